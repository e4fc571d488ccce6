"""Batch-invariant mode in the engine (EngineConfig.batch_invariant, kernels/invariant.py): the mode set and
reported, a sharded target refused by name, and on CUDA greedy output with speculation (chains and trees) token
for token plain decoding's, and every output the same alone or in a batch."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from draft.hybrid import HybridDrafter
from draft.model_drafter import ModelDrafter
from draft.ngram import NgramDrafter
from draft.params import SpeculationParams
from engine_util import random_weights, run_all, tiny_config, tiny_engine, tiny_target
from gateway.budget import BudgetConfig
from gateway.cli import engine_config, serve_options
from gateway.engine import Engine, EngineConfig
from gateway.scheduler import SchedulerConfig
from gateway_util import MODEL, make_tokenizer, run_app
from kernels import dispatch, invariant
from target.model import Transformer
from verify.sampling import SamplingParams

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def restore_mode():
    """The mode is the process's: put back what the test found."""
    was = invariant.enabled()
    yield
    invariant.set_enabled(was)


def _engine(target: Transformer, batch_invariant: bool | None, default: str | None = "ngram",
            tree: tuple[int, ...] = (2, 2, 1), num_blocks: int = 128, **cfg) -> Engine:
    drafters = {"ngram": NgramDrafter(), "self": ModelDrafter("self", target.truncated(2), num_blocks, 16)}
    drafters["hybrid"] = HybridDrafter("hybrid", drafters["self"])
    # acceptance alone steers the trees (cost_aware off): the drafting then repeats from run to run
    sched = SchedulerConfig(max_model_len=512, budget=BudgetConfig(cost_aware=False, gate=False))
    return Engine(target, drafters, EngineConfig(num_blocks, 16, sched, default, tree,
                                                 batch_invariant=batch_invariant, **cfg))


def test_the_mode_is_reported_and_set_for_the_process():
    target = tiny_target()
    eng = _engine(target, True)
    assert eng.batch_invariant and eng.config.batch_invariant and invariant.enabled()
    assert eng.config.default_tree == (2, 2, 1)  # trees stay trees: branch nodes are computed over their paths
    off = _engine(target, False)
    assert not off.batch_invariant and off.config.batch_invariant is False and not invariant.enabled()


def test_the_mode_refuses_a_sharded_target_by_name():
    class Sharded:  # anything but a one-process Transformer (a tensor-parallel target)
        pass

    with pytest.raises(ValueError, match="needs a one-process target"):
        Engine(Sharded(), {}, EngineConfig(batch_invariant=True))


def test_the_mode_keeps_a_run_step_for_step_on_the_cpu():
    """On the CPU the kernels' float32 reference paths run (the mode sets what CUDA launches): greedy speculation
    equals plain decoding with every drafter, and no block stays taken."""
    target = tiny_target()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (4 + i,), generator=g).tolist() for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def run(spec: SpeculationParams) -> dict[str, list[int]]:
        eng = _engine(target, True)
        out = run_all(eng, [(str(i), p, greedy, spec) for i, p in enumerate(prompts)])
        assert eng.cache.pool.num_free == 128 and not eng.has_work()
        return out

    plain = run(SpeculationParams(enabled=False))
    assert run(SpeculationParams()) == plain  # n-gram trees (2, 2, 1)
    assert run(SpeculationParams(drafter="self", tree=(2, 2, 1))) == plain
    assert run(SpeculationParams(drafter="hybrid", tree=(1, 1, 1))) == plain  # a chain with a grafted branch


def test_the_api_reports_the_mode_and_serves_trees():
    tokenizer = make_tokenizer()  # not the fixture: the GPU stage runs these tests without conftest
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 4}

    async def go(client, app):
        tree = await client.post("/v1/chat/completions", json=chat | {"speculation": {"tree": [2, 1]}})
        return tree, await client.get("/v1/models")

    tree, models = run_app(tokenizer, go, engine=tiny_engine(vocab=len(tokenizer), num_blocks=128, batch_invariant=True))
    assert tree.status_code == 200 and tree.json()["usage"]["completion_tokens"] == 4
    assert models.json()["data"][0]["speculation"]["batch_invariant"] is True


@pytest.fixture
def interpreted():
    """Every kernel of a forward through its Triton code, which the interpreter runs on the CPU (kernels/dispatch.py)."""
    was = dispatch.FORCE_TRITON
    dispatch.FORCE_TRITON = True
    yield
    dispatch.FORCE_TRITON = was


def _check_invariance(target: Transformer) -> None:
    """Greedy speculation through n-gram, model and grafted trees emits plain decoding's tokens and logprobs (bits
    that every kernel's rounding reaches: the tokens alone rarely flip on a model this small), a prompt alone emits
    what it does in a batch of three, and so does seeded sampling through a fixed tree."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (3 + 4 * i,), generator=g).tolist() for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)

    def run(spec: SpeculationParams, only: int | None = None, sampling: SamplingParams = greedy) -> dict[str, list]:
        eng = _engine(target, True, num_blocks=64)
        out: dict[str, list] = {}
        for i, p in enumerate(prompts):
            if only is None or i == only:
                eng.add(str(i), p, replace(sampling, seed=i) if sampling.seed is not None else sampling, spec)
                out[str(i)] = []
        while eng.has_work():
            for o in eng.step():
                assert o.error is None, o.error
                out[o.request_id] += list(o.logprobs or ())
        assert eng.cache.pool.num_free == 64
        return out

    plain = run(SpeculationParams(enabled=False))
    assert run(SpeculationParams()) == plain  # n-gram trees (2, 2, 1)
    assert run(SpeculationParams(drafter="self", tree=(2, 1))) == plain
    assert run(SpeculationParams(drafter="hybrid", tree=(1, 1))) == plain
    assert run(SpeculationParams(enabled=False), only=2) == {"2": plain["2"]}
    sampled, tree = replace(greedy, temperature=0.9, seed=0), SpeculationParams(drafter="self", tree=(2, 1))
    assert run(tree, only=1, sampling=sampled) == {"1": run(tree, sampling=sampled)["1"]}


def _small_target(dtype: torch.dtype) -> Transformer:
    cfg = tiny_config(vocab=96, layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                      head_dim=16)
    return Transformer.from_weights(cfg, random_weights(cfg, scale=0.1), dtype, "cpu").quantize(32)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="runs the GPU's kernels under Triton's interpreter (the CUDA tests run them compiled)")
def test_interpreted_kernels_keep_speculation_and_batches_invariant(interpreted):
    """The engine on the kernels the GPU runs (INT4 MMA, dense matmul, tree attention with its branch rows, RMSNorm,
    RoPE, compaction), interpreted, in float16 (with the mode off the logprobs differ)."""
    _check_invariance(_small_target(torch.float16))


def test_the_cpu_paths_keep_speculation_and_batches_invariant():
    """The CPU's own paths in float32 (its projections, and attention through invariant_attention_ref). With the
    mode off, on this project's CPU, the batched attention gave the self-draft tree's rows other last bits than
    plain decoding's (not asserted: that is an accident of the rounding, not a property)."""
    _check_invariance(_small_target(torch.float32))


def test_the_flag_reaches_the_engine_config():
    assert engine_config(serve_options().parse_args(["--batch-invariant"])).batch_invariant is True
    assert engine_config(serve_options().parse_args(["--no-batch-invariant"])).batch_invariant is False
    assert engine_config(serve_options().parse_args([])).batch_invariant is None


# ------------------------------------------------------------------------------------------------------
# CUDA: the kernels' fixed configurations
# ------------------------------------------------------------------------------------------------------

CUDA_CFG = dict(vocab=512, layers=3, hidden_size=256, intermediate_size=512, num_heads=6, num_kv_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def bf16_target() -> Transformer:
    cfg = tiny_config(**CUDA_CFG)
    # flat logits (small weights): many near-ties, where kernels that round by M flip greedy picks
    return Transformer.from_weights(cfg, random_weights(cfg, scale=0.08), torch.bfloat16, "cuda").quantize(64)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_cuda_greedy_speculation_equals_plain_decoding_token_for_token(bf16_target: Transformer, graphs: bool):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (5 + 7 * i,), generator=g).tolist() for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)

    def run(spec: SpeculationParams, only: int | None = None) -> dict[str, list[int]]:
        eng = _engine(bf16_target, True, num_blocks=256, cuda_graphs=graphs)
        reqs = [(str(i), p, greedy, spec) for i, p in enumerate(prompts) if only is None or i == only]
        out = run_all(eng, reqs)
        assert eng.cache.pool.num_free == 256 and not eng.has_work()
        return out

    plain = run(SpeculationParams(enabled=False))
    assert run(SpeculationParams(tree=(1, 1, 1, 1))) == plain  # n-gram chains
    assert run(SpeculationParams(drafter="self", tree=(1, 1, 1))) == plain  # a model's chains
    assert run(SpeculationParams(drafter="self", tree=(3, 2, 2))) == plain  # a model's trees: branch nodes
    assert run(SpeculationParams(drafter="hybrid", tree=(2, 1, 1))) == plain  # a tree with a grafted chain
    assert run(SpeculationParams(enabled=False), only=4) == {"4": plain["4"]}  # alone, not in a batch of six


@requires_cuda
@pytest.mark.gpu
def test_cuda_seeded_sampling_repeats_alone_and_in_a_batch(bf16_target: Transformer):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (6 + 5 * i,), generator=g).tolist() for i in range(5)]

    def run(only: int | None = None) -> dict[str, list[int]]:
        eng = _engine(bf16_target, True, num_blocks=256)
        return run_all(eng, [(str(i), p, SamplingParams(temperature=0.9, seed=i, max_tokens=32, ignore_eos=True),
                              SpeculationParams(enabled=False)) for i, p in enumerate(prompts)
                             if only is None or i == only])

    batched = run()
    assert all(run(only=i) == {str(i): batched[str(i)]} for i in (0, 3))
