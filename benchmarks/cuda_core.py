"""cai_dlpack beside cuda.core's StridedMemoryView (SMV), NVIDIA's own CAI/DLPack view, in the same run: a view
of the same producers, a capsule of the same data, and numpy.from_dlpack of each one's result. Host memory
(SMV's views of it need no GPU); each group's rows are sampled in turns, so their ratios compare like with like.
A separate script from cpu.py / run_all.py so either can change without the other.

Usage: python benchmarks/cuda_core.py [--out FILE | --update-committed]
(default: print the table; --update-committed writes benchmarks/results/cuda_core.md)"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as run_all.py: no BLAS thread spinning beside the rows

import numpy as np  # noqa: E402

from cai_dlpack import DLPackShim, cai2dlpack, dlpack2cai  # noqa: E402
from cai_dlpack._benchmark import Holder, markdown, run_groups  # noqa: E402

COMMITTED = os.path.join(HERE, "results", "cuda_core.md")


def smv_groups(np, torch=None):
    """[(title, reference label, [(label, call)])], each row timed as a statement; [] without cuda-core."""
    try:
        from cuda.core.utils import StridedMemoryView as SMV
    except ImportError:
        return []
    x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    holder = Holder(x)  # a ready __array_interface__ dict: a CAI-style producer on the host
    names = {"SMV": SMV, "DLPackShim": DLPackShim, "cai2dlpack": cai2dlpack, "dlpack2cai": dlpack2cai, "np": np,
             "x": x, "holder": holder, "smv": SMV.from_dlpack(x, stream_ptr=-1), "view": dlpack2cai(x),
             "shim": DLPackShim(holder)}
    views = [("dlpack2cai(x)", ("dlpack2cai(x)", names)),
             ("SMV.from_dlpack(x, stream_ptr=-1)", ("SMV.from_dlpack(x, stream_ptr=-1)", names)),
             ("SMV.from_any_interface(x, stream_ptr=-1)", ("SMV.from_any_interface(x, stream_ptr=-1)", names))]
    groups = [("a view of a NumPy array", "SMV.from_dlpack(x, stream_ptr=-1)", views)]
    if torch is not None:
        names["t"] = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
        groups.append(("a view of a torch tensor (dlpack2cai: torch's C exchange API)",
                       "SMV.from_dlpack(t, stream_ptr=-1)", [
                           ("dlpack2cai(t)", ("dlpack2cai(t)", names)),
                           ("SMV.from_dlpack(t, stream_ptr=-1)", ("SMV.from_dlpack(t, stream_ptr=-1)", names))]))
    groups.append(("a capsule of the same data, from a view made beforehand",
                   "smv.__dlpack__(max_version=(1, 0))  (SMV)", [
        ("view.__dlpack__(max_version=(1, 0))  (dlpack2cai's view)", ("view.__dlpack__(max_version=(1, 0))", names)),
        ("smv.__dlpack__(max_version=(1, 0))  (SMV)", ("smv.__dlpack__(max_version=(1, 0))", names)),
        ("cai2dlpack(holder, max_version=(1, 0))  (from the interface dict)",
         ("cai2dlpack(holder, max_version=(1, 0))", names)),
        ("x.__dlpack__(max_version=(1, 0))  (NumPy's own)", ("x.__dlpack__(max_version=(1, 0))", names))]))
    groups.append(("numpy.from_dlpack of each", "np.from_dlpack(smv)  (SMV)", [
        ("np.from_dlpack(view)  (dlpack2cai's view)", ("np.from_dlpack(view)", names)),
        ("np.from_dlpack(smv)  (SMV)", ("np.from_dlpack(smv)", names)),
        ("np.from_dlpack(shim)  (DLPackShim of the interface dict)", ("np.from_dlpack(shim)", names)),
        ("np.from_dlpack(x)  (NumPy's own)", ("np.from_dlpack(x)", names))]))
    return groups


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="FILE", help="write the table to FILE")
    where.add_argument("--update-committed", action="store_true", help=f"replace {COMMITTED}")
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        torch = None
    groups = smv_groups(np, torch)
    if not groups:
        print("cuda-core is not installed: no rows to compare with (pip install cuda-core cuda-bindings)")
        return 1
    from run_all import environment
    import cuda.core

    table = markdown(run_groups(groups, repeat=21), {title: reference for title, reference, _ in groups})
    text = (f"# cai_dlpack beside cuda.core's StridedMemoryView (CPU, host memory)\n\n{environment()}; "
            f"cuda-core {cuda.core.__version__}\n\nMedian of 21 samples per row; each group's rows sampled in "
            f"turns; x is a 64x64 float32 NumPy array, holder a ready __array_interface__ dict of it.\n\n{table}\n")
    print(text)
    path = COMMITTED if args.update_committed else args.out
    if path:
        with open(path, "w") as out:
            out.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
