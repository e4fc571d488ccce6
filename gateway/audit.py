"""The online losslessness audit: replay finished speculative greedy requests without speculation, compare.

Greedy output with speculation must be token-identical to the target alone. A fraction (``fraction``) of
the requests that ran with a drafter, were greedy and ended with "stop" or "length" is queued here; the
runner replays each with speculation off, the same prompt ids and the same sampling, at the lowest
priority and only in idle capacity (``gateway/runner.py``: it starts a replay only when no real request
is live and nothing is in its inbox, and aborts and requeues it the moment a real request arrives).

    engine thread: finished request -> offer() -> pending (bounded, oldest dropped)
                   idle -> next_replay() -> engine.add(priority=REPLAY_PRIORITY) -> ... -> verdict()
                   real request arrives -> engine.abort(replay) -> requeue() (retried from scratch)
    event loop:    snapshot(), reset()

Each mismatch is logged on ``specgate.audit`` with the request id, the first differing position and both
tokens (ids and their text); the prompt only with ``log_prompts``. Pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("specgate.audit")
REPLAY_PRIORITY = 1 << 30  # below every real request (lower runs first)
ELIGIBLE_REASONS = ("stop", "length")


@dataclass(frozen=True, slots=True)
class AuditConfig:
    fraction: float = 0.0  # of eligible requests replayed; 0 disables the audit
    log_prompts: bool = False  # put the prompt's text in mismatch log lines (off: prompts may be private)
    max_pending: int = 16  # replays waiting for idle capacity; a full queue drops its oldest
    idle_s: float = 0.2  # the engine must have had no real request this long before a replay starts

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"audit_fraction must be in [0, 1], got {self.fraction}")
        if self.max_pending < 1:
            raise ValueError(f"audit max_pending must be >= 1, got {self.max_pending}")
        if self.idle_s < 0:
            raise ValueError(f"audit idle_s must be >= 0, got {self.idle_s}")


@dataclass(slots=True)
class Replay:
    """One queued check, owned by the engine thread once taken."""

    request_id: str  # the original request's id (what the log names)
    prompt_ids: list[int]
    sampling: Any  # the original SamplingParams; max_tokens cut to what it emitted when it ended on "length"
    expected: list[int]  # the tokens the speculative run emitted
    epoch: int  # results from before a stats reset are discarded

    @property
    def engine_id(self) -> str:
        return f"audit:{self.request_id}"


@dataclass(frozen=True, slots=True)
class Verdict:
    request_id: str
    is_identical: bool
    position: int | None  # the first differing token index; None when identical
    speculative_token: int | None  # None: that run had already ended
    plain_token: int | None


class AuditMetrics(Protocol):
    def observe_audit(self, checked: int = 0, mismatches: int = 0, dropped: int = 0, interrupted: int = 0,
                      pending: int | None = None, identity_rate: float | None = None) -> None: ...


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter one's end counts); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class Auditor:
    """The pending queue and the counters. Thread-safe: the engine thread offers, takes and judges; the
    event loop reads ``snapshot`` and calls ``reset``. ``decode`` turns token ids into text for the log."""

    def __init__(self, config: AuditConfig, decode: Callable[[list[int]], str] | None = None,
                 metrics: AuditMetrics | None = None) -> None:
        self.config, self.decode, self.metrics = config, decode, metrics
        self._lock = threading.Lock()
        self._pending: deque[Replay] = deque()
        self._credit = 0.0  # accumulates ``fraction`` per eligible request; a whole one selects it
        self._epoch = 0
        self._zero()

    def _zero(self) -> None:
        self.checked = self.identical = self.mismatches = self.dropped = self.interrupted = self.failed = 0
        self.last_mismatch: dict[str, Any] | None = None

    @property
    def is_enabled(self) -> bool:
        return self.config.fraction > 0

    # --- engine thread ------------------------------------------------------------------------------

    def wants(self, is_speculative: bool, sampling: Any) -> bool:
        """Whether a request is worth recording tokens for (before it finishes): speculative and greedy."""
        return self.is_enabled and is_speculative and bool(getattr(sampling, "is_greedy", False))

    def offer(self, request_id: str, prompt_ids: list[int], sampling: Any, tokens: list[int],
              finish_reason: str | None) -> bool:
        """A finished request that ``wants`` accepted. Returns whether it was queued for a replay."""
        if finish_reason not in ELIGIBLE_REASONS or not tokens:
            return False
        if finish_reason == "length":  # the engine may have cut it short (KV, context): replay that much
            sampling = dataclasses.replace(sampling, max_tokens=len(tokens))
        if getattr(sampling, "logprobs", None) is not None:  # the replay compares tokens alone
            sampling = dataclasses.replace(sampling, logprobs=None)
        dropped = 0
        with self._lock:
            self._credit += self.config.fraction
            if self._credit < 1.0 - 1e-9:
                return False
            self._credit -= 1.0
            self._pending.append(Replay(request_id, list(prompt_ids), sampling, list(tokens), self._epoch))
            while len(self._pending) > self.config.max_pending:
                self._pending.popleft()
                self.dropped += 1
                dropped += 1
            pending = len(self._pending)
        self._publish(dropped=dropped, pending=pending)
        return True

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def next_replay(self) -> Replay | None:
        with self._lock:
            replay = self._pending.popleft() if self._pending else None
            pending = len(self._pending)
        self._publish(pending=pending)
        return replay

    def requeue(self, replay: Replay) -> None:
        """A replay aborted for real traffic goes back to the front, to run again from scratch."""
        dropped = interrupted = 0
        with self._lock:
            if replay.epoch == self._epoch:  # else it belongs to an experiment that was reset: let it go
                self.interrupted += 1
                interrupted = 1
                self._pending.appendleft(replay)
                while len(self._pending) > self.config.max_pending:
                    self._pending.pop()  # the interrupted one is the oldest: keep it, drop the newest
                    self.dropped += 1
                    dropped += 1
            pending = len(self._pending)
        self._publish(interrupted=interrupted, dropped=dropped, pending=pending)

    def fail(self, replay: Replay) -> None:
        """The replay itself failed (engine error): not a verdict either way."""
        with self._lock:
            self.failed += replay.epoch == self._epoch

    def verdict(self, replay: Replay, tokens: list[int]) -> Verdict | None:
        """Compare a finished replay; log a mismatch. None when a reset made it stale."""
        position = first_difference(replay.expected, tokens)
        verdict = Verdict(replay.request_id, position is None, position,
                          _at(replay.expected, position), _at(tokens, position))
        with self._lock:
            if replay.epoch != self._epoch:
                return None
            self.checked += 1
            self.identical += verdict.is_identical
            self.mismatches += not verdict.is_identical
            if not verdict.is_identical:
                self.last_mismatch = {"request_id": replay.request_id, "position": position,
                                      "speculative_token": verdict.speculative_token,
                                      "plain_token": verdict.plain_token}
            rate = self.identical / self.checked
        if not verdict.is_identical:
            self._log_mismatch(replay, verdict)
        self._publish(checked=1, mismatches=int(not verdict.is_identical), identity_rate=rate)
        return verdict

    def _log_mismatch(self, replay: Replay, v: Verdict) -> None:
        spec_text, plain_text = self._text(v.speculative_token), self._text(v.plain_token)
        prompt = ""
        if self.config.log_prompts:
            prompt = f"; prompt={self._text_of(replay.prompt_ids)!r}"
        log.warning("audit mismatch on %s: first difference at token %d: speculative %s %r, plain %s %r%s",
                    v.request_id, v.position, v.speculative_token, spec_text, v.plain_token, plain_text, prompt,
                    extra={"request_id": v.request_id, "position": v.position,
                           "speculative_token": v.speculative_token, "plain_token": v.plain_token,
                           "speculative_text": spec_text, "plain_text": plain_text})

    def _text(self, token: int | None) -> str | None:
        return None if token is None else self._text_of([token])

    def _text_of(self, ids: list[int]) -> str:
        if self.decode is None:
            return " ".join(map(str, ids))
        try:
            return self.decode(ids)
        except Exception:  # noqa: BLE001 -- a log line must not take the engine thread down
            return "<undecodable>"

    def _publish(self, **figures: Any) -> None:
        if self.metrics is not None:
            self.metrics.observe_audit(**figures)

    # --- event loop ---------------------------------------------------------------------------------

    def reset(self) -> None:
        """A new experiment: counters to zero, pending replays dropped, a running replay's result ignored."""
        with self._lock:
            self._epoch += 1
            self._pending.clear()
            self._credit = 0.0
            self._zero()
        self._publish(pending=0, identity_rate=float("nan"))

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"enabled": self.is_enabled, "fraction": self.config.fraction, "checked": self.checked,
                    "identical": self.identical, "mismatches": self.mismatches,
                    "identity_rate": self.identical / self.checked if self.checked else None,
                    "pending": len(self._pending), "dropped": self.dropped, "interrupted": self.interrupted,
                    "failed": self.failed, "last_mismatch": self.last_mismatch}


def _at(tokens: list[int], position: int | None) -> int | None:
    return tokens[position] if position is not None and position < len(tokens) else None
