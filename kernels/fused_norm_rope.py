"""Fusions for the launch-bound part of a decode step: RMSNorm, RoPE with the KV-cache write, and the
gated activation of a dense MLP.

At decode sizes every elementwise op is a kernel launch that moves a few KB; a 30-layer model spends
more time between its matmuls than in them (bench/results/engine.json). Written as torch ops, RMSNorm
is five kernels and rotary embedding plus the cache write about a dozen per layer; here they are one
each.

* ``rms_norm``: one program per row, fp32 statistics, ``(x * rsqrt(mean(x^2) + eps)).to(dtype) * w``.
* ``silu_mul``: ``silu(gate) * up`` of a dense ``gate_up`` output in one pass (the INT4 matmul fuses it
  into its epilogue; a bf16 draft's MLP otherwise spends two elementwise launches on it), fp32 math,
  one rounding.
* ``rope_and_cache``: one program per token reads its fused qkv row, rotates q and k (HF's rotate-half
  convention, angles ``position * inv_freq`` computed in fp32 and rounded to the activation dtype like
  the reference's cos/sin tables), writes the rotated q out and the rotated k and the v straight into
  their cache slots.

Each has a torch reference, which is also the CPU path, and a dispatcher that takes Triton on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import dispatch
from kernels.pdl import pdl_enter, pdl_meta


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float, perm: torch.Tensor | None = None) -> torch.Tensor:
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w
    return y if perm is None else y[..., perm]


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, o_ptr, perm_ptr, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr,
                     PERM: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    # column j of the output is column perm[j] of the norm: the row is read gathered, once (a sum of squares
    # does not depend on the order it is taken in)
    src = tl.load(perm_ptr + offs, mask=mask, other=0) if PERM else offs
    x = tl.load(x_ptr + row * stride_x + src, mask=mask, other=0.0)
    w = tl.load(w_ptr + src, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    y = (xf * r).to(x.dtype) * w
    tl.store(o_ptr + row * stride_o + offs, y, mask=mask)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, *, perm: torch.Tensor | None = None,
             use_triton: bool | None = None) -> torch.Tensor:
    """x: [..., hidden]; w: [hidden]. Triton on CUDA (or when forced), the reference elsewhere.

    ``perm`` ([hidden] int64): return the norm's columns in that order, ``out[..., j] = norm(x)[..., perm[j]]``,
    the input an act-order projection gathers (``Linear.perm``), at no extra launch."""
    if not dispatch.use_triton(x, use_triton) or x.dtype != w.dtype:
        return rms_norm_ref(x, w, eps, perm)
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty_like(x2)
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(x2.shape[0],)](x2, w, out, x2 if perm is None else perm, x2.stride(0), out.stride(0),
                                         hidden, eps, BLOCK=block, PERM=perm is not None,
                                         num_warps=4 if block <= 4096 else 8, **pdl_meta(x.device))
    return out.view(x.shape)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@triton.jit
def _silu_mul_kernel(x_ptr, o_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * stride_o + cols, (gate * tl.sigmoid(gate) * up).to(o_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """gate_up: [..., 2 I], gate columns first -> [..., I]. Triton on CUDA (or when forced), else the reference."""
    if not dispatch.use_triton(gate_up, use_triton):
        return silu_mul_ref(gate_up)
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"gate_up has an odd width {two_i}: expected [gate | up] halves")
    x2 = gate_up.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = x2.new_empty(x2.shape[0], two_i // 2)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(two_i // 2))
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(two_i // 2, block))](
            x2, out, x2.stride(0), out.stride(0), two_i // 2, BLOCK=block, num_warps=4, **pdl_meta(x2.device))
    return out.view(*gate_up.shape[:-1], two_i // 2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, D]. HF's rotate-half convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_and_cache_ref(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, k_layer: torch.Tensor,
                       v_layer: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int
                       ) -> torch.Tensor:
    """qkv: [T, (H + 2 Hkv) D]; positions, slot_mapping: [T] int64; inv_freq: [D / 2] fp32;
    k_layer / v_layer: [num_blocks, P, Hkv, D], written at ``slot_mapping``. Returns rotated q [T, H, D]."""
    T = qkv.shape[0]
    D = inv_freq.shape[0] * 2
    H, Hkv = num_heads, num_kv_heads
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
    cos, sin = emb.cos().to(qkv.dtype), emb.sin().to(qkv.dtype)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q = apply_rope(q.reshape(T, H, D), cos, sin)
    k_layer.view(-1, Hkv, D)[slot_mapping] = apply_rope(k.reshape(T, Hkv, D), cos, sin)
    v_layer.view(-1, Hkv, D)[slot_mapping] = v.reshape(T, Hkv, D)
    return q


@triton.jit
def _rotate(x1, x2, c, s):
    """Rotate-half on [heads, D/2] halves with fp32 math: (x1 c - x2 s, x2 c + x1 s)."""
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    return a * c - b * s, b * c + a * s


@triton.jit
def _rope_cache_kernel(
    qkv_ptr, pos_ptr, freq_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
    stride_t, stride_qt, stride_qh, stride_kb, stride_kp, stride_kh,
    H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    D: tl.constexpr = 2 * HALF
    dtype = qkv_ptr.dtype.element_ty
    # Every load is issued before the first store: Triton keeps memory operations in program order (it cannot
    # tell that q, the cache and qkv do not alias), so a load written after a store waits a round trip for it.
    pos = tl.load(pos_ptr + t).to(tl.float32)
    slot = tl.load(slot_ptr + t)
    offs_j = tl.arange(0, HALF)
    row = qkv_ptr + t * stride_t
    offs_h = tl.arange(0, BLOCK_H)
    hm = (offs_h < H)[:, None]
    base = offs_h[:, None] * D + offs_j[None, :]  # [BLOCK_H, HALF]
    q1, q2 = tl.load(row + base, mask=hm), tl.load(row + base + HALF, mask=hm)
    offs_g = tl.arange(0, BLOCK_KV)
    gm = (offs_g < HKV)[:, None]
    kbase = H * D + offs_g[:, None] * D + offs_j[None, :]  # [BLOCK_KV, HALF]
    k1, k2 = tl.load(row + kbase, mask=gm), tl.load(row + kbase + HALF, mask=gm)
    vbase = kbase + HKV * D
    v1, v2 = tl.load(row + vbase, mask=gm), tl.load(row + vbase + HALF, mask=gm)

    ang = pos * tl.load(freq_ptr + offs_j)  # [HALF] fp32
    c = tl.cos(ang).to(dtype).to(tl.float32)[None, :]  # rounded like the reference's cos/sin tables
    s = tl.sin(ang).to(dtype).to(tl.float32)[None, :]
    y1, y2 = _rotate(q1, q2, c, s)
    q_off = t * stride_qt + offs_h[:, None] * stride_qh + offs_j[None, :]
    tl.store(q_ptr + q_off, y1.to(dtype), mask=hm)
    tl.store(q_ptr + q_off + HALF, y2.to(dtype), mask=hm)
    dst = (slot // PAGE) * stride_kb + (slot % PAGE) * stride_kp
    y1, y2 = _rotate(k1, k2, c, s)
    c_off = dst + offs_g[:, None] * stride_kh + offs_j[None, :]
    tl.store(k_ptr + c_off, y1.to(dtype), mask=gm)
    tl.store(k_ptr + c_off + HALF, y2.to(dtype), mask=gm)
    tl.store(v_ptr + c_off, v1, mask=gm)
    tl.store(v_ptr + c_off + HALF, v2, mask=gm)


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, k_layer: torch.Tensor,
                   v_layer: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, *,
                   use_triton: bool | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA (or when forced), the reference elsewhere. See the reference.
    ``out``: a contiguous buffer of ``T * num_heads * D`` elements the rotated q is written into."""
    D = inv_freq.shape[0] * 2
    usable = (qkv.stride(-1) == 1 and k_layer.stride() == v_layer.stride() and k_layer.stride(-1) == 1
              and k_layer.dtype == qkv.dtype and D & (D - 1) == 0 and D >= 16)
    T = qkv.shape[0]
    if not dispatch.use_triton(qkv, use_triton) or not usable:
        q = rope_and_cache_ref(qkv, positions, inv_freq, k_layer, v_layer, slot_mapping, num_heads, num_kv_heads)
        return q if out is None else out.view(T, num_heads, D).copy_(q)
    q = qkv.new_empty(T, num_heads, D) if out is None else out.view(T, num_heads, D)
    if T:
        _rope_cache_kernel[(T,)](
            qkv, positions, inv_freq, slot_mapping, q, k_layer, v_layer,
            qkv.stride(0), q.stride(0), q.stride(1), k_layer.stride(0), k_layer.stride(1), k_layer.stride(2),
            H=num_heads, HKV=num_kv_heads, HALF=D // 2, PAGE=k_layer.shape[1],
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(num_kv_heads), num_warps=4,
            **pdl_meta(qkv.device))
    return q
