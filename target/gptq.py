"""GPTQ calibration: INT4 weights whose rounding error is compensated with second-order input statistics.

The idea and the algorithm are GPTQ's ("GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", and its AutoGPTQ / GPTQModel implementations): for each linear layer, with
``H = 2 X^T X`` over its calibration inputs, quantize one input column at a time and spread that column's
error over the columns not yet quantized, weighted by the rows of the upper Cholesky factor of ``H^-1``.
Updates are applied lazily in column blocks, and group scales / zeros are chosen on the fly from the
already-updated weights, the first time a group's column comes up.

Layers are processed in order ("true sequential"): each projection sees inputs computed through the
projections already quantized before it, and the next layer's calibration inputs are the quantized layer's
outputs. Fused ``qkv`` and ``gate_up`` share their input, so one Hessian serves all their rows.

Act-order (``desc_act``) visits columns by decreasing ``diag(H)``, so the inputs that matter most are
rounded while the most columns remain to absorb their error. The kernel has no ``g_idx``: a group must be
contiguous in the stored K. ``act_order`` chooses how:

* ``off``: the original order; each group's grid from its updated columns when it comes up.
* ``static``: GPTQ's ``static_groups``. Columns visited by decreasing ``diag(H)``, but every group's grid
  comes from the original weight before any update. K stays as it came. The default.
* ``group``: group-aware reordering (GPTQModel's ``act_group_aware``): groups visited by decreasing largest
  ``diag(H)``, each group's columns by decreasing ``diag(H)``, grids chosen from the updated columns as
  with ``off``. K stays as it came, so nothing is gathered at run time.
* ``perm``: true act-order (``desc_act`` with dynamic groups): a group is G consecutive columns of the
  visiting order, and K is stored in that order with ``Linear.perm``, which costs a gather of the input on
  every matmul of ``qkv`` and ``gate_up``. ``down``'s permutation is free: it is folded into ``gate_up``'s
  rows. ``o`` uses ``group`` (see ``_quantize_layer``).

``mse=True`` searches each group's grid (``mse_group_params``) instead of taking its [min, max].

On the embedded SmolLM2 (bench/results/quant.json) the mse grids matter most: they halve the KL to dense
for ``static`` and ``group``, which then tie, while ``perm`` stays behind both. That checkpoint is a Q4_1
GGUF whose weights sit on group-32 min-max grids in the original order, which ``static`` and ``group``
groups keep whole and ``perm`` groups mix; on other weights ``perm`` may well win. ``static`` with mse
grids is the default: the best perplexity of the perm-free orders, no run-time gather, and a K that
tensor parallelism can split anywhere.

End-loss guidance (``output_saliency``, GuidedQuant) is on by default in 8 row groups: one backward pass of the
dense model over the calibration weighs each token, per group of output rows, by how much the model's loss
depends on that output, and each row group gets its own Hessian. GPTAQ's asymmetric objective (aiming each
projection at the dense model's outputs on the dense model's own inputs, by a ridge fit of the weight before
GPTQ) was tried and removed: on SmolLM2 it did not lower the KL on held-out prose, and together with guidance
it raised it above plain GPTQ's (the ``_asym`` rows of bench/results/quant_pydoc.json).

Zero points are fractional by default: GPTQ and AWQ files round them to 4-bit integers because that is
how they store them, but our layout keeps zeros in the activation dtype, so each group's grid can span
exactly its [min, max]. ``round_zero=True`` gives the integer grid (``quantize_rtn``'s).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kernels.int4_matmul import Int4Weight, pack_int4
from kernels.fused_norm_rope import apply_rope
from kernels.fused_norm_rope import rms_norm_ref as rms_norm
from target.batch import Segment, build_batch
from target.loader import LoadedCheckpoint, load_checkpoint
from target.model import Layer, Linear, Transformer, int4_group_size, int4_linear
from target.qtune import PROJ_NAMES, TuneConfig, on_device, sequence_logits, tune_scales
from target.quant_formats import save_quantized

BLOCK_SIZE = 128  # columns per lazy batch update (GPTQ's default)
SHRINK_STEPS, SHRINK_MAX = 12, 0.3  # mse grids: each end of min-max moved in by 0, 2.5%, ..., 30%
ActOrder = Literal["off", "static", "group", "perm"]
ACT_ORDERS: tuple[str, ...] = get_args(ActOrder)
DEFAULT_ACT_ORDER: ActOrder = "static"
DEFAULT_MSE = True
DEFAULT_GUIDED = 8  # end-loss guidance (``output_saliency``) in this many row groups of each projection
CALIB_SEQS, CALIB_LEN = 128, 256  # what ``cached_gptq`` samples: 5 to 10 minutes on two CPU cores for 135M
# ``cached_gptq(tune_steps=...)`` tunes on this many more sampled sequences (seed 1): on SmolLM2, 512 were
# overfit within an epoch (bench/results/quant_tuned.json), and 4096 at 16 a step cut the held-out KL by 37%
# (quant_tunecode.json)
TUNE_SEQS = 8192
# what --gptq-tune-steps trains: scales, zeros, norms and codes, 32 sequences a step. The recipe of
# bench/results/quant_pydoc_gpu.json: 600 steps after guided GPTQ at group 64 took SmolLM2 from +5.1% to +2.9%
# perplexity over dense bf16 (600 steps after plain GPTQ at g128, 16 a step on 4096: +6.8% to +3.8%)
SERVE_TUNE = TuneConfig(batch_size=32, tune_norms=True, tune_codes=True)
# by name, for LoadConfig.gptq_tune: "scales" trains scales and zeros alone. The code offsets and their Adam
# moments hold 16 bytes per weight in training (about 112 GB for an 8B model), the scales' a few percent of that
TUNE_RECIPES = {"all": SERVE_TUNE, "scales": replace(SERVE_TUNE, tune_norms=False, tune_codes=False)}


# --- one weight -------------------------------------------------------------------------------------

def range_params(lo: torch.Tensor, hi: torch.Tensor, use_zero_point: bool,
                 round_zero: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point ([N], [N] float32) of the grid spanning each row's ``[lo, hi]`` ([N] each).

    ``round_zero``: ``quantize_rtn``'s grid, as GPTQ / AWQ files must use (they pack zeros in 4 bits):
    [min(lo, 0), max(hi, 0)] onto 0..15 with an integer zero. Without it, the grid spans exactly [lo, hi]
    with a fractional zero, which our layout stores for free (zeros are in the activation dtype).
    """
    if not use_zero_point:
        scale = (torch.maximum(lo.abs(), hi.abs()) / 7).clamp(min=1e-8)
        return scale, torch.full_like(scale, 8.0)
    if round_zero:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        return scale, (-lo / scale).round().clamp(0, 15)
    # a near-constant group would get a huge zero (-lo / scale) that fp16 cannot hold: keep it below 15e3
    span = (hi - lo).clamp(min=1e-3 * torch.maximum(lo.abs(), hi.abs())).clamp(min=1e-8)
    return span / 15, -lo / (span / 15)


def group_params(w: torch.Tensor, use_zero_point: bool, round_zero: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of one group ``w: [N, G]`` (float32): the min-max grid, [N], [N]."""
    return range_params(w.amin(-1), w.amax(-1), use_zero_point, round_zero)


def mse_group_params(w: torch.Tensor, importance: torch.Tensor, use_zero_point: bool, round_zero: bool,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid of one group ``w: [N, G]`` with the smallest rounding error weighted by ``importance: [G]``,
    among the min-max range with its low and high ends each moved in by 0, 1, ..., SHRINK_STEPS steps of
    ``SHRINK_MAX / SHRINK_STEPS`` of their distance to zero (or to the end nearer zero when zero lies outside).
    Scale and zero [N] as stored in ``dtype``.

    After AutoGPTQ / GPTQModel's ``Quantizer.find_params(mse=True)``, which shrinks both ends by one factor
    and weighs every column alike (AWQ's clip search is the same idea on outputs). On SmolLM2's layers
    (``tr(E H E^T)`` after GPTQ), moving the two ends independently more than doubled what one shared factor
    gains, and weighing columns by the loss GPTQ itself assigns them (``1 / [H_F^-1]_jj``, see
    ``gptq_quantize``) beat ``diag(H)`` and equal weights. The min-max grid is among the candidates and a row
    only moves on a strictly smaller error, so the result is never worse than min-max by this measure.
    """
    lo, hi = w.amin(-1), w.amax(-1)  # [N]
    centre = torch.zeros_like(lo).clamp(lo, hi)  # [N]: zero, or the end nearer it
    shrink = 1 - SHRINK_MAX * torch.arange(SHRINK_STEPS + 1, device=w.device) / SHRINK_STEPS  # [S]
    his = centre + shrink[:, None] * (hi - centre)  # [S, N]: every high end, tried at once
    best = torch.full_like(lo, float("inf"))
    best_scale, best_zero = torch.empty_like(lo), torch.empty_like(lo)
    rows = torch.arange(lo.numel(), device=w.device)
    for p in shrink.tolist():
        scale, zero = _stored(*range_params(centre + p * (lo - centre), his, use_zero_point, round_zero), dtype)
        scale, zero = scale[..., None], zero[..., None]  # [S, N, 1]
        q = (w / scale + zero).round().clamp(0, 15)  # [S, N, G]
        err, at = ((w - (q - zero) * scale).square() @ importance).min(0)  # [N], best high end per row
        better = err < best
        best = torch.where(better, err, best)
        best_scale = torch.where(better, scale[at, rows, 0], best_scale)
        best_zero = torch.where(better, zero[at, rows, 0], best_zero)
    return best_scale, best_zero


def inverse_hessian_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``: [K, K] float32.

    Damping keeps H positive definite when some input directions are rarely excited; it is raised
    tenfold when the factorization still fails (a nearly rank-deficient calibration set).
    """
    mean_diag = h.diagonal().mean()
    for attempt in range(4):
        hd = h.clone()
        hd.diagonal().add_(damp * 10**attempt * mean_diag)
        lower, info = torch.linalg.cholesky_ex(hd)
        if int(info) == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)
    raise ValueError(f"Hessian is not positive definite even with damping {damp * 1000}: too little calibration data?")


def visiting_order(diag: torch.Tensor, group_size: int, act_order: ActOrder) -> torch.Tensor:
    """[K] int64: the input columns in the order GPTQ quantizes them (see the module docstring).

    ``group``: groups by decreasing largest ``diag(H)``, each group's columns by decreasing ``diag(H)``
    (GPTQModel's ``act_group_aware``, after Gafni et al.'s group-aware reordering), so every group's
    columns stay consecutive in the original order too.
    """
    K, G = diag.numel(), group_size
    if act_order == "off":
        return torch.arange(K, device=diag.device)
    if act_order != "group":
        return torch.argsort(diag, descending=True, stable=True)
    by_group = diag.view(K // G, G)  # [K/G, G]
    groups = torch.argsort(by_group.amax(1), descending=True, stable=True)  # [K/G]
    within = torch.argsort(by_group, dim=1, descending=True, stable=True)  # [K/G, G]
    return (within[groups] + G * groups[:, None]).flatten()


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, group_size: int, act_order: ActOrder = "off",
                  damp: float = 0.01, mse: bool = False, use_zero_point: bool = True, round_zero: bool = False,
                  dtype: torch.dtype | None = None) -> tuple[Int4Weight, torch.Tensor | None]:
    """GPTQ one weight ``w: [N, K]`` given its input Hessian ``h: [K, K]``; scales/zeros in ``dtype``.

    Returns the INT4 weight and, for ``act_order="perm"`` only, the [K] input order its K is stored in
    (``Linear.perm``: y = x[..., perm] @ W'.T); every other order stores K as it came.
    ``mse``: each group's grid from ``mse_group_params`` rather than min-max. ``round_zero``: integer zero
    points (see ``range_params``).
    """
    N, K = w.shape
    G = group_size
    if K % G or G % 8:
        raise ValueError(f"in_features {K} must be a multiple of group_size {G} (itself a multiple of 8)")
    if act_order not in ACT_ORDERS:
        raise ValueError(f"act_order must be one of {ACT_ORDERS}, got {act_order!r}")
    dtype = dtype or w.dtype

    def fit(group: torch.Tensor, importance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if mse:  # [N, G], [G] -> scale, zero [N] as stored
            return mse_group_params(group, importance, use_zero_point, round_zero, dtype)
        return _stored(*group_params(group, use_zero_point, round_zero), dtype)

    W, H = w.float().clone(), h.float().clone()
    dead = H.diagonal() == 0  # inputs that are always zero: their weights cannot matter
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = visiting_order(H.diagonal(), G, act_order)  # [K]
    W0, (W, H) = W, (W[:, perm], H[perm][:, perm])  # W0: as it came; the sweep updates W in place
    U = inverse_hessian_factor(H, damp)  # [K, K] upper
    # [K] in visiting order: 1 / [H_F^-1]_jj, the weight GPTQ's loss gives column j's rounding error once the
    # columns after it (F) have absorbed what they can of it; it weighs the mse grid search
    importance = U.diagonal() ** -2
    # [K]: where the column visited j-th is stored (its original place, or for "perm" its place in the order)
    stored_at = torch.arange(K, device=W.device) if act_order == "perm" else perm
    scales = torch.zeros(N, K // G, device=W.device)  # [N, K/G]
    zeros = torch.zeros_like(scales)
    if act_order == "static":  # grids from the original weight (see the module docstring)
        imp = torch.empty_like(importance)
        imp[perm] = importance  # back to the original order
        for g in range(K // G):
            scales[:, g], zeros[:, g] = fit(W0[:, g * G:(g + 1) * G], imp[g * G:(g + 1) * G])
    codes = torch.empty(N, K, device=W.device)
    codes[:, stored_at] = _sweep(W, U, stored_at // G, scales, zeros, None if act_order == "static" else
                                 lambda j, cols: fit(cols, importance[j:j + G]))
    z = zeros.T.contiguous().to(dtype) if use_zero_point else None
    return Int4Weight(pack_int4(codes), scales.T.contiguous().to(dtype), z, G), perm if act_order == "perm" else None


def _sweep(W: torch.Tensor, U: torch.Tensor, col_group: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           fit: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None) -> torch.Tensor:
    """GPTQ's column loop: codes [N, K] (float) of ``W: [N, K]``, both in visiting order; W is updated in place.

    ``U``: the upper Cholesky factor of ``H^-1`` in that order. ``col_group: [K]``: the column of ``scales`` /
    ``zeros`` ([N, K/G], filled in place) that the j-th visited column uses. ``fit(j, W[:, j:j + G])``, when given,
    sets that group's grid from the updated columns when its first column j comes up (G consecutive columns of
    the visiting order form one group then); without it the grids are already set.
    """
    N, K = W.shape
    G = K // scales.shape[1]
    codes = torch.zeros(N, K, device=W.device)
    col_group = col_group.tolist()
    block = G * -(-BLOCK_SIZE // G)  # whole groups per block, so a group's columns are all updated in W1
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]
        err = torch.zeros_like(W1)  # [N, block] scaled errors, replayed onto the later blocks at once
        for i in range(i2 - i1):
            g = col_group[i1 + i]
            if fit is not None and (i1 + i) % G == 0:  # a group's first column: its grid, from W1 as updated
                scales[:, g], zeros[:, g] = fit(i1 + i, W1[:, i:i + G])
            q = (W1[:, i] / scales[:, g] + zeros[:, g]).round().clamp(0, 15)  # [N]
            codes[:, i1 + i] = q
            err[:, i] = (W1[:, i] - (q - zeros[:, g]) * scales[:, g]) / U1[i, i]
            W1[:, i:] -= err[:, i, None] * U1[i, None, i:]
        W[:, i2:] -= err @ U[i1:i2, i2:]
    return codes


def _stored(scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Round scale and zero to the dtype they are stored in, so the error GPTQ compensates is the real one."""
    return scale.to(dtype).float(), zero.to(dtype).float()


# --- the model, layer by layer ----------------------------------------------------------------------

def quantize_gptq(model: Transformer, calib: list[list[int]], group_size: int = 128,
                  act_order: ActOrder = DEFAULT_ACT_ORDER, mse: bool = DEFAULT_MSE, damp: float = 0.01,
                  use_zero_point: bool = True, round_zero: bool = False, progress: bool = True,
                  saliency: Saliency | None = None) -> Transformer:
    """A copy of ``model`` whose projections are GPTQ INT4; embeddings, norms and lm_head stay dense.

    ``calib``: token id sequences (a few hundred of a few hundred tokens). Deterministic for fixed
    inputs and thread count (the Hessians' float sums follow the thread count, and a code near a rounding
    edge, or act-order's visiting order, with them). ``group_size`` falls back to 64 / 32 where K is not a
    multiple (as RTN does). Zero points are fractional by default (``round_zero=False``): a finer grid that
    our format holds at no cost.
    ``act_order`` and ``mse``: see the module docstring.
    ``saliency``: ``output_saliency(model, calib, ...)``, which guides each projection's rows by the end loss
    (GuidedQuant, see there); not with ``act_order="perm"``, whose one stored input order all rows share.
    """
    if not calib or any(not s for s in calib):
        raise ValueError("calibration needs at least one non-empty sequence")
    if saliency is not None and act_order == "perm":
        raise ValueError("saliency-guided GPTQ gives each row group its own Hessian, so its own act-order: "
                         "use act_order 'static', 'group' or 'off', not 'perm'")
    opts = dict(group_size=group_size, act_order=act_order, mse=mse, damp=damp, use_zero_point=use_zero_point,
                round_zero=round_zero)
    hs = [model.embed[torch.tensor(s, device=model.device)] for s in calib]  # S x [T, hidden]
    layers = []
    with torch.inference_mode():
        for i, layer in enumerate(tqdm(model.layers, desc="GPTQ", unit="layer", disable=not progress)):
            guide = None if saliency is None else {name: saliency[i, name] for name in PROJ_NAMES}
            q_layer, hs = _quantize_layer(model, layer, hs, opts, guide)
            layers.append(q_layer)
    return Transformer(model.config, model.embed, layers, model.norm, model.lm_head, model.dtype)


def _quantize_layer(model: Transformer, layer: Layer, hs: list[torch.Tensor], opts: dict,
                    guide: dict[str, list[torch.Tensor]] | None = None) -> tuple[Layer, list[torch.Tensor]]:
    """Quantize one layer's four projections in forward order; return it and its outputs on ``hs``.

    Under ``act_order="perm"``, ``o`` is quantized with ``"group"``: its input (the attention output) has no
    producer whose rows could absorb a permutation, and a gathered input could not be split along K under
    tensor parallelism. ``down``'s permutation is folded into ``gate_up``'s rows (``_fold_input_order``).
    ``guide``: each projection's saliencies (``output_saliency``), by name.
    """
    eps = model.config.rms_norm_eps
    g = guide or {}
    xs = [rms_norm(h, layer.input_norm, eps) for h in hs]
    qkv = _gptq_linear(layer.qkv, xs, saliency=g.get("qkv"), **opts)
    attn = [_attention(model, qkv(x)) for x in xs]  # S x [T, H * D]
    o_opts = {**opts, "act_order": "group"} if opts.get("act_order") == "perm" else opts
    o = _gptq_linear(layer.o, attn, saliency=g.get("o"), **o_opts)
    hs = [o(a, residual=h) for a, h in zip(attn, hs)]
    xs = [rms_norm(h, layer.post_norm, eps) for h in hs]
    gate_up = _gptq_linear(layer.gate_up, xs, saliency=g.get("gate_up"), **opts)
    acts = [gate_up.silu_mul(x) for x in xs]  # S x [T, I]
    down = _gptq_linear(layer.down, acts, saliency=g.get("down"), **opts)
    hs = [down(a, residual=h) for a, h in zip(acts, hs)]
    gate_up, down = _fold_input_order(gate_up, down)
    return replace(layer, qkv=qkv, o=o, gate_up=gate_up, down=down), hs


def _gptq_linear(lin: Linear, inputs: list[torch.Tensor], group_size: int,
                 saliency: list[torch.Tensor] | None = None, **opts) -> Linear:
    """Accumulate ``H = 2/n sum x^T x`` over every calibration token, then GPTQ the weight.

    With ``saliency`` (one ``[T, R]`` per input, ``output_saliency``), the rows are cut into R contiguous groups
    and group r is quantized against its own ``H_r = 2/n sum_t s_tr x_t^T x_t``.
    """
    if isinstance(lin.weight, Int4Weight):
        return lin
    N, K = lin.weight.shape
    G = int4_group_size(K, group_size)
    R = 1 if saliency is None else saliency[0].shape[1]
    h = torch.zeros(R, K, K, device=lin.weight.device)
    n = 0
    for j, x in enumerate(inputs):  # x: [T, K]
        xf = x.float()
        sal = 1.0 if saliency is None else saliency[j].to(xf.device).T[:, None, :]  # [R, 1, T]: tokens' weights
        h.baddbmm_(xf.T[None] * sal, xf.expand(R, -1, -1))  # [R, K, T] @ [R, T, K]
        n += xf.shape[0]
    h.mul_(2 / n)
    if R == 1:
        q, perm = gptq_quantize(lin.weight, h[0], G, dtype=lin.weight.dtype, **opts)
        return int4_linear(q, lin.bias, perm)
    qs = [gptq_quantize(lin.weight[rows], h[r], G, dtype=lin.weight.dtype, **opts)[0]
          for r, rows in enumerate(row_groups(N, R, lin.weight.device))]
    zeros = None if qs[0].zeros is None else torch.cat([q.zeros for q in qs], dim=1)
    q = Int4Weight(torch.cat([q.qweight for q in qs], dim=1), torch.cat([q.scales for q in qs], dim=1), zeros, G)
    return int4_linear(q, lin.bias, None)


def _fold_input_order(gate_up: Linear, down: Linear) -> tuple[Linear, Linear]:
    """Move ``down``'s input order into ``gate_up``'s output rows, so ``down`` gathers nothing at run time.

    ``silu(gate) * up`` is elementwise, so permuting the gate rows and the up rows alike permutes ``down``'s
    input exactly; INT4 groups run along K, so reordering ``gate_up``'s rows (N) changes no code or scale.
    Each tensor-parallel rank still gets matching slices: its gate / up rows are ``down``'s K slice.
    """
    if down.perm is None:
        return gate_up, down
    w = gate_up.weight
    assert isinstance(w, Int4Weight)
    rows = torch.cat([down.perm, down.perm + down.perm.numel()])  # [2I]: gate rows, then up rows
    zeros = None if w.zeros is None else w.zeros[:, rows].contiguous()
    w = Int4Weight(w.qweight[:, rows].contiguous(), w.scales[:, rows].contiguous(), zeros, w.group_size)
    bias = None if gate_up.bias is None else gate_up.bias[rows]
    return int4_linear(w, bias, gate_up.perm), replace(down, perm=None)


def _attention(model: Transformer, qkv: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of one whole sequence, the same maths as ``Transformer.forward``: [T, H * D]."""
    c = model.config
    H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
    T = qkv.shape[0]
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    freqs = torch.arange(T, device=qkv.device).float()[:, None] * model.inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
    cos, sin = emb.cos().to(model.dtype), emb.sin().to(model.dtype)
    q = apply_rope(q.view(T, H, D), cos, sin).transpose(0, 1)  # [H, T, D]
    k = apply_rope(k.view(T, Hkv, D), cos, sin).transpose(0, 1).repeat_interleave(H // Hkv, 0)  # [H, T, D]
    v = v.view(T, Hkv, D).transpose(0, 1).repeat_interleave(H // Hkv, 0)  # [H, T, D]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [H, T, D]
    return out.transpose(0, 1).reshape(T, H * D)


# --- end-loss guidance --------------------------------------------------------------------------------

# (layer, projection name) -> one [T, R] float32 tensor per calibration sequence
Saliency = dict[tuple[int, str], list[torch.Tensor]]


def row_groups(N: int, R: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, ...]:
    """The row indices of R contiguous groups of N output rows (sizes differ by at most one)."""
    if not 1 <= R <= N:
        raise ValueError(f"need 1 <= groups <= rows, got {R} groups of {N} rows")
    return torch.arange(N, device=device).tensor_split(R)


def output_saliency(model: Transformer, calib: list[list[int]], groups: int, batch_size: int = 8,
                    progress: bool = True) -> Saliency:
    """How much the end loss cares about each projection's output, per calibration token and row group.

    GuidedQuant ("GuidedQuant: Large Language Model Quantization via Exploiting End Loss Guidance", Kim et al.
    2025): GPTQ's layer objective ``sum_t |dW x_t|^2`` weighs every token and every output row alike, while the
    model's loss moves by about ``sum_t (g_t . dW x_t)^2``, ``g_t`` the loss's gradient in the layer's output.
    Keeping the rows' sums of ``g_tj^2`` over R contiguous row groups gives each group a Hessian of its own,
    ``H_r = sum_t s_tr x_t x_t^T`` (``_gptq_linear``), at R times GPTQ's Hessian memory.

    The loss is ``model``'s own negative log-likelihood of the sequences. Calibration sampled from the model
    (``sample_calibration``) makes each next token a draw from the model's distribution, so ``E[g g^T]`` is the
    Fisher information of the outputs: the curvature of ``KL(dense || quantized)``, what quantization should
    keep small. Gradients are taken on the dense model, in float32, over whole sequences (a token's gradient
    includes what later tokens' losses owe it through attention).
    Returns ``[T, R]`` per sequence, per ``(layer, name)`` of ``target.qtune.PROJ_NAMES`` (R = ``groups``, or a
    projection's row count where that is smaller).
    """
    if not calib or any(len(s) < 2 for s in calib):
        raise ValueError("saliency needs calibration sequences of at least two tokens")
    dense = on_device(model, model.device)
    out: Saliency = {}
    for lo in tqdm(range(0, len(calib), batch_size), desc="saliency", unit="batch", disable=not progress):
        seqs = calib[lo:lo + batch_size]
        T = max(map(len, seqs))
        tokens = torch.tensor([s + [0] * (T - len(s)) for s in seqs], device=model.device)
        mask = torch.tensor([[0 < j < len(s) for j in range(T)] for s in seqs], device=model.device)  # [B, T]
        probes: dict[tuple[int, str], torch.Tensor] = {}

        def tap(i: int, name: str, y: torch.Tensor) -> torch.Tensor:
            probes[i, name] = torch.zeros_like(y, requires_grad=True)
            return y + probes[i, name]

        logits = sequence_logits(dense, tokens, tap=tap)  # [B, T, V]
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
        (nll * mask[:, 1:].flatten()).sum().backward()
        for key, p in probes.items():
            g2 = p.grad.square()  # [B, T, N]
            cuts = row_groups(g2.shape[-1], min(groups, g2.shape[-1]), g2.device)  # a narrow projection: one row each
            s = torch.stack([g2[..., rows].sum(-1) for rows in cuts], -1)
            out.setdefault(key, []).extend(s[b, :len(seq)].detach().cpu() for b, seq in enumerate(seqs))
    return out


# --- calibration data -------------------------------------------------------------------------------

def sample_calibration(model: Transformer, num_seqs: int, seq_len: int, first_tokens: list[int], seed: int = 0,
                       batch_size: int = 32, per_sequence: bool = True) -> list[list[int]]:
    """Sequences sampled from the model itself at temperature 1, each from a random first token.

    Data-free calibration (as in LLM-QAT): the model's own text covers the activations it produces at
    inference, and no corpus has to ship. ``first_tokens``: ids to draw starts from (no special tokens).
    ``per_sequence``: sequence i has its own (CPU) generator, so it does not depend on ``batch_size``; each
    step then copies the batch's probabilities to the host and draws row by row. Otherwise each batch draws
    on the model's device from one generator (seeded by ``seed`` and the batch's place) with one host copy a
    step: the thousands of sequences that scale tuning wants, in seconds on a GPU, at the price of sequences
    that depend on ``batch_size``.
    """
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(num_seqs)]
    seqs = [[first_tokens[int(torch.randint(len(first_tokens), (1,), generator=g))]] for g in gens]
    out: list[list[int]] = []
    for b in range(0, num_seqs, batch_size):
        draw = gens[b:b + batch_size] if per_sequence else \
            torch.Generator(model.device).manual_seed(seed * 1_000_003 + num_seqs + b)
        out += _sample_batch(model, seqs[b:b + batch_size], seq_len, draw)
    return out


def sample_tuning_set(model: Transformer, num_seqs: int, seq_len: int, first_tokens: list[int],
                      seed: int) -> list[list[int]]:
    """``sample_calibration`` for the thousands of sequences scale tuning wants: on a GPU in batches of 512 drawn on
    the device (row-by-row host draws took minutes for a few hundred sequences there), per sequence elsewhere."""
    fast = model.device.type == "cuda"
    return sample_calibration(model, num_seqs, seq_len, first_tokens, seed, batch_size=512 if fast else 32,
                              per_sequence=not fast)


def _sample_batch(model: Transformer, seqs: list[list[int]], seq_len: int,
                  gens: list[torch.Generator] | torch.Generator) -> list[list[int]]:
    """Extend every sequence to ``seq_len`` tokens by ancestral sampling through the paged cache: row by row
    from ``gens`` (one per sequence) on the host, or from one device generator for the batch."""
    page = 16
    cache = model.new_cache(len(seqs) * (-(-seq_len // page) + 1), page)
    tables = [cache.new_table() for _ in seqs]
    ctx = [0] * len(seqs)
    while len(seqs[0]) < seq_len:
        segs = [Segment(t, c, s[c:]) for t, c, s in zip(tables, ctx, seqs)]
        logits = model.forward(build_batch(segs, cache, model.device), cache)  # [B, V]
        ctx = [len(s) for s in seqs]
        if isinstance(gens, torch.Generator):
            drawn = torch.multinomial(torch.softmax(logits.float(), dim=-1), 1, generator=gens)[:, 0].tolist()  # [B]
            seqs = [s + [t] for s, t in zip(seqs, drawn)]
            continue
        probs = torch.softmax(logits.float().cpu(), dim=-1)  # [B, V]
        seqs = [s + [int(torch.multinomial(p, 1, generator=g))] for s, p, g in zip(seqs, probs, gens)]
    return seqs


def text_windows(ids: list[int], num_seqs: int, seq_len: int, seed: int = 0) -> list[list[int]]:
    """``num_seqs`` random windows of ``seq_len`` tokens from a tokenized text (GPTQ's usual calibration)."""
    if len(ids) <= seq_len:
        raise ValueError(f"calibration text has {len(ids)} tokens; need more than seq_len {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(ids) - seq_len, (num_seqs,), generator=gen).tolist()
    return [ids[s:s + seq_len] for s in starts]


# --- calibrate once, reload after -------------------------------------------------------------------

def cached_gptq(model: Transformer, ckpt: LoadedCheckpoint, cache_root: Path, group_size: int = 128,
                act_order: ActOrder = DEFAULT_ACT_ORDER, mse: bool = DEFAULT_MSE, damp: float = 0.01,
                guided: int = DEFAULT_GUIDED,
                num_seqs: int = CALIB_SEQS, seq_len: int = CALIB_LEN, tune_steps: int = 0, tune_seqs: int = TUNE_SEQS,
                tune: TuneConfig = SERVE_TUNE, log: Callable[[str], None] = print) -> Transformer:
    """GPTQ ``model`` (built from ``ckpt``) once per checkpoint and settings; later calls reload the result
    saved under ``cache_root`` in our format. Calibration: ``num_seqs`` sequences sampled from the model.
    ``guided``: row groups of the end-loss guidance (``output_saliency``; 0 for none).
    ``tune_steps``: then tune as ``tune`` says (by default the scales, zeros, norms and codes) on ``tune_seqs``
    more sampled sequences, on the model's device (minutes on a GPU; far slower on a CPU)."""
    settings = {"method": "gptq", "group_size": group_size, "act_order": act_order, "mse": mse, "damp": damp,
                "zeros": "fractional", "calibration": f"sampled {num_seqs}x{seq_len} seed 0", "dtype": str(model.dtype),
                "guided": guided}
    if tune_steps:
        tune = replace(tune, steps=tune_steps)  # the config in force, as the key records it
        settings["tune"] = f"{tune_steps} steps on {tune_seqs}x{seq_len} sampled with seed 1, {tune}"
    key = json.dumps({"source": _fingerprint(Path(ckpt.source)), **settings}, sort_keys=True)
    out = cache_root / f"{Path(ckpt.source).stem}-gptq-g{group_size}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (out / "config.json").is_file():
        log(f"loading cached GPTQ weights from {out}")
        q = load_checkpoint(out, model.dtype)
        return Transformer.from_weights(q.config, q.weights, model.dtype, model.device, q.quantized)
    specials = set(ckpt.tokenizer.all_special_ids)
    first = [i for i in range(min(ckpt.config.vocab_size, len(ckpt.tokenizer))) if i not in specials]
    log(f"GPTQ: sampling {num_seqs} calibration sequences of {seq_len} tokens, then quantizing (once)")
    calib = sample_calibration(model, num_seqs, seq_len, first, seed=0)
    saliency = None
    if guided:
        log(f"GPTQ: the end loss's gradients over the calibration, in {guided} row groups per projection")
        saliency = output_saliency(model, calib, guided)
    q = quantize_gptq(model, calib, group_size, act_order, mse, damp, saliency=saliency)
    if tune_steps:
        parts = ["scales", "zeros"] + ["codes"] * tune.tune_codes + ["norms"] * tune.tune_norms
        log(f"tuning INT4 {', '.join(parts[:-1])} and {parts[-1]} for {tune_steps} steps on {tune_seqs} more "
            f"sampled sequences")
        seqs = sample_tuning_set(model, tune_seqs, seq_len, first, seed=1)
        q = tune_scales(q, model, seqs, tune)
    cache_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_root, prefix=".gptq-") as tmp:
        save_quantized(q, Path(tmp) / "q", ckpt.tokenizer, ckpt.chat_template, settings)
        try:  # one rename, so a reader never sees half a directory; a concurrent writer's copy wins
            (Path(tmp) / "q").rename(out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
    return q


def _fingerprint(source: Path) -> list[tuple[str, int, int]]:
    """Name, size and mtime of the checkpoint's files: a changed checkpoint recalibrates."""
    files = [source] if source.is_file() else sorted(f for f in source.iterdir() if f.is_file())
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
