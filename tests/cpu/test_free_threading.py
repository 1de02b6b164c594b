"""Free-threading: the state the C core shares between threads (the CUDA runtime table, the event pool, the
CAI opt-out switches) hammered from many threads at once, with the GIL released where our code runs without
it: the DLPack exchange API's allocator and the deleters of tensors, called here through ctypes, which drops
the GIL around a foreign call. On a free-threaded CPython the module keeps the GIL off, so every Python thread
here runs in parallel too; elsewhere the GIL serializes the Python-side calls and the rest still races."""
import contextlib
import ctypes
import os
import re
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time

import numpy as np
import pytest

from cai_dlpack import DLPackShim, DLPackView, cai2dlpack, dlpack2cai, options
from support import threads
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE, GLOBAL
from support.dlpack_ctypes import (DLDataType, DLDevice, DLManagedTensorVersioned, DLTensor, _api, kDLCPU, kDLCUDA,
                                   kDLCUDAHost, kDLCUDAManaged, read_capsule)

FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
THREADS = 8

SetError = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p)
Allocator = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(DLTensor),
                             ctypes.POINTER(ctypes.POINTER(DLManagedTensorVersioned)), ctypes.c_void_p, SetError)


class ExchangeAPI(ctypes.Structure):
    """dlpack.h's DLPackExchangeAPI; only the allocator is called here (the other calls need the GIL)."""
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("prev_api", ctypes.c_void_p),
                ("managed_tensor_allocator", Allocator), ("from_py_object", ctypes.c_void_p),
                ("to_py_object", ctypes.c_void_p), ("dltensor_from_py_object", ctypes.c_void_p),
                ("current_work_stream", ctypes.c_void_p)]


def run_threads(work, count=THREADS):
    """Runs work(i) on count threads started together; returns the exceptions they raised."""
    return threads.run_threads(work, count)


def allocate(allocator, device_type, count):
    """A float32 tensor of count elements from the exchange allocator, called without the GIL."""
    refused = []
    set_error = SetError(lambda _context, kind, message: refused.append((kind, message)))
    shape = (ctypes.c_int64 * 1)(count)
    prototype = DLTensor(ndim=1, dtype=DLDataType(2, 32, 1), device=DLDevice(device_type, 0),
                         shape=ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64)))
    out = ctypes.POINTER(DLManagedTensorVersioned)()
    assert allocator(ctypes.byref(prototype), ctypes.byref(out), None, set_error) == 0, refused
    return out


def exchange_allocator():
    return ExchangeAPI.from_address(DLPackShim.__c_dlpack_exchange_api__).managed_tensor_allocator


def test_the_module_keeps_the_gil_off():
    """Importing the module leaves the GIL off on a free-threaded build: it declares Py_mod_gil not used (a module
    that does not turns the GIL on for the whole process, with a RuntimeWarning)."""
    if not FREE_THREADED:
        pytest.skip("not a free-threaded CPython (3.13t, 3.14t): the GIL is always on here")
    env = {key: value for key, value in os.environ.items() if key != "PYTHON_GIL"}
    result = subprocess.run([sys.executable, "-W", "error", "-c", "import cai_dlpack, sys; print(sys._is_gil_enabled())"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_threads_racing_to_load_the_runtime_without_the_gil_share_one():
    """A fresh process whose first calls into us are the exchange allocator on eight threads at once (no GIL held):
    every one loads, or waits for, one runtime, and every tensor is made and freed."""
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = {sys.path!r}
        import ctypes
        import cai_dlpack
        from test_free_threading import allocate, exchange_allocator, run_threads
        allocator = exchange_allocator()
        made = []

        def work(i):
            for round in range(20):
                out = allocate(allocator, {kDLCUDA} if (i + round) % 2 else {kDLCUDAManaged}, 64)
                ctypes.memset(out.contents.dl_tensor.data, i, 256)
                made.append(ctypes.string_at(out.contents.dl_tensor.data, 256) == bytes([i]) * 256)
                out.contents.deleter(out)

        errors = run_threads(work)
        assert errors == [], errors
        print(len(made), all(made), cai_dlpack.cuda_runtime_info()["path"])
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=os.path.dirname(__file__))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(THREADS * 20), "True", os.environ["CAI_DLPACK_CUDART"]]


def test_record_and_wait_of_the_shared_event_are_never_split(cudart):
    """Every thread orders its own producer stream before its own consumer stream through the one pooled event of
    the context: a consumer's wait always follows the record on its own producer, never another thread's."""
    host = np.arange(256, dtype=np.float32)
    register(cudart, host, DEVICE)
    producer = {0x9000 + 16 * i: 0x5000 + 16 * i for i in range(THREADS)}  # consumer -> its producer
    objects = [CaiArray(host, stream=0x5000 + 16 * i) for i in range(THREADS)]
    cudart.clear_log()

    def work(i):
        consumer = 0x9000 + 16 * i
        for round in range(300):
            if round % 3 == 0:
                view = dlpack2cai(DLPackShim(objects[i]), stream=consumer)
                assert view.__cuda_array_interface__["stream"] == consumer
            else:
                cai2dlpack(objects[i], stream=consumer, max_version=(1, 0))

    assert run_threads(work) == []
    last_record, checked, ordering_events = {}, 0, set()
    for line in cudart.log():
        record = re.fullmatch(r"cudaEventRecord\(ev(\d+), (\d+)\)", line)
        wait = re.fullmatch(r"cudaStreamWaitEvent\((\d+), ev(\d+), 0\)", line)
        if record:
            last_record[record[1]] = int(record[2])
            if int(record[2]) in producer.values():
                ordering_events.add(record[1])
        elif wait:
            assert last_record[wait[2]] == producer[int(wait[1])], line
            checked += 1
    assert checked > 100  # as far as the double's log reaches
    # The ordering used one event (the views' stream-ordered releases record their own, on the consumers' streams,
    # one per release still pending in late mode).
    assert len(ordering_events) == 1
    assert cudart.current_device == 0 and cudart.context_device == 0


def test_external_waits_from_many_threads_keep_one_event_per_producer(cudart):
    """Threads join one capture from 96 producer streams, more than the pool keeps: entries are made and given up
    concurrently, an external wait's event is only ever recorded on its own producer, and the capture stays whole."""
    host = np.arange(64, dtype=np.float32)
    register(cudart, host, DEVICE)
    consumer = 0x6000
    capture = cudart.begin_capture(consumer, 0, GLOBAL)
    cudart.clear_log()

    def work(i):
        for round in range(4):
            for j in range(12):
                cai2dlpack(CaiArray(host, stream=0x20000 + 64 * i + j), stream=consumer)

    assert run_threads(work) == []
    recorded_on = {}
    for line in cudart.log():
        record = re.fullmatch(r"cudaEventRecord\(ev(\d+), (\d+)\)", line)
        if record:
            assert recorded_on.setdefault(record[1], record[2]) == record[2], line
    assert len(recorded_on) > 64  # given-up entries were made again
    assert cudart.end_capture(capture) and cudart.violations == 0


def test_allocator_and_deleters_without_the_gil_beside_conversions(cudart):
    """Threads make and free tensors through the allocator and run our exports' deleters with the GIL released,
    while others convert: every tensor is usable, every reference an export held is released."""
    allocator = exchange_allocator()
    owner = np.arange(32.0)
    base = sys.getrefcount(owner)
    kinds = [kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged]
    _api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]

    def work(i):
        for round in range(150):
            if i % 2:
                out = allocate(allocator, kinds[(i + round) % 4], 16)
                ctypes.memset(out.contents.dl_tensor.data, 7, 64)
                assert ctypes.string_at(out.contents.dl_tensor.data, 64) == b"\x07" * 64
                out.contents.deleter(out)
            else:
                capsule = cai2dlpack(owner, max_version=(1, 0))
                address = _api.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
                _api.PyCapsule_SetName(capsule, b"used_dltensor_versioned")  # consumed: the deleter is ours to run
                managed = DLManagedTensorVersioned.from_address(address)
                managed.deleter(ctypes.pointer(managed))
                assert np.asarray(dlpack2cai(owner))[3] == 3.0

    assert run_threads(work) == []
    assert sys.getrefcount(owner) == base
    assert cudart.current_device == 0 and cudart.context_device == 0


def test_options_change_while_other_threads_convert(cudart):
    """One thread flips the CAI opt-outs while others export views' interfaces and order streams: each read sees
    one setting or the other, never anything else."""
    host = np.arange(16, dtype=np.float32)
    register(cudart, host, DEVICE)
    view = dlpack2cai(DLPackShim(CaiArray(host, stream=0x5000)), stream=0x9000)
    before = options()
    assert isinstance(view, DLPackView)

    def work(i):
        for round in range(2000):
            if i == 0:
                options(sync=bool(round % 2), export_stream=bool(round % 3))
            elif i % 2:
                assert view.__cuda_array_interface__["stream"] in (None, 0x9000)
            else:
                cai2dlpack(CaiArray(host, stream=0x5000), stream=0x9000 + i)

    try:
        assert run_threads(work, count=4) == []
    finally:
        options(**before)
    assert options() == before


@pytest.mark.skipif(not FREE_THREADED, reason="with a GIL one options() call runs whole: no two calls overlap")
def test_an_option_one_thread_sets_is_not_undone_by_another_threads_call():
    """options() writes only the options it names: one thread switching export_stream over and over never puts back
    an old trust_streams over the one another thread just set (calls overlap on a free-threaded build). Run for a
    time rather than a count: a snapshot written back (the old code) lost about 2% of the settings on 2 cores."""
    before = options()
    deadline = time.monotonic() + 1.0
    lost = []

    def work(i):
        turn = 0
        while time.monotonic() < deadline:
            turn += 1
            if i == 0:
                options(export_stream=bool(turn % 2))
            else:
                wanted = bool(turn % 2)
                options(trust_streams=wanted)
                if options()["trust_streams"] is not wanted:
                    lost.append(turn)

    try:
        assert run_threads(work, count=2) == []
    finally:
        options(**before)
    assert lost == []


def test_a_descr_list_changed_by_another_thread_is_read_whole():
    """A producer's descr list, replaced item by item by one thread while others convert: each conversion reads the
    list as it is at one moment, so it names bfloat16 (its item) or nothing (refused), never a torn read."""
    raw = np.zeros(8, dtype=np.uint16)
    descr = [("bfloat16", "<V2")]

    class Named:
        __array_interface__ = {"shape": (8,), "typestr": "<V2", "descr": descr,
                               "data": (raw.__array_interface__["data"][0], False), "version": 3}

    stop = threading.Event()
    outcomes = {"named": 0, "refused": 0}

    def work(i):
        if i == 0:
            # At least 3000 rounds, and on until the readers have seen both states (the changer can otherwise finish
            # before a reader has started: CI's 3.13t stage once saw no named read at all).
            round_, deadline = 0, time.monotonic() + 30
            while round_ < 3000 or (min(outcomes.values()) < 10 and time.monotonic() < deadline):
                descr[0] = ("", "<V2") if round_ % 2 else ("bfloat16", "<V2")
                descr.append(("extra", "|u1")) if round_ % 3 == 0 else None
                del descr[1:]
                round_ += 1
            stop.set()
            return
        while not stop.is_set():
            try:
                capsule = cai2dlpack(Named(), max_version=(1, 0))
            except ValueError as error:
                assert "has no DLPack equivalent" in str(error)
                outcomes["refused"] += 1
            else:
                view = dlpack2cai(capsule)
                assert view.__array_interface__["descr"] == [("bfloat16", "<V2")] and np.asarray(view).itemsize == 2
                outcomes["named"] += 1

    assert run_threads(work, 4) == []
    assert outcomes["named"] > 0 and outcomes["refused"] > 0


def test_a_held_dict_switched_whole_by_another_thread_is_read_as_one_state():
    """One dict held by its object, switched between two whole states by one thread (dict.update: one step, under
    the dict's lock on free-threaded builds) while others convert it. The fused reader reads it inside its
    critical section there; with the GIL, a record kept of it must never outlive a change. Each tensor is one
    state's, never one state's shape or type with the other's strides or pointer."""
    raw = np.zeros(64, dtype=np.float32)
    base = raw.__array_interface__["data"][0]
    one = {"shape": (3, 4), "typestr": "<f4", "data": (base, False), "strides": (16, 4), "version": 3}
    other = {"shape": (6, 2), "typestr": "<i2", "data": (base + 64, True), "strides": (4, 2), "version": 3}

    def tensor_of(iface):
        class Fresh:
            __array_interface__ = dict(iface)

        return read_capsule(cai2dlpack(Fresh(), max_version=(1, 0)))

    states = [tensor_of(one), tensor_of(other)]
    shared = dict(one)

    class Held:
        __array_interface__ = shared

    stop = threading.Event()
    torn, reads = [], [0]

    def work(i):
        if i == 0:
            # until the others have converted it often while it changed (threads started together may still run
            # one after another for a while), within a bound
            round_ = 0
            while (round_ < 20000 or reads[0] < 50000) and round_ < 2000000:
                # new tuples each time: a reading that outlived its lock would find them freed
                state = other if round_ % 2 else one
                shared.update({key: tuple(list(value)) if isinstance(value, tuple) else value
                               for key, value in state.items()})
                round_ += 1
            stop.set()
            return
        while not stop.is_set():
            tensor = read_capsule(cai2dlpack(Held(), max_version=(1, 0)))
            reads[0] += 1
            if tensor not in states:
                torn.append(tensor)

    assert run_threads(work, 3) == []
    assert torn == [] and reads[0] > 0
    if FREE_THREADED:
        assert not sys._is_gil_enabled()


@contextlib.contextmanager
def store_delay(microseconds):
    """The store-delay hook's wait for the block (it waits on free-threaded builds only), none again after it."""
    from cai_dlpack import _core

    _core._set_record_store_delay(microseconds)
    try:
        yield
    finally:
        _core._set_record_store_delay(0)


def held_numpy_dict():
    """A class whose __array_interface__ is one ready dict (NumPy's, of six float64s), held by the class."""
    return type("Held", (), {"__array_interface__": dict(np.arange(6.0).__array_interface__)})


store_delay_only = pytest.mark.skipif(
    not FREE_THREADED or not __import__("cai_dlpack")._core._interface_cache_info()["enabled"],
    reason="the store-delay hook waits on free-threaded builds that keep records only (3.13t); with the GIL a read "
           "and its store run with nothing between them")


@store_delay_only
def test_a_store_under_way_when_keeping_is_turned_off_is_never_kept():
    """One thread's store waits (the hook) while keeping is turned off and on again: the store, begun before off,
    is refused under its slot's lock, so the next conversion reads afresh and keeps its own record."""
    from cai_dlpack import _core

    Held = held_numpy_dict()
    try:
        with store_delay(300000):
            thread = threading.Thread(target=lambda: read_capsule(cai2dlpack(Held(), max_version=(1, 0))))
            thread.start()
            time.sleep(0.1)
            _core._set_interface_cache(False)
            thread.join()
    finally:
        _core._set_interface_cache(True)
    before = _core._interface_cache_info()
    read_capsule(cai2dlpack(Held(), max_version=(1, 0)))
    after = _core._interface_cache_info()
    assert (after["hits"] - before["hits"], after["stores"] - before["stores"]) == (0, 1)


@store_delay_only
def test_a_collection_never_waits_for_a_store_delayed_between_read_and_store():
    """The hook's wait between a held dict's read and its store is detached: another thread's gc.collect() (which
    stops the world) returns without waiting for it."""
    import gc

    Held = held_numpy_dict()
    with store_delay(1000000):
        thread = threading.Thread(target=lambda: read_capsule(cai2dlpack(Held(), max_version=(1, 0))))
        thread.start()
        time.sleep(0.2)
        began = time.monotonic()
        gc.collect()
        took = time.monotonic() - began
        thread.join()
    assert took < 0.5


STOP_THE_WORLD_WHILE_A_SLOT_IS_HELD = textwrap.dedent("""
    import gc, threading, time
    import numpy as np
    from cai_dlpack import _core, cai2dlpack

    iface = dict(np.arange(6.0).__array_interface__)

    class Held:
        __array_interface__ = iface

    _core._set_record_store_delay(300000)
    storer = threading.Thread(target=lambda: cai2dlpack(Held()))
    storer.start()
    time.sleep(0.45)  # past the detached wait (0.3 s): the storer now sleeps holding the slot's lock
    _core._set_record_store_delay(0)
    finder = threading.Thread(target=lambda: cai2dlpack(Held()))  # spins on that lock
    finder.start()
    time.sleep(0.05)
    gc.collect()  # stops the world: it waits for the sleeper, which must still be attached
    storer.join()
    finder.join()
    print("done")
""")


@store_delay_only
def test_a_collection_while_a_store_holds_its_slot_finishes():
    """A store holding its slot's spin lock stays attached (the hook's wait there too): another thread spins on that
    lock, attached, and a stop-the-world waits for both. A holder that detached would wait for the stop to end to
    attach again, while the stop waited for the spinner: a deadlock (run in a child, with a time limit)."""
    result = subprocess.run([sys.executable, "-c", STOP_THE_WORLD_WHILE_A_SLOT_IS_HELD], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr


@store_delay_only
def test_a_dict_subclass_changed_between_its_read_and_its_store_is_read_afresh_after():
    """A dict subclass is read by the general reader, which takes the dict's tag before the read: a change that
    lands while the store waits (the hook) leaves a record under the old tag, never found again (one taken at the
    store would keep the old content under the new tag: the review's mutant, 5 of 5 stale)."""
    raw = np.zeros(64, dtype=np.float32)

    class Interface(dict):
        pass

    class Holder:
        pass

    holder = Holder()
    holder.__array_interface__ = Interface(version=3, typestr="<f4", data=(raw.ctypes.data, False), shape=(2,))

    def shape_now():
        return read_capsule(cai2dlpack(holder, max_version=(1, 0)))["shape"]

    seen = []
    for _ in range(3):
        holder.__array_interface__["shape"] = (2,)
        with store_delay(200000):
            thread = threading.Thread(target=shape_now)
            thread.start()
            time.sleep(0.05)
            holder.__array_interface__["shape"] = (9,)
            thread.join()
        seen += [shape_now() for _ in range(3)]
    assert seen == [(9,)] * 9


def test_a_record_kept_while_its_dict_changes_never_serves_the_change():
    """One thread changes a held dict and then, once the stores under way have had time to land, converts it
    itself; others convert it all along, each keeping its record. A reader that read the dict before a change and
    kept what it read after the change's event would leave a record of the old state: the changer's own
    conversion would be served it. On
    free-threaded builds records are kept of what the fused reader reads, and a store is refused once an event
    came after the read (there, each store waits 200 microseconds before its slot's lock and again holding it,
    for the changes to land between a read and its store); with the GIL the read and the store run with nothing between them."""
    from cai_dlpack import _core

    raw = np.zeros(64, dtype=np.float32)
    base = raw.__array_interface__["data"][0]
    states = [{"shape": (3, 4), "typestr": "<f4", "data": (base, False), "strides": (16, 4), "version": 3},
              {"shape": (6, 2), "typestr": "<i2", "data": (base + 64, True), "strides": (4, 2), "version": 3},
              {"shape": (5,), "typestr": "<u1", "data": (base + 8, False), "strides": None, "version": 3}]

    def tensor_of(iface):
        class Fresh:
            __array_interface__ = dict(iface)

        return read_capsule(cai2dlpack(Fresh(), max_version=(1, 0)))

    expected = [tensor_of(state) for state in states]
    shared = dict(states[0])

    class Held:
        __array_interface__ = shared

    stop = threading.Event()
    stale, reads, stores_before = [], [0], _core._interface_cache_info()["stores"]

    def work(i):
        if i == 0:
            round_ = 0
            while (round_ < 3000 or reads[0] < 5000) and round_ < 100000:
                state = round_ % len(states)
                shared.update(states[state])
                if FREE_THREADED:
                    time.sleep(0.0005)  # past the stores that read the dict before the change (two waits of 200 us)
                seen = read_capsule(cai2dlpack(Held(), max_version=(1, 0)))
                if seen != expected[state]:
                    stale.append((round_, seen))
                round_ += 1
            stop.set()
            return
        while not stop.is_set():
            read_capsule(cai2dlpack(Held(), max_version=(1, 0)))
            reads[0] += 1

    with store_delay(200):
        assert run_threads(work, 3) == []
    assert stale == []
    if _core._interface_cache_info()["enabled"]:
        assert _core._interface_cache_info()["stores"] > stores_before  # records were kept all along
    if FREE_THREADED:
        assert not sys._is_gil_enabled()


# ---- real threads against each shared structure, results checked (on 3.13t the GIL stays off throughout) ----

class PerThreadInterface:
    """A CUDA array interface that answers each thread with that thread's own array (shape and memory): a reading
    taken by one thread and used by another would describe the wrong memory."""

    def __init__(self):
        self.local = threading.local()

    @property
    def __cuda_array_interface__(self):
        return self.local.array.__cuda_array_interface__


@pytest.mark.parametrize("unwatches", [False, True], ids=["watching", "unwatching itself first"])
def test_a_change_another_watcher_holds_up_is_never_served_from_a_record(unwatches):
    """Another dict watcher whose callback lets the changing thread wait (it fails, and the unraisable hook sleeps,
    after it unwatches the dict, in the second case) between the events and the change: a reader may read the dict
    then, and must not keep the state from before for later conversions. Records kept by watcher events failed
    this (3.12 with the GIL: the changer got the old shape in 299 of 299 rounds; 3.13t about 2,000 of 2,000), and
    so did a rule that kept no dict another watcher watched, in the second case (review: 282-299 of 299 on 3.12,
    3.14, 3.15). Records are now found only under the version tag the change itself writes."""
    _testcapi = pytest.importorskip("_testcapi", reason="CPython's _testcapi adds the second dict watcher")
    if not hasattr(_testcapi, "add_dict_watcher"):
        pytest.skip("this CPython's _testcapi has no dict watchers (before 3.12)")
    raw = np.zeros(400, dtype=np.float32)
    base = raw.__array_interface__["data"][0]
    shared = {"shape": (1,), "typestr": "<f4", "data": (base, False), "strides": None, "version": 3}

    class Held:
        __array_interface__ = shared

    watcher = _testcapi.add_dict_watcher(1)  # its callback raises
    _testcapi.watch_dict(watcher, shared)
    def waits(unraisable):
        if unwatches:
            _testcapi.unwatch_dict(watcher, shared)
        time.sleep(0.001)

    hook, sys.unraisablehook = sys.unraisablehook, waits
    stop, stale = threading.Event(), []

    def reader():
        while not stop.is_set():
            read_capsule(cai2dlpack(Held(), max_version=(1, 0)))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for round_ in range(1, 300):
            shared["shape"] = (round_ + 1,)
            seen = read_capsule(cai2dlpack(Held(), max_version=(1, 0)))["shape"]
            if seen != (round_ + 1,):
                stale.append((round_, seen))
    finally:
        stop.set()
        thread.join()
        sys.unraisablehook = hook
        if not unwatches:
            _testcapi.unwatch_dict(watcher, shared)
        _testcapi.clear_dict_watcher(watcher)
    assert stale == []


def test_two_dicts_taking_one_slot_in_turn_are_each_read_whole():
    """Two held dicts whose records take the same slot (picked by address), converted in turn by many threads: each
    conversion of one evicts the other's record and keeps its own, while other threads copy the record out. The
    slot's lock keeps a copy from meeting a store halfway (on free-threaded builds the store-delay hook holds each
    store there): every tensor is one dict's, never one's shape with the other's strides or pointer."""
    raw = np.zeros(256, dtype=np.float32)
    base = raw.__array_interface__["data"][0]
    states = [{"shape": (3, 4), "typestr": "<f4", "data": (base, False), "strides": (16, 4), "version": 3},
              {"shape": (2, 2, 8), "typestr": "<i2", "data": (base + 128, True), "strides": (32, 16, 2),
               "version": 3}]

    def tensor_of(iface):
        class Fresh:
            __array_interface__ = dict(iface)

        return read_capsule(cai2dlpack(Fresh(), max_version=(1, 0)))

    expected = [tensor_of(state) for state in states]
    made, holders = [], {}
    while len(holders) < 2:  # two dicts of one slot, one of each state
        iface = dict(states[len(holders)])
        made.append(iface)
        slot = id(iface) >> 6 & 3
        if not holders or slot == next(iter(holders.values()))[1]:
            holders[len(holders)] = (type("Held", (), {"__array_interface__": iface}), slot)
    torn = []

    def work(i):
        for round_ in range(1000 if FREE_THREADED else 2000):
            which = (i + round_) % 2
            seen = read_capsule(cai2dlpack(holders[which][0](), max_version=(1, 0)))
            if seen != expected[which]:
                torn.append((which, seen))

    with store_delay(20):  # on free-threaded builds each store waits with its record half written
        assert run_threads(work, 4) == []
    assert torn == []
    if FREE_THREADED:
        assert not sys._is_gil_enabled()


def test_kept_blocks_taken_and_given_back_by_many_threads_are_each_one_exports():
    """Exports take freed blocks from the kept list and give them back when dropped, from every thread at once (a lock
    on free-threaded builds, the GIL elsewhere): no block is ever two held exports' at once, and each export's shape,
    strides and pointer are its own array's."""
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    arrays = [np.zeros((i % 4 + 1,) * (i % 4 + 1), dtype=np.float32) for i in range(THREADS)]
    shared, problems, lock = set(), [], threading.Lock()

    def work(i):
        array = arrays[i]
        want = (array.shape, array.__array_interface__["data"][0])
        for _ in range(3000):
            held = [cai2dlpack(array) for _ in range(3)]
            tensors = [get_pointer(capsule, b"dltensor") for capsule in held]
            with lock:
                if shared & set(tensors) or len(set(tensors)) != 3:
                    problems.append(("shared", i))
                shared.update(tensors)
            for capsule in held:
                got = read_capsule(capsule)
                if (got["shape"], got["data"]) != want:
                    problems.append((i, got))
            with lock:
                shared.difference_update(tensors)
            del held

    assert run_threads(work) == []
    assert problems == []
    if FREE_THREADED:
        assert not sys._is_gil_enabled()


def test_the_shims_pending_reading_is_used_only_by_the_thread_that_read_it(cudart):
    """One shim, many threads, each asking __dlpack_device__ (which reads the interface and keeps the reading for
    the next call) then __dlpack__ (which takes it), as consumers do. Each thread must get its own array, never
    another thread's reading."""
    hosts = [np.full(16 + i, i, dtype=np.float32) for i in range(THREADS)]
    for host in hosts:
        register(cudart, host, DEVICE)
    wrapped = PerThreadInterface()
    shim = DLPackShim(wrapped)
    seen = [[] for _ in range(THREADS)]

    def work(i):
        wrapped.local.array = CaiArray(hosts[i])
        for _ in range(400):
            shim.__dlpack_device__()
            time.sleep(0)  # a chance for another thread's __dlpack_device__ to come in between
            got = dlpack2cai(shim.__dlpack__(stream=-1)).__cuda_array_interface__
            seen[i].append((got["data"][0], got["shape"]) == (hosts[i].__array_interface__["data"][0], (16 + i,)))

    assert run_threads(work) == []
    assert [len(s) for s in seen] == [400] * THREADS
    assert [s.count(False) for s in seen] == [0] * THREADS


def test_a_capsule_taken_by_two_threads_at_once_is_consumed_once():
    """Two threads race to consume each capsule: one gets the view, the other a BufferError for a used capsule;
    the owner's reference is released exactly once."""
    owner = np.arange(16.0)
    base = sys.getrefcount(owner)
    rounds = 300
    capsules = [cai2dlpack(owner, max_version=(1, 0)) for _ in range(rounds)]
    barrier = threading.Barrier(2)
    won = [[0] * rounds, [0] * rounds]
    refused = [0, 0]

    def work(i):
        for k, capsule in enumerate(capsules):
            barrier.wait()
            try:
                view = dlpack2cai(capsule)
            except BufferError as error:
                assert "used" in str(error) or "consumed" in str(error), error
                refused[i] += 1
            else:
                assert np.asarray(view)[5] == 5.0
                won[i][k] = 1
                del view

    assert run_threads(work, count=2) == []
    assert [a + b for a, b in zip(*won)] == [1] * rounds and sum(refused) == rounds
    del capsules
    assert sys.getrefcount(owner) == base


def test_the_exchange_api_called_from_many_threads():
    """Every call of our DLPack C exchange table, from many threads at once through a consumer extension: each
    thread's DLTensor, owning tensor and allocation describe its own data."""
    from support import c_example
    example = c_example.build()
    arrays = [np.arange(8 * i, 8 * i + 24, dtype=np.float64).reshape(3, 8) for i in range(THREADS)]

    def work(i):
        x = arrays[i]
        for round in range(200):
            fields = example.exchange_dltensor(DLPackShim(x))
            assert fields["data"] == x.__array_interface__["data"][0] and fields["shape"] == (3, 8)
            assert example.managed(x, -1)["data"] == x.__array_interface__["data"][0]
            made = example.exchange_allocate(DLPackShim, (2, 32), (i + 1, 2), (1, 0))
            assert np.asarray(made).shape == (i + 1, 2)
            assert example.sum_float64(x) == x.sum()

    assert run_threads(work) == []


def test_deleters_of_one_export_run_on_foreign_threads_while_others_convert(cudart):
    """Owning tensors made on one thread are freed on others (a framework's own threads), with the GIL released,
    while more are made: each owner is released exactly when its last tensor goes."""
    owners = [np.arange(32.0) + i for i in range(THREADS)]
    bases = [sys.getrefcount(o) for o in owners]
    _api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
    made = [[] for _ in range(THREADS)]

    def work(i):
        for round in range(100):
            capsule = cai2dlpack(owners[i], max_version=(1, 0))
            address = _api.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
            _api.PyCapsule_SetName(capsule, b"used_dltensor_versioned")
            made[(i + 1) % THREADS].append(address)  # freed by the next thread
            del capsule
            while made[i]:
                managed = DLManagedTensorVersioned.from_address(made[i].pop())
                assert managed.dl_tensor.shape[0] == 32
                managed.deleter(ctypes.pointer(managed))

    assert run_threads(work) == []
    for i in range(THREADS):  # what the last rounds handed on
        while made[i]:
            managed = DLManagedTensorVersioned.from_address(made[i].pop())
            managed.deleter(ctypes.pointer(managed))
    assert [sys.getrefcount(o) for o in owners] == bases
