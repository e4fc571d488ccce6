"""A CUDA graph's static inputs loaded from a step's batch in one launch.

A replay starts by copying the step's batch into the graph's static inputs: its rows first, then padding rows
(token 0, position 0, K/V to the scratch block, mask bits 1), its segments' context lengths and block tables
padded with empty segments and the scratch block, and for ragged graphs the segment offsets (the dummy
segment takes the rows left). As torch ops that is 11 (decode) to 15 (ragged) launches, each a few
microseconds of host time before the graph can run: 70 / 127 us of a 1 ms step on a lent H100's host
(bench/results/verify_host2_h100.json). One kernel writes them all here; ``load_reference`` is the same as
torch ops (the CPU path, and what the tests compare against). ``load_tree_inputs`` does the same for the draft
tree loop's graphs (draft/tree_loop.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 1024


# Sizes change every step: specialised on them (==1, multiples of 16), the kernel would build new variants
# mid-serving.
@triton.jit(do_not_specialize=["bt_stride", "T", "B", "COLS", "T_G", "B_G", "MAXB", "pad_slot", "scratch"])
def _load_kernel(tok_src, pos_src, slot_src, bits_src, ctx_src, qs_src, bt_src, bt_stride,
                 tok_dst, pos_dst, slot_dst, bits_dst, ctx_dst, qs_dst, bt_dst,
                 T, B, COLS, T_G, B_G, MAXB, pad_slot, scratch,
                 HAS_BITS: tl.constexpr, RAGGED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # rows: the batch's T, then padding up to the graph's T_G
    row = offs < T_G
    real = offs < T
    tl.store(tok_dst + offs, tl.load(tok_src + offs, mask=real, other=0), mask=row)
    tl.store(pos_dst + offs, tl.load(pos_src + offs, mask=real, other=0), mask=row)
    tl.store(slot_dst + offs, tl.load(slot_src + offs, mask=real, other=pad_slot), mask=row)
    if RAGGED:
        if HAS_BITS:
            bits = tl.load(bits_src + offs, mask=real, other=1)  # padding sees its segment's first row only
        else:
            bits = tl.where(real, 0, 1).to(tl.int64)  # 0 = causal
        tl.store(bits_dst + offs, bits, mask=row)
        # segment offsets: the batch's B + 1, then T_G (the dummy segment B holds rows T..T_G; any after it none)
        qs = tl.load(qs_src + offs, mask=offs <= B, other=T_G)
        tl.store(qs_dst + offs, qs, mask=offs <= B_G)
    tl.store(ctx_dst + offs, tl.load(ctx_src + offs, mask=offs < B, other=0), mask=offs < B_G)
    # block tables [B_G, MAXB]: the batch's [B, COLS], the scratch block everywhere else
    r, c = offs // MAXB, offs % MAXB
    bt = tl.load(bt_src + r * bt_stride + c, mask=(r < B) & (c < COLS), other=scratch)
    tl.store(bt_dst + offs, bt, mask=offs < B_G * MAXB)


def _extent(T_G: int, B_G: int, maxb: int) -> int:
    return max(T_G, B_G + 1, B_G * maxb)


def load_inputs(dst, batch, scratch: int, page_size: int) -> None:
    """Write ``batch`` (a ``ForwardBatch``) into ``dst``'s static inputs (a ``target.graphs._Graph``) in one
    launch. ``dst.mask_bits`` is None for decode graphs, whose segment offsets are static."""
    T, B = batch.num_tokens, len(batch.query_lens)
    bt = batch.block_tables
    if bt.stride(1) != 1:
        bt = bt.contiguous()
    ragged = dst.mask_bits is not None
    bits = batch.mask_bits if ragged and batch.mask_bits is not None else batch.tokens
    maxb = dst.block_tables.shape[1]
    grid = (triton.cdiv(_extent(dst.T, dst.B, maxb), BLOCK),)
    _load_kernel[grid](batch.tokens, batch.positions, batch.slot_mapping, bits, batch.context_lens,
                       batch.query_start, bt, bt.stride(0),
                       dst.tokens, dst.positions, dst.slot_mapping, dst.mask_bits if ragged else dst.tokens,
                       dst.context_lens, dst.query_start, dst.block_tables,
                       T, B, bt.shape[1], dst.T, dst.B, maxb, scratch * page_size, scratch,
                       HAS_BITS=ragged and batch.mask_bits is not None, RAGGED=ragged, BLOCK=BLOCK)


def load_reference(dst, batch, scratch: int, page_size: int) -> None:
    """``load_inputs`` as torch ops."""
    T, B = batch.num_tokens, len(batch.query_lens)
    dst.tokens[:T].copy_(batch.tokens)
    dst.positions[:T].copy_(batch.positions)
    dst.slot_mapping[:T].copy_(batch.slot_mapping)
    dst.tokens[T:].zero_()
    dst.positions[T:].zero_()
    dst.slot_mapping[T:].fill_(scratch * page_size)
    if dst.mask_bits is not None:
        if batch.mask_bits is not None:
            dst.mask_bits[:T].copy_(batch.mask_bits)
        else:
            dst.mask_bits[:T].zero_()  # 0 = causal
        dst.mask_bits[T:].fill_(1)  # padding sees its segment's first row only: finite, and unused
        dst.query_start[: B + 1].copy_(batch.query_start)
        dst.query_start[B + 1 :].fill_(dst.T)  # the dummy segment B: rows T..dst.T; any after it: none
    dst.context_lens[:B].copy_(batch.context_lens)
    dst.context_lens[B:].zero_()
    cols = batch.block_tables.shape[1]
    dst.block_tables[:B, :cols].copy_(batch.block_tables)
    dst.block_tables[:B, cols:].fill_(scratch)
    dst.block_tables[B:].fill_(scratch)


# The draft tree loop's graphs (draft/tree_loop.py): each replay's roots, node slots and block tables, padded
# to the graph's batch bucket (root position -1, slots and blocks in the scratch block), in one launch where
# they took seven torch copies and fills.
@triton.jit(do_not_specialize=["G", "NS", "COLS", "B_G", "MAXB", "slot_s0", "slot_s1", "bt_stride", "pad_slot",
                               "scratch"])
def _tree_load_kernel(ctx_src, slot_src, slot_s0, slot_s1, bt_src, bt_stride, ctx_dst, slot_dst, bt_dst,
                      G, NS, COLS, B_G, MAXB, pad_slot, scratch, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ctx_dst + offs, tl.load(ctx_src + offs, mask=offs < G, other=-1), mask=offs < B_G)
    r, c = offs // NS, offs % NS  # slots [B_G, NS]
    s = tl.load(slot_src + r * slot_s0 + c * slot_s1, mask=r < G, other=pad_slot)
    tl.store(slot_dst + offs, s, mask=offs < B_G * NS)
    r, c = offs // MAXB, offs % MAXB  # block tables [B_G, MAXB]
    bt = tl.load(bt_src + r * bt_stride + c, mask=(r < G) & (c < COLS), other=scratch)
    tl.store(bt_dst + offs, bt, mask=offs < B_G * MAXB)


def load_tree_inputs(dst, ctx, slots, block_tables, scratch: int, page_size: int) -> None:
    """The tree loop's static ``dst`` (``ctx`` [B], ``slots`` [B, N - 1], ``block_tables`` [B, max_blocks])
    from ``G <= B`` sequences' ``ctx`` [G], ``slots`` [G, N - 1] (any strides) and ``block_tables`` [G, cols]."""
    G, NS = slots.shape
    B, maxb = dst.block_tables.shape
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    grid = (triton.cdiv(max(B * NS, B * maxb, B), BLOCK),)
    _tree_load_kernel[grid](ctx, slots, slots.stride(0), slots.stride(1), block_tables, block_tables.stride(0),
                            dst.ctx, dst.slots, dst.block_tables, G, NS, block_tables.shape[1], B, maxb,
                            scratch * page_size, scratch, BLOCK=BLOCK)


def load_tree_reference(dst, ctx, slots, block_tables, scratch: int, page_size: int) -> None:
    """``load_tree_inputs`` as torch ops."""
    G, cols = block_tables.shape
    dst.ctx[:G].copy_(ctx)
    dst.ctx[G:].fill_(-1)
    dst.slots[:G].copy_(slots)
    dst.slots[G:].fill_(scratch * page_size)
    dst.block_tables[:G, :cols].copy_(block_tables)
    dst.block_tables[:G, cols:].fill_(scratch)
    dst.block_tables[G:].fill_(scratch)
