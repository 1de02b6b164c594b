"""Builds and imports the tests' C extensions the way a user's extension is built: against the installed
package (cai_dlpack.get_include() and Python's headers), never against this source tree.
tests/c_api_example/example.c uses cai_dlpack's C API; tests/exchange_producer/producer.c is a producer
that publishes the DLPack C exchange API; tests/buffer_exporter/exporter.c exports a buffer in any format."""
import atexit
import importlib.util
import os
import shutil
import subprocess
import sysconfig
import tempfile

import cai_dlpack

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, os.pardir, "c_api_example", "example.c")
PRODUCER = os.path.join(HERE, os.pardir, "exchange_producer", "producer.c")
EXPORTER = os.path.join(HERE, os.pardir, "buffer_exporter", "exporter.c")


def build(source=SOURCE, name="cai_dlpack_example"):
    directory = tempfile.mkdtemp(prefix=name + "_")
    # (the loaded library stays mapped once its file is gone; child processes load it during the session)
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    target = os.path.join(directory, name + sysconfig.get_config_var("EXT_SUFFIX"))
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    command = [compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-I", sysconfig.get_paths()["include"],
               "-I", cai_dlpack.get_include(), source, "-o", target]
    subprocess.run(command, check=True)
    spec = importlib.util.spec_from_file_location(name, target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_producer():
    return build(PRODUCER, "exchange_producer")


def build_buffer_exporter():
    return build(EXPORTER, "buffer_exporter")
