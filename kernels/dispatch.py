"""Which path a kernel's dispatcher takes: Triton on CUDA tensors, the torch reference elsewhere.

``FORCE_TRITON`` (tests) sends every dispatcher of a model's forward through its Triton kernel on CPU tensors
too, where Triton's interpreter runs it (``TRITON_INTERPRET=1`` before Triton is imported): a whole engine can
then run the kernels the GPU runs, slowly, on a machine without one (tests/gateway/test_batch_invariant.py).
"""

from __future__ import annotations

import torch

FORCE_TRITON = False


def use_triton(t: torch.Tensor, forced: bool | None = None) -> bool:
    """Whether a kernel on ``t`` takes its Triton path: ``forced`` if given, else on CUDA or under FORCE_TRITON."""
    return (t.is_cuda or FORCE_TRITON) if forced is None else forced
