"""Security: the API key on every route but /health (compared in constant time), the body size limit,
no stack traces or file paths in answers, a loopback default bind, no prompt text in logs unless asked."""

from __future__ import annotations

import logging

import pytest

from gateway import guard
from gateway.cli import serve_options
from gateway_util import API_KEY, MODEL, FaultyForward, run_app as run

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
ROUTES = [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/v1/nothing"),
          ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")]


def test_api_key_guards_every_route_but_health(tokenizer, monkeypatch) -> None:
    compared = []
    real = guard.hmac.compare_digest
    monkeypatch.setattr(guard.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))

    async def fn(client, app):
        out = {}
        for method, path in ROUTES:
            for name, headers in (("none", {}), ("wrong", {"Authorization": "Bearer nope"}),
                                  ("bare", {"Authorization": API_KEY}), ("good", AUTH)):
                body = CHAT | {"prompt": "Hi"} if path == "/v1/completions" else CHAT
                r = await client.request(method, path, headers=headers, json=body)
                out[path, name] = r
        out["/health", "none"] = await client.get("/health")
        return out

    out = run(tokenizer, fn, api_key=API_KEY)
    for (path, name), r in out.items():
        if path == "/health":
            assert r.status_code == 200
        elif name == "good":
            assert r.status_code == (404 if path == "/v1/nothing" else 200), (path, r.text)
        else:
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, name)
            assert r.headers["www-authenticate"] == "Bearer"
    assert compared  # every check went through hmac.compare_digest


def test_body_size_limit_is_413_in_openai_shape(tokenizer) -> None:
    big = b'{"model": "tiny", "prompt": "' + b"a" * 2000 + b'"}'

    async def chunks():
        for i in range(0, len(big), 100):  # no Content-Length: refused while it arrives
            yield big[i : i + 100]

    async def fn(client, app):
        declared = await client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        streamed = await client.post("/v1/completions", content=chunks())
        small = await client.post("/v1/chat/completions", json=CHAT)
        return declared, streamed, small

    for r in run(tokenizer, fn, max_body_bytes=1000)[:2]:
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert run(tokenizer, fn, max_body_bytes=1000)[2].status_code == 200


def test_engine_errors_reach_clients_without_paths_or_traces(tokenizer) -> None:
    async def fn(client, app):
        faults = FaultyForward(app.state.gateway.engine)
        faults.arm(2)
        return [await client.post("/v1/chat/completions", json=CHAT | {"stream": s}) for s in (False, True)]

    for r in run(tokenizer, fn):
        assert "injected fault at <path>" in r.text
        assert "/opt/build" not in r.text and "Traceback" not in r.text and ".cu" not in r.text


def test_serve_binds_to_loopback_by_default() -> None:
    args = serve_options().parse_args([])
    assert args.host == "127.0.0.1" and args.api_key is None and args.max_body_bytes == 1 << 20
    assert not args.log_prompts


@pytest.mark.parametrize("log_prompts", [False, True])
def test_logs_hold_prompt_text_only_when_asked(tokenizer, caplog, log_prompts: bool) -> None:
    secret = "my-secret-prompt-text"

    async def fn(client, app):
        await client.post("/v1/chat/completions", json=CHAT | {"messages": [{"role": "user", "content": secret}]})
        await client.post("/v1/completions", json={"model": MODEL, "prompt": secret, "max_tokens": 2})

    with caplog.at_level(logging.DEBUG):
        run(tokenizer, fn, log_prompts=log_prompts)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "prompt tokens" in text
    assert (secret in text) == log_prompts
