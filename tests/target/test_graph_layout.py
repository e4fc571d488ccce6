"""target/graphs.py on the CPU: which graph a step replays (``graph_shape``), and the ragged layout a graph's
static inputs take (``_Graph.load``), run through the eager forward: the batch's logits and K/V come out as
the batch's own forward gives them. (Capture and replay need CUDA: tests/target/test_graphs_cuda.py.)"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch

from draft.tree import TokenTree
from engine_util import random_weights, tiny_config
from target.batch import Segment, build_batch
from target.graphs import BATCH_BUCKETS, CudaGraphRunner, _Graph, graph_shape
from target.model import Transformer


def test_decode_steps_take_the_bucket_that_holds_them() -> None:
    assert graph_shape((1,) * 5, 5, BATCH_BUCKETS, 64, 1024) == (8, 8, True)
    assert graph_shape((1,) * 16, 16, BATCH_BUCKETS, 64, 1024) == (16, 16, True)
    assert graph_shape((1,) * 129, 129, BATCH_BUCKETS, 64, 1024) is None  # past the largest bucket


def test_ragged_steps_take_the_fewest_rows_with_a_segment_to_spare() -> None:
    # 16 sequences, one with a 4-node tree: 19 rows in a 24-segment graph of 24 rows (padded per segment: 64)
    assert graph_shape((4,) + (1,) * 15, 19, BATCH_BUCKETS, 64, 1024) == (24, 24, False)
    # rows that fit exactly need no spare segment
    assert graph_shape((2, 2, 2, 2), 8, BATCH_BUCKETS, 64, 1024) == (4, 8, False)
    # 3 segments of 9 rows: 4 segments hold them in 16 rows
    assert graph_shape((3, 1, 5), 9, BATCH_BUCKETS, 64, 1024) == (4, 16, False)
    # a full bucket with padding rows moves to the next bucket
    assert graph_shape((2,) + (1,) * 15, 17, BATCH_BUCKETS, 64, 1024) == (24, 24, False)
    # among buckets a capture narrowed to, the best that remains
    assert graph_shape((4,) + (1,) * 15, 19, (1, 2, 4, 8, 16), 64, 1024) is None
    assert graph_shape((4,) + (1,) * 6, 10, (1, 2, 4, 8, 16), 64, 1024) == (8, 16, False)


def test_long_segments_and_too_many_rows_run_eagerly() -> None:
    assert graph_shape((70,), 70, BATCH_BUCKETS, 64, 1024) is None  # a prefill chunk past max_nodes
    assert graph_shape((64,) * 20, 1280, BATCH_BUCKETS, 64, 1024) is None  # past max_tokens
    assert graph_shape((40, 2), 42, (1, 2), 64, 1024) is None  # 2 segments, no spare one: 64 rows, 2 x 32 max
    assert graph_shape((), 0, BATCH_BUCKETS, 64, 1024) is None


@pytest.mark.parametrize("with_features", [False, True])
def test_a_ragged_graph_batch_gives_the_batch_logits_and_kv(with_features: bool) -> None:
    """Segments of 3 (causal, last logits), 1, and a 5-node tree (all logits) loaded into a (4, 16) graph:
    one dummy segment of 7 padding rows. The eager forward of the graph's static batch gives the batch's
    logits rows and the batch's K/V writes; the padding wrote only the scratch block."""
    cfg = tiny_config(vocab=96, layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                      head_dim=16)
    model = Transformer.from_weights(cfg, random_weights(cfg, scale=0.1), torch.float32, "cpu")
    cache = model.new_cache(32, 4)
    tables = [cache.new_table() for _ in range(3)]
    for i, t in enumerate(tables):  # context lengths 5, 14, 23: across block boundaries
        model.forward(build_batch([Segment(t, 0, list(range(5 + 9 * i)), logits="none")], cache, "cpu"), cache)
    tree = TokenTree.from_lists([4, 5, 6, 7, 8], [-1, 0, 0, 1, 2])
    segs = [Segment(tables[0], 5, [1, 2, 3], logits="last"), Segment(tables[1], 14, [9], logits="all"),
            Segment(tables[2], 23, tree.tokens.tolist(), positions=(23 + tree.depths).tolist(),
                    mask_bits=tree.ancestor_bits().tolist(), logits="all")]
    batch = build_batch(segs, cache, "cpu")
    assert graph_shape(batch.query_lens, batch.num_tokens, BATCH_BUCKETS, 64, 1024) == (4, 16, False)
    g = _Graph(4, 16, False, max_blocks=12, device=torch.device("cpu"))
    g.tokens.fill_(7)  # stale inputs from an earlier replay: load must overwrite every row
    g.query_start.fill_(3)
    g.context_lens.fill_(9)
    rows = g.load(batch, cache.scratch_block, cache.page_size)
    assert g.query_start.tolist() == [0, 3, 4, 9, 16] and g.context_lens.tolist() == [5, 14, 23, 0]
    assert g.tokens[9:].eq(0).all() and g.slot_mapping[9:].eq(cache.scratch_block * cache.page_size).all()
    assert rows is not None and rows.tolist() == batch.logits_indices.tolist() == [2, 3, 4, 5, 6, 7, 8]
    k_before, v_before = cache.k.clone(), cache.v.clone()
    if with_features:  # the forward that also returns features (a feature drafter's target)
        padded_logits, padded_hidden = model.forward_hidden(g.batch, cache)
        got, got_hidden = padded_logits.index_select(0, rows), padded_hidden[: batch.num_tokens]
    else:
        got = model.forward(g.batch, cache).index_select(0, rows)
    k_graph, v_graph = cache.k.clone(), cache.v.clone()
    cache.k.copy_(k_before)
    cache.v.copy_(v_before)
    if with_features:
        want, want_hidden = model.forward_hidden(batch, cache)
        torch.testing.assert_close(got_hidden, want_hidden, rtol=1e-5, atol=1e-5)
    else:
        want = model.forward(batch, cache)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    s = cache.scratch_block
    torch.testing.assert_close(k_graph[:, :s], cache.k[:, :s])  # real rows wrote the same K/V, padding none
    torch.testing.assert_close(v_graph[:, :s], cache.v[:, :s])
    torch.testing.assert_close(k_graph[:, s + 1 :], cache.k[:, s + 1 :])


def test_a_decode_graph_batch_pads_with_empty_segments() -> None:
    cfg = tiny_config(vocab=96, layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                      head_dim=16)
    model = Transformer.from_weights(cfg, random_weights(cfg, scale=0.1), torch.float32, "cpu")
    cache = model.new_cache(32, 4)
    tables = [cache.new_table() for _ in range(3)]
    for i, t in enumerate(tables):
        model.forward(build_batch([Segment(t, 0, list(range(3 + 4 * i)), logits="none")], cache, "cpu"), cache)
    batch = build_batch([Segment(t, 3 + 4 * i, [10 + i], logits="all") for i, t in enumerate(tables)], cache, "cpu")
    batch.is_decode = True
    g = _Graph(4, 4, True, max_blocks=12, device=torch.device("cpu"))
    assert g.load(batch, cache.scratch_block, cache.page_size) is None  # every row wanted, in order
    assert g.query_start.tolist() == [0, 1, 2, 3, 4] and g.context_lens.tolist() == [3, 7, 11, 0]
    k_before = cache.k.clone()
    got = model.forward(g.batch, cache)[:3]
    cache.k.copy_(k_before)
    torch.testing.assert_close(got, model.forward(batch, cache), rtol=1e-5, atol=1e-5)


class EagerLayoutRunner(CudaGraphRunner):
    """The runner's shapes and ragged layout on the CPU: each "replay" runs the eager forward over the
    graph's static batch, as the captured graph would."""

    def _record(self, g: _Graph) -> None:
        runner = self

        class Replay:
            def replay(self) -> None:
                g.out, g.hidden = runner._run(g)

        g.graph = Replay()


def _with_layout_runners(engine, max_running: int | None = None):
    """``engine`` with the target's and every model drafter's forwards going through ``EagerLayoutRunner``
    (captured up front when ``max_running`` is given, as ``Engine.capture_graphs`` does)."""
    from draft.model_drafter import CATCH_UP_NODES
    from draft.tree import MAX_TREE_NODES

    blocks = -(-(engine.max_model_len + MAX_TREE_NODES) // engine.config.page_size)
    engine.graphs = EagerLayoutRunner(engine.target, engine.cache, blocks, max_nodes=MAX_TREE_NODES,
                                      shared_logits=True)  # as the engine builds its target's runner
    for d in engine.drafters.values():
        if hasattr(d, "graphs"):
            d.graphs = d.loop.runner = EagerLayoutRunner(d.model, d.cache, blocks, max_nodes=CATCH_UP_NODES)
    if max_running is not None:
        engine.graphs.capture(max_running)
        for d in engine.drafters.values():
            if getattr(d, "graphs", None) is not None:
                d.graphs.capture(max_running)
    return engine


def _requests(seed: int):
    from draft.params import SpeculationParams
    from verify.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    s = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    # speculation on with several drafters and trees, and off, side by side: ragged steps every step
    specs = [SpeculationParams(), SpeculationParams(enabled=False), SpeculationParams(drafter="exact", tree=(3, 2, 1)),
             SpeculationParams(drafter="ngram"), SpeculationParams(drafter="self", tree=(1,)),
             SpeculationParams(drafter="exact", tree=(1, 1, 1, 1, 1)), SpeculationParams(enabled=False)]
    lengths = [5 + 7 * i for i in range(len(specs) - 1)] + [80]  # the last prefill is past 64 tokens: eager
    return [(str(i), torch.randint(0, 64, (n,), generator=g).tolist(), s, spec)
            for i, (n, spec) in enumerate(zip(lengths, specs))]


def test_engine_output_is_the_same_through_the_ragged_layout() -> None:
    """Greedy output through the runners' shapes and ragged static batches equals the eager engine's, mixed
    batches of trees and plain decoding included; the target replayed ragged graphs with a spare segment."""
    from engine_util import run_all, tiny_engine

    want = run_all(tiny_engine(max_running=8), _requests(3))
    eng = _with_layout_runners(tiny_engine(max_running=8))
    assert run_all(eng, _requests(3)) == want
    assert eng.graphs.replays > 0 and eng.drafters["draft"].graphs.replays > 0
    ragged = [k for k in eng.graphs._graphs if not k[2]]
    assert ragged and eng.graphs.eager > 0  # tree steps replayed ragged; the prompts' prefills ran eagerly
    # every target graph wrote its logits into the one shared buffer; the drafter's graphs each hold their own
    outs = [g.out for g in eng.graphs._graphs.values() if g.out is not None]
    assert len(outs) > 2 and {o.untyped_storage().data_ptr() for o in outs} == {eng.graphs._logits.data_ptr()}
    draft_outs = [g.out for g in eng.drafters["draft"].graphs._graphs.values() if g.out is not None]
    assert len({o.untyped_storage().data_ptr() for o in draft_outs}) == len(draft_outs) > 1


def test_capture_up_front_covers_every_step_that_follows() -> None:
    """After ``capture(max_running)`` no step needs a graph that was not captured: the buckets steps choose
    among are narrowed to the captured ones, a spare bucket past ``max_running`` included."""
    from engine_util import run_all, tiny_engine

    eng = _with_layout_runners(tiny_engine(max_running=6), max_running=6)
    held = {name: set(r._graphs) for name, r in [("target", eng.graphs)] + [
        (n, d.graphs) for n, d in eng.drafters.items() if getattr(d, "graphs", None) is not None]}
    assert max(b for b, _, _ in held["target"]) == 8  # the bucket past 6: its spare segment holds padding
    run_all(eng, _requests(4))
    assert set(eng.graphs._graphs) == held["target"] and eng.graphs.replays > 0
    for n, d in eng.drafters.items():
        if getattr(d, "graphs", None) is not None:
            assert set(d.graphs._graphs) == held[n]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 90), st.sampled_from(["off", "draft", "exact", "ngram", "self"]),
                          st.lists(st.integers(1, 3), min_size=1, max_size=4), st.integers(1, 16)),
                min_size=1, max_size=9),
       st.integers(1, 8), st.integers(0, 2**16))
def test_random_batches_through_the_ragged_layout_match_the_eager_engine(reqs, max_running: int, seed: int) -> None:
    """Random prompt lengths (prefills past 64 tokens run eagerly), drafters, trees and lengths, more requests
    than running slots (admission mid-run): greedy output through the layout runners, captured up front,
    equals the eager engine's token for token."""
    from draft.params import SpeculationParams
    from engine_util import run_all, tiny_engine
    from verify.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    requests = [(str(i), torch.randint(0, 64, (n,), generator=g).tolist(),
                 SamplingParams(temperature=0, max_tokens=m, ignore_eos=True),
                 SpeculationParams(enabled=False) if d == "off" else SpeculationParams(drafter=d, tree=tuple(tree)))
                for i, (n, d, tree, m) in enumerate(reqs)]
    want = run_all(tiny_engine(max_running=max_running), requests)
    eng = _with_layout_runners(tiny_engine(max_running=max_running), max_running=max_running)
    held = set(eng.graphs._graphs)
    assert run_all(eng, requests) == want
    assert set(eng.graphs._graphs) == held  # nothing captured past the up-front set
