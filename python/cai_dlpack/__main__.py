"""``python -m cai_dlpack``: a self-check. Reports versions and which CUDA runtime it loaded (the file, and how
it was found) and the GPUs, shows a zero-copy round trip with nothing but Python's standard library, then one
with every framework installed. Each row's verdict is what its conversion returned: the result's address is
the source's, and a value written through one end is read through the other. Exits 1 if any row fails."""
import argparse
import array
import ctypes
import importlib
import platform
import sys

import cai_dlpack
from cai_dlpack import DLPackShim, cai2dlpack, dlpack2cai

# Written through one end of a conversion and read through the other; no source array holds it before.
MARK = 42.0

FULL_BENCHMARK = 'python3 -m pip install ".[bench]" && python3 benchmarks/run_all.py'

# How cuda_runtime_info()["source"] found the runtime, in words.
RUNTIME_SOURCES = {"CAI_DLPACK_CUDART": "named by CAI_DLPACK_CUDART",
                   "preloaded": "already loaded in this process",
                   "loader": "found by the loader's search",
                   "pip wheel": "from NVIDIA's pip wheel"}


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
    except (RuntimeError, cai_dlpack.CudaError) as error:
        print(f"CUDA runtime: none usable ({error})")
        return 0
    print(describe_runtime(info))
    return info["device_count"]


def describe_runtime(info):
    """One line: the runtime's version, the file the loader mapped, how it was found (after the name asked
    for where that is not the file: a soname), the GPUs."""
    how = RUNTIME_SOURCES.get(info["source"], info["source"])
    if info["path"] != info["file"]:
        how = f"{info['path']}, {how}"
    version = info["version"]
    return (f"CUDA runtime {version // 1000}.{version % 1000 // 10}: {info['file']} ({how}), "
            f"{info['device_count']} GPU(s)")


def shares_memory(source_address, result_address, write, read):
    """A row's verdict: "yes" when the result starts at the source's address and a value written through
    one end (write(MARK)) is read through the other (read()), else what failed. Nothing is written unless the
    addresses agree."""
    if result_address != source_address:
        return f"NO: 0x{result_address or 0:x}, not 0x{source_address:x}"
    try:
        write(MARK)
        seen = read()
    except Exception as error:  # a read-only result, a consumer refusing: the row fails, the check goes on
        return f"NO: {type(error).__name__}: {error}"
    return "yes" if seen == MARK else f"NO: wrote {MARK}, read {seen}"


def row(rows, what, verdict, call):
    """call: a no-argument callable doing the conversion, timed in turns with every other row's (main)."""
    rows.append((what, verdict, call))


class HostArray:
    """Host memory and the array-interface dict that describes it, as a library without NumPy would hand
    it over. The object owns the memory, so a capsule made from it keeps it alive."""

    def __init__(self, values):
        self.memory = array.array("d", values)
        address, length = self.memory.buffer_info()
        typestr = ("<" if sys.byteorder == "little" else ">") + "f8"
        self.__array_interface__ = {"shape": (length,), "typestr": typestr, "data": (address, False), "version": 3}


class DLTensorHead(ctypes.Structure):
    """The leading fields of DLPack's DLTensor, which a legacy capsule's DLManagedTensor begins with."""
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("dtype", ctypes.c_uint32), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("byte_offset", ctypes.c_uint64)]


# A prototype of our own: setting restype on ctypes.pythonapi's shared one would change it for everyone.
_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def capsule_address(capsule):
    """The address of the first element of a legacy (unconsumed) DLPack capsule's tensor."""
    head = DLTensorHead.from_address(_capsule_pointer(capsule, b"dltensor"))
    return (head.data or 0) + head.byte_offset


def write_float32(address, value):
    ctypes.c_float.from_address(address).value = value


def write_device_float32(address, value):
    """Writes one float32 to device memory through the CUDA runtime the module loaded."""
    runtime = ctypes.CDLL(cai_dlpack.cuda_runtime_info()["file"])
    host = ctypes.c_float(value)
    host_to_device = 1  # cudaMemcpyHostToDevice
    status = runtime.cudaMemcpy(ctypes.c_void_p(address), ctypes.byref(host), ctypes.c_size_t(4), host_to_device)
    if status != 0:
        raise RuntimeError(f"cudaMemcpy failed with CUDA error {status}")


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
    verdict = shares_memory(address, through_address, lambda value: through.__setitem__(0, value),
                            lambda: host.memory[0])
    if through_address == address:
        print(f"  memoryview[0] = {MARK}, and the array.array reads {host.memory[0]}")
    print(f"  {'same address, same values: zero-copy' if verdict == 'yes' else 'FAILED: ' + verdict}")
    through.release()
    row(rows, "array.array -> cai2dlpack -> dlpack2cai -> memoryview", verdict,
        lambda: memoryview(dlpack2cai(cai2dlpack(host))).release())


def host_round_trips(rows):
    np = optional("numpy")
    if np is None:
        return

    def address(a):
        return a.__array_interface__["data"][0]

    def fresh():
        return np.arange(12, dtype=np.float32).reshape(3, 4)

    x = fresh()
    y = np.from_dlpack(DLPackShim(x))
    row(rows, "numpy -> DLPackShim -> numpy.from_dlpack",
        shares_memory(address(x), address(y), lambda value: y.__setitem__((0, 0), value), lambda: x[0, 0]),
        lambda: np.from_dlpack(DLPackShim(x)))
    x2 = fresh()
    capsule = cai2dlpack(x2)
    data = capsule_address(capsule)
    row(rows, "cai2dlpack(numpy array)",
        shares_memory(address(x2), data, lambda value: write_float32(data, value), lambda: x2[0, 0]),
        lambda: cai2dlpack(x2))
    torch = optional("torch")
    if torch is None:
        return
    x3 = fresh()
    t = torch.from_dlpack(DLPackShim(x3))
    row(rows, "numpy -> DLPackShim -> torch.from_dlpack",
        shares_memory(address(x3), t.data_ptr(), lambda value: t.__setitem__((0, 0), value), lambda: x3[0, 0]),
        lambda: torch.from_dlpack(DLPackShim(x3)))
    tensor = torch.arange(12.0)
    a = np.asarray(dlpack2cai(tensor))
    row(rows, "torch -> dlpack2cai -> numpy.asarray",
        shares_memory(tensor.data_ptr(), address(a), lambda value: a.__setitem__(0, value),
                      lambda: tensor[0].item()),
        lambda: np.asarray(dlpack2cai(tensor)))


def gpu_round_trips(rows):
    """Each write and its read run on the legacy default stream (every framework's default here), so the
    read is ordered after the write."""
    torch, cupy, numba_cuda = optional("torch"), optional("cupy"), optional("numba.cuda")
    torch_gpu = torch is not None and torch.cuda.is_available()
    if torch_gpu:
        t = torch.zeros(1 << 10, device="cuda", dtype=torch.float32)
        view = dlpack2cai(t)
        pointer = view.__cuda_array_interface__["data"][0]
        row(rows, "torch.cuda -> dlpack2cai (CAI pointer)",
            shares_memory(t.data_ptr(), pointer, lambda value: write_device_float32(pointer, value),
                          lambda: t[0].item()),
            lambda: dlpack2cai(t))
        if cupy is not None:
            t1 = torch.zeros(1 << 10, device="cuda", dtype=torch.float32)
            c = cupy.asarray(dlpack2cai(t1))
            row(rows, "torch.cuda -> dlpack2cai -> cupy.asarray",
                shares_memory(t1.data_ptr(), c.data.ptr, lambda value: c.__setitem__(0, value),
                              lambda: t1[0].item()),
                lambda: cupy.asarray(dlpack2cai(t1)))
        if numba_cuda is not None:
            t2 = torch.zeros(1 << 10, device="cuda", dtype=torch.float32)
            d = numba_cuda.as_cuda_array(dlpack2cai(t2))
            row(rows, "torch.cuda -> dlpack2cai -> numba.cuda.as_cuda_array",
                shares_memory(t2.data_ptr(), d.__cuda_array_interface__["data"][0],
                              lambda value: d.__setitem__(0, value), lambda: t2[0].item()),
                lambda: numba_cuda.as_cuda_array(dlpack2cai(t2)))
    if cupy is not None and torch_gpu:
        c2 = cupy.zeros(1 << 10, dtype=cupy.float32)
        t3 = torch.from_dlpack(DLPackShim(c2))
        row(rows, "cupy -> DLPackShim -> torch.from_dlpack",
            shares_memory(c2.data.ptr, t3.data_ptr(), lambda value: t3.__setitem__(0, value), lambda: float(c2[0])),
            lambda: torch.from_dlpack(DLPackShim(c2)))
    if numba_cuda is not None and torch_gpu:
        d2 = numba_cuda.device_array(1 << 10, dtype="f4")
        t4 = torch.from_dlpack(DLPackShim(d2))
        row(rows, "numba.cuda -> DLPackShim -> torch.from_dlpack",
            shares_memory(d2.__cuda_array_interface__["data"][0], t4.data_ptr(),
                          lambda value: t4.__setitem__(0, value), lambda: float(d2[0])),
            lambda: torch.from_dlpack(DLPackShim(d2)))
    jax = optional("jax")
    if jax is not None and cupy is not None:
        try:
            on_gpu = any(device.platform == "gpu" for device in jax.devices())
        except RuntimeError:
            on_gpu = False
        if on_gpu:
            c3 = cupy.zeros(1 << 10, dtype=cupy.float32)
            j = jax.dlpack.from_dlpack(DLPackShim(c3))

            def write_through_cupy(value):  # JAX arrays are immutable: the write goes through the source
                c3[0] = value
                cupy.cuda.runtime.deviceSynchronize()

            row(rows, "cupy -> DLPackShim -> jax.dlpack.from_dlpack",
                shares_memory(c3.data.ptr, j.unsafe_buffer_pointer(), write_through_cupy, lambda: float(j[0])),
                lambda: jax.dlpack.from_dlpack(DLPackShim(c3)))


def parse_arguments(argv):
    """The command line: none but -h/--help (usage, exit 0); anything else is refused with the usage on stderr
    and exit status 2, as argparse does."""
    parser = argparse.ArgumentParser(
        prog="python -m cai_dlpack",
        description="Self-check of cai_dlpack: versions, the CUDA runtime it loaded and the GPUs, a zero-copy "
                    "round trip with the standard library alone and one with each framework installed (each "
                    "timed), then, where NumPy is installed, a short benchmark against the peers. Exits 1 if "
                    "any round trip does not share memory.")
    return parser.parse_args(argv)


def main(argv=()):
    from cai_dlpack._benchmark import measure_together

    parse_arguments(argv)
    devices = describe_environment()
    rows = []
    standard_library_round_trip(rows)
    host_round_trips(rows)
    if devices:
        gpu_round_trips(rows)
    # Every row timed in turns with the others (measure_together), so a change of load reaches all alike.
    medians = [stats["median"] for stats in measure_together([call for _, _, call in rows], repeat=9,
                                                             target_seconds=0.002)]
    width = max(len(what) for what, _, _ in rows)
    verdict_width = max(len("same memory"), *(len(verdict) for _, verdict, _ in rows))
    print()
    print(f"| {'zero-copy round trip':{width}s} | {'same memory':{verdict_width}s} | median ns per call |")
    print(f"|{'-' * (width + 2)}|{'-' * (verdict_width + 2)}|--------------------|")
    for (what, verdict, _), ns in zip(rows, medians):
        print(f"| {what:{width}s} | {verdict:{verdict_width}s} | {ns:>18,.0f} |")
    print("same memory: the result's address is the source's, and a value written through one is read through\n"
          "the other; ns per call: the median of 9 samples of each row, the rows sampled in turns")
    # Named with the verdict: a consumer that raised (a third-party library broken by its own dependencies, say)
    # is told apart from memory that was not shared.
    failed = [f"{what} ({verdict})" for what, verdict, _ in rows if verdict != "yes"]
    if failed:
        print(f"\nFAILED: {len(failed)} of {len(rows)} conversions were not shown to share memory: "
              f"{'; '.join(failed)}")
        return 1
    np = optional("numpy")
    if np is not None:
        from cai_dlpack._benchmark import cpu_groups, markdown, run_groups

        groups = cpu_groups(np, optional("torch"))
        print("\nShort benchmark against the peers: each ratio is against a peer timed in this run, 7 samples of "
              "each row,\nthe rows of a group sampled in turns. A rough check, not a measurement: on a busy "
              "machine a ratio\ncan move severalfold from run to run. The full benchmark, from the source tree:\n"
              f"  {FULL_BENCHMARK}\n")
        print(markdown(run_groups(groups, repeat=7), {title: reference for title, reference, _ in groups}))
    else:
        print("\nNo short benchmark: it compares with NumPy. Install numpy (and torch, cupy, numba-cuda, jax) to "
              "see it, and round trips with them as well.")
    print(f"\nOK: {len(rows)} conversion{'s' if len(rows) != 1 else ''} shared memory")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
