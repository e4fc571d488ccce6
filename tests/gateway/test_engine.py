"""The engine end to end on tiny random models: greedy losslessness for every drafter and tree shape,
batching, seeded sampling, KV pool hygiene, and bad input."""

from __future__ import annotations

import pytest
import torch

from draft.params import SpeculationParams
from engine_util import run_all, tiny_engine
from verify.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
TREES = [(1, 1, 1, 1), (2, 2, 1), (4, 2, 2, 1)]


def prompts(n: int, vocab: int = 64, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(0, vocab, (3 + i % 7,), generator=g).tolist()
        out.append(base * 3 if i % 2 else base)  # repeats give the n-gram drafter something to find
    return out


def reference(ps: list[list[int]], sampling: SamplingParams = GREEDY) -> list[list[int]]:
    eng = tiny_engine()
    got = run_all(eng, [(str(i), p, sampling, SpeculationParams(enabled=False)) for i, p in enumerate(ps)])
    return [got[str(i)] for i in range(len(ps))]


@pytest.fixture(scope="module")
def ref20() -> tuple[list[list[int]], list[list[int]]]:
    ps = prompts(20)
    return ps, reference(ps)


@pytest.mark.parametrize("drafter", ["self", "ngram", "exact", "draft"])
@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_speculation_is_token_identical(ref20, drafter, tree, batch) -> None:
    ps, want = ref20
    eng = tiny_engine()
    spec = SpeculationParams(drafter=drafter, tree=tree)
    got: dict[str, list[int]] = {}
    for start in range(0, len(ps), batch):
        chunk = range(start, min(start + batch, len(ps)))
        got |= run_all(eng, [(str(i), ps[i], GREEDY, spec) for i in chunk])
    assert [got[str(i)] for i in range(len(ps))] == want
    assert eng.cache.pool.num_free == eng.cache.pool.num_blocks
    for d in eng.drafters.values():
        if hasattr(d, "cache"):
            assert d.cache.pool.num_free == d.cache.pool.num_blocks


def test_exact_draft_accepts_everything() -> None:
    eng = tiny_engine()
    eng.add("a", [1, 2, 3], GREEDY, SpeculationParams(drafter="exact", tree=(1, 1, 1)))
    stats = None
    while eng.has_work():
        for o in eng.step():
            stats = o.stats
    # every step but possibly the last (cut by max_tokens) emits depth + 1 = 4 tokens
    assert stats.accepted_tokens == stats.drafted_tokens
    assert stats.mean_accepted_length > 3.0


def test_mixed_batch_spec_on_and_off_agree(ref20) -> None:
    ps, want = ref20
    eng = tiny_engine()
    reqs = [(str(i), p, GREEDY, SpeculationParams(enabled=bool(i % 2), drafter="draft")) for i, p in enumerate(ps)]
    got = run_all(eng, reqs)
    assert [got[str(i)] for i in range(len(ps))] == want


def test_seeded_sampling_reproduces() -> None:
    s = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    spec = SpeculationParams(drafter="draft", tree=(2, 2, 1))
    a = run_all(tiny_engine(), [("x", [5, 6, 7], s, spec)])
    b = run_all(tiny_engine(), [("x", [5, 6, 7], s, spec)])
    assert a == b and len(a["x"]) == 20


def test_preemption_keeps_output_identical() -> None:
    ps = prompts(8)
    want = reference(ps)
    eng = tiny_engine(num_blocks=24, page_size=4)  # too small for 8 sequences of ~40 tokens at once
    got = run_all(eng, [(str(i), p, GREEDY, SpeculationParams(drafter="draft")) for i, p in enumerate(ps)])
    assert [got[str(i)] for i in range(len(ps))] == want
    assert eng.num_preemptions > 0
    assert eng.cache.pool.num_free == eng.cache.pool.num_blocks


def test_stop_token_and_max_tokens() -> None:
    ps = prompts(1)
    full = reference(ps)[0]
    stop = full[5]
    eng = tiny_engine()
    cut = run_all(eng, [("s", ps[0], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(stop,)),
                         SpeculationParams(drafter="exact"))])["s"]
    assert cut == full[: full.index(stop) + 1]
    short = run_all(eng, [("m", ps[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                           SpeculationParams(drafter="exact"))])["m"]
    assert short == full[:3]


def test_abort_frees_every_block() -> None:
    eng = tiny_engine()
    for i, p in enumerate(prompts(4)):
        eng.add(str(i), p, GREEDY, SpeculationParams(drafter="draft"))
    eng.step()
    eng.step()
    assert eng.cache.pool.num_free < eng.cache.pool.num_blocks
    for i in range(4):
        out = eng.abort(str(i))
        assert out.finished and out.finish_reason == "abort"
    assert not eng.has_work()
    assert eng.cache.pool.num_free == eng.cache.pool.num_blocks
    assert eng.drafters["draft"].cache.pool.num_free == eng.drafters["draft"].cache.pool.num_blocks


def test_failed_step_fails_its_requests_and_frees_blocks(monkeypatch) -> None:
    eng = tiny_engine()
    eng.add("a", [1, 2, 3, 4], GREEDY, SpeculationParams(drafter="draft"))
    eng.step()

    def boom(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(eng.target, "forward", boom)
    outs = eng.step()
    assert [o.finish_reason for o in outs] == ["error"] and "injected" in outs[0].error
    assert eng.cache.pool.num_free == eng.cache.pool.num_blocks
    assert eng.drafters["draft"].cache.pool.num_free == eng.drafters["draft"].cache.pool.num_blocks


@pytest.mark.parametrize("prompt, sampling, spec, message", [
    ([], GREEDY, SpeculationParams(), "prompt is empty"),
    (list(range(10)) * 60, GREEDY, SpeculationParams(), "context"),
    ([1, 2], GREEDY, SpeculationParams(drafter="nope"), "unknown drafter"),
    ([1, 99], GREEDY, SpeculationParams(), "vocabulary"),
])
def test_bad_input_is_refused_and_changes_nothing(prompt, sampling, spec, message) -> None:
    eng = tiny_engine()
    with pytest.raises(ValueError, match=message):
        eng.add("bad", prompt, sampling, spec)
    assert not eng.has_work() and eng.cache.pool.num_free == eng.cache.pool.num_blocks


def test_bad_sampling_params_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-3)


def test_sequence_larger_than_the_pool_ends_with_length() -> None:
    eng = tiny_engine(num_blocks=6, page_size=4)  # 24 slots in all
    got = run_all(eng, [("big", [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                         SpeculationParams(drafter="draft"))])
    assert 15 <= len(got["big"]) < 24
    assert eng.cache.pool.num_free == eng.cache.pool.num_blocks


def test_adaptive_budget_turns_speculation_off_for_a_bad_draft() -> None:
    """No tree in the request: the budget adapts. A draft that never agrees ends in plain decoding
    (bar the periodic probes); one that always agrees keeps the full template."""
    eng = tiny_engine(draft_noise=50.0)  # a draft of pure noise
    eng.add("bad", [1, 2, 3], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
            SpeculationParams(drafter="draft"))
    eng.add("good", [1, 2, 3], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
            SpeculationParams(drafter="exact"))
    stats = {}
    while eng.has_work():
        for o in eng.step():
            stats[o.request_id] = o.stats
    bad, good = stats["bad"], stats["good"]
    assert bad.drafted_tokens < bad.steps  # far fewer than the template's 5 nodes a step
    assert good.drafted_tokens >= 4 * good.steps  # the (2, 2, 1) template, 5 nodes, kept nearly every step
    assert good.mean_accepted_length > 3.5


def test_measured_step_cost_turns_an_accurate_but_slow_draft_off() -> None:
    """The draft always agrees, but each proposal costs 0.5 s against a 30 ms target forward: the
    cost-aware budget measures that and decodes plainly. Output stays the target's. With the drafter fast
    again, the next re-measure (every ``reprobe`` steps) brings the tree back. The target's fixed 30 ms
    dominates every step, so what the budget sees does not hang on this machine's speed or load. The gate
    (SpecGate), which runs speculation and plain decoding in blocks of steps and keeps the faster, runs short
    blocks, exploring one in four whatever the losing arm's shortfall, so that its exploring block comes
    within the fast run."""
    import time

    from gateway.budget import SpecGate

    eng = tiny_engine(cost_aware=True)
    eng.scheduler.costs.reprobe = 20
    eng.scheduler.gate = SpecGate(block=4, explore=4, max_explore=4)
    forward = eng.target.forward
    eng.target.forward = lambda *a, **k: (time.sleep(0.03), forward(*a, **k))[1]
    exact = eng.drafters["exact"]
    propose = exact.propose
    exact.propose = lambda reqs: (time.sleep(0.5), propose(reqs))[1]
    greedy = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    ref = run_all(tiny_engine(), [("ref", [1, 2, 3], greedy, SpeculationParams(enabled=False))])

    def run(rid: str):
        eng.add(rid, [1, 2, 3], greedy, SpeculationParams(drafter="exact"))
        tokens, stats = [], None
        while eng.has_work():
            for o in eng.step():
                tokens += o.new_token_ids
                stats = o.stats
        return tokens, stats

    tokens, slow = run("slow")
    assert tokens == ref["ref"]
    costs = eng.scheduler.costs
    # plain steps measured far cheaper than one drafted level, so no deeper level was even tried
    assert costs.seconds(1, 0) < costs.seconds(1, 1, ("exact",)) / 2
    assert costs.seconds(1, 3, ("exact",)) is None
    assert slow.steps > 60  # nearly one token a step: the template (4 tokens a step here) was dropped
    exact.propose = propose
    tokens, fast = run("fast")
    assert tokens == ref["ref"]
    assert fast.drafted_tokens > fast.steps  # most steps speculate again
    gate = eng.scheduler.gate.summary()["1"]  # the engine timed both arms end to end; speculation won
    assert gate["speculate"] and gate["spec_tok_s"] > gate["plain_tok_s"] > 0


def test_the_gate_counts_no_step_whose_roots_fill_the_verify_cap() -> None:
    """With three speculating sequences under a verify cap of three tokens every tree is cut away in both of the
    gate's arms: those steps tell the arms nothing, and the gate takes none of them. Once one sequence has
    ended, two roots leave room for a draft node and the gate times its blocks again."""
    from dataclasses import replace

    from gateway.budget import SpecGate

    eng = tiny_engine(cost_aware=True)
    sched = eng.scheduler
    sched.config = replace(sched.config, budget=replace(sched.config.budget, max_verify_tokens=3))
    sched.gate = SpecGate(block=4, explore=4, max_explore=4)
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=20)
    for i, n in enumerate((20, 60, 60)):
        eng.add(str(i), [1, 2, 3 + i], replace(greedy, max_tokens=n), SpeculationParams(drafter="exact"))
    while "0" in eng._seqs:  # all three decode: nothing counted
        eng.step()
    assert sched.gate.summary() == {} and not sched.gate._open
    while eng.has_work():
        eng.step()
    assert "2" in sched.gate.summary()  # two decoding sequences: the bucket of 2 was timed


def test_sibling_waits_for_its_leaders_prompt_and_prefills_only_the_rest() -> None:
    """prefix_of (the choices of an n > 1 request): added together, the sibling is admitted only once the
    leader's prompt is cached, and takes every full block from the cache. Without it both compute it."""
    prompt = list(range(1, 31))  # 29 prefilled tokens: 7 full blocks of 4
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3)
    for linked, want_hits in ((True, 7), (False, 0)):
        eng = tiny_engine()
        leader = eng.add("a", prompt, GREEDY, SpeculationParams(drafter="draft"))
        sibling = eng.add("b", prompt, sampled, SpeculationParams(drafter="draft"), prefix_of="a" if linked else None)
        got = {"a": [], "b": []}
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
        assert (sibling.status.value, leader.is_prefilling) == ("waiting" if linked else "running", False)
        while eng.has_work():
            for o in eng.step():
                got[o.request_id] += o.new_token_ids
        assert eng.cache.pool.prefix_hit_blocks == want_hits
        assert eng.cache.pool.num_free == eng.cache.pool.num_blocks
        alone = run_all(tiny_engine(), [("b", prompt, sampled, SpeculationParams(drafter="draft"))])
        assert got["b"] == alone["b"]  # same seed, same tokens, whether it shared the prompt or not
        assert got["a"] == reference([prompt])[0]


def test_prefix_cache_reuses_blocks_and_keeps_output() -> None:
    shared = list(range(1, 30))  # 7 full blocks of 4
    ps = [shared + [40 + i] for i in range(4)]
    want = reference(ps)
    eng = tiny_engine()
    first = run_all(eng, [("0", ps[0], GREEDY, SpeculationParams(drafter="draft"))])
    hits_before = eng.cache.pool.prefix_hit_blocks
    rest = run_all(eng, [(str(i), ps[i], GREEDY, SpeculationParams(drafter="draft")) for i in range(1, 4)])
    assert [first["0"]] + [rest[str(i)] for i in range(1, 4)] == want
    assert eng.cache.pool.prefix_hit_blocks - hits_before >= 3 * 7
    assert eng.cache.pool.num_free == eng.cache.pool.num_blocks  # parked blocks count as free


def test_a_lookup_that_finds_nothing_counts_against_its_sequences_acceptance() -> None:
    """The n-gram drafter offered levels it cannot fill (no match): each such step is one failed level for the
    sequence and for the drafter's prior, so the budget stops promising itself the prior's 0.5 -- while a
    drafter that fills its levels keeps its figure."""
    eng = tiny_engine()
    eng.drafters["ngram"].continuations = lambda *a, **k: []  # never a match
    long = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)  # long enough for the prior to count
    eng.add("miss", [1, 2, 3], long, SpeculationParams(drafter="ngram"))
    eng.add("miss2", [4, 5, 6], long, SpeculationParams(drafter="ngram"))
    eng.add("hit", [1, 2, 3], GREEDY, SpeculationParams(drafter="exact"))
    seqs = {rid: eng._seqs[rid] for rid in ("miss", "hit")}
    while eng.has_work():
        eng.step()
    assert seqs["miss"].stats.drafted_tokens == 0
    assert seqs["miss"].acceptance.alpha < 0.2
    assert seqs["hit"].acceptance.alpha > 0.8  # the exact drafter is always right
    assert eng.scheduler.priors.start("ngram").alpha < 0.2  # the next n-gram request starts from that record


def test_cached_tokens_are_the_first_admissions_prefix_hits() -> None:
    """RequestOutput.cached_tokens: whole blocks of a prompt the prefix cache held when the request was first
    admitted (never its last token); a preemption's recompute, which finds its own blocks, does not change it."""
    ps = prompts(8)
    eng = tiny_engine(num_blocks=24, page_size=4)  # too small for 8 sequences of ~40 tokens at once: preemption
    first: dict[str, int] = {}
    for i, p in enumerate(ps):
        eng.add(str(i), p, GREEDY, SpeculationParams(drafter="draft"))
    eng.add("again", ps[0], GREEDY, SpeculationParams(enabled=False))  # the same prompt as request 0, queued last
    while eng.has_work():
        for out in eng.step():
            first.setdefault(out.request_id, out.cached_tokens)
            assert out.cached_tokens == first[out.request_id]  # one figure for the request's whole life
    assert eng.num_preemptions > 0
    assert all(first[str(i)] == 0 for i in range(len(ps)))  # distinct prompts (a shared head would be cached)
    n = len(ps[0])
    assert first["again"] % 4 == 0 and n - 4 <= first["again"] < n  # request 0's blocks, all but the last token



def test_an_ngram_table_of_the_targets_own_text_drafts_losslessly_and_is_accepted(ref20) -> None:
    """With a table built from the target's greedy text (draft/ngram.py, NgramTable), the n-gram drafter drafts
    on steps its own lookup finds nothing: output is still plain decoding's, and more drafts are kept."""
    from draft.ngram import NgramTable

    ps, want = ref20
    spec = SpeculationParams(drafter="ngram", tree=(2, 2, 1))
    kept = {}
    for arm in ("alone", "table"):
        eng = tiny_engine()
        if arm == "table":
            eng.drafters["ngram"].table = NgramTable.build(want, min_n=1, max_n=3, min_count=1)
        for i, p in enumerate(ps):
            eng.add(str(i), p, GREEDY, spec)
        got = {str(i): [] for i in range(len(ps))}
        kept[arm] = 0
        while eng.has_work():
            for o in eng.step():
                got[o.request_id] += o.new_token_ids
                if o.finished:
                    kept[arm] += o.stats.accepted_tokens
        assert [got[str(i)] for i in range(len(ps))] == want, arm
        assert eng.cache.pool.num_free == eng.cache.pool.num_blocks
    assert kept["table"] > 2 * kept["alone"], kept


def test_the_gate_chooses_the_drafter_of_requests_that_name_none() -> None:
    """A gate with drafters measures each in order (here 'draft', a noisy copy slowed to 40 ms a proposal,
    then 'exact', the target itself), settles on the faster, and moves the adaptive requests that named no
    drafter to it mid-stream: their output stays the target's, and the drafter they leave keeps none of their
    K/V blocks. A request that named its drafter, and one that fixed its tree, keep theirs. The target's
    forward takes 10 ms more, so that the arms' order does not hang on this machine's speed."""
    import time

    from gateway.budget import SpecGate

    steps: list[list] = []  # per step: whether a sequence changed drafter, then whether the gate counted it

    class Spy(SpecGate):
        def observe(self, batch: int, tokens: int, seconds: float, counted: bool = True, ahead: bool = False) -> None:
            steps[-1].append(counted)
            super().observe(batch, tokens, seconds, counted, ahead)

    eng = tiny_engine(cost_aware=True)
    forward = eng.target.forward
    eng.target.forward = lambda *a, **k: (time.sleep(0.01), forward(*a, **k))[1]
    gate = eng.scheduler.gate = Spy(block=4, explore=4, drafters=("draft", "exact"), max_explore=4)
    proposed: dict[str, set[str]] = {"draft": set(), "exact": set()}
    for name in proposed:
        drafter, propose = eng.drafters[name], eng.drafters[name].propose

        def spy(reqs, name=name, propose=propose):
            proposed[name].update(r.seq_id for r in reqs)
            if name == "draft":
                time.sleep(0.04)
            return propose(reqs)

        drafter.propose = spy
    # a step where a sequence changed drafter pays the new one's catch-up: the gate does not count it
    follow = eng._follow_gate
    eng._follow_gate = lambda *a: (steps.append([follow(*a)]), steps[-1][0])[1]
    greedy = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    ref = run_all(tiny_engine(), [("ref", [1, 2, 3], greedy, SpeculationParams(enabled=False))])["ref"]
    out = run_all(eng, [("auto", [1, 2, 3], greedy, SpeculationParams())])
    assert out["auto"] == ref
    switches = [counted for switched, counted in steps if switched]
    assert len(switches) >= 2 and not any(switches)  # to 'draft' at the first decode step, then to 'exact'
    assert proposed["draft"] == {"auto"} and proposed["exact"] == {"auto"}  # measured with both
    assert gate.summary()["1"]["drafter"] == "exact" and gate.summary()["1"]["speculate"], gate.summary()
    for name in ("draft", "exact"):
        pool = eng.drafters[name].cache.pool
        assert pool.num_free == pool.num_blocks and not eng.drafters[name]._tables
    assert eng.cache.pool.num_free == eng.cache.pool.num_blocks
    proposed = {"draft": set(), "exact": set()}
    short = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = run_all(eng, [("named", [1, 2, 3], short, SpeculationParams(drafter="draft")),
                        ("fixed", [1, 2, 4], short, SpeculationParams(tree=(1, 1))),
                        ("auto2", [1, 2, 5], short, SpeculationParams())])
    # 'auto2' follows the gate to 'exact'; a block in which the gate explores 'draft' again may reach it too (one
    # in up to ``max_explore``, sooner when timings on a loaded machine waver), the other two never leave 'draft'
    assert proposed["draft"] - {"auto2"} == {"named", "fixed"} and proposed["exact"] == {"auto2"}
    assert out["named"] == ref[:40]


def test_the_gate_chooses_only_among_loaded_drafters() -> None:
    from dataclasses import replace

    eng = tiny_engine(cost_aware=True)
    cfg = eng.config
    bad = replace(cfg, scheduler=replace(cfg.scheduler, budget=replace(cfg.scheduler.budget,
                                                                       gate_drafters=("draft", "eagle"))))
    with pytest.raises(ValueError, match="cannot choose drafter 'eagle'"):
        type(eng)(eng.target, eng.drafters, bad)
