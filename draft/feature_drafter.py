"""Drafting with a feature draft: a small head that reads the target's own features (EAGLE, Li et al. 2024).

A plain small LM guesses the next token from tokens alone, and a three-layer one agrees with a 30-layer
target far less often than the target agrees with itself. A feature draft is fed, beside each token
``x_p``, the target's feature at the position before it, ``f_{p-1}`` (the final-normed hidden state the
target's LM head reads): most of what the target knows about the next token is already in that vector.
The draft's input is ``fc([embed(x_p), f_{p-1}])``, then its own decoder layer(s), norm and the target's
LM head; its output feature at ``p`` stands in for ``f_p`` when the tree grows past what the target has
verified.

State per sequence, beside ``ModelDrafter``'s block table and ``num_cached``:

* the target features of verified positions not yet fed (``observe``: the engine hands over every
  prefill chunk's rows and each step's root and accepted nodes);
* nothing of the tree: the draft K/V of tree nodes were computed from the draft's own features, so
  ``commit`` keeps only the root (fed with a true feature) and the next ``propose`` re-feeds the accepted
  tokens with the target's features -- EAGLE does the same.

Positions whose feature never arrives -- a prompt prefix taken from the target's prefix cache -- are fed a
zero feature: the draft guesses worse there, and output never changes (the target verifies every token).
"""

from __future__ import annotations

import torch

from draft.base import DraftRequest, TreeBuilder, expand_all
from draft.model_drafter import ModelDrafter
from draft.tree import TokenTree, mask_to_bits
from target.batch import Segment, build_batch
from target.model import Transformer


class FeatureDrafter(ModelDrafter):
    wants_features = True  # the engine's target forward returns features and calls ``observe``

    def __init__(self, name: str, model: Transformer, num_blocks: int, page_size: int, graphs: bool = True,
                 max_model_len: int = 8192, head_vocab: torch.Tensor | None = None) -> None:
        if model.fc is None:
            raise ValueError(f"drafter {name!r}: the model has no feature input (fc.weight): load it as a plain draft")
        super().__init__(name, model, num_blocks, page_size, graphs, max_model_len, head_vocab)
        if self.graphs is not None:
            self.graphs.hidden = True  # catch-up steps also return the roots' features
        self._feats: dict[str, list[tuple[int, torch.Tensor]]] = {}  # seq -> (first position, [n, hidden]) chunks

    def observe(self, seq_id: str, pos: int, features: torch.Tensor) -> None:
        """The target's features ``[n, hidden]`` of positions ``pos .. pos + n - 1``. While the sequence
        decodes without drafting, one chunk arrives per step: runs of adjacent chunks are merged."""
        chunks = self._feats.setdefault(seq_id, [])
        chunks.append((pos, features))
        if len(chunks) >= 32 and all(a + f.shape[0] == b for (a, f), (b, _) in zip(chunks, chunks[1:])):
            self._feats[seq_id] = [(chunks[0][0], torch.cat([f for _, f in chunks]))]

    def _features(self, seq_id: str, lo: int, hi: int) -> torch.Tensor:
        """``[hi - lo, hidden]``: the target's features of positions ``lo - 1 .. hi - 2`` (what tokens
        ``lo .. hi - 1`` are fed with); zeros where none arrived. Drops chunks no later call can need.
        A step's usual ask -- the previous step's root and accepted nodes -- is one chunk: a view, no copy."""
        chunks = self._feats.get(seq_id, [])
        pieces, at = [], lo - 1  # position the next piece starts at
        for start, f in sorted(chunks, key=lambda c: c[0]):
            a, b = max(start, at), min(start + f.shape[0], hi - 1)
            if a >= b:
                continue
            if a > at:
                pieces.append(self._zeros(a - at))
            pieces.append(f[a - start : b - start])
            at = b
        if at < hi - 1:
            pieces.append(self._zeros(hi - 1 - at))
        # the next call starts at hi - 1 at the earliest (the root is re-fed only after a commit cut it)
        self._feats[seq_id] = [(s, f) for s, f in chunks if s + f.shape[0] > hi - 2]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, self.model.config.hidden_size, dtype=self.model.dtype, device=self.model.device)

    def _catch_up(self, reqs: list[DraftRequest], segs: list[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token is fed with the target's feature of the position before it; returns the roots' logits
        and the roots' own output features ``[B, hidden]`` (what their children are fed)."""
        feats = [self._features(r.seq_id, s.context_len, s.context_len + len(s.tokens)) for r, s in zip(reqs, segs)]
        batch = build_batch(segs, self.cache, self.model.device)
        forward = self.graphs.forward_hidden if self.graphs is not None else self.model.forward_hidden
        logits, hidden = forward(batch, self.cache, torch.cat(feats))  # [B, V]; [T, hidden]
        return logits, hidden.index_select(0, batch.logits_indices)  # the logits rows are the roots

    def _grow_on_host(self, reqs: list[DraftRequest], rows: list[torch.Tensor],
                      roots: list[torch.Tensor] | None = None) -> list[TokenTree]:
        """Sampled trees, level by level from the host; node ``i`` is fed its parent's output feature."""
        builders = [TreeBuilder(r.token_ids[-1], r.widths, r.sampling, r.generator) for r in reqs]
        assert roots is not None
        node_h = [[h] for h in roots]  # per sequence: each node's output feature, by node index
        for depth in range(max(len(r.widths) for r in reqs)):
            active = [i for i, r in enumerate(reqs) if depth < len(r.widths)]
            expand_all([builders[i] for i in active], depth, [rows[i] for i in active])
            deeper = [i for i in active if depth + 1 < len(reqs[i].widths)]
            if not deeper:
                continue
            segs, feeds = [], []
            for i in deeper:
                r, b = reqs[i], builders[i]
                nodes = list(range(1, len(b.tokens)))
                anc = TokenTree.from_lists(b.tokens, b.parents).ancestor_mask()[1:, 1:]  # root is in the prefix
                segs.append(Segment(self._tables[r.seq_id], r.context_len + 1, [b.tokens[n] for n in nodes],
                                    positions=[r.context_len + b.depths[n] for n in nodes],
                                    mask_bits=mask_to_bits(anc).tolist(), logits="all"))
                feeds.append(torch.stack([node_h[i][b.parents[n]] for n in nodes]))
            batch = build_batch(segs, self.cache, self.model.device)
            forward = self.graphs.forward_hidden if self.graphs is not None else self.model.forward_hidden
            logits, hidden = forward(batch, self.cache, torch.cat(feeds))
            for k, i in enumerate(deeper):
                b, lo = builders[i], batch.logits_start[k]
                n_fed = len(b.tokens) - 1
                node_h[i] = [node_h[i][0]] + list(hidden[lo : lo + n_fed])  # rows of nodes 1.. in order
                rows[i] = self._full(logits[[lo + n - 1 for n in b.frontier(depth + 1)]])
        return [b.build() for b in builders]

    def commit(self, seq_id: str, tree: TokenTree, accepted_nodes: list[int]) -> None:
        """Keep the root's K/V only: the accepted nodes are re-fed next step with the target's features."""
        if seq_id not in self._tables:
            return
        ctx = self._cached[seq_id] - 1  # the root's slot
        self._fed.pop(seq_id, None)
        self._cached[seq_id] = ctx + 1
        self._cuts[seq_id] = ctx + 1

    def release(self, seq_id: str) -> None:
        self._feats.pop(seq_id, None)
        super().release(seq_id)
