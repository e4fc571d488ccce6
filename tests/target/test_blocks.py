"""Block pool and tables: reference counts, copy-on-write forks, prefix cache with LRU parking."""

from __future__ import annotations

import pytest

from target.blocks import BlockPool, BlockTable, NoFreeBlocks


def test_allocate_free_and_exhaustion() -> None:
    pool = BlockPool(3, 4)
    t = BlockTable(pool)
    t.ensure(12)
    assert pool.num_free == 0
    with pytest.raises(NoFreeBlocks):
        BlockTable(pool).ensure(1)
    t.truncate(5)
    assert len(t.blocks) == 2 and pool.num_free == 1
    t.release()
    assert pool.num_free == 3


def test_ensure_is_all_or_nothing() -> None:
    pool = BlockPool(2, 4)
    t = BlockTable(pool)
    with pytest.raises(NoFreeBlocks):
        t.ensure(100)
    assert not t.blocks and pool.num_free == 2


def test_fork_shares_blocks_until_released() -> None:
    pool = BlockPool(4, 4)
    a = BlockTable(pool)
    a.ensure(8)
    b = a.fork()
    assert b.blocks == a.blocks and all(pool.refcount(x) == 2 for x in a.blocks)
    assert a.shared_blocks_in(4, 8) == [1]
    a.release()
    assert pool.num_free == 2
    b.release()
    assert pool.num_free == 4


def test_prefix_cache_parks_and_reuses() -> None:
    pool = BlockPool(4, 2)
    ids = [5, 6, 7, 8, 9]
    a = BlockTable(pool)
    a.ensure(5)
    a.register_prefix(ids, 5)  # two full blocks registered
    assert pool.num_cached == 2
    a.release()
    assert pool.num_free == 4  # parked blocks count as free
    b = BlockTable(pool)
    assert b.adopt_prefix(ids, 4) == 4 and pool.prefix_hit_blocks == 2
    c = BlockTable(pool)
    assert c.adopt_prefix([5, 6, 0, 0], 4) == 2  # shares only the first block
    b.release()
    c.release()
    assert pool.num_free == 4


def test_parked_blocks_are_evicted_lru_when_needed() -> None:
    pool = BlockPool(2, 2)
    a = BlockTable(pool)
    a.ensure(4)
    a.register_prefix([1, 2, 3, 4], 4)
    a.release()
    t = BlockTable(pool)
    t.ensure(4)  # no plain free block left: both parked blocks are evicted
    assert pool.num_cached == 0
    t.release()
    assert BlockTable(pool).adopt_prefix([1, 2, 3, 4], 4) == 0
