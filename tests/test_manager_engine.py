"""The request manager's engines at the protocol level (spec/manager.md §12).

``kvref.ReferenceManagerEngine`` and kvfast's ``FastManagerEngine`` satisfy
``kvspec.engine.ManagerEngine``; their pools satisfy ``kvspec.engine.BlockPool``;
given the same calls they return the same values (hashes, lookup tables, block
ids, ``peek``); each manager runs on the engine its class chose.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvfast
import kvref
from kvfast._manager_engine import FastManagerEngine
from kvspec import KVCacheParams, hashing
from kvspec.engine import BlockPool, ManagerEngine

ENGINES = [kvref.ReferenceManagerEngine(), FastManagerEngine()]


def test_engines_and_pools_satisfy_the_protocols():
    for eng in ENGINES:
        assert isinstance(eng, ManagerEngine)
        assert isinstance(eng.block_pool(4), BlockPool)
    p = KVCacheParams(page_size=2, num_layers=1, kv_heads=1, head_dim=1)
    assert type(kvref.PagedKVCacheManager(p, num_blocks=5, max_batch_size=1, max_seq_len=8)._engine) \
        is kvref.ReferenceManagerEngine
    assert type(kvfast.PagedKVCacheManager(p, num_blocks=5, max_batch_size=1, max_seq_len=8)._engine) \
        is FastManagerEngine


@settings(max_examples=40)
@given(tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40), page=st.integers(1, 5),
       algo=st.sampled_from(["sha256", "xxh3_128"]), parent=st.binary(min_size=16, max_size=32))
def test_chain_hashes_equal_kvspec_hashing(tokens, page, algo, parent):
    toks = np.asarray(tokens, dtype=np.int32)
    want = list(hashing.block_hashes(toks[: len(toks) // page * page], page, algo, parent=parent))
    for eng in ENGINES:
        assert eng.chain_hashes(parent, toks[: len(toks) // page * page], page, algo) == want


@settings(max_examples=40)
@given(rows=st.lists(st.lists(st.integers(1, 2**31), max_size=9), max_size=6), data=st.data())
def test_lookup_tables_equal(rows, data):
    widths = [data.draw(st.integers(0, len(r))) for r in rows]
    cols = 8 * max(1, -(-max(widths, default=0) // 8))
    a, b = (eng.lookup_table(rows, widths, cols) for eng in ENGINES)
    assert a.dtype == b.dtype == np.uint32 and a.shape == b.shape == (len(rows), cols)
    assert np.array_equal(a, b)


@settings(max_examples=60)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "publish", "touch", "peek"]),
                              st.integers(0, 7)), max_size=40))
def test_pools_agree_on_a_random_run_including_peek(ops):
    pools = [eng.block_pool(8) for eng in ENGINES]
    held: list[int] = []
    for op, x in ops:
        out = []
        for pool in pools:
            if op == "alloc":
                out.append(pool.allocate(min(x % 3 + 1, pool.num_free)) if pool.num_free else [])
            elif op == "free" and held:
                pool.free([held[x % len(held)]])
                out.append(None)
            elif op == "publish" and held:
                b = held[x % len(held)]
                out.append(pool.publish(b, bytes([x % 4]), np.array([x % 3, 1], np.int32)))
            elif op == "touch":
                hit = pool.lookup(bytes([x % 4]), np.array([x % 3, 1], np.int32))
                if hit is not None:
                    pool.touch(hit)
                out.append(hit)
            elif op == "peek":
                out.append(pool.peek(x, skip={1, 2}))
            else:
                out.append(None)
        assert out[0] == out[1], (op, x, out)
        if op == "alloc":
            held += out[0]
        elif op == "free" and held:
            held.remove(held[x % len(held)])
        elif op == "touch" and out[0] is not None:
            held.append(out[0])
        assert pools[0].free_order() == pools[1].free_order()
        assert pools[0].peek(3) == pools[0].free_order()[:3]


@pytest.mark.parametrize("pkg", [kvref, kvfast], ids=["kvref", "kvfast"])
def test_cuda_is_chosen_by_the_engine(pkg):
    p = KVCacheParams(page_size=2, num_layers=1, kv_heads=1, head_dim=1)
    if pkg is kvref:
        with pytest.raises(ValueError, match="kvref stores NumPy arrays and supports only 'cpu'"):
            pkg.PagedKVCacheManager(p, num_blocks=4, max_batch_size=1, max_seq_len=8, device="cuda")
    with pytest.raises(ValueError, match="device='tpu'"):
        pkg.PagedKVCacheManager(p, num_blocks=4, max_batch_size=1, max_seq_len=8, device="tpu")
