"""OpenAI's logprobs, logit_bias, echo and batched prompts through the HTTP routes: both logprobs shapes (chat,
legacy completions), stream and non-stream agreeing, stop strings cutting logprobs with the text, bytes that
rebuild the text, and lm-eval's loglikelihood request (a batch of token-id prompts, echo, logprobs)."""

from __future__ import annotations

import math

import pytest
import torch

from gateway_util import CHAT_TEMPLATE, MODEL, pool_is_full, run_app as run
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


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(tokenizer) -> None:
    """lm-eval's loglikelihood request: token-id prompts in a batch, echo, logprobs 1, max_tokens 1. Each
    choice lists every prompt token (the first without figures) then the generated one; the continuation's
    logprobs are the target's, whatever shares the batch, and top_logprobs says whether it was greedy."""
    context = tokenizer.encode("Hello wor")
    conts = [tokenizer.encode("ld"), tokenizer.encode("d!")]
    prompts = [context + c for c in conts]

    async def go(client, app):
        body = {"model": MODEL, "prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0,
                "seed": 1234}
        batch = (await client.post("/v1/completions", json=body)).json()
        alone = [(await client.post("/v1/completions", json=body | {"prompt": p})).json() for p in prompts]
        return batch, alone, pool_is_full(app.state.gateway.engine)

    batch, alone, freed = run(tokenizer, go)
    choices = sorted(batch["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1] and freed
    assert batch["usage"]["prompt_tokens"] == sum(map(len, prompts))
    for choice, single, prompt in zip(choices, alone, prompts):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
        assert choice["text"].startswith(tokenizer.decode(prompt))
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        # the figures lm-eval sums: the continuation's tokens, scored inside the prompt
        cont = lp["token_logprobs"][len(context) : -1]
        assert len(cont) == len(prompt) - len(context)
        assert cont == pytest.approx(single["choices"][0]["logprobs"]["token_logprobs"][len(context) : -1], abs=1e-4)
        for value, top in zip(cont, lp["top_logprobs"][len(context) : -1]):
            assert max(top.values()) >= value  # is_greedy compares these two


def test_echo_matches_a_teacher_forced_forward(tokenizer) -> None:
    """The echoed prompt's logprobs are log-softmax of the target's logits over the prompt."""
    from engine_util import tiny_engine
    from test_engine_logit_controls import teacher_forced

    prompt = tokenizer.encode("Hello world, hello")
    engine = tiny_engine(vocab=len(tokenizer), num_blocks=128)

    async def go(client, app):
        return (await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                           "logprobs": 0, "echo": True, "temperature": 0})).json()

    body = run(tokenizer, go, engine=engine)
    ref = teacher_forced(engine, prompt[:1], prompt[1:])
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    assert body["choices"][0]["logprobs"]["token_logprobs"][1 : len(prompt)] == pytest.approx(want, abs=1e-4)


def test_echo_without_logprobs_and_streamed(tokenizer) -> None:
    async def go(client, app):
        plain = (await client.post("/v1/completions", json=COMPLETION)).json()
        echo = (await client.post("/v1/completions", json=COMPLETION | {"echo": True})).json()
        stream = (await client.post("/v1/completions", json=COMPLETION | {"echo": True, "stream": True,
                                                                         "logprobs": 0})).text
        chat = await client.post("/v1/chat/completions", json=CHAT | {"echo": True})
        return plain, echo, stream, chat

    plain, echo, stream, chat = run(tokenizer, go)
    assert echo["choices"][0]["text"] == "Hello" + plain["choices"][0]["text"]
    assert echo["choices"][0]["logprobs"] is None
    chunks = [c for c in events(stream)[:-1] if c["choices"]]
    assert chunks[0]["choices"][0]["text"].startswith("Hello")
    assert "".join(c["choices"][0]["text"] for c in chunks) == echo["choices"][0]["text"]
    tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens[: len(tokenizer.encode("Hello"))] == [tokenizer.decode([t]) for t in tokenizer.encode("Hello")]
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "echo"


def test_a_batch_of_prompts_answers_each_with_n_choices(tokenizer) -> None:
    """Prompt i's choice j has index i * n + j and equals the single request for that prompt (greedy)."""
    texts = ["Hello", "Hi there", "Hello world"]

    async def go(client, app):
        batch = (await client.post("/v1/completions", json=COMPLETION | {"prompt": texts, "n": 2,
                                                                         "max_tokens": 6})).json()
        stream = (await client.post("/v1/completions", json=COMPLETION | {"prompt": texts, "max_tokens": 6,
                                                                          "stream": True})).text
        alone = [(await client.post("/v1/completions", json=COMPLETION | {"prompt": t, "max_tokens": 6})).json()
                 for t in texts]
        too_many = await client.post("/v1/completions", json=COMPLETION | {"prompt": ["a"] * 65, "n": 2})
        bad = await client.post("/v1/completions", json=COMPLETION | {"prompt": ["a", ""]})
        return batch, stream, alone, too_many, bad, pool_is_full(app.state.gateway.engine)

    batch, stream, alone, too_many, bad, freed = run(tokenizer, go)
    by_index = {c["index"]: c["text"] for c in batch["choices"]}
    assert sorted(by_index) == list(range(6))
    for i, single in enumerate(alone):
        assert by_index[2 * i] == by_index[2 * i + 1] == single["choices"][0]["text"]
    assert batch["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert batch["usage"]["completion_tokens"] == 36
    streamed: dict[int, str] = {}
    for c in events(stream)[:-1]:
        for ch in c["choices"]:
            streamed[ch["index"]] = streamed.get(ch["index"], "") + ch["text"]
    assert streamed == {i: a["choices"][0]["text"] for i, a in enumerate(alone)}
    assert too_many.status_code == 400 and "128" in too_many.json()["error"]["message"]
    assert bad.status_code == 400 and "prompt[1]" in bad.json()["error"]["message"]
    assert freed


def test_tokenizer_routes_as_lm_eval_probes_them(tokenizer) -> None:
    """vLLM's /tokenize, /detokenize and /tokenizer_info, in the shapes lm-eval's remote tokenizer reads."""
    async def go(client, app):
        info = (await client.get("/tokenizer_info")).json()
        plain = (await client.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False})).json()
        chat = (await client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})).json()
        back = (await client.post("/detokenize", json={"tokens": plain["tokens"]})).json()
        bad = [await client.post("/detokenize", json={"tokens": [10**6]}),
               await client.post("/tokenize", json={"prompt": 5}), await client.post("/tokenize", content=b"[")]
        return info, plain, chat, back, bad

    info, plain, chat, back, bad = run(tokenizer, go)
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"] and info["model_max_length"] > 0
    assert plain["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)
    assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == info["model_max_length"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True, chat_template=CHAT_TEMPLATE)
    assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False)  # what the chat route serves
    assert back == {"prompt": "Hello world"}
    assert [r.status_code for r in bad] == [400, 400, 400]
    assert [r.json()["error"]["param"] for r in bad[:2]] == ["tokens", "prompt"]
