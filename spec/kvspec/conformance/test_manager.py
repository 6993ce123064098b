"""Method-level conformance tests of ``PagedKVCacheManager`` (DESIGN §5).

Lockstep with kvref through ``ManagerPair``; absolute checks pin the spec's
numbers (reuse of ``(len - 1) // page`` blocks, tail-first release, null
padding, publish only after an onload lands).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvspec import InsufficientBlocksError, KVCacheParams, PrefixCacheHits, TextContext
from kvspec.conformance._compare import assert_same, to_numpy
from kvspec.conformance._harness import ManagerPair, ManualConnector
from kvspec.conformance.plugin import require
from kvspec.conformance.manager_machine import forward_values


def _pair(backend, oracle, *, connectors=(None, None), page=2, num_blocks=12, max_seq_len=None, **params):
    require(backend, "manager")
    kw = dict(page_size=page, num_layers=1, kv_heads=1, head_dim=2, dtype="float32")
    kw.update(params)
    if max_seq_len is None:  # spec/manager.md §1.6: at most what the pool holds
        max_seq_len = min(16, (num_blocks - 1) * page)
    return ManagerPair(backend, oracle, KVCacheParams(**kw), connectors=connectors,
                       num_blocks=num_blocks, max_batch_size=4, max_seq_len=max_seq_len)


def _hits(p, tokens, rid="probe"):
    return p.ok(f"manager.get_prefix_cache_hit_counts(TextContext({rid!r}, {tokens}))",
                lambda m, cs: m.get_prefix_cache_hit_counts(TextContext(rid, np.array(tokens, np.int32))))[1]


def test_claim_alloc_release_errors(kv_backend, kv_oracle):
    p = _pair(kv_backend, kv_oracle, max_seq_len=8)
    p.new("a", [1, 2, 3])
    p.new("long", list(range(9)))
    p.raises("manager.alloc(ctx_a)  # unclaimed", lambda m, cs: m.alloc(cs["a"]), ValueError)
    p.raises("manager.step(ctx_a)  # unclaimed", lambda m, cs: m.step(cs["a"]), ValueError)
    p.raises("manager.release(ctx_a)  # unclaimed", lambda m, cs: m.release(cs["a"]), ValueError)
    p.raises("manager.claim(ctx_a, 1)  # replica", lambda m, cs: m.claim(cs["a"], 1), IndexError)
    p.raises("manager.claim(ctx_long)  # > max_seq_len", lambda m, cs: m.claim(cs["long"]), ValueError)
    p.raises("manager.claim('a')  # not a context", lambda m, cs: m.claim("a"), TypeError)
    p.ok("manager.claim(ctx_a)", lambda m, cs: m.claim(cs["a"]))
    assert p.sut.contains(p.ctx_sut["a"]) and p.sut.contains("a"), "contains() after claim"
    p.raises("manager.claim(ctx_a)  # twice", lambda m, cs: m.claim(cs["a"]), ValueError)
    p.raises("manager.block_count(1)", lambda m, cs: m.block_count(1), IndexError)
    p.ok("manager.release(ctx_a)", lambda m, cs: m.release(cs["a"]))
    p.raises("manager.release(ctx_a)  # twice", lambda m, cs: m.release(cs["a"]), ValueError)
    p.agree()


def test_alloc_sizes_rows_and_counts(kv_backend, kv_oracle):
    p = _pair(kv_backend, kv_oracle, page=4, num_blocks=10)
    p.new("a", [5, 6, 7])
    p.ok("manager.claim(ctx_a)", lambda m, cs: m.claim(cs["a"]))
    p.ok("manager.alloc(ctx_a)", lambda m, cs: m.alloc(cs["a"]).is_complete())
    rows = p.sut.get_req_blocks_per_leaf(p.ctx_sut["a"])
    assert list(rows) == ["full"] and len(rows["full"]) == 1, f"rows={rows}, a 3-token prompt of page 4 holds 1 block"
    assert_same(p.ref.block_count(), p.sut.block_count(), "block_count()")
    assert p.sut.block_count().total == 9 and p.sut.block_count().free == 8, f"block_count()={p.sut.block_count()}"
    assert p.sut.get_metrics_aggregated().input_tokens == 3, "input_tokens after one alloc of 3 tokens"
    p.agree()


def test_repeat_prompt_reuses_all_but_the_last_token(kv_backend, kv_oracle):
    """DESIGN §5: only full blocks are hashed and never the last token, so a
    repeat of an 8-token prompt (page 2) reuses (8 - 1) // 2 = 3 blocks."""
    require(kv_backend, "prefix_caching")
    p = _pair(kv_backend, kv_oracle)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    p.new("a", prompt)
    p.ok("manager.claim(ctx_a)", lambda m, cs: m.claim(cs["a"]))
    p.forward("a", token=9, seed=3)
    p.ok("manager.release(ctx_a)", lambda m, cs: m.release(cs["a"]))
    hits = _hits(p, prompt)
    assert hits == [PrefixCacheHits(3, 0)], f"get_prefix_cache_hit_counts={hits}, expected [PrefixCacheHits(3, 0)]"
    p.new("b", prompt)
    p.ok("manager.claim(ctx_b)", lambda m, cs: m.claim(cs["b"]))
    p.ok("manager.alloc(ctx_b)", lambda m, cs: m.alloc(cs["b"]).is_complete())
    b = p.ctx_sut["b"]
    assert (b.processed_length, b.active_length, b.cached_prefix_length) == (6, 2, 6), (
        f"after a repeat: processed={b.processed_length} active={b.active_length} cached={b.cached_prefix_length}, expected (6, 2, 6)"
    )
    m = p.sut.get_metrics_aggregated()
    assert (m.cache_tokens, m.input_tokens) == (6, 10), f"metrics cache_tokens={m.cache_tokens} input_tokens={m.input_tokens}"
    p.agree()


def test_alloc_is_atomic(kv_backend, kv_oracle):
    p = _pair(kv_backend, kv_oracle, num_blocks=5)
    p.new("a", [1, 2, 3, 4, 5])
    p.new("b", [9, 9, 9, 9])
    p.ok("manager.claim(ctx_a)", lambda m, cs: m.claim(cs["a"]))
    p.ok("manager.alloc(ctx_a)", lambda m, cs: m.alloc(cs["a"]).is_complete())
    p.ok("manager.claim(ctx_b)", lambda m, cs: m.claim(cs["b"]))
    p.raises("manager.alloc(ctx_b)  # 2 blocks, 1 free", lambda m, cs: m.alloc(cs["b"]), InsufficientBlocksError)
    p.ok("manager.release(ctx_a)", lambda m, cs: m.release(cs["a"]))
    p.ok("manager.alloc(ctx_b)  # fits now", lambda m, cs: m.alloc(cs["b"]).is_complete())
    p.agree()


def test_release_is_tail_first(kv_backend, kv_oracle):
    """DESIGN §5: release frees tail first, so pool pressure evicts a chain's
    tail while its head stays hittable."""
    require(kv_backend, "prefix_caching")
    p = _pair(kv_backend, kv_oracle, num_blocks=5)
    prompt = [1, 1, 2, 2, 3, 3, 4]
    p.new("a", prompt)
    p.ok("manager.claim(ctx_a)", lambda m, cs: m.claim(cs["a"]))
    p.forward("a", token=5, seed=1)
    p.ok("manager.release(ctx_a)", lambda m, cs: m.release(cs["a"]))
    p.new("x", [8, 8, 8])
    p.ok("manager.claim(ctx_x)", lambda m, cs: m.claim(cs["x"]))
    p.ok("manager.alloc(ctx_x)  # evicts one published block", lambda m, cs: m.alloc(cs["x"]).is_complete())
    hits = _hits(p, prompt)
    assert hits == [PrefixCacheHits(2, 0)], f"hits={hits} after evicting one block, expected 2: the tail goes first"
    p.agree()


def test_runtime_inputs_pad_with_the_null_block(kv_backend, kv_oracle):
    p = _pair(kv_backend, kv_oracle)
    p.new("a", [1, 2, 3, 4, 5, 6, 7])
    p.new("b", [4, 4])
    for rid in ("a", "b"):
        p.ok(f"manager.claim(ctx_{rid})", lambda m, cs, rid=rid: m.claim(cs[rid]))
        p.ok(f"manager.alloc(ctx_{rid})", lambda m, cs, rid=rid: m.alloc(cs[rid]).is_complete())
    r, s = p.ok("manager.runtime_inputs([[ctx_a, ctx_b]])", lambda m, cs: m.runtime_inputs([[cs["a"], cs["b"]]]))
    got = s.inputs[0]
    lut = to_numpy(got.lookup_table)
    assert lut.dtype == np.uint32 and lut.shape[0] == 2 and lut.shape[1] % 8 == 0, f"lookup_table {lut.dtype} {lut.shape}"
    rows = {rid: p.sut.get_req_blocks_per_leaf(p.ctx_sut[rid])["full"] for rid in ("a", "b")}
    for i, rid in enumerate(("a", "b")):
        n = len(rows[rid])
        assert lut[i, :n].tolist() == rows[rid], f"lookup_table[{i}, :{n}]={lut[i, :n].tolist()}, rows {rows[rid]}"
        assert not lut[i, n:].any(), f"lookup_table[{i}, {n}:]={lut[i, n:].tolist()}, must be the null block 0"
    assert_same(np.array([0, 0], np.uint32), got.cache_lengths, "cache_lengths")
    if kv_backend.supports("strict_block_ids"):
        assert_same(r.inputs[0].lookup_table, got.lookup_table, "lookup_table")
    p.raises("manager.runtime_inputs([[ctx_a], []])", lambda m, cs: m.runtime_inputs([[cs["a"]], []]), ValueError)
    p.raises("manager.runtime_inputs(max_cache_length=0)",
             lambda m, cs: m.runtime_inputs([[cs["a"]]], max_cache_length=0), ValueError)
    p.agree()


@pytest.mark.kv_requires("manager", "tiers", "prefix_caching")
def test_onload_published_only_after_it_lands(kv_backend, kv_oracle):
    """DESIGN §5 / manager note §9: a page loaded from a tier is published (hittable
    from the device) only once its transfer has landed; before that a probe
    sees it as external, and after landing its bytes are the offloaded ones."""
    conns = (ManualConnector(), ManualConnector())
    p = _pair(kv_backend, kv_oracle, connectors=conns, num_blocks=12)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    p.new("a", prompt)
    p.ok("manager.claim(ctx_a)", lambda m, cs: m.claim(cs["a"]))
    p.forward("a", token=0, seed=21)
    p.ok("manager.poll_transfers()  # posts the offload", lambda m, cs: m.poll_transfers())
    assert len(conns[1].store) == 4, f"connector holds {len(conns[1].store)} blocks after the offload, expected 4"
    p.ok("manager.release(ctx_a)", lambda m, cs: m.release(cs["a"]))
    p.ok("manager.reset_prefix_cache()", lambda m, cs: m.reset_prefix_cache())
    assert _hits(p, prompt) == [PrefixCacheHits(0, 4)], "before the load: the tier holds 4 blocks, the device none"
    p.new("b", prompt)
    p.ok("manager.claim(ctx_b)", lambda m, cs: m.claim(cs["b"]))
    done = p.ok("manager.alloc(ctx_b)", lambda m, cs: m.alloc(cs["b"]).is_complete())[1]
    assert done is False, "the load has not landed, alloc must hand back an incomplete transfer"
    hits = _hits(p, prompt)
    assert hits[0].device_blocks == 0, f"hits={hits}: pages published before their onload landed"
    for c in conns:
        c.land()
    p.ok("manager.poll_transfers()  # lands the load", lambda m, cs: m.poll_transfers())
    assert _hits(p, prompt)[0].device_blocks == 4, "after landing the 4 loaded pages are device hits"
    rows = p.sut.get_req_blocks_per_leaf(p.ctx_sut["b"])["full"]
    buf = to_numpy(p.sut.get_device_buffer(0))
    want = forward_values(9, p.params, 21)
    for pos in range(8):
        assert_same(want[pos], buf[rows[pos // 2], :, :, pos % 2], f"K/V of position {pos} after the onload")
    p.agree()
