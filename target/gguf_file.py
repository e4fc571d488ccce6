"""GGUF -> LoadedCheckpoint: llama.cpp metadata to a HF config dict, tensors dequantized and renamed to HF names.

``int4=True`` keeps Q4_0 / Q4_1 projection weights quantized instead: each 32-weight block is already the
INT4 kernel's group (``kernels/int4_matmul.py``), so it is repacked, not re-quantized. Q4_0 stores
``w = d * (q - 8)`` (our symmetric zero point 8); Q4_1 stores ``w = d * q + m``, which is our
``(q - z) * d`` with the fractional zero point ``z = -m / d``. Re-quantizing the dequantized file to our
own RTN grid instead loses what the file's grid had kept: on SmolLM2-135M-Instruct's Q4_1 file, RTN g128
raises perplexity 32% over the file's own weights (bench/results/quant_pydoc.json).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from transformers import PreTrainedTokenizerFast

from target.config import ModelConfig
from target.loader import LoadedCheckpoint, check_dtype, check_no_extra_tensors, expected_weights, select_weights
from target.model import Linear
from target.quant_formats import PROJECTIONS, Unpacked, fuse_parts

# general.architecture -> the HF class whose config.json keys we build
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# llama.cpp pre-tokenizers that isolate every digit before the GPT-2 split (llama-vocab.cpp); transformers'
# GGUF conversion does not know them all, and without the digit split numbers tokenize differently.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}


Q4_BLOCK = 32  # weights per Q4_0 / Q4_1 block
_Q4_BYTES = {gguf.GGMLQuantizationType.Q4_0: 18, gguf.GGMLQuantizationType.Q4_1: 20}  # fp16 d (, fp16 m), 16 nibble bytes


def q4_blocks(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, rows: int, cols: int) -> Unpacked:
    """A Q4_0 / Q4_1 tensor's raw bytes (``rows`` x ``cols`` weights, row-major) as INT4 codes, scales and zero
    points with ``w = (code - zero) * scale`` per 32-column group. Byte ``j`` of a block holds weight ``j`` in
    its low nibble and weight ``j + 16`` in its high nibble (ggml's block_q4_0 / block_q4_1)."""
    nbytes = _Q4_BYTES[qtype]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // Q4_BLOCK, nbytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, groups]
    qs = blocks[..., nbytes - 16 :]
    codes = np.concatenate((qs & 0x0F, qs >> 4), axis=-1).astype(np.int64)  # [rows, groups, 32]
    if qtype == gguf.GGMLQuantizationType.Q4_0:
        zero = np.full_like(d, 8.0)
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        flat = d == 0  # every weight of the block is m: code 1, zero 0, scale m gives exactly that
        zero = np.where(flat, 0.0, -m / np.where(flat, 1.0, d)).astype(np.float32)
        d = np.where(flat, m, d)
        codes[flat] = 1
    return Unpacked(torch.from_numpy(codes.reshape(rows, cols)), torch.from_numpy(d.T.copy()),
                    torch.from_numpy(zero.T.copy()), torch.arange(cols) // Q4_BLOCK)


def load_gguf(path: Path, dtype: torch.dtype = torch.float32, int4: bool = False) -> LoadedCheckpoint:
    """Dequantize every tensor of a llama/qwen2 GGUF to ``dtype`` and rebuild its tokenizer from the metadata.
    ``int4``: fused projections whose parts are all Q4_0 / Q4_1 come back as INT4 ``quantized`` Linears instead
    (the blocks repacked as they are, see the module's docstring)."""
    check_dtype(dtype)
    reader = gguf.GGUFReader(str(path))
    meta = _metadata(reader)
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}  # ne order is reversed
    config = ModelConfig.from_hf(gguf_config_dict(meta, shapes))
    names = {t.name: hf_tensor_name(t.name) or "" for t in reader.tensors}  # GGUF name -> HF name
    unknown = [name for name, hf_name in names.items() if not hf_name]
    if unknown:
        raise ValueError(f"{path}: unexpected GGUF tensor {unknown[0]!r}: this model variant is not supported")
    check_no_extra_tensors(names.values(), config, path)
    by_hf = {names[t.name]: t for t in reader.tensors}
    quantized: dict[str, Linear] = {}
    kept: set[str] = set()  # HF names of the projection weights kept quantized
    for i in range(config.num_layers if int4 else 0):
        for fused, parts in PROJECTIONS.items():
            hf = [f"model.layers.{i}.{part}.weight" for part in parts]
            if not all(by_hf[n].tensor_type in _Q4_BYTES for n in hf):
                continue  # an F16 / Q8_0 / K-quant part: the whole projection goes the dense way
            unpacked = []
            for n in hf:
                rows, cols = shapes[by_hf[n].name]
                u = q4_blocks(by_hf[n].data, by_hf[n].tensor_type, rows, cols)
                # llama's q/k rows are permuted in the file: undo it on the codes and on each row's groups
                unpacked.append(Unpacked(_undo_rotary_permute(n, u.codes, config),
                                         _undo_rotary_permute(n, u.scales.T, config).T.contiguous(),
                                         _undo_rotary_permute(n, u.zeros.T, config).T.contiguous(), u.g_idx))
            quantized[f"model.layers.{i}.{fused}"] = fuse_parts(unpacked, fused)
            kept.update(hf)
    found: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = names[tensor.name]
        if name in kept:
            continue
        # dequantize gives float32 in torch (row-major) order; copy because the reader's memmap is read-only
        value = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        found[name] = _undo_rotary_permute(name, value, config).to(dtype)
    wanted = {n: shape for n, shape in expected_weights(config).items() if n not in kept}
    weights = select_weights(found, config, path, wanted)
    chat_template = meta.get("tokenizer.chat_template")
    tokenizer = _gguf_tokenizer(path, meta)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.model_max_length = config.max_position_embeddings  # the GGUF tokenizer otherwise has no limit
    return LoadedCheckpoint(config, weights, tokenizer, chat_template, str(path), quantized)


def hf_tensor_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for tensors we do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _BLOCK_NAMES:
        return None
    return f"model.layers.{match[1]}.{_BLOCK_NAMES[match[2]]}.{match[3]}"


def rotary_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's convert permutation of q/k rows: per head, HF's [first half | second half] -> interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rotary_unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of ``rotary_permute``: interleaved (GPT-J) rotary pairs back to HF's rotate_half layout."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _undo_rotary_permute(name: str, w: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    # Only the llama converter permutes (weights and biases alike); qwen2 GGUFs use NEOX rope and keep HF order.
    if config.family == "qwen2":
        return w
    if ".self_attn.q_proj." in name:
        return rotary_unpermute(w, config.num_heads)
    if ".self_attn.k_proj." in name:
        return rotary_unpermute(w, config.num_kv_heads)
    return w


def _metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Scalar and string fields; arrays (token lists, merges) are left to the tokenizer conversion."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not field.types or field.types[0] == gguf.GGUFValueType.ARRAY or not field.data:
            continue
        part = field.parts[field.data[0]]
        kind = field.types[0]
        if kind == gguf.GGUFValueType.STRING:
            meta[key] = bytes(part).decode("utf-8")
        elif kind == gguf.GGUFValueType.FLOAT32:
            meta[key] = float(str(part[0]))  # shortest float32 spelling: 1e-05, not 9.999999747378752e-06
        else:
            meta[key] = part.tolist()[0]
    return meta


def gguf_config_dict(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """A config.json-style dict from ``<arch>.*`` metadata; ``shapes`` (torch order) fill what metadata omits."""
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}: supported are {sorted(_ARCHITECTURES)}")

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ValueError(f"GGUF metadata has no {arch}.{key}")
        return meta[f"{arch}.{key}"]

    if "token_embd.weight" not in shapes:
        raise ValueError("GGUF has no token_embd.weight tensor")
    if "rope_freqs.weight" in shapes:
        raise ValueError("GGUF stores Llama-3.1 rope scaling as a rope_freqs tensor, which cannot be mapped back to "
                         "rope_scaling: load the Hugging Face directory instead")
    heads = need("attention.head_count")
    hf_arch = _ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        hf_arch = "MistralForCausalLM"  # llama.cpp files Mistral under llama; transformers tells them apart by name
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    return {
        "architectures": [hf_arch],
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": need("embedding_length"),
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": meta.get(f"{arch}.attention.key_length") or need("embedding_length") // heads,
        "max_position_embeddings": meta.get(f"{arch}.context_length", 2048),
        "rms_norm_eps": meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta, arch),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(dict.fromkeys(eos)) or None,
    }


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (only none and linear)")


def _gguf_tokenizer(path: Path, meta: dict[str, Any]) -> PreTrainedTokenizerFast:
    """transformers' GGUF tokenizer conversion (offline: the file is local), plus llama.cpp's digit split."""
    if "tokenizer.ggml.model" not in meta:
        raise ValueError(f"{path} carries no tokenizer (no tokenizer.ggml.* metadata)")
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except (KeyError, ValueError, NotImplementedError) as exc:
        raise ValueError(f"cannot build a tokenizer from the GGUF metadata of {path}: {exc}") from exc
    if meta["tokenizer.ggml.model"] == "gpt2" and meta.get("tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE:
        from tokenizers import pre_tokenizers

        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    return tokenizer
