"""Overlapped n-gram chains: a drafted step launched before the last one's tokens reach the host.

A drafted step run one by one leaves the GPU idle while the host commits its tokens, drafts and builds the
next batch; plain steps hide that time (gateway/overlap.py), so since they overlap, speculation that paid
1.23x on the embedded pair no longer pays (ARCHITECTURE.md, "Why speculation does not pay"). A prompt-lookup
chain needs nothing from the host to draft the next step, so this module keeps every input of the next step
on the device:

- each sequence's tokens in a device row (``ChainRun.hist``), extended by every step's picks there;
- the lookup itself (``NgramDrafter.lookup_on_device``, one kernel: the newest earlier occurrence of the last
  n tokens, longest n first, as the host's lookup finds it; the drafter's shipped table is not consulted);
- the next step's positions, context lengths and slots, offset on the device by this step's advance (its
  accepted drafts plus the root), and its tokens, in one launch (``target.batch.place_chains``); the host reserves
  blocks for the longest outcome;
- acceptance of a chain (verify/chains.py): greedy, the leading agreements of the target's picks and the
  drafts; sampled, speculative sampling of a deterministic draft (a draft d kept with probability p(d), a
  rejection drawn from p without d), with each request's own generator. A chain's accepted nodes already sit
  in their final slots, so no K/V moves.

Step n + 1 is launched before step n is resolved; step n's tokens are committed and emitted through
``Engine._settle`` while n + 1 runs, with each table kept to ``num_cached + depth + 1`` slots, the ones n + 1
writes. Outputs reach the caller one step later. (SGLang's overlap scheduler for speculative decoding keeps a
drafted step's inputs on the device the same way.)

A run starts from a plan where some decoding sequence drafts with an n-gram drafter and every one is greedy or
sampled without min-p, with no logit processing, logprobs, grammar or held stop token, drafting with that
drafter or not at all (a plain request, or one the budget leaves plain, rides as a one-token chain). Where a
batch could run so (``could_run``, the scheduler's ``chains``), its regular plan is planned as a run's later
steps are -- no acceptance cut, each depth priced by the overlapped chain steps measured at it (``ahead_kinds``:
apart from tree steps taken one by one, whose host work the GPU waits out) -- so a run starts where chains pay.
Before, a run could start only from a plan that kept a level under the acceptance cut and the stepped steps'
prices: on the CPU (bench/results/chain_ahead_cpu_planned.json, SmolLM2's shape cut to 4 layers) the planned arm
went from 1.455 to 1.600 tokens a step at batch 1 (fixed four-token chains 1.641) and from plain decoding to
5.22 at batch 4. Each
step's depths are planned anew while the last step runs (``Scheduler.chain_depths``: the cost cap over each
request's acceptance, or a probe, and the verify cap, as a plan sets them, but with no cut by ``min_gain``:
looked-up levels cost nothing to draft, and each depth's overlapped step is timed), so a chain deepens and
shallows with its acceptance within a run; the step reserves slots for the pending step's reach (its
depth there + 1) plus its own chain. Requests the scheduler admits meanwhile ride along as prompt chunks,
and join the run once their prompt is cached. The run ends -- the pending step resolved, the next planned as
usual -- when a sequence that is not eligible is decoding, the gate leaves adaptive requests plain, a
sequence nears its context limit, the pool cannot hold the next step's blocks, a prompt chunk scores its
prompt, no sequence drafts any more, or after ``MAX_RUN_STEPS`` steps. ``EngineConfig.chain_ahead`` turns
it on; off by default (under the budget's adaptive depths the gate measured n-gram chains below plain
decoding on an H100, though fixed four-token chains ran 1.15-1.27x of it at batch 1: ARCHITECTURE.md).
One-process targets only: a tensor-parallel target's ranks take the batch from the host.

A sequence that a step ends (a stop token, its length) or that is aborted was already fed into the next step:
that step's tokens for it are dropped at resolution, and the step after leaves it out (the run's device rows
narrowed to the others). Its blocks go back to the pool while a step may still write them -- safe as in
gateway/overlap.py: every later use of a block runs on the same stream after it, and the slots lie past the
prompt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from draft.ngram import NgramDrafter
from draft.tree import MAX_TREE_NODES, TokenTree
from gateway.budget import ahead_kinds, drafter_set
from gateway.sequence import Sequence, Status
from target.batch import Segment, build_batch, place_chains
from target.model import Transformer
from target.transfer import to_device
from verify.accept import AcceptResult
from verify.chains import accept_greedy_chains, accept_sampled_chains
from verify.sampling import process_rows

if TYPE_CHECKING:
    from gateway.engine import Engine, RequestOutput
    from gateway.scheduler import StepPlan

MAX_RUN_STEPS = 32  # then the pending step resolves and the scheduler plans anew (admissions, preemption)


@dataclass(slots=True)
class Sampled:
    """A run's sampled rows: which, their knobs, their logits rows and their generators."""

    index: torch.Tensor  # [S] int64: their rows in the run
    rows: torch.Tensor  # [S, K + 1] int64: each one's logits rows in a step (its last one past its depth)
    temperature: torch.Tensor  # [S]
    top_k: torch.Tensor  # [S] int64
    top_p: torch.Tensor  # [S]
    filtered: bool  # some row has top-k or top-p
    generators: list[torch.Generator]


@dataclass(slots=True)
class ChainRun:
    """One run's sequences and device state, kept across its steps."""

    seqs: list[Sequence]
    depths: list[int]  # draft tokens in each sequence's chain, fixed for the run (0: it decodes plainly)
    drafter: NgramDrafter  # whose n-gram sizes and window the lookup uses
    hist: torch.Tensor  # [B, cap] int64: each sequence's tokens, the next root last (past lens: stale)
    lens: torch.Tensor  # [B] int64: tokens in each row of hist
    row_seq: torch.Tensor  # [T] int64: the sequence of each row of a step's batch
    row_at: torch.Tensor  # [T] int64: each row's node in its chain (0: the root)
    offered: torch.Tensor  # [B, K] bool: the chain places each sequence drafts
    sampled: Sampled | None  # the sampled rows' knobs and draws; None: every row is greedy
    steps: int = 0

    @property
    def K(self) -> int:
        return max(self.depths)


@dataclass(slots=True)
class ChainInFlight:
    """A launched chain step whose tokens are not on the host yet."""

    run: ChainRun
    advance: torch.Tensor  # [B] int64 on the device: tokens the step commits (accepted drafts + the root)
    host: torch.Tensor  # [B, 2K + 2]: picks, accepted count, drafts; complete once ``event`` has passed
    event: torch.cuda.Event | None
    prefilled: bool  # the step also ran prompt chunks: not a decode step's time


@dataclass(slots=True)
class ChainStep:
    """What a chain step launches: the run's rows, the pending step's advance per row (None: no step is
    pending; 0 for a row that joined since) and the most it may be (``reach``: the row's depth in the pending
    step + 1; 0 where nothing of the row is pending), and the prompt chunks that ride along, as the scheduler
    admits and picks them."""

    run: ChainRun
    advance: torch.Tensor | None
    reach: list[int]
    prefills: list[tuple[Sequence, int]]


def prepare(engine: Engine) -> None:
    """Start-up work for chain runs: each n-gram drafter's table packed onto the target's device (~45 ms for
    the shipped table), so that a run's first step does not pay it."""
    if engine.config.chain_ahead and isinstance(engine.target, Transformer):
        for drafter in engine.drafters.values():
            if type(drafter) is NgramDrafter:
                drafter.device_table(engine.target.device)


def eligible(seq: Sequence, engine: Engine) -> bool:
    """Whether ``seq`` can take part in a run: its step needs nothing read on the host (see the docstring), and
    it drafts with an n-gram drafter or not at all (a plain request rides in the run as a one-token chain)."""
    s = seq.sampling
    return ((seq.drafter is None or type(engine.drafters.get(seq.drafter)) is NgramDrafter)
            and (s.is_greedy or s.min_p == 0) and not s.custom_logits and s.logprobs is None and seq.matcher is None
            and s.min_tokens <= len(seq.output_ids))


def from_plan(engine: Engine, plan: StepPlan) -> ChainStep | None:
    """A run's first step from a scheduler's plan, where it qualifies: some sequence drafts, every one is
    eligible, the drafting ones share one drafter, no prompt chunk scores its prompt; None otherwise."""
    if (not engine.config.chain_ahead or not isinstance(engine.target, Transformer) or not plan.decodes
            or _scores_prompts(plan.prefills)):
        return None
    seqs = [s for s, _ in plan.decodes]
    depths = [len(w) for _, w in plan.decodes]
    drafters = {s.drafter for s, k in zip(seqs, depths) if k}
    if len(drafters) != 1 or not all(eligible(s, engine) for s in seqs):
        return None  # nobody drafts (the plain overlap's case), or two drafters' sizes to look up with
    if _blocks(engine, seqs, depths, [0] * len(seqs)) is None:
        return None
    return ChainStep(_start(engine, seqs, depths, engine.drafters[drafters.pop()]), None, [0] * len(seqs),
                     plan.prefills)


def _scores_prompts(prefills: list[tuple[Sequence, int]]) -> bool:
    """A prompt chunk whose logits are read on the host (prompt logprobs): its step cannot be a chain's."""
    return any(s.wants_prompt_logprobs for s, _ in prefills)


def _admits(engine: Engine) -> bool:
    """Whether a waiting request may be admitted (its first prompt chunk then rides in the next step)."""
    sched = engine.scheduler
    return bool(sched.waiting) and len(sched.running) < sched.config.max_running


def _blocks(engine: Engine, seqs: list[Sequence], depths: list[int], reach: list[int]) -> int | None:
    """The blocks a step of these chains needs; None where one cannot be launched now: a sequence would pass
    the context, or the pool cannot hold every slot the step may write. ``reach``: how far the step in flight
    may advance each sequence first (its depth there + 1; 0 with none). (A sequence the pending step may end
    by length still goes ahead: its tokens past the end are dropped at resolution.)"""
    need = 0
    for s, k, r in zip(seqs, depths, reach):
        end = s.num_cached + r + k + 1
        if end > engine.max_model_len:
            return None
        need += s.table.blocks_needed(end)
    return need if need <= engine.cache.pool.num_free else None


def _start(engine: Engine, seqs: list[Sequence], depths: list[int], drafter: NgramDrafter) -> ChainRun:
    device = engine.target.device
    # every write stays inside (positions end at max_model_len; a step writes at most a pending chain's reach
    # and its own chain past them, each under MAX_TREE_NODES), whatever depths the run's steps take
    cap = engine.max_model_len + 2 * (MAX_TREE_NODES + 1) + 1
    return ChainRun(seqs, depths, drafter, *_rows(seqs, cap, device), *_layout(seqs, depths, device))


def _rows(seqs: list[Sequence], cap: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Device rows [B, cap] of the sequences' tokens as the host holds them (nothing of theirs pending), and
    their lengths [B]: one copy each of the tokens there are, not of the whole rows."""
    L = max(s.num_tokens for s in seqs)
    host = torch.zeros(len(seqs), L, dtype=torch.int64)
    for b, s in enumerate(seqs):
        host[b, : s.num_tokens] = torch.tensor(s.token_ids)
    rows = torch.zeros(len(seqs), cap, dtype=torch.int64, device=device)
    rows[:, :L] = to_device(host, device)
    return rows, to_device(torch.tensor([s.num_tokens for s in seqs]), device)


def _layout(seqs: list[Sequence], depths: list[int], device: torch.device) -> tuple:
    """``ChainRun.row_seq``, ``row_at``, ``offered`` and ``sampled`` for chains of ``depths``."""
    row_seq = torch.cat([torch.full((k + 1,), b) for b, k in enumerate(depths)])
    row_at = torch.cat([torch.arange(k + 1) for k in depths])
    K = max(depths)
    offered = torch.arange(K)[None, :] < torch.tensor(depths)[:, None]
    picked = [b for b, s in enumerate(seqs) if not s.sampling.is_greedy]
    sampled = None
    if picked:
        first = [0]
        for k in depths:
            first.append(first[-1] + k + 1)
        rows = torch.tensor([[first[b] + min(i, depths[b]) for i in range(K + 1)] for b in picked])
        knobs = [seqs[b].sampling for b in picked]
        sampled = Sampled(to_device(torch.tensor(picked), device), to_device(rows, device),
                          to_device(torch.tensor([k.temperature for k in knobs], dtype=torch.float32), device),
                          to_device(torch.tensor([k.top_k for k in knobs]), device),
                          to_device(torch.tensor([k.top_p for k in knobs], dtype=torch.float32), device),
                          any(k.top_k or k.top_p < 1 for k in knobs), [seqs[b].generator for b in picked])
    return to_device(row_seq, device), to_device(row_at, device), to_device(offered, device), sampled


def launch(engine: Engine, step: ChainStep) -> ChainInFlight:
    """One chain step: the prompt chunks first (their sequences' ``num_cached`` advanced now: a chunk yields
    no token), then each row's root and drafts at the positions after its last committed token, offset on the
    device by the pending step's advance."""
    run, advance, prefills = step.run, step.advance, step.prefills
    seqs, depths, K = run.seqs, run.depths, run.K
    device = run.hist.device
    for s, k, r in zip(seqs, depths, step.reach):  # the slots the step may write, past what build_batch reserves
        end = s.num_cached + r + k + 1
        s.table.ensure(end)
        engine.cache.make_writable(s.table, s.num_cached, end)
    segs = [Segment(s.table, s.num_cached, s.token_ids[s.num_cached : s.num_cached + n], logits="none")
            for s, n in prefills]
    segs += [Segment(s.table, s.num_cached, [0] * (k + 1), logits="all") for s, k in zip(seqs, depths)]
    batch = build_batch(segs, engine.cache, device)
    first, nb = sum(n for _, n in prefills), len(prefills)  # the chains' first row, and first segment
    span = min(run.hist.shape[1], max(s.num_tokens for s in seqs) + max(step.reach))
    drafts = run.drafter.lookup_on_device(run.hist, run.lens, span, K)  # [B, K]
    # the chains' rows moved by the pending step's advance, and their roots and drafts put in
    place_chains(batch, first, nb, run.hist, run.lens, drafts, advance, run.row_seq, run.row_at,
                 engine.cache.page_size)
    runner = engine.graphs if engine.graphs is not None else engine.target
    logits = runner.forward(batch, engine.cache)  # [R, V]: every chain row (the chunks score nothing)
    engine._advance_prefills(prefills)
    picks = torch.full((len(seqs), K + 1), -1, dtype=torch.int64, device=device)
    picks[run.row_seq, run.row_at] = logits.argmax(dim=-1)  # as greedy acceptance picks (verify/accept.py)
    accepted = accept_greedy_chains(picks, drafts, run.offered)  # [B]; emitted: picks[:, :accepted + 1]
    if run.sampled is not None:
        picks, accepted = _sample(run.sampled, logits, drafts, run.offered, picks, accepted)
    run.hist.scatter_(1, run.lens[:, None] + torch.arange(K + 1, device=device), picks)  # past the advance: stale
    advance = accepted + 1
    run.lens += advance
    run.steps += 1
    out = torch.cat([picks, accepted[:, None], drafts], 1)  # [B, 2K + 2]
    host, event = out, None
    if out.is_cuda:
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    engine.num_steps += 1
    return ChainInFlight(run, advance, host, event, bool(prefills))


def _sample(sampled: Sampled, logits: torch.Tensor, drafts: torch.Tensor, offered: torch.Tensor, picks: torch.Tensor,
            accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled rows' emitted tokens and accepted counts put in place of their greedy ones (verify/chains.py):
    each one's processed distributions, its K uniforms and its bonus race drawn from its own generator."""
    probs = process_rows(logits[sampled.rows], sampled.temperature, sampled.top_k, sampled.top_p,
                         sampled.filtered)  # [S, K + 1, V]
    K, V = drafts.shape[1], logits.shape[1]
    u = torch.stack([torch.rand(K, generator=g, device=logits.device) for g in sampled.generators])
    race = torch.empty(len(sampled.generators), V, device=logits.device)
    for row, g in zip(race, sampled.generators):
        row.exponential_(generator=g)
    taken, emitted = accept_sampled_chains(probs, drafts[sampled.index], offered[sampled.index], u, race)
    picks, accepted = picks.clone(), accepted.clone()
    picks[sampled.index], accepted[sampled.index] = emitted, taken
    return picks, accepted


def continues(engine: Engine, prev: ChainInFlight) -> ChainStep | None:
    """The step to launch ahead of ``prev``; None where the run ends (see the docstring). Sequences that ended
    since ``prev`` was launched leave the run (its device rows narrowed); sequences whose prompt is now cached join it
    (``_joined``), and the waiting requests the scheduler admits ride along as prompt chunks."""
    run, sched = prev.run, engine.scheduler
    if run.steps >= MAX_RUN_STEPS:
        return None
    keep = [b for b, s in enumerate(run.seqs) if s.status is Status.RUNNING]
    seqs = [run.seqs[b] for b in keep]
    inside = {id(s) for s in seqs}
    joiners = [s for s in sched.running if not s.is_prefilling and id(s) not in inside]
    if not keep or not all(eligible(s, engine) for s in seqs + joiners):
        return None  # every row ended (joiners start a run from the next plan), or a request the run cannot carry
    if sched.roots_fill_cap(len(seqs) + len(joiners)):
        return None  # a plan of this batch would draft nothing
    gated = sched.gate is not None and not sched.gate.allows(len(seqs) + len(joiners))
    if gated and any(engine._template_of(s)[1] for s in seqs):
        return None  # the gate's plain arm: adaptive requests decode plainly
    # each row's depth as a plan would set it now (shallower or deeper than in the pending step), within the
    # verify cap; 0 for a row drafting with another drafter (it rides as a one-token chain)
    depths = [k if s.drafter is not None and engine.drafters[s.drafter] is run.drafter else 0
              for s, k in zip(seqs + joiners, sched.chain_depths(seqs + joiners, engine._template_of))]
    if max(depths) == 0:
        return None  # nobody drafts any more
    depths, joined = depths[: len(seqs)], depths[len(seqs) :]
    # the pending step may advance a kept row by its depth there + 1, whatever its depth in the next
    reach = [run.depths[b] + 1 for b in keep] + [0] * len(joiners)
    need = _blocks(engine, seqs + joiners, depths + joined, reach)
    if need is None:
        return None
    prefills = []
    if _admits(engine) or any(s.is_prefilling for s in sched.running):
        budget = sched.config.max_step_tokens - sum(k + 1 for k in depths + joined)
        prefills = sched.plan_prefills(budget, engine.cache.pool.num_free - need)
        if _scores_prompts(prefills):
            return None  # admitted, and planned again as usual
    advance = prev.advance
    if len(keep) < len(run.seqs) or depths != run.depths:  # rows that ended leave; chains change depth
        hist, lens = run.hist, run.lens
        if len(keep) < len(run.seqs):
            index = to_device(torch.tensor(keep), hist.device)
            hist, lens, advance = hist[index], lens[index], advance[index]
        run = ChainRun(seqs, depths, run.drafter, hist, lens, *_layout(seqs, depths, hist.device), run.steps)
    if joiners:
        run = _joined(engine, run, joiners, joined)
        advance = torch.cat([advance, torch.zeros(len(joiners), dtype=advance.dtype, device=advance.device)])
    return ChainStep(run, advance, reach, prefills)


def _joined(engine: Engine, run: ChainRun, seqs: list[Sequence], depths: list[int]) -> ChainRun:
    """``run`` with rows for ``seqs`` added, from their tokens on the host (nothing of theirs is pending)."""
    device = run.hist.device
    rows, lens = _rows(seqs, run.hist.shape[1], device)
    all_depths = run.depths + depths
    return ChainRun(run.seqs + seqs, all_depths, run.drafter, torch.cat([run.hist, rows]), torch.cat([run.lens, lens]),
                    *_layout(run.seqs + seqs, all_depths, device), run.steps)


def resolve(engine: Engine, prev: ChainInFlight, successor: ChainInFlight | None) -> list[RequestOutput]:
    """``prev``'s tokens committed and emitted for its sequences still running; ``successor``: the run's step
    launched after it, whose chains' slots the tables keep (None: none was)."""
    if prev.event is not None:
        t0 = time.perf_counter()
        prev.event.synchronize()
        engine.wait_s += time.perf_counter() - t0
    run, K = prev.run, prev.run.K
    rows = prev.host.tolist()
    seqs, trees, results, offered = [], [], [], []
    for s, k, row in zip(run.seqs, run.depths, rows):
        if s.status is not Status.RUNNING:
            continue  # ended or aborted since the step was launched
        picks, accepted, drafts = row[: K + 1], row[K + 1], row[K + 2 : K + 2 + k]
        tokens = [s.last_token, *drafts]
        nodes = list(range(accepted + 1))
        seqs.append(s)
        trees.append(TokenTree.from_lists(tokens, [-1, *range(k)]))
        results.append(AcceptResult(nodes, picks[accepted], [tokens[i] for i in nodes]))
        offered.append(k)
    return engine._settle(seqs, trees, results, offered, {}, keep=1 + successor.run.K if successor else 1)


def kinds(run: ChainRun) -> tuple[str, ...]:
    """The drafters of the run's steps, as the step-cost model keys an overlapped chain step of them."""
    return ahead_kinds(drafter_set(s.drafter for s in run.seqs))


def could_run(engine: Engine, seqs: list[Sequence]) -> bool:
    """Whether these decoding sequences could take their next step as an overlapped chain run's (``from_plan``'s
    test of the sequences, before any depth is planned): the scheduler then prices their draft levels as chain
    steps and plans them as a run's continuing steps are planned (``Scheduler.chains``)."""
    return (engine.config.chain_ahead and isinstance(engine.target, Transformer) and bool(seqs)
            and all(eligible(s, engine) for s in seqs) and len({s.drafter for s in seqs if s.drafter}) == 1)
