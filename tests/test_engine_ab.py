"""bench/engine_ab.py's arm parsing and summary (the GPU runs themselves are the bench's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from engine_ab import parse_arm, summarise  # noqa: E402


def test_parse_arm():
    assert parse_arm("SPECGATE_INT4_SCALE_DOT=1") == {"SPECGATE_INT4_SCALE_DOT": "1"}
    assert parse_arm("A=0,B=x=y") == {"A": "0", "B": "x=y"}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_arm("A")


def test_summarise_means_and_pair_wins():
    runs = [{"arm": "a", "verify_ms": {"1": 2.0, "16": 3.0}}, {"arm": "b", "verify_ms": {"1": 2.2, "16": 2.9}},
            {"arm": "a", "verify_ms": {"1": 2.4, "16": 3.1}}, {"arm": "b", "verify_ms": {"1": 2.1, "16": 3.3}}]
    s = summarise(runs, ["a", "b"])
    assert s["mean_verify_ms"] == {"a": {"1": 2.2, "16": 3.05}, "b": {"1": 2.15, "16": 3.1}}
    assert s["pairs"] == 2
    assert s["pair_wins"] == {"1": {"a": 1, "b": 1}, "16": {"a": 1, "b": 1}}
