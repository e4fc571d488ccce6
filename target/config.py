"""Model configuration: the architecture facts our transformer needs, read from a HF config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# A feature draft's input projection (draft/feature_drafter.py): [hidden, 2 * hidden] over
# [token embedding, target feature]; the one tensor such a draft holds beyond a Llama layer stack.
FC_NAME = "fc.weight"

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_ARCHITECTURE_OF = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One decoder-only model. ``family`` is llama, mistral or qwen2; the rest mirror config.json."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # Llama-3 style {"rope_type": "llama3", ...} or None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name} must be positive, got {getattr(self, name)}")

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed config.json; names the architecture when it is not supported."""
        archs = cfg.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            family = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}.get(cfg.get("model_type", ""))
        if family is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}: "
                f"supported are {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):  # transformers >= 5 spelling
            rope_params = cfg["rope_parameters"]
            rope_theta = rope_params.get("rope_theta")
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        return ModelConfig(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf(self) -> dict[str, Any]:
        """The config.json dict that ``from_hf`` reads back to an equal ModelConfig (and transformers can load)."""
        eos: int | list[int] | None = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else (
            self.eos_token_ids[0] if self.eos_token_ids else None
        )
        cfg: dict[str, Any] = {
            "architectures": [_ARCHITECTURE_OF[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
        }
        if self.family != "qwen2":  # Qwen2 always has q/k/v biases and has no such key
            cfg["attention_bias"] = self.attention_bias
        return cfg
