"""paged_decode_attention: the Triton kernel against the reference, and the reference against dense SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.paged_decode import chunk_pages, paged_decode_attention, paged_decode_attention_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_paged(seq_lens: list[int], page: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               gen: torch.Generator, device: torch.device = DEVICE):
    """Random K/V in a cache whose block tables are a shuffled, non-contiguous pick of blocks."""
    max_blocks = max(-(-n // page) for n in seq_lens) + 1
    num_blocks = len(seq_lens) * max_blocks + 3
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * max_blocks]
    block_tables = perm.reshape(len(seq_lens), max_blocks).to(torch.int32)
    return k_cache.to(device), v_cache.to(device), block_tables.to(device)


def gather_dense(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[length, Hkv, D] contiguous copy of one sequence's paged K or V."""
    page = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    return cache[block_table[pos // page].long(), pos % page]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def run_case(seq_lens, page, num_heads, num_kv_heads, head_dim, dtype, num_splits, seed, device=DEVICE,
             prefetch=None, block_n=None, len_offset=0, chunk_tokens=None):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = make_paged(seq_lens, page, num_kv_heads, head_dim, dtype, gen, device)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, lens + len_offset, scale)
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale, use_triton=True, num_splits=num_splits,
                                 prefetch=prefetch, block_n=block_n, len_offset=len_offset,
                                 chunk_tokens=chunk_tokens)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    return rel_err(out, ref)


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (3, 1)])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("prefetch", [False, True])
def test_matches_ref_ragged_batch(page, num_heads, num_kv_heads, num_splits, prefetch):
    # B=3: a single token, a ragged tail block, and a length spanning several tiles and splits.
    err = run_case([1, 37, 150], page, num_heads, num_kv_heads, 64, torch.float16, num_splits, seed=page + num_heads,
                   prefetch=prefetch)
    assert err < 5e-3


@pytest.mark.parametrize("block_n", [16, 32])
def test_prefetch_loop_tiles_and_len_offset(block_n):
    """The hand-pipelined loop: tiles smaller than a page and larger, a split of one tile, a split that
    starts on the last (partial) tile, and the model's ``len_offset`` of 1."""
    for lens, splits in (([1, 16, 17, 100], 3), ([33, 64], 1), ([48], 2)):
        err = run_case(lens, 16, 4, 2, 32, torch.float16, splits, seed=block_n + len(lens), prefetch=True,
                       block_n=block_n, len_offset=1)
        assert err < 5e-3, (lens, splits, err)


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("chunk_tokens", [32, 128, 1024])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_chunked_block_ids(page, chunk_tokens, num_splits):
    # Lengths that end inside a chunk, on a chunk's last tile, and several chunks into a split; tiles of 32
    # and 64 tokens, so a chunk holds one page, a part of one (no: whole tiles only) or many.
    for block_n in (32, 64):
        err = run_case([1, 37, 150, 230, 300], page, 4, 2, 32, torch.float16, num_splits, seed=page + chunk_tokens,
                       block_n=block_n, chunk_tokens=chunk_tokens, len_offset=1)
        assert err < 2e-3, (block_n, err)


def test_plan_chunks_one_wave_of_programs_only(monkeypatch):
    from kernels import paged_decode as PD
    cpu = torch.device("cpu")  # 8 SMs on the CPU: one program an SM over 5.6 to 8 of them
    assert [PD.wave_splits(n, cpu) for n in (1, 2, 3, 4, 5, 6, 8, 9, 16)] == [0, 0, 2, 2, 0, 1, 1, 0, 0]
    monkeypatch.setattr(PD, "DECODE_CHUNK_TOKENS", 0)
    assert PD.decode_plan(8, 256, 16, cpu) == (4, 64, 3, 0)  # off: the split loop
    monkeypatch.setattr(PD, "DECODE_CHUNK_TOKENS", 4096)
    assert PD.decode_plan(8, 256, 16, cpu) == (1, 128, 3, 256)  # one program each, unsplit, chunked
    assert PD.decode_plan(4, 256, 64, cpu) == (2, 128, 3, 64)  # two splits make the wave
    assert PD.decode_plan(2, 256, 16, cpu)[3] == 0  # a quarter wave: the split loop
    assert PD.decode_plan(16, 256, 16, cpu)[3] == 0  # two waves
    assert PD.decode_plan(8, 256, 16, cpu, num_splits=2) == (2, 64, 3, 0)  # a fixed argument keeps the old loop
    assert PD.decode_plan(8, 256, 16, cpu, chunk_tokens=1024)[3] == 64  # an explicit chunk holds everywhere
    assert PD.decode_plan(2, 256, 16, cpu, chunk_tokens=1024)[3] == 64
    assert PD.decode_plan(8, 256, 16, cpu, prefetch=True)[3] == 0
    # head dim 64: unsplit and chunked from a pair an SM (past one wave too) and 2k tokens; elsewhere the split loop
    assert PD.decode_plan(8, 256, 16, cpu, head_dim=64) == (1, 128, 3, 256)
    assert PD.decode_plan(24, 128, 16, cpu, head_dim=64) == (1, 128, 3, 256)  # three waves
    assert PD.decode_plan(6, 256, 16, cpu, head_dim=64)[3] == 0  # under one wave
    assert PD.decode_plan(8, 64, 16, cpu, head_dim=64)[3] == 0  # 1k-token tables: not timed
    assert PD.decode_plan(8, 256, 16, cpu, head_dim=64, num_splits=2)[3] == 0
    assert PD.decode_plan(8, 256, 16, cpu, head_dim=96)[3] == 0  # other head dims: the split loop


def test_one_wave_launch_matches_ref(monkeypatch):
    from kernels import paged_decode as PD
    monkeypatch.setattr(PD, "DECODE_CHUNK_TOKENS", 64)  # several chunks per sequence
    assert PD.decode_plan(4 * 2, 20, 16, DEVICE)[3] > 0
    err = run_case([1, 37, 150, 300], 16, 4, 2, 128, torch.float16, None, seed=5, len_offset=1)
    assert err < 2e-3


def test_head_dim_64_unsplit_chunked_launch_matches_ref(monkeypatch):
    """SmolLM2's head shape (3 query heads a KV head, head dim 64) past one wave of pairs: the launcher's own
    plan is the unsplit chunked loop, several chunks a sequence; ragged lengths up to past 2k tokens."""
    from kernels import paged_decode as PD
    monkeypatch.setattr(PD, "DECODE_CHUNK_TOKENS", 512)
    lens = [2100, 1, 37, 600, 1500]
    assert PD.decode_plan(len(lens) * 2, -(-max(lens) // 64), 64, torch.device(DEVICE), head_dim=64)[:2] == (1, 128)
    err = run_case(lens, 64, 6, 2, 64, torch.float16, None, seed=11, len_offset=1)
    assert err < 2e-3


def test_chunk_pages_cover_whole_tiles():
    assert chunk_pages(0, 16, 64) == 0
    assert chunk_pages(1024, 16, 64) == 64
    assert chunk_pages(32, 16, 64) == 4  # at least one 64-token tile
    assert chunk_pages(32, 64, 32) == 1  # at least one page
    assert chunk_pages(1000, 16, 64) == 64  # a power of two of pages
    assert chunk_pages(1024, 24, 64) == 0  # pages not a power of two: one lookup per tile


def test_batch_of_one_head_dim_128_auto_splits():
    assert run_case([97], 16, 6, 2, 128, torch.float16, None, seed=1) < 5e-3


def test_more_splits_than_tiles():
    # Splits past the sequence's end stay empty and must weigh nothing in the merge.
    assert run_case([5, 70], 16, 4, 2, 64, torch.float16, 8, seed=2) < 5e-3


def test_twenty_splits_merge_over_repeated_calls():
    for seed in range(3):
        assert run_case([300, 7, 129], 16, 6, 2, 32, torch.float16, 20, seed=seed, block_n=16, len_offset=1) < 5e-3


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_ref_matches_dense_sdpa(num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(3)
    seq_lens, page, head_dim = [1, 19, 40], 16, 32
    k_cache, v_cache, block_tables = make_paged(seq_lens, page, num_kv_heads, head_dim, torch.float64, gen, "cpu")
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen, dtype=torch.float64)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, lens, 0.3)
    for b, n in enumerate(seq_lens):
        k = gather_dense(k_cache, block_tables[b], n).transpose(0, 1)  # [Hkv, n, D]
        v = gather_dense(v_cache, block_tables[b], n).transpose(0, 1)
        dense = F.scaled_dot_product_attention(q[b][:, None], k.repeat_interleave(num_heads // num_kv_heads, 0),
                                               v.repeat_interleave(num_heads // num_kv_heads, 0), scale=0.3)
        torch.testing.assert_close(ref[b], dense[:, 0], rtol=1e-4, atol=1e-5)  # the ref softmaxes in fp32


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("prefetch,chunk_tokens", [(False, 0), (True, 0), (False, 1024), (False, 64)])
def test_gpu_bf16(page, prefetch, chunk_tokens):
    err = run_case([1, 700, 4000, 33], page, 32, 8, 128, torch.bfloat16, None, seed=4, device=torch.device("cuda"),
                   prefetch=prefetch, chunk_tokens=chunk_tokens)
    assert err < 1e-2


@pytest.mark.gpu
@requires_cuda
def test_gpu_cuda_graph_replay_follows_new_lengths():
    gen = torch.Generator().manual_seed(5)
    dev = torch.device("cuda")
    k_cache, v_cache, block_tables = make_paged([2000, 2000], 16, 8, 128, torch.bfloat16, gen, dev)
    q = torch.randn(2, 32, 128, generator=gen).to(torch.bfloat16).to(dev)
    lens = torch.tensor([10, 1000], dtype=torch.int32, device=dev)
    paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, 0.1)
    lens.copy_(torch.tensor([1999, 3], dtype=torch.int32))
    graph.replay()
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, lens, 0.1)
    assert rel_err(out, ref) < 1e-2


def test_short_contexts_split_finer():
    """Up to 16 splits of 32 tokens for a short context, else 128-token splits, never past one wave."""
    from kernels.paged_decode import pick_num_splits

    cpu = torch.device("cpu")  # 8 "SMs" off CUDA: 4 programs per SM over 1 program fill 32 splits
    assert pick_num_splits(1, 640, cpu, 4, short_splits=16) == 16  # 5 by the 128-token rule
    assert pick_num_splits(1, 640, cpu, 4) == 5  # the tree kernel keeps the 128-token rule
    assert pick_num_splits(1, 256, cpu, 4, short_splits=16) == 8
    assert pick_num_splits(1, 4096, cpu, 4, short_splits=16) == 32  # long: the 128-token rule wins
    assert pick_num_splits(16, 640, cpu, 4, short_splits=16) == 2  # one wave caps it


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("chunk_elems", [1, 4096, 1 << 26])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_cpu_path_matches_ref(page: int, chunk_elems: int, dtype: torch.dtype) -> None:
    """The CPU's batched decode path: ragged lengths (one token, a partial last block, several blocks), GQA
    groups of 3, chunks of one sequence up to the whole batch, and block-table entries past a sequence's end
    set to -1 (they must be masked, never read as neighbours' tokens)."""
    from kernels.paged_decode import paged_decode_attention_batched

    gen = torch.Generator().manual_seed(page + chunk_elems % 97)
    seq_lens = [1, 37, 150, 64, 5]
    k_cache, v_cache, block_tables = make_paged(seq_lens, page, 2, 32, dtype, gen, torch.device("cpu"))
    for b, n in enumerate(seq_lens):
        block_tables[b, -(-n // page):] = -1
    q = torch.randn(len(seq_lens), 6, 32, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, lens, 0.2)
    out = paged_decode_attention_batched(q, k_cache, v_cache, block_tables, lens, 0.2, chunk_elems=chunk_elems)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-5 if dtype == torch.float32 else 1e-2)
    # the dispatcher's CPU path is this one, with the model's len_offset
    via = paged_decode_attention(q, k_cache, v_cache, block_tables, lens - 1, 0.2, use_triton=False, len_offset=1)
    torch.testing.assert_close(via, paged_decode_attention_batched(q, k_cache, v_cache, block_tables, lens, 0.2))
