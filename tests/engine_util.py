"""Tiny random models for engine tests: no files, no tokenizer, a few milliseconds a step."""

from __future__ import annotations

import torch

from gateway.budget import BudgetConfig
from gateway.engine import Engine, EngineConfig
from gateway.scheduler import SchedulerConfig
from draft.model_drafter import ModelDrafter
from draft.ngram import NgramDrafter
from target.config import ModelConfig
from target.gptq import quantize_gptq
from target.loader import expected_weights
from target.model import Transformer


def tiny_config(family: str = "llama", vocab: int = 64, layers: int = 3, **kw) -> ModelConfig:
    base = dict(family=family, vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=layers,
                num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
                attention_bias=family == "qwen2", tie_word_embeddings=False, eos_token_ids=())
    base.update(kw)
    return ModelConfig(**base)


def random_weights(config: ModelConfig, seed: int = 0, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """Random weights with peaked logits (large embed/head scale) so greedy paths are stable."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_weights(config).items():
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        else:
            out[name] = scale * torch.randn(shape, generator=g)
    return out


def noisy(weights: dict[str, torch.Tensor], amount: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """A draft that mostly agrees with its target: the same weights plus noise."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + amount * v.std() * torch.randn(v.shape, generator=g) for k, v in weights.items()}


def tiny_target(group_size: int | None = None, **model_kw) -> Transformer:
    """tiny_engine's target alone, INT4 (RTN) with ``group_size`` when given. Module-level, so a
    ``functools.partial`` of it pickles into tensor-parallel worker processes."""
    cfg = tiny_config(**model_kw)
    target = Transformer.from_weights(cfg, random_weights(cfg))
    return target.quantize(group_size) if group_size else target


def act_order_target() -> Transformer:
    """tiny_target quantized by GPTQ with true act-order (``Linear.perm`` on qkv and gate_up), group 32.
    GPTQ's float sums depend on the thread count, so processes that must hold one model load it
    (``saved_target``) rather than quantize again."""
    dense = tiny_target()
    calib = torch.randint(0, dense.config.vocab_size, (8, 24), generator=torch.Generator().manual_seed(3)).tolist()
    return quantize_gptq(dense, calib, 32, act_order="perm", progress=False)


def saved_target(path: str) -> Transformer:
    """A model ``torch.save``d whole (module-level: a ``functools.partial`` of it pickles into workers)."""
    return torch.load(path, weights_only=False)


def tiny_engine(num_blocks: int = 64, page_size: int = 4, draft_noise: float = 0.3, self_layers: int = 2,
                max_running: int = 8, tree: tuple[int, ...] = (2, 2, 1), group_size: int | None = None,
                target=None, cost_aware: bool = False, cut_vocab: list[int] | None = None,
                batch_invariant: bool | None = None, **model_kw) -> Engine:
    """Target + drafters 'self' (first layers), 'ngram', 'exact' (the target itself: always accepted) and
    'draft' (a noisy copy: sometimes accepted). ``target`` replaces the target (a tensor-parallel one);
    the drafters are still built from the full weights. ``cost_aware`` is off by default: tests see tree
    shapes that depend on acceptance alone, not on this machine's timing. ``cut_vocab`` adds drafter 'cut':
    'draft' with its head cut to those token ids (FR-Spec, draft/vocab.py)."""
    cfg = tiny_config(**model_kw)
    w = random_weights(cfg)
    full = tiny_target(group_size, **model_kw)
    drafters = {
        "self": ModelDrafter("self", full.truncated(self_layers), num_blocks, page_size),
        "ngram": NgramDrafter(),
        "exact": ModelDrafter("exact", Transformer.from_weights(cfg, w), num_blocks, page_size),
        "draft": ModelDrafter("draft", Transformer.from_weights(cfg, noisy(w, draft_noise)), num_blocks, page_size),
    }
    if cut_vocab is not None:
        drafters["cut"] = ModelDrafter("cut", Transformer.from_weights(cfg, noisy(w, draft_noise)), num_blocks,
                                       page_size, head_vocab=torch.tensor(cut_vocab))
    ecfg = EngineConfig(num_blocks=num_blocks, page_size=page_size,
                        scheduler=SchedulerConfig(max_running=max_running, max_step_tokens=256, max_model_len=512,
                                                  budget=BudgetConfig(max_verify_tokens=1024, cost_aware=cost_aware)),
                        default_drafter="draft", default_tree=tree, batch_invariant=batch_invariant)
    return Engine(full if target is None else target, drafters, ecfg)


def run_all(engine: Engine, requests: list[tuple[str, list[int], object, object]]) -> dict[str, list[int]]:
    """Add (id, prompt, sampling, speculation) requests, step until all finish, return emitted tokens."""
    out: dict[str, list[int]] = {}
    for rid, prompt, sampling, spec in requests:
        engine.add(rid, prompt, sampling, spec)
        out[rid] = []
    finished: set[str] = set()
    while len(finished) < len(requests):
        outs = engine.step()
        for o in outs:
            out[o.request_id] += o.new_token_ids
            if o.finished:
                finished.add(o.request_id)
                assert o.error is None, o.error
    return out


def self_draft_engine(target: Transformer, cuda_graphs: bool = True, tokenizer=None) -> Engine:
    """An engine over ``target`` that drafts with its own first two layers, greedy tree 2,2,1, 256 blocks of 16
    (the CUDA engine tests' set-up)."""
    drafters = {"self": ModelDrafter("self", target.truncated(2), 256, 16)}
    return Engine(target, drafters, EngineConfig(256, 16, SchedulerConfig(max_model_len=512), "self", (2, 2, 1),
                                                 cuda_graphs=cuda_graphs), tokenizer=tokenizer)
