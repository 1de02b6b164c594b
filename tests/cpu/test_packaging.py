"""The package as a user installs it: one version everywhere, the C API's headers inside the package (an
extension built against cai_dlpack.get_include() alone works), and a self-check that shows a zero-copy
round trip with nothing but the standard library. Needs no NumPy or PyTorch."""
import array
import importlib.metadata
import os
import re
import subprocess
import sys

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
    assert cai_dlpack.__version__ == importlib.metadata.version("cai-dlpack")
    source = os.path.join(SOURCE_TREE, "python", "cai_dlpack", "__init__.py")
    if os.path.exists(source):  # the file the build reads the version from
        with open(source) as file:
            assert f'__version__ = "{cai_dlpack.__version__}"' in file.read()


def test_the_headers_ship_inside_the_package():
    include = cai_dlpack.get_include()
    assert os.path.dirname(include) == PACKAGE
    with open(os.path.join(include, "dlpack", "dlpack.h")) as file:
        dlpack_header = file.read()
    major = re.search(r"^#define DLPACK_MAJOR_VERSION (\d+)", dlpack_header, re.MULTILINE).group(1)
    minor = re.search(r"^#define DLPACK_MINOR_VERSION (\d+)", dlpack_header, re.MULTILINE).group(1)
    assert (int(major), int(minor)) == cai_dlpack.DLPACK_VERSION  # the header the module was built with
    with open(os.path.join(include, "cai_dlpack", "cai_dlpack.h"), "rb") as file:
        installed = file.read()
    source = os.path.join(SOURCE_TREE, "include", "cai_dlpack", "cai_dlpack.h")
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
