"""``python -m cai_dlpack``: a self-check. Reports versions and whether a CUDA runtime and GPUs were found,
shows a zero-copy round trip with nothing but Python's standard library, then one with every framework
installed, printing pointer equality and the per-call time of each conversion."""
import array
import ctypes
import importlib
import platform
import sys
import timeit

import cai_dlpack
from cai_dlpack import DLPackShim, cai2dlpack, dlpack2cai


def per_call_ns(call, repeat=7, number=2000):
    """Best of repeat samples of number calls, in ns per call."""
    return min(timeit.repeat(call, repeat=repeat, number=number)) / number * 1e9


def optional(name):
    try:
        return importlib.import_module(name)
    except Exception:  # a broken optional install must not stop the self-check
        return None


def describe_environment():
    print(f"cai_dlpack {cai_dlpack.__version__} (DLPack {'.'.join(map(str, cai_dlpack.DLPACK_VERSION))} header, "
          f"CUDA runtime API {cai_dlpack.CUDART_HEADER_MAJOR} header)")
    print(f"Python {platform.python_version()} on {platform.machine()} {platform.system()}")
    for name in ("numpy", "torch", "cupy", "numba", "jax"):
        module = optional(name)
        print(f"  {name:6s} {getattr(module, '__version__', 'not installed') if module else 'not installed'}")
    try:
        info = cai_dlpack.cuda_runtime_info()
        print(f"CUDA runtime: {info['path']} (version {info['version']}), {info['device_count']} GPU(s)")
        return info["device_count"]
    except (RuntimeError, cai_dlpack.CudaError) as error:
        print(f"CUDA runtime: none usable ({error})")
        return 0


def row(rows, what, same_memory, ns):
    rows.append((what, "yes" if same_memory else "NO", f"{ns:,.0f}"))


class HostArray:
    """Host memory and the array-interface dict that describes it, as a library without NumPy would hand
    it over. The object owns the memory, so a capsule made from it keeps it alive."""

    def __init__(self, values):
        self.memory = array.array("d", values)
        address, length = self.memory.buffer_info()
        typestr = ("<" if sys.byteorder == "little" else ">") + "f8"
        self.__array_interface__ = {"shape": (length,), "typestr": typestr, "data": (address, False), "version": 3}


def standard_library_round_trip(rows):
    """array.array -> cai2dlpack -> DLPack capsule -> dlpack2cai -> DLPackView -> memoryview, with the address
    and the values at each end, and a write through the memoryview read back from the array."""
    host = HostArray([0.5, 1.5, 2.5, 3.5])
    address = host.memory.buffer_info()[0]
    capsule = cai2dlpack(host)
    capsule_text = repr(capsule)  # before dlpack2cai consumes it and renames it used_dltensor
    view = dlpack2cai(capsule)
    through = memoryview(view)
    through_address = ctypes.addressof(ctypes.c_char.from_buffer(through))
    view_address = view.__array_interface__["data"][0]
    print("\nZero-copy round trip with the standard library alone:")
    step = "  {:30s} {}".format
    print(step("array.array('d')", f"at 0x{address:x}: {host.memory.tolist()}"))
    print(step("-> cai2dlpack(its interface)", f"a DLPack capsule: {capsule_text}"))
    print(step("-> dlpack2cai(capsule)", f"at 0x{view_address:x}: DLPackView shape {view.shape}, "
                                         f"typestr {view.typestr!r}, device {view.device} (kDLCPU)"))
    print(step("-> memoryview(view)", f"at 0x{through_address:x}: {through.tolist()}"))
    through[0] = 42.0
    print(f"  memoryview[0] = 42.0, and the array.array reads {host.memory[0]}")
    same = (through_address == address == view_address and host.memory[0] == 42.0
            and through.tolist() == host.memory.tolist())
    print(f"  {'same address, same values: zero-copy' if same else 'FAILED: the memory is not shared'}")
    through.release()
    row(rows, "array.array -> cai2dlpack -> dlpack2cai -> memoryview", same,
        per_call_ns(lambda: memoryview(dlpack2cai(cai2dlpack(host))).release()))


def host_round_trips(rows):
    np = optional("numpy")
    if np is None:
        return
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    pointer = x.__array_interface__["data"][0]
    y = np.from_dlpack(DLPackShim(x))
    row(rows, "numpy -> DLPackShim -> numpy.from_dlpack", y.__array_interface__["data"][0] == pointer,
        per_call_ns(lambda: np.from_dlpack(DLPackShim(x))))
    capsule_ns = per_call_ns(lambda: cai2dlpack(x))
    row(rows, "cai2dlpack(numpy array)", True, capsule_ns)
    torch = optional("torch")
    if torch is None:
        return
    t = torch.from_dlpack(DLPackShim(x))
    row(rows, "numpy -> DLPackShim -> torch.from_dlpack", t.data_ptr() == pointer,
        per_call_ns(lambda: torch.from_dlpack(DLPackShim(x))))
    tensor = torch.arange(12.0)
    a = np.asarray(dlpack2cai(tensor))
    row(rows, "torch -> dlpack2cai -> numpy.asarray", a.__array_interface__["data"][0] == tensor.data_ptr(),
        per_call_ns(lambda: np.asarray(dlpack2cai(tensor))))


def gpu_round_trips(rows):
    torch, cupy, numba_cuda = optional("torch"), optional("cupy"), optional("numba.cuda")
    if torch is not None and torch.cuda.is_available():
        t = torch.arange(1 << 10, device="cuda", dtype=torch.float32)
        view = dlpack2cai(t)
        row(rows, "torch.cuda -> dlpack2cai (CAI pointer)", view.__cuda_array_interface__["data"][0] == t.data_ptr(),
            per_call_ns(lambda: dlpack2cai(t)))
        if cupy is not None:
            c = cupy.asarray(view)
            row(rows, "torch.cuda -> dlpack2cai -> cupy.asarray", c.data.ptr == t.data_ptr(),
                per_call_ns(lambda: cupy.asarray(dlpack2cai(t))))
        if numba_cuda is not None:
            d = numba_cuda.as_cuda_array(view)
            row(rows, "torch.cuda -> dlpack2cai -> numba.cuda.as_cuda_array",
                d.__cuda_array_interface__["data"][0] == t.data_ptr(),
                per_call_ns(lambda: numba_cuda.as_cuda_array(dlpack2cai(t)), number=200))
    if cupy is not None and torch is not None and torch.cuda.is_available():
        c = cupy.arange(1 << 10, dtype=cupy.float32)
        t = torch.from_dlpack(DLPackShim(c))
        row(rows, "cupy -> DLPackShim -> torch.from_dlpack", t.data_ptr() == c.data.ptr,
            per_call_ns(lambda: torch.from_dlpack(DLPackShim(c))))
    if numba_cuda is not None and torch is not None and torch.cuda.is_available():
        d = numba_cuda.device_array(1 << 10, dtype="f4")
        t = torch.from_dlpack(DLPackShim(d))
        row(rows, "numba.cuda -> DLPackShim -> torch.from_dlpack",
            t.data_ptr() == d.__cuda_array_interface__["data"][0],
            per_call_ns(lambda: torch.from_dlpack(DLPackShim(d)), number=500))
    jax = optional("jax")
    if jax is not None and cupy is not None:
        try:
            on_gpu = any(device.platform == "gpu" for device in jax.devices())
        except RuntimeError:
            on_gpu = False
        if on_gpu:
            c = cupy.arange(1 << 10, dtype=cupy.float32)
            j = jax.dlpack.from_dlpack(DLPackShim(c))
            same = j.unsafe_buffer_pointer() == c.data.ptr
            row(rows, "cupy -> DLPackShim -> jax.dlpack.from_dlpack", same,
                per_call_ns(lambda: jax.dlpack.from_dlpack(DLPackShim(c)), number=200))


def main():
    devices = describe_environment()
    rows = []
    standard_library_round_trip(rows)
    host_round_trips(rows)
    if devices:
        gpu_round_trips(rows)
    width = max(len(r[0]) for r in rows)
    print()
    print(f"| {'zero-copy round trip':{width}s} | same memory | ns per call |")
    print(f"|{'-' * (width + 2)}|-------------|-------------|")
    for what, same, ns in rows:
        print(f"| {what:{width}s} | {same:11s} | {ns:>11s} |")
    if any(same != "yes" for _, same, _ in rows):
        print("\nFAILED: a conversion did not share memory")
        return 1
    np = optional("numpy")
    if np is not None:
        from cai_dlpack._benchmark import cpu_groups, markdown, run_groups

        groups = cpu_groups(np, optional("torch"))
        print("\nShort benchmark against the peers, same run (full run: python benchmarks/run_all.py):\n")
        print(markdown(run_groups(groups, repeat=7), {title: reference for title, reference, _ in groups}))
    else:
        print("\nInstall numpy (and torch, cupy, numba-cuda, jax) to see round trips with them as well.")
    print(f"\nOK: {len(rows)} conversion{'s' if len(rows) != 1 else ''} shared memory")
    return 0


if __name__ == "__main__":
    sys.exit(main())
