"""gateway/generation.py: a stream that wakes to several queued engine events sends them as one delta,
with the same text as one delta per event, and a failure after queued text still delivers that text."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from gateway_util import make_tokenizer
from gateway.generation import EngineFailure, Generation
from gateway.metrics import Metrics
from gateway.protocol import Shape, parse_request
from gateway.runner import Event, Submission
from gateway.sequence import SpecStats
from gateway.stats import Arm

TOK = make_tokenizer()
WORDS = ["Hello", " world", " é€", " again", " and", " more"]


def events(finish: str = "length") -> list[Event]:
    ids = [TOK.encode(w, add_special_tokens=False) for w in WORDS]
    out, done = [], 0
    for i, piece in enumerate(ids):
        done += len(piece)
        last = i == len(ids) - 1
        out.append(Event(piece, last, finish if last else None, SpecStats(), "boom" if last and finish == "error" else None,
                         done, time.monotonic()))
    return out


def generation(queue: asyncio.Queue) -> Generation:
    runner = SimpleNamespace(abort=lambda rid: None, stats=None)
    sub = Submission("r", queue, False, 1, Arm("off", "none", "none"))
    req = parse_request(b'{"model": "m", "prompt": "x", "stream": true}', is_chat=False)
    return Generation(runner, sub, req, Shape(False, "id", 0, "m"), TOK, [5], time.monotonic(), Metrics(), "completions")


async def collect(gen: Generation) -> list[str]:
    return [piece async for piece in gen.pieces()]


def test_queued_events_go_out_as_one_delta_with_the_same_text() -> None:
    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        for e in events():
            queue.put_nowait(e)  # the stream wakes to all of them at once
        coalesced = await collect(generation(queue))

        queue = asyncio.Queue()
        gen = generation(queue)
        pieces = []

        async def feed():
            for e in events():  # one event per wake-up: the stream keeps up
                queue.put_nowait(e)
                await asyncio.sleep(0.01)

        feeder = asyncio.ensure_future(feed())
        async for piece in gen.pieces():
            pieces.append(piece)
        await feeder
        return coalesced, pieces, gen

    coalesced, pieces, gen = asyncio.run(main())
    assert len(coalesced) == 1 and len(pieces) >= len(WORDS) - 1  # 'é€' may wait for its last byte
    assert coalesced[0] == "".join(pieces) == "".join(WORDS)
    assert gen.finish_reason == "length" and gen.completion_tokens == sum(len(TOK.encode(w, add_special_tokens=False)) for w in WORDS)


def test_a_failure_behind_queued_tokens_still_sends_them_first() -> None:
    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        for e in events(finish="error"):
            queue.put_nowait(e)
        got = []
        with pytest.raises(EngineFailure, match="boom"):
            async for piece in generation(queue).pieces():
                got.append(piece)
        return got

    got = asyncio.run(main())
    assert "".join(got) == "".join(WORDS[:-1])  # everything before the failed event
