"""TieredConnector(remote_url=...): two managers in two processes share K/V through Redis."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from _redis_servers import redis_own, redis_server, redis_shared  # noqa: F401

_PROC = textwrap.dedent(
    """
    import sys
    import numpy as np
    from kvref import PagedKVCacheManager, TieredConnector
    from kvspec import KVCacheParams, TextContext

    role, url, out = sys.argv[1:4]
    PAGE = 4
    params = KVCacheParams(page_size=PAGE, num_layers=2, kv_heads=1, head_dim=2, dtype="float32")
    conn = TieredConnector(host_bytes=4096, remote_url=url, remote_timeout_s=2.0)
    m = PagedKVCacheManager(params, num_blocks=16, max_batch_size=4, max_seq_len=60, connector=conn)
    ctx = TextContext("r", list(range(100, 113)))
    m.claim(ctx)
    m.alloc(ctx).synchronize()
    m.poll_transfers()
    rows = m.get_req_blocks_per_leaf(ctx)["full"]
    buf = m.get_device_buffer(0)
    if role == "A":
        rng = np.random.default_rng(1)
        for p in range(ctx.processed_length, ctx.current_position):
            buf[rows[p // PAGE], :, :, p % PAGE] = rng.standard_normal(buf.shape[2:3] + buf.shape[4:])
        ctx.update(0)
        m.step(ctx)
    kv = buf[list(rows[:3])].tobytes()
    open(out, "wb").write(kv)
    print(ctx.cached_prefix_external_length, conn.remote_metrics().hits, conn.remote_metrics().blocks_written)
    m.release(ctx)
    m.shutdown()
    """
)


def test_two_managers_two_processes_share_kv(redis_server, tmp_path):
    def run(role):
        out = subprocess.run([sys.executable, "-c", _PROC, role, redis_server.url, str(tmp_path / role)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    a = run("A")
    b = run("B")
    assert a[0] == "0"
    assert b[0] == "12" and b[1] == "3"
    assert (tmp_path / "A").read_bytes() == (tmp_path / "B").read_bytes()
    assert np.frombuffer((tmp_path / "A").read_bytes(), np.float32).any()


PAGE = 4


def _kv(toks, p):
    return float((int(np.sum(np.asarray(toks[: p + 1], dtype=np.int64) * np.arange(1, p + 2))) % 1009) + p)


def test_redis_killed_mid_replay_changes_hits_not_correctness(redis_own):
    import time

    from kvref import PagedKVCacheManager, TieredConnector
    from kvspec import KVCacheParams, TextContext

    params = KVCacheParams(page_size=PAGE, num_layers=2, kv_heads=1, head_dim=2, dtype="float32")
    conn = TieredConnector(host_bytes=0, remote_url=redis_own.url, remote_timeout_s=2.0,
                           remote_reconnect_interval_s=0.2)
    m = PagedKVCacheManager(params, num_blocks=32, max_batch_size=4, max_seq_len=64, connector=conn)
    prompts = [[7 * i + j for j in range(13)] for i in range(5)]
    external = []
    for i in range(30):
        if i == 10:
            redis_own.kill()
        if i == 20:
            redis_own.restart()
            time.sleep(0.25)
        toks = prompts[i % 5]
        ctx = TextContext(f"r{i}", toks)
        m.claim(ctx)
        m.alloc(ctx)
        while m.pending_transfers_exist():
            m.poll_transfers()
        rows = m.get_req_blocks_per_leaf(ctx)["full"]
        buf = m.get_device_buffer(0)
        for p in range(ctx.processed_length):  # whatever was loaded is right
            assert np.all(buf[rows[p // PAGE], :, :, p % PAGE] == _kv(toks, p)), (i, p)
        external.append(ctx.cached_prefix_external_length // PAGE)
        for p in range(ctx.processed_length, ctx.current_position):
            buf[rows[p // PAGE], :, :, p % PAGE] = _kv(toks, p)
        ctx.update(0)
        m.step(ctx)
        m.release(ctx)
        m.poll_transfers()
        for off in list(m._offloads):
            off.handle.synchronize()
        m.poll_transfers()
        for pools in m._pools:  # forget the device copies: the next request must go to Redis
            for pool in pools.values():
                pool.reset_prefix_cache()
    assert external[:5] == [0] * 5 and external[5:10] == [3] * 5
    assert external[10:20] == [0] * 10
    assert external[20:25] == [0] * 5 and external[25:] == [3] * 5
    assert m.get_metrics_aggregated().connector_offload_blocks_dropped == 10 * 3
    m.shutdown()
