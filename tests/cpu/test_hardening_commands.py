"""The README's hardening scripts say in one line what a machine lacks and how to get it, the sanitized run
refuses to test any build but its own, and the libFuzzer targets still compile against the core they are
built with (they are compiled only by tests/fuzz/run.sh)."""
import os
import shutil
import subprocess
import sys
import sysconfig

import cai_dlpack._core

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FUZZ_SCRIPT = os.path.join("tests", "fuzz", "run.sh")
SANITIZED_SCRIPT = os.path.join("tests", "run_sanitized.sh")

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(ROOT, FUZZ_SCRIPT)),
                                reason="needs the source tree's scripts (these tests were copied out of it)")


def run_without(tmp_path, script, *arguments):
    """Runs script with a PATH that holds only dirname (which the scripts use to find the repository): no
    compiler, no cmake, no python."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    return subprocess.run([shutil.which("bash"), script, *arguments], env={"PATH": str(bin_dir)}, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_the_fuzz_script_names_the_missing_clang_and_its_packages(tmp_path):
    result = run_without(tmp_path, FUZZ_SCRIPT, "10")
    assert result.returncode != 0 and result.stdout == ""
    debian = "clang-14 libclang-rt-14-dev"
    assert result.stderr == f"{FUZZ_SCRIPT}: needs clang with libFuzzer (Debian: apt-get install {debian})\n"
    with open(os.path.join(ROOT, "README.md")) as readme:
        assert f"Debian: `{debian}`" in readme.read()  # the packages the README names


def test_the_sanitized_script_names_the_missing_gcc(tmp_path):
    result = run_without(tmp_path, SANITIZED_SCRIPT)
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr == f"{SANITIZED_SCRIPT}: needs gcc with its sanitizer runtimes (Debian: apt-get install gcc)\n"


def run_suite_expecting(build):
    """A short CPU run told, as tests/run_sanitized.sh tells it, which build it must have imported."""
    env = dict(os.environ, CAI_DLPACK_EXPECTED_BUILD=str(build))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.join("tests", "cpu", "test_dlpack_abi.py")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_sanitized_run_fails_when_it_imported_another_build(tmp_path):
    """An editable install's import hook wins over the script's PYTHONPATH: the suite would test the plain
    module and pass. Here the build named is an empty folder, so whatever was imported is another one."""
    result = run_suite_expecting(tmp_path)
    loaded = os.path.realpath(cai_dlpack._core.__file__)
    assert result.returncode != 0
    assert f"this run imported cai_dlpack._core from {loaded}, not from the build under test in {tmp_path}" in result.stdout


def test_the_sanitized_run_fails_on_a_build_without_sanitizers():
    loaded = os.path.realpath(cai_dlpack._core.__file__)
    with open(loaded, "rb") as module:
        if b"__asan_init" in module.read():
            pytest.skip("this suite runs on the sanitized build itself")
    result = run_suite_expecting(os.path.dirname(loaded))
    assert result.returncode != 0
    assert f"cai_dlpack._core at {loaded} is not built with AddressSanitizer and UBSan" in result.stdout


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc)")
@pytest.mark.parametrize("target", ["fuzz_interface.c", "fuzz_doors.c"])
def test_the_libfuzzer_target_compiles_against_the_current_core(target):
    command = ["cc", "-fsyntax-only", "-Wall", "-Werror=implicit-function-declaration",
               "-DCDL_CUDART_HEADER_MAJOR=13", "-I", "csrc", "-I", "include",
               "-I", sysconfig.get_paths()["include"],
               os.path.join("tests", "fuzz", target)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
