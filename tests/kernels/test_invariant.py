"""Batch-invariant mode (kernels/invariant.py): a row's bits do not depend on the rows beside it.

Each test computes one row alone and inside launches of other shapes -- more rows, other sequences, a plain
decode row against the same position as a chain node or a prefill row, a wider block table (more splits) --
and asserts the bits equal, then the result close to the reference. Under the interpreter on the CPU (fp16:
its bf16 dot is wrong), compiled on CUDA, where the cases add bf16.
"""

from __future__ import annotations

import pytest
import torch

from kernels import invariant
from kernels.dense_matmul import dense_matmul, dense_matmul_ref
from kernels.int4_matmul import Int4Weight, int4_matmul_ref, quantize_rtn
from kernels.int4_matmul_triton import int4_matmul_triton, invariant_config
from kernels.tree_attention import tree_attention, tree_attention_ref
from test_tree_attention import ancestor_bits  # (tests/kernels/)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.fixture
def invariant_on():
    was = invariant.enabled()
    invariant.set_enabled(True)
    yield
    invariant.set_enabled(was)


def _rand(*shape, gen, dtype, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


# ------------------------------------------------------------------------------------------------------
# Dense matmul
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 16, 17, 40])
@pytest.mark.parametrize("bias,residual", [(False, False), (True, True)])
def test_dense_matmul_matches_reference(M, dtype, bias, residual):
    gen = torch.Generator().manual_seed(M)
    K, N = 200, 150  # neither a multiple of the 64-wide blocks
    x, w = _rand(M, K, gen=gen, dtype=dtype), _rand(N, K, gen=gen, dtype=dtype, scale=0.1)
    b = _rand(N, gen=gen, dtype=dtype) if bias else None
    r = _rand(M, N, gen=gen, dtype=dtype) if residual else None
    out = dense_matmul(x, w, b, r, use_triton=True)
    ref = dense_matmul_ref(x, w, b, r)
    assert out.shape == (M, N) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_matmul_row_is_batch_invariant(dtype):
    gen = torch.Generator().manual_seed(1)
    K, N = 136, 96
    w, b = _rand(N, K, gen=gen, dtype=dtype, scale=0.1), _rand(N, gen=gen, dtype=dtype)
    x = _rand(37, K, gen=gen, dtype=dtype)
    whole = dense_matmul(x, w, b, use_triton=True)
    for i in (0, 15, 16, 36):
        alone = dense_matmul(x[i : i + 1], w, b, use_triton=True)
        mixed = dense_matmul(torch.cat([_rand(5, K, gen=gen, dtype=dtype), x[i : i + 1]]), w, b, use_triton=True)
        assert torch.equal(alone[0], whole[i]) and torch.equal(mixed[5], whole[i]), f"row {i}"


def test_dense_matmul_names_bad_shapes():
    with pytest.raises(ValueError, match="do not match"):
        dense_matmul(torch.zeros(2, 3), torch.zeros(4, 5))
    with pytest.raises(ValueError, match="residual"):
        dense_matmul(torch.zeros(2, 3), torch.zeros(4, 3), residual=torch.zeros(2, 5))


# ------------------------------------------------------------------------------------------------------
# INT4 matmul
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("silu", [False, True])
def test_int4_row_is_batch_invariant(invariant_on, dtype, silu):
    gen = torch.Generator().manual_seed(2)
    K, N, G = 384, 256, 128
    w = quantize_rtn(torch.randn(N, K, generator=gen) * 0.05, G, use_zero_point=True, dtype=dtype).to(DEVICE)
    x = _rand(33, K, gen=gen, dtype=dtype, scale=0.5)

    def run(rows):
        if silu:
            return int4_matmul_triton(rows, w.qweight, w.scales, w.zeros, G, silu=True)
        return int4_matmul_triton(rows, w.qweight, w.scales, w.zeros, G)

    whole = run(x)  # three 16-row tiles
    assert invariant_config(N, K, silu, 132).split_k > 1  # the fix-up is part of what is checked
    for i in (0, 17, 32):
        alone, pair = run(x[i : i + 1]), run(torch.cat([x[i : i + 1], x[:1]]))
        assert torch.equal(alone[0], whole[i]) and torch.equal(pair[0], whole[i]), f"row {i}"
    if not silu:
        torch.testing.assert_close(whole.float(), int4_matmul_ref(x.float(), Int4Weight(w.qweight, w.scales.float(), w.zeros.float(), G)), rtol=2e-2,
                                   atol=2e-2)


# ------------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------------


def _cache(total: int, page: int, Hkv: int, D: int, dtype, gen, extra_blocks: int = 0):
    """A shuffled paged cache holding one sequence of ``total`` positions (sequence 0) and a second of
    ``total // 2`` (sequence 1), block tables ``extra_blocks`` wider than they need."""
    nb = -(-total // page) + extra_blocks
    num_blocks = 2 * nb + 1
    k = _rand(num_blocks, page, Hkv, D, gen=gen, dtype=dtype)
    v = _rand(num_blocks, page, Hkv, D, gen=gen, dtype=dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: 2 * nb].reshape(2, nb).to(torch.int32).to(DEVICE)
    return k, v, tables


def _chain_bits(n: int) -> torch.Tensor:
    return torch.tensor([(1 << (i + 1)) - 1 for i in range(n)], dtype=torch.int64, device=DEVICE)


def _i32(*xs):
    return torch.tensor(xs, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "cpu-ref"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page,H,Hkv,D", [(16, 6, 2, 64), (64, 4, 1, 32)])
def test_attention_row_is_the_same_in_decode_chain_and_prefill(invariant_on, dtype, page, H, Hkv, D, kernel):
    """A chain's nodes (the verify step's rows) and a prefill chunk's rows against plain decode rows at the
    same positions, alone, beside another sequence and under a wider block table; the chain crosses a tile
    boundary and the split boundary at invariant.SPLIT_TOKENS."""
    gen = torch.Generator().manual_seed(page + D)
    ctx, n = invariant.SPLIT_TOKENS - 3, 6
    k, v, tables = _cache(ctx + n + 1, page, Hkv, D, dtype, gen)
    kw, vw, tables_w = k, v, torch.cat([tables, tables[:, :1].expand(2, 9)], dim=1)  # more splits, same data
    q = _rand(n, H, D, gen=gen, dtype=dtype)
    scale = D**-0.5
    chain = tree_attention(q, k, v, tables[:1], _i32(ctx), _i32(0, n), _chain_bits(n), scale, use_triton=kernel)
    prefill = tree_attention(q, k, v, tables[:1], _i32(ctx), _i32(0, n), None, scale, use_triton=kernel)
    q_other = _rand(3, H, D, gen=gen, dtype=dtype)
    for i in range(n):
        pos = ctx + i  # the row sees positions 0 .. pos
        alone = tree_attention(q[i : i + 1], k, v, tables[:1], _i32(pos), _i32(0, 1), None, scale, use_triton=kernel,
                               is_decode=True)
        # beside a 3-token chunk of sequence 1, the row second, under the wider table
        batch = tree_attention(torch.cat([q_other, q[i : i + 1]]), kw, vw, tables_w[[1, 0]], _i32(40, pos),
                               _i32(0, 3, 4), None, scale, use_triton=kernel)
        assert torch.equal(alone[0], chain[i]), f"decode row vs chain node {i}"
        assert torch.equal(alone[0], prefill[i]), f"decode row vs prefill row {i}"
        assert torch.equal(batch[3], chain[i]), f"row in a mixed batch vs chain node {i}"
    ref = tree_attention_ref(q, k, v, tables[:1], _i32(ctx), _i32(0, n), _chain_bits(n), scale)
    torch.testing.assert_close(chain.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_attention_names_a_table_past_the_fixed_splits(invariant_on):
    page, limit = 16, invariant.MAX_SPLITS * invariant.SPLIT_TOKENS
    k = torch.zeros(2, page, 1, 16, dtype=torch.float16, device=DEVICE)
    tables = torch.zeros(1, limit // page + 1, dtype=torch.int32, device=DEVICE)
    q = torch.zeros(1, 1, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="batch-invariant attention covers"):
        tree_attention(q, k, k, tables, _i32(3), _i32(0, 1), None, 0.25, use_triton=True, is_decode=True)


BRANCHING = [-1, 0, 0, 1, 1, 2, 4, 4, 3, 5]  # parent of each node (topological order), the root first


def _path(parents: list[int], i: int) -> list[int]:
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "cpu-ref"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page,H,Hkv,D", [(16, 6, 2, 64), (64, 4, 1, 32), (16, 8, 1, 16)])
def test_attention_tree_node_is_its_paths_decode_row(invariant_on, dtype, page, H, Hkv, D, kernel):
    """Every node of a branching tree against a plain decode row at position ctx + depth over a cache that holds
    its path in order (what plain decoding would have written), beside another sequence; the tree crosses the
    split boundary at invariant.SPLIT_TOKENS."""
    gen = torch.Generator().manual_seed(7 + page)
    n = len(BRANCHING)
    ctx = invariant.SPLIT_TOKENS - 2
    k, v, tables = _cache(ctx + n + 1, page, Hkv, D, dtype, gen)
    q = _rand(n, H, D, gen=gen, dtype=dtype)
    chunk = 70  # a prefill chunk longer than a mask's 64 bits rides in the same launch
    q_other = _rand(chunk, H, D, gen=gen, dtype=dtype)
    scale = D**-0.5
    bits = torch.tensor([0] * chunk + ancestor_bits(BRANCHING), dtype=torch.int64, device=DEVICE)
    # sequence 1 (a 70-token chunk at 30 cached tokens) first, then the tree of sequence 0
    tree = tree_attention(torch.cat([q_other, q]), k, v, tables[[1, 0]], _i32(30, ctx), _i32(0, chunk, chunk + n), bits,
                          scale, use_triton=kernel)[chunk:]
    P = page

    def slots(table: torch.Tensor, positions: list[int]) -> torch.Tensor:
        pos = torch.tensor(positions, device=DEVICE)
        return table[pos // P].long() * P + pos % P

    flat_k, flat_v = k.reshape(-1, Hkv, D), v.reshape(-1, Hkv, D)
    for i in range(n):
        path = _path(BRANCHING, i)
        # a fresh cache holding the prefix and then the path's K/V at positions ctx .. ctx + depth
        k2, v2, tables2 = _cache(ctx + len(path) + 1, page, Hkv, D, dtype, gen)
        src = slots(tables[0], list(range(ctx)) + [ctx + j for j in path])
        dst = slots(tables2[0], list(range(ctx + len(path))))
        k2.reshape(-1, Hkv, D)[dst] = flat_k[src]
        v2.reshape(-1, Hkv, D)[dst] = flat_v[src]
        pos = ctx + len(path) - 1
        alone = tree_attention(q[i : i + 1], k2, v2, tables2[:1], _i32(pos), _i32(0, 1), None, scale, use_triton=kernel,
                               is_decode=True)
        assert torch.equal(alone[0], tree[i]), f"node {i} (path {path})"
    ref = tree_attention_ref(q, k, v, tables[:1], _i32(ctx), _i32(0, n),
                             torch.tensor(ancestor_bits(BRANCHING), dtype=torch.int64, device=DEVICE), scale)
    torch.testing.assert_close(tree.float(), ref.float(), rtol=1e-2, atol=1e-2)
