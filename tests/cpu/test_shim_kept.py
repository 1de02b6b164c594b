"""Kept shims: a few dropped DLPackShim objects (of the class itself, on builds with a GIL) are handed out again
by the next DLPackShim(obj), which every shim conversion makes and drops. A shim handed out again must be a new
object in every way a program can tell: nothing of the dead one's reading, weak references, wrapped object or
dtype, tracked by the garbage collector, and collected in a cycle. Subclasses are never kept."""
import gc
import itertools
import sys
import sysconfig
import tracemalloc
import weakref

import numpy as np
import pytest

from cai_dlpack import DLPackShim, dlpack2cai
from support import c_example
from support.cai_objects import register
from support.cuda_double import DEVICE

FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


class DeviceCai:
    """A CAI producer over memory the double reports as device memory."""

    def __init__(self, array):
        self.array = array

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.array.shape, "typestr": self.array.dtype.str, "strides": None,
                "data": (self.array.ctypes.data, False), "version": 3, "stream": None}


def test_a_shim_made_after_one_died_with_a_reading_exports_its_own_object(cudart):
    """The dead shim's __dlpack_device__ reading (same thread) goes with it: the next shim, likely in its memory,
    exports what it wraps."""
    first, second = np.arange(6, dtype=np.float32), np.arange(8, dtype=np.float32)
    register(cudart, first, DEVICE)
    register(cudart, second, DEVICE)
    for _ in range(8):  # past the kept list's size: some shims are new memory, some kept
        dead = DLPackShim(DeviceCai(first))
        assert dead.__dlpack_device__() == (2, 0)
        del dead
        shim = DLPackShim(DeviceCai(second))
        view = dlpack2cai(shim.__dlpack__(max_version=(1, 0)))
        assert view.__cuda_array_interface__["data"][0] == second.ctypes.data and view.shape == (8,)
        del shim, view


def test_a_shim_handed_out_again_is_a_new_object():
    x, y = np.arange(3.0), np.arange(5.0)
    called = []
    dead = DLPackShim(x, dtype="float64")
    ref = weakref.ref(dead, called.append)
    del dead
    assert ref() is None and len(called) == 1
    shims = [DLPackShim(y) for _ in range(8)]
    for shim in shims:
        assert ref() is None  # a weak reference to the dead shim stays dead
        assert shim.obj is y and gc.is_tracked(shim)
        assert weakref.ref(shim)() is shim
        assert repr(shim) == f"cai_dlpack.DLPackShim({y!r})"
        assert sys.getrefcount(shim) == 3  # the list's, the loop's and the call's: one made afresh, no more
        np.testing.assert_array_equal(np.from_dlpack(shim), y)
    assert len({id(shim) for shim in shims}) == 8


def test_a_kept_shim_in_a_cycle_is_collected():
    class Holder:
        pass

    for _ in range(8):
        DLPackShim(np.arange(2.0))  # fills the kept list
    gc.collect()
    holder = Holder()
    holder.array = np.arange(4.0)
    holder.__array_interface__ = holder.array.__array_interface__
    holder.shim = DLPackShim(holder)
    gone = weakref.ref(holder)
    del holder
    gc.collect()
    assert gone() is None


def test_a_subclass_shim_is_not_kept():
    """A subclass's instances hold a reference to their class each; none is left behind by one kept."""

    class Sub(DLPackShim):
        pass

    x = np.arange(3.0)
    for _ in range(4):
        Sub(x)
    before = sys.getrefcount(Sub)
    for _ in range(100):
        shim = Sub(x)
        np.testing.assert_array_equal(np.from_dlpack(shim), x)
        assert type(shim) is Sub
        del shim
    assert sys.getrefcount(Sub) == before
    kept = DLPackShim(x)  # the class's own shims are kept as before
    assert type(kept) is DLPackShim


def traced_growth(make, times):
    """(what Python's allocator holds after `times` calls of make, its peak meanwhile), less before, traced."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        for _ in itertools.repeat(None, times):  # no int made per iteration
            make()
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return after - before, peak - before


@pytest.mark.skipif(FREE_THREADED, reason="a free-threaded build keeps no shims: each is allocated and freed")
def test_shims_made_and_dropped_reuse_the_kept_memory():
    """Past the first, a shim made and dropped allocates nothing: over 10^4 of them Python's allocator never
    holds more than over a loop that makes nothing (tracemalloc's own peak); an object allocated each time
    would raise the peak by its size, as object() does."""
    x = np.arange(3.0)
    for _ in range(16):
        np.from_dlpack(DLPackShim(x))
    nothing = traced_growth(lambda: None, 10_000)
    assert traced_growth(object, 10_000)[1] > nothing[1]  # the measure sees one object's allocation
    assert traced_growth(lambda: DLPackShim(x), 10_000) == nothing


def test_a_shim_handed_out_again_lends_shape_and_strides_of_its_own():
    """The exchange API's DLTensor call lends shape and strides from memory the shim makes once and frees when it
    dies; a shim handed out again makes its own (the dead one's is freed, not lent twice nor freed twice)."""
    example = c_example.build()
    x = np.zeros((2, 3))

    def lend_twice_and_drop():
        shim = DLPackShim(x)
        for _ in range(2):
            assert example.status_of("dltensor_from_py_object_no_sync", shim, 0)[:2] == (0, None)

    for _ in range(1000):  # past the first thousand calls, CPython's caches of freed objects (3.13t's) are full
        lend_twice_and_drop()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(100):
            lend_twice_and_drop()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Each shim's 1 KiB of shape and strides goes with it: 100 KiB would stay otherwise. What does stay is a few KiB
    # of CPython's own (free lists of result tuples; on a free-threaded build, frees it delays), traced as held.
    assert after - before < 50 * 1024


@pytest.mark.skipif(FREE_THREADED, reason="a free-threaded build keeps no shims: each is allocated and freed")
def test_every_kept_shim_is_handed_out():
    """Four shims dropped are four kept: the next four DLPackShim(obj), held, allocate nothing (the last kept one
    included)."""
    x = np.arange(3.0)
    held = [DLPackShim(x) for _ in range(4)]
    del held  # four kept
    slots = [None] * 5

    def fill(count):
        for i in range(count):
            slots[i] = DLPackShim(x)

    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        fill(4)
        four, _ = tracemalloc.get_traced_memory()
        fill(5)  # none kept while four are held: the first of these is allocated (the measure sees it)
        five, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert four == before and five > four
