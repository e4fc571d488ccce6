"""graph_inputs: a graph's static inputs written in one launch, against the torch ops they replace, on batches
from ``build_batch`` (decode, ragged with and without tree bits, partial and full block tables) loaded
into graphs whose every input starts poisoned."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.graph_inputs import load_inputs, load_reference
from target.batch import Segment, build_batch
from target.graphs import _Graph
from target.kv_cache import KVCache

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE = 4
FIELDS = ("tokens", "positions", "slot_mapping", "mask_bits", "context_lens", "query_start", "block_tables")


def _batch(seed: int, lens: list[int], tree: bool):
    """Segments of ``lens`` new tokens over random cached prefixes; with ``tree``, random ancestor bits on
    the longer ones (the others causal)."""
    rng = random.Random(seed)
    cache = KVCache(1, 64, PAGE, 1, 8, torch.float32, DEVICE)
    segs = []
    for n in lens:
        t, ctx = cache.new_table(), rng.randrange(0, 23)
        t.ensure(ctx)
        bits = [rng.randrange(1, 1 << 20) for _ in range(n)] if tree and n > 1 else None
        segs.append(Segment(t, ctx, [rng.randrange(1000) for _ in range(n)],
                            positions=[ctx + rng.randrange(n) for _ in range(n)], mask_bits=bits, logits="all"))
    return build_batch(segs, cache, DEVICE), cache.scratch_block


def _poisoned(B: int, T: int, decode: bool, max_blocks: int) -> _Graph:
    g = _Graph(B, T, decode, max_blocks, DEVICE)
    for name in FIELDS:
        t = getattr(g, name)
        if t is not None and not (decode and name == "query_start"):  # a decode graph's offsets are static
            t.fill_(-7)
    return g


@pytest.mark.parametrize("case", [
    ("decode", [1, 1, 1], 4, 4, True, False),
    ("decode, full bucket", [1] * 8, 8, 8, True, False),
    ("ragged causal", [3, 1, 5], 4, 16, False, False),
    ("ragged tree", [4, 1, 1, 6], 8, 16, False, True),
    ("ragged, rows fit exactly", [2, 2, 2, 2], 4, 8, False, True),
    ("one segment", [7], 2, 8, False, True),
], ids=lambda c: c[0])
def test_one_launch_matches_the_torch_ops(case) -> None:
    _, lens, B, T, decode, tree = case
    for seed in range(3):  # fresh batches each time
        batch, scratch = _batch(seed, lens, tree)
        maxb = batch.block_tables.shape[1] + 3  # the graph's tables are wider than the batch's
        got, want = _poisoned(B, T, decode, maxb), _poisoned(B, T, decode, maxb)
        load_inputs(got, batch, scratch, PAGE)
        load_reference(want, batch, scratch, PAGE)
        for name in FIELDS:
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert torch.equal(a, b), (name, a.tolist(), b.tolist())
        assert not got.block_tables.eq(-7).any() and not got.tokens.eq(-7).any()  # nothing left unwritten


def test_the_reference_pads_as_the_graph_layout_says() -> None:
    """What the kernel is checked against: the padding rows and segments of a ragged load."""
    batch, scratch = _batch(0, [3, 1], tree=True)
    g = _poisoned(4, 8, False, batch.block_tables.shape[1] + 2)
    load_reference(g, batch, scratch, PAGE)
    assert g.tokens[4:].eq(0).all() and g.positions[4:].eq(0).all()
    assert g.slot_mapping[4:].eq(scratch * PAGE).all() and g.mask_bits[4:].eq(1).all()
    assert g.mask_bits[3] == 0  # the one-token segment is causal
    assert g.query_start.tolist() == [0, 3, 4, 8, 8] and g.context_lens[2:].eq(0).all()
    assert g.block_tables[2:].eq(scratch).all() and g.block_tables[:2, -2:].eq(scratch).all()


@pytest.mark.parametrize("G,B,N,cols,maxb", [(3, 4, 7, 2, 5), (4, 4, 2, 5, 5), (1, 8, 16, 1, 3)])
def test_tree_loop_load_matches_the_torch_ops(G: int, B: int, N: int, cols: int, maxb: int) -> None:
    """The tree loop's roots, node slots (a transposed view, as its ``_prepare`` hands them over) and block
    tables, padded to the graph's bucket."""
    from types import SimpleNamespace

    from kernels.graph_inputs import load_tree_inputs, load_tree_reference

    gen = torch.Generator().manual_seed(G * 100 + N)
    host = torch.randint(0, 5000, (N, G), generator=gen).to(DEVICE)  # row 0 the roots, rows 1.. the slots
    ctx, slots = host[0], host[1:].T  # [G], [G, N - 1] with strides (1, G)
    bt = torch.randint(0, 60, (G, cols), generator=gen, dtype=torch.int32).to(DEVICE)

    def poisoned():
        return SimpleNamespace(ctx=torch.full((B,), -7, dtype=torch.int64, device=DEVICE),
                               slots=torch.full((B, N - 1), -7, dtype=torch.int64, device=DEVICE),
                               block_tables=torch.full((B, maxb), -7, dtype=torch.int32, device=DEVICE))

    got, want = poisoned(), poisoned()
    load_tree_inputs(got, ctx, slots, bt, 63, 16)
    load_tree_reference(want, ctx, slots, bt, 63, 16)
    for name in ("ctx", "slots", "block_tables"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.ctx[G:].eq(-1).all() and got.slots[G:].eq(63 * 16).all() and got.block_tables[:, cols:].eq(63).all()
    assert torch.equal(got.slots[:G], slots)
