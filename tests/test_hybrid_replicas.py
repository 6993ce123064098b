"""Cross-replica prefix copy for every leaf kind (spec/manager.md §7.3), byte for byte.

A prompt served on replica 0 is admitted on replica 1: full pages of every
hit block, the sliding window's pages and the recurrent checkpoint come from
replica 0 (copied, published locally, counted), and hold exactly what the
model wrote; both packages agree.
"""

from __future__ import annotations

import numpy as np
import pytest
from _hybrid_model import HYBRIDS, check_hit_bytes, flush, forward, serve

import kvfast
import kvref
from kvspec import KVCacheParams, LeafKind, LeafSpec, PrefixCacheHits, TextContext

PAGE = 4
PROMPT = np.arange(200, 233, dtype=np.int32)  # 33 tokens: 8 hashed blocks, checkpoint at 32
PKGS = pytest.mark.parametrize("pkg", [kvref, kvfast], ids=["kvref", "kvfast"])
CONFIGS = pytest.mark.parametrize("config", sorted(HYBRIDS) + ["sliding", "full+sliding+recurrent"])
LEAVES = {**HYBRIDS, "sliding": {"swa": LeafSpec.sliding_window(6)},
          "full+sliding+recurrent": {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(5),
                                     "rec": LeafSpec.recurrent((2, 3))}}


def manager(pkg, config, *, dp=2, num_blocks=24, allocate_buffers=True):
    p = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, dtype="float32",
                      leaves=LEAVES[config], data_parallel_degree=dp, allocate_buffers=allocate_buffers)
    return pkg.PagedKVCacheManager(p, num_blocks=num_blocks, max_batch_size=2, max_seq_len=40)


def copies_expected(m, config, k):
    """(pages, bytes) a copy of a ``k``-block hit moves: full pages of every block, the sliding
    window's pages, one recurrent state."""
    pages = nbytes = 0
    for lid, spec in LEAVES[config].items():
        if spec.kind is LeafKind.RECURRENT:
            pages, nbytes = pages + 1, nbytes + m.params.page_bytes(lid)
            continue
        n = k if spec.kind is LeafKind.FULL else min(k, -(-(spec.window - 1) // PAGE))
        pages, nbytes = pages + n, nbytes + n * m.params.kv_page_bytes
    return pages, nbytes


@PKGS
@CONFIGS
def test_peer_held_prefix_is_copied_for_every_leaf(pkg, config):
    m = manager(pkg, config)
    serve(m, TextContext("a", PROMPT), 0)
    m.check_invariants()
    hits = m.get_prefix_cache_hit_counts(TextContext("x", PROMPT))
    assert hits == [PrefixCacheHits(8, 0), PrefixCacheHits(8, 0)], "a peer-held prefix counts on replica 1"
    ctx = TextContext("b", PROMPT)
    m.claim(ctx, 1)
    m.alloc(ctx)
    assert ctx.cached_prefix_length == 32 and ctx.cached_prefix_external_length == 0
    check_hit_bytes(m, ctx, 1)  # every copied page (and the recurrent state) byte for byte
    got = m.get_metrics_aggregated()
    assert (got.cross_replica_blocks_copied, got.cross_replica_bytes_copied) == copies_expected(m, config, 8)
    assert got.device_blocks_served == 8
    m.check_invariants()
    forward(m, ctx, 1)
    m.release(ctx)
    m.check_invariants()
    # full/sliding copies were published on replica 1: a third request there takes them locally;
    # a recurrent state went into the live page (not a checkpoint of replica 1), so it is copied again
    again = TextContext("c", PROMPT)
    m.claim(again, 1)
    m.alloc(again)
    assert again.cached_prefix_length == 32
    rec = sum(spec.kind is LeafKind.RECURRENT for spec in LEAVES[config].values())
    assert m.get_metrics_aggregated().cross_replica_blocks_copied == got.cross_replica_blocks_copied + rec
    check_hit_bytes(m, again, 1)
    m.release(again)
    m.check_invariants()


@PKGS
def test_copy_only_what_the_replica_lacks(pkg):
    """Replica 1 still holds the first blocks (a shorter prompt served there): those are taken
    locally, only the rest is copied."""
    config = "full+sliding"
    m = manager(pkg, config)
    serve(m, TextContext("a", PROMPT), 0)
    serve(m, TextContext("s", PROMPT[:13]), 1)  # 3 full blocks published on replica 1
    before = m.get_metrics_aggregated().cross_replica_blocks_copied
    ctx = TextContext("b", PROMPT)
    m.claim(ctx, 1)
    m.alloc(ctx)
    assert ctx.cached_prefix_length == 32
    # full: blocks 3..7 copied (5), sliding: the window block 7 (1)
    assert m.get_metrics_aggregated().cross_replica_blocks_copied - before == 6
    check_hit_bytes(m, ctx, 1)
    m.check_invariants()
    m.release(ctx)


@PKGS
def test_copies_that_do_not_fit_leave_the_local_hit(pkg):
    """Best effort, all or nothing: with no room on replica 1 for the copies, the hit is the
    local one (here none) and the alloc still succeeds when the growth alone fits."""
    config = "full+sliding"
    m = manager(pkg, config, num_blocks=24)
    serve(m, TextContext("a", PROMPT), 0)
    # fill replica 1 so that only the pages of one fresh 33-token request fit
    hogs = []
    while True:
        c = TextContext(f"h{len(hogs)}", np.full(PAGE, 5000 + len(hogs), dtype=np.int32))
        m.claim(c, 1)
        try:
            m.alloc(c)
        except Exception:
            m.release(c)
            break
        hogs.append(c)
    ctx = TextContext("b", PROMPT)
    m.claim(ctx, 1)
    with pytest.raises(kvref.InsufficientBlocksError):
        m.alloc(ctx)  # not even the growth fits: raises, nothing drawn, nothing copied
    assert m.get_metrics_aggregated().cross_replica_blocks_copied == 0
    assert ctx.processed_length == 0
    m.check_invariants()
    for c in hogs:
        m.release(c)
    m.alloc(ctx)
    assert ctx.cached_prefix_length == 32
    check_hit_bytes(m, ctx, 1)
    m.check_invariants()


@PKGS
def test_recurrent_hit_stops_at_the_deepest_checkpoint_any_replica_holds(pkg):
    config = "full+recurrent"
    m = manager(pkg, config)
    serve(m, TextContext("a", PROMPT[:21]), 0)  # checkpoint at 20 tokens on replica 0 only
    ctx = TextContext("b", PROMPT)
    m.claim(ctx, 1)
    m.alloc(ctx)
    assert ctx.cached_prefix_length == 20  # full blocks 0..4 and the state after 20 tokens
    check_hit_bytes(m, ctx, 1)
    m.check_invariants()


def test_bookkeeping_only_copies_are_counted_the_same():
    out = []
    for allocate in (True, False):
        m = manager(kvref, "full+sliding+recurrent", allocate_buffers=allocate)
        ctx = TextContext("a", PROMPT)
        m.claim(ctx, 0)
        ctx.chunk(32)
        m.alloc(ctx)
        m.runtime_inputs([[ctx], []])
        ctx.advance_chunk()
        m.step(ctx)
        m.release(ctx)
        b = TextContext("b", PROMPT)
        m.claim(b, 1)
        m.alloc(b)
        out.append((b.cached_prefix_length, m.get_req_blocks_per_leaf(b), m.get_metrics_aggregated()))
        m.check_invariants()
    assert out[0] == out[1]


def test_both_packages_agree():
    seen = {}
    for pkg in (kvref, kvfast):
        m = manager(pkg, "full+sliding+recurrent")
        serve(m, TextContext("a", PROMPT), 0)
        ctx = TextContext("b", PROMPT)
        m.claim(ctx, 1)
        m.alloc(ctx)
        seen[pkg.__name__] = (ctx.cached_prefix_length, m.get_req_blocks_per_leaf(ctx),
                              m.get_metrics_aggregated(), m._free_order(1, "full"))
    assert seen["kvref"] == seen["kvfast"]


def test_flush_helper_evicts_peer_copies_too():
    """After the peer's pages are evicted there is nothing to copy: the hit is 0 (sanity of the
    tests above: hits really come from the peer)."""
    m = manager(kvref, "full+sliding")
    serve(m, TextContext("a", PROMPT), 0)
    flush(m, 0)
    assert m.get_prefix_cache_hit_counts(TextContext("x", PROMPT)) == [PrefixCacheHits(0, 0)] * 2
