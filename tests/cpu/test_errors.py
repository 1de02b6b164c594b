"""Every refusal: the exception type, and a message that names the key and the value."""
import os
import re
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

import cai_dlpack
from cai_dlpack import DLPackShim, DLPackView, UnsupportedArrayError, cai2dlpack, dlpack2cai
from support.cuda_double import DEVICE
from support.fresh_process import run_with_double
from support.optional import tvm_ffi
from support.dlpack_ctypes import (MadeTensor, kDLBfloat, kDLCPU, kDLCUDA, kDLFloat, kDLOpaqueHandle, kDLROCM,
                                  read_capsule)

HOST = np.arange(12, dtype=np.float32)
POINTER = HOST.__array_interface__["data"][0]


def cai(**changes):
    iface = {"shape": (12,), "typestr": "<f4", "data": (POINTER, False), "version": 3}
    for key, value in changes.items():
        if value is KeyError:
            del iface[key]
        else:
            iface[key] = value
    return iface


@pytest.fixture
def device_host(cudart):
    cudart.add_region(POINTER, HOST.nbytes, DEVICE, 0)
    return HOST


CASES = [
    # (changes, exception, message fragment)
    (dict(version=KeyError), ValueError, "lacks the required key 'version'"),
    (dict(shape=KeyError), ValueError, "lacks the required key 'shape'"),
    (dict(typestr=KeyError), ValueError, "lacks the required key 'typestr'"),
    (dict(data=KeyError), ValueError, "lacks the required key 'data'"),
    (dict(version=4), ValueError, "'version' is 4"),
    (dict(version=-1), ValueError, "'version' is -1"),
    (dict(version="3"), TypeError, "'version' must be an int, not str"),
    (dict(version=True), TypeError, "'version' must be an int, not bool"),
    (dict(shape=[12]), None, None),
    (dict(shape=12), TypeError, "'shape' must be a tuple of ints, not int"),
    (dict(shape=(3, -4)), ValueError, "'shape'[1] is -4"),
    (dict(shape=(3, True)), TypeError, "'shape'[1] must be an int, not bool"),
    (dict(shape=(3, 4.0)), TypeError, "'shape'[1] must be an int, not float"),
    (dict(shape=(2**63,)), ValueError, "'shape'[0] is 9223372036854775808"),
    (dict(shape=(2**32, 2**32)), ValueError, "more elements than fit in 64 bits"),
    # Both the count and the extent overflow: the count is named.
    (dict(shape=(2**32, 2**32), strides=(2**62, 4)), ValueError, "more elements than fit in 64 bits"),
    # An empty array reaches no byte, however far its strides would step.
    (dict(shape=(0, 2**62), strides=(4, 2**62), data=(0, False)), None, None),
    (dict(shape=(1,) * 65), ValueError, "'shape' has 65 entries"),
    (dict(shape=(2**62,)), ValueError, "outside the address space"),
    (dict(typestr=">f4"), ValueError, "'typestr' '>f4' has non-native byte order"),
    (dict(typestr="<f16"), ValueError, "'typestr' '<f16' has no DLPack equivalent"),
    (dict(typestr=">f" if sys.byteorder == "little" else "<f"), ValueError, "has no DLPack equivalent"),  # too short
    (dict(typestr="|O8"), ValueError, "'typestr' '|O8' has no DLPack equivalent"),
    # No kind 'd': its 1-byte entry of the (kind, item size) index lies next to complex128's ('c', 16 bytes).
    (dict(typestr="|d1"), ValueError, "'typestr' '|d1' has no DLPack equivalent"),
    (dict(typestr="<U4"), ValueError, "'typestr' '<U4'"),
    (dict(typestr="|V8"), ValueError, "'typestr' '|V8'"),
    (dict(typestr="<M8"), ValueError, "'typestr' '<M8'"),
    (dict(typestr="<m8"), ValueError, "'typestr' '<m8'"),
    (dict(typestr="|S4"), ValueError, "'typestr' '|S4'"),
    (dict(typestr="f4"), ValueError, "'typestr' 'f4'"),
    (dict(typestr=b"<f4"), TypeError, "'typestr' must be a str, not bytes"),
    (dict(data=POINTER), TypeError, "'data' must be a (pointer, read_only) tuple, not int"),
    (dict(data=(POINTER,)), ValueError, "'data' must be a (pointer, read_only) pair"),
    (dict(data=(POINTER, 0)), TypeError, "'data'[1] (read-only) must be a bool, not int"),
    (dict(data=(float(POINTER), False)), TypeError, "'data'[0] (the pointer) must be an int, not float"),
    (dict(data=(-16, False)), ValueError, "'data'[0] is -16"),
    (dict(data=(2**64, False)), ValueError, "'data'[0] is 18446744073709551616"),
    (dict(data=(0, False)), ValueError, "'data' pointer is 0 (NULL) but the array has 12 elements"),
    (dict(data=(2**64 - 8, False)), ValueError, "outside the address space"),
    (dict(strides=(6,)), ValueError, "'strides'[0] is 6 bytes, not a multiple of the itemsize 4"),
    (dict(strides=(4, 4)), ValueError, "'strides' has 2 entries but 'shape' has 1"),
    (dict(strides=4), TypeError, "'strides' must be a tuple of ints, not int"),
    (dict(strides=(4.0,)), TypeError, "'strides'[0] must be an int, not float"),
    (dict(strides=(2**62,)), ValueError, "outside the address space"),
    (dict(strides=(-(2**62),)), ValueError, "outside the address space"),
    # The lowest byte offset is exactly INT64_MIN: found by the C fuzzer (UBSan: negating it overflowed).
    (dict(shape=(2,), strides=(-(2**63),)), ValueError, "outside the address space"),
    (dict(mask=np.ones(12, bool)), BufferError, "'mask' is set"),
    (dict(mask=None), None, None),
    (dict(stream=0), ValueError, "'stream' 0 is not a valid stream"),
    (dict(stream="s"), TypeError, "'stream' must be None or an int, not str"),
]


def case_id(changes):
    """A case's id, the same in every run: the host array's address (where the allocator put it) named, not shown."""
    return repr(changes).replace(repr(float(POINTER)), "float(POINTER)").replace(str(POINTER), "POINTER")[:60]


@pytest.mark.parametrize("changes,error,message", CASES, ids=[case_id(c[0]) for c in CASES])
def test_cai_dict_errors(device_host, changes, error, message):
    iface = cai(**changes)
    if error is None:
        assert cai2dlpack(iface, owner=HOST) is not None
        return
    with pytest.raises(error) as info:
        cai2dlpack(iface, owner=HOST)
    assert message in str(info.value)
    if "'" in message.split(" ")[0] or message.startswith("lacks"):
        assert "__cuda_array_interface__" in str(info.value)


def test_subclasses_of_dict_tuple_int_are_accepted(device_host):
    class Dict(dict):
        pass

    class Tuple(tuple):
        pass

    class Int(int):
        pass

    iface = Dict(cai(shape=Tuple((Int(3), Int(4))), data=(Int(POINTER), False), version=Int(3)))
    assert cai2dlpack(iface, owner=HOST) is not None


def test_not_a_dict():
    class Bad:
        __cuda_array_interface__ = [("shape", (1,))]

    with pytest.raises(TypeError, match="__cuda_array_interface__ must be a dict, not list"):
        cai2dlpack(Bad())


def test_property_that_raises_propagates():
    class Broken:
        @property
        def __cuda_array_interface__(self):
            raise RuntimeError("device lost")

    with pytest.raises(RuntimeError, match="device lost"):
        cai2dlpack(Broken())
    with pytest.raises(RuntimeError, match="device lost"):
        DLPackShim(Broken()).__dlpack__()


def test_object_without_any_interface():
    with pytest.raises(TypeError, match="object of type int has neither __cuda_array_interface__ nor __array_interface__"):
        cai2dlpack(5)
    with pytest.raises(TypeError, match="neither"):
        DLPackShim(object()).__dlpack_device__()


def test_dict_needs_owner_and_objects_refuse_one(device_host):
    with pytest.raises(TypeError, match="needs owner="):
        cai2dlpack(cai())
    with pytest.raises(TypeError, match="owner= is only for a CAI dict"):
        cai2dlpack(HOST, owner=HOST)
    with pytest.raises(TypeError, match="not a bare interface dict"):
        DLPackShim(cai())


def test_array_interface_errors():
    with pytest.raises(TypeError, match=r"__cuda_array_interface__ 'data' must be a \(pointer, read_only\) tuple, not NoneType"):
        cai2dlpack(cai(data=None), owner=HOST)  # a dict is a CAI dict: 'data' must be a tuple

    class NonContiguous:
        def __init__(self):
            self.__array_interface__ = {"shape": (2,), "typestr": "<f8", "data": memoryview(np.zeros(4))[::2],
                                        "version": 3}

    with pytest.raises(ValueError, match="not contiguous"):
        cai2dlpack(NonContiguous())

    class BadOffset:
        def __init__(self):
            self.__array_interface__ = {"shape": (2,), "typestr": "|u1", "data": b"abcd", "offset": -1,
                                        "version": 3}

    with pytest.raises(ValueError, match="'offset' is -1"):
        cai2dlpack(BadOffset())


def test_array_interface_with_data_none_uses_the_objects_buffer():
    class Buffered(bytearray):
        @property
        def __array_interface__(self):
            return {"shape": (len(self),), "typestr": "|u1", "data": None, "version": 3}

    b = Buffered(b"\x01\x02\x03")
    y = np.from_dlpack(DLPackShim(b))
    assert y.tolist() == [1, 2, 3]
    y[0] = 9
    assert b[0] == 9


def test_array_interface_without_data_uses_the_objects_buffer():
    """NumPy reads a missing 'data' as None: the object's own buffer."""
    class Buffered(bytearray):
        @property
        def __array_interface__(self):
            return {"shape": (len(self) // 2,), "typestr": "<u2", "version": 3}

    b = Buffered(b"\x01\x00\x02\x00")
    for y in (np.from_dlpack(DLPackShim(b)), np.asarray(dlpack2cai(cai2dlpack(b)))):
        assert y.tolist()[1:] == [2]
        y[0] = y[0] + 7
        assert b[0] == y[0]  # the same memory
    with pytest.raises(ValueError, match="__cuda_array_interface__ lacks the required key 'data'"):
        cai2dlpack({"shape": (2,), "typestr": "<u2", "version": 3}, owner=b)


def test_strides_of_dimensions_of_extent_one_may_be_any_bytes():
    """A stride on a dimension of extent 1 (or 0) is never used: NumPy exports views whose such strides are no
    multiple of the itemsize, and so does the bridge, through the buffer and through the interface."""
    base = np.arange(40, dtype=np.uint8)
    odd = np.lib.stride_tricks.as_strided(base[1:].view(np.uint8), shape=(1, 2), strides=(17, 8))
    x = np.lib.stride_tricks.as_strided(np.zeros(16, np.float32), shape=(1, 2), strides=(17, 8))
    x[0, 1] = 5.0
    assert np.from_dlpack(x).tolist() == [[0.0, 5.0]]  # NumPy's own exporter takes it
    holder = type("Holder", (), {})()
    holder.__array_interface__ = x.__array_interface__
    for source in (x, holder):
        for y in (np.from_dlpack(DLPackShim(source)), np.asarray(dlpack2cai(cai2dlpack(source)))):
            assert y.tolist() == [[0.0, 5.0]]
            assert y.__array_interface__["data"][0] == x.__array_interface__["data"][0]
    empty = np.lib.stride_tricks.as_strided(np.zeros(4, np.float32), shape=(0, 2), strides=(3, 4))
    assert np.from_dlpack(DLPackShim(empty)).shape == (0, 2)
    with pytest.raises(ValueError, match="'strides'\\[1\\] is 6 bytes, not a multiple of the itemsize 4"):
        cai2dlpack(np.lib.stride_tricks.as_strided(np.zeros(8, np.float32), shape=(1, 2), strides=(17, 6)))
    del odd


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(copy="yes"), TypeError, "copy must be None or a bool"),
    (dict(dl_device=(2, 0)), BufferError, "dl_device (2, 0) differs from the data's device (1, 0)"),
    (dict(dl_device="cpu"), TypeError, "dl_device must be None or a (device_type, device_id) tuple"),
    (dict(max_version=1), TypeError, "max_version must be None or a (major, minor) tuple"),
    (dict(max_version=(1,)), TypeError, "max_version"),
    (dict(max_version=(1, 0, 0)), TypeError, "max_version must be None or a (major, minor) tuple of ints, not (1, 0, 0)"),
    (dict(max_version=("1", 0)), TypeError, "max_version must be None or a (major, minor) tuple of ints, not ('1', 0)"),
    (dict(max_version=(1, 0.5)), TypeError, "max_version must be None or a (major, minor) tuple of ints, not (1, 0.5)"),
    (dict(max_version=(2**64, 0)), OverflowError, "too large to convert to C long"),
    (dict(colour=1), TypeError, "unexpected keyword argument 'colour'"),
])
def test_dlpack_argument_errors(kwargs, error, message):
    shim = DLPackShim(np.arange(3))
    with pytest.raises(error) as info:
        shim.__dlpack__(**kwargs)
    assert message in str(info.value)
    view = dlpack2cai(np.arange(3))
    with pytest.raises(error):
        view.__dlpack__(**kwargs)


def capsule_name(capsule):
    import ctypes

    ctypes.pythonapi.PyCapsule_GetName.restype = ctypes.c_char_p
    ctypes.pythonapi.PyCapsule_GetName.argtypes = [ctypes.py_object]
    return ctypes.pythonapi.PyCapsule_GetName(capsule).decode()


@pytest.mark.parametrize("major,versioned", [(1, True), (0, False), (2, True), (True, True), (False, False),
                                             (2**40, True), (-(2**40), False), (-1, False)])
def test_max_version_names_the_capsule_whichever_way_it_comes(major, versioned):
    """max_version alone (torch.from_dlpack's call for host memory), by the interned keyword or a str of its
    own, with other keywords, its major an int of one digit, of several, or a bool: its major alone decides
    between the versioned capsule and the legacy one."""
    expected = "dltensor_versioned" if versioned else "dltensor"
    shim = DLPackShim(np.arange(3))
    keyword = "".join(["max_", "version"])  # equal text, another str object
    for kwargs in ({"max_version": (major, 0)}, {keyword: (major, 0)}, {"max_version": (major, 0), "stream": None},
                   {"copy": False, "max_version": (major, 0)}):
        assert capsule_name(shim.__dlpack__(**kwargs)) == expected, kwargs


class VersionPair(tuple):
    """A tuple subclass, as a namedtuple is: read as the tuple it is."""


@pytest.mark.parametrize("max_version,versioned", [
    ((1, True), True), ((1, 2**70), True), ((0, 2**70), False), ((1, -1), True), (VersionPair((1, 0)), True),
    (VersionPair((0, 8)), False), ((-5, 0), False)])
def test_max_version_minor_is_only_checked_to_be_an_int(max_version, versioned):
    """The major alone decides; the minor is checked to be an int (a bool, a big or negative one included) and
    never read, and a tuple subclass is a tuple: the same whether max_version comes alone (torch's call, read
    inline) or beside another keyword (the general parse), through a shim and through cai2dlpack."""
    expected = "dltensor_versioned" if versioned else "dltensor"
    x = np.arange(3)
    calls = (lambda: DLPackShim(x).__dlpack__(max_version=max_version),
             lambda: DLPackShim(x).__dlpack__(max_version=max_version, stream=None),
             lambda: cai2dlpack(x, max_version=max_version))
    for call in calls:
        assert capsule_name(call()) == expected, max_version


def test_copy_takes_a_truth_value_as_numpy_does():
    """NumPy's __dlpack__ reads copy by its truth value: a NumPy bool_ or 0-d array works, an array of several
    values raises its own ValueError; a str is never read as True."""
    x = np.arange(4.0)
    for value, copies in ((np.False_, False), (np.array(False), False), (np.True_, True), (0, False)):
        y = np.asarray(dlpack2cai(DLPackShim(x).__dlpack__(copy=value, max_version=(1, 0))))
        assert np.shares_memory(x, y) is not copies and y.tolist() == x.tolist()
    with pytest.raises(ValueError, match="truth value of an array with more than one element is ambiguous"):
        DLPackShim(x).__dlpack__(copy=np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="truth value"):
        x.__dlpack__(copy=np.array([1, 2, 3]))  # NumPy's own exporter says the same
    for value in ("yes", b"", object(), [True]):
        with pytest.raises(TypeError, match="copy must be None or a bool"):
            DLPackShim(x).__dlpack__(copy=value)


def test_dlpack_accepts_matching_device_and_copy_false():
    shim = DLPackShim(np.arange(3))
    assert shim.__dlpack__(dl_device=(1, 0), copy=False, max_version=(1, 0)) is not None
    with pytest.raises(TypeError, match="positional"):
        shim.__dlpack__(None)
    with pytest.raises(TypeError, match="takes 0 positional arguments but 1 were given"):
        shim.__dlpack__(None, max_version=(1, 0))  # torch's keyword, with a positional argument besides


def test_positional_and_keyword_errors_of_functions():
    with pytest.raises(TypeError, match="takes 1 positional argument but 0 were given"):
        cai2dlpack()
    with pytest.raises(TypeError, match="unexpected keyword argument 'streams'"):
        dlpack2cai(np.arange(2), streams=1)
    with pytest.raises(TypeError, match="cannot create"):
        DLPackView()


SHIM_ARGUMENT_ERRORS = [
    ((), {}, "missing required argument 'obj'"),
    ((), {"dtype": "float32"}, "missing required argument 'obj'"),
    ((np.arange(2), np.arange(2)), {}, "takes at most 1 positional argument"),
    ((np.arange(2),), {"obj": np.arange(2)}, "by name .'obj'. and position"),
    ((np.arange(2),), {"dtypes": "float32"}, "keyword argument.*'dtypes'|'dtypes'.*keyword argument"),
    (({},), {}, "not a bare interface dict"),
]


class ShimSubclass(DLPackShim):
    """Made through tp_new (a subclass does not inherit the type's vectorcall)."""


@pytest.mark.parametrize("shim_type", [DLPackShim, ShimSubclass])
@pytest.mark.parametrize("args,kwargs,message", SHIM_ARGUMENT_ERRORS, ids=[m for _, _, m in SHIM_ARGUMENT_ERRORS])
def test_shim_constructor_argument_errors(shim_type, args, kwargs, message):
    with pytest.raises(TypeError, match=message):
        shim_type(*args, **kwargs)


@pytest.mark.parametrize("shim_type", [DLPackShim, ShimSubclass])
def test_shim_constructor_takes_obj_and_dtype_by_position_or_name(shim_type):
    x = np.arange(3, dtype=np.uint16)
    for shim in (shim_type(x), shim_type(obj=x), shim_type(x, dtype=None), shim_type(dtype="float16", obj=x)):
        assert type(shim) is shim_type and shim.obj is x
    assert np.from_dlpack(shim_type(x, dtype="float16")).dtype == np.float16
    assert np.from_dlpack(shim_type(obj=x)).dtype == np.uint16
    with pytest.raises(ValueError, match="dtype=float32 has 4-byte items but .* '<u2' has 2-byte items"):
        shim_type(obj=x, dtype="float32").__dlpack__()


# ---- DLPack -> CAI refusals -------------------------------------------------------------------------

def test_not_a_dlpack_source():
    with pytest.raises(TypeError, match="expected a DLPack capsule or an object with __dlpack__, not int"):
        dlpack2cai(3)


def test_foreign_capsule():
    import ctypes

    ctypes.pythonapi.PyCapsule_New.restype = ctypes.py_object
    ctypes.pythonapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    other = ctypes.pythonapi.PyCapsule_New(8, b"something_else", None)
    with pytest.raises(TypeError, match="named something_else is not a DLPack tensor"):
        dlpack2cai(other)


def test_nameless_capsule():
    """PyCapsule_GetName answers NULL without an error for a capsule with no name: still a TypeError, never a
    SystemError (a NULL return with nothing set)."""
    import ctypes

    ctypes.pythonapi.PyCapsule_New.restype = ctypes.py_object
    ctypes.pythonapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    nameless = ctypes.pythonapi.PyCapsule_New(8, None, None)
    for call in (lambda: dlpack2cai(nameless), lambda: np.asarray(dlpack2cai(nameless))):
        with pytest.raises(TypeError, match="a PyCapsule without a name is not a DLPack tensor"):
            call()


def test_used_capsule_is_refused():
    capsule = cai2dlpack(np.arange(3))
    dlpack2cai(capsule)
    with pytest.raises(BufferError, match="already consumed"):
        dlpack2cai(capsule)


def test_dlpack_that_returns_no_capsule():
    class Liar:
        def __dlpack__(self, stream=None, max_version=None):
            return 42

    with pytest.raises(TypeError, match="returned int, not a PyCapsule"):
        dlpack2cai(Liar())


def test_old_producer_is_retried_without_max_version():
    calls = []

    class Old:
        def __dlpack__(self, stream=None):
            calls.append(stream)
            return cai2dlpack(np.arange(4))

    view = dlpack2cai(Old())
    assert calls == [None] and view.shape == (4,)


BAD_TENSORS = [
    (dict(dtype=(kDLFloat, 32, 4)), "code=2, bits=32, lanes=4"),
    (dict(dtype=(kDLBfloat, 16, 2)), "code=4, bits=16, lanes=2"),
    (dict(dtype=(15, 6, 1)), "code=15, bits=6, lanes=1"),  # float6: not whole bytes
    (dict(dtype=(17, 4, 1)), "code=17, bits=4, lanes=1"),  # a lone float4: half a byte
    (dict(dtype=(kDLOpaqueHandle, 64, 1)), "code=3, bits=64, lanes=1"),
    (dict(dtype=(kDLFloat, 8, 1)), "code=2, bits=8, lanes=1"),
    (dict(device=(kDLROCM, 0)), "device type 10"),
    (dict(shape=(2, -3)), "shape[1] is -3"),
    (dict(shape=(2,), ndim=-1), "ndim -1"),
    (dict(shape=(1,), ndim=65), "ndim 65"),
    (dict(shape=(2,), null_shape=True), "no shape"),
    (dict(version=(2, 0)), "version 2.0"),
    (dict(shape=(2,), strides=(2**62,), dtype=(kDLFloat, 64, 1)), "overflows in bytes"),
]


@pytest.mark.parametrize("versioned", [True, False])
@pytest.mark.parametrize("fields,message", BAD_TENSORS, ids=[m for _, m in BAD_TENSORS])
def test_bad_dlpack_tensors_are_refused_and_deleted_once(fields, message, versioned):
    if "version" in fields and not versioned:
        pytest.skip("a legacy capsule has no version field")
    made = MadeTensor(data=HOST.__array_interface__["data"][0], versioned=versioned, **fields)
    with pytest.raises(BufferError) as info:
        dlpack2cai(made.capsule)
    assert message in str(info.value)
    assert made.deleted == 1
    with pytest.raises(BufferError, match="already consumed"):
        dlpack2cai(made.capsule)
    assert made.deleted == 1


@pytest.mark.parametrize("versioned", [True, False])
@pytest.mark.parametrize("byte_offset", [0, 64])
def test_null_data_with_elements_is_refused(versioned, byte_offset):
    """A tensor with elements must name memory: a NULL data pointer would reach consumers as a valid one (a
    buffer consumer would read address 0 + byte_offset). An empty tensor may have NULL (test_view_buffer)."""
    made = MadeTensor(data=0, shape=(2, 3), byte_offset=byte_offset, versioned=versioned)
    with pytest.raises(BufferError,
                       match=rf"data is NULL \(byte_offset {byte_offset}\) but the tensor has 6 elements"):
        dlpack2cai(made.capsule)
    assert made.deleted == 1


@pytest.mark.parametrize("shape", [(4,), (0,)], ids=["with elements", "empty"])
def test_data_plus_byte_offset_that_wraps_is_refused(shape):
    """data + byte_offset past 2**64 wraps to an unrelated low address, which the view would hand out."""
    data = HOST.__array_interface__["data"][0]
    byte_offset = 2**64 - data + 16
    made = MadeTensor(data=data, shape=shape, byte_offset=byte_offset)
    with pytest.raises(BufferError) as info:
        dlpack2cai(made.capsule)
    assert f"data {data:#x} + byte_offset {byte_offset} wraps past the end of the address space" in str(info.value)
    assert made.deleted == 1


def test_data_plus_byte_offset_at_the_last_address_does_not_wrap():
    """data + byte_offset == 2**64 - 1 is the last address, not past it: an empty tensor there is viewed (its view
    names no memory: data 0, as every empty view's)."""
    data = HOST.__array_interface__["data"][0]
    made = MadeTensor(data=data, shape=(0,), byte_offset=2**64 - 1 - data)
    view = dlpack2cai(made.capsule)
    assert view.__array_interface__["shape"] == (0,)
    assert view.__array_interface__["data"] == (0, False)
    del view
    assert made.deleted == 1


def test_made_tensor_with_byte_offset_and_null_strides():
    base = np.arange(10, dtype=np.int16)
    made = MadeTensor(data=base.__array_interface__["data"][0], dtype=(0, 16, 1), shape=(2, 3), byte_offset=4,
                      versioned=False)
    view = dlpack2cai(made.capsule)
    iface = view.__array_interface__
    assert iface["strides"] is None
    assert iface["data"] == (base.__array_interface__["data"][0] + 4, False)
    assert np.asarray(view).tolist() == [[2, 3, 4], [5, 6, 7]]
    del view, iface
    assert made.deleted == 1


def test_made_tensor_read_only_and_newer_minor():
    base = np.arange(4, dtype=np.float32)
    made = MadeTensor(data=base.__array_interface__["data"][0], shape=(4,), flags=1, version=(1, 99))
    view = dlpack2cai(made.capsule)
    assert view.read_only and view.__array_interface__["data"][1] is True
    a = np.asarray(view)
    assert not a.flags.writeable
    with pytest.raises(BufferError, match="read-only"):
        view.__dlpack__()  # legacy capsules cannot carry read-only


def test_cuda_made_tensor_exposes_cai_only():
    made = MadeTensor(data=0x7000_0000, device=(kDLCUDA, 5), shape=(3,), versioned=True)
    view = dlpack2cai(made.capsule, stream=-1)
    assert view.__cuda_array_interface__ == {"shape": (3,), "typestr": "<f4", "data": (0x7000_0000, False),
                                             "strides": None, "version": 3, "stream": None}
    with pytest.raises(AttributeError, match="device memory"):
        view.__array_interface__
    assert view.__dlpack_device__() == (kDLCUDA, 5)
    assert repr(view) == "<cai_dlpack.DLPackView shape=(3,) typestr='<f4' device=(2, 5)>"


def test_zero_size_made_tensor_exports_null_pointer():
    made = MadeTensor(data=0x1234, device=(kDLCPU, 0), shape=(0, 4))
    assert dlpack2cai(made.capsule).__array_interface__["data"] == (0, False)


def test_array_interface_data_without_buffer():
    class Holder:
        def __init__(self, data):
            self.__array_interface__ = {"shape": (1,), "typestr": "|u1", "data": data, "version": 3}

    for data, name in ((None, "Holder"), (5.0, "float"), ([1], "list")):
        with pytest.raises(TypeError, match=f"__array_interface__ 'data' must be .*; {name} has no buffer"):
            cai2dlpack(Holder(data))


# ---- what DLPack cannot describe, malformed interfaces, the supported types ------------------------------

UNDESCRIBABLE = [
    (np.zeros(3, "M8[ns]"), "'typestr' '<M8[ns]' has no DLPack equivalent"),
    (np.zeros(3, ">f4"), "'typestr' '>f4' has non-native byte order"),
    (np.zeros(3, [("a", "<f4"), ("b", "u1")])["a"], "'strides'[0] is 5 bytes, not a multiple of the itemsize 4"),
]


@pytest.mark.parametrize("array_,message", UNDESCRIBABLE, ids=["datetime64", "big-endian", "strides"])
def test_dlpack_raises_buffer_error_for_what_dlpack_cannot_describe(array_, message):
    for call in (lambda: DLPackShim(array_).__dlpack__(), lambda: DLPackShim(array_).__dlpack__(max_version=(1, 0)),
                 lambda: np.from_dlpack(DLPackShim(array_)), lambda: cai2dlpack(array_),
                 *([lambda: tvm_ffi.from_dlpack(DLPackShim(array_))] if tvm_ffi is not None else [])):
        with pytest.raises(BufferError, match=re.escape(message)) as info:
            call()
        # Still a ValueError, as such data always was for cai2dlpack's callers.
        assert isinstance(info.value, ValueError) and isinstance(info.value, UnsupportedArrayError)


class Holder:
    def __init__(self, **entries):
        iface = {"shape": (3,), "typestr": "<f4", "data": (8, False), "version": 3, **entries}
        self.__array_interface__ = {key: value for key, value in iface.items() if value is not None}


@pytest.mark.parametrize("entries,error,message", [
    (dict(typestr=4), TypeError, "'typestr' must be a str, not int"),
    (dict(shape=None), ValueError, "lacks the required key 'shape'"),
    (dict(strides=(4, 4)), ValueError, "'strides' has 2 entries but 'shape' has 1"),
])
def test_malformed_interfaces_keep_type_and_value_errors(entries, error, message):
    with pytest.raises(error, match=re.escape(message)) as info:
        DLPackShim(Holder(**entries)).__dlpack__()
    assert not isinstance(info.value, BufferError)


def test_supported_types_in_messages_come_from_the_table():
    with pytest.raises(UnsupportedArrayError) as info:
        cai2dlpack({"shape": (1,), "typestr": "<f16", "data": (8, False), "version": 3}, owner=object())
    typestrs, names = re.search(r"supported: (.*); by name \(.*?\): (.*)\)", str(info.value)).groups()
    # Every listed typestr converts; every listed name converts when named.
    for kind_size in typestrs.split(", "):
        typestr = ("|" if kind_size[1:] == "1" else "<") + kind_size
        iface = {"shape": (1,), "typestr": typestr, "data": (8, False), "version": 3}
        assert cai2dlpack(Holder(**iface)) is not None
    for name in names.split(", "):
        itemsize = 2 if name == "bfloat16" else 1
        assert cai2dlpack(Holder(typestr=f"|V{itemsize}", shape=(1,)), dtype=name) is not None
    assert {"b1", "i8", "u2", "f2", "c16"} <= set(typestrs.split(", "))
    assert {"bfloat16", "float8_e4m3fn", "float4_e2m1fn_x2"} <= set(names.split(", "))


@pytest.mark.parametrize("length", [0, 2, 3])
def test_an_array_interface_over_a_buffer_too_short_is_refused(length):
    """'data' a buffer object: the array must lie inside it, an empty buffer included (its length is 0, not "no
    buffer")."""
    with pytest.raises(ValueError, match=rf"reach bytes \[0, 4\) of a buffer of {length} bytes"):
        cai2dlpack(Holder(shape=(4,), typestr="|u1", data=bytearray(length)))


def test_an_offset_past_an_empty_buffer_is_refused():
    """'offset' into a buffer object must lie within it, an empty buffer included: 0 is the only offset there."""
    empty = dict(shape=(0,), typestr="|u1", data=bytearray(0))
    assert read_capsule(cai2dlpack(Holder(**empty, offset=0)))["shape"] == (0,)
    with pytest.raises(ValueError, match=r"'offset' is 1; it must lie in \[0, 0\]"):
        cai2dlpack(Holder(**empty, offset=1))


class HostInterface:
    def __init__(self, iface):
        self.__array_interface__ = iface


@pytest.mark.parametrize("pointer, strides, fits", [
    (8, (-8,), True),  # the lower item starts at address 0: the last address below is the first there is
    (7, (-8,), False),  # one byte lower would be below address 0
    (2**64 - 16, None, True),  # the upper item ends at the last address there is
    (2**64 - 15, None, False),
], ids=["down_to_0", "below_0", "up_to_the_top", "past_the_top"])
def test_an_extent_at_the_ends_of_the_address_space(pointer, strides, fits):
    """Two float64 items: the bytes they reach must lie in the address space, its first and last byte included
    (the pointer is never read: a host interface's data is only described)."""
    obj = HostInterface({"shape": (2,), "typestr": "<f8", "strides": strides, "data": (pointer, False), "version": 3})
    if fits:
        assert read_capsule(cai2dlpack(obj))["data"] == pointer
    else:
        with pytest.raises(ValueError, match="reaches outside the address space"):
            cai2dlpack(obj)


class SetOnly:
    """A data descriptor with __set__ and no __get__: attribute lookup gives the descriptor object itself."""

    def __set__(self, obj, value):
        raise AttributeError("read-only")


def test_an_interface_that_is_a_descriptor_without_get_is_read_as_python_reads_it():
    class Producer:
        __cuda_array_interface__ = SetOnly()

    assert isinstance(Producer().__cuda_array_interface__, SetOnly)
    with pytest.raises(TypeError, match="__cuda_array_interface__ must be a dict, not SetOnly"):
        cai2dlpack(Producer())


def test_keys_that_are_equal_strings_but_not_the_interned_names_are_read():
    """A producer may build its keys at run time (str objects of their own, not the interned literals): every key
    is still found by its text, and the dict converts as the literal one does."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    literal = dict(x.__array_interface__)
    built = {"".join(list(key)): value for key, value in literal.items()}
    assert all(a == b and a is not b for a, b in zip(literal, built))
    assert read_capsule(cai2dlpack(HostInterface(built))) == read_capsule(cai2dlpack(HostInterface(literal)))


@pytest.mark.parametrize("device", ["cpu", ("cuda", 0), (2,), (2, 0, 0)], ids=["a str", "a named type", "one int",
                                                                              "three ints"])
def test_a_producer_device_that_is_no_device_pair_is_left_to_its_dlpack(cudart, device):
    """With a runtime loaded, the legacy stream's capture check asks the producer's device: an answer that is no
    (type, id) pair of ints asks nothing of the runtime, and __dlpack__ gives the tensor (its reader names a
    malformed device in its own words); a tuple the check could not read leaves no error of its own behind."""
    x = np.arange(3.0)
    cai_dlpack.cuda_runtime_info()  # the runtime is loaded

    class NamedDevice:
        def __dlpack_device__(self):
            return device

        def __dlpack__(self, **kwargs):
            # Had the check left its parse error set, this call would raise SystemError (a C function's result
            # with an exception set): NumPy's own __dlpack__ would hide it, and so would a call the interpreter
            # specialised (len(kwargs) from 3.12 on), which is why the call goes through __call__.
            len.__call__(kwargs)
            return x.__dlpack__(**kwargs)

    view = dlpack2cai(NamedDevice())
    assert view.__array_interface__["data"][0] == x.ctypes.data
    assert np.asarray(view).tolist() == [0.0, 1.0, 2.0]


def test_a_view_whose_producer_changed_its_tensors_type_says_so():
    """A producer that changes its tensor's type after handing it out (DLPack forbids it) from one a typestr cannot
    name to one it can: the view's interface, which names such a type in its descr, raises SystemError naming the
    broken promise instead of describing memory it no longer knows."""
    data = np.zeros(4, dtype=np.uint16)
    made = MadeTensor(data=data.ctypes.data, dtype=(kDLBfloat, 16, 1), shape=(4,))
    view = dlpack2cai(made.capsule)
    assert view.__array_interface__["descr"] == [("bfloat16", "<V2")]
    made.managed.dl_tensor.dtype.code, made.managed.dl_tensor.dtype.bits = kDLFloat, 32
    with pytest.raises(SystemError, match="a descr asked of a type a typestr names"):
        view.__array_interface__
    del view
    assert made.deleted == 1


def test_cuda_error_stays_one_class_when_the_core_is_imported_again():
    """The core module imported again after it left sys.modules (a reloader's or a test runner's way) is the module
    it was: cai_dlpack.CudaError, caught by code written against the first import, is the class of the errors it
    raises from then on. (A process of its own: the import is the process's.)"""
    out = run_with_double("""
        import importlib
        import cai_dlpack
        first = sys.modules["cai_dlpack._core"]
        del sys.modules["cai_dlpack._core"]
        again = importlib.import_module("cai_dlpack._core")
        double.reset()
        host = np.zeros(8, dtype=np.float32)
        register(double, host, DEVICE)
        double.fail("cudaEventRecord", 700)  # cudaErrorIllegalAddress
        try:
            again.cai2dlpack(CaiArray(host[::2], stream=0x5000), stream=0x6000)
        except cai_dlpack.CudaError as error:
            print(again.CudaError is first.CudaError, error.call)
    """)
    assert out == ["True", "cudaEventRecord"]


def test_read_only_memory_by_max_version_alone():
    """max_version alone (torch's call for host memory) decides for read-only data as with any other keyword: a
    major of 1 gives a versioned capsule, a major of 0 (or none) the legacy one, which cannot say read-only."""
    x = np.arange(3.0)
    x.flags.writeable = False
    shim = DLPackShim(x)
    assert capsule_name(shim.__dlpack__(max_version=(1, 0))) == "dltensor_versioned"
    assert np.from_dlpack(shim).flags.writeable is False
    for kwargs in ({"max_version": (0, 8)}, {"max_version": None}, {}, {"max_version": (0, 8), "copy": None}):
        with pytest.raises(BufferError, match="read-only, which a legacy 'dltensor' capsule cannot say"):
            shim.__dlpack__(**kwargs)


@pytest.mark.skipif(bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
                    reason="a free-threaded CPython runs on mimalloc only: it refuses PYTHONMALLOC=malloc")
def test_one_keyword_other_than_max_version_is_not_read_as_it(tmp_path):
    """A lone keyword (dl_device here) is looked for among __dlpack__'s names, never read as max_version, with the C
    allocator under the tuples (PYTHONMALLOC=malloc, as valgrind runs): there the word just past a one-keyword
    tuple's item can be a freed two-item tuple's second item, the interned name max_version itself. Each round frees
    such a tuple just before a **kwargs call makes its one-keyword tuple, with the tuple free lists full (size 2)
    and empty (size 1), so that malloc hands the freed block over."""
    script = tmp_path / "lone_keyword.py"
    script.write_text(
        "import sys, ctypes, collections, numpy as np\n"
        "from cai_dlpack import DLPackShim\n"
        "name = ctypes.pythonapi.PyCapsule_GetName\n"
        "name.restype, name.argtypes = ctypes.c_char_p, [ctypes.py_object]\n"
        "shim = DLPackShim(np.arange(3.0))\n"
        "keyword = sys.intern('max_version')\n"
        "seen = collections.Counter()\n"
        "for round in range(200):\n"
        "    pair = (round, keyword)\n"
        "    pairs = [(i, i) for i in range(3000)]\n"
        "    del pairs\n"
        "    singles = [(i,) for i in range(3000)]\n"
        "    method, kwargs = shim.__dlpack__, {'dl_device': (1, 0)}\n"
        "    del pair\n"
        "    seen[name(method(**kwargs)).decode()] += 1\n"
        "    del singles, method, kwargs\n"
        "print(dict(seen))\n")
    env = dict(os.environ, PYTHONMALLOC="malloc")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "{'dltensor': 200}"
