"""The CPU's projection form (``cpu_linear``) against ``F.linear``, and the weight alignment that keeps its
results independent of where a weight happened to be loaded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from target import model
from target.model import Linear, cpu_linear


@pytest.mark.parametrize("M", [1, 2, 3, 9, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_matches_f_linear(M: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(M)
    x, w = torch.randn(M, 96, generator=g), torch.randn(160, 96, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    y = cpu_linear(x, w, b)
    assert y.shape == (M, 160) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_keeps_float32_cpu_weights_aligned_and_results_independent_of_placement() -> None:
    w = torch.randn(576, 96, generator=torch.Generator().manual_seed(0))
    shifted = torch.empty(w.numel() + 3)[3:].view_as(w)  # 12 bytes past an aligned allocation
    shifted.copy_(w)
    assert shifted.data_ptr() % 64 != 0
    a, b = Linear(w), Linear(shifted)
    assert b.weight.data_ptr() % 64 == 0 and torch.equal(b.weight, w)
    x = torch.randn(2, 96)
    assert torch.equal(a(x), b(x))
    t = w.t()  # a transposed view is made contiguous too (cpu_linear reads [N, K] rows)
    assert Linear(t).weight.is_contiguous()
    half = torch.empty(w.numel() + 3, dtype=torch.float16)[3:].view_as(w)
    assert half.data_ptr() % 64 != 0
    assert Linear(half).weight is half  # other dtypes are staging copies: left where they are


def test_prefill_widths_keep_f_linear() -> None:
    g = torch.Generator().manual_seed(2)
    lin = Linear(torch.randn(160, 96, generator=g))
    x = torch.randn(model.CPU_LINEAR_MAX_ROWS + 1, 96, generator=g)
    assert torch.equal(lin(x), F.linear(x, lin.weight))
