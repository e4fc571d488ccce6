"""compact_kv: the Triton kernel and the reference against a plain per-move loop, on overlapping moves."""

from __future__ import annotations

import pytest
import torch

from kernels.compact_kv import compact_kv, compact_kv_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_moves(block_tables: torch.Tensor, page: int, ctxs: list[int], accepted: list[list[int]]):
    """Flat (src, dst) slots: accepted node a_d of a sequence moves from ctx + a_d to ctx + d.

    ``accepted`` lists node indices in increasing order (a root-to-leaf path in topological order), so
    the moves satisfy the invariant: sorted by source, dst <= src, destinations strictly increasing.
    """
    src, dst = [], []
    for b, (ctx, path) in enumerate(zip(ctxs, accepted)):
        for depth, node in enumerate(path):
            for pos, out in ((ctx + node, src), (ctx + depth, dst)):
                out.append(int(block_tables[b, pos // page]) * page + pos % page)
    return torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)


def per_move_loop(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """The obvious sequential semantics: one slot copy after another, in list order."""
    flat = cache.clone().view(cache.shape[0], -1, *cache.shape[3:])  # [L, S, Hkv, D]
    for s, d in zip(src.tolist(), dst.tolist()):
        flat[:, d] = flat[:, s]
    return flat.view(cache.shape)


def random_case(page: int, num_layers: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ctxs = [0, 13, 30]
    accepted = [[0, 1, 2, 5, 9], [0, 3, 4, 6, 7, 8, 11, 12, 14], [2, 3]]  # the last never keeps its root slot
    max_blocks = max(-(-(c + 16) // page) for c in ctxs)
    num_blocks = len(ctxs) * max_blocks + 1
    block_tables = torch.randperm(num_blocks, generator=gen)[: len(ctxs) * max_blocks].reshape(len(ctxs), -1)
    shape = (num_layers, num_blocks, page, 2, 32)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    src, dst = make_moves(block_tables, page, ctxs, accepted)
    return k_cache, v_cache, src, dst


@pytest.mark.parametrize("page", [16, 64])
def test_ref_matches_per_move_loop(page):
    k_cache, v_cache, src, dst = random_case(page, 2, seed=page)
    want_k, want_v = per_move_loop(k_cache, src, dst), per_move_loop(v_cache, src, dst)
    compact_kv_ref(k_cache, v_cache, src, dst)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("block_m,block_c", [(4, 32), (32, 128)])
def test_kernel_matches_per_move_loop(page, block_m, block_c):
    # block_m=4 splits the 16 moves into batches, so moves whose destination is a source of the
    # previous batch are exercised as well as those inside one batch; block_c=32 splits each row.
    k_cache, v_cache, src, dst = random_case(page, 3, seed=page + block_m)
    k_cache, v_cache, src, dst = (t.to(DEVICE) for t in (k_cache, v_cache, src, dst))
    want_k, want_v = per_move_loop(k_cache, src, dst), per_move_loop(v_cache, src, dst)
    compact_kv(k_cache, v_cache, src, dst, use_triton=True, block_m=block_m, block_c=block_c)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_no_moves_is_a_no_op():
    k_cache, v_cache, _, _ = random_case(16, 1, seed=0)
    k0, v0 = k_cache.clone(), v_cache.clone()
    empty = torch.empty(0, dtype=torch.int64)
    compact_kv(k_cache, v_cache, empty, empty, use_triton=True)
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


@pytest.mark.gpu
@requires_cuda
def test_gpu_bf16_many_layers():
    gen = torch.Generator().manual_seed(1)
    page, ctxs = 16, [5 * b + 3 for b in range(16)]
    accepted = [sorted(torch.randperm(16, generator=gen)[:6].tolist()) for _ in ctxs]
    block_tables = torch.randperm(200, generator=gen)[:160].reshape(16, 10)
    src, dst = make_moves(block_tables, page, ctxs, accepted)
    k_cache = torch.randn(32, 200, page, 8, 128, generator=gen).to(torch.bfloat16).cuda()
    v_cache = torch.randn(32, 200, page, 8, 128, generator=gen).to(torch.bfloat16).cuda()
    want_k, want_v = per_move_loop(k_cache, src.cuda(), dst.cuda()), per_move_loop(v_cache, src.cuda(), dst.cuda())
    compact_kv(k_cache, v_cache, src.cuda(), dst.cuda())
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_compact_slots_hands_the_kernel_aligned_rows_for_every_move_count() -> None:
    """Both index rows start 16-byte aligned whatever the move count (Triton compiles one kernel per
    pointer-alignment class), and the moves are still exactly the ones asked for."""
    from target.kv_cache import KVCache

    cache = KVCache(num_layers=2, num_blocks=32, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                    device="cpu")
    seen = []
    inner = cache.compact

    def recording(src, dst):
        seen.append((src.data_ptr() % 16, dst.data_ptr() % 16, src.tolist(), dst.tolist()))
        inner(src, dst)

    cache.compact = recording
    for M in range(1, 34):
        src = list(range(2 * M, 3 * M))
        dst = list(range(M))
        cache.k.normal_()
        want = per_move_loop(cache.k, torch.tensor(src), torch.tensor(dst))
        cache.compact_slots(src, dst)
        assert seen[-1] == (0, 0, src, dst), M
        torch.testing.assert_close(cache.k, want)


@requires_cuda
def test_one_compile_serves_every_move_count_cuda() -> None:
    """After the first compaction, no move count compiles another variant of the kernel."""
    import triton
    from target.kv_cache import KVCache

    compiles = []

    def hook(**kw) -> bool:
        compiles.append(kw.get("repr", ""))
        return False

    cache = KVCache(num_layers=2, num_blocks=64, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16,
                    device="cuda")
    cache.compact_slots([40], [0])  # compiled here (or already, by an earlier test)
    old = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = hook
    try:
        for M in (1, 2, 3, 16, 17, 32, 5):
            cache.compact_slots(list(range(100, 100 + M)), list(range(M)))
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_cache_hook = old
    assert not [c for c in compiles if "compact_kv" in c], compiles
