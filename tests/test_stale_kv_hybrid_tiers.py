"""Wrong or stale K/V of hybrid managers across replicas and tiers, with speculative decoding and
FP8 (spec/manager.md §7.3, §9.8, §15, §16; spec/tiers.md §12), kvref and kvfast.

A request decodes speculatively on one replica (rejected drafts land past ``processed_length``,
some across page boundaries); the same prefix is then admitted on the other replica (peer copy of
values, scales and the recurrent checkpoint) and, after both device caches are dropped, from the
host tier. Every page the new request's lookup table binds up to ``cache_lengths`` holds the
bytes the model wrote for its verified tokens (``test_stale_kv_spec_decode``'s prefix-dependent
model), in both packages.
"""

from __future__ import annotations

import numpy as np
import pytest
from _fault_connector import settle_manager
from kvspec import KVCacheParams, LeafSpec, TextContext
from test_stale_kv_spec_decode import (
    PS,
    K,
    check_inputs,
    next_drafts,
    published_ok,
    register,
    verify,
    write_forward,
    write_state,
)

import kvfast
import kvref

PKGS = [kvref, kvfast]
IDS = ["kvref", "kvfast"]
LEAVES = {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(3), "rec": LeafSpec.recurrent((2, 3))}


def _manager(pkg, dtype, **kw):
    p = KVCacheParams(page_size=PS, num_layers=1, kv_heads=2, head_dim=2, dtype=dtype, leaves=LEAVES,
                      data_parallel_degree=2, speculative_method="eagle", num_draft_tokens=K)
    return pkg.PagedKVCacheManager(p, num_blocks=48, max_batch_size=2, max_seq_len=16, **kw)


def _decode(m, ctx, r, prefixes, rights, *, release=True):
    """Serve ``ctx`` on replica ``r``: each forward checked, then verify drafts chosen by ``rights``."""
    m.claim(ctx, r)
    for right in rights:
        m.alloc(ctx).synchronize()
        m.poll_transfers()
        drafts = list(ctx.spec_decoding_state.draft_tokens_to_verify)
        batches = [[], []]
        batches[r] = [ctx]
        check_inputs(m, ctx, m.runtime_inputs(batches), r)
        write_forward(m, ctx, drafts, r)
        verify(ctx, drafts)
        write_state(m, ctx, r)
        ctx.spec_decoding_state.draft_tokens_to_verify = next_drafts(ctx, right)
        m.step(ctx)
        register(prefixes, ctx.tokens)
        published_ok(m, prefixes, r)
    if release:
        m.release(ctx)


RIGHTS = [[True, False], [False, False], [True, True], [True, False], [False, True], [True, True]]


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3fn"])
@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_peer_copy_after_speculation_serves_the_verified_bytes(pkg, dtype):
    m = _manager(pkg, dtype)
    prefixes: dict = {}
    a = TextContext("a", np.array([0, 1, 2, 0, 2], dtype=np.int32))
    _decode(m, a, 0, prefixes, RIGHTS)
    tokens = np.array(a.tokens, dtype=np.int32)
    b = TextContext("b", tokens)
    m.claim(b, 1)
    m.alloc(b)
    assert b.cached_prefix_length > 0 and m.get_metrics_aggregated().cross_replica_blocks_copied > 0
    assert check_inputs(m, b, m.runtime_inputs([[], [b]]), 1) > 0
    published_ok(m, prefixes, 1)
    m.release(b)
    m.check_invariants()


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3fn"])
@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_tier_reload_after_speculation_serves_the_verified_bytes(pkg, dtype):
    """Offloaded during a speculative run, reloaded on the other replica after every device page
    is dropped: values, scales and the recurrent checkpoint come back as the model wrote them."""
    m = _manager(pkg, dtype, connector=pkg.TieredConnector(1 << 20))
    prefixes: dict = {}
    a = TextContext("a", np.array([2, 1, 0, 2], dtype=np.int32))
    _decode(m, a, 0, prefixes, RIGHTS)
    settle_manager(m)
    for r in range(2):
        for pool in m._pools[r].values():
            pool.reset_prefix_cache()  # the device copies only; the tier keeps its units
    b = TextContext("b", np.array(a.tokens, dtype=np.int32))
    m.claim(b, 1)
    m.alloc(b).synchronize()
    m.poll_transfers()
    assert b.cached_prefix_external_length > 0
    assert check_inputs(m, b, m.runtime_inputs([[], [b]]), 1) > 0
    published_ok(m, prefixes, 1)
    m.release(b)
    settle_manager(m, 1)
    m.check_invariants()
    m.shutdown()


def test_kvref_and_kvfast_move_the_same_bytes_under_speculation():
    out = []
    for pkg in PKGS:
        m = _manager(pkg, "float8_e4m3fn")
        _decode(m, TextContext("a", np.array([0, 1, 2, 0, 2], dtype=np.int32)), 0, {}, RIGHTS)
        b = TextContext("b", np.array([0, 1, 2, 0, 2], dtype=np.int32))
        m.claim(b, 1)
        m.alloc(b)
        out.append((m.get_metrics_aggregated(), [np.asarray(m.get_device_buffer(r)["full"]).view(np.uint8).copy()
                                                 for r in range(2)],
                    [np.asarray(m.get_device_scales_buffer(r)["full"]).copy() for r in range(2)]))
    (mr, br, sr), (mf, bf, sf) = out
    assert mr == mf
    for x, y in zip(br + sr, bf + sf):
        np.testing.assert_array_equal(x, y)
