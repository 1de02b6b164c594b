"""Zero-copy bridge between the CUDA Array Interface (v3) and DLPack.

- ``cai2dlpack(obj, *, stream=None, max_version=None, owner=None)``: DLPack capsule from a CAI object,
  an ``__array_interface__`` object, or a CAI dict with ``owner=``.
- ``dlpack2cai(x, *, stream=None)``: a ``DLPackView`` owning the DLPack tensor and exposing
  ``__cuda_array_interface__`` (device memory) / ``__array_interface__`` (host memory).
- ``DLPackShim(obj)``: gives any CAI object ``__dlpack__`` / ``__dlpack_device__``.
- ``options(sync=None, export_stream=None, trust_streams=None)``: the CAI spec's stream opt-outs, and whether
  streams named by handle outlive what is made for them (ordered release after them).
- ``get_include()``: the folder to put on a C/C++ extension's include path for the C API.
"""
import os

from ._core import (
    CUDART_HEADER_MAJOR,
    DLPACK_VERSION,
    _C_API,
    CudaError,
    DLPackShim,
    DLPackView,
    UnsupportedArrayError,
    cai2dlpack,
    cuda_runtime_info,
    dlpack2cai,
    options,
)

# The one place the version is written: the build reads it from here (pyproject.toml, tool.scikit-build).
__version__ = "0.1.0"


def get_include() -> str:
    """The folder holding ``cai_dlpack/cai_dlpack.h`` and the ``dlpack/dlpack.h`` it was built with: add it
    to a C or C++ extension's include path (with Python's own) to use the C API, as with
    ``numpy.get_include()``."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


__all__ = [
    "CUDART_HEADER_MAJOR",
    "DLPACK_VERSION",
    "CudaError",
    "DLPackShim",
    "DLPackView",
    "UnsupportedArrayError",
    "cai2dlpack",
    "cuda_runtime_info",
    "dlpack2cai",
    "get_include",
    "options",
]
