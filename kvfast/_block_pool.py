"""The fast block pool: free list, reference counts and the prefix index (DESIGN §4.2).

A drop-in for :class:`kvref.BlockPool` (same methods, attributes,
allocation order and errors) with O(1) work per block and no Python object
per block on the list:

* the free list is intrusive, two int32 arrays ``prev`` / ``next`` with
  sentinel ids past the last block (``HEAD = num_blocks``, one sentinel per
  retention level, ``TAIL``); batch operations (``allocate``, ``free``,
  ``set_retention``) run as Numba kernels (:mod:`kvfast._numba.freelist`);
* ``ref_count`` is an int32 array;
* the prefix index is a dict ``hash -> block``; the tokens of every
  published block sit in one int32 table ``[num_blocks, width]`` (no Python
  object per block: publishing, verifying a run of hits and evicting are
  array operations).

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
``(priority, expiry)`` (int8 ``priority``, float64 ``expiry`` arrays); freed,
it goes to the back of its level (one segment of the chain per priority
0 .. 100, 35 without a claim); levels are popped lowest first after the
unpublished front. Expired claims are dropped when freed and, through an
expiry min-heap, when the eviction front is read. Identical to
``kvref.BlockPool`` call for call.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from itertools import compress, repeat, takewhile
from typing import Callable, Iterable

import numpy as np

from kvspec import retention as _ret
from kvspec._interop import int64_from_ints
from kvspec.errors import CapacityError

from ._numba import freelist as _fl

__all__ = ["BlockPool", "NULL_BLOCK"]

#: The null block: padding target of every table, never allocated.
NULL_BLOCK = 0

#: Up to this many blocks, ``free`` and ``touch_many`` loop in Python (cheaper than a kernel call).
_SMALL = 4
#: From this many ids a list is packed (``int64_from_ints``: about 6 ns an id) rather than iterated
#: (``np.fromiter``: about 20 ns an id, less to start).
_PACK_FROM = 32
#: ``publish``: int32 tokens are read in place (``dtype is`` holds for NumPy's builtin dtypes)
_INT32 = np.dtype(np.int32)

#: Runs an iterator of side effects (``map`` of a setter) to the end at C speed.
_consume = deque(maxlen=0).extend


def _rows(data, n: int) -> np.ndarray:
    """Tokens of ``n`` equal blocks as int32 ``[n, w]``: from int32 little-endian bytes or an integer
    array (an int32 one in place), so the verifications compare int32 runs (``BlockPool._holds``)."""
    if isinstance(data, np.ndarray):
        return data.reshape(n, -1).astype(np.int32, copy=False)
    w = len(data) // (4 * n)
    return np.frombuffer(data, "<i4", n * w).reshape(n, w)


class _TokenView:
    """``block_tokens[b]``: the int32 tokens of published block ``b`` (a read-only
    copy of its row of the pool's token table) or None; built on read."""

    __slots__ = ("_pool",)

    def __init__(self, pool: "BlockPool"):
        self._pool = pool

    def __getitem__(self, block):
        p = self._pool
        if not p._published[block]:
            return None
        t = p._tok[block, : p._tok_len[block]].copy()
        t.flags.writeable = False
        return t

    def __len__(self) -> int:
        return self._pool.num_blocks

    def __iter__(self):
        return (self[b] for b in range(self._pool.num_blocks))


class _MemoryViews:
    """Memoryviews of some of an object's NumPy arrays, for the paths that read and write them one
    element at a time: an item of a memoryview is a Python int (or float) in about half the time of
    a NumPy scalar index. ``_VIEWS`` names the ``(view, array)`` attribute pairs; the views share the
    arrays' memory, and whoever assigns one of those arrays calls :meth:`_views` again. A pickle or
    a deep copy carries the arrays, not the views (which cannot be pickled), and rebuilds them."""

    _VIEWS: tuple[tuple[str, str], ...] = ()

    def _views(self) -> None:
        for view, array in self._VIEWS:
            setattr(self, view, memoryview(getattr(self, array)))

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for view, _ in self._VIEWS:
            del state[view]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._views()


class BlockPool(_MemoryViews):
    """Ids ``0 .. num_blocks-1`` with ref counts, an intrusive free list and a prefix index.

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

    Attributes
    ----------
    ref_count : int32 [num_blocks]
        References per block (0 = on the free list, except block 0).
    block_hash : list of bytes or None
        Hash of each published block.
    block_tokens : sequence of int32 [block_size] or None
        Token ids of each published block (read-only views, built on read).
    hash_to_block : dict of bytes to int
        The prefix index.
    priority : int8 [num_blocks]
        Retention priority of each published block's claim (-1: none).
    expiry : float64 [num_blocks]
        Expiry of each claim on ``clock`` (inf: none).
    """

    def __init__(self, num_blocks: int, on_evict: Callable[[bytes], None] | None = None, *,
                 clock: Callable[[], float] | None = None):
        if num_blocks < 2:
            raise ValueError(f"BlockPool: num_blocks={num_blocks}, must be >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.on_evict = on_evict
        self.clock = _ret.check_clock("BlockPool", clock)
        self._head = num_blocks
        self._tail = _fl.list_size(num_blocks) - 1
        _fl.warm()
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Every block free in ascending order, nothing published."""
        n = self.num_blocks
        self.ref_count = np.zeros(n, np.int32)
        self.block_hash: list[bytes | None] = [None] * n
        self.hash_to_block: dict[bytes, int] = {}
        #: tokens of published block b: _tok[b, :_tok_len[b]] (rows of other blocks are stale)
        self._tok = np.zeros((n, 0), np.int32)
        self._tok_len = np.zeros(n, np.int32)
        self.block_tokens = _TokenView(self)
        self._published = np.zeros(n, np.bool_)
        self._prev = np.empty(_fl.list_size(n), np.int32)
        self._next = np.empty(_fl.list_size(n), np.int32)
        _fl.init_list(self._prev, self._next, n)
        self._num_free = n - 1
        self.priority = np.full(n, _ret.NO_CLAIM, np.int8)
        self.expiry = np.full(n, _ret.NEVER, np.float64)
        #: every level below this one is empty
        self._lo = _ret.NUM_LEVELS
        #: free blocks with a finite expiry: (expiry, seq, int32 blocks), a block live while _heap_seq[block] == seq
        self._heap: list[tuple[float, int, int]] = []
        self._heap_seq = np.full(n, -1, np.int64)
        self._seq = 0
        #: whether some claim has a finite expiry (else the clock is never read)
        self._ttl = False
        #: blocks taken out of circulation by ``revoke`` (a slab leaf's pages in huge blocks it does not hold)
        self._off = np.zeros(n, np.bool_)
        self._views()

    #: the memoryviews the one-block paths (``allocate_one``, ``touch``, ``free`` and ``retain_free`` of
    #: one page, ``_publish``) read and write element by element
    _VIEWS = (("_nx", "_next"), ("_pv", "_prev"), ("_rc", "ref_count"), ("_pub", "_published"),
              ("_tl", "_tok_len"), ("_pr", "priority"), ("_ex", "expiry"))

    def snapshot(self):
        """An opaque copy of the whole state (for atomic rollback and tests)."""
        return (
            self.ref_count.copy(), list(self.block_hash), dict(self.hash_to_block),
            (self._tok.copy(), self._tok_len.copy()), self._published.copy(), self._prev.copy(), self._next.copy(),
            self._num_free,
            (self.priority.copy(), self.expiry.copy(), self._lo, list(self._heap), self._heap_seq.copy(), self._seq,
             self._ttl),
        )

    def restore(self, snap) -> None:
        """Return to a state taken with ``snapshot``."""
        rc, bh, idx, tb, pub, prev, nxt, nfree, ret = snap
        pr, ex, self._lo, heap, hseq, self._seq, self._ttl = ret
        self.priority, self.expiry, self._heap, self._heap_seq = pr.copy(), ex.copy(), list(heap), hseq.copy()
        self.ref_count = rc.copy()
        self.block_hash = list(bh)
        self._tok, self._tok_len = tb[0].copy(), tb[1].copy()
        self.hash_to_block = dict(idx)
        self._published, self._prev, self._next = pub.copy(), prev.copy(), nxt.copy()
        self._num_free = nfree
        self._views()

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        """Blocks that ``allocate`` can hand out (free and evictable published)."""
        return self._num_free

    @property
    def num_usable(self) -> int:
        """Blocks excluding the null block."""
        return self.num_blocks - 1

    def free_order_array(self) -> np.ndarray:
        """The free list front to back as int32 ``[num_free]`` (expired claims dropped first)."""
        if self._heap:
            self._expire()
        out = np.empty(self._num_free, np.int32)
        _fl.walk(self._next, self._head, self._tail, out)
        return out

    def free_order(self) -> list[int]:
        """The free list front to back (the order ``allocate`` pops); for tests."""
        return self.free_order_array().tolist()

    def is_free(self, block: int) -> bool:
        """True when ``block`` is on the free list (free, or published with no reference)."""
        return (block != NULL_BLOCK and 0 <= block < self.num_blocks and self.ref_count[block] == 0
                and not self._off[block])

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
        toks = np.asarray(tokens, dtype=np.int32)
        if toks.ndim != 1 or not self._holds(block, toks):
            return None
        return block

    def _holds(self, block: int, toks: np.ndarray) -> bool:
        """Whether published ``block`` stores exactly the 1-D int32 ``toks``: one compare of their
        bytes (equal int32 runs of one length have equal bytes; about 0.3 us against 2.3 us for
        ``np.array_equal`` on a 16-token page)."""
        n = toks.shape[0]
        return self._tl[block] == n and self._tok[block, :n].tobytes() == toks.tobytes()

    def _store(self, blocks: np.ndarray, toks: np.ndarray) -> None:
        """Write ``toks`` (int32 [len(blocks), w]) as the tokens of ``blocks``; widens the table if needed."""
        w = toks.shape[1]
        if w > self._tok.shape[1]:
            grown = np.zeros((self.num_blocks, w), np.int32)
            grown[:, : self._tok.shape[1]] = self._tok
            self._tok = grown
        self._tok[blocks, :w] = toks
        self._tok_len[blocks] = w

    def contains_hash(self, block_hash: bytes) -> bool:
        """True when a published block holds ``block_hash`` (its tokens not checked)."""
        return block_hash in self.hash_to_block

    def last_indexed(self, hashes: list[bytes], stop: int) -> int:
        """The largest ``i < stop`` with ``hashes[i]`` in the index (tokens not checked), else -1:
        the probes run at C level, back from ``stop`` (about 30 ns each)."""
        hit = next(compress(range(stop - 1, -1, -1), map(self.hash_to_block.__contains__,
                                                          reversed(hashes[:stop]))), None)
        return -1 if hit is None else hit

    # ------------------------------------------------------------------ mutations

    def allocate_array(self, n: int) -> np.ndarray:
        """:meth:`allocate` returning int32 ``[n]``."""
        out, evicted = self._draw_args(n)
        if n:
            k, self._lo = _fl.pop_front_evict(self._prev, self._next, self.ref_count, self._published,
                                              self.priority, self.expiry, self._head, self._lo, n, out, evicted)
            self._draw_done(n, evicted, k)
        return out

    def _draw_args(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`allocate_array`'s check (``CapacityError``, nothing changed) and expiries, then its
        kernel pass's ``(out, evicted)`` scratch, int32 ``[n]`` each. ``kvfast.FastSlabTable.allocate_pages``
        runs the same pass fused with its own."""
        if n > self._num_free:
            raise CapacityError(f"BlockPool.allocate: needs {n} blocks, {self._num_free} free or evictable")
        if n and self._heap:
            self._expire()
        return np.empty(n, np.int32), np.empty(n, np.int32)

    def _draw_done(self, n: int, evicted: np.ndarray, k: int) -> None:
        """The pool's bookkeeping after a draw's kernel pass popped ``n`` blocks, ``evicted[:k]`` of
        them published: their index entries dropped, ``on_evict`` told."""
        self._num_free -= n
        if k:
            ev = evicted[:k].tolist()
            bh, idx, cb = self.block_hash, self.hash_to_block, self.on_evict
            hs = list(map(bh.__getitem__, ev))
            # The index is a bijection onto the published blocks (check_invariants), so
            # every evicted block's hash maps to it: drop the entries, then the slots.
            _consume(map(idx.__delitem__, hs))
            _consume(map(bh.__setitem__, ev, repeat(None)))
            if cb is not None:
                for h in hs:
                    cb(h)

    def allocate_one(self) -> int:
        """:meth:`allocate` of one block, returned as an int (no kernel call: a decode step's page)."""
        if self._num_free < 1:
            raise CapacityError(f"BlockPool.allocate: needs 1 blocks, {self._num_free} free or evictable")
        if self._heap:
            self._expire()
        nxt, prv, head = self._nx, self._pv, self._head
        b = nxt[head]
        if b >= head:  # the front is empty: the first block of the lowest non-empty level
            lo = self._lo
            while nxt[head + 1 + lo] >= head:
                lo += 1
            self._lo = lo
            b = nxt[head + 1 + lo]
        p = prv[b]
        nn = nxt[b]
        nxt[p] = nn
        prv[nn] = p
        prv[b] = -1
        nxt[b] = -1
        self._rc[b] = 1
        self._num_free -= 1
        if self._pub[b]:  # evict, as allocate does
            self._pub[b] = False
            self._pr[b] = _ret.NO_CLAIM
            self._ex[b] = _ret.NEVER
            h = self.block_hash[b]
            del self.hash_to_block[h]
            self.block_hash[b] = None
            if self.on_evict is not None:
                self.on_evict(h)
        return b

    def allocate(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the front of the free list, each with ref count 1.

        A popped published block is evicted: unpublished and reported to
        ``on_evict``. Raises ``CapacityError`` (state unchanged) when fewer
        than ``n`` blocks are free.
        """
        return self.allocate_array(n).tolist()

    def peek(self, n: int, skip=()) -> list[int]:
        """The first ``n`` blocks ``allocate`` would pop once the blocks in ``skip`` left the free
        list (fewer when fewer are free); changes nothing (the manager plans before it commits)."""
        if self._heap:
            self._expire()
        out: list[int] = []
        nxt, tail, head = self._next, self._tail, self._head
        b = int(nxt[head])
        if b >= head:  # empty front: start at the lowest level that may hold a block
            b = head + 1 + min(self._lo, _ret.NUM_LEVELS - 1)
        while len(out) < n and b != tail:
            if b < head and b not in skip:
                out.append(b)
            b = int(nxt[b])
        return out

    def touch(self, block: int) -> None:
        """Take one more reference; a free (published) block leaves the free list."""
        if block == NULL_BLOCK:
            raise ValueError("BlockPool.touch: block 0 is the null block")
        rc = self._rc
        r = rc[block]
        if r == 0:  # unlink in Python: one block is cheaper than a kernel call
            prv, nxt = self._pv, self._nx
            p, n = prv[block], nxt[block]
            nxt[p] = n
            prv[n] = p
            prv[block] = nxt[block] = -1
            self._num_free -= 1
        rc[block] = r + 1

    def count_free(self, blocks) -> int:
        """How many of ``blocks`` (distinct) are on the free list (ref count 0)."""
        arr = np.asarray(blocks, dtype=np.int64)
        return int(np.count_nonzero((self.ref_count[arr] == 0) & ~self._off[arr])) if arr.size else 0

    def touch_many(self, blocks) -> int:
        """:meth:`touch` each of ``blocks`` (distinct, none null) in one call; returns
        how many left the free list."""
        if type(blocks) is list and len(blocks) <= _SMALL:
            revived = 0
            for b in blocks:  # a few blocks: no kernel call
                revived += self.ref_count[b] == 0
                self.touch(b)
            return int(revived)
        arr = _ids(blocks)
        if arr.size == 0:
            return 0
        revived = _fl.touch_many(self._prev, self._next, self.ref_count, arr)
        self._num_free -= revived
        return revived

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference from each block, in the order given.

        A block reaching 0 goes to the front of the free list if unpublished,
        to the back if published. The null block is skipped.
        """
        if type(blocks) is list and len(blocks) <= _SMALL:
            for b in blocks:  # a few blocks (a twin, an unpinned run, a slide): no kernel call
                self._free_one(b)
            return
        arr = np.asarray(blocks if isinstance(blocks, np.ndarray) else list(blocks), dtype=np.int64)
        if arr.size == 0:
            return
        ttl = self._ttl_out(arr.size)
        bad, freed, self._lo, k = _fl.free_many(self._prev, self._next, self.ref_count, self._published, self.priority,
                                                self.expiry, self._head, self._lo, self._now(), arr, ttl)
        self._num_free += freed
        if k:
            self._push(ttl[:k])
        if bad >= 0:
            b = int(arr[bad])
            raise AssertionError(f"BlockPool.free: block {b} ref_count={int(self.ref_count[b])}")

    def retain_free(self, blocks: np.ndarray, priority: int, expiry: float) -> None:
        """``set_retention(blocks, priority, expiry)`` then ``free(blocks)`` in one kernel pass (a
        request's release: its claim on its pages, then its references, spec/manager.md §14.2, §6).

        Parameters
        ----------
        blocks : int64 [n] or sequence of int
            Pages the caller references once each (a request's row, tail first).
        priority : int
            ``0 .. 100``.
        expiry : float
            Absolute time on ``clock`` (``math.inf``: none).

        Notes
        -----
        The same state as the two calls in sequence (a claim merged into a page the caller
        still references moves nothing). ``TypeError`` / ``ValueError`` / ``IndexError`` for
        bad arguments before any change.
        """
        run = self._retain_free_args(blocks, priority, expiry)
        if run is not None:
            blocks, priority, expiry, now, ttl = run
            self._retain_free_done(*run, *_fl.retain_free(self._prev, self._next, self.ref_count, self._published,
                                                          self.priority, self.expiry, self._head, self._lo, now,
                                                          blocks, priority, expiry, ttl))

    def _retain_free_args(self, blocks, priority: int, expiry: float) -> tuple | None:
        """:meth:`retain_free`'s checks, then ``(blocks as int64, priority, expiry, now, ttl scratch)``
        for its kernel pass; None when nothing is left for a kernel (no page, or one page, freed here
        in Python). ``kvfast.FastSlabTable.free_pages`` runs the same pass fused with its own."""
        priority = _ret.check_priority("BlockPool.retain_free", priority, "priority")
        expiry = _ret.check_expiry("BlockPool.set_retention", expiry)
        if type(blocks) is list and len(blocks) == 1 and type(blocks[0]) is int:
            self._retain_free_one(blocks[0], priority, expiry)  # a slide's or checkpoint's page
            return None
        blocks = _ids(blocks)
        if blocks.size == 0:
            return None
        timed = self._ttl or expiry != _ret.NEVER  # as set_retention: a finite claim starts the clock
        ttl = np.empty(blocks.size, np.int32) if timed else _EMPTY_I32
        now = float(self.clock()) if timed else -math.inf
        return blocks, priority, expiry, now, ttl

    def _retain_free_done(self, blocks, priority, expiry, now, ttl, bad: int, freed: int, lo: int, k: int) -> None:
        """The pool's bookkeeping after :meth:`retain_free`'s kernel pass returned ``(bad, freed, lo, k)``."""
        if bad <= -2:  # the kernel's range check, before any change
            b = int(blocks[-2 - bad])
            raise IndexError(f"BlockPool.retain_free: block {b} out of range 0..{self.num_blocks - 1}")
        self._lo = lo
        if expiry != _ret.NEVER:
            self._ttl = True
        self._num_free += freed
        if k:
            self._push(ttl[:k])
        if bad >= 0:
            b = int(blocks[bad])
            raise AssertionError(f"BlockPool.retain_free: block {b} ref_count={int(self.ref_count[b])}")

    def _retain_free_one(self, b: int, priority: int, expiry: float) -> None:
        """``retain_free([b], priority, expiry)`` in Python (no kernel call for one page): the same
        checks, merge and clock reading as the kernel pass."""
        if not 0 <= b < self.num_blocks:
            raise IndexError(f"BlockPool.retain_free: block {b} out of range 0..{self.num_blocks - 1}")
        if b == NULL_BLOCK:
            return
        r = self._rc[b]
        if r <= 0:
            raise AssertionError(f"BlockPool.retain_free: block {b} ref_count={r}")
        timed = self._ttl or expiry != _ret.NEVER  # as set_retention: a finite claim starts the clock
        now = float(self.clock()) if timed else -math.inf
        if self._pub[b]:
            p, e = _ret.merge(self._pr[b], self._ex[b], priority, expiry, now)
            self._pr[b] = p
            self._ex[b] = e
        if expiry != _ret.NEVER:
            self._ttl = True
        self._free_one(b, now)

    def _free_one(self, b: int, now: float | None = None) -> None:
        """``free([b])`` in Python, the free list's rule (front if unpublished, back if published);
        ``now``: the clock reading to expire a claim at (None: read it when a claim has an expiry)."""
        if b == NULL_BLOCK:
            return
        rc = self._rc
        r = rc[b]
        if r <= 0:
            raise AssertionError(f"BlockPool.free: block {b} ref_count={r}")
        if r > 1:
            rc[b] = r - 1
            return
        e = self._ex[b]
        if now is None and e != _ret.NEVER and self._pub[b]:
            now = self.clock()  # spec/manager.md §14.7: read (and checked) before the change
        rc[b] = r - 1
        prv, nxt = self._pv, self._nx
        if self._pub[b]:
            if e != _ret.NEVER and e <= now:  # spec/manager.md §14.5: when freed
                self._pr[b] = _ret.NO_CLAIM
                self._ex[b] = e = _ret.NEVER
            pr = self._pr[b]
            level = _ret.DEFAULT_PRIORITY if pr < 0 else pr
            t = self._head + 2 + level
            p = prv[t]
            nxt[p] = b
            prv[b] = p
            nxt[b] = t
            prv[t] = b
            if level < self._lo:
                self._lo = level
            if e != _ret.NEVER:
                self._push(np.array([b], np.int32))
        else:
            h = self._head
            n = nxt[h]
            nxt[h] = b
            prv[b] = h
            nxt[b] = n
            prv[n] = b
        self._num_free += 1

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
        if type(tokens) is not np.ndarray or tokens.dtype is not _INT32 or tokens.ndim != 1:
            tokens = np.asarray(tokens, dtype=np.int32).ravel()  # (_publish copies them into the table)
        return self._publish(block, block_hash if type(block_hash) is bytes else bytes(block_hash), tokens)

    def _publish(self, block: int, h: bytes, toks: np.ndarray) -> int:
        """Publish unpublished ``block`` under ``h`` with int32 ``toks``: itself, a twin, or
        ``block`` unpublished at a collision. One probe: ``block`` is unpublished, so no entry
        maps to it (the index is a bijection onto the published blocks) and ``setdefault``
        returning ``block`` means the entry is new."""
        twin = self.hash_to_block.setdefault(h, block)
        if twin != block:
            return twin if self._holds(twin, toks) else block
        self.block_hash[block] = h
        w = toks.shape[0]
        width = self._tok.shape[1]
        if w > width:
            self._store(np.array([block]), toks.reshape(1, w))
        else:
            if w == width:
                self._tok[block] = toks  # a whole row: no slice object (a page fill's common case)
            else:
                self._tok[block, :w] = toks
            self._tl[block] = w
        self._pub[block] = True
        return block

    def publish_run(self, blocks: list[int], hashes: list[bytes], data) -> list[int]:
        """:meth:`publish` for each ``blocks[j]`` under ``hashes[j]`` with
        tokens ``data[j*s:(j+1)*s]`` (``s = len(data) // len(blocks)``), in order,
        as one chain: it stops at the first **collision** (a hash held by other
        tokens; that block and every later one stay unpublished, so no page joins
        the index under a parent that is not there, spec/manager.md §5.1).
        ``data`` is int32 little-endian bytes or an int32 array ``[n_tokens]``.

        Returns the canonical block of each block before the stop (itself, or an
        existing twin): ``len(result) < len(blocks)`` means block
        ``len(result)`` collided.
        """
        n = len(blocks)
        if n == 0:
            return []
        if n == 1:  # a decode step's block: no batch machinery
            b = blocks[0]
            if self.block_hash[b] is not None:
                return [b]
            c = self._publish(b, hashes[0], _rows(data, 1)[0])
            return [] if c == b and self.block_hash[b] is None else [c]
        toks = _rows(data, n)
        w = toks.shape[1]
        bh, idx = self.block_hash, self.hash_to_block
        if hashes[0] not in idx:
            # Common case (a prefill's or decode's fresh blocks): no twin, no collision, no block
            # published yet, no repeated block or hash; then this is exactly the loop at the end.
            # Tried first, checked as it goes (one probe per hash: ``setdefault`` inserts or finds)
            # and undone if it is not that case.
            arr = _ids(blocks)
            if w > self._tok.shape[1]:
                self._store(arr[:0], toks[:0])  # widen the table
            if _fl.publish_rows(self._tok, self._tok_len, self._published, arr, toks):
                before = len(idx)
                got = list(map(idx.setdefault, hashes, blocks))
                if len(idx) - before == n:
                    _consume(map(bh.__setitem__, blocks, hashes))
                    return list(blocks)
                # A hash was indexed (a twin or a collision) or repeated: undo. None of ``blocks``
                # was published, so an entry that maps a hash to its own block is one inserted here.
                for h, c, b in zip(hashes, got, blocks):
                    if c == b and idx.get(h) == b:
                        del idx[h]
                self._published[arr] = False
        got = list(map(idx.get, hashes))
        fresh = got.count(None)
        t = n - fresh
        if 0 < t and (fresh == 0 or got.index(None) == t) and w <= self._tok.shape[1] \
                and list(map(bh.__getitem__, blocks[:t])).count(None) == t:
            # A leading run of twins (a prefix another request of the wave published first),
            # then fresh blocks only, none of ours published: the loop below would switch each
            # twin whose stored tokens match (one kernel call verifies them all) and stop at
            # the first that does not (a collision); the fresh tail is the common case.
            canon = got[:t]
            ok = _fl.verify_run(self._tok, self._tok_len, _ids(canon), toks[:t])
            if ok < t:
                return canon[:ok]
            return canon + (self.publish_run(blocks[t:], hashes[t:], toks[t:].reshape(-1)) if fresh else [])
        out = []
        for j in range(n):
            b = blocks[j]
            if bh[b] is None:
                c = self._publish(b, hashes[j], toks[j])
                if c == b and bh[b] is None:
                    break  # a collision: the chain stops here
                b = c
            out.append(b)
        return out

    def lookup_run(self, hashes: list[bytes], token_bytes) -> list[int]:
        """The longest leading run of :meth:`lookup` hits over ``hashes``.

        ``token_bytes`` holds the run's tokens, the same number per block:
        int32 little-endian bytes, or an int32 array ``[n_tokens]`` (no
        copy). Returns the hit blocks in order; the
        run stops at the first hash not in the index **or** whose stored
        tokens differ (spec/hashing.md §4), as a loop over ``lookup`` would.
        """
        n = len(hashes)
        if n == 0:
            return []
        # The probes stop at the first miss, at C speed: a hit is a block id >= 1 (block 0, the null
        # block, is never published), a miss None.
        blocks = list(takewhile(bool, map(self.hash_to_block.get, hashes)))
        k = len(blocks)
        if k:
            # spec/hashing.md §4: verify the stored tokens of the whole run in one kernel call.
            toks = _rows(token_bytes, n)[:k]
            w = toks.shape[1]
            if self._tok.shape[1] < w:
                ok = 0
            else:
                ok = _fl.verify_run(self._tok, self._tok_len, _ids(blocks), toks)
            del blocks[ok:]
        return blocks

    def grant(self, blocks) -> None:
        """Put ``blocks`` (revoked, ref count 0, unpublished) back on the free list at the **front**,
        in the order given (``blocks[0]`` is popped first); spec/manager.md §13.2. One kernel pass
        (``blocks``: a sequence of ints, a ``range`` or an int array)."""
        if not hasattr(blocks, "__len__"):
            blocks = list(blocks)
        if len(blocks) <= _SMALL:  # a huge block of a few pages: no kernel call
            prv, nxt, head = self._prev, self._next, self._head
            for b in reversed(blocks):
                self._off[b] = False
                n = nxt[head]
                nxt[head] = b
                prv[b] = head
                nxt[b] = n
                prv[n] = b
            self._num_free += len(blocks)
            return
        arr = _ids(blocks)
        self._off[arr] = False
        _fl.push_front_many(self._prev, self._next, self._head, arr)
        self._num_free += arr.size

    def revoke(self, blocks) -> None:
        """Take free ``blocks`` (ref count 0) out of circulation: off the free list and, if published,
        out of the prefix index (evicted, reported to ``on_evict`` in the order given). They stay off
        until ``grant``. One kernel pass; Python only for the published ones."""
        if not hasattr(blocks, "__len__"):
            blocks = list(blocks)
        if len(blocks) <= _SMALL:  # a huge block of a few pages: no kernel call
            for b in blocks:
                self._unlink(b)
                self._unpublish(b)
                self._off[b] = True
            self._num_free -= len(blocks)
            return
        arr = _ids(blocks)
        _fl.unlink_many(self._prev, self._next, arr)
        for b in arr[self._published[arr]].tolist():
            self._unpublish(b)
        self._off[arr] = True
        self._num_free -= arr.size

    def unpublished_run(self, n: int) -> int:
        """How many of the first ``n`` blocks ``allocate`` would pop are unpublished before the first
        published one (spec/manager.md §13.2); reads the eviction front as :meth:`peek` does."""
        if self._heap:
            self._expire()
        if n == 1:  # a decode step's claim decision: a block at the front is read without a kernel call
            b = self._nx[self._head]
            if b < self._head:
                return 0 if self._pub[b] else 1
        return int(_fl.unpublished_run(self._next, self._published, self._head, self._tail, self._lo, n))

    def _unlink(self, b: int) -> None:
        prv, nxt = self._prev, self._next
        p, n = prv[b], nxt[b]
        nxt[p] = n
        prv[n] = p
        prv[b] = nxt[b] = -1

    def reset_prefix_cache(self) -> list[int]:
        """Unpublish every published block with ref count 0; returns them.

        Referenced (live or pinned) blocks stay published. The free order is
        unchanged.
        """
        order = self.free_order_array()
        dropped = order[self._published[order]].tolist()
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
        self._published[block] = False
        self.priority[block] = _ret.NO_CLAIM
        self.expiry[block] = _ret.NEVER
        if self.on_evict is not None:
            self.on_evict(h)

    # ------------------------------------------------------------------ retention (spec/manager.md §14)

    def set_retention(self, blocks, priority: int, expiry: float) -> None:
        """Merge the claim ``(priority, expiry)`` into each **published** block of ``blocks``.

        Parameters
        ----------
        blocks : sequence of int
            Pages (the null block and unpublished pages are skipped).
        priority : int
            ``0 .. 100``.
        expiry : float
            Absolute time on ``clock`` (``math.inf``: none).

        Notes
        -----
        Same rule as ``kvref.BlockPool.set_retention`` (``kvspec.retention.merge``;
        a free block moves to the back of its new level). ``TypeError`` /
        ``ValueError`` / ``IndexError`` before any change.
        """
        priority = _ret.check_priority("BlockPool.set_retention", priority, "priority")
        expiry = _ret.check_expiry("BlockPool.set_retention", expiry)
        arr = _ids(blocks)
        if arr.size == 0:
            return
        if int(arr.min()) < 0 or int(arr.max()) >= self.num_blocks:
            bad = arr[(arr < 0) | (arr >= self.num_blocks)][0]
            raise IndexError(f"BlockPool.set_retention: block {int(bad)} out of range 0..{self.num_blocks - 1}")
        # spec/manager.md §14.7: the clock read (and checked) before the first change
        now = float(self.clock()) if self._ttl or expiry != _ret.NEVER else -math.inf
        if expiry != _ret.NEVER:
            self._ttl = True
        ttl = self._ttl_out(arr.size)
        self._lo, k = _fl.set_retention(self._prev, self._next, self.ref_count, self._published, self.priority,
                                        self.expiry, self._head, self._lo, arr, priority, expiry, now, ttl)
        if k:
            self._push(ttl[:k])

    def retention(self, block: int) -> tuple[int, float]:
        """The claim of ``block``: ``(priority, expiry)``, ``(-1, inf)`` without one."""
        return int(self.priority[block]), float(self.expiry[block])

    def _now(self) -> float:
        """The clock when some claim has a finite expiry, else -inf (nothing can expire; no clock read)."""
        return float(self.clock()) if self._ttl else -math.inf

    def _ttl_out(self, n: int) -> np.ndarray:
        return np.empty(n, np.int32) if self._ttl else _EMPTY_I32

    def _push(self, blocks: np.ndarray) -> None:
        """Enter free ``blocks`` (int32, each with a finite expiry, in the order freed) into the
        expiry heap: one entry per distinct expiry, ``(expiry, seq, blocks in order)`` (the
        reference's one entry per block, ties by the order freed, pops in the same order)."""
        exp = self.expiry[blocks]
        if exp.size == 1 or (exp == exp[0]).all():
            groups = [(float(exp[0]), blocks)]
        else:
            vals, first = np.unique(exp, return_index=True)
            groups = [(float(vals[i]), blocks[exp == vals[i]]) for i in np.argsort(first, kind="stable")]
        for e, group in groups:
            self._seq += 1
            self._heap_seq[group] = self._seq
            heapq.heappush(self._heap, (e, self._seq, group))
        if len(self._heap) > 2 * self.num_blocks + 64:  # stale entries of revived blocks: amortised O(1)
            hseq, kept = self._heap_seq, []
            for e, seq, group in self._heap:
                live = group[hseq[group] == seq]
                if live.size:
                    kept.append((e, seq, live))
            heapq.heapify(kept)
            self._heap = kept

    def _expire(self) -> None:
        """spec/manager.md §14.5: free blocks whose claim expired move, in expiry order, to level 35."""
        heap = self._heap
        now = float(self.clock())
        rc, pub, hseq, exp, prio = self.ref_count, self._published, self._heap_seq, self.expiry, self.priority
        prv, nxt, head = self._prev, self._next, self._head
        while heap and heap[0][0] <= now:
            e, seq, group = heapq.heappop(heap)
            for b in group.tolist():
                # live entry: the block is still free, published, holding this claim since this push
                if hseq[b] != seq or rc[b] != 0 or not pub[b] or exp[b] != e or prv[b] < 0:
                    continue
                hseq[b] = -1
                p, n = prv[b], nxt[b]
                nxt[p] = n
                prv[n] = p
                prio[b] = _ret.NO_CLAIM
                exp[b] = _ret.NEVER
                t = head + 2 + _ret.DEFAULT_PRIORITY
                p = prv[t]
                nxt[p] = b
                prv[b] = p
                nxt[b] = t
                prv[t] = b
                self._lo = min(self._lo, _ret.DEFAULT_PRIORITY)

    # ------------------------------------------------------------------ invariants

    def check_invariants(self, table_refs: dict[int, int] | None = None) -> None:
        """Raise ``AssertionError`` if the pool is inconsistent (vectorised checks).

        Parameters
        ----------
        table_refs : dict of block -> count, optional
            References the owner's tables (and pins) hold; when given, every
            ref count must equal it.
        """
        p = "check_invariants"
        n = self.num_blocks
        rc = self.ref_count
        assert rc[NULL_BLOCK] == 0, f"{p}: null block ref_count={rc[0]}"
        order = self.free_order_array()
        assert order.size == self._num_free, f"{p}: free list holds {order.size} blocks, counter says {self._num_free}"
        on_list = np.zeros(n, np.bool_)
        on_list[order] = True
        assert np.unique(order).size == order.size, f"{p}: a block is on the free list twice"
        assert not on_list[NULL_BLOCK], f"{p}: null block is on the free list"
        assert self.block_hash[NULL_BLOCK] is None, f"{p}: null block is published"
        neg = np.flatnonzero(rc < 0)
        assert neg.size == 0, f"{p}: block {neg[:1].tolist()} ref_count < 0"
        off = self._off  # revoked blocks (spec/manager.md §13.2): out of circulation, unreferenced, unpublished
        assert not (off & (on_list | (rc != 0) | self._published)).any(), f"{p}: a revoked block is in circulation"
        bad = np.flatnonzero(((rc[1:] == 0) & ~off[1:]) != on_list[1:])
        if bad.size:
            b = int(bad[0]) + 1
            assert False, f"{p}: block {b} ref_count={int(rc[b])} but free={bool(on_list[b])}"
        # links agree both ways; sentinels in order; every published free block in its claim's level
        nodes = np.empty(self._prev.size + 1, np.int32)
        k = _fl.walk_nodes(self._next, self._head, self._tail, nodes)
        nodes = nodes[:k]
        assert nodes[-1] == self._tail, f"{p}: the free list does not reach its tail"
        assert np.array_equal(self._prev[nodes[1:]], nodes[:-1]), f"{p}: prev links disagree with next links"
        sent = nodes[nodes >= self._head]
        assert np.array_equal(sent, np.arange(self._head, self._tail + 1)), f"{p}: sentinels out of order"
        level = np.cumsum(nodes >= self._head) - 2  # -1 on the front, p in level p
        blk = nodes < self._head
        lv, bl = level[blk], nodes[blk]
        pubd = self._published[bl]
        want = np.where(self.priority[bl] < 0, _ret.DEFAULT_PRIORITY, self.priority[bl])
        exp_ok = self.expiry[bl] != np.inf
        # a published block sits in its claim's level, or (its claim expired, not yet noticed) anywhere above
        bad = pubd & (lv != want) & ~exp_ok
        assert not bad.any(), f"{p}: block {int(bl[bad][0])} sits in level {int(lv[bad][0])}, its claim says {int(want[bad][0])}"
        assert not (pubd & (lv < 0)).any(), f"{p}: a published block is on the unpublished front"
        if lv.size and (lv >= 0).any():
            assert int(lv[lv >= 0].min()) >= self._lo, f"{p}: a block sits below the level bound {self._lo}"
        assert not (~self._published & (self.priority >= 0)).any(), f"{p}: an unpublished block holds a claim"
        if table_refs is not None:
            want = np.zeros(n, np.int64)
            for b, c in table_refs.items():
                assert b != NULL_BLOCK, f"{p}: a table references block 0 as live"
                want[b] = c
            diff = np.flatnonzero(rc[1:] != want[1:])
            if diff.size:
                b = int(diff[0]) + 1
                assert False, f"{p}: block {b} ref_count={int(rc[b])} but {int(want[b])} table entries"
        pub = np.array([h is not None for h in self.block_hash], np.bool_)
        assert np.array_equal(pub, self._published), f"{p}: published mask disagrees with block_hash"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"{p}: index maps {h.hex()[:12]} to block {b} holding another hash"
            assert self._published[b], f"{p}: indexed block {b} is not marked published"
        assert int(pub.sum()) == len(self.hash_to_block), (
            f"{p}: {int(pub.sum())} blocks carry a hash but the index holds {len(self.hash_to_block)}"
        )


_EMPTY_I32 = np.empty(0, np.int32)
_INT64 = np.dtype(np.int64)


def _ids(blocks) -> np.ndarray:
    """Block ids as int64 ``[n]``: a list of Python ints packed (a long one) or through ``fromiter``
    (a short one), a ``range`` without a Python loop, else any iterable of ints."""
    if type(blocks) is list:
        if len(blocks) >= _PACK_FROM:
            arr = int64_from_ints(blocks)
            if arr is not None:
                return arr
        return np.fromiter(blocks, np.int64, len(blocks))
    if type(blocks) is np.ndarray and blocks.dtype is _INT64 and blocks.ndim == 1:
        return blocks  # a release's or a slab call's ids, converted once by the caller
    if type(blocks) is range:
        return np.arange(blocks.start, blocks.stop, blocks.step, dtype=np.int64)
    if isinstance(blocks, np.ndarray):
        return blocks.astype(np.int64, copy=False).reshape(-1)
    if type(blocks) is not list:
        blocks = list(blocks)
    return np.fromiter(blocks, np.int64, len(blocks))


