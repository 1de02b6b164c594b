"""CPU benchmarks: the converter against its floors and peers, the shim and view paths against the
frameworks' own exporters, growth with ndim and strides, and memory per conversion."""
import importlib.util
import os
import subprocess
import sysconfig
import tempfile

import numpy as np

from cai_dlpack import _core, cai2dlpack
from cai_dlpack._benchmark import Holder, cpu_groups, measure_together, run_groups


def build_floors():
    """Compiles floors.c into an extension module and imports it; None without a compiler."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = os.path.join(tempfile.mkdtemp(prefix="cdl_floors_"), "_floors" + sysconfig.get_config_var("EXT_SUFFIX"))
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    command = [compiler, "-shared", "-fPIC", "-O2", "-I", sysconfig.get_paths()["include"],
               os.path.join(here, "floors.c"), "-o", out]
    if subprocess.run(command, capture_output=True).returncode != 0:
        command[0] = "cc"
        if subprocess.run(command, capture_output=True).returncode != 0:
            return None
    spec = importlib.util.spec_from_file_location("_floors", out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def converter_extras():
    x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    holder = Holder(x)
    ready = holder.__array_interface__
    extras = []
    floors = build_floors()
    if floors is not None:
        names = {"floors": floors, "ready": ready}
        extras += [("floor f0: malloc + PyCapsule_New", ("floors.f0()", names)),
                   ("floor f1: f0 + 4 interned dict reads", ("floors.f1(ready)", names)),
                   ("floor f1 with PyDict_GetItemString", ("floors.f1_getitemstring(ready)", names))]
    try:
        from dlpack import asdlpack  # the 'pydlpack' package
        extras.append(("pydlpack asdlpack(ready dict).__dlpack__()",
                       ("asdlpack(holder).__dlpack__()", {"asdlpack": asdlpack, "holder": holder})))
    except ImportError:
        pass
    return {"converter": extras}


def exchange_group():
    """tvm_ffi.from_dlpack through our DLPack C exchange API against the same conversion by __dlpack__."""
    try:
        import tvm_ffi
    except ImportError:
        return []
    from cai_dlpack import DLPackShim

    x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    shim = DLPackShim(Holder(x))  # a ready interface dict: the exchange path itself, not NumPy's dict building
    return [("apache-tvm-ffi consumer, a ready interface behind a DLPackShim", "tvm_ffi.from_dlpack(shim.__dlpack__(...))", [
        ("tvm_ffi.from_dlpack(shim): C exchange API", lambda: tvm_ffi.from_dlpack(shim)),
        ("tvm_ffi.from_dlpack(shim.__dlpack__(...))",
         lambda: tvm_ffi.from_dlpack(shim.__dlpack__(max_version=(1, 0)))),
        ("tvm_ffi.from_dlpack(x): NumPy's own __dlpack__", lambda: tvm_ffi.from_dlpack(x)),
    ])]


def records_not_kept(measure):
    """measure() with every interface dict read afresh (_core._set_interface_cache(False)): what a conversion
    of a dict costs the first time, or every time for a producer that builds its dict on each access."""
    _core._set_interface_cache(False)
    try:
        return measure()
    finally:
        _core._set_interface_cache(True)


def uncached_converter_group(groups):
    """The converter group's ready-dict rows again, against the same reference, with records not kept."""
    title, reference, rows = groups[0]
    rows = [(label, call) for label, call in rows if label.startswith("cai2dlpack(ready dict)") or label == reference]
    group = (title + ", every dict read afresh (records not kept)", reference, rows)
    return group, records_not_kept(lambda: run_groups([group]))


def growth(repeat=21):
    """cai2dlpack per-call ns for ndim 1..32: contiguous (strides None) and strided (explicit strides) dicts read
    afresh, and the contiguous dict's kept record reused. Each set of cases is sampled in turns
    (measure_together): a machine still warming up (clock, caches) would otherwise slow the first cases, ndim 1
    among them, and flatter the ratio."""
    element = np.zeros(1, dtype=np.float32)
    ndims = (1, 2, 4, 8, 16, 32)
    cases = {}
    for ndim in ndims:
        shaped = element.reshape((1,) * ndim)
        contiguous, strided = Holder(shaped, strides=False), Holder(shaped)
        strided.__array_interface__["strides"] = (8,) * ndim
        for kind, holder in (("contiguous", contiguous), ("strided", strided)):
            cases[ndim, kind] = ("cai2dlpack(holder)", {"cai2dlpack": cai2dlpack, "holder": holder})
    fresh = records_not_kept(lambda: measure_together(list(cases.values()), repeat=repeat))
    medians = dict(zip(cases, (stats["median"] for stats in fresh)))
    kept_cases = [cases[ndim, "contiguous"] for ndim in ndims]
    kept = [stats["median"] for stats in measure_together(kept_cases, repeat=repeat)]
    return [(ndim, medians[ndim, "contiguous"], medians[ndim, "strided"], reused)
            for ndim, reused in zip(ndims, kept)]


def resident_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory(calls=1_000_000):
    """Resident growth over many conversions, and live allocations per capsule (tracemalloc)."""
    import tracemalloc

    holder = Holder(np.arange(16, dtype=np.float32).reshape(4, 4))
    for _ in range(10_000):
        cai2dlpack(holder)
    before = resident_bytes()
    for _ in range(calls):
        cai2dlpack(holder)
    growth_bytes = resident_bytes() - before
    tracemalloc.start()
    keep = [cai2dlpack(holder) for _ in range(1000)]
    blocks = tracemalloc.take_snapshot().statistics("filename")
    tracemalloc.stop()
    allocations = sum(stat.count for stat in blocks) / len(keep)
    return {"calls": calls, "rss_growth_bytes": growth_bytes, "allocations_per_capsule": allocations}


def run(short=False):
    try:
        import torch
    except ImportError:
        torch = None
    groups = cpu_groups(np, torch, extra=None if short else converter_extras())
    if not short:
        groups += exchange_group()
    results = run_groups(groups, repeat=7 if short else 21)
    if not short:
        group, measured = uncached_converter_group(groups)
        groups.insert(1, group)
        results[1:1] = measured
    references = {title: reference for title, reference, _ in groups}
    return {"results": results, "references": references,
            "growth": None if short else growth(), "memory": None if short else memory()}
