"""Overlapped plain decoding (gateway/overlap.py): the same tokens as step-by-step decoding, greedy and
seeded, through stop tokens, length limits, aborts, arrivals, speculating neighbours and a tight KV pool;
no block left behind."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from draft.params import SpeculationParams
from engine_util import run_all, tiny_engine
from gateway.budget import BudgetConfig
from verify.sampling import SamplingParams

PLAIN = SpeculationParams(enabled=False)


def engine(overlap: bool, **kw):
    eng = tiny_engine(**kw)
    eng.config = replace(eng.config, overlap=overlap)
    return eng


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (3 + 5 * i % 11,), generator=g).tolist() for i in range(n)]


def both(requests, **kw):
    """The requests' outputs without and with overlap, and the overlapped engine (its pool checked whole)."""
    off, on = engine(False, **kw), engine(True, **kw)
    want, got = run_all(off, requests), run_all(on, requests)
    assert on.cache.pool.num_free == off.cache.pool.num_free == on.config.num_blocks
    assert not on.has_work()
    return want, got, on


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_greedy_tokens_match_step_by_step_decoding(batch: int) -> None:
    reqs = [(str(i), p, SamplingParams(temperature=0, max_tokens=9 + 3 * i, ignore_eos=True), PLAIN)
            for i, p in enumerate(prompts(batch))]
    want, got, eng = both(reqs)
    assert got == want and all(len(got[r]) == 9 + 3 * int(r) for r in got)
    assert eng.num_ahead > 0  # the overlapped path ran


def test_seeded_sampling_draws_the_same_tokens() -> None:
    reqs = [(str(i), p, SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=20, ignore_eos=True), PLAIN)
            for i, p in enumerate(prompts(5))]
    want, got, eng = both(reqs)
    assert got == want and eng.num_ahead > 0


def test_stop_tokens_and_the_context_limit_end_outputs_where_they_would() -> None:
    ps = prompts(4)
    first = engine(False)
    free = run_all(first, [(str(i), p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), PLAIN)
                           for i, p in enumerate(ps)])
    # each request stops at the token it emits 6th (an earlier emission of it stops it sooner: the same in both)
    reqs = [(str(i), p, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(free[str(i)][5],)), PLAIN)
            for i, p in enumerate(ps)]
    reqs.append(("long", list(range(60)) * 8 + [1] * 5, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                 PLAIN))  # 485 prompt tokens: the 512-token context ends it after 27
    want, got, _ = both(reqs, num_blocks=160)
    assert got == want
    assert len(got["long"]) == 512 - 485 and all(len(got[str(i)]) <= 6 for i in range(4))


def test_an_abort_while_a_step_is_in_flight_leaks_nothing() -> None:
    reqs = [(str(i), p, SamplingParams(temperature=0, max_tokens=25, ignore_eos=True), PLAIN)
            for i, p in enumerate(prompts(4))]
    want = run_all(engine(False), reqs)
    eng = engine(True)
    for rid, p, sp, spec in reqs:
        eng.add(rid, p, sp, spec)
    got = {rid: [] for rid, *_ in reqs}
    done, steps = set(), 0
    while eng.has_work():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
            done.add(o.request_id) if o.finished else None
        steps += 1
        if steps == 6:
            assert eng._inflight is not None  # the abort meets a launched step
            out = eng.abort("2")
            assert out is not None and out.finished and out.finish_reason == "abort"
            done.add("2")
    assert done == {"0", "1", "2", "3"}
    assert {r: got[r] for r in "013"} == {r: want[r] for r in "013"}
    assert got["2"] == want["2"][: len(got["2"])] and len(got["2"]) < 25  # what it had, nothing after
    assert eng.cache.pool.num_free == eng.config.num_blocks


def test_arrivals_and_speculating_neighbours_take_the_step_by_step_path() -> None:
    ps = prompts(6, seed=1)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    off, on = engine(False), engine(True)
    outs = []
    for eng in (off, on):
        got: dict[str, list[int]] = {}
        for i in range(3):
            eng.add(str(i), ps[i], greedy, PLAIN)
        for step in range(40):
            if step == 4:  # an arrival mid-stream, and a speculating request beside the plain ones
                eng.add("3", ps[3], greedy, PLAIN)
                eng.add("spec", ps[4], greedy, SpeculationParams(drafter="draft", tree=(2, 1)))
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        while eng.has_work():
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        outs.append(got)
        assert eng.cache.pool.num_free == eng.config.num_blocks
    assert outs[0] == outs[1] and all(len(v) == 16 for v in outs[1].values())
    assert on.num_ahead > 0


def test_a_tight_pool_falls_back_and_finishes_every_request() -> None:
    """12 blocks of 4 slots for three 20-token prompts growing 30 tokens: the overlapped path gives way when
    a next slot has no block, the scheduler preempts, and every request ends at its length."""
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reqs = [(str(i), [(7 * i + j) % 64 for j in range(20)], greedy, PLAIN) for i in range(3)]
    eng = engine(True, num_blocks=24, page_size=4)
    got = run_all(eng, reqs)
    assert all(len(v) == 30 for v in got.values())
    assert eng.num_ahead > 0 and eng.num_preemptions > 0
    assert eng.cache.pool.num_free == eng.config.num_blocks and not eng.has_work()


def test_arrivals_and_chunked_prefills_ride_the_overlapped_steps() -> None:
    """Plain requests arriving mid-stream, one with a prompt longer than a step's token budget (chunked over
    overlapped steps), and one asking for prompt logprobs (its prefill reads logits on the host: the engine
    steps one by one for it): the same tokens as step by step, and most steps launched ahead."""
    ps = prompts(4, seed=2)
    long_prompt = [(5 * j + 1) % 64 for j in range(300)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    arrivals = {3: [("a", ps[2], greedy)], 5: [("long", long_prompt, greedy)],
                9: [("lp", ps[3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=2))]}
    outs, engines = [], []
    for overlap in (False, True):
        eng = engine(overlap, num_blocks=200)
        got: dict[str, list[int]] = {}
        for i in range(2):
            eng.add(str(i), ps[i], greedy, PLAIN)
        step = 0
        while eng.has_work() or step <= max(arrivals):
            for rid, p, sp in arrivals.get(step, ()):
                eng.add(rid, p, sp, PLAIN)
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
                assert o.error is None, o.error
            step += 1
        outs.append(got)
        engines.append(eng)
        assert eng.cache.pool.num_free == eng.config.num_blocks
    assert outs[0] == outs[1] and sorted(outs[1]) == ["0", "1", "a", "long", "lp"]
    assert all(len(v) == 20 for v in outs[1].values())
    assert engines[1].num_ahead > engines[1].num_steps // 2


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_speculating_requests_overlap_where_the_budget_leaves_them_plain(drafter: str) -> None:
    """Adaptive speculating requests (the default tree): on steps where their acceptance pays no level and no
    probe is due, they ride the overlapped path; their output is plain decoding's either way. A batch whose
    roots fill the verify cap never drafts, so every step after the first can go ahead."""
    spec = SpeculationParams(drafter=drafter)
    reqs = [(str(i), p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), spec)
            for i, p in enumerate(prompts(4, seed=3))]
    plain = run_all(engine(False, num_blocks=200), [(r, p, sp, PLAIN) for r, p, sp, _ in reqs])
    want, got, eng = both(reqs, num_blocks=200)
    assert got == want == plain
    assert eng.num_ahead > 0

    capped = engine(True, num_blocks=200)
    sched = capped.scheduler
    sched.config = replace(sched.config, budget=replace(sched.config.budget, max_verify_tokens=4))
    got = run_all(capped, reqs)
    assert got == plain
    assert capped.num_ahead >= capped.num_steps - 3  # the prefill, the first plain step, the last


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_overlapped_steps_keep_the_budget_s_drafting_decisions(drafter: str) -> None:
    """With the acceptance-only budget, every request drafts, is probed and is kept plain on the same steps
    with and without overlap: steps, drafted and accepted tokens all match (an overlapped step counts as a
    plan for the probes' cadence, and its pending step toward each request's probe)."""
    stats = []
    for overlap in (False, True):
        eng = engine(overlap, num_blocks=200)
        for i, p in enumerate(prompts(4, seed=3)):
            eng.add(str(i), p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                    SpeculationParams(drafter=drafter))
        got = {}
        while eng.has_work():
            for o in eng.step():
                if o.finished:
                    got[o.request_id] = (o.stats.steps, o.stats.drafted_tokens, o.stats.accepted_tokens)
        stats.append(got)
    assert stats[0] == stats[1] and len(stats[1]) == 4
    assert sum(d for _, d, _ in stats[1].values()) > 0  # they did draft, and probe


def test_overlapped_plain_steps_price_the_plain_step() -> None:
    """The budget weighs a draft level against the plain step's measured time: overlapped steps record it
    (the span between two resolutions), where otherwise a batch that only ever overlaps would have none."""
    reqs = [(str(i), p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), PLAIN)
            for i, p in enumerate(prompts(4))]
    eng = engine(True, num_blocks=200)
    assert eng.scheduler.costs.seconds(4, 0) is None
    run_all(eng, reqs)
    assert eng.num_ahead > 20
    assert eng.scheduler.costs.seconds(4, 0) is not None and eng.scheduler.costs.seconds(4, 0) > 0


def test_logprobs_are_taken_beside_the_picks() -> None:
    """Requests asking for logprobs (greedy and seeded, top 0 and 3) go ahead too: their figures, taken on the
    device from the raw logits before the next replay overwrites them, are step-by-step decoding's."""
    reqs = [(str(i), p, SamplingParams(temperature=0 if i % 2 else 0.7, seed=i, max_tokens=12, ignore_eos=True,
                                       logprobs=(0, 3)[i % 2]), PLAIN)
            for i, p in enumerate(prompts(4, seed=4))]
    reqs.append(("none", prompts(1, seed=5)[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), PLAIN))
    runs = []
    for overlap in (False, True):
        eng = engine(overlap)
        for rid, p, sp, spec in reqs:
            eng.add(rid, p, sp, spec)
        got: dict[str, list] = {rid: [] for rid, *_ in reqs}
        while eng.has_work():
            for o in eng.step():
                lps = o.logprobs or [None] * len(o.new_token_ids)
                got[o.request_id] += list(zip(o.new_token_ids, lps))
        runs.append((got, eng.num_ahead))
    (want, _), (got, ahead) = runs
    assert got == want and ahead > 0
    assert all(lp is not None and len(lp.top) == (0, 3)[int(r) % 2] and lp.token_id == t
               for r in "0123" for t, lp in got[r])
    assert all(lp is None for _, lp in got["none"])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_penalties_bias_and_allowed_tokens_go_ahead(monkeypatch, temperature: float) -> None:
    """Repetition, frequency and presence penalties, a logit bias and allowed tokens, greedy and seeded: the
    pending pick is counted on the device before the next step's batched processing, and emitting it does
    not count it twice. The tokens are step-by-step decoding's with the same batched processing."""
    from verify import processing

    monkeypatch.setattr(processing, "BATCHED_CPU", True)  # both runs process the whole step at once
    base = dict(temperature=temperature, max_tokens=24, ignore_eos=True)
    params = [SamplingParams(repetition_penalty=1.3, seed=1, **base),
              SamplingParams(frequency_penalty=0.8, presence_penalty=0.5, seed=2, **base),
              SamplingParams(logit_bias=((3, 4.0), (5, -100.0)), seed=3, **base),
              SamplingParams(allowed_token_ids=tuple(range(10, 40)), repetition_penalty=1.2, seed=4, **base),
              SamplingParams(seed=5, **base)]
    reqs = [(str(i), p, sp, PLAIN) for i, (p, sp) in enumerate(zip(prompts(5, seed=6), params))]
    want, got, eng = both(reqs)
    assert got == want and eng.num_ahead > 10
    assert all(10 <= t < 40 for t in got["3"])  # allowed tokens held
    assert 5 not in got["2"]


def test_min_tokens_holds_stops_back_counting_the_pending_pick() -> None:
    """Greedy requests whose free run first emits a token at position 9: with it as their stop token and
    min_tokens 9, the hold (counting the pick still in flight as emitted) lets it end the output exactly
    there, as step by step; seeded ones with an early stop token end no sooner than min_tokens."""
    ps = prompts(8, seed=7)
    free = run_all(engine(False), [(str(i), p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), PLAIN)
                                   for i, p in enumerate(ps)])
    exact = [str(i) for i in range(8) if free[str(i)][9] not in free[str(i)][:9]]
    assert len(exact) >= 2
    reqs = [(r, ps[int(r)], SamplingParams(temperature=0, max_tokens=30, min_tokens=9,
                                           stop_token_ids=(free[r][9],)), PLAIN) for r in exact]
    reqs += [(f"s{i}", ps[i], SamplingParams(temperature=0.9, seed=i, max_tokens=30, min_tokens=9,
                                             stop_token_ids=(free[str(i)][2],)), PLAIN) for i in range(2)]
    want, got, eng = both(reqs)
    assert got == want and eng.num_ahead > 0
    assert all(got[r] == free[r][:10] for r in exact)  # stopped at the first position min_tokens allows
    assert all(len(v) >= 9 for v in got.values())


def test_the_default_overlaps_only_a_one_process_cuda_target() -> None:
    """``EngineConfig.overlap`` None (the default) resolves by the target: on the CPU a launch runs the whole
    forward before it returns, so nothing overlaps and steps go one by one; an explicit setting wins."""
    eng = tiny_engine()
    assert eng.config.overlap is None and not eng.overlaps
    reqs = [("a", prompts(1)[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), PLAIN)]
    run_all(eng, reqs)
    assert eng.num_ahead == 0
    eng.config = replace(eng.config, overlap=True)
    assert eng.overlaps
    run_all(eng, [("b", *reqs[0][1:])])
    assert eng.num_ahead > 0


def test_speculating_requests_go_ahead_while_the_gate_runs_plain_decoding() -> None:
    """Under the speculation gate's plain arm (gateway/budget.py SpecGate) a speculating request gets no tree
    and no probe, so its steps are overlapped like plain ones; the tokens stay the step-by-step ones."""
    from gateway.budget import SpecGate

    class PlainArm(SpecGate):  # the gate held in its plain arm: no step of the run moves it
        def allows(self, batch: int) -> bool:
            return False

        def observe(self, *args, **kwargs) -> None:
            pass

    reqs = [(str(i), p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), SpeculationParams(drafter="draft"))
            for i, p in enumerate(prompts(3))]
    want = run_all(engine(False), reqs)
    on = engine(True)
    on.scheduler.gate = PlainArm()
    got = run_all(on, reqs)
    assert got == want
    assert on.num_ahead > 0.8 * 40  # nearly every step went ahead: none drafted
    assert on.cache.pool.num_free == on.config.num_blocks


def test_gate_history_counts_the_overlapped_steps_of_each_block() -> None:
    """The engine tells the gate which steps launched the next one ahead (``SpecGate.history``'s ``ahead``):
    in plain blocks nearly all of them; in speculating blocks the steps the budget left plain (tree steps run
    one by one)."""
    from gateway.budget import SpecGate

    on = engine(True)
    on.scheduler.gate = SpecGate(block=4, explore=2)
    reqs = [(str(i), p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), SpeculationParams())
            for i, p in enumerate(prompts(2))]
    run_all(on, reqs)
    hist = on.scheduler.gate.history()
    plain = [h for h in hist if h["arm"] == "plain"]
    spec = [h for h in hist if h["arm"] == "spec"]
    assert plain and spec
    assert sum(h["ahead"] for h in plain) >= 0.7 * sum(h["steps"] for h in plain)
    assert all(0 <= h["ahead"] <= h["steps"] for h in hist)
    assert sum(h["ahead"] for h in hist) <= on.num_ahead


def test_steps_go_ahead_where_measured_costs_cut_the_trees_acceptance_keeps() -> None:
    """N-gram requests whose lookups the target confirms keep their trees by acceptance, but measured step costs
    that make every draft depth ruinous cut them in the plan: the overlapped step's test
    (``Scheduler.plans_plain``) sees the same cut, so steps keep going ahead instead of stopping the pipeline at
    each one; the tokens stay the step-by-step ones."""
    V = 64

    def rule(batch, cache):  # next token 7 t + 1: lookups in the repeating text are confirmed
        rows = batch.logits_indices.shape[0]
        out = torch.zeros(rows, V)
        at = batch.logits_indices
        out[torch.arange(rows), (batch.tokens[at] * 7 + 1) % V] = 5.0
        return out

    outs = []
    for overlap in (False, True):
        eng = engine(overlap, num_blocks=2048, page_size=16, max_running=8, vocab=V)
        eng.scheduler.config = replace(eng.scheduler.config, budget=BudgetConfig(cost_aware=True, gate=False))
        eng.scheduler.gate = None
        eng.target.forward = rule
        reqs = [(str(i), [(13 * i + j) % V for j in range(12)], SamplingParams(temperature=0, max_tokens=60,
                 ignore_eos=True), SpeculationParams(drafter="ngram")) for i in range(8)]
        for depth in range(1, 5):
            for _ in range(2):
                eng.scheduler.costs.observe(8, depth, 1.0, ("ngram",))  # every draft depth ruinous, fresh
        outs.append(run_all(eng, reqs))
        if overlap:
            seq_alpha = eng.scheduler.priors.start("ngram").alpha
            assert seq_alpha >= BudgetConfig().min_gain  # the acceptance alone would keep a level
            assert eng.num_ahead > 0.8 * 60  # nearly every step went ahead
            assert eng.cache.pool.num_free == eng.config.num_blocks
    assert outs[0] == outs[1]
