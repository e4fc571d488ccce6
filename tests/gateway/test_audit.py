"""The online losslessness audit: identity on real speculation, a caught (injected) mismatch and its log
record, replays only in idle capacity (they wait for real work and yield to it), the bounded queue, flags."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from draft.params import SpeculationParams
from engine_util import tiny_engine
from gateway.audit import AuditConfig, Auditor, first_difference
from gateway.cli import main, serve_options
from gateway.runner import EngineRunner
from gateway_util import MODEL, pool_is_full, run_app, wait_until
from verify.sampling import SamplingParams

AUDIT_ALL = AuditConfig(fraction=1.0, idle_s=0.0)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
BODY = {"model": MODEL, "prompt": "Hello world", "temperature": 0, "max_tokens": 40, "ignore_eos": True}


async def audited(client, count: int, timeout: float = 30.0) -> dict:
    """The stats snapshot once ``count`` replays were judged."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (snap := (await client.get("/v1/stats")).json())["audit"]["checked"] < count:
        assert asyncio.get_running_loop().time() < deadline, snap["audit"]
        await asyncio.sleep(0.02)
    return snap


def test_audit_finds_speculative_greedy_output_identical_and_skips_the_rest(tokenizer) -> None:
    speculative = [{"drafter": "draft", "tree": [3, 2, 1]}, {"drafter": "exact", "tree": [2, 2, 1]},
                   {"drafter": "draft"}, {"drafter": "ngram", "tree": [2, 1]}]
    others = [BODY | {"speculation": {"enabled": False}},  # nothing to compare against
              BODY | {"temperature": 0.8, "seed": 1}]  # sampled: equal in distribution, not token by token

    async def go(client, app):
        rs = await asyncio.gather(*(client.post("/v1/completions", json=BODY | {"speculation": s})
                                    for s in speculative),
                                  *(client.post("/v1/completions", json=b) for b in others))
        await audited(client, len(speculative))
        engine = app.state.gateway.engine
        await asyncio.to_thread(wait_until, lambda: pool_is_full(engine) and not engine.has_work())
        return [r.json() for r in rs], (await client.get("/v1/stats")).json(), (await client.get("/metrics")).text

    bodies, snap, metrics = run_app(tokenizer, go, audit=AUDIT_ALL)
    reports = [b["usage"]["speculation"] for b in bodies]
    assert sum(r["accepted_tokens"] for r in reports[:4]) > 0  # speculation really accepted drafts
    assert all(r["accepted_tokens"] < r["drafted_tokens"] for r in reports[:1])  # and really rejected some
    audit = snap["audit"]  # read once the engine is idle: a wrongly queued fifth replay would show here
    assert (audit["checked"], audit["identical"], audit["mismatches"], audit["identity_rate"]) == (4, 4, 0, 1.0)
    assert audit["pending"] == 0 and audit["last_mismatch"] is None
    # replays are not traffic: the arms hold exactly the six requests and their tokens
    arms = snap["arms"].values()
    assert sum(a["requests"] for a in arms) == 6 and sum(a["tokens"] for a in arms) == 6 * 40
    assert "specgate_audit_checked_total 4.0" in metrics and "specgate_audit_identity_rate 1.0" in metrics
    assert "specgate_audit_mismatches_total 0.0" in metrics
    steps = sum(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("specgate_target_steps_total{"))
    assert steps == sum(r["steps"] for r in reports)  # neither warm-up nor replays counted as steps


@pytest.mark.parametrize("log_prompts", [False, True])
def test_an_injected_mismatch_is_counted_and_logged(tokenizer, monkeypatch, caplog, log_prompts: bool) -> None:
    vocab = len(tokenizer)
    offer = Auditor.offer

    def corrupt(self, request_id, prompt_ids, sampling, tokens, finish_reason):  # as if speculation broke at 5
        tokens = tokens[:5] + [(tokens[5] + 1) % vocab] + tokens[6:]
        return offer(self, request_id, prompt_ids, sampling, tokens, finish_reason)

    monkeypatch.setattr(Auditor, "offer", corrupt)
    secret = "a private prompt"

    async def go(client, app):
        r = await client.post("/v1/completions", json=BODY | {"prompt": secret})
        return r.json(), await audited(client, 1), (await client.get("/metrics")).text

    with caplog.at_level(logging.INFO):
        body, snap, metrics = run_app(tokenizer, go,
                                      audit=AuditConfig(fraction=1.0, idle_s=0.0, log_prompts=log_prompts))
    (record,) = [r for r in caplog.records if r.name == "specgate.audit"]
    assert record.levelno == logging.WARNING
    assert record.request_id == body["id"] and record.position == 5
    assert record.speculative_token == (record.plain_token + 1) % vocab
    assert record.plain_text == tokenizer.decode([record.plain_token])
    assert record.speculative_text == tokenizer.decode([record.speculative_token])
    assert body["id"] in record.getMessage() and "token 5" in record.getMessage()
    assert (secret in record.getMessage()) == log_prompts
    if not log_prompts:
        assert all(secret not in r.getMessage() for r in caplog.records)
    audit = snap["audit"]
    assert (audit["checked"], audit["mismatches"], audit["identity_rate"]) == (1, 1, 0.0)
    assert audit["last_mismatch"] == {"request_id": body["id"], "position": 5,
                                      "speculative_token": record.speculative_token,
                                      "plain_token": record.plain_token}
    assert "specgate_audit_mismatches_total 1.0" in metrics and "specgate_audit_identity_rate 0.0" in metrics


class StepLog:
    """Wraps ``engine.step``: records which requests the engine held at each step."""

    def __init__(self, engine, hold=None) -> None:
        self.engine, self.real, self.hold = engine, engine.step, hold
        self.steps: list[set[str]] = []
        engine.step = self

    def __call__(self):
        ids = set(self.engine._seqs)
        self.steps.append(ids)
        if self.hold is not None:
            self.hold(ids)
        return self.real()

    def check_never_mixed(self) -> list[int]:
        """Indices of the steps that ran a replay; asserts none of them also ran a real request."""
        replay_steps = [i for i, ids in enumerate(self.steps) if any(r.startswith("audit:") for r in ids)]
        for i in replay_steps:
            assert len(self.steps[i]) == 1, f"step {i} ran a replay beside real work: {self.steps[i]}"
        return replay_steps


def run_runner(coro_fn, engine, auditor):
    async def main():
        runner = EngineRunner(engine, auditor=auditor)
        runner.start(asyncio.get_running_loop())
        try:
            return await coro_fn(runner)
        finally:
            await asyncio.to_thread(runner.shutdown)

    return asyncio.run(main())


async def finish(sub) -> list[int]:
    tokens = []
    while not (event := await asyncio.wait_for(sub.events.get(), 30)).finished:
        tokens += event.token_ids
    return tokens + event.token_ids


def test_replays_wait_until_no_real_request_is_live() -> None:
    engine = tiny_engine()
    steps = StepLog(engine)
    auditor = Auditor(AUDIT_ALL)

    async def go(runner):
        short = await runner.submit("short", [1, 2, 3], GREEDY, SpeculationParams(drafter="draft"))
        long = await runner.submit("long", [4, 5], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True),
                                   SpeculationParams(enabled=False))
        await finish(short)
        short_done = len(steps.steps)
        await finish(long)
        await asyncio.to_thread(wait_until, lambda: auditor.checked == 1)
        return short_done

    short_done = run_runner(go, engine, auditor)
    replay_steps = steps.check_never_mixed()
    long_steps = [i for i, ids in enumerate(steps.steps) if "long" in ids]
    assert replay_steps and replay_steps[0] > long_steps[-1] > short_done  # queued early, ran after "long"
    assert (auditor.checked, auditor.identical, auditor.interrupted) == (1, 1, 0)
    assert pool_is_full(engine)


def test_a_real_request_aborts_a_running_replay_which_reruns_later() -> None:
    engine = tiny_engine()
    replay_running = threading.Event()
    holder: dict = {}

    def hold(ids: set[str]) -> None:  # the replay's first step waits until a real request is in the inbox
        if any(r.startswith("audit:") for r in ids) and not replay_running.is_set():
            replay_running.set()
            wait_until(lambda: bool(holder["runner"]._inbox), timeout=20)

    steps = StepLog(engine, hold)
    auditor = Auditor(AUDIT_ALL)

    async def go(runner):
        holder["runner"] = runner
        first = await runner.submit("first", [1, 2, 3], GREEDY, SpeculationParams(drafter="draft"))
        want = await finish(first)
        await asyncio.to_thread(replay_running.wait, 20)
        second = await runner.submit("second", [1, 2, 3], GREEDY, SpeculationParams(enabled=False))
        got = await finish(second)
        await asyncio.to_thread(wait_until, lambda: auditor.checked == 1)
        return want, got

    want, got = run_runner(go, engine, auditor)
    assert want == got  # the request that interrupted the replay was served in full
    replay_steps = steps.check_never_mixed()
    second_steps = [i for i, ids in enumerate(steps.steps) if "second" in ids]
    # the interrupted replay ran one step, yielded, and ran again from scratch once "second" was done
    assert replay_steps[0] < second_steps[0] and replay_steps[1] > second_steps[-1]
    assert (auditor.checked, auditor.identical, auditor.interrupted) == (1, 1, 1)
    assert pool_is_full(engine)


def test_pending_queue_is_bounded_and_drops_its_oldest() -> None:
    auditor = Auditor(AuditConfig(fraction=1.0, max_pending=2))
    for rid in ("a", "b", "c"):
        assert auditor.offer(rid, [1], GREEDY, [5, 6], "length")
    assert auditor.dropped == 1 and [r.request_id for r in auditor._pending] == ["b", "c"]
    replay = auditor.next_replay()
    auditor.offer("d", [1], GREEDY, [5], "stop")
    auditor.requeue(replay)  # back to the front; the queue is full again, so the newest goes
    assert [r.request_id for r in auditor._pending] == ["b", "c"] and auditor.dropped == 2
    assert auditor.interrupted == 1


def test_selection_eligibility_and_reset() -> None:
    auditor = Auditor(AuditConfig(fraction=0.5))
    picked = [auditor.offer(f"r{i}", [1], GREEDY, [7, 8, 9], "length") for i in range(6)]
    assert picked == [False, True] * 3
    assert not auditor.offer("x", [1], GREEDY, [7], "abort") and not auditor.offer("y", [1], GREEDY, [], "stop")
    assert auditor.wants(True, GREEDY) and not auditor.wants(False, GREEDY)
    assert not auditor.wants(True, SamplingParams(temperature=0.7))
    replay = auditor.next_replay()
    assert replay.sampling.max_tokens == 3 and replay.engine_id == "audit:r1"  # "length": as many as it emitted
    auditor.reset()
    assert auditor.verdict(replay, [7, 8, 9]) is None and auditor.checked == 0  # from the old experiment
    assert auditor.snapshot()["pending"] == 0 and not Auditor(AuditConfig()).is_enabled


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([], [4]) == 0


def test_audit_flags_reach_the_server_config(tmp_path, capsys) -> None:
    args = serve_options().parse_args(["--audit-fraction", "0.25", "--audit-log-prompts"])
    assert (args.audit_fraction, args.audit_log_prompts) == (0.25, True)
    assert serve_options().parse_args([]).audit_fraction == 0.0
    with pytest.raises(ValueError, match="audit_fraction"):
        AuditConfig(fraction=1.5)
    path = tmp_path / "c.json"
    path.write_text('{"audit-fraction": 2}')
    assert main(["serve", "--config", str(path)]) == 2  # refused before any model loads
    assert "audit_fraction must be in [0, 1]" in capsys.readouterr().err
