"""The fast request manager ``PagedKVCacheManager`` (DESIGN §5, §7; spec/manager.md §12).

``kvfast.PagedKVCacheManager`` is the policy, ``kvref.PagedKVCacheManager``
(its public class), on a fast engine chosen by :meth:`make_engine`:
:class:`~kvfast._manager_engine.FastManagerEngine` on the CPU (the Numba
block pool, the SHA-256 chain kernel, one-scatter lookup tables),
:class:`~kvfast._manager_engine.CudaManagerEngine` on a GPU (CuPy buffers,
``CudaPageStore`` for the tiers, device-side inputs). Every configuration
(replicas, sliding and recurrent leaves, tiers, in-flight loads) runs the
policy on that engine.

Plans, measured and kept on purpose: the calls a scheduler makes every step read
the row they serve once (``_alloc_plan``, ``_step_plan``, ``_inputs_plan``) and,
when it is a running request's plain decode, apply that plan: the policy's steps
with fewer checks, the same results, errors and block ids (the differential and
batch tests compare them with kvref). The single calls and the batch calls
(``alloc_many``, ``step_many``) share each plan; a row without one goes to the
policy. Which plans exist is decided at construction; a closed manager
(spec/manager.md §9.7) has none:

* every leaf set, replica count, connector, draft count and dtype: ``claim``, the
  growth of a request past its admission (``alloc``: the drain, the sizing of every
  paged row from one slab, the count; with drafts the rows cover ``seq_len``, and a
  row past it rolls back through the policy), the step that fills no page,
  checkpoints no state and slides no window (``step``: the count), the forward's
  inputs (``runtime_inputs``: the batch's checks and the lookup tables of the paged
  leaves in one engine call, of the state leaves in another; the drafts' lengths;
  FP8's scale fields) and the release (the rows let go leaf by leaf, the claim
  merged);
* every leaf set besides one full leaf: the step of a settled request that fills
  pages (``step``: the one-block commit of a decode step hashed once and published
  in every paged leaf, or the policy's ``_commit`` of several; then the policy's own
  checkpoint and slide) and, without a connector, the admission's splice
  (``alloc``: the policy's joint device hit, each leaf's part of it planned and
  committed by the leaf, one slab check, the slab's draw per leaf; a hit a peer
  replica extends goes to the policy);
* one full-attention leaf: the commit of a step (one ``publish_run``), the release
  (claim and free in one kernel pass, ``BlockPool.retain_free``) and the
  admission's splice (when no peer replica holds the block after the local run and
  the tiers hold nothing past it: one connector lookup).

The plans read one field of the request record, ``settled`` (no load of its
own, no external stage due, not a dummy row; spec/manager.md §2), instead of
its five flags.
"""

from __future__ import annotations

import hashlib

import numpy as np
from kvspec import hashing
from kvspec._config import parse_device
from kvspec._manager_types import (
    LUT_ALIGN,
    CompletedTransfer,
    KVCacheInputs,
    KVCacheInputsPerDevice,
    KVCacheParams,
    KVTransfer,
    LeafKind,
    TextContext,
)
from kvspec.errors import InsufficientBlocksError, insufficient_blocks_message

import kvref

from ._block_pool import _ids
from ._manager_engine import CudaManagerEngine, FastManagerEngine
from ._slot_cache import require_cuda

__all__ = ["PagedKVCacheManager"]

#: ``alloc``'s result when nothing is in flight (immutable, shared).
_DONE = CompletedTransfer()


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class _Splice:
    """The hit part of an admission that the leaves plan and commit (``Leaf.plan_hit``,
    ``Leaf.commit_hit``, ``Leaf.first_state_copy``): per leaf, the spliced row and its nulled slots
    (paged leaves), the checkpoint to restore (recurrent leaves); no peer part (spec/manager.md §4.5)."""

    __slots__ = ("rows", "nulled", "restore", "leaf_peer", "restore_peer")

    def __init__(self):
        self.rows: dict[str, list[int]] = {}
        self.nulled: dict[str, int] = {}
        self.restore: dict[str, int] = {}
        self.leaf_peer: dict = {}
        self.restore_peer: dict = {}


class PagedKVCacheManager(kvref.PagedKVCacheManager):
    """Request-level paged KV cache with prefix caching, replicas and tiers; the fast path.

    Same constructor, methods, results and errors as
    ``kvref.PagedKVCacheManager`` (see there for the full contract).

    Parameters
    ----------
    params : KVCacheParams
    num_blocks : int
        Pages per replica and leaf including the null block 0.
    max_batch_size : int
    max_seq_len : int
    device : str
        ``"cpu"`` or ``"cuda[:N]"`` (buffers as CuPy arrays; ``RuntimeError``
        without CuPy or a visible GPU).
    connector : KVConnector, optional

    Examples
    --------
    >>> from kvfast import PagedKVCacheManager, KVCacheParams, TextContext
    >>> m = PagedKVCacheManager(KVCacheParams(page_size=4, num_layers=1, kv_heads=1, head_dim=2),
    ...                         num_blocks=9, max_batch_size=4, max_seq_len=32)
    >>> ctx = TextContext("a", list(range(10)))
    >>> m.claim(ctx); _ = m.alloc(ctx)
    >>> m.get_req_blocks_per_leaf(ctx)
    {'full': [1, 2, 3]}
    """

    def __init__(self, params: KVCacheParams, *, num_blocks: int, max_batch_size: int, max_seq_len: int,
                 device: str = "cpu", connector=None, clock=None, lookup_table_dtype: str = "uint32"):
        super().__init__(params, num_blocks=num_blocks, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                         device=device, connector=connector, clock=clock, lookup_table_dtype=lookup_table_dtype)
        # Decided here, once. The plans (the claim, the growth of a request past its admission, the
        # decode step inside a page, the forward's inputs) serve every leaf set, replica count and
        # connector, speculative decoding (spec/manager.md §15: the sizing reads seq_len; a row past
        # its need, which rolls back, goes to the policy) and FP8 scales (spec/manager.md §16: the
        # inputs carry the scale fields). A closed manager's calls (``_closed``, set by shutdown,
        # spec/manager.md §9.7) go to the policy, which refuses what would change state.
        # One full leaf: the commit of a step, the release and the admission's splice are planned too.
        self._single = len(self._leaves) == 1 and self._leaves[0].kind is LeafKind.FULL
        # The admission's splice serves any replica, when no peer holds the block after the local run
        # (else the policy's cross-replica hit, spec/manager.md §7.3) and the tiers hold nothing past
        # it (else the policy's load, spec/manager.md §9.3).
        self._anchor_id = self._anchor.leaf_id  # every paged row has its length (spec/manager.md §4.6)
        #: several leaves: (leaf id, whether it is a state leaf) in leaf order, the order the policy
        #: sizes and draws in
        self._grow_order = [(leaf.leaf_id, leaf.kind is LeafKind.RECURRENT) for leaf in self._leaves]
        #: recurrent leaves: a state row holds a live page and, with caching, a successor
        self._state_ids = [leaf.leaf_id for leaf in self._leaves if leaf.kind is LeafKind.RECURRENT]
        self._state_len = 2 if self._caching else 1
        #: sliding leaves: (leaf id, blocks in the window), for the decode step's no-slide test
        self._windows = [(leaf.leaf_id, leaf.blocks_in_window) for leaf in self._leaves
                         if leaf.kind is LeafKind.SLIDING_WINDOW]
        if not self._drafts and not self._state_ids:
            self._alloc_plan = self._alloc_plan_paged  # the plan without drafts or state rows
        if params.hash_algo == "sha256":
            self._hash1 = _sha256_digest
        else:
            import xxhash

            self._hash1 = xxhash.xxh3_128_digest

    @classmethod
    def make_engine(cls, params: KVCacheParams, device: str):
        """:class:`FastManagerEngine` on ``"cpu"``; :class:`CudaManagerEngine` on ``"cuda[:N]"``
        (``RuntimeError`` without CuPy or a visible device N)."""
        o = "PagedKVCacheManager"
        kind, dev = parse_device(o, device)
        if kind == "cuda":
            require_cuda(o, dev)
            return CudaManagerEngine(dev)
        return FastManagerEngine()

    # ------------------------------------------------------------------ fast paths

    def claim(self, ctx: TextContext, replica_idx: int = 0) -> None:
        """Pin ``ctx`` to a replica with empty rows (same contract and errors as the reference)."""
        if (
            type(ctx) is TextContext and type(replica_idx) is int and 0 <= replica_idx < self._dp and not self._closed
            and ctx.request_id not in self._requests and ctx._length <= self._max_seq_len
        ):
            self._requests[ctx.request_id] = self._new_request(ctx, replica_idx)
            return
        super().claim(ctx, replica_idx)  # validates and raises, or claims

    def alloc(self, ctx: TextContext, *, defer_lookup: bool = False) -> KVTransfer:
        """Give the request the pages its next forward needs, reusing a cached prefix.

        Same contract as ``kvref.PagedKVCacheManager.alloc`` (drains finished
        transfers, splices the device hit at the reuse point, grows the rows,
        runs the external stage); all or nothing on ``InsufficientBlocksError``.
        """
        # A running request's decode sizing: its plan (the batch calls' too), then only the drain,
        # the growth and the count (spec/manager.md §4).
        plan = self._alloc_plan(ctx) if defer_lookup is False and not self._closed else None
        if plan is not None:
            if self._loads or self._offloads and self._completions_moved():
                self._drain()  # spec/manager.md §9.2: finished transfers land before the sizing
            if type(plan) is tuple:  # it draws pages
                req, row, need = plan
                if not self._grow_rows(req, row, need):
                    return super().alloc(ctx)  # short of pages: the policy waits for offloads or raises
            else:
                req = plan
            self._metrics.input_tokens += req.count_forward(ctx._active)  # spec/manager.md §4.9
            return _DONE
        return self._alloc_fast(ctx, defer_lookup)

    # ------------------------------------------------------------------ the decode step (spec/manager.md §4, §5, §17)
    #
    # One plan per row, shared by the single calls and the batch calls: ``_alloc_plan`` and
    # ``_step_plan`` read a context's slots and its record (changing nothing) and say what its call
    # does, or None when the row is not a running request's plain decode (the policy's then).

    def _alloc_plan(self, ctx):
        """For ``alloc(ctx)`` of a claimed, settled request already holding pages (spec/manager.md
        §4: only the drain, the sizing and the count): its record when it draws no page, ``(record,
        anchor row, pages per paged row)`` when it does (its paged rows, or a state row's successor,
        spec/manager.md §5.2). None otherwise (nothing read beyond the checks)."""
        if type(ctx) is not TextContext:
            return None
        req = self._requests.get(ctx.request_id)
        if req is None or req.ctx is not ctx or not req.settled:
            return None  # unclaimed, a replacement, a load or an external stage of its own
        state = ctx._spec_decoding_state
        if state is not None and not self._drafts_fit(state):
            return None  # the policy checks drafts (spec/manager.md §15.4)
        row = req.rows[self._anchor_id]
        processed = ctx._processed
        page = self._page
        # (no rewind into published pages, spec/manager.md §11.21, nor into a fork's, spec/manager.md §19)
        if not row or ctx._length > self._max_seq_len or processed < req.committed * page or \
                processed < req.shared_floor:
            return None
        if self._drafts:
            # spec/manager.md §15: the rows cover seq_len; a row past its need rolls back (the policy's trim)
            short = self._seq_len(ctx) - len(row) * page
            if short <= -page:
                return None
        else:
            short = processed + ctx._active - len(row) * page
        need = -(-short // page) if short > 0 else 0
        if self._state_ids:
            # a state row: its live page, and with caching a successor to draw (spec/manager.md §5.2);
            # an empty one gets a fresh, zeroed state from the policy (spec/manager.md §4.7)
            states = min([len(req.rows[lid]) for lid in self._state_ids])
            if not states:
                return None
            return (req, row, need) if need > 0 or states < self._state_len else req
        return (req, row, need) if need > 0 else req

    def _alloc_plan_paged(self, ctx):
        """:meth:`_alloc_plan` of a manager without drafts or state leaves (chosen at construction):
        a context with a speculative state goes to the policy."""
        if type(ctx) is not TextContext:
            return None
        req = self._requests.get(ctx.request_id)
        if req is None or req.ctx is not ctx or not req.settled or ctx._spec_decoding_state is not None:
            return None
        row = req.rows[self._anchor_id]
        processed = ctx._processed
        page = self._page
        if not row or ctx._length > self._max_seq_len or processed < req.committed * page or \
                processed < req.shared_floor:
            return None
        short = processed + ctx._active - len(row) * page
        if short > 0:
            return req, row, -(-short // page)
        return req

    def _step_plan(self, ctx):
        """For ``step(ctx)`` of a claimed, settled request whose rows cover its forward (then the
        step cannot fail): its record when the step only counts the forward (spec/manager.md §5: no
        page filled since the last commit, no checkpoint, no slide, or no prefix caching), True
        when it commits. None otherwise."""
        if type(ctx) is not TextContext:
            return None
        req = self._requests.get(ctx.request_id)
        if req is None or req.ctx is not ctx or not req.settled:
            return None  # unclaimed, a replacement, a dummy row, a load or an admission's flags
        processed = ctx._processed
        page = self._page
        if processed > len(req.rows[self._anchor_id]) * page:
            return None  # the policy raises: alloc must be called before the forward
        if self._single:  # spec/manager.md §5.1 (without prefix caching nothing is ever committed)
            return True if self._caching and processed >= (req.committed + 1) * page else req
        if not self._caching:
            return True if self._windows and self._slides(req, processed // page) else req
        filled = processed // page
        if min(filled, (ctx._length - 1) // page) > req.committed or (
                self._state_ids and processed and not processed % page):  # spec/manager.md §5.1, §5.2
            return True
        return True if self._windows and self._slides(req, filled) else req

    def _slides(self, req, filled: int) -> bool:
        """Whether blocks left a sliding leaf's window (spec/manager.md §5.3: the slide frees them)."""
        nulled = req.nulled
        for lid, window in self._windows:
            if filled - window > nulled.get(lid, 0):
                return True
        return False

    def alloc_many(self, ctxs, *, defer_lookup: bool = False) -> list[KVTransfer]:
        """``[alloc(ctx, defer_lookup=defer_lookup) for ctx in ctxs]``, all or nothing (same contract
        as the reference, spec/manager.md §17).

        A batch of running requests, each listed once, whose growth fits the free pages of every
        replica and leaf (so no alloc can fail) is served from the rows' plans in one pass: the
        drain the loop's first ``alloc`` does, the pages drawn in batch order (the loop's block
        ids), the forwards counted. Any other batch goes through the policy's checks and bound."""
        if type(ctxs) is list and defer_lookup is False and not self._closed and ctxs:
            plans = list(map(self._alloc_plan, ctxs))
            if None not in plans and (len(ctxs) == 1 or len(set(map(id, ctxs))) == len(ctxs)):
                # (a duplicate's second alloc sizes the first's rows: the policy's loop)
                if self._loads or self._offloads and self._completions_moved():
                    self._drain()  # spec/manager.md §9.2, §17.2: finished transfers land before the sizing
                grow = [p for p in plans if type(p) is tuple]
                if not grow or self._demand_fits(self._decode_demand(grow)):
                    if grow:
                        grow_rows = self._grow_rows
                        with self._clock_held:  # spec/manager.md §14.7, §17.1: one reading for every pool
                            for req, row, need in grow:
                                grow_rows(req, row, need)
                    added = 0
                    for p, ctx in zip(plans, ctxs):
                        added += (p[0] if type(p) is tuple else p).count_forward(ctx._active)
                    self._metrics.input_tokens += added  # spec/manager.md §4.9
                    return [_DONE] * len(ctxs)
                # short of pages: the policy waits for offloads, or raises all or nothing
        return super().alloc_many(ctxs, defer_lookup=defer_lookup)

    def _decode_demand(self, grow: list) -> dict[int, dict[str, int]]:
        """The pages the plans ``grow`` draw, per replica and leaf: ``need`` on every paged row, the
        missing successor on a state row (spec/manager.md §5.2), as :meth:`_grow_rows` draws them."""
        demand: dict[int, dict[str, int]] = {}
        full = self._state_len
        for req, _, need in grow:
            per = demand.setdefault(req.replica, {})
            for lid, state in self._grow_order:
                n = full - len(req.rows[lid]) if state else need
                if n > 0:
                    per[lid] = per.get(lid, 0) + n
        return demand

    def _demand_fits(self, demand: dict[int, dict[str, int]]) -> bool:
        """Whether every replica's ``demand`` (pages per leaf) fits its free pages (one slab's
        joint check with several leaves, spec/manager.md §13.3)."""
        for r, per in demand.items():
            if not per:
                continue
            if self._slabs:
                if self._slabs[r].shortfall(per, None) is not None:
                    return False
            else:
                pools = self._pools[r]
                for lid, n in per.items():
                    if n > pools[lid].num_free:
                        return False
        return True

    def step_many(self, ctxs) -> None:
        """``for ctx in ctxs: step(ctx)``, all or nothing (same contract as the reference,
        spec/manager.md §17): a batch of settled requests whose rows cover the forward, each listed
        once (so no step can fail), is served from the rows' plans in batch order under one clock
        reading; any other batch goes through the policy's checks."""
        if type(ctxs) is list and not self._closed and ctxs:
            plans = list(map(self._step_plan, ctxs))
            if None not in plans and (len(ctxs) == 1 or len(set(map(id, ctxs))) == len(ctxs)):
                # (a duplicate's second step sees the first's commit: the policy's loop)
                commit = self._step_one if self._single else self._step_leaves
                with self._clock_held:  # spec/manager.md §17.1: one clock reading, checked before any change
                    for plan, ctx in zip(plans, ctxs):
                        if plan is True:
                            commit(ctx)
                        else:
                            plan.step_gen += 1  # only the forward is counted
                return
        super().step_many(ctxs)

    def _drafts_fit(self, state) -> bool:
        """Both draft lists of ``state`` are lists within ``num_draft_tokens`` (spec/manager.md §15.4);
        anything else (a tuple, an array, a list too long, drafts without ``num_draft_tokens``) goes
        to the policy, which accepts or refuses it."""
        verify, maybe, k = state.draft_tokens_to_verify, state.maybe_accepted_draft_tokens, self._drafts
        return type(verify) is list and type(maybe) is list and len(verify) <= k and len(maybe) <= k

    def _completions_moved(self) -> bool:
        """Whether the drain could unpin an offload (spec/manager.md §9.2): the connector's
        completion count moved since its last poll, or the connector keeps none. False means
        the drain would change nothing, so it is skipped."""
        return self._completions is None or self._completions() != self._completions_seen

    def _grow_rows(self, req, row: list[int], need: int) -> bool:
        """The sizing of a ``running`` request (spec/manager.md §4.6): ``need`` pages onto every
        paged row and, with prefix caching, a successor page onto a state row that holds only
        its live page (spec/manager.md §5.2), all or nothing; False (nothing drawn) when the
        replica cannot serve them."""
        pools = self._pools[req.replica]
        if self._single:
            pool = pools[self._anchor_id]
            if need > pool.num_free:
                return False
            if need == 1:
                row.append(pool.allocate_one())
            else:
                row.extend(pool.allocate(need))
            return True
        rows, full = req.rows, self._state_len
        demand = {}
        for lid, state in self._grow_order:  # leaf order: the order the policy checks and draws in
            n = full - len(rows[lid]) if state else need
            if n > 0:
                demand[lid] = n
        if not demand:
            return True
        # spec/manager.md §13.3: the leaves' pages come from one slab, checked together.
        if self._slabs:
            if self._slabs[req.replica].shortfall(demand, None) is not None:
                return False
        elif any(n > pools[lid].num_free for lid, n in demand.items()):
            return False
        with self._clock_held:  # spec/manager.md §14.7: one reading for every pool drawn from
            for lid, n in demand.items():
                if n == 1:
                    rows[lid].append(pools[lid].allocate_one())
                else:
                    rows[lid].extend(pools[lid].allocate(n))
        return True

    def _alloc_fast(self, ctx: TextContext, defer_lookup: bool) -> KVTransfer:
        """An admission (spec/manager.md §4) after the checks every plan shares: of one full leaf on
        any replica, the splice of the device hit, the sizing and, with a connector, the external
        stage when the tiers hold nothing past the hit (one lookup); of several leaves without a
        connector, :meth:`_splice_leaves`; anything else is the policy's."""
        if self._loads or self._closed or not self._single and self._uses_connector:
            return super().alloc(ctx, defer_lookup=defer_lookup)
        op = "alloc"
        # spec/manager.md §4.1: every argument is checked before the stored context may be replaced.
        if not isinstance(defer_lookup, bool):
            return super().alloc(ctx, defer_lookup=defer_lookup)  # raises TypeError
        req = self._requests.get(ctx.request_id) if type(ctx) is TextContext else None
        if req is None or req.ctx is not ctx:
            req = self._req(op, ctx)  # raises, or adopts a replacement context (spec/manager.md §2.3)
        if ctx._length > self._max_seq_len:
            self._check_len(op, ctx)  # raises ValueError
        if ctx._spec_decoding_state is not None:
            self._check_drafts(op, ctx)  # spec/manager.md §15: no drafts without num_draft_tokens
        self._check_no_rewind(op, req, ctx)  # spec/manager.md §11.21
        if req.dummy:
            return self._size_dummy(req)
        if self._offloads and self._completions_moved():
            self._drain()  # spec/manager.md §9.2: finished transfers land before anything is sized
        if not self._single:
            with self._clock_held:  # spec/manager.md §14.7: one reading for every pool drawn from
                return self._splice_leaves(req, ctx, defer_lookup)
        leaf_id = self._conn_leaf
        r = req.replica
        pool = self._pools[r][leaf_id]
        row = req.rows[leaf_id]
        page = self._page
        splice = self._caching and ctx.processed_length == 0 and not row
        conn = self._uses_connector
        if conn and (not splice or defer_lookup or not req.settled or req.skip_connector):
            return super().alloc(ctx, defer_lookup=defer_lookup)  # a deferred or held lookup, a load
        if splice:
            hashes = self._hashes_for(ctx, req.hashes)
            cap = min(len(hashes), (ctx.active_length - 1) // page)
            # spec/manager.md §3.2: hits are verified against the context's own int32 tokens (never the hash input).
            hits = pool.lookup_run(hashes[:cap], ctx._tokens[: cap * page]) if cap else []
            k = have = len(hits)
            if k < cap and self._dp > 1 and self._peer_source(r, hashes[k], ctx._tokens[k * page : (k + 1) * page]):
                # spec/manager.md §7.3: a peer holds the next block, the hit reaches past the local
                # run (copies): the policy's
                return super().alloc(ctx, defer_lookup=defer_lookup)
        else:
            have = len(row)
        # spec/manager.md §15: with drafts the row covers seq_len, and a row past it rolls back (the
        # policy's trim)
        need = (-(-ctx.current_position // page) if not self._drafts else self._required_blocks(ctx)) - have
        if need < 0:
            if self._drafts:
                return super().alloc(ctx, defer_lookup=defer_lookup)
            need = 0
        # The splice revives at most k free hits: count them exactly only when that decides.
        free = pool.num_free - k if splice else pool.num_free
        if need > free and splice:
            free = pool.num_free - pool.count_free(hits)
        if need > free:
            if self._offloads:
                return super().alloc(ctx)  # spec/manager.md §4 step 6: the policy may wait for them
            raise InsufficientBlocksError(insufficient_blocks_message(op, ctx.request_id, need, leaf_id, free, r))
        # spec/manager.md §9.3: the external stage (the connector in use, a fresh splice, blocks
        # past the hit): one lookup; a load goes to the policy with the answer held (spec/manager.md §9.4), so
        # the connector is asked once.
        ext = conn and k < len(hashes)
        if ext:
            n = self._lookup(op, r, hashes, ctx.tokens, k)  # TypeError for a bad answer, nothing changed
            if min(n, len(hashes) - k, (ctx.current_position - k * page - 1) // page) > 0:
                req.lookup = (k, n)
                try:
                    return super().alloc(ctx)
                except BaseException:
                    if req.lookup == (k, n):
                        req.lookup = None  # as after the policy's own failed stage
                    raise
        # ---- commit (nothing below can fail)
        m = self._metrics
        if splice:
            if k:
                pool.touch_many(hits)
                ctx.skip_processing(k * page)
            req.rows[leaf_id] = row = hits
            req.nulled[leaf_id] = 0
            req.hashes = hashes
            req.committed = k
            ctx.cached_prefix_length = k * page
            ctx.cached_prefix_external_length = 0
            m.cache_tokens += k * page
            m.device_blocks_served += k
            req.ext_point = not ext  # the stage ran (nothing to load) or is still due
        if need:
            row.extend(pool.allocate_array(need).tolist())
        if conn and k:
            self._tier_touch(r, hashes[:k])  # spec/manager.md §4.8: the device hit re-ranked in the tiers
        m.input_tokens += req.count_forward(ctx.active_length)  # spec/manager.md §4.9
        return _DONE

    def _splice_leaves(self, req, ctx: TextContext, defer_lookup: bool) -> KVTransfer:
        """The admission of several leaves on any replica count without a connector (spec/manager.md §4,
        the policy's ``_plan_alloc`` then ``_commit_alloc`` for a fresh request): the joint device hit
        (the policy's ``_device_hit``, each leaf's part and its commit by the leaf's own methods), the
        sizing of every leaf from one slab (checked together, spec/manager.md §13.3), a fresh live
        state for each recurrent leaf (spec/manager.md §4.7), the count. A request past its reuse point
        and a hit that reaches past the local run (a peer's copies, spec/manager.md §7.3) are the
        policy's."""
        page = self._page
        if not self._caching or ctx._processed or any(req.rows.values()):
            return super().alloc(ctx, defer_lookup=defer_lookup)  # not at the reuse point (spec/manager.md §3.3)
        r = req.replica
        tokens = ctx._tokens[: ctx._length]  # ctx.tokens without building its read-only view
        hashes = self._hashes_for(ctx, req.hashes)
        cap = min(len(hashes), (ctx._active - 1) // page)
        resident = self._resident(r, hashes, tokens)
        k, reach = self._device_hit(r, hashes, tokens, cap, resident)
        if reach > k:
            return super().alloc(ctx, defer_lookup=defer_lookup)  # peer copies past the local hit
        # spec/manager.md §4.5: each leaf's part of the hit, planned by the leaf
        hit = _Splice()
        touched = {}
        for leaf in self._leaves:
            pages = leaf.hit_pages(k, resident[leaf.leaf_id])
            leaf.plan_hit(hit, k, pages)
            touched[leaf.leaf_id] = pages
        # spec/manager.md §4.6: size every leaf, all or nothing, after the hit took its pages
        required = self._required_blocks(ctx)
        pools, caching = self._pools[r], self._caching
        need = {}
        for leaf in self._leaves:
            lid = leaf.leaf_id
            row = hit.rows.get(lid)
            need[lid] = n = max(leaf.grow_need(len(row) if row is not None else 0, required, caching), 0)
            if not self._slabs and n:
                pool = pools[lid]
                free = pool.num_free - (pool.count_free(touched[lid]) if touched[lid] else 0)
                if n > free:
                    self._raise_short(ctx, r, lid, n, free, touched[lid])
        if self._slabs:
            self._check_slab(ctx, r, need, touched)  # spec/manager.md §13.3
        # ---- commit (nothing below can fail)
        for leaf in self._leaves:
            leaf.commit_hit(req, hit, pools[leaf.leaf_id], k)
        req.hashes, req.committed = hashes, k
        if k:
            ctx.skip_processing(k * page)
        ctx.cached_prefix_length = k * page
        ctx.cached_prefix_external_length = 0
        m = self._metrics
        m.cache_tokens += k * page
        m.device_blocks_served += k
        req.ext_point = True
        # (the spliced rows hold at most `required` blocks: k < len(ctx) / page, nothing to roll back)
        copies = []
        # (the slab's draw itself: the joint check above is the one its leaf pools would repeat)
        draw = self._slabs[r].allocate if self._slabs else None
        for leaf in self._leaves:  # spec/manager.md §4.6: the sizing's pages, in leaf order
            lid = leaf.leaf_id
            n = need[lid]
            if not n:
                continue
            row = req.rows[lid]
            pages = [pools[lid].allocate_one()] if n == 1 else draw(lid, n) if draw else pools[lid].allocate(n)
            copy = leaf.first_state_copy(row, pages, hit, req)  # spec/manager.md §4.7: a new live state
            row.extend(pages)
            if copy is not None:
                copies.append(copy)
        self._run_copies(req, copies)
        m.input_tokens += req.count_forward(ctx._active)  # spec/manager.md §4.9
        return _DONE

    def step(self, ctx: TextContext) -> None:
        """Commit what the forward wrote (call after ``ctx.update``); same contract as the reference."""
        plan = self._step_plan(ctx) if not self._closed else None  # a settled request's step: its plan (the batch calls' too)
        if plan is not None:
            if plan is not True:
                plan.step_gen += 1  # only the forward is counted (spec/manager.md §5)
                return
        elif type(ctx) is not TextContext or self._closed:
            return super().step(ctx)
        if not self._single:
            return self._step_leaves(ctx)
        return self._step_one(ctx)

    def _step_one(self, ctx: TextContext) -> None:
        """``step`` of one full leaf: the commit of a settled request (the batch path's), or the
        policy's checks, adoption and load handling for any other."""
        req = self._requests.get(ctx.request_id)
        if req is None or req.ctx is not ctx or req.dummy:
            req = self._req("step", ctx)  # raises, or adopts a replacement context (spec/manager.md §2.3)
            if req.dummy:
                return
        if req.load is not None:
            return super().step(ctx)  # a load of its own: the policy polls, lands or defers (spec/manager.md §9.6)
        row = req.rows[self._conn_leaf]
        page = self._page
        processed = ctx._processed
        if processed > len(row) * page:
            return super().step(ctx)  # raises ValueError: alloc must be called before the forward
        req.step_gen += 1
        req.end_admission()
        if not self._caching:
            return
        lo = req.committed
        hashes = req.hashes
        k = len(hashes)
        if k == (ctx._length - 1) // page and processed // page <= lo:
            return  # decode step inside a block: nothing to hash or publish
        n_hash = (ctx._length - 1) // page
        if n_hash == k + 1 == lo + 1 and processed // page == n_hash:
            self._fill_leaves(req, ctx, k)  # a decode step filled one block
            return
        if len(hashes) != n_hash:
            req.hashes = hashes = self._hashes_for(ctx, hashes)
        end = min(processed // page, len(hashes))
        if end <= lo:
            return  # nothing new filled: nothing to publish
        pool = self._pools[req.replica][self._conn_leaf]
        if lo and pool.block_hash[row[lo - 1]] != hashes[lo - 1]:
            return  # spec/manager.md §5.1: the parent lost a collision; the chain is not published
        mine = row[lo:end]
        canon = pool.publish_run(mine, hashes[lo:end], ctx._tokens[lo * page : end * page])
        if canon != mine:  # one list compare: twins (or a collision) exist
            # spec/manager.md §5.1: twin dedup (same chain), keep the published copies: reference
            # them, let the private pages go (in row order, as one by one), switch the row.
            twins = [j for j, c in enumerate(canon) if c != mine[j]]
            if twins:
                pool.touch_many([canon[j] for j in twins])
                pool.free([mine[j] for j in twins])
                row[lo : lo + len(canon)] = canon
        req.committed = stop = lo + len(canon)
        if stop > lo and self._uses_connector:  # spec/manager.md §9.2: queued for the next post
            toks = np.array(ctx._tokens[lo * page : stop * page], dtype=np.int32).reshape(stop - lo, page)
            self._offload_queue[req.replica].append((hashes[lo:stop], toks))

    def _step_leaves(self, ctx: TextContext) -> None:
        """``step`` with several leaves, for a request without a load whose rows cover the forward
        (the first step after an admission clears its flags first, spec/manager.md §2): a step that
        fills no page, checkpoints no state and slides no window only counts the forward
        (spec/manager.md §5); any other commits the filled blocks of every paged leaf (one filled by
        a decode step: ``_fill_leaves``; several: the policy's ``_commit``), then checkpoints and
        slides through the policy's own methods. Any other request goes to the policy (which raises,
        adopts a replacement, or polls, lands or defers a load)."""
        req = self._requests.get(ctx.request_id)
        page = self._page
        processed = ctx._processed
        # the rows cover the forward (every paged row has the anchor's length); else the policy raises
        if req is not None and req.ctx is ctx and processed <= len(req.rows[self._anchor_id]) * page:
            if not req.settled:
                if req.load is not None or req.dummy:
                    return super().step(ctx)  # the policy polls, lands or defers a load; a dummy row
                req.end_admission()  # the first step after an admission, as the policy's step
            filled = processed // page
            caching = self._caching
            if not caching or (
                    min(filled, (ctx._length - 1) // page) <= req.committed  # spec/manager.md §5.1: nothing to publish
                    and (not self._state_ids or not processed or processed % page)):  # spec/manager.md §5.2
                nulled = req.nulled
                for lid, window in self._windows:
                    if filled - window > nulled.get(lid, 0):
                        break  # spec/manager.md §5.3: blocks left the window, the slide frees them
                else:
                    req.step_gen += 1
                    return
            # spec/manager.md §14.7: the clock read (and checked) once, before anything changes
            with self._clock_held:
                expiry = self._claim_expiry(ctx) if self._state_ids or self._windows else None
                # spec/manager.md §5.1 to spec/manager.md §5.3, in that order: the commit in every paged
                # leaf, the checkpoint, the slide (the policy's step for a settled request)
                req.step_gen += 1
                if caching and (ctx._length - 1) // page == len(req.hashes) + 1 == req.committed + 1 == filled:
                    self._fill_leaves(req, ctx, filled - 1)  # a decode step filled one block
                else:
                    self._commit(req, ctx)  # several blocks (a prefill), or none
                if self._state_ids:
                    self._checkpoint(req, ctx, expiry)
                if self._windows:
                    self._slide(req, ctx, expiry)
            return
        return super().step(ctx)

    def _fill_leaves(self, req, ctx: TextContext, i: int) -> None:
        """spec/manager.md §5.1 for block ``i`` of every paged leaf (a decode step just filled it,
        blocks before are committed): hash it, publish it leaf by leaf in the policy's commit order
        (the anchor first: its collision stops the chain, nothing else is published) with the
        policy's twin dedup (``_publish_or_twin``), queue it for offload."""
        page = self._page
        toks = ctx._tokens[i * page : (i + 1) * page]  # native int32: the verified tokens
        # spec/manager.md §3.1 (spec/hashing.md): the hash input goes through kvspec.hashing.tokens_to_bytes.
        hin = toks.tobytes() if hashing.native_tokens_are_hash_input() else hashing.tokens_to_bytes(toks)
        hashes = req.hashes
        h = self._hash1((hashes[-1] if hashes else self._root(ctx.cache_salt)) + hin)
        hashes.append(h)  # req.hashes is the request's own list (never shared)
        if not self._parent_published(req, i):
            return  # spec/manager.md §5.1: the parent lost a collision; the chain is not published
        pools, rows, anchor = self._pools[req.replica], req.rows, self._anchor
        for leaf in self._commit_order:
            pool, row = pools[leaf.leaf_id], rows[leaf.leaf_id]
            b = row[i]
            row[i] = c = self._publish_or_twin(pool, b, h, toks)  # b, or the twin that replaces it
            if c == b and leaf is anchor and pool.block_hash[b] is None:
                return  # a collision of the anchor: the block is retried at the next step
        req.committed = i + 1
        if self._uses_connector:  # spec/manager.md §9.2: queued for the next post
            self._offload_queue[req.replica].append(([h], np.array(toks, dtype=np.int32).reshape(1, page)))

    def runtime_inputs(self, batches, *, max_cache_length: int | None = None) -> KVCacheInputs:
        """The paged-attention inputs of one forward (same contract and errors as the reference).

        Planned: one batch per replica (empty ones too) of claimed ``TextContext`` rows
        that hold every block they need, with or without ``max_cache_length`` (a
        CUDA-graph capture width). The lookup tables and cache lengths are built
        from the rows in a few C-level passes; anything the plan does not prove
        valid goes to the policy (which raises).
        """
        if not self._closed and type(batches) is list and len(batches) == self._dp and (
                max_cache_length is None or type(max_cache_length) is int):
            out = self._inputs_plan(batches, max_cache_length)
            if out is not None:
                return out
        return super().runtime_inputs(batches, max_cache_length=max_cache_length)

    def _inputs_plan(self, batches: list, max_cache_length: int | None) -> KVCacheInputs | None:
        """``runtime_inputs(batches, max_cache_length=max_cache_length)`` when every check of
        spec/manager.md §8 passes, else None (nothing changed).

        ``batches[r]`` is replica r's batch (a replica is an index); the lookup tables share the
        column count of the widest row of all batches (or of ``max_cache_length``), as in the policy.
        With drafts (spec/manager.md §15.7) the rows cover ``seq_len`` and the lengths count the
        drafts; with FP8 (spec/manager.md §16.3) each leaf's inputs carry its scale fields."""
        leaf, page, requests, k = self._anchor_id, self._page, self._requests, self._drafts
        seen = 0
        per = []
        for r, batch in enumerate(batches):
            if type(batch) is not list and type(batch) is not tuple:
                return None
            n = len(batch)
            # spec/manager.md §8 (5); (1) holds (len(batches) == dp), (2) is checked below
            if n > self._max_batch_size or self._closed:
                return None
            for c in batch:
                if type(c) is not TextContext or (
                        c._spec_decoding_state is not None and not self._drafts_fit(c._spec_decoding_state)):
                    return None  # the policy checks drafts (spec/manager.md §15.4), accepts or refuses them
            # (3): every row claimed on replica r, once, holding the blocks it needs (every paged
            # row has the anchor's length; a state row its live page)
            reqs = list(map(requests.get, [c.request_id for c in batch]))
            if not all(reqs) or self._dp > 1 and any(q.replica != r for q in reqs):  # (one replica: all on 0)
                return None
            seen += n
            rows = [q.rows[leaf] for q in reqs]
            # num_req_blocks: ceil(current_position / page_size), with drafts ceil(seq_len / page_size)
            # (spec/manager.md §15.3)
            widths = [-(-(c._processed + c._active) // page) for c in batch] if not k else \
                list(map(self._required_blocks, batch))
            lengths, longest, reach = self._batch_extents(batch)  # spec/manager.md §8, §15.7
            if list(map(len, rows)) != widths and not all(map(int.__ge__, map(len, rows), widths)):
                return None
            for lid in self._state_ids:
                if not all([q.rows[lid] for q in reqs]):
                    return None
            per.append((batch, reqs, rows, widths, lengths, longest, reach))
        if len({c.request_id for b in batches for c in b}) != seen:
            return None  # a request twice: the policy names it
        if not seen and self._state_ids:
            return None  # (2): a recurrent leaf binds rows, every batch is empty: the policy raises
        need = max([max(p[3], default=0) for p in per])
        if max_cache_length is not None:  # (4): the capture width, up to the draft slack (spec/manager.md §15.8)
            if not 1 <= max_cache_length <= self._max_seq_len + self._slack or -(-max_cache_length // page) < need:
                return None  # the policy raises
            need = -(-max_cache_length // page)
        cols = LUT_ALIGN * (-(-need // LUT_ALIGN) or 1)
        if self._uses_connector:
            self._post_offloads()  # spec/manager.md §9.2: queued offloads are posted before the forward
        eng = self._engine
        if self._single and not self._scales_stride:
            return KVCacheInputs(tuple(KVCacheInputsPerDevice(
                kv_blocks=self._buffers[r][leaf],  # None in bookkeeping-only mode (spec/manager.md §8)
                lookup_table=self._lut_as(eng.to_device(eng.lookup_table(rows, widths, cols))),  # spec/manager.md §8
                cache_lengths=eng.to_device(np.array(lengths, dtype=np.uint32)),
                max_prompt_length=longest,
                max_cache_length=reach if max_cache_length is None else max_cache_length,
            ) for r, (batch, _, rows, widths, lengths, longest, reach) in enumerate(per)))
        out = []
        paged, states = self._paged_ids, self._state_ids
        for r, (batch, reqs, rows, widths, lengths, longest, reach) in enumerate(per):
            lengths = eng.to_device(np.array(lengths, dtype=np.uint32))
            if max_cache_length is not None:
                reach = max_cache_length
            n = len(reqs)
            luts = {}
            # The paged leaves' tables in one engine call: their rows stacked leaf by leaf into one
            # [leaves * n, cols] table, each leaf's inputs binding its n rows (a contiguous view).
            if len(paged) == 1:
                luts[leaf] = eng.to_device(eng.lookup_table(rows, widths, cols))
            else:
                stacked = []
                for lid in paged:
                    stacked += rows if lid == leaf else [q.rows[lid] for q in reqs]
                table = eng.to_device(eng.lookup_table(stacked, widths * len(paged), cols))
                for i, lid in enumerate(paged):
                    luts[lid] = table[i * n : (i + 1) * n]
            if states:  # spec/manager.md §8: one column, the live state page
                stacked = []
                for lid in states:
                    stacked += [q.rows[lid] for q in reqs]
                table = eng.to_device(eng.lookup_table(stacked, [1] * len(stacked), LUT_ALIGN))
                if len(states) == 1:
                    luts[states[0]] = table
                else:
                    for i, lid in enumerate(states):
                        luts[lid] = table[i * n : (i + 1) * n]
            by_leaf = {}
            for lid in self._leaf:
                by_leaf[lid] = self._leaf_inputs(r, lid, luts[lid], lengths, longest, reach)
            out.append(by_leaf)
        if len(self._leaves) == 1:  # one leaf: its inputs, as the policy returns
            (lid,) = self._leaf
            return KVCacheInputs(tuple(p[lid] for p in out))
        return KVCacheInputs(tuple(out))

    def release(self, ctx: TextContext | str) -> None:
        """Free the request's pages, tail first, and forget it (same contract as the reference)."""
        if self._closed or self._loads:
            return super().release(ctx)
        req = self._requests.get(ctx.request_id) if type(ctx) is TextContext else None
        if req is None or req.ctx is not ctx:
            req = self._req("release", ctx, allow_id=True)  # raises, a request id, or a replacement context
        if req.dummy:
            del self._requests[req.ctx.request_id]
            return
        # spec/manager.md §14.7: the clock is read (and its reading checked) before anything changes,
        # once: every pool the request lets go in sees that instant
        with self._clock_held:
            expiry = self._claim_expiry(req.ctx)
            del self._requests[req.ctx.request_id]
            if req.load is not None:
                req.load.request_id = None  # a finished load record: nothing lands for it any more
            # spec/manager.md §6: tail first, so a chain's tail is evicted before its head; spec/manager.md
            # §14.2: the request's retention claim merged first
            pools = self._pools[req.replica]
            if self._single:
                row = req.rows[self._conn_leaf]
                if row:
                    pages = _ids(row[::-1])  # int64 ids, converted once for the kernel call
                    self._let_go(pools[self._conn_leaf], pages, req.ctx, expiry)
            else:
                rows = req.rows
                for lid in self._leaf:  # leaf order, as the policy; a slab's leaf pool takes the list as it is
                    row = rows[lid]
                    if row:
                        self._let_go(pools[lid], row[::-1], req.ctx, expiry)
        if self._uses_connector and req.committed:
            self._tier_touch(req.replica, req.hashes[: req.committed])
            self._tier_retain(req.replica, req.hashes[: req.committed], req.ctx)  # spec/manager.md §14.9

    def shutdown(self) -> None:
        """Post queued offloads, wait for every transfer, close the connector (same contract as the
        reference); afterwards every call goes to the policy (spec/manager.md §9.7)."""
        super().shutdown()
