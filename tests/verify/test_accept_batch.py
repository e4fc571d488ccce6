"""verify.accept.accept_batch: a whole step's verification equals ``accept`` sequence by sequence, draw
for draw, for greedy trees, plain sampled decodes and requests with penalties. Stochastic trees take the
parallel path, whose draws differ from the walk's: tests/verify/test_accept.py checks its distribution."""

from __future__ import annotations

import pytest
import torch

from draft.tree import TokenTree
from verify.accept import accept, accept_batch
from verify.sampling import SamplingParams, make_generator

V = 40


def _trees(g: torch.Generator) -> list[TokenTree]:
    tok = lambda n: torch.randint(0, V, (n,), generator=g).tolist()  # noqa: E731
    chain = TokenTree.from_lists(tok(4), [-1, 0, 1, 2])
    wide = TokenTree.from_lists([7, 1, 2, 3, 4, 5], [-1, 0, 0, 0, 1, 2])
    return [chain, wide, TokenTree.root_only(tok(1)[0]), TokenTree.root_only(3), wide, TokenTree.root_only(5)]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0),  # greedy chain: shared copy
        SamplingParams(temperature=0),  # greedy tree: shared copy
        SamplingParams(temperature=0.8, top_k=10, seed=1),  # sampled decode: shared copy
        SamplingParams(temperature=1.0, top_p=0.9, seed=2),  # sampled decode: shared copy
        SamplingParams(temperature=0.7, seed=3),  # stochastic tree: parallel (not compared draw for draw)
        SamplingParams(temperature=0.9, repetition_penalty=1.3, seed=4),  # penalties: one by one
    ]


def _penalties(trees: list[TokenTree]) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    prompt = torch.zeros(V, dtype=torch.bool)
    prompt[[1, 2, 3]] = True
    counts = torch.bincount(torch.tensor([4, 4, 5]), minlength=V)
    return [(None, None)] * (len(trees) - 1) + [(prompt, counts)]


def _starts(trees: list[TokenTree]) -> list[int]:
    """Each tree's first row in a step's logits, and the end."""
    starts = [0]
    for t in trees:
        starts.append(starts[-1] + t.num_nodes)
    return starts


def test_batch_equals_one_by_one_for_every_path() -> None:
    g = torch.Generator().manual_seed(0)
    trees, params = _trees(g), _params()
    starts = _starts(trees)
    for trial in range(20):
        logits = torch.randn(starts[-1], V, generator=g) * 3
        # plant agreement so greedy walks go deep on some trials
        if trial % 2:
            logits[0, trees[0].tokens[1]] = 50.0
            logits[1, trees[0].tokens[2]] = 50.0
            logits[starts[1], 2] = 50.0
        gens_a = [make_generator(SamplingParams(seed=trial * 10 + k)) for k in range(len(trees))]
        gens_b = [make_generator(SamplingParams(seed=trial * 10 + k)) for k in range(len(trees))]
        batch = accept_batch(trees, logits, starts, params, gens_a, _penalties(trees))
        single = [accept(t, logits[starts[k] : starts[k + 1]], params[k], gens_b[k], *_penalties(trees)[k])
                  for k, t in enumerate(trees)]
        same = [k for k in range(len(trees)) if k != 4]
        assert [batch[k].accepted_nodes for k in same] == [single[k].accepted_nodes for k in same]
        assert [batch[k].tokens for k in same] == [single[k].tokens for k in same]
        path = batch[4].accepted_nodes  # a root-to-node path of the wide tree, one token per node + bonus
        assert path[0] == 0 and all(trees[4].parents[b] == a for a, b in zip(path, path[1:]))
        assert len(batch[4].tokens) == len(path)
        if trial % 2:
            assert batch[0].accepted_nodes == [0, 1, 2] and batch[1].accepted_nodes[:2] == [0, 2]


def test_batch_of_only_plain_decodes_and_of_nothing() -> None:
    trees = [TokenTree.root_only(i) for i in range(3)]
    logits = torch.zeros(3, V)
    logits[torch.arange(3), torch.tensor([9, 8, 7])] = 1.0
    out = accept_batch(trees, logits, [0, 1, 2, 3], [SamplingParams(temperature=0)] * 3,
                       [make_generator(SamplingParams(seed=0))] * 3, [(None, None)] * 3)
    assert [r.tokens for r in out] == [[9], [8], [7]] and all(r.accepted_nodes == [0] for r in out)
    assert accept_batch([], torch.zeros(0, V), [0], [], [], []) == []


def test_a_zero_probability_draft_token_is_named_by_the_parallel_path_too() -> None:
    q = torch.zeros(2, V)
    q[0, 2] = 1.0
    tree = TokenTree.from_lists([0, 1], [-1, 0], draft_probs=q)  # token 1 cannot have come from q
    with pytest.raises(ValueError, match="zero probability"):
        accept_batch([tree], torch.zeros(2, V), [0, 2], [SamplingParams(temperature=1.0, seed=0)],
                     [make_generator(SamplingParams(seed=0))], [(None, None)])


def _deferred(tree: TokenTree) -> TokenTree:
    """``tree`` as a drafter's device loop hands it over: nodes on the device, host lists unread."""
    tokens, parents, depths = tree.host()
    rows = torch.tensor([tokens[1:], parents[1:]], dtype=torch.int64)
    return TokenTree.deferred(tokens[0], depths, rows, tree.ancestor_bits()[1:])


def test_deferred_trees_resolve_in_the_one_host_copy() -> None:
    """Deferred greedy trees among every other kind: resolved from the step's copy, verified as if built on the
    host, and every other sequence's result unchanged."""
    g = torch.Generator().manual_seed(1)
    trees, params = _trees(g), _params()
    starts = _starts(trees)
    for trial in range(10):
        logits = torch.randn(starts[-1], V, generator=g) * 3
        logits[starts[0], trees[0].host()[0][1]] += 20 * (trial % 2)  # some walks go deep
        logits[starts[1], 1] += 20 * (trial % 3 == 0)
        results = []
        for defer in (False, True):
            ts = [_deferred(t) if defer and k < 2 else t for k, t in enumerate(trees)]
            gens = [make_generator(p, "cpu") for p in params]
            results.append(accept_batch(ts, logits, starts, params, gens, _penalties(ts)))
            if defer:
                assert all(t.pending is None for t in ts) and [t.host() for t in ts[:2]] == [t.host() for t in trees[:2]]
        assert [(r.accepted_nodes, r.tokens) for r in results[0]] == [(r.accepted_nodes, r.tokens) for r in results[1]]


def test_a_deferred_tree_is_verified_greedily_only() -> None:
    tree = TokenTree.from_lists([7, 1, 2], [-1, 0, 1])
    logits = torch.randn(3, V)
    for p in (SamplingParams(temperature=0.7, seed=0), SamplingParams(temperature=0, repetition_penalty=1.2)):
        with pytest.raises(ValueError, match="deferred tree is verified greedily"):
            accept_batch([_deferred(tree)], logits, [0, 3], [p], [make_generator(p, "cpu")], [(None, None)])
    with pytest.raises(RuntimeError, match="deferred tree"):
        _deferred(tree).host()
