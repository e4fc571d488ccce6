"""Quantized checkpoints, repacked once at load into the kernel's INT4 layout (``kernels/int4_matmul.py``).

Three formats, told apart by ``config.json``'s ``quantization_config.quant_method``:

* ``specgate``: ours, written by ``save_quantized``. Per fused projection (``self_attn.qkv_proj``,
  ``self_attn.o_proj``, ``mlp.gate_up_proj``, ``mlp.down_proj``): ``qweight`` / ``scales`` / ``zeros``
  (absent when symmetric) / ``perm`` (absent unless imported from an act-order checkpoint or quantized by
  ``target.gptq`` with ``act_order="perm"``), exactly the kernel's tensors. Everything else is dense under its
  Hugging Face name.
* ``gptq`` (AutoGPTQ / GPTQModel): per projection ``qweight`` int32 ``[K/8, N]`` (already our packing),
  ``qzeros`` int32 ``[K/G, N/8]`` packed along N, ``scales`` fp16 ``[K/G, N]``, ``g_idx`` int32 ``[K]``.
  ``W[n, k] = (code - zero[g_idx[k], n]) * scale[g_idx[k], n]``. The classic v1 checkpoint format
  (``checkpoint_format`` "gptq", the default) stores ``zero - 1``; GPTQModel's "gptq_v2" stores ``zero``.
  We read v1 as the v1 kernels do: stored + 1 without wrapping, so a zero of 0 that was stored as the
  nibble 15 reads back as 16 (float zeros hold it exactly). Act-order checkpoints have an unsorted
  ``g_idx``: K is reordered so each group's columns are contiguous and the Linear gathers its input
  with ``perm`` instead (exact; the kernel has no g_idx).
* ``awq`` (AutoAWQ, GEMM version): ``qweight`` int32 ``[K, N/8]`` and ``qzeros`` int32 ``[K/G, N/8]`` packed
  along N in AWQ's interleaved order (nibble i of a word holds column ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of its
  eight), ``scales`` fp16 ``[K/G, N]``, zeros stored as is, ``W = (code - zero) * scale``.

Separate q/k/v (gate/up) projections are fused along N, which needs them to share K, group size and
``g_idx``; they do in every checkpoint these tools write, since the parts share one input. Scales are
cast to the load dtype: fp32 is exact, bf16 rounds fp16 scales (a relative 2^-9).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast

from kernels.int4_matmul import Int4Weight, pack_int4, unpack_int4
from target.config import ModelConfig
from target.loader import expected_weights, save_tokenizer
from target.model import Linear, Transformer

OUR_FORMAT = "specgate"
FORMAT_VERSION = 1
# Fused projection (our name) -> the checkpoint's separate projections, rows in this order.
PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: nibble i holds column AWQ_ORDER[i] of 8
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # argsort of AWQ_ORDER: where column j sits in the word


@dataclass(slots=True)
class Unpacked:
    """One projection's codes before fusing and repacking."""

    codes: torch.Tensor  # [N, K] int64 in 0..15
    scales: torch.Tensor  # [K/G, N] float32
    zeros: torch.Tensor  # [K/G, N] float32
    g_idx: torch.Tensor  # [K] int64 group of each input column


# --- reading --------------------------------------------------------------------------------------

def read_quantized(root: Path, files: dict[str, Path], config: ModelConfig, qcfg: dict[str, Any],
                   dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, Linear]]:
    """Dense HF-named weights (in ``dtype``) and fused INT4 projections of a quantized checkpoint directory.

    The projections stay on the CPU with scales as stored (fp32 after unpacking GPTQ / AWQ);
    ``Transformer.from_weights`` casts them to the model's dtype.
    """
    method = str(qcfg.get("quant_method", "")).lower()
    if method not in (OUR_FORMAT, "gptq", "awq"):
        raise ValueError(f"{root}: unsupported quant_method {method!r}: supported are gptq, awq and {OUR_FORMAT}")
    if int(qcfg.get("bits", 4)) != 4:
        raise ValueError(f"{root}: only 4-bit checkpoints are supported, this one has bits={qcfg.get('bits')}")
    if method == "awq" and str(qcfg.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"{root}: AWQ version {qcfg.get('version')!r} is not supported: only the GEMM packing")
    tensors = _read_all(files)
    used: set[str] = set()
    quantized: dict[str, Linear] = {}
    for i in range(config.num_layers):
        for fused, parts in PROJECTIONS.items():
            name = f"model.layers.{i}.{fused}"
            if method == OUR_FORMAT:
                quantized[name] = _our_projection(tensors, name, used)
            else:
                unpacked = [_unpack_part(tensors, f"model.layers.{i}.{p}", method, qcfg, used) for p in parts]
                quantized[name] = fuse_parts(unpacked, name)
    return _dense_weights(tensors, config, root, used, dtype), quantized


def _read_all(files: dict[str, Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(files.values())):
        with safe_open(str(file), framework="pt") as f:
            out.update((name, f.get_tensor(name)) for name in f.keys() if files.get(name) == file)
    return out


def _take(tensors: dict[str, torch.Tensor], name: str, used: set[str]) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"quantized checkpoint has no tensor {name!r}")
    used.add(name)
    return tensors[name]


def _dense_weights(tensors: dict[str, torch.Tensor], config: ModelConfig, root: Path, used: set[str],
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every expected tensor that is not a quantized projection weight, shape-checked; refuse leftovers."""
    wanted = {n: s for n, s in expected_weights(config).items()
              if not any(f".{p}.weight" in n for ps in PROJECTIONS.values() for p in ps)}
    weights: dict[str, torch.Tensor] = {}
    for name, shape in wanted.items():
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"{root}: checkpoint has no tensor {name!r}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{root}: tensor {name!r} has shape {tuple(t.shape)}, config implies {shape}")
        weights[name] = t.to(dtype)
    for name in tensors:
        if name not in wanted and name not in used and name != "lm_head.weight" and "rotary_emb" not in name:
            raise ValueError(f"{root}: unexpected tensor {name!r}: this model variant is not supported")
    return weights


def _unpack_part(tensors: dict[str, torch.Tensor], prefix: str, method: str, qcfg: dict[str, Any],
                 used: set[str]) -> Unpacked:
    """One GPTQ or AWQ projection -> codes, float scales and zeros, and its g_idx."""
    qweight = _take(tensors, prefix + ".qweight", used)
    qzeros = _take(tensors, prefix + ".qzeros", used)
    scales = _take(tensors, prefix + ".scales", used).float()  # [K/G, N]
    if method == "awq":
        codes = _awq_unpack(qweight).T  # [N, K]
        zeros = _awq_unpack(qzeros).float()  # [K/G, N]
        g_idx = None
    else:
        codes = unpack_int4(qweight)  # [N, K]: GPTQ packs K exactly as our layout does
        zeros = unpack_int4(qzeros.T.contiguous()).float()  # [K/G, N]: qzeros packs N the same way
        if str(qcfg.get("checkpoint_format", qcfg.get("format", "gptq"))).lower() != "gptq_v2":
            zeros = zeros + 1  # v1 stores zero - 1 (see the module docstring)
        g_idx = tensors.get(prefix + ".g_idx")
        used.add(prefix + ".g_idx")
    N, K = codes.shape
    if scales.shape[1] != N or zeros.shape != scales.shape or K % scales.shape[0]:
        raise ValueError(f"{prefix}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and "
                         f"scales {tuple(scales.shape)} do not agree")
    G = K // scales.shape[0]
    g_idx = torch.arange(K) // G if g_idx is None else g_idx.to(torch.int64)
    return Unpacked(codes, scales, zeros, g_idx)


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's ``[R, C/8]`` int32, packed along columns in AWQ_ORDER -> ``[R, C]`` int64 codes in column order."""
    R = packed.shape[0]
    by_nibble = unpack_int4(packed.T.contiguous())  # [R, C]: column 8c + i is nibble i of word c
    return by_nibble.view(R, -1, 8)[:, :, list(AWQ_REVERSE_ORDER)].reshape(R, -1)


def fuse_parts(parts: list[Unpacked], name: str) -> Linear:
    """Concatenate parts along N into one INT4 Linear, making groups contiguous along K when act-ordered."""
    g_idx = parts[0].g_idx
    if any(p.g_idx.shape != g_idx.shape or not torch.equal(p.g_idx, g_idx) for p in parts):
        raise ValueError(f"{name}: its parts have different g_idx (act-order permutations); they cannot share "
                         "one fused INT4 weight")
    codes = torch.cat([p.codes for p in parts])  # [N, K]
    scales = torch.cat([p.scales for p in parts], dim=1)  # [K/G, N]
    zeros = torch.cat([p.zeros for p in parts], dim=1)
    K, num_groups = codes.shape[1], scales.shape[0]
    G = K // num_groups
    perm = None
    if not torch.equal(g_idx, torch.arange(K) // G):
        perm = torch.argsort(g_idx, stable=True)  # [K]: column k of the repacked weight is input perm[k]
        if not torch.equal(g_idx[perm], torch.arange(K) // G):
            raise ValueError(f"{name}: g_idx does not give every group exactly {G} columns")
        codes = codes[:, perm]
    sym = bool((zeros == 8).all())  # the kernel's symmetric path (zero point 8) skips the zeros load
    return Linear(Int4Weight(pack_int4(codes), scales, None if sym else zeros, G), perm=perm)


def _our_projection(tensors: dict[str, torch.Tensor], name: str, used: set[str]) -> Linear:
    qweight = _take(tensors, name + ".qweight", used)  # [K/8, N] int32
    scales = _take(tensors, name + ".scales", used)  # [K/G, N]
    zeros = _take(tensors, name + ".zeros", used) if name + ".zeros" in tensors else None
    perm = _take(tensors, name + ".perm", used).to(torch.int64) if name + ".perm" in tensors else None
    K = qweight.shape[0] * 8
    bad_zeros = zeros is not None and zeros.shape != scales.shape
    if scales.shape[1] != qweight.shape[1] or K % scales.shape[0] or bad_zeros:
        raise ValueError(f"{name}: qweight {tuple(qweight.shape)} and scales {tuple(scales.shape)} do not agree")
    return Linear(Int4Weight(qweight, scales, zeros, K // scales.shape[0]), perm=perm)


# --- writing our format ---------------------------------------------------------------------------

def save_quantized(model: Transformer, out_dir: str | Path, tokenizer: PreTrainedTokenizerFast,
                   chat_template: str | None = None, meta: dict[str, Any] | None = None) -> Path:
    """Write an INT4 ``model`` (RTN or GPTQ) as a directory ``load_checkpoint`` reads back unchanged.

    ``meta`` (method, calibration settings) is recorded in ``quantization_config`` for the reader's benefit.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = model.config
    tensors = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm}
    if not c.tie_word_embeddings:
        tensors["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = layer.input_norm
        tensors[p + "post_attention_layernorm.weight"] = layer.post_norm
        for fused, lin in (("self_attn.qkv_proj", layer.qkv), ("self_attn.o_proj", layer.o),
                           ("mlp.gate_up_proj", layer.gate_up), ("mlp.down_proj", layer.down)):
            tensors.update(_projection_tensors(p + fused, lin, c))
    tensors = {n: t.detach().cpu().contiguous() for n, t in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    qcfg = {"quant_method": OUR_FORMAT, "bits": 4, "format_version": FORMAT_VERSION, **(meta or {})}
    (out / "config.json").write_text(json.dumps({**c.to_hf(), "quantization_config": qcfg}, indent=2) + "\n")
    save_tokenizer(tokenizer, chat_template, out)
    return out


def _projection_tensors(name: str, lin: Linear, c: ModelConfig) -> dict[str, torch.Tensor]:
    """One fused INT4 projection's tensors; its bias goes back under the separate HF names."""
    w = lin.weight
    if not isinstance(w, Int4Weight):
        raise ValueError(f"{name} is dense: quantize the model before save_quantized")
    out = {name + ".qweight": w.qweight, name + ".scales": w.scales}
    if w.zeros is not None:
        out[name + ".zeros"] = w.zeros
    if lin.perm is not None:
        out[name + ".perm"] = lin.perm
    if lin.bias is not None:  # only q/k/v carry biases in the families we load (Qwen2)
        if not name.endswith("qkv_proj"):
            raise ValueError(f"{name} has a bias, which the checkpoint format has no name for")
        rows = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        prefix = name.removesuffix("qkv_proj")
        out.update((f"{prefix}{x}_proj.bias", b) for x, b in zip("qkv", lin.bias.split(rows)))
    return out
