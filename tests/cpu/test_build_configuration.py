"""The build's own checks: configure uses our own DLPack declarations by default, and fails with a clear
message when the upstream dlpack.h it is pointed at is missing or older than 1.2."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
cmake = shutil.which("cmake")


def configure(tmp_path, dlpack_dir):
    result = subprocess.run(
        [cmake, "-S", ROOT, "-B", str(tmp_path / "build"), f"-DDLPACK_INCLUDE_DIR={dlpack_dir or ''}",
         f"-DPython_EXECUTABLE={sys.executable}"],
        capture_output=True, text=True, timeout=300)
    return result.returncode, " ".join((result.stdout + result.stderr).split())  # CMake wraps its messages


@pytest.mark.skipif(cmake is None, reason="cmake is not on PATH")
def test_no_package_is_needed_for_dlpack_h(tmp_path):
    code, output = configure(tmp_path, None)
    if "CUDA Runtime API headers not found" in output:
        pytest.skip("the CUDA Runtime API header wheels (nvidia-cuda-runtime, nvidia-cuda-crt) are not installed")
    assert code == 0, output
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
    code, output = configure(tmp_path, tmp_path / "new")
    if "CUDA Runtime API headers not found" in output:
        pytest.skip("the CUDA Runtime API header wheels (nvidia-cuda-runtime, nvidia-cuda-crt) are not installed")
    assert code == 0, output
    assert f"DLPack 1.2 from {tmp_path / 'new'}" in output
