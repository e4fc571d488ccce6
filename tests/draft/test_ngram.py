"""draft/ngram.py: the indexed lookup finds exactly what a scan of the window finds, as a sequence grows
step by step, across the window's edge, and when an id is reused for another sequence."""

from __future__ import annotations

import random

from draft.ngram import NgramDrafter


def scan(ids: list[int], depth: int, branches: int, min_n: int, max_n: int, window: int) -> list[list[int]]:
    """The plain scan: longest n first, most recent earlier occurrence first, distinct continuations."""
    found: list[list[int]] = []
    hist = ids[-window:]
    for n in range(min(max_n, len(hist) - 1), min_n - 1, -1):
        for start in range(len(hist) - n - 1, -1, -1):
            if hist[start : start + n] == hist[-n:]:
                cont = hist[start + n : start + n + depth]
                if cont and cont not in found:
                    found.append(cont)
                    if len(found) == branches:
                        return found
    return found


def test_indexed_lookup_equals_the_scan_as_sequences_grow() -> None:
    rng = random.Random(0)
    for trial in range(30):
        min_n, max_n = rng.choice([(1, 3), (2, 4), (1, 1)])
        window = rng.choice([8, 32, 4096])
        drafter = NgramDrafter(max_ngram=max_n, min_ngram=min_n, window=window)
        vocab = rng.choice([3, 6, 20])
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        for _ in range(40):
            depth, branches = rng.randint(1, 5), rng.randint(1, 4)
            got = drafter.continuations(ids, depth, branches, seq_id="s")
            assert got == scan(ids, depth, branches, min_n, max_n, window), (trial, ids)
            ids = ids + [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]  # a step's accepted tokens


def test_a_reused_id_or_a_released_one_starts_a_fresh_index() -> None:
    d = NgramDrafter()
    a = [1, 2, 3, 1, 2, 3, 1, 2]
    assert d.continuations(a, 2, 1, seq_id="x") == [[3, 1]]
    b = [7, 8, 9, 7, 8]  # shorter and different under the same id
    assert d.continuations(b, 2, 1, seq_id="x") == scan(b, 2, 1, 1, 3, 4096) == [[9, 7]]
    c = [7, 8, 5, 5, 7, 8]  # same length as a prefix check would allow, different tokens
    d.release("x")
    assert d.continuations(c, 1, 2, seq_id="x") == scan(c, 1, 2, 1, 3, 4096)
    assert d.continuations(c, 1, 2) == scan(c, 1, 2, 1, 3, 4096)  # no id: a one-off index
