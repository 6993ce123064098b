"""Conformance of the copy-on-write fork (``spec/slot-cache.md`` §12, ``spec/manager.md`` §19).

Lockstep with kvref (``CachePair``, ``ManagerPair``: the same outcome per call, unchanged state
after every raise, the full observable state compared), plus absolute checks that hold whatever
kvref does: after a fork the child reads the parent's history; writing new tokens into the child
never changes a byte the parent reads (the shared full pages are never written); the releases of
both free every block; prefix hits afterwards are the chains each side published.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvspec import CapacityError, InsufficientBlocksError, KVCacheConfig, KVCacheMode, KVCacheParams, KVLayerSpec
from kvspec import LeafSpec
from kvspec.conformance._compare import assert_same, to_numpy
from kvspec.conformance._harness import CachePair, ManagerPair
from kvspec.conformance.machine import live_kv
from kvspec.conformance.plugin import require

MODES = [pytest.param(KVCacheMode.CONTIGUOUS, id="contiguous"), pytest.param(KVCacheMode.PAGED, id="paged")]
_CAP = {KVCacheMode.CONTIGUOUS: "contiguous", KVCacheMode.PAGED: "paged"}


# =========================================================================== slot cache (spec/slot-cache.md §12)


def _cache_pair(backend, oracle, mode=KVCacheMode.PAGED, *, specs=None, **cfg) -> CachePair:
    require(backend, _CAP[mode])
    kw = dict(max_seqs=3, max_seq_len=16, mode=mode, block_size=4, dtype="float32")
    kw.update(cfg)
    specs = specs or [KVLayerSpec.attention(2, 4)]
    return CachePair(backend, oracle, KVCacheConfig(num_layers=len(specs), **kw), specs)


def _kv_of(p: CachePair, slot: int) -> list:
    """The committed K/V of ``slot`` in every attention layer of the backend, as host copies."""
    n = int(to_numpy(p.sut.seq_lens())[slot])
    return [live_kv(p.sut, l, slot, n) for l, sp in enumerate(p.specs)
            if sp.kind.name in ("ATTENTION", "SLIDING_WINDOW")]


def _assert_prefix(now, then, what: str) -> None:
    for l, ((k, v), (k0, v0)) in enumerate(zip(now, then)):
        n = k0.shape[0]
        assert_same(k0, k[:n], f"{what}: keys of attention layer {l}")
        assert_same(v0, v[:n], f"{what}: values of attention layer {l}")


@pytest.mark.parametrize("mode", MODES)
def test_fork_copies_history_and_child_writes_never_reach_the_parent(kv_backend, kv_oracle, mode):
    p = _cache_pair(kv_backend, kv_oracle, mode, specs=[KVLayerSpec.attention(2, 4), KVLayerSpec.sliding_window(2, 4, 5)])
    p.write(0, 6, seed=1)  # paged: block 0 full, block 1 partial
    parent = _kv_of(p, 0)
    p.ok("cache.fork(0, 2)", lambda c, ops: c.fork(0, 2))
    p.agree()
    assert int(to_numpy(p.sut.seq_lens())[2]) == 6, "fork: seq_lens()[dst] must equal seq_lens()[src]"
    _assert_prefix(_kv_of(p, 2), parent, "the child after fork(0, 2)")
    if mode is KVCacheMode.PAGED:
        t = to_numpy(p.sut.paged_block_table())
        assert t[2, 0] == t[0, 0], f"fork must share the full block: table rows {t[0, :2]} and {t[2, :2]}"
        assert t[2, 1] != t[0, 1], f"fork must copy the partial block: table rows {t[0, :2]} and {t[2, :2]}"
    p.write(2, 5, seed=2)  # the child fills its copied block and takes another
    p.write(2, 1, seed=3)
    p.agree()
    _assert_prefix(_kv_of(p, 0), parent, "the parent after the child wrote")
    _assert_prefix(_kv_of(p, 2), parent, "the child's history")
    child = _kv_of(p, 2)
    p.write(0, 3, seed=4)
    p.agree()
    _assert_prefix(_kv_of(p, 2), child, "the child after the parent wrote")


@pytest.mark.parametrize("mode", MODES)
def test_fork_copies_state_and_cross(kv_backend, kv_oracle, mode):
    require(kv_backend, "state", "cross")
    specs = [KVLayerSpec.attention(1, 2), KVLayerSpec.state(conv_dims=(3,), conv_width=2, recurrent=(1, 2, 2)),
             KVLayerSpec.cross_attention(1, 2, max_enc_len=5)]
    p = _cache_pair(kv_backend, kv_oracle, mode, specs=specs)
    k = np.arange(8, dtype=np.float32).reshape(4, 1, 2)
    p.ok("cache.fill(2, 1, k, -k)", lambda c, ops: c.fill(2, 1, k, -k))
    p.write(1, 5, seed=5)
    p.ok("cache.conv_state(1)[1] = 3.0", lambda c, ops: c.conv_state(1).__setitem__(1, 3.0))
    p.ok("cache.fork(1, 0)", lambda c, ops: c.fork(1, 0))
    p.agree()
    assert_same(to_numpy(p.sut.conv_state(1))[1], to_numpy(p.sut.conv_state(1))[0], "fork: the conv state")
    assert_same(to_numpy(p.sut.keys(2))[1], to_numpy(p.sut.keys(2))[0], "fork: the cross keys")
    step = p.ok("cache.prepare_step([0, 1], [5], [0])", lambda c, ops: c.prepare_step([0, 1], [5], [0]))[1]
    assert to_numpy(step.cross_seqused_k).tolist() == [4], "fork: the encoder length is the source's"


def test_fork_releases_free_everything_and_prefix_hits(kv_backend, kv_oracle):
    p = _cache_pair(kv_backend, kv_oracle, max_seqs=4)
    p.write(0, 6, seed=6)
    p.ok("cache.fork(0, 1)", lambda c, ops: c.fork(0, 1))
    p.write(0, 2, seed=7)
    p.write(1, 3, seed=8)
    a = list(range(10, 16))
    pa, pb = a + [20, 21], a + [30, 31, 32]
    p.ok(f"cache.retire(0, {pa})", lambda c, ops: c.retire(0, pa))
    p.ok(f"cache.retire(1, {pb})", lambda c, ops: c.retire(1, pb))
    p.agree()
    if kv_backend.supports("strict_block_ids"):
        free = p.sut._free_order()
        assert len(free) == p.config.resolved_num_blocks - 1, f"after both releases {len(free)} blocks are free"
    for slot, toks in ((2, pa + [1]), (3, pb + [1])):
        hit = p.ok(f"cache.admit({slot}, {toks})", lambda c, ops: c.admit(slot, toks))[1]
        assert hit == 8, f"admit of a forked continuation: hit={hit}, want 8 (the shared block and its own)"
    t = to_numpy(p.sut.paged_block_table())
    assert t[2, 0] == t[3, 0] and t[2, 1] != t[3, 1], f"hits must share block 0 only: {t[2, :2]}, {t[3, :2]}"
    p.agree()


def test_fork_rollback_floor_and_errors(kv_backend, kv_oracle):
    p = _cache_pair(kv_backend, kv_oracle, num_blocks=5)
    p.write(0, 9, seed=9)  # three of the four blocks
    p.raises("cache.fork(0, 0)", lambda c, ops: c.fork(0, 0), ValueError)
    p.raises("cache.fork(0, 3)", lambda c, ops: c.fork(0, 3), IndexError)
    p.raises("cache.fork('0', 1)", lambda c, ops: c.fork("0", 1), TypeError)
    p.write(1, 1, seed=10)
    p.raises("cache.fork(0, 1)  # not empty", lambda c, ops: c.fork(0, 1), ValueError)
    p.ok("cache.evict_batch(1)", lambda c, ops: c.evict_batch(1))
    p.ok("cache.fork(0, 1)", lambda c, ops: c.fork(0, 1))  # takes the last block for the copy
    for slot in (0, 1):
        p.raises(f"cache.update_position({slot}, 7)  # into a shared block",
                 lambda c, ops: c.update_position(slot, 7), ValueError)
    p.ok("cache.evict_batch(1)", lambda c, ops: c.evict_batch(1))
    p.write(2, 4, seed=11)  # the last block again
    p.raises("cache.fork(0, 1)  # no block for the partial copy", lambda c, ops: c.fork(0, 1), CapacityError)
    p.agree()


@pytest.mark.parametrize("mode", MODES)
def test_fork_fp8_scales(kv_backend, kv_oracle, mode):
    require(kv_backend, "slot_fp8")
    p = _cache_pair(kv_backend, kv_oracle, mode, dtype="float8_e4m3fn")
    p.write(0, 6, seed=12)
    parent = _kv_of(p, 0)
    p.ok("cache.fork(0, 1)", lambda c, ops: c.fork(0, 1))
    p.write(1, 2, seed=13)
    p.agree()
    ref = [tuple(to_numpy(x) for x in p.oracle.ops.gather_kv(p.ref, 0, 0))]
    sut = [tuple(to_numpy(x) for x in p.backend.ops.gather_kv(p.sut, 0, 0))]
    assert_same(ref, sut, "gather_kv of the parent after the child wrote")
    assert parent[0][0].shape[0] == 6


# =========================================================================== manager (spec/manager.md §19)


def _mgr_pair(backend, oracle, *, leaves=None, num_blocks=12, **params) -> ManagerPair:
    require(backend, "manager", "prefix_caching")
    if leaves is not None:
        require(backend, "recurrent_leaf")
    kw = dict(page_size=4, num_layers=1, kv_heads=1, head_dim=2, dtype="float32", leaves=leaves)
    kw.update(params)
    return ManagerPair(backend, oracle, KVCacheParams(**kw), num_blocks=num_blocks, max_batch_size=4,
                       max_seq_len=16)


def _full_buffer(m):
    buf = m.get_device_buffer(0)
    return to_numpy(buf["full"] if isinstance(buf, dict) else buf)


def _read(m, ctx) -> np.ndarray:
    """The K/V bytes of the full leaf a request reads: positions ``[0, processed_length)``."""
    row = m.get_req_blocks_per_leaf(ctx)["full"]
    buf, page = _full_buffer(m), m.params.page_size
    return np.stack([buf[row[q // page], :, :, q % page] for q in range(ctx.processed_length)]).copy()


HYBRID = {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(5), "rec": LeafSpec.recurrent((2, 2))}


@pytest.mark.parametrize("leaves", [None, HYBRID], ids=["full", "full+swa+rec"])
def test_manager_fork_copy_on_write(kv_backend, kv_oracle, leaves):
    p = _mgr_pair(kv_backend, kv_oracle, leaves=leaves)
    p.new("a", list(range(100, 109)))
    p.ok("manager.claim(ctx_a)", lambda m, cs: m.claim(cs["a"]))
    p.forward("a", 7, seed=1)
    p.forward("a", 8, seed=2)  # processed 10: pages 0, 1 full, page 2 partial
    parent = _read(p.sut, p.ctx_sut["a"])
    p.new("b", list(range(100, 109)) + [7, 55])
    p.ok("manager.fork(ctx_a, ctx_b)", lambda m, cs: m.fork(cs["a"], cs["b"]))
    p.agree()
    ra, rb = (p.sut.get_req_blocks_per_leaf(p.ctx_sut[r])["full"] for r in "ab")
    assert rb[:2] == ra[:2] and rb[2] != ra[2], f"fork must share full pages and copy the partial one: {ra} {rb}"
    assert p.ctx_sut["b"].processed_length == 10, "fork: the child's processed_length is the parent's"
    assert_same(parent, _read(p.sut, p.ctx_sut["b"]), "the child reads the parent's K/V after fork")
    for i in range(3):
        p.forward("b", 60 + i, seed=10 + i)
    p.forward("a", 9, seed=20)
    p.agree()
    assert_same(parent, _read(p.sut, p.ctx_sut["a"])[:10], "the parent's K/V after the child wrote")
    assert_same(parent, _read(p.sut, p.ctx_sut["b"])[:10], "the child's history")
    p.ok("manager.release(ctx_a)", lambda m, cs: m.release(cs["a"]))
    p.ok("manager.release(ctx_b)", lambda m, cs: m.release(cs["b"]))
    p.agree()
    bc = p.sut.block_count(0)
    assert bc.free == bc.total, f"after both releases block_count={bc}, every page must be free"


def test_manager_fork_prefix_hits_afterwards(kv_backend, kv_oracle):
    p = _mgr_pair(kv_backend, kv_oracle)
    p.new("a", list(range(6)))
    p.ok("manager.claim(ctx_a)", lambda m, cs: m.claim(cs["a"]))
    p.forward("a", 6, seed=1)
    p.new("b", list(range(6)) + [40])
    p.ok("manager.fork(ctx_a, ctx_b)", lambda m, cs: m.fork(cs["a"], cs["b"]))
    p.forward("a", 7, seed=2)
    p.forward("a", 8, seed=3)
    p.forward("b", 41, seed=4)
    p.forward("b", 42, seed=5)
    p.agree()
    ra, rb = (p.sut.get_req_blocks_per_leaf(p.ctx_sut[r])["full"] for r in "ab")
    p.ok("manager.release(ctx_a)", lambda m, cs: m.release(cs["a"]))
    p.ok("manager.release(ctx_b)", lambda m, cs: m.release(cs["b"]))
    for rid, toks, want in (("c", [0, 1, 2, 3, 4, 5, 6, 7, 1], ra[:2]), ("d", [0, 1, 2, 3, 4, 5, 40, 41, 1], rb[:2])):
        p.new(rid, toks)
        p.ok(f"manager.claim(ctx_{rid})", lambda m, cs: m.claim(cs[rid]))
        p.ok(f"manager.alloc(ctx_{rid})", lambda m, cs: m.alloc(cs[rid]).is_complete())
        got = p.sut.get_req_blocks_per_leaf(p.ctx_sut[rid])["full"]
        assert p.ctx_sut[rid].processed_length == 8, f"{rid}: hit {p.ctx_sut[rid].processed_length} tokens, want 8"
        if p.strict:
            assert got[:2] == want, f"{rid}: hit pages {got[:2]}, want the forked chain's {want}"
        p.ok(f"manager.release(ctx_{rid})", lambda m, cs: m.release(cs[rid]))
    p.agree()


def test_manager_fork_errors(kv_backend, kv_oracle):
    p = _mgr_pair(kv_backend, kv_oracle, num_blocks=7)
    p.new("a", list(range(6)))
    p.new("b", list(range(6)) + [5])
    p.new("x", [1, 2])
    p.new("wrong", [0, 1, 2, 9, 4, 5, 6])
    p.raises("manager.fork(ctx_x, ctx_b)  # unclaimed parent", lambda m, cs: m.fork(cs["x"], cs["b"]), ValueError)
    p.ok("manager.claim(ctx_a)", lambda m, cs: m.claim(cs["a"]))
    p.raises("manager.fork(ctx_a, ctx_b)  # admitting", lambda m, cs: m.fork(cs["a"], cs["b"]), ValueError)
    p.forward("a", 6, seed=1)
    p.raises("manager.fork(ctx_a, 'b')", lambda m, cs: m.fork(cs["a"], "b"), TypeError)
    p.raises("manager.fork(ctx_a, ctx_wrong)  # other tokens", lambda m, cs: m.fork(cs["a"], cs["wrong"]),
             ValueError)
    p.raises("manager.fork(ctx_a, ctx_a)  # claimed", lambda m, cs: m.fork(cs["a"], cs["a"]), ValueError)
    p.new("f", list(range(50, 66)))  # 16 tokens: the four other pages
    p.ok("manager.claim(ctx_f)", lambda m, cs: m.claim(cs["f"]))
    p.ok("manager.alloc(ctx_f)", lambda m, cs: m.alloc(cs["f"]).is_complete())
    msg = p.raises("manager.fork(ctx_a, ctx_b)  # no page for the partial copy",
                   lambda m, cs: m.fork(cs["a"], cs["b"]), InsufficientBlocksError)
    assert msg.startswith("fork: request_id='b' needs 1 blocks of leaf 'full'"), msg
    p.ok("manager.release(ctx_f)", lambda m, cs: m.release(cs["f"]))
    p.ok("manager.fork(ctx_a, ctx_b)", lambda m, cs: m.fork(cs["a"], cs["b"]))
    p.agree()
    b = p.ctx_sut["b"]
    assert (b.processed_length, b.active_length) == (6, 1), f"the child after fork: {b!r}"
    p.new("c", list(range(6)) + [5])
    p.ok("manager.fork(ctx_b, ctx_c)  # a child forks like any running request",
         lambda m, cs: m.fork(cs["b"], cs["c"]))
    p.agree()
