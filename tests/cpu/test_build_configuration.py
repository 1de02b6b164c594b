"""The build's own checks: configure fails with a clear message when dlpack.h is missing or too old."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
cmake = shutil.which("cmake")


def configure(tmp_path, dlpack_dir):
    result = subprocess.run(
        [cmake, "-S", ROOT, "-B", str(tmp_path / "build"), f"-DDLPACK_INCLUDE_DIR={dlpack_dir}",
         f"-DPython_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True, timeout=300)
    return result.returncode, " ".join((result.stdout + result.stderr).split())  # CMake wraps its messages


@pytest.mark.skipif(cmake is None, reason="cmake is not on PATH")
def test_missing_dlpack_header(tmp_path):
    code, output = configure(tmp_path, tmp_path / "nowhere")
    assert code != 0
    assert "dlpack/dlpack.h not found" in output and "apache-tvm-ffi" in output


@pytest.mark.skipif(cmake is None, reason="cmake is not on PATH")
def test_dlpack_header_older_than_1_1(tmp_path):
    header = tmp_path / "old" / "dlpack"
    header.mkdir(parents=True)
    (header / "dlpack.h").write_text("#define DLPACK_MAJOR_VERSION 0\n#define DLPACK_MINOR_VERSION 8\n")
    code, output = configure(tmp_path, tmp_path / "old")
    assert code != 0
    assert "is version '0.8'; cai_dlpack needs 1.1 or newer" in output
