"""Every input of the libFuzzer corpus (tests/fuzz/corpus), replayed through the installed module: the
same decoding as tests/fuzz/fuzz_interface.c turns each file into a typestr and an __array_interface__,
which goes through cai2dlpack, dlpack2cai, the view's interface and its buffer export. A crash the fuzzer
once found cannot come back unnoticed: each refusal must be a Python exception, each accepted array must
read back, and each buffer export must describe exactly its length."""
import ctypes
import math
import os

import pytest

from cai_dlpack import cai2dlpack, dlpack2cai
from support import doors
from support.dlpack_ctypes import MadeTensor

CORPUS = os.path.join(os.path.dirname(__file__), os.pardir, "fuzz", "corpus")
FILES = sorted(os.listdir(CORPUS))
MEMORY = bytearray(1 << 12)
MEMORY_ADDRESS = ctypes.addressof(ctypes.c_char.from_buffer(MEMORY))

# The buffer requests of fuzz_interface.c, in its order (values of CPython's PyBUF_* flags).
PyBUF_WRITABLE, PyBUF_FORMAT, PyBUF_ND = 0x1, 0x4, 0x8
PyBUF_STRIDES = 0x10 | PyBUF_ND
PyBUF_C, PyBUF_F, PyBUF_ANY, PyBUF_INDIRECT = 0x20 | PyBUF_STRIDES, 0x40 | PyBUF_STRIDES, 0x80 | PyBUF_STRIDES, 0x100 | PyBUF_STRIDES
REQUESTS = [0, PyBUF_WRITABLE, PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES, PyBUF_C, PyBUF_F, PyBUF_ANY, PyBUF_INDIRECT,
            PyBUF_ND | PyBUF_WRITABLE, PyBUF_ND, PyBUF_STRIDES | PyBUF_WRITABLE, PyBUF_STRIDES,
            PyBUF_STRIDES | PyBUF_WRITABLE | PyBUF_FORMAT, PyBUF_STRIDES | PyBUF_FORMAT,
            PyBUF_INDIRECT | PyBUF_WRITABLE | PyBUF_FORMAT, PyBUF_INDIRECT | PyBUF_FORMAT]


class Py_buffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.POINTER(ctypes.c_ssize_t)),
                ("strides", ctypes.POINTER(ctypes.c_ssize_t)), ("suboffsets", ctypes.POINTER(ctypes.c_ssize_t)),
                ("internal", ctypes.c_void_p)]


get_buffer = ctypes.pythonapi.PyObject_GetBuffer
get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(Py_buffer), ctypes.c_int]
release_buffer = ctypes.pythonapi.PyBuffer_Release
release_buffer.argtypes = [ctypes.POINTER(Py_buffer)]
is_contiguous = ctypes.pythonapi.PyBuffer_IsContiguous
is_contiguous.argtypes = [ctypes.POINTER(Py_buffer), ctypes.c_char]
libc = ctypes.CDLL(None)
libc.malloc_usable_size.restype = ctypes.c_size_t
libc.malloc_usable_size.argtypes = [ctypes.c_void_p]
ctypes.pythonapi.PyCapsule_New.restype = ctypes.py_object
ctypes.pythonapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class Input:
    """The fuzzer's reading of its bytes: a byte at a time, 0 once they run out."""

    def __init__(self, data):
        self.data, self.position = data, 0

    def byte(self):
        if self.position >= len(self.data):
            return 0
        self.position += 1
        return self.data[self.position - 1]

    def int64(self):
        value = 0
        for _ in range(8):
            value = value << 8 | self.byte()
        return value - (1 << 64) if value >> 63 else value % 97 - 8

    def value(self):
        choice = self.byte() % 8
        if choice == 0:
            return bool(self.byte() & 1)
        if choice == 1:
            return None
        if choice == 2:
            return float(self.int64())
        if choice == 3:
            return "x"
        if choice == 4:
            return (self.int64() % (1 << 64)) << (self.byte() % 80)
        return self.int64()

    def tuple(self, length):
        return tuple(self.int64() if self.byte() % 5 else self.value() for _ in range(length))


class Holder:
    def __init__(self, iface):
        self.__array_interface__ = iface


def exercise_buffer(view, choice):
    flags = REQUESTS[choice % len(REQUESTS)]
    buffer = Py_buffer()
    try:
        get_buffer(view, ctypes.byref(buffer), flags)
    except BufferError:
        return
    try:
        length = buffer.itemsize
        if buffer.shape:
            for i in range(buffer.ndim):
                length *= buffer.shape[i]
        else:
            length = buffer.len
        assert length == buffer.len
        assert buffer.obj is view
        assert not (flags & PyBUF_WRITABLE and buffer.readonly)
        assert (flags & PyBUF_STRIDES) == PyBUF_STRIDES or is_contiguous(ctypes.byref(buffer), b"C")
    finally:
        release_buffer(ctypes.byref(buffer))


def replay(data):
    # The typestr parser alone, on the raw bytes.
    typestr_alone = data[:8].decode("latin-1")
    try:
        cai2dlpack(Holder({"shape": (), "typestr": typestr_alone, "data": (MEMORY_ADDRESS, False), "version": 3}))
    except (TypeError, ValueError, BufferError):
        pass
    source = Input(data)
    flags = source.byte()
    typestr = "".join(chr(source.byte() & 0x7F) for _ in range(source.byte() % 6)).split("\0")[0]
    ndim = source.byte() % 70
    iface = {"typestr": typestr if flags & 0x80 else None}
    iface["shape"] = source.tuple(ndim) if flags & 1 else source.value()
    if flags & 2:
        iface["strides"] = source.tuple(ndim) if flags & 4 else source.value()
    if flags & 8:
        iface["data"] = memoryview(MEMORY)[:source.byte() * 16]
        iface["offset"] = source.value()
    else:
        iface["data"] = (MEMORY_ADDRESS + source.byte(), True if flags & 16 else source.value())
    iface["version"] = source.value() if flags & 32 else 3
    if flags & 64:
        iface["mask"] = True
    try:
        capsule = cai2dlpack(Holder(iface), max_version=(1, 0) if source.byte() & 1 else None)
    except (TypeError, ValueError, BufferError, OverflowError):
        return "refused"
    view = dlpack2cai(capsule)
    assert view.__array_interface__["shape"] == view.shape  # a tensor we made always reads back
    exercise_buffer(view, source.byte())
    return "accepted"


@pytest.mark.parametrize("name", FILES)
def test_corpus_input_replays(name):
    with open(os.path.join(CORPUS, name), "rb") as file:
        replay(file.read())


def test_corpus_reaches_both_outcomes():
    outcomes = set()
    for name in FILES:
        with open(os.path.join(CORPUS, name), "rb") as file:
            outcomes.add(replay(file.read()))
    assert outcomes == {"refused", "accepted"}


# ---- tests/fuzz/corpus_doors: fuzz_doors.c's inputs, decoded the same way and sent through the same doors by
# ctypes (support/doors.py) ---------------------------------------------------------------------------------

DOORS_CORPUS = os.path.join(os.path.dirname(__file__), os.pardir, "fuzz", "corpus_doors")
DOORS_FILES = sorted(os.listdir(DOORS_CORPUS))
EXTREMES = [0, 1, 2, 3, -1, -2, -(2**63), 2**63 - 1, 2**31, 2**32 + 1, 2**61 - 1, 2**62, 2**60 + 1, 2**33,
            2**40 + 7, 2**58]
DEVICE_TYPES = [1, 2, 3, 13, 0, 4, 7, 10, 99, 2**31 - 1, -1]
STREAMS = [-1, 1, 2, 0x5000, 0, -2, -5, -(2**63), 2**63 - 1]
BITS = [8, 16, 32, 64, 1, 4, 6, 0, 128, 255]
LANES = [1, 1, 1, 2, 4, 0, 65535]
TYPESTRS = ["<f4", "|u1", "<i8", "<c16", "<V2", "|b1", ">f4", "<f16"]
CAPSULE_NAMES = [b"dltensor", b"dltensor_versioned", b"used_dltensor", b"used_dltensor_versioned", None, b"",
                 b"dltensor_", b"DLTENSOR"]
CANARY = 0x5A5A5A5A5A5A5A5A


class DoorsInput(Input):
    def int64(self):
        choice = self.byte()
        if choice < 128:
            return choice % 10
        if choice < 240:
            return EXTREMES[choice % 16]
        value = 0
        for _ in range(8):
            value = value << 8 | self.byte()
        return value - (1 << 64) if value >> 63 else value

    def stream(self):
        return STREAMS[self.byte() % len(STREAMS)]

    def dtype(self):
        return self.byte() % 22, BITS[self.byte() % 10], LANES[self.byte() % 7]

    def ndim(self):
        choice = self.byte()
        return choice % 6 if choice < 250 else {250: -1, 251: 65}.get(choice, 64)


def replay_allocator(source):
    dtype = source.dtype()
    device = (DEVICE_TYPES[source.byte() % len(DEVICE_TYPES)], source.byte() % 6 - 1)
    ndim = source.ndim()
    shape = [source.int64() if i < ndim else 0 for i in range(70)]
    null_shape = source.byte() % 16 == 0
    try:
        made = doors.allocate(dtype, shape, device, ndim=ndim, null_shape=null_shape)
    except doors.AllocationRefused as refusal:
        assert refusal.kind in ("ValueError", "MemoryError", "RuntimeError", "OverflowError"), refusal
        return "refused"
    fields = made.fields()
    itemsize = (dtype[1] * dtype[2] + 7) // 8
    nbytes = itemsize * math.prod(shape[:ndim])
    assert 0 <= ndim <= 64 and fields["shape"] == tuple(shape[:ndim]) and fields["dtype"] == dtype
    assert nbytes < 2**63 and libc.malloc_usable_size(fields["data"]) >= nbytes
    if device[0] == 1 and nbytes <= 1 << 20:
        ctypes.memset(fields["data"], 0xA5, nbytes)
    pointer, made.pointer = made.pointer, None
    try:
        view = doors.object_from_managed(pointer)
    except (BufferError, ValueError, TypeError):
        return "refused"
    assert view.shape == tuple(shape[:ndim])
    return "accepted"


def replay_tensor_to_view(source):
    version = (source.byte() % 3, source.byte() % 4)
    flags = source.byte() % 4
    data = MEMORY_ADDRESS + source.byte()
    device = (DEVICE_TYPES[source.byte() % len(DEVICE_TYPES)], source.byte() % 3)
    ndim = source.ndim()
    dtype = source.dtype()
    dims, steps = [], []
    for i in range(70):
        dims.append(source.int64() if i < ndim else 0)
        steps.append(source.int64() if i < ndim else 0)
    layout = source.byte()
    made = MadeTensor(data=data, device=device, dtype=dtype, shape=dims, strides=None if layout & 16 else steps,
                      byte_offset=source.byte(), version=version, flags=flags, ndim=ndim,
                      null_shape=layout % 16 == 0)
    pointer = ctypes.cast(ctypes.pointer(made.managed), doors.ManagedPointer)
    try:
        if source.byte() & 1:
            view = doors.view_from_managed_tensor(pointer, source.stream())
        else:
            view = doors.object_from_managed(pointer)
    except (BufferError, ValueError, TypeError):
        assert made.deleted == 1  # a door that steals a tensor and fails has let it go
        return "refused"
    assert made.deleted == 0 and view.shape == tuple(dims[:ndim])
    del view
    assert made.deleted == 1
    return "accepted"


def replay_c_api(source):
    flags = source.byte()
    ndim = source.byte() % 70 if flags & 64 else source.byte() % 5
    shape, strides = [], []
    for _ in range(ndim):
        shape.append(source.int64())
        if flags & 2:
            strides.append((source.int64() * 4 + 2**63) % 2**64 - 2**63)
    as_sequence = list if flags & 1 else tuple
    iface = {"shape": as_sequence(shape), "strides": as_sequence(strides) if flags & 2 else None,
             "typestr": TYPESTRS[source.byte() % 8], "data": (MEMORY_ADDRESS + source.byte(), bool(flags & 4)),
             "version": 3}
    holder = Holder(iface)
    stream = source.stream()
    try:
        if source.byte() & 1:
            doors.to_managed_tensor(holder, stream).delete()
            return "accepted"
        capacity = source.byte() % 70 - 2
        shape_out = (ctypes.c_int64 * 72)(*[CANARY] * 72)
        strides_out = (ctypes.c_int64 * 72)(*[CANARY] * 72)
        tensor, read_only = doors.DLTensor(), ctypes.c_int(-1)
        try:
            doors._check_status("fill_tensor", doors.C_API.fill_tensor(
                holder, stream, ctypes.byref(tensor), shape_out, strides_out, capacity, ctypes.byref(read_only)))
            assert tensor.ndim <= capacity and read_only.value in (0, 1)
            return "accepted"
        finally:
            assert all(value == CANARY for value in shape_out[max(capacity, 0):])  # nothing past the capacity
            assert all(value == CANARY for value in strides_out[max(capacity, 0):])
    except (TypeError, ValueError, BufferError):
        return "refused"


def replay_capsule(source):
    name = CAPSULE_NAMES[source.byte() % 8]
    name = b"dltensor_versioned" if name == b"dltensor" else name
    made = MadeTensor(data=MEMORY_ADDRESS, dtype=(2, 32, 1), shape=(4,))
    capsule = made.capsule if name == b"dltensor_versioned" else ctypes.pythonapi.PyCapsule_New(
        MEMORY_ADDRESS, name, None)
    outcomes = []
    for _ in range(2):
        try:
            dlpack2cai(capsule)
            outcomes.append("accepted")
        except (TypeError, BufferError):
            outcomes.append("refused")
    assert outcomes == (["accepted", "refused"] if name == b"dltensor_versioned" else ["refused", "refused"])
    assert made.deleted == (name == b"dltensor_versioned")
    return outcomes[0]


def replay_doors(data):
    source = DoorsInput(data)
    door = source.byte() % 4
    return door, [replay_allocator, replay_tensor_to_view, replay_c_api, replay_capsule][door](source)


@pytest.mark.parametrize("name", DOORS_FILES)
def test_doors_corpus_input_replays(cudart, name):
    with open(os.path.join(DOORS_CORPUS, name), "rb") as file:
        replay_doors(file.read())


def test_doors_corpus_reaches_every_door_and_both_outcomes(cudart):
    outcomes = set()
    for name in DOORS_FILES:
        with open(os.path.join(DOORS_CORPUS, name), "rb") as file:
            outcomes.add(replay_doors(file.read()))
    assert outcomes >= {(door, outcome) for door in range(4) for outcome in ("accepted", "refused")}
