"""Shared by every suite: makes tests/support importable. The CPU suite (tests/cpu) runs against the CUDA
runtime test double; the GPU suite (tests/gpu) against the real runtime."""
