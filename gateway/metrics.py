"""Prometheus metrics for one server: request outcomes and latencies, engine load, speculation figures.

Every request-level series carries a ``speculation`` label ("on" / "off"), so an A/B run inside one
server reads apart. The tree-aware step series (accepted depth, sibling rank, verified and wasted nodes)
carry the whole arm: ``speculation``, ``drafter`` and ``tree`` (bounded by ``stats.ArmLabeller``).
Step-level figures are observed on the engine thread, request-level ones on the event loop. The step
figures are the hot path -- every live request, every engine step -- so they are kept as plain numbers
under one lock (``StepFigures``) and turned into metric families only when /metrics is scraped: through
prometheus-client's labelled children they cost 15.6 us per request and step on the CPU, 4.0 us this way
(bench/results/host_micro_cpu.json): a millisecond a step at batch 64, on the engine thread, in front of
the next step's launch. Audit replays and warm-up requests are never observed here as
traffic; the audit has its own series. Each ``Metrics`` owns its registry, so several servers (tests) can
live in one process.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import dataclass, field

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from gateway.sequence import SpecStats
from gateway.stats import Arm

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
LENGTH_BUCKETS = tuple(float(n) for n in range(1, 17))  # tokens emitted per target step: 1 = nothing accepted
DEPTH_BUCKETS = tuple(float(n) for n in range(0, 16))  # drafts accepted per step: 0 = nothing accepted
RANK_BUCKETS = (0.0, 1.0, 2.0, 3.0, 5.0, 7.0, 15.0)  # sibling index of an accepted draft: 0 = the drafter's first
WASTE_BUCKETS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 63.0)  # verified nodes thrown away per step
UTILISATION_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
ARM = ["speculation", "drafter", "tree"]
CONTENT_TYPE = CONTENT_TYPE_LATEST


def spec_label(is_speculative: bool) -> str:
    return "on" if is_speculative else "off"


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # the *_created series double the page and no dashboard reads them
        r = self.registry = CollectorRegistry()
        spec = ["speculation"]
        self.requests = Counter("specgate_requests", "HTTP requests by route and final status "
                                "(499 = client went away)", ["route", "status", "speculation"], registry=r)
        self.finished = Counter("specgate_request_finish", "Finished generations by reason",
                                ["reason", "speculation"], registry=r)
        self.ttft = Histogram("specgate_time_to_first_token_seconds", "Arrival to first token", spec,
                              buckets=LATENCY_BUCKETS, registry=r)
        # per token, the hot path of the event loop: plain numbers, one add per event whatever its tokens
        self.per_token = CountedHistogram("specgate_time_per_output_token_seconds",
                                          "Gap between engine events divided by the tokens the event carries, "
                                          "one observation per token", spec, TOKEN_BUCKETS)
        r.register(self.per_token)
        self.e2e = Histogram("specgate_e2e_request_latency_seconds", "Arrival to last token", spec,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specgate_prompt_tokens", "Prompt tokens admitted", spec, registry=r)
        self.generation_tokens = Counter("specgate_generation_tokens", "Tokens generated", spec, registry=r)
        self.queue_depth = Gauge("specgate_queue_depth", "Requests waiting for admission", registry=r)
        self.running = Gauge("specgate_running_sequences", "Sequences holding KV blocks", registry=r)
        self.kv_used = Gauge("specgate_kv_blocks_used", "Target KV blocks in use", registry=r)
        self.kv_free = Gauge("specgate_kv_blocks_free", "Target KV blocks free", registry=r)
        self.draft_kv_used = Gauge("specgate_draft_kv_blocks_used", "Draft models' KV blocks in use", registry=r)
        self.gate = Gauge("specgate_speculation_gate", "1 where the speculation gate runs speculation at this batch "
                          "bucket, 0 where it runs plain decoding", ["bucket"], registry=r)
        self.gate_rate = Gauge("specgate_speculation_gate_tokens_per_second", "The gate's measured tokens/s of "
                               "each arm at each batch bucket", ["bucket", "arm"], registry=r)
        self.gate_drafter = Gauge("specgate_speculation_gate_drafter", "1 for the drafter the speculation gate "
                                  "prefers at this batch bucket (where it chooses drafters)", ["bucket", "drafter"],
                                  registry=r)
        self._gate_seen: tuple = ()
        self.step_figures = StepFigures()
        r.register(self.step_figures)
        self._add_audit_series(r)

    def _add_audit_series(self, r: CollectorRegistry) -> None:
        self.audit_checked = Counter("specgate_audit_checked", "Speculative greedy requests replayed without "
                                     "speculation and compared", registry=r)
        self.audit_mismatches = Counter("specgate_audit_mismatches", "Replays whose tokens differed", registry=r)
        self.audit_identity = Gauge("specgate_audit_identity_rate", "Identical / checked replays since start "
                                    "or the last stats reset (NaN while none was checked)", registry=r)
        self.audit_identity.set(float("nan"))
        self.audit_dropped = Counter("specgate_audit_dropped", "Replays dropped from the full pending queue",
                                     registry=r)
        self.audit_interrupted = Counter("specgate_audit_interrupted", "Replays aborted because real requests "
                                         "arrived (retried later)", registry=r)
        self.audit_pending = Gauge("specgate_audit_pending", "Replays waiting for idle capacity", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_step(self, arm: Arm, delta: SpecStats) -> None:
        """One request's figures moved by ``delta`` (engine thread); a delivery holds at most one step."""
        self.step_figures.observe(arm, delta)

    def observe_engine(self, waiting: int, running: int, kv_used: int, kv_free: int, draft_kv_used: int = 0,
                       gate: tuple = ()) -> None:
        """``gate``: ``SpecGate.state()``, (bucket, speculates, spec tok/s, plain tok/s, drafter) per batch
        bucket; its labelled gauges are set only when it changed (a labelled child costs microseconds a set)."""
        self.queue_depth.set(waiting)
        self.running.set(running)
        self.kv_used.set(kv_used)
        self.kv_free.set(kv_free)
        self.draft_kv_used.set(draft_kv_used)
        if gate != self._gate_seen:
            for bucket, *_, drafter in self._gate_seen:
                if drafter is not None:
                    self.gate_drafter.labels(str(bucket), drafter).set(0)
            self._gate_seen = gate
            for bucket, speculates, spec, plain, drafter in gate:
                self.gate.labels(str(bucket)).set(1 if speculates else 0)
                if drafter is not None:
                    self.gate_drafter.labels(str(bucket), drafter).set(1)
                for arm, rate in (("spec", spec), ("plain", plain)):
                    if rate is not None:
                        self.gate_rate.labels(str(bucket), arm).set(rate)

    def observe_audit(self, checked: int = 0, mismatches: int = 0, dropped: int = 0, interrupted: int = 0,
                      pending: int | None = None, identity_rate: float | None = None) -> None:
        self.audit_checked.inc(checked)
        self.audit_mismatches.inc(mismatches)
        self.audit_dropped.inc(dropped)
        self.audit_interrupted.inc(interrupted)
        if pending is not None:
            self.audit_pending.set(pending)
        if identity_rate is not None:
            self.audit_identity.set(identity_rate)


class CountedHistogram:
    """A labelled histogram kept as plain numbers, observed ``n`` times at once (``add``) and turned into a
    metric family at scrape time (a prometheus-client custom collector)."""

    def __init__(self, name: str, doc: str, labels: list[str], buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.labels, self.bounds = name, doc, labels, buckets
        self._lock = threading.Lock()
        self._hists: dict[tuple[str, ...], _Hist] = {}

    def add(self, values: tuple[str, ...], value: float, n: int = 1) -> None:
        with self._lock:
            h = self._hists.get(values)
            if h is None:
                h = self._hists[values] = _Hist(self.bounds)
            h.add(value, n)

    def describe(self):
        return []

    def collect(self):
        with self._lock:  # built under the lock, handed out after it: a scrape never holds up the observers
            fam = _histogram_family(self.name, self.doc, self.labels, self._hists.items())
        yield fam


def _histogram_family(name: str, doc: str, labels: list[str], hists) -> HistogramMetricFamily:
    """One metric family from ``(label values, _Hist)`` pairs."""
    fam = HistogramMetricFamily(name, doc, labels=labels)
    for values, h in hists:
        fam.add_metric(list(values), h.buckets(), h.sum)
    return fam


class _Hist:
    """A histogram as plain numbers: per-bucket counts (the last one +Inf) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0

    def add(self, value: float, n: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += n  # the first bucket whose bound is >= value
        self.sum += value * n

    def merge(self, other: "_Hist") -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.sum += other.sum

    def buckets(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            out.append((floatToGoString(bound), total))
        return out


@dataclass(slots=True)
class _ArmFigures:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    verified: int = 0
    kept: int = 0
    accepted_length: _Hist = field(default_factory=lambda: _Hist(LENGTH_BUCKETS))
    accepted_depth: _Hist = field(default_factory=lambda: _Hist(DEPTH_BUCKETS))
    accepted_rank: _Hist = field(default_factory=lambda: _Hist(RANK_BUCKETS))
    utilisation: _Hist = field(default_factory=lambda: _Hist(UTILISATION_BUCKETS))
    wasted: _Hist = field(default_factory=lambda: _Hist(WASTE_BUCKETS))


class StepFigures:
    """The speculation step series, per arm: observed on the engine thread, collected at scrape time (a
    prometheus-client custom collector). The series keep the names and labels they had as prometheus-client
    metrics: the target-step, drafted, accepted and accepted-length series by ``speculation``, the
    tree-aware ones by the whole arm, accepted-by-depth by ``depth``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arms: dict[Arm, _ArmFigures] = {}
        self._by_depth: list[int] = []

    def observe(self, arm: Arm, delta: SpecStats) -> None:
        steps = delta.steps
        if steps <= 0:
            return
        with self._lock:
            f = self._arms.get(arm)
            if f is None:
                f = self._arms[arm] = _ArmFigures()
            f.steps += steps
            f.drafted += delta.drafted_tokens
            f.accepted += delta.accepted_tokens
            f.verified += delta.verified_nodes
            f.kept += delta.kept_nodes
            f.accepted_length.add((delta.accepted_tokens + steps) / steps)
            f.accepted_depth.add(delta.accepted_tokens / steps)
            f.utilisation.add(delta.utilisation)
            f.wasted.add(delta.wasted_nodes / steps)
            for rank, count in enumerate(delta.accepted_by_rank):
                if count:
                    f.accepted_rank.add(rank, count)
            by_depth = self._by_depth
            for depth, count in enumerate(delta.accepted_by_depth):
                if count:
                    if depth >= len(by_depth):
                        by_depth.extend([0] * (depth + 1 - len(by_depth)))
                    by_depth[depth] += count

    def describe(self):
        return []  # registering must not call collect(): the series exist before any step

    def collect(self):
        with self._lock:  # built under the lock, handed out after it: a scrape never holds up the engine thread
            fams = list(self._families())
        yield from fams

    def _families(self):
        """The step series' metric families; the caller holds the lock."""
        spec = ["speculation"]
        arms = [((a.speculation, a.drafter, a.tree), f) for a, f in self._arms.items()]
        per_spec: dict[tuple[str], _ArmFigures] = {}  # the speculation-labelled series sum their arms
        for (label, *_), f in arms:
            agg = per_spec.setdefault((label,), _ArmFigures())
            agg.steps += f.steps
            agg.drafted += f.drafted
            agg.accepted += f.accepted
            agg.accepted_length.merge(f.accepted_length)
        for attr, name, doc in _SPEC_COUNTERS:
            yield _counter_family(name, doc, spec, ((k, getattr(f, attr)) for k, f in per_spec.items()))
        for attr, name, doc in _ARM_COUNTERS:
            yield _counter_family(name, doc, ARM, ((k, getattr(f, attr)) for k, f in arms))
        yield _histogram_family("specgate_accepted_length", "Tokens emitted per target step (accepted drafts + "
                                "bonus)", spec, ((k, f.accepted_length) for k, f in per_spec.items()))
        for attr, name, doc in _ARM_HISTOGRAMS:
            yield _histogram_family(name, doc, ARM, ((k, getattr(f, attr)) for k, f in arms))
        yield _counter_family("specgate_accepted_by_depth", "Accepted draft tokens at each tree depth; divide by "
                              "specgate_target_steps_total{speculation=\"on\"} for the acceptance rate at that "
                              "depth", ["depth"], (((str(d + 1),), n) for d, n in enumerate(self._by_depth) if n))


# (attribute of _ArmFigures, metric name, help) of the step series
_SPEC_COUNTERS = (
    ("steps", "specgate_target_steps", "Per-request target steps (a batch step counts once per sequence)"),
    ("drafted", "specgate_drafted_tokens", "Draft tokens proposed"),
    ("accepted", "specgate_accepted_tokens", "Draft tokens the target kept"),
)
_ARM_COUNTERS = (
    ("verified", "specgate_verified_nodes", "Tree nodes the target scored in decode steps (roots included)"),
    ("kept", "specgate_kept_nodes", "Verified nodes that emitted a token (roots and accepted drafts); divide by "
     "specgate_verified_nodes_total for the utilisation"),
)
_ARM_HISTOGRAMS = (
    ("accepted_depth", "specgate_accepted_depth", "Draft tokens accepted per target step, by arm"),
    ("accepted_rank", "specgate_accepted_rank", "For each accepted draft token, its index among its parent's "
     "children in the tree (0 = the drafter's first choice)"),
    ("utilisation", "specgate_verify_utilisation", "Kept / verified nodes per target step"),
    ("wasted", "specgate_wasted_verify_tokens", "Verified nodes thrown away per target step (verified - kept)"),
)


def _counter_family(name: str, doc: str, labels: list[str], values) -> CounterMetricFamily:
    """One metric family from ``(label values, count)`` pairs."""
    fam = CounterMetricFamily(name, doc, labels=labels)
    for key, n in values:
        fam.add_metric(list(key), n)
    return fam
