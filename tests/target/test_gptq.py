"""target/gptq.py: GPTQ against RTN on one weight and on a tiny random model (CPU, seconds)."""

from __future__ import annotations

import json

import pytest
import torch

from kernels.int4_matmul import dequantize, quantize_rtn
from target.batch import Segment, build_batch
from target.gptq import (_quantize_layer, cached_gptq, gptq_quantize, quantize_gptq, sample_calibration,
                         text_windows)
from target.config import ModelConfig
from target.loader import expected_weights, load_checkpoint
from kernels.fused_norm_rope import rms_norm_ref as rms_norm
from target.model import Transformer


def correlated_inputs(num_rows: int, K: int, seed: int = 0) -> torch.Tensor:
    """[num_rows, K] activations near a fixed low-rank subspace, with a few loud channels (like an LLM's).
    ``seed`` draws the rows; the subspace and the loud channels are the same for every seed."""
    fixed = torch.Generator().manual_seed(100)
    mix, loud = torch.randn(K // 4, K, generator=fixed), 1 + 4 * (torch.rand(K, generator=fixed) > 0.9)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, K // 4, generator=g) @ mix + 0.1 * torch.randn(num_rows, K, generator=g)
    return x * loud


def output_error(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    return float(((x @ w.T - x @ wq.T) ** 2).mean())


@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize(("group_size", "use_zero_point"), [(32, True), (64, True), (32, False)])
def test_gptq_beats_rtn_on_one_weight(desc_act: bool, group_size: int, use_zero_point: bool) -> None:
    K, N = 128, 48
    x = correlated_inputs(2048, K)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(1))
    h = 2 * x.T @ x / x.shape[0]
    q = gptq_quantize(w, h, group_size, desc_act=desc_act, use_zero_point=use_zero_point)
    rtn = quantize_rtn(w, group_size, use_zero_point)
    x_test = correlated_inputs(512, K, seed=1)  # held out, same distribution
    assert (q.zeros is None) == (not use_zero_point) and q.group_size == group_size
    assert output_error(x_test, w, dequantize(q)) < 0.5 * output_error(x_test, w, dequantize(rtn))


@pytest.mark.parametrize("desc_act", [False, True])
def test_uncorrelated_inputs_give_rtn(desc_act: bool) -> None:
    """With H = I no column can absorb another's error: GPTQ must reduce to round-to-nearest exactly."""
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(2))
    q = gptq_quantize(w, torch.eye(64), 32, desc_act=desc_act, round_zero=True)
    rtn = quantize_rtn(w, 32)
    assert torch.equal(q.qweight, rtn.qweight) and torch.equal(q.scales, rtn.scales) and torch.equal(q.zeros, rtn.zeros)


@pytest.mark.parametrize("desc_act", [False, True])
def test_weight_already_on_a_grid_is_kept(desc_act: bool) -> None:
    """Fractional zeros span each group's [min, max] exactly, so a weight already on a min-max INT4 grid
    (a Q4_1 GGUF's, dequantized) comes back unchanged, whatever H is."""
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (16, 4, 32), generator=g)
    codes[:, :, 0], codes[:, :, 1] = 0, 15  # every group uses the whole code range, as min-max blocks do
    scale, zero = 0.01 + torch.rand(16, 4, 1, generator=g) / 10, 15 * torch.rand(16, 4, 1, generator=g)
    w = ((codes - zero) * scale).reshape(16, 128)
    x = correlated_inputs(256, 128)
    q = gptq_quantize(w, 2 * x.T @ x / 256, 32, desc_act=desc_act)
    torch.testing.assert_close(dequantize(q), w, rtol=0, atol=1e-5)


def test_bf16_weights_store_bf16_scales() -> None:
    w = torch.randn(16, 64).bfloat16()
    x = correlated_inputs(128, 64)
    q = gptq_quantize(w, 2 * x.T @ x / 128, 32)
    assert q.scales.dtype == q.zeros.dtype == torch.bfloat16
    rtn = quantize_rtn(w, 32)
    assert output_error(x, w.float(), dequantize(q).float()) < output_error(x, w.float(), dequantize(rtn).float())


def test_dead_inputs_and_bad_group() -> None:
    w = torch.randn(8, 64)
    h = torch.eye(64)
    h[5, 5] = 0  # an input that is always zero
    assert torch.isfinite(dequantize(gptq_quantize(w, h, 32))).all()
    with pytest.raises(ValueError, match="multiple of group_size"):
        gptq_quantize(w, h, 48)


def logits_all(model: Transformer, ids: list[int]) -> torch.Tensor:
    cache = model.new_cache(-(-len(ids) // 4) + 1, 4)
    return model.forward(build_batch([Segment(cache.new_table(), 0, ids, logits="all")], cache, "cpu"), cache)


@pytest.fixture(scope="module")
def tiny_dense() -> Transformer:
    cfg = ModelConfig(family="llama", vocab_size=64, hidden_size=128, intermediate_size=256, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=256)
    g = torch.Generator().manual_seed(3)
    weights = {name: (1 + 0.1 * torch.randn(shape, generator=g)) if name.endswith("norm.weight")
               else 0.1 * torch.randn(shape, generator=g) for name, shape in expected_weights(cfg).items()}
    return Transformer.from_weights(cfg, weights)


def test_gptq_model_beats_rtn(tiny_dense: Transformer) -> None:
    """Calibrated on sequences the model wrote itself, GPTQ's logits sit closer to dense's on held-out ones."""
    calib = sample_calibration(tiny_dense, 24, 48, first_tokens=list(range(64)), seed=0)
    held_out = sample_calibration(tiny_dense, 4, 48, first_tokens=list(range(64)), seed=1)
    gptq = quantize_gptq(tiny_dense, calib, group_size=32, progress=False)
    rtn = tiny_dense.quantize(32)
    ref = [logits_all(tiny_dense, s) for s in held_out]
    err = {name: sum(float(((logits_all(m, s) - r) ** 2).mean()) for s, r in zip(held_out, ref))
           for name, m in (("gptq", gptq), ("rtn", rtn))}
    assert err["gptq"] < 0.7 * err["rtn"], err


def test_calibration_forward_matches_the_model(tiny_dense: Transformer) -> None:
    """The per-layer forward GPTQ calibrates through is the engine's forward (else it would tune the wrong maths)."""
    q = quantize_gptq(tiny_dense, [[1, 2, 3, 4, 5, 6, 7, 8]] * 4, 32, desc_act=True, damp=0.1, progress=False)
    ids = [5, 9, 2, 33, 7, 1, 0, 12, 40, 41]
    hs = [q.embed[torch.tensor(ids)]]
    for layer in q.layers:  # projections already INT4: this only runs the forward
        _, hs = _quantize_layer(q, layer, hs, dict(group_size=32))
    logits = q.lm_head(rms_norm(hs[0], q.norm, q.config.rms_norm_eps))
    torch.testing.assert_close(logits, logits_all(q, ids), rtol=1e-4, atol=1e-4)


def test_gptq_is_deterministic_and_keeps_dense_parts(tiny_dense: Transformer) -> None:
    calib = text_windows(list(range(64)) * 4, 6, 16, seed=0)
    a = quantize_gptq(tiny_dense, calib, group_size=64, desc_act=True, progress=False)
    b = quantize_gptq(tiny_dense, calib, group_size=64, desc_act=True, progress=False)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.gate_up.weight.qweight, lb.gate_up.weight.qweight)
        assert torch.equal(la.qkv.weight.scales, lb.qkv.weight.scales)
    assert a.embed is tiny_dense.embed and a.lm_head is tiny_dense.lm_head


def test_calibration_data_is_seeded(tiny_dense: Transformer) -> None:
    a = sample_calibration(tiny_dense, 3, 10, first_tokens=[4, 5, 6], seed=7, batch_size=2)
    assert [len(s) for s in a] == [10, 10, 10] and all(s[0] in (4, 5, 6) for s in a)
    assert a == sample_calibration(tiny_dense, 3, 10, first_tokens=[4, 5, 6], seed=7)
    assert text_windows(list(range(100)), 2, 8, seed=1) == text_windows(list(range(100)), 2, 8, seed=1)
    with pytest.raises(ValueError, match="calibration"):
        quantize_gptq(tiny_dense, [], progress=False)


def test_cached_gptq_calibrates_once(make_model, make_hf_dir, tmp_path) -> None:
    ck = load_checkpoint(make_hf_dir(make_model("llama", hidden_size=64, intermediate_size=64)))
    dense = Transformer.from_weights(ck.config, ck.weights)
    logs: list[str] = []
    first = cached_gptq(dense, ck, tmp_path / "q", 32, num_seqs=4, seq_len=16, log=logs.append)
    (saved,) = (tmp_path / "q").iterdir()
    assert json.loads((saved / "config.json").read_text())["quantization_config"]["method"] == "gptq"
    again = cached_gptq(dense, ck, tmp_path / "q", 32, num_seqs=4, seq_len=16, log=logs.append)
    assert "loading cached" in logs[-1] and len(list((tmp_path / "q").iterdir())) == 1
    for a, b in zip(first.layers, again.layers):
        assert torch.equal(a.down.weight.qweight, b.down.weight.qweight)
        assert torch.equal(a.o.weight.zeros, b.o.weight.zeros)
    cached_gptq(dense, ck, tmp_path / "q", 64, num_seqs=4, seq_len=16, log=logs.append)  # new settings, new entry
    assert len(list((tmp_path / "q").iterdir())) == 2
