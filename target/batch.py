"""Flattening a ragged batch of segments (prefill chunks, trees, catch-up chunks) into one forward.

A ``Segment`` is one sequence's new tokens for this forward: they are written at slots
``context_len + i`` of the sequence's block table and attend to the cached prefix ``[0, context_len)``
plus each other through ``mask_bits`` (0 = causal). ``positions`` default to ``context_len + i``;
trees pass ``context_len + depth``.
"""

from __future__ import annotations

import array
import os
from dataclasses import dataclass

import torch

from kernels.chain_inputs import chain_inputs
from target.kv_cache import BlockTable, KVCache, NoFreeBlocks
from target.transfer import to_device


@dataclass(slots=True)
class Segment:
    table: BlockTable
    context_len: int  # tokens already cached for this sequence
    tokens: list[int]  # new tokens
    positions: list[int] | None = None  # RoPE positions; None = context_len + i
    mask_bits: list[int] | None = None  # ancestor bitmask per token; None = causal
    logits: str = "last"  # which tokens need logits: "last", "all" or "none"
    # (first, tokens, bits): the tokens and mask bits of the segment's tokens first..first+m-1, [m] int64 each,
    # on the device (a deferred tree's nodes: draft/tree.py ``TokenTree.deferred``); ``tokens`` and
    # ``mask_bits`` hold placeholders there.
    device_nodes: tuple[int, torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class ForwardBatch:
    """Device tensors for one forward. T = total new tokens, B = segments, R = rows needing logits."""

    tokens: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64 flat cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32
    query_start: torch.Tensor  # [B + 1] int32
    mask_bits: torch.Tensor | None  # [T] int64, None when every segment is causal
    logits_indices: torch.Tensor  # [R] int64 rows of the hidden state that get logits
    logits_start: list[int]  # [B + 1] where each segment's logits rows begin
    is_decode: bool = False  # every segment has exactly one new token: the decode kernel applies
    query_lens: tuple[int, ...] = ()  # host copy of each segment's new-token count
    logits_rows: tuple[int, ...] = ()  # host copy of logits_indices

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]


def build_batch(segments: list[Segment], cache: KVCache, device: torch.device | str) -> ForwardBatch:
    """Reserve slots (allocating blocks, copy-on-write) and pack ``segments`` into tensors.

    Mutates the segments' block tables: on return each holds ``context_len + len(tokens)`` slots.
    Raises ``NoFreeBlocks`` before changing any table when the pool cannot hold them all.
    """
    need = sum(s.table.blocks_needed(s.context_len + len(s.tokens)) for s in segments)
    if need > cache.pool.num_free:
        raise NoFreeBlocks(f"forward needs {need} new KV blocks, {cache.pool.num_free} free")
    tokens, positions, slots, bits, logit_rows = [], [], [], [], []
    query_start, logits_start = [0], [0]
    any_bits = any(s.mask_bits is not None for s in segments)
    tails: list[torch.Tensor] = []  # device nodes, tokens then bits of each segment's
    tail_rows: list[int] = []  # the rows they go to
    P = cache.pool.page_size
    refcount = cache.pool.refcount
    for s in segments:
        n, ctx, table = len(s.tokens), s.context_len, s.table
        end = ctx + n
        base = query_start[-1]
        if (n == 1 and s.logits in ("all", "last") and s.positions is None and s.mask_bits is None
                and s.device_nodes is None and not any_bits):
            # a plain decode's one token (most segments of a busy step): its slot, without the general calls
            blocks = table.blocks
            if ctx // P >= len(blocks):
                table.ensure(end)
            elif refcount(blocks[ctx // P]) > 1:
                cache.make_writable(table, ctx, end)
            tokens.append(s.tokens[0])
            positions.append(ctx)
            slots.append(blocks[ctx // P] * P + ctx % P)
            logit_rows.append(base)
            query_start.append(base + 1)
            logits_start.append(len(logit_rows))
            continue
        table.ensure(end)
        cache.make_writable(table, ctx, end)
        if s.device_nodes is not None:
            first, dev_tokens, dev_bits = s.device_nodes
            tails += (dev_tokens, dev_bits)
            tail_rows += range(base + first, base + first + dev_tokens.shape[0])
        tokens += s.tokens
        positions += s.positions if s.positions is not None else range(ctx, end)
        slots += table.slots(ctx, end)
        if any_bits:  # a batch of causal segments packs no bits at all
            bits += s.mask_bits if s.mask_bits is not None else [0] * n
        if s.logits == "all":
            logit_rows += range(base, base + n)
        elif s.logits == "last" and n:
            logit_rows.append(base + n - 1)
        elif s.logits not in ("last", "none"):
            raise ValueError(f"Segment.logits must be 'all', 'last' or 'none', got {s.logits!r}")
        query_start.append(base + n)
        logits_start.append(len(logit_rows))
    max_blocks = max((len(s.table.blocks) for s in segments), default=0) or 1
    # Two host->device copies per forward (one int64, one int32 buffer), sliced into the fields: a copy
    # costs the host microseconds each, and a step builds several batches. Every field starts on a
    # 16-element boundary: Triton specialises kernels on 16-byte pointer alignment, and fields at
    # batch-dependent offsets would compile new variants mid-serving.
    T, R, B = len(tokens), len(logit_rows), len(segments)
    wide, at64 = _packed([tokens, positions, slots, bits, logit_rows], torch.int64, device)
    rows = array.array("i")  # the tables' rows, copied as memory (BlockTable.blocks is an array('i'))
    pad = array.array("i", [0]) * max_blocks
    for seg in segments:
        rows += seg.table.blocks
        rows += pad[len(seg.table.blocks):]
    narrow, at32 = _packed([[s.context_len for s in segments], query_start, rows,
                            [r + at64[0] for r in tail_rows] + [r + at64[3] for r in tail_rows]], torch.int32, device)
    if tails:  # the device nodes into their rows: one gather of the pieces, one indexed write
        pieces = tails[0::2] + tails[1::2]  # every segment's tokens, then every segment's bits: the index's order
        wide[narrow[at32[3] : at32[3] + 2 * len(tail_rows)]] = torch.cat(pieces)
    return ForwardBatch(
        tokens=wide[at64[0] : at64[0] + T],
        positions=wide[at64[1] : at64[1] + T],
        slot_mapping=wide[at64[2] : at64[2] + T],
        block_tables=narrow[at32[2] : at32[2] + B * max_blocks].view(B, max_blocks),
        context_lens=narrow[at32[0] : at32[0] + B],
        query_start=narrow[at32[1] : at32[1] + B + 1],
        mask_bits=wide[at64[3] : at64[3] + T] if any_bits else None,
        logits_indices=wide[at64[4] : at64[4] + R],
        logits_start=logits_start,
        is_decode=all(len(s.tokens) == 1 for s in segments),
        query_lens=tuple(len(s.tokens) for s in segments),
        logits_rows=tuple(logit_rows),
    )


# SPECGATE_CHAIN_INPUTS=ops: ``place_chains`` as torch ops (~14 launches) instead of one kernel (A/B).
FUSED_CHAIN_INPUTS = os.environ.get("SPECGATE_CHAIN_INPUTS", "kernel") != "ops"


def place_chains(batch: ForwardBatch, first_row: int, first_segment: int, hist: torch.Tensor, lens: torch.Tensor,
                 drafts: torch.Tensor, advance: torch.Tensor | None, row_seq: torch.Tensor, row_at: torch.Tensor,
                 page: int) -> None:
    """A packed batch's chain segments (from row ``first_row``, segment ``first_segment``, packed as though
    nothing were pending) moved on by a pending step's ``advance`` per chain and given their tokens, on the
    device: each chain's root from its row of ``hist`` (``lens`` long), its drafts from ``drafts``
    (kernels/chain_inputs.py; ``row_seq`` / ``row_at``: each row's chain and node). gateway/chain_ahead.py's."""
    chain_inputs(batch.tokens[first_row:], batch.positions[first_row:], batch.slot_mapping[first_row:],
                 batch.context_lens[first_segment:], batch.block_tables[first_segment:], hist, lens, drafts, advance,
                 row_seq, row_at, page, use_triton=None if FUSED_CHAIN_INPUTS else False)


_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def _packed(fields: list, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, list[int]]:
    """One device tensor holding every field (lists of ints, or arrays of the dtype's typecode), each
    starting at a multiple of 16 elements; and the starts.

    The fields go through ``array.array``: ``torch.tensor`` converts a Python list at ~140-190 ns per
    int, the array at ~60 (a 64-sequence decode packs ~1,800 ints per forward), and an array field of the
    same typecode is copied as memory."""
    code = _TYPECODES[dtype]
    flat = array.array(code)
    zeros = array.array(code, [0]) * 16
    starts = []
    for f in fields:
        starts.append(len(flat))
        flat += f if isinstance(f, array.array) else array.array(code, f)
        flat += zeros[: -len(flat) % 16]
    if not flat:
        return torch.empty(0, dtype=dtype, device=device), starts
    return to_device(torch.frombuffer(flat, dtype=dtype), device), starts
