"""A short soak (bench/soak.py): 200 mixed requests with cancellations, malformed bodies and engine
faults; every request ends exactly once, nothing leaks, nothing hangs."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from soak import problems, soak  # noqa: E402


import pytest  # noqa: E402


@pytest.mark.parametrize("overlap", [False, True], ids=["", "overlap"])
def test_short_soak_leaks_nothing(overlap: bool) -> None:
    report = soak(200, concurrency=16, seed=1, overlap=overlap)
    assert problems(report) == [], report
    by = report["by_status"]
    assert by.get("200", 0) > 100 and by.get("cancelled", 0) > 5 and report["faults_injected"] > 0
    assert set(by) <= {"200", "400", "500", "cancelled", "error_event"}, by
    assert (report["steps_ahead"] > 0) == overlap
