"""draft.base: trees grown level by level; greedy builders share one top-k and one host copy per level."""

from __future__ import annotations

import pytest
import torch

from draft.base import TreeBuilder, _expand_sampled, expand_all
from draft.tree import TokenTree, mask_to_bits
from verify.sampling import SamplingParams, make_generator

V = 30
GREEDY = SamplingParams(temperature=0)


def test_greedy_picks_best_cumulative_pairs() -> None:
    b = TreeBuilder(5, (2, 2), GREEDY, make_generator(GREEDY))
    root = torch.full((1, V), -10.0)
    root[0, [3, 4, 6]] = torch.tensor([2.0, 1.9, 0.0])
    b.expand(0, root)
    assert b.tokens == [5, 3, 4] and b.parents == [-1, 0, 0]
    level = torch.full((2, V), -10.0)
    level[0, [7, 8]] = torch.tensor([0.0, -0.1])  # children of token 3: near-even, so low cumulative
    level[1, [9]] = 5.0  # token 4's child is almost certain: the best pair overall
    b.expand(1, level)
    assert b.tokens[3:] == [7, 9] and b.parents[3:] == [1, 2]  # (3->7) then (4->9), in parent order
    assert b.build().depths.tolist() == [0, 1, 1, 2, 2]


def test_expanding_together_equals_one_by_one() -> None:
    g = torch.Generator().manual_seed(0)
    table = {}

    def logits_of(b: TreeBuilder, depth: int) -> torch.Tensor:
        return table.setdefault((b.root, depth), torch.randn(len(b.frontier(depth)), V, generator=g) * 2)

    widths = [(2, 2, 1), (3, 1), (1, 1, 1, 1), (4,)]
    sampled = SamplingParams(temperature=0.8, seed=3)
    make = lambda: [TreeBuilder(r, w, GREEDY, make_generator(GREEDY)) for r, w in enumerate(widths)] + [  # noqa: E731
        TreeBuilder(9, (2, 2), sampled, make_generator(sampled))]
    alone, together = make(), make()
    for depth in range(4):
        live = [i for i, w in enumerate(widths + [(2, 2)]) if depth < len(w)]
        rows = [logits_of(alone[i], depth) for i in live]
        for i, r in zip(live, rows):
            alone[i].expand(depth, r)
        expand_all([together[i] for i in live], depth, rows)
    for a, t in zip(alone, together):
        assert (a.tokens, a.parents) == (t.tokens, t.parents)
        assert torch.equal(a.build().depths, t.build().depths)
    assert together[-1].build().draft_probs is not None and together[0].build().draft_probs is None


@pytest.mark.parametrize("n", [1, 5, 63, 64])
def test_host_ancestor_bits_match_the_mask(n: int) -> None:
    """The per-step host bits equal the mask's bits, sign bit included (node 63 of a 64-node chain)."""
    g = torch.Generator().manual_seed(n)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    for par in (parents, [i - 1 for i in range(n)]):
        tree = TokenTree.from_lists(list(range(n)), par)
        assert tree.ancestor_bit_list() == mask_to_bits(tree.ancestor_mask()).tolist()
        assert tree.ancestor_bits().tolist() == tree.ancestor_bit_list()


def test_sampled_children_are_draws_without_replacement() -> None:
    """Many sampled builders grown in one call: the first child follows q and the second follows q with the
    first removed (successive draws without replacement), each builder from its own generator."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7, -2.0]])  # [1, 5]
    q = torch.softmax(logits[0], -1)
    sampled = SamplingParams(temperature=1.0)
    n = 20_000
    builders = [TreeBuilder(0, (2,), sampled, torch.Generator().manual_seed(i)) for i in range(n)]
    expand_all(builders, 0, [logits] * n)
    pairs = torch.zeros(5, 5)
    for b in builders:
        assert b.parents == [-1, 0, 0] and b.tokens[1] != b.tokens[2]
        pairs[b.tokens[1], b.tokens[2]] += 1
    expected = q[:, None] * q[None, :] / (1 - q[:, None])  # P(first a) P(second b | first a)
    expected.fill_diagonal_(0)
    torch.testing.assert_close(pairs / n, expected, atol=0.012, rtol=0)
    assert torch.equal(builders[0].build().draft_probs[0], q)  # the row the children were drawn from


def test_sampled_children_stop_at_the_support() -> None:
    """top-k 2 leaves two tokens with mass: a width of 3 gets two children, never a zero-mass token."""
    sampled = SamplingParams(temperature=0.9, top_k=2)
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(4))
    keep = set(logits[0].topk(2).indices.tolist())
    for seed in range(20):
        b = TreeBuilder(1, (3,), sampled, torch.Generator().manual_seed(seed))
        b.expand(0, logits)
        assert len(b.tokens) == 3 and set(b.tokens[1:]) == keep


def test_an_empty_sampled_frontier_adds_nothing() -> None:
    sampled = SamplingParams(temperature=0.8)
    b = TreeBuilder(1, (2, 2), sampled, torch.Generator().manual_seed(0))
    expand_all([b], 1, [torch.zeros(0, V)])  # depth 1 has no nodes yet
    assert b.tokens == [1] and b.build().draft_probs is None


def test_stacked_sampled_levels_equal_each_builder_alone() -> None:
    """The stacking CUDA steps use (the CPU expands each builder alone), on CPU tensors: builders expanded in
    one call get the children each gets alone from the same generator."""
    sampled = SamplingParams(temperature=0.8)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randn(1, V, generator=g) * 2 for _ in range(4)]
    for seed in range(10):
        make = lambda: [TreeBuilder(i, (3,), sampled, torch.Generator().manual_seed(seed * 10 + i))  # noqa: E731
                        for i in range(4)]
        together, alone = make(), make()
        _expand_sampled(together, 0, rows)
        for b, r in zip(alone, rows):
            _expand_sampled([b], 0, [r])
        assert [(b.tokens, b.parents) for b in together] == [(b.tokens, b.parents) for b in alone]
