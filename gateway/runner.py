"""The engine thread and its thread-safe handoff to the event loop.

    event loop                          engine thread (owns the Engine: torch lives here only)
    submit() -> inbox "add" ----------> engine.add(...)  -> future resolved via call_soon_threadsafe
    abort()  -> inbox "abort" --------> engine.abort(...) before the next step
                                        engine.step()    -> Events, one call_soon_threadsafe per step
    Submission.events (asyncio.Queue) <------------------'

Commands are applied between steps, so an abort reaches the engine within one step. The engine
thread sleeps on a condition while it has neither commands nor work. Nothing here imports Starlette.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from draft.params import SpeculationParams
from gateway.engine import Engine, RequestOutput
from gateway.metrics import Metrics
from gateway.sequence import SpecStats
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


@dataclass(slots=True)
class Submission:
    request_id: str
    events: asyncio.Queue[Event]
    is_speculative: bool  # the engine gave it a drafter
    prompt_tokens: int


@dataclass(slots=True)
class _Live:
    events: asyncio.Queue[Event]
    is_speculative: bool
    stats: SpecStats = field(default_factory=SpecStats)  # as last delivered, for metric deltas


def _copy(stats: SpecStats) -> SpecStats:
    return SpecStats(stats.steps, stats.drafted_tokens, stats.accepted_tokens, list(stats.accepted_by_depth))


class EngineRunner:
    def __init__(self, engine: Engine, metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
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
                     speculation: SpeculationParams) -> Submission:
        """Queue a request. Raises what ``Engine.add`` raises (ValueError, QueueFull) or ShuttingDown."""
        future: asyncio.Future[Submission] = asyncio.get_running_loop().create_future()
        self._post("add", (future, request_id, prompt_ids, sampling, speculation))
        try:
            return await future
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may have landed; nobody will read its events
            raise

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
                for kind, payload in commands:
                    if kind == "add":
                        self._add(*payload)
                    else:
                        self._abort(payload)
                if self.engine.has_work():
                    self._step()
                self._publish_load()
        finally:
            self._stop()

    def _take(self) -> list[tuple[str, Any]] | None:
        """Every queued command; blocks while idle. None once shutdown was asked for."""
        with self._cond:
            while not self._inbox and not self._stopping and not self.engine.has_work():
                self._cond.wait()
            if self._stopping:
                return None
            commands = list(self._inbox)
            self._inbox.clear()
            return commands

    def _add(self, future: asyncio.Future, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
             speculation: SpeculationParams) -> None:
        try:
            seq = self.engine.add(request_id, prompt_ids, sampling, speculation)
        except Exception as exc:  # noqa: BLE001 -- ValueError / QueueFull go back to the caller as they are
            self._to_loop(_settle, future, None, exc)
            return
        live = _Live(asyncio.Queue(), seq.drafter is not None)
        self._live[request_id] = live
        self._to_loop(_settle, future, Submission(request_id, live.events, live.is_speculative, len(prompt_ids)),
                      None)

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
        batch: list[tuple[asyncio.Queue, Event]] = []
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:  # warm-up leftovers or a request already failed
                continue
            stats = _copy(out.stats)
            if self.metrics is not None:
                self.metrics.observe_step(live.is_speculative, live.stats, stats)
            live.stats = stats
            batch.append((live.events, Event(list(out.new_token_ids), out.finished, out.finish_reason, stats,
                                             out.error, out.completion_tokens, now)))
            if out.finished:
                del self._live[out.request_id]
        if batch:
            self._to_loop(_put_all, batch)

    def _publish_load(self) -> None:
        if self.metrics is None:
            return
        pool = self.engine.cache.pool
        sched = self.engine.scheduler
        self.metrics.observe_engine(len(sched.waiting), len(sched.running), pool.num_blocks - pool.num_free,
                                    pool.num_free)

    def _stop(self) -> None:
        """Shutdown (or a crash of the loop itself): refuse queued adds, abort everything still running."""
        with self._cond:
            self._stopping = True
            commands = list(self._inbox)
            self._inbox.clear()
        for kind, payload in commands:
            if kind == "add":
                self._to_loop(_settle, payload[0], None, ShuttingDown("the server is shutting down"))
        outputs = self._fail_all("the server is shutting down", reason="abort")
        self._deliver(outputs)
        self._publish_load()


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
