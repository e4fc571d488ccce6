"""Live A/B figures for one server, per arm and global: what GET /v1/stats and the dashboard show.

An *arm* is what an A/B experiment compares: speculation on/off, the drafter, the tree budget. Two threads
write here and one lock guards everything:

    engine thread (runner)  observe_step  per request per step: tokens, accepted / verified nodes, ranks
                            observe_load  KV blocks and queue, after every step
    event loop (Generation) observe_first_token, observe_token_gaps, observe_request

Memory is bounded: rolling windows hold the last ``TTFT_SAMPLES`` / ``TOKEN_SAMPLES`` latencies per arm,
the time series keeps ``SERIES_S`` one-second buckets, and ``ArmLabeller`` bounds the number of arms.
``reset`` starts a new experiment (the load figures, being the present state, stay). Pure Python: no torch.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.sequence import SpecStats

SERIES_S = 300  # seconds of per-second history
RATE_WINDOW_S = 10  # tokens/s averages the last this many complete seconds
TTFT_SAMPLES = 512  # per arm: the last this many requests' time to first token
TOKEN_SAMPLES = 4096  # per arm: the last this many per-token gaps
MAX_TREE_LABELS = 8  # distinct request-chosen tree labels; more read "other"


@dataclass(frozen=True, slots=True)
class Arm:
    speculation: str  # "on" / "off": whether the engine gave the request a drafter
    drafter: str  # the drafter's name, "none" when off
    tree: str  # "2x2x1" (the request's own tree), "max_nodes=6", "adaptive" (the server's budget), "none"

    @property
    def key(self) -> str:
        return f"{self.speculation}/{self.drafter}/{self.tree}"


OFF = Arm("off", "none", "none")


def tree_label(tree: tuple[int, ...] | None, max_nodes: int | None) -> str:
    """The tree budget a request asked for; "adaptive" when it left the shape to the server."""
    if tree is not None:
        return "x".join(map(str, tree)) + (f",max_nodes={max_nodes}" if max_nodes is not None else "")
    return "adaptive" if max_nodes is None else f"max_nodes={max_nodes}"


AUTO = "auto"  # the drafter label of requests whose drafter the speculation gate chooses (SpecGate.drafters)


class ArmLabeller:
    """Arms with bounded label cardinality: drafter names come from the loaded set, and past ``max_trees``
    distinct tree labels a new one reads "other" (clients choose trees, so they could flood the series)."""

    def __init__(self, max_trees: int = MAX_TREE_LABELS) -> None:
        self.max_trees = max_trees
        self._trees: set[str] = {"adaptive"}
        self._lock = threading.Lock()

    def arm(self, drafter: str | None, tree: tuple[int, ...] | None, max_nodes: int | None) -> Arm:
        if drafter is None:
            return OFF
        label = tree_label(tree, max_nodes)
        with self._lock:
            if label not in self._trees:
                if len(self._trees) > self.max_trees:
                    label = "other"
                else:
                    self._trees.add(label)
        return Arm("on", drafter, label)


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in (0, 1]) of an ascending list; None when empty."""
    if not sorted_values:
        return None
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def percentiles(values: deque[float] | list[float]) -> dict[str, float | int | None]:
    ordered = sorted(values)
    return {"p50": percentile(ordered, 0.5), "p90": percentile(ordered, 0.9), "p99": percentile(ordered, 0.99),
            "n": len(ordered)}


@dataclass(slots=True)
class _Second:
    """One arm's figures within one second."""

    tokens: int = 0
    steps: int = 0
    kept: int = 0  # roots + accepted drafts: the tokens the steps emitted before max_tokens / stop cuts
    ttft_sum: float = 0.0
    ttft_n: int = 0
    gap_sum: float = 0.0
    gap_n: int = 0


@dataclass(slots=True)
class _Bucket:
    arms: dict[Arm, _Second] = field(default_factory=dict)
    load_max: tuple[float, int] | None = None  # (KV used fraction, waiting): each the highest in this second
    load_last: tuple[float, int] | None = None  # the last seen: the load holds until the next observation


@dataclass(slots=True)
class _ArmTotals:
    spec: SpecStats = field(default_factory=SpecStats)
    tokens: int = 0
    requests: int = 0
    errors: int = 0  # requests that did not end with a 200
    ttft: deque[float] = field(default_factory=lambda: deque(maxlen=TTFT_SAMPLES))
    per_token: deque[float] = field(default_factory=lambda: deque(maxlen=TOKEN_SAMPLES))


class StatsStore:
    """Thread-safe figures since the last ``reset``. ``clock`` is monotonic seconds (the runner's Event
    times are ``time.monotonic()``); tests pass their own."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._kv_used = self._kv_total = self._waiting = self._running = 0
        self._gate: tuple = ()  # SpecGate.state(): what the engine's speculation gate chose, per batch bucket
        self._load_before: tuple[float, int] | None = None  # the load as of the series' first second
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._arms: dict[Arm, _ArmTotals] = {}
            self._buckets: dict[int, _Bucket] = {}
            self._reset_at = self.clock()
            self._reset_wall = time.time()
            if self._kv_total:
                self._load_before = (self._kv_used / self._kv_total, self._waiting)

    # --- writers ------------------------------------------------------------------------------------

    def observe_step(self, arm: Arm, delta: SpecStats, num_tokens: int, now: float) -> None:
        """One request's step figures (``delta`` = after - before) and the tokens it emitted (engine thread)."""
        with self._lock:
            totals = self._totals(arm)
            totals.spec.add(delta)
            totals.tokens += num_tokens
            second = self._second(arm, now)
            second.tokens += num_tokens
            second.steps += delta.steps
            second.kept += delta.kept_nodes

    def observe_load(self, waiting: int, running: int, kv_used: int, kv_total: int, now: float,
                     gate: tuple = ()) -> None:
        """``gate``: the speculation gate's (bucket, speculates, spec tok/s, plain tok/s, drafter) per batch
        bucket (drafter: the one it prefers, where it chooses drafters)."""
        with self._lock:
            self._waiting, self._running, self._kv_used, self._kv_total = waiting, running, kv_used, kv_total
            self._gate = gate
            bucket = self._bucket(now)
            load = (kv_used / kv_total if kv_total else 0.0, waiting)
            high = bucket.load_max or load
            bucket.load_max, bucket.load_last = (max(high[0], load[0]), max(high[1], load[1])), load

    def observe_first_token(self, arm: Arm, ttft_s: float, now: float) -> None:
        with self._lock:
            self._totals(arm).ttft.append(ttft_s)
            second = self._second(arm, now)
            second.ttft_sum += ttft_s
            second.ttft_n += 1

    def observe_token_gaps(self, arm: Arm, per_token_s: float, num_tokens: int, now: float) -> None:
        """An event of ``num_tokens`` tokens came ``per_token_s * num_tokens`` after the previous one."""
        with self._lock:
            self._totals(arm).per_token.extend([per_token_s] * num_tokens)
            second = self._second(arm, now)
            second.gap_sum += per_token_s * num_tokens
            second.gap_n += num_tokens

    def observe_request(self, arm: Arm, is_ok: bool) -> None:
        with self._lock:
            totals = self._totals(arm)
            totals.requests += 1
            totals.errors += not is_ok

    def _totals(self, arm: Arm) -> _ArmTotals:
        totals = self._arms.get(arm)
        if totals is None:
            totals = self._arms[arm] = _ArmTotals()
        return totals

    def _bucket(self, now: float) -> _Bucket:
        sec = math.floor(now)
        bucket = self._buckets.get(sec)
        if bucket is None:
            bucket = self._buckets[sec] = _Bucket()
            for old in sorted(s for s in self._buckets if s <= sec - SERIES_S):
                self._load_before = self._buckets.pop(old).load_last or self._load_before
        return bucket

    def _second(self, arm: Arm, now: float) -> _Second:
        arms = self._bucket(now).arms
        second = arms.get(arm)
        if second is None:
            second = arms[arm] = _Second()
        return second

    # --- the snapshot -------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Every figure as plain JSON types; times in seconds, series over complete seconds only."""
        with self._lock:
            now = self.clock()
            now_sec = math.floor(now)
            secs = range(max(now_sec - SERIES_S, math.floor(self._reset_at)), now_sec)
            buckets = [self._buckets.get(s) for s in secs]
            rate_secs = [b for s, b in zip(secs, buckets) if s >= now_sec - RATE_WINDOW_S]
            arms = {arm.key: _arm_summary(arm, totals, rate_secs) for arm, totals in sorted(
                self._arms.items(), key=lambda kv: kv[0].key)}
            load = self._load_series(secs)
            series = {"t": [s - now_sec for s in secs],
                      "arms": {arm.key: _arm_series(arm, buckets) for arm in sorted(self._arms, key=lambda a: a.key)},
                      "kv_used_fraction": [x and x[0] for x in load], "queue_waiting": [x and x[1] for x in load]}
            return {"since_reset_s": round(now - self._reset_at, 3), "reset_at": self._reset_wall,
                    "arms": arms, "series": series,
                    "kv": {"used_blocks": self._kv_used, "total_blocks": self._kv_total,
                           "used_fraction": self._kv_used / self._kv_total if self._kv_total else 0.0},
                    "queue": {"waiting": self._waiting, "running": self._running},
                    # per batch bucket: whether adaptive requests speculate, and each arm's measured tokens/s
                    "speculation_gate": {str(b): {"speculate": on, "spec_tok_s": a, "plain_tok_s": z}
                                         | ({} if d is None else {"drafter": d}) for b, on, a, z, d in self._gate}}


    def _load_series(self, secs: range) -> list[tuple[float, int] | None]:
        """Each second's highest load; a second without an observation holds the last one before it."""
        carry = self._load_before
        for s in sorted(self._buckets):
            if s >= secs.start:
                break
            carry = self._buckets[s].load_last or carry
        out = []
        for s in secs:
            bucket = self._buckets.get(s)
            out.append(bucket.load_max if bucket and bucket.load_max else carry)
            carry = bucket.load_last if bucket and bucket.load_last else carry
        return out


def _arm_summary(arm: Arm, t: _ArmTotals, rate_secs: list[_Bucket | None]) -> dict[str, Any]:
    s = t.spec
    spec_steps = s.steps if arm.speculation == "on" else 0
    rate = None
    if rate_secs:
        rate = sum(b.arms[arm].tokens for b in rate_secs if b and arm in b.arms) / len(rate_secs)
    return {"speculation": arm.speculation, "drafter": arm.drafter, "tree": arm.tree,
            "requests": t.requests, "errors": t.errors, "tokens": t.tokens,
            "ttft_s": percentiles(t.ttft), "per_token_s": percentiles(t.per_token), "tokens_per_s": rate,
            "steps": s.steps, "drafted_tokens": s.drafted_tokens, "accepted_tokens": s.accepted_tokens,
            "mean_accepted_length": s.mean_accepted_length if s.steps else None,
            "acceptance_by_depth": [n / spec_steps for n in s.accepted_by_depth] if spec_steps else [],
            "accepted_by_rank": list(s.accepted_by_rank), "steps_by_accepted_depth": s.steps_by_accepted_depth,
            "verified_nodes": s.verified_nodes, "utilisation": s.utilisation if s.verified_nodes else None,
            "wasted_per_step": s.wasted_nodes / s.steps if s.steps else None}


def _arm_series(arm: Arm, buckets: list[_Bucket | None]) -> dict[str, list[float | None]]:
    seconds = [b.arms.get(arm) if b else None for b in buckets]
    return {"tokens_per_s": [float(x.tokens) if x else 0.0 for x in seconds],
            "ttft_s": [x.ttft_sum / x.ttft_n if x and x.ttft_n else None for x in seconds],
            "per_token_s": [x.gap_sum / x.gap_n if x and x.gap_n else None for x in seconds],
            "accepted_length": [x.kept / x.steps if x and x.steps else None for x in seconds]}
