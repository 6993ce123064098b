"""Lost-hit attribution: why each prompt token the ceiling reuses was not reused.

For every request the infinite-cache ceiling (:mod:`kvcache.ceiling`) reuses
``c`` pages and the replay reused ``h <= c`` at the request's first
admission. The ``c - h`` lost pages get exactly one cause each, from a ladder
of counterfactual hits, each the longest leading run of the request's pages
that met one more condition at its admission (``docs/replay.md`` defines
them):

==========  ===============================================================  ==================
rung        leading run of pages that were ...                               the gap's cause
==========  ===============================================================  ==================
``c``       reusable by an infinite cache serving requests one at a time
``a0``      committed by some request before this admission (any salt)      ``in_flight`` or
                                                                             ``preempted``
``a``       committed under this request's ``cache_salt``                   ``isolated_by_salt``
``b``       committed on this request's replica (or on any replica when     ``other_replica``
            peers or a shared tier can serve it)
``k``       ... and, with a recurrent leaf, ending where a state checkpoint  ``no_checkpoint``
            was published
``h``       the replay's hit                                                 ``evicted:<levels>``
                                                                             or ``load_refused``
==========  ===============================================================  ==================

The page at ``a0`` decides between ``in_flight`` (no request had committed it
yet: the requests that produce it were waiting or still running) and
``preempted`` (a request that produces it had been preempted and was waiting
or recomputing at this admission, or had computed it and was preempted
before committing it). ``evicted:device+host+...`` names every level the page was absent
from (the device pool and each configured tier); when the tier refused the
load during this admission the gap is ``load_refused`` instead. A load that
fails after admission moves the external tokens it would have brought to
``load_failed``. Every gap is a whole number of pages, so the causes of a
run sum exactly to ``ceiling_hit_tokens - hit_tokens``.

The ladder assumes a cold start (no warm disk directory or remote tier from
an earlier process) and, on a sliding-window model, counts window pages
evicted from the window pool under ``evicted``. When the replay hits more
than a rung allows (a warm start), the rung is raised to the hit and the
request counts in :attr:`LostHits.mismatches`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["CAUSES", "LostHits", "evicted_cause"]

#: Every cause, in the order the table lists them (``evicted:...`` stands for its variants).
CAUSES = ("in_flight", "preempted", "isolated_by_salt", "other_replica", "no_checkpoint",
          "evicted", "load_refused", "load_failed")


def evicted_cause(host: bool, disk: bool, remote: bool) -> str:
    """``"evicted:device"`` plus ``+host``, ``+disk``, ``+remote`` for each configured tier."""
    levels = ["device"] + [name for name, on in (("host", host), ("disk", disk), ("remote", remote)) if on]
    return "evicted:" + "+".join(levels)


class LostHits:
    """Tracks what a replay commits and attributes each request's lost hit.

    Parameters
    ----------
    page_ids : list of int64 arrays
        ``Ceiling.page_ids``: an id per committed page of each request.
    ceiling_pages : int64 [num_requests]
        Pages the ceiling reuses per request.
    salts : sequence of (str or None)
        Each request's ``cache_salt``.
    page_size : int
    peers_serve : bool
        Pages committed on another replica can be served (cross-replica copies
        of a single full leaf, or a tier shared by the replicas).
    recurrent : bool
        The model has a recurrent leaf (hits end at state checkpoints).
    evicted : str
        The eviction cause's name (:func:`evicted_cause`).
    """

    def __init__(self, page_ids: Sequence[np.ndarray], ceiling_pages: np.ndarray, salts: Sequence,
                 page_size: int, *, peers_serve: bool, recurrent: bool, evicted: str):
        self.page_ids = page_ids
        self.ceiling_pages = ceiling_pages
        self.salts = salts
        self.page_size = page_size
        self.peers_serve = peers_serve
        self.recurrent = recurrent
        self.evicted = evicted
        n_ids = 1 + max((int(p.max()) for p in page_ids if p.size), default=0)
        #: per page id: committed under any salt
        self._any = np.zeros(n_ids, dtype=np.bool_)
        #: per page id: bitmask of replicas that committed it with no salt
        self._where = np.zeros(n_ids, dtype=np.int64) if not any(salts) else None
        #: (salt, id) -> bitmask of replicas, for salted workloads
        self._salted: dict = {}
        self._checkpoints: set = set()
        self._preempted: set = set()
        #: requests preempted and not finished yet -> their page ids as a set
        self._set_back: dict[int, set] = {}
        self._committed = np.zeros(len(page_ids), dtype=np.int64)
        #: cause -> lost tokens
        self.tokens: dict[str, int] = {}
        #: requests whose hit exceeded a rung (see the module notes)
        self.mismatches = 0

    # -- what the replay tells us

    def commit(self, i: int, replica: int, processed: int) -> None:
        """Request ``i`` on ``replica`` called ``step`` with ``processed_length = processed``."""
        n = processed // self.page_size
        start = self._committed[i]
        if self.recurrent and processed and processed % self.page_size == 0:
            self._checkpoints.add((replica, self.salts[i], int(self.page_ids[i][n - 1])))
        if n <= start:
            return
        ids = self.page_ids[i][start:n]
        self._committed[i] = n
        self._any[ids] = True
        bit = 1 << replica if replica < 63 else 0
        if self._where is not None:
            if bit:
                self._where[ids] |= bit
        else:
            salt = self.salts[i]
            for j in ids.tolist():
                self._salted[(salt, j)] = self._salted.get((salt, j), 0) | bit

    def preempt(self, i: int, processed: int) -> None:
        """Request ``i`` was preempted with ``processed`` tokens computed (not all committed)."""
        n = processed // self.page_size
        c = self._committed[i]
        if n > c:
            self._preempted.update(self.page_ids[i][c:n].tolist())
        self._committed[i] = 0
        self._set_back[i] = set(self.page_ids[i].tolist())

    def finish(self, i: int) -> None:
        """Request ``i`` produced all its tokens and was released."""
        self._set_back.pop(i, None)

    def _lost_to_preemption(self, page: int) -> bool:
        return page in self._preempted or any(page in ids for ids in self._set_back.values())

    def admit(self, i: int, replica: int, hit_tokens: int, load: str | None = None) -> None:
        """Request ``i`` was first admitted on ``replica`` with ``hit_tokens``; attribute its loss.

        ``load`` is ``"load_refused"`` or ``"load_failed"`` when the tier refused or failed this
        admission's load (the manager then spliced the device hit only)."""
        ps = self.page_size
        c = int(self.ceiling_pages[i])
        h = hit_tokens // ps
        ids = self.page_ids[i]
        salt = self.salts[i]
        a0 = _run(self._any[ids[:c]])
        if self._where is not None:
            masks = self._where[ids[:a0]]
            a = a0
        else:
            masks = np.array([self._salted.get((salt, j), 0) for j in ids[:a0].tolist()], dtype=np.int64)
            a = _run(masks != 0)
        if self.peers_serve or replica >= 63:
            b = a
        else:
            b = _run((masks[:a] >> replica) & 1 != 0)
        k = b
        if self.recurrent:
            while k > 0 and (replica, salt, int(ids[k - 1])) not in self._checkpoints:
                k -= 1
        rungs = [c, a0, a, b, k, h]
        if h > min(rungs[:-1]):
            self.mismatches += 1
        # Raise every rung to the hit (and keep them non-increasing) so the gaps sum to c - h.
        floor = h
        for j in range(len(rungs) - 1, -1, -1):
            floor = rungs[j] = max(rungs[j], floor)
        for j in range(1, len(rungs)):
            rungs[j] = min(rungs[j], rungs[j - 1])
        c, a0, a, b, k, h = rungs
        if c > a0:
            self._add("preempted" if self._lost_to_preemption(int(ids[a0])) else "in_flight", c - a0)
        self._add("isolated_by_salt", a0 - a)
        self._add("other_replica", a - b)
        self._add("no_checkpoint", b - k)
        self._add(load or self.evicted, k - h)

    def load_failed(self, tokens: int) -> None:
        """A first admission's onload of ``tokens`` external tokens failed."""
        self._add("load_failed", tokens // self.page_size)

    def _add(self, cause: str, pages: int) -> None:
        if pages > 0:
            self.tokens[cause] = self.tokens.get(cause, 0) + pages * self.page_size

    @property
    def total(self) -> int:
        """Lost tokens over every cause."""
        return sum(self.tokens.values())


def _run(mask: np.ndarray) -> int:
    """Length of the leading run of True in ``mask``."""
    if mask.size == 0:
        return 0
    miss = np.flatnonzero(~mask)
    return int(miss[0]) if miss.size else int(mask.size)
