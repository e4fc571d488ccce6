"""A GGUF's Q4_0 / Q4_1 blocks kept as INT4 (target/gguf_file.py, int4=True) against gguf-py's own dequantizer."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from gateway.llm import LoadConfig, target_checkpoint
from kernels.int4_matmul import Int4Weight, dequantize
from target.batch import Segment, build_batch
from target.gguf_file import q4_blocks
from target.loader import load_checkpoint
from target.model import Transformer
from target.quant_formats import PROJECTIONS

Q4_0, Q4_1 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1])
def test_q4_blocks_decode_as_gguf_does(qtype) -> None:
    rng = np.random.default_rng(int(qtype))
    w = rng.standard_normal((6, 96)).astype(np.float32)
    w[2, 32:64] = 0.75  # a constant block: Q4_1 stores d = 0, m = 0.75
    w[3, :32] = 0.0
    raw = gguf_quantize(w, qtype)
    want = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32))
    u = q4_blocks(raw, qtype, 6, 96)
    assert u.codes.shape == (6, 96) and u.scales.shape == u.zeros.shape == (3, 6)
    assert int(u.codes.min()) >= 0 and int(u.codes.max()) <= 15
    got = (u.codes.float() - u.zeros.T.repeat_interleave(32, 1)) * u.scales.T.repeat_interleave(32, 1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    if qtype == Q4_0:
        assert bool((u.zeros == 8).all())
    assert torch.equal(got[2, 32:64], want[2, 32:64]) and bool((want[2, 32:64] == 0.75).all())


def _dense_projection(ckpt, layer: int, fused: str) -> torch.Tensor:
    return torch.cat([ckpt.weights[f"model.layers.{layer}.{p}.weight"] for p in PROJECTIONS[fused]])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gguf_q4_projections_load_as_int4(make_model, make_gguf, family) -> None:
    """Q4_1 attention (q/k rows permuted in llama files) and a Q4_0 MLP load as INT4 Linears whose weights are
    the dequantized file's; a projection with one F32 part stays dense; the model computes the same logits."""
    quant = {"self_attn.q_proj": Q4_1, "self_attn.k_proj": Q4_1, "self_attn.v_proj": Q4_1,
             "self_attn.o_proj": Q4_1, "mlp.gate_proj": Q4_0, "mlp.up_proj": Q4_0}  # down_proj stays F32
    path = make_gguf(make_model(family), arch=family, quant=quant)
    dense = load_checkpoint(path)
    q = load_checkpoint(path, gguf_int4=True)
    assert sorted({n.split(".", 3)[-1] for n in q.quantized}) == ["mlp.gate_up_proj", "self_attn.o_proj",
                                                                     "self_attn.qkv_proj"]
    assert not any(".self_attn.q_proj.weight" in n or ".mlp.up_proj.weight" in n for n in q.weights)
    assert "model.layers.0.mlp.down_proj.weight" in q.weights
    if family == "qwen2":  # biases stay dense beside the INT4 qkv
        assert torch.equal(q.weights["model.layers.0.self_attn.q_proj.bias"], dense.weights["model.layers.0.self_attn.q_proj.bias"])
    for layer in range(dense.config.num_layers):
        for fused in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj"):
            lin = q.quantized[f"model.layers.{layer}.{fused}"]
            assert isinstance(lin.weight, Int4Weight) and lin.weight.group_size == 32 and lin.perm is None
            assert (lin.weight.zeros is None) == (fused == "mlp.gate_up_proj")  # Q4_0: the symmetric path
            # (code - zero) * scale against d * code + m: equal up to float32 rounding of the zero point
            torch.testing.assert_close(dequantize(lin.weight), _dense_projection(dense, layer, fused),
                                       rtol=1e-5, atol=1e-6)
    a = Transformer.from_weights(dense.config, dense.weights)
    b = Transformer.from_weights(q.config, q.weights, quantized=q.quantized)
    logits = []
    for model in (a, b):
        cache = model.new_cache(8, 4)
        batch = build_batch([Segment(cache.new_table(), 0, [5, 9, 17, 33, 2, 8], logits="all")], cache, "cpu")
        logits.append(model.forward(batch, cache))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_target_checkpoint_keeps_q4_blocks_only_under_int4(make_model, make_gguf) -> None:
    path = make_gguf(make_model(), quant={"mlp.down_proj": Q4_1})
    assert set(target_checkpoint(LoadConfig(model=str(path), quantize="int4"), torch.float32).quantized) == {
        "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}
    for mode in ("none", "gptq"):  # a dense model to serve as is, or to calibrate from
        assert not target_checkpoint(LoadConfig(model=str(path), quantize=mode), torch.float32).quantized
