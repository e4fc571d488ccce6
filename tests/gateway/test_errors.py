"""One test per error class: OpenAI's error shape, the status, the field named, no stack trace, and a
server that keeps serving afterwards."""

from __future__ import annotations

import asyncio

import pytest

from gateway.engine import QueueFull
from gateway_util import API_KEY, MODEL, asgi_client, make_app

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}


def post(tokenizer, body, path: str = "/v1/chat/completions", headers=None, prepare=None, **app_kw):
    """POST ``body`` (bytes or JSON), then check a normal request still succeeds. Returns the first response."""

    async def main():
        app = make_app(tokenizer, **app_kw)
        async with asgi_client(app) as client:
            if prepare is not None:
                prepare(app.state.gateway.engine)
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = await client.post(path, headers=headers, **kw)
            if prepare is not None:
                prepare(None)
            ok = await client.post("/v1/chat/completions", json=CHAT,
                                   headers={"Authorization": f"Bearer {API_KEY}"})
            assert ok.status_code == 200, ok.text
            return r

    return asyncio.run(main())


def check(r, status: int, param: str | None, *words: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert "Traceback" not in r.text and 'File "' not in r.text
    for w in words:
        assert w in err["message"], err["message"]
    return err


def test_malformed_json(tokenizer) -> None:
    check(post(tokenizer, b'{"model": "tiny", "messages": ['), 400, None, "not valid JSON")
    check(post(tokenizer, b"[1, 2]"), 400, None, "JSON object")


@pytest.mark.parametrize("field, value, param", [
    ("max_tokens", "ten", "max_tokens"),
    ("temperature", True, "temperature"),
    ("stream", "yes", "stream"),
    ("min_tokens", 1.5, "min_tokens"),
    ("include_stop_str_in_output", 1, "include_stop_str_in_output"),
    ("skip_special_tokens", "no", "skip_special_tokens"),
    ("messages", "Hi", "messages"),
    ("stop", [1, 2], "stop"),
    ("speculation", {"enabled": "no"}, "speculation.enabled"),
    ("priority", 1.5, "priority"),
])
def test_wrong_types_name_the_field(tokenizer, field, value, param) -> None:
    check(post(tokenizer, CHAT | {field: value}), 400, param, param.split(".")[-1])


@pytest.mark.parametrize("field, value, param", [
    ("max_tokens", 0, "max_tokens"),
    ("temperature", -1, "temperature"),
    ("top_p", 1.5, "top_p"),
    ("presence_penalty", 3, "presence_penalty"),
    ("seed", 2**70, "seed"),
    ("speculation", {"max_nodes": 999}, "speculation.max_nodes"),
    ("speculation", {"tree": [2, 0]}, "speculation.tree"),
    ("speculation", {"drafter": "nope"}, "speculation.drafter"),
    ("speculation", {"depth": 3}, "speculation.depth"),
    ("stop", [str(i) for i in range(17)], "stop"),
    ("stop", ["x" * 257], "stop"),
    ("stop_token_ids", list(range(65)), "stop_token_ids"),
    ("repetition_penalty", 1e-300, "repetition_penalty"),
    ("max_tokens", 10**6, "max_tokens"),
    ("min_tokens", 5, "min_tokens"),  # above max_tokens (4)
    ("min_tokens", -1, "min_tokens"),
    ("priority", -10**7, "priority"),
])
def test_out_of_range_values_name_the_field(tokenizer, field, value, param) -> None:
    check(post(tokenizer, CHAT | {field: value}), 400, param)


def test_bad_speculation_header(tokenizer) -> None:
    check(post(tokenizer, CHAT, headers={"X-Speculation": "maybe"}), 400, "X-Speculation")


def test_unknown_model_is_404(tokenizer) -> None:
    err = check(post(tokenizer, CHAT | {"model": "gpt-9"}), 404, "model", "gpt-9")
    assert err["code"] == "model_not_found"


def test_prompt_too_long_is_400(tokenizer) -> None:
    r = post(tokenizer, {"model": MODEL, "prompt": [5] * 600}, path="/v1/completions")
    assert check(r, 400, "prompt", "context")["code"] == "context_length_exceeded"


@pytest.mark.parametrize("field, value", [("functions", [{}]), ("echo", True), ("prompt_logprobs", 1),
                                          ("use_beam_search", True)])
def test_unsupported_features_are_refused(tokenizer, field, value) -> None:
    check(post(tokenizer, CHAT | {field: value}), 400, field, "not supported")


@pytest.mark.parametrize("body, path, param, words", [
    ({"top_logprobs": 2}, "/v1/chat/completions", "top_logprobs", ("logprobs: true",)),
    ({"logprobs": 1}, "/v1/chat/completions", "logprobs", ("boolean",)),
    ({"logprobs": True}, "/v1/completions", "logprobs", ("integer",)),
    ({"logprobs": 2, "top_logprobs": 2}, "/v1/completions", "top_logprobs", ("chat",)),
    ({"logit_bias": {"a": 1}}, "/v1/chat/completions", "logit_bias", ("token ids",)),
    ({"logit_bias": {"3": True}}, "/v1/chat/completions", "logit_bias", ("[-100, 100]",)),
    ({"tools": [{}]}, "/v1/chat/completions", "tools[0]", ("function",)),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "/v1/chat/completions", "tools[0]", ("name",)),
    ({"tool_choice": "required"}, "/v1/chat/completions", "tool_choice", ("needs tools",)),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"}, "/v1/chat/completions",
     "tool_choice", ("none, auto, required",)),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "/v1/chat/completions", "tool_choice", ("f",)),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "/v1/chat/completions", "tool_choice", ("not both",)),
])
def test_bad_logprobs_and_logit_bias_name_the_field(tokenizer, body, path, param, words) -> None:
    base = CHAT if path == "/v1/chat/completions" else {"model": MODEL, "prompt": "Hi"}
    check(post(tokenizer, base | body, path=path), 400, param, *words)


@pytest.mark.parametrize("body, param, words", [({"n": 0}, "n", ("between 1 and 16", "0")),
                                                 ({"n": 17}, "n", ("17",)),
                                                 ({"n": 2, "best_of": 3}, "best_of", ("equal n",))])
def test_choices_out_of_range_are_refused(tokenizer, body, param, words) -> None:
    check(post(tokenizer, CHAT | body), 400, param, *words)


def test_queue_full_is_429_with_retry_after(tokenizer) -> None:
    def prepare(engine):
        if engine is None:
            return
        real = engine.add

        def full(*a, **k):
            engine.add = real  # one refusal, then the check request is served
            raise QueueFull("256 requests are waiting")

        engine.add = full

    r = post(tokenizer, CHAT, prepare=prepare)
    check(r, 429, None, "capacity")
    assert r.headers["retry-after"] == "1"


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_fails_the_request_not_the_server(tokenizer, stream: bool) -> None:
    saved = {}

    def prepare(engine):
        if engine is not None:
            saved["engine"], saved["forward"] = engine, engine.target.forward
            engine.target.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device fell over"))
        else:
            saved["engine"].target.forward = saved["forward"]

    r = post(tokenizer, CHAT | {"stream": stream}, prepare=prepare)
    if not stream:
        check(r, 500, None, "device fell over")
        return
    assert r.status_code == 200  # the stream had started; the error arrives as an event
    assert '"error":{"message":"generation failed: RuntimeError: device fell over"' in r.text
    assert r.text.endswith("data: [DONE]\n\n") and "Traceback" not in r.text


def test_missing_or_wrong_api_key_is_401(tokenizer) -> None:
    check(post(tokenizer, CHAT, api_key=API_KEY), 401, None, "API key")
    r = post(tokenizer, CHAT, headers={"Authorization": "Bearer wrong"}, api_key=API_KEY)
    assert check(r, 401, None)["code"] == "invalid_api_key"


def test_unknown_route_is_404_in_openai_shape(tokenizer) -> None:
    check(post(tokenizer, CHAT, path="/v1/embeddings"), 404, None)
