"""gateway/stats.py and the tree-aware figures: exact values on constructed trees, a fake clock for the
per-second series, bounded memory, thread safety, arm labels, and the engine's ranks on real trees."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from draft.params import SpeculationParams
from engine_util import run_all, tiny_engine
from gateway import stats as stats_mod
from gateway.sequence import SpecStats, sibling_rank
from gateway.stats import OFF, Arm, ArmLabeller, StatsStore, percentile, tree_label
from verify.sampling import SamplingParams

ON = Arm("on", "draft", "adaptive")
#        node: 0   1  2  3  4  5  6
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3]  # root -> {1, 2}; 1 -> {3, 4}; 2 -> {5}; 3 -> {6}


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_sibling_rank_counts_earlier_children_of_the_same_parent() -> None:
    assert [sibling_rank(TREE_PARENTS, n) for n in range(1, 7)] == [0, 1, 0, 1, 0, 0]


def test_spec_stats_record_depths_ranks_and_waste_on_a_constructed_tree() -> None:
    st = SpecStats()
    st.record(7, TREE_PARENTS, [0, 2, 5])  # the root's second child, then its only child
    st.record(7, TREE_PARENTS, [0, 1, 4])  # the first child, then its second
    st.record(7, TREE_PARENTS, [0])  # nothing accepted
    st.record(1, [], [0])  # plain decoding
    assert (st.steps, st.drafted_tokens, st.accepted_tokens, st.verified_nodes) == (4, 18, 4, 22)
    assert st.accepted_by_depth == [2, 2]
    assert st.accepted_by_rank == [2, 2]  # ranks: (1, 0) and (0, 1)
    assert st.steps_by_accepted_depth == [2, 0, 2]  # two steps kept nothing, two kept two drafts
    assert (st.kept_nodes, st.wasted_nodes) == (8, 14)
    assert st.utilisation == pytest.approx(8 / 22) and st.mean_accepted_length == 2.0


def test_spec_stats_since_and_add_round_trip() -> None:
    before = SpecStats()
    before.record(7, TREE_PARENTS, [0, 1])
    after = before.copy()
    after.record(7, TREE_PARENTS, [0, 2, 5])
    delta = after.since(before)
    assert (delta.steps, delta.accepted_tokens, delta.verified_nodes) == (1, 2, 7)
    assert delta.accepted_by_depth == [1, 1] and delta.accepted_by_rank == [1, 1]
    before.add(delta)
    assert before == after


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert [percentile(values, q) for q in (0.5, 0.9, 0.99, 1.0)] == [50.0, 90.0, 99.0, 100.0]
    assert percentile([3.0], 0.99) == 3.0 and percentile([], 0.5) is None


def step(accepted: list[int], verified: int) -> SpecStats:
    """One step's delta: ``accepted`` = the accepted path's nodes of TREE_PARENTS (root first)."""
    st = SpecStats()
    st.record(verified, TREE_PARENTS if verified > 1 else [], accepted)
    return st


def test_store_summarises_arms_and_buckets_seconds_on_a_fake_clock() -> None:
    clock = Clock(1000.0)
    store = StatsStore(clock)
    store.observe_step(ON, step([0, 2, 5], 7), 3, 1000.2)
    store.observe_step(ON, step([0], 7), 1, 1000.7)
    store.observe_step(ON, step([0, 1], 7), 2, 1001.5)
    store.observe_step(OFF, step([0], 1), 1, 1001.5)
    store.observe_first_token(ON, 0.030, 1000.2)
    store.observe_first_token(ON, 0.010, 1003.1)
    store.observe_token_gaps(ON, 0.002, 3, 1000.7)
    store.observe_token_gaps(ON, 0.004, 1, 1001.5)
    store.observe_request(ON, True)
    store.observe_request(ON, False)
    store.observe_load(waiting=2, running=1, kv_used=16, kv_total=64, now=1000.5)
    store.observe_load(waiting=0, running=1, kv_used=8, kv_total=64, now=1000.9,
                       gate=((1, True, 900, 800, "draft"), (16, False, None, 5000, None)))
    clock.now = 1004.5
    snap = store.snapshot()
    assert snap["speculation_gate"] == {"1": {"speculate": True, "spec_tok_s": 900, "plain_tok_s": 800,
                                              "drafter": "draft"},
                                        "16": {"speculate": False, "spec_tok_s": None, "plain_tok_s": 5000}}
    on = snap["arms"]["on/draft/adaptive"]
    assert (on["requests"], on["errors"], on["tokens"], on["steps"], on["accepted_tokens"]) == (2, 1, 6, 3, 3)
    assert on["mean_accepted_length"] == 2.0 and on["tokens_per_s"] == 6 / 4  # seconds 1000..1003 complete
    assert on["acceptance_by_depth"] == [2 / 3, 1 / 3] and on["accepted_by_rank"] == [2, 1]
    assert on["steps_by_accepted_depth"] == [1, 1, 1]
    assert on["utilisation"] == 6 / 21 and on["wasted_per_step"] == 15 / 3
    assert on["ttft_s"] == {"p50": 0.010, "p90": 0.030, "p99": 0.030, "n": 2}
    assert on["per_token_s"] == {"p50": 0.002, "p90": 0.004, "p99": 0.004, "n": 4}
    off = snap["arms"]["off/none/none"]
    assert off["acceptance_by_depth"] == [] and off["utilisation"] == 1.0 and off["wasted_per_step"] == 0.0
    series = snap["series"]
    assert series["t"] == [-4, -3, -2, -1]
    assert series["arms"]["on/draft/adaptive"] == {
        "tokens_per_s": [4.0, 2.0, 0.0, 0.0], "ttft_s": [0.030, None, None, 0.010],
        "per_token_s": [0.002, 0.004, None, None], "accepted_length": [2.0, 2.0, None, None]}
    # each second's highest load; seconds without an observation hold the last one (0.125, 0 waiting)
    assert series["kv_used_fraction"] == [0.25, 0.125, 0.125, 0.125] and series["queue_waiting"] == [2, 0, 0, 0]
    assert snap["kv"] == {"used_blocks": 8, "total_blocks": 64, "used_fraction": 0.125}
    assert snap["queue"] == {"waiting": 0, "running": 1}


def test_reset_starts_a_new_experiment_and_keeps_the_present_load() -> None:
    clock = Clock(50.0)
    store = StatsStore(clock)
    store.observe_step(ON, step([0, 1], 7), 2, 50.5)
    store.observe_load(1, 2, 10, 20, 50.5)
    clock.now = 60.2
    store.reset()
    clock.now = 62.7
    snap = store.snapshot()
    assert snap["arms"] == {} and snap["series"]["t"] == [-2, -1] and snap["since_reset_s"] == pytest.approx(2.5)
    assert snap["series"]["kv_used_fraction"] == [0.5, 0.5] and snap["series"]["queue_waiting"] == [1, 1]
    assert snap["kv"]["used_blocks"] == 10 and snap["queue"] == {"waiting": 1, "running": 2}


def test_memory_is_bounded() -> None:
    clock = Clock(0.0)
    store = StatsStore(clock)
    for sec in range(stats_mod.SERIES_S + 100):
        store.observe_step(ON, step([0], 7), 1, sec + 0.5)
        store.observe_token_gaps(ON, 0.001, 16, sec + 0.5)
        store.observe_first_token(ON, 0.01, sec + 0.5)
        store.observe_first_token(ON, 0.02, sec + 0.6)
        store.observe_load(0, 0, 1, 2, sec + 0.5)
    clock.now = stats_mod.SERIES_S + 100.0
    assert len(store._buckets) <= stats_mod.SERIES_S
    snap = store.snapshot()
    assert len(snap["series"]["t"]) == stats_mod.SERIES_S and snap["series"]["t"][0] == -stats_mod.SERIES_S
    on = snap["arms"]["on/draft/adaptive"]
    assert on["per_token_s"]["n"] == stats_mod.TOKEN_SAMPLES and on["ttft_s"]["n"] == stats_mod.TTFT_SAMPLES
    assert on["steps"] == stats_mod.SERIES_S + 100  # totals since reset stay exact


def test_concurrent_writers_and_readers_lose_nothing() -> None:
    store = StatsStore()
    one = step([0, 1], 7)

    def engine_thread() -> None:
        for _ in range(2000):
            store.observe_step(ON, one, 2, store.clock())

    def loop_thread() -> None:
        for _ in range(2000):
            store.observe_token_gaps(ON, 0.001, 1, store.clock())
            store.observe_request(ON, True)

    threads = [threading.Thread(target=f) for f in (engine_thread, engine_thread, loop_thread)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        store.snapshot()
    for t in threads:
        t.join()
    on = store.snapshot()["arms"]["on/draft/adaptive"]
    assert (on["steps"], on["tokens"], on["accepted_tokens"], on["requests"]) == (4000, 8000, 4000, 2000)


def test_tree_labels_and_bounded_arm_cardinality() -> None:
    assert tree_label((2, 2, 1), None) == "2x2x1" and tree_label(None, None) == "adaptive"
    assert tree_label(None, 6) == "max_nodes=6" and tree_label((4, 1), 3) == "4x1,max_nodes=3"
    labeller = ArmLabeller(max_trees=2)
    assert labeller.arm(None, (2, 1), None) == OFF
    assert labeller.arm("ngram", None, None) == Arm("on", "ngram", "adaptive")
    assert [labeller.arm("draft", (w,), None).tree for w in (1, 2, 3, 1)] == ["1", "2", "other", "1"]


def test_stats_and_audit_modules_load_no_torch() -> None:
    code = "import sys, gateway.stats, gateway.audit; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_engine_commit_records_each_accepted_nodes_rank_among_its_siblings() -> None:
    """On real draft trees: ranks recomputed here from each step's tree and accepted path match the engine's."""
    engine = tiny_engine(tree=(3, 2, 1))
    seen: list[tuple[list[int], list[int]]] = []
    commit = engine._commit

    def spy(seq, tree, result, offered):
        seen.append((tree.parents.tolist(), list(result.accepted_nodes)))
        return commit(seq, tree, result, offered)

    engine._commit = spy
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=32, ignore_eos=True)
    seqs = {}
    real_add = engine.add
    engine.add = lambda rid, *a, **k: seqs.setdefault(rid, real_add(rid, *a, **k))
    run_all(engine, [("g", [1, 2, 3], greedy, SpeculationParams(drafter="draft", tree=(3, 2, 1))),
                     ("s", [4, 5], sampled, SpeculationParams(drafter="draft", tree=(3, 2, 1)))])
    ranks: list[int] = []
    for parents, path in seen:
        for node in path[1:]:
            children = [i for i, p in enumerate(parents) if p == parents[node]]
            ranks.append(children.index(node))
    got = SpecStats()
    for seq in seqs.values():
        got.add(seq.stats)
    want = [ranks.count(r) for r in range(max(ranks) + 1)] if ranks else []
    assert got.accepted_by_rank == want and sum(want) == got.accepted_tokens > 0
    assert got.verified_nodes == sum(len(parents) for parents, _ in seen)
    assert got.wasted_nodes == sum(len(parents) - len(path) for parents, path in seen)
