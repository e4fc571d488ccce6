"""The device-side greedy tree loop grows exactly the trees the host builder grows, and keeps the pool whole."""

from dataclasses import replace

import pytest
import torch

from draft.base import DraftRequest
from draft.params import SpeculationParams
from draft.model_drafter import prune_tree
from draft.tree_loop import covering_template
from engine_util import tiny_engine
from verify.sampling import SamplingParams


@pytest.mark.parametrize("widths", [(1,), (1, 1, 1, 1), (2, 2, 2, 1), (3, 3, 3, 2, 2, 1), (4, 1)])
def test_device_loop_matches_host_builder(widths):
    engine = tiny_engine(num_blocks=128, page_size=4, vocab=512)
    drafter = engine.drafters["draft"]
    gen = torch.Generator()
    # contexts that straddle block boundaries, so node slots cross into fresh blocks
    reqs = [DraftRequest(f"s{i}", [(7 * j + i) % 500 + 3 for j in range(5 + 3 * i)], widths,
                         SamplingParams(temperature=0), gen) for i in range(4)]
    free = drafter.cache.pool.num_free
    trees = {}
    for on_device in (True, False):
        drafter.device_loop = on_device
        trees[on_device] = drafter.propose(reqs)
        for r in reqs:
            drafter.release(r.seq_id)
        assert drafter.cache.pool.num_free == free
    for a, b, r in zip(trees[True], trees[False], reqs):
        assert a.tokens.tolist() == b.tokens.tolist()
        assert a.parents.tolist() == b.parents.tolist()
        assert a.tokens[0] == r.token_ids[-1]
        assert a.num_nodes == 1 + sum(widths)
        assert drafter.loop.replays == 0  # no graphs on the CPU: the loop ran eagerly


def test_device_loop_mixed_widths_and_sampled_requests():
    """One propose with two greedy width groups and a sampled request: each gets its own shape."""
    engine = tiny_engine(num_blocks=128, page_size=4, vocab=512)
    drafter = engine.drafters["draft"]
    gen = torch.Generator().manual_seed(0)
    reqs = [DraftRequest("a", list(range(3, 20)), (2, 2, 1), SamplingParams(temperature=0), gen),
            DraftRequest("b", list(range(5, 30)), (1, 1), SamplingParams(temperature=0), gen),
            DraftRequest("c", list(range(8, 25)), (2, 1), SamplingParams(temperature=1.0), gen),
            DraftRequest("d", list(range(9, 40)), (2, 2, 1), SamplingParams(temperature=0), gen)]
    trees = drafter.propose(reqs)
    assert [t.num_nodes for t in (trees[0], trees[2], trees[3])] == [6, 4, 6]
    assert trees[2].draft_probs is not None  # sampled: the loop kept the draft's distributions
    assert trees[0].draft_probs is None
    # one loop for the three greedy trees (their union template), one for the sampled tree
    assert drafter.loop.replays == 0 and sorted(drafter.loop._plans) == [(1, (2, 1)), (3, (2, 2, 1))]
    for t, r in zip(trees, reqs):
        assert int(t.tokens[0]) == r.token_ids[-1]
        depths = t.depths.tolist()
        per_level = [depths.count(d + 1) for d in range(max(depths) + 1)][: len(r.widths)]
        assert all(n <= w for n, w in zip(per_level, r.widths)) and per_level[0] == r.widths[0]


def test_prune_keeps_best_children_of_kept_nodes() -> None:
    # grown with W = (2, 2): nodes 1, 2 at depth 1; 3 (child of 1), 4 (child of 2) at depth 2
    tokens, parents, cum = [9, 10, 11, 12, 13], [-1, 0, 0, 1, 2], [0.0, -1.0, -0.5, -1.2, -0.9]
    assert prune_tree(tokens, parents, cum, (2, 2), (1, 1)) == ([9, 11, 13], [-1, 0, 1], [0, 2, 4])
    assert prune_tree(tokens, parents, cum, (2, 2), (2,)) == ([9, 10, 11], [-1, 0, 0], [0, 1, 2])
    assert prune_tree(tokens, parents, cum, (2, 2), (2, 1)) == ([9, 10, 11, 13], [-1, 0, 0, 2], [0, 1, 2, 4])


def test_covering_template_is_the_cheapest_held_template_that_holds_the_widths() -> None:
    held = [(2,), (2, 2), (2, 2, 2), (2, 2, 2, 1), (3, 1)]
    assert covering_template(held, (1,)) == (2,)
    assert covering_template(held, (2, 1)) == (2, 2)
    assert covering_template(held, (3,)) == (3, 1)
    assert covering_template(held, (1, 1, 1, 1)) == (2, 2, 2, 1)
    assert covering_template(held, (2, 2, 2)) == (2, 2, 2)
    assert covering_template(held, (3, 2)) is None  # no held template is wide enough at both levels
    assert covering_template(held, (1, 1, 1, 1, 1)) is None  # nor deep enough
    assert covering_template([], (1,)) is None


def test_committing_a_cut_tree_keeps_the_draft_cache_exact() -> None:
    """A tree cut from a larger loop tree holds its K/V at the loop's slots. Two sequences commit (one cut
    tree, one whole tree accepted along its last children, so both move K/V) and one flush compacts
    both: each draft cache then equals a fresh prefill of its accepted tokens."""
    engine = tiny_engine(num_blocks=128, page_size=4, vocab=512)
    drafter = engine.drafters["draft"]
    gen = torch.Generator()
    greedy = SamplingParams(temperature=0)
    a = DraftRequest("a", [(5 * j) % 500 + 3 for j in range(9)], (1, 1, 1), greedy, gen)
    b = DraftRequest("b", [(3 * j) % 500 + 7 for j in range(13)], (3, 3, 3), greedy, gen)
    trees = drafter.propose([a, b])  # a's tree is cut from the (3, 3, 3) loop tree
    assert drafter._fed.get("a") is not None and drafter._fed.get("b") is None
    accepted = {}
    for r, tree in zip((a, b), trees):
        parents = tree.parents.tolist()
        path = [0]
        while any(p == path[-1] for p in parents):  # down the last child of each node, to a leaf
            path.append(max(i for i, p in enumerate(parents) if p == path[-1]))
        drafter.commit(r.seq_id, tree, path)
        accepted[r.seq_id] = r.token_ids + [int(tree.tokens[n]) for n in path[1:]]
        deepest = int(tree.depths.max())
        fed = sum(1 for n in path[1:] if int(tree.depths[n]) < deepest)  # the deepest level is never fed
        assert drafter._cached[r.seq_id] == len(r.token_ids) + fed
    drafter.flush()
    for r in (a, b):
        n_cached = drafter._cached[r.seq_id]
        fresh = tiny_engine(num_blocks=128, page_size=4, vocab=512).drafters["draft"]
        fresh.propose([DraftRequest(r.seq_id, accepted[r.seq_id][: n_cached + 1], (1,), greedy, gen)])
        slots = drafter._tables[r.seq_id].slots(0, n_cached)
        ref = fresh._tables[r.seq_id].slots(0, n_cached)
        for cache, ref_cache in ((drafter.cache.k, fresh.cache.k), (drafter.cache.v, fresh.cache.v)):
            torch.testing.assert_close(cache.flatten(1, 2)[:, slots], ref_cache.flatten(1, 2)[:, ref],
                                       rtol=1e-5, atol=1e-5)


def cuda_engine():
    """A float32 target and its noisy-copy draft on CUDA, with graphs: the engine and the draft."""
    from draft.model_drafter import ModelDrafter
    from engine_util import noisy, random_weights, tiny_config
    from gateway.engine import Engine, EngineConfig
    from gateway.scheduler import SchedulerConfig
    from target.model import Transformer

    cfg = tiny_config(vocab=512)
    w = random_weights(cfg)
    target = Transformer.from_weights(cfg, w, torch.float32, "cuda")
    drafter = ModelDrafter("draft", Transformer.from_weights(cfg, noisy(w, 0.3), torch.float32, "cuda"), 256, 4,
                           graphs=True, max_model_len=256)
    engine = Engine(target, {"draft": drafter}, EngineConfig(num_blocks=256, page_size=4, scheduler=SchedulerConfig(
        max_running=8, max_model_len=256), default_drafter="draft", default_tree=(2, 2, 1)))
    return engine, drafter


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_loop_graphs_keep_greedy_output_cuda():
    """On CUDA the loop replays captured graphs (batches padded to a bucket, mixed widths cut from one
    union tree); greedy speculative output stays the target's own. Trees are not compared with the host
    builder's: fp32 attention runs as TF32 there, and padding changes its rounding, so near-ties may flip."""
    engine, drafter = cuda_engine()
    assert engine._defer_trees  # CUDA's default: greedy trees reach the target's batch unread
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [[(7 * j + i) % 500 + 3 for j in range(5 + 3 * i)] for i in range(5)]
    trees = [(2, 2, 1), (1, 1), (3, 1), None, (2,)]
    out = {}
    for arm, spec, defer in (("True", True, None), ("host", True, False), ("False", False, None)):
        engine.config = replace(engine.config, defer_trees=defer)
        for i, (p, t) in enumerate(zip(prompts, trees)):
            engine.add(f"{arm}{i}", p, greedy, SpeculationParams(enabled=spec, tree=t))
        while engine.has_work():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert drafter.loop.replays > 0
    for i in range(len(prompts)):
        assert out[f"True{i}"] == out[f"False{i}"] == out[f"host{i}"]
    # Trees inside the default template grow in the graphs captured at start: serving captures no more.
    engine.capture_graphs()
    held = set(drafter.loop._graphs)
    for i, t in enumerate([(1,), (2, 1), (1, 1, 1), None, (2, 2)]):
        engine.add(f"in{i}", prompts[i], greedy, SpeculationParams(enabled=True, tree=t))
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert set(drafter.loop._graphs) == held
    assert all(out[f"in{i}"] == out[f"False{i}"] for i in range(5))
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks
    assert drafter.cache.pool.num_free == drafter.cache.pool.num_blocks


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.6),
], ids=["t1", "topk3", "topp"])
@pytest.mark.parametrize("widths", [(1,), (2, 2, 1), (3, 3, 2), (4, 1, 1)])
def test_sampled_device_loop_grows_the_host_builders_trees(params, widths):
    """Same generators, same trees: the CPU generator fills the loop's one noise block per request with the
    numbers the host builder draws level by level, so tokens and parents agree exactly, and draft
    distributions to float rounding. top-k 3
    under width 4 and a narrow nucleus leave fewer tokens with mass than children: the loop's draws past
    the support are cut."""
    engine = tiny_engine(num_blocks=128, page_size=4, vocab=512)
    drafter = engine.drafters["draft"]
    def reqs() -> list[DraftRequest]:
        return [DraftRequest(f"s{i}", [(11 * j + i) % 500 + 3 for j in range(6 + 3 * i)], widths, params,
                             torch.Generator().manual_seed(i)) for i in range(3)]

    free = drafter.cache.pool.num_free
    trees = {}
    for on_device in (True, False):
        drafter.device_loop = on_device
        trees[on_device] = drafter.propose(reqs())
        for r in reqs():
            drafter.release(r.seq_id)
        assert drafter.cache.pool.num_free == free
    cut = 0
    for a, b in zip(trees[True], trees[False]):
        assert a.depths.tolist() == b.depths.tolist()  # the same share of each level for each node
        for node, (tok, parent) in enumerate(zip(a.tokens.tolist(), a.parents.tolist())):
            if node:
                assert a.draft_probs[parent, tok] > 0  # never a draw past the support
        if a.num_nodes < 1 + sum(widths) and len(widths) > 1:
            # a cut above the last level: the host draws noise for the kept frontier nodes alone, the loop
            # for every node it fed, so deeper levels draw other (equally valid) noise. The cut level agrees.
            cut += 1
            first = a.depths.tolist().count(1) + 1
            assert a.tokens.tolist()[:first] == b.tokens.tolist()[:first]
            continue
        assert a.tokens.tolist() == b.tokens.tolist()
        assert a.parents.tolist() == b.parents.tolist()
        # the loop's forwards batch the sequences otherwise than the host's: the logits differ in their last bits
        torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-4, atol=1e-7)
        assert torch.equal(a.draft_probs > 0, b.draft_probs > 0)
    assert drafter.loop.replays == 0
    if params.top_k == 3 and widths == (4, 1, 1):
        assert cut == 3  # four children asked of a three-token support at the root


def test_sampled_loop_with_cut_draws_commits_the_fed_slots():
    """A tree with draws cut past the support keeps its K/V where the loop fed them: committing an accepted
    path through it leaves the draft cache as if the path had been fed in order."""
    engine = tiny_engine(num_blocks=128, page_size=4, vocab=512)
    drafter = engine.drafters["draft"]
    params = SamplingParams(temperature=1.0, top_k=2)
    r = DraftRequest("s", [(5 * j) % 500 + 3 for j in range(9)], (3, 3, 1), params, torch.Generator().manual_seed(0))
    tree = drafter.propose([r])[0]
    fed = drafter._fed["s"]
    assert tree.num_nodes < 8
    depths, parents = tree.depths.tolist(), tree.parents.tolist()
    child = depths.index(2)  # the first depth-2 node: its loop slot lies past the cut draw of level 1
    assert fed[child] != child
    path = [0, parents[child], child]
    drafter.commit("s", tree, path)
    drafter.flush()
    assert drafter._cached["s"] == len(r.token_ids) + 2
    ids = r.token_ids + [int(tree.tokens[n]) for n in path[1:]] + [7]  # the accepted path, then the next root
    # the next propose feeds only the new root over the committed cache: its tree must equal a fresh draft's
    fresh = tiny_engine(num_blocks=128, page_size=4, vocab=512).drafters["draft"]
    nxt = DraftRequest("s", ids, (2, 2), SamplingParams(temperature=0), torch.Generator())
    again = DraftRequest("t", ids, (2, 2), SamplingParams(temperature=0), torch.Generator())
    assert drafter.propose([nxt])[0].tokens.tolist() == fresh.propose([again])[0].tokens.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampled_loop_replays_its_graph_or_the_runners_cuda(monkeypatch):
    """On CUDA a sampled loop replays one graph of its own per (bucket, widths, filtered), each request's noise
    drawn into it from its own CUDA generator; with SPECGATE_SAMPLED_GRAPHS=0 it runs eagerly and its draft
    forwards replay the drafter's graph runner. Either way sampled requests finish, free every block, and
    draw the same tokens: the same noise, the same kernels."""
    from draft import tree_loop

    outs = {}
    for whole in (True, False):
        monkeypatch.setattr(tree_loop, "SAMPLED_GRAPHS", whole)
        engine, drafter = cuda_engine()
        engine.capture_graphs()
        runner, fed = drafter.loop.runner, []

        class Counting:  # the drafter's runner, counting the loop's forwards through it
            def forward(self, batch, cache):
                fed.append(len(batch.query_lens))
                return runner.forward(batch, cache)

        drafter.loop.runner = Counting()
        before = drafter.loop.replays
        for i, params in enumerate([SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=1),
                                    SamplingParams(temperature=1.0, top_p=0.9, top_k=4, max_tokens=24,
                                                   ignore_eos=True, seed=2)]):
            engine.add(f"s{i}", [(5 * j + i) % 500 + 3 for j in range(9)], params, SpeculationParams(tree=(2, 2, 1)))
        out = outs[whole] = {}
        while engine.has_work():
            for o in engine.step():
                assert o.error is None, o.error
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert [len(v) for v in out.values()] == [24, 24]
        if whole:
            assert not fed and drafter.loop.replays > before and drafter.loop._sampled_graphs
        else:
            assert fed and drafter.loop.replays == before
        assert drafter.cache.pool.num_free == drafter.cache.pool.num_blocks
    assert outs[True] == outs[False]


def _resolved(tree):
    """A deferred tree resolved from its device rows, as the step's host copy does."""
    tok, par = tree.pending.rows.tolist()
    bits = tree.pending.bits.tolist()
    tree.resolve(tok, par)
    return bits


@pytest.mark.parametrize("shapes", [
    [(2, 2, 1), (2, 2), (2,), (2, 2, 1)],  # the union template and its first levels
    [(9,) * 7, (9, 9), (9,), (9,) * 7],  # 63 nodes: node 63's bit is int64's sign bit
    [(3, 3, 2), (3, 1), (2,), (3, 3, 1), (1,)],  # last levels narrower: cut on the device
    [(4, 4, 4, 4), (4, 4, 4, 1), (4, 4, 2), (4, 4, 4, 3)],
])
def test_deferred_trees_equal_host_trees_and_carry_the_targets_bits(shapes):
    """Deferred requests get the loop's trees without a host copy; resolved they equal the host path's trees
    (``prune_tree`` for the narrower ones), and their device bits are ``ancestor_bits``'."""
    engine = tiny_engine(num_blocks=256, page_size=4, vocab=512)
    drafter = engine.drafters["draft"]
    gen = torch.Generator()
    reqs = [DraftRequest(f"s{i}", [(5 * j + 3 * i) % 500 + 3 for j in range(6 + 2 * i)], w,
                         SamplingParams(temperature=0), gen, defer=True) for i, w in enumerate(shapes)]
    free = drafter.cache.pool.num_free
    got = {}
    for defer in (True, False):
        got[defer] = drafter.propose([replace(r, defer=defer) for r in reqs])
        for r in reqs:
            drafter.release(r.seq_id)
        assert drafter.cache.pool.num_free == free
    for a, b, w in zip(got[True], got[False], shapes):
        assert a.pending is not None and b.pending is None
        assert a.num_nodes == b.num_nodes == 1 + sum(w)
        bits = _resolved(a)
        assert a.host() == b.host()
        assert bits == b.ancestor_bits()[1:].tolist()


def test_a_tree_cut_from_the_union_is_built_on_the_host():
    """A request whose widths are narrower above its last level than the union template's is cut from it by
    cumulative log-probability on the host: its step copies the trees back, deferred or not."""
    engine = tiny_engine(num_blocks=128, page_size=4, vocab=512)
    drafter = engine.drafters["draft"]
    gen = torch.Generator()
    reqs = [DraftRequest("a", list(range(3, 20)), (3, 2), SamplingParams(temperature=0), gen, defer=True),
            DraftRequest("b", list(range(5, 30)), (1, 2), SamplingParams(temperature=0), gen, defer=True)]
    trees = drafter.propose(reqs)
    assert all(t.pending is None for t in trees)
    assert [t.num_nodes for t in trees] == [6, 4]
