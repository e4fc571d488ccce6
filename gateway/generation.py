"""One request on the event loop (``Generation``; ``Choices`` when it asks for n > 1): engine events ->
text pieces -> an OpenAI body or SSE chunks.

Owns the request's timing (TTFT, per-token latency, decode rate), its request-level metrics and stats
(``runner.stats``, under the request's arm), and
the guarantee that a request nobody reads any more is aborted in the engine: ``close`` runs from
every exit (finished, stop string, engine failure, client gone, cancellation) and is idempotent.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from gateway.detok import Decoder, TextAssembler, TokenText
from gateway.metrics import Metrics, spec_label
from gateway.protocol import (SSE_DONE, ApiError, GenerateRequest, Shape, error_body, logprobs_body, speculation_report,
                              sse, tool_calls, usage)
from gateway.runner import EngineRunner, Event, Submission
from gateway.sequence import SpecStats
from verify.logprobs import TokenLogprob

log = logging.getLogger("specgate.generation")


class EngineFailure(Exception):
    """The engine ended the request with an error (500) or aborted it on shutdown (503)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Generation:
    """One choice: one sequence in the engine. A request with ``n > 1`` is ``Choices`` over n of these."""

    def __init__(self, runner: EngineRunner, sub: Submission, req: GenerateRequest, shape: Shape,
                 tokenizer: Decoder, prompt_ids: list[int], arrival: float, metrics: Metrics, route: str,
                 index: int = 0, token_text: TokenText | None = None,
                 echo: tuple[str, list[int]] | None = None) -> None:
        self.runner, self.sub, self.req, self.shape, self.metrics = runner, sub, req, shape, metrics
        self.route, self.arrival, self.index = route, arrival, index
        self.label = spec_label(sub.is_speculative)
        self.assembler = TextAssembler(tokenizer, prompt_ids, req.stop, include_stop=req.include_stop,
                                       min_tokens=req.sampling.get("min_tokens", 0),
                                       skip_special_tokens=req.skip_special_tokens)
        # logprobs: every reported token with the offset of its text, and how many went out in chunks so far
        self.token_text = None
        if req.sampling.get("logprobs") is not None:
            self.token_text = token_text or TokenText(tokenizer)
        self.logprobs: list[tuple[int, TokenLogprob | None, int]] = []  # (token, figures, text offset)
        self._logprobs_sent = 0
        # echo (completions): the prompt's text goes out before the output's, with its tokens' logprobs when
        # asked; output offsets then count from the end of the echoed text
        self.prompt_ids = prompt_ids
        self.call_id = "call_" + uuid.uuid4().hex[:24]  # a tool call's id, when the choice makes one
        if req.echo and echo is None:  # the app computes it off the event loop (echo_text) and hands it in
            echo = echo_text(tokenizer, prompt_ids)
        self._echo: tuple[str, list[int]] | None = echo if req.echo else None
        self._text_base = len(self._echo[0]) if self._echo else 0
        self.stats = SpecStats()
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the prefix cache held (from the engine's events)
        self.finish_reason: str | None = None
        self.first_time: float | None = None
        self.first_tokens = 0
        self.last_time: float | None = None
        self.is_done = False  # the engine holds nothing for this request any more
        self.is_closed = False
        self.interrupted: str | None = None  # why the server aborted it (shutdown)
        self.on_close: Callable[[], None] | None = None  # the app's admission slot, given back once

    # --- events -> text ---------------------------------------------------------------------------

    async def pieces(self) -> AsyncIterator[str]:
        """Stable text deltas; the last one is yielded (maybe empty) once ``finish_reason`` is set.

        Every event already queued when the stream wakes goes into one delta: a reader that keeps up gets
        one chunk per engine step, and one that falls behind (the event loop busy with many streams) gets
        fewer, larger chunks instead of a growing backlog. A chunk's fixed cost -- its JSON, SSE frame and
        socket write -- is then paid per wake-up, not per step (vLLM's streaming coalesces likewise)."""
        events = self.sub.events
        while not self.is_done:
            event = await events.get()
            text = ""
            while True:
                try:
                    text += self._feed(event)
                except EngineFailure:
                    if text:  # what came before the failure is the client's: send it first
                        yield text
                    raise
                if self.is_done or events.empty():
                    break
                event = events.get_nowait()
            if text or self.is_done or len(self.logprobs) > self._logprobs_sent:
                yield text

    def _feed(self, event: Event) -> str:
        """One engine event into the assembler: its stable text. Raises EngineFailure for a failed request."""
        self._observe(event)
        if event.finished and event.finish_reason in ("error", "abort"):
            self.is_done = True
            status = 503 if event.finish_reason == "abort" else 500
            raise EngineFailure(event.error or self.interrupted or "the request was aborted", status)
        head = self._take_echo(event)
        if self.token_text is not None and event.logprobs:
            text, stopped = self._feed_tokens(event)
        else:
            ids = event.token_ids[:-1] if self._drops_stop_token(event) else event.token_ids
            text, stopped = self.assembler.feed(ids, event.finished)
        text = head + text
        if stopped and not event.finished:
            self.runner.abort(self.sub.request_id)  # free its KV now, not at max_tokens
        if stopped or event.finished:
            self.is_done = True
            self.finish_reason = "stop" if stopped else event.finish_reason
        return text

    def _feed_tokens(self, event: Event) -> tuple[str, bool]:
        """``assembler.feed`` one token at a time, keeping each token's logprobs up to the token that completed
        a stop string (the tokens after it are cut, as their text is)."""
        text, last = "", len(event.logprobs) - 1
        drop = self._drops_stop_token(event)
        for i, entry in enumerate(event.logprobs):
            offset = self._text_base + self.assembler.offset
            ids = [] if drop and i == last else [entry.token_id]  # the stop token: its logprob, not its text
            piece, stopped = self.assembler.feed(ids, event.finished and i == last)
            self.logprobs.append((entry.token_id, entry, offset))
            text += piece
            if stopped:
                return text, True
        return text, False

    def _drops_stop_token(self, event: Event) -> bool:
        """The event ends at a stop token whose text stays out of the output (vLLM's rule for EOS and
        stop_token_ids; ``include_stop_str_in_output`` keeps it). The token still counts and has logprobs."""
        return event.stop_token and not self.req.include_stop

    def _take_echo(self, event: Event) -> str:
        """The echoed prompt's text, once, before the first output; its tokens' logprobs with it (the first
        token has none: nothing comes before it)."""
        if self._echo is None:
            return ""
        text, offsets = self._echo
        self._echo = None
        if self.token_text is not None:
            scored = {i + 1: e for i, e in enumerate(event.prompt_logprobs or [])}
            self.logprobs[:0] = [(t, scored.get(i), off) for i, (t, off) in enumerate(zip(self.prompt_ids, offsets))]
        return text

    def _new_logprobs(self) -> dict[str, Any] | None:
        """The logprobs of the tokens not yet in a chunk, for the next chunk; None when there are none."""
        if self.token_text is None or self._logprobs_sent == len(self.logprobs):
            return None
        entries, self._logprobs_sent = self.logprobs[self._logprobs_sent :], len(self.logprobs)
        return logprobs_body(self.shape.is_chat, entries, self.token_text)

    def logprobs_report(self) -> dict[str, Any] | None:
        """The whole choice's logprobs for the non-stream body; None when not asked for."""
        if self.token_text is None:
            return None
        return logprobs_body(self.shape.is_chat, self.logprobs, self.token_text)

    def _observe(self, event: Event) -> None:
        n = len(event.token_ids)
        if n:
            store = self.runner.stats
            if self.first_time is None:
                self.first_time, self.first_tokens = event.time, n
                self.metrics.ttft.labels(self.label).observe(event.time - self.arrival)
                if store is not None:
                    store.observe_first_token(self.sub.arm, event.time - self.arrival, event.time)
            else:
                per_token = (event.time - self.last_time) / n  # a speculative event carries several tokens
                self.metrics.per_token.add((self.label,), per_token, n)
                if store is not None:
                    store.observe_token_gaps(self.sub.arm, per_token, n, event.time)
            self.last_time = event.time
        self.completion_tokens = event.completion_tokens
        self.cached_tokens = event.cached_tokens
        self.stats = event.stats

    # --- reports ----------------------------------------------------------------------------------

    def usage(self, final: bool = True) -> dict[str, Any]:
        ttft = None if self.first_time is None else self.first_time - self.arrival
        rate = None
        decoded = self.completion_tokens - self.first_tokens
        if self.first_time is not None and self.last_time > self.first_time and decoded > 0:
            rate = decoded / (self.last_time - self.first_time)
        report = speculation_report(self.sub.is_speculative, self.stats, ttft, rate, self.sub.arm)
        if not final:  # live figures on every chunk: the counters only
            report = {k: report[k] for k in ("drafted_tokens", "accepted_tokens", "mean_accepted_length", "steps")}
        return usage(self.sub.prompt_tokens, self.completion_tokens, report, self.cached_tokens)

    def _chunk_usage(self) -> dict[str, Any] | None | bool:
        if self.req.continuous_usage:
            return self.usage(final=False)
        return None if self.req.include_usage else False

    # --- the two response forms -------------------------------------------------------------------

    @property
    def request_id(self) -> str:
        return self.sub.request_id

    async def text(self) -> str:
        """The whole completion. Raises EngineFailure when the engine fails the request."""
        return "".join([piece async for piece in self.pieces()])

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """This choice's stream chunks: role (chat), text, finish. Raises EngineFailure."""
        if self.shape.is_chat:
            yield self.shape.chunk("", role=True, usage=self._chunk_usage(), index=self.index)
        pieces = self.pieces()
        if self.req.tool_choice is not None:
            # A call is whole only at the end: it goes out as one delta then. Under "auto" a reply that does not
            # open with the call's tag is text (the grammar keeps the two apart by the first character), and
            # streams as text from there.
            held = ""
            async for text in pieces:
                held += text
                if self.req.tool_choice == "auto" and held and not held.startswith("<"):
                    break
            else:
                calls, reason = self.tool_calls(held)
                if calls:
                    yield self.shape.chunk(None, usage=self._chunk_usage(), index=self.index, tool_calls=calls,
                                           logprobs=self._new_logprobs())
                elif held:
                    yield self.shape.chunk(held, usage=self._chunk_usage(), index=self.index,
                                           logprobs=self._new_logprobs())
                yield self.shape.chunk(None, reason, usage=self._chunk_usage(), index=self.index)
                return
            yield self.shape.chunk(held, usage=self._chunk_usage(), index=self.index, logprobs=self._new_logprobs())
        async for text in pieces:
            logprobs = self._new_logprobs()
            if text or logprobs:
                yield self.shape.chunk(text, usage=self._chunk_usage(), index=self.index, logprobs=logprobs)
        yield self.shape.chunk(None, self.finish_reason, usage=self._chunk_usage(), index=self.index)

    def tool_calls(self, text: str) -> tuple[list[dict[str, Any]] | None, str | None]:
        """The choice's tool calls and finish reason: a call the grammar completed is "tool_calls"; output cut
        short (max_tokens) stays text with its own reason."""
        if self.req.tool_choice is None or self.finish_reason != "stop":
            return None, self.finish_reason
        calls = tool_calls(text, self.call_id, tagged=self.req.tool_choice == "auto")
        return calls, "tool_calls" if calls else self.finish_reason

    async def collect(self) -> dict[str, Any]:
        """The non-stream body. Raises ApiError when the engine fails the request."""
        return await _collect(self, [self])

    def stream(self) -> AsyncIterator[bytes]:
        """SSE bytes: role chunk (chat), text chunks, finish chunk, usage chunk, ``[DONE]``."""
        return _stream(self, self.chunks())

    def interrupt(self, reason: str) -> None:
        """Abort from the server's side: the engine's abort event then ends ``pieces`` with ``reason``."""
        if not self.is_done:
            self.interrupted = reason
            self.runner.abort(self.sub.request_id)

    def close(self, status: str = "499") -> None:
        """Abort the request if the engine still holds it; record request metrics once."""
        if self.is_closed:
            return
        self.is_closed = True
        if not self.is_done:
            self.runner.abort(self.sub.request_id)
        if self.on_close is not None:
            self.on_close()
        m, label = self.metrics, self.label
        m.requests.labels(self.route, status, label).inc()
        m.finished.labels(self.finish_reason or ("abort" if status == "499" else "error"), label).inc()
        m.prompt_tokens.labels(label).inc(self.sub.prompt_tokens)
        m.generation_tokens.labels(label).inc(self.completion_tokens)
        if self.last_time is not None:
            m.e2e.labels(label).observe(self.last_time - self.arrival)
        if self.runner.stats is not None:
            self.runner.stats.observe_request(self.sub.arm, status == "200")


class Choices:
    """A request with ``n > 1``: n Generations (one engine sequence each, seeds ``seed + i``) answered as one
    body with n choices or one SSE stream whose chunks carry each choice's index. Usage counts the prompt
    once and sums the completions; ``usage.speculation`` lists each choice's report. A failure of any
    choice fails the request and aborts the others; every exit closes all of them. The metrics count each
    choice as a request: each is one in the engine."""

    def __init__(self, gens: list[Generation]) -> None:
        self.gens = gens
        self.req, self.shape = gens[0].req, gens[0].shape

    @property
    def request_id(self) -> str:
        return self.shape.id

    @property
    def on_close(self) -> Callable[[], None] | None:
        return self.gens[0].on_close

    @on_close.setter
    def on_close(self, fn: Callable[[], None] | None) -> None:
        for g in self.gens:  # each choice holds one admission slot and gives it back once
            g.on_close = fn

    def usage(self) -> dict[str, Any]:
        """Each prompt counted once (choice 0 of each), completions summed over every sequence."""
        parts = [g.usage() for g in self.gens]
        first = [p for g, p in zip(self.gens, parts) if g.index % self.req.n == 0]
        return usage(sum(p["prompt_tokens"] for p in first), sum(p["completion_tokens"] for p in parts),
                     [p["speculation"] for p in parts], sum(p["prompt_tokens_details"]["cached_tokens"] for p in first))

    async def collect(self) -> dict[str, Any]:
        return await _collect(self, self.gens)

    def stream(self) -> AsyncIterator[bytes]:
        return _stream(self, _merged(self.gens))

    def interrupt(self, reason: str) -> None:
        for g in self.gens:
            g.interrupt(reason)

    def close(self, status: str = "499") -> None:
        for g in self.gens:
            g.close(status)


async def _merged(gens: list[Generation]) -> AsyncIterator[dict[str, Any]]:
    """Every choice's chunks, in the order they are ready. One task per choice feeds a queue; the first
    failure is raised here, and leaving (failure, cancellation, a closed stream) cancels the feeders."""
    queue: asyncio.Queue = asyncio.Queue()

    async def feed(g: Generation) -> None:
        try:
            async for chunk in g.chunks():
                await queue.put(chunk)
            await queue.put(None)
        except Exception as exc:  # noqa: BLE001 -- handed to the reader, which raises it
            await queue.put(exc)

    tasks = [asyncio.ensure_future(feed(g)) for g in gens]
    try:
        running = len(gens)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(owner: Generation | Choices, gens: list[Generation]) -> dict[str, Any]:
    """The non-stream body of ``owner`` (one Generation, or Choices over ``gens``)."""
    status = "499"  # stays if we are cancelled: the client went away
    tasks = [asyncio.ensure_future(g.text()) for g in gens]
    try:
        texts = await asyncio.gather(*tasks)
        status = "200"
        choices = []
        for t, g in zip(texts, gens):
            calls, reason = g.tool_calls(t)
            choices.append((t, reason, g.logprobs_report(), calls))
        return owner.shape.response(choices, owner.usage())
    except EngineFailure as exc:
        status = str(exc.status)
        raise ApiError(exc.status, f"generation failed: {exc}", type="server_error") from None
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        owner.close(status)


async def _stream(owner: Generation | Choices, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """SSE bytes of ``owner``: its ``chunks``, then the usage chunk (when asked for) and ``[DONE]``."""
    status = "499"
    try:
        async for chunk in chunks:
            yield sse(chunk)
        if owner.req.include_usage:
            yield sse(owner.shape.usage_chunk(owner.usage()))
        yield SSE_DONE
        status = "200"
    except EngineFailure as exc:
        status = str(exc.status)
        yield sse(error_body(f"generation failed: {exc}", "server_error"))
        yield SSE_DONE
    except Exception:  # noqa: BLE001 -- headers are sent: end the stream cleanly, keep the details in the log
        log.exception("stream of %s failed", owner.request_id)
        status = "500"
        yield sse(error_body("internal server error", "server_error"))
        yield SSE_DONE
    finally:
        await chunks.aclose()
        owner.close(status)


def echo_text(tokenizer: Decoder, prompt_ids: list[int]) -> tuple[str, list[int]]:
    """The prompt's text as the output's detokenizer writes text (special tokens skipped), and where each
    prompt token's text starts in it: one token at a time through ``TextAssembler``, so a window of
    neighbours decodes each piece, as for the output. One decode per token: the app runs it in a worker
    thread, as a long prompt would hold up every stream on the event loop."""
    assembler = TextAssembler(tokenizer, [])
    offsets = []
    for i, token in enumerate(prompt_ids):
        offsets.append(assembler.offset)
        assembler.feed([token], i == len(prompt_ids) - 1)
    return assembler.text, offsets
