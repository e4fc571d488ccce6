"""Prometheus metrics for one server: request outcomes and latencies, engine load, speculation figures.

Every request-level series carries a ``speculation`` label ("on" / "off"), so an A/B run inside one
server reads apart. Step-level figures (drafted / accepted tokens, accepted length, acceptance by depth)
are observed on the engine thread, request-level ones on the event loop; prometheus-client metrics are
thread-safe. Each ``Metrics`` owns its registry, so several servers (tests) can live in one process.
"""

from __future__ import annotations

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

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
LENGTH_BUCKETS = tuple(float(n) for n in range(1, 17))  # tokens emitted per target step: 1 = nothing accepted
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

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_step(self, is_speculative: bool, before: SpecStats, after: SpecStats) -> None:
        """One request's figures moved from ``before`` to ``after`` (engine thread)."""
        label = spec_label(is_speculative)
        steps = after.steps - before.steps
        if steps <= 0:
            return
        accepted = after.accepted_tokens - before.accepted_tokens
        self.steps.labels(label).inc(steps)
        self.drafted.labels(label).inc(after.drafted_tokens - before.drafted_tokens)
        self.accepted.labels(label).inc(accepted)
        self.accepted_length.labels(label).observe((accepted + steps) / steps)
        for depth, count in enumerate(after.accepted_by_depth, start=1):
            prev = before.accepted_by_depth[depth - 1] if depth <= len(before.accepted_by_depth) else 0
            if count > prev:
                self.accepted_by_depth.labels(str(depth)).inc(count - prev)

    def observe_engine(self, waiting: int, running: int, kv_used: int, kv_free: int) -> None:
        self.queue_depth.set(waiting)
        self.running.set(running)
        self.kv_used.set(kv_used)
        self.kv_free.set(kv_free)
