"""bfloat16, float8 and packed float4 across the bridge: torch tensors into NumPy as raw bytes a user
reinterprets with ml_dtypes, and back into torch with the exact type, bit for bit and in the same memory;
ml_dtypes arrays into torch; dtype= for what a typestr cannot name; the same through the C doors."""
import sys

import numpy as np
import pytest
from cai_dlpack import DLPackShim, UnsupportedArrayError, cai2dlpack, dlpack2cai
from support import c_example
from support.optional import TORCH_MISSING

torch = pytest.importorskip("torch", reason=TORCH_MISSING)

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes (a test extra) is not installed")

# torch's type, the raw-bits type of the same size, and ml_dtypes' type where it has the same layout.
TYPES = [
    (torch.bfloat16, torch.int16, ml_dtypes.bfloat16, "<V2"),
    (torch.float8_e4m3fn, torch.uint8, ml_dtypes.float8_e4m3fn, "|V1"),
    (torch.float8_e4m3fnuz, torch.uint8, ml_dtypes.float8_e4m3fnuz, "|V1"),
    (torch.float8_e5m2, torch.uint8, ml_dtypes.float8_e5m2, "|V1"),
    (torch.float8_e5m2fnuz, torch.uint8, ml_dtypes.float8_e5m2fnuz, "|V1"),
    (torch.float8_e8m0fnu, torch.uint8, ml_dtypes.float8_e8m0fnu, "|V1"),
    (torch.float4_e2m1fn_x2, torch.uint8, None, "|V1"),  # two values a byte: ml_dtypes' float4 is one a byte
]
LAYOUTS = {"contiguous": lambda t: t, "strided": lambda t: t[::2, 1:], "transposed": lambda t: t.t(),
           "empty": lambda t: t[:0], "zero_d": lambda t: t[1, 1]}


def make(dtype, bits_type):
    """Random bit patterns (finite values of every type) viewed as dtype."""
    return torch.randint(0, 120, (6, 5), dtype=bits_type).view(dtype)


@pytest.mark.parametrize("dtype,bits_type,ml_type,typestr", TYPES, ids=[str(t[0]) for t in TYPES])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_to_numpy_and_back_bit_exact(dtype, bits_type, ml_type, typestr, layout):
    t = LAYOUTS[layout](make(dtype, bits_type))
    view = dlpack2cai(t)
    name = str(dtype).removeprefix("torch.")
    iface = view.__array_interface__
    assert iface["typestr"] == typestr and iface["descr"] == [(name, typestr)]  # never labelled as another type
    a = np.asarray(view)
    assert a.dtype.kind == "V" and a.dtype.itemsize == t.element_size() and a.shape == t.shape
    if t.numel():
        assert a.__array_interface__["data"][0] == t.data_ptr()
        as_bits = a.view(np.uint16 if t.element_size() == 2 else np.uint8)
        assert np.array_equal(as_bits.view(np.int16) if bits_type == torch.int16 else as_bits,
                              t.view(bits_type).numpy())
        if ml_type is not None:
            same = a.view(ml_type)
            assert same.dtype == np.dtype(ml_type)
            assert np.array_equal(same.view(np.uint8 if t.element_size() == 1 else np.int16), t.view(bits_type).numpy())
    for back in (torch.from_dlpack(cai2dlpack(view)), torch.from_dlpack(DLPackShim(view)),
                 torch.from_dlpack(DLPackShim(a, dtype=dtype))):
        assert back.dtype == dtype and back.shape == t.shape
        if t.numel():
            assert back.data_ptr() == t.data_ptr()
            assert torch.equal(back.view(bits_type), t.view(bits_type))


ML_TO_TORCH = [(ml_dtypes.bfloat16, torch.bfloat16), (ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn),
               (ml_dtypes.float8_e4m3fnuz, torch.float8_e4m3fnuz), (ml_dtypes.float8_e5m2, torch.float8_e5m2),
               (ml_dtypes.float8_e5m2fnuz, torch.float8_e5m2fnuz), (ml_dtypes.float8_e8m0fnu, torch.float8_e8m0fnu)]


@pytest.mark.parametrize("ml_type,dtype", ML_TO_TORCH, ids=[t.__name__ for t, _ in ML_TO_TORCH])
@pytest.mark.parametrize("strided", [False, True])
def test_ml_dtypes_arrays_into_torch_without_being_told(ml_type, dtype, strided):
    a = np.linspace(0.5, 4, 24, dtype=np.float32).astype(ml_type).reshape(4, 6)
    if strided:
        a = a[::2, 1::3]  # positive strides: torch 2.13 aborts on negative DLPack strides
    t = torch.from_dlpack(DLPackShim(a))
    assert t.dtype == dtype and t.shape == a.shape and t.data_ptr() == a.__array_interface__["data"][0]
    assert np.array_equal(t.float().numpy(), a.astype(np.float32))
    assert torch.from_dlpack(cai2dlpack(a)).dtype == dtype


@pytest.mark.parametrize("requested", ["bfloat16", torch.bfloat16, ml_dtypes.bfloat16, np.dtype(ml_dtypes.bfloat16)],
                         ids=["name", "torch", "ml_dtypes type", "numpy dtype"])
def test_dtype_names_what_the_typestr_cannot(requested):
    bits = np.array([0x3F80, 0x4000, 0xC040], dtype=np.uint16)  # 1.0, 2.0, -3.0 in bfloat16
    t = torch.from_dlpack(cai2dlpack(bits, dtype=requested))
    assert t.dtype == torch.bfloat16 and t.tolist() == [1.0, 2.0, -3.0]
    assert t.data_ptr() == bits.__array_interface__["data"][0]
    assert torch.from_dlpack(DLPackShim(bits, dtype=requested)).tolist() == [1.0, 2.0, -3.0]


def test_a_dtype_request_keeps_no_reference_to_what_names_it():
    """dtype= given as a str, or as an object whose name is read, holds no reference once the call is over."""
    name = "".join(["bfloat", "16"])  # made at run time: neither interned nor a constant of the code

    class Named:
        def __init__(self, name):
            self.name = name

    named = Named("".join(["bfloat", "16"]))
    bits = np.zeros(3, np.uint16)
    before = sys.getrefcount(name), sys.getrefcount(named.name)
    for _ in range(100):
        cai2dlpack(bits, dtype=name)
        DLPackShim(bits, dtype=named)
    assert (sys.getrefcount(name), sys.getrefcount(named.name)) == before


class _NameRaises:
    """A dtype= object whose name cannot be read: its own error is the caller's to see."""

    @property
    def name(self):
        raise LookupError("this dtype's name cannot be read")


class _NameNotStr:
    """A dtype= object whose name is not a str and whose str() fails."""

    name = 7

    def __str__(self):
        raise LookupError("this dtype cannot be written")


@pytest.mark.parametrize("requested,message", [(_NameRaises(), "name cannot be read"),
                                               (_NameNotStr(), "cannot be written")])
def test_a_dtype_whose_name_fails_raises_its_own_error(requested, message):
    bits = np.zeros(3, np.uint16)
    with pytest.raises(LookupError, match=message):
        cai2dlpack(bits, dtype=requested)
    with pytest.raises(LookupError, match=message):
        DLPackShim(bits, dtype=requested)


def test_a_name_that_cannot_be_encoded_names_no_type():
    """A dtype name with a lone surrogate (no UTF-8 spelling) matches no row: refused as any unknown name, with
    the ValueError naming it, and nothing of the failed encoding left behind."""
    for request in (lambda: cai2dlpack(np.zeros(3, np.uint8), dtype="int8\ud800"),
                    lambda: DLPackShim(np.zeros(3, np.uint8), dtype="\ud800")):
        with pytest.raises(ValueError, match=r"dtype='(int8)?\\ud800' names no type") as raised:
            request()
        assert raised.value.__context__ is None


def test_mismatched_sizes_and_unknown_names_are_refused_by_name():
    with pytest.raises(ValueError, match=r"dtype=bfloat16 has 2-byte items but __array_interface__ 'typestr' '<f4' has 4"):
        cai2dlpack(np.zeros(3, np.float32), dtype="bfloat16")
    with pytest.raises(ValueError, match=r"dtype='float9' names no type"):
        cai2dlpack(np.zeros(3, np.uint8), dtype="float9")
    with pytest.raises(ValueError, match=r"dtype='float9' names no type"):
        DLPackShim(np.zeros(3, np.uint8), dtype="float9")
    # ml_dtypes' float4 holds one value a byte, which no DLPack type describes: refused, naming the typestr.
    with pytest.raises(UnsupportedArrayError, match=r"'typestr' '<V1' has no DLPack equivalent"):
        cai2dlpack(np.zeros(3, ml_dtypes.float4_e2m1fn))
    with pytest.raises(BufferError, match=r"'typestr' '\|V2' has no DLPack equivalent.*by name"):
        DLPackShim(np.zeros(3, "V2")).__dlpack__()  # bytes of no named type


def test_c_doors_carry_the_exact_type():
    example = c_example.build()
    a = np.ones(4, ml_dtypes.bfloat16)
    assert example.fill(a, -1)["dtype"] == (4, 16, 1)
    assert example.managed(a, -1)["dtype"] == (4, 16, 1)
    packed = torch.zeros(4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    assert example.fill(DLPackShim(dlpack2cai(packed)), -1)["dtype"] == (17, 4, 2)
    assert example.fill(DLPackShim(np.zeros(4, np.uint8), dtype=torch.float8_e5m2), -1)["dtype"] == (12, 8, 1)
    assert example.managed(dlpack2cai(torch.zeros(3, dtype=torch.float8_e4m3fn)), -1)["dtype"] == (10, 8, 1)


def test_what_a_view_hands_out_is_the_receivers_own():
    """Each interface dict a view hands out, its descr list included, belongs to its receiver: editing one (as a
    consumer may) changes no other view's type, and the next conversion still says bfloat16."""
    first = dlpack2cai(make(torch.bfloat16, torch.int16))
    handed = first.__array_interface__
    handed["descr"][0] = ("float16", "<V2")
    handed["descr"].append(("x", "|u1"))
    handed["typestr"] = "<f2"
    second = dlpack2cai(make(torch.bfloat16, torch.int16))
    for view in (first, second):
        assert view.__array_interface__["descr"] == [("bfloat16", "<V2")]
        assert view.__array_interface__["descr"] is not handed["descr"]
        assert torch.from_dlpack(DLPackShim(view)).dtype == torch.bfloat16
    assert isinstance(first.shape, tuple) and isinstance(first.strides, (tuple, type(None)))


class TorchInterface:
    """A torch tensor described as torch itself describes it in an array interface: bfloat16 is "<V2" with no
    descr, and the object's dtype is the torch.dtype."""

    def __init__(self, tensor):
        self.tensor = tensor
        self.dtype = tensor.dtype
        self.__array_interface__ = {"shape": tuple(tensor.shape), "typestr": "<V2" if tensor.element_size() == 2
                                    else "|V1", "data": (tensor.data_ptr(), False), "version": 3,
                                    "strides": tuple(s * tensor.element_size() for s in tensor.stride())}


@pytest.mark.parametrize("dtype,bits_type", [(torch.bfloat16, torch.int16), (torch.float8_e4m3fn, torch.uint8),
                                             (torch.float8_e5m2, torch.uint8)])
def test_the_objects_torch_dtype_names_the_type(dtype, bits_type):
    t = make(dtype, bits_type)
    back = torch.from_dlpack(DLPackShim(TorchInterface(t)))
    assert back.dtype == dtype and back.data_ptr() == t.data_ptr()
    assert torch.equal(back.view(bits_type), t.view(bits_type))


def test_a_dtype_that_names_nothing_known_is_refused():
    """Never a guess from the item size alone: a dtype object that is no NumPy dtype or torch.dtype, or a name
    whose size differs from the typestr's, names nothing."""
    t = make(torch.bfloat16, torch.int16)
    obj = TorchInterface(t)
    for dtype in (object(), "bfloat16", type("dtype", (), {"name": 3})(), torch.float8_e4m3fn):
        obj.dtype = dtype
        with pytest.raises(UnsupportedArrayError, match="'typestr' '<V2' has no DLPack equivalent"):
            DLPackShim(obj).__dlpack__()


@pytest.mark.parametrize("dtype,bits_type", [(torch.bfloat16, torch.int16), (torch.float8_e5m2, torch.uint8),
                                             (torch.float4_e2m1fn_x2, torch.uint8)])
def test_no_buffer_format_is_given_for_a_type_none_names(dtype, bits_type):
    """No struct format names these types, so a buffer consumer that asks for one is refused (mpi4py then reads
    __dlpack__, as it does the producer's own tensor); NumPy reads the interface, whose descr names the type."""
    t = make(dtype, bits_type)
    view = dlpack2cai(t)
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(BufferError, match=f"DLPackView of {name}: no buffer format names this type"):
        memoryview(view)
    a = np.asarray(view)
    assert a.dtype.names == (name,) and a.dtype.itemsize == t.element_size()
    assert a.__array_interface__["data"][0] == t.data_ptr()
    assert np.array_equal(a.view(np.int16 if bits_type == torch.int16 else np.uint8), t.view(bits_type).numpy())



class DescrNamedByNoStr:
    """An ml_dtypes array's interface whose descr names its one field with name (not a str); its dtype is the array's."""

    def __init__(self, array, name):
        self.array = array
        self.dtype = array.dtype
        self.__array_interface__ = dict(array.__array_interface__, descr=[(name, array.dtype.str)])


@pytest.mark.parametrize("name", [b"bfloat16", 7, ("bfloat16",)], ids=["bytes", "an int", "a tuple"])
def test_a_descr_whose_name_is_no_str_is_passed_over_for_the_objects_dtype(name):
    """Only a str names a type in a descr: any other name is passed over, and the object's own dtype names it
    (bfloat16 here), as if the descr named nothing."""
    a = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16)
    t = torch.from_dlpack(cai2dlpack(DescrNamedByNoStr(a, name)))
    assert t.dtype == torch.bfloat16
    assert t.data_ptr() == a.ctypes.data
