"""The fast slab table: huge blocks shared by a manager's leaves as int32 arrays
(``kvspec.engine.SlabTable``, spec/manager.md §13).

Same answers as ``kvref.ReferenceSlabTable`` for the same calls, with no
Python object per huge block: ``owner`` and ``live`` are int32 arrays, the
parked queue is an intrusive list in two int32 arrays ``prev`` / ``next``
with sentinels ``HEAD = num_huge_blocks`` and ``TAIL = num_huge_blocks + 1``,
so parking, un-parking from the middle and claiming the front are O(1). The batched calls
(``claim_pristine``, ``claim_front``, ``take_pages``, ``take_idle``, ``drop_idle``,
``claim_pristine_pages``) run as one
Numba pass each (a single block in Python, cheaper than a kernel call), leaving exactly the state
of their loops of single-block calls. The policy over it (which leaf claims what, when) is
``kvref.Slab``'s; this module holds no policy.
"""

from __future__ import annotations

import numpy as np
from kvspec.engine import PRISTINE
from numba import njit

from ._block_pool import _SMALL, BlockPool, _ids, _MemoryViews
from ._numba import inner_kernel
from ._numba.freelist import insert_before, pop_front_evict, retain_free, unlink


@inner_kernel
def _ref_one(prev, next_, parked, owner, live, parked_typed, h):
    """A page of huge block ``h`` referenced again: unlink it if parked, ``live += 1``. Returns 1
    when it was un-parked, else 0."""
    was_parked = 0
    if parked[h]:
        unlink(prev, next_, h)
        parked[h] = False
        if owner[h] >= 0:
            parked_typed[owner[h]] -= 1
        was_parked = 1
    live[h] += 1
    return was_parked


@inner_kernel
def _unref_one(prev, next_, parked, owner, live, parked_typed, tail, h):
    """A page of huge block ``h`` went idle: ``live -= 1``; at 0 the block is appended to the parked
    queue. Returns 1 when it was parked, else 0."""
    live[h] -= 1
    if live[h] != 0:
        return 0
    insert_before(prev, next_, tail, h)
    parked[h] = True
    parked_typed[owner[h]] += 1
    return 1


@njit(cache=True)
def _take(prev, next_, parked, owner, live, parked_typed, hs):
    """A page of each huge block of ``hs`` referenced again: unlink it if parked, ``live += 1``.
    Returns how many were un-parked."""
    k = 0
    for i in range(hs.shape[0]):
        h = hs[i]
        k += _ref_one(prev, next_, parked, owner, live, parked_typed, h)
    return k


@njit(cache=True)
def _drop(prev, next_, parked, owner, live, parked_typed, tail, hs):
    """A page of each huge block of ``hs`` went idle: ``live -= 1``; at 0 the block is appended
    to the parked queue. Returns how many were parked."""
    k = 0
    for i in range(hs.shape[0]):
        h = hs[i]
        k += _unref_one(prev, next_, parked, owner, live, parked_typed, tail, h)
    return k


@njit(cache=True)
def _take_pages(prev, next_, parked, owner, live, parked_typed, pages, ratio, ref_count, idle_only):
    """:func:`_take` of ``pages[i] // ratio`` for every page (``idle_only``: only the pages whose
    ``ref_count`` is 0). Returns how many huge blocks were un-parked."""
    k = 0
    for i in range(pages.shape[0]):
        b = pages[i]
        if idle_only and ref_count[b] != 0:
            continue
        h = b // ratio
        k += _ref_one(prev, next_, parked, owner, live, parked_typed, h)
    return k


@njit(cache=True)
def _drop_idle(prev, next_, parked, owner, live, parked_typed, tail, pages, ratio, ref_count):
    """:func:`_drop` of ``pages[i] // ratio`` for every page ``!= 0`` whose ``ref_count`` is 0.
    Returns how many huge blocks were parked."""
    k = 0
    for i in range(pages.shape[0]):
        b = pages[i]
        if b == 0 or ref_count[b] != 0:
            continue
        h = b // ratio
        k += _unref_one(prev, next_, parked, owner, live, parked_typed, tail, h)
    return k


@njit(cache=True)
def _touch_pages(prev, next_, parked, owner, live, parked_typed, ratio, pool_prev, pool_next, ref_count, pages):
    """:func:`_take_pages` of the idle ``pages`` (``idle_only``) then the pool's ``touch_many`` of them
    (``kvfast._numba.freelist.touch_many``), page by page in one pass: the same state, since the pages
    are distinct and a page's table step reads only its own ref count. Returns ``(un-parked huge
    blocks, pages revived off the pool's free list)``."""
    unparked = 0
    revived = 0
    for i in range(pages.shape[0]):
        b = pages[i]
        if ref_count[b] == 0:
            unparked += _ref_one(prev, next_, parked, owner, live, parked_typed, b // ratio)
            unlink(pool_prev, pool_next, b)
            revived += 1
        ref_count[b] += 1
    return unparked, revived


@njit(cache=True)
def _retain_free_drop(pool_prev, pool_next, ref_count, published, prio, expiry, pool_head, lo, now, pages, priority,
                      until, ttl, prev, next_, parked, owner, live, parked_typed, tail, ratio):
    """The pool's ``retain_free`` kernel pass over ``pages`` (``kvfast._numba.freelist.retain_free``),
    then, when it freed every page, :func:`_drop_idle` of them, in one call. Returns the pool's
    ``(bad, freed, lo, k)`` and the huge blocks parked (0, the table untouched, when the pool
    refused a page: its caller raises as ``retain_free`` would, before any drop)."""
    bad, freed, lo, k = retain_free(pool_prev, pool_next, ref_count, published, prio, expiry, pool_head, lo, now,
                                    pages, priority, until, ttl)
    if bad != -1:
        return bad, freed, lo, k, 0
    return bad, freed, lo, k, _drop_idle(prev, next_, parked, owner, live, parked_typed, tail, pages, ratio,
                                         ref_count)


@njit(cache=True)
def _draw_take(pool_prev, pool_next, ref_count, published, prio, expiry, pool_head, lo, n, out, evicted, prev, next_,
               parked, owner, live, parked_typed, ratio):
    """The pool's draw of ``n`` pages (``kvfast._numba.freelist.pop_front_evict`` into ``out``) then
    :func:`_take_pages` of them, in one call. Returns the pool's ``(evicted count, lo)`` and the huge
    blocks un-parked."""
    k, lo = pop_front_evict(pool_prev, pool_next, ref_count, published, prio, expiry, pool_head, lo, n, out, evicted)
    return k, lo, _take_pages(prev, next_, parked, owner, live, parked_typed, out, ratio, ref_count, False)


@njit(cache=True)
def _claim_front(prev, next_, parked, owner, parked_typed, head, leaf, hs, prevs):
    """Unlink the ``hs.shape[0]`` front blocks of the parked queue into ``hs`` (their previous owners
    into ``prevs``) and type them to ``leaf``; the caller checked that many are parked."""
    for i in range(hs.shape[0]):
        h = next_[head]
        unlink(prev, next_, h)
        parked[h] = False
        o = owner[h]
        if o >= 0:
            parked_typed[o] -= 1
        owner[h] = leaf
        hs[i] = h
        prevs[i] = o


@njit(cache=True)
def _claim_run(prev, next_, parked, owner, live, head, h0, h1, leaf, pages, ratio):
    """Unlink the run ``h0 .. h1-1`` at the front of the parked queue (pristine, consecutive), type it
    to ``leaf`` and reference its first ``pages`` pages (``ratio`` per block): ``live += 1`` each."""
    after = next_[h1 - 1]
    next_[head] = after
    prev[after] = head
    for h in range(h0, h1):
        prev[h] = -1
        next_[h] = -1
        parked[h] = False
        owner[h] = leaf
        left = pages - (h - h0) * ratio
        if left > 0:
            live[h] += min(left, ratio)


@njit(cache=True)
def _parked_order(next_, head, tail, out):
    """The parked queue from the front into ``out``; returns how many (one pass over the links)."""
    n = 0
    h = next_[head]
    while h != tail and n < out.shape[0]:
        out[n] = h
        n += 1
        h = next_[h]
    return n


_NO_REFS = np.zeros(1, np.int32)


_warmed = False


def _warm() -> None:
    """Compile (or load from the disk cache) this module's kernels once per process, when the first
    table is built, so a request does not pay the load."""
    global _warmed
    if _warmed:
        return
    n = 4
    prev = np.full(n + 2, -1, np.int32)
    nxt = np.full(n + 2, -1, np.int32)
    prev[n + 1], nxt[n] = n, n + 1  # an empty queue HEAD -> TAIL
    parked = np.zeros(n, np.bool_)
    owner = np.zeros(n, np.int32)
    live = np.zeros(n, np.int32)
    typed = np.zeros(1, np.int64)
    hs = np.array([1, 2], np.int64)
    rc = np.zeros(n, np.int32)
    _take(prev, nxt, parked, owner, live, typed, hs)
    _drop(prev, nxt, parked, owner, live, typed, n + 1, hs)  # parks 1, 2
    _take_pages(prev, nxt, parked, owner, live, typed, hs, 1, rc, True)
    _drop_idle(prev, nxt, parked, owner, live, typed, n + 1, hs, 1, rc)
    _claim_front(prev, nxt, parked, owner, typed, n, 0, np.empty(0, np.int32), np.empty(0, np.int32))
    _claim_run(prev, nxt, parked, owner, live, n, 1, 1, 0, 0, 1)  # an empty run (the scratch arrays only)
    _touch_pages(prev, nxt, parked, owner, live, typed, 1, prev, nxt, rc, np.empty(0, np.int64))  # no page
    _draw_take(prev, nxt, rc, parked, np.zeros(n, np.int8), np.zeros(n), n, 0, 0, np.empty(0, np.int32),
               np.empty(0, np.int32), prev, nxt, parked, owner, live, typed, 1)  # no page
    _retain_free_drop(prev, nxt, rc, parked, np.zeros(n, np.int8), np.zeros(n), n, 0, 0.0, np.empty(0, np.int64),
                      35, np.inf, np.empty(0, np.int32), prev, nxt, parked, owner, live, typed, n + 1, 1)  # no page
    empty = np.full(n + 2, -1, np.int32)
    empty[n] = n + 1  # HEAD -> TAIL
    _parked_order(empty, n, n + 1, np.empty(n, np.int32))
    _warmed = True


__all__ = ["FastSlabTable"]


class FastSlabTable(_MemoryViews):
    """Owners, live page counts and the parked queue of one slab (int32 arrays).

    Parameters
    ----------
    num_huge_blocks : int
        Huge blocks including the null block 0 (>= 2).
    num_leaves : int
        Leaves sharing the slab.

    Attributes
    ----------
    owner : int32 [num_huge_blocks]
        Leaf each huge block is typed to, ``PRISTINE`` (-1) if none.
    live : int32 [num_huge_blocks]
        Referenced pages per huge block.
    """

    def __init__(self, num_huge_blocks: int, num_leaves: int):
        if num_huge_blocks < 2:
            raise ValueError(f"SlabTable: num_huge_blocks={num_huge_blocks}, must be >= 2 (huge block 0 is null)")
        n = num_huge_blocks
        self.num_huge_blocks = n
        self.num_leaves = num_leaves
        self.owner = np.full(n, PRISTINE, np.int32)
        self.live = np.zeros(n, np.int32)
        self._head, self._tail = n, n + 1
        # the parked queue HEAD -> 1 -> 2 .. -> n-1 -> TAIL; huge block 0 off it
        chain = np.concatenate(([self._head], np.arange(1, n), [self._tail])).astype(np.int32)
        self._prev = np.full(n + 2, -1, np.int32)
        self._next = np.full(n + 2, -1, np.int32)
        self._next[chain[:-1]] = chain[1:]
        self._prev[chain[1:]] = chain[:-1]
        self._parked = np.zeros(n, np.bool_)
        self._parked[1:] = True
        self._num_parked = n - 1
        self._parked_typed = np.zeros(num_leaves, np.int64)
        self._views()
        _warm()

    #: the memoryviews the one-block paths (``park``, ``unpark``, ``front``, a single take or drop, a
    #: decode step's claim) read and write element by element
    _VIEWS = (("_nx", "_next"), ("_pv", "_prev"), ("_pk", "_parked"), ("_ow", "owner"), ("_lv", "live"),
              ("_pt", "_parked_typed"))

    @property
    def num_parked(self) -> int:
        return self._num_parked

    def parked_typed(self, leaf: int) -> int:
        return self._pt[leaf]

    def front(self) -> int:
        h = self._nx[self._head]
        return 0 if h == self._tail else h

    def is_parked(self, h: int) -> bool:
        return self._pk[h]

    def park(self, h: int) -> None:
        prv, nxt, t = self._pv, self._nx, self._tail
        p = prv[t]
        nxt[p] = h
        prv[h] = p
        nxt[h] = t
        prv[t] = h
        self._pk[h] = True
        self._num_parked += 1
        self._pt[self._ow[h]] += 1

    def unpark(self, h: int) -> None:
        prv, nxt = self._pv, self._nx
        p, n = prv[h], nxt[h]
        nxt[p] = n
        prv[n] = p
        prv[h] = nxt[h] = -1
        self._pk[h] = False
        self._num_parked -= 1
        o = self._ow[h]
        if o != PRISTINE:
            self._pt[o] -= 1

    def set_owner(self, h: int, leaf: int) -> None:
        self._ow[h] = leaf

    def _take_one(self, h: int) -> None:
        """``take([h])`` in Python (a decode step's page: no kernel call)."""
        if self._pk[h]:
            self.unpark(h)
        self._lv[h] += 1

    def _drop_one(self, h: int) -> None:
        """``drop([h])`` in Python (a decode step's page: no kernel call)."""
        lv = self._lv
        v = lv[h] - 1
        lv[h] = v
        if v == 0:
            self.park(h)

    def take(self, hs) -> None:
        if type(hs) is not list and not isinstance(hs, np.ndarray):
            hs = list(hs)
        n = len(hs)
        if n <= 1:
            if n:
                self._take_one(hs[0])
            return
        arr = np.asarray(hs, dtype=np.int64)
        self._num_parked -= _take(self._prev, self._next, self._parked, self.owner, self.live, self._parked_typed,
                                  arr)

    def drop(self, hs) -> None:
        if type(hs) is not list and not isinstance(hs, np.ndarray):
            hs = list(hs)
        n = len(hs)
        if n <= 1:
            if n:
                self._drop_one(hs[0])
            return
        arr = np.asarray(hs, dtype=np.int64)
        self._num_parked += _drop(self._prev, self._next, self._parked, self.owner, self.live, self._parked_typed,
                                  self._tail, arr)

    def claim_pristine(self, leaf: int, k: int) -> range:
        """Up to ``k`` pristine blocks off the queue's front, typed to ``leaf``: the pristine blocks
        are the ids ``front .. num_huge_blocks-1`` at the front in order (``kvspec.engine.SlabTable``),
        so the run is unlinked in one pass."""
        return self._claim_pristine(leaf, k, 0, 1)

    def claim_pristine_pages(self, leaf: int, n: int, ratio: int) -> range:
        """:meth:`claim_pristine` of ``ceil(n / ratio)`` blocks and ``take_pages`` of their first ``n``
        pages, in the same pass."""
        return self._claim_pristine(leaf, -(-n // ratio), n, ratio)

    def _claim_pristine(self, leaf: int, k: int, pages: int, ratio: int) -> range:
        h0 = self._nx[self._head]
        if h0 == self._tail or self._ow[h0] != PRISTINE or k <= 0:
            h0 = 0 if h0 == self._tail else h0
            return range(h0, h0)
        h1 = min(h0 + k, self.num_huge_blocks)
        _claim_run(self._prev, self._next, self._parked, self.owner, self.live, self._head, h0, h1, leaf, pages,
                   ratio)
        self._num_parked -= h1 - h0
        return range(h0, h1)

    def claim_front(self, leaf: int, k: int) -> tuple[list[int], list[int]]:
        if k == 1:  # a decode step's claim: no kernel call
            h = self.front()
            o = self._ow[h]
            self.unpark(h)
            self._ow[h] = leaf
            return [h], [o]
        hs = np.empty(k, np.int32)
        prevs = np.empty(k, np.int32)
        _claim_front(self._prev, self._next, self._parked, self.owner, self._parked_typed, self._head, leaf, hs,
                     prevs)
        self._num_parked -= k
        return hs.tolist(), prevs.tolist()

    def take_pages(self, pages, ratio: int) -> None:
        n = len(pages)
        if n <= 1:
            if n:
                self._take_one(pages[0] // ratio)
            return
        self._num_parked -= _take_pages(self._prev, self._next, self._parked, self.owner, self.live,
                                        self._parked_typed, _ids(pages), ratio, _NO_REFS, False)

    def allocate_pages(self, pool, n: int, ratio: int) -> list[int]:
        """``pool.allocate(n)`` then :meth:`take_pages` of the pages drawn; with kvfast's pool, its
        draw and the takes are one kernel call (the pool's check first: ``CapacityError``, nothing
        changed)."""
        if n <= 1 or type(pool) is not BlockPool:
            got = pool.allocate(n)
            self.take_pages(got, ratio)
            return got
        out, evicted = pool._draw_args(n)
        k, pool._lo, unparked = _draw_take(pool._prev, pool._next, pool.ref_count, pool._published, pool.priority,
                                           pool.expiry, pool._head, pool._lo, n, out, evicted, self._prev,
                                           self._next, self._parked, self.owner, self.live, self._parked_typed, ratio)
        self._num_parked -= unparked
        pool._draw_done(n, evicted, k)
        return out.tolist()

    def take_idle(self, pages, ratio: int, ref_count) -> None:
        n = len(pages)
        if n <= 1 or not isinstance(ref_count, np.ndarray):
            self.take([b // ratio for b in pages if ref_count[b] == 0])
            return
        self._num_parked -= _take_pages(self._prev, self._next, self._parked, self.owner, self.live,
                                        self._parked_typed, _ids(pages), ratio, ref_count, True)

    def drop_idle(self, pages, ratio: int, ref_count) -> None:
        n = len(pages)
        if n <= 1 or not isinstance(ref_count, np.ndarray):
            if n == 1:
                b = pages[0]
                if b and ref_count[b] == 0:
                    self._drop_one(b // ratio)
                return
            self.drop([b // ratio for b in pages if b and ref_count[b] == 0])
            return
        self._num_parked += _drop_idle(self._prev, self._next, self._parked, self.owner, self.live,
                                       self._parked_typed, self._tail, _ids(pages), ratio, ref_count)

    def free_pages(self, pool, pages, ratio: int, claim: tuple[int, float] | None = None) -> None:
        """``pool.free(pages)`` (``pool.retain_free(pages, *claim)``), then :meth:`drop_idle` of them;
        the ids of a run the pool passes to a kernel are converted once, for both kernels (a short
        list keeps the pool's Python ``free``). A retained run of a ``kvfast.BlockPool`` (a release, a
        slide) is one kernel call for the pool and the table together."""
        if claim is not None and len(pages) > 1 and type(pool) is BlockPool:
            run = pool._retain_free_args(pages, claim[0], claim[1])  # checks first: nothing changed on a bad claim
            blocks, priority, expiry, now, ttl = run
            bad, freed, lo, k, parked = _retain_free_drop(
                pool._prev, pool._next, pool.ref_count, pool._published, pool.priority, pool.expiry, pool._head,
                pool._lo, now, blocks, priority, expiry, ttl, self._prev, self._next, self._parked, self.owner,
                self.live, self._parked_typed, self._tail, ratio)
            self._num_parked += parked
            pool._retain_free_done(*run, bad, freed, lo, k)  # raises as retain_free would (the table untouched)
            return
        if len(pages) > (1 if claim is not None else _SMALL) and isinstance(pool.ref_count, np.ndarray):
            pages = _ids(pages)  # what the pool's kernel call converts to; the table reuses it
        if claim is None:
            pool.free(pages)
        else:
            pool.retain_free(pages, claim[0], claim[1])
        self.drop_idle(pages, ratio, pool.ref_count)

    def touch_pages(self, pool, pages, ratio: int) -> int:
        """:meth:`take_idle` of ``pages``, then ``pool.touch_many(pages)``; the ids of a long run are
        converted once, for both kernels (a short list keeps the pool's Python path). A long run of a
        ``kvfast.BlockPool`` is one kernel pass over the table and the pool's free list together."""
        if len(pages) > _SMALL and type(pool) is BlockPool:
            unparked, revived = _touch_pages(self._prev, self._next, self._parked, self.owner, self.live,
                                             self._parked_typed, ratio, pool._prev, pool._next, pool.ref_count,
                                             _ids(pages))
            self._num_parked -= unparked
            pool._num_free -= revived
            return revived
        if len(pages) > _SMALL and isinstance(pool.ref_count, np.ndarray):
            pages = _ids(pages)
        self.take_idle(pages, ratio, pool.ref_count)
        return pool.touch_many(pages)

    def parked_order(self, limit: int | None = None) -> list[int]:
        out = np.empty(self._num_parked if limit is None else min(limit, self._num_parked), np.int32)
        return out[: _parked_order(self._next, self._head, self._tail, out)].tolist()

    def owners(self) -> list[int]:
        return self.owner.tolist()

    def live_counts(self) -> list[int]:
        return self.live.tolist()
