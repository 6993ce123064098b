"""Offload tiers: ``TieredConnector`` (host arena + disk files, worker threads).

The connector implements ``kvspec.KVConnector`` (DESIGN §5, spec/tiers.md):
the manager calls ``lookup`` and ``load`` inside ``alloc``, ``offload`` for
published blocks, ``touch`` for device hits, and ``poll_transfers`` every
iteration. Copies run on a small pool of real threads
(``concurrent.futures.ThreadPoolExecutor``); each ``load``/``offload``
returns a ``TierTransfer`` whose ``is_complete()`` never blocks.

Where things live:

* ``kvref/_host_tier.py``: ``HostTier``, the fixed arena of page-sized slots
  and its prefix index (hash -> slot, stored tokens), LRU by use;
* ``kvref/_disk_tier.py``: ``DiskTier``, one verified file per block hash,
  LRU by bytes, warm start, and the file format;
* this module: the connector (validation, the lock, write policies,
  transfers, metrics).

Threading: one lock (``self._lock``) guards both indexes, the metrics and the
bookkeeping of in-flight work. Bytes move outside the lock; an entry being
written is invisible (state ``writing``) and an entry being read is pinned,
so neither is evicted or reused under a copy.
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Sequence

import numpy as np

from kvspec import retention as _retention
from kvspec._config import check_int
from kvspec._manager_types import ByteCount, CompletedTransfer, KVCacheMetrics, KVCacheParams, KVTransfer
from kvspec._page_store import HostPageStore, PageStore
from kvspec.errors import KVLoadFailed, KVLoadRefused
from kvspec.hashing import digest_size

from ._disk_tier import DiskBlockError, DiskTier, geometry_of
from ._host_tier import Evicted, HostTier
from ._remote_tier import RemoteTier, RemoteTierMetrics

#: Remote claims remembered for blocks whose write has not landed yet (spec/tiers.md §3.1).
_REMOTE_CLAIMS = 4096
#: ``set(map(type, hashes))`` of a list of bytes, ``set(map(type, block_ids))`` of a list of ints.
_BYTES = {bytes}
_INTS = {int}
_INT32 = np.dtype(np.int32)

__all__ = ["TieredConnector", "TierTransfer", "TierStats", "WRITE_POLICIES", "MAX_TIER_BYTES", "MAX_WORKERS"]

#: ``write_through``: every offload goes to host and disk. ``write_back``:
#: offloads go to host; a block evicted from host is then written to disk.
WRITE_POLICIES = ("write_through", "write_back")
#: Upper bound of ``host_bytes`` and ``disk_bytes`` (4 EiB): sizes are planned in
#: bookkeeping-only mode far beyond any machine, never beyond int64 arithmetic.
MAX_TIER_BYTES = 2**62
#: Upper bound of ``num_workers``.
MAX_WORKERS = 256


def _physical_memory() -> int | None:
    """Bytes of physical memory, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _start_workers(executor: ThreadPoolExecutor, n: int) -> None:
    """Start the ``n`` worker threads of ``executor`` now (at ``attach``), not at the first
    transfers: starting a thread costs its poster ~100 us of CPU time, the scheduler thread's.
    ``n`` jobs that wait for each other need ``n`` threads (the pool starts one per job while
    none is idle)."""
    barrier = threading.Barrier(n)
    jobs = []
    try:
        for _ in range(n):
            jobs.append(executor.submit(barrier.wait, 5.0))
    except RuntimeError:  # no thread can be started now: the pool starts them with the transfers
        barrier.abort()
    wait_futures(jobs)  # a broken barrier (a thread that could not start in time) costs only the wait


# --------------------------------------------------------------------------- transfers


class TierTransfer:
    """A ``KVTransfer`` backed by a worker-thread future.

    ``is_complete()`` never blocks: it returns False while the copy runs,
    True once it landed, and raises ``KVLoadFailed`` (again on every call)
    once a load failed. ``synchronize()`` blocks until the copy ends and
    raises the same way. An offload handle never raises ``KVLoadFailed``: a
    failed offload is dropped and counted.
    """

    __slots__ = ("_future", "_kind", "_landed")

    def __init__(self, future: Future, kind: str, landed: list[bool] | None = None):
        self._future = future
        self._kind = kind
        #: ``[done]``, set by the connector's done callback of ``future`` (a poll while the copy
        #: runs then reads one flag instead of the future's lock); None: ask the future
        self._landed = landed

    def is_complete(self) -> bool:
        landed = self._landed
        if landed is not None:
            if not landed[0]:
                return False
        elif not self._future.done():
            return False
        self._raise_if_failed()
        return True

    def synchronize(self) -> None:
        wait_futures([self._future])
        if self._landed is not None:
            # the waiter may return before the done callback ran: is_complete is True from now on
            self._landed[0] = True
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        err = self._future.exception()  # done: returns at once
        if err is None:
            return
        if isinstance(err, KVLoadFailed):
            raise KVLoadFailed(str(err)) from err
        raise RuntimeError(f"TierTransfer: {self._kind} worker raised {err!r}") from err

    def __repr__(self):
        state = "done" if self._future.done() else "running"
        return f"TierTransfer({self._kind}, {state})"


@dataclass(frozen=True, slots=True)
class TierStats:
    """What the tiers hold and what they threw away (beyond ``KVCacheMetrics``).

    Attributes
    ----------
    host_blocks, disk_blocks : int
        Hittable blocks in each tier now.
    warm_start_indexed : int
        Block files indexed from an existing directory at ``attach``.
    temp_files_removed : int
        Temp files of interrupted writes removed at ``attach``.
    foreign_files : int
        Files in the directory that are not ours (left alone).
    files_rejected : int
        Block files refused: bad header at warm start, or failed
        verification on read (checksum, tokens, truncation, algo, geometry).
    load_failures : int
        Loads whose copy failed in a worker (``KVLoadFailed``).
    disk_write_errors : int
        Block writes that raised ``OSError`` (full or read-only disk).
    reset_failures : int
        ``reset_prefix_cache`` calls refused because the disk tier could not
        persist its new generation (the reset raised ``RuntimeError``).
    stale_writes_dropped : int
        Writes (offloads, promotions, write-back evictions) dropped because a
        ``reset_prefix_cache`` happened after they were posted.
    unlink_failures : int
        Block paths the disk tier could not delete (evicted, reset, refused);
        such a file is never served (older generation, or refused again).
    """

    host_blocks: int = 0
    disk_blocks: int = 0
    warm_start_indexed: int = 0
    temp_files_removed: int = 0
    foreign_files: int = 0
    files_rejected: int = 0
    load_failures: int = 0
    disk_write_errors: int = 0
    reset_failures: int = 0
    stale_writes_dropped: int = 0
    unlink_failures: int = 0


# --------------------------------------------------------------------------- connector


class TieredConnector:
    """Host and disk offload tiers for a ``PagedKVCacheManager`` (``spec/tiers.md``).

    Parameters
    ----------
    host_bytes : int
        Size of the host arena, in ``[0, 2**62]``; it holds ``host_bytes // page_bytes``
        page-sized slots once ``attach`` fixes the page size. On a GPU the
        arena is pinned host memory (``kvfast``); here it is a NumPy array.
    disk_bytes : int, optional
        Byte budget of the disk tier over whole files (>= 0; 0 disables it).
    disk_dir : str or os.PathLike, optional
        Directory of the disk tier; required when ``disk_bytes > 0``. It
        stays across ``shutdown`` so the next process starts warm.
    write_policy : {"write_through", "write_back"}
        ``write_through`` (default) writes every offload to host and disk;
        ``write_back`` writes to host and moves a block to disk when host
        evicts it.
    num_workers : int
        Worker threads (>= 1).
    remote_url : str, optional
        ``redis://host:port/db`` or ``redis+cluster://host:port``: a shared
        ``RemoteTier`` under host and disk (spec/remote-tier.md §7).
    remote_namespace, remote_ttl_s, remote_timeout_s, remote_reconnect_interval_s, remote_secret : optional
        ``RemoteTier``'s ``namespace``, ``ttl_s``, ``timeout_s``,
        ``reconnect_interval_s`` and ``secret`` (bytes, or the name of an
        environment variable: every value authenticated with HMAC-SHA256;
        without it anyone who can write to the Redis can poison the tier).
    clock : callable() -> float, optional
        Seconds for retention expiries (``time.monotonic`` by default;
        spec/tiers.md §3.1).

    Raises
    ------
    TypeError
        A size is not an int, or ``disk_dir`` is not a path.
    ValueError
        A negative size, ``disk_bytes > 0`` without ``disk_dir``, an unknown
        ``write_policy``, ``num_workers < 1``.

    Examples
    --------
    >>> import numpy as np, kvref
    >>> params = kvref.KVCacheParams(page_size=4, num_layers=1, kv_heads=1, head_dim=2)
    >>> buf = np.zeros((8,) + params.page_shape, dtype=params.np_dtype)
    >>> conn = kvref.TieredConnector(host_bytes=4 * 64)
    >>> conn.attach([buf], params)
    >>> conn.host_byte_count()
    ByteCount(free=256, total=256)
    >>> conn.shutdown()
    """

    name = "tiered"

    def __init__(
        self,
        host_bytes: int,
        disk_bytes: int = 0,
        disk_dir: str | os.PathLike | None = None,
        *,
        write_policy: str = "write_through",
        num_workers: int = 2,
        remote_url: str | None = None,
        remote_namespace: str = "kvcache",
        remote_ttl_s: float | None = None,
        remote_timeout_s: float = 0.05,
        remote_reconnect_interval_s: float = 1.0,
        remote_secret: bytes | str | None = None,
        clock=None,
    ):
        o = "TieredConnector"
        self._clock = _retention.check_clock(o, clock)
        host_bytes = check_int(o, "host_bytes", host_bytes, low=0, high=MAX_TIER_BYTES)
        disk_bytes = check_int(o, "disk_bytes", disk_bytes, low=0, high=MAX_TIER_BYTES)
        if disk_dir is not None and not isinstance(disk_dir, (str, os.PathLike)):
            raise TypeError(f"{o}: disk_dir={disk_dir!r}, must be a str, os.PathLike or None")
        if disk_bytes and (disk_dir is None or os.fspath(disk_dir) == ""):
            raise ValueError(f"{o}: disk_bytes={disk_bytes} > 0 needs disk_dir, got disk_dir={disk_dir!r}")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"{o}: write_policy={write_policy!r}, must be one of {list(WRITE_POLICIES)}")
        num_workers = check_int(o, "num_workers", num_workers, low=1, high=MAX_WORKERS)
        remote = None
        if remote_url is not None:
            # spec/remote-tier.md §7: validated here (no I/O); bound to the geometry at attach.
            remote = RemoteTier(remote_url, namespace=remote_namespace, ttl_s=remote_ttl_s,
                                timeout_s=remote_timeout_s, reconnect_interval_s=remote_reconnect_interval_s,
                                secret=remote_secret)
        elif remote_secret is not None:
            raise ValueError(f"{o}: remote_secret given without remote_url")
        self._remote = remote
        #: remote claims' expiries by hash (bounded, oldest first dropped), for writes that land later
        self._remote_claims: dict[bytes, float] = {}
        self.host_bytes = host_bytes
        self.disk_bytes = disk_bytes
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.write_policy = write_policy
        self.num_workers = num_workers
        self._lock = threading.RLock()
        self._metrics = KVCacheMetrics()
        self._stats = dict.fromkeys(
            ("warm_start_indexed", "temp_files_removed", "foreign_files", "files_rejected",
             "load_failures", "disk_write_errors", "reset_failures", "stale_writes_dropped"), 0,
        )
        self._params: KVCacheParams | None = None
        #: ``{digest_size(params.hash_algo)}``: ``set(map(len, hashes))`` of well-sized hashes
        self._digest_sizes: set[int] = set()
        self._geometry: dict | None = None
        self._stores: list[PageStore] = []
        self._sources: list = []
        self._owner_ref = None
        self._owner_name: str | None = None
        self._holds_bytes = True
        self._unlink_failures = 0  # of disk tiers closed by shutdown
        self._page_bytes = 0
        self._host: HostTier | None = None
        self._disk: DiskTier | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: set[Future] = set()
        self._completed = 0  # transfers whose handle reports complete (completed_transfers)
        self._background: list[Future] = []
        self._epoch = 0
        self._closed = False

    # ------------------------------------------------------------------ attach

    def attach(self, stores: Sequence[PageStore | np.ndarray], params: KVCacheParams, *, owner: object = None) -> None:
        """Bind the device pages and fix the block geometry and model; open the tiers.

        The host arena comes from ``stores[0].alloc_host(host_bytes // page_bytes)``
        (none in bookkeeping-only mode) and the disk directory is opened: its
        ``kvcache-disk.json`` is created, or checked against this geometry,
        model and hash algorithm, and existing block files are re-indexed
        (warm start). The ``num_workers`` worker threads start here (with
        bytes), not at the first transfers. Attaching again (same owner, or
        after ``detach``) with the same geometry, model and algorithm re-binds
        the stores and keeps the tiers.

        Parameters
        ----------
        stores : sequence of PageStore or ndarray [num_blocks, 2, num_layers, page_size, kv_heads, head_dim]
            One per replica: a ``kvspec.PageStore`` (every read and write of a
            device page goes through ``store.read``/``store.write``), or a
            C-contiguous buffer of dtype ``params.np_dtype``, wrapped in a
            ``HostPageStore`` (a single 6-D array or a single store is taken
            as one replica). All stores hold bytes, or none does
            (bookkeeping-only mode, which ``params.allocate_buffers`` must match).
        params : KVCacheParams
            Geometry, dtype, ``model_id``, ``data_parallel_degree`` and ``hash_algo``.
        owner : object, optional
            Who attaches (the manager). A second attach is accepted only from
            the same owner (or, without ``owner``, over the same stores) until
            ``detach``; a collected owner frees the connector.

        Raises
        ------
        TypeError
            ``params`` is not a ``KVCacheParams`` or a store neither a
            ``PageStore`` nor an ndarray.
        ValueError
            Wrong number of stores, shape, dtype, layout or page size; stores
            that disagree on ``holds_bytes`` or with ``params.allocate_buffers``;
            a host arena that cannot be allocated; a disk directory written
            with another hash algorithm, geometry or model (the message names
            both), or one that cannot be opened.
        RuntimeError
            The connector is shut down, attached to another live owner's pages
            (call ``detach`` first), or re-attached with transfers in flight.
            State is unchanged.
        """
        o = "TieredConnector.attach"
        self._check_open(o)
        if not isinstance(params, KVCacheParams):
            raise TypeError(f"{o}: params={params!r}, must be a KVCacheParams")
        single = (isinstance(stores, np.ndarray) and stores.ndim == 6) or (
            not isinstance(stores, np.ndarray) and isinstance(stores, PageStore))
        sources = [stores] if single else list(stores)
        if len(sources) != params.data_parallel_degree:
            raise ValueError(
                f"{o}: len(stores)={len(sources)} != data_parallel_degree={params.data_parallel_degree}"
            )
        page_bytes = params.kv_page_bytes  # values, then (FP8) scales: one payload (spec/manager.md §16)
        bound = [self._as_store(o, i, x, params, page_bytes) for i, x in enumerate(sources)]
        holds = {st.holds_bytes for st in bound}
        if len(holds) != 1:
            raise ValueError(f"{o}: stores disagree on holds_bytes ({[st.holds_bytes for st in bound]}); "
                             "all hold bytes or none does")
        holds_bytes = holds.pop()
        if holds_bytes != params.allocate_buffers:
            raise ValueError(f"{o}: stores[0].holds_bytes={holds_bytes} but params.allocate_buffers="
                             f"{params.allocate_buffers}; bookkeeping-only stores go with allocate_buffers=False")
        geometry = geometry_of(params.dtype, params.page_shape, params.model_id)
        with self._lock:
            if self._geometry is not None:
                # spec/tiers.md §2: a re-attach keeps the tiers, so geometry, model and mode must not change.
                if geometry != self._geometry or params.hash_algo != self._params.hash_algo:
                    raise ValueError(
                        f"{o}: re-attach with geometry {geometry} hash_algo={params.hash_algo!r}, "
                        f"attached with {self._geometry} hash_algo={self._params.hash_algo!r}"
                    )
                if holds_bytes != self._holds_bytes:
                    raise ValueError(f"{o}: re-attach with holds_bytes={holds_bytes}, attached with "
                                     f"holds_bytes={self._holds_bytes}")
                # spec/tiers.md §2: one live owner at a time; a second manager would offload its
                # pages under the first one's hashes (wrong K/V for every later reader).
                if self._stores and not self._same_owner(owner, sources):
                    raise RuntimeError(
                        f"{o}: already attached to the pages of another live owner "
                        f"({self._owner_name}); call detach() (or shut that manager down) first"
                    )
                if self._inflight:
                    raise RuntimeError(f"{o}: {len(self._inflight)} transfers in flight; re-attach after they land")
                self._bind(bound, sources, params, owner)
                return
        disk = None
        warm = None
        meta_rejected = 0
        if self.disk_bytes > 0:
            disk = DiskTier(self.disk_dir, self.disk_bytes, params.hash_algo, geometry, params.page_size,
                            page_bytes, holds_bytes=holds_bytes)
            if holds_bytes:
                try:
                    meta_rejected = disk.check_metadata(o)
                    warm = disk.open()
                except OSError as err:
                    raise ValueError(f"{o}: disk_dir={str(self.disk_dir)!r} cannot be opened: {err}") from err
        slots = self.host_bytes // page_bytes
        arena = None
        if holds_bytes and slots:
            phys = _physical_memory()
            if phys is not None and slots * page_bytes > phys:
                # spec/tiers.md §2: refuse up front what would be an OOM kill later (overcommit).
                raise ValueError(
                    f"{o}: host_bytes={self.host_bytes} needs an arena of {slots * page_bytes} bytes > "
                    f"{phys} bytes of physical memory (use less, or allocate_buffers=False to plan)"
                )
            try:
                arena = bound[0].alloc_host(slots)
            except (MemoryError, OverflowError):
                raise ValueError(
                    f"{o}: host_bytes={self.host_bytes} needs an arena of {slots} pages of {page_bytes} bytes, "
                    "which cannot be allocated (use less, or allocate_buffers=False to plan)"
                ) from None
            arena = np.asarray(arena)
            if arena.shape != (slots, page_bytes) or arena.dtype != np.uint8:
                raise ValueError(f"{o}: stores[0].alloc_host({slots}) returned shape={arena.shape} "
                                 f"dtype={arena.dtype}, must be ({slots}, {page_bytes}) uint8")
        host = HostTier(slots, page_bytes, arena)
        if self._remote is not None:
            # spec/tiers.md §11: bookkeeping-only shares header-only entries under "plan" keys.
            self._remote.bind(params, holds_bytes=holds_bytes)
        with self._lock:
            self._params, self._geometry, self._page_bytes = params, geometry, page_bytes
            self._holds_bytes = holds_bytes
            self._host, self._disk = host, disk
            for tier in (host, disk):
                if tier is not None:
                    tier.clock = self._clock  # spec/tiers.md §3.1: claims expire on the connector's clock
            self._bind(bound, sources, params, owner)
            self._stats["files_rejected"] += meta_rejected
            if warm is not None:
                self._stats["warm_start_indexed"] += warm.indexed
                self._stats["temp_files_removed"] += warm.temp_removed
                self._stats["foreign_files"] += warm.foreign
                self._stats["files_rejected"] += warm.rejected
            self._executor = ThreadPoolExecutor(self.num_workers, thread_name_prefix="kvcache-tier")
        if holds_bytes:
            _start_workers(self._executor, self.num_workers)

    def detach(self) -> None:
        """Unbind the stores after every transfer has landed; the tiers keep
        their blocks, so another owner (a new manager) may ``attach`` next.

        Raises ``RuntimeError`` before ``attach`` or after ``shutdown``. A
        load that failed is not raised here (its handle raises it).
        """
        o = "TieredConnector.detach"
        self._check_attached(o)
        while True:
            with self._lock:
                pending = list(self._inflight) + [f for f in self._background if not f.done()]
                if not pending:
                    self._stores, self._sources, self._owner_ref, self._owner_name = [], [], None, None
                    return
            wait_futures(pending)

    def _as_store(self, o: str, i: int, x, params: KVCacheParams, page_bytes: int) -> PageStore:
        """``x`` validated as replica ``i``'s page store (an ndarray is wrapped)."""
        if isinstance(x, np.ndarray):
            if x.ndim != 6 or x.shape[1:] != params.page_shape or x.shape[0] < 2:
                raise ValueError(f"{o}: stores[{i}].shape={x.shape} != (num_blocks >= 2, *{params.page_shape})")
            if x.dtype != params.np_dtype:
                raise ValueError(f"{o}: stores[{i}].dtype={x.dtype} != params.dtype={params.dtype}")
            if not x.flags.c_contiguous:
                raise ValueError(f"{o}: stores[{i}] is not C-contiguous; a block must be one contiguous copy")
            return HostPageStore(x)
        if not isinstance(x, PageStore):
            raise TypeError(f"{o}: stores[{i}] is {type(x).__name__}, must be a kvspec.PageStore or a numpy.ndarray")
        if not isinstance(x.holds_bytes, bool):
            raise TypeError(f"{o}: stores[{i}].holds_bytes={x.holds_bytes!r}, must be a bool")
        check_int(o, f"stores[{i}].num_pages", x.num_pages, low=2)
        if x.page_nbytes != page_bytes:
            raise ValueError(f"{o}: stores[{i}].page_nbytes={x.page_nbytes} != page bytes {page_bytes} of params")
        return x

    def _same_owner(self, owner, sources) -> bool:
        """True when ``owner`` (or, without one, ``sources``) is who is attached now (lock held)."""
        held = self._owner_ref() if self._owner_ref is not None else None
        if self._owner_ref is not None and held is None:
            return True  # spec/tiers.md §2: the owner was collected; the connector is free
        if owner is not None or held is not None:
            return owner is not None and owner is held
        if len(sources) != len(self._sources):
            return False

        def same(a, b) -> bool:
            if a is b:
                return True
            # a store re-made over the same buffer is the same owner's pages
            a, b = getattr(a, "buffer", a), getattr(b, "buffer", b)
            return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
                    and np.shares_memory(a, b))

        return all(same(a, b) for a, b in zip(sources, self._sources))

    def _bind(self, stores, sources, params, owner) -> None:
        """Take ``stores`` as the device pages of ``owner`` (lock held)."""
        self._stores, self._sources, self._params = stores, list(sources), params
        self._digest_sizes = {digest_size(params.hash_algo)}
        self._owner_name = type(owner).__name__ if owner is not None else "stores given without owner"
        try:
            self._owner_ref = weakref.ref(owner) if owner is not None else None
        except TypeError:
            self._owner_ref = (lambda o=owner: o)  # not weakly referenceable: held until detach

    # ------------------------------------------------------------------ protocol

    def lookup(self, hashes: Sequence[bytes], tokens: np.ndarray, replica_idx: int = 0) -> int:
        """Number of leading blocks of ``hashes`` held (ready) by host or disk.

        Advisory and read-only: reserves, pins and re-ranks nothing; a later
        ``load`` may still be refused.

        Parameters
        ----------
        hashes : sequence of bytes [n]
            Root-anchored chained block hashes (digest size of ``hash_algo``).
        tokens : int32 [n, page_size]
            Token ids of each block, compared with the stored ones.
        replica_idx : int
            In ``[0, data_parallel_degree)``; the tiers are shared by replicas.
        """
        o = "TieredConnector.lookup"
        self._check_call(o, replica_idx)
        hs, toks = self._check_hashes_tokens(o, hashes, tokens, copy=False)
        with self._lock:
            n = 0
            for h, t in zip(hs, toks):
                if self._host.get(h, t) is None and (self._disk is None or self._disk.get(h, t) is None):
                    break
                n += 1
        if self._remote is not None and n < len(hs):
            # spec/remote-tier.md §7: the run continues in Redis (one round trip, outside the lock).
            n += self._remote.lookup(hs[n:])
        return n

    def load(
        self, block_ids: Sequence[int], hashes: Sequence[bytes], tokens: np.ndarray, replica_idx: int = 0
    ) -> KVTransfer:
        """Copy the stored blocks ``hashes`` into device pages ``block_ids``.

        All or nothing at post: if any block is no longer held (with equal
        tokens), ``KVLoadRefused`` is raised, nothing is pinned or copied,
        and ``connector_loads_refused`` counts it. Otherwise the sources are
        pinned and a worker copies host slots (and verified disk files) into
        the pages; disk hits are then promoted into host in the background.

        Parameters
        ----------
        block_ids : int [n]
            Distinct destination pages of replica ``replica_idx`` (never 0).
        hashes : sequence of bytes [n]
        tokens : int32 [n, page_size]
        replica_idx : int

        Returns
        -------
        KVTransfer
            ``CompletedTransfer`` for ``n == 0``; else a ``TierTransfer``
            that raises ``KVLoadFailed`` if a disk file fails verification
            (the file is dropped and counted in ``tier_stats().files_rejected``;
            the pages must not be published).

        Raises
        ------
        KVLoadRefused
            A block is not held (only ``connector_loads_refused`` changes).
        TypeError, ValueError, IndexError
            Bad arguments; state is unchanged.
        RuntimeError
            Not attached, or shut down.
        """
        o = "TieredConnector.load"
        self._check_call(o, replica_idx)
        hs, toks = self._check_hashes_tokens(o, hashes, tokens)
        ids = self._check_block_ids(o, block_ids, len(hs), replica_idx, distinct=True)
        if not ids:
            return CompletedTransfer()
        store = self._stores[replica_idx]
        with self._lock:
            plan = []
            for i, (h, t) in enumerate(zip(hs, toks)):
                e = self._host.get(h, t)
                if e is not None:
                    plan.append(("host", e))
                    continue
                d = self._disk.get(h, t) if self._disk is not None else None
                if d is None and self._remote is not None:
                    # spec/remote-tier.md §7: fetched and verified by the worker; a refusal there
                    # fails the handle (KVLoadFailed), the pages are never published.
                    plan.append(("remote", None))
                    continue
                if d is None:
                    # spec/tiers.md §5: all or refuse; the refusal is counted, nothing else changes.
                    self._metrics.connector_loads_refused += 1
                    raise KVLoadRefused(
                        f"{o}: hashes[{i}]={h.hex()[:16]} is held by no tier (evicted since lookup?)",
                        block_hash=h,
                    )
                plan.append(("disk", d))
            for tier, e in plan:
                if tier != "remote":
                    (self._host if tier == "host" else self._disk).pin(e)
            self._host.touch(reversed(hs))
            if self._disk is not None:
                self._disk.touch(reversed(hs))
            if self._holds_bytes:
                return self._submit("load", self._run_load, store, ids, hs, toks, plan, self._epoch)
        # spec/tiers.md §11: bookkeeping only: the transfer is its accounting, done at post.
        self._run_load(store, ids, hs, toks, plan, self._epoch)
        return CompletedTransfer()

    def offload(
        self, block_ids: Sequence[int], hashes: Sequence[bytes], tokens: np.ndarray, replica_idx: int = 0
    ) -> KVTransfer:
        """Snapshot-copy published device pages into the tiers on a worker.

        The manager keeps ``block_ids`` pinned (unchanged) until the handle
        completes. Blocks already held are only re-ranked. A block that
        cannot be stored (no free or evictable slot, a full or failing disk)
        is dropped and counted in ``connector_offload_blocks_dropped``; the
        handle never raises for it.

        Parameters
        ----------
        block_ids : int [n]
            Source pages of replica ``replica_idx`` (never 0).
        hashes : sequence of bytes [n]
        tokens : int32 [n, page_size]
        replica_idx : int

        Raises
        ------
        TypeError, ValueError, IndexError
            Bad arguments; state is unchanged.
        RuntimeError
            Not attached, or shut down.
        """
        o = "TieredConnector.offload"
        self._check_call(o, replica_idx)
        hs, toks = self._check_hashes_tokens(o, hashes, tokens)
        ids = self._check_block_ids(o, block_ids, len(hs), replica_idx, distinct=False)
        if not ids:
            return CompletedTransfer()
        store = self._stores[replica_idx]
        with self._lock:
            self._reap()
            if self._holds_bytes:
                return self._submit("offload", self._run_offload, store, ids, hs, toks, self._epoch)
            epoch = self._epoch
        self._run_offload(store, ids, hs, toks, epoch)  # spec/tiers.md §11: accounting at post
        return CompletedTransfer()

    def touch(self, hashes: Sequence[bytes], replica_idx: int = 0) -> None:
        """Re-rank blocks served from the device: ``hashes`` is root-anchored,
        and the head of the chain ends up most recently used, so a chain's
        tail is evicted before its head (as on the device, ``spec/slot-cache.md``).

        Raises ``TypeError``/``ValueError`` for bad hashes, ``IndexError`` for
        ``replica_idx``, ``RuntimeError`` before attach or after shutdown;
        state is unchanged."""
        o = "TieredConnector.touch"
        self._check_call(o, replica_idx)
        hs = self._check_hashes(o, hashes)
        with self._lock:
            # spec/tiers.md §3: iterate tail first so the head ends up most recent.
            self._host.touch(reversed(hs))
            if self._disk is not None:
                self._disk.touch(reversed(hs))
            if self._remote is not None and self._remote.ttl_s is not None and self._executor is not None:
                # spec/remote-tier.md §7: refresh the TTL on a worker; no network on the caller's thread.
                self._background.append(self._executor.submit(self._remote.touch, hs))

    def set_retention(self, hashes: Sequence[bytes], priority: int, seconds: float | None = None,
                      replica_idx: int = 0) -> None:
        """A retention claim on stored blocks (spec/tiers.md §3.1, spec/manager.md §14).

        Host and disk merge ``(priority, clock() + seconds)`` (``None``: no
        expiry) into the entry of every hash they hold (ready or being
        written), and evict the lowest priority first, least recently used
        within a priority. The remote tier, when ``seconds`` is given, extends
        each stored key's expiry to at least ``seconds`` (``PEXPIRE ... GT`` on
        a worker: a TTL is never shortened, a key without one keeps none).

        Raises ``TypeError``/``ValueError`` for bad hashes, priority or seconds,
        ``IndexError`` for ``replica_idx``, ``RuntimeError`` before attach or
        after shutdown; state is unchanged."""
        o = "TieredConnector.set_retention"
        self._check_call(o, replica_idx)
        hs = self._check_hashes(o, hashes)
        if type(priority) is not int or not _retention.MIN_PRIORITY <= priority <= _retention.MAX_PRIORITY:
            priority = _retention.check_priority(o, priority, "priority")  # raises, or an int-like
        if seconds is not None:
            seconds = _retention.check_seconds(o, seconds, "seconds")
        now = self._clock()  # one read: the expiry, and the merges of both tiers (spec/tiers.md §3.1)
        expiry = _retention.NEVER if seconds is None else float(now) + seconds
        with self._lock:
            self._host.set_retention(hs, priority, expiry, now)
            if self._disk is not None:
                self._disk.set_retention(hs, priority, expiry, now)
            if self._remote is not None and seconds is not None and self._executor is not None and hs:
                # A block whose offload is still queued is written with its claim's TTL (_run_offload).
                rc = self._remote_claims
                for h in hs:
                    rc[h] = max(expiry, rc.pop(h, expiry))
                while len(rc) > _REMOTE_CLAIMS:
                    rc.pop(next(iter(rc)))
                # no network on the caller's thread (spec/remote-tier.md §7)
                self._background.append(self._executor.submit(self._remote.retain, hs, seconds))

    def _remote_claims_of(self, hs: list[bytes]) -> dict[bytes, float]:
        """The live claims (expiry on the connector's clock) that ``set_retention`` made on ``hs``."""
        with self._lock:
            rc = self._remote_claims
            return {h: rc[h] for h in hs if h in rc}

    def _put_remote(self, hs: list[bytes], toks, srcs: list) -> None:
        """The remote write of an offload (on a worker), each block under its known claim's TTL
        (spec/tiers.md §3.1: the bytes never sit in Redis under a shorter TTL than their claim)."""
        now = self._clock()
        sent = self._remote_claims_of(hs)
        left = [sent[h] - now if h in sent and sent[h] > now else None for h in hs]
        self._remote.put_many(hs, toks, srcs, retain_s=None if all(x is None for x in left) else left)
        # A claim made while the write was in flight: its own retain may have run before the key
        # existed, so extend it here (PEXPIRE ... GT; a claim already sent above is not resent).
        now = self._clock()
        by_seconds: dict[float, list[bytes]] = {}
        for h, expiry in self._remote_claims_of(hs).items():
            if expiry != sent.get(h) and expiry > now:
                by_seconds.setdefault(expiry - now, []).append(h)
        for sec, group in by_seconds.items():
            self._remote.retain(group, sec)

    def poll_transfers(self) -> None:
        """Reap finished background work (promotions into host); never blocks.

        Raises ``RuntimeError`` if background work hit an unexpected error
        (a bug, never a full disk: that is dropped and counted)."""
        with self._lock:
            self._reap()

    def reset_prefix_cache(self) -> None:
        """Forget every stored block, in this process and in every later one.

        The disk tier first persists a new **generation** in its metadata file
        (every block file carries the generation it was written in, and only
        files of the current one are served), then host entries are dropped
        and this tier's block files deleted (files still being read or written
        go when their copy ends; a file whose unlink fails is never served
        again all the same). Offloads, promotions and write-back evictions
        posted before the reset store nothing (counted in
        ``tier_stats().stale_writes_dropped``). Foreign files and the
        metadata file stay.

        Raises
        ------
        RuntimeError
            Shut down; or the new generation cannot be written (a read-only
            directory and file): nothing is forgotten, ``tier_stats().reset_failures``
            counts it, the message names the directory.
        """
        o = "TieredConnector.reset_prefix_cache"
        self._check_open(o)
        with self._lock:
            if self._disk is not None and self._disk.holds_bytes:
                try:
                    # spec/tiers.md §9: invalidation first, durable; deleting files is then an optimisation.
                    self._disk.new_generation()
                except OSError as err:
                    self._stats["reset_failures"] += 1
                    raise RuntimeError(
                        f"{o}: disk_dir={str(self.disk_dir)!r} cannot record the reset ({err.strerror or err}); "
                        "nothing was forgotten"
                    ) from err
            self._epoch += 1
            if self._host is not None:
                self._host.clear()
            if self._disk is not None:
                self._disk.clear()

    def shutdown(self) -> None:
        """Wait for every transfer and background job, stop the workers and
        release the host arena. The disk directory stays, so the next
        connector over it starts warm. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            executor = self._executor
        while True:
            with self._lock:
                pending = list(self._inflight) + [f for f in self._background if not f.done()]
            if not pending:
                break
            wait_futures(pending)
        if executor is not None:
            executor.shutdown(wait=True)
        if self._remote is not None:
            self._remote.close()
        with self._lock:
            self._background.clear()
            self._executor = None
            self._stores, self._sources, self._owner_ref = [], [], None
            self._host = None
            if self._disk is not None:
                self._unlink_failures += self._disk.undeletable
            self._disk = None

    def host_byte_count(self) -> ByteCount:
        """``ByteCount(free, total)`` of the host arena (0 of 0 before attach
        and after shutdown); a slot being written counts as used."""
        with self._lock:
            if self._host is None:
                return ByteCount(0, 0)
            total = self._host.num_slots * self._page_bytes
            return ByteCount(total - self._host.used_slots * self._page_bytes, total)

    def disk_byte_count(self) -> ByteCount:
        """``ByteCount(free, total)`` of the disk budget over whole files (0 of
        0 without a disk tier, before attach and after shutdown)."""
        with self._lock:
            if self._disk is None:
                return ByteCount(0, 0)
            return ByteCount(self._disk.capacity - self._disk.used, self._disk.capacity)

    @property
    def metrics(self) -> KVCacheMetrics:
        """A snapshot of the counters: ``h2d_bytes_copied``, ``d2h_bytes_copied``,
        ``disk_bytes_written``, ``disk_bytes_read``, ``connector_loads_refused``,
        ``connector_offload_blocks_dropped``."""
        with self._lock:
            out = self._metrics.copy()
            if self._remote is not None:
                out.connector_offload_blocks_dropped += self._remote.metrics.offloads_dropped
            return out

    def take_metrics(self) -> KVCacheMetrics:
        """The counters, then zero them."""
        with self._lock:
            out, self._metrics = self._metrics, KVCacheMetrics()
            if self._remote is not None:
                out.connector_offload_blocks_dropped += self._remote.take_metrics().offloads_dropped
            return out

    def remote_metrics(self) -> RemoteTierMetrics:
        """The remote tier's counters since the last ``take_metrics`` (zeros without one)."""
        return self._remote.metrics if self._remote is not None else RemoteTierMetrics()

    # ------------------------------------------------------------------ inspection

    def tier_stats(self) -> TierStats:
        """Occupancy and the files and copies the tiers refused (``TierStats``)."""
        with self._lock:
            return TierStats(
                host_blocks=len(self._host.ready_hashes()) if self._host is not None else 0,
                disk_blocks=len(self._disk.ready_hashes()) if self._disk is not None else 0,
                unlink_failures=self._unlink_failures + (self._disk.undeletable if self._disk is not None else 0),
                **self._stats,
            )

    def held_in(self, block_hash: bytes) -> frozenset[str]:
        """The tiers (``"host"``, ``"disk"``) holding ``block_hash`` ready now."""
        with self._lock:
            out = set()
            if self._host is not None and block_hash in self._host.ready_hashes():
                out.add("host")
            if self._disk is not None and block_hash in self._disk.ready_hashes():
                out.add("disk")
            return frozenset(out)

    def pending(self) -> int:
        """Loads, offloads and background jobs not yet finished."""
        with self._lock:
            return len(self._inflight) + sum(1 for f in self._background if not f.done())

    def check_invariants(self) -> None:
        """``AssertionError`` if the host slots or the disk byte budget are inconsistent."""
        with self._lock:
            if self._host is not None:
                self._host.check_invariants()
            if self._disk is not None:
                self._disk.check_invariants()

    # ------------------------------------------------------------------ IO seams (tests override)

    def _disk_read(self, block_hash: bytes, tokens: np.ndarray, generation: int) -> tuple[memoryview, int]:
        """Read and verify one block file of ``generation`` on a worker (``DiskBlockError`` on a mismatch)."""
        return self._disk.read_block(block_hash, tokens, generation)

    def _disk_write(self, block_hash: bytes, tokens: np.ndarray, payload: np.ndarray, generation: int) -> int:
        """Write one block file of ``generation`` on a worker; ``OSError`` on a full or read-only disk."""
        return self._disk.write_block(block_hash, tokens, payload, generation)

    # ------------------------------------------------------------------ workers

    def _submit(self, kind: str, fn, *args) -> TierTransfer:
        """Start ``fn(*args)`` on a worker (lock held)."""
        fut = self._executor.submit(fn, *args)
        self._inflight.add(fut)
        landed = [False]
        fut.add_done_callback(partial(self._forget, landed))
        return TierTransfer(fut, kind, landed)

    def _forget(self, landed: list[bool], fut: Future) -> None:
        # A done callback: it runs once the future is done, so a reader of the count that sees
        # it grow finds the handle complete (spec/manager.md §9.2).
        landed[0] = True
        with self._lock:
            self._inflight.discard(fut)
            self._completed += 1

    def completed_transfers(self) -> int:
        """How many loads and offloads of this connector have finished (monotonic).

        A manager that reads the same count as at its last poll knows no
        in-flight handle of this connector became complete since, and skips
        polling them (spec/manager.md §9.2): O(1) per ``alloc`` instead of one
        ``is_complete`` per in-flight offload.
        """
        return self._completed

    def _reap(self) -> None:
        """Drop finished background futures; surface an unexpected error (lock held)."""
        if not self._background:
            return
        done = [f for f in self._background if f.done()]
        self._background = [f for f in self._background if not f.done()]
        for f in done:
            err = f.exception()
            if err is not None:
                raise RuntimeError(f"TieredConnector.poll_transfers: background work raised {err!r}") from err

    def _run_load(self, store: PageStore, ids, hs, toks, plan, epoch: int) -> None:
        host, disk, pb, holds = self._host, self._disk, self._page_bytes, self._holds_bytes
        promote: list[tuple[bytes, np.ndarray, np.ndarray | None]] = []
        try:
            remote_at = [i for i, (tier, _) in enumerate(plan) if tier == "remote"]
            fetched = {}
            if remote_at:
                try:
                    got = self._remote.get_many([hs[i] for i in remote_at], toks[remote_at])
                except KVLoadRefused as err:
                    with self._lock:
                        self._stats["load_failures"] += 1
                    raise KVLoadFailed(f"TieredConnector.load: remote tier refused the load: {err}") from err
                fetched = dict(zip(remote_at, got))
            for i, (bid, h, t, (tier, e)) in enumerate(zip(ids, hs, toks, plan)):
                data = None
                if tier == "host":
                    if holds:
                        store.write([bid], host.arena[e.slot : e.slot + 1])
                elif tier == "remote":
                    if holds:
                        data = np.frombuffer(fetched[i], dtype=np.uint8)
                        store.write([bid], data[None])
                    promote.append((h, t, data))
                else:
                    nread = disk.file_bytes
                    if holds:
                        try:
                            payload, nread = self._disk_read(h, t, e.generation)
                        except DiskBlockError as err:
                            with self._lock:
                                disk.reject(e)
                                self._stats["files_rejected"] += 1
                                self._stats["load_failures"] += 1
                            # spec/tiers.md §6: a bad file fails the load; its pages are never published.
                            raise KVLoadFailed(
                                f"TieredConnector.load: hashes[{i}]={h.hex()[:16]} disk copy refused: {err}"
                            ) from err
                        data = np.frombuffer(payload, dtype=np.uint8)
                        store.write([bid], data[None])
                    with self._lock:
                        self._metrics.disk_bytes_read += nread
                    promote.append((h, t, data))
                with self._lock:
                    self._metrics.h2d_bytes_copied += pb
        finally:
            with self._lock:
                for tier, e in plan:
                    if tier != "remote":
                        (host if tier == "host" else disk).unpin(e)
                run_promote = bool(promote and host.num_slots and self._executor is not None)
                if run_promote and holds:
                    # spec/tiers.md §9: a reset after the post forgets these blocks too
                    self._background.append(self._executor.submit(self._promote, promote, epoch))
            if run_promote and not holds:
                self._promote(promote, epoch)

    def _promote(self, blocks, epoch: int) -> None:
        """Copy blocks read from disk into host slots (background)."""
        host = self._host
        for h, t, data in blocks:
            with self._lock:
                if epoch != self._epoch:
                    self._stats["stale_writes_dropped"] += 1
                    return
                entry, evicted = host.reserve(h, t, copy_evicted=self.write_policy == "write_back")
            if entry is not None:
                if data is not None:
                    np.copyto(host.arena[entry.slot], data)
                with self._lock:
                    host.commit(entry)
            self._write_evicted(evicted, epoch)

    def _run_offload(self, store: PageStore, ids, hs, toks, epoch: int) -> None:
        host, disk, pb = self._host, self._disk, self._page_bytes
        write_back = self.write_policy == "write_back"
        # spec/tiers.md §2: every device read goes through the store (one call for the batch).
        srcs = store.read(ids) if self._holds_bytes else [None] * len(ids)
        for src, h, t in zip(srcs, hs, toks):
            with self._lock:
                if epoch != self._epoch:
                    self._stats["stale_writes_dropped"] += 1
                    return  # spec/tiers.md §9: a reset forgets offloads posted before it
                in_host = host.has_entry(h)
                # bookkeeping only (no source bytes): the entry is ready at once (HostTier.reserve)
                # (t: a row of offload's own int32 copy of the tokens, handed over as is)
                host_e, evicted = (None, []) if in_host else host.reserve(h, t, copy_evicted=write_back,
                                                                          ready=src is None, own_tokens=True)
                host_ok = in_host or host_e is not None
                disk_e, to_disk, disk_ok = None, False, True
                if disk is not None:
                    # spec/tiers.md §3: write-through sends every block to disk; write-back only
                    # what host could not take (the rest goes to disk on host eviction).
                    to_disk = not write_back or not host_ok
                    if to_disk and not disk.has_entry(h):
                        disk_e = disk.reserve(h, t)
                        disk_ok = disk_e is not None
                host_missing = host.num_slots > 0 and not host_ok and not (write_back and to_disk)
                # spec/remote-tier.md §7: with a remote tier, a block no local tier was meant to
                # take is the remote's to store (put_many counts its own drops).
                stored_nowhere = not (host_ok or (to_disk and disk_ok)) and self._remote is None
                dropped = host_missing or not disk_ok or stored_nowhere
                if host_e is not None and src is None:
                    self._metrics.d2h_bytes_copied += pb  # bookkeeping only: the entry is ready already
            if host_e is not None:
                if src is not None:
                    np.copyto(host.arena[host_e.slot], src)
                    with self._lock:
                        host.commit(host_e)  # the bytes landed
                        self._metrics.d2h_bytes_copied += pb
            elif disk_e is not None:
                with self._lock:
                    self._metrics.d2h_bytes_copied += pb
            if disk_e is not None and not self._write_disk(disk_e, h, t, src):
                dropped = True
            if dropped:
                with self._lock:
                    self._metrics.connector_offload_blocks_dropped += 1
            if evicted and write_back and disk is not None:  # (only wanted evictions go to disk)
                self._write_evicted(evicted, epoch)
        if self._remote is not None:
            # spec/remote-tier.md §7: SET NX of the pinned source pages, one round trip; a failing
            # store drops them (counted by the remote tier), never raises.
            self._put_remote(hs, toks, list(srcs))
        with self._lock:
            host.touch(reversed(hs))
            if disk is not None:
                disk.touch(reversed(hs))

    def _write_disk(self, entry, h: bytes, t: np.ndarray, payload: np.ndarray | None) -> bool:
        """Write a reserved disk entry; False (reservation released, counted) on ``OSError``."""
        if payload is None:  # spec/tiers.md §11: bookkeeping only, the file is its accounting
            n = self._disk.file_bytes
        else:
            try:
                n = self._disk_write(h, t, payload, entry.generation)
            except OSError:
                # spec/tiers.md §6: a full or read-only disk drops the block, never raises into serving.
                with self._lock:
                    self._disk.abort(entry)
                    self._stats["disk_write_errors"] += 1
                return False
        with self._lock:
            self._disk.commit(entry)
            self._metrics.disk_bytes_written += n
        return True

    def _write_evicted(self, evicted: list[Evicted], epoch: int) -> None:
        """Write-back: blocks pushed out of host go to disk (worker thread),
        unless a reset happened since they were evicted (spec/tiers.md §9)."""
        for v in evicted:
            if not v.wanted or self._disk is None:
                continue
            with self._lock:
                if epoch != self._epoch:
                    # spec/tiers.md §9: the block was forgotten by a reset; writing it would revive it.
                    self._stats["stale_writes_dropped"] += 1
                    continue
                if self._disk.has_entry(v.block_hash):
                    continue
                entry = self._disk.reserve(v.block_hash, v.tokens)
                if entry is None:
                    self._metrics.connector_offload_blocks_dropped += 1
                    continue
            if not self._write_disk(entry, v.block_hash, v.tokens, v.data):
                with self._lock:
                    self._metrics.connector_offload_blocks_dropped += 1

    # ------------------------------------------------------------------ validation

    def _check_open(self, o: str) -> None:
        if self._closed:
            raise RuntimeError(f"{o}: the connector is shut down")

    def _check_attached(self, o: str) -> None:
        self._check_open(o)
        if self._params is None or not self._stores:
            raise RuntimeError(f"{o}: call attach(stores, params) first")

    def _check_replica(self, o: str, replica_idx) -> None:
        r = check_int(o, "replica_idx", replica_idx)
        if not 0 <= r < len(self._stores):
            raise IndexError(f"{o}: replica_idx={r} out of range [0, {len(self._stores)})")

    def _check_call(self, o: str, replica_idx) -> None:
        """``_check_attached`` then ``_check_replica``; a plain int in range costs two tests."""
        if (self._closed or not self._stores or type(replica_idx) is not int
                or not 0 <= replica_idx < len(self._stores)):
            self._check_attached(o)
            self._check_replica(o, replica_idx)

    def _check_hashes(self, o: str, hashes) -> list[bytes]:
        if type(hashes) is list and (not hashes or (set(map(type, hashes)) == _BYTES
                                                    and set(map(len, hashes)) == self._digest_sizes)):
            return hashes[:]  # the manager's runs: checked in two C-level passes (the loop names a bad one)
        if isinstance(hashes, (bytes, bytearray, str)) or not hasattr(hashes, "__len__"):
            raise TypeError(f"{o}: hashes={hashes!r:.60}, must be a sequence of bytes")
        size = digest_size(self._params.hash_algo)
        out = []
        for i, h in enumerate(hashes):
            if not isinstance(h, (bytes, bytearray)):
                raise TypeError(f"{o}: hashes[{i}]={h!r:.40} is {type(h).__name__}, must be bytes")
            if len(h) != size:
                raise ValueError(
                    f"{o}: hashes[{i}] has {len(h)} bytes != {size} ({self._params.hash_algo} digest)"
                )
            out.append(bytes(h))
        return out

    def _check_hashes_tokens(self, o: str, hashes, tokens, *, copy: bool = True) -> tuple[list[bytes], np.ndarray]:
        """The hashes (a copy) and the tokens as int32 ``[n, page_size]`` (a copy unless ``copy``
        is False and they are int32 already: ``lookup`` keeps nothing)."""
        hs = self._check_hashes(o, hashes)
        ps = self._params.page_size
        arr = tokens if type(tokens) is np.ndarray else np.asarray(tokens)
        if arr.size == 0 and not hs:
            return hs, np.zeros((0, ps), dtype=np.int32)
        dt = arr.dtype
        if dt.kind not in "iu" and arr.size:  # np.issubdtype(dt, np.integer), without its cost
            raise TypeError(f"{o}: tokens dtype={arr.dtype}, must be an integer type")
        if arr.shape != (len(hs), ps):
            raise ValueError(f"{o}: tokens shape={arr.shape} != (len(hashes)={len(hs)}, page_size={ps})")
        if dt is _INT32 or dt == _INT32:
            return hs, (arr.copy() if copy else arr)
        if arr.min() < -(2**31) or arr.max() > 2**31 - 1:
            raise ValueError(f"{o}: tokens value out of int32 range")
        return hs, arr.astype(np.int32)

    def _check_block_ids(self, o: str, block_ids, n: int, replica_idx: int, *, distinct: bool) -> list[int]:
        if not hasattr(block_ids, "__len__"):
            raise TypeError(f"{o}: block_ids={block_ids!r:.60}, must be a sequence of ints")
        if len(block_ids) != n:
            raise ValueError(f"{o}: len(block_ids)={len(block_ids)} != len(hashes)={n}")
        num_blocks = self._stores[replica_idx].num_pages
        if (type(block_ids) is list and n and set(map(type, block_ids)) == _INTS
                and 0 < min(block_ids) and max(block_ids) < num_blocks
                and (not distinct or len(set(block_ids)) == n)):
            return block_ids[:]  # the manager's pages: checked in C-level passes (the loop names a bad one)
        ids = []
        for i, b in enumerate(block_ids):
            b = check_int(o, f"block_ids[{i}]", b)
            if b == 0:
                raise ValueError(f"{o}: block_ids[{i}]=0 is the null block")
            if not 0 < b < num_blocks:
                raise IndexError(f"{o}: block_ids[{i}]={b} out of range [1, {num_blocks})")
            ids.append(b)
        if distinct and len(set(ids)) != len(ids):
            dup = next(b for b in ids if ids.count(b) > 1)
            raise ValueError(f"{o}: block_ids has {dup} twice; each destination page once")
        return ids

    def __repr__(self):
        return (
            f"TieredConnector(host_bytes={self.host_bytes}, disk_bytes={self.disk_bytes}, "
            f"disk_dir={str(self.disk_dir) if self.disk_dir else None!r}, write_policy={self.write_policy!r})"
        )
