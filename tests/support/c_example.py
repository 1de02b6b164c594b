"""Builds and imports tests/c_api_example/example.c, an extension that uses cai_dlpack's C API, the way a
user's extension is built: against the installed package (cai_dlpack.get_include() and Python's headers),
never against this source tree."""
import importlib.util
import os
import subprocess
import sysconfig
import tempfile

import cai_dlpack

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, os.pardir, "c_api_example", "example.c")


def build():
    directory = tempfile.mkdtemp(prefix="cai_dlpack_example_")
    target = os.path.join(directory, "cai_dlpack_example" + sysconfig.get_config_var("EXT_SUFFIX"))
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    command = [compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-I", sysconfig.get_paths()["include"],
               "-I", cai_dlpack.get_include(), SOURCE, "-o", target]
    subprocess.run(command, check=True)
    spec = importlib.util.spec_from_file_location("cai_dlpack_example", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
