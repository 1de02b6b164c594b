"""How the CUDA runtime is found: each case in a fresh interpreter, since the first success is cached."""
import os
import subprocess
import sys
import textwrap

import numpy as np  # noqa: F401  (the child imports it too)
import pytest

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


# What cuda_runtime_info says of the runtime it loaded: how it was found, and the file the loader mapped.
INFO_PROBE = textwrap.dedent("""
    import cai_dlpack
    info = cai_dlpack.cuda_runtime_info()
    print(info["source"], info["file"])
""")


def run_probe(hide_wheels=None, preload=None, probe=PROBE, **env_changes):
    env = {k: v for k, v in os.environ.items() if k != "CAI_DLPACK_CUDART"}
    env.update(env_changes)
    if hide_wheels is not None:
        # A regular package named 'nvidia' first on the path hides the namespace package of NVIDIA's wheels.
        (hide_wheels / "nvidia").mkdir()
        (hide_wheels / "nvidia" / "__init__.py").write_text("")
        env["PYTHONPATH"] = str(hide_wheels)
    probe = probe if preload is None else f"import ctypes; ctypes.CDLL({str(preload)!r})\n" + probe
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_named_runtime_that_does_not_exist():
    out = run_probe(CAI_DLPACK_CUDART="/nowhere/libcudart.so.99")
    assert out.startswith("ERROR RuntimeError CAI_DLPACK_CUDART names a CUDA runtime that could not be loaded")
    assert "/nowhere/libcudart.so.99" in out


VIEW_PROBE = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import cai_dlpack
    from support.dlpack_ctypes import MadeTensor
    made = MadeTensor(data=4096, device=(2, 0), shape=(3,))  # a CUDA tensor: taking it needs no runtime
    view = cai_dlpack.dlpack2cai(made.capsule)  # its stream: the legacy default stream
    try:
        view.__cuda_array_interface__  # exporting the stream asks the runtime whether it captures
    except Exception as error:
        print("ERROR", type(error).__name__, error)
    else:
        print("EXPORTED")
    del view  # before made, whose ctypes deleter the view calls (at exit the collector may free either first)
""").format(tests=os.path.join(os.path.dirname(__file__), os.pardir))


def test_a_view_exporting_its_stream_raises_when_the_runtime_cannot_load():
    out = run_probe(CAI_DLPACK_CUDART="/nowhere/libcudart.so.99", probe=VIEW_PROBE)
    assert out.startswith("ERROR RuntimeError CAI_DLPACK_CUDART names a CUDA runtime that could not be loaded"), out


def test_named_library_that_is_not_a_runtime():
    import ctypes.util

    libm = ctypes.util.find_library("m")
    out = run_probe(CAI_DLPACK_CUDART=f"/lib/x86_64-linux-gnu/{libm}" if libm else "libm.so.6")
    assert "lacks cudaGetErrorName" in out


def test_named_runtime_is_used():
    out = run_probe(CAI_DLPACK_CUDART=os.environ["CAI_DLPACK_CUDART"])
    # The double knows no pointer: loading worked and the pointer query answered.
    assert out.startswith("ERROR BufferError") and "not memory the CUDA runtime knows" in out
    assert run_probe(probe=INFO_PROBE, CAI_DLPACK_CUDART=os.environ["CAI_DLPACK_CUDART"]) == \
        f"CAI_DLPACK_CUDART {os.environ['CAI_DLPACK_CUDART']}"


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
    result = subprocess.run([sys.executable, "-c", INFO_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == f"pip wheel {lib / 'libcudart.so.13'}", result.stdout + result.stderr


@pytest.mark.parametrize("driver,named", [("12080", "12.8"), ("12090", "12.9")])
def test_runtime_needing_a_newer_driver_is_refused(driver, named):
    """A runtime newer than the driver would fail every call (cudaErrorInsufficientDriver): refused at load."""
    out = run_probe(CAI_DLPACK_CUDART=os.environ["CAI_DLPACK_CUDART"], CUDART_DOUBLE_DRIVER_VERSION=driver)
    assert out.startswith("ERROR RuntimeError CAI_DLPACK_CUDART names a CUDA runtime that could not be loaded")
    assert f"(runtime 13.0 needs a newer driver than this CUDA {named} one)" in out


def test_runtime_without_a_driver_still_loads():
    """No driver at all (version 0) is said by the runtime's own errors at first use, not by the loader."""
    out = run_probe(CAI_DLPACK_CUDART=os.environ["CAI_DLPACK_CUDART"], CUDART_DOUBLE_DRIVER_VERSION="0")
    assert out.startswith("ERROR BufferError") and "not memory the CUDA runtime knows" in out


def build_with_soname(directory, soname):
    import shutil
    import sysconfig

    from support.cuda_double import SOURCE

    directory.mkdir(parents=True, exist_ok=True)
    target = directory / soname
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    compiler = compiler if shutil.which(compiler) else "cc"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-pthread", f"-Wl,-soname,{soname}", SOURCE, "-o",
                    str(target)], check=True)
    return target


def test_runtime_the_process_already_loaded_is_preferred(tmp_path):
    """A libcudart.so.12 already in the process (a framework's) wins over a libcudart.so.13 on the search
    path: one runtime instance, one last-error state, one current device."""
    loaded = build_with_soname(tmp_path / "framework", "libcudart.so.12")
    build_with_soname(tmp_path / "on_path", "libcudart.so.13")
    out = run_probe(preload=loaded, LD_LIBRARY_PATH=str(tmp_path / "on_path"))
    assert out.startswith("ERROR BufferError"), out
    assert out.endswith("PATH libcudart.so.12"), out
    # cuda_runtime_info names the copy the loader chose behind the soname, and how it was found.
    info = run_probe(preload=loaded, probe=INFO_PROBE, LD_LIBRARY_PATH=str(tmp_path / "on_path"))
    assert info == f"preloaded {loaded}", info
    # Without it in the process, the search takes the newest on the path.
    out = run_probe(LD_LIBRARY_PATH=str(tmp_path / "on_path"))
    assert out.endswith("PATH libcudart.so.13"), out
    info = run_probe(probe=INFO_PROBE, LD_LIBRARY_PATH=str(tmp_path / "on_path"))
    assert info == f"loader {tmp_path / 'on_path' / 'libcudart.so.13'}", info


def test_loaded_runtime_refused_is_listed_once(tmp_path):
    """A libcudart.so.13 already in the process but newer than the driver is refused, and the search that
    follows does not try (and list) the same library again."""
    loaded = build_with_soname(tmp_path / "framework", "libcudart.so.13")
    out = run_probe(preload=loaded, CUDART_DOUBLE_DRIVER_VERSION="12080", hide_wheels=tmp_path,
                    LD_LIBRARY_PATH=str(tmp_path / "nothing"))
    assert out.startswith("ERROR RuntimeError no CUDA runtime found"), out
    assert out.count("libcudart.so.13 (runtime 13.0 needs a newer driver than this CUDA 12.8 one)") == 1, out
