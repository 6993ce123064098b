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


def test_redis_ttl_follows_retention_seconds(redis_server):
    conn = TieredConnector(host_bytes=0, remote_url=redis_server.url, remote_ttl_s=2.0, remote_timeout_s=2.0)
    m = PagedKVCacheManager(PARAMS, num_blocks=16, max_batch_size=2, max_seq_len=40, connector=conn)
    prefix = conn._remote._key_prefix
    _serve(m, "sys", list(range(100, 109)), retention_seconds=600)
    _serve(m, "plain", list(range(500, 509)))
    deadline = time.monotonic() + 10
    with redis_server.raw() as r:
        while True:
            found = (r.keys(prefix + "*", target_nodes=r.ALL_NODES) if hasattr(r, "ALL_NODES")
                     else r.keys(prefix + "*"))  # a cluster client asks every node
            keys = [k.decode() if isinstance(k, bytes) else k for k in found]
            ttls = {k: r.pttl(k) for k in keys}
            long = [k for k, t in ttls.items() if t > 2000]
            if len(keys) == 4 and len(long) == 2 or time.monotonic() > deadline:
                break
            conn.poll_transfers()
            time.sleep(0.05)
    assert len(keys) == 4, (keys, conn.remote_metrics(), conn.metrics)  # two blocks of each request
    assert len(long) == 2 and all(ttls[k] <= 600_000 for k in long)  # the claim's TTL, never more
    assert all(0 < t <= 2000 for k, t in ttls.items() if k not in long)  # the tier's own TTL
    m.shutdown()
