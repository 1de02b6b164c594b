"""The build's own checks: configure uses our own DLPack declarations by default, and fails with a clear
message when the upstream dlpack.h it is pointed at is missing or older than 1.2; link-time optimization is on
where the toolchain takes it, off where asked, and does not hide the warnings -Werror turns into errors."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
cmake = shutil.which("cmake")


# The build requirements (the CUDA Runtime API header wheels) come from this interpreter, or from the folder
# CAI_DLPACK_TEST_BUILD_DEPS names (pip install --target DIR nvidia-cuda-runtime nvidia-cuda-crt: CI's main stage
# makes one); else the tests that build are skipped. An ASan runtime preloaded into this interpreter is not passed on
# to cmake and the compiler.
BUILD_ENVIRONMENT = {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"}
if os.environ.get("CAI_DLPACK_TEST_BUILD_DEPS"):
    BUILD_ENVIRONMENT["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.environ["CAI_DLPACK_TEST_BUILD_DEPS"], os.environ.get("PYTHONPATH")]))


def configure(tmp_path, dlpack_dir, *options, source=ROOT):
    result = subprocess.run(
        [cmake, "-S", str(source), "-B", str(tmp_path / "build"), f"-DDLPACK_INCLUDE_DIR={dlpack_dir or ''}",
         f"-DPython_EXECUTABLE={sys.executable}", *options],
        capture_output=True, text=True, timeout=300, env=BUILD_ENVIRONMENT)
    return result.returncode, " ".join((result.stdout + result.stderr).split())  # CMake wraps its messages


def configured_or_skip(tmp_path, *options, source=ROOT, dlpack_dir=None):
    code, output = configure(tmp_path, dlpack_dir, *options, source=source)
    if "CUDA Runtime API headers not found" in output:
        pytest.skip("the CUDA Runtime API header wheels (nvidia-cuda-runtime, nvidia-cuda-crt) are not installed")
    assert code == 0, output
    return output


@pytest.mark.skipif(cmake is None, reason="cmake is not on PATH")
def test_no_package_is_needed_for_dlpack_h(tmp_path):
    output = configured_or_skip(tmp_path)
    assert "DLPack 1.4 from cai_dlpack's own declarations (include/cai_dlpack/dlpack_abi.h)" in output


@pytest.mark.skipif(cmake is None, reason="cmake is not on PATH")
def test_missing_dlpack_header(tmp_path):
    code, output = configure(tmp_path, tmp_path / "nowhere")
    assert code != 0
    assert "dlpack/dlpack.h not found in DLPACK_INCLUDE_DIR=" in output
    assert "leave DLPACK_INCLUDE_DIR unset to build with cai_dlpack's own DLPack declarations" in output


@pytest.mark.skipif(cmake is None, reason="cmake is not on PATH")
@pytest.mark.parametrize("major, minor", [(0, 8), (1, 1), (2, 0)])
def test_dlpack_header_not_1_2_or_newer_of_major_1(tmp_path, major, minor):
    header = tmp_path / "old" / "dlpack"
    header.mkdir(parents=True)
    (header / "dlpack.h").write_text(f"#define DLPACK_MAJOR_VERSION {major}\n#define DLPACK_MINOR_VERSION {minor}\n")
    code, output = configure(tmp_path, tmp_path / "old")
    assert code != 0
    assert f"is DLPack version '{major}.{minor}'; cai_dlpack needs 1.2 or newer (1.x)" in output


@pytest.mark.skipif(cmake is None, reason="cmake is not on PATH")
def test_an_upstream_dlpack_header_is_used_when_named(tmp_path):
    header = tmp_path / "new" / "dlpack"
    header.mkdir(parents=True)
    (header / "dlpack.h").write_text("#define DLPACK_MAJOR_VERSION 1\n#define DLPACK_MINOR_VERSION 2\n")
    output = configured_or_skip(tmp_path, dlpack_dir=tmp_path / "new")
    assert f"DLPack 1.2 from {tmp_path / 'new'}" in output


@pytest.mark.skipif(cmake is None, reason="cmake is not on PATH")
@pytest.mark.parametrize("options, on", [
    ((), True),
    (("-DCAI_DLPACK_LTO=OFF",), False),
    (("-DCMAKE_INTERPROCEDURAL_OPTIMIZATION=OFF",), False),  # CMake's own switch, as packagers set it
    (("-DCAI_DLPACK_SANITIZE=ON",), False),
    (("-DCAI_DLPACK_TSAN=ON",), False),
    (("-DCMAKE_INTERPROCEDURAL_OPTIMIZATION=ON",), True),
    (("-DCMAKE_INTERPROCEDURAL_OPTIMIZATION=ON", "-DCAI_DLPACK_LTO=OFF"), False),  # ours says off: off it is
    (("-DCMAKE_INTERPROCEDURAL_OPTIMIZATION=ON", "-DCAI_DLPACK_SANITIZE=ON"), False),
])
def test_link_time_optimization_is_on_unless_turned_off(tmp_path, options, on):
    output = configured_or_skip(tmp_path, "-DCMAKE_BUILD_TYPE=Release", *options)
    if on and "Link-time optimization: off, the toolchain refused it" in output:
        pytest.skip("this toolchain does not take link-time optimization")
    assert ("Link-time optimization: on" in output) == on, output
    assert "Link-time optimization: off" in output or on, output
    # What the build runs says the same: the compile and link commands (Unix Makefiles' flags and link files, or
    # Ninja's one file).
    commands = " ".join(path.read_text() for path in (tmp_path / "build").rglob("*")
                        if path.name in ("flags.make", "link.txt", "build.ninja"))
    assert commands, "no compile flags or link command found in the build folder"
    assert ("-flto" in commands) == on, commands


# A read of a variable one path leaves unset: an error under -Werror. gcc finds it by its flow analysis, which
# runs where the code is made: at the link when link-time optimization is on, so that must warn too.
UNSET_KIND = ("    *kind = text[1];\n", "    if (length == 3)\n        *kind = text[1];\n")


@pytest.mark.skipif(cmake is None, reason="cmake is not on PATH")
def test_werror_fails_a_read_of_an_unset_variable_under_lto(tmp_path):
    """Without LTO the compile reports it, as every build did before LTO (the sanitizer builds still do)."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns("build", ".venv", ".git", "*.so", "__pycache__"))
    dtype_c = source / "csrc" / "dtype.c"
    text = dtype_c.read_text()
    assert text.count(UNSET_KIND[0]) == 1, "dtype.c no longer sets *kind as this test expects: update the test"
    dtype_c.write_text(text.replace(*UNSET_KIND))
    output = configured_or_skip(tmp_path, "-DCMAKE_BUILD_TYPE=Release", "-DCAI_DLPACK_WERROR=ON",
                                source=source)
    if "Link-time optimization: on" not in output:
        pytest.skip("this toolchain does not take link-time optimization")
    compiler = re.search(r"The C compiler identification is (\w+)", output)
    if compiler is None or compiler.group(1) != "GNU":
        pytest.skip("the test's unset read is one gcc's flow analysis reports; this compiler is not gcc")
    built = subprocess.run([cmake, "--build", str(tmp_path / "build"), "--parallel", str(os.cpu_count() or 1)],
                           capture_output=True, text=True,
                           timeout=600, env=BUILD_ENVIRONMENT)
    assert built.returncode != 0, built.stdout[-2000:]
    assert "kind" in built.stdout + built.stderr and "uninitialized" in built.stdout + built.stderr, \
        (built.stdout + built.stderr)[-2000:]
