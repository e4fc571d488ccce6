"""Chain verification (verify/chains.py): greedy chains keep the leading agreements; sampled chains emit every
token with the target's processed distribution, checked by drawing many times from fixed distributions."""

from __future__ import annotations

import torch

from verify.chains import accept_greedy_chains, accept_sampled_chains


def test_greedy_chains_keep_the_leading_agreements_of_offered_places() -> None:
    picks = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [1, 2, 3, 4], [4, 4, 4, 4]])
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [9, 2, 3], [4, 4, 4]])
    offered = torch.tensor([[True] * 3, [True] * 3, [True] * 3, [True, True, False]])
    assert accept_greedy_chains(picks, drafts, offered).tolist() == [3, 1, 0, 2]


def draws(probs: torch.Tensor, drafts: torch.Tensor, offered: torch.Tensor, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    P, D, O = (t.expand(n, *t.shape[1:]) for t in (probs, drafts, offered))
    u = torch.rand(n, drafts.shape[1], generator=g)
    race = torch.empty(n, probs.shape[-1]).exponential_(generator=g)
    return accept_sampled_chains(P, D, O, u, race)


def test_sampled_chains_emit_each_token_with_the_target_s_distribution() -> None:
    """A chain of two drafts over five tokens: the first emitted token is distributed as p_0; where the first
    draft was kept, the second as p_1; where both were kept, the bonus as p_2 (a rejection ends the step).
    400,000 draws; each frequency within 0.005 of its probability (about five standard errors)."""
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.6, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]])
    drafts = torch.tensor([[0, 1]])  # d_1 = 0 (p_0 gives it 0.5), d_2 = 1 (p_1 gives it 0.6)
    n = 400_000
    accepted, emitted = draws(p[None], drafts, torch.tensor([[True, True]]), n, 0)
    first = torch.bincount(emitted[:, 0], minlength=5).float() / n
    assert torch.allclose(first, p[0], atol=0.005)
    kept = emitted[:, 0] == 0  # the first draft was kept: the next token follows p_1
    second = torch.bincount(emitted[kept, 1], minlength=5).float() / kept.sum()
    assert torch.allclose(second, p[1], atol=0.005)
    both = kept & (emitted[:, 1] == 1)  # both kept: the bonus follows p_2
    third = torch.bincount(emitted[both, 2], minlength=5).float() / both.sum()
    assert torch.allclose(third, p[2], atol=0.01)
    # acceptance counts as the drafts' probabilities give them
    assert abs((accepted >= 1).float().mean() - 0.5) < 0.005 and abs((accepted == 2).float().mean() - 0.3) < 0.005
    assert ((emitted >= 0).sum(1) == accepted + 1).all()  # the kept drafts and the bonus, -1 past them


def test_a_shallower_chain_and_a_draft_the_target_excludes() -> None:
    """One offered place of two: the bonus after a kept draft comes from p_1. A draft with zero probability
    (outside the target's top-k, say) is never kept, and the draw after it is p_0 itself."""
    p = torch.tensor([[0.0, 0.7, 0.3], [0.25, 0.25, 0.5], [1.0, 0.0, 0.0]])
    n = 200_000
    accepted, emitted = draws(p[None], torch.tensor([[0, 2]]), torch.tensor([[True, False]]), n, 1)
    assert (accepted == 0).all()  # p_0(0) = 0
    assert torch.allclose(torch.bincount(emitted[:, 0], minlength=3).float() / n, p[0], atol=0.005)
    accepted, emitted = draws(p[None], torch.tensor([[1, 2]]), torch.tensor([[True, False]]), n, 2)
    assert accepted.max() == 1 and abs((accepted == 1).float().mean() - 0.7) < 0.005
    bonus = emitted[accepted == 1, 1]
    assert torch.allclose(torch.bincount(bonus, minlength=3).float() / bonus.numel(), p[1], atol=0.006)
