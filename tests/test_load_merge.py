"""bench/load_merge.py: the load stage's parts joined into the load issue's table."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from load import ratio_interval  # noqa: E402
from load_merge import merge  # noqa: E402


def _arm(tok_s: float, tpot: float, mal: float, mean_tok_s: float | None = None) -> dict:
    pct = lambda x: {"p50": x, "p90": x, "p99": x, "mean": x, "n": 4}  # noqa: E731
    rate = pct(tok_s) | ({"mean": mean_tok_s} if mean_tok_s is not None else {})
    return {"requests": 4, "errors": 0, "tokens": 256, "request_tokens_per_s": rate, "mean_accepted_length": mal,
            "ttft_s": pct(0.01), "itl_s": pct(tpot), "tpot_s": pct(tpot), "e2e_s": pct(0.1)}


def _report(commit: str, levels: list[tuple[int, dict]]) -> dict:
    return {"date": "2026-12-03", "device": "dev", "model": "m", "commit": commit, "max_tokens": 64, "temperature": 0,
            "rate_per_s": "inf", "arms": {"on": {}, "off": {"enabled": False}}, "requests_per_level": 8,
            "levels": [{"concurrency": c, "wall_s": 1.0, "tokens_per_s": 1.0, "arms": arms} for c, arms in levels]}


def test_merge_joins_levels_and_compares_the_off_arm_with_the_off_only_server() -> None:
    low = _report("abc", [(1, {"on": _arm(600.0, 0.0015, 2.0), "off": _arm(400.0, 0.002, 1.0)})])
    # at 64 the rates are bimodal (admission waits): p50s far apart, means close
    high = _report("abc", [(64, {"on": _arm(30.0, 0.02, 1.1, 48.0), "off": _arm(60.0, 0.021, 1.0, 50.0)})])
    off = _report("abc", [(1, {"off": _arm(500.0, 0.0016, 1.0)}), (64, {"off": _arm(55.0, 0.02, 1.0)})])
    stats = {"arms": {"on/hybrid/adaptive": {"steps": 10, "drafted_tokens": 5, "accepted_tokens": 3,
                                             "mean_accepted_length": 1.3, "acceptance_by_depth": [0.3], "x": 1}}}
    r = merge([low, high], [off], stats, ["a note"])
    assert [row["concurrency"] for row in r["rows"]] == [1, 64]
    one, many = r["rows"]
    assert one["ratio"] == 1.5 and one["mean_accepted_length_on"] == 2.0
    assert one["off_only_server_p50_tpot_ms"] == 1.6 and one["off_arm_tpot_vs_off_only_server"] == 1.25
    assert many["off_arm_tpot_vs_off_only_server"] == 1.05
    assert many["ratio"] == 0.5 and many["ratio_mean"] == 0.96
    assert r["requests_per_level"] == {"1": 8, "64": 8}
    assert r["server_stats"]["on/hybrid/adaptive"] == {"steps": 10, "drafted_tokens": 5, "accepted_tokens": 3,
                                                      "mean_accepted_length": 1.3, "acceptance_by_depth": [0.3]}
    assert r["notes"] == ["a note"]


def test_server_ratio_compares_the_single_arm_runs_level_by_level() -> None:
    mixed = _report("abc", [(1, {"on": _arm(600.0, 0.0015, 2.0), "off": _arm(400.0, 0.002, 1.0)}),
                            (64, {"on": _arm(30.0, 0.02, 1.1), "off": _arm(60.0, 0.021, 1.0)})])
    on_low = _report("abc", [(1, {"on": _arm(620.0, 0.0014, 2.1)})])
    on_high = _report("abc", [(64, {"on": _arm(50.0, 0.019, 1.2)})])
    on_high["requests_per_level"] = 128
    on_low["levels"][0]["tokens_per_s"], on_high["levels"][0]["tokens_per_s"] = 900.0, 3000.0
    off_low = _report("abc", [(1, {"off": _arm(450.0, 0.0018, 1.0)})])
    off_high = _report("abc", [(64, {"off": _arm(55.0, 0.02, 1.0)})])
    off_low["levels"][0]["tokens_per_s"], off_high["levels"][0]["tokens_per_s"] = 450.0, 4000.0
    r = merge([mixed], [off_low, off_high], None, [], on_only=[on_low, on_high])
    one, many = r["rows"]
    assert one["server_ratio"] == 2.0 and many["server_ratio"] == 0.75
    assert one["on_only_total_tok_s"] == 900.0 and many["off_only_server_total_tok_s"] == 4000.0
    assert one["on_only_mean_accepted_length"] == 2.1 and many["on_only_p50_tpot_ms"] == 19.0
    assert r["on_only_run"]["requests_per_level"] == {"1": 8, "64": 128}
    assert [lv["concurrency"] for lv in r["off_only_server"]["levels"]] == [1, 64]
    # a level the single-arm runs did not cover gets no ratio rather than a wrong one
    r2 = merge([mixed], [off_low], None, [], on_only=[on_low, on_high])
    assert r2["rows"][1]["server_ratio"] is None and "off_only_server_total_tok_s" not in r2["rows"][1]


def test_rows_carry_the_budget_the_server_chose_at_each_level() -> None:
    """Draft nodes per request-step of the speculating arms, from each level's server counters; None where a
    level has none (an older server, or --no-server-stats)."""
    arm = lambda steps, drafted: {"steps": steps, "drafted_tokens": drafted, "accepted_tokens": 0,  # noqa: E731
                                  "verified_nodes": steps + drafted, "mean_accepted_length": 1.0}
    mixed = _report("abc", [(1, {"on": _arm(600.0, 0.0015, 2.0), "off": _arm(400.0, 0.002, 1.0)}),
                            (64, {"on": _arm(30.0, 0.02, 1.1), "off": _arm(60.0, 0.021, 1.0)})])
    mixed["levels"][0]["server"] = {"on/ngram/adaptive": arm(100, 300), "on/draft/2,1": arm(100, 100),
                                    "off/none/none": arm(200, 0)}
    on_only = _report("abc", [(64, {"on": _arm(50.0, 0.019, 1.2)})])
    on_only["levels"][0]["server"] = {"on/ngram/adaptive": arm(400, 20)}
    one, many = merge([mixed], None, None, [], on_only=[on_only])["rows"]
    assert one["drafted_per_step_on"] == 2.0 and many["drafted_per_step_on"] is None
    assert many["on_only_drafted_per_step"] == 0.05
    assert one["gate_at_level"] is None  # no gate state in that level's counters


def test_rows_carry_the_gate_state_at_each_levels_bucket() -> None:
    """The speculation gate's verdict for the batch bucket of each level's concurrency, as the server had it
    when the level ended (``load.server_stats``)."""
    mixed = _report("abc", [(1, {"on": _arm(600.0, 0.0015, 2.0), "off": _arm(400.0, 0.002, 1.0)}),
                            (12, {"on": _arm(30.0, 0.02, 1.1), "off": _arm(60.0, 0.021, 1.0)})])
    gate = {"1": {"speculate": True, "spec_tok_s": 900, "plain_tok_s": 700},
            "16": {"speculate": False, "spec_tok_s": 5000, "plain_tok_s": 9000}}
    for level in mixed["levels"]:
        level["server"] = {"on/ngram/adaptive": {"steps": 10, "drafted_tokens": 1}, "speculation_gate": gate}
    one, twelve = merge([mixed], None, None, [])["rows"]
    assert one["gate_at_level"] == gate["1"] and twelve["gate_at_level"] == gate["16"]  # 12 streams: bucket 16
    assert one["drafted_per_step_on"] == 0.1  # the gate's key is not an arm


def test_merge_refuses_parts_of_different_commits() -> None:
    a = _report("abc", [(1, {"on": _arm(1.0, 0.1, 1.0), "off": _arm(1.0, 0.1, 1.0)})])
    b = _report("def", [(4, {"on": _arm(1.0, 0.1, 1.0), "off": _arm(1.0, 0.1, 1.0)})])
    with pytest.raises(SystemExit, match="different commits"):
        merge([a, b], None, None, [])


def test_ratio_interval_brackets_the_ratio_and_narrows_with_more_requests() -> None:
    assert ratio_interval([], [1.0]) is None
    assert ratio_interval([4.0] * 8, [2.0] * 8) == [2.0, 2.0]  # no spread: the ratio itself
    rng = random.Random(1)
    off = [rng.gauss(100, 15) for _ in range(8)]
    on = [x * 1.5 for x in off]
    lo, hi = ratio_interval(on, off)
    assert lo < 1.5 < hi  # eight requests an arm: a wide interval around the ratio
    many_off = [rng.gauss(100, 15) for _ in range(128)]
    lo2, hi2 = ratio_interval([x * 1.5 for x in many_off], many_off)
    assert lo2 < 1.5 < hi2 and hi2 - lo2 < hi - lo and lo2 > 1.0  # 128: narrow, and clear of 1


def test_rounds_keep_every_ratio_and_their_median() -> None:
    from load_merge import combine_rounds

    def rnd(ratio, server, penalty):
        return {"commit": "abc", "levels": [{"concurrency": 64}], "notes": [],
                "rows": [{"concurrency": 64, "ratio": ratio, "server_ratio": server,
                          "off_arm_tpot_vs_off_only_server": penalty, "tpot_ratio_off_over_on": None}]}

    r = combine_rounds([rnd(1.0, 1.2, 1.11), rnd(0.9, 0.76, 1.28), rnd(1.1, None, 1.02)])
    row = r["rows"][0]
    assert r["rounds"] == 3 and len(r["round_levels"]) == 2
    assert row["ratio"] == 1.0  # the first round's row itself, untouched
    assert row["ratio_rounds"] == [1.0, 0.9, 1.1] and row["ratio_median"] == 1.0
    assert row["server_ratio_rounds"] == [1.2, 0.76, None] and row["server_ratio_median"] == 0.98  # of the two known
    assert row["off_arm_tpot_vs_off_only_server_median"] == 1.11
    assert "tpot_ratio_off_over_on_median" not in row  # never measured


def test_rounds_of_other_commits_or_levels_are_refused() -> None:
    from load_merge import combine_rounds

    a = {"commit": "abc", "levels": [], "rows": [{"concurrency": 64}]}
    with pytest.raises(SystemExit, match="different commits"):
        combine_rounds([a, a | {"commit": "def"}])
    with pytest.raises(SystemExit, match="different concurrencies"):
        combine_rounds([a, a | {"rows": [{"concurrency": 16}]}])
