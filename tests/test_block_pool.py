"""The block pool's allocation order and prefix index (spec/slot-cache.md §Allocation order)."""

import numpy as np
import pytest

from kvref._block_pool import BlockPool
from kvspec import CapacityError


def test_initial_order_and_null_block():
    p = BlockPool(5)
    assert p.free_order() == [1, 2, 3, 4]
    assert p.allocate(2) == [1, 2]
    p.check_invariants({1: 1, 2: 1})


def test_unpublished_front_published_back_tail_first():
    p = BlockPool(6)
    a = p.allocate(4)  # [1,2,3,4]
    p.publish(1, b"h1", [0, 1])
    p.publish(2, b"h2", [2, 3])
    p.free(list(reversed(a)))  # tail first: 4,3 unpublished -> front; 2,1 published -> back
    assert p.free_order() == [3, 4, 5, 2, 1]
    # allocation pops unpublished first, then evicts the chain's tail (2) before its head (1)
    evicted = []
    p.on_evict = evicted.append
    assert p.allocate(4) == [3, 4, 5, 2]
    assert evicted == [b"h2"] and p.lookup(b"h1", [0, 1]) == 1


def test_lookup_verifies_tokens_and_twins():
    p = BlockPool(4)
    b1, b2 = p.allocate(2)
    assert p.publish(b1, b"h", [1, 2]) == b1
    assert p.publish(b2, b"h", [1, 2]) == b1  # twin: b2 stays private
    assert not p.is_published(b2)
    assert p.lookup(b"h", [1, 3]) is None  # same hash, other tokens: never a hit
    assert p.publish(b2, b"h", [9, 9]) == b2 and not p.is_published(b2)  # collision: not published


def test_touch_revives_and_reset_prefix_cache_keeps_referenced():
    p = BlockPool(4)
    b1, b2 = p.allocate(2)
    p.publish(b1, b"a", [1])
    p.publish(b2, b"b", [2])
    p.free([b2, b1])
    p.touch(b1)
    assert not p.is_free(b1) and p.ref_count[b1] == 1
    assert p.reset_prefix_cache() == [b2]
    assert p.lookup(b"a", [1]) == b1 and p.lookup(b"b", [2]) is None


def test_capacity_error_changes_nothing():
    p = BlockPool(3)
    p.allocate(1)
    snap = p.snapshot()
    with pytest.raises(CapacityError, match="needs 5 blocks, 1 free"):
        p.allocate(5)
    assert p.snapshot() == snap
