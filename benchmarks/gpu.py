"""GPU benchmarks (run where a GPU is present): the shim and view paths against what users write today,
and the host time of a conversion while the producer stream is busy."""
import statistics
import time

import numpy as np

from cai_dlpack import DLPackShim, dlpack2cai
from cai_dlpack._benchmark import SPIN_KERNEL, run_groups



def available():
    try:
        import cupy
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0


def groups():
    import cupy
    import torch

    c = cupy.arange(1 << 20, dtype=cupy.float32).reshape(1024, 1024)
    result = [("CuPy array -> torch (CUDA)", "torch.from_dlpack(cupy_array)", [
        ("torch.from_dlpack(DLPackShim(cupy_array))", lambda: torch.from_dlpack(DLPackShim(c))),
        ("torch.as_tensor(cupy_array, device='cuda')", lambda: torch.as_tensor(c, device="cuda")),
        ("torch.from_dlpack(cupy_array)", lambda: torch.from_dlpack(c)),
        # Not a path into torch: what the shim pays CuPy, twice (torch calls __dlpack_device__, then __dlpack__).
        ("(part of the shim's cost) CuPy builds cupy_array.__cuda_array_interface__",
         lambda: c.__cuda_array_interface__),
    ])]
    try:
        from numba import cuda as numba_cuda
    except ImportError:
        return result
    d = numba_cuda.device_array((1024, 1024), dtype=np.float32)
    rows = [("torch.from_dlpack(DLPackShim(numba_array))", lambda: torch.from_dlpack(DLPackShim(d))),
            ("torch.from_dlpack(cupy.asarray(numba_array))", lambda: torch.from_dlpack(cupy.asarray(d)))]
    reference = "torch.from_dlpack(cupy.asarray(numba_array))"
    try:
        from cuda.core.utils import StridedMemoryView  # cuda.core.experimental: deprecated, then removed
    except ImportError:
        try:
            from cuda.core.experimental.utils import StridedMemoryView
        except ImportError:
            StridedMemoryView = None
    if StridedMemoryView is not None:
        def via_cuda_core():
            return torch.from_dlpack(StridedMemoryView.from_cuda_array_interface(d, stream_ptr=-1))

        try:
            via_cuda_core()
            rows.append(("cuda.core StridedMemoryView.from_cuda_array_interface + __dlpack__", via_cuda_core))
        except Exception as error:  # its API moves between releases: report, do not stop the run
            print(f"cuda.core peer left out: {type(error).__name__}: {error}")
    result.append(("numba-cuda array -> torch", reference, rows))
    t = torch.zeros((1024, 1024), device="cuda")
    # PyTorch's own interface is version 2, with no stream: Numba neither waits nor synchronizes for it. Ours
    # exports the stream the data is ready on (1, the legacy stream, by default), which Numba synchronizes, and
    # asks torch's __dlpack__ for that stream. The rows below split the cost between the two.
    result.append(("torch tensor -> numba-cuda", "numba.cuda.as_cuda_array(tensor)", [
        ("numba.cuda.as_cuda_array(dlpack2cai(tensor))", lambda: numba_cuda.as_cuda_array(dlpack2cai(t))),
        ("numba.cuda.as_cuda_array(dlpack2cai(tensor, stream=-1)): no ordering asked, as with torch's own",
         lambda: numba_cuda.as_cuda_array(dlpack2cai(t, stream=-1))),
        ("numba.cuda.as_cuda_array(tensor)", lambda: numba_cuda.as_cuda_array(t)),
        ("(part of dlpack2cai's cost) torch's tensor.__dlpack__(stream=1)", lambda: t.__dlpack__(stream=1)),
        ("(part of dlpack2cai's cost) torch's tensor.__dlpack__()", lambda: t.__dlpack__()),
    ]))
    return result


def host_blocking(milliseconds=100, periods=7, conversions=200):
    """Host microseconds of one conversion while the producer stream is busy, ours against CuPy's and Numba's
    consumers. In each of several busy periods ours is timed right after the kernel launch (where the first
    runtime calls cost more: 7 to 30 us each on the H100 machine, from run to run), then over a run of
    conversions while the stream is still busy; beside it, one bare cudaEventRecord right after the launch, the
    floor of any event ordering. The peers wait out the whole period: one sample each."""
    import cupy

    spin = cupy.RawKernel(SPIN_KERNEL, "spin")
    consumer = cupy.cuda.Stream(non_blocking=True)

    class Producer:
        def __init__(self, array, stream):
            self.array = array
            self.__cuda_array_interface__ = dict(array.__cuda_array_interface__, stream=stream.ptr)

    def busy():
        stream = cupy.cuda.Stream(non_blocking=True)
        x = cupy.zeros(1 << 20, dtype=cupy.float32)
        cupy.cuda.Device().synchronize()
        with stream:
            spin((1,), (1,), (np.int64(milliseconds * 1_000_000),))
        return Producer(x, stream), stream

    def ours(producer):
        start = time.perf_counter()
        DLPackShim(producer).__dlpack__(stream=consumer.ptr, max_version=(1, 0))
        return time.perf_counter() - start

    # One ordered conversion first, so the timed ones do not include loading the runtime or making the event.
    idle = cupy.cuda.Stream(non_blocking=True)
    ours(Producer(cupy.zeros(4, dtype=cupy.float32), idle))
    first, steady, bare = [], [], []
    event = cupy.cuda.Event(disable_timing=True)
    for _ in range(periods):
        producer, stream = busy()
        first.append(ours(producer))
        steady += [ours(producer) for _ in range(conversions)]
        busy_after = not stream.done
        stream.synchronize()
        assert busy_after, "the producer stream finished before the conversions did: no busy period measured"
        producer, stream = busy()
        start = time.perf_counter()
        event.record(stream)
        bare.append(time.perf_counter() - start)
        stream.synchronize()
    steady.sort()
    timings = {
        f"cai_dlpack (event-ordered), right after the launch: median of {periods}": statistics.median(first),
        f"cai_dlpack (event-ordered), right after the launch: worst of {periods}": max(first),
        f"cai_dlpack (event-ordered), while busy: median of {len(steady)}": statistics.median(steady),
        f"cai_dlpack (event-ordered), while busy: 99th percentile of {len(steady)}": steady[len(steady) * 99 // 100],
        f"one bare cudaEventRecord (CuPy Event.record), right after the launch: median of {periods}":
            statistics.median(bare),
    }

    def peer(convert):
        producer, stream = busy()
        start = time.perf_counter()
        convert(producer)
        seconds = time.perf_counter() - start
        stream.synchronize()
        return seconds

    timings["cupy.asarray (CAI consumer)"] = peer(cupy.asarray)
    try:
        from numba import cuda as numba_cuda

        timings["numba.cuda.as_cuda_array (CAI consumer)"] = peer(numba_cuda.as_cuda_array)
    except ImportError:
        pass
    return {label: seconds * 1e6 for label, seconds in timings.items()}


def device():
    """The GPU and CUDA versions the figures were taken on."""
    import torch

    import cai_dlpack

    info = cai_dlpack.cuda_runtime_info()
    return (f"{torch.cuda.get_device_name(0)}; CUDA runtime {info['version']} ({info['path']}); "
            f"PyTorch built for CUDA {torch.version.cuda}")


def run():
    built = groups()
    return {"results": run_groups(built), "references": {title: ref for title, ref, _ in built},
            "host_blocking_us": host_blocking(), "device": device()}
