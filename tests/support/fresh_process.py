"""Cases that must start from a process of their own: the module's process-wide pools (kept events, a thread's
serial, the first array type it meets) hold what earlier tests left there. run_with_double runs a script in a new
interpreter that imports this session's module (the same sys.path, so a mutation run's build too) with the CUDA
runtime test double loaded as `double`, and `np`, `DEVICE`, `CaiArray` and `register` in scope."""
import os
import subprocess
import sys
import textwrap

PREAMBLE = """\
import os, sys
import numpy as np
sys.path[:0] = [p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p]
from support.cuda_double import CudaDouble, DEVICE
from support.cai_objects import CaiArray, register
double = CudaDouble(os.environ["CAI_DLPACK_CUDART"])
"""


def run_with_double(body, timeout=60):
    """Runs body (indented as it comes) after the preamble; returns its standard output split in words, once the
    child exited with 0 (else the assertion shows its standard error)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", PREAMBLE + textwrap.dedent(body)], env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def live_tracebacks():
    """How many traceback objects are alive after a collection: one a C path kept by mistake stays alive."""
    import gc
    import types

    gc.collect()
    return sum(isinstance(o, types.TracebackType) for o in gc.get_objects())


# A script's lines that make a legacy subinterpreter (it shares the main GIL, so this single-phase module loads
# there): `interp`, and `run(code)`, which returns an error or None.
LEGACY_SUBINTERPRETER = """
try:
    import _interpreters as interpreters                   # 3.13+
    interp = interpreters.create("legacy")
    run = lambda code: interpreters.exec(interp, code)
except ImportError:
    import _xxsubinterpreters as interpreters              # 3.11, 3.12 (3.11's "isolated" forbids threads)
    interp = interpreters.create(isolated=False)
    run = lambda code: interpreters.run_string(interp, code)
"""
