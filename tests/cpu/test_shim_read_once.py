"""The shim's read-once rule: a conversion (a consumer's __dlpack_device__, then its __dlpack__) reads the
wrapped object's interface once and asks the runtime where its pointer lives once. What __dlpack_device__
read is used by the next __dlpack__ of the same shim on the same thread only; every other call reads
afresh, so a wrapped object that changes between conversions is seen as it is now."""
import sys
import sysconfig
import textwrap
import threading

import numpy as np
import pytest

from cai_dlpack import DLPackShim, dlpack2cai
from support import c_example
from support.cai_objects import register
from support.cuda_double import DEVICE
from support.fresh_process import LEGACY_SUBINTERPRETER, run_with_double


class CountingCai:
    """A CAI producer whose property builds a new dict on every access, as CuPy's and Numba's do, and
    counts the accesses."""

    def __init__(self, array):
        self.array = array
        self.reads = 0

    @property
    def __cuda_array_interface__(self):
        self.reads += 1
        return {"shape": self.array.shape, "typestr": self.array.dtype.str, "strides": self.array.strides,
                "data": (self.array.__array_interface__["data"][0], False), "version": 3, "stream": None}


@pytest.fixture
def device_arrays(cudart):
    """Two arrays the double reports as device memory (the second for a producer that changes)."""
    first, second = np.arange(12, dtype=np.float32), np.arange(20, dtype=np.float32)
    register(cudart, first, DEVICE)
    register(cudart, second, DEVICE)
    return first.reshape(3, 4), second.reshape(4, 5)


def pointer_queries(cudart):
    return sum(line.startswith("cudaPointerGetAttributes") for line in cudart.log())


def convert(shim):
    """What torch.from_dlpack does with a CUDA producer, then a view of the capsule."""
    shim.__dlpack_device__()
    return dlpack2cai(shim.__dlpack__(stream=None, max_version=(1, 0)))


def test_one_conversion_reads_once(cudart, device_arrays):
    producer = CountingCai(device_arrays[0])
    shim = DLPackShim(producer)
    cudart.clear_log()
    view = convert(shim)
    assert (producer.reads, pointer_queries(cudart)) == (1, 1)
    assert view.shape == (3, 4) and view.__cuda_array_interface__["data"][0] == device_arrays[0].ctypes.data


def test_a_change_between_conversions_is_seen(cudart, device_arrays):
    producer = CountingCai(device_arrays[0])
    shim = DLPackShim(producer)
    assert convert(shim).shape == (3, 4)
    producer.array = device_arrays[1]
    view = convert(shim)
    assert view.shape == (4, 5) and view.__cuda_array_interface__["data"][0] == device_arrays[1].ctypes.data
    assert producer.reads == 2


def test_dlpack_alone_reads_every_time(cudart, device_arrays):
    producer = CountingCai(device_arrays[0])
    shim = DLPackShim(producer)
    dlpack2cai(shim.__dlpack__(max_version=(1, 0)))
    producer.array = device_arrays[1]
    assert dlpack2cai(shim.__dlpack__(max_version=(1, 0))).shape == (4, 5)
    assert producer.reads == 2


def test_another_conversion_drops_the_reading(cudart, device_arrays):
    """The C API reads afresh, and the __dlpack__ after it does not use what the earlier device call read."""
    example = c_example.build()
    producer = CountingCai(device_arrays[0])
    shim = DLPackShim(producer)
    shim.__dlpack_device__()
    producer.array = device_arrays[1]
    assert example.fill(shim, -1)["shape"] == (4, 5)
    assert dlpack2cai(shim.__dlpack__(max_version=(1, 0))).shape == (4, 5)
    assert producer.reads == 3


def test_another_threads_dlpack_reads_afresh(cudart, device_arrays):
    producer = CountingCai(device_arrays[0])
    shim = DLPackShim(producer)
    shim.__dlpack_device__()
    producer.array = device_arrays[1]
    shapes = []
    worker = threading.Thread(target=lambda: shapes.append(dlpack2cai(shim.__dlpack__(max_version=(1, 0))).shape))
    worker.start()
    worker.join()
    assert shapes == [(4, 5)] and producer.reads == 2
    assert dlpack2cai(shim.__dlpack__(max_version=(1, 0))).shape == (4, 5)  # the reading went with the thread
    assert producer.reads == 3


@pytest.mark.skipif(bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
                    reason="a free-threaded CPython loads no single-phase module (ours) in any subinterpreter")
def test_a_legacy_subinterpreters_thread_with_the_same_state_id_reads_afresh(cudart):
    """A legacy subinterpreter can reach a shim of the main interpreter (this module is single-phase), and every
    interpreter numbers its thread states from 1: a reading is told apart by the process-wide thread serial, so a
    subinterpreter thread whose state has the id of the main thread that read the device does not take that reading
    (a freed array's pointer and shape), as a tag by thread-state id would (the second review of 1228022)."""
    words = run_with_double(LEGACY_SUBINTERPRETER + textwrap.dedent("""
        import ctypes, threading
        from cai_dlpack import DLPackShim
        ctypes.pythonapi.PyThreadState_Get.restype = ctypes.c_void_p
        ctypes.pythonapi.PyThreadState_GetID.restype = ctypes.c_uint64
        ctypes.pythonapi.PyThreadState_GetID.argtypes = [ctypes.c_void_p]
        state_id = lambda: ctypes.pythonapi.PyThreadState_GetID(ctypes.pythonapi.PyThreadState_Get())

        class Counting:  # asks nothing of NumPy when read (NumPy does not load in a subinterpreter)
            def __init__(self, array):
                self.array, self.reads = array, 0

            @property
            def array(self):
                return self._array

            @array.setter
            def array(self, array):
                self._array, self._interface = array, (array.shape, array.ctypes.data)

            @property
            def __cuda_array_interface__(self):
                self.reads += 1
                shape, pointer = self._interface
                return {"shape": shape, "typestr": "<f4", "strides": None, "version": 3, "data": (pointer, False),
                        "stream": None}

        first, second = np.arange(12, dtype=np.float32), np.arange(20, dtype=np.float32)
        register(double, first, DEVICE)
        register(double, second, DEVICE)
        producer = Counting(first.reshape(3, 4))
        shim = DLPackShim(producer)
        for _ in range(40):  # the main interpreter's ids run ahead of the subinterpreter's
            threading.Thread(target=lambda: None).start()
        reader = []
        thread = threading.Thread(target=lambda: (reader.append(state_id()), shim.__dlpack_device__()))
        thread.start()
        thread.join()
        producer.array = second.reshape(4, 5)
        found = []
        code = "\\n".join([
            "import ctypes, threading",
            "from cai_dlpack import dlpack2cai",
            "ctypes.pythonapi.PyThreadState_Get.restype = ctypes.c_void_p",
            "ctypes.pythonapi.PyThreadState_GetID.restype = ctypes.c_uint64",
            "ctypes.pythonapi.PyThreadState_GetID.argtypes = [ctypes.c_void_p]",
            f"shim = ctypes.cast({id(shim)}, ctypes.py_object).value",
            "def convert_if_the_same_id():",
            f"    if ctypes.pythonapi.PyThreadState_GetID(ctypes.pythonapi.PyThreadState_Get()) == {reader[0]}:",
            "        print('same-id', *dlpack2cai(shim.__dlpack__(max_version=(1, 0))).shape, flush=True)",
            "for _ in range(200):",
            "    worker = threading.Thread(target=convert_if_the_same_id)",
            "    worker.start()",
            "    worker.join()"])
        runner = threading.Thread(target=lambda: found.append(run(code)))
        runner.start()
        runner.join()
        print(found, producer.reads, flush=True)
        os._exit(0)  # (the subinterpreter is not destroyed: its end is not what this test is about)
    """))
    assert words == ["same-id", "4", "5", "[None]", "2"]


def test_a_new_thread_with_a_dead_threads_ident_reads_afresh(cudart, device_arrays):
    """The OS hands a finished thread's ident to the next thread it starts: a reading is the thread's, not the
    ident's, or a new thread would export a dead thread's old pointer and shape."""
    producer = CountingCai(device_arrays[0])
    shim = DLPackShim(producer)
    first = {}

    def read_device():
        first["ident"] = threading.get_ident()
        shim.__dlpack_device__()

    reader = threading.Thread(target=read_device)
    reader.start()
    reader.join()
    producer.array = device_arrays[1]
    # A few tries for a thread that gets the reader's ident (glibc reuses it at once); each try that does not
    # leaves the reading in place, since only a __dlpack__ takes it.
    results = []
    for _ in range(200):
        def convert_if_same_ident():
            if threading.get_ident() == first["ident"]:
                results.append(dlpack2cai(shim.__dlpack__(max_version=(1, 0))).shape)
        worker = threading.Thread(target=convert_if_same_ident)
        worker.start()
        worker.join()
        if results:
            break
    if not results:
        # (AddressSanitizer's thread stacks, hence pthread idents, are not handed out again at once)
        pytest.skip("no new thread got the finished thread's ident in 200 tries: nothing to check")
    assert results == [(4, 5)]  # the array as it is now, not the dead thread's reading of the old one
    assert producer.reads == 2


def test_a_refused_dlpack_drops_the_reading(cudart, device_arrays):
    producer = CountingCai(device_arrays[0])
    shim = DLPackShim(producer)
    shim.__dlpack_device__()
    with pytest.raises(TypeError):
        shim.__dlpack__(stream="the default one")
    producer.array = device_arrays[1]
    assert dlpack2cai(shim.__dlpack__(max_version=(1, 0))).shape == (4, 5)


def test_a_device_call_that_fails_leaves_nothing(cudart, device_arrays):
    producer = CountingCai(device_arrays[0])
    shim = DLPackShim(producer)
    cudart.fail("cudaPointerGetAttributes", 1)
    with pytest.raises(Exception, match="cudaPointerGetAttributes"):
        shim.__dlpack_device__()
    assert dlpack2cai(shim.__dlpack__(max_version=(1, 0))).shape == (3, 4)
    assert producer.reads == 2


class ReadyHost:
    """Host memory behind an instance's ready __array_interface__ dict (its type has none)."""

    def __init__(self, iface):
        self.__array_interface__ = iface


def test_host_memory_needs_no_reading_to_name_its_device():
    x = np.arange(6.0)
    shim = DLPackShim(ReadyHost(dict(x.__array_interface__)))
    assert shim.__dlpack_device__() == (1, 0)
    np.testing.assert_array_equal(np.from_dlpack(shim), x)
    broken = dict(x.__array_interface__)
    del broken["typestr"]
    shim = DLPackShim(ReadyHost(broken))
    assert shim.__dlpack_device__() == (1, 0)  # not parsed: array-interface memory is host memory
    with pytest.raises(ValueError, match="lacks the required key 'typestr'"):
        shim.__dlpack__()


def test_naming_the_device_of_an_instances_host_interface_keeps_no_reference_to_it():
    """The instance's own __array_interface__ is only asked for (its presence says host memory): the dict the
    lookup returned is let go, 100 calls later its count is as before."""
    iface = dict(np.arange(6.0).__array_interface__)
    shim = DLPackShim(ReadyHost(iface))
    before = sys.getrefcount(iface)
    for _ in range(100):
        assert shim.__dlpack_device__() == (1, 0)
    assert sys.getrefcount(iface) == before


def test_an_object_with_neither_interface_is_refused_by_either_call():
    shim = DLPackShim(object())
    for call in (shim.__dlpack_device__, shim.__dlpack__):
        with pytest.raises(TypeError, match="neither __cuda_array_interface__ nor __array_interface__"):
            call()


class LateInterface:
    """An object whose __array_interface__ (over a bytearray it holds) appears from its second lookup on: the
    shim's device lookup finds neither interface, and the reader, asked next, finds one."""

    def __init__(self):
        self.lookups = 0
        self.buffer = bytearray(4)

    def __getattr__(self, name):
        if name != "__array_interface__":
            raise AttributeError(name)
        self.lookups += 1
        if self.lookups < 2:
            raise AttributeError(name)
        return {"shape": (4,), "typestr": "|u1", "data": self.buffer, "version": 3}


def test_an_interface_that_appears_while_the_device_is_asked_is_read_and_let_go():
    """The reader decides the device of an object whose interface the lookup did not find, and keeps nothing of
    what it read: the buffer it exported is given back (the bytearray can grow again, its count is as before)."""
    obj = LateInterface()
    buffer = obj.buffer
    before = sys.getrefcount(buffer)
    assert DLPackShim(obj).__dlpack_device__() == (1, 0)
    assert obj.lookups == 2
    after = sys.getrefcount(buffer)
    assert after == before
    buffer.extend(b"more")  # BufferError while an export is held
    assert len(buffer) == 8


def test_a_shims_repr_names_the_wrapped_object_and_reads_nothing(cudart, device_arrays):
    wrapped = CountingCai(device_arrays[0])
    shim = DLPackShim(wrapped)
    assert repr(shim) == f"cai_dlpack.DLPackShim({wrapped!r})"
    assert repr(DLPackShim(np.arange(2.0))) == "cai_dlpack.DLPackShim(array([0., 1.]))"
    assert wrapped.reads == 0


class Switching:
    """Host memory through its type's __array_interface__ property, and a __cuda_array_interface__ (memory the
    double reports as device memory) that __getattr__ serves while `device` is set; counts the lookups of the
    CUDA one."""

    def __init__(self, host, device=None):
        self.host, self.device, self.cai_lookups = host, device, 0

    @property
    def __array_interface__(self):
        return dict(self.host.__array_interface__)

    def __getattr__(self, name):
        if name == "__cuda_array_interface__":
            self.cai_lookups += 1
            if self.device is not None:
                return {"shape": self.device.shape, "typestr": self.device.dtype.str, "strides": None,
                        "data": (self.device.ctypes.data, False), "version": 3, "stream": None}
        raise AttributeError(name)


def exported_pointer(capsule):
    """(the interface the view of capsule speaks, its data pointer)."""
    view = dlpack2cai(capsule)
    for name in ("__cuda_array_interface__", "__array_interface__"):
        if hasattr(view, name):
            return name, getattr(view, name)["data"][0]
    raise AssertionError(f"a view with neither interface: {view!r}")


def test_a_host_conversion_asks_for_the_cuda_interface_once():
    """__dlpack_device__ found no CUDA interface: the __dlpack__ after it on the thread reads the array interface
    without asking again (a failed lookup, the most a host object's conversion costs beyond its dict)."""
    host = np.arange(6.0)
    producer = Switching(host)
    shim = DLPackShim(producer)
    for conversion in (1, 2):
        assert shim.__dlpack_device__() == (1, 0)
        np.testing.assert_array_equal(np.asarray(dlpack2cai(shim.__dlpack__(max_version=(1, 0)))), host)
        assert producer.cai_lookups == conversion
    shim.__dlpack__(max_version=(1, 0))  # alone: asks
    assert producer.cai_lookups == 3


def test_a_cuda_interface_that_appears_after_the_device_call_waits_for_the_next_conversion(cudart, device_arrays):
    """The device the consumer was told is the memory it gets: host memory, though the object now speaks CAI;
    the next conversion sees the CUDA interface."""
    host = np.arange(6.0)
    producer = Switching(host)
    shim = DLPackShim(producer)
    assert shim.__dlpack_device__() == (1, 0)
    producer.device = device_arrays[0]
    assert exported_pointer(shim.__dlpack__(max_version=(1, 0))) == ("__array_interface__", host.ctypes.data)
    assert shim.__dlpack_device__() == (2, 0)
    assert exported_pointer(shim.__dlpack__(max_version=(1, 0))) == ("__cuda_array_interface__",
                                                                     device_arrays[0].ctypes.data)


def test_another_threads_host_mark_is_not_used():
    host = np.arange(6.0)
    producer = Switching(host)
    shim = DLPackShim(producer)
    assert shim.__dlpack_device__() == (1, 0)
    pointers = []
    worker = threading.Thread(target=lambda: pointers.append(exported_pointer(shim.__dlpack__(max_version=(1, 0)))))
    worker.start()
    worker.join()
    assert pointers == [("__array_interface__", host.ctypes.data)]
    assert producer.cai_lookups == 2  # the worker asked for the CUDA interface itself


def test_a_device_call_that_says_host_drops_a_cuda_reading_kept_before(cudart, device_arrays):
    """A CAI reading kept by one __dlpack_device__ is not exported after a later one said host memory: the object
    lost its CUDA interface in between, and the capsule is the host memory the consumer was told of."""
    host = np.arange(6.0)
    producer = Switching(host, device=device_arrays[0])
    shim = DLPackShim(producer)
    assert shim.__dlpack_device__() == (2, 0)
    producer.device = None
    assert shim.__dlpack_device__() == (1, 0)
    assert exported_pointer(shim.__dlpack__(max_version=(1, 0))) == ("__array_interface__", host.ctypes.data)


def test_an_object_that_moved_to_the_device_after_the_device_call_is_read_as_it_is(cudart, device_arrays):
    """The host mark only spares __dlpack__ the CUDA lookup: an object that lost its array interface and gained a
    CUDA one since is read whole (its CUDA memory), not refused as having neither."""

    class Moving:
        pass

    host = np.arange(4.0)
    obj = Moving()
    obj.__array_interface__ = host.__array_interface__
    shim = DLPackShim(obj)
    assert shim.__dlpack_device__() == (1, 0)
    del obj.__array_interface__
    device = device_arrays[0]
    obj.__cuda_array_interface__ = {"shape": device.shape, "typestr": device.dtype.str, "strides": None,
                                    "data": (device.ctypes.data, False), "version": 3, "stream": None}
    assert exported_pointer(shim.__dlpack__(max_version=(1, 0))) == ("__cuda_array_interface__", device.ctypes.data)
    del obj.__cuda_array_interface__  # and one that has neither now is refused as such
    obj.__array_interface__ = host.__array_interface__
    assert shim.__dlpack_device__() == (1, 0)
    del obj.__array_interface__
    with pytest.raises(TypeError, match="neither __cuda_array_interface__ nor __array_interface__"):
        shim.__dlpack__(max_version=(1, 0))


def test_a_host_mark_is_its_threads_alone_whatever_the_threads_order():
    """Threads one after another (their marks' numbers consecutive, both parities in turn: a spacer thread shifts
    them): a mark left by one thread's __dlpack_device__ never spares the next thread's __dlpack__ its lookup."""
    host = np.arange(6.0)
    producer = Switching(host)
    shim = DLPackShim(producer)

    def in_a_thread(call):
        worker = threading.Thread(target=call)
        worker.start()
        worker.join()

    for _ in range(4):
        for _ in range(3):
            before = producer.cai_lookups
            in_a_thread(shim.__dlpack_device__)
            in_a_thread(lambda: shim.__dlpack__(max_version=(1, 0)))
            assert producer.cai_lookups == before + 2
        in_a_thread(DLPackShim(host).__dlpack_device__)  # a spacer: one more thread numbered


def test_a_device_call_that_fails_drops_the_reading_before_it(cudart, device_arrays):
    """What an earlier __dlpack_device__ read is not used after a later one failed: __dlpack__ reads afresh."""
    producer = CountingCai(device_arrays[0])
    shim = DLPackShim(producer)
    assert shim.__dlpack_device__() == (2, 0)
    producer.array = device_arrays[1]
    cudart.fail("cudaPointerGetAttributes", 1)
    with pytest.raises(Exception, match="cudaPointerGetAttributes"):
        shim.__dlpack_device__()
    assert dlpack2cai(shim.__dlpack__(max_version=(1, 0))).shape == (4, 5)


def test_a_missing_array_interface_after_the_device_call_is_asked_once():
    """A type whose __array_interface__ property says AttributeError is named host memory by __dlpack_device__ (the
    type has the attribute); its __dlpack__ then asks each interface once, as any conversion, and refuses."""
    asked = []

    class Refusing:
        @property
        def __array_interface__(self):
            asked.append("__array_interface__")
            raise AttributeError("__array_interface__")

        def __getattr__(self, name):  # also what getattr falls back on when the property says AttributeError
            if name != "__array_interface__":
                asked.append(name)
            raise AttributeError(name)

    shim = DLPackShim(Refusing())
    assert shim.__dlpack_device__() == (1, 0)
    assert asked == ["__cuda_array_interface__"]
    asked.clear()
    with pytest.raises(TypeError, match="neither __cuda_array_interface__ nor __array_interface__"):
        shim.__dlpack__(max_version=(1, 0))
    assert sorted(asked) == ["__array_interface__", "__cuda_array_interface__"]


def test_a_cuda_interface_found_after_all_keeps_no_reference_to_its_property(cudart, device_arrays):
    """After a host mark, an object that moved to the device through its type (a __cuda_array_interface__ property
    set on the class, the array interface gone) is read through that property, which is not kept."""
    device = device_arrays[0]

    class Moving:
        pass

    def cai(self):
        return {"shape": device.shape, "typestr": device.dtype.str, "strides": None,
                "data": (device.ctypes.data, False), "version": 3, "stream": None}

    prop = property(cai)
    host = np.arange(4.0)
    before = sys.getrefcount(prop)
    for _ in range(20):
        obj = Moving()
        obj.__array_interface__ = host.__array_interface__
        shim = DLPackShim(obj)
        assert shim.__dlpack_device__() == (1, 0)
        Moving.__cuda_array_interface__ = prop
        del obj.__array_interface__
        assert exported_pointer(shim.__dlpack__(max_version=(1, 0))) == ("__cuda_array_interface__",
                                                                         device.ctypes.data)
        del Moving.__cuda_array_interface__, shim, obj
    assert sys.getrefcount(prop) == before
