"""Every allocation the converters make, failed in turn (CPython's _testcapi.set_nomemory): each call either
succeeds or raises MemoryError, never crashes, and leaves nothing behind."""
import gc
import sys

import numpy as np
import pytest

from cai_dlpack import DLPackShim, cai2dlpack, dlpack2cai
from support import c_example
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE

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
