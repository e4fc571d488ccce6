"""Adaptive tree budget: acceptance EMA, depth cut, probing, and the global verify cap."""

from __future__ import annotations

import random

import pytest

from gateway.budget import (AcceptanceEMA, BudgetConfig, SpecGate, StepCosts, adaptive_widths, batch_bucket, cap_total,
                            expected_tokens, probe_due, probe_interval)


def test_ema_tracks_acceptance() -> None:
    e = AcceptanceEMA()
    for _ in range(30):
        e.update(accepted=3, depth=3)  # always the whole path: no failure observed
    assert e.alpha > 0.95
    for _ in range(30):
        e.update(accepted=0, depth=3)
    assert e.alpha < 0.05
    before = (e.successes, e.trials)
    e.update(accepted=0, depth=0)  # plain decoding says nothing about the draft
    assert (e.successes, e.trials) == before


def test_depth_follows_acceptance() -> None:
    cfg = BudgetConfig(min_gain=0.2)
    t = (2, 2, 2, 1)
    assert adaptive_widths(t, 0.95, cfg) == t  # 0.95^4 = 0.81 >= 0.2
    assert adaptive_widths(t, 0.6, cfg) == (2, 2, 2)  # 0.6^3 = 0.216, 0.6^4 = 0.13
    assert adaptive_widths(t, 0.3, cfg) == (2,)
    assert adaptive_widths(t, 0.1, cfg) == ()  # does not pay: plain decoding


def test_plain_decoding_probes_periodically() -> None:
    cfg = BudgetConfig(min_gain=0.2, probe_every=4)
    assert [adaptive_widths((2, 2), 0.05, cfg, probe_due(k, 4, cfg.probe_every)) for k in range(5)] == \
        [(), (), (), (1,), (1,)]
    assert adaptive_widths((2, 2), 0.05, cfg, probe_due(10, 6, cfg.probe_every)) == ()  # not a probe step


def test_global_cap_trims_least_promising_first() -> None:
    w = cap_total([(2, 2, 1), (2, 2, 1)], [0.9, 0.3], cap=10)
    assert sum(1 + sum(x) for x in w) <= 10
    assert w[0] == (2, 2, 1)  # the high-acceptance tree keeps its shape
    assert len(w[1]) < 3


@pytest.mark.parametrize("cap", [1, 2, 5, 17, 100])
def test_cap_never_cuts_roots_and_is_respected_when_possible(cap: int) -> None:
    widths = [(4, 2, 2, 1), (1, 1, 1), (), (3, 3)]
    out = cap_total(widths, [0.5, 0.7, 0.1, 0.4], cap)
    total = sum(1 + sum(w) for w in out)
    assert total <= max(cap, len(widths))
    assert all(all(x >= 1 for x in w) for w in out)
    assert all(len(o) <= len(w) for o, w in zip(out, widths))


def test_step_costs_measure_each_depth_then_pick_the_best_rate() -> None:
    costs = StepCosts(reprobe=1000)
    gains = [1.0, 1.8, 2.3]  # expected tokens with the depth capped at 0, 1, 2
    seen = []
    for _ in range(6):  # shallowest first, each twice (the first figure of a shape is dropped); depth 2 is
        c = costs.best_depth(1, gains)  # tried because 2.3 / 1.5 (depth 1's price) could beat 1.8 / 1.5
        seen.append(c)
        costs.observe(1, c, {0: 1.0, 1: 1.5, 2: 3.0}[c])
    assert seen == [0, 0, 1, 1, 2, 2]
    assert costs.best_depth(1, gains) == 1  # 1.8 / 1.5 beats 1.0 / 1.0 and 2.3 / 3.0
    costs.observe(1, 1, 3.0)  # drafting got dearer (EMA): plain decoding now pays best
    costs.observe(1, 1, 3.0)
    assert costs.seconds(1, 1) > 1.8
    assert costs.best_depth(1, gains) == 0
    assert costs.best_depth(1, gains, floor=1) == 1  # a fixed tree below cannot be cut


def test_step_costs_reprobe_stale_depths_and_bucket_batches() -> None:
    costs = StepCosts(reprobe=5)
    for c in (2, 2, 1, 1, 0, 0):
        costs.observe(3, c, 1.0 + c)
    assert costs.best_depth(4, [1.0, 1.1, 1.2]) == 0  # 3 and 4 share a bucket; spec does not pay
    for _ in range(6):
        costs.observe(4, 0, 1.0)
    # depths 1 and 2 were last measured 8 and 10 steps ago: the shallower is measured again, since even at a
    # plain step's price it would beat plain decoding; depth 2 only if depth 1's new figure leaves it a chance
    assert costs.best_depth(3, [1.0, 1.1, 1.2]) == 1
    costs.observe(3, 1, 2.0)
    assert costs.best_depth(3, [1.0, 1.1, 1.2]) == 0  # 1.2 / 2.0 cannot beat 1.0 / 1.0: depth 2 is not tried
    assert costs.best_depth(3, [1.0, 1.1, 2.5]) == 2  # 2.5 / 2.0 could: it is
    assert costs.seconds(5, 0) is None  # bucket 8: nothing measured there
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    assert expected_tokens(0.5, 0) == 1.0 and expected_tokens(0.5, 2) == 1.75


def test_step_costs_price_each_drafters_levels_apart() -> None:
    """A model draft's levels are dear and an n-gram lookup's nearly free: one figure per drafter set, so the
    model's price does not turn the free drafter off. Plain steps share one figure across drafters."""
    costs = StepCosts(reprobe=1000)
    for _ in range(2):
        costs.observe(1, 0, 1.0, ("draft",))  # plain: filed under no drafter whatever the caller passed
        costs.observe(1, 2, 4.0, ("draft",))
        costs.observe(1, 2, 1.1, ("ngram",))
    assert costs.seconds(1, 0) == costs.seconds(1, 0, ("ngram",)) == 1.0
    assert costs.seconds(1, 2, ("draft",)) == 4.0 and costs.seconds(1, 2, ("ngram",)) == 1.1
    assert costs.seconds(1, 2) is None
    gains = [1.0, 1.4, 1.6]
    # depth 1 is unmeasured for both. For the model draft it could pay even at a plain step's price (1.4 /
    # 1.0 against the best measured, plain's 1.0 / 1.0): tried. For the n-gram drafter depth 2 already makes
    # 1.6 / 1.1, which depth 1 cannot beat at any price above plain's: not tried.
    assert costs.best_depth(1, gains, drafters=("draft",)) == 1
    assert costs.best_depth(1, gains, drafters=("ngram",)) == 2
    for _ in range(2):
        costs.observe(1, 1, 2.5, ("draft",))
    assert costs.best_depth(1, gains, drafters=("draft",)) == 0  # 1.0 / 1.0 beats 1.4 / 2.5 and 1.6 / 4.0


def _cap_total_by_scan(widths, alphas, cap):
    """cap_total as first written: a scan of every live tree per trimmed level (the reference)."""
    out = [list(w) for w in widths]
    total = sum(1 + sum(w) for w in out)
    while total > cap:
        live = [i for i, w in enumerate(out) if w]
        if not live:
            break
        i = min(live, key=lambda i: alphas[i] ** len(out[i]))
        excess = total - cap
        if out[i][-1] > excess:
            out[i][-1] -= excess
            total -= excess
        else:
            total -= out[i].pop()
    return [tuple(w) for w in out]


def test_cap_total_trims_as_a_scan_of_every_tree_would() -> None:
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 40)
        widths = [tuple(rng.randint(1, 4) for _ in range(rng.randint(0, 5))) for _ in range(n)]
        alphas = [rng.choice([0.0, 0.25, 0.5, 1.0, rng.random()]) for _ in range(n)]  # ties included
        cap = rng.randint(n, n + 3 * sum(map(sum, widths)) // 2 + 1)
        assert cap_total(widths, alphas, cap) == _cap_total_by_scan(widths, alphas, cap)


def test_probe_interval_grows_with_what_a_probe_costs() -> None:
    cfg = BudgetConfig(probe_every=8, probe_overhead=0.03, max_probe_every=128)
    assert probe_interval(None, 2e-3, cfg) == 8  # unmeasured: the base interval
    assert probe_interval(1e-3, None, cfg) == 8
    assert probe_interval(1e-3, 1.2e-3, cfg) == 8  # 20% extra over 8 steps: 2.5%
    assert probe_interval(1e-3, 1.3e-3, cfg) == 16  # 30% / 8 = 3.75% > 3%; / 16 = 1.9%
    assert probe_interval(1.4e-3, 3.5e-3, cfg) == 64  # the model draft's probe at batch 1 on the H200: 150%
    assert probe_interval(1e-3, 10e-3, cfg) == 128  # never longer than max_probe_every
    assert probe_interval(1e-3, 0.5e-3, cfg) == 8  # a probe step measured faster than plain costs nothing
    for plain, probe in ((1e-3, 1.3e-3), (1e-3, 2.6e-3), (1e-3, 4e-3)):
        k = probe_interval(plain, probe, cfg)
        assert (probe / plain - 1) / k <= 0.03 and k % cfg.probe_every == 0
    with pytest.raises(ValueError, match="probe_every"):
        BudgetConfig(probe_every=256, max_probe_every=128)


def test_a_batch_with_plain_requests_keeps_to_depths_that_cost_them_little() -> None:
    """Requests with speculation off pay each step's time per token: with one in the batch, only depths within
    ``max_ratio`` of a plain step count -- measured, or bounded below for an untried one."""
    costs = StepCosts(reprobe=1000)
    for c, secs in ((0, 1.0), (1, 1.03), (2, 1.2)):
        for _ in range(2):
            costs.observe(4, c, secs, ("ngram",))
    gains = [4.0, 4.5, 6.0]  # depth 2 has the best rate: 6.0 / 1.2 against 4.5 / 1.03 and 4.0 / 1.0
    assert costs.best_depth(4, gains, drafters=("ngram",)) == 2
    assert costs.best_depth(4, gains, drafters=("ngram",), max_ratio=1.05) == 1
    assert costs.best_depth(4, gains, drafters=("ngram",), max_ratio=1.01) == 0
    assert costs.best_depth(4, gains, floor=2, drafters=("ngram",), max_ratio=1.01) == 2  # a fixed tree stays
    # untried depth 3: its lower bound (depth 2's 1.2) is already past 1.05, so it is not even tried
    assert costs.best_depth(4, gains + [9.0], drafters=("ngram",), max_ratio=1.05) == 1
    assert costs.best_depth(4, gains + [9.0], drafters=("ngram",)) == 3


def test_the_scheduler_bounds_the_depth_only_when_a_plain_request_rides_along() -> None:
    from gateway.scheduler import Scheduler, SchedulerConfig
    from target.blocks import BlockPool
    from test_scheduler import Clock, make_seq

    def widths(with_plain: bool) -> dict[str, tuple[int, ...]]:
        sched = Scheduler(SchedulerConfig(max_running=4), BlockPool(256, 4), Clock())
        seqs = [make_seq(i, 4, 50, 0, 0.0) for i in range(3)]
        for s in seqs:
            s.drafter = "ngram"
        if with_plain:
            seqs[2].drafter = None
        for s in seqs:
            sched.add(s)
            s.acceptance.successes, s.acceptance.trials = 9.0, 10.0  # alpha 0.9: four levels pay on their own
        for c, secs in ((0, 1.0), (1, 1.02), (2, 1.3), (3, 1.35), (4, 1.4)):
            for _ in range(2):
                sched.costs.observe(3, c, secs, ("ngram",))
        plan = sched.schedule(lambda s: ((2, 2, 2, 1), True) if s.drafter else ((), False))
        for s, n in plan.prefills:
            s.table.ensure(s.num_cached + n)
            s.num_cached += n
        return {s.request_id: w for s, w in sched.schedule(lambda s: ((2, 2, 2, 1), True) if s.drafter
                                                          else ((), False)).decodes}

    assert widths(False)["0"] == (2, 2, 2, 1)
    mixed = widths(True)
    assert mixed["0"] == (2,) and mixed["2"] == ()  # depth 1 costs 2% more than plain; depth 2 30%


def run_gate(gate: SpecGate, spec_rate: float, plain_rate: float, steps: int, batch: int = 1) -> tuple[float, float]:
    """Steps through ``gate`` where a step emits one token and lasts 1 / rate of the arm the gate runs; the
    tokens and seconds it took."""
    tokens = seconds = 0.0
    for _ in range(steps):
        dt = 1.0 / (spec_rate if gate.allows(batch) else plain_rate)
        gate.observe(batch, 1, dt)
        tokens, seconds = tokens + 1, seconds + dt
    return tokens, seconds


def test_gate_measures_speculation_first_then_plain_decoding() -> None:
    gate = SpecGate(block=4, explore=8)
    arms = []
    for _ in range(8):
        arms.append(gate.allows(1))
        gate.observe(1, 1, 1.0)
    assert arms == [True] * 4 + [False] * 4
    assert gate.rate(1, True) == gate.rate(1, False) == 1.0


@pytest.mark.parametrize("spec_rate, floor, every", [(0.85, 0.97, 16), (1.5, 1.4, 64), (0.995, 0.98, 8)])
def test_gate_runs_the_better_arm_and_pays_little_for_exploring(spec_rate: float, floor: float, every: int) -> None:
    """Speculation at 0.85x of plain decoding: the gate keeps throughput within 3% of plain; at 1.5x it keeps
    most of the gain. The losing arm still runs, one block in 16 for a 15% shortfall and one in 64 for 33%
    (at most 1% of the time lost to it), one in 8 (``explore``) for a shortfall of 0.5%."""
    gate = SpecGate(block=32, explore=8)
    tokens, seconds = run_gate(gate, spec_rate, 1.0, 32 * 200)
    assert tokens / seconds >= floor
    losing = spec_rate < 1.0
    assert gate.summary()["1"]["speculate"] is not losing
    assert gate.interval(1) == every
    counts = {True: 0, False: 0}
    for _ in range(32 * every * 4):
        arm = gate.allows(1)
        counts[arm] += 1
        gate.observe(1, 1, 1.0 / (spec_rate if arm else 1.0))
    assert counts[losing] == 32 * 4  # one block in ``every``


def test_gate_follows_a_change_in_either_arm() -> None:
    """Speculation stops paying (a text turns unpredictable): the gate moves to plain decoding, and back when
    speculation pays again, through its exploring blocks."""
    gate = SpecGate(block=16, explore=4)
    run_gate(gate, 1.5, 1.0, 16 * 40)
    assert gate.summary()["1"]["speculate"] is True
    # a loser by a third is run one block in max_explore: a change shows within two such spans
    run_gate(gate, 0.6, 1.0, 16 * 2 * gate.max_explore)
    assert gate.summary()["1"]["speculate"] is False
    run_gate(gate, 1.5, 1.0, 16 * 2 * gate.max_explore)
    assert gate.summary()["1"]["speculate"] is True


def test_a_batch_wavering_across_a_bucket_edge_still_fills_both_buckets_blocks() -> None:
    """Batches of 16 and 17 sequences alternate step by step (buckets 16 and 32): each bucket's block fills
    with its own steps, so both buckets measure both arms and settle on the better one."""
    gate = SpecGate(block=8, explore=4)
    for k in range(8 * 24):
        batch = 16 + k % 2
        gate.observe(batch, 1, 1.0 / (0.5 if gate.allows(batch) else 1.0))
    assert gate.summary()["16"]["speculate"] is False and gate.summary()["32"]["speculate"] is False


def test_a_new_bucket_inherits_a_loss_from_a_smaller_one() -> None:
    """Speculation lost at batch 1: bucket 4 starts with plain decoding and explores speculation one block in
    as many as that loss allows (not first, nor one in ``explore``); its own measurement then rules, here a
    win. A win at a smaller bucket is not inherited: bucket 16 still measures speculation first."""
    gate = SpecGate(block=4, explore=8)
    run_gate(gate, 0.5, 1.0, 4 * 16)  # batch 1: speculation at half of plain's rate
    assert gate.summary()["1"]["speculate"] is False
    k = gate.interval(4)
    assert k == gate.max_explore  # a 50% shortfall: the longest interval
    arms = []
    for _ in range(k):
        arms.append(gate.allows(4))
        run_gate(gate, 1.5, 1.0, 4, batch=4)  # at batch 4 speculation would win
    assert arms[:-1] == [False] * (k - 1) and arms[-1] is True  # plain first; speculation once, in the last block
    assert gate.summary()["4"]["speculate"] is True and gate.allows(4)
    fresh = SpecGate(block=4, explore=8)
    run_gate(fresh, 2.0, 1.0, 4 * 16)  # batch 1: speculation wins
    assert fresh.allows(16) and fresh.interval(16) == fresh.explore


def run_arms(gate: SpecGate, rates: dict[str, float], steps: int, batch: int = 1) -> tuple[float, dict[str, int]]:
    """Steps through a drafter-choosing ``gate`` where a step emits one token and lasts 1 / the rate of its
    arm; the tokens per second it kept and the steps each arm ran."""
    counts = dict.fromkeys(rates, 0)
    seconds = 0.0
    for _ in range(steps):
        arm = gate.arm(batch)
        assert gate.allows(batch) is (arm != "plain") and gate.drafter(batch) == (None if arm == "plain" else arm)
        counts[arm] += 1
        seconds += 1.0 / rates[arm]
        gate.observe(batch, 1, 1.0 / rates[arm])
    return steps / seconds, counts


def test_gate_picks_the_faster_drafter_and_explores_each_other_arm() -> None:
    """Drafters as arms: each is measured once in order of preference, then plain decoding; the fastest runs,
    and each loser one block in as many as its own shortfall allows (here 21% and 29%: one in 32)."""
    gate = SpecGate(block=8, explore=4, drafters=("draft", "ngram"))
    assert gate.arms == ("draft", "ngram", "plain")
    rates = {"draft": 1.4, "ngram": 1.1, "plain": 1.0}
    first = []
    for _ in range(3):
        first.append(gate.arm(1))
        run_arms(gate, rates, 8)
    assert first == ["draft", "ngram", "plain"]
    _, counts = run_arms(gate, rates, 8 * 8)  # each loser comes back every 4 blocks until it ran 3
    assert counts["ngram"] == counts["plain"] == 2 * 8 and gate._counts[(1, "ngram")] == gate.confirm
    tok_s, counts = run_arms(gate, rates, 8 * 32 * 8)
    assert gate.summary()["1"] | {} == {"spec_tok_s": 1.4, "plain_tok_s": 1.0, "speculate": True, "drafter": "draft",
                                       "arms": {"draft": 1.4, "ngram": 1.1, "plain": 1.0}}
    assert gate.interval(1, "ngram") == gate.interval(1, "plain") == 32
    assert counts["ngram"] == counts["plain"] == 8 * 8  # one block in 32 each
    assert tok_s >= 1.4 * 0.97
    assert gate.state() == ((1, True, 1, 1, "draft"),)
    assert gate.rate(1, True) == gate.rate(1, "draft") == pytest.approx(1.4) and gate.rate(1, False) == pytest.approx(1.0)


def test_gate_moves_to_another_drafter_when_its_drafter_stops_paying() -> None:
    gate = SpecGate(block=8, explore=4, drafters=("draft", "ngram"))
    run_arms(gate, {"draft": 1.4, "ngram": 1.1, "plain": 1.0}, 8 * 40)
    assert gate.drafter(1) == "draft"
    _, counts = run_arms(gate, {"draft": 0.7, "ngram": 1.1, "plain": 1.0}, 8 * 3 * gate.max_explore)
    assert gate.summary()["1"]["drafter"] == "ngram" and gate.drafter(1) == "ngram"
    _, counts = run_arms(gate, {"draft": 0.7, "ngram": 0.9, "plain": 1.0}, 8 * 3 * gate.max_explore)
    assert not gate.allows(1) and gate.drafter(1) is None and gate.summary()["1"]["speculate"] is False
    assert gate.summary()["1"]["drafter"] == "ngram"  # the best speculating arm, though plain decoding runs


def test_each_drafter_inherits_its_own_loss() -> None:
    """At batch 1 the model draft lost and n-grams won: bucket 2 measures n-grams and plain decoding first,
    and explores the model draft one block in as many as its loss at batch 1 allows."""
    gate = SpecGate(block=4, explore=4, drafters=("draft", "ngram"))
    run_arms(gate, {"draft": 0.5, "ngram": 1.2, "plain": 1.0}, 4 * 12)
    k = gate.interval(2, "draft")
    assert k == gate.max_explore and gate.interval(2, "ngram") == gate.explore
    arms = []
    for _ in range(k):
        arms.append(gate.arm(2))
        run_arms(gate, {"draft": 0.5, "ngram": 1.2, "plain": 1.0}, 4, batch=2)
    assert arms[:2] == ["ngram", "plain"] and arms.index("draft") == k - 1
    assert gate.summary()["2"]["drafter"] == "ngram" and gate.rate(2, "draft") == 0.5


def test_gate_drafters_must_be_distinct_names() -> None:
    for bad in (("draft", "draft"), ("plain",), ("spec", "ngram")):
        with pytest.raises(ValueError, match="distinct drafter names"):
            SpecGate(drafters=bad)


def test_gate_keeps_buckets_apart_and_skips_prefill_steps() -> None:
    gate = SpecGate(block=8, explore=4)
    run_gate(gate, 0.5, 1.0, 8 * 12, batch=16)  # at batch 16 speculation loses
    run_gate(gate, 2.0, 1.0, 8 * 12, batch=1)  # at batch 1 it wins
    assert gate.summary()["16"]["speculate"] is False and gate.summary()["1"]["speculate"] is True
    assert not gate.allows(16) and gate.allows(1)
    state = dict((b, (on, a, z)) for b, on, a, z, drafter in gate.state() if drafter is None)
    assert state[1][0] and state[1][1] > state[1][2] and not state[16][0] and state[16][1] < state[16][2]
    kept = gate.state()
    run_gate(gate, 2.0, 1.0, 8 * 4, batch=4)  # a new bucket's blocks: the state follows
    assert gate.state() != kept and any(b == 4 for b, *_ in gate.state())
    before = gate.rate(1, True)
    for _ in range(3):  # a short run in another bucket fills that bucket's block alone
        gate.observe(64, 1, 100.0)
    assert gate.rate(64, True) is None and gate.rate(64, False) is None and gate.rate(1, True) == before
    for _ in range(20):
        gate.observe(1, 0, 100.0, counted=False)  # prompt chunks, or nobody speculating: the arms alike
    assert gate.rate(1, True) == before


def test_gate_rates_are_start_corrected_emas_and_young_arms_come_back_soon() -> None:
    """A first block weighs 0.41 once a second one is in (an EMA corrected for its start at zero), not 0.7; and
    an arm measured fewer than ``confirm`` times comes back every ``explore`` blocks, however far it trails."""
    gate = SpecGate(block=1, explore=4)
    arms = []
    for spec_rate in (1.0, None, None, None, 2.0):
        arms.append(gate.arm(1))
        gate.observe(1, 1, 1.0 / (spec_rate if gate.allows(1) else 10.0))
    assert arms == ["spec", "plain", "plain", "plain", "spec"]  # a 90% loser, back after 4 blocks
    assert gate.rate(1, "spec") == pytest.approx((0.21 * 1.0 + 0.3 * 2.0) / 0.51)
    assert gate.interval(1, "spec") == gate.explore  # two blocks of 3
    gate.observe(1, 1, 1.0 / 10.0)  # plain
    for _ in range(3):
        gate.observe(1, 1, 1.0)  # the exploring block falls here: spec's third
    assert gate._counts[(1, "spec")] == 3 and gate.interval(1, "spec") == gate.max_explore


def test_gate_history_records_each_completed_block() -> None:
    """``SpecGate.history``: every completed block, oldest first, with its bucket, arm, overlapped steps and rate;
    running blocks and uncounted steps stay out, and only the last ``HISTORY`` blocks are kept."""
    gate = SpecGate(block=4, explore=8)
    for i in range(8):  # the speculating arm's block, then plain's; odd steps overlapped
        gate.observe(1, 2, 0.5, ahead=bool(i % 2))
    gate.observe(16, 1, 1.0)  # a running block at another bucket: not yet history
    gate.observe(1, 5, 9.0, counted=False)  # a prefill step: not counted
    hist = gate.history()
    assert [(h["bucket"], h["arm"], h["steps"], h["ahead"], h["tokens"]) for h in hist] == [
        (1, "spec", 4, 2, 8), (1, "plain", 4, 2, 8)]
    assert hist[0]["seconds"] == 2.0 and hist[0]["tok_s"] == 4.0
    assert gate.completed_blocks == 2 and gate.history(last=1) == hist[-1:]
    small = SpecGate(block=1, explore=2)
    for _ in range(SpecGate.HISTORY + 10):
        small.observe(1, 1, 1.0)
    assert len(small.history()) == SpecGate.HISTORY and small.completed_blocks == SpecGate.HISTORY + 10
