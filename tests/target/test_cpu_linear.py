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


needs_cpu_int4 = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                    reason="this torch has no CPU INT4 kernel")


@needs_cpu_int4
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("zeros", ["whole", "fractional", "none"])
def test_cpu_int4_form_holds_the_same_weight(G: int, zeros: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's CPU INT4 form against the dequantized float32 copy: the same weight, rows 1 to 64, with a bias,
    a residual, an input order (act-order) and the fused SwiGLU; bfloat16 activations bound the difference."""
    from kernels.int4_matmul import CpuInt4, quantize_rtn

    monkeypatch.setattr(model, "CPU_INT4", True)
    g = torch.Generator().manual_seed(G)
    K, N = 384, 320
    q = quantize_rtn(torch.randn(N, K, generator=g) * 0.05, G, use_zero_point=zeros != "none")
    if zeros == "fractional":  # GGUF Q4_1's minimum, tuned zero points
        q.zeros = q.zeros + torch.rand(q.zeros.shape, generator=g)
    bias, perm = torch.randn(N, generator=g), torch.randperm(K, generator=g)
    lin = model.int4_linear(q, bias, perm)
    assert isinstance(lin.cpu_int4, CpuInt4)
    ref = model.Linear(q, bias, lin.dequantized, perm)  # the float32 path
    for M in (1, 3, 17, 64):
        x, res = torch.randn(M, K, generator=g), torch.randn(M, N, generator=g)
        want = ref(x, residual=res)
        monkeypatch.setattr(model, "CPU_INT4", False)
        assert torch.equal(lin(x, residual=res), want)  # switched off: the float32 copy, bit for bit
        monkeypatch.setattr(model, "CPU_INT4", True)
        got = lin(x, residual=res)
        assert got.dtype == torch.float32 and got.shape == (M, N)
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * want.abs().max().item())
        assert not torch.equal(got, want)  # the CPU INT4 kernel really ran
    gate_up = model.int4_linear(quantize_rtn(torch.randn(2 * N, K, generator=g) * 0.05, G))
    x = torch.randn(5, K, generator=g)
    want = model.Linear(gate_up.weight, None, gate_up.dequantized).silu_mul(x)
    torch.testing.assert_close(gate_up.silu_mul(x), want, rtol=0.02, atol=0.02 * want.abs().max().item())


def test_cpu_int4_form_is_built_only_when_switched_on() -> None:
    from kernels.int4_matmul import quantize_rtn

    q = quantize_rtn(torch.randn(64, 128), 32)
    assert not model.CPU_INT4 and model.int4_linear(q).cpu_int4 is None
