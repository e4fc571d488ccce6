"""The scheduler alone, simulated without a model: hypothesis drives random arrivals, cancellations and
acceptance; the invariants are no block leaks, no starvation, FIFO within a priority class, and every
admitted request finishing or being cancelled."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from draft.params import SpeculationParams
from gateway.budget import BudgetConfig, ahead_kinds
from gateway.scheduler import Scheduler, SchedulerConfig
from gateway.sequence import Sequence, Status
from target.blocks import BlockPool
from verify.sampling import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_seq(i: int, prompt_len: int, max_tokens: int, priority: int, now: float) -> Sequence:
    s = Sequence(str(i), [1] * prompt_len, SamplingParams(max_tokens=max_tokens), SpeculationParams(),
                 None, "draft", priority)
    s.arrival_time = now
    return s


def simulate_step(sched: Scheduler, accept_draw, step_s: float = 0.0) -> list[Sequence]:
    """What the engine does with a plan, minus the model: reserve, advance, truncate, finish; with ``step_s``,
    the step's time and tokens reported to the speculation gate (``SpecGate``), as the engine reports them."""
    plan = sched.schedule(lambda s: ((2, 2, 1), True))
    if step_s and sched.gate is not None:
        emitted = sum(1 + min(len(w), 1) for _, w in plan.decodes)
        sched.gate.observe(len(plan.decodes), emitted, step_s, counted=not plan.prefills)
    finished = list(plan.exhausted)
    for seq in plan.exhausted:  # the engine ends these with finish_reason "length"
        finish(sched, seq)
    for seq, n in plan.prefills:
        seq.table.ensure(seq.num_cached + n)
        seq.num_cached += n
        seq.table.register_prefix(seq.token_ids, seq.num_cached)  # identical prompts share blocks
    for seq, widths in plan.decodes:
        seq.table.ensure(seq.num_cached + 1 + sum(widths))
        a = 1 + min(accept_draw(), len(widths))
        seq.num_cached += a
        seq.output_ids += [7] * a
        seq.acceptance.update(a - 1, len(widths))
        seq.table.truncate(seq.num_cached + 1)
        if len(seq.output_ids) >= seq.sampling.max_tokens:
            finish(sched, seq)
            finished.append(seq)
    return finished


def finish(sched: Scheduler, seq: Sequence) -> None:
    sched.remove(seq)
    if seq.table is not None:
        seq.table.release()
        seq.table = None
    seq.status = Status.FINISHED


def held_blocks(sched: Scheduler) -> int:
    """Distinct blocks in use: prefix-cached blocks may sit in several tables at once."""
    return len({b for s in sched.running if s.table is not None for b in s.table.blocks})


ops = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.integers(1, 40), st.integers(1, 30), st.integers(0, 2)),
    st.tuples(st.just("cancel"), st.integers(0, 1000)),
    st.tuples(st.just("step"), st.integers(0, 3)),
    st.tuples(st.just("sibling"), st.integers(0, 1000), st.integers(1, 30)),  # another choice of a request
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(12, 40), max_running=st.integers(1, 6), step_tokens=st.integers(4, 64))
def test_random_traffic_keeps_invariants(ops, num_blocks, max_running, step_tokens) -> None:
    clock = Clock()
    pool = BlockPool(num_blocks, 4)
    sched = Scheduler(SchedulerConfig(max_running=max_running, max_step_tokens=step_tokens, max_model_len=256, aging_s=1e9,
                                      budget=BudgetConfig(gate_block=2)), pool, clock)
    seqs: list[Sequence] = []
    admitted_order: list[Sequence] = []
    ended: set[str] = set()

    def step(draw: int) -> None:
        before = {id(s) for s in sched.running}
        # the gate sees steps of random prices, so its arm (trees or none) changes under the traffic too
        for s in simulate_step(sched, lambda: draw, step_s=1.0 + draw):
            ended.add(s.request_id)
        admitted_order.extend(s for s in sched.running if id(s) not in before and s not in admitted_order)
        assert pool.num_free + held_blocks(sched) == num_blocks  # nothing leaked, nothing double-counted
        clock.t += 1

    for op in ops:
        if op[0] == "arrive":
            if -(-op[1] // 4) <= num_blocks:  # the engine refuses prompts the pool can never hold
                seqs.append(make_seq(len(seqs), op[1], op[2], op[3], clock.t))
                sched.add(seqs[-1])
        elif op[0] == "sibling" and seqs:
            leader = seqs[op[1] % len(seqs)]
            seqs.append(make_seq(len(seqs), len(leader.prompt_ids), op[2], leader.priority, clock.t))
            seqs[-1].prefix_leader = leader  # waits for the leader's prompt, whatever became of the leader
            sched.add(seqs[-1])
        elif op[0] == "cancel" and seqs:
            s = seqs[op[1] % len(seqs)]
            if s.request_id not in ended:
                finish(sched, s)
                ended.add(s.request_id)
        else:
            step(op[1])
    for _ in range(5000):  # drain: every request must end (no starvation, no livelock)
        if not sched.has_work():
            break
        step(1)
    assert not sched.has_work(), "requests left behind"
    assert {s.request_id for s in seqs} == ended
    assert pool.num_free == num_blocks
    # FIFO within a priority class: first admissions happen in arrival order (siblings excepted: one may
    # be overtaken while its leader prefills)
    first = {}
    for s in admitted_order:
        first.setdefault(s.request_id, s)
    for p in range(3):
        cls = [s for s in first.values() if s.priority == p and s.prefix_leader is None]
        assert [s.arrival_time for s in cls] == sorted(s.arrival_time for s in cls)


def test_priority_and_aging() -> None:
    clock = Clock()
    sched = Scheduler(SchedulerConfig(max_running=1, aging_s=10), BlockPool(64, 4), clock)
    low = make_seq(0, 4, 4, priority=2, now=0.0)
    high = make_seq(1, 4, 4, priority=0, now=0.0)
    sched.add(low)
    sched.add(high)
    sched.schedule(lambda s: ((), False))
    assert sched.running == [high]  # the urgent class goes first
    finish(sched, high)
    later = make_seq(2, 4, 4, priority=0, now=25.0)
    sched.add(later)
    clock.t = 25.0
    sched.schedule(lambda s: ((), False))
    assert sched.running == [low]  # 25 s of waiting lifted it two classes: it does not starve


def test_shortest_expected_first() -> None:
    sched = Scheduler(SchedulerConfig(max_running=1, policy="sef"), BlockPool(64, 4), Clock())
    long = make_seq(0, 20, 100, 0, 0.0)
    short = make_seq(1, 4, 4, 0, 0.0)
    sched.add(long)
    sched.add(short)
    sched.schedule(lambda s: ((), False))
    assert sched.running == [short]


def test_scheduler_imports_no_torch() -> None:
    code = "import sys, gateway.scheduler, gateway.budget; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def two_decoding(max_tokens: int) -> tuple[Scheduler, list[Sequence]]:
    """A scheduler with two sequences past their prefill, each asking a (2, 2, 1) tree at alpha 0.9 (the tree
    stays by acceptance)."""
    sched = Scheduler(SchedulerConfig(max_running=4), BlockPool(64, 4), Clock())
    seqs = [make_seq(i, 4, max_tokens, 0, 0.0) for i in range(2)]
    for s in seqs:
        sched.add(s)
        s.acceptance.successes, s.acceptance.trials = 9.0, 10.0
    plan = sched.schedule(lambda s: ((2, 2, 1), True))
    for seq, n in plan.prefills:
        seq.table.ensure(seq.num_cached + n)
        seq.num_cached += n
    return sched, seqs


def test_measured_step_costs_turn_speculation_down_and_keep_fixed_trees() -> None:
    """Once plain steps are measured faster per expected token, adaptive trees are cut to nothing; a tree
    the request fixed itself is kept and sets the floor."""
    sched, seqs = two_decoding(50)
    for depth in (3, 3, 2, 2, 1, 1, 0, 0):
        sched.costs.observe(2, depth, 1.0 + 10 * depth, ("draft",))  # drafting is ruinously slow here
    plan = sched.schedule(lambda s: ((2, 2, 1), True))
    assert [w for _, w in plan.decodes] == [(), ()]
    plan = sched.schedule(lambda s: ((2, 2, 1), s is seqs[0]))  # seqs[1] asked for its tree itself
    assert dict((s.request_id, w) for s, w in plan.decodes) == {"0": (2, 2, 1), "1": (2, 2, 1)}
    for depth in (3, 2, 1, 0) * 20:
        sched.costs.observe(2, depth, 1.0 + 0.01 * depth, ("draft",))  # now cheap (the EMA forgets): the full trees pay
    plan = sched.schedule(lambda s: ((2, 2, 1), True))
    assert [w for _, w in plan.decodes] == [(2, 2, 1), (2, 2, 1)]


def test_a_sequence_the_cost_cap_keeps_plain_still_probes() -> None:
    """The cost cap cuts trees whose acceptance is too low to pay for their levels; such a sequence drafts
    nothing, so its acceptance never updates. Every ``probe_every`` plain steps it drafts one level anyway,
    on the scheduler's probe steps, so it can find its way back when the text turns predictable. (A probe
    here costs 2 plain steps extra; ``probe_overhead`` 0.25 lets it every 8 steps.)"""
    cfg = SchedulerConfig(max_running=4, budget=BudgetConfig(probe_overhead=0.25))
    sched = Scheduler(cfg, BlockPool(64, 4), Clock())
    seq = make_seq(0, 4, 50, 0, 0.0)
    sched.add(seq)
    seq.acceptance.successes, seq.acceptance.trials = 3.0, 10.0  # alpha 0.3: depth 1 by acceptance alone
    plan = sched.schedule(lambda s: ((2, 2, 1), True))
    for s, n in plan.prefills:
        s.table.ensure(s.num_cached + n)
        s.num_cached += n
    for depth in (1, 1, 0, 0):
        sched.costs.observe(1, depth, 1.0 + 2 * depth, ("draft",))  # a level costs twice a plain step
    every = cfg.budget.probe_every
    got = []
    for _ in range(3 * every):
        (s, w), = sched.schedule(lambda s: ((2, 2, 1), True)).decodes
        got.append((sched.num_schedules, w))
        seq.steps_without_draft = 0 if w else seq.steps_without_draft + 1  # what the engine's commit does
    probes = [n for n, w in got if w]
    assert probes and all(n % every == 0 for n in probes)  # only on probe steps
    assert all(w in ((), (2,)) for _, w in got)  # a probe is one level of the template
    assert all(b - a >= every for a, b in zip(probes, probes[1:]))  # at most one every probe_every steps
    assert len(probes) >= 2


def test_dear_probes_come_less_often() -> None:
    """A probe that costs two plain steps extra would cost 25% of plain decoding every 8 steps: the interval
    doubles until it costs at most ``probe_overhead`` (3%), here to ``max_probe_every``."""
    cfg = SchedulerConfig(max_running=4, budget=BudgetConfig(max_probe_every=128))
    sched = Scheduler(cfg, BlockPool(64, 4), Clock())
    seq = make_seq(0, 4, 1000, 0, 0.0)
    sched.add(seq)
    seq.acceptance.successes, seq.acceptance.trials = 0.5, 10.0  # alpha 0.05: plain by acceptance
    plan = sched.schedule(lambda s: ((2, 2, 1), True))
    for s, n in plan.prefills:
        s.table.ensure(s.num_cached + n)
        s.num_cached += n
    for depth in (1, 1, 0, 0):
        sched.costs.observe(1, depth, 1.0 + 2 * depth, ("draft",))
    probes = []
    for _ in range(3 * 128):
        (s, w), = sched.schedule(lambda s: ((2, 2, 1), True)).decodes
        if w:
            probes.append(sched.num_schedules)
        seq.steps_without_draft = 0 if w else seq.steps_without_draft + 1
    assert len(probes) >= 2 and all(n % 128 == 0 for n in probes), probes


def test_probes_of_a_batch_fall_on_the_same_steps() -> None:
    """A draft level delays the whole batch: sequences that fell back at different steps probe together."""
    cfg = SchedulerConfig(max_running=8)
    sched = Scheduler(cfg, BlockPool(64, 4), Clock())
    seqs = [make_seq(i, 4, 80, 0, 0.0) for i in range(4)]
    for s in seqs:
        sched.add(s)
        s.acceptance.successes, s.acceptance.trials = 0.5, 10.0  # alpha 0.05: plain decoding by acceptance
    plan = sched.schedule(lambda s: ((2, 2, 1), True))
    for s, n in plan.prefills:
        s.table.ensure(s.num_cached + n)
        s.num_cached += n
    for i, s in enumerate(seqs):
        s.steps_without_draft = 3 * i  # staggered
    steps_with_a_probe = set()
    for _ in range(4 * cfg.budget.probe_every):
        for s, w in sched.schedule(lambda s: ((2, 2, 1), True)).decodes:
            if w:
                steps_with_a_probe.add(sched.num_schedules)
            s.steps_without_draft = 0 if w else s.steps_without_draft + 1
    assert steps_with_a_probe and all(n % cfg.budget.probe_every == 0 for n in steps_with_a_probe)
    assert len(steps_with_a_probe) <= 4


def test_no_probe_costs_riding_plain_requests_more_than_their_bound() -> None:
    """A probe is a draft level like any other for the batch's speculation-off requests: where a one-level
    step is measured dearer than ``plain_penalty`` allows, a batch holding such a request does not probe (no
    depth could follow it); the same batch without one probes on schedule, and so does the mixed batch once
    the level is cheap enough."""

    def probe_steps(with_plain: bool, level_cost: float) -> int:
        cfg = SchedulerConfig(max_running=4, budget=BudgetConfig(probe_overhead=1.0))  # probe every 8 steps
        sched = Scheduler(cfg, BlockPool(256, 4), Clock())
        seqs = [make_seq(i, 4, 1000, 0, 0.0) for i in range(3)]
        if with_plain:
            seqs[2].drafter = None
        for s in seqs:
            sched.add(s)
            s.acceptance.successes, s.acceptance.trials = 0.5, 10.0  # alpha 0.05: plain by acceptance
        plan = sched.schedule(lambda s: ((2, 2, 1), True) if s.drafter else ((), False))
        for s, n in plan.prefills:
            s.table.ensure(s.num_cached + n)
            s.num_cached += n
        for depth in (1, 1, 0, 0):
            sched.costs.observe(3, depth, 1.0 + (level_cost - 1.0) * depth, ("draft",))
        drafted = 0
        for _ in range(4 * cfg.budget.probe_every):
            plan = sched.schedule(lambda s: ((2, 2, 1), True) if s.drafter else ((), False))
            drafted += any(w for _, w in plan.decodes)
            for s, w in plan.decodes:
                s.steps_without_draft = 0 if w else s.steps_without_draft + 1
        return drafted

    assert probe_steps(with_plain=False, level_cost=1.4) >= 3
    assert probe_steps(with_plain=True, level_cost=1.4) == 0  # 1.4x a plain step: past the 5% bound
    assert probe_steps(with_plain=True, level_cost=1.03) >= 3  # within it


def test_batch_completion_counts_only_the_drafts_of_the_requests_furthest_from_done() -> None:
    """Under ``batch_completion`` (a caller waits for every request) with nobody waiting, a request that will
    end well before the last one gains the batch nothing by drafting: the budget counts only the drafts of
    the requests within one step of the most remaining tokens. A request waiting for a slot makes an early
    end worth a slot again, and the budget counts every request's tokens."""

    def plan_widths(lead_alpha: float, last_alpha: float, completion: bool, queued: bool = False) -> list:
        sched = Scheduler(SchedulerConfig(max_running=3), BlockPool(256, 4), Clock())
        seqs = [make_seq(0, 4, 20, 0, 0.0), make_seq(1, 4, 200, 0, 0.0), make_seq(2, 4, 200, 0, 0.0)]
        for s in seqs:
            sched.add(s)
        plan = sched.schedule(lambda s: ((2, 2, 1), True))
        for s, n in plan.prefills:
            s.table.ensure(s.num_cached + n)
            s.num_cached += n
        for s, a in zip(seqs, (lead_alpha, last_alpha, last_alpha)):
            s.acceptance.successes, s.acceptance.trials = 10 * a, 10.0
        for depth, secs in ((0, 1.0), (1, 1.3), (2, 1.5), (3, 1.7)):
            for _ in range(2):
                sched.costs.observe(3, depth, secs, ("draft",))
        if queued:
            sched.add(make_seq(3, 4, 200, 0, 0.0))  # no slot for it: max_running 3
        sched.batch_completion = completion
        return [w for _, w in sched.schedule(lambda s: ((2, 2, 1), True)).decodes]

    # request 0 has 20 tokens to go against the others' 200, and is the only one whose drafts the target keeps
    assert plan_widths(0.95, 0.3, completion=False)[0] == (2, 2, 1)  # tokens per second: its drafts pay
    assert plan_widths(0.95, 0.3, completion=True) == [(), (), ()]  # the batch ends with requests 1 and 2
    assert plan_widths(0.95, 0.3, completion=True, queued=True)[0] == (2, 2, 1)  # its slot is worth freeing
    # the requests the batch waits on draft well: they speculate, and request 0 rides along
    assert plan_widths(0.3, 0.95, completion=True)[1] == (2, 2, 1)


def test_a_new_request_starts_from_its_drafters_acceptance() -> None:
    """Requests of a drafter that has kept little so far start plain instead of four levels deep; a drafter
    with no record yet (or too little) starts from the fixed prior of 0.5. (Cost-blind: a fresh engine would
    first measure a plain step.)"""
    sched = Scheduler(SchedulerConfig(max_running=4, budget=BudgetConfig(cost_aware=False)), BlockPool(64, 4), Clock())
    old = make_seq(0, 4, 50, 0, 0.0)
    sched.add(old)
    assert old.acceptance.alpha == 0.5
    for _ in range(40):
        sched.observe_acceptance(old, 0, 2)  # two levels drafted, nothing kept
    new = make_seq(1, 4, 50, 0, 0.0)
    sched.add(new)
    assert new.acceptance.alpha < 0.05 and new.acceptance.trials == 2.0  # the prior's weight, not the record's
    other = make_seq(2, 4, 50, 0, 0.0)
    other.drafter = "ngram"
    sched.add(other)
    assert other.acceptance.alpha == 0.5
    plan = sched.schedule(lambda s: ((2, 2, 1), True))
    for s, n in plan.prefills:
        s.table.ensure(s.num_cached + n)
        s.num_cached += n
    widths = {s.request_id: w for s, w in sched.schedule(lambda s: ((2, 2, 1), True)).decodes}
    assert widths["1"] == () and len(widths["2"]) >= 1


def test_the_gates_plain_arm_leaves_adaptive_requests_plain_without_probes() -> None:
    """While the gate (gateway/budget.py SpecGate) runs plain decoding at this batch, adaptive requests get no
    tree and no probe, and ``plans_plain`` says so for overlapped steps; a tree a request fixed itself stays."""
    sched, seqs = two_decoding(500)
    gate = sched.gate
    assert gate is not None and gate.allows(2)
    for spec in (True, False):  # one block each arm, plain decoding twice as fast
        for _ in range(gate.block):
            assert gate.allows(2) is spec
            gate.observe(2, 2, 1.0 if spec else 0.5)
    assert not gate.allows(2)
    fixed = lambda s: ((2, 2, 1), s is seqs[0])  # noqa: E731 -- seqs[1] asked for its tree itself
    for _ in range(3 * sched.config.budget.max_probe_every):
        plan = sched.schedule(fixed)
        assert dict((s.request_id, w) for s, w in plan.decodes) == {"0": (), "1": (2, 2, 1)}
        seqs[0].steps_without_draft += 1
    assert sched.plans_plain([(seqs[0], False)], fixed, 2)
    assert not sched.plans_plain([(seqs[1], False)], fixed, 2)
    assert not sched.plans_plain([(seqs[0], False), (seqs[1], False)], fixed, 2)  # one that drafts: not all plain
    off = Scheduler(SchedulerConfig(budget=BudgetConfig(gate=False)), BlockPool(64, 4), Clock())
    assert off.gate is None


def test_chain_runs_cut_their_free_levels_by_measured_cost_alone() -> None:
    """An overlapped chain run's depths (``chain_depths``) skip the acceptance cut: at alpha 0.37 the cut of
    ``min_gain`` 0.2 leaves one level, but where each chain depth's step is measured at 1.25x a plain one, four
    levels bring the most tokens per second (1.58 against 1.37 expected tokens for the same price). Where levels
    are dear the costs still cut them all. A regular plan keeps the cut. Chain steps are priced apart from tree
    steps taken one by one (``ahead_kinds``): here those cost 3x a plain step, and do not touch the chains'."""
    sched = Scheduler(SchedulerConfig(max_running=4), BlockPool(64, 4), Clock())
    seq = Sequence("0", [1] * 4, SamplingParams(max_tokens=50), SpeculationParams(), None, "ngram", 0)
    sched.add(seq)
    seq.acceptance.successes, seq.acceptance.trials = 3.7, 10.0
    chain = lambda s: ((1, 1, 1, 1), True)  # noqa: E731
    for s, n in sched.schedule(chain).prefills:
        s.table.ensure(s.num_cached + n)
        s.num_cached += n
    ahead = ahead_kinds(("ngram",))
    for depth in (0, 0, 1, 1, 2, 2, 3, 3, 4, 4):  # a key's first figure is a warm-up's, not kept
        sched.costs.observe(1, depth, 1.0 if depth == 0 else 1.25, ahead if depth else ())
        if depth:
            sched.costs.observe(1, depth, 3.0, ("ngram",))  # the same depths stepped: dear
    seq.steps_without_draft = 0  # no probe due
    (_, widths), = sched.schedule(chain).decodes
    assert widths == ()  # a regular plan: the acceptance cut leaves one level, and stepped it does not pay
    assert sched.chain_depths([seq], chain) == [4]
    sched.chains = lambda seqs: True  # the batch could run as a chain: its plan is a chain run's first step
    (_, widths), = sched.schedule(chain).decodes
    assert widths == (1, 1, 1, 1)
    sched.chains = None
    for depth in range(1, 5):
        for _ in range(20):  # the EMA forgets: levels now cost 0.6 of a plain step each
            sched.costs.observe(1, depth, 1.0 + 0.6 * depth, ahead)
    seq.steps_without_draft = 0  # no probe due
    assert sched.chain_depths([seq], chain) == [0]


def test_plans_plain_follows_the_plans_cost_cut() -> None:
    """``plans_plain`` (an overlapped step's test) agrees with the plan where the acceptance keeps a tree but the
    measured step costs cut it: the step goes ahead instead of draining the overlap every step. Where a depth is
    unmeasured (the plan tries it) or a probe is due, it still says no."""
    sched, seqs = two_decoding(500)
    sched.gate = None  # the cut alone
    adaptive = lambda s: ((2, 2, 1), True)  # noqa: E731
    pending = [(s, True) for s in seqs]
    assert sched.plans_plain(pending, adaptive, 2)  # nothing measured: the plan measures a plain step first
    for _ in range(2):
        sched.costs.observe(2, 0, 1.0)
    assert not sched.plans_plain(pending, adaptive, 2)  # depth 1 unmeasured: the plan would try it
    assert [len(w) for _, w in sched.schedule(adaptive).decodes] == [1, 1]
    for depth in (3, 3, 2, 2, 1, 1):
        sched.costs.observe(2, depth, 1.0 + 10 * depth, ("draft",))  # drafting is ruinously slow here
    assert [w for _, w in sched.schedule(adaptive).decodes] == [(), ()]  # the plan: plain
    for s in seqs:
        s.steps_without_draft = 0  # no probe due yet
    assert sched.plans_plain(pending, adaptive, 2)  # ... and so the overlapped step's test
    seqs[0].steps_without_draft = 10**6  # long without a draft: a probe falls due on the interval's steps
    answers = set()
    for _ in range(sched._interval("draft", 2)):
        sched.num_schedules += 1
        answers.add(sched.plans_plain(pending, adaptive, 2))
    assert answers == {True, False}  # plain between the probes, not on a probe's step
    seqs[0].steps_without_draft = 0
    # a request without a drafter rides along: the plain-penalty bound holds too, and the answer stays plain
    assert sched.plans_plain(pending[:1], adaptive, 2)
    # cheap drafting: the cut keeps the tree, and the test says so
    for depth in (3, 2, 1, 0) * 20:
        sched.costs.observe(2, depth, 1.0 + 0.01 * depth, ("draft",))
    assert not sched.plans_plain(pending, adaptive, 2)
    assert [len(w) for _, w in sched.schedule(adaptive).decodes] == [3, 3]
