"""A claimed request never rewinds into its published pages (spec/manager.md §11.21).

Its next forward would overwrite K/V that other requests may share (wrong K/V
for them), so ``alloc`` refuses it with ``ValueError``, state unchanged, in
every path of both packages: kvref's policy, kvfast's decode lane and its
admission lane.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvfast
import kvref
from kvspec import KVCacheParams, TextContext

PKGS = [kvref, kvfast]


def _manager(pkg, **kw):
    params = KVCacheParams(page_size=4, num_layers=1, kv_heads=1, head_dim=2, **kw)
    return pkg.PagedKVCacheManager(params, num_blocks=16, max_batch_size=2, max_seq_len=32)


def _state(m, ctx):
    return (m.get_req_blocks_per_leaf(ctx), m.block_count(0), m._free_order(0),
            m.get_metrics_aggregated(), ctx.processed_length, ctx.active_length)


def _published(pkg, **kw):
    """A request with two published pages (8 tokens processed) and one decode token."""
    m = _manager(pkg, **kw)
    ctx = TextContext("a", np.arange(10, dtype=np.int64))
    m.claim(ctx)
    m.alloc(ctx)
    ctx.update(99)
    m.step(ctx)
    return m, ctx


@pytest.mark.parametrize("pkg", PKGS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("rewind", ["reset", "rewind_processing"])
def test_rewind_into_published_pages_is_refused(pkg, rewind):
    m, ctx = _published(pkg)
    assert m.get_prefix_cache_hit_counts(TextContext("probe", np.arange(10)))[0].device_blocks == 2
    if rewind == "reset":
        ctx.reset()
    else:
        ctx.rewind_processing(ctx.processed_length - 1)  # back into page 0
    before = _state(m, ctx)
    with pytest.raises(ValueError, match=r"processed_length=\d+ < 8 tokens already published"):
        m.alloc(ctx)
    assert _state(m, ctx) == before
    m.release(ctx)  # the scheduler's way out: release, reset, claim again
    ctx.reset()
    m.claim(ctx)
    m.alloc(ctx)
    assert ctx.cached_prefix_length == 8


@pytest.mark.parametrize("pkg", PKGS, ids=lambda p: p.__name__)
def test_rewind_within_unpublished_tokens_is_allowed(pkg):
    m, ctx = _published(pkg)
    m.alloc(ctx)
    ctx.update(7)  # processed 11: still two published pages (8 tokens)
    m.step(ctx)
    ctx.rewind_processing(1)  # back to 10, above the 8 published tokens
    assert ctx.processed_length == 10
    m.alloc(ctx)  # accepted


@pytest.mark.parametrize("pkg", PKGS, ids=lambda p: p.__name__)
def test_rewind_is_refused_with_a_host_tier(pkg):
    m, ctx = _published(pkg, host_offload_bytes=1 << 16)
    try:
        ctx.reset()
        with pytest.raises(ValueError, match="already published"):
            m.alloc(ctx)
    finally:
        m.shutdown()
