"""Run as a script: converts, resets the device through the runtime cai_dlpack uses, converts again. The GPU
suite runs it against the real runtime, the CPU suite against the double (CAI_DLPACK_CUDART)."""
import ctypes

import cai_dlpack
from cai_dlpack import cai2dlpack

cudart = ctypes.CDLL(cai_dlpack.cuda_runtime_info()["path"])


def convert():
    pointer, stream = ctypes.c_void_p(), ctypes.c_void_p()
    assert cudart.cudaMalloc(ctypes.byref(pointer), 64) == 0
    assert cudart.cudaStreamCreate(ctypes.byref(stream)) == 0
    iface = {"shape": (16,), "typestr": "<f4", "data": (pointer.value, False), "version": 3, "stream": stream.value}
    capsule = cai2dlpack(iface, owner=object(), stream=2)  # an event on the stream, waited on by stream 2
    del capsule
    assert cudart.cudaStreamDestroy(stream) == 0 and cudart.cudaFree(pointer) == 0


convert()
assert cudart.cudaDeviceReset() == 0  # destroys the context, and the pooled event with it
convert()
print("converted after a reset")
