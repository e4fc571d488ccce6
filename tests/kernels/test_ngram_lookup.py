"""ngram_lookup: the Triton kernel (interpreted on the CPU) against the reference, and the reference against
the host drafter's lookup, on rows with stale tails, short rows, windows and every n."""

from __future__ import annotations

import pytest
import torch

from draft.ngram import NgramDrafter
from kernels.ngram_lookup import ngram_lookup, ngram_lookup_ref


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


def test_bad_arguments_are_named() -> None:
    hist, lens, _ = rows_case(0)
    with pytest.raises(ValueError, match="int64"):
        ngram_lookup(hist.to(torch.int32), lens, 10, 2, 3, 1, 64, use_triton=True)
    with pytest.raises(ValueError, match="min_n"):
        ngram_lookup(hist, lens, 10, 2, 1, 2, 64, use_triton=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_kernel_matches_the_reference_on_cuda() -> None:
    hist, lens, _ = rows_case(7, B=64, cap=3000, vocab=6)
    hist, lens = hist.cuda(), lens.cuda()
    want = ngram_lookup_ref(hist, lens, int(lens.max()), 4, 3, 1, 1024)
    assert torch.equal(ngram_lookup(hist, lens, int(lens.max()), 4, 3, 1, 1024), want)
