"""An exact numpy.ndarray is read from its fields, a subclass through the buffer protocol (its type implements
__array_interface__ in C and exports a buffer); everything they cannot say goes through __array_interface__.
The readings must give the same tensor, and the same errors."""
import ctypes
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cai_dlpack import DLPackShim, cai2dlpack, dlpack2cai
from support import c_example
from support.dlpack_ctypes import read_capsule
from test_host_peers import DTYPES, layouts, sample


class InterfaceOnly:
    """The same array seen through its __array_interface__ dict alone (no buffer)."""

    def __init__(self, array):
        self.array = array
        self.__array_interface__ = array.__array_interface__


@pytest.mark.parametrize("dtype", DTYPES + ["l", "q", "L", "Q", "intc", "uintc"])
@pytest.mark.parametrize("layout", ["c_order", "f_order", "sliced", "negative", "broadcast", "zero_d",
                                    "zero_size", "one_d"])
@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_buffer_and_interface_give_the_same_tensor(dtype, layout, max_version):
    array = layouts(dtype if len(dtype) <= 3 else np.dtype(dtype).str[1:])[layout]
    if dtype in ("l", "q", "L", "Q", "intc", "uintc"):
        array = array.astype(dtype)  # the buffer formats 'l', 'q', 'L', 'Q', 'i', 'I'
    if max_version is None and not array.flags.writeable:  # no legacy capsule can say read-only
        for obj in (array, InterfaceOnly(array)):
            with pytest.raises(BufferError, match="the array is read-only"):
                cai2dlpack(obj)
        return
    through_buffer = read_capsule(cai2dlpack(array, max_version=max_version))
    through_interface = read_capsule(cai2dlpack(InterfaceOnly(array), max_version=max_version))
    assert through_buffer == through_interface
    assert through_buffer["data"] == array.__array_interface__["data"][0]


@pytest.mark.parametrize("array", [
    np.array([1.5, 2.5], dtype="e"),
    np.array([1 + 2j], dtype="c8"),
    np.array([True, False]),
    np.broadcast_to(np.float32(3), (4, 4)),
], ids=["f2", "c8", "bool", "read_only_broadcast"])
def test_read_only_flag_and_values_come_through(array):
    capsule_fields = read_capsule(cai2dlpack(array, max_version=(1, 0)))
    assert bool(capsule_fields["flags"] & 1) == (not array.flags.writeable)
    assert np.from_dlpack(DLPackShim(array)).tolist() == array.tolist()


@pytest.mark.parametrize("array, message", [
    (np.zeros(3, "M8[ns]"), "'typestr' '<M8[ns]' has no DLPack equivalent"),  # NumPy exports no buffer
    (np.zeros(3, ">f4"), "'typestr' '>f4' has non-native byte order"),  # buffer format '>f'
    (np.zeros(3, [("a", "<f4"), ("b", "u1")])["a"], "'strides'[0] is 5 bytes, not a multiple"),
    (np.zeros(3, "V8"), "'typestr' '|V8' has no DLPack equivalent"),  # format '8x'
    (np.zeros(3, [("a", "<f4")]), "'typestr' '|V4' has no DLPack equivalent"),  # format 'T{<f:a:}'
    (np.zeros(3, "O"), "'typestr' '|O' has no DLPack equivalent"),
    (np.zeros(3, "S4"), "'typestr' '|S4' has no DLPack equivalent"),  # format '4s'
])
def test_what_the_buffer_cannot_say_gets_the_interface_error(array, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cai2dlpack(array)
    with pytest.raises(ValueError, match=re.escape(message)):
        DLPackShim(array).__dlpack__()


class OverridingInterface(np.ndarray):
    """A subclass whose Python-level __array_interface__ describes the first row only: it must win."""

    @property
    def __array_interface__(self):
        row = np.ndarray.__getitem__(self, 0)
        return np.ndarray.__array_interface__.__get__(row)


def test_python_level_interface_is_honoured():
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    array = base.view(OverridingInterface)
    fields = read_capsule(cai2dlpack(array))
    assert fields["shape"] == (4,)
    assert np.asarray(dlpack2cai(cai2dlpack(array))).tolist() == [0, 1, 2, 3]


def test_capsule_holds_the_buffer_until_it_dies():
    array = np.arange(6, dtype=np.int32)
    before = sys.getrefcount(array)
    capsule = cai2dlpack(array)
    assert sys.getrefcount(array) > before
    with pytest.raises(ValueError, match="resize"):
        array.resize(12)  # the capsule keeps references: NumPy refuses to move the memory
    del capsule
    assert sys.getrefcount(array) == before
    array.resize(12)
    assert array.shape == (12,)


def test_a_shims_capsule_gives_the_buffer_back_when_it_dies():
    """A shim's __dlpack__ of an object read through a buffer (an ndarray subclass; an interface whose 'data' is a
    bytearray): the capsule holds the export, and the export goes with the capsule, every time: the object's
    count is as before, and the bytearray, which refuses to resize while exported, resizes again."""

    class BytesInterface:
        pass

    sub = np.arange(6, dtype=np.int32).view(Subclass)
    data = bytearray(8)
    described = BytesInterface()
    described.__array_interface__ = {"shape": (8,), "typestr": "|u1", "data": data, "version": 3}
    for obj, exporter in ((sub, sub), (described, data)):
        shim = DLPackShim(obj)
        before = sys.getrefcount(exporter)
        for _ in range(3):
            capsule = shim.__dlpack__(max_version=(1, 0))
            assert sys.getrefcount(exporter) > before
            del capsule
            assert sys.getrefcount(exporter) == before
    data.extend(b"\0")
    assert len(data) == 9


@pytest.mark.parametrize("array", [np.zeros(4, dtype=[("a", "<f4"), ("b", "<i4")]), np.zeros(2, dtype="<U3")],
                         ids=["structured", "unicode"])
def test_a_buffer_the_reader_cannot_take_is_released_before_the_interface_is_read(array):
    """NumPy exports these arrays' buffers, in formats with no DLPack type: the reader gives the buffer back (and
    the reference it holds to the array) before it reads __array_interface__, which then refuses the type."""
    before = sys.getrefcount(array)
    for _ in range(3):
        with pytest.raises(ValueError, match="has no DLPack equivalent"):
            cai2dlpack(array)
    assert sys.getrefcount(array) == before


def assert_refusals_cost_no_memory(array):
    """200 refused conversions of array leave fewer than 100 blocks allocated, in the least of four rounds (a first
    round after warming up can still fill a cache; on a free-threaded build the count moves by up to about 90 a
    round on its own, under load); a block lost a call would be 200 each round."""
    import gc

    growth = []
    for _ in range(4):
        gc.collect()
        blocks = sys.getallocatedblocks()
        for _ in range(200):
            with pytest.raises(ValueError, match="has no DLPack equivalent"):
                cai2dlpack(array)
        gc.collect()
        growth.append(sys.getallocatedblocks() - blocks)
    assert min(growth) < 100, growth


def test_a_buffer_numpy_refuses_to_export_costs_no_memory():
    """A subclass of a type NumPy will not export a buffer of (datetime64: ValueError) is read through its
    interface, which refuses the type; each refused export frees what the reader set aside for it."""
    array = np.array(["2020-01-01", "2020-01-02"], dtype="M8[D]").view(Subclass)
    with pytest.raises(ValueError, match="cannot include dtype 'M' in a buffer"):
        memoryview(array)
    with pytest.raises(ValueError, match="'typestr' '<M8\\[D\\]' has no DLPack equivalent"):
        cai2dlpack(array)
    assert_refusals_cost_no_memory(array)


@pytest.mark.parametrize("array", [np.zeros(2, dtype="<U3"),
                                   np.zeros(4, dtype=[("a", "<f4"), ("b", "<i4")]).view(np.recarray)],
                         ids=["unicode", "structured subclass"])
def test_a_buffer_the_reader_cannot_take_costs_no_memory(array):
    """A buffer exported in a format with no DLPack type is given back, and so is what the reader set aside to hold
    it: a conversion refused by the interface afterwards leaves nothing allocated behind, however often it is
    made."""
    for _ in range(50):  # warm NumPy's and the reader's caches
        with pytest.raises(ValueError, match="has no DLPack equivalent"):
            cai2dlpack(array)
    assert_refusals_cost_no_memory(array)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="a Python-level __buffer__ (PEP 688) needs CPython 3.12")
def test_an_array_whose_buffer_export_raises_is_read_through_its_interface():
    """An ndarray subclass whose __buffer__ raises keeps NumPy's C __array_interface__: the reader's buffer export
    fails, the failure is dropped (not left pending behind a result), and the interface gives the same tensor."""

    class NoExport(np.ndarray):
        def __buffer__(self, flags):
            raise RuntimeError("no export today")

    a = np.arange(4.0).view(NoExport)
    with pytest.raises(RuntimeError, match="no export today"):
        memoryview(a)
    assert np.from_dlpack(DLPackShim(a)).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert read_capsule(cai2dlpack(a))["data"] == a.ctypes.data


class Subclass(np.ndarray):
    """An ndarray subclass: read through its buffer (its type is not numpy.ndarray), the reading the fields of an
    exact ndarray must agree with."""


def field_layouts(dtype):
    """layouts() and the ones whose strides the array, its buffer and its interface may each write differently:
    empty arrays of several dimensions, extents of 1 (in C and in Fortran order), a column."""
    base = sample(dtype, (6, 8))
    return {**layouts(dtype), "empty_rows": base[:, :0], "empty_columns": base[:0, :], "empty_middle": base[:2, :0, None],
            "extent_one": base[2:3, 1:2], "column": base[:, 3], "extent_one_strided": base[1:2, ::2],
            "f_extent_one": np.asfortranarray(base)[:, None, :], "f_extent_one_last": np.asfortranarray(base)[:, :, None],
            "read_only": np.frombuffer(base.tobytes(), dtype=base.dtype).reshape(base.shape)}


def steps(fields):
    """A capsule's fields with the strides of extents that never step (0 or 1) left out."""
    return {**fields, "strides": tuple(stride if extent > 1 else None
                                       for extent, stride in zip(fields["shape"], fields["strides"]))}


@pytest.mark.parametrize("dtype", DTYPES + ["l", "L", "intc", "uintc", "short", "ushort", "longlong", "ulonglong"])
@pytest.mark.parametrize("layout", list(field_layouts("f4")))
def test_an_ndarrays_fields_give_what_its_buffer_and_interface_give(dtype, layout):
    array = field_layouts(dtype if len(dtype) <= 3 else "f4")[layout]
    if len(dtype) > 3 or dtype in ("l", "L"):
        array = array.astype(dtype) if array.flags.writeable else array.astype(dtype).copy()
        if layout == "read_only":
            array.flags.writeable = False
    assert type(array) is np.ndarray
    fields = read_capsule(cai2dlpack(array, max_version=(1, 0)))
    assert fields == read_capsule(cai2dlpack(array.view(Subclass), max_version=(1, 0)))
    # The interface gives the array's own strides, which may differ where an extent of 1 never steps
    assert steps(fields) == steps(read_capsule(cai2dlpack(InterfaceOnly(array), max_version=(1, 0))))
    assert fields["data"] == array.__array_interface__["data"][0]
    assert bool(fields["flags"] & 1) == (not array.flags.writeable)


def test_an_ndarray_is_read_from_its_fields_and_holds_no_buffer_export():
    """The capsule of an exact ndarray holds the array (its owner) and nothing more: no buffer export (which would
    hold a second reference). A subclass is read through its buffer, which it holds."""
    for dtype in DTYPES:  # every type the fields are read for (float16 is NumPy's type number 23, after a gap)
        array = sample(dtype)
        before = sys.getrefcount(array)
        capsule = cai2dlpack(array)
        assert sys.getrefcount(array) == before + 1, dtype
        del capsule
    # Strides that are no multiple of the itemsize where an extent of 1 never steps, in arrays neither C nor
    # Fortran contiguous: still the fields.
    base = np.zeros(16)
    for shape, strides in [((1, 3), (3, 16)), ((3, 1), (16, 5)), ((2, 1, 2), (64, 1, 16))]:
        odd = np.lib.stride_tricks.as_strided(base, shape=shape, strides=strides)
        assert not (odd.flags.c_contiguous or odd.flags.f_contiguous)
        before = sys.getrefcount(odd)
        capsule = cai2dlpack(odd)
        assert sys.getrefcount(odd) == before + 1, strides
        del capsule
    for dtype in DTYPES:  # every type the buffer's formats name, the complex ones ('Zf', 'Zd') included
        sub = sample(dtype).view(Subclass)
        before = sys.getrefcount(sub)
        capsule = cai2dlpack(sub)
        assert sys.getrefcount(sub) == before + 2, dtype
        del capsule
        assert sys.getrefcount(sub) == before


@pytest.mark.parametrize("array, read_only", [
    # warns on its first write: writeable in its flags, read-only in its buffer (NumPy's flag of its own)
    (np.broadcast_arrays(np.arange(3.0), np.zeros((2, 1)))[0], True),
    (np.arange(3.0), False),
], ids=["warn_on_write", "plain"])
def test_an_ndarray_with_numpys_own_flags_says_what_its_buffer_says(array, read_only):
    fields = read_capsule(cai2dlpack(array, max_version=(1, 0)))
    assert bool(fields["flags"] & 1) == read_only == memoryview(array).readonly


@pytest.mark.parametrize("array, message", [
    (np.zeros(3, ">f4"), "'typestr' '>f4' has non-native byte order"),
    (np.zeros(3, "M8[ns]"), "'typestr' '<M8[ns]' has no DLPack equivalent"),
    # NumPy's type number just below float16's (NPY_TIMEDELTA 22, NPY_HALF 23): 8-byte items, never 2-byte floats
    (np.zeros(3, "m8[ns]"), "'typestr' '<m8[ns]' has no DLPack equivalent"),
    (np.zeros(3, "g"), "'typestr' '<f16' has no DLPack equivalent"),
    (np.zeros(3, "O"), "'typestr' '|O' has no DLPack equivalent"),
], ids=["big_endian", "datetime", "timedelta", "long_double", "object"])
def test_an_ndarray_its_fields_cannot_say_is_read_as_before(array, message):
    """A byte order, or a type the fields are not read for, goes to the buffer and then the interface: the same
    refusal, in the interface's words, every time."""
    for _ in range(2):
        with pytest.raises(ValueError, match=re.escape(message)):
            cai2dlpack(array)


def test_numpy_ndarray_is_read_from_its_fields_from_the_first_conversion_of_a_process():
    """The reader knows numpy.ndarray by its type from the first array it sees, in any process: a fresh interpreter
    reads its first array from the fields (the same in every test, whatever ran before it), as the next."""
    script = textwrap.dedent("""
        import sys
        import numpy as np
        from cai_dlpack import cai2dlpack
        array = np.arange(4.0)
        held = []
        for _ in range(2):
            before = sys.getrefcount(array)
            held.append(cai2dlpack(array))
            print(sys.getrefcount(array) - before)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))).stdout.split()
    assert out == ["1", "1"]


class CustomAttributes(np.ndarray):
    """An ndarray subclass whose attribute access is not the generic one (it has __getattr__): its type still
    implements __array_interface__ in C, so it is read through its buffer as any subclass."""

    def __getattr__(self, name):
        raise AttributeError(name)


def test_a_subclass_with_its_own_attribute_access_is_read_through_its_buffer():
    array = np.arange(6, dtype=np.int32).view(CustomAttributes)
    before = sys.getrefcount(array)
    capsule = cai2dlpack(array)
    held = sys.getrefcount(array)
    assert held == before + 2  # the capsule's owner and the buffer export it holds
    assert read_capsule(capsule)["data"] == array.ctypes.data
    del capsule
    assert sys.getrefcount(array) == before


@pytest.mark.parametrize("step", [2**62, -(2**62)])
def test_a_buffer_reaching_outside_the_address_space_gets_the_interface_error(step):
    """A subclass whose buffer describes items past either end of the address space (strides NumPy's as_strided
    allows): the reader refuses the buffer, and the interface, read instead, says why in its own words."""
    array = np.lib.stride_tricks.as_strided(np.zeros(4), shape=(5,), strides=(step,)).view(Subclass)
    for call in (lambda: cai2dlpack(array), lambda: DLPackShim(array).__dlpack__()):
        with pytest.raises(ValueError, match=re.escape("__array_interface__ 'shape' (5,) with these 'strides' "
                                                       "reaches outside the address space")):
            call()


ANOTHER_ARRAY = np.arange(3, dtype=np.int16)


class InterfaceOfAnotherArray(np.ndarray):
    """An ndarray subclass whose attribute access answers __array_interface__ with another array's: its type's
    interface is NumPy's C one, so its own buffer is read first."""

    def __getattribute__(self, name):
        if name == "__array_interface__":
            return ANOTHER_ARRAY.__array_interface__
        return super().__getattribute__(name)


def test_a_buffer_reaching_outside_the_address_space_leaves_no_error_behind_a_valid_interface():
    """The buffer reader refuses a buffer past the end of the address space quietly: the interface, read instead,
    describes an array the tensor then holds, with no exception left pending behind the result."""
    array = np.lib.stride_tricks.as_strided(np.zeros(4), shape=(5,), strides=(2**62,)).view(InterfaceOfAnotherArray)
    fields = read_capsule(cai2dlpack(array, max_version=(1, 0)))
    assert (fields["data"], fields["shape"]) == (ANOTHER_ARRAY.ctypes.data, (3,))
    assert np.from_dlpack(DLPackShim(array)).tolist() == [0, 1, 2]


class WideStringPointer(ctypes.c_wchar_p):
    """A ctypes wide-string pointer: its buffer is one 8-byte item in format '<Z', a 'Z' alone, which no type has
    (complex's formats are 'Zf' and 'Zd'). Its type carries a C getset under __array_interface__ (ctypes' own
    'value'), so its buffer is read first, and its attribute access answers the interface: the pointer as uint64."""

    __array_interface__ = ctypes._SimpleCData.__dict__["value"]

    def __getattribute__(self, name):
        if name == "__array_interface__":
            return {"shape": (), "typestr": "<u8", "data": (ctypes.addressof(self), False), "version": 3}
        return super().__getattribute__(name)


def test_a_buffer_format_of_one_character_that_only_starts_a_known_format_is_read_through_the_interface():
    """A format is known whole, never by its first character: a buffer in format 'Z' (8-byte items, as complex64's
    'Zf' has) is no complex64, and the interface, read instead, gives the pointer's uint64."""
    pointer = WideStringPointer("text")
    assert (memoryview(pointer).format, memoryview(pointer).itemsize) == ("<Z", 8)
    value = np.from_dlpack(DLPackShim(pointer))
    assert value.dtype == np.uint64 and int(value) == ctypes.cast(pointer, ctypes.c_void_p).value


@pytest.fixture(scope="module")
def buffer_exporter():
    return c_example.build_buffer_exporter()


@pytest.mark.parametrize("source,format,read_as", [
    (np.arange(3, dtype=np.int32), "f:x:", "float32"),  # one float32 named x (PEP 3118)
    (np.arange(3, dtype=np.uint16), "e0s", "float16"),  # a float16 and an empty string
], ids=["named field", "empty string after"])
def test_a_buffer_format_that_only_starts_with_a_known_format_is_read_through_the_interface(buffer_exporter, source,
                                                                                            format, read_as):
    """A format of several characters is known whole, never by its first one: a buffer whose format starts with a
    type's one-character format and whose items are that type's size is still no such type; the interface, read
    instead, gives the source's own type. The same exporter's buffer in that type's own format is read, and
    believed over the interface, so the buffer is what was read first."""
    believed = np.from_dlpack(DLPackShim(buffer_exporter.Exporter(source, np.dtype(read_as).char)))
    assert believed.dtype == np.dtype(read_as) and believed.ctypes.data == source.ctypes.data
    exported = buffer_exporter.Exporter(source, format)
    assert (memoryview(exported).format, memoryview(exported).itemsize) == (format, source.itemsize)
    value = np.from_dlpack(DLPackShim(exported))
    assert value.dtype == source.dtype and value.tolist() == source.tolist()
    assert value.ctypes.data == source.ctypes.data
    fields = read_capsule(cai2dlpack(exported, max_version=(1, 0)))
    assert (fields["data"], fields["shape"]) == (source.ctypes.data, (3,))
