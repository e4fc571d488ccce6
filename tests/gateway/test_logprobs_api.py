"""OpenAI's logprobs and logit_bias through the HTTP routes: both shapes (chat, legacy completions), stream
and non-stream agreeing, stop strings cutting logprobs with the text, bytes that rebuild the text."""

from __future__ import annotations

import math

import pytest

from gateway_util import MODEL, pool_is_full, run_app as run
from test_app import events

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "temperature": 0, "max_tokens": 16,
        "ignore_eos": True}
COMPLETION = {"model": MODEL, "prompt": "Hello", "temperature": 0, "max_tokens": 16, "ignore_eos": True}


def check_entry(entry: dict, top: int) -> None:
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert entry["logprob"] <= 0 and math.isfinite(entry["logprob"])
    assert len(entry["top_logprobs"]) == top
    lps = [alt["logprob"] for alt in entry["top_logprobs"]]
    assert lps == sorted(lps, reverse=True)
    for alt in entry["top_logprobs"]:
        assert set(alt) == {"token", "logprob", "bytes"} and all(0 <= b < 256 for b in alt["bytes"])


@pytest.mark.parametrize("speculation", [True, False])
def test_chat_logprobs_non_stream_and_stream_agree(tokenizer, speculation: bool) -> None:
    body = CHAT | {"logprobs": True, "top_logprobs": 3, "speculation": {"enabled": speculation}}

    async def go(client, app):
        full = await client.post("/v1/chat/completions", json=body)
        stream = await client.post("/v1/chat/completions", json=body | {"stream": True})
        return full, stream, pool_is_full(app.state.gateway.engine)

    full, stream, freed = run(tokenizer, go)
    assert full.status_code == 200, full.text
    (choice,) = full.json()["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == 16 == full.json()["usage"]["completion_tokens"]
    for entry in content:
        check_entry(entry, 3)
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: the emitted token is the argmax
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
    # The tokens' bytes rebuild the text (no special tokens here: ignore_eos and a length finish).
    assert bytes(b for e in content for b in e["bytes"]).decode() == choice["message"]["content"]
    chunks = [c for c in events(stream.text) if c != "[DONE]"]
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    for got, want in zip(streamed, content):  # up to rounding: the two runs verify different trees
        assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-4)
        assert [a["token"] for a in got["top_logprobs"]] == [a["token"] for a in want["top_logprobs"]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == choice["message"]["content"]
    assert freed


def test_completions_legacy_logprobs_shape(tokenizer) -> None:
    async def go(client, app):
        full = await client.post("/v1/completions", json=COMPLETION | {"logprobs": 2})
        stream = await client.post("/v1/completions", json=COMPLETION | {"logprobs": 2, "stream": True})
        chat = await client.post("/v1/chat/completions", json=CHAT | {"logprobs": True})
        return full.json(), stream.text, chat.json()

    full, stream, chat = run(tokenizer, go)
    (choice,) = full["choices"]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 16
    text = choice["text"]
    for i, (tok, value, top, offset) in enumerate(zip(*(lp[k] for k in ("tokens", "token_logprobs", "top_logprobs",
                                                                         "text_offset")))):
        assert tok in top and top[tok] == value and 1 <= len(top) <= 3
        assert text[offset : offset + len(tok)] == tok or "\ufffd" in tok
        if i:
            assert offset >= lp["text_offset"][i - 1]
    assert lp["text_offset"][0] == 0
    streamed = {"tokens": [], "token_logprobs": []}
    for c in events(stream)[:-1]:
        if c["choices"] and c["choices"][0]["logprobs"]:
            for k in streamed:
                streamed[k] += c["choices"][0]["logprobs"][k]
    # the same tokens; figures up to rounding (two runs verify different trees: different batch shapes)
    assert streamed["tokens"] == lp["tokens"]
    assert streamed["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)
    # logprobs without top_logprobs: each entry with an empty list of alternatives
    assert all(e["top_logprobs"] == [] for e in chat["choices"][0]["logprobs"]["content"])


def test_no_logprobs_field_unless_asked(tokenizer) -> None:
    async def go(client, app):
        return (await client.post("/v1/chat/completions", json=CHAT)).json()

    assert run(tokenizer, go)["choices"][0]["logprobs"] is None


def test_a_stop_string_cuts_logprobs_with_the_text(tokenizer) -> None:
    """Logprobs end at the token that completed the stop string: the tokens after it are not reported."""
    async def go(client, app):
        free = (await client.post("/v1/completions", json=COMPLETION | {"logprobs": 0})).json()
        text = free["choices"][0]["text"]
        stop = text[5:7]  # two characters from the middle of the greedy text
        cut = (await client.post("/v1/completions", json=COMPLETION | {"logprobs": 0, "stop": [stop]})).json()
        streamed = (await client.post("/v1/completions", json=COMPLETION | {"logprobs": 0, "stop": [stop],
                                                                            "stream": True})).text
        return free, stop, cut, streamed

    free, stop, cut, streamed = run(tokenizer, go)
    full_lp, (choice,) = free["choices"][0]["logprobs"], cut["choices"]
    text = free["choices"][0]["text"]
    assert choice["finish_reason"] == "stop" and choice["text"] == text[: text.index(stop)]
    end = text.index(stop) + len(stop)  # the stop string ends inside the last reported token
    n = next(i for i, off in enumerate(full_lp["text_offset"]) if off + len(full_lp["tokens"][i]) >= end) + 1
    assert choice["logprobs"]["tokens"] == full_lp["tokens"][:n]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(full_lp["token_logprobs"][:n], abs=1e-4)
    tokens = [t for c in events(streamed)[:-1] if c["choices"] and c["choices"][0]["logprobs"]
              for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == full_lp["tokens"][:n]


def test_logit_bias_over_http(tokenizer) -> None:
    """A +100 bias on one token id: every generated token is that token, spec on and off."""
    target = tokenizer.convert_tokens_to_ids("Hello")

    async def go(client, app):
        out = []
        for enabled in (True, False):
            r = await client.post("/v1/completions", json=COMPLETION | {
                "logit_bias": {str(target): 100}, "speculation": {"enabled": enabled}, "logprobs": 0})
            out.append(r.json())
        return out

    for body in run(tokenizer, go):
        assert body["choices"][0]["text"] == "Hello" * 16, body
        # raw logprobs: the bias is not in them, so the forced token is not certain
        assert all(lp < -1e-3 for lp in body["choices"][0]["logprobs"]["token_logprobs"])
