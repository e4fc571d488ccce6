"""Tiny checkpoints for the loader tests: random HF models, a byte-level BPE tokenizer, and GGUF files of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB_SIZE = 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_vocab() -> tuple[list[str], list[tuple[str, str]]]:
    """128 byte-level BPE tokens (specials, printable ASCII with space as Ġ, some merges) and their merges."""
    tokens = SPECIALS + ["Ġ"] + [chr(c) for c in range(33, 127)]
    merges = [("H", "e"), ("l", "l"), ("He", "ll"), ("Hell", "o"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"), ("l", "d"),
              ("Ġwor", "ld")]
    merges += [("a", c) for c in "bcdefghijklmnopqrstuvwxyz"][: VOCAB_SIZE - len(tokens) - len(merges)]
    tokens += [a + b for a, b in merges]
    assert len(tokens) == VOCAB_SIZE
    return tokens, merges


def write_tokenizer(root: Path, template_in: str = "config") -> None:
    """tokenizer.json + tokenizer_config.json; the chat template goes in the config or in chat_template.jinja."""
    tokens, merges = tiny_vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[1], "eos_token": SPECIALS[2]}
    if template_in == "config":
        cfg["chat_template"] = CHAT_TEMPLATE
    else:
        (root / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))


def randomize(model: PreTrainedModel, seed: int = 0) -> PreTrainedModel:
    """Fill every parameter (biases and norms too, which HF initialises to constants) with distinct values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


_TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB_SIZE, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
_FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def tiny_model(family: str = "llama", **overrides: object) -> PreTrainedModel:
    config_cls, model_cls = _FAMILIES[family]
    return randomize(model_cls(config_cls(**{**_TINY, **overrides})))


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, written out independently of the loader."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_BLOCK[module]}.{kind}"


def write_gguf(path: Path, model: PreTrainedModel, arch: str = "llama",
               quant: dict[str, "gguf.GGMLQuantizationType"] | None = None) -> Path:
    """What llama.cpp's converter writes for ``model``: F32 tensors, q/k permuted for llama, gpt2 tokenizer.
    ``quant``: module name (``self_attn.q_proj``, ``mlp.down_proj``, ...) -> the type its weights are stored
    in, encoded by gguf-py's own quantizer (llama.cpp's reference rounding)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}  # transformers 5 vs 4 spelling
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    tokens, merges = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    tied = cfg.tie_word_embeddings
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        array = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in hf_name:
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        module = hf_name.split(".", 3)[-1].rsplit(".", 1)[0] if hf_name.startswith("model.layers.") else ""
        qtype = (quant or {}).get(module) if hf_name.endswith(".weight") else None
        if qtype is None:
            w.add_tensor(gguf_name(hf_name), array)
        else:
            w.add_tensor(gguf_name(hf_name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def make_model() -> Callable[..., PreTrainedModel]:
    """``make_model(family="llama", **config_overrides)``: a tiny random HF causal LM."""
    return tiny_model


@pytest.fixture
def make_hf_dir(tmp_path: Path) -> Callable[..., Path]:
    """``make_hf_dir(model, name="hf", template_in="config", **save_pretrained_kwargs)``: model + tokenizer on disk."""

    def make(model: PreTrainedModel, name: str = "hf", template_in: str = "config", **save_kwargs: object) -> Path:
        root = tmp_path / name
        model.save_pretrained(str(root), **save_kwargs)
        write_tokenizer(root, template_in)
        return root

    return make


@pytest.fixture
def make_gguf(tmp_path: Path) -> Callable[..., Path]:
    """``make_gguf(model, arch="llama", name="tiny.gguf", quant=None)``: the model as llama.cpp would convert it
    (``quant``: see ``write_gguf``)."""

    def make(model: PreTrainedModel, arch: str = "llama", name: str = "tiny.gguf",
             quant: dict[str, gguf.GGMLQuantizationType] | None = None) -> Path:
        return write_gguf(tmp_path / name, model, arch, quant)

    return make


@pytest.fixture
def chat_template() -> str:
    return CHAT_TEMPLATE
