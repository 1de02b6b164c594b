"""GPU benchmarks (run where a GPU is present): the shim and view paths against what users write today,
and the host time of a conversion while the producer stream is busy."""
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
    result.append(("torch tensor -> numba-cuda", "numba.cuda.as_cuda_array(tensor)", [
        ("numba.cuda.as_cuda_array(dlpack2cai(tensor))", lambda: numba_cuda.as_cuda_array(dlpack2cai(t))),
        ("numba.cuda.as_cuda_array(tensor)", lambda: numba_cuda.as_cuda_array(t)),
    ]))
    return result


def host_blocking(milliseconds=100):
    """Host seconds of one conversion while the producer stream is busy, ours vs CuPy's and Numba's consumers."""
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

    # One ordered conversion first, so the timed one does not include loading the runtime or making the event.
    idle = cupy.cuda.Stream(non_blocking=True)
    DLPackShim(Producer(cupy.zeros(4, dtype=cupy.float32), idle)).__dlpack__(stream=consumer.ptr, max_version=(1, 0))
    timings = {}
    producer, stream = busy()
    start = time.perf_counter()
    DLPackShim(producer).__dlpack__(stream=consumer.ptr, max_version=(1, 0))
    timings["cai_dlpack (event-ordered)"] = time.perf_counter() - start
    stream.synchronize()
    producer, stream = busy()
    start = time.perf_counter()
    cupy.asarray(producer)
    timings["cupy.asarray (CAI consumer)"] = time.perf_counter() - start
    stream.synchronize()
    try:
        from numba import cuda as numba_cuda

        producer, stream = busy()
        start = time.perf_counter()
        numba_cuda.as_cuda_array(producer)
        timings["numba.cuda.as_cuda_array (CAI consumer)"] = time.perf_counter() - start
        stream.synchronize()
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
