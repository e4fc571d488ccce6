"""Verifying chains of deterministic drafts (prompt lookup) on the device, greedy and sampled, with no host read.

A chain is a root and up to K drafted tokens ``d_1..d_k``; row ``i`` of its logits scores the token after
node ``i``. Greedy: node i's draft is kept while it equals the target's argmax, and the emitted tokens are
the argmaxes up to the first disagreement. Sampled: a draft that puts all its mass on ``d`` is speculative
sampling's proposal ``q = delta_d``, so ``d`` is kept with probability ``min(1, p(d) / q(d)) = p(d)``, and on a
rejection the token is drawn from ``max(0, p - q)`` normalised: ``p`` with ``d`` removed (Leviathan et al.,
"Fast Inference from Transformers via Speculative Decoding"; Chen et al., "Accelerating Large Language Model
Decoding with Speculative Sampling"). After k kept drafts the bonus is drawn from ``p_k``. Every emitted token
is then distributed as if sampled from the target's processed distribution one at a time.

The uniforms and exponentials come from each request's own generator, so a seeded request repeats its draws
(the chain's, not plain decoding's: another schedule of draws, the same distribution).
"""

from __future__ import annotations

import torch

from verify.sampling import race_argmax


def accept_greedy_chains(picks: torch.Tensor, drafts: torch.Tensor, offered: torch.Tensor) -> torch.Tensor:
    """Accepted drafts per chain [B]: picks [B, K + 1] (the target's argmax after each node), drafts [B, K],
    offered [B, K] bool (the places each chain drafted). The emitted tokens are ``picks[:, :accepted + 1]``."""
    agree = (picks[:, : drafts.shape[1]] == drafts) & offered
    return agree.to(torch.int64).cumprod(1).sum(1)


def accept_sampled_chains(probs: torch.Tensor, drafts: torch.Tensor, offered: torch.Tensor, u: torch.Tensor,
                          race: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of deterministic chains (see the module's docstring), every chain at once.

    probs [B, K + 1, V]: the target's processed distribution after each node (rows past a chain's depth are
    never read); drafts [B, K]; offered [B, K] bool; u [B, K] uniforms in [0, 1); race [B, V] Exp(1) draws for
    the bonus. Returns (accepted [B], emitted [B, K + 1]): the kept drafts, then the bonus at place
    ``accepted``; places past it hold -1."""
    B, K1, V = probs.shape
    K = K1 - 1
    p_draft = probs[:, :K].gather(2, drafts.clamp(0, V - 1)[:, :, None])[:, :, 0]  # [B, K]: p_i(d_{i+1})
    keep = (u < p_draft) & offered
    accepted = keep.to(torch.int64).cumprod(1).sum(1)  # [B]
    at = torch.arange(B, device=probs.device)
    p = probs[at, accepted]  # [B, V]: the distribution after the last kept node
    rejected = accepted < offered.sum(1)  # stopped at a draft it offered: that draft leaves the distribution
    drop = drafts.gather(1, accepted.clamp(max=max(K - 1, 0))[:, None])[:, 0] if K else accepted
    p = torch.where(rejected[:, None] & (torch.arange(V, device=p.device)[None, :] == drop[:, None]), 0.0, p)
    bonus = race_argmax(p, race)  # the race needs no normalising: argmax of p / E is a draw from p / sum(p)
    places = torch.arange(K1, device=probs.device)[None, :]
    emitted = torch.where(places < accepted[:, None], torch.cat([drafts, drafts[:, :1]], 1), -1)
    emitted = torch.where(places == accepted[:, None], bonus[:, None], emitted)
    return accepted, emitted
