"""gateway/metrics.py: the step series, kept as plain numbers and collected at scrape time, expose the
counts, buckets and sums that per-observation prometheus-client metrics would."""

from __future__ import annotations

from gateway.metrics import Metrics
from gateway.sequence import SpecStats
from gateway.stats import Arm

NGRAM, DRAFT, OFF = Arm("on", "ngram", "adaptive"), Arm("on", "draft", "2x2x1"), Arm("off", "none", "none")


def lines(m: Metrics) -> set[str]:
    return {line for line in m.render().decode().splitlines() if not line.startswith("#")}


def test_step_series_count_bucket_and_sum_every_observation() -> None:
    m = Metrics()
    m.observe_step(NGRAM, SpecStats(1, 4, 2, [1, 1], 5, [1, 1]))  # 3 tokens from one step of 5 nodes
    m.observe_step(DRAFT, SpecStats(2, 6, 3, [2, 1], 8, [2, 0, 1]))  # two steps, 2.5 tokens a step
    m.observe_step(OFF, SpecStats(3, 0, 0, [], 3, []))  # three plain steps in one delivery
    m.observe_step(OFF, SpecStats(0, 0, 0, [], 0, []))  # no step: nothing observed
    got = lines(m)
    want = {
        'specgate_target_steps_total{speculation="on"} 3.0',
        'specgate_target_steps_total{speculation="off"} 3.0',
        'specgate_drafted_tokens_total{speculation="on"} 10.0',
        'specgate_accepted_tokens_total{speculation="on"} 5.0',
        # one observation per delivery: 3.0 (ngram) and 2.5 (draft) on, 1.0 off
        'specgate_accepted_length_bucket{le="2.0",speculation="on"} 0.0',
        'specgate_accepted_length_bucket{le="3.0",speculation="on"} 2.0',
        'specgate_accepted_length_count{speculation="on"} 2.0',
        'specgate_accepted_length_sum{speculation="on"} 5.5',
        'specgate_accepted_length_bucket{le="1.0",speculation="off"} 1.0',
        'specgate_accepted_by_depth_total{depth="1"} 3.0',
        'specgate_accepted_by_depth_total{depth="2"} 2.0',
        # ranks: ngram one at rank 0 and one at 1; draft two at 0 and one at 2
        'specgate_accepted_rank_bucket{drafter="draft",le="1.0",speculation="on",tree="2x2x1"} 2.0',
        'specgate_accepted_rank_count{drafter="draft",speculation="on",tree="2x2x1"} 3.0',
        'specgate_accepted_rank_sum{drafter="draft",speculation="on",tree="2x2x1"} 2.0',
        'specgate_accepted_rank_count{drafter="ngram",speculation="on",tree="adaptive"} 2.0',
        'specgate_verified_nodes_total{drafter="ngram",speculation="on",tree="adaptive"} 5.0',
        'specgate_kept_nodes_total{drafter="draft",speculation="on",tree="2x2x1"} 5.0',
        'specgate_wasted_verify_tokens_sum{drafter="draft",speculation="on",tree="2x2x1"} 1.5',
        'specgate_verify_utilisation_bucket{drafter="none",le="1.0",speculation="off",tree="none"} 1.0',
    }
    assert want <= got, sorted(want - got)


def test_per_token_gaps_count_every_token_of_an_event_with_inclusive_bounds() -> None:
    m = Metrics()
    m.per_token.add(("on",), 0.001, 3)  # one event of three tokens, exactly on the first bound
    m.per_token.add(("on",), 0.03, 1)
    got = lines(m)
    assert {'specgate_time_per_output_token_seconds_bucket{le="0.001",speculation="on"} 3.0',
            'specgate_time_per_output_token_seconds_bucket{le="0.02",speculation="on"} 3.0',
            'specgate_time_per_output_token_seconds_bucket{le="0.04",speculation="on"} 4.0',
            'specgate_time_per_output_token_seconds_count{speculation="on"} 4.0'} <= got
    assert not [line for line in got if 'speculation="off"' in line and "per_output_token" in line]


def test_the_speculation_gate_shows_per_bucket_and_moves_with_it() -> None:
    m = Metrics()
    m.observe_engine(0, 1, 4, 60, gate=((1, True, 900, 800, None), (16, False, None, 5000, None)))
    got = lines(m)
    assert {'specgate_speculation_gate{bucket="1"} 1.0', 'specgate_speculation_gate{bucket="16"} 0.0',
            'specgate_speculation_gate_tokens_per_second{arm="spec",bucket="1"} 900.0',
            'specgate_speculation_gate_tokens_per_second{arm="plain",bucket="16"} 5000.0'} <= got
    assert not any('arm="spec",bucket="16"' in line for line in got)  # never measured: no series
    m.observe_engine(0, 1, 4, 60, gate=((1, False, 700, 800, None), (16, False, None, 5000, None)))
    assert 'specgate_speculation_gate{bucket="1"} 0.0' in lines(m)
    assert not any("speculation_gate_drafter" in line and "{" in line for line in lines(m))


def test_the_drafter_the_gate_prefers_shows_per_bucket_and_moves_with_it() -> None:
    m = Metrics()
    m.observe_engine(0, 1, 4, 60, gate=((1, True, 900, 800, "draft"),))
    assert 'specgate_speculation_gate_drafter{bucket="1",drafter="draft"} 1.0' in lines(m)
    m.observe_engine(0, 1, 4, 60, gate=((1, True, 950, 800, "ngram"),))
    got = lines(m)
    assert {'specgate_speculation_gate_drafter{bucket="1",drafter="draft"} 0.0',
            'specgate_speculation_gate_drafter{bucket="1",drafter="ngram"} 1.0'} <= got
