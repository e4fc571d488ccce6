"""gateway/runner.py: the engine thread's handoff, aborts, failures and shutdown, without HTTP."""

from __future__ import annotations

import asyncio

import pytest

from gateway_util import pool_is_full
from draft.params import SpeculationParams
from engine_util import tiny_engine
from gateway.engine import QueueFull
from gateway.runner import EngineRunner, Event, ShuttingDown
from verify.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


async def drain(events: asyncio.Queue) -> list[Event]:
    out = [await asyncio.wait_for(events.get(), 10)]
    while not out[-1].finished:
        out.append(await asyncio.wait_for(events.get(), 10))
    return out


def run(coro_fn, engine=None):
    """Run ``coro_fn(runner)`` on a fresh loop with a started runner; always shut it down."""
    engine = engine or tiny_engine()

    async def main():
        runner = EngineRunner(engine)
        runner.start(asyncio.get_running_loop())
        try:
            return await coro_fn(runner)
        finally:
            await asyncio.to_thread(runner.shutdown)

    return asyncio.run(main()), engine


def test_tokens_arrive_in_order_and_match_the_engine_alone() -> None:
    from engine_util import run_all

    want = run_all(tiny_engine(), [("r", [1, 2, 3], GREEDY, SpeculationParams(enabled=False))])["r"]

    async def go(runner):
        sub = await runner.submit("r", [1, 2, 3], GREEDY, SpeculationParams(drafter="draft"))
        return sub, await drain(sub.events)

    (sub, events), engine = run(go)
    assert sub.is_speculative and sub.prompt_tokens == 3
    assert [t for e in events for t in e.token_ids] == want
    assert events[-1].finish_reason == "length" and events[-1].completion_tokens == 12
    assert all(a.time <= b.time for a, b in zip(events, events[1:]))
    assert pool_is_full(engine)


def test_refusals_come_back_to_the_caller() -> None:
    async def go(runner):
        with pytest.raises(ValueError, match="prompt is empty"):
            await runner.submit("a", [], GREEDY, SpeculationParams())
        runner.engine.add = lambda *a, **k: (_ for _ in ()).throw(QueueFull("full"))
        with pytest.raises(QueueFull):
            await runner.submit("b", [1], GREEDY, SpeculationParams())

    run(go)


def test_abort_ends_the_stream_and_frees_blocks() -> None:
    async def go(runner):
        sub = await runner.submit("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
                                  SpeculationParams(drafter="draft"))
        await sub.events.get()  # it is running
        runner.abort("r")
        events = await drain(sub.events)
        return events[-1]

    last, engine = run(go)
    assert last.finish_reason == "abort" and last.completion_tokens < 400
    assert pool_is_full(engine) and not engine.has_work()


def test_a_broken_step_fails_its_requests_and_the_next_request_runs() -> None:
    engine = tiny_engine()
    real = engine.scheduler.schedule
    calls = {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("scheduler broke")
        return real(*args)

    engine.scheduler.schedule = flaky

    async def go(runner):
        first = await runner.submit("a", [1, 2], GREEDY, SpeculationParams())
        failed = (await drain(first.events))[-1]
        second = await runner.submit("b", [1, 2], GREEDY, SpeculationParams())
        return failed, (await drain(second.events))[-1]

    (failed, ok), engine = run(go, engine)
    assert failed.finish_reason == "error" and "scheduler broke" in failed.error
    assert ok.finish_reason == "length" and ok.completion_tokens == 12
    assert pool_is_full(engine)


def test_shutdown_aborts_running_requests_and_refuses_new_ones() -> None:
    engine = tiny_engine()

    async def main():
        runner = EngineRunner(engine)
        runner.start(asyncio.get_running_loop())
        sub = await runner.submit("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
                                  SpeculationParams())
        await sub.events.get()
        await asyncio.to_thread(runner.shutdown)
        last = (await drain(sub.events))[-1]
        with pytest.raises(ShuttingDown):
            await runner.submit("late", [1], GREEDY, SpeculationParams())
        return last

    last = asyncio.run(main())
    assert last.finish_reason == "abort" and "shutting down" in last.error
    assert pool_is_full(engine)


def test_an_overlapping_engine_streams_aborts_and_shuts_down_cleanly() -> None:
    """EngineConfig.overlap behind the runner: several plain streams give the step-by-step tokens, an abort
    mid-stream ends its stream while a step is launched ahead, and the pool comes back whole."""
    from dataclasses import replace

    from engine_util import run_all

    plain = SpeculationParams(enabled=False)
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [9, 8]}
    want = run_all(tiny_engine(), [(r, p, GREEDY, plain) for r, p in prompts.items()])
    engine = tiny_engine()
    engine.config = replace(engine.config, overlap=True)

    async def go(runner):
        subs = {r: await runner.submit(r, p, GREEDY, plain) for r, p in prompts.items()}
        long = await runner.submit("x", [3, 3], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), plain)
        await long.events.get()
        runner.abort("x")
        got = {r: [t for e in await drain(s.events) for t in e.token_ids] for r, s in subs.items()}
        return got, (await drain(long.events))[-1]

    (got, aborted), engine = run(go, engine)
    assert got == want
    assert aborted.finish_reason == "abort" and aborted.completion_tokens < 400
    assert engine.num_ahead > 0 and pool_is_full(engine) and not engine.has_work()
