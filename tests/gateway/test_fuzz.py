"""Fuzzing both POST routes: hypothesis-built bodies (wrong types, unknown fields, huge numbers, broken
bytes) and a list of named nasties. Every answer is 2xx or 4xx in OpenAI's error shape, within a time
bound, with no stack trace; afterwards the KV pools are whole. The engine has a 64-token context so any
accepted request is short. Also: the published OpenAPI schema is truthful at its bounds."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_util import tiny_engine
from gateway.protocol import MAX_STOP_STRINGS
from gateway_util import MODEL, asgi_client, make_app, pool_is_full, wait_until

CONTEXT = 64
ROUTES = ("/v1/completions", "/v1/chat/completions")
ANSWER_S = 20.0  # far above any accepted request here: 64 tokens of a tiny model
FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stream",
          "stream_options", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "ignore_eos", "n", "best_of", "logprobs", "top_logprobs", "logit_bias", "speculation", "response_format",
          "echo", "suffix", "tools", "user", "min_p", "structured_outputs", "prompt_logprobs", "tool_choice",
          "min_tokens", "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens",
          "allowed_token_ids"]
HUGE = [1e308, -1e308, 5e-324, 2**63, 2**64, 2**70, -(2**70), 10**30, 0, -1, 1, 0.5]


@pytest.fixture(scope="module", params=[False, True], ids=["", "overlap"])
def served(tokenizer, request) -> Iterator[tuple[asyncio.Runner, Any, Any]]:
    """One app and client per engine mode (steps one by one; plain steps overlapped: gateway/overlap.py), driven
    from a long-lived event loop between examples."""
    engine = tiny_engine(vocab=len(tokenizer), num_blocks=64, max_position_embeddings=CONTEXT)
    engine.config = replace(engine.config, overlap=request.param)
    with asyncio.Runner() as runner:
        stack = contextlib.AsyncExitStack()
        client = runner.run(stack.enter_async_context(asgi_client(make_app(tokenizer, engine=engine))))
        try:
            yield runner, client, engine
        finally:
            runner.run(stack.aclose())


def send(served, route: str, raw: bytes, headers: dict[str, str] | None = None):
    runner, client, _ = served
    headers = {"content-type": "application/json"} | (headers or {})
    r = runner.run(asyncio.wait_for(client.post(route, content=raw, headers=headers), ANSWER_S))
    assert 200 <= r.status_code < 500, (r.status_code, r.text[:300], raw[:300])
    assert "Traceback" not in r.text and 'File "' not in r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    elif b'"stream": true' in raw or b'"stream":true' in raw:
        assert r.text.endswith("data: [DONE]\n\n"), r.text[-200:]
    return r


# --- strategies -----------------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(HUGE), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                          max_size=3), max_leaves=8)
token_ids = st.lists(st.integers(-3, 200), max_size=12)
prompts = st.one_of(st.text(max_size=40), token_ids, st.lists(st.text(max_size=5), max_size=3), junk)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "bot"]),
                                           "content": st.one_of(st.text(max_size=30), st.none(), junk)}),
                    max_size=3) | junk
speculation = st.dictionaries(st.sampled_from(["enabled", "drafter", "tree", "max_nodes", "depth"]),
                              st.one_of(st.booleans(), st.sampled_from(["self", "ngram", "nope", "2,1", "9,9,9,9"]),
                                        st.lists(st.integers(-1, 9), max_size=5), st.integers(-1, 2000)),
                              max_size=4)
special = {"stop": st.lists(st.text(max_size=300), max_size=MAX_STOP_STRINGS + 4) | st.text(max_size=8),
           "stop_token_ids": token_ids, "speculation": speculation,
           "logit_bias": st.dictionaries(st.text(max_size=4), st.sampled_from(HUGE), max_size=3),
           "structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "yaml"]),
                                                 st.one_of(st.sampled_from(["[ab]+", "(a", "{}", "start: x", "",
                                                                            '{"type": "integer"}']),
                                                           st.lists(st.text(max_size=3), max_size=3), junk),
                                                 max_size=2),
           "tools": st.one_of(st.just([{"type": "function", "function": {"name": "f"}}]),
                              st.just([{"type": "function", "function": {"name": "f", "parameters": {
                                  "type": "object", "properties": {"x": {"type": "integer"}}}}}]), junk),
           "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required", {"type": "function",
                                                                                   "function": {"name": "f"}}]), junk),
           "response_format": st.one_of(st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "x"},
                                                         {"type": "json_schema", "json_schema": {"schema": {}}},
                                                         {"type": "json_schema", "json_schema": {"schema": 5}}]),
                                        junk),
           "max_tokens": st.sampled_from([1, 8, CONTEXT, CONTEXT + 1, 2**31, 2**63 - 1, 2**70, 0, -5, 1e308])}


@st.composite
def bodies(draw, is_chat: bool) -> bytes:
    body: dict[str, Any] = {}
    if draw(st.booleans()):  # mostly-valid bodies reach deeper code than random ones
        body = {"model": MODEL, "max_tokens": 8, "temperature": 0}
        body |= {"messages": [{"role": "user", "content": "Hi"}]} if is_chat else {"prompt": "Hello"}
    body["messages" if is_chat else "prompt"] = draw(messages if is_chat else prompts)
    for name in draw(st.lists(st.sampled_from(FIELDS) | st.text(max_size=8), max_size=5)):
        body[name] = draw(special.get(name, junk))
    raw = json.dumps(body).encode()  # the stdlib writes 2**70 and Infinity, which orjson then refuses
    cut = draw(st.sampled_from(["none", "none", "truncate", "bad_utf8"]))
    if cut == "truncate":
        raw = raw[: draw(st.integers(0, len(raw)))]
    elif cut == "bad_utf8":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"])) + raw[at:]
    return raw


@pytest.mark.parametrize("route", ROUTES)
def test_fuzzed_bodies_never_get_a_server_error(served, route: str) -> None:
    @settings(max_examples=50, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(raw=bodies(route.endswith("chat/completions")), header=st.sampled_from([None, "on", "off", "maybe"]))
    def check(raw: bytes, header: str | None) -> None:
        send(served, route, raw, {"x-speculation": header} if header else None)

    check()
    wait_until(lambda: pool_is_full(served[2]) and not served[2].has_work())


def nested(depth: int) -> bytes:
    return b'{"model": "tiny", "prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
NASTIES = [
    ("/v1/completions", nested(10_000), 400),
    ("/v1/chat/completions", b"[" * 10_000 + b"]" * 10_000, 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 1e308}', 400),
    ("/v1/completions", b'{"prompt": "a", "temperature": 1e999}', 400),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 1180591620717411303424}', 400),
    ("/v1/completions", json.dumps({"prompt": ""}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": []}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": [5] * (10 * CONTEXT)}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": "Hello " * (10 * CONTEXT)}).encode(), 400),
    ("/v1/chat/completions", json.dumps(CHAT | {"messages": [{"role": "user", "content": "x" * 5000}]}).encode(), 400),
    ("/v1/chat/completions", json.dumps(CHAT | {"messages": [{"role": "user", "content": ""}]}).encode(), 200),
    ("/v1/chat/completions", json.dumps(CHAT | {"max_tokens": 2**62}).encode(), 400),
    ("/v1/chat/completions", json.dumps(CHAT | {"stop": ["a"] * 1000}).encode(), 400),
    ("/v1/chat/completions", json.dumps(CHAT | {"logit_bias": {"5": 100}}).encode(), 200),
    ("/v1/chat/completions", json.dumps(CHAT | {"logit_bias": {"5": 100.5}}).encode(), 400),
    ("/v1/chat/completions", json.dumps(CHAT | {"logit_bias": {"99999": 1}}).encode(), 400),
    ("/v1/chat/completions", json.dumps(CHAT | {"logit_bias": {"-5": 1}}).encode(), 400),
    ("/v1/chat/completions", json.dumps(CHAT | {"top_logprobs": 2}).encode(), 400),
    ("/v1/chat/completions", json.dumps(CHAT | {"logprobs": True, "top_logprobs": 21, "stream": True}).encode(), 400),
    ("/v1/chat/completions", json.dumps(CHAT | {"logprobs": True, "top_logprobs": 20, "stream": True}).encode(), 200),
    ("/v1/completions", json.dumps({"prompt": "a", "logprobs": True}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": "a", "logprobs": 5, "top_logprobs": 5}).encode(), 400),
    ("/v1/chat/completions", json.dumps(CHAT | {"logit_bias": {}, "unknown": {"x": [1]}}).encode(), 200),
    ("/v1/chat/completions", json.dumps(CHAT | {"temperature": 1e-300, "top_p": 5e-324}).encode(), 200),
    ("/v1/chat/completions", json.dumps(CHAT | {"top_k": 2**62, "seed": -(2**63)}).encode(), 200),
    ("/v1/chat/completions", json.dumps(CHAT | {"stream": True, "stream_options": {"include_usage": 1}}).encode(), 400),
    ("/v1/chat/completions", json.dumps(CHAT | {"stream": True, "stop": ["\u20ac", "é"]}).encode(), 200),
    ("/v1/completions", json.dumps({"prompt": "Hi", "stream": True, "max_tokens": None}).encode(), 200),
    ("/v1/completions", json.dumps({"prompt": [1, 2], "stream": True, "stop": ["", "\x00"] * 8}).encode(), 200),
    ("/v1/completions", json.dumps({"prompt": "a", "stream": True, "max_tokens": 2**31}).encode(), 400),
    ("/v1/chat/completions", json.dumps(CHAT | {"stream": True, "speculation": {"tree": [9] * 40}}).encode(), 400),
]


@pytest.mark.parametrize("route, raw, status", NASTIES, ids=range(len(NASTIES)))
def test_named_nasties(served, route: str, raw: bytes, status: int) -> None:
    assert send(served, route, raw).status_code == status


NEEDS = {"top_logprobs": {"logprobs": True}}  # a field the schema bounds that is valid only beside another


def test_openapi_schema_is_published_and_truthful(served) -> None:
    """Each numeric bound in the schema: the bound itself is served, just past it is a 400 naming the field."""
    runner, client, _ = served
    schema = runner.run(client.get("/openapi.json")).json()
    assert set(schema["paths"]) >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}
    props = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for name, prop in props.items():
        for key, step in (("minimum", -1), ("maximum", 1)):
            if key not in prop or "null" not in prop.get("type", []):
                continue
            bound = prop[key]
            step = step if prop["type"][0] == "integer" else step * max(abs(bound) * 0.5, 0.5)
            inside = {name: bound} if name not in ("max_tokens", "max_completion_tokens") else {name: 2}
            inside |= NEEDS.get(name, {})
            ok = send(served, ROUTES[1], json.dumps(CHAT | {"max_tokens": 2} | inside).encode())
            assert ok.status_code == 200, (name, bound, ok.text)
            base = {k: v for k, v in CHAT.items() if k != "max_tokens"}  # it would win over max_completion_tokens
            bad = send(served, ROUTES[1], json.dumps(base | NEEDS.get(name, {}) | {name: bound + step}).encode())
            assert bad.status_code == 400 and bad.json()["error"]["param"] in (name, "max_tokens"), (name, bad.text)
