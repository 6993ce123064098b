"""``alloc``: the admission and growth of a request (spec/manager.md §4).

Validate, plan (the splice of the prefix hit, the sizing of every leaf, the external stage),
then commit: the methods of ``PagedKVCacheManager`` (``kvref/_manager.py``) that give a request
the pages its next forward needs, with padding rows (``alloc_dummy``, spec/manager.md §7.2).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvspec._manager_types import (
    CompletedTransfer,
    KVTransfer,
    TextContext,
)
from kvspec.engine import NULL_BLOCK
from kvspec.errors import InsufficientBlocksError, KVLoadFailed, KVLoadRefused, insufficient_blocks_message

from ._leaves import Leaf
from ._request import _AllocPlan, _Load, _Request
from ._transfers import _AwaitOffloads

__all__ = ["Allocation"]

#: ``alloc``'s result when nothing is in flight (immutable, shared).
_DONE = CompletedTransfer()


class Allocation:
    """The ``alloc`` half of the policy, mixed into ``PagedKVCacheManager`` (its state)."""

    def alloc(self, ctx: TextContext, *, defer_lookup: bool = False) -> KVTransfer:
        """Give the request the pages its next forward needs, reusing a cached prefix.

        Drains finished transfers first. At the reuse point (the request holds
        no pages and ``processed_length == 0``) the joint device hit is spliced
        in (``ctx.skip_processing``), then every row grows to exactly
        ``ceil(current_position / page_size)`` blocks (with speculative
        decoding ``ceil(seq_len / page_size)``, MAX's draft slack included, and
        a speculating row past it shrinks: spec/manager.md §15), then the
        external stage may load more blocks from the connector into the fresh pages.

        Parameters
        ----------
        ctx : TextContext
            A claimed context.
        defer_lookup : bool
            Do only the device part; when the connector might hold more the
            request awaits ``start_lookup`` and the next ``alloc``.

        Returns
        -------
        KVTransfer
            ``CompletedTransfer()`` or the in-flight load; the forward must
            not run before it completes.

        Raises
        ------
        TypeError, ValueError
            Bad argument, unclaimed, ``len(ctx) > max_seq_len``, a draft list that is
            not a list or is longer than ``num_draft_tokens`` (spec/manager.md §15.4).
        RuntimeError
            A forward ran past a failed load (chained from ``KVLoadFailed``).
        InsufficientBlocksError
            Not enough free or evictable pages: nothing is drawn, the splice
            is rolled back; ctx, counts and metrics are as before.
        """
        req = self._requests.get(ctx.request_id) if type(ctx) is TextContext else None
        if (req is not None and req.ctx is ctx and defer_lookup is False and req.settled
                and not self._closed and len(ctx) <= self._max_seq_len
                and req.rows[self._anchor.leaf_id]
                and ctx._processed >= max(req.committed * self._page, req.shared_floor)):
            # spec/manager.md §4 for a request past its admission (it holds pages, no load, no external
            # stage due): the drain (step 2), the sizing (step 6) and the count (step 9) only.
            if ctx._spec_decoding_state is not None:
                self._check_drafts("alloc", ctx)  # spec/manager.md §15: arguments before the drain
            if self._loads or self._offloads:
                self._drain()
            try:
                with self._clock_held:  # spec/manager.md §14.7: one reading for every pool drawn from
                    return self._grow(req, ctx)
            except _AwaitOffloads as wait:
                self._settle_offloads(wait)
            return self.alloc(ctx)  # spec/manager.md §4 step 6: sized again after the wait
        op = "alloc"
        self._check_open(op)
        # spec/manager.md §4.1: every argument is checked before the stored context may be replaced.
        if not isinstance(defer_lookup, bool):
            raise TypeError(f"alloc: defer_lookup={defer_lookup!r}, must be a bool")
        req = self._req(op, ctx)
        self._check_len(op, ctx)
        self._check_drafts(op, ctx)
        self._check_no_rewind(op, req, ctx)
        if req.dummy:
            return self._size_dummy(req)
        if self._loads or self._offloads:
            self._drain()  # spec/manager.md §9.2: finished transfers land before anything is sized.
        if req.load is not None and req.load.state == "failed" and req.ran_past:
            raise RuntimeError(
                f"alloc: request_id={ctx.request_id!r} ran past a failed load of {req.load.blocks} blocks "
                f"at block {req.load.start}; release it and recompute"
            ) from req.load.error
        try:
            plan = self._plan_alloc(req, ctx, defer_lookup)  # spec/manager.md §4: every check; nothing changes
        except _AwaitOffloads as wait:
            self._settle_offloads(wait)
            return self.alloc(ctx, defer_lookup=defer_lookup)  # spec/manager.md §4 step 6: sized again
        with self._clock_held:  # spec/manager.md §14.7: read and checked once, before the commit
            return self._commit_alloc(req, ctx, plan)  # nothing below can fail

    def _grow(self, req: _Request, ctx: TextContext) -> KVTransfer:
        """spec/manager.md §4.6 and §4.9 for a request that holds pages and has nothing in flight: size
        every leaf, all or nothing, then count the forward's input tokens."""
        pools = self._pools[req.replica]
        required = self._required_blocks(ctx)
        need = []
        for leaf in self._leaves:
            row = req.rows[leaf.leaf_id]
            n = leaf.grow_need(len(row), required, self._caching)
            if n > 0:
                if not self._slabs:  # a slab's leaves are checked jointly, below
                    free = pools[leaf.leaf_id].num_free
                    if n > free:
                        self._raise_short(ctx, req.replica, leaf.leaf_id, n, free)
                need.append((leaf, row, n))
            elif n < 0 and self._drafts:  # (only a paged row can be past its need)
                need.append((leaf, row, n))  # spec/manager.md §15: drafts past the need roll back
        if self._slabs and need:  # nothing to draw (a decode step inside a page): nothing to check
            self._check_slab(ctx, req.replica, {leaf.leaf_id: n for leaf, _, n in need if n > 0}, None)
        for leaf, row, n in need:
            if n < 0:
                self._trim(req, leaf, row, required)
                continue
            pool = pools[leaf.leaf_id]
            if n == 1:
                row.append(pool.allocate_one())
            else:
                row.extend(pool.allocate(n))
            fresh = leaf.fresh_states(row, n)
            if fresh:  # spec/manager.md §4.7: a fresh live state starts at zero
                self._run_copies(req, [("restore", leaf.leaf_id, NULL_BLOCK, b) for b in fresh])
        self._metrics.input_tokens += req.count_forward(ctx.active_length)  # spec/manager.md §4.9
        return _DONE

    def _trim(self, req: _Request, leaf: Leaf, row: list[int], required: int) -> None:
        """spec/manager.md §15: free a speculating row's pages past ``required`` blocks, tail
        first; they lie past ``processed_length``, so they are never published (front of the free list)."""
        self._pools[req.replica][leaf.leaf_id].free(list(reversed(row[required:])))
        del row[required:]

    def _check_slab(self, ctx: TextContext, r: int, need: dict[str, int], taken) -> None:
        """spec/manager.md §13.3: the leaves' new pages come from one slab, so they are checked
        together (MAX's ``can_satisfy_demand``) after the hit pages in ``taken`` left the free lists;
        the message names the first leaf, in leaf order, the huge blocks left cannot serve."""
        short = self._slabs[r].shortfall(need, taken)
        if short is not None:
            lid, n, free = short
            message = insufficient_blocks_message("alloc", ctx.request_id, n, lid, free, r)
            # spec/manager.md §4 step 6: which huge blocks the offloads' pages would park is known only
            # once they land, so with a slab any page only in-flight offloads hold is worth the wait.
            if self._offloads and any(self._offload_only_pages(r, leaf.leaf_id).difference((taken or {}).get(
                    leaf.leaf_id, ())) for leaf in self._leaves):
                raise _AwaitOffloads(r, message)
            raise InsufficientBlocksError(message)

    def _at_reuse_point(self, req: _Request, ctx: TextContext) -> bool:
        # spec/manager.md §3.3: reuse only while the request holds no pages and nothing is processed.
        return self._caching and ctx.processed_length == 0 and not any(req.rows.values())

    def _plan_alloc(self, req: _Request, ctx: TextContext, defer_lookup: bool) -> _AllocPlan:
        """spec/manager.md §4 steps 4-8 decided without changing anything: the splice
        (spec/manager.md §4.5 and §7.3: the peer-held part), the sizing (``InsufficientBlocksError`` here), the
        connector's lookup and the post of the load (spec/manager.md §9.3). Validate first, then commit: no
        snapshot of the pools is ever taken."""
        r, page = req.replica, self._page
        pools = self._pools[r]
        plan = _AllocPlan()
        plan.undo_load = req.load is not None and req.load.state == "failed"
        committed = req.load.start if plan.undo_load else req.committed
        processed = ctx.processed_length - (req.load.blocks * page if plan.undo_load else 0)
        ext_point, hashes = req.ext_point, req.hashes
        touched: dict[str, set[int]] = {}  # leaf -> hit pages the splice takes
        pops: list[int] = []  # pages the peer copies draw, in order (spec/manager.md §7.3)
        if self._at_reuse_point(req, ctx):
            touched = {}
            tokens = ctx._tokens[: ctx._length]  # ctx.tokens without building its read-only view
            hashes = self._hashes_for(ctx, req.hashes)
            cap = min(len(hashes), (ctx.active_length - 1) // page)
            resident = self._resident(r, hashes, tokens)
            local, reach = self._device_hit(r, hashes, tokens, cap, resident)
            k = local
            for leaf in self._leaves:  # spec/manager.md §4.5: each leaf's part of the hit
                pages = leaf.hit_pages(k, resident[leaf.leaf_id])
                leaf.plan_hit(plan, k, pages)
                touched[leaf.leaf_id] = set(pages)
            if reach > local and not self._simple:
                k = self._plan_peer_leaves(ctx, r, plan, touched, resident, hashes, tokens, local, reach)
            elif reach > local:
                # spec/manager.md §7.3: past the local run a block is taken locally (after a hole) or copied
                # from a peer into a fresh page, best effort: a copy needs a free local page.
                pool, row, held = pools[self._conn_leaf], plan.rows[self._conn_leaf], touched[self._conn_leaf]
                free = pool.num_free - pool.count_free(list(held))
                # A copy draws the first free page not held and not drawn before: copies draw in free
                # order, so one peek of the order past the hit's pages serves the walk (a page held
                # later is skipped; each block adds at most one copy or one held page).
                order, at = pool.peek(2 * (reach - local), skip=held), 0
                for i in range(local, reach):
                    h, toks = hashes[i], self._block_tokens(tokens, i)
                    b = pool.lookup(h, toks)
                    if b is not None and b not in pops:  # a page an earlier copy drew was evicted
                        free -= pool.count_free([b])
                        held.add(b)
                    elif free and (src := self._peer_source(r, h, toks)) is not None:
                        while at < len(order) and order[at] in held:
                            at += 1
                        if at < len(order):
                            b, at = order[at], at + 1
                        else:
                            (b,) = pool.peek(1, skip=held.union(pops))
                        plan.peer[i] = src
                        pops.append(b)
                        free -= 1
                    else:
                        break
                    row.append(b)
                    k = i + 1
            plan.splice, plan.local, plan.k, plan.hashes = True, local, k, hashes
            committed, processed, ext_point = k, k * page, True
        # spec/manager.md §4.6: size every leaf, all or nothing; the free count is after the hit took its pages.
        required = self._required_blocks(ctx)
        for leaf in self._leaves:
            lid, pool = leaf.leaf_id, pools[leaf.leaf_id]
            # (a row slot a peer copy fills is None until the sizing draws its page, spec/manager.md §7.3)
            have = len(plan.rows[lid]) - plan.rows[lid].count(None) if lid in plan.rows else len(req.rows[lid])
            n = max(leaf.grow_need(have, required, self._caching), 0)
            if not self._slabs:  # a slab's leaves are checked jointly, below
                free = pool.num_free
                if touched.get(lid):
                    free -= pool.count_free(list(touched[lid]))
                if lid == self._conn_leaf:
                    free -= len(pops)
                if n > free:
                    self._raise_short(ctx, r, lid, n, free, touched.get(lid, ()))
            plan.need[lid] = n
        if self._slabs:
            self._check_slab(ctx, r, plan.need, touched)
        # spec/manager.md §9.3: the external stage, when due; its lookup and the load's post happen here, so a
        # bad answer or an unexpected error of the connector leaves the state as after the drain.
        if (self._uses_connector and ext_point and not req.skip_connector and processed == committed * page
                and committed < len(hashes)):
            if defer_lookup and req.lookup is None:
                plan.lookup_pending = True  # spec/manager.md §9.4: awaits start_lookup and the next alloc
            else:
                plan.ext_ran = True
                (self._plan_load if self._simple else self._plan_leaf_load)(
                    req, ctx, plan, committed, processed, hashes, touched, pops)
        return plan

    def _plan_load(self, req, ctx, plan, k, processed, hashes, touched, pops) -> None:
        """Ask the connector (or use the held lookup) and post the load into the pages the row
        will hold at ``k .. k+n`` (its own, or the first ones the sizing will draw)."""
        r, page = req.replica, self._page
        max_n = min(len(hashes) - k, (ctx.current_position - processed - 1) // page)
        if req.lookup is not None:
            start, held = req.lookup
            n = max(0, start + held - k) if start <= k else 0
        else:
            n = self._lookup("alloc", r, hashes, ctx.tokens, k)
        n = min(n, max_n)
        if n <= 0:
            return
        conn = self._conn_leaf
        row = plan.rows[conn] if conn in plan.rows else req.rows[conn]
        dest = list(row[k : k + n])
        if len(dest) < n:
            fresh = self._pools[r][conn].peek(len(pops) + plan.need[conn], skip=touched.get(conn, ()))[len(pops):]
            dest += fresh[: n - len(dest)]
        toks = np.array(ctx.tokens[k * page : (k + n) * page], dtype=np.int32).reshape(n, page)
        if self._journal is not None and self._holds_bytes:
            self._journal_pages(self._conn_stores[r], dest)  # spec/manager.md §17.3
        try:
            handle = self._connector.load(dest, hashes[k : k + n], toks, r)
            done = handle.is_complete()
        except KVLoadRefused:
            # spec/manager.md §9.3: a refused load is a clean miss; the pages stay the request's.
            # connector_loads_refused is the connector's counter (no double count).
            return
        except KVLoadFailed:
            plan.load_failed = True  # spec/manager.md §9.3: a miss at the device hit, skip the connector
            return
        plan.load = _Load(r, ctx.request_id, k, dest, list(hashes[k : k + n]), toks, handle)
        plan.load_done = done

    def _commit_alloc(self, req: _Request, ctx: TextContext, plan: _AllocPlan) -> KVTransfer:
        """Carry out a plan of ``_plan_alloc``, in the spec's order (spec/manager.md §4)."""
        r, page, m = req.replica, self._page, self._metrics
        pools = self._pools[r]
        if plan.undo_load:
            self._undo_failed_load(req, ctx)
        copies: list[tuple[str, Any, int, int]] = []
        if plan.splice:
            k, local, hashes = plan.k, plan.local, plan.hashes
            for leaf in self._leaves:
                leaf.commit_hit(req, plan, pools[leaf.leaf_id], local)
            for leaf in (self._paged_leaves if k > local and (plan.leaf_peer or not self._simple) else ()):
                # spec/manager.md §7.3 with several leaves: blocks past the local hit held locally
                # are taken; the slots a peer copy fills (None) get the sizing's first pages below.
                row, pool = req.rows[leaf.leaf_id], pools[leaf.leaf_id]
                for i in range(max(local, plan.nulled[leaf.leaf_id]), k):
                    if row[i] is not None:
                        pool.touch(row[i])
            pool, row = pools[self._conn_leaf], req.rows[self._conn_leaf]
            for i in range(local, k) if self._simple else ():  # spec/manager.md §7.3: the peer-held part
                src = plan.peer.get(i)
                if src is None:
                    pool.touch(row[i])
                    continue
                row[i] = pool.allocate_one()  # the page the plan peeked
                pool.publish(row[i], hashes[i], self._block_tokens(ctx.tokens, i))
                copies.append(("peer", src[0], src[1], row[i]))
                m.cross_replica_blocks_copied += 1
                m.cross_replica_bytes_copied += self._params.kv_page_bytes  # spec/manager.md §16: values + scales
            req.hashes, req.committed = hashes, k
            if k:
                ctx.skip_processing(k * page)
            ctx.cached_prefix_length = k * page
            ctx.cached_prefix_external_length = 0
            m.cache_tokens += k * page
            m.device_blocks_served += k
            req.ext_point = True
        if self._drafts:  # spec/manager.md §15: rows past the need (rejected drafts) shrink, tail first
            required = self._required_blocks(ctx)
            for leaf in self._paged_leaves:
                row = req.rows[leaf.leaf_id]
                if len(row) > required:
                    self._trim(req, leaf, row, required)
        for leaf in self._leaves:  # spec/manager.md §4.6: the sizing's pages
            n = plan.need[leaf.leaf_id]
            if not n:
                continue
            row = req.rows[leaf.leaf_id]
            pages = [pools[leaf.leaf_id].allocate_one()] if n == 1 else pools[leaf.leaf_id].allocate(n)
            if plan.drawn is not None and pages != plan.drawn.get(leaf.leaf_id, pages):
                # spec/manager.md §9.8: a load was posted into the predicted pages; any other draw is a bug
                raise AssertionError(f"alloc: leaf {leaf.leaf_id!r} drew pages {pages}, the load went into "
                                     f"{plan.drawn[leaf.leaf_id]}")
            copy = leaf.first_state_copy(row, pages, plan, req)  # spec/manager.md §4.7: a new live state
            if plan.leaf_peer:
                self._fill_peer_slots(req, ctx, leaf, row, pages, plan, copies)
            else:
                row.extend(pages)
            if copy is not None:
                copies.append(copy)
                if copy[0] == "leafpeer":  # spec/manager.md §7.3: a peer's checkpoint into the new live page
                    m.cross_replica_blocks_copied += 1
                    m.cross_replica_bytes_copied += self._params.page_bytes(leaf.leaf_id)
        self._run_copies(req, copies)
        device_hit = req.committed
        if plan.lookup_pending:
            req.lookup_pending = True
        elif plan.ext_ran:
            req.lookup, req.lookup_pending, req.ext_point = None, False, False
            if plan.load_failed:
                self._metrics.connector_load_failures += 1
                req.skip_connector = True
            elif plan.load is not None:
                self._splice_load(req, ctx, plan.load, plan.load_done)
        if self._uses_connector and device_hit and (plan.splice or req.committed > device_hit):
            # spec/manager.md §4.8, spec/tiers.md §3: the device hit is re-ranked after the load
            # ranked the loaded blocks, so the chain's head ends most recent in the tiers.
            self._tier_touch(r, req.hashes[:device_hit])
        transfer: KVTransfer = _DONE
        if req.load is not None and req.load.state == "pending":
            transfer = req.load.handle  # spec/manager.md §4: a repeated alloc returns the load still in flight
        m.input_tokens += req.count_forward(ctx.active_length)  # spec/manager.md §4.9
        return transfer

    @staticmethod
    def _sized_row(row: list, pages: list[int]) -> list[int]:
        """``row`` once the sizing drew ``pages`` into it: the first ones fill the slots peer copies
        take (None, block order, spec/manager.md §7.3), the rest are appended. The commit places
        them so (``_fill_peer_slots``), and a tier load's plan predicts its destinations so
        (spec/manager.md §9.8)."""
        out = list(row)
        holes = [i for i, b in enumerate(out) if b is None]
        for i, b in zip(holes, pages):
            out[i] = b
        return out + list(pages[len(holes):])

    def _fill_peer_slots(self, req, ctx, leaf, row, pages, plan, copies) -> None:
        """spec/manager.md §7.3 with several leaves: ``row`` takes the sizing's ``pages`` as
        ``_sized_row`` places them; each slot a peer copy takes is published locally and copied."""
        lid, pool, m = leaf.leaf_id, self._pools[req.replica][leaf.leaf_id], self._metrics
        holes = [i for i, b in enumerate(row) if b is None]
        row[:] = self._sized_row(row, pages)
        for i in holes:
            b = row[i]
            pool.publish(b, req.hashes[i], self._block_tokens(ctx.tokens, i))
            src_r, src = plan.leaf_peer[(lid, i)]
            copies.append(("leafpeer", (lid, src_r), src, b))
            m.cross_replica_blocks_copied += 1
            m.cross_replica_bytes_copied += self._params.kv_page_bytes

    def _run_copies(self, req: _Request, copies: list) -> None:
        """Byte copies of an alloc, run only once nothing can fail any more (spec/manager.md §4.7)."""
        r, eng = req.replica, self._engine
        if self._journal is not None and self._holds_bytes and copies:
            self._journal_copies(r, copies)  # spec/manager.md §17.3: a guarded batch puts these bytes back
        for kind, a, src, dst in copies if self._holds_bytes else ():  # spec/manager.md §1.5: no bytes, no copies
            if kind == "leafpeer":  # spec/manager.md §7.3: a page of leaf a[0] from replica a[1]
                lid, src_r = a
                eng.copy_page(self._buffers[r][lid], dst, self._buffers[src_r][lid], src)
                if self._scales[r].get(lid) is not None:  # a page's scales travel with its values
                    eng.copy_page(self._scales[r][lid], dst, self._scales[src_r][lid], src)
                continue
            if kind == "peer":
                eng.copy_page(self._buffers[r][self._conn_leaf], dst, self._buffers[a][self._conn_leaf], src)
                if self._scales_shape:  # spec/manager.md §16: a page's scales travel with its values
                    eng.copy_page(self._scales[r][self._conn_leaf], dst, self._scales[a][self._conn_leaf], src)
            else:
                buf = self._buffers[r][a]
                if src == NULL_BLOCK:
                    eng.zero_page(buf, dst)  # spec/manager.md §4.7: a fresh recurrent state starts at zero
                else:
                    eng.copy_page(buf, dst, buf, src)
        for lid, c in req.restore.items():
            self._pools[r][lid].free([c])
        req.restore.clear()

    def _journal_copies(self, r: int, copies: list) -> None:
        """The bytes (values, and FP8 scales) of every page ``copies`` write, before they do."""
        eng = self._engine
        for kind, a, src, dst in copies:
            lid = a[0] if kind == "leafpeer" else self._conn_leaf if kind == "peer" else a
            self._journal_pages(eng.page_store(self._buffers[r][lid]), [dst])
            if kind != "restore" and self._scales[r].get(lid) is not None:
                self._journal_pages(eng.page_store(self._scales[r][lid]), [dst])

    def _size_dummy(self, req: _Request) -> KVTransfer:
        n = self._required_blocks(req.ctx)
        for leaf in self._leaves:
            row = req.rows[leaf.leaf_id]
            want = leaf.row_width(n)  # what runtime_inputs reads of the row
            if len(row) < want:
                row.extend([NULL_BLOCK] * (want - len(row)))
        return CompletedTransfer()

    def alloc_dummy(self, ctx: TextContext, replica_idx: int = 0) -> None:
        """Claim ``ctx`` on ``replica_idx`` with rows of null pages (DP batch padding).

        No ref count or ``block_count`` changes; ``release`` frees nothing;
        ``step`` is a no-op; ``runtime_inputs`` gives it an all-null row.

        Raises
        ------
        TypeError, IndexError, ValueError
            As ``claim``. State is unchanged.
        """
        r = self._check_claimable("alloc_dummy", ctx, replica_idx)
        req = _Request(ctx=ctx, replica=r, rows={leaf.leaf_id: [] for leaf in self._leaves}, dummy=True)
        self._size_dummy(req)
        self._requests[ctx.request_id] = req

    def _raise_short(self, ctx: TextContext, r: int, lid: str, n: int, free: int, taken=()) -> None:
        """spec/manager.md §4 step 6: leaf ``lid`` of replica ``r`` has ``free`` pages for ``n``. Pages
        held only by in-flight offloads (not by a row, a load or the hit in ``taken``) count as
        evictable: when they close the gap, ``_AwaitOffloads`` makes ``alloc`` wait for those
        offloads and size again; otherwise ``InsufficientBlocksError``, nothing changed."""
        if self._offloads and lid == self._conn_leaf:
            extra = len(self._offload_only_pages(r, lid).difference(taken))
            if extra and n <= free + extra:
                raise _AwaitOffloads(r, insufficient_blocks_message("alloc", ctx.request_id, n, lid, free, r))
            free += extra
        raise InsufficientBlocksError(insufficient_blocks_message("alloc", ctx.request_id, n, lid, free, r))
