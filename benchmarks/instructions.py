"""Instruction counts (callgrind) of the converter's paths against NumPy's own exporter, counted in one run.

Instructions do not depend on what else the machine runs, so they compare builds where wall-clock times on a
shared machine cannot. run() starts this file again under `valgrind --tool=callgrind`, with instrumentation
off until the first measured loop and collection on only inside the loops (callgrind_regions.c); each case is
a statement run in a loop of N and of 2N iterations, and its count per call is the difference over N less an
empty loop's per iteration (so neither the loop nor the region's entry is counted).

The cases are what real producers hand the converter: a CuPy-shaped producer, a class whose property builds
its dict afresh on every access as cupy/_core/core.pyx does (shape, typestr, descr, stream, version, strides
None, data), on the device path (through the CUDA runtime test double, tests/cudart_double, whose pointer
query is not counted: its cost is the double's, not a runtime's) and on the host path (its twin, the same
dict as __array_interface__); the producer's own access is counted alone and subtracted. Then NumPy arrays
through their buffer, torch.from_dlpack through a DLPackShim, and the ready-dict, exchange-API and
dlpack2cai rows of the wall-clock benchmark. Runtime calls per conversion are counted by the double.
Usage: python benchmarks/instructions.py (or run_all.py --instructions); needs valgrind and its headers."""
import glob
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHILD = "CAI_DLPACK_CALLGRIND_CHILD"
ITERATIONS = 2000
DEVICE_POINTER = 0x7F00_0000_0000  # a region the double reports as device memory of device 0
REFERENCE = "NumPy x.__dlpack__()"
POINTER_QUERY = "cudaPointerGetAttributes"


def build_regions(directory):
    """Compiles callgrind_regions.c and imports it."""
    import importlib.util

    out = os.path.join(directory, "_callgrind_regions" + sysconfig.get_config_var("EXT_SUFFIX"))
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        compiler = "cc"
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-I", sysconfig.get_paths()["include"],
                    os.path.join(HERE, "callgrind_regions.c"), "-o", out], check=True)
    spec = importlib.util.spec_from_file_location("_callgrind_regions", out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CupyShaped:
    """A producer that builds its interface dict on each access, key for key as CuPy's ndarray does
    (cupy/_core/core.pyx: shape, typestr, descr, then stream, version, strides None for a C-contiguous array,
    data (pointer, False)); the stream is the legacy default, 1, as CuPy exports when no stream is current.
    Served as __cuda_array_interface__ (device memory) or, for the host twin, as __array_interface__."""

    def __init__(self, shape, dtype, pointer):
        self._shape = list(shape)
        self.dtype = dtype
        self.pointer = pointer

    @property
    def shape(self):
        return tuple(self._shape)

    def _interface(self):
        desc = {"shape": self.shape, "typestr": self.dtype.str, "descr": self.dtype.descr}
        desc["stream"] = 1
        desc["version"] = 3
        desc["strides"] = None
        desc["data"] = (self.pointer, False)
        return desc


class DeviceProducer(CupyShaped):
    @property
    def __cuda_array_interface__(self):
        return self._interface()


class HostProducer(CupyShaped):
    def __init__(self, array):
        super().__init__(array.shape, array.dtype, array.ctypes.data)
        self.array = array

    @property
    def __array_interface__(self):
        return self._interface()


def cases(np):
    """[(group, label, statement, names, subtract)]: subtract is the label whose count is taken off this
    one's (the producer's own access), or None."""
    import cai_dlpack
    from cai_dlpack import DLPackShim, cai2dlpack, dlpack2cai
    from cai_dlpack._benchmark import Holder, producer_dicts

    x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    device = DeviceProducer(x.shape, x.dtype, DEVICE_POINTER)
    host = HostProducer(x)
    names = {"x": x, "np": np, "cai2dlpack": cai2dlpack, "dlpack2cai": dlpack2cai, "DLPackShim": DLPackShim,
             "device": device, "host": host}
    fresh = "a CuPy-shaped producer (a fresh dict per access)"
    rows = [
        (fresh, REFERENCE, "x.__dlpack__()", None),
        (fresh, "device: the producer's own __cuda_array_interface__ access", "device.__cuda_array_interface__",
         None),
        (fresh, "device: cai2dlpack(obj) beyond that access", "cai2dlpack(device)",
         "device: the producer's own __cuda_array_interface__ access"),
        (fresh, "host twin: the producer's own __array_interface__ access", "host.__array_interface__", None),
        (fresh, "host twin: cai2dlpack(obj) beyond that access", "cai2dlpack(host)",
         "host twin: the producer's own __array_interface__ access"),
        (fresh, "cai2dlpack(x): a NumPy array, read from its fields", "cai2dlpack(x)", None),
    ]
    for i, (which, iface) in enumerate(producer_dicts(x).items()):
        names[f"h{i}"] = Holder(x, iface=iface)
        rows.append(("ready dicts (kept records)", f"cai2dlpack(ready dict): {which} dict", f"cai2dlpack(h{i})", None))
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        names["torch"] = torch
        group = "NumPy memory -> torch tensor"
        rows += [
            (group, "torch.from_dlpack(x)", "torch.from_dlpack(x)", None),
            (group, "torch.from_dlpack(DLPackShim(obj)), the host twin, beyond its access",
             "torch.from_dlpack(DLPackShim(host))", "host twin: the producer's own __array_interface__ access"),
            (group, "torch.from_dlpack(DLPackShim(x))", "torch.from_dlpack(DLPackShim(x))", None),
        ]
        names["t"] = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
        group = "torch CPU tensor -> NumPy array"
        rows += [
            (group, "dlpack2cai(t)", "dlpack2cai(t)", None),
            (group, "numpy.asarray(dlpack2cai(t))", "np.asarray(dlpack2cai(t))", None),
            (group, "numpy.from_dlpack(t)", "np.from_dlpack(t)", None),
        ]
    try:
        import tvm_ffi
    except ImportError:
        tvm_ffi = None
    if tvm_ffi is not None:
        names["tvm_ffi"] = tvm_ffi
        names["shim"] = DLPackShim(Holder(x))
        group = "apache-tvm-ffi consumer, a ready interface behind a DLPackShim"
        rows += [
            (group, "tvm_ffi.from_dlpack(shim): C exchange API", "tvm_ffi.from_dlpack(shim)", None),
            (group, "tvm_ffi.from_dlpack(shim.__dlpack__(...))",
             "tvm_ffi.from_dlpack(shim.__dlpack__(max_version=(1, 0)))", None),
            (group, "tvm_ffi.from_dlpack(x): NumPy's own __dlpack__", "tvm_ffi.from_dlpack(x)", None),
        ]
    return [(group, label, statement, names, subtract) for group, label, statement, subtract in rows], cai_dlpack


def make_loop(statement, names, iterations):
    """A function running statement iterations times, the statement compiled as written (no call of ours)."""
    namespace = dict(names)
    exec(compile(f"def _loop(_range):\n    for _ in _range:\n        {statement}\n", "<case>", "exec"), namespace)
    loop, iterations_range = namespace["_loop"], range(iterations)
    return lambda: loop(iterations_range)


def runtime_calls(double, cai2dlpack, device):
    """{scenario: [runtime calls]} of one device-path conversion, as the double logged them."""
    scenarios = {}
    for label, kwargs in (("consumer stream = producer stream (1)", {}),
                          ("consumer stream -1 (no ordering)", {"stream": -1}),
                          ("consumer stream 2 (per-thread default): ordered", {"stream": 2})):
        cai2dlpack(device, **kwargs)  # the pool's event is made once; what a steady conversion calls follows
        double.clear_log()
        capsule = cai2dlpack(device, **kwargs)  # held until the log is read: its release calls nothing here
        scenarios[label] = [re.sub(r"\(.*", "", line) for line in double.log()]
        del capsule
    return scenarios


def child(out_folder):
    """The run under callgrind: every case's loops, one dump each; the double's call counts to a file."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from support import cuda_double

    work = tempfile.mkdtemp(prefix="cdl_instructions_")
    double_path = cuda_double.build(work)
    os.environ["CAI_DLPACK_CUDART"] = double_path
    double = cuda_double.CudaDouble(double_path)
    double.reset()
    double.add_region(DEVICE_POINTER, 1 << 20, cuda_double.DEVICE, 0)
    import numpy as np

    regions = build_regions(work)
    rows, cai_dlpack = cases(np)
    calls = runtime_calls(double, cai_dlpack.cai2dlpack, rows[0][3]["device"])
    with open(os.path.join(out_folder, "runtime_calls.txt"), "w") as out:
        for label, made in calls.items():
            out.write(f"{label}\t{len(made)}\t{', '.join(made)}\n")
    loops = [("empty loop", make_loop("pass", {}, ITERATIONS), make_loop("pass", {}, 2 * ITERATIONS))]
    for _, label, statement, names, _ in rows:
        loops.append((label, make_loop(statement, names, ITERATIONS), make_loop(statement, names, 2 * ITERATIONS)))
    for _, once, twice in loops:  # warm: first calls load code, fill caches and pools
        once()
        twice()
    double.clear_log()
    regions.start()
    for index, (_, once, twice) in enumerate(loops):
        regions.count(f"case{index}-n", once)
        regions.count(f"case{index}-2n", twice)


def read_dumps(folder):
    """{dump label: (total instructions, inclusive instructions of the runtime's pointer query)}."""
    found = {}
    annotate = shutil.which("callgrind_annotate")
    for path in glob.glob(os.path.join(folder, "callgrind.out.*")):
        with open(path) as dump:
            text = dump.read()
        label = re.search(r"^desc: Trigger: Client Request: (\S+)", text, re.MULTILINE)
        total = re.search(r"^(?:summary|totals): (\d+)", text, re.MULTILINE)
        if label is None or total is None:
            continue
        pointer_query = 0
        if POINTER_QUERY in text and annotate:
            listing = subprocess.run([annotate, "--inclusive=yes", "--threshold=100", path], capture_output=True,
                                     text=True, check=True).stdout
            for line in listing.splitlines():
                if re.search(rf"[:\s]{POINTER_QUERY}\s", line + " "):
                    pointer_query = int(line.split()[0].replace(",", ""))
                    break
        found[label.group(1)] = (int(total.group(1)), pointer_query)
    return found


def fixed_layout_prefix():
    """The command prefix that turns address-space randomization off for the run, or [] where it cannot be (no
    setarch, or a container whose seccomp profile refuses the personality call). CPython's type-attribute cache
    slots hash the names' addresses, so with randomization on, two runs of one build differ by up to a few dozen
    instructions a row; with it off, two runs of one installed build gave the same count in every row."""
    prefix = ["setarch", platform.machine(), "--addr-no-randomize"]
    if shutil.which("setarch") is None:
        return []
    probe = subprocess.run(prefix + ["true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return prefix if probe.returncode == 0 else []


def run(out_folder):
    """Runs the cases under callgrind; returns {"rows": [(group, label, per call, ratio)], "calls": ...}."""
    if shutil.which("valgrind") is None:
        raise SystemExit("instruction counts need valgrind (with callgrind and its headers) on the PATH")
    dumps = tempfile.mkdtemp(prefix="cdl_callgrind_")
    environment = dict(os.environ, **{CHILD: dumps, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1"})
    fixed_layout = fixed_layout_prefix()
    subprocess.run(fixed_layout + ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
                    f"--callgrind-out-file={dumps}/callgrind.out.%p", sys.executable, os.path.abspath(__file__)],
                   env=environment, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    counts = read_dumps(dumps)
    import numpy as np

    rows, _ = cases(np)

    def per_call(index):
        once, twice = counts[f"case{index}-n"], counts[f"case{index}-2n"]
        return (twice[0] - once[0]) / ITERATIONS, (twice[1] - once[1]) / ITERATIONS

    empty = per_call(0)[0]
    measured = {}
    for index, (group, label, _, _, subtract) in enumerate(rows, start=1):
        total, pointer_query = per_call(index)
        measured[label] = (group, total - empty - pointer_query, subtract, pointer_query)
    results = []
    for label, (group, count, subtract, pointer_query) in measured.items():
        if subtract is not None:
            count -= measured[subtract][1]
        results.append((group, label, count, pointer_query))
    with open(os.path.join(dumps, "runtime_calls.txt")) as made:
        calls = [line.rstrip("\n").split("\t") for line in made]
    shutil.rmtree(dumps, ignore_errors=True)
    return {"rows": results, "reference": measured[REFERENCE][1], "calls": calls, "iterations": ITERATIONS,
            "fixed_layout": bool(fixed_layout)}


def markdown(report):
    reference = report["reference"]
    references = {"NumPy memory -> torch tensor": "torch.from_dlpack(x)",
                  "torch CPU tensor -> NumPy array": "numpy.from_dlpack(t)",
                  "apache-tvm-ffi consumer, a ready interface behind a DLPackShim":
                      "tvm_ffi.from_dlpack(shim.__dlpack__(...))"}
    by_label = {label: count for _, label, count, _ in report["rows"]}
    lines = ["| case | instructions per call | ratio to NumPy x.__dlpack__() | ratio in its group |",
             "|---|---:|---:|---:|"]
    group_now = None
    for group, label, count, pointer_query in report["rows"]:
        if group != group_now:
            group_now = group
            against = references.get(group, REFERENCE)
            lines.append(f"| **{group}** (group ratio to {against}) | | | |")
        base = by_label[references.get(group, REFERENCE)]
        note = f" (the double's pointer query, {pointer_query:,.0f}, not counted)" if pointer_query else ""
        lines.append(f"| {label}{note} | {count:,.0f} | {count / reference:.2f}x | {count / base:.2f}x |")
    lines += ["", "Runtime calls per device-path conversion of the CuPy-shaped producer (stream 1), counted by the "
              "CUDA runtime test double:", "", "| consumer stream | calls | which |", "|---|---:|---|"]
    lines += [f"| {label} | {count} | {which or 'none'} |" for label, count, which in report["calls"]]
    return "\n".join(lines)


if __name__ == "__main__":
    if os.environ.get(CHILD):
        child(os.environ[CHILD])
    else:
        print(markdown(run(None)))
