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
``a0``      committed by some request before this admission (any model or  ``in_flight`` or
            salt), or found warm (below)                                     ``preempted``
``am``      committed under this request's ``model``                        ``isolated_by_model``
``a``       committed under this request's ``model`` and ``cache_salt``     ``isolated_by_salt``
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

The ceiling is **global**: an infinite cache that reuses identical tokens
whatever the request's model or salt (``kvcache.ceiling``), so what isolation
costs shows up as ``isolated_by_model`` and ``isolated_by_salt``.

**Warm start.** A replay may start with pages already in a tier (a disk
directory or a remote tier written by an earlier process). A page the replay
hits that no request of the run had committed is *warm*: it is counted in
``warm_ceiling_tokens`` and from then on the ceiling treats it as seen from
the start (an infinite cache started as warm would hold it), so a request's
ceiling run is the leading run of pages committed by an earlier request *or*
found warm, and the causes still sum to ``ceiling - hits`` with the ceiling
so raised. Warm pages count as committed for the rungs below the ceiling.
A request that hits more than a rung allows for any other reason counts in
:attr:`LostHits.mismatches` (its rungs are raised to the hit).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["CAUSES", "LostHits", "evicted_cause"]

#: Every cause, in the order the table lists them (``evicted:...`` stands for its variants).
CAUSES = ("in_flight", "preempted", "isolated_by_model", "isolated_by_salt", "other_replica", "no_checkpoint",
          "sliding_window", "evicted", "load_refused", "load_failed")


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
        Pages the (cold) ceiling reuses per request.
    salts : sequence of (str or None)
        Each request's ``cache_salt``.
    page_size : int
    peers_serve : bool
        Pages (and state checkpoints) committed on another replica can be
        served: cross-replica copies (spec/manager.md §7.3, every leaf kind)
        or a tier shared by the replicas. When False, ``other_replica`` names
        the pages only another replica holds.
    recurrent : bool
        The model has a recurrent leaf (hits end at state checkpoints).
    evicted : str
        The eviction cause's name (:func:`evicted_cause`).
    models : sequence of (str or None), optional
        Each request's ``model`` (``Request.model``); default all None.
    reusable_pages : int64 [num_requests], optional
        ``(prompt_length - 1) // page_size`` per request: the most pages a
        request may reuse (needed to raise the ceiling over warm pages;
        default ``ceiling_pages``, which never raises it past the cold one).
    """

    def __init__(self, page_ids: Sequence[np.ndarray], ceiling_pages: np.ndarray, salts: Sequence,
                 page_size: int, *, peers_serve: bool, recurrent: bool, evicted: str,
                 models: Sequence | None = None, reusable_pages: np.ndarray | None = None):
        self.page_ids = page_ids
        self.ceiling_pages = ceiling_pages
        self.salts = salts
        self.models = list(models) if models is not None else [None] * len(page_ids)
        self.keys = list(zip(self.models, salts))  # a request's pages are shared under its (model, salt)
        self.reusable = reusable_pages if reusable_pages is not None else ceiling_pages
        self.page_size = page_size
        self.peers_serve = peers_serve
        self.recurrent = recurrent
        self.evicted = evicted
        n_ids = 1 + max((int(p.max()) for p in page_ids if p.size), default=0)
        #: per page id: committed under any model or salt
        self._any = np.zeros(n_ids, dtype=np.bool_)
        #: per page id: found warm (hit, never committed by the run: a tier warm at start)
        self._warm = np.zeros(n_ids, dtype=np.bool_)
        self._any_warm = False
        #: per page id: the first request (in workload order) that commits it: the ceiling's "seen before"
        self._first = np.full(n_ids, len(page_ids), dtype=np.int64)
        for i in range(len(page_ids) - 1, -1, -1):
            self._first[page_ids[i]] = i
        plain = not any(salts) and not any(m is not None for m in self.models)
        #: per page id: bitmask of replicas that committed it with no model and no salt
        self._where = np.zeros(n_ids, dtype=np.int64) if plain else None
        #: ((model, salt), id) -> bitmask of replicas, for salted or multi-model workloads
        self._salted: dict = {}
        #: (model, id) committed under that model (any salt)
        self._by_model: set = set()
        #: ((model, salt), id) -> bitmask of replicas holding a state checkpoint that ends at that page
        self._checkpoints: dict = {}
        self._preempted: set = set()
        #: requests preempted and not finished yet -> their page ids as a set
        self._set_back: dict[int, set] = {}
        self._committed = np.zeros(len(page_ids), dtype=np.int64)
        #: cause -> lost tokens
        self.tokens: dict[str, int] = {}
        #: requests whose hit exceeded a rung (see the module notes)
        self.mismatches = 0
        #: tokens the ceiling gained from warm pages (see the module notes)
        self.warm_ceiling_tokens = 0

    # -- what the replay tells us

    def commit(self, i: int, replica: int, processed: int) -> None:
        """Request ``i`` on ``replica`` called ``step`` with ``processed_length = processed``."""
        n = processed // self.page_size
        start = self._committed[i]
        if self.recurrent and processed and processed % self.page_size == 0:
            cp = (self.keys[i], int(self.page_ids[i][n - 1]))
            self._checkpoints[cp] = self._checkpoints.get(cp, 0) | (1 << replica if replica < 63 else 0)
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
            key = self.keys[i]
            model = key[0]
            salted, by_model = self._salted, self._by_model
            for j in ids.tolist():
                salted[(key, j)] = salted.get((key, j), 0) | bit
                by_model.add((model, j))

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

    def _ceiling(self, i: int, ids: np.ndarray) -> int:
        """Pages the ceiling reuses for request ``i``: the cold ceiling, raised over warm pages."""
        c = int(self.ceiling_pages[i])
        if not self._any_warm:
            return c
        r = int(self.reusable[i])
        raised = _run((self._first[ids[:r]] < i) | self._warm[ids[:r]])
        self.warm_ceiling_tokens += (raised - c) * self.page_size
        return raised

    def admit(self, i: int, replica: int, hit_tokens: int, load: str | None = None,
              window_pages: int | None = None) -> None:
        """Request ``i`` was first admitted on ``replica`` with ``hit_tokens``; attribute its loss.

        ``load`` is ``"load_refused"`` or ``"load_failed"`` when the tier refused or failed this
        admission's load (the manager then spliced the device hit only). ``window_pages``, on a
        model with a sliding-window leaf, is the hit its full-attention leaves alone would have
        given (pages, ``>= hit``): the pages between the hit and it were held by the full leaves
        but not by the window (``sliding_window``)."""
        ps = self.page_size
        h = hit_tokens // ps
        ids = self.page_ids[i]
        key = self.keys[i]
        if h:
            fresh = ids[:h][~self._any[ids[:h]]]
            if fresh.size:  # hit pages no request of this run committed: a tier warm at start
                self._warm[fresh] = True
                self._any_warm = True
        c = self._ceiling(i, ids)
        a0 = _run(self._any[ids[:c]] | self._warm[ids[:c]])
        warm = self._warm[ids[:a0]]
        if self._where is not None:
            masks = self._where[ids[:a0]]
            am = a = a0
        else:
            model = key[0]
            am = _run(np.fromiter(((model, j) in self._by_model for j in ids[:a0].tolist()), dtype=np.bool_,
                                  count=a0) | warm)
            masks = np.fromiter((self._salted.get((key, j), 0) for j in ids[:am].tolist()), dtype=np.int64, count=am)
            a = _run((masks != 0) | warm[:am])
        if self.peers_serve or replica >= 63:
            b = a
        else:
            b = _run(((masks[:a] >> replica) & 1 != 0) | warm[:a])
        k = b
        if self.recurrent:
            cps = self._checkpoints
            mine = 1 << replica if replica < 63 and not self.peers_serve else -1  # any replica's, when peers serve
            while k > 0 and not cps.get((key, int(ids[k - 1])), 0) & mine and not self._warm[ids[k - 1]]:
                k -= 1
        w = h if window_pages is None else max(min(k, window_pages), h)
        rungs = [c, a0, am, a, b, k, w, h]
        if h > min(rungs[:-1]):
            self.mismatches += 1
        # Raise every rung to the hit (and keep them non-increasing) so the gaps sum to c - h.
        floor = h
        for j in range(len(rungs) - 1, -1, -1):
            floor = rungs[j] = max(rungs[j], floor)
        for j in range(1, len(rungs)):
            rungs[j] = min(rungs[j], rungs[j - 1])
        c, a0, am, a, b, k, w, h = rungs
        if c > a0:
            self._add("preempted" if self._lost_to_preemption(int(ids[a0])) else "in_flight", c - a0)
        self._add("isolated_by_model", a0 - am)
        self._add("isolated_by_salt", am - a)
        self._add("other_replica", a - b)
        self._add("no_checkpoint", b - k)
        self._add(load or self.evicted, k - w)
        self._add("sliding_window", w - h)

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
