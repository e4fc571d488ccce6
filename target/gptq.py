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

Act-order (``desc_act``) visits columns by decreasing ``diag(H)``. Our INT4 layout has no ``g_idx``, so
groups must stay contiguous in the original column order: we use GPTQ's "static groups" variant, where
every group's scale and zero come from the original weight before any update, and each column is then
quantized with its own group's parameters whatever the visiting order. The result needs no permutation.

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

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kernels.int4_matmul import Int4Weight, pack_int4
from kernels.fused_norm_rope import apply_rope
from kernels.fused_norm_rope import rms_norm_ref as rms_norm
from target.batch import Segment, build_batch
from target.loader import LoadedCheckpoint, load_checkpoint
from target.model import Layer, Linear, Transformer, int4_group_size, int4_linear
from target.quant_formats import save_quantized

BLOCK_SIZE = 128  # columns per lazy batch update (GPTQ's default)
CALIB_SEQS, CALIB_LEN = 128, 256  # what ``cached_gptq`` samples: 5 to 10 minutes on two CPU cores for 135M


# --- one weight -------------------------------------------------------------------------------------

def group_params(w: torch.Tensor, use_zero_point: bool, round_zero: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of one group ``w: [N, G]`` (float32): [N], [N].

    ``round_zero``: ``quantize_rtn``'s grid, as GPTQ / AWQ files must use (they pack zeros in 4 bits):
    [min(w, 0), max(w, 0)] onto 0..15 with an integer zero. Without it, the grid spans exactly [min, max]
    with a fractional zero, which our layout stores for free (zeros are in the activation dtype).
    """
    if not use_zero_point:
        scale = (w.abs().amax(-1) / 7).clamp(min=1e-8)
        return scale, torch.full_like(scale, 8.0)
    if round_zero:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        return scale, (-lo / scale).round().clamp(0, 15)
    lo, hi = w.amin(-1), w.amax(-1)
    # a near-constant group would get a huge zero (-lo / scale) that fp16 cannot hold: keep it below 15e3
    span = (hi - lo).clamp(min=1e-3 * torch.maximum(lo.abs(), hi.abs())).clamp(min=1e-8)
    return span / 15, -lo / (span / 15)


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


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, group_size: int, desc_act: bool = False, damp: float = 0.01,
                  use_zero_point: bool = True, round_zero: bool = False,
                  dtype: torch.dtype | None = None) -> Int4Weight:
    """GPTQ one weight ``w: [N, K]`` given its input Hessian ``h: [K, K]``; scales/zeros in ``dtype``.
    ``round_zero``: integer zero points (see ``group_params``)."""
    N, K = w.shape
    G = group_size
    if K % G or G % 8:
        raise ValueError(f"in_features {K} must be a multiple of group_size {G} (itself a multiple of 8)")
    dtype = dtype or w.dtype

    def params(group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [N, G] -> scale, zero [N] as stored
        return _stored(*group_params(group, use_zero_point, round_zero), dtype)

    W, H = w.float().clone(), h.float().clone()
    dead = H.diagonal() == 0  # inputs that are always zero: their weights cannot matter
    H[dead, dead] = 1
    W[:, dead] = 0
    scales = torch.zeros(N, K // G, device=W.device)  # [N, K/G]
    zeros = torch.zeros_like(scales)
    if desc_act:  # static groups: parameters from the original weight (see the module docstring)
        for g in range(K // G):
            scales[:, g], zeros[:, g] = params(W[:, g * G:(g + 1) * G])
    perm = torch.argsort(H.diagonal(), descending=True) if desc_act else torch.arange(K, device=W.device)
    W, H = W[:, perm], H[perm][:, perm]
    U = inverse_hessian_factor(H, damp)  # [K, K] upper
    codes = torch.zeros(N, K, device=W.device)
    col_group = (perm // G).tolist()  # group of the column visited i-th
    block = G * -(-BLOCK_SIZE // G)  # whole groups per block, so a group's columns are all updated in W1
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]
        err = torch.zeros_like(W1)  # [N, block] scaled errors, replayed onto the later blocks at once
        for i in range(i2 - i1):
            g = col_group[i1 + i]
            if not desc_act and (i1 + i) % G == 0:
                scales[:, g], zeros[:, g] = params(W1[:, i:i + G])
            q = (W1[:, i] / scales[:, g] + zeros[:, g]).round().clamp(0, 15)  # [N]
            codes[:, i1 + i] = q
            err[:, i] = (W1[:, i] - (q - zeros[:, g]) * scales[:, g]) / U1[i, i]
            W1[:, i:] -= err[:, i, None] * U1[i, None, i:]
        W[:, i2:] -= err @ U[i1:i2, i2:]
    codes = codes[:, torch.argsort(perm)]
    z = zeros.T.contiguous().to(dtype) if use_zero_point else None
    return Int4Weight(pack_int4(codes), scales.T.contiguous().to(dtype), z, G)


def _stored(scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Round scale and zero to the dtype they are stored in, so the error GPTQ compensates is the real one."""
    return scale.to(dtype).float(), zero.to(dtype).float()


# --- the model, layer by layer ----------------------------------------------------------------------

def quantize_gptq(model: Transformer, calib: list[list[int]], group_size: int = 128, desc_act: bool = False,
                  damp: float = 0.01, use_zero_point: bool = True, round_zero: bool = False,
                  progress: bool = True) -> Transformer:
    """A copy of ``model`` whose projections are GPTQ INT4; embeddings, norms and lm_head stay dense.

    ``calib``: token id sequences (a few hundred of a few hundred tokens). Deterministic for fixed
    inputs. ``group_size`` falls back to 64 / 32 where K is not a multiple (as RTN does). Zero points
    are fractional by default (``round_zero=False``): a finer grid that our format holds at no cost.
    """
    if not calib or any(not s for s in calib):
        raise ValueError("calibration needs at least one non-empty sequence")
    opts = dict(group_size=group_size, desc_act=desc_act, damp=damp, use_zero_point=use_zero_point,
                round_zero=round_zero)
    hs = [model.embed[torch.tensor(s, device=model.device)] for s in calib]  # S x [T, hidden]
    layers = []
    with torch.inference_mode():
        for layer in tqdm(model.layers, desc="GPTQ", unit="layer", disable=not progress):
            q_layer, hs = _quantize_layer(model, layer, hs, opts)
            layers.append(q_layer)
    return Transformer(model.config, model.embed, layers, model.norm, model.lm_head, model.dtype)


def _quantize_layer(model: Transformer, layer: Layer, hs: list[torch.Tensor],
                    opts: dict) -> tuple[Layer, list[torch.Tensor]]:
    """Quantize one layer's four projections in forward order; return it and its outputs on ``hs``."""
    eps = model.config.rms_norm_eps
    xs = [rms_norm(h, layer.input_norm, eps) for h in hs]
    qkv = _gptq_linear(layer.qkv, xs, **opts)
    attn = [_attention(model, qkv(x)) for x in xs]  # S x [T, H * D]
    o = _gptq_linear(layer.o, attn, **opts)
    hs = [o(a, residual=h) for a, h in zip(attn, hs)]
    xs = [rms_norm(h, layer.post_norm, eps) for h in hs]
    gate_up = _gptq_linear(layer.gate_up, xs, **opts)
    acts = [gate_up.silu_mul(x) for x in xs]  # S x [T, I]
    down = _gptq_linear(layer.down, acts, **opts)
    hs = [down(a, residual=h) for a, h in zip(acts, hs)]
    return replace(layer, qkv=qkv, o=o, gate_up=gate_up, down=down), hs


def _gptq_linear(lin: Linear, inputs: list[torch.Tensor], group_size: int, **opts) -> Linear:
    """Accumulate ``H = 2/n sum x^T x`` over every calibration token, then GPTQ the weight."""
    if isinstance(lin.weight, Int4Weight):
        return lin
    K = lin.weight.shape[1]
    h = torch.zeros(K, K, device=lin.weight.device)
    n = 0
    for x in inputs:  # x: [T, K]
        xf = x.float()
        h.addmm_(xf.T, xf)
        n += xf.shape[0]
    h.mul_(2 / n)
    q = gptq_quantize(lin.weight, h, int4_group_size(K, group_size), dtype=lin.weight.dtype, **opts)
    return int4_linear(q, lin.bias)


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


# --- calibration data -------------------------------------------------------------------------------

def sample_calibration(model: Transformer, num_seqs: int, seq_len: int, first_tokens: list[int], seed: int = 0,
                       batch_size: int = 32) -> list[list[int]]:
    """Sequences sampled from the model itself at temperature 1, each from a random first token.

    Data-free calibration (as in LLM-QAT): the model's own text covers the activations it produces at
    inference, and no corpus has to ship. ``first_tokens``: ids to draw starts from (no special tokens).
    Sequence i has its own generator, so it does not depend on ``batch_size``.
    """
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(num_seqs)]
    seqs = [[first_tokens[int(torch.randint(len(first_tokens), (1,), generator=g))]] for g in gens]
    out: list[list[int]] = []
    for b in range(0, num_seqs, batch_size):
        out += _sample_batch(model, seqs[b:b + batch_size], seq_len, gens[b:b + batch_size])
    return out


def _sample_batch(model: Transformer, seqs: list[list[int]], seq_len: int,
                  gens: list[torch.Generator]) -> list[list[int]]:
    """Extend every sequence to ``seq_len`` tokens by ancestral sampling through the paged cache."""
    page = 16
    cache = model.new_cache(len(seqs) * (-(-seq_len // page) + 1), page)
    tables = [cache.new_table() for _ in seqs]
    ctx = [0] * len(seqs)
    while len(seqs[0]) < seq_len:
        segs = [Segment(t, c, s[c:]) for t, c, s in zip(tables, ctx, seqs)]
        logits = model.forward(build_batch(segs, cache, model.device), cache)  # [B, V]
        probs = torch.softmax(logits.float().cpu(), dim=-1)  # [B, V]
        ctx = [len(s) for s in seqs]
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
                desc_act: bool = True, damp: float = 0.01, num_seqs: int = CALIB_SEQS, seq_len: int = CALIB_LEN,
                log: Callable[[str], None] = print) -> Transformer:
    """GPTQ ``model`` (built from ``ckpt``) once per checkpoint and settings; later calls reload the result
    saved under ``cache_root`` in our format. Calibration: ``num_seqs`` sequences sampled from the model."""
    settings = {"method": "gptq", "group_size": group_size, "desc_act": desc_act, "damp": damp, "zeros": "fractional",
                "calibration": f"sampled {num_seqs}x{seq_len} seed 0", "dtype": str(model.dtype)}
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
    q = quantize_gptq(model, calib, group_size, desc_act, damp)
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
