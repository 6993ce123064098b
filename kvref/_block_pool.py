"""The block pool: free list, reference counts and the prefix index (DESIGN §4.2).

One pool per paged storage (the slot cache has one; the manager has one per
replica and leaf). It knows nothing of K/V bytes, only block ids.

Allocation order (part of the spec, so block ids agree across backends):

* the free list starts in ascending id order ``1 .. num_blocks-1``
  (block 0 is the null block: never handed out, freed or published);
* a block freed (ref count reaching 0) that holds **no** published content
  goes to the **front** (reused first); a freed **published** block goes to
  the **back** and stays hittable until it is popped (LRU eviction);
* ``free`` takes blocks in the order given; callers release a sequence
  **tail first**, so a chain's tail is evicted before its head;
* ``allocate`` pops the front; popping a published block unpublishes it
  (eviction) and reports its hash to the ``on_evict`` listener.

It satisfies ``kvspec.engine.BlockPool`` (the batch methods are plain loops
over the per-block ones). Every operation is O(1) per block: the free list is an ordered dict used as
an intrusive doubly linked list (``move_to_end(last=False)`` pushes to the
front, ``popitem(last=False)`` pops it, ``del`` unlinks from the middle when a
prefix hit revives a free block).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable

import numpy as np

from kvspec.errors import CapacityError

__all__ = ["BlockPool", "NULL_BLOCK"]

#: The null block: padding target of every table, never allocated.
NULL_BLOCK = 0


class BlockPool:
    """Ids ``0 .. num_blocks-1`` with ref counts, a free list and a prefix index.

    Parameters
    ----------
    num_blocks : int
        Pool size including the null block (>= 2).
    on_evict : callable(bytes) -> None, optional
        Called with a published block's hash when the block is evicted
        (popped from the free list) or unpublished by ``reset_prefix_cache``.
    """

    def __init__(self, num_blocks: int, on_evict: Callable[[bytes], None] | None = None):
        if num_blocks < 2:
            raise ValueError(f"BlockPool: num_blocks={num_blocks}, must be >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.on_evict = on_evict
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Every block free in ascending order, nothing published."""
        n = self.num_blocks
        self.ref_count = [0] * n
        #: hash of a published block, else None
        self.block_hash: list[bytes | None] = [None] * n
        #: token ids (int32 [block_size]) of a published block, else None
        self.block_tokens: list[np.ndarray | None] = [None] * n
        #: prefix index: hash -> published block id
        self.hash_to_block: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, n))

    def snapshot(self):
        """An opaque copy of the whole state (for atomic rollback and tests)."""
        return (
            list(self.ref_count),
            list(self.block_hash),
            list(self.block_tokens),
            dict(self.hash_to_block),
            list(self._free),
        )

    def restore(self, snap) -> None:
        """Return to a state taken with ``snapshot``."""
        rc, bh, bt, idx, free = snap
        self.ref_count, self.block_hash, self.block_tokens = list(rc), list(bh), list(bt)
        self.hash_to_block = dict(idx)
        self._free = OrderedDict((b, None) for b in free)

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        """Blocks that ``allocate`` can hand out (free and evictable published)."""
        return len(self._free)

    @property
    def num_usable(self) -> int:
        """Blocks excluding the null block."""
        return self.num_blocks - 1

    def free_order(self) -> list[int]:
        """The free list front to back (the order ``allocate`` pops); for tests."""
        return list(self._free)

    def is_free(self, block: int) -> bool:
        """True when ``block`` is on the free list (free, or published with no reference)."""
        return block in self._free

    def is_published(self, block: int) -> bool:
        """True when ``block`` is in the prefix index (it has a hash)."""
        return self.block_hash[block] is not None

    def lookup(self, block_hash: bytes, tokens) -> int | None:
        """The published block holding ``block_hash`` **and** exactly ``tokens``, else None.

        Spec §6: a hash is a key, never a proof; the stored tokens must match.
        """
        block = self.hash_to_block.get(block_hash)
        if block is None:
            return None
        stored = self.block_tokens[block]
        if stored is None or not np.array_equal(stored, np.asarray(tokens, dtype=np.int32)):
            return None
        return block

    def contains_hash(self, block_hash: bytes) -> bool:
        """True when a published block holds ``block_hash`` (its tokens not checked)."""
        return block_hash in self.hash_to_block

    # ------------------------------------------------------------------ mutations

    def allocate(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the front of the free list, each with ref count 1.

        A popped published block is evicted: unpublished and reported to
        ``on_evict``. Raises ``CapacityError`` (state unchanged) when fewer
        than ``n`` blocks are free.
        """
        if n > len(self._free):
            raise CapacityError(f"BlockPool.allocate: needs {n} blocks, {len(self._free)} free or evictable")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._unpublish(block)
            self.ref_count[block] = 1
            out.append(block)
        return out

    def allocate_one(self) -> int:
        """``allocate(1)[0]`` (a decode step's page)."""
        return self.allocate(1)[0]

    def touch_many(self, blocks) -> int:
        """``touch`` each of ``blocks`` (distinct, none null); returns how many left the free list."""
        revived = 0
        for b in blocks:
            revived += self.ref_count[b] == 0
            self.touch(b)
        return revived

    def count_free(self, blocks) -> int:
        """How many of ``blocks`` (distinct) are on the free list."""
        return sum(1 for b in blocks if b in self._free)

    def lookup_run(self, hashes, tokens) -> list[int]:
        """The longest leading run of ``lookup`` hits; ``tokens`` int32 ``[len(hashes) * page]``."""
        out: list[int] = []
        if not len(hashes):
            return out
        page = len(tokens) // len(hashes)
        for i, h in enumerate(hashes):
            b = self.lookup(h, tokens[i * page : (i + 1) * page])
            if b is None:
                break
            out.append(b)
        return out

    def publish_run(self, blocks, hashes, tokens) -> list[int]:
        """``publish`` each block in order as one chain, stopping at the first collision
        (spec/manager.md §5.1); returns the kept page of each block before the stop."""
        out: list[int] = []
        if not len(blocks):
            return out
        page = len(tokens) // len(blocks)
        for i, (b, h) in enumerate(zip(blocks, hashes)):
            c = self.publish(b, h, tokens[i * page : (i + 1) * page])
            if c == b and self.block_hash[b] is None:
                break  # a collision: the chain stops here
            out.append(c)
        return out

    def peek(self, n: int, skip=()) -> list[int]:
        """The first ``n`` blocks ``allocate`` would pop once the blocks in ``skip`` left the free
        list (fewer when fewer are free); changes nothing (the manager plans before it commits)."""
        out: list[int] = []
        for b in self._free:
            if len(out) >= n:
                break
            if b not in skip:
                out.append(b)
        return out

    def touch(self, block: int) -> None:
        """Take one more reference; a free (published) block leaves the free list."""
        if block == NULL_BLOCK:
            raise ValueError("BlockPool.touch: block 0 is the null block")
        if self.ref_count[block] == 0:
            del self._free[block]
        self.ref_count[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block, in the order given.

        A block reaching 0 goes to the front of the free list if unpublished,
        to the back if published. The null block is skipped.
        """
        for block in blocks:
            if block == NULL_BLOCK:
                continue
            if self.ref_count[block] <= 0:
                raise AssertionError(f"BlockPool.free: block {block} ref_count={self.ref_count[block]}")
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self._free[block] = None
                if self.block_hash[block] is None:
                    self._free.move_to_end(block, last=False)

    def publish(self, block: int, block_hash: bytes, tokens) -> int:
        """Enter ``block`` into the prefix index under ``block_hash``.

        Returns the canonical block for that content: ``block`` itself if it
        was published now or already, or the existing **twin** that holds the
        same hash and tokens (then ``block`` stays private; the caller decides
        whether to swap). If the hash is held by a block with *different*
        tokens (a collision), nothing is published and ``block`` is returned.
        """
        if block == NULL_BLOCK:
            raise ValueError("BlockPool.publish: block 0 is the null block")
        if self.block_hash[block] is not None:
            return block
        twin = self.hash_to_block.get(block_hash)
        toks = np.array(tokens, dtype=np.int32)
        if twin is not None:
            stored = self.block_tokens[twin]
            if stored is not None and np.array_equal(stored, toks):
                return twin
            return block
        self.block_hash[block] = bytes(block_hash)
        self.block_tokens[block] = toks
        self.hash_to_block[bytes(block_hash)] = block
        return block

    def reset_prefix_cache(self) -> list[int]:
        """Unpublish every published block with ref count 0; returns them.

        Referenced (live or pinned) blocks stay published. The free order is
        unchanged.
        """
        dropped = [b for b in self._free if self.block_hash[b] is not None]
        for b in dropped:
            self._unpublish(b)
        return dropped

    def _unpublish(self, block: int) -> None:
        h = self.block_hash[block]
        if h is None:
            return
        if self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]
        self.block_hash[block] = None
        self.block_tokens[block] = None
        if self.on_evict is not None:
            self.on_evict(h)

    # ------------------------------------------------------------------ invariants

    def check_invariants(self, table_refs: dict[int, int] | None = None) -> None:
        """Raise ``AssertionError`` if the pool is inconsistent.

        Parameters
        ----------
        table_refs : dict of block -> count, optional
            References the owner's tables (and pins) hold; when given, every
            ref count must equal it.
        """
        p = "check_invariants"
        assert self.ref_count[NULL_BLOCK] == 0, f"{p}: null block ref_count={self.ref_count[0]}"
        assert NULL_BLOCK not in self._free, f"{p}: null block is on the free list"
        assert self.block_hash[NULL_BLOCK] is None, f"{p}: null block is published"
        for b in range(1, self.num_blocks):
            rc = self.ref_count[b]
            assert rc >= 0, f"{p}: block {b} ref_count={rc} < 0"
            assert (rc == 0) == (b in self._free), f"{p}: block {b} ref_count={rc} but free={b in self._free}"
            if table_refs is not None:
                want = table_refs.get(b, 0)
                assert rc == want, f"{p}: block {b} ref_count={rc} but {want} table entries"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"{p}: index maps {h.hex()[:12]} to block {b} holding another hash"
            assert self.block_tokens[b] is not None, f"{p}: published block {b} has no tokens"
        published = sum(1 for h in self.block_hash if h is not None)
        assert published == len(self.hash_to_block), (
            f"{p}: {published} blocks carry a hash but the index holds {len(self.hash_to_block)}"
        )
        if table_refs is not None:
            for b in table_refs:
                assert b != NULL_BLOCK, f"{p}: a table references block 0 as live"
