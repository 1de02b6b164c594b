"""mpi4py, a real distributed consumer: two processes under `mpiexec -n 2` send and receive what cai_dlpack hands
out (DLPackShim, DLPackView, low-precision views) as mpi4py reads message buffers (the buffer protocol, else
__dlpack__), and the receiver checks the bits (tests/support/mpi_exchange.py)."""
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("mpi4py", reason="mpi4py (a test extra, with MPICH from the mpich wheel) is not installed")
pytest.importorskip("torch", reason="torch (a test extra) is not installed: the low-precision cases need it")

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "support", "mpi_exchange.py")


def mpiexec():
    """The mpiexec beside this interpreter (the mpich wheel installs it there), else one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.path.exists(beside) else shutil.which("mpiexec")


@pytest.mark.skipif(mpiexec() is None, reason="no mpiexec: the mpich wheel (a test extra) installs one")
def test_mpi4py_sends_and_receives_every_object_we_hand_out():
    result = subprocess.run([mpiexec(), "-n", "2", sys.executable, SCRIPT], capture_output=True, text=True,
                            timeout=240, cwd=os.path.join(os.path.dirname(__file__), os.pardir))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "shim of a NumPy array: ok", "view of a NumPy array: ok", "view of a torch bfloat16 tensor: ok",
        "view of a torch float8_e4m3fn tensor: ok", "view of a torch float8_e5m2 tensor: ok"], result.stderr
