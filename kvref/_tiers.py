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

import math
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from kvspec._config import check_int
from kvspec._manager_types import ByteCount, CompletedTransfer, KVCacheMetrics, KVCacheParams, KVTransfer
from kvspec.errors import KVLoadFailed, KVLoadRefused
from kvspec.hashing import digest_size

from ._disk_tier import DiskBlockError, DiskTier, geometry_of
from ._host_tier import Evicted, HostTier
from ._remote_tier import RemoteTier, RemoteTierMetrics

__all__ = ["TieredConnector", "TierTransfer", "TierStats", "WRITE_POLICIES"]

#: ``write_through``: every offload goes to host and disk. ``write_back``:
#: offloads go to host; a block evicted from host is then written to disk.
WRITE_POLICIES = ("write_through", "write_back")


# --------------------------------------------------------------------------- transfers


class TierTransfer:
    """A ``KVTransfer`` backed by a worker-thread future.

    ``is_complete()`` never blocks: it returns False while the copy runs,
    True once it landed, and raises ``KVLoadFailed`` (again on every call)
    once a load failed. ``synchronize()`` blocks until the copy ends and
    raises the same way. An offload handle never raises ``KVLoadFailed``: a
    failed offload is dropped and counted.
    """

    __slots__ = ("_future", "_kind")

    def __init__(self, future: Future, kind: str):
        self._future = future
        self._kind = kind

    def is_complete(self) -> bool:
        if not self._future.done():
            return False
        self._raise_if_failed()
        return True

    def synchronize(self) -> None:
        wait_futures([self._future])
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
    """

    host_blocks: int = 0
    disk_blocks: int = 0
    warm_start_indexed: int = 0
    temp_files_removed: int = 0
    foreign_files: int = 0
    files_rejected: int = 0
    load_failures: int = 0
    disk_write_errors: int = 0


# --------------------------------------------------------------------------- connector


class TieredConnector:
    """Host and disk offload tiers for a ``PagedKVCacheManager`` (DESIGN §5).

    Parameters
    ----------
    host_bytes : int
        Size of the host arena (>= 0); it holds ``host_bytes // page_bytes``
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
    remote_namespace, remote_ttl_s, remote_timeout_s, remote_reconnect_interval_s : optional
        ``RemoteTier``'s ``namespace``, ``ttl_s``, ``timeout_s`` and ``reconnect_interval_s``.

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
    ):
        o = "TieredConnector"
        host_bytes = check_int(o, "host_bytes", host_bytes, low=0)
        disk_bytes = check_int(o, "disk_bytes", disk_bytes, low=0)
        if disk_dir is not None and not isinstance(disk_dir, (str, os.PathLike)):
            raise TypeError(f"{o}: disk_dir={disk_dir!r}, must be a str, os.PathLike or None")
        if disk_bytes and (disk_dir is None or os.fspath(disk_dir) == ""):
            raise ValueError(f"{o}: disk_bytes={disk_bytes} > 0 needs disk_dir, got disk_dir={disk_dir!r}")
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"{o}: write_policy={write_policy!r}, must be one of {list(WRITE_POLICIES)}")
        num_workers = check_int(o, "num_workers", num_workers, low=1)
        remote = None
        if remote_url is not None:
            # Spec remote-tier §7: validated here (no I/O); bound to the geometry at attach.
            remote = RemoteTier(remote_url, namespace=remote_namespace, ttl_s=remote_ttl_s,
                                timeout_s=remote_timeout_s, reconnect_interval_s=remote_reconnect_interval_s)
        self._remote = remote
        self.host_bytes = host_bytes
        self.disk_bytes = disk_bytes
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.write_policy = write_policy
        self.num_workers = num_workers
        self._lock = threading.RLock()
        self._metrics = KVCacheMetrics()
        self._stats = dict.fromkeys(
            ("warm_start_indexed", "temp_files_removed", "foreign_files", "files_rejected",
             "load_failures", "disk_write_errors"), 0,
        )
        self._params: KVCacheParams | None = None
        self._geometry: dict | None = None
        self._pages: list[np.ndarray] = []
        self._page_bytes = 0
        self._host: HostTier | None = None
        self._disk: DiskTier | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: set[Future] = set()
        self._background: list[Future] = []
        self._epoch = 0
        self._closed = False

    # ------------------------------------------------------------------ attach

    def attach(self, buffers: Sequence[np.ndarray], params: KVCacheParams) -> None:
        """Bind the device buffers and fix the block geometry; open the tiers.

        Parameters
        ----------
        buffers : sequence of ndarray [num_blocks, 2, num_layers, page_size, kv_heads, head_dim]
            One C-contiguous buffer per replica, dtype ``params.np_dtype``
            (a single 6-D array is taken as one replica).
        params : KVCacheParams
            Geometry, dtype, ``data_parallel_degree`` and ``hash_algo``.

        The host arena is allocated (``host_bytes // page_bytes`` slots) and
        the disk directory opened: its ``kvcache-disk.json`` is created, or
        checked against this geometry and hash algorithm, and existing block
        files are re-indexed (warm start). Attaching again with the same
        geometry and algorithm re-binds the buffers and keeps the tiers.

        Raises
        ------
        TypeError
            ``params`` is not a ``KVCacheParams`` or a buffer not an ndarray.
        ValueError
            Wrong number of buffers, shape, dtype or layout; a disk directory
            written with another hash algorithm or block geometry (the
            message names both), or one that cannot be opened.
        RuntimeError
            The connector is shut down, or re-attached with transfers in
            flight. State is unchanged.
        """
        o = "TieredConnector.attach"
        self._check_open(o)
        if not isinstance(params, KVCacheParams):
            raise TypeError(f"{o}: params={params!r}, must be a KVCacheParams")
        bufs = [buffers] if isinstance(buffers, np.ndarray) and buffers.ndim == 6 else list(buffers)
        if len(bufs) != params.data_parallel_degree:
            raise ValueError(
                f"{o}: len(buffers)={len(bufs)} != data_parallel_degree={params.data_parallel_degree}"
            )
        for i, b in enumerate(bufs):
            if not isinstance(b, np.ndarray):
                raise TypeError(f"{o}: buffers[{i}] is {type(b).__name__}, must be a numpy.ndarray")
            if b.ndim != 6 or b.shape[1:] != params.page_shape or b.shape[0] < 2:
                raise ValueError(
                    f"{o}: buffers[{i}].shape={b.shape} != (num_blocks >= 2, *{params.page_shape})"
                )
            if b.dtype != params.np_dtype:
                raise ValueError(f"{o}: buffers[{i}].dtype={b.dtype} != params.dtype={params.dtype}")
            if not b.flags.c_contiguous:
                raise ValueError(f"{o}: buffers[{i}] is not C-contiguous; a block must be one contiguous copy")
        geometry = geometry_of(params.dtype, params.page_shape)
        pages = [b.reshape(b.shape[0], -1).view(np.uint8) for b in bufs]
        with self._lock:
            if self._geometry is not None:
                # Spec tiers §2: a re-attach keeps the tiers, so the geometry must not change.
                if geometry != self._geometry or params.hash_algo != self._params.hash_algo:
                    raise ValueError(
                        f"{o}: re-attach with geometry {geometry} hash_algo={params.hash_algo!r}, "
                        f"attached with {self._geometry} hash_algo={self._params.hash_algo!r}"
                    )
                if self._inflight:
                    raise RuntimeError(f"{o}: {len(self._inflight)} transfers in flight; re-attach after they land")
                self._pages, self._params = pages, params
                return
        page_bytes = math.prod(params.page_shape) * params.np_dtype.itemsize
        disk = None
        warm = None
        if self.disk_bytes > 0:
            disk = DiskTier(self.disk_dir, self.disk_bytes, params.hash_algo, geometry, params.page_size, page_bytes)
            try:
                disk.check_metadata(o)
                warm = disk.open()
            except OSError as err:
                raise ValueError(f"{o}: disk_dir={str(self.disk_dir)!r} cannot be opened: {err}") from err
        host = HostTier(self.host_bytes // page_bytes, page_bytes)
        if self._remote is not None:
            self._remote.bind(params)
        with self._lock:
            self._params, self._geometry, self._pages, self._page_bytes = params, geometry, pages, page_bytes
            self._host, self._disk = host, disk
            if warm is not None:
                self._stats["warm_start_indexed"] += warm.indexed
                self._stats["temp_files_removed"] += warm.temp_removed
                self._stats["foreign_files"] += warm.foreign
                self._stats["files_rejected"] += warm.rejected
            self._executor = ThreadPoolExecutor(self.num_workers, thread_name_prefix="kvcache-tier")

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
        self._check_attached(o)
        self._check_replica(o, replica_idx)
        hs, toks = self._check_hashes_tokens(o, hashes, tokens)
        with self._lock:
            n = 0
            for h, t in zip(hs, toks):
                if self._host.get(h, t) is None and (self._disk is None or self._disk.get(h, t) is None):
                    break
                n += 1
        if self._remote is not None and n < len(hs):
            # Spec remote-tier §7: the run continues in Redis (one round trip, outside the lock).
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
        self._check_attached(o)
        self._check_replica(o, replica_idx)
        hs, toks = self._check_hashes_tokens(o, hashes, tokens)
        ids = self._check_block_ids(o, block_ids, len(hs), replica_idx, distinct=True)
        if not ids:
            return CompletedTransfer()
        pages = self._pages[replica_idx]
        with self._lock:
            plan = []
            for i, (h, t) in enumerate(zip(hs, toks)):
                e = self._host.get(h, t)
                if e is not None:
                    plan.append(("host", e))
                    continue
                d = self._disk.get(h, t) if self._disk is not None else None
                if d is None and self._remote is not None:
                    # Spec remote-tier §7: fetched and verified by the worker; a refusal there
                    # fails the handle (KVLoadFailed), the pages are never published.
                    plan.append(("remote", None))
                    continue
                if d is None:
                    # Spec tiers §5: all or refuse; the refusal is counted, nothing else changes.
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
            return self._submit("load", self._run_load, pages, ids, hs, toks, plan, self._epoch)

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
        self._check_attached(o)
        self._check_replica(o, replica_idx)
        hs, toks = self._check_hashes_tokens(o, hashes, tokens)
        ids = self._check_block_ids(o, block_ids, len(hs), replica_idx, distinct=False)
        if not ids:
            return CompletedTransfer()
        with self._lock:
            self._reap()
            return self._submit("offload", self._run_offload, self._pages[replica_idx], ids, hs, toks, self._epoch)

    def touch(self, hashes: Sequence[bytes], replica_idx: int = 0) -> None:
        """Re-rank blocks served from the device: ``hashes`` is root-anchored,
        and the head of the chain ends up most recently used, so a chain's
        tail is evicted before its head (as on the device, DESIGN §4.2).

        Raises ``TypeError``/``ValueError`` for bad hashes, ``IndexError`` for
        ``replica_idx``, ``RuntimeError`` before attach or after shutdown;
        state is unchanged."""
        o = "TieredConnector.touch"
        self._check_attached(o)
        self._check_replica(o, replica_idx)
        hs = self._check_hashes(o, hashes)
        with self._lock:
            # Spec tiers §3: iterate tail first so the head ends up most recent.
            self._host.touch(reversed(hs))
            if self._disk is not None:
                self._disk.touch(reversed(hs))
            if self._remote is not None and self._remote.ttl_s is not None and self._executor is not None:
                # Spec remote-tier §7: refresh the TTL on a worker; no network on the caller's thread.
                self._background.append(self._executor.submit(self._remote.touch, hs))

    def poll_transfers(self) -> None:
        """Reap finished background work (promotions into host); never blocks.

        Raises ``RuntimeError`` if background work hit an unexpected error
        (a bug, never a full disk: that is dropped and counted)."""
        with self._lock:
            self._reap()

    def reset_prefix_cache(self) -> None:
        """Forget every stored block: host entries are dropped and the disk
        files of this tier are deleted (files still being read or written go
        when their copy ends). Offloads posted before the reset store nothing.
        Foreign files and the metadata file stay."""
        o = "TieredConnector.reset_prefix_cache"
        self._check_open(o)
        with self._lock:
            # Spec tiers §9: reset deletes this tier's block files (shutdown keeps them).
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
            self._pages = []
            self._host = None
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

    def _disk_read(self, block_hash: bytes, tokens: np.ndarray) -> tuple[memoryview, int]:
        """Read and verify one block file on a worker (``DiskBlockError`` on a mismatch)."""
        return self._disk.read_block(block_hash, tokens)

    def _disk_write(self, block_hash: bytes, tokens: np.ndarray, payload: np.ndarray) -> int:
        """Write one block file on a worker; ``OSError`` on a full or read-only disk."""
        return self._disk.write_block(block_hash, tokens, payload)

    # ------------------------------------------------------------------ workers

    def _submit(self, kind: str, fn, *args) -> TierTransfer:
        """Start ``fn(*args)`` on a worker (lock held)."""
        fut = self._executor.submit(fn, *args)
        self._inflight.add(fut)
        fut.add_done_callback(self._forget)
        return TierTransfer(fut, kind)

    def _forget(self, fut: Future) -> None:
        with self._lock:
            self._inflight.discard(fut)

    def _reap(self) -> None:
        """Drop finished background futures; surface an unexpected error (lock held)."""
        done = [f for f in self._background if f.done()]
        self._background = [f for f in self._background if not f.done()]
        for f in done:
            err = f.exception()
            if err is not None:
                raise RuntimeError(f"TieredConnector.poll_transfers: background work raised {err!r}") from err

    def _run_load(self, pages, ids, hs, toks, plan, epoch: int) -> None:
        host, disk, pb = self._host, self._disk, self._page_bytes
        promote: list[tuple[bytes, np.ndarray, np.ndarray]] = []
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
                if tier == "host":
                    np.copyto(pages[bid], host.arena[e.slot])
                elif tier == "remote":
                    data = np.frombuffer(fetched[i], dtype=np.uint8)
                    np.copyto(pages[bid], data)
                    promote.append((h, t, data))
                else:
                    try:
                        payload, nread = self._disk_read(h, t)
                    except DiskBlockError as err:
                        with self._lock:
                            disk.reject(e)
                            self._stats["files_rejected"] += 1
                            self._stats["load_failures"] += 1
                        # Spec tiers §6: a bad file fails the load; its pages are never published.
                        raise KVLoadFailed(
                            f"TieredConnector.load: hashes[{i}]={h.hex()[:16]} disk copy refused: {err}"
                        ) from err
                    data = np.frombuffer(payload, dtype=np.uint8)
                    np.copyto(pages[bid], data)
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
                if promote and host.num_slots and self._executor is not None:
                    # Spec tiers §9: a reset after the post forgets these blocks too
                    self._background.append(self._executor.submit(self._promote, promote, epoch))

    def _promote(self, blocks, epoch: int) -> None:
        """Copy blocks read from disk into host slots (background)."""
        host = self._host
        for h, t, data in blocks:
            with self._lock:
                if epoch != self._epoch:
                    return
                entry, evicted = host.reserve(h, t, copy_evicted=self.write_policy == "write_back")
            if entry is not None:
                np.copyto(host.arena[entry.slot], data)
                with self._lock:
                    host.commit(entry)
            self._write_evicted(evicted)

    def _run_offload(self, pages, ids, hs, toks, epoch: int) -> None:
        host, disk, pb = self._host, self._disk, self._page_bytes
        write_back = self.write_policy == "write_back"
        for bid, h, t in zip(ids, hs, toks):
            src = pages[bid]
            with self._lock:
                if epoch != self._epoch:
                    return  # Spec tiers §9: a reset forgets offloads posted before it
                in_host = host.has_entry(h)
                host_e, evicted = (None, []) if in_host else host.reserve(h, t, copy_evicted=write_back)
                host_ok = in_host or host_e is not None
                disk_e, to_disk, disk_ok = None, False, True
                if disk is not None:
                    # Spec tiers §3: write-through sends every block to disk; write-back only
                    # what host could not take (the rest goes to disk on host eviction).
                    to_disk = not write_back or not host_ok
                    if to_disk and not disk.has_entry(h):
                        disk_e = disk.reserve(h, t)
                        disk_ok = disk_e is not None
                host_missing = host.num_slots > 0 and not host_ok and not (write_back and to_disk)
                # Spec remote-tier §7: with a remote tier, a block no local tier was meant to
                # take is the remote's to store (put_many counts its own drops).
                stored_nowhere = not (host_ok or (to_disk and disk_ok)) and self._remote is None
                dropped = host_missing or not disk_ok or stored_nowhere
            if host_e is not None:
                np.copyto(host.arena[host_e.slot], src)
                with self._lock:
                    host.commit(host_e)
            if host_e is not None or disk_e is not None:
                with self._lock:
                    self._metrics.d2h_bytes_copied += pb
            if disk_e is not None and not self._write_disk(disk_e, h, t, src):
                dropped = True
            if dropped:
                with self._lock:
                    self._metrics.connector_offload_blocks_dropped += 1
            self._write_evicted(evicted)
        if self._remote is not None:
            # Spec remote-tier §7: SET NX of the pinned source pages, one round trip; a failing
            # store drops them (counted by the remote tier), never raises.
            self._remote.put_many(hs, toks, [pages[bid] for bid in ids])
        with self._lock:
            host.touch(reversed(hs))
            if disk is not None:
                disk.touch(reversed(hs))

    def _write_disk(self, entry, h: bytes, t: np.ndarray, payload: np.ndarray) -> bool:
        """Write a reserved disk entry; False (reservation released, counted) on ``OSError``."""
        try:
            n = self._disk_write(h, t, payload)
        except OSError:
            # Spec tiers §6: a full or read-only disk drops the block, never raises into serving.
            with self._lock:
                self._disk.abort(entry)
                self._stats["disk_write_errors"] += 1
            return False
        with self._lock:
            self._disk.commit(entry)
            self._metrics.disk_bytes_written += n
        return True

    def _write_evicted(self, evicted: list[Evicted]) -> None:
        """Write-back: blocks pushed out of host go to disk (worker thread)."""
        for v in evicted:
            if v.data is None or self._disk is None:
                continue
            with self._lock:
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
        if self._params is None:
            raise RuntimeError(f"{o}: call attach(buffers, params) first")

    def _check_replica(self, o: str, replica_idx) -> None:
        r = check_int(o, "replica_idx", replica_idx)
        if not 0 <= r < len(self._pages):
            raise IndexError(f"{o}: replica_idx={r} out of range [0, {len(self._pages)})")

    def _check_hashes(self, o: str, hashes) -> list[bytes]:
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

    def _check_hashes_tokens(self, o: str, hashes, tokens) -> tuple[list[bytes], np.ndarray]:
        hs = self._check_hashes(o, hashes)
        ps = self._params.page_size
        arr = np.asarray(tokens)
        if arr.size == 0 and not hs:
            return hs, np.zeros((0, ps), dtype=np.int32)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"{o}: tokens dtype={arr.dtype}, must be an integer type")
        if arr.shape != (len(hs), ps):
            raise ValueError(f"{o}: tokens shape={arr.shape} != (len(hashes)={len(hs)}, page_size={ps})")
        if arr.dtype != np.int32 and (arr.min() < -(2**31) or arr.max() > 2**31 - 1):
            raise ValueError(f"{o}: tokens value out of int32 range")
        return hs, arr.astype(np.int32)

    def _check_block_ids(self, o: str, block_ids, n: int, replica_idx: int, *, distinct: bool) -> list[int]:
        if not hasattr(block_ids, "__len__"):
            raise TypeError(f"{o}: block_ids={block_ids!r:.60}, must be a sequence of ints")
        if len(block_ids) != n:
            raise ValueError(f"{o}: len(block_ids)={len(block_ids)} != len(hashes)={n}")
        num_blocks = self._pages[replica_idx].shape[0]
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
