"""On a real GPU: PyTorch, CuPy and numba-cuda as producers and consumers, memory kinds, and stream
ordering that keeps the host free. Skipped (with the reason) where there is no GPU."""
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

import cai_dlpack  # noqa: E402
from cai_dlpack import DLPackShim, cai2dlpack, dlpack2cai  # noqa: E402
from cai_dlpack._benchmark import SPIN_KERNEL  # noqa: E402
from support.cai_objects import Wrapped  # noqa: E402

DTYPES = ["?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"]
TORCH_DTYPES = [d for d in DTYPES if d not in ("u2", "u4", "u8")]
kDLCUDA, kDLCUDAHost, kDLCUDAManaged = 2, 3, 13


def cupy_sample(dtype, shape=(6, 8)):
    values = cupy.arange(int(np.prod(shape))).reshape(shape)
    if dtype == "?":
        return values % 2 == 1
    return values.astype(dtype)


def layouts(dtype):
    base = cupy_sample(dtype)
    return {"contiguous": base, "strided": base[1:5:2, ::3], "transposed": base.T, "zero_size": base[:0],
            "zero_d": base[2, 3]}


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "transposed", "zero_size", "zero_d"])
def test_cupy_to_torch_and_back(dtype, layout):
    x = layouts(dtype)[layout]
    t = torch.from_dlpack(DLPackShim(x))
    assert tuple(t.shape) == x.shape
    if x.size:
        assert t.data_ptr() == x.data.ptr
    np.testing.assert_array_equal(t.cpu().numpy(), cupy.asnumpy(x))
    back = cupy.asarray(dlpack2cai(t))
    if x.size:
        assert back.data.ptr == x.data.ptr
    np.testing.assert_array_equal(cupy.asnumpy(back), cupy.asnumpy(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cupy_through_capsule_into_cupy(dtype):
    x = cupy_sample(dtype)[::2]
    y = cupy.from_dlpack(DLPackShim(x))
    assert y.data.ptr == x.data.ptr
    assert bool((y == x).all())


def test_numba_producer_and_consumer():
    numba_cuda = pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")
    d = numba_cuda.to_device(np.arange(24, dtype=np.float32).reshape(4, 6))
    t = torch.from_dlpack(DLPackShim(d))
    assert t.data_ptr() == d.__cuda_array_interface__["data"][0]
    assert t.sum().item() == sum(range(24))
    tensor = torch.arange(10, device="cuda", dtype=torch.int32)[::2]
    view = dlpack2cai(tensor)
    n = numba_cuda.as_cuda_array(view)
    assert n.__cuda_array_interface__["data"][0] == tensor.data_ptr()
    assert n.copy_to_host().tolist() == tensor.tolist()


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "transposed", "zero_size", "zero_d"])
def test_numba_to_torch_and_back(dtype, layout):
    """Numba device arrays of every layout, made as views (Numba's own .T copies through a kernel), into torch
    through the shim and back into Numba through dlpack2cai; values are read back through CuPy."""
    numba_cuda = pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    host = cupy.asnumpy(cupy_sample(dtype))
    base = numba_cuda.to_device(host)
    if layout == "contiguous":
        d, expected = base, host
    elif layout == "strided":
        d, expected = base[1:5:2, ::3], host[1:5:2, ::3]
    elif layout == "transposed":
        d = DeviceNDArray(base.shape[::-1], base.strides[::-1], base.dtype, gpu_data=base.gpu_data)
        expected = host.T
    elif layout == "zero_size":
        d, expected = base[:0], host[:0]
    else:
        d, expected = DeviceNDArray((), (), base.dtype, gpu_data=base.gpu_data), host[0, 0]
    t = torch.from_dlpack(DLPackShim(d))
    assert tuple(t.shape) == expected.shape and t.stride() == tuple(s // host.itemsize for s in expected.strides)
    if expected.size:
        assert t.data_ptr() == d.__cuda_array_interface__["data"][0]
    np.testing.assert_array_equal(t.cpu().numpy(), expected)
    back = numba_cuda.as_cuda_array(dlpack2cai(t))
    assert back.shape == expected.shape
    if expected.size:
        assert back.__cuda_array_interface__["data"][0] == t.data_ptr()
    np.testing.assert_array_equal(cupy.asnumpy(cupy.asarray(back)), expected)


def test_writes_visible_both_ways():
    x = cupy.zeros((4, 4), dtype=cupy.float32)
    t = torch.from_dlpack(DLPackShim(x))
    t[1, 2] = 5
    torch.cuda.synchronize()
    assert float(x[1, 2]) == 5.0


def test_device_types_of_memory_kinds():
    device = cupy.zeros(16, dtype=cupy.float32)
    assert DLPackShim(device).__dlpack_device__() == (kDLCUDA, device.device.id)
    managed_memory = cupy.cuda.malloc_managed(64)
    managed = cupy.ndarray((16,), dtype=cupy.float32, memptr=managed_memory)
    assert DLPackShim(managed).__dlpack_device__() == (kDLCUDAManaged, 0)  # DLPack: 0 for managed memory
    pinned_memory = cupy.cuda.alloc_pinned_memory(64)
    host = np.frombuffer(pinned_memory, dtype=np.float32, count=16)
    host[:] = np.arange(16)

    class Pinned:
        __cuda_array_interface__ = {"shape": (16,), "typestr": "<f4", "data": (host.ctypes.data, False),
                                    "version": 3, "stream": None}

    assert DLPackShim(Pinned()).__dlpack_device__() == (kDLCUDAHost, 0)  # and for pinned memory
    np.testing.assert_array_equal(np.from_dlpack(DLPackShim(Pinned())), np.arange(16))




def busy_producer(milliseconds):
    """A stream kept busy for about the given time, then writing ones into x: the data is ready only then."""
    spin = cupy.RawKernel(SPIN_KERNEL, "spin")
    producer = cupy.cuda.Stream(non_blocking=True)
    # cupy.ones loads CuPy's fill kernel now: loading a module synchronizes with the device, and doing it
    # while the producer spins would block the host until the spin ends (no race left, host blocked).
    x = cupy.ones(1 << 20, dtype=cupy.float32)
    x.fill(0)
    cupy.cuda.Device().synchronize()
    with producer:
        spin((1,), (1,), (np.int64(milliseconds * 1_000_000),))
        x.fill(1)
    return x, producer


def read_on(consumer, capsule_source):
    with torch.cuda.stream(torch.cuda.ExternalStream(consumer.ptr)):
        t = torch.from_dlpack(capsule_source)
        return t.sum()


@pytest.mark.parametrize("sync", [True, False])
def test_race_is_prevented_only_by_ordering(sync):
    consumer = cupy.cuda.Stream(non_blocking=True)
    # Load torch's sum kernel and cache memory for the consumer stream first: a module load or a cudaMalloc
    # during the spin can serialize the streams, which would hide the race this test shows.
    read_on(consumer, DLPackShim(cupy.zeros(1 << 20, dtype=cupy.float32)))
    torch.cuda.synchronize()
    x, producer = busy_producer(200)
    try:
        cai_dlpack.options(sync=sync)
        total = read_on(consumer, DLPackShim(Wrapped(x, producer.ptr)))
        torch.cuda.synchronize()
    finally:
        cai_dlpack.options(sync=True)
    if sync:
        assert total.item() == x.size
    else:
        assert total.item() < x.size  # the consumer read before the producer wrote: the race is real


def test_host_is_not_blocked_while_producer_is_busy():
    consumer = cupy.cuda.Stream(non_blocking=True)
    idle = cupy.cuda.Stream(non_blocking=True)
    DLPackShim(Wrapped(cupy.zeros(4), idle.ptr)).__dlpack__(stream=consumer.ptr)  # load the runtime, make the event
    x, producer = busy_producer(100)
    shim = DLPackShim(Wrapped(x, producer.ptr))
    capsule = shim.__dlpack__(stream=consumer.ptr, max_version=(1, 0))
    still_busy = not producer.done
    consumer.synchronize()
    # How long the conversion took is measured by benchmarks/gpu.py; here only that it did not wait.
    assert still_busy  # the conversion returned while the producer was still working
    view = dlpack2cai(capsule, stream=consumer.ptr)
    assert float(cupy.asarray(view).sum()) == x.size


class SpyTensor(torch.Tensor):
    """A torch tensor whose __dlpack__ must not be called: dlpack2cai takes it through torch's exchange API."""

    def __dlpack__(self, *args, **kwargs):
        raise AssertionError("__dlpack__ was called although torch.Tensor publishes an exchange table")


@pytest.mark.parametrize("sync", [True, False])
def test_torch_work_stream_is_ordered_through_the_exchange_api(sync):
    """torch writes on a non-default current stream; dlpack2cai takes the tensor through torch's table (no sync
    of its own) and orders torch's current stream before CuPy's consumer stream. With ordering off the CuPy
    reduction reads before torch's write: the race is real."""
    spin = cupy.RawKernel(SPIN_KERNEL, "spin")
    spin((1,), (1,), (np.int64(1),))
    consumer = cupy.cuda.Stream(non_blocking=True)
    x = torch.zeros(1 << 20, device="cuda")
    with consumer:
        cupy.asarray(dlpack2cai(x, stream=-1)).sum()  # load CuPy's reduction first: a module load would serialize
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        with external_stream(side.cuda_stream):
            spin((1,), (1,), (np.int64(200_000_000),))
        x.fill_(1)
        try:
            cai_dlpack.options(sync=sync)
            view = dlpack2cai(x.as_subclass(SpyTensor), stream=consumer.ptr)  # torch's current stream: side
        finally:
            cai_dlpack.options(sync=True)
    with consumer:
        total = cupy.asarray(view).sum()
    consumer.synchronize()
    torch.cuda.synchronize()
    if sync:
        assert float(total) == x.numel()
    else:
        assert float(total) < x.numel()


def test_dlpack2cai_exports_the_consumer_stream():
    consumer = cupy.cuda.Stream(non_blocking=True)
    t = torch.ones(1 << 16, device="cuda")
    view = dlpack2cai(t, stream=consumer.ptr)
    assert view.__cuda_array_interface__["stream"] == consumer.ptr
    assert dlpack2cai(t).__cuda_array_interface__["stream"] == 1
    assert dlpack2cai(t, stream=-1).__cuda_array_interface__["stream"] is None


def test_a_thread_without_context_is_left_without_one():
    """A new thread has no current CUDA context. A conversion that orders streams makes the data's device current
    for its calls and leaves the thread with the context it had after the pointer query alone (none, unless the
    query binds one), where cudaSetDevice would leave device 0's primary context bound."""
    driver = pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")
    producer = cupy.cuda.Stream(non_blocking=True)
    with producer:
        x = cupy.arange(1 << 10, dtype=cupy.float32)
    wrapped = Wrapped(x, producer.ptr)
    results = {}

    def current_context():
        return int(driver.cuCtxGetCurrent()[1])

    def query_only():
        results["fresh"] = current_context()
        cupy.cuda.runtime.pointerGetAttributes(x.data.ptr)
        results["after query"] = current_context()

    def convert():
        capsule = cai2dlpack(wrapped, stream=2)
        results["after conversion"] = current_context()
        results["view"] = dlpack2cai(capsule)

    for target in (query_only, convert):
        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
    assert results["fresh"] == 0
    assert results["after conversion"] == results["after query"]
    assert float(cupy.asarray(results["view"]).sum()) == float(x.sum())


def test_conversion_after_a_device_reset():
    """A device reset destroys the pooled event with its context; the next conversion makes a new one (in a child
    process: a reset would pull the memory from under this process's PyTorch and CuPy)."""
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), os.pardir, "support", "device_reset_child.py")
    child = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "converted after a reset"


def external_stream(handle):
    """A CuPy stream object over a stream handle made elsewhere."""

    class Foreign:
        def __cuda_stream__(self):  # the CUDA stream protocol: (version, handle)
            return (0, handle)

    if hasattr(cupy.cuda.Stream, "from_external"):
        return cupy.cuda.Stream.from_external(Foreign())
    return cupy.cuda.ExternalStream(handle)  # CuPy before 14: deprecated since


@pytest.mark.parametrize("sync", [True, False])
def test_green_context_producer_stream(sync):
    """A stream of a green context (a share of the SMs) records the event in that context, the one cuStreamGetCtx
    names, and the consumer in the primary context waits on it; the thread's context is left as it was. With
    ordering switched off the consumer reads before the green stream's write: the race is real."""
    driver = pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")
    if not hasattr(driver, "cuGreenCtxStreamCreate"):
        pytest.skip("this cuda-bindings has no green contexts")

    def ok(result):
        assert result[0] == driver.CUresult.CUDA_SUCCESS, result[0]
        return result[1] if len(result) == 2 else result[1:]

    # Load the fill and sum kernels first: a module load while the green stream spins would wait for the spin.
    x = cupy.zeros(1 << 20, dtype=cupy.float32)
    x.fill(0)
    consumer = cupy.cuda.Stream(non_blocking=True)
    with consumer:
        float(x.sum())
    version = ok(driver.cuDriverGetVersion())
    if version < 12040:
        pytest.skip(f"driver {version} has no green contexts (12.4 and later)")
    device = ok(driver.cuDeviceGet(0))
    sms = ok(driver.cuDeviceGetDevResource(device, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, _, _ = ok(driver.cuDevSmResourceSplitByCount(1, sms, 0, 8))
    description = ok(driver.cuDevResourceGenerateDesc([groups[0]], 1))
    green = ok(driver.cuGreenCtxCreate(description, device, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
    try:
        handle = ok(driver.cuGreenCtxStreamCreate(green, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
        primary = int(ok(driver.cuCtxGetCurrent()))
        assert int(ok(driver.cuStreamGetCtx(handle))) == int(ok(driver.cuCtxFromGreenCtx(green))) != primary
        spin = cupy.RawKernel(SPIN_KERNEL, "spin")
        cupy.cuda.Device().synchronize()
        with external_stream(int(handle)):
            spin((1,), (1,), (np.int64(200_000_000),))
            x.fill(7)
        try:
            cai_dlpack.options(sync=sync)
            capsule = cai2dlpack(dict(x.__cuda_array_interface__, stream=int(handle)), owner=x, stream=consumer.ptr)
        finally:
            cai_dlpack.options(sync=True)
        assert int(ok(driver.cuCtxGetCurrent())) == primary
        with consumer:
            total = float(cupy.asarray(dlpack2cai(capsule, stream=-1)).sum())
        if sync:
            assert total == 7.0 * x.size  # read after the green stream's write, not during its spin
        else:
            assert total < 7.0 * x.size
        ok((driver.cuStreamDestroy(handle)[0], None))
    finally:
        cupy.cuda.Device().synchronize()
        ok((driver.cuGreenCtxDestroy(green)[0], None))


@pytest.mark.skipif("torch.cuda.device_count() < 2", reason="needs two GPUs")
def test_second_device():
    with cupy.cuda.Device(1):
        x = cupy.arange(8, dtype=cupy.float32)
    capsule = cai2dlpack(Wrapped(x, 1), stream=2)
    view = dlpack2cai(capsule)
    assert view.device == (kDLCUDA, 1)
    assert torch.cuda.current_device() == 0
    t = torch.from_dlpack(DLPackShim(x))
    assert t.device.index == 1
