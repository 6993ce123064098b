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

Retention (spec/manager.md §14): a published block may hold a claim
``(priority, expiry)`` (``set_retention``). A freed published block goes to
the back of **level** ``priority`` (35 without a claim); the free order is the
unpublished front, then levels 0, 1, .., 100, least recently freed first in
each. A claim whose expiry passed is dropped when its block is freed, and,
for free blocks, when the eviction front is read (``allocate``, ``peek``,
``free_order``): expired blocks move, in expiry order, to the back of level
35 (an expiry min-heap; stale entries are skipped).

It satisfies ``kvspec.engine.BlockPool`` (the batch methods are plain loops
over the per-block ones). Every operation is O(1) per block: the free list is an ordered dict used as
an intrusive doubly linked list (``move_to_end(last=False)`` pushes to the
front, ``popitem(last=False)`` pops it, ``del`` unlinks from the middle when a
prefix hit revives a free block): ``_free`` holds the front (unpublished
blocks), ``_levels[p]`` level ``p``.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Callable, Iterable

import numpy as np

from kvspec import retention as _ret
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
    clock : callable() -> float, optional
        Seconds for retention expiries (``time.monotonic`` by default); read
        only while some claim has a finite expiry. Assignable (``pool.clock``).
    """

    def __init__(self, num_blocks: int, on_evict: Callable[[bytes], None] | None = None, *,
                 clock: Callable[[], float] | None = None):
        if num_blocks < 2:
            raise ValueError(f"BlockPool: num_blocks={num_blocks}, must be >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.on_evict = on_evict
        self.clock = _ret.check_clock("BlockPool", clock)
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
        #: free blocks of each retention level (published, or unpublished by reset_prefix_cache), LRU first
        self._levels: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(_ret.NUM_LEVELS)]
        #: level of a block on a level list, else -1 (in use, or on the front list ``_free``)
        self._lvl = [-1] * n
        #: retention claim per block: priority (NO_CLAIM = none) and expiry (NEVER = none)
        self.priority = [_ret.NO_CLAIM] * n
        self.expiry = [_ret.NEVER] * n
        #: free blocks with a finite expiry: (expiry, seq, block); an entry is live while _heap_seq[block] == seq
        self._heap: list[tuple[float, int, int]] = []
        self._heap_seq = [-1] * n
        self._seq = 0
        #: every level below this one is empty; blocks on level lists
        self._lo = _ret.NUM_LEVELS
        self._n_levels = 0
        #: blocks taken out of circulation by ``revoke`` (a slab leaf's pages in huge blocks it does not hold)
        self._off: set[int] = set()

    def snapshot(self):
        """An opaque copy of the whole state (for atomic rollback and tests)."""
        return (
            list(self.ref_count),
            list(self.block_hash),
            list(self.block_tokens),
            dict(self.hash_to_block),
            list(self._free),
            [list(lv) for lv in self._levels],
            (list(self.priority), list(self.expiry), list(self._heap), list(self._heap_seq), self._seq),
        )

    def restore(self, snap) -> None:
        """Return to a state taken with ``snapshot``."""
        rc, bh, bt, idx, free, levels, ret = snap
        self.ref_count, self.block_hash, self.block_tokens = list(rc), list(bh), list(bt)
        self.hash_to_block = dict(idx)
        self._free = OrderedDict((b, None) for b in free)
        self._levels = [OrderedDict((b, None) for b in lv) for lv in levels]
        self._lvl = [-1] * self.num_blocks
        for p, lv in enumerate(self._levels):
            for b in lv:
                self._lvl[b] = p
        self._lo = next((p for p, lv in enumerate(self._levels) if lv), _ret.NUM_LEVELS)
        self._n_levels = sum(map(len, self._levels))
        pr, ex, heap, hseq, seq = ret
        self.priority, self.expiry, self._heap, self._heap_seq, self._seq = (
            list(pr), list(ex), list(heap), list(hseq), seq)

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        """Blocks that ``allocate`` can hand out (free and evictable published)."""
        return len(self._free) + self._n_levels

    @property
    def num_usable(self) -> int:
        """Blocks excluding the null block."""
        return self.num_blocks - 1

    def free_order(self) -> list[int]:
        """The free list front to back (the order ``allocate`` pops); for tests.

        Reads the eviction front: expired claims are dropped first (spec/manager.md §14.5).
        """
        self._expire()
        out = list(self._free)
        for lv in self._levels[self._lo :]:
            out.extend(lv)
        return out

    def is_free(self, block: int) -> bool:
        """True when ``block`` is on the free list (free, or published with no reference)."""
        return block in self._free or self._lvl[block] >= 0

    def is_published(self, block: int) -> bool:
        """True when ``block`` is in the prefix index (it has a hash)."""
        return self.block_hash[block] is not None

    def lookup(self, block_hash: bytes, tokens) -> int | None:
        """The published block holding ``block_hash`` **and** exactly ``tokens``, else None.

        spec/hashing.md §4: a hash is a key, never a proof; the stored tokens must match.
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

    def last_indexed(self, hashes, stop: int) -> int:
        """The largest ``i < stop`` with ``hashes[i]`` in the index (tokens not checked), else -1."""
        for i in range(stop - 1, -1, -1):
            if hashes[i] in self.hash_to_block:
                return i
        return -1

    # ------------------------------------------------------------------ mutations

    def allocate(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the front of the free list, each with ref count 1.

        A popped published block is evicted: unpublished and reported to
        ``on_evict``. Raises ``CapacityError`` (state unchanged) when fewer
        than ``n`` blocks are free.
        """
        free = self.num_free
        if n > free:
            raise CapacityError(f"BlockPool.allocate: needs {n} blocks, {free} free or evictable")
        self._expire()
        out = []
        for _ in range(n):
            block = self._pop_front()
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
        return sum(1 for b in blocks if self.is_free(b))

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
        self._expire()
        out: list[int] = []
        for lv in [self._free] + self._levels[self._lo :]:
            for b in lv:
                if len(out) >= n:
                    return out
                if b not in skip:
                    out.append(b)
        return out

    def unpublished_run(self, n: int) -> int:
        """How many of the first ``n`` blocks ``allocate`` would pop are unpublished before the first
        published one (a slab leaf pops that run without a claim decision, spec/manager.md §13.2);
        reads the eviction front as :meth:`peek` does."""
        run = 0
        for b in self.peek(n):
            if self.block_hash[b] is not None:
                break
            run += 1
        return run

    def touch(self, block: int) -> None:
        """Take one more reference; a free (published) block leaves the free list."""
        if block == NULL_BLOCK:
            raise ValueError("BlockPool.touch: block 0 is the null block")
        if self.ref_count[block] == 0:
            self._unlink(block)
        self.ref_count[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block, in the order given.

        A block reaching 0 goes to the front of the free list if unpublished,
        to the back if published. The null block is skipped.
        """
        blocks = list(blocks)
        # spec/manager.md §14.7: the clock is read (and its reading checked) before any change,
        # once, when some block given holds a claim that may expire
        now = self.clock() if any(b != NULL_BLOCK and self.expiry[b] != _ret.NEVER for b in blocks) else None
        for block in blocks:
            if block == NULL_BLOCK:
                continue
            if self.ref_count[block] <= 0:
                raise AssertionError(f"BlockPool.free: block {block} ref_count={self.ref_count[block]}")
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                if self.block_hash[block] is None:
                    self._free[block] = None
                    self._free.move_to_end(block, last=False)
                    continue
                if self.expiry[block] != _ret.NEVER:  # spec/manager.md §14.5: checked when freed
                    if self.expiry[block] <= now:
                        self._drop_claim(block)
                self._append(block)

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

    def grant(self, blocks) -> None:
        """Put ``blocks`` (out of circulation: revoked, ref count 0, unpublished) back on the free list,
        at the **front**, in the order given (``blocks[0]`` is popped first): a slab leaf's pages of a
        huge block it claimed (spec/manager.md §13.2)."""
        for b in reversed(list(blocks)):
            self._off.remove(b)
            self._free[b] = None
            self._free.move_to_end(b, last=False)

    def revoke(self, blocks) -> None:
        """Take free ``blocks`` (ref count 0) out of circulation: off the free list and, if published,
        out of the prefix index (evicted, reported to ``on_evict``). They stay off until ``grant``."""
        for b in blocks:
            self._unlink(b)
            self._unpublish(b)
            self._off.add(b)

    def reset_prefix_cache(self) -> list[int]:
        """Unpublish every published block with ref count 0; returns them.

        Referenced (live or pinned) blocks stay published. The free order is
        unchanged.
        """
        dropped = [b for lv in [self._free] + self._levels for b in lv if self.block_hash[b] is not None]
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
        self._drop_claim(block)
        if self.on_evict is not None:
            self.on_evict(h)

    # ------------------------------------------------------------------ retention (spec/manager.md §14)

    def retain_free(self, blocks: Iterable[int], priority: int, expiry: float) -> None:
        """:meth:`set_retention` of ``(priority, expiry)`` on ``blocks``, then :meth:`free` of them
        (a request's claim on the pages it lets go, then its references: spec/manager.md §14.2, §6)."""
        blocks = list(blocks)
        self.set_retention(blocks, priority, expiry)
        self.free(blocks)

    def set_retention(self, blocks: Iterable[int], priority: int, expiry: float) -> None:
        """Merge the claim ``(priority, expiry)`` into each **published** block of ``blocks``.

        Parameters
        ----------
        blocks : iterable of int
            Pages (the null block and unpublished pages are skipped).
        priority : int
            ``0 .. 100``.
        expiry : float
            Absolute time on ``clock`` (``math.inf``: none).

        Notes
        -----
        The merge is ``kvspec.retention.merge``: no claim or an expired one is
        replaced, else the higher priority wins, and at equal priority the later
        expiry. A block that is free moves to the back of its (new) level, as if
        freed now. ``TypeError`` / ``ValueError`` before any change on a bad
        ``priority`` or ``expiry``.
        """
        priority = _ret.check_priority("BlockPool.set_retention", priority, "priority")
        expiry = _ret.check_expiry("BlockPool.set_retention", expiry)
        blocks = list(blocks)
        for b in blocks:
            if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 0 <= b < self.num_blocks:
                raise IndexError(f"BlockPool.set_retention: block {b!r} out of range 0..{self.num_blocks - 1}")
        # spec/manager.md §14.7: one clock reading, checked before any change, when a claim held may expire
        timed = any(b != NULL_BLOCK and self.block_hash[b] is not None and self.expiry[b] != _ret.NEVER for b in blocks)
        now = self.clock() if timed else -math.inf
        for b in blocks:
            if b == NULL_BLOCK or self.block_hash[b] is None:
                continue
            self.priority[b], self.expiry[b] = _ret.merge(self.priority[b], self.expiry[b], priority, expiry, now)
            if self.ref_count[b] == 0 and b not in self._off:
                self._unlink(b)
                self._append(b)

    def retention(self, block: int) -> tuple[int, float]:
        """The claim of ``block``: ``(priority, expiry)``, ``(-1, inf)`` without one."""
        return self.priority[block], self.expiry[block]

    def _drop_claim(self, block: int) -> None:
        self.priority[block] = _ret.NO_CLAIM
        self.expiry[block] = _ret.NEVER
        self._heap_seq[block] = -1

    def _append(self, block: int) -> None:
        """Put free ``block`` at the back of its level; a finite expiry enters the heap."""
        p = _ret.level_of(self.priority[block])
        self._levels[p][block] = None
        self._lvl[block] = p
        self._n_levels += 1
        self._lo = min(self._lo, p)
        if self.expiry[block] != _ret.NEVER:
            self._seq += 1
            self._heap_seq[block] = self._seq
            heapq.heappush(self._heap, (self.expiry[block], self._seq, block))
            if len(self._heap) > 2 * self.num_blocks + 64:  # stale entries of revived blocks: amortised O(1)
                self._heap = [x for x in self._heap if self._heap_seq[x[2]] == x[1]]
                heapq.heapify(self._heap)

    def _unlink(self, block: int) -> None:
        """Take free ``block`` off whichever list holds it."""
        p = self._lvl[block]
        if p < 0:
            del self._free[block]
        else:
            del self._levels[p][block]
            self._lvl[block] = -1
            self._n_levels -= 1
        self._heap_seq[block] = -1

    def _pop_front(self) -> int:
        """Unlink and return the block ``allocate`` pops next (the caller checked one is free)."""
        if self._free:
            return self._free.popitem(last=False)[0]
        while not self._levels[self._lo]:
            self._lo += 1
        block = self._levels[self._lo].popitem(last=False)[0]
        self._lvl[block] = -1
        self._n_levels -= 1
        self._heap_seq[block] = -1
        return block

    def _expire(self) -> None:
        """spec/manager.md §14.5: free blocks whose claim expired move, in expiry order, to level 35."""
        heap = self._heap
        if not heap:
            return
        now = self.clock()
        while heap and heap[0][0] <= now:
            _, seq, b = heapq.heappop(heap)
            if self._heap_seq[b] != seq:
                continue  # stale: the block was taken, evicted or freed again since
            self._unlink(b)
            self._drop_claim(b)
            self._append(b)

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
        assert self._lvl[NULL_BLOCK] < 0, f"{p}: null block is on a level list"
        assert self._n_levels == sum(map(len, self._levels)), f"{p}: level count {self._n_levels} is stale"
        for lv_idx, lv in enumerate(self._levels):
            assert lv_idx >= self._lo or not lv, f"{p}: level {lv_idx} is not empty but below the hint {self._lo}"
            for b in lv:
                assert self._lvl[b] == lv_idx and b not in self._free, f"{p}: block {b} is on two free lists"
        for b in range(self.num_blocks):
            if self.block_hash[b] is None:
                assert self.priority[b] == _ret.NO_CLAIM, f"{p}: unpublished block {b} holds a retention claim"
        assert self.block_hash[NULL_BLOCK] is None, f"{p}: null block is published"
        for b in range(1, self.num_blocks):
            rc = self.ref_count[b]
            assert rc >= 0, f"{p}: block {b} ref_count={rc} < 0"
            if b in self._off:  # revoked (spec/manager.md §13.2): out of circulation, unreferenced, unpublished
                assert rc == 0 and self.block_hash[b] is None, f"{p}: revoked block {b} ref_count={rc} or published"
                continue
            assert (rc == 0) == self.is_free(b), f"{p}: block {b} ref_count={rc} but free={self.is_free(b)}"
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


