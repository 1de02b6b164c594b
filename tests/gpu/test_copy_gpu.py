"""Copies on a real GPU: host copies (dl_device=(kDLCPU, 0)) equal CuPy's .get() and Numba's copy_to_host(),
device copies (copy=True) are distinct memory with the right values after a producer stream that finishes
late, and a device copy leaves the host free. Skipped (with the reason) where there is no GPU."""
import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

from cai_dlpack import DLPackShim, dlpack2cai  # noqa: E402
from support.cai_objects import Wrapped  # noqa: E402
from test_gpu import busy_producer  # noqa: E402

kDLCPU, kDLCUDA = 1, 2
MAX_CALLS = 65536  # csrc/copy.c: CDL_COPY_MAX_CALLS


def layouts(dtype):
    base = cupy.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)
    base = (base % 2 == 1) if dtype == "?" else base.astype(dtype)
    return {
        "contiguous": base,
        "strided": base[:, ::2, 1:, ::3],
        "negative": base[::-1, :, ::-2],
        "transposed": base.transpose(3, 1, 0, 2),
        "zero strides": cupy.broadcast_to(base[0, 0, 0], (3, 4, 5)),
        "rows": base[:, ::2, 1:3],
        "empty": base[:, :0],
        "0-d": base[1, 2, 3],
    }


LAYOUT_NAMES = list(layouts("f4"))
DTYPES = ["?", "i1", "i8", "f2", "f4", "f8", "c8"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_host_copy_equals_get(layout, dtype):
    x = layouts(dtype)[layout]
    host = np.from_dlpack(DLPackShim(x), device="cpu")
    assert isinstance(host, np.ndarray) and host.flags.c_contiguous and host.flags.writeable
    assert host.dtype == x.dtype and host.shape == x.shape
    np.testing.assert_array_equal(host, x.get())


def test_host_copy_of_numba_equals_copy_to_host():
    numba_cuda = pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")
    d = numba_cuda.to_device(np.arange(4 * 6, dtype=np.float32).reshape(4, 6))[:, ::2]
    host = np.from_dlpack(DLPackShim(d), device="cpu")
    np.testing.assert_array_equal(host, d.copy_to_host())


def test_low_precision_host_copy_bit_for_bit():
    bits = cupy.arange(256, dtype=cupy.uint16).reshape(16, 16)[::-1, ::3].copy()
    x = torch.from_dlpack(bits).view(torch.bfloat16)[:, ::2]  # bfloat16, strided, every bit pattern of a byte
    capsule = DLPackShim(dlpack2cai(x)).__dlpack__(dl_device=(kDLCPU, 0))
    host = torch.utils.dlpack.from_dlpack(capsule)
    assert host.device.type == "cpu" and host.dtype == torch.bfloat16 and host.is_contiguous()
    assert host.view(torch.int16).numpy().view(np.uint16).tolist() == bits.get()[:, ::2].tolist()


def test_host_copy_waits_for_the_producers_stream():
    x, producer = busy_producer(200)
    host = np.from_dlpack(DLPackShim(Wrapped(x, producer.ptr)), device="cpu")
    assert producer.done  # the one host wait: the copy is complete on return
    assert int((host == 1).sum()) == x.size


def test_device_copy_is_distinct_right_and_leaves_the_host_free():
    consumer = cupy.cuda.Stream(non_blocking=True)
    with consumer:  # load the sum kernel first: a module load during the spin would serialize the streams
        warm = cupy.asarray(dlpack2cai(DLPackShim(cupy.zeros(4, dtype=cupy.float32)).__dlpack__(
            stream=consumer.ptr, copy=True, max_version=(1, 0)), stream=consumer.ptr))
        float(warm.sum())
    x, producer = busy_producer(200)
    capsule = DLPackShim(Wrapped(x, producer.ptr)).__dlpack__(stream=consumer.ptr, copy=True, max_version=(1, 0))
    still_busy = not producer.done
    view = dlpack2cai(capsule, stream=consumer.ptr)
    assert view.device == (kDLCUDA, x.device.id)
    with consumer:
        y = cupy.asarray(view)
        total = y.sum()
    consumer.synchronize()
    assert still_busy  # __dlpack__(copy=True) returned while the producer was still working
    assert y.data.ptr != x.data.ptr
    assert float(total) == x.size  # the copy ran after the producer's late write
    with producer:
        x.fill(5)
    producer.synchronize()
    assert float(y.sum()) == x.size  # its own memory


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_device_copy_of_every_layout(layout):
    x = layouts("f4")[layout]
    view = dlpack2cai(DLPackShim(x).__dlpack__(copy=True, max_version=(1, 0)))
    y = cupy.asarray(view)
    assert y.flags.c_contiguous and y.shape == x.shape
    if x.size:
        assert y.data.ptr != x.data.ptr
    np.testing.assert_array_equal(y.get(), x.get())


def test_torch_asks_for_a_copy():
    if "copy" not in inspect.signature(torch.from_dlpack).parameters:
        pytest.skip("this torch.from_dlpack has no copy= argument")
    x = layouts("f4")["strided"]
    t = torch.from_dlpack(DLPackShim(x), copy=True)
    assert t.data_ptr() != x.data.ptr
    np.testing.assert_array_equal(t.cpu().numpy(), x.get())


def test_device_copy_needing_a_kernel_is_refused_and_the_host_copy_is_not():
    x = cupy.arange(2 * (MAX_CALLS + 10), dtype=cupy.float32)[::-2]
    with pytest.raises(BufferError, match="no kernel of its own"):
        DLPackShim(x).__dlpack__(copy=True)
    np.testing.assert_array_equal(np.from_dlpack(DLPackShim(x), device="cpu"), x.get())


def test_copies_are_flagged_as_copies():
    from support.dlpack_ctypes import read_capsule
    x = layouts("f4")["strided"]
    assert read_capsule(DLPackShim(x).__dlpack__(copy=True, max_version=(1, 0)))["flags"] == 2  # IS_COPIED
    assert read_capsule(DLPackShim(x).__dlpack__(dl_device=(kDLCPU, 0), max_version=(1, 0)))["flags"] == 2
    assert read_capsule(DLPackShim(x).__dlpack__(max_version=(1, 0)))["flags"] == 0  # shared: no copy


def test_device_copy_of_an_empty_transposed_tensor():
    t = torch.empty(0, 100000, device="cuda").t()  # strides (1, 100000): 100,000 calls of no rows, were it planned
    copied = torch.from_dlpack(dlpack2cai(DLPackShim(dlpack2cai(t)).__dlpack__(copy=True, max_version=(1, 0))))
    assert copied.shape == (100000, 0)


@pytest.mark.parametrize("what", ["rows farther apart than the max pitch", "rows wider than the max pitch"])
def test_copies_past_the_max_pitch(what):
    # cudaDevAttrMaxPitch is 2**31 - 1 on current GPUs: 2D copies of such rows are refused by CUDA.
    big = 2**31 + 64
    if cupy.cuda.Device().mem_info[0] < 3 * 2 * big:
        pytest.skip("needs about 13 GiB of free GPU memory")
    base = cupy.zeros((2, big), dtype=cupy.uint8)
    base[:, :16] = cupy.arange(32, dtype=cupy.uint8).reshape(2, 16)
    base[:, big - 80:big - 64] = 7
    x = base[:, :16] if what.startswith("rows farther") else base[:, :big - 64]
    host = np.from_dlpack(DLPackShim(x), device="cpu")
    np.testing.assert_array_equal(host[:, :16], base[:, :16].get())
    assert host.shape == x.shape
    y = cupy.asarray(dlpack2cai(DLPackShim(x).__dlpack__(copy=True, max_version=(1, 0))))
    assert bool((y == x).all())
