"""The module's locks (cdl_lock, cdl_internal.h): each is released by the thread that took it, and none is taken
again by its holder. Before Python 3.13 a cdl_lock is a POSIX mutex, which says nothing when it is unlocked unheld
(the runtime's publication, the event pool and the pending releases would then be open to a second thread with
no error anywhere): a checker loaded in front of the C library (tests/lock_checker) watches every lock and unlock
the module makes while a child process uses each lock. From 3.13 a cdl_lock is a PyMutex, which keeps no owner:
unlocking an unlocked one is a fatal error of its own, but a release by a thread other than the taker passes
unseen, and the checker sees no calls there; on 3.13+ the child's run shows only that no lock is unlocked
twice."""
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from support.cuda_double import compiler

TESTS = os.path.join(os.path.dirname(__file__), os.pardir)
CHECKER = os.path.join(TESTS, "lock_checker", "lock_checker.c")

# Every lock of the module in turn: the runtime loaded (its publication), a producer's stream ordered before a
# consumer's (the event pool), a view dropped while work queued on its consumer's stream has not run (the pending
# releases, a spare event taken and given back), the stream run (the release collected).
WORKLOAD = textwrap.dedent("""
    import gc, os, sys
    sys.path[:0] = [{tests!r}]
    import numpy as np
    from cai_dlpack import DLPackShim, _core, dlpack2cai
    from support.cai_objects import CaiArray, register
    from support.cuda_double import DEVICE, CudaDouble
    S1, S2 = 0x5000, 0x6000
    cudart = CudaDouble(os.environ["CAI_DLPACK_CUDART"])
    cudart.add_stream(S1, 0)
    cudart.add_stream(S2, 0)
    cudart.late = True
    host = np.arange(8, dtype=np.float32)
    register(cudart, host, DEVICE)
    for round in range(3):
        view = dlpack2cai(DLPackShim(CaiArray(host, stream=S1)), stream=S2)
        view.__cuda_array_interface__
        cudart.launch_kernel(S2, lambda: None)
        del view
        gc.collect()
        pending = _core._pending_releases()["pending"]
        for _ in range(10):
            cudart.run_all()
            gc.collect()
            if _core._pending_releases()["pending"] == 0:
                break
        print(round, pending, _core._pending_releases()["pending"])
""").format(tests=TESTS)


# Past the bound of pending releases: the limit's views dropped while their stream never runs, then one more, whose
# drop takes the oldest release out of the list and waits for it (and puts it back where the wait is refused).
PAST_THE_BOUND = textwrap.dedent("""
    import gc, os, sys
    sys.path[:0] = [{tests!r}]
    import numpy as np
    from cai_dlpack import DLPackShim, _core, dlpack2cai
    from support.cai_objects import CaiArray, register
    from support.cuda_double import DEVICE, CudaDouble
    S2 = 0x6000
    cudart = CudaDouble(os.environ["CAI_DLPACK_CUDART"])
    cudart.add_stream(S2, 0)
    cudart.late = True
    limit = _core._pending_releases()["limit"]
    host = np.zeros(limit + 2, dtype=np.float32)
    register(cudart, host, DEVICE)
    for i in range(limit + 1):
        dlpack2cai(DLPackShim(CaiArray(host[i:i + 1])), stream=S2)
    cudart.fail("cudaEventSynchronize", 700)
    dlpack2cai(DLPackShim(CaiArray(host[limit + 1:])), stream=S2)
    waited = _core._pending_releases()["waited"]
    cudart.run_all()
    gc.collect()
    _core._pending_releases()
    print(waited, _core._pending_releases()["pending"])
""").format(tests=TESTS)


def sanitizer_preloaded():
    return any(name in os.environ.get("LD_PRELOAD", "") for name in ("asan", "tsan", "ubsan", "msan"))


def run_checked(tmp_path, workload):
    """Runs workload in a child with the checker loaded; returns the result, once the child exited with 0 and (before
    3.13, where a cdl_lock is a POSIX mutex) the checker saw the module's locks."""
    checker = tmp_path / "liblock_checker.so"
    subprocess.run([compiler(), "-shared", "-fPIC", "-O1", "-Wall", "-Werror", CHECKER, "-o", str(checker), "-ldl"],
                   check=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path),
               LD_PRELOAD=" ".join(filter(None, [os.environ.get("LD_PRELOAD"), str(checker)])))
    result = subprocess.run([sys.executable, "-c", workload], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    checked = int(result.stderr.rsplit("lock_checker: ", 1)[1].split()[0])
    if sys.version_info < (3, 13):
        assert checked > 0, result.stderr  # the checker saw the module's locks
    return result


glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the checker reads glibc's mutex layout")
no_sanitizer = pytest.mark.skipif(sanitizer_preloaded(),
                                  reason="a sanitizer's interceptors stand between the module and the checker")


@glibc_only
@no_sanitizer
@pytest.mark.usefixtures("trusted_streams")
def test_every_lock_the_module_takes_is_released_by_the_thread_that_took_it(tmp_path):
    result = run_checked(tmp_path, WORKLOAD)
    # Each round's release waited for the consumer's stream, and was made once it ran.
    assert result.stdout.split("\n")[:3] == [f"{round} 1 0" for round in range(3)], result.stdout


@glibc_only
@no_sanitizer
@pytest.mark.usefixtures("trusted_streams")
def test_the_pending_releases_lock_is_held_past_the_bound(tmp_path):
    """Past the bound, the oldest release is taken out of the pending list and, its wait refused, put back, each
    under the pending releases' lock, taken and released by the dropping thread; the releases are all made once
    the stream ran."""
    result = run_checked(tmp_path, PAST_THE_BOUND)
    assert result.stdout.split() == ["2", "0"], result.stdout  # two waits past the bound (one refused), none left
