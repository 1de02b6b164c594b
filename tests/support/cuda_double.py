"""Builds and drives the CUDA runtime test double (tests/cudart_double/cudart_double.c)."""
import ctypes
import os
import shutil
import subprocess
import sysconfig
import tempfile

SOURCE = os.path.join(os.path.dirname(__file__), os.pardir, "cudart_double", "cudart_double.c")

# cudaMemoryType values, as the runtime reports them.
UNREGISTERED, PINNED_HOST, DEVICE, MANAGED = 0, 1, 2, 3
# cudaStreamCaptureMode values.
GLOBAL, THREAD_LOCAL, RELAXED = 0, 1, 2


def compiler():
    """The C compiler Python was built with, or cc."""
    name = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return name if shutil.which(name) else "cc"


def build(directory=None, cuda_12_0=False, capture_mode=True):
    """Compiles the double into a shared library and returns its path. cuda_12_0: a runtime without
    cudaGetDriverEntryPointByVersion (CUDA 12.5), whose driver calls come through cudaGetDriverEntryPoint.
    capture_mode=False: a runtime without cudaThreadExchangeStreamCaptureMode."""
    directory = directory or tempfile.mkdtemp(prefix="cudart_double_")
    name = "libcudart_double" + ("_12_0" if cuda_12_0 else "") + ("" if capture_mode else "_no_capture_mode")
    target = os.path.join(directory, name + ".so")
    subprocess.run(
        [compiler(), "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-pthread", SOURCE, "-o", target, "-ldl"]
        + (["-DDOUBLE_CUDA_12_0"] if cuda_12_0 else []) + ([] if capture_mode else ["-DDOUBLE_NO_CAPTURE_MODE"]),
        check=True,
    )
    return target


class CudaDouble:
    """The loaded double: regions, failures and the call log."""

    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.lib.double_log.restype = ctypes.c_char_p
        self.lib.double_add_region.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
        self.lib.double_fail.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
        self.lib.double_fail_after.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.lib.double_add_stream.argtypes = [ctypes.c_size_t, ctypes.c_int]
        self.lib.double_primary_contexts.restype = ctypes.c_uint
        self.lib.double_begin_capture.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.lib.double_begin_capture.restype = ctypes.c_ulonglong
        self.lib.double_join_capture.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_int]
        self.lib.double_end_capture.argtypes = [ctypes.c_ulonglong]
        self.lib.double_invalidate_capture.argtypes = [ctypes.c_ulonglong]

    def set_max_pitch(self, pitch):
        """What cudaDeviceGetAttribute(cudaDevAttrMaxPitch) answers (2**31 - 1 after reset); cudaMemcpy2DAsync
        refuses a wider pitch or row with cudaErrorInvalidPitchValue."""
        self.lib.double_set_max_pitch(ctypes.c_size_t(pitch))

    def log_context(self, on=True):
        """While on, each log line ends with " @ctxN", N the device whose context is current (-1: none)."""
        self.lib.double_log_context(int(on))

    def reset(self):
        self.lib.double_reset()

    def add_region(self, start, size, kind, device=0):
        assert self.lib.double_add_region(start, size, kind, device) == 0

    def fail(self, call, code, count=1, after=0):
        """The next count calls of call (-1: all) return code, once after calls of it have gone through."""
        assert self.lib.double_fail_after(call.encode(), code, count, after) == 0

    def log(self):
        return [line for line in self.lib.double_log().decode().splitlines() if line]

    def clear_log(self):
        self.lib.double_clear_log()

    @property
    def current_device(self):
        return self.lib.double_current_device()

    @current_device.setter
    def current_device(self, device):
        self.lib.double_set_current_device(device)

    @property
    def context_device(self):
        """The device whose primary context is current, or -1 for none."""
        return self.lib.double_context_device()

    def drop_context(self, device=0):
        """No context current and no primary context made (cudaGetDevice answers device): a process
        that has not used CUDA yet."""
        self.lib.double_drop_context(device)

    @property
    def primary_contexts(self):
        """The devices whose primary context exists."""
        bits = self.lib.double_primary_contexts()
        return {device for device in range(32) if bits >> device & 1}

    def reset_device(self, device):
        """cudaDeviceReset: the device's context and its events are destroyed; the next context has a new id."""
        self.lib.double_reset_device(device)

    def add_stream(self, handle, device):
        """A stream made in device's primary context (what cuStreamGetCtx answers; the runtime then holds it)."""
        assert self.lib.double_add_stream(handle, device) == 0

    @property
    def last_error(self):
        return self.lib.double_last_error()

    @property
    def events_created(self):
        return self.lib.double_events_created()

    @property
    def events_alive(self):
        return self.lib.double_events_alive()

    # ---- stream capture (CUDA graphs) ----

    def begin_capture(self, stream, device=0, mode=GLOBAL, blocking=False, other_thread=False):
        """Starts capturing on stream (a handle, or 2 for device's per-thread default stream) and returns the
        capture's id. blocking: a stream the legacy stream depends on (not cudaStreamNonBlocking), so the legacy
        stream of device is unusable while it captures; other_thread: a capture another thread began."""
        capture = self.lib.double_begin_capture(stream, device, mode, int(blocking), int(other_thread))
        assert capture != 0
        return capture

    def join_capture(self, stream, capture, device=0, blocking=False):
        """stream joins the capture (as a fork through an event recorded in it would make it)."""
        assert self.lib.double_join_capture(stream, device, capture, int(blocking)) == 0

    def end_capture(self, capture):
        """True when the capture made a graph, False when something invalidated it."""
        result = self.lib.double_end_capture(capture)
        assert result in (0, 1)
        return bool(result)

    def invalidate_capture(self, capture):
        """An earlier error of someone else's invalidated the capture."""
        self.lib.double_invalidate_capture(capture)

    @property
    def thread_capture_mode(self):
        """The calling thread's capture-interaction mode (GLOBAL until something exchanges it)."""
        return self.lib.double_thread_capture_mode()

    @thread_capture_mode.setter
    def thread_capture_mode(self, mode):
        """Set as a framework would, with cudaThreadExchangeStreamCaptureMode (which the log records)."""
        value = ctypes.c_int(mode)
        assert self.lib.cudaThreadExchangeStreamCaptureMode(ctypes.byref(value)) == 0

    @property
    def violations(self):
        """How many calls would have broken (invalidated) a capture."""
        return self.lib.double_violations()

    # ---- the late-running device ----

    HOST_FUNCTION = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

    @property
    def late(self):
        raise AttributeError("late is write-only")

    @late.setter
    def late(self, on):
        """Late mode: each stream is a queue that runs only when forced (a synchronizing call, run_stream,
        run_all); cudaEventQuery only looks; freed device memory is poisoned (0xDD) and handed out again."""
        self.lib.double_set_late(int(on))

    def run_stream(self, stream):
        """Runs everything queued on stream (and what it waits on); returns how many operations ran."""
        return self.lib.double_run_stream(ctypes.c_size_t(stream))

    def run_all(self):
        self.lib.double_run_all()

    def queued(self, stream):
        return self.lib.double_queued(ctypes.c_size_t(stream))

    @property
    def sync_calls(self):
        """Calls that waited for the device: stream, device and event synchronizations, cudaFree(Host)."""
        return self.lib.double_sync_calls()

    @property
    def gil_at_event_sync(self):
        """Whether the last cudaEventSynchronize's caller held the GIL: 1 or 0, -1 before any (read it in a
        fresh process: once a subinterpreter exists CPython's check always answers 1)."""
        return self.lib.double_gil_at_event_sync()

    @property
    def calls(self):
        """Every runtime and driver call made so far (logged ones and event queries)."""
        self.lib.double_calls.restype = ctypes.c_ulong
        return self.lib.double_calls()

    def launch_kernel(self, stream, function):
        """Queues function() on stream with cudaLaunchHostFunc, as a kernel would be: it runs when the stream
        gets to it. The callback is kept alive on the returned object."""
        callback = self.HOST_FUNCTION(lambda _argument: function())
        self._kernels = getattr(self, "_kernels", [])
        self._kernels.append(callback)
        self.lib.cudaLaunchHostFunc.argtypes = [ctypes.c_void_p, self.HOST_FUNCTION, ctypes.c_void_p]
        assert self.lib.cudaLaunchHostFunc(ctypes.c_void_p(stream), callback, None) == 0
        return callback
