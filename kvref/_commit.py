"""``step``: commit what a forward wrote (spec/manager.md §5).

Publish the filled blocks of every paged leaf as one chain, with twin dedup
(spec/manager.md §5.1), checkpoint recurrent states at page boundaries
(spec/manager.md §5.2) and slide sliding windows (spec/manager.md §5.3): the
methods of ``PagedKVCacheManager`` (``kvref/_manager.py``) that run after each
forward.
"""

from __future__ import annotations

import numpy as np

from kvspec._manager_types import TextContext
from kvspec.engine import NULL_BLOCK
from kvspec.retention import NEVER, expiry_of

from ._request import _Request

__all__ = ["Commit"]


class Commit:
    """The ``step`` half of the policy, mixed into ``PagedKVCacheManager`` (its state)."""

    def step(self, ctx: TextContext) -> None:
        """Commit what the forward wrote (call after ``ctx.update``).

        Publishes row blocks ``committed .. processed_length // page_size``
        (twin deduplication: an already published copy replaces ours), queues
        them for offload, checkpoints recurrent leaves at exact page
        boundaries, and slides sliding-window leaves (blocks below the window
        freed and nulled in place).

        Raises
        ------
        TypeError, ValueError
            Bad or unclaimed ctx; ``processed_length`` beyond the allocated
            rows. State is unchanged.
        """
        req = self._requests.get(ctx.request_id) if type(ctx) is TextContext else None
        if req is None or req.ctx is not ctx or self._closed:
            op = "step"
            self._check_open(op)
            req = self._req(op, ctx)  # raises, or adopts a replacement context (spec/manager.md §2.3)
        settled = req.settled  # not a dummy, no load, no admission flag: only the commits below
        if not settled and req.dummy:
            return
        rows = req.rows
        cap = min([len(rows[lid]) for lid in self._paged_ids]) * self._page
        if ctx.processed_length > cap:
            raise ValueError(
                f"step: processed_length={ctx.processed_length} > {cap} tokens in the allocated rows; "
                "alloc must be called before the forward"
            )
        if not settled:
            errors = self._poll_load(req.load) if req.load is not None and req.load.state == "pending" else []
            if errors:
                raise errors[0]
        if self._recurrent_leaves or self._sliding_leaves:
            # spec/manager.md §14.7: a checkpoint or slide lets pages go under the request's claim;
            # the clock is read (and checked) once, before the step changes anything
            with self._clock_held:
                self._step_settled(req, ctx, settled, self._claim_expiry(ctx))
        else:
            self._step_settled(req, ctx, settled, None)

    def _step_settled(self, req: _Request, ctx: TextContext, settled: bool, expiry: float | None) -> None:
        """``step`` past its checks: the forward counted, the admission's flags cleared, then
        the commit, the checkpoint and the slide (``expiry``: the claim's, read by ``step``)."""
        req.step_gen += 1
        if not settled:
            req.end_admission()  # the admission's flags cleared
            if req.load is not None:
                if req.load.state == "failed":
                    req.ran_past = True  # spec/manager.md §9.6: the forward read pages that never landed
                    return
                req.stepped_during_load = True  # pending: commits wait for the landing
                return
        self._commit(req, ctx)
        if self._recurrent_leaves:
            self._checkpoint(req, ctx, expiry)
        if self._sliding_leaves:
            self._slide(req, ctx, expiry)

    def _commit(self, req: _Request, ctx: TextContext) -> None:
        """spec/manager.md §5.1: publish row blocks ``committed .. processed // page`` of every
        paged leaf as one chain per leaf (``publish_run``), twin dedup, queue for offload."""
        if not self._caching:
            return
        r, page, lo = req.replica, self._page, req.committed
        if min(ctx.processed_length // page, (len(ctx) - 1) // page) <= lo:
            return  # no block filled since the last commit (a decode step inside a page)
        hashes = req.hashes = self._hashes_for(ctx, req.hashes)
        end = min(ctx.processed_length // page, len(hashes))
        if not self._parent_published(req, lo):
            return
        tokens = ctx._tokens[lo * page : end * page]  # (end * page <= processed_length: ctx.tokens' slice)
        stop = end
        rows, pools, anchor = req.rows, self._pools[r], self._anchor
        for leaf in self._commit_order:  # the anchor first: nothing past its stop is published
            lid = leaf.leaf_id
            row, pool = rows[lid], pools[lid]
            mine = row[lo:stop]
            kept = pool.publish_run(mine, hashes[lo:stop], tokens if stop == end else tokens[: (stop - lo) * page])
            if kept != mine[: len(kept)]:  # one list compare: the loop runs only when a twin exists
                # spec/manager.md §5.1: twin dedup, keep the published copies (same chain). One
                # touch_many of the twins (distinct: one chain), then one free of our copies in
                # order: the same state as touch(c), free([b]) page by page (a twin is published, our
                # copy is not, so neither call moves the other's page).
                twins = [j for j, c in enumerate(kept) if c != mine[j]]
                pool.touch_many([kept[j] for j in twins])
                for j in twins:
                    row[lo + j] = kept[j]
                pool.free([mine[j] for j in twins])
            if leaf is anchor:
                stop = lo + len(kept)  # a collision: block stop is retried at the next step
        req.committed = stop
        if stop > lo and self._uses_connector:
            toks = np.array(tokens[: (stop - lo) * page], dtype=np.int32).reshape(stop - lo, page)
            self._offload_queue[r].append((hashes[lo:stop], toks))

    def _claim_expiry(self, ctx: TextContext) -> float:
        """The expiry of the retention claim ``ctx`` makes now (spec/manager.md §14.7): one clock
        read, checked, taken before the caller changes anything."""
        return expiry_of(ctx._retention_seconds, self._clock) if self._caching else NEVER

    def _let_go(self, pool, pages, ctx: TextContext, expiry: float) -> None:
        """The request lets go of ``pages`` (in the order given): its retention claim merged into
        the published ones (spec/manager.md §14.2), then its references dropped (spec/manager.md §6); one engine
        call (``retain_free``). ``expiry``: the claim's (``_claim_expiry``), read by the caller before
        its first change."""
        if self._caching and len(pages):
            pool.retain_free(pages, ctx._retention_priority, expiry)
        else:
            pool.free(pages)

    def _parent_published(self, req: _Request, i: int) -> bool:
        """spec/manager.md §5.1: block ``i`` may be published, or switched to a twin, only
        when its parent is: the anchor leaf's page ``i - 1`` is the published page of
        ``h_{i-1}`` (a page whose parent lost a hash collision never joins the index, so a
        twin found by hash and tokens always continues the same chain)."""
        if i == 0:
            return True
        pool = self._pools[req.replica][self._anchor.leaf_id]
        parent = req.rows[self._anchor.leaf_id][i - 1]
        # A sliding anchor's parent may be below the window (null): nothing to verify there.
        return parent == NULL_BLOCK or pool.block_hash[parent] == req.hashes[i - 1]

    @staticmethod
    def _publish_or_twin(pool, b: int, h: bytes, toks) -> int:
        """Publish page ``b`` under ``h``; the page the row keeps (spec/manager.md §5.1 twin dedup).

        When a twin (same hash and tokens) is already published, the row switches to
        it (one more reference) and ``b`` is freed; the caller has checked the parent
        (``_parent_published``), so the twin continues the same chain.
        """
        canon = pool.publish(b, h, toks)
        if canon != b:
            pool.touch(canon)
            pool.free([b])
        return canon

    def _checkpoint(self, req: _Request, ctx: TextContext, expiry: float) -> None:
        p = ctx.processed_length
        if not self._caching or p == 0 or p % self._page:
            return
        i = p // self._page - 1
        if i >= len(req.hashes):
            return
        h, toks = req.hashes[i], self._block_tokens(ctx._tokens, i)  # (block i < len(ctx): ctx.tokens' slice)
        for leaf in self._recurrent_leaves:
            row, pool = req.rows[leaf.leaf_id], self._pools[req.replica][leaf.leaf_id]
            if len(row) < 2 or pool.lookup(h, toks) is not None:
                continue
            live, succ = row
            if self._holds_bytes:  # spec/manager.md §5.2: the successor carries on, the old live page is the checkpoint
                buf = self._buffers[req.replica][leaf.leaf_id]
                self._engine.copy_page(buf, succ, buf, live)
            pool.publish(live, h, toks)
            self._let_go(pool, [live], ctx, expiry)  # spec/manager.md §14.2
            req.rows[leaf.leaf_id] = [succ]

    def _slide(self, req: _Request, ctx: TextContext, expiry: float) -> None:
        filled = ctx.processed_length // self._page
        for leaf in self._sliding_leaves:
            cut, lo = leaf.window_start(filled), req.nulled.get(leaf.leaf_id, 0)
            if cut <= lo:
                continue
            row = req.rows[leaf.leaf_id]
            # spec/manager.md §5.3: freed tail first, nulled in place (row index = same tokens in every leaf).
            self._let_go(self._pools[req.replica][leaf.leaf_id], row[lo:cut][::-1], ctx, expiry)  # spec/manager.md §14.2
            row[lo:cut] = [NULL_BLOCK] * (cut - lo)
            req.nulled[leaf.leaf_id] = cut
