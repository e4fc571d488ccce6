"""The drafter interface and the tree builder shared by every model-based drafter.

A drafter turns each decoding sequence into a ``TokenTree`` rooted at its pending token. Trees are
grown depth by depth: at depth ``d`` the builder keeps ``widths[d-1]`` children in all, chosen from the
frontier by cumulative draft probability (EAGLE-2's expansion rule, without its final re-rank so that
sampled trees stay valid for rejection sampling).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from draft.tree import TokenTree
from verify.sampling import SamplingParams, draws_without_replacement, process_logits, race_scores


@dataclass(slots=True)
class DraftRequest:
    """What a drafter sees of one sequence. ``token_ids[-1]`` is the root (pending token)."""

    seq_id: str
    token_ids: list[int]  # prompt + output; the root is the last one
    widths: tuple[int, ...]  # draft nodes per depth, already fitted to the sequence's budget
    sampling: SamplingParams
    generator: torch.Generator
    # The caller takes the tree deferred (``TokenTree.deferred``): its nodes may stay on the device, for the
    # target's batch to read there and the caller's host copy of the step to resolve.
    defer: bool = False

    @property
    def context_len(self) -> int:
        """Target tokens cached before the root: the root's position."""
        return len(self.token_ids) - 1


class Drafter(Protocol):
    name: str

    def propose(self, reqs: list[DraftRequest]) -> list[TokenTree]:
        """One tree per request, in order. A request with no widths gets a root-only tree."""
        ...

    def commit(self, seq_id: str, tree: TokenTree, accepted_nodes: list[int]) -> None:
        """Keep the draft state of the accepted path; drop the rest."""
        ...

    def flush(self) -> None:
        """Apply the step's queued commits at once (the engine calls it after every step's commits)."""
        ...

    def release(self, seq_id: str) -> None:
        """Forget the sequence and free whatever it holds (finished, aborted or preempted)."""
        ...


@dataclass(slots=True)
class TreeBuilder:
    """Grows one tree level by level. Node 0 is the root; nodes are appended in BFS order."""

    root: int
    widths: tuple[int, ...]
    sampling: SamplingParams
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    cum_logp: list[float] = field(default_factory=list)
    q_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> its children's draft distribution

    def __post_init__(self) -> None:
        self.tokens, self.parents, self.depths, self.cum_logp = [self.root], [-1], [0], [0.0]

    def frontier(self, depth: int) -> list[int]:
        return [i for i, d in enumerate(self.depths) if d == depth]

    def expand(self, depth: int, logits: torch.Tensor) -> None:
        """Add the nodes of ``depth + 1`` from ``logits`` [F, V], one row per frontier node at ``depth``."""
        expand_all([self], depth, [logits])

    def _expand_top(self, front: list[int], top_lp: list[list[float]], top_tok: list[list[int]], width: int) -> None:
        # Deterministic children (point masses to the verifier): the best `width` (parent, child) pairs by
        # cumulative log-probability, added in (parent, rank) order.
        cands = [(self.cum_logp[f] + lp, i, j) for i, f in enumerate(front) for j, lp in enumerate(top_lp[i][:width])]
        best = sorted(cands, key=lambda c: (-c[0], c[1], c[2]))[:width]
        for cum, i, j in sorted(best, key=lambda c: (c[1], c[2])):
            self._add(front[i], top_tok[i][j], cum)

    def _add_sampled(self, front: list[int], q: torch.Tensor, counts: list[int], drawn: list[list[int]],
                     logq: list[list[float]], support: list[int]) -> None:
        # The first min(k, support) draws of each frontier node, in draw order, and the row they came from.
        for i, (f, k) in enumerate(zip(front, counts)):
            k = min(k, support[i])
            if k == 0:
                continue
            self.q_rows[f] = q[i]
            for tok, lp in zip(drawn[i][:k], logq[i][:k]):
                self._add(f, tok, self.cum_logp[f] + lp)

    def _add(self, parent: int, token: int, cum: float) -> None:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.cum_logp.append(cum)

    def build(self) -> TokenTree:
        """The tree on the host; sampled trees keep ``draft_probs`` where the draft computed them."""
        probs = None
        if self.q_rows:
            row = next(iter(self.q_rows.values()))
            probs = row.new_zeros(len(self.tokens), row.shape[-1])
            for node, q in self.q_rows.items():
                probs[node] = q
        return TokenTree.from_lists(self.tokens, self.parents, draft_probs=probs)


def expand_all(builders: list[TreeBuilder], depth: int, rows: list[torch.Tensor]) -> None:
    """Grow each builder by one level from its frontier's logits ``rows[i]`` [F_i, V].

    Greedy builders share one log-softmax and top-k on the draft's device and one host copy for all of
    them; sampled builders that share their processing knobs share one pass and one host copy too, each
    drawing from its own generator (``_expand_sampled``).
    """
    greedy = [i for i, b in enumerate(builders) if b.sampling.is_greedy]
    if greedy:
        k = min(max(builders[i].widths[depth] for i in greedy), rows[greedy[0]].shape[-1])
        top_lp, top_tok = top_logprobs(torch.cat([rows[i] for i in greedy]), k)  # [sum F, k]
        # float64 holds every token id exactly: the ids ride along in the same host copy
        lp, tok = torch.stack((top_lp.double(), top_tok.double())).tolist()
        at = 0
        for i in greedy:
            b, n = builders[i], rows[i].shape[0]
            b._expand_top(b.frontier(depth), lp[at : at + n], [[int(t) for t in r] for r in tok[at : at + n]],
                          b.widths[depth])
            at += n
    sampled: dict[tuple, list[int]] = {}  # by processing knobs; on the CPU one builder a group (as in accept_batch)
    for i, b in enumerate(builders):
        if not b.sampling.is_greedy:
            alone = i if rows[i].device.type != "cuda" else -1
            knobs = (b.sampling.temperature, b.sampling.top_k, b.sampling.top_p, b.sampling.min_p)
            sampled.setdefault(knobs + (alone,), []).append(i)
    for idx in sampled.values():
        _expand_sampled([builders[i] for i in idx], depth, [rows[i] for i in idx])


def _expand_sampled(builders: list[TreeBuilder], depth: int, rows: list[torch.Tensor]) -> None:
    """Sampled children for builders that share their processing: one processing pass and one host copy.

    Children are the first k draws without replacement from the draft's processed distribution q, k fixed
    before drawing (Sequoia's condition for lossless multi-candidate verification). The draws are an
    exponential race (the Gumbel-top-k trick, Kool et al. 2019): ranking tokens by ``q_i / E_i``, E_i ~ Exp(1)
    from the builder's own generator, orders them exactly as successive draws without replacement do, so
    one top-k per row replaces a multinomial and a host copy per frontier node. That is CUDA's form, where
    launches are the cost; the CPU, whose cost is arithmetic, makes the successive draws themselves from the
    level's width in uniforms a row (``draws_without_replacement``) rather than V exponentials.
    """
    q = process_logits(torch.cat(rows).float(), builders[0].sampling)  # [sum F, V] on the draft's device
    fronts = [b.frontier(depth) for b in builders]
    counts = [_allocate(b.widths[depth], [b.cum_logp[f] for f in front]) for b, front in zip(builders, fronts)]
    if q.is_cuda:
        noise = torch.empty_like(q)
    else:  # the level's width in uniforms a frontier row (draws_without_replacement), as the tree loop draws them
        noise = torch.full((q.shape[0], max(b.widths[depth] for b in builders)), 0.5, dtype=torch.float64)
    at = 0
    for b, r in zip(builders, rows):  # this builder's frontier rows, from its own generator
        if q.is_cuda:
            noise[at : at + r.shape[0]].exponential_(generator=b.generator)
        else:
            noise[at : at + r.shape[0], : b.widths[depth]] = torch.rand(r.shape[0], b.widths[depth],
                                                                      generator=b.generator, dtype=torch.float64)
        at += r.shape[0]
    k = min(max((max(c) for c in counts if c), default=0), q.shape[-1])  # an empty frontier draws none
    if k == 0:
        return
    if q.is_cuda:
        drawn = race_scores(q, noise).topk(k, dim=-1).indices  # [sum F, k], in draw order; zero mass ranks last
    else:  # only the first ``support`` draws of a row are kept (below), and those all had mass
        drawn = draws_without_replacement(q, noise[:, :k])[0]
    logq = q.gather(1, drawn).log()
    support = (q > 0).sum(-1, keepdim=True)  # [sum F, 1]
    # float64 holds every token id and count exactly: one host copy for the whole group
    host = torch.cat((drawn.double(), logq.double(), support.double()), dim=1).tolist()  # [sum F, 2k + 1]
    at = 0
    for b, r, front, c in zip(builders, rows, fronts, counts):
        n = r.shape[0]
        block = host[at : at + n]
        b._add_sampled(front, q[at : at + n], c, [[int(t) for t in h[:k]] for h in block],
                       [h[k : 2 * k] for h in block], [int(h[2 * k]) for h in block])
        at += n


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of each row and their log-probabilities, float32. Top-k of the raw
    logits minus one log-sum-exp: no full-vocabulary log-softmax is written (k = 1 is a max)."""
    x = logits.float()
    top, tok = x.max(dim=-1, keepdim=True) if k == 1 else x.topk(k, dim=-1)
    return top - x.logsumexp(dim=-1, keepdim=True), tok


def _allocate(width: int, cum_logp: list[float]) -> list[int]:
    """Split ``width`` children among frontier nodes by cumulative probability (largest remainder)."""
    p = torch.tensor(cum_logp).softmax(0) * width
    counts = p.floor().long()
    rest = width - int(counts.sum())
    if rest:
        counts[(p - counts).argsort(descending=True)[:rest]] += 1
    return counts.tolist()
