"""Wrong-K/V races between the tiers' transfer threads and ``CudaPageStore``'s staging buffers.

A tier reads device pages (offload) and writes them (load) from worker threads through the
replica's ``PageStore``; ``kvspec.PageStore.read``'s result is valid until the next *read* on
the same store from the same thread. ``CudaPageStore`` stages through a pinned host buffer:
when one buffer was shared by every thread, a load's write on one worker overwrote an
offload's read result on another before it reached the host arena, and a later load of that
block served the other block's bytes (the decoder's ``manager-host-tier`` on the emulated
device: logits off by ~8-20 in some runs). The interleavings are forced here with events, so
each test fails every time on such a store. Runs on the emulated device (``KVFAST_CUDA_EMULATE``).
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np

import kvfast  # noqa: F401  (installs the emulation finder)
import kvref


def _store(cp, num_pages=8, seed=0):
    from kvfast._cuda.page_store import CudaPageStore

    host = np.random.default_rng(seed).standard_normal((num_pages, 2, 1, 4, 1, 2)).astype(np.float32)
    return CudaPageStore(cp.asarray(host)), host


def _run(fn):
    """``fn()`` on a new thread; re-raise what it raised."""
    err = []

    def body():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            err.append(e)

    t = threading.Thread(target=body)
    t.start()
    return t, err


def test_a_read_survives_another_threads_read_and_write(emulated):
    """Thread A reads pages 1, 2 and holds the result while thread B writes page 3 and reads 4, 5."""
    ps, host = _store(emulated)
    want = host[[1, 2]].view(np.uint8).reshape(2, -1).copy()
    held, go = threading.Event(), threading.Event()
    got = {}

    def a():
        got["a"] = ps.read([1, 2])
        held.set()
        assert go.wait(10)
        got["a_after"] = got["a"].copy()

    def b():
        ps.write([3], np.full((1, ps.page_nbytes), 0xAB, np.uint8))
        got["b"] = ps.read([4, 5]).copy()

    ta, ea = _run(a)
    assert held.wait(10)
    tb, eb = _run(b)
    tb.join(10)
    go.set()
    ta.join(10)
    assert not ea and not eb, (ea, eb)
    assert np.array_equal(got["a_after"], want)  # B staged through its own buffers
    assert np.array_equal(got["b"], host[[4, 5]].view(np.uint8).reshape(2, -1))


def test_a_read_survives_a_write_on_the_same_thread(emulated):
    """kvspec.PageStore: a read's result is valid until the next read (a write does not end it)."""
    ps, host = _store(emulated)
    got = ps.read([1, 2])
    ps.write([6], np.full((1, ps.page_nbytes), 0x5A, np.uint8))
    assert np.array_equal(got, host[[1, 2]].view(np.uint8).reshape(2, -1))
    ps.write([7], got[1:2])  # and the bytes written are what was read
    assert ps.read([7]).tobytes() == host[2].tobytes()


def test_an_offload_read_is_not_overwritten_by_a_concurrent_load(emulated):
    """The reported interleaving through ``TieredConnector`` (2 workers): the offload of page 1
    has read it and is held before its copy into the host arena; a load of another block into
    page 3 runs on the other worker; the offload then lands. Loading the offloaded block back
    must give page 1's bytes."""
    params = kvref.KVCacheParams(page_size=4, num_layers=1, kv_heads=1, head_dim=2, dtype="float32")
    ps, host = _store(emulated)
    conn = kvref.TieredConnector(host_bytes=8 * ps.page_nbytes, num_workers=2)
    held, go = threading.Event(), threading.Event()
    block = {"on": False}
    real_read = ps.read

    def read(ids):
        out = real_read(ids)
        if block["on"]:
            held.set()
            assert go.wait(10)
        return out

    ps.read = read  # the connector calls the store it was given
    conn.attach([ps], params)
    try:
        toks = np.arange(8, dtype=np.int32).reshape(2, 4)
        h0 = hashlib.sha256(b"block 0").digest()
        h1 = hashlib.sha256(b"block 1").digest()
        conn.offload([2], [h0], toks[:1]).synchronize()  # h0 in host
        block["on"] = True
        off = conn.offload([1], [h1], toks[1:])
        assert held.wait(10)  # the worker read page 1 and waits before the arena copy
        block["on"] = False
        conn.load([3], [h0], toks[:1]).synchronize()  # the other worker writes page 3
        go.set()
        off.synchronize()
        conn.load([4], [h1], toks[1:]).synchronize()
        got = ps.read([3, 4])
        assert got[0].tobytes() == host[2].tobytes()
        assert got[1].tobytes() == host[1].tobytes()  # not page 2's bytes (the load's staging)
    finally:
        go.set()
        conn.shutdown()
