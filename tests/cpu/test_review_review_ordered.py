"""Review of issue 34 (stream-ordered release) and issue 33 defect 7: reproducers, each failing on the code as
merged into main (26b2f60). Run: .venv/bin/python -m pytest -q -p no:cacheprovider tests/cpu/test_review_review_ordered.py"""
import gc
import time
import weakref

import numpy as np
import pytest

from cai_dlpack import DLPackShim, _core, cai2dlpack
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE, GLOBAL, RELAXED, THREAD_LOCAL

from test_ordered_release import (NEXT, ORIGINAL, S2, Pool, consume, drain, late, read,  # noqa: F401 (fixture)
                                  through_cai2dlpack_without_keywords, through_shim)


def fill_to_the_bound(cudart, first_kernel=None):
    """CDL_PENDING_LIMIT dropped tensors whose releases wait for S2 (which never runs); returns a weakref to the
    oldest one's owner and a host buffer (kept registered) for one more."""
    limit = _core._pending_releases()["limit"]
    host = np.zeros(limit + 1, dtype=np.float32)
    register(cudart, host, DEVICE)
    if first_kernel is not None:
        cudart.launch_kernel(S2, first_kernel)
    first = CaiArray(host[0:1])
    watch = weakref.ref(first)
    consume(cai2dlpack(first, stream=S2, max_version=(1, 0)))[1]()
    del first
    for i in range(1, limit):
        consume(cai2dlpack(CaiArray(host[i:i + 1]), stream=S2, max_version=(1, 0)))[1]()
    gc.collect()
    assert _core._pending_releases()["pending"] == limit and watch() is not None
    return watch, host, limit


def test_a_failed_wait_past_the_bound_releases_the_owner_before_its_stream_ran(late):
    """cdl_release_after, past CDL_PENDING_LIMIT: the oldest release waits with cudaEventSynchronize and is made
    whatever the wait returned (cdl_wait_for ignores the error, cdl_finish releases). A refused wait (900, as CUDA
    answers while a capture prohibits it; or any other error) releases the owner while the consumer's stream has
    not run what it queued before the drop."""
    watch, host, limit = fill_to_the_bound(late)
    late.fail("cudaEventSynchronize", 900)
    consume(cai2dlpack(CaiArray(host[limit:]), stream=S2, max_version=(1, 0)))[1]()
    gc.collect()
    assert late.queued(S2) > 0  # S2 never ran: its work before the first drop is still queued
    assert watch() is not None, "released while the consumer's stream had not run past the drop"


def test_the_wait_past_the_bound_is_made_in_relaxed_capture_mode(late):
    """cudaEventSynchronize is one of the calls a capture prohibits (the thread's own non-relaxed capture, or any
    other thread's global-mode capture: 900, and that capture invalidated), as cudaEventQuery is, which
    cdl_release_completed asks in relaxed mode. cdl_wait_for makes it in the thread's own mode (global, the
    default). The double does not refuse cudaEventSynchronize (cudaEventQuery's unsafe_call is missing there), so
    the kernel the wait runs looks at the waiting thread's mode."""
    modes = []
    watch, host, limit = fill_to_the_bound(late, first_kernel=lambda: modes.append(late.thread_capture_mode))
    capture = late.begin_capture(0x7777, 0, GLOBAL, other_thread=True)  # PyTorch's default, another thread
    consume(cai2dlpack(CaiArray(host[limit:]), stream=S2, max_version=(1, 0)))[1]()
    assert modes, "the wait ran nothing"
    assert modes == [RELAXED], f"cudaEventSynchronize made in mode {modes[0]} while another thread captures globally"
    late.end_capture(capture)


def test_a_drop_while_the_consumers_stream_captures_releases_before_earlier_work(late):
    """Converted outside any capture, a kernel queued on C, then C begins a capture and the tensor is dropped:
    cdl_record_release sees C capturing and releases at once, though the kernel queued before the capture is
    ordinary work still to run. README's table: released when 'C has run what was queued before it' (the
    'at once' row is for tensors converted with C capturing)."""
    pool = Pool(late)
    x = pool.take(ORIGINAL)
    data, drop, stream = through_shim(x)
    seen = []
    late.launch_kernel(S2, lambda: seen.append(read(data)))
    capture = late.begin_capture(S2, 0, THREAD_LOCAL)
    drop()
    del x
    gc.collect()
    later = pool.take(NEXT)
    late.end_capture(capture)
    late.run_stream(S2)
    np.testing.assert_array_equal(seen[0], ORIGINAL)
    del later


def test_a_legacy_stream_drop_while_another_thread_captures_releases_before_earlier_work(late):
    """Consumer stream 1 (cai2dlpack(obj), None): a kernel queued on the legacy stream, then another thread
    begins capturing a blocking stream and the tensor is dropped. The capture query of the legacy stream answers
    906, cdl_record_release returns 0, and the owner is released at once, before the legacy stream ran the
    kernel."""
    pool = Pool(late)
    x = pool.take(ORIGINAL)
    data, drop, stream = through_cai2dlpack_without_keywords(x)
    assert stream == 1
    seen = []
    late.launch_kernel(1, lambda: seen.append(read(data)))
    capture = late.begin_capture(0x7777, 0, GLOBAL, blocking=True, other_thread=True)
    drop()
    del x
    gc.collect()
    later = pool.take(NEXT)
    late.end_capture(capture)
    late.run_stream(1)
    np.testing.assert_array_equal(seen[0], ORIGINAL)
    del later


def test_a_release_whose_stream_runs_after_the_pending_call_waits_for_the_next_conversion(late):
    """The pending call is scheduled once per drop and runs at the interpreter's next check: a stream that
    completes after that leaves its release pending until some later conversion or deleter, however long that
    takes (a program that stops converting keeps the producer's memory for good). README: completed releases are
    made 'from a pending call the interpreter runs soon after'."""
    pool = Pool(late)
    x = pool.take(ORIGINAL)
    watch = weakref.ref(x)
    data, drop, stream = through_shim(x)
    late.launch_kernel(S2, lambda: None)
    drop()
    del x
    for _ in range(1000):  # the pending call runs here, before the stream did
        pass
    time.sleep(0.01)
    late.run_stream(S2)  # the device got to it
    deadline = time.monotonic() + 0.5
    while watch() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
        gc.collect()
    assert watch() is None, "released only at a later conversion"


def test_a_completed_release_is_not_held_behind_an_older_one_on_another_stream(late):
    """cdl_release_completed stops at the first pending release not yet complete (one global FIFO): a release
    whose stream has run stays pending behind an older one on another stream, for as long as that stream takes
    (and, past the bound, the host waits for the unrelated older stream). Issue 34: 'completed releases are
    collected without blocking'."""
    S3 = 0x5800
    late.add_stream(S3, 0)
    pool = Pool(late)
    older = pool.take(ORIGINAL)
    capsule = DLPackShim(older).__dlpack__(stream=S3, max_version=(1, 0))
    late.launch_kernel(S3, lambda: None)  # S3 is busy for a long time
    consume(capsule)[1]()
    del older, capsule
    x = pool.take(ORIGINAL)
    watch = weakref.ref(x)
    data, drop, stream = through_shim(x)
    late.launch_kernel(S2, lambda: None)
    drop()
    del x
    late.run_stream(S2)  # the consumer's stream of x has run past the drop
    gc.collect()
    info = _core._pending_releases()
    assert watch() is None, f"x's release completed but is held behind S3's: {info}"


SUBINTERPRETER_SCRIPT = r'''
import ctypes, os, sys
sys.path.insert(0, {support!r})
from support.cuda_double import CudaDouble
double = CudaDouble(os.environ["CAI_DLPACK_CUDART"])
double.add_stream(0x6000, 0)
double.late = True
import cai_dlpack
import _xxsubinterpreters as si
interp = si.create()
si.run_string(interp, """
import ctypes, os, sys
sys.path.insert(0, {support!r})
from support.cuda_double import CudaDouble, DEVICE
from support.dlpack_ctypes import DLManagedTensorVersioned
import cai_dlpack, _xxsubinterpreters
double = CudaDouble(os.environ["CAI_DLPACK_CUDART"])
buf = (ctypes.c_float * 8)(*range(8))
double.add_region(ctypes.addressof(buf), 32, DEVICE)
class Owner:
    def __init__(self):
        self.__cuda_array_interface__ = dict(shape=(8,), typestr="<f4", data=(ctypes.addressof(buf), False),
                                             version=3, strides=None, stream=1)
    def __del__(self):
        print("owner released in interpreter", _xxsubinterpreters.get_current(), flush=True)
api = ctypes.pythonapi
api.PyCapsule_GetPointer.restype = ctypes.c_void_p
api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
capsule = cai_dlpack.cai2dlpack(Owner(), stream=0x6000, max_version=(1, 0))
address = api.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
api.PyCapsule_SetName(capsule, b"used_dltensor_versioned")
double.launch_kernel(0x6000, lambda: None)
deleter = ctypes.cast(DLManagedTensorVersioned.from_address(address).deleter, ctypes.c_void_p).value
ctypes.CFUNCTYPE(None, ctypes.c_void_p)(deleter)(address)   # the consumer drops it, in the subinterpreter
print("subinterpreter is", _xxsubinterpreters.get_current(), flush=True)
""")
double.run_all()                                 # the device gets to it
cai_dlpack._core._pending_releases()             # the main interpreter collects the release
si.destroy(interp)
print("end", flush=True)
'''


def test_a_subinterpreters_owner_is_released_by_the_main_interpreter():
    """A release is a global pending entry, collected by whichever interpreter converts or runs the pending call
    next: a subinterpreter's owner is decref'd (its __del__ run) under the main interpreter's thread state, or after
    its own interpreter is gone. Before ordered release a drop in the subinterpreter released it there."""
    pytest.importorskip("_xxsubinterpreters")
    import os
    import subprocess
    import sys
    support = os.path.join(os.path.dirname(__file__), os.pardir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", SUBINTERPRETER_SCRIPT.format(support=support)], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    sub = next(line for line in lines if line.startswith("subinterpreter is")).split()[-1]
    released = next(line for line in lines if line.startswith("owner released in")).split()[-1]
    assert released == sub, result.stdout


def test_the_double_refuses_an_event_synchronize_that_a_capture_prohibits(cudart):
    """The double's fidelity: cudaEventQuery goes through unsafe_call (900 and the capture invalidated where the
    thread's mode prohibits it), cudaEventSynchronize does not, though it is the blocking form of the same
    query (and cudaStreamSynchronize is judged). So no test on the double can see the bound's wait
    (cdl_wait_for) breaking another thread's global capture."""
    import ctypes
    lib = cudart.lib
    event = ctypes.c_void_p()
    assert lib.cudaEventCreateWithFlags(ctypes.byref(event), 2) == 0
    capture = cudart.begin_capture(0x7777, 0, GLOBAL, other_thread=True)
    assert lib.cudaEventQuery(event) == 900  # judged
    lib.cudaGetLastError()
    cudart.end_capture(capture)
    capture = cudart.begin_capture(0x7777, 0, GLOBAL, other_thread=True)
    assert lib.cudaEventSynchronize(event) == 900, "cudaEventSynchronize is not judged by the thread's mode"


FOREIGN_DROP_SCRIPT = r'''
import ctypes, os, sys, threading, time
import numpy as np
sys.path.insert(0, {support!r})
from support.cuda_double import CudaDouble, DEVICE
from support.cai_objects import CaiArray, register
from support.dlpack_ctypes import DLManagedTensorVersioned
import cai_dlpack
from cai_dlpack import _core
double = CudaDouble(os.environ["CAI_DLPACK_CUDART"])
S2 = 0x6000
double.add_stream(S2, 0)
double.late = True
api = ctypes.pythonapi
api.PyCapsule_GetPointer.restype = ctypes.c_void_p
api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
def take(capsule):
    address = api.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
    api.PyCapsule_SetName(capsule, b"used_dltensor_versioned")
    return ctypes.cast(DLManagedTensorVersioned.from_address(address).deleter, ctypes.c_void_p).value, address
limit = _core._pending_releases()["limit"]
host = np.zeros(limit + 1, dtype=np.float32)
register(double, host, DEVICE)
for i in range(limit):
    d, a = take(cai_dlpack.cai2dlpack(CaiArray(host[i:i + 1]), stream=S2, max_version=(1, 0)))
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(d)(a)
print("pending", _core._pending_releases()["pending"], flush=True)
last = take(cai_dlpack.cai2dlpack(CaiArray(host[limit:]), stream=S2, max_version=(1, 0)))
samples = []
stop = False
def spin():
    n = 0
    while not stop:
        n += 1
        if n % 1000 == 0:
            samples.append(time.perf_counter())
b = threading.Thread(target=spin)
b.start()
time.sleep(0.05)
double.lib.double_call_later.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
libc = ctypes.PyDLL(None)          # PyDLL: the GIL stays held through the call
assert double.lib.double_call_later(last[0], last[1], 100000) == 0
t0 = time.perf_counter()
libc.usleep(ctypes.c_uint(600000))  # this thread holds the GIL throughout: no other Python thread may run
t1 = time.perf_counter()
stop = True
b.join()
print("python ran while the main thread held the GIL:", sum(t0 + 0.05 < t < t1 - 0.05 for t in samples), round(t1 - t0, 3), flush=True)
print("waited", _core._pending_releases()["waited"], flush=True)
'''


def test_a_foreign_threads_wait_past_the_bound_lets_go_of_a_gil_it_does_not_hold():
    """cdl_attached_thread_state returns _PyThreadState_UncheckedGet(), which before 3.12 is the GIL holder's thread
    state, whichever thread that is (managed_tensor.c's cdl_thread_holds_gil checks thread_id for this reason; this
    function does not). A deleter on a thread without the GIL, past the bound, then calls PyEval_SaveThread with the
    main thread's state: it drops the GIL the main thread holds, and another Python thread runs while the main
    thread is inside a call that holds the GIL (here PyDLL usleep). The same function guards exchange_alloc.c's
    cdl_free_made_tensor (a made tensor dropped on a framework's thread) and cdl_release_copy."""
    import os
    import subprocess
    import sys
    if sys.version_info >= (3, 12):
        pytest.skip("from 3.12 the unchecked thread state is the calling thread's")
    support = os.path.join(os.path.dirname(__file__), os.pardir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", FOREIGN_DROP_SCRIPT.format(support=support)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("python ran"))
    assert line.split()[-2] == "0", result.stdout
