"""draft/ngram.py: the indexed lookup finds exactly what a scan of the window finds, as a sequence grows
step by step, across the window's edge, and when an id is reused for another sequence."""

from __future__ import annotations

import random

from draft.base import DraftRequest
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


def test_table_keeps_the_most_frequent_next_tokens_and_backs_off_to_shorter_contexts() -> None:
    from draft.ngram import NgramTable

    texts = [[1, 2, 3, 1, 2, 3, 1, 2, 4], [5, 2, 4, 9, 2, 4]]
    t = NgramTable.build(texts, min_n=1, max_n=2, keep=2, min_count=2)
    assert t.entries[(1, 2)] == (3,)  # 3 twice, 4 once: once is below min_count
    assert t.entries[(2,)] == (4, 3)  # 4 three times, 3 twice
    assert (5,) not in t.entries and (9,) not in t.entries  # seen once
    assert t.next_tokens([7, 1, 2]) == (3,)  # the longest context the table holds
    assert t.next_tokens([7, 8, 2]) == (4, 3)  # (8, 2) unseen: back off to (2,)
    assert t.next_tokens([7, 8]) == ()
    ties = NgramTable.build([[1, 9, 1, 8, 1, 9, 1, 8]], min_n=1, max_n=1, keep=1, min_count=1)
    assert ties.entries[(1,)] == (8,)  # equal counts: the smaller id
    assert t.max_token() == 4


def test_table_round_trips_through_its_file(tmp_path) -> None:
    import random

    from draft.ngram import TABLE_FILE, NgramTable

    rng = random.Random(0)
    texts = [[rng.randrange(30) for _ in range(rng.randrange(5, 60))] for _ in range(20)]
    t = NgramTable.build(texts, min_n=1, max_n=4, keep=3, min_count=1, source="test corpus")
    t.save(tmp_path / TABLE_FILE)
    back = NgramTable.find(tmp_path)
    assert back.entries == t.entries and (back.min_n, back.max_n, back.source) == (1, 4, "test corpus")
    assert NgramTable.find(tmp_path / "elsewhere") is None


def test_the_table_fills_the_branches_the_sequences_own_text_leaves_free() -> None:
    from draft.ngram import NgramTable

    table = NgramTable({(5,): (6, 7), (5, 6): (8,), (6, 8): (9,), (5, 7): (1,)}, 1, 2)
    d = NgramDrafter(table=table)
    # no earlier 5 in the sequence: both branches from the table, each grown by its top token per level
    assert d.table_continuations([3, 4, 5], 3, 2) == [[6, 8, 9], [7, 1]]
    tree = d.propose([DraftRequest("a", [3, 4, 5], (2, 2, 1), None, None)])[0]
    tokens, parents, _ = tree.host()
    assert {tuple(tokens[n] for n in path) for path in _paths(parents)} == {(6, 8, 9), (7, 1)}
    # the sequence's own lookup finds 5 -> 7 first: the table fills the second branch with another first token
    ids = [5, 7, 2, 5]
    assert d.continuations(ids, 3, 2) == [[7, 2, 5]]
    tree = d.propose([DraftRequest("b", ids, (2, 2, 1), None, None)])[0]
    tokens, parents, _ = tree.host()
    paths = {tuple(tokens[n] for n in path) for path in _paths(parents)}
    assert paths == {(7, 2, 5), (6, 8)}  # the tree's 5 nodes are spent before 9
    # both branches found in the sequence's own text: the table is not asked
    d.table = None
    full = NgramDrafter(table=table).propose([DraftRequest("c", [5, 7, 5, 6, 5], (1, 1), None, None)])[0]
    assert full.host()[0][1] == 6  # the latest occurrence's continuation


def _paths(parents: list[int]) -> list[list[int]]:
    """Root-to-leaf node paths (root excluded) of a parent list."""
    leaves = set(range(1, len(parents))) - set(parents)
    out = []
    for leaf in sorted(leaves):
        path, n = [], leaf
        while n > 0:
            path.append(n)
            n = parents[n]
        out.append(path[::-1])
    return out


def test_the_loader_finds_a_drafts_table_and_refuses_another_tokenizers(tmp_path) -> None:
    import pytest

    from draft.ngram import TABLE_FILE, NgramTable
    from gateway.llm import LoadConfig, ngram_table

    NgramTable.build([[1, 2, 3, 1, 2, 3, 900]], min_n=1, max_n=2, min_count=1).save(tmp_path / TABLE_FILE)
    other = LoadConfig(model="elsewhere")  # not the embedded target: no shipped table
    assert ngram_table(other, str(tmp_path), 1000).entries[(1, 2)] == (3,)  # beside the draft model
    assert ngram_table(other, "ngram", 1000) is None
    assert ngram_table(LoadConfig(model="elsewhere", ngram_table="none"), str(tmp_path), 1000) is None
    assert ngram_table(LoadConfig(model="elsewhere", ngram_table=str(tmp_path / TABLE_FILE)), "ngram", 1000)
    with pytest.raises(ValueError, match="another tokenizer"):
        ngram_table(other, str(tmp_path), 512)
    with pytest.raises(ValueError, match="no such file"):
        LoadConfig(model="elsewhere", ngram_table=str(tmp_path / "missing"))
