"""draft/hybrid.py: lookup branches grafted onto a model draft's tree stay lossless, raise the accepted
length on repetitive text, and leave the model drafter's KV state consistent."""

from __future__ import annotations

import torch

from draft.hybrid import HybridDrafter
from draft.ngram import NgramDrafter
from draft.params import SpeculationParams
from draft.tree import TokenTree, cut_widths, graft_chains
from engine_util import run_all, tiny_engine
from verify.sampling import SamplingParams


def test_graft_merges_shared_prefixes_and_appends_after_the_model_nodes() -> None:
    model_tree = TokenTree.from_lists([9, 1, 2, 3], [-1, 0, 0, 1])  # 9 -> {1 -> 3, 2}
    out = graft_chains(model_tree, [[1, 3, 5, 6]])
    assert out.tokens.tolist() == [9, 1, 2, 3, 5, 6]
    assert out.parents.tolist() == [-1, 0, 0, 1, 3, 4]  # follows 1 -> 3, then grows 5 -> 6
    assert graft_chains(model_tree, [[2]]) is model_tree  # nothing new: the model's own tree
    assert graft_chains(model_tree, []) is model_tree


def test_the_model_tree_is_cut_to_leave_room_for_the_graft() -> None:
    assert cut_widths((2, 2, 2, 1), 3) == (2, 2) and cut_widths((2, 2, 2, 1), 2) == (2, 2, 1)
    assert cut_widths((2, 2, 2, 1), 0) == (2, 2, 2, 1)
    assert cut_widths((2, 1), 5) == () and cut_widths((), 2) == ()


def _engine():
    eng = tiny_engine(tree=(2, 1, 1))
    eng.drafters["hybrid"] = HybridDrafter("hybrid", eng.drafters["draft"], NgramDrafter())
    return eng


def _run(engine, reqs) -> tuple[dict[str, list[int]], int]:
    """Tokens per request, and the draft tokens accepted over all of them."""
    for rid, prompt, sampling, spec in reqs:
        engine.add(rid, prompt, sampling, spec)
    out, accepted = {rid: [] for rid, *_ in reqs}, 0
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            accepted += o.stats.accepted_tokens if o.finished else 0
    return out, accepted


def test_hybrid_greedy_is_lossless_and_keeps_the_pools_whole() -> None:
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(0, 64, (5,), generator=g).tolist()
    prompts = [motif * 4 + torch.randint(0, 64, (3,), generator=g).tolist() for _ in range(3)]
    prompts.append(torch.randint(0, 64, (12,), generator=g).tolist())
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reqs = lambda spec: [(str(i), p, greedy, spec) for i, p in enumerate(prompts)]  # noqa: E731
    off = run_all(_engine(), reqs(SpeculationParams(enabled=False)))
    hybrid, model_only = _engine(), _engine()
    on, hybrid_accepted = _run(hybrid, reqs(SpeculationParams(drafter="hybrid", tree=(2, 1, 1))))
    plain, model_accepted = _run(model_only, reqs(SpeculationParams(drafter="draft", tree=(2, 1, 1))))
    assert on == off and plain == off
    assert hybrid_accepted > model_accepted  # the lookup finds the repeats the noisy draft misses
    for e in (hybrid, model_only):
        assert e.cache.pool.num_free == e.cache.pool.num_blocks
        d = e.drafters["draft"]
        assert d.cache.pool.num_free == d.cache.pool.num_blocks and not d._tables


def test_sampled_requests_keep_the_model_tree() -> None:
    eng = _engine()
    prompt = [3, 4, 5, 6] * 5
    s = SamplingParams(temperature=0.8, seed=1, max_tokens=16, ignore_eos=True)
    out = run_all(eng, [("a", prompt, s, SpeculationParams(drafter="hybrid", tree=(2, 1, 1)))])
    ref = run_all(_engine(), [("a", prompt, s, SpeculationParams(drafter="draft", tree=(2, 1, 1)))])
    assert out == ref  # no grafts: the same trees, the same draws


def test_lookup_first_drafts_full_depth_matches_alone_and_stays_lossless() -> None:
    """Repetitive prompts: the lookup finds full-depth chains, so most requests skip the model; steps where
    every request did run no draft forward at all. The output is the target's, the pools end whole, and the
    model's lagging cache still drafts correctly when it runs again (the mixed prompt)."""
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(0, 64, (4,), generator=g).tolist()
    prompts = [motif * 6 for _ in range(2)] + [torch.randint(0, 64, (10,), generator=g).tolist() + motif * 3]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reqs = lambda spec: [(str(i), p, greedy, spec) for i, p in enumerate(prompts)]  # noqa: E731
    off = run_all(_engine(), reqs(SpeculationParams(enabled=False)))
    eng = _engine()
    lf = eng.drafters["lookup-first"] = HybridDrafter("lookup-first", eng.drafters["draft"], lookup_first=True)
    model = eng.drafters["draft"].model
    forwards = []
    forward = model.forward
    model.forward = lambda *a, **k: (forwards.append(1), forward(*a, **k))[1]
    for rid, prompt, sampling, spec in reqs(SpeculationParams(drafter="lookup-first", tree=(2, 1, 1))):
        eng.add(rid, prompt, sampling, spec)
    on, accepted, model_free = {str(i): [] for i in range(len(prompts))}, 0, 0
    while eng.has_work():
        before = len(forwards)
        outs = eng.step()
        model_free += len(forwards) == before and all(not o.finished for o in outs) and len(outs) > 0
        for o in outs:
            on[o.request_id] += o.new_token_ids
            accepted += o.stats.accepted_tokens if o.finished else 0
    assert on == off
    assert lf.lookup_only > 0 and accepted > 0
    assert model_free > 0  # decode steps where every request drafted by lookup: no draft forward at all
    assert eng.cache.pool.num_free == eng.cache.pool.num_blocks
    d = eng.drafters["draft"]
    assert d.cache.pool.num_free == d.cache.pool.num_blocks and not d._tables
