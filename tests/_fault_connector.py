"""Test helpers for the tiers: a fault-injecting connector wrapper and a
deterministic "model" that writes K/V from token ids and positions.

``FaultConnector`` wraps a real connector (a ``TieredConnector`` with real
files and threads) and, on demand, refuses the next lookup (reports a miss),
refuses the next load (``KVLoadRefused``), fails it at post
(``KVLoadFailed``), fails it at the first poll, or fails it later (after the
handle reported "not yet" at least once). A load that fails after post first
**scribbles garbage** over its destination pages, as a torn DMA would, so a
manager that published an unlanded page would serve wrong K/V and the
content check catches it.

With ``gated=True`` every handle it returns reports "not complete" until the
test calls ``land()``; the inner copies themselves run (on real worker
threads) and are waited for inside each call, so the tiers' contents, and
hence every lookup, are deterministic (Hypothesis needs that), while the
manager still sees transfers in flight and must pin, cordon and publish only
after landing.
"""

from __future__ import annotations

import time

import numpy as np

from kvspec import CompletedTransfer, KVCacheMetrics, TextContext
from kvspec.errors import KVLoadFailed, KVLoadRefused

__all__ = ["FaultConnector", "GatedTransfer", "kv_values", "write_forward", "LOAD_FAULTS", "CONNECTOR_BUG",
           "ConnectorBug", "manager_state", "request_state"]

#: What ``FaultConnector.arm`` can make the next load do (each a miss or a failure the manager handles).
LOAD_FAULTS = ("refuse", "fail_post", "fail_first_poll", "fail_later")

#: ``FaultConnector.arm(CONNECTOR_BUG)``: the next load raises :class:`ConnectorBug`, an exception of no
#: ``KVLoad*`` type (a bug of the connector), which ``alloc`` propagates with all state as it was.
CONNECTOR_BUG = "connector_bug"


class ConnectorBug(RuntimeError):
    """The unexpected exception ``FaultConnector.load`` raises when armed with ``CONNECTOR_BUG``."""


def manager_state(m, ctxs=()) -> tuple:
    """Everything a manager call may change, comparable with ``==``: per replica, every leaf's free
    order, ``block_count`` and pins, with several leaves the slab's parked queue, owners and live
    counts; the metrics, transfers in flight; then :func:`request_state` of ``ctxs``."""
    out = [m.get_metrics_aggregated()]
    for r in range(m.params.data_parallel_degree):
        out += [{lid: m._free_order(r, lid) for lid in m.params.leaves()}, m.block_count(r),
                m.pending_transfers_exist(r), dict(m._pins[r]), dict(m._leaf_pins[r])]
        if m._slabs:
            t = m._slabs[r].table
            out += [t.parked_order(), t.owners(), t.live_counts()]
    return tuple(out) + request_state(m, ctxs)


def request_state(m, ctxs) -> tuple:
    """Per context: claimed or not, its lengths and hit, and (claimed) its rows and lookup state."""
    out = []
    for ctx in ctxs:
        claimed = m.contains(ctx)
        out += [ctx.request_id, claimed, ctx.processed_length, ctx.active_length, ctx.cached_prefix_length,
                ctx.cached_prefix_external_length]
        if claimed:
            out += [m.get_req_blocks_per_leaf(ctx), m.awaits_lookup(ctx)]
    return tuple(out)


def kv_values(tokens: np.ndarray, positions: np.ndarray, page_shape, dtype) -> np.ndarray:
    """The K/V a deterministic model writes for ``tokens`` at ``positions``.

    Returns ``[n, 2, num_layers, kv_heads, head_dim]`` of ``dtype``: small
    integers (exact in every float dtype), distinct per token, position,
    K/V, layer, head and lane.
    """
    _, layers, _, heads, dim = page_shape
    t = np.asarray(tokens, dtype=np.int64).reshape(-1, 1, 1, 1, 1)
    p = np.asarray(positions, dtype=np.int64).reshape(-1, 1, 1, 1, 1)
    kv = np.arange(2).reshape(1, 2, 1, 1, 1)
    ly = np.arange(layers).reshape(1, 1, layers, 1, 1)
    hd = np.arange(heads).reshape(1, 1, 1, heads, 1)
    ln = np.arange(dim).reshape(1, 1, 1, 1, dim)
    return ((t * 131 + p * 17 + kv * 7 + ly * 5 + hd * 3 + ln) % 251).astype(dtype)


def write_forward(buffer: np.ndarray, row: list[int], tokens: np.ndarray, start: int, stop: int) -> None:
    """Write the K/V of positions ``[start, stop)`` through the request's row
    (what a forward's ``append_kv`` does)."""
    page_size = buffer.shape[3]
    pos = np.arange(start, stop)
    vals = kv_values(tokens[start:stop], pos, buffer.shape[1:], buffer.dtype)
    for j, q in enumerate(pos):
        buffer[row[q // page_size], :, :, q % page_size] = vals[j]


class GatedTransfer:
    """A handle that completes when its connector lands it, then succeeds or fails."""

    def __init__(self, owner: "FaultConnector", fault: str | None, pages: list[int], replica: int):
        self._owner = owner
        self.fault = fault
        self.pages = pages
        self.replica = replica
        self.landed = not owner.gated
        self.polls = 0
        self.scribbled = False

    def is_complete(self) -> bool:
        self.polls += 1
        if self.fault == "fail_first_poll":
            self._fail()
        if not self.landed:
            return False
        if self.fault == "fail_later":
            self._fail()
        return True

    def synchronize(self) -> None:
        self.landed = True
        if self.fault in ("fail_first_poll", "fail_later"):
            self._fail()

    def _fail(self):
        if not self.scribbled:
            # a torn copy: whatever landed is garbage
            buf = self._owner.buffers[self.replica]
            if isinstance(buf, np.ndarray):
                for b in self.pages:
                    buf[b].view(np.uint8)[...] = 0xAB
            elif buf.holds_bytes:  # a kvspec.PageStore: write through it, as the tiers do
                buf.write(list(self.pages), np.full((len(self.pages), buf.page_nbytes), 0xAB, np.uint8))
            self.scribbled = True
        raise KVLoadFailed(f"FaultConnector: injected {self.fault} for pages {self.pages}")


class FaultConnector:
    """A ``KVConnector`` that forwards to ``inner`` and injects faults.

    Parameters
    ----------
    inner : KVConnector
        The real connector (e.g. ``TieredConnector``).
    gated : bool
        Handles complete only after ``land()`` (see the module docstring).
    load_faults : mapping of int to str, optional
        ``{k: fault}``: the k-th ``load`` call (1-based) does ``fault``.
    lookup_misses : set of int, optional
        The k-th ``lookup`` calls (1-based) report a miss.
    """

    name = "fault"

    def __init__(self, inner, *, gated: bool = False, load_faults=None, lookup_misses=()):
        for k, f in dict(load_faults or {}).items():
            if f not in LOAD_FAULTS:
                raise ValueError(f"FaultConnector: load_faults[{k}]={f!r}, must be one of {LOAD_FAULTS}")
        self.inner = inner
        self.gated = gated
        self.load_faults = dict(load_faults or {})
        self.lookup_misses = set(lookup_misses)
        self.buffers: list[np.ndarray] = []
        self.lookups = 0
        self.loads = 0
        self._next_load_fault: str | None = None
        self._refuse_next_lookup = False
        self._open: list[GatedTransfer] = []
        self.injected: list[str] = []
        # a refusal is the connector's counter (connector_loads_refused): count ours too
        self._own = KVCacheMetrics()

    # -- arming
    def arm(self, fault: str) -> None:
        """Make the next ``load`` do ``fault`` (one of ``LOAD_FAULTS``, or ``CONNECTOR_BUG``)."""
        if fault not in LOAD_FAULTS + (CONNECTOR_BUG,):
            raise ValueError(f"FaultConnector.arm: fault={fault!r}, must be one of {LOAD_FAULTS + (CONNECTOR_BUG,)}")
        self._next_load_fault = fault

    def refuse_next_lookup(self) -> None:
        self._refuse_next_lookup = True

    def land(self) -> None:
        """Let every handle handed out so far complete (or fail, as armed)."""
        for t in self._open:
            t.landed = True
        self._open.clear()

    def _settle(self) -> None:
        """Wait for the inner connector's background work (promotions)."""
        pending = getattr(self.inner, "pending", None)
        if pending is None:
            return
        deadline = time.monotonic() + 30
        while pending():
            self.inner.poll_transfers()
            if time.monotonic() > deadline:
                raise AssertionError("FaultConnector: inner background work never finished")
            time.sleep(0.001)
        self.inner.poll_transfers()

    def _gate(self, handle, fault, pages, replica):
        try:
            handle.synchronize()
        finally:
            self._settle()
        t = GatedTransfer(self, fault, list(pages), replica)
        if not t.landed:
            self._open.append(t)
        return t

    # -- protocol
    def attach(self, buffers, params, **kw) -> None:
        self.buffers = list(buffers)
        self.inner.attach(buffers, params, **kw)

    def lookup(self, hashes, tokens, replica_idx: int = 0) -> int:
        self.lookups += 1
        if self._refuse_next_lookup or self.lookups in self.lookup_misses:
            self._refuse_next_lookup = False
            self.injected.append("lookup_miss")
            return 0
        return self.inner.lookup(hashes, tokens, replica_idx)

    def load(self, block_ids, hashes, tokens, replica_idx: int = 0):
        self.loads += 1
        fault, self._next_load_fault = self._next_load_fault, None
        fault = self.load_faults.get(self.loads, fault)
        if fault is not None:
            self.injected.append(fault)
        if fault == "refuse" and len(block_ids):
            self._own.connector_loads_refused += 1
            raise KVLoadRefused(f"FaultConnector: injected refusal of {len(block_ids)} blocks")
        if fault == CONNECTOR_BUG and len(block_ids):
            raise ConnectorBug(f"FaultConnector: injected connector bug at the load of {len(block_ids)} blocks")
        if fault == "fail_post" and len(block_ids):
            raise KVLoadFailed(f"FaultConnector: injected failure at post of {len(block_ids)} blocks")
        handle = self.inner.load(block_ids, hashes, tokens, replica_idx)
        if not len(block_ids):
            return handle
        try:
            return self._gate(handle, fault, block_ids, replica_idx)
        except KVLoadFailed:
            # the inner copy failed for real: report it from the handle
            return self._gate(CompletedTransfer(), "fail_first_poll", block_ids, replica_idx)

    def offload(self, block_ids, hashes, tokens, replica_idx: int = 0):
        handle = self.inner.offload(block_ids, hashes, tokens, replica_idx)
        if not len(block_ids):
            return handle
        return self._gate(handle, None, block_ids, replica_idx)

    def touch(self, hashes, replica_idx: int = 0) -> None:
        self.inner.touch(hashes, replica_idx)

    def poll_transfers(self) -> None:
        self.inner.poll_transfers()

    def reset_prefix_cache(self) -> None:
        self.inner.reset_prefix_cache()

    def shutdown(self) -> None:
        self.land()
        self.inner.shutdown()

    def host_byte_count(self):
        return self.inner.host_byte_count()

    def disk_byte_count(self):
        return self.inner.disk_byte_count()

    @property
    def metrics(self) -> KVCacheMetrics:
        return self.inner.metrics + self._own

    def take_metrics(self) -> KVCacheMetrics:
        out, self._own = self.inner.take_metrics() + self._own, KVCacheMetrics()
        return out


def next_token(tokens: np.ndarray, vocab: int = 1000) -> int:
    """A deterministic "sampler": the same context always continues the same way."""
    return int((int(np.sum(tokens, dtype=np.int64)) * 7 + len(tokens)) % vocab)


def settle_manager(manager, replica_idx: int = 0, timeout: float = 30.0, land=None) -> None:
    """Poll until nothing of the replica is pinned by a transfer; ``land``
    (e.g. ``FaultConnector.land``) is called before every poll, since a poll
    may post new (gated) offloads."""
    deadline = time.monotonic() + timeout
    while True:
        if land is not None:
            land()
        manager.poll_transfers()
        if not manager.pending_transfers_exist(replica_idx):
            return
        if time.monotonic() > deadline:
            raise AssertionError("transfers never settled")
        time.sleep(0.001)


def run_request(manager, ctx, decode_steps: int = 0, *, replica_idx: int = 0, release: bool = True):
    """Serve ``ctx`` the way a scheduler does: claim, alloc (wait for its load),
    forward (write K/V of the active tokens), runtime_inputs (posts
    offloads), update, step; ``decode_steps`` more forwards; then release.
    Returns the alloc transfer of the first forward."""
    manager.claim(ctx, replica_idx)
    first = manager.alloc(ctx)
    first.synchronize()
    buf = manager.get_device_buffer(replica_idx)
    for i in range(decode_steps + 1):
        if i:
            manager.alloc(ctx).synchronize()
        row = manager.get_req_blocks_per_leaf(ctx)["full"]
        write_forward(buf, row, ctx.tokens, ctx.processed_length, ctx.current_position)
        batches = [[] for _ in range(manager.params.data_parallel_degree)]
        batches[replica_idx] = [ctx]
        manager.runtime_inputs(batches)
        ctx.update(next_token(ctx.tokens))
        manager.step(ctx)
    if release:
        manager.release(ctx)
    return first


def flush_device(manager, replica_idx: int = 0) -> None:
    """Evict every unreferenced page from a replica's device prefix cache:
    one-block filler requests (``page_size`` tokens: nothing hashed, so the
    connector is never asked) take every free page and give them back
    unpublished."""
    page = manager.params.page_size
    fillers = []
    try:
        for i in range(manager.block_count(replica_idx).free):
            ctx = TextContext(f"__filler{i}", np.full(page, 10**6 + i, dtype=np.int32))
            manager.claim(ctx, replica_idx)
            fillers.append(ctx)
            manager.alloc(ctx)
    finally:
        for ctx in fillers:
            manager.release(ctx)
