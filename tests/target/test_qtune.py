"""target/qtune.py: scale and zero-point tuning by distillation, on tiny random models (CPU, seconds)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine_util import random_weights, tiny_config
from kernels.int4_matmul import Int4Weight, dequantize, unpack_int4
from target.gptq import quantize_gptq
from target.batch import Segment, build_batch
from target.model import Transformer
from target.qtune import TuneConfig, kl_to_teacher, mean_kl, sequence_logits, tune_scales


def random_seqs(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=g).tolist()


def serving_logits(model: Transformer, ids: list[int]) -> torch.Tensor:
    """[T, V] logits of every position through the paged serving forward."""
    cache = model.new_cache(-(-len(ids) // 16) + 1, 16)
    return model.forward(build_batch([Segment(cache.new_table(), 0, ids, logits="all")], cache, model.device), cache)


def assert_serves_as_trained(model: Transformer, ids: list[int]) -> None:
    """The paged serving forward computes what ``sequence_logits`` (the forward tuning trains through) does."""
    torch.testing.assert_close(serving_logits(model, ids), sequence_logits(model, torch.tensor([ids]))[0],
                               atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("int4", [False, True])
def test_sequence_logits_match_the_serving_forward(family: str, int4: bool) -> None:
    """The differentiable restatement computes what ``Transformer.forward`` does: dense and INT4, with and
    without qkv bias, two sequences in one batch."""
    cfg = tiny_config(family, layers=2)
    model = Transformer.from_weights(cfg, random_weights(cfg, seed=5))
    model = model.quantize(32) if int4 else model
    seqs = random_seqs(2, 21, cfg.vocab_size, seed=6)
    got = sequence_logits(model, torch.tensor(seqs))  # [2, 21, V]
    for b, ids in enumerate(seqs):
        torch.testing.assert_close(got[b], serving_logits(model, ids), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("everything", [False, True])
def test_input_orders_survive_tuning(pair: tuple[Transformer, Transformer], everything: bool) -> None:
    """A true act-order GPTQ model gathers its inputs (``Linear.perm``): ``sequence_logits`` must gather alike,
    and the tuned model keeps every permutation; ``everything``: codes and norms tuned too."""
    dense, _ = pair
    calib = random_seqs(8, 32, dense.config.vocab_size, seed=12)
    start = quantize_gptq(dense, calib, group_size=32, act_order="perm", progress=False)
    assert start.layers[0].qkv.perm is not None and start.layers[0].gate_up.perm is not None
    ids = calib[0][:19]
    assert_serves_as_trained(start, ids)
    cfg = TuneConfig(steps=2, batch_size=4, warmup=0, tune_codes=everything, tune_norms=everything,
                     lr_code=0.5 if everything else 5e-3)  # steps of half a level: some codes flip
    tuned = tune_scales(start, dense, calib, cfg, progress=False)
    if everything:
        assert any(not torch.equal(a.qkv.weight.qweight, b.qkv.weight.qweight)
                   for a, b in zip(start.layers, tuned.layers))
    for a, b in zip(start.layers, tuned.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            pa, pb = getattr(a, name).perm, getattr(b, name).perm
            assert (pa is None and pb is None) or torch.equal(pa, pb)
    assert_serves_as_trained(tuned, ids)


def test_kl_to_teacher_masks_and_is_zero_on_itself() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    mask = torch.tensor([[True] * 5, [True, True, False, False, False]])
    assert float(kl_to_teacher(a, a, mask)) == pytest.approx(0.0, abs=1e-6)
    kl = float(kl_to_teacher(a, b, mask))
    b2 = b.clone()
    b2[1, 2:] = 100 * torch.randn(3, 11, generator=g)  # masked positions must not count
    assert float(kl_to_teacher(a, b2, mask)) == pytest.approx(kl, rel=1e-6) and kl > 0


@pytest.fixture(scope="module")
def pair() -> tuple[Transformer, Transformer]:
    cfg = tiny_config(layers=2, vocab=96, hidden_size=64, intermediate_size=128)
    dense = Transformer.from_weights(cfg, random_weights(cfg, seed=7, scale=0.2))
    return dense, dense.quantize(32)


def test_tuning_lowers_held_out_kl_and_keeps_the_codes(pair: tuple[Transformer, Transformer]) -> None:
    dense, rtn = pair
    train = random_seqs(256, 24, dense.config.vocab_size, seed=8)  # fewer overfit: held-out KL then rises
    held = random_seqs(32, 24, dense.config.vocab_size, seed=9)
    losses: list[float] = []
    tuned = tune_scales(rtn, dense, train, TuneConfig(steps=30, batch_size=32, lr_scale=1e-2, lr_zero=3e-2, warmup=2),
                        progress=False, log=lambda step, loss: losses.append(loss))
    assert len(losses) == 30 and sum(losses[-5:]) < 0.85 * sum(losses[:5])
    before, after = mean_kl(rtn, dense, held), mean_kl(tuned, dense, held)
    assert after < 0.92 * before, (before, after)  # 0.178 -> 0.154 when written
    for old, new in zip(rtn.layers, tuned.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            a, b = getattr(old, name).weight, getattr(new, name).weight
            assert isinstance(b, Int4Weight) and b.group_size == a.group_size
            assert torch.equal(a.qweight, b.qweight)  # codes frozen
            assert b.scales.dtype == a.scales.dtype and b.zeros is not None
            assert not torch.equal(a.scales, b.scales) and not torch.equal(a.zeros, b.zeros)
            # the CPU path multiplies by the dequantized copy: it must be the tuned weight's
            torch.testing.assert_close(getattr(new, name).dequantized, dequantize(b))
    # the serving forward runs the tuned model as sequence_logits does
    ids = held[0]
    assert_serves_as_trained(tuned, ids)


def test_scales_only_and_symmetric_weights(pair: tuple[Transformer, Transformer]) -> None:
    """``tune_zeros=False`` moves scales alone; symmetric codes (no zeros) keep their fixed zero point."""
    dense, rtn = pair
    train = random_seqs(8, 16, dense.config.vocab_size, seed=10)
    cfg = TuneConfig(steps=3, batch_size=4, lr_scale=1e-2, lr_zero=1e-2, warmup=0, tune_zeros=False)
    tuned = tune_scales(rtn, dense, train, cfg, progress=False)
    qkv_old, qkv_new = rtn.layers[0].qkv.weight, tuned.layers[0].qkv.weight
    assert torch.equal(qkv_old.zeros, qkv_new.zeros) and not torch.equal(qkv_old.scales, qkv_new.scales)
    sym = dense.quantize(64, use_zero_point=False)
    tuned_sym = tune_scales(sym, dense, train, cfg, progress=False)
    assert tuned_sym.layers[0].qkv.weight.zeros is None
    assert not torch.equal(sym.layers[0].qkv.weight.scales, tuned_sym.layers[0].qkv.weight.scales)


def test_norms_tune_with_the_scales(pair: tuple[Transformer, Transformer]) -> None:
    """``tune_norms`` moves every norm weight (and only with it set); the tuned model serves as it trained."""
    dense, rtn = pair
    train = random_seqs(64, 16, dense.config.vocab_size, seed=13)
    cfg = TuneConfig(steps=4, batch_size=16, lr_scale=1e-2, lr_zero=1e-2, lr_norm=1e-2, warmup=0)
    plain = tune_scales(rtn, dense, train, cfg, progress=False)
    normed = tune_scales(rtn, dense, train, replace(cfg, tune_norms=True), progress=False)
    assert torch.equal(plain.norm, rtn.norm) and torch.equal(plain.layers[1].post_norm, rtn.layers[1].post_norm)
    assert not torch.equal(normed.norm, rtn.norm) and normed.norm.dtype == rtn.norm.dtype
    for a, b in zip(rtn.layers, normed.layers):
        assert not torch.equal(a.input_norm, b.input_norm) and not torch.equal(a.post_norm, b.post_norm)
    ids = train[0]
    assert_serves_as_trained(normed, ids)


def test_tuning_starts_from_gptq_and_is_deterministic(pair: tuple[Transformer, Transformer]) -> None:
    dense, _ = pair
    calib = random_seqs(8, 32, dense.config.vocab_size, seed=11)
    start = quantize_gptq(dense, calib, group_size=32, progress=False)
    cfg = TuneConfig(steps=5, batch_size=4, warmup=1)
    a, b = (tune_scales(start, dense, calib, cfg, progress=False) for _ in range(2))
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.down.weight.scales, lb.down.weight.scales)
        assert torch.equal(la.down.weight.zeros, lb.down.weight.zeros)


def test_bad_input(pair: tuple[Transformer, Transformer]) -> None:
    dense, rtn = pair
    with pytest.raises(ValueError, match="at least two tokens"):
        tune_scales(rtn, dense, [[1]], TuneConfig(steps=1), progress=False)
    with pytest.raises(ValueError, match="no INT4 projections"):
        tune_scales(dense, dense, [[1, 2, 3]], TuneConfig(steps=1), progress=False)
    with pytest.raises(ValueError, match="steps and batch_size"):
        TuneConfig(steps=0)


def test_codes_tune_within_one_level(pair: tuple[Transformer, Transformer]) -> None:
    """``tune_codes`` flips some codes, never by more than one level or out of 0..15, and the model it leaves
    serves as it trained; on this pair it lowers the held-out KL below what the same steps give the scales alone."""
    dense, rtn = pair
    train = random_seqs(512, 24, dense.config.vocab_size, seed=8)
    held = random_seqs(32, 24, dense.config.vocab_size, seed=9)
    # a code flips once its offset has moved half a level: that takes more steps than the scales need
    cfg = TuneConfig(steps=150, batch_size=32, lr_scale=1e-2, lr_zero=3e-2, lr_code=1e-2, warmup=2)
    scales_only = tune_scales(rtn, dense, train, cfg, progress=False)
    coded = tune_scales(rtn, dense, train, replace(cfg, tune_codes=True), progress=False)
    moved = 0
    for old, new in zip(rtn.layers, coded.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            a, b = unpack_int4(getattr(old, name).weight.qweight), unpack_int4(getattr(new, name).weight.qweight)
            assert int((a - b).abs().max()) <= 1 and int(b.min()) >= 0 and int(b.max()) <= 15
            moved += int((a != b).sum())
            torch.testing.assert_close(getattr(new, name).dequantized, dequantize(getattr(new, name).weight))
    assert moved > 0
    kl_scales, kl_codes = mean_kl(scales_only, dense, held), mean_kl(coded, dense, held)
    assert kl_codes < 0.9 * kl_scales, (kl_scales, kl_codes)  # 0.138 -> 0.107 when written
    assert_serves_as_trained(coded, held[0])
