"""bench/closed_loop.py's phases on the tiny engine: every request finishes, the tokens and steps add up, and the
profiled pass ranks functions by their own time."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import closed_loop  # noqa: E402  (bench/)
from engine_util import tiny_engine  # noqa: E402


@pytest.mark.parametrize("phase", closed_loop.PHASES)
def test_phase_runs_every_request_to_its_end(phase):
    eng = tiny_engine(max_running=4)
    prompts = [[1 + i, 2 + i, 3 + i, 4 + i] for i in range(5)]
    row = closed_loop.run_phase(SimpleNamespace(engine=eng), prompts, phase, concurrency=3, requests=7, max_tokens=6,
                                profile=phase == "mixed", top=10)
    assert row["tokens"] == 7 * 6  # greedy, no stop token in the tiny vocabulary's way: each runs to max_tokens
    assert row["prefill_chunks"] >= 7 and row["steps_run"] > 0
    arms = {"off": ["off"], "on": ["on"], "mixed": ["on", "off"]}[phase]
    assert sorted(k for k in row if k.startswith("p50_tpot_ms_")) == sorted(f"p50_tpot_ms_{a}" for a in arms)
    assert all(0 < row[f"p50_tpot_ms_{a}"] <= row[f"p90_tpot_ms_{a}"] for a in arms)
    assert not eng.has_work() and eng.cache.pool.num_free == eng.cache.pool.num_blocks  # nothing leaked
    # a step call's parts: the thread's CPU time and the device waits each fit in its wall time
    assert 0 < row["thread_cpu_ms_per_step_call"] <= row["ms_per_step_call"] * 1.01 + 0.01
    assert 0 <= row["wait_ms_per_step_call"] <= row["ms_per_step_call"]
    if phase == "mixed":
        top = row["top_tottime_us_per_call"]
        own = [r["tottime_us_per_step_call"] for r in top]
        assert len(top) == 10 and own == sorted(own, reverse=True) and all(r["calls_per_step_call"] > 0 for r in top)
        # the whole loop's time per step call bounds any one function's own time
        assert own[0] <= 1e3 * row["ms_per_step_call"]
    else:
        assert "top_tottime_us_per_call" not in row


def test_unknown_phase_is_refused_by_name():
    with pytest.raises(SystemExit, match="'fast'"):
        closed_loop.main(["--phases", "off,fast"])


def test_on_and_mixed_phases_are_set_against_the_off_phases_beside_them():
    def row(phase, tok_s, off_tpot=None, profiled=False):
        r = {"phase": phase, "tok_s": tok_s, "profiled": profiled}
        return r | ({"p50_tpot_ms_off": off_tpot} if off_tpot is not None else {})

    rows = [row("off", 100.0, 2.0), row("on", 90.0), row("mixed", 95.0, 2.2), row("off", 110.0, 2.4),
            row("mixed", 99.0, 2.6), row("mixed", 1.0, 9.0, profiled=True)]
    got = closed_loop.against_off(rows)
    # the on and first mixed phases sit between the off phases 0 and 3 (mean 105 tok/s, 2.2 ms); the last timed
    # mixed phase has only phase 3 before it; the profiled pass is no phase of the comparison
    assert got == [{"phase": "on", "index": 1, "tok_s_over_off": 0.857},
                   {"phase": "mixed", "index": 2, "tok_s_over_off": 0.905, "off_arm_tpot_over_off": 1.0},
                   {"phase": "mixed", "index": 4, "tok_s_over_off": 0.9, "off_arm_tpot_over_off": 1.083}]
    assert closed_loop.against_off([row("on", 90.0)]) == []  # nothing to compare with
