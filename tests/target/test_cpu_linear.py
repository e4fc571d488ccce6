"""The CPU's projection form (``cpu_linear``) against ``F.linear``, and the weight alignment that keeps its
results independent of where a weight happened to be loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from target import model
from target.model import Linear, cpu_linear


@pytest.mark.parametrize("M", [1, 2, 3, 9, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_matches_f_linear(M: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(M)
    x, w = torch.randn(M, 96, generator=g), torch.randn(160, 96, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    y = cpu_linear(x, w, b)
    assert y.shape == (M, 160) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_keeps_float32_cpu_weights_aligned_and_results_independent_of_placement() -> None:
    w = torch.randn(576, 96, generator=torch.Generator().manual_seed(0))
    shifted = torch.empty(w.numel() + 3)[3:].view_as(w)  # 12 bytes past an aligned allocation
    shifted.copy_(w)
    assert shifted.data_ptr() % 64 != 0
    a, b = Linear(w), Linear(shifted)
    assert b.weight.data_ptr() % 64 == 0 and torch.equal(b.weight, w)
    x = torch.randn(2, 96)
    assert torch.equal(a(x), b(x))
    t = w.t()  # a transposed view is made contiguous too (cpu_linear reads [N, K] rows)
    assert Linear(t).weight.is_contiguous()
    half = torch.empty(w.numel() + 3, dtype=torch.float16)[3:].view_as(w)
    assert half.data_ptr() % 64 != 0
    assert Linear(half).weight is half  # other dtypes are staging copies: left where they are


def test_prefill_widths_keep_f_linear() -> None:
    g = torch.Generator().manual_seed(2)
    lin = Linear(torch.randn(160, 96, generator=g))
    x = torch.randn(model.CPU_LINEAR_MAX_ROWS + 1, 96, generator=g)
    assert torch.equal(lin(x), F.linear(x, lin.weight))


needs_cpu_int4 = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                    reason="this torch has no CPU INT4 kernel")


@needs_cpu_int4
@pytest.mark.parametrize("G", [32, 64, 128])
@pytest.mark.parametrize("zeros", ["whole", "fractional", "none"])
def test_cpu_int4_form_holds_the_same_weight(G: int, zeros: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's CPU INT4 form against the dequantized float32 copy: the same weight, rows 1 to 64, with a bias,
    a residual, an input order (act-order) and the fused SwiGLU; bfloat16 activations bound the difference."""
    from kernels.int4_matmul import CpuInt4, quantize_rtn

    monkeypatch.setattr(model, "CPU_INT4", True)
    g = torch.Generator().manual_seed(G)
    K, N = 384, 320
    q = quantize_rtn(torch.randn(N, K, generator=g) * 0.05, G, use_zero_point=zeros != "none")
    if zeros == "fractional":  # GGUF Q4_1's minimum, tuned zero points
        q.zeros = q.zeros + torch.rand(q.zeros.shape, generator=g)
    bias, perm = torch.randn(N, generator=g), torch.randperm(K, generator=g)
    lin = model.int4_linear(q, bias, perm)
    assert isinstance(lin.cpu_int4, CpuInt4)
    ref = model.Linear(q, bias, lin.dequantized, perm)  # the float32 path
    for M in (1, 3, 17, 64):
        x, res = torch.randn(M, K, generator=g), torch.randn(M, N, generator=g)
        want = ref(x, residual=res)
        monkeypatch.setattr(model, "CPU_INT4", False)
        assert torch.equal(lin(x, residual=res), want)  # switched off: the float32 copy, bit for bit
        monkeypatch.setattr(model, "CPU_INT4", True)
        got = lin(x, residual=res)
        assert got.dtype == torch.float32 and got.shape == (M, N)
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02 * want.abs().max().item())
        assert not torch.equal(got, want)  # the CPU INT4 kernel really ran
    gate_up = model.int4_linear(quantize_rtn(torch.randn(2 * N, K, generator=g) * 0.05, G))
    x = torch.randn(5, K, generator=g)
    want = model.Linear(gate_up.weight, None, gate_up.dequantized).silu_mul(x)
    torch.testing.assert_close(gate_up.silu_mul(x), want, rtol=0.02, atol=0.02 * want.abs().max().item())


def test_cpu_int4_form_is_built_only_when_switched_on() -> None:
    from kernels.int4_matmul import quantize_rtn

    q = quantize_rtn(torch.randn(64, 128), 32)
    assert not model.CPU_INT4 and model.int4_linear(q).cpu_int4 is None


# ------------------------------------------------------------------------------------------------------
# CPU_LINEAR "auto": each shape's form as time_cpu_forms measured it, per row bucket
# ------------------------------------------------------------------------------------------------------


def test_auto_takes_each_buckets_measured_form(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(192, 160, generator=g), torch.randn(64, 160, generator=g)
    lin = Linear(w)
    calls: list[int] = []

    def recording(x, w, b=None):
        calls.append(x.shape[0])
        return cpu_linear(x, w, b)

    def took_cpu_linear(M: int) -> bool:
        calls.clear()
        torch.testing.assert_close(lin(x[:M]), F.linear(x[:M], w), rtol=1e-5, atol=1e-4)
        return calls == [M]

    monkeypatch.setattr(model, "cpu_linear", recording)
    monkeypatch.setattr(model, "CPU_LINEAR", "auto")
    monkeypatch.setattr(model, "_CPU_FORMS", {})
    assert not took_cpu_linear(1) and not took_cpu_linear(9)  # a shape no model timed: F.linear
    model._CPU_FORMS[(192, 160, torch.float32)] = ("cpu_linear", "f_linear", "cpu_linear", "f_linear", "cpu_linear")
    # buckets 1, 2-4, 5-16, 17-32, 33-64
    for M, takes in ((1, True), (3, False), (4, False), (5, True), (16, True), (17, False), (32, False), (33, True),
                     (64, True)):
        assert took_cpu_linear(M) == takes, M
    assert not took_cpu_linear(65)  # past CPU_LINEAR_MAX_ROWS: F.linear whatever was timed
    monkeypatch.setattr(model.invariant, "_enabled", True)  # the batch-invariant mode: its own form at every width
    for M in (3, 40, 65):
        assert not took_cpu_linear(M) and torch.equal(lin(x[:M]), model.cpu_linear_invariant(x[:M], w))
    monkeypatch.setattr(model.invariant, "_enabled", False)
    for fixed in (True, False):  # SPECGATE_CPU_LINEAR=1 / 0
        monkeypatch.setattr(model, "CPU_LINEAR", fixed)
        assert [took_cpu_linear(M) for M in (1, 3, 9, 40)] == [fixed] * 4


def _model(hidden: int = 128) -> model.Transformer:
    from engine_util import random_weights, tiny_config

    cfg = tiny_config(vocab=512, layers=2, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=4,
                      num_kv_heads=2, head_dim=hidden // 4)
    return model.Transformer.from_weights(cfg, random_weights(cfg), torch.float32, "cpu").quantize(32)


@pytest.mark.parametrize("cpu_linear_cost", ["free", "slow"])
def test_time_cpu_forms_follows_the_measurement(monkeypatch: pytest.MonkeyPatch, cpu_linear_cost: str) -> None:
    """time_cpu_forms keeps, per shape and bucket, the form that timed faster: with cpu_linear's form made
    free every pick is it, made slow (twenty F.linear calls a call: slower whatever else loads the machine)
    none is. Every shape of the model and of a self-draft sharing its weights is timed once."""
    target = _model()

    def slow(x, w, b=None):
        for _ in range(20):
            y = F.linear(x, w, b)
        return y

    fake = (lambda x, w, b=None: x) if cpu_linear_cost == "free" else slow
    monkeypatch.setattr(model, "cpu_linear", fake)
    monkeypatch.setattr(model, "CPU_ONEDNN", False)  # the two forms alone (oneDNN's: the tests below)
    monkeypatch.setattr(model, "_CPU_FORMS", {})
    forms = model.time_cpu_forms([target, target.truncated(1)])
    # qkv, o, gate_up (and the head: 512 x 128 too), down
    assert set(forms) == {(256, 128), (128, 128), (512, 128), (128, 256)}
    want = "cpu_linear" if cpu_linear_cost == "free" else "f_linear"
    assert all(picks == (want,) * len(model.CPU_LINEAR_BUCKETS) for picks in forms.values()), forms
    assert model._CPU_FORMS == {(n, k, torch.float32): p for (n, k), p in forms.items()}
    assert all(lin.onednn is None for lin in (target.lm_head, target.layers[0].qkv))


onednn = pytest.mark.skipif(not model.CPU_ONEDNN, reason="this torch build has no oneDNN linear")


@onednn
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 16, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_f_linear(M: int, bias: bool) -> None:
    """oneDNN's form over a prepacked weight, its rows padded to the bucket's top (3 -> 4, 5 -> 16, 17 -> 64)."""
    g = torch.Generator().manual_seed(M)
    x, w = torch.randn(M, 96, generator=g), torch.randn(160, 96, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    y = model.onednn_linear(x, model.onednn_pack(w), b)
    assert y.shape == (M, 160) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@onednn
def test_time_cpu_forms_packs_the_shapes_that_pick_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """With oneDNN's form made free, every shape picks it: each Linear of the model and of a self-draft sharing
    its tensors keeps the packed copy of the weight it multiplies, calls at any row count up to the limit go
    through oneDNN (padded to the bucket), and the forward's logits stay F.linear's. A Linear whose weight was
    replaced since falls back to the plain forms."""
    target = _model()
    calls: list[int] = []
    real = model.onednn_linear

    def recording(x, packed, b=None):
        calls.append(x.shape[0])
        return real(x, packed, b)

    timing = [True]
    monkeypatch.setattr(model, "onednn_linear", lambda x, p, b=None: x if timing[0] else recording(x, p, b))
    monkeypatch.setattr(model, "CPU_LINEAR", "auto")
    monkeypatch.setattr(model, "_CPU_FORMS", {})
    draft = target.truncated(1)
    forms = model.time_cpu_forms([target, draft])
    timing[0] = False
    assert all(picks == ("onednn",) * len(model.CPU_LINEAR_BUCKETS) for picks in forms.values()), forms
    head, qkv = target.lm_head, target.layers[0].qkv
    assert head.onednn is not None and head.onednn[0] is (head.dequantized if head.dequantized is not None
                                                           else head.weight)
    assert draft.layers[0].qkv.onednn[1] is qkv.onednn[1]  # one packed copy per shared tensor
    g = torch.Generator().manual_seed(3)
    w = qkv.dequantized
    for M in (1, 3, 9, 64, 65):
        x = torch.randn(M, w.shape[1], generator=g)
        calls.clear()
        torch.testing.assert_close(qkv(x), F.linear(x, w, qkv.bias), rtol=1e-5, atol=1e-4)
        assert calls == ([M] if M <= model.CPU_LINEAR_MAX_ROWS else []), M
    moved = Linear(w.clone(), qkv.bias, onednn=qkv.onednn)  # another tensor than the packed one: not oneDNN
    calls.clear()
    torch.testing.assert_close(moved(x[:4]), F.linear(x[:4], w, qkv.bias), rtol=1e-5, atol=1e-4)
    assert calls == []


def test_the_load_log_names_the_shapes_that_take_cpu_linear() -> None:
    from gateway.llm import cpu_forms_line

    c, f, o = "cpu_linear", "f_linear", "onednn"
    line = cpu_forms_line({(576, 1536): (f, f, c, o, o), (960, 576): (c, c, f, f, c), (49152, 576): (f,) * 5}, 1.25)
    assert line.startswith("CPU projections: (W @ x.T).T for 576x1536 at 5-16 rows; 960x576 at 1, 2-4, 33-64 rows; "
                           "oneDNN for 576x1536 at 17-32, 33-64 rows; F.linear elsewhere")
    assert "49152x576" not in line and "1.2s" in line
    assert cpu_forms_line({(49152, 576): (f,) * 5}, 0.1).count("no shape") == 2


@pytest.mark.parametrize("form", ["cpu_linear", "f_linear",
                                  pytest.param("onednn", marks=pytest.mark.skipif(not model.CPU_ONEDNN,
                                                                                  reason="no oneDNN linear"))])
@pytest.mark.parametrize("shape", [(576, 1536), (3072, 576)], ids=["down", "gate_up"])
def test_the_invariant_form_gives_a_row_the_same_bits_at_any_row_count(monkeypatch: pytest.MonkeyPatch,
                                                                       shape: tuple[int, int], form: str) -> None:
    """The batch-invariant mode on the CPU: a row's projection is bit-identical whatever rows share the call and
    wherever it sits among them, decode widths and prefill widths alike, with a bias and a residual, in each
    form of the chunks (oneDNN's where the 4-row bucket picked it). SmolLM2's shapes: on a 2-core AMX machine
    cpu_linear's rows of the down projection over the whole batch differed between M <= 33 and M = 64, and
    F.linear's between M <= 9 and M = 300."""
    N, K = shape
    g = torch.Generator().manual_seed(N)
    lin = Linear(torch.randn(N, K, generator=g) * 0.05, torch.randn(N, generator=g))
    x, res = torch.randn(200, K, generator=g), torch.randn(200, N, generator=g)
    if form == "onednn":
        monkeypatch.setattr(model, "CPU_LINEAR", "auto")
        monkeypatch.setattr(model, "_CPU_FORMS", {(N, K, torch.float32): ("onednn",) * len(model.CPU_LINEAR_BUCKETS)})
        lin.onednn = (lin.weight, model.onednn_pack(lin.weight))
        calls: list[int] = []
        real = model.onednn_linear
        monkeypatch.setattr(model, "onednn_linear", lambda x, p, b=None: calls.append(x.shape[0]) or real(x, p, b))
    else:
        monkeypatch.setattr(model, "CPU_LINEAR", form == "cpu_linear")
    monkeypatch.setattr(model.invariant, "_enabled", True)
    ref = lin(x, residual=res)
    torch.testing.assert_close(ref, F.linear(x, lin.weight, lin.bias) + res, rtol=1e-5, atol=1e-4)
    assert lin(x[:0], residual=res[:0]).shape == (0, N)  # a forward with no rows for this projection
    for start, M in ((0, 1), (7, 1), (5, 3), (17, 9), (3, 64), (100, 77), (61, 139)):
        rows = slice(start, start + M)
        assert torch.equal(lin(x[rows], residual=res[rows]), ref[rows]), (start, M)
    if form == "onednn":
        assert calls and set(calls) == {model.INVARIANT_CPU_ROWS}  # every chunk through oneDNN, none padded


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


@onednn
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from /proc")
def test_onednn_builds_primitives_for_the_bucket_sizes_alone() -> None:
    """oneDNN builds and caches a primitive per row count it meets. Padded to the bucket tops, calls at every row
    count from 1 to 64 cost no memory past what the four bucket sizes took: unpadded, on SmolLM2's five shapes,
    they grew a process by 185 MB (360 -> 545 MB)."""
    g = torch.Generator().manual_seed(0)
    packs = [(model.onednn_pack(torch.randn(n, k, generator=g)), k) for n, k in [(960, 576), (3072, 576), (576, 1536)]]
    for M in model.CPU_LINEAR_BUCKETS:
        for p, k in packs:
            model.onednn_linear(torch.randn(M, k), p)
    warm = _rss_mb()
    for M in range(1, model.CPU_LINEAR_MAX_ROWS + 1):
        for p, k in packs:
            model.onednn_linear(torch.randn(M, k), p)
    assert _rss_mb() - warm < 16, f"{warm:.0f} -> {_rss_mb():.0f} MB"
