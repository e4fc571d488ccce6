"""target/batch.py: the packed fields of a forward batch."""

from __future__ import annotations

import pytest
import torch

from target.batch import Segment, build_batch
from target.kv_cache import KVCache


@pytest.mark.parametrize("lens", [[1], [3, 1, 5], [2, 7, 1, 1, 4], [17] * 3])
def test_fields_hold_the_segments_and_start_16_byte_aligned(lens: list[int]) -> None:
    """Every field is its own slice of one buffer per dtype, at a 16-element boundary whatever the batch:
    Triton specialises kernels on pointer alignment, so a batch-dependent offset would mean new compiles."""
    cache = KVCache(num_layers=1, num_blocks=32, page_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                    device="cpu")
    tables = [cache.new_table() for _ in lens]
    for i, t in enumerate(tables):  # contexts of different lengths: tables of different widths
        t.ensure(3 * i + 1)
    segs = [Segment(t, 3 * i + 1, [10 * i + j for j in range(n)], mask_bits=[1] * n if i % 2 else None,
                    logits="all" if i % 2 else "last") for i, (t, n) in enumerate(zip(tables, lens))]
    b = build_batch(segs, cache, "cpu")
    assert b.tokens.tolist() == [10 * i + j for i, n in enumerate(lens) for j in range(n)]
    assert b.positions.tolist() == [3 * i + 1 + j for i, n in enumerate(lens) for j in range(n)]
    assert b.slot_mapping.tolist() == [s for i, (t, n) in enumerate(zip(tables, lens))
                                       for s in t.slots(3 * i + 1, 3 * i + 1 + n)]
    assert b.context_lens.tolist() == [3 * i + 1 for i in range(len(lens))]
    assert b.query_start.tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]
    assert b.logits_indices.tolist() == list(b.logits_rows)
    for i, t in enumerate(tables):
        assert b.block_tables[i, : len(t.blocks)].tolist() == t.blocks
        assert b.block_tables[i, len(t.blocks):].eq(0).all()
    assert (b.mask_bits is None) == (len(lens) == 1)  # only odd segments bring a mask
    fields = [b.tokens, b.positions, b.slot_mapping, b.logits_indices, b.context_lens, b.query_start,
              b.block_tables] + ([b.mask_bits] if b.mask_bits is not None else [])
    assert all(f.data_ptr() % 16 == 0 and f.is_contiguous() for f in fields)
