"""The caller's CUDA context around a conversion that orders streams on another device: the other context
pushed and popped, so the caller's comes back exactly and the runtime's device setting is never touched (no
primary context made on a device the caller never used); the event in the producer stream's own context for
pinned and managed memory; pooled events across device resets; and the runtimes without the driver's calls."""
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from cai_dlpack import CudaError, DLPackShim, cai2dlpack, cuda_runtime_info, dlpack2cai
from support import c_example, cuda_double
from support.cai_objects import CaiArray, register
from support.cuda_double import DEVICE, MANAGED, PINNED_HOST

S1, S2 = 0x5000, 0x6000


@pytest.fixture(autouse=True)
def runtime_loaded(cudart):
    """The runtime loaded (and its entry points asked for) before the case, so logs show the conversion only."""
    cuda_runtime_info()
    cudart.clear_log()


def stream_calls(log):
    """What the conversion did to the device, contexts and streams (not pointer queries, capture queries, event
    ids or the runtime's load)."""
    return [re.sub(r"ev\d+", "ev", line) for line in log
            if not line.startswith(("cudaPointerGetAttributes", "cudaGetDriverEntryPoint", "cudaEventCreateWithFlags",
                                    "cuCtxGetId", "cudaStreamGetCaptureInfo"))]


def test_a_thread_without_context_is_left_without_one(cudart):
    """Data on device 2, a thread that never used CUDA: device 2's primary context is retained and pushed for the
    record, then popped; no context is left current, none is made on device 0, and cudaGetDevice still answers
    0 (cudaSetDevice(2) would have changed it, and cudaSetDevice(0) made a context there)."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=2)
    cudart.drop_context(0)
    assert cai2dlpack(CaiArray(host, stream=1), stream=S2) is not None
    assert stream_calls(cudart.log()) == [
        "cudaGetDevice() -> 0", "cuCtxGetCurrent() -> NULL", "cuDevicePrimaryCtxGetState(2) -> 0",
        "cuDevicePrimaryCtxRetain(2)", "cuCtxPushCurrent(ctx2)", "cudaEventRecord(ev, 1)",
        f"cudaStreamWaitEvent({S2}, ev, 0)", "cuCtxPopCurrent() -> NULL current"]
    assert cudart.context_device == -1 and cudart.lib.double_context_depth() == 0
    assert cudart.current_device == 0  # the runtime's device setting
    assert cudart.primary_contexts == {2}  # made by the retain, and kept: releasing it would destroy it


def test_a_held_primary_context_is_released_again(cudart):
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=2)
    cudart.add_stream(0x7777, 2)  # device 2's primary context is in use (the runtime holds it)
    cai2dlpack(CaiArray(host, stream=1), stream=S2)
    calls = stream_calls(cudart.log())
    assert calls[2:5] == ["cuDevicePrimaryCtxGetState(2) -> 1", "cuDevicePrimaryCtxRetain(2)", "cuCtxPushCurrent(ctx2)"]
    assert calls[-2:] == ["cuCtxPopCurrent() -> ctx0 current", "cuDevicePrimaryCtxRelease(2)"]


def test_no_context_and_data_on_device_zero(cudart):
    """cudaGetDevice answers 0 without a context, but no context is current: device 0's is pushed and popped,
    so the thread is left as it was rather than with device 0's bound by our calls."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=0)
    cudart.drop_context(0)
    cai2dlpack(CaiArray(host, stream=1), stream=S2)
    calls = stream_calls(cudart.log())
    assert calls[:2] == ["cudaGetDevice() -> 0", "cuCtxGetCurrent() -> NULL"]
    assert "cuCtxPushCurrent(ctx0)" in calls and calls[-1] == "cuCtxPopCurrent() -> NULL current"
    assert cudart.context_device == -1


def test_driver_not_initialized_means_no_context(cudart):
    """cuCtxGetCurrent before the driver is initialized answers CUDA_ERROR_NOT_INITIALIZED: no context, so the
    conversion goes on and leaves the thread without one."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=2)
    cudart.drop_context(0)
    cudart.fail("cuCtxGetCurrent", 3)
    assert cai2dlpack(CaiArray(host, stream=1), stream=S2) is not None
    assert stream_calls(cudart.log())[-1] == "cuCtxPopCurrent() -> NULL current"
    assert cudart.context_device == -1


def test_current_context_on_the_data_device_is_not_touched(cudart):
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=3)
    cudart.current_device = 3
    cai2dlpack(CaiArray(host, stream=1), stream=S2)
    calls = stream_calls(cudart.log())
    assert calls == ["cudaGetDevice() -> 3", "cuCtxGetCurrent() -> ctx3", "cudaEventRecord(ev, 1)",
                     f"cudaStreamWaitEvent({S2}, ev, 0)"]
    assert cudart.context_device == 3


def test_failed_pop_raises_and_frees_the_capsule(cudart):
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=2)
    obj = CaiArray(host, stream=1)
    cai2dlpack(obj, stream=S2)  # the pooled event exists
    references = sys.getrefcount(obj)
    cudart.current_device = 1
    cudart.fail("cuCtxPopCurrent", 201)
    with pytest.raises(CudaError, match=r"cuCtxPopCurrent failed: CUDA_ERROR_INVALID_CONTEXT \(invalid device "
                                        r"context\)") as raised:
        cai2dlpack(obj, stream=S2)
    assert (raised.value.call, raised.value.code) == ("cuCtxPopCurrent", 201)
    assert sys.getrefcount(obj) == references
    assert cudart.last_error == 0  # a driver error is not the runtime's to clear, and nothing else was left
    log = cudart.log()
    assert log.count("cuDevicePrimaryCtxRelease(2)") == log.count("cuDevicePrimaryCtxRetain(2)") - 1  # the first kept


@pytest.mark.parametrize("kind", [PINNED_HOST, MANAGED])
def test_pinned_and_managed_events_go_in_the_stream_context(cudart, kind):
    """Pinned or managed memory allocated under device 1, produced on a stream of device 3: the event is made and
    recorded in that stream's context (in device 1's, the record would fail: event and stream in different
    contexts). A stream consumer waits there too; the legacy stream's consumer waits in the caller's context."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, kind, device=1)
    cudart.add_stream(S1, 3)
    cai2dlpack(CaiArray(host, stream=S1), stream=S2)
    assert stream_calls(cudart.log()) == [
        f"cuStreamGetCtx({S1}) -> 3", "cudaGetDevice() -> 0", "cuCtxGetCurrent() -> ctx0", "cuCtxPushCurrent(ctx3)",
        f"cudaEventRecord(ev, {S1})", f"cudaStreamWaitEvent({S2}, ev, 0)", "cuCtxPopCurrent() -> ctx0 current"]
    cudart.clear_log()
    cai2dlpack(CaiArray(host, stream=S1))  # consumer None: the legacy default stream of the caller's device
    calls = stream_calls(cudart.log())
    if calls[-1] == "cudaGetDevice() -> 0":
        calls.pop()  # the caller's device, kept for ordering the tensor's release after the consumer's stream
    assert calls[-3:] == [
        f"cudaEventRecord(ev, {S1})", "cuCtxPopCurrent() -> ctx0 current", "cudaStreamWaitEvent(1, ev, 0)"]
    assert cudart.context_device == 0 and not any("cudaSetDevice" in call for call in cudart.log())


@pytest.mark.parametrize("kind", [PINNED_HOST, MANAGED])
def test_pinned_and_managed_with_the_legacy_stream_use_the_allocation_device(cudart, kind):
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, kind, device=1)
    cai2dlpack(CaiArray(host, stream=1), stream=S2)
    calls = stream_calls(cudart.log())
    assert not any(call.startswith("cuStreamGetCtx") for call in calls)
    assert "cuCtxPushCurrent(ctx1)" in calls and calls[-1] in ("cuCtxPopCurrent() -> ctx0 current",
                                                               "cuDevicePrimaryCtxRelease(1)")


def test_stream_context_query_failure(cudart):
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, MANAGED, device=1)
    cudart.fail("cuStreamGetCtx", 400)  # a handle the driver does not know
    with pytest.raises(CudaError, match="cuStreamGetCtx failed: CUDA_ERROR_INVALID_HANDLE"):
        cai2dlpack(CaiArray(host, stream=S1), stream=S2)
    assert cudart.last_error == 0 and cudart.context_device == 0
    assert not any(call.startswith(("cuCtxPush", "cudaEventRecord")) for call in cudart.log())


def test_device_memory_with_a_stream_handle_records_in_its_context(cudart):
    """Device memory of device 1 produced on a stream of device 3 (peer access): the event goes in the stream's
    context, the only one cudaEventRecord accepts for that stream."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=1)
    cudart.add_stream(S1, 3)
    cai2dlpack(CaiArray(host, stream=S1), stream=S2)
    calls = stream_calls(cudart.log())
    assert calls[0] == f"cuStreamGetCtx({S1}) -> 3" and "cuCtxPushCurrent(ctx3)" in calls
    assert not any("error" in call for call in cudart.log())


@pytest.mark.parametrize("copy", [None, True])
@pytest.mark.parametrize("consumer", [None, 1, 2])
def test_device_memory_default_consumer_stream_is_the_datas_devices(cudart, consumer, copy):
    """Device memory of device 0 produced on a stream of device 1 (CuPy's current stream while device 1 was
    current): the consumer's legacy or per-thread stream is the data's device's (the array API's), so the event is
    recorded in the producer stream's context and waited on in device 0's, where a copy then runs after it."""
    host = np.arange(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=0)
    cudart.add_stream(S1, 1)
    cudart.log_context()
    cudart.clear_log()
    capsule = DLPackShim(CaiArray(host, stream=S1)).__dlpack__(stream=consumer, copy=copy, max_version=(1, 0))
    log = cudart.log()
    handle = consumer or 1
    record = [i for i, line in enumerate(log) if line.startswith("cudaEventRecord") and f", {S1}) @ctx1" in line]
    wait = [i for i, line in enumerate(log) if line.startswith(f"cudaStreamWaitEvent({handle}, ")]
    assert record and wait and record[0] < wait[0] and all(log[i].endswith("@ctx0") for i in wait), log
    copies = [i for i, line in enumerate(log) if line.startswith(("cudaMemcpyAsync", "cudaMemcpy2DAsync"))]
    assert bool(copies) == bool(copy) and all(wait[0] < i and log[i].endswith(f", {handle}) @ctx0") for i in copies)
    assert cudart.context_device == 0
    del capsule


# A call of the ordering above that can fail, made with the caller on device 2 (so each scope switches): which
# occurrence fails, and whether the event was recorded and waited on by then.
AROUND_THE_DATAS_DEVICE = {
    "the producer's context's device": ("cudaGetDevice", 201, 1, False, False),
    "the consumer's capture scope": ("cuDevicePrimaryCtxRetain", 101, 0, False, False),
    "leaving the consumer's capture scope": ("cuCtxPopCurrent", 201, 0, False, False),
    "the consumer's wait scope": ("cuDevicePrimaryCtxRetain", 101, 1, True, False),
    "leaving the consumer's wait scope": ("cuCtxPopCurrent", 201, 2, True, True),
}


@pytest.mark.parametrize("where", AROUND_THE_DATAS_DEVICE)
def test_a_failure_around_the_datas_device_wait_raises(cudart, where):
    """Device memory of device 0 produced on a stream of device 1, consumed on the legacy stream while device 2 is
    current: each call of the data's device's scopes that fails raises CudaError naming it, ordering no further."""
    call, code, after, recorded, waited = AROUND_THE_DATAS_DEVICE[where]
    host = np.arange(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=0)
    cudart.add_stream(S1, 1)
    obj = CaiArray(host, stream=S1)
    cudart.current_device = 2
    cai2dlpack(obj)  # the pooled event exists
    references = sys.getrefcount(obj)
    cudart.clear_log()
    cudart.fail(call, code, after=after)
    with pytest.raises(CudaError, match=f"{call} failed") as raised:
        cai2dlpack(obj)
    assert (raised.value.call, raised.value.code) == (call, code)
    log = cudart.log()
    assert any(line.startswith("cudaEventRecord") for line in log) == recorded
    assert any(line.startswith("cudaStreamWaitEvent") for line in log) == waited
    assert sys.getrefcount(obj) == references and cudart.last_error == 0
    if call != "cuCtxPopCurrent":  # a failed pop leaves the context stack as the driver left it
        assert cudart.context_device == 2


@pytest.fixture
def pooled(cudart):
    """A device-2 producer whose pooled event exists (converted once)."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=2)
    obj = CaiArray(host, stream=1)
    cai2dlpack(obj, stream=S2)
    return obj


def test_a_device_reset_gets_a_new_event(cudart, pooled):
    """A device reset destroys the context and the pooled event with it: the next conversion sees another context
    id and makes a new event instead of recording a dead handle."""
    obj = pooled
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


def test_a_dead_event_under_the_same_context_id_is_replaced(cudart, pooled):
    """A reset that kept the context's id: the record of the pooled event fails as a dead handle, and is tried once
    more with a new event that takes its place in the pool."""
    obj = pooled
    before = cudart.events_created
    cudart.fail("cudaEventRecord", 400)
    cai2dlpack(obj, stream=S2)
    assert cudart.events_created == before + 1 and cudart.last_error == 0
    cai2dlpack(obj, stream=S2)
    assert cudart.events_created == before + 1


def test_a_record_refused_twice_leaks_no_event(cudart, pooled):
    """When the new event's record is refused too, the fault is the stream's: the error is raised and the new event
    destroyed, so a stream that always fails costs no event per call."""
    obj = pooled
    alive = cudart.events_alive
    for _ in range(3):
        cudart.fail("cudaEventRecord", 400, count=2)
        with pytest.raises(CudaError, match="cudaEventRecord failed: cudaErrorInvalidResourceHandle"):
            cai2dlpack(obj, stream=S2)
    assert cudart.events_alive == alive and cudart.last_error == 0
    cai2dlpack(obj, stream=S2)


OLDER_RUNTIME = textwrap.dedent("""
    import numpy as np, cai_dlpack, sys
    sys.path.insert(0, {tests!r})
    from support.cuda_double import CudaDouble, DEVICE, MANAGED
    from support.cai_objects import CaiArray, register
    double = CudaDouble({path!r})
    double.reset()
    host = np.zeros(4, dtype=np.float32)
    register(double, host, {kind}, device=1)
    double.add_stream(0x5000, {stream_device})
    double.current_device = 2
    cai_dlpack.cai2dlpack(CaiArray(host, stream=0x5000), stream=0x6000)
    for line in double.log():
        if not line.startswith(("cudaPointerGetAttributes", "cudaEventCreateWithFlags")):
            print(line)
    print("current", double.current_device, double.context_device)
""")


def run_older_runtime(path, kind="DEVICE", stream_device=1, **env_changes):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, CAI_DLPACK_CUDART=path, **env_changes)
    script = OLDER_RUNTIME.format(tests=tests, path=path, kind=kind, stream_device=stream_device)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [re.sub(r" -> ev\d+|ev\d+", "ev", line) for line in result.stdout.splitlines()]


def test_without_driver_entry_points_the_device_is_put_back_by_number():
    """A runtime whose driver cannot hand out its calls: cudaSetDevice(device), then cudaSetDevice(previous)."""
    lines = run_older_runtime(os.environ["CAI_DLPACK_CUDART"], CUDART_DOUBLE_ENTRY_POINTS="0")
    lines = [line for line in lines if not line.startswith("cudaGetDriverEntryPoint")]
    assert lines == ["cudaGetLastError() -> 801", "cudaGetDevice() -> 2", "cudaSetDevice(1)",
                     "cudaStreamGetCaptureInfo(20480) -> none", "cudaStreamGetCaptureInfo(24576) -> none",
                     "cudaEventRecord(ev, 20480)", "cudaStreamWaitEvent(24576, ev, 0)", "cudaSetDevice(2)", "current 2 2"]


@pytest.mark.parametrize("lacking", ["cuCtxGetCurrent", "cuStreamGetCtx", "cuCtxGetId"])
def test_a_driver_lacking_one_context_call_is_used_by_device_number_alone(lacking):
    """The nine context calls are used all together or not at all: where the driver lacks any one of them (here
    the first, the eighth, the ninth and last), the device is put back by number, as with none."""
    lines = run_older_runtime(os.environ["CAI_DLPACK_CUDART"], CUDART_DOUBLE_ENTRY_POINTS=f"-{lacking}")
    lines = [line for line in lines if not line.startswith(("cudaGetDriverEntryPoint", "cudaGetLastError"))]
    assert lines == ["cudaGetDevice() -> 2", "cudaSetDevice(1)",
                     "cudaStreamGetCaptureInfo(20480) -> none", "cudaStreamGetCaptureInfo(24576) -> none",
                     "cudaEventRecord(ev, 20480)", "cudaStreamWaitEvent(24576, ev, 0)", "cudaSetDevice(2)", "current 2 2"]


def test_the_drivers_calls_are_asked_for_with_their_cuda_12_0_signatures():
    """cudaGetDriverEntryPointByVersion hands out a driver call as it is in the CUDA version asked for; the runtime
    table declares each call with its CUDA 12.0 signature (12.0 brought cuCtxGetId, the newest of them), so each of
    the eleven is asked for at 12000 exactly, where a later version could hand out a later signature."""
    lines = run_older_runtime(os.environ["CAI_DLPACK_CUDART"])
    asked = [line for line in lines if line.startswith("cudaGetDriverEntryPointByVersion(")]
    symbols = ["cuCtxGetCurrent", "cuCtxPushCurrent", "cuCtxPopCurrent", "cuDeviceGet", "cuDevicePrimaryCtxRetain",
               "cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxGetState", "cuStreamGetCtx", "cuCtxGetId",
               "cuGetErrorName", "cuGetErrorString"]
    assert asked == [f"cudaGetDriverEntryPointByVersion({symbol}, 12000)" for symbol in symbols]


def test_runtime_12_0_uses_the_unversioned_entry_point(tmp_path):
    """CUDA 12.0-12.4 has cudaGetDriverEntryPoint only: the driver's calls come through it all the same, and
    managed memory's event goes in its stream's context. Its capture query is CUDA 12's six-argument
    cudaStreamGetCaptureInfo_v2 (the plain name is CUDA 11.0's three-argument one)."""
    path = cuda_double.build(str(tmp_path), cuda_12_0=True)
    lines = run_older_runtime(path, kind="MANAGED", stream_device=3)
    assert "cudaGetDriverEntryPoint(cuCtxPushCurrent)" in lines
    lines = [line for line in lines if not line.startswith(("cudaGetDriverEntryPoint", "cudaGetLastError"))]
    assert lines == ["cuStreamGetCtx(20480) -> 3", "cudaGetDevice() -> 2", "cuCtxGetCurrent() -> ctx2",
                     "cuCtxPushCurrent(ctx3)", "cudaStreamGetCaptureInfo_v2(20480) -> none",
                     "cudaStreamGetCaptureInfo_v2(24576) -> none", "cuCtxGetId(ctx3) -> 0", "cudaEventRecord(ev, 20480)",
                     "cudaStreamWaitEvent(24576, ev, 0)", "cuCtxPopCurrent() -> ctx2 current", "current 2 2"]


def test_the_gpu_suites_reset_script_against_the_double():
    """The GPU suite's device-reset child, run here against the double: the script itself is sound."""
    script = os.path.join(os.path.dirname(__file__), os.pardir, "support", "device_reset_child.py")
    child = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "converted after a reset"


def test_host_data_costs_no_cuda_call(cudart):
    """Once a conversion has loaded the runtime, converting host data still makes no CUDA call at all: on a thread
    without a context, a capture query would make the current device's primary context (hundreds of MiB on a GPU
    the caller never used). Through every door that takes a host producer."""
    example = c_example.build()
    cudart.drop_context(0)
    host = np.arange(6.0)
    for convert in (lambda: dlpack2cai(host), lambda: example.managed(host, 1),
                    lambda: example.view(host, 1), lambda: example.fill(host, 1), lambda: dlpack2cai(DLPackShim(host)),
                    lambda: cai2dlpack(host, stream=1)):
        cudart.clear_log()
        result = convert()
        assert result is not None
        assert cudart.log() == [] and cudart.primary_contexts == set() and cudart.context_device == -1


def test_a_view_for_the_per_thread_stream_whose_scope_cannot_be_left_keeps_no_event(cudart):
    """A view for the per-thread default stream marks, with an event recorded in the data's device's scope, the
    point other threads wait for. When that scope cannot be left, the view is refused (CudaError) and its event
    destroyed: a caller that keeps failing costs no event per call."""
    host = np.arange(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=2)
    obj = CaiArray(host, stream=1)
    cudart.clear_log()
    kept = dlpack2cai(DLPackShim(obj), stream=2)  # kept: its release would leave a scope of its own
    pops = sum(line.startswith("cuCtxPopCurrent") for line in cudart.log())

    def refused(times):
        for _ in range(times):
            cudart.fail("cuCtxPopCurrent", 201, after=pops - 1)  # the last scope left: the view's
            with pytest.raises(CudaError, match="cuCtxPopCurrent failed"):
                dlpack2cai(DLPackShim(obj), stream=2)
            cudart.current_device = 0  # what the pop would have restored

    refused(1)  # the refused view's tensor is released, which keeps an event for the next release
    alive = cudart.events_alive
    refused(3)
    assert cudart.events_alive == alive and cudart.last_error == 0
    del kept


@pytest.mark.parametrize("kind", [PINNED_HOST, MANAGED])
def test_a_streams_context_that_cannot_be_pushed_raises_naming_the_drivers_error(cudart, kind):
    """Pinned or managed memory produced on a stream of device 3, with device 0 current: the event goes in that
    stream's context. When the driver refuses to make it current, CudaError names cuCtxPushCurrent and the driver's
    own error (not a runtime error of the same number); nothing is recorded, and device 0's context stays."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, kind, device=1)
    cudart.add_stream(S1, 3)
    obj = CaiArray(host, stream=S1)
    cai2dlpack(obj, stream=S2)
    references = sys.getrefcount(obj)
    cudart.clear_log()
    cudart.fail("cuCtxPushCurrent", 201)
    with pytest.raises(CudaError, match=r"^cuCtxPushCurrent failed: CUDA_ERROR_INVALID_CONTEXT \(") as raised:
        cai2dlpack(obj, stream=S2)
    assert (raised.value.call, raised.value.code, raised.value.name) == (
        "cuCtxPushCurrent", 201, "CUDA_ERROR_INVALID_CONTEXT")
    assert not any(line.startswith(("cudaEventRecord", "cudaStreamWaitEvent")) for line in cudart.log())
    assert cudart.context_device == 0 and cudart.lib.double_context_depth() == 1
    assert sys.getrefcount(obj) == references and cudart.last_error == 0


SET_DEVICE_FAILS = textwrap.dedent("""
    import numpy as np, cai_dlpack, sys
    sys.path.insert(0, {tests!r})
    from support.cuda_double import CudaDouble, DEVICE
    from support.cai_objects import CaiArray, register
    double = CudaDouble({path!r})
    double.reset()
    host = np.zeros(4, dtype=np.float32)
    register(double, host, DEVICE, device=1)
    double.add_stream(0x5000, 1)
    double.current_device = 2
    cai_dlpack.cai2dlpack(CaiArray(host, stream=0x5000), stream=0x6000)  # the runtime loaded
    double.fail("cudaSetDevice", 101, after={after})
    double.clear_log()
    try:
        cai_dlpack.cai2dlpack(CaiArray(host, stream=0x5000), stream=0x6000)
    except cai_dlpack.CudaError as error:
        print(error.call, error.code, error.name)
        print(error)
    print("ordered", any(line.startswith("cudaStreamWaitEvent") for line in double.log()))
    print("current", double.current_device, "last error", double.last_error)
""")


@pytest.mark.parametrize("after, ordered, left_on", [(0, False, 2), (1, True, 1)], ids=["entering", "putting back"])
def test_without_driver_entry_points_a_failed_set_device_raises_the_runtimes_error(after, ordered, left_on):
    """With the device switched by number (no driver calls), a cudaSetDevice that fails, to the data's device or
    back to the caller's, raises CudaError naming it with the runtime's own error name and text, and leaves no
    runtime error pending; a switch that failed left the device as it was."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ["CAI_DLPACK_CUDART"]
    env = dict(os.environ, CAI_DLPACK_CUDART=path, CUDART_DOUBLE_ENTRY_POINTS="0")
    script = SET_DEVICE_FAILS.format(tests=tests, path=path, after=after)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "cudaSetDevice 101 cudaErrorInvalidDevice",
        "cudaSetDevice failed: cudaErrorInvalidDevice (invalid device ordinal)",
        f"ordered {ordered}", f"current {left_on} last error 0"]


def test_device_0s_primary_context_retained_for_a_scope_is_released_after_it(cudart):
    """Device 0 is a device like any other: once its primary context is active, each scope that enters it from
    another device's context retains it and releases it again (a retain kept would keep it alive for good)."""
    host = np.zeros(4, dtype=np.float32)
    register(cudart, host, DEVICE, device=0)
    obj = CaiArray(host, stream=1)
    cudart.current_device = 1
    cai2dlpack(obj, stream=S2)  # device 0's context is made, and the pooled event
    cudart.clear_log()
    for _ in range(3):
        cai2dlpack(obj, stream=S2)
    log = cudart.log()
    assert log.count("cuDevicePrimaryCtxRetain(0)") >= 3
    assert log.count("cuDevicePrimaryCtxRelease(0)") == log.count("cuDevicePrimaryCtxRetain(0)")
