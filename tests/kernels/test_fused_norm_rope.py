"""kernels/fused_norm_rope: the Triton kernels against their torch references (interpreter on CPU), on
odd widths, GQA head counts, and cache slots across blocks; untouched cache slots stay as they were."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.fused_norm_rope import rms_norm, rms_norm_ref, rope_and_cache, rope_and_cache_ref, silu_mul, silu_mul_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (3, 576), (17, 100)])
def test_rms_norm_matches_reference(rows: int, hidden: int, dtype: torch.dtype) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g, device=DEVICE) * 3).to(dtype)
    w = (torch.rand(hidden, generator=g, device=DEVICE) + 0.5).to(dtype)
    out = rms_norm(x, w, 1e-5, use_triton=True)
    ref = rms_norm_ref(x, w, 1e-5)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, **tol)
    assert out.shape == x.shape and out.dtype == dtype


@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 100)])
def test_rms_norm_writes_columns_in_a_given_order(rows: int, hidden: int) -> None:
    """``perm``: the output is the norm gathered by ``perm`` (what an act-order projection reads): the
    unpermuted norm's values, moved (up to the order its sum of squares is taken in)."""
    g = torch.Generator(device=DEVICE).manual_seed(hidden)
    x = (torch.randn(rows, hidden, generator=g, device=DEVICE) * 3).to(torch.float16)
    w = (torch.rand(hidden, generator=g, device=DEVICE) + 0.5).to(torch.float16)
    perm = torch.randperm(hidden, generator=g, device=DEVICE)
    out = rms_norm(x, w, 1e-5, perm=perm, use_triton=True)
    plain = rms_norm(x, w, 1e-5, use_triton=True)
    torch.testing.assert_close(out, plain[:, perm], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-5, perm), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-5, perm), rms_norm_ref(x, w, 1e-5)[:, perm], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 8), (5, 1536), (3, 1100), (2, 2500)])
def test_silu_mul_matches_reference(rows: int, inter: int, dtype: torch.dtype) -> None:
    """Widths below, at and past one column block (1024), ragged; a strided input; every output written."""
    g = torch.Generator(device=DEVICE).manual_seed(rows * inter)
    wide = (torch.randn(rows, 2 * inter + 6, generator=g, device=DEVICE) * 4).to(dtype)
    gate_up = wide[:, 3 : 3 + 2 * inter]  # a view with a row stride past its width
    out = silu_mul(gate_up, use_triton=True)
    ref = silu_mul_ref(gate_up.float()).to(dtype)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, **tol)
    assert out.shape == (rows, inter) and out.dtype == dtype


def test_silu_mul_rejects_an_odd_width() -> None:
    with pytest.raises(ValueError, match="odd width"):
        silu_mul(torch.zeros(2, 7), use_triton=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,page", [(4, 2, 16, 4), (9, 3, 64, 16), (8, 8, 32, 16)])
def test_rope_and_cache_matches_reference(heads: int, kv_heads: int, head_dim: int, page: int,
                                          dtype: torch.dtype) -> None:
    T, blocks = 7, 6
    g = torch.Generator(device=DEVICE).manual_seed(heads * 100 + head_dim)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g, device=DEVICE).to(dtype)
    positions = torch.tensor([0, 1, 5, 33, 34, 900, 4097], device=DEVICE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=DEVICE, dtype=torch.float32) / head_dim))
    slots = torch.randperm(blocks * page, generator=g, device=DEVICE)[:T]  # scattered over blocks
    poison = math.pi
    caches = [torch.full((blocks, page, kv_heads, head_dim), poison, device=DEVICE, dtype=dtype) for _ in range(4)]
    q = rope_and_cache(qkv, positions, inv_freq, caches[0], caches[1], slots, heads, kv_heads, use_triton=True)
    q_ref = rope_and_cache_ref(qkv, positions, inv_freq, caches[2], caches[3], slots, heads, kv_heads)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(caches[0], caches[2], **tol)  # k: rotated, at the slots
    torch.testing.assert_close(caches[1], caches[3], rtol=0, atol=0)  # v: copied exactly
    untouched = torch.ones(blocks * page, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert (caches[0].view(-1, kv_heads, head_dim)[untouched] == poison).all()


def test_rope_rotates_position_zero_to_identity_and_preserves_norm() -> None:
    H, D = 2, 16
    qkv = torch.randn(2, (H + 2) * D, device=DEVICE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=DEVICE) / D))
    k, v = torch.zeros(1, 4, 1, D, device=DEVICE), torch.zeros(1, 4, 1, D, device=DEVICE)
    pos, slots = torch.tensor([0, 7], device=DEVICE), torch.tensor([0, 1], device=DEVICE)
    q = rope_and_cache(qkv, pos, inv_freq, k, v, slots, H, 1, use_triton=True)
    torch.testing.assert_close(q[0], qkv[0, : H * D].view(H, D))  # angle 0: unchanged
    torch.testing.assert_close(q[1].norm(dim=-1), qkv[1, : H * D].view(H, D).norm(dim=-1))  # a rotation
