"""Host, disk and Redis tiers for every leaf kind (spec/manager.md §9.8, spec/tiers.md §12).

The tier tests that exist for a single full leaf (offload then reload with
identical bytes, hits from host, disk and Redis, deferred lookups, load
failure recovery), run for a full + sliding-window manager and a full +
recurrent manager in both packages, with real bytes compared against the
deterministic model of ``_hybrid_model``.
"""

from __future__ import annotations

import numpy as np
import pytest
from _fault_connector import CONNECTOR_BUG, ConnectorBug, FaultConnector, manager_state, settle_manager
from _hybrid_model import HYBRIDS, check_hit_bytes, flush, forward, serve
from _redis_servers import redis_server, redis_shared  # noqa: F401  (fixtures)

import kvfast
import kvref
from kvspec import KVCacheParams, LeafKind, LeafSpec, PrefixCacheHits, TextContext
from kvspec._connector import leaf_block_key
from kvspec.hashing import block_hashes

PAGE = 4
PROMPT = np.arange(100, 133, dtype=np.int32)  # 33 tokens: 8 hashed blocks, checkpoint at 32
PKGS = pytest.mark.parametrize("pkg", [kvref, kvfast], ids=["kvref", "kvfast"])
CONFIGS = pytest.mark.parametrize("config", sorted(HYBRIDS))


def params(config: str, **kw) -> KVCacheParams:
    return KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, dtype="float32",
                         leaves=HYBRIDS[config], **kw)


def manager(pkg, config, connector, *, num_blocks=24, **kw):
    return pkg.PagedKVCacheManager(params(config, **kw), num_blocks=num_blocks, max_batch_size=2,
                                   max_seq_len=40, connector=connector)


def units_loaded(m, config: str, k2: int, k: int = 0) -> int:
    """Units one load of a hit from ``k`` to ``k2`` blocks moves (spec/manager.md §9.8)."""
    n = 0
    unit = m.params.page_bytes("full")
    for lid, spec in HYBRIDS[config].items():
        if spec.kind is LeafKind.FULL:
            n += k2 - k
        elif spec.kind is LeafKind.SLIDING_WINDOW:
            biw = -(-(spec.window - 1) // PAGE)
            n += k2 - max(k, k2 - biw)
        else:
            n += -(-m.params.page_bytes(lid) // unit)
    return n


def primed(pkg, config, connector, **kw):
    """A manager over ``connector`` that served PROMPT, offloaded it, and lost it from the device."""
    m = manager(pkg, config, connector, **kw)
    serve(m, TextContext("prime", PROMPT))
    settle_manager(m)
    flush(m)
    assert m.get_prefix_cache_hit_counts(TextContext("x", PROMPT))[0].device_blocks == 0
    return m


def reload_and_check(m, config, rid="b"):
    """Admit PROMPT again: the whole hit comes from the tiers, byte for byte."""
    ctx = TextContext(rid, PROMPT)
    m.claim(ctx)
    m.alloc(ctx).synchronize()
    m.poll_transfers()
    assert (ctx.cached_prefix_length, ctx.cached_prefix_external_length) == (32, 32)
    check_hit_bytes(m, ctx)
    m.check_invariants()
    forward(m, ctx)  # the forward after the load: commits resume, the window slides
    m.check_invariants()
    m.release(ctx)
    settle_manager(m)
    m.check_invariants()
    return ctx


# --------------------------------------------------------------------------- host, disk, Redis


@PKGS
@CONFIGS
def test_offload_then_reload_from_host_bit_identical(pkg, config):
    conn = kvref.TieredConnector(host_bytes=64 * 64)
    m = primed(pkg, config, conn)
    stats = conn.tier_stats()
    # full: 8 blocks; sliding: 8 pages; recurrent: the checkpoint at 32 tokens (three units)
    assert stats.host_blocks == 8 + (8 if "sliding" in config else 3)
    assert m.get_prefix_cache_hit_counts(TextContext("x", PROMPT)) == [PrefixCacheHits(0, 8)]
    before = m.get_metrics_aggregated()
    reload_and_check(m, config)
    got = m.get_metrics_aggregated()
    unit = m.params.page_bytes("full")
    assert got.external_blocks_served - before.external_blocks_served == 8
    # spec/manager.md §9.8: a sliding leaf onloads only its window, a recurrent one its checkpoint
    assert got.h2d_bytes_copied - before.h2d_bytes_copied == units_loaded(m, config, 8) * unit
    m.shutdown()


@PKGS
@CONFIGS
def test_hits_from_disk_and_after_a_restart(pkg, config, tmp_path):
    conn = kvref.TieredConnector(0, 1 << 20, tmp_path / "kv")
    m = primed(pkg, config, conn)
    assert conn.tier_stats().disk_blocks > 8
    reload_and_check(m, config)
    assert m.get_metrics_aggregated().disk_bytes_read > 0
    m.shutdown()
    # a new process over the same directory starts warm: every leaf's units are found again
    m2 = manager(pkg, config, kvref.TieredConnector(0, 1 << 20, tmp_path / "kv"))
    assert m2.get_prefix_cache_hit_counts(TextContext("x", PROMPT)) == [PrefixCacheHits(0, 8)]
    reload_and_check(m2, config, "c")
    m2.shutdown()


@PKGS
@CONFIGS
def test_hits_from_redis_across_managers(pkg, config, redis_server):
    first = manager(pkg, config, kvref.TieredConnector(0, remote_url=redis_server.url, remote_timeout_s=2.0))
    serve(first, TextContext("prime", PROMPT))
    settle_manager(first)
    first.shutdown()
    # a second manager with empty host and disk tiers finds everything in Redis
    m = manager(pkg, config, kvref.TieredConnector(0, remote_url=redis_server.url, remote_timeout_s=2.0))
    assert m.get_prefix_cache_hit_counts(TextContext("x", PROMPT)) == [PrefixCacheHits(0, 8)]
    reload_and_check(m, config)
    m.shutdown()


# --------------------------------------------------------------------------- keys


def test_leaf_keys_never_collide_with_the_block_hash_or_each_other():
    h = block_hashes(PROMPT, PAGE)[0]
    keys = {h}
    for tag in (b"swa|sliding_window|5||float32", b"swa|sliding_window|6||float32", b"rec|recurrent|0|3,5|float32"):
        for part in range(3):
            k = leaf_block_key(h, tag, part, "sha256")
            assert len(k) == 32 and k not in keys
            keys.add(k)
    assert len(leaf_block_key(h[:16], b"x", 0, "xxh3_128")) == 16
    with pytest.raises(ValueError, match="part=-1"):
        leaf_block_key(h, b"x", -1, "sha256")


@PKGS
def test_full_pages_keyed_by_hash_sliding_pages_keyed_apart(pkg):
    """A full+sliding manager's full pages use the block hash as key (a single-full-leaf manager
    of the same geometry loads them), its sliding pages their own keys (never served as full)."""
    conn = kvref.TieredConnector(host_bytes=64 * 64)
    m = primed(pkg, "full+sliding", conn)
    assert conn.tier_stats().host_blocks == 16  # 8 full + 8 sliding, none overwrote another
    conn.detach()
    del m
    p = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, dtype="float32")
    single = pkg.PagedKVCacheManager(p, num_blocks=24, max_batch_size=2, max_seq_len=40, connector=conn)
    ctx = TextContext("b", PROMPT)
    single.claim(ctx)
    single.alloc(ctx).synchronize()
    single.poll_transfers()
    assert ctx.cached_prefix_external_length == 32
    check_hit_bytes(single, ctx)  # the full leaf's bytes, not the sliding leaf's
    single.release(ctx)
    single.shutdown()


# --------------------------------------------------------------------------- deferred lookups


@PKGS
@CONFIGS
def test_deferred_lookup_then_load(pkg, config):
    conn = kvref.TieredConnector(host_bytes=64 * 64)
    m = primed(pkg, config, conn)
    ctx = TextContext("b", PROMPT)
    m.claim(ctx)
    assert m.starts_lookup(ctx)
    m.alloc(ctx, defer_lookup=True)  # the device part only: runnable on a 0-block hit
    assert ctx.processed_length == 0 and not m.awaits_lookup(ctx)
    assert m.start_lookup(ctx) and m.awaits_lookup(ctx)
    assert not m.starts_lookup(ctx)
    m.alloc(ctx).synchronize()
    m.poll_transfers()
    assert not m.awaits_lookup(ctx)
    assert (ctx.cached_prefix_length, ctx.cached_prefix_external_length) == (32, 32)
    check_hit_bytes(m, ctx)
    m.check_invariants()
    m.release(ctx)
    # handing a lookup back is always safe: nothing is loaded, nothing leaks
    settle_manager(m)
    flush(m)
    c2 = TextContext("c", PROMPT)
    m.claim(c2)
    m.alloc(c2, defer_lookup=True)
    assert m.start_lookup(c2) and m.hand_back_lookup(c2)
    m.alloc(c2)
    assert c2.cached_prefix_external_length == 0
    m.release(c2)
    settle_manager(m)
    m.check_invariants()
    m.shutdown()


@PKGS
@CONFIGS
def test_in_flight_load_pins_and_publishes_only_after_landing(pkg, config):
    fc = FaultConnector(kvref.TieredConnector(host_bytes=64 * 64), gated=True)
    m = primed_gated(pkg, config, fc)
    ctx = TextContext("b", PROMPT)
    m.claim(ctx)
    t = m.alloc(ctx)
    assert not t.is_complete() and m.pending_transfers_exist()
    assert m.alloc(ctx) is t  # a repeated alloc returns the load still in flight
    hits = m.get_prefix_cache_hit_counts(TextContext("x", PROMPT))[0]
    assert hits.device_blocks == 0  # nothing published before it lands
    m.check_invariants()
    fc.land()
    m.poll_transfers()
    assert not m.pending_transfers_exist()
    check_hit_bytes(m, ctx)
    m.check_invariants()
    forward(m, ctx)
    m.release(ctx)
    settle_manager(m, land=fc.land)
    m.check_invariants()
    m.shutdown()


def primed_gated(pkg, config, fc):
    m = manager(pkg, config, fc)
    serve(m, TextContext("prime", PROMPT))
    settle_manager(m, land=fc.land)
    flush(m)
    return m


# --------------------------------------------------------------------------- load failures


@PKGS
@CONFIGS
@pytest.mark.parametrize("fault", ["refuse", "fail_post", "fail_first_poll"])
def test_failed_or_refused_load_is_a_miss(pkg, config, fault):
    fc = FaultConnector(kvref.TieredConnector(host_bytes=64 * 64), gated=True)
    m = primed_gated(pkg, config, fc)
    fc.arm(fault)
    ctx = TextContext("b", PROMPT)
    m.claim(ctx)
    m.alloc(ctx)
    assert ctx.processed_length == 0 and ctx.cached_prefix_external_length == 0
    assert not m.pending_transfers_exist()
    failures = m.get_metrics_aggregated().connector_load_failures
    assert failures == (0 if fault == "refuse" else 1)
    m.check_invariants()
    forward(m, ctx)  # recomputed from scratch: every leaf's bytes are the model's
    m.release(ctx)
    settle_manager(m, land=fc.land)
    m.check_invariants()
    m.shutdown()


@PKGS
@CONFIGS
def test_failure_seen_later_resplices_only_the_device_hit(pkg, config):
    fc = FaultConnector(kvref.TieredConnector(host_bytes=64 * 64), gated=True)
    m = manager(pkg, config, fc)
    serve(m, TextContext("prime", PROMPT))
    settle_manager(m, land=fc.land)
    flush(m)
    # the device keeps a 4-block prefix (a request sharing it), the tiers hold all 8
    short = TextContext("s", PROMPT[:17])
    serve(m, short)
    settle_manager(m, land=fc.land)
    fc.arm("fail_later")
    ctx = TextContext("b", PROMPT)
    m.claim(ctx)
    t = m.alloc(ctx)
    device = m.get_prefix_cache_hit_counts(TextContext("x", PROMPT[:17]))[0].device_blocks
    assert ctx.cached_prefix_length == 32 and not t.is_complete()
    fc.land()
    with pytest.raises(kvref.KVLoadFailed):
        t.is_complete()
    m.poll_transfers()  # failed: pages unpinned unpublished, counted once
    assert m.get_metrics_aggregated().connector_load_failures == 1
    m.check_invariants()
    m.alloc(ctx)  # re-takes only the device hit
    assert ctx.processed_length == device * PAGE == ctx.cached_prefix_length
    assert ctx.cached_prefix_external_length == 0
    check_hit_bytes(m, ctx)  # the live recurrent state / sliding window of the device hit
    m.check_invariants()
    forward(m, ctx)
    m.release(ctx)
    settle_manager(m, land=fc.land)
    m.check_invariants()
    assert not m.pending_transfers_exist()
    m.shutdown()


@PKGS
@CONFIGS
def test_release_during_a_load_leaks_nothing(pkg, config):
    fc = FaultConnector(kvref.TieredConnector(host_bytes=64 * 64), gated=True)
    m = primed_gated(pkg, config, fc)
    ctx = TextContext("b", PROMPT)
    m.claim(ctx)
    m.alloc(ctx)
    m.release(ctx)
    assert m.pending_transfers_exist()
    m.check_invariants()
    settle_manager(m, land=fc.land)
    m.check_invariants()
    assert m.block_count().free == m.block_count().total
    m.shutdown()


@PKGS
@CONFIGS
def test_bookkeeping_only_mode_counts_the_same(pkg, config):
    """Without bytes (spec/tiers.md §11) the hits, metrics and block ids equal those with bytes."""
    out = []
    for allocate in (True, False):
        m = manager(pkg, config, kvref.TieredConnector(host_bytes=64 * 64), allocate_buffers=allocate)
        ctx = TextContext("prime", PROMPT)
        m.claim(ctx)
        ctx.chunk(32)
        m.alloc(ctx)
        m.runtime_inputs([[ctx]])
        ctx.advance_chunk()
        m.step(ctx)
        m.release(ctx)
        settle_manager(m)
        flush(m)
        b = TextContext("b", PROMPT)
        m.claim(b)
        m.alloc(b).synchronize()
        m.poll_transfers()
        out.append((b.cached_prefix_external_length, m.get_req_blocks_per_leaf(b), m.get_metrics_aggregated()))
        m.check_invariants()
        m.shutdown()
    assert out[0][0] == out[1][0] == 32
    assert out[0][1] == out[1][1]


def test_both_packages_agree_on_a_hybrid_tier_run():
    """Same calls, same block ids, hits and metrics in kvref and kvfast (spec/manager.md §12)."""
    seen = []
    for pkg in (kvref, kvfast):
        for config in sorted(HYBRIDS):
            m = primed(pkg, config, kvref.TieredConnector(host_bytes=64 * 64))
            ctx = reload_and_check(m, config)
            seen.append((pkg.__name__, config, ctx.cached_prefix_length, m.get_metrics_aggregated(),
                         m._free_order(0, "full")))
            m.shutdown()
    half = len(seen) // 2
    for a, b in zip(seen[:half], seen[half:]):
        assert a[1:] == b[1:], f"{a[0]} and {b[0]} differ on {a[1]}"


def test_sliding_only_manager_onloads_only_the_window():
    leaves = {"swa": LeafSpec.sliding_window(9)}  # biw = 2 blocks
    p = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, dtype="float32", leaves=leaves)
    for pkg in (kvref, kvfast):
        conn = kvref.TieredConnector(host_bytes=64 * 64)
        m = pkg.PagedKVCacheManager(p, num_blocks=12, max_batch_size=2, max_seq_len=40, connector=conn)
        serve(m, TextContext("prime", PROMPT))
        settle_manager(m)
        flush(m)
        ctx = TextContext("b", PROMPT)
        m.claim(ctx)
        m.alloc(ctx).synchronize()
        m.poll_transfers()
        assert ctx.cached_prefix_external_length == 32
        assert m.get_metrics_aggregated().h2d_bytes_copied == 2 * p.page_bytes("swa")
        check_hit_bytes(m, ctx)
        m.check_invariants()
        m.release(ctx)
        m.shutdown()




@PKGS
@CONFIGS
def test_a_bad_lookup_answer_rolls_the_alloc_back(pkg, config):
    """spec/manager.md §9.3, §9.8: the tiers are asked in the plan, before anything changes."""

    class BadAnswer(FaultConnector):
        bad = False

        def lookup(self, hashes, tokens, replica_idx=0):
            return "many" if self.bad else super().lookup(hashes, tokens, replica_idx)

    fc = BadAnswer(kvref.TieredConnector(host_bytes=64 * 64))
    m = primed_gated(pkg, config, fc)
    ctx = TextContext("b", PROMPT)
    m.claim(ctx)
    free = m.block_count()
    fc.bad = True
    with pytest.raises(TypeError, match=r"alloc: connector.lookup returned 'many', must be an int >= 0"):
        m.alloc(ctx)
    assert (ctx.processed_length, ctx.cached_prefix_length) == (0, 0)
    assert m.block_count() == free and m.get_req_blocks_per_leaf(ctx) == {lid: [] for lid in HYBRIDS[config]}
    m.check_invariants()
    fc.bad = False
    m.alloc(ctx).synchronize()
    m.poll_transfers()
    assert ctx.cached_prefix_external_length == 32
    check_hit_bytes(m, ctx)
    m.release(ctx)
    m.shutdown()


@PKGS
@CONFIGS
def test_an_unexpected_load_error_leaves_everything_as_it_was(pkg, config):
    """spec/manager.md §9.8, §11.22: a tier hit past pages the sizing draws posts its load into the
    pages a joint peek of the slab predicts, before anything changes, so an unexpected exception of
    ``connector.load`` (a connector bug) propagates with every pool, the slab, the rows, pins,
    metrics and the context exactly as before; the next alloc loads the whole hit."""

    fc = FaultConnector(kvref.TieredConnector(host_bytes=64 * 64))
    m = primed_gated(pkg, config, fc)
    ctx = TextContext("b", PROMPT)
    m.claim(ctx)
    before = manager_state(m, [ctx])
    fc.arm(CONNECTOR_BUG)
    with pytest.raises(ConnectorBug):
        m.alloc(ctx)
    assert manager_state(m, [ctx]) == before
    m.check_invariants()
    m.alloc(ctx).synchronize()
    m.poll_transfers()
    assert (ctx.cached_prefix_length, ctx.cached_prefix_external_length) == (32, 32)
    check_hit_bytes(m, ctx)
    forward(m, ctx)
    m.release(ctx)
    settle_manager(m)
    m.check_invariants()
    m.shutdown()


@PKGS
@CONFIGS
def test_peer_copies_and_a_tier_load_in_one_admission(pkg, config):
    """spec/manager.md §7.3, §9.8: replica 0 holds PROMPT's first 4 blocks on the device, replica 1's
    tier holds all 8. Admitting PROMPT on replica 1 copies the peer-held part into the first pages the
    sizing draws (the slots of the peer copies) and loads the rest from the tier into the pages after
    them, all predicted before anything is drawn: every leaf's hit bytes are the model's."""
    m = manager(pkg, config, kvref.TieredConnector(host_bytes=64 * 64), num_blocks=40,
                data_parallel_degree=2)
    serve(m, TextContext("prime", PROMPT), replica=1)
    settle_manager(m)
    flush(m, replica=1)
    serve(m, TextContext("short", PROMPT[:17]), replica=0)
    settle_manager(m)
    # replica 1: 4 blocks on the peer's device (spec/manager.md §7.3 counts them as device blocks), 4 more
    # in its own tier
    assert m.get_prefix_cache_hit_counts(TextContext("x", PROMPT))[1] == PrefixCacheHits(4, 4)
    ctx = TextContext("b", PROMPT)
    m.claim(ctx, 1)
    m.alloc(ctx).synchronize()
    m.poll_transfers()
    assert (ctx.cached_prefix_length, ctx.cached_prefix_external_length) == (32, 16)
    assert m.get_metrics_aggregated().cross_replica_blocks_copied > 0
    check_hit_bytes(m, ctx, replica=1)
    m.check_invariants()
    forward(m, ctx, replica=1)
    m.release(ctx)
    settle_manager(m)
    m.check_invariants()
    m.shutdown()


def test_leaf_unit_store_maps_units_to_page_bytes():
    """spec/tiers.md §12: unit ids, bytes and zero padding of a multi-unit page; a unit write
    patches only its slice of the page."""
    from kvspec._page_store import HostPageStore, LeafUnitStore

    kv = np.zeros((4, 8), dtype=np.uint8)  # 4 pages of 8 bytes: the unit
    state = np.zeros((3, 5), dtype=np.float32)  # 3 pages of 20 bytes: 3 units, the last half padding
    store = LeafUnitStore([HostPageStore(kv), HostPageStore(state)])
    assert (store.page_nbytes, store.units, store.bases, store.num_pages) == (8, [1, 3], [0, 4], 13)
    state[2] = np.arange(5, dtype=np.float32) + 1
    kv[3] = 7
    got = store.read([3, 4 + 2 * 3 + 0, 4 + 2 * 3 + 1, 4 + 2 * 3 + 2])
    assert got.shape == (4, 8) and np.all(got[0] == 7)
    assert got[1:].reshape(-1)[:20].tobytes() == state[2].tobytes() and not got[3, 4:].any()
    new = np.arange(8, dtype=np.uint8) + 100
    store.write([4 + 1 * 3 + 1], new[None])  # unit 1 of state page 1: bytes 8..15
    assert state.view(np.uint8).reshape(3, 20)[1, 8:16].tolist() == new.tolist()
    assert not state.view(np.uint8).reshape(3, 20)[1, :8].any() and not state[0].any()
    store.write([4 + 1 * 3 + 2], np.full((1, 8), 9, np.uint8))  # the last unit: only its 4 real bytes land
    assert state.view(np.uint8).reshape(3, 20)[1, 16:].tolist() == [9, 9, 9, 9]
