"""Test setup: builds the CUDA runtime test double and points cai_dlpack at it, before any CUDA use."""
import gc
import os

import pytest

from support import cuda_double

_DOUBLE_PATH = cuda_double.build()
os.environ["CAI_DLPACK_CUDART"] = _DOUBLE_PATH
_DOUBLE = cuda_double.CudaDouble(_DOUBLE_PATH)


@pytest.fixture
def trusted_streams(monkeypatch):
    """The streams named by handle are trusted to outlive the tensors made for them (the double's streams never
    go), so releases are ordered after them, here and in the processes a test starts (the variable). Without it
    a handle is not used at the drop (test_untrusted_streams.py)."""
    import cai_dlpack

    monkeypatch.setenv("CAI_DLPACK_TRUST_STREAMS", "1")
    before = cai_dlpack.options()["trust_streams"]
    cai_dlpack.options(trust_streams=True)
    yield
    cai_dlpack.options(trust_streams=before)


@pytest.fixture
def cudart(request):
    """The CUDA runtime double, reset: 4 devices, device 0 current, no regions, empty log (in late mode with
    --late-double: device work runs only when something waits for it)."""
    # What earlier tests left in reference cycles is collected first: a deleter run later by the collector would
    # make its runtime calls inside this test (and take a failure this test injects).
    gc.collect()
    _DOUBLE.reset()
    if request.config.getoption("--late-double"):
        _DOUBLE.late = True
    yield _DOUBLE
    _DOUBLE.reset()
