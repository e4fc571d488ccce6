"""Helpers for the gateway tests: a tiny random engine, a tiny byte-level BPE tokenizer with a chat
template, the app over them, reached through httpx's ASGI transport or a live uvicorn on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn

from engine_util import tiny_engine
from gateway.app import ServerConfig, create_app
from gateway.engine import Engine
from tiny_tokenizer import make_tokenizer  # noqa: F401 -- the tests import it from here

MODEL = "tiny"
API_KEY = "test-key"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_app(tokenizer: Any, engine: Engine | None = None, **config: Any):
    engine = engine or tiny_engine(vocab=len(tokenizer), num_blocks=128)
    return create_app(engine, tokenizer, CHAT_TEMPLATE, ServerConfig(model_name=MODEL, warmup_tokens=2, **config))


def tiny_engine_process(fail: str | None = None, **engine_kw: Any) -> tuple[Engine, dict[str, Any]]:
    """An engine process's factory (gateway/engine_proc.py): make_app's engine and what the server needs besides.
    Module-level, so a ``functools.partial`` of it pickles into the spawned process. ``fail``: raise instead."""
    if fail is not None:
        raise RuntimeError(fail)
    refuse = engine_kw.pop("refuse", None)  # every add raises an exception that cannot be pickled, with this text
    tok = make_tokenizer()
    engine = tiny_engine(vocab=len(tok), num_blocks=engine_kw.pop("num_blocks", 128), **engine_kw)
    engine.tokenizer = tok
    if refuse is not None:
        class Unpicklable(Exception):  # a local class: pickle cannot name it
            pass

        def add(*args, **kw):
            raise Unpicklable(refuse)
        engine.add = add
    return engine, {"tokenizer": tok, "chat_template": CHAT_TEMPLATE, "model_name": MODEL, "device": "cpu"}


def make_process_app(runner, **config: Any):
    """The app over an engine process (``ProcessRunner``), configured as ``make_app``'s."""
    extras = runner.extras
    return create_app(None, extras["tokenizer"], extras["chat_template"],
                      ServerConfig(model_name=MODEL, warmup_tokens=2, **config), runner=runner)


@contextlib.asynccontextmanager
async def asgi_client(app) -> AsyncIterator[httpx.AsyncClient]:
    """The app's lifespan (runner thread, warm-up) around an in-process client; for finite responses only."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await wait_ready(client)
            yield client


def run_app(tokenizer: Any, fn, **app_kw: Any) -> Any:
    """Build an app on a tiny engine and run ``await fn(client, app)`` over httpx's ASGI transport."""
    async def main():
        app = make_app(tokenizer, **app_kw)
        async with asgi_client(app) as client:
            return await fn(client, app)

    return asyncio.run(main())


async def wait_ready(client: httpx.AsyncClient, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (await client.get("/health")).status_code != 200:
        assert time.monotonic() < deadline, "server never became ready"
        await asyncio.sleep(0.02)


class LiveServer:
    """uvicorn in a thread on a free port of 127.0.0.1; stops and joins cleanly on exit."""

    def __init__(self, app) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def engine(self) -> Engine:
        return self.app.state.gateway.engine

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self._ready():
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def _ready(self) -> bool:
        if not self.server.started:
            return False
        return httpx.get(self.url + "/health").status_code == 200

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
        assert not self.thread.is_alive(), "server did not stop"


def pool_is_full(engine: Engine) -> bool:
    pools = [engine.cache.pool] + [d.cache.pool for d in engine.drafters.values() if hasattr(d, "cache")]
    return all(p.num_free == p.num_blocks for p in pools)


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


class FaultyForward:
    """Wraps ``engine.target.forward``: ``arm(n)`` makes the next ``n`` calls raise, as a device fault would.
    Installed on the instance, so the engine and its tests stay unchanged."""

    MESSAGE = "injected fault at /opt/build/kernels/attention.cu:42"  # a path, which must not reach clients

    def __init__(self, engine: Engine) -> None:
        self.forward = engine.target.forward
        self.armed = 0
        self.fired = 0
        self._lock = threading.Lock()  # armed from the loop or a driver thread, fired on the engine thread
        engine.target.forward = self

    def arm(self, n: int = 1) -> None:
        with self._lock:
            self.armed += n

    def __call__(self, *args: Any, **kwargs: Any):
        with self._lock:
            fire = self.armed > 0
            if fire:
                self.armed -= 1
                self.fired += 1
        if fire:
            raise RuntimeError(self.MESSAGE)
        return self.forward(*args, **kwargs)
