"""dlpack2cai and the C API as consumers of a producer's DLPack C exchange API: the tensor comes from the
table of the object's type instead of __dlpack__, and the producer's current work stream is ordered before
the consumer's by us. Driven through torch.Tensor's own table and through tests/exchange_producer, a
producer whose table the tests control."""
import ctypes
import gc
import sys
import weakref

import numpy as np
import pytest

from cai_dlpack import DLPackShim, UnsupportedArrayError, dlpack2cai, options
from support import c_example, doors
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE
from support.optional import needs_torch, torch

KDLCPU, KDLCUDA = 1, 2
S1, S2 = 0x5000, 0x6000


@pytest.fixture(scope="module")
def producer():
    return c_example.build_producer()


@pytest.fixture(scope="module")
def example():
    return c_example.build()


@pytest.fixture(autouse=True)
def fresh(request):
    if "producer" in request.fixturenames:
        request.getfixturevalue("producer").configure()
    yield


def address(view):
    return view.__array_interface__["data"][0]


def ordering(cudart):
    """(streams recorded on, streams made to wait) in the double's log. A record whose event no stream waits on is a
    dropped tensor's release (ordered after its consumer's stream), not ordering."""
    log = cudart.log()
    waited = {line.split(", ")[1] for line in log if line.startswith("cudaStreamWaitEvent")}
    records = [int(line.rsplit(", ", 1)[1].rstrip(")"), 0) for line in log
               if line.startswith("cudaEventRecord") and line.split("(", 1)[1].split(",")[0] in waited]
    waits = [int(line.split("(", 1)[1].split(",")[0], 0) for line in log if line.startswith("cudaStreamWaitEvent")]
    return records, waits


# ---- which path is taken ---------------------------------------------------------------------------------

class SpyTensor(torch.Tensor if torch is not None else object):
    """A torch.Tensor whose __dlpack__ must not be called: only the table can give its tensor."""

    def __dlpack__(self, *args, **kwargs):
        raise AssertionError("__dlpack__ was called although the type publishes an exchange table")


@needs_torch
def test_a_torch_tensor_is_taken_through_its_table(example):
    t = torch.arange(12.0).reshape(3, 4)[:, 1:]
    spy = t.as_subclass(SpyTensor)
    view = dlpack2cai(spy)
    assert address(view) == t.data_ptr() and view.strides == (16, 4)
    np.testing.assert_array_equal(np.asarray(view), t.numpy())
    assert example.managed(spy, -1)["data"] == t.data_ptr()
    fields = example.fill(spy, -1)
    assert (fields["data"], fields["shape"], fields["strides"]) == (t.data_ptr(), (3, 3), (4, 1))


@pytest.mark.parametrize("kind", ["Tensor", "AddressTensor", "ChainedTensor"])
def test_every_readable_table_is_taken(producer, kind):
    x = np.arange(6.0).reshape(2, 3)
    view = dlpack2cai(getattr(producer, kind)(x))
    counts = producer.counts()
    assert (counts["from_object"], counts["dlpack"]) == (1, 0)
    assert address(view) == x.__array_interface__["data"][0]
    np.testing.assert_array_equal(np.asarray(view), x)
    del view
    assert producer.counts()["deleter"] == 1


@pytest.mark.parametrize("kind", ["PlainTensor", "FutureTensor"])
def test_no_table_or_an_unreadable_one_goes_through_dlpack(producer, kind):
    x = np.arange(4.0)
    np.testing.assert_array_equal(np.asarray(dlpack2cai(getattr(producer, kind)(x))), x)
    counts = producer.counts()
    assert (counts["from_object"], counts["dlpack"]) == (0, 1)


def test_our_own_types_keep_their_dlpack(producer):
    """A shim's __dlpack__ orders its CAI stream before the consumer's directly: its table is not used."""
    class CountingShim(DLPackShim):
        calls = 0

        def __dlpack__(self, **kwargs):
            CountingShim.calls += 1
            return super().__dlpack__(**kwargs)

    x = np.arange(3.0)
    np.testing.assert_array_equal(np.asarray(dlpack2cai(CountingShim(x))), x)
    assert CountingShim.calls == 1


@pytest.mark.parametrize("failure", [1, 2, 3], ids=["BufferError", "RuntimeError", "no-exception"])
def test_a_failing_table_falls_back_to_dlpack(producer, failure):
    x = np.arange(5.0)
    producer.configure(from_object_fails=failure)
    np.testing.assert_array_equal(np.asarray(dlpack2cai(producer.Tensor(x))), x)
    counts = producer.counts()
    assert (counts["from_object"], counts["dlpack"]) == (1, 1)
    producer.configure(from_object_fails=failure, dlpack_refuses=True)
    with pytest.raises(BufferError, match="refuses in its own words"):
        dlpack2cai(producer.Tensor(x))


def test_the_c_api_falls_back_the_same_way(producer, example):
    x = np.arange(5.0)
    producer.configure(from_object_fails=2)
    assert example.managed(producer.Tensor(x), -1)["shape"] == (5,)
    assert producer.counts()["dlpack"] == 1
    producer.configure()
    assert example.fill(producer.Tensor(x), -1)["shape"] == (5,)
    counts = producer.counts()
    assert (counts["dltensor"], counts["from_object"], counts["dlpack"]) == (1, 0, 0)
    # Without the borrowed call, or when it fails, fill_tensor reads an array interface, which this has not.
    for tensor, fails in ((producer.NoDLTensorTensor(x), 0), (producer.Tensor(x), 1)):
        producer.configure(from_object_fails=fails)
        with pytest.raises(TypeError, match="interface"):
            example.fill(tensor, -1)


def test_when_the_borrowed_call_fails_fill_tensor_reads_the_interface_cleanly(producer, example):
    """A table whose borrowed call fails, on an object that also has an array interface: fill_tensor reads the
    interface, with the table's error cleared (none is left set, nor raised later)."""
    x = np.arange(6.0)

    class Described(producer.Tensor):
        @property
        def __array_interface__(self):
            return dict(x.__array_interface__)

    for failure in (1, 2):
        producer.configure(from_object_fails=failure)
        assert example.fill(Described(x), -1)["shape"] == (6,)
        assert producer.counts()["dltensor"] >= 1


# ---- what __dlpack__ refuses and a table exports anyway ---------------------------------------------------

@needs_torch
def test_torch_refusals_keep_torch_words():
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    cases = [(c.conj(), "conjugate bit"), (torch.ones(2, requires_grad=True), "require gradient"),
             (torch.eye(2).to_sparse(), "layout"), (torch.empty(2, device="meta"), "meta")]
    for tensor, words in cases:
        with pytest.raises(BufferError, match=words) as raised:
            dlpack2cai(tensor)
        assert "Exception raised from" not in str(raised.value)  # not the table's C++ backtrace
    np.testing.assert_array_equal(np.asarray(dlpack2cai(c.conj().resolve_conj())), [1 - 2j, 3 + 4j])


@needs_torch
def test_a_negative_bit_is_refused_not_handed_on_wrong(example):
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    negated = c.conj().imag  # [-2, 4], stored as [2, -4] with torch's negative bit
    assert negated.is_neg()
    for convert in (dlpack2cai, lambda t: example.managed(t, -1), lambda t: example.fill(t, -1)):
        with pytest.raises(UnsupportedArrayError, match="negative bit"):
            convert(negated)
    np.testing.assert_array_equal(np.asarray(dlpack2cai(negated.resolve_neg())), [-2, 4])


def test_the_checks_are_asked_of_any_producer_that_has_them(producer):
    x = np.arange(4.0)
    asked = []

    class Negated(producer.Tensor):
        def is_neg(self):
            asked.append("is_neg")
            return True

    with pytest.raises(UnsupportedArrayError, match="Negated has its negative bit set"):
        dlpack2cai(Negated(x))
    assert asked == ["is_neg"]
    gc.collect()
    assert producer.counts()["deleter"] == 1  # the table's tensor was let go

    class Tracked(producer.Tensor):
        requires_grad = True

    producer.configure()
    dlpack2cai(Tracked(x))
    assert (producer.counts()["from_object"], producer.counts()["dlpack"]) == (1, 1)

    class Conjugated(producer.Tensor):
        def is_conj(self):
            asked.append("is_conj")
            return True

    asked.clear()
    producer.configure()
    dlpack2cai(Conjugated(x))  # a real type cannot be a lazy conjugate: not asked, the table is used
    assert asked == [] and producer.counts()["dlpack"] == 0
    dlpack2cai(Conjugated(x.astype(np.complex128)))
    assert asked == ["is_conj"] and producer.counts()["dlpack"] == 1


# ---- ordering the producer's work stream ----------------------------------------------------------------

def device_tensor(producer, cudart, device=1):
    x = np.zeros(8, dtype=np.float32)
    register(cudart, x, DEVICE, device=device)
    return producer.Tensor(x, KDLCUDA, device)


def test_the_work_stream_is_ordered_before_the_consumers(producer, cudart):
    tensor = device_tensor(producer, cudart)
    producer.configure(work_stream=S1)
    view = dlpack2cai(tensor, stream=S2)
    assert producer.counts()["work_stream_device"] == (KDLCUDA, 1)
    assert ordering(cudart) == ([S1], [S2])
    assert view.__cuda_array_interface__["stream"] == S2  # what the view exports is unchanged


def test_a_default_work_stream_is_the_legacy_stream(producer, cudart):
    tensor = device_tensor(producer, cudart)
    dlpack2cai(tensor)  # producer NULL, consumer None: both the legacy stream
    assert producer.counts()["work_stream"] == 1 and ordering(cudart) == ([], [])
    dlpack2cai(tensor, stream=S2)
    assert ordering(cudart) == ([1], [S2])


@pytest.mark.parametrize("case", ["no-sync", "same-stream", "host", "sync-off"])
def test_nothing_to_order(producer, cudart, case):
    tensor = device_tensor(producer, cudart)
    producer.configure(work_stream=S1)
    if case == "host":
        tensor = producer.Tensor(np.zeros(3))
    before = options()
    try:
        if case == "sync-off":
            options(sync=False)
        dlpack2cai(tensor, stream={"no-sync": -1, "same-stream": S1}.get(case, S2))
    finally:
        options(**before)
    assert ordering(cudart) == ([], [])
    assert producer.counts()["work_stream"] == (1 if case in ("same-stream", "sync-off") else 0)


def test_a_failing_work_stream_raises_and_lets_the_tensor_go(producer, cudart, example):
    tensor = device_tensor(producer, cudart)
    producer.configure(work_stream_fails=True)
    for convert in (lambda: dlpack2cai(tensor, stream=S2), lambda: example.managed(tensor, S2),
                    lambda: example.fill(tensor, S2)):
        with pytest.raises(RuntimeError, match="no work stream"):
            convert()
    gc.collect()
    counts = producer.counts()
    assert counts["deleter"] == counts["from_object"] == 2 and counts["dlpack"] == 0
    assert ordering(cudart) == ([], [])


@pytest.mark.parametrize("door", ["to_managed_tensor", "fill_tensor"])
def test_a_failing_work_stream_is_a_failed_c_api_call(producer, cudart, example, door):
    """The C API's convention through a table whose work stream cannot be had: -1 with the table's error set, and
    no tensor; never 0 (success) with an exception pending, which a C consumer, trusting the status, would miss."""
    tensor = device_tensor(producer, cudart)
    producer.configure(work_stream_fails=True)
    status, error, handed_out = example.status_of(door, tensor, S2)
    assert (status, type(error), handed_out) == (-1, RuntimeError, False)
    assert "no work stream" in str(error)


def test_the_c_api_orders_the_work_stream_too(producer, cudart, example):
    tensor = device_tensor(producer, cudart)
    producer.configure(work_stream=S1)
    assert example.fill(tensor, S2)["device"] == (KDLCUDA, 1)
    assert ordering(cudart) == ([S1], [S2])
    cudart.clear_log()
    assert example.managed(tensor, S2)["device"] == (KDLCUDA, 1)
    assert ordering(cudart) == ([S1], [S2])
    assert producer.counts()["dlpack"] == 0


@pytest.mark.parametrize("door", ["fill", "managed"])
def test_a_borrowed_tensor_the_checks_refuse_is_refused_in_their_words(producer, example, door):
    """The table lends a tensor the checks turn down (memory of a device that is neither CUDA nor the host, here
    Vulkan's) while the producer says the table suits it: the C API raises the checks' error, and lends nothing."""
    tensor = producer.Tensor(np.arange(4.0), device_type=7)
    with pytest.raises(BufferError, match=r"DLPack device type 7 \(kDLVulkan\) is neither CUDA nor host memory"):
        getattr(example, door)(tensor, -1)
    assert producer.counts()["dlpack"] == 0


def test_a_borrowed_tensor_the_checks_refuse_of_a_producer_the_table_does_not_suit_keeps_nothing(producer, example):
    """The table lends a tensor the checks turn down (Vulkan memory) and the producer says the table does not suit
    it (requires_grad): fill_tensor reads the array interface instead, and the checks' refusal, set aside while the
    producer was asked, is dropped: not one reference kept per call."""
    x = np.arange(4.0)

    class Tracked(producer.Tensor):
        requires_grad = True

        @property
        def __array_interface__(self):
            return dict(x.__array_interface__)

    tensor = Tracked(x, device_type=7)

    def fill(times):
        for _ in range(times):
            fields = example.fill(tensor, -1)
            assert (fields["device"], fields["shape"]) == ((KDLCPU, 0), (4,))

    fill(3)
    gc.collect()
    before = sys.getrefcount(BufferError), len(gc.get_objects())
    fill(100)
    gc.collect()
    assert (sys.getrefcount(BufferError), len(gc.get_objects())) == before
    assert producer.counts()["dltensor"] >= 103


def test_an_unusable_table_address_sends_the_reader_to_dlpack():
    """A DLPack 1.2 table address that is no address (an int past the pointer's range): the table is not used,
    nothing of the failed conversion is left set, and __dlpack__ gives the tensor."""
    x = np.arange(3.0)

    class FarAddress:
        __c_dlpack_exchange_api__ = 2**64
        dlpack_calls = 0

        def __dlpack_device__(self):
            return (KDLCPU, 0)

        def __dlpack__(self, **kwargs):
            FarAddress.dlpack_calls += 1
            return x.__dlpack__(**kwargs)

    view = dlpack2cai(FarAddress())
    assert address(view) == x.ctypes.data and FarAddress.dlpack_calls == 1
    np.testing.assert_array_equal(np.asarray(view), x)


def new_capsule(pointer, name):
    """A PyCapsule of pointer named name (the way a producer module publishes its table)."""
    make = ctypes.pythonapi.PyCapsule_New
    make.restype, make.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return make(pointer, name, None)


def test_a_work_stream_call_that_fails_without_an_exception_is_named(cudart):
    """A table's current_work_stream that returns failure and sets no exception: dlpack2cai raises RuntimeError
    naming the producer's type and the call (never a failure without an exception), and the tensor the table gave
    is deleted."""
    host = np.zeros(8, dtype=np.float32)
    register(cudart, host, DEVICE, device=1)
    lent = CaiArray(host)
    gone = weakref.ref(lent)
    handed = []

    def from_object(obj, out):
        owned = doors.managed_from_object(DLPackShim(lent))
        handed.append(owned)
        out[0] = owned.pointer
        return 0

    def work_stream(device_type, device_id, out):
        return -1  # and no exception

    callbacks = doors.FromObject(from_object), doors.WorkStream(work_stream)
    table = doors.ExchangeApi(major=1, minor=3, managed_tensor_from_py_object_no_sync=callbacks[0],
                              current_work_stream=callbacks[1])

    class SilentTable:
        __dlpack_c_exchange_api__ = new_capsule(ctypes.addressof(table), b"dlpack_exchange_api")

        def __dlpack__(self, **kwargs):
            raise AssertionError("never reached: the table gave the tensor")

    with pytest.raises(RuntimeError, match="SilentTable's DLPack exchange API current_work_stream failed without "
                                           "setting an exception"):
        dlpack2cai(SilentTable(), stream=S2)
    assert len(handed) == 1
    del lent, handed
    gc.collect()
    assert gone() is None  # the table's tensor was deleted: it let its producer go
