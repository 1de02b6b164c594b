"""The converters against real third-party peers on host memory: NumPy and PyTorch (CPU)."""
import re

import numpy as np
import pytest

import cai_dlpack
from cai_dlpack import DLPackShim, cai2dlpack, dlpack2cai
from support.optional import needs_torch, torch

DTYPES = ["?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"]
TORCH_DTYPES = [d for d in DTYPES if d not in ("u2", "u4", "u8")]  # torch's DLPack import refuses these


def sample(dtype, shape=(3, 4)):
    values = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    if dtype == "?":
        return (values % 2).astype(bool)
    if dtype.startswith("c"):
        return (values + 1j * values).astype(dtype)
    return values.astype(dtype)


def layouts(dtype):
    base = sample(dtype, (6, 8))
    return {
        "c_order": base,
        "f_order": np.asfortranarray(base),
        "sliced": base[1:5:2, ::3],
        "negative": base[::-1, ::-2],
        "broadcast": np.broadcast_to(base[:1], (5, 8)),
        "zero_d": np.array(base[2, 3]),
        "zero_size": base[:0],
        "one_d": base[2],
    }


def pointer(a):
    return a.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(layouts("f4")))
def test_numpy_through_shim_into_numpy(dtype, layout):
    x = layouts(dtype)[layout]
    y = np.from_dlpack(DLPackShim(x))
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(y, x)
    if x.size:
        assert pointer(y) == pointer(x)
        assert y.strides == x.strides or x.size <= 1


# torch 2.13 aborts the process on negative strides, from NumPy's own exporter too: not our case to test.
TORCH_LAYOUTS = [name for name in layouts("f4") if name != "negative"]


@needs_torch
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("layout", TORCH_LAYOUTS)
def test_numpy_through_shim_into_torch(dtype, layout):
    x = layouts(dtype)[layout]
    t = torch.from_dlpack(DLPackShim(x))
    assert tuple(t.shape) == x.shape
    np.testing.assert_array_equal(t.numpy(), x)
    if x.size:
        assert t.data_ptr() == pointer(x)
        assert tuple(s * x.itemsize for s in t.stride()) == x.strides or x.size <= 1


@needs_torch
def test_writes_are_visible_both_ways():
    x = np.zeros((4, 5), dtype=np.float32)[:, 1:]
    t = torch.from_dlpack(DLPackShim(x))
    t[1, 2] = 7.0
    assert x[1, 2] == 7.0
    x[3, 0] = -1.0
    assert t[3, 0].item() == -1.0
    y = np.from_dlpack(DLPackShim(x))
    y[0, 0] = 5.0
    assert t[0, 0].item() == 5.0


def test_read_only_array_gives_read_only_numpy():
    x = np.arange(6.0)
    x.flags.writeable = False
    y = np.from_dlpack(DLPackShim(x))
    assert not y.flags.writeable
    assert pointer(y) == pointer(x)
    np.testing.assert_array_equal(y, x)


def test_read_only_array_refuses_legacy_capsule():
    x = np.arange(6.0)
    x.flags.writeable = False
    with pytest.raises(BufferError, match="read-only"):
        cai2dlpack(x)
    with pytest.raises(BufferError, match="read-only"):
        DLPackShim(x).__dlpack__()
    assert cai2dlpack(x, max_version=(1, 0)) is not None


@needs_torch
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_tensor_through_dlpack2cai_into_numpy(dtype):
    x = sample(dtype, (5, 6))
    t = torch.from_numpy(x.copy())[1:, ::2]
    view = dlpack2cai(t)
    a = np.asarray(view)
    assert a.shape == tuple(t.shape)
    np.testing.assert_array_equal(a, t.numpy())
    assert pointer(a) == t.data_ptr()
    a[0, 0] = a[1, 1]
    assert t[0, 0].item() == t[1, 1].item()


@needs_torch
def test_torch_capsule_legacy_and_versioned():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    for capsule in (t.__dlpack__(), t.__dlpack__(max_version=(1, 0))):
        view = dlpack2cai(capsule)
        assert view.shape == (3, 4) and view.typestr == "<f4" and view.device == (1, 0)
        assert np.asarray(view).tolist() == t.tolist()


def test_view_has_no_cai_for_host_memory():
    view = dlpack2cai(np.arange(3))
    with pytest.raises(AttributeError, match="host memory"):
        view.__cuda_array_interface__
    assert not hasattr(view, "__cuda_array_interface__")
    iface = view.__array_interface__
    assert iface["version"] == 3 and "stream" not in iface


@needs_torch
def test_view_hands_on_through_dlpack():
    x = np.arange(10, dtype=np.int32)[::3]
    view = dlpack2cai(x)
    t = torch.from_dlpack(view)
    assert t.data_ptr() == pointer(x) and t.tolist() == x.tolist()
    y = np.from_dlpack(view)
    assert pointer(y) == pointer(x)
    assert view.__dlpack_device__() == (1, 0)


def test_array_interface_with_buffer_data():
    class Image:
        def __init__(self):
            self.payload = bytes(range(24))

        @property
        def __array_interface__(self):
            return {"shape": (2, 3, 4), "typestr": "|u1", "data": self.payload, "version": 3}

    image = Image()
    y = np.from_dlpack(DLPackShim(image))
    np.testing.assert_array_equal(y, np.arange(24, dtype=np.uint8).reshape(2, 3, 4))
    assert not y.flags.writeable  # bytes are immutable


def test_array_interface_with_offset_and_bounds():
    buffer = bytearray(range(16))

    class Holder:
        def __init__(self, iface):
            self.__array_interface__ = iface

    ok = Holder({"shape": (3,), "typestr": "|u1", "data": buffer, "offset": 4, "version": 3})
    assert np.from_dlpack(DLPackShim(ok)).tolist() == [4, 5, 6]
    past_end = Holder({"shape": (13,), "typestr": "|u1", "data": buffer, "offset": 4, "version": 3})
    with pytest.raises(ValueError, match="buffer of 16 bytes"):
        cai2dlpack(past_end)


@pytest.mark.parametrize("shape,strides,offset,expected", [
    ((8,), None, 0, list(range(8))),  # the whole buffer, to its last byte
    ((9,), None, 0, "bytes [0, 9) of a buffer of 8 bytes"),
    ((4,), None, 4, [4, 5, 6, 7]),  # from the offset to the end
    ((5,), None, 4, "bytes [4, 9) of a buffer of 8 bytes"),
    ((4,), (-1,), 3, [3, 2, 1, 0]),  # backwards from the offset to the first byte
    ((5,), (-1,), 3, "bytes [-1, 4) of a buffer of 8 bytes"),
    ((2, 2), (6, 1), 0, [[0, 1], [6, 7]]),  # strided, its last element the buffer's last byte
    ((2, 2), (7, 1), 0, "bytes [0, 9) of a buffer of 8 bytes"),
    ((0,), None, 8, []),  # nothing read, at the buffer's end
])
def test_array_interface_buffer_bounds_to_the_byte(shape, strides, offset, expected):
    """An __array_interface__ over a buffer may reach every byte of it and not one more, either way."""
    class Holder:
        def __init__(self, iface):
            self.__array_interface__ = iface

    obj = Holder({"shape": shape, "strides": strides, "typestr": "|u1", "data": bytearray(range(8)),
                  "offset": offset, "version": 3})
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=re.escape(f"'shape', 'strides' and 'offset' reach {expected}")):
            cai2dlpack(obj)
    else:
        assert np.from_dlpack(DLPackShim(obj)).tolist() == expected


def test_dlpack_version_constant():
    assert cai_dlpack.DLPACK_VERSION >= (1, 1)
    capsule = cai2dlpack(np.arange(3), max_version=(1, 0))
    from support.dlpack_ctypes import read_capsule

    assert read_capsule(capsule)["version"] == cai_dlpack.DLPACK_VERSION
