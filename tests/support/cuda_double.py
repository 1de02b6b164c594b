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


def build(directory=None):
    """Compiles the double into a shared library and returns its path."""
    directory = directory or tempfile.mkdtemp(prefix="cudart_double_")
    target = os.path.join(directory, "libcudart_double.so")
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        compiler = "cc"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-pthread", SOURCE, "-o", target],
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
    def last_error(self):
        return self.lib.double_last_error()

    @property
    def events_created(self):
        return self.lib.double_events_created()

    @property
    def events_alive(self):
        return self.lib.double_events_alive()
