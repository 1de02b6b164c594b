"""Conversions inside CUDA graph capture, through the runtime double: every cell of the README's table (producer
stream x consumer stream, each capturing or not, in one capture or two, the legacy stream usable or not) through
every door, in every capture mode. The capture is never invalidated (the double counts each call CUDA would
refuse), the host never blocks, and where no ordering keeps the capture whole and the replay right, the
conversion raises CudaError naming the capture and the error CUDA would have given, having called nothing."""
import ctypes
import itertools
import os
import re
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from cai_dlpack import CudaError, DLPackShim, DLPackView, cai2dlpack, cuda_runtime_info, dlpack2cai
from support import c_example, cuda_double
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE, GLOBAL, MANAGED, RELAXED, THREAD_LOCAL
from support.dlpack_ctypes import DLManagedTensorVersioned, _api
from support.fresh_process import live_tracebacks

LEGACY, PER_THREAD = 1, 2
P_HANDLE, C_HANDLE, BYSTANDER = 0x5000, 0x6000, 0x7000
BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")

# A stream's part in the capture, as the table's rows (producer) and columns (consumer) name it.
FREE = "not capturing"
SAME = "capturing, in the consumer's capture"
OTHER = "capturing, in a capture the consumer is not in"
CAPTURING = "capturing"
BLOCKED = "legacy, while a blocking stream of its device captures"
INVALIDATED = "in a capture already invalidated"

# What the conversion does: the README's table, as data.
ORDER, EXTERNAL = "record, wait", "record, external wait"
IMPLICIT, INVALID, MERGE, CAPTURED_EVENT = 906, 901, 902, 907
TABLE = {
    FREE: {FREE: ORDER, CAPTURING: EXTERNAL, BLOCKED: IMPLICIT, INVALIDATED: INVALID},
    SAME: {CAPTURING: ORDER},
    OTHER: {FREE: CAPTURED_EVENT, CAPTURING: MERGE, BLOCKED: IMPLICIT, INVALIDATED: INVALID},
    BLOCKED: {FREE: IMPLICIT, CAPTURING: IMPLICIT, BLOCKED: IMPLICIT, INVALIDATED: IMPLICIT},
    INVALIDATED: {FREE: INVALID, CAPTURING: INVALID, BLOCKED: IMPLICIT, INVALIDATED: INVALID},
}
ERROR_NAMES = {IMPLICIT: "cudaErrorStreamCaptureImplicit", INVALID: "cudaErrorStreamCaptureInvalidated",
               MERGE: "cudaErrorStreamCaptureMerge", CAPTURED_EVENT: "cudaErrorCapturedEvent"}


def states_of(stream, role):
    if stream == LEGACY:  # never captures: usable or not
        return [FREE, BLOCKED]
    return [FREE, SAME, OTHER, INVALIDATED] if role == "producer" else [FREE, CAPTURING, INVALIDATED]


def possible(producer, made, consumer, used):
    """A cell CUDA can be in: SAME needs a capturing consumer, and the per-thread default stream synchronizes with
    the legacy stream, so while it captures the legacy stream of its device is unusable."""
    if made == SAME and used != CAPTURING:
        return False
    per_thread_captures = (producer == PER_THREAD and made != FREE) or (consumer == PER_THREAD and used != FREE)
    legacy_free = (producer == LEGACY and made == FREE) or (consumer == LEGACY and used == FREE)
    return not (per_thread_captures and legacy_free)


CELLS = [(p, made, c, used)
         for p, c in itertools.product([LEGACY, PER_THREAD, P_HANDLE], [LEGACY, PER_THREAD, C_HANDLE]) if p != c
         for made in states_of(p, "producer") for used in states_of(c, "consumer") if possible(p, made, c, used)]
NAMES = {LEGACY: "legacy", PER_THREAD: "per-thread", P_HANDLE: "handle", C_HANDLE: "handle"}


def cell_id(cell):
    p, made, c, used = cell
    return f"{NAMES[p]}:{made.split(',')[0].split(' ')[0]}-{NAMES[c]}:{used.split(',')[0].split(' ')[0]}" + (
        "-same" if made == SAME else "-other" if made == OTHER else "")


def begin_world(cudart, cell, mode=GLOBAL, other_thread=False, device=0):
    """Starts the captures the cell describes; returns {capture id: expected to end valid}. Handles capture as
    non-blocking streams (as PyTorch's), the per-thread default stream as the blocking stream it is."""
    producer, made, consumer, used = cell
    captures = {}

    def begin(stream, blocking=None):
        capture = cudart.begin_capture(stream, device, mode, blocking=stream == PER_THREAD if blocking is None
                                       else blocking, other_thread=other_thread)
        captures[capture] = True
        return capture

    if used in (CAPTURING, INVALIDATED):
        consumer_capture = begin(consumer)
        if used == INVALIDATED:
            cudart.invalidate_capture(consumer_capture)
            captures[consumer_capture] = False
        if made == SAME:
            cudart.join_capture(producer, consumer_capture, device, blocking=producer == PER_THREAD)
    if made in (OTHER, INVALIDATED):
        producer_capture = begin(producer)
        if made == INVALIDATED:
            cudart.invalidate_capture(producer_capture)
            captures[producer_capture] = False
    legacy_blocked = BLOCKED in (made, used)
    already = any(stream == PER_THREAD and state != FREE for stream, state in ((producer, made), (consumer, used)))
    if legacy_blocked and not already:
        begin(BYSTANDER, blocking=True)
    return captures


def end_world(cudart, captures):
    assert {capture: cudart.end_capture(capture) for capture in captures} == captures
    assert cudart.violations == 0


def order_calls(log):
    return [re.sub(r"ev\d+", "ev", line) for line in log if line.startswith(("cudaEventRecord", "cudaStreamWaitEvent"))]


def expected_order(cell):
    producer, made, consumer, used = cell
    outcome = TABLE[made][used]
    if outcome == ORDER:
        return [f"cudaEventRecord(ev, {producer})", f"cudaStreamWaitEvent({consumer}, ev, 0)"]
    if outcome == EXTERNAL:
        return [f"cudaEventRecord(ev, {producer})", f"cudaStreamWaitEvent({consumer}, ev, 1)"]
    return []


@pytest.fixture
def data(cudart):
    host = np.arange(8, dtype=np.float32)
    register(cudart, host, DEVICE, device=0)
    cai2dlpack(CaiArray(host, stream=P_HANDLE), stream=C_HANDLE)  # the shared pooled event exists
    cudart.clear_log()
    return host


@pytest.fixture(scope="module")
def example():
    return c_example.build()


def through(door, example, obj, consumer):
    if door == "cai2dlpack":
        return cai2dlpack(obj, stream=consumer)
    if door == "__dlpack__":
        return DLPackShim(obj).__dlpack__(stream=consumer, max_version=(1, 0))
    if door == "dlpack2cai":
        return dlpack2cai(DLPackShim(obj), stream=consumer)
    if door == "c_api_fill":
        return example.fill(obj, consumer)
    if door == "c_api_managed":
        return example.managed(obj, consumer)
    raise AssertionError(door)


def stream_words(stream):
    """A stream as the refusals name it."""
    return {LEGACY: "the legacy default stream", PER_THREAD: "the per-thread default stream"}.get(
        stream, f"stream {stream}")


def refusal_naming(cell):
    """A pattern of the refusal's message for the cell: which stream (producer or consumer) is at fault, by value."""
    producer, made, consumer, used = cell
    p, c = re.escape(stream_words(producer)), re.escape(stream_words(consumer))
    outcome = TABLE[made][used]
    if outcome == IMPLICIT:  # dlpack2cai refuses its consumer's stream before it asks the producer for a tensor
        return ("the producer stream is" if made == BLOCKED else
                "(the consumer stream|dlpack2cai's stream \\(None\\)) is") + " the legacy default stream"
    if outcome == INVALID:
        return f"the capture on {p if made == INVALIDATED else c} \\(capture id \\d+\\) was already invalidated"
    if outcome == MERGE:
        return f"producer {p} is capturing CUDA graph capture \\d+ and consumer {c} capture \\d+"
    return f"producer {p} is capturing a CUDA graph \\(capture id \\d+\\).* and consumer {c}, outside"


def check_cell(cudart, cell, convert):
    producer, made, consumer, used = cell
    outcome = TABLE[made][used]
    if isinstance(outcome, int):
        with pytest.raises(CudaError, match="break a CUDA graph capture") as raised:
            convert()
        assert (raised.value.code, raised.value.name) == (outcome, ERROR_NAMES[outcome])
        assert raised.value.call in ("cudaEventRecord", "cudaStreamWaitEvent")
        message = str(raised.value)
        if outcome in (INVALID, MERGE, CAPTURED_EVENT):
            assert re.search(r"capture(?: id)? \d+", message)  # the capture is named
        else:
            assert "legacy default stream" in message
        assert re.search(refusal_naming(cell), message), (refusal_naming(cell), message)
    else:
        result = convert()  # kept until the log is read: dropping it records its release on the consumer stream
        assert result is not None
    # A tensor the C API made and dropped records its release on the consumer stream: not an ordering call.
    log = [line for line in cudart.log() if not line.startswith("cudaEventRecord(ev")
           or not line.endswith(f", {consumer})") or consumer == producer]
    assert order_calls(log) == expected_order(cell)
    assert not any(line.startswith(BLOCKING) for line in log)
    assert cudart.last_error == 0


@pytest.mark.parametrize("door", ["cai2dlpack", "__dlpack__", "dlpack2cai", "c_api_fill", "c_api_managed"])
@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_every_cell_through_every_door(cudart, data, example, door, cell):
    captures = begin_world(cudart, cell)
    check_cell(cudart, cell, lambda: through(door, example, CaiArray(data, stream=cell[0]), cell[2]))
    end_world(cudart, captures)


@pytest.mark.parametrize("mode,other_thread", [(GLOBAL, False), (GLOBAL, True), (THREAD_LOCAL, False),
                                               (THREAD_LOCAL, True), (RELAXED, False)])
@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_every_cell_in_every_capture_mode(cudart, data, cell, mode, other_thread):
    """The mode decides which unsafe calls a capture forbids; a conversion makes none (events, waits, capture
    queries, context push and pop are all allowed during any capture), so the table holds in every mode, for
    captures this thread began and captures another thread began."""
    captures = begin_world(cudart, cell, mode, other_thread)
    check_cell(cudart, cell, lambda: cai2dlpack(CaiArray(data, stream=cell[0]), stream=cell[2]))
    end_world(cudart, captures)


@pytest.mark.parametrize("cell", [cell for cell in CELLS if cell[2] == LEGACY], ids=cell_id)
def test_exchange_api_cells(cudart, data, example, cell):
    """The exchange API's no-sync calls order the producer before the legacy stream they report."""
    captures = begin_world(cudart, cell)
    check_cell(cudart, cell, lambda: example.exchange_dltensor(DLPackShim(CaiArray(data, stream=cell[0]))))
    end_world(cudart, captures)


def test_the_table_is_complete():
    """Every cell has an answer, and every stream kind meets every other in each state it can be in."""
    for producer, made, consumer, used in CELLS:
        assert used in TABLE[made]
    assert len(CELLS) == 50  # 7 pairs of distinct stream kinds, each in the states it can be in


# ---- the columns where nothing is ordered: no capture query at all ----------------------------------

CAPTURE_CALLS = ("cudaStreamGetCaptureInfo", "cudaEventRecord", "cudaStreamWaitEvent")


@pytest.mark.parametrize("producer,made", [(LEGACY, FREE), (LEGACY, BLOCKED)] + [
    (stream, state) for stream in (PER_THREAD, P_HANDLE) for state in (FREE, OTHER, INVALIDATED)])
def test_consumer_minus_one_asks_nothing(cudart, data, producer, made):
    cell = (producer, made, C_HANDLE, FREE)
    captures = begin_world(cudart, cell)
    cai2dlpack(CaiArray(data, stream=producer), stream=-1)
    dlpack2cai(DLPackShim(CaiArray(data, stream=producer)), stream=-1)
    assert not any(line.startswith(CAPTURE_CALLS) for line in cudart.log())
    end_world(cudart, captures)


@pytest.mark.parametrize("stream", [PER_THREAD, C_HANDLE])
def test_same_stream_in_a_capture_asks_nothing(cudart, data, stream):
    captures = {cudart.begin_capture(stream, 0, GLOBAL, blocking=stream == PER_THREAD): True}
    cai2dlpack(CaiArray(data, stream=stream), stream=stream)
    assert not any(line.startswith(CAPTURE_CALLS) for line in cudart.log())
    end_world(cudart, captures)


@pytest.mark.parametrize("consumer", [None, LEGACY, PER_THREAD, C_HANDLE])
def test_no_producer_stream_asks_nothing(cudart, data, consumer):
    """A CAI without a stream, host memory, and an array without elements: nothing to order, nothing asked, even
    with the legacy stream unusable and the consumer capturing."""
    captures = {cudart.begin_capture(BYSTANDER, 0, GLOBAL, blocking=True): True}
    if consumer in (PER_THREAD, C_HANDLE):
        captures[cudart.begin_capture(consumer, 0, GLOBAL)] = True
    cai2dlpack(CaiArray(data), stream=consumer)
    cai2dlpack(np.arange(3.0), stream=consumer)
    cai2dlpack(CaiArray(np.zeros((0, 2), dtype=np.float32), stream=P_HANDLE), stream=consumer)
    assert not any(line.startswith(CAPTURE_CALLS) for line in cudart.log())
    end_world(cudart, captures)


def test_sync_off_asks_nothing(cudart, data):
    import cai_dlpack

    captures = {cudart.begin_capture(P_HANDLE, 0, GLOBAL): True}
    try:
        cai_dlpack.options(sync=False)
        cai2dlpack(CaiArray(data, stream=P_HANDLE), stream=C_HANDLE)
    finally:
        cai_dlpack.options(sync=True)
    assert not any(line.startswith(CAPTURE_CALLS) for line in cudart.log())
    end_world(cudart, captures)


# ---- the external wait, contexts and devices ---------------------------------------------------------

def event_of(line):
    return re.search(r"ev(\d+)", line).group(1)


def events_used(log):
    return [event_of(line) for line in log if line.startswith(("cudaEventRecord", "cudaStreamWaitEvent"))]


def test_external_wait_uses_its_own_event_per_producer_stream(cudart, data):
    """A graph keeps the event of its external wait and waits, at each launch, on its latest record: that event is
    never the shared one (recorded in captures and on any stream), and is recorded again only on the same
    producer stream, outside any capture."""
    cai2dlpack(CaiArray(data, stream=P_HANDLE), stream=C_HANDLE)
    shared = events_used(cudart.log())[0]
    capture = cudart.begin_capture(C_HANDLE, 0, GLOBAL)
    cudart.clear_log()
    cai2dlpack(CaiArray(data, stream=P_HANDLE), stream=C_HANDLE)
    first = events_used(cudart.log())
    cudart.clear_log()
    cai2dlpack(CaiArray(data, stream=P_HANDLE + 1), stream=C_HANDLE)
    second = events_used(cudart.log())
    assert first[0] == first[1] != shared
    assert second[0] == second[1] not in (shared, first[0])
    cudart.clear_log()
    cai2dlpack(CaiArray(data, stream=P_HANDLE), stream=C_HANDLE)  # the same producer stream: the same event
    assert events_used(cudart.log()) == first
    assert cudart.end_capture(capture) and cudart.violations == 0
    created = cudart.events_created
    cudart.clear_log()
    cai2dlpack(CaiArray(data, stream=P_HANDLE), stream=C_HANDLE)  # after the capture: the shared event again
    assert events_used(cudart.log()) == [shared, shared] and cudart.events_created == created


_FRESH_PRODUCERS = itertools.count(0x7A000000, 0x100)  # stream handles no other test uses, new on each use


def test_every_pooled_event_is_found_again(cudart, data):
    """The pool keeps 64 events and finds each kept one again, whatever slot it fell in. 64 new external-wait
    entries (one per producer stream) fill every slot, whatever the pool held before (another test's entries, or
    none); the next 64 conversions of the same streams then make no event at all."""
    producers = [next(_FRESH_PRODUCERS) for _ in range(64)]
    capture = cudart.begin_capture(C_HANDLE, 0, GLOBAL)
    for producer in producers:
        cai2dlpack(CaiArray(data, stream=producer), stream=C_HANDLE)
    created = cudart.events_created
    for producer in producers:
        cai2dlpack(CaiArray(data, stream=producer), stream=C_HANDLE)
    assert cudart.events_created == created
    assert cudart.end_capture(capture) and cudart.violations == 0


def test_per_thread_producer_streams_of_two_threads_have_their_own_external_events(cudart, data):
    """Every thread's per-thread default stream is the value 2, but each is a different stream: a graph that waits
    on thread A's stream 2 must never see that event recorded again on thread B's, or a replay would run after B's
    work instead of A's. The double models stream 2 per thread and counts such a record as a violation."""
    first = cudart.begin_capture(C_HANDLE, 0, RELAXED)
    second = cudart.begin_capture(C_HANDLE + 1, 0, RELAXED)
    used = {}

    def convert(name, consumer):
        log_start = len(cudart.log())
        cai2dlpack(CaiArray(data, stream=PER_THREAD), stream=consumer)
        used[name] = events_used(cudart.log()[log_start:])

    convert("main", C_HANDLE)
    worker = threading.Thread(target=convert, args=("worker", C_HANDLE + 1))
    worker.start()
    worker.join()
    convert("main again", C_HANDLE)  # the same thread's stream 2: the same event as before
    assert used["main"][0] == used["main"][1] == used["main again"][0]
    assert used["worker"][0] == used["worker"][1] != used["main"][0]
    # A later thread may be given the exited worker's id: its stream is still another stream.
    third = cudart.begin_capture(C_HANDLE + 2, 0, RELAXED)
    worker = threading.Thread(target=convert, args=("next worker", C_HANDLE + 2))
    worker.start()
    worker.join()
    assert used["next worker"][0] not in (used["worker"][0], used["main"][0])
    assert cudart.violations == 0, cudart.log()
    assert cudart.end_capture(first) and cudart.end_capture(second) and cudart.end_capture(third)


def test_a_producer_on_another_device_joins_the_capture_in_its_context(cudart):
    """Device memory of device 2 made on its stream, consumed on a capturing stream of device 2 by a caller on
    device 0: the external wait happens in device 2's context, and the caller's context comes back."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=2)
    cudart.add_stream(P_HANDLE, 2)
    cudart.add_stream(C_HANDLE, 2)
    capture = cudart.begin_capture(C_HANDLE, 2, GLOBAL)
    cai2dlpack(CaiArray(host, stream=P_HANDLE), stream=C_HANDLE)
    log = cudart.log()
    assert order_calls(log) == [f"cudaEventRecord(ev, {P_HANDLE})", f"cudaStreamWaitEvent({C_HANDLE}, ev, 1)"]
    assert log.index("cuCtxPushCurrent(ctx2)") < log.index(f"cudaStreamGetCaptureInfo({P_HANDLE}) -> none")
    assert cudart.context_device == 0
    assert cudart.end_capture(capture) and cudart.violations == 0


def test_legacy_stream_of_another_device_is_free(cudart, data):
    """The legacy stream is unusable only on the device whose blocking stream captures: a capture on device 3
    leaves device 0's legacy stream to the conversion."""
    capture = cudart.begin_capture(BYSTANDER, 3, GLOBAL, blocking=True)
    cai2dlpack(CaiArray(data, stream=P_HANDLE))  # consumer None: the legacy stream of device 0
    assert order_calls(cudart.log()) == [f"cudaEventRecord(ev, {P_HANDLE})", "cudaStreamWaitEvent(1, ev, 0)"]
    assert cudart.end_capture(capture) and cudart.violations == 0


@pytest.mark.parametrize("caller_device,capture_device,refused", [(0, 0, True), (0, 1, False), (1, 1, True)])
def test_managed_memory_legacy_consumer_is_the_callers(cudart, caller_device, capture_device, refused):
    """Managed memory's legacy consumer stream is the caller's device's: that is the legacy stream whose use a
    blocking capture forbids, whatever device the allocation names."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, MANAGED, device=1)
    cudart.add_stream(P_HANDLE, 2)
    cudart.current_device = caller_device
    capture = cudart.begin_capture(BYSTANDER, capture_device, GLOBAL, blocking=True)
    cudart.clear_log()
    if refused:
        with pytest.raises(CudaError, match="legacy default stream") as raised:
            cai2dlpack(CaiArray(host, stream=P_HANDLE), stream=LEGACY)
        assert raised.value.code == IMPLICIT and order_calls(cudart.log()) == []
    else:
        cai2dlpack(CaiArray(host, stream=P_HANDLE), stream=LEGACY)
        assert order_calls(cudart.log())[-1] == "cudaStreamWaitEvent(1, ev, 0)"
    assert cudart.context_device == caller_device
    assert cudart.end_capture(capture) and cudart.violations == 0


@pytest.mark.parametrize("capture_device,refused", [(0, True), (1, False)])
def test_device_memory_legacy_consumer_is_the_datas_devices(cudart, capture_device, refused):
    """Device memory's legacy consumer stream is the data's device's, whatever device the producer's stream
    belongs to: a blocking capture there forbids it, one on the producer stream's device does not."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=0)
    cudart.add_stream(P_HANDLE, 1)
    capture = cudart.begin_capture(BYSTANDER, capture_device, GLOBAL, blocking=True)
    cudart.clear_log()
    if refused:
        with pytest.raises(CudaError, match="legacy default stream") as raised:
            cai2dlpack(CaiArray(host, stream=P_HANDLE), stream=LEGACY)
        assert raised.value.code == IMPLICIT and order_calls(cudart.log()) == []
    else:
        cai2dlpack(CaiArray(host, stream=P_HANDLE), stream=LEGACY)
        assert order_calls(cudart.log())[-1] == "cudaStreamWaitEvent(1, ev, 0)"
    assert cudart.context_device == 0
    assert cudart.end_capture(capture) and cudart.violations == 0


def test_a_view_handed_on_inside_its_capture(cudart, data):
    """A view made on a capturing stream, handed on to another stream of the same capture, orders inside the graph;
    handed to a stream outside it, raises."""
    capture = cudart.begin_capture(C_HANDLE, 0, GLOBAL)
    cudart.join_capture(P_HANDLE, capture)
    view = dlpack2cai(DLPackShim(CaiArray(data, stream=P_HANDLE)), stream=C_HANDLE)
    cudart.clear_log()
    view.__dlpack__(stream=P_HANDLE, max_version=(1, 0))
    assert order_calls(cudart.log()) == [f"cudaEventRecord(ev, {C_HANDLE})", f"cudaStreamWaitEvent({P_HANDLE}, ev, 0)"]
    with pytest.raises(CudaError, match=f"capture id {capture}") as raised:
        view.__dlpack__(stream=BYSTANDER, max_version=(1, 0))
    assert raised.value.code == CAPTURED_EVENT
    assert cudart.end_capture(capture) and cudart.violations == 0


def test_capture_refusals_leak_nothing(cudart, data):
    """A refusal that keeps a capture whole (the CudaError naming the capture) frees what its message was made of:
    traced memory stays flat over many."""
    import tracemalloc

    capture = cudart.begin_capture(C_HANDLE, 0, GLOBAL)
    cudart.join_capture(P_HANDLE, capture)
    view = dlpack2cai(DLPackShim(CaiArray(data, stream=P_HANDLE)), stream=C_HANDLE)

    def refused():
        try:  # (not pytest.raises: it keeps a little of each call)
            view.__dlpack__(stream=BYSTANDER, max_version=(1, 0))
        except CudaError as error:
            assert f"capture id {capture}" in str(error)
        else:
            raise AssertionError("not refused")

    growth = []
    try:
        for _ in range(100):
            refused()
        tracemalloc.start()
        # A leak grows in every round; memory freed late (free-threaded builds) swings from one round to the next.
        for _ in range(3):
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(1000):
                refused()
            growth.append(tracemalloc.get_traced_memory()[0] - before)
        tracemalloc.stop()
    finally:
        assert cudart.end_capture(capture) and cudart.violations == 0
    assert min(growth) < 32 * 1024, growth


def test_capture_query_failure_is_a_cuda_error(cudart, data):
    cudart.fail("cudaStreamGetCaptureInfo", 400)
    with pytest.raises(CudaError, match="cudaStreamGetCaptureInfo failed: cudaErrorInvalidResourceHandle"):
        cai2dlpack(CaiArray(data, stream=P_HANDLE), stream=C_HANDLE)
    assert order_calls(cudart.log()) == [] and cudart.last_error == 0 and cudart.context_device == 0


# ---- the double itself: what it calls a violation ---------------------------------------------------

def test_the_double_refuses_what_cuda_refuses(cudart, data):
    """The naive ordering (record and wait, no capture check) through the double, to show what the table avoids:
    each refused call invalidates its capture and counts as a violation."""
    import ctypes

    lib = cudart.lib
    event = ctypes.c_void_p()
    assert lib.cudaEventCreateWithFlags(ctypes.byref(event), 2) == 0
    # A capturing consumer waiting on outside work.
    capture = cudart.begin_capture(C_HANDLE, 0, GLOBAL)
    assert lib.cudaEventRecord(event, ctypes.c_void_p(P_HANDLE)) == 0
    assert lib.cudaStreamWaitEvent(ctypes.c_void_p(C_HANDLE), event, 0) == 905
    assert not cudart.end_capture(capture) and cudart.violations == 1
    # The same wait made external joins the capture.
    capture = cudart.begin_capture(C_HANDLE, 0, GLOBAL)
    assert lib.cudaStreamWaitEvent(ctypes.c_void_p(C_HANDLE), event, 1) == 0
    assert cudart.end_capture(capture) and cudart.violations == 1
    # A stream outside waiting on captured work.
    capture = cudart.begin_capture(P_HANDLE, 0, GLOBAL)
    assert lib.cudaEventRecord(event, ctypes.c_void_p(P_HANDLE)) == 0
    assert lib.cudaStreamWaitEvent(ctypes.c_void_p(C_HANDLE), event, 0) == 907
    assert not cudart.end_capture(capture) and cudart.violations == 2
    # The legacy stream while a blocking stream captures.
    capture = cudart.begin_capture(BYSTANDER, 0, GLOBAL, blocking=True)
    assert lib.cudaEventRecord(event, ctypes.c_void_p(LEGACY)) == 906
    assert not cudart.end_capture(capture) and cudart.violations == 3
    # An unsafe call while another thread captures in global mode, but not in relaxed mode.
    capture = cudart.begin_capture(BYSTANDER, 0, GLOBAL, other_thread=True)
    pointer = ctypes.c_void_p()
    assert lib.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(8)) == 900
    assert not cudart.end_capture(capture) and cudart.violations == 4
    capture = cudart.begin_capture(BYSTANDER, 0, RELAXED, other_thread=True)
    assert lib.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(8)) == 0
    lib.cudaFree(pointer)
    assert cudart.end_capture(capture) and cudart.violations == 4
    cudart.lib.cudaGetLastError()


# ---- the doors of dlpack_to_cai.c and c_api.c ------------------------------------------------------------

class CudaProducer:
    """A DLPack producer of device memory that records the stream it was asked for."""

    def __init__(self, data):
        self.data = data
        self.asked = []

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None, max_version=None, **kwargs):
        self.asked.append(stream)
        return DLPackShim(CaiArray(self.data)).__dlpack__(stream=-1, max_version=max_version)


def test_dlpack2cai_does_not_ask_a_producer_for_an_unusable_legacy_stream(cudart, data):
    capture = cudart.begin_capture(BYSTANDER, 0, GLOBAL, blocking=True)
    producer = CudaProducer(data)
    try:
        with pytest.raises(CudaError, match="legacy default stream") as raised:
            dlpack2cai(producer)  # stream None: the legacy default stream
        assert raised.value.code == IMPLICIT and producer.asked == []
    finally:
        assert cudart.end_capture(capture)
    dlpack2cai(producer, stream=C_HANDLE)  # any other stream is passed on as it is
    assert producer.asked == [C_HANDLE]


def test_exchange_work_stream_refuses_an_unusable_legacy_stream(cudart, example):
    capture = cudart.begin_capture(BYSTANDER, 0, GLOBAL, blocking=True)
    try:
        with pytest.raises(CudaError, match="legacy default stream"):
            example.exchange_work_stream(DLPackShim, 2, 0)
        assert example.exchange_work_stream(DLPackShim, 1, 0) == 0  # the CPU asks nothing
    finally:
        assert cudart.end_capture(capture)
    assert cudart.violations == 0


@pytest.mark.parametrize("stream,blocking", [(C_HANDLE, False), (PER_THREAD, True), (LEGACY, None)])
def test_a_view_exports_no_stream_while_it_captures(cudart, data, stream, blocking):
    """CAI consumers synchronize the stream a view exports (Numba and CuPy by default), which a capture forbids:
    while the view's stream captures (or is the legacy stream a blocking capture makes unusable) the view
    exports "stream": None; the consumer is ordered by launching into the same capture."""
    view = dlpack2cai(DLPackShim(CaiArray(data, stream=P_HANDLE)), stream=stream)
    capture = cudart.begin_capture(BYSTANDER if stream == LEGACY else stream, 0, GLOBAL,
                                   blocking=True if blocking is None else blocking)
    assert view.__cuda_array_interface__["stream"] is None
    assert cudart.end_capture(capture) and cudart.violations == 0
    assert view.__cuda_array_interface__["stream"] == stream


# ---- the exchange API's allocator: its allocations and frees in relaxed mode ------------------------------

EXCHANGE = "cudaThreadExchangeStreamCaptureMode"
MADE_BY = {2: "cudaMalloc", 3: "cudaMallocHost", 13: "cudaMallocManaged"}
FREED_BY = {2: "cudaFree", 3: "cudaFreeHost", 13: "cudaFree"}


def exchanges(mode, was):
    """The log lines of one switch to relaxed mode and back, from mode (as the double writes them)."""
    return [f"{EXCHANGE}({RELAXED}) -> 0, was {mode}", f"{EXCHANGE}({mode}) -> 0, was {RELAXED}"] if was else []


def allocator_calls(cudart, device_type):
    """The allocator's and its deleter's calls: each allocation or free with the mode switches beside it. Switches
    with no allocation or free beside them are the pending releases' event queries (a view releases its tensor
    once its stream has run), not the allocator's."""
    memory = (MADE_BY[device_type] + "(", FREED_BY[device_type] + "(")
    calls = [line for line in cudart.log() if line.startswith((EXCHANGE,) + memory)]
    beside = lambda i: any(0 <= j < len(calls) and calls[j].startswith(memory) for j in (i - 1, i + 1))
    return [line for i, line in enumerate(calls) if line.startswith(memory) or beside(i)]


@pytest.mark.parametrize("device_type", [2, 3, 13])
def test_exchange_allocator_leaves_a_global_capture_whole(cudart, example, device_type):
    """While another thread captures in global mode (PyTorch's default), an allocation or free from a thread in
    global mode would invalidate that capture: the allocator and its deleter switch this thread to relaxed mode
    around each, and put its mode back."""
    capture = cudart.begin_capture(BYSTANDER, 0, GLOBAL, other_thread=True)
    view = example.exchange_allocate(DLPackView, (2, 32), (4,), (device_type, 0))
    assert view.device == (device_type, 0)
    del view  # the deleter frees it during the capture
    assert cudart.end_capture(capture) and cudart.violations == 0
    made, freed = MADE_BY[device_type], FREED_BY[device_type]
    to_relaxed, back = exchanges(GLOBAL, True)
    assert allocator_calls(cudart, device_type) == [
        to_relaxed, f"{made}(16) -> ok", back, to_relaxed, f"{freed}()", back]
    assert cudart.thread_capture_mode == GLOBAL


@pytest.mark.parametrize("mode,other_thread", [(GLOBAL, False), (THREAD_LOCAL, False), (THREAD_LOCAL, True),
                                               (RELAXED, False), (RELAXED, True)])
def test_exchange_allocator_in_every_capture_mode(cudart, example, mode, other_thread):
    """Relaxed mode lifts the prohibition for this thread's own capture too: a consumer allocating its output
    while it captures gets memory made at once (cudaMalloc is no node of a graph), as PyTorch's caching allocator
    does inside its captures; that capture and any other stay whole."""
    capture = cudart.begin_capture(C_HANDLE, 0, mode, other_thread=other_thread)
    bystander = cudart.begin_capture(BYSTANDER, 0, GLOBAL, other_thread=True)
    for device_type in (2, 3, 13):
        view = example.exchange_allocate(DLPackView, (2, 32), (4,), (device_type, 0))
        del view
    assert cudart.end_capture(capture) and cudart.end_capture(bystander) and cudart.violations == 0


def test_the_double_judges_an_allocation_by_the_threads_mode(cudart):
    """The double as the runtime header describes the modes: during this thread's own global capture, cudaMalloc
    from this thread in global mode is refused (900) and invalidates the capture; in relaxed mode it is made."""
    lib = cudart.lib
    pointer = ctypes.c_void_p()
    capture = cudart.begin_capture(C_HANDLE, 0, GLOBAL)
    assert lib.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(16)) == 900
    assert not cudart.end_capture(capture) and cudart.violations == 1
    lib.cudaGetLastError()
    capture = cudart.begin_capture(C_HANDLE, 0, GLOBAL)
    cudart.thread_capture_mode = RELAXED
    assert lib.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(16)) == 0 and lib.cudaFree(pointer) == 0
    cudart.thread_capture_mode = GLOBAL
    assert cudart.end_capture(capture) and cudart.violations == 1


def test_exchange_allocator_frees_on_another_thread_during_a_capture(cudart, example):
    """A framework may drop the tensor from a thread of its own, in that thread's global mode, while this thread
    captures in global mode: the deleter switches that thread to relaxed mode too, and back."""
    view = example.exchange_allocate(DLPackView, (2, 32), (4,), (2, 0))
    capsule = view.__dlpack__(max_version=(1, 0))  # holds the view, which holds the tensor the allocator made
    address = _api.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
    _api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
    assert _api.PyCapsule_SetName(capsule, b"used_dltensor_versioned") == 0  # consumed by "the framework"
    deleter = ctypes.cast(DLManagedTensorVersioned.from_address(address).deleter, ctypes.c_void_p).value
    del view, capsule
    capture = cudart.begin_capture(C_HANDLE, 0, GLOBAL)
    cudart.clear_log()
    cudart.lib.double_call_in_thread.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    assert cudart.lib.double_call_in_thread(deleter, address) == 0  # the last reference: the memory is freed there
    assert allocator_calls(cudart, 2) == [exchanges(GLOBAL, True)[0], "cudaFree()", exchanges(GLOBAL, True)[1]]
    assert cudart.end_capture(capture) and cudart.violations == 0


@pytest.mark.parametrize("mode", [THREAD_LOCAL, RELAXED])
def test_exchange_allocator_puts_the_threads_own_mode_back(cudart, example, mode):
    """The switch is push-pop: a thread a framework put in thread-local (or relaxed) mode is in it again after
    the allocation and after the free."""
    cudart.thread_capture_mode = mode
    cudart.clear_log()
    view = example.exchange_allocate(DLPackView, (2, 32), (4,), (2, 0))
    assert cudart.thread_capture_mode == mode
    del view
    assert cudart.thread_capture_mode == mode
    to_relaxed, back = exchanges(mode, True)
    assert allocator_calls(cudart, 2) == [to_relaxed, "cudaMalloc(16) -> ok", back, to_relaxed, "cudaFree()", back]
    cudart.thread_capture_mode = GLOBAL


def test_exchange_allocator_goes_ahead_when_the_mode_cannot_be_switched(cudart, example):
    """A refused switch changes nothing: the allocation is made in the thread's own mode, nothing is switched
    back, and the runtime's last error (ours) is cleared."""
    cudart.fail(EXCHANGE, 1, count=1)
    view = example.exchange_allocate(DLPackView, (2, 32), (4,), (2, 0))
    assert cudart.last_error == 0 and cudart.thread_capture_mode == GLOBAL
    assert allocator_calls(cudart, 2) == [f"{EXCHANGE}({RELAXED}) -> 1, was {GLOBAL}", "cudaMalloc(16) -> ok"]
    del view


def test_exchange_allocator_with_a_runtime_that_cannot_switch_modes(tmp_path, example):
    """A runtime without cudaThreadExchangeStreamCaptureMode loads, and the allocator works as before: in the
    thread's own mode, so during another thread's global capture cudaMalloc is refused as CUDA refuses it."""
    runtime = cuda_double.build(str(tmp_path), capture_mode=False)
    child = textwrap.dedent(f"""
        import ctypes, importlib.util
        from cai_dlpack import DLPackView
        spec = importlib.util.spec_from_file_location("cai_dlpack_example", {example.__file__!r})
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        double = ctypes.CDLL({runtime!r})
        view = example.exchange_allocate(DLPackView, (2, 32), (4,), (2, 0))
        del view
        double.double_begin_capture.restype = ctypes.c_ulonglong
        double.double_begin_capture(0x7000, 0, 0, 0, 1)
        try:
            example.exchange_allocate(DLPackView, (2, 32), (4,), (2, 0))
        except RuntimeError as error:
            print("REFUSED", error)
        print("VIOLATIONS", double.double_violations())
    """)
    env = dict(os.environ, CAI_DLPACK_CUDART=runtime)
    result = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "REFUSED RuntimeError: cai_dlpack allocator: 16 bytes on device (2, 0): cudaMalloc failed: "
        "cudaErrorStreamCaptureUnsupported",
        "VIOLATIONS 1"]


class UnnamedDevice:
    """A producer that cannot name its device (as torch's meta tensors cannot) and whose __dlpack__ would order its
    work on the legacy stream it is given."""

    def __init__(self):
        self.asked = []

    def __dlpack_device__(self):
        raise RuntimeError("this producer cannot name its device")

    def __dlpack__(self, stream=None, max_version=None):
        self.asked.append(stream)
        raise BufferError("this producer has no data")


def test_a_producer_that_cannot_name_its_device_is_not_asked_during_a_blocking_capture(cudart):
    """While the legacy stream is unusable, a producer whose device is unknown is not asked for it (its work there
    would invalidate the capture): its own error is raised. Outside a capture, its __dlpack__ decides."""
    cuda_runtime_info()  # the runtime is loaded
    producer = UnnamedDevice()
    capture = cudart.begin_capture(BYSTANDER, 0, GLOBAL, blocking=True)
    with pytest.raises(RuntimeError, match="cannot name its device"):
        dlpack2cai(producer)
    assert producer.asked == [] and cudart.end_capture(capture) and cudart.violations == 0
    with pytest.raises(BufferError, match="has no data"):
        dlpack2cai(producer)
    assert producer.asked == [None]


class DeviceNameError(RuntimeError):
    """Raised by one producer only: its references count what the bridge keeps of the error."""


def test_a_producer_that_cannot_name_its_device_has_its_error_released_when_dlpack_decides(cudart):
    """Outside a capture the producer's error is set aside, the legacy stream is asked about, and __dlpack__
    decides: the error set aside is then dropped, its type, value and traceback, not kept one reference per call."""
    cuda_runtime_info()  # the runtime is loaded
    error = DeviceNameError("this producer cannot name its device")

    class SameError(UnnamedDevice):
        def __dlpack_device__(self):
            raise error

    producer = SameError()

    def convert(times):
        for _ in range(times):
            with pytest.raises(BufferError, match="has no data"):
                dlpack2cai(producer)
        error.__traceback__ = None  # each raise gives it a traceback of its own: not what is counted

    convert(3)
    before = sys.getrefcount(error), sys.getrefcount(DeviceNameError), live_tracebacks()
    convert(200)
    assert (sys.getrefcount(error), sys.getrefcount(DeviceNameError), live_tracebacks()) == before
    assert producer.asked == [None] * 203


def test_a_producer_that_cannot_name_its_device_when_the_capture_query_fails(cudart):
    """The producer cannot name its device and the runtime cannot say whether the legacy stream captures: the
    query's CudaError is raised (the producer is not asked: its work might break a capture), not the producer's
    error, and no error is left pending behind a result."""
    cuda_runtime_info()  # the runtime is loaded
    producer = UnnamedDevice()
    cudart.fail("cudaStreamGetCaptureInfo", 400)
    with pytest.raises(CudaError, match="cudaStreamGetCaptureInfo"):
        dlpack2cai(producer)
    assert producer.asked == []


class InterruptedDevice(UnnamedDevice):
    def __init__(self, error):
        super().__init__()
        self.error = error

    def __dlpack_device__(self):
        raise self.error


@pytest.mark.parametrize("error", [KeyboardInterrupt(), MemoryError()], ids=["KeyboardInterrupt", "MemoryError"])
def test_an_interrupt_or_memory_error_asking_a_producers_device_is_raised(cudart, error):
    """Only an ordinary error of __dlpack_device__ leaves the decision to __dlpack__: an interrupt or running out
    of memory is raised at once, and the producer is not asked for its data."""
    cuda_runtime_info()  # the runtime is loaded
    producer = InterruptedDevice(error)
    with pytest.raises(type(error)):
        dlpack2cai(producer)
    assert producer.asked == []
