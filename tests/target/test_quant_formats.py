"""target/quant_formats.py: GPTQ and AWQ checkpoints written here by independent packers (each format's
published packing loops, in NumPy), and our own format's round trip. Loading must reproduce exactly the
weights each format's spec dequantizes to."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from kernels.int4_matmul import dequantize
from target.batch import Segment, build_batch
from target.loader import load_checkpoint
from target.model import Transformer
from target.quant_formats import save_quantized

G = 32  # the tiny models' K (64 and 96) are multiples of it
PARTS = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
         "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantize_groups(w: np.ndarray, g_idx: np.ndarray, sym: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Min-max INT4 of ``w [N, K]``, column k in group g_idx[k]: codes [N, K]; fp16 scales, int zeros [K/G, N]."""
    N, K = w.shape
    scales, zeros = np.zeros((K // G, N), np.float16), np.zeros((K // G, N), np.int64)
    codes = np.zeros((N, K), np.int64)
    for g in range(K // G):
        cols = np.nonzero(g_idx == g)[0]
        block = w[:, cols]
        if sym:
            scale, zero = np.abs(block).max(1) / 7, np.full(N, 8)
        else:
            lo, hi = np.minimum(block.min(1), 0), np.maximum(block.max(1), 0)
            scale = (hi - lo) / 15
            zero = np.clip(np.round(-lo / scale), 1, 15).astype(np.int64)  # >= 1: v1 cannot store 0 (see below)
        scales[g] = scale.astype(np.float16)
        zeros[g] = zero
        s = scales[g].astype(np.float32)[:, None]
        codes[:, cols] = np.clip(np.round(block / s + zero[:, None]), 0, 15)
    return codes, scales, zeros


def spec_dequant(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, g_idx: np.ndarray) -> torch.Tensor:
    """``W[n, k] = (code - zero[g_idx[k], n]) * scale[g_idx[k], n]`` in float32."""
    z, s = zeros[g_idx].T.astype(np.float32), scales[g_idx].T.astype(np.float32)
    return torch.from_numpy((codes.astype(np.float32) - z) * s)


def gptq_pack(codes: np.ndarray, zeros: np.ndarray, v1: bool) -> tuple[np.ndarray, np.ndarray]:
    """AutoGPTQ QuantLinear.pack: qweight [K/8, N] packs 8 rows of K per word; qzeros [K/G, N/8] packs 8
    columns of N per word, storing zero - 1 in the v1 format."""
    intweight = codes.T.astype(np.uint32)  # [K, N]
    qweight = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(8):
            qweight[row] |= intweight[row * 8 + j] << (4 * j)
    stored = ((zeros - 1) if v1 else zeros).astype(np.uint32) & 0xF
    qzeros = np.zeros((stored.shape[0], stored.shape[1] // 8), np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(8):
            qzeros[:, col] |= stored[:, col * 8 + j] << (4 * j)
    return qweight.view(np.int32), qzeros.view(np.int32)


def awq_pack(intweight: np.ndarray) -> np.ndarray:
    """AutoAWQ WQLinear_GEMM.from_linear: [R, C] codes -> [R, C/8] int32, nibble i = column AWQ_PACK_ORDER[i]."""
    packed = np.zeros((intweight.shape[0], intweight.shape[1] // 8), np.uint32)
    for col in range(packed.shape[1]):
        for i in range(8):
            packed[:, col] |= intweight[:, col * 8 + AWQ_PACK_ORDER[i]].astype(np.uint32) << (4 * i)
    return packed.view(np.int32)


def write_quantized_dir(root: Path, model: PreTrainedModel, fmt: str, sym: bool = False, act_order: bool = False,
                        v1: bool = True) -> dict[str, torch.Tensor]:
    """Turn ``root`` (``model`` saved with its tokenizer) into a GPTQ or AWQ checkpoint of it; return the
    spec-dequantized weight of every projection, by HF module name."""
    tensors, expected = {}, {}
    for name, p in model.state_dict().items():
        proj = name.removesuffix(".weight")
        if not name.endswith("_proj.weight"):
            tensors[name] = p.contiguous()
            continue
        w = p.float().numpy()
        K = w.shape[1]
        # act-order: column perm[j] is visited j-th, so its group is j // G (AutoGPTQ's g_idx); one
        # permutation per input, since q/k/v (gate/up) share their Hessian
        perm = np.random.default_rng(K).permutation(K) if act_order else np.arange(K)
        g_idx = np.empty(K, np.int64)
        g_idx[perm] = np.arange(K) // G
        codes, scales, zeros = quantize_groups(w, g_idx, sym)
        expected[proj] = spec_dequant(codes, scales, zeros, g_idx)
        if fmt == "gptq":
            qweight, qzeros = gptq_pack(codes, zeros, v1)
            tensors[proj + ".g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        else:
            qweight, qzeros = awq_pack(codes.T), awq_pack(zeros)
        tensors.update({proj + ".qweight": torch.from_numpy(qweight), proj + ".qzeros": torch.from_numpy(qzeros),
                        proj + ".scales": torch.from_numpy(scales)})
    save_file(tensors, str(root / "model.safetensors"))  # replaces the dense weights
    qcfg = ({"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": act_order, "sym": sym,
             "checkpoint_format": "gptq" if v1 else "gptq_v2"} if fmt == "gptq"
            else {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True, "version": "gemm"})
    cfg = {**model.config.to_dict(), "quantization_config": qcfg}
    (root / "config.json").write_text(json.dumps(cfg))
    return expected


def logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(8, 4)
    return model.forward(build_batch([Segment(cache.new_table(), 0, ids, logits="all")], cache, "cpu"), cache)


def effective_weight(lin) -> torch.Tensor:
    """The [N, K] weight a Linear applies to its un-permuted input."""
    w = dequantize(lin.weight).float()
    if lin.perm is None:
        return w
    out = torch.empty_like(w)
    out[:, lin.perm] = w
    return out


def check_loaded(root: Path, model: PreTrainedModel, expected: dict[str, torch.Tensor], sym: bool) -> Transformer:
    ckpt = load_checkpoint(root)
    cfg = ckpt.config
    assert len(ckpt.quantized) == 4 * cfg.num_layers
    for i in range(cfg.num_layers):
        for fused, parts in PARTS.items():
            prefix = f"model.layers.{i}.{fused.split('.')[0]}."
            lin = ckpt.quantized[f"model.layers.{i}.{fused}"]
            assert (lin.weight.zeros is None) == sym
            assert torch.equal(effective_weight(lin), torch.cat([expected[prefix + p] for p in parts]))
    q = Transformer.from_weights(cfg, ckpt.weights, quantized=ckpt.quantized)
    dense = {k: v for k, v in model.state_dict().items()}
    dense.update({k + ".weight": v for k, v in expected.items()})
    ids = [3, 17, 40, 5, 99, 12]
    torch.testing.assert_close(logits(q, ids), logits(Transformer.from_weights(cfg, dense), ids), rtol=1e-4, atol=1e-4)
    return q


@pytest.mark.parametrize(("family", "sym", "act_order", "v1"), [
    ("llama", False, False, True),
    ("llama", True, False, True),
    ("qwen2", False, False, False),
    ("llama", False, True, True),
    ("llama", True, True, False),
])
def test_gptq_checkpoint_loads_exactly(make_model, make_hf_dir, family: str, sym: bool, act_order: bool,
                                       v1: bool) -> None:
    model = make_model(family)
    root = make_hf_dir(model)
    q = check_loaded(root, model, write_quantized_dir(root, model, "gptq", sym, act_order, v1), sym)
    assert (q.layers[0].qkv.perm is not None) == act_order


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_awq_checkpoint_loads_exactly(make_model, make_hf_dir, family: str) -> None:
    model = make_model(family)
    root = make_hf_dir(model)
    check_loaded(root, model, write_quantized_dir(root, model, "awq"), sym=False)


def test_gptq_v1_zero_of_zero_reads_as_sixteen(make_model, make_hf_dir) -> None:
    """v1 stores zero - 1 in a nibble: a zero of 0 wraps to 15 and the v1 kernels read it back as 16."""
    model = make_model("llama")
    root = make_hf_dir(model)
    write_quantized_dir(root, model, "gptq")
    tensors = load_file(str(root / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.qzeros"
    tensors[name][0, 0] = (tensors[name][0, 0] & ~0xF) | 0xF  # column 0, group 0: stored nibble 15
    save_file(tensors, str(root / "model.safetensors"))
    lin = load_checkpoint(root).quantized["model.layers.0.mlp.down_proj"]
    assert float(lin.weight.zeros[0, 0]) == 16.0


def test_mismatched_act_order_and_unknown_tensors_are_refused(make_model, make_hf_dir) -> None:
    model = make_model("llama")
    root = make_hf_dir(model)
    write_quantized_dir(root, model, "gptq", act_order=True)
    original = load_file(str(root / "model.safetensors"))
    broken = {**original, "model.layers.0.self_attn.k_proj.g_idx": torch.arange(64, dtype=torch.int32) // G}
    save_file(broken, str(root / "model.safetensors"))
    with pytest.raises(ValueError, match="different g_idx"):
        load_checkpoint(root)
    save_file({**original, "lm_head.qweight": torch.zeros(8, 128, dtype=torch.int32)}, str(root / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensor 'lm_head.qweight'"):
        load_checkpoint(root)


@pytest.mark.parametrize(("family", "use_zero_point"), [("llama", True), ("qwen2", False)])
def test_our_format_round_trips(make_model, make_hf_dir, tmp_path: Path, family: str, use_zero_point: bool) -> None:
    ck = load_checkpoint(make_hf_dir(make_model(family)))
    q = Transformer.from_weights(ck.config, ck.weights).quantize(32, use_zero_point)
    save_quantized(q, tmp_path / "ours", ck.tokenizer, ck.chat_template, {"method": "rtn"})
    back = load_checkpoint(tmp_path / "ours")
    assert back.chat_template == ck.chat_template and back.tokenizer.get_vocab() == ck.tokenizer.get_vocab()
    r = Transformer.from_weights(back.config, back.weights, quantized=back.quantized)
    for a, b in zip(q.layers, r.layers):
        for x, y in ((a.qkv, b.qkv), (a.o, b.o), (a.gate_up, b.gate_up), (a.down, b.down)):
            assert torch.equal(x.weight.qweight, y.weight.qweight) and torch.equal(x.weight.scales, y.weight.scales)
            assert (x.weight.zeros is None) == (y.weight.zeros is None) == (not use_zero_point)
    assert torch.equal(logits(q, [1, 2, 3, 50]), logits(r, [1, 2, 3, 50]))


def test_act_order_import_round_trips_through_our_format(make_model, make_hf_dir, tmp_path: Path) -> None:
    model = make_model("llama")
    root = make_hf_dir(model)
    write_quantized_dir(root, model, "gptq", act_order=True)
    ck = load_checkpoint(root)
    q = Transformer.from_weights(ck.config, ck.weights, quantized=ck.quantized)
    save_quantized(q, tmp_path / "ours", ck.tokenizer, ck.chat_template)
    back = load_checkpoint(tmp_path / "ours")
    assert torch.equal(back.quantized["model.layers.1.mlp.down_proj"].perm, q.layers[1].down.perm)
    r = Transformer.from_weights(back.config, back.weights, quantized=back.quantized)
    assert torch.equal(logits(q, [4, 8, 15, 16, 23, 42]), logits(r, [4, 8, 15, 16, 23, 42]))


def test_build_engine_uses_an_int4_checkpoint_as_is(make_model, make_hf_dir) -> None:
    from gateway.llm import LoadConfig, build_engine

    model = make_model("llama")
    root = make_hf_dir(model)
    expected = write_quantized_dir(root, model, "awq")
    loaded = build_engine(LoadConfig(model=str(root), quantize="int4", group_size=64, draft="ngram", device="cpu"),
                          log=lambda m: None)
    qkv = loaded.engine.target.layers[0].qkv
    assert qkv.weight.group_size == G  # the checkpoint's groups, not a requantization at 64
    parts = [expected[f"model.layers.0.self_attn.{p}"] for p in PARTS["self_attn.qkv_proj"]]
    assert torch.equal(effective_weight(qkv), torch.cat(parts))
