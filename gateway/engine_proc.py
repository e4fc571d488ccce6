"""The engine in a process of its own, beside the server's event loop.

    server process (event loop)                     engine process (torch lives here only)
    ProcessRunner.submit -> ("add", ...)  ---cmd--->  reader thread -> EngineRunner inbox
    ProcessRunner.abort  -> ("abort", id) ---cmd--->  main thread: _ChildRunner._run (engine.step)
    Submission.events   <- ("settled" | "events")  <---out---  one message per add and per step

In one process the engine thread and the event loop share one interpreter lock: a step's Python (the
scheduler, batch building, acceptance, commit) and the streams' Python (detokenization, SSE chunks, socket
writes) take turns, and at many streams their sum, not the GPU, sets the step time (bench/gateway_host.py).
Apart, the two run at once. The engine side is ``EngineRunner`` itself -- commands between steps, abort
within a step, audit replays in idle time -- with its three ways out (a settled add, a step's events, the
load figures) sent down a pipe; the server side keeps the requests' queues and feeds the metrics and the
stats store from the events, as the engine thread did. vLLM's V1 splits its engine core from the API
server the same way.

The engine is built in the child by a picklable factory (the child is spawned, so CUDA starts there only),
which returns the engine and what the server needs besides it (the tokenizer, the chat template, the
model's name); ``EngineInfo`` carries the engine's read-only facts across. If the engine process dies,
every open request ends with an error event and /health says the engine failed.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import multiprocessing.util as mp_util
import pickle
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from draft.params import SpeculationParams
from gateway.engine import Engine, EngineConfig
from gateway.metrics import Metrics
from gateway.runner import (Event, EngineRunner, ShuttingDown, Submission, _Live, added, engine_load, observe_load,
                            observe_step)
from gateway.stats import StatsStore
from target.config import ModelConfig
from verify.sampling import SamplingParams

log = logging.getLogger("specgate.engine_proc")

START_TIMEOUT_S = 1800.0  # loading and quantizing a large model, and capturing graphs, take minutes


@dataclass(slots=True)
class _Target:
    """``EngineInfo.target``: what the server reads of the engine's target."""

    config: ModelConfig
    device: str


@dataclass(slots=True)
class EngineInfo:
    """What the server reads off an engine it does not hold: constants, and ``healthy`` as last reported."""

    config: EngineConfig
    max_model_len: int
    drafters: dict[str, None]
    target: _Target
    healthy: bool = True
    tokenizer: Any = None  # the server's ``Gateway`` may set it; the engine process has its own

    @staticmethod
    def of(engine: Engine) -> "EngineInfo":
        return EngineInfo(engine.config, engine.max_model_len, dict.fromkeys(engine.drafters),
                          _Target(engine.target.config, str(engine.target.device)))


class _ChildRunner(EngineRunner):
    """``EngineRunner``'s engine side in the engine process: what it handed to the event loop goes down ``out``."""

    def __init__(self, engine: Engine, out) -> None:
        super().__init__(engine)
        self._out = out
        self._out_lock = threading.Lock()  # the engine loop and the command reader both send
        self._load: tuple[int, int, int, int] | None = None

    def put(self, msg: tuple) -> None:
        with self._out_lock:
            self._out.send(msg)

    def _queue(self) -> None:
        return None

    def _settled(self, future: Any, request_id: str, sub: Submission | None, exc: BaseException | None) -> None:
        fields = None if sub is None else (sub.is_speculative, sub.prompt_tokens, sub.arm)
        try:
            self.put(("settled", request_id, fields, exc))
        except (pickle.PicklingError, TypeError, AttributeError):  # an exception that cannot cross: its text can
            self.put(("settled", request_id, None, RuntimeError(f"{type(exc).__name__}: {exc}")))

    def _send(self, batch: list[tuple[_Live, Event]]) -> None:
        self.put(("events", [(live.request_id, event) for live, event in batch], self._load, self.engine.healthy))

    def _publish_load(self) -> None:
        load = engine_load(self.engine)
        if load != self._load:  # a message only when a figure moved; events carry the latest anyway
            self._load = load
            self.put(("load", load, self.engine.healthy))


def _child_main(factory: Callable[[], tuple[Engine, dict[str, Any]]], commands, out) -> None:
    """The engine process: build, say ready (or why not), then serve commands until told to stop."""
    # A terminal's Ctrl-C reaches the whole process group: the server drains and tells this process to stop
    # (or closes the pipe); a KeyboardInterrupt here would cut the streams short instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine, extras = factory()
    except BaseException as exc:  # noqa: BLE001 -- the server reports it and exits
        log.exception("the engine could not be built")  # the whole traceback, on the server's stderr
        out.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    out.send(("ready", EngineInfo.of(engine), extras))
    runner = _ChildRunner(engine, out)

    def read() -> None:
        try:
            while True:
                kind, payload = commands.recv()
                if kind == "shutdown":
                    break
                if kind == "add":
                    request_id = payload[0]
                    payload = (request_id, *payload)  # the "future" the runner settles is the request id itself
                try:
                    runner._post(kind, payload)
                except ShuttingDown as exc:
                    runner._settled(None, payload[1], None, exc)
        except (EOFError, OSError):  # the server is gone: stop as on shutdown
            pass
        except Exception:  # noqa: BLE001 -- a command that cannot be read: stop rather than serve deaf
            log.exception("engine command could not be read: stopping")
        with runner._cond:
            runner._stopping = True
            runner._cond.notify()

    threading.Thread(target=read, name="specgate-commands", daemon=True).start()
    runner._run()  # returns after _stop has aborted whatever was left and sent its events
    runner.put(("stopped", None))


def _stop_child(cmd, process, timeout: float | None = 10.0) -> None:
    """Close the command pipe and wait for the engine process, killing it after ``timeout`` seconds."""
    cmd.close()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()


class ProcessRunner:
    """``EngineRunner``'s event-loop side, for an engine in its own process (``start``, ``submit``, ``abort``,
    ``shutdown``). Construction spawns the process and waits until its engine is built."""

    def __init__(self, factory: Callable[[], tuple[Engine, dict[str, Any]]],
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        ctx = mp.get_context("spawn")
        cmd_recv, self._cmd = ctx.Pipe(duplex=False)
        self._out, out_send = ctx.Pipe(duplex=False)
        # not a daemon: a tensor-parallel target's engine spawns its own worker processes
        self.process = ctx.Process(target=_child_main, args=(factory, cmd_recv, out_send), name="specgate-engine")
        self.process.start()
        cmd_recv.close()
        out_send.close()
        # A server that exits without shutdown() (an exception, a test that failed half-way) would hang there:
        # multiprocessing joins non-daemon children at exit, and this child waits on a pipe the exiting process
        # still holds. Finalizers of positive priority run before that join: close the pipe (the child stops
        # as on shutdown) and kill the child if it does not go in time.
        mp_util.Finalize(self, _stop_child, args=(self._cmd, self.process), exitpriority=10)
        self._lock = threading.Lock()  # sends come from the event loop and from abort's callers
        self.metrics: Metrics | None = None
        self.stats: StatsStore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[str, tuple[asyncio.Future, bool]] = {}
        self._live: dict[str, _Live] = {}
        self._stopping = False
        self._stopped = threading.Event()
        if not self._out.poll(start_timeout_s):
            self.process.kill()
            raise RuntimeError(f"the engine process was not ready within {start_timeout_s:.0f} s")
        try:
            msg = self._out.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"the engine process exited while starting (code {self.process.exitcode})") from None
        if msg[0] == "failed":
            self.process.join()
            raise RuntimeError(f"the engine process failed to start: {msg[1]}")
        _, self.info, self.extras = msg

    @property
    def engine(self) -> EngineInfo:
        return self.info

    def attach(self, metrics: Metrics | None, stats: StatsStore | None) -> None:
        """The server's metrics and stats store, fed from the events as they arrive."""
        self.metrics, self.stats = metrics, stats

    # --- event-loop side ------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self._out.fileno(), self._readable)
        # the process's end, whatever else may hold its pipe open: its sentinel becomes readable when it exits
        loop.add_reader(self.process.sentinel, self._readable)

    async def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                     speculation: SpeculationParams, record: bool = True,
                     prefix_of: str | None = None, priority: int = 0) -> Submission:
        """As ``EngineRunner.submit``: raises what ``Engine.add`` raises, or ShuttingDown."""
        if self._stopping or not self.process.is_alive():
            raise ShuttingDown("the server is shutting down" if self._stopping else "the engine process is gone")
        future: asyncio.Future[Submission] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (future, record)
        self._post(("add", (request_id, prompt_ids, sampling, speculation, record, prefix_of, priority)))
        return await added(future, request_id, self.abort)

    def abort(self, request_id: str) -> None:
        """Cancel a request (idempotent, any thread)."""
        self._post(("abort", request_id))

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop after the current step: the engine process aborts every request (their last events still
        arrive while the loop runs) and exits."""
        self._stopping = True
        self._post(("shutdown", None))
        if self._loop is None or self._loop.is_closed():  # no loop reads the pipe: drain it here
            try:
                while not self._stopped.is_set() and self._out.poll(timeout):
                    if self._out.recv()[0] == "stopped":
                        self._stopped.set()
            except (EOFError, OSError):
                pass
        self._stopped.wait(timeout)
        _stop_child(self._cmd, self.process, timeout)

    def _post(self, msg: tuple[str, Any]) -> None:
        with self._lock:
            try:
                self._cmd.send(msg)
            except (OSError, ValueError):  # the engine process is gone: its reader fails what is open
                pass

    def _readable(self) -> None:
        if self._stopped.is_set():
            return
        try:
            while self._out.poll():
                msg = self._out.recv()
                try:
                    self._dispatch(msg)
                except Exception:  # noqa: BLE001 -- one bad message must not stop the others' delivery
                    log.exception("engine message %r could not be delivered", msg[0])
        except (EOFError, OSError):
            self._lost()
            return
        if not self.process.is_alive() and not self._stopped.is_set():  # exited with its pipe still open
            self._lost()

    def _dispatch(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "events":
            _, items, load, healthy = msg
            now = time.monotonic()
            for request_id, event in items:
                req = self._live.get(request_id)
                if req is None:
                    continue
                if req.record:
                    observe_step(self.metrics, self.stats, req.arm, event.stats.since(req.stats), event.token_ids, now)
                req.stats = event.stats
                req.events.put_nowait(event)
                if event.finished:
                    del self._live[request_id]
            self._load(load, healthy)
        elif kind == "settled":
            _, request_id, fields, exc = msg
            future, record = self._pending.pop(request_id, (None, True))
            if exc is None:
                is_speculative, prompt_tokens, arm = fields
                req = self._live[request_id] = _Live(request_id, asyncio.Queue(), is_speculative, arm, record)
                result = Submission(request_id, req.events, is_speculative, prompt_tokens, arm)
            if future is None or future.done():  # the caller gave up; submit() aborted the request
                return
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(result)
        elif kind == "load":
            self._load(msg[1], msg[2])
        elif kind == "stopped":
            self._closed()

    def _load(self, load: tuple | None, healthy: bool) -> None:
        self.info.healthy = healthy
        if load is not None:
            observe_load(self.metrics, self.stats, load)

    def _lost(self) -> None:
        """The engine process is gone (or closed its pipe): end every open request with an error."""
        if not self._stopping:
            log.error("the engine process exited (code %s): failing open requests", self.process.exitcode)
            self.info.healthy = False
        error = "the server is shutting down" if self._stopping else "the engine process exited"
        for request_id, req in self._live.items():
            req.events.put_nowait(Event([], True, "abort" if self._stopping else "error", req.stats, error, 0,
                                        time.monotonic()))
        self._live.clear()
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(ShuttingDown(error))
        self._pending.clear()
        self._closed()

    def _closed(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._out.fileno())
            self._loop.remove_reader(self.process.sentinel)
        self._stopped.set()
