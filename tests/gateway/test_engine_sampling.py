"""Sampling through the whole engine (drafter, tree, logit processing, verifier, commit) follows the target's
distribution.

The exact joint distribution of the first two tokens is computed from the target alone; thousands of
seeded speculative runs on a tiny-vocabulary model are compared with it by a chi-square test."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from draft.params import SpeculationParams
from engine_util import tiny_engine
from target.batch import Segment, build_batch
from verify import processing
from verify.sampling import SamplingParams, apply_penalties, process_logits

PROMPT = [3, 1, 4, 1, 5]
V = 8


def next_probs(engine, ids: list[int], params: SamplingParams) -> torch.Tensor:
    """The target's processed distribution after ``ids``: bias and penalties (counting what follows PROMPT as
    generated, PROMPT as the prompt), then temperature, top-k, top-p."""
    model = engine.target
    cache = model.new_cache(8, 4)
    logits = model.forward(build_batch([Segment(cache.new_table(), 0, ids)], cache, "cpu"), cache)
    prompt = torch.zeros(V, dtype=torch.bool)
    prompt[PROMPT] = True
    counts = torch.bincount(torch.tensor(ids[len(PROMPT):], dtype=torch.int64), minlength=V)
    return process_logits(apply_penalties(logits, params, prompt, counts), params)[0]


def exact_joint(engine, params: SamplingParams) -> dict[tuple[int, int], float]:
    p1 = next_probs(engine, PROMPT, params)
    joint = {}
    for a in range(V):
        if p1[a] > 0:
            p2 = next_probs(engine, PROMPT + [a], params)
            for b in range(V):
                joint[(a, b)] = float(p1[a] * p2[b])
    return joint


def chi2_critical(dof: int, z: float = 4.26) -> float:
    """Wilson-Hilferty upper quantile; z=4.26 is a 1e-5 tail, so a correct engine fails ~never."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def sample_pairs(engine, params: SamplingParams, spec: SpeculationParams, n: int) -> Counter:
    counts: Counter = Counter()
    for start in range(0, n, 64):
        outs: dict[str, list[int]] = {}
        for i in range(start, min(start + 64, n)):
            engine.add(str(i), PROMPT, SamplingParams(**{**_fields(params), "seed": i}), spec)
            outs[str(i)] = []
        while engine.has_work():
            for o in engine.step():
                outs[o.request_id] += o.new_token_ids
        counts.update(tuple(t[:2]) for t in outs.values())
    return counts


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__slots__}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True),
    SamplingParams(temperature=0.7, top_p=0.8, top_k=5, max_tokens=2, ignore_eos=True),
    # processed in the step's batched pass (verify/processing.py), then verified in the batched groups
    SamplingParams(temperature=0.9, repetition_penalty=1.6, frequency_penalty=0.7, presence_penalty=0.4,
                   logit_bias={2: 1.5, 6: -2.0}, min_p=0.02, max_tokens=2, ignore_eos=True),
], ids=["t1", "topp-topk", "penalties-bias-minp"])
@pytest.mark.parametrize("drafter,tree", [("draft", (2, 1)), ("ngram", (2, 1)), ("self", (3,)), ("cut", (2, 1))])
def test_speculative_sampling_matches_target_joint(monkeypatch, params, drafter, tree) -> None:
    """'cut' drafts over tokens 0, 2, 3, 5, 6 only (a cut head): its q is zero on the rest, which the
    verifier's residual must still give their full probability. Penalties and bias take the batched
    processing pass here (CUDA's path); the per-sequence one has its chi-square in tests/verify."""
    monkeypatch.setattr(processing, "BATCHED_CPU", True)
    torch.set_num_threads(1)
    engine = tiny_engine(vocab=V, num_blocks=256, max_running=64, draft_noise=0.5, cut_vocab=[0, 2, 3, 5, 6])
    n = 3000
    counts = sample_pairs(engine, params, SpeculationParams(drafter=drafter, tree=tree), n)
    joint = exact_joint(engine, params)
    assert all(joint.get(k, 0.0) > 0 for k in counts), "sampled a pair the target gives zero probability"
    # merge cells with small expectation into one bucket, as the chi-square approximation needs
    big = {k: p for k, p in joint.items() if p * n >= 5}
    stat, small_obs, small_exp = 0.0, n, n
    for k, p in big.items():
        stat += (counts[k] - n * p) ** 2 / (n * p)
        small_obs -= counts[k]
        small_exp -= n * p
    if small_exp >= 5:
        stat += (small_obs - small_exp) ** 2 / small_exp
    dof = len(big) - (0 if small_exp >= 5 else 1)
    assert stat < chi2_critical(dof), f"chi2 {stat:.1f} over {dof} dof"
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks
