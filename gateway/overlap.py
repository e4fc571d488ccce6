"""Overlapped plain decoding: the next step is launched before this one's tokens reach the host.

A plain decode step ends in one host copy, the picked tokens, and everything the host does after it --
committing and emitting the tokens, scheduling, building the next batch, loading the graph's inputs --
leaves the GPU idle. For a small target that host time is a large share of a step. While every decoding
sequence decodes plainly, the next step's inputs are known without the copy: each sequence's next token is
the pick still on the device, its position one past the last, its slot the next in its block table. So the
engine launches step n + 1 with those tokens read on the device, and only then waits for step n's copy and
commits it, while step n + 1 runs (the zero-overhead batch scheduler of SGLang works the same way).
Outputs reach the caller one step later.

Eligible sequences decode plainly -- speculation off, or a speculating request the budget leaves plain
this step (``Scheduler.plans_plain``: its acceptance pays no draft level and no probe is due, or the
batch's roots fill the verify cap) -- with no logit processing that depends on the host's view of the
output (a grammar) and no feature drafter. Logprobs are taken on the device beside the picks, from the raw
logits the next replay overwrites; bias, penalties and allowed tokens are applied in one batched pass, with
each pending pick counted on the device first; min_tokens holds stops back counting the pending pick. A
step is planned ahead when every decoding sequence is eligible and the pool holds each one's next slot:
the last step's sequences (minus those whose pending token is their last by length) fed their picks,
sequences whose prefill ended in the last step fed their roots, and the prefill chunks the scheduler
admits and picks as usual (a chunk yields no token, so its ``num_cached`` advances at launch).
Otherwise -- a request that may draft, a prompt-logprobs prefill, a missing block -- the pending step is
resolved and the engine plans that step as usual.

A sequence that the pending token ends (a stop token) or that is aborted meanwhile was already fed into
step n + 1: that step's token for it is dropped at resolution. Its blocks go back to the pool while step
n + 1 may still write the sequence's next slot. That is safe because every later use of a block runs on
the same stream after it, and the slot lies past the prompt, so in no block the prefix cache shares.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from draft.tree import TokenTree
from gateway.sequence import Sequence, Status
from target.batch import Segment, build_batch
from target.transfer import to_device
from verify.accept import AcceptResult, Launched, finish_accept, launch_accept
from verify.logprobs import TokenLogprob, logprob_table, parse_table

if TYPE_CHECKING:
    from gateway.engine import Engine
    from gateway.scheduler import StepPlan


# A launched step's trees before resolution: one-node trees whose root the host does not know yet. Shared, as
# acceptance only reads them.
PENDING_ROOT = TokenTree.root_only(0)


@dataclass(slots=True)
class InFlight:
    """A launched plain step whose picks are not on the host yet."""

    seqs: list[Sequence]
    launched: Launched
    next_tokens: torch.Tensor  # [B] int64 on the device: each sequence's picked token, in ``seqs`` order
    host: torch.Tensor  # the picks' host copy (pinned on CUDA), complete once ``event`` has passed
    event: torch.cuda.Event | None
    prefilled: bool  # the step also ran prompt chunks: not a plain decode step's time
    asked: list[int]  # the sequences (by index in ``seqs``) that want logprobs
    table: torch.Tensor | None  # their rows of ``logprob_table``, copied to the host like ``host``


def eligible(seq: Sequence, engine: Engine) -> bool:
    """Whether ``seq``'s next token can be fed to a step before the host has seen it: it has no grammar
    (whose parser reads each token on the host) and no feature drafter waiting for the target's features of
    its positions. Logprobs are taken on the device beside the picks, penalties count the pending pick on the
    device (``Sequence.counted_ahead``), and min_tokens counts it as emitted."""
    return seq.matcher is None and seq.drafter not in engine._feature_drafters


@dataclass(slots=True)
class Ahead:
    """The step after a pending one, planned before it is resolved."""

    ahead: list[Sequence]  # decoding in the pending step: their tokens are its picks, still on the device
    host: list[Sequence]  # decoding, their roots on the host (a prefill that ended in the pending step)
    prefills: list[tuple[Sequence, int]]  # prompt chunks, as the scheduler admits and picks them


def plan_ahead(engine: Engine, prev: InFlight) -> Ahead | None:
    """The next step's segments while ``prev`` is in flight; None where it cannot be planned now (see the
    module's docstring)."""
    sched = engine.scheduler
    pending = {id(s) for s in prev.seqs}
    ahead, host = [], []
    for s in sched.running:
        if s.is_prefilling:
            continue
        if id(s) not in pending:
            host.append(s)
        elif len(s.output_ids) + 1 < s.sampling.max_tokens and s.num_tokens + 1 < engine.max_model_len:
            ahead.append(s)  # (else its pending token is its last, by length)
    batch = len(ahead) + len(host)
    if not batch or not all(eligible(s, engine) for s in ahead + host):
        return None
    speculating = [(s, id(s) in pending) for s in ahead + host if s.drafter]
    if speculating and not sched.plans_plain(speculating, engine._template_of, batch,
                                             sched.chains is not None and sched.chains(ahead + host)):
        return None  # the next plan may draft for one of them
    free = engine.cache.pool.num_free - sum(s.table.blocks_needed(s.num_cached + 2) for s in ahead) - sum(
        s.table.blocks_needed(s.num_cached + 1) for s in host)
    if free < 0:
        return None
    prefills = sched.plan_prefills(engine.config.scheduler.max_step_tokens - len(ahead) - len(host), free)
    if _scores_prompts(prefills):
        return None
    sched.num_schedules += 1  # a plan, for the probes' cadence (Scheduler._probe_due)
    return Ahead(ahead, host, prefills)


def from_plan(engine: Engine, plan: StepPlan) -> Ahead | None:
    """A scheduler's plan as the first step of an overlapped run, where it qualifies: every decode plain and
    eligible, no prefill scoring its prompt."""
    if not plan.decodes or any(w or not eligible(s, engine) for s, w in plan.decodes) or _scores_prompts(plan.prefills):
        return None
    return Ahead([], [s for s, _ in plan.decodes], plan.prefills)


def _scores_prompts(prefills: list[tuple[Sequence, int]]) -> bool:
    """A prefill chunk whose logits are read on the host (prompt logprobs): its step cannot go ahead."""
    return any(s.wants_prompt_logprobs for s, _ in prefills)


def launch(engine: Engine, plan: Ahead, prev: InFlight | None) -> InFlight:
    """One plain step, up to the picks' host copy: ``plan.prefills``' chunks (their sequences' ``num_cached``
    advanced now: a chunk yields no token), then ``plan.ahead``, each fed its pick in ``prev`` at the position
    after its last committed one, then ``plan.host`` from their roots."""
    segs = [Segment(s.table, s.num_cached, s.token_ids[s.num_cached : s.num_cached + n], logits="none")
            for s, n in plan.prefills]
    first = sum(n for _, n in plan.prefills)  # the row of the first decoding segment
    segs += [Segment(s.table, s.num_cached + 1, [0], logits="all") for s in plan.ahead]
    segs += [Segment(s.table, s.num_cached, [s.last_token], logits="all") for s in plan.host]
    batch = build_batch(segs, engine.cache, engine.target.device)
    if plan.ahead:
        where = {id(s): k for k, s in enumerate(prev.seqs)}
        rows = [where[id(s)] for s in plan.ahead]
        src = (prev.next_tokens[: len(rows)] if rows == list(range(len(rows))) else
               prev.next_tokens[to_device(torch.tensor(rows), batch.tokens.device)])
        batch.tokens[first : first + len(rows)].copy_(src)
    runner = engine.graphs if engine.graphs is not None else engine.target
    raw = logits = runner.forward(batch, engine.cache)
    engine._advance_prefills(plan.prefills)
    seqs = plan.ahead + plan.host
    trees = [PENDING_ROOT] * len(seqs)  # roots named at resolution, once the host knows them (read-only here)
    starts = batch.logits_start[len(plan.prefills):]
    if any(s.sampling.custom_logits for s in seqs):  # bias, penalties, allowed tokens: one batched pass
        for k, seq in enumerate(plan.ahead):  # each root, the pending pick, counted as emitted
            if seq.sampling.custom_logits:
                state = engine._penalties_of(seq, logits.device)
                one = torch.ones(1, dtype=state.counts.dtype, device=logits.device)
                state.counts.index_add_(0, src[k : k + 1], one)
                seq.counted_ahead = 1
        logits = engine._process(logits, starts, seqs, trees)
    pending = [1] * len(plan.ahead) + [0] * len(plan.host)  # each ahead sequence's pick is not emitted yet
    if any(s.sampling.min_tokens > len(s.output_ids) + p for s, p in zip(seqs, pending)):
        logits = engine._hold_stops(logits, starts, seqs, trees, pending)
    launched = launch_accept(trees, logits, starts,
                             [s.verify_sampling for s in seqs], [s.generator for s in seqs], [(None, None)] * len(seqs))
    picks = launched.picks
    at = [launched.at[k] for k in range(len(seqs))]
    next_tokens = (picks[: len(seqs)] if at == list(range(len(seqs))) else
                   picks[to_device(torch.tensor(at), picks.device)])
    asked = [k for k, s in enumerate(seqs) if s.sampling.logprobs is not None]
    table = None
    if asked:  # the raw logits' figures for the picks, before the next replay overwrites them
        index = to_device(torch.tensor([[k for k in asked], [launched.starts[k] for k in asked]]), picks.device)
        table = logprob_table(raw, index[1], next_tokens[index[0]], max(seqs[k].sampling.logprobs for k in asked))
    host, event = _to_host(picks), None
    if table is not None:
        table = _to_host(table)
    if picks.is_cuda:
        event = torch.cuda.Event()
        event.record()
    engine.num_steps += 1
    return InFlight(seqs, launched, next_tokens, host, event, bool(plan.prefills), asked, table)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` into pinned host memory, not waited for (``InFlight.event`` marks its end); as is on the
    CPU."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def resolve(engine: Engine, prev: InFlight) -> list:
    """``prev``'s tokens committed and emitted (``Engine._commit`` / ``_emit``), for its sequences still
    running; their outputs."""
    if prev.event is not None:
        t0 = time.perf_counter()
        prev.event.synchronize()  # only prev's copy: a step launched after it may still run
        engine.wait_s += time.perf_counter() - t0
    ids = prev.host.tolist()
    prev.launched.trees = [TokenTree.root_only(s.last_token) for s in prev.seqs]
    results: list[AcceptResult] = finish_accept(prev.launched, ids)
    logprobs: dict[int, list[TokenLogprob]] = {}
    if prev.table is not None:
        entries = parse_table(prev.table.tolist(), [results[k].tokens[0] for k in prev.asked])
        for k, e in zip(prev.asked, entries):
            logprobs[k] = [TokenLogprob(e.token_id, e.logprob, e.top[: prev.seqs[k].sampling.logprobs])]
    kept = [k for k, s in enumerate(prev.seqs) if s.status is Status.RUNNING]
    # the tables keep each next root's slot (num_cached), which a launched step may be writing
    return engine._settle([prev.seqs[k] for k in kept], [prev.launched.trees[k] for k in kept],
                          [results[k] for k in kept], [0] * len(kept),
                          {j: logprobs[k] for j, k in enumerate(kept) if k in logprobs})
