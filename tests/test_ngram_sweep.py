"""bench/ngram_sweep.py's simulation against the engine: greedy speculation with a fixed n-gram tree emits
plain decoding's text, so replaying the drafter over that text must give the engine's own step counts."""

import sys
from pathlib import Path

import pytest

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
