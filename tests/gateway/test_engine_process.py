"""The engine in a process of its own (gateway/engine_proc.py): the server's answers equal those of the engine
thread, requests are aborted and failed across the pipe, and nothing is left open when the process goes."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from draft.params import SpeculationParams
from gateway.engine_proc import ProcessRunner
from gateway.runner import ShuttingDown
from gateway.audit import AuditConfig
from gateway_util import (LiveServer, asgi_client, make_app, make_process_app, make_tokenizer,
                          tiny_engine_process)
from verify.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]

BODIES = [
    {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 12, "temperature": 0,
     "ignore_eos": True},
    {"model": "tiny", "messages": [{"role": "user", "content": "Count"}], "max_tokens": 10, "temperature": 0,
     "ignore_eos": True, "speculation": {"enabled": False}},
    {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0.9,
     "seed": 4, "n": 2, "ignore_eos": True, "speculation": {"drafter": "draft", "tree": [2, 1]}},
    # logprobs cross the pipe pickled; a grammar's matcher lives in the engine process, over its own tokenizer
    {"model": "tiny", "messages": [{"role": "user", "content": "Ok?"}], "max_tokens": 40, "temperature": 0,
     "logprobs": True, "top_logprobs": 2, "speculation": {"drafter": "draft", "tree": [2, 1]},
     "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
         "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}},
]


async def _answers(client) -> list:
    out = []
    for body in BODIES:
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out.append([(c["message"]["content"], c["finish_reason"], c.get("logprobs")) for c in r.json()["choices"]])
        streamed = await client.post("/v1/chat/completions", json=body | {"stream": True, "n": 1})
        lines = [ln[6:] for ln in streamed.text.splitlines() if ln.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        out.append("".join(c["choices"][0]["delta"].get("content") or "" for c in map(orjson.loads, lines[:-1])
                           if c["choices"]))
    r = await client.post("/v1/chat/completions", json=BODIES[0] | {"max_tokens": 10**6})
    out.append((r.status_code, r.json()["error"]["message"]))  # Engine.add's refusal, from across the pipe
    return out


async def _next(sub):
    """A submission's next event, or a failure rather than a hang."""
    return await asyncio.wait_for(sub.events.get(), timeout=60)


def test_answers_equal_the_engine_threads() -> None:
    """Greedy and seeded sampled answers, streamed and whole, and a refusal: the same from an engine process
    as from the engine thread; its metrics and stats are fed from the events, and its pools end whole."""
    async def main(app):
        async with asgi_client(app) as client:
            got = await _answers(client)
            models = (await client.get("/v1/models")).json()
            metrics = (await client.get("/metrics")).text
            stats = (await client.get("/v1/stats")).json()
        return got, models, metrics, stats

    want = asyncio.run(main(make_app(make_tokenizer())))
    runner = ProcessRunner(functools.partial(tiny_engine_process))
    got = asyncio.run(main(make_process_app(runner)))
    assert not runner.process.is_alive() and runner.process.exitcode == 0  # the lifespan's shutdown stopped it
    assert got[:2] == want[:2]  # answers, /v1/models
    text, _, logprobs = got[0][6][0]  # the constrained body's whole answer
    assert isinstance(orjson.loads(text)["ok"], bool) and len(logprobs["content"]) > 0
    fed = ("specgate_accepted_length_count", "specgate_generation_tokens_total")  # per-step series, from the events
    lines = [sorted(ln for ln in m.splitlines() if ln.startswith(fed)) for m in (got[2], want[2])]
    assert lines[0] == lines[1] and len(lines[0]) >= 3
    for stats in (got[3], want[3]):
        assert stats["queue"] == {"waiting": 0, "running": 0} and stats["kv"]["used_blocks"] == 0
        assert stats["kv"]["total_blocks"] == 128
    assert got[3]["arms"].keys() == want[3]["arms"].keys()


def test_abort_and_shutdown_cross_the_pipe() -> None:
    runner = ProcessRunner(functools.partial(tiny_engine_process))

    async def main():
        app = make_process_app(runner)
        async with asgi_client(app):
            long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            a = await runner.submit("a", [5, 6, 7], long, SpeculationParams(enabled=False))
            b = await runner.submit("b", [5, 6, 8], long, SpeculationParams(drafter="draft"))
            assert not (await _next(a)).finished
            runner.abort("a")
            while not (ev := await _next(a)).finished:
                pass
            assert ev.finish_reason == "abort"
            # the lifespan's end shuts the engine process down: b ends aborted, not cut off
        while not (ev := await _next(b)).finished:
            pass
        assert ev.finish_reason == "abort" and ev.error == "the server is shutting down"
        with pytest.raises(ShuttingDown):
            await runner.submit("c", [1, 2], long, SpeculationParams())

    asyncio.run(main())
    assert runner.process.exitcode == 0


def test_a_dead_engine_process_fails_open_requests_and_health() -> None:
    runner = ProcessRunner(functools.partial(tiny_engine_process))

    async def main():
        app = make_process_app(runner)
        async with asgi_client(app) as client:
            sub = await runner.submit("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=10**4, ignore_eos=True),
                                      SpeculationParams())
            first = await _next(sub)
            assert not first.finished, first.error  # the engine process is alive and stepping
            os.kill(runner.process.pid, signal.SIGKILL)
            while not (ev := await _next(sub)).finished:
                pass
            assert ev.finish_reason == "error" and ev.error == "the engine process exited"
            health = await client.get("/health")
            assert health.status_code == 503 and "engine failed" in health.json()["status"]
            r = await client.post("/v1/chat/completions", json=BODIES[0])
            assert r.status_code == 503

    asyncio.run(main())


def test_an_add_refused_with_an_exception_pickle_cannot_name_still_answers() -> None:
    runner = ProcessRunner(functools.partial(tiny_engine_process, refuse="no room for you"))

    async def main():
        runner.start(asyncio.get_running_loop())
        with pytest.raises(RuntimeError, match="Unpicklable: no room for you"):
            await asyncio.wait_for(runner.submit("a", [1, 2], SamplingParams(), SpeculationParams()), timeout=60)
        await asyncio.to_thread(runner.shutdown)

    asyncio.run(main())
    assert runner.process.exitcode == 0


def test_an_engine_that_cannot_start_is_named() -> None:
    with pytest.raises(RuntimeError, match="failed to start: RuntimeError: no such model"):
        ProcessRunner(functools.partial(tiny_engine_process, fail="no such model"))


def test_the_audit_needs_the_engine_thread() -> None:
    runner = ProcessRunner(functools.partial(tiny_engine_process))
    try:
        with pytest.raises(ValueError, match="audit"):
            make_process_app(runner, audit=AuditConfig(fraction=0.5))
    finally:
        runner.shutdown()
    assert runner.process.exitcode == 0


def test_a_server_that_exits_without_shutdown_does_not_hang(tmp_path) -> None:
    """multiprocessing joins a non-daemon child at exit; without the runner's finalizer the engine process
    waits on its command pipe for ever and the server never exits."""
    script = tmp_path / "leave.py"
    script.write_text(
        "import functools, sys\n"
        f"sys.path[:0] = {[str(ROOT), str(ROOT / 'tests'), str(ROOT / 'tests' / 'gateway')]!r}\n"
        "from gateway.engine_proc import ProcessRunner\n"
        "from gateway_util import tiny_engine_process\n"
        "if __name__ == '__main__':\n"
        "    runner = ProcessRunner(functools.partial(tiny_engine_process))\n"
        "    print(runner.process.pid, flush=True)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    child = int(done.stdout.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # the engine process is gone too


def _gauge(metrics: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", metrics, re.M).group(1))


def test_many_streams_and_disconnects_leave_nothing_open() -> None:
    """The serving default under churn: 48 requests, 12 at a time, over real sockets (streamed and whole,
    speculation on and off, greedy and sampled), a quarter of the streams dropped by their client part-way,
    on a pool of 48 four-token blocks for eight running sequences of up to ~100 tokens each, so sequences are
    preempted. Every request gets one outcome, the server counts each once, and once idle the engine process
    reports nothing waiting or running and every target and draft KV block free."""
    runner = ProcessRunner(functools.partial(tiny_engine_process, num_blocks=48))
    rng = random.Random(7)
    plans = []
    for i in range(48):
        text = f"churn {i} " + "word " * rng.randint(0, 30)
        body = {"model": "tiny", "messages": [{"role": "user", "content": text}],
                "max_tokens": rng.randint(4, 40), "ignore_eos": True, "temperature": rng.choice([0, 0, 0.8]),
                "seed": i, "stream": rng.random() < 0.7,
                "speculation": {"enabled": rng.random() < 0.6}}
        # a dropped stream leaves after its first or second data line: every stream sends at least two (a chunk
        # and [DONE]), while a later drop point could fall past the end of a short stream whose tokens the
        # server sent in few chunks (one did so in CI: it finished instead of dropping)
        plans.append((body, body["stream"] and rng.random() < 0.25, rng.randrange(1, 3)))

    async def one(http, url: str, body: dict, drop: bool, keep: int) -> str:
        if not body["stream"]:
            r = await http.post(url, json=body)
            return str(r.status_code)
        async with http.stream("POST", url, json=body) as r:
            lines = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines += 1
                    if drop and lines >= keep:
                        return "dropped"  # leaving the block closes the connection mid-stream
                    if line == "data: [DONE]":
                        return str(r.status_code)
        return "truncated"

    async def drive(base: str) -> list[str]:
        gate = asyncio.Semaphore(12)
        async with httpx.AsyncClient(timeout=60) as http:
            async def guarded(p):
                async with gate:
                    return await asyncio.wait_for(one(http, base + "/v1/chat/completions", *p), 60)
            return await asyncio.gather(*(guarded(p) for p in plans))

    with LiveServer(make_process_app(runner)) as server:
        outcomes = asyncio.run(drive(server.url))
        assert all(o in ("200", "dropped") for o in outcomes), outcomes
        assert outcomes.count("dropped") == sum(drop for _, drop, _ in plans if drop)
        deadline = time.monotonic() + 30
        while True:  # the engine settles a moment after the last client: aborts cross the pipe
            metrics = httpx.get(server.url + "/metrics").text
            settled = [_gauge(metrics, g) for g in ("specgate_queue_depth", "specgate_running_sequences",
                                                    "specgate_kv_blocks_used", "specgate_draft_kv_blocks_used")]
            if settled == [0, 0, 0, 0]:
                break
            assert time.monotonic() < deadline, settled
            time.sleep(0.05)
        counted = sum(float(v) for v in re.findall(r"^specgate_requests_total\{[^}]*\} (\S+)$", metrics, re.M))
        assert counted == len(plans)
    assert runner.process.exitcode == 0
