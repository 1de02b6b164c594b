"""The C-speed doors, through real consumers: a small C extension built on cai_dlpack's C API, and
apache-tvm-ffi taking the DLPack C exchange API (__dlpack_c_exchange_api__) fast path."""
import array
import ctypes
import gc
import os
import re
import subprocess
import sys
import sysconfig
import threading
import weakref

import numpy as np
import pytest

import cai_dlpack
from cai_dlpack import DLPackShim, DLPackView, cai2dlpack, dlpack2cai
from support import c_example, doors
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE
from support.fresh_process import live_tracebacks

from support.optional import needs_torch, needs_tvm_ffi, torch, tvm_ffi

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

DTYPES = ["?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"]
CODES = {"b": 6, "i": 0, "u": 1, "f": 2, "c": 5}
S1, S2 = 0x5000, 0x6000


@pytest.fixture(scope="module")
def example():
    return c_example.build()


def expected_fields(x):
    return {"data": x.__array_interface__["data"][0] if x.size else x.__array_interface__["data"][0],
            "device": (1, 0), "ndim": x.ndim, "dtype": (CODES[x.dtype.kind], x.itemsize * 8, 1),
            "shape": x.shape, "strides": tuple(s // x.itemsize for s in x.strides), "byte_offset": 0}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "zero_size", "zero_d"])
def test_fill_and_managed_every_dtype(example, dtype, layout):
    base = np.zeros((6, 8), dtype=dtype)
    x = {"contiguous": base, "strided": base[1::2, ::-3], "zero_size": base[:0], "zero_d": np.array(base[1, 1])}[layout]
    fields = example.fill(x, -1)
    assert fields.pop("read_only") is False
    assert fields == expected_fields(x)
    managed = example.managed(x, 1)
    assert managed.pop("version") == cai_dlpack.DLPACK_VERSION and managed.pop("flags") == 0
    assert managed == expected_fields(x)
    for obj in (DLPackShim(x), dlpack2cai(x)):
        assert example.fill(obj, 1)["shape"] == x.shape


def test_the_kernel_reads_any_layout(example):
    x = np.arange(60.0).reshape(3, 4, 5)
    for view in (x, x[::2, 1:, ::-2], x.transpose(2, 0, 1), np.broadcast_to(x[:1], (4, 4, 5))):
        assert example.sum_float64(view) == view.sum()
    with pytest.raises(TypeError, match="host float64"):
        example.sum_float64(np.arange(3, dtype=np.float32))


def test_read_only_is_reported(example):
    x = np.arange(4.0)
    x.flags.writeable = False
    assert example.fill(x, -1)["read_only"] is True
    assert example.managed(x, -1)["flags"] & 1


@needs_torch
def test_dlpack_producers_and_views(example):
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    fields = example.managed(t, 1)
    assert fields["data"] == t.data_ptr() and fields["shape"] == (3, 4) and fields["strides"] == (4, 1)
    view = example.view(t, -1)
    assert isinstance(view, DLPackView) and np.asarray(view).tolist() == t.tolist()


def test_view_keeps_owner_alive(example):
    class Owner:
        def __init__(self):
            self.array = np.arange(5.0)
            self.__array_interface__ = self.array.__array_interface__

    owner = Owner()
    ref = weakref.ref(owner)
    view = example.view(owner, -1)
    del owner
    gc.collect()
    assert ref() is not None and np.asarray(view).tolist() == [0, 1, 2, 3, 4]
    del view
    gc.collect()
    assert ref() is None


def test_errors(example):
    with pytest.raises(TypeError, match="neither __cuda_array_interface__ nor __array_interface__"):
        example.fill(object(), 1)
    with pytest.raises(ValueError, match="3 dimensions but the caller's storage holds 2"):
        example.fill_small(np.zeros((1, 2, 3)))
    for bad in (0, -2):
        with pytest.raises(ValueError, match="not a valid stream"):
            example.fill(np.zeros(2), bad)
        with pytest.raises(ValueError, match="not a valid stream"):
            example.managed(np.zeros(2), bad)
    with pytest.raises(ValueError, match="'typestr'"):
        example.managed(CaiArray(np.zeros(2), typestr="<f16"), 1)


class NoInterface:
    pass


class RefusingProducer:
    """A DLPack producer that refuses its export (BufferError) and has no array interface to be read instead."""

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        raise BufferError("this producer cannot describe its data")


class DeviceZero(RefusingProducer):
    """A producer naming device type 0, which DLPack does not have (its types count from kDLCPU, 1)."""

    def __dlpack_device__(self):
        return (0, 0)


# (door, object, stream, the exception a failure raises or None for a success): each door's failures of each
# kind (a refused stream, a dict, an object with no interface, an interface that does not read) and a success.
DOOR_CALLS = [
    ("to_managed_tensor", np.zeros(2), -1, None),
    ("to_managed_tensor", np.zeros(2), 0, ValueError),
    ("to_managed_tensor", {"shape": (2,)}, -1, TypeError),
    ("to_managed_tensor", NoInterface(), -1, TypeError),
    ("to_managed_tensor", CaiArray(np.zeros(2), typestr="<f16"), 1, ValueError),
    ("to_managed_tensor", RefusingProducer(), -1, BufferError),
    ("to_managed_tensor", DeviceZero(), 1, ValueError),
    ("fill_tensor", np.zeros(2), -1, None),
    ("fill_tensor", np.zeros(2), -2, ValueError),
    ("fill_tensor", NoInterface(), -1, TypeError),
    ("fill_tensor", CaiArray(np.zeros(2), typestr="<f16"), 1, ValueError),
    ("managed_tensor_from_py_object_no_sync", DLPackShim(np.zeros(2)), 0, None),
    ("managed_tensor_from_py_object_no_sync", DLPackShim(NoInterface()), 0, TypeError),
    ("managed_tensor_from_py_object_no_sync", DLPackShim(CaiArray(np.zeros(2), typestr="<f16")), 0, ValueError),
    ("dltensor_from_py_object_no_sync", DLPackShim(np.zeros(2)), 0, None),
    ("dltensor_from_py_object_no_sync", DLPackShim(NoInterface()), 0, TypeError),
    ("dltensor_from_py_object_no_sync", DLPackShim(np.broadcast_to(np.zeros(1), (2,))), 0, BufferError),
]


@pytest.mark.parametrize("door,obj,stream,error", DOOR_CALLS,
                         ids=[f"{d}-{type(o).__name__}-{s}-{e.__name__ if e else 'ok'}" for d, o, s, e in DOOR_CALLS])
def test_every_door_returns_0_or_minus_1_with_an_exception(example, door, obj, stream, error):
    """The C API's convention, held to by value (a caller may test `== -1`, or `!= 0`): 0 with no exception set
    and, where the door hands out a tensor, a tensor; -1 with an exception set and no tensor."""
    status, raised, handed_out = example.status_of(door, obj, stream)
    if error is None:
        assert (status, raised) == (0, None)
        assert handed_out == door.startswith(("to_managed", "managed"))
    else:
        assert status == -1 and isinstance(raised, error) and not handed_out, (status, raised)


def test_to_managed_tensor_for_the_producers_own_stream_hands_out_the_tensor_and_orders_nothing(example, cudart):
    """Device memory asked for on the stream its producer named: the tensor with status 0 and no exception, and
    no wait made between the streams (they are one)."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE)
    cudart.add_stream(0x5000, 0)
    cudart.clear_log()
    status, raised, handed_out = example.status_of("to_managed_tensor", CaiArray(host, stream=0x5000), 0x5000)
    assert (status, raised, handed_out) == (0, None, True)
    assert not any(call.startswith("cudaStreamWaitEvent") for call in cudart.log())


@needs_torch
def test_reference_counts_are_stable(example):
    x = np.arange(10.0)
    t = torch.arange(4.0)
    before = sys.getrefcount(x), sys.getrefcount(t)
    for _ in range(2000):
        example.fill(x, -1)
        example.managed(x, 1)
        example.view(t, -1)
        try:
            example.fill_small(np.zeros((1, 2, 3)))
        except ValueError:
            pass
    gc.collect()
    assert (sys.getrefcount(x), sys.getrefcount(t)) == before


def test_cai_streams_are_ordered_through_the_c_api(cudart, example):
    host = np.zeros(8, dtype=np.float32)
    register(cudart, host, DEVICE, device=1)
    fields = example.fill(CaiArray(host, stream=S1), S2)
    assert fields["device"] == (2, 1)
    log = cudart.log()
    assert any(line.startswith(f"cudaEventRecord(ev") and line.endswith(f", {S1})") for line in log)
    assert any(line.startswith(f"cudaStreamWaitEvent({S2}, ev") for line in log)
    cudart.clear_log()
    example.managed(CaiArray(host, stream=S1), -1)
    assert not any(line.startswith(("cudaEventRecord", "cudaStreamWaitEvent")) for line in cudart.log())


# ---- the DLPack C exchange API ------------------------------------------------------------------------

def test_both_exchange_attributes_point_at_one_table():
    for cls in (DLPackShim, DLPackView):
        capsule = cls.__dlpack_c_exchange_api__
        ctypes.pythonapi.PyCapsule_GetPointer.restype = ctypes.c_void_p
        ctypes.pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
        assert ctypes.pythonapi.PyCapsule_GetPointer(capsule, b"dlpack_exchange_api") == cls.__c_dlpack_exchange_api__


class Spy(DLPackShim):
    """A shim whose slow path must never be taken."""

    calls = 0

    def __dlpack__(self, *args, **kwargs):
        Spy.calls += 1
        raise AssertionError("tvm_ffi fell back to __dlpack__")


@needs_tvm_ffi
@pytest.mark.parametrize("dtype", ["f4", "f8", "i8", "u1", "?"])
def test_tvm_ffi_takes_the_fast_path(dtype):
    Spy.calls = 0
    x = np.arange(24).astype(dtype).reshape(4, 6)[::2, 1:]
    tensor = tvm_ffi.from_dlpack(Spy(x))
    assert Spy.calls == 0
    y = np.from_dlpack(tensor)
    assert y.__array_interface__["data"][0] == x.__array_interface__["data"][0]
    np.testing.assert_array_equal(y, x)


@needs_torch
@needs_tvm_ffi
def test_tvm_ffi_function_arguments_and_results():
    echo = tvm_ffi.get_global_func("testing.echo")
    x = np.arange(6.0)
    Spy.calls = 0
    result = echo(Spy(x))
    assert Spy.calls == 0
    assert isinstance(result, DLPackView)  # the tensor came back through managed_tensor_to_py_object_no_sync
    assert np.asarray(result).__array_interface__["data"][0] == x.__array_interface__["data"][0]
    view = dlpack2cai(torch.arange(4.0))
    assert np.from_dlpack(tvm_ffi.from_dlpack(view)).tolist() == [0, 1, 2, 3]


@needs_tvm_ffi
def test_no_sync_fast_path_still_orders_a_cai_producer_stream(cudart):
    """The consumer is told to work on the default stream: the producer's stream is ordered before it."""
    host = np.zeros(8, dtype=np.float32)
    register(cudart, host, DEVICE, device=0)
    tensor = tvm_ffi.from_dlpack(DLPackShim(CaiArray(host, stream=S1)))
    assert tensor.shape == (8,)
    log = cudart.log()
    record = [line for line in log if line.startswith("cudaEventRecord")]
    wait = [line for line in log if line.startswith("cudaStreamWaitEvent")]
    assert record and record[-1].endswith(f", {S1})") and wait and wait[-1].startswith("cudaStreamWaitEvent(1, ")


def test_exchange_dltensor_without_allocation(example):
    x = np.arange(20.0).reshape(4, 5)[1:, ::2]
    shim = DLPackShim(x)
    assert example.exchange_dltensor(shim) == expected_fields(x)
    view = dlpack2cai(x)
    fields = example.exchange_dltensor(view)
    assert fields["shape"] == x.shape and fields["data"] == x.__array_interface__["data"][0]
    assert example.exchange_work_stream(DLPackShim, 2, 0) == 0  # the default stream


def test_exchange_dltensor_refuses_read_only_memory(example):
    """A DLTensor has no read-only flag: lending read-only memory through it would let the consumer write it.
    The managed tensor of the same object says read-only."""
    x = np.arange(6.0)
    x.flags.writeable = False
    for obj in (DLPackShim(x), dlpack2cai(x)):
        with pytest.raises(BufferError, match=rf"this cai_dlpack.{type(obj).__name__}'s memory is read-only, which a DLTensor "
                                              "cannot say .* managed_tensor_from_py_object_no_sync"):
            example.exchange_dltensor(obj)
        managed = doors.managed_from_object(obj)
        assert managed.pointer.contents.flags & 1  # DLPACK_FLAG_BITMASK_READ_ONLY
        managed.delete()
    writable = np.arange(6.0)
    assert example.exchange_dltensor(DLPackShim(writable))["data"] == writable.ctypes.data


def test_exchange_dltensor_refusal_of_read_only_memory_orders_no_streams(cudart):
    """dltensor_from_py_object_no_sync refuses read-only memory before ordering the producer's stream before the
    legacy default stream: a tensor it never lends needs no event recorded on S1 nor a wait queued."""
    host = np.arange(8, dtype=np.float32)
    register(cudart, host, DEVICE, device=0)
    cudart.add_stream(S1, 0)
    shim = DLPackShim(CaiArray(host, stream=S1, read_only=True))
    cudart.clear_log()
    with pytest.raises(BufferError, match="read-only"):
        doors.dltensor_from_object(shim)
    ordering = [line for line in cudart.log() if line.startswith(("cudaEventRecord", "cudaStreamWaitEvent"))]
    assert ordering == []


def test_exchange_dltensor_refuses_an_object_that_borrowed_our_table(example):
    """A class may hand on our exchange table as its own: dltensor_from_py_object_no_sync fails with TypeError for
    its objects, which are neither a DLPackShim nor a DLPackView (a C consumer, which trusts the status, lends
    nothing)."""
    class Borrowed:
        __dlpack_c_exchange_api__ = DLPackShim.__dlpack_c_exchange_api__

    with pytest.raises(TypeError, match="Borrowed is neither a DLPackShim nor a DLPackView"):
        example.exchange_dltensor(Borrowed())


def test_exchange_dltensor_of_a_view_fails_when_its_stream_cannot_be_ordered(cudart, example):
    """dltensor_from_py_object_no_sync of a view made for stream S1 orders S1 before the legacy default stream it
    tells the consumer to work on; when the runtime refuses that ordering the call fails with the runtime's error,
    so that a C consumer, which trusts the status, lends nothing."""
    host = np.arange(8, dtype=np.float32)
    register(cudart, host, DEVICE, device=0)
    cudart.add_stream(S1, 0)
    view = dlpack2cai(DLPackShim(CaiArray(host)), stream=S1)
    assert example.exchange_dltensor(view)["data"] == host.ctypes.data  # ordered: lent
    cudart.fail("cudaEventRecord", 1, count=-1)  # cudaErrorInvalidValue, every time
    with pytest.raises(cai_dlpack.CudaError, match="cudaEventRecord") as raised:
        example.exchange_dltensor(view)
    assert raised.value.call == "cudaEventRecord" and raised.value.code == 1


def test_exchange_dltensor_of_a_view_no_other_thread_can_order_is_refused_there(cudart, example):
    """A view made for this thread's per-thread default stream while it captured a graph has no event that marks
    its data ready: on another thread dltensor_from_py_object_no_sync cannot order it before the stream it reports,
    and fails with BufferError there (a C consumer, which trusts the status, lends nothing)."""
    host = np.arange(8, dtype=np.float32)
    register(cudart, host, DEVICE, device=0)
    capture = cudart.begin_capture(2, 0)
    view = dlpack2cai(DLPackShim(CaiArray(host)), stream=2)
    assert cudart.end_capture(capture)
    outcome = []

    def lend():
        try:
            outcome.append(example.exchange_dltensor(view))
        except Exception as error:  # noqa: BLE001 (what the other thread saw is the result)
            outcome.append(error)

    other = threading.Thread(target=lend)
    other.start()
    other.join()
    assert type(outcome[0]) is BufferError and "made with stream=2 on another thread" in str(outcome[0]), outcome
    assert example.exchange_dltensor(view)["data"] == host.ctypes.data  # on the thread that made it: lent


def test_exchange_allocator(cudart, example):
    host_view = example.exchange_allocate(DLPackShim, (2, 32), (2, 3), (1, 0))
    a = np.asarray(host_view)
    a[:] = 7
    assert a.shape == (2, 3) and a.sum() == 42 and a.__array_interface__["data"][0] % 64 == 0
    device_view = example.exchange_allocate(DLPackView, (0, 64), (5,), (2, 1))
    assert device_view.device == (2, 1)
    assert device_view.__cuda_array_interface__["stream"] == 1
    assert "cudaMalloc(40) -> ok" in cudart.log() and cudart.current_device == 0
    del device_view
    assert "cudaFree()" in cudart.log()
    managed_view = example.exchange_allocate(DLPackView, (2, 16), (4,), (13, 0))
    assert managed_view.device == (13, 0) and np.asarray(managed_view).shape == (4,)
    with pytest.raises(RuntimeError, match="device type 10 is not supported"):
        example.exchange_allocate(DLPackShim, (2, 32), (2,), (10, 0))
    cudart.fail("cudaMalloc", 2)
    with pytest.raises(RuntimeError, match="cudaMalloc failed: cudaErrorMemoryAllocation"):
        example.exchange_allocate(DLPackShim, (2, 32), (2,), (2, 0))
    assert cudart.last_error == 0
    with pytest.raises(RuntimeError, match="bad or overflowing prototype shape"):
        example.exchange_allocate(DLPackShim, (2, 32), (2**62, 2**62), (1, 0))


def test_exchange_allocator_puts_the_callers_context_back(cudart, example):
    """Allocating on device 3 for a thread with no context leaves it with none, and no context on device 0."""
    cudart.drop_context(0)
    view = example.exchange_allocate(DLPackView, (2, 32), (4,), (2, 3))
    assert view.device == (2, 3)
    assert cudart.context_device == -1 and cudart.primary_contexts == {3}
    assert [line for line in cudart.log() if line.startswith(("cuCtx", "cudaSetDevice", "cudaMalloc("))] == [
        "cuCtxGetCurrent() -> NULL", "cuCtxPushCurrent(ctx3)", "cudaMalloc(16) -> ok",
        "cuCtxPopCurrent() -> NULL current"]
    assert cudart.current_device == 0  # the runtime's device setting is untouched
    del view
    # A failed restore refuses the memory it made: freed, and the driver's error named.
    cudart.current_device = 1
    cudart.fail("cuCtxPopCurrent", 201)
    with pytest.raises(RuntimeError, match="cuCtxPopCurrent failed: CUDA_ERROR_INVALID_CONTEXT"):
        example.exchange_allocate(DLPackView, (2, 32), (4,), (2, 3))
    assert cudart.log().count("cudaMalloc(16) -> ok") == 2 and cudart.log().count("cudaFree()") == 2


@pytest.mark.parametrize("code,name", [(1, "cudaErrorInvalidValue"), (2, "cudaErrorMemoryAllocation")])
def test_a_failed_device_allocation_puts_the_callers_context_back(cudart, example, code, name):
    """cudaMalloc failing, with whatever error, on a device other than the caller's: its context is popped again."""
    cudart.fail("cudaMalloc", code)
    with pytest.raises(RuntimeError, match=f"cudaMalloc failed: {name}"):
        example.exchange_allocate(DLPackView, (2, 32), (4,), (2, 3))
    calls = [line for line in cudart.log() if line.startswith(("cuCtxPush", "cuCtxPop"))]
    assert calls == ["cuCtxPushCurrent(ctx3)", "cuCtxPopCurrent() -> ctx0 current"], calls
    assert cudart.context_device == 0 and cudart.current_device == 0


def test_exchange_allocator_makes_pinned_and_managed_memory_in_the_callers_context(cudart, example):
    """Pinned and managed tensors say device 0 (DLPack), but any device may use them: no context is pushed, so none
    is made on device 0 for a caller working on device 2."""
    cudart.drop_context(2)  # the runtime's device is 2; no context exists yet
    for device_type in (3, 13):
        view = example.exchange_allocate(DLPackView, (2, 32), (4,), (device_type, 0))
        assert view.device == (device_type, 0)
    assert not any(line.startswith(("cuCtxPush", "cudaSetDevice")) for line in cudart.log())
    assert cudart.primary_contexts == {2}  # the runtime bound its own device's for the allocation; device 0 has none


def test_exchange_allocator_is_a_consumers_first_call(cudart, example):
    """A fresh process whose first call into us is the exchange allocator (TVM-FFI allocating outputs) loads
    the runtime then; with no runtime at all the allocator reports that, without a pending exception."""
    import os
    import subprocess
    import sys
    import textwrap

    child = textwrap.dedent(f"""
        import importlib.util
        from cai_dlpack import DLPackView
        spec = importlib.util.spec_from_file_location("cai_dlpack_example", {example.__file__!r})
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        try:
            view = example.exchange_allocate(DLPackView, (2, 32), (5,), (2, 0))
            print("MADE", view.device, view.shape)
        except RuntimeError as error:
            print("REFUSED", error)
    """)
    made = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == "MADE (2, 0) (5,)"
    missing = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "CAI_DLPACK_CUDART": "/nowhere/libcudart.so"})
    assert missing.returncode == 0, missing.stderr
    assert missing.stdout.startswith(
        "REFUSED RuntimeError: cai_dlpack allocator: 20 bytes on device (2, 0): no CUDA runtime found")


@pytest.mark.parametrize("shape,code_bits", [((2**61 - 1,), (2, 64)), ((2**60, 8), (2, 8)),
                                             ((2**31, 2**31, 2**1), (1, 8)), ((2**63 - 1,), (1, 8))])
def test_exchange_allocator_refuses_sizes_no_allocation_holds(example, shape, code_bits):
    """A byte count whose rounding up to 64-byte lines would wrap (float64 x (2**61 - 1) is 2**64 - 8 bytes) is
    refused before any rounding, not handed out as a block of a few bytes a consumer then writes past."""
    with pytest.raises(RuntimeError, match="MemoryError: cai_dlpack allocator: the prototype needs"):
        example.exchange_allocate(DLPackShim, code_bits, shape, (1, 0))


@pytest.mark.parametrize("code_bits", [(2, 0), (0, 0)])
def test_exchange_allocator_refuses_a_dtype_without_size(example, code_bits):
    with pytest.raises(RuntimeError, match=r"ValueError: cai_dlpack allocator: prototype dtype .* has no size"):
        example.exchange_allocate(DLPackShim, code_bits, (4,), (1, 0))


def test_to_managed_tensor_refuses_a_bare_dict(example):
    """A tensor owned by a dict keeps nothing alive: the memory it describes is another object's."""
    x = np.arange(4.0)
    for call in (lambda d: example.managed(d, 1), lambda d: example.view(d, 1)):
        with pytest.raises(TypeError, match="to_managed_tensor\\(\\) of a bare interface dict"):
            call(dict(x.__array_interface__))


class Owner:
    """Host memory behind an array interface, with a weak reference to tell when the tensor let it go."""

    def __init__(self):
        self.array = np.arange(6.0)
        self.__array_interface__ = self.array.__array_interface__


@pytest.mark.parametrize("stream", [-5, 0, -(2**40)])
def test_view_from_managed_tensor_refuses_a_bad_stream_and_deletes_the_tensor(example, stream):
    owner = Owner()
    gone = weakref.ref(owner)
    with pytest.raises(ValueError, match=f"consumer stream {stream} is not a valid stream"):
        example.view(owner, 1, stream)
    del owner
    gc.collect()
    assert gone() is None  # the stolen tensor's deleter ran: its owner is free


@pytest.mark.parametrize("stream", [-1, 1, 2, 0x5000])
def test_view_from_managed_tensor_takes_the_array_api_streams(example, stream):
    view = example.view(Owner(), 1, stream)
    assert view.shape == (6,) and np.asarray(view).sum() == 15.0


@needs_torch
def test_fill_tensor_reads_the_lent_tensor_before_running_python(example):
    class Reshaping(torch.Tensor):
        """A tensor whose checks (run between the exchange table lending its DLTensor and our reading of it) change
        the tensor's own shape and strides, which the lent DLTensor points into."""

        def is_neg(self):
            with torch.no_grad():
                self.set_(torch.zeros(7, dtype=self.dtype))
            return False

    base = torch.arange(12.0).reshape(3, 4)
    keep = base.clone()
    tensor = base.as_subclass(Reshaping)
    expected = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
    fields = example.fill(tensor, -1)
    assert tuple(tensor.shape) == (7,)  # the check did run, and changed the tensor
    assert (fields["data"], fields["shape"], fields["strides"]) == expected
    del keep


# ---- producers the C doors refuse, borrowed buffers, the header ---------------------------------------

class AbsurdDevice:
    """A producer whose __dlpack_device__ names a device type that fits no C integer."""

    def __init__(self, device):
        self.device = device

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, max_version=None):
        raise AssertionError("never reached: the device is refused first")


@pytest.mark.parametrize("device", [(2**70, 0), (-(2**70), 0), (-1, 0), ("cpu", 0), (1,), None])
def test_producer_device_that_is_not_a_device_is_refused_clearly(example, device):
    with pytest.raises(ValueError, match=r"__dlpack_device__\(\) returned .*not a \(device_type, device_id\) pair"):
        example.managed(AbsurdDevice(device), 1)


def test_producer_device_types_up_to_int32_max_are_asked_for_their_tensor(example):
    """DLPack's device type is an int32: the largest one is a device type (its producer is asked, with the
    consumer's stream), one more is not (refused before the producer is asked)."""
    asked = []

    class LargestDevice(AbsurdDevice):
        def __dlpack__(self, stream=None, max_version=None):
            asked.append(stream)
            raise ValueError("this producer makes no tensor")

    with pytest.raises(ValueError, match="this producer makes no tensor"):
        example.managed(LargestDevice((2**31 - 1, 0)), 5)
    assert asked == [5]
    with pytest.raises(ValueError, match=r"returned \(2147483648, 0\), not a \(device_type, device_id\) pair"):
        example.managed(AbsurdDevice((2**31, 0)), 5)


class FreshBuffer:
    """An array interface whose 'data' is a buffer object made anew on each access, which NumPy's protocol
    allows: nothing but the caller holds it."""

    def __init__(self):
        self.made = []

    @property
    def __array_interface__(self):
        buffer = array.array("d", [1.0, 2.0, 3.0])
        self.made.append(weakref.ref(buffer))
        return {"shape": (3,), "typestr": "<f8", "data": buffer, "version": 3}


class HeldBuffer(FreshBuffer):
    """The same, but the object keeps the buffer it names: the memory lives as long as the object."""

    def __init__(self):
        super().__init__()
        self.buffer = array.array("d", [1.0, 2.0, 3.0])

    @property
    def __array_interface__(self):
        self.made.append(weakref.ref(self.buffer))
        return {"shape": (3,), "typestr": "<f8", "data": self.buffer, "version": 3}


def test_borrowed_tensor_of_a_buffer_that_dies_with_the_call_is_refused(example):
    obj = FreshBuffer()
    with pytest.raises(BufferError, match="array that FreshBuffer's __array_interface__ 'data' names is held by nothing"):
        example.fill(obj, -1)
    with pytest.raises(BufferError, match="held by nothing but this call"):
        example.exchange_dltensor(DLPackShim(obj))
    gc.collect()
    assert [ref() for ref in obj.made] == [None, None]  # refused, and nothing kept


def test_borrowed_tensor_of_a_buffer_the_object_holds_is_lent(example):
    obj = HeldBuffer()
    fields = example.fill(obj, -1)
    assert fields["data"] == obj.buffer.buffer_info()[0] and fields["shape"] == (3,)
    assert obj.made[-1]() is obj.buffer


def test_owning_tensor_of_a_fresh_buffer_keeps_it_alive(example):
    obj = FreshBuffer()
    capsule = cai2dlpack(obj, max_version=(1, 0))
    gc.collect()
    assert obj.made[-1]() is not None  # the capsule holds the buffer
    assert example.managed(obj, -1)["shape"] == (3,)
    del capsule
    gc.collect()
    assert [ref() for ref in obj.made] == [None, None]


def test_header_usage_example_compiles():
    """The usage lines at the top of the public header, compiled as a caller would write them, with no include
    path but Python's and ours (the header declares the DLPack ABI itself)."""
    with open(os.path.join(ROOT, "include", "cai_dlpack", "cai_dlpack.h")) as file:
        header = file.read()
    usage = re.search(r"/\* cai_dlpack C API.*?\n \*\n(.*?)\n \*\n", header, re.S).group(1)
    lines = [line[4:].split("//")[0] for line in usage.splitlines()]
    source = ("#include <cai_dlpack/cai_dlpack.h>\nstatic void launch_kernel(void *data, ...) { (void)data; }\n"
              "PyObject *use(PyObject *obj, int64_t stream) {\n" + "\n".join(lines).replace("...", "&t") +
              "\n    Py_RETURN_NONE;\n}\n")
    directory = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"cai_dlpack_usage_{os.getpid()}")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "usage.c")
    with open(path, "w") as file:
        file.write(source)
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    result = subprocess.run([compiler, "-c", "-Wall", "-Werror", "-I", sysconfig.get_paths()["include"],
                             "-I", os.path.join(ROOT, "include"), path, "-o", os.path.join(directory, "usage.o")], capture_output=True, text=True)
    assert result.returncode == 0, source + result.stderr


@pytest.mark.parametrize("error", [BufferError, ValueError])
def test_to_managed_tensor_passes_on_a_dlpack_producers_own_error(error):
    """A DLPack producer whose __dlpack__ refuses, with no array interface to read instead: to_managed_tensor
    raises the producer's own exception (a BufferError included: it is checked for a fallback first)."""

    class Refusing:
        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, **kwargs):
            raise error("the producer's own words")

    with pytest.raises(error, match="the producer's own words"):
        doors.to_managed_tensor(Refusing(), -1)


@pytest.mark.parametrize("door", ["to_managed_tensor", "fill_tensor"])
def test_an_empty_array_with_a_producer_stream_passes_every_door(cudart, example, door):
    """An array with no elements orders no streams (nothing to race on; its NULL pointer names no device to
    record on), whatever stream its producer names: each door succeeds, with no exception set and no runtime
    ordering call."""
    cudart.clear_log()
    status, raised, _ = example.status_of(door, CaiArray(np.zeros((0, 3), dtype=np.float32), stream=0x5000), 0x6000)
    assert (status, raised) == (0, None)
    assert not any(line.startswith(("cudaEventRecord", "cudaStreamWaitEvent")) for line in cudart.log())


class RefusingWithInterface:
    """A DLPack producer that refuses its export but describes the same memory through its array interface."""

    def __init__(self, array, error):
        self.array = array
        self.error = error

    @property
    def __array_interface__(self):
        return self.array.__array_interface__

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        raise self.error


def test_a_refused_export_read_through_the_interface_keeps_nothing_of_the_refusal(example):
    """to_managed_tensor of a producer whose __dlpack__ refuses (BufferError) reads its array interface instead; the
    refusal, set aside while the interface is asked for, is dropped whole (type, value and traceback): not one
    reference kept per call."""
    x = np.arange(4.0)
    error = BufferError("this producer's export refuses")
    producer = RefusingWithInterface(x, error)

    def convert(times):
        for _ in range(times):
            assert example.managed(producer, -1)["shape"] == (4,)
        error.__traceback__ = None  # each raise gives it a traceback of its own: not what is counted

    convert(3)
    before = sys.getrefcount(error), sys.getrefcount(producer), live_tracebacks()
    convert(200)
    assert (sys.getrefcount(error), sys.getrefcount(producer), live_tracebacks()) == before  # a kept traceback keeps
                                                                                        # __dlpack__'s frame



# ---- the stream a DLPack producer is asked with, NULL tensors ---------------------------------------------

class NoDeviceProducer:
    """A DLPack producer with __dlpack__ alone (no __dlpack_device__), which records the stream it is asked with."""

    def __init__(self):
        self.asked = []

    def __dlpack__(self, stream=None, max_version=None):
        self.asked.append(stream)
        raise ValueError("this producer makes no tensor")


def test_a_producer_without_dlpack_device_is_asked_with_the_consumers_stream(example):
    """No __dlpack_device__ (AttributeError) tells nothing of the device: the producer's __dlpack__ is asked with
    the consumer's stream, and its own error is what the caller sees."""
    producer = NoDeviceProducer()
    with pytest.raises(ValueError, match="this producer makes no tensor"):
        example.managed(producer, 5)
    assert producer.asked == [5]


def test_a_producer_whose_dlpack_device_raises_is_not_asked_for_its_tensor(example):
    """A __dlpack_device__ that raises anything but AttributeError: its error is raised, __dlpack__ not asked."""

    class BrokenDevice(NoDeviceProducer):
        def __dlpack_device__(self):
            raise RuntimeError("the device cannot be named today")

    producer = BrokenDevice()
    with pytest.raises(RuntimeError, match="the device cannot be named today"):
        example.managed(producer, 5)
    assert producer.asked == []


def test_view_from_managed_tensor_refuses_a_null_tensor():
    with pytest.raises(ValueError, match=r"view_from_managed_tensor\(\) was given a NULL tensor"):
        doors.view_from_managed_tensor(doors.ManagedPointer(), 1)


def test_managed_tensor_to_py_object_refuses_a_null_tensor():
    with pytest.raises(ValueError, match=r"managed_tensor_to_py_object_no_sync\(\) was given a NULL tensor"):
        doors.object_from_managed(doors.ManagedPointer())


def test_a_null_tensor_handed_back_is_refused_by_the_status_as_well(example):
    """A C consumer reads the status first: -1 with the ValueError set, and no object made."""
    status, raised, _ = example.status_of("managed_tensor_to_py_object_no_sync of NULL", DLPackShim(np.zeros(1)), 0)
    assert status == -1
    assert isinstance(raised, ValueError) and "was given a NULL tensor" in str(raised)
