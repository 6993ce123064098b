"""FP8 K/V with scales in the request manager (spec/manager.md §16), kvref and kvfast.

Pins the scales buffer (shape, dtype, live view, bookkeeping-only mode), the
all-or-none scale fields of ``runtime_inputs``, the one-payload page store,
and that a page's scales travel with its values byte for byte through a host
tier offload and reload and through a cross-replica copy.
"""

from __future__ import annotations

import time

import ml_dtypes
import numpy as np
import pytest
from kvspec import HostPageStore, KVCacheParams, LeafSpec, PrefixCacheHits, ScaledPageStore, TextContext

import kvfast
import kvref

PKGS = [kvref, kvfast]
IDS = ["kvref", "kvfast"]
FP8 = ["float8_e4m3fn", "float8_e5m2"]


def _params(dtype="float8_e4m3fn", **kw) -> KVCacheParams:
    kw.setdefault("page_size", 4)
    return KVCacheParams(num_layers=2, kv_heads=3, head_dim=4, dtype=dtype, **kw)


def _manager(pkg, params, num_blocks=12, max_seq_len=32, **kw):
    return pkg.PagedKVCacheManager(params, num_blocks=num_blocks, max_batch_size=4, max_seq_len=max_seq_len, **kw)


def _fill(m, ctx, seed: int, replica: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Write random FP8 values and scales into ``ctx``'s pages; returns their bytes ``(values, scales)``."""
    rng = np.random.default_rng(seed)
    rows = m.get_req_blocks_per_leaf(ctx)["full"]
    buf, scales = m.get_device_buffer(replica), m.get_device_scales_buffer(replica)
    for b in rows:
        buf[b] = rng.standard_normal(buf.shape[1:]).astype(buf.dtype)
        scales[b] = rng.uniform(0.01, 2.0, scales.shape[1:]).astype(np.float32)
    return buf[rows].view(np.uint8).copy(), scales[rows].copy()


def _settle(m, host_bytes: int, timeout: float = 30.0) -> None:
    """Poll until the offloads landed and the host tier holds ``host_bytes`` (workers are threads)."""
    deadline = time.monotonic() + timeout
    while m.pending_transfers_exist(0) or m.host_byte_count(0).used != host_bytes:
        assert time.monotonic() < deadline, f"host tier holds {m.host_byte_count(0).used} bytes, not {host_bytes}"
        m.poll_transfers()
        time.sleep(0.001)


# ------------------------------------------------------------------ storage


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_scales_buffer_shape_dtype_and_identity(pkg, dtype):
    p = _params(dtype)
    assert p.page_scales_shape == (2, 2, 3)
    assert p.kv_page_bytes == 2 * 2 * 4 * 3 * 4 * 1 + 4 * 2 * 2 * 3 == p.page_bytes() + 4 * 2 * 2 * 3
    m = _manager(pkg, p)
    buf, sc = m.get_device_buffer(0), m.get_device_scales_buffer(0)
    assert buf.dtype == np.dtype(getattr(ml_dtypes, dtype)) and buf.shape == (12, 2, 2, 4, 3, 4)
    assert sc.dtype == np.float32 and sc.shape == (12, 2, 2, 3)
    assert not sc.any()
    assert m.get_device_scales_buffer(0) is sc
    with pytest.raises(IndexError, match=r"get_device_scales_buffer: replica_idx=1 out of range \[0, 1\)"):
        m.get_device_scales_buffer(1)


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_non_fp8_and_bookkeeping_managers_keep_no_scales(pkg):
    plain = _manager(pkg, _params("bfloat16"))
    assert plain.params.page_scales_shape == ()
    assert plain.params.kv_page_bytes == 2 * 2 * 4 * 3 * 4 * 2
    with pytest.raises(RuntimeError, match=r"params.dtype='bfloat16' keeps no scales"):
        plain.get_device_scales_buffer(0)
    book = _manager(pkg, _params(allocate_buffers=False))
    with pytest.raises(RuntimeError, match=r"allocates no scales"):
        book.get_device_scales_buffer(0)
    assert book._scales == [{}]  # nothing allocated
    ctx = TextContext("a", np.arange(9))
    book.claim(ctx)
    book.alloc(ctx)
    inp = book.runtime_inputs([[ctx]]).inputs[0]
    assert inp.kv_blocks is None and inp.kv_scales is None
    assert inp.scales_page_stride is None and inp.scales_lookup_table is None


@pytest.mark.parametrize("pkg", [kvref], ids=["kvref"])  # kvfast: see the report of issue 14 (slab WIP)
def test_scales_per_leaf_with_several_leaves(pkg):
    p = _params(leaves={"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(5),
                        "rec": LeafSpec.recurrent((2, 2))})
    m = _manager(pkg, p, num_blocks=16, max_seq_len=16)
    sc = m.get_device_scales_buffer(0)
    assert sorted(sc) == ["full", "swa"]
    for lid, arr in sc.items():
        assert arr.dtype == np.float32 and arr.shape[1:] == (2, 2, 3)
        assert arr.shape[0] == m.get_device_buffer(0)[lid].shape[0]


# ------------------------------------------------------------------ runtime inputs


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_runtime_inputs_scale_fields_all_or_none(pkg):
    m = _manager(pkg, _params())
    a, b = TextContext("a", np.arange(9)), TextContext("b", np.arange(3))
    for c in (a, b):
        m.claim(c)
        m.alloc(c)
    inp = m.runtime_inputs([[a, b]]).inputs[0]
    assert inp.kv_scales is m.get_device_scales_buffer(0)
    assert np.asarray(inp.scales_page_stride).dtype == np.int64
    assert np.asarray(inp.scales_page_stride).tolist() == [2 * 2 * 3]
    np.testing.assert_array_equal(np.asarray(inp.scales_lookup_table), np.asarray(inp.lookup_table))
    plain = _manager(pkg, _params("float16"))
    c = TextContext("c", np.arange(5))
    plain.claim(c)
    plain.alloc(c)
    pi = plain.runtime_inputs([[c]]).inputs[0]
    assert (pi.kv_scales, pi.scales_page_stride, pi.scales_lookup_table) == (None, None, None)


# ------------------------------------------------------------------ the one-payload page store


def test_scaled_page_store_moves_values_then_scales():
    vals = np.arange(5 * 2 * 3, dtype=np.uint8).reshape(5, 2, 3)
    scales = np.arange(5 * 2, dtype=np.float32).reshape(5, 2) + 0.5
    st = ScaledPageStore(HostPageStore(vals), HostPageStore(scales))
    assert (st.num_pages, st.page_nbytes) == (5, 6 + 8)
    got = st.read([3, 1])
    assert got.shape == (2, 14)
    assert got[0, :6].tolist() == vals[3].reshape(-1).tolist()
    assert got[0, 6:].view(np.float32).tolist() == scales[3].tolist()
    st.write([2], got[:1])
    assert np.array_equal(vals[2], vals[3]) and np.array_equal(scales[2], scales[3])
    with pytest.raises(ValueError, match=r"data.nbytes=13 != len\(block_ids\)\*page_nbytes=1\*14"):
        st.write([0], np.zeros(13, np.uint8))
    arena = st.alloc_host(3)
    assert arena.shape == (3, 14) and arena.dtype == np.uint8 and not arena.any()
    with pytest.raises(ValueError, match="num_pages"):
        ScaledPageStore(HostPageStore(vals), HostPageStore(scales[:4]))
    with pytest.raises(TypeError, match="must be a kvspec.PageStore"):
        ScaledPageStore(vals, HostPageStore(scales))


# ------------------------------------------------------------------ scales travel with their pages


def _offload_then_reload(pkg, dtype, tmp_path):
    """Request ``a`` writes 2 pages (values + scales), is offloaded to the host tier and released;
    the device copies are dropped and the buffers zeroed; ``b`` with the same prompt loads them."""
    p = _params(dtype, host_offload_bytes=1 << 16)
    m = _manager(pkg, p)
    toks = np.arange(9)
    a = TextContext("a", toks)
    m.claim(a)
    m.alloc(a)
    vals, scales = _fill(m, a, seed=7)
    a.update(1)
    m.step(a)
    m.release(a)
    _settle(m, 2 * p.kv_page_bytes)
    for pool in m._pools[0].values():  # drop the device copies only (the tier keeps its blocks)
        pool.reset_prefix_cache()
    m.get_device_buffer(0)[...] = 0
    m.get_device_scales_buffer(0)[...] = 0
    b = TextContext("b", toks)
    assert m.get_prefix_cache_hit_counts(b) == [PrefixCacheHits(0, 2)]
    m.claim(b)
    handle = m.alloc(b)
    handle.synchronize()
    m.poll_transfers()
    assert b.cached_prefix_external_length == 8
    rows = m.get_req_blocks_per_leaf(b)["full"][:2]
    got_vals = m.get_device_buffer(0)[rows].view(np.uint8)
    got_scales = m.get_device_scales_buffer(0)[rows]
    m.check_invariants()
    m.shutdown()
    return vals[:2], scales[:2], got_vals, got_scales


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_scales_survive_a_host_tier_offload_and_reload(pkg, dtype, tmp_path):
    vals, scales, got_vals, got_scales = _offload_then_reload(pkg, dtype, tmp_path)
    np.testing.assert_array_equal(got_vals, vals)
    np.testing.assert_array_equal(got_scales.view(np.uint8), scales.view(np.uint8))
    assert got_scales.any()


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_scales_travel_with_a_cross_replica_copy(pkg):
    m = _manager(pkg, _params(data_parallel_degree=2))
    toks = np.arange(13)
    a = TextContext("a", toks)
    m.claim(a, 0)
    m.alloc(a)
    vals, scales = _fill(m, a, seed=3)
    a.update(5)
    m.step(a)
    b = TextContext("b", toks)
    m.claim(b, 1)
    m.alloc(b)
    assert b.cached_prefix_length == 12
    rows = m.get_req_blocks_per_leaf(b)["full"][:3]
    np.testing.assert_array_equal(m.get_device_buffer(1)[rows].view(np.uint8), vals[:3])
    np.testing.assert_array_equal(m.get_device_scales_buffer(1)[rows], scales[:3])
    met = m.get_metrics_aggregated()
    assert met.cross_replica_blocks_copied == 3
    assert met.cross_replica_bytes_copied == 3 * m.params.kv_page_bytes
    m.check_invariants()


def test_kvref_and_kvfast_move_the_same_bytes(tmp_path):
    r = _offload_then_reload(kvref, "float8_e4m3fn", tmp_path)
    f = _offload_then_reload(kvfast, "float8_e4m3fn", tmp_path)
    for x, y in zip(r, f):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def test_bookkeeping_only_tiers_account_the_scale_bytes():
    p = _params(allocate_buffers=False, host_offload_bytes=1 << 16)
    m = _manager(kvref, p)
    a = TextContext("a", np.arange(9))
    m.claim(a)
    m.alloc(a)
    a.update(1)
    m.step(a)
    _settle(m, 2 * p.kv_page_bytes)
    m.shutdown()


def test_fp8_on_the_emulated_gpu(emulated):
    """kvfast on ``cuda`` (the CPU stand-in): FP8 pages as uint8 bit patterns, float32 scales,
    the scale fields set on the device, and a host-tier round trip through ``CudaPageStore``."""
    p = _params(host_offload_bytes=1 << 16)
    m = kvfast.PagedKVCacheManager(p, num_blocks=12, max_batch_size=4, max_seq_len=32, device="cuda:0")
    buf, sc = m.get_device_buffer(0), m.get_device_scales_buffer(0)
    assert buf.dtype == np.uint8 and sc.dtype == np.float32 and sc.shape == (12, 2, 2, 3)
    a = TextContext("a", np.arange(9))
    m.claim(a)
    m.alloc(a)
    rows = m.get_req_blocks_per_leaf(a)["full"]
    rng = np.random.default_rng(0)
    want_v = rng.integers(0, 255, (2, *buf.shape[1:]), dtype=np.uint8)
    want_s = rng.uniform(0.1, 1.0, (2, *sc.shape[1:])).astype(np.float32)
    for j in range(2):
        buf[rows[j]] = emulated.asarray(want_v[j])
        sc[rows[j]] = emulated.asarray(want_s[j])
    inp = m.runtime_inputs([[a]]).inputs[0]
    assert inp.kv_scales is sc and inp.scales_lookup_table is not None
    assert emulated.asnumpy(inp.scales_page_stride).tolist() == [12]
    a.update(1)
    m.step(a)
    m.release(a)
    _settle(m, 2 * p.kv_page_bytes)
    for pool in m._pools[0].values():
        pool.reset_prefix_cache()
    buf[...] = 0
    sc[...] = 0
    b = TextContext("b", np.arange(9))
    m.claim(b)
    m.alloc(b).synchronize()
    m.poll_transfers()
    got = m.get_req_blocks_per_leaf(b)["full"][:2]
    np.testing.assert_array_equal(emulated.asnumpy(buf[got]), want_v)
    np.testing.assert_array_equal(emulated.asnumpy(sc[got]), want_s)
    m.shutdown()


def test_fp8_cross_replica_copy_on_the_emulated_gpu(emulated):
    """copy_blocks.cu moves a page's scales with its values between replicas (CPU stand-in of a GPU)."""
    m = kvfast.PagedKVCacheManager(_params(data_parallel_degree=2), num_blocks=12, max_batch_size=4,
                                   max_seq_len=32, device="cuda:0")
    toks = np.arange(13)
    a = TextContext("a", toks)
    m.claim(a, 0)
    m.alloc(a)
    rows = m.get_req_blocks_per_leaf(a)["full"]
    sc0 = m.get_device_scales_buffer(0)
    want = np.random.default_rng(1).uniform(0.1, 1.0, (3, 2, 2, 3)).astype(np.float32)
    for j in range(3):
        sc0[rows[j]] = emulated.asarray(want[j])
    a.update(5)
    m.step(a)
    b = TextContext("b", toks)
    m.claim(b, 1)
    m.alloc(b)
    assert b.cached_prefix_length == 12
    got = m.get_req_blocks_per_leaf(b)["full"][:3]
    np.testing.assert_array_equal(emulated.asnumpy(m.get_device_scales_buffer(1)[got]), want)
