"""The drain skips polling in-flight offloads while the connector's completion count is
unchanged (spec/manager.md §9.2), and never misses a finished one.

Real ``TieredConnector`` (real worker threads, host tier in bookkeeping mode);
``Future.done`` calls are counted on the handles the connector returns.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvfast
import kvref
from kvspec import KVCacheParams, TextContext

PKGS = [kvref, kvfast]


def _manager(pkg):
    params = KVCacheParams(page_size=4, num_layers=1, kv_heads=1, head_dim=2, host_offload_bytes=1 << 20)
    return pkg.PagedKVCacheManager(params, num_blocks=64, max_batch_size=4, max_seq_len=64)


def _gate_offloads(m):
    """Hold every offload of ``m``'s connector until ``gate`` is set; count is_complete calls."""
    conn = m._connector
    gate, polls = threading.Event(), [0]
    run = conn._run_offload

    def gated(*a, **kw):
        gate.wait(10)
        return run(*a, **kw)

    conn._run_offload = gated
    offload = conn.offload

    def counting_offload(*a, **kw):
        handle = offload(*a, **kw)
        is_complete = handle.is_complete

        class Counted:
            def is_complete(self):
                polls[0] += 1
                return is_complete()

            def synchronize(self):
                return handle.synchronize()

        return Counted()

    conn.offload = counting_offload
    return gate, polls


@pytest.mark.parametrize("pkg", PKGS, ids=lambda p: p.__name__)
def test_alloc_polls_offloads_only_after_a_completion(pkg):
    m = _manager(pkg)
    try:
        gate, polls = _gate_offloads(m)
        ctx = TextContext("a", np.arange(17, dtype=np.int64))
        m.claim(ctx)
        m.alloc(ctx)
        ctx.update(1)
        m.step(ctx)
        m.runtime_inputs([[ctx]])  # posts the offload of the 4 committed pages (gated)
        assert m.pending_transfers_exist(0)
        first = polls[0]
        for t in range(8):  # decode steps: alloc drains each time, nothing completed
            m.alloc(ctx)
            ctx.update(2 + t)
            m.step(ctx)
        assert polls[0] - first <= 1  # at most the poll that recorded the count
        gate.set()
        deadline = threading.Event()
        for _ in range(1000):  # the count moves once the worker finishes; a drain then unpins
            m.alloc(ctx)
            if not m.pending_transfers_exist(0):
                break
            deadline.wait(0.01)
        assert not m.pending_transfers_exist(0)
    finally:
        gate.set()
        m.shutdown()


@pytest.mark.parametrize("pkg", PKGS, ids=lambda p: p.__name__)
def test_poll_transfers_after_synchronize_always_unpins(pkg):
    m = _manager(pkg)
    try:
        ctx = TextContext("a", np.arange(17, dtype=np.int64))
        m.claim(ctx)
        m.alloc(ctx)
        ctx.update(1)
        m.step(ctx)
        m.runtime_inputs([[ctx]])
        for off in list(m._offloads):
            off.handle.synchronize()
        m.poll_transfers()  # polls every handle, whatever the count says
        assert not m.pending_transfers_exist(0)
    finally:
        m.shutdown()


def test_completed_transfers_counts_each_finished_transfer():
    m = _manager(kvref)
    try:
        conn = m._connector
        before = conn.completed_transfers()
        ctx = TextContext("a", np.arange(17, dtype=np.int64))
        m.claim(ctx)
        m.alloc(ctx)
        ctx.update(1)
        m.step(ctx)
        m.runtime_inputs([[ctx]])
        posted = len(m._offloads)
        m.poll_transfers()
        for _ in range(500):
            if conn.completed_transfers() >= before + posted:
                break
            threading.Event().wait(0.01)
        assert conn.completed_transfers() == before + posted
    finally:
        m.shutdown()
