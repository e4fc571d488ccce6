"""W4A16 matmul: ``y = x @ dequant(W).T (+ bias)`` with group-wise INT4 weights.

Layout (the project's one INT4 format; loaders and quantizers repack into it once):

* ``qweight``: int32 ``[K // 8, N]``. Word ``qweight[k // 8, n]`` holds the 4-bit codes of
  ``W[n, k .. k+7]``, code ``k % 8`` in bits ``4 * (k % 8) .. 4 * (k % 8) + 3`` (GPTQ's packing, so
  GPTQ checkpoints load without reordering). Threads that walk ``n`` read consecutive words.
* ``scales``: ``[K // G, N]`` in the activation dtype.
* ``zeros``: ``[K // G, N]`` in the activation dtype, or ``None`` for symmetric codes (zero point 8).
* ``W[n, k] = (code - zero[k // G, n]) * scale[k // G, n]``.

The Triton kernels (``kernels/int4_matmul_triton.py``) read this layout as is: no GPU repack. On CUDA
they tune once per (M bucket, shape) on the first eager call, so call each shape once before capturing
a CUDA graph. Fused epilogues: ``bias``, ``residual=``, ``int4_matmul_silu_mul`` (SwiGLU's gate) and
``int4_qkv_rope_cache`` (RoPE and the KV-cache write of a fused qkv projection).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import dispatch
from kernels import int4_matmul_triton as _triton
from kernels.fused_norm_rope import rope_and_cache
from kernels.int4_matmul_triton import Rope, int4_matmul_triton


@dataclass(slots=True)
class Int4Weight:
    qweight: torch.Tensor  # [K // 8, N] int32
    scales: torch.Tensor  # [K // G, N]
    zeros: torch.Tensor | None  # [K // G, N] or None (symmetric, zero point 8)
    group_size: int
    whole_zeros: bool | None = None  # every zero point a whole number; None: not yet looked at

    def zeros_are_whole(self) -> bool:
        """Whole-number zero points (RTN, GPTQ) let the kernels subtract them in 16 bits; fractional ones
        (GGUF Q4_1's minimum, tuned zero points) take the factored path. Looked at once: one sync, at the
        first (eager) call. Inside a CUDA graph capture a sync is not allowed: an unlooked-at weight takes
        the factored path there, which is right for any zero points."""
        if self.whole_zeros is None:
            if self.zeros is None:
                self.whole_zeros = True
            elif self.zeros.is_cuda and torch.cuda.is_current_stream_capturing():
                return False
            else:
                self.whole_zeros = bool(torch.equal(self.zeros, self.zeros.round()))
        return self.whole_zeros

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * 8

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    def to(self, device: torch.device | str) -> "Int4Weight":
        z = None if self.zeros is None else self.zeros.to(device)
        return Int4Weight(self.qweight.to(device), self.scales.to(device), z, self.group_size, self.whole_zeros)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] integer codes in 0..15 -> [K // 8, N] int32 in the layout above."""
    N, K = codes.shape
    c = codes.to(torch.int64).T.reshape(K // 8, 8, N)  # [K/8, 8, N]
    shifts = (torch.arange(8, device=codes.device, dtype=torch.int64) * 4)[None, :, None]
    words = (c << shifts).sum(1)  # [K/8, N], fits in 32 bits unsigned
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """[K // 8, N] int32 -> [N, K] int64 codes."""
    K8, N = qweight.shape
    shifts = (torch.arange(8, device=qweight.device, dtype=torch.int64) * 4)[None, :, None]
    codes = (qweight.to(torch.int64)[:, None, :] >> shifts) & 0xF  # [K/8, 8, N]
    return codes.reshape(K8 * 8, N).T


def quantize_rtn(w: torch.Tensor, group_size: int = 128, use_zero_point: bool = True,
                 dtype: torch.dtype | None = None) -> Int4Weight:
    """Round-to-nearest INT4 of a ``[N, K]`` weight, group-wise along K.

    With zero points the group's [min, max] maps onto 0..15 (asymmetric); without, codes are
    symmetric around 8 with ``scale = absmax / 7``.
    """
    N, K = w.shape
    if K % group_size or group_size % 8:
        raise ValueError(f"in_features {K} must be a multiple of group_size {group_size} (itself a multiple of 8)")
    dtype = dtype or w.dtype
    g = w.float().reshape(N, K // group_size, group_size)  # [N, K/G, G]
    if use_zero_point:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = (-lo / scale).round().clamp(0, 15)
    else:
        scale = (g.abs().amax(-1) / 7).clamp(min=1e-8)
        zero = torch.full_like(scale, 8.0)
    codes = (g / scale[..., None] + zero[..., None]).round().clamp(0, 15).reshape(N, K)
    zeros = zero.T.contiguous().to(dtype) if use_zero_point else None
    return Int4Weight(pack_int4(codes), scale.T.contiguous().to(dtype), zeros, group_size)


def dequantize(w: Int4Weight) -> torch.Tensor:
    """Int4Weight -> [N, K] weight in the scales' dtype."""
    codes = unpack_int4(w.qweight).float()  # [N, K]
    G = w.group_size
    scales = w.scales.float().T.repeat_interleave(G, dim=1)  # [N, K]
    zeros = 8.0 if w.zeros is None else w.zeros.float().T.repeat_interleave(G, dim=1)
    return ((codes - zeros) * scales).to(w.scales.dtype)


@dataclass(slots=True)
class CpuInt4:
    """A weight in torch's CPU INT4 format (``_weight_int4pack_mm_for_cpu``, the tinygemm kernel's layout):
    ``W = (code - 8) * scale + offset`` per group of K, which holds this project's ``(code - zero) * scale``
    exactly as offset ``(8 - zero) * scale``. The kernel reads 4-bit codes where the CPU path's dequantized
    copy is float32 (an eighth of the bytes) and runs with bfloat16 activations and scales."""

    packed: torch.Tensor
    scales_offsets: torch.Tensor  # [K // G, N, 2] bfloat16
    group_size: int

    @staticmethod
    def of(w: Int4Weight) -> "CpuInt4 | None":
        """``w`` in this form, or None where this torch has no such kernel or it refuses the shape."""
        convert = getattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu", None)
        if convert is None or w.qweight.is_cuda or w.group_size not in (32, 64, 128, 256):
            return None
        scale = w.scales.float()  # [K // G, N]
        zero = 8.0 if w.zeros is None else w.zeros.float()
        offsets = torch.stack([scale, (8.0 - zero) * scale], -1).to(torch.bfloat16).contiguous()
        try:
            packed = convert(unpack_int4(w.qweight).to(torch.int32).contiguous(), 1)
        except RuntimeError:
            return None
        return CpuInt4(packed, offsets, w.group_size)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for ``x`` ``[M, K]``, in ``x``'s dtype."""
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, self.group_size,
                                                       self.scales_offsets)
        return y.to(x.dtype)


def int4_matmul_ref(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """The spec and the CPU path: dequantize, then a dense matmul. x: [..., K] -> [..., N]."""
    y = torch.nn.functional.linear(x, dequantize(w).to(x.dtype))
    y = y if bias is None else y + bias
    return y if residual is None else y + residual


def int4_matmul_silu_mul_ref(x: torch.Tensor, w_gate_up: Int4Weight) -> torch.Tensor:
    """SwiGLU's first half: ``silu(x @ W_gate.T) * (x @ W_up.T)``; gate rows first. [..., K] -> [..., N // 2]."""
    gate, up = int4_matmul_ref(x, w_gate_up).float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [M, K] with unit stride along K (the kernels index rows by stride only)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _ahead(w: Int4Weight | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    return None if w is None else (w.qweight, w.scales)


def int4_matmul(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None, *,
                residual: torch.Tensor | None = None, use_triton: bool | None = None,
                lookahead: Int4Weight | None = None) -> torch.Tensor:
    """Dispatch ``x @ dequant(W).T + bias + residual``: Triton on CUDA, the reference elsewhere.

    x: [..., K] fp16/bf16 (fp32 too); bias: [N]; residual: [..., N]. ``use_triton=True`` on CPU tensors
    runs the kernels under ``TRITON_INTERPRET=1`` (tests). ``lookahead``: the weight the caller multiplies
    next, for the kernel to ask L2 for (``SPECGATE_INT4_LOOKAHEAD``).
    """
    if not dispatch.use_triton(x, use_triton):
        return int4_matmul_ref(x, w, bias, residual)
    res = None if residual is None else _rows(residual)
    y = int4_matmul_triton(_rows(x), w.qweight, w.scales, w.zeros, w.group_size, bias=bias, residual=res,
                           whole_zeros=w.zeros_are_whole(), lookahead=_ahead(lookahead))
    return y.reshape(*x.shape[:-1], w.out_features)


def int4_matmul_silu_mul(x: torch.Tensor, w_gate_up: Int4Weight, *, use_triton: bool | None = None,
                         lookahead: Int4Weight | None = None) -> torch.Tensor:
    """Fused ``silu(x @ W_gate.T) * (x @ W_up.T)`` over gate_up's [2 * I, K] weight. [..., K] -> [..., I]."""
    if not dispatch.use_triton(x, use_triton):
        return int4_matmul_silu_mul_ref(x, w_gate_up)
    y = int4_matmul_triton(_rows(x), w_gate_up.qweight, w_gate_up.scales, w_gate_up.zeros, w_gate_up.group_size,
                           silu=True, whole_zeros=w_gate_up.zeros_are_whole(), lookahead=_ahead(lookahead))
    return y.reshape(*x.shape[:-1], w_gate_up.out_features // 2)


def int4_qkv_rope_cache(x: torch.Tensor, w_qkv: Int4Weight, bias: torch.Tensor | None, positions: torch.Tensor,
                        inv_freq: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                        slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, *,
                        use_triton: bool | None = None, fused: bool | None = None,
                        lookahead: Int4Weight | None = None) -> torch.Tensor:
    """``rope_and_cache(int4_matmul(x, w_qkv, bias), ...)``: a fused qkv projection ([H | Hkv | Hkv] heads of D
    columns), q and k rotated, k and v written into the cache layers at ``slot_mapping``; returns q [T, H, D].

    ``fused`` (default: ``SPECGATE_INT4_ROPE``): on the Triton path the matmul's epilogue does all of it in one
    launch (``Rope``), where the cache layers are contiguous in x's dtype and D is a power of two from 16 to 256;
    otherwise, and on the reference path, the projection and ``rope_and_cache`` run one after the other."""
    triton_path = dispatch.use_triton(x, use_triton)
    D = 2 * inv_freq.shape[0]
    fusable = (triton_path and (_triton.ROPE if fused is None else fused) and x.dim() == 2
               and D in (16, 32, 64, 128, 256) and w_qkv.out_features == (num_heads + 2 * num_kv_heads) * D
               and k_layer.is_contiguous() and v_layer.is_contiguous() and k_layer.shape == v_layer.shape
               and tuple(k_layer.shape[2:]) == (num_kv_heads, D)
               and k_layer.dtype == x.dtype and v_layer.dtype == x.dtype)
    if not fusable:
        qkv = int4_matmul(x, w_qkv, bias, use_triton=use_triton, lookahead=lookahead)
        return rope_and_cache(qkv, positions, inv_freq, k_layer, v_layer, slot_mapping, num_heads, num_kv_heads,
                              use_triton=use_triton)
    rope = Rope(positions, inv_freq, k_layer, v_layer, slot_mapping, num_heads, num_kv_heads)
    q = int4_matmul_triton(_rows(x), w_qkv.qweight, w_qkv.scales, w_qkv.zeros, w_qkv.group_size, bias=bias,
                           whole_zeros=w_qkv.zeros_are_whole(), rope=rope, lookahead=_ahead(lookahead))
    return q.view(x.shape[0], num_heads, D)
