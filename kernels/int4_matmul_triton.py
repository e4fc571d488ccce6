"""Triton kernels behind ``kernels.int4_matmul``: W4A16 ``y = x @ dequant(W).T`` on the GPTQ layout.

No repack is needed: ``qweight`` is ``[K // 8, N]`` int32 with N contiguous, so a thread that owns four
neighbouring columns of one packed row issues one 16-byte load, and a warp reads 512 contiguous bytes.

The launcher times the candidates of each (M bucket, shape) once and keeps the fastest:

* ``_int4_matmul_kernel``: tensor cores (``tl.dot``) on register-decoded codes, split-K; the workhorse
  from M=1 to M=64 (weights cross HBM once, as 4-bit codes: the GPTQ-triton / Marlin idea).
* ``_int4_matmul_t_kernel``: the same with the operands swapped (y^T = W x^T), so the decoded weights
  sit on wgmma's register side and are decoded once per program whatever the token count.
* ``_int4_gemv_f16_kernel`` ("hgemv"): M = 1, two codes per instruction in packed fp16 FMAs.
* ``_int4_gemv_kernel``: CUDA-core FMAs for M <= 4 (a candidate at M = 1), split-K; ~4 instructions per
  weight, so it wins only on some shapes.
* M >= 64 turns compute-bound: ``_int4_dequant_kernel`` writes a bf16/fp16 ``[K, N]`` scratch copy and
  cuBLAS does the product (the ``"dequant"`` config).

Split-K without atomics on the output: every program writes its fp32 partial tile to a workspace
``[SPLIT_K, M, N]`` and bumps a per-tile counter; the last one to arrive sums the partials in a fixed
order (so results are deterministic), applies the epilogue and resets the counter for the next launch
(CUTLASS's "serial split-K" semaphore). Counters live in one zeroed buffer per device, so launches
that share it must be ordered: one stream, or graphs replayed on one stream.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompileTimeAssertionFailure
from triton.runtime.errors import OutOfResources, PTXASError
from triton.language.extra.cuda.gdc import gdc_launch_dependents, gdc_wait

from kernels import invariant
from kernels.fused_norm_rope import rope_and_cache
from kernels.pdl import pdl_ok
from kernels.tune_file import TuneFile

log = logging.getLogger("specgate.int4")
ONE_BITS = 0x3F800000  # fp32 1.0; a kernel argument, not a constant: see _nibble
_NIBBLE_AT_19 = tl.constexpr(0x780000)  # mantissa bits 19..22


# ----------------------------------------------------------------------------------------------------
# Shared pieces: tile columns, group parameters, decoding, the split-K fix-up and the epilogue.
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _tile_columns(pid_n, N, BLOCK_N: tl.constexpr, SILU: tl.constexpr):
    """Weight columns of a tile. With SILU the tile's first half is gate columns ``j`` and its second
    half the matching up columns ``j + N // 2``, so one program holds both operands of its outputs."""
    return _columns_at(tl.arange(0, BLOCK_N), pid_n, N, BLOCK_N, SILU)


@triton.jit
def _columns_at(c, pid_n, N, BLOCK_N: tl.constexpr, SILU: tl.constexpr):
    """``_tile_columns`` at the tile's column indices ``c`` only, and their mask."""
    if SILU:
        half: tl.constexpr = BLOCK_N // 2
        out_col = pid_n * half + (c % half)
        return out_col + (c // half) * (N // 2), out_col < N // 2
    else:
        cols = pid_n * BLOCK_N + c
        return cols, cols < N


@triton.jit
def _group_params(scales_ptr, zeros_ptr, k0, cols, n_mask, N, K, G: tl.constexpr, BLOCK_K: tl.constexpr,
                  HAS_ZEROS: tl.constexpr):
    """(16 s, (16 + z) s) for packed rows k0 / 8 + r: [1, BLOCK_N] when the tile sits in one group,
    else [BLOCK_K // 8, BLOCK_N] (G is a multiple of 8, so the 8 codes of a word share a group)."""
    if BLOCK_K <= G:
        offs = (k0 // G) * N + cols[None, :]
        mask = n_mask[None, :]
    else:
        rows8 = k0 + 8 * tl.arange(0, BLOCK_K // 8)
        offs = (rows8 // G)[:, None] * N + cols[None, :]
        mask = (rows8 < K)[:, None] & n_mask[None, :]
    s = tl.load(scales_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(zeros_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        z = 8.0
    return 16.0 * s, (16.0 + z) * s


@triton.jit
def _nibble(q, j: tl.constexpr, one_bits):
    """Code j of every word as the fp32 ``1 + code / 16``, with one shift and one LOP3 per weight.

    No int->float conversion (16 per clock per SM: too slow for decode). Moving the code into mantissa
    bits 19..22 of 1.0 is the FasterTransformer / Marlin "magic number" idea; fp32 rather than fp16 keeps
    x * v exact enough for the ``- sum x`` that follows. ``one_bits`` arrives at run time so that ptxas
    holds it in a register and fuses ``(t & mask) | one`` into one LOP3 (an immediate costs a second).
    """
    if j <= 4:
        bits = (q << (19 - 4 * j)) & _NIBBLE_AT_19
    else:
        bits = (q >> (4 * j - 19)) & _NIBBLE_AT_19
    return (bits | one_bits).to(tl.float32, bitcast=True)


@triton.jit
def _epilogue(acc, offs_m, cols, n_mask, M, N, y_ptr, bias_ptr, res_ptr, stride_ym, stride_rm, pid_n,
              HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SILU: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              pos_ptr, freq_ptr, slot_ptr, kc_ptr, vc_ptr, ROPE: tl.constexpr, R_H: tl.constexpr,
              R_HKV: tl.constexpr, R_HALF: tl.constexpr, R_PAGE: tl.constexpr):
    """acc: [BLOCK_M, BLOCK_N] fp32 over weight columns ``cols``. Adds bias, gates, adds residual, stores;
    with ROPE, rotates and places a fused qkv projection's tile instead (``_rope_store``)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if ROPE:
        _rope_store(acc, offs_m, cols, n_mask, M, y_ptr, stride_ym, pid_n, BLOCK_M, BLOCK_N,
                    pos_ptr, freq_ptr, slot_ptr, kc_ptr, vc_ptr, R_H, R_HKV, R_HALF, R_PAGE)
    else:
        if SILU:  # columns [gate half | up half] -> [BLOCK_M, BLOCK_N // 2]
            gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N // 2]), [0, 2, 1]))
            out = gate * tl.sigmoid(gate) * up
            out_cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            mask = (offs_m < M)[:, None] & (out_cols < N // 2)[None, :]
        else:
            out, out_cols = acc, cols
            mask = (offs_m < M)[:, None] & n_mask[None, :]
        if HAS_RES:
            out += tl.load(res_ptr + offs_m[:, None] * stride_rm + out_cols[None, :], mask=mask,
                           other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + out_cols[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_store(acc, offs_m, cols, n_mask, M, q_ptr, stride_qm, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                pos_ptr, freq_ptr, slot_ptr, kc_ptr, vc_ptr, R_H: tl.constexpr, R_HKV: tl.constexpr,
                R_HALF: tl.constexpr, R_PAGE: tl.constexpr):
    """The qkv projection's epilogue with RoPE and the KV-cache write fused in (what ``rope_and_cache``
    does as a kernel of its own; kernels/fused_norm_rope.py). The tile holds whole heads (BLOCK_N a multiple
    of the head dim D): q heads are rotated and stored to ``q`` ([M, R_H * D]); k heads are rotated and v heads
    copied into their cache slots (``kc`` / ``vc``: contiguous [blocks, R_PAGE, R_HKV, D], row m's slot
    ``slot[m]``). Rotate-half convention, fp32 math on the projection rounded to the activation dtype and on
    cos / sin rounded alike, as the separate kernel computes them: the same values, one launch fewer."""
    dtype = q_ptr.dtype.element_ty
    D: tl.constexpr = 2 * R_HALF
    NH: tl.constexpr = BLOCK_N // D  # heads in the tile
    m_ok = offs_m < M
    v = acc.to(dtype).to(tl.float32)  # the unfused path rotates the projection's stored (rounded) values
    x1, x2 = tl.split(tl.permute(tl.reshape(v, [BLOCK_M, NH, 2, R_HALF]), [0, 1, 3, 2]))  # [BLOCK_M, NH, R_HALF]
    pos = tl.load(pos_ptr + offs_m, mask=m_ok, other=0).to(tl.float32)
    ang = pos[:, None, None] * tl.load(freq_ptr + tl.arange(0, R_HALF))[None, None, :]  # [BLOCK_M, 1, R_HALF]
    c = tl.cos(ang).to(dtype).to(tl.float32)
    s = tl.sin(ang).to(dtype).to(tl.float32)
    rot = ((pid_n * NH + tl.arange(0, NH)) < R_H + R_HKV)[None, :, None]  # q and k heads; v heads pass through
    y1 = tl.where(rot, x1 * c - x2 * s, x1)
    y2 = tl.where(rot, x2 * c + x1 * s, x2)
    out = tl.reshape(tl.permute(tl.join(y1, y2), [0, 1, 3, 2]), [BLOCK_M, BLOCK_N]).to(dtype)
    HD: tl.constexpr = R_H * D
    KVD: tl.constexpr = R_HKV * D
    tl.store(q_ptr + offs_m[:, None] * stride_qm + cols[None, :], out, mask=m_ok[:, None] & (cols < HD)[None, :])
    slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
    row = (slot // R_PAGE) * (R_PAGE * KVD) + (slot % R_PAGE) * KVD  # [BLOCK_M]: the slot's first element
    kv = cols - HD  # column within [k | v]
    is_v = kv >= KVD
    kv = tl.where(is_v, kv - KVD, kv)
    dst = row[:, None] + kv[None, :]  # a slot's heads are contiguous: column h D + d is element h D + d
    kv_ok = m_ok[:, None] & (n_mask & (cols >= HD))[None, :]
    tl.store(kc_ptr + dst, out, mask=kv_ok & ~is_v[None, :])
    tl.store(vc_ptr + dst, out, mask=kv_ok & is_v[None, :])


@triton.jit
def _finish(acc, tile, pid_n, pid_k, split_k, offs_m, cols, n_mask, M, N,
            y_ptr, bias_ptr, res_ptr, part_ptr, count_ptr, stride_ym, stride_rm,
            HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, SILU: tl.constexpr, USE_SPLIT: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FIX_R: tl.constexpr, ATOMIC: tl.constexpr,
            pos_ptr, freq_ptr, slot_ptr, kc_ptr, vc_ptr, ROPE: tl.constexpr, R_H: tl.constexpr, R_HKV: tl.constexpr,
            R_HALF: tl.constexpr, R_PAGE: tl.constexpr):
    """Store directly, or as one of split_k partials; the last partial to land reduces and stores.
    ``tile`` indexes this output tile's counter.

    ``ATOMIC``: each program adds its partial into one fp32 ``[M, N]`` sum instead (``part_ptr``: zeroed, and
    left zeroed by the last program), so the last one reads one row, not split_k; the sum's order follows the
    arrival order, so results may differ in the last bits between launches."""
    if not USE_SPLIT:
        _epilogue(acc, offs_m, cols, n_mask, M, N, y_ptr, bias_ptr, res_ptr, stride_ym, stride_rm, pid_n,
                  HAS_BIAS, HAS_RES, SILU, BLOCK_M, BLOCK_N,
                  pos_ptr, freq_ptr, slot_ptr, kc_ptr, vc_ptr, ROPE, R_H, R_HKV, R_HALF, R_PAGE)
    elif ATOMIC:
        mask = (offs_m < M)[:, None] & n_mask[None, :]
        sum_ptrs = part_ptr + offs_m[:, None] * N + cols[None, :]  # part: [M, N] fp32
        tl.atomic_add(sum_ptrs, acc, mask=mask, sem="relaxed")  # reductions in L2; no value comes back
        tl.debug_barrier()  # every thread's adds are issued before thread 0 releases the counter
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == split_k - 1:
            total = tl.load(sum_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            _epilogue(total, offs_m, cols, n_mask, M, N, y_ptr, bias_ptr, res_ptr, stride_ym, stride_rm, pid_n,
                      HAS_BIAS, HAS_RES, SILU, BLOCK_M, BLOCK_N,
                  pos_ptr, freq_ptr, slot_ptr, kc_ptr, vc_ptr, ROPE, R_H, R_HKV, R_HALF, R_PAGE)
            # Zeroed for the next launch, but only once every thread holds its sums: the zeros' layout need not
            # be the load's (an MMA tile's is not), so without the barrier one thread could zero a sum another
            # has yet to read (on an H100 without it, the bench's check after graph replays failed across the
            # candidates, max relative error 0.69, while hgemv's outputs were right).
            tl.debug_barrier()
            tl.store(sum_ptrs, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), mask=mask)
            tl.atomic_xchg(count_ptr + tile, 0)
    else:
        mask = (offs_m < M)[:, None] & n_mask[None, :]
        part_ptrs = part_ptr + offs_m[:, None] * N + cols[None, :]  # part: [split_k, M, N] fp32
        tl.store(part_ptrs + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before thread 0 releases the counter
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == split_k - 1:
            # FIX_R partials per step, all loads in flight at once (one at a time costs a round trip
            # to L2 each); fixed order, so results are bit-identical whatever the arrival order.
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            r = tl.arange(0, FIX_R)[:, None, None]
            for s0 in range(0, split_k, FIX_R):
                p = tl.load(part_ptrs[None, :, :] + (s0 + r) * M * N, mask=mask[None, :, :] & (s0 + r < split_k),
                            other=0.0, cache_modifier=".cg")  # [FIX_R, BLOCK_M, BLOCK_N]
                total += tl.sum(p, axis=0)
            _epilogue(total, offs_m, cols, n_mask, M, N, y_ptr, bias_ptr, res_ptr, stride_ym, stride_rm, pid_n,
                      HAS_BIAS, HAS_RES, SILU, BLOCK_M, BLOCK_N,
                  pos_ptr, freq_ptr, slot_ptr, kc_ptr, vc_ptr, ROPE, R_H, R_HKV, R_HALF, R_PAGE)
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch (and graph replay)


# ----------------------------------------------------------------------------------------------------
# Small M: CUDA-core GEMV with split-K.
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _gemv_row(acc, x_row, row_ok, q, s16, sz16, one_bits):
    """acc[r, n] += one x row's share of a packed tile. x_row: [BLOCK_K // 8, 1] pointers to x[m, k0 + 8 r].

    sum_k x (code - z) s = 16 s * sum x v - (16 + z) s * sum x, with v = 1 + code / 16 (_nibble).
    """
    xv = tl.zeros(acc.shape, tl.float32)
    xs = tl.zeros(x_row.shape, tl.float32)
    for j in tl.static_range(8):  # code j of word r is weight row k0 + 8 r + j
        xj = tl.load(x_row + j, mask=row_ok, other=0.0).to(tl.float32)  # [BLOCK_K // 8, 1]
        xv += xj * _nibble(q, j, one_bits)
        xs += xj
    return acc + xv * s16 - xs * sz16


@triton.jit
def _int4_gemv_kernel(
    # pointers
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, res_ptr, y_ptr, part_ptr, count_ptr,
    # sizes
    M, N, K,
    # strides (qweight, scales, zeros, bias, workspace are contiguous)
    stride_xm, stride_ym, stride_rm,
    split_k, K_ITERS, one_bits,  # K splits; K blocks per split; fp32 bits of 1.0
    pos_ptr, freq_ptr, slot_ptr, kc_ptr, vc_ptr,  # ROPE: positions, inv_freq, slots, the k and v cache layers
    la_q_ptr, la_q_lines, la_s_ptr, la_s_lines,  # LOOKAHEAD: the next projection's words and scales, 128 B lines
    # meta-parameters
    G: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    SILU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_SPLIT: tl.constexpr, FIX_R: tl.constexpr,
    ROPE: tl.constexpr, R_H: tl.constexpr, R_HKV: tl.constexpr, R_HALF: tl.constexpr, R_PAGE: tl.constexpr,
    LOOKAHEAD: tl.constexpr,
):
    """One program: all M <= BLOCK_M <= 4 rows, BLOCK_N weight columns, one K split.

    Rows get separate 2D accumulators rather than one 3D tensor: a 3D layout would lose the 16-byte
    vectors of the packed-word load, and Triton would shuffle every tile through shared memory.
    """
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    BLOCK_K8: tl.constexpr = BLOCK_K // 8
    cols, n_mask = _tile_columns(pid_n, N, BLOCK_N, SILU)  # [BLOCK_N]
    offs_k8 = tl.arange(0, BLOCK_K8)
    q_ptrs = qw_ptr + offs_k8[:, None] * N + cols[None, :]  # [BLOCK_K8, BLOCK_N] packed words
    x_ptrs = x_ptr + 8 * offs_k8[:, None]  # [BLOCK_K8, 1], row 0
    # acc_m[r, n]: row m's sum over packed row r of every tile; reduced over r once, after the loop.
    acc0 = tl.zeros([BLOCK_K8, BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_K8, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_K8, BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_K8, BLOCK_N], tl.float32)
    # Software pipelining by hand (Triton pipelines only loads that feed a dot): the next tile's words
    # are in flight while this one is decoded.
    q_next = tl.load(q_ptrs + pid_k * K_ITERS * BLOCK_K8 * N, mask=n_mask[None, :], other=0)
    for i in range(K_ITERS):
        k0 = (pid_k * K_ITERS + i) * BLOCK_K
        q = q_next  # [BLOCK_K8, BLOCK_N] int32
        q_next = tl.load(q_ptrs + (k0 // 8 + BLOCK_K8) * N, mask=n_mask[None, :] & (i + 1 < K_ITERS), other=0)
        s16, sz16 = _group_params(scales_ptr, zeros_ptr, k0, cols, n_mask, N, K, G, BLOCK_K, HAS_ZEROS)
        acc0 = _gemv_row(acc0, x_ptrs + k0, 0 < M, q, s16, sz16, one_bits)
        if BLOCK_M > 1:
            acc1 = _gemv_row(acc1, x_ptrs + stride_xm + k0, 1 < M, q, s16, sz16, one_bits)
        if BLOCK_M > 2:
            acc2 = _gemv_row(acc2, x_ptrs + 2 * stride_xm + k0, 2 < M, q, s16, sz16, one_bits)
            acc3 = _gemv_row(acc3, x_ptrs + 3 * stride_xm + k0, 3 < M, q, s16, sz16, one_bits)
    offs_m = tl.arange(0, BLOCK_M)
    out = tl.where(offs_m[:, None] == 0, tl.sum(acc0, axis=0)[None, :], 0.0)  # [BLOCK_M, BLOCK_N]
    if BLOCK_M > 1:
        out = tl.where(offs_m[:, None] == 1, tl.sum(acc1, axis=0)[None, :], out)
    if BLOCK_M > 2:
        out = tl.where(offs_m[:, None] == 2, tl.sum(acc2, axis=0)[None, :], out)
        out = tl.where(offs_m[:, None] == 3, tl.sum(acc3, axis=0)[None, :], out)
    if LOOKAHEAD:  # our weights are all loaded: ask L2 for the next projection's while the kernels between run
        _look_ahead(la_q_ptr, la_q_lines, la_s_ptr, la_s_lines)
    _finish(out, pid_n, pid_n, pid_k, split_k, offs_m, cols, n_mask, M, N,
            y_ptr, bias_ptr, res_ptr, part_ptr, count_ptr, stride_ym, stride_rm,
            HAS_BIAS, HAS_RES, SILU, USE_SPLIT, BLOCK_M, BLOCK_N, FIX_R, False,
            pos_ptr, freq_ptr, slot_ptr, kc_ptr, vc_ptr, ROPE, R_H, R_HKV, R_HALF, R_PAGE)


# ----------------------------------------------------------------------------------------------------
# M = 1: packed fp16 GEMV. Two weights per instruction, x scaled into fp16 range per program.
# ----------------------------------------------------------------------------------------------------

# One packed word (codes of rows 8r .. 8r + 7) against x's pairs (x_i, x_i+4) as f16x2, -> fp32
# sum_j x_j (c_j - 8). lop3 moves two nibbles at a time into the mantissas of fp16 1024 (the
# FasterTransformer "fast int4 to half2" trick: codes i and i + 4 sit 16 bits apart, so one lop3
# decodes both); sub / fma strip the magic to exact c - 8; four packed FMAs take the products. In the
# integer pipe (half the FP32 rate on Hopper) that is 5 instructions per 8 weights, against 15 for
# _nibble's one-code-at-a-time decode.
_WORD_DOT_F16 = tl.constexpr("""{
.reg .b32 a, b, c, d, q2, t, m, k16, k72;
.reg .b16 lo, hi;
.reg .f32 flo, fhi;
mov.b32 m, 0x64086408;
mov.b32 k16, 0x2c002c00;
mov.b32 k72, 0xd480d480;
lop3.b32 a, $1, 0x000f000f, 0x64006400, 0xea;
lop3.b32 b, $1, 0x00f000f0, 0x64006400, 0xea;
shr.u32 q2, $1, 8;
lop3.b32 c, q2, 0x000f000f, 0x64006400, 0xea;
lop3.b32 d, q2, 0x00f000f0, 0x64006400, 0xea;
sub.f16x2 a, a, m;
fma.rn.f16x2 b, b, k16, k72;
sub.f16x2 c, c, m;
fma.rn.f16x2 d, d, k16, k72;
mul.f16x2 t, a, $2;
fma.rn.f16x2 t, b, $3, t;
fma.rn.f16x2 t, c, $4, t;
fma.rn.f16x2 t, d, $5, t;
mov.b32 {lo, hi}, t;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 flo, flo, fhi;
mov.b32 $0, flo;
}""")


@triton.jit
def _half(p, HI: tl.constexpr):
    """One fp16 half of packed int32 ``p`` as fp32."""
    if HI:
        h = (p >> 16).to(tl.int16)
    else:
        h = p.to(tl.int16)
    return h.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _word_dot(q, x04, x15, x26, x37, USE_ASM: tl.constexpr):
    """[R, C] words against [R, 1] f16x2 pairs -> [R, C] fp32 sum_j x_j (c_j - 8)."""
    if USE_ASM:
        out = tl.inline_asm_elementwise(asm=_WORD_DOT_F16, constraints="=r,r,r,r,r,r", args=[q, x04, x15, x26, x37],
                                        dtype=tl.int32, is_pure=True, pack=1)
        return out.to(tl.float32, bitcast=True)
    else:  # the interpreter runs no asm: the same sum in fp32
        out = tl.zeros(q.shape, tl.float32)
        for p in tl.static_range(4):
            if p == 0:
                xp = x04
            elif p == 1:
                xp = x15
            elif p == 2:
                xp = x26
            else:
                xp = x37
            out += _half(xp, False) * (((q >> 4 * p) & 0xF) - 8).to(tl.float32)
            out += _half(xp, True) * (((q >> (4 * p + 16)) & 0xF) - 8).to(tl.float32)
        return out


@triton.jit
def _hgemv_tile(q_ptrs, scales_ptr, zeros_ptr, cols, k_lo, i, n_mask, N, K_ITERS, G: tl.constexpr,
                BLOCK_K: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """Tile i's packed words [BLOCK_K // 8, BLOCK_N] and its group's scales and zero points [BLOCK_N]
    (zeros if i is past the split)."""
    ok = n_mask & (i < K_ITERS)
    q = tl.load(q_ptrs + i * (BLOCK_K // 8) * N, mask=ok[None, :], other=0)
    g = (k_lo + i * BLOCK_K) // G * N + cols  # a split need not start on a group boundary
    s = tl.load(scales_ptr + g, mask=ok, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(zeros_ptr + g, mask=ok, other=0.0).to(tl.float32)
    else:
        z = s  # unused
    return q, s, z


@triton.jit
def _hgemv_pairs(x_ptrs, sum_ptr, i, K_ITERS, BLOCK_K8: tl.constexpr):
    """Tile i's scaled x as four [BLOCK_K8, 1] f16x2 pair columns, and its sum of x."""
    ok = i < K_ITERS
    xr = x_ptrs + i * BLOCK_K8 * 4
    return (tl.load(xr, mask=ok, other=0), tl.load(xr + 1, mask=ok, other=0), tl.load(xr + 2, mask=ok, other=0),
            tl.load(xr + 3, mask=ok, other=0), tl.load(sum_ptr + i, mask=ok, other=0).to(tl.float32, bitcast=True))


@triton.jit
def _hgemv_x_pass(x_ptr, scr, k_lo, R8, K_ITERS, BLOCK_K8: tl.constexpr, CHUNK8: tl.constexpr):
    """hgemv's step 1 over a split's R8 packed rows of x: the largest |x|, then the scaled f16x2 pairs and each
    tile's sum of x into the program's scratch rows ``scr``, then a barrier. Returns 1 / the scale."""
    c8 = tl.arange(0, CHUNK8)
    c4 = tl.arange(0, 4)
    # 1a. the split's largest |x|
    amax = tl.zeros([CHUNK8, 4], tl.float32)
    for r0 in range(0, R8, CHUNK8):
        ok = (r0 + c8 < R8)[:, None]
        offs = k_lo + 8 * (r0 + c8)[:, None] + c4[None, :]
        lo = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        hi = tl.load(x_ptr + offs + 4, mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.maximum(tl.abs(lo), tl.abs(hi)))
    e = (tl.max(tl.max(amax, axis=1), axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.maximum(e, 10)
    scale = ((263 - e) << 23).to(tl.float32, bitcast=True)  # 2^(136 - e): max |x| * scale in [2^9, 2^10)
    # 1b. pairs and tile sums
    for r0 in range(0, R8, CHUNK8):
        ok = (r0 + c8 < R8)[:, None]
        offs = k_lo + 8 * (r0 + c8)[:, None] + c4[None, :]
        lo = (tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32) * scale).to(tl.float16)
        hi = (tl.load(x_ptr + offs + 4, mask=ok, other=0.0).to(tl.float32) * scale).to(tl.float16)
        pair = (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)
        tl.store(scr + 4 * (r0 + c8)[:, None] + c4[None, :], pair, mask=ok)
        rows = tl.sum(lo.to(tl.float32) + hi.to(tl.float32), axis=1)  # [CHUNK8]
        tiles = tl.sum(tl.reshape(rows, [CHUNK8 // BLOCK_K8, BLOCK_K8]), axis=1)
        t_idx = r0 // BLOCK_K8 + tl.arange(0, CHUNK8 // BLOCK_K8)
        tl.store(scr + R8 * 4 + t_idx, tiles.to(tl.int32, bitcast=True), mask=t_idx < K_ITERS)
    tl.debug_barrier()  # the scratch rows are written before any thread reads them
    return ((e - 9) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _int4_gemv_f16_kernel(
    # pointers
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, res_ptr, y_ptr, part_ptr, count_ptr, scr_ptr,
    # sizes
    M, N, K,
    # strides (qweight, scales, zeros, bias, workspace are contiguous)
    stride_xm, stride_ym, stride_rm,
    split_k, K_ITERS,  # K splits; K blocks per split (splits cover K exactly: BLOCK_K divides K)
    pos_ptr, freq_ptr, slot_ptr, kc_ptr, vc_ptr,  # ROPE: positions, inv_freq, slots, the k and v cache layers
    la_q_ptr, la_q_lines, la_s_ptr, la_s_lines,  # LOOKAHEAD: the next projection's words and scales, 128 B lines
    # meta-parameters
    G: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    SILU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_SPLIT: tl.constexpr,
    FIX_R: tl.constexpr, USE_ASM: tl.constexpr, CHUNK8: tl.constexpr, DEPTH: tl.constexpr, USE_PDL: tl.constexpr,
    ATOMIC: tl.constexpr,
    ROPE: tl.constexpr, R_H: tl.constexpr, R_HKV: tl.constexpr, R_HALF: tl.constexpr, R_PAGE: tl.constexpr,
    LOOKAHEAD: tl.constexpr,
):
    """One program: row 0 of x, BLOCK_N weight columns, one K split of K_ITERS * BLOCK_K rows (BLOCK_K
    divides G, so every tile sits in one group).

    1. x's slice is scaled by a power of two that puts its largest magnitude in [512, 1024), so the
       fp16 products (|c - 8| <= 8) and 4-term lane sums stay under 32768 and bf16 values convert
       exactly. The scaled pairs (x_i, x_i+4) and each tile's sum of x go to this program's own
       scratch rows (no other program touches them), then the loop reads them back from L1.
    2. Each tile: _word_dot per word, summed over rows, times the group scale; zero points add
       s (8 - z) * sum x.  sum_k x (c - z) s = s (sum x (c - 8) + (8 - z) sum x).
    """
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    BLOCK_K8: tl.constexpr = BLOCK_K // 8
    R8 = K_ITERS * BLOCK_K8  # packed rows in this split
    k_lo = pid_k * K_ITERS * BLOCK_K
    # The first DEPTH tiles' weights and group parameters go out before step 1, so their HBM latency
    # hides behind it; each trip then keeps DEPTH tiles in flight (Triton pipelines only loads that
    # feed a dot, so this loop does it by hand).
    cols, n_mask = _tile_columns(pid_n, N, BLOCK_N, SILU)  # [BLOCK_N]
    offs_k8 = tl.arange(0, BLOCK_K8)
    q_ptrs = qw_ptr + (k_lo // 8 + offs_k8)[:, None] * N + cols[None, :]  # [BLOCK_K8, BLOCK_N]
    q_a, s_a, z_a = _hgemv_tile(q_ptrs, scales_ptr, zeros_ptr, cols, k_lo, 0, n_mask, N, K_ITERS, G, BLOCK_K,
                                HAS_ZEROS)
    if DEPTH > 1:
        q_b, s_b, z_b = _hgemv_tile(q_ptrs, scales_ptr, zeros_ptr, cols, k_lo, 1, n_mask, N, K_ITERS, G, BLOCK_K,
                                    HAS_ZEROS)
    if USE_PDL:  # everything above reads weights only; x and every buffer wait for the previous kernel
        gdc_wait()
    scr = scr_ptr + (pid_k * tl.num_programs(0) + pid_n) * (R8 * 4 + K_ITERS)  # pairs, then tile sums
    inv_scale = _hgemv_x_pass(x_ptr, scr, k_lo, R8, K_ITERS, BLOCK_K8, CHUNK8)
    # 2. the weights
    x_ptrs = scr + 4 * offs_k8[:, None]  # [BLOCK_K8, 1]
    sum_ptr = scr + R8 * 4
    x_a = _hgemv_pairs(x_ptrs, sum_ptr, 0, K_ITERS, BLOCK_K8)  # from L1 / L2: one tile ahead is enough
    acc = tl.zeros([BLOCK_N], tl.float32)
    for i in range(K_ITERS):
        q, s, z = q_a, s_a, z_a
        if DEPTH > 1:
            q_a, s_a, z_a = q_b, s_b, z_b
            q_b, s_b, z_b = _hgemv_tile(q_ptrs, scales_ptr, zeros_ptr, cols, k_lo, i + 2, n_mask, N, K_ITERS, G,
                                        BLOCK_K, HAS_ZEROS)
        else:
            q_a, s_a, z_a = _hgemv_tile(q_ptrs, scales_ptr, zeros_ptr, cols, k_lo, i + 1, n_mask, N, K_ITERS, G,
                                        BLOCK_K, HAS_ZEROS)
        x04, x15, x26, x37, xsum = x_a
        x_a = _hgemv_pairs(x_ptrs, sum_ptr, i + 1, K_ITERS, BLOCK_K8)
        t = tl.sum(_word_dot(q, x04, x15, x26, x37, USE_ASM), axis=0)  # [BLOCK_N]
        if HAS_ZEROS:
            t += (8.0 - z) * xsum
        acc += s * t
    acc = acc * inv_scale
    if USE_PDL:
        gdc_launch_dependents()  # the next kernel may start its own weight prefetch during our fix-up
    if LOOKAHEAD:  # our weights are all loaded: ask L2 for the next projection's while the kernels between run
        _look_ahead(la_q_ptr, la_q_lines, la_s_ptr, la_s_lines)
    offs_m = tl.arange(0, 1)
    _finish(acc[None, :], pid_n, pid_n, pid_k, split_k, offs_m, cols, n_mask, M, N,
            y_ptr, bias_ptr, res_ptr, part_ptr, count_ptr, stride_ym, stride_rm,
            HAS_BIAS, HAS_RES, SILU, USE_SPLIT, 1, BLOCK_N, FIX_R, ATOMIC,
            pos_ptr, freq_ptr, slot_ptr, kc_ptr, vc_ptr, ROPE, R_H, R_HKV, R_HALF, R_PAGE)


# ----------------------------------------------------------------------------------------------------
# Medium M: tensor cores, split-K.
# ----------------------------------------------------------------------------------------------------


def _code_pair_asm(j: int, magic: int) -> str:
    """PTX for two packed words -> two 16-bit floats ``magic + code_j``: code j sits in byte j // 2
    (high nibble for odd j); prmt gathers that byte of both words into the two halves, lop3 keeps the
    nibble and ors in the exponent (Marlin's lop3 dequant, here one code position at a time)."""
    b = j // 2
    sel = ((4 + b) << 12) | ((4 + b) << 8) | (b << 4) | b
    shift = "shr.b32 t, t, 4; " if j % 2 else ""
    return f"{{ .reg .b32 t; prmt.b32 t, $1, $2, {sel:#x}; {shift}lop3.b32 $0, t, 0x000F000F, {magic:#x}, 0xEA; }}"


_CODE_ASM_BF16 = tl.constexpr(tuple(_code_pair_asm(j, 0x43004300) for j in range(8)))  # bf16 128 + code
_CODE_ASM_F16 = tl.constexpr(tuple(_code_pair_asm(j, 0x64006400) for j in range(8)))  # fp16 1024 + code


@triton.jit
def _codes_plus_magic(q, j: tl.constexpr, dtype: tl.constexpr, USE_ASM: tl.constexpr):
    """[R, C] int32 words -> [R, C] ``dtype`` values MAGIC + code_j (128 for bf16, 1024 for fp16), exact.

    The asm is pure and unary: Triton then moves the conversion to the MMA operand layout above it, so
    packed words (not 16-bit weights) cross shared memory and decoding lands in MMA registers. The
    interpreter runs no asm: it takes the plain path.
    """
    if not USE_ASM:
        if dtype == tl.bfloat16:
            return (((q >> 4 * j) & 0xF).to(tl.float32) + 128.0).to(dtype)
        else:
            return (((q >> 4 * j) & 0xF).to(tl.float32) + 1024.0).to(dtype)
    elif dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(asm=_CODE_ASM_BF16[j], constraints="=r,r,r", args=[q], dtype=tl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(asm=_CODE_ASM_F16[j], constraints="=r,r,r", args=[q], dtype=tl.float16,
                                         is_pure=True, pack=2)


# One L2 prefetch per pointer, where its predicate holds; the result is a dummy (nothing reads it), and the op
# is not pure, so it stays in the kernel.
_PREFETCH_L2 = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }")


@triton.jit
def _prefetch_l2(ptrs, mask):
    tl.inline_asm_elementwise(asm=_PREFETCH_L2, constraints="=r,l,r", args=[ptrs, mask.to(tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_split(qw_ptr, scales_ptr, zeros_ptr, pid_n, pid_k, N, K, K_ITERS, G: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """Ask L2 for the first (at most two) K blocks of a MMA program's packed words and group parameters,
    before it waits on the kernel ahead (PDL): weights are never written by a kernel, so their HBM latency
    can overlap the kernel ahead's tail and our own launch, as the GEMV's first tiles do; the pipeliner
    fetches the later blocks while the first ones compute. One prefetch per 64 bytes of a row (16 words,
    32 scales): a [BLOCK_K // 8, BLOCK_N // 16] grid of pointers per K block."""
    c = tl.arange(0, BLOCK_N // 16) * 16
    cols, ok = _columns_at(c, pid_n, N, BLOCK_N, SILU)
    r8 = tl.arange(0, BLOCK_K // 8)
    GROWS: tl.constexpr = BLOCK_K // G if BLOCK_K > G else 1  # group rows a K block spans
    gr = tl.arange(0, GROWS)
    for i in range(tl.minimum(K_ITERS, 2)):
        k0 = (pid_k * K_ITERS + i) * BLOCK_K
        _prefetch_l2(qw_ptr + (k0 // 8 + r8)[:, None] * N + cols[None, :], (k0 + 8 * r8 < K)[:, None] & ok[None, :])
        g_ok = (k0 + gr * G < K)[:, None] & (ok & (c % 32 == 0))[None, :]
        g_off = (k0 // G + gr)[:, None] * N + cols[None, :]
        _prefetch_l2(scales_ptr + g_off, g_ok)
        if HAS_ZEROS:
            _prefetch_l2(zeros_ptr + g_off, g_ok)


@triton.jit
def _prefetch_lines(base, lines, pid, progs):
    """This program's share of ``lines`` 128-byte lines from ``base`` (a contiguous buffer), one L2 prefetch a
    line, 128 a round."""
    per = tl.cdiv(lines, progs)
    lo = pid * per
    offs = tl.arange(0, 128)
    for j in range(0, per, 128):
        line = lo + j + offs
        _prefetch_l2(base.to(tl.pointer_type(tl.int8)) + line.to(tl.int64) * 128, (j + offs < per) & (line < lines))


@triton.jit
def _look_ahead(la_q_ptr, la_q_lines, la_s_ptr, la_s_lines):
    """Ask L2 for this program's share of another weight's packed words and scales (``LOOKAHEAD_BYTES``): the
    programs split the lines evenly, so the whole grid covers them once."""
    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    progs = tl.num_programs(0) * tl.num_programs(1)
    _prefetch_lines(la_q_ptr, la_q_lines, pid, progs)
    _prefetch_lines(la_s_ptr, la_s_lines, pid, progs)


@triton.jit
def _dot(a, b, acc):
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _split8(x, BLOCK_M: tl.constexpr, BLOCK_K8: tl.constexpr):
    """[BLOCK_M, 8 * BLOCK_K8] -> eight [BLOCK_M, BLOCK_K8]: x_j[:, r] = x[:, 8 r + j] (in registers)."""
    e, o = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_K8, 2, 2, 2]))  # split on j % 2
    ee, eo = tl.split(e)
    oe, oo = tl.split(o)
    x0, x4 = tl.split(ee)
    x2, x6 = tl.split(eo)
    x1, x5 = tl.split(oe)
    x3, x7 = tl.split(oo)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _mma_tile(x_ptr, qw_ptr, pid, M, N, stride_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, SILU: tl.constexpr, TRANS: tl.constexpr):
    """A program's tile: its token rows and weight columns, and pointers to K block 0 of x ([BLOCK_M,
    BLOCK_K]) and of the packed words ([BLOCK_K // 8, BLOCK_N], or [BLOCK_N, BLOCK_K // 8] with TRANS).
    The M tiles of an N tile are neighbours in the grid, so a weight tile comes from HBM once and from
    L2 for the others."""
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % num_m_tiles, pid // num_m_tiles
    cols, n_mask = _tile_columns(pid_n, N, BLOCK_N, SILU)  # [BLOCK_N]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k8 = tl.arange(0, BLOCK_K // 8)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    if TRANS:
        q_ptrs = qw_ptr + offs_k8[None, :] * N + cols[:, None]
    else:
        q_ptrs = qw_ptr + offs_k8[:, None] * N + cols[None, :]
    return pid_n, cols, n_mask, offs_m, offs_m < M, x_ptrs, q_ptrs


@triton.jit
def _mma_load(x_ptrs, q_ptrs, k0, m_mask, n_mask, N, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              TRANS: tl.constexpr):
    """K block k0's x tile and packed words (int32); K may be ragged (not a multiple of BLOCK_K) unless
    EVEN_K, so rows past K are masked."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_k8 = tl.arange(0, BLOCK_K // 8)
    if EVEN_K:
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
        if TRANS:
            q = tl.load(q_ptrs + (k0 // 8) * N, mask=n_mask[:, None], other=0)
        else:
            q = tl.load(q_ptrs + (k0 // 8) * N, mask=n_mask[None, :], other=0)
    else:
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None] & (k0 + offs_k < K)[None, :], other=0.0)
        if TRANS:
            q = tl.load(q_ptrs + (k0 // 8) * N, mask=n_mask[:, None] & (k0 + 8 * offs_k8 < K)[None, :], other=0)
        else:
            q = tl.load(q_ptrs + (k0 // 8) * N, mask=(k0 + 8 * offs_k8 < K)[:, None] & n_mask[None, :], other=0)
    return x, q


@triton.jit
def _group_vectors(scales_ptr, zeros_ptr, k, cols, mask, N, G: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """Scales and zero points ([BLOCK_N], storage dtype) of the group holding weight row k. The MMA
    kernels load them a trip ahead: Triton's pipeliner overlaps only the loads that feed a dot, and
    these would stall every trip on an HBM round trip."""
    g = (k // G) * N
    return (tl.load(scales_ptr + g + cols, mask=mask, other=0.0),
            tl.load(zeros_ptr + g + cols, mask=mask & HAS_ZEROS, other=0.0))


@triton.jit
def _int4_matmul_kernel(
    # pointers
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, res_ptr, y_ptr, part_ptr, count_ptr,
    # sizes
    M, N, K,
    # strides
    stride_xm, stride_ym, stride_rm,
    split_k, K_ITERS, one_bits,  # K splits; K blocks per split; fp32 bits of 1.0
    pos_ptr, freq_ptr, slot_ptr, kc_ptr, vc_ptr,  # ROPE: positions, inv_freq, slots, the k and v cache layers
    la_q_ptr, la_q_lines, la_s_ptr, la_s_lines,  # LOOKAHEAD: the next projection's words and scales, 128 B lines
    # meta-parameters
    G: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    SILU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_SPLIT: tl.constexpr, FIX_R: tl.constexpr, FACTORED: tl.constexpr, USE_ASM: tl.constexpr,
    EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, SCALE_DOT: tl.constexpr, ZDEC: tl.constexpr,
    PREFETCH: tl.constexpr, ATOMIC: tl.constexpr,
    ROPE: tl.constexpr, R_H: tl.constexpr, R_HKV: tl.constexpr, R_HALF: tl.constexpr, R_PAGE: tl.constexpr,
    LOOKAHEAD: tl.constexpr,
):
    """One program: a [BLOCK_M, BLOCK_N] output tile over one K split (see ``_mma_tile``).

    A [BLOCK_K // 8, BLOCK_N] tile of words is eight dots, one per code position j: rows 8 r + j of W
    against columns 8 r + j of x. With FACTORED (16-bit x, G % BLOCK_K == 0) the dots take the raw
    codes (+ magic) and scales and zero points apply once per tile to the fp32 sums:
        sum_k x (c - z) s = s * (sum_k x (c + MAGIC) - (MAGIC + z) * sum_k x),
    with sum_k x itself a dot against ones (the tensor cores are idle in this regime). Otherwise
    (interpreter, fp32, smaller groups) each slice is dequantized in fp32 before its dot. EVEN_K: BLOCK_K divides K, so
    no load needs a K mask.
    """
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    BLOCK_K8: tl.constexpr = BLOCK_K // 8
    pid_n, cols, n_mask, offs_m, m_mask, x_ptrs, q_ptrs = _mma_tile(x_ptr, qw_ptr, pid, M, N, stride_xm, BLOCK_M,
                                                                    BLOCK_N, BLOCK_K, SILU, False)
    if USE_PDL:  # the pipeliner's first loads read x: only the L2 prefetch of our weights overlaps the kernel ahead
        if PREFETCH:
            _prefetch_split(qw_ptr, scales_ptr, zeros_ptr, pid_n, pid_k, N, K, K_ITERS, G, BLOCK_N, BLOCK_K, SILU,
                            HAS_ZEROS)
        gdc_wait()
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = pid_k * K_ITERS * BLOCK_K
    if SCALE_DOT:
        # FACTORED: a tile's scales (row 0) and zero points (row 1) travel as a [16, BLOCK_N] tile that
        # feeds two one-hot dots, so Triton's pipeliner fetches them with the weights (cp.async, stages
        # ahead; rows 2-15 are masked and never fetched) and the dots hand them over in the
        # accumulator's layout, exact (x 1.0, fp32 sums). Loaded as plain [BLOCK_N] vectors instead,
        # they arrive in another layout: a shared-memory round trip with two barriers per trip.
        r16 = tl.arange(0, 16)
        sz_off = cols[None, :] + 0 * r16[:, None]
        sz_ptrs = tl.where(r16[:, None] == 0, scales_ptr + sz_off, zeros_ptr + sz_off)  # [16, BLOCK_N]
        sz_mask = ((r16 == 0) | ((r16 == 1) & HAS_ZEROS))[:, None] & n_mask[None, :]
        pick = tl.arange(0, BLOCK_M)[:, None] * 0 + r16[None, :]  # [BLOCK_M, 16]: column index
        e0 = (pick == 0).to(x_ptr.dtype.element_ty)
        e1 = (pick == 1).to(x_ptr.dtype.element_ty)
    else:  # FACTORED: scales and zero points a trip ahead
        s_next, z_next = _group_vectors(scales_ptr, zeros_ptr, k_lo, cols, n_mask, N, G, HAS_ZEROS)
    for i in range(K_ITERS):
        k0 = (pid_k * K_ITERS + i) * BLOCK_K
        x, q = _mma_load(x_ptrs, q_ptrs, k0, m_mask, n_mask, N, K, BLOCK_K, EVEN_K, False)  # q: [BLOCK_K8, BLOCK_N]
        xj = _split8(x, BLOCK_M, BLOCK_K8)  # 8 x [BLOCK_M, BLOCK_K8]
        if FACTORED:
            if x.dtype == tl.bfloat16:
                MAGIC: tl.constexpr = 128.0
            else:
                MAGIC: tl.constexpr = 1024.0
            # sum_k x as a dot against ones: a row sum of the x tile would cost a barrier per tile
            # sum_k x as a dot against ones: a row sum of the x tile would cost a barrier per tile.
            # (Two accumulator chains, even and odd j, measured no faster on the H200.)
            t = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # sum_k x (code + MAGIC), or with ZDEC x (code - z)
            if ZDEC:  # (code + MAGIC) - (MAGIC + z) = code - z exactly in 16 bits: no sum_k x needed
                if HAS_ZEROS:
                    zm = (MAGIC + z_next.to(tl.float32)).to(x.dtype)[None, :]
                else:
                    zm = tl.full([1, 1], MAGIC + 8.0, x.dtype)
                for j in tl.static_range(8):
                    t = tl.dot(xj[j], _codes_plus_magic(q, j, x.dtype, USE_ASM) - zm, t)
            else:
                ones = tl.full([BLOCK_K8, BLOCK_N], 1.0, x.dtype)
                u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # sum_k x, broadcast along N
                for j in tl.static_range(8):
                    t = tl.dot(xj[j], _codes_plus_magic(q, j, x.dtype, USE_ASM), t)
                    u = tl.dot(xj[j], ones, u)
            if SCALE_DOT:
                sz = tl.load(sz_ptrs + (k0 // G) * N, mask=sz_mask, other=0.0).to(x.dtype)  # [16, BLOCK_N]
                s = tl.dot(e0, sz)
                if HAS_ZEROS:
                    z = tl.dot(e1, sz)
                else:
                    z = 8.0
            else:
                s = s_next.to(tl.float32)[None, :]
                if HAS_ZEROS:
                    z = z_next.to(tl.float32)[None, :]
                else:
                    z = 8.0
                s_next, z_next = _group_vectors(scales_ptr, zeros_ptr, k0 + BLOCK_K, cols, n_mask & (i + 1 < K_ITERS),
                                                N, G, HAS_ZEROS)
            if ZDEC:
                acc += t * s
            else:
                acc += t * s - u * (s * (MAGIC + z))
        else:
            s16, sz16 = _group_params(scales_ptr, zeros_ptr, k0, cols, n_mask, N, K, G, BLOCK_K, HAS_ZEROS)
            for j in tl.static_range(8):
                acc = _dot(xj[j], (_nibble(q, j, one_bits) * s16 - sz16).to(x.dtype), acc)
    if USE_PDL:
        gdc_launch_dependents()
    if LOOKAHEAD:  # our weights are all loaded: ask L2 for the next projection's while the kernels between run
        _look_ahead(la_q_ptr, la_q_lines, la_s_ptr, la_s_lines)
    _finish(acc, pid, pid_n, pid_k, split_k, offs_m, cols, n_mask, M, N, y_ptr, bias_ptr, res_ptr, part_ptr,
            count_ptr, stride_ym, stride_rm, HAS_BIAS, HAS_RES, SILU, USE_SPLIT, BLOCK_M, BLOCK_N, FIX_R, ATOMIC,
            pos_ptr, freq_ptr, slot_ptr, kc_ptr, vc_ptr, ROPE, R_H, R_HKV, R_HALF, R_PAGE)


@triton.jit
def _int4_matmul_t_kernel(
    # pointers
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, res_ptr, y_ptr, part_ptr, count_ptr,
    # sizes
    M, N, K,
    # strides
    stride_xm, stride_ym, stride_rm,
    split_k, K_ITERS, one_bits,  # K splits; K blocks per split; fp32 bits of 1.0
    pos_ptr, freq_ptr, slot_ptr, kc_ptr, vc_ptr,  # ROPE: positions, inv_freq, slots, the k and v cache layers
    la_q_ptr, la_q_lines, la_s_ptr, la_s_lines,  # LOOKAHEAD: the next projection's words and scales, 128 B lines
    # meta-parameters
    G: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    SILU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_SPLIT: tl.constexpr, FIX_R: tl.constexpr, FACTORED: tl.constexpr, USE_ASM: tl.constexpr,
    EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, ZDEC: tl.constexpr, PREFETCH: tl.constexpr,
    ATOMIC: tl.constexpr,
    ROPE: tl.constexpr, R_H: tl.constexpr, R_HKV: tl.constexpr, R_HALF: tl.constexpr, R_PAGE: tl.constexpr,
    LOOKAHEAD: tl.constexpr,
):
    """The MMA path with its operands swapped: y^T = W x^T, so the decoded weights are the MMA's A
    operand (rows = weight columns) and the tokens its N dimension (Machete's swap-AB idea).

    ``_int4_matmul_kernel`` puts tokens on the MMA's M side; every warp that owns other token rows
    decodes the same weights again, and a 64-row tile decodes each weight four times. Here warps split
    the weight columns, each weight is decoded once per program whatever BLOCK_M is, and BLOCK_M only
    adds MMAs (8 tokens each) on registers already decoded. Same factoring as the untransposed kernel:
        sum_k x (c - z) s = s * (sum_k x (c + MAGIC) - (MAGIC + z) * sum_k x).
    """
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    BLOCK_K8: tl.constexpr = BLOCK_K // 8
    pid_n, cols, n_mask, offs_m, m_mask, x_ptrs, q_ptrs = _mma_tile(x_ptr, qw_ptr, pid, M, N, stride_xm, BLOCK_M,
                                                                    BLOCK_N, BLOCK_K, SILU, True)
    if USE_PDL:  # index arithmetic only above: nothing read before the wait but weights
        if PREFETCH:
            _prefetch_split(qw_ptr, scales_ptr, zeros_ptr, pid_n, pid_k, N, K, K_ITERS, G, BLOCK_N, BLOCK_K, SILU,
                            HAS_ZEROS)
        gdc_wait()
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)  # y^T
    k_lo = pid_k * K_ITERS * BLOCK_K
    if FACTORED:
        s_next, z_next = _group_vectors(scales_ptr, zeros_ptr, k_lo, cols, n_mask, N, G, HAS_ZEROS)
    for i in range(K_ITERS):
        k0 = (pid_k * K_ITERS + i) * BLOCK_K
        x, q = _mma_load(x_ptrs, q_ptrs, k0, m_mask, n_mask, N, K, BLOCK_K, EVEN_K, True)  # q: [BLOCK_N, BLOCK_K8]
        xj = _split8(x, BLOCK_M, BLOCK_K8)  # 8 x [BLOCK_M, BLOCK_K8]
        if FACTORED:
            if x.dtype == tl.bfloat16:
                MAGIC: tl.constexpr = 128.0
            else:
                MAGIC: tl.constexpr = 1024.0
            s = s_next.to(tl.float32)
            if HAS_ZEROS:
                z = z_next.to(tl.float32)
            else:
                z = 8.0
            t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            if ZDEC:  # (code + MAGIC) - (MAGIC + z) = code - z, exact in 16 bits: t = sum_k (code - z) x
                if HAS_ZEROS:
                    zm = (MAGIC + z).to(x.dtype)[:, None]
                else:
                    zm = tl.full([1, 1], MAGIC + 8.0, x.dtype)
                for j in tl.static_range(8):
                    t = tl.dot(_codes_plus_magic(q, j, x.dtype, USE_ASM) - zm, tl.trans(xj[j]), t)
            else:  # t = sum_k (code + MAGIC) x, u = sum_k x (broadcast along the weight columns)
                ones = tl.full([BLOCK_N, BLOCK_K8], 1.0, x.dtype)
                u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                for j in tl.static_range(8):
                    xt = tl.trans(xj[j])  # [BLOCK_K8, BLOCK_M]
                    t = tl.dot(_codes_plus_magic(q, j, x.dtype, USE_ASM), xt, t)
                    u = tl.dot(ones, xt, u)
            s_next, z_next = _group_vectors(scales_ptr, zeros_ptr, k0 + BLOCK_K, cols, n_mask & (i + 1 < K_ITERS), N,
                                            G, HAS_ZEROS)
            if ZDEC:
                acc += t * s[:, None]
            else:
                acc += t * s[:, None] - u * (s * (MAGIC + z))[:, None]
        else:
            s16, sz16 = _group_params(scales_ptr, zeros_ptr, k0, cols, n_mask, N, K, G, BLOCK_K, HAS_ZEROS)
            s16, sz16 = tl.trans(s16), tl.trans(sz16)  # [BLOCK_N, 1] or [BLOCK_N, BLOCK_K8]
            for j in tl.static_range(8):
                w = (_nibble(q, j, one_bits) * s16 - sz16).to(x.dtype)
                acc = _dot(w, tl.trans(xj[j]), acc)
    if USE_PDL:
        gdc_launch_dependents()
    if LOOKAHEAD:  # our weights are all loaded: ask L2 for the next projection's while the kernels between run
        _look_ahead(la_q_ptr, la_q_lines, la_s_ptr, la_s_lines)
    _finish(tl.trans(acc), pid, pid_n, pid_k, split_k, offs_m, cols, n_mask, M, N, y_ptr, bias_ptr, res_ptr,
            part_ptr, count_ptr, stride_ym, stride_rm, HAS_BIAS, HAS_RES, SILU, USE_SPLIT, BLOCK_M, BLOCK_N, FIX_R,
            ATOMIC, pos_ptr, freq_ptr, slot_ptr, kc_ptr, vc_ptr, ROPE, R_H, R_HKV, R_HALF, R_PAGE)


# ----------------------------------------------------------------------------------------------------
# Large M: dequantize once into a scratch buffer, then cuBLAS.
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _int4_dequant_kernel(
    qw_ptr, scales_ptr, zeros_ptr, w_ptr,  # w: [K, N] out, activation dtype
    N, K, one_bits,
    G: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < N
    k0 = pid_k * BLOCK_K
    rows8 = k0 + 8 * tl.arange(0, BLOCK_K // 8)  # first weight row of each packed row
    mask = (rows8 < K)[:, None] & n_mask[None, :]
    q = tl.load(qw_ptr + (rows8 // 8)[:, None] * N + cols[None, :], mask=mask, other=0)
    s16, sz16 = _group_params(scales_ptr, zeros_ptr, k0, cols, n_mask, N, K, G, BLOCK_K, HAS_ZEROS)
    for j in tl.static_range(8):  # one store per code position keeps 4 neighbouring columns per thread
        w = (_nibble(q, j, one_bits) * s16 - sz16).to(w_ptr.dtype.element_ty)
        tl.store(w_ptr + (rows8 + j)[:, None] * N + cols[None, :], w, mask=mask)


# ----------------------------------------------------------------------------------------------------
# Launch: pick a path and a config, allocate, launch.
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KernelConfig:
    kind: str  # "hgemv" (packed fp16, M = 1), "gemv" (fp32 CUDA cores, M <= 4), "mma" (tensor cores),
    # "mmat" (tensor cores, operands swapped: y^T = W x^T) or "dequant" (W + cuBLAS)
    block_m: int = 16
    block_n: int = 128  # weight columns per program
    block_k: int = 128  # weight rows per loop step
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3  # software pipeline stages (mma); weight tiles in flight (hgemv)


@dataclass(frozen=True, slots=True)
class Rope:
    """What a fused qkv projection's epilogue needs to rotate q and k and write k and v into the cache
    (``_rope_store``; the separate kernel is ``rope_and_cache`` in kernels/fused_norm_rope.py)."""

    positions: torch.Tensor  # [M] int64
    inv_freq: torch.Tensor  # [D // 2] fp32
    k_layer: torch.Tensor  # [num_blocks, page, num_kv_heads, D], contiguous
    v_layer: torch.Tensor  # the same shape
    slot_mapping: torch.Tensor  # [M] int64: each row's cache slot
    num_heads: int
    num_kv_heads: int

    @property
    def head_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]


# Programmatic dependent launch (sm_90, kernels/pdl.py): hgemv and mma launches may start while the previous
# kernel in the stream finishes; they prefetch weights (which no kernel writes) and wait (griddepcontrol.wait)
# before touching x or any buffer. Hides the launch gap and the tail of the kernel before.
# SPECGATE_PDL=0 turns it off.
# SPECGATE_INT4_SCALE_DOT=1: at block_m 16 the MMA path's scales and zero points ride the dot pipeline
# (see _int4_matmul_kernel). Off by default: alone, on the four 8B shapes, it is faster (H200, one run,
# bench/results/mma_probe.json: M=16 78.8 -> 73.8 us per layer); inside the 8B verify step it is slower
# (bench/results/scale_dot_engine_ab.json: 16 nodes 3.64 -> 3.73 ms, mean of 5 runs per arm, alternated).
# At block_m 32 its two [BLOCK_M, BLOCK_N] fp32 tiles spill (M=32 102 -> 123 us), so it never applies there.
SCALE_DOT = os.environ.get("SPECGATE_INT4_SCALE_DOT", "0") == "1"
# Whole-number zero points (RTN, GPTQ; not GGUF Q4_1's or tuned ones) are subtracted from the decoded
# codes in 16 bits, exactly, so the MMA paths skip their second dot (sum_k x against ones) and its
# per-tile correction. SPECGATE_INT4_ZDEC=0 keeps the factored form everywhere, for A/B runs.
ZDEC = os.environ.get("SPECGATE_INT4_ZDEC", "1") == "1"
# Partial rows hgemv's fix-up reads per round at 512 columns (more at narrower tiles): 16 takes two rounds of
# L2 reads at 32 splits. The fix-up costs 11.7 of 63.8 us a layer on the 8B shapes (H100,
# bench/results/gemv_probe_h100.json); SPECGATE_INT4_FIX_ROWS=32 (one round; the sm_90 build keeps its
# registers and no stack) is for an A/B not yet run.
FIX_ROWS = int(os.environ.get("SPECGATE_INT4_FIX_ROWS", "16"))
if FIX_ROWS < 1 or FIX_ROWS & (FIX_ROWS - 1):
    raise ValueError(f"SPECGATE_INT4_FIX_ROWS must be a power of two, got {FIX_ROWS}")
# Split-K sums by atomic adds (the default; SPECGATE_INT4_FIX_ATOMIC=0 for the serial fix-up above): the split-K
# programs of hgemv and of both MMA paths add their partials into one fp32 [M, N] sum in L2 (reductions, no value
# back), so the last program of a tile reads one tile instead of split_k (the MMA paths read theirs one a round:
# a serial L2 round trip per split). The split-K "atomic" mode of cuBLAS and CUTLASS beside the serial one. The
# sum's order is the arrival order: results may differ in their last bits from launch to launch. 2.3-5.4% off
# every M up to 128 of the 8B layer on an H100 (bench/results/int4_atomic_ab_h100_d32cf22.json, repeated in
# int4_atomic_ab_h100_5e2e7e0.json); the engine's CUDA tests pass with it (cuda_tests_atomic_h100_5e2e7e0.json).
# Batch-invariant mode always takes the serial fix-up, whose results repeat bit for bit.
FIX_ATOMIC = os.environ.get("SPECGATE_INT4_FIX_ATOMIC", "1") == "1"
# SPECGATE_INT4_MMAT=0 leaves the swap-AB path out of the tuner's candidates (A/B runs).
MMAT = os.environ.get("SPECGATE_INT4_MMAT", "1") == "1"
# SPECGATE_INT4_PREFETCH=0: the MMA paths do not prefetch their first weights into L2 before waiting on the
# kernel ahead (_prefetch_split). A decode step's GEMVs load weights before that wait and a verify step's MMA
# matmuls did not: on an H100 the prefetch took 3-4% off SmolLM2-shape verify steps, where every program's
# K split is one block (bench/results/verify_prefetch_ab_h100.json). Not yet timed on the 8B shapes.
PREFETCH = os.environ.get("SPECGATE_INT4_PREFETCH", "1") == "1"
# SPECGATE_INT4_COMPILE_THREADS: threads that build a shape's tuning candidates at once (_precompile; 1: each is
# built by its first launch, one by one). Triton's passes release the GIL and ptxas runs as a process of its own:
# six INT4 kernels built for sm_90 in 2.80-3.07 s one by one and 1.82-2.10 s on two threads of a 2-core host
# (bench/results/compile_threads_cpu.json, 1.54x best against best). A cold
# engine tunes dozens of (M bucket, shape) keys, each over up to ~25 candidates.
COMPILE_THREADS = int(os.environ.get("SPECGATE_INT4_COMPILE_THREADS", str(min(16, os.cpu_count() or 1))))
# SPECGATE_INT4_LOOKAHEAD=MB (0, the default: off until timed on a GPU): once a projection's programs hold their
# own weights, they ask L2 for up to MB megabytes of the words and scales of the projection the model runs next
# (``lookahead``: qkv -> o, o -> gate_up, down -> the next layer's qkv), split evenly over the grid. At small M
# the kernels between (RoPE, attention and its merge, RMSNorm) are latency-bound and leave HBM idle for some
# microseconds a layer (an 8B decode step on the H200, bench/results/engine.json's kernel profile: ~15 us a
# layer in them), time in which HBM can move o's 8 MB, or a third of gate_up's 59 MB, into L2 before they are
# asked for. It rides the MMA paths' L2 prefetch (``_prefetch_l2``). Prefetches only: no result changes.
LOOKAHEAD_BYTES = int(float(os.environ.get("SPECGATE_INT4_LOOKAHEAD", "0")) * (1 << 20))
# SPECGATE_INT4_ROPE=1: the qkv projection's epilogue rotates q and k and writes k and v into the KV cache
# (_rope_store), so a layer launches no rope_and_cache kernel (fewer launches in a launch-bound step). Off by
# default: on an H100 (bench/results/rope_ab_h100_a7a710a.json, SmolLM2-shape verify steps, best of 4 rounds)
# it took 0.979 / 0.990x of the step at batch 1 (1 / 4 nodes) and 0.996 / 1.016x at batch 16, within the
# spread of the run; the tuner kept the separate kernel's dequant path for the 64-row projection there. The
# interpreter tests check it bit-equal to the separate kernel on every path.
ROPE = os.environ.get("SPECGATE_INT4_ROPE", "0") == "1"
# SPECGATE_INT4_TUNE: how the tuner times the candidates.
# "cold": each call alone, after a read that evicts the weights from L2 (_time_configs).
# "chain": the way a graphed forward runs them (_time_chain): one CUDA graph of back-to-back launches, PDL on
#   where the GPU has it, each launch over its own copy of the weight, with enough copies to stream twice
#   the L2's size, so every launch reads its weights from HBM, as each layer's do, while its prefetch
#   overlaps the tail of the launch ahead. A timed call alone pays its whole latency chain, a launch in a
#   graph mostly its weight stream: the cold timing favours many programs and splits over a short
#   kernel with no split-K fix-up (the serial tail: partials to L2, the counter, the last program's reads).
#   The chain tuner also weighs one split and narrower tiles for short K (K <= SHORT_K).
# "auto" (the default): chain for 2 <= M <= 64 (CHAIN_M), cold elsewhere. H100, both arms in one process or
#   in alternated processes: chain-tuned SmolLM2-shape verify steps took 0.979-0.983x (batch 1, 4 nodes),
#   0.9625x (batch 16, 1 node) and 0.992-0.994x (batch 16, 4 nodes) of the cold-tuned ones in two runs
#   (bench/results/tune_ab_h100_6781735.json), and 8B-shape verify steps 0.950-0.987x at 2-32 nodes in two
#   pairs, 1.001-1.002x at 64 (engine_ab_tune_h100_6781735.json). At M = 1 chain lost: the SmolLM2 decode step
#   1.010-1.029x, the 8B one 1.000-1.007x. So M = 1 stays cold, and so do prefill sizes, which were not timed.
TUNE = os.environ.get("SPECGATE_INT4_TUNE", "auto")
if TUNE not in ("auto", "cold", "chain"):
    raise ValueError(f"SPECGATE_INT4_TUNE must be auto, cold or chain, got {TUNE!r}")
CHAIN_M = (2, 64)
SHORT_K = 2048
CHAIN_MAX_LAUNCHES = 256
_CONFIG_CACHE: dict[tuple, KernelConfig] = {}
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_SUMS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # grown-out shared buffers that captured graphs may still use
_autotune = True
# (block_m, block_n, num_warps, num_stages) per M bucket, the H200 favourite first. block_m <= 32 keeps
# the MMA on mma.sync with B in registers (wgmma would read dequantized weights from shared memory).
_MMA_SHAPES = {
    16: [(16, 128, 4, 3), (16, 64, 4, 3), (16, 256, 8, 3), (16, 256, 4, 3)],
    32: [(32, 128, 4, 3), (32, 64, 4, 3)],
    64: [(32, 128, 4, 3), (32, 256, 8, 3)],
    128: [(32, 128, 4, 3)],
    256: [(128, 128, 8, 3)],
}
# The swap-AB MMA path: (block_m = tokens, block_n, num_warps, num_stages). Weight columns are the MMA's
# M side, so Triton lowers to wgmma with the decoded weights in registers (block_n >= 64 per warpgroup).
_MMAT_SHAPES = {
    16: [(16, 128, 4, 3), (16, 256, 8, 3)],
    32: [(32, 128, 4, 3), (32, 256, 8, 3)],
    64: [(64, 256, 8, 3), (64, 128, 4, 3), (64, 128, 8, 3)],
    128: [(128, 128, 8, 3), (64, 256, 8, 3)],
    256: [(128, 128, 8, 3)],
}
# Narrower tiles for short K under the chain tuner (the MMA's at M <= 16): a small weight over more programs
_SHORT_MMA_SHAPES = [(16, 32, 4, 3)]
_SHORT_HGEMV_SHAPES = [(128, 64, 4, 2)]
_GEMV_SHAPES = [(512, 64, 4, 1)]  # (block_n, block_k, warps, stages); more rows or a larger block_k spill
# (block_n, block_k, warps, tiles in flight); block_k is capped at G
_HGEMV_SHAPES = [(512, 64, 4, 2), (512, 64, 4, 1), (256, 128, 4, 2), (512, 128, 4, 1)]


def set_autotune(enabled: bool) -> None:
    """Time the candidate configs on the first call of each (M bucket, shape); else take the first."""
    global _autotune
    _autotune = enabled


def _splits(tiles: int, k_blocks: int, num_sms: int, unsplit: bool = False) -> list[int]:
    """Split-K factors that divide k_blocks (equal splits) and bring the grid near 1.5, 3 or 6 programs
    per SM: few programs leave SMs idle in the last wave, many pay for partials and fix-ups. ``unsplit``
    adds 1 last (the untuned default stays the first pick): no fix-up at all, for a K one program can walk."""
    divisors = [d for d in range(1, min(k_blocks, 32) + 1) if k_blocks % d == 0]
    picks = sorted({min(divisors, key=lambda d: abs(tiles * d - w * num_sms)) for w in (1.5, 3, 6)})
    return picks + [1] * (unsplit and 1 not in picks)


def _candidates(M: int, N: int, K: int, silu: bool, num_sms: int, G: int = 128, x16: bool = True,
                head_dim: int = 0) -> list[KernelConfig]:
    """Configs worth timing for this M bucket, the untuned default first. ``x16``: 16-bit activations.
    ``head_dim``: a RoPE epilogue's (``Rope``): only tiles that hold whole heads."""
    n_out = N // 2 if silu else N
    out: list[KernelConfig] = []
    if M >= 128 and not silu:  # compute-bound: cuBLAS on a dequantized copy wins from here (H200)
        out.append(KernelConfig("dequant"))
    bucket = min(max(triton.next_power_of_2(M), 16), 256)
    short = chain_timed(M) and K <= SHORT_K  # the chain tuner's extra candidates
    shapes = [("mma", bm, bn, 128, w, st)
              for bm, bn, w, st in _MMA_SHAPES[bucket] + _SHORT_MMA_SHAPES * (short and bucket == 16)]
    if M > 1 and MMAT:  # (M = 1 belongs to the GEMVs)
        shapes += [("mmat", bm, bn, 128, w, st) for bm, bn, w, st in _MMAT_SHAPES[bucket]]
    if M == 1:  # K & -K: the largest power of two dividing K, so GEMV blocks are whole
        if x16:
            shapes = [("hgemv", 1, bn, min(bk, G), w, d) for bn, bk, w, d in _HGEMV_SHAPES + _SHORT_HGEMV_SHAPES * short
                      ] + shapes
        shapes += [("gemv", 1, bn, min(bk, K & -K), w, st) for bn, bk, w, st in _GEMV_SHAPES]
    if head_dim:
        shapes = [sh for sh in shapes if sh[2] % head_dim == 0]
    for kind, bm, bn, bk, warps, stages in shapes:
        tiles = triton.cdiv(n_out, bn // 2 if silu else bn) * (1 if "gemv" in kind else triton.cdiv(M, bm))
        for split in _splits(tiles, triton.cdiv(K, bk), num_sms, short):
            out.append(KernelConfig(kind, bm, bn, bk, split, warps, stages))
    if M >= 64 and not silu and out[0].kind != "dequant":
        out.append(KernelConfig("dequant"))
    return out


@functools.lru_cache(maxsize=None)  # a pure function of the shape, asked at every launch in the mode
def invariant_config(N: int, K: int, silu: bool, num_sms: int, head_dim: int = 0) -> KernelConfig:
    """Batch-invariant mode's one config for a weight shape, at every M (kernels/invariant.py): MMA tiles of
    ``invariant.QUERY_ROWS`` rows, so a row meets the same instructions at any M, and one split-K factor from the
    weight's shape alone (the fewest-programs pick of ``_splits`` at a single row tile). The fix-up is the serial
    one (``kernel_for``), which sums the partials in split order."""
    block_n = max(128, head_dim)
    tiles = triton.cdiv(N // 2 if silu else N, block_n // 2 if silu else block_n)
    split = _splits(tiles, triton.cdiv(K, 128), num_sms)[0]
    return KernelConfig("mma", invariant.QUERY_ROWS, block_n, 128, split, 4, 3)


def _shared_zeros(store: dict, device: torch.device, n: int, dtype: torch.dtype, what: str) -> torch.Tensor:
    """``store``'s zeroed buffer for ``device``, grown to at least ``n`` elements.

    A grown buffer replaces the old one for new launches, but the old one is kept: a CUDA graph captured
    before the growth still reads and writes it on every replay (its launches leave it zeroed, as they found
    it). Freed, its memory would go back to the allocator, and a later tensor there would take the replays'
    counter bumps and partial sums. Growth at least doubles, so what is kept stays under the live size. It
    never happens inside a capture, whose allocations belong to the graph's pool: the first launch of each
    shape runs eagerly (tuning, warm-up) before a graph records it."""
    buf = store.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"INT4 split-K {what}: a launch needing {n} met its first use inside a CUDA graph "
                               "capture; run the shape once eagerly before capturing it")
        if buf is not None:
            _RETIRED.append(buf)
        size = max(n, 1 << 16, 0 if buf is None else 2 * buf.numel())
        buf = store[device] = torch.zeros(size, dtype=dtype, device=device)
    return buf


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 split-K counters, shared by every launch on this device (each resets its own)."""
    return _shared_zeros(_COUNTERS, device, n, torch.int32, "counters")


def _sums(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed fp32 split-K sums for FIX_ATOMIC, shared like the counters (each launch leaves its rows zeroed)."""
    return _shared_zeros(_SUMS, device, n, torch.float32, "sums (SPECGATE_INT4_FIX_ATOMIC)")


def kernel_for(cfg: KernelConfig, x_16bit: bool, G: int, on_gpu: bool, even_k: bool = True,
               pdl: bool = False, whole_zeros: bool = False) -> tuple:
    """The kernel of ``cfg``'s path and the compile-time arguments that depend on the call.
    ``whole_zeros``: the zero points are whole numbers (or absent), so a 16-bit decode can subtract them."""
    atomic = FIX_ATOMIC and not invariant.enabled()  # atomic sums follow the programs' arrival order
    if cfg.kind == "hgemv":
        # partials read per fix-up step: the fix-up's L2 round trips are the tail of a short kernel
        return _int4_gemv_f16_kernel, {"FIX_R": max(1, min(FIX_ROWS, FIX_ROWS * 512 // cfg.block_n)),
                                       "USE_ASM": on_gpu, "CHUNK8": 128, "DEPTH": cfg.num_stages, "USE_PDL": pdl,
                                       "ATOMIC": atomic}
    if cfg.kind == "gemv":
        # Partials read per fix-up step: pays off for GEMV's thin tiles; on MMA tiles the 3D tile costs
        # more than it saves (H200, 16 x 128 tiles: 9.9 -> 20 us).
        return _int4_gemv_kernel, {"FIX_R": max(1, min(8, 4096 // cfg.block_n))}
    factored = x_16bit and G % cfg.block_k == 0
    if cfg.kind == "mmat":
        return _int4_matmul_t_kernel, {"FIX_R": 1, "FACTORED": factored, "USE_ASM": on_gpu, "EVEN_K": even_k,
                                       "USE_PDL": pdl, "ZDEC": factored and whole_zeros and ZDEC,
                                       "PREFETCH": pdl and on_gpu and PREFETCH, "ATOMIC": atomic}
    scale_dot = factored and SCALE_DOT and cfg.block_m == 16
    return _int4_matmul_kernel, {"FIX_R": 1, "FACTORED": factored, "USE_ASM": on_gpu, "EVEN_K": even_k,
                                 "USE_PDL": pdl, "SCALE_DOT": scale_dot,
                                 "ZDEC": factored and whole_zeros and ZDEC and not scale_dot,
                                 "PREFETCH": pdl and on_gpu and PREFETCH, "ATOMIC": atomic}


def sass_configs() -> list[KernelConfig]:
    """The configs ``bench/kernels/sass.py`` compiles for sm_90: each path at its usual M."""
    return [KernelConfig("hgemv", 1, 512, 64, 16, 4, 2),
            KernelConfig("hgemv", 1, 512, 128, 16, 4, 1),
            KernelConfig("gemv", 1, 512, 64, 16, 4, 1),
            KernelConfig("mma", 16, 128, 128, 8, 4, 3),
            KernelConfig("mma", 16, 256, 128, 8, 8, 3),
            KernelConfig("mma", 16, 256, 128, 8, 4, 3),
            KernelConfig("mma", 32, 256, 128, 4, 8, 3),
            KernelConfig("mma", 32, 128, 128, 4, 4, 3),
            KernelConfig("mmat", 16, 128, 128, 8, 4, 3),
            KernelConfig("mmat", 64, 256, 128, 2, 8, 3),
            KernelConfig("mmat", 128, 128, 128, 1, 8, 3)]


def _is_16bit(x: torch.Tensor) -> bool:
    return x.dtype in (torch.float16, torch.bfloat16)


def lookahead_lines(qweight: torch.Tensor, scales: torch.Tensor, cap: int) -> tuple[int, int]:
    """128-byte lines of ``qweight`` and of ``scales`` that a lookahead of ``cap`` bytes of words asks for: the
    first rows of the words (the first K blocks of every column) and the scales of those rows."""
    q_bytes = qweight.numel() * qweight.element_size()
    s_bytes = scales.numel() * scales.element_size()
    take = min(q_bytes, cap)
    return -(-take // 128), -(-(s_bytes * take // q_bytes) // 128)


def _launch(cfg: KernelConfig, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
            zeros: torch.Tensor | None, G: int, bias: torch.Tensor | None, residual: torch.Tensor | None,
            silu: bool, y: torch.Tensor, whole_zeros: bool = False, rope: Rope | None = None,
            lookahead: tuple[torch.Tensor, torch.Tensor] | None = None, warmup: bool = False) -> None:
    """x: [M, K]; qweight: [K // 8, N]; y: [M, N], [M, N // 2] with silu, [M, H D] (q) with rope;
    residual like y; ``lookahead``: (words, scales) to ask L2 for (``LOOKAHEAD_BYTES``). ``warmup``: build the
    kernel this launch needs and launch nothing (``_precompile``)."""
    M, K = x.shape
    N = qweight.shape[1]
    if cfg.kind == "dequant":  # compute-bound M: one dequantized copy, then cuBLAS
        if warmup:  # cuBLAS has nothing to build
            return
        w = dequantize_triton(qweight, scales, zeros, G, x.dtype)  # [K, N]
        out = y if rope is None else torch.empty((M, N), dtype=x.dtype, device=x.device)
        torch.matmul(x, w, out=out)
        if bias is not None:
            out += bias
        if residual is not None:
            out += residual
        if rope is not None:  # the separate kernel, as the unfused path runs it
            rope_and_cache(out, rope.positions, rope.inv_freq, rope.k_layer, rope.v_layer, rope.slot_mapping,
                           rope.num_heads, rope.num_kv_heads, use_triton=True, out=y)
        return
    grid_n = triton.cdiv(N // 2, cfg.block_n // 2) if silu else triton.cdiv(N, cfg.block_n)
    grid_m = 1 if "gemv" in cfg.kind else triton.cdiv(M, cfg.block_m)
    kernel, extra = kernel_for(cfg, _is_16bit(x), G, x.is_cuda, K % cfg.block_k == 0, pdl_ok(x.device),
                               whole_zeros)
    if cfg.split_k == 1:
        part = y
    elif extra.get("ATOMIC"):
        part = _sums(x.device, M * N)
    else:
        part = torch.empty((cfg.split_k, M, N), dtype=torch.float32, device=x.device)
    counts = y if cfg.split_k == 1 else _counters(x.device, grid_m * grid_n)
    k_iters = triton.cdiv(K, cfg.block_k) // cfg.split_k
    args = [x, qweight, scales, scales if zeros is None else zeros, y if bias is None else bias,
            y if residual is None else residual, y, part, counts]
    sizes = [M, N, K, x.stride(0), y.stride(0), y.stride(0) if residual is None else residual.stride(0),
             cfg.split_k, k_iters]
    if rope is None:
        sizes += [y] * 5  # unread pointers
        rope_meta = dict(ROPE=False, R_H=1, R_HKV=1, R_HALF=1, R_PAGE=1)
    else:
        if cfg.block_n % rope.head_dim:
            raise ValueError(f"{cfg}: a RoPE epilogue needs tiles of whole heads (head dim {rope.head_dim})")
        sizes += [rope.positions, rope.inv_freq, rope.slot_mapping, rope.k_layer, rope.v_layer]
        rope_meta = dict(ROPE=True, R_H=rope.num_heads, R_HKV=rope.num_kv_heads, R_HALF=rope.head_dim // 2,
                         R_PAGE=rope.k_layer.shape[1])
    ahead = lookahead is not None and LOOKAHEAD_BYTES > 0 and x.is_cuda  # the prefetch is PTX: GPU builds only
    if ahead:
        q_lines, s_lines = lookahead_lines(*lookahead, LOOKAHEAD_BYTES)
        sizes += [lookahead[0], q_lines, lookahead[1], s_lines]
    else:
        sizes += [y, 0, y, 0]  # unread
    meta = dict(G=G, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, HAS_RES=residual is not None, SILU=silu,
                BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_SPLIT=cfg.split_k > 1, num_warps=cfg.num_warps,
                **rope_meta, LOOKAHEAD=ahead, **extra, **({"launch_pdl": True} if extra.get("USE_PDL") else {}))
    if cfg.kind == "hgemv":
        if M != 1 or G % cfg.block_k or K % cfg.block_k or not _is_16bit(x):
            raise ValueError(f"hgemv needs one 16-bit row and block_k dividing G and K: {tuple(x.shape)} {x.dtype}, "
                             f"G {G}, {cfg}")
        # per program: the split's f16x2 pairs (4 words per packed row) and one sum of x per tile
        scratch = torch.empty(grid_n * cfg.split_k * (k_iters * cfg.block_k // 2 + k_iters), dtype=torch.int32,
                              device=x.device)
        # num_stages: hgemv's DEPTH is its own (tiles in flight); Triton's pipeliner has nothing to do
        grid, call = (grid_n, cfg.split_k), [*args, scratch, *sizes]
        meta["num_stages"] = 1
    else:
        grid, call = (grid_m * grid_n, cfg.split_k), [*args, *sizes[:8], ONE_BITS, *sizes[8:]]
        meta.update(BLOCK_M=cfg.block_m, num_stages=cfg.num_stages)
    if warmup:
        kernel.warmup(*call, grid=grid, **meta)
    else:
        kernel[grid](*call, **meta)


def _num_sms(x: torch.Tensor) -> int:
    """SMs of x's GPU; an H100's / H200's count off the GPU (the interpreter), so CPU runs pick as those do."""
    return torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132


def _pick(x: torch.Tensor, N: int, G: int, key: tuple, silu: bool, run, head_dim: int = 0,
          weights: tuple = ()) -> KernelConfig:
    """The cached config for ``key``, else the fastest candidate (timed once, eagerly, on CUDA); with the tuner
    off (``set_autotune``) the first candidate, whatever was timed before. ``run(cfg)`` launches over the call's
    weight, ``run(cfg, w)`` over ``w``, a copy of ``weights`` (qweight, scales, zeros)."""
    if _autotune and key in _CONFIG_CACHE:
        return _CONFIG_CACHE[key]
    M, K = x.shape
    cands = _candidates(M, N, K, silu, _num_sms(x), G, _is_16bit(x), head_dim)
    if not (x.is_cuda and _autotune and len(cands) > 1):
        return cands[0]
    stored = _stored_pick(key, cands, x.device)
    if stored is not None:
        _CONFIG_CACHE[key] = stored
        PICKS["stored"] += 1
        return stored
    if torch.cuda.is_current_stream_capturing():
        return cands[0]  # no timing inside a graph capture: a later eager call tunes
    _precompile(run, cands)
    if chain_timed(M) and weights:
        try:
            times = _time_chain(run, cands, weights, x.device)
        except torch.cuda.OutOfMemoryError:  # the weight copies or a graph's pool did not fit: time them alone
            log.warning("INT4 chain tuning of %s ran out of memory; timing its candidates alone", key)
            torch.cuda.empty_cache()
            times = _time_configs(run, cands, x.device)
    else:
        times = _time_configs(run, cands, x.device)
    pick = _CONFIG_CACHE[key] = cands[times.index(min(times))]
    PICKS["timed"] += 1
    tune_file = _tune_file(x.device)
    if tune_file is not None:
        tune_file.put(_key_name(key), list(dataclasses.astuple(pick)))
    return pick


# Picks kept on disk across processes (kernels/tune_file.py): off until use_tune_file names a file (build_engine
# does on CUDA: the gateway's --int4-tune-file; bench/int4_ab.py and the kernel tests time afresh).
_TUNE_PATH: Path | None = None
PICKS = {"timed": 0, "stored": 0}  # this process's picks by where they came from (a bench's provenance)
_TUNE_FILES: dict[torch.device, TuneFile] = {}


def use_tune_file(path: str | os.PathLike | None) -> None:
    """Keep tuned picks in ``path`` and take stored ones from it (None: time every shape afresh, keep nothing)."""
    global _TUNE_PATH
    _TUNE_PATH = None if path is None else Path(path).expanduser()
    _TUNE_FILES.clear()


def tune_fingerprint(device: torch.device) -> str:
    """What a stored pick is valid under: the GPU, torch and Triton, this module's source (a kernel edit retunes),
    the tuner's mode and every INT4 / PDL switch in the environment."""
    props = torch.cuda.get_device_properties(device)
    source = hashlib.sha1(Path(__file__).read_bytes()).hexdigest()[:12]
    switches = ",".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                        if k.startswith(("SPECGATE_INT4_", "SPECGATE_PDL")))
    return (f"{props.name}, {props.multi_processor_count} SMs | torch {torch.__version__} | triton {triton.__version__}"
            f" | {source} | tune {TUNE} | {switches}")


def _tune_file(device: torch.device) -> TuneFile | None:
    if _TUNE_PATH is None:
        return None
    if device not in _TUNE_FILES:
        _TUNE_FILES[device] = TuneFile(_TUNE_PATH, tune_fingerprint(device))
    return _TUNE_FILES[device]


def _key_name(key: tuple) -> str:
    """A tuning key as the tune file names it (the device is the fingerprint's)."""
    m, n, k, g, dtype, zeros, whole, silu, head_dim, _device = key
    return (f"M{m} N{n} K{k} G{g} {str(dtype).removeprefix('torch.')} zeros={int(zeros)} whole={int(whole)} "
            f"silu={int(silu)} head_dim={head_dim}")


def _stored_pick(key: tuple, cands: list[KernelConfig], device: torch.device) -> KernelConfig | None:
    """The tune file's pick for ``key``, if one is stored and still among the candidates."""
    tune_file = _tune_file(device)
    fields = None if tune_file is None else tune_file.get(_key_name(key))
    if fields is None:
        return None
    try:
        cfg = KernelConfig(*fields)
    except TypeError:
        return None
    return cfg if cfg in cands else None


_TUNE_REPS = 15


def _precompile(run, cands: list[KernelConfig]) -> None:
    """Build the candidates' kernels at once on ``COMPILE_THREADS`` threads before the tuner launches them one by
    one: inside Triton's ``AsyncCompileMode`` a warm-up launch (``run(c, warmup=True)``) submits its build to the
    pool, and leaving the block waits for them all. Best effort: a build that fails here is dropped, and the
    tuner's own first launch builds (or leaves out, ``_buildable``) whatever is missing, as before."""
    todo = [c for c in cands if c.kind != "dequant"]
    if COMPILE_THREADS < 2 or len(todo) < 2:
        return
    try:
        from triton.runtime._async_compile import AsyncCompileMode  # Triton's own parallel-build hook (3.4+)
    except ImportError:
        return
    try:
        with ThreadPoolExecutor(min(COMPILE_THREADS, len(todo))) as pool, AsyncCompileMode(pool, ignore_errors=True):
            for c in todo:
                run(c, warmup=True)
    except Exception as e:  # noqa: BLE001 -- the one-by-one path after this is the one that must work
        log.warning("INT4 candidates not built in parallel (%s: %s); building them one by one",
                    type(e).__name__, str(e)[:200])


def _buildable(run, cands: list[KernelConfig]) -> list[KernelConfig]:
    """The candidates that compile and launch (twice: the first launch's one-time costs stay out of the
    timing). One that runs out of registers or shared memory on this GPU, or that ptxas rejects, is
    left out with a warning, as Triton's own autotuner does; any other error is a bug and propagates."""
    built = []
    for c in cands:
        try:
            run(c)
            run(c)
            built.append(c)
        except (OutOfResources, PTXASError, CompileTimeAssertionFailure) as e:
            log.warning("INT4 config %s left out: %s: %s", c, type(e).__name__, str(e)[:200])
    if not built:
        raise RuntimeError(f"no INT4 kernel config could be built for this shape: {cands}")
    return built


def _time_configs(run, cands: list[KernelConfig], device: torch.device) -> list[float]:
    """Median device milliseconds of each candidate, timed round-robin (drift hits all alike), each
    call after a 256 MB read that evicts the weights from L2.

    Not ``triton.testing.do_bench``: its flush zero-fills 256 MB, and the dirty lines that leaves in L2
    are written back during the timed call -- tens of MB of writes, more traffic than a 7 us GEMV's own.
    Which candidate absorbs the most of it varied from run to run, and the tuner picked the MMA path
    at M = 1 at ~1.4-1.5x hgemv's time (bench/results/norm_fold_ab.json). A read leaves clean lines, as
    the weight reads before a matmul in a forward do."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    built = _buildable(run, cands)
    events = {c: [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(_TUNE_REPS)] for c in built}
    for r in range(_TUNE_REPS):
        for c in built:
            flush.max()
            events[c][r][0].record()
            run(c)
            events[c][r][1].record()
    torch.cuda.synchronize(device)
    return [sorted(a.elapsed_time(b) for a, b in events[c])[_TUNE_REPS // 2] if c in events else float("inf")
            for c in cands]


def chain_timed(M: int) -> bool:
    """Whether the tuner times an M-row call's candidates chained in a graph (``TUNE``), not alone."""
    return TUNE == "chain" or (TUNE == "auto" and CHAIN_M[0] <= M <= CHAIN_M[1])


def chain_launches(weight_bytes: int, l2_bytes: int) -> int:
    """Launches in a chain-timing graph: enough weight copies to stream twice the L2, at least two."""
    return max(2, min(CHAIN_MAX_LAUNCHES, -(-2 * l2_bytes // max(weight_bytes, 1))))


def _time_chain(run, cands: list[KernelConfig], weights: tuple, device: torch.device,
                reps: int = 5) -> list[float]:
    """Device milliseconds per launch of each candidate, as a graphed forward runs it (``chain_timed``): one
    CUDA graph of back-to-back launches, each over its own copy of ``weights`` (so each reads HBM, not L2),
    replayed ``reps`` times; the median replay over the launches."""
    built = _buildable(run, cands)
    nbytes = sum(t.numel() * t.element_size() for t in weights if t is not None)
    n = chain_launches(nbytes, torch.cuda.get_device_properties(device).L2_cache_size)
    copies = [tuple(None if t is None else t.clone() for t in weights) for _ in range(n)]
    times = []
    for c in cands:
        if c not in built:
            times.append(float("inf"))
            continue
        graph = torch.cuda.CUDAGraph()
        # thread_local: a server thread's own CUDA calls meanwhile (an engine thread beside the gateway's) are
        # not this capture's business
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for w in copies:
                run(c, w)
        graph.replay()  # the first replay uploads the graph
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for a, b in events:
            a.record()
            graph.replay()
            b.record()
        torch.cuda.synchronize(device)
        times.append(sorted(a.elapsed_time(b) for a, b in events)[reps // 2] / n)
        del graph
    return times


def int4_matmul_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       group_size: int, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                       silu: bool = False, config: KernelConfig | None = None,
                       out: torch.Tensor | None = None, whole_zeros: bool = False,
                       rope: Rope | None = None,
                       lookahead: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x: [M, K], unit stride along K -> [M, N] (or [M, N // 2] = silu(gate) * up with ``silu``) in x's dtype.

    On CPU tensors this needs ``TRITON_INTERPRET=1`` before Triton is imported (tests). ``config``
    skips the choice (benchmarks); ``out`` receives the result. ``whole_zeros``: every zero point is a
    whole number (the caller knows; checking here would cost a device sync per call). ``rope``: the weight
    is a fused qkv projection, [H | Hkv | Hkv] heads of D columns; returns the rotated q ``[M, H D]`` and
    writes the rotated k and the v into ``rope``'s cache layers (a bias is added before the rotation; no residual
    or silu). ``lookahead``: the packed words and scales of the projection the caller runs next, for the
    programs to ask L2 for once their own weights are in (``SPECGATE_INT4_LOOKAHEAD``; ignored while it is 0).
    """
    M, K = x.shape
    N = qweight.shape[1]
    if qweight.shape[0] * 8 != K or scales.shape != (K // group_size, N) or (silu and N % 2):
        raise ValueError(f"x {tuple(x.shape)} does not match qweight {tuple(qweight.shape)} "
                         f"/ scales {tuple(scales.shape)}")
    if rope is not None:
        D = rope.head_dim
        if silu or residual is not None or N != (rope.num_heads + 2 * rope.num_kv_heads) * D:
            raise ValueError(f"a RoPE epilogue takes a qkv projection of {rope.num_heads} + 2 x {rope.num_kv_heads} "
                             f"heads of {D} ({(rope.num_heads + 2 * rope.num_kv_heads) * D} columns), no residual "
                             f"or silu: got N {N}")
        kv_shape = (rope.num_kv_heads, D)
        if (rope.k_layer.shape != rope.v_layer.shape or tuple(rope.k_layer.shape[2:]) != kv_shape
                or not (rope.k_layer.is_contiguous() and rope.v_layer.is_contiguous())
                or rope.k_layer.dtype != x.dtype or rope.v_layer.dtype != x.dtype):
            raise ValueError(f"RoPE cache layers must be contiguous {x.dtype} [blocks, page, {kv_shape[0]}, {D}]: "
                             f"{tuple(rope.k_layer.shape)} {rope.k_layer.dtype}, {tuple(rope.v_layer.shape)}")
    shape = (M, N // 2 if silu else N if rope is None else rope.num_heads * rope.head_dim)
    y = torch.empty(shape, dtype=x.dtype, device=x.device) if out is None else out
    if y.shape != shape or y.dtype != x.dtype or not y.is_contiguous():
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape {shape}, not {tuple(y.shape)} {y.dtype}")
    if M == 0:
        return y
    whole_zeros = whole_zeros or zeros is None  # symmetric codes: the zero point 8 is whole
    if invariant.enabled():  # one decode for a weight, whether a first call was looked at (eager) or not (a capture)
        whole_zeros = zeros is None
    run = lambda c, w=(qweight, scales, zeros), warmup=False: _launch(  # noqa: E731
        c, x, *w, group_size, bias, residual, silu, y, whole_zeros, rope, lookahead, warmup)
    head_dim = 0 if rope is None else rope.head_dim
    key = (triton.next_power_of_2(M), N, K, group_size, x.dtype, zeros is not None, whole_zeros, silu, head_dim,
           x.device)
    if config is not None and config.kind != "dequant" and triton.cdiv(K, config.block_k) % config.split_k:
        # k_iters = blocks // split_k: a split count that does not divide them would drop the last blocks
        raise ValueError(f"{config}: split_k must divide the {triton.cdiv(K, config.block_k)} K blocks of K={K}")
    if config is None and invariant.enabled():
        config = invariant_config(N, K, silu, _num_sms(x), head_dim)
    run(config or _pick(x, N, group_size, key, silu, run, head_dim, (qweight, scales, zeros)))
    return y


def dequantize_triton(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """[K // 8, N] packed -> [K, N] (the transpose of ``dequantize``'s [N, K]) in ``dtype``."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    w = torch.empty((K, N), dtype=dtype, device=qweight.device)
    _int4_dequant_kernel[(triton.cdiv(N, 128), triton.cdiv(K, 64))](
        qweight, scales, scales if zeros is None else zeros, w, N, K, ONE_BITS,
        G=group_size, HAS_ZEROS=zeros is not None, BLOCK_N=128, BLOCK_K=64, num_warps=4,
    )
    return w
