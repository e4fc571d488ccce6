"""Paged KV cache: a pool of fixed-size blocks, per-sequence block tables, reference counts.

The bookkeeping (``BlockPool``, ``BlockTable``) is plain Python and never touches torch, so it can be
tested exhaustively; ``KVCache`` owns the tensors. Slot ``s`` of the flat cache is block ``s // P``,
offset ``s % P``.

Ownership: a ``BlockTable`` belongs to one sequence in one cache (target or draft). Forked tables share
blocks by reference count; a shared block is copied before it is written (copy-on-write), so a fork
never sees its sibling's writes.
"""

from __future__ import annotations

from collections import deque

import torch


class NoFreeBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; the scheduler preempts or waits."""


class BlockPool:
    """Free list plus reference counts for ``num_blocks`` blocks of ``page_size`` slots."""

    def __init__(self, num_blocks: int, page_size: int) -> None:
        if num_blocks <= 0 or page_size <= 0:
            raise ValueError(f"num_blocks and page_size must be positive, got {num_blocks}, {page_size}")
        self.num_blocks = num_blocks
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeBlocks(f"all {self.num_blocks} KV blocks are in use")
        block = self._free.popleft()
        self._refs[block] = 1
        return block

    def incref(self, block: int) -> None:
        assert self._refs[block] > 0, f"incref of free block {block}"
        self._refs[block] += 1

    def decref(self, block: int) -> None:
        assert self._refs[block] > 0, f"double free of block {block}"
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def refcount(self, block: int) -> int:
        return self._refs[block]


class BlockTable:
    """One sequence's blocks in one cache. ``blocks[i]`` holds slots ``i*P .. i*P + P - 1``."""

    __slots__ = ("pool", "blocks")

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.blocks: list[int] = []

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.page_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Extra blocks that ``ensure(num_tokens)`` would allocate."""
        return max(0, -(-num_tokens // self.pool.page_size) - len(self.blocks))

    def ensure(self, num_tokens: int) -> None:
        """Grow to hold ``num_tokens`` slots; all-or-nothing when the pool runs dry."""
        need = self.blocks_needed(num_tokens)
        if need > self.pool.num_free:
            raise NoFreeBlocks(f"need {need} KV blocks, {self.pool.num_free} free")
        self.blocks.extend(self.pool.allocate() for _ in range(need))

    def truncate(self, num_tokens: int) -> None:
        """Return the blocks past ``num_tokens`` slots to the pool."""
        keep = -(-num_tokens // self.pool.page_size)
        while len(self.blocks) > keep:
            self.pool.decref(self.blocks.pop())

    def release(self) -> None:
        self.truncate(0)

    def fork(self) -> "BlockTable":
        """A new table sharing every block (prefix sharing / a tree branch)."""
        other = BlockTable(self.pool)
        for b in self.blocks:
            self.pool.incref(b)
        other.blocks = list(self.blocks)
        return other

    def shared_blocks_in(self, start: int, end: int) -> list[int]:
        """Indices into ``blocks`` of shared blocks that slots [start, end) would write."""
        P = self.pool.page_size
        return [i for i in range(start // P, -(-end // P)) if i < len(self.blocks) and self.pool.refcount(self.blocks[i]) > 1]

    def slots(self, start: int, end: int) -> list[int]:
        return self.slots_of(range(start, end))

    def slots_of(self, positions) -> list[int]:
        """Flat cache slots of token positions (each must be within ``capacity``)."""
        P = self.pool.page_size
        return [self.blocks[p // P] * P + p % P for p in positions]


class KVCache:
    """K and V tensors for every layer: ``[L, num_blocks, P, Hkv, D]`` each, plus the block pool."""

    def __init__(self, num_layers: int, num_blocks: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, num_blocks, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.pool = BlockPool(num_blocks, page_size)

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
            self.k[:, fresh] = self.k[:, old]
            self.v[:, fresh] = self.v[:, old]
            self.pool.decref(old)
            table.blocks[i] = fresh

    @staticmethod
    def bytes_per_block(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
