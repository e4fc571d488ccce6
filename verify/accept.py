"""Verification: which draft nodes the target accepts, and the bonus token after them.

Greedy verification follows the target's argmax down the tree. Stochastic verification is the
multi-candidate recursive rejection sampling of SpecInfer (Miao et al.) with the without-replacement
residual of Sequoia (Chen et al.): the emitted tokens are distributed exactly as if sampled one by one
from the target's processed distribution, whatever the draft proposed.

Every function is pure: it reads the tree and the target's scores, never touches a KV cache, and draws
randomness only from the generator it is handed. ``accept`` walks one tree on the host (each stochastic
decision reads three scalars back from the device); ``accept_batch``, the engine's entry point, decides
every node of every tree on the device and copies the outcome to the host once per step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from draft.tree import TokenTree
from kernels.stochastic_accept import normalise, residual_decisions_ref, stochastic_accept
from verify.sampling import (SamplingParams, apply_penalties, inverse_cdf, process_logits, race_argmax, sample,
                             sample_rows, tree_path_counts)


# Stochastic trees' decisions on CUDA: one kernel launch (kernels/stochastic_accept.py); 0 keeps the torch passes.
ACCEPT_KERNEL = os.environ.get("SPECGATE_ACCEPT_KERNEL", "1") != "0"


@dataclass(slots=True)
class AcceptResult:
    """The outcome of verifying one sequence's tree."""

    accepted_nodes: list[int]  # node indices from the root down; always starts with 0
    bonus_token: int  # sampled from the target (or its residual) after the last accepted node
    node_tokens: list[int]  # tree tokens at accepted_nodes; node_tokens[0] is the root (already emitted)

    @property
    def tokens(self) -> list[int]:
        """The newly emitted tokens: accepted drafts then the bonus. Length == len(accepted_nodes)."""
        return self.node_tokens[1:] + [self.bonus_token]

    @property
    def num_accepted_drafts(self) -> int:
        return len(self.accepted_nodes) - 1


def accept(tree: TokenTree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
           prompt_mask: torch.Tensor | None = None, output_counts: torch.Tensor | None = None) -> AcceptResult:
    """Verify one sequence's tree: the single entry point the engine calls per sequence.

    target_logits: [N, V] raw target logits (row i scores node i's children). prompt_mask: [V] bool.
    output_counts: [V] int, counts of tokens generated *before* the root; the root and the draft path are
    counted here (row i sees the path root..i). Penalties, then greedy or stochastic verification.
    """
    _check_shapes(tree, target_logits)
    logits = _penalise(target_logits, params, prompt_mask, output_counts, tree)  # [N, V]
    if params.is_greedy:
        return accept_greedy(tree, logits)
    return accept_stochastic(tree, process_logits(logits, params), generator)


def sample_first(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                 prompt_mask: torch.Tensor | None = None, output_counts: torch.Tensor | None = None) -> int:
    """Sample the token after prefill from logits [V]: the same processing and the same generator draw
    as ``accept`` on a one-node tree, so the two agree when output_counts here includes that root."""
    logits = _penalise(logits[None], params, prompt_mask, output_counts, tree=None)  # [1, V]
    if params.is_greedy:
        return int(logits[0].argmax())
    return int(sample(process_logits(logits, params)[0], generator))


def accept_batch(trees: list[TokenTree], logits: torch.Tensor, starts: list[int], params: list[SamplingParams],
                 generators: list[torch.Generator],
                 penalties: list[tuple[torch.Tensor | None, torch.Tensor | None]]) -> list[AcceptResult]:
    """Verify every sequence of one step with one host copy. logits: [R, V] on the device; sequence k owns
    rows ``starts[k]:starts[k + 1]``.

    - Greedy trees: one argmax over every row; the walk down each tree is host Python over those ids.
    - One-node sampled trees (plain decoding): processed together per (temperature, top-k, top-p) and drawn
      with ``sample_rows``: each the same draw ``accept`` makes, one tiny draw per sequence.
    - Stochastic trees: every node's accept/reject decisions at once on the device, every tree of a group
      (same knobs, draft probabilities or point masses) in one pass (``_stochastic_parallel``); the host
      walks the accepted children.
    - Requests with penalties or a logit bias go through ``accept`` one by one (penalised logits depend on
      the path). The engine processes those rows for the whole step beforehand (verify/processing.py) and
      hands their parameters here stripped, so they join the groups above.
    - Deferred greedy trees (``TokenTree.deferred``: grown on the device and scored by the target from
      there) ride the same host copy, which resolves them (``TokenTree.resolve``) before they are walked.
    """
    launched = launch_accept(trees, logits, starts, params, generators, penalties)
    return finish_accept(launched, launched.picks.tolist() if launched.picks is not None else [])  # the one copy


@dataclass(slots=True)
class Launched:
    """``launch_accept``'s outcome: its arguments, and where each sequence's picks sit in ``picks``."""

    trees: list[TokenTree]
    logits: torch.Tensor
    starts: list[int]
    params: list[SamplingParams]
    generators: list[torch.Generator]
    penalties: list[tuple[torch.Tensor | None, torch.Tensor | None]]
    picks: torch.Tensor | None  # [P] int64 on the device: every pick of the step, one host copy
    at: dict[int, int]  # sequence -> offset of its ids (greedy rows, or a one-node sampled tree's draw)
    nodes_at: dict[int, tuple[int, int, int]]  # stochastic sequence -> offsets of children, bonuses, flags
    deferred: list[int]  # sequences whose trees' nodes ride at the picks' end


def launch_accept(trees: list[TokenTree], logits: torch.Tensor, starts: list[int], params: list[SamplingParams],
                  generators: list[torch.Generator],
                  penalties: list[tuple[torch.Tensor | None, torch.Tensor | None]]) -> Launched:
    """``accept_batch``'s device work, up to its host copy: what ``finish_accept`` walks once the copy of
    ``Launched.picks`` is on the host (the engine's overlapped steps copy it while the next step runs)."""
    deferred = [k for k, t in enumerate(trees) if t.pending is not None]  # nodes still on the device
    if any(not params[k].is_greedy or params[k].custom_logits for k in deferred):
        raise ValueError("a deferred tree is verified greedily, with no bias or penalties")
    picks: list[torch.Tensor] = []
    at: dict[int, int] = {}  # sequence -> offset of its ids in the host copy
    size = 0

    def add(k: int, t: torch.Tensor) -> None:
        nonlocal size
        at[k] = size
        picks.append(t)
        size += t.shape[0]

    greedy = [k for k, p in enumerate(params) if p.is_greedy and not p.custom_logits]
    if greedy:
        best = logits.argmax(dim=-1)  # [R]: rows of other sequences are read and ignored
        picks.append(best)
        at.update((k, starts[k]) for k in greedy)
        size = best.shape[0]
    plain: dict[tuple[float, int, float, float], list[int]] = {}  # one-node sampled trees by processing knobs
    stochastic: dict[tuple, list[int]] = {}  # sampled trees by knobs and draft kind
    # Stacking pays where launches dominate (CUDA); on the CPU arithmetic does, and stacked [R, V] temporaries
    # outgrow the cache (sampling_step_cpu.json): there each tree is a group of its own, with the same draws.
    alone = logits.device.type != "cuda"
    for k, (tree, p) in enumerate(zip(trees, params)):
        if p.is_greedy or p.custom_logits:
            continue
        knobs = (p.temperature, p.top_k, p.top_p, p.min_p)
        if tree.num_nodes == 1:
            plain.setdefault(knobs, []).append(k)
        else:
            _check_shapes(tree, logits[starts[k] : starts[k + 1]])
            stochastic.setdefault(knobs + (tree.draft_probs is None, k if alone else -1), []).append(k)
    for ks in plain.values():  # one processing pass and one draw pass per group (sample_rows)
        rows = _rows(logits, [(starts[k], starts[k] + 1) for k in ks])  # [n, V]
        ids = sample_rows(process_logits(rows, params[ks[0]]), [generators[k] for k in ks])  # [n]
        at.update((k, size + j) for j, k in enumerate(ks))
        picks.append(ids)
        size += len(ks)
    nodes_at: dict[int, tuple[int, int, int]] = {}  # stochastic sequence -> offsets of its children, bonuses, flags
    for ks in stochastic.values():  # every node of every tree of the group at once
        group = [trees[k] for k in ks]
        R = sum(t.num_nodes for t in group)
        rows = _rows(logits, [(starts[k], starts[k + 1]) for k in ks])  # [R, V]
        decided = _stochastic_parallel(group, process_logits(rows, params[ks[0]]), [generators[k] for k in ks])  # [3R]
        off = 0
        for k, t in zip(ks, group):
            nodes_at[k] = (size + off, size + R + off, size + 2 * R + off)
            off += t.num_nodes
        picks.append(decided)
        size += 3 * R
    for k in deferred:
        rows = trees[k].pending.rows  # [2, N - 1]: its tokens and parents ride the same copy
        picks += [rows[0], rows[1]]
    return Launched(trees, logits, starts, params, generators, penalties, torch.cat(picks) if picks else None,
                    at, nodes_at, deferred)


def finish_accept(launched: Launched, ids: list[int]) -> list[AcceptResult]:
    """Every sequence's result from ``launched``'s picks, copied to the host as ``ids``."""
    trees, logits, starts, params = launched.trees, launched.logits, launched.starts, launched.params
    generators, penalties = launched.generators, launched.penalties
    at, nodes_at, deferred = launched.at, launched.nodes_at, launched.deferred
    for k in reversed(deferred):  # their pieces sit at the copy's end, in order
        lo = len(ids) - 2 * trees[k].pending.rows.shape[1]  # (a tree of host nodes alone has none)
        mid = (lo + len(ids)) // 2
        trees[k].resolve(ids[lo:mid], ids[mid:])
        del ids[lo:]
    results = []
    for k, tree in enumerate(trees):
        n = tree.num_nodes
        if k not in at and k not in nodes_at:
            rows = logits[starts[k] : starts[k + 1]]
            results.append(accept(tree, rows, params[k], generators[k], *penalties[k]))
        elif params[k].is_greedy:
            results.append(_walk_greedy(tree, ids[at[k] : at[k] + n]))
        elif n == 1:
            results.append(_result(tree.host()[0], [0], ids[at[k]]))
        elif any(ids[nodes_at[k][2] : nodes_at[k][2] + n]):  # a draft token with zero draft probability
            results.append(accept(tree, logits[starts[k] : starts[k + 1]], params[k], generators[k]))  # names it
        else:
            child, bonus = ids[nodes_at[k][0] : nodes_at[k][0] + n], ids[nodes_at[k][1] : nodes_at[k][1] + n]
            nodes = [0]
            while child[nodes[-1]] >= 0:
                nodes.append(child[nodes[-1]])
            results.append(_result(tree.host()[0], nodes, bonus[nodes[-1]]))
    return results


def _rows(logits: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """The rows of ``spans`` (lo, hi), in order: a view when each span starts where the last ended (the usual
    case), else one indexed copy."""
    if all(a[1] == b[0] for a, b in zip(spans, spans[1:])):
        return logits[spans[0][0] : spans[-1][1]]
    return logits[torch.tensor([r for lo, hi in spans for r in range(lo, hi)], device=logits.device)]


def _stochastic_parallel(trees: list[TokenTree], p: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """The recursive rejection sampling of ``accept_stochastic`` for every node of every tree at once.

    A node's decisions depend only on its own target row, its draft row and its children's tokens, never
    on which path reached it: so every node tries its children in order against its running residual,
    all nodes in parallel (one loop over the sibling rank), each decision with its own uniform draw, and
    every node draws the bonus it would emit if the path ended there (over its final residual, as ``sample``
    draws: a race on CUDA, an inverse CDF on the CPU). The host then follows accepted children from the root.
    Each emitted token is drawn exactly as in the sequential walk, so the output distribution is the target's.

    Rows are independent, so the trees of one step are stacked: ``trees`` share their processing and are
    all drafted with probabilities or all with point masses. Each tree draws from its own generator, in
    the order one tree alone would (its uniforms, then its bonus draws), so batching changes no sequence's
    tokens.

    p: [R, V] processed target probabilities, tree after tree. Returns int64 ``[3R]`` on p's device: each
    node's accepted child (its index in its own tree, -1 for none), each node's bonus token, and a flag per
    node set when a draft token it tried has zero draft probability (``accept`` then raises the error that
    names it).
    """
    R, V = p.shape
    lists = [_tree_lists(t) for t in trees]
    K = max(len(c) for _, children in lists for c in children)
    kid_rows: list[list[int]] = []  # [R, K]: each node's children, indices within its tree, -1 padded
    tok_rows: list[list[int]] = []  # [R, K]: their tokens (0 where padded: never live)
    for tokens, children in lists:
        for c in children:
            kid_rows.append(c + [-1] * (K - len(c)))
            tok_rows.append([tokens[i] for i in c] + [0] * (K - len(c)))
    kid, kid_tok = torch.tensor(kid_rows, dtype=torch.int64), torch.tensor(tok_rows, dtype=torch.int64)
    kid, kid_tok = kid.to(p.device, non_blocking=True), kid_tok.to(p.device, non_blocking=True)
    u = torch.ones(R, K, device=p.device)  # padded siblings are never live
    # The bonus draws, as ``sample`` makes them: an exponential race on CUDA (launches dominate), one float64
    # uniform a node against its residual's running sum on the CPU (arithmetic does: the race's V draws a row
    # cost a 16-node tree ~7 ms there).
    race = torch.empty(R, V, device=p.device) if p.is_cuda else torch.empty(R, dtype=torch.float64)
    off = 0
    for (tokens, children), generator in zip(lists, generators):
        n, k = len(tokens), max(len(c) for c in children)
        u[off : off + n, :k].uniform_(generator=generator)  # in place: one launch, not a draw and a copy
        if p.is_cuda:
            race[off : off + n].exponential_(generator=generator)
        else:
            race[off : off + n] = torch.rand(n, generator=generator, dtype=torch.float64)
        off += n
    q = None
    if trees[0].draft_probs is not None:
        q = torch.cat([t.draft_probs.to(p.device, torch.float32) for t in trees])  # [R, V]
    if p.is_cuda and ACCEPT_KERNEL:  # every decision and every bonus in one launch (kernels/stochastic_accept.py)
        return stochastic_accept(p.float().contiguous(), q, kid, kid_tok, u, race)
    child, bad, p = residual_decisions_ref(p, q, kid, kid_tok, u)
    # [R]: p_i / Exp(1) is largest at i with probability p_i / sum(p); the inverse CDF draws i as often
    bonus = race_argmax(p, race) if p.is_cuda else inverse_cdf(p, race)
    return torch.cat((child, bonus, bad.long()))


def accept_greedy(tree: TokenTree, target_logits: torch.Tensor) -> AcceptResult:
    """Follow the target's argmax from the root; the bonus is the argmax at the last accepted node.

    target_logits: [N, V], already penalised by the caller (``accept`` does it): the argmax is taken as is.
    """
    _check_shapes(tree, target_logits)
    return _walk_greedy(tree, target_logits.argmax(dim=-1).tolist())  # [N]: the one host copy


def _walk_greedy(tree: TokenTree, best: list[int]) -> AcceptResult:
    """The greedy walk over host ids: ``best[i]`` is the target's choice after node i. Siblings are distinct
    but for twins that a chain appended on the host may make (``TokenTree.with_chains``): the walk then keeps
    the deepest path. Twins carry the same token at the same position after the same ancestors, so either
    holds the target's own tokens and K/V: the choice changes how many are kept, never which."""
    if tree.num_nodes == 1:  # plain decoding, most sequences of a busy step: nothing to walk
        return _result(tree.host()[0], [0], best[0])
    tokens, children = _tree_lists(tree, distinct=False)
    nodes = _deepest(0, tokens, children, best)
    return _result(tokens, nodes, best[nodes[-1]])


def _deepest(u: int, tokens: list[int], children: list[list[int]], best: list[int]) -> list[int]:
    """The longest path from ``u`` down children that carry the target's choice (the first on ties). A
    module-level function, not a closure: a recursive closure is a reference cycle per call, and the cyclic
    collector's passes over the engine's objects doubled the host step at 48 streams (bench/host_step.py)."""
    path: list[int] = []
    for c in children[u]:
        if tokens[c] == best[u]:
            below = _deepest(c, tokens, children, best)
            if len(below) > len(path):
                path = below
    return [u, *path]


def accept_stochastic(tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator) -> AcceptResult:
    """Recursive rejection sampling down the tree (SpecInfer / Sequoia).

    target_probs: [N, V] float32, fully processed (penalties, temperature, top-k/p), rows summing to 1.
    tree.draft_probs: [N, V] or None (children are point masses). At each node the children are tried in
    node order against the running residual; the first accepted one becomes the new current node. When all
    are rejected, or the node is a leaf, the bonus is drawn from the residual. Sibling tokens must be
    distinct (``ValueError`` otherwise): a drafter sampling without replacement never repeats one, and a
    deterministic drafter must merge duplicates.
    """
    _check_shapes(tree, target_probs)
    tokens, children = _tree_lists(tree)
    nodes = [0]
    while True:
        u = nodes[-1]
        draft = None if tree.draft_probs is None else tree.draft_probs[u]  # [V]
        child, residual = _try_children(children[u], tokens, target_probs[u], draft, generator)
        if child is None:
            return _result(tokens, nodes, int(sample(residual, generator)))
        nodes.append(child)


def _try_children(children: list[int], tokens: list[int], p: torch.Tensor, q: torch.Tensor | None,
                  generator: torch.Generator) -> tuple[int | None, torch.Tensor]:
    """Try each child of one node. p: [V] target, q: [V] draft or None. Returns (accepted child, residual).

    Point masses (q None): accept child token t with probability p[t] / sum(p); on reject zero p[t]. The
    residual stays unnormalised, which is exact: a rejection needs u >= p[t] / sum(p) with u < 1, so the
    mass left is positive and the next test and the bonus draw see a proper distribution.
    Draft q: accept with min(1, p[t] / q[t]); on reject p <- norm(max(p - q, 0)), q <- norm(q with t zeroed).
    """
    if q is not None:  # p - q needs both on one scale
        p, q = normalise(p, fallback=p), normalise(q, fallback=q)
    for child in children:
        t = tokens[child]
        u = torch.rand((), generator=generator, device=p.device)
        q_t = p.sum() if q is None else q[t]  # a point mass is q = one-hot(t) scaled to p's mass
        p_t, q_t, u = torch.stack((p[t], q_t, u)).tolist()  # the decision's host sync
        if q_t <= 0:
            raise ValueError(f"node {child}: draft_probs gives its token {t} zero probability")
        if u < p_t / q_t:  # u in [0, 1): a ratio >= 1 always accepts
            return child, p
        without_t = p.index_fill(0, torch.tensor([t], device=p.device), 0.0)  # [V]
        if q is None:
            p = without_t
        else:
            p = normalise((p - q).clamp_min(0), fallback=p)
            q = normalise(q.index_fill(0, torch.tensor([t], device=q.device), 0.0), fallback=q)
    return None, p


def _penalise(logits: torch.Tensor, params: SamplingParams, prompt_mask: torch.Tensor | None,
              output_counts: torch.Tensor | None, tree: TokenTree | None) -> torch.Tensor:
    """apply_penalties with each tree row also counting its path root..i. logits: [N, V]."""
    if not params.custom_logits:
        return logits
    path_counts = None
    if tree is not None and params.use_penalties:
        if tree.num_nodes == 1:  # the root alone (plain decoding): one more count, no [N, V] path matrix
            V = logits.shape[-1]
            output_counts = (torch.zeros(V, dtype=torch.int64, device=logits.device) if output_counts is None
                             else output_counts.clone())
            output_counts[tree.host()[0][0]] += 1
        else:
            path_counts = tree_path_counts(tree, logits.shape[-1]).to(logits.device)  # [N, V]
    return apply_penalties(logits, params, prompt_mask, output_counts, path_counts)


def _tree_lists(tree: TokenTree, distinct: bool = True) -> tuple[list[int], list[list[int]]]:
    """Host copies: tokens [N] and each node's children in node order. Rejects duplicate sibling tokens unless
    ``distinct`` is False (the greedy walk, which takes the deeper twin)."""
    tokens, parents = tree.host()[:2]
    children: list[list[int]] = [[] for _ in tokens]
    for node in range(1, len(tokens)):
        children[parents[node]].append(node)
    for node, kids in enumerate(children if distinct else ()):
        kid_tokens = [tokens[c] for c in kids]
        if len(set(kid_tokens)) != len(kid_tokens):
            raise ValueError(f"node {node} has duplicate child tokens {kid_tokens}; a drafter must merge them")
    return tokens, children


def _check_shapes(tree: TokenTree, scores: torch.Tensor) -> None:
    n = tree.num_nodes
    if scores.dim() != 2 or scores.shape[0] != n:
        raise ValueError(f"target scores must be [N={n}, V], got {tuple(scores.shape)}")
    if tree.draft_probs is not None and tree.draft_probs.shape != scores.shape:
        raise ValueError(f"draft_probs must be {tuple(scores.shape)}, got {tuple(tree.draft_probs.shape)}")


def _result(tokens: list[int], nodes: list[int], bonus: int) -> AcceptResult:
    return AcceptResult(accepted_nodes=nodes, bonus_token=bonus, node_tokens=[tokens[i] for i in nodes])
