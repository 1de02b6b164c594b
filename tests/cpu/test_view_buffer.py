"""DLPackView exports the buffer protocol for host-accessible tensors: NumPy, memoryview and any buffer
consumer read the tensor without the interface dict; the export holds the tensor; device memory, read-only
tensors and layouts a consumer cannot take are refused with BufferError."""
import ctypes
import gc
import weakref
import zlib

import numpy as np
import pytest

from cai_dlpack import DLPackShim, cai2dlpack, dlpack2cai
from support.cai_objects import CaiArray, register
from support.cuda_double import PINNED_HOST
from support.dlpack_ctypes import MadeTensor, kDLCPU, kDLCUDA, kDLFloat, kDLUInt
from support.optional import needs_torch, torch
from test_host_peers import DTYPES, layouts

_testbuffer = pytest.importorskip("_testbuffer", reason="this CPython build has no _testbuffer module")

FORMATS = {"?": "?", "i1": "b", "i2": "h", "i4": "i", "i8": "q", "u1": "B", "u2": "H", "u4": "I", "u8": "Q",
           "f2": "e", "f4": "f", "f8": "d", "c8": "Zf", "c16": "Zd"}


def view_of(array):
    return dlpack2cai(array.__dlpack__(max_version=(1, 0)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["c_order", "f_order", "sliced", "negative", "broadcast", "zero_d",
                                    "zero_size", "one_d"])
def test_memoryview_and_numpy_read_the_tensor(dtype, layout):
    array = layouts(dtype)[layout]
    view = view_of(array)
    m = memoryview(view)
    assert m.format == FORMATS[dtype]
    assert m.itemsize == array.itemsize
    assert m.shape == array.shape
    assert m.readonly == (not array.flags.writeable)
    if array.size:
        assert m.strides == array.strides
    assert m.tobytes() == array.tobytes()
    through_numpy = np.asarray(view)
    assert through_numpy.dtype == array.dtype and through_numpy.shape == array.shape
    assert np.array_equal(through_numpy, array)
    if array.size:
        assert through_numpy.__array_interface__["data"][0] == array.__array_interface__["data"][0]
    assert through_numpy.flags.writeable == array.flags.writeable


@needs_torch
def test_writes_through_the_buffer_reach_the_producer():
    t = torch.zeros(3, 4)
    a = np.asarray(dlpack2cai(t))
    a[1, 2] = 7.0
    assert t[1, 2].item() == 7.0


def test_read_only_tensor_refuses_a_writable_buffer():
    array = np.arange(6, dtype=np.float32)
    array.flags.writeable = False
    view = view_of(array)
    assert view.read_only and memoryview(view).readonly
    with pytest.raises(BufferError, match="DLPackView is read-only"):
        _testbuffer.ndarray(view, getbuf=_testbuffer.PyBUF_WRITABLE)
    with pytest.raises(TypeError, match="not writable"):
        (ctypes.c_char * 24).from_buffer(view)  # ctypes words the same refusal as a TypeError
    assert not np.asarray(view).flags.writeable  # NumPy falls back to a read-only buffer


@pytest.mark.parametrize("request_name, layouts_accepted", [
    ("PyBUF_SIMPLE", {"c_order", "one_d", "zero_d"}),
    ("PyBUF_C_CONTIGUOUS", {"c_order", "one_d", "zero_d"}),
    ("PyBUF_F_CONTIGUOUS", {"f_order", "one_d", "zero_d"}),
    ("PyBUF_ANY_CONTIGUOUS", {"c_order", "f_order", "one_d", "zero_d"}),
    ("PyBUF_FULL_RO", {"c_order", "f_order", "one_d", "zero_d", "sliced", "negative", "broadcast"}),
])
def test_contiguity_requests(request_name, layouts_accepted):
    flags = getattr(_testbuffer, request_name)
    for name, array in layouts("f4").items():
        if name == "zero_size":
            continue
        view = view_of(array)
        if name in layouts_accepted:
            exported = _testbuffer.ndarray(view, getbuf=flags)
            assert exported.tobytes() == array.tobytes(), name
        else:
            with pytest.raises(BufferError, match="contiguous"):
                _testbuffer.ndarray(view, getbuf=flags)


def test_simple_consumer_gets_the_bytes():
    array = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert zlib.crc32(view_of(array)) == zlib.crc32(array.tobytes())  # PyBUF_SIMPLE
    with pytest.raises(BufferError, match="not C-contiguous"):
        zlib.crc32(view_of(array[:, ::2]))
    with pytest.raises(BufferError, match="not C-contiguous"):
        zlib.crc32(view_of(array[0, ::2]))  # one dimension, stepping over every other item


@needs_torch
def test_export_keeps_the_tensor_alive():
    t = torch.arange(4.0)
    made = MadeTensor(data=t.data_ptr(), shape=(4,))
    view = dlpack2cai(made.capsule)
    alive = weakref.ref(view)
    m = memoryview(view)
    del view
    gc.collect()
    assert alive() is not None and made.deleted == 0
    assert m.tolist() == [0.0, 1.0, 2.0, 3.0]
    m.release()
    gc.collect()
    assert alive() is None and made.deleted == 1


def test_device_memory_has_no_buffer():
    made = MadeTensor(data=0x7000_0000, device=(kDLCUDA, 0), shape=(3,))
    view = dlpack2cai(made.capsule)
    with pytest.raises(BufferError, match=r"device memory \(DLPack device type 2\) has no host buffer"):
        memoryview(view)
    del view
    assert made.deleted == 1


def test_shape_too_large_for_a_buffer():
    # Broadcast (zero strides): 2**62 elements in 8 bytes of memory, more than a buffer's length can say.
    base = np.zeros(4)
    made = MadeTensor(data=base.__array_interface__["data"][0], device=(kDLCPU, 0), dtype=(kDLFloat, 64, 1),
                      shape=(1 << 31, 1 << 31), strides=(0, 0))
    view = dlpack2cai(made.capsule)
    with pytest.raises(BufferError, match="more bytes than a buffer can hold"):
        memoryview(view)


def test_a_shape_of_exactly_the_largest_buffer_length_is_a_buffer():
    """A buffer's length may be any Py_ssize_t: a broadcast byte (stride 0) 2**63 - 1 times, the largest length
    there is, is exported and read (a longer one is refused, above)."""
    base = np.array([7], dtype=np.uint8)
    made = MadeTensor(data=base.__array_interface__["data"][0], device=(kDLCPU, 0), dtype=(kDLUInt, 8, 1),
                      shape=(2**63 - 1,), strides=(0,))
    view = dlpack2cai(made.capsule)
    m = memoryview(view)
    assert (m.nbytes, m.shape, m.strides) == (2**63 - 1, (2**63 - 1,), (0,))
    assert m[0] == m[2**63 - 2] == 7


@pytest.mark.parametrize("strides", [(2**62,), (-(2**62),)], ids=["up", "down"])
def test_strides_past_the_address_space_are_refused_at_the_door(strides):
    base = np.zeros(4)
    # bytes (itemsize 1): four steps of 2**62 are 2**64, past any offset a 64-bit extent can hold
    made = MadeTensor(data=base.__array_interface__["data"][0], device=(kDLCPU, 0), dtype=(kDLUInt, 8, 1),
                      shape=(5,), strides=strides)
    with pytest.raises(BufferError, match="DLPack tensor shape and strides reach outside the address space"):
        dlpack2cai(made.capsule)
    assert made.deleted == 1


def test_element_count_past_64_bits_is_refused_at_the_door():
    base = np.zeros(4)
    made = MadeTensor(data=base.__array_interface__["data"][0], device=(kDLCPU, 0), dtype=(kDLFloat, 64, 1),
                      shape=(1 << 40, 1 << 30))
    with pytest.raises(BufferError, match="more elements than fit in 64 bits"):
        dlpack2cai(made.capsule)
    assert made.deleted == 1


def test_empty_tensor_with_null_data():
    made = MadeTensor(data=0, shape=(0, 4))
    view = dlpack2cai(made.capsule)
    assert memoryview(view).tobytes() == b""
    assert np.asarray(view).shape == (0, 4)


def test_empty_array_whose_byte_strides_overflow_reads_back():
    """Found by replaying the fuzz corpus: an empty array accepted by cai2dlpack has contiguous element
    strides that overflow in bytes; the view refused our own tensor until emptiness was checked first."""
    shape = (0, 61, 66, 463856467968, 44, 81)
    holder = type("Holder", (), {})()
    holder.__array_interface__ = {"shape": shape, "typestr": "<i2", "data": (8, False), "version": 3}
    view = dlpack2cai(cai2dlpack(holder))
    assert view.shape == shape and view.strides is None and view.__array_interface__["data"] == (0, False)


def test_a_views_array_interface_has_no_stream_key(cudart):
    """'stream' is a key of the CUDA array interface only: a view's __array_interface__ has the array interface's
    keys, of host memory and of pinned memory alike, while the same pinned view's __cuda_array_interface__ names the
    stream it was made for."""
    keys = {"shape", "typestr", "data", "strides", "version"}
    assert set(dlpack2cai(np.arange(6.0)).__array_interface__) == keys
    pinned = np.arange(6, dtype=np.float32)
    register(cudart, pinned, PINNED_HOST)
    cudart.add_stream(0x5000, 0)
    view = dlpack2cai(DLPackShim(CaiArray(pinned)), stream=0x5000)
    assert set(view.__array_interface__) == keys
    assert view.__cuda_array_interface__["stream"] == 0x5000
    np.testing.assert_array_equal(np.asarray(view), pinned)
