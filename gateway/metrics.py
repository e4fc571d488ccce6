"""Prometheus metrics for one server: request outcomes and latencies, engine load, speculation figures.

Every request-level series carries a ``speculation`` label ("on" / "off"), so an A/B run inside one
server reads apart. The tree-aware step series (accepted depth, sibling rank, verified and wasted nodes)
carry the whole arm: ``speculation``, ``drafter`` and ``tree`` (bounded by ``stats.ArmLabeller``).
Step-level figures are observed on the engine thread, request-level ones on the event loop;
prometheus-client metrics are thread-safe. Audit replays and warm-up requests are never observed here as
traffic; the audit has its own series. Each ``Metrics`` owns its registry, so several servers (tests) can
live in one process.
"""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

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
        self._series: dict[Arm, SimpleNamespace] = {}
        r = self.registry = CollectorRegistry()
        spec = ["speculation"]
        self.requests = Counter("specgate_requests", "HTTP requests by route and final status "
                                "(499 = client went away)", ["route", "status", "speculation"], registry=r)
        self.finished = Counter("specgate_request_finish", "Finished generations by reason",
                                ["reason", "speculation"], registry=r)
        self.ttft = Histogram("specgate_time_to_first_token_seconds", "Arrival to first token", spec,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.per_token = Histogram("specgate_time_per_output_token_seconds",
                                   "Gap between engine events divided by the tokens the event carries, one "
                                   "observation per token", spec, buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("specgate_e2e_request_latency_seconds", "Arrival to last token", spec,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specgate_prompt_tokens", "Prompt tokens admitted", spec, registry=r)
        self.generation_tokens = Counter("specgate_generation_tokens", "Tokens generated", spec, registry=r)
        self.queue_depth = Gauge("specgate_queue_depth", "Requests waiting for admission", registry=r)
        self.running = Gauge("specgate_running_sequences", "Sequences holding KV blocks", registry=r)
        self.kv_used = Gauge("specgate_kv_blocks_used", "Target KV blocks in use", registry=r)
        self.kv_free = Gauge("specgate_kv_blocks_free", "Target KV blocks free", registry=r)
        self.steps = Counter("specgate_target_steps", "Per-request target steps (a batch step counts once per "
                             "sequence)", spec, registry=r)
        self.drafted = Counter("specgate_drafted_tokens", "Draft tokens proposed", spec, registry=r)
        self.accepted = Counter("specgate_accepted_tokens", "Draft tokens the target kept", spec, registry=r)
        self.accepted_length = Histogram("specgate_accepted_length", "Tokens emitted per target step "
                                         "(accepted drafts + bonus)", spec, buckets=LENGTH_BUCKETS, registry=r)
        self.accepted_by_depth = Counter("specgate_accepted_by_depth", "Accepted draft tokens at each tree depth; "
                                         "divide by specgate_target_steps_total{speculation=\"on\"} for the "
                                         "acceptance rate at that depth", ["depth"], registry=r)
        self._add_tree_series(r)
        self._add_audit_series(r)

    def _add_tree_series(self, r: CollectorRegistry) -> None:
        self.accepted_depth = Histogram("specgate_accepted_depth", "Draft tokens accepted per target step, by arm",
                                        ARM, buckets=DEPTH_BUCKETS, registry=r)
        self.accepted_rank = Histogram("specgate_accepted_rank", "For each accepted draft token, its index among "
                                       "its parent's children in the tree (0 = the drafter's first choice)", ARM,
                                       buckets=RANK_BUCKETS, registry=r)
        self.verified_nodes = Counter("specgate_verified_nodes", "Tree nodes the target scored in decode steps "
                                      "(roots included)", ARM, registry=r)
        self.kept_nodes = Counter("specgate_kept_nodes", "Verified nodes that emitted a token (roots and accepted "
                                  "drafts); divide by specgate_verified_nodes_total for the utilisation", ARM,
                                  registry=r)
        self.utilisation = Histogram("specgate_verify_utilisation", "Kept / verified nodes per target step", ARM,
                                     buckets=UTILISATION_BUCKETS, registry=r)
        self.wasted = Histogram("specgate_wasted_verify_tokens", "Verified nodes thrown away per target step "
                                "(verified - kept)", ARM, buckets=WASTE_BUCKETS, registry=r)

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
        steps = delta.steps
        if steps <= 0:
            return
        c = self._arm_series(arm)
        c.steps.inc(steps)
        c.drafted.inc(delta.drafted_tokens)
        c.accepted.inc(delta.accepted_tokens)
        c.accepted_length.observe((delta.accepted_tokens + steps) / steps)
        for depth, count in enumerate(delta.accepted_by_depth, start=1):
            if count > 0:
                self.accepted_by_depth.labels(str(depth)).inc(count)
        c.accepted_depth.observe(delta.accepted_tokens / steps)
        for rank, count in enumerate(delta.accepted_by_rank):
            for _ in range(count):
                c.accepted_rank.observe(rank)
        c.verified_nodes.inc(delta.verified_nodes)
        c.kept_nodes.inc(delta.kept_nodes)
        c.utilisation.observe(delta.utilisation)
        c.wasted.observe(delta.wasted_nodes / steps)

    def _arm_series(self, arm: Arm) -> SimpleNamespace:
        """The labelled children ``observe_step`` feeds, looked up once per arm: ``labels()`` validates and
        locks on every call, and every live request calls here once per engine step (arms are bounded:
        ``stats.ArmLabeller``)."""
        c = self._series.get(arm)
        if c is None:
            spec, full = (arm.speculation,), (arm.speculation, arm.drafter, arm.tree)
            c = self._series[arm] = SimpleNamespace(
                steps=self.steps.labels(*spec), drafted=self.drafted.labels(*spec),
                accepted=self.accepted.labels(*spec), accepted_length=self.accepted_length.labels(*spec),
                accepted_depth=self.accepted_depth.labels(*full), accepted_rank=self.accepted_rank.labels(*full),
                verified_nodes=self.verified_nodes.labels(*full), kept_nodes=self.kept_nodes.labels(*full),
                utilisation=self.utilisation.labels(*full), wasted=self.wasted.labels(*full))
        return c

    def observe_engine(self, waiting: int, running: int, kv_used: int, kv_free: int) -> None:
        self.queue_depth.set(waiting)
        self.running.set(running)
        self.kv_used.set(kv_used)
        self.kv_free.set(kv_free)

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
