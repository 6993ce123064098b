"""The fast slab table: huge blocks shared by a manager's leaves as int32 arrays
(``kvspec.engine.SlabTable``, spec/manager.md §13).

Same answers as ``kvref.ReferenceSlabTable`` for the same calls, with no
Python object per huge block: ``owner`` and ``live`` are int32 arrays, the
parked queue is an intrusive list in two int32 arrays ``prev`` / ``next``
with sentinels ``HEAD = num_huge_blocks`` and ``TAIL = num_huge_blocks + 1``,
so parking, un-parking from the middle and claiming the front are O(1). The policy over it (which
leaf claims what, when) is ``kvref.Slab``'s; this module holds no policy.
"""

from __future__ import annotations

import numpy as np
from kvspec.engine import PRISTINE
from numba import njit


@njit(nogil=True, cache=True)
def _take(prev, next_, parked, owner, live, parked_typed, hs):
    """A page of each huge block of ``hs`` referenced again: unlink it if parked, ``live += 1``.
    Returns how many were un-parked."""
    k = 0
    for i in range(hs.shape[0]):
        h = hs[i]
        if parked[h]:
            p = prev[h]
            n = next_[h]
            next_[p] = n
            prev[n] = p
            prev[h] = -1
            next_[h] = -1
            parked[h] = False
            if owner[h] >= 0:
                parked_typed[owner[h]] -= 1
            k += 1
        live[h] += 1
    return k


@njit(nogil=True, cache=True)
def _drop(prev, next_, parked, owner, live, parked_typed, tail, hs):
    """A page of each huge block of ``hs`` went idle: ``live -= 1``; at 0 the block is appended
    to the parked queue. Returns how many were parked."""
    k = 0
    for i in range(hs.shape[0]):
        h = hs[i]
        live[h] -= 1
        if live[h] == 0:
            p = prev[tail]
            next_[p] = h
            prev[h] = p
            next_[h] = tail
            prev[tail] = h
            parked[h] = True
            parked_typed[owner[h]] += 1
            k += 1
    return k

__all__ = ["FastSlabTable"]


class FastSlabTable:
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

    @property
    def num_parked(self) -> int:
        return self._num_parked

    def parked_typed(self, leaf: int) -> int:
        return int(self._parked_typed[leaf])

    def front(self) -> int:
        h = int(self._next[self._head])
        return 0 if h == self._tail else h

    def is_parked(self, h: int) -> bool:
        return bool(self._parked[h])

    def park(self, h: int) -> None:
        prv, nxt, t = self._prev, self._next, self._tail
        p = prv[t]
        nxt[p] = h
        prv[h] = p
        nxt[h] = t
        prv[t] = h
        self._parked[h] = True
        self._num_parked += 1
        self._parked_typed[self.owner[h]] += 1

    def unpark(self, h: int) -> None:
        prv, nxt = self._prev, self._next
        p, n = prv[h], nxt[h]
        nxt[p] = n
        prv[n] = p
        prv[h] = nxt[h] = -1
        self._parked[h] = False
        self._num_parked -= 1
        o = self.owner[h]
        if o != PRISTINE:
            self._parked_typed[o] -= 1

    def set_owner(self, h: int, leaf: int) -> None:
        self.owner[h] = leaf

    def add_live(self, h: int, delta: int) -> int:
        v = int(self.live[h]) + delta
        self.live[h] = v
        return v

    def take(self, hs) -> None:
        if len(hs) == 1:  # a decode step's page: no kernel call
            h = hs[0]
            if self._parked[h]:
                self.unpark(h)
            self.live[h] += 1
            return
        arr = np.asarray(hs, dtype=np.int64)
        self._num_parked -= _take(self._prev, self._next, self._parked, self.owner, self.live, self._parked_typed,
                                  arr)

    def drop(self, hs) -> None:
        if not len(hs):
            return
        arr = np.asarray(hs, dtype=np.int64)
        self._num_parked += _drop(self._prev, self._next, self._parked, self.owner, self.live, self._parked_typed,
                                  self._tail, arr)

    def parked_order(self) -> list[int]:
        out, nxt, h = [], self._next, int(self._next[self._head])
        while h != self._tail:
            out.append(h)
            h = int(nxt[h])
        return out

    def owners(self) -> list[int]:
        return self.owner.tolist()

    def live_counts(self) -> list[int]:
        return self.live.tolist()
