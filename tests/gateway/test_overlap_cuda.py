"""Overlapped plain decoding on CUDA with graphs (gateway/overlap.py): the picks' host copy waits on its own
event while the next step runs; the tokens are those of step-by-step decoding, greedy and seeded, plain and
speculating, with no block left behind."""

from __future__ import annotations

import pytest
import torch

from draft.model_drafter import ModelDrafter
from draft.ngram import NgramDrafter
from draft.params import SpeculationParams
from engine_util import random_weights, run_all, tiny_config
from gateway.budget import BudgetConfig
from gateway.engine import Engine, EngineConfig
from gateway.scheduler import SchedulerConfig
from target.model import Transformer
from verify.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CFG = dict(vocab=512, layers=3, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def target() -> Transformer:
    cfg = tiny_config(**CFG)
    return Transformer.from_weights(cfg, random_weights(cfg, scale=0.3), torch.float32, "cuda").quantize(64)


def engine(target: Transformer, overlap: bool) -> Engine:
    drafters = {"self": ModelDrafter("self", target.truncated(2), 256, 16), "ngram": NgramDrafter()}
    # cost_aware off: drafting then follows acceptance alone, the same in both runs, so every step has the
    # same rows in both and the kernels round alike
    sched = SchedulerConfig(max_model_len=512, budget=BudgetConfig(cost_aware=False))
    return Engine(target, drafters, EngineConfig(256, 16, sched, "ngram", (2, 2, 1), overlap=overlap))


@pytest.mark.parametrize("spec", [SpeculationParams(enabled=False), SpeculationParams()], ids=["plain", "ngram"])
def test_overlapped_tokens_match_step_by_step_on_cuda(target: Transformer, spec: SpeculationParams) -> None:
    g = torch.Generator().manual_seed(0)
    # Speculating requests are greedy: speculation keeps greedy output whatever it drafts, and seeded sampling
    # repeats only where the drafting decisions do.
    reqs = [(str(i), torch.randint(0, 512, (5 + 3 * i,), generator=g).tolist(),
             SamplingParams(temperature=0 if i % 2 or spec.enabled else 0.8, seed=i, max_tokens=40, ignore_eos=True,
                            logprobs=2 if i == 3 else None, repetition_penalty=1.3 if i == 5 else 1.0), spec)
            for i in range(6)]
    want = run_all(engine(target, False), reqs)
    on = engine(target, True)
    got = run_all(on, reqs)
    assert got == want
    assert on.num_ahead > 0 and on.cache.pool.num_free == 256 and not on.has_work()


def test_a_cuda_target_overlaps_by_default(target: Transformer) -> None:
    eng = Engine(target, {}, EngineConfig(64, 16, SchedulerConfig(max_model_len=512)))
    assert eng.config.overlap is None and eng.overlaps
    g = torch.Generator().manual_seed(1)
    reqs = [(str(i), torch.randint(0, 512, (6,), generator=g).tolist(),
             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), SpeculationParams(enabled=False))
            for i in range(3)]
    run_all(eng, reqs)
    assert eng.num_ahead > 0 and eng.cache.pool.num_free == 64
