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


ORIGIN = "https://chat.example.com"


def test_cors_lets_a_named_origin_read_answers_and_keeps_the_key(tokenizer) -> None:
    """A browser page on an allowed origin: its preflight is answered without the key; its requests still need
    the key, and every answer, a 401 and a stream included, names the origin so the page can read it. Other
    origins get no CORS headers, and a preflight from one is refused."""
    from gateway.app import CorsConfig

    async def fn(client, app):
        pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}
        out = {"preflight": await client.options("/v1/chat/completions", headers=pre),
               "preflight_other": await client.options("/v1/chat/completions",
                                                       headers=pre | {"Origin": "https://evil.example"}),
               "no_key": await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": ORIGIN}),
               "other": await client.post("/v1/chat/completions", json=CHAT,
                                          headers=AUTH | {"Origin": "https://evil.example"})}
        async with client.stream("POST", "/v1/chat/completions", json=CHAT | {"stream": True},
                                 headers=AUTH | {"Origin": ORIGIN}) as r:
            out["stream"], out["stream_body"] = r, (await r.aread()).decode()
        return out

    out = run(tokenizer, fn, api_key=API_KEY, cors=CorsConfig((ORIGIN,)))
    pre = out["preflight"]
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "x-stainless-os" in pre.headers["access-control-allow-headers"]  # SDKs' own headers pass
    assert out["preflight_other"].status_code == 400
    assert "access-control-allow-origin" not in out["preflight_other"].headers
    assert out["no_key"].status_code == 401 and out["no_key"].headers["access-control-allow-origin"] == ORIGIN
    assert out["other"].status_code == 200 and "access-control-allow-origin" not in out["other"].headers
    s = out["stream"]
    assert s.status_code == 200 and s.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in s.headers["access-control-expose-headers"].lower()
    assert s.headers["content-type"].startswith("text/event-stream") and "data: [DONE]" in out["stream_body"]


def test_no_cors_headers_unless_origins_are_named(tokenizer) -> None:
    async def fn(client, app):
        return (await client.post("/v1/chat/completions", json=CHAT, headers={"Origin": ORIGIN}),
                await client.options("/v1/chat/completions", headers={"Origin": ORIGIN,
                                                                      "Access-Control-Request-Method": "POST"}))

    post, pre = run(tokenizer, fn)
    assert post.status_code == 200 and "access-control-allow-origin" not in post.headers
    assert pre.status_code == 405 and "access-control-allow-origin" not in pre.headers


@pytest.mark.parametrize("origins, credentials, message", [
    (("https://chat.example.com/",), False, "no path or trailing slash"),
    (("chat.example.com",), False, "scheme://host"),
    (("*",), True, "name the origins"),
])
def test_cors_settings_a_browser_would_never_match_are_refused(origins, credentials, message, capsys) -> None:
    from gateway.app import CorsConfig
    from gateway.cli import main

    with pytest.raises(ValueError, match=message):
        CorsConfig(origins, credentials)
    argv = ["serve", "--model", "none-such", "--allowed-origins", *origins]
    argv += ["--allow-credentials"] if credentials else []
    assert main(argv) == 2  # refused before any model is loaded
    assert message in capsys.readouterr().err


def test_cors_wildcard_without_credentials() -> None:
    from gateway.app import CorsConfig

    args = serve_options().parse_args(["--allowed-origins", "*", "http://localhost:5173"])
    assert CorsConfig(tuple(args.allowed_origins), args.allow_credentials).origins == ("*", "http://localhost:5173")
