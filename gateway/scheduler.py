"""Continuous batching: which sequences run this step, with how many prefill tokens or tree nodes.

Pure Python over ``Sequence`` objects and the ``BlockPool`` (no torch: it is tested on its own). KV
blocks are only counted here and allocated when the forward batch is built. When the pool cannot hold
a step, the least urgent running sequence (lowest priority, latest arrival) is preempted: its blocks are
freed and it recomputes later (vLLM's recompute policy). Tree sizes come from ``gateway/budget.py``.

Waiting order: lower ``priority`` first; within a priority, arrival order (FIFO) or, with
``policy="sef"``, shortest expected first. Every ``aging_s`` seconds of waiting lifts a request by one
priority class, so nothing starves.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from gateway.budget import (BudgetConfig, DrafterPriors, SpecGate, StepCosts, adaptive_widths, ahead_kinds,
                            cap_total, drafter_set, expected_tokens, probe_due, probe_interval)
from gateway.sequence import Sequence, Status
from target.blocks import BlockPool, BlockTable

# (template widths, adapt?) for a decoding sequence: adapt=False keeps a tree the request asked for
TemplateOf = Callable[[Sequence], tuple[tuple[int, ...], bool]]
# Prefill tokens a step gives a request for prompt logprobs: its chunk's logits are [n, vocab] float32 (for a
# 128k vocabulary, 128 MB at 256 tokens).
PROMPT_LOGPROBS_CHUNK = 256


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_running: int = 32  # sequences holding KV at once
    max_step_tokens: int = 1024  # prefill tokens + tree nodes per step
    max_waiting: int = 256  # queue bound: beyond it submissions are refused (HTTP 429)
    max_model_len: int = 2048
    policy: str = "fifo"  # "fifo" or "sef" (shortest expected first) within a priority class
    aging_s: float = 10.0  # seconds of waiting that lift a request by one priority class
    budget: BudgetConfig = field(default_factory=BudgetConfig)

    def __post_init__(self) -> None:
        for name in ("max_running", "max_step_tokens", "max_waiting", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.policy not in ("fifo", "sef"):
            raise ValueError(f"policy must be 'fifo' or 'sef', got {self.policy!r}")
        if self.aging_s <= 0:
            raise ValueError(f"aging_s must be > 0, got {self.aging_s}")


@dataclass(slots=True)
class StepPlan:
    prefills: list[tuple[Sequence, int]]  # (sequence, number of prompt tokens to prefill now)
    decodes: list[tuple[Sequence, tuple[int, ...]]]  # (sequence, tree widths for this step)
    preempted: list[Sequence]
    exhausted: list[Sequence] = field(default_factory=list)  # alone and still out of KV: end with "length"

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.pool = pool
        self.clock = clock
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.costs = StepCosts(reprobe=config.budget.reprobe)  # the engine reports each decode step's time
        self.priors = DrafterPriors()  # each drafter's acceptance so far: where a new request's estimate starts
        budget = config.budget
        # speculation against plain decoding, end to end (the engine reports every step); None: the caps alone
        self.gate = (SpecGate(budget.gate_block, budget.gate_explore, budget.gate_drafters or ())
                     if budget.gate and budget.cost_aware else None)
        self._gate_open = True  # this plan's: whether adaptive requests may draft at all
        self.num_schedules = 0  # probes fall on every interval-th plan (see gateway/budget.py)
        self._intervals: dict[str | None, int] = {}  # this plan's probe interval per drafter
        self._batch = 0  # this plan's decoding sequences: the batch whose step costs price a probe
        # True while a caller waits for every running request to end (``LLM.generate``): with nobody waiting
        # to take a finished request's place, only drafts of the requests furthest from done shorten that.
        self.batch_completion = False
        # Whether a batch of decoding sequences could run as an overlapped chain (gateway/chain_ahead.py
        # could_run; set by the engine): its plan then prices draft levels as chain steps and leaves out the
        # acceptance cut, as chain_depths does for a run's later steps, so that a run can start where chains pay.
        self.chains: Callable[[list[Sequence]], bool] | None = None

    def add(self, seq: Sequence) -> None:
        seq.acceptance = self.priors.start(seq.drafter)
        self.waiting.append(seq)

    def observe_acceptance(self, seq: Sequence, accepted: int, depth: int) -> None:
        """A decode step of ``seq`` drafted ``depth`` levels and kept ``accepted`` tokens of them."""
        seq.acceptance.update(accepted, depth)
        if seq.drafter and depth > 0:
            self.priors.observe(seq.drafter, accepted, depth)

    def observe_step(self, seq: Sequence, accepted: int, depth: int, offered: int) -> None:
        """A decode step of ``seq``: the plan offered it ``offered`` draft levels, its drafter's tree had
        ``depth`` (0: nothing, or plain decoding) and the target kept ``accepted`` of them. A drafter with
        nothing to offer (an n-gram lookup without a match) counts as one failed level: the budget prices what
        offering a tree yields. Counted as no trial at all, a sequence whose lookups rarely match kept its
        prior's promise, and at batch 16 on the H200 the budget drafted four levels for 16 sequences that
        returned 1.12 tokens a step (engine_real_a5ef89b.json). A step without a tree counts toward the
        sequence's next probe."""
        self.observe_acceptance(seq, accepted, depth if depth else min(offered, 1))
        seq.steps_without_draft = 0 if depth else seq.steps_without_draft + 1

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished or aborted); the engine frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def urgency(self, seq: Sequence, now: float) -> tuple[float, float, float]:
        """Sort key, smallest first: aged priority class, then SEF length or nothing, then arrival."""
        aged = seq.priority - int((now - seq.arrival_time) / self.config.aging_s)
        length = seq.num_tokens + seq.remaining_tokens if self.config.policy == "sef" else 0
        return (aged, length, seq.arrival_time)

    def schedule(self, template_of: TemplateOf) -> StepPlan:
        plan = StepPlan([], [], [])
        self.num_schedules += 1
        self._intervals.clear()
        decoding = [s for s in self.running if not s.is_prefilling]
        widths = self._plan_widths(decoding, template_of, chain=self.chains is not None and self.chains(decoding))
        budget = self.config.max_step_tokens
        reserved = 0  # blocks this plan will allocate
        for seq, w in zip(decoding, widths):
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            w = self._fit_budget(w, budget)
            need = seq.table.blocks_needed(seq.num_cached + 1 + sum(w))
            while need > self.pool.num_free - reserved and self._preempt_victim(plan, exclude=seq):
                pass
            if need > self.pool.num_free - reserved:
                w = ()
                need = seq.table.blocks_needed(seq.num_cached + 1)
                if need > self.pool.num_free - reserved:  # not even one slot
                    if len(self.running) == 1:  # nobody else will ever free a block: it cannot grow
                        self.running.remove(seq)
                        plan.exhausted.append(seq)
                    else:  # wait for others to finish, then recompute
                        self._preempt(plan, seq)
                    continue
            reserved += need
            budget -= 1 + sum(w)
            plan.decodes.append((seq, w))
        self._plan_prefills(plan, budget, self.pool.num_free - reserved)
        return plan

    def chain_depths(self, decoding: list[Sequence], template_of: TemplateOf) -> list[int]:
        """The draft depth a plan would give each of ``decoding`` now -- the cost cap over its acceptance (or a
        probe), the verify cap -- admitting, preempting and reserving nothing: an overlapped
        chain run's next step (gateway/chain_ahead.py), planned while the last one runs. Counts as a plan for
        the probes' schedule.

        With a cost-aware budget the acceptance cut (``min_gain``) is left out here: a chain's levels are looked
        up, costing nothing to draft, and each chain depth's overlapped step is timed as such (Engine._step_ahead),
        so the measured costs alone cut the depth. At the embedded pair's n-gram acceptance (about 0.37 a level)
        the cut of 0.2 left depth 1 or a probe, and the gate measured those chains at 876 tokens/s against plain
        decoding's 1,225, where fixed four-token chains ran 1.15-1.27x of it (H100, engine_real_h100_b7cf8a0.json)."""
        self.num_schedules += 1
        self._intervals.clear()
        return [len(w) for w in self._plan_widths(decoding, template_of, chain=True)]

    def _plan_widths(self, decoding: list[Sequence], template_of: TemplateOf,
                     chain: bool = False) -> list[tuple[int, ...]]:
        """Each decoding sequence's tree widths this step: the budget's cut at its acceptance (or a probe), the
        cost cap, the verify cap. ``chain``: planned as an overlapped chain step (``_free``: no acceptance cut
        under a cost-aware budget; priced by ``ahead_kinds``)."""
        self._batch = len(decoding)
        self._gate_open = self.gate is None or self.gate.allows(len(decoding))
        if self.roots_fill_cap(len(decoding)):  # every tree would be cut away
            return [()] * len(decoding)
        free = self._free(chain)
        asked = [self._widths(s, template_of, free) for s in decoding]
        if not any(w for w, _ in asked):  # nobody drafts this step (the usual case where speculation is off)
            return [()] * len(decoding)
        widths = self._cap_depth(decoding, asked, chain) if self.config.budget.cost_aware else [w for w, _ in asked]
        return cap_total(widths, [s.acceptance.alpha for s in decoding], self.config.budget.max_verify_tokens)

    def _widths(self, seq: Sequence, template_of: TemplateOf, free: bool = False) -> tuple[tuple[int, ...], bool]:
        """The sequence's widths this step, and whether the budget may cut them further (``free``: no cut by
        acceptance, ``chain_depths``)."""
        template, adapt = template_of(seq)
        if adapt and not self._gate_open:  # the gate's plain arm: no tree, no probe
            return (), adapt
        if template and adapt:  # the probe's schedule is looked up only where no depth pays
            template = adaptive_widths(template, seq.acceptance.alpha, self.config.budget,
                                       lambda: self._probe_due(seq), 0.0 if free else None)
        if not template:  # speculation off, or plain decoding this step (the common case at high load)
            return template, adapt
        # No deeper than the tokens still wanted (a step emits depth + 1) or the context allows.
        depth = min(len(template), seq.remaining_tokens - 1, self.config.max_model_len - seq.num_tokens)
        return template[: max(depth, 0)], adapt

    def _cap_depth(self, decoding: list[Sequence], asked: list[tuple[tuple[int, ...], bool]],
                   chain: bool = False) -> list[tuple[int, ...]]:
        """Cut the adaptive trees to the depth with the most expected tokens per measured second
        (``StepCosts``). Draft levels run one after another for the whole batch, so the step's cost
        follows its deepest tree; trees a request fixed itself set the floor. ``chain``: priced as an
        overlapped chain step (``ahead_kinds``)."""
        widths = [w for w, _ in asked]
        cut = [i for i, (w, adapt) in enumerate(asked) if adapt and w]
        floor = max((len(w) for w, adapt in asked if not adapt), default=0)
        top = max((len(widths[i]) for i in cut), default=0)
        if top <= floor:
            return widths
        pays = self._shortens_batch(decoding, top) if self.batch_completion and not self.waiting else None
        kinds = self._kinds((s.drafter for s, (w, _) in zip(decoding, asked) if w), chain)
        max_ratio = self._max_ratio(any(not s.drafter for s in decoding))
        c = self._best_cap(len(decoding), [s.acceptance.alpha for s in decoding], widths, cut, floor, pays, kinds,
                           max_ratio)
        # A probe is a draft level like any other for the plain requests riding along: where the bound rules
        # depth 1 out, a probe would cost them its price and could not return the batch to speculation.
        # (H100, 2485e10: a one-level n-gram step cost 1.4x a plain one at batch 16 in
        # engine_real_h100_2485e10.json, so the mixed server's drafting at 16 streams could only be probes: one
        # every 16 steps, about 2.5% of its plain requests' time. They ran 6% slower a token than an all-plain
        # server's, load_gpu_h100_2485e10.json.)
        may_probe = c == 0 and self.costs.within(len(decoding), 1, kinds, max_ratio)
        for i in cut:
            # A sequence the cap keeps from drafting never updates its acceptance, so a cap set on a low
            # early estimate would hold for good: every probe interval it drafts one level anyway (on the
            # scheduler's probe steps, with every other due sequence).
            stale = may_probe and (pays is None or pays[i]) and self._probe_due(decoding[i])
            widths[i] = widths[i][:1] if stale else widths[i][:c]
        return widths

    def _free(self, chain: bool) -> bool:
        """Whether a plan leaves out the acceptance cut: a chain step's under a cost-aware budget (its levels are
        looked up, and each depth's overlapped step is timed, so the measured costs alone cut it)."""
        return chain and self.config.budget.cost_aware

    @staticmethod
    def _kinds(drafters: Iterable[str | None], chain: bool) -> tuple[str, ...]:
        """``StepCosts``' key for a step whose trees these drafters grew: as an overlapped chain step's if ``chain``."""
        kinds = drafter_set(drafters)
        return ahead_kinds(kinds) if chain else kinds

    def _max_ratio(self, plain_riders: bool) -> float | None:
        """The bound on a step's cost over a plain step's while requests that do not speculate ride along
        (``BudgetConfig.plain_penalty``); None without such requests or without the bound."""
        penalty = self.config.budget.plain_penalty
        return 1.0 + penalty if penalty is not None and plain_riders else None

    def _best_cap(self, batch: int, alphas: list[float], widths: list[tuple[int, ...]], cut: list[int], floor: int,
                  pays: list[bool] | None, kinds: tuple[str, ...], max_ratio: float | None, riders: int = 0) -> int:
        """The depth cap on the adaptive trees ``cut`` (indices into ``widths``) with the most expected tokens
        per measured second, at least ``floor``; ``pays`` (if given): the sequences whose tokens count;
        ``riders``: more sequences in the step, not in ``widths``, each emitting its root alone."""
        top = max((len(widths[i]) for i in cut), default=0)
        adaptive = set(cut)
        fixed = riders + sum(expected_tokens(alphas[i], len(w)) for i, w in enumerate(widths) if i not in adaptive)
        # gains[c]: the step's expected tokens with the adaptive trees cut to depth c (under batch_completion,
        # only those of the sequences the batch's end waits on). Per tree, one running sum of alpha ** d: this
        # runs every step over the whole batch.
        gains = [fixed] * (top + 1)
        for i in cut:
            if pays is not None and not pays[i]:
                continue  # its tokens, drafted or not, do not bring the batch's end closer
            a, term, tokens = alphas[i], 1.0, 1.0
            depth = len(widths[i])
            for c in range(top + 1):
                gains[c] += tokens
                if c < depth:
                    term *= a
                    tokens += term
        return self.costs.best_depth(batch, gains, floor, kinds, max_ratio)

    def _shortens_batch(self, decoding: list[Sequence], top: int) -> list[bool]:
        """Which decoding sequences' drafted tokens can bring the batch's end closer: those within one step's
        tokens (``top`` + 1) of the most any running sequence still may generate. The others finish first
        anyway, and every step is paid for the last one whatever they keep. A prefilling sequence counts with
        its whole budget: the batch waits for it too."""
        last = max(s.remaining_tokens for s in self.running)
        return [s.remaining_tokens >= last - (top + 1) for s in decoding]

    def _probe_due(self, seq: Sequence) -> bool:
        """Whether ``seq``, decoding plainly, drafts one level this plan. Its drafter's probe interval is
        priced from this batch's measured plain and one-level steps (``probe_interval``)."""
        interval = self._intervals.get(seq.drafter)
        if interval is None:
            interval = self._intervals[seq.drafter] = self._interval(seq.drafter, self._batch)
        return probe_due(seq.steps_without_draft, self.num_schedules, interval)

    def _interval(self, drafter: str | None, batch: int) -> int:
        cfg = self.config.budget
        plain = self.costs.seconds(batch, 0) if cfg.cost_aware else None
        probe = self.costs.seconds(batch, 1, drafter_set([drafter])) if cfg.cost_aware else None
        return probe_interval(plain, probe, cfg)

    def roots_fill_cap(self, batch: int) -> bool:
        """Whether ``batch`` decoding sequences' roots alone fill the verify cap: every tree of such a step is cut
        away, whatever the budget or the gate's arm (so the gate does not count it: both arms run it plain)."""
        return batch >= self.config.budget.max_verify_tokens

    def plans_plain(self, seqs: Iterable[tuple[Sequence, bool]], template_of: TemplateOf, batch: int,
                    chain: bool = False) -> bool:
        """Whether the next plan leaves every one of ``seqs`` plain, asked before the step ahead of them is
        committed (each with ``pending``: a plain step of it is in flight and will count toward its probe) and
        changing nothing: an overlapped step's test for speculating requests (gateway/overlap.py). ``seqs`` are
        the batch's sequences with a drafter; the other ``batch - len(seqs)`` ride plainly. False where unsure:
        a tree template fixed by the request, or one the plan may still keep. What holds for the whole batch --
        the roots filling the verify cap, the gate's plain arm -- is asked once, not per sequence: 64 n-gram
        streams under a gate held plain cost an overlapped step 0.638 ms of host time against 0.608 for plain
        requests, and 0.615 against 0.600 so (``bench/host_step.py``, CPU, ``host_step_gated_cpu.json``).

        With a cost-aware budget the trees the acceptance keeps go through the plan's depth cap as well
        (``_best_cap``, and its probe rule): where the measured step costs leave every one plain, the plan
        will, and the step goes ahead. Without that, a batch whose acceptance kept a level that its costs cut
        drained the overlap at every step -- the plan ran plain, one step was launched ahead, and the next
        step's test, blind to the costs, stopped the pipeline again -- so its plain steps ran at the speed of
        steps taken one by one. On an H100 the n-gram arm measured 10,768 tokens/s at batch 16 where plain
        decoding runs at 15,532, with 12 of 129 steps launched ahead (engine_real_h100_fa9f052.json), which fits
        that pattern; the fix has not yet run on a GPU. ``chain``: the batch could run as an overlapped chain
        (``chains``), so its trees are planned and priced as a chain run's."""
        if self.roots_fill_cap(batch):
            return True
        seqs = list(seqs)
        gated = self.gate is not None and not self.gate.allows(batch)
        intervals: dict[str | None, int] = {}
        asked: list[tuple[Sequence, tuple[int, ...], Callable[[], bool]]] = []
        for seq, pending in seqs:
            template, adapt = template_of(seq)
            if not template:
                continue
            if not adapt:
                return False
            if gated:
                continue
            if seq.drafter not in intervals:
                intervals[seq.drafter] = self._interval(seq.drafter, batch)
            due = partial(probe_due, seq.steps_without_draft + pending, self.num_schedules + 1, intervals[seq.drafter])
            widths = adaptive_widths(template, seq.acceptance.alpha, self.config.budget, due,
                                     0.0 if self._free(chain) else None)
            if widths:
                asked.append((seq, widths, due))
        if not asked:
            return True
        if not self.config.budget.cost_aware:
            return False
        trees = [s for s, _, _ in asked]
        widths = [w for _, w, _ in asked]
        completing = self.batch_completion and not self.waiting
        pays = self._shortens_batch(trees, max(map(len, widths))) if completing else None
        kinds = self._kinds((s.drafter for s in trees), chain)
        max_ratio = self._max_ratio(batch > len(seqs))  # requests without a drafter ride along
        # the batch's other sequences emit their roots alone, whatever the cap
        if self._best_cap(batch, [s.acceptance.alpha for s in trees], widths, list(range(len(trees))), 0, pays, kinds,
                          max_ratio, riders=batch - len(trees)):
            return False
        if not self.costs.within(batch, 1, kinds, max_ratio):
            return True
        return not any((pays is None or pays[i]) and due() for i, (_, _, due) in enumerate(asked))

    @staticmethod
    def _fit_budget(widths: tuple[int, ...], budget: int) -> tuple[int, ...]:
        while widths and 1 + sum(widths) > budget:
            widths = widths[:-1]
        return widths

    def plan_prefills(self, budget: int, free: int) -> list[tuple[Sequence, int]]:
        """Admit waiting requests and pick prefill chunks within ``budget`` tokens and ``free`` blocks, as a
        plan does after its decodes (an overlapped step plans its decodes itself: gateway/overlap.py)."""
        plan = StepPlan([], [], [])
        self._plan_prefills(plan, budget, free)
        return plan.prefills

    def _plan_prefills(self, plan: StepPlan, budget: int, free: int) -> None:
        P = self.pool.page_size
        candidates = [s for s in self.running if s.is_prefilling]
        # Admission reserves a whole prompt's blocks against what running prefills still need, so
        # admitted prefills can always complete and never deadlock one another half-way.
        avail = free - sum(s.table.blocks_needed(s.num_tokens - 1) for s in candidates)
        now = self.clock()
        while self.waiting and len(self.running) < self.config.max_running:
            # a sibling waiting on its leader's prompt is not a candidate yet (and does not block the queue)
            ready = [s for s in self.waiting if not s.waits_for_leader]
            if not ready:
                break
            seq = min(ready, key=lambda s: self.urgency(s, now))
            need = -(-seq.num_tokens // P)
            if need > avail:  # no overtaking: the head waits until it fits
                break
            avail -= need
            self.waiting.remove(seq)
            seq.status, seq.table = Status.RUNNING, BlockTable(self.pool)
            # prefix cache: reuse full blocks of an identical prefix; the root itself stays uncached. A request
            # for prompt logprobs computes every prompt position (the cache holds K/V, not logits).
            if not seq.wants_prompt_logprobs:
                seq.num_cached = seq.table.adopt_prefix(seq.token_ids, seq.num_tokens - 1)
            if seq.cached_prompt_tokens is None:  # the first admission: no output yet, num_cached < the prompt
                seq.cached_prompt_tokens = seq.num_cached
            self.running.append(seq)
            candidates.append(seq)
        for seq in candidates:
            if budget <= 0:
                break
            n = min(seq.num_tokens - 1 - seq.num_cached, budget)
            if seq.wants_prompt_logprobs:  # its chunk's logits are [n, vocab] float32: bound them
                n = min(n, PROMPT_LOGPROBS_CHUNK)
            need = seq.table.blocks_needed(seq.num_cached + n)
            if need > free:
                continue
            free -= need
            budget -= n
            plan.prefills.append((seq, n))

    def _preempt_victim(self, plan: StepPlan, exclude: Sequence) -> bool:
        planned = {id(d) for d, _ in plan.decodes}
        victims = [s for s in self.running if s is not exclude and id(s) not in planned]
        if not victims:
            return False
        now = self.clock()
        self._preempt(plan, max(victims, key=lambda s: self.urgency(s, now)))
        return True

    def _preempt(self, plan: StepPlan, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.table.release()
        seq.table, seq.num_cached, seq.status = None, 0, Status.WAITING
        seq.num_preemptions += 1
        self.waiting.append(seq)  # keeps its arrival time, so it returns ahead of later arrivals
        plan.preempted.append(seq)

