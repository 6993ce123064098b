"""TieredConnector on its own: validation, host tier, transfers, write policies, threads.

Real worker threads throughout; the disk tier uses real files under tmp_path
(its format, warm start and crash safety are in test_disk_tier.py).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvref
from kvref import KVCacheMetrics, KVCacheParams, KVLoadFailed, KVLoadRefused, TieredConnector
from kvref._tiers import TierTransfer
from kvspec import CompletedTransfer, KVConnector
from kvspec.hashing import block_hashes

PS = 4  # page size


def make_params(**kw) -> KVCacheParams:
    args = dict(page_size=PS, num_layers=2, kv_heads=2, head_dim=4, dtype="float16")
    args.update(kw)
    return KVCacheParams(**args)


def make_buffer(params: KVCacheParams, num_blocks: int = 16) -> np.ndarray:
    return np.zeros((num_blocks,) + params.page_shape, dtype=params.np_dtype)


def chain(n_blocks: int, start: int = 0, algo: str = "sha256", salt=None):
    """Tokens int32 [n, PS] and their chained hashes."""
    toks = np.arange(start, start + n_blocks * PS, dtype=np.int32)
    return block_hashes(toks, PS, algo, cache_salt=salt), toks.reshape(n_blocks, PS)


def fill(buf: np.ndarray, block_ids, seed: int) -> None:
    """Deterministic distinct bytes into pages ``block_ids``."""
    rng = np.random.default_rng(seed)
    for b in block_ids:
        raw = buf[b].view(np.uint8)
        raw[...] = rng.integers(0, 256, raw.shape, dtype=np.uint8)


def page_bytes(buf: np.ndarray, block_ids) -> list[bytes]:
    return [buf[b].tobytes() for b in block_ids]


def state_of(conn: TieredConnector):
    """Everything observable: metrics, byte counts, stats, holdings, host LRU."""
    with conn._lock:
        host = list(conn._host.ready_hashes()) if conn._host is not None else None
        disk = list(conn._disk.ready_hashes()) if conn._disk is not None else None
        arena = conn._host.arena.tobytes() if conn._host is not None else None
    return (conn.metrics, conn.host_byte_count(), conn.disk_byte_count(), conn.tier_stats(), host, disk, arena)


@pytest.fixture
def params():
    return make_params()


@pytest.fixture
def attached(params):
    """A connector with 4 host slots over a 16-block buffer, no disk."""
    buf = make_buffer(params)
    conn = TieredConnector(host_bytes=4 * params.page_bytes())
    conn.attach([buf], params)
    yield conn, buf
    conn.shutdown()


# --------------------------------------------------------------------------- construction


def test_satisfies_the_protocol(params):
    conn = TieredConnector(host_bytes=1024)
    assert isinstance(conn, KVConnector)
    assert kvref.TieredConnector is TieredConnector
    assert conn.name == "tiered"


@pytest.mark.parametrize(
    "kwargs, exc, text",
    [
        (dict(host_bytes=-1), ValueError, "host_bytes=-1"),
        (dict(host_bytes=0, disk_bytes=-5, disk_dir="x"), ValueError, "disk_bytes=-5"),
        (dict(host_bytes=0, disk_bytes=100), ValueError, "disk_bytes=100 > 0 needs disk_dir"),
        (dict(host_bytes=0, disk_bytes=100, disk_dir=""), ValueError, "needs disk_dir"),
        (dict(host_bytes=0, write_policy="write_around"), ValueError, "write_policy='write_around'"),
        (dict(host_bytes=0, num_workers=0), ValueError, "num_workers=0"),
        (dict(host_bytes=1.5), TypeError, "host_bytes=1.5"),
        (dict(host_bytes=True), TypeError, "host_bytes=True"),
        (dict(host_bytes=0, disk_bytes=10, disk_dir=7), TypeError, "disk_dir=7"),
    ],
)
def test_constructor_validation(kwargs, exc, text):
    with pytest.raises(exc, match=text.replace("(", r"\(").replace(")", r"\)")):
        TieredConnector(**kwargs)


def test_attach_validation(params):
    conn = TieredConnector(host_bytes=1024)
    buf = make_buffer(params)
    with pytest.raises(TypeError, match="params="):
        conn.attach([buf], object())
    with pytest.raises(ValueError, match=r"len\(stores\)=2 != data_parallel_degree=1"):
        conn.attach([buf, buf], params)
    with pytest.raises(ValueError, match=r"stores\[0\].shape"):
        conn.attach([np.zeros((4, 2, 2, PS, 2, 8), np.float16)], params)
    with pytest.raises(ValueError, match=r"stores\[0\].dtype=float32 != params.dtype=float16"):
        conn.attach([buf.astype(np.float32)], params)
    with pytest.raises(ValueError, match="not C-contiguous"):
        conn.attach([np.asfortranarray(buf)], params)
    with pytest.raises(TypeError, match=r"stores\[0\] is list"):
        conn.attach([buf.tolist()], params)
    # nothing was attached by the failures
    assert conn.host_byte_count() == kvref.ByteCount(0, 0)
    with pytest.raises(RuntimeError, match="call attach"):
        conn.lookup([], np.zeros((0, PS), np.int32))


def test_host_arena_size_and_byte_counts(params):
    pb = params.page_bytes()
    conn = TieredConnector(host_bytes=3 * pb + pb // 2)
    assert conn.host_byte_count() == kvref.ByteCount(0, 0)  # no arena before attach
    buf = make_buffer(params)
    conn.attach(buf, params)  # a single 6-D array is one replica
    assert conn.host_byte_count() == kvref.ByteCount(3 * pb, 3 * pb)
    assert conn.disk_byte_count() == kvref.ByteCount(0, 0)
    hs, toks = chain(2)
    fill(buf, [1, 2], 0)
    conn.offload([1, 2], hs, toks).synchronize()
    assert conn.host_byte_count() == kvref.ByteCount(pb, 3 * pb)
    assert conn.host_byte_count().used_pct == pytest.approx(100 * 2 / 3)
    conn.shutdown()
    assert conn.host_byte_count() == kvref.ByteCount(0, 0)


def test_reattach_same_geometry_keeps_tiers_other_geometry_refused(attached, params):
    conn, buf = attached
    hs, toks = chain(2)
    fill(buf, [1, 2], 1)
    conn.offload([1, 2], hs, toks).synchronize()
    conn.attach([buf], params)  # the same owner's pages: accepted, tiers kept
    conn.detach()
    buf2 = make_buffer(params, num_blocks=8)
    conn.attach([buf2], params)  # after detach another owner may attach
    conn.load([5, 6], hs, toks).synchronize()
    assert page_bytes(buf2, [5, 6]) == page_bytes(buf, [1, 2])
    conn.detach()
    with pytest.raises(ValueError, match="re-attach with geometry"):
        conn.attach([make_buffer(make_params(head_dim=8))], make_params(head_dim=8))
    with pytest.raises(ValueError, match="hash_algo='xxh3_128'"):
        conn.attach([buf2], make_params(hash_algo="xxh3_128"))
    with pytest.raises(ValueError, match="model_id"):
        conn.attach([buf2], make_params(model_id="other"))


def test_second_live_owner_is_refused_until_detach(params):
    """Issue 11 (2): a connector handed to a second live manager must not re-bind."""
    conn = TieredConnector(host_bytes=4 * params.page_bytes())
    first, second = object.__new__(type("Mgr", (), {})), object.__new__(type("Mgr", (), {}))
    buf1, buf2 = make_buffer(params), make_buffer(params)
    conn.attach([buf1], params, owner=first)
    hs, toks = chain(2)
    fill(buf1, [1, 2], 3)
    conn.offload([1, 2], hs, toks).synchronize()
    before = state_of(conn)
    with pytest.raises(RuntimeError, match="another live owner"):
        conn.attach([buf2], params, owner=second)
    with pytest.raises(RuntimeError, match="another live owner"):
        conn.attach([buf1], params)  # no owner given while an owner holds it
    assert state_of(conn) == before
    conn.attach([buf1], params, owner=first)  # the same owner re-attaches
    # the connector still reads the first owner's pages
    fill(buf2, [3], 9)
    conn.offload([3], *chain(1, start=100)).synchronize()
    assert conn.held_in(chain(1, start=100)[0][0]) == {"host"}
    conn.detach()
    conn.attach([buf2], params, owner=second)
    conn.load([7, 8], hs, toks).synchronize()
    assert page_bytes(buf2, [7, 8]) == page_bytes(buf1, [1, 2])
    conn.shutdown()


def test_collected_owner_frees_the_connector(params):
    import gc

    conn = TieredConnector(host_bytes=4 * params.page_bytes())
    Owner = type("Owner", (), {})
    first = Owner()
    conn.attach([make_buffer(params)], params, owner=first)
    del first
    gc.collect()
    conn.attach([make_buffer(params)], params, owner=Owner())
    conn.shutdown()


def test_second_manager_cannot_take_a_live_managers_connector(params):
    """Through the manager API: the second manager's construction raises, the first keeps working."""
    conn = TieredConnector(host_bytes=8 * params.page_bytes())
    m1 = kvref.PagedKVCacheManager(params, num_blocks=16, max_batch_size=2, max_seq_len=60, connector=conn)
    with pytest.raises(RuntimeError, match="another live owner"):
        kvref.PagedKVCacheManager(params, num_blocks=16, max_batch_size=2, max_seq_len=60, connector=conn)
    m1.shutdown()


# --------------------------------------------------------------------------- argument validation


def test_call_validation_leaves_state_unchanged(attached):
    conn, buf = attached
    hs, toks = chain(3)
    fill(buf, [1, 2, 3], 2)
    conn.offload([1, 2, 3], hs, toks).synchronize()
    before = state_of(conn)
    bad = [
        (lambda: conn.load([1, 2], hs, toks), ValueError, r"len\(block_ids\)=2 != len\(hashes\)=3"),
        (lambda: conn.load([0, 5, 6], hs, toks), ValueError, r"block_ids\[0\]=0 is the null block"),
        (lambda: conn.load([4, 5, 16], hs, toks), IndexError, r"block_ids\[2\]=16 out of range \[1, 16\)"),
        (lambda: conn.load([4, 4, 5], hs, toks), ValueError, "block_ids has 4 twice"),
        (lambda: conn.load([4, 5, 6.0], hs, toks), TypeError, r"block_ids\[2\]=6.0"),
        (lambda: conn.load([4, 5, 6], hs, toks, replica_idx=1), IndexError, r"replica_idx=1 out of range \[0, 1\)"),
        (lambda: conn.load([4, 5, 6], hs[:2] + [b"x" * 31], toks), ValueError, r"hashes\[2\] has 31 bytes != 32"),
        (lambda: conn.load([4, 5, 6], hs[:2] + ["ab"], toks), TypeError, r"hashes\[2\]="),
        (lambda: conn.load([4, 5, 6], hs, toks[:, :3]), ValueError, r"tokens shape=\(3, 3\) != \(len\(hashes\)=3, page_size=4\)"),
        (lambda: conn.load([4, 5, 6], hs, toks.astype(np.float32)), TypeError, "tokens dtype=float32"),
        (lambda: conn.load([4, 5, 6], hs, toks.astype(np.int64) + 2**40), ValueError, "int32 range"),
        (lambda: conn.lookup(b"abc", toks), TypeError, "must be a sequence of bytes"),
        (lambda: conn.lookup(hs, toks, replica_idx=-1), IndexError, "replica_idx=-1"),
        (lambda: conn.offload([1, 2, 99], hs, toks), IndexError, r"block_ids\[2\]=99"),
        (lambda: conn.offload([1, 2], hs, toks), ValueError, r"len\(block_ids\)=2"),
        (lambda: conn.touch([b"short"]), ValueError, r"hashes\[0\] has 5 bytes"),
    ]
    for call, exc, text in bad:
        with pytest.raises(exc, match=text):
            call()
        assert state_of(conn) == before


def test_calls_after_shutdown_raise(params):
    conn = TieredConnector(host_bytes=1024)
    conn.attach([make_buffer(params)], params)
    conn.shutdown()
    conn.shutdown()  # idempotent
    hs, toks = chain(1)
    for call in (
        lambda: conn.lookup(hs, toks),
        lambda: conn.load([1], hs, toks),
        lambda: conn.offload([1], hs, toks),
        lambda: conn.touch(hs),
        lambda: conn.reset_prefix_cache(),
        lambda: conn.attach([make_buffer(params)], params),
    ):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
    conn.poll_transfers()  # still fine: nothing to reap
    assert conn.metrics == KVCacheMetrics()


# --------------------------------------------------------------------------- host tier round trip


def test_offload_then_load_is_bit_identical(attached, params):
    conn, buf = attached
    hs, toks = chain(3)
    fill(buf, [1, 2, 3], 3)
    t = conn.offload([1, 2, 3], hs, toks)
    assert isinstance(t, TierTransfer)
    t.synchronize()
    assert t.is_complete()
    assert conn.lookup(hs, toks) == 3
    t = conn.load([7, 8, 9], hs, toks)
    t.synchronize()
    assert page_bytes(buf, [7, 8, 9]) == page_bytes(buf, [1, 2, 3])
    m = conn.metrics
    pb = params.page_bytes()
    assert (m.d2h_bytes_copied, m.h2d_bytes_copied) == (3 * pb, 3 * pb)
    assert (m.disk_bytes_written, m.disk_bytes_read, m.connector_loads_refused) == (0, 0, 0)
    conn.check_invariants()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_round_trip_every_dtype(dtype):
    p = make_params(dtype=dtype)
    buf = make_buffer(p)
    conn = TieredConnector(host_bytes=4 * p.page_bytes())
    conn.attach([buf], p)
    hs, toks = chain(2)
    fill(buf, [1, 2], 4)
    conn.offload([1, 2], hs, toks).synchronize()
    conn.load([3, 4], hs, toks).synchronize()
    assert page_bytes(buf, [3, 4]) == page_bytes(buf, [1, 2])
    conn.shutdown()


def test_offload_copies_a_snapshot(attached):
    """What landed is what the page held at the copy; later writes do not leak in."""
    conn, buf = attached
    hs, toks = chain(1)
    fill(buf, [1], 5)
    expect = page_bytes(buf, [1])
    conn.offload([1], hs, toks).synchronize()
    fill(buf, [1], 6)  # the manager would never do this to a published page; the copy is still ours
    conn.load([2], hs, toks).synchronize()
    assert page_bytes(buf, [2]) == expect


def test_lookup_is_leading_and_token_checked(attached):
    conn, buf = attached
    hs, toks = chain(3)
    fill(buf, [1, 2, 3], 7)
    conn.offload([1, 3], [hs[0], hs[2]], toks[[0, 2]]).synchronize()
    assert conn.lookup(hs, toks) == 1  # stops at the gap
    assert conn.lookup(hs[:1], toks[:1]) == 1
    assert conn.lookup([], np.zeros((0, PS), np.int32)) == 0
    other = toks.copy()
    other[0, 0] += 1  # same hash, other tokens: a collision is a miss, never wrong K/V
    assert conn.lookup(hs, other) == 0
    with pytest.raises(KVLoadRefused):
        conn.load([5], hs[:1], other[:1])


def test_lookup_is_read_only(attached):
    conn, buf = attached
    hs, toks = chain(4)
    fill(buf, [1, 2, 3, 4], 8)
    conn.offload([1, 2, 3, 4], hs, toks).synchronize()
    before = state_of(conn)
    for _ in range(3):
        assert conn.lookup(hs, toks) == 4
    assert state_of(conn) == before


def test_load_refused_is_all_or_nothing(attached):
    conn, buf = attached
    hs, toks = chain(3)
    fill(buf, [1, 2], 9)
    conn.offload([1, 2], hs[:2], toks[:2]).synchronize()
    fill(buf, [7, 8, 9], 10)
    dest_before = page_bytes(buf, [7, 8, 9])
    before = state_of(conn)
    with pytest.raises(KVLoadRefused, match=r"hashes\[2\]=.* is held by no tier") as info:
        conn.load([7, 8, 9], hs, toks)
    assert info.value.block_hash == hs[2]
    assert page_bytes(buf, [7, 8, 9]) == dest_before  # nothing copied
    after = state_of(conn)
    assert after[0].connector_loads_refused == 1  # the only change: the refusal is counted
    assert after[1:] == before[1:]
    assert conn.pending() == 0


def test_empty_load_and_offload_are_complete(attached):
    conn, _ = attached
    empty = np.zeros((0, PS), np.int32)
    assert isinstance(conn.load([], [], empty), CompletedTransfer)
    assert isinstance(conn.offload([], [], empty), CompletedTransfer)


def test_host_lru_and_touch_keep_chain_heads(params):
    """Host evicts least recently used; touch ranks a chain's head most recent."""
    buf = make_buffer(params)
    conn = TieredConnector(host_bytes=3 * params.page_bytes())
    conn.attach([buf], params)
    a, ta = chain(2, start=0)
    b, tb = chain(2, start=1000)
    fill(buf, [1, 2, 3, 4], 11)
    conn.offload([1, 2], a, ta).synchronize()
    conn.offload([3], b[:1], tb[:1]).synchronize()
    # order now (LRU first): a1, a0, b0  -- offload ranks the head most recent
    assert conn._host.ready_hashes() == [a[1], a[0], b[0]]
    conn.touch(a)  # a chain served from the device: head a0 most recent
    assert conn._host.ready_hashes() == [b[0], a[1], a[0]]
    conn.offload([4], b[1:], tb[1:]).synchronize()  # evicts b0 (least recent)
    assert conn.held_in(b[0]) == frozenset()
    assert conn.held_in(a[0]) == frozenset({"host"})
    assert conn.lookup(a, ta) == 2
    conn.shutdown()


def test_offload_of_held_block_is_not_copied_again(attached, params):
    conn, buf = attached
    hs, toks = chain(2)
    fill(buf, [1, 2], 12)
    conn.offload([1, 2], hs, toks).synchronize()
    conn.offload([1, 2], hs, toks).synchronize()
    assert conn.metrics.d2h_bytes_copied == 2 * params.page_bytes()
    assert conn.tier_stats().host_blocks == 2


def test_full_host_without_disk_drops_and_counts(params):
    buf = make_buffer(params)
    conn = TieredConnector(host_bytes=params.page_bytes())  # one slot
    conn.attach([buf], params)
    hs, toks = chain(3)
    fill(buf, [1, 2, 3], 13)
    # pin the only slot (as a running load does), then offload: nothing evictable
    conn.offload([1], hs[:1], toks[:1]).synchronize()
    with conn._lock:
        entry = conn._host.get(hs[0], toks[0])
        conn._host.pin(entry)
    conn.offload([2, 3], hs[1:], toks[1:]).synchronize()
    assert conn.metrics.connector_offload_blocks_dropped == 2
    with conn._lock:
        conn._host.unpin(entry)
    conn.offload([2], hs[1:2], toks[1:2]).synchronize()  # now evictable again
    assert conn.held_in(hs[1]) == frozenset({"host"})
    conn.shutdown()


def test_zero_capacity_connector_drops_everything(params):
    buf = make_buffer(params)
    conn = TieredConnector(host_bytes=0)
    conn.attach([buf], params)
    hs, toks = chain(2)
    conn.offload([1, 2], hs, toks).synchronize()
    assert conn.metrics.connector_offload_blocks_dropped == 2
    assert conn.lookup(hs, toks) == 0
    conn.shutdown()


def test_replicas_share_the_tiers():
    p = make_params(data_parallel_degree=2)
    bufs = [make_buffer(p), make_buffer(p)]
    conn = TieredConnector(host_bytes=4 * p.page_bytes())
    conn.attach(bufs, p)
    hs, toks = chain(2)
    fill(bufs[0], [1, 2], 14)
    conn.offload([1, 2], hs, toks, replica_idx=0).synchronize()
    assert conn.lookup(hs, toks, replica_idx=1) == 2
    conn.load([5, 6], hs, toks, replica_idx=1).synchronize()
    assert page_bytes(bufs[1], [5, 6]) == page_bytes(bufs[0], [1, 2])
    assert page_bytes(bufs[0], [5, 6]) == [bytes(len(page_bytes(bufs[0], [5])[0]))] * 2
    conn.shutdown()


# --------------------------------------------------------------------------- reset, metrics


def test_reset_prefix_cache_forgets_everything(attached):
    conn, buf = attached
    hs, toks = chain(3)
    fill(buf, [1, 2, 3], 15)
    conn.offload([1, 2, 3], hs, toks).synchronize()
    conn.reset_prefix_cache()
    assert conn.lookup(hs, toks) == 0
    assert conn.host_byte_count().used == 0
    with pytest.raises(KVLoadRefused):
        conn.load([5], hs[:1], toks[:1])
    conn.offload([1, 2, 3], hs, toks).synchronize()  # storable again
    assert conn.lookup(hs, toks) == 3
    conn.check_invariants()


def test_reset_during_a_load_keeps_the_slot_until_the_copy_ends(params):
    buf = make_buffer(params)
    conn = SlowHostConnector(host_bytes=2 * params.page_bytes())
    conn.attach([buf], params)
    hs, toks = chain(1)
    fill(buf, [1], 16)
    conn.offload([1], hs, toks).synchronize()
    conn.gate.clear()
    t = conn.load([2], hs, toks)
    conn.reset_prefix_cache()
    assert conn.lookup(hs, toks) == 0
    assert conn.host_byte_count().used == params.page_bytes()  # still pinned by the load
    conn.gate.set()
    t.synchronize()
    assert page_bytes(buf, [2]) == page_bytes(buf, [1])
    assert conn.host_byte_count().used == 0
    conn.check_invariants()
    conn.shutdown()


def test_reset_forgets_offloads_posted_before_it(params):
    buf = make_buffer(params)
    conn = SlowHostConnector(host_bytes=4 * params.page_bytes(), num_workers=1)
    conn.attach([buf], params)
    hs, toks = chain(2)
    fill(buf, [1, 2, 3], 17)
    # block the only worker with a load so the offload waits in the queue
    conn.offload([3], *chain(1, start=500)).synchronize()
    conn.gate.clear()
    blocker = conn.load([4], *chain(1, start=500))
    t = conn.offload([1, 2], hs, toks)
    conn.reset_prefix_cache()
    conn.gate.set()
    blocker.synchronize()
    t.synchronize()
    assert conn.lookup(hs, toks) == 0
    conn.check_invariants()
    conn.shutdown()


def test_metrics_snapshot_and_take(attached, params):
    conn, buf = attached
    hs, toks = chain(2)
    fill(buf, [1, 2], 18)
    conn.offload([1, 2], hs, toks).synchronize()
    snap = conn.metrics
    snap.d2h_bytes_copied = 12345  # a snapshot, not the live counters
    assert conn.metrics.d2h_bytes_copied == 2 * params.page_bytes()
    taken = conn.take_metrics()
    assert taken.d2h_bytes_copied == 2 * params.page_bytes()
    assert conn.metrics == KVCacheMetrics()


# --------------------------------------------------------------------------- threads


class SlowHostConnector(TieredConnector):
    """Host-to-device copies wait on ``gate`` (a real worker thread blocks)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()

    def _run_load(self, *args):
        self.started.set()
        assert self.gate.wait(30), "test gate never opened"
        return super()._run_load(*args)


def test_is_complete_never_blocks_while_a_worker_is_stuck(params):
    buf = make_buffer(params)
    conn = SlowHostConnector(host_bytes=4 * params.page_bytes())
    conn.attach([buf], params)
    hs, toks = chain(2)
    fill(buf, [1, 2], 19)
    conn.offload([1, 2], hs, toks).synchronize()
    conn.gate.clear()
    t = conn.load([5, 6], hs, toks)
    assert conn.started.wait(30)
    for _ in range(100):
        assert t.is_complete() is False  # returns at once: the worker is parked on the gate
    assert conn.pending() >= 1
    conn.poll_transfers()  # never blocks either
    conn.gate.set()
    t.synchronize()
    assert t.is_complete() is True
    assert page_bytes(buf, [5, 6]) == page_bytes(buf, [1, 2])
    conn.shutdown()


def test_shutdown_waits_for_transfers(params):
    buf = make_buffer(params)
    conn = SlowHostConnector(host_bytes=4 * params.page_bytes())
    conn.attach([buf], params)
    hs, toks = chain(2)
    fill(buf, [1, 2], 20)
    conn.offload([1, 2], hs, toks).synchronize()
    conn.gate.clear()
    t = conn.load([5, 6], hs, toks)
    threading.Timer(0.05, conn.gate.set).start()
    conn.shutdown()  # blocks until the load landed
    assert t.is_complete()
    assert page_bytes(buf, [5, 6]) == page_bytes(buf, [1, 2])


def test_workers_are_real_threads(attached):
    conn, buf = attached
    seen = []
    orig = conn._run_offload

    def spy(*a):
        seen.append(threading.current_thread().name)
        return orig(*a)

    conn._run_offload = spy
    hs, toks = chain(1)
    conn.offload([1], hs, toks).synchronize()
    assert seen and seen[0].startswith("kvcache-tier")


def test_failed_transfer_handle_reraises_on_every_poll():
    from concurrent.futures import Future

    fut = Future()
    fut.set_exception(KVLoadFailed("boom"))
    t = TierTransfer(fut, "load")
    for _ in range(3):
        with pytest.raises(KVLoadFailed, match="boom"):
            t.is_complete()
    with pytest.raises(KVLoadFailed):
        t.synchronize()
    fut = Future()
    fut.set_exception(ZeroDivisionError())
    with pytest.raises(RuntimeError, match="offload worker raised"):
        TierTransfer(fut, "offload").is_complete()


def test_concurrent_offloads_and_loads_stay_consistent(params):
    """Many threads' worth of transfers at once: every load gets the right bytes."""
    buf = make_buffer(params, num_blocks=64)
    conn = TieredConnector(host_bytes=8 * params.page_bytes(), num_workers=4)
    conn.attach([buf], params)
    chains = [chain(3, start=1000 * k) for k in range(8)]
    srcs = [[1 + 3 * k, 2 + 3 * k, 3 + 3 * k] for k in range(8)]
    for k in range(8):
        fill(buf, srcs[k], 100 + k)
    handles = [conn.offload(srcs[k], *chains[k]) for k in range(8)]
    for h in handles:
        h.synchronize()
    conn.check_invariants()
    loads = []
    dest = 30
    for k in range(8):
        n = conn.lookup(*chains[k])
        hs, toks = chains[k]
        try:
            loads.append((k, n, list(range(dest, dest + n)), conn.load(list(range(dest, dest + n)), hs[:n], toks[:n])))
        except KVLoadRefused:
            continue
        dest += n
    for k, n, ids, t in loads:
        t.synchronize()
        assert page_bytes(buf, ids) == page_bytes(buf, srcs[k][:n])
    conn.check_invariants()
    conn.shutdown()


# --------------------------------------------------------------------------- through the manager


def test_end_to_end_replicas_share_the_host_tier():
    """Replica 0 computes a prefix; after its device copy is gone, replica 1
    loads it from the host tier with identical K/V."""
    from _fault_connector import flush_device, kv_values, run_request, settle_manager

    from kvref import PagedKVCacheManager, TextContext

    p = make_params(data_parallel_degree=2)
    conn = TieredConnector(host_bytes=8 * p.page_bytes())
    m = PagedKVCacheManager(p, num_blocks=8, max_batch_size=2, max_seq_len=28, connector=conn)
    prompt = np.arange(40, 53, dtype=np.int32)  # 3 full hashed blocks
    run_request(m, TextContext("a", prompt), replica_idx=0)
    settle_manager(m, 0)
    flush_device(m, 0)
    ctx = TextContext("b", prompt)
    assert m.get_prefix_cache_hit_counts(ctx)[1].external_blocks == 3
    m.claim(ctx, 1)
    m.alloc(ctx).synchronize()
    m.poll_transfers()
    assert ctx.cached_prefix_external_length == 3 * PS
    row = m.get_req_blocks_per_leaf(ctx)["full"]
    buf = m.get_device_buffer(1)
    for i in range(3):
        want = kv_values(prompt[i * PS : (i + 1) * PS], np.arange(i * PS, (i + 1) * PS), buf.shape[1:], buf.dtype)
        assert np.array_equal(buf[row[i]].transpose(2, 0, 1, 3, 4), want)
    assert m.get_metrics_aggregated().h2d_bytes_copied == 3 * p.page_bytes()
    m.release(ctx)
    m.check_invariants()
    m.shutdown()
