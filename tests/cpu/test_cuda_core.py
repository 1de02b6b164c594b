"""cuda.core's StridedMemoryView (SMV), NVIDIA's own CAI/DLPack view, both ways, on host memory (its views of
host data need no GPU): SMV reads our DLPackShim through __dlpack__ and our DLPackView through its interfaces;
dlpack2cai reads an SMV through its DLPack C exchange API. Every dtype both can name, strided, negative
strides, 0-d, empty and read-only data: the same address, shape, strides and values at both ends. And where
cai_dlpack does more than SMV (a copy on request, bfloat16 and float8), what each does with the same data."""
import ctypes

import numpy as np
import pytest

from cai_dlpack import DLPackShim, DLPackView, dlpack2cai
from support.dlpack_ctypes import read_capsule

try:
    from cuda.core.utils import StridedMemoryView
except ImportError:
    StridedMemoryView = None
try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

pytestmark = pytest.mark.skipif(
    StridedMemoryView is None,
    reason="cuda-core is not installed (a test extra on Linux CPython 3.10 to 3.15 and 3.14t, less 3.13: it has no "
           "3.13t wheel, and no marker tells 3.13t from 3.13)")
needs_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes is not installed (a test extra)")

# Every type both name: NumPy's, which SMV reads and writes as DLPack's; bfloat16 is ml_dtypes' (below).
DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
          "float64", "complex64", "complex128"]


def address(a):
    return a.__array_interface__["data"][0]


def values(dtype, shape=(3, 4)):
    count = int(np.prod(shape))
    return (np.arange(count) % 2 == 1 if dtype == "bool" else np.arange(1, count + 1).astype(dtype)).reshape(shape)


def read_only(a):
    a.flags.writeable = False
    return a


LAYOUTS = {
    "contiguous": lambda dtype: values(dtype),
    "strided": lambda dtype: values(dtype, (4, 6))[::2, 1::2],
    "negative strides": lambda dtype: values(dtype, (3, 4))[::-1, ::-2],
    "0-d": lambda dtype: values(dtype, ()),
    "empty": lambda dtype: values(dtype, (0, 3)),
    "read-only": lambda dtype: read_only(values(dtype)),
}


def element_strides(a):
    return tuple(stride // a.itemsize for stride in a.strides)


def check_smv_describes(smv, x):
    assert smv.shape == x.shape and smv.dtype == x.dtype and smv.readonly == (not x.flags.writeable)
    assert not smv.is_device_accessible
    if x.size:
        assert smv.ptr == address(x)
        assert smv.strides is None and x.flags.c_contiguous or smv.strides == element_strides(x)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_smv_from_dlpack_of_a_shim_is_the_same_memory(dtype, layout):
    x = LAYOUTS[layout](dtype)
    smv = StridedMemoryView.from_dlpack(DLPackShim(x), stream_ptr=-1)
    check_smv_describes(smv, x)
    assert np.array_equal(np.from_dlpack(smv), x)  # SMV's own export: the values are the source's


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dlpack2cai_of_an_smv_is_the_same_memory(dtype, layout):
    x = LAYOUTS[layout](dtype)
    smv = StridedMemoryView.from_dlpack(x, stream_ptr=-1)
    view = dlpack2cai(smv)
    assert view.shape == x.shape and view.read_only == (not x.flags.writeable)
    if x.size:
        assert view.__array_interface__["data"][0] == address(x)
    through = np.asarray(view)
    assert through.dtype == x.dtype and np.array_equal(through, x)
    if x.size and x.flags.writeable:
        through[(0,) * x.ndim] = x[(1,) * x.ndim] if x.ndim and x.shape[-1] > 1 else 0
        assert x[(0,) * x.ndim] == through[(0,) * x.ndim]  # a write through one end is seen at the other


def test_dlpack2cai_takes_an_smv_through_its_exchange_api_not_its_dunder_dlpack():
    calls = []

    class Counted(StridedMemoryView):
        def __dlpack__(self, *args, **kwargs):
            calls.append(kwargs)
            return super().__dlpack__(*args, **kwargs)

    class WithoutTable(Counted):  # the same view with no exchange table: __dlpack__ is the only door
        __dlpack_c_exchange_api__ = None

    x = np.arange(6.0)
    assert StridedMemoryView.__dlpack_c_exchange_api__ is not None
    view = dlpack2cai(Counted.from_dlpack(x, stream_ptr=-1))
    assert calls == [] and view.__array_interface__["data"][0] == address(x)
    view = dlpack2cai(WithoutTable.from_dlpack(x, stream_ptr=-1))
    assert len(calls) == 1 and view.__array_interface__["data"][0] == address(x)


def driver_missing():
    """The reason SMV cannot read an array interface here, or None: cuda.core 1.2.2's from_array_interface and
    from_cuda_array_interface load the CUDA driver (libcuda.so.1) for every view, host memory included."""
    try:
        StridedMemoryView.from_array_interface(np.zeros(1))
    except Exception as error:  # cuda.pathfinder's DynamicLibNotFoundError, or the driver's own error
        return (f"cuda.core's from_array_interface / from_cuda_array_interface call the CUDA driver (libcuda.so.1) "
                f"even for host memory, and so cannot look at a device pointer of the runtime double either: "
                f"{type(error).__name__}")
    return None


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["int32", "float64", "complex64"])
def test_smv_from_array_interface_of_a_view_is_the_same_memory(dtype, layout):
    reason = driver_missing()
    if reason:
        pytest.skip(reason)
    x = LAYOUTS[layout](dtype)
    check_smv_describes(StridedMemoryView.from_array_interface(dlpack2cai(x)), x)


def test_smv_from_any_interface_of_a_view_reads_it_without_a_driver():
    """What an SMV user calls without knowing the producer: it takes our view's __dlpack__ (no driver call)."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    view = dlpack2cai(x)
    assert isinstance(view, DLPackView)
    check_smv_describes(StridedMemoryView.from_any_interface(view, stream_ptr=-1), x)


@needs_ml_dtypes
def test_bfloat16_both_ways_smv_reads_ours_but_exports_none():
    x = np.arange(1, 7, dtype=ml_dtypes.bfloat16).reshape(2, 3)
    smv = StridedMemoryView.from_dlpack(DLPackShim(x), stream_ptr=-1)
    check_smv_describes(smv, x)
    with pytest.raises(BufferError, match="bfloat16"):
        dlpack2cai(smv)  # SMV exports no bfloat16
    view = dlpack2cai(DLPackShim(x))  # ours does, and a view hands it on
    assert view.__array_interface__["descr"] == [("bfloat16", "<V2")]
    assert np.array_equal(np.asarray(view).view(ml_dtypes.bfloat16), x)
    assert read_capsule(view.__dlpack__(max_version=(1, 0)))["dtype"] == (4, 16, 1)


@needs_ml_dtypes
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_float8_smv_refuses_what_cai_dlpack_hands_on(name):
    x = np.arange(4, dtype=np.float32).astype(getattr(ml_dtypes, name))
    smv = StridedMemoryView.from_dlpack(DLPackShim(x), stream_ptr=-1)
    assert smv.ptr == address(x)
    with pytest.raises(TypeError, match="Unsupported dtype"):
        smv.dtype  # SMV holds the tensor but cannot name its type
    view = dlpack2cai(DLPackShim(x))
    assert view.__array_interface__["data"][0] == address(x)
    assert view.__array_interface__["descr"] == [(name, "|V1")]


@pytest.mark.parametrize("request_", [dict(copy=True), dict(dl_device=(1, 0), copy=True)], ids=["copy", "to host"])
def test_a_copy_on_request_smv_refuses_cai_dlpack_makes_one(request_):
    x = np.arange(6.0)
    smv = StridedMemoryView.from_dlpack(x, stream_ptr=-1)
    with pytest.raises(BufferError, match="not supported"):
        smv.__dlpack__(max_version=(1, 0), **request_)
    capsule = dlpack2cai(smv).__dlpack__(max_version=(1, 0), **request_)  # owns its copy while it lives
    fields = read_capsule(capsule)
    assert fields["data"] != address(x)
    assert (ctypes.c_double * 6).from_address(fields["data"])[:] == x.tolist()
    del capsule
