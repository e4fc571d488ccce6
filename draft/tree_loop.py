"""Greedy draft trees grown on the device: no host copy until the tree is whole.

For a greedy request the tree's shape per level is fixed by its ``widths``; only each child's token and
the frontier node it hangs from are data. Both stay on the device. Level ``d + 1`` comes from level
``d``'s logits with the same rule as ``TreeBuilder._expand_top`` (EAGLE-2's expansion): the top ``w``
children of every frontier node, then the best ``w`` of those by cumulative log-probability, kept in
(parent, rank) order. The new nodes' ancestor bits are their parents' bits plus their own, and every
non-root node so far is fed through the draft (the root is already in its cache) to score the next level.
The leaves are never fed.

Node ``i`` of a sequence whose root sits at position ``ctx`` is written at cache slot ``ctx + i`` and
RoPE position ``ctx + depth(i)``: the layout ``ModelDrafter`` and the target use, so ``commit`` works as
for host-built trees.

On CUDA the whole loop -- every level's top-k, bit gathers and draft forward -- is one CUDA graph per
(batch bucket, widths): a step replays it after copying in the root logits, positions, slots and block
tables, then reads tokens and parents back once -- or, with ``grow_on_device``, hands them on to the target's
batch without reading them (``TokenTree.deferred``). Elsewhere the same code runs eagerly.

Sampled trees (``grow_sampled``) run the same loop with the host builder's sampled rule
(``draft.base._expand_sampled``): each frontier node's share of the level's width by largest remainder of
its cumulative probability, then that many draws without replacement from the processed draft
distribution q: on CUDA by an exponential race, on the CPU by successive inverse-CDF draws from the level's
width in uniforms a frontier node (``draws_without_replacement``: V exponentials a row were the CPU's cost).
The noise comes from each request's own generator in one draw before the loop, so a request's tree does not
depend on its batch; on the CPU, whose generator fills a tensor in order however it is split, that draw
equals the host builder's level-by-level draws. A draw
past q's support (top-k, top-p) is kept in the layout but marked invalid, with no share of the next
level: the caller cuts it, as the host builder never adds it. The loop runs eagerly, its draft forwards
through the drafter's graph runner when it has one, and the tree comes back with the q rows of its nodes
in one host copy.

Measured with this loop (bench/results/step_profile.json, H200, SmolLM2 shapes, batch 1, tree 2,2,2,1):
drafting costs 1.9 ms a step against a 1.3 ms target forward; the loop replaces per-level batch building,
top-k host copies and Python tree building.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from draft.base import top_logprobs
from draft.tree import template_depths
from draft.vocab import full_vocab
from kernels.graph_inputs import load_tree_inputs, load_tree_reference
from target.batch import ForwardBatch
from target.graphs import BATCH_BUCKETS, ONE_LAUNCH
from target.kv_cache import BlockTable, KVCache
from target.transfer import to_device
from target.model import Transformer
from verify.sampling import SamplingParams, draws_without_replacement, process_rows, race_scores


# Sampled trees on CUDA replay one graph per (batch bucket, widths, top-k/top-p or not), as greedy trees do,
# captured on first use. SPECGATE_SAMPLED_GRAPHS=0 runs the loop eagerly instead, each draft forward through the
# drafter's graph runner: ~300 launches a step at batch 1. On an H100 (random weights, tree 2,2,2,1, one run,
# bench/results/step_profile_sampled_h100.json) the graph took a T=0.7 step from 5.98 to 3.95 ms, its sampled
# loop from 4.08 to 1.36 ms.
SAMPLED_GRAPHS = os.environ.get("SPECGATE_SAMPLED_GRAPHS", "1") == "1"


@dataclass(slots=True)
class _Plan:
    """Index tensors that depend only on (B, widths); built once, outside any capture."""

    B: int
    widths: tuple[int, ...]
    levels: list[tuple[int, int]]  # [lo, hi) node range of each level, level 0 = the root
    depth: torch.Tensor  # [N - 1] depth of nodes 1..N-1
    own_bit: torch.Tensor  # [N] int64: 1 << (i - 1) for node i >= 1 (the feed's segment order), 0 for the root
    feeds: list[tuple[int, torch.Tensor, torch.Tensor, tuple[int, ...]]]  # per fed level: (n fed, query_start,
    # logits_indices, and their host copy)


@dataclass(slots=True)
class _Inputs:
    """What a step copies in: static buffers under a graph, plain tensors eagerly."""

    root_logits: torch.Tensor  # [B, V]
    ctx: torch.Tensor  # [B] int64 root position; -1 for padding rows
    slots: torch.Tensor  # [B, N - 1] int64 cache slots of nodes 1..N-1
    block_tables: torch.Tensor  # [B, max_blocks] int32
    root_hidden: torch.Tensor | None = None  # [B, hidden]: a feature draft's feature at each root


@dataclass(slots=True)
class _Sampled:
    """A sampled loop's per-row knobs and race noise."""

    # CUDA: [B, R, V] Exp(1) for the R frontier nodes (every node above the leaves), by node. CPU: [B, U] float64
    # uniforms, each frontier node's next-level width of them in node order (draws_without_replacement)
    noise: torch.Tensor
    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    filtered: bool  # some row has top-k or top-p
    offsets: dict[int, int] | None = None  # CPU: a level's first frontier node -> where its uniforms start


class GreedyTreeLoop:
    def __init__(self, model: Transformer, cache: KVCache, max_blocks: int, graphs: bool,
                 buckets: tuple[int, ...] = BATCH_BUCKETS, vocab_ids: torch.Tensor | None = None) -> None:
        self.model, self.cache, self.max_blocks = model, cache, max_blocks
        self.vocab_ids = vocab_ids  # [K] a cut head's token ids (logits column j is token vocab_ids[j]); None: all
        self.device = cache.k.device
        self.graphs = graphs and self.device.type == "cuda"
        self.buckets = tuple(sorted(buckets))
        self._plans: dict[tuple[int, tuple[int, ...]], _Plan] = {}
        # (batch bucket, widths) -> the graph, its static inputs and its outputs (``_levels``')
        self._graphs: dict[tuple[int, tuple[int, ...]],
                           tuple[torch.cuda.CUDAGraph, _Inputs, tuple[torch.Tensor, torch.Tensor]]] = {}
        # (batch bucket, widths, filtered) -> a sampled loop's graph, its static inputs, its static noise and
        # knobs ([B, 3] float64: temperature, top-k, top-p), and its outputs
        self._sampled_graphs: dict[tuple[int, tuple[int, ...], bool], tuple] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.replays = 0
        # A feature draft (Transformer.fc) feeds each node with its parent's feature (the root's comes from
        # the catch-up step); see draft/feature_drafter.py.
        self.features = model.fc is not None
        # the drafter's graph runner (target/graphs.py), for the sampled loop's draft forwards; the greedy
        # loop is one graph itself
        self.runner = None

    def grow(self, root_logits: torch.Tensor, ctxs: list[int], tables: list[BlockTable],
             widths: tuple[int, ...], root_hidden: torch.Tensor | None = None,
             ) -> list[tuple[list[int], list[int], list[float]]]:
        """Tokens, parents and cumulative log-probabilities of each sequence's tree (node 0's token is left
        0: the caller knows its root).
        ``root_logits`` [G, V] are the draft's logits at each root (V: the model's ``logits_width``),
        ``ctxs[g]`` the root's position;
        ``widths`` is not empty. ``root_hidden`` [G, hidden]: a feature draft's features at the roots.
        The tables get slots for every node."""
        out, _ = self._run(root_logits, ctxs, tables, widths, root_hidden)
        tokens, parents, cum = out.tolist()  # the loop's one host copy
        return [([int(t) for t in tok], [int(p) for p in par], c) for tok, par, c in zip(tokens, parents, cum)]

    def grow_on_device(self, root_logits: torch.Tensor, ctxs: list[int], tables: list[BlockTable],
                       widths: tuple[int, ...], root_hidden: torch.Tensor | None = None,
                       cuts: list[tuple[int, ...]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``grow`` with no host copy: ``[2, G, N]`` int64 tokens and parents (node 0's token left 0) and
        ``[G, N]`` int64 ancestor bits in the target's format (bit ``i`` = node ``i``, the root's included),
        on the device and the caller's own (a graph's outputs are overwritten by its next replay).

        ``cuts[g]``: the widths sequence ``g`` asked for, each ``widths``' first levels but the last, which may
        be narrower (``is_narrowing``): its first ``1 + sum(cuts[g])`` nodes are then that tree, the last
        level's best nodes by cumulative log-probability in their order -- what ``prune_tree`` keeps."""
        out, bits = self._run(root_logits, ctxs, tables, widths, root_hidden)
        rows, bits = out[:2].long(), target_bits(bits)
        narrowed: dict[int, list[tuple[int, int]]] = {}  # level -> (sequence, nodes kept there)
        for g, w in enumerate(cuts or ()):
            if w[-1] < widths[len(w) - 1]:
                narrowed.setdefault(len(w), []).append((g, w[-1]))
        plan = self._plan(len(ctxs), widths) if narrowed else None
        for level, keep in narrowed.items():
            self._keep_best(rows, bits, out[2], plan, level, keep)
        return rows, bits

    def _keep_best(self, rows: torch.Tensor, bits: torch.Tensor, cum: torch.Tensor, plan: _Plan, level: int,
                   keep: list[tuple[int, int]]) -> None:
        """In place: move the best ``k`` nodes of ``level`` = [lo, hi) by cumulative log-probability (ties to the
        earlier node, as a stable sort) to the level's front, in their order, for each (sequence, k) of
        ``keep``; their ancestor bits follow their new indices. Their parents lie above the level: unmoved."""
        lo, hi = plan.levels[level]
        g, k = to_device(torch.tensor([[q for q, _ in keep], [n for _, n in keep]]), self.device)
        idx = torch.arange(hi - lo, device=self.device)
        order = cum[g, lo:hi].float().sort(dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, idx.expand_as(order))
        front = ((rank >= k[:, None]).long() * (hi - lo) + idx).argsort(dim=1) + lo  # kept first, in index order
        moved = rows[:, g].gather(2, front.expand(2, -1, -1))  # [2, r, hi - lo]
        rows[:, g, lo:hi] = moved
        own = target_bits(plan.own_bit[lo:hi]) ^ 1  # bit i for node i (the root's bit taken back out)
        bits[g, lo:hi] = bits[g].gather(1, moved[1]) | own

    def _run(self, root_logits: torch.Tensor, ctxs: list[int], tables: list[BlockTable], widths: tuple[int, ...],
             root_hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The loop over ``G`` sequences: ``_levels``' outputs, views of a graph's when it replayed one."""
        G = len(ctxs)
        ctx, slot_t, bt, cols = self._prepare(ctxs, tables, widths, root_hidden)
        B = next((b for b in self.buckets if b >= G), None)
        if not self.graphs or B is None or cols > self.max_blocks:
            return self._levels(self._plan(G, widths), _Inputs(root_logits, ctx, slot_t, bt, root_hidden))
        graph, static, (out_all, bits_all) = self._graph(B, widths)
        self._load(static, root_logits, ctx, slot_t, bt, root_hidden)
        graph.replay()
        self.replays += 1
        return out_all[:, :G], bits_all[:G]

    def grow_sampled(self, root_logits: torch.Tensor, ctxs: list[int], tables: list[BlockTable],
                     widths: tuple[int, ...], sampling: list[SamplingParams], generators: list[torch.Generator],
                     root_hidden: torch.Tensor | None = None,
                     ) -> list[tuple[list[int], list[int], list[bool], torch.Tensor]]:
        """Sampled trees of ``widths`` (see the module's docstring). Per sequence: tokens (node 0's left 0),
        parents, each node's validity (False: a draw past q's support, to cut) and the q rows ``[N, V]``
        of its nodes (zero for nodes with no children). ``sampling[g]`` is sequence g's (not greedy),
        ``generators[g]`` its generator, on this loop's device."""
        G = len(ctxs)
        ctx, slot_t, bt, cols = self._prepare(ctxs, tables, widths, root_hidden)
        knobs = [[p.temperature, p.top_k, p.top_p] for p in sampling]
        filtered = any(p.top_k > 0 or p.top_p < 1 for p in sampling)
        plan = self._plan(G, widths)
        R = plan.levels[-2][1]  # frontier nodes: every node above the leaves
        B = next((b for b in self.buckets if b >= G), None)
        if self.graphs and SAMPLED_GRAPHS and B is not None and cols <= self.max_blocks:
            out, q = self._replay_sampled(B, widths, filtered, root_logits, ctx, slot_t, bt, root_hidden, knobs,
                                          generators)
            return self._sampled_trees(out, q, R)
        if self.device.type == "cuda":
            noise = torch.empty(G, R, self.model.config.vocab_size, device=self.device)
            for g, gen in enumerate(generators):  # one draw per request, whatever shares its batch
                noise[g].exponential_(generator=gen)
        else:  # each frontier row's width of uniforms, level after level: the host builder's draws, in its order
            offsets, U = {}, 0
            for (lo, hi), w in zip(plan.levels, widths):
                offsets[lo], U = U, U + (hi - lo) * w
            noise = torch.stack([torch.rand(U, generator=gen, dtype=torch.float64) for gen in generators])
        kn = to_device(torch.tensor(knobs, dtype=torch.float64), self.device)
        x = _Inputs(root_logits, ctx, slot_t, bt, root_hidden)
        out, q = self._levels(plan, x, _Sampled(noise, kn[:, 0].float(), kn[:, 1].long(), kn[:, 2].float(), filtered,
                                                None if self.device.type == "cuda" else offsets))
        return self._sampled_trees(out, q, R)

    @staticmethod
    def _sampled_trees(out: torch.Tensor, q: torch.Tensor, R: int
                       ) -> list[tuple[list[int], list[int], list[bool], torch.Tensor]]:
        """``grow_sampled``'s result from the loop's outputs: ``out`` [4, G, N] and the frontier's q rows
        ``q`` [G, R, V] (copied here: a graph's are overwritten by its next replay)."""
        tokens, parents, _, valid = out.tolist()  # the loop's one host copy
        G, N = len(tokens), len(tokens[0])
        q = torch.cat((q, q.new_zeros(G, N - R, q.shape[-1])), dim=1)  # leaves: no children, no q row
        return [([int(t) for t in tok], [int(p) for p in par], [v > 0 for v in val], q[g])
                for g, (tok, par, val) in enumerate(zip(tokens, parents, valid))]

    def _replay_sampled(self, B: int, widths: tuple[int, ...], filtered: bool, root_logits: torch.Tensor,
                        ctx: torch.Tensor, slot_t: torch.Tensor, bt: torch.Tensor, root_hidden: torch.Tensor | None,
                        knobs: list[list[float]], generators: list[torch.Generator]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled loop of ``G`` sequences from its graph: the inputs copied in as ``_run`` copies them, each
        request's race noise drawn into the static noise from its own generator (outside the graph: a launch a
        request), the knobs copied (padding rows at temperature 1, unfiltered). Views of the graph's outputs."""
        G = len(generators)
        graph, static, noise, kn, (out_all, q_all) = self._sampled_graph(B, widths, filtered)
        self._load(static, root_logits, ctx, slot_t, bt, root_hidden)
        for g, gen in enumerate(generators):  # one draw per request, whatever shares its batch
            noise[g].exponential_(generator=gen)
        kn.copy_(to_device(torch.tensor(knobs + [[1.0, 0, 1.0]] * (B - G), dtype=torch.float64), self.device))
        graph.replay()
        self.replays += 1
        return out_all[:, :G], q_all[:G]

    def _load(self, static: _Inputs, root_logits: torch.Tensor, ctx: torch.Tensor, slot_t: torch.Tensor,
              bt: torch.Tensor, root_hidden: torch.Tensor | None) -> None:
        """Copy ``G`` sequences' inputs into a graph's static buffers; the padding rows after them get zero roots
        and the scratch block."""
        G = root_logits.shape[0]
        static.root_logits[:G].copy_(root_logits)
        static.root_logits[G:].zero_()
        if ONE_LAUNCH:  # roots, slots and block tables in one kernel (kernels/graph_inputs.py)
            load_tree_inputs(static, ctx, slot_t, bt, self.cache.scratch_block, self.cache.page_size)
        else:
            load_tree_reference(static, ctx, slot_t, bt, self.cache.scratch_block, self.cache.page_size)
        if static.root_hidden is not None:
            static.root_hidden[:G].copy_(root_hidden)
            static.root_hidden[G:].zero_()

    def _sampled_graph(self, B: int, widths: tuple[int, ...], filtered: bool):
        """The sampled loop for bucket ``B`` as one graph: ``_graph``'s static inputs plus static noise and knobs;
        its draft forwards run inside it (the model's, not the runner's graphs). Captured on first use."""
        key = (B, widths, filtered)
        if key in self._sampled_graphs:
            return self._sampled_graphs[key]
        plan = self._plan(B, widths)
        static = self._static_inputs(plan)
        noise = torch.ones(B, plan.levels[-2][1], self.model.config.vocab_size, device=self.device)
        kn = torch.tensor([[1.0, 0, 1.0]] * B, dtype=torch.float64, device=self.device)

        def loop():
            smp = _Sampled(noise, kn[:, 0].float(), kn[:, 1].long(), kn[:, 2].float(), filtered)
            return self._levels(plan, static, smp, whole=True)

        graph = self._capture(loop)
        self._sampled_graphs[key] = (graph[0], static, noise, kn, graph[1])
        return self._sampled_graphs[key]

    def _prepare(self, ctxs: list[int], tables: list[BlockTable], widths: tuple[int, ...],
                 root_hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Slots for every node of every tree; the roots' positions [G], node slots [G, N - 1] and block
        tables [G, cols] on the device, and cols."""
        if self.features and root_hidden is None:
            raise ValueError("a feature draft's tree loop needs the roots' features")
        N = 1 + sum(widths)
        slots = []
        for table, ctx in zip(tables, ctxs):
            table.ensure(ctx + N)
            self.cache.make_writable(table, ctx + 1, ctx + N)
            slots.append(table.slots(ctx + 1, ctx + N))
        cols = max(len(t.blocks) for t in tables)
        scratch_row = [self.cache.scratch_block] * cols
        bt = torch.tensor([t.blocks.tolist() + scratch_row[len(t.blocks):] for t in tables], dtype=torch.int32)
        # [N, G]: row 0 the contexts, rows 1.. the slots
        host = to_device(torch.tensor([ctxs, *zip(*slots)], dtype=torch.int64), self.device)
        return host[0], host[1:].T, to_device(bt, self.device), cols

    def cover(self, G: int, widths: tuple[int, ...]) -> tuple[int, ...]:
        """The template to grow ``G`` sequences to: the cheapest captured one for their batch bucket that
        holds ``widths`` (as deep, every level as wide), else ``widths``. A few spare nodes in a held graph
        cost microseconds; capturing a new graph mid-serving stalls every stream for a third of a second,
        and budget cuts, probes and lookup grafts make many templates that no start-up capture foresees."""
        B = next((b for b in self.buckets if b >= G), None)
        if not self.graphs or B is None or (B, widths) in self._graphs:
            return widths
        return covering_template([w for b, w in self._graphs if b == B], widths) or widths

    def capture(self, max_batch: int, widths: tuple[int, ...]) -> int:
        """Capture the loop for every batch bucket up to ``max_batch``; returns the graphs held."""
        if self.graphs:
            for B in self.buckets:
                self._graph(B, widths)
                if B >= max_batch:
                    break
        return len(self._graphs)

    # --- internals --------------------------------------------------------------------------------

    def _plan(self, B: int, widths: tuple[int, ...]) -> _Plan:
        key = (B, widths)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        levels, lo = [(0, 1)], 1
        for w in widths:
            levels.append((lo, lo + w))
            lo += w
        N = lo
        depth = template_depths(widths)[1:]
        i64 = dict(dtype=torch.int64, device=self.device)
        own = torch.tensor([0] + [1 << (i - 1) for i in range(1, N)], **i64)
        feeds = []
        for lo_d, hi_d in levels[1:-1]:  # every level but the leaves is fed, with all nodes above it
            n = hi_d - 1
            qs = torch.arange(0, B * n + 1, n, dtype=torch.int32, device=self.device)
            host = tuple(g * n + i - 1 for g in range(B) for i in range(lo_d, hi_d))
            feeds.append((n, qs, torch.tensor(host, **i64), host))
        plan = self._plans[key] = _Plan(B, widths, levels, torch.tensor(depth, **i64), own, feeds)
        return plan

    def _levels(self, plan: _Plan, x: _Inputs, smp: _Sampled | None = None, whole: bool = False):
        """[3, B, N] float64: tokens, parents (exact in float64) and cumulative log-probabilities, so one
        host copy reads all three; and [B, N] int64 ancestor bits (bit ``i - 1`` = node ``i``, none for the
        root: the feeds' format). Device ops only: capturable. Sampled (``smp``): [4, B, N], each node's
        validity fourth, and the frontier nodes' q rows [B, R, V]."""
        B, N = x.ctx.shape[0], plan.levels[-1][1]
        V = self.model.config.vocab_size
        if smp is not None:
            valid = torch.ones(B, N, dtype=torch.bool, device=self.device)
            q_rows = torch.zeros(B, plan.levels[-2][1], V, device=self.device)
        tok = torch.zeros(B, N, dtype=torch.int64, device=self.device)
        par = torch.full((B, N), -1, dtype=torch.int64, device=self.device)
        cum = torch.zeros(B, N, dtype=torch.float32, device=self.device)
        bits = torch.zeros(B, N, dtype=torch.int64, device=self.device)
        positions = x.ctx[:, None] + plan.depth[None, :]  # [B, N - 1]
        context_lens = (x.ctx + 1).to(torch.int32)
        front = x.root_logits[:, None, :]  # [B, F, V]
        node_h = None
        if self.features:  # each node's output feature; node i is fed with its parent's
            node_h = x.root_hidden.new_zeros(B, N, x.root_hidden.shape[-1])
            node_h[:, 0] = x.root_hidden
        for d, w in enumerate(plan.widths):
            lo, hi = plan.levels[d]
            new_lo, new_hi = plan.levels[d + 1]
            if smp is None:
                top_lp, top_tok = top_logprobs(front, w)  # [B, F, w]
                if self.vocab_ids is not None:
                    top_tok = self.vocab_ids[top_tok]
                cand = (cum[:, lo:hi, None] + top_lp).flatten(1)  # [B, F * w]
                val, idx = cand.topk(w, dim=-1)
                idx, order = idx.sort(dim=-1)  # (parent, rank) order, as the host builder adds them
                tok[:, new_lo:new_hi] = top_tok.flatten(1).gather(1, idx)
                par[:, new_lo:new_hi] = lo + torch.div(idx, w, rounding_mode="floor")
                cum[:, new_lo:new_hi] = val.gather(1, order)
            else:
                self._sampled_level(front, smp, lo, hi, new_lo, new_hi, w, tok, par, cum, valid, q_rows)
            bits[:, new_lo:new_hi] = bits.gather(1, par[:, new_lo:new_hi]) | plan.own_bit[new_lo:new_hi]
            if d + 1 == len(plan.widths):
                break
            n, query_start, rows, rows_host = plan.feeds[d]
            batch = ForwardBatch(
                tokens=tok[:, 1 : 1 + n].reshape(-1), positions=positions[:, :n].reshape(-1),
                slot_mapping=x.slots[:, :n].reshape(-1), block_tables=x.block_tables, context_lens=context_lens,
                query_start=query_start, mask_bits=bits[:, 1 : 1 + n].reshape(-1), logits_indices=rows,
                logits_start=[], query_lens=(n,) * B, logits_rows=rows_host if smp is not None and not whole else ())
            # the greedy loop is captured whole, the sampled one too on CUDA (``whole``); an eager sampled loop
            # replays the runner's graph for each forward
            fwd = self.runner if smp is not None and self.runner is not None and not whole else self.model
            if node_h is None:
                front = fwd.forward(batch, self.cache).view(B, new_hi - new_lo, -1)
                continue
            feed = node_h.gather(1, par[:, 1 : 1 + n, None].expand(-1, -1, node_h.shape[-1]))  # [B, n, hidden]
            logits, hidden = fwd.forward_hidden(batch, self.cache, feed.reshape(B * n, -1))
            front = logits.view(B, new_hi - new_lo, -1)
            node_h[:, new_lo:new_hi] = hidden.view(B, n, -1)[:, new_lo - 1 : new_hi - 1]
        if smp is not None:
            return torch.stack((tok.double(), par.double(), cum.double(), valid.double())), q_rows
        return torch.stack((tok.double(), par.double(), cum.double())), bits

    def _sampled_level(self, front: torch.Tensor, smp: _Sampled, lo: int, hi: int, new_lo: int, new_hi: int,
                       w: int, tok: torch.Tensor, par: torch.Tensor, cum: torch.Tensor, valid: torch.Tensor,
                       q_rows: torch.Tensor) -> None:
        """Level ``new_lo:new_hi`` of sampled trees from the frontier ``lo:hi``'s logits ``front`` [B, F, V'],
        by ``draft.base._expand_sampled``'s rule (``_allocate`` for the shares)."""
        B, F = front.shape[0], hi - lo
        front = full_vocab(front, self.vocab_ids, self.model.config.vocab_size)  # a cut head: q is zero off the cut
        q = process_rows(front, smp.temperature, smp.top_k, smp.top_p, smp.filtered)  # [B, F, V]
        ok = valid[:, lo:hi]
        share = cum[:, lo:hi].masked_fill(~ok, float("-inf")).softmax(-1) * w  # [B, F]
        counts = share.floor()
        rest = w - counts.sum(-1, keepdim=True)
        order = (share - counts).masked_fill(~ok, -1.0).argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(F, device=self.device).expand(B, F))
        counts = counts + (rank < rest).to(counts.dtype)  # largest remainders first
        if smp.offsets is not None:  # the CPU's successive draws, from this level's uniforms
            at = smp.offsets[lo]
            drawn, ok = draws_without_replacement(q, smp.noise[:, at : at + F * w].view(B, F, w))
            logq = q.gather(-1, drawn).log().masked_fill(~ok, float("-inf"))  # -inf past the support
        else:
            drawn = race_scores(q, smp.noise[:, lo:hi]).topk(w, dim=-1).indices  # [B, F, w] in draw order
            logq = q.gather(-1, drawn).log()  # -inf past the support
        pos = torch.arange(F * w, device=self.device).view(F, w)
        take = torch.arange(w, device=self.device) < counts[..., None]  # each node's first counts draws
        idx = torch.where(take, pos, pos + F * w).flatten(1).topk(w, dim=-1, largest=False).indices.sort(-1).values
        tok[:, new_lo:new_hi] = drawn.flatten(1).gather(1, idx)
        par[:, new_lo:new_hi] = lo + torch.div(idx, w, rounding_mode="floor")
        lq = logq.flatten(1).gather(1, idx)
        cum[:, new_lo:new_hi] = cum.gather(1, par[:, new_lo:new_hi]) + lq
        valid[:, new_lo:new_hi] = lq > float("-inf")
        q_rows[:, lo:hi] = q * (counts > 0)[..., None]

    def _graph(self, B: int, widths: tuple[int, ...]):
        key = (B, widths)
        if key in self._graphs:
            return self._graphs[key]
        plan = self._plan(B, widths)
        static = self._static_inputs(plan)
        graph, out = self._capture(lambda: self._levels(plan, static))
        self._graphs[key] = (graph, static, out)
        return self._graphs[key]

    def _static_inputs(self, plan: _Plan) -> _Inputs:
        """A graph's input buffers for ``plan``: padding rows point at the scratch block."""
        B, N, V = plan.B, plan.levels[-1][1], self.model.logits_width
        scratch = self.cache.scratch_block
        return _Inputs(
            root_logits=torch.zeros(B, V, dtype=torch.float32, device=self.device),
            ctx=torch.full((B,), -1, dtype=torch.int64, device=self.device),
            slots=torch.full((B, N - 1), scratch * self.cache.page_size, dtype=torch.int64, device=self.device),
            block_tables=torch.full((B, self.max_blocks), scratch, dtype=torch.int32, device=self.device),
            root_hidden=torch.zeros(B, self.model.config.hidden_size, dtype=self.model.dtype, device=self.device)
            if self.features else None)

    def _capture(self, loop):
        """``loop()`` captured as a graph (after two runs outside it: every kernel compiled and tuned); the graph
        and what the capture returned."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                loop()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = loop()
        return graph, out


def is_narrowing(asked: tuple[int, ...], widths: tuple[int, ...]) -> bool:
    """``asked`` is ``widths``' first levels, the last of them possibly narrower: a tree ``grow_on_device`` cuts
    from the grown one on the device (``cuts``), node for node as ``prune_tree`` would."""
    n = len(asked)
    return 0 < n <= len(widths) and asked[:-1] == widths[: n - 1] and asked[-1] <= widths[n - 1]


def target_bits(bits: torch.Tensor) -> torch.Tensor:
    """The loop's ancestor bits (bit ``i - 1`` for node ``i``, none for the root) in the target's format (bit
    ``i`` for node ``i``, the root's bit 0 in every node's): a left shift and the root's bit. Node 63's bit
    is int64's sign bit, set by hand rather than shifted into (a signed overflow)."""
    shifted = ((bits & ((1 << 62) - 1)) << 1) | 1
    return torch.where((bits >> 62) != 0, shifted | -(1 << 63), shifted)


def covering_template(held: list[tuple[int, ...]], widths: tuple[int, ...]) -> tuple[int, ...] | None:
    """The held template with the fewest nodes (then the shallowest) that is at least as deep as ``widths``
    and at least as wide at every level, or None. The grown tree is then pruned back to ``widths``
    (``prune_tree``): it may differ from one grown to ``widths`` directly -- a wider level can rank a child
    of a dropped node above one of a kept node -- which changes acceptance a little and output never."""
    fits = [w for w in held if len(w) >= len(widths) and all(a >= b for a, b in zip(w, widths))]
    return min(fits, key=lambda w: (sum(w), len(w)), default=None)
