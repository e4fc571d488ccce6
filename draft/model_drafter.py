"""Drafting with a causal LM over its own paged KV cache: an independent small model, or the target's
first layers (layer-skip self-draft, after LayerSkip / Draft&Verify).

Per sequence the drafter keeps a block table and ``num_cached``, the tokens whose draft K/V are in
place. ``propose`` first catches up on the uncached tokens (the draft's prefill the first time, later
the previous step's bonus token and any accepted leaf), the root included, then grows the tree one depth
at a time. Tree node ``i`` is written at slot ``ctx + i`` -- the same slot the target uses -- so after
acceptance ``commit`` compacts the accepted nodes exactly as the target does.
"""

from __future__ import annotations

import torch

from draft.base import DraftRequest, TreeBuilder, expand_all
from draft.tree import MAX_TREE_NODES, TokenTree, mask_to_bits, template_depths
from draft.tree_loop import GreedyTreeLoop, is_narrowing
from draft.vocab import full_vocab
from target.batch import Segment, build_batch
from target.graphs import CudaGraphRunner
from target.kv_cache import BlockTable, KVCache, NoFreeBlocks
from target.model import Transformer


CATCH_UP_NODES = 16  # the longest per-sequence segment a drafter's forward replays from a graph
# Trees of fewer levels are copied to the host, not deferred: on an H100 (SmolLM2 shapes, random weights, one run
# per arm, bench/results/step_profile_h100.json) a deferred one-level tree made the step slower than a host copy
# (batch 1: 2.16 against 1.98 ms; batch 16: 3.28 against 2.75), while a deferred 2,2,2,1 tree made it faster
# (2.52 against 2.98; 3.87 against 4.75).
DEFER_MIN_DEPTH = 2


class ModelDrafter:
    def __init__(self, name: str, model: Transformer, num_blocks: int, page_size: int, graphs: bool = True,
                 max_model_len: int = 8192, head_vocab: torch.Tensor | None = None) -> None:
        self.name = name
        # ``head_vocab`` [K]: the token ids a cut head drafts over (FR-Spec, draft/vocab.py); None = all of them.
        # The model's logits are then [R, K]; token ids are mapped back as the tree grows, and sampled trees
        # draw from logits scattered back to the vocabulary (-inf elsewhere: q is zero off the cut).
        self.vocab_ids = None if head_vocab is None else head_vocab.to(model.device, torch.int64)
        self.model = model if head_vocab is None else model.cut_head(self.vocab_ids)
        model = self.model
        self.cache: KVCache = model.new_cache(num_blocks, page_size)
        max_blocks = -(-(min(max_model_len, model.config.max_position_embeddings) + MAX_TREE_NODES) // page_size)
        # On CUDA the catch-up and frontier steps (a few tokens per sequence) replay CUDA graphs, all of them
        # captured at start (Engine.capture_graphs). Longer segments -- a prompt's prefill -- run eagerly:
        # a graph for every (batch, prompt length) bucket would be captured mid-serving, a stall per shape.
        self.graphs: CudaGraphRunner | None = None
        if graphs and model.device.type == "cuda":
            self.graphs = CudaGraphRunner(model, self.cache, max_blocks, max_nodes=CATCH_UP_NODES)
        # Trees grow on the device (draft/tree_loop.py); False keeps them on the host builder (tests).
        self.device_loop = True
        self.loop = GreedyTreeLoop(model, self.cache, max_blocks, graphs, vocab_ids=self.vocab_ids)
        self.loop.runner = self.graphs
        self._tables: dict[str, BlockTable] = {}
        self._cached: dict[str, int] = {}
        self._fed: dict[str, list[int]] = {}  # a cut tree's node -> the loop's node (whose slot holds its K/V)
        # Commits queue their K/V moves and table cuts; ``flush`` applies a whole step's in one launch.
        self._moves: dict[str, tuple[list[int], list[int]]] = {}
        self._cuts: dict[str, int] = {}

    def propose(self, reqs: list[DraftRequest]) -> list[TokenTree]:
        self.flush()  # a caller that committed without flushing still drafts from a compacted cache
        trees: list[TokenTree | None] = [None] * len(reqs)
        live = []
        for i, r in enumerate(reqs):
            if r.widths:
                live.append(i)
            else:
                trees[i] = TokenTree.root_only(r.token_ids[-1])
        if live:
            try:
                built = self._grow([reqs[i] for i in live])
            except NoFreeBlocks:
                # The draft pool is full: decode these sequences plainly this step rather than fail them.
                for i in live:
                    self.release(reqs[i].seq_id)
                built = [TokenTree.root_only(reqs[i].token_ids[-1]) for i in live]
            for i, t in zip(live, built):
                trees[i] = t
        return trees  # type: ignore[return-value]

    def _grow(self, reqs: list[DraftRequest]) -> list[TokenTree]:
        self._feed_backlog(reqs)
        segs = []
        for r in reqs:
            table = self._tables.setdefault(r.seq_id, self.cache.new_table())
            start = self._cached.get(r.seq_id, 0)
            segs.append(Segment(table, start, r.token_ids[start:], logits="last"))
        logits, roots = self._catch_up(reqs, segs)  # [B, V]: each root's row
        for r in reqs:
            self._cached[r.seq_id] = len(r.token_ids)
        trees: list[TokenTree | None] = [None] * len(reqs)
        for i, r in enumerate(reqs):
            if not r.widths:  # no levels this step (a grammar-forced or lookup-first chain): the catch-up alone
                trees[i] = TokenTree.root_only(r.token_ids[-1])
        greedy = [i for i, r in enumerate(reqs) if trees[i] is None and r.sampling.is_greedy and self.device_loop]
        if greedy:
            # One loop for every greedy sequence, grown to the union template W (elementwise max of their
            # widths); each tree is then cut to its own widths on the host. One replay and one host copy
            # per step, and graphs keyed by the few templates the budget makes, not by every cut of them.
            depth = max(len(reqs[i].widths) for i in greedy)
            W = tuple(max(reqs[i].widths[d] if d < len(reqs[i].widths) else 0 for i in greedy) for d in range(depth))
            W = self.loop.cover(len(greedy), W)
            tables = [self._tables[reqs[i].seq_id] for i in greedy]
            ctxs = [reqs[i].context_len for i in greedy]
            root_h = None if roots is None else roots[greedy]
            if depth >= DEFER_MIN_DEPTH and all(reqs[i].defer and is_narrowing(reqs[i].widths, W) for i in greedy):
                # Every tree is the grown one's first levels, the last perhaps narrower (the budget's depth cuts,
                # probes, the verify cap's trims): cut on the device, no host copy here. The target's batch reads
                # the nodes there, and the caller's host copy of the step brings them back.
                rows, bits = self.loop.grow_on_device(logits[greedy], ctxs, tables, W, root_h,
                                                      [reqs[i].widths for i in greedy])
                for g, i in enumerate(greedy):
                    n = 1 + sum(reqs[i].widths)
                    # the nodes the draft fed (all but the deepest level) keep the loop's numbers: no map needed
                    self._fed.pop(reqs[i].seq_id, None)
                    trees[i] = TokenTree.deferred(reqs[i].token_ids[-1], template_depths(reqs[i].widths),
                                                  rows[:, g, 1:n], bits[g, 1:n])
            else:
                for i, (tokens, parents, cum) in zip(greedy, self.loop.grow(logits[greedy], ctxs, tables, W, root_h)):
                    tokens[0] = reqs[i].token_ids[-1]
                    if reqs[i].widths == W:
                        self._fed.pop(reqs[i].seq_id, None)
                    else:
                        tokens, parents, kept = prune_tree(tokens, parents, cum, W, reqs[i].widths)
                        self._fed[reqs[i].seq_id] = kept
                    trees[i] = TokenTree.from_lists(tokens, parents)
        sampled: dict[tuple[int, ...], list[int]] = {}  # by widths: a sampled tree cannot be grown wider and cut
        for i, r in enumerate(reqs):
            if trees[i] is None and not r.sampling.is_greedy and self.device_loop:
                sampled.setdefault(r.widths, []).append(i)
        for widths, idx in sampled.items():
            grown = self.loop.grow_sampled(logits[idx], [reqs[i].context_len for i in idx],
                                           [self._tables[reqs[i].seq_id] for i in idx], widths,
                                           [reqs[i].sampling for i in idx], [reqs[i].generator for i in idx],
                                           None if roots is None else roots[idx])
            for i, (tokens, parents, valid, q) in zip(idx, grown):
                tokens[0] = reqs[i].token_ids[-1]
                if all(valid):
                    self._fed.pop(reqs[i].seq_id, None)
                    trees[i] = TokenTree.from_lists(tokens, parents, draft_probs=q)
                    continue
                # draws past q's support, which the host builder never adds: cut them (they have no children)
                kept = [n for n, v in enumerate(valid) if v]
                index = {n: k for k, n in enumerate(kept)}
                self._fed[reqs[i].seq_id] = kept
                trees[i] = TokenTree.from_lists([tokens[n] for n in kept], [-1] + [index[parents[n]] for n in kept[1:]],
                                                draft_probs=q[kept])
        rest = [i for i, t in enumerate(trees) if t is None]
        if rest:
            built = self._grow_on_host([reqs[i] for i in rest], [self._full(logits[i : i + 1]) for i in rest],
                                       None if roots is None else [roots[i] for i in rest])
            for i, tree in zip(rest, built):
                trees[i] = tree
        return trees  # type: ignore[return-value]

    def _feed_backlog(self, reqs: list[DraftRequest]) -> None:
        """Feed the uncached tokens of sequences that lag by more than ``CATCH_UP_NODES`` in pieces of at most
        that many, until each has at most ``CATCH_UP_NODES`` left for the catch-up proper.

        A sequence lags while it does not draft with this model: plain steps (the budget turned speculation
        down), and steps a prompt lookup drafted alone (``HybridDrafter``). One long catch-up segment runs
        eagerly, at a new shape; a batch of sixteen sequences then nearly always holds one, and every step
        paid an eager draft forward. Pieces replay the catch-up graphs instead. A first prefill (nothing
        cached yet) is still fed whole: one eager forward, once per sequence."""
        while True:
            behind, segs = [], []
            for r in reqs:
                start = self._cached.get(r.seq_id, 0)
                left = len(r.token_ids) - start
                if start == 0 or left <= CATCH_UP_NODES:
                    continue
                n = min(CATCH_UP_NODES, left - CATCH_UP_NODES)
                behind.append(r)
                segs.append(Segment(self._tables[r.seq_id], start, r.token_ids[start : start + n], logits="last"))
            if not behind:
                return
            self._catch_up(behind, segs)
            for r, s in zip(behind, segs):
                self._cached[r.seq_id] = s.context_len + len(s.tokens)

    def _catch_up(self, reqs: list[DraftRequest], segs: list[Segment]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed each sequence's uncached tokens; the roots' logits ``[B, V]``, and whatever else the tree
        growth needs of each root (a feature draft's features; None here)."""
        return self._forward(build_batch(segs, self.cache, self.model.device)), None

    def _grow_on_host(self, reqs: list[DraftRequest], rows: list[torch.Tensor],
                      roots: list[torch.Tensor] | None = None) -> list[TokenTree]:
        """Sampled trees (children drawn from the draft's distribution), level by level from the host."""
        builders = [TreeBuilder(r.token_ids[-1], r.widths, r.sampling, r.generator) for r in reqs]
        for depth in range(max(len(r.widths) for r in reqs)):
            active = [i for i, r in enumerate(reqs) if depth < len(r.widths)]
            expand_all([builders[i] for i in active], depth, [rows[i] for i in active])
            deeper = [i for i in active if depth + 1 < len(reqs[i].widths)]
            if deeper:
                self._score_frontier([reqs[i] for i in deeper], [builders[i] for i in deeper], depth + 1, rows, deeper)
        return [b.build() for b in builders]

    def _score_frontier(self, reqs: list[DraftRequest], builders: list[TreeBuilder], depth: int,
                        rows: list[torch.Tensor], index: list[int]) -> None:
        """Feed every non-root node grown so far (ancestor-masked); keep logits of the nodes at ``depth``."""
        segs = []
        for r, b in zip(reqs, builders):
            nodes = list(range(1, len(b.tokens)))
            anc = TokenTree.from_lists(b.tokens, b.parents).ancestor_mask()[1:, 1:]  # root is in the prefix
            segs.append(Segment(
                self._tables[r.seq_id], r.context_len + 1, [b.tokens[n] for n in nodes],
                positions=[r.context_len + b.depths[n] for n in nodes],
                mask_bits=mask_to_bits(anc).tolist(), logits="all"))
        batch = build_batch(segs, self.cache, self.model.device)
        logits = self._forward(batch)  # [sum nodes, V]
        for k, (seg_i, b) in enumerate(zip(index, builders)):
            lo = batch.logits_start[k]
            front = b.frontier(depth)
            rows[seg_i] = self._full(logits[[lo + n - 1 for n in front]])

    def _full(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits ``[R, V]`` over the vocabulary from a cut head's ``[R, K]``: -inf off the cut."""
        return full_vocab(logits, self.vocab_ids, self.model.config.vocab_size)

    def _forward(self, batch) -> torch.Tensor:
        return (self.graphs.forward if self.graphs is not None else self.model.forward)(batch, self.cache)

    def commit(self, seq_id: str, tree: TokenTree, accepted_nodes: list[int]) -> None:
        table = self._tables.get(seq_id)
        if table is None:
            return
        ctx = self._cached[seq_id] - 1  # the root's slot
        depths = tree.host()[2]
        deepest_fed = max(depths) - 1  # leaves were never fed through the draft
        path = [n for n in accepted_nodes[1:] if depths[n] <= deepest_fed]
        fed = self._fed.pop(seq_id, None)
        if fed is not None:  # the tree was cut from a larger loop tree: K/V sit at the loop's slots
            path = [fed[n] for n in path]
        moves = [(ctx + n, ctx + d) for d, n in enumerate(path, start=1) if n != d]
        if moves:
            self._moves[seq_id] = (table.slots_of([s for s, _ in moves]), table.slots_of([d for _, d in moves]))
        self._cached[seq_id] = ctx + 1 + len(path)
        self._cuts[seq_id] = self._cached[seq_id]  # after the moves: their sources may lie past the cut

    def flush(self) -> None:
        """Every queued sequence's moves in one compaction (each sequence's list keeps the kernel's order
        invariant; sequences never share a slot), then the tables give back their spare blocks."""
        if self._moves:
            src = [s for moves in self._moves.values() for s in moves[0]]
            dst = [d for moves in self._moves.values() for d in moves[1]]
            self.cache.compact_slots(src, dst)
            self._moves.clear()
        for seq_id, n in self._cuts.items():
            self._tables[seq_id].truncate(n)
        self._cuts.clear()

    def release(self, seq_id: str) -> None:
        self._moves.pop(seq_id, None)
        self._cuts.pop(seq_id, None)
        self._fed.pop(seq_id, None)
        table = self._tables.pop(seq_id, None)
        self._cached.pop(seq_id, None)
        if table is not None:
            table.release()


def prune_tree(tokens: list[int], parents: list[int], cum: list[float], W: tuple[int, ...],
               widths: tuple[int, ...]) -> tuple[list[int], list[int], list[int]]:
    """Cut a tree grown with widths ``W`` (BFS, level by level) to ``widths``: per level, the best
    ``widths[d]`` nodes by cumulative log-probability among children of kept nodes, in their original
    order. Returns tokens, parents and each kept node's index in the grown tree."""
    kept, index = [0], {0: 0}
    lo = 1
    for d, w in enumerate(W):
        hi = lo + w
        if d < len(widths):
            cands = [i for i in range(lo, hi) if parents[i] in index]
            for i in sorted(sorted(cands, key=lambda i: -cum[i])[: widths[d]]):
                index[i] = len(kept)
                kept.append(i)
        lo = hi
    return [tokens[i] for i in kept], [-1] + [index[parents[i]] for i in kept[1:]], kept
