"""CAI producers for tests without a GPU: host memory described by a __cuda_array_interface__ dict,
with the CUDA runtime double told what kind of memory the pointer is."""
import numpy as np


class CaiArray:
    """Exposes a NumPy array's memory through a CAI v3 dict (stream and read-only as asked)."""

    def __init__(self, base, *, stream=None, read_only=False, strides="auto", version=3, **extra):
        self.base = base
        iface = {
            "shape": base.shape,
            "typestr": base.dtype.str,
            "data": (base.__array_interface__["data"][0] if base.size else 0, read_only),
            "strides": base.strides if strides == "auto" else strides,
            "version": version,
            "stream": stream,
        }
        iface.update(extra)
        self.__cuda_array_interface__ = iface


def register(cudart, array, kind, device=0):
    """Tells the double that array's whole allocation is CUDA memory of kind on device."""
    owner = array.base if array.base is not None and isinstance(array.base, np.ndarray) else array
    start = owner.__array_interface__["data"][0]
    cudart.add_region(start, max(owner.nbytes, 1), kind, device)


class Wrapped:
    """A CAI producer with a chosen stream, over any array that speaks CAI (CuPy's, Numba's)."""

    def __init__(self, array, stream):
        self.array = array
        iface = dict(array.__cuda_array_interface__)
        iface["stream"] = stream
        self.__cuda_array_interface__ = iface
