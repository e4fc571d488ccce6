"""Continuous batching: which sequences run this step, with how many prefill tokens or tree nodes.

Pure Python over ``Sequence`` objects; KV blocks are only counted here (``BlockTable.blocks_needed``)
and allocated when the forward batch is built. When the pool cannot hold a step, the most recently
admitted sequence is preempted: its blocks are freed and it recomputes later (vLLM's recompute policy).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from gateway.sequence import Sequence, Status
from target.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_running: int = 32  # sequences holding KV at once
    max_step_tokens: int = 1024  # prefill tokens + tree nodes per step
    max_waiting: int = 256  # queue bound: beyond it submissions are refused (HTTP 429)
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_running", "max_step_tokens", "max_waiting", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(slots=True)
class StepPlan:
    prefills: list[tuple[Sequence, int]]  # (sequence, number of prompt tokens to prefill now)
    decodes: list[tuple[Sequence, tuple[int, ...]]]  # (sequence, tree widths for this step)
    preempted: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: KVCache) -> None:
        self.config = config
        self.cache = cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished or aborted); the engine frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, widths_of) -> StepPlan:
        """``widths_of(seq)`` gives a decoding sequence's wanted tree widths (the drafter's template)."""
        plan = StepPlan([], [], [])
        budget = self.config.max_step_tokens
        reserved = 0  # blocks this plan will allocate
        for seq in [s for s in self.running if not s.is_prefilling]:
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            widths = self._fit(seq, widths_of(seq), budget)
            need = seq.table.blocks_needed(seq.num_cached + 1 + sum(widths))
            while need > self.cache.pool.num_free - reserved and self._preempt_last(plan, exclude=seq):
                pass
            if need > self.cache.pool.num_free - reserved:
                widths = ()
                need = seq.table.blocks_needed(seq.num_cached + 1)
                if need > self.cache.pool.num_free - reserved:  # not even one slot: wait and recompute
                    self._preempt(plan, seq)
                    continue
            reserved += need
            budget -= 1 + sum(widths)
            plan.decodes.append((seq, widths))
        self._plan_prefills(plan, budget, self.cache.pool.num_free - reserved)
        return plan

    def _plan_prefills(self, plan: StepPlan, budget: int, free: int) -> None:
        P = self.cache.page_size
        candidates = [s for s in self.running if s.is_prefilling]
        while self.waiting and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            if -(-seq.num_tokens // P) > free:  # admit only what can finish its prefill
                break
            self.waiting.popleft()
            seq.status, seq.table = Status.RUNNING, self.cache.new_table()
            self.running.append(seq)
            candidates.append(seq)
        for seq in candidates:
            if budget <= 0:
                break
            n = min(seq.num_tokens - 1 - seq.num_cached, budget)
            need = seq.table.blocks_needed(seq.num_cached + n)
            if need > free:
                continue
            free -= need
            budget -= n
            plan.prefills.append((seq, n))

    def _fit(self, seq: Sequence, widths: tuple[int, ...], budget: int) -> tuple[int, ...]:
        # No deeper than the tokens still wanted (a step emits depth + 1) or the context allows.
        depth = min(len(widths), seq.remaining_tokens - 1, self.config.max_model_len - seq.num_tokens)
        widths = widths[: max(depth, 0)]
        while widths and 1 + sum(widths) > budget:
            widths = widths[:-1]
        return widths

    def _preempt_last(self, plan: StepPlan, exclude: Sequence) -> bool:
        planned = {id(d) for d, _ in plan.decodes}
        victims = [s for s in self.running if s is not exclude and id(s) not in planned]
        if not victims:
            return False
        self._preempt(plan, victims[-1])
        return True

    def _preempt(self, plan: StepPlan, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.table.release()
        seq.table, seq.num_cached, seq.status = None, 0, Status.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
