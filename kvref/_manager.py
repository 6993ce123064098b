"""The reference request manager ``PagedKVCacheManager`` (DESIGN §5, spec/manager.md): its front class.

A scheduler claims a request on a replica, ``alloc``-ates the pages its next
forward needs (reusing cached prefixes), builds the paged-attention inputs
with ``runtime_inputs``, commits what the forward wrote with ``step`` and
finally ``release``-s. The policy is this one class, read by concept in one
file each (spec/manager.md §12): here construction, claim, release, queries
and invariants; ``_prefix_hits.py`` the hash chain and the joint device hit;
``_allocation.py`` ``alloc``; ``_commit.py`` ``step``; ``_transfers.py`` the
connector, deferred lookups and transfers in flight; ``_runtime_inputs.py``
the forward's inputs; ``_leaves.py`` the leaf kinds; ``_request.py`` the
request record. It reaches storage only through the engine
(``kvspec.engine.ManagerEngine``): per replica and leaf a ``BlockPool`` holds
the free list, ref counts and prefix index.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from typing import Any, Callable, Sequence

import numpy as np

from kvspec._config import check_int, parse_device
from kvspec._config import is_int as _is_int
from kvspec._connector import KVConnector, NullConnector
from kvspec._manager_types import (
    BlockCount,
    ByteCount,
    KVCacheMetrics,
    KVCacheParams,
    LeafKind,
    PrefixCacheHits,
    TextContext,
    spec_decode_cache_slack,
)
from kvspec._page_store import BookkeepingPageStore, PaddedPageStore, ScaledPageStore
from kvspec.engine import NULL_BLOCK, BlockPool, ManagerEngine
from kvspec.errors import InsufficientBlocksError, insufficient_blocks_message
from kvspec.retention import check_clock, held
from kvspec import hashing

from ._allocation import Allocation
from ._batch import BatchCalls
from ._commit import Commit
from ._leaves import Leaf
from ._manager_engine import ReferenceManagerEngine
from ._prefix_hits import PrefixHits
from ._request import _Load, _Offload, _Request
from ._runtime_inputs import RuntimeInputs
from ._slab import Slab, SlabGeometry, plan_slab_geometry
from ._transfers import Transfers

__all__ = ["PagedKVCacheManager"]

#: Largest value of a size or length argument: block ids, positions and cache
#: lengths are 32-bit in every tensor the manager hands out (spec/manager.md §1.1).
MAX_INT_ARG = 2**31 - 1


def _slack_note(slack: int) -> str:
    """`` + spec_decode_cache_slack=N`` for a message, or ``""`` without speculative decoding."""
    return f" + spec_decode_cache_slack={slack}" if slack else ""


def _slab_geometry(params: KVCacheParams, leaves: list[Leaf]) -> SlabGeometry:
    """spec/manager.md §13.1: the huge block of a multi-leaf manager from its leaves' page bytes; a
    padded page stays a whole number of rows (``head_dim`` elements, or the state's last axis)."""
    rows = {leaf.leaf_id: leaf.row_bytes(params) for leaf in leaves}
    return plan_slab_geometry({leaf.leaf_id: params.page_bytes(leaf.leaf_id) for leaf in leaves}, rows)


def _lut_uint32(table):
    return table


def _lut_int32(table):
    return table.view(np.int32)  # the same bytes: every block id is below 2**31 (spec/manager.md §8)


def _lut_int64(table):
    return table.astype(np.int64)


#: ``lookup_table_dtype`` -> the lookup table as the engine built it (uint32) in that dtype.
_LUT_DTYPES = {"uint32": _lut_uint32, "int32": _lut_int32, "int64": _lut_int64}


class PagedKVCacheManager(PrefixHits, Allocation, Commit, Transfers, RuntimeInputs, BatchCalls):
    """Request-level paged KV cache with prefix caching, replicas and tiers.

    Parameters
    ----------
    params : KVCacheParams
        Geometry, leaves, hashing and tier sizes.
    num_blocks : int
        Pages per replica **including** the null block 0 with one leaf; with
        several leaves, huge blocks of the replica's slab that the leaves
        share (spec/manager.md §13). >= 2; >= 3 with a recurrent leaf and
        prefix caching.
    max_batch_size : int
        Most contexts one replica batch of ``runtime_inputs`` may hold (>= 1).
    max_seq_len : int
        Longest context (>= 1); longer ones are refused with ``ValueError``.
    device : str
        ``"cpu"`` (kvref stores NumPy arrays only).
    connector : KVConnector, optional
        External tiers. ``None``: a ``TieredConnector`` when
        ``params.host_offload_bytes`` or ``disk_offload_bytes`` is non-zero,
        else ``NullConnector()``.
    clock : callable() -> float, optional
        Seconds for retention time-to-live (``time.monotonic`` by default;
        spec/manager.md §14.7); tests inject a fake clock.
    lookup_table_dtype : {"uint32", "int32", "int64"}
        The dtype of ``runtime_inputs``' lookup tables (spec/manager.md §8):
        ``"uint32"`` (MAX's), ``"int32"`` (a zero-copy view of the same table,
        which torch and FlashInfer-style kernels index with directly) or
        ``"int64"`` (one conversion per call, for kernels that take int64 ids).

    Notes
    -----
    Storage per replica: a full or sliding leaf has a buffer
    ``[pages, 2, num_layers, page_size, kv_heads, head_dim]`` of
    ``params.dtype``; a recurrent leaf ``[pages, *state_shape]`` of its
    state dtype. Block 0 of each is the null page. One leaf: ``pages =
    num_blocks``, its own array. Several leaves: ``pages = num_blocks *
    ratio[leaf]`` and every buffer is a view into one ``uint8 [num_blocks,
    huge_bytes]`` slab (``slab_geometry``).

    Examples
    --------
    >>> from kvref import PagedKVCacheManager, KVCacheParams, TextContext
    >>> m = PagedKVCacheManager(KVCacheParams(page_size=4, num_layers=1, kv_heads=1, head_dim=2),
    ...                         num_blocks=9, max_batch_size=4, max_seq_len=32)
    >>> ctx = TextContext("a", list(range(10)))
    >>> m.claim(ctx); _ = m.alloc(ctx)
    >>> m.get_req_blocks_per_leaf(ctx)
    {'full': [1, 2, 3]}
    >>> inp = m.runtime_inputs([[ctx]]).inputs[0]
    >>> inp.lookup_table.shape, int(inp.cache_lengths[0])
    ((1, 8), 0)
    >>> ctx.update(7); m.step(ctx); m.release(ctx)
    """

    def __init__(
        self,
        params: KVCacheParams,
        *,
        num_blocks: int,
        max_batch_size: int,
        max_seq_len: int,
        device: str = "cpu",
        connector: KVConnector | None = None,
        clock: Callable[[], float] | None = None,
        lookup_table_dtype: str = "uint32",
    ):
        o = "PagedKVCacheManager"
        clock = check_clock(o, clock)  # spec/manager.md §14.7: retention expiries read this clock
        if not isinstance(lookup_table_dtype, str):
            raise TypeError(f"{o}: lookup_table_dtype={lookup_table_dtype!r}, must be one of {list(_LUT_DTYPES)}")
        if lookup_table_dtype not in _LUT_DTYPES:
            raise ValueError(f"{o}: lookup_table_dtype={lookup_table_dtype!r}, must be one of {list(_LUT_DTYPES)}")
        if not isinstance(params, KVCacheParams):
            raise TypeError(f"{o}: params={params!r}, must be a KVCacheParams")
        # spec/manager.md §1.1: every size is bounded before any arithmetic or allocation.
        num_blocks = check_int(o, "num_blocks", num_blocks, low=2, high=MAX_INT_ARG)
        max_batch_size = check_int(o, "max_batch_size", max_batch_size, low=1, high=MAX_INT_ARG)
        max_seq_len = check_int(o, "max_seq_len", max_seq_len, low=1, high=MAX_INT_ARG)
        engine = type(self).make_engine(params, device)  # spec/manager.md §12: the mechanisms, chosen once
        leaves = [Leaf.make(lid, spec, params.page_size) for lid, spec in params.leaves().items()]
        # The policy's only kind tests: membership lists, built once (every rule is a method of the
        # leaf's class, kvref/_leaves.py; spec/manager.md §3.2).
        full_leaves = [leaf for leaf in leaves if leaf.kind is LeafKind.FULL]  # twin-dedup anchor, tier keys
        recurrent_leaves = [leaf for leaf in leaves if leaf.is_recurrent]  # checkpoints in step
        if recurrent_leaves and params.enable_prefix_caching and num_blocks < 3:
            raise ValueError(f"{o}: num_blocks={num_blocks}, must be >= 3 with a recurrent leaf (live + successor)")
        # spec/manager.md §13.1: several leaves share one slab of huge blocks, each leaf cut at its ratio.
        geometry = _slab_geometry(params, leaves) if len(leaves) > 1 else None
        ratios = geometry.ratios if geometry else {leaf.leaf_id: 1 for leaf in leaves}
        # spec/manager.md §15.8: a speculating request may reach spec_decode_cache_slack past max_seq_len.
        reach = max_seq_len + spec_decode_cache_slack(params)
        for leaf in leaves:  # spec/manager.md §1.6: a pool that cannot hold one max_seq_len request is refused
            need = leaf.pages_to_hold(reach)
            have = (num_blocks - 1) * ratios[leaf.leaf_id]
            if need > have:
                raise ValueError(
                    f"{o}: max_seq_len={max_seq_len}{_slack_note(reach - max_seq_len)} needs {need} pages of leaf "
                    f"{leaf.leaf_id!r} for one request, "
                    f"the pool has {have} (num_blocks={num_blocks} less the null page)")
        if geometry is not None:  # spec/manager.md §13.3: the leaves' pages come from the same huge blocks
            need = {leaf.leaf_id: -(-leaf.pages_to_hold(reach) // ratios[leaf.leaf_id]) for leaf in leaves}
            if sum(need.values()) > num_blocks - 1:
                raise ValueError(
                    f"{o}: max_seq_len={max_seq_len}{_slack_note(reach - max_seq_len)} needs {sum(need.values())} "
                    "huge blocks for one request "
                    f"({', '.join(f'{lid!r}: {n}' for lid, n in need.items())}), the slab has {num_blocks - 1} "
                    f"(num_blocks={num_blocks} less the null block)")
        if connector is not None and not isinstance(connector, KVConnector):
            raise TypeError(f"{o}: connector={connector!r} does not implement kvspec.KVConnector")

        self._params = params
        self._num_blocks = num_blocks
        self._max_batch_size = max_batch_size
        self._max_seq_len = max_seq_len
        self._device = device
        self._page = params.page_size
        self._dp = params.data_parallel_degree
        self._caching = params.enable_prefix_caching
        self._leaves = leaves
        self._leaf = {leaf.leaf_id: leaf for leaf in leaves}
        self._paged_leaves = [leaf for leaf in leaves if not leaf.is_recurrent]  # rows of block ids
        self._salted_roots: OrderedDict[bytes, bytes] = OrderedDict()  # bounded LRU (spec/manager.md §3.1)
        self._closed = False  # set by shutdown (spec/manager.md §9.7)
        # One full leaf: tier keys are the block hashes and the device pages are the tiers' pages. Several
        # leaves (or one non-full leaf): spec/manager.md §9.8 and spec/tiers.md §12 (per-leaf keys, units).
        self._simple = len(leaves) == 1 and bool(full_leaves)
        self._conn_leaf = self._paged_leaves[0].leaf_id
        # The leaf whose rows carry the chain for twin dedup (spec/manager.md §5.1): a full leaf if any.
        self._anchor = full_leaves[0] if full_leaves else self._paged_leaves[0]
        self._commit_order = [self._anchor] + [leaf for leaf in self._paged_leaves if leaf is not self._anchor]
        self._sliding_leaves = [leaf for leaf in leaves if leaf.is_sliding]  # slid in step
        self._paged_ids = [leaf.leaf_id for leaf in self._paged_leaves]
        self._recurrent_leaves = recurrent_leaves
        # spec/tiers.md §12: the connector leaf first, then the others in declaration order; a full
        # anchor leaf keys its pages by the block hash itself, every other leaf by leaf_block_key.
        self._unit_order = [self._leaf[self._conn_leaf]] + [lf for lf in leaves if lf.leaf_id != self._conn_leaf]
        self._plain_leaf = self._anchor.leaf_id if full_leaves else None
        self._units: dict[str, int] = {}
        self._unit_base: dict[str, int] = {}
        # spec/manager.md §15 (speculative decoding), decided once: MAX's slack terms.
        self._drafts = params.num_draft_tokens
        self._draft_extra = 1 if self._drafts and params.num_draft_tokens_per_step == self._drafts else 0
        self._slack = spec_decode_cache_slack(params)
        # spec/manager.md §16 (FP8 K/V): per-page float32 scales beside every full/sliding page.
        self._scales_shape = params.page_scales_shape
        #: elements from one page's scales to the next (the inputs' ``scales_page_stride``; 0: no scales)
        self._scales_stride = math.prod(self._scales_shape) if self._scales_shape else 0

        self._engine = engine
        # spec/manager.md §13: num_blocks counts huge blocks; leaf l has num_blocks * ratio[l] page ids.
        self._geometry = geometry
        self._ratios = ratios
        self._slabs: list[Slab] = [
            Slab(engine.slab_table(num_blocks, len(leaves)),
                 {leaf.leaf_id: engine.block_pool(num_blocks * ratios[leaf.leaf_id]) for leaf in leaves}, ratios)
            for _ in range(self._dp)] if geometry is not None else []
        self._pools: list[dict[str, BlockPool]] = (
            [dict(slab.pools) for slab in self._slabs] if self._slabs else
            [{leaf.leaf_id: engine.block_pool(num_blocks) for leaf in leaves} for _ in range(self._dp)])
        self._clock = clock
        #: ``with self._clock_held:`` reads a user's clock once for a call (spec/manager.md §14.7), decided here
        self._clock_held = held(clock)
        self._lut_as = _LUT_DTYPES[lookup_table_dtype]  # spec/manager.md §8: the tables' dtype, decided here
        for pools in self._pools:
            for pool in pools.values():
                pool.clock = clock
        # spec/manager.md §1.3 / §1.5: buffers exist only when params.allocate_buffers (else nothing is O(bytes)).
        self._holds_bytes = params.allocate_buffers
        # spec/manager.md §13.1: with a slab, one uint8 [num_blocks, huge_bytes] per replica, every leaf's
        # buffer a view into it with page stride padded_bytes[leaf].
        self._slab_bytes = [engine.slab_buffer(num_blocks, geometry.huge_bytes) if self._holds_bytes else None
                            for _ in range(self._dp)] if geometry is not None else []
        self._buffers: list[dict[str, Any]] = [
            {leaf.leaf_id: (self._leaf_buffer(r, leaf) if self._holds_bytes else None) for leaf in leaves}
            for r in range(self._dp)]
        # spec/manager.md §13.1: a slab leaf's page stride in elements, -1 when packed (MAX's convention)
        self._page_strides = {
            leaf.leaf_id: np.array([-1 if geometry.padded_bytes[leaf.leaf_id] == geometry.page_bytes[leaf.leaf_id]
                                    else geometry.padded_bytes[leaf.leaf_id]
                                    // engine.storage_dtype(self._leaf_dtype(leaf)).itemsize], np.int64)
            for leaf in leaves} if geometry is not None else {}
        # spec/manager.md §16: scales [num_blocks, 2, num_layers, kv_heads] float32 per replica and
        # full/sliding leaf, zero-filled; none without bytes or without an FP8 dtype.
        self._scales: list[dict[str, Any]] = [
            {leaf.leaf_id: engine.page_buffer((self._leaf_pages(leaf), *self._scales_shape), np.float32)
             for leaf in self._paged_leaves} if self._scales_shape and self._holds_bytes else {}
            for _ in range(self._dp)]

        self._requests: dict[str, _Request] = {}
        self._metrics = KVCacheMetrics()
        self._pins: list[Counter] = [Counter() for _ in range(self._dp)]
        # spec/manager.md §9.8: pins of a manager with several leaves, per replica {(leaf_id, page): count}
        self._leaf_pins: list[Counter] = [Counter() for _ in range(self._dp)]
        # per replica: committed runs (hashes, int32 tokens [n, page]) waiting for the next post
        self._offload_queue: list[list[tuple[list[bytes], np.ndarray]]] = [[] for _ in range(self._dp)]
        self._loads: list[_Load] = []
        self._offloads: list[_Offload] = []

        if connector is None:
            if params.host_offload_bytes or params.disk_offload_bytes:
                from ._tiers import TieredConnector

                connector = TieredConnector(
                    params.host_offload_bytes, params.disk_offload_bytes, params.disk_offload_dir
                )
            else:
                connector = NullConnector()
        self._connector = connector
        # spec/manager.md §9.1: the null connector is never called on the hot path.
        self._uses_connector = self._caching and not isinstance(connector, NullConnector)
        # spec/manager.md §9.2: a connector that counts its finished transfers lets the drain skip
        # polling in-flight offloads while the count is unchanged (decided once, here).
        self._completions = getattr(connector, "completed_transfers", None) if self._uses_connector else None
        self._completions_seen = -1
        # spec/manager.md §1.4: one page store per replica, built by the engine over the final buffers.
        if self._holds_bytes and self._scales_shape:
            # spec/manager.md §16: one payload per page, values then scales, so every tier moves both.
            stores = [ScaledPageStore(self._page_store(r, self._conn_leaf),
                                      engine.page_store(self._scales[r][self._conn_leaf])) for r in range(self._dp)]
        elif self._holds_bytes:
            stores = [self._page_store(r, self._conn_leaf) for r in range(self._dp)]
        else:
            stores = [BookkeepingPageStore(num_blocks * ratios[self._conn_leaf], params.kv_page_bytes)
                      for _ in range(self._dp)]
        # spec/tiers.md §2: one live owner per connector; a second live manager is refused.
        if not self._simple:  # spec/tiers.md §12: every leaf's pages, as units of the first paged leaf's page
            stores = self._leaf_unit_stores(stores)
        self._conn_stores = stores  # (a guarded batch journals a load's pages through them, spec/manager.md §17.3)
        connector.attach(stores, params, owner=self)

    @classmethod
    def make_engine(cls, params: KVCacheParams, device: str) -> ManagerEngine:
        """The engine this manager runs on (spec/manager.md §12), chosen once at construction.

        ``kvref`` serves ``device="cpu"`` with :class:`ReferenceManagerEngine`;
        ``kvfast`` overrides this method (Numba on the CPU, CuPy on a GPU).

        Raises
        ------
        ValueError
            A malformed device, or one this engine does not serve.
        """
        o = "PagedKVCacheManager"
        kind, _ = parse_device(o, device)
        if kind != "cpu":
            raise ValueError(f"{o}: device={device!r}, kvref stores NumPy arrays and supports only 'cpu'")
        return ReferenceManagerEngine()

    def _leaf_shape(self, leaf: Leaf) -> tuple[int, ...]:
        return (self._leaf_pages(leaf), *leaf.page_shape(self._params))

    def _leaf_pages(self, leaf: Leaf) -> int:
        """Page ids of ``leaf`` per replica: ``num_blocks * ratio`` (``num_blocks`` without a slab)."""
        return self._num_blocks * self._ratios[leaf.leaf_id]

    def _store_buffer(self, r: int, lid: str):
        """The buffer the tiers' page store of leaf ``lid`` covers: the leaf's buffer, or, for a padded
        slab leaf (a strided view), its pages as contiguous ``uint8 [pages, padded_bytes]`` rows of the
        slab (``_page_store`` cuts the padding off; spec/manager.md §13.1)."""
        g = self._geometry
        if g is None or g.padded_bytes[lid] == g.page_bytes[lid]:
            return self._buffers[r][lid]
        return self._slab_bytes[r].reshape(self._num_blocks * g.ratios[lid], g.padded_bytes[lid])

    def _page_store(self, r: int, lid: str):
        """The tiers' page store of leaf ``lid``'s values on replica ``r``: its data bytes only
        (spec/manager.md §13.1: padding never travels, so a tier unit is ``params.page_bytes``
        whatever the slab's geometry; a padded page store failed ``attach``'s size check)."""
        store = self._engine.page_store(self._store_buffer(r, lid))
        g = self._geometry
        if g is None or g.padded_bytes[lid] == g.page_bytes[lid]:
            return store
        return PaddedPageStore(store, g.page_bytes[lid])

    def _leaf_buffer(self, r: int, leaf: Leaf):
        """Replica ``r``'s buffer of ``leaf``: its own array, or its view into the replica's slab."""
        if not self._slabs:
            return self._engine.page_buffer(self._leaf_shape(leaf), self._leaf_dtype(leaf))
        return self._engine.leaf_view(self._slab_bytes[r], self._geometry.padded_bytes[leaf.leaf_id],
                                      self._leaf_shape(leaf), self._leaf_dtype(leaf))

    def _leaf_dtype(self, leaf: Leaf):
        return leaf.dtype(self._params)

    # ================================================================== properties

    @property
    def params(self) -> KVCacheParams:
        """The ``KVCacheParams`` the manager was built with."""
        return self._params

    @property
    def slab_geometry(self) -> SlabGeometry | None:
        """How each replica's slab is cut (spec/manager.md §13.1): huge block bytes, pages per huge
        block, data and padded bytes per page of each leaf; None with a single leaf (no slab)."""
        return self._geometry

    @property
    def chunk_alignment_tokens(self) -> int:
        """``page_size`` when prefix caching is on and a recurrent leaf exists, else 0.

        spec/manager.md §2.4: chunks then end at page boundaries so state checkpoints publish.
        """
        if self._caching and self._recurrent_leaves:
            return self._page
        return 0

    @property
    def effective_max_seq_length(self) -> int:
        """Longest context one forward can take on an empty pool:
        ``min(max_seq_len, (num_blocks - 1) * page_size - spec_decode_cache_slack(params))``
        (at least 0; the slack is 0 without speculative decoding). With a slab (spec/manager.md
        §13.5), the longest one whose pages of every leaf fit the huge blocks together."""
        if not self._slabs:
            return max(0, min(self._max_seq_len, (self._num_blocks - 1) * self._page - self._slack))

        def fits(n: int) -> bool:  # one request of n tokens on an empty slab (the pages spec/manager.md §1.6 counts)
            return sum(-(-leaf.pages_to_admit(n + self._slack, self._caching) // self._ratios[leaf.leaf_id])
                       for leaf in self._leaves) <= self._num_blocks - 1

        lo, hi = 0, self._max_seq_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    # ================================================================== validation helpers

    def _replica(self, op: str, replica_idx) -> int:
        if not _is_int(replica_idx):
            raise TypeError(f"{op}: replica_idx={replica_idx!r}, must be an int")
        r = int(replica_idx)
        if not 0 <= r < self._dp:
            raise IndexError(f"{op}: replica_idx={r} out of range [0, {self._dp})")
        return r

    @staticmethod
    def _ctx(op: str, ctx) -> TextContext:
        if not isinstance(ctx, TextContext):
            raise TypeError(f"{op}: ctx={ctx!r}, must be a TextContext")
        return ctx

    def _req(self, op: str, ctx, *, allow_id: bool = False) -> _Request:
        req = self._find_req(op, ctx, allow_id=allow_id)
        if isinstance(ctx, TextContext) and req.ctx is not ctx:
            req.ctx = ctx  # spec/manager.md §2.3: a new context object for a claimed id replaces the old one
        return req

    def _find_req(self, op: str, ctx, *, allow_id: bool = False) -> _Request:
        """The record of ``ctx`` (a request id with ``allow_id``) after ``_req``'s checks and errors,
        a replacement context checked but not adopted (a batch's checks, spec/manager.md §17.2)."""
        if allow_id and isinstance(ctx, str):
            rid = ctx
        else:
            rid = self._ctx(op, ctx).request_id
        req = self._requests.get(rid)
        if req is None:
            raise ValueError(f"{op}: request_id={rid!r} is not claimed, so it holds no pages; call claim first")
        if isinstance(ctx, TextContext) and req.ctx is not ctx:
            n = len(req.hashes) * self._page
            if not np.array_equal(req.ctx.tokens[:n], ctx.tokens[:n]):
                raise ValueError(f"{op}: request_id={rid!r} was claimed with other tokens")
        return req

    def _check_len(self, op: str, ctx: TextContext) -> None:
        if len(ctx) > self._max_seq_len:
            raise ValueError(f"{op}: len(ctx)={len(ctx)} > max_seq_len={self._max_seq_len}")

    def _check_no_rewind(self, op: str, req: _Request, ctx: TextContext) -> None:
        """spec/manager.md §11.21: a claimed request never rewinds into its published pages (the
        next forward would overwrite K/V other requests may share)."""
        if ctx.processed_length < req.committed * self._page:
            raise ValueError(
                f"{op}: request_id={ctx.request_id!r} processed_length={ctx.processed_length} < "
                f"{req.committed * self._page} tokens already published in its pages; a claimed request "
                "must not rewind into them: release it, reset the context and claim it again"
            )
        if ctx.processed_length < req.shared_floor:  # spec/manager.md §19: pages shared with a fork
            raise ValueError(
                f"{op}: request_id={ctx.request_id!r} processed_length={ctx.processed_length} < "
                f"{req.shared_floor} tokens in pages shared with a fork; a claimed request must not rewind "
                "into them: release it, reset the context and claim it again"
            )

    def _required_blocks(self, ctx: TextContext) -> int:
        return -(-self._seq_len(ctx) // self._page)

    def _seq_len(self, ctx: TextContext) -> int:
        """KV slots the next forward may touch (MAX's ``_compute_seq_len``, spec/manager.md §15):
        ``current_position`` without speculation, else ``current_position +
        len(maybe_accepted_draft_tokens) + 2 * num_draft_tokens + block_draft_extra``."""
        if not self._drafts:
            return ctx.current_position
        state = ctx._spec_decoding_state  # read without creating it (kvspec.TextContext's lazy slot)
        maybe = len(state.maybe_accepted_draft_tokens) if state is not None else 0
        return ctx.current_position + maybe + 2 * self._drafts + self._draft_extra

    def _check_drafts(self, op: str, ctx: TextContext, where: str = "ctx") -> None:
        """spec/manager.md §15: each draft list is a list, tuple or 1-D array of at most
        ``num_draft_tokens`` entries (``TypeError`` / ``ValueError``)."""
        state = ctx._spec_decoding_state
        if state is None:
            return
        for name in ("draft_tokens_to_verify", "maybe_accepted_draft_tokens"):
            drafts = getattr(state, name)
            if not (isinstance(drafts, (list, tuple)) or (isinstance(drafts, np.ndarray) and drafts.ndim == 1)):
                raise TypeError(f"{op}: {where}.spec_decoding_state.{name}={drafts!r}, must be a list, tuple or "
                                "1-D array of ints")
            if len(drafts) > self._drafts:
                raise ValueError(f"{op}: len({where}.spec_decoding_state.{name})={len(drafts)} > "
                                 f"params.num_draft_tokens={self._drafts}")

    def _check_open(self, op: str) -> None:
        """spec/manager.md §9.7: after ``shutdown`` every mutating call raises, state unchanged."""
        if self._closed:
            raise RuntimeError(f"{op}: the manager is shut down")

    # ================================================================== claim / contains / release

    def claim(self, ctx: TextContext, replica_idx: int = 0) -> None:
        """Pin ``ctx`` to a replica with empty rows.

        Parameters
        ----------
        ctx : TextContext
        replica_idx : int
            ``0 <= replica_idx < data_parallel_degree``.

        Raises
        ------
        TypeError
            ``ctx`` is not a TextContext or ``replica_idx`` not an int.
        IndexError
            ``replica_idx`` out of range.
        ValueError
            Already claimed (on any replica), or ``len(ctx) > max_seq_len``.
            State is unchanged.
        """
        r = self._check_claimable("claim", ctx, replica_idx)
        self._requests[ctx.request_id] = self._new_request(ctx, r)

    def _check_claimable(self, op: str, ctx: TextContext, replica_idx) -> int:
        """The checks of ``claim`` and ``alloc_dummy`` (spec/manager.md §2): open, a context, a replica
        index, not claimed on any replica, within ``max_seq_len``; returns the replica."""
        self._check_open(op)
        self._ctx(op, ctx)
        r = self._replica(op, replica_idx)
        old = self._requests.get(ctx.request_id)
        if old is not None:
            raise ValueError(f"{op}: request_id={ctx.request_id!r} is already claimed, on replica {old.replica}")
        self._check_len(op, ctx)
        return r

    def _new_request(self, ctx: TextContext, r: int) -> _Request:
        """A claimed request's state: empty rows on replica ``r``."""
        return _Request(ctx=ctx, replica=r, rows={leaf.leaf_id: [] for leaf in self._leaves})

    def contains(self, ctx: TextContext | str) -> bool:
        """Whether the request is claimed on any replica.

        Parameters
        ----------
        ctx : TextContext or str
            The context or its request id.

        Raises
        ------
        TypeError
            ``ctx`` neither a TextContext nor a str.
        """
        if isinstance(ctx, str):
            return ctx in self._requests
        return self._ctx("contains", ctx).request_id in self._requests

    def release(self, ctx: TextContext | str) -> None:
        """Free the request's pages, tail first, and forget it.

        spec/manager.md §6: rows are freed in reverse so a chain's tail is evicted
        before its head; published pages stay hittable until evicted. A load
        still in flight keeps its pages pinned until it lands (then they are
        published) or fails (then they are freed unpublished).

        Raises
        ------
        TypeError
            ``ctx`` neither a TextContext nor a str.
        ValueError
            Not claimed (also on a second release). State is unchanged.
        """
        self._check_open("release")  # spec/manager.md §9.7: validated before the request is forgotten
        req = self._req("release", ctx, allow_id=True)
        r = req.replica
        if req.dummy:
            del self._requests[req.ctx.request_id]
            return
        # spec/manager.md §14.7: the clock is read (and its reading checked) before anything changes,
        # once: every pool the request lets go in sees that instant
        with self._clock_held:
            expiry = self._claim_expiry(req.ctx)
            del self._requests[req.ctx.request_id]
            if req.load is not None:
                req.load.request_id = None
            for leaf in self._leaves:
                self._let_go(self._pools[r][leaf.leaf_id], req.rows[leaf.leaf_id][::-1], req.ctx, expiry)
        if self._uses_connector and req.committed:
            self._tier_touch(r, req.hashes[: req.committed])
            self._tier_retain(r, req.hashes[: req.committed], req.ctx)  # spec/manager.md §14.9

    # ================================================================== fork (spec/manager.md §19)

    def fork(self, parent_ctx: TextContext, child_ctx: TextContext) -> None:
        """Claim ``child_ctx`` as a copy-on-write fork of the running request ``parent_ctx``.

        For beam search and ``n > 1`` sampling (vLLM forks a sequence by sharing
        its blocks; SGLang shares through its radix tree). The child is claimed
        on the parent's replica with the parent's ``processed_length`` tokens
        already in its rows: per full or sliding-window leaf, the parent's
        **full** pages below ``processed_length`` are shared (one more
        reference each; a sliding leaf's null slots below the window stay
        null) and the partial last page is copied into a fresh page (values
        and, with FP8, scales); per recurrent leaf, the live state is copied
        into a fresh live page. The child's hash chain and committed count are
        the parent's over the shared blocks, so its later ``step`` publishes
        exactly as the parent's would and ``release`` frees exactly what it
        holds. Neither request's next forward writes a shared page (writes
        start at ``processed_length``), and neither may rewind below the
        shared pages (``alloc`` refuses it, spec/manager.md §11.21).

        Parameters
        ----------
        parent_ctx : TextContext
            A claimed request in phase ``"running"`` (allocated and stepped,
            no load in flight, not a dummy) with ``processed_length >= 1``.
        child_ctx : TextContext
            An unclaimed context whose first ``parent.processed_length`` tokens
            are the parent's (same ``cache_salt``), with at least one token
            after them (its own continuation: a different sampled token, a
            beam's token), and ``processed_length`` either 0 (then ``fork``
            marks the shared tokens processed, ``skip_processing``) or the
            parent's. Its ``cached_prefix_length`` and
            ``cached_prefix_external_length`` become the parent's.

        Raises
        ------
        TypeError
            A context is not a ``TextContext``.
        ValueError
            Manager shut down (``RuntimeError``); parent unclaimed, a dummy,
            not running or with nothing processed; child already claimed, too
            long, with other tokens or salt, with no token after the shared
            prefix, or a ``processed_length`` other than 0 or the parent's.
        InsufficientBlocksError
            The replica has no free or evictable page for a copied page (the
            partial page of a full/sliding leaf, the live state of a recurrent
            leaf); with several leaves the slab's joint check names the first
            leaf it cannot serve. Every raise leaves all state unchanged.

        Examples
        --------
        >>> from kvref import PagedKVCacheManager, KVCacheParams, TextContext
        >>> m = PagedKVCacheManager(KVCacheParams(page_size=4, num_layers=1, kv_heads=1, head_dim=2),
        ...                         num_blocks=9, max_batch_size=4, max_seq_len=32)
        >>> a = TextContext("a", list(range(6)))
        >>> m.claim(a); _ = m.alloc(a); a.update(6); m.step(a)
        >>> b = TextContext("b", list(range(6)) + [9])   # the same 6 tokens, another sample
        >>> m.fork(a, b)
        >>> m.get_req_blocks_per_leaf(a), m.get_req_blocks_per_leaf(b), b.processed_length
        ({'full': [1, 2]}, {'full': [1, 3]}, 6)
        """
        op = "fork"
        self._check_open(op)
        if not isinstance(parent_ctx, TextContext):
            raise TypeError(f"{op}: parent_ctx={parent_ctx!r}, must be a TextContext")
        if not isinstance(child_ctx, TextContext):
            raise TypeError(f"{op}: child_ctx={child_ctx!r}, must be a TextContext")
        old = self._requests.get(child_ctx.request_id)
        if old is not None:
            raise ValueError(f"{op}: child_ctx request_id={child_ctx.request_id!r} is already claimed, on replica "
                             f"{old.replica}")
        req = self._req(op, parent_ctx)  # spec/manager.md §2.2, §2.3: unclaimed raises; a replacement is adopted
        parent = req.ctx
        rid = parent.request_id
        if req.dummy:
            raise ValueError(f"{op}: parent request_id={rid!r} is a dummy row (alloc_dummy), it holds no pages")
        if req.phase != "running":
            raise ValueError(f"{op}: parent request_id={rid!r} is {req.phase!r}, must be 'running' (allocated "
                             "and stepped, no load in flight)")
        p = parent.processed_length
        if p == 0:
            raise ValueError(f"{op}: parent request_id={rid!r} processed_length=0, nothing to share; claim the "
                             "child instead")
        if len(child_ctx) > self._max_seq_len:
            raise ValueError(f"{op}: len(child_ctx)={len(child_ctx)} > max_seq_len={self._max_seq_len}")
        cp = child_ctx.processed_length
        if cp not in (0, p):
            raise ValueError(f"{op}: child_ctx.processed_length={cp}, must be 0 (fork marks the shared tokens "
                             f"processed) or the parent's {p}")
        left = child_ctx.active_length - p if cp == 0 else len(child_ctx) - p  # tokens the child computes next
        if left < 1:
            raise ValueError(f"{op}: child_ctx request_id={child_ctx.request_id!r} has no token to compute after "
                             f"the parent's processed_length={p} (len={len(child_ctx)}, "
                             f"active_length={child_ctx.active_length})")
        mine, theirs = child_ctx.tokens[:p], parent.tokens[:p]
        diff = np.flatnonzero(mine != theirs)
        if diff.size:
            i = int(diff[0])
            raise ValueError(f"{op}: child_ctx.tokens[{i}]={int(mine[i])} but the parent's tokens[{i}]="
                             f"{int(theirs[i])}; the child must start with the parent's {p} processed tokens")
        if hashing.salt_bytes(child_ctx.cache_salt) != hashing.salt_bytes(parent.cache_salt):
            raise ValueError(f"{op}: child_ctx.cache_salt={child_ctx.cache_salt!r} != the parent's "
                             f"{parent.cache_salt!r}; shared pages belong to one hash chain")
        self._check_drafts(op, child_ctx, "child_ctx")  # spec/manager.md §15.4
        r, page = req.replica, self._page
        full = p // page  # pages wholly below processed_length: shared
        pools = self._pools[r]
        # spec/manager.md §19: per leaf, (shared pages, the page to copy or None) in leaf order
        plan: dict[str, tuple[list[int], int | None]] = {}
        for leaf in self._leaves:
            row = req.rows[leaf.leaf_id]
            if leaf in self._recurrent_leaves:  # (the membership list __init__ built, spec/manager.md §12)
                plan[leaf.leaf_id] = ([], row[0])  # the live state
            else:
                src = row[full] if p % page else NULL_BLOCK
                plan[leaf.leaf_id] = (row[:full], src if src != NULL_BLOCK else None)
        demand = {lid: 1 for lid, (_, src) in plan.items() if src is not None}
        # spec/manager.md §13.3: with a slab the leaves' copies are drawn from it together
        if self._slabs:
            short = self._slabs[r].shortfall(demand, None)
            if short is not None:
                lid, n, free = short
                raise InsufficientBlocksError(insufficient_blocks_message(op, child_ctx.request_id, n, lid, free, r))
        else:
            for lid, n in demand.items():
                if n > pools[lid].num_free:
                    raise InsufficientBlocksError(
                        insufficient_blocks_message(op, child_ctx.request_id, n, lid, pools[lid].num_free, r))
        # ---- commit (nothing below can fail); spec/manager.md §14.7: one clock reading for every draw
        with self._clock_held:
            rows: dict[str, list[int]] = {}
            for leaf in self._leaves:
                lid = leaf.leaf_id
                shared, src = plan[lid]
                pool = pools[lid]
                for b in shared:
                    if b != NULL_BLOCK:
                        pool.touch(b)
                row = list(shared)
                if src is not None:
                    dst = pool.allocate_one()
                    if self._holds_bytes:  # spec/manager.md §1.5: no bytes, no copies
                        buf = self._buffers[r][lid]
                        self._engine.copy_page(buf, dst, buf, src)
                        scales = self._scales[r].get(lid)
                        if scales is not None:  # spec/manager.md §16: a page's scales travel with its values
                            self._engine.copy_page(scales, dst, scales, src)
                    row.append(dst)
                rows[lid] = row
        child = self._new_request(child_ctx, r)
        child.rows = rows
        child.hashes = list(req.hashes[:full])
        child.committed = min(req.committed, full)
        child.nulled = dict(req.nulled)
        child.shared_floor = full * page
        req.shared_floor = max(req.shared_floor, full * page)
        if cp == 0:
            child_ctx.skip_processing(p)
        child_ctx.cached_prefix_length = parent.cached_prefix_length
        child_ctx.cached_prefix_external_length = parent.cached_prefix_external_length
        self._requests[child_ctx.request_id] = child

    # ================================================================== queries

    def num_req_blocks(self, ctx: TextContext) -> int:
        """Blocks the next forward reaches, ``ceil(current_position / page_size)`` (with speculative
        decoding ``ceil(seq_len / page_size)``, spec/manager.md §15.3).

        The request's lookup-table width; works on unclaimed contexts.
        Raises ``TypeError`` for a non-TextContext.
        """
        return self._required_blocks(self._ctx("num_req_blocks", ctx))

    def get_req_blocks_per_leaf(self, ctx: TextContext) -> dict[str, list[int]]:
        """``{leaf_id: block ids}`` of a claimed request (copies; 0 = null).

        Full and sliding rows have equal length (sliding slots below the
        window are 0); a recurrent leaf lists ``[live]`` or ``[live, successor]``.
        Raises ``TypeError`` / ``ValueError`` for a bad or unclaimed ctx.
        """
        req = self._req("get_req_blocks_per_leaf", ctx)
        return {lid: list(row) for lid, row in req.rows.items()}

    def get_prefix_cache_hit_counts(self, ctx: TextContext) -> list[PrefixCacheHits]:
        """Per replica, the blocks of ``ctx``'s prompt it could serve (read-only, for routing).

        ``device_blocks``: the joint device hit (peer-held blocks count when
        cross-replica copy applies); ``external_blocks``: what the connector
        says it holds after that. Works on unclaimed contexts.

        Returns
        -------
        list of PrefixCacheHits
            One per replica, in replica order.

        Raises
        ------
        TypeError
            ``ctx`` is not a TextContext.
        """
        self._ctx("get_prefix_cache_hit_counts", ctx)
        if not self._caching:
            return [PrefixCacheHits(0, 0) for _ in range(self._dp)]
        hashes = self._hashes_for(ctx, [])
        tokens = ctx.tokens
        out = []
        for r in range(self._dp):
            _, dev = self._device_hit(r, hashes, tokens, len(hashes))
            ext = 0
            if self._uses_connector and dev < len(hashes) and not self._simple:
                ext = self._tier_hit("get_prefix_cache_hit_counts", r, hashes, tokens, dev, len(hashes)) - dev
            elif self._uses_connector and dev < len(hashes):
                toks = np.array(tokens[dev * self._page : len(hashes) * self._page], dtype=np.int32)
                ext = min(int(self._connector.lookup(hashes[dev:], toks.reshape(-1, self._page), r)),
                          len(hashes) - dev)
            out.append(PrefixCacheHits(dev, ext))
        return out

    def get_prefix_cache_hit_counts_per_leaf(self, ctx: TextContext, leaf_ids: Sequence[str]) -> list[int]:
        """Per replica, the device blocks of ``ctx``'s prompt the leaves ``leaf_ids`` alone would serve
        (read-only; spec/manager.md §3.6).

        The joint hit of ``get_prefix_cache_hit_counts`` (``device_blocks``: the fixed point of
        every leaf's rule, peer-held blocks counting when cross-replica copy applies) computed
        over the named leaves only, the others ignored. With every leaf named it equals
        ``device_blocks``; with the full-attention leaves of a sliding-window model, the blocks
        past ``device_blocks`` are the ones the full leaves hold but the window cannot reach.
        Changes nothing (no touch, no metric, no connector call). Works on unclaimed contexts.

        Parameters
        ----------
        ctx : TextContext
        leaf_ids : sequence of str
            A non-empty list or tuple of distinct leaf ids of ``params.leaves()``.

        Returns
        -------
        list of int
            One per replica, in replica order.

        Raises
        ------
        TypeError
            ``ctx`` is not a TextContext; ``leaf_ids`` is not a list or tuple of str.
        ValueError
            ``leaf_ids`` is empty, repeats a leaf, or names a leaf this manager does not have.
        """
        op = "get_prefix_cache_hit_counts_per_leaf"
        self._ctx(op, ctx)
        if not isinstance(leaf_ids, (list, tuple)) or not all(isinstance(lid, str) for lid in leaf_ids):
            raise TypeError(f"{op}: leaf_ids={leaf_ids!r}, must be a list or tuple of leaf ids (str)")
        by_id = {leaf.leaf_id: leaf for leaf in self._leaves}
        if not leaf_ids or len(set(leaf_ids)) != len(leaf_ids) or not set(leaf_ids) <= set(by_id):
            raise ValueError(f"{op}: leaf_ids={list(leaf_ids)!r}, must be distinct leaf ids of "
                             f"{sorted(by_id)!r}, at least one")
        if not self._caching:
            return [0] * self._dp
        leaves = [by_id[lid] for lid in leaf_ids]
        hashes = self._hashes_for(ctx, [])
        tokens = ctx.tokens
        return [self._device_hit(r, hashes, tokens, len(hashes), leaves=leaves)[1] for r in range(self._dp)]

    def block_count(self, replica_idx: int = 0) -> BlockCount:
        """``BlockCount(free, total)`` of the replica.

        ``total = num_blocks - 1`` (null excluded); cached-unreferenced pages
        count as free; with several leaves, huge blocks: ``free`` = the parked
        ones (spec/manager.md §13.5).
        Raises ``TypeError`` / ``IndexError`` for a bad ``replica_idx``.
        """
        r = self._replica("block_count", replica_idx)
        if self._slabs:  # spec/manager.md §13.5: huge blocks; parked ones (free or cached-unreferenced) are free
            return BlockCount(self._slabs[r].free_huge_blocks(), self._num_blocks - 1)
        return BlockCount(min(p.num_free for p in self._pools[r].values()), self._num_blocks - 1)

    def pressure_pct(self, replica_idx: int = 0) -> float:
        """Used percentage of the fullest leaf, 0-100 (100 once a leaf cannot allocate).

        Raises ``TypeError`` / ``IndexError`` for a bad ``replica_idx``.
        """
        r = self._replica("pressure_pct", replica_idx)
        total = self._num_blocks - 1  # spec/manager.md §13.5: with a slab, (num_blocks - 1) * ratio pages per leaf
        return max(100.0 * (total * self._ratios[lid] - p.num_free) / (total * self._ratios[lid])
                   for lid, p in self._pools[r].items())

    def host_byte_count(self, replica_idx: int = 0) -> ByteCount:
        """Host tier occupancy (``ByteCount(0, 0)`` without one); tiers are shared by replicas."""
        self._replica("host_byte_count", replica_idx)
        return self._connector.host_byte_count()

    def disk_byte_count(self, replica_idx: int = 0) -> ByteCount:
        """Disk tier occupancy (``ByteCount(0, 0)`` without one); tiers are shared by replicas."""
        self._replica("disk_byte_count", replica_idx)
        return self._connector.disk_byte_count()

    def get_device_buffer(self, replica_idx: int = 0):
        """The replica's page buffer (a live view) with one leaf; ``{leaf_id: buffer}`` otherwise.

        Full/sliding: ``[pages, 2, num_layers, page_size, kv_heads,
        head_dim]`` of ``params.dtype``; recurrent: ``[pages,
        *state_shape]`` of its state dtype (``pages = num_blocks *
        ratio[leaf]`` with several leaves: views into the replica's slab,
        page stride ``slab_geometry.padded_bytes[leaf]``). Raises ``TypeError`` /
        ``IndexError`` for a bad ``replica_idx``; ``RuntimeError`` in
        bookkeeping-only mode (``params.allocate_buffers=False``, spec/manager.md §1.5).
        """
        r = self._replica("get_device_buffer", replica_idx)
        if not self._holds_bytes:
            raise RuntimeError("get_device_buffer: params.allocate_buffers=False (bookkeeping-only mode) "
                               "allocates no K/V buffers")
        if len(self._leaves) == 1:
            return self._buffers[r][self._leaves[0].leaf_id]
        return dict(self._buffers[r])

    def get_device_scales_buffer(self, replica_idx: int = 0):
        """The replica's FP8 scales buffer (a live view) with one full/sliding leaf;
        ``{leaf_id: scales}`` over the full/sliding leaves otherwise.

        ``float32 [num_blocks, 2, num_layers, kv_heads]``: one scale per (page,
        K/V, layer, kv head), zero-filled at construction (spec/manager.md §16).

        Raises
        ------
        TypeError, IndexError
            A bad ``replica_idx``.
        RuntimeError
            ``params.dtype`` is not an FP8 dtype (no scales), or bookkeeping-only
            mode (``params.allocate_buffers=False``) allocates none.
        """
        op = "get_device_scales_buffer"
        r = self._replica(op, replica_idx)
        if not self._scales_shape:
            raise RuntimeError(f"{op}: params.dtype={self._params.dtype!r} keeps no scales; "
                               "only float8_e4m3fn and float8_e5m2 pages carry them")
        if not self._holds_bytes:
            raise RuntimeError(f"{op}: params.allocate_buffers=False (bookkeeping-only mode) allocates no scales")
        if len(self._paged_leaves) == 1:
            return self._scales[r][self._paged_leaves[0].leaf_id]
        return dict(self._scales[r])

    def get_metrics_aggregated(self) -> KVCacheMetrics:
        """Manager plus connector counters (a snapshot)."""
        return self._metrics.copy() + self._connector.metrics

    def take_metrics_aggregated(self) -> KVCacheMetrics:
        """Manager plus connector counters, then zero them."""
        out = self._metrics + self._connector.take_metrics()
        self._metrics = KVCacheMetrics()
        return out

    def reset_prefix_cache(self) -> None:
        """Unpublish every unreferenced page of every replica and leaf, then reset the
        connector; pages held by live requests or pinned by transfers stay published.

        Raises ``RuntimeError`` after ``shutdown``."""
        self._check_open("reset_prefix_cache")
        # The connector first: when its reset raises, the device prefix cache is still as it was.
        self._connector.reset_prefix_cache()
        for pools in self._pools:
            for pool in pools.values():
                pool.reset_prefix_cache()

    def _free_order(self, replica_idx: int = 0, leaf_id: str = "full") -> list[int]:
        """The free list of one pool, front first (for differential tests)."""
        r = self._replica("_free_order", replica_idx)
        if leaf_id not in self._leaf:
            raise ValueError(f"_free_order: leaf_id={leaf_id!r} not in {sorted(self._leaf)}")
        return self._pools[r][leaf_id].free_order()

    # ================================================================== invariants

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant.

        Per replica and leaf: the pool's own invariants with ref counts equal
        to row entries plus transfer pins; live rows hold no null page except
        sliding slots below the window; full/sliding rows of a request have
        equal length; committed pages are
        published under the request's hash of their tokens.
        """
        p = "check_invariants"
        for r in range(self._dp):
            reqs = [q for q in self._requests.values() if q.replica == r and not q.dummy]
            loading = set()  # (leaf_id, page) of in-flight loads and of failed ones not yet undone
            for ld in [ld for ld in self._loads if ld.replica == r] + [q.load for q in reqs if q.load is not None]:
                loading.update((self._conn_leaf, b) for b in ld.pages)
                for lid, pages in (ld.leaf_pages or {}).items():
                    loading.update((lid, b) for b in pages)
            for leaf in self._leaves:
                lid = leaf.leaf_id
                refs: Counter = Counter()
                for q in reqs:
                    for b in q.rows[lid]:
                        if b != NULL_BLOCK:
                            refs[b] += 1
                if lid == self._conn_leaf:
                    refs.update(self._pins[r])
                for (pl, b), c in self._leaf_pins[r].items():  # spec/manager.md §9.8
                    if pl == lid:
                        refs[b] += c
                self._pools[r][lid].check_invariants(dict(refs))
            if self._slabs:  # spec/manager.md §13.4: every huge block parked or claimed, consistently
                self._slabs[r].check_invariants()
            for q in reqs:
                rid, ctx = q.ctx.request_id, q.ctx
                lens = {len(q.rows[leaf.leaf_id]) for leaf in self._paged_leaves}
                assert len(lens) == 1, f"{p}: request {rid!r} rows of unequal length {lens}"
                (n,) = lens  # (processed_length vs rows is the scheduler's side: step checks it)
                for leaf in self._leaves:
                    row = q.rows[leaf.leaf_id]
                    lo = leaf.check_row(p, rid, row, q.nulled)  # the row's shape; its first live slot
                    pool = self._pools[r][leaf.leaf_id]
                    for i in leaf.committed_blocks(lo, min(q.committed, n)):  # spec/manager.md §10.4
                        b = row[i]
                        if (leaf.leaf_id, b) in loading:
                            continue
                        h = q.hashes[i]
                        toks = self._block_tokens(ctx.tokens, i)
                        if pool.block_hash[b] is None:
                            # spec/manager.md §10.4: only a page whose hash another page holds (a collision,
                            # or a twin of another chain) stays unpublished; the chain stops there.
                            assert pool.hash_to_block.get(h) is not None, (
                                f"{p}: request {rid!r} committed block {i} (page {b}) is not published")
                            break
                        assert pool.block_hash[b] == h, f"{p}: page {b} published under another hash than block {i}"
                        assert np.array_equal(pool.block_tokens[b], toks), f"{p}: page {b} tokens differ from block {i}"
            for b, c in self._pins[r].items():
                assert c > 0, f"{p}: replica {r} pin count of block {b} is {c}"
            for (lid, b), c in self._leaf_pins[r].items():
                assert c > 0, f"{p}: replica {r} pin count of leaf {lid!r} page {b} is {c}"
