"""The qkv projection's RoPE epilogue (``Rope`` in kernels/int4_matmul_triton.py): each INT4 kernel path
with RoPE and the KV-cache write fused in, against the same path's plain epilogue followed by the separate
``rope_and_cache`` kernel, on poisoned outputs and caches (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import int4_matmul_triton as T
from kernels.fused_norm_rope import rope_and_cache, rope_and_cache_ref
from kernels.int4_matmul import int4_matmul_ref, int4_qkv_rope_cache, quantize_rtn

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
POISON = math.pi


def _case(M: int, H: int, HKV: int, D: int, K: int, G: int, zero_point: bool, bias: bool, page: int = 4,
          dtype: torch.dtype = torch.float16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    N = (H + 2 * HKV) * D
    w = quantize_rtn(torch.randn(N, K, generator=g) / math.sqrt(K), G, zero_point, dtype=dtype).to(DEVICE)
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    b = (torch.randn(N, generator=g) * 0.1).to(DEVICE, dtype) if bias else None
    positions = torch.randint(0, 5000, (M,), generator=g).to(DEVICE)
    inv_freq = (1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))).to(DEVICE)
    blocks = (M + 2) // page + 2
    slots = torch.randperm(blocks * page, generator=g)[:M].to(DEVICE)  # scattered over the blocks
    return w, x, b, positions, inv_freq, slots, blocks


def _caches(blocks: int, page: int, HKV: int, D: int, dtype: torch.dtype, n: int):
    return [torch.full((blocks, page, HKV, D), POISON, dtype=dtype, device=DEVICE) for _ in range(n)]


def _configs(M: int, N: int, K: int, D: int) -> list[T.KernelConfig]:
    """One config of each kind (with and without split-K) whose tiles hold whole heads, plus dequant."""
    out: list[T.KernelConfig] = []
    for cfg in T._candidates(M, N, K, False, num_sms=132, head_dim=D):
        if not any(c.kind == cfg.kind and (c.split_k > 1) == (cfg.split_k > 1) for c in out):
            out.append(cfg)
    out += [T.KernelConfig("mmat", 16, 128, 128, 1, 4, 2), T.KernelConfig("dequant")]
    if M <= 4:
        out.append(T.KernelConfig("gemv", 4 if M > 2 else M, 128, 64, 2, 4, 1))
    return out


@pytest.mark.parametrize("M,H,HKV,D,K,G,zero_point,bias", [
    (1, 4, 2, 16, 256, 64, True, False),  # hgemv and gemv rows; GQA
    (3, 3, 1, 32, 512, 128, False, True),  # a bias before the rotation; symmetric codes
    (17, 4, 2, 16, 256, 128, True, True),  # two token tiles, the second one row deep
    (5, 2, 2, 64, 256, 32, True, False),  # a head of 64 columns: tiles of 64 and more
])
def test_rope_epilogue_matches_the_separate_kernel(M, H, HKV, D, K, G, zero_point, bias):
    page = 4
    w, x, b, positions, inv_freq, slots, blocks = _case(M, H, HKV, D, K, G, zero_point, bias, page)
    N = (H + 2 * HKV) * D
    configs = _configs(M, N, K, D)
    assert {"mma", "mmat", "dequant"} <= {c.kind for c in configs}
    assert all(c.block_n % D == 0 for c in configs if c.kind != "dequant")
    for cfg in configs:
        kf, vf, ks, vs = _caches(blocks, page, HKV, D, x.dtype, 4)
        rope = T.Rope(positions, inv_freq, kf, vf, slots, H, HKV)
        q_out = torch.full((M, H * D), POISON, dtype=x.dtype, device=DEVICE)
        q = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, bias=b, config=cfg, rope=rope, out=q_out)
        assert q.data_ptr() == q_out.data_ptr()
        qkv = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, bias=b, config=cfg)
        q_sep = rope_and_cache(qkv, positions, inv_freq, ks, vs, slots, H, HKV, use_triton=True)
        # the same projection, rotated by the same fp32 arithmetic: equal (to an ulp where compiled code fuses
        # multiply-adds differently)
        tol = dict(rtol=0, atol=0) if DEVICE.type == "cpu" else dict(rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(q.view(M, H, D), q_sep, **tol, msg=str(cfg))
        torch.testing.assert_close(kf, ks, **tol, msg=str(cfg))  # rotated k at the slots, the rest untouched
        torch.testing.assert_close(vf, vs, rtol=0, atol=0, msg=str(cfg))  # v copied
        untouched = torch.ones(blocks * page, dtype=torch.bool, device=DEVICE)
        untouched[slots] = False
        assert (kf.view(-1, HKV, D)[untouched] == POISON).all() and (vf.view(-1, HKV, D)[untouched] == POISON).all()
    # and against the spec: the reference matmul in fp32, then the reference rotation
    qkv_ref = int4_matmul_ref(x.float(), type(w)(w.qweight, w.scales.float(), None if w.zeros is None
                                                 else w.zeros.float(), G), None if b is None else b.float())
    k32, v32 = _caches(blocks, page, HKV, D, torch.float32, 2)
    q_ref = rope_and_cache_ref(qkv_ref, positions, inv_freq, k32, v32, slots, H, HKV)
    assert ((q.float().view(M, H, D) - q_ref).norm() / q_ref.norm()).item() < 5e-3


def test_rope_epilogue_with_split_k_fix_ups(monkeypatch):
    """Serial and atomic split-K fix-ups both end in the RoPE epilogue (the last program to arrive stores)."""
    H, HKV, D, K, G = 2, 1, 32, 1024, 128
    gemvs = ((1, T.KernelConfig("hgemv", 1, 256, 64, 4, 4, 2)), (2, T.KernelConfig("gemv", 2, 128, 64, 4, 4, 1)))
    for M, gemv in gemvs:
        w, x, b, positions, inv_freq, slots, blocks = _case(M, H, HKV, D, K, G, True, False, seed=M)
        for atomic in (False, True):
            monkeypatch.setattr(T, "FIX_ATOMIC", atomic)
            mmas = (T.KernelConfig("mma", 16, 128, 128, 4, 4, 2), T.KernelConfig("mmat", 16, 128, 128, 8, 4, 2))
            for cfg in (gemv, *mmas):
                kf, vf, ks, vs = _caches(blocks, 4, HKV, D, x.dtype, 4)
                q = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, config=cfg,
                                         rope=T.Rope(positions, inv_freq, kf, vf, slots, H, HKV))
                qkv = T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, config=cfg)
                q_sep = rope_and_cache(qkv, positions, inv_freq, ks, vs, slots, H, HKV, use_triton=True)
                tol = dict(rtol=2e-3, atol=2e-3)  # atomic sums may add in another order
                torch.testing.assert_close(q.view(M, H, D), q_sep, **tol, msg=f"{cfg} atomic={atomic}")
                torch.testing.assert_close(kf, ks, **tol)
                torch.testing.assert_close(vf, vs, **tol)


def test_dispatch_fuses_only_where_it_can():
    """``int4_qkv_rope_cache``: fused or not, the same q and cache; a non-contiguous cache layer (or fusion
    off) takes the two-launch path, and the reference path matches the spec."""
    M, H, HKV, D, K, G = 3, 2, 1, 16, 256, 64
    w, x, b, positions, inv_freq, slots, blocks = _case(M, H, HKV, D, K, G, True, True)
    kf, vf, ku, vu = _caches(blocks, 4, HKV, D, x.dtype, 4)
    q_fused = int4_qkv_rope_cache(x, w, b, positions, inv_freq, kf, vf, slots, H, HKV, use_triton=True, fused=True)
    q_two = int4_qkv_rope_cache(x, w, b, positions, inv_freq, ku, vu, slots, H, HKV, use_triton=True, fused=False)
    tol = dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(q_fused, q_two, **tol)
    torch.testing.assert_close(kf, ku, **tol)
    torch.testing.assert_close(vf, vu, **tol)
    # a strided cache layer (a view across heads) cannot take the epilogue's contiguous slot arithmetic
    wide = torch.full((blocks, 4, 2 * HKV, D), POISON, dtype=x.dtype, device=DEVICE)
    kn, vn = wide[:, :, :HKV], wide[:, :, HKV:]
    assert not kn.is_contiguous()
    q_strided = int4_qkv_rope_cache(x, w, b, positions, inv_freq, kn, vn, slots, H, HKV, use_triton=True, fused=True)
    torch.testing.assert_close(q_strided, q_two, **tol)
    torch.testing.assert_close(kn, ku, **tol)
    kr, vr = _caches(blocks, 4, HKV, D, x.dtype, 2)
    q_ref = int4_qkv_rope_cache(x, w, b, positions, inv_freq, kr, vr, slots, H, HKV, use_triton=False)
    torch.testing.assert_close(q_ref, q_two, rtol=2e-2, atol=2e-2)


def test_rope_epilogue_rejects_what_it_cannot_fuse():
    M, H, HKV, D, K, G = 2, 2, 1, 16, 256, 64
    w, x, b, positions, inv_freq, slots, blocks = _case(M, H, HKV, D, K, G, True, False)
    kf, vf = _caches(blocks, 4, HKV, D, x.dtype, 2)
    rope = T.Rope(positions, inv_freq, kf, vf, slots, H, HKV)
    with pytest.raises(ValueError, match="qkv projection"):  # a residual has no place in a rotated output
        T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, residual=torch.zeros(M, 64, dtype=x.dtype), rope=rope)
    with pytest.raises(ValueError, match="qkv projection"):  # heads that do not add up to the weight's columns
        T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G, rope=T.Rope(positions, inv_freq, kf, vf, slots, 3, 1))
    with pytest.raises(ValueError, match="cache layers"):
        T.int4_matmul_triton(x, w.qweight, w.scales, w.zeros, G,
                             rope=T.Rope(positions, inv_freq, kf.float(), vf.float(), slots, H, HKV))
    with pytest.raises(ValueError, match="whole heads"):  # a 16-column tile cannot hold a 32-wide head
        D2 = 32
        w2, x2, _, pos2, freq2, slots2, blocks2 = _case(M, 1, 1, D2, K, G, True, False)
        k2, v2 = _caches(blocks2, 4, 1, D2, x.dtype, 2)
        T.int4_matmul_triton(x2, w2.qweight, w2.scales, w2.zeros, G, config=T.KernelConfig("mma", 16, 16, 64, 1, 4, 2),
                             rope=T.Rope(pos2, freq2, k2, v2, slots2, 1, 1))


def test_candidates_hold_whole_heads():
    for M in (1, 2, 16, 64, 300):
        for D in (64, 128, 256):
            cands = T._candidates(M, 6144, 4096, False, 132, head_dim=D)
            assert cands and all(c.kind == "dequant" or c.block_n % D == 0 for c in cands), (M, D)
