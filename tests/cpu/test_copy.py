"""Copies a consumer asks __dlpack__ for: copy=True on the data's own device, dl_device=(kDLCPU, 0) a host copy.
Host memory directly, "device" memory through the CUDA runtime double (which copies bytes and logs the stream
of each copy): every layout the bridge reads, values, distinct memory, ownership and freeing, stream order,
and the errors."""
import ctypes
import gc
import os
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest
from numpy.lib.array_utils import byte_bounds

from cai_dlpack import CudaError, DLPackShim, UnsupportedArrayError, cai2dlpack, cuda_runtime_info, dlpack2cai
from support.c_heap import c_heap_bytes
from support.threads import run_threads
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE, GLOBAL, MANAGED, PINNED_HOST
from support.dlpack_ctypes import DLManagedTensorVersioned, MadeTensor, _api, read_capsule

kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged = 1, 2, 3, 13
READ_ONLY, IS_COPIED = 1, 2  # DLPACK_FLAG_BITMASK_*
S1, S2 = 0x5000, 0x6000
MAX_CALLS = 65536  # csrc/copy.c: CDL_COPY_MAX_CALLS


def _base():
    return np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)


# Every layout the bridge accepts, as NumPy views of one allocation (so a region of the double covers them).
LAYOUTS = {
    "contiguous": lambda: _base(),
    "strided": lambda: _base()[:, ::2, 1:, ::3],
    "negative": lambda: _base()[::-1, :, ::-2],
    "transposed": lambda: _base().transpose(3, 1, 0, 2),
    "fortran": lambda: np.asfortranarray(_base()),
    "zero strides": lambda: np.broadcast_to(np.arange(5, dtype=np.float32), (3, 4, 5)),
    "zero and negative": lambda: np.broadcast_to(np.arange(5, dtype=np.float32)[::-1], (3, 5)),
    "empty": lambda: _base()[:, :0],
    "0-d": lambda: np.array(7.5, dtype=np.float32),
    "extent one": lambda: _base()[1:2, 2:3, :, 4:5],
}


def allocation_of(array):
    """The NumPy array that owns array's memory (for registering it with the double)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def host_values(capsule_fields, dtype):
    """The values a capsule's host tensor holds (C-contiguous), read through its pointer."""
    shape = capsule_fields["shape"]
    count = int(np.prod(shape)) if shape else 1
    nbytes = count * np.dtype(dtype).itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    raw = (ctypes.c_char * nbytes).from_address(capsule_fields["data"])
    return np.frombuffer(bytes(raw), dtype=dtype).reshape(shape)


def contiguous_strides(shape):
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


# ---- host memory ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_host_copy_of_every_layout(layout, max_version):
    source = LAYOUTS[layout]()
    capsule = DLPackShim(source).__dlpack__(copy=True, max_version=max_version)
    fields = read_capsule(capsule)
    assert fields["device"] == (kDLCPU, 0)
    assert fields["shape"] == source.shape
    assert fields["strides"] == contiguous_strides(source.shape)
    # Writable, even where the source is not (broadcast views are read-only), and said to be a copy where the
    # capsule can say it (a legacy one has no flags).
    assert fields.get("flags") == (IS_COPIED if max_version else None)
    np.testing.assert_array_equal(host_values(fields, source.dtype), source)
    if source.size:
        lo, hi = byte_bounds(allocation_of(source))
        assert not lo <= fields["data"] < hi


@pytest.mark.parametrize("layout", LAYOUTS)
def test_numpy_from_dlpack_copy_true(layout):
    source = LAYOUTS[layout]()
    copied = np.from_dlpack(DLPackShim(source), copy=True)
    np.testing.assert_array_equal(copied, source)
    assert copied.flags.c_contiguous and copied.flags.writeable
    assert not np.shares_memory(copied, allocation_of(source))
    copied[...] = -1  # the copy is its own memory
    np.testing.assert_array_equal(source, LAYOUTS[layout]())


def test_copy_none_and_false_share_host_memory():
    source = _base()
    assert np.shares_memory(np.from_dlpack(DLPackShim(source)), source)
    assert np.shares_memory(np.from_dlpack(DLPackShim(source), copy=False), source)
    assert np.shares_memory(np.from_dlpack(DLPackShim(source), device="cpu"), source)
    capsule = DLPackShim(source).__dlpack__(dl_device=(kDLCPU, 0), copy=False)
    assert read_capsule(capsule)["data"] == source.ctypes.data


def test_view_copy_true():
    source = _base()[:, ::-1]
    view = dlpack2cai(source)
    copied = np.from_dlpack(view, copy=True)
    np.testing.assert_array_equal(copied, source)
    assert not np.shares_memory(copied, source)
    assert np.shares_memory(np.from_dlpack(view), allocation_of(source))


def test_cai2dlpack_copies_as_dunder_dlpack(cudart):
    source = _base()[::-1]
    capsule = cai2dlpack(source, copy=True)
    fields = read_capsule(capsule)
    assert fields["strides"] == contiguous_strides(source.shape)
    np.testing.assert_array_equal(host_values(fields, source.dtype), source)
    owner = np.ascontiguousarray(source)
    watch = weakref.ref(owner)
    register(cudart, owner, DEVICE)
    capsule = cai2dlpack(CaiArray(owner).__cuda_array_interface__, owner=owner, copy=True)
    assert read_capsule(capsule)["device"] == (kDLCUDA, 0)
    del owner
    assert watch() is None  # the copy keeps no owner
    np.testing.assert_array_equal(host_values(read_capsule(capsule), source.dtype), source)
    device, obj = device_source(cudart, "negative")
    capsule = cai2dlpack(obj, dl_device=(kDLCPU, 0))
    np.testing.assert_array_equal(host_values(read_capsule(capsule), np.float32), device)
    with pytest.raises(BufferError, match="copy=False forbids a copy"):
        cai2dlpack(obj, dl_device=(kDLCPU, 0), copy=False)
    assert read_capsule(cai2dlpack(obj))["data"] == device.ctypes.data


try:
    import ml_dtypes
    LOW_PRECISION = [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]
except ImportError:  # no wheel for this CPython: the types NumPy has are still copied
    LOW_PRECISION = [pytest.param(None, marks=pytest.mark.skip(reason="ml_dtypes (a test extra) is not installed"))]


@pytest.mark.parametrize("dtype", [*LOW_PRECISION, np.float16, np.complex64, np.bool_, np.int8])
def test_low_precision_copies_bit_for_bit(dtype):
    bits = np.random.default_rng(3).integers(0, 256, size=(6, 8), dtype=np.uint8)
    itemsize = np.dtype(dtype).itemsize
    if dtype is np.bool_:
        bits = bits & 1
    raw = np.tile(bits, (1, itemsize))
    source = raw.view(dtype)[::-1, ::2]
    capsule = DLPackShim(source).__dlpack__(copy=True, max_version=(1, 0))
    fields = read_capsule(capsule)
    copied = host_values(fields, source.dtype)
    assert copied.view(np.uint8).tobytes() == np.ascontiguousarray(source).view(np.uint8).tobytes()


def test_host_copy_holds_no_reference_to_the_source():
    source = _base()[::2]
    owner = source.base
    shim = DLPackShim(source)
    capsule = shim.__dlpack__(copy=True)
    watch = weakref.ref(owner)
    del source, owner, shim
    gc.collect()
    assert watch() is None  # the copy lives without its source
    np.testing.assert_array_equal(host_values(read_capsule(capsule), np.float32), _base()[::2])


def test_arguments_are_checked():
    shim = DLPackShim(_base())
    with pytest.raises(TypeError, match="copy must be None or a bool, not str"):
        shim.__dlpack__(copy="1")
    with pytest.raises(TypeError, match="dl_device must be"):
        shim.__dlpack__(dl_device="cpu")
    with pytest.raises(UnsupportedArrayError, match=r"dl_device \(2, 0\) differs from the data's device \(1, 0\); "
                                                    r"cai_dlpack copies only to the host"):
        shim.__dlpack__(dl_device=(kDLCUDA, 0))
    # Both what the array API asks __dlpack__ to raise and what NumPy's own __dlpack__ raises for (10, 0).
    for error in (BufferError, ValueError):
        with pytest.raises(error):
            shim.__dlpack__(dl_device=(10, 0))
    with pytest.raises(BufferError, match=r"copy=False forbids a copy"):
        shim.__dlpack__(dl_device=(kDLCUDA, 0), copy=False)


# ---- CUDA memory through the runtime double --------------------------------------------------------------


def device_source(cudart, layout, kind=DEVICE, device=0, stream=S1):
    source = LAYOUTS[layout]()
    register(cudart, allocation_of(source), kind, device)
    return source, CaiArray(source, stream=stream)


def copies_in(log):
    return [line for line in log if line.startswith(("cudaMemcpyAsync", "cudaMemcpy2DAsync"))]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_copy_of_device_memory(cudart, layout):
    source, obj = device_source(cudart, layout)
    cudart.clear_log()
    host = np.from_dlpack(DLPackShim(obj), device="cpu")
    np.testing.assert_array_equal(host, source)
    assert host.flags.c_contiguous and host.flags.writeable
    assert not np.shares_memory(host, allocation_of(source))
    log = cudart.log()
    if source.size == 0:
        assert copies_in(log) == [] and not any("Synchronize" in line for line in log)
        return
    # Issued on the producer's stream, then that stream (only) is waited for: the one host wait.
    assert copies_in(log) and all(line.endswith(f", {S1})") for line in copies_in(log))
    waits = [line for line in log if "Synchronize" in line]
    assert waits == [f"cudaStreamSynchronize({S1})"]
    assert log.index(waits[0]) > log.index(copies_in(log)[-1])


@pytest.mark.parametrize("kind, dl_type", [(PINNED_HOST, kDLCUDAHost), (MANAGED, kDLCUDAManaged)])
def test_host_copy_of_pinned_and_managed_memory(cudart, kind, dl_type):
    source, obj = device_source(cudart, "strided", kind=kind, stream=None)
    shim = DLPackShim(obj)
    assert shim.__dlpack_device__() == (dl_type, 0)
    cudart.clear_log()
    host = np.from_dlpack(shim, device="cpu")
    np.testing.assert_array_equal(host, source)
    assert not np.shares_memory(host, allocation_of(source))
    assert "cudaStreamSynchronize(1)" in cudart.log()  # no producer stream: the legacy one


def test_host_copy_past_the_call_limit_is_staged(cudart):
    allocation = np.arange(2 * (MAX_CALLS + 10), dtype=np.float32)
    register(cudart, allocation, DEVICE)
    source = allocation[::-2]  # one element per call: too many calls, so the bytes are staged
    cudart.clear_log()
    host = np.from_dlpack(DLPackShim(CaiArray(source, stream=S1)), device="cpu")
    np.testing.assert_array_equal(host, source)
    assert copies_in(cudart.log()) == [f"cudaMemcpyAsync({allocation.nbytes - 4} bytes, kind 4, {S1})"]


def freed(log):
    """How many copies were freed: by cudaFree, or stream-ordered by cudaFreeAsync (memory from cudaMallocAsync)."""
    return sum(line == "cudaFree()" or line.startswith("cudaFreeAsync(") for line in log)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_copy_of_every_layout(cudart, layout):
    source, obj = device_source(cudart, layout)
    cudart.add_stream(S1, 0)
    cudart.add_stream(S2, 0)
    cudart.clear_log()
    capsule = DLPackShim(obj).__dlpack__(stream=S2, copy=True, max_version=(1, 0))
    fields = read_capsule(capsule)
    assert fields["device"] == (kDLCUDA, 0)
    assert fields["shape"] == source.shape and fields["strides"] == contiguous_strides(source.shape)
    assert fields["flags"] == IS_COPIED
    np.testing.assert_array_equal(host_values(fields, source.dtype), source)
    lo, hi = byte_bounds(allocation_of(source))
    assert not lo <= fields["data"] < hi
    log = cudart.log()
    assert not any("Synchronize" in line for line in log)  # the host does not wait
    assert any(line.startswith(("cudaMalloc(", "cudaMallocAsync(")) for line in log)
    if source.size == 0:
        assert copies_in(log) == []
        return
    # The producer's stream is ordered before the consumer's, then every copy runs on the consumer's.
    wait = next(i for i, line in enumerate(log) if line.startswith(f"cudaStreamWaitEvent({S2}"))
    assert any(line.startswith("cudaEventRecord") and line.endswith(f", {S1})") for line in log[:wait])
    copies = [i for i, line in enumerate(log) if line.startswith(("cudaMemcpyAsync", "cudaMemcpy2DAsync"))]
    assert copies and min(copies) > wait
    assert all(log[i].endswith(f", {S2})") for i in copies)


def test_device_copy_calls(cudart):
    source, obj = device_source(cudart, "strided")  # (2, 2, 3, 2) of (2,3,4,5): rows are single elements
    cudart.clear_log()
    DLPackShim(obj).__dlpack__(stream=S2, copy=True)
    # innermost stride 3 elements: width 4 bytes, 2 rows 12 bytes apart per call; 2*2*3 outer indices
    assert copies_in(cudart.log()) == ["cudaMemcpy2DAsync(2 x 4 bytes, pitches 4 12, kind 4, 24576)"] * 12
    source, obj = device_source(cudart, "contiguous")
    cudart.clear_log()
    DLPackShim(obj).__dlpack__(stream=S2, copy=True)
    assert copies_in(cudart.log()) == [f"cudaMemcpyAsync({source.nbytes} bytes, kind 4, 24576)"]
    source = _base()[:, ::2, 1:3]  # rows of 10 contiguous floats, 160 bytes apart; the outer step does not merge
    register(cudart, allocation_of(source), DEVICE)
    cudart.clear_log()
    DLPackShim(CaiArray(source)).__dlpack__(stream=S2, copy=True)
    assert copies_in(cudart.log()) == ["cudaMemcpy2DAsync(2 x 40 bytes, pitches 40 160, kind 4, 24576)"] * 2


@pytest.mark.parametrize("columns, calls", [
    # rows of 10 contiguous floats, 64 bytes apart: the rows are the one copy's height
    (slice(0, 10), ["cudaMemcpy2DAsync(4 x 40 bytes, pitches 40 64, kind 4, 24576)"]),
    # one float per row: the rows are still the one copy's height (4 bytes wide, 64 apart)
    (slice(3, 4), ["cudaMemcpy2DAsync(4 x 4 bytes, pitches 4 64, kind 4, 24576)"]),
])
def test_device_copy_of_two_dimensions_is_one_call(cudart, columns, calls):
    """A layout of one outer dimension whose step is a pitch the runtime takes is one 2D copy, not a copy per
    row."""
    allocation = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)
    register(cudart, allocation, DEVICE)
    source = allocation[:, columns]
    cudart.clear_log()
    capsule = DLPackShim(CaiArray(source)).__dlpack__(stream=S2, copy=True)
    assert copies_in(cudart.log()) == calls
    del capsule


def test_device_copy_with_no_sync_runs_on_the_producers_stream(cudart):
    source, obj = device_source(cudart, "contiguous")
    cudart.clear_log()
    capsule = DLPackShim(obj).__dlpack__(stream=-1, copy=True)
    np.testing.assert_array_equal(host_values(read_capsule(capsule), source.dtype), source)
    assert copies_in(cudart.log()) == [f"cudaMemcpyAsync({source.nbytes} bytes, kind 4, {S1})"]
    assert not any(line.startswith("cudaStreamWaitEvent") for line in cudart.log())


@pytest.mark.parametrize("kind, dl_type, alloc, free", [(PINNED_HOST, kDLCUDAHost, "cudaMallocHost", "cudaFreeHost"),
                                                        (MANAGED, kDLCUDAManaged, "cudaMallocManaged", "cudaFree")])
def test_device_copy_of_pinned_and_managed_memory(cudart, kind, dl_type, alloc, free):
    source, obj = device_source(cudart, "negative", kind=kind)
    cudart.clear_log()
    capsule = DLPackShim(obj).__dlpack__(copy=True, max_version=(1, 0))
    fields = read_capsule(capsule)
    assert fields["device"] == (dl_type, 0)
    np.testing.assert_array_equal(host_values(fields, source.dtype), source)
    assert any(line.startswith(alloc + "(") for line in cudart.log())
    cudart.clear_log()
    del capsule
    assert cudart.log().count(free + "()") == 1


def test_device_copy_freed_once_by_its_consumer(cudart):
    source, obj = device_source(cudart, "transposed")
    shim = DLPackShim(obj)
    view = dlpack2cai(shim.__dlpack__(copy=True, max_version=(1, 0)))
    assert view.device == (kDLCUDA, 0)
    assert view.__cuda_array_interface__["data"][0] != source.ctypes.data
    watch = weakref.ref(obj)
    del shim, obj
    gc.collect()
    assert watch() is None  # once the copy has run (at once on this double), the copy keeps no source owner
    cudart.clear_log()
    del view
    assert freed(cudart.log()) == 1


def test_device_copy_freed_on_a_thread_without_the_gil(cudart):
    source, obj = device_source(cudart, "contiguous")
    capsule = DLPackShim(obj).__dlpack__(copy=True, max_version=(1, 0))
    address = _api.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
    _api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
    _api.PyCapsule_SetName(capsule, b"used_dltensor_versioned")  # consumed: ours to delete
    deleter = ctypes.cast(DLManagedTensorVersioned.from_address(address).deleter, ctypes.c_void_p).value
    cudart.lib.double_call_in_thread.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    cudart.clear_log()
    assert cudart.lib.double_call_in_thread(deleter, address) == 0
    assert freed(cudart.log()) == 1
    del capsule
    assert freed(cudart.log()) == 1


@pytest.mark.parametrize("where", ["the thread that asked", "another thread"])
def test_device_copy_for_the_per_thread_stream_is_freed_on_a_stream_its_freeing_thread_can_name(cudart, where):
    """A copy made for a consumer on the per-thread default stream (2) is freed stream-ordered there by the
    thread that asked for it; another thread's 2 is another stream, so a free from there goes on the legacy
    stream (1), which runs after every blocking stream's work, the consumer's included."""
    source, obj = device_source(cudart, "contiguous")
    capsule = DLPackShim(obj).__dlpack__(stream=2, copy=True, max_version=(1, 0))
    address = _api.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
    _api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
    _api.PyCapsule_SetName(capsule, b"used_dltensor_versioned")  # consumed: ours to delete
    deleter = ctypes.cast(DLManagedTensorVersioned.from_address(address).deleter, ctypes.c_void_p).value
    cudart.clear_log()
    if where == "another thread":
        cudart.lib.double_call_in_thread.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        assert cudart.lib.double_call_in_thread(deleter, address) == 0
    else:
        ctypes.CFUNCTYPE(None, ctypes.c_void_p)(deleter)(address)
    frees = [line for line in cudart.log() if line.startswith(("cudaFree", "cudaFreeAsync"))]
    assert frees == ["cudaFreeAsync(2)" if where == "the thread that asked" else "cudaFreeAsync(1)"], cudart.log()


def test_device_copy_freed_while_the_interpreter_finalizes(tmp_path):
    log_path = tmp_path / "log.txt"
    script = textwrap.dedent("""
        import ctypes, time, os, sys
        import numpy as np
        sys.path[:0] = [p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p]
        from support.cuda_double import CudaDouble, DEVICE
        from support.cai_objects import CaiArray, register
        from support.dlpack_ctypes import DLManagedTensorVersioned, _api
        from cai_dlpack import DLPackShim
        double = CudaDouble(os.environ["CAI_DLPACK_CUDART"])
        source = np.arange(100.0)
        register(double, source, DEVICE)
        capsule = DLPackShim(CaiArray(source)).__dlpack__(copy=True, max_version=(1, 0))
        address = _api.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
        _api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
        _api.PyCapsule_SetName(capsule, b"used_dltensor_versioned")
        deleter = ctypes.cast(DLManagedTensorVersioned.from_address(address).deleter, ctypes.c_void_p).value
        double.lib.double_call_later.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        class SlowToDie:
            def __del__(self):
                print("finalizing", sys.is_finalizing(), flush=True)
                time.sleep(0.3)   # finalization is under way while the deleter runs on its thread
        slow = SlowToDie()        # a global of __main__: it dies in the interpreter's module teardown
        double.clear_log()
        assert double.lib.double_call_later(deleter, address, 100000) == 0
        print("exiting")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), CUDART_DOUBLE_LOG_AT_EXIT=str(log_path))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["exiting", "finalizing", "True"]
    assert freed(log_path.read_text().splitlines()) == 1


def test_copy_none_and_false_share_device_memory(cudart):
    source, obj = device_source(cudart, "strided")
    for copy in (None, False):
        capsule = DLPackShim(obj).__dlpack__(copy=copy, dl_device=(kDLCUDA, 0))
        assert read_capsule(capsule)["data"] == source.ctypes.data
    cudart.clear_log()
    DLPackShim(obj).__dlpack__(copy=False)
    assert copies_in(cudart.log()) == []


def test_host_copy_refused_by_copy_false(cudart):
    source, obj = device_source(cudart, "contiguous")
    with pytest.raises(UnsupportedArrayError, match=r"dl_device \(1, 0\) differs from the data's device \(2, 0\) "
                                                    r"and copy=False forbids a copy"):
        DLPackShim(obj).__dlpack__(dl_device=(kDLCPU, 0), copy=False)
    # numpy.from_dlpack passes it on: a ValueError, as the array API asks of from_dlpack here.
    with pytest.raises(ValueError, match="copy=False forbids a copy"):
        np.from_dlpack(DLPackShim(obj), device="cpu", copy=False)
    with pytest.raises(BufferError, match=r"dl_device \(2, 1\) differs .* copies only to the host"):
        DLPackShim(obj).__dlpack__(dl_device=(kDLCUDA, 1))


def test_device_copy_needing_a_kernel_is_refused(cudart):
    allocation = np.arange(2 * (MAX_CALLS + 10), dtype=np.float32)
    register(cudart, allocation, DEVICE)
    obj = CaiArray(allocation[::-2])
    cudart.clear_log()
    with pytest.raises(BufferError, match=r"element strides \(-2\) would take more than 65536 runtime copy calls; "
                                          r"cai_dlpack copies with the runtime's memcpy calls only \(no kernel"):
        DLPackShim(obj).__dlpack__(copy=True)
    assert not any(line.startswith("cudaMalloc") for line in cudart.log())  # refused before anything is made
    # The same array copies to the host.
    np.testing.assert_array_equal(np.from_dlpack(DLPackShim(obj), device="cpu"), allocation[::-2])


class InstanceInterface:
    def __init__(self, iface):
        self.__cuda_array_interface__ = iface


@pytest.mark.parametrize("first, listed_length, shown", [(10**10 + 7, 375, 28), (10**11 + 7, 376, 27)],
                         ids=["375 characters: one more listed", "376 characters: the list stops"])
def test_device_copy_refusal_lists_strides_while_its_text_is_short(cudart, first, listed_length, shown):
    """The refusal names the element strides entry by entry while fewer than 376 characters are written (64
    dimensions' worth would be unreadable): where the first 27 make 375 characters a 28th is listed, and no more;
    where they make exactly 376 the list stops there (a 28th would have to be cut short in the text's 400 bytes)."""
    strides = [first] + [10**11 + 1000 * i + 3 for i in range(1, 40)]  # bytes of |u1 items: never merged
    assert len(", ".join(map(str, strides[:27]))) == listed_length
    pointer = 0x7E00_0000_0000
    cudart.add_region(pointer, sum(strides) + 1, DEVICE, 0)
    obj = InstanceInterface({"shape": (2,) * 40, "typestr": "|u1", "strides": tuple(strides),
                             "data": (pointer, False), "version": 3, "stream": None})
    with pytest.raises(BufferError) as refused:
        DLPackShim(obj).__dlpack__(copy=True)
    assert f"element strides ({', '.join(map(str, strides[:shown]))}) would take more than" in str(refused.value)


@pytest.mark.parametrize("call", ["cudaMemcpyAsync", "cudaMemcpy2DAsync"])
def test_failed_device_copy_frees_its_allocation(cudart, call):
    source, obj = device_source(cudart, "contiguous" if call == "cudaMemcpyAsync" else "strided")
    cudart.fail(call, 700)
    cudart.clear_log()
    with pytest.raises(CudaError, match=call):
        DLPackShim(obj).__dlpack__(stream=S2, copy=True)
    log = cudart.log()
    assert sum(line.startswith(("cudaMalloc(", "cudaMallocAsync(")) for line in log) == freed(log) == 1


def test_failed_allocation_raises(cudart):
    source, obj = device_source(cudart, "contiguous")
    cudart.fail("cudaMallocAsync", 2)  # a stream-ordered allocation that fails is tried once more with cudaMalloc
    cudart.fail("cudaMalloc", 2)
    with pytest.raises(CudaError, match="cudaMalloc.*cudaErrorMemoryAllocation"):
        DLPackShim(obj).__dlpack__(copy=True)


@pytest.mark.parametrize("kind", [DEVICE, PINNED_HOST])
def test_failed_legacy_stream_capture_query_raises(cudart, kind):
    # Whether the legacy stream can take the copies is asked first: a failed query is a CudaError, nothing made.
    source, obj = device_source(cudart, "contiguous", kind=kind, stream=None)
    cudart.clear_log()
    cudart.fail("cudaStreamGetCaptureInfo", 400)
    with pytest.raises(CudaError, match="cudaStreamGetCaptureInfo failed: cudaErrorInvalidResourceHandle"):
        DLPackShim(obj).__dlpack__(copy=True, max_version=(1, 0))
    assert not any(line.startswith(("cudaMalloc", "cudaMemcpy")) for line in cudart.log())
    assert cudart.last_error == 0


def test_failed_device_query_of_a_copy_for_the_callers_stream_raises(cudart):
    # A pinned copy for the caller's legacy stream asks which device that is (the one it orders the producer's
    # stream after): a failed query is a CudaError, nothing made.
    source, obj = device_source(cudart, "contiguous", kind=PINNED_HOST, stream=S1)
    cudart.current_device = 1
    cudart.clear_log()
    DLPackShim(obj).__dlpack__(copy=True, max_version=(1, 0))
    log = cudart.log()
    asked = log.index("cudaDeviceGetAttribute(11, 0)") + 1  # after the pitch, before anything is made
    assert log[asked] == "cudaGetDevice() -> 1"
    cudart.clear_log()
    cudart.fail("cudaGetDevice", 999, after=sum(line.startswith("cudaGetDevice") for line in log[:asked]))
    with pytest.raises(CudaError, match="cudaGetDevice failed: cudaErrorUnknown"):
        DLPackShim(obj).__dlpack__(copy=True, max_version=(1, 0))
    assert not any(line.startswith(("cudaMalloc", "cudaMemcpy", "cudaEventRecord")) for line in cudart.log())
    assert cudart.last_error == 0


@pytest.mark.parametrize("call", ["cudaMemcpyAsync", "cudaStreamSynchronize"])
def test_failed_host_copy_raises(cudart, call):
    source, obj = device_source(cudart, "contiguous")
    cudart.fail(call, 700)
    with pytest.raises(CudaError, match=f"{call}.*cudaErrorIllegalAddress"):
        DLPackShim(obj).__dlpack__(dl_device=(kDLCPU, 0))


def test_host_copies_from_many_threads(cudart):
    # Host copies wait with the GIL released; copies from four threads at once stay correct.
    source, obj = device_source(cudart, "negative")
    def work(_):
        for _ in range(200):
            np.testing.assert_array_equal(np.from_dlpack(DLPackShim(obj), device="cpu"), source)

    assert run_threads(work, 4) == []


def test_host_copy_refused_while_its_stream_captures(cudart):
    source, obj = device_source(cudart, "contiguous")
    capture = cudart.begin_capture(S1)
    with pytest.raises(CudaError, match=rf"waits for stream {S1}, which is capturing a CUDA graph"):
        np.from_dlpack(DLPackShim(obj), device="cpu")
    assert cudart.violations == 0 and cudart.end_capture(capture)  # nothing broke the capture
    source, obj = device_source(cudart, "contiguous", stream=None)
    capture = cudart.begin_capture(S2, blocking=True)
    with pytest.raises(CudaError, match="is the legacy stream while a blocking stream captures"):
        np.from_dlpack(DLPackShim(obj), device="cpu")
    assert cudart.violations == 0 and cudart.end_capture(capture)


def test_device_copy_into_a_capture(cudart):
    source, obj = device_source(cudart, "strided")
    capture = cudart.begin_capture(S2)  # the consumer captures (PyTorch's default, global mode)
    capsule = DLPackShim(obj).__dlpack__(stream=S2, copy=True, max_version=(1, 0))
    np.testing.assert_array_equal(host_values(read_capsule(capsule), source.dtype), source)
    del capsule  # freed in relaxed mode too
    assert cudart.violations == 0 and cudart.end_capture(capture)


def legacy_stream_used(log):
    return [line for line in log if line.startswith(("cudaMalloc", "cudaMemcpy", "cudaEventRecord",
                                                      "cudaStreamWaitEvent"))]


@pytest.mark.parametrize("producer, consumer", [(None, None), (1, None), (1, 1), (None, -1), (1, -1)])
def test_device_copy_on_the_legacy_stream_refused_while_a_blocking_stream_captures(cudart, producer, consumer):
    # The copies go onto the data's device's legacy stream (the consumer's, or for -1 the producer's, which is
    # the legacy one where it gave none): while a blocking stream of that device captures, any use of it would
    # invalidate the capture. Refused before any allocation, copy or ordering call.
    source, obj = device_source(cudart, "strided", stream=producer)
    capture = cudart.begin_capture(S2, blocking=True)
    cudart.clear_log()
    with pytest.raises(CudaError, match="copy=True would copy on the legacy default stream") as raised:
        DLPackShim(obj).__dlpack__(stream=consumer, copy=True, max_version=(1, 0))
    assert (raised.value.code, raised.value.call) == (906, "cudaMemcpyAsync")
    assert legacy_stream_used(cudart.log()) == []
    assert cudart.violations == 0 and cudart.end_capture(capture)


@pytest.mark.parametrize("consumer", [None, 1, -1])
def test_an_empty_device_copy_is_made_while_a_blocking_stream_captures(cudart, consumer):
    """An empty copy queues nothing on any stream: a blocking capture, which forbids the legacy stream, does not
    refuse it, and it uses no stream the capture forbids."""
    source, obj = device_source(cudart, "empty", stream=None)
    capture = cudart.begin_capture(S2, blocking=True)
    cudart.clear_log()
    capsule = DLPackShim(obj).__dlpack__(stream=consumer, copy=True, max_version=(1, 0))
    fields = read_capsule(capsule)
    assert fields["shape"] == source.shape and fields["device"] == (kDLCUDA, 0) and fields["flags"] == IS_COPIED
    del capsule
    assert copies_in(cudart.log()) == []
    # (nor is the device asked its widest pitch, for copies it will not make)
    assert not any(line.startswith(("cudaEventRecord", "cudaStreamWaitEvent", "cudaDeviceGetAttribute"))
                   for line in cudart.log())
    assert cudart.violations == 0 and cudart.end_capture(capture)


@pytest.mark.parametrize("capture_device, refused", [(1, True), (0, False)])
@pytest.mark.parametrize("kind", [PINNED_HOST, MANAGED])
def test_pinned_copy_on_the_callers_legacy_stream_refused_while_its_device_captures(cudart, kind, capture_device,
                                                                                       refused):
    # Pinned or managed memory of device 0 copied for the legacy stream while device 1 is current: the copies go
    # onto device 1's legacy stream, the one a blocking capture on device 1 forbids (one on device 0 does not).
    source, obj = device_source(cudart, "strided", kind=kind, stream=None)
    cudart.current_device = 1
    capture = cudart.begin_capture(S2, device=capture_device, blocking=True)
    cudart.clear_log()
    if refused:
        with pytest.raises(CudaError, match="copy=True would copy on the legacy default stream") as raised:
            DLPackShim(obj).__dlpack__(copy=True, max_version=(1, 0))
        assert raised.value.code == 906 and legacy_stream_used(cudart.log()) == []
    else:
        capsule = DLPackShim(obj).__dlpack__(copy=True, max_version=(1, 0))
        np.testing.assert_array_equal(host_values(read_capsule(capsule), source.dtype), source)
        del capsule
    assert cudart.current_device == 1
    assert cudart.violations == 0 and cudart.end_capture(capture)


# ---- what a copy says of itself ----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["host memory, copy=True", "device memory, copy=True", "device memory to the host"])
def test_copies_are_flagged_as_copies_and_writable(cudart, where):
    source = _base()[:, ::2]
    if where != "host memory, copy=True":
        register(cudart, allocation_of(source), DEVICE)
    obj = CaiArray(source, read_only=True) if where != "host memory, copy=True" else None
    shim = DLPackShim(obj) if obj is not None else DLPackShim(np.broadcast_to(source, source.shape))
    # Not a copy: the source's own read-only flag and nothing else.
    assert read_capsule(shim.__dlpack__(max_version=(1, 0)))["flags"] == READ_ONLY
    asked = {"dl_device": (kDLCPU, 0)} if where == "device memory to the host" else {"copy": True}
    fields = read_capsule(shim.__dlpack__(max_version=(1, 0), **asked))
    assert fields["flags"] == IS_COPIED  # the array API: a copy says so; it is the consumer's, so writable
    assert "flags" not in read_capsule(shim.__dlpack__(**asked))  # a legacy capsule has no way to say it
    if where == "device memory to the host":
        copied = np.from_dlpack(shim, device="cpu")
        assert copied.flags.writeable
        copied[...] = 0  # numpy took the flags as they are: its own memory


# ---- empty arrays: copied by no call, whatever their strides -------------------------------------------------

# (shape, byte strides) of float32 arrays with no elements: torch.empty(0, 100000).t() first.
EMPTY = [
    ((100000, 0), (4, 400000)),
    ((0,), (4,)),
    ((3, 0, 5), (-20, 4, 200000)),
    ((0, 70000, 3), (4, 12, 0)),
    ((70000, 0, 70000), (4, 4, 280000)),
    ((100000, 5, 0), (4, 0, 8)),  # 500,000 row copies of no rows each, were there any
]


def empty_source(shape, strides, stream=S1):
    return CaiArray(np.empty(0, np.float32), stream=stream, shape=shape, strides=strides)


@pytest.mark.parametrize("shape, strides", EMPTY)
def test_device_copy_of_an_empty_array(cudart, shape, strides):
    cudart.clear_log()
    fields = read_capsule(DLPackShim(empty_source(shape, strides)).__dlpack__(stream=S2, copy=True,
                                                                              max_version=(1, 0)))
    assert fields["device"] == (kDLCUDA, 0)
    assert fields["shape"] == shape and fields["strides"] == contiguous_strides(shape)
    assert fields["flags"] == IS_COPIED
    log = cudart.log()
    assert copies_in(log) == [] and not any("Synchronize" in line or "WaitEvent" in line for line in log)


@pytest.mark.parametrize("shape, strides", EMPTY)
def test_host_copy_of_an_empty_array(cudart, shape, strides):
    host = np.from_dlpack(DLPackShim(empty_source(shape, strides)), device="cpu")
    assert host.shape == shape and host.flags.c_contiguous
    numpy_empty = np.lib.stride_tricks.as_strided(np.empty(1, np.float32), shape, strides)
    copied = np.from_dlpack(DLPackShim(numpy_empty), copy=True)
    assert copied.shape == shape and not np.shares_memory(copied, numpy_empty)


def test_copy_of_an_empty_array_whose_extents_do_not_fit(cudart):
    # No extent is measured for an empty array: element strides times the itemsize, and the product of the
    # extents after the zero, pass 64 bits. The copy multiplies neither (the sanitized build checks it).
    shape, strides = (0, 2**40, 2**40), (4, 2**42, 4)  # the last two would merge into 2**80 elements
    source = empty_source(shape, strides)
    assert read_capsule(DLPackShim(source).__dlpack__(copy=True, max_version=(1, 0)))["shape"] == shape
    assert read_capsule(DLPackShim(source).__dlpack__(dl_device=(kDLCPU, 0)))["shape"] == shape
    made = MadeTensor(shape=(0, 3), strides=(2**62, 1))  # 2**62 elements of 4 bytes apart
    view = dlpack2cai(made.capsule)
    assert read_capsule(view.__dlpack__(copy=True, max_version=(1, 0)))["shape"] == (0, 3)
    made = MadeTensor(device=(kDLCUDA, 0), shape=(3, 0), strides=(-(2**62), 2**61))
    view = dlpack2cai(made.capsule)
    assert read_capsule(view.__dlpack__(copy=True, max_version=(1, 0)))["shape"] == (3, 0)
    assert np.from_dlpack(view, device="cpu").shape == (3, 0)


# ---- 2D copies within the runtime's bound on pitches (cudaDevAttrMaxPitch) -----------------------------------


def test_copies_of_rows_farther_apart_than_the_max_pitch(cudart):
    source = _base()[:, ::2, 1:3]  # rows of 40 bytes, 160 bytes apart (test_device_copy_calls)
    register(cudart, allocation_of(source), DEVICE)
    obj = CaiArray(source, stream=S1)
    cudart.set_max_pitch(160)  # the bound itself is a pitch the runtime takes
    cudart.clear_log()
    DLPackShim(obj).__dlpack__(stream=S2, copy=True)
    assert copies_in(cudart.log()) == ["cudaMemcpy2DAsync(2 x 40 bytes, pitches 40 160, kind 4, 24576)"] * 2
    cudart.set_max_pitch(159)  # rows too far apart: one plain copy per row
    cudart.clear_log()
    capsule = DLPackShim(obj).__dlpack__(stream=S2, copy=True)
    np.testing.assert_array_equal(host_values(read_capsule(capsule), source.dtype), source)
    assert copies_in(cudart.log()) == ["cudaMemcpyAsync(40 bytes, kind 4, 24576)"] * 4
    cudart.clear_log()
    np.testing.assert_array_equal(np.from_dlpack(DLPackShim(obj), device="cpu"), source)
    assert copies_in(cudart.log()) == [f"cudaMemcpyAsync(40 bytes, kind 4, {S1})"] * 4
    assert "cudaDeviceGetAttribute(11, 0)" in cudart.log()  # the bound is the device's own


def test_copies_of_rows_wider_than_the_max_pitch(cudart):
    source = _base()[:, ::2, 1:3]
    register(cudart, allocation_of(source), DEVICE)
    obj = CaiArray(source, stream=S1)
    cudart.set_max_pitch(32)  # the 40-byte row is the packed copy's pitch: wider than the bound
    for asked in ({"stream": S2, "copy": True}, {"dl_device": (kDLCPU, 0)}):
        cudart.clear_log()
        capsule = DLPackShim(obj).__dlpack__(**asked)
        np.testing.assert_array_equal(host_values(read_capsule(capsule), source.dtype), source)
        assert [line.split(",")[0] for line in copies_in(cudart.log())] == ["cudaMemcpyAsync(40 bytes"] * 4


def test_host_copy_past_the_call_limit_with_rows_past_the_max_pitch_is_staged(cudart):
    allocation = np.arange(2 * (MAX_CALLS + 10), dtype=np.float32).reshape(-1, 2)
    register(cudart, allocation, DEVICE)
    source = allocation[:, :1]  # rows of 4 bytes, 8 apart: one call each once 8 is past the bound
    cudart.set_max_pitch(4)
    cudart.clear_log()
    np.testing.assert_array_equal(np.from_dlpack(DLPackShim(CaiArray(source, stream=S1)), device="cpu"), source)
    assert copies_in(cudart.log()) == [f"cudaMemcpyAsync({allocation.nbytes - 4} bytes, kind 4, {S1})"]
    with pytest.raises(BufferError, match="would take more than 65536 runtime copy calls"):
        DLPackShim(CaiArray(source, stream=S1)).__dlpack__(copy=True)


@pytest.mark.parametrize("asked", [{"copy": True}, {"dl_device": (kDLCPU, 0)}])
def test_failed_max_pitch_query_raises(cudart, asked):
    source, obj = device_source(cudart, "strided")
    cudart.fail("cudaDeviceGetAttribute", 101)
    cudart.clear_log()
    with pytest.raises(CudaError, match="cudaDeviceGetAttribute.*cudaErrorInvalidDevice"):
        DLPackShim(obj).__dlpack__(**asked)
    assert not any(line.startswith(("cudaMalloc", "cudaMemcpy")) for line in cudart.log())


# ---- pinned and managed memory copied for a consumer on another device ---------------------------------------


@pytest.mark.parametrize("consumer", [1, 2])
@pytest.mark.parametrize("kind", [PINNED_HOST, MANAGED])
def test_pinned_and_managed_copy_runs_on_the_callers_default_stream(cudart, kind, consumer):
    # The allocation is device 0's, its producer stream S1 too; the caller works on device 1, where stream 1
    # (2) is device 1's legacy (per-thread) default stream: the copies must run there, after the producer.
    source, obj = device_source(cudart, "strided", kind=kind)
    cudart.add_stream(S1, 0)
    cudart.current_device = 1
    cudart.log_context()
    cudart.clear_log()
    capsule = DLPackShim(obj).__dlpack__(stream=consumer, copy=True, max_version=(1, 0))
    np.testing.assert_array_equal(host_values(read_capsule(capsule), source.dtype), source)
    log = cudart.log()
    record = next(i for i, line in enumerate(log) if line.startswith("cudaEventRecord") and f", {S1}) @ctx0" in line)
    wait = next(i for i, line in enumerate(log) if line.startswith(f"cudaStreamWaitEvent({consumer}, "))
    assert log[wait].endswith("@ctx1")  # the consumer's stream is the caller's device's
    copies = [i for i, line in enumerate(log) if line.startswith(("cudaMemcpyAsync", "cudaMemcpy2DAsync"))]
    assert copies and record < wait < min(copies)
    assert all(log[i].endswith(f", {consumer}) @ctx1") for i in copies)  # there, not on device 0's stream
    assert cudart.context_device == 1  # the caller's context as it was


@pytest.mark.parametrize("kind", [PINNED_HOST, MANAGED])
def test_pinned_copy_for_the_callers_legacy_stream_after_the_allocations(cudart, kind):
    # Producer and consumer both say "the legacy stream", but the producer's is the allocation's device's and
    # the consumer's the caller's: the copies are still ordered after the producer's work.
    source, obj = device_source(cudart, "contiguous", kind=kind, stream=1)
    cudart.current_device = 1
    cudart.log_context()
    cudart.clear_log()
    capsule = DLPackShim(obj).__dlpack__(stream=1, copy=True, max_version=(1, 0))
    np.testing.assert_array_equal(host_values(read_capsule(capsule), source.dtype), source)
    log = cudart.log()
    record = next(i for i, line in enumerate(log)
                  if line.startswith("cudaEventRecord") and line.endswith(", 1) @ctx0"))
    wait = next(i for i, line in enumerate(log) if line.startswith("cudaStreamWaitEvent(1, ") and line.endswith("@ctx1"))
    copies = [i for i, line in enumerate(log) if line.startswith(("cudaMemcpyAsync", "cudaMemcpy2DAsync"))]
    assert copies and record < wait < min(copies)
    assert all(log[i].endswith(", 1) @ctx1") for i in copies)


# ---- host copies and graph captures ----------------------------------------------------------------------------


@pytest.mark.parametrize("whose", ["another thread's", "this thread's"])
def test_host_copy_leaves_a_global_capture_whole(cudart, whose):
    # A capture in global mode (PyTorch's default) on a stream the copy does not use: the copy into pageable
    # memory and the wait for it are made in relaxed mode, so they neither fail nor invalidate it.
    source, obj = device_source(cudart, "negative")
    capture = cudart.begin_capture(S2, mode=GLOBAL, other_thread=whose == "another thread's")
    cudart.clear_log()
    np.testing.assert_array_equal(np.from_dlpack(DLPackShim(obj), device="cpu"), source)
    assert cudart.violations == 0 and cudart.end_capture(capture)
    assert cudart.thread_capture_mode == GLOBAL  # the thread's mode as it was
    log = cudart.log()
    relax = log.index("cudaThreadExchangeStreamCaptureMode(2) -> 0, was 0")
    sync = log.index(f"cudaStreamSynchronize({S1})")
    restore = log.index("cudaThreadExchangeStreamCaptureMode(0) -> 0, was 2")
    assert relax < log.index(copies_in(log)[0]) and sync < restore


@pytest.mark.parametrize("consumer", [S2, 2])
def test_host_copy_refused_while_the_consumers_stream_captures(cudart, consumer):
    # The consumer's stream captures: a host copy now is not what the graph's launches would read.
    source, obj = device_source(cudart, "contiguous")
    capture = cudart.begin_capture(consumer)
    cudart.clear_log()
    with pytest.raises(BufferError, match=rf"a host copy \(dl_device=\(1, 0\)\) was asked for with stream={consumer}, "
                                          rf"which is capturing a CUDA graph \(capture {capture}\): the copy would be "
                                          r"made once, now, never by the graph's launches"):
        DLPackShim(obj).__dlpack__(stream=consumer, dl_device=(kDLCPU, 0))
    assert copies_in(cudart.log()) == [] and not any("Synchronize" in line for line in cudart.log())
    assert cudart.violations == 0 and cudart.end_capture(capture)
    capture = cudart.begin_capture(consumer)
    cudart.invalidate_capture(capture)
    with pytest.raises(BufferError, match=rf"\(capture {capture}, already invalidated\)"):
        DLPackShim(obj).__dlpack__(stream=consumer, dl_device=(kDLCPU, 0))


def test_host_copy_with_a_consumer_stream_that_cannot_be_asked_raises(cudart):
    source, obj = device_source(cudart, "contiguous")
    cudart.fail("cudaStreamGetCaptureInfo", 400)
    with pytest.raises(CudaError, match="cudaStreamGetCaptureInfo.*cudaErrorInvalidResourceHandle"):
        DLPackShim(obj).__dlpack__(stream=S2, dl_device=(kDLCPU, 0))
    assert cudart.last_error == 0  # the failed query's error was ours to clear: it is in the CudaError


def test_host_copy_whose_producer_stream_cannot_be_asked_raises(cudart):
    """The host copy waits for the producer's stream, which is first asked whether it captures: a failed query is
    refused before the copy (nothing waited for, nothing copied), and its error is not left for the runtime's next
    caller."""
    source, obj = device_source(cudart, "contiguous")
    cudart.clear_log()
    np.from_dlpack(DLPackShim(obj), device="cpu")
    queries = [line for line in cudart.log() if line.startswith("cudaStreamGetCaptureInfo")]
    assert queries[-1].startswith(f"cudaStreamGetCaptureInfo({S1}")  # the producer's stream, asked last
    cudart.clear_log()
    cudart.fail("cudaStreamGetCaptureInfo", 400, after=len(queries) - 1)
    with pytest.raises(CudaError, match="cudaStreamGetCaptureInfo failed") as raised:
        DLPackShim(obj).__dlpack__(dl_device=(kDLCPU, 0), max_version=(1, 0))
    assert (raised.value.call, raised.value.code) == ("cudaStreamGetCaptureInfo", 400)  # the query's own error
    assert copies_in(cudart.log()) == [] and not any("Synchronize" in line for line in cudart.log())
    assert cudart.last_error == 0


def test_device_copy_whose_stream_cannot_be_asked_about_captures_queues_no_copy(cudart):
    """A device copy asks its stream whether it captures right before queuing the copies: outside a capture the
    source is kept until they ran, inside one it is the graph's to keep. Without an answer neither is known, so no
    copy is queued: the query's CudaError, the new memory freed, and its error not left for the runtime's next
    caller."""
    source, obj = device_source(cudart, "contiguous")
    cudart.add_stream(S2, 0)
    cudart.clear_log()
    DLPackShim(obj).__dlpack__(stream=S2, copy=True, max_version=(1, 0))
    log = cudart.log()
    copies = log.index(copies_in(log)[0])
    before = [line for line in log[:copies] if line.startswith("cudaStreamGetCaptureInfo")]
    assert before[-1].startswith(f"cudaStreamGetCaptureInfo({S2}")  # the copies' stream, asked last before them
    cudart.clear_log()
    cudart.fail("cudaStreamGetCaptureInfo", 400, after=len(before) - 1)
    with pytest.raises(CudaError, match="cudaStreamGetCaptureInfo failed") as raised:
        DLPackShim(obj).__dlpack__(stream=S2, copy=True, max_version=(1, 0))
    assert (raised.value.call, raised.value.code) == ("cudaStreamGetCaptureInfo", 400)
    assert copies_in(cudart.log()) == [] and freed(cudart.log()) == 1
    assert cudart.last_error == 0


def test_pinned_copy_for_the_same_legacy_stream_on_the_allocations_device_is_not_ordered(cudart):
    # Caller and allocation on one device: producer and consumer "legacy stream" are one stream, nothing to order.
    source, obj = device_source(cudart, "contiguous", kind=PINNED_HOST, stream=1)
    cudart.clear_log()
    capsule = DLPackShim(obj).__dlpack__(stream=1, copy=True, max_version=(1, 0))
    np.testing.assert_array_equal(host_values(read_capsule(capsule), source.dtype), source)
    # (an event may be recorded after the copy: the source is kept until it has run; no stream waits on another)
    assert not any(line.startswith("cudaStreamWaitEvent") for line in cudart.log())
    cudart.fail("cudaGetDevice", 999)  # asking where the caller is fails (reached first by a zero-copy export)
    cudart.clear_log()
    with pytest.raises(CudaError, match="^cudaGetDevice failed: cudaErrorUnknown"):
        DLPackShim(obj).__dlpack__(stream=1)
    assert cudart.log()[-2:] == ["cudaGetDevice() -> -1", "cudaGetLastError() -> 999"]  # and nothing after it


# ---- a view's legacy stream of pinned memory is the making caller's device's ------------------------------------
# dlpack2cai(x, stream=None or 1) asks the producer for data ready on the caller's legacy stream (device 1's here);
# a DLPack pinned tensor says device_id 0 whatever device allocated it, so a view keeps the device its stream
# was, and copies of it are ordered after that stream.

_PRODUCERS_KEPT = []  # producers' ctypes tensors live as long as the process: a view may outlive a failing test


class PinnedProducer:
    """A DLPack producer of pinned memory (DLPack says device_id 0 for kDLCUDAHost)."""

    def __init__(self, array):
        self.made = MadeTensor(data=array.ctypes.data, device=(kDLCUDAHost, 0), shape=array.shape)
        self.asked = []
        _PRODUCERS_KEPT.append(self)

    def __dlpack_device__(self):
        return (kDLCUDAHost, 0)

    def __dlpack__(self, stream=None, max_version=None, **_):
        self.asked.append(stream)
        return self.made.capsule


def _pinned(cudart, device):
    a = np.arange(24, dtype=np.float32)
    register(cudart, a, PINNED_HOST, device)
    return a


def test_pinned_view_copy_on_another_device_is_ordered_after_the_views_stream(cudart):
    a = _pinned(cudart, 0)
    cudart.current_device = 1
    producer = PinnedProducer(a)
    view = dlpack2cai(producer, stream=1)  # the producer's work is ordered before device 1's legacy stream
    assert producer.asked == [1]
    cudart.current_device = 0
    cudart.log_context()
    cudart.clear_log()
    view.__dlpack__(stream=1, copy=True, max_version=(1, 0))  # copies on device 0's legacy stream ...
    log = cudart.log()
    # ... after device 1's legacy stream: an event recorded there, waited for by device 0's.
    record = [i for i, line in enumerate(log) if line.startswith("cudaEventRecord") and line.endswith(", 1) @ctx1")]
    wait = [i for i, line in enumerate(log) if line.startswith("cudaStreamWaitEvent(1, ") and line.endswith("@ctx0")]
    first_copy = log.index(copies_in(log)[0])
    assert record and wait and record[0] < wait[0] < first_copy, log


@pytest.mark.parametrize("copy", [None, True])
def test_pinned_view_exported_where_it_was_made_uses_no_other_devices_legacy_stream(cudart, copy):
    """Made and handed on with device 1 current, for device 1's legacy stream: nothing is ordered on device 0's, so a
    blocking capture there, unrelated to this conversion, neither breaks nor refuses it."""
    a = _pinned(cudart, 1)
    cudart.current_device = 1
    view = dlpack2cai(PinnedProducer(a))
    capture = cudart.begin_capture(S2, device=0, blocking=True)
    cudart.log_context()
    cudart.clear_log()
    view.__dlpack__(copy=copy, max_version=(1, 0))
    ordering = [line for line in cudart.log() if line.startswith(("cudaEventRecord", "cudaStreamWaitEvent"))]
    assert not any(line.endswith("@ctx0") for line in ordering), ordering  # a copy's release event is device 1's
    assert cudart.violations == 0 and cudart.end_capture(capture)


def test_pinned_view_host_copy_waits_for_the_views_stream(cudart):
    # numpy.from_dlpack(view, device="cpu") copies after device 1's legacy stream, where the producer's work was
    # ordered, not device 0's.
    a = _pinned(cudart, 1)
    cudart.current_device = 1
    view = dlpack2cai(PinnedProducer(a))
    cudart.log_context()
    cudart.clear_log()
    np.testing.assert_array_equal(np.from_dlpack(view, device="cpu"), a)
    log = cudart.log()
    assert any(line.startswith("cudaStreamSynchronize(1)") and line.endswith("@ctx1") for line in log), log


def others_ran_during(call):
    """Whether another Python thread ran while call() did: the thread waits for the GIL before call starts, and
    with the switch interval far longer than the test, it can take the GIL only where call releases it."""
    import threading
    import time

    go, done, ran = threading.Event(), threading.Event(), []

    def other():
        go.wait()
        ran.append(True)  # needs the GIL
        done.set()

    thread = threading.Thread(target=other)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        thread.start()
        go.set()
        deadline = time.perf_counter() + 0.05
        while time.perf_counter() < deadline:  # holding the GIL: the other thread is woken and waits for it
            pass
        call()
        answer = bool(ran)
    finally:
        sys.setswitchinterval(interval)
        done.wait(10)
        thread.join(10)
    return answer


@pytest.mark.skipif(not getattr(sys, "_is_gil_enabled", lambda: True)(), reason="a free-threaded build has no GIL")
def test_large_host_copies_release_the_gil_small_ones_keep_it():
    """A host copy of 64 KiB or more gathers with the GIL released (other threads run meanwhile); a smaller one
    keeps it (releasing would cost more than the copy)."""
    large = np.ones((256, 1024), dtype=np.float64)[:, ::2]  # 1 MiB gathered from a strided source
    at_the_threshold = np.ones(2 * 65536, dtype=np.uint8)[::2]  # 64 KiB exactly
    below = np.ones(2 * 65535, dtype=np.uint8)[::2]
    small = np.ones(64, dtype=np.float64)[::2]
    # A copy of 64 KiB releases the GIL for microseconds, and the waiting thread may not be running yet when it
    # does: 200 copies give it 200 windows (no switch can come between them: the switch interval is 1000 s). A held
    # GIL gives none, however many copies.
    def copies(source):
        return lambda: [DLPackShim(source).__dlpack__(copy=True) for _ in range(200)]

    for released in (large, at_the_threshold):
        assert any(others_ran_during(copies(released)) for _ in range(3))
    for kept in (below, small):
        assert not others_ran_during(copies(kept))


# Host copies of 64 KiB or more (csrc/copy.c: CDL_COPY_RELEASE_GIL_BYTES), gathered with the GIL released.
LARGE_LAYOUTS = {
    "contiguous": lambda: np.arange(256 * 512, dtype=np.float64).reshape(256, 512),
    "strided": lambda: np.arange(256 * 1024, dtype=np.float64).reshape(256, 1024)[:, ::2],
    "negative and transposed": lambda: np.arange(512 * 300, dtype=np.int32).reshape(512, 300)[::-1, ::-3].T,
    "at the threshold": lambda: (np.arange(2 * 65536) % 251).astype(np.uint8)[::2],
}


@pytest.mark.parametrize("layout", LARGE_LAYOUTS)
def test_large_host_copy_holds_the_sources_values(layout):
    """A host copy large enough to be gathered without the GIL holds every value of its source, C-contiguous,
    whatever the source's strides (the layouts above are each 64 KiB or more)."""
    source = LARGE_LAYOUTS[layout]()
    assert source.nbytes >= 65536
    capsule = DLPackShim(source).__dlpack__(copy=True, max_version=(1, 0))
    fields = read_capsule(capsule)
    assert fields["strides"] == contiguous_strides(source.shape)
    np.testing.assert_array_equal(host_values(fields, source.dtype), source)
    np.testing.assert_array_equal(np.from_dlpack(DLPackShim(source), copy=True), source)


def test_device_copy_whose_devices_scope_cannot_be_left_raises_and_frees_the_copy(cudart):
    """Data of device 2 copied for a stream of device 2 while device 0 is current: the copies are issued in device
    2's context, then the caller's is put back. When it cannot be, the copy is refused (CudaError naming the call)
    and its memory freed: a caller left in the wrong context is told so, not handed a tensor."""
    cuda_runtime_info()
    host = np.arange(8, dtype=np.float32)
    register(cudart, host, DEVICE, device=2)
    cudart.add_stream(S1, 2)
    cudart.add_stream(S2, 2)
    obj = CaiArray(host, stream=S1)
    cudart.clear_log()
    capsule = DLPackShim(obj).__dlpack__(stream=S2, copy=True, max_version=(1, 0))
    log = cudart.log()
    copied = next(i for i, line in enumerate(log) if line.startswith("cudaMemcpyAsync"))
    pops = sum(line.startswith("cuCtxPopCurrent") for line in log[:copied])  # the pop after the copy is the next
    del capsule
    cudart.clear_log()
    cudart.fail("cuCtxPopCurrent", 201, after=pops)
    with pytest.raises(CudaError, match="cuCtxPopCurrent failed"):
        DLPackShim(obj).__dlpack__(stream=S2, copy=True, max_version=(1, 0))
    log = cudart.log()
    assert any(line.startswith("cudaMemcpyAsync") for line in log) and freed(log) == 1


def test_staged_host_copy_whose_devices_scope_cannot_be_entered_frees_its_staging(cudart):
    """A host copy past the call limit stages the bytes it reaches in one host block first; when the data's device
    cannot be entered for the copy, the copy is refused (CudaError) and that block freed, every time."""
    if c_heap_bytes() is None:
        pytest.skip("this C library cannot say how much of its heap is in use (mallinfo2)")
    allocation = np.arange(2 * (MAX_CALLS + 10), dtype=np.float32).reshape(-1, 2)
    register(cudart, allocation, DEVICE, device=2)
    source = allocation[:, :1]  # rows of 4 bytes, 8 apart: one call each once 8 is past the bound, so staged
    cudart.set_max_pitch(4)
    obj = CaiArray(source)
    cudart.clear_log()
    np.from_dlpack(DLPackShim(obj), device="cpu")
    log = cudart.log()
    assert copies_in(log) == [f"cudaMemcpyAsync({allocation.nbytes - 4} bytes, kind 4, 1)"]  # one staged copy
    retains = sum(line.startswith("cuDevicePrimaryCtxRetain") for line in log)
    gc.collect()
    before = c_heap_bytes()
    for _ in range(4):  # a lost staging block is half a MiB a call
        cudart.fail("cuDevicePrimaryCtxRetain", 101, after=retains - 1)
        with pytest.raises(CudaError, match="cuDevicePrimaryCtxRetain failed"):
            DLPackShim(obj).__dlpack__(dl_device=(1, 0), max_version=(1, 0))
    gc.collect()
    assert c_heap_bytes() - before < allocation.nbytes // 2


def test_empty_device_copy_is_made_with_no_stream(cudart):
    """A device copy of no elements is one byte nobody reads: allocated with no stream (not stream-ordered on the
    consumer's) and nothing queued."""
    source, obj = device_source(cudart, "empty")
    cudart.add_stream(S2, 0)
    cudart.clear_log()
    capsule = DLPackShim(obj).__dlpack__(stream=S2, copy=True, max_version=(1, 0))
    allocations = [line for line in cudart.log() if line.startswith("cudaMalloc")]
    assert allocations == ["cudaMalloc(1) -> ok"] and copies_in(cudart.log()) == []
    del capsule


def test_device_copy_of_exactly_the_call_limit_is_made(cudart):
    """65,536 runtime copy calls is the limit itself: made, one call a row; one more row is refused."""
    allocation = np.arange(2 * (MAX_CALLS + 1), dtype=np.float32).reshape(-1, 2)
    register(cudart, allocation, DEVICE)
    cudart.set_max_pitch(4)  # rows of 4 bytes, 8 apart: past the bound, so one call each
    obj = CaiArray(allocation[:MAX_CALLS, :1])
    capsule = DLPackShim(obj).__dlpack__(copy=True)  # the runtime loaded, the pitch and the pool's event asked once
    del capsule
    cudart.clear_log()
    before = cudart.calls
    capsule = DLPackShim(obj).__dlpack__(copy=True)
    assert cudart.calls - before >= MAX_CALLS  # (the log keeps only its first lines)
    np.testing.assert_array_equal(host_values(read_capsule(capsule), np.float32), allocation[:MAX_CALLS, :1])
    del capsule
    with pytest.raises(BufferError, match="would take more than 65536 runtime copy calls"):
        DLPackShim(CaiArray(allocation[:, :1])).__dlpack__(copy=True)


def test_staged_host_copy_refused_for_its_streams_capture_query_frees_its_staging(cudart):
    """A host copy past the call limit stages the bytes it reaches in one host block first; when the producer's
    stream then cannot be asked about graph captures, the copy is refused (CudaError) and that block freed, every
    time."""
    if c_heap_bytes() is None:
        pytest.skip("this C library cannot say how much of its heap is in use (mallinfo2)")
    allocation = np.arange(2 * (MAX_CALLS + 10), dtype=np.float32).reshape(-1, 2)
    register(cudart, allocation, DEVICE)
    cudart.set_max_pitch(4)  # rows of 4 bytes, 8 apart: one call each, past the bound, so staged
    obj = CaiArray(allocation[:, :1], stream=S1)
    np.from_dlpack(DLPackShim(obj), device="cpu")
    gc.collect()
    before = c_heap_bytes()
    for _ in range(4):  # a lost staging block is half a MiB a call
        cudart.clear_log()
        cudart.fail("cudaStreamGetCaptureInfo", 400)
        with pytest.raises(CudaError, match="cudaStreamGetCaptureInfo failed") as raised:
            DLPackShim(obj).__dlpack__(dl_device=(kDLCPU, 0), max_version=(1, 0))
        assert (raised.value.call, raised.value.code) == ("cudaStreamGetCaptureInfo", 400)  # the query's own error
        assert copies_in(cudart.log()) == []
    gc.collect()
    assert c_heap_bytes() - before < allocation.nbytes // 2


def test_staged_host_copy_refused_while_its_stream_captures_names_the_capture(cudart):
    """A host copy past the call limit (staged) of data whose stream is capturing a graph is refused before it
    waits for the stream: CudaError naming cudaStreamSynchronize and cudaErrorStreamCaptureUnsupported (900), no
    copy made, the capture left whole."""
    allocation = np.arange(2 * (MAX_CALLS + 10), dtype=np.float32).reshape(-1, 2)
    register(cudart, allocation, DEVICE)
    cudart.set_max_pitch(4)  # rows of 4 bytes, 8 apart: one call each, past the bound, so staged
    obj = CaiArray(allocation[:, :1], stream=S1)
    capture = cudart.begin_capture(S1)
    cudart.clear_log()
    with pytest.raises(CudaError, match=f"waits for stream {S1}, which is capturing a CUDA graph") as raised:
        DLPackShim(obj).__dlpack__(dl_device=(kDLCPU, 0), max_version=(1, 0))
    assert (raised.value.call, raised.value.code) == ("cudaStreamSynchronize", 900)
    assert copies_in(cudart.log()) == []
    assert cudart.violations == 0 and cudart.end_capture(capture)


def test_host_copies_let_go_give_their_memory_back(cudart):
    """A host copy's memory is the consumer's until it lets the tensor go, then given back: host copies of a MiB of
    device memory made and dropped one after another do not grow the C heap."""
    if c_heap_bytes() is None:
        pytest.skip("this C library cannot say how much of its heap is in use (mallinfo2)")
    source = np.arange(1 << 18, dtype=np.float32)
    register(cudart, source, DEVICE)
    obj = CaiArray(source, stream=S1)
    np.testing.assert_array_equal(np.from_dlpack(DLPackShim(obj), device="cpu"), source)
    gc.collect()
    before = c_heap_bytes()
    for _ in range(4):
        copied = np.from_dlpack(DLPackShim(obj), device="cpu")
        assert copied[-1] == source[-1]
        del copied
    gc.collect()
    assert c_heap_bytes() - before < source.nbytes


def test_strided_host_copy_of_sixteen_byte_items():
    """complex128, the widest item a typestr names: a strided copy moves each item's 16 bytes whole and packs
    them 16 bytes apart."""
    values = np.arange(40) + 1j * np.arange(100, 140)
    source = values.reshape(5, 8)[::-1, ::3]
    capsule = DLPackShim(source).__dlpack__(copy=True, max_version=(1, 0))
    fields = read_capsule(capsule)
    assert fields["strides"] == contiguous_strides(source.shape)
    np.testing.assert_array_equal(host_values(fields, source.dtype), source)


def test_staged_host_copy_whose_staging_block_cannot_be_had_raises_memory_error(cudart):
    """A host copy past the call limit stages every byte its layout reaches in one host block. Twenty dimensions
    of two elements, 2**44 bytes apart (none merges, and none is a pitch the runtime takes), reach 20 * 2**44
    bytes, past any address space: MemoryError, before anything is copied or waited for."""
    pointer, stride = 0x7E00_0000_0000, 2**44
    cudart.add_region(pointer, 20 * stride + 1, DEVICE, 0)
    obj = InstanceInterface({"shape": (2,) * 20, "typestr": "|u1", "strides": (stride,) * 20,
                             "data": (pointer, False), "version": 3, "stream": None})
    cudart.clear_log()
    with pytest.raises(MemoryError):
        DLPackShim(obj).__dlpack__(dl_device=(kDLCPU, 0), max_version=(1, 0))
    log = cudart.log()
    assert copies_in(log) == [] and not any("Synchronize" in line for line in log)


def test_copy_whose_byte_count_passes_64_bits_is_refused():
    """2**60 complex128 items (a broadcast of one: stride 0) are 2**64 bytes: no allocation can hold the copy,
    and the count itself does not fit. Refused with BufferError naming the element count and size."""
    one = np.zeros(1, np.complex128)
    made = MadeTensor(data=one.ctypes.data, dtype=(5, 128, 1), shape=(2**60,), strides=(0,))  # kDLComplex
    view = dlpack2cai(made.capsule)
    for asked in ({"copy": True}, {"copy": True, "max_version": (1, 0)}):
        with pytest.raises(BufferError, match="^a copy of 1152921504606846976 elements of 16 bytes does not fit "
                                              "in memory$"):
            view.__dlpack__(**asked)
    del view


def test_host_copy_larger_than_any_allocation_raises_memory_error(cudart):
    """2**59 float64 items (a broadcast of one) are 2**62 bytes: the count fits, but no host block that large
    can be had."""
    pointer = 0x7E00_0000_0000
    cudart.add_region(pointer, 8, DEVICE, 0)
    obj = InstanceInterface({"shape": (2**59,), "typestr": "<f8", "strides": (0,), "data": (pointer, False),
                             "version": 3, "stream": None})
    cudart.clear_log()
    with pytest.raises(MemoryError):
        DLPackShim(obj).__dlpack__(dl_device=(kDLCPU, 0))
    assert copies_in(cudart.log()) == []


# A call of a device copy that can fail, for data of device 2 produced on a stream of device 2 and copied for
# another stream there, with device 0 current (so each scope switches): which occurrence fails, and whether the
# memory was allocated, and the copies queued, by then.
AROUND_A_DEVICE_COPY = {
    "entering the allocation's scope": ("cuDevicePrimaryCtxRetain", 101, 0, False, False),
    "leaving the allocation's scope": ("cuCtxPopCurrent", 201, 0, True, False),
    "ordering the copies after the producer": ("cudaStreamWaitEvent", 400, 0, True, False),
    "entering the copies' scope": ("cuDevicePrimaryCtxRetain", 101, 1, True, False),
    "ordering the producer after the copies": ("cudaStreamWaitEvent", 400, 1, True, True),
}


@pytest.mark.parametrize("where", AROUND_A_DEVICE_COPY)
@pytest.mark.parametrize("kind, free", [(DEVICE, f"cudaFreeAsync({S2})"), (PINNED_HOST, "cudaFreeHost()")],
                         ids=["device", "pinned"])
def test_a_device_copy_whose_call_fails_raises_and_frees_what_it_made(cudart, where, kind, free):
    """Each call of a device copy that fails raises CudaError naming it, and hands back nothing: memory already
    allocated is freed once, by the call that frees its kind (stream-ordered on the consumer's stream where it was
    made there), the source is not kept, and the caller's context is as it was."""
    call, code, after, allocated, copied = AROUND_A_DEVICE_COPY[where]
    host = np.arange(8, dtype=np.float32)
    register(cudart, host, kind, device=2)
    cudart.add_stream(S1, 2)
    cudart.add_stream(S2, 2)
    obj = CaiArray(host, stream=S1)
    DLPackShim(obj).__dlpack__(stream=S2, copy=True, max_version=(1, 0))  # the runtime loaded, the pooled event made
    references = sys.getrefcount(obj)
    cudart.clear_log()
    cudart.fail(call, code, after=after)
    with pytest.raises(CudaError, match=f"^{call} failed") as raised:
        DLPackShim(obj).__dlpack__(stream=S2, copy=True, max_version=(1, 0))
    assert (raised.value.call, raised.value.code) == (call, code)
    log = cudart.log()
    made = [line for line in log if line.startswith("cudaMalloc") and line.endswith("-> ok")]
    frees = [line for line in log if line.startswith(("cudaFree", "cudaFreeHost", "cudaFreeAsync"))]
    assert (len(made), frees) == ((1, [free]) if allocated else (0, []))
    assert bool(copies_in(log)) == copied
    assert sys.getrefcount(obj) == references and cudart.last_error == 0
    if call != "cuCtxPopCurrent":  # a failed pop leaves the context stack as the driver left it
        assert cudart.context_device == 0


def test_a_host_copy_whose_datas_device_cannot_be_entered_raises(cudart):
    """Data of device 2 copied to the host with device 0 current: when device 2's context cannot be had, CudaError
    names the call, nothing is copied or waited for, and device 0's context stays current."""
    host = np.arange(8, dtype=np.float32)
    register(cudart, host, DEVICE, device=2)
    obj = CaiArray(host, stream=1)
    np.testing.assert_array_equal(np.from_dlpack(DLPackShim(obj), device="cpu"), host)
    cudart.clear_log()
    cudart.fail("cuDevicePrimaryCtxRetain", 2)
    with pytest.raises(CudaError, match="^cuDevicePrimaryCtxRetain failed: CUDA_ERROR_OUT_OF_MEMORY"):
        DLPackShim(obj).__dlpack__(dl_device=(kDLCPU, 0))
    log = cudart.log()
    assert copies_in(log) == [] and not any("Synchronize" in line for line in log)
    assert cudart.context_device == 0 and cudart.last_error == 0


def test_a_device_copy_whose_stream_cannot_be_asked_about_captures_is_made_by_cudamalloc(cudart):
    """Stream-ordered allocation is only for a stream known to be outside any capture: when the consumer's stream
    cannot be asked, the copy is made by cudaMalloc (and freed by cudaFree) all the same, and the failed query's
    error is not left for the runtime's next caller."""
    source, obj = device_source(cudart, "contiguous")
    cudart.add_stream(S1, 0)
    cudart.add_stream(S2, 0)
    cudart.clear_log()
    cudart.fail("cudaStreamGetCaptureInfo", 400)
    capsule = DLPackShim(obj).__dlpack__(stream=S2, copy=True, max_version=(1, 0))
    np.testing.assert_array_equal(host_values(read_capsule(capsule), source.dtype), source)
    assert cudart.last_error == 0
    assert [line for line in cudart.log() if line.startswith("cudaMalloc")] == [f"cudaMalloc({source.nbytes}) -> ok"]
    cudart.clear_log()
    del capsule
    assert [line for line in cudart.log() if line.startswith("cudaFree")] == ["cudaFree()"]


@pytest.mark.usefixtures("trusted_streams")  # the copy is freed in its stream's order
def test_a_device_copy_whose_free_fails_leaves_no_runtime_error_behind(cudart):
    """A free that fails (at exit the runtime may be unloading) has nobody to report to: its error is cleared, not
    left for the next framework that asks the runtime's last error."""
    source, obj = device_source(cudart, "contiguous")
    cudart.add_stream(S2, 0)
    capsule = DLPackShim(obj).__dlpack__(stream=S2, copy=True, max_version=(1, 0))
    cudart.clear_log()
    cudart.fail("cudaFreeAsync", 700)
    del capsule
    assert [line for line in cudart.log() if line.startswith("cudaFree")] == [f"cudaFreeAsync({S2})"]
    assert cudart.last_error == 0 and cudart.context_device == 0
