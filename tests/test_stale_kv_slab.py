"""Wrong or stale K/V through the slab (spec/manager.md §13): padded pages on the tiers, and
another leaf's claim of a parked block whose cached pages a queued offload still names.

The model is ``test_stale_kv_spec_decode``'s (K/V that depend on the whole prefix).
"""

from __future__ import annotations

import numpy as np
import pytest
from _fault_connector import settle_manager
from kvspec import InsufficientBlocksError, KVCacheParams, LeafSpec, TextContext
from kvspec.hashing import block_hashes
from test_stale_kv_spec_decode import (
    PS,
    check_inputs,
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
#: 16-byte full/sliding pages and a 2412-byte state: the slab pads them to 20 and 2680 bytes.
PADDED = {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(3), "rec": LeafSpec.recurrent((9, 67))}


def _params(leaves, dtype="float16", **kw) -> KVCacheParams:
    return KVCacheParams(page_size=PS, num_layers=1, kv_heads=1, head_dim=2, dtype=dtype, leaves=leaves, **kw)


def _serve(m, ctx: TextContext, prefixes: dict, *, release: bool = True) -> None:
    """Claim, one forward over the prompt (checked), ``step``; release."""
    m.claim(ctx)
    m.alloc(ctx).synchronize()
    m.poll_transfers()
    check_inputs(m, ctx, m.runtime_inputs([[ctx]]))
    write_forward(m, ctx, [])
    verify(ctx, [])
    write_state(m, ctx)
    m.step(ctx)
    register(prefixes, ctx.tokens)
    if release:
        m.release(ctx)


def _drop_device_cache(m) -> None:
    """Unpublish every free device page (the tiers keep theirs)."""
    for pool in m._pools[0].values():
        pool.reset_prefix_cache()


@pytest.mark.parametrize("dtype, state, padded", [
    ("float16", (9, 67), {"full": 20, "swa": 20, "rec": 2680}),
    ("float8_e4m3fn", (5, 67), {"full": 10, "swa": 10, "rec": 1340}),  # values padded, scales beside them
])
@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_padded_slab_pages_round_trip_through_a_host_tier(pkg, dtype, state, padded):
    """Before the fix a padded slab's page store had the padded page size, so a manager with a
    connector could not be built (``attach``: "page_nbytes=20 != page bytes 16 of params"); now
    the tiers move the data bytes (and FP8 scales) and a reload serves every leaf's bytes."""
    p = _params({**PADDED, "rec": LeafSpec.recurrent(state)}, dtype)
    assert pkg.PagedKVCacheManager(p, num_blocks=40, max_batch_size=2, max_seq_len=14).slab_geometry.padded_bytes \
        == padded
    m = pkg.PagedKVCacheManager(p, num_blocks=40, max_batch_size=2, max_seq_len=14,
                                connector=pkg.TieredConnector(1 << 20))
    prefixes: dict = {}
    prompt = np.array([0, 1, 2, 0, 1, 1, 2, 0], dtype=np.int32)  # processed lands on a page: a checkpoint
    _serve(m, TextContext("a", prompt), prefixes)
    settle_manager(m)
    _drop_device_cache(m)  # the next admission hits in the tier only
    assert all(h is None for lid in PADDED for h in m._pools[0][lid].block_hash)
    ctx = TextContext("b", np.append(prompt, [2, 1]).astype(np.int32))
    m.claim(ctx)
    m.alloc(ctx).synchronize()
    m.poll_transfers()
    assert ctx.cached_prefix_external_length == 8
    assert check_inputs(m, ctx, m.runtime_inputs([[ctx]])) > 0  # full, window and state bytes, as written
    published_ok(m, prefixes)
    m.release(ctx)
    m.shutdown()


@pytest.mark.parametrize("state", [(9, 67), (7, 101)], ids=["all-padded", "state-padded"])
@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_padded_and_bookkeeping_only_managers_count_the_same_tier_units(pkg, state):
    """The tier holds data bytes: a bookkeeping-only manager (no slab, no padding) fills the host
    tier exactly as the padded one does. With only the state padded (2828 -> 3232 bytes) the
    manager could be built before the fix, but shipped 202 units per checkpoint, not 177."""
    leaves = {**PADDED, "rec": LeafSpec.recurrent(state)}
    used = []
    for allocate in (True, False):
        m = pkg.PagedKVCacheManager(_params(leaves, allocate_buffers=allocate), num_blocks=40, max_batch_size=2,
                                    max_seq_len=14, connector=pkg.TieredConnector(1 << 20))
        ctx = TextContext("a", np.array([0, 1, 2, 0, 1, 1, 2, 0], dtype=np.int32))
        m.claim(ctx)
        m.alloc(ctx)
        if allocate:
            write_forward(m, ctx, [])
        verify(ctx, [])
        m.step(ctx)
        m.release(ctx)
        settle_manager(m)
        used.append(m.host_byte_count(0).used)
        m.shutdown()
    assert used[0] == used[1] > 0


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_a_claimed_parked_block_never_ships_under_its_old_hash(pkg):
    """A published sliding page sits in a parked block while its run waits in the offload queue;
    the full leaf claims that block (evicting the page) and overwrites it before the queue is
    posted. The post looks pages up by hash, so the evicted page is skipped, never shipped with
    the full leaf's bytes under the sliding leaf's key; a later reload serves the model's bytes."""
    leaves = {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(3)}
    m = pkg.PagedKVCacheManager(_params(leaves), num_blocks=10, max_batch_size=2, max_seq_len=8,
                                connector=pkg.TieredConnector(1 << 20))
    prefixes: dict = {}
    a = TextContext("a", np.array([0, 1, 2, 0, 1], dtype=np.int32))
    _serve(m, a, prefixes)  # committed and queued, not yet posted (runtime_inputs posts)
    # other requests take every parked block: their full leaf claims the blocks a's pages park in
    others = []
    for i in range(4):
        c = TextContext(f"o{i}", np.full(5, 100 + i, dtype=np.int32))
        m.claim(c)
        try:
            m.alloc(c)
        except InsufficientBlocksError:
            m.release(c)
            break
        others.append(c)
        if i == 0:  # the scenario: a's run still queued, one of its sliding pages already evicted
            swa = m._pools[0]["swa"]
            assert m._offload_queue[0] and any(swa.lookup(h, a.tokens[j * PS:(j + 1) * PS]) is None
                                               for j, h in enumerate(block_hashes(a.tokens, PS)))
        check_inputs(m, c, m.runtime_inputs([[c]]))  # posts a's queued offload among others
        write_forward(m, c, [])
    settle_manager(m)
    for c in others:
        m.release(c)
    published_ok(m, prefixes)
    _drop_device_cache(m)
    b = TextContext("b", np.array([0, 1, 2, 0, 1, 2], dtype=np.int32))
    m.claim(b)
    m.alloc(b).synchronize()
    m.poll_transfers()
    check_inputs(m, b, m.runtime_inputs([[b]]))
    m.release(b)
    m.shutdown()


def test_padded_slab_pages_round_trip_on_the_emulated_device(emulated):
    """The same round trip through ``CudaPageStore`` (staged, padded rows of the device slab):
    the bytes a reload writes into the device pages equal the ones offloaded."""
    p = _params(PADDED)
    m = kvfast.PagedKVCacheManager(p, num_blocks=40, max_batch_size=2, max_seq_len=14, device="cuda",
                                   connector=kvfast.TieredConnector(1 << 20))
    assert m.slab_geometry.padded_bytes["full"] == 20
    ctx = TextContext("a", np.array([0, 1, 2, 0, 1, 1, 2, 0], dtype=np.int32))
    m.claim(ctx)
    m.alloc(ctx)
    rows = m.get_req_blocks_per_leaf(ctx)
    buf = m.get_device_buffer(0)["full"]
    rng = np.random.default_rng(0)
    want = rng.integers(-100, 100, (4, *buf.shape[1:])).astype(np.float16)
    for i in range(4):
        buf[rows["full"][i]] = emulated.asarray(want[i])
    verify(ctx, [])
    m.step(ctx)
    m.release(ctx)
    settle_manager(m)
    _drop_device_cache(m)
    b = TextContext("b", np.array([0, 1, 2, 0, 1, 1, 2, 0, 2], dtype=np.int32))
    m.claim(b)
    m.alloc(b).synchronize()
    m.poll_transfers()
    assert b.cached_prefix_external_length == 8
    got = m.get_req_blocks_per_leaf(b)["full"]
    for i in range(4):
        np.testing.assert_array_equal(emulated.asnumpy(buf[got[i]]), want[i])
    m.release(b)
    m.shutdown()


def test_a_padded_state_page_starts_at_zero_on_the_emulated_device(emulated):
    """A fresh recurrent state of a padded slab leaf (a strided view on the device) is zeroed
    without touching its neighbours; before the fix the row kernel refused the view and the
    first ``alloc`` of any padded hybrid manager on a GPU raised."""
    m = kvfast.PagedKVCacheManager(_params(PADDED), num_blocks=40, max_batch_size=2, max_seq_len=14, device="cuda")
    rec = m.get_device_buffer(0)["rec"]
    assert rec.strides[0] == 2680 and rec[0].nbytes == 2412
    rec[...] = 7.0  # garbage everywhere, padding included
    slab = emulated.asnumpy(m._slab_bytes[0]).copy()
    ctx = TextContext("a", np.array([0, 1, 2], dtype=np.int32))
    m.claim(ctx)
    m.alloc(ctx)
    live = m.get_req_blocks_per_leaf(ctx)["rec"][0]
    assert not emulated.asnumpy(rec[live]).any()
    after = emulated.asnumpy(m._slab_bytes[0]).reshape(-1)
    lo = live * 2680
    changed = np.flatnonzero(after != slab.reshape(-1))
    assert changed.min() >= lo and changed.max() < lo + 2412  # the page's data bytes only
    m.release(ctx)
