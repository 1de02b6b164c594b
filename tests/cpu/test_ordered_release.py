"""Memory stays alive until the device is done with it: a consumer's tensor, dropped on the host while work it
queued on its stream has not run, keeps the producer's memory until that work has run; a device copy keeps its
source until the copy ran. Proven on the runtime double's late mode (streams run only when forced), by the values
a queued "kernel" (a host function on the consumer's stream) reads after the producer's pool reused the block."""
import ctypes
import gc
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest

from cai_dlpack import DLPackShim, _core, cai2dlpack, cuda_runtime_info, dlpack2cai
from support import doors
from support.c_heap import c_heap_bytes
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE, GLOBAL, MANAGED, PINNED_HOST, RELAXED, THREAD_LOCAL
from support.dlpack_ctypes import DLManagedTensor, DLManagedTensorVersioned, MadeTensor, _api, kDLCUDA
from support.fresh_process import run_with_double
from test_lifetime import LEGACY_SUBINTERPRETER

S1, S2 = 0x5000, 0x6000  # the producer's stream, the consumer's
N = 8
ORIGINAL = np.arange(N, dtype=np.float32)
NEXT = np.full(N, -1.0, dtype=np.float32)  # what the producer's next allocation writes


# Releases here are ordered after the streams the tests name by handle: see the fixture (conftest.py).
pytestmark = pytest.mark.usefixtures("trusted_streams")


@pytest.fixture
def late(cudart):
    cudart.add_stream(S1, 0)
    cudart.add_stream(S2, 0)
    cudart.late = True
    yield cudart
    _core._set_ordered_release(True)
    drain(cudart)
    cudart.late = False


def drain(cudart):
    """Runs every stream until no release is pending (a release may record an event that needs a run itself)."""
    for _ in range(10):
        cudart.run_all()
        if _core._pending_releases()["pending"] == 0:
            return
    raise AssertionError(f"releases still pending: {_core._pending_releases()}")


class Pool:
    """A producer's caching allocator: a freed block is poisoned and handed to the next allocation of its size."""

    def __init__(self, cudart):
        self.cudart = cudart
        self.free = []

    def take(self, values):
        if self.free:
            block = self.free.pop()
        else:
            block = np.empty(N, dtype=np.float32)
            register(self.cudart, block, DEVICE)
        block[:] = values
        array = CaiArray(block, stream=S1)
        weakref.finalize(array, self._give_back, block)
        return array

    def _give_back(self, block):
        block.view(np.uint8)[:] = 0xDD
        self.free.append(block)


def read(address):
    return np.frombuffer((ctypes.c_float * N).from_address(address), dtype=np.float32).copy()


class Taken:
    """A tensor taken as a framework takes it (the capsule renamed used_*): ours to delete, once."""

    def __init__(self, capsule, name=b"dltensor_versioned"):
        self.address = _api.PyCapsule_GetPointer(capsule, name)
        _api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
        assert _api.PyCapsule_SetName(capsule, b"used_" + name) == 0
        layout = DLManagedTensorVersioned if name == b"dltensor_versioned" else DLManagedTensor
        self.managed = layout.from_address(self.address)
        self.data = self.managed.dl_tensor.data
        self.deleter = ctypes.cast(self.managed.deleter, ctypes.c_void_p).value

    def drop(self):
        ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self.deleter)(self.address)


def consume(capsule, name=b"dltensor_versioned"):
    """(data, the deleter's call) of a tensor taken from capsule."""
    taken = Taken(capsule, name)
    return taken.data, taken.drop


def through_shim(x):
    return consume(DLPackShim(x).__dlpack__(stream=S2, max_version=(1, 0))) + (S2,)


def through_cai2dlpack(x):
    return consume(cai2dlpack(x, stream=S2, max_version=(1, 0))) + (S2,)


def through_cai2dlpack_without_keywords(x):
    # the common call, cai2dlpack(obj): a legacy capsule for the legacy stream (its own no-keyword path)
    return consume(cai2dlpack(x), b"dltensor") + (1,)


def through_view(x):
    holder = [dlpack2cai(DLPackShim(x), stream=S2)]
    return holder[0].__cuda_array_interface__["data"][0], holder.clear, S2


def through_c_api(x):
    owned = doors.to_managed_tensor(x, S2)
    return owned.tensor.data, owned.delete, S2


def through_exchange_api(x):
    owned = doors.managed_from_object(DLPackShim(x))  # the consumer works on the reported stream: the legacy one
    return owned.tensor.data, owned.delete, 1


DOORS = {"DLPackShim": through_shim, "cai2dlpack": through_cai2dlpack,
         "cai2dlpack without keywords": through_cai2dlpack_without_keywords, "DLPackView": through_view,
         "C API": through_c_api, "exchange API": through_exchange_api}


def shim_tensor_with_work_queued(late, pool):
    """A fresh producer array of pool taken through the shim for S2, and a kernel queued on S2 after it: (a weakref
    to the array, the tensor's drop). Nothing else holds the array."""
    x = pool.take(ORIGINAL)
    watch = weakref.ref(x)
    _, drop, _ = through_shim(x)
    late.launch_kernel(S2, lambda: None)
    return watch, drop


def kernel_after_drop(cudart, door):
    """The issue's example: a kernel queued on the consumer's stream, the tensor and the producer's array dropped,
    the producer's pool asked for a block of the same size; then the device runs the kernel. Returns what the kernel
    read, a weakref to the producer's array, and how many host waits the conversion and the drop made."""
    pool = Pool(cudart)
    x = pool.take(ORIGINAL)
    watch = weakref.ref(x)
    waits = cudart.sync_calls
    data, drop, stream = DOORS[door](x)
    seen = []
    cudart.launch_kernel(stream, lambda: seen.append(read(data)))
    drop()
    del x
    gc.collect()
    later = pool.take(NEXT)  # the producer's next allocation
    waits = cudart.sync_calls - waits
    cudart.run_stream(stream)
    del later
    return seen[0], watch, waits


@pytest.mark.parametrize("door", DOORS)
def test_kernel_queued_before_the_drop_reads_the_producers_bytes(late, door):
    seen, watch, waits = kernel_after_drop(late, door)
    np.testing.assert_array_equal(seen, ORIGINAL)
    assert waits == 0  # no host wait on the conversion or the deleter
    drain(late)
    assert watch() is None and _core._pending_releases()["pending"] == 0


@pytest.mark.parametrize("door", DOORS)
def test_without_ordered_release_the_kernel_reads_reused_memory(late, door):
    """The test-only switch off (releases at once, as before): the same scenario reads the next allocation's bytes,
    so the test above can fail."""
    _core._set_ordered_release(False)
    seen, watch, waits = kernel_after_drop(late, door)
    np.testing.assert_array_equal(seen, NEXT)


def test_release_waits_for_the_consumers_stream_only(late):
    """Pending until the consumer's stream runs past the drop; another stream's run releases nothing."""
    pool = Pool(late)
    watch, drop = shim_tensor_with_work_queued(late, pool)
    drop()
    gc.collect()
    assert watch() is not None and _core._pending_releases()["pending"] == 1
    late.run_stream(S1)
    assert watch() is not None and _core._pending_releases()["pending"] == 1
    late.run_stream(S2)
    assert _core._pending_releases()["pending"] == 0 and watch() is None


def test_deleters_from_foreign_threads_release_every_owner_once(late):
    """Deleters run on threads that never held the GIL, many at once: each owner is released exactly once, after
    its stream ran, and the pending count comes back to zero."""
    pool = Pool(late)
    arrays = [pool.take(ORIGINAL) for _ in range(16)]
    released = []
    for index, x in enumerate(arrays):
        weakref.finalize(x, released.append, index)
    tensors = [Taken(DLPackShim(x).__dlpack__(stream=S2, max_version=(1, 0))) for x in arrays]
    del arrays, x
    late.lib.double_call_in_thread.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    for taken in tensors:
        assert late.lib.double_call_in_thread(taken.deleter, taken.address) == 0
    gc.collect()
    assert released == [] and _core._pending_releases()["pending"] == 16
    drain(late)
    assert sorted(released) == list(range(16)) and _core._pending_releases()["pending"] == 0


def test_concurrent_conversions_and_drops_release_each_owner_once(late):
    """Threads convert and drop at once (free-threaded builds run them in parallel): nothing lost, nothing twice."""
    released = []
    host = np.zeros(100 * N, dtype=np.float32)
    register(late, host, DEVICE)

    def work(first):
        for i in range(first, first + 25):
            x = CaiArray(host[i * N:(i + 1) * N], stream=S1)
            weakref.finalize(x, released.append, i)
            data, drop, stream = through_cai2dlpack(x)
            drop()

    threads = [threading.Thread(target=work, args=(first,)) for first in range(0, 100, 25)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    drain(late)
    gc.collect()
    assert sorted(released) == list(range(100)) and _core._pending_releases()["pending"] == 0


def dropped_by_a_consumer_on(x, stream):
    """The drop of a consumer's tensor of x for stream: its deleter, called with the GIL let go (a C consumer)."""
    return consume(cai2dlpack(x, stream=stream, max_version=(1, 0)))[1]


def dropped_by_a_consumer(x):
    return dropped_by_a_consumer_on(x, S2)


def dropped_with_a_view(x):
    """The drop of a view of x for S2: its last reference let go, the GIL held."""
    holder = [dlpack2cai(DLPackShim(x), stream=S2)]
    return holder.clear


@pytest.mark.parametrize("dropped", [dropped_by_a_consumer, dropped_with_a_view],
                         ids=["a consumer's tensor, GIL let go", "a view, GIL held"])
def test_past_the_bound_the_oldest_release_waits_for_its_stream(late, dropped):
    """At most CDL_PENDING_LIMIT releases wait; one more makes the oldest wait for its event: one host wait, the
    dropping thread attached again after it when it held the GIL. A view's release drops the tensor it held, whose
    own release (for the same stream) is covered by the event just waited for: made at once, not queued again."""
    limit = _core._pending_releases()["limit"]
    host = np.zeros(limit + 1, dtype=np.float32)
    register(late, host, DEVICE)
    waited = _core._pending_releases()["waited"]
    waits = late.sync_calls
    for i in range(limit):
        dropped(CaiArray(host[i:i + 1]))()
    assert _core._pending_releases()["pending"] == limit and late.sync_calls == waits
    dropped(CaiArray(host[limit:]))()
    info = _core._pending_releases()
    assert info["waited"] == waited + 1 and late.sync_calls == waits + 1
    assert info["pending"] == limit


@pytest.mark.parametrize("dropped", ["dropped_by_a_consumer", "dropped_with_a_view"])
def test_the_wait_past_the_bound_lets_the_gil_go(dropped):
    """The host wait for the oldest release is made with the GIL let go, whether the drop came with it held (a
    view) or not (a C consumer's deleter): other threads run while the device catches up. Own process: once a
    subinterpreter exists, CPython's GIL check always answers yes."""
    out = run_with_double(f"""
from test_ordered_release import {dropped}
from cai_dlpack import _core
double.add_stream({S2}, 0)
double.late = True
limit = _core._pending_releases()["limit"]
host = np.zeros(limit + 1, dtype=np.float32)
register(double, host, DEVICE)
for i in range(limit):
    {dropped}(CaiArray(host[i:i + 1]))()
print(double.gil_at_event_sync, _core._pending_releases()["waited"])
{dropped}(CaiArray(host[limit:]))()
print(double.gil_at_event_sync, _core._pending_releases()["waited"])
""")
    assert out == ["-1", "0", "0", "1"]


def test_views_dropped_one_after_another_past_the_bound_stay_at_the_bound(late):
    """Twice CDL_PENDING_LIMIT views dropped while their stream never runs: from the bound on, each drop waits for
    the oldest and no more than the bound ever waits (the releases those make add none)."""
    limit = _core._pending_releases()["limit"]
    host = np.zeros(2 * limit, dtype=np.float32)
    register(late, host, DEVICE)
    late.launch_kernel(S2, lambda: None)
    waited = _core._pending_releases()["waited"]
    most = 0
    for i in range(2 * limit):
        dropped_with_a_view(CaiArray(host[i:i + 1]))()
        most = max(most, _core._pending_releases()["pending"])
    assert most == limit and _core._pending_releases()["waited"] == waited + limit


class Holding(CaiArray):
    """A producer's array that holds other objects (views, or whatever its __del__ does)."""


def test_a_release_that_drops_many_ordered_releases_leaves_at_most_the_bound_waiting(late):
    """One release (a tensor's owner, made once S2 ran) drops three times CDL_PENDING_LIMIT views for S1, which
    never runs: they queue, and once that release returned the oldest are waited for until the bound holds."""
    limit = _core._pending_releases()["limit"]
    host = np.zeros(3 * limit + 1, dtype=np.float32)
    register(late, host, DEVICE)
    late.launch_kernel(S1, lambda: None)
    owner = Holding(host[3 * limit:])
    owner.views = [dlpack2cai(DLPackShim(CaiArray(host[i:i + 1])), stream=S1) for i in range(3 * limit)]
    late.launch_kernel(S2, lambda: None)
    consume(cai2dlpack(owner, stream=S2, max_version=(1, 0)))[1]()
    del owner
    gc.collect()
    assert _core._pending_releases()["pending"] == 1
    late.run_stream(S2)
    assert _core._pending_releases()["pending"] == limit


def test_drops_made_by_a_finalizer_a_release_runs_leave_at_most_the_bound_waiting(late):
    """Python code a release runs (the __del__ of the owner it drops) converts and drops twice CDL_PENDING_LIMIT
    tensors for S1, which never runs: the bound holds once the release returned."""
    limit = _core._pending_releases()["limit"]
    host = np.zeros(2 * limit + 1, dtype=np.float32)
    register(late, host, DEVICE)
    late.launch_kernel(S1, lambda: None)

    class Converting(Holding):
        def __del__(self):
            for i in range(2 * limit):
                dropped_by_a_consumer_on(CaiArray(host[i:i + 1]), S1)()

    owner = Converting(host[2 * limit:])
    late.launch_kernel(S2, lambda: None)
    consume(cai2dlpack(owner, stream=S2, max_version=(1, 0)))[1]()
    del owner
    gc.collect()
    late.run_stream(S2)
    assert _core._pending_releases()["pending"] == limit


def released_by_a_completed_release(late, finalizer):
    """Runs finalizer inside the release of an owner whose tensor was dropped for S2 (the release is made once S2
    ran past its event, by the host's next collection)."""
    class Owner(Holding):
        def __del__(self):
            finalizer()

    host = np.zeros(N, dtype=np.float32)
    register(late, host, DEVICE)
    owner = Owner(host)
    late.launch_kernel(S2, lambda: None)
    consume(cai2dlpack(owner, stream=S2, max_version=(1, 0)))[1]()
    del owner
    gc.collect()
    late.run_stream(S2)
    _core._pending_releases()  # the collection: the owner's release, its finalizer


def test_a_tensor_a_release_converts_and_drops_for_the_same_stream_waits_for_its_kernel(late):
    """Code a release runs (a finalizer) converts for S2, queues a kernel reading the tensor on S2 and drops it:
    the producer's array outlives the drop until that kernel ran (the completed release's event covers nothing
    queued after it)."""
    pool, seen, watch = Pool(late), [], []

    def finalizer():
        x = pool.take(ORIGINAL)
        watch.append(weakref.ref(x))
        data, drop = consume(cai2dlpack(x, stream=S2, max_version=(1, 0)))
        del x
        late.launch_kernel(S2, lambda: seen.append(read(data)))
        drop()

    released_by_a_completed_release(late, finalizer)
    gc.collect()
    assert watch[0]() is not None
    pool.take(NEXT)
    late.run_stream(S2)
    np.testing.assert_array_equal(seen[0], ORIGINAL)


def test_a_device_copy_a_release_makes_for_the_same_stream_keeps_its_source_until_it_ran(late):
    """A device copy asked for by code a release runs, for the stream that release waited on: its source stays
    alive until the copy ran (the pool cannot hand the block out before), and the copy holds the source's
    values."""
    pool, made = Pool(late), {}

    def finalizer():
        x = pool.take(ORIGINAL)
        made["watch"] = weakref.ref(x)
        made["copy"], made["drop"] = consume(DLPackShim(x).__dlpack__(stream=S2, copy=True, max_version=(1, 0)))

    released_by_a_completed_release(late, finalizer)
    gc.collect()
    assert made["watch"]() is not None
    later = pool.take(NEXT)
    late.run_stream(S2)
    np.testing.assert_array_equal(read(made["copy"]), ORIGINAL)
    made["drop"]()
    del later


@pytest.mark.parametrize("export", [
    lambda x: DLPackShim(x).__dlpack__(stream=S2, max_version=(1, 0)),
    lambda x: cai2dlpack(x, stream=S2),
], ids=["versioned", "legacy"])
def test_a_view_of_our_own_export_for_its_stream_is_released_with_one_event(late, export):
    """A view of our own export (either capsule) for the stream the export was made for: the view was the tensor's
    one holder, so once its stream ran past the view's drop the producer's array is released, with no second
    event recorded for the tensor and nothing left pending."""
    pool = Pool(late)
    x = pool.take(ORIGINAL)
    watch = weakref.ref(x)
    view = dlpack2cai(export(x), stream=S2)
    del x
    late.launch_kernel(S2, lambda: None)
    late.clear_log()
    del view
    gc.collect()
    assert watch() is not None and _core._pending_releases()["pending"] == 1
    late.run_stream(S2)
    gc.collect()
    assert watch() is None and _core._pending_releases()["pending"] == 0
    assert sum(call.startswith("cudaEventRecord") for call in late.log()) == 1


@pytest.mark.parametrize("refused", ["cudaEventRecord", "cudaEventQuery"])
def test_a_views_release_made_without_its_event_still_orders_the_export_it_held(late, refused):
    """A view of our own export for S2 whose release is made without its event having completed (the record of
    its drop refused, or the query of its event erring, taken as a context gone): the export it held is not
    released with it but by its own deleter, which records an event of its own, so the producer's memory outlives
    the consumer's kernel queued before the drop."""
    pool, seen = Pool(late), []
    x = pool.take(ORIGINAL)
    view = dlpack2cai(DLPackShim(x), stream=S2)
    address = view.__cuda_array_interface__["data"][0]
    del x
    late.launch_kernel(S2, lambda: seen.append(read(address)))
    if refused == "cudaEventRecord":
        late.fail("cudaEventRecord", 999)
    del view
    gc.collect()
    if refused == "cudaEventQuery":
        late.fail("cudaEventQuery", 999)
    _core._pending_releases()
    assert _core._pending_releases()["pending"] == 1  # the export's own release
    later = pool.take(NEXT)
    late.run_stream(S2)
    np.testing.assert_array_equal(seen[0], ORIGINAL)
    del later


def test_ordered_releases_give_their_bookkeeping_back(late):
    """Releases kept until their stream ran, then made, and releases made at once on a stream with nothing left to
    run give back the C memory that kept them (the pending entry, a view's record of its tensor): the C heap does
    not grow over thousands of them."""
    if c_heap_bytes() is None:
        pytest.skip("this C library cannot say how much of its heap is in use (mallinfo2)")
    host = np.zeros(500, dtype=np.float32)
    register(late, host, DEVICE)

    def releases():
        late.launch_kernel(S2, lambda: None)
        for i in range(500):
            dropped_with_a_view(CaiArray(host[i:i + 1]))()
            dropped_by_a_consumer(CaiArray(host[i:i + 1]))()
        assert _core._pending_releases()["pending"] == 1000
        drain(late)
        late.late = False  # streams run their work at once: each release made at once, its event complete
        for i in range(500):
            dropped_by_a_consumer(CaiArray(host[i:i + 1]))()
        late.late = True
        assert _core._pending_releases()["pending"] == 0
        gc.collect()

    releases()
    before = c_heap_bytes()
    for _ in range(4):
        releases()
    assert c_heap_bytes() - before < 32 * 1024  # a lost entry or record is 48-96 bytes: 200-400 KiB


def with_another_librarys_error_pending(cudart, work):
    """Runs work with an error another library left pending in the runtime; whether it is still there, as it was."""
    assert cudart.lib.cudaSetDevice(99) != 0
    pending = cudart.last_error
    work()
    still = cudart.last_error == pending != 0
    cudart.lib.cudaGetLastError()
    return still


def view_exporting_its_stream_then_dropped(late):
    """A view for S2 whose CAI exports its stream (an event of its own), read, then dropped once S2 ran."""
    block = np.arange(N, dtype=np.float32)
    register(late, block, DEVICE)
    view = dlpack2cai(DLPackShim(CaiArray(block, stream=S1)), stream=2)
    assert view.__cuda_array_interface__["stream"] is not None
    del view
    drain(late)


def device_copy_made_and_dropped(late):
    block = np.arange(N, dtype=np.float32)
    register(late, block, DEVICE)
    consume(DLPackShim(CaiArray(block, stream=S1)).__dlpack__(stream=S2, copy=True, max_version=(1, 0)))[1]()
    drain(late)


def more_releases_at_once_than_events_kept(late):
    """80 releases pending at once, then made: their events go back to a pool of 64, the rest destroyed."""
    block = np.arange(80, dtype=np.float32)
    register(late, block, DEVICE)
    late.launch_kernel(S2, lambda: None)
    for i in range(80):
        dropped_by_a_consumer(CaiArray(block[i:i + 1], stream=S1))()
    drain(late)


@pytest.mark.parametrize("work", [view_exporting_its_stream_then_dropped, device_copy_made_and_dropped,
                                  more_releases_at_once_than_events_kept])
def test_runtime_calls_that_work_leave_another_librarys_error_pending(late, work):
    """Each path that asks the runtime for something and clears the runtime's last error where the call failed
    leaves an error another library left pending as it was where every call worked."""
    assert with_another_librarys_error_pending(late, lambda: work(late))


def test_a_view_released_at_once_inside_a_completed_release_at_its_address_still_orders_its_export(late):
    """A release made because its event completed (an owner's block, freed first, then its owner dropped) runs a
    finalizer that drops a view of another export for S2 whose record the runtime refuses: made at once, that
    view's release holds a record malloc'd where the freed block was. It answers for itself, not as the completed
    release around it: its export is still ordered, and outlives the kernel queued before the drop."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    pool, seen, made = Pool(late), [], {}
    x = pool.take(ORIGINAL)
    made["view"] = dlpack2cai(DLPackShim(x), stream=S2)
    address = made["view"].__cuda_array_interface__["data"][0]
    del x

    class Owner(Holding):
        def __del__(self):
            held = []  # small blocks taken until the C heap hands out the freed block's address, given back once
            for _ in range(1_000_000):
                block = libc.malloc(48)
                if block == made["block"]:
                    made["reused"] = True
                    libc.free(block)
                    break
                held.append(block)
            late.launch_kernel(S2, lambda: seen.append(read(address)))
            late.fail("cudaEventRecord", 999)
            del made["view"]
            for block in held:
                libc.free(block)

    host = np.zeros((1,) * 63 + (N,), dtype=np.float32)  # 64 dimensions: a block of its own from the C heap
    register(late, host, DEVICE)
    owner = Owner(host)
    late.launch_kernel(S2, lambda: None)
    taken = Taken(cai2dlpack(owner, stream=S2, max_version=(1, 0)))
    made["block"] = taken.address
    taken.drop()
    del owner
    gc.collect()
    late.run_stream(S2)
    _core._pending_releases()  # the owner's release, its event completed: its finalizer drops the view
    if not made.get("reused"):
        pytest.skip("this C heap did not hand the freed block's address out again (the case needs it)")
    later = pool.take(NEXT)
    late.run_stream(S2)
    np.testing.assert_array_equal(seen[0], ORIGINAL)
    del later


def test_a_captured_conversion_is_kept_until_its_stream_left_the_capture_and_leaves_the_capture_whole(late):
    """An event recorded in a capture is a node of the graph, not a point in time: a tensor dropped while its
    consumer stream captures records nothing (the capture stays valid) and stays pending, with no event, until a
    later collection finds the stream outside the capture; its event is recorded then, and it is released once
    the stream ran up to it."""
    capture = late.begin_capture(S2, 0, GLOBAL)
    pool = Pool(late)
    x = pool.take(ORIGINAL)
    watch = weakref.ref(x)
    data, drop, stream = through_shim(x)
    drop()
    del x
    gc.collect()
    assert watch() is not None and _core._pending_releases()["pending"] == 1
    assert late.end_capture(capture) and late.violations == 0
    assert _core._pending_releases()["pending"] == 1  # recorded now, on S2 outside the capture
    late.run_stream(S2)
    gc.collect()
    assert watch() is None and _core._pending_releases()["pending"] == 0


def test_past_the_bound_a_release_still_without_an_event_is_passed_over_for_the_oldest_with_one(late):
    """The oldest pending release, dropped while its stream (S1) captures, has no event yet: one drop past the bound
    waits for the oldest release that has one (the first of S2's) and leaves the captured one pending, its capture
    whole."""
    capture = late.begin_capture(S1, 0, GLOBAL)
    limit = _core._pending_releases()["limit"]
    host = np.zeros(limit + 1, dtype=np.float32)
    register(late, host, DEVICE)
    captured = CaiArray(host[0:1])
    watch_captured = weakref.ref(captured)
    consume(cai2dlpack(captured, stream=S1, max_version=(1, 0)))[1]()
    late.launch_kernel(S2, lambda: None)
    first = CaiArray(host[1:2])
    watch_first = weakref.ref(first)
    consume(cai2dlpack(first, stream=S2, max_version=(1, 0)))[1]()
    del captured, first
    waited = _core._pending_releases()["waited"]
    for i in range(2, limit + 1):
        consume(cai2dlpack(CaiArray(host[i:i + 1]), stream=S2, max_version=(1, 0)))[1]()
    gc.collect()
    info = _core._pending_releases()
    assert info["pending"] == limit and info["waited"] == waited + 1
    assert watch_captured() is not None and watch_first() is None
    assert late.violations == 0 and late.end_capture(capture)


def test_collecting_releases_leaves_another_threads_global_capture_whole(late):
    """Event queries are prohibited while another thread captures in global mode (PyTorch's default): the
    pending releases are queried in relaxed mode."""
    pool = Pool(late)
    x = pool.take(ORIGINAL)
    data, drop, stream = through_shim(x)
    drop()
    del x
    capture = late.begin_capture(0x7777, 0, GLOBAL, other_thread=True)
    late.run_stream(S2)
    assert _core._pending_releases()["pending"] == 0
    assert late.end_capture(capture) and late.violations == 0


# ---- device copies ------------------------------------------------------------------------------------------

def test_device_copy_keeps_its_source_until_the_copy_ran(late):
    """copy=True queues the copy on the consumer's stream: the source stays alive until it ran (the producer's pool
    cannot hand the block out), and the producer's stream waits for the copy."""
    copy_keeps_its_source_until_it_ran(late)


def copy_keeps_its_source_until_it_ran(late):
    """The body of the test above (test_untrusted_streams.py runs it without trust too)."""
    pool = Pool(late)
    x = pool.take(ORIGINAL)
    watch = weakref.ref(x)
    late.clear_log()
    capsule = DLPackShim(x).__dlpack__(stream=S2, copy=True, max_version=(1, 0))
    copy, drop = consume(capsule)
    del x
    gc.collect()
    assert watch() is not None
    later = pool.take(NEXT)
    late.run_stream(S2)
    np.testing.assert_array_equal(read(copy), ORIGINAL)
    log = late.log()
    last_copy = max(i for i, line in enumerate(log) if line.startswith(("cudaMemcpyAsync", "cudaMemcpy2DAsync")))
    assert any(line.startswith(f"cudaStreamWaitEvent({S1}, ") for line in log[last_copy:])
    drain(late)
    assert watch() is None
    drop()
    del later


@pytest.mark.parametrize("consumer", [S2, 1], ids=["a stream", "the legacy stream"])
def test_device_copy_memory_is_freed_in_the_consumers_stream_order(late, consumer):
    """The copy's own memory goes back by cudaFreeAsync on the consumer's stream: no host wait, and a kernel queued
    before the drop still reads the copy."""
    pool = Pool(late)
    x = pool.take(ORIGINAL)
    copy, drop = consume(DLPackShim(x).__dlpack__(stream=consumer, copy=True, max_version=(1, 0)))
    seen = []
    late.launch_kernel(consumer, lambda: seen.append(read(copy)))
    waits = late.sync_calls
    late.clear_log()
    drop()
    assert late.sync_calls == waits
    assert f"cudaFreeAsync({consumer})" in late.log() and "cudaFree()" not in late.log()
    late.run_stream(consumer)
    np.testing.assert_array_equal(seen[0], ORIGINAL)


@pytest.mark.parametrize("consumer", [None, 2], ids=["legacy", "per-thread"])
@pytest.mark.parametrize("kind", [PINNED_HOST, MANAGED])
def test_pinned_copy_for_the_callers_stream_is_released_after_that_stream(cudart, kind, consumer):
    """Pinned or managed memory of device 0 copied for the legacy (or per-thread) stream while device 1 is current:
    the copies ran on device 1's stream, so the copy's memory is released after that stream (its event recorded
    there, in device 1's context), not after device 0's."""
    host = np.arange(N, dtype=np.float32)
    register(cudart, host, kind, device=0)
    cudart.current_device = 1
    cudart.late = True
    try:
        copy, drop = consume(DLPackShim(CaiArray(host)).__dlpack__(stream=consumer, copy=True, max_version=(1, 0)))
        cudart.log_context()
        cudart.clear_log()
        drop()
        records = [line for line in cudart.log() if line.startswith("cudaEventRecord")]
        assert records and all(line.endswith(f", {consumer or 1}) @ctx1") for line in records), cudart.log()
        drain(cudart)
    finally:
        cudart.late = False


@pytest.mark.parametrize("consumer", [1, 2])
@pytest.mark.parametrize("kind", [PINNED_HOST, MANAGED])
def test_pinned_copy_for_the_callers_stream_orders_the_producer_after_it(cudart, kind, consumer):
    """Pinned or managed memory of device 0, made on its stream S1, copied for the legacy (per-thread) stream while
    device 1 is current: the copies run on device 1's stream, so that is the stream whose event S1 waits on before
    the producer's allocator may reuse the source (device 0's would not hold the copies)."""
    host = np.arange(N, dtype=np.float32)
    register(cudart, host, kind, device=0)
    cudart.add_stream(S1, 0)
    cudart.current_device = 1
    cudart.log_context()
    cudart.clear_log()
    capsule = DLPackShim(CaiArray(host, stream=S1)).__dlpack__(stream=consumer, copy=True, max_version=(1, 0))
    log = cudart.log()
    last_copy = max(i for i, line in enumerate(log) if line.startswith(("cudaMemcpyAsync", "cudaMemcpy2DAsync")))
    assert log[last_copy].endswith(f", {consumer}) @ctx1")
    after = log[last_copy:]
    wait = next(i for i, line in enumerate(after) if line.startswith(f"cudaStreamWaitEvent({S1}, "))
    event = re.search(r", (ev\d+),", after[wait]).group(1)
    records = [line for line in after[:wait] if line.startswith(f"cudaEventRecord({event}, ")]
    assert records[-1:] == [f"cudaEventRecord({event}, {consumer}) @ctx1"], after  # device 1's stream, not 0's
    del capsule


@pytest.mark.parametrize("kind", [PINNED_HOST, MANAGED])
def test_pinned_copy_on_the_producers_legacy_stream_keeps_its_source_until_that_stream_ran(cudart, kind):
    """stream=-1 copies pinned or managed memory on the producer's stream: its legacy stream is the allocation's
    device's (device 0), whatever device is current, so the source is kept until device 0's legacy stream ran the
    copies (an event recorded there, in device 0's context, not on device 1's)."""
    host = np.arange(N, dtype=np.float32)
    register(cudart, host, kind, device=0)
    cudart.current_device = 1
    cudart.log_context()
    cudart.clear_log()
    capsule = DLPackShim(CaiArray(host, stream=1)).__dlpack__(stream=-1, copy=True, max_version=(1, 0))
    log = cudart.log()
    last_copy = max(i for i, line in enumerate(log) if line.startswith(("cudaMemcpyAsync", "cudaMemcpy2DAsync")))
    assert log[last_copy].endswith(", 1) @ctx0")
    records = [line for line in log[last_copy:] if line.startswith("cudaEventRecord")]
    assert records and all(line.endswith(", 1) @ctx0") for line in records), log
    del capsule


# ---- interpreter exit ---------------------------------------------------------------------------------------

def child_output(script, **fields):
    """The words a fresh Python process running script (its {support} and other fields filled in) printed; it
    must exit cleanly."""
    support = os.path.join(os.path.dirname(__file__), os.pardir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", script.format(support=support, **fields)], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


EXIT_SCRIPT = textwrap.dedent("""
    import ctypes, os, sys, weakref
    import numpy as np
    sys.path.insert(0, {support!r})
    from support.cuda_double import CudaDouble, DEVICE
    from support.cai_objects import CaiArray, register
    import cai_dlpack
    double = CudaDouble(os.environ["CAI_DLPACK_CUDART"])
    double.add_stream(0x6000, 0)
    double.late = True
    host = np.arange(8, dtype=np.float32)
    register(double, host, DEVICE)
    class Owner(CaiArray):
        def __del__(self):
            print("released", flush=True)
    capsule = cai_dlpack.cai2dlpack(Owner(host), stream=0x6000, max_version=(1, 0))
    api = ctypes.pythonapi
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
    address = api.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
    api.PyCapsule_SetName(capsule, b"used_dltensor_versioned")   # taken by a consumer, which drops it now
    from support.dlpack_ctypes import DLManagedTensorVersioned
    deleter = ctypes.cast(DLManagedTensorVersioned.from_address(address).deleter, ctypes.c_void_p).value
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(deleter)(address)
    print("pending", cai_dlpack._core._pending_releases()["pending"], flush=True)
    if {run_later}:
        double.lib.double_call_later.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        run_all = ctypes.cast(double.lib.double_run_all, ctypes.c_void_p).value
        assert double.lib.double_call_later(run_all, None, 200000) == 0
    print("exiting", flush=True)
""")


@pytest.mark.parametrize("run_later", [True, False])
def test_exit_waits_a_bounded_time_for_pending_releases(run_later):
    """At exit pending releases are waited for, at most 2 s: one whose stream runs meanwhile is released; one whose
    stream never runs is left (its memory may still be read), and the process ends cleanly either way."""
    expected = ["pending", "1", "exiting"] + (["released"] if run_later else [])
    assert child_output(EXIT_SCRIPT, run_later=run_later) == expected


EXIT_PAST_THE_BOUND_SCRIPT = textwrap.dedent("""
    import atexit, ctypes, os, sys, time
    started = []  # registered before the module's own handler, so it runs after it
    atexit.register(lambda: print("exit-under-3s", time.monotonic() - started[0] < 3.0, flush=True))
    import numpy as np
    sys.path.insert(0, {support!r})
    from support.cuda_double import CudaDouble, DEVICE
    from support.cai_objects import CaiArray, register
    import cai_dlpack
    from cai_dlpack import DLPackShim, dlpack2cai
    double = CudaDouble(os.environ["CAI_DLPACK_CUDART"])
    S1, S2 = 0x5000, 0x6000
    double.add_stream(S1, 0)
    double.add_stream(S2, 0)
    double.late = True
    limit = cai_dlpack._core._pending_releases()["limit"]
    host = np.zeros(limit + 2, dtype=np.float32)
    register(double, host, DEVICE)
    double.launch_kernel(S1, lambda: print("S1-ran", flush=True))
    class Owner(CaiArray):
        def __del__(self):
            print("owner-released", flush=True)
    owner = Owner(host[limit + 1:])
    owner.views = [dlpack2cai(DLPackShim(CaiArray(host[i:i + 1])), stream=S1) for i in range(limit + 1)]
    double.launch_kernel(S2, lambda: None)
    capsule = cai_dlpack.cai2dlpack(owner, stream=S2, max_version=(1, 0))
    del owner
    api = ctypes.pythonapi
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
    address = api.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
    api.PyCapsule_SetName(capsule, b"used_dltensor_versioned")
    from support.dlpack_ctypes import DLManagedTensorVersioned
    deleter = ctypes.cast(DLManagedTensorVersioned.from_address(address).deleter, ctypes.c_void_p).value
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(deleter)(address)
    print("pending", cai_dlpack._core._pending_releases()["pending"], flush=True)
    # S2 runs 100 ms into the exit handler's wait: the owner's release is made there, dropping its views.
    double.lib.double_call_later.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    run_stream = ctypes.cast(double.lib.double_run_stream, ctypes.c_void_p).value
    assert double.lib.double_call_later(run_stream, S2, 100000) == 0
    started.append(time.monotonic())
    print("exiting", flush=True)
""")


def test_exit_never_waits_on_a_stream_for_the_bound():
    """A release made in the exit handler's wait (an owner holding more views than CDL_PENDING_LIMIT, for S1,
    which never runs) queues them past the bound: exit leaves them pending rather than waiting for S1 (a stream
    that may never get there), and still returns within its time."""
    assert child_output(EXIT_PAST_THE_BOUND_SCRIPT) == ["pending", "1", "exiting", "owner-released", "exit-under-3s", "True"]


# A legacy subinterpreter imports the module before the main interpreter does (a plugin host), then ends: its exit
# runs the module's exit handler (single-phase init registers it with the first importer's atexit).
SUBINTERPRETER_IMPORTS_FIRST_AND_ENDS = LEGACY_SUBINTERPRETER + """
assert "cai_dlpack" not in sys.modules
error = run("import sys; sys.path[:0] = %r; import cai_dlpack" % (sys.path,))
assert error is None, error
interpreters.destroy(interp)
"""

# Then, in the main interpreter: drops past the bound for a stream that never runs, and a release whose stream ran.
AFTER_A_SUBINTERPRETER_ENDED = f"""
import weakref
from test_ordered_release import consume
from cai_dlpack import _core, cai2dlpack
double.add_stream({S1}, 0)
double.add_stream({S2}, 0)
double.late = True
limit = _core._pending_releases()["limit"]
host = np.zeros(limit + 21, dtype=np.float32)
register(double, host, DEVICE)
double.launch_kernel({S2}, lambda: None)
for i in range(limit + 20):
    consume(cai2dlpack(CaiArray(host[i:i + 1]), stream={S2}, max_version=(1, 0)))[1]()
info = _core._pending_releases()
print("over", info["pending"] - limit, "waited", info["waited"])
double.launch_kernel({S1}, lambda: None)
x = CaiArray(host[limit + 20:])
watch = weakref.ref(x)
consume(cai2dlpack(x, stream={S1}, max_version=(1, 0)))[1]()
del x
double.run_stream({S1})  # its host function schedules the pending call
for _ in range(1000):  # bytecode only: the interpreter makes its pending calls here
    if watch() is None:
        break
print("released", watch() is None)
"""


@pytest.mark.skipif(bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
                    reason="a free-threaded CPython loads no single-phase module (ours) in any subinterpreter")
@pytest.mark.parametrize("first", ["main interpreter", "a subinterpreter that ended"])
def test_a_subinterpreter_ending_leaves_the_bound_and_the_pending_call_to_the_main_interpreter(first):
    """The exit handler may run when the subinterpreter that imported the module first ends, long before the process
    does: only the main interpreter's stops waiting for the bound and scheduling collections. The main interpreter
    then still holds the bound (each drop past it waits for the oldest) and makes a release once its stream ran,
    without another conversion."""
    out = run_with_double((SUBINTERPRETER_IMPORTS_FIRST_AND_ENDS if first != "main interpreter" else "")
                          + AFTER_A_SUBINTERPRETER_ENDED)
    assert out == ["over", "0", "waited", "20", "released", "True"]


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


def test_a_refused_wait_past_the_bound_keeps_the_release_pending(late):
    """Past CDL_PENDING_LIMIT the oldest release waits for its event; a wait the runtime refuses (900, as CUDA
    answers while a capture prohibits it, or any other error) keeps that release pending: its owner lives on while
    the consumer's stream has not run what it queued before the drop."""
    watch, host, limit = fill_to_the_bound(late)
    late.fail("cudaEventSynchronize", 900)
    consume(cai2dlpack(CaiArray(host[limit:]), stream=S2, max_version=(1, 0)))[1]()
    gc.collect()
    assert late.queued(S2) > 0  # S2 never ran: its work before the first drop is still queued
    assert watch() is not None, "released while the consumer's stream had not run past the drop"
    assert late.last_error == 0  # the refusal was ours to clear


def test_a_wait_past_the_bound_leaves_another_librarys_error_pending(late):
    """The wait past CDL_PENDING_LIMIT that succeeds clears nothing: an error another library left pending in the
    runtime is still there for it."""
    waits = late.sync_calls
    watch, host, limit = fill_to_the_bound(late)
    assert late.lib.cudaSetDevice(99) != 0  # another library's failure, left pending
    pending = late.last_error
    consume(cai2dlpack(CaiArray(host[limit:]), stream=S2, max_version=(1, 0)))[1]()
    assert late.sync_calls > waits  # the wait was made
    assert late.last_error == pending != 0
    late.lib.cudaGetLastError()


def test_the_wait_past_the_bound_is_made_in_relaxed_capture_mode(late):
    """cudaEventSynchronize is one of the calls a capture prohibits (the thread's own non-relaxed capture, or any
    other thread's global-mode capture: 900, and that capture invalidated), as cudaEventQuery is: the wait past the
    bound is made in relaxed mode, seen by the kernel the wait runs, which looks at the waiting thread's mode."""
    modes = []
    watch, host, limit = fill_to_the_bound(late, first_kernel=lambda: modes.append(late.thread_capture_mode))
    capture = late.begin_capture(0x7777, 0, GLOBAL, other_thread=True)  # PyTorch's default, another thread
    consume(cai2dlpack(CaiArray(host[limit:]), stream=S2, max_version=(1, 0)))[1]()
    assert modes, "the wait ran nothing"
    assert modes == [RELAXED], f"cudaEventSynchronize made in mode {modes[0]} while another thread captures globally"
    late.end_capture(capture)


def test_a_drop_while_the_consumers_stream_captures_waits_for_the_work_queued_before_the_capture(late):
    """Converted outside any capture, a kernel queued on C, then C begins a capture and the tensor is dropped: the
    kernel queued before the capture is ordinary work still to run, so the release stays pending (no event can be
    recorded in the capture) until C is outside the capture and has run that work."""
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


def test_a_legacy_stream_drop_while_another_thread_captures_waits_for_the_work_queued_before(late):
    """Consumer stream 1 (cai2dlpack(obj), None): a kernel queued on the legacy stream, then another thread
    begins capturing a blocking stream and the tensor is dropped. The capture query of the legacy stream answers
    906 (nothing can be recorded there now): the release stays pending until the legacy stream ran the kernel."""
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


def test_a_release_is_made_when_its_stream_reaches_it_without_another_conversion(late):
    """A stream that completes after the drop's pending call ran: the release is made when the stream reaches it
    (a host function queued after the event schedules the pending call), not at some later conversion or deleter,
    which a program that stops converting never makes."""
    pool = Pool(late)
    watch, drop = shim_tensor_with_work_queued(late, pool)
    drop()
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
    """A release whose stream has run is made though an older one on another stream is still pending (issue 34:
    'completed releases are collected without blocking')."""
    S3 = 0x5800
    late.add_stream(S3, 0)
    pool = Pool(late)
    older = pool.take(ORIGINAL)
    capsule = DLPackShim(older).__dlpack__(stream=S3, max_version=(1, 0))
    late.launch_kernel(S3, lambda: None)  # S3 is busy for a long time
    consume(capsule)[1]()
    del older, capsule
    watch, drop = shim_tensor_with_work_queued(late, pool)
    drop()
    late.run_stream(S2)  # the consumer's stream of x has run past the drop
    gc.collect()
    info = _core._pending_releases()
    assert watch() is None, f"x's release completed but is held behind S3's: {info}"


def test_the_double_refuses_an_event_synchronize_that_a_capture_prohibits(cudart):
    """The double's fidelity: cudaEventSynchronize, the blocking form of cudaEventQuery, is refused (900, the
    capture invalidated) where the thread's mode prohibits it, as cudaEventQuery and cudaStreamSynchronize are:
    else no test on the double could see the bound's wait breaking another thread's global capture."""
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
    lib.cudaGetLastError()
    cudart.end_capture(capture)


def test_a_refused_host_function_leaves_the_release_to_the_next_collection_and_no_error_behind(late):
    """Where the runtime refuses the host function that schedules the pending call, the release is still made once
    its stream has run, by the next collection, and the refusal is not left as the runtime's last error."""
    pool = Pool(late)
    watch, drop = shim_tensor_with_work_queued(late, pool)
    late.fail("cudaLaunchHostFunc", 2)
    drop()
    assert late.last_error == 0
    assert any(line.startswith("cudaLaunchHostFunc(") for line in late.log())  # the refusal was met
    late.run_stream(S2)
    assert _core._pending_releases()["pending"] == 0 and watch() is None


def on_a_worker_while_the_main_thread_waits_in_c(work):
    """Runs work on another thread while this one waits in C (so runs no pending call), the GIL's switch interval
    long; re-raises what work raised."""
    go, done, failed = threading.Event(), threading.Lock(), []
    done.acquire()

    def run():
        go.wait()
        try:
            work()
        except BaseException as error:  # noqa: B036 (handed to the main thread)
            failed.append(error)
        finally:
            done.release()

    thread = threading.Thread(target=run)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        thread.start()
        go.set()
        assert done.acquire(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    thread.join()
    if failed:
        raise failed[0]


def test_a_release_whose_stream_ran_before_the_main_thread_came_back_is_made_by_the_drops_own_pending_call(late):
    """A drop on another thread schedules a collection itself, not only through the host function it queues after
    the event: here that host function is refused and the dropping thread runs the stream before the main thread
    (the one that makes pending calls) gets the GIL back. The release is made as soon as it does, with no
    conversion or deleter of ours called in between."""
    pool = Pool(late)
    watch, drop = shim_tensor_with_work_queued(late, pool)
    late.fail("cudaLaunchHostFunc", 2)

    # The main thread must run no bytecode between the drop and the stream's run (it would make the drop's pending
    # call then, too early to find the stream ran).
    def drop_and_run():
        drop()
        late.run_stream(S2)

    on_a_worker_while_the_main_thread_waits_in_c(drop_and_run)
    for _ in range(1000):  # bytecode only: the interpreter makes its pending calls here
        if watch() is None:
            break
    assert watch() is None, "released only at a later conversion"


# What a collection on another thread releases: made for S2 from x, with the call that schedules its collection
# refused (its kept handle, if any, in `held`).
HELD_FOR_S2 = {
    "a device copy's source": """
double.fail("cudaLaunchHostFunc", 2)
held = Taken(DLPackShim(x).__dlpack__(stream=S2, copy=True, max_version=(1, 0)))
""",
    "a view's producer": """
views = [dlpack2cai(DLPackShim(x), stream=S2)]
double.launch_kernel(S2, lambda: None)
double.fail("cudaLaunchHostFunc", 2)
views.clear()
held = None
""",
}


@pytest.mark.parametrize("what", HELD_FOR_S2)
def test_a_release_made_on_a_thread_with_no_python_state_gives_the_gil_back(what):
    """A release is made by whichever collection first finds its stream ran: here one made by a tensor dropped on a
    thread that never ran Python (the host function that would have scheduled the collection was refused). That
    thread takes the GIL for the release and gives it back: the process goes on. Own process: a thread that ended
    holding the GIL would hang this one."""
    out = run_with_double(f"""
import ctypes, gc, weakref
from test_ordered_release import Taken
from cai_dlpack import DLPackShim, _core, dlpack2cai
S1, S2 = {S1}, {S2}
double.add_stream(S1, 0)
double.add_stream(S2, 0)
double.late = True
block, other = np.arange(8, dtype=np.float32), np.arange(8, dtype=np.float32)
register(double, block, DEVICE)
register(double, other, DEVICE)
x = CaiArray(block, stream=S1)
watch = weakref.ref(x)
dropped = Taken(DLPackShim(CaiArray(other, stream=S1)).__dlpack__(stream=S2, max_version=(1, 0)))
""" + HELD_FOR_S2[what] + """
del x
gc.collect()
double.run_stream(S2)
print("kept" if watch() is not None else "gone")
double.lib.double_call_in_thread.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
assert double.lib.double_call_in_thread(dropped.deleter, dropped.address) == 0
print("released" if watch() is None else "kept", _core._pending_releases()["pending"])
if held is not None:
    held.drop()
""", timeout=30)
    assert out == ["kept", "released", "1"]


class ForeignProducer:
    """Another library's DLPack export of device memory: its tensor's deleter counts its calls."""

    def __init__(self, block):
        self.made = MadeTensor(data=block.ctypes.data, device=(kDLCUDA, 0), shape=block.shape)

    def __dlpack_device__(self):
        return (kDLCUDA, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return self.made.capsule


@pytest.mark.parametrize("consumer", [S2, 1, -1], ids=["a stream", "the legacy stream", "no stream"])
def test_a_foreign_tensor_a_view_held_is_deleted_after_its_consumers_work(late, consumer):
    """A view of another library's tensor, dropped while work queued on the view's stream (the legacy one too) has
    not run: that library's deleter runs once the work ran (at once for stream -1, which orders nothing)."""
    block = np.arange(N, dtype=np.float32)
    register(late, block, DEVICE)
    producer = ForeignProducer(block)
    view = dlpack2cai(producer, stream=consumer)
    seen = []
    if consumer != -1:
        late.launch_kernel(consumer, lambda: seen.append(producer.made.deleted))
    del view
    gc.collect()
    _core._pending_releases()
    if consumer == -1:
        assert producer.made.deleted == 1
        return
    assert producer.made.deleted == 0
    drain(late)
    assert seen == [0] and producer.made.deleted == 1


FIRST_VIEW_SCRIPT = textwrap.dedent("""
    import gc, os, sys
    import numpy as np
    sys.path.insert(0, {support!r})
    from support.cuda_double import CudaDouble, DEVICE
    from support.cai_objects import register
    from support.dlpack_ctypes import MadeTensor, kDLCUDA
    import cai_dlpack
    double = CudaDouble(os.environ["CAI_DLPACK_CUDART"])
    double.add_stream(0x6000, 0)
    double.late = True
    block = np.arange(8, dtype=np.float32)
    register(double, block, DEVICE)
    made = MadeTensor(data=block.ctypes.data, device=(kDLCUDA, 0), shape=block.shape)
    class Foreign:
        def __dlpack_device__(self):
            return (kDLCUDA, 0)
        def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
            return made.capsule
    view = cai_dlpack.dlpack2cai(Foreign(), stream=0x6000)  # the process's first use of the runtime
    double.launch_kernel(0x6000, lambda: print("kernel", made.deleted, flush=True))
    del view
    gc.collect()
    print("dropped", made.deleted, flush=True)
    double.run_all()
    cai_dlpack._core._pending_releases()
    print("ran", made.deleted, flush=True)
""")


def test_a_view_made_before_the_runtime_was_loaded_still_orders_its_release(cudart):
    """In a process where nothing has loaded the CUDA runtime yet, a view of another library's device tensor
    asks the runtime nothing: its release must load it to be ordered after the view's stream."""
    assert child_output(FIRST_VIEW_SCRIPT) == ["dropped", "0", "kernel", "0", "ran", "1"]


SPARE_EVENTS_SCRIPT = textwrap.dedent("""
    import ctypes, os, sys
    import numpy as np
    sys.path.insert(0, {support!r})
    from support.cuda_double import CudaDouble, DEVICE
    from support.cai_objects import CaiArray, register
    from support.dlpack_ctypes import DLManagedTensorVersioned
    import cai_dlpack
    double = CudaDouble(os.environ["CAI_DLPACK_CUDART"])
    double.add_stream(0x5000, 0)
    double.add_stream(0x6000, 0)
    host = np.arange(8, dtype=np.float32)
    register(double, host, DEVICE)
    api = ctypes.pythonapi
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
    for cycle in range(6):
        capsule = cai_dlpack.cai2dlpack(CaiArray(host, stream=0x5000), stream=0x6000, max_version=(1, 0))
        address = api.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
        api.PyCapsule_SetName(capsule, b"used_dltensor_versioned")
        deleter = ctypes.cast(DLManagedTensorVersioned.from_address(address).deleter, ctypes.c_void_p).value
        ctypes.CFUNCTYPE(None, ctypes.c_void_p)(deleter)(address)   # a release recorded on 0x6000
        cai_dlpack._core._pending_releases()                        # made: its event is kept for the next
        if cycle == 0:
            double.clear_log()
    print(sum(line.startswith("cudaEventCreate") for line in double.log()), flush=True)
""")


def test_a_steady_stream_of_releases_reuses_one_event(cudart):
    """In a fresh process (no event kept yet), one ordered release after another: the first makes the event each
    later one reuses, so no event is created after the first cycle."""
    assert child_output(SPARE_EVENTS_SCRIPT) == ["0"]


@pytest.mark.parametrize("value", [1, 0, None, "yes"])
def test_the_ordered_release_switch_takes_only_a_bool(value):
    """The tests' switch (_set_ordered_release) refuses anything but True or False with a TypeError naming what
    it got, and leaves the setting as it was."""
    try:
        with pytest.raises(TypeError, match=f"takes a bool, not {type(value).__name__}"):
            _core._set_ordered_release(value)
        assert _core._pending_releases()["enabled"] is True
    finally:
        _core._set_ordered_release(True)


def test_a_device_reset_gives_the_release_a_new_event():
    """The release's spare events are kept per context: after a device reset (its context and events destroyed),
    the next release records a new event instead of a dead one (as the stream ordering of the conversion does:
    two new events, no refused record). In a fresh process, whose spare events all belong to this case (an earlier
    test's could fill the few kept)."""
    out = run_with_double(f"""
        from test_ordered_release import through_cai2dlpack
        from cai_dlpack import _core
        host = np.zeros(8, dtype=np.float32)
        register(double, host, DEVICE, device=2)
        double.add_stream({S2}, 2)
        obj = CaiArray(host, stream=1)

        def take_and_drop():
            _, drop, _ = through_cai2dlpack(obj)
            drop()

        take_and_drop()  # the release's event is kept for the next one
        double.reset_device(2)
        double.clear_log()
        before = double.events_created
        take_and_drop()
        print(double.events_created - before, sum("error" in line.lower() for line in double.log()),
              _core._pending_releases()["pending"], double.last_error)
    """)
    assert out == ["2", "0", "0", "0"]  # two new events, no error, nothing pending or left


@pytest.mark.parametrize("make", [
    lambda x: cai2dlpack(x, max_version=(1, 0)),
    lambda x: cai2dlpack(x, max_version=(1, 0), copy=True),
    lambda x: DLPackShim(x).__dlpack__(stream=None, max_version=(1, 0)),
], ids=["shared", "copy", "shim"])
def test_a_host_tensor_is_released_at_once_with_no_runtime_call(cudart, make):
    """Host memory no stream reads: a consumer's drop releases it at once, asking the runtime nothing (the runtime
    is loaded, as in any process that converted device data)."""
    cuda_runtime_info()
    x = np.arange(N, dtype=np.float32)
    watch_x = sys.getrefcount(x)
    _, drop = consume(make(x))
    cudart.clear_log()
    drop()
    assert cudart.log() == [] and _core._pending_releases()["pending"] == 0
    assert sys.getrefcount(x) == watch_x


def test_a_release_whose_event_record_is_refused_records_a_new_event_and_still_waits(late):
    """A kept event of a context reset under the same id is a dead handle: its record is refused, and the release
    records a new event in its place, so it still waits for the consumer's stream (not released at once)."""
    pool = Pool(late)
    watch, drop = shim_tensor_with_work_queued(late, pool)
    late.fail("cudaEventRecord", 400)  # the release's record: its event is dead
    drop()
    gc.collect()
    assert watch() is not None and _core._pending_releases()["pending"] == 1  # the kernel on S2 has not run
    assert late.last_error == 0
    drain(late)
    gc.collect()
    assert watch() is None


def test_a_release_whose_streams_context_the_driver_will_not_name_is_made_at_once(late):
    """A release on a stream whose context cuStreamGetCtx refuses to name (a stream destroyed meanwhile): no event
    can be recorded in it, so the owner is released at once, the runtime asked nothing more, nothing kept pending
    and no runtime error left."""
    pool = Pool(late)
    watch, drop = shim_tensor_with_work_queued(late, pool)
    late.clear_log()
    late.fail("cuStreamGetCtx", 400)
    drop()
    gc.collect()
    assert watch() is None and _core._pending_releases()["pending"] == 0
    assert [call.split("(")[0] for call in late.log()] == ["cuStreamGetCtx"]  # no event recorded, none asked after
    assert late.last_error == 0


def test_two_releases_pending_at_once_record_two_kept_events():
    """Two releases wait, then complete: both events are kept. Two more releases pending at once take one kept
    event each, never the same one twice (one event would mark two points of the stream, and the older release
    would wait for the newer's work). In a fresh process, whose kept events are all this case's."""
    out = run_with_double(f"""
        from test_ordered_release import through_cai2dlpack
        from cai_dlpack import _core
        host = np.zeros(8, dtype=np.float32)
        register(double, host, DEVICE)
        double.add_stream({S1}, 0)
        double.add_stream({S2}, 0)
        double.late = True
        obj = CaiArray(host, stream={S1})

        def two_pending():
            drops = [through_cai2dlpack(obj)[1] for _ in range(2)]
            double.clear_log()
            for drop in drops:
                drop()
            return [line.split(",")[0] for line in double.log() if line.startswith("cudaEventRecord(")
                    and line.endswith(", {S2})")]

        two_pending()
        double.run_all()
        assert _core._pending_releases()["pending"] == 0  # completed: both events kept
        made = double.events_created
        print(*two_pending(), double.events_created - made)
    """)
    first, second, made = out
    assert first != second and made == "0", out  # the two kept events, one each


def test_at_most_64_events_are_kept_for_later_releases():
    """Seventy releases wait at once, then their stream runs: 64 of their events are kept for later releases (the
    README's bound), the other six destroyed. In a fresh process, whose kept events are all this case's."""
    out = run_with_double(f"""
        from test_ordered_release import through_cai2dlpack
        from cai_dlpack import _core
        host = np.zeros(8, dtype=np.float32)
        register(double, host, DEVICE)
        double.add_stream({S1}, 0)
        double.add_stream({S2}, 0)
        double.late = True
        obj = CaiArray(host, stream={S1})
        through_cai2dlpack(obj)[1]()  # the conversions' own event (stream ordering) is made
        double.run_all()
        _core._pending_releases()
        alive = double.events_alive
        for drop in [through_cai2dlpack(obj)[1] for _ in range(70)]:
            drop()
        assert _core._pending_releases()["pending"] == 70
        double.run_all()
        assert _core._pending_releases()["pending"] == 0
        print(double.events_alive - alive)
    """)
    assert out == ["63"]  # 64 kept, one of which the first release kept already


@pytest.mark.parametrize("streams, asked_again", [(16, 0), (17, 1)])
def test_a_collection_passes_over_later_releases_of_sixteen_busy_streams_at_most(late, streams, asked_again):
    """Two releases wait on each of several streams, none of which has run. A collection asks the first release of
    each stream and passes over the second without asking (events of one stream complete in order), for up to 16
    busy streams, which is all it keeps track of: the second release on a 17th stream is asked again (one event
    query more), and nothing is written past that table."""
    handles = [0x7000 + 0x100 * i for i in range(streams)]
    for handle in handles:
        late.add_stream(handle, 0)
    x = Pool(late).take(ORIGINAL)

    def drop_one_on_each_stream():
        for handle in handles:
            consume(DLPackShim(x).__dlpack__(stream=handle, max_version=(1, 0)))[1]()

    def calls_of_a_collection():
        # The fewest of three: a collection the interpreter runs on its own (the pending call) only adds calls.
        counts = []
        for _ in range(3):
            before = late.calls
            _core._pending_releases()
            counts.append(late.calls - before)
        return min(counts)

    drop_one_on_each_stream()
    one_each = calls_of_a_collection()
    drop_one_on_each_stream()
    two_each = calls_of_a_collection()
    assert _core._pending_releases()["pending"] == 2 * streams
    assert two_each - one_each == asked_again


EXIT_WITH_NOTHING_PENDING_SCRIPT = textwrap.dedent("""
    import gc, sys, threading, time
    import cai_dlpack
    exit_handler, = [f for f in gc.get_objects()
                     if callable(f) and getattr(f, "__name__", None) == "_release_pending_at_exit"]
    go, ran = threading.Event(), []
    def other():
        go.wait()
        ran.append(True)  # needs the GIL
    thread = threading.Thread(target=other)
    sys.setswitchinterval(1000.0)
    thread.start()
    go.set()
    spin = time.perf_counter() + 0.05
    while time.perf_counter() < spin:  # holding the GIL: the other thread is woken and waits for it
        pass
    exit_handler()
    print("pending", cai_dlpack._core._pending_releases()["pending"], "others-ran", bool(ran), flush=True)
    sys.setswitchinterval(0.005)
    thread.join(10)
""")


@pytest.mark.skipif(not getattr(sys, "_is_gil_enabled", lambda: True)(),
                    reason="told by a thread waiting for the GIL: a free-threaded build has none to wait for")
def test_exit_with_nothing_pending_does_not_wait():
    """With no release pending, the exit handler returns at once: it never polls, and so never lets the GIL go (its
    wait polls without the GIL), and a thread waiting for the GIL does not run during it. Called directly, in a
    fresh process (the handler also stops scheduling collections for the rest of the process)."""
    assert child_output(EXIT_WITH_NOTHING_PENDING_SCRIPT) == ["pending", "0", "others-ran", "False"]


def test_drops_on_another_thread_take_one_pending_call_slot_between_collections(late):
    """Each drop on a thread other than the main one asks for a collection, but the pending call is scheduled once
    until it runs: CPython's few slots of pending calls (32 on 3.11, for the main thread's) stay free for others. Here
    400 drops are made while the main thread waits in C (so runs no pending call), then another pending call is
    added: it finds a slot."""
    x = Pool(late).take(ORIGINAL)
    drops = [through_shim(x)[1] for _ in range(400)]
    late.launch_kernel(S2, lambda: None)
    ran = []
    callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(lambda _: ran.append(True) or 0)
    added = []

    def drop_all():
        for drop in drops:
            drop()
        added.append(ctypes.pythonapi.Py_AddPendingCall(callback, None))

    on_a_worker_while_the_main_thread_waits_in_c(drop_all)
    assert added == [0]
    for _ in range(1000):  # bytecode: the pending calls run here
        if ran:
            break
    assert ran == [True]


def test_a_collection_cpython_had_no_slot_for_is_scheduled_by_the_next_drop(late):
    """A drop whose collection cannot be scheduled (CPython's pending calls all taken) leaves none scheduled, so the
    next drop schedules it: its release, and the first's, are made as soon as the main thread runs again."""
    x = Pool(late).take(ORIGINAL)
    watch = weakref.ref(x)
    first, second = through_shim(x)[1], through_shim(x)[1]
    del x
    late.launch_kernel(S2, lambda: None)
    late.fail("cudaLaunchHostFunc", 2, count=2)  # no host function schedules a collection: only the drops
    fillers = []
    callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(lambda _: fillers.append(True) or 0)

    def fill_then_drop():
        for _ in range(10000):  # CPython keeps a few dozen, a few hundred at most
            if ctypes.pythonapi.Py_AddPendingCall(callback, None) != 0:
                break
        else:
            raise AssertionError("CPython's pending calls never filled")
        first()

    on_a_worker_while_the_main_thread_waits_in_c(fill_then_drop)
    for _ in range(1000):  # bytecode: the fillers run here, and free the slots
        if fillers:
            break
    assert fillers and watch() is not None

    def drop_then_run():
        second()
        late.run_stream(S2)

    on_a_worker_while_the_main_thread_waits_in_c(drop_then_run)
    for _ in range(1000):  # bytecode: the pending call the second drop scheduled runs here
        if watch() is None:
            break
    assert watch() is None, "released only at a later conversion"
