"""Threads and interpreter shutdown: concurrent conversions, deleters on foreign threads, capsules and
views alive at exit, and a deleter that runs while the interpreter finalizes."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from cai_dlpack import DLPackShim, cai2dlpack, dlpack2cai
from support.threads import run_threads
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE
from support.optional import TORCH_MISSING

torch = pytest.importorskip("torch", reason=TORCH_MISSING)


def test_eight_threads_convert_the_same_object(cudart):
    host = np.arange(256, dtype=np.float32)
    register(cudart, host, DEVICE, device=1)
    device_object = CaiArray(host, stream=0x5000)
    host_array = np.arange(64.0)
    base = sys.getrefcount(device_object), sys.getrefcount(host_array)
    events_before = cudart.events_created

    def work(_):
        for _ in range(1500):
            cai2dlpack(device_object, stream=0x6000, max_version=(1, 0))
            t = torch.from_dlpack(DLPackShim(host_array))
            assert t.data_ptr() == host_array.ctypes.data
            assert np.asarray(dlpack2cai(t))[5] == 5.0

    assert run_threads(work, 8) == []
    assert (sys.getrefcount(device_object), sys.getrefcount(host_array)) == base
    assert cudart.current_device == 0
    assert cudart.events_created - events_before <= 1  # one pooled event for device 1, whatever the threads did


def run_script(body, timeout=60):
    script = textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    return result


def test_capsules_and_views_alive_at_exit():
    result = run_script("""
        import numpy as np, torch
        from cai_dlpack import cai2dlpack, dlpack2cai, DLPackShim
        keep_capsule = cai2dlpack(np.arange(10), max_version=(1, 0))
        keep_view = dlpack2cai(torch.arange(5))
        keep_array = np.asarray(dlpack2cai(np.arange(7)))
        class Cycle: pass
        c = Cycle(); c.self = c; c.capsule = cai2dlpack(np.arange(3)); c.shim = DLPackShim(c)
        keep_tensor = torch.from_dlpack(DLPackShim(np.arange(4.0)))
        print("done")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "done"


def test_deleter_during_finalization_does_not_crash_or_hang():
    result = run_script("""
        import ctypes, time, os, sys
        import numpy as np
        sys.path[:0] = [p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p]
        from support.cuda_double import CudaDouble
        from support.dlpack_ctypes import DLManagedTensorVersioned, _api
        from cai_dlpack import cai2dlpack
        double = CudaDouble(os.environ["CAI_DLPACK_CUDART"])
        owner = np.arange(100.0)
        capsule = cai2dlpack(owner, max_version=(1, 0))
        address = _api.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
        _api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
        _api.PyCapsule_SetName(capsule, b"used_dltensor_versioned")
        deleter = ctypes.cast(DLManagedTensorVersioned.from_address(address).deleter, ctypes.c_void_p).value
        double.lib.double_call_later.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        class SlowToDie:
            def __del__(self):
                time.sleep(0.3)   # finalization is under way while the deleter runs on its thread
        sys.slow = SlowToDie()
        assert double.lib.double_call_later(deleter, address, 100000) == 0
        print("exiting")
    """, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "exiting" in result.stdout
