"""Stream ordering through the CUDA runtime double: the exact runtime calls for every pair of producer
and consumer streams, in both directions, and that the host is never made to wait, except by a host read of
pinned or managed memory, which waits once for the stream its producer made it ready on."""
import gc
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

import cai_dlpack
from cai_dlpack import CudaError, DLPackShim, cai2dlpack, dlpack2cai, options
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE, GLOBAL, MANAGED, PINNED_HOST
from support.fresh_process import run_with_double

S1, S2 = 0x5000, 0x6000
STREAMS = [None, 1, 2, S1, S2, -1]
BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def ordering_calls(log):
    """The log without pointer queries and the runtime's load: what the conversion did to order streams."""
    return [line for line in log if not line.startswith(("cudaPointerGetAttributes", "cudaGetDriverEntryPoint"))]


def expected_calls(producer, consumer, data_device, current_device):
    """The calls an event-ordered conversion must make (the pooled event is already made). A stream handle's own
    context is asked for and pushed if it is not the current one; for the legacy and per-thread handles the data
    device's primary context is (retained, pushed, popped, released). A pushed handle's context is asked its device
    when the consumer's is the legacy or per-thread handle, which names the data's device's stream. Each stream's
    capture is asked about (two calls: the only ones graph capture adds to an ordered conversion). The event is
    found by the context's id."""
    consumer_stream = 1 if consumer is None else consumer
    if producer is None or consumer_stream == -1 or producer == consumer_stream:
        return []
    switch = data_device != current_device
    handle = producer > 2
    calls = [f"cuStreamGetCtx({producer}) -> {data_device}"] if handle else []
    calls += [f"cudaGetDevice() -> {current_device}", f"cuCtxGetCurrent() -> ctx{current_device}"]
    if switch and not handle:
        calls += [f"cuDevicePrimaryCtxGetState({data_device}) -> 1", f"cuDevicePrimaryCtxRetain({data_device})"]
    if switch:
        calls.append(f"cuCtxPushCurrent(ctx{data_device})")
    if switch and handle and consumer_stream in (1, 2):
        calls.append(f"cudaGetDevice() -> {data_device}")
    # Both streams' captures are asked about (neither captures here), then the event is found and used.
    calls += [f"cudaStreamGetCaptureInfo({producer}) -> none", f"cudaStreamGetCaptureInfo({consumer_stream}) -> none"]
    calls += [f"cuCtxGetId(ctx{data_device}) -> 0", f"cudaEventRecord(ev{{}}, {producer})",
              f"cudaStreamWaitEvent({consumer_stream}, ev{{}}, 0)"]
    if switch:
        calls.append(f"cuCtxPopCurrent() -> ctx{current_device} current")
    if switch and not handle:
        calls.append(f"cuDevicePrimaryCtxRelease({data_device})")
    return calls


def view_event_calls(data_device, current_device):
    """The calls a view made for the per-thread stream (2) adds after the ordering: an event of its own recorded
    on that stream in the data device's context, which other threads wait for (only this thread can name it)."""
    return [f"cudaGetDevice() -> {current_device}", f"cuCtxGetCurrent() -> ctx{current_device}",
            f"cuDevicePrimaryCtxGetState({data_device}) -> 1", f"cuDevicePrimaryCtxRetain({data_device})",
            f"cuCtxPushCurrent(ctx{data_device})", "cudaStreamGetCaptureInfo(2) -> none",
            "cudaEventCreateWithFlags(0x2) -> ev{}", "cudaEventRecord(ev{}, 2)",
            f"cuCtxPopCurrent() -> ctx{current_device} current", f"cuDevicePrimaryCtxRelease({data_device})"]


def strip_event_ids(calls):
    import re

    return [re.sub(r"ev\d+", "ev{}", call) for call in calls]


@pytest.fixture
def device_array(cudart):
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    register(cudart, host, DEVICE, device=2)
    cudart.add_stream(S1, 2)
    cudart.add_stream(S2, 2)
    # Make the pooled event of device 2 once, so every case below sees the steady state.
    cai2dlpack(CaiArray(host, stream=S1), stream=S2)
    cudart.clear_log()
    return host


@pytest.mark.parametrize("producer", STREAMS)
@pytest.mark.parametrize("consumer", STREAMS)
def test_cai2dlpack_stream_pairs(cudart, device_array, producer, consumer):
    obj = CaiArray(device_array, stream=producer)
    if producer == -1:
        with pytest.raises(ValueError, match="'stream' -1 is not a valid stream"):
            cai2dlpack(obj, stream=consumer)
        assert cudart.log() == []
        return
    cai2dlpack(obj, stream=consumer)
    calls = ordering_calls(cudart.log())
    assert strip_event_ids(calls) == expected_calls(producer, consumer, 2, 0)
    assert not any(call.startswith(BLOCKING) for call in cudart.log())
    assert cudart.current_device == 0


@pytest.mark.parametrize("producer", [p for p in STREAMS if p != -1])
@pytest.mark.parametrize("consumer", STREAMS)
def test_dlpack2cai_stream_pairs(cudart, device_array, producer, consumer):
    """dlpack2cai asks the producer for data ready on the consumer stream and exports that stream."""
    view = dlpack2cai(DLPackShim(CaiArray(device_array, stream=producer)), stream=consumer)
    calls = ordering_calls(cudart.log())
    if consumer in (None, 1):
        # Before the producer is asked for the legacy stream: is a capture on the data's device (2) making it
        # unusable? One query, in that device's context, which is then left.
        query = calls.index("cudaStreamGetCaptureInfo(1) -> none")
        assert calls[query - 1] == "cuCtxPushCurrent(ctx2)" and calls[query + 1].startswith("cuCtxPopCurrent")
        calls = calls[query + 2:]
        if calls[:1] == ["cuDevicePrimaryCtxRelease(2)"]:  # a context the scope found made is released again
            calls = calls[1:]
    expected = expected_calls(producer, consumer, 2, 0) + (view_event_calls(2, 0) if consumer == 2 else [])
    assert strip_event_ids(calls) == expected
    assert not any(call.startswith(BLOCKING) for call in cudart.log())
    exported = view.__cuda_array_interface__["stream"]
    assert exported == {None: 1, -1: None}.get(consumer, consumer)
    # Handing the view on orders its stream before the next consumer's.
    cudart.clear_log()
    for next_consumer in STREAMS:
        cudart.clear_log()
        view.__dlpack__(stream=next_consumer, max_version=(1, 0))
        assert strip_event_ids(ordering_calls(cudart.log())) == expected_calls(exported, next_consumer, 2, 0)


def test_same_device_needs_no_device_switch(cudart):
    host = np.zeros(4)
    register(cudart, host, DEVICE, device=0)
    cudart.add_stream(S1, 0)
    cai2dlpack(CaiArray(host, stream=S1), stream=S2)
    calls = strip_event_ids(ordering_calls(cudart.log()))
    assert "cudaSetDevice(0)" not in calls and "cudaSetDevice(2)" not in calls
    assert calls[-2:] == [f"cudaEventRecord(ev{{}}, {S1})", f"cudaStreamWaitEvent({S2}, ev{{}}, 0)"]


def test_events_are_pooled(cudart):
    host = np.zeros(4)
    register(cudart, host, DEVICE, device=1)
    for i in range(7):
        cudart.add_stream(S1 + i, 1)
    before = cudart.events_created
    for i in range(500):
        cai2dlpack(CaiArray(host, stream=S1 + (i % 7)), stream=S2)
    assert cudart.events_created - before <= 1
    assert cudart.log().count("cuCtxPushCurrent(ctx1)") == 500
    assert cudart.log().count("cuCtxPopCurrent() -> ctx0 current") == 500
    assert not any(call.startswith("cudaSetDevice") for call in cudart.log())


def test_event_made_on_data_device_without_timing(cudart):
    host = np.zeros(4)
    register(cudart, host, DEVICE, device=3)
    cudart.add_stream(S1, 3)
    cai2dlpack(CaiArray(host, stream=S1), stream=S2)
    log = cudart.log()
    creations = [i for i, call in enumerate(log) if call.startswith("cudaEventCreateWithFlags")]
    if creations:  # made here, not by an earlier test in this process
        assert log[creations[0]].startswith("cudaEventCreateWithFlags(0x2)")  # cudaEventDisableTiming
        assert "cuCtxPushCurrent(ctx3)" in log[: creations[0]]


FAILURES = {"cudaEventRecord": (700, "cudaErrorIllegalAddress"), "cudaStreamWaitEvent": (400, "cudaErrorInvalidResourceHandle"),
            "cudaGetDevice": (400, "cudaErrorInvalidResourceHandle")}
FAILURES.update({call: (201, "CUDA_ERROR_INVALID_CONTEXT") for call in
                 ("cuCtxGetCurrent", "cuDevicePrimaryCtxRetain", "cuCtxPushCurrent", "cuCtxGetId",
                  "cuDevicePrimaryCtxRelease")})


@pytest.mark.parametrize("failing", sorted(FAILURES))
def test_cuda_errors_leak_nothing_and_restore_the_device(cudart, failing):
    host = np.zeros(4)
    register(cudart, host, DEVICE, device=2)
    cudart.add_stream(S2, 1)  # the consumer's stream, and device 2's primary context is in use
    cudart.add_stream(0x7777, 2)
    obj = CaiArray(host, stream=1)  # the legacy stream: device 2's primary context is retained and pushed
    cai2dlpack(obj, stream=S2)  # the pooled event exists
    events = cudart.events_alive
    references = sys.getrefcount(obj)
    cudart.current_device = 1
    code, name = FAILURES[failing]
    cudart.fail(failing, code)
    with pytest.raises(CudaError, match=f"{failing} failed: {name}") as raised:
        cai2dlpack(obj, stream=S2)
    assert (raised.value.call, raised.value.code, raised.value.name) == (failing, code, name)
    assert cudart.current_device == 1 and cudart.context_device == 1 and cudart.lib.double_context_depth() == 1
    assert cudart.last_error == 0
    assert cudart.events_alive == events
    assert sys.getrefcount(obj) == references
    # The next conversion works.
    cai2dlpack(obj, stream=S2)
    assert cudart.current_device == 1


def test_event_creation_failure(cudart):
    # Device 7: no other test makes its pooled event, so this conversion must create one.
    host = np.zeros(4)
    cudart.lib.double_set_device_count(8)
    register(cudart, host, DEVICE, device=7)
    cudart.add_stream(S1, 7)
    cudart.fail("cudaEventCreateWithFlags", 2)
    with pytest.raises(CudaError, match="cudaEventCreateWithFlags failed: cudaErrorMemoryAllocation"):
        cai2dlpack(CaiArray(host, stream=S1), stream=S2)
    assert cudart.current_device == 0
    cai2dlpack(CaiArray(host, stream=S1), stream=S2)
    assert any(line.startswith("cudaEventCreateWithFlags(0x2) -> ev") for line in cudart.log())


def test_opt_outs(cudart, device_array):
    trust = cai_dlpack.options()["trust_streams"]  # whatever the environment said: not this test's subject
    try:
        assert cai_dlpack.options(sync=False) == {"sync": False, "export_stream": True, "trust_streams": trust}
        cai2dlpack(CaiArray(device_array, stream=S1), stream=S2)
        assert ordering_calls(cudart.log()) == []
        cai_dlpack.options(sync=True, export_stream=False)
        view = dlpack2cai(cai2dlpack(CaiArray(device_array), stream=S2), stream=S2)
        assert view.__cuda_array_interface__["stream"] is None
        with pytest.raises(TypeError, match="sync"):
            cai_dlpack.options(sync=1)
        assert cai_dlpack.options() == {"sync": True, "export_stream": False, "trust_streams": trust}
    finally:
        cai_dlpack.options(sync=True, export_stream=True)


@pytest.mark.parametrize("bad,error", [(0, ValueError), (-2, ValueError), (True, TypeError), ("1", TypeError),
                                       (2**64, ValueError)])
def test_bad_consumer_streams(cudart, device_array, bad, error):
    with pytest.raises(error, match="stream"):
        cai2dlpack(CaiArray(device_array, stream=S1), stream=bad)
    with pytest.raises(error, match="stream"):
        dlpack2cai(np.zeros(2), stream=bad)


@pytest.mark.parametrize("bad,error", [(0, ValueError), (-1, ValueError), (True, TypeError), (1.0, TypeError)])
def test_bad_producer_streams(cudart, device_array, bad, error):
    with pytest.raises(error, match="__cuda_array_interface__ 'stream'"):
        cai2dlpack(CaiArray(device_array, stream=bad))


@pytest.mark.parametrize("consumer", [None, 2, S2])
def test_zero_size_array_orders_nothing(cudart, consumer):
    """No elements, nothing to race on; and its NULL pointer names no device, so an event recorded on the
    guessed (current) device could not be recorded on a producer stream of another device."""
    cudart.current_device = 1
    cudart.clear_log()
    empty = CaiArray(np.zeros((0, 3), dtype=np.float32), stream=S1)
    capsule = cai2dlpack(empty, stream=consumer, max_version=(1, 0))
    view = dlpack2cai(DLPackShim(empty), stream=consumer)
    assert view.shape == (0, 3)
    assert not any(call.startswith(("cudaEventRecord", "cudaStreamWaitEvent", "cudaSetDevice"))
                   for call in cudart.log())
    assert cudart.current_device == 1
    del capsule


def test_a_view_exporting_its_stream_reports_a_context_it_could_not_put_back(cudart, device_array):
    """A view of device 2's memory exports its legacy stream after asking, in device 2's context, whether it
    captures: when the caller's context cannot be put back, the export raises, naming the driver's call."""
    view = dlpack2cai(cai2dlpack(CaiArray(device_array)))
    assert view.__cuda_array_interface__["stream"] == 1
    cudart.fail("cuCtxPopCurrent", 201)
    with pytest.raises(RuntimeError, match="cuCtxPopCurrent failed: CUDA_ERROR_INVALID_CONTEXT"):
        view.__cuda_array_interface__


def test_pinned_memory_of_no_device_is_ordered_in_device_0s_context(cudart):
    """Pinned memory whose pointer names no device (cudaPointerGetAttributes says -2) is ordered on the legacy
    stream of device 0's primary context, whatever device the caller is on."""
    host = np.arange(4, dtype=np.float32)
    register(cudart, host, PINNED_HOST, device=-2)
    cudart.current_device = 2
    cudart.clear_log()
    cai2dlpack(CaiArray(host, stream=1), stream=S2)
    log = cudart.log()
    assert [line for line in log if line.startswith(("cuCtxPush", "cuDevicePrimaryCtxRetain"))] == [
        "cuDevicePrimaryCtxRetain(0)", "cuCtxPushCurrent(ctx0)"], log
    assert cudart.current_device == 2


class StreamObject:
    """A stream of the CUDA stream protocol (cuda.core, tvm-ffi): __cuda_stream__() -> (version, handle)."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


@pytest.mark.parametrize("consumer", [1, 2, S2])
def test_stream_objects_order_like_their_handles(cudart, device_array, consumer):
    cai2dlpack(CaiArray(device_array, stream=S1), stream=consumer)
    by_int = strip_event_ids(ordering_calls(cudart.log()))
    cudart.clear_log()
    cai2dlpack(CaiArray(device_array, stream=S1), stream=StreamObject(consumer))
    assert strip_event_ids(ordering_calls(cudart.log())) == by_int == expected_calls(S1, consumer, 2, 0)
    cudart.clear_log()
    DLPackShim(CaiArray(device_array, stream=S1)).__dlpack__(stream=StreamObject(consumer))
    assert strip_event_ids(ordering_calls(cudart.log())) == by_int


def test_a_null_stream_object_is_the_legacy_stream_and_producers_get_an_int(cudart, device_array):
    asked = []

    class Producer:
        def __dlpack__(self, stream=None, max_version=None):
            asked.append(stream)
            return cai2dlpack(CaiArray(device_array), max_version=(1, 0))

    view = dlpack2cai(Producer(), stream=StreamObject(0))
    assert asked == [1] and view.__cuda_array_interface__["stream"] == 1
    dlpack2cai(Producer(), stream=StreamObject(S2))
    assert asked == [1, S2]


def test_a_stream_objects_pair_is_released_after_each_conversion(cudart, device_array):
    """The (version, handle) pair that __cuda_stream__() returns is released by every door that takes a stream
    object, whether the handle is taken or refused."""
    good, bad = tuple([0, S2]), tuple([0, -5])  # made at run time: no constant of the code object holds them

    class Returning:
        def __init__(self, pair):
            self.pair = pair

        def __cuda_stream__(self):
            return self.pair

    before = sys.getrefcount(good), sys.getrefcount(bad)
    for _ in range(100):
        cai2dlpack(CaiArray(device_array, stream=S1), stream=Returning(good))
        DLPackShim(CaiArray(device_array, stream=S1)).__dlpack__(stream=Returning(good))
        with pytest.raises(ValueError, match="whose handle is not a pointer"):
            cai2dlpack(CaiArray(device_array, stream=S1), stream=Returning(bad))
    assert (sys.getrefcount(good), sys.getrefcount(bad)) == before


@pytest.mark.parametrize("stream,error,message", [
    (object(), TypeError, "stream must be None or an int, not object (nor an object with __cuda_stream__)"),
    (StreamObject("x"), TypeError, "__cuda_stream__() returned (0, 'x'), not a (version, handle) pair of ints"),
    (StreamObject(-5), ValueError, "whose handle is not a pointer"),
])
def test_bad_stream_objects_are_refused_by_name(device_array, stream, error, message):
    with pytest.raises(error, match=re.escape(message)):
        cai2dlpack(CaiArray(device_array, stream=S1), stream=stream)


# ---- host reads of pinned and managed memory --------------------------------------------------------------

@pytest.fixture(params=[PINNED_HOST, MANAGED], ids=["pinned", "managed"])
def host_accessible(request, cudart):
    """Pinned or managed memory a CAI producer wrote on stream S1."""
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    register(cudart, host, request.param)
    cudart.add_stream(S1, 0)
    cudart.add_stream(S2, 0)
    return host


def host_syncs(cudart):
    return [line for line in cudart.log() if line.startswith(BLOCKING)]


@pytest.mark.parametrize("read", ["array_interface", "buffer"])
def test_a_host_read_waits_once_for_the_views_stream(cudart, host_accessible, read):
    """A host reader (NumPy, memoryview) knows no stream: before it gets the pointer, the host waits for the stream
    the producer made the data ready on (S2, the one dlpack2cai asked for). Once: the data stays ready."""
    view = dlpack2cai(DLPackShim(CaiArray(host_accessible, stream=S1)), stream=S2)
    assert host_syncs(cudart) == []  # making the view never blocks
    take = (lambda: np.asarray(view)) if read == "array_interface" else (lambda: np.asarray(memoryview(view)))
    np.testing.assert_array_equal(take(), host_accessible)
    assert host_syncs(cudart) == [f"cudaStreamSynchronize({S2})"]
    cudart.clear_log()
    view.__array_interface__, memoryview(view)
    assert host_syncs(cudart) == []
    # stream=-1 asks for no ordering: the caller has taken the duty, and the host read waits for nothing.
    unordered = dlpack2cai(DLPackShim(CaiArray(host_accessible, stream=S1)), stream=-1)
    np.asarray(unordered), memoryview(unordered)
    assert host_syncs(cudart) == []


def test_a_host_read_during_a_capture_of_the_views_stream_is_refused(cudart, host_accessible):
    view = dlpack2cai(DLPackShim(CaiArray(host_accessible, stream=S1)), stream=S2)
    capture = cudart.begin_capture(S2)
    with pytest.raises(CudaError, match="a host read of this DLPackView .* waits for stream 24576, .* capturing"):
        np.asarray(view)
    with pytest.raises(CudaError, match="a host read of this DLPackView"):
        memoryview(view)
    assert host_syncs(cudart) == [] and cudart.violations == 0
    assert cudart.end_capture(capture)  # the capture is whole
    np.testing.assert_array_equal(np.asarray(view), host_accessible)


def test_a_host_read_leaves_another_threads_capture_whole(cudart, host_accessible):
    view = dlpack2cai(DLPackShim(CaiArray(host_accessible, stream=S1)), stream=S2)
    capture = cudart.begin_capture(0x7000, 0, GLOBAL, other_thread=True)
    np.asarray(view)
    assert host_syncs(cudart) == [f"cudaStreamSynchronize({S2})"]
    assert cudart.violations == 0 and cudart.end_capture(capture)


# ---- what a view remembers of the stream it was made for ---------------------------------------------------
# 1 and 2 name the legacy / per-thread default stream of the caller's current device, and 2 the calling thread's:
# a view keeps what they named when it was made, not the handle.

@pytest.fixture
def sync_restored():
    yield
    options(sync=True)


def test_a_host_read_on_another_thread_waits_for_the_making_threads_per_thread_stream(cudart, host_accessible):
    """The view is made (S1 ordered before this thread's per-thread stream) on this thread; a host read on another
    thread waits for the event recorded on this thread's stream then, never for its own per-thread stream, which
    never waited for S1."""
    view = dlpack2cai(DLPackShim(CaiArray(host_accessible, stream=S1)), stream=2)
    assert any(line.startswith("cudaStreamWaitEvent(2,") for line in cudart.log())
    marked = [line for line in cudart.log() if line.startswith("cudaEventRecord(") and line.endswith(", 2)")]
    assert len(marked) == 1  # the view's own event, on this thread's stream 2 after the wait
    event = marked[0][len("cudaEventRecord("):].split(",")[0]
    cudart.clear_log()
    read = []
    reader = threading.Thread(target=lambda: read.append(np.asarray(view).copy()))
    reader.start()
    reader.join()
    np.testing.assert_array_equal(read[0], host_accessible)
    assert host_syncs(cudart) == [f"cudaEventSynchronize({event})"]
    del view
    assert f"cudaEventDestroy({event})" in cudart.log()  # the view's event goes with it


def test_a_host_read_after_the_current_device_changed_waits_for_the_making_devices_stream(cudart, host_accessible):
    """A legacy-stream view of pinned or managed memory made while device 1 is current: S1 is ordered before
    device 1's legacy stream. A host read after cudaSetDevice(0) waits for that stream, in device 1's context."""
    cudart.current_device = 1
    cudart.log_context(True)
    view = dlpack2cai(DLPackShim(CaiArray(host_accessible, stream=S1)))
    waits = [line for line in cudart.log() if line.startswith("cudaStreamWaitEvent(1,")]
    assert len(waits) == 1 and waits[0].endswith("@ctx1")
    cudart.clear_log()
    cudart.current_device = 0
    np.asarray(view)
    assert host_syncs(cudart) == ["cudaStreamSynchronize(1) @ctx1"]
    assert cudart.current_device == 0


def test_a_host_read_waits_as_the_sync_option_was_when_the_view_was_made(cudart, host_accessible, sync_restored):
    """options() is process-wide and may be switched by any library later: a view made under sync=True waits for
    its stream at its first host read whatever the option says by then, and one made under sync=False (nothing
    ordered its stream after the producer's) waits for nothing, as the README says."""
    ordered = dlpack2cai(DLPackShim(CaiArray(host_accessible, stream=S1)), stream=S2)
    options(sync=False)
    unordered = dlpack2cai(DLPackShim(CaiArray(host_accessible, stream=S1)), stream=S2)
    cudart.clear_log()
    np.asarray(ordered)
    assert host_syncs(cudart) == [f"cudaStreamSynchronize({S2})"]
    options(sync=True)
    cudart.clear_log()
    np.asarray(unordered)
    assert host_syncs(cudart) == []


def test_numpy_from_dlpack_of_a_view_waits_once_like_its_array_interface(cudart, host_accessible):
    """numpy.from_dlpack calls __dlpack__ with no stream and reads pinned and managed memory on the host at once:
    a host consumer, owed the host readers' wait (once per view). A consumer that names a stream is not."""
    view = dlpack2cai(DLPackShim(CaiArray(host_accessible, stream=S1)), stream=S2)
    cudart.clear_log()
    view.__dlpack__(stream=S1, max_version=(1, 0))
    view.__dlpack__(stream=S1, max_version=None)  # a legacy consumer that names its stream
    assert host_syncs(cudart) == []
    a = np.from_dlpack(view)
    assert a.__array_interface__["data"][0] == host_accessible.__array_interface__["data"][0]  # shared
    assert host_syncs(cudart) == [f"cudaStreamSynchronize({S2})"]
    cudart.clear_log()
    np.from_dlpack(view), np.asarray(view)
    assert host_syncs(cudart) == []


def test_a_view_for_one_threads_per_thread_stream_re_exported_on_another_waits_for_it(cudart):
    """A view made with stream=2 on a worker thread, copied on this thread for this thread's per-thread stream: this
    thread's stream first waits for the event the view recorded on the worker's, then the copies are queued."""
    device = np.arange(24, dtype=np.float32)
    register(cudart, device, DEVICE, 0)
    producer = DLPackShim(CaiArray(device, stream=None))
    made = []
    worker = threading.Thread(target=lambda: made.append(dlpack2cai(producer, stream=2)))
    worker.start()
    worker.join()
    view = made[0]
    marked = [line for line in cudart.log() if line.startswith("cudaEventRecord(") and line.endswith(", 2)")]
    event = marked[-1][len("cudaEventRecord("):].split(",")[0]
    cudart.clear_log()
    capsule = view.__dlpack__(stream=2, copy=True, max_version=(1, 0))
    log = cudart.log()
    first_copy = next(i for i, line in enumerate(log) if line.startswith(("cudaMemcpyAsync", "cudaMemcpy2DAsync")))
    assert f"cudaStreamWaitEvent(2, {event}, 0)" in log[:first_copy], log
    del capsule


def test_a_per_thread_stream_view_made_during_its_capture_is_refused_on_another_thread(cudart, host_accessible):
    """While the making thread's per-thread stream captures, no event can mark the data ready (it would be a node
    of the graph): another thread, which cannot name that stream, is refused a host read or a re-export."""
    capture = cudart.begin_capture(2, 0)
    view = dlpack2cai(DLPackShim(CaiArray(host_accessible, stream=None)), stream=2)
    assert cudart.end_capture(capture)
    errors = []

    def use():
        for use in (lambda: np.asarray(view), lambda: view.__dlpack__(stream=1, max_version=(1, 0))):
            try:
                use()
            except BufferError as error:
                errors.append(str(error))

    other = threading.Thread(target=use)
    other.start()
    other.join()
    assert len(errors) == 2 and all("made with stream=2 on another thread" in error for error in errors), errors


@pytest.mark.parametrize("call", ["cudaEventCreateWithFlags", "cudaEventRecord"])
def test_a_per_thread_stream_view_whose_event_cannot_be_made_is_not_made(cudart, host_accessible, call):
    cudart.fail(call, 2)
    with pytest.raises(CudaError, match=call):
        dlpack2cai(DLPackShim(CaiArray(host_accessible, stream=None)), stream=2)


def _view_made_on_a_worker_for_its_per_thread_stream(cudart):
    device = np.arange(24, dtype=np.float32)
    register(cudart, device, DEVICE, 0)
    producer = DLPackShim(CaiArray(device, stream=None))
    made = []
    worker = threading.Thread(target=lambda: made.append(dlpack2cai(producer, stream=2)))
    worker.start()
    worker.join()
    marked = [line for line in cudart.log() if line.startswith("cudaEventRecord(") and line.endswith(", 2)")]
    return made[0], marked[-1][len("cudaEventRecord("):].split(",")[0]


def test_a_per_thread_stream_view_re_exported_into_this_threads_capture_joins_it_by_an_external_wait(cudart):
    """This thread's per-thread stream captures: the wait for the view's event (recorded before, outside any
    capture) is an external one, a node of the graph that waits at each launch; the capture stays whole."""
    view, event = _view_made_on_a_worker_for_its_per_thread_stream(cudart)
    capture = cudart.begin_capture(2, 0)
    cudart.clear_log()
    view.__dlpack__(stream=2, max_version=(1, 0))
    assert f"cudaStreamWaitEvent(2, {event}, 1)" in cudart.log()
    assert cudart.violations == 0 and cudart.end_capture(capture)


def test_a_failed_wait_for_a_per_thread_stream_views_event_is_raised(cudart):
    view, _ = _view_made_on_a_worker_for_its_per_thread_stream(cudart)
    cudart.fail("cudaStreamWaitEvent", 400)
    with pytest.raises(CudaError, match="cudaStreamWaitEvent"):
        view.__dlpack__(stream=2, max_version=(1, 0))


def test_a_failed_host_wait_for_a_per_thread_stream_views_event_is_raised_and_tried_again(cudart, host_accessible):
    view = dlpack2cai(DLPackShim(CaiArray(host_accessible, stream=S1)), stream=2)
    cudart.fail("cudaEventSynchronize", 700)
    with pytest.raises(CudaError, match="cudaEventSynchronize"):
        view.__array_interface__
    cudart.clear_log()
    np.asarray(view)  # not marked ready by the failed wait: the next read waits again
    assert len(host_syncs(cudart)) == 1


def test_a_views_event_is_destroyed_leaving_the_runtimes_last_error_as_it_found_it(cudart):
    """The event a view recorded on the per-thread stream it was made for is destroyed with the view: another
    library's error pending in the runtime is not cleared by that (not ours to clear), and a failure of the
    destruction itself is not left pending (ours, cleared)."""
    device = np.arange(24, dtype=np.float32)
    register(cudart, device, DEVICE, 0)

    def view_with_an_event():
        view = dlpack2cai(DLPackShim(CaiArray(device, stream=None)), stream=2)
        assert any(line.startswith("cudaEventRecord(") and line.endswith(", 2)") for line in cudart.log())
        cudart.clear_log()
        return view

    view = view_with_an_event()
    assert cudart.lib.cudaSetDevice(99) != 0  # another library's failure, left pending
    pending = cudart.last_error
    del view
    gc.collect()
    assert any(line.startswith("cudaEventDestroy(") for line in cudart.log())
    assert cudart.last_error == pending != 0
    cudart.lib.cudaGetLastError()
    view = view_with_an_event()
    cudart.fail("cudaEventDestroy", 400)
    del view
    gc.collect()
    assert any(line.startswith("cudaEventDestroy(") for line in cudart.log())
    assert cudart.last_error == 0


OFF_WORDS, ON_WORDS = ["0", "false", "False", "FALSE", "no", "No", "off", "OFF"], ["1", "true", "True", "yes", "on",
                                                                                  "anything", ""]


def test_the_environment_sets_each_option_at_import():
    """CAI_DLPACK_SYNC and CAI_DLPACK_EXPORT_STREAM, read when the module is imported: 0, false, no and off (in
    any case) switch an option off; any other value, or none, leaves it on. CAI_DLPACK_TRUST_STREAMS, off by default, is
    switched on by 1, true, yes and on alone. Each value in a fresh interpreter."""
    import json
    import subprocess

    script = "import json, cai_dlpack; print(json.dumps(cai_dlpack.options()))"
    for word in OFF_WORDS + ON_WORDS:
        env = dict(os.environ, CAI_DLPACK_SYNC=word, CAI_DLPACK_EXPORT_STREAM="off" if word == "1" else word,
                   CAI_DLPACK_TRUST_STREAMS=word)
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        on = word not in OFF_WORDS
        assert json.loads(result.stdout) == {"sync": on, "export_stream": on and word != "1",
                                             "trust_streams": word in ("1", "true", "True", "yes", "on")}, word


def test_a_views_dlpack_with_no_keyword_is_a_host_consumers_and_waits_once(cudart, host_accessible):
    """__dlpack__() with no keyword at all (no stream, no copy) is asked as a host consumer asks: owed the host
    readers' wait, once per view."""
    view = dlpack2cai(DLPackShim(CaiArray(host_accessible, stream=S1)), stream=S2)
    cudart.clear_log()
    capsule = view.__dlpack__()
    assert host_syncs(cudart) == [f"cudaStreamSynchronize({S2})"]
    cudart.clear_log()
    view.__dlpack__(), np.asarray(view)
    assert host_syncs(cudart) == []
    del capsule


def test_cuda_errors_leak_nothing(cudart, device_array):
    """A CudaError raised for a runtime call that failed keeps its code, call and name, and holds nothing more: traced
    memory stays flat over thousands (a leaked code int alone would grow a round by about 96 KiB)."""
    import tracemalloc

    obj = CaiArray(device_array, stream=S1)
    calls = 3000

    def failed():
        try:  # (not pytest.raises: it keeps a little of each call)
            cai2dlpack(obj, stream=S2)
        except CudaError as error:
            assert (error.code, error.call) == (400, "cudaStreamGetCaptureInfo")
        else:
            raise AssertionError("no CudaError")

    cudart.fail("cudaStreamGetCaptureInfo", 400, count=100 + 3 * calls)
    for _ in range(100):
        failed()
    tracemalloc.start()
    growth = []
    try:
        for _ in range(3):  # a leak grows in every round; memory freed late swings from one round to the next
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(calls):
                failed()
            growth.append(tracemalloc.get_traced_memory()[0] - before)
    finally:
        tracemalloc.stop()
    assert min(growth) < 16 * 1024, growth


def test_a_failed_capture_query_of_the_callers_stream_for_host_accessible_memory_raises(cudart, host_accessible):
    """Pinned and managed memory produced on S1 for the caller's legacy stream: that stream is asked whether it
    captures, in the caller's context, before anything is ordered. A failed query is a CudaError, nothing ordered."""
    obj = CaiArray(host_accessible, stream=S1)
    cudart.clear_log()
    cudart.fail("cudaStreamGetCaptureInfo", 400)
    with pytest.raises(CudaError, match="cudaStreamGetCaptureInfo failed: cudaErrorInvalidResourceHandle"):
        cai2dlpack(obj, stream=1, max_version=(1, 0))
    assert not any(line.startswith(("cudaEventRecord", "cudaStreamWaitEvent")) for line in cudart.log())
    assert cudart.last_error == 0


def test_a_stream_int_given_to_dlpack2cai_is_not_kept(cudart, device_array):
    """dlpack2cai(producer, stream=s) hands the producer s itself and keeps no reference to it."""
    stream = int(str(S2))  # an int object of its own (not one of CPython's cached small ints)
    producer = DLPackShim(CaiArray(device_array, stream=S1))
    dlpack2cai(producer, stream=stream)
    before = sys.getrefcount(stream)
    for _ in range(200):
        dlpack2cai(producer, stream=stream)
    assert sys.getrefcount(stream) == before


def test_the_first_thread_to_name_its_per_thread_stream_is_known_by_it_ever_after():
    """In a fresh process, the first thread to hand a tensor over for its per-thread stream (stream=2) is known by
    the same number from its first call on: the tensor's release is recorded on that thread's per-thread stream
    (2), as its own, not on the legacy stream (which another thread's release falls back to)."""
    out = run_with_double(f"""
        from cai_dlpack import DLPackShim, dlpack2cai
        host = np.arange(8, dtype=np.float32)
        register(double, host, DEVICE)
        double.add_stream({S1}, 0)
        view = dlpack2cai(DLPackShim(CaiArray(host, stream={S1})), stream=2)
        double.clear_log()
        del view  # its tensor's release is recorded on the stream it was handed over for
        print(*[line.split(", ")[-1].rstrip(")") for line in double.log() if line.startswith("cudaEventRecord(")])
    """)
    assert out and set(out) == {"2"}, out


PINNED_VIEW_WITHOUT_A_RUNTIME = """
import os, sys
import numpy as np
sys.path[:0] = [p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p]
import cai_dlpack
from support.dlpack_ctypes import MadeTensor
host = np.zeros(3, dtype=np.float32)
made = MadeTensor(data=host.ctypes.data, device=(3, 0), shape=(3,))  # pinned memory
try:
    cai_dlpack.dlpack2cai(made.capsule, stream={stream})
except Exception as error:
    print("ERROR", type(error).__name__, error)
else:
    print("MADE")
print("deleted", made.deleted)
"""


@pytest.mark.parametrize("stream", [1, 2])
def test_a_pinned_view_for_a_default_stream_raises_when_the_runtime_cannot_load(stream):
    """A view of pinned memory for the legacy or per-thread stream is made for the caller's current device, which
    only the runtime can name: where no runtime loads, the view is refused with the loader's error and the tensor
    handed back to its producer."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), CAI_DLPACK_CUDART="/nowhere/libcudart.so.99")
    result = subprocess.run([sys.executable, "-c", PINNED_VIEW_WITHOUT_A_RUNTIME.format(stream=stream)], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("ERROR RuntimeError CAI_DLPACK_CUDART names a CUDA runtime that could not be loaded: "
                               "/nowhere/libcudart.so.99"), lines
    assert lines[1:] == ["deleted 1"]


@pytest.mark.parametrize("kwargs", [dict(dl_device=None, copy=False), dict(dl_device=None, copy=None)],
                         ids=["no device, no copy", "no device, copy None"])
def test_a_views_dlpack_owes_the_host_wait_to_a_consumer_that_takes_it_where_it_is(cudart, host_accessible, kwargs):
    """A consumer of pinned or managed memory that names no stream and no device (None), and asks for no copy, reads
    it on the host where it is: it is owed the host readers' wait, once."""
    view = dlpack2cai(DLPackShim(CaiArray(host_accessible, stream=S1)), stream=S2)
    cudart.clear_log()
    view.__dlpack__(max_version=(1, 0), **kwargs)
    view.__dlpack__(max_version=(1, 0), **kwargs)
    assert host_syncs(cudart) == [f"cudaStreamSynchronize({S2})"]
