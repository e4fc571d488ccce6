"""gateway/app.py through httpx's ASGI transport: OpenAI shapes, streams, stop strings, the A/B switch,
metrics and health. Finite responses only; endless streams and disconnects are in test_live.py."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from engine_util import tiny_engine
from gateway_util import MODEL, make_app, pool_is_full, run_app as run, wait_ready, wait_until

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "temperature": 0, "max_tokens": 24,
        "ignore_eos": True}


def events(body: str) -> list[dict | str]:
    """SSE body -> parsed data payloads; asserts the exact `data: ...\\n\\n` framing."""
    assert body.endswith("data: [DONE]\n\n")
    out = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


def test_chat_non_stream_shape(tokenizer) -> None:
    async def go(client, app):
        return await client.post("/v1/chat/completions", json=CHAT)

    r = run(tokenizer, go)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    usage = body["usage"]
    assert usage["completion_tokens"] == 24 and usage["total_tokens"] == usage["prompt_tokens"] + 24
    spec = usage["speculation"]
    assert spec["enabled"] and spec["steps"] >= 1 and spec["drafted_tokens"] >= spec["accepted_tokens"]
    assert spec["mean_accepted_length"] >= 1 and spec["ttft_s"] > 0 and spec["decode_tokens_per_s"] > 0


def test_streams_match_non_stream_and_end_with_usage_and_done(tokenizer) -> None:
    async def go(client, app):
        full = await client.post("/v1/chat/completions", json=CHAT)
        stream = await client.post("/v1/chat/completions",
                                   json=CHAT | {"stream": True, "stream_options": {"include_usage": True}})
        comp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 8,
                                                          "stream": True})
        return full.json(), stream, comp

    full, stream, comp = run(tokenizer, go)
    assert stream.headers["content-type"].startswith("text/event-stream")
    chunks = events(stream.text)
    assert chunks[-1] == "[DONE]"
    first, *middle, finish, usage_chunk, _ = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in [first, *middle, finish])
    text = "".join(c["choices"][0]["delta"]["content"] for c in middle)
    assert text == full["choices"][0]["message"]["content"]
    assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 24
    assert usage_chunk["usage"]["speculation"]["steps"] >= 1
    comp_chunks = events(comp.text)
    assert all(c["object"] == "text_completion" and "usage" not in c for c in comp_chunks[:-1])
    assert comp_chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_continuous_usage_counts_every_token(tokenizer) -> None:
    async def go(client, app):
        opts = {"include_usage": True, "continuous_usage_stats": True}
        return await client.post("/v1/chat/completions", json=CHAT | {"stream": True, "stream_options": opts})

    chunks = events(run(tokenizer, go).text)[:-1]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 24
    assert {"drafted_tokens", "accepted_tokens", "steps"} <= set(chunks[1]["usage"]["speculation"])


def test_greedy_text_is_the_same_with_speculation_on_and_off(tokenizer) -> None:
    arms = [({}, {"speculation": {"enabled": True, "drafter": "draft", "tree": [2, 2, 1]}}),
            ({}, {"speculation": {"drafter": "exact", "tree": [1, 1, 1], "max_nodes": 3}}),
            ({}, {"speculation": {"enabled": False}}),
            ({"X-Speculation": "off"}, {}),
            ({"X-Speculation": "on"}, {"speculation": {"drafter": "ngram", "tree": "2,1"}})]

    async def go(client, app):
        # all arms at once: they share engine steps, which is the A/B setting
        rs = await asyncio.gather(*(client.post("/v1/chat/completions", json=CHAT | body, headers=headers)
                                    for headers, body in arms))
        return [r.json() for r in rs]

    bodies = run(tokenizer, go)
    texts = {b["choices"][0]["message"]["content"] for b in bodies}
    assert len(texts) == 1
    enabled = [b["usage"]["speculation"]["enabled"] for b in bodies]
    assert enabled == [True, True, False, False, True]
    assert bodies[1]["usage"]["speculation"]["accepted_tokens"] == bodies[1]["usage"]["speculation"]["drafted_tokens"]
    assert bodies[2]["usage"]["speculation"]["drafted_tokens"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_text_and_frees_the_request(tokenizer, stream: bool) -> None:
    async def go(client, app):
        full = (await client.post("/v1/chat/completions", json=CHAT)).json()["choices"][0]["message"]["content"]
        stop = next(full[i : i + 2] for i in range(4, len(full)) if "\ufffd" not in full[i : i + 2])
        r = await client.post("/v1/chat/completions", json=CHAT | {"stop": [stop], "stream": stream,
                                                                   "max_tokens": 400})
        engine = app.state.gateway.engine
        await asyncio.to_thread(wait_until, lambda: pool_is_full(engine) and not engine.has_work())
        return full, stop, r

    full, stop, r = run(tokenizer, go)
    want = full[: full.index(stop)]
    if stream:
        chunks = events(r.text)[:-1]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        reason = chunks[-1]["choices"][0]["finish_reason"]
    else:
        text, reason = r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]
    assert (text, reason) == (want, "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_and_min_tokens(tokenizer, stream: bool) -> None:
    """include_stop_str_in_output keeps the matched stop string; min_tokens lets no stop string end the output
    before its min_tokens-th token, so a later match ends it."""
    async def go(client, app):
        full = (await client.post("/v1/chat/completions", json=CHAT | {"max_tokens": 40, "ignore_eos": True}))
        full = full.json()["choices"][0]["message"]["content"]
        stop = next(full[i] for i in range(2, len(full)) if full[i].isalnum() and full[i] in full[i + 1 :])
        base = CHAT | {"stop": [stop], "stream": stream, "max_tokens": 40, "ignore_eos": True}
        kept = await client.post("/v1/chat/completions", json=base | {"include_stop_str_in_output": True})
        held = await client.post("/v1/chat/completions", json=base | {"min_tokens": 40})
        return full, stop, kept, held

    full, stop, kept, held = run(tokenizer, go)

    def text_of(r):
        if not stream:
            return r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]
        chunks = events(r.text)[:-1]
        return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks), chunks[-1]["choices"][0]["finish_reason"]

    assert text_of(kept) == (full[: full.index(stop) + 1], "stop")
    assert text_of(held) == (full, "length")  # ignore_eos: the 40 tokens of the free run, every stop held


@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_tokens_text_is_left_out_unless_asked(tokenizer, stream: bool, logprobs: bool) -> None:
    """vLLM's rule for EOS and stop_token_ids: the token ends the output and counts, its text does not show
    (here a special token, with skip_special_tokens off so it would), unless include_stop_str_in_output."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    body = CHAT | {"stream": stream, "max_tokens": 20, "min_tokens": 3, "logit_bias": {str(end): 100},
                   "stop_token_ids": [end], "skip_special_tokens": False, "logprobs": logprobs,
                   "stream_options": {"include_usage": True} if stream else None}

    async def go(client, app):
        return [await client.post("/v1/chat/completions", json=body | extra)
                for extra in ({}, {"include_stop_str_in_output": True})]

    def read(r):
        if not stream:
            b = r.json()
            return b["choices"][0]["message"]["content"], b["choices"][0]["finish_reason"], b["usage"]["completion_tokens"]
        chunks = [c for c in events(r.text) if isinstance(c, dict)]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c.get("choices"))
        reason = next(c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0].get("finish_reason"))
        return text, reason, chunks[-1]["usage"]["completion_tokens"]

    left_out, kept = (read(r) for r in run(tokenizer, go))
    assert left_out[1] == kept[1] == "stop" and left_out[2] == kept[2] == 4  # three tokens, then the forced end
    assert "<|im_end|>" not in left_out[0] and kept[0] == left_out[0] + "<|im_end|>"


def test_n_choices_are_the_single_requests_of_seed_plus_i(tokenizer) -> None:
    # A prompt no earlier request (the warm-up) has put in the prefix cache. The tree is fixed: a sampled
    # token's value depends on the draws the tree's verification consumed, and the adaptive budget's trees
    # follow measured step times and the scheduler's probe steps, which differ between a batch of three and
    # three requests one after another. Same distribution either way; the same tokens only with the same trees.
    body = CHAT | {"messages": [{"role": "user", "content": "Tell me a story about a hedgehog"}],
                   "temperature": 1.0, "seed": 11, "max_tokens": 12, "speculation": {"tree": [2, 1]}}

    async def go(client, app):
        pool = app.state.gateway.engine.cache.pool
        hits = pool.prefix_hit_blocks
        many = await client.post("/v1/chat/completions", json=body | {"n": 3})
        hits = pool.prefix_hit_blocks - hits
        singles = [await client.post("/v1/chat/completions", json=body | {"seed": 11 + i}) for i in range(3)]
        engine = app.state.gateway.engine
        await asyncio.to_thread(wait_until, lambda: pool_is_full(engine) and not engine.has_work())
        return many, [r.json() for r in singles], app.state.gateway.in_flight, hits, pool.page_size

    many, singles, in_flight, hits, page = run(tokenizer, go)
    assert many.status_code == 200, many.text
    body = many.json()
    assert body["id"] == many.headers["x-request-id"]
    texts = [c["message"]["content"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert texts == [s["choices"][0]["message"]["content"] for s in singles]
    assert len(set(texts)) > 1  # sampled choices differ
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    u = body["usage"]
    assert u["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"] and u["completion_tokens"] == 36
    assert u["total_tokens"] == u["prompt_tokens"] + 36
    assert [r["steps"] >= 1 for r in u["speculation"]] == [True] * 3
    assert in_flight == 0  # every choice gave its admission slot back
    # choices 1 and 2 took every full block of choice 0's prompt from the cache (choice 0 may have found
    # the chat template's first block there too, from the warm-up)
    assert hits >= 2 * ((u["prompt_tokens"] - 1) // page)


def test_n_choices_stream_by_index_then_one_usage_chunk_and_done(tokenizer) -> None:
    # A fixed tree: sampled tokens follow the draws the tree's verification consumed, and adaptive trees follow
    # the server's history (measured step times, each drafter's acceptance so far), which differs between calls.
    body = CHAT | {"n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 10, "speculation": {"tree": [2, 1]}}

    async def go(client, app):
        full = await client.post("/v1/chat/completions", json=body)
        stream = await client.post("/v1/chat/completions",
                                   json=body | {"stream": True, "stream_options": {"include_usage": True}})
        comp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 6, "n": 2,
                                                          "stream": True, "ignore_eos": True})
        return full.json(), events(stream.text), events(comp.text)

    full, chunks, comp = run(tokenizer, go)
    assert chunks.count("[DONE]") == 1
    *choice_chunks, usage_chunk, _ = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 20
    assert len(usage_chunk["usage"]["speculation"]) == 2
    for i in (0, 1):
        mine = [c["choices"][0] for c in choice_chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["finish_reason"] == "length" and all(c["finish_reason"] is None for c in mine[:-1])
        text = "".join(c["delta"].get("content", "") for c in mine)
        assert text == full["choices"][i]["message"]["content"]
    comp_chunks = comp[:-1]
    assert {c["choices"][0]["index"] for c in comp_chunks} == {0, 1}
    assert sum(c["choices"][0]["finish_reason"] == "length" for c in comp_chunks) == 2


def test_n_choices_take_one_admission_slot_each(tokenizer) -> None:
    async def go(client, app):
        too_many = await client.post("/v1/chat/completions", json=CHAT | {"n": 3})
        fits = await client.post("/v1/chat/completions", json=CHAT | {"n": 2})
        return too_many, fits, app.state.gateway.in_flight

    too_many, fits, in_flight = run(tokenizer, go, max_in_flight=2)
    assert too_many.status_code == 429 and too_many.json()["error"]["code"] == "queue_full"
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 2
    assert in_flight == 0


def test_a_requests_priority_reaches_the_scheduler(tokenizer) -> None:
    """The body's ``priority`` (vLLM's field: lower runs first) is the class the engine queues the request in,
    for chat and completions, and every choice of an n > 1 request; absent, it is 0."""
    engine = tiny_engine(vocab=len(tokenizer), num_blocks=128)
    seen: dict[str, int] = {}
    add = engine.add

    def recording(request_id, *args, **kw):
        seq = add(request_id, *args, **kw)
        seen[request_id] = seq.priority
        return seq

    engine.add = recording

    async def go(client, app):
        await wait_ready(client)
        seen.clear()  # the warm-up's own requests
        chat = await client.post("/v1/chat/completions", json=CHAT | {"priority": -3, "max_tokens": 2})
        done = dict(seen)
        completions = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                                   "n": 2, "priority": 7})
        plain = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        return chat, completions, plain, done

    chat, completions, plain, after_chat = run(tokenizer, go, engine=engine)
    assert chat.status_code == completions.status_code == plain.status_code == 200
    assert list(after_chat.values()) == [-3]
    assert sorted(seen.values()) == [-3, 0, 7, 7]


def test_completions_accept_token_ids_and_report_usage(tokenizer) -> None:
    async def go(client, app):
        return await client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 5,
                                                          "temperature": 0, "ignore_eos": True})

    body = run(tokenizer, go).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 5
    assert body["choices"][0]["finish_reason"] == "length" and "text" in body["choices"][0]


def test_models_metrics_and_health(tokenizer) -> None:
    async def go(client, app):
        await client.post("/v1/chat/completions", json=CHAT)
        await client.post("/v1/chat/completions", json=CHAT, headers={"X-Speculation": "off"})
        await client.post("/v1/chat/completions", json=CHAT | {"model": "nope"})
        return [await client.get(p) for p in ("/v1/models", "/metrics", "/health")]

    models, metrics, health = run(tokenizer, go)
    card = models.json()["data"][0]
    assert card["id"] == MODEL and "draft" in card["speculation"]["drafters"]
    text = metrics.text
    for needle in ['specgate_requests_total{route="/v1/chat/completions",speculation="on",status="200"} 1.0',
                   'specgate_requests_total{route="/v1/chat/completions",speculation="off",status="200"} 1.0',
                   'status="404"', "specgate_time_to_first_token_seconds_bucket",
                   'specgate_time_per_output_token_seconds_count{speculation="off"} 23.0',  # first token: TTFT
                   "specgate_e2e_request_latency_seconds", "specgate_queue_depth", "specgate_running_sequences",
                   "specgate_kv_blocks_used", "specgate_kv_blocks_free 128.0", "specgate_draft_kv_blocks_used 0.0",
                   'specgate_drafted_tokens_total',
                   'specgate_accepted_length_bucket{le="1.0",speculation="on"}', "specgate_accepted_by_depth_total"]:
        assert needle in text, needle
    assert health.json() == {"status": "ready", "model": MODEL, "device": "cpu"}


def test_health_is_503_until_warm_up_is_done(tokenizer) -> None:
    async def main():
        app = make_app(tokenizer)
        gw = app.state.gateway
        release = asyncio.Event()
        real = gw.warm_up

        async def held():
            await release.wait()
            await real()

        gw.warm_up = held
        async with app.router.lifespan_context(app):
            import httpx

            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                before = await client.get("/health")
                release.set()
                for _ in range(500):
                    if (after := await client.get("/health")).status_code == 200:
                        break
                    await asyncio.sleep(0.01)
        return before, after

    before, after = asyncio.run(main())
    assert before.status_code == 503 and before.json()["status"] == "warming up" and "retry-after" in before.headers
    assert after.status_code == 200


def test_truncate_prompt_tokens_keeps_the_prompts_end(tokenizer) -> None:
    """vLLM's truncate_prompt_tokens: the last k prompt tokens are what the model sees (usage and echo say so);
    -1 keeps as many as fit beside max_tokens, so a prompt past the context is served instead of refused;
    bad values are a 400 naming the field."""
    ids = list(range(5, 95))  # 90 token ids: past the 64-token context below
    base = {"model": MODEL, "prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def go(client, app):
        out = {"whole": await client.post("/v1/completions", json=base),
               "kept": await client.post("/v1/completions", json=base | {"truncate_prompt_tokens": 7, "echo": True,
                                                                        "max_tokens": 1}),
               "fit": await client.post("/v1/completions", json=base | {"truncate_prompt_tokens": -1}),
               "same": await client.post("/v1/completions", json=base | {"prompt": ids[-7:], "max_tokens": 1})}
        for bad in (0, -2, "7", 2.5):
            out[f"bad {bad!r}"] = await client.post("/v1/completions", json=base | {"truncate_prompt_tokens": bad})
        return out

    from engine_util import tiny_engine

    out = run(tokenizer, go, engine=tiny_engine(vocab=len(tokenizer), num_blocks=128, max_position_embeddings=64))
    assert out["whole"].status_code == 400  # 90 prompt tokens do not fit a 64-token context
    kept = out["kept"].json()
    assert out["kept"].status_code == 200 and kept["usage"]["prompt_tokens"] == 7
    same = out["same"].json()
    text = same["choices"][0]["text"]
    assert kept["choices"][0]["text"].endswith(text)  # the echo, then the same greedy token as the cut prompt's
    assert kept["choices"][0]["text"] == tokenizer.decode(ids[-7:]) + text
    fit = out["fit"].json()
    assert out["fit"].status_code == 200 and fit["usage"]["prompt_tokens"] == 60  # 64 - max_tokens 4
    assert fit["usage"]["completion_tokens"] == 4
    for name in ("bad 0", "bad -2", "bad '7'", "bad 2.5"):
        r = out[name]
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", (name, r.text)


def test_allowed_token_ids_through_the_api(tokenizer) -> None:
    """allowed_token_ids reach the engine (a single allowed token is all the output holds); bad lists are a
    400 naming the field, an id past the vocabulary included."""
    one = tokenizer.encode("a", add_special_tokens=False)[-1]
    base = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}

    async def go(client, app):
        out = {"one": await client.post("/v1/completions", json=base | {"allowed_token_ids": [one]})}
        for name, bad in (("empty", []), ("strings", ["3"]), ("negative", [-1]), ("bools", [True]),
                          ("too many", list(range(70000))), ("past vocab", [len(tokenizer) + 5])):
            out[name] = await client.post("/v1/completions", json=base | {"allowed_token_ids": bad})
        return out

    out = run(tokenizer, go)
    r = out["one"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["tokens"] == [tokenizer.decode([one])] * 5
    for name in ("empty", "strings", "negative", "bools", "too many", "past vocab"):
        bad = out[name]
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_token_ids", (name, bad.text)


def test_usage_reports_the_prompt_tokens_the_prefix_cache_held(tokenizer) -> None:
    """OpenAI's usage.prompt_tokens_details.cached_tokens: for a prompt seen first, at most the chat template's
    head that the warm-up left cached; the second time, whole blocks of it (all but the last token, which every
    request computes), in streams' usage chunks too."""
    long = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea. " * 6}],
            "max_tokens": 3, "temperature": 0, "ignore_eos": True}

    async def go(client, app):
        first = (await client.post("/v1/chat/completions", json=long)).json()["usage"]
        again = (await client.post("/v1/chat/completions", json=long)).json()["usage"]
        r = await client.post("/v1/chat/completions", json=long | {"stream": True,
                                                                   "stream_options": {"include_usage": True}})
        streamed = [e for e in events(r.text) if isinstance(e, dict) and e.get("usage")][-1]["usage"]
        other = (await client.post("/v1/chat/completions",
                                   json=long | {"messages": [{"role": "user", "content": "Quite another prompt."}]}))
        return first, again, streamed, other.json()["usage"]

    first, again, streamed, other = run(tokenizer, go)
    page = 4  # the tiny engine's page size
    assert first["prompt_tokens_details"]["cached_tokens"] <= page and first["prompt_tokens"] > 3 * page
    cached = again["prompt_tokens_details"]["cached_tokens"]
    assert cached % page == 0 and again["prompt_tokens"] - page <= cached < again["prompt_tokens"]
    assert streamed["prompt_tokens_details"]["cached_tokens"] == cached
    assert other["prompt_tokens_details"]["cached_tokens"] <= page  # the shared template head at most
