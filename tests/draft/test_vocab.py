"""A draft head cut to the target's most frequent tokens (FR-Spec): ranking, the cut model, the drafter's id
mapping on both tree paths, lossless greedy output, and loading a cut draft from a directory."""

from __future__ import annotations

import json

import pytest
import torch

from draft.base import DraftRequest
from draft.model_drafter import ModelDrafter
from draft.params import SpeculationParams
from draft.vocab import continuation_counts, head_vocab, load_counts, rank_tokens, save_counts, spread
from engine_util import noisy, random_weights, tiny_config, tiny_engine
from target.batch import Segment, build_batch
from target.model import Transformer
from verify.sampling import SamplingParams


def test_rank_puts_kept_tokens_first_then_counts_then_ids() -> None:
    counts = {7: 3, 2: 5, 9: 3, 4: 0, 99: 8}  # 99 lies outside the vocabulary; 4 was never seen
    assert rank_tokens(counts, 10, keep=[5, 2]) == [5, 2, 7, 9, 0, 1, 3, 4, 6, 8]
    assert head_vocab(counts, 10, 3, keep=[5]).tolist() == [2, 5, 7]  # ascending
    assert head_vocab(counts, 10, 10).tolist() == list(range(10))
    with pytest.raises(ValueError, match="1..10"):
        head_vocab(counts, 10, 11)


def test_counts_round_trip_and_skip_prompts(tmp_path) -> None:
    counts = continuation_counts([[1, 2, 3, 3], [2, 4]], [2, 1])  # prompts [1, 2] and [2]
    assert counts == {3: 2, 4: 1}
    assert load_counts(tmp_path) is None
    save_counts(tmp_path, counts, "test")
    assert load_counts(tmp_path) == {3: 2, 4: 1}
    assert json.loads((tmp_path / "token_counts.json").read_text())["tokens"] == 3
    assert spread(list(range(10)), 3) == [0, 3, 6] and spread([1, 2], 0) == [1, 2]


def test_cut_head_scores_its_tokens_exactly() -> None:
    cfg = tiny_config(vocab=64)
    model = Transformer.from_weights(cfg, random_weights(cfg))
    ids = torch.tensor([40, 3, 17, 5])
    cut = model.cut_head(ids)
    assert cut.logits_width == 4 and model.logits_width == 64
    outs = []
    for m in (model, cut):
        cache = m.new_cache(8, 4)
        outs.append(m.forward(build_batch([Segment(cache.new_table(), 0, [1, 2, 3, 4, 5])], cache, "cpu"), cache))
    torch.testing.assert_close(outs[1], outs[0][:, ids])


def _drafters(vocab: int, ids: torch.Tensor) -> tuple[ModelDrafter, ModelDrafter]:
    cfg = tiny_config(vocab=vocab)
    w = noisy(random_weights(cfg), 0.3)
    full = ModelDrafter("full", Transformer.from_weights(cfg, w), 128, 4)
    cut = ModelDrafter("cut", Transformer.from_weights(cfg, w), 128, 4, head_vocab=ids)
    return full, cut


@pytest.mark.parametrize("device_loop", [True, False])
def test_a_permuted_whole_vocabulary_drafts_the_full_heads_trees(device_loop) -> None:
    """Every token kept, in a shuffled column order: any slip in mapping columns back to ids shows."""
    ids = torch.randperm(256, generator=torch.Generator().manual_seed(0))
    full, cut = _drafters(256, ids)
    gen = torch.Generator()
    reqs = [DraftRequest(f"s{i}", [(7 * j + i) % 250 + 3 for j in range(5 + 3 * i)], (2, 2, 1),
                         SamplingParams(temperature=0), gen) for i in range(3)]
    trees = []
    for d in (full, cut):
        d.device_loop = device_loop
        trees.append(d.propose(reqs))
    for a, b in zip(*trees):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()


def test_a_cut_head_proposes_only_its_tokens_greedy_and_sampled() -> None:
    ids = torch.arange(0, 256, 3)  # a third of the vocabulary
    _, cut = _drafters(256, ids)
    allowed = set(ids.tolist())
    reqs = [DraftRequest("g", list(range(3, 30)), (3, 2, 1), SamplingParams(temperature=0), torch.Generator()),
            DraftRequest("s", list(range(5, 40)), (3, 2, 1), SamplingParams(temperature=1.0),
                         torch.Generator().manual_seed(1))]
    greedy, sampled = cut.propose(reqs)
    for t in (greedy, sampled):
        assert t.num_nodes == 7 and set(t.tokens[1:].tolist()) <= allowed
    q = sampled.draft_probs  # the sampled tree's distributions live on the whole vocabulary, zero off the cut
    assert q is not None and q.shape[-1] == 256
    off = torch.ones(256, dtype=torch.bool)
    off[ids] = False
    assert float(q[..., off].abs().max()) == 0.0
    sums = q.sum(-1)  # a distribution at every node that has children; leaves hold none
    assert bool(((sums - 1).abs() < 1e-5).any()) and bool((((sums - 1).abs() < 1e-5) | (sums == 0)).all())


def test_greedy_output_with_a_cut_draft_is_the_targets() -> None:
    engine = tiny_engine(vocab=128, cut_vocab=list(range(0, 128, 2)))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], [1, 1, 2, 3, 5, 8, 13]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out: dict[str, list[int]] = {}
    drafted = 0
    for i, p in enumerate(prompts):
        engine.add(f"cut{i}", p, greedy, SpeculationParams(drafter="cut", tree=(2, 2, 1)))
        engine.add(f"off{i}", p, greedy, SpeculationParams(enabled=False))
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished and o.request_id.startswith("cut"):
                drafted += o.stats.drafted_tokens
    for i in range(len(prompts)):
        assert len(out[f"cut{i}"]) == 24 and out[f"cut{i}"] == out[f"off{i}"]
    assert drafted > 0  # the cut drafter drafted
    pool = engine.drafters["cut"].cache.pool
    assert pool.num_free == pool.num_blocks
