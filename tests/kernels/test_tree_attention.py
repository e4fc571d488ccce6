"""tree_attention: the Triton kernel against the reference, and the reference against dense SDPA with an
explicit mask built from parent pointers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import paged_decode
from kernels.tree_attention import tree_attention, tree_attention_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CHAIN = [-1, 0, 1, 2, 3, 4]
BRANCHING = [-1, 0, 0, 1, 1, 2, 4, 4, 3]  # nodes in topological order, parent index or -1 for the root


def ancestor_bits(parents: list[int]) -> list[int]:
    """mask_bits for one tree: bit j of node i set when j is i or an ancestor of i."""
    bits = []
    for i, p in enumerate(parents):
        b = 1 << i
        while p >= 0:
            b |= 1 << p
            p = parents[p]
        bits.append(b if b < 2**63 else b - 2**64)
    return bits


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool from parent pointers, built without bit tricks (the independent spec)."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(n):
        p = parents[i]
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    return mask


def make_batch(seqs: list[tuple[int, list[int] | int]], page: int, num_heads: int, num_kv_heads: int,
               head_dim: int, dtype: torch.dtype, seed: int, device: torch.device = DEVICE):
    """seqs: (context_len, parents) for a tree, or (context_len, n) for a causal chunk of n tokens."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [len(x) if isinstance(x, list) else x for _, x in seqs]
    max_blocks = max(-(-(ctx + n) // page) for (ctx, _), n in zip(seqs, sizes)) + 1
    num_blocks = len(seqs) * max_blocks + 2
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)[: len(seqs) * max_blocks]
    block_tables = perm.reshape(len(seqs), max_blocks).to(torch.int32)
    q = torch.randn(sum(sizes), num_heads, head_dim, generator=gen).to(dtype)
    bits = []
    for _, x in seqs:
        bits += ancestor_bits(x) if isinstance(x, list) else [0] * x
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    tensors = dict(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32),
        query_start=torch.tensor(starts, dtype=torch.int32),
        mask_bits=torch.tensor(bits, dtype=torch.int64))
    return {name: t.to(device) for name, t in tensors.items()}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check(seqs, page=16, num_heads=3, num_kv_heads=1, head_dim=64, num_splits=None, use_bits=True, seed=0,
          dtype=torch.float16, device=DEVICE, tol=5e-3, prefetch=None, **launch):
    batch = make_batch(seqs, page, num_heads, num_kv_heads, head_dim, dtype, seed, device)
    if not use_bits:
        batch["mask_bits"] = None
    args = list(batch.values()) + [head_dim**-0.5]
    ref = tree_attention_ref(*args)
    out = tree_attention(*args, use_triton=True, num_splits=num_splits, prefetch=prefetch, **launch)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < tol


def test_single_node_tree_empty_context():
    check([(0, [-1])], num_splits=1)


def test_chain_as_bits_and_as_causal():
    check([(21, CHAIN)], num_splits=2)
    check([(21, len(CHAIN))], use_bits=False, num_splits=1)


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (3, 1)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("prefetch", [False, True])
def test_mixed_batch(page, num_heads, num_kv_heads, num_splits, prefetch):
    # A causal prefill chunk longer than 64 tokens, two trees (one with no context), one decode token;
    # contexts are not multiples of the page size.
    seqs = [(20, 70), (45, BRANCHING), (0, CHAIN), (33, [-1])]
    check(seqs, page, num_heads, num_kv_heads, num_splits=num_splits, seed=page + num_splits, prefetch=prefetch)


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("chunk_tokens,block_n", [(32, 32), (128, 32), (1024, 128), (64, 128)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_chunked_prefix_block_ids(page, chunk_tokens, block_n, num_splits):
    # Prefixes of several chunks and tiles, one ending inside a page, beside a tree with no whole tile.
    seqs = [(300, BRANCHING), (517, 70), (40, CHAIN), (257, [-1])]
    check(seqs, page, 4, 2, 32, num_splits=num_splits, seed=page + block_n, chunk_tokens=chunk_tokens,
          block_n=block_n)


def test_wide_tiles_take_the_chunked_loop(monkeypatch):
    from kernels import tree_attention as TA
    pages = []
    monkeypatch.setattr(TA, "TREE_CHUNK_TOKENS", 64)
    monkeypatch.setattr(TA, "chunk_pages", lambda *a: pages.append(paged_decode.chunk_pages(*a)) or pages[-1])
    wide = [-1] + [(i - 1) // 2 for i in range(1, 40)]  # 40 nodes x 4 query heads: 128-row tiles
    check([(300, wide), (517, wide)], 16, 4, 1, 128, seed=3)
    assert pages == [8]  # a 64-token chunk grows to one whole 128-key step: 8 pages of 16
    check([(300, BRANCHING), (517, CHAIN)], 16, 4, 1, 128, seed=4)  # small tiles keep their lookups
    check([(300, wide)], 16, 4, 1, 64, seed=5)  # the rule is timed at head dim 128 only
    check([(300, 200)], 16, 4, 1, 128, seed=6)  # and on trees, not on prefill chunks
    assert pages[1:] == [0, 0, 0]


def test_head_dim_128_auto_splits():
    check([(130, BRANCHING), (7, 5)], num_heads=6, num_kv_heads=2, head_dim=128)


def test_all_causal_without_bits():
    check([(3, 40), (0, 17)], page=64, num_heads=2, num_kv_heads=2, use_bits=False, num_splits=2)


def test_more_sequences_than_the_block_b_floor():
    """70 sequences: past the 64-sequence BLOCK_B variant, the tile scheduler's cumsum spans 128 lanes."""
    seqs = [(3 + 5 * i % 29, [-1, 0] if i % 3 else 2) for i in range(70)]
    check(seqs, num_heads=2, num_kv_heads=1, head_dim=16, num_splits=1)


def test_is_decode_route():
    batch = make_batch([(5, 1), (80, 1), (0, 1)], 16, 3, 1, 64, torch.float16, seed=9)
    args = list(batch.values()) + [0.125]
    ref = tree_attention_ref(*args)
    out = tree_attention(*args, use_triton=True, is_decode=True)
    assert rel_err(out, ref) < 5e-3
    # off Triton, a decode batch takes the batched torch path: the same attention
    cpu = {k: v.cpu() for k, v in batch.items()}
    args_cpu = [t.float() if name in ("q", "k_cache", "v_cache") else t for name, t in cpu.items()] + [0.125]
    torch.testing.assert_close(tree_attention(*args_cpu, use_triton=False, is_decode=True),
                               tree_attention_ref(*args_cpu), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_ref_matches_dense_sdpa(num_heads, num_kv_heads):
    seqs = [(20, 70), (13, BRANCHING), (0, CHAIN)]
    batch = make_batch(seqs, 16, num_heads, num_kv_heads, 32, torch.float64, seed=7, device=torch.device("cpu"))
    ref = tree_attention_ref(*batch.values(), 0.2)
    page, group = 16, num_heads // num_kv_heads
    for b, (ctx, x) in enumerate(seqs):
        n = len(x) if isinstance(x, list) else x
        s = batch["query_start"][b].item()
        pos = torch.arange(ctx + n)
        blocks = batch["block_tables"][b, pos // page].long()
        k = batch["k_cache"][blocks, pos % page].transpose(0, 1).repeat_interleave(group, 0)  # [H, ctx+n, D]
        v = batch["v_cache"][blocks, pos % page].transpose(0, 1).repeat_interleave(group, 0)
        mask = torch.ones(n, ctx + n, dtype=torch.bool)
        mask[:, ctx:] = ancestor_mask(x) if isinstance(x, list) else torch.ones(n, n, dtype=torch.bool).tril()
        q = batch["q"][s:s + n].transpose(0, 1)  # [H, n, D]
        dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2).transpose(0, 1)
        torch.testing.assert_close(ref[s:s + n], dense, rtol=1e-4, atol=1e-5)  # the ref softmaxes in fp32


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("prefetch,chunk_tokens", [(False, 0), (True, 0), (False, 1024)])
def test_gpu_bf16(page, prefetch, chunk_tokens):
    tree16 = [-1] + [i // 2 for i in range(15)]
    seqs = [(4000, tree16), (517, 300), (2048, 1), (0, tree16), (100, list(range(-1, 63)))]
    check(seqs, page, 32, 8, 128, dtype=torch.bfloat16, device=torch.device("cuda"), tol=1e-2, prefetch=prefetch,
          chunk_tokens=chunk_tokens)


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("chunk_elems", [1, 1 << 26])
@pytest.mark.parametrize("use_bits", [True, False])
def test_batched_cpu_path_matches_ref(page: int, chunk_elems: int, use_bits: bool) -> None:
    """The CPU's batched path on a ragged batch: a one-node tree over no context, a deep chain, a wide tree,
    a decode token, a short causal chunk and a prefill chunk past 64 tokens (that one goes through the
    reference), GQA groups of 3, a partial last page, chunks of one sequence up to the whole batch."""
    from kernels.tree_attention import tree_attention_batched

    seqs = [(0, [-1]), (37, CHAIN), (70, BRANCHING), (5, 1), (20, 9), (3, 80), (130, [-1, 0, 0, 0, 0])]
    batch = make_batch(seqs, page, 6, 2, 32, torch.float32, seed=page + use_bits, device=torch.device("cpu"))
    if not use_bits:
        batch["mask_bits"] = None
    args = list(batch.values()) + [0.2]
    ref = tree_attention_ref(*args)
    out = tree_attention_batched(*args, chunk_elems=chunk_elems)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # and the dispatcher's CPU path for a batch that is not all decode tokens is this one
    torch.testing.assert_close(tree_attention(*args, use_triton=False), out)


def test_batched_cpu_plan_is_shared_by_layers_and_keyed_by_contents() -> None:
    """Every layer of a forward reuses one plan (rows, masks) for its batch; a batch whose tensors are the same
    objects written in place (new ancestor bits, new context lengths) gets a new plan, never a stale one."""
    from kernels import tree_attention as TA

    seqs = [(37, CHAIN), (70, BRANCHING), (5, 1)]
    batch = make_batch(seqs, 16, 6, 2, 32, torch.float32, seed=3, device=torch.device("cpu"))
    args = list(batch.values()) + [0.2]
    first = TA.tree_attention_batched(*args)
    plan = TA._PLAN[1]
    k2 = torch.randn_like(batch["k_cache"])  # another layer: other K/V, the same batch
    second = TA.tree_attention_batched(batch["q"], k2, k2, *list(batch.values())[3:], 0.2)
    assert TA._PLAN[1] is plan
    torch.testing.assert_close(second, tree_attention_ref(batch["q"], k2, k2, *list(batch.values())[3:], 0.2),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first, tree_attention_ref(*args), rtol=1e-5, atol=1e-5)
    # in place: the chain becomes a star (each node sees the root and itself), and the tree's context grows
    star = ancestor_bits([-1] + [0] * (len(CHAIN) - 1))
    batch["mask_bits"][: len(CHAIN)] = torch.tensor(star)
    batch["context_lens"][1] += 9
    out = TA.tree_attention_batched(*args)
    assert TA._PLAN[1] is not plan
    torch.testing.assert_close(out, tree_attention_ref(*args), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, first)


@pytest.mark.parametrize("pad", [7, 70])
def test_graph_layout_dummy_and_empty_segments(pad: int) -> None:
    """The ragged layout of a replayed graph (target/graphs.py): real segments, then one dummy segment of
    padding rows (context 0, mask bits 1: each sees its segment's first row; past 64 rows causal), then
    segments with no rows. The kernel's tile scheduler skips the empty ones; every row matches the ref."""
    seqs = [(20, BRANCHING), (9, 1), (33, 3), (0, pad), (0, 0), (0, 0)]
    batch = make_batch(seqs, 16, 4, 2, 32, torch.float16, seed=pad)
    start = batch["query_start"][3].item()
    batch["mask_bits"][start:] = 1
    args = list(batch.values()) + [32**-0.5]
    ref = tree_attention_ref(*args)
    out = tree_attention(*args, use_triton=True)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 5e-3
    assert rel_err(out[:start], ref[:start]) < 5e-3
