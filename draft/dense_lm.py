"""A plain, differentiable Llama-family LM over padded ``[B, T]`` batches, for distillation only.

The serving ``Transformer`` is an inference-mode forward over the paged cache; training needs autograd
and whole sequences, so this module re-states the same maths (``rms_norm``, ``apply_rope`` and
``rope_inv_freq`` are shared with ``target/model.py``) with HF parameter names. It plays both roles: the
frozen teacher (all target layers) and the student (a few layers), so ``state_dict`` exports straight to
a checkpoint that ``load_checkpoint`` reads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from target.config import FC_NAME, ModelConfig
from kernels.fused_norm_rope import apply_rope
from kernels.fused_norm_rope import rms_norm_ref as rms_norm
from target.loader import LoadedCheckpoint, attach_shared_embeddings, load_checkpoint
from target.model import rope_inv_freq

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Suffix -> shape of one decoder layer's tensors (HF names, no biases: Llama / Mistral)."""
    hid, D, I = config.hidden_size, config.head_dim, config.intermediate_size
    return {
        "input_layernorm.weight": (hid,), "post_attention_layernorm.weight": (hid,),
        "self_attn.q_proj.weight": (config.num_heads * D, hid), "self_attn.k_proj.weight": (config.num_kv_heads * D, hid),
        "self_attn.v_proj.weight": (config.num_kv_heads * D, hid), "self_attn.o_proj.weight": (hid, config.num_heads * D),
        "mlp.gate_proj.weight": (I, hid), "mlp.up_proj.weight": (I, hid), "mlp.down_proj.weight": (hid, I),
    }


class DenseLM(nn.Module):
    """Trainable layers and final norm; embedding and LM head are frozen buffers (shared with the target)."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, head: torch.Tensor | None,
                 feature: bool = False) -> None:
        super().__init__()
        if config.attention_bias:
            raise ValueError("distillation supports bias-free (Llama / Mistral) targets only")
        self.config = config
        self.register_buffer("embed", embed, persistent=False)  # [V, hidden], frozen
        self.register_buffer("head", embed if head is None else head, persistent=False)  # [V, hidden], frozen
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)  # [D / 2]
        # Parameter names are the HF names with "." -> "__" (nn.ParameterDict keys cannot hold dots).
        self.params = nn.ParameterDict()
        for i in range(config.num_layers):
            for suffix, shape in layer_shapes(config).items():
                self.params[f"model.layers.{i}.{suffix}".replace(".", "__")] = nn.Parameter(torch.zeros(shape))
        self.params["model__norm__weight"] = nn.Parameter(torch.ones(config.hidden_size))
        if feature:  # a feature draft's input projection (draft/feature_drafter.py)
            self.params[FC_NAME.replace(".", "__")] = nn.Parameter(torch.zeros(config.hidden_size, 2 * config.hidden_size))
        self.feature = feature

    def p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "__")]

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """HF name -> tensor of every trainable weight (embedding and head excluded)."""
        return {k.replace("__", "."): v.detach() for k, v in self.params.items()}

    def load_hf(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, t in weights.items():
                self.p(name).copy_(t)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        """tokens ``[B, T]`` int64 (right-padded) -> logits ``[B, T, V]`` float32, causal. A feature draft also
        takes ``features`` ``[B, T, hidden]`` (the target's feature of the position before each token)."""
        return self.forward_hidden(tokens, features)[0]

    def forward_hidden(self, tokens: torch.Tensor,
                       features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and the final-normed hidden state ``[B, T, hidden]`` (the feature the LM head reads)."""
        c = self.config
        B, T = tokens.shape
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        freqs = torch.arange(T, dtype=torch.float32, device=tokens.device)[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        cos, sin = emb.cos(), emb.sin()
        h = self.embed[tokens]  # [B, T, hidden]
        if self.feature:
            if features is None:
                raise ValueError("a feature draft needs the target's features")
            h = F.linear(torch.cat((h, features.to(h.dtype)), dim=-1), self.p(FC_NAME))
        for i in range(c.num_layers):
            w = lambda s: self.p(f"model.layers.{i}.{s}.weight")  # noqa: E731
            x = rms_norm(h, w("input_layernorm"), c.rms_norm_eps)
            q = apply_rope(F.linear(x, w("self_attn.q_proj")).view(B, T, H, D), cos, sin)  # [B, T, H, D]
            k = apply_rope(F.linear(x, w("self_attn.k_proj")).view(B, T, Hkv, D), cos, sin)  # [B, T, Hkv, D]
            v = F.linear(x, w("self_attn.v_proj")).view(B, T, Hkv, D)
            k, v = (t.repeat_interleave(H // Hkv, dim=2) for t in (k, v))  # [B, T, H, D]
            attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True, scale=1.0 / math.sqrt(D))  # [B, H, T, D]
            h = h + F.linear(attn.transpose(1, 2).reshape(B, T, H * D), w("self_attn.o_proj"))
            x = rms_norm(h, w("post_attention_layernorm"), c.rms_norm_eps)
            h = h + F.linear(F.silu(F.linear(x, w("mlp.gate_proj"))) * F.linear(x, w("mlp.up_proj")), w("mlp.down_proj"))
        hn = rms_norm(h, self.p("model.norm.weight"), c.rms_norm_eps)
        return F.linear(hn, self.head).float(), hn  # [B, T, V], [B, T, hidden]


def teacher_from_checkpoint(config: ModelConfig, weights: dict[str, torch.Tensor]) -> DenseLM:
    """The whole checkpoint as a frozen ``DenseLM`` (float32): the target as a teacher, or a saved draft
    (a feature draft when ``weights`` hold ``fc.weight``) with the target's embedding attached."""
    head = None if config.tie_word_embeddings else weights.get(HEAD)
    model = DenseLM(config, weights[EMBED].float(), None if head is None else head.float(), FC_NAME in weights)
    model.load_hf({k: v.float() for k, v in weights.items() if k not in (EMBED, HEAD)})
    return model.requires_grad_(False).eval()


def draft_from_checkpoint(path: str, target: LoadedCheckpoint) -> DenseLM:
    """A saved draft of ``target`` as a frozen float32 ``DenseLM``, the target's embedding and head attached
    when the draft shares them."""
    ck = load_checkpoint(path, torch.float32)
    attach_shared_embeddings(ck, target)
    return teacher_from_checkpoint(ck.config, ck.weights)


def pick_layers(num_target: int, num_draft: int) -> list[int]:
    """Target layers that initialise the draft: evenly spread, first and last included (the last layer
    already writes the features the shared norm and head read; cf. layer-skip self-drafts)."""
    if num_draft == 1:
        return [num_target - 1]
    return [round(i * (num_target - 1) / (num_draft - 1)) for i in range(num_draft)]


def student_from_teacher(teacher: DenseLM, draft_config: ModelConfig, feature: bool = False,
                         seed: int = 0) -> DenseLM:
    """A ``draft_config``-shaped student initialised from the teacher's layers (MLP rows sliced when the
    draft's intermediate size is smaller), sharing the teacher's frozen embedding and head. A feature
    student's ``fc`` starts by passing the feature through, plus a small random share of the embedding."""
    tc = teacher.config
    student = DenseLM(draft_config, teacher.embed, None if tc.tie_word_embeddings else teacher.head, feature)
    I = draft_config.intermediate_size
    init: dict[str, torch.Tensor] = {"model.norm.weight": teacher.p("model.norm.weight")}
    for j, i in enumerate(pick_layers(tc.num_layers, draft_config.num_layers)):
        for suffix in layer_shapes(tc):
            t = teacher.p(f"model.layers.{i}.{suffix}")
            t = t[:I] if suffix in ("mlp.gate_proj.weight", "mlp.up_proj.weight") else t
            t = t[:, :I] if suffix == "mlp.down_proj.weight" else t
            init[f"model.layers.{j}.{suffix}"] = t
    if feature:
        H = tc.hidden_size
        g = torch.Generator().manual_seed(seed)
        init[FC_NAME] = torch.cat([torch.randn(H, H, generator=g) * H**-0.5 * 0.1, torch.eye(H)], dim=1)
    student.load_hf(init)
    return student
