"""The device-side greedy tree loop grows exactly the trees the host builder grows, and keeps the pool whole."""

import pytest
import torch

from draft.base import DraftRequest
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
    assert [t.num_nodes for t in trees] == [6, 3, 4, 6]
    assert trees[2].draft_probs is not None  # sampled: the host builder kept the draft's distributions
    assert trees[0].draft_probs is None
    for t, r in zip(trees, reqs):
        assert int(t.tokens[0]) == r.token_ids[-1]
        depths = t.depths.tolist()
        assert [depths.count(d + 1) for d in range(len(r.widths))] == list(r.widths)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("widths", [(1, 1, 1, 1), (2, 2, 2, 1)])
def test_device_loop_graph_matches_host_builder_cuda(widths):
    """On CUDA the loop replays a captured graph (batch padded to a bucket) and still grows the host's trees."""
    from draft.model_drafter import ModelDrafter
    from engine_util import random_weights, tiny_config
    from target.model import Transformer

    cfg = tiny_config(vocab=512)
    model = Transformer.from_weights(cfg, random_weights(cfg), torch.float32, "cuda")
    drafter = ModelDrafter("draft", model, 128, 4, graphs=True, max_model_len=256)
    gen = torch.Generator(device="cuda")
    reqs = [DraftRequest(f"s{i}", [(7 * j + i) % 500 + 3 for j in range(5 + 3 * i)], widths,
                         SamplingParams(temperature=0), gen) for i in range(3)]  # 3 rows in bucket 4
    trees = {}
    for on_device in (True, False):
        drafter.device_loop = on_device
        trees[on_device] = drafter.propose(reqs)
        for r in reqs:
            drafter.release(r.seq_id)
    assert drafter.loop.replays == 1
    for a, b in zip(trees[True], trees[False]):
        assert a.tokens.tolist() == b.tokens.tolist()
        assert a.parents.tolist() == b.parents.tolist()
