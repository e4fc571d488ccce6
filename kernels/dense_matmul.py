"""A batch-invariant dense matmul: ``y = x @ w.T (+ bias) (+ residual)`` whose every row gets the same bits
whatever rows share the launch (kernels/invariant.py).

cuBLAS chooses its algorithm (GEMV, tile shape, split-K) by M, so a row's logits depend on how many rows the
LM head scored with it. Here every launch runs one configuration: 16-row tiles (one MMA row tile per row
block, so a row's products meet in the same instructions at any M), a K loop in fixed order with float32
accumulation, no split-K. Rows past M are masked, never computed into real ones.

``dense_matmul_ref`` (float32 sums, one rounding) is the spec and the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import dispatch
from kernels.invariant import QUERY_ROWS
from kernels.pdl import pdl_enter, pdl_meta

BLOCK_N, BLOCK_K = 64, 64


def dense_matmul_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


@triton.jit(do_not_specialize=["M"])
def _dense_matmul_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_rm, stride_ym,
                         HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)  # column tiles first: neighbouring programs share an x tile
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + k[:, None],
                    mask=n_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RES:
        acc += tl.load(r_ptr + offs_m[:, None].to(tl.int64) * stride_rm + offs_n[None, :], mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask)


def dense_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, *, use_triton: bool | None = None) -> torch.Tensor:
    """x: [M, K]; w: [N, K]; bias: [N]; residual: [M, N] -> [M, N] in x's dtype. Triton on CUDA (or when
    forced: CPU tensors need TRITON_INTERPRET=1), the reference elsewhere."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"dense_matmul: x {tuple(x.shape)} and w {tuple(w.shape)} do not match as [M, K] @ [N, K].T")
    M, K = x.shape
    N = w.shape[0]
    if residual is not None and tuple(residual.shape) != (M, N):
        raise ValueError(f"dense_matmul: residual {tuple(residual.shape)} is not [M, N] = {(M, N)}")
    if not dispatch.use_triton(x, use_triton):
        return dense_matmul_ref(x, w, bias, residual)
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(M, QUERY_ROWS))
    _dense_matmul_kernel[grid](x, w, y if bias is None else bias, y if residual is None else residual, y, M, N, K,
                               x.stride(0), w.stride(0), 0 if residual is None else residual.stride(0), y.stride(0),
                               HAS_BIAS=bias is not None, HAS_RES=residual is not None, BLOCK_M=QUERY_ROWS,
                               BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4, num_stages=3, **pdl_meta(x.device))
    return y
