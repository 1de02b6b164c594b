"""The CAI path without a GPU: the CUDA runtime double classifies pointers, NumPy consumes the result."""
import numpy as np
import pytest

import cai_dlpack
from cai_dlpack import CudaError, DLPackShim, cai2dlpack, dlpack2cai
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE, MANAGED, PINNED_HOST
from support.dlpack_ctypes import kDLCUDA, kDLCUDAHost, kDLCUDAManaged, read_capsule

DTYPES = ["?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"]
DL_DTYPES = {
    "?": (6, 8), "i1": (0, 8), "i2": (0, 16), "i4": (0, 32), "i8": (0, 64), "u1": (1, 8), "u2": (1, 16),
    "u4": (1, 32), "u8": (1, 64), "f2": (2, 16), "f4": (2, 32), "f8": (2, 64), "c8": (5, 64), "c16": (5, 128),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("versioned", [False, True])
def test_device_memory_fields(cudart, dtype, versioned):
    host = np.zeros((5, 7), dtype=dtype)
    register(cudart, host, DEVICE, device=3)
    x = host[1:, ::2]
    capsule = cai2dlpack(CaiArray(x), max_version=(1, 0) if versioned else None)
    fields = read_capsule(capsule)
    assert fields["name"] == ("dltensor_versioned" if versioned else "dltensor")
    assert fields["device"] == (kDLCUDA, 3)
    assert fields["data"] == x.__array_interface__["data"][0]
    assert fields["dtype"] == DL_DTYPES[dtype] + (1,)
    assert fields["shape"] == x.shape
    assert fields["strides"] == tuple(s // x.itemsize for s in x.strides)
    assert fields["byte_offset"] == 0 and fields["has_deleter"]
    if versioned:
        assert fields["version"] == cai_dlpack.DLPACK_VERSION and fields["flags"] == 0
    # The same fields through our own consumer.
    view = dlpack2cai(capsule)
    iface = view.__cuda_array_interface__
    assert iface["shape"] == x.shape and iface["typestr"] == x.dtype.str
    assert iface["data"] == (x.__array_interface__["data"][0], False)
    assert iface["strides"] == x.strides and iface["version"] == 3
    assert view.device == (kDLCUDA, 3)
    with pytest.raises(AttributeError):
        view.__array_interface__


@pytest.mark.parametrize("kind,device_type", [(PINNED_HOST, kDLCUDAHost), (MANAGED, kDLCUDAManaged)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pinned_and_managed_memory_into_numpy(cudart, kind, device_type, dtype):
    host = (np.arange(24) % 5).astype(dtype).reshape(4, 6)
    register(cudart, host, kind, device=1)
    producer = CaiArray(host[:, 1:5])
    shim = DLPackShim(producer)
    # DLPack: "for vanilla CPU memory, pinned memory, or managed memory, [device_id] is set to 0", whatever
    # device the allocation was made under (1 here).
    assert shim.__dlpack_device__() == (device_type, 0)
    assert read_capsule(shim.__dlpack__(max_version=(1, 0), dl_device=(device_type, 0)))["device"] == (device_type, 0)
    with pytest.raises(BufferError, match=rf"dl_device \({device_type}, 1\) differs from the data's device"):
        shim.__dlpack__(max_version=(1, 0), dl_device=(device_type, 1))
    y = np.from_dlpack(shim)
    assert y.__array_interface__["data"][0] == host[:, 1:].__array_interface__["data"][0]
    np.testing.assert_array_equal(y, host[:, 1:5])
    y[0, 0] = y[1, 1]
    assert host[0, 1] == host[1, 2]


def test_pinned_view_has_both_interfaces(cudart):
    host = np.arange(6, dtype=np.float32)
    register(cudart, host, PINNED_HOST)
    view = dlpack2cai(cai2dlpack(CaiArray(host)))
    assert view.__cuda_array_interface__["data"][0] == view.__array_interface__["data"][0]
    np.testing.assert_array_equal(np.asarray(view), host)


def test_dict_with_owner(cudart):
    host = np.arange(8, dtype=np.int16)
    register(cudart, host, DEVICE, device=2)
    iface = CaiArray(host).__cuda_array_interface__
    capsule = cai2dlpack(iface, owner=host)
    assert read_capsule(capsule)["device"] == (kDLCUDA, 2)


def test_zero_size_null_pointer_uses_current_device(cudart):
    cudart.current_device = 2
    capsule = cai2dlpack(CaiArray(np.zeros((0, 3), dtype=np.float32)))
    fields = read_capsule(capsule)
    assert fields["device"] == (kDLCUDA, 2) and fields["data"] == 0 and fields["shape"] == (0, 3)
    view = dlpack2cai(capsule)
    assert view.__cuda_array_interface__["data"] == (0, False)


def test_empty_view_is_c_contiguous_with_a_null_pointer(cudart):
    """An empty array exports data 0 (CAI v3) and strides None: CuPy sizes interface memory as the largest
    shape * stride, so spelled-out strides would make a (0, 6) array look 24 bytes long and CuPy would then ask
    the runtime about the null pointer."""
    host = np.zeros((4, 6), dtype=np.float32)
    register(cudart, host, DEVICE)
    capsule = cai2dlpack(CaiArray(host[:0]))
    fields = read_capsule(capsule)
    assert fields["strides"] == (6, 1)  # spelled out in the capsule
    iface = dlpack2cai(capsule).__cuda_array_interface__
    assert iface["data"] == (0, False) and iface["shape"] == (0, 6) and iface["strides"] is None


def test_zero_d(cudart):
    host = np.array(3.5)
    register(cudart, host, DEVICE)
    fields = read_capsule(cai2dlpack(CaiArray(host)))
    assert fields["ndim"] == 0 and fields["shape"] == ()


def test_read_only_cai(cudart):
    host = np.arange(4.0)
    register(cudart, host, MANAGED)
    producer = CaiArray(host, read_only=True)
    with pytest.raises(BufferError, match="read-only"):
        cai2dlpack(producer)
    fields = read_capsule(cai2dlpack(producer, max_version=(1, 0)))
    assert fields["flags"] & 1
    y = np.from_dlpack(DLPackShim(producer))
    assert not y.flags.writeable
    view = dlpack2cai(DLPackShim(producer))
    assert view.read_only and view.__cuda_array_interface__["data"][1] is True


def test_strides_none_become_c_contiguous(cudart):
    host = np.zeros((2, 3, 4), dtype=np.float64)
    register(cudart, host, DEVICE)
    fields = read_capsule(cai2dlpack(CaiArray(host, strides=None)))
    assert fields["strides"] == (12, 4, 1)


def test_round_trip_gives_back_the_same_dict(cudart):
    host = np.zeros((4, 6), dtype=np.complex64)
    register(cudart, host, DEVICE, device=1)
    x = host[::2, 1::2]
    original = CaiArray(x, stream=None).__cuda_array_interface__
    iface = dlpack2cai(cai2dlpack(original, owner=x), stream=-1).__cuda_array_interface__
    assert iface == original
    # A contiguous producer that says strides None comes back with the same strides spelled out.
    contiguous = CaiArray(host, strides=None).__cuda_array_interface__
    back = dlpack2cai(cai2dlpack(contiguous, owner=host), stream=-1).__cuda_array_interface__
    assert back == dict(contiguous, strides=host.strides)


def test_unregistered_pointer_is_refused(cudart):
    host = np.arange(3.0)
    with pytest.raises(BufferError, match="not memory the CUDA runtime knows"):
        cai2dlpack(CaiArray(host))


def test_pointer_query_error_raises_cuda_error_and_clears_it(cudart):
    host = np.arange(3.0)
    register(cudart, host, DEVICE)
    cudart.fail("cudaPointerGetAttributes", 1)
    with pytest.raises(CudaError, match="cudaPointerGetAttributes failed: cudaErrorInvalidValue") as info:
        cai2dlpack(CaiArray(host))
    assert info.value.code == 1 and info.value.name == "cudaErrorInvalidValue"
    assert info.value.call == "cudaPointerGetAttributes"
    assert cudart.last_error == 0  # a framework checking cudaGetLastError later sees no stale error
    assert read_capsule(cai2dlpack(CaiArray(host)))["device"] == (kDLCUDA, 0)


def test_current_device_query_error(cudart):
    cudart.fail("cudaGetDevice", 100)
    with pytest.raises(CudaError, match="cudaErrorNoDevice"):
        cai2dlpack(CaiArray(np.zeros(0)))


def test_cuda_runtime_info_reports_the_double(cudart):
    info = cai_dlpack.cuda_runtime_info()
    assert info["path"].endswith("libcudart_double.so")
    assert info["source"] == "CAI_DLPACK_CUDART" and info["file"] == info["path"]
    assert info["device_count"] == 4 and info["version"] == 13000


def test_dtype_none_and_the_other_keywords_leave_the_asked_type_alone():
    """dtype=None reads the interface's own type, whatever other keyword is given; a dtype= is applied whatever
    other keyword is given (dl_device=None, the data's own device, among them)."""
    bits = np.zeros(3, np.uint16)
    plain = read_capsule(cai2dlpack(bits, max_version=(1, 0)))
    assert plain["dtype"] == (1, 16, 1)
    for keywords in ({}, {"dl_device": None}, {"dl_device": (1, 0)}, {"copy": None}, {"stream": None}):
        assert read_capsule(cai2dlpack(bits, dtype=None, max_version=(1, 0), **keywords)) == plain
        asked = read_capsule(cai2dlpack(bits, dtype="bfloat16", max_version=(1, 0), **keywords))
        assert asked["dtype"] == (4, 16, 1) and asked["data"] == plain["data"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_asks_for_every_type_a_typestr_names_by_its_numpy_name(dtype):
    """dtype= names any type of the table by its NumPy name, or as a NumPy dtype, the first row (bool) as much as the
    last: raw bytes of the same item size are read as that type, where they are."""
    name = np.dtype(dtype).name
    raw = np.zeros(3, f"V{np.dtype(dtype).itemsize}")  # bytes no typestr names a type of
    for requested in (name, np.dtype(dtype)):
        asked = read_capsule(cai2dlpack(raw, dtype=requested, max_version=(1, 0)))
        assert asked["dtype"] == (*DL_DTYPES[dtype], 1), (name, asked["dtype"])
        assert asked["data"] == raw.ctypes.data


@pytest.mark.parametrize("max_version,name", [
    (None, "dltensor"), ((0, 0), "dltensor"), ((0, 8), "dltensor"),
    ((1, 0), "dltensor_versioned"), ((1, 9), "dltensor_versioned"), ((2, 0), "dltensor_versioned")])
def test_max_version_picks_the_capsule_a_consumer_of_that_version_reads(max_version, name):
    """The array API's max_version: a consumer of major version 0 (or one that names none) reads only the legacy
    "dltensor" capsule; major 1 or newer gets "dltensor_versioned" (of this producer's own version, at most 1.x).
    Each way in: cai2dlpack, and a shim's __dlpack__."""
    host = np.arange(6, dtype=np.float32)
    capsules = [cai2dlpack(host, max_version=max_version), DLPackShim(host).__dlpack__(max_version=max_version)]
    for capsule in capsules:
        fields = read_capsule(capsule)
        assert fields["name"] == name
        if name == "dltensor_versioned":
            assert fields["version"][0] == 1
