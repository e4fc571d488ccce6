"""A chain step's inputs on the device, in one launch (gateway/chain_ahead.py).

The host packs a chain step's batch (target/batch.py) as though nothing were pending: each chain's rows at
positions ``num_cached + i``, its slots from those, its tokens placeholders. The pending step's outcome lives on
the device, so this pass fixes the chain rows there, before the forward: every row of chain ``b`` moves
``advance[b]`` positions on (its context length too), takes the slot of its new position from the block
table, and takes its token: the chain's root (the last token of the chain's row of ``hist``) at node 0, its
draft ``drafts[b, i - 1]`` at node ``i``. The torch form is ~14 launches a step; the kernel is one, one program
per block of rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def chain_inputs_ref(tokens: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                     context_lens: torch.Tensor, block_tables: torch.Tensor, hist: torch.Tensor, lens: torch.Tensor,
                     drafts: torch.Tensor, advance: torch.Tensor | None, row_seq: torch.Tensor, row_at: torch.Tensor,
                     page: int) -> None:
    """In place. ``tokens``, ``positions``, ``slot_mapping`` [T] int64 and ``context_lens`` [B] int32 are the
    chain rows' and chains' slices of the batch; ``block_tables`` [B, cols] int32 the chains' rows; ``hist``
    [B, cap] int64 with ``lens`` [B]; ``drafts`` [B, K]; ``advance`` [B] int64 or None (nothing pending);
    ``row_seq``, ``row_at`` [T] int64: each row's chain and node."""
    if advance is not None:
        positions += advance[row_seq]
        context_lens += advance.to(context_lens.dtype)
        blocks = block_tables[row_seq, positions // page].to(torch.int64)
        slot_mapping.copy_(blocks * page + positions % page)
    root = hist.gather(1, (lens - 1)[:, None])  # [B, 1]
    tokens.copy_(torch.cat([root, drafts], 1)[row_seq, row_at])


@triton.jit(do_not_specialize=["T", "hist_stride", "drafts_stride", "bt_stride"])
def _chain_inputs_kernel(tokens_ptr, positions_ptr, slots_ptr, ctx_ptr, bt_ptr, hist_ptr, lens_ptr, drafts_ptr,
                         advance_ptr, row_seq_ptr, row_at_ptr, T, hist_stride, drafts_stride, bt_stride,
                         PAGE: tl.constexpr, AHEAD: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < T
    b = tl.load(row_seq_ptr + r, mask=ok, other=0)
    i = tl.load(row_at_ptr + r, mask=ok, other=0)
    if AHEAD:
        adv = tl.load(advance_ptr + b, mask=ok, other=0)
        pos = tl.load(positions_ptr + r, mask=ok, other=0) + adv
        tl.store(positions_ptr + r, pos, mask=ok)
        block = tl.load(bt_ptr + b * bt_stride + pos // PAGE, mask=ok, other=0).to(tl.int64)
        tl.store(slots_ptr + r, block * PAGE + pos % PAGE, mask=ok)
        root = ok & (i == 0)  # one row a chain moves its context length
        ctx = tl.load(ctx_ptr + b, mask=root, other=0)
        tl.store(ctx_ptr + b, ctx + adv.to(ctx.dtype), mask=root)
    n = tl.load(lens_ptr + b, mask=ok, other=1)
    root_tok = tl.load(hist_ptr + b * hist_stride + n - 1, mask=ok & (i == 0), other=0)
    draft = tl.load(drafts_ptr + b * drafts_stride + i - 1, mask=ok & (i > 0), other=0)
    tl.store(tokens_ptr + r, tl.where(i == 0, root_tok, draft), mask=ok)


def chain_inputs(tokens: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, context_lens: torch.Tensor,
                 block_tables: torch.Tensor, hist: torch.Tensor, lens: torch.Tensor, drafts: torch.Tensor,
                 advance: torch.Tensor | None, row_seq: torch.Tensor, row_at: torch.Tensor, page: int, *,
                 use_triton: bool | None = None, block: int = 128) -> None:
    """Dispatch: the kernel on CUDA (or when forced: CPU tensors need TRITON_INTERPRET=1), the reference
    elsewhere. Same contract as ``chain_inputs_ref``."""
    if not (tokens.is_cuda if use_triton is None else use_triton):
        return chain_inputs_ref(tokens, positions, slot_mapping, context_lens, block_tables, hist, lens, drafts,
                                advance, row_seq, row_at, page)
    for name, t in (("tokens", tokens), ("positions", positions), ("slot_mapping", slot_mapping),
                    ("context_lens", context_lens), ("lens", lens), ("row_seq", row_seq), ("row_at", row_at)):
        if t.dim() != 1 or t.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous vector, got shape {tuple(t.shape)}")
    if block_tables.stride(1) != 1 or hist.stride(1) != 1 or drafts.stride(1) != 1:
        raise ValueError("block_tables, hist and drafts need unit column strides")
    T = tokens.shape[0]
    if T:
        _chain_inputs_kernel[(triton.cdiv(T, block),)](
            tokens, positions, slot_mapping, context_lens, block_tables, hist, lens, drafts,
            lens if advance is None else advance, row_seq, row_at, T, hist.stride(0), drafts.stride(0),
            block_tables.stride(0), PAGE=page, AHEAD=advance is not None, BLOCK=block, num_warps=4)
