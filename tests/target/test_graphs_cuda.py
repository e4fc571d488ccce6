"""target/graphs.py: replayed CUDA graphs give the eager forward's logits for decode and tree steps, padded
batches included, and the engine's greedy output is the same with graphs on and off."""

from __future__ import annotations

import pytest
import torch

from draft.params import SpeculationParams
from draft.tree import TokenTree
from engine_util import random_weights, run_all, self_draft_engine, tiny_config
from gateway.engine import Engine, EngineConfig
from gateway.scheduler import SchedulerConfig
from target.batch import Segment, build_batch
from target.graphs import CudaGraphRunner
from target.model import Transformer
from verify.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CFG = dict(vocab=512, layers=3, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64)


def _model() -> Transformer:
    cfg = tiny_config(**CFG)
    return Transformer.from_weights(cfg, random_weights(cfg, scale=0.05), torch.float32, "cuda").quantize(64)


@pytest.mark.parametrize("nodes", [1, 6])
@pytest.mark.parametrize("batch", [1, 3, 5])
def test_graph_matches_eager(nodes: int, batch: int) -> None:
    model = _model()
    cache = model.new_cache(64, 16)
    runner = CudaGraphRunner(model, cache, max_blocks=8, buckets=(1, 4, 8))
    g = torch.Generator().manual_seed(batch * 10 + nodes)
    ids = lambda n: torch.randint(0, 512, (n,), generator=g).tolist()  # noqa: E731
    tables = [cache.new_table() for _ in range(batch)]
    for i, t in enumerate(tables):  # different context lengths, one across a block boundary
        model.forward(build_batch([Segment(t, 0, ids(10 + 7 * i), logits="none")], cache, "cuda"), cache)
    tree = TokenTree.from_lists(ids(nodes), [-1, 0, 0, 1, 1, 2][:nodes])
    for step in range(2):  # the second step replays the graph captured by the first
        segs = [Segment(t, 10 + 7 * i + step * nodes, tree.tokens.tolist(),
                        positions=(10 + 7 * i + step * nodes + tree.depths).tolist(),
                        mask_bits=tree.ancestor_bits().tolist() if nodes > 1 else None, logits="all")
                for i, t in enumerate(tables)]
        b = build_batch(segs, cache, "cuda")
        k_before = cache.k.clone()
        graphed = runner.forward(b, cache).clone()
        k_graphed = cache.k.clone()
        cache.k.copy_(k_before)
        eager = model.forward(b, cache)
        assert graphed.shape == eager.shape == (batch * nodes, 512)
        # The graph runs the INT4 matmuls at the padded M (a different tile config, and Triton's tl.dot
        # takes fp32 operands as TF32), so the fp32 logits agree to TF32 accuracy, not bit for bit.
        torch.testing.assert_close(graphed, eager, rtol=2e-3, atol=2e-3)
        assert (graphed.argmax(-1) == eager.argmax(-1)).float().mean() >= 0.9
        # the real rows' K/V writes agree (to TF32 accuracy: the qkv matmul ran at the padded M, another
        # tile config; an H200 run saw 3.5e-4 at batch 5); the padded rows touched only the scratch block
        torch.testing.assert_close(k_graphed[:, : cache.scratch_block], cache.k[:, : cache.scratch_block],
                                   rtol=2e-3, atol=2e-3)
    assert runner.replays == 2 and runner.num_graphs == 1


def test_ragged_step_pads_into_a_graph_and_long_segments_run_eagerly() -> None:
    """Segments of 3 (causal, last logits), 1, and a 5-node tree (all logits): 9 rows, replayed ragged in a
    graph of 16 rows for 4 segments (its fourth holds the padding); a 70-token prefill is past max_nodes and
    runs eagerly."""
    model = _model()
    cache = model.new_cache(64, 16)
    runner = CudaGraphRunner(model, cache, max_blocks=8)
    tables = [cache.new_table() for _ in range(3)]
    for i, t in enumerate(tables):
        model.forward(build_batch([Segment(t, 0, list(range(5 + 9 * i)), logits="none")], cache, "cuda"), cache)
    tree = TokenTree.from_lists([4, 5, 6, 7, 8], [-1, 0, 0, 1, 2])
    segs = [Segment(tables[0], 5, [1, 2, 3], logits="last"), Segment(tables[1], 14, [9], logits="all"),
            Segment(tables[2], 23, tree.tokens.tolist(), positions=(23 + tree.depths).tolist(),
                    mask_bits=tree.ancestor_bits().tolist(), logits="all")]
    b = build_batch(segs, cache, "cuda")
    k_before = cache.k.clone()
    graphed = runner.forward(b, cache).clone()
    cache.k.copy_(k_before)
    eager = model.forward(b, cache)
    assert graphed.shape == eager.shape == (7, 512) and runner.replays == 1
    assert set(runner._graphs) == {(4, 16, False)}
    torch.testing.assert_close(graphed, eager, rtol=2e-3, atol=2e-3)
    long = build_batch([Segment(cache.new_table(), 0, list(range(70)), logits="last")], cache, "cuda")
    assert runner.forward(long, cache).shape == (1, 512) and runner.eager == 1


def test_engine_greedy_output_same_with_and_without_graphs(monkeypatch) -> None:
    from kernels import int4_matmul_triton as T

    monkeypatch.setattr(T, "FIX_ATOMIC", False)  # bit equality needs split-K sums in a fixed order
    cfg = tiny_config(**CFG)
    target = Transformer.from_weights(cfg, random_weights(cfg, scale=0.3), torch.float32, "cuda").quantize(64)

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (5 + i,), generator=g).tolist() for i in range(6)]
    s = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reqs = lambda spec: [(str(i), p, s, SpeculationParams(enabled=spec)) for i, p in enumerate(prompts)]  # noqa: E731
    eager = run_all(self_draft_engine(target, cuda_graphs=False), reqs(False))
    for spec in (False, True):
        eng = self_draft_engine(target)
        assert run_all(eng, reqs(spec)) == eager
        assert eng.graphs is not None and eng.graphs.replays > 0
        assert eng.cache.pool.num_free == eng.cache.pool.num_blocks


def test_engine_with_atomic_split_k_sums(monkeypatch) -> None:
    """SPECGATE_INT4_FIX_ATOMIC (split-K partials added into one shared fp32 buffer by atomics, in arrival order)
    inside the engine: graphs captured and replayed over the shared sums, speculation off and on, bf16. The
    tuner is off, so every projection takes its untuned default, which splits K (the M = 1 GEMV four ways
    here). Against the serial fix-up: the same greedy output but where a near-tie flips (fp32 sums in another
    order move the bf16 logits in their last bit), no block lost, and the sums left zeroed after every launch."""
    from kernels import int4_matmul_triton as T

    monkeypatch.setattr(T, "_autotune", False)
    monkeypatch.setattr(T, "_SUMS", {})
    cfg = tiny_config(**CFG)
    target = Transformer.from_weights(cfg, random_weights(cfg, scale=0.3), torch.bfloat16, "cuda").quantize(64)

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (5 + i,), generator=g).tolist() for i in range(8)]
    s = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for atomic in (False, True):
        monkeypatch.setattr(T, "FIX_ATOMIC", atomic)
        for spec in (False, True):
            eng = self_draft_engine(target)
            outs[atomic, spec] = run_all(eng, [(str(i), p, s, SpeculationParams(enabled=spec))
                                               for i, p in enumerate(prompts)])
            assert eng.graphs is not None and eng.graphs.replays > 0
            assert eng.cache.pool.num_free == eng.cache.pool.num_blocks
        assert bool(T._SUMS) == atomic  # the atomic arm used the shared sums; the serial one never made them
    torch.cuda.synchronize()
    assert not any(buf.any() for buf in T._SUMS.values())  # every launch left its rows zeroed
    for spec in (False, True):
        same = sum(outs[True, spec][k] == outs[False, spec][k] for k in outs[False, spec])
        assert same >= len(prompts) - 1, f"speculation {spec}: {same}/{len(prompts)} identical"


def test_capture_at_start_covers_the_steps_that_follow() -> None:
    cfg = tiny_config(**CFG)
    target = Transformer.from_weights(cfg, random_weights(cfg, scale=0.3), torch.float32, "cuda").quantize(64)
    from draft.model_drafter import ModelDrafter

    drafters = {"self": ModelDrafter("self", target.truncated(2), 256, 16, max_model_len=512)}
    sched = SchedulerConfig(max_model_len=512, max_running=4)
    eng = Engine(target, drafters, EngineConfig(256, 16, sched, "self", (2, 2, 1), capture_at_start=True))
    captured = eng.graphs.num_graphs
    import triton

    compiled: list[str] = []  # Triton kernels built from here on: none may be the KV compaction
    hook = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = lambda **kw: compiled.append(str(kw.get("repr", "?"))) or False
    # decode graphs for buckets 1, 2, 4; ragged ones for 1, 2, 4 and 8 (a spare segment past 4 sequences),
    # b * 2**k rows up to 64 / 16 nodes a segment (the target's / the drafter's catch-up)
    assert captured >= 3 + 4 * 7 and drafters["self"].graphs.num_graphs >= 3 + 4 * 5
    drafter = drafters["self"]
    held = (drafter.graphs.num_graphs, set(drafter.loop._graphs))
    g = torch.Generator().manual_seed(2)
    s = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # Prompts past the drafter's graphs (its prefill runs eagerly), speculation on and off, trees cut from
    # the default one, probes: every step replays a graph captured at start, or runs eagerly.
    specs = [SpeculationParams(), SpeculationParams(enabled=False), SpeculationParams(tree=(1,)),
             SpeculationParams(tree=(2, 1)), SpeculationParams(tree=(1, 1, 1))]
    try:
        run_all(eng, [(str(i), torch.randint(0, 512, (6 + 11 * i,), generator=g).tolist(), s, spec)
                      for i, spec in enumerate(specs)])
    finally:
        triton.knobs.runtime.jit_cache_hook = hook
    assert not [c for c in compiled if "compact_kv" in c], compiled  # built by capture_graphs, not mid-serving
    assert eng.graphs.num_graphs == captured and eng.graphs.replays > 0  # nothing captured on the way
    assert (drafter.graphs.num_graphs, set(drafter.loop._graphs)) == held and drafter.loop.replays > 0
