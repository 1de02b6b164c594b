"""Timing helpers and the CPU peer comparisons, shared by ``python -m cai_dlpack`` (a short run) and the
scripts under benchmarks/ (the full run). Every figure is a ratio against a peer measured in the same run."""
import statistics
import timeit

# A CUDA kernel that keeps one stream busy for a given number of nanoseconds (the global timer, so no
# clock-rate query): the producer in the host-blocking benchmark and in the GPU suite's race test.
SPIN_KERNEL = r"""
extern "C" __global__ void spin(long long nanoseconds) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < (unsigned long long)nanoseconds);
}
"""


def _timer(call):
    """call is a callable, or a (statement, namespace) pair timed as written, with no wrapping function's
    frame in each call."""
    return timeit.Timer(call[0], globals=call[1]) if isinstance(call, tuple) else timeit.Timer(call)


def _calls_per_sample(timer, target_seconds):
    number = 1
    while True:
        elapsed = timer.timeit(number=number)
        if elapsed >= target_seconds / 4 or number >= 1 << 22:
            break
        number *= 4
    return max(1, int(number * target_seconds / max(elapsed, 1e-9)))


def measure_together(calls, repeat=21, target_seconds=0.005):
    """ns per call of each of calls (median, min and max over repeat samples of many calls each), sampled in
    turns: each round takes one sample of every call, in reverse order every other round. A change of the
    machine's speed during the run (another tenant, the clock, a warming cache) then reaches every call alike,
    and their ratios compare like with like."""
    timers = [_timer(call) for call in calls]
    numbers = [_calls_per_sample(timer, target_seconds) for timer in timers]
    samples = [[] for _ in calls]
    order = list(range(len(calls)))
    for round_ in range(repeat):
        for i in (order if round_ % 2 == 0 else reversed(order)):
            samples[i].append(timers[i].timeit(number=numbers[i]) / numbers[i] * 1e9)
    return [{"median": statistics.median(taken), "min": min(taken), "max": max(taken), "calls": number}
            for taken, number in zip(samples, numbers)]


class Holder:
    """An object whose __array_interface__ is a ready dict: what a converter reads, and nothing else. The dict
    is NumPy's own, descr included (every real producer's dict has keys a converter does not need)."""

    def __init__(self, array, strides=True, iface=None):
        self.array = array
        iface = dict(array.__array_interface__ if iface is None else iface)
        if not strides:
            iface["strides"] = None
        self.__array_interface__ = iface


def producer_dicts(array):
    """The interface dicts real producers build for array's memory, keys in their order: NumPy's
    __array_interface__, and the keys CuPy's and Numba's __cuda_array_interface__ carry (here describing host
    memory, read as an array interface: this machine has no GPU)."""
    numpy_dict = dict(array.__array_interface__)
    pointer = (array.ctypes.data, False)
    cupy_dict = {"shape": array.shape, "typestr": array.dtype.str, "descr": array.dtype.descr, "stream": 1,
                 "version": 3, "strides": None, "data": pointer}
    numba_dict = {"shape": array.shape, "strides": None, "data": pointer, "typestr": array.dtype.str,
                  "stream": 1, "version": 3}
    return {"NumPy's": numpy_dict, "CuPy's keys": cupy_dict, "Numba's keys": numba_dict}


def cpu_groups(np, torch=None, extra=None, short=False):
    """[(title, reference label, [(label, call)])]: each group's rows are compared with its reference."""
    from cai_dlpack import DLPackShim, cai2dlpack, dlpack2cai

    x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    holder = Holder(x)
    # Timed as statements, so every row pays the same (a call expression, no lambda frame).
    names = {"cai2dlpack": cai2dlpack, "holder": holder, "x": x}
    converter = []
    for which, iface in producer_dicts(x).items():
        names[f"h{len(converter)}"] = Holder(x, iface=iface)
        converter.append((f"cai2dlpack(ready dict): {which} dict", (f"cai2dlpack(h{len(converter)})", names)))
    converter += [("cai2dlpack(x): a NumPy array, read from its fields", ("cai2dlpack(x)", names)),
                  ("NumPy x.__dlpack__()", ("x.__dlpack__()", names))]
    converter += list((extra or {}).get("converter", []))
    groups = [("converter alone, 2-d float32", "NumPy x.__dlpack__()", converter)]
    if torch is not None:
        groups.append(("NumPy array -> torch tensor", "torch.from_dlpack(x)", [
            ("torch.from_dlpack(DLPackShim(x))", lambda: torch.from_dlpack(DLPackShim(x))),
            ("torch.from_dlpack(DLPackShim(obj)), obj with a ready dict (NumPy's)",
             lambda: torch.from_dlpack(DLPackShim(holder))),
            ("torch.from_dlpack(x)", lambda: torch.from_dlpack(x)),
            ("torch.from_numpy(x)", lambda: torch.from_numpy(x)),
            ("(not on the shim's path: it reads the buffer) NumPy builds x.__array_interface__",
             lambda: x.__array_interface__),
        ]))
        t = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
        groups.append(("torch CPU tensor -> NumPy array", "numpy.from_dlpack(t)", [
            ("numpy.asarray(dlpack2cai(t))", lambda: np.asarray(dlpack2cai(t))),
            ("numpy.from_dlpack(t)", lambda: np.from_dlpack(t)),
        ]))
    return groups


def run_groups(groups, repeat=21):
    """Measures every row, a group's rows together (measure_together); returns
    [(title, [(label, stats, ratio to reference)])]."""
    results = []
    for title, reference, rows in groups:
        labels, calls = zip(*rows)
        measured = list(zip(labels, measure_together(calls, repeat=repeat)))
        base = dict(measured)[reference]["median"]
        results.append((title, [(label, stats, stats["median"] / base) for label, stats in measured]))
    return results


def markdown(results, reference_of):
    lines = ["| case | median ns/call | min-max | ratio |", "|---|---:|---:|---:|"]
    for title, rows in results:
        lines.append(f"| **{title}** (ratio to {reference_of[title]}) | | | |")
        for label, stats, ratio in rows:
            lines.append(f"| {label} | {stats['median']:,.0f} | {stats['min']:,.0f}-{stats['max']:,.0f} | "
                         f"{ratio:.2f}x |")
    return "\n".join(lines)
