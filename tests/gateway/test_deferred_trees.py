"""Deferred draft trees (draft/tree.py ``TokenTree.deferred``): a greedy tree grown on the device goes into the
target's batch from there, and the acceptance's host copy brings it back. The engine's output, acceptance and
pools are those of trees copied to the host first, and a speculative step copies device data to the host
once, as a plain step does."""

from __future__ import annotations

import traceback
from dataclasses import replace

import pytest
import torch

from draft import model_drafter
from draft.hybrid import HybridDrafter
from draft.ngram import NgramDrafter
from draft.params import SpeculationParams
from draft.tree import TokenTree
from draft.tree_loop import GreedyTreeLoop
from engine_util import tiny_engine
from verify.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        base = torch.randint(0, 64, (3 + i % 5,), generator=g).tolist()
        out.append(base * 3 if i % 3 == 0 else base)  # repeats: the hybrid's lookup finds some
    return out


@pytest.fixture(autouse=True)
def defer_every_depth(monkeypatch):
    """The mechanism under test at every depth: by default one-level trees are not deferred (DEFER_MIN_DEPTH,
    test_one_level_trees_are_copied_to_the_host_by_default)."""
    monkeypatch.setattr(model_drafter, "DEFER_MIN_DEPTH", 1)


def _engine(defer: bool):
    eng = tiny_engine(max_running=6)
    eng.config = replace(eng.config, defer_trees=defer)
    eng.drafters["hybrid"] = HybridDrafter("hybrid", eng.drafters["draft"], NgramDrafter())
    return eng


def _run(eng, reqs) -> tuple[dict[str, list[int]], dict[str, tuple[int, int, int]]]:
    for rid, prompt, sampling, spec in reqs:
        eng.add(rid, prompt, sampling, spec)
    tokens: dict[str, list[int]] = {rid: [] for rid, *_ in reqs}
    stats = {}
    while eng.has_work():
        for o in eng.step():
            tokens[o.request_id] += o.new_token_ids
            if o.finished:
                assert o.error is None, o.error
                stats[o.request_id] = (o.stats.steps, o.stats.drafted_tokens, o.stats.accepted_tokens)
    return tokens, stats


@pytest.mark.parametrize("spec", [SpeculationParams(drafter="draft", tree=(2, 2, 1)),
                                  SpeculationParams(drafter="self", tree=(1, 1, 1, 1)),
                                  SpeculationParams(drafter="exact", tree=(3, 2)),
                                  SpeculationParams(drafter="hybrid", tree=(2, 1, 1)),
                                  SpeculationParams(drafter="draft")])  # the adaptive budget: cuts and probes
def test_deferred_trees_change_nothing_but_the_copies(spec, monkeypatch) -> None:
    """Greedy speculating requests among plain and sampled ones (which keep host trees), more requests than
    running slots: every token as with host trees, every acceptance count too (but the hybrid's, whose lookup
    chains ride unmerged beside a deferred tree), and the pools end whole."""
    grown, chained = [], []
    on_device, with_chains = GreedyTreeLoop.grow_on_device, TokenTree.with_chains
    monkeypatch.setattr(GreedyTreeLoop, "grow_on_device", lambda self, *a: grown.append(1) or on_device(self, *a))
    monkeypatch.setattr(TokenTree, "with_chains", lambda self, c: chained.append(1) or with_chains(self, c))
    ps = _prompts(10)
    sampled = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=3)
    reqs = [(str(i), p, sampled if i == 4 else GREEDY, spec if i % 5 != 2 else SpeculationParams(enabled=False))
            for i, p in enumerate(ps)]
    runs = {}
    for defer in (True, False):
        grown.clear()
        eng = _engine(defer)
        runs[defer] = _run(eng, reqs)
        assert bool(grown) == defer  # deferred steps happened, and only when asked for
        assert eng.cache.pool.num_free == eng.cache.pool.num_blocks
        for d in eng.drafters.values():
            if hasattr(d, "cache"):
                assert d.cache.pool.num_free == d.cache.pool.num_blocks
    assert runs[True][0] == runs[False][0]
    if spec.drafter == "hybrid":  # lookup chains rode after device trees, unmerged: their nodes may count apart
        assert chained
    else:
        assert runs[True][1] == runs[False][1]


@pytest.mark.parametrize("drafter", ["draft", "hybrid"])
def test_a_speculative_step_copies_to_the_host_once(monkeypatch, drafter: str) -> None:
    """Count every read of tensor data into Python during greedy speculative steps, outside the CPU attention
    references (kernels/, which read context lengths on the host and never run on CUDA): one a step with
    deferred trees -- the acceptance's -- where trees copied first made two (one in a step that drafts
    nothing, near max_tokens)."""
    reads: list[int] = []
    counting = [False]

    def counted(name):
        orig = getattr(torch.Tensor, name)

        def read(self, *a, **k):
            if counting[0] and not any("/kernels/" in f.filename for f in traceback.extract_stack(limit=12)):
                reads.append(1)
            return orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, read)

    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__"):
        counted(name)
    per_step = {}
    for defer in (True, False):
        eng = _engine(defer)
        for i, p in enumerate(_prompts(4)):
            eng.add(str(i), p, GREEDY, SpeculationParams(drafter=drafter, tree=(2, 2, 1)))
        eng.step()  # prefill
        eng.step()  # the first step feeds the draft its prompt
        per_step[defer] = []
        while eng.has_work():
            reads.clear()
            counting[0] = True
            eng.step()
            counting[0] = False
            per_step[defer].append(len(reads))
    assert set(per_step[True]) == {1}
    assert 2 in per_step[False] and set(per_step[False]) <= {1, 2}  # 1: no model level that step


def test_trees_are_deferred_by_default_on_cuda_only() -> None:
    """On the CPU deferring saves no wait (its tensor ops run as issued) and costs its extra ops: the default
    (None) defers on CUDA targets only; an explicit setting wins."""
    eng = tiny_engine()
    assert eng.config.defer_trees is None and not eng._defer_trees
    eng.config = replace(eng.config, defer_trees=True)
    assert eng._defer_trees


def test_min_tokens_reads_a_deferred_trees_depths_without_a_host_copy() -> None:
    """A stop token held back by min_tokens at a deferred tree's rows: the same output as with host trees."""
    ps = _prompts(4)
    free = _run(_engine(False), [("f", ps[1], GREEDY, SpeculationParams(enabled=False))])[0]["f"]
    stop = free[1]
    sampling = replace(GREEDY, stop_token_ids=(stop,), min_tokens=7)
    reqs = [(str(i), p, sampling, SpeculationParams(drafter="exact", tree=(2, 2, 1))) for i, p in enumerate(ps)]
    runs = {}
    for defer in (True, False):
        eng = _engine(defer)
        runs[defer] = _run(eng, reqs)[0]
        assert eng.cache.pool.num_free == eng.cache.pool.num_blocks
    assert runs[True] == runs[False]
    assert stop not in runs[True]["1"][:7] and len(runs[True]["1"]) >= 8


@pytest.mark.parametrize("tree, deferred", [((1,), False), ((2,), False), ((1, 1), True), ((2, 2, 1), True)])
def test_one_level_trees_are_copied_to_the_host_by_default(monkeypatch, tree, deferred: bool) -> None:
    monkeypatch.setattr(model_drafter, "DEFER_MIN_DEPTH", 2)
    grown = []
    on_device = GreedyTreeLoop.grow_on_device
    monkeypatch.setattr(GreedyTreeLoop, "grow_on_device", lambda self, *a: grown.append(1) or on_device(self, *a))
    eng = _engine(True)
    tokens, _ = _run(eng, [("a", _prompts(1)[0], replace(GREEDY, max_tokens=8),
                            SpeculationParams(drafter="draft", tree=tree))])
    assert bool(grown) == deferred and len(tokens["a"]) == 8
    assert eng.cache.pool.num_free == eng.cache.pool.num_blocks
