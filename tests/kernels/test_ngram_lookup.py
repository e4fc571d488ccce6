"""ngram_lookup: the Triton kernel (interpreted on the CPU) against the reference, and the reference against
the host drafter's lookup, on rows with stale tails, short rows, windows and every n; with an n-gram table,
for the rows whose own text holds no match."""

from __future__ import annotations

import pytest
import torch

from draft.ngram import NgramDrafter, NgramTable
from kernels.ngram_lookup import (MAX_PROBES, TOKEN_BITS, ngram_lookup, ngram_lookup_ref, pack_key, pack_table,
                                  table_hash)


def rows_case(seed: int, B: int = 6, cap: int = 96, vocab: int = 5):
    g = torch.Generator().manual_seed(seed)
    lens = [1, 2, 3] + torch.randint(4, cap - 8, (B - 3,), generator=g).tolist()
    hist = torch.randint(0, vocab, (B, cap), generator=g)
    rows = []
    for b, n in enumerate(lens):
        hist[b, n:] = 99 + b  # stale past the end: never matched nor drafted
        rows.append(hist[b, :n].tolist())
    return hist, torch.tensor(lens), rows


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_n,min_n,window,K", [(3, 1, 4096, 4), (2, 2, 4096, 1), (3, 1, 17, 5), (4, 2, 40, 3)])
def test_the_kernel_matches_the_reference(seed: int, max_n: int, min_n: int, window: int, K: int) -> None:
    hist, lens, _ = rows_case(seed)
    want = ngram_lookup_ref(hist, lens, int(lens.max()), K, max_n, min_n, window)
    got = ngram_lookup(hist, lens, int(lens.max()), K, max_n, min_n, window, use_triton=True, block=16)
    assert torch.equal(got, want)


@pytest.mark.parametrize("seed", range(6))
def test_the_reference_finds_the_host_drafter_s_first_continuation(seed: int) -> None:
    drafter = NgramDrafter(max_ngram=3, min_ngram=1, window=30 if seed % 2 else 4096)
    hist, lens, rows = rows_case(seed, vocab=4 + seed)
    K = 4
    got = ngram_lookup_ref(hist, lens, int(lens.max()), K, drafter.max_ngram, drafter.min_ngram, drafter.window)
    for b, r in enumerate(rows):
        found = drafter.continuations(r, K, 1)
        want = (found[0] if found else []) + [0] * (K - (len(found[0]) if found else 0))
        assert got[b].tolist() == want, (b, r)


def table_case(seed: int, min_n: int = 1, max_n: int = 3, B: int = 8, cap: int = 40, vocab: int = 40):
    """Rows with no repeated token (the table's case: no lookup in their own text matches) and a few with
    repeats, stale tails past their lengths, and a table of next tokens over the same vocabulary built from
    texts that share some of the rows' endings, so lookups hit at every context size, and miss."""
    g = torch.Generator().manual_seed(seed)
    lens = [1, 2, 3] + torch.randint(4, cap - 8, (B - 3,), generator=g).tolist()
    hist = torch.full((B, cap), 7, dtype=torch.int64)
    rows = []
    for b, n in enumerate(lens):
        row = torch.randperm(vocab, generator=g)[:n] if b % 4 else torch.randint(0, 4, (n,), generator=g)
        hist[b, :n] = row
        hist[b, n:] = 99 + b
        rows.append(row.tolist())
    texts = [torch.randint(0, vocab, (60,), generator=g).tolist() for _ in range(6)]
    texts += [r[-3:] + torch.randint(0, vocab, (4,), generator=g).tolist() for r in rows[::2]]
    table = NgramTable.build(texts, min_n=min_n, max_n=max_n, keep=2, min_count=1)
    return hist, torch.tensor(lens), rows, table


def packed(table: NgramTable) -> tuple:
    keys, nxt, probes = pack_table(table.entries)
    return keys, nxt, table.min_n, table.max_n, probes


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("min_n,max_n,K", [(1, 3, 4), (2, 3, 3), (1, 1, 2), (1, 2, 5)])
def test_the_kernel_matches_the_reference_with_a_table(seed: int, min_n: int, max_n: int, K: int) -> None:
    hist, lens, _, table = table_case(seed, min_n, max_n)
    args = (hist, lens, int(lens.max()), K, 3, 1, 4096, packed(table))
    want = ngram_lookup_ref(*args)
    assert torch.equal(ngram_lookup(*args, use_triton=True, block=16), want)
    assert not torch.equal(want, ngram_lookup_ref(*args[:-1]))  # the table drafted where the rows alone did not


@pytest.mark.parametrize("seed", range(6))
def test_with_a_table_the_reference_drafts_the_host_drafter_s_chain(seed: int) -> None:
    hist, lens, rows, table = table_case(seed, 1, 3)
    drafter = NgramDrafter(table=table)
    K = 4
    got = drafter.lookup_on_device(hist, lens, int(lens.max()), K)  # CPU tensors: the reference
    from_table = 0
    for b, r in enumerate(rows):
        found = drafter.continuations(r, K, 1) or drafter.table_continuations(r, K, 1)
        want = (found[0] if found else []) + [0] * (K - (len(found[0]) if found else 0))
        assert got[b].tolist() == want, (b, r)
        from_table += not drafter.continuations(r, K, 1) and bool(found)
    assert from_table >= 2


def test_a_table_that_cannot_be_packed_is_left_to_the_host() -> None:
    assert pack_table({(1, 2, 3, 4): (5,)}) is None  # four tokens of context
    assert pack_table({(1,): (1 << TOKEN_BITS,)}) is None  # a token past the key's width
    keys, nxt, probes = pack_table({(2, 1): (5, 6), (3,): (4,), (9,): ()})  # (9,) holds no next token: left out
    assert keys.numel() == 4 and sorted(keys.tolist()) == [-1, -1, pack_key((3,)), pack_key((2, 1))]
    assert {k: v for k, v in zip(keys.tolist(), nxt.tolist()) if k >= 0} == {pack_key((3,)): 4, pack_key((2, 1)): 5}
    # many contexts: at most half the slots full, every key within its probe window of its hash
    entries = {(a, b): (a ^ b,) for a in range(60) for b in range(50)}
    keys, nxt, probes = pack_table(entries)
    assert keys.numel() >= 2 * len(entries) and probes <= MAX_PROBES
    where = {k: i for i, k in enumerate(keys.tolist()) if k >= 0}
    assert len(where) == len(entries)
    for c, v in entries.items():
        i = where[pack_key(c)]
        assert nxt[i] == v[0] and (i - table_hash(pack_key(c))) % keys.numel() < probes
    hist, lens, _, _ = table_case(0)
    drafter = NgramDrafter(table=NgramTable({(1, 2, 3, 4): (5,)}, 4, 4))
    assert torch.equal(drafter.lookup_on_device(hist, lens, int(lens.max()), 3),
                       ngram_lookup_ref(hist, lens, int(lens.max()), 3, 3, 1, 4096))


def test_bad_arguments_are_named() -> None:
    hist, lens, _ = rows_case(0)
    with pytest.raises(ValueError, match="int64"):
        ngram_lookup(hist.to(torch.int32), lens, 10, 2, 3, 1, 64, use_triton=True)
    with pytest.raises(ValueError, match="min_n"):
        ngram_lookup(hist, lens, 10, 2, 1, 2, 64, use_triton=True)
    with pytest.raises(ValueError, match="device table"):
        ngram_lookup(hist, lens, 10, 2, 3, 1, 64, (lens, lens, 1, 4, 1), use_triton=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_kernel_matches_the_reference_on_cuda() -> None:
    hist, lens, _ = rows_case(7, B=64, cap=3000, vocab=6)
    hist, lens = hist.cuda(), lens.cuda()
    want = ngram_lookup_ref(hist, lens, int(lens.max()), 4, 3, 1, 1024)
    assert torch.equal(ngram_lookup(hist, lens, int(lens.max()), 4, 3, 1, 1024), want)
    hist, lens, _, table = table_case(7, B=64)
    table = tuple(t.cuda() if torch.is_tensor(t) else t for t in packed(table))
    hist, lens = hist.cuda(), lens.cuda()
    want = ngram_lookup_ref(hist, lens, int(lens.max()), 4, 3, 1, 1024, table)
    assert torch.equal(ngram_lookup(hist, lens, int(lens.max()), 4, 3, 1, 1024, table), want)
