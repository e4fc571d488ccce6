"""KV block bookkeeping: a pool of fixed-size blocks, reference counts, per-sequence block tables.

Plain Python, no torch, so the scheduler that counts blocks can be tested on its own. Slot ``s`` of a
flat cache is block ``s // P``, offset ``s % P``. Forked tables share blocks by reference count; the cache
copies a shared block before it is written (copy-on-write, ``KVCache.make_writable``).
"""

from __future__ import annotations

import array
from collections import OrderedDict, deque


class NoFreeBlocks(RuntimeError):
    """The pool cannot satisfy an allocation; the scheduler preempts or waits."""


class BlockPool:
    """Free list plus reference counts for ``num_blocks`` blocks of ``page_size`` slots.

    Prefix caching (vLLM's automatic prefix caching, SGLang's radix cache in its simplest form): a full
    block of prompt tokens is registered under the hash of its whole prefix. When its last owner lets
    go it is not wiped but parked in an LRU list, still counted as free; a later sequence with the same
    prefix takes it back by hash, and allocation evicts the least recently parked block only when no
    plain free block is left.
    """

    def __init__(self, num_blocks: int, page_size: int) -> None:
        if num_blocks <= 0 or page_size <= 0:
            raise ValueError(f"num_blocks and page_size must be positive, got {num_blocks}, {page_size}")
        self.num_blocks = num_blocks
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._parked: OrderedDict[int, None] = OrderedDict()  # refcount 0 but holding a cached prefix, LRU first
        self._by_hash: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self.prefix_hit_blocks = 0  # blocks taken from the prefix cache since start

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._parked)

    @property
    def num_cached(self) -> int:
        """Blocks that hold a registered prefix (in use or parked)."""
        return len(self._hash_of)

    def allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._parked:
            block, _ = self._parked.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        else:
            raise NoFreeBlocks(f"all {self.num_blocks} KV blocks are in use")
        self._refs[block] = 1
        return block

    def register(self, block: int, prefix_hash: int) -> None:
        """Mark a full, final block as holding the prefix with this hash (first writer wins)."""
        if prefix_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[prefix_hash] = block
            self._hash_of[block] = prefix_hash

    def lookup(self, prefix_hash: int) -> int | None:
        """Take a reference to the block caching this prefix, or None."""
        block = self._by_hash.get(prefix_hash)
        if block is None:
            return None
        if self._refs[block] == 0:
            del self._parked[block]
        self._refs[block] += 1
        self.prefix_hit_blocks += 1
        return block

    def incref(self, block: int) -> None:
        assert self._refs[block] > 0, f"incref of free block {block}"
        self._refs[block] += 1

    def decref(self, block: int) -> None:
        assert self._refs[block] > 0, f"double free of block {block}"
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._hash_of:
                self._parked[block] = None
            else:
                self._free.append(block)

    def refcount(self, block: int) -> int:
        return self._refs[block]


class BlockTable:
    """One sequence's blocks in one cache. ``blocks[i]`` holds slots ``i*P .. i*P + P - 1``.

    ``blocks`` is an ``array('i')``, not a list: a forward packs every sequence's row into one int32 buffer
    (``target.batch.build_batch``), and arrays of one type extend each other by copying memory, where a
    list's ints are converted one by one (64 sequences at 2k tokens: 8,000 of them a step)."""

    __slots__ = ("pool", "blocks", "hashes")

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.blocks = array.array("i")
        self.hashes: list[int] = []  # prefix hashes of blocks[0 : len(hashes)], registered in the pool

    def adopt_prefix(self, token_ids: list[int], max_tokens: int) -> int:
        """On an empty table: take cached blocks for the longest prefix of ``token_ids`` that lies in
        full blocks within ``max_tokens``. Returns how many tokens are now cached."""
        assert not self.blocks, "adopt_prefix needs an empty table"
        P = self.pool.page_size
        h = 0
        for i in range(max_tokens // P):
            h = prefix_hash(h, token_ids[i * P : (i + 1) * P])
            block = self.pool.lookup(h)
            if block is None:
                break
            self.blocks.append(block)
            self.hashes.append(h)
        return len(self.blocks) * P

    def register_prefix(self, token_ids: list[int], num_tokens: int) -> None:
        """Register every full block inside ``[0, num_tokens)`` (their K/V are final) for reuse."""
        P = self.pool.page_size
        h = self.hashes[-1] if self.hashes else 0
        for i in range(len(self.hashes), min(num_tokens // P, len(self.blocks))):
            h = prefix_hash(h, token_ids[i * P : (i + 1) * P])
            self.pool.register(self.blocks[i], h)
            self.hashes.append(h)

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
        del self.hashes[keep:]

    def release(self) -> None:
        self.truncate(0)

    def fork(self) -> "BlockTable":
        """A new table sharing every block (prefix sharing / a tree branch)."""
        other = BlockTable(self.pool)
        for b in self.blocks:
            self.pool.incref(b)
        other.blocks = array.array("i", self.blocks)
        other.hashes = list(self.hashes)
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


def prefix_hash(parent: int, tokens: list[int]) -> int:
    """Hash of a block's tokens chained to its parent's hash, so equal hashes mean equal whole prefixes
    (up to a 64-bit collision, which the cache accepts as vLLM's default hash does)."""
    return hash((parent, tuple(tokens)))
