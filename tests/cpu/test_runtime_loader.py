"""How the CUDA runtime is found: each case in a fresh interpreter, since the first success is cached."""
import os
import subprocess
import sys
import textwrap

import numpy as np  # noqa: F401  (the child imports it too)
import pytest

from support.cuda_double import compiler
from support.fresh_process import run_with_double

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


def first_on_path(env, folder):
    """env with folder first on PYTHONPATH, ahead of what was there: the cai_dlpack a run put on the path (the
    mutation run's build, a sanitizer build) stays the one the child imports."""
    env["PYTHONPATH"] = os.pathsep.join([str(folder)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


# Put before a probe: the import of the 'nvidia' namespace package fails, as where no NVIDIA wheel is installed.
NO_WHEELS = "import sys; sys.modules['nvidia'] = None\n"


def run_probe(hide_wheels=None, preload=None, probe=PROBE, no_wheels=False, **env_changes):
    env = {k: v for k, v in os.environ.items() if k != "CAI_DLPACK_CUDART"}
    env.update(env_changes)
    if hide_wheels is not None:
        # A regular package named 'nvidia' first on the path hides the namespace package of NVIDIA's wheels.
        (hide_wheels / "nvidia").mkdir()
        (hide_wheels / "nvidia" / "__init__.py").write_text("")
        first_on_path(env, hide_wheels)
    probe = probe if preload is None else f"import ctypes; ctypes.CDLL({str(preload)!r})\n" + probe
    probe = NO_WHEELS + probe if no_wheels else probe
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


def occupy_sonames(directory):
    """A folder for LD_LIBRARY_PATH (searched before the loader's cache and default folders) in which every
    libcudart.so.N the search could ask for (N from 10 to 20) is a library that is no CUDA runtime (it lacks
    cudaGetErrorName): each soname tried is found here and refused, whatever runtime this machine has installed."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "not_a_runtime.c").write_text("int not_a_cuda_runtime;\n")
    subprocess.run([compiler(), "-shared", "-fPIC", str(directory / "not_a_runtime.c"), "-o",
                    str(directory / "libnot_a_runtime.so")], check=True)
    for major in range(10, 21):
        (directory / f"libcudart.so.{major}").symlink_to("libnot_a_runtime.so")
    return {"LD_LIBRARY_PATH": os.pathsep.join([str(directory)] + ([os.environ["LD_LIBRARY_PATH"]]
                                                                   if os.environ.get("LD_LIBRARY_PATH") else []))}


def searched_sonames():
    """The sonames the loader's search asks for, in order: the major of the headers the module was built with,
    then 13, then 12, each once."""
    import cai_dlpack._core

    return [f"libcudart.so.{major}" for major in dict.fromkeys([cai_dlpack._core.CUDART_HEADER_MAJOR, 13, 12])]


NOTHING_FOUND = ("ERROR RuntimeError no CUDA runtime found (tried {}); install a CUDA driver and runtime, e.g. "
                 "'pip install nvidia-cuda-runtime', or set CAI_DLPACK_CUDART to the path of libcudart.so")


@pytest.mark.parametrize("nvidia", ["not installed", "a module, not a package"])
def test_without_a_runtime_or_nvidia_wheels_the_error_lists_each_soname_once_newest_first(tmp_path, nvidia):
    """No runtime the loader can give and no NVIDIA wheel installed (the import of 'nvidia' fails, or finds a
    module of that name with no folders to look in): the error lists every soname tried, in the search's order,
    each once, and says how to point at a runtime."""
    if nvidia == "not installed":
        out = run_probe(no_wheels=True, **occupy_sonames(tmp_path / "lib"))
    else:
        (tmp_path / "nvidia.py").write_text("")
        out = run_probe(PYTHONPATH=first_on_path(dict(os.environ), tmp_path)["PYTHONPATH"],
                        **occupy_sonames(tmp_path / "lib"))
    assert out == NOTHING_FOUND.format(", ".join(f"{soname} (lacks cudaGetErrorName)" for soname in searched_sonames()))


def test_search_order_is_reported_when_nothing_is_found(tmp_path):
    """With no runtime anywhere the message lists what was tried, the loader's sonames and then the two places
    of libcudart inside NVIDIA's wheels, and how to point at one."""
    out = run_probe(hide_wheels=tmp_path, **occupy_sonames(tmp_path / "lib"))
    wheels = [str(tmp_path / "nvidia" / "cu13" / "lib" / "libcudart.so.13"),
              str(tmp_path / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12")]
    assert out == NOTHING_FOUND.format(", ".join(
        [f"{soname} (lacks cudaGetErrorName)" for soname in searched_sonames()]
        + [f"{path} ({path}: cannot open shared object file: No such file or directory)" for path in wheels]))


@pytest.mark.parametrize("inside", ["cu13/lib/libcudart.so.13", "cuda_runtime/lib/libcudart.so.12"])
def test_runtime_inside_nvidia_wheels_is_found(tmp_path, inside):
    """The copy of libcudart inside NVIDIA's pip wheels (nvidia/cu13/lib for CUDA 13, nvidia/cuda_runtime/lib for
    CUDA 12) is found without any setting when the loader has none."""
    assert_wheel_runtime_found(tmp_path, tmp_path / "site", inside)


def test_runtime_inside_nvidia_wheels_at_the_longest_path_the_loader_holds_is_found(tmp_path):
    """Wheels installed deep enough that the runtime's path is 1,023 characters long, the most the loader's path
    buffer holds with its terminator: the runtime is still found there."""
    inside = "cu13/lib/libcudart.so.13"
    out_dir = tmp_path / "site"
    left = 1023 - len(str(out_dir / "nvidia" / inside))
    while left > 256:  # folder names of 200 characters (each adds a separator), then one of what is left
        out_dir, left = out_dir / ("d" * 200), left - 201
    out_dir = out_dir / ("e" * (left - 1))
    assert len(str(out_dir / "nvidia" / inside)) == 1023
    assert_wheel_runtime_found(tmp_path, out_dir, inside)


def assert_wheel_runtime_found(tmp_path, out_dir, inside):
    """A copy of the double as the runtime of an NVIDIA wheel (out_dir/nvidia/inside, out_dir first on the path):
    found and used, with no setting and nothing else for the loader to find."""
    import shutil

    lib = out_dir / "nvidia" / inside
    lib.parent.mkdir(parents=True)
    shutil.copy(os.environ["CAI_DLPACK_CUDART"], lib)
    (out_dir / "nvidia" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "CAI_DLPACK_CUDART"}
    env.update(occupy_sonames(tmp_path / "lib"))
    first_on_path(env, out_dir)
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # The double knows no pointer: loading worked and the pointer query answered.
    out = result.stdout.strip()
    assert out.startswith("ERROR BufferError") and "not memory the CUDA runtime knows" in out, out
    assert out.endswith(f"PATH {lib}"), out
    result = subprocess.run([sys.executable, "-c", INFO_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == f"pip wheel {lib}", result.stdout + result.stderr


@pytest.mark.parametrize("driver,named", [("12080", "12.8"), ("12090", "12.9"), ("12000", "12.0")])
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
    from support.cuda_double import SOURCE

    directory.mkdir(parents=True, exist_ok=True)
    target = directory / soname
    subprocess.run([compiler(), "-shared", "-fPIC", "-O1", "-pthread", f"-Wl,-soname,{soname}", SOURCE, "-o",
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


# An 'nvidia' on the path whose import loads the runtime itself (as another caller's search that ends while ours
# still looks at NVIDIA's wheels) and then leaves the wheel search nothing to read, in one of three ways.
NVIDIA_LOADING_THE_RUNTIME = {
    "its import fails": ("nvidia.py", "raise ImportError('no wheels here')\n"),
    "a module, not a package": ("nvidia.py", ""),
    "a folder name UTF-8 cannot encode": ("nvidia/__init__.py", "__path__ = ['\\udcff']\n"),
}


@pytest.mark.parametrize("how", NVIDIA_LOADING_THE_RUNTIME)
def test_a_search_that_another_load_overtook_answers_with_that_runtime(tmp_path, how):
    """The search finds nothing of its own, but the runtime was loaded while it looked (here by the import of
    'nvidia' it makes): it answers with that runtime, and the failures it met on the way are not left pending
    (a pending error behind a success is a SystemError in the caller)."""
    name, tail = NVIDIA_LOADING_THE_RUNTIME[how]
    module = tmp_path / "site" / name
    module.parent.mkdir(parents=True)
    module.write_text(textwrap.dedent(f"""
        import os, cai_dlpack
        os.environ["CAI_DLPACK_CUDART"] = {os.environ['CAI_DLPACK_CUDART']!r}
        cai_dlpack.cuda_runtime_info()
        del os.environ["CAI_DLPACK_CUDART"]
    """) + tail)
    env = {k: v for k, v in os.environ.items() if k != "CAI_DLPACK_CUDART"}
    env.update(occupy_sonames(tmp_path / "lib"))
    first_on_path(env, tmp_path / "site")
    result = subprocess.run([sys.executable, "-c", INFO_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"CAI_DLPACK_CUDART {os.path.realpath(os.environ['CAI_DLPACK_CUDART'])}"


def test_a_runtime_that_cannot_count_its_devices_reports_none(cudart):
    """cuda_runtime_info on a machine with no driver or no GPU: cudaGetDeviceCount fails, which is an answer (no
    device), not an error; the failure is not left as the runtime's last error."""
    from cai_dlpack import cuda_runtime_info

    assert cuda_runtime_info()["device_count"] == 4  # the double's
    cudart.fail("cudaGetDeviceCount", 100)  # cudaErrorNoDevice
    info = cuda_runtime_info()
    assert info["device_count"] == 0 and info["version"] == 13000
    assert cudart.last_error == 0


# Whether the library at a path is still mapped in this process (dlopen with RTLD_NOLOAD loads nothing).
STILL_LOADED = textwrap.dedent("""
    import ctypes, os
    def still_loaded(path):
        try:
            ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        except OSError:
            return False
        return True
""")


@pytest.mark.parametrize("symbol", ["cudaStreamGetCaptureInfo", "cudaGetErrorName"])
def test_a_runtime_lacking_a_symbol_it_needs_is_refused_and_unloaded(tmp_path, symbol):
    """A library without a symbol every runtime has (cudaGetErrorName) is no CUDA runtime; a CUDA 13 runtime
    without cudaStreamGetCaptureInfo (which every stream ordering asks) cannot be used. Either is refused at load,
    naming what it lacks, and closed again: the process keeps no library it will not use."""
    from support.cuda_double import SOURCE

    path = tmp_path / f"libcudart_without_{symbol}.so"
    subprocess.run([compiler(), "-shared", "-fPIC", "-O1", "-pthread", f"-D{symbol}={symbol}_renamed", SOURCE, "-o",
                    str(path)], check=True)
    out = run_probe(probe=STILL_LOADED + PROBE + f"print('STILL LOADED', still_loaded({str(path)!r}))\n",
                    CAI_DLPACK_CUDART=str(path))
    assert out == (f"ERROR RuntimeError CAI_DLPACK_CUDART names a CUDA runtime that could not be loaded: {path} (lacks "
                   f"{symbol})\nSTILL LOADED False"), out


def test_a_runtime_found_after_another_load_won_is_closed_again(tmp_path):
    """The wheel search finds a runtime of its own after the import of 'nvidia' loaded another (as a search on
    another thread may finish first): the one loaded first is the one in use, and the one found later is closed."""
    import shutil

    site = tmp_path / "site"
    wheel_copy = site / "nvidia" / "cu13" / "lib" / "libcudart.so.13"
    wheel_copy.parent.mkdir(parents=True)
    shutil.copy(os.environ["CAI_DLPACK_CUDART"], wheel_copy)
    (site / "nvidia" / "__init__.py").write_text(textwrap.dedent(f"""
        import os, cai_dlpack
        os.environ["CAI_DLPACK_CUDART"] = {os.environ['CAI_DLPACK_CUDART']!r}
        cai_dlpack.cuda_runtime_info()
        del os.environ["CAI_DLPACK_CUDART"]
    """))
    env = {k: v for k, v in os.environ.items() if k != "CAI_DLPACK_CUDART"}
    env.update(occupy_sonames(tmp_path / "lib"))
    first_on_path(env, site)
    probe = STILL_LOADED + INFO_PROBE + f"print('STILL LOADED', still_loaded({str(wheel_copy)!r}))\n"
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"CAI_DLPACK_CUDART {os.path.realpath(os.environ['CAI_DLPACK_CUDART'])}", "STILL LOADED False"]


# A device copy on a stream of its own, freed at once: the names of the calls that made and freed it.
ALLOCATION_CALLS_OF_A_DEVICE_COPY = """
    from cai_dlpack import DLPackShim
    host = np.arange(8, dtype=np.float32)
    register(double, host, DEVICE)
    double.add_stream(0x6000, 0)
    capsule = DLPackShim(CaiArray(host, stream=0x6000)).__dlpack__(stream=0x6000, copy=True, max_version=(1, 0))
    del capsule
    print(*[line.split("(")[0] for line in double.log() if line.startswith(("cudaMalloc", "cudaFree"))])
"""


@pytest.mark.parametrize("lacks", [None, "cudaFreeAsync"])
@pytest.mark.usefixtures("trusted_streams")
def test_device_copies_are_stream_ordered_only_with_a_runtime_that_has_both_async_calls(tmp_path, monkeypatch,
                                                                                        lacks):
    """A runtime with cudaMallocAsync and cudaFreeAsync (CUDA 11.2 on) has a device copy allocated on the
    consumer's stream and freed there; one lacking either uses neither: the copy is made by cudaMalloc and freed by
    cudaFree, never taken from a stream's pool that nothing could give it back to."""
    if lacks is not None:
        from support.cuda_double import SOURCE

        path = tmp_path / "libcudart_without_free_async.so"
        subprocess.run([compiler(), "-shared", "-fPIC", "-O1", "-pthread", f"-D{lacks}={lacks}_renamed", SOURCE,
                        "-o", str(path)], check=True)
        monkeypatch.setenv("CAI_DLPACK_CUDART", str(path))
    calls = run_with_double(ALLOCATION_CALLS_OF_A_DEVICE_COPY)
    assert calls == (["cudaMallocAsync", "cudaFreeAsync"] if lacks is None else ["cudaMalloc", "cudaFree"]), calls


def test_loading_the_runtime_leaves_another_librarys_pending_error_alone():
    """Another library loaded the runtime first and left an error pending in it: loading it ourselves (the entry
    points asked, the devices counted) clears nothing, and the error is still there for that library."""
    out = run_with_double("""
        assert double.lib.cudaSetDevice(99) != 0  # another library's failure, left pending
        pending = double.last_error
        import cai_dlpack
        assert cai_dlpack.cuda_runtime_info()["path"] is not None
        print(pending != 0, double.last_error == pending)
    """)
    assert out == ["True", "True"]
