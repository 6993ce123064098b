"""Tiers keep a block's retention claim (spec/tiers.md §3.1): host and disk evict the lowest
priority first, LRU within a priority, claims expire on the connector's clock; the remote
tier extends a stored key's Redis TTL from ``retention_seconds`` (``PEXPIRE ... GT``)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from _redis_servers import redis_server, redis_shared  # noqa: F401  (fixtures)
from kvref import PagedKVCacheManager, TieredConnector
from kvref._host_tier import HostTier
from kvspec import KVCacheParams, TextContext

PAGE = 4
PARAMS = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, dtype="float32")


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _h(i: int) -> bytes:
    return bytes([i]) * 32


def _fill(tier: HostTier, ids) -> None:
    for i in ids:
        entry, _ = tier.reserve(_h(i), np.array([i], np.int32), copy_evicted=False)
        assert entry is not None
        tier.commit(entry)


def test_host_tier_evicts_lowest_priority_first_lru_within():
    clock = Clock()
    tier = HostTier(num_slots=3, page_bytes=8)
    tier.clock = clock
    _fill(tier, [1, 2, 3])  # LRU: 1, 2, 3
    tier.set_retention([_h(1)], 80, math.inf)
    tier.set_retention([_h(3)], 90, 5.0)
    tier.set_retention([_h(9)], 90, math.inf)  # no entry: ignored
    assert tier.retention(_h(9)) == (-1, math.inf)
    _, ev = tier.reserve(_h(4), np.array([4], np.int32), copy_evicted=True)
    assert [e.block_hash for e in ev] == [_h(2)]  # 2 (level 35) goes, not 1 (80), the LRU
    tier.commit(tier._index[_h(4)])
    assert tier.ready_hashes() == [_h(1), _h(3), _h(4)]
    clock.t = 5.0  # 3's claim expired: level 35, and older than 4
    assert tier.retention(_h(3)) == (-1, math.inf)
    _, ev = tier.reserve(_h(5), np.array([5], np.int32), copy_evicted=False)
    assert [e.block_hash for e in ev] == [_h(3)]
    tier.commit(tier._index[_h(5)])
    _, ev = tier.reserve(_h(6), np.array([6], np.int32), copy_evicted=False)
    assert [e.block_hash for e in ev] == [_h(4)]  # 4 before 5 (LRU), 1 stays (80)
    assert tier.retention(_h(1)) == (80, math.inf)
    tier.check_invariants()


def _serve(m, rid, tokens, **kw):
    ctx = TextContext(rid, np.asarray(tokens, np.int32), **kw)
    m.claim(ctx)
    m.alloc(ctx)
    while m.pending_transfers_exist():
        m.poll_transfers()
    ctx.update(1)
    m.step(ctx)
    m.release(ctx)
    m.poll_transfers()  # posts the queued offloads
    while m.pending_transfers_exist():
        m.poll_transfers()
    return ctx


def _tier_keeps_system_prompt(tmp_path, tier: str, priority: int) -> bool:
    """A system prompt (3 full pages) then one-off prompts that overflow the tier (8 blocks);
    returns whether the tier still holds every system-prompt block."""
    page_bytes = PARAMS.page_bytes("full")
    if tier == "host":
        conn = TieredConnector(host_bytes=8 * page_bytes)
    else:
        conn = TieredConnector(host_bytes=0, disk_bytes=1, disk_dir=tmp_path / "disk")
    m = PagedKVCacheManager(PARAMS, num_blocks=12, max_batch_size=2, max_seq_len=40, connector=conn)
    ix = conn._host if tier == "host" else conn._disk
    if tier == "disk":  # room for exactly 8 files
        ix.capacity = 8 * ix.file_bytes
    _serve(m, "sys", list(range(100, 113)), retention_priority=priority)
    system = set(ix.ready_hashes())
    assert len(system) == 3
    for i in range(4):
        _serve(m, f"o{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 13)))
    held = set(ix.ready_hashes())
    ix.check_invariants()
    m.shutdown()
    return system <= held


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_tiers_keep_a_high_priority_prefix_that_lru_drops(tmp_path, tier):
    assert _tier_keeps_system_prompt(tmp_path / "a", tier, priority=80)
    assert not _tier_keeps_system_prompt(tmp_path / "b", tier, priority=35)


def test_set_retention_checks_its_arguments():
    conn = TieredConnector(host_bytes=PARAMS.page_bytes("full") * 2)
    with pytest.raises(RuntimeError, match="attach"):
        conn.set_retention([_h(1)], 50)
    buf = np.zeros((4,) + PARAMS.page_shape, dtype=PARAMS.np_dtype)
    conn.attach([buf], PARAMS)
    with pytest.raises(ValueError, match="TieredConnector.set_retention: priority=101"):
        conn.set_retention([_h(1)], 101)
    with pytest.raises(ValueError, match="TieredConnector.set_retention: seconds=0"):
        conn.set_retention([_h(1)], 50, 0)
    with pytest.raises(TypeError, match="clock=1"):
        TieredConnector(host_bytes=0, clock=1)
    conn.shutdown()


def _pttls(redis_server, prefix: str) -> dict[str, int]:
    """Every key under ``prefix`` and its PTTL (ms; -1: none)."""
    with redis_server.raw() as r:
        found = (r.keys(prefix + "*", target_nodes=r.ALL_NODES) if hasattr(r, "ALL_NODES")
                 else r.keys(prefix + "*"))  # a cluster client asks every node
        keys = [k.decode() if isinstance(k, bytes) else k for k in found]
        return {k: r.pttl(k) for k in keys}


# The tier's own TTL: long enough that no key expires while a loaded machine runs the test
# (the assertions compare TTLs, nothing waits for an expiry), far below the 600 s claim.
TIER_TTL_S = 60.0


def test_redis_ttl_follows_retention_seconds(redis_server):
    conn = TieredConnector(host_bytes=0, remote_url=redis_server.url, remote_ttl_s=TIER_TTL_S,
                           remote_timeout_s=2.0)
    m = PagedKVCacheManager(PARAMS, num_blocks=16, max_batch_size=2, max_seq_len=40, connector=conn)
    prefix = conn._remote._key_prefix
    _serve(m, "sys", list(range(100, 109)), retention_seconds=600)
    _serve(m, "plain", list(range(500, 509)))
    ttl_ms = TIER_TTL_S * 1000
    deadline = time.monotonic() + 10
    while True:  # the release's touch and claim reach Redis on workers, in either order
        ttls = _pttls(redis_server, prefix)
        long = [k for k, t in ttls.items() if t > ttl_ms]
        if len(ttls) == 4 and len(long) == 2 or time.monotonic() > deadline:
            break
        conn.poll_transfers()
        time.sleep(0.05)
    assert len(ttls) == 4, (ttls, conn.remote_metrics(), conn.metrics)  # two blocks of each request
    assert len(long) == 2 and all(ttls[k] <= 600_000 for k in long), ttls  # the claim's TTL, never more
    assert all(0 < t <= ttl_ms for k, t in ttls.items() if k not in long), ttls  # the tier's own TTL
    m.shutdown()


def test_redis_claim_outlives_a_later_touch(redis_server):
    """A touch that lands after the claim (the release's touch on a slower worker, or a later
    hit's) never cuts the claim's TTL back to the tier's: ``PEXPIRE ... GT``. Without it a touch
    worker that lagged the offload's worker put the claimed keys back on the tier's TTL, and
    test_redis_ttl_follows_retention_seconds (then with a 2 s tier TTL) found no key at all."""
    conn = TieredConnector(host_bytes=0, remote_url=redis_server.url, remote_ttl_s=TIER_TTL_S,
                           remote_timeout_s=2.0)
    m = PagedKVCacheManager(PARAMS, num_blocks=16, max_batch_size=2, max_seq_len=40, connector=conn)
    remote, prefix = conn._remote, conn._remote._key_prefix
    _serve(m, "sys", list(range(100, 109)), retention_seconds=600)
    deadline = time.monotonic() + 10
    while len(ttls := _pttls(redis_server, prefix)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(ttls) == 2 and all(TIER_TTL_S * 1000 < t <= 600_000 for t in ttls.values()), ttls
    hashes = [bytes.fromhex(k[len(prefix):]) for k in ttls]
    remote.touch(hashes)  # what the worker runs for conn.touch, here in order after the claim
    after = _pttls(redis_server, prefix)
    assert all(TIER_TTL_S * 1000 < t <= 600_000 for t in after.values()), after
    assert remote.metrics.errors == 0
    m.shutdown()


def test_remote_put_many_writes_a_known_claim_as_the_ttl(redis_server):
    """``put_many(..., retain_s=)``: a new key is written with the longer of the tier's TTL and
    its claim, an existing key's expiry is extended (``GT``), in the one round trip; without a
    TTL the claim changes nothing; bad ``retain_s`` raises before any I/O."""
    from kvref._remote_tier import RemoteTier

    hs = [_h(i) for i in (1, 2, 3, 4)]
    rows = np.arange(4 * PAGE, dtype=np.int32).reshape(4, PAGE)
    data = [bytes([i]) * PARAMS.page_bytes("full") for i in range(4)]
    tier = RemoteTier(redis_server.url, ttl_s=TIER_TTL_S, timeout_s=2.0)
    tier.bind(PARAMS, "sha256")
    ttl_ms = TIER_TTL_S * 1000
    assert tier.put_many(hs[:1], rows[:1], data[:1]) == 1  # present before, under the tier's TTL
    with pytest.raises(ValueError, match=r"RemoteTier.put_many: len\(retain_s\)=1 but len\(hashes\)=4"):
        tier.put_many(hs, rows, data, retain_s=[600])
    with pytest.raises(ValueError, match=r"RemoteTier.put_many: retain_s\[1\]=0"):
        tier.put_many(hs, rows, data, retain_s=[600, 0, None, None])
    assert tier.metrics.blocks_written == 1 and tier.metrics.blocks_already_present == 0
    assert tier.put_many(hs, rows, data, retain_s=[600, 600, None, 1.0]) == 3
    assert tier.metrics.blocks_already_present == 1
    with redis_server.raw() as r:
        t = [r.pttl(tier.key_for(h)) for h in hs]
    assert ttl_ms < t[0] <= 600_000 and ttl_ms < t[1] <= 600_000, t  # extended; written with it
    assert 0 < t[2] <= ttl_ms and ttl_ms - 10_000 < t[3] <= ttl_ms, t  # no claim; a claim below the TTL
    assert tier.get_many(hs, rows) == data
    tier.close()
    keep = RemoteTier(redis_server.url, namespace="keep", timeout_s=2.0)
    keep.bind(PARAMS, "sha256")
    assert keep.put_many(hs[:1], rows[:1], data[:1], retain_s=[600]) == 1
    with redis_server.raw() as r:
        assert r.pttl(keep.key_for(hs[0])) == -1  # without a TTL a key never expires
    assert keep.metrics.errors == 0
    keep.close()


class _NoGT:
    """A client of a server before Redis 7.0 (no ``PEXPIRE ... GT``): a pipelined ``GT`` is refused."""

    def __init__(self, client):
        self._client = client

    def pipeline(self, **kw):
        pipe = self._client.pipeline(**kw)
        execute_command = pipe.execute_command

        def refuse_gt(*args, **kwargs):
            return execute_command(*[("NOGT" if a == "GT" else a) for a in args], **kwargs)

        pipe.execute_command = refuse_gt
        return pipe

    def __getattr__(self, name):
        return getattr(self._client, name)


def test_remote_without_gt_writes_and_touches_as_before(redis_server, monkeypatch):
    """A server before Redis 7.0 refuses ``GT``: a claimed write is still stored (under the
    claim's TTL) and served, ``touch`` falls back to plain ``PEXPIRE``; no error is counted."""
    from kvref._remote_tier import RemoteTier

    monkeypatch.setattr(RemoteTier, "_connect", lambda self, _c=RemoteTier._connect: _NoGT(_c(self)))
    hs = [_h(i) for i in (1, 2)]
    rows = np.arange(2 * PAGE, dtype=np.int32).reshape(2, PAGE)
    data = [bytes([i]) * PARAMS.page_bytes("full") for i in range(2)]
    tier = RemoteTier(redis_server.url, ttl_s=TIER_TTL_S, timeout_s=2.0)
    tier.bind(PARAMS, "sha256")
    assert tier.put_many(hs[:1], rows[:1], data[:1]) == 1
    assert tier.put_many(hs, rows, data, retain_s=[600, 600]) == 1  # the first one was present
    ttl_ms = TIER_TTL_S * 1000
    with redis_server.raw() as r:
        assert ttl_ms < r.pttl(tier.key_for(hs[1])) <= 600_000  # written with the claim's TTL
        r.pexpire(tier.key_for(hs[0]), 5_000)
        tier.touch(hs[:1])
        assert ttl_ms - 10_000 < r.pttl(tier.key_for(hs[0])) <= ttl_ms  # plain PEXPIRE
    assert tier.get_many(hs, rows) == data
    assert tier.metrics.errors == 0 and tier.metrics.offloads_dropped == 0
    tier.close()
