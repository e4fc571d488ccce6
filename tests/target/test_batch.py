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
        assert b.block_tables[i, : len(t.blocks)].tolist() == t.blocks.tolist()
        assert b.block_tables[i, len(t.blocks):].eq(0).all()
    assert (b.mask_bits is None) == (len(lens) == 1)  # only odd segments bring a mask
    fields = [b.tokens, b.positions, b.slot_mapping, b.logits_indices, b.context_lens, b.query_start,
              b.block_tables] + ([b.mask_bits] if b.mask_bits is not None else [])
    assert all(f.data_ptr() % 16 == 0 and f.is_contiguous() for f in fields)


def test_one_token_segments_take_the_general_paths_slots_and_copies() -> None:
    """A plain decode's one-token segment is packed by a shortcut: its slot in a fresh block (allocated), in a
    block it shares with a fork (copied first: copy-on-write), or in a block of its own. Fields, tables and the
    cache's contents equal what the general path makes (forced here by naming the positions)."""
    def run(general: bool):
        cache = KVCache(num_layers=1, num_blocks=32, page_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                        device="cpu")
        cache.k.copy_(torch.arange(cache.k.numel(), dtype=torch.float32).view_as(cache.k))
        fresh, shared, own = cache.new_table(), cache.new_table(), cache.new_table()
        fresh.ensure(8)  # two full blocks: the next token needs a third
        shared.ensure(6)
        fork = shared.fork()  # its last block is now shared: writing slot 6 copies it first
        own.ensure(3)
        segs = [Segment(t, ctx, [tok], positions=[ctx] if general else None, logits=lg)
                for t, ctx, tok, lg in ((fresh, 8, 11, "last"), (shared, 6, 12, "all"), (own, 2, 13, "last"))]
        b = build_batch(segs, cache, "cpu")
        fields = [b.tokens, b.positions, b.slot_mapping, b.block_tables, b.context_lens, b.query_start,
                  b.logits_indices]
        return [f.tolist() for f in fields], b.logits_rows, b.is_decode, [t.blocks.tolist() for t in (fresh, shared, own, fork)], \
            cache.k.clone()

    fast, slow = run(False), run(True)
    assert fast[:4] == slow[:4] and torch.equal(fast[4], slow[4])
    assert fast[3][1] != fast[3][3]  # the shared block was copied: the fork keeps the original
    assert len(fast[3][0]) == 3  # the fresh table grew a block


def test_device_nodes_land_in_their_rows() -> None:
    """A deferred tree's nodes come from the device (``Segment.device_nodes``), between its root and any host
    nodes after them: the batch holds exactly what the same segments with host lists hold."""
    cache = KVCache(num_layers=1, num_blocks=32, page_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                    device="cpu")
    g = torch.Generator().manual_seed(0)
    lens = [5, 1, 7, 3]
    toks = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lens]
    bits = [torch.randint(-2**63, 2**63 - 1, (n,), generator=g, dtype=torch.int64).tolist() for n in lens]
    batches = []
    for deferred in (False, True):
        segs = []
        for i, n in enumerate(lens):
            t = cache.new_table()
            m = {0: n - 1, 1: 0, 2: n - 3, 3: n - 1}[i]  # device nodes after the root; the rest stay on the host
            seg = Segment(t, 2 * i, toks[i], mask_bits=bits[i], logits="all")
            if deferred and m:
                seg.tokens = toks[i][:1] + [0] * m + toks[i][1 + m:]  # placeholders, overwritten from the device
                seg.mask_bits = bits[i][:1] + [-1] * m + bits[i][1 + m:]
                seg.device_nodes = (1, torch.tensor(toks[i][1 : 1 + m]), torch.tensor(bits[i][1 : 1 + m]))
            segs.append(seg)
        batches.append(build_batch(segs, cache, "cpu"))
    host, dev = batches
    assert dev.tokens.tolist() == host.tokens.tolist() == [t for ts in toks for t in ts]
    assert dev.mask_bits.tolist() == host.mask_bits.tolist() == [b for bs in bits for b in bs]
    assert dev.positions.tolist() == host.positions.tolist()
    assert dev.logits_indices.tolist() == host.logits_indices.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_copies_to_cuda_go_through_pinned_memory() -> None:
    """to_device's copy is asynchronous (pinned source) and lands intact; build_batch's fields use it."""
    from target.transfer import to_device

    host = torch.arange(1000, dtype=torch.int64)
    dev = to_device(host, "cuda")
    assert dev.is_cuda and torch.equal(dev.cpu(), host)
    cache = KVCache(num_layers=1, num_blocks=8, page_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float16,
                    device="cuda")
    b = build_batch([Segment(cache.new_table(), 0, [5, 6, 7], logits="all")], cache, "cuda")
    assert b.tokens.tolist() == [5, 6, 7] and b.query_start.tolist() == [0, 3]


def test_host_copies_stay_put_on_the_cpu() -> None:
    from target.transfer import to_device

    host = torch.arange(10)
    assert to_device(host, "cpu") is host  # no copy where host and device are one
