"""verify.accept: greedy rules with mock logits that always / never / sometimes agree, and statistical
losslessness of stochastic verification (chi-square against the target's own distribution)."""

from __future__ import annotations

import functools
import math
from collections import Counter

import pytest
import torch

from draft.tree import TokenTree
from verify.accept import (AcceptResult, _stochastic_parallel, accept, accept_batch, accept_greedy, accept_stochastic,
                           sample_first)
from verify.sampling import SamplingParams, apply_penalties, process_logits

V = 6


def _agreeing_logits(next_tokens: list[int], vocab: int = V) -> torch.Tensor:
    """[N, V] mock target logits whose argmax at node i is next_tokens[i]."""
    logits = torch.zeros(len(next_tokens), vocab)
    logits[torch.arange(len(next_tokens)), torch.tensor(next_tokens)] = 5.0
    return logits


# --- greedy -----------------------------------------------------------------------------------------

def test_result_properties() -> None:
    result = AcceptResult(accepted_nodes=[0, 2, 5], bonus_token=9, node_tokens=[1, 4, 3])
    assert result.tokens == [4, 3, 9] and result.num_accepted_drafts == 2


def test_greedy_always_agrees_accepts_the_whole_chain() -> None:
    tree = TokenTree.from_lists([1, 2, 3, 4], [-1, 0, 1, 2])
    result = accept_greedy(tree, _agreeing_logits([2, 3, 4, 5]))
    assert result.accepted_nodes == [0, 1, 2, 3] and result.tokens == [2, 3, 4, 5]


def test_greedy_never_agrees_emits_only_the_bonus() -> None:
    tree = TokenTree.from_lists([1, 2, 3, 4], [-1, 0, 1, 2])
    result = accept_greedy(tree, _agreeing_logits([5, 3, 4, 5]))
    assert result.accepted_nodes == [0] and result.tokens == [5] and result.num_accepted_drafts == 0


def test_greedy_stops_at_the_first_mismatch() -> None:
    tree = TokenTree.from_lists([1, 2, 3, 4], [-1, 0, 1, 2])
    result = accept_greedy(tree, _agreeing_logits([2, 0, 4, 5]))  # node 2 would agree, but node 1 does not
    assert result.accepted_nodes == [0, 1] and result.tokens == [2, 0]


def test_greedy_picks_the_right_branch() -> None:
    #        0(1)
    #     /   |   \
    #  1(2) 2(3) 3(4)
    #   |    |  \
    #  4(5) 5(0) 6(5)
    tree = TokenTree.from_lists([1, 2, 3, 4, 5, 0, 5], [-1, 0, 0, 0, 1, 2, 2])
    result = accept_greedy(tree, _agreeing_logits([3, 5, 5, 0, 0, 0, 1]))
    assert result.accepted_nodes == [0, 2, 6] and result.tokens == [3, 5, 1]


def test_greedy_root_only_is_plain_argmax() -> None:
    result = accept_greedy(TokenTree.root_only(3), _agreeing_logits([4]))
    assert result.accepted_nodes == [0] and result.tokens == [4]


def test_accept_greedy_applies_penalties_along_the_path() -> None:
    # Every node scores token 2 at 1.0, token 5 at 0.8, token 0 at 0.3, with a frequency penalty of 0.6.
    # Root [2]: 2 -> 0.4, so 5 wins. Node 1, path [2, 5]: 2 -> 0.4, 5 -> 0.2, so 2 wins.
    # Node 2, path [2, 5, 2]: 2 -> -0.2, 5 -> 0.2, so the bonus is 0.
    tree = TokenTree.from_lists([2, 5, 2], [-1, 0, 1])
    logits = torch.zeros(3, V)
    logits[:, 2], logits[:, 5], logits[:, 0] = 1.0, 0.8, 0.3
    params = SamplingParams(temperature=0, frequency_penalty=0.6)
    result = accept(tree, logits, params, torch.Generator())
    assert result.tokens == [5, 2, 0]
    no_penalty = accept(tree, logits, SamplingParams(temperature=0), torch.Generator())
    assert no_penalty.tokens == [2]  # the root's argmax is 2, and node 1 carries token 5


def test_greedy_keeps_the_deeper_twin_and_stochastic_refuses_twins() -> None:
    """Twin children (a lookup chain appended beside a device tree's branch, TokenTree.with_chains): the greedy
    walk keeps the deeper agreeing path, whichever twin comes first; sampled verification refuses them."""
    for tokens, parents, deep in (([1, 2, 2, 3], [-1, 0, 0, 2], 2), ([1, 2, 2, 3], [-1, 0, 0, 1], 1)):
        tree = TokenTree.from_lists(tokens, parents)
        result = accept_greedy(tree, _agreeing_logits([2, 3, 3, 4]))
        assert result.accepted_nodes == [0, deep, 3] and result.tokens == [2, 3, 4]
    with pytest.raises(ValueError, match="duplicate"):
        accept_stochastic(tree, torch.full((4, V), 1 / V), torch.Generator())


@pytest.mark.parametrize("with_counts", [True, False])
def test_a_one_node_trees_penalties_count_its_root_as_the_path_matrix_does(with_counts: bool) -> None:
    """Plain decoding's one-node tree adds its root to the counts directly; the logits equal those of the path
    matrix (tree_path_counts) for every penalty, with or without earlier outputs, and the counts handed in are
    left as they were."""
    from verify.accept import _penalise
    from verify.sampling import tree_path_counts

    g = torch.Generator().manual_seed(4)
    vocab = 50
    logits = torch.randn(1, vocab, generator=g) * 3
    counts = torch.randint(0, 3, (vocab,), generator=g, dtype=torch.int32) if with_counts else None
    before = None if counts is None else counts.clone()
    prompt = torch.rand(vocab, generator=g) > 0.7
    params = SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    tree = TokenTree.root_only(17)
    got = _penalise(logits, params, prompt, counts, tree)
    want = apply_penalties(logits, params, prompt, counts, tree_path_counts(tree, vocab))
    assert torch.equal(got, want)
    assert counts is None or torch.equal(counts, before)


def test_shape_mismatch_is_rejected() -> None:
    tree = TokenTree.from_lists([1, 2], [-1, 0])
    with pytest.raises(ValueError, match="N=2"):
        accept(tree, torch.zeros(3, V), SamplingParams(), torch.Generator())


# --- stochastic: deterministic corner cases -----------------------------------------------------------

def test_stochastic_one_hot_target_equals_greedy() -> None:
    tree = TokenTree.from_lists([1, 2, 3, 4, 5, 0, 5], [-1, 0, 0, 0, 1, 2, 2])
    logits = _agreeing_logits([3, 5, 5, 0, 0, 0, 1])
    one_hot = process_logits(logits, SamplingParams(temperature=0))
    for seed in range(20):
        assert accept_stochastic(tree, one_hot, torch.Generator().manual_seed(seed)) == accept_greedy(tree, logits)


def test_stochastic_never_accepts_a_token_the_target_excludes() -> None:
    q = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0, 0.0])
    tree = TokenTree.from_lists([0, 1, 2], [-1, 0, 0], draft_probs=q.expand(3, V).clone())
    p = torch.tensor([0.0, 0.0, 0.0, 0.2, 0.3, 0.5]).expand(3, V)
    for seed in range(50):
        result = accept_stochastic(tree, p, torch.Generator().manual_seed(seed))
        assert result.accepted_nodes == [0] and result.bonus_token in (3, 4, 5)


def test_stochastic_draft_equal_to_target_always_accepts() -> None:
    q = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(1)), -1).expand(4, V).clone()
    tree = TokenTree.from_lists([0, 1, 2, 3], [-1, 0, 1, 2], draft_probs=q)
    for seed in range(50):
        assert accept_stochastic(tree, q, torch.Generator().manual_seed(seed)).accepted_nodes == [0, 1, 2, 3]


def test_zero_draft_probability_is_rejected() -> None:
    q = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0]).expand(2, V).clone()
    tree = TokenTree.from_lists([0, 1], [-1, 0], draft_probs=q)  # token 1 cannot have come from q
    with pytest.raises(ValueError, match="zero probability"):
        accept_stochastic(tree, torch.full((2, V), 1 / V), torch.Generator())


def test_batched_plain_draws_equal_one_by_one_accepts() -> None:
    """One-node sampled trees of several processing settings share a step: each sequence still gets the draw
    accept() makes with its own generator, whatever its neighbours (sample_rows per settings group)."""
    settings = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=3),
                SamplingParams(temperature=0), SamplingParams(temperature=0.7), SamplingParams(top_p=0.5),
                SamplingParams(temperature=1.0, top_k=3)]
    logits = torch.randn(len(settings), V, generator=torch.Generator().manual_seed(3))  # [B, V], one row each
    trees = [TokenTree.root_only(i % V) for i in range(len(settings))]
    for seed in range(25):
        gens = [torch.Generator().manual_seed(seed * 100 + i) for i in range(len(settings))]
        batched = accept_batch(trees, logits, list(range(len(settings) + 1)), settings, gens,
                               [(None, None)] * len(settings))
        alone = [accept(t, logits[i : i + 1], p, torch.Generator().manual_seed(seed * 100 + i))
                 for i, (t, p) in enumerate(zip(trees, settings))]
        assert [r.tokens for r in batched] == [r.tokens for r in alone]


def test_a_step_of_many_trees_draws_what_each_tree_alone_draws() -> None:
    """Sampled trees of several shapes, knobs and draft kinds (probabilities or point masses), beside plain and
    greedy sequences, in one accept_batch: every sequence gets the tokens it gets in a batch of its own."""
    g = torch.Generator().manual_seed(11)

    def tree(tokens: list[int], parents: list[int], probs: bool) -> TokenTree:
        q = torch.softmax(torch.randn(len(tokens), V, generator=g), -1) if probs else None
        return TokenTree.from_lists(tokens, parents, draft_probs=q)

    trees = [tree([1, 2, 3, 4], [-1, 0, 0, 1], True), tree([0, 5, 1], [-1, 0, 1], False), TokenTree.root_only(2),
             tree([3, 0, 1, 2, 4], [-1, 0, 0, 0, 1], True), tree([4, 4, 5], [-1, 0, 0], False),
             tree([5, 1, 2], [-1, 0, 0], True), TokenTree.root_only(3)]
    knobs = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(top_p=0.8), SamplingParams(),
             SamplingParams(temperature=0.7), SamplingParams(temperature=0), SamplingParams(top_k=3)]
    starts = [0]
    for t in trees:
        starts.append(starts[-1] + t.num_nodes)
    logits = torch.randn(starts[-1], V, generator=g) * 2  # [R, V]
    none = [(None, None)] * len(trees)
    for seed in range(30):
        together = accept_batch(trees, logits, starts, knobs, [torch.Generator().manual_seed(seed * 10 + i)
                                                               for i in range(len(trees))], none)
        alone = [accept_batch([t], logits[starts[i] : starts[i + 1]], [0, t.num_nodes], [knobs[i]],
                              [torch.Generator().manual_seed(seed * 10 + i)], none[:1])[0] for i, t in enumerate(trees)]
        assert [r.tokens for r in together] == [r.tokens for r in alone]


def test_stacked_tree_decisions_equal_each_tree_alone() -> None:
    """The stacking CUDA steps use (the CPU decides each tree alone), run here on CPU tensors: one call over
    several trees returns, per tree, what a call over that tree alone returns."""
    g = torch.Generator().manual_seed(5)
    shapes = [([1, 2, 3, 4], [-1, 0, 0, 1]), ([0, 5, 1], [-1, 0, 1]), ([3, 0, 1, 2, 4], [-1, 0, 0, 0, 1])]
    trees = [TokenTree.from_lists(t, par, draft_probs=torch.softmax(torch.randn(len(t), V, generator=g), -1))
             for t, par in shapes]
    p = torch.softmax(torch.randn(sum(t.num_nodes for t in trees), V, generator=g), -1)  # [R, V]
    for seed in range(20):
        together = _stochastic_parallel(trees, p, [torch.Generator().manual_seed(seed + i) for i in range(3)])
        R, at = p.shape[0], 0
        for i, t in enumerate(trees):
            n = t.num_nodes
            one = _stochastic_parallel([t], p[at : at + n], [torch.Generator().manual_seed(seed + i)])
            assert torch.equal(together[at : at + n], one[:n])  # children
            assert torch.equal(together[R + at : R + at + n], one[n : 2 * n])  # bonuses
            assert torch.equal(together[2 * R + at : 2 * R + at + n], one[2 * n :])  # flags
            at += n


def test_seeded_runs_reproduce() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(7, V, generator=gen), -1)
    logits = torch.randn(7, V, generator=gen)
    tree = TokenTree.from_lists([1, 2, 3, 4, 5, 0, 5], [-1, 0, 0, 0, 1, 2, 2], draft_probs=q)
    params = SamplingParams(seed=42, top_p=0.9, frequency_penalty=0.5)

    def run() -> list[list[int]]:
        g = torch.Generator().manual_seed(params.seed)  # type: ignore[arg-type]
        return [accept(tree, logits, params, g).tokens for _ in range(200)]

    first = run()
    assert first == run() and len({tuple(t) for t in first}) > 1


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, repetition_penalty=1.3),
                                    SamplingParams(top_k=4, frequency_penalty=0.7, repetition_penalty=1.3)])
def test_sample_first_agrees_with_a_one_node_tree(params: SamplingParams) -> None:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(5))
    prompt_mask = torch.tensor([True, False, False, True, False, False])
    before_root = torch.tensor([0, 1, 0, 0, 2, 0])
    root = 4
    with_root = before_root + torch.nn.functional.one_hot(torch.tensor(root), V)
    for seed in range(30):
        a = sample_first(logits, params, torch.Generator().manual_seed(seed), prompt_mask, with_root)
        b = accept(TokenTree.root_only(root), logits[None], params, torch.Generator().manual_seed(seed),
                   prompt_mask, before_root)
        assert b.tokens == [a]


# --- stochastic: statistical losslessness ---------------------------------------------------------------
# A mock "model" maps a context to logits. The drafter builds trees from a different mock model; the
# verifier sees the target's logits at each node. The emitted tokens must follow the target exactly.

@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors have six entries: intra-op threads only add overhead (badly so on a busy machine)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


PROMPT = (0, 3)
BEFORE_ROOT = (4,)  # generated before the pending root
ROOT = 1


@functools.cache
def _mock_logits(salt: int, context: tuple[int, ...]) -> torch.Tensor:
    seed = salt
    for tok in context:
        seed = (seed * 1_000_003 + tok + 1) % (2**61 - 1)
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 1.5  # [V]


@functools.cache
def _draft_probs(context: tuple[int, ...], params: SamplingParams) -> torch.Tensor:
    """The drafter: correlated with the target (so paths run deep) but far from equal to it."""
    logits = 0.7 * _mock_logits(1, context) + 0.7 * _mock_logits(2, context)  # [V]
    return process_logits(logits[None], params)[0]  # [V]


def _draft_tree(context: tuple[int, ...], widths: tuple[int, ...], draft_params: SamplingParams,
                is_sampled: bool, gen: torch.Generator) -> tuple[TokenTree, list[tuple[int, ...]]]:
    """Grow a tree level by level; children sampled without replacement from q, or q's top-k (point masses)."""
    tokens, parents, contexts = [context[-1]], [-1], [context]
    frontier = [0]
    for width in widths:
        next_frontier = []
        for u in frontier:
            q = _draft_probs(contexts[u], draft_params)
            if is_sampled:
                kids = torch.multinomial(q, width, replacement=False, generator=gen)
            else:
                kids = q.topk(width).indices
            for tok in kids.tolist():
                next_frontier.append(len(tokens))
                tokens.append(tok)
                parents.append(u)
                contexts.append(contexts[u] + (tok,))
        frontier = next_frontier
    draft = torch.stack([_draft_probs(c, draft_params) for c in contexts]) if is_sampled else None  # [N, V]
    return TokenTree.from_lists(tokens, parents, draft_probs=draft), contexts


def _step(context: tuple[int, ...], widths: tuple[int, ...], params: SamplingParams, draft_params: SamplingParams,
          is_sampled: bool, gen: torch.Generator, batched: bool = False) -> list[int]:
    """One engine step: draft, score with the target, accept. context ends with the pending root."""
    tree, contexts = _draft_tree(context, widths, draft_params, is_sampled, gen)
    target_logits = torch.stack([_mock_logits(1, c) for c in contexts])  # [N, V]
    prompt_mask = torch.zeros(V, dtype=torch.bool)
    prompt_mask[list(PROMPT)] = True
    output = context[len(PROMPT):-1]  # generated before this step's root
    output_counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=V)
    if batched:  # the engine's entry point: every node's decisions at once (penalties: one by one)
        return accept_batch([tree], target_logits, [0, tree.num_nodes], [params], [gen],
                            [(prompt_mask, output_counts)])[0].tokens
    return accept(tree, target_logits, params, gen, prompt_mask, output_counts).tokens


def _target_probs(context: tuple[int, ...], params: SamplingParams) -> torch.Tensor:
    """The reference: the target's processed distribution after ``context``, penalties counted by hand."""
    counts = torch.bincount(torch.tensor(context[len(PROMPT):]), minlength=V)  # every generated token, root too
    prompt_mask = torch.zeros(V, dtype=torch.bool)
    prompt_mask[list(PROMPT)] = True
    logits = apply_penalties(_mock_logits(1, context)[None], params, prompt_mask, counts)
    return process_logits(logits, params)[0].double()  # [V]


def _chi2_critical(dof: int, z: float = 4.265) -> float:
    """Upper quantile of chi-square(dof) by Wilson-Hilferty; z = 4.265 is a one-sided 1e-5 tail."""
    c = 2 / (9 * dof)
    return dof * (1 - c + z * math.sqrt(c)) ** 3


def _assert_follows(counts: Counter, probs: dict, num_samples: int) -> None:
    """Chi-square goodness of fit; cells the target gives probability zero must never occur."""
    impossible = [k for k, p in probs.items() if p == 0]
    assert sum(counts[k] for k in impossible) == 0, "emitted a token the target excludes"
    cells = sorted(((probs[k] * num_samples, counts[k]) for k in probs if probs[k] > 0), reverse=True)
    while len(cells) > 2 and cells[-1][0] < 5:  # pool sparse cells so the chi-square approximation holds
        e, o = cells.pop()
        cells[-1] = (cells[-1][0] + e, cells[-1][1] + o)
    stat = sum((o - e) ** 2 / e for e, o in cells)
    assert stat < _chi2_critical(len(cells) - 1), f"chi2 {stat:.1f} over {len(cells) - 1} dof"


CASES = {  # name: (widths, is_sampled, target params, draft params)
    "chain3-sampled": ((1, 1, 1), True, SamplingParams(), SamplingParams(temperature=1.3)),
    "tree-sampled": ((3, 2), True, SamplingParams(), SamplingParams(temperature=0.7)),
    "tree-sampled-topkp-penalties": ((3, 2), True,
                                     SamplingParams(temperature=0.8, top_k=4, top_p=0.9, frequency_penalty=0.5,
                                                    presence_penalty=0.3, repetition_penalty=1.2),
                                     SamplingParams(top_k=3)),  # the draft misses tokens the target keeps
    "tree-point-mass": ((2, 2), False, SamplingParams(), SamplingParams()),
    "chain2-point-mass-topkp": ((1, 1), False, SamplingParams(top_k=5, top_p=0.8), SamplingParams()),
    # min-p and a logit bias on the target alone: the draft proposes the banned token and ones min-p drops
    "tree-sampled-minp-bias": ((3, 2), True, SamplingParams(temperature=0.9, min_p=0.1,
                                                            logit_bias={2: -1.0, 5: -100.0}), SamplingParams()),
    "chain2-point-mass-minp": ((1, 1), False, SamplingParams(min_p=0.3), SamplingParams()),
}


@pytest.mark.parametrize("batched", [False, True], ids=["walk", "parallel"])
@pytest.mark.parametrize("name", list(CASES))
def test_stochastic_verification_is_lossless(name: str, batched: bool) -> None:
    widths, is_sampled, params, draft_params = CASES[name]
    num_samples = 8_000
    gen = torch.Generator().manual_seed(1234)
    start = PROMPT + BEFORE_ROOT + (ROOT,)
    firsts, pairs = Counter(), Counter()
    for _ in range(num_samples):
        tokens = _step(start, widths, params, draft_params, is_sampled, gen, batched)
        if len(tokens) == 1:  # the next step (a fresh tree on the new root) supplies the second token
            tokens += _step(start + (tokens[0],), widths, params, draft_params, is_sampled, gen, batched)
        firsts[tokens[0]] += 1
        pairs[tokens[0], tokens[1]] += 1
    first_probs = _target_probs(start, params)  # [V]
    _assert_follows(firsts, {a: first_probs[a].item() for a in range(V)}, num_samples)
    pair_probs = {(a, b): first_probs[a].item() * _target_probs(start + (a,), params)[b].item()
                  for a in range(V) for b in range(V)}
    _assert_follows(pairs, pair_probs, num_samples)
