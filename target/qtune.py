"""Tuning an INT4 model's group scales and zero points by distillation from the dense model.

Once GPTQ has fixed every weight's 4-bit code, the group scales and zero points are all that is left to
choose: about 3% of the weights' count at group 64. ``tune_scales`` trains them, codes frozen, so that the
INT4 model's next-token distributions match the dense model's, ``KL(dense || int4)`` at every position of
the calibration sequences. This is EfficientQAT's second stage, E2E-QP ("EfficientQAT: Efficient
Quantization-Aware Training for Large Language Models", Chen et al. 2024), which trains the step sizes of a
quantized model end to end with its codes fixed (PEQA, Kim et al. 2023, is the same with a task loss); here
the loss is distillation from the dense model, as GPTQ's own objective is, so no text beyond the
self-sampled calibration is needed.

With the codes fixed, ``W = (q - z) * s`` is linear in the scale ``s`` and the zero ``z``: the gradient is
exact and no straight-through estimator is needed. A scale is trained as a multiplier, ``s = s0 * exp(a)``
(``a`` starts at 0), so one learning rate suits groups of any magnitude; a zero point moves in code units.
Zero points stay fractional, as our format stores them (symmetric weights keep their fixed zero of 8).

``TuneConfig.tune_codes`` lets the codes move too, within one level of GPTQ's: every weight gets a trainable
offset ``v`` in [-1, 1] added to its code before rounding, ``q' = clamp(round(q + v), 0, 15)``, and the
gradient passes the rounding straight through (Bengio et al. 2013). This is AutoRound's learned rounding
("Optimize Weight Rounding via Signed Gradient Descent for the Quantization of LLMs", Cheng et al. 2023),
trained end to end on the distillation loss rather than block by block, and started from GPTQ's codes rather
than round-to-nearest: an offset starts at 0, so a code flips only once its gradient has pushed consistently
for long enough to carry it past half a level.

The forward here is a plain, differentiable restatement of ``Transformer.forward`` over whole sequences
(no paged cache): the same norms, RoPE and grouped-query attention. Embeddings and the LM head stay as they
are; the INT4 projections' scales and zeros change (and, as configured, the norms and codes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from kernels.fused_norm_rope import apply_rope
from kernels.fused_norm_rope import rms_norm_ref as rms_norm
from kernels.int4_matmul import Int4Weight, dequantize, pack_int4, unpack_int4
from target.model import Linear, Transformer, int4_linear

PROJ_NAMES = ("qkv", "o", "gate_up", "down")


@dataclass(slots=True)
class TuneConfig:
    """``steps`` optimizer steps over batches of ``batch_size`` calibration sequences (cycled in a seeded
    order); ``lr_scale`` for the log-scale multipliers, ``lr_zero`` for zero points in code units; both decay
    to zero on a cosine after ``warmup`` steps. ``tune_zeros=False`` trains scales alone (E2E-QP's choice).
    ``tune_norms`` also trains every RMSNorm weight (as a multiplier, ``lr_norm``): a per-channel factor
    that the INT4 projections after it see as an input scaling, the degree of freedom AWQ and OmniQuant's
    equivalent transforms use; the norms stay dense, as they always are. ``tune_codes`` also lets every code
    move by at most one level (the module docstring), at ``lr_code`` in code units."""

    steps: int = 400
    batch_size: int = 8
    lr_scale: float = 1e-3
    lr_zero: float = 1e-3
    warmup: int = 20
    tune_zeros: bool = True
    tune_norms: bool = False
    lr_norm: float = 1e-3
    tune_codes: bool = False
    lr_code: float = 5e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps and batch_size must be >= 1, got {self.steps} and {self.batch_size}")
        if min(self.lr_scale, self.lr_zero, self.lr_norm, self.lr_code, self.warmup) < 0:
            raise ValueError("learning rates and warmup must be >= 0")


class _Tuned(torch.nn.Module):
    """One INT4 projection being tuned: its starting codes ``[N, K/G, G]``, scales and zeros ``[K/G, N]``,
    the trainable log-scale multipliers and zero points (same shape), and with ``codes`` the trainable code
    offsets (the codes' shape; else the codes stay frozen)."""

    def __init__(self, lin: Linear, device: torch.device, codes: bool = False) -> None:
        super().__init__()
        w = lin.weight
        assert isinstance(w, Int4Weight)
        N, K, G = w.out_features, w.in_features, w.group_size
        self.lin, self.G = lin, G
        self.register_buffer("codes", unpack_int4(w.qweight.to(device)).to(torch.uint8).view(N, K // G, G))
        # clones: the starting weights may be inference tensors (GPTQ runs under inference mode)
        self.register_buffer("scale0", w.scales.to(device, torch.float32).clone())
        self.log_scale = torch.nn.Parameter(torch.zeros_like(self.scale0))
        zeros = torch.full_like(self.scale0, 8.0) if w.zeros is None else w.zeros.to(device, torch.float32).clone()
        self.zero = torch.nn.Parameter(zeros, requires_grad=w.zeros is not None)
        # only when the codes train: 4 bytes a weight, and Adam's moments twice that
        self.offset = torch.nn.Parameter(torch.zeros(self.codes.shape, device=device)) if codes else None

    def scales(self) -> torch.Tensor:
        return self.scale0 * self.log_scale.exp()  # [K/G, N]

    def current_codes(self) -> torch.Tensor:
        """The codes [N, K/G, G] as float: the starting ones, or with trainable offsets ``clamp(round(q + v))``
        whose gradient in ``v`` is the identity (straight through the rounding)."""
        q = self.codes.float()
        if self.offset is None:
            return q
        u = q + self.offset
        return u + ((u.detach().round().clamp(0, 15)) - u.detach())

    def weight(self) -> torch.Tensor:
        """The dequantized weight [N, K] float32, differentiable in the scales, zeros and code offsets."""
        s, z = self.scales().T[:, :, None], self.zero.T[:, :, None]  # [N, K/G, 1]
        return ((self.current_codes() - z) * s).flatten(1)

    def tuned(self, dtype: torch.dtype) -> Linear:
        """The projection with its tuned scales, zeros (and codes), stored in ``dtype`` on the original device."""
        w = self.lin.weight
        assert isinstance(w, Int4Weight)
        dev = w.qweight.device
        zeros = None if w.zeros is None else self.zero.detach().to(dev, dtype)
        qweight = w.qweight
        if self.offset is not None:
            qweight = pack_int4(self.current_codes().detach().flatten(1).to(torch.uint8)).to(dev)
        return int4_linear(Int4Weight(qweight, self.scales().detach().to(dev, dtype), zeros, self.G),
                           self.lin.bias, self.lin.perm)


class _Norms(torch.nn.Module):
    """Trainable log-multipliers of a model's RMSNorm weights: ``[L, 2, hidden]`` (each layer's input and
    post-attention norm) and ``[hidden]`` (the final norm)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        hidden = model.config.hidden_size
        self.layer_mult = torch.nn.Parameter(torch.zeros(model.num_layers, 2, hidden, device=model.device))
        self.final_mult = torch.nn.Parameter(torch.zeros(hidden, device=model.device))

    def applied(self, model: Transformer, dtype: torch.dtype | None = None) -> Transformer:
        """``model`` with every norm weight multiplied (differentiably, unless ``dtype`` asks for a stored
        copy: then detached, in ``dtype``, on ``model``'s device)."""
        def mult(w: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
            out = w.float() * a.to(w.device).exp()
            return out if dtype is None else out.detach().to(dtype)

        layers = [replace(l, input_norm=mult(l.input_norm, self.layer_mult[i, 0]),
                          post_norm=mult(l.post_norm, self.layer_mult[i, 1])) for i, l in enumerate(model.layers)]
        return Transformer(model.config, model.embed, layers, mult(model.norm, self.final_mult), model.lm_head,
                           model.dtype, model.fc)


def sequence_logits(model: Transformer, tokens: torch.Tensor,
                    weight: Callable[[int, str], torch.Tensor | None] | None = None,
                    tap: Callable[[int, str, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Causal logits ``[B, T, V]`` float32 of whole sequences ``tokens: [B, T]`` through ``model``'s maths.

    ``weight(layer, name)`` gives the dense ``[N, K]`` weight of projection ``name`` (one of ``PROJ_NAMES``) in
    layer ``layer``, or None for the projection's own (dequantized for INT4), as without ``weight``. Computed in float32, whatever the
    model's dtype: this is for calibration, not serving. ``model`` lives on ``tokens``' device (``on_device``).
    ``tap(layer, name, y)`` sees each projection's output ``y: [B, T, N]`` and returns what the forward goes on with
    (``target.gptq.output_saliency`` adds a zero there whose gradient is the loss's gradient in ``y``).
    """
    c = model.config
    B, T = tokens.shape
    H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
    freqs = torch.arange(T, device=tokens.device, dtype=torch.float32)[:, None] * model.inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :].repeat(B, 1, 1)  # [B * T, 1, D]
    cos, sin = emb.cos(), emb.sin()

    def proj(i: int, name: str, x: torch.Tensor) -> torch.Tensor:
        lin = getattr(model.layers[i], name)
        w = weight(i, name) if weight is not None else None
        w = _dense(lin) if w is None else w
        x = x if lin.perm is None else x[..., lin.perm]
        y = F.linear(x, w, None if lin.bias is None else lin.bias.float())
        return y if tap is None else tap(i, name, y)

    h = model.embed.float()[tokens]  # [B, T, hidden]
    for i, layer in enumerate(model.layers):
        x = rms_norm(h, layer.input_norm.float(), c.rms_norm_eps)
        q, k, v = proj(i, "qkv", x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q = apply_rope(q.reshape(B * T, H, D), cos, sin).view(B, T, H, D)
        k = apply_rope(k.reshape(B * T, Hkv, D), cos, sin).view(B, T, Hkv, D)
        k, v = k.repeat_interleave(H // Hkv, dim=2), v.view(B, T, Hkv, D).repeat_interleave(H // Hkv, dim=2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True, scale=1.0 / math.sqrt(D))  # [B, H, T, D]
        h = h + proj(i, "o", attn.transpose(1, 2).reshape(B, T, H * D))
        x = rms_norm(h, layer.post_norm.float(), c.rms_norm_eps)
        gate, up = proj(i, "gate_up", x).chunk(2, dim=-1)
        h = h + proj(i, "down", F.silu(gate) * up)
    hn = rms_norm(h, model.norm.float(), c.rms_norm_eps)
    return F.linear(hn, _dense(model.lm_head))  # [B, T, V]


def on_device(model: Transformer, device: torch.device, dequantized: bool = True) -> Transformer:
    """``model`` on ``device`` with its dense tensors in float32, for ``sequence_logits``. ``dequantized``: INT4
    projections also keep a float32 dequantized copy, so repeated forwards do not dequantize again (off where
    every INT4 weight is being tuned, which would leave the copies unused)."""
    m = model.to(device)
    # GPTQ's tensors are made under inference mode, which autograd may not save: plain copies of those
    f32 = lambda t: (t.clone() if t.is_inference() else t).float()  # noqa: E731
    def lin(x: Linear) -> Linear:
        perm = None if x.perm is None else x.perm.clone()
        bias = None if x.bias is None else f32(x.bias)
        if not isinstance(x.weight, Int4Weight):
            return replace(x, weight=f32(x.weight), perm=perm, bias=bias)
        deq = _dense(x) if dequantized else None
        return replace(x, perm=perm, bias=bias, dequantized=deq)

    layers = [replace(l, input_norm=f32(l.input_norm), post_norm=f32(l.post_norm), qkv=lin(l.qkv), o=lin(l.o),
                      gate_up=lin(l.gate_up), down=lin(l.down)) for l in m.layers]
    return Transformer(m.config, f32(m.embed), layers, f32(m.norm), lin(m.lm_head), torch.float32)


def _dense(lin: Linear) -> torch.Tensor:
    """A projection's weight [N, K] as float32: dense as stored, INT4 dequantized (its kept copy when it has one)."""
    w = lin.weight
    if not isinstance(w, Int4Weight):
        return w.float()
    return (lin.dequantized if lin.dequantized is not None else dequantize(w)).float()


def kl_to_teacher(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over ``mask``-ed positions of KL(teacher || student); logits ``[B, T, V]``, mask ``[B, T]`` bool."""
    p_log, q_log = teacher[mask].log_softmax(-1), student[mask].log_softmax(-1)  # [n, V]
    return (p_log.exp() * (p_log - q_log)).sum(-1).mean()


def _batches(calib: list[list[int]], batch_size: int, seed: int, device: torch.device):
    """Endless ``(tokens [B, T], mask [B, T])`` batches over ``calib`` in seeded epochs; right-padded, and
    a padded position is masked out (causal attention keeps padding from touching the real ones)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(calib), generator=gen).tolist()
        for lo in range(0, len(order), batch_size):
            seqs = [calib[i] for i in order[lo:lo + batch_size]]
            T = max(map(len, seqs))
            tokens = torch.tensor([s + [0] * (T - len(s)) for s in seqs], device=device)
            mask = torch.tensor([[j < len(s) for j in range(T)] for s in seqs], device=device)
            yield tokens, mask


def tune_scales(qmodel: Transformer, dense: Transformer, calib: list[list[int]], cfg: TuneConfig = TuneConfig(),
                device: torch.device | str | None = None, progress: bool = True,
                log: Callable[[int, float], None] | None = None) -> Transformer:
    """A copy of ``qmodel`` whose INT4 scales and zero points (and with ``cfg.tune_norms`` its norm weights)
    minimise KL(``dense`` || INT4) over ``calib``.

    ``qmodel`` and ``dense`` share config, embeddings, norms and head (``qmodel`` is a quantization of
    ``dense``); dense projections and everything else are kept, the codes too unless ``cfg.tune_codes``.
    ``device``: where to train (default ``qmodel``'s); the result lives where ``qmodel`` does, in its dtype.
    ``log(step, loss)`` sees every step.
    Deterministic for fixed inputs on one device.
    """
    if not calib or any(len(s) < 2 for s in calib):
        raise ValueError("tuning needs calibration sequences of at least two tokens")
    dev = torch.device(device) if device is not None else qmodel.device
    tuned = {(i, n): _Tuned(getattr(layer, n), dev, cfg.tune_codes) for i, layer in enumerate(qmodel.layers)
             for n in PROJ_NAMES if isinstance(getattr(layer, n).weight, Int4Weight)}
    student, teacher = on_device(qmodel, dev, dequantized=False), on_device(dense, dev)
    if not tuned:
        raise ValueError("the model has no INT4 projections to tune")
    norms = _Norms(student) if cfg.tune_norms else None
    params = [{"params": [t.log_scale for t in tuned.values()], "lr": cfg.lr_scale},
              {"params": [t.zero for t in tuned.values() if t.zero.requires_grad and cfg.tune_zeros],
               "lr": cfg.lr_zero},
              {"params": [] if norms is None else list(norms.parameters()), "lr": cfg.lr_norm},
              {"params": [t.offset for t in tuned.values() if t.offset is not None], "lr": cfg.lr_code}]
    opt = torch.optim.Adam([g for g in params if g["params"]], betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup, 1)) * 0.5 *
                                              (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)))
    batches = _batches(calib, cfg.batch_size, cfg.seed, dev)
    for step in tqdm(range(cfg.steps), desc="tune scales", unit="step", disable=not progress):
        tokens, mask = next(batches)
        with torch.no_grad():
            target = sequence_logits(teacher, tokens)
        weights = {k: t.weight() for k, t in tuned.items()}  # the rest are dense: their own weights
        model = student if norms is None else norms.applied(student)
        loss = kl_to_teacher(sequence_logits(model, tokens, lambda i, n: weights.get((i, n))), target, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if cfg.tune_codes:
            with torch.no_grad():
                for t in tuned.values():
                    t.offset.clamp_(-1.0, 1.0)  # one level from the starting code at most
        if log is not None:
            log(step, float(loss.detach()))
    layers = [replace(layer, **{n: tuned[i, n].tuned(qmodel.dtype) for n in PROJ_NAMES if (i, n) in tuned})
              for i, layer in enumerate(qmodel.layers)]
    out = Transformer(qmodel.config, qmodel.embed, layers, qmodel.norm, qmodel.lm_head, qmodel.dtype, qmodel.fc)
    return out if norms is None else norms.applied(out, qmodel.dtype)


@torch.no_grad()
def mean_kl(qmodel: Transformer, dense: Transformer, seqs: list[list[int]], device: torch.device | str | None = None,
            batch_size: int = 8) -> float:
    """Mean KL(``dense`` || ``qmodel``) per position over ``seqs`` (whole sequences, every position scored once):
    the quantity ``tune_scales`` lowers, measured on sequences it did not train on."""
    dev = torch.device(device) if device is not None else qmodel.device
    student, teacher = on_device(qmodel, dev), on_device(dense, dev)
    total, count = 0.0, 0
    for lo in range(0, len(seqs), batch_size):
        tokens, mask = next(_batches(seqs[lo:lo + batch_size], batch_size, 0, dev))
        n = int(mask.sum())
        total += float(kl_to_teacher(sequence_logits(student, tokens), sequence_logits(teacher, tokens), mask)) * n
        count += n
    return total / max(count, 1)
