"""`python -m cai_dlpack`: every row's verdict comes from what its conversion returned, a conversion that
copies is reported (and not counted as sharing memory), and the runtime line says which libcudart it is."""
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import cai_dlpack.__main__ as self_check
from cai_dlpack import DLPackShim, cai2dlpack, dlpack2cai
from support import optional

ROW = re.compile(r"^\| (.+?) +\| (yes|NO: .+?) +\| +[\d,]+ \|$", re.MULTILINE)


def run_self_check(capsys):
    status = self_check.main()
    out = capsys.readouterr().out
    return status, out, dict(ROW.findall(out))


def test_every_row_is_checked_and_counted(capsys):
    status, out, verdicts = run_self_check(capsys)
    assert status == 0, out
    expected = {"array.array -> cai2dlpack -> dlpack2cai -> memoryview", "numpy -> DLPackShim -> numpy.from_dlpack",
                "cai2dlpack(numpy array)"}
    if optional.torch is not None:  # its rows are shown where torch is installed
        expected |= {"numpy -> DLPackShim -> torch.from_dlpack", "torch -> dlpack2cai -> numpy.asarray"}
    assert set(verdicts) == expected, out
    assert set(verdicts.values()) == {"yes"}, out
    assert f"OK: {len(verdicts)} conversions shared memory" in out
    assert '  python3 -m pip install ".[bench]" && python3 benchmarks/run_all.py\n' in out
    assert "A rough check, not a measurement" in out


def copy_numpy_arrays(obj, **kwargs):
    return cai2dlpack(obj.copy() if isinstance(obj, np.ndarray) else obj, **kwargs)


def copy_host_arrays(obj, **kwargs):
    return cai2dlpack(np.array(obj) if isinstance(obj, self_check.HostArray) else obj, **kwargs)


def shim_of_a_copy(obj, **kwargs):
    return DLPackShim(np.array(obj), **kwargs)


def view_of_a_copy(x, **kwargs):
    return dlpack2cai(DLPackShim(np.array(dlpack2cai(x, **kwargs))))


@pytest.mark.parametrize("name, copying, broken", [
    ("cai2dlpack", copy_numpy_arrays, {"cai2dlpack(numpy array)"}),
    ("cai2dlpack", copy_host_arrays, {"array.array -> cai2dlpack -> dlpack2cai -> memoryview"}),
    ("DLPackShim", shim_of_a_copy, {"numpy -> DLPackShim -> numpy.from_dlpack",
                                    "numpy -> DLPackShim -> torch.from_dlpack"}),
    ("dlpack2cai", view_of_a_copy, {"array.array -> cai2dlpack -> dlpack2cai -> memoryview",
                                    "torch -> dlpack2cai -> numpy.asarray"}),
], ids=["cai2dlpack-numpy", "cai2dlpack-array.array", "DLPackShim", "dlpack2cai"])
def test_a_conversion_that_copies_is_reported(capsys, monkeypatch, name, copying, broken):
    monkeypatch.setattr(self_check, name, copying)
    if optional.torch is None:  # torch's rows are not shown without it
        broken = {what for what in broken if "torch" not in what}
    status, out, verdicts = run_self_check(capsys)
    assert status == 1, out
    assert {what for what, verdict in verdicts.items() if verdict != "yes"} == broken, out
    assert all(re.fullmatch(r"NO: 0x[0-9a-f]+, not 0x[0-9a-f]+", verdicts[what]) for what in broken), out
    assert f"FAILED: {len(broken)} of {len(verdicts)} conversions were not shown to share memory" in out
    assert "OK:" not in out and "Short benchmark" not in out


def test_a_verdict_needs_the_same_address_and_a_write_seen_through_both():
    written = []
    assert self_check.shares_memory(64, 64, written.append, lambda: written[-1]) == "yes"
    assert self_check.shares_memory(64, 128, written.append, lambda: written[-1]) == "NO: 0x80, not 0x40"
    assert written == [self_check.MARK]  # nothing is written through another address
    assert self_check.shares_memory(64, 64, lambda value: None, lambda: 0.0) == "NO: wrote 42.0, read 0.0"

    def refuse(value):
        raise ValueError("assignment destination is read-only")
    assert self_check.shares_memory(64, 64, refuse, lambda: 0.0) == \
        "NO: ValueError: assignment destination is read-only"


def runtime_line(env):
    probe = "from cai_dlpack.__main__ import describe_environment; describe_environment()"
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return next(line for line in result.stdout.splitlines() if line.startswith("CUDA runtime"))


def test_the_runtime_line_names_the_file_and_how_it_was_found(tmp_path):
    double = os.environ["CAI_DLPACK_CUDART"]  # the CPU suite's conftest names the runtime double
    assert runtime_line(dict(os.environ)) == f"CUDA runtime 13.0: {double} (named by CAI_DLPACK_CUDART), 4 GPU(s)"
    # The same library found by the loader under a soname: the line names the file behind it.
    shutil.copy(double, tmp_path / "libcudart.so.13")
    env = {key: value for key, value in os.environ.items() if key != "CAI_DLPACK_CUDART"}
    env["LD_LIBRARY_PATH"] = str(tmp_path)
    assert runtime_line(env) == (f"CUDA runtime 13.0: {tmp_path / 'libcudart.so.13'} "
                                 "(libcudart.so.13, found by the loader's search), 4 GPU(s)")


def run_command(*arguments, hide_numpy=False):
    """`python -m cai_dlpack ARGUMENTS` as a user runs it; hide_numpy: as where only the package is installed
    (the frameworks it would use are made unimportable)."""
    code = "import runpy, sys\n"
    if hide_numpy:
        code += "for name in ('numpy', 'torch', 'cupy', 'numba', 'numba.cuda', 'jax'): sys.modules[name] = None\n"
    code += "sys.argv[0] = 'cai_dlpack'\nrunpy.run_module('cai_dlpack', run_name='__main__', alter_sys=True)\n"
    return subprocess.run([sys.executable, "-c", code, *arguments], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("option", ["--help", "-h"])
def test_help_prints_the_usage_and_runs_no_check(option):
    result = run_command(option)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m cai_dlpack [-h]\n")
    assert "round trip" in result.stdout  # the description says what the command does
    assert "Zero-copy round trip" not in result.stdout and "OK:" not in result.stdout and result.stderr == ""


@pytest.mark.parametrize("arguments", [["--bogus"], ["extra"], ["-x"]])
def test_an_unknown_argument_is_refused_with_the_usage_on_stderr(arguments):
    result = run_command(*arguments)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("usage: python -m cai_dlpack [-h]\n")
    assert "error: unrecognized arguments" in result.stderr


def test_with_the_package_alone_one_row_and_a_hint_instead_of_the_benchmark():
    """What the README's first command says it prints where nothing but the package is installed."""
    result = run_command(hide_numpy=True)
    assert result.returncode == 0, result.stderr
    assert list(dict(ROW.findall(result.stdout))) == ["array.array -> cai2dlpack -> dlpack2cai -> memoryview"]
    assert "Short benchmark" not in result.stdout
    assert "No short benchmark: it compares with NumPy. Install numpy" in result.stdout
    assert result.stdout.rstrip().endswith("OK: 1 conversion shared memory")
