"""The batch calls: one call per scheduler step (spec/manager.md §17).

``alloc_many``, ``step_many`` and ``release_many`` have exactly the effect of
the loop of the single calls over ``ctxs`` in order (results, block ids,
hits, metrics, errors); if that loop would raise at some context, the batch
call raises the same error and leaves the manager, its pages' bytes and the
contexts as they were before the call. Mixed into ``PagedKVCacheManager``
(its state); kvref's batch call is the loop over its per-request policy, so
it stays the executable definition.

How "as before" is kept without a copy per call: every argument check of the
single calls is run for every context first (they depend only on the state
before the batch), then a bound decides whether the loop can fail at all
(``alloc_many``: the pages the batch can draw, per replica and leaf, against
the free ones). Only when it might (a pool that could run short, a transfer
of its own, a replacement context) does the batch run **guarded**: the
bookkeeping is copied, every page byte the batch writes is journaled, and a
failure puts both back before it re-raises.
"""

from __future__ import annotations

import copy
from typing import Sequence

import numpy as np

from kvspec._manager_types import KVTransfer, TextContext

from ._request import _Request

__all__ = ["BatchCalls"]

#: The manager's attributes a guarded batch copies and puts back on failure (spec/manager.md §17.3);
#: everything else is configuration, decided at construction, or bytes (journaled page by page).
_BATCH_STATE = ("_requests", "_pools", "_slabs", "_metrics", "_loads", "_offloads", "_offload_queue",
                "_pins", "_leaf_pins", "_completions_seen")
#: The fields of a context the manager changes (spec/manager.md §2: the splice and its counts).
_CTX_FIELDS = ("_processed", "_active", "cached_prefix_length", "cached_prefix_external_length")


class BatchCalls:
    """``alloc_many``, ``step_many``, ``release_many`` (spec/manager.md §17)."""

    #: the byte journal of a guarded batch: ``(page store, page ids, their bytes)`` before each write;
    #: None outside one (``_run_copies`` and the connector's loads append to it)
    _journal: list | None = None

    # ================================================================== the calls

    def alloc_many(self, ctxs: Sequence[TextContext], *, defer_lookup: bool = False) -> list[KVTransfer]:
        """``[alloc(ctx, defer_lookup=defer_lookup) for ctx in ctxs]``, all or nothing.

        Parameters
        ----------
        ctxs : sequence of TextContext
            Claimed contexts, in the order their single calls would run.
        defer_lookup : bool
            As ``alloc``'s, for every context.

        Returns
        -------
        list of KVTransfer
            One per context, as ``alloc`` returns.

        Raises
        ------
        TypeError, ValueError, RuntimeError, InsufficientBlocksError
            The error the loop would raise at its first failing context, with
            the same message; the manager, the pages' bytes and every context
            are as before the call (spec/manager.md §17.2). Finished transfers
            the call landed first stay landed, as the loop's first ``alloc``
            would have landed them.
        """
        ctxs = self._batch_list("alloc_many", ctxs)
        if not ctxs:
            return []
        reqs, growth = self._batch_check_alloc(ctxs, defer_lookup)
        if self._loads or self._offloads:
            self._drain()  # spec/manager.md §17.2: as the first alloc of the loop; not undone
            growth = None  # (a load may have landed or failed: the exact look below)
        alloc = self.alloc

        def run() -> list[KVTransfer]:
            return [alloc(ctx, defer_lookup=defer_lookup) for ctx in ctxs]

        if (growth is not None and self._growth_fits(growth)) or self._alloc_cannot_fail(ctxs, reqs):
            return run()  # it cannot fail: no copy
        return self._guarded(ctxs, run)

    def step_many(self, ctxs: Sequence[TextContext]) -> None:
        """``for ctx in ctxs: step(ctx)``, all or nothing (spec/manager.md §17).

        Raises
        ------
        TypeError, ValueError
            The error the loop would raise at its first failing context (a bad
            or unclaimed context, ``processed_length`` past the rows); nothing
            changed. A user clock is read once for the whole batch.
        """
        ctxs = self._batch_list("step_many", ctxs)
        if not ctxs:
            return
        self._check_open("step")
        guarded = False
        page, requests, paged = self._page, self._requests, self._paged_ids
        (anchor,) = paged if len(paged) == 1 else (None,)
        for ctx in ctxs:
            req = requests.get(ctx.request_id) if type(ctx) is TextContext else None
            if req is None or req.ctx is not ctx or req.load is not None:
                req = self._find_req("step", ctx)
                guarded = True  # an adoption, or a load of its own polled by the step
            rows = req.rows
            if anchor is not None and ctx._processed <= len(rows[anchor]) * page:
                continue  # the rows cover the forward (one paged leaf: its row)
            if not req.settled and req.dummy:
                continue
            cap = min([len(rows[lid]) for lid in paged]) * page
            if ctx._processed > cap:
                raise ValueError(
                    f"step: processed_length={ctx.processed_length} > {cap} tokens in the allocated rows; "
                    "alloc must be called before the forward"
                )
        with self._clock_held:  # spec/manager.md §17.1: one clock reading, checked before any change
            if guarded:
                self._guarded(ctxs, lambda: self._step_each(ctxs))
            else:
                self._step_each(ctxs)

    def _step_each(self, ctxs: list) -> None:
        step = self.step
        for ctx in ctxs:
            step(ctx)

    def release_many(self, ctxs: Sequence[TextContext | str]) -> None:
        """``for ctx in ctxs: release(ctx)``, all or nothing (spec/manager.md §17).

        Raises
        ------
        TypeError
            An element neither a TextContext nor a str.
        ValueError
            An element not claimed, also the second of two naming the same
            request (the loop's second release would refuse it); nothing changed.
        """
        ctxs = self._batch_list("release_many", ctxs)
        if not ctxs:
            return
        self._check_open("release")
        seen = set()
        for ctx in ctxs:
            rid = ctx if isinstance(ctx, str) else self._ctx("release", ctx).request_id
            if rid in seen:
                raise ValueError(f"release: request_id={rid!r} is not claimed, so it holds no pages; call claim first")
            self._find_req("release", ctx, allow_id=True)
            seen.add(rid)
        release = self.release
        with self._clock_held:  # spec/manager.md §17.1: one clock reading, checked before any change
            for ctx in ctxs:
                release(ctx)

    # ================================================================== checks (nothing changes)

    @staticmethod
    def _batch_list(op: str, ctxs) -> list:
        if isinstance(ctxs, (str, bytes, TextContext)) or not hasattr(ctxs, "__iter__"):
            raise TypeError(f"{op}: ctxs={ctxs!r}, must be a sequence of TextContext")
        return ctxs if type(ctxs) is list else list(ctxs)

    def _batch_check_alloc(self, ctxs: list, defer_lookup) -> tuple[list[_Request], list[int] | None]:
        """Every argument check of ``alloc`` for every context, in the loop's order (each depends
        only on the state before the batch: an earlier alloc of the batch cannot make a later one's
        arguments wrong, spec/manager.md §17.2). A claimed context of its own record, within
        ``max_seq_len``, without drafts and not rewinding passes in one look; any other goes
        through ``alloc``'s own checks, which raise its error. Returns the records and the quick
        growth bound per replica (None: the exact look of ``_alloc_cannot_fail`` decides)."""
        op = "alloc"
        self._check_open(op)
        if not isinstance(defer_lookup, bool):
            raise TypeError(f"alloc: defer_lookup={defer_lookup!r}, must be a bool")
        requests, page, longest = self._requests, self._page, self._max_seq_len
        reqs = []
        # the quick bound: every context is a settled running request of its own record, so its
        # paged rows cover processed_length and grow by at most active // page + 1 pages
        growth = [0] * self._dp if not self._drafts else None
        for ctx in ctxs:
            req = requests.get(ctx.request_id) if type(ctx) is TextContext else None
            if (req is None or req.ctx is not ctx or ctx._length > longest or ctx._spec_decoding_state is not None
                    or ctx._processed < max(req.committed * page, req.shared_floor)):
                req = self._find_req(op, ctx)
                self._check_len(op, ctx)
                self._check_drafts(op, ctx)
                self._check_no_rewind(op, req, ctx)
                growth = None
            elif growth is not None:
                if req.settled and ctx._processed:
                    growth[req.replica] += ctx._active // page + 1
                else:
                    growth = None
            reqs.append(req)
        if growth is not None and len(set(map(id, ctxs))) != len(ctxs):
            growth = None  # a duplicate: the exact look
        return reqs, growth

    def _growth_fits(self, growth: list[int]) -> bool:
        """Whether ``growth[r]`` pages on every paged leaf of replica ``r`` (and two per request on
        a state leaf: its live page and a successor, bounded by the same count) fit its free pages."""
        for r, n in enumerate(growth):
            if not n:
                continue
            if self._slabs:
                if self._slabs[r].shortfall({leaf.leaf_id: n for leaf in self._leaves}, None) is not None:
                    return False
            else:
                pools = self._pools[r]
                for leaf in self._leaves:
                    if n > pools[leaf.leaf_id].num_free:
                        return False
        return True

    def _alloc_cannot_fail(self, ctxs: list, reqs: list[_Request]) -> bool:
        """Whether the loop of ``alloc`` over ``ctxs`` surely raises nothing (so it runs unguarded):
        no replacement context, no duplicate, no load of its own, no connector stage, and per
        replica and leaf the pages the batch can draw fit the free ones (an admission's at most its
        whole row, and a state leaf's checkpoint page; a growing row its growth)."""
        caching, leaves, recurrent = self._caching, self._leaves, self._recurrent_leaves
        required_blocks = self._required_blocks
        demand: dict[int, dict[str, int]] = {}
        if len(set(map(id, ctxs))) != len(ctxs):
            return False  # a duplicate (the records are distinct per context: claim's check)
        for ctx, req in zip(ctxs, reqs):
            if req.ctx is not ctx or req.load is not None:
                return False
            if req.dummy:
                continue
            rows = req.rows
            fresh = caching and ctx._processed == 0 and not any(rows.values())
            if fresh and self._uses_connector:
                return False  # the connector stage: lookups and loads
            required = required_blocks(ctx)
            need = demand.get(req.replica)
            if need is None:
                need = demand[req.replica] = dict.fromkeys(rows, 0)
            for leaf in leaves:
                lid = leaf.leaf_id
                n = leaf.grow_need(0 if fresh else len(rows[lid]), required, caching)
                if fresh and leaf in recurrent:
                    n += 1  # the checkpoint page the hit takes
                if n > 0:
                    need[lid] += n
        for r, need in demand.items():
            need = {lid: n for lid, n in need.items() if n}
            if self._slabs:
                if need and self._slabs[r].shortfall(need, None) is not None:
                    return False
            else:
                pools = self._pools[r]
                for lid, n in need.items():
                    if n > pools[lid].num_free:
                        return False
        return True

    # ================================================================== the guarded run

    def _guarded(self, ctxs: list, run):
        """``run()`` with the bookkeeping copied and the bytes journaled; on any exception both are
        put back (and loads the run posted are waited for first, so none lands later) and the
        exception re-raised (spec/manager.md §17.3)."""
        # kept by identity: the manager (its pools' eviction callbacks are its bound methods), its
        # configuration and collaborators, the contexts (their fields are saved below), the handles
        memo = {id(self): self, id(self._params): self._params, id(self._engine): self._engine,
                id(self._clock): self._clock}
        if self._connector is not None:
            memo[id(self._connector)] = self._connector
        for leaf in self._leaves:
            memo[id(leaf)] = leaf
        for ctx in ctxs:
            if isinstance(ctx, TextContext):
                memo[id(ctx)] = ctx
        for req in self._requests.values():
            memo[id(req.ctx)] = req.ctx
            if req.load is not None:
                memo[id(req.load.handle)] = req.load.handle
        for load in self._loads:
            memo[id(load.handle)] = load.handle
        for off in self._offloads:
            memo[id(off.handle)] = off.handle
        vars_ = vars(self)
        saved = copy.deepcopy({k: vars_[k] for k in _BATCH_STATE if k in vars_}, memo)
        contexts = {id(c): (c, [getattr(c, f) for f in _CTX_FIELDS])
                    for c in [*ctxs, *(q.ctx for q in self._requests.values())] if isinstance(c, TextContext)}
        posted = {id(load) for load in self._loads}
        self._journal = []
        try:
            return run()
        except BaseException:
            for load in self._loads:  # a load this run posted writes into pages given back below
                if id(load) not in posted:
                    try:
                        load.handle.synchronize()
                    except Exception:  # noqa: BLE001
                        pass  # a failed load wrote what it wrote: its pages' bytes are put back below
            for store, ids, data in reversed(self._journal):
                store.write(ids, data)
            vars_.update(saved)
            for c, values in contexts.values():
                for f, v in zip(_CTX_FIELDS, values):
                    setattr(c, f, v)
            raise
        finally:
            self._journal = None

    def _journal_pages(self, store, ids) -> None:
        """Before a guarded batch writes pages ``ids`` of ``store``: their bytes, to put back."""
        ids = [int(i) for i in ids]
        if ids:
            self._journal.append((store, ids, np.array(store.read(ids), copy=True)))
