"""Every input of the libFuzzer corpus (tests/fuzz/corpus), replayed through the installed module: the
same decoding as tests/fuzz/fuzz_interface.c turns each file into a typestr and an __array_interface__,
which goes through cai2dlpack, dlpack2cai, the view's interface and its buffer export. A crash the fuzzer
once found cannot come back unnoticed: each refusal must be a Python exception, each accepted array must
read back, and each buffer export must describe exactly its length."""
import ctypes
import os

import pytest

from cai_dlpack import cai2dlpack, dlpack2cai

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
