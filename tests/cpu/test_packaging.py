"""The package as a user installs it: one version everywhere, the C API's headers inside the package (an
extension built against cai_dlpack.get_include() alone works), and a self-check that shows a zero-copy
round trip with nothing but the standard library. Needs no NumPy or PyTorch."""
import array
import importlib.metadata
import os
import importlib.util
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

import cai_dlpack
from support import c_example

PACKAGE = os.path.dirname(os.path.abspath(cai_dlpack.__file__))
SOURCE_TREE = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
FRAMEWORKS = ("numpy", "torch", "cupy", "numba", "jax")


class HostArray:
    def __init__(self, values):
        self.memory = array.array("d", values)
        address, length = self.memory.buffer_info()
        self.__array_interface__ = {"shape": (length,), "typestr": "<f8", "data": (address, False), "version": 3}


def test_one_version():
    distribution = importlib.metadata.distribution("cai-dlpack")
    installed = os.path.abspath(distribution.locate_file(os.path.join("cai_dlpack", "__init__.py")))
    if installed != os.path.join(PACKAGE, "__init__.py"):
        pytest.skip("this cai_dlpack was not installed by pip (tests/run_sanitized.sh lays out its own)")
    assert cai_dlpack.__version__ == distribution.version
    source = os.path.join(SOURCE_TREE, "python", "cai_dlpack", "__init__.py")
    if os.path.exists(source):  # the file the build reads the version from
        with open(source) as file:
            assert f'__version__ = "{cai_dlpack.__version__}"' in file.read()


def test_the_headers_ship_inside_the_package():
    include = cai_dlpack.get_include()
    assert os.path.dirname(include) == PACKAGE
    assert sorted(os.listdir(include)) == ["cai_dlpack"]  # no dlpack/dlpack.h: the DLPack types are declared by us
    with open(os.path.join(include, "cai_dlpack", "dlpack_abi.h")) as file:
        dlpack_header = file.read()
    major = re.search(r"^#define DLPACK_MAJOR_VERSION (\d+)", dlpack_header, re.MULTILINE).group(1)
    minor = re.search(r"^#define DLPACK_MINOR_VERSION (\d+)", dlpack_header, re.MULTILINE).group(1)
    assert (int(major), int(minor)) == cai_dlpack.DLPACK_VERSION  # the declarations the module was built with
    for name in ("cai_dlpack.h", "dlpack_abi.h"):
        with open(os.path.join(include, "cai_dlpack", name), "rb") as file:
            installed = file.read()
        source = os.path.join(SOURCE_TREE, "include", "cai_dlpack", name)
        if os.path.exists(source):
            with open(source, "rb") as file:
                assert installed == file.read()


def test_an_extension_built_against_the_installed_package():
    example = c_example.build()  # include path: Python's and cai_dlpack.get_include(), nothing else
    host = HostArray([0.5, 1.5, 2.5, 4.0])
    fields = example.fill(host, -1)
    assert fields["data"] == host.memory.buffer_info()[0]
    assert fields["shape"] == (4,) and fields["dtype"] == (2, 64, 1) and fields["device"] == (1, 0)
    assert example.sum_float64(host) == 8.5
    assert example.managed(host, -1)["data"] == host.memory.buffer_info()[0]


# The README's CMake lines, for a C++ extension; the test adds only the project line and warnings as errors.
CMAKE_LISTS = """cmake_minimum_required(VERSION 3.19)
project(cxx_example LANGUAGES CXX)
find_package(Python REQUIRED COMPONENTS Interpreter Development.Module)
execute_process(COMMAND "${Python_EXECUTABLE}" -c "import cai_dlpack; print(cai_dlpack.get_include())"
                OUTPUT_VARIABLE CAI_DLPACK_INCLUDE OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)
Python_add_library(cxx_example MODULE WITH_SOABI cxx_example.cpp)
target_include_directories(cxx_example PRIVATE "${CAI_DLPACK_INCLUDE}")
target_compile_options(cxx_example PRIVATE -Wall -Wextra -Werror)
"""
CXX_SOURCE = r"""
#include <Python.h>
#include <cai_dlpack/cai_dlpack.h>

static const cai_dlpack_api *api;

// (data address, ndim, first dimension) of any array cai_dlpack accepts.
static PyObject *describe(PyObject *, PyObject *obj)
{
    DLTensor tensor;
    int64_t shape[CAI_DLPACK_MAX_NDIM], strides[CAI_DLPACK_MAX_NDIM];
    int read_only = 0;
    if (api->fill_tensor(obj, -1, &tensor, shape, strides, CAI_DLPACK_MAX_NDIM, &read_only) < 0)
        return nullptr;
    return Py_BuildValue("(KiL)", (unsigned long long)(uintptr_t)tensor.data, tensor.ndim,
                         (long long)(tensor.ndim ? tensor.shape[0] : 0));
}

static PyMethodDef methods[] = {{"describe", describe, METH_O, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef definition = {PyModuleDef_HEAD_INIT, "cxx_example", nullptr, -1, methods,
                                 nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit_cxx_example(void)
{
    api = cai_dlpack_import();
    PyObject *module = api ? PyModule_Create(&definition) : nullptr;
#ifdef Py_GIL_DISABLED
    if (module != nullptr && PyUnstable_Module_SetGIL(module, Py_MOD_GIL_NOT_USED) < 0) {
        Py_DECREF(module);
        return nullptr;
    }
#endif
    return module;
}
"""


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("c++") is None, reason="needs cmake and c++")
def test_a_cxx_extension_built_with_the_readme_cmake_lines(tmp_path):
    (tmp_path / "CMakeLists.txt").write_text(CMAKE_LISTS)
    (tmp_path / "cxx_example.cpp").write_text(CXX_SOURCE)
    build = tmp_path / "build"
    cmake = shutil.which("cmake")
    for command in ([cmake, "-S", str(tmp_path), "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}"],
                    [cmake, "--build", str(build)]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
    [library] = build.glob("cxx_example*" + sysconfig.get_config_var("EXT_SUFFIX"))
    spec = importlib.util.spec_from_file_location("cxx_example", library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    host = HostArray([1.0, 2.0, 3.0])
    assert module.describe(host) == (host.memory.buffer_info()[0], 1, 3)
    with pytest.raises(TypeError, match="neither __cuda_array_interface__ nor __array_interface__"):
        module.describe(object())


def test_the_self_check_without_any_framework(tmp_path):
    blocked = "import runpy, sys\n" \
              f"for name in {FRAMEWORKS!r}:\n" \
              "    sys.modules[name] = None  # import fails as if not installed\n" \
              "runpy.run_module('cai_dlpack', run_name='__main__')\n"
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)  # cwd: the installed package, not a source tree's python/
    output = result.stdout
    assert result.returncode == 0, output + result.stderr
    for name in FRAMEWORKS:
        assert re.search(rf"^  {name} +not installed$", output, re.MULTILINE), output
    addresses = re.findall(r" at (0x[0-9a-f]+): ", output)
    assert len(addresses) == 3 and len(set(addresses)) == 1, output  # array.array, DLPackView, memoryview
    values = re.findall(r" at 0x[0-9a-f]+: (\[[^]]*\])$", output, re.MULTILINE)
    assert values == ["[0.5, 1.5, 2.5, 3.5]"] * 2, output
    assert "memoryview[0] = 42.0, and the array.array reads 42.0" in output
    assert "same address, same values: zero-copy" in output
    assert "| array.array -> cai2dlpack -> dlpack2cai -> memoryview | yes" in output
    assert "OK: 1 conversion shared memory" in output
