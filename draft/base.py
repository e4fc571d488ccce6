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
from verify.sampling import SamplingParams, process_logits


@dataclass(slots=True)
class DraftRequest:
    """What a drafter sees of one sequence. ``token_ids[-1]`` is the root (pending token)."""

    seq_id: str
    token_ids: list[int]  # prompt + output; the root is the last one
    widths: tuple[int, ...]  # draft nodes per depth, already fitted to the sequence's budget
    sampling: SamplingParams
    generator: torch.Generator

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
        front = self.frontier(depth)
        width = self.widths[depth]
        logits = logits.float().cpu()  # [F, V]: choices are host-side Python, and the generator lives on CPU
        if self.sampling.is_greedy:
            self._expand_top(front, logits, width)
        else:
            self._expand_sampled(front, logits, width)

    def _expand_top(self, front: list[int], logits: torch.Tensor, width: int) -> None:
        # Deterministic children (point masses to the verifier): the best `width` (parent, child)
        # pairs by cumulative log-probability.
        logp = torch.log_softmax(logits.float(), dim=-1)  # [F, V]
        top_lp, top_tok = logp.topk(min(width, logp.shape[-1]), dim=-1)  # [F, w]
        cum = torch.tensor([self.cum_logp[f] for f in front])[:, None] + top_lp
        order = cum.flatten().argsort(descending=True)[:width].tolist()
        w = top_lp.shape[1]
        for flat in sorted(order, key=lambda x: (x // w, x % w)):
            f, j = divmod(flat, w)
            self._add(front[f], int(top_tok[f, j]), float(cum[f, j]))

    def _expand_sampled(self, front: list[int], logits: torch.Tensor, width: int) -> None:
        # Children are the first k draws without replacement from the draft's processed distribution q,
        # k fixed before drawing (Sequoia's condition for lossless multi-candidate verification).
        q = process_logits(logits.float(), self.sampling)  # [F, V]
        counts = _allocate(width, [self.cum_logp[f] for f in front])
        for f, k in zip(front, counts):
            row = q[front.index(f)]
            k = min(k, int((row > 0).sum()))
            if k == 0:
                continue
            self.q_rows[f] = row
            for tok in torch.multinomial(row, k, replacement=False, generator=self.generator).tolist():
                self._add(f, tok, self.cum_logp[f] + float(row[tok].log()))

    def _add(self, parent: int, token: int, cum: float) -> None:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.cum_logp.append(cum)

    def build(self, device: torch.device | str = "cpu") -> TokenTree:
        probs = None
        if self.q_rows:
            V = next(iter(self.q_rows.values())).shape[-1]
            probs = torch.zeros(len(self.tokens), V)
            for node, row in self.q_rows.items():
                probs[node] = row
            probs = probs.to(device)
        return TokenTree.from_lists(self.tokens, self.parents, device=device, draft_probs=probs)


def _allocate(width: int, cum_logp: list[float]) -> list[int]:
    """Split ``width`` children among frontier nodes by cumulative probability (largest remainder)."""
    p = torch.tensor(cum_logp).softmax(0) * width
    counts = p.floor().long()
    rest = width - int(counts.sum())
    if rest:
        counts[(p - counts).argsort(descending=True)[:rest]] += 1
    return counts.tolist()
