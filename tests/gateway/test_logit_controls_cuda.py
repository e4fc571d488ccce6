"""Logprobs, prompt logprobs and structured output on CUDA with graphs: the figures and the constrained output
that eager steps give, speculative or not."""

from __future__ import annotations

import json

import pytest
import torch

from draft.params import SpeculationParams
from engine_util import random_weights, run_all, self_draft_engine, tiny_config
from gateway.engine import Engine
from target.model import Transformer
from tiny_tokenizer import make_tokenizer
from verify.grammar import compile_grammar
from verify.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CFG = dict(vocab=512, layers=3, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 999}, "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def target() -> Transformer:
    cfg = tiny_config(**CFG)
    return Transformer.from_weights(cfg, random_weights(cfg, scale=0.3), torch.float32, "cuda").quantize(64)


def engine(target: Transformer, graphs: bool) -> Engine:
    return self_draft_engine(target, cuda_graphs=graphs, tokenizer=make_tokenizer())


def collect(eng: Engine, reqs) -> dict[str, tuple[list[int], list, list]]:
    """(tokens, logprobs, prompt logprobs) per request."""
    out = {rid: ([], [], []) for rid, *_ in reqs}
    for rid, prompt, sampling, spec in reqs:
        eng.add(rid, prompt, sampling, spec)
    while eng.has_work():
        for o in eng.step():
            assert o.error is None, o.error
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(o.logprobs or [])
            out[o.request_id][2].extend(o.prompt_logprobs or [])
    return out


def test_logprobs_and_prompt_logprobs_with_graphs_match_eager(target) -> None:
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (6 + 9 * i,), generator=g).tolist() for i in range(4)]
    s = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    reqs = lambda spec: [(str(i), p, s, SpeculationParams(enabled=spec)) for i, p in enumerate(prompts)]  # noqa: E731
    eager = collect(engine(target, False), reqs(False))
    for spec in (False, True):
        eng = engine(target, True)
        got = collect(eng, reqs(spec))
        assert eng.graphs.replays > 0
        for rid, (tokens, lps, plps) in eager.items():
            assert got[rid][0] == tokens
            assert [e.token_id for e in got[rid][2]] == prompts[int(rid)][1:]
            # TF32 matmuls in the graphs (tests/target/test_graphs_cuda.py): figures agree to ~1e-3
            torch.testing.assert_close(torch.tensor([e.logprob for e in got[rid][1]]),
                                       torch.tensor([e.logprob for e in lps]), rtol=5e-3, atol=5e-3)
            torch.testing.assert_close(torch.tensor([e.logprob for e in got[rid][2]]),
                                       torch.tensor([e.logprob for e in plps]), rtol=5e-3, atol=5e-3)


def test_structured_output_with_graphs_and_speculation(target) -> None:
    pytest.importorskip("llguidance", reason="structured output needs llguidance (carry its wheel to the GPU)")
    tok = make_tokenizer()
    s = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, grammar=compile_grammar("json", SCHEMA))
    prompts = [[5, 9, 2, 5, 9, 2], [40, 41, 7], [3]]
    reqs = lambda spec: [(str(i), p, s, SpeculationParams(enabled=spec)) for i, p in enumerate(prompts)]  # noqa: E731
    eager = run_all(engine(target, False), reqs(False))
    for spec in (False, True):
        eng = engine(target, True)
        assert run_all(eng, reqs(spec)) == eager
        assert eng.cache.pool.num_free == eng.cache.pool.num_blocks
    for tokens in eager.values():
        doc = json.loads(tok.decode(tokens, skip_special_tokens=True))
        assert set(doc) == {"a", "b"} and isinstance(doc["b"], bool)


def test_sampled_structured_output_with_the_device_tree_loop(target) -> None:
    """Sampled constrained requests: forced chains ask the drafter's device loop for no levels some steps
    (a root-only proposal), and every output still parses."""
    pytest.importorskip("llguidance", reason="structured output needs llguidance (carry its wheel to the GPU)")
    tok = make_tokenizer()
    s = SamplingParams(temperature=0.9, seed=5, max_tokens=30, ignore_eos=True, grammar=compile_grammar("json", SCHEMA))
    eng = engine(target, True)
    got = run_all(eng, [(str(i), p, s, SpeculationParams()) for i, p in enumerate([[5, 9, 2], [40, 41, 7], [3]])])
    for tokens in got.values():
        assert set(json.loads(tok.decode(tokens, skip_special_tokens=True))) == {"a", "b"}
    assert eng.cache.pool.num_free == eng.cache.pool.num_blocks


def test_min_tokens_on_cuda_with_deferred_trees(target) -> None:
    """A stop token held back by min_tokens at CUDA's default (graphs, greedy trees deferred on the device):
    the output of plain decoding under the same mask, and no stop token before min_tokens."""
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 512, (7 + 5 * i,), generator=g).tolist() for i in range(3)]
    free = collect(engine(target, True), [(str(i), p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                           SpeculationParams(enabled=False)) for i, p in enumerate(prompts)])
    stop = free["0"][0][1]  # the first prompt's output would end at its second token
    s = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop,), min_tokens=8)
    runs = {spec: collect(engine(target, True), [(str(i), p, s, SpeculationParams(enabled=spec))
                                                 for i, p in enumerate(prompts)]) for spec in (False, True)}
    for i in range(len(prompts)):
        assert runs[True][str(i)][0] == runs[False][str(i)][0]
        assert stop not in runs[False][str(i)][0][:8]
