"""bench/ngram_sweep.py's simulation against the engine: greedy speculation with a fixed n-gram tree emits
plain decoding's text, so replaying the drafter over that text must give the engine's own step counts."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from draft.params import SpeculationParams  # noqa: E402
from engine_util import run_all, tiny_engine  # noqa: E402
from ngram_sweep import accepted_path, simulate  # noqa: E402
from verify.sampling import SamplingParams  # noqa: E402


def test_accepted_path_follows_the_text_down_the_deepest_matching_branch():
    # root 0; branches 5-6-7 and 5-8, and 9
    tokens, parents = [0, 5, 6, 7, 8, 9], [-1, 0, 1, 2, 1, 0]
    assert accepted_path(tokens, parents, [5, 6, 7]) == 3
    assert accepted_path(tokens, parents, [5, 8, 1]) == 2
    assert accepted_path(tokens, parents, [9, 9]) == 1
    assert accepted_path(tokens, parents, [4]) == 0
    assert accepted_path(tokens, parents, []) == 0


@pytest.mark.parametrize("tree", [(1, 1, 1), (2, 2, 1)])
def test_simulation_matches_the_engine(tree):
    # prompts that repeat themselves, so lookups find continuations the target sometimes confirms
    prompts = [[(3 * i + j % 7) % 50 + 1 for j in range(24)] for i in range(4)]
    sampling = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine = tiny_engine(max_running=4)
    reqs = [(str(i), p, sampling, SpeculationParams(drafter="ngram", tree=tree)) for i, p in enumerate(prompts)]
    stats = {}  # each request's figures as it finishes (the engine then drops the sequence)
    engine_steps = engine_tokens = 0
    orig = engine._finish

    def finish(seq, reason, error=None):
        stats[seq.request_id] = seq.stats.copy()
        return orig(seq, reason, error)

    engine._finish = finish
    out = run_all(engine, reqs)
    for s in stats.values():
        engine_steps += s.steps
        engine_tokens += s.accepted_tokens + s.steps
    texts = [(p + out[str(i)], len(p)) for i, p in enumerate(prompts)]
    sim = simulate(texts, 3, 1, 4096, tree)
    assert sim["tokens"] == sum(len(o) for o in out.values()) == engine_tokens
    assert sim["steps"] == engine_steps
    assert sim["steps"] < sim["tokens"]  # some drafts were kept: the comparison is not vacuous


def test_adaptive_replay_matches_the_engine_for_one_request():
    # One request (the replay's model), the budget's acceptance rule and probes, no step prices. The target follows
    # a rule the lookups can learn (next = 7 t + 1 mod V) but breaks it at every 6th position, so drafts are kept
    # and rejected by turns and the rule raises and cuts the tree.
    V = 64

    def rule(batch, cache):
        at = batch.logits_indices
        pos, tok = batch.positions[at], batch.tokens[at]
        nxt = torch.where(pos % 6 == 5, (tok + 3) % V, (tok * 7 + 1) % V)
        out = torch.zeros(at.shape[0], V)
        out[torch.arange(at.shape[0]), nxt] = 5.0
        return out

    engine = tiny_engine(max_running=1, tree=(2, 2, 1), vocab=V)
    engine.target.forward = rule
    prompt = [1]
    for _ in range(40):
        prompt.append((prompt[-1] * 7 + 1) % V)
    stats = {}
    orig = engine._finish

    def finish(seq, reason, error=None):
        stats[seq.request_id] = seq.stats.copy()
        return orig(seq, reason, error)

    engine._finish = finish
    sampling = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    out = run_all(engine, [("a", prompt, sampling, SpeculationParams(drafter="ngram"))])
    text = [(prompt + out["a"], len(prompt))]
    sim = simulate(text, 3, 1, 4096, (2, 2, 1), adaptive=True)
    assert sim["steps"] == stats["a"].steps and sim["tokens"] == len(out["a"])
    assert sim["drafted"] == stats["a"].drafted_tokens
    whole = simulate(text, 3, 1, 4096, (2, 2, 1))
    assert sim["steps"] < sim["tokens"] and sim["drafted"] < whole["drafted"]  # kept some drafts, cut some trees
