"""The dicts real producers build on every access (CuPy, Numba, PyTorch, RMM: a property returning a new dict)
are read by the fused reader, and every dict it must not read the common way goes to the general reader: counted
by _core._fused_reads(), with the same tensor or the same error as a dict held elsewhere (which the general
reader always reads). Which reader ran is otherwise seen only in a conversion's cost."""
import copy
import gc
import sys
import sysconfig

import numpy as np
import pytest

from cai_dlpack import DLPackShim, _core, cai2dlpack
from support.dlpack_ctypes import read_capsule

# A dict held elsewhere that no kept record serves is the fused reader's too on free-threaded builds (inside its
# critical section); with the GIL, its kept record or the general reader reads it.
HELD_FUSED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))

BUFFER = np.zeros(1 << 12, dtype=np.uint8)
BASE = BUFFER.ctypes.data + 64


class Int(int):
    pass


class Fresh:
    """A new dict on each access, as a producer's property builds it."""

    def __init__(self, iface):
        self.iface = iface

    @property
    def __array_interface__(self):
        return copy.copy(self.iface)


class FreshCuda(Fresh):
    @property
    def __cuda_array_interface__(self):
        return copy.copy(self.iface)


class Held:
    def __init__(self, iface):
        self.__array_interface__ = iface


class HeldCuda:
    def __init__(self, iface):
        self.__cuda_array_interface__ = iface


def cupy_shaped(**changes):
    """CuPy's dict, key for key in its order (cupy/_core/core.pyx), for a C-contiguous 3x4 float32 array."""
    iface = {"shape": (3, 4), "typestr": "<f4", "descr": [("", "<f4")], "stream": 1, "version": 3,
             "strides": None, "data": (BASE, False)}
    for key, value in changes.items():
        if value is KeyError:
            iface.pop(key)
        else:
            iface[key] = value
    return iface


def outcome(convert, producer):
    try:
        return read_capsule(convert(producer))
    except (TypeError, ValueError, BufferError) as error:
        return type(error), str(error).replace(type(producer).__name__, "<producer>")


def versioned(obj):
    return cai2dlpack(obj, max_version=(1, 0))


def reads(iface, cudart=None, convert=versioned):
    """(whether the fused reader read iface, the outcome), after checking that the outcome is the general reader's
    (the fused reader turned off for held dicts) for the dict fresh on each access and held by its object, that
    the fused reader reads both or neither, and, on the device path (cudart: the runtime double), that the runtime
    calls are the general reader's too."""
    fresh_type, held_type = (FreshCuda, HeldCuda) if cudart is not None else (Fresh, Held)
    calls = []

    def converted(producer):
        if cudart is not None:
            cudart.clear_log()
        try:
            return outcome(convert, producer)
        finally:
            if cudart is not None:
                calls.append(cudart.log())

    def counted(producer):
        before = _core._fused_reads()
        result = converted(producer)
        return _core._fused_reads() - before, result

    _core._set_interface_cache(False)  # a held dict is read each time, not served by its kept record
    try:
        converted(held_type(copy.copy(iface)))  # first calls set up once (driver entry points, the event pool)
        _core._set_held_fused_reads(False)
        try:
            general = counted(held_type(copy.copy(iface)))
        finally:
            _core._set_held_fused_reads(True)
        fresh = counted(fresh_type(iface))
        held = counted(held_type(copy.copy(iface)))
    finally:
        _core._set_interface_cache(True)
    assert general[0] == 0
    assert fresh[0] in (0, 1) and held[0] == (fresh[0] if HELD_FUSED else 0)
    assert fresh[1] == general[1] and held[1] == general[1]
    if cudart is not None:
        assert calls[1] == calls[2] == calls[3]
    return fresh[0] == 1, fresh[1]


@pytest.fixture
def device(cudart):
    cudart.reset()
    cudart.add_region(BUFFER.ctypes.data, BUFFER.nbytes, 2, 0)
    return cudart


TAKEN = {
    "CuPy's dict": cupy_shaped(),
    "Numba's keys": {"shape": (3, 4), "strides": None, "data": (BASE, False), "typestr": "<f4", "stream": 1,
                     "version": 3},
    "PyTorch's keys": {"typestr": "<f4", "shape": (3, 4), "strides": (16, 4), "data": (BASE, False),
                       "version": 2},
    "version 0": cupy_shaped(version=0),
    "read-only data": cupy_shaped(data=(BASE, True)),
    "a 0-d array": cupy_shaped(shape=()),
    "an empty array": cupy_shaped(shape=(0, 4)),
    "an empty array at NULL": cupy_shaped(shape=(3, 0), data=(0, False)),
    "strides in bytes": cupy_shaped(strides=(4, 12)),
    "negative strides": cupy_shaped(strides=(-16, -4), data=(BASE + 44, False)),
    "a stride of any size where the extent is 1": cupy_shaped(shape=(1, 4), strides=(7, 4)),
    "strides of a dimension of extent 0": cupy_shaped(shape=(0, 4), strides=(3, 4)),
    "a typestr no three characters name": cupy_shaped(typestr="<c16", descr=[("", "<c16")]),
    "a typestr whose size has a leading zero": cupy_shaped(typestr="<f04", descr=[("", "<f04")]),
    "a mask of None": cupy_shaped(mask=None),
    "an offset": cupy_shaped(offset=8),
    "no stream key": cupy_shaped(stream=KeyError),
    "stream None": cupy_shaped(stream=None),
    "the per-thread stream": cupy_shaped(stream=2),
    "a stream handle of many digits": cupy_shaped(stream=0x7F3A_2C00_1000),
    "the largest stream handle": cupy_shaped(stream=2**63 - 1),
    "no descr": cupy_shaped(descr=KeyError),
    "a pointer of three digits": cupy_shaped(data=(2**61, False)),
    # (an int below 2**30 is one digit of CPython's 30-bit digits; no memory is read where nothing is there)
    "a pointer of one digit": cupy_shaped(shape=(0, 4), data=(2**30 - 64, False)),
}


@pytest.mark.parametrize("iface", TAKEN.values(), ids=TAKEN.keys())
@pytest.mark.parametrize("door", ["cai2dlpack", "DLPackShim"])
def test_producers_fresh_dicts_take_the_fused_reader(iface, door):
    convert = versioned if door == "cai2dlpack" else (lambda obj: DLPackShim(obj).__dlpack__(max_version=(1, 0)))
    fused, tensor = reads(iface, convert=convert)
    assert fused and isinstance(tensor, dict), tensor


@pytest.mark.parametrize("iface", TAKEN.values(), ids=TAKEN.keys())
@pytest.mark.parametrize("consumer", [None, 1, 2, -1])
def test_on_the_device_path_too_with_the_same_stream_ordering(device, iface, consumer):
    """The same tensor and the same runtime calls (the stream ordering the producer's stream, or its absence,
    asks for) for each consumer stream."""
    if iface["data"][0] >= 2**61 or 0 < iface["data"][0] < 2**30:
        iface = dict(iface, data=(BASE, False))  # the double knows only the buffer's range
    fused, tensor = reads(iface, device, lambda obj: cai2dlpack(obj, stream=consumer, max_version=(1, 0)))
    assert fused and isinstance(tensor, dict), tensor


LEFT = {
    "another key": cupy_shaped(other=1),
    "a mask": cupy_shaped(mask=(BASE, False)),
    "a key of ours as another str": {"".join(["sha", "pe"]) if key == "shape" else key: value
                                     for key, value in cupy_shaped().items()},
    "no version": cupy_shaped(version=KeyError),
    "version 4": cupy_shaped(version=4),
    "version -1": cupy_shaped(version=-1),
    "version True": cupy_shaped(version=True),
    "version an int subclass": cupy_shaped(version=Int(3)),
    "version of two digits": cupy_shaped(version=2**40),
    "no shape": cupy_shaped(shape=KeyError),
    "a shape list": cupy_shaped(shape=[3, 4]),
    "a negative extent": cupy_shaped(shape=(3, -4)),
    "an extent True": cupy_shaped(shape=(3, True)),
    "an extent of two digits": cupy_shaped(shape=(3, 2**40)),
    "65 dimensions": cupy_shaped(shape=(1,) * 65),
    "no typestr": cupy_shaped(typestr=KeyError),
    "a typestr not a str": cupy_shaped(typestr=b"<f4"),
    "a typestr DLPack has no type for": cupy_shaped(typestr="|V4"),
    "a typestr whose first three characters name a type": cupy_shaped(typestr="<f44", descr=[("", "<f44")]),
    "a typestr of a type and a letter": cupy_shaped(typestr="<f4x", descr=[("", "<f4x")]),
    "a typestr of another byte order": cupy_shaped(typestr=">f4"),
    "a typestr of no byte order": cupy_shaped(typestr="!f4", descr=[("", "!f4")]),
    "a typestr of five characters whose size names a type": cupy_shaped(typestr="<f004", descr=[("", "<f004")]),
    "no data": cupy_shaped(data=KeyError),
    "data a list": cupy_shaped(data=[BASE, False]),
    "data of three items": cupy_shaped(data=(BASE, False, 0)),
    "a read-only flag not a bool": cupy_shaped(data=(BASE, 0)),
    "a pointer an int subclass": cupy_shaped(data=(Int(BASE), False)),
    "a NULL pointer with elements": cupy_shaped(data=(0, False)),
    "a negative pointer": cupy_shaped(data=(-8, False)),
    "a pointer past 64 bits": cupy_shaped(data=(2**64, False)),
    "an extent past the address space": cupy_shaped(data=(2**64 - 16, False)),
    "strides a list": cupy_shaped(strides=[16, 4]),
    "strides of the wrong length": cupy_shaped(strides=(4,)),
    "strides not whole items": cupy_shaped(strides=(16, 3)),
    "a stride of two digits": cupy_shaped(strides=(2**40, 4)),
    "strides past the address space": cupy_shaped(strides=(2**61, 4)),
    "elements past 64 bits": cupy_shaped(shape=(2**29, 2**29, 2**29), strides=None),
    "elements past 64 bits, strides given": cupy_shaped(shape=(2**29, 2**29, 2**29), strides=(4, 4, 4)),
}


@pytest.mark.parametrize("iface", LEFT.values(), ids=LEFT.keys())
def test_dicts_it_does_not_read_the_common_way_go_to_the_general_reader(iface):
    fused, _ = reads(iface)
    assert not fused


DEVICE_LEFT = {
    "stream 0": cupy_shaped(stream=0),
    "stream -1": cupy_shaped(stream=-1),
    "stream True": cupy_shaped(stream=True),
    "a stream handle past 63 bits": cupy_shaped(stream=2**63),
    "a stream an int subclass": cupy_shaped(stream=Int(1)),
    "a stream of another type": cupy_shaped(stream="1"),
}


@pytest.mark.parametrize("iface", DEVICE_LEFT.values(), ids=DEVICE_LEFT.keys())
def test_cuda_streams_it_does_not_read_go_to_the_general_reader(device, iface):
    fused, _ = reads(iface, device)
    assert not fused
    # The host interface ignores 'stream': the same dict is the fused reader's there.
    assert reads(iface)[0]


def test_a_dtype_asked_for_is_never_the_fused_readers():
    before = _core._fused_reads()
    cai2dlpack(Fresh(cupy_shaped()), dtype="float32")
    cai2dlpack(Held(cupy_shaped()), dtype="float32")
    assert _core._fused_reads() == before


def test_a_held_dict_is_read_by_its_record_or_afresh_at_each_change():
    """Read once (by the general reader with the GIL, by the fused reader on free-threaded builds), then by its
    record while unchanged. Changed, it is read afresh, and the change is seen. Where no records are kept
    (CPython 3.14 and later), a free-threaded build would read it with the fused reader each time."""
    held = Held(cupy_shaped())
    keeps = _core._interface_cache_info()["enabled"]
    fused, info = _core._fused_reads(), _core._interface_cache_info()
    first = read_capsule(versioned(held))
    second = read_capsule(versioned(held))
    held.__array_interface__["shape"] = (4, 3)
    changed = read_capsule(versioned(held))
    assert second == first and changed["shape"] == (4, 3) and first["shape"] == (3, 4), (first, changed)
    assert _core._fused_reads() - fused == (0 if not HELD_FUSED else 2 if keeps else 3)
    if keeps:
        after = _core._interface_cache_info()
        assert (after["stores"] - info["stores"], after["hits"] - info["hits"]) == (2, 1)


def test_held_fused_reads_off_send_held_dicts_to_the_general_reader_and_leave_fresh_ones():
    _core._set_interface_cache(False)
    _core._set_held_fused_reads(False)
    try:
        before = _core._fused_reads()
        cai2dlpack(Held(cupy_shaped()))
        assert _core._fused_reads() == before
        cai2dlpack(Fresh(cupy_shaped()))
        assert _core._fused_reads() == before + 1
    finally:
        _core._set_held_fused_reads(True)
        _core._set_interface_cache(True)
    before = _core._fused_reads()
    cai2dlpack(Held(cupy_shaped()))
    assert _core._fused_reads() == before + HELD_FUSED


@pytest.mark.skipif(sys.version_info < (3, 12), reason="3.11 collects inside the allocation that crosses the threshold, "
                    "in the producer's property: the finalizer has run before the conversion reads the dict")
def test_a_refused_typestr_is_never_formatted_from_a_borrowed_reference():
    """A held dict whose typestr ('<f3', held by the dict alone) names no type. The fused reader (which reads held
    dicts on free-threaded builds) declines it without raising: formatting the refusal calls the str's repr, which
    first runs pending signal handlers and, from 3.12, a pending collection, whose finalizer here replaces the
    typestr. Read through a borrowed reference, the freed str would be read and the new one converted; the general
    reader, holding its own references, refuses '<f3' by name."""
    shared = {"shape": (3, 4), "typestr": "".join(["<", "f", "3"]), "data": (BASE, False), "version": 3}

    class Finalized:
        def __del__(self):
            shared["typestr"] = "<f4"  # the dict's reference to '<f3' was its last

    def arm():
        garbage = Finalized()
        garbage.cycle = garbage

    # The property leaves the cycle and then makes 1,200 lists with no call or backward jump after them, where the
    # interpreter would run the collection they schedule: it is still pending when the conversion's C code runs.
    getter = eval("lambda self: (arm(), [" + "[], " * 1200 + "], shared)[-1]", {"arm": arm, "shared": shared})
    producer = type("Producer", (), {"__array_interface__": property(getter)})()
    threshold = gc.get_threshold()
    gc.set_threshold(1, 0, 0)
    try:
        with pytest.raises(ValueError, match="'<f3' has no DLPack equivalent"):
            cai2dlpack(producer, max_version=(1, 0))
    finally:
        gc.set_threshold(*threshold)
