"""KV compaction after acceptance: move the accepted tree nodes' K/V into their final slots.

A tree node ``i`` of a sequence with ``ctx`` cached tokens is scored at slot ``ctx + i`` but belongs at
slot ``ctx + depth(i)`` once accepted. One call moves every accepted node of every sequence, across all
layers, for K and V.

Move-list invariant (the engine guarantees it, the kernel relies on it): within one sequence the moves
are sorted by source slot, ``dst <= src``, and destinations strictly increase. Then moving in list
order never overwrites a source that a later move still has to read. Different sequences never share
a slot.

Kernel: one launch covers every layer and both caches. Program ``(layer, column chunk)`` owns a strip
of ``Hkv * D`` columns and walks the move list in batches: it loads a batch's sources, waits at a
barrier, then stores the batch. Under the invariant no move reads a slot that an earlier move wrote
(``dst_a <= src_a < src_b``), so only reads-before-writes inside a batch need ordering, and the barrier
gives it. Moves with ``src == dst`` are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import dispatch


def compact_kv_ref(
    k_cache: torch.Tensor,  # [L, num_blocks, P, Hkv, D], mutated
    v_cache: torch.Tensor,  # [L, num_blocks, P, Hkv, D], mutated
    src_slots: torch.Tensor,  # [M] int64 flat slot ids (block * P + offset)
    dst_slots: torch.Tensor,  # [M] int64
) -> None:
    """Copy slot ``src_slots[m]`` to ``dst_slots[m]`` in every layer of both caches, in place."""
    if src_slots.numel() == 0:
        return
    for cache in (k_cache, v_cache):
        flat = cache.view(cache.shape[0], -1, *cache.shape[3:])  # [L, S, Hkv, D]
        flat[:, dst_slots] = flat[:, src_slots].clone()  # gather all sources first: safe for any order


# The move count changes every step: not specialised on (1, a multiple of 16 and other would each compile a
# variant, mid-serving). It bounds a loop and masks; it never feeds a vectorised address.
@triton.jit(do_not_specialize=["num_moves"])
def _compact_kv_kernel(
    k_ptr, v_ptr, src_ptr, dst_ptr,
    num_moves,
    stride_l, stride_b, stride_p, stride_h,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    layer = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # columns of the flattened [Hkv, D] row
    c_mask = offs_c < NUM_COLS
    col_off = (offs_c // HEAD_DIM) * stride_h + offs_c % HEAD_DIM  # [BLOCK_C]
    k_base = k_ptr + layer.to(tl.int64) * stride_l
    v_base = v_ptr + layer.to(tl.int64) * stride_l
    for m0 in range(0, num_moves, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        src = tl.load(src_ptr + offs_m, mask=offs_m < num_moves, other=0)  # [BLOCK_M] int64
        dst = tl.load(dst_ptr + offs_m, mask=offs_m < num_moves, other=0)
        mask = ((offs_m < num_moves) & (src != dst))[:, None] & c_mask[None, :]  # [BLOCK_M, BLOCK_C]
        src_off = ((src // PAGE) * stride_b + (src % PAGE) * stride_p)[:, None] + col_off[None, :]
        dst_off = ((dst // PAGE) * stride_b + (dst % PAGE) * stride_p)[:, None] + col_off[None, :]
        k = tl.load(k_base + src_off, mask=mask)
        v = tl.load(v_base + src_off, mask=mask)
        tl.debug_barrier()  # a destination here may be another move's source in this same batch
        tl.store(k_base + dst_off, k, mask=mask)
        tl.store(v_base + dst_off, v, mask=mask)


def compact_kv(
    k_cache: torch.Tensor,  # [L, num_blocks, P, Hkv, D], mutated
    v_cache: torch.Tensor,  # [L, num_blocks, P, Hkv, D], mutated
    src_slots: torch.Tensor,  # [M] int64
    dst_slots: torch.Tensor,  # [M] int64
    *,
    use_triton: bool | None = None,
    block_m: int = 32,
    block_c: int = 128,
) -> None:
    """Dispatch: the Triton kernel on CUDA (or when forced), the reference elsewhere."""
    if not dispatch.use_triton(k_cache, use_triton):
        return compact_kv_ref(k_cache, v_cache, src_slots, dst_slots)
    L, _, P, Hkv, D = k_cache.shape
    if (v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1
            or src_slots.shape != dst_slots.shape or src_slots.dim() != 1):
        raise ValueError(f"bad shapes: cache {tuple(k_cache.shape)}, moves {tuple(src_slots.shape)}")
    M = src_slots.shape[0]
    if M == 0:
        return
    s_l, s_b, s_p, s_h, _ = k_cache.stride()
    _compact_kv_kernel[(L, triton.cdiv(Hkv * D, block_c))](
        k_cache, v_cache, src_slots, dst_slots, M, s_l, s_b, s_p, s_h,
        PAGE=P, HEAD_DIM=D, NUM_COLS=Hkv * D, BLOCK_M=block_m, BLOCK_C=block_c, num_warps=4)
