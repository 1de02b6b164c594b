"""Ordered release on a real device: a consumer drops its tensor on the host while a kernel it queued still has to
read the memory, and the producer's own caching allocator (CuPy's pool, torch's allocator) must not hand the
block to new work before that kernel ran. With the release unordered (the test-only switch) the race is real:
the producer's next array reuses the block and its fill lands before the consumer's late read. The consumers'
streams here outlive the tensors (torch's pool streams never go; the CuPy stream is held to the end), which
trust_streams says; without it a stream named by handle is not used at the drop, which a destroyed one would crash.
"""
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")
cupy = pytest.importorskip("cupy", reason="CuPy is not installed")

import cai_dlpack  # noqa: E402
from cai_dlpack import DLPackShim, _core, dlpack2cai  # noqa: E402
from cai_dlpack._benchmark import SPIN_KERNEL  # noqa: E402
from support.cai_objects import Wrapped  # noqa: E402
from test_gpu import external_stream  # noqa: E402

N = 1 << 20
SPIN_NS = 200_000_000  # the consumer's queued work: its read comes this late


@pytest.fixture
def ordering():
    """The consumers' streams trusted, and CuPy's blocks taken from a pool of the test's own: CuPy keeps a free list
    per stream handle (a new stream may get a dead one's handle, and its list) and takes any block of the size from
    it, so blocks earlier tests left free would decide which block the producer's next array gets."""
    cai_dlpack.options(trust_streams=True)
    with cupy.cuda.using_allocator(cupy.cuda.MemoryPool().malloc):
        yield lambda enabled: _core._set_ordered_release(enabled)
    _core._set_ordered_release(True)
    cai_dlpack.options(trust_streams=False)


def wait_for_no_pending(seconds=5.0):
    """Runs Python (the interpreter's pending calls with it) until no release waits: the block did go back."""
    deadline = time.monotonic() + seconds
    while _core._pending_releases()["pending"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return _core._pending_releases()["pending"]


def warm(spin, producer, consumer):
    """Loads every kernel and caches memory for both streams first: a module load or a cudaMalloc during the spin
    can serialize the streams and hide the race."""
    with producer:
        a = cupy.ones(N, dtype=cupy.float32)
        a.fill(-1)
        a.sum()
    with torch.cuda.stream(consumer):
        b = torch.ones(N, device="cuda")
        b.sum()
        b.fill_(-1)
        with external_stream(consumer.cuda_stream):
            spin((1,), (1,), (np.int64(1),))
            cupy.asarray(dlpack2cai(b, stream=consumer.cuda_stream)).sum()
    torch.cuda.synchronize()
    del a, b


@pytest.mark.parametrize("ordered", [True, False])
def test_cupy_block_outlives_the_torch_read_queued_before_the_drop(ordering, ordered):
    spin = cupy.RawKernel(SPIN_KERNEL, "spin")
    producer = cupy.cuda.Stream(non_blocking=True)
    consumer = torch.cuda.Stream()
    warm(spin, producer, consumer)
    with producer:
        x = cupy.ones(N, dtype=cupy.float32)
    producer.synchronize()
    block = x.data.ptr
    ordering(ordered)
    with torch.cuda.stream(consumer):
        t = torch.from_dlpack(DLPackShim(Wrapped(x, producer.ptr)))  # torch names its current stream: consumer
        assert t.data_ptr() == block
        with external_stream(consumer.cuda_stream):
            spin((1,), (1,), (np.int64(SPIN_NS),))
        total = t.sum()  # queued after the spin
    del t, x  # the consumer's drop, then the producer's: only the queued read still needs the block
    with producer:
        y = cupy.empty(N, dtype=cupy.float32)  # CuPy's pool hands out a free block of this size on this stream
        y.fill(-1)
    reused = y.data.ptr == block
    consumer.synchronize()
    producer.synchronize()
    if ordered:
        assert not reused  # the block was still held for the consumer's read
        assert total.item() == N
        assert wait_for_no_pending() == 0
        with producer:  # y still holds its own block
            z = cupy.empty(N, dtype=cupy.float32)
        assert z.data.ptr == block  # released once the read ran: back in CuPy's pool, not leaked
    else:
        assert reused
        assert total.item() != N  # the fill reached the block before the late read: the race is real


@pytest.mark.parametrize("ordered", [True, False])
def test_torch_block_outlives_the_cupy_read_queued_before_the_view_died(ordering, ordered):
    spin = cupy.RawKernel(SPIN_KERNEL, "spin")
    consumer = cupy.cuda.Stream(non_blocking=True)
    producer = torch.cuda.Stream()
    warm(spin, consumer, producer)
    with torch.cuda.stream(producer):
        x = torch.ones(N, device="cuda")
    producer.synchronize()
    block = x.data_ptr()
    ordering(ordered)
    with torch.cuda.stream(producer):
        view = dlpack2cai(x, stream=consumer.ptr)
    with consumer:
        spin((1,), (1,), (np.int64(SPIN_NS),))
        # Through DLPack: CuPy reading a CAI that names a stream synchronizes that stream on the host, which
        # would end the spin before the drop.
        total = cupy.from_dlpack(view).sum()  # queued after the spin
    del view, x  # torch's caching allocator gets the block back when the view lets go of the tensor
    with torch.cuda.stream(producer):
        y = torch.empty(N, device="cuda")
        y.fill_(-1)
    reused = y.data_ptr() == block
    consumer.synchronize()
    producer.synchronize()
    if ordered:
        assert not reused
        assert float(total) == N
        assert wait_for_no_pending() == 0
        with torch.cuda.stream(producer):  # y still holds its own block
            z = torch.empty(N, device="cuda")
        assert z.data_ptr() == block
    else:
        assert reused
        assert float(total) != N


DESTROYED_FIRST = {
    # CuPy's own consumer in a stream it made for the call: the stream is destroyed when collected, before the array.
    "cupy.from_dlpack": """
        x = cupy.ones(N, dtype=cupy.float32)
        with cupy.cuda.Stream(non_blocking=True):
            y = cupy.from_dlpack(DLPackShim(x))
        del x
        gc.collect()
        del y
    """,
    # A view made for a CuPy stream that a function's locals drop first.
    "dlpack2cai": """
        t = torch.ones(N, device="cuda")
        stream = cupy.cuda.Stream(non_blocking=True)
        view = dlpack2cai(t, stream=stream.ptr)
        del stream
        gc.collect()
        del view
    """,
    # A device copy for such a stream: its memory goes back by cudaFree.
    "copy": """
        x = cupy.ones(N, dtype=cupy.float32)
        with cupy.cuda.Stream(non_blocking=True) as stream:
            y = dlpack2cai(DLPackShim(x).__dlpack__(stream=stream.ptr, copy=True, max_version=(1, 0)))
        del stream
        gc.collect()
        del y
    """,
}


@pytest.mark.parametrize("case", DESTROYED_FIRST)
def test_a_consumer_stream_destroyed_before_the_drop_is_not_used(case):
    """By default nothing made for a stream handle uses it at the drop: the process lives on (with trust_streams
    on, the same code reads freed driver memory, seen as a segmentation fault on an H200). Own process: a crash
    must not take the suite with it."""
    script = textwrap.dedent("""
        import gc
        import cupy, torch
        from cai_dlpack import DLPackShim, _core, dlpack2cai
        N = 1 << 20
        torch.zeros(1, device="cuda")
    """) + textwrap.dedent(DESTROYED_FIRST[case]) + textwrap.dedent("""
        for _ in range(3):
            s = cupy.cuda.Stream(non_blocking=True)  # new streams may take the dead handle's memory
        cupy.cuda.Device().synchronize()
        print(_core._pending_releases()["pending"])
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("CAI_DLPACK_TRUST_STREAMS", None)
    child = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script], env=env, capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.split() == ["0"]
