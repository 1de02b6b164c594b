"""Runs every benchmark this machine supports and writes <part>.md and .png (cpu, and gpu where a GPU is),
with the machine, Python and library versions, to a folder: --out DIR, by default build/benchmarks/ (ignored by
git, so a run leaves the clone unchanged). --update-committed writes them to benchmarks/results/ instead, the
committed results the README quotes. --quick runs the short CPU groups alone (what the self-check runs).
Usage: python benchmarks/run_all.py [--out DIR | --update-committed] [--quick]"""
import argparse
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# No row calls BLAS, but OpenBLAS's idle threads (started with NumPy) spin on the other cores, and on a
# machine with two they slow whichever row runs beside them.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import cpu  # noqa: E402
import gpu  # noqa: E402
import instructions  # noqa: E402

import cai_dlpack  # noqa: E402
from cai_dlpack._benchmark import markdown  # noqa: E402

COMMITTED = os.path.join(HERE, "results")
DEFAULT_OUT = os.path.join(os.path.dirname(HERE), "build", "benchmarks")


def parse_arguments(argv=None):
    """(the folder the results go to, the parsed arguments)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="DIR", help=f"folder for the results (default: {DEFAULT_OUT})")
    where.add_argument("--update-committed", action="store_true",
                       help=f"replace the committed results in {COMMITTED}")
    parser.add_argument("--quick", action="store_true",
                        help="the short CPU groups only (no extras, ndim growth, memory or GPU part)")
    parser.add_argument("--instructions", action="store_true",
                        help="callgrind's instruction counts (instructions.md) instead of the timed runs")
    args = parser.parse_args(argv)
    if args.quick and args.instructions:
        parser.error("--quick and --instructions are two different runs; ask for one")
    if args.quick and args.update_committed:
        parser.error("--quick makes a partial run, which must not replace the committed results")
    return (COMMITTED if args.update_committed else os.path.abspath(args.out or DEFAULT_OUT)), args


def environment():
    versions = [f"cai_dlpack {cai_dlpack.__version__}", f"Python {platform.python_version()}"]
    for name, module in (("numpy", "numpy"), ("torch", "torch"), ("cupy", "cupy"), ("numba", "numba"),
                         ("pydlpack", "dlpack")):
        try:
            versions.append(f"{name} {getattr(__import__(module), '__version__', '?')}")
        except ImportError:
            pass
    cpu_name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu_name = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{cpu_name}, {os.cpu_count()} cores; " + ", ".join(versions) +
            f"; OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}")


def plot(path, results, growth=None):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = len(results) + (1 if growth else 0)
    figure, axes = plt.subplots(panels, 1, figsize=(9, 2.2 * panels + 1), squeeze=False)
    for axis, (title, rows) in zip(axes[:, 0], results):
        labels = [label for label, _, _ in rows]
        medians = [stats["median"] for _, stats, _ in rows]
        errors = [[m - stats["min"] for m, (_, stats, _) in zip(medians, rows)],
                  [stats["max"] - m for m, (_, stats, _) in zip(medians, rows)]]
        colours = ["tab:green" if "DLPackShim" in label or "dlpack2cai" in label or "cai2dlpack" in label
                   else "tab:gray" for label in labels]
        axis.barh(labels, medians, xerr=errors, color=colours)
        if max(medians) > 20 * min(medians):
            axis.set_xscale("log")
        axis.set_title(title, fontsize=9)
        axis.set_xlabel("ns per call (median, min-max)", fontsize=8)
        axis.tick_params(labelsize=7)
        axis.invert_yaxis()
    if growth:
        axis = axes[-1, 0]
        ndims = [n for n, *_ in growth]
        axis.plot(ndims, [c for _, c, _, _ in growth], "o-", label="contiguous (strides None), read afresh")
        axis.plot(ndims, [s for _, _, s, _ in growth], "s-", label="strided (explicit strides), read afresh")
        axis.plot(ndims, [k for _, _, _, k in growth], "^-", label="contiguous, kept record reused")
        axis.set_xscale("log", base=2)
        axis.set_xlabel("ndim", fontsize=8)
        axis.set_ylabel("ns per cai2dlpack", fontsize=8)
        axis.set_title("converter cost against ndim", fontsize=9)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return True


def write(folder, part, report, extra_lines):
    os.makedirs(folder, exist_ok=True)
    text = [f"# {part.upper()} benchmarks", "", f"Machine: {environment()}", "",
            markdown(report["results"], report["references"]), ""] + extra_lines
    with open(os.path.join(folder, f"{part}.md"), "w") as out:
        out.write("\n".join(text) + "\n")
    plot(os.path.join(folder, f"{part}.png"), report["results"], report.get("growth"))
    print("\n".join(text))


def write_instructions(folder):
    report = instructions.run(folder)
    text = ["# Instruction counts (callgrind)", "", f"Machine: {environment()}", "",
            f"Each case is a statement run in loops of {report['iterations']:,} and {2 * report['iterations']:,} "
            "iterations under callgrind, counting only the loops; per call is the difference over "
            f"{report['iterations']:,}, less an empty loop's iteration. Counts do not depend on the machine's load, "
            "so they compare builds; they do not say how long a call takes. Address-space randomization was "
            + ("off (setarch): two runs of one installed build count the same." if report.get("fixed_layout") else
               "on (setarch could not turn it off here): rows move by up to a few dozen between runs."), "",
            instructions.markdown(report)]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "instructions.md"), "w") as out:
        out.write("\n".join(text) + "\n")
    print("\n".join(text))
    print(f"\nResults written to {folder}")


def main(argv=None):
    folder, args = parse_arguments(argv)
    if args.instructions:
        write_instructions(folder)
        return
    report = cpu.run(short=args.quick)
    lines = []
    if report["growth"]:
        lines += ["## Growth of cai2dlpack with ndim (ns per call, median)", "",
                  "| ndim | contiguous, read afresh | strided, read afresh | contiguous, kept record reused |",
                  "|---:|---:|---:|---:|"]
        lines += [f"| {n} | {c:,.0f} | {s:,.0f} | {k:,.0f} |" for n, c, s, k in report["growth"]]
    m = report["memory"]
    if m:
        lines += ["", f"Memory: resident growth over {m['calls']:,} conversions: {m['rss_growth_bytes']:,} bytes; "
                  f"live allocations per unconsumed capsule: {m['allocations_per_capsule']:.2f} "
                  "(the capsule object and our one block)."]
    write(folder, "cpu", report, lines)
    if args.quick:
        print("\nGPU benchmarks skipped: --quick.")
    elif gpu.available():
        report = gpu.run()
        lines = [f"GPU: {report['device']}", "",
                 "## Host time of one conversion while the producer stream is busy for 100 ms", "",
                 "| consumer | host us |", "|---|---:|"]
        lines += [f"| {label} | {us:,.1f} |" for label, us in report["host_blocking_us"].items()]
        write(folder, "gpu", report, lines)
    else:
        print("\nGPU benchmarks skipped: no CUDA GPU with PyTorch and CuPy here.")
    print(f"\nResults written to {folder}" + ("" if folder == COMMITTED else
          " (the committed ones in benchmarks/results/ are unchanged; --update-committed replaces them)"))


if __name__ == "__main__":
    main()
