"""KV block bookkeeping: a pool of fixed-size blocks, reference counts, per-sequence block tables.

Plain Python, no torch, so the scheduler that counts blocks can be tested on its own. Slot ``s`` of a
flat cache is block ``s // P``, offset ``s % P``. Forked tables share blocks by reference count; the cache
copies a shared block before it is written (copy-on-write, ``KVCache.make_writable``).
"""

from __future__ import annotations

from collections import deque


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
