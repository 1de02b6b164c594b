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


def build(directory=None, cuda_12_0=False):
    """Compiles the double into a shared library and returns its path. cuda_12_0: a runtime without
    cudaGetDriverEntryPointByVersion (CUDA 12.5), whose driver calls come through cudaGetDriverEntryPoint."""
    directory = directory or tempfile.mkdtemp(prefix="cudart_double_")
    target = os.path.join(directory, "libcudart_double_12_0.so" if cuda_12_0 else "libcudart_double.so")
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        compiler = "cc"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-pthread", SOURCE, "-o", target]
        + (["-DDOUBLE_CUDA_12_0"] if cuda_12_0 else []),
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
        self.lib.double_add_stream.argtypes = [ctypes.c_size_t, ctypes.c_int]
        self.lib.double_primary_contexts.restype = ctypes.c_uint

    def reset(self):
        self.lib.double_reset()

    def add_region(self, start, size, kind, device=0):
        assert self.lib.double_add_region(start, size, kind, device) == 0

    def fail(self, call, code, count=1):
        assert self.lib.double_fail(call.encode(), code, count) == 0

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
