"""Test dependencies without a wheel for every supported CPython: each is None where it is not installed, and
the tests that need it carry a mark that skips them with a reason naming it; the rest of their file runs."""
import pytest

try:
    import torch
except ImportError:
    torch = None
try:
    import tvm_ffi
except ImportError:
    tvm_ffi = None

TORCH_MISSING = ("torch is not installed (a test extra; torch 2.13.0 has no wheel for CPython 3.15 or for "
                 "free-threaded builds)")
TVM_FFI_MISSING = ("apache-tvm-ffi is not installed (it has no wheel for free-threaded CPython; "
                   "pip install apache-tvm-ffi where it has one)")
needs_torch = pytest.mark.skipif(torch is None, reason=TORCH_MISSING)
needs_tvm_ffi = pytest.mark.skipif(tvm_ffi is None, reason=TVM_FFI_MISSING)
