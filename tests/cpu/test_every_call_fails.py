"""Every runtime call of every path fails once. Each scenario is one whole user-level operation on the double's
device memory (a conversion each way, a view's host read, the copies, the exchange API's two doors, the C API, a
dropped tensor's ordered release), checked end to end. Its runtime calls are learned from the double's log on a
run without failures; then each call, at each of its occurrences, is made to fail alone, and the operation must
either succeed with a fully correct result, or raise CudaError naming that call and its code (never a wrong
result, never SystemError); calls whose result the operation needs must raise. Either way nothing is left behind:
the caller's device and context, the thread's capture mode, the runtime's last error, the events and allocations
made, the objects a release holds, and the same operation succeeds again once nothing fails."""
import ctypes
import sys
import weakref

import numpy as np
import pytest

from cai_dlpack import CudaError, DLPackShim, _core, cai2dlpack, dlpack2cai
from support import c_example, doors
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE, GLOBAL, MANAGED, PINNED_HOST
from support.dlpack_ctypes import MadeTensor, read_capsule

# The releases these scenarios count are ordered after the streams they name by handle (conftest.py).
pytestmark = pytest.mark.usefixtures("trusted_streams")

# An error code no branch of csrc looks for (not 2, 400, 600, 709, 900-907): every failure takes the plain path.
# The double has no name for it (cudaErrorUnrecognized; the driver's name lookup fails: "unknown error").
CODE = 719
S1, S2 = 0x5000, 0x6000  # a producer's and a consumer's stream on device 0
S3, S4 = 0x5100, 0x6100  # the same on device 1
kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged = 1, 2, 3, 13
F32 = (2, 32, 1)  # kDLFloat, 32 bits, 1 lane

# The calls the double can be told to fail (the others, cudaEventDestroy, cudaFree, cudaFreeHost, cudaGetLastError,
# cuDevicePrimaryCtxGetState, cuDeviceGet, always succeed there).
FAILABLE = {
    "cudaPointerGetAttributes", "cudaGetDevice", "cudaSetDevice", "cudaGetDeviceCount", "cudaEventCreateWithFlags",
    "cudaEventRecord", "cudaStreamWaitEvent", "cudaStreamGetCaptureInfo", "cudaThreadExchangeStreamCaptureMode",
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaMemcpy2DAsync", "cudaLaunchHostFunc",
    "cudaDeviceGetAttribute", "cudaStreamCreate", "cudaMalloc", "cudaMallocHost", "cudaMallocManaged",
    "cudaMallocAsync", "cudaFreeAsync", "cudaEventQuery", "cudaEventSynchronize", "cuCtxGetCurrent",
    "cuCtxPushCurrent", "cuCtxPopCurrent", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease",
    "cuStreamGetCtx", "cuCtxGetId",
}
# Failing calls the double does not log (cudaEventQuery), or logs only when they work (the cudaMalloc family):
# whether the failure was taken is read from the runtime's last error, which the failure set, or from the log's
# cudaGetLastError that cleared it.
UNLOGGED_WHEN_FAILING = {"cudaEventQuery", "cudaMalloc", "cudaMallocHost", "cudaMallocManaged"}


def address(array):
    return array.__array_interface__["data"][0]


def values_at(pointer, dtype, shape):
    """The C-contiguous values at pointer (device memory is host memory in the double)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(bytes((ctypes.c_char * nbytes).from_address(pointer)), dtype).reshape(shape)


def c_strides(shape):
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


class Scenario:
    """One operation: setup(cudart) makes its memory and streams (after each reset of the double) and returns its
    state; run(cudart, state) does the operation end to end and asserts its result. late: the double runs streams
    only when forced. raises: call name -> the occurrences (0-based; ALL: every one) whose failure the operation
    cannot survive, because it needs the call's result or its contract says it raises; ALL for the whole dict:
    every call."""

    def __init__(self, name, setup, run, raises, late=False):
        self.name, self.setup, self.run, self.raises, self.late = name, setup, run, raises, late

    def must_raise(self, call, occurrence):
        if self.raises is ALL:
            return True
        wanted = self.raises.get(call, ())
        return wanted is ALL or occurrence in wanted


ALL = object()


class State:
    def __init__(self, **values):
        self.__dict__.update(values)
        self.dead = []  # weak references to what must be let go once every stream ran
        self.after = []  # more checks of that moment: each returns a sentence saying what is wrong, or None


def device_array(cudart, device=0, kind=DEVICE, shape=(4, 6)):
    base = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 1
    register(cudart, base, kind, device=device)
    return base


def streams(cudart):
    cudart.add_stream(S1, 0)
    cudart.add_stream(S2, 0)
    cudart.add_stream(S3, 1)
    cudart.add_stream(S4, 1)


def keep_weakly(state, obj):
    state.dead.append(weakref.ref(obj))


def check_capsule(capsule, data, device, shape, strides):
    fields = read_capsule(capsule)
    assert fields["data"] == data and fields["device"] == device and fields["shape"] == shape
    assert fields["strides"] in ((None, c_strides(shape)) if strides == c_strides(shape) else (strides,)), fields
    return fields


# ---- the scenarios ---------------------------------------------------------------------------------------


def setup_one_device(cudart):
    streams(cudart)
    return State(base=device_array(cudart))


def run_cai2dlpack(cudart, s):
    """cai2dlpack of device memory made on S1, for a consumer on S2: an event ordering, then the capsule's drop."""
    obj = CaiArray(s.base[:, 1:], stream=S1)
    keep_weakly(s, obj)
    capsule = cai2dlpack(obj, stream=S2, max_version=(1, 0))
    check_capsule(capsule, address(s.base) + 4, (kDLCUDA, 0), (4, 5), (6, 1))
    del capsule, obj


def setup_device_1(cudart):
    streams(cudart)
    return State(base=device_array(cudart, device=1))


def run_shim_other_device(cudart, s):
    """DLPackShim.__dlpack__ of device 1's memory made on the legacy stream, device 0 current: device 1's context is
    entered for the event, the consumer S3 waits, and the capsule's release is recorded in S3's context."""
    obj = CaiArray(s.base, stream=1)
    keep_weakly(s, obj)
    capsule = DLPackShim(obj).__dlpack__(stream=S3, max_version=(1, 0))
    check_capsule(capsule, address(s.base), (kDLCUDA, 1), (4, 6), (6, 1))
    del capsule, obj


def run_view(cudart, s):
    """dlpack2cai of a shim of device memory made on S1, for S2: the view's interface names its stream and data."""
    obj = CaiArray(s.base[::2], stream=S1)
    keep_weakly(s, obj)
    view = dlpack2cai(DLPackShim(obj), stream=S2)
    iface = view.__cuda_array_interface__
    assert iface["data"] == (address(s.base), False) and iface["shape"] == (2, 6)
    assert iface["strides"] == (48, 4) and iface["typestr"] == "<f4" and iface["stream"] == S2
    del view, obj, iface


def setup_host_accessible(kind):
    def setup(cudart):
        streams(cudart)
        return State(base=device_array(cudart, kind=kind))
    return setup


def run_per_thread_host_read(cudart, s):
    """A view of pinned memory for the per-thread stream: an event marks it; the host read waits for that event
    and sees the producer's values."""
    obj = CaiArray(s.base, stream=S1)
    keep_weakly(s, obj)
    view = dlpack2cai(DLPackShim(obj), stream=2)
    assert view.__array_interface__["data"] == (address(s.base), False)  # (NumPy retries a failed buffer export)
    np.testing.assert_array_equal(np.asarray(view), s.base)
    del view, obj


def run_stream_host_read(cudart, s):
    """A view of managed memory for S2, read on the host: the host waits for S2 (not capturing) first."""
    obj = CaiArray(s.base, stream=S1)
    keep_weakly(s, obj)
    view = dlpack2cai(DLPackShim(obj), stream=S2)
    assert view.__array_interface__["data"] == (address(s.base), False)
    np.testing.assert_array_equal(np.asarray(view), s.base)
    del view, obj


def run_device_copy(cudart, s):
    """copy=True of strided device memory made on S1, for S2: a stream-ordered allocation, 2D copies after S1's
    work, S1 ordered after them; the copy holds the values, C-contiguous, in new memory, freed on S2 at its drop."""
    source = s.base[:, ::2]
    obj = CaiArray(source, stream=S1)
    keep_weakly(s, obj)
    capsule = DLPackShim(obj).__dlpack__(stream=S2, copy=True, max_version=(1, 0))
    fields = read_capsule(capsule)
    assert fields["device"] == (kDLCUDA, 0) and fields["shape"] == (4, 3)
    assert fields["strides"] in (None, (3, 1)) and fields["data"] != address(s.base)
    np.testing.assert_array_equal(values_at(fields["data"], np.float32, (4, 3)), source)
    del capsule, obj


def run_pinned_copy(cudart, s):
    """copy=True of pinned memory for the legacy stream (the caller's device's): pinned memory made, one copy."""
    obj = CaiArray(s.base, stream=S1)
    keep_weakly(s, obj)
    capsule = DLPackShim(obj).__dlpack__(stream=None, copy=True, max_version=(1, 0))
    fields = read_capsule(capsule)
    assert fields["device"] == (kDLCUDAHost, 0) and fields["shape"] == (4, 6)
    assert fields["strides"] in (None, (6, 1)) and fields["data"] != address(s.base)
    np.testing.assert_array_equal(values_at(fields["data"], np.float32, (4, 6)), s.base)
    del capsule, obj


def run_host_copy(cudart, s):
    """A host copy (dl_device=(kDLCPU, 0)) of strided memory of device 1 made on S3, device 0 current: copied on
    S3 in device 1's context and waited for; the copy holds the values."""
    source = s.base[::2, 1::2]
    obj = CaiArray(source, stream=S3)
    capsule = DLPackShim(obj).__dlpack__(stream=S4, dl_device=(kDLCPU, 0), max_version=(1, 0))
    fields = read_capsule(capsule)
    assert fields["device"] == (kDLCPU, 0) and fields["shape"] == (2, 3) and fields["strides"] in (None, (3, 1))
    np.testing.assert_array_equal(values_at(fields["data"], np.float32, (2, 3)), source)
    del capsule, obj


@pytest.fixture(scope="module")
def producer():
    return c_example.build_producer()


def setup_exchange(producer):
    def setup(cudart):
        streams(cudart)
        producer.configure(work_stream=S3)
        state = State(base=device_array(cudart, device=1), producer=producer)
        # Every tensor the table lent is deleted, once (by the view, or at once when no view was made).
        state.after.append(lambda: None if producer.counts()["deleter"] == producer.counts()["from_object"]
                           else f"the producer's tensors: {producer.counts()}")
        return state
    return setup


def run_exchange_consumer(cudart, s):
    """dlpack2cai of a producer publishing the exchange API, its tensor on device 1 and its work stream S3, for S4:
    the table's tensor is viewed, S4 ordered after S3; the producer's tensor is deleted once the view is dropped."""
    tensor = s.producer.Tensor(s.base, kDLCUDA, 1)
    view = dlpack2cai(tensor, stream=S4)
    iface = view.__cuda_array_interface__
    assert iface["data"] == (address(s.base), False) and iface["shape"] == (4, 6) and iface["stream"] == S4
    assert iface["strides"] in (None, (24, 4))
    del view, tensor, iface


def setup_nothing(cudart):
    streams(cudart)
    return State()


def run_allocator(cudart, s):
    """The exchange API's allocator: device memory of device 1, pinned and managed memory, each written, read back
    and freed by its deleter."""
    for device in ((kDLCUDA, 1), (kDLCUDAHost, 0), (kDLCUDAManaged, 0)):
        try:
            owned = doors.allocate(F32, (3, 4), device)
        except doors.AllocationRefused as refused:
            raise AllocatorRefusal(refused.kind, refused.message) from None
        try:
            fields = owned.fields()
            assert fields["device"] == device and fields["shape"] == (3, 4) and fields["strides"] == (4, 1)
            values = np.arange(12, dtype=np.float32)
            ctypes.memmove(fields["data"], values.ctypes.data, values.nbytes)
            np.testing.assert_array_equal(values_at(fields["data"], np.float32, (12,)), values)
        finally:
            owned.delete()


class AllocatorRefusal(Exception):
    """The allocator's refusal through its error callback: kind, the Python exception it names, and message."""

    def __init__(self, kind, message):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


def run_late_release(cudart, s):
    """Late mode: a view for S2 is dropped while S2's work is queued; the producer's object is let go once S2 ran
    (the harness runs every stream). Its CAI names the stream, its data the producer's."""
    obj = CaiArray(s.base, stream=S1)
    keep_weakly(s, obj)
    view = dlpack2cai(DLPackShim(obj), stream=S2)
    assert view.__cuda_array_interface__["data"][0] == address(s.base)
    del view, obj


def run_c_api(cudart, s):
    """The C API: to_managed_tensor and fill_tensor of device 1's memory made on S3, for S4."""
    obj = CaiArray(s.base[1:], stream=S3)
    keep_weakly(s, obj)
    owned = doors.to_managed_tensor(obj, S4)
    try:
        fields = owned.fields()
        assert fields["data"] + fields["byte_offset"] == address(s.base) + 24
        assert fields["device"] == (kDLCUDA, 1) and fields["shape"] == (3, 6)
        assert fields["strides"] in (None, (6, 1))
    finally:
        owned.delete()
    fields, read_only = doors.fill_tensor(obj, S4)
    assert fields["data"] + fields["byte_offset"] == address(s.base) + 24 and fields["shape"] == (3, 6)
    assert read_only == 0
    del obj




# ---- the harness -----------------------------------------------------------------------------------------


def settle(cudart):
    """Runs every stream until no release is pending (a release may record an event that needs a run itself)."""
    for _ in range(20):
        cudart.run_all()
        if _core._pending_releases()["pending"] == 0:
            return True
    return False


def fresh(cudart, scenario):
    """The double reset (no failure, no log, device 0 current) and the scenario's memory and streams made again."""
    cudart.reset()
    state = scenario.setup(cudart)
    if scenario.late:
        cudart.late = True
    return state


def call_name(line):
    return line.split("(", 1)[0]


def failure_taken(cudart, call, occurrence, log):
    if call in UNLOGGED_WHEN_FAILING:
        return cudart.last_error == CODE or f"cudaGetLastError() -> {CODE}" in log
    return sum(call_name(line) == call for line in log) > occurrence


class Unraisable:
    """Collects what is reported as unraisable (a deleter's error) while in the with block."""

    def __enter__(self):
        self.seen, self.previous = [], sys.unraisablehook
        sys.unraisablehook = lambda report: self.seen.append(repr(report.exc_value))
        return self.seen

    def __exit__(self, *exc):
        sys.unraisablehook = self.previous


class Run:
    """One run of a scenario from a fresh double, failing occurrence of call (or nothing), every stream run after
    it. outcome: None, or what the operation raised as (type, call, code, message): the exception itself is not
    kept, as its traceback would hold the operation's objects past the releases checked."""

    def __init__(self, cudart, scenario, call=None, occurrence=0):
        self.state = fresh(cudart, scenario)
        self.events_before = cudart.events_alive
        self.calls_before = cudart.calls
        if call is not None:
            cudart.fail(call, CODE, after=occurrence)
        with Unraisable() as self.unraisable:
            self.outcome = self.attempt(scenario, cudart)
            self.settled = settle(cudart)
        self.log = cudart.log()

    def attempt(self, scenario, cudart):
        try:
            scenario.run(cudart, self.state)
        except AllocatorRefusal as refused:
            return (AllocatorRefusal, None, None, f"{refused.kind}: {refused.message}")
        except Exception as error:  # every kind is judged by the caller
            return (type(error), getattr(error, "call", None), getattr(error, "code", None), str(error))
        return None

    def calls(self, cudart):
        """How often each runtime call was made (cudaEventQuery is counted by the double, not logged)."""
        counts = {}
        for line in self.log:
            counts[call_name(line)] = counts.get(call_name(line), 0) + 1
        queries = cudart.calls - self.calls_before - len(self.log)
        if queries:
            counts["cudaEventQuery"] = queries
        return counts

    def leftovers(self, cudart, failing=None):
        """What the operation left behind once every stream ran: sentences, none when nothing."""
        found = []
        made = sum(line.startswith("cudaMalloc") and line.endswith("-> ok") for line in self.log)
        freed = sum(call_name(line) in ("cudaFree", "cudaFreeHost", "cudaFreeAsync") for line in self.log)
        if not self.settled:
            found.append(f"releases still pending: {_core._pending_releases()}")
        if made != freed:
            found.append(f"{made} allocations made, {freed} freed")
        alive = [ref() for ref in self.state.dead if ref() is not None]
        if alive:
            found.append(f"still held: {alive}")
        found += [wrong for wrong in (check() for check in self.state.after) if wrong]
        if cudart.violations:
            found.append(f"{cudart.violations} capture violations")
        if cudart.current_device != 0:
            found.append(f"the runtime's device is {cudart.current_device}")
        # A refused put-back of the thread's mode leaves it as the runtime left it (as a refused pop leaves the
        # context stack); any other failure leaves the thread's own mode.
        if cudart.thread_capture_mode != GLOBAL and failing != "cudaThreadExchangeStreamCaptureMode":
            found.append(f"the thread's capture mode is left at {cudart.thread_capture_mode}")
        if self.unraisable:
            found.append(f"unraisable: {self.unraisable}")
        return found


def judge(cudart, scenario, call, occurrence, run):
    """The problems of one run failing occurrence of call: sentences, none when it behaved."""
    problems = []
    if not failure_taken(cudart, call, occurrence, run.log):
        problems.append("the failure was never taken (the operation's calls changed)")
    named = call
    if run.outcome is None:
        if scenario.must_raise(call, occurrence):
            problems.append("succeeded, although it needs the call's result")
    else:
        kind, raised_call, code, message = run.outcome
        if kind is AllocatorRefusal:
            # The allocator's door has no exception of its own: it names the kind and the failed call.
            right = message.startswith("RuntimeError: ") and f"{named} failed: " in message
        else:
            right = kind is CudaError and (raised_call, code) == (named, CODE) and named in message
        if not right:
            problems.append(f"raised {kind.__name__} (call {raised_call!r}, code {code!r}): {message!r}")
        elif not scenario.must_raise(call, occurrence):
            problems.append(f"raised, although the operation can do without the call: {message!r}")
    if call.startswith("cuda") and cudart.last_error != 0:
        problems.append(f"the runtime's last error is left at {cudart.last_error}")
    # A failed pop leaves the context stack as the driver left it; any other failure leaves the caller's.
    if call != "cuCtxPopCurrent" and cudart.context_device != 0:
        problems.append(f"device {cudart.context_device}'s context is current, not device 0's")
    return problems + run.leftovers(cudart, call)


def fault_case(cudart, scenario, call, occurrence):
    """Fails occurrence of call, twice, then nothing; returns the problems found, each a sentence. Events a failure
    leaves pooled (a release's spare kept under its device's number when the context's id could not be had) are
    reused by the next run, and a pooled event a failure destroyed is made again by the next clean run: the second
    failing run and the second clean one make no event that stays."""
    where = f"{scenario.name}: {call} #{occurrence}"
    problems = [f"{where}: {problem}" for problem in judge(cudart, scenario, call, occurrence,
                                                            Run(cudart, scenario, call, occurrence))]
    run = Run(cudart, scenario, call, occurrence)
    problems += [f"{where}, again: {problem}" for problem in judge(cudart, scenario, call, occurrence, run)]
    # (fewer is no leak: a failed record destroys its event, which may be a spare an earlier test left kept)
    if cudart.events_alive > run.events_before:
        problems.append(f"{where}, again: {cudart.events_alive - run.events_before} more events alive")
    Run(cudart, scenario)  # refills what the failures took from the pools
    run = Run(cudart, scenario)
    if run.outcome is not None:
        problems.append(f"{where}, then nothing failing: raised {run.outcome[0].__name__}: {run.outcome[3]!r}")
    problems += [f"{where}, then nothing failing: {found}" for found in run.leftovers(cudart)]
    if cudart.events_alive != run.events_before or cudart.context_device != 0 or cudart.last_error != 0:
        problems.append(f"{where}, then nothing failing: {cudart.events_alive - run.events_before} more events "
                        f"alive, device {cudart.context_device}'s context current, last error {cudart.last_error}")
    return problems


# ---- which failures each operation must raise for ----------------------------------------------------------
# Read from csrc. A conversion needs every call it makes: the pointer query (which device the data is on), the
# ordering of the consumer's stream after the producer's (cdl_order_streams_by_runtime: the producer stream's
# context, both capture queries, the pool key's context id, the event's record and the wait), the device scopes
# around them (cdl_device_enter / cdl_device_leave: a context that cannot be entered or put back raises), the
# copies and their allocation, the waits of a host read, the capture query of a view's exported stream. A
# release can do without all of its calls (cdl_record_release, cdl_release_completed: a release that cannot be
# ordered is made at once, a pool key falls back on the device's number, a query that fails counts as complete),
# and so can the frees, the capture-mode switches (made in the thread's own mode), a release point's device
# (cdl_release_point_set: left unordered), a copy's stream-ordered allocation (cudaMalloc instead) and the
# capture queries that only choose between stream-ordered work and plain calls (cdl_stream_outside_capture).

# The ordering's calls when the producer's stream is a handle in the current context (device 0's).
ORDERING = {"cuStreamGetCtx": {0}, "cudaGetDevice": {0}, "cuCtxGetCurrent": {0}, "cudaStreamGetCaptureInfo": {0, 1},
            "cuCtxGetId": {0}, "cudaEventRecord": {0}, "cudaStreamWaitEvent": {0}}

SCENARIOS = {
    # Nothing but the conversion: an unconsumed capsule is released at once, no call.
    "cai2dlpack": lambda producer: Scenario("cai2dlpack", setup_one_device, run_cai2dlpack, ALL),
    # The ordering in device 1's context (retain, push, pop, release): a scope not put back raises too.
    "shim of another device": lambda producer: Scenario("shim of another device", setup_device_1,
                                                         run_shim_other_device, ALL),
    # Then the view's exported stream (capture query #2); its release and the shim capsule's are ordered after S2
    # (cudaGetDevice, cuCtxGetCurrent... #1 and #2).
    "view": lambda producer: Scenario(
        "view", setup_one_device, run_view,
        dict(ORDERING, cudaPointerGetAttributes=ALL, cudaStreamGetCaptureInfo={0, 1, 2})),
    # Pinned memory for the per-thread stream, in the caller's context: the consumer's capture query first (#0),
    # the producer's (#1) and the wait; the release points' devices (cudaGetDevice #1, #2) can fail, the view's
    # per-thread stream's device (#3), scope (#4), capture query (#2), event and the host read's wait cannot.
    "per-thread host read": lambda producer: Scenario(
        "per-thread host read", setup_host_accessible(PINNED_HOST), run_per_thread_host_read,
        {"cudaPointerGetAttributes": ALL, "cuStreamGetCtx": {0}, "cudaGetDevice": {0, 3, 4},
         "cuCtxGetCurrent": {0, 1}, "cudaStreamGetCaptureInfo": {0, 1, 2}, "cuCtxGetId": {0},
         "cudaEventRecord": {0, 1}, "cudaStreamWaitEvent": {0}, "cudaEventCreateWithFlags": {0},
         "cudaEventSynchronize": ALL}),
    # Managed memory for S2: the host read asks S2's capture (#2) and waits for it.
    "stream host read": lambda producer: Scenario(
        "stream host read", setup_host_accessible(MANAGED), run_stream_host_read,
        dict(ORDERING, cudaPointerGetAttributes=ALL, cudaStreamGetCaptureInfo={0, 1, 2}, cudaStreamSynchronize=ALL)),
    # The allocation's scope (#0), the ordering (#1), the copies' scope (#2), the copy's release (#3), the
    # producer ordered after the copies (#4), the free's scope (#5). Capture queries: S2 before the stream-ordered
    # allocation (#0, can fail: cudaMalloc instead), the ordering (#1, #2), S2 before the copies (#3: without its
    # answer, whether the source must be kept is not known, so nothing is copied), the release (#4), the
    # producer's ordering (#5, #6), the free (#7, can fail: cudaFree instead).
    "device copy": lambda producer: Scenario(
        "device copy", setup_one_device, run_device_copy,
        {"cudaPointerGetAttributes": ALL, "cudaDeviceGetAttribute": ALL, "cudaGetDevice": {0, 1, 2, 4},
         "cuCtxGetCurrent": {0, 1, 2, 4}, "cudaStreamGetCaptureInfo": {1, 2, 3, 5, 6}, "cuStreamGetCtx": {0, 2},
         "cuCtxGetId": {0, 2}, "cudaEventRecord": {0, 2}, "cudaStreamWaitEvent": ALL, "cudaMemcpy2DAsync": ALL}),
    # Pinned memory copied on the legacy stream of the caller's device: cudaGetDevice #0 names it, the legacy
    # stream is asked about captures (#0) before pinned memory is made in the allocation's scope (#1), then the
    # ordering (#2, capture queries #1, #2), the copies' stream asked (capture query #3, needed, as in the device
    # copy), the copy's release (#3, can fail), the copies' ordering of the
    # producer (#4... #5, capture queries #5, #6).
    "pinned copy": lambda producer: Scenario(
        "pinned copy", setup_host_accessible(PINNED_HOST), run_pinned_copy,
        {"cudaPointerGetAttributes": ALL, "cudaDeviceGetAttribute": ALL, "cudaGetDevice": {0, 1, 2, 5},
         "cuCtxGetCurrent": {0, 1, 3}, "cudaStreamGetCaptureInfo": {0, 1, 2, 3, 5, 6}, "cuStreamGetCtx": {0},
         "cuCtxGetId": {0, 2}, "cudaEventRecord": {0, 2}, "cudaStreamWaitEvent": ALL, "cudaMallocHost": ALL,
         "cudaMemcpyAsync": ALL}),
    # A host copy needs every call: the consumer's capture query, the pitch, device 1's scope, the producer
    # stream's capture query, the copies and the wait.
    "host copy": lambda producer: Scenario(
        "host copy", setup_device_1, run_host_copy,
        dict.fromkeys(["cudaPointerGetAttributes", "cudaStreamGetCaptureInfo", "cudaDeviceGetAttribute",
                       "cudaGetDevice", "cuCtxGetCurrent", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent",
                       "cudaMemcpy2DAsync", "cudaStreamSynchronize", "cuCtxPopCurrent", "cuDevicePrimaryCtxRelease"],
                      ALL)),
    # The table's tensor ordered after its work stream (in device 1's context, ORDERING's calls), viewed for S4;
    # the view's release can fail.
    "exchange consumer": lambda producer: Scenario(
        "exchange consumer", setup_exchange(producer), run_exchange_consumer,
        dict(ORDERING, cuCtxPushCurrent={0}, cuCtxPopCurrent={0}, cudaStreamGetCaptureInfo={0, 1, 2})),
    # Device memory of device 1 made in its scope (#0) and freed in it (#1: the free goes ahead without it);
    # pinned and managed memory made and freed in the caller's context.
    "allocator": lambda producer: Scenario(
        "allocator", setup_nothing, run_allocator,
        {"cudaGetDevice": {0}, "cuCtxGetCurrent": {0}, "cuDevicePrimaryCtxRetain": {0}, "cuCtxPushCurrent": {0},
         "cuCtxPopCurrent": {0}, "cuDevicePrimaryCtxRelease": {0}, "cudaMalloc": ALL, "cudaMallocHost": ALL,
         "cudaMallocManaged": ALL}),
    # Late mode: the view's release is recorded on S2 with its work queued, and collected once S2 ran.
    "late release": lambda producer: Scenario(
        "late release", setup_one_device, run_late_release,
        dict(ORDERING, cudaPointerGetAttributes=ALL, cudaStreamGetCaptureInfo={0, 1, 2}), late=True),
    # to_managed_tensor (ordering in device 1's context: occurrences #0), its tensor's release (#1), fill_tensor
    # (ordering: #2; capture queries #0, #1 and #3, #4).
    "c api": lambda producer: Scenario(
        "c api", setup_device_1, run_c_api,
        {"cudaPointerGetAttributes": ALL, "cuStreamGetCtx": {0, 2}, "cudaGetDevice": {0, 2},
         "cuCtxGetCurrent": {0, 2}, "cuCtxPushCurrent": {0, 2}, "cuCtxPopCurrent": {0, 2},
         "cudaStreamGetCaptureInfo": {0, 1, 3, 4}, "cuCtxGetId": {0, 2}, "cudaEventRecord": {0, 2},
         "cudaStreamWaitEvent": ALL}),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_each_call_failing_once_raises_or_succeeds_and_leaves_nothing(cudart, producer, name):
    """Every occurrence of every runtime call the operation makes, failing alone: a correct result or CudaError
    naming the call and its code (raised where the result is needed), and nothing left behind either way."""
    scenario = SCENARIOS[name](producer)
    Run(cudart, scenario)  # the runtime loaded, the event pools filled
    steady = Run(cudart, scenario)
    assert steady.outcome is None and not steady.leftovers(cudart), (steady.outcome, steady.leftovers(cudart))
    sequence = steady.calls(cudart)
    if scenario.raises is not ALL:
        assert set(scenario.raises) <= set(sequence), "a call the table names is no longer made"
    problems = []
    for call, count in sorted(sequence.items()):
        for occurrence in range(count if call in FAILABLE else 0):
            problems += fault_case(cudart, scenario, call, occurrence)
    assert not problems, "\n".join(problems)


# ---- a failed scope entry where nothing raises: found by the cases above, one test per site -------------------


def test_a_release_whose_scope_cannot_be_entered_leaves_no_runtime_error(cudart):
    """A view of a foreign device tensor, dropped when its stream's context cannot be entered (cudaGetDevice
    fails): the release is made at once, and the failed call's error must not stay the runtime's last error, for
    another framework to find."""
    streams(cudart)
    base = device_array(cudart)
    made = MadeTensor(data=address(base), device=(kDLCUDA, 0), shape=base.shape)
    view = dlpack2cai(made.capsule, stream=S2)
    cudart.clear_log()
    cudart.fail("cudaGetDevice", CODE)  # the next: the view's release, entering S2's context
    del view
    assert settle(cudart) and made.deleted == 1
    assert "cudaGetDevice() -> -1" in cudart.log() and not any("Record" in line for line in cudart.log())
    assert cudart.last_error == 0


def test_a_device_copys_free_whose_scope_cannot_be_entered_leaves_no_runtime_error(cudart):
    """A device copy made by cudaMallocAsync, dropped (its free is stream-ordered, so made at once) when the free
    cannot enter the copy's device (cudaGetDevice fails): the copy is freed all the same, and the failed call's
    error must not stay the runtime's last error."""
    streams(cudart)
    base = device_array(cudart)
    capsule = DLPackShim(CaiArray(base, stream=S1)).__dlpack__(stream=S2, copy=True, max_version=(1, 0))
    cudart.clear_log()
    cudart.fail("cudaGetDevice", CODE)
    del capsule
    assert settle(cudart) and [line for line in cudart.log() if line.startswith("cudaFree")] == ["cudaFreeAsync(24576)"]
    assert "cudaGetDevice() -> -1" in cudart.log()
    assert cudart.last_error == 0


def test_the_allocators_free_whose_scope_cannot_be_entered_leaves_no_runtime_error(cudart):
    """Device memory the exchange allocator made, deleted when its device cannot be entered (cudaGetDevice fails):
    freed all the same, and the error must not stay the runtime's last error."""
    owned = doors.allocate(F32, (3, 4), (kDLCUDA, 1))
    cudart.clear_log()
    cudart.fail("cudaGetDevice", CODE)
    owned.delete()
    assert [line for line in cudart.log() if line.startswith("cudaFree")] == ["cudaFree()"]
    assert cudart.last_error == 0
