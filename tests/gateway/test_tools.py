"""Tool calls: with tool_choice "required" or a named function the output is one call of the offered tools
(their parameters' schemas); with "auto" (the default when tools are given) the model writes text or one
tagged call. Answered in OpenAI's tool_calls shape, stream and non-stream."""

from __future__ import annotations

import json

from gateway_util import MODEL, pool_is_full, run_app as run
from test_app import events

# Small tools: the tests' tokenizer spells most text a character a token, and the context is 512 tokens.
WEATHER = {"type": "function", "function": {"name": "w", "parameters": {
    "type": "object", "properties": {"c": {"type": "string", "maxLength": 3}}, "required": ["c"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 64,
        "tools": [TIME]}


def test_named_and_required_tool_calls(tokenizer) -> None:
    named = {"type": "function", "function": {"name": "time"}}

    async def go(client, app):
        out = {}
        out["named"] = (await client.post("/v1/chat/completions", json=CHAT | {"tool_choice": named})).json()
        out["required"] = (await client.post("/v1/chat/completions", json=CHAT | {"tool_choice": "required",
                                                                                  "tools": [WEATHER, TIME]})).json()
        out["stream"] = (await client.post("/v1/chat/completions", json=CHAT | {"tool_choice": named,
                                                                                "stream": True})).text
        out["none"] = (await client.post("/v1/chat/completions", json=CHAT | {"tool_choice": "none",
                                                                              "max_tokens": 4})).json()
        out["short"] = (await client.post("/v1/chat/completions", json=CHAT | {"tool_choice": "required",
                                                                               "max_tokens": 3})).json()
        # a second turn: the call, its result, and the model answers in text
        call = out["named"]["choices"][0]["message"]["tool_calls"][0]
        turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "12:00"}]
        out["turn"] = (await client.post("/v1/chat/completions", json=CHAT | {"messages": turn, "max_tokens": 4})).json()
        out["freed"] = pool_is_full(app.state.gateway.engine)
        return out

    out = run(tokenizer, go)
    choice = out["named"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "time"
    assert json.loads(call["function"]["arguments"])["zone"] in ("UTC", "CET")
    (call,) = out["required"]["choices"][0]["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] in ("w", "time")
    assert set(args) == ({"c"} if call["function"]["name"] == "w" else {"zone"})
    chunks = [c for c in events(out["stream"]) if c != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    streamed = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(streamed) == 1 and streamed[0][0]["index"] == 0
    assert streamed[0][0]["function"] == choice["message"]["tool_calls"][0]["function"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "content" in out["none"]["choices"][0]["message"] and "tool_calls" not in out["none"]["choices"][0]["message"]
    short = out["short"]["choices"][0]  # cut by max_tokens: no call, the text and "length"
    assert short["finish_reason"] == "length" and short["message"]["content"].startswith("{")
    assert out["turn"]["choices"][0]["message"]["content"] is not None
    assert out["freed"]


def test_tools_reach_the_prompt(tokenizer) -> None:
    """A template without tools support gets them in the system turn; the prompt grows by their text."""
    async def go(client, app):
        plain = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})).json()
        gw = app.state.gateway
        with_tools = gw._encode_chat([{"role": "user", "content": "Hi"}], tools=(WEATHER,))
        return plain["tokens"], with_tools

    plain, with_tools = run(tokenizer, go)
    text = tokenizer.decode(with_tools)
    assert len(with_tools) > len(plain) and '"name":"w"' in text and "You can call these functions" in text


def test_auto_tool_choice_answers_in_text_or_with_a_call(tokenizer) -> None:
    """A logit bias on "<" picks the branch (the grammar keeps text from starting with it): strongly for, a
    tagged call under the tools' schema; strongly against, text. Streams agree with bodies."""
    lt = str(tokenizer.convert_tokens_to_ids("<"))
    body = CHAT | {"tools": [TIME]}  # no tool_choice: "auto"

    async def go(client, app):
        out = {}
        for name, bias in (("call", 100), ("text", -100)):
            b = body | {"logit_bias": {lt: bias}, "max_tokens": 90}
            out[name] = (await client.post("/v1/chat/completions", json=b)).json()
            out[name + "_stream"] = (await client.post("/v1/chat/completions", json=b | {"stream": True})).text
        out["format"] = (await client.post("/v1/chat/completions", json=body | {
            "response_format": {"type": "json_object"}, "ignore_eos": False})).json()
        out["freed"] = pool_is_full(app.state.gateway.engine)
        return out

    out = run(tokenizer, go)
    assert isinstance(json.loads(out["format"]["choices"][0]["message"]["content"]), dict)  # no choice: the format
    call = out["call"]["choices"][0]
    assert call["finish_reason"] == "tool_calls", call
    (tc,) = call["message"]["tool_calls"]
    assert tc["function"]["name"] == "time" and json.loads(tc["function"]["arguments"])["zone"] in ("UTC", "CET")
    text = out["text"]["choices"][0]
    assert "tool_calls" not in text["message"] and text["message"]["content"]
    assert not text["message"]["content"].startswith("<") and text["finish_reason"] in ("length", "stop")
    for name in ("call", "text"):
        chunks = [c for c in events(out[name + "_stream"]) if c != "[DONE]" and c["choices"]]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        if name == "call":
            (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
            assert calls[0]["function"] == tc["function"]
        else:
            assert "".join(d.get("content") or "" for d in deltas) == text["message"]["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] == out[name]["choices"][0]["finish_reason"]
    assert out["freed"]
