"""The GPU suite runs against the real CUDA runtime, alone in its process: `python -m pytest tests/gpu`."""
import os

import pytest


def _gpu_skip_reason():
    if "libcudart_double" in os.environ.get("CAI_DLPACK_CUDART", ""):
        return "the CPU suite's CUDA test double is loaded in this process; run `python -m pytest tests/gpu` alone"
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU is available"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        return
    for item in items:
        if "tests/gpu" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.skip(reason=reason))
