"""Our decoder-only transformer (Llama / Mistral / Qwen2 families) over the paged KV cache.

Not HF's modeling code: a flat forward over a ragged batch (``ForwardBatch``), fused qkv and gate_up
projections, RoPE at explicit positions (tree nodes sit at ``context_len + depth``), K/V written into
the paged cache before attention, and logits only for the rows that need them.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kernels import dispatch, invariant
from kernels.dense_matmul import dense_matmul
from kernels.fused_norm_rope import rms_norm as fused_rms_norm
from kernels.fused_norm_rope import rope_and_cache
from kernels.fused_norm_rope import silu_mul as fused_silu_mul
from kernels.int4_matmul import (CpuInt4, Int4Weight, dequantize, int4_matmul, int4_matmul_silu_mul,
                                 int4_qkv_rope_cache, quantize_rtn)
from kernels.tree_attention import tree_attention
from target.batch import ForwardBatch
from target.config import FC_NAME, ModelConfig
from target.kv_cache import KVCache


# Dense (bf16) projections on CUDA: the residual add rides the GEMM (addmm) and silu(gate) * up is one
# Triton kernel. SPECGATE_DENSE_FUSION=0 restores F.linear + add and F.silu * up (bench/draft_step.py's A/B).
DENSE_FUSION = os.environ.get("SPECGATE_DENSE_FUSION", "1") != "0"
# How CPU projections of up to CPU_LINEAR_MAX_ROWS rows are computed: "auto" takes the form time_cpu_forms
# measured for the weight's shape and the row bucket (build_engine times a CPU model's shapes at load; a shape
# it did not time takes F.linear); True takes cpu_linear, False F.linear (SPECGATE_CPU_LINEAR=auto|1|0;
# bench/cpu_decode.py --switch linear / linear_auto). The batch-invariant mode takes cpu_linear_invariant
# whatever this says. Which form is faster depends on the CPU: on one 2-core AVX-512 machine cpu_linear ran
# SmolLM2's decode step in 27.6 ms against F.linear's 53.9 (bench/results/cpu_forms.json), on another (2 cores,
# AVX-512 with AMX) in 76.6 against 34.5 (cpu_forms_amx.json). Above the limit, prefill's widths, F.linear was
# as fast or faster on both (307 against 415 ms, 167 against 264 at 256 rows).
CPU_LINEAR: bool | str = {"1": True, "0": False}.get(os.environ.get("SPECGATE_CPU_LINEAR", "auto"), "auto")
CPU_LINEAR_MAX_ROWS = 64
CPU_LINEAR_BUCKETS = (1, 4, 16, 32, CPU_LINEAR_MAX_ROWS)  # M rows take the choice timed at the first bucket >= M
# (32: a batch of 17-32 decoding sequences would otherwise pad to 64 rows for oneDNN's form)
# oneDNN's linear over a weight prepacked into its blocked layout (torch.ops.mkldnn._linear_pointwise, the op
# torch's inductor emits for CPU linears): a third form for "auto" to measure. Every new row count builds and
# caches a oneDNN primitive (five weights at row counts 3-299 grew a process by 518 MB, ARCHITECTURE.md), so
# its calls are padded with zero rows to their bucket's top: at most len(CPU_LINEAR_BUCKETS) row counts a shape.
# The packed copy is kept beside the plain weight (the other buckets read that, and the batch-invariant mode
# where its 4-row bucket did not pick oneDNN), for the shapes that pick it. SPECGATE_CPU_ONEDNN=0 leaves it out of the measurement.
CPU_ONEDNN = (os.environ.get("SPECGATE_CPU_ONEDNN", "1") != "0" and hasattr(torch.ops.mkldnn, "_linear_pointwise")
              and torch.backends.mkldnn.is_available())
# SPECGATE_CPU_INT4=1: a CPU model's INT4 projections also keep torch's CPU INT4 form (kernels/int4_matmul.py
# CpuInt4) and run through it, with bfloat16 activations. On a 2-core AVX-512 machine SmolLM2's 30 layers of
# projections took 4.6 / 7.1 / 17.8 / 23.0 ms at 1 / 4 / 9 / 16 rows against cpu_linear's 15.7 / 20.5 / 48.0 /
# 45.2 ms on the float32 copy, and 329 against 326 ms at 256 rows (bench/results/cpu_int4pack.json). It runs at every
# row count: a row's result then does not depend on the rows beside it (the kernel's are bit-identical alone
# and in a batch), where a switch by row count made a prompt's prefill, and so greedy output, depend on what
# else shared its step. Off by default: bfloat16 activations move the logits (0.3% relative on a projection),
# so greedy output is no longer the float32 path's. Read at load (the form is built then) and at every call.
CPU_INT4 = os.environ.get("SPECGATE_CPU_INT4", "0") == "1"


def batch_invariant(on: bool | None = None) -> bool:
    """Put batch-invariant kernels (kernels/invariant.py) on or off for this process; None: as the environment
    says (``SPECGATE_BATCH_INVARIANT``). Returns the mode now in force."""
    invariant.set_enabled(invariant.FROM_ENV if on is None else on)
    return invariant.enabled()


@dataclass(slots=True)
class Linear:
    """``y = x @ W.T + b`` with W dense ``[N, K]`` or INT4 (``Int4Weight``)."""

    weight: torch.Tensor | Int4Weight
    bias: torch.Tensor | None = None
    # CPU only: the INT4 weight dequantized once. The reference matmul dequantizes on every call, which
    # is the spec but costs 5x the matmul itself; the product is bit-identical either way.
    dequantized: torch.Tensor | None = None
    # [K] int64 input order, or None. The kernel has no g_idx, so act-order GPTQ checkpoints are stored
    # with K reordered into contiguous groups and the input is gathered to match: y = x[..., perm] @ W'.T.
    perm: torch.Tensor | None = None
    cpu_int4: CpuInt4 | None = None  # CPU only, with CPU_INT4: the same weight in torch's CPU INT4 form
    # CPU float32, where time_cpu_forms picked oneDNN for the shape: (the weight it packs, oneDNN's packed copy).
    # Used only while that weight is still the one multiplied (a replaced or moved Linear falls back).
    onednn: tuple[torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        # MKL's sums depend on the weight's address modulo 64 bytes (cpu_linear's products differ by an ulp
        # between an aligned and a shifted copy of one weight): every float32 CPU weight -- what the CPU computes
        # with -- is kept contiguous and 64-byte aligned, so a model gives the same logits wherever its tensors
        # happened to load (a file's memory map places them at any offset). Other dtypes on the CPU are staging
        # copies on their way to a GPU or a tensor-parallel shard, and are not copied again.
        w = self.weight
        if (isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.dtype == torch.float32
                and (not w.is_contiguous() or w.data_ptr() % 64)):
            self.weight = w.clone(memory_format=torch.contiguous_format)

    @property
    def int4(self) -> Int4Weight | None:
        """The weight the INT4 kernels multiply, or None where this Linear takes another path."""
        return self.weight if self.dequantized is None and isinstance(self.weight, Int4Weight) else None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, permuted: bool = False,
                 lookahead: Linear | None = None) -> torch.Tensor:
        """``x @ W.T + b (+ residual)``; the INT4 kernel fuses the residual add into its epilogue.
        ``permuted``: ``x`` already comes in ``perm``'s order (``rms_norm(..., perm=)`` wrote it so).
        ``lookahead``: the projection the forward runs next; an INT4 kernel may ask L2 for its weight
        (``SPECGATE_INT4_LOOKAHEAD``)."""
        if self.perm is not None and not permuted:
            x = x[..., self.perm]
        if (w4 := self.int4) is not None:
            return int4_matmul(x, w4, self.bias, residual=residual, lookahead=_int4_of(lookahead))
        if self.cpu_int4 is not None and CPU_INT4 and x.dim() == 2:  # at any row count: see CPU_INT4
            y = self.cpu_int4(x)
            y = y if self.bias is None else y + self.bias
            return y if residual is None else y + residual
        w = self.dequantized.to(x.dtype) if self.dequantized is not None else self.weight
        if dispatch.use_triton(x) and x.dim() == 2 and invariant.enabled():  # not cuBLAS, whose algorithm follows M
            return dense_matmul(x, w, self.bias, residual)
        if residual is not None and x.is_cuda and self.bias is None and x.dim() == 2 and DENSE_FUSION:
            return torch.addmm(residual, x, w.t())  # the add rides the GEMM's epilogue: one launch, not two
        packed = self.onednn[1] if self.onednn is not None and self.onednn[0] is w else None
        if x.device.type == "cpu" and x.dim() == 2 and invariant.enabled():
            return cpu_linear_invariant(x, w, self.bias, residual, packed)
        form = _cpu_form(x.shape[0], w) if x.device.type == "cpu" and x.dim() == 2 else "f_linear"
        if form == "onednn" and packed is not None:
            y = onednn_linear(x, packed, self.bias)
        elif form == "cpu_linear":
            y = cpu_linear(x, w, self.bias)
        else:
            y = F.linear(x, w, self.bias)
        return y if residual is None else y + residual

    def silu_mul(self, x: torch.Tensor, permuted: bool = False, lookahead: Linear | None = None) -> torch.Tensor:
        """``silu(gate) * up`` for a gate_up projection (gate rows first), fused for INT4 weights."""
        if (w4 := self.int4) is not None:
            return int4_matmul_silu_mul(x if self.perm is None or permuted else x[..., self.perm], w4,
                                        lookahead=_int4_of(lookahead))
        if not DENSE_FUSION:
            gate, up = self(x, permuted=permuted).chunk(2, dim=-1)
            return F.silu(gate) * up
        return fused_silu_mul(self(x, permuted=permuted))

    def qkv_rope_cache(self, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, k_layer: torch.Tensor,
                       v_layer: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                       permuted: bool = False, lookahead: Linear | None = None) -> torch.Tensor:
        """A fused qkv projection, then RoPE and the KV-cache write (``rope_and_cache``): q ``[T, H, D]``. INT4
        weights may take both in the matmul's epilogue, one launch (``int4_qkv_rope_cache``)."""
        if (w4 := self.int4) is not None:
            xp = x if self.perm is None or permuted else x[..., self.perm]
            return int4_qkv_rope_cache(xp, w4, self.bias, positions, inv_freq, k_layer, v_layer, slot_mapping,
                                       num_heads, num_kv_heads, lookahead=_int4_of(lookahead))
        return rope_and_cache(self(x, permuted=permuted), positions, inv_freq, k_layer, v_layer, slot_mapping,
                              num_heads, num_kv_heads)

    def quantized(self, group_size: int, use_zero_point: bool) -> "Linear":
        if isinstance(self.weight, Int4Weight):
            return self
        q = quantize_rtn(self.weight, int4_group_size(self.weight.shape[1], group_size), use_zero_point)
        return int4_linear(q, self.bias)


def _int4_of(lin: Linear | None) -> Int4Weight | None:
    """A lookahead's weight for the INT4 kernels: ``lin``'s, where it takes their path."""
    return None if lin is None else lin.int4


def _as_float(logits: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``logits`` as float32: a new tensor, or written into ``out``'s first rows."""
    if out is None:
        return logits.float()
    return out[: logits.shape[0]].copy_(logits)


def cpu_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for ``x`` ``[M, K]`` on the CPU, computed as ``(w @ x.T).T``, one row padded to two.

    Decode and tree verification run the CPU's GEMMs at a few rows against weights far larger than its
    caches. There MKL's ``x @ w.T`` (``F.linear``) reached a third of the memory bandwidth that ``w @ x.T``
    did: SmolLM2's 30 layers of projections (float32) took 33.7 / 54.8 / 45.4 ms at M = 1 / 2 / 4 rows against
    16.4 / 14.4 / 21.0 ms, and its LM head 9.2 / 21.2 ms against 3.0 / 3.0 ms at M = 1 / 2 (2-core AVX-512
    machine, bench/results/cpu_forms.json). One row alone takes a slower path, so it is padded to two.
    Results equal ``F.linear``'s up to float rounding (the sums run in another order)."""
    if x.shape[0] == 1:
        y = (w @ torch.cat((x, x)).t())[:, :1].t().contiguous()
    else:
        y = (w @ x.t()).t().contiguous()
    return y if bias is None else y + bias


# The batch-invariant mode's CPU form: the rows in chunks of this many (the last padded with zeros), each chunk
# one product of the same shape, in the form this process takes at that many rows (_cpu_form: F.linear,
# (W @ X.T).T or oneDNN's, as time_cpu_forms measured). MKL then gives a row the same bits at any position in its chunk and
# beside any other rows (both forms, SmolLM2's shapes, chunks of 2 to 16, 1 to 200 rows, on a 2-core AMX
# machine), where the bits of either form over the whole batch follow the row count on some CPUs
# (ARCHITECTURE.md, batch-invariant mode).
INVARIANT_CPU_ROWS = 4


def cpu_linear_invariant(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                         residual: torch.Tensor | None = None, packed: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias (+ residual)`` for ``x`` ``[M, K]`` on the CPU, each row's bits independent of M and of
    the other rows (``INVARIANT_CPU_ROWS``). A prefill pays one pass over the weight per chunk. ``packed``: ``w``
    in oneDNN's layout (``Linear.onednn``), taken where the chunk's bucket picked that form."""
    M, K = x.shape
    C = INVARIANT_CPU_ROWS
    pad = -M % C
    xp = torch.cat((x, x.new_zeros(pad, K))) if pad else x
    form = _cpu_form(C, w)
    if form == "onednn" and packed is not None:
        chunks = [onednn_linear(xp[i : i + C], packed) for i in range(0, M + pad, C)]
    elif form == "cpu_linear":
        chunks = [(w @ xp[i : i + C].t()).t() for i in range(0, M + pad, C)]
    else:
        chunks = [F.linear(xp[i : i + C], w) for i in range(0, M + pad, C)]
    y = torch.cat([x.new_empty(0, w.shape[0])] + chunks)[:M]
    y = y if bias is None else y + bias
    return y if residual is None else y + residual


def onednn_pack(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[N, K]`` (CPU float32) in oneDNN's blocked layout, for ``onednn_linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(w, 16)  # 16: the row count its layout is chosen for


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[M, K]``, M <= CPU_LINEAR_MAX_ROWS, through oneDNN's ``packed`` weight. The
    rows are padded with zeros to their bucket's top, so the primitives oneDNN builds and caches per row count
    stay a handful (see CPU_ONEDNN); a padded row costs little at these widths, which stream the weight."""
    M = x.shape[0]
    pad = _bucket(M) - M
    xp = torch.cat((x, x.new_zeros(pad, x.shape[1]))) if pad else x.contiguous()
    y = torch.ops.mkldnn._linear_pointwise(xp, packed, bias, "none", [], "")
    return y[:M] if pad else y


# (N, K, dtype) -> per CPU_LINEAR_BUCKETS bucket, the form time_cpu_forms measured fastest: "f_linear",
# "cpu_linear" or "onednn"
_CPU_FORMS: dict[tuple[int, int, torch.dtype], tuple[str, ...]] = {}


def _bucket(rows: int) -> int:
    return next(b for b in CPU_LINEAR_BUCKETS if rows <= b)


def _cpu_form(rows: int, w: torch.Tensor) -> str:
    """The form a CPU projection of ``rows`` rows over ``w`` takes (Linear.__call__, outside the invariant mode)."""
    if rows > CPU_LINEAR_MAX_ROWS:
        return "f_linear"
    if CPU_LINEAR != "auto":
        return "cpu_linear" if CPU_LINEAR else "f_linear"
    forms = _CPU_FORMS.get((w.shape[0], w.shape[1], w.dtype))
    if forms is None:  # a shape no loaded model timed: the common form
        return "f_linear"
    return forms[CPU_LINEAR_BUCKETS.index(_bucket(rows))]


def time_cpu_forms(models: list["Transformer"], reps: int = 2) -> dict[tuple[int, int], tuple[str, ...]]:
    """Time ``cpu_linear`` and ``onednn_linear`` (with CPU_ONEDNN, float32 weights) against ``F.linear`` for each
    projection shape of ``models`` (CPU float weights) at each of ``CPU_LINEAR_BUCKETS`` rows, and keep the
    choice for ``CPU_LINEAR = "auto"``: per shape and bucket, F.linear unless cpu_linear was at least 15% faster,
    and that unless oneDNN was at least 15% faster than the pick so far (where forms time close, the older one
    keeps a machine's choice stable from one process to the next). Each pass runs every weight of the shape
    once, as a forward does, so the weights come from where a forward finds them -- one weight timed alone stays
    in L2, and there the forms ranked otherwise. Linears of a shape that picked oneDNN in some bucket keep their packed copy
    (``Linear.onednn``); the others drop theirs. Returns {(N, K): picks}; SmolLM2 with its draft took ~1.5 s on
    2 cores without oneDNN."""
    groups: dict[tuple[int, int, torch.dtype], dict[int, torch.Tensor]] = {}  # by shape, then address
    owners: list[tuple[Linear, torch.Tensor]] = []
    for m in models:
        lins = [lin for layer in m.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        for lin in lins + [m.lm_head] + ([m.fc] if m.fc is not None else []):
            w = lin.dequantized if lin.dequantized is not None else lin.weight
            if isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.is_floating_point():
                # a self-draft shares its target's tensors: each is timed once
                groups.setdefault((w.shape[0], w.shape[1], w.dtype), {})[w.data_ptr()] = w
                owners.append((lin, w))
    out = {}
    packs: dict[int, torch.Tensor] = {}  # by address, for the shapes that picked oneDNN
    for key, by_ptr in groups.items():
        ws = list(by_ptr.values())
        packed = {p: onednn_pack(w) for p, w in by_ptr.items()} if CPU_ONEDNN and key[2] == torch.float32 else {}
        picks = []
        for rows in CPU_LINEAR_BUCKETS:
            x = torch.randn(rows, key[1], dtype=key[2])
            forms = {"f_linear": lambda w: F.linear(x, w), "cpu_linear": lambda w: cpu_linear(x, w)}
            if packed:
                forms["onednn"] = lambda w: onednn_linear(x, packed[w.data_ptr()])
            best = dict.fromkeys(forms, math.inf)
            for rep in range(reps + 1):  # the first pass untimed: the libraries' own set-up
                for name, f in forms.items():
                    t = time.perf_counter()
                    for w in ws:
                        f(w)
                    if rep:
                        best[name] = min(best[name], time.perf_counter() - t)
            pick = "f_linear"  # a form displaces the one before it only 15% faster: close timings keep the older
            for name in forms:
                if best[name] < 0.85 * best[pick]:
                    pick = name
            picks.append(pick)
        _CPU_FORMS[key] = out[key[:2]] = tuple(picks)
        if "onednn" in picks:
            packs.update(packed)
    for lin, w in owners:
        lin.onednn = (w, packs[w.data_ptr()]) if w.data_ptr() in packs else None
    return out


def int4_group_size(in_features: int, group_size: int) -> int:
    """``group_size``, or the largest smaller of 64 / 32 that divides K (SmolLM2's hidden size 576 is not a
    multiple of 128): a ragged last group would cost the kernel a branch on every tile."""
    g = next((g for g in (group_size, 64, 32) if g <= group_size and in_features % g == 0), None)
    if g is None:
        raise ValueError(f"in_features {in_features} is not a multiple of 32: cannot quantize to INT4")
    return g


def int4_linear(w: Int4Weight, bias: torch.Tensor | None = None, perm: torch.Tensor | None = None) -> Linear:
    """An INT4 Linear; on the CPU it keeps the dequantized copy that the reference path multiplies by."""
    if w.qweight.is_cuda or dispatch.FORCE_TRITON:  # (forced: the Triton kernel, interpreted, multiplies on the CPU)
        return Linear(w, bias, None, perm)
    return Linear(w, bias, dequantize(w).contiguous(), perm,  # [N, K]: cpu_linear
                  cpu_int4=CpuInt4.of(w) if CPU_INT4 else None)


@dataclass(slots=True)
class Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [(H + 2 Hkv) * D, hidden]
    o: Linear  # [hidden, H * D]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # [2 * I, hidden], gate rows first
    down: Linear  # [hidden, I]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[D / 2] inverse frequencies, with Llama-3 or linear scaling when the config asks for it."""
    D = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    rs = config.rope_scaling
    if rs is None:
        return inv.float()
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return (inv / rs["factor"]).float()
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}: supported are 'llama3' and 'linear'")
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, smoothed, scaled).float()


class Transformer:
    """Weights plus a forward over ``ForwardBatch``. Holds no per-sequence state: the cache does."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[Layer], norm: torch.Tensor,
                 lm_head: Linear, dtype: torch.dtype, fc: Linear | None = None) -> None:
        self.config = config
        self.embed = embed  # [V, hidden]
        # A feature draft (EAGLE, Li et al. 2024) reads, beside each token, the target's feature at the
        # position before it: its input is fc([embedding, feature]) [hidden, 2 * hidden] -> [hidden].
        self.fc = fc
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.dtype = dtype
        self.device = embed.device
        self.inv_freq = rope_inv_freq(config).to(self.device)  # [D / 2]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @staticmethod
    def from_weights(config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu", quantized: dict[str, Linear] | None = None) -> "Transformer":
        """Build from HF-named tensors; a missing tensor is named in the error.

        ``quantized`` maps fused projection names (``model.layers.{i}.self_attn.qkv_proj``, ``.o_proj``,
        ``mlp.gate_up_proj``, ``mlp.down_proj``) to INT4 Linears from a quantized checkpoint; those
        projections take no dense weight from ``weights`` (biases still come from there).
        """
        quantized = quantized or {}

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint is missing tensor {name!r}")
            return weights[name].to(device=device, dtype=dtype)

        def opt(name: str) -> torch.Tensor | None:
            return get(name) if name in weights else None

        def proj(fused: str, parts: list[str], bias: torch.Tensor | None = None) -> Linear:
            q = quantized.get(fused)
            if q is None:
                return Linear(torch.cat([get(n) for n in parts]), bias)
            w = q.weight
            assert isinstance(w, Int4Weight)
            zeros = None if w.zeros is None else w.zeros.to(device, dtype)
            w = Int4Weight(w.qweight.to(device), w.scales.to(device, dtype), zeros, w.group_size)
            return int4_linear(w, bias, None if q.perm is None else q.perm.to(device))

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            biases = [opt(p + f"self_attn.{x}_proj.bias") for x in "qkv"]
            qkv_b = torch.cat(biases) if all(b is not None for b in biases) else None
            layers.append(Layer(
                input_norm=get(p + "input_layernorm.weight"),
                qkv=proj(p + "self_attn.qkv_proj", [p + f"self_attn.{x}_proj.weight" for x in "qkv"], qkv_b),
                o=proj(p + "self_attn.o_proj", [p + "self_attn.o_proj.weight"], opt(p + "self_attn.o_proj.bias")),
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=proj(p + "mlp.gate_up_proj", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down=proj(p + "mlp.down_proj", [p + "mlp.down_proj.weight"]),
            ))
        embed = get("model.embed_tokens.weight")
        head = embed if config.tie_word_embeddings or "lm_head.weight" not in weights else get("lm_head.weight")
        fc = Linear(get(FC_NAME)) if FC_NAME in weights else None
        return Transformer(config, embed, layers, get("model.norm.weight"), Linear(head), dtype, fc)

    def quantize(self, group_size: int = 128, use_zero_point: bool = True) -> "Transformer":
        """A copy whose projections are INT4 (RTN); embeddings, norms and lm_head stay dense."""
        layers = [replace(l, qkv=l.qkv.quantized(group_size, use_zero_point), o=l.o.quantized(group_size, use_zero_point),
                          gate_up=l.gate_up.quantized(group_size, use_zero_point),
                          down=l.down.quantized(group_size, use_zero_point)) for l in self.layers]
        return Transformer(self.config, self.embed, layers, self.norm, self.lm_head, self.dtype, self.fc)

    def to(self, device: torch.device | str) -> "Transformer":
        """A copy on ``device``, dtypes kept; INT4 projections get the CPU's dequantized copy there (``int4_linear``)."""
        def lin(x: Linear | None) -> Linear | None:
            if x is None:
                return None
            bias = None if x.bias is None else x.bias.to(device)
            perm = None if x.perm is None else x.perm.to(device)
            if isinstance(x.weight, Int4Weight):
                return int4_linear(x.weight.to(device), bias, perm)
            return Linear(x.weight.to(device), bias, None, perm)

        layers = [replace(l, input_norm=l.input_norm.to(device), post_norm=l.post_norm.to(device), qkv=lin(l.qkv),
                          o=lin(l.o), gate_up=lin(l.gate_up), down=lin(l.down)) for l in self.layers]
        return Transformer(self.config, self.embed.to(device), layers, self.norm.to(device), lin(self.lm_head),
                           self.dtype, lin(self.fc))

    def truncated(self, num_layers: int) -> "Transformer":
        """The first ``num_layers`` layers plus the final norm and head (a layer-skip self-draft)."""
        if not 1 <= num_layers <= self.num_layers:
            raise ValueError(f"self-draft layers must be in 1..{self.num_layers}, got {num_layers}")
        return Transformer(self.config, self.embed, self.layers[:num_layers], self.norm, self.lm_head, self.dtype,
                           self.fc)

    def cut_head(self, ids: torch.Tensor) -> "Transformer":
        """A copy whose LM head scores only the tokens ``ids`` ``[K]``: its logits are ``[R, K]``, column ``j``
        token ``ids[j]`` (a drafter's FR-Spec head, draft/vocab.py). The K rows are copied out once."""
        w = self.lm_head.weight
        if isinstance(w, Int4Weight):
            raise ValueError("an INT4 LM head cannot be cut")
        head = Linear(w.index_select(0, ids.to(w.device)).contiguous(),
                      None if self.lm_head.bias is None else self.lm_head.bias[ids.to(w.device)])
        return Transformer(self.config, self.embed, self.layers, self.norm, head, self.dtype, self.fc)

    @property
    def logits_width(self) -> int:
        """Columns of ``forward``'s logits: the vocabulary, or a cut head's tokens."""
        w = self.lm_head.weight
        return w.out_features if isinstance(w, Int4Weight) else w.shape[0]

    def new_cache(self, num_blocks: int, page_size: int) -> KVCache:
        c = self.config
        return KVCache(self.num_layers, num_blocks, page_size, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, features: torch.Tensor | None = None,
                logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """Run every new token, write its K/V into ``cache``, return logits ``[R, V]`` float32.
        ``features`` ``[T, hidden]``: a feature draft's second input (see ``fc``). ``logits_out``: a float32
        buffer of at least ``R`` rows the logits are written into (the float conversion's own kernel), and
        returned a view of (target/graphs.py: one buffer for every graph)."""
        h = self._layers(batch, cache, features)
        h = fused_rms_norm(h[batch.logits_indices], self.norm, self.config.rms_norm_eps)  # [R, hidden]
        return _as_float(self.lm_head(h), logits_out)  # [R, V]

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch, cache: KVCache, features: torch.Tensor | None = None,
                       logits_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s logits, and every token's feature ``[T, hidden]``: the final-normed hidden state the
        LM head reads (what a feature draft is fed, and what it predicts)."""
        hn = fused_rms_norm(self._layers(batch, cache, features), self.norm, self.config.rms_norm_eps)  # [T, hidden]
        return _as_float(self.lm_head(hn[batch.logits_indices]), logits_out), hn

    def _layers(self, batch: ForwardBatch, cache: KVCache, features: torch.Tensor | None) -> torch.Tensor:
        c = self.config
        H, Hkv, D = c.num_heads, c.num_kv_heads, c.head_dim
        T = batch.num_tokens
        scale = 1.0 / math.sqrt(D)
        h = self.embed[batch.tokens]  # [T, hidden]
        if self.fc is not None:
            if features is None:
                raise ValueError("a feature draft's forward needs the target's features")
            h = self.fc(torch.cat((h, features.to(h.dtype)), dim=-1))
        for i, layer in enumerate(self.layers):
            # an act-order projection's input gather rides the norm before it (rms_norm's perm)
            x = fused_rms_norm(h, layer.input_norm, c.rms_norm_eps, perm=layer.qkv.perm)
            k_layer, v_layer = cache.k[i], cache.v[i]  # [num_blocks, P, Hkv, D]
            # lookahead: each projection names the one after the latency-bound kernels that follow it
            q = layer.qkv.qkv_rope_cache(x, batch.positions, self.inv_freq, k_layer, v_layer, batch.slot_mapping, H,
                                         Hkv, permuted=True, lookahead=layer.o)  # [T, H, D]; K/V written into the cache
            attn = tree_attention(q, k_layer, v_layer, batch.block_tables, batch.context_lens,
                                  batch.query_start, batch.mask_bits, scale, is_decode=batch.is_decode)  # [T, H, D]
            h = layer.o(attn.reshape(T, H * D), residual=h, lookahead=layer.gate_up)
            x = fused_rms_norm(h, layer.post_norm, c.rms_norm_eps, perm=layer.gate_up.perm)
            after = self.layers[i + 1].qkv if i + 1 < len(self.layers) else None
            h = layer.down(layer.gate_up.silu_mul(x, permuted=True), residual=h, lookahead=after)
        return h  # [T, hidden], before the final norm
