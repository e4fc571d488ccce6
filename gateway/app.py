"""The Starlette app: OpenAI-compatible routes over one ``EngineRunner``.

Routes: POST /v1/completions, POST /v1/chat/completions (stream and non-stream), GET /v1/models,
GET /health (503 until warm-up has generated tokens, and while draining), GET /metrics (Prometheus text),
GET /openapi.json, and the live A/B view: GET /v1/stats (a JSON snapshot of ``gateway/stats.py`` and the
audit), GET /v1/stats/stream (the same snapshot as SSE every ``stats_interval_s``), POST /v1/stats/reset
(a new experiment), GET /dashboard (one self-contained page, gateway/static/dashboard.html).

With an API key, every route needs it except /health and the three read-only stats GETs (/dashboard,
/v1/stats, /v1/stats/stream): they serve aggregate figures only, never prompt or output text, and a
browser's EventSource cannot send an Authorization header. POST /v1/stats/reset always needs the key when
one is configured; without a key every route, reset included, is open (gateway/guard.py).
Admission: more than ``max_in_flight`` generation requests at once are refused with 429 before their
body is read, so a burst costs bounded memory; the engine's own queue bound is the second line.
How streams, disconnects and shutdown cancel one another: see ARCHITECTURE.md, "The server".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

import anyio
import orjson
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from draft.params import SpeculationParams
from gateway.audit import AuditConfig, Auditor
from gateway.detok import TokenText
from gateway.engine import Engine, QueueFull
from gateway.engine_proc import ProcessRunner
from gateway.generation import Choices, Generation, echo_text
from gateway.guard import ApiKeyMiddleware, read_body
from gateway.metrics import CONTENT_TYPE, Metrics, spec_label
from gateway.openapi import openapi_schema
from gateway.protocol import (AUTO_CALL, ApiError, GenerateRequest, Shape, error_body, parse_detokenize,
                              parse_request, parse_tokenize)
from gateway.runner import EngineRunner, ShuttingDown, Submission
from gateway.stats import StatsStore
from verify.sampling import SamplingParams

log = logging.getLogger("specgate.app")
PING_S = 15  # SSE comment pings keep idle proxies from closing a slow stream
SHUTDOWN_GRACE_S = 2.0  # for open streams to send their last event; below uvicorn's graceful timeout
# The dashboard loads nothing from elsewhere; the policy makes the browser enforce it.
DASHBOARD_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
                 "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


@dataclass(frozen=True, slots=True)
class CorsConfig:
    """Cross-origin access for browser clients (a chat frontend served from another origin): which origins
    may read the responses. No origins (the default): no CORS headers, and browsers keep other origins'
    pages from reading anything. Preflights are answered before the API key check, since browsers send
    them without credentials; every other request still needs the key."""

    origins: tuple[str, ...] = ()  # "scheme://host[:port]" as browsers send Origin, or "*" for any
    allow_credentials: bool = False  # cookies / HTTP auth on cross-origin requests (never with "*")

    def __post_init__(self) -> None:
        for origin in self.origins:
            if origin != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s]+", origin):
                raise ValueError(f"allowed origin {origin!r} is not one a browser sends: write scheme://host[:port] "
                                 "with no path or trailing slash (https://chat.example.com), or * for any")
        if self.allow_credentials and "*" in self.origins:
            raise ValueError("allowing credentials from any origin (*) is refused by browsers (the CORS spec): "
                             "name the origins")

    def middleware(self) -> list[Middleware]:
        if not self.origins:
            return []
        return [Middleware(CORSMiddleware, allow_origins=list(self.origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], allow_credentials=self.allow_credentials,
                           expose_headers=["X-Request-Id", "Retry-After"], max_age=600)]


@dataclass(frozen=True, slots=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None  # None = no authentication
    warmup_tokens: int = 4  # generated with speculation on and off before /health says ready
    retry_after_s: int = 1  # Retry-After on 429 / 503
    device: str = "cpu"  # reported by /health, for benchmark records
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    max_in_flight: int | None = None  # generation requests at once; None = the engine's max_running + max_waiting
    log_prompts: bool = False  # put prompt text in the request log line (off: prompts may be private)
    audit: AuditConfig = AuditConfig()  # the online losslessness audit (off by default)
    stats_interval_s: float = 1.0  # how often /v1/stats/stream pushes a snapshot
    cors: CorsConfig = CorsConfig()  # browser clients on other origins (off by default)


def json_response(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status, headers, media_type="application/json")


def error_response(exc: ApiError) -> Response:
    return json_response(exc.body(), exc.status, exc.headers)


class Gateway:
    """The routes' state: one runner, one tokenizer, one metrics registry, one stats store, one auditor."""

    def __init__(self, engine: Engine | None, tokenizer: Any, chat_template: str | None, config: ServerConfig,
                 runner: ProcessRunner | None = None) -> None:
        """``engine``, stepped by a thread of this process; or ``runner``, an engine in a process of its own
        (gateway/engine_proc.py), whose ``EngineInfo`` stands in for the engine here."""
        if runner is not None:
            if config.audit.fraction > 0:
                raise ValueError("the audit replays requests in the engine's thread: it needs the engine in the "
                                 "server's process (no engine process)")
            engine = runner.engine
        self.engine, self.tokenizer, self.chat_template, self.config = engine, tokenizer, chat_template, config
        self.token_text = TokenText(tokenizer) if tokenizer is not None else None  # logprobs' token strings
        if engine.tokenizer is None:  # an engine built without one (tests): structured output walks this one
            engine.tokenizer = tokenizer
        self.metrics = Metrics()
        self.stats = StatsStore()
        self.auditor = Auditor(config.audit, decode=tokenizer.decode if tokenizer is not None else None,
                               metrics=self.metrics)
        if runner is not None:
            runner.attach(self.metrics, self.stats)
        self.runner = runner if runner is not None else EngineRunner(engine, self.metrics, self.stats, self.auditor)
        self.max_model_len = engine.max_model_len  # a constant: safe to read off the engine thread
        self.is_ready = False
        self.is_draining = False  # set on SIGTERM: new generation requests get 503
        self.warmup_error: str | None = None
        sched = engine.config.scheduler
        self.max_in_flight = config.max_in_flight or sched.max_running + sched.max_waiting
        self.in_flight = 0  # event loop only: generation requests between arrival and response end

    # --- lifecycle --------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.runner.start(asyncio.get_running_loop())
        warm = asyncio.create_task(self.warm_up())
        try:
            yield
        finally:
            warm.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await warm
            await asyncio.to_thread(self.runner.shutdown)  # the join waits out the current step

    def drain(self) -> None:
        """Refuse new generation requests (503) while open ones finish; safe from a signal handler."""
        self.is_draining = True

    async def warm_up(self) -> None:
        """Generate a few tokens with speculation on and off so first requests hit a warm engine: a batch of
        prompts of several lengths each way, so that the eager prefill steps compile their kernel variants
        (a second or more each, on first use) before /health says ready rather than in a user's stream."""
        try:
            ids = self._encode_chat([{"role": "user", "content": "Hello"}]) if self.chat_template else [0]
            sampling = SamplingParams(temperature=0, max_tokens=self.config.warmup_tokens, ignore_eos=True)
            pool = self.engine.config.num_blocks * self.engine.config.page_size
            room = min(self.max_model_len, pool // 2) - self.config.warmup_tokens - 1  # small test pools too
            prompts = [(ids * -(-n // len(ids)))[:n] for n in (len(ids), 24, 48, 100, 200) if n <= room]
            for enabled in (True, False):
                subs = [await self.runner.submit(f"warmup-{uuid.uuid4().hex}", p, sampling,
                                                 SpeculationParams(enabled=enabled), record=False) for p in prompts]
                for sub in subs:
                    while not (event := await sub.events.get()).finished:
                        pass
                    if event.error:
                        raise RuntimeError(event.error)
        except Exception as exc:  # noqa: BLE001 -- reported by /health, the server stays up to say so
            self.warmup_error = f"{type(exc).__name__}: {exc}"
            log.error("warm-up failed: %s", self.warmup_error)
            return
        self.is_ready = True
        log.info("warm-up done: ready")

    # --- routes -----------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        is_healthy = getattr(self.engine, "healthy", True)  # False once the target lost a rank: restart it
        if self.is_draining:
            return json_response({"status": "draining"}, 503)
        if self.is_ready and is_healthy:
            return json_response({"status": "ready", "model": self.config.model_name, "device": self.config.device})
        status = f"warm-up failed: {self.warmup_error}" if self.warmup_error else "warming up"
        status = status if is_healthy else "engine failed: restart the server"
        return json_response({"status": status}, 503, {"Retry-After": str(self.config.retry_after_s)})

    async def metrics_route(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # --- the live A/B view ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        return self.stats.snapshot() | {"model": self.config.model_name, "audit": self.auditor.snapshot()}

    async def stats_route(self, request: Request) -> Response:
        return json_response(self.snapshot())

    async def stats_stream(self, request: Request) -> Response:
        async def snapshots() -> AsyncIterator[dict[str, str]]:
            while True:
                yield {"data": orjson.dumps(self.snapshot()).decode()}
                await asyncio.sleep(self.config.stats_interval_s)

        return EventSourceResponse(snapshots(), ping=PING_S, sep="\n")

    async def stats_reset(self, request: Request) -> Response:
        self.stats.reset()
        self.auditor.reset()
        log.info("stats reset: a new experiment starts")
        return json_response({"status": "reset"})

    async def dashboard(self, request: Request) -> Response:
        return Response(DASHBOARD_HTML, media_type="text/html; charset=utf-8",
                        headers={"Content-Security-Policy": DASHBOARD_CSP, "Cache-Control": "no-cache"})

    async def openapi(self, request: Request) -> Response:
        return json_response(openapi_schema(self.config.model_name, self.max_model_len, self.config.max_body_bytes))

    async def models(self, request: Request) -> Response:
        cfg = self.engine.config
        card = {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "specgate",
                "max_model_len": self.max_model_len,
                "speculation": {"drafters": sorted(self.engine.drafters), "default_drafter": cfg.default_drafter,
                                "default_tree": list(cfg.default_tree), "batch_invariant": bool(cfg.batch_invariant)}}
        return json_response({"object": "list", "data": [card]})

    # --- the tokenizer (vLLM's routes: lm-eval's remote tokenizer uses them) ---------------------------

    async def tokenize(self, request: Request) -> Response:
        try:
            raw = await read_body(request.headers.get("content-length"), request.stream(), self.config.max_body_bytes)
            text, messages, flag = parse_tokenize(raw)
            if messages is not None:
                tokens = self._encode_chat(messages, add_generation_prompt=flag)
            else:
                tokens = self.tokenizer.encode(text, add_special_tokens=flag)
        except ApiError as exc:
            return error_response(exc)
        return json_response({"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        try:
            raw = await read_body(request.headers.get("content-length"), request.stream(), self.config.max_body_bytes)
            tokens = parse_detokenize(raw, self.engine.target.config.vocab_size)
        except ApiError as exc:
            return error_response(exc)
        return json_response({"prompt": self.tokenizer.decode(tokens)})

    async def tokenizer_info(self, request: Request) -> Response:
        tok = self.tokenizer
        specials = {name: getattr(tok, name, None) for name in ("eos_token", "bos_token", "pad_token")}
        return json_response({"tokenizer_class": type(tok).__name__, **specials, "chat_template": self.chat_template,
                              "model_max_length": self.max_model_len})

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, is_chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, is_chat=False)

    # --- generation -------------------------------------------------------------------------------

    async def _generate(self, request: Request, is_chat: bool) -> Response:
        arrival = time.monotonic()
        route = request.url.path
        label = "unknown"
        gen = None
        held = 1  # admission slots: one per choice, each given back when its Generation closes
        self.in_flight += 1
        try:
            self._admit()
            raw = await read_body(request.headers.get("content-length"), request.stream(), self.config.max_body_bytes)
            req = parse_request(raw, is_chat, request.headers.get("x-speculation"))
            label = spec_label(req.speculation.enabled)
            if req.num_sequences > 1:  # every sequence takes a slot: admit the whole request or none of it
                self.in_flight += req.num_sequences - 1
                held = req.num_sequences
                self._admit()
            gen = await self._start(req, route, arrival)
        except ApiError as exc:
            self.metrics.requests.labels(route, str(exc.status), label).inc()
            return error_response(exc)
        finally:
            if gen is None:  # refused or cancelled before the Generations took over the slots
                self.in_flight -= held
        gen.on_close = self._release
        headers = {"X-Request-Id": gen.request_id}
        if req.stream:
            return _event_source(gen, headers)
        body = await self._collect_watching(request, gen)
        if body is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        if isinstance(body, ApiError):
            return error_response(body)
        return json_response(body, headers=headers)

    def _admit(self) -> None:
        retry = {"Retry-After": str(self.config.retry_after_s)}
        if self.is_draining:
            raise ApiError(503, "the server is shutting down", type="server_error", headers=retry)
        if self.in_flight > self.max_in_flight:
            raise ApiError(429, f"the server is at capacity ({self.max_in_flight} requests in flight); retry later",
                           code="queue_full", type="rate_limit_error", headers=retry)

    def _release(self) -> None:
        self.in_flight -= 1

    async def _start(self, req: GenerateRequest, route: str, arrival: float) -> Generation | Choices:
        if req.max_tokens is not None and req.max_tokens > self.max_model_len:
            raise ApiError(400, f"max_tokens must be <= {self.max_model_len} (the context), got {req.max_tokens}",
                           param="max_tokens")
        if req.model is not None and req.model != self.config.model_name:
            raise ApiError(404, f"model {req.model!r} does not exist: this server serves {self.config.model_name!r}",
                           param="model", code="model_not_found")
        prompts = ([self._encode_chat(req.messages, tools=req.tools, tool_choice=req.tool_choice)] if req.is_chat
                   else [self._encode(p) for p in req.prompts])
        if req.truncate_prompt_tokens is not None:
            keep = req.truncate_prompt_tokens
            if keep == -1:  # as many as fit: the context less the tokens asked for (one, when none are)
                keep = self.max_model_len - (req.max_tokens or 1)
            prompts = [p[-keep:] if keep > 0 else p for p in prompts]
        echoes: list[tuple[str, list[int]] | None] = [None] * len(prompts)
        if req.echo:  # before anything is submitted: nothing to take back if the client leaves meanwhile
            echoes = list(await asyncio.gather(*(asyncio.to_thread(echo_text, self.tokenizer, p) for p in prompts)))
        request_id = ("chatcmpl-" if req.is_chat else "cmpl-") + uuid.uuid4().hex
        for prompt_ids in prompts:
            self._log_request(request_id, req, prompt_ids)
        shape = Shape(req.is_chat, request_id, int(time.time()), self.config.model_name)
        # Sequence i (prompt i // n, choice i % n) is engine request "<id>-<i>" when there are several. Choices
        # 1.. of a prompt reuse choice 0's prompt KV, unless they score the prompt (echo with logprobs).
        total = len(prompts) * req.n
        share = req.sampling.get("prompt_logprobs") is None
        subs: list[tuple[Submission, list[int]]] = []
        try:  # a refusal takes back the sequences already in
            for i in range(total):
                prompt_ids = prompts[i // req.n]
                engine_id = request_id if total == 1 else f"{request_id}-{i}"
                leader = f"{request_id}-{i - i % req.n}" if i % req.n and share else None
                sampling = req.sampling_params(self.max_model_len - len(prompt_ids), i % req.n)
                subs.append((await self._submit(engine_id, prompt_ids, sampling, req, prefix_of=leader), prompt_ids))
        except BaseException:
            for sub, _ in subs:
                self.runner.abort(sub.request_id)
            raise
        gens = [Generation(self.runner, sub, req, shape, self.tokenizer, prompt_ids, arrival, self.metrics, route,
                           index=i, token_text=self.token_text, echo=echoes[i // req.n])
                for i, (sub, prompt_ids) in enumerate(subs)]
        return gens[0] if total == 1 else Choices(gens)

    async def _submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                      req: GenerateRequest, prefix_of: str | None = None) -> Submission:
        retry = {"Retry-After": str(self.config.retry_after_s)}
        try:
            return await self.runner.submit(request_id, prompt_ids, sampling, req.speculation, prefix_of=prefix_of,
                                            priority=req.priority)
        except QueueFull as exc:
            raise ApiError(429, f"the server is at capacity ({exc}); retry later", code="queue_full",
                           type="rate_limit_error", headers=retry) from None
        except ShuttingDown as exc:
            raise ApiError(503, str(exc), type="server_error", headers=retry) from None
        except ValueError as exc:
            raise _engine_refusal(str(exc), req.is_chat) from None

    async def _collect_watching(self, request: Request, gen: Generation | Choices) -> dict[str, Any] | ApiError | None:
        """Collect a non-stream body, cancelling it if the client disconnects first (which aborts it)."""
        collect = asyncio.ensure_future(gen.collect())
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (watch, collect):
                if not task.done():
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.gather(task, return_exceptions=True)
        if collect.cancelled():
            return None
        exc = collect.exception()
        if isinstance(exc, ApiError):
            return exc
        if exc is not None:
            raise exc
        return collect.result()

    def _encode(self, prompt: str | list[int]) -> list[int]:
        return prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt)

    def _encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                     tools: tuple[dict[str, Any], ...] = (), tool_choice: str | None = None) -> list[int]:
        """The chat template over the messages. Tools go to a template that takes them (``tools`` in its
        text); for one that does not, they are described in a system turn, as the JSON a call is written in."""
        if not self.chat_template:
            raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages")
        extra: dict[str, Any] = {}
        if tools and "tools" in self.chat_template:
            extra["tools"] = list(tools)
        elif tools:
            messages = _with_tools_turn(messages, tools, tool_choice)
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      chat_template=self.chat_template, **extra)
        except Exception as exc:  # noqa: BLE001 -- templates raise their own errors on unsupported turns
            raise ApiError(400, f"messages do not fit the chat template: {exc}", param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _log_request(self, request_id: str, req: GenerateRequest, prompt_ids: list[int]) -> None:
        """One line per admitted request; prompt text only with ``log_prompts`` (prompts may be private)."""
        if not log.isEnabledFor(logging.INFO):
            return
        text = ""
        if self.config.log_prompts:
            text = f" prompt={orjson.dumps(req.messages if req.is_chat else prompt_ids).decode()}"
        log.info("%s: %d prompt tokens, max_tokens=%s, stream=%s, speculation=%s%s", request_id, len(prompt_ids),
                 req.max_tokens, req.stream, spec_label(req.speculation.enabled), text)


def _event_source(gen: Generation | Choices, headers: dict[str, str]) -> EventSourceResponse:
    """SSE for one generation. sse-starlette runs the stream, the disconnect listener and the shutdown
    listener as sibling tasks; whichever ends first cancels the others. On shutdown it sets ``shutdown``
    and waits a grace period: ``interrupt`` aborts the request so the stream ends itself with an error
    event and ``[DONE]`` instead of a cut connection. ``gen.close`` (also the stream's ``finally``)
    aborts a request whose client went away."""
    shutdown = anyio.Event()

    async def on_shutdown() -> None:
        await shutdown.wait()
        gen.interrupt("the server is shutting down")

    return EventSourceResponse(gen.stream(), headers=headers, ping=PING_S, sep="\n",
                               background=BackgroundTask(gen.close), data_sender_callable=on_shutdown,
                               shutdown_event=shutdown, shutdown_grace_period=SHUTDOWN_GRACE_S)


def _with_tools_turn(messages: list[dict[str, str]], tools: tuple[dict[str, Any], ...],
                     choice: str | None) -> list[dict[str, str]]:
    """The messages with the tools described at the end of the system turn (one is added when there is none),
    and how a call is written: bare JSON when a call is required, between ``AUTO_CALL``'s tags when the
    model may choose."""
    call = '{"name": <function name>, "arguments": <its arguments>}'
    if choice == "auto":
        open_tag, close_tag = AUTO_CALL
        how = f"To call one, reply with {open_tag}{call}{close_tag} and nothing else; otherwise reply as usual."
    else:
        how = f"A call is one JSON object: {call}."
    lines = [f"You can call these functions. {how}"]
    for t in tools:
        fn = t["function"]
        card = {"name": fn["name"]} | ({"description": fn["description"]} if fn.get("description") else {})
        lines.append(orjson.dumps(card | {"parameters": fn.get("parameters", {"type": "object"})}).decode())
    text = "\n".join(lines)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _engine_refusal(message: str, is_chat: bool) -> ApiError:
    """Engine.add's ValueError as a 400 naming the field."""
    if "drafter" in message:
        return ApiError(400, message, param="speculation.drafter")
    field = message.split(" ", 1)[0]  # the engine names a sampling field first
    if field in ("logit_bias", "allowed_token_ids", "min_tokens"):
        return ApiError(400, message, param=field)
    code = "context_length_exceeded" if "context" in message or "KV pool" in message else None
    return ApiError(400, message, param="messages" if is_chat else "prompt", code=code)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away. The body is already read, so the next message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return json_response(error_body(str(exc.detail), kind), exc.status_code)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return json_response(error_body("internal server error", "server_error"), 500)


DASHBOARD_HTML = resources.files("gateway").joinpath("static/dashboard.html").read_bytes()


def create_app(engine: Engine | None, tokenizer: Any, chat_template: str | None, config: ServerConfig,
               runner: ProcessRunner | None = None) -> Starlette:
    """The ASGI app over ``engine`` (stepped by the app's engine thread: nobody else may step it once the
    lifespan starts) or over ``runner``, an engine in its own process (gateway/engine_proc.py)."""
    gw = Gateway(engine, tokenizer, chat_template, config, runner)
    routes = [
        Route("/v1/chat/completions", gw.chat, methods=["POST"]),
        Route("/v1/completions", gw.completions, methods=["POST"]),
        Route("/v1/models", gw.models, methods=["GET"]),
        Route("/tokenize", gw.tokenize, methods=["POST"]),
        Route("/detokenize", gw.detokenize, methods=["POST"]),
        Route("/tokenizer_info", gw.tokenizer_info, methods=["GET"]),
        Route("/health", gw.health, methods=["GET"]),
        Route("/metrics", gw.metrics_route, methods=["GET"]),
        Route("/openapi.json", gw.openapi, methods=["GET"]),
        Route("/v1/stats", gw.stats_route, methods=["GET"]),
        Route("/v1/stats/stream", gw.stats_stream, methods=["GET"]),
        Route("/v1/stats/reset", gw.stats_reset, methods=["POST"]),
        Route("/dashboard", gw.dashboard, methods=["GET"]),
    ]
    # CORS outermost: a browser's preflight carries no credentials, and a refused request's 401 must still
    # carry the CORS headers for the page to read why
    middleware = config.cors.middleware()
    if config.api_key is not None:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=config.api_key))
    app = Starlette(routes=routes, lifespan=gw.lifespan, middleware=middleware,
                    exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.gateway = gw
    return app
