"""Every allocation the converters make, failed in turn (CPython's _testcapi.set_nomemory): each call either
succeeds or raises MemoryError, never crashes, and leaves nothing behind."""
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cai_dlpack import DLPackShim, cai2dlpack, dlpack2cai
from support import c_example
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE
from support.dlpack_ctypes import read_capsule

_testcapi = pytest.importorskip("_testcapi", reason="this CPython build has no _testcapi")
if not hasattr(_testcapi, "set_nomemory"):
    pytest.skip("this CPython's _testcapi cannot fail allocations", allow_module_level=True)


def fail_each_allocation(call, limit=60):
    """Runs call with the n-th allocation failing, for n = 0, 1, ...; returns how many runs raised."""
    failures = 0
    for n in range(limit):
        _testcapi.set_nomemory(n, n + 1)
        try:
            call()
        except MemoryError:
            failures += 1
        finally:
            _testcapi.remove_mem_hooks()
    return failures


class Holder:
    def __init__(self, iface):
        self.__array_interface__ = iface


def test_paths_under_allocation_failure(cudart):
    host = np.arange(24, dtype=np.float32).reshape(4, 6)
    register(cudart, host, DEVICE, device=1)
    device = CaiArray(host[:, ::2], stream=0x5000)
    holder = Holder(dict(host.__array_interface__))
    buffer_holder = Holder({"shape": (4,), "typestr": "|u1", "data": bytearray(4), "version": 3})
    view = dlpack2cai(cai2dlpack(holder))
    # 24 dimensions: a view's shape and strides tuples are past CPython's tuple free lists, so allocated.
    deep = np.zeros((1,) * 24, dtype=np.float32)
    many = Holder(dict(deep.__array_interface__))
    before = sys.getrefcount(host), sys.getrefcount(holder), sys.getrefcount(view)
    paths = [
        lambda: cai2dlpack(holder, max_version=(1, 0)),
        lambda: cai2dlpack(host, max_version=(1, 0)),  # NumPy's buffer
        lambda: cai2dlpack(buffer_holder),
        lambda: cai2dlpack(device, stream=0x6000),
        lambda: dlpack2cai(cai2dlpack(holder)).__array_interface__,
        lambda: dlpack2cai(cai2dlpack(many)).__array_interface__,
        lambda: memoryview(dlpack2cai(cai2dlpack(holder))),
        lambda: dlpack2cai(cai2dlpack(device), stream=2).__cuda_array_interface__,
        lambda: view.__dlpack__(max_version=(1, 0)),
        lambda: np.from_dlpack(DLPackShim(holder)),
        lambda: DLPackShim(device).__dlpack_device__(),
    ]
    raised = [fail_each_allocation(path, limit=80) for path in paths]
    gc.collect()
    assert all(count > 0 for count in raised), raised  # each path met at least one failed allocation
    assert (sys.getrefcount(host), sys.getrefcount(holder), sys.getrefcount(view)) == before
    assert cudart.current_device == 0
    assert np.asarray(dlpack2cai(cai2dlpack(holder))).tolist() == host.tolist()  # and all still works


def test_exchange_dltensor_under_allocation_failure_fails_with_memory_error():
    """dltensor_from_py_object_no_sync of a shim lends shape and strides from storage the shim makes at its first
    such call: when that or any allocation of the call fails, the call fails with MemoryError, so a C consumer,
    which trusts the status, lends nothing; it never says success with an error set (SystemError) or crashes."""
    example = c_example.build()
    x = np.arange(20.0).reshape(4, 5)
    failures = 0
    for n in range(60):
        shim = DLPackShim(x)  # made before any allocation fails: the call below makes its storage
        _testcapi.set_nomemory(n, n + 1)
        try:
            fields = example.exchange_dltensor(shim)
        except MemoryError:
            failures += 1
            continue
        finally:
            _testcapi.remove_mem_hooks()
        assert fields["shape"] == (4, 5)
    assert failures > 0


@pytest.mark.skipif(sys.version_info[:2] == (3, 13),
                    reason="CPython 3.13's PyDict_SetDefaultRef returns 0 with a MemoryError set when its dict resize "
                           "fails, and PyType_Ready (which our init calls) goes on to crash on the half-resized "
                           "type dict: a CPython defect, with or without the GIL; 3.11, 3.12, 3.14 and 3.15 pass")
@pytest.mark.skipif(not hasattr(os, "fork"), reason="each load is made in a fork")
def test_module_init_under_allocation_failure():
    """Loading the extension with its n-th allocation failing, for n = 0, 1, ... until a load succeeds: each
    failed load raises MemoryError (nothing else, no crash) and leaves no module object alive, and the module that finally loads works in every
    function. Each load is made in a fork of a process that never loaded the module, so no load sees what an
    earlier one left in the module's static state (nor does this session's module see any of them)."""
    script = textwrap.dedent("""
        import gc, glob, importlib.machinery, importlib.util, os, sys, traceback, types, warnings
        import numpy as np
        import _testcapi
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a process that may have threads: the child
                                                            # runs this thread alone and exits
        package = os.path.dirname(importlib.util.find_spec("cai_dlpack").origin)  # found, not run
        path = glob.glob(os.path.join(package, "_core*" + importlib.machinery.EXTENSION_SUFFIXES[0]))[0]
        LOADED, MEMORY_ERROR, OTHER_ERROR, BROKEN = 0, 1, 2, 3

        class Host:
            def __init__(self, iface):
                self.__array_interface__ = iface

        def use(core):
            x = np.arange(12, dtype=np.float32).reshape(3, 4)
            view = core.dlpack2cai(core.cai2dlpack(x))
            assert np.asarray(view).tolist() == x.tolist() and view.__array_interface__["shape"] == (3, 4)
            assert np.asarray(core.dlpack2cai(core.cai2dlpack(Host(dict(x.__array_interface__))))).tolist() == x.tolist()
            core.cai2dlpack(x, stream=None, max_version=(1, 0), dtype=None, dl_device=(1, 0), copy=False)
            shim = core.DLPackShim(x)
            assert shim.__dlpack_device__() == (1, 0) and np.from_dlpack(shim).tolist() == x.tolist()
            view.__dlpack__(max_version=(1, 0), stream=None, dl_device=None, copy=None)
            core.options(sync=True, export_stream=True)
            try:
                core.cai2dlpack(np.zeros(2, ">f4"))
                raise AssertionError("a big-endian array was converted")
            except core.UnsupportedArrayError as error:
                assert "byte order" in str(error)

        def load(n):
            loader = importlib.machinery.ExtensionFileLoader("cai_dlpack._core", path)
            spec = importlib.util.spec_from_file_location("cai_dlpack._core", path, loader=loader)
            _testcapi.set_nomemory(n, n + 1)
            try:
                core = importlib.util.module_from_spec(spec)
                loader.exec_module(core)
            except MemoryError:
                # nothing of the failed load is kept: no module object is left alive
                gc.collect()
                if any(isinstance(o, types.ModuleType) and o.__name__ == "cai_dlpack._core" for o in gc.get_objects()):
                    print("a module object outlived its failed load", file=sys.stderr)
                    return OTHER_ERROR
                return MEMORY_ERROR
            except BaseException:
                traceback.print_exc()
                return OTHER_ERROR
            finally:
                _testcapi.remove_mem_hooks()
            try:
                use(core)
            except BaseException:
                traceback.print_exc()
                return BROKEN
            return LOADED

        outcomes = []
        for n in range(2000):
            child = os.fork()
            if child == 0:
                os._exit(load(n))
            outcomes.append(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
            if outcomes[-1] != MEMORY_ERROR:
                break
        print(" ".join(map(str, outcomes)))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OPENBLAS_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    outcomes = [int(word) for word in result.stdout.split()]
    # init allocates: each of its allocations failed in turn raised MemoryError, then a load worked
    assert len(outcomes) > 20 and set(outcomes[:-1]) == {1} and outcomes[-1] == 0, (outcomes[-5:], result.stderr)


class Subclass(np.ndarray):
    """An ndarray subclass: read through its buffer export (an exact ndarray is read from its fields)."""


def test_the_buffer_reader_under_allocation_failure_keeps_nothing():
    """An ndarray subclass, read through its buffer, with each allocation failing in turn (the reader's own, the
    export's, the capsule's that holds it): each call succeeds or raises MemoryError, and every failure gives the
    export back (the array's count is as before) and frees the memory that held it (no block is left allocated
    by a second pass over the same failures)."""
    array = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2].view(Subclass)  # strided
    before = sys.getrefcount(array)
    convert = lambda: cai2dlpack(array, max_version=(1, 0))  # noqa: E731
    assert fail_each_allocation(convert) > 0
    gc.collect()
    blocks = sys.getallocatedblocks()
    assert fail_each_allocation(convert) > 0
    gc.collect()
    # (the int `blocks`, made once it was counted, may be the one more; the free-threaded build's count can drop)
    assert sys.getallocatedblocks() - blocks <= 1
    assert sys.getrefcount(array) == before
    assert read_capsule(cai2dlpack(array))["shape"] == (3, 2)


def test_a_listed_strides_under_allocation_failure_raises_memory_error():
    """'strides' given as a list is taken as a tuple before the type is read: when that allocation fails, the call
    raises MemoryError and keeps nothing. 24 dimensions: the tuple is past CPython's tuple free lists, so allocated."""
    host = np.arange(12, dtype=np.float32).reshape((3, 4) + (1,) * 22)
    iface = dict(host.__array_interface__, strides=list(host.strides))
    holder = Holder(iface)
    before = sys.getrefcount(holder), sys.getrefcount(iface["strides"])
    assert fail_each_allocation(lambda: cai2dlpack(holder)) > 0
    gc.collect()
    assert (sys.getrefcount(holder), sys.getrefcount(iface["strides"])) == before
    assert np.asarray(dlpack2cai(cai2dlpack(holder))).tolist() == host.tolist()


def test_a_view_of_extents_past_the_small_ints_under_allocation_failure_raises_memory_error():
    """A view's shape holds its extents as ints: past CPython's cached small ints (-5 to 256) each is allocated.
    When one of those fails, making the view raises MemoryError, never hands out a view with the error pending
    (SystemError) or a shape with a hole, and keeps nothing."""
    host = np.zeros((300, 500), dtype=np.uint8)
    holder = Holder(dict(host.__array_interface__))
    before = sys.getrefcount(host), sys.getrefcount(holder)
    shapes = []

    def convert():
        shapes.append(dlpack2cai(cai2dlpack(holder)).shape)

    assert fail_each_allocation(convert, limit=80) > 0
    gc.collect()
    assert shapes and set(shapes) == {(300, 500)}
    assert (sys.getrefcount(host), sys.getrefcount(holder)) == before


def test_a_device_copy_under_allocation_failure_frees_what_it_made(cudart):
    """A copy on the device (copy=True), with each allocation failing in turn, the tensor's and its capsule's after
    the copy was made included: each call succeeds or raises MemoryError, and every device allocation it made is
    freed, none left behind; a failed call's copy at once (cudaFree: no consumer's stream to wait for)."""
    host = np.arange(24, dtype=np.float32).reshape(4, 6)
    register(cudart, host, DEVICE, device=1)
    device = CaiArray(host[:, ::2])
    cudart.clear_log()
    assert fail_each_allocation(lambda: DLPackShim(device).__dlpack__(copy=True, max_version=(1, 0))) > 0
    gc.collect()
    log = cudart.log()
    made = [line for line in log if line.startswith("cudaMalloc")]
    freed = [line for line in log if line.startswith("cudaFree")]
    assert made and len(freed) == len(made), (made, freed)
    assert "cudaFree()" in freed  # the copy of a call that failed after making it: freed at once