"""Overlapped n-gram chains (gateway/chain_ahead.py): the target's greedy tokens, as plain decoding gives them,
through stop tokens, length and context limits, aborts, arrivals, the gate and a tight KV pool; no block left
behind (the device lookup itself: tests/kernels/test_ngram_lookup.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from draft.ngram import NgramDrafter
from draft.params import SpeculationParams
from engine_util import run_all, tiny_engine
from gateway.budget import SpecGate
from gateway.chain_ahead import MAX_RUN_STEPS
from verify.sampling import SamplingParams

PLAIN = SpeculationParams(enabled=False)


def engine(chain: bool, **kw):
    eng = tiny_engine(**kw)
    eng.config = replace(eng.config, chain_ahead=chain)
    return eng


def chain_spec(depth: int = 3) -> SpeculationParams:
    return SpeculationParams(drafter="ngram", tree=(1,) * depth)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase, so that lookups find continuations from the first step."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (4 + i % 3,), generator=g).tolist() * 3 for i in range(n)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **({"ignore_eos": True} | kw))


def run(eng, requests) -> tuple[dict[str, list[int]], dict[str, object]]:
    """Each request's tokens and its last output's speculation stats."""
    out, stats = {}, {}
    for rid, prompt, sampling, spec in requests:
        eng.add(rid, prompt, sampling, spec)
        out[rid] = []
    while eng.has_work():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
            stats[o.request_id] = o.stats
            assert o.error is None, o.error
    return out, stats


def staged(eng, schedule: dict[int, list[tuple]], steps: int) -> dict[str, list[int]]:
    """Requests (id, prompt, sampling, speculation) added at their step of ``schedule``, the engine stepped at
    least ``steps`` times, past the last arrival and on to the end; each request's tokens. The pool ends whole."""
    got: dict[str, list[int]] = {}
    step, steps = 0, max(steps, max(schedule) + 1)
    while step < steps or eng.has_work():
        for rid, prompt, sampling, spec in schedule.get(step, ()):
            eng.add(rid, prompt, sampling, spec)
        for o in eng.step():
            assert o.error is None, o.error
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    assert eng.cache.pool.num_free == eng.config.num_blocks
    return got


@pytest.mark.parametrize("batch,depth", [(1, 1), (1, 4), (4, 3), (8, 2)])
def test_greedy_tokens_match_plain_decoding(batch: int, depth: int) -> None:
    ps = prompts(batch)
    want = run_all(engine(False), [(str(i), p, greedy(30 + i), PLAIN) for i, p in enumerate(ps)])
    eng = engine(True)
    got, stats = run(eng, [(str(i), p, greedy(30 + i), chain_spec(depth)) for i, p in enumerate(ps)])
    assert got == want
    assert eng.num_ahead > 0  # steps went ahead of their predecessors' resolution
    assert sum(s.accepted_tokens for s in stats.values()) > 0  # lookups found what the target then picked
    assert all(s.steps < len(got[r]) for r, s in stats.items() if s.accepted_tokens)
    assert eng.cache.pool.num_free == eng.config.num_blocks and not eng.has_work()


def test_plain_requests_ride_in_the_run_as_one_token_chains() -> None:
    """An A/B server's mix: speculation-off requests beside n-gram ones, all greedy."""
    ps = prompts(6, seed=5)
    specs = [PLAIN if i % 2 else chain_spec(2 + i % 3) for i in range(6)]
    want = run_all(engine(False), [(str(i), p, greedy(30), PLAIN) for i, p in enumerate(ps)])
    eng = engine(True)
    got, stats = run(eng, [(str(i), p, greedy(30), sp) for i, (p, sp) in enumerate(zip(ps, specs))])
    assert got == want and eng.num_ahead > 0
    assert all(stats[str(i)].drafted_tokens == 0 for i in (1, 3, 5))  # the plain ones drafted nothing
    assert sum(stats[str(i)].accepted_tokens for i in (0, 2, 4)) > 0
    assert eng.cache.pool.num_free == eng.config.num_blocks


def test_the_run_goes_on_without_the_sequences_that_end(monkeypatch) -> None:
    import gateway.chain_ahead as ca

    batches: list[tuple[int, bool]] = []  # (sequences, launched ahead) per chain step
    narrowed: list[list[int]] = []  # the pending advances handed to each narrowed run
    launch, continues = ca.launch, ca.continues
    monkeypatch.setattr(ca, "launch", lambda e, step: batches.append((len(step.run.seqs), step.advance is not None))
                        or launch(e, step))

    def recorded(e, prev):
        nxt = continues(e, prev)
        if nxt is not None and len(nxt.run.seqs) < len(prev.run.seqs):
            narrowed.append(nxt.advance.tolist())
        return nxt

    monkeypatch.setattr(ca, "continues", recorded)
    ps = prompts(4, seed=12)
    want = run_all(engine(False), [(str(i), p, greedy(8 + 6 * i), PLAIN) for i, p in enumerate(ps)])
    eng = engine(True)
    got, _ = run(eng, [(str(i), p, greedy(8 + 6 * i), chain_spec(1 + i % 3)) for i, p in enumerate(ps)])
    assert got == want
    # steps of three, two and one sequence went ahead of their predecessors within one run, and one narrowing
    # carried unequal advances (each row kept its own)
    assert {n for n, ahead in batches if ahead} >= {3, 2, 1} and batches.count((4, False)) == 1
    assert any(len(set(adv)) > 1 for adv in narrowed)
    assert eng.cache.pool.num_free == eng.config.num_blocks


def test_stop_tokens_length_and_context_limits_end_outputs_where_plain_decoding_does() -> None:
    ps = prompts(4, seed=2)
    free = run_all(engine(False), [(str(i), p, greedy(30), PLAIN) for i, p in enumerate(ps)])
    # each stops at the token it emits 7th (sooner where it emitted that token before); one ends by length
    # mid-chain; one ends at the 512-token context
    stops = [(str(i), p, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(free[str(i)][6],)))
             for i, p in enumerate(ps)]
    reqs = stops + [("len", ps[0], greedy(11)), ("ctx", list(range(60)) * 8 + [1, 2, 3, 1, 2], greedy(40))]
    want = run_all(engine(False, num_blocks=200), [(r, p, s, PLAIN) for r, p, s in reqs])
    eng = engine(True, num_blocks=200)
    got, _ = run(eng, [(r, p, s, chain_spec(4)) for r, p, s in reqs])
    assert got == want
    assert len(got["len"]) == 11 and len(got["ctx"]) == 512 - 485 and all(len(got[str(i)]) <= 7 for i in range(4))
    assert eng.num_ahead > 0 and eng.cache.pool.num_free == eng.config.num_blocks


def test_an_abort_while_a_chain_step_is_in_flight_leaks_nothing() -> None:
    ps = prompts(3, seed=3)
    want = run_all(engine(False), [(str(i), p, greedy(40), PLAIN) for i, p in enumerate(ps)])
    eng = engine(True)
    for i, p in enumerate(ps):
        eng.add(str(i), p, greedy(40), chain_spec(3))
    got = {str(i): [] for i in range(3)}
    steps = 0
    while eng.has_work():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
        steps += 1
        if steps == 5:
            assert type(eng._inflight).__name__ == "ChainInFlight"  # the abort meets a launched chain step
            out = eng.abort("1")
            assert out is not None and out.finished and out.finish_reason == "abort"
    assert got["0"] == want["0"] and got["2"] == want["2"]
    assert got["1"] == want["1"][: len(got["1"])] and len(got["1"]) < 40
    assert eng.cache.pool.num_free == eng.config.num_blocks


def test_arrivals_ride_along_as_prompt_chunks_and_join_the_run(monkeypatch) -> None:
    import gateway.chain_ahead as ca

    steps: list[tuple[int, int, bool]] = []  # (rows, prompt chunks, launched ahead) per chain step
    launch = ca.launch
    monkeypatch.setattr(ca, "launch", lambda e, step: steps.append(
        (len(step.run.seqs), len(step.prefills), step.advance is not None)) or launch(e, step))
    ps = prompts(6, seed=8)
    long = [(7 * j) % 64 for j in range(70)]  # a prompt of 70 tokens: chunks of 32 (max_step_tokens below)
    # arrivals mid-run: a plain request and a long-prompted speculating one
    schedule = {0: [(str(i), ps[i], greedy(40), chain_spec(3)) for i in range(2)],
                5: [("new5", ps[1], greedy(20), PLAIN)], 9: [("new9", long, greedy(20), chain_spec(2))]}
    outs = []
    for chain in (False, True):
        eng = engine(chain)
        eng.scheduler.config = replace(eng.scheduler.config, max_step_tokens=32)
        outs.append(staged(eng, schedule, 80))
    assert outs[0] == outs[1] and len(outs[1]) == 4
    # every prompt chunk of the arrivals went ahead inside the run (one for the short prompt, three for the long
    # one), and the run grew from its first two rows to four
    assert sum(chunks for _, chunks, ahead in steps if ahead) == 4 and max(rows for rows, _, _ in steps) == 4


def test_joiners_draft_within_the_verify_cap(monkeypatch) -> None:
    import gateway.chain_ahead as ca
    from gateway.budget import BudgetConfig

    rows: list[int] = []  # chain rows per step
    launch = ca.launch
    monkeypatch.setattr(ca, "launch", lambda e, step: rows.append(sum(k + 1 for k in step.run.depths))
                        or launch(e, step))
    ps = prompts(4, seed=9)
    want = run_all(engine(False), [(str(i), p, greedy(30), PLAIN) for i, p in enumerate(ps)])
    eng = engine(True)
    eng.scheduler.config = replace(eng.scheduler.config, budget=BudgetConfig(max_verify_tokens=12, cost_aware=False))
    # two more at step 3: a run's ten rows and their two roots leave them no draft under the cap
    got = staged(eng, {0: [(str(i), ps[i], greedy(30), chain_spec(4)) for i in range(2)],
                       3: [(str(i), ps[i], greedy(30), chain_spec(4)) for i in range(2, 4)]}, 0)
    assert got == want and max(rows) <= 12 and len(rows) > 10
    assert 12 in rows  # the run took the joiners in, as one-token chains


def test_sampled_requests_ride_and_a_model_drafter_ends_the_run(monkeypatch) -> None:
    """A seeded sampled request drafts chains in the run (its draws its own: the same tokens run after run, not
    plain decoding's); a request drafting with a model ends the run, and greedy outputs stay the target's."""
    import gateway.chain_ahead as ca

    sampled_rows: list[int] = []
    launch = ca.launch
    monkeypatch.setattr(ca, "launch", lambda e, step: sampled_rows.append(
        0 if step.run.sampled is None else len(step.run.sampled.generators)) or launch(e, step))
    ps = prompts(6, seed=4)
    hot = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    schedule = {0: [(str(i), ps[i], greedy(24), chain_spec(3)) for i in range(3)],
                6: [("plain", ps[3], greedy(24), PLAIN)], 12: [("sampled", ps[4], hot, chain_spec(3))],
                20: [("model", ps[5], greedy(24), SpeculationParams(drafter="draft", tree=(2, 1)))]}
    outs = [staged(engine(chain), schedule, 60) for chain in (False, True, True)]
    greedy_ids = ["0", "1", "2", "plain", "model"]
    assert all(outs[0][r] == outs[1][r] for r in greedy_ids)
    assert outs[1] == outs[2] and all(len(v) == 24 for v in outs[1].values())  # seeded: repeatable
    assert max(sampled_rows) == 1  # the sampled request rode in a run


def test_sampling_at_a_vanishing_temperature_emits_the_greedy_tokens() -> None:
    """At temperature 1e-4 every processed distribution is the argmax's point mass, so sampled chains must emit
    plain greedy decoding's tokens: a check that each sampled row reads its own chain's logits rows and knobs,
    in a batch mixing depths, greedy rows and top-k / top-p rows."""
    ps = prompts(5, seed=11)
    want = run_all(engine(False), [(str(i), p, greedy(30), PLAIN) for i, p in enumerate(ps)])
    cold = [SamplingParams(temperature=1e-4, seed=i, max_tokens=30, ignore_eos=True, top_k=5 * (i % 2),
                           top_p=0.9 if i == 2 else 1.0) for i in range(5)]
    eng = engine(True)
    got, stats = run(eng, [(str(i), p, greedy(30) if i == 4 else cold[i], chain_spec(1 + i % 3))
                           for i, p in enumerate(ps)])
    assert got == want and eng.num_ahead > 0 and sum(s.accepted_tokens for s in stats.values()) > 0


def test_a_tight_pool_ends_runs_and_every_request_finishes() -> None:
    """14 blocks of 4 slots for three 18-token prompts growing 30 tokens: chains need their worst case reserved,
    so runs give way, the scheduler preempts, and the tokens are still the target's."""
    reqs = [(str(i), [(7 * i + j) % 64 for j in range(6)] * 3, greedy(30)) for i in range(3)]
    want = run_all(engine(False, num_blocks=28, page_size=4), [(r, p, s, PLAIN) for r, p, s in reqs])
    eng = engine(True, num_blocks=28, page_size=4)
    got, _ = run(eng, [(r, p, s, chain_spec(3)) for r, p, s in reqs])
    assert got == want and all(len(v) == 30 for v in got.values())
    assert eng.num_preemptions > 0 and eng.cache.pool.num_free == eng.config.num_blocks


def test_runs_end_after_max_run_steps_and_when_the_gate_turns_plain(monkeypatch) -> None:
    import gateway.chain_ahead as ca

    launched: list[int] = []
    real = ca.launch
    monkeypatch.setattr(ca, "launch", lambda e, step: launched.append(step.run.steps) or real(e, step))
    p = prompts(1)[0]
    out, _ = run(engine(True), [("a", p, greedy(4 * MAX_RUN_STEPS), chain_spec(2))])
    assert max(launched) == MAX_RUN_STEPS - 1 and launched.count(0) >= 2  # runs restarted from a plan
    # under a gate held on its plain arm, no adaptive request drafts, so no run starts
    eng = engine(True)
    eng.scheduler.gate = SpecGate()
    monkeypatch.setattr(SpecGate, "allows", lambda self, batch: False)
    launched.clear()
    got, _ = run(eng, [("a", p, greedy(40), SpeculationParams(drafter="ngram"))])
    assert got["a"] == out["a"][:40] and not launched


def test_adaptive_chains_follow_their_acceptance_within_a_run(monkeypatch) -> None:
    """An adaptive request's depth within a run follows its acceptance down and back up, as a plan would set
    it each step; a fixed tree keeps its depth but for its last tokens (a step emits depth + 1)."""
    import gateway.chain_ahead as ca

    steps: list[tuple[list[int], bool, int]] = []  # (depths, launched ahead, the fixed chain's tokens left)
    real = ca.launch
    monkeypatch.setattr(ca, "launch", lambda e, step: steps.append(
        (list(step.run.depths), step.advance is not None, e._seqs["1"].remaining_tokens)) or real(e, step))
    eng = engine(True)
    eng.scheduler.config = replace(eng.scheduler.config, budget=replace(eng.scheduler.config.budget,
                                                                        cost_aware=False, gate=False))
    eng.scheduler.gate = None
    ps = prompts(2, seed=10)
    want = run_all(engine(False), [(str(i), p, greedy(40), PLAIN) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        eng.add(str(i), p, greedy(40), SpeculationParams(drafter="ngram") if i == 0 else chain_spec(3))
    got: dict[str, list[int]] = {"0": [], "1": []}
    while eng.has_work():
        # the adaptive request's estimate: its lookups pay, then (steps 3-5) stop paying, then pay again
        if "0" in eng._seqs:
            eng._seqs["0"].acceptance.successes = eng._seqs["0"].acceptance.trials * (0.0 if 3 <= len(steps) < 6 else 0.99)
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    assert got == want
    adaptive = [d[0] if len(d) == 2 else None for d, _, _ in steps]
    ahead = [a for _, a, _ in steps]
    # within one run (each step launched ahead of the last): drafting, then plain, then drafting again
    down = next(i for i in range(1, len(steps)) if ahead[i] and adaptive[i - 1] and adaptive[i] == 0)
    assert any(ahead[j] and adaptive[j] for j in range(down + 1, len(steps)) if all(ahead[down : j + 1]))
    assert all(d[-1] == min(3, left - 1) for d, _, left in steps)


@pytest.mark.parametrize("seed", range(3))
def test_every_slot_a_chain_step_writes_is_in_its_own_table(monkeypatch, seed: int) -> None:
    """Small pages, chains accepted whole (an oracle drafts plain decoding's next tokens) and cut short mid-run:
    a step launched ahead of one that may advance a row by its old depth + 1 writes up to that far past it, at
    its new depth, and every such slot lies in a block of the row's own table, held by it alone, when the step
    launches."""
    import gateway.chain_ahead as ca

    checked = []
    real = ca.launch

    def launch(e, step):
        inflight = real(e, step)
        ahead = step.advance.tolist() if step.advance is not None else [0] * len(step.run.seqs)
        for s, k, a in zip(step.run.seqs, step.run.depths, ahead):
            last = s.num_cached + a + k  # the deepest slot the step writes for s
            assert len(s.table.blocks) > last // e.config.page_size, (s.num_cached, a, k, len(s.table.blocks))
            assert e.cache.pool.refcount(s.table.blocks[last // e.config.page_size]) == 1
            checked.append(a)
        return inflight

    monkeypatch.setattr(ca, "launch", launch)
    ps = prompts(3, seed=20 + seed)
    want = run_all(engine(False, page_size=2), [(str(i), p, greedy(40), PLAIN) for i, p in enumerate(ps)])
    eng = engine(True, page_size=2)
    eng.config = replace(eng.config, default_tree=(1,) * 4)  # adaptive chains of up to four drafts
    full = [p + want[str(i)] for i, p in enumerate(ps)]

    def oracle(hist, lens, span, depth):  # each row's next tokens as plain decoding emits them
        out = torch.zeros(len(lens), depth, dtype=torch.int64)
        for b, n in enumerate(lens.tolist()):
            seq = next(f for f in full if f[:n] == hist[b, :n].tolist())
            nxt = seq[n : n + depth]
            out[b, : len(nxt)] = torch.tensor(nxt, dtype=torch.int64)
        return out

    eng.drafters["ngram"].lookup_on_device = oracle
    eng.scheduler.config = replace(eng.scheduler.config, budget=replace(eng.scheduler.config.budget,
                                                                        cost_aware=False, gate=False))
    eng.scheduler.gate = None
    for i, p in enumerate(ps):
        eng.add(str(i), p, greedy(40), SpeculationParams(drafter="ngram"))
    got: dict[str, list[int]] = {str(i): [] for i in range(3)}
    for step in range(200):
        if not eng.has_work():
            break
        for s in eng._seqs.values():  # the estimates say the lookups pay (the whole chain), but for a step or two
            s.acceptance.successes = s.acceptance.trials * (0.3 if step in (4 + seed, 20 + seed) else 0.99)
        for o in eng.step():
            assert o.error is None, o.error  # (a failed check in the launch fails the step's requests)
            got[o.request_id] += o.new_token_ids
    assert got == want and eng.cache.pool.num_free == eng.config.num_blocks
    assert max(checked) == 5  # some step was launched ahead of one that could advance a row by a whole chain


def test_off_by_default() -> None:
    eng = tiny_engine()
    assert not eng.config.chain_ahead
    run(eng, [("a", prompts(1)[0], greedy(20), chain_spec(3))])
    assert eng.num_ahead == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chain_steps_on_cuda_graphs_emit_plain_decoding_s_tokens() -> None:
    """On CUDA the chain steps replay ragged graphs whose inputs are offset on the device after the batch's
    copy. Plain decoding is the reference: float32 activations over random weights leave logit gaps far
    above the rounding that different row counts give the matmuls."""
    from draft.model_drafter import ModelDrafter
    from engine_util import random_weights, tiny_config
    from gateway.budget import BudgetConfig
    from gateway.engine import Engine, EngineConfig
    from gateway.scheduler import SchedulerConfig
    from target.model import Transformer

    cfg = tiny_config(vocab=512, layers=3, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                      head_dim=64)
    target = Transformer.from_weights(cfg, random_weights(cfg, scale=0.3), torch.float32, "cuda").quantize(64)

    def cuda_engine(chain: bool) -> Engine:
        drafters = {"self": ModelDrafter("self", target.truncated(2), 256, 16), "ngram": NgramDrafter()}
        sched = SchedulerConfig(max_model_len=512, budget=BudgetConfig(cost_aware=False))
        return Engine(target, drafters, EngineConfig(256, 16, sched, "ngram", (1, 1, 1), chain_ahead=chain))

    g = torch.Generator().manual_seed(0)
    phrases = [torch.randint(0, 512, (4 + i,), generator=g).tolist() for i in range(6)]
    want = run_all(cuda_engine(False), [(str(i), p * 3, greedy(48), PLAIN) for i, p in enumerate(phrases)])
    eng = cuda_engine(True)
    got, stats = run(eng, [(str(i), p * 3, greedy(48), chain_spec(3 + i % 2)) for i, p in enumerate(phrases)])
    assert got == want
    assert eng.num_ahead > 0 and eng.graphs.replays > 0 and sum(s.accepted_tokens for s in stats.values()) > 0
    assert eng.cache.pool.num_free == 256 and not eng.has_work()


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_matches_the_engine_without_chains(seed: int) -> None:
    """Requests of every kind the server takes -- greedy plain and n-gram (fixed chains and adaptive), seeded
    sampling, logprobs -- arriving at random steps, some aborted, their acceptance estimates jolted at random
    (so that chains deepen and shallow mid-run): with chains on, every finished greedy request's tokens are
    those without, an aborted one's a prefix of them, every sampled one reaches its length, and the pool ends
    whole."""
    g = torch.Generator().manual_seed(100 + seed)
    kinds = [(greedy(20), PLAIN), (greedy(24), chain_spec(3)), (greedy(16), SpeculationParams(drafter="ngram")),
             (SamplingParams(temperature=0.9, seed=seed, max_tokens=18, ignore_eos=True), chain_spec(2)),
             (SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2), chain_spec(2))]
    plan = []  # (arrival step, id, prompt, sampling, speculation, abort step or None)
    for i in range(10):  # the first three open a run together; the rest come at random
        sp, spec = kinds[1 if i < 3 else int(torch.randint(0, len(kinds), (1,), generator=g))]
        at = 0 if i < 3 else int(torch.randint(8, 30, (1,), generator=g))
        abort = at + int(torch.randint(2, 12, (1,), generator=g)) if torch.rand(1, generator=g) < 0.2 else None
        phrase = torch.randint(0, 64, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        plan.append((at, str(i), phrase * 3, sp, spec, abort))
    outs = []
    for chain in (False, True):
        eng = engine(chain, num_blocks=96)
        got: dict[str, list[int]] = {}
        aborted: set[str] = set()
        step = 0
        jolts = torch.Generator().manual_seed(seed)  # the same jolts in both engines
        while step < 40 or eng.has_work():
            for rid in sorted(eng._seqs):
                u = torch.rand(2, generator=jolts).tolist()
                if u[0] < 0.3:
                    est = eng._seqs[rid].acceptance
                    est.successes = est.trials * u[1]
            for at, rid, p, sp, spec, abort in plan:
                if at == step:
                    eng.add(rid, p, sp, spec)
                if abort == step and eng.abort(rid) is not None:
                    aborted.add(rid)
            for o in eng.step():
                assert o.error is None, o.error
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
            step += 1
        assert eng.cache.pool.num_free == eng.config.num_blocks
        outs.append((got, aborted))
        if chain:
            assert eng.num_ahead > 0
    (off, off_aborted), (on, on_aborted) = outs
    for _, rid, _, sp, _, _ in plan:
        a, b = off.get(rid, []), on.get(rid, [])
        if not sp.is_greedy:  # its draws are the chain's in one engine, plain decoding's in the other
            assert rid in off_aborted or rid in on_aborted or len(a) == len(b) == sp.max_tokens
        elif rid in off_aborted or rid in on_aborted:
            assert a[: len(b)] == b[: len(a)]  # one is a prefix of the other
        else:
            assert a == b, rid
