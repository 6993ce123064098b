"""Transfers: the external stage of an admission, the tiers for every leaf kind, deferred
lookups, and the loads and offloads in flight (spec/manager.md §9, §7.4).

The methods of ``PagedKVCacheManager`` (``kvref/_manager.py``) that talk to the
connector: the lookup and the load of an admission (spec/manager.md §9.3), the
per-leaf keys and unit ids of a hybrid manager (spec/manager.md §9.8),
``start_lookup`` and its companions (spec/manager.md §9.4), the drain of
finished transfers (spec/manager.md §9.2), the post of queued offloads,
``poll_transfers`` and ``shutdown`` (spec/manager.md §9.7).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from kvspec._config import is_int as _is_int
from kvspec._connector import leaf_block_key
from kvspec._manager_types import TextContext
from kvspec._page_store import BookkeepingPageStore, LeafUnitStore, ScaledPageStore
from kvspec.errors import InsufficientBlocksError, KVLoadFailed, KVLoadRefused

from ._leaves import ExtendedResidency, joint_hit
from ._request import _Load, _Offload, _Request

__all__ = ["Transfers"]


class _AwaitOffloads(Exception):
    """spec/manager.md §4 step 6: the sizing fits once the replica's in-flight offloads complete
    (raised by the check, caught by ``alloc``, which waits and sizes again; never escapes)."""

    def __init__(self, replica: int, message: str):
        super().__init__(message)
        self.replica = replica


def _drop_pins(pins: Counter, keys) -> None:
    """One pin less on each of ``keys``; a key at 0 leaves ``pins`` (``dict.__delitem__``: Counter's
    own ``__delitem__`` is Python code)."""
    for key in keys:
        n = pins[key] - 1
        if n:
            pins[key] = n
        else:
            dict.__delitem__(pins, key)


class Transfers:
    """The connector half of the policy, mixed into ``PagedKVCacheManager`` (its state)."""

    def _external_stage_due(self, req: _Request, ctx: TextContext) -> bool:
        return (
            self._uses_connector
            and req.ext_point
            and not req.skip_connector
            and ctx.processed_length == req.committed * self._page
            and req.committed < len(req.hashes)
        )

    def _splice_load(self, req: _Request, ctx: TextContext, load: _Load, done: bool) -> None:
        """spec/manager.md §9.3: the posted load's blocks join the hit; published now if complete, else pinned."""
        n, page, m = load.blocks, self._page, self._metrics
        ctx.skip_processing(n * page)
        req.committed = load.start + n
        ctx.cached_prefix_length = (load.start + n) * page
        ctx.cached_prefix_external_length = n * page
        m.cache_tokens += n * page
        m.external_blocks_served += n
        if done:
            load.state = "landed"
            self._publish_loaded(load)
            return
        if load.leaf_pages is not None:
            self._pin_leaves(load.replica, load.leaf_pages)  # spec/manager.md §9.8
        pool = self._pools[load.replica][self._conn_leaf]
        for b in load.pages:
            pool.touch(b)
            self._pins[load.replica][b] += 1
        req.load = load
        req.stepped_during_load = False
        self._loads.append(load)

    def _lookup(self, op: str, r: int, hashes: list[bytes], tokens: np.ndarray, k: int) -> int:
        """The connector's answer for the blocks after ``k`` (``TypeError`` unless an int >= 0); with
        several leaves, the joint hit over device and tiers past ``k`` (spec/manager.md §9.8)."""
        if not self._simple:
            return self._tier_hit(op, r, hashes, tokens, k, len(hashes)) - k
        toks = np.array(tokens[k * self._page : len(hashes) * self._page], dtype=np.int32)
        n = self._connector.lookup(hashes[k:], toks.reshape(-1, self._page), r)
        if not _is_int(n) or n < 0:
            raise TypeError(f"{op}: connector.lookup returned {n!r}, must be an int >= 0")
        return int(n)

    def _publish_loaded(self, load: _Load) -> None:
        """Publish a landed load's pages; swap a live request to an existing twin."""
        if load.leaf_pages is not None:
            self._publish_leaf_load(load)  # spec/manager.md §9.8
            return
        pool = self._pools[load.replica][self._conn_leaf]
        req = self._requests.get(load.request_id) if load.request_id is not None else None
        row = req.rows[self._conn_leaf] if req is not None else None
        for j, b in enumerate(load.pages):
            h = load.hashes[j]
            if row is not None and row[load.start + j] == b:
                kept = row[load.start + j] = self._publish_or_twin(pool, b, h, load.tokens[j])
            else:
                kept = pool.publish(b, h, load.tokens[j])
            # spec/manager.md §5.1: the next page joins the index only under a published parent
            # (the device hit's last page, then the load's pages): the chain stops at a collision.
            if pool.block_hash[kept] != h:
                break

    def _unpin(self, r: int, pages: list[int], leaf_pages: dict[str, list[int]] | None = None) -> None:
        if leaf_pages:
            self._unpin_leaves(r, leaf_pages)  # spec/manager.md §9.8
        _drop_pins(self._pins[r], pages)
        self._pools[r][self._conn_leaf].free(pages[::-1])  # spec/manager.md §9.2: tail first

    def _undo_failed_load(self, req: _Request, ctx: TextContext) -> None:
        """spec/manager.md §9.6: re-take only the device hit after a load failed post-splice."""
        load = req.load
        n = load.blocks
        ctx.rewind_processing(n * self._page)
        req.committed = load.start
        ctx.cached_prefix_length = load.start * self._page
        ctx.cached_prefix_external_length = 0
        self._metrics.cache_tokens -= n * self._page
        self._metrics.external_blocks_served -= n
        req.load = None

    # ================================================================== tiers for every leaf kind

    def _leaf_unit_stores(self, stores: list) -> list:
        """spec/tiers.md §12: one ``LeafUnitStore`` per replica over every leaf's pages (the
        connector leaf's ``stores[r]`` first), or a ``BookkeepingPageStore`` of as many units."""
        order = self._unit_order
        if self._holds_bytes:
            out = []
            for r in range(self._dp):
                per = [stores[r]]
                for leaf in order[1:]:
                    values = self._page_store(r, leaf.leaf_id)
                    scales = self._scales[r].get(leaf.leaf_id)  # paged leaves only
                    per.append(ScaledPageStore(values, self._engine.page_store(scales))
                               if scales is not None else values)
                out.append(LeafUnitStore(per))
            units, bases = out[0].units, out[0].bases
        else:
            unit = stores[0].page_nbytes
            units = [1] + [leaf.tier_units(self._params, unit) for leaf in order[1:]]
            bases = [0]
            for leaf, u in zip(order, units):
                bases.append(bases[-1] + self._leaf_pages(leaf) * u)
            out = [BookkeepingPageStore(bases.pop(), unit) for _ in range(self._dp)]
        self._units = {leaf.leaf_id: u for leaf, u in zip(order, units)}
        self._unit_base = {leaf.leaf_id: b for leaf, b in zip(order, bases)}
        return out

    def _leaf_keys(self, lid: str, h: bytes) -> list[bytes]:
        """spec/tiers.md §12: the tier keys of leaf ``lid``'s page of block hash ``h``, one per unit."""
        if lid == self._plain_leaf:
            return [h]
        tag, algo = self._leaf[lid].tier_tag, self._params.hash_algo
        return [leaf_block_key(h, tag, j, algo) for j in range(self._units[lid])]

    def _leaf_unit_ids(self, lid: str, page: int) -> list[int]:
        """spec/tiers.md §12: the unit ids of leaf ``lid``'s page in the connector's store."""
        u = self._units[lid]
        first = self._unit_base[lid] + page * u
        return list(range(first, first + u))

    def _unit_args(self, items, hashes: list[bytes], tokens: np.ndarray, first: int):
        """``(unit ids, keys, int32 tokens [n_units, page])`` of ``items`` = ``[(leaf_id, block, page)]``;
        block ``i``'s hash is ``hashes[i - first]`` and its tokens ``tokens[i - first]``."""
        ids, keys, rows = [], [], []
        for lid, i, b in items:
            us = self._leaf_unit_ids(lid, b)
            ids += us
            keys += self._leaf_keys(lid, hashes[i - first])
            rows += [i - first] * len(us)
        toks = np.asarray(tokens, dtype=np.int32).reshape(-1, self._page)[rows] if rows else \
            np.zeros((0, self._page), np.int32)
        return ids, keys, toks

    def _asked(self, op: str, r: int, keys: list[bytes], toks: np.ndarray) -> int:
        """``connector.lookup`` with its answer checked (``TypeError`` unless an int >= 0)."""
        n = self._connector.lookup(keys, toks, r)
        if not _is_int(n) or n < 0:
            raise TypeError(f"{op}: connector.lookup returned {n!r}, must be an int >= 0")
        return int(n)

    def _tier_hit(self, op: str, r: int, hashes: list[bytes], tokens, k: int, cap: int) -> int:
        """spec/manager.md §9.8: the joint hit ``k' >= k`` over the blocks the request holds
        (below ``k``) and the blocks the tiers hold (every unit of the leaf's page, tokens equal)."""
        if cap <= k:
            return k
        page = self._page

        def block_tokens(i: int) -> np.ndarray:
            return np.asarray(tokens[i * page : (i + 1) * page], dtype=np.int32)

        def asker(lid: str):
            def ask(i: int) -> bool:
                keys = self._leaf_keys(lid, hashes[i])
                return self._asked(op, r, keys, np.repeat(block_tokens(i)[None], len(keys), 0)) >= len(keys)
            return ask

        def run_from(k0: int, k1: int) -> int:  # the plain leaf: one batched lookup of its run
            toks = np.asarray(tokens[k0 * page : k1 * page], dtype=np.int32).reshape(k1 - k0, page)
            return min(self._asked(op, r, hashes[k0:k1], toks), k1 - k0)

        resident = {leaf.leaf_id: ExtendedResidency(k, asker(leaf.leaf_id),
                                                    run_from if leaf.leaf_id == self._plain_leaf else None)
                    for leaf in self._leaves}
        return max(k, joint_hit(self._leaves, cap, resident))

    def _plan_leaf_load(self, req, ctx, plan, k, processed, hashes, touched, pops) -> None:
        """spec/manager.md §9.8: ``_plan_load`` for a manager with several leaves: the joint hit over
        device and tiers, then one load of each leaf's missing blocks (full: all of them; sliding: the
        window's; recurrent: the checkpoint at the hit, into the successor page)."""
        r, page = req.replica, self._page
        cap = k + min(len(hashes) - k, (ctx.current_position - processed - 1) // page)
        if req.lookup is not None and req.lookup[0] == k and k + req.lookup[1] <= cap:
            k2 = k + req.lookup[1]  # the held answer is the joint hit (start_lookup)
        elif req.lookup is not None:
            start, held = req.lookup
            k2 = self._tier_hit("alloc", r, hashes, ctx.tokens, k, min(cap, start + held) if start <= k else k)
        else:
            k2 = self._tier_hit("alloc", r, hashes, ctx.tokens, k, cap)
        if k2 <= k:
            return
        # spec/manager.md §9.8: the load goes into the rows as the sizing will leave them; the pages it
        # draws are predicted (one joint peek of the slab), so the load is posted before anything changes.
        drawn = self._peek_sizing(r, plan.need, touched) if any(plan.need.values()) else {}
        items, leaf_pages, leaf_blocks = [], {}, {}
        for leaf in self._leaves:
            lid = leaf.leaf_id
            blocks = leaf.needed_blocks(k, k2)
            row = plan.rows[lid] if lid in plan.rows else req.rows[lid]
            if drawn.get(lid):
                row = self._sized_row(row, drawn[lid])
            dest = leaf.load_destinations(row, blocks)
            leaf_pages[lid], leaf_blocks[lid] = dest, blocks
            items += [(lid, i, b) for i, b in zip(blocks, dest)]
        toks = np.array(ctx.tokens[k * page : k2 * page], dtype=np.int32).reshape(k2 - k, page)
        ids, keys, utoks = self._unit_args(items, hashes[k:k2], toks, k)
        if self._journal is not None and self._holds_bytes:
            self._journal_pages(self._conn_stores[r], ids)  # spec/manager.md §17.3
        try:
            handle = self._connector.load(ids, keys, utoks, r)
            done = handle.is_complete()
        except KVLoadRefused:
            return  # spec/manager.md §9.3: a clean miss (the connector counts it)
        except KVLoadFailed:
            plan.load_failed = True  # spec/manager.md §9.3: a miss at the device hit, skip the connector
            return
        plan.load = _Load(r, ctx.request_id, k, [], list(hashes[k:k2]), toks, handle,
                          leaf_pages=leaf_pages, leaf_blocks=leaf_blocks, nblocks=k2 - k)
        plan.load_done = done
        plan.drawn = drawn or None

    def _peek_sizing(self, r: int, need: dict[str, int], touched: dict[str, set[int]]) -> dict[str, list[int]]:
        """The pages the sizing will draw for each leaf (spec/manager.md §4.6: leaf order, after the hit's
        pages in ``touched`` were taken), changing nothing: one joint peek of the replica's slab
        (a draw of one leaf may claim a huge block another leaf's pages are in), or each leaf's
        own pool's ``peek``."""
        wants = {leaf.leaf_id: need[leaf.leaf_id] for leaf in self._leaves if need.get(leaf.leaf_id)}
        if self._slabs:
            return self._slabs[r].peek(wants, touched)
        pools = self._pools[r]
        return {lid: pools[lid].peek(n, skip=touched.get(lid, ())) for lid, n in wants.items()}

    def _pin_leaves(self, r: int, leaf_pages: dict[str, list[int]]) -> None:
        pins = self._leaf_pins[r]
        for lid, pages in leaf_pages.items():
            pool = self._pools[r][lid]
            for b in pages:
                pool.touch(b)
                pins[(lid, b)] += 1

    def _unpin_leaves(self, r: int, leaf_pages: dict[str, list[int]]) -> None:
        pins = self._leaf_pins[r]
        for lid, pages in leaf_pages.items():
            _drop_pins(pins, [(lid, b) for b in pages])
            self._pools[r][lid].free(pages[::-1])  # spec/manager.md §9.2: tail first

    def _publish_leaf_load(self, load: _Load) -> None:
        """spec/manager.md §9.8: a landed load's full/sliding pages are published (twin dedup, the chain
        stops at a collision); a recurrent checkpoint loaded into the successor becomes the live state."""
        req = self._requests.get(load.request_id) if load.request_id is not None else None
        for lid, pages in load.leaf_pages.items():
            leaf, pool = self._leaf[lid], self._pools[load.replica][lid]
            leaf.land_load(pool, req.rows[lid] if req is not None else None, load, pages, self._publish_or_twin)

    def _call_offload(self, r: int, ids: list[int], keys: list[bytes], toks: np.ndarray):
        """``connector.offload(ids, keys, toks, r)`` and whether its handle is complete already;
        a raise of the call or of the handle counts the blocks in
        ``connector_offload_blocks_dropped`` and completes it (spec/manager.md §9.2)."""
        try:
            handle = self._connector.offload(ids, keys, toks, r)
            return handle, handle.is_complete()
        except Exception:
            self._metrics.connector_offload_blocks_dropped += len(ids)
            return None, True

    def _post_leaf_offload(self, r: int, hashes: list[bytes], toks: np.ndarray) -> None:
        """spec/manager.md §9.8: offload one committed run of every leaf: the full leaf's run up to
        its first evicted hash, each sliding page and recurrent checkpoint still published."""
        pools, items, leaf_pages = self._pools[r], [], {}
        flat = toks.reshape(-1)
        for leaf in self._leaves:
            lid, pool = leaf.leaf_id, pools[leaf.leaf_id]
            found = leaf.published_pages(pool, hashes, toks, flat)
            if found:
                leaf_pages[lid] = [b for _, b in found]
                items += [(lid, j, b) for j, b in found]
        if not items:
            return
        self._pin_leaves(r, leaf_pages)
        ids, keys, utoks = self._unit_args(items, hashes, toks, 0)
        handle, done = self._call_offload(r, ids, keys, utoks)
        if done:
            self._unpin_leaves(r, leaf_pages)
        else:
            self._offloads.append(_Offload(r, [], handle, leaf_pages))

    def _tier_touch(self, r: int, hashes: list[bytes]) -> None:
        """``connector.touch`` of a root-anchored run: with several leaves, every leaf's keys of it
        (spec/tiers.md §12), each leaf's run root-anchored."""
        if self._simple:
            self._connector.touch(hashes, r)
            return
        keys = []
        for leaf in self._leaves:
            for h in hashes:
                keys += self._leaf_keys(leaf.leaf_id, h)
        self._connector.touch(keys, r)

    def _tier_retain(self, r: int, hashes: list[bytes], ctx: TextContext) -> None:
        """The request's retention claim on its committed run in the tiers (spec/tiers.md §3.1),
        when the connector takes claims (``set_retention`` is optional in ``KVConnector``)."""
        set_retention = getattr(self._connector, "set_retention", None)
        if set_retention is None:
            return
        keys = hashes if self._simple else [k for leaf in self._leaves for h in hashes
                                             for k in self._leaf_keys(leaf.leaf_id, h)]
        set_retention(keys, ctx._retention_priority, ctx._retention_seconds, r)

    # ================================================================== deferred lookups

    def starts_lookup(self, ctx: TextContext) -> bool:
        """Whether ``start_lookup(ctx)`` would ask the connector now (asks nothing).

        True when the connector is in use for the request, no lookup is
        outstanding, the request is fresh (no pages, nothing processed) or
        awaits its lookup after ``alloc(ctx, defer_lookup=True)``, and the
        device hit leaves hashed blocks the connector might hold.

        Raises
        ------
        TypeError, ValueError
            Not a TextContext; not claimed. State is unchanged.
        """
        req = self._req("starts_lookup", ctx)
        return self._lookup_point(req, ctx) is not None

    def _lookup_point(self, req: _Request, ctx: TextContext) -> int | None:
        """The first block a lookup would ask for, or None."""
        if not self._uses_connector or req.dummy or req.skip_connector or req.lookup is not None:
            return None
        if req.lookup_pending and self._external_stage_due(req, ctx):
            return req.committed
        if self._at_reuse_point(req, ctx):
            hashes = self._hashes_for(ctx, req.hashes)
            cap = min(len(hashes), (ctx.active_length - 1) // self._page)
            _, reach = self._device_hit(req.replica, hashes, ctx.tokens, cap)
            return reach if reach < cap else None
        return None

    def start_lookup(self, ctx: TextContext) -> bool:
        """Ask the connector how many blocks after the device hit it holds.

        Reserves and pins nothing; the next ``alloc`` uses the answer (and may
        still see the load refused).

        Returns
        -------
        bool
            Whether a lookup was started (``starts_lookup(ctx)`` was true).

        Raises
        ------
        TypeError, ValueError
            Not a TextContext; not claimed; ``TypeError`` for a connector
            answer that is not an int >= 0. State is unchanged.
        """
        self._check_open("start_lookup")
        req = self._req("start_lookup", ctx)
        k = self._lookup_point(req, ctx)
        if k is None:
            return False
        hashes = self._hashes_for(ctx, req.hashes)
        n = self._lookup("start_lookup", req.replica, hashes, ctx.tokens, k)  # one answer check (spec/manager.md §9.4)
        req.hashes = hashes
        req.lookup = (k, n)
        return True

    def awaits_lookup(self, ctx: TextContext) -> bool:
        """Whether a started lookup is outstanding (not yet used by ``alloc`` or handed back).

        Raises ``TypeError`` / ``ValueError`` for a bad or unclaimed ctx.
        """
        return self._req("awaits_lookup", ctx).lookup is not None

    def hand_back_lookup(self, ctx: TextContext) -> bool:
        """Drop the request's lookup (always safe); returns whether one existed.

        The request keeps the pages it holds and loads nothing externally for
        this admission. Raises ``TypeError`` / ``ValueError`` for a bad or
        unclaimed ctx.
        """
        self._check_open("hand_back_lookup")
        req = self._req("hand_back_lookup", ctx)
        had = req.lookup is not None or req.lookup_pending
        req.lookup, req.lookup_pending = None, False
        if had:
            req.ext_point = False
        return had

    # ================================================================== transfers

    def _poll_load(self, load: _Load) -> list[BaseException]:
        """Poll one pending load; land or fail it. Returns unexpected errors."""
        try:
            done = load.handle.is_complete()
        except KVLoadFailed as e:
            self._fail_load(load, e)
            return []
        except Exception as e:  # spec/manager.md §9.6: other errors propagate after unpinning
            self._fail_load(load, e, count=False)
            return [e]
        if done:
            load.state = "landed"
            self._publish_loaded(load)
            self._unpin(load.replica, load.pages, load.leaf_pages)
            self._loads.remove(load)
            req = self._requests.get(load.request_id) if load.request_id else None
            if req is not None and req.load is load:
                req.load = None  # landed: commits resume at the next step
        return []

    def _fail_load(self, load: _Load, err: BaseException, count: bool = True) -> None:
        load.state, load.error = "failed", err
        self._unpin(load.replica, load.pages, load.leaf_pages)
        self._loads.remove(load)
        if count:
            self._metrics.connector_load_failures += 1
        req = self._requests.get(load.request_id) if load.request_id else None
        if req is not None and req.load is load:
            req.skip_connector = True
            if req.stepped_during_load:
                req.ran_past = True

    def _offload_only_pages(self, r: int, lid: str) -> set[int]:
        """Pages of leaf ``lid`` of replica ``r`` that only in-flight offloads hold: free or evictable
        once those complete. O(pages of the replica's rows); only a short sizing asks."""
        def of(t) -> list[int]:  # a transfer's pages of leaf lid (spec/manager.md §9.8: per leaf)
            if t.leaf_pages is not None:
                return t.leaf_pages.get(lid, [])
            return t.pages if lid == self._conn_leaf else []

        pages = {b for off in self._offloads if off.replica == r for b in of(off)}
        for ld in self._loads:
            if ld.replica == r:
                pages.difference_update(of(ld))
        for q in self._requests.values():
            if q.replica == r and not q.dummy:
                pages.difference_update(q.rows[lid])
                if q.load is not None:
                    pages.difference_update(of(q.load))
        return pages

    def _settle_offloads(self, wait: _AwaitOffloads) -> None:
        """spec/manager.md §4 step 6: wait (``synchronize``) for replica ``wait.replica``'s in-flight
        offloads, then drain: their sources are unpinned. A handle that still reports incomplete
        after ``synchronize`` (a connector bug) ends in ``InsufficientBlocksError``, not a retry loop."""
        r = wait.replica
        waiting = [off for off in self._offloads if off.replica == r]
        for off in waiting:
            try:
                off.handle.synchronize()
            except Exception:  # the drain sees it through is_complete and counts the drop (spec/manager.md §9.2)
                continue
        self._drain(full=True)
        if all(off in self._offloads for off in waiting):
            raise InsufficientBlocksError(str(wait)) from None

    def _drain(self, *, full: bool = False) -> None:
        """Land finished loads, unpin finished offloads; never blocks. ``full``: poll every
        in-flight offload even when the connector's completion count did not change (after a
        ``synchronize``, whose waiter may return before the count moves)."""
        errors = []
        for load in list(self._loads) if self._loads else ():
            errors += self._poll_load(load)
        offloads = self._offloads
        if offloads and self._completions is not None and not full:
            seen = self._completions()  # read before polling: a later completion changes it
            if seen == self._completions_seen:
                offloads = ()  # no handle of the connector became complete since the last poll
            self._completions_seen = seen
        for off in list(offloads):
            try:
                done = off.handle.is_complete()
            except Exception:
                self._metrics.connector_offload_blocks_dropped += len(off.pages) + sum(
                    map(len, (off.leaf_pages or {}).values()))
                done = True
            if done:
                self._unpin(off.replica, off.pages, off.leaf_pages)
                self._offloads.remove(off)
        if errors:
            raise errors[0]

    def _post_offloads(self) -> None:
        """Post queued offload runs, truncated at the first evicted hash (spec/manager.md §9.2): with
        one full leaf, the surviving runs of a replica go out in one ``connector.offload`` (queue
        order), each run keeping its own record of pins on the shared handle."""
        for r in range(self._dp):
            queue, self._offload_queue[r] = self._offload_queue[r], []
            if not queue:
                continue
            if not self._simple:
                for hashes, toks in queue:
                    self._post_leaf_offload(r, hashes, toks)  # spec/manager.md §9.8: every leaf
                continue
            pool = self._pools[r][self._conn_leaf]
            runs = []
            for hashes, toks in queue:
                # one batched lookup: the run's pages, up to the first evicted hash
                pages = pool.lookup_run(hashes, toks.reshape(-1))
                if pages:
                    n = len(pages)
                    pool.touch_many(pages)
                    self._pins[r].update(pages)  # one pin per page per run
                    runs.append((pages, hashes[:n], toks[:n]))
            if not runs:
                continue
            if len(runs) == 1:
                ids, hs, toks = runs[0]
            else:
                ids = [b for pages, _, _ in runs for b in pages]
                hs = [h for _, run_hashes, _ in runs for h in run_hashes]
                toks = np.concatenate([t for _, _, t in runs])
            handle, done = self._call_offload(r, ids, hs, toks)
            for pages, _, _ in runs:  # unpinned run by run, each tail first, when the handle completes
                if done:
                    self._unpin(r, pages)
                else:
                    self._offloads.append(_Offload(r, pages, handle))

    def poll_transfers(self) -> None:
        """Post queued offloads and land or retire finished transfers; never blocks.

        Landed loads are published and unpinned; failed loads are unpinned
        unpublished (``connector_load_failures``); complete offloads unpin
        their sources.

        Raises
        ------
        Exception
            An unexpected error of a load handle, after its pages were
            unpinned unpublished.
        """
        self._check_open("poll_transfers")
        self._connector.poll_transfers()
        self._post_offloads()
        self._drain(full=True)

    def pending_transfers_exist(self, replica_idx: int = 0) -> bool:
        """Whether anything of the replica is pinned by an unfinished transfer.

        Raises ``TypeError`` / ``IndexError`` for a bad ``replica_idx``.
        """
        r = self._replica("pending_transfers_exist", replica_idx)
        return bool(self._pins[r]) or bool(self._leaf_pins[r])

    def shutdown(self) -> None:
        """Post queued offloads, wait for every transfer, close the connector.

        Failed loads are handled as in ``poll_transfers``; the connector is
        shut down even if a transfer raised unexpectedly (which then propagates).
        Afterwards the manager is closed (spec/manager.md §9.7): every call
        that would change state raises ``RuntimeError``; queries still answer;
        a second ``shutdown`` does nothing.
        """
        if self._closed:
            return
        self._closed = True
        self._post_offloads()
        for t in list(self._loads) + list(self._offloads):
            try:
                t.handle.synchronize()
            except Exception:
                pass  # _drain sees the failure through is_complete
        try:
            self._drain(full=True)
        finally:
            self._connector.shutdown()
