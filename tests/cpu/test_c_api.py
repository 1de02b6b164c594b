"""The C-speed doors, through real consumers: a small C extension built on cai_dlpack's C API, and
apache-tvm-ffi taking the DLPack C exchange API (__dlpack_c_exchange_api__) fast path."""
import ctypes
import gc
import sys
import weakref

import numpy as np
import pytest

import cai_dlpack
from cai_dlpack import DLPackShim, DLPackView, dlpack2cai
from support import c_example
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE

from support.optional import needs_torch, needs_tvm_ffi, torch, tvm_ffi

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
