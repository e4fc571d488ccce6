"""Logprobs, logit bias and min-p through the engine: logprobs checked against a teacher-forced forward of
the target, the same under speculation as without and cut with the tokens; a bias and min-p that steer
verification whatever the drafter proposes."""

from __future__ import annotations

import pytest
import torch

from draft.params import SpeculationParams
from engine_util import run_all, tiny_engine
from target.batch import Segment, build_batch
from verify import processing
from verify.logprobs import token_logprobs
from verify.sampling import SamplingParams

PROMPTS = [[5, 9, 2, 5, 9, 2, 5, 9], [1, 2, 3], [40, 41, 7, 7, 7, 7, 3]]
SPEC = {"off": SpeculationParams(enabled=False), "draft": SpeculationParams(drafter="draft", tree=(2, 2, 1)),
        "ngram": SpeculationParams(drafter="ngram", tree=(1, 1, 1)),
        "exact": SpeculationParams(drafter="exact", tree=(2, 1, 1))}


def run_with_logprobs(engine, sampling: SamplingParams, spec: SpeculationParams):
    """Tokens and logprob entries per request, and the most tokens one event carried; checks every event
    carries one entry per new token."""
    for i, p in enumerate(PROMPTS):
        engine.add(str(i), p, sampling, spec)
    toks = {str(i): [] for i in range(len(PROMPTS))}
    lps = {str(i): [] for i in range(len(PROMPTS))}
    done, widest = set(), 0
    while len(done) < len(PROMPTS):
        for out in engine.step():
            widest = max(widest, len(out.new_token_ids))
            assert out.error is None, out.error
            assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
            assert [e.token_id for e in out.logprobs] == out.new_token_ids
            toks[out.request_id] += out.new_token_ids
            lps[out.request_id] += out.logprobs
            if out.finished:
                done.add(out.request_id)
    return toks, lps, widest


def teacher_forced(engine, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V] log-probabilities of the target's plain forward over prompt + output."""
    model, ids = engine.target, prompt + output
    cache = model.new_cache(-(-len(ids) // 4) + 1, 4)
    logits = model.forward(build_batch([Segment(cache.new_table(), 0, ids, logits="all")], cache, "cpu"), cache)
    return torch.log_softmax(logits[len(prompt) - 1 : len(ids) - 1].float(), dim=-1)


@pytest.mark.parametrize("spec", list(SPEC))
def test_greedy_logprobs_match_a_teacher_forced_forward(spec: str) -> None:
    engine = tiny_engine()
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    toks, lps, widest = run_with_logprobs(engine, sampling, SPEC[spec])
    assert (widest > 1) == (spec != "off")  # speculative runs took rows from inside verified trees
    for i, prompt in enumerate(PROMPTS):
        ref = teacher_forced(engine, prompt, toks[str(i)])
        entries = lps[str(i)]
        got = torch.tensor([e.logprob for e in entries])
        want = ref.gather(1, torch.tensor(toks[str(i)])[:, None])[:, 0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for e, row in zip(entries, ref):
            assert len(e.top) == 3
            assert e.top[0][0] == e.token_id  # greedy: the emitted token is the most likely one
            values, ids = row.topk(3)
            assert [t for t, _ in e.top] == ids.tolist()
            torch.testing.assert_close(torch.tensor([lp for _, lp in e.top]), values, atol=1e-4, rtol=1e-4)


def test_speculative_and_plain_runs_report_the_same_logprobs() -> None:
    sampling = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    base_toks, base, _ = run_with_logprobs(tiny_engine(), sampling, SPEC["off"])
    engine = tiny_engine()
    toks, got, _ = run_with_logprobs(engine, sampling, SPEC["exact"])  # every draft accepted: multi-token steps
    assert toks == base_toks
    for rid in base:
        torch.testing.assert_close(torch.tensor([e.logprob for e in got[rid]]),
                                   torch.tensor([e.logprob for e in base[rid]]), atol=1e-4, rtol=1e-4)
        assert all(e.top == () for e in got[rid])


def test_sampled_logprobs_are_those_of_the_emitted_tokens() -> None:
    engine = tiny_engine()
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=10, ignore_eos=True, logprobs=2)
    toks, lps, _ = run_with_logprobs(engine, sampling, SPEC["draft"])
    for i, prompt in enumerate(PROMPTS):
        ref = teacher_forced(engine, prompt, toks[str(i)])  # raw: before temperature and top-p
        want = ref.gather(1, torch.tensor(toks[str(i)])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([e.logprob for e in lps[str(i)]]), want, atol=1e-4, rtol=1e-4)


def test_logprobs_are_cut_with_the_tokens_at_a_stop_token_and_max_tokens() -> None:
    engine = tiny_engine()
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = run_all(tiny_engine(), [("a", PROMPTS[0], greedy, SPEC["off"])])["a"]
    stop = free[5]
    first = free.index(stop)
    sampling = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=1, stop_token_ids=(stop,))
    engine.add("a", PROMPTS[0], sampling, SPEC["exact"])  # four tokens a step: the stop lands mid-step
    toks, entries = [], []
    while engine.has_work():
        for out in engine.step():
            toks += out.new_token_ids
            entries += out.logprobs
    assert toks == free[: min(first + 1, 7)]
    assert [e.token_id for e in entries] == toks


def test_no_logprobs_unless_asked() -> None:
    engine = tiny_engine()
    engine.add("a", PROMPTS[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), SPEC["draft"])
    while engine.has_work():
        assert all(out.logprobs is None for out in engine.step())


def test_token_logprobs_packs_one_copy_per_step() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=g, dtype=torch.float64).float()
    entries = token_logprobs(logits, [4, 0, 2], [7, 39, 0], top=4)
    ref = torch.log_softmax(logits, dim=-1)
    for e, row, tok in zip(entries, [4, 0, 2], [7, 39, 0]):
        assert e.token_id == tok and abs(e.logprob - ref[row, tok].item()) < 1e-6
        values, ids = ref[row].topk(4)
        assert [t for t, _ in e.top] == ids.tolist()
        assert max(abs(a - b) for (_, a), b in zip(e.top, values.tolist())) < 1e-6
    assert token_logprobs(logits, [], [], top=3) == []
    with pytest.raises(ValueError, match="rows"):
        token_logprobs(logits, [1], [1, 2], top=0)


@pytest.mark.parametrize("spec", ["off", "draft", "ngram"])
def test_a_large_logit_bias_steers_greedy_verification(spec: str) -> None:
    """+100 on one token makes it the argmax at every position: the output is that token throughout, and a
    drafter's proposals are verified against the biased logits, not the raw ones."""
    engine = tiny_engine()
    sampling = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={17: 100.0})
    got = run_all(engine, [(str(i), p, sampling, SPEC[spec]) for i, p in enumerate(PROMPTS)])
    assert all(toks == [17] * 10 for toks in got.values())
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks


@pytest.mark.parametrize("spec", ["off", "draft", "exact"])
def test_a_negative_bias_bans_tokens_and_speculation_agrees(spec: str) -> None:
    """-100 on the plain greedy choices: none of them is emitted again, and greedy speculative output with the
    bias equals plain output with it (the exact drafter proposes the unbiased argmax, which must be refused)."""
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = run_all(tiny_engine(), [(str(i), p, plain, SPEC["off"]) for i, p in enumerate(PROMPTS)])
    banned = sorted({t for toks in free.values() for t in toks[:3]})
    biased = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={t: -100 for t in banned})
    want = run_all(tiny_engine(), [(str(i), p, biased, SPEC["off"]) for i, p in enumerate(PROMPTS)])
    got = run_all(tiny_engine(), [(str(i), p, biased, SPEC[spec]) for i, p in enumerate(PROMPTS)])
    assert got == want
    assert all(t not in banned for toks in got.values() for t in toks)


def test_sampled_bias_bans_tokens() -> None:
    banned = list(range(0, 64, 2))
    s = SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, logit_bias={t: -100 for t in banned})
    got = run_all(tiny_engine(), [(str(i), p, s, SPEC["draft"]) for i, p in enumerate(PROMPTS)])
    assert all(t % 2 == 1 for toks in got.values() for t in toks)


def test_bad_logit_bias_and_logprobs_are_refused() -> None:
    engine = tiny_engine()
    with pytest.raises(ValueError, match="logit_bias names token 64"):
        engine.add("a", [1, 2], SamplingParams(logit_bias={64: 1.0}))
    for bad, field in (({"logit_bias": {3: 101}}, "logit_bias"), ({"logit_bias": {-1: 1}}, "logit_bias"),
                       ({"logit_bias": {3: float("nan")}}, "logit_bias"), ({"logit_bias": {3: "x"}}, "logit_bias"),
                       ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks and not engine.has_work()


@pytest.mark.parametrize("spec", ["off", "draft", "ngram"])
def test_min_p_one_samples_the_argmax(spec: str) -> None:
    """min_p = 1 keeps only the most likely token: sampled output is greedy output, under speculation too
    (the draft samples from its own distribution; the target's processing decides)."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = run_all(tiny_engine(), [(str(i), p, greedy, SPEC["off"]) for i, p in enumerate(PROMPTS)])
    sampled = SamplingParams(temperature=1.3, min_p=1.0, seed=5, max_tokens=12, ignore_eos=True)
    got = run_all(tiny_engine(), [(str(i), p, sampled, SPEC[spec]) for i, p in enumerate(PROMPTS)])
    assert got == want


def collect_prompt_logprobs(engine, requests) -> dict[str, list]:
    """Run (id, prompt, sampling, spec) requests; each one's prompt logprobs, checking they come once, with the
    request's first tokens."""
    for rid, prompt, sampling, spec in requests:
        engine.add(rid, prompt, sampling, spec)
    got: dict[str, list] = {}
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            if out.prompt_logprobs is not None:
                assert out.request_id not in got and out.new_token_ids
                got[out.request_id] = out.prompt_logprobs
    return got


@pytest.mark.parametrize("chunk", [256, 3])
def test_prompt_logprobs_match_a_teacher_forced_forward(monkeypatch, chunk: int) -> None:
    """Every prompt token after the first, scored by the prefill (in chunks of ``chunk`` tokens), including a
    second request whose prompt sits in the prefix cache: it computes its prompt again to score it."""
    import gateway.scheduler as scheduler

    monkeypatch.setattr(scheduler, "PROMPT_LOGPROBS_CHUNK", chunk)
    engine = tiny_engine()
    prompt = list(range(3, 30))  # six full blocks of 4: the second run finds them cached
    sampling = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    first = collect_prompt_logprobs(engine, [("a", prompt, sampling, SPEC["draft"])])
    again = collect_prompt_logprobs(engine, [("b", prompt, sampling, SPEC["draft"]),
                                             ("c", [7], sampling, SPEC["off"])])
    ref = teacher_forced(engine, prompt[:1], prompt[1:])  # row j scores prompt[j + 1]
    for entries in (first["a"], again["b"]):
        assert [e.token_id for e in entries] == prompt[1:]
        want = ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([e.logprob for e in entries]), want, atol=1e-4, rtol=1e-4)
        for e, row in zip(entries, ref):
            assert [t for t, _ in e.top] == row.topk(2).indices.tolist()
    assert again["c"] == []  # a one-token prompt has nothing to score
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks


def test_prompt_logprobs_survive_preemption_once() -> None:
    """A pool too small for the batch preempts sequences, which recompute prompt and output: each still reports
    every prompt position exactly once, and the same figures as alone."""
    ps = [[(7 * i + j) % 60 + 1 for j in range(10 + i)] for i in range(8)]
    sampling = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=0)
    want = {str(i): collect_prompt_logprobs(tiny_engine(), [(str(i), p, sampling, SPEC["off"])])[str(i)]
            for i, p in enumerate(ps)}
    engine = tiny_engine(num_blocks=24, page_size=4)
    got = collect_prompt_logprobs(engine, [(str(i), p, sampling, SPEC["draft"]) for i, p in enumerate(ps)])
    assert engine.num_preemptions > 0
    for rid, entries in want.items():
        assert [e.token_id for e in got[rid]] == [e.token_id for e in entries] == ps[int(rid)][1:]
        torch.testing.assert_close(torch.tensor([e.logprob for e in got[rid]]),
                                   torch.tensor([e.logprob for e in entries]), atol=1e-4, rtol=1e-4)


def penalised_greedy(engine, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    """The definition, one token at a time: the target's logits after prompt + output, bias and penalties
    applied with the output so far (verify.sampling.apply_penalties), argmax."""
    from verify.sampling import apply_penalties

    V = engine.target.config.vocab_size
    mask = torch.zeros(V, dtype=torch.bool)
    mask[prompt] = True
    out: list[int] = []
    for _ in range(n):
        model, ids = engine.target, prompt + out
        cache = model.new_cache(-(-len(ids) // 4) + 1, 4)
        logits = model.forward(build_batch([Segment(cache.new_table(), 0, ids)], cache, "cpu"), cache)  # [1, V]
        counts = torch.bincount(torch.tensor(out, dtype=torch.int64), minlength=V)
        out.append(int(apply_penalties(logits, params, mask, counts).argmax()))
    return out


@pytest.mark.parametrize("batched", [False, True], ids=["per-sequence", "batched"])
@pytest.mark.parametrize("spec", list(SPEC))
def test_greedy_penalties_and_bias_follow_their_definition_under_speculation(monkeypatch, spec: str,
                                                                              batched: bool) -> None:
    """Penalties and a bias, processed per sequence in acceptance (the CPU's path) or for every tree row in
    the step's batched pass (CUDA's), give what decoding one token at a time by the definition gives: each
    row counts the output before the root plus its own path."""
    monkeypatch.setattr(processing, "BATCHED_CPU", batched)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, repetition_penalty=1.8,
                            frequency_penalty=0.6, presence_penalty=0.5, logit_bias={3: 2.0, 9: -1.0})
    engine = tiny_engine()
    got = run_all(engine, [(str(i), p, params, SPEC[spec]) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        assert got[str(i)] == penalised_greedy(engine, prompt, params, 14), (spec, i)
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks


def held_reference(engine, prompt: list[int], stop: int, min_tokens: int, max_tokens: int) -> list[int]:
    """Plain greedy decoding by whole forwards, the stop token masked while the output is shorter than
    min_tokens, ended by it after."""
    out: list[int] = []
    while len(out) < max_tokens:
        row = teacher_forced(engine, prompt, out + [0])[-1]  # the row after prompt + out
        if len(out) < min_tokens:
            row[stop] = float("-inf")
        out.append(int(row.argmax()))
        if out[-1] == stop:
            break
    return out


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("spec", list(SPEC))
def test_min_tokens_holds_the_stop_token_back_under_every_drafter(spec: str, batched: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processing, "BATCHED_CPU", batched)
    engine = tiny_engine()
    free = run_all(tiny_engine(), [("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                    SPEC["off"])])["a"]
    stop = free[1]  # the output would end at its second token; the exact drafter proposes the stop token
    want = held_reference(engine, PROMPTS[0], stop, min_tokens=6, max_tokens=12)
    assert stop not in want[:6] and len(want) > 2
    sampling = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop,), min_tokens=6)
    # a penalty sends the request through the logit processing too (its own path on the CPU)
    penalised = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop,), min_tokens=6,
                               logit_bias={3: 0.0})
    got = run_all(engine, [("a", PROMPTS[0], sampling, SPEC[spec]), ("b", PROMPTS[0], penalised, SPEC[spec])])
    assert got["a"] == want and got["b"] == want
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks


def test_sampled_output_never_stops_before_min_tokens() -> None:
    engine = tiny_engine()
    free = run_all(tiny_engine(), [("a", PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                    SPEC["off"])])["a"]
    stop = free[0]  # the likeliest first token, so sampling meets it often
    base = dict(temperature=1.0, max_tokens=10, ignore_eos=True, stop_token_ids=(stop,))
    outs = run_all(engine, [(f"{k}{i}", PROMPTS[1], SamplingParams(seed=i, min_tokens=k, **base), SPEC["exact"])
                            for i in range(12) for k in (0, 4)])
    early = [o for rid, o in outs.items() if rid.startswith("0") and stop in o[:4]]
    assert early  # without min_tokens the stop token comes early in some outputs
    for i in range(12):
        o = outs[f"4{i}"]
        assert stop not in o[:4] and (len(o) == 10 or o[-1] == stop)


def test_min_tokens_is_checked() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    engine = tiny_engine()
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        engine.add("g", PROMPTS[1], SamplingParams(max_tokens=8, min_tokens=2, grammar='{"type": "regex"}'))


def allowed_reference(engine, prompt: list[int], allowed: list[int], max_tokens: int) -> list[int]:
    """Plain greedy decoding by whole forwards, the argmax taken over the allowed tokens only."""
    out: list[int] = []
    keep = torch.tensor(allowed)
    while len(out) < max_tokens:
        row = teacher_forced(engine, prompt, out + [0])[-1]
        out.append(int(keep[row[keep].argmax()]))
    return out


@pytest.mark.parametrize("batched", [False, True], ids=["per-sequence", "batched"])
@pytest.mark.parametrize("spec", list(SPEC))
def test_allowed_token_ids_restrict_greedy_output_under_every_drafter(spec: str, batched: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's allowed_token_ids: greedy output is the argmax over the allowed tokens at every position (the
    definition, decoded one whole forward at a time), whatever a drafter proposes outside them; with a bias on
    one allowed token, and through both logit-processing paths."""
    monkeypatch.setattr(processing, "BATCHED_CPU", batched)
    engine = tiny_engine()
    allowed = [3, 11, 17, 29, 40, 41, 50]
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed)
    got = run_all(engine, [(str(i), p, plain, SPEC[spec]) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        assert got[str(i)] == allowed_reference(engine, prompt, allowed, 10), (spec, i)
    biased = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed,
                            logit_bias={29: 100.0, 5: 100.0})  # the bias on 5 cannot let it through
    got = run_all(engine, [(str(i), p, biased, SPEC[spec]) for i, p in enumerate(PROMPTS)])
    assert all(toks == [29] * 6 for toks in got.values())
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks


def test_sampled_output_keeps_to_the_allowed_tokens() -> None:
    allowed = list(range(1, 64, 3))
    outs = run_all(tiny_engine(), [(str(i), PROMPTS[i % 3], SamplingParams(temperature=1.0, seed=i, max_tokens=16,
                                                                          ignore_eos=True, allowed_token_ids=allowed),
                                    SPEC["draft" if i % 2 else "exact"]) for i in range(8)])
    emitted = {t for o in outs.values() for t in o}
    assert emitted <= set(allowed) and len(emitted) > 3  # sampled, so more than one allowed token shows up


def test_allowed_token_ids_are_checked() -> None:
    engine = tiny_engine()
    with pytest.raises(ValueError, match="allowed_token_ids names token 64"):
        engine.add("a", [1, 2], SamplingParams(allowed_token_ids=[3, 64]))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[-1])
    with pytest.raises(ValueError, match="allowed_token_ids cannot be combined"):
        engine.add("g", [1, 2], SamplingParams(allowed_token_ids=[3], grammar='{"type": "regex"}'))
    with pytest.raises(ValueError, match="holds only stop tokens"):
        engine.add("s", [1, 2], SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(3, 4),
                                               ignore_eos=True, allowed_token_ids=[4, 3]))
    assert SamplingParams(allowed_token_ids=[9, 3, 9]).allowed_token_ids == (3, 9)
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks and not engine.has_work()
