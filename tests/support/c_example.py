"""Builds and imports tests/c_api_example/example.c: an extension that uses cai_dlpack's C API."""
import importlib.util
import os
import subprocess
import sysconfig
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, os.pardir, os.pardir))


def build():
    import tvm_ffi.libinfo  # the same dlpack.h the package is built with

    directory = tempfile.mkdtemp(prefix="cai_dlpack_example_")
    target = os.path.join(directory, "cai_dlpack_example" + sysconfig.get_config_var("EXT_SUFFIX"))
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    command = [compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-I", sysconfig.get_paths()["include"],
               "-I", os.path.join(ROOT, "include"), "-I", tvm_ffi.libinfo.find_dlpack_include_path(),
               os.path.join(ROOT, "tests", "c_api_example", "example.c"), "-o", target]
    subprocess.run(command, check=True)
    spec = importlib.util.spec_from_file_location("cai_dlpack_example", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
