"""target/gptq.py: GPTQ against RTN on one weight and on a tiny random model (CPU, seconds)."""

from __future__ import annotations

import json

import pytest
import torch

from kernels.int4_matmul import Int4Weight, dequantize, quantize_rtn
from target.batch import Segment, build_batch
from target.gptq import (ACT_ORDERS, TUNE_RECIPES, _fold_input_order, _gptq_linear, _quantize_layer, cached_gptq,
                         gptq_quantize, group_params, mse_group_params, output_saliency, quantize_gptq, row_groups,
                         sample_calibration, text_windows, visiting_order)
from target.config import ModelConfig
from target.loader import expected_weights, load_checkpoint
from kernels.fused_norm_rope import rms_norm_ref as rms_norm
from target.model import Linear, Transformer, int4_linear
from target.qtune import on_device, sequence_logits
from target.quant_formats import save_quantized


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


def gptq_dense(w: torch.Tensor, h: torch.Tensor, group_size: int, **opts) -> torch.Tensor:
    """GPTQ ``w`` and dequantize it back to the original column order: [N, K]."""
    q, perm = gptq_quantize(w, h, group_size, **opts)
    wq = dequantize(q)
    return wq if perm is None else wq[:, torch.argsort(perm)]


@pytest.mark.parametrize("act_order", ACT_ORDERS)
@pytest.mark.parametrize(("group_size", "use_zero_point"), [(32, True), (64, True), (32, False)])
def test_gptq_beats_rtn_on_one_weight(act_order: str, group_size: int, use_zero_point: bool) -> None:
    K, N = 128, 48
    x = correlated_inputs(2048, K)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(1))
    h = 2 * x.T @ x / x.shape[0]
    q, perm = gptq_quantize(w, h, group_size, act_order=act_order, use_zero_point=use_zero_point)
    rtn = quantize_rtn(w, group_size, use_zero_point)
    x_test = correlated_inputs(512, K, seed=1)  # held out, same distribution
    assert (q.zeros is None) == (not use_zero_point) and q.group_size == group_size
    assert (perm is not None) == (act_order == "perm")
    wq = gptq_dense(w, h, group_size, act_order=act_order, use_zero_point=use_zero_point)
    assert output_error(x_test, w, wq) < 0.5 * output_error(x_test, w, dequantize(rtn))


@pytest.mark.parametrize("act_order", ACT_ORDERS)
def test_uncorrelated_inputs_give_rtn(act_order: str) -> None:
    """With H = I no column can absorb another's error: GPTQ must reduce to round-to-nearest exactly
    (every order is then the natural one: ties keep their place)."""
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(2))
    q, perm = gptq_quantize(w, torch.eye(64), 32, act_order=act_order, round_zero=True)
    rtn = quantize_rtn(w, 32)
    assert perm is None or torch.equal(perm, torch.arange(64))
    assert torch.equal(q.qweight, rtn.qweight) and torch.equal(q.scales, rtn.scales) and torch.equal(q.zeros, rtn.zeros)


@pytest.mark.parametrize(("act_order", "mse"), [("off", False), ("static", False), ("group", False), ("group", True)])
def test_weight_already_on_a_grid_is_kept(act_order: str, mse: bool) -> None:
    """Fractional zeros span each group's [min, max] exactly, so a weight already on a min-max INT4 grid
    (a Q4_1 GGUF's, dequantized) comes back unchanged, whatever H is; the mse search cannot beat zero error.
    (``perm`` groups mix columns of different grids, so it does not keep them.)"""
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (16, 4, 32), generator=g)
    codes[:, :, 0], codes[:, :, 1] = 0, 15  # every group uses the whole code range, as min-max blocks do
    scale, zero = 0.01 + torch.rand(16, 4, 1, generator=g) / 10, 15 * torch.rand(16, 4, 1, generator=g)
    w = ((codes - zero) * scale).reshape(16, 128)
    x = correlated_inputs(256, 128)
    wq = gptq_dense(w, 2 * x.T @ x / 256, 32, act_order=act_order, mse=mse)
    torch.testing.assert_close(wq, w, rtol=0, atol=1e-5)


def test_visiting_orders() -> None:
    diag = torch.tensor([1.0, 5, 2, 9, 3, 4, 8, 0])
    assert visiting_order(diag, 4, "off").tolist() == list(range(8))
    by_diag = [3, 6, 1, 5, 4, 2, 0, 7]
    assert visiting_order(diag, 4, "static").tolist() == visiting_order(diag, 4, "perm").tolist() == by_diag
    # groups [0..3] (max 9) then [4..7] (max 8), each by decreasing diag: every group stays whole
    assert visiting_order(diag, 4, "group").tolist() == [3, 1, 2, 0, 6, 5, 4, 7]


def heavy_tailed_weight(N: int, K: int, seed: int) -> torch.Tensor:
    """[N, K] with a few outliers per row, where the min-max grid wastes most of its steps."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, generator=g) * (1 + 4 * (torch.rand(N, K, generator=g) > 0.98))


def test_mse_grid_never_worse_than_min_max() -> None:
    w = heavy_tailed_weight(64, 32, seed=5)
    importance = torch.rand(32, generator=torch.Generator().manual_seed(6)) + 0.1

    def row_error(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:  # [N]
        q = (w / scale[:, None] + zero[:, None]).round().clamp(0, 15)
        return (w - (q - zero[:, None]) * scale[:, None]).square() @ importance

    for use_zero_point, round_zero in ((True, False), (True, True), (False, False)):
        searched = row_error(*mse_group_params(w, importance, use_zero_point, round_zero, torch.float32))
        minmax = row_error(*group_params(w, use_zero_point, round_zero))
        assert (searched <= minmax).all()
        assert float(searched.sum()) < 0.95 * float(minmax.sum())  # and it does find better grids


def test_act_orders_and_mse_on_one_layer() -> None:
    """Layer reconstruction error on held-out inputs with a few loud channels: every act-order beats the natural
    order, true act-order (``perm``) and static groups by half or more; the mse grids help the natural order most
    and cost no order more than noise. (Which of ``static`` / ``group`` / ``perm`` wins depends on the weights:
    on SmolLM2's ``group`` ties ``static`` and ``perm`` loses, see bench/results/quant.json.)"""
    K, N, G = 256, 64, 64
    x, x_test = correlated_inputs(2048, K), correlated_inputs(512, K, seed=1)
    w = heavy_tailed_weight(N, K, seed=7)
    h = 2 * x.T @ x / x.shape[0]
    err = {(order, mse): output_error(x_test, w, gptq_dense(w, h, G, act_order=order, mse=mse))
           for order in ACT_ORDERS for mse in (False, True)}
    rtn = output_error(x_test, w, dequantize(quantize_rtn(w, G)))
    assert max(err["perm", False], err["static", False]) < 0.5 * err["off", False] < 0.1 * rtn, err
    assert err["group", False] < 0.7 * err["off", False], err
    assert err["off", True] < 0.8 * err["off", False], err
    assert all(err[order, True] < 1.05 * err[order, False] for order in ACT_ORDERS), err


def test_fold_input_order_keeps_the_mlp() -> None:
    """``down``'s input permutation moved into ``gate_up``'s rows gives the same MLP output, with no gather."""
    g = torch.Generator().manual_seed(8)
    hidden, inter = 64, 96
    gate_up = int4_linear(quantize_rtn(torch.randn(2 * inter, hidden, generator=g), 32),
                          perm=torch.randperm(hidden, generator=g))
    down = int4_linear(quantize_rtn(torch.randn(hidden, inter, generator=g), 32),
                       perm=torch.randperm(inter, generator=g))
    x = torch.randn(5, hidden, generator=g)  # [T, hidden]
    folded_gate_up, folded_down = _fold_input_order(gate_up, down)
    assert folded_down.perm is None and torch.equal(folded_gate_up.perm, gate_up.perm)
    assert isinstance(folded_gate_up.weight, Int4Weight)
    torch.testing.assert_close(folded_down(folded_gate_up.silu_mul(x)), down(gate_up.silu_mul(x)), rtol=1e-5, atol=1e-5)


def test_bf16_weights_store_bf16_scales() -> None:
    w = torch.randn(16, 64).bfloat16()
    x = correlated_inputs(128, 64)
    q, _ = gptq_quantize(w, 2 * x.T @ x / 128, 32)
    assert q.scales.dtype == q.zeros.dtype == torch.bfloat16
    rtn = quantize_rtn(w, 32)
    assert output_error(x, w.float(), dequantize(q).float()) < output_error(x, w.float(), dequantize(rtn).float())


def test_dead_inputs_and_bad_group() -> None:
    w = torch.randn(8, 64)
    h = torch.eye(64)
    h[5, 5] = 0  # an input that is always zero
    for act_order in ACT_ORDERS:
        assert torch.isfinite(gptq_dense(w, h, 32, act_order=act_order, mse=True)).all()
    with pytest.raises(ValueError, match="multiple of group_size"):
        gptq_quantize(w, h, 48)
    with pytest.raises(ValueError, match="act_order"):
        gptq_quantize(w, h, 32, act_order="desc")


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
    q = quantize_gptq(tiny_dense, [[1, 2, 3, 4, 5, 6, 7, 8]] * 4, 32, act_order="perm", damp=0.1, progress=False)
    assert q.layers[0].qkv.perm is not None and q.layers[0].down.perm is None  # down's order went into gate_up
    ids = [5, 9, 2, 33, 7, 1, 0, 12, 40, 41]
    hs = [q.embed[torch.tensor(ids)]]
    for layer in q.layers:  # projections already INT4: this only runs the forward
        _, hs = _quantize_layer(q, layer, hs, dict(group_size=32))
    logits = q.lm_head(rms_norm(hs[0], q.norm, q.config.rms_norm_eps))
    torch.testing.assert_close(logits, logits_all(q, ids), rtol=1e-4, atol=1e-4)


def test_gptq_is_deterministic_and_keeps_dense_parts(tiny_dense: Transformer) -> None:
    calib = text_windows(list(range(64)) * 4, 6, 16, seed=0)
    a = quantize_gptq(tiny_dense, calib, group_size=64, act_order="perm", progress=False)
    b = quantize_gptq(tiny_dense, calib, group_size=64, act_order="perm", progress=False)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.gate_up.weight.qweight, lb.gate_up.weight.qweight)
        assert torch.equal(la.qkv.weight.scales, lb.qkv.weight.scales) and torch.equal(la.qkv.perm, lb.qkv.perm)
    assert a.embed is tiny_dense.embed and a.lm_head is tiny_dense.lm_head


def test_calibration_data_is_seeded(tiny_dense: Transformer) -> None:
    a = sample_calibration(tiny_dense, 3, 10, first_tokens=[4, 5, 6], seed=7, batch_size=2)
    assert [len(s) for s in a] == [10, 10, 10] and all(s[0] in (4, 5, 6) for s in a)
    assert a == sample_calibration(tiny_dense, 3, 10, first_tokens=[4, 5, 6], seed=7)
    assert text_windows(list(range(100)), 2, 8, seed=1) == text_windows(list(range(100)), 2, 8, seed=1)
    with pytest.raises(ValueError, match="calibration"):
        quantize_gptq(tiny_dense, [], progress=False)


def test_batch_drawn_calibration_follows_the_model(tiny_dense: Transformer) -> None:
    """``per_sequence=False`` draws a batch from one device generator: seeded, and distributed as the model says
    (second tokens after a fixed first one against the model's softmax, over 4000 draws in batches of 1000)."""
    a = sample_calibration(tiny_dense, 5, 6, first_tokens=[4, 5, 6], seed=3, batch_size=2, per_sequence=False)
    assert a == sample_calibration(tiny_dense, 5, 6, first_tokens=[4, 5, 6], seed=3, batch_size=2, per_sequence=False)
    assert [len(s) for s in a] == [6] * 5 and all(s[0] in (4, 5, 6) for s in a)
    seqs = sample_calibration(tiny_dense, 4000, 2, first_tokens=[9], seed=0, batch_size=1000, per_sequence=False)
    counts = torch.bincount(torch.tensor([s[1] for s in seqs]), minlength=tiny_dense.config.vocab_size).float()
    cache = tiny_dense.new_cache(2, 16)
    probs = torch.softmax(tiny_dense.forward(build_batch([Segment(cache.new_table(), 0, [9])], cache, "cpu"), cache)[0], -1)
    assert (counts / 4000 - probs).abs().max() < 4 * (probs * (1 - probs) / 4000).sqrt().max() + 1e-3


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
    # tuned weights are another entry: other scales and norms (two steps flip no code), reloaded as tuned
    tuned = cached_gptq(dense, ck, tmp_path / "q", 32, num_seqs=4, seq_len=16, tune_steps=2, tune_seqs=8,
                        log=logs.append)
    assert len(list((tmp_path / "q").iterdir())) == 3 and "tuning INT4 scales, zeros, codes and norms" in logs[-1]
    again = cached_gptq(dense, ck, tmp_path / "q", 32, num_seqs=4, seq_len=16, tune_steps=2, tune_seqs=8,
                        log=logs.append)
    assert "loading cached" in logs[-1]
    for a, b, c in zip(first.layers, tuned.layers, again.layers):
        assert torch.equal(a.qkv.weight.qweight, b.qkv.weight.qweight)
        assert not torch.equal(a.qkv.weight.scales, b.qkv.weight.scales)
        assert torch.equal(b.qkv.weight.scales, c.qkv.weight.scales) and torch.equal(b.qkv.weight.zeros, c.qkv.weight.zeros)
        assert not torch.equal(a.post_norm, b.post_norm) and torch.equal(b.post_norm, c.post_norm)
    assert not torch.equal(first.norm, tuned.norm) and torch.equal(tuned.norm, again.norm)
    # scales alone: another entry, the norms as they were
    scales = cached_gptq(dense, ck, tmp_path / "q", 32, num_seqs=4, seq_len=16, tune_steps=2, tune_seqs=8,
                         tune=TUNE_RECIPES["scales"], log=logs.append)
    assert len(list((tmp_path / "q").iterdir())) == 4 and "tuning INT4 scales and zeros for" in logs[-1]
    assert torch.equal(first.norm, scales.norm) and not torch.equal(first.layers[0].o.weight.scales,
                                                                     scales.layers[0].o.weight.scales)


@pytest.mark.parametrize("act_order", ["group", "perm"])
def test_saved_gptq_reloads_with_its_input_order(make_model, make_hf_dir, tmp_path, act_order: str) -> None:
    """A ``perm`` model keeps its input permutations through save_quantized / load_checkpoint: same logits."""
    ck = load_checkpoint(make_hf_dir(make_model("llama", hidden_size=64, intermediate_size=64)))
    dense = Transformer.from_weights(ck.config, ck.weights)
    calib = text_windows(list(range(ck.config.vocab_size)) * 2, 6, 16, seed=0)
    q = quantize_gptq(dense, calib, 32, act_order=act_order, progress=False)
    assert all((layer.qkv.perm is not None) == (act_order == "perm") for layer in q.layers)
    loaded = load_checkpoint(save_quantized(q, tmp_path / "q", ck.tokenizer), torch.float32)
    again = Transformer.from_weights(loaded.config, loaded.weights, torch.float32, "cpu", loaded.quantized)
    for a, b in zip(q.layers, again.layers):
        assert (a.gate_up.perm is None) == (b.gate_up.perm is None) and b.down.perm is None
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    assert torch.equal(logits_all(again, ids), logits_all(q, ids))


# --- end-loss guidance (GuidedQuant) ---------------------------------------------------------------

def nll_with_nudge(model: Transformer, ids: list[int], at: tuple[int, str, int, int], eps: float) -> float:
    """The summed next-token NLL of ``ids`` with projection output ``(layer, name)`` at (token, row) moved by eps."""
    layer, name, t, j = at

    def tap(i: int, n: str, y: torch.Tensor) -> torch.Tensor:
        if (i, n) != (layer, name):
            return y
        bump = torch.zeros_like(y)
        bump[0, t, j] = eps
        return y + bump

    logits = sequence_logits(on_device(model, torch.device("cpu")), torch.tensor([ids]), tap=tap)[0].double()
    return float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum"))


def test_saliency_is_the_squared_loss_gradient(tiny_dense: Transformer) -> None:
    """With one row per group (R = 128 rows of ``o`` and ``down``), a token's saliency is its squared
    gradient: checked against central differences of the loss; the last token feeds no loss, so it has none."""
    ids = sample_calibration(tiny_dense, 1, 12, first_tokens=list(range(64)), seed=4)[0]
    sal = output_saliency(tiny_dense, [ids], groups=128, progress=False)
    assert set(sal) == {(i, n) for i in range(2) for n in ("qkv", "o", "gate_up", "down")}
    for at in ((0, "o", 3, 5), (1, "down", 7, 100), (0, "down", 10, 0)):
        layer, name, t, j = at
        eps = 1e-2
        fd = (nll_with_nudge(tiny_dense, ids, at, eps) - nll_with_nudge(tiny_dense, ids, at, -eps)) / (2 * eps)
        assert sal[layer, name][0].shape == (12, 128)
        got = float(sal[layer, name][0][t, j]) ** 0.5
        assert abs(fd) > 5e-3 and abs(got - abs(fd)) < 1e-4 + 1e-2 * abs(fd), (at, fd, got)
    assert all(float(s[0][-1].abs().max()) == 0 for s in sal.values())


def test_saliency_groups_sum_rows_and_ignore_batching(tiny_dense: Transformer) -> None:
    """Row groups are sums of the rows' saliencies; ragged sequences batched together (padded, masked) get what
    each gets alone."""
    calib = [sample_calibration(tiny_dense, 1, n, first_tokens=list(range(64)), seed=n)[0] for n in (9, 14, 5)]
    alone = output_saliency(tiny_dense, calib, groups=4, batch_size=1, progress=False)
    together = output_saliency(tiny_dense, calib, groups=4, batch_size=3, progress=False)
    one = output_saliency(tiny_dense, calib, groups=1, batch_size=3, progress=False)
    for key in alone:
        assert [s.shape for s in alone[key]] == [(9, 4), (14, 4), (5, 4)]
        for a, b, c in zip(alone[key], together[key], one[key]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-9)
            torch.testing.assert_close(a.sum(-1, keepdim=True), c, rtol=1e-4, atol=1e-9)
    assert [len(r) for r in row_groups(10, 3)] == [4, 3, 3]
    with pytest.raises(ValueError, match="groups"):
        row_groups(4, 5)


def test_guided_rows_use_their_own_hessian() -> None:
    """Each row group is GPTQ against ``2/n sum_t s_tr x_t x_t^T``; a saliency of ones is plain GPTQ."""
    torch.manual_seed(0)
    w, x = 0.1 * torch.randn(24, 64), correlated_inputs(200, 64, seed=1)
    xs = [x[:120], x[120:]]
    sal = [torch.rand(120, 3), torch.rand(80, 3)]
    got = dequantize(_gptq_linear(Linear(w), xs, 32, saliency=sal, act_order="static").weight)
    s = torch.cat(sal)
    for r, rows in enumerate(row_groups(24, 3)):
        h = 2 / 200 * (x.T * s[:, r]) @ x
        torch.testing.assert_close(got[rows], gptq_dense(w[rows], h, 32, act_order="static"), rtol=1e-4, atol=1e-5)
    ones = _gptq_linear(Linear(w), xs, 32, saliency=[torch.ones(120, 1), torch.ones(80, 1)])
    plain = _gptq_linear(Linear(w), xs, 32)
    torch.testing.assert_close(dequantize(ones.weight), dequantize(plain.weight), rtol=1e-4, atol=1e-5)


def test_guided_gptq_model(tiny_dense: Transformer) -> None:
    """Guided GPTQ quantizes every projection, keeps the dense parts, and refuses act_order='perm' (one stored
    input order for rows with different Hessians)."""
    calib = sample_calibration(tiny_dense, 8, 24, first_tokens=list(range(64)), seed=0)
    sal = output_saliency(tiny_dense, calib, groups=4, progress=False)
    q = quantize_gptq(tiny_dense, calib, group_size=32, saliency=sal, progress=False)
    assert all(isinstance(getattr(l, n).weight, Int4Weight) and getattr(l, n).perm is None
               for l in q.layers for n in ("qkv", "o", "gate_up", "down"))
    assert q.embed is tiny_dense.embed and q.lm_head is tiny_dense.lm_head
    ids = calib[0]
    assert torch.isfinite(logits_all(q, ids)).all()
    with pytest.raises(ValueError, match="perm"):
        quantize_gptq(tiny_dense, calib, group_size=32, act_order="perm", saliency=sal, progress=False)

