"""Our declarations of the DLPack ABI (include/cai_dlpack/dlpack_abi.h) against an upstream dlpack.h: the
same sizes, alignments, field offsets, enum values and flag bits, and a version no newer than upstream's. And
the public header together with an upstream dlpack.h, included in either order, in C and C++.

Our header is at DLPack 1.4. No package that pip can install here (PyPI) ships a 1.4 dlpack.h yet (the newest
apache-tvm-ffi, 0.1.15.post2, bundles 1.3; cupy-cuda13x 14.2.0 bundles 1.0; torch's ATen/dlpack.h and cuda-core's
are older still), so the facts of DLPack 1.4 that our header adds are recorded here as data (values only): the
four new enum values, the version, and the layout of every struct on a 64-bit Linux ABI (1.4 changed no layout,
so it is the layout of 1.3, which the installed upstream header checks too where there is one)."""
import os
import shutil
import subprocess
import sysconfig

import pytest

import cai_dlpack

STRUCTS = {
    "DLPackVersion": ["major", "minor"],
    "DLDevice": ["device_type", "device_id"],
    "DLDataType": ["code", "bits", "lanes"],
    "DLTensor": ["data", "device", "ndim", "dtype", "shape", "strides", "byte_offset"],
    "DLManagedTensor": ["dl_tensor", "manager_ctx", "deleter"],
    "DLManagedTensorVersioned": ["version", "manager_ctx", "deleter", "flags", "dl_tensor"],
    "DLPackExchangeAPIHeader": ["version", "prev_api"],
    "DLPackExchangeAPI": ["header", "managed_tensor_allocator", "managed_tensor_from_py_object_no_sync",
                          "managed_tensor_to_py_object_no_sync", "dltensor_from_py_object_no_sync",
                          "current_work_stream"],
}
SCALARS = ["DLDeviceType", "DLDataTypeCode", "DLPackManagedTensorAllocator", "DLPackCurrentWorkStream"]
CONSTANTS = [
    "kDLCPU", "kDLCUDA", "kDLCUDAHost", "kDLOpenCL", "kDLVulkan", "kDLMetal", "kDLVPI", "kDLROCM", "kDLROCMHost",
    "kDLExtDev", "kDLCUDAManaged", "kDLOneAPI", "kDLWebGPU", "kDLHexagon", "kDLMAIA", "kDLTrn",
    "kDLInt", "kDLUInt", "kDLFloat", "kDLOpaqueHandle", "kDLBfloat", "kDLComplex", "kDLBool",
    "kDLFloat8_e3m4", "kDLFloat8_e4m3", "kDLFloat8_e4m3b11fnuz", "kDLFloat8_e4m3fn", "kDLFloat8_e4m3fnuz",
    "kDLFloat8_e5m2", "kDLFloat8_e5m2fnuz", "kDLFloat8_e8m0fnu", "kDLFloat6_e2m3fn", "kDLFloat6_e3m2fn",
    "kDLFloat4_e2m1fn",
    "DLPACK_FLAG_BITMASK_READ_ONLY", "DLPACK_FLAG_BITMASK_IS_COPIED", "DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED",
]


# DLPack 1.4's additions (dmlc/dlpack v1.4, include/dlpack/dlpack.h): the values an upstream header older than
# 1.4 cannot be asked for, so they are compared with this data, and with an upstream header only where it is 1.4.
DLPACK_1_4 = {"version": "1.4", "value kDLTPU": "19", "value kDLTPUHost": "20", "value kDLAscend": "21",
              "value kDLBcomplex": "18"}
ADDED_IN_1_4 = ["kDLTPU", "kDLTPUHost", "kDLAscend", "kDLBcomplex"]
# The layout of DLPack 1.4 (unchanged since 1.3, as the 1.4 release says) on a 64-bit Linux ABI (LP64: x86_64,
# aarch64): {struct: (size, alignment, [offset of each field in STRUCTS' order])}, and the sizes of the scalars.
LP64_LAYOUT = {
    "DLPackVersion": (8, 4, [0, 4]),
    "DLDevice": (8, 4, [0, 4]),
    "DLDataType": (4, 2, [0, 1, 2]),
    "DLTensor": (48, 8, [0, 8, 16, 20, 24, 32, 40]),
    "DLManagedTensor": (64, 8, [0, 48, 56]),
    "DLManagedTensorVersioned": (80, 8, [0, 8, 16, 24, 32]),
    "DLPackExchangeAPIHeader": (16, 8, [0, 8]),
    "DLPackExchangeAPI": (56, 8, [0, 16, 24, 32, 40, 48]),
}
LP64_SCALARS = {"DLDeviceType": 4, "DLDataTypeCode": 4, "DLPackManagedTensorAllocator": 8,
                "DLPackCurrentWorkStream": 8}


def compiler():
    name = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(name) or shutil.which("cc")


def upstream_include():
    """The folder of an installed upstream dlpack/dlpack.h, or None."""
    try:
        import tvm_ffi.libinfo
        folder = tvm_ffi.libinfo.find_dlpack_include_path()
    except (ImportError, RuntimeError, AttributeError):
        return None
    return folder if os.path.exists(os.path.join(folder, "dlpack", "dlpack.h")) else None


needs_cc = pytest.mark.skipif(compiler() is None, reason="no C compiler (sysconfig's CC, or cc) on PATH")
needs_upstream = pytest.mark.skipif(
    upstream_include() is None,
    reason="no upstream dlpack/dlpack.h installed (apache-tvm-ffi brings one; it has no wheel for free-threaded "
           "CPython)")


def printer_source():
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#ifdef UPSTREAM", "#include <dlpack/dlpack.h>", "#else",
             "#include <cai_dlpack/dlpack_abi.h>", "#endif", "int main(void) {",
             'printf("version %d.%d\\n", DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION);']
    for struct, fields in STRUCTS.items():
        lines.append(f'printf("sizeof {struct} %zu align %zu\\n", sizeof({struct}), _Alignof({struct}));')
        lines += [f'printf("offsetof {struct}.{field} %zu\\n", offsetof({struct}, {field}));' for field in fields]
    lines += [f'printf("sizeof {name} %zu\\n", sizeof({name}));' for name in SCALARS]
    lines += [f'printf("value {name} %llu\\n", (unsigned long long)({name}));' for name in CONSTANTS]
    # An upstream header older than 1.4 has no such names.
    lines.append("#if DLPACK_MAJOR_VERSION > 1 || DLPACK_MINOR_VERSION >= 4")
    lines += [f'printf("value {name} %llu\\n", (unsigned long long)({name}));' for name in ADDED_IN_1_4]
    lines += ["#endif", "return 0;", "}"]
    return "\n".join(lines) + "\n"


def run_printer(tmp_path, name, flags):
    source = tmp_path / "printer.c"
    source.write_text(printer_source())
    program = tmp_path / name
    subprocess.run([compiler(), "-std=c11", "-Wall", "-Werror", *flags, str(source), "-o", str(program)],
                   check=True, capture_output=True, text=True)
    return dict(line.rsplit(" ", 1) for line in subprocess.run(
        [str(program)], check=True, capture_output=True, text=True).stdout.splitlines())


@needs_cc
@needs_upstream
def test_our_declarations_match_an_upstream_dlpack_header(tmp_path):
    ours = run_printer(tmp_path, "ours", ["-I", cai_dlpack.get_include()])
    theirs = run_printer(tmp_path, "theirs", ["-DUPSTREAM", "-I", upstream_include()])
    version, their_version = ours.pop("version"), theirs.pop("version")
    assert len(ours) == sum(len(f) + 1 for f in STRUCTS.values()) + len(SCALARS) + len(CONSTANTS) + len(ADDED_IN_1_4)
    # Everything upstream declares, ours declares the same (an upstream older than 1.4 lacks 1.4's values).
    assert {key: ours[key] for key in theirs} == theirs
    (major, minor), (their_major, their_minor) = (tuple(map(int, v.split("."))) for v in (version, their_version))
    assert major == their_major == 1 and minor >= 2 and their_minor >= 2
    if their_minor < 4:
        assert set(ours) - set(theirs) == {f"value {name}" for name in ADDED_IN_1_4}


@needs_cc
def test_our_declarations_are_dlpack_1_4(tmp_path):
    """The version, 1.4's four new enum values, and every size, alignment and offset of DLPack 1.4 on LP64."""
    ours = run_printer(tmp_path, "ours", ["-I", cai_dlpack.get_include()])
    assert {key: ours[key] for key in DLPACK_1_4} == DLPACK_1_4
    assert cai_dlpack.DLPACK_VERSION == (1, 4)
    if sysconfig.get_config_var("SIZEOF_VOID_P") != 8:
        pytest.skip("the recorded layout is the 64-bit one")
    for struct, (size, alignment, offsets) in LP64_LAYOUT.items():
        assert ours[f"sizeof {struct} {size} align"] == str(alignment), struct
        assert [int(ours[f"offsetof {struct}.{field}"]) for field in STRUCTS[struct]] == offsets, struct
    assert {name: int(ours[f"sizeof {name}"]) for name in LP64_SCALARS} == LP64_SCALARS


MIXED = """#include <Python.h>
{first}
{second}
int cai_dlpack_mixed_check(DLManagedTensorVersioned *m, const DLPackExchangeAPI *api);
int cai_dlpack_mixed_check(DLManagedTensorVersioned *m, const DLPackExchangeAPI *api)
{{
    return (int)m->dl_tensor.ndim + (int)api->header.version.major + (int)kDLCUDAManaged +
           (int)DLPACK_MAJOR_VERSION;
}}
"""
OURS, THEIRS = "#include <cai_dlpack/cai_dlpack.h>", "#include <dlpack/dlpack.h>"


def compile_unit(tmp_path, text, language, include_dirs):
    suffix, tool = (".c", compiler()) if language == "c" else (".cpp", shutil.which("c++"))
    if tool is None:
        pytest.skip("no C++ compiler (c++) on PATH")
    source = tmp_path / ("unit" + suffix)
    source.write_text(text)
    flags = [f"-I{d}" for d in (sysconfig.get_paths()["include"], *include_dirs)]
    return subprocess.run([tool, "-fsyntax-only", "-Wall", "-Wextra", "-Werror", *flags, str(source)],
                          capture_output=True, text=True)


@needs_cc
@needs_upstream
@pytest.mark.parametrize("language", ["c", "c++"])
@pytest.mark.parametrize("first, second", [(OURS, THEIRS), (THEIRS, OURS)], ids=["ours-first", "upstream-first"])
def test_the_public_header_with_an_upstream_dlpack_header_in_either_order(tmp_path, language, first, second):
    result = compile_unit(tmp_path, MIXED.format(first=first, second=second), language,
                          [cai_dlpack.get_include(), upstream_include()])
    assert result.returncode == 0, result.stderr


@needs_cc
@pytest.mark.parametrize("how", ["included first", "CAI_DLPACK_UPSTREAM_DLPACK"])
def test_an_upstream_dlpack_header_older_than_1_2_is_refused_by_the_public_header(tmp_path, how):
    old = tmp_path / "old" / "dlpack"
    old.mkdir(parents=True)
    (old / "dlpack.h").write_text("#ifndef DLPACK_DLPACK_H_\n#define DLPACK_DLPACK_H_\n#define DLPACK_MAJOR_VERSION 1\n"
                                  "#define DLPACK_MINOR_VERSION 1\n#endif\n")
    first = THEIRS if how == "included first" else "#define CAI_DLPACK_UPSTREAM_DLPACK 1"
    result = compile_unit(tmp_path, f"#include <Python.h>\n{first}\n{OURS}\n", "c",
                          [cai_dlpack.get_include(), tmp_path / "old"])
    assert result.returncode != 0
    assert "cai_dlpack needs dlpack/dlpack.h of DLPack 1.2 or newer" in result.stderr


@needs_cc
def test_the_public_header_alone_declares_everything_its_api_uses(tmp_path):
    """No dlpack/dlpack.h anywhere on the include path: the installed package's folder is enough."""
    assert not os.path.exists(os.path.join(cai_dlpack.get_include(), "dlpack"))
    result = compile_unit(tmp_path, MIXED.format(first=OURS, second=""), "c", [cai_dlpack.get_include()])
    assert result.returncode == 0, result.stderr
