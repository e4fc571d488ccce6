"""The feature drafter (EAGLE-style): output identical to the target alone, the target's features reach
the draft at the right positions, and every block comes back."""

from __future__ import annotations

import pytest
import torch

from draft.feature_drafter import FeatureDrafter
from draft.params import SpeculationParams
from engine_util import random_weights, run_all, tiny_config
from gateway.budget import BudgetConfig
from gateway.engine import Engine, EngineConfig
from gateway.scheduler import SchedulerConfig
from target.batch import Segment, build_batch
from target.config import FC_NAME
from target.model import Transformer
from verify.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def feature_draft(target_weights: dict[str, torch.Tensor], seed: int = 3, device: str = "cpu") -> Transformer:
    """A one-layer random feature draft on the target's embedding and head. ``fc`` passes the feature
    through (plus noise), so the draft's guesses follow the target's features a little."""
    cfg = tiny_config(layers=1)
    g = torch.Generator().manual_seed(seed)
    w = random_weights(cfg, seed)
    w["model.embed_tokens.weight"] = target_weights["model.embed_tokens.weight"]
    w["lm_head.weight"] = target_weights["lm_head.weight"]
    H = cfg.hidden_size
    w[FC_NAME] = torch.cat([0.05 * torch.randn(H, H, generator=g), torch.eye(H)], dim=1)
    for name in list(w):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = 0.05 * w[name]  # a layer that mostly keeps its input
    return Transformer.from_weights(cfg, w, device=device)


class Recording(FeatureDrafter):
    """Records the features each catch-up feeds: (seq, first position, [n, hidden])."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.fed: list[tuple[str, int, torch.Tensor]] = []
        self.accepted = 0

    def _features(self, seq_id: str, lo: int, hi: int) -> torch.Tensor:
        out = super()._features(seq_id, lo, hi)
        self.fed.append((seq_id, lo, out.clone()))
        return out

    def commit(self, seq_id, tree, accepted_nodes) -> None:
        self.accepted += len(accepted_nodes) - 1
        super().commit(seq_id, tree, accepted_nodes)


def make_engine(tree=(4, 4, 2), num_blocks=96, page_size=4, max_step_tokens=256, device="cpu"):
    cfg = tiny_config()
    w = random_weights(cfg)
    target = Transformer.from_weights(cfg, w, device=device)
    drafter = Recording("feature", feature_draft(w, device=device), num_blocks, page_size)
    ecfg = EngineConfig(num_blocks=num_blocks, page_size=page_size,
                        scheduler=SchedulerConfig(max_running=8, max_step_tokens=max_step_tokens, max_model_len=512,
                                                  budget=BudgetConfig(max_verify_tokens=1024, cost_aware=False)),
                        default_drafter="feature", default_tree=tree)
    return Engine(target, {"feature": drafter}, ecfg), target, drafter


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def dense_features(target: Transformer, ids: list[int]) -> torch.Tensor:
    """The target's features of every position of ``ids``, from one causal pass on a fresh cache."""
    cache = target.new_cache(64, 4)  # one eager pass: never a graph
    table = cache.new_table()
    _, hidden = target.forward_hidden(build_batch([Segment(table, 0, ids, logits="last")], cache, target.device), cache)
    return hidden


@pytest.mark.parametrize("max_step_tokens,device", [
    (256, "cpu"), (8, "cpu"),  # 8: prompts prefill in several chunks
    pytest.param(256, "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_greedy_output_is_the_targets_and_features_line_up(max_step_tokens, device) -> None:
    """On CUDA the target's, the catch-up's and the tree loop's forwards replay graphs with features."""
    engine, target, drafter = make_engine(max_step_tokens=max_step_tokens, device=device)
    ps = prompts(6)
    on = run_all(engine, [(f"r{i}", p, GREEDY, SpeculationParams()) for i, p in enumerate(ps)])
    off = run_all(engine, [(f"o{i}", p, GREEDY, SpeculationParams(enabled=False)) for i, p in enumerate(ps)])
    for i in range(len(ps)):
        assert on[f"r{i}"] == off[f"o{i}"]
    assert drafter.accepted > 0  # trees were accepted past the root: the node rows were exercised
    assert drafter.cache.pool.num_free == drafter.cache.pool.num_blocks
    assert not drafter._feats and not drafter._tables
    # Every feature the draft was fed is the target's own at that position (zeros before position 0).
    checked = 0
    for seq_id, lo, fed in drafter.fed:
        i = int(seq_id[1:])
        ids = ps[i] + on[seq_id]
        ref = dense_features(target, ids)
        for j in range(fed.shape[0]):
            pos = lo + j - 1
            if pos < 0:
                assert fed[j].abs().max() == 0
            else:
                # CUDA: Triton's fp32 dots run as TF32, and graphs pad rows (another tile config)
                tol = 1e-4 if device == "cpu" else 1e-2
                torch.testing.assert_close(fed[j], ref[pos], rtol=tol, atol=tol)
                checked += 1
    assert checked > sum(len(p) for p in ps)  # the prompts and the generated positions


def test_sampled_trees_run_and_free_everything() -> None:
    engine, _, drafter = make_engine()
    sampling = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=5)
    out = run_all(engine, [(f"s{i}", p, sampling, SpeculationParams()) for i, p in enumerate(prompts(4, seed=1))])
    assert all(len(v) == 20 and all(0 <= t < 64 for t in v) for v in out.values())
    assert drafter.cache.pool.num_free == drafter.cache.pool.num_blocks
    assert not drafter._feats


def test_a_prefix_cache_hit_feeds_zeros_and_keeps_output() -> None:
    engine, _, drafter = make_engine()
    p = prompts(1, seed=2)[0] * 3  # several full blocks
    first = run_all(engine, [("a", p, GREEDY, SpeculationParams())])
    drafter.fed.clear()
    second = run_all(engine, [("b", p, GREEDY, SpeculationParams())])
    assert first["a"] == second["b"]
    _, lo, fed = drafter.fed[0]
    assert lo == 0 and fed[1:].abs().sum(-1).eq(0).any()  # cached prompt blocks: no target feature for them


def test_a_plain_draft_model_is_refused() -> None:
    cfg = tiny_config(layers=1)
    with pytest.raises(ValueError, match="no feature input"):
        FeatureDrafter("f", Transformer.from_weights(cfg, random_weights(cfg)), 8, 4)


def test_forward_needs_features() -> None:
    w = random_weights(tiny_config())
    draft = feature_draft(w)
    cache = draft.new_cache(8, 4)
    batch = build_batch([Segment(cache.new_table(), 0, [1, 2, 3])], cache, draft.device)
    with pytest.raises(ValueError, match="needs the target's features"):
        draft.forward(batch, cache)
