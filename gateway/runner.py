"""The engine thread and its thread-safe handoff to the event loop.

    event loop                          engine thread (owns the Engine: torch lives here only)
    submit() -> inbox "add" ----------> engine.add(...)  -> future resolved via call_soon_threadsafe
    abort()  -> inbox "abort" --------> engine.abort(...) before the next step
                                        engine.step()    -> Events, one call_soon_threadsafe per step
    Submission.events (asyncio.Queue) <------------------'

Commands are applied between steps, so an abort reaches the engine within one step. The engine
thread sleeps on a condition while it has neither commands nor work. Nothing here imports Starlette.

Step figures go to the metrics and the stats store from here, per arm (``stats.Arm``), for user requests
only: warm-up (``record=False``) and audit replays are not traffic. The audit (``gateway/audit.py``) runs
in idle capacity: a replay starts only when no recorded or warm-up request is live, the inbox is empty
and ``idle_s`` has passed since the last one; any ``add`` aborts it (its KV freed) and requeues it, so a
real request waits at most for the one replay step already running.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from draft.params import SpeculationParams
from gateway.audit import REPLAY_PRIORITY, Auditor, Replay
from gateway.engine import Engine, RequestOutput
from gateway.metrics import Metrics
from gateway.sequence import SpecStats
from gateway.stats import AUTO, Arm, ArmLabeller, StatsStore
from verify.logprobs import TokenLogprob
from verify.sampling import SamplingParams

log = logging.getLogger("specgate.runner")


class ShuttingDown(RuntimeError):
    """The runner is stopping (or stopped); no new requests (HTTP 503)."""


@dataclass(frozen=True, slots=True)
class Event:
    """One engine event for one request, owned by the event loop once delivered."""

    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "error"
    stats: SpecStats  # a copy: the engine keeps mutating its own
    error: str | None
    completion_tokens: int
    time: float  # time.monotonic() when the engine emitted it
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.., on the first event, when asked
    stop_token: bool = False  # ended at a stop token, the last of token_ids: its text is not the output's
    cached_tokens: int = 0  # prompt tokens the prefix cache held at admission

    def __reduce__(self):
        # positional: dataclasses' slots state calls fields() per object, which made unpickling the larger
        # part of an engine process's message (gateway/engine_proc.py)
        return Event, (self.token_ids, self.finished, self.finish_reason, self.stats, self.error,
                       self.completion_tokens, self.time, self.logprobs, self.prompt_logprobs, self.stop_token,
                       self.cached_tokens)


@dataclass(slots=True)
class Submission:
    request_id: str
    events: asyncio.Queue[Event]
    is_speculative: bool  # the engine gave it a drafter
    prompt_tokens: int
    arm: Arm  # its A/B arm, for the stats store and the tree-aware metrics


@dataclass(slots=True)
class _Live:
    request_id: str
    events: asyncio.Queue[Event] | None  # None in an engine process: the events cross a pipe (engine_proc.py)
    is_speculative: bool
    arm: Arm
    record: bool  # user traffic: observed in metrics and stats, offered to the audit
    stats: SpecStats = field(default_factory=SpecStats)  # as last delivered, for metric deltas
    audit: tuple[list[int], SamplingParams, list[int]] | None = None  # prompt, sampling, tokens so far


class EngineRunner:
    def __init__(self, engine: Engine, metrics: Metrics | None = None, stats: StatsStore | None = None,
                 auditor: Auditor | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.stats = stats
        self.auditor = auditor if auditor is not None and auditor.is_enabled else None
        self.labeller = ArmLabeller()
        self._replay: Replay | None = None  # engine thread only: the audit replay in the engine
        self._replay_tokens: list[int] = []
        self._busy_at = time.monotonic()  # engine thread: when a live request was last seen
        self._cond = threading.Condition()
        self._inbox: deque[tuple[str, Any]] = deque()  # ("add", (future, args)) or ("abort", request_id)
        self._stopping = False
        self._live: dict[str, _Live] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # --- event-loop side --------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="specgate-engine", daemon=True)
        self._thread.start()

    async def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                     speculation: SpeculationParams, record: bool = True,
                     prefix_of: str | None = None, priority: int = 0) -> Submission:
        """Queue a request. Raises what ``Engine.add`` raises (ValueError, QueueFull) or ShuttingDown.
        ``record=False``: the server's own request (warm-up), kept out of metrics, stats and the audit.
        ``prefix_of`` and ``priority``: as ``Engine.add``'s (a sibling choice reuses that request's prompt KV;
        the scheduling class, lower first)."""
        future: asyncio.Future[Submission] = asyncio.get_running_loop().create_future()
        self._post("add", (future, request_id, prompt_ids, sampling, speculation, record, prefix_of, priority))
        return await added(future, request_id, self.abort)

    def abort(self, request_id: str) -> None:
        """Cancel a request (idempotent, any thread); its blocks free before the next step."""
        self._post("abort", request_id)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop after the current step: abort every request, free its blocks, join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _post(self, kind: str, payload: Any) -> None:
        with self._cond:
            if self._stopping and kind == "add":
                raise ShuttingDown("the server is shutting down")
            self._inbox.append((kind, payload))
            self._cond.notify()

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # --- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while (commands := self._take()) is not None:
                if self._replay is not None and any(kind == "add" for kind, _ in commands):
                    self._interrupt_replay()  # real traffic first: the replay runs again later
                for kind, payload in commands:
                    if kind == "add":
                        self._add(*payload)
                    else:
                        self._abort(payload)
                if self._live:
                    self._busy_at = time.monotonic()
                elif self._replay_wait() == 0:
                    self._start_replay()
                if self.engine.has_work():
                    self._step()
                self._publish_load()
        finally:
            self._stop()

    def _take(self) -> list[tuple[str, Any]] | None:
        """Every queued command; blocks while idle (until a due replay, if any). None once shutdown was asked."""
        with self._cond:
            while not self._inbox and not self._stopping and not self.engine.has_work():
                wait = self._replay_wait()
                if wait == 0:
                    break
                self._cond.wait(wait)
            if self._stopping:
                return None
            commands = list(self._inbox)
            self._inbox.clear()
            return commands

    def _add(self, future: asyncio.Future, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
             speculation: SpeculationParams, record: bool, prefix_of: str | None, priority: int = 0) -> None:
        try:
            seq = self.engine.add(request_id, prompt_ids, sampling, speculation, priority, prefix_of=prefix_of)
        except Exception as exc:  # noqa: BLE001 -- ValueError / QueueFull go back to the caller as they are
            self._settled(future, request_id, None, exc)
            return
        # a request whose drafter the speculation gate chooses step by step is labelled "auto"
        arm = self.labeller.arm(AUTO if seq.follows_gate else seq.drafter, speculation.tree, speculation.max_nodes)
        live = _Live(request_id, self._queue(), seq.drafter is not None, arm, record)
        if record and self.auditor is not None and self.auditor.wants(live.is_speculative, sampling):
            live.audit = (list(prompt_ids), sampling, [])
        self._live[request_id] = live
        self._settled(future, request_id, Submission(request_id, live.events, live.is_speculative, len(prompt_ids),
                                                     arm), None)

    # The engine side's three ways out, which an engine process (engine_proc.py) sends down a pipe instead.

    def _queue(self) -> asyncio.Queue[Event] | None:
        """A new request's event queue (the event loop's)."""
        return asyncio.Queue()

    def _settled(self, future: Any, request_id: str, sub: Submission | None, exc: BaseException | None) -> None:
        """An add's outcome, to the waiting ``submit``."""
        self._to_loop(_settle, future, sub, exc)

    def _send(self, batch: list[tuple[_Live, Event]]) -> None:
        """A step's events, one hand-off to the event loop."""
        self._to_loop(_put_all, [(live.events, event) for live, event in batch])

    def _abort(self, request_id: str) -> None:
        try:
            out = self.engine.abort(request_id)
        except Exception:  # noqa: BLE001 -- a broken abort must not stop the thread serving the others
            log.exception("abort of %s failed", request_id)
            return
        if out is not None:
            self._deliver([out])

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 -- Engine.step fails per request; this is the scheduler itself
            log.exception("engine step failed")
            outputs = self._fail_all(f"{type(exc).__name__}: {exc}")
        self._deliver(outputs)

    def _fail_all(self, error: str, reason: str = "error") -> list[RequestOutput]:
        """End every live request with ``reason``: "error" (the step broke) or "abort" (shutdown)."""
        outputs = []
        for request_id in list(self._live):
            try:
                out = self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 -- keep failing the others
                log.exception("abort of %s failed", request_id)
                out = None
            out = out or RequestOutput(request_id, [], True, reason, SpecStats())
            out.finish_reason, out.error = reason, error
            outputs.append(out)
        return outputs

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self._publish_load()  # before the events: a client that saw its last token sees its blocks freed
        now = time.monotonic()
        batch: list[tuple[_Live, Event]] = []
        for out in outputs:
            if self._replay is not None and out.request_id == self._replay.engine_id:
                self._replay_output(out)
                continue
            live = self._live.get(out.request_id)
            if live is None:  # a request already failed
                continue
            stats = out.stats.copy()
            if live.record:
                self._observe(live, stats.since(live.stats), out.new_token_ids, now)
            live.stats = stats
            batch.append((live, Event(list(out.new_token_ids), out.finished, out.finish_reason, stats, out.error,
                                      out.completion_tokens, now, out.logprobs, out.prompt_logprobs, out.stop_token,
                                      out.cached_tokens)))
            if out.finished:
                del self._live[out.request_id]
                self._busy_at = now
                if live.audit is not None:
                    prompt_ids, sampling, tokens = live.audit
                    self.auditor.offer(out.request_id, prompt_ids, sampling, tokens, out.finish_reason)
        if batch:
            self._send(batch)

    def _observe(self, live: _Live, delta: SpecStats, new_tokens: list[int], now: float) -> None:
        observe_step(self.metrics, self.stats, live.arm, delta, new_tokens, now)
        if live.audit is not None:
            live.audit[2].extend(new_tokens)

    def _publish_load(self) -> None:
        observe_load(self.metrics, self.stats, engine_load(self.engine))

    # --- the audit's replays (engine thread) --------------------------------------------------------

    def _replay_wait(self) -> float | None:
        """Seconds until a replay may start (0: now); None when none can (nothing pending, or not idle)."""
        if self.auditor is None or self._replay is not None or self._live or not self.auditor.has_pending():
            return None
        return max(0.0, self._busy_at + self.auditor.config.idle_s - time.monotonic())

    def _start_replay(self) -> None:
        with self._cond:
            if self._inbox:  # a command came in meanwhile: it goes first
                return
        replay = self.auditor.next_replay()
        if replay is None:
            return
        try:
            self.engine.add(replay.engine_id, replay.prompt_ids, replay.sampling, SpeculationParams(enabled=False),
                            priority=REPLAY_PRIORITY)
        except Exception:  # noqa: BLE001 -- a replay that cannot run is no verdict; serving goes on
            log.exception("audit replay of %s could not start", replay.request_id)
            self.auditor.fail(replay)
            return
        self._replay, self._replay_tokens = replay, []

    def _interrupt_replay(self) -> None:
        replay, self._replay = self._replay, None
        try:
            self.engine.abort(replay.engine_id)  # frees its blocks before the real request's first step
        except Exception:  # noqa: BLE001
            log.exception("abort of audit replay %s failed", replay.engine_id)
        self.auditor.requeue(replay)

    def _replay_output(self, out: RequestOutput) -> None:
        self._replay_tokens += out.new_token_ids
        if not out.finished:
            return
        replay, self._replay = self._replay, None
        if out.finish_reason in ("stop", "length"):
            self.auditor.verdict(replay, self._replay_tokens)
        else:
            log.warning("audit replay of %s ended with %s: %s", replay.request_id, out.finish_reason, out.error)
            self.auditor.fail(replay)

    def _stop(self) -> None:
        """Shutdown (or a crash of the loop itself): refuse queued adds, abort everything still running."""
        with self._cond:
            self._stopping = True
            commands = list(self._inbox)
            self._inbox.clear()
        for kind, payload in commands:
            if kind == "add":
                self._settled(payload[0], payload[1], None, ShuttingDown("the server is shutting down"))
        if self._replay is not None:
            self.engine.abort(self._replay.engine_id)
            self._replay = None
        outputs = self._fail_all("the server is shutting down", reason="abort")
        self._deliver(outputs)
        self._publish_load()


async def added(future: asyncio.Future[Submission], request_id: str, abort: Callable[[str], None]) -> Submission:
    """An add's outcome. A caller cancelled while waiting aborts the request: the add may have landed, and
    nobody will read its events."""
    try:
        return await future
    except asyncio.CancelledError:
        abort(request_id)
        raise


def observe_step(metrics: Metrics | None, stats: StatsStore | None, arm: Arm, delta: SpecStats, new_tokens: list[int],
                 now: float) -> None:
    """One request's step into the metrics and the stats store (wherever its events are delivered)."""
    if metrics is not None:
        metrics.observe_step(arm, delta)
    if stats is not None and (delta.steps or new_tokens):
        stats.observe_step(arm, delta, len(new_tokens), now)


def engine_load(engine: Engine) -> tuple:
    """Waiting and running sequences, used and total target KV blocks, the drafters' used KV blocks (each
    pool once: the hybrid drafters share their model drafter's), and the speculation gate's state per batch
    bucket (``SpecGate.state``; empty without a gate)."""
    pool, sched = engine.cache.pool, engine.scheduler
    draft_used = sum(c.pool.num_blocks - c.pool.num_free for c in engine.draft_caches())
    gate = sched.gate.state() if sched.gate is not None else ()
    return len(sched.waiting), len(sched.running), pool.num_blocks - pool.num_free, pool.num_blocks, draft_used, gate


def observe_load(metrics: Metrics | None, stats: StatsStore | None, load: tuple) -> None:
    waiting, running, used, blocks, draft_used, gate = load
    if metrics is not None:
        metrics.observe_engine(waiting, running, used, blocks - used, draft_used, gate)
    if stats is not None:
        stats.observe_load(waiting, running, used, blocks, time.monotonic(), gate)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():  # the caller was cancelled while waiting; submit() aborts the request
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _put_all(batch: list[tuple[asyncio.Queue, Event]]) -> None:
    for queue, event in batch:
        queue.put_nowait(event)
