"""``Pair``: one object built on the backend and on kvref, driven in lockstep.

The method-level tests use it the way the state machines use their ``_both``
helper: every call runs on both sides, outcomes must agree, and a raise must
leave both sides' observable state unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .._config import KVCacheMode, LayerKind
from ..strategies import exact_values
from ._backend import Backend
from ._compare import Outcome, assert_same, assert_same_outcome, begin_reproduction, capture, record
from .machine import cache_snapshot, scatter_kv

__all__ = ["CachePair", "ManagerPair", "ManualConnector", "write_step"]


def write_step(cache, ops, slot: int, n: int, seed: int):
    """Prepare a one-row step of ``n`` tokens for ``slot``, write deterministic
    K/V (``exact_values(seed)``) into every attention layer, commit it.

    Returns
    -------
    dict of int -> (k, v)
        The K/V written per layer, ``[n, kv_heads, head_dim]``.
    """
    past = int(np.asarray(cache.seq_lens())[slot])
    step = cache.prepare_step(np.array([0, n], np.int32), np.array([past], np.int32), np.array([slot], np.int32))
    written = {}
    for l, spec in enumerate(cache.layer_specs if hasattr(cache, "layer_specs") else ()):
        if spec.kind in (LayerKind.ATTENTION, LayerKind.SLIDING_WINDOW):
            dt = cache.config.dtype
            k = exact_values((n, spec.kv_heads, spec.head_dim), dt, seed + 2 * l)
            v = exact_values((n, spec.kv_heads, spec.head_dim), dt, seed + 2 * l + 1)
            if ops is None:
                scatter_kv(cache, l, k, v, step)
            else:
                ops.append_kv(cache, l, k, v, step)
            written[l] = (k, v)
    cache.update_position(slot, past + n)
    return written


class CachePair:
    """A ``KVCache`` on the backend and on kvref with the same config.

    Parameters
    ----------
    backend, oracle : Backend
    config : KVCacheConfig
    specs : list of KVLayerSpec
    """

    def __init__(self, backend: Backend, oracle: Backend, config, specs):
        self.backend, self.oracle = backend, oracle
        self.config, self.specs = config, list(specs)
        self.ref = oracle.make_cache(config, specs)
        self.sut = backend.build_cache(config, specs)
        self.paged = config.mode is KVCacheMode.PAGED
        begin_reproduction("cache", backend, config=config, specs=self.specs)

    def snapshot(self, cache) -> dict:
        strict = cache is self.ref or self.backend.supports("strict_block_ids")
        return cache_snapshot(cache, self.specs, free_order=strict and self.paged)

    def call(self, label: str, fn: Callable[[Any, Any], Any]) -> tuple[Outcome, Outcome]:
        """Run ``fn(cache, ops)`` on both; assert the same outcome and, after a
        raise, unchanged state. Returns both outcomes. ``label`` is the call as
        Python source on ``cache`` and ``ops`` (it goes into the reproduction)."""
        __tracebackhide__ = True
        before = (self.snapshot(self.ref), self.snapshot(self.sut))
        r = capture(lambda: fn(self.ref, self.oracle.ops))
        s = capture(lambda: fn(self.sut, self.backend.ops), source=label)
        assert_same_outcome(label, r, s)
        if r.raised:
            assert_same(before[0], self.snapshot(self.ref), f"{label} [kvref state after raise]")
            assert_same(before[1], self.snapshot(self.sut), f"{label}: state changed after {type(s.exc).__name__}")
        return r, s

    def ok(self, label: str, fn):
        """``call`` that must succeed; returns (kvref value, backend value)."""
        __tracebackhide__ = True
        r, s = self.call(label, fn)
        if r.raised:
            raise AssertionError(f"{label}: kvref raised {r.exc!r}; the test expects success")
        return r.value, s.value

    def raises(self, label: str, fn, exc_type: type) -> str:
        """``call`` that must raise ``exc_type`` on both; returns the message."""
        __tracebackhide__ = True
        r, s = self.call(label, fn)
        if not r.raised or not isinstance(r.exc, exc_type):
            raise AssertionError(f"{label}: kvref gave {r.exc or r.value!r}, the test expects {exc_type.__name__}")
        return str(s.exc)

    def write(self, slot: int, n: int, seed: int = 0):
        """``write_step`` on both sides; returns the K/V written (same on both)."""
        __tracebackhide__ = True
        w, _ = self.ok(f"write_step(cache, ops, {slot}, {n}, seed={seed})",
                       lambda c, ops: write_step(c, ops, slot, n, seed))
        return w

    def agree(self) -> None:
        """Invariants on both, then the full observable state compared."""
        __tracebackhide__ = True
        self.ref.check_invariants()
        if self.backend.supports("invariants"):
            self.sut.check_invariants()
        a, b = self.snapshot(self.ref), self.snapshot(self.sut)
        if not self.backend.supports("strict_block_ids"):
            for key in [k for k in a if k.startswith(("keys", "values", "free_order", "block_table"))]:
                a.pop(key, None)
                b.pop(key, None)
        assert_same(a, b, "state")


class ManagerPair:
    """A ``PagedKVCacheManager`` on the backend and on kvref, with one
    ``TextContext`` per side for each request id.

    Parameters
    ----------
    backend, oracle : Backend
    params : KVCacheParams
    connectors : (ref, sut) pair of connectors, optional
    **kw
        ``num_blocks``, ``max_batch_size``, ``max_seq_len``.
    """

    def __init__(self, backend: Backend, oracle: Backend, params, connectors=(None, None), **kw):
        from .manager_machine import manager_snapshot

        self._snapshot = manager_snapshot
        self.backend, self.oracle, self.params = backend, oracle, params
        self.ref = oracle.make_manager(params, connector=connectors[0], **kw)
        self.sut = backend.build_manager(params, connector=connectors[1], **kw)
        self.ctx_ref: dict = {}
        self.ctx_sut: dict = {}
        begin_reproduction("manager", backend, params=params, kw=kw, connector=connectors[0] is not None)

    @property
    def strict(self) -> bool:
        return self.backend.supports("strict_block_ids")

    def new(self, rid: str, tokens, cache_salt=None) -> None:
        """A request ``rid`` with ``tokens`` on both sides (not claimed)."""
        from .._manager_types import TextContext

        record(f"ctx_{rid} = TextContext({rid!r}, np.array({[int(t) for t in tokens]}, np.int32), cache_salt={cache_salt!r})")
        self.ctx_ref[rid] = TextContext(rid, np.array(tokens, np.int32), cache_salt=cache_salt)
        self.ctx_sut[rid] = TextContext(rid, np.array(tokens, np.int32), cache_salt=cache_salt)

    def snapshots(self):
        return (self._snapshot(self.ref, self.ctx_ref, strict=True),
                self._snapshot(self.sut, self.ctx_sut, strict=self.strict))

    def call(self, label: str, fn) -> tuple[Outcome, Outcome]:
        """``fn(manager, contexts)`` on both; same outcome; no state change after a raise.
        ``label`` is the call as Python source on ``manager`` and ``ctx_<rid>``."""
        __tracebackhide__ = True
        before = self.snapshots()
        r = capture(lambda: fn(self.ref, self.ctx_ref))
        s = capture(lambda: fn(self.sut, self.ctx_sut), source=label)
        assert_same_outcome(label, r, s)
        if r.raised:
            after = self.snapshots()
            assert_same(before[0], after[0], f"{label} [kvref state after raise]")
            assert_same(before[1], after[1], f"{label}: state changed after {type(s.exc).__name__}")
        return r, s

    def ok(self, label: str, fn):
        """``call`` that must succeed; returns (kvref value, backend value)."""
        __tracebackhide__ = True
        r, s = self.call(label, fn)
        if r.raised:
            raise AssertionError(f"{label}: kvref raised {r.exc!r}; the test expects success")
        return r.value, s.value

    def raises(self, label: str, fn, exc_type: type) -> str:
        """``call`` that must raise ``exc_type`` on both; returns the message."""
        __tracebackhide__ = True
        r, s = self.call(label, fn)
        if not r.raised or not isinstance(r.exc, exc_type):
            raise AssertionError(f"{label}: kvref gave {r.exc or r.value!r}, the test expects {exc_type.__name__}")
        return str(s.exc)

    def forward(self, rid: str, token: int, seed: int = 0, replica_idx: int = 0) -> None:
        """``alloc`` then a forward (K/V written) then ``update(token)`` and ``step``."""
        from .manager_machine import write_forward

        __tracebackhide__ = True
        self.ok(f"manager.alloc(ctx_{rid}).is_complete()", lambda m, cs: m.alloc(cs[rid]).is_complete())
        record(f"write_forward(manager, ctx_{rid}, {seed}, {replica_idx}); ctx_{rid}.update({token})")
        for m, cs in ((self.ref, self.ctx_ref), (self.sut, self.ctx_sut)):
            write_forward(m, cs[rid], seed, replica_idx)
            cs[rid].update(token)
        self.ok(f"manager.step(ctx_{rid})", lambda m, cs: m.step(cs[rid]))

    def agree(self) -> None:
        """Invariants on both, then the manager state (and contexts) compared."""
        __tracebackhide__ = True
        self.ref.check_invariants()
        if self.backend.supports("invariants"):
            self.sut.check_invariants()
        assert_same(self._snapshot(self.ref, self.ctx_ref, strict=self.strict),
                    self._snapshot(self.sut, self.ctx_sut, strict=self.strict), "manager state")


class ManualConnector:
    """A connector whose loads land (``land()``) or fail (``fail()``) only when the test says so.

    ``offload`` copies pages into a dict at once; ``load`` returns a pending
    handle and copies nothing until ``land()``. ``reset_prefix_cache`` keeps
    the store (so a test can drop the device cache and still load). Token ids
    are stored and compared: a mismatch is a miss, never wrong K/V.
    """

    name = "manual"

    def __init__(self):
        self.store: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
        self.pending: list["_ManualTransfer"] = []
        self.buffers = None

    def attach(self, buffers, params, *, owner=None) -> None:
        self.buffers = list(buffers)

    def lookup(self, hashes, tokens, replica_idx: int = 0) -> int:
        n = 0
        for h, t in zip(hashes, tokens):
            held = self.store.get(bytes(h))
            if held is None or not np.array_equal(held[0], np.asarray(t)):
                break
            n += 1
        return n

    def load(self, block_ids, hashes, tokens, replica_idx: int = 0):
        from ..errors import KVLoadRefused

        if self.lookup(hashes, tokens, replica_idx) < len(hashes):
            raise KVLoadRefused(f"ManualConnector.load: {len(hashes)} blocks asked, not all held")
        t = _ManualTransfer(self, replica_idx, list(block_ids), [bytes(h) for h in hashes])
        self.pending.append(t)
        return t

    def land(self) -> int:
        """Copy every pending load into the device buffers; returns how many landed."""
        n = len(self.pending)
        for t in self.pending:
            for b, h in zip(t.block_ids, t.hashes):
                _assign_page(self.buffers[t.replica], b, self.store[h][1])
            t.done = True
        self.pending = []
        return n

    def fail(self) -> int:
        """Fail every pending load: its handle's ``is_complete()`` raises
        ``KVLoadFailed`` and nothing is copied. Returns how many failed."""
        n = len(self.pending)
        for t in self.pending:
            t.failed = True
        self.pending = []
        return n

    def offload(self, block_ids, hashes, tokens, replica_idx: int = 0):
        from .._manager_types import CompletedTransfer

        for b, h, t in zip(block_ids, hashes, tokens):
            self.store[bytes(h)] = (np.array(t), to_numpy_page(self.buffers[replica_idx], b))
        return CompletedTransfer()

    def touch(self, hashes, replica_idx: int = 0) -> None:
        return None

    def poll_transfers(self) -> None:
        return None

    def reset_prefix_cache(self) -> None:
        return None

    def shutdown(self) -> None:
        self.land()

    def host_byte_count(self):
        from .._manager_types import ByteCount

        return ByteCount(0, 0)

    def disk_byte_count(self):
        from .._manager_types import ByteCount

        return ByteCount(0, 0)

    @property
    def metrics(self):
        from .._manager_types import KVCacheMetrics

        return KVCacheMetrics()

    def take_metrics(self):
        from .._manager_types import KVCacheMetrics

        return KVCacheMetrics()


class _ManualTransfer:
    def __init__(self, conn: ManualConnector, replica: int, block_ids: list[int], hashes: list[bytes]):
        self.conn, self.replica, self.block_ids, self.hashes = conn, replica, block_ids, hashes
        self.done = False
        self.failed = False

    def is_complete(self) -> bool:
        if self.failed:
            from ..errors import KVLoadFailed

            raise KVLoadFailed(f"ManualConnector: load of {len(self.block_ids)} blocks failed")
        return self.done

    def synchronize(self) -> None:
        if not self.done and not self.failed:
            self.conn.land()
        self.is_complete()


def to_numpy_page(buffer, block: int) -> np.ndarray:
    from .._page_store import PageStore
    from ._compare import to_numpy

    if isinstance(buffer, PageStore) and not hasattr(buffer, "__getitem__"):  # the manager attaches page stores
        return np.array(buffer.read([block])[0])
    return to_numpy(buffer[block]).copy()


def _assign_page(buffer, block: int, page: np.ndarray) -> None:
    from .._page_store import PageStore

    if isinstance(buffer, PageStore) and not hasattr(buffer, "__getitem__"):  # uint8 [page_nbytes]
        buffer.write([block], page[None])
    elif isinstance(buffer, np.ndarray):
        buffer[block] = page
    else:  # pragma: no cover - GPU arrays
        from ._compare import to_device

        buffer[block] = to_device(page)
