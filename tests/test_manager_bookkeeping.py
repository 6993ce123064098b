"""Bookkeeping-only mode, ``KVCacheParams(allocate_buffers=False)`` (spec/manager.md §1.5).

The whole policy runs (allocation order, hits, eviction, tiers' accounting)
without a byte of K/V: block ids, hits, metrics and lookup tables equal a
manager with buffers; nothing is O(bytes), so a 120 GiB pool is built and
driven in a few MiB.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import kvfast
import kvref
from kvspec import KVCacheParams, LeafSpec, TextContext

PKGS = pytest.mark.parametrize("pkg", [kvref, kvfast], ids=["kvref", "kvfast"])

LEAVES = [None, {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(6)},
          {"full": LeafSpec.full(), "rec": LeafSpec.recurrent((2, 2, 2))}]


def _drive(m, prompts, dp=1):
    """A scheduler loop; returns what a caller observes (hits, rows, tables, metrics, free order)."""
    out = []
    live = []
    for i, p in enumerate(prompts):
        ctx = TextContext(f"r{i}", p)
        r = i % dp
        m.claim(ctx, r)
        m.alloc(ctx)
        out.append((ctx.cached_prefix_length, m.get_req_blocks_per_leaf(ctx)))
        for _ in range(3):
            batches = [[c for c, rr in live + [(ctx, r)] if rr == q] for q in range(dp)]
            inp = m.runtime_inputs(batches)
            out.append([(x.lookup_table.tolist(), x.cache_lengths.tolist()) if not isinstance(x, dict) else
                        {k: (v.lookup_table.tolist(), v.cache_lengths.tolist()) for k, v in x.items()}
                        for x in inp.inputs])
            ctx.update(7)
            m.step(ctx)
            m.alloc(ctx)
        live.append((ctx, r))
        if len(live) > 2:
            old, _ = live.pop(0)
            m.release(old)
    m.check_invariants()
    out.append((m._free_order(), m.get_metrics_aggregated(), [m.block_count(r) for r in range(dp)]))
    return out


@PKGS
@pytest.mark.parametrize("leaves", LEAVES, ids=["full", "swa", "rec"])
@pytest.mark.parametrize("dp", [1, 2])
def test_bookkeeping_only_observes_what_real_bytes_observe(pkg, leaves, dp):
    rng = np.random.default_rng(5)
    base = rng.integers(0, 50, 12).tolist()
    prompts = [base[: int(rng.integers(3, 12))] + rng.integers(0, 50, int(rng.integers(1, 9))).tolist()
               for _ in range(10)]
    runs = []
    for allocate in (True, False):
        params = KVCacheParams(page_size=4, num_layers=2, kv_heads=1, head_dim=2, dtype="float32", leaves=leaves,
                               data_parallel_degree=dp, allocate_buffers=allocate)
        # spec/manager.md §13: two leaves share one slab of huge blocks, so the hybrid runs get twice the blocks
        m = pkg.PagedKVCacheManager(params, num_blocks=40 if leaves else 20, max_batch_size=4, max_seq_len=64)
        runs.append(_drive(m, prompts, dp))
    assert runs[0] == runs[1]


@PKGS
def test_bookkeeping_only_has_no_buffer(pkg):
    params = KVCacheParams(page_size=4, num_layers=1, kv_heads=1, head_dim=2, allocate_buffers=False)
    m = pkg.PagedKVCacheManager(params, num_blocks=8, max_batch_size=2, max_seq_len=28)
    with pytest.raises(RuntimeError, match=r"get_device_buffer: params.allocate_buffers=False"):
        m.get_device_buffer(0)
    ctx = TextContext("a", list(range(9)))
    m.claim(ctx)
    m.alloc(ctx)
    inp = m.runtime_inputs([[ctx]]).inputs[0]
    assert inp.kv_blocks is None and inp.lookup_table.tolist() == [[1, 2, 3, 0, 0, 0, 0, 0]]


@PKGS
def test_a_120_gib_pool_with_tiers_costs_no_bytes(pkg, tmp_path):
    # 2 MiB pages (32 layers, 8 heads of 128, bf16, page 16): 61,441 pages = 120 GiB per replica
    params = KVCacheParams(page_size=16, num_layers=32, kv_heads=8, head_dim=128, dtype="bfloat16",
                           data_parallel_degree=2, allocate_buffers=False,
                           host_offload_bytes=64 << 30, disk_offload_bytes=256 << 30,
                           disk_offload_dir=str(tmp_path))
    assert params.page_bytes() == 2 << 20
    tracemalloc.start()
    try:
        m = pkg.PagedKVCacheManager(params, num_blocks=61_441, max_batch_size=8, max_seq_len=8192)
        for i in range(4):
            ctx = TextContext(f"r{i}", list(range(1000 + i)))
            m.claim(ctx, i % 2)
            m.alloc(ctx)
            m.runtime_inputs([[ctx], []] if i % 2 == 0 else [[], [ctx]])
            ctx.update(1)
            m.step(ctx)
            m.release(ctx)
        m.poll_transfers()
        m.shutdown()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 256 << 20, f"peak {peak / 2**20:.0f} MiB for a bookkeeping-only manager"
    assert m.block_count(0).total == 61_440
