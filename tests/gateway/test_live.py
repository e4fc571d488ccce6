"""A live uvicorn on 127.0.0.1: the real openai SDK, `curl -N`, and a client that drops mid-stream."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from engine_util import tiny_engine
from gateway_util import API_KEY, MODEL, LiveServer, make_app, pool_is_full, wait_until

MESSAGES = [{"role": "user", "content": "Hello"}]


def greedy(**extra_body: object) -> dict:
    """SDK kwargs for 16 greedy tokens; ``extra_body`` carries the non-OpenAI fields (speculation)."""
    return {"temperature": 0, "max_tokens": 16, "extra_body": {"ignore_eos": True, **extra_body}}


def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


def test_openai_sdk_chat_stream_and_non_stream(live) -> None:
    on = greedy(speculation={"enabled": True, "drafter": "draft", "max_nodes": 4})
    with client(live) as c:
        full = c.chat.completions.create(model=MODEL, messages=MESSAGES, **on)
        chunks = list(c.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                stream_options={"include_usage": True}, **greedy()))
        off = c.chat.completions.create(model=MODEL, messages=MESSAGES, **greedy(speculation={"enabled": False}))
    text = full.choices[0].message.content
    assert text and full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 16
    report = full.usage.model_extra["speculation"]
    assert report["enabled"] and report["drafted_tokens"] > 0 and report["steps"] <= 16
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert off.choices[0].message.content == text  # greedy: speculation changes speed, not text
    assert off.usage.model_extra["speculation"]["drafted_tokens"] == 0


def test_openai_sdk_completions_models_and_errors(live) -> None:
    with client(live) as c:
        full = c.completions.create(model=MODEL, prompt="Hello", **greedy())
        ngram = greedy(speculation={"drafter": "ngram"})
        stream = c.completions.create(model=MODEL, prompt="Hello", stream=True, **ngram)
        streamed = "".join(ch.choices[0].text for ch in stream if ch.choices)
        assert [m.id for m in c.models.list()] == [MODEL]
        two = c.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, seed=3, temperature=1, max_tokens=4,
                                        extra_body={"ignore_eos": True})
        assert [ch.index for ch in two.choices] == [0, 1] and two.usage.completion_tokens == 8
        with pytest.raises(openai.BadRequestError, match="n must be between 1 and 16"):
            c.chat.completions.create(model=MODEL, messages=MESSAGES, n=17)
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="other", messages=MESSAGES)
    with openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    assert full.choices[0].text == streamed and full.usage.completion_tokens == 16


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_a_chat_completion(live) -> None:
    body = orjson.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "stream": True,
                         "stream_options": {"include_usage": True}}).decode()
    out = subprocess.run(["curl", "-sN", live.url + "/v1/chat/completions", "-H", "Content-Type: application/json",
                          "-H", f"Authorization: Bearer {API_KEY}", "-d", body],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    lines = [line for line in out.split("\n") if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    usage = orjson.loads(lines[-2][len("data: "):])["usage"]
    assert usage["completion_tokens"] == 12 and "speculation" in usage


def slow_engine(tokenizer):
    """~500 tokens take seconds: plenty of time to drop the connection mid-request."""
    engine = tiny_engine(vocab=len(tokenizer), num_blocks=128)
    step = engine.step
    engine.step = lambda: (time.sleep(0.005), step())[1]
    return engine


LONG = {"model": MODEL, "messages": MESSAGES, "max_tokens": 480, "ignore_eos": True}


def test_client_dropping_mid_stream_aborts_and_frees_kv(tokenizer) -> None:
    engine = slow_engine(tokenizer)
    with LiveServer(make_app(tokenizer, engine=engine)) as live:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", live.url + "/v1/chat/completions", json=LONG | {"stream": True}) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(6)]  # role chunk + a few tokens
                assert not pool_is_full(engine)
            # leaving the block closes the connection mid-stream
        wait_until(lambda: pool_is_full(engine) and not engine.has_work())
        metrics = httpx.get(live.url + "/metrics").text
    assert any('"content"' in line for line in got)
    assert 'specgate_request_finish_total{reason="abort",speculation="on"} 1.0' in metrics
    assert 'route="/v1/chat/completions",speculation="on",status="499"} 1.0' in metrics


@pytest.mark.parametrize("stream", [True, False])
def test_client_leaving_a_request_of_n_choices_aborts_them_all(tokenizer, stream: bool) -> None:
    engine = slow_engine(tokenizer)
    app = make_app(tokenizer, engine=engine)
    body = LONG | {"n": 3, "temperature": 1.0, "max_tokens": 160}
    with LiveServer(app) as live:
        if stream:
            with httpx.Client(timeout=30) as http:
                with http.stream("POST", live.url + "/v1/chat/completions", json=body | {"stream": True}) as r:
                    lines = r.iter_lines()
                    got = [json.loads(line[6:]) for line in (next(lines) for _ in range(16)) if line]
                    assert engine.has_work()
            assert {c["choices"][0]["index"] for c in got} == {0, 1, 2}  # the choices stream side by side
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(live.url + "/v1/chat/completions", json=body, timeout=0.5)
        wait_until(lambda: pool_is_full(engine) and not engine.has_work())
        assert app.state.gateway.in_flight == 0
        metrics = httpx.get(live.url + "/metrics").text
    assert 'specgate_request_finish_total{reason="abort",speculation="on"} 3.0' in metrics


def test_client_leaving_a_non_stream_request_aborts_it(tokenizer) -> None:
    engine = slow_engine(tokenizer)
    with LiveServer(make_app(tokenizer, engine=engine)) as live:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(live.url + "/v1/chat/completions", json=LONG, timeout=0.5)
        wait_until(lambda: pool_is_full(engine) and not engine.has_work())
        metrics = httpx.get(live.url + "/metrics").text
    assert 'specgate_request_finish_total{reason="abort",speculation="on"} 1.0' in metrics


def test_load_bench_reports_every_arm(tokenizer, tmp_path) -> None:
    """bench/load.py end to end against a live server: both arms, per-token ITL, percentiles, JSON."""
    root = Path(__file__).resolve().parents[2]
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"Hello {i}"]}) + "\n" for i in range(4)))
    out, off_only = tmp_path / "load", tmp_path / "off_only"
    with LiveServer(make_app(tokenizer)) as live:
        for path, extra in ((out, []), (off_only, ["--all-as", '{"enabled": false}'])):
            subprocess.run([sys.executable, str(root / "bench" / "load.py"), "--url", live.url, "--prompts-file",
                            str(prompts), "--concurrency", "1,2", "--requests", "4", "--max-tokens", "8", "--rate", "50",
                            "--procs", "2", "--out", str(path), *extra], check=True, capture_output=True, text=True,
                            timeout=60)
    # --all-as: the same requests under the same labels, every one sent with speculation off
    alone = json.loads(off_only.with_suffix(".json").read_text())
    assert alone["all_as"] == {"enabled": False} and alone["requests_per_level"] == 4
    for level in alone["levels"]:
        assert level["arms"]["on"]["requests"] == level["arms"]["off"]["requests"] == 2
        assert not [label for label in level["server"] if label.startswith("on/")]  # the server saw no "on" request
    report = json.loads(out.with_suffix(".json").read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2] and report["device"] == "cpu"
    # concurrency 2 ran in two client processes (--procs 2), their results gathered into one level
    assert [lv["client_procs"] for lv in report["levels"]] == [1, 2]
    for level in report["levels"]:
        assert 0 < level["client_cpu_share"] < 4  # the busiest client's CPU seconds over the level's wall time
        for arm in ("on", "off"):
            s = level["arms"][arm]
            assert s["requests"] == 2 and s["errors"] == 0 and s["tokens"] <= 16
            assert s["request_tokens_per_s"]["p50"] > 0
            assert s["itl_s"]["n"] > 0 and s["ttft_s"]["p50"] <= s["e2e_s"]["p99"]
    assert level["arms"]["off"]["mean_accepted_length"] == 1.0
    for level in report["levels"]:  # the server's counters, reset before the level: its requests alone
        server = level["server"]
        on = [a for label, a in server.items() if label.startswith("on/")]
        off = [a for label, a in server.items() if label.startswith("off/")]
        assert on and off and sum(a["drafted_tokens"] for a in off) == 0
        # a step emits one token a request, or more when drafts are kept
        assert sum(a["steps"] for a in off) == level["arms"]["off"]["tokens"]
        assert 0 < sum(a["steps"] for a in on) <= level["arms"]["on"]["tokens"]
        assert all(a["drafted_per_step"] == round(a["drafted_tokens"] / a["steps"], 4) for a in on)
        assert "speculation_gate" in server  # the gate's state by the level's end, beside the arms' counters
    for row, level in zip(report["rows"], report["levels"]):  # the on/off table of the load issue's schema
        on, off = level["arms"]["on"], level["arms"]["off"]
        assert row["concurrency"] == level["concurrency"]
        assert row["ratio"] == round(on["request_tokens_per_s"]["p50"] / off["request_tokens_per_s"]["p50"], 3)
        assert row["p99_ttft_ms_off"] == round(off["ttft_s"]["p99"] * 1e3, 2)
        # a request whose chunks all reached the client at once has a TPOT of 0 (a loaded client reads them in one
        # go): the table leaves the ratio out then, as it does here (CI once met it)
        tpots = off["tpot_s"]["p50"], on["tpot_s"]["p50"]
        assert row["tpot_ratio_off_over_on"] == (round(tpots[0] / tpots[1], 3) if all(tpots) else None)
        lo, hi = row["ratio_ci95"]  # two requests an arm: the interval holds the ratio, however wide
        assert len(on["request_rates"]) == 2 and lo <= row["ratio"] <= hi


def test_openai_sdk_logprobs_batches_and_structured_output(live) -> None:
    """The SDK's own types parse what the server sends: chat logprobs, a batch of completion prompts with
    echo and legacy logprobs, and a JSON-schema response (its parse helper reads it back)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    with client(live) as c:
        chat = c.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2, **greedy())
        batch = c.completions.create(model=MODEL, prompt=["Hello", "Hi"], echo=True, logprobs=1, **greedy())
        shaped = c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "n", "schema": schema}})
    content = chat.choices[0].logprobs.content
    assert len(content) == 16 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert sorted(ch.index for ch in batch.choices) == [0, 1]
    for ch, prompt in zip(sorted(batch.choices, key=lambda ch: ch.index), ["Hello", "Hi"]):
        assert ch.text.startswith(prompt) and ch.logprobs.token_logprobs[0] is None
        assert len(ch.logprobs.tokens) == len(ch.logprobs.text_offset) == len(ch.logprobs.token_logprobs)
    doc = json.loads(shaped.choices[0].message.content)
    assert isinstance(doc["n"], int) and shaped.choices[0].finish_reason == "stop"
