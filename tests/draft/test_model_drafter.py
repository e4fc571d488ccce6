"""ModelDrafter's catch-up: a sequence that lagged (plain steps, lookup-only steps) is fed in graph-sized
pieces, and its cache and tree come out as if it had been fed in one."""

from __future__ import annotations

import torch

from draft.base import DraftRequest
from draft.model_drafter import CATCH_UP_NODES
from engine_util import tiny_engine
from verify.sampling import SamplingParams


def test_a_long_lag_is_fed_in_pieces_that_a_catch_up_graph_holds() -> None:
    gen = torch.Generator()
    greedy = SamplingParams(temperature=0)
    tokens = [(7 * j) % 500 + 3 for j in range(80)]
    lagging = tiny_engine(num_blocks=128, page_size=4, vocab=512).drafters["draft"]
    first = lagging.propose([DraftRequest("a", tokens[:10], (1,), greedy, gen),
                             DraftRequest("b", tokens[:20], (1,), greedy, gen)])
    for sid, tree in zip("ab", first):
        lagging.commit(sid, tree, [0])  # only the root accepted: 10 and 20 tokens cached
    lagging.flush()
    fed: list[tuple[str, int, int]] = []  # (sequence, context, tokens) of every catch-up segment
    inner = lagging._catch_up

    def recording(reqs, segs):
        fed.extend((r.seq_id, s.context_len, len(s.tokens)) for r, s in zip(reqs, segs))
        return inner(reqs, segs)

    lagging._catch_up = recording
    # a now lags by 60 tokens, b by 25 (as after plain steps); one proposal feeds both
    ask = [DraftRequest("a", tokens[:70], (2, 1), greedy, gen), DraftRequest("b", tokens[:45], (2, 1), greedy, gen)]
    trees = lagging.propose(ask)
    assert max(n for _, _, n in fed) <= CATCH_UP_NODES, fed
    for sid, start, end in (("a", 10, 70), ("b", 20, 45)):
        pieces = [(c, n) for s, c, n in fed if s == sid]
        assert len(pieces) > 1 and pieces[0][0] == start, pieces
        assert all(c + n == nxt for (c, n), (nxt, _) in zip(pieces, pieces[1:])), pieces  # contiguous
        assert pieces[-1][0] + pieces[-1][1] == end

    fresh = tiny_engine(num_blocks=128, page_size=4, vocab=512).drafters["draft"]
    ref = fresh.propose(ask)
    for t, r in zip(trees, ref):
        assert t.tokens.tolist() == r.tokens.tolist() and t.parents.tolist() == r.parents.tolist()
    for sid, n in (("a", 70), ("b", 45)):
        assert lagging._cached[sid] == fresh._cached[sid] == n
        got, want = lagging._tables[sid].slots(0, n), fresh._tables[sid].slots(0, n)
        for cache, ref_cache in ((lagging.cache.k, fresh.cache.k), (lagging.cache.v, fresh.cache.v)):
            torch.testing.assert_close(cache.flatten(1, 2)[:, got], ref_cache.flatten(1, 2)[:, want],
                                       rtol=1e-4, atol=1e-4)
