"""How the CUDA runtime is found: each case in a fresh interpreter, since the first success is cached."""
import os
import subprocess
import sys
import textwrap

import numpy as np  # noqa: F401  (the child imports it too)

PROBE = textwrap.dedent("""
    import numpy as np, cai_dlpack
    from cai_dlpack import DLPackShim
    # Host paths never need the runtime.
    assert np.from_dlpack(DLPackShim(np.arange(3))).tolist() == [0, 1, 2]
    class Cai:
        __cuda_array_interface__ = {"shape": (1,), "typestr": "<f4", "data": (4096, False), "version": 3}
    try:
        cai_dlpack.cai2dlpack(Cai())
    except Exception as error:
        print("ERROR", type(error).__name__, error)
        if not isinstance(error, RuntimeError) or isinstance(error, cai_dlpack.CudaError):
            print("PATH", cai_dlpack.cuda_runtime_info()["path"])
    else:
        print("LOADED", cai_dlpack.cuda_runtime_info()["path"])
""")


def run_probe(hide_wheels=None, **env_changes):
    env = {k: v for k, v in os.environ.items() if k != "CAI_DLPACK_CUDART"}
    env.update(env_changes)
    if hide_wheels is not None:
        # A regular package named 'nvidia' first on the path hides the namespace package of NVIDIA's wheels.
        (hide_wheels / "nvidia").mkdir()
        (hide_wheels / "nvidia" / "__init__.py").write_text("")
        env["PYTHONPATH"] = str(hide_wheels)
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_named_runtime_that_does_not_exist():
    out = run_probe(CAI_DLPACK_CUDART="/nowhere/libcudart.so.99")
    assert out.startswith("ERROR RuntimeError CAI_DLPACK_CUDART names a CUDA runtime that could not be loaded")
    assert "/nowhere/libcudart.so.99" in out


def test_named_library_that_is_not_a_runtime():
    import ctypes.util

    libm = ctypes.util.find_library("m")
    out = run_probe(CAI_DLPACK_CUDART=f"/lib/x86_64-linux-gnu/{libm}" if libm else "libm.so.6")
    assert "lacks cudaGetErrorName" in out


def test_named_runtime_is_used():
    out = run_probe(CAI_DLPACK_CUDART=os.environ["CAI_DLPACK_CUDART"])
    # The double knows no pointer: loading worked and the pointer query answered.
    assert out.startswith("ERROR BufferError") and "not memory the CUDA runtime knows" in out


def test_search_order_is_reported_when_nothing_is_found(tmp_path):
    """With no runtime anywhere the message lists what was tried and how to point at one."""
    out = run_probe(hide_wheels=tmp_path, LD_LIBRARY_PATH="/nonexistent")
    if not out.startswith("ERROR RuntimeError"):
        # This machine has a runtime on the loader's default path; the search found it (then any error
        # comes from the runtime itself, e.g. no driver).
        assert out.startswith(("LOADED", "ERROR CudaError")), out
        return
    assert out.startswith("ERROR RuntimeError no CUDA runtime found (tried libcudart.so.")
    assert "CAI_DLPACK_CUDART" in out and "nvidia-cuda-runtime" in out


def test_runtime_inside_nvidia_wheels_is_found(tmp_path):
    """The copy of libcudart inside NVIDIA's pip wheels (nvidia/cu13/lib) is found without any setting."""
    import shutil

    out_dir = tmp_path / "site"
    out_dir.mkdir()
    lib = out_dir / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    shutil.copy(os.environ["CAI_DLPACK_CUDART"], lib / "libcudart.so.13")
    (out_dir / "nvidia" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "CAI_DLPACK_CUDART"}
    env["PYTHONPATH"] = str(out_dir)
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout.strip()
    if not out.endswith(str(lib / "libcudart.so.13")):
        # A runtime on the loader's default path comes first in the search order.
        assert "PATH" in out and "libcudart.so.1" in out, out
        return
    assert out.startswith("ERROR BufferError") and "not memory the CUDA runtime knows" in out
