"""The reference request manager ``PagedKVCacheManager`` (DESIGN §5, spec/manager.md).

A scheduler claims a request on a replica, ``alloc``-ates the pages its next
forward needs (reusing cached prefixes), builds the paged-attention inputs
with ``runtime_inputs``, commits what the forward wrote with ``step`` and
finally ``release``-s. One ``kvref._block_pool.BlockPool`` per replica and
leaf holds the free list, ref counts and prefix index; ``kvspec.hashing``
is the hash chain.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from typing import Any, Callable, Sequence

import numpy as np

from kvspec import hashing
from kvspec._config import check_int, parse_device
from kvspec._connector import KVConnector, NullConnector, leaf_block_key
from kvspec._manager_types import (
    BlockCount,
    ByteCount,
    CompletedTransfer,
    KVCacheInputs,
    KVCacheInputsPerDevice,
    KVCacheMetrics,
    KVCacheParams,
    KVTransfer,
    LeafKind,
    PrefixCacheHits,
    TextContext,
    spec_decode_cache_slack,
)
from kvspec.errors import InsufficientBlocksError, KVLoadFailed, KVLoadRefused
from kvspec.retention import check_clock, expiry_of

from kvspec._page_store import BookkeepingPageStore, LeafUnitStore, PaddedPageStore, ScaledPageStore
from kvspec.engine import NULL_BLOCK, BlockPool, ManagerEngine

from ._leaves import ExtendedResidency, Leaf, Residency, joint_hit
from ._manager_engine import ReferenceManagerEngine
from ._request import _AllocPlan, _Load, _Offload, _Request
from ._slab import Slab, SlabGeometry, plan_slab_geometry
from ._runtime_inputs import lut_columns

__all__ = ["PagedKVCacheManager"]

#: Largest value of a size or length argument: block ids, positions and cache
#: lengths are 32-bit in every tensor the manager hands out (spec/manager.md §1.1).
MAX_INT_ARG = 2**31 - 1

#: Salted roots kept per manager, least recently used dropped first (spec/manager.md §3.1).
ROOT_CACHE_SIZE = 64


#: ``alloc``'s result when nothing is in flight (immutable, shared).
_DONE = CompletedTransfer()


class _AwaitOffloads(Exception):
    """spec/manager.md §4 step 6: the sizing fits once the replica's in-flight offloads complete
    (raised by the check, caught by ``alloc``, which waits and sizes again; never escapes)."""

    def __init__(self, replica: int, message: str):
        super().__init__(message)
        self.replica = replica


def _slack_note(slack: int) -> str:
    """`` + spec_decode_cache_slack=N`` for a message, or ``""`` without speculative decoding."""
    return f" + spec_decode_cache_slack={slack}" if slack else ""


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _slab_geometry(params: KVCacheParams, leaves: list[Leaf]) -> SlabGeometry:
    """spec/manager.md §13.1: the huge block of a multi-leaf manager from its leaves' page bytes; a
    padded page stays a whole number of rows (``head_dim`` elements, or the state's last axis)."""
    rows = {leaf.leaf_id: leaf.row_bytes(params) for leaf in leaves}
    return plan_slab_geometry({leaf.leaf_id: params.page_bytes(leaf.leaf_id) for leaf in leaves}, rows)


# --------------------------------------------------------------------------- manager


def _drop_pins(pins: Counter, keys) -> None:
    """One pin less on each of ``keys``; a key at 0 leaves ``pins`` (``dict.__delitem__``: Counter's
    own ``__delitem__`` is Python code)."""
    for key in keys:
        n = pins[key] - 1
        if n:
            pins[key] = n
        else:
            dict.__delitem__(pins, key)


class PagedKVCacheManager:
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
    ):
        o = "PagedKVCacheManager"
        clock = check_clock(o, clock)  # spec/manager.md §14.7: retention expiries read this clock
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
        if allow_id and isinstance(ctx, str):
            rid = ctx
        else:
            rid = self._ctx(op, ctx).request_id
        req = self._requests.get(rid)
        if req is None:
            raise ValueError(f"{op}: request_id={rid!r} is not claimed, so it holds no pages; call claim first")
        if isinstance(ctx, TextContext) and req.ctx is not ctx:
            # spec/manager.md §2.3: a new context object for a claimed id replaces the old one.
            if np.array_equal(req.ctx.tokens[: len(req.hashes) * self._page],
                              ctx.tokens[: len(req.hashes) * self._page]):
                req.ctx = ctx
            else:
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

    # ================================================================== hashing

    def _root(self, salt) -> bytes:
        """The chain root of ``salt``; at most ``ROOT_CACHE_SIZE`` roots are kept (LRU)."""
        key = hashing.salt_bytes(salt)
        cache = self._salted_roots
        root = cache.get(key)
        if root is None:
            root = hashing.root_hash(self._params.hash_seed, salt)
            cache[key] = root
            if len(cache) > ROOT_CACHE_SIZE:
                cache.popitem(last=False)
        else:
            cache.move_to_end(key)
        return root

    def _check_open(self, op: str) -> None:
        """spec/manager.md §9.7: after ``shutdown`` every mutating call raises, state unchanged."""
        if self._closed:
            raise RuntimeError(f"{op}: the manager is shut down")

    def _block_tokens(self, tokens: np.ndarray, i: int) -> np.ndarray:
        return tokens[i * self._page : (i + 1) * self._page]

    def _hashes_for(self, ctx: TextContext, have: list[bytes]) -> list[bytes]:
        """Chained hashes of ctx's full blocks, never covering the last token (spec/manager.md §3.1)."""
        n = (len(ctx) - 1) // self._page
        if len(have) >= n:
            return have if len(have) == n else have[:n]
        parent = have[-1] if have else self._root(ctx.cache_salt)
        # (ctx._tokens: the context's token buffer; the blocks hashed lie below len(ctx), as in ctx.tokens)
        more = self._engine.chain_hashes(parent, ctx._tokens[len(have) * self._page : n * self._page], self._page,
                                         self._params.hash_algo)
        return list(have) + more

    def _resident(self, r: int, hashes: list[bytes], tokens: np.ndarray) -> dict[str, Residency]:
        """``{leaf_id: Residency}`` of the chain over replica r's pools (spec/manager.md §3.2)."""
        return {leaf.leaf_id: Residency(self._pools[r][leaf.leaf_id], hashes, tokens, self._page)
                for leaf in self._leaves}

    def _peer_source(self, r: int, h: bytes, toks: np.ndarray, lid: str | None = None) -> tuple[int, int] | None:
        """A peer replica's published page of leaf ``lid`` (the connector leaf by default) for ``h``
        (source rotated by hash and destination)."""
        start = int.from_bytes(h[:8], "little") + r
        lid = self._conn_leaf if lid is None else lid
        for j in range(self._dp):
            src = (start + j) % self._dp
            if src == r:
                continue
            page = self._pools[src][lid].lookup(h, toks)
            if page is not None:
                return src, page
        return None

    def _device_hit(self, r: int, hashes: list[bytes], tokens: np.ndarray, cap: int,
                    resident: dict[str, Residency] | None = None, leaves: list[Leaf] | None = None) -> tuple[int, int]:
        """(local hit, peer-extendable hit) in blocks, both ``<= cap``; the joint rule over ``leaves``
        (default every leaf; a subset: spec/manager.md §3.6)."""
        leaves = self._leaves if leaves is None else leaves
        local = joint_hit(leaves, cap, resident or self._resident(r, hashes, tokens))
        reach = local
        if self._simple and self._dp > 1:
            # spec/manager.md §7.3: past the local run, each block is local (after a hole) or peer-held.
            pool = self._pools[r][self._conn_leaf]
            while reach < cap:
                h, toks = hashes[reach], self._block_tokens(tokens, reach)
                if pool.lookup(h, toks) is None and self._peer_source(r, h, toks) is None:
                    break
                reach += 1
        elif self._dp > 1:
            # spec/manager.md §7.3 with several leaves: the joint hit over local and peer residency.
            resident = resident or self._resident(r, hashes, tokens)

            def asker(lid: str):
                return lambda i: resident[lid](i) or self._peer_source(
                    r, hashes[i], self._block_tokens(tokens, i), lid) is not None

            reach = max(local, joint_hit(leaves, cap, {
                leaf.leaf_id: ExtendedResidency(0, asker(leaf.leaf_id)) for leaf in leaves}))
        return local, reach

    def _fits(self, r: int, demand: dict[str, int], taken: dict[str, set[int]]) -> bool:
        """Whether replica ``r`` can draw ``demand[leaf]`` pages after the pages in ``taken`` are referenced."""
        if self._slabs:
            return self._slabs[r].shortfall(demand, taken) is None
        pools = self._pools[r]
        return all(n <= pools[lid].num_free - pools[lid].count_free(list(taken.get(lid, ())))
                   for lid, n in demand.items())

    def _plan_peer_leaves(self, ctx, r, plan, touched, resident, hashes, tokens, local: int, reach: int) -> int:
        """spec/manager.md §7.3 with several leaves: every block a leaf needs for the hit ``reach`` is
        taken locally when held, else copied from a peer into a page the sizing draws (full/sliding:
        published locally; recurrent: the peer's checkpoint into the new live page). All or nothing:
        when the copies and the growth do not fit, the local hit ``local`` stands. Returns the hit."""
        staged, taken = _AllocPlan(), {}  # the peer part, staged: it joins plan only when it fits
        for leaf in self._leaves:
            lid = leaf.leaf_id
            taken[lid] = set()
            got = []
            for i in leaf.needed_blocks(0, reach):
                b = resident[lid].page(i)
                if b is None:
                    src = self._peer_source(r, hashes[i], self._block_tokens(tokens, i), lid)
                    if src is None:  # the residency said local or peer: nothing else can answer
                        return local
                    staged.leaf_peer[(lid, i)] = src
                else:
                    taken[lid].add(b)
                got.append(b)
            leaf.plan_hit(staged, reach, got)
        required = self._required_blocks(ctx)
        # spec/manager.md §4.6 on the staged rows: a slot a peer copy fills (None) is drawn by the sizing;
        # a leaf without a staged row (a recurrent state) holds nothing yet
        held = {lid: len(row) - row.count(None) for lid, row in staged.rows.items()}
        demand = {leaf.leaf_id: max(leaf.grow_need(held.get(leaf.leaf_id, 0), required, self._caching), 0)
                  for leaf in self._leaves}
        if not self._fits(r, demand, taken):
            return local  # best effort: the copies need free pages
        plan.rows.update(staged.rows)
        plan.nulled.update(staged.nulled)
        plan.restore, plan.leaf_peer, plan.restore_peer = staged.restore, staged.leaf_peer, staged.restore_peer
        touched.clear()
        touched.update(taken)
        return reach

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
        op = "claim"
        self._check_open(op)
        self._ctx(op, ctx)
        r = self._replica(op, replica_idx)
        old = self._requests.get(ctx.request_id)
        if old is not None:
            raise ValueError(f"claim: request_id={ctx.request_id!r} is already claimed, on replica {old.replica}")
        self._check_len(op, ctx)
        self._requests[ctx.request_id] = self._new_request(ctx, r)

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
        del self._requests[req.ctx.request_id]
        if req.dummy:
            return
        if req.load is not None:
            req.load.request_id = None
        for leaf in self._leaves:
            self._let_go(self._pools[r][leaf.leaf_id], req.rows[leaf.leaf_id][::-1], req.ctx)
        if self._uses_connector and req.committed:
            self._tier_touch(r, req.hashes[: req.committed])
            self._tier_retain(r, req.hashes[: req.committed], req.ctx)  # spec/manager.md §14.9

    # ================================================================== allocation

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
                and req.rows[self._anchor.leaf_id] and ctx._processed >= req.committed * self._page):
            # spec/manager.md §4 for a request past its admission (it holds pages, no load, no external
            # stage due): the drain (step 2), the sizing (step 6) and the count (step 9) only.
            if ctx._spec_decoding_state is not None:
                self._check_drafts("alloc", ctx)  # spec/manager.md §15: arguments before the drain
            if self._loads or self._offloads:
                self._drain()
            try:
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
        if plan.tier_hit is not None:
            # spec/manager.md §9.8: round 1 (the device part and the sizing) keeps the tiers' answer;
            # round 2 posts the load into the pages round 1 drew.
            self._commit_alloc(req, ctx, plan)
            req.lookup = plan.tier_hit
            return self._commit_alloc(req, ctx, self._plan_alloc(req, ctx, False))
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
            message = (f"alloc: request_id={ctx.request_id!r} needs {n} blocks of leaf {lid!r}, "
                       f"{free} free or evictable on replica {r}")
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
            if plan.leaf_peer:
                pages = self._fill_peer_slots(req, ctx, leaf, row, pages, plan, copies)
            copy = leaf.first_state_copy(row, pages, plan, req)  # spec/manager.md §4.7: a new live state
            if copy is not None:
                copies.append(copy)
                if copy[0] == "leafpeer":  # spec/manager.md §7.3: a peer's checkpoint into the new live page
                    m.cross_replica_blocks_copied += 1
                    m.cross_replica_bytes_copied += self._params.page_bytes(leaf.leaf_id)
            row.extend(pages)
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

    def _fill_peer_slots(self, req, ctx, leaf, row, pages, plan, copies) -> list[int]:
        """spec/manager.md §7.3 with several leaves: the sizing's first pages fill the row slots peer
        copies take (block order), each published locally and copied; returns the rest (all of them
        for a row without such slots, e.g. a recurrent leaf's)."""
        lid, pool, m = leaf.leaf_id, self._pools[req.replica][leaf.leaf_id], self._metrics
        holes = [i for i, b in enumerate(row) if b is None]
        for i, b in zip(holes, pages):
            row[i] = b
            pool.publish(b, req.hashes[i], self._block_tokens(ctx.tokens, i))
            src_r, src = plan.leaf_peer[(lid, i)]
            copies.append(("leafpeer", (lid, src_r), src, b))
            m.cross_replica_blocks_copied += 1
            m.cross_replica_bytes_copied += self._params.kv_page_bytes
        return pages[len(holes):]

    def _run_copies(self, req: _Request, copies: list) -> None:
        """Byte copies of an alloc, run only once nothing can fail any more (spec/manager.md §4.7)."""
        r, eng = req.replica, self._engine
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
        op = "alloc_dummy"
        self._check_open(op)
        self._ctx(op, ctx)
        r = self._replica(op, replica_idx)
        old = self._requests.get(ctx.request_id)
        if old is not None:
            raise ValueError(f"alloc_dummy: request_id={ctx.request_id!r} is already claimed, on replica {old.replica}")
        self._check_len(op, ctx)
        req = _Request(ctx=ctx, replica=r, rows={leaf.leaf_id: [] for leaf in self._leaves}, dummy=True)
        self._size_dummy(req)
        self._requests[ctx.request_id] = req

    # ================================================================== external stage

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
            k2 = k + req.lookup[1]  # the held answer is the joint hit (start_lookup, or round 1)
        elif req.lookup is not None:
            start, held = req.lookup
            k2 = self._tier_hit("alloc", r, hashes, ctx.tokens, k, min(cap, start + held) if start <= k else k)
        else:
            k2 = self._tier_hit("alloc", r, hashes, ctx.tokens, k, cap)
        if k2 <= k:
            return
        if any(plan.need.values()):
            # The sizing has not drawn the destination pages yet: this alloc posts the load in a second
            # round, once they are the request's (spec/manager.md §9.8).
            plan.ext_ran, plan.tier_hit = False, (k, k2 - k)
            return
        items, leaf_pages, leaf_blocks = [], {}, {}
        for leaf in self._leaves:
            lid = leaf.leaf_id
            blocks = leaf.needed_blocks(k, k2)
            row = plan.rows[lid] if lid in plan.rows else req.rows[lid]  # sized: every page is the request's
            dest = leaf.load_destinations(row, blocks)
            leaf_pages[lid], leaf_blocks[lid] = dest, blocks
            items += [(lid, i, b) for i, b in zip(blocks, dest)]
        toks = np.array(ctx.tokens[k * page : k2 * page], dtype=np.int32).reshape(k2 - k, page)
        ids, keys, utoks = self._unit_args(items, hashes[k:k2], toks, k)
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

    # ================================================================== step

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
        req.step_gen += 1
        if not settled:
            # the admission's flags cleared (only those set: each write re-derives req.settled)
            if req.ext_point:
                req.ext_point = False
            if req.lookup is not None:
                req.lookup = None
            if req.lookup_pending:
                req.lookup_pending = False
            if req.load is not None:
                if req.load.state == "failed":
                    req.ran_past = True  # spec/manager.md §9.6: the forward read pages that never landed
                    return
                req.stepped_during_load = True  # pending: commits wait for the landing
                return
        self._commit(req, ctx)
        if self._recurrent_leaves:
            self._checkpoint(req, ctx)
        if self._sliding_leaves:
            self._slide(req, ctx)

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

    def _let_go(self, pool, pages, ctx: TextContext) -> None:
        """The request lets go of ``pages`` (in the order given): its retention claim merged into
        the published ones (spec/manager.md §14.2), then its references dropped (spec/manager.md §6); one engine
        call (``retain_free``)."""
        if self._caching and len(pages):
            pool.retain_free(pages, ctx._retention_priority, expiry_of(ctx._retention_seconds, self._clock))
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

    def _checkpoint(self, req: _Request, ctx: TextContext) -> None:
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
            self._let_go(pool, [live], ctx)  # spec/manager.md §14.2
            req.rows[leaf.leaf_id] = [succ]

    def _slide(self, req: _Request, ctx: TextContext) -> None:
        filled = ctx.processed_length // self._page
        for leaf in self._sliding_leaves:
            cut, lo = leaf.window_start(filled), req.nulled.get(leaf.leaf_id, 0)
            if cut <= lo:
                continue
            row = req.rows[leaf.leaf_id]
            # spec/manager.md §5.3: freed tail first, nulled in place (row index = same tokens in every leaf).
            self._let_go(self._pools[req.replica][leaf.leaf_id], row[lo:cut][::-1], ctx)  # spec/manager.md §14.2
            row[lo:cut] = [NULL_BLOCK] * (cut - lo)
            req.nulled[leaf.leaf_id] = cut

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

    def _raise_short(self, ctx: TextContext, r: int, lid: str, n: int, free: int, taken=()) -> None:
        """spec/manager.md §4 step 6: leaf ``lid`` of replica ``r`` has ``free`` pages for ``n``. Pages
        held only by in-flight offloads (not by a row, a load or the hit in ``taken``) count as
        evictable: when they close the gap, ``_AwaitOffloads`` makes ``alloc`` wait for those
        offloads and size again; otherwise ``InsufficientBlocksError``, nothing changed."""
        message = (f"alloc: request_id={ctx.request_id!r} needs {n} blocks of leaf {lid!r}, "
                   "{} free or evictable on replica " f"{r}")
        if self._offloads and lid == self._conn_leaf:
            extra = len(self._offload_only_pages(r, lid).difference(taken))
            if extra and n <= free + extra:
                raise _AwaitOffloads(r, message.format(free))
            free += extra
        raise InsufficientBlocksError(message.format(free))

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

    # ================================================================== runtime inputs

    def runtime_inputs(self, batches: Sequence[Sequence[TextContext]], *, max_cache_length: int | None = None
                       ) -> KVCacheInputs:
        """The paged-attention inputs of one forward: one batch per replica.

        Parameters
        ----------
        batches : sequence of sequence of TextContext
            ``batches[r]``: the contexts (claimed on replica r, allocated) in row order.
        max_cache_length : int, optional
            CUDA-graph capture bound: the lookup table gets
            ``ceil(max_cache_length / page_size)`` columns (rounded up to 8).

        Returns
        -------
        KVCacheInputs
            ``.inputs[r]``: a ``KVCacheInputsPerDevice`` with one leaf, a
            ``{leaf_id: KVCacheInputsPerDevice}`` dict with several.
            ``lookup_table`` uint32 [batch, cols] (null padded),
            ``cache_lengths`` uint32 [batch] (``processed_length``, plus
            ``len(maybe_accepted_draft_tokens)`` with speculative decoding,
            spec/manager.md §15.7); FP8: ``kv_scales``, ``scales_page_stride``
            and ``scales_lookup_table`` (spec/manager.md §16.3).

        Raises
        ------
        TypeError
            ``batches`` not a sequence of sequences of TextContext; ``max_cache_length`` not an int.
        ValueError
            In this order: ``len(batches) != data_parallel_degree``; every
            batch empty with a recurrent leaf; a context not claimed on its
            replica, repeated, or short of blocks; ``max_cache_length < 1``
            or too small for the batch; a batch over ``max_batch_size``.
            State is unchanged.
        """
        per = self._inputs("runtime_inputs", [leaf.leaf_id for leaf in self._leaves], batches, max_cache_length)
        if len(self._leaves) == 1:
            return KVCacheInputs(tuple(p[self._leaves[0].leaf_id] for p in per))
        return KVCacheInputs(tuple(per))

    def runtime_inputs_for_leaf(self, leaf_id: str, batches: Sequence[Sequence[TextContext]], *,
                                max_cache_length: int | None = None) -> KVCacheInputs:
        """``runtime_inputs`` for one leaf: ``.inputs[r]`` is a ``KVCacheInputsPerDevice``.

        Raises ``ValueError`` for an unknown ``leaf_id``, else as ``runtime_inputs``.
        """
        if leaf_id not in self._leaf:
            raise ValueError(f"runtime_inputs_for_leaf: leaf_id={leaf_id!r} not in {sorted(self._leaf)}")
        per = self._inputs("runtime_inputs_for_leaf", [leaf_id], batches, max_cache_length)
        return KVCacheInputs(tuple(p[leaf_id] for p in per))

    def _inputs(self, op: str, leaf_ids: list[str], batches, max_cache_length) -> list[dict]:
        page = self._page
        self._check_open(op)
        if not isinstance(batches, (list, tuple)):
            raise TypeError(f"{op}: batches={type(batches).__name__}, must be a list of lists of TextContext")
        for r, batch in enumerate(batches):
            if not isinstance(batch, (list, tuple)):
                raise TypeError(f"{op}: batches[{r}]={type(batch).__name__}, must be a list of TextContext")
            for i, c in enumerate(batch):
                if not isinstance(c, TextContext):
                    raise TypeError(f"{op}: batches[{r}][{i}]={c!r}, must be a TextContext")
        if max_cache_length is not None and not _is_int(max_cache_length):
            raise TypeError(f"{op}: max_cache_length={max_cache_length!r}, must be an int or None")
        # spec/manager.md §8 (1)
        if len(batches) != self._dp:
            raise ValueError(f"{op}: len(batches)={len(batches)} but data_parallel_degree={self._dp}; "
                             "the number of batches must match the number of replicas")
        # (2)
        if any(self._leaf[lid].binds_rows for lid in leaf_ids) and not any(batches):
            raise ValueError(f"{op}: every batch is empty, but a recurrent leaf binds rows; "
                             "runtime_inputs called with an empty batch")
        # (3)
        seen = set()
        what = "seq_len" if self._drafts else "current_position"  # spec/manager.md §15
        for r, batch in enumerate(batches):
            for i, c in enumerate(batch):
                req = self._requests.get(c.request_id)
                if req is None:
                    raise ValueError(f"{op}: batches[{r}][{i}] request_id={c.request_id!r} is not claimed; "
                                     "claim and alloc must be called first")
                if req.replica != r:
                    raise ValueError(f"{op}: batches[{r}][{i}] request_id={c.request_id!r} is claimed on "
                                     f"replica {req.replica}, not {r}")
                if c.request_id in seen:
                    raise ValueError(f"{op}: batches[{r}][{i}] request_id={c.request_id!r} appears twice")
                seen.add(c.request_id)
                self._check_drafts(op, c, f"batches[{r}][{i}]")
                reach = self._seq_len(c)
                for lid in leaf_ids:
                    short = self._leaf[lid].row_shortfall(req.rows[lid], reach, what)
                    if short is not None:
                        raise ValueError(f"{op}: batches[{r}][{i}] request_id={c.request_id!r} {short}")
        need = max((self._required_blocks(c) for b in batches for c in b), default=0)
        cols = lut_columns(op, need, page, max_cache_length, batches, self._max_batch_size,
                           self._max_seq_len, self._slack)  # checks (4), (5); spec/manager.md §15: the slack

        self._post_offloads()  # spec/manager.md §9.2: queued offloads are posted before the forward
        eng, requests = self._engine, self._requests
        out = []
        for r, batch in enumerate(batches):
            # what every leaf's inputs share, computed once per batch
            reqs = [requests[c.request_id] for c in batch]
            widths = [self._required_blocks(c) for c in batch]
            lengths, longest, reach = self._batch_extents(batch)
            lengths = eng.to_device(np.array(lengths, dtype=np.uint32))
            bound = int(max_cache_length) if max_cache_length is not None else reach
            per = {}
            for lid in leaf_ids:
                leaf = self._leaf[lid]  # spec/manager.md §8: the leaf says what its column holds
                lut = eng.to_device(eng.lookup_table([q.rows[lid] for q in reqs], leaf.table_widths(widths),
                                                     leaf.table_columns(cols)))
                scales = self._scales[r].get(lid)  # spec/manager.md §16: all three scale fields, or none
                per[lid] = KVCacheInputsPerDevice(
                    kv_blocks=self._buffers[r][lid],  # None in bookkeeping-only mode (spec/manager.md §8)
                    lookup_table=lut,
                    cache_lengths=lengths,
                    max_prompt_length=longest,
                    max_cache_length=bound,
                    kv_scales=scales,
                    scales_page_stride=(None if scales is None else
                                        eng.to_device(np.array([self._scales_stride], np.int64))),
                    scales_lookup_table=None if scales is None else lut,
                    page_stride=None if lid not in self._page_strides else eng.to_device(self._page_strides[lid]),
                )
            out.append(per)
        return out

    def _batch_extents(self, batch) -> tuple[list[int], int, int]:
        """spec/manager.md §8, §15.7: each context's ``cache_lengths`` entry, the batch's
        ``max_prompt_length`` and its ``max_cache_length`` (when not given): ``processed_length``,
        ``active_length`` and ``current_position``; with drafts (MAX's), the drafts in flight count
        as cached, the drafts to verify as prompt, and ``num_draft_tokens`` more as reach."""
        if not self._drafts:
            return ([c._processed for c in batch], max([c._active for c in batch], default=0),
                    max([c._processed + c._active for c in batch], default=0))
        counts = list(map(self._draft_counts, batch))
        return ([c._processed + m for c, (_, m) in zip(batch, counts)],
                max([c._active + v for c, (v, _) in zip(batch, counts)], default=0),
                max([c._processed + c._active + v + m + self._drafts for c, (v, m) in zip(batch, counts)],
                    default=0))

    @staticmethod
    def _draft_counts(ctx: TextContext) -> tuple[int, int]:
        """``(len(draft_tokens_to_verify), len(maybe_accepted_draft_tokens))`` (0, 0 without a state)."""
        state = ctx._spec_decoding_state
        if state is None:
            return 0, 0
        return len(state.draft_tokens_to_verify), len(state.maybe_accepted_draft_tokens)

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
