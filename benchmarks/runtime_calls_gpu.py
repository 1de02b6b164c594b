"""Runtime and driver calls per conversion on a real GPU, counted by CUPTI's callback API (the library of NVIDIA's
nvidia-cuda-cupti wheel, or the toolkit's), beside what the CPU suite's runtime double counts (the README's table).
Every runtime API call the process makes while a row runs is counted, and every driver API call made outside a
runtime call (ours go through cudaGetDriverEntryPoint); a row that includes a framework's own work (torch's
from_dlpack) counts that framework's calls too, so its peer row is shown beside it.
Usage: python benchmarks/runtime_calls_gpu.py [--out DIR] (writes DIR/runtime_calls.md as well)"""
import argparse
import collections
import ctypes
import glob
import os
import sys

DRIVER_DOMAIN, RUNTIME_DOMAIN = 1, 2  # CUpti_CallbackDomain
API_ENTER = 0  # CUpti_ApiCallbackSite
REPEAT = 50


class CallbackData(ctypes.Structure):  # CUpti_CallbackData, its leading fields
    _fields_ = [("callbackSite", ctypes.c_int), ("functionName", ctypes.c_char_p),
                ("functionParams", ctypes.c_void_p), ("functionReturnValue", ctypes.c_void_p),
                ("symbolName", ctypes.c_char_p), ("context", ctypes.c_void_p), ("contextUid", ctypes.c_uint32)]


CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.POINTER(CallbackData))


def find_cupti():
    """The path of a libcupti.so in an NVIDIA wheel, torch's folder or a toolkit, or None."""
    roots = [p for p in sys.path if os.path.isdir(p)] + ["/usr/local/cuda"]
    for root in roots:
        for pattern in ("nvidia/*/lib/libcupti.so*", "nvidia/*/*/lib/libcupti.so*", "torch/lib/libcupti*.so*",
                        "extras/CUPTI/lib64/libcupti.so*", "lib64/libcupti.so*"):
            found = sorted(glob.glob(os.path.join(root, pattern)))
            if found:
                return found[0]
    return None


class Counter:
    """Names of the API calls made while on: runtime calls, and driver calls not made inside a runtime call."""

    def __init__(self, library):
        self.lib = ctypes.CDLL(library)
        self.calls, self.depth, self.on = [], 0, False
        self.callback = CALLBACK(self._called)  # kept: CUPTI holds the pointer
        self.subscriber = ctypes.c_void_p()
        for call, args in (("cuptiSubscribe", (ctypes.byref(self.subscriber), self.callback, None)),
                           ("cuptiEnableDomain", (1, self.subscriber, RUNTIME_DOMAIN)),
                           ("cuptiEnableDomain", (1, self.subscriber, DRIVER_DOMAIN))):
            code = getattr(self.lib, call)(*args)
            if code != 0:
                raise RuntimeError(f"{call} failed with CUPTI error {code}")

    def _called(self, userdata, domain, callback_id, data):
        entering = data.contents.callbackSite == API_ENTER
        if entering and self.on and (domain == RUNTIME_DOMAIN or self.depth == 0):
            self.calls.append(data.contents.functionName.decode())
        if domain == RUNTIME_DOMAIN:
            self.depth += 1 if entering else -1

    def count(self, work):
        """(calls per run, 'name xN' per run) of work, run REPEAT times after one warm-up run."""
        work()
        self.calls, self.on = [], True
        try:
            for _ in range(REPEAT):
                work()
        finally:
            self.on = False
        names = collections.Counter(self.calls)
        described = ", ".join(f"{name} x{n / REPEAT:g}" if n != REPEAT else name for name, n in names.items())
        return len(self.calls) / REPEAT, described or "none"


def rows():
    import cupy
    import torch

    from cai_dlpack import DLPackShim, dlpack2cai

    c = cupy.arange(1 << 16, dtype=cupy.float32)
    other = cupy.cuda.Stream(non_blocking=True)
    t = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
    result = [
        ("CuPy's own `cupy_array.__cuda_array_interface__` (part of every shim row)", lambda: c.__cuda_array_interface__),
        ("`DLPackShim(cupy_array).__dlpack__(stream=1)`: the producer's stream (the legacy one), capsule dropped",
         lambda: DLPackShim(c).__dlpack__(stream=1, max_version=(1, 0))),
        ("`DLPackShim(cupy_array).__dlpack__(stream=-1)`: no ordering",
         lambda: DLPackShim(c).__dlpack__(stream=-1, max_version=(1, 0))),
        ("`DLPackShim(cupy_array).__dlpack__(stream=other)`: ordered by an event",
         lambda: DLPackShim(c).__dlpack__(stream=other.ptr, max_version=(1, 0))),
        ("`torch.from_dlpack(DLPackShim(cupy_array))`, the tensor dropped", lambda: torch.from_dlpack(DLPackShim(c))),
        ("(peer) `torch.from_dlpack(cupy_array)`, the tensor dropped", lambda: torch.from_dlpack(c)),
        ("`dlpack2cai(tensor)` (torch's exchange API; the legacy stream), the view dropped", lambda: dlpack2cai(t)),
        ("`dlpack2cai(tensor, stream=-1)`, the view dropped", lambda: dlpack2cai(t, stream=-1)),
        ("`dlpack2cai(tensor, stream=other)`, the view dropped", lambda: dlpack2cai(t, stream=other.ptr)),
    ]
    try:
        from numba import cuda as numba_cuda
    except ImportError:
        return result
    d = numba_cuda.device_array(1 << 16, dtype="f4")
    result.append(("`DLPackShim(numba_array).__dlpack__(stream=1)`, capsule dropped",
                   lambda: DLPackShim(d).__dlpack__(stream=1, max_version=(1, 0))))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", metavar="DIR", help="also write DIR/runtime_calls.md")
    args = parser.parse_args(argv)
    try:
        import cupy  # noqa: F401
        import torch
    except ImportError as error:
        print(f"runtime calls not counted: {error}")
        return 0
    if not torch.cuda.is_available():
        print("runtime calls not counted: no CUDA GPU")
        return 0
    library = find_cupti()
    if library is None:
        print("runtime calls not counted: no libcupti.so found (pip install nvidia-cuda-cupti)")
        return 0
    counter = Counter(library)
    lines = ["# Runtime and driver calls per conversion (CUPTI)", "",
             f"GPU: {torch.cuda.get_device_name()}; CUPTI: {library}; each row run {REPEAT} times after a warm-up.",
             "", "| case | calls | which (per run) |", "|---|---:|---|"]
    for label, work in rows():
        calls, which = counter.count(work)
        lines.append(f"| {label} | {calls:g} | {which} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "runtime_calls.md"), "w") as out:
            out.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
