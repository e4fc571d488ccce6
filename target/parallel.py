"""Tensor-parallel sharding of the target over N ranks, after Megatron-LM's column / row parallel layers.

Per layer each rank holds:

* ``qkv``: column-parallel. Its ``H / N`` query heads and ``Hkv / N`` KV heads (rows ``[q_r; k_r; v_r]``), so
  attention runs on local heads only and each rank's paged KV holds only its own KV heads.
* ``o``: row-parallel. The K columns of its query heads; the partial products are summed by one
  ``all_reduce(SUM)``.
* ``gate_up``: column-parallel, rows ``[gate_r; up_r]`` so the fused SwiGLU still splits at N / 2.
* ``down``: row-parallel over the intermediate dimension, then ``all_reduce(SUM)``.

Row-parallel bias and residual: rank 0 alone adds them (fused into its matmul epilogue, as in one process),
the other ranks add nothing, so the sum holds each once. INT4 weights are sliced as stored, never
re-quantized: column slices take whole ``qweight`` / ``scales`` columns, and a row-parallel slice along K
must start and end on a group boundary (``K / N`` a multiple of the group size), else ``shard`` raises.

The embedding is replicated (a lookup, no collective). The lm_head is vocab-parallel: each rank scores
``ceil(V / N)`` rows (the last padded with zeros) and ``all_gather`` assembles ``[R, V]`` on every rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from kernels.int4_matmul import Int4Weight
from kernels.tree_attention import tree_attention
from kernels.fused_norm_rope import rms_norm
from target.batch import ForwardBatch
from target.config import ModelConfig
from target.kv_cache import KVCache
from target.model import Layer, Linear, Transformer, int4_linear


def check_shardable(config: ModelConfig, world_size: int) -> None:
    """Raise ValueError naming the count that does not split over ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {world_size}")
    for name, count in (("num_attention_heads", config.num_heads), ("num_key_value_heads", config.num_kv_heads),
                        ("intermediate_size", config.intermediate_size)):
        if count % world_size:
            raise ValueError(f"{name} {count} is not divisible by tensor_parallel {world_size}: "
                             f"each rank must hold whole heads (this model splits over "
                             f"{[n for n in range(1, config.num_kv_heads + 1) if _fits(config, n)]} ranks)")


def _fits(config: ModelConfig, n: int) -> bool:
    return not (config.num_heads % n or config.num_kv_heads % n or config.intermediate_size % n)


def column_shard(lin: Linear, rows: torch.Tensor, device: torch.device | str) -> Linear:
    """The output features ``rows`` ([n] int64) of ``lin``: weight rows for dense, qweight columns for INT4."""
    bias = None if lin.bias is None else lin.bias[rows].to(device)
    perm = None if lin.perm is None else lin.perm.to(device)  # the input order: K is not split here
    w = lin.weight
    if isinstance(w, Int4Weight):
        zeros = None if w.zeros is None else w.zeros[:, rows]
        shard = Int4Weight(w.qweight[:, rows].contiguous(), w.scales[:, rows].contiguous(),
                           None if zeros is None else zeros.contiguous(), w.group_size)
        return int4_linear(shard.to(device), bias, perm)
    return Linear(w[rows].contiguous().to(device), bias)


def row_shard(lin: Linear, start: int, end: int, keep_bias: bool, device: torch.device | str) -> Linear:
    """Input features ``[start, end)`` of ``lin``; the bias only where ``keep_bias`` (rank 0)."""
    bias = lin.bias.to(device) if keep_bias and lin.bias is not None else None
    w = lin.weight
    if not isinstance(w, Int4Weight):
        return Linear(w[:, start:end].contiguous().to(device), bias)
    G = w.group_size
    if start % G or end % G:
        raise ValueError(f"cannot split an INT4 weight with group size {G} along K at [{start}, {end}): the "
                         f"shard must hold whole groups; quantize with a group size dividing {end - start}")
    if lin.perm is not None:
        # An act-order permutation mixes inputs across shards, and the local input holds only this rank's part.
        raise ValueError("act-order (g_idx) INT4 weights cannot be split along K: "
                         "use RTN or a checkpoint quantized without act-order")
    zeros = None if w.zeros is None else w.zeros[start // G : end // G].contiguous()
    shard = Int4Weight(w.qweight[start // 8 : end // 8].contiguous(), w.scales[start // G : end // G].contiguous(),
                       zeros, G)
    return int4_linear(shard.to(device), bias)


def _span(start: int, size: int) -> torch.Tensor:
    return torch.arange(start, start + size, dtype=torch.int64)


def shard_layer(layer: Layer, config: ModelConfig, rank: int, world_size: int, device: torch.device | str) -> Layer:
    """Rank ``rank``'s part of one layer (see the module docstring)."""
    H, Hkv, D, I = config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    h, hkv, i = H // world_size, Hkv // world_size, I // world_size
    qkv_rows = torch.cat([_span(rank * h * D, h * D), _span(H * D + rank * hkv * D, hkv * D),
                          _span((H + Hkv) * D + rank * hkv * D, hkv * D)])
    gate_up_rows = torch.cat([_span(rank * i, i), _span(I + rank * i, i)])
    first = rank == 0
    return Layer(
        input_norm=layer.input_norm.to(device),
        qkv=column_shard(layer.qkv, qkv_rows, device),
        o=row_shard(layer.o, rank * h * D, (rank + 1) * h * D, first, device),
        post_norm=layer.post_norm.to(device),
        gate_up=column_shard(layer.gate_up, gate_up_rows, device),
        down=row_shard(layer.down, rank * i, (rank + 1) * i, first, device),
    )


def shard_head(lm_head: Linear, vocab_size: int, rank: int, world_size: int, device: torch.device | str) -> Linear:
    """Rows ``[rank * Vr, (rank + 1) * Vr)`` of the lm_head, ``Vr = ceil(V / N)``, zero-padded past V so every
    rank's logits have one shape (``all_gather`` needs equal sizes)."""
    Vr = -(-vocab_size // world_size)
    lo, hi = rank * Vr, min((rank + 1) * Vr, vocab_size)
    if isinstance(lm_head.weight, Int4Weight):
        if vocab_size % world_size:
            raise ValueError(f"an INT4 lm_head needs vocab_size {vocab_size} divisible by tensor_parallel {world_size}")
        return column_shard(lm_head, _span(lo, hi - lo), device)
    w = lm_head.weight[lo:hi]  # [<= Vr, hidden]
    pad = w.new_zeros(Vr - w.shape[0], w.shape[1])
    return Linear(torch.cat([w, pad]).to(device), None)


class ShardedTransformer(Transformer):
    """One rank's shard of a ``Transformer``; ``forward`` has the same signature and runs the collectives.

    Every rank must call ``forward`` with the same batch, in the same order: the all-reduces pair up
    across ranks. ``config`` stays the full model's; ``num_heads`` / ``num_kv_heads`` are the local counts.
    """

    def __init__(self, full: Transformer, rank: int, world_size: int, device: torch.device | str,
                 group: dist.ProcessGroup | None = None) -> None:
        c = full.config
        check_shardable(c, world_size)
        layers = [shard_layer(l, c, rank, world_size, device) for l in full.layers]
        head = shard_head(full.lm_head, c.vocab_size, rank, world_size, device)
        super().__init__(c, full.embed.to(device), layers, full.norm.to(device), head, full.dtype)
        self.rank, self.world_size, self.group = rank, world_size, group
        self.num_heads, self.num_kv_heads = c.num_heads // world_size, c.num_kv_heads // world_size

    def new_cache(self, num_blocks: int, page_size: int) -> KVCache:
        """This rank's KV: the same blocks and pages as every rank, its own KV heads only."""
        return KVCache(self.num_layers, num_blocks, page_size, self.num_kv_heads, self.config.head_dim,
                       self.dtype, self.device)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Run every new token on local heads, write local K/V into ``cache``, return full logits ``[R, V]`` float32."""
        c = self.config
        H, Hkv, D = self.num_heads, self.num_kv_heads, c.head_dim
        T = batch.num_tokens
        first = self.rank == 0  # adds the residual (and bias) of row-parallel outputs, once
        h = self.embed[batch.tokens]  # [T, hidden], replicated
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, c.rms_norm_eps, perm=layer.qkv.perm)  # act-order: gathered here
            k_layer, v_layer = cache.k[i], cache.v[i]  # [num_blocks, P, Hkv/N, D]
            q = layer.qkv.qkv_rope_cache(x, batch.positions, self.inv_freq, k_layer, v_layer, batch.slot_mapping, H,
                                         Hkv, permuted=True)  # [T, H/N, D]; local K/V written into the cache
            attn = tree_attention(q, k_layer, v_layer, batch.block_tables, batch.context_lens, batch.query_start,
                                  batch.mask_bits, 1.0 / math.sqrt(D), is_decode=batch.is_decode)  # [T, H/N, D]
            h = self._reduce(layer.o(attn.reshape(T, H * D), residual=h if first else None))  # [T, hidden]
            x = rms_norm(h, layer.post_norm, c.rms_norm_eps, perm=layer.gate_up.perm)
            h = self._reduce(layer.down(layer.gate_up.silu_mul(x, permuted=True), residual=h if first else None))
        h = rms_norm(h[batch.logits_indices], self.norm, c.rms_norm_eps)  # [R, hidden]
        return self._gather_vocab(self.lm_head(h).float())  # [R, V]

    def _gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """[R, V/N] per rank -> [R, V] on every rank. all_gather rather than gather: NCCL and gloo both have it."""
        if local.shape[0] == 0:  # a prefill-only step: every rank sees R = 0 and skips the collective together
            return local.new_empty(0, self.config.vocab_size)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, : self.config.vocab_size]
