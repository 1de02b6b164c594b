"""The caller's CUDA context around a conversion that orders streams on another device: saved and put back
exactly (no primary context made on a device the caller never used), the event on the producer stream's
device for pinned and managed memory, and the older runtimes that cannot say either."""
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cai_dlpack import CudaError, cai2dlpack, cuda_runtime_info
from support import cuda_double
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE, MANAGED, PINNED_HOST

S1, S2 = 0x5000, 0x6000


@pytest.fixture(autouse=True)
def runtime_loaded(cudart):
    """The runtime loaded (and its entry points asked for) before the case, so logs show the conversion only."""
    cuda_runtime_info()
    cudart.clear_log()


def stream_calls(log):
    """What the conversion did to the device, contexts and streams (not pointer queries, event ids or the
    runtime's load)."""
    return [re.sub(r"ev\d+", "ev", line) for line in log
            if not line.startswith(("cudaPointerGetAttributes", "cudaGetDriverEntryPoint", "cudaEventCreateWithFlags",
                                    "cuCtxGetId"))]


def test_a_thread_without_context_is_left_without_one(cudart):
    """Data on device 2, a thread that never used CUDA: device 2 is made current for the record and the thread
    is then left with no context, and no primary context is made on device 0 (cudaSetDevice(0) would)."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=2)
    cudart.drop_context(0)
    assert cai2dlpack(CaiArray(host, stream=S1), stream=S2) is not None
    assert stream_calls(cudart.log()) == [
        "cudaGetDevice() -> 0", "cuCtxGetCurrent() -> NULL", "cudaSetDevice(2)", "cuCtxGetCurrent() -> ctx2",
        f"cudaEventRecord(ev, {S1})",
        f"cudaStreamWaitEvent({S2}, ev, 0)", "cuCtxSetCurrent(NULL)"]
    assert cudart.context_device == -1
    assert cudart.primary_contexts == {2}


def test_no_context_and_data_on_device_zero(cudart):
    """cudaGetDevice answers 0 without a context, but 0 is not current: the switch still happens, so the thread
    is left as it was (no context) rather than with device 0's bound by our calls."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=0)
    cudart.drop_context(0)
    cai2dlpack(CaiArray(host, stream=S1), stream=S2)
    calls = stream_calls(cudart.log())
    assert calls[:3] == ["cudaGetDevice() -> 0", "cuCtxGetCurrent() -> NULL", "cudaSetDevice(0)"]
    assert calls[-1] == "cuCtxSetCurrent(NULL)"
    assert cudart.context_device == -1


def test_driver_not_initialized_means_no_context(cudart):
    """cuCtxGetCurrent before the driver is initialized answers CUDA_ERROR_NOT_INITIALIZED: no context, so the
    conversion goes on and leaves the thread without one."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=2)
    cudart.drop_context(0)
    cudart.fail("cuCtxGetCurrent", 3)  # the first call only: the one that saves the caller's context
    assert cai2dlpack(CaiArray(host, stream=S1), stream=S2) is not None
    assert stream_calls(cudart.log())[-1] == "cuCtxSetCurrent(NULL)"
    assert cudart.context_device == -1


def test_current_context_on_the_data_device_is_not_touched(cudart):
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=3)
    cudart.current_device = 3
    cai2dlpack(CaiArray(host, stream=S1), stream=S2)
    calls = stream_calls(cudart.log())
    assert calls[:2] == ["cudaGetDevice() -> 3", "cuCtxGetCurrent() -> ctx3"]
    assert not any(call.startswith(("cudaSetDevice", "cuCtxSetCurrent")) for call in calls)
    assert cudart.context_device == 3


def test_failed_restore_raises_and_frees_the_capsule(cudart):
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=2)
    obj = CaiArray(host, stream=S1)
    cai2dlpack(obj, stream=S2)  # the pooled event exists
    references = sys.getrefcount(obj)
    cudart.current_device = 1
    cudart.fail("cuCtxSetCurrent", 201)
    with pytest.raises(CudaError, match=r"cuCtxSetCurrent failed: CUDA_ERROR_INVALID_CONTEXT \(invalid device "
                                        r"context\)") as raised:
        cai2dlpack(obj, stream=S2)
    assert (raised.value.call, raised.value.code) == ("cuCtxSetCurrent", 201)
    assert sys.getrefcount(obj) == references
    assert cudart.last_error == 0  # a driver error is not the runtime's to clear, and nothing else was left


@pytest.mark.parametrize("kind", [PINNED_HOST, MANAGED])
def test_pinned_and_managed_events_go_on_the_stream_device(cudart, kind):
    """Pinned or managed memory allocated under device 1, produced on a stream of device 3: the event is made
    and recorded on device 3 (recording it on device 1 would fail: event and stream on different devices)."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, kind, device=1)
    cudart.add_stream(S1, 3)
    cai2dlpack(CaiArray(host, stream=S1), stream=S2)
    calls = stream_calls(cudart.log())
    assert calls[0] == f"cudaStreamGetDevice({S1}) -> 3"
    assert calls[1:5] == ["cudaGetDevice() -> 0", "cuCtxGetCurrent() -> ctx0", "cudaSetDevice(3)",
                          "cuCtxGetCurrent() -> ctx3"]
    assert calls[5:] == [f"cudaEventRecord(ev, {S1})", f"cudaStreamWaitEvent({S2}, ev, 0)", "cuCtxSetCurrent(ctx0)"]
    assert cudart.context_device == 0


@pytest.mark.parametrize("kind", [PINNED_HOST, MANAGED])
def test_pinned_and_managed_with_the_legacy_stream_keep_the_allocation_device(cudart, kind):
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, kind, device=1)
    cai2dlpack(CaiArray(host, stream=1), stream=S2)
    calls = stream_calls(cudart.log())
    assert not any(call.startswith("cudaStreamGetDevice") for call in calls)
    assert "cudaSetDevice(1)" in calls and calls[-1] == "cuCtxSetCurrent(ctx0)"


def test_stream_device_query_failure(cudart):
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, MANAGED, device=1)  # S1 is not a stream the double knows: the query fails
    with pytest.raises(CudaError, match="cudaStreamGetDevice failed: cudaErrorInvalidResourceHandle"):
        cai2dlpack(CaiArray(host, stream=S1), stream=S2)
    assert cudart.last_error == 0 and cudart.context_device == 0
    assert not any(call.startswith(("cudaSetDevice", "cudaEventRecord")) for call in cudart.log())


def test_device_memory_never_asks_the_stream(cudart):
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=1)
    cai2dlpack(CaiArray(host, stream=S1), stream=S2)
    assert not any(call.startswith("cudaStreamGetDevice") for call in cudart.log())


OLDER_RUNTIME = textwrap.dedent("""
    import numpy as np, cai_dlpack, sys
    sys.path.insert(0, {tests!r})
    from support.cuda_double import CudaDouble, DEVICE, MANAGED
    from support.cai_objects import CaiArray, register
    double = CudaDouble({path!r})
    double.reset()
    host = np.zeros(4, dtype=np.float32)
    register(double, host, {kind}, device=1)
    double.add_stream(0x5000, 3)
    double.current_device = 2
    cai_dlpack.cai2dlpack(CaiArray(host, stream=0x5000), stream=0x6000)
    for line in double.log():
        if not line.startswith(("cudaPointerGetAttributes", "cudaEventCreateWithFlags")):
            print(line)
    print("current", double.current_device, double.context_device)
""")


def run_older_runtime(path, kind="DEVICE", **env_changes):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, CAI_DLPACK_CUDART=path, **env_changes)
    script = OLDER_RUNTIME.format(tests=tests, path=path, kind=kind)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [re.sub(r" -> ev\d+|ev\d+", "ev", line) for line in result.stdout.splitlines()]


def test_without_driver_entry_points_the_device_is_put_back_by_number():
    """A runtime whose driver cannot hand out cuCtxGetCurrent/cuCtxSetCurrent: cudaSetDevice(previous)."""
    lines = run_older_runtime(os.environ["CAI_DLPACK_CUDART"], CUDART_DOUBLE_ENTRY_POINTS="0")
    lines = [line for line in lines if not line.startswith("cudaGetDriverEntryPoint")]
    assert lines == ["cudaGetLastError() -> 801", "cudaGetDevice() -> 2", "cudaSetDevice(1)",
                     "cudaEventRecord(ev, 20480)", "cudaStreamWaitEvent(24576, ev, 0)", "cudaSetDevice(2)", "current 2 2"]


def test_runtime_12_0_uses_the_unversioned_entry_point_and_the_allocation_device(tmp_path):
    """CUDA 12.0-12.4 has cudaGetDriverEntryPoint only, and no cudaStreamGetDevice before 12.8: managed memory
    orders on its allocation device, and the context comes back through the driver all the same."""
    path = cuda_double.build(str(tmp_path), cuda_12_0=True)
    lines = run_older_runtime(path, kind="MANAGED")
    assert "cudaGetDriverEntryPoint(cuCtxGetCurrent)" in lines
    lines = [line for line in lines if not line.startswith(("cudaGetDriverEntryPoint", "cudaGetLastError"))]
    assert lines == ["cudaGetDevice() -> 2", "cuCtxGetCurrent() -> ctx2", "cudaSetDevice(1)",
                     "cuCtxGetCurrent() -> ctx1", "cuCtxGetId(ctx1) -> 0",
                     "cudaEventRecord(ev, 20480)", "cudaStreamWaitEvent(24576, ev, 0)", "cuCtxSetCurrent(ctx2)",
                     "current 2 2"]


def test_a_device_reset_gets_a_new_event(cudart):
    """cudaDeviceReset destroys the context and the pooled event with it: the next conversion sees another context
    id and makes a new event instead of recording a dead handle."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=2)
    obj = CaiArray(host, stream=S1)
    cai2dlpack(obj, stream=S2)
    before = cudart.events_created
    cai2dlpack(obj, stream=S2)
    assert cudart.events_created == before  # steady state: the pooled event
    cudart.reset_device(2)
    cudart.clear_log()
    cai2dlpack(obj, stream=S2)
    assert cudart.events_created == before + 1
    assert not any("error" in line for line in cudart.log())
    cai2dlpack(obj, stream=S2)
    assert cudart.events_created == before + 1


@pytest.mark.parametrize("failing", ["cuCtxGetId", "cuCtxGetCurrent"])
def test_context_id_failure(cudart, failing):
    """A failing context query after the switch raises, names the driver's error and puts the context back."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=2)
    cudart.current_device = 1
    if failing == "cuCtxGetCurrent":
        # Its first call saves the caller's context and succeeds (code 0); the second, after the switch, fails.
        cudart.fail(failing, 0)
    cudart.fail(failing, 201)
    with pytest.raises(CudaError, match=f"{failing} failed: CUDA_ERROR_INVALID_CONTEXT"):
        cai2dlpack(CaiArray(host, stream=S1), stream=S2)
    assert cudart.context_device == 1 and cudart.last_error == 0


def test_the_gpu_suites_reset_script_against_the_double():
    """The GPU suite's device-reset child, run here against the double: the script itself is sound."""
    script = os.path.join(os.path.dirname(__file__), os.pardir, "support", "device_reset_child.py")
    child = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "converted after a reset"
