"""The Python API: load a target (and drafters), then ``generate(prompts, sampling, speculation)``.

``build_engine`` is shared by the CLI, the HTTP server and the benchmarks, so every entry point loads
models, quantizes and sizes caches the same way.
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draft.base import Drafter
from draft.model_drafter import ModelDrafter
from draft.ngram import NgramDrafter
from draft.params import DEFAULT_TREE, SpeculationParams
from gateway.engine import Engine, EngineConfig, RequestOutput
from gateway.scheduler import SchedulerConfig
from gateway.sequence import SpecStats
from target.loader import LoadedCheckpoint, load_checkpoint
from target.model import Transformer
from verify.sampling import SamplingParams

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """Where models come from and how they are prepared; one per server / CLI run."""

    model: str | None = None  # HF directory or .gguf; None = the embedded SmolLM2-135M-Instruct
    draft: str = "self"  # default drafter: "self", "ngram", "none", or a draft model's directory / .gguf
    self_draft_layers: int | None = None  # None = two thirds of the target's layers
    quantize: str = "int4"  # "int4" (W4A16 RTN) or "none"
    group_size: int = 128
    dtype: str | None = None  # None = bfloat16 on CUDA, float32 on CPU
    device: str | None = None  # None = cuda when available
    cache_dir: str | None = None  # where the embedded model is converted and kept

    def __post_init__(self) -> None:
        if self.quantize not in ("int4", "none"):
            raise ValueError(f"quantize must be 'int4' or 'none', got {self.quantize!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.group_size not in (32, 64, 128):
            raise ValueError(f"group_size must be 32, 64 or 128, got {self.group_size}")


@dataclass(slots=True)
class Loaded:
    engine: Engine
    checkpoint: LoadedCheckpoint
    model_name: str


def resolve_model_path(cfg: LoadConfig) -> Path:
    if cfg.model is not None:
        return Path(cfg.model).expanduser()
    from target.embedded import default_model_dir

    return default_model_dir(Path(cfg.cache_dir) if cfg.cache_dir else None)


def build_engine(cfg: LoadConfig, engine_cfg: EngineConfig | None = None, log=print) -> Loaded:
    """Load, quantize and wire the target and its drafters. Errors name the bad path or option."""
    if cfg.draft not in ("self", "ngram", "none") and not Path(cfg.draft).expanduser().exists():
        raise ValueError(f"unknown drafter {cfg.draft!r}: use self, ngram, none, or a draft model directory / .gguf")
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[cfg.dtype] if cfg.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    path = resolve_model_path(cfg)
    t0 = time.perf_counter()
    ckpt = load_checkpoint(path, dtype)
    target = Transformer.from_weights(ckpt.config, ckpt.weights, dtype, device)
    log(f"loaded {path.name}: {ckpt.config.num_layers} layers, vocab {ckpt.config.vocab_size} "
        f"({time.perf_counter() - t0:.1f}s)")
    if cfg.quantize == "int4":
        t0 = time.perf_counter()
        target = target.quantize(cfg.group_size)
        log(f"quantized to INT4 W4A16, group {cfg.group_size} ({time.perf_counter() - t0:.1f}s)")
    engine_cfg = engine_cfg or EngineConfig()
    drafters: dict[str, Drafter] = {"ngram": NgramDrafter()}
    # Untrained early exits predict poorly: on SmolLM2 a quarter of the layers accepts ~1.05 tokens per step,
    # two thirds ~1.3 (bench/results/drafters.json). A distilled draft replaces this default.
    layers = cfg.self_draft_layers or max(1, (2 * target.num_layers) // 3)
    drafters["self"] = ModelDrafter("self", target.truncated(layers), engine_cfg.num_blocks, engine_cfg.page_size)
    default = cfg.draft
    if cfg.draft not in ("self", "ngram", "none"):
        drafters["draft"] = _load_draft_model(cfg.draft, ckpt, dtype, device, engine_cfg)
        default = "draft"
    engine_cfg = EngineConfig(engine_cfg.num_blocks, engine_cfg.page_size, engine_cfg.scheduler,
                              None if default == "none" else default, engine_cfg.default_tree)
    return Loaded(Engine(target, drafters, engine_cfg), ckpt, path.name)


def _load_draft_model(path: str, target_ckpt: LoadedCheckpoint, dtype: torch.dtype, device: torch.device,
                      engine_cfg: EngineConfig) -> ModelDrafter:
    ck = load_checkpoint(path, dtype)
    if ck.config.vocab_size != target_ckpt.config.vocab_size or ck.tokenizer.get_vocab() != target_ckpt.tokenizer.get_vocab():
        raise ValueError(f"draft model {path} does not share the target's tokenizer")
    model = Transformer.from_weights(ck.config, ck.weights, dtype, device)
    return ModelDrafter("draft", model, engine_cfg.num_blocks, engine_cfg.page_size)


@dataclass(slots=True)
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: SpecStats
    prompt_tokens: int
    seconds: float = 0.0
    error: str | None = None


@dataclass(slots=True)
class LLM:
    """Synchronous front end over one ``Engine``: the caller's thread runs the steps."""

    loaded: Loaded
    chat: bool = True  # apply the tokenizer's chat template to string prompts
    outputs: dict[str, list[int]] = field(default_factory=dict)

    @staticmethod
    def load(cfg: LoadConfig = LoadConfig(), engine_cfg: EngineConfig | None = None, log=print) -> "LLM":
        return LLM(build_engine(cfg, engine_cfg, log))

    @property
    def engine(self) -> Engine:
        return self.loaded.engine

    def encode(self, prompt: str) -> list[int]:
        if not prompt:
            raise ValueError("prompt is empty")
        tok = self.loaded.checkpoint.tokenizer
        if self.chat and self.loaded.checkpoint.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True, chat_template=self.loaded.checkpoint.chat_template)
            return tok.encode(text, add_special_tokens=False)
        return tok.encode(prompt)

    def generate(self, prompts: list[str] | list[list[int]], sampling: SamplingParams = SamplingParams(),
                 speculation: SpeculationParams = SpeculationParams()) -> list[Generation]:
        """Run all prompts to completion in one continuous batch; results in prompt order."""
        ids = [p if isinstance(p, list) else self.encode(p) for p in prompts]
        rids = [uuid.uuid4().hex for _ in ids]
        try:
            for rid, p in zip(rids, ids):
                self.engine.add(rid, p, sampling, speculation)
        except Exception:  # one bad prompt queues nothing
            for rid in rids:
                self.engine.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        toks: dict[str, list[int]] = {r: [] for r in rids}
        t0 = time.perf_counter()
        while len(done) < len(rids):
            for out in self.engine.step():
                toks[out.request_id] += out.new_token_ids
                if out.finished:
                    done[out.request_id] = out
        secs = time.perf_counter() - t0
        tok = self.loaded.checkpoint.tokenizer
        return [Generation(tok.decode(toks[r], skip_special_tokens=True), toks[r], done[r].finish_reason,
                           done[r].stats, done[r].prompt_tokens, secs, done[r].error) for r in rids]


def log_stderr(msg: str) -> None:
    print(msg, file=sys.stderr)
