"""Adaptive tree budget: acceptance EMA, depth cut, probing, and the global verify cap."""

from __future__ import annotations

import pytest

from gateway.budget import AcceptanceEMA, BudgetConfig, adaptive_widths, cap_total


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
    assert adaptive_widths(t, 0.95, 0, cfg) == t  # 0.95^4 = 0.81 >= 0.2
    assert adaptive_widths(t, 0.6, 0, cfg) == (2, 2, 2)  # 0.6^3 = 0.216, 0.6^4 = 0.13
    assert adaptive_widths(t, 0.3, 0, cfg) == (2,)
    assert adaptive_widths(t, 0.1, 0, cfg) == ()  # does not pay: plain decoding


def test_plain_decoding_probes_periodically() -> None:
    cfg = BudgetConfig(min_gain=0.2, probe_every=4)
    assert [adaptive_widths((2, 2), 0.05, k, cfg) for k in range(5)] == [(), (), (), (1,), (1,)]


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
