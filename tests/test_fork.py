"""Copy-on-write fork of a slot (``KVCache.fork``) and of a request (``PagedKVCacheManager.fork``).

Issue 33, deliverable 4; ``spec/slot-cache.md`` §12 and ``spec/manager.md`` §19. Every test runs on
kvref and kvfast (CPU). The copy-on-write property is checked on bytes: after a fork, new tokens
written into the child never change a byte the parent reads, and the child reads the parent's
history followed by its own. Every refused call leaves a fingerprint of the whole cache unchanged.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import kvfast
import kvref
from kvspec import (
    CapacityError, InsufficientBlocksError, KVCacheConfig, KVCacheMode, KVCacheParams, KVLayerSpec, LeafSpec,
    TextContext,
)
from kvspec.conformance.machine import cache_snapshot

PKGS = [pytest.param(kvref, id="kvref"), pytest.param(kvfast, id="kvfast")]
P = 4  # block / page size


# =========================================================================== slot cache


def _cache(pkg, mode=KVCacheMode.PAGED, *, specs=None, dtype="float32", max_seqs=3, max_seq_len=16, **kw):
    specs = specs or [KVLayerSpec.attention(2, 4), KVLayerSpec.sliding_window(2, 4, 5)]
    cfg = KVCacheConfig(num_layers=len(specs), max_seqs=max_seqs, max_seq_len=max_seq_len, mode=mode,
                        block_size=P, dtype=dtype, **kw)
    return pkg.KVCache.make(cfg, specs)


def _kv(n, spec, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, spec.kv_heads, spec.head_dim)).astype(np.float32),
            rng.standard_normal((n, spec.kv_heads, spec.head_dim)).astype(np.float32))


def _write(pkg, cache, slots, n, seed):
    """One step of ``n`` tokens for each slot in ``slots``: K/V written into every attention layer."""
    past = [int(cache.seq_lens()[s]) for s in slots]
    cu = np.arange(len(slots) + 1, dtype=np.int32) * n
    step = cache.prepare_step(cu, past, slots)
    for l, spec in enumerate(cache.layer_specs):
        if spec.kind in (kvref.LayerKind.ATTENTION, kvref.LayerKind.SLIDING_WINDOW):
            k, v = _kv(n * len(slots), spec, seed + l)
            pkg.ops.append_kv(cache, l, k, v, step)
    for s, p in zip(slots, past):
        cache.update_position(s, p + n)


def _history(pkg, cache, slot):
    """Every attention layer's committed K/V of ``slot`` (gather_kv copies, float32)."""
    return [tuple(np.asarray(x, np.float32).copy() for x in pkg.ops.gather_kv(cache, l, slot))
            for l, sp in enumerate(cache.layer_specs) if sp.kind is not kvref.LayerKind.STATE
            and sp.kind is not kvref.LayerKind.CROSS_ATTENTION]


def _fp(cache):
    """Fingerprint: every observable byte plus the bookkeeping (pool, counts, checkpoints)."""
    snap = cache_snapshot(cache, cache.layer_specs, free_order=cache.mode() is KVCacheMode.PAGED)
    pool = None if cache._pool is None else cache._pool.snapshot()
    return repr((snap, pool, cache._nblk.tolist(), cache._nshared.tolist(), cache._nfrozen.tolist(),
                 cache._enc.tolist(), sorted(cache._spec_checkpoints), list(cache._checkpoints)))


def _refused(cache, exc, match, fn):
    before = _fp(cache)
    with pytest.raises(exc, match=match):
        fn()
    assert _fp(cache) == before
    cache.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_paged_fork_shares_full_blocks_and_copies_the_partial_one(pkg):
    c = _cache(pkg)
    _write(pkg, c, [0], 6, seed=1)
    before = _history(pkg, c, 0)
    c.fork(0, 2)
    c.check_invariants()
    table = c.paged_block_table()
    assert table[0, :2].tolist() == [1, 2] and table[2, :2].tolist() == [1, 3]
    assert c.seq_lens().tolist() == [6, 0, 6]
    assert c._pool.ref_count[1] == 2 and c._pool.ref_count[2] == 1 and c._pool.ref_count[3] == 1
    for (k0, v0), (k2, v2) in zip(_history(pkg, c, 0), _history(pkg, c, 2)):
        np.testing.assert_array_equal(k0, k2)
        np.testing.assert_array_equal(v0, v2)
    for (k0, v0), (kb, vb) in zip(_history(pkg, c, 0), before):
        np.testing.assert_array_equal(k0, kb)
        np.testing.assert_array_equal(v0, vb)
    # all P rows of the partial block are copied, written or not
    for l in range(2):
        np.testing.assert_array_equal(c.keys(l)[3], c.keys(l)[2])


@pytest.mark.parametrize("pkg", PKGS)
@pytest.mark.parametrize("mode", [KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS], ids=["paged", "contiguous"])
def test_writes_into_the_child_never_change_the_parent(pkg, mode):
    c = _cache(pkg, mode)
    _write(pkg, c, [1], 9, seed=2)  # two full blocks and one partial
    parent = _history(pkg, c, 1)
    c.fork(1, 0)
    _write(pkg, c, [0], 5, seed=3)  # the child fills its copied block and takes a new one
    _write(pkg, c, [0], 1, seed=4)
    c.check_invariants()
    for (k, v), (kb, vb) in zip(_history(pkg, c, 1), parent):
        np.testing.assert_array_equal(k, kb)
        np.testing.assert_array_equal(v, vb)
    for (k, v), (kb, vb) in zip(_history(pkg, c, 0), parent):  # the child's history starts with the parent's
        np.testing.assert_array_equal(k[:9], kb)
        np.testing.assert_array_equal(v[:9], vb)
    # and the parent's new tokens never reach the child
    child = _history(pkg, c, 0)
    _write(pkg, c, [1], 3, seed=5)
    for (k, v), (kb, vb) in zip(_history(pkg, c, 0), child):
        np.testing.assert_array_equal(k, kb)
        np.testing.assert_array_equal(v, vb)


@pytest.mark.parametrize("pkg", PKGS)
def test_beams_step_together_and_attention_reads_their_own_history(pkg):
    c = _cache(pkg, specs=[KVLayerSpec.attention(2, 4)])
    _write(pkg, c, [0], 5, seed=6)
    c.fork(0, 1)
    c.fork(0, 2)
    step = c.prepare_step([0, 1, 2, 3], [5, 5, 5], [0, 1, 2])
    spec = c.layer_specs[0]
    k, v = _kv(3, spec, 7)
    pkg.ops.append_kv(c, 0, k, v, step)
    q = np.random.default_rng(8).standard_normal((3, 2, 4)).astype(np.float32)
    out = pkg.ops.varlen_attention(q, c, 0, step)
    for b in range(3):
        c.update_position(b, 6)
    hist = [_history(pkg, c, s)[0] for s in range(3)]
    for s in range(3):
        np.testing.assert_array_equal(hist[s][0][:5], hist[0][0][:5])
        np.testing.assert_array_equal(hist[s][0][5], k[s].astype(np.float32))
        # each beam attends over the shared prefix plus its own token (dense reference)
        ks, vs = hist[s]
        scores = np.einsum("hd,khd->hk", q[s], ks) / np.sqrt(4)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        np.testing.assert_allclose(out[s], np.einsum("hk,khd->hd", w, vs), rtol=1e-4, atol=1e-5)
    c.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_releases_free_everything_and_prefix_hits_afterwards(pkg):
    c = _cache(pkg, specs=[KVLayerSpec.attention(2, 4)], max_seqs=4)
    a = list(range(10, 16))  # 6 tokens: block 0 full, block 1 partial
    _write(pkg, c, [0], 6, seed=9)
    c.fork(0, 1)
    _write(pkg, c, [0], 2, seed=10)  # parent: 8 tokens, two full blocks
    _write(pkg, c, [1], 3, seed=11)  # child: 9 tokens
    pa, pb = a + [20, 21], a + [30, 31, 32]
    c.retire(0, pa)
    c.check_invariants()
    c.retire(1, pb)
    c.check_invariants()
    assert len(c._free_order()) == c.config.resolved_num_blocks - 1  # every block free (published ones retained)
    # the shared block 0 is one hit for both continuations; each chain's own second block hits too
    assert c.admit(2, pa + [1]) == 8
    assert c.admit(3, pb + [1]) == 8
    assert c.paged_block_table()[2, 0] == c.paged_block_table()[3, 0]
    c.check_invariants()
    c.evict_batch(2)
    c.evict_batch(3)
    assert len(c._free_order()) == c.config.resolved_num_blocks - 1
    c.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_a_shared_block_cannot_be_rolled_back_into(pkg):
    c = _cache(pkg)
    _write(pkg, c, [0], 9, seed=12)
    c.fork(0, 1)
    for slot in (0, 1):
        _refused(c, ValueError, rf"update_position: new_pos=7 < shared prefix=8 of slot {slot}",
                 lambda: c.update_position(slot, 7))
        c.update_position(slot, 8)  # the floor itself is fine; the copied block is private
    c.evict_batch(1)
    c.update_position(0, 8)
    _refused(c, ValueError, "new_pos=3 < shared prefix=8", lambda: c.update_position(0, 3))


@pytest.mark.parametrize("pkg", PKGS)
def test_fork_below_a_speculation_checkpoint_shares_only_what_stays(pkg):
    c = _cache(pkg, specs=[KVLayerSpec.attention(2, 4)])
    _write(pkg, c, [0], 3, seed=13)
    assert c.checkpoint_state(0) == 3
    _write(pkg, c, [0], 6, seed=14)  # a speculative step: 9 tokens, blocks [1, 2, 3]
    c.fork(0, 1)
    t = c.paged_block_table()
    assert t[1, :3].tolist() == [4, 5, 6]  # nothing shared: the checkpoint lies in block 0
    assert c.state_checkpoint_position(1) == -1 and c.state_checkpoint_position(0) == 3
    child = _history(pkg, c, 1)
    assert c.restore_state(0) == 3  # rejected drafts: the parent rewrites from position 3
    _write(pkg, c, [0], 4, seed=15)
    for (k, v), (kb, vb) in zip(_history(pkg, c, 1), child):
        np.testing.assert_array_equal(k, kb)
        np.testing.assert_array_equal(v, vb)
    c.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
@pytest.mark.parametrize("mode", [KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS], ids=["paged", "contiguous"])
def test_state_and_cross_layers_are_copied(pkg, mode):
    specs = [KVLayerSpec.attention(1, 2), KVLayerSpec.state(conv_dims=(3,), conv_width=2, recurrent=(1, 2, 2)),
             KVLayerSpec.cross_attention(1, 2, max_enc_len=5)]
    c = _cache(pkg, mode, specs=specs)
    rng = np.random.default_rng(16)
    c.conv_state(1)[2] = rng.standard_normal((3, 2))
    c.recurrent_state(1)[2] = rng.standard_normal((1, 2, 2))
    k = rng.standard_normal((4, 1, 2)).astype(np.float32)
    c.fill(2, 2, k, -k)
    _write(pkg, c, [2], 5, seed=17)
    c.fork(2, 0)
    np.testing.assert_array_equal(c.conv_state(1)[0], c.conv_state(1)[2])
    np.testing.assert_array_equal(c.recurrent_state(1)[0], c.recurrent_state(1)[2])
    np.testing.assert_array_equal(c.keys(2)[0], c.keys(2)[2])
    np.testing.assert_array_equal(c.values(2)[0], c.values(2)[2])
    step = c.prepare_step([0, 1], [5], [0])
    assert step.cross_seqused_k.tolist() == [4]
    c.update_position(0, 6)
    c.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
@pytest.mark.parametrize("mode", [KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS], ids=["paged", "contiguous"])
def test_fp8_scales_follow_the_copied_block(pkg, mode):
    c = _cache(pkg, mode, specs=[KVLayerSpec.attention(2, 4)], dtype="float8_e4m3fn")
    _write(pkg, c, [0], 6, seed=18)
    parent = _history(pkg, c, 0)
    c.fork(0, 1)
    ks, vs = c.scales(0)
    if mode is KVCacheMode.PAGED:
        np.testing.assert_array_equal(ks[3], ks[2])  # block 2's scales copied into block 3
        np.testing.assert_array_equal(vs[3], vs[2])
    else:
        np.testing.assert_array_equal(ks[1], ks[0])
    for (k, v), (kb, vb) in zip(_history(pkg, c, 1), parent):
        np.testing.assert_array_equal(k, kb)
        np.testing.assert_array_equal(v, vb)
    # a large value into the child grows (and re-quantises) only the child's unit
    step = c.prepare_step([0, 1], [6], [1])
    big = np.full((1, 2, 4), 1000.0, np.float32)
    pkg.ops.append_kv(c, 0, big, big, step)
    c.update_position(1, 7)
    for (k, v), (kb, vb) in zip(_history(pkg, c, 0), parent):
        np.testing.assert_array_equal(k, kb)
        np.testing.assert_array_equal(v, vb)
    c.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_fork_of_an_empty_slot_leaves_an_empty_slot(pkg):
    c = _cache(pkg)
    c.fork(0, 1)
    assert c.seq_lens().tolist() == [0, 0, 0]
    assert not c.paged_block_table().any()
    c.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_fork_errors_leave_the_cache_unchanged(pkg):
    c = _cache(pkg, num_blocks=5)  # 4 usable blocks
    _write(pkg, c, [0], 6, seed=19)  # blocks 1, 2
    _write(pkg, c, [1], 1, seed=20)  # block 3
    _refused(c, TypeError, r"fork: src_batch_idx='0', must be an int", lambda: c.fork("0", 2))
    _refused(c, TypeError, r"fork: dst_batch_idx=True, must be an int", lambda: c.fork(0, True))
    _refused(c, IndexError, r"fork: src_batch_idx=3 out of range \[0, 3\)", lambda: c.fork(3, 2))
    _refused(c, IndexError, r"fork: dst_batch_idx=-1 out of range \[0, 3\)", lambda: c.fork(0, -1))
    _refused(c, ValueError, r"fork: dst_batch_idx=0 == src_batch_idx=0, must be another slot",
             lambda: c.fork(0, 0))
    _refused(c, ValueError, r"fork: dst_batch_idx=1 holds seq_len=1 and 1 blocks, must be empty",
             lambda: c.fork(0, 1))
    c.prepare_step([0, 1], [0], [2])  # slot 2 reserves the last block (length 0, one block: not empty)
    _refused(c, ValueError, r"fork: dst_batch_idx=2 holds seq_len=0 and 1 blocks, must be empty",
             lambda: c.fork(0, 2))
    c.evict_batch(2)
    _write(pkg, c, [2], 1, seed=21)  # the last free block taken
    c.evict_batch(1)  # block 3 freed...
    _write(pkg, c, [2], 4, seed=22)  # ...and taken again: no free block
    assert c._pool.num_free == 0
    _refused(c, CapacityError, r"fork: needs 1 blocks, 0 free or evictable", lambda: c.fork(0, 1))
    c.update_position(0, 4)  # a whole-block source needs no copy
    c.fork(0, 1)
    assert c.paged_block_table()[1, :1].tolist() == [1]
    c.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_contiguous_fork_errors(pkg):
    c = _cache(pkg, KVCacheMode.CONTIGUOUS)
    _write(pkg, c, [0], 3, seed=23)
    _refused(c, ValueError, r"fork: dst_batch_idx=0 holds seq_len=3 and 0 blocks, must be empty",
             lambda: c.fork(1, 0))


# =========================================================================== manager


def _mgr(pkg, leaves=None, *, dtype="float32", num_blocks=12, dp=1, caching=True, max_seq_len=24, **kw):
    params = KVCacheParams(page_size=P, num_layers=1, kv_heads=1, head_dim=2, dtype=dtype, leaves=leaves,
                           data_parallel_degree=dp, enable_prefix_caching=caching, **kw)
    return pkg.PagedKVCacheManager(params, num_blocks=num_blocks, max_batch_size=4, max_seq_len=max_seq_len)


HYBRID = {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(5), "rec": LeafSpec.recurrent((2, 2))}


def _buffers(m, r=0):
    buf = m.get_device_buffer(r)
    return buf if isinstance(buf, dict) else {"full": buf}


def _forward(m, ctx, seed, r=0):
    """What a forward writes: distinct K/V per (token position, seed) into every full/sliding page the
    request holds over its active tokens, and its recurrent live state (the sum of the seeds)."""
    rows = m.get_req_blocks_per_leaf(ctx)
    bufs = _buffers(m, r)
    for lid, row in rows.items():
        buf = bufs[lid]
        if m.params.leaves()[lid].kind is kvref.LeafKind.RECURRENT:
            buf[row[0]] += seed
            continue
        for p in range(ctx.processed_length, ctx.current_position):
            if row[p // P]:
                buf[row[p // P], :, :, p % P] = (seed * 1000 + p) * (1 + np.arange(buf.shape[-1]))


def _history_m(m, ctx, r=0):
    """The K/V a request reads: every processed position of every full/sliding row, and its live state."""
    rows = m.get_req_blocks_per_leaf(ctx)
    bufs = _buffers(m, r)
    out = {}
    for lid, row in rows.items():
        buf = np.asarray(bufs[lid])
        if m.params.leaves()[lid].kind is kvref.LeafKind.RECURRENT:
            out[lid] = buf[row[0]].copy()
            continue
        out[lid] = {p: buf[row[p // P], :, :, p % P].copy() for p in range(ctx.processed_length) if row[p // P]}
    return out


def _same(now, then, upto=None):
    """Every position both histories hold (a sliding window drops old ones) has the same bytes."""
    for lid, h in then.items():
        if isinstance(h, dict):
            common = [p for p in h if p in now[lid] and (upto is None or p < upto)]
            assert common, lid
            for p in common:
                np.testing.assert_array_equal(now[lid][p], h[p], err_msg=f"{lid} position {p}")
        else:
            np.testing.assert_array_equal(now[lid], h, err_msg=lid)


def _run(m, ctx, token, seed, r=0):
    if not m.contains(ctx):
        m.claim(ctx, r)
    m.alloc(ctx)
    _forward(m, ctx, seed, r)
    ctx.update(token)
    m.step(ctx)


def _mfp(m, *ctxs):
    """Fingerprint of everything observable (tests/test_manager_errors.py's, with slabs and scales)."""
    pools = [{lid: p.snapshot() for lid, p in pools.items()} for pools in m._pools]
    reqs = {rid: {k: getattr(q, k) for k in type(q).__slots__ if k != "ctx"} for rid, q in m._requests.items()}
    bufs = [{lid: hashlib.sha256(np.ascontiguousarray(b).tobytes()).hexdigest() for lid, b in d.items()
             if b is not None} for d in m._buffers]
    scales = [{lid: hashlib.sha256(np.ascontiguousarray(b).tobytes()).hexdigest() for lid, b in d.items()}
              for d in m._scales]
    slabs = [(s.table.parked_order(), s.table.owners(), s.table.live_counts()) for s in m._slabs]
    cs = [(c.request_id, c.processed_length, c.active_length, len(c), c.cached_prefix_length,
           c.cached_prefix_external_length) for c in ctxs]
    return repr((pools, reqs, m.get_metrics_aggregated(), [dict(p) for p in m._pins], m._offload_queue,
                 len(m._loads), bufs, scales, slabs, cs))


def _m_refused(m, exc, match, fn, *ctxs):
    before = _mfp(m, *ctxs)
    with pytest.raises(exc, match=match):
        fn()
    assert _mfp(m, *ctxs) == before
    m.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
@pytest.mark.parametrize("leaves", [None, HYBRID], ids=["full", "full+swa+rec"])
def test_manager_fork_copy_on_write(pkg, leaves):
    m = _mgr(pkg, leaves)
    a = TextContext("a", list(range(100, 109)))  # 9 tokens
    _run(m, a, 7, seed=1)  # processed 9: pages 0, 1 full, page 2 partial
    _run(m, a, 8, seed=2)  # processed 10
    parent_rows = m.get_req_blocks_per_leaf(a)
    parent = _history_m(m, a)
    b = TextContext("b", list(a.tokens[:10]) + [55])
    m.fork(a, b)
    m.check_invariants()
    rows = m.get_req_blocks_per_leaf(b)
    assert b.processed_length == 10 and b.active_length == 1
    assert rows["full"][:2] == parent_rows["full"][:2] and rows["full"][2] not in parent_rows["full"]
    if leaves:
        # the sliding leaf keeps its window pages (shared) and nulls what the parent nulled
        assert rows["swa"][:2] == parent_rows["swa"][:2] and rows["swa"][2] not in parent_rows["swa"]
        assert len(rows["rec"]) == 1 and rows["rec"][0] not in parent_rows["rec"]
    _same(_history_m(m, b), parent)  # the same bytes through the child's rows
    for _ in range(3):  # the child decodes past its copied page into fresh ones
        _run(m, b, 60 + _, seed=10 + _)
    _run(m, a, 9, seed=20)
    m.check_invariants()
    parent.pop("rec", None)  # (the states moved on by design)
    _same(_history_m(m, a), parent)
    _same(_history_m(m, b), parent, upto=10)
    m.release(a)
    m.check_invariants()
    m.release(b)
    m.check_invariants()
    assert m.block_count(0).free == m.block_count(0).total


@pytest.mark.parametrize("pkg", PKGS)
def test_manager_fork_then_steps_publish_and_prefix_hits_are_correct(pkg):
    m = _mgr(pkg)
    a = TextContext("a", list(range(6)))
    _run(m, a, 6, seed=1)  # processed 6: page 0 full (published), page 1 partial
    b = TextContext("b", list(range(6)) + [40])
    m.fork(a, b)
    _run(m, a, 7, seed=2)  # processed 7
    _run(m, a, 8, seed=3)  # processed 8: page 1 full, published under a's chain
    _run(m, b, 41, seed=4)  # processed 7
    _run(m, b, 42, seed=5)  # processed 8: b's own page 1 published under b's chain
    m.check_invariants()
    ra, rb = m.get_req_blocks_per_leaf(a)["full"], m.get_req_blocks_per_leaf(b)["full"]
    assert ra[0] == rb[0] and ra[1] != rb[1]
    m.release(a)
    m.release(b)
    m.check_invariants()
    for toks, want in ((list(a.tokens[:8]) + [1], ra[:2]), (list(b.tokens[:8]) + [1], rb[:2]),
                       (list(range(4)) + [9, 9, 9, 9, 1], ra[:1])):
        c = TextContext("c", toks)
        m.claim(c)
        m.alloc(c)
        assert m.get_req_blocks_per_leaf(c)["full"][: len(want)] == want
        assert c.processed_length == len(want) * P
        m.release(c)
    m.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_manager_fork_fp8_copies_the_partial_page_scales(pkg):
    m = _mgr(pkg, dtype="float8_e4m3fn")
    a = TextContext("a", list(range(6)))
    m.claim(a)
    m.alloc(a)
    sc = m.get_device_scales_buffer(0)
    rows = m.get_req_blocks_per_leaf(a)["full"]
    sc[rows[0]] = 2.0
    sc[rows[1]] = 0.5
    a.update(6)
    m.step(a)
    b = TextContext("b", list(range(7)))
    m.fork(a, b)
    rb = m.get_req_blocks_per_leaf(b)["full"]
    assert rb[0] == rows[0]
    np.testing.assert_array_equal(sc[rb[1]], sc[rows[1]])
    np.testing.assert_array_equal(np.asarray(m.get_device_buffer(0)[rb[1]]).view(np.uint8),
                                  np.asarray(m.get_device_buffer(0)[rows[1]]).view(np.uint8))
    m.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_manager_fork_on_a_replica_and_without_bytes(pkg):
    m = _mgr(pkg, dp=2)
    a = TextContext("a", list(range(6)))
    _run(m, a, 6, seed=1, r=1)
    b = TextContext("b", list(range(6)) + [3])
    m.fork(a, b)
    assert m._requests["b"].replica == 1
    assert m.block_count(0).free == m.block_count(0).total
    m.check_invariants()
    n = _mgr(pkg, allocate_buffers=False)
    a = TextContext("a", list(range(6)))
    n.claim(a)
    n.alloc(a)
    a.update(6)
    n.step(a)
    b = TextContext("b", list(range(6)) + [3])
    n.fork(a, b)
    assert n.get_req_blocks_per_leaf(b)["full"][0] == n.get_req_blocks_per_leaf(a)["full"][0]
    n.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_manager_fork_without_prefix_caching(pkg):
    m = _mgr(pkg, HYBRID, caching=False)
    a = TextContext("a", list(range(9)))
    _run(m, a, 9, seed=1)
    b = TextContext("b", list(range(9)) + [1])
    m.fork(a, b)
    m.check_invariants()
    _run(m, b, 2, seed=2)
    _run(m, a, 3, seed=3)
    m.release(b)
    m.release(a)
    m.check_invariants()
    assert m.block_count(0).free == m.block_count(0).total


@pytest.mark.parametrize("pkg", PKGS)
def test_manager_refuses_a_rewind_into_fork_shared_pages(pkg):
    """spec/manager.md §19: neither side may rewind below the shared pages. The policy's check
    (``_check_no_rewind``) is reached here through ``defer_lookup=True``; the decode lanes of
    ``alloc`` (kvref/_allocation.py, kvref/_batch.py, kvfast/_manager.py) compare
    ``processed_length`` with the published count only and must also read ``shared_floor``
    (reported with issue 33)."""
    m = _mgr(pkg, caching=False)
    a = TextContext("a", list(range(9)))
    _run(m, a, 9, seed=1)
    b = TextContext("b", list(range(9)) + [1])
    m.fork(a, b)
    for ctx in (a, b):
        ctx.rewind_processing(3)
        _m_refused(m, ValueError, rf"alloc: request_id='{ctx.request_id}' processed_length=6 < 8 tokens in pages "
                   "shared with a fork", lambda: m.alloc(ctx, defer_lookup=True), a, b)
        ctx.skip_processing(3)
        m.alloc(ctx, defer_lookup=True)
    m.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_manager_fork_errors_leave_everything_unchanged(pkg):
    m = _mgr(pkg, num_blocks=7)  # 6 usable pages
    a = TextContext("a", list(range(6)))
    _run(m, a, 6, seed=1)  # pages 1, 2
    ok = lambda: TextContext("b", list(range(6)) + [5])  # noqa: E731
    b = ok()
    _m_refused(m, TypeError, r"fork: parent_ctx='a', must be a TextContext", lambda: m.fork("a", b), a, b)
    _m_refused(m, TypeError, r"fork: child_ctx=None, must be a TextContext", lambda: m.fork(a, None), a, b)
    _m_refused(m, ValueError, r"fork: request_id='x' is not claimed",
               lambda: m.fork(TextContext("x", [1, 2]), b), a, b)
    _m_refused(m, ValueError, r"fork: child_ctx request_id='a' is already claimed, on replica 0",
               lambda: m.fork(a, TextContext("a", list(range(7)))), a, b)
    d = TextContext("d", [1, 2, 3])
    m.alloc_dummy(d)
    _m_refused(m, ValueError, r"fork: parent request_id='d' is a dummy row", lambda: m.fork(d, b), a, b)
    e = TextContext("e", list(range(70, 75)))
    m.claim(e)
    _m_refused(m, ValueError, r"fork: parent request_id='e' is 'admitting', must be 'running'",
               lambda: m.fork(e, b), a, b)
    m.alloc(e)
    _m_refused(m, ValueError, r"fork: parent request_id='e' is 'admitting'", lambda: m.fork(e, b), a, b)
    _m_refused(m, ValueError, r"fork: len\(child_ctx\)=25 > max_seq_len=24",
               lambda: m.fork(a, TextContext("b", list(range(6)) + [0] * 19)), a, b)
    c = TextContext("b", list(range(6)) + [5])
    c.skip_processing(2)
    _m_refused(m, ValueError, r"fork: child_ctx.processed_length=2, must be 0 .* or the parent's 6",
               lambda: m.fork(a, c), a, b)
    _m_refused(m, ValueError, r"fork: child_ctx request_id='b' has no token to compute after the parent's "
               r"processed_length=6", lambda: m.fork(a, TextContext("b", list(range(6)))), a, b)
    _m_refused(m, ValueError, r"fork: child_ctx.tokens\[3\]=9 but the parent's tokens\[3\]=3",
               lambda: m.fork(a, TextContext("b", [0, 1, 2, 9, 4, 5, 6])), a, b)
    _m_refused(m, ValueError, r"fork: child_ctx.cache_salt='s' != the parent's None",
               lambda: m.fork(a, TextContext("b", list(range(7)), cache_salt="s")), a, b)
    # no free page for the partial copy: four other pages taken (e holds 2, f 2)
    f = TextContext("f", list(range(50, 58)))
    m.claim(f)
    m.alloc(f)
    assert m.block_count(0).free == 0
    _m_refused(m, InsufficientBlocksError,
               r"fork: request_id='b' needs 1 blocks of leaf 'full', 0 free or evictable on replica 0",
               lambda: m.fork(a, b), a, b)
    m.release(f)
    m.fork(a, b)  # now it fits
    m.check_invariants()
    m.shutdown()
    _m_refused(m, RuntimeError, r"fork: the manager is shut down", lambda: m.fork(a, ok()), a)


@pytest.mark.parametrize("pkg", PKGS)
def test_manager_fork_slab_shortfall_names_the_leaf(pkg):
    m = _mgr(pkg, HYBRID, num_blocks=8, max_seq_len=12)
    a = TextContext("a", list(range(6)))
    _run(m, a, 6, seed=1)
    hogs = []
    for n in (3, 1):  # fill the slab with other requests
        while True:
            h = TextContext(f"h{len(hogs)}", list(range(200 + 10 * len(hogs), 200 + 10 * len(hogs) + n)))
            m.claim(h)
            try:
                m.alloc(h)
            except InsufficientBlocksError:
                m.release(h)
                break
            hogs.append(h)
    b = TextContext("b", list(range(6)) + [5])
    _m_refused(m, InsufficientBlocksError, r"fork: request_id='b' needs 1 blocks of leaf '(full|swa|rec)', "
               r"\d+ free or evictable on replica 0", lambda: m.fork(a, b), a, b)
    for h in hogs:
        m.release(h)
    m.fork(a, b)
    m.check_invariants()
    m.release(a)
    m.release(b)
    m.check_invariants()
    assert m.block_count(0).free == m.block_count(0).total


# =========================================================================== the emulated CUDA device


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("mode", [KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS], ids=["paged", "contiguous"])
def test_fork_on_cuda_matches_kvref(emulated, dtype, mode):
    """kvfast on ``device="cuda"`` (``KVFAST_CUDA_EMULATE=1``, the ``.cu`` copy kernels on the host):
    the same storage bytes, scales, tables and state slabs as kvref after a fork and the child's writes."""
    import dataclasses

    import kvfast.ops
    import kvref.ops
    from kvspec.conformance._compare import to_numpy

    specs = [KVLayerSpec.attention(2, 8), KVLayerSpec.state(conv_dims=(3,), conv_width=2, recurrent=(1, 2, 2))]
    cfg = KVCacheConfig(num_layers=2, max_seqs=3, max_seq_len=16, mode=mode, block_size=P, dtype=dtype)
    fast = kvfast.KVCache.make(dataclasses.replace(cfg, device="cuda"), specs)
    ref = kvref.KVCache.make(cfg, specs)
    rng = np.random.default_rng(30)
    k = rng.standard_normal((6, 2, 8)).astype(np.float32)
    for c, ops in ((fast, kvfast.ops), (ref, kvref.ops)):
        step = c.prepare_step([0, 6], [0], [0])
        ops.append_kv(c, 0, k, -k, step)
        c.update_position(0, 6)
    ref.conv_state(1)[0] = 2.0
    fast.conv_state(1)[0] = 2.0
    for c in (fast, ref):
        c.fork(0, 2)
    for c, ops in ((fast, kvfast.ops), (ref, kvref.ops)):
        step = c.prepare_step([0, 3], [6], [2])
        ops.append_kv(c, 0, 4 * k[:3], k[:3], step)
        c.update_position(2, 9)
    def raw(x):  # the stored bytes (CuPy keeps bfloat16 as uint16 and FP8 as uint8 bit patterns)
        return np.ascontiguousarray(to_numpy(x)).view(np.uint8)

    a, b = cache_snapshot(fast, specs, free_order=False), cache_snapshot(ref, specs, free_order=False)
    for key in b:
        if isinstance(b[key], np.ndarray):
            np.testing.assert_array_equal(raw(a[key]), raw(b[key]), err_msg=key)
        elif isinstance(b[key], tuple):
            for x, y in zip(a[key], b[key]):
                np.testing.assert_array_equal(raw(x), raw(y), err_msg=key)
        else:
            assert a[key] == b[key], key
    assert np.asarray(b["seq_lens"]).tolist() == [6, 0, 9]
    fast.check_invariants()


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_manager_fork_on_cuda_matches_kvref(emulated, dtype):
    """kvfast's manager on ``device="cuda"`` (emulated): the same rows, pages and scales as kvref."""
    from kvspec.conformance._compare import to_numpy

    params = KVCacheParams(page_size=P, num_layers=1, kv_heads=1, head_dim=2, dtype=dtype)
    ms = [pkg.PagedKVCacheManager(params, num_blocks=12, max_batch_size=4, max_seq_len=24, device=dev)
          for pkg, dev in ((kvfast, "cuda"), (kvref, "cpu"))]
    out = []
    for m in ms:
        a = TextContext("a", list(range(6)))
        m.claim(a)
        m.alloc(a)
        row = m.get_req_blocks_per_leaf(a)["full"]
        buf = m.get_device_buffer(0)
        vals = np.arange(2 * 1 * P * 1 * 2, dtype=np.float32).reshape(2, 1, P, 1, 2)
        if dtype != "float32":  # FP8: bit patterns (CuPy holds them as uint8, the CPU as ml_dtypes)
            vals = (vals * 3).astype(np.uint8)
            buf = buf.view(np.uint8) if isinstance(buf, np.ndarray) else buf
        buf[row[1]] = m._engine.to_device(vals)
        if dtype != "float32":
            m.get_device_scales_buffer(0)[row[1]] = 0.25
        a.update(6)
        m.step(a)
        b = TextContext("b", list(range(6)) + [1])
        m.fork(a, b)
        m.check_invariants()
        snap = [m.get_req_blocks_per_leaf(b)["full"],
                np.ascontiguousarray(to_numpy(m.get_device_buffer(0))).view(np.uint8)]
        if dtype != "float32":
            snap.append(to_numpy(m.get_device_scales_buffer(0)).copy())
        out.append(snap)
    assert out[0][0] == out[1][0]
    for x, y in zip(out[0][1:], out[1][1:]):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("pkg", PKGS)
def test_manager_fork_with_tiers_and_speculative_decoding(pkg):
    """A connector (the host tier) and draft slack (spec/manager.md §15) change nothing of the rule: the
    child's rows are ``ceil(processed / page)`` pages and its next ``alloc`` sizes them as any request's."""
    for kw in (dict(host_offload_bytes=1 << 16), dict(speculative_method="eagle", num_draft_tokens=2)):
        m = _mgr(pkg, num_blocks=16, **kw)
        a = TextContext("a", list(range(9)))
        _run(m, a, 9, seed=1)
        assert len(m.get_req_blocks_per_leaf(a)["full"]) >= 3
        b = TextContext("b", list(range(9)) + [3])
        m.fork(a, b)
        assert len(m.get_req_blocks_per_leaf(b)["full"]) == 3
        m.check_invariants()
        _run(m, b, 4, seed=2)
        _run(m, a, 5, seed=3)
        m.poll_transfers()
        m.check_invariants()
        m.release(a)
        m.release(b)
        m.shutdown()
        m.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_retire_checks_a_published_fork_shared_block(pkg):
    c = _cache(pkg, specs=[KVLayerSpec.attention(2, 4)])
    toks = list(range(10, 19))
    _write(pkg, c, [0], 9, seed=40)
    c.fork(0, 1)
    c.retire(0, toks)  # publishes blocks 0 and 1, both shared with slot 1
    bad = toks[:5] + [99] + toks[6:]
    _refused(c, ValueError, r"retire: full_token_ids\[5\]=99 but fork-shared block 1 holds 15",
             lambda: c.retire(1, bad))
    c.retire(1, toks)
    c.check_invariants()
    assert len(c._free_order()) == c.config.resolved_num_blocks - 1
