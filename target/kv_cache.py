"""Paged KV cache tensors: ``[L, num_blocks, P, Hkv, D]`` for K and V, over a ``BlockPool``.

The bookkeeping lives in ``target/blocks.py`` (plain Python); this file owns the tensors and the one
operation that needs both, copy-on-write of shared blocks.
"""

from __future__ import annotations

import torch

from kernels.compact_kv import compact_kv
from target.blocks import BlockPool, BlockTable, NoFreeBlocks
from target.transfer import to_device

__all__ = ["BlockPool", "BlockTable", "KVCache", "NoFreeBlocks"]


class KVCache:
    """K and V tensors for every layer: ``[L, num_blocks, P, Hkv, D]`` each, plus the block pool."""

    def __init__(self, num_layers: int, num_blocks: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        # One block past the pool's is never handed out: padded rows of a CUDA-graph batch write and read it.
        shape = (num_layers, num_blocks + 1, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pool = BlockPool(num_blocks, page_size)
        self.scratch_block = num_blocks

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def new_table(self) -> BlockTable:
        return BlockTable(self.pool)

    def make_writable(self, table: BlockTable, start: int, end: int) -> None:
        """Copy-on-write: give ``table`` private copies of shared blocks that [start, end) touches."""
        for i in table.shared_blocks_in(start, end):
            fresh = self.pool.allocate()
            old = table.blocks[i]
            self.copy_block(old, fresh)
            self.pool.decref(old)
            table.blocks[i] = fresh

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``src``'s K/V into block ``dst``, every layer."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def compact(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Move accepted tree nodes' K/V: ``[M]`` int64 flat slots on the cache's device (see kernels/compact_kv.py)."""
        compact_kv(self.k, self.v, src_slots, dst_slots)

    def compact_slots(self, src: list[int], dst: list[int]) -> None:
        """``compact`` from host lists, with one host-to-device copy for both. Each row is padded to a multiple
        of 16 entries, so both start 128-byte aligned: Triton specialises a kernel on its pointers' 16-byte
        alignment, and a destination row right after ``M`` sources is aligned only for even ``M``: the first odd
        count after even ones would compile a second variant mid-serving. (The H200 caught one mid-serving
        compile of about 0.45 s, kernel unrecorded: bench/results/engine_real_b1_a829433.json.)"""
        M = len(src)
        pad = [0] * (-M % 16)
        both = to_device(torch.tensor([src + pad, dst + pad], dtype=torch.int64), self.k.device)
        self.compact(both[0, :M], both[1, :M])

    @staticmethod
    def bytes_per_block(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
