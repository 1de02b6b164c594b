"""Property-based fuzzing of both converters through the public API (a bounded run in CI; set
CAI_DLPACK_FUZZ_EXAMPLES for a long run). Invariants: never a crash; valid input round-trips exactly;
invalid input raises TypeError, ValueError or BufferError naming the interface."""
import contextlib
import copy
import ctypes
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cai_dlpack import DLPackShim, _core, cai2dlpack, dlpack2cai
from support import doors
from support.dlpack_ctypes import MadeTensor, read_capsule


@contextlib.contextmanager
def general_reader():
    """Every held dict read afresh by the general reader: kept records off, and the fused reader off for dicts held
    elsewhere, which it reads on free-threaded builds (a property's fresh dict is still the fused reader's)."""
    _core._set_interface_cache(False)
    _core._set_held_fused_reads(False)
    try:
        yield
    finally:
        _core._set_held_fused_reads(True)
        _core._set_interface_cache(True)
from support.fuzz_settings import FUZZ
BUFFER = np.zeros(1 << 16, dtype=np.uint8)
BASE = BUFFER.ctypes.data


class Int(int):
    pass


class Tuple(tuple):
    pass


class Dict(dict):
    pass


ints = st.one_of(st.integers(-3, 64), st.integers(-(2**70), 2**70), st.builds(Int, st.integers(0, 64)))
junk = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=4), st.binary(max_size=4),
                 st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))
typestrs = st.one_of(
    st.sampled_from(["|b1", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8", "<c8",
                     "<c16", "=f4", "|f8"]),
    st.sampled_from([">f4", "<f16", "|O8", "<U4", "|V8", "<M8", "<m8", "|S4", "f4", "", "<f", "<bf16", "<i3"]),
    st.text(max_size=5), junk)
shapes = st.one_of(st.lists(st.integers(0, 6), max_size=5).map(tuple),
                   st.lists(ints, max_size=70).map(tuple), st.lists(st.integers(0, 4), max_size=4).map(Tuple),
                   st.lists(st.integers(0, 4), max_size=4), junk)
strides = st.one_of(st.none(), st.lists(st.integers(-64, 64).map(lambda s: s * 8), max_size=5).map(tuple),
                    st.lists(ints, max_size=6).map(tuple), junk)
datas = st.one_of(st.tuples(st.integers(0, 1 << 12).map(lambda o: BASE + o), st.booleans()),
                  st.tuples(ints, st.one_of(st.booleans(), junk)), st.just(None), st.binary(max_size=64), junk)
versions = st.one_of(st.integers(0, 3), ints, junk)
masks = st.one_of(st.none(), junk)


@st.composite
def interfaces(draw):
    iface = {}
    for key, strategy in (("shape", shapes), ("typestr", typestrs), ("data", datas), ("version", versions),
                          ("strides", strides), ("mask", masks), ("offset", ints)):
        if draw(st.integers(0, 9)) > 0 or key in ("strides", "mask", "offset"):
            if key in ("strides", "mask", "offset") and draw(st.booleans()):
                continue
            iface[key] = draw(strategy)
    return Dict(iface) if draw(st.booleans()) else iface


class Holder:
    def __init__(self, iface):
        self.__array_interface__ = iface


@FUZZ
@given(interfaces(), st.sampled_from([None, (1, 0), (1, 3)]))
def test_array_interface_dicts(iface, max_version):
    try:
        capsule = cai2dlpack(Holder(iface), max_version=max_version)
    except (TypeError, ValueError, BufferError) as error:
        assert "__array_interface__" in str(error) or "read-only" in str(error), repr(error)
        return
    view = dlpack2cai(capsule, stream=-1)
    out = view.__array_interface__
    assert out["shape"] == tuple(iface["shape"])
    assert np.dtype(out["typestr"]) == np.dtype(iface["typestr"])
    itemsize = np.dtype(iface["typestr"]).itemsize
    if isinstance(iface["data"], tuple):
        expected_pointer = iface["data"][0]
    else:
        expected_pointer = None  # a buffer object: checked through the bytes below
    size = int(np.prod(out["shape"])) if out["shape"] else 1
    if expected_pointer is not None and size:
        assert out["data"][0] == expected_pointer
    if iface.get("strides") is not None and size:
        assert tuple(s // itemsize for s in out["strides"]) == tuple(s // itemsize for s in iface["strides"])


def _outcome(convert):
    """What a conversion gave: the view's array interface, or the exception's type and message."""
    try:
        return dlpack2cai(convert(), stream=-1).__array_interface__
    except (TypeError, ValueError, BufferError) as error:
        return type(error), str(error)


@st.composite
def ready_interfaces(draw):
    """Valid array interfaces over BUFFER (a holder's ready dict)."""
    typestr = draw(st.sampled_from(["|b1", "|i1", "<i2", "<u4", "<f4", "<f8", "<c16"]))
    itemsize = np.dtype(typestr).itemsize
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
    iface = {"shape": shape, "typestr": typestr, "version": draw(st.integers(0, 3)),
             "data": (BASE + 4096 + itemsize * draw(st.integers(0, 64)), draw(st.booleans()))}
    if draw(st.booleans()):
        iface["strides"] = tuple(itemsize * draw(st.integers(-4, 4)) for _ in shape)
    return iface


KEYED = {"shape": shapes, "typestr": typestrs, "data": datas, "version": versions, "strides": strides,
         "mask": masks}


@st.composite
def changes(draw, iface):
    """iface with one key set to a fuzzed value or removed, or another ready dict."""
    if draw(st.booleans()):
        return draw(ready_interfaces())
    key = draw(st.sampled_from(sorted(KEYED)))
    changed = dict(iface)
    if draw(st.integers(0, 4)) == 0:
        changed.pop(key, None)
    else:
        changed[key] = draw(KEYED[key])
    return changed


@FUZZ
@given(st.data())
def test_a_kept_record_answers_as_a_fresh_read(data):
    """A ready dict converted with kept records (kept, then reused), then changed in place and converted again,
    answers as each dict read afresh by the general reader (general_reader: kept records off, and the fused reader
    off for held dicts)."""
    iface = data.draw(ready_interfaces())
    changed = data.draw(changes(iface))

    def convert(obj):
        return lambda: cai2dlpack(obj, max_version=(1, 0))

    with general_reader():
        fresh = [_outcome(convert(Holder(dict(d)))) for d in (iface, changed)]
    holder = Holder(iface)
    for expected in fresh:
        assert _outcome(convert(holder)) == expected
        assert _outcome(convert(holder)) == expected
        iface.clear()
        iface.update(changed)


class CaiHolder:
    def __init__(self, iface):
        self.__cuda_array_interface__ = iface


class Raising:
    def __init__(self, error):
        self.error = error

    @property
    def __cuda_array_interface__(self):
        raise self.error


cai_streams = st.one_of(st.none(), st.integers(-2, 3), st.integers(2**40, 2**64), junk)


@FUZZ
@given(interfaces(), cai_streams, st.one_of(st.none(), st.integers(-2, 3), junk))
def test_cai_dicts_through_the_runtime_double(cudart, iface, stream, consumer):
    """The CAI path: the double says the fuzzed pointer range is device memory on device 1."""
    cudart.reset()
    cudart.add_region(BASE, BUFFER.nbytes, 2, 1)
    iface = dict(iface, stream=stream)
    try:
        capsule = cai2dlpack(CaiHolder(iface), stream=consumer, max_version=(1, 0))
    except (TypeError, ValueError, BufferError) as error:
        message = str(error)
        assert "__cuda_array_interface__" in message or "stream" in message or "read-only" in message, repr(error)
        return
    finally:
        assert cudart.current_device == 0
    view = dlpack2cai(capsule, stream=-1)
    out = view.__cuda_array_interface__
    assert out["shape"] == tuple(iface["shape"]) and view.device[0] == 2


class FreshArrayHolder:
    """A producer that builds its dict on each access (as CuPy, Numba, PyTorch and RMM do): a dict only the
    converting call holds, read by the fused path for such dicts."""

    def __init__(self, iface):
        self.iface = iface

    @property
    def __array_interface__(self):
        return copy.copy(self.iface)


class FreshCaiHolder(FreshArrayHolder):
    @property
    def __cuda_array_interface__(self):
        return copy.copy(self.iface)


def _capsule_outcome(convert, producer):
    """What convert(producer) gave: every field of the capsule's tensor, or the exception's type and message
    (the producer's class named as "<producer>")."""
    try:
        return read_capsule(convert(producer))
    except (TypeError, ValueError, BufferError) as error:
        return type(error), str(error).replace(type(producer).__name__, "<producer>")


# The keys as a producer's own code spells them (interned literals), as text of another str object, the keys
# that are read only sometimes, and one no reader knows.
SPELLED = st.sampled_from(["shape", "sha" + "pe".upper().lower(), "typestr", "typ" + "estr".upper().lower()])
EXTRA_KEYS = st.dictionaries(st.one_of(SPELLED, st.sampled_from(["descr", "offset", "mask", "stream", "other"])),
                             st.one_of(ints, junk, st.just([("", "<f4")])), max_size=3)


@st.composite
def fresh_interfaces(draw):
    """Fuzzed dicts, and CuPy-shaped ones (in the order CuPy builds them) with each value valid, or now and then
    one of the values next to valid that the fused path must leave to the general reader."""
    if draw(st.integers(0, 3)) == 0:
        iface = draw(interfaces())
    else:
        spoiled_key = draw(st.sampled_from([None, "shape", "typestr", "stream", "version", "strides", "data"]))

        def value(key, valid, spoiled):
            return draw(spoiled) if key == spoiled_key else draw(valid)

        typestr = value("typestr", st.sampled_from(["|b1", "<i2", "|u1", "<f4", "<f8", "<c8", "<c16", "=f4"]),
                        st.one_of(st.sampled_from(["|V2", "<V2", ">f4", "<f3", "f4", "<f4 ", "<b1", "|x1"]), typestrs))
        itemsize = np.dtype(typestr).itemsize if typestr in ("|b1", "<i2", "|u1", "<f4", "<f8", "<c8", "<c16",
                                                             "=f4") else 1
        shape = value("shape", st.lists(st.integers(0, 5), max_size=4).map(tuple),
                      st.one_of(st.lists(st.sampled_from([-1, 2**62, 2**31, True, Int(2), 3]), max_size=4).map(tuple),
                                st.lists(st.integers(0, 3), max_size=3), shapes))
        ndim = len(shape) if isinstance(shape, (tuple, list)) else 2
        iface = {"shape": shape, "typestr": typestr, "descr": [("", typestr)],
                 "stream": value("stream", st.sampled_from([1, 2, None, 2**40, 0x7F3A_2C00_1000, 2**63 - 1]),
                                 st.one_of(st.sampled_from([0, -1, -2**40, True, 2**63, 2**64, "1", Int(5)]), junk)),
                 "version": value("version", st.just(3), st.sampled_from([-1, 4, True, 3.0, Int(3), 2**64, None])),
                 "strides": value("strides", st.one_of(st.none(),
                                                       st.lists(st.integers(-4, 4).map(lambda s: s * itemsize),
                                                                 min_size=ndim, max_size=ndim).map(tuple)),
                                  st.one_of(st.lists(st.sampled_from([1, 3, -3, 2**62, True, Int(8)]),
                                                     max_size=4).map(tuple), strides)),
                 "data": value("data", st.tuples(st.integers(0, 1 << 10).map(lambda o: BASE + 8192 + o * 8),
                                                 st.booleans()),
                               st.one_of(st.sampled_from([(BASE, 1), (0, False), (-1, False), (2**64 - 8, False),
                                                          (True, False), [BASE, False]]), datas))}
    for key, value in draw(EXTRA_KEYS).items():
        iface.pop(key, None)  # so that a key spelled as another str object replaces the literal one
        iface[key] = value
    return iface


@FUZZ
@given(fresh_interfaces(), st.sampled_from([{}, {"max_version": (1, 0)}, {"stream": -1, "max_version": (1, 3)}]))
def test_a_dict_only_the_call_holds_reads_as_a_dict_held_elsewhere(cudart, iface, keywords):
    """The same dict through the fused path (a fresh dict from a property, and on free-threaded builds a ready dict
    too) and the general reader (a ready dict, general_reader()): the same tensor, or the same exception with the
    same message, on both interfaces."""
    cudart.reset()
    cudart.add_region(BASE, BUFFER.nbytes, 2, 1)
    for fresh, held in ((FreshArrayHolder, Holder), (FreshCaiHolder, CaiHolder)):
        for convert in (lambda obj: cai2dlpack(obj, **keywords),
                        lambda obj: DLPackShim(obj).__dlpack__(**keywords)):
            with general_reader():
                expected = _capsule_outcome(convert, held(iface))
            assert _capsule_outcome(convert, fresh(iface)) == expected
            assert _capsule_outcome(convert, held(iface)) == expected  # free-threaded: the fused reader's


@pytest.mark.parametrize("pointer", [1, 2**30 - 8, 2**30, 2**30 + 8, 2**31, 2**59 + 2**30 + 8, 2**60 - 8, 2**60,
                                     2**60 + 8, 2**63, 2**64 - 8, 2**64, 2**64 + 8, -8, -(2**40)])
def test_pointers_of_every_size_read_alike_on_both_paths(pointer):
    """An int of one, two or three 30-bit digits, at each edge, as 'data'[0] of a dict the call alone holds and
    of a dict held elsewhere: the same address in the tensor, or the same refusal."""
    iface = {"shape": (2,), "typestr": "<f4", "descr": [("", "<f4")], "version": 3, "strides": None,
             "data": (pointer, False)}
    with general_reader():
        held = _capsule_outcome(cai2dlpack, Holder(iface))
    fresh = _capsule_outcome(cai2dlpack, FreshArrayHolder(iface))
    assert fresh == held
    assert _capsule_outcome(cai2dlpack, Holder(iface)) == held  # free-threaded: the fused reader's
    if 0 < pointer <= 2**64 - 8:
        assert dlpack2cai(cai2dlpack(FreshArrayHolder(iface))).__array_interface__["data"][0] == pointer
    else:
        assert fresh[0] in (ValueError, BufferError)


@FUZZ
@given(st.one_of(st.sampled_from([RuntimeError("x"), AttributeError("y"), KeyError("z"), MemoryError()]),
                 junk.map(lambda value: ValueError(value))))
def test_interface_properties_that_raise(error):
    expected = TypeError if isinstance(error, AttributeError) else type(error)
    try:
        cai2dlpack(Raising(error))
    except expected as raised:
        if isinstance(error, AttributeError):  # as with hasattr(): the object has no usable interface
            assert "neither __cuda_array_interface__ nor __array_interface__" in str(raised)
        else:
            assert raised is error
    else:
        raise AssertionError("no error")


@FUZZ
@given(ndim=st.integers(-2, 70), code=st.integers(0, 8), bits=st.sampled_from([1, 4, 8, 16, 32, 64, 128, 255]),
       lanes=st.sampled_from([0, 1, 2, 4]), device=st.sampled_from([1, 2, 3, 4, 10, 13, 99]),
       null_strides=st.booleans(), offset=st.integers(0, 64), versioned=st.booleans(),
       version=st.tuples(st.integers(0, 3), st.integers(0, 9)), flags=st.integers(0, 7),
       dims=st.lists(st.integers(-2, 5), min_size=70, max_size=70),
       steps=st.lists(st.integers(-(2**62), 2**62), min_size=70, max_size=70))
def test_arbitrary_dlpack_tensors(ndim, code, bits, lanes, device, null_strides, offset, versioned, version, flags,
                                  dims, steps):
    shape = tuple(dims[: max(ndim, 0)])
    made = MadeTensor(data=BASE, device=(device, 0), dtype=(code, bits, lanes), shape=shape,
                      strides=None if null_strides else tuple(steps[: len(shape)]), byte_offset=offset,
                      versioned=versioned, version=version, flags=flags, ndim=ndim)
    try:
        view = dlpack2cai(made.capsule)
    except BufferError:
        assert made.deleted == 1
        return
    assert made.deleted == 0
    assert view.shape == shape and view.device == (device, 0)
    iface = view.__cuda_array_interface__ if device in (2, 3, 13) else view.__array_interface__
    assert iface["shape"] == shape
    if all(shape):
        assert iface["data"][0] == BASE + offset
    del view, iface
    assert made.deleted == 1


# ---- the C API's three doors, called as a C extension calls them (support/doors.py) ----------------------

valid_streams = st.one_of(st.sampled_from([-1, 1, 2]), st.integers(3, 2**63 - 1))
invalid_streams = st.one_of(st.sampled_from([0, -2, -5, -(2**63)]), st.integers(-(2**63), -2))
REFUSALS = (TypeError, ValueError, BufferError)


def capsule_outcome(obj):
    """What cai2dlpack makes of obj: the exported tensor's fields, or the exception's type."""
    try:
        capsule = cai2dlpack(obj, max_version=(1, 0))
    except REFUSALS as error:
        return type(error)
    return door_outcome(lambda: read_capsule(capsule))


def door_outcome(call):
    try:
        fields = call()
    except REFUSALS as error:
        return type(error)
    outcome = {key: fields[key] for key in ("data", "device", "ndim", "dtype", "shape", "strides")}
    if outcome["ndim"] == 0:
        outcome["strides"] = ()  # fill_tensor's caller may give no storage for a 0-d array
    return outcome


def c_api_answers_as_cai2dlpack(obj, expected, stream, capacity):
    """to_managed_tensor and fill_tensor of obj on a valid stream answer as cai2dlpack did (expected)."""
    def managed():
        owned = doors.to_managed_tensor(obj, stream)
        try:
            assert owned.pointer.contents.version.major == 1
            return owned.fields()
        finally:
            owned.delete()

    def filled():
        fields, read_only = doors.fill_tensor(obj, stream, capacity=capacity)
        assert read_only in (0, 1)
        return fields

    assert door_outcome(managed) == expected
    filled_outcome = door_outcome(filled)
    if isinstance(expected, dict) and expected["ndim"] > capacity:
        assert filled_outcome is ValueError
    else:
        assert filled_outcome == expected


@FUZZ
@given(interfaces(), valid_streams, st.integers(-2, 70), st.sampled_from(["array", "shim"]))
def test_c_api_answers_as_cai2dlpack(iface, stream, capacity, wrap):
    """Any array-interface object, or a shim of one, through to_managed_tensor and fill_tensor (any storage
    capacity): the same tensor cai2dlpack exports of the array, or a refusal of the same type."""
    holder = Holder(iface)
    obj = DLPackShim(holder) if wrap == "shim" else holder
    c_api_answers_as_cai2dlpack(obj, capsule_outcome(holder), stream, capacity)


@FUZZ
@given(interfaces(), cai_streams, valid_streams)
def test_c_api_cai_dicts_through_the_runtime_double(cudart, iface, producer_stream, stream):
    cudart.reset()
    cudart.add_region(BASE, BUFFER.nbytes, 2, 1)
    obj = CaiHolder(dict(iface, stream=producer_stream))
    c_api_answers_as_cai2dlpack(obj, capsule_outcome(obj), stream, 64)
    assert cudart.current_device == 0


@pytest.mark.parametrize("streams", ["invalid", "invalid, view"])
@FUZZ
@given(data=st.data())
def test_c_api_refuses_invalid_streams(streams, data):
    """0 and negatives other than -1 are no stream of the array API: each door refuses them with ValueError, and
    view_from_managed_tensor, which steals its tensor, has run the tensor's deleter."""
    stream = data.draw(invalid_streams)
    x = np.arange(6.0)
    if streams == "invalid":
        for call in (lambda: doors.to_managed_tensor(x, stream), lambda: doors.fill_tensor(x, stream)):
            with pytest.raises(ValueError, match="not a valid stream"):
                call()
        return
    made = MadeTensor(data=x.ctypes.data, dtype=(2, 64, 1), shape=(6,))
    with pytest.raises(ValueError, match="not a valid stream"):
        doors.view_from_managed_tensor(ctypes.cast(ctypes.pointer(made.managed), doors.ManagedPointer), stream)
    assert made.deleted == 1


@FUZZ
@given(ndim=st.integers(-2, 70), code=st.integers(0, 8), bits=st.sampled_from([0, 1, 4, 8, 16, 32, 64, 128, 255]),
       lanes=st.sampled_from([0, 1, 2, 4]), device=st.sampled_from([1, 2, 3, 4, 10, 13, 99]),
       null_strides=st.booleans(), offset=st.integers(0, 64), version=st.tuples(st.integers(0, 3), st.integers(0, 9)),
       flags=st.integers(0, 7), dims=st.lists(st.integers(-2, 5), min_size=70, max_size=70),
       steps=st.lists(st.integers(-(2**62), 2**62), min_size=70, max_size=70), stream=valid_streams)
def test_view_from_managed_tensor_answers_as_dlpack2cai(ndim, code, bits, lanes, device, null_strides, offset,
                                                        version, flags, dims, steps, stream):
    """Any versioned tensor through view_from_managed_tensor (which steals it) and through dlpack2cai of a capsule
    of the same: the same view or the same refusal, the deleter run exactly once either way."""
    shape = tuple(dims[: max(ndim, 0)])

    def made():
        return MadeTensor(data=BASE, device=(device, 0), dtype=(code, bits, lanes), shape=shape,
                          strides=None if null_strides else tuple(steps[: len(shape)]), byte_offset=offset,
                          version=version, flags=flags, ndim=ndim)

    def answer(convert, tensor):
        try:
            view = convert(tensor)
        except BufferError as error:
            assert tensor.deleted == 1
            return BufferError, str(error)
        assert tensor.deleted == 0
        answer = (view.shape, view.strides, view.typestr, view.device, view.read_only)
        del view
        assert tensor.deleted == 1
        return answer

    def pointer(t):
        return ctypes.cast(ctypes.pointer(t.managed), doors.ManagedPointer)

    by_capsule = answer(lambda t: dlpack2cai(t.capsule, stream=stream), made())
    assert answer(lambda t: doors.view_from_managed_tensor(pointer(t), stream), made()) == by_capsule
    # The exchange API's managed_tensor_to_py_object_no_sync: the same view, ready on the legacy stream.
    assert answer(lambda t: doors.object_from_managed(pointer(t)), made()) == by_capsule


@FUZZ
@given(device_type=st.one_of(st.sampled_from([1, 2, 3, 13]), st.integers(-(2**31), 2**31 - 1)),
       device_id=st.one_of(st.integers(-1, 5), st.integers(-(2**31), 2**31 - 1)))
def test_exchange_work_stream_of_any_device(cudart, device_type, device_id):
    """current_work_stream for any device: the stream to launch on (0, the default stream, for every device this
    producer has), or an exception, never a failure without one; the caller's device is left as it was."""
    cudart.reset()
    try:
        stream = doors.current_work_stream(device_type, device_id)
    except (ValueError, TypeError, BufferError, RuntimeError) as error:
        assert str(error), error
    else:
        assert stream == 0
    assert cudart.current_device == 0


@pytest.mark.parametrize("kind", ["views", "shims", "bare dicts"])
@FUZZ
@given(iface=ready_interfaces(), stream=valid_streams)
def test_c_api_owners(cudart, kind, iface, stream):
    """What keeps a C API tensor's memory alive: a view owns its tensor, a shim's object owns its memory; a bare
    interface dict owns nothing and is refused, as cai2dlpack and DLPackShim refuse it."""
    if kind == "bare dicts":
        cudart.reset()
        cudart.add_region(BASE, BUFFER.nbytes, 2, 1)  # a CAI dict of device memory the double knows
        with pytest.raises(TypeError):
            doors.to_managed_tensor(dict(iface), stream)
        return
    holder = Holder(iface)
    obj = dlpack2cai(cai2dlpack(holder, max_version=(1, 0))) if kind == "views" else DLPackShim(holder)
    owner = obj if kind == "views" else holder
    before = sys.getrefcount(owner)
    owned = doors.to_managed_tensor(obj, stream)
    assert sys.getrefcount(owner) > before
    owned.delete()
    assert sys.getrefcount(owner) == before


# ---- capsules of every name ----------------------------------------------------------------------------

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
ctypes.pythonapi.PyCapsule_GetName.restype = ctypes.c_char_p
ctypes.pythonapi.PyCapsule_GetName.argtypes = [ctypes.py_object]
capsule_names = st.one_of(st.sampled_from([b"dltensor", b"dltensor_versioned", b"used_dltensor",
                                           b"used_dltensor_versioned", b"dltensor_", b"DLTENSOR", b"dlpack_exchange_api",
                                           b"cai_dlpack._C_API", b""]),
                          st.binary(min_size=1, max_size=24).filter(lambda name: b"\0" not in name))


@pytest.mark.parametrize("names", ["named", "nameless"])
@FUZZ
@given(data=st.data())
def test_capsules_of_any_name(names, data):
    """dlpack2cai takes a capsule named dltensor or dltensor_versioned once (renaming it used_*); a used one is a
    BufferError, any other name (none included) a TypeError, and the capsule keeps its name. The C doors read
    no capsule: TypeError. Never a SystemError."""
    name = None if names == "nameless" else data.draw(capsule_names)
    versioned = name == b"dltensor_versioned"
    made = MadeTensor(data=BASE, dtype=(2, 32, 1), shape=(4,), versioned=versioned)
    capsule = made.capsule if name in (b"dltensor", b"dltensor_versioned") else _capsule_new(BASE, name, None)
    for door in (lambda: doors.to_managed_tensor(capsule, -1), lambda: doors.fill_tensor(capsule, -1),
                 lambda: doors.managed_from_object(capsule), lambda: doors.dltensor_from_object(capsule)):
        with pytest.raises(TypeError):
            door()
    for stream in (None, -1):
        if name in (b"dltensor", b"dltensor_versioned"):
            view = dlpack2cai(capsule, stream=stream)
            assert view.shape == (4,) and made.deleted == 0
            del view
            assert made.deleted == 1
            name = b"used_" + name
        elif name in (b"used_dltensor", b"used_dltensor_versioned"):
            with pytest.raises(BufferError, match="already consumed"):
                dlpack2cai(capsule, stream=stream)
        else:
            with pytest.raises(TypeError, match="PyCapsule"):
                dlpack2cai(capsule, stream=stream)
        assert ctypes.pythonapi.PyCapsule_GetName(capsule) == name
    consumed = capsule is made.capsule
    del capsule
    assert made.deleted == consumed


# ---- objects whose dicts and lists change between and during calls -------------------------------------

def every_door(obj):
    """obj through each door that reads an interface: its answer at each (fields, or the exception's type)."""
    def capsule():
        return read_capsule(cai2dlpack(obj, max_version=(1, 0)))

    def shim():
        return read_capsule(DLPackShim(obj).__dlpack__(max_version=(1, 0)))

    def managed():
        owned = doors.to_managed_tensor(obj, -1)
        try:
            return owned.fields()
        finally:
            owned.delete()

    def exchange_managed():
        owned = doors.managed_from_object(DLPackShim(obj))
        try:
            return owned.fields()
        finally:
            owned.delete()

    return [door_outcome(call) for call in (capsule, shim, managed, lambda: doors.fill_tensor(obj, -1)[0],
                                            exchange_managed, lambda: doors.dltensor_from_object(DLPackShim(obj)))]


class Float16Holder(Holder):
    dtype = np.dtype("float16")


def fresh_answers(iface, holder=Holder):
    """every_door of a deep copy of iface (in a holder of that class) read by the general reader: what each door
    must say of it."""
    copied = {key: list(value) if isinstance(value, list) else value for key, value in iface.items()}
    if isinstance(iface.get("descr"), list):
        copied["descr"] = [tuple(field) if isinstance(field, tuple) else field for field in iface["descr"]]
    with general_reader():
        return every_door(holder(copied))


@st.composite
def editable_interfaces(draw):
    """A valid interface over BUFFER whose shape, strides and descr are lists (a receiver may edit them)."""
    typestr = draw(st.sampled_from(["<f4", "<i2", "|u1", "<V2"]))
    itemsize = np.dtype(typestr).itemsize
    shape = draw(st.lists(st.integers(0, 4), max_size=4))
    iface = {"shape": shape, "typestr": typestr, "version": 3, "data": (BASE + 8192, False)}
    if draw(st.booleans()):
        iface["strides"] = [itemsize * draw(st.integers(-3, 3)) for _ in shape]
    if typestr == "<V2" or draw(st.booleans()):
        iface["descr"] = [(draw(st.sampled_from(["bfloat16", "float16", "", "x"])), typestr)]
    return iface


def edits(draw, iface):
    """One in-place edit of iface or of a list it holds (a draw of what to change)."""
    target = draw(st.sampled_from(["shape", "strides", "descr", "dict"]))
    value = iface.get(target) if target != "dict" else iface
    if target == "dict":
        key = draw(st.sampled_from(["shape", "strides", "typestr", "descr", "data"]))
        return lambda: iface.pop(key, None) if draw(st.booleans()) else iface.__setitem__(key, draw(KEYED.get(key, junk)))
    if not isinstance(value, list):
        return lambda: None
    action = draw(st.sampled_from(["append", "pop", "set", "clear"]))
    item = draw(st.one_of(st.integers(-2, 5), st.tuples(st.sampled_from(["bfloat16", "float16"]),
                                                        st.sampled_from(["<V2", "<f2"])), junk))
    return {"append": lambda: value.append(item), "pop": lambda: value and value.pop(),
            "set": lambda: value and value.__setitem__(0, item), "clear": value.clear}[action]


@FUZZ
@given(data=st.data())
def test_interfaces_edited_between_calls(data):
    """A holder's ready dict converted at every door, edited in place (the dict, or a shape, strides or descr list
    it holds), and converted again: each door answers as for a fresh copy of the dict as it is now."""
    iface = data.draw(editable_interfaces())
    holder = Holder(iface)
    for _ in range(3):
        assert every_door(holder) == fresh_answers(iface)
        data.draw(st.builds(lambda: None).map(lambda _: edits(data.draw, iface)))()


class EditingHolder:
    """An interface whose reading runs Python that edits it: the interface property (before the dict is read) or
    the dtype property (asked when a 'V' typestr has no named descr: in the middle of the read) applies the next
    edit. Each state the dict passes through is recorded as the answers a fresh copy of it gets."""

    def __init__(self, iface, pending, hook):
        self.iface, self.pending, self.hook, self.states = iface, pending, hook, []

    def _edit(self, hook):
        self.states.append(fresh_answers(self.iface, Float16Holder))
        if self.pending and hook == self.hook:
            self.pending.pop(0)()
            self.states.append(fresh_answers(self.iface, Float16Holder))

    @property
    def dtype(self):
        self._edit("dtype")
        return np.dtype("float16")

    @property
    def __array_interface__(self):
        self._edit("property")
        return self.iface


@st.composite
def unnamed_interfaces(draw):
    """A valid interface of a 'V' type its descr does not name, with shape and strides lists: its reader asks the
    object's dtype after reading the shape."""
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    return {"shape": shape, "strides": [2 * draw(st.integers(-3, 3)) for _ in shape], "typestr": "<V2",
            "version": 3, "data": (BASE + 8192, False), "descr": [("", "<V2")]}


def reshape(iface, shape, strides):
    """An edit to another valid state: shape and strides replaced in place."""
    def edit():
        iface["shape"][:] = shape
        iface["strides"][:] = strides
    return edit


@pytest.mark.parametrize("hook", ["property", "dtype"])
@FUZZ
@given(data=st.data())
def test_interfaces_edited_during_calls(hook, data):
    """Python run by a conversion (the object's interface property before the read, its dtype in the middle of it)
    edits the dict and its lists: each door answers as for the dict in one state it was in, never a mix of two."""
    if hook == "property":
        iface = data.draw(editable_interfaces())
        pending = [edits(data.draw, iface) for _ in range(data.draw(st.integers(1, 8)))]
    else:
        iface = data.draw(unnamed_interfaces())
        shapes = st.lists(st.integers(1, 4), min_size=1, max_size=3)
        pending = [reshape(iface, shape, [2 * data.draw(st.integers(-3, 3)) for _ in shape])
                   for shape in data.draw(st.lists(shapes, min_size=1, max_size=4))]
    holder = EditingHolder(iface, pending, hook)
    for _ in range(2):
        answers = every_door(holder)
        seen = holder.states + [fresh_answers(iface, Float16Holder)]
        for door, answer in enumerate(answers):
            assert any(state[door] == answer for state in seen), (door, answer)
        holder.states.clear()
