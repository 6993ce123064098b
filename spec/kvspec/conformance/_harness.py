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
from ._compare import Outcome, assert_same, assert_same_outcome, capture
from .machine import cache_snapshot, scatter_kv

__all__ = ["CachePair", "write_step"]


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
        self.sut = backend.make_cache(config, specs)
        self.paged = config.mode is KVCacheMode.PAGED

    def snapshot(self, cache) -> dict:
        strict = cache is self.ref or self.backend.supports("strict_block_ids")
        return cache_snapshot(cache, self.specs, free_order=strict and self.paged)

    def call(self, label: str, fn: Callable[[Any, Any], Any]) -> tuple[Outcome, Outcome]:
        """Run ``fn(cache, ops)`` on both; assert the same outcome and, after a
        raise, unchanged state. Returns both outcomes."""
        before = (self.snapshot(self.ref), self.snapshot(self.sut))
        r = capture(lambda: fn(self.ref, self.oracle.ops))
        s = capture(lambda: fn(self.sut, self.backend.ops))
        assert_same_outcome(label, r, s)
        if r.raised:
            assert_same(before[0], self.snapshot(self.ref), f"{label} [kvref state after raise]")
            assert_same(before[1], self.snapshot(self.sut), f"{label}: state changed after {type(s.exc).__name__}")
        return r, s

    def ok(self, label: str, fn):
        """``call`` that must succeed; returns (kvref value, backend value)."""
        r, s = self.call(label, fn)
        if r.raised:
            raise AssertionError(f"{label}: kvref raised {r.exc!r}; the test expects success")
        return r.value, s.value

    def raises(self, label: str, fn, exc_type: type) -> str:
        """``call`` that must raise ``exc_type`` on both; returns the message."""
        r, s = self.call(label, fn)
        if not r.raised or not isinstance(r.exc, exc_type):
            raise AssertionError(f"{label}: kvref gave {r.exc or r.value!r}, the test expects {exc_type.__name__}")
        return str(s.exc)

    def write(self, slot: int, n: int, seed: int = 0):
        """``write_step`` on both sides; returns the K/V written (same on both)."""
        w, _ = self.ok(f"write_step(cache, ops, {slot}, {n}, seed={seed})",
                       lambda c, ops: write_step(c, ops, slot, n, seed))
        return w

    def agree(self) -> None:
        """Invariants on both, then the full observable state compared."""
        self.ref.check_invariants()
        if self.backend.supports("invariants"):
            self.sut.check_invariants()
        a, b = self.snapshot(self.ref), self.snapshot(self.sut)
        if not self.backend.supports("strict_block_ids"):
            for key in [k for k in a if k.startswith(("keys", "values", "free_order", "block_table"))]:
                a.pop(key, None)
                b.pop(key, None)
        assert_same(a, b, "state")
