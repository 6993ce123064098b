"""``alloc`` under page pressure while offloads are in flight (spec/manager.md §4 step 6, §9.2).

Offload sources stay pinned until their handle completes. A page a released
request left behind, pinned only by its offload, is neither free nor
evictable; before the rule, ``alloc`` raised ``InsufficientBlocksError`` as
soon as the tier's worker was slower than the scheduler (``kvcache bench``'s
"host tier" row, on a loaded machine: ``needs 46 blocks ..., 0 free or
evictable``), so the outcome depended on thread timing and kvref and kvfast
disagreed. Now pages only in-flight offloads hold count as evictable: an
``alloc`` they would satisfy waits for the replica's offloads, drains them and
sizes again; one they would not satisfy raises at once, nothing changed. The
error happens exactly when the pool is short without the pins, in both
packages.

The connector here is a ``TieredConnector`` behind a gated ``FaultConnector``
(tests/_fault_connector.py): its offload handles report "not complete" until
``synchronize`` (or ``land``), i.e. a worker that never catches up on its own.
"""

from __future__ import annotations

import numpy as np
import pytest
from _fault_connector import FaultConnector, kv_values, write_forward

import kvfast
import kvref
from kvspec import InsufficientBlocksError, KVCacheParams, TextContext

PS = 4
PACKAGES = [pytest.param(kvref, id="kvref"), pytest.param(kvfast, id="kvfast")]


def _manager(mod, num_blocks: int, host_bytes: int = 1 << 20, dp: int = 1):
    params = KVCacheParams(page_size=PS, num_layers=1, kv_heads=1, head_dim=2, dtype="float32",
                           data_parallel_degree=dp)
    fc = FaultConnector(mod.TieredConnector(host_bytes, 0), gated=True)
    m = mod.PagedKVCacheManager(params, num_blocks=num_blocks, max_batch_size=4, max_seq_len=32, connector=fc)
    return m, fc


def _serve(m, ctx, replica: int = 0) -> None:
    """claim, alloc, the prompt's forward (writes K/V), runtime_inputs, step; the request stays claimed."""
    m.claim(ctx, replica)
    m.alloc(ctx)
    row = m.get_req_blocks_per_leaf(ctx)["full"]
    write_forward(m.get_device_buffer(replica), row, ctx.tokens, ctx.processed_length, ctx.current_position)
    m.runtime_inputs([[ctx] if r == replica else [] for r in range(m.params.data_parallel_degree)])
    ctx.update(1)
    m.step(ctx)


def _pin_released(m, tokens, replica: int = 0) -> None:
    """Serve and release a request whose committed pages are then posted for offload (pinned, in flight)."""
    ctx = TextContext(f"old{replica}", np.asarray(tokens, dtype=np.int32))
    _serve(m, ctx, replica)
    m.release(ctx)
    m.runtime_inputs([[] for _ in range(m.params.data_parallel_degree)])  # posts the queued offload
    assert m.pending_transfers_exist(replica)


@pytest.mark.parametrize("mod", PACKAGES)
def test_alloc_waits_for_offloads_instead_of_raising(mod):
    m, fc = _manager(mod, num_blocks=9)  # 8 usable pages
    _pin_released(m, np.arange(100, 125))  # 25 tokens: 7 pages, 6 committed and pinned by the offload
    assert m.block_count().used == 6  # pinned pages are used until the offload completes
    ctx = TextContext("new", np.arange(500, 529, dtype=np.int32))  # 29 tokens: 8 pages, no hit
    m.claim(ctx)
    m.alloc(ctx)  # before the rule: InsufficientBlocksError (2 free, pins neither free nor evictable)
    assert len(m.get_req_blocks_per_leaf(ctx)["full"]) == 8
    assert not m.pending_transfers_exist() and m.block_count().free == 0
    m.check_invariants()
    # the waited-for offload reached the host tier with the bytes the forward wrote
    old = TextContext("probe", np.arange(100, 125, dtype=np.int32))
    assert m.get_prefix_cache_hit_counts(old)[0].external_blocks == 6
    m.release(ctx)
    m.shutdown()


@pytest.mark.parametrize("mod", PACKAGES)
def test_waited_offload_bytes_reload(mod):
    """The pages the wait freed are reused; the tier still serves the old prompt's bytes."""
    m, fc = _manager(mod, num_blocks=9)
    old_tokens = np.arange(100, 125, dtype=np.int32)
    _pin_released(m, old_tokens)
    filler = TextContext("filler", np.arange(500, 529, dtype=np.int32))
    _serve(m, filler)  # waits for the offload, overwrites every page
    m.release(filler)
    fc.land()
    m.poll_transfers()
    again = TextContext("again", old_tokens)
    m.claim(again)
    t = m.alloc(again)
    t.synchronize()
    m.poll_transfers()
    assert again.cached_prefix_external_length == 6 * PS
    buf, row = m.get_device_buffer(0), m.get_req_blocks_per_leaf(again)["full"]
    for i in range(6):
        want = kv_values(old_tokens[i * PS:(i + 1) * PS], np.arange(i * PS, (i + 1) * PS), buf.shape[1:], buf.dtype)
        assert np.array_equal(np.asarray(buf[row[i]]).transpose(2, 0, 1, 3, 4), want), f"block {i}"
    m.release(again)
    m.shutdown()


@pytest.mark.parametrize("mod", PACKAGES)
def test_short_even_after_the_wait_raises_without_waiting(mod):
    m, fc = _manager(mod, num_blocks=9)
    _pin_released(m, np.arange(100, 125))
    live = TextContext("live", np.arange(300, 306, dtype=np.int32))  # 2 pages held by a live request
    _serve(m, live)
    ctx = TextContext("big", np.arange(500, 529, dtype=np.int32))  # 8 pages: 6 can be had at most
    m.claim(ctx)
    with pytest.raises(InsufficientBlocksError) as e:
        m.alloc(ctx)
    # the count includes the pages only the offload holds (evictable once it completes) ...
    assert "needs 8 blocks of leaf 'full', 6 free or evictable on replica 0" in str(e.value)
    # ... but waiting would not have helped, so nothing waited and nothing changed
    assert m.get_req_blocks_per_leaf(ctx)["full"] == [] and ctx.processed_length == 0
    assert m.pending_transfers_exist() and m.block_count().used == 8
    m.check_invariants()
    fc.land()
    m.poll_transfers()
    assert m.block_count().used == 2  # the live request's pages
    m.shutdown()


@pytest.mark.parametrize("mod", PACKAGES)
def test_a_handle_that_never_completes_ends_in_insufficient_blocks(mod, monkeypatch):
    """A connector bug (``synchronize`` returns, the handle still reports incomplete) gives the
    error with the count without the pinned pages, not an endless wait."""
    import _fault_connector

    m, fc = _manager(mod, num_blocks=9)
    _pin_released(m, np.arange(100, 125))
    monkeypatch.setattr(_fault_connector.GatedTransfer, "synchronize", lambda self: None)
    ctx = TextContext("new", np.arange(500, 529, dtype=np.int32))
    m.claim(ctx)
    with pytest.raises(InsufficientBlocksError, match="needs 8 blocks of leaf 'full', 2 free or evictable"):
        m.alloc(ctx)
    assert m.pending_transfers_exist() and m.get_req_blocks_per_leaf(ctx)["full"] == []
    m.check_invariants()
    monkeypatch.undo()
    m.alloc(ctx)  # a working handle: the wait frees the pages
    assert len(m.get_req_blocks_per_leaf(ctx)["full"]) == 8
    m.shutdown()


@pytest.mark.parametrize("mod", PACKAGES)
def test_grow_of_a_running_request_waits_too(mod):
    """The decode-growth path (a request that already holds pages) applies the same rule."""
    m, fc = _manager(mod, num_blocks=9)
    run = TextContext("run", np.arange(300, 303, dtype=np.int32))
    _serve(m, run)  # 1 page, now 4 tokens: the next forward needs no new page
    _pin_released(m, np.arange(100, 121))  # 21 tokens: 6 pages, 5 pinned; 2 pages free
    for t in range(3):  # grow "run" until it needs a 2nd, 3rd and 4th page
        m.alloc(run)
        run.update(7 + t)
        m.step(run)
    run.update(9)
    m.alloc(run)
    assert m.pending_transfers_exist()  # 2 free pages were enough: nothing waited
    for _ in range(PS * 2):
        run.update(3)
    m.alloc(run)  # needs 2 more pages, 0 free: waits for the offload
    assert not m.pending_transfers_exist()
    m.check_invariants()
    m.shutdown()


@pytest.mark.parametrize("mod", PACKAGES)
def test_only_the_requests_replica_waits(mod):
    m, fc = _manager(mod, num_blocks=9, dp=2)
    _pin_released(m, np.arange(100, 125), replica=0)
    _pin_released(m, np.arange(700, 725), replica=1)
    ctx = TextContext("new", np.arange(500, 529, dtype=np.int32))
    m.claim(ctx, 1)
    m.alloc(ctx)
    assert m.pending_transfers_exist(0) and not m.pending_transfers_exist(1)
    m.check_invariants()
    m.shutdown()


@pytest.mark.parametrize("mod", PACKAGES)
def test_several_leaves_on_one_slab_wait_too(mod):
    """Full + sliding window (one slab of huge blocks, spec/manager.md §13) with a host tier
    (spec/manager.md §9.8): the released request's pages of both leaves, pinned by its offload,
    are waited for."""
    from kvspec import LeafSpec

    params = KVCacheParams(page_size=PS, num_layers=1, kv_heads=1, head_dim=2, dtype="float32",
                           leaves={"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(8)})
    fc = FaultConnector(mod.TieredConnector(1 << 20, 0), gated=True)
    m = mod.PagedKVCacheManager(params, num_blocks=17, max_batch_size=4, max_seq_len=32, connector=fc)
    old = TextContext("old", np.arange(100, 125, dtype=np.int32))  # 7 pages per leaf
    m.claim(old)
    m.alloc(old)
    m.runtime_inputs([[old]])
    old.update(1)
    m.step(old)
    m.release(old)
    m.runtime_inputs([[]])  # posts the offload: both leaves' committed pages pinned
    assert m.pending_transfers_exist() and m.block_count().free < 14
    ctx = TextContext("new", np.arange(500, 529, dtype=np.int32))  # 8 pages per leaf
    m.claim(ctx)
    m.alloc(ctx)
    assert {k: len(v) for k, v in m.get_req_blocks_per_leaf(ctx).items()} == {"full": 8, "swa": 8}
    assert not m.pending_transfers_exist()
    m.check_invariants()
    m.shutdown()


def _loop_with_a_worker_that_never_catches_up(mod) -> list:
    """Waves of requests (claim, alloc, forward, runtime_inputs, step, release) sharing one prefix,
    the pool holding two waves' pages, offload handles completing only when waited for. Returns
    per request its hit and its row (block ids)."""
    m, fc = _manager(mod, num_blocks=2 * 4 * 5 + 1)
    shared = np.arange(900, 908, dtype=np.int32)  # 2 shared pages
    out = []
    for w in range(6):
        ctxs = [TextContext(f"w{w}.{i}", np.concatenate([shared, np.arange(12, dtype=np.int32) + 100 * (4 * w + i)]))
                for i in range(4)]  # 20 tokens: 5 pages each
        for c in ctxs:
            m.claim(c)
            m.alloc(c)
            out.append((c.cached_prefix_length, m.get_req_blocks_per_leaf(c)["full"]))
        buf = m.get_device_buffer(0)
        for c in ctxs:
            write_forward(buf, m.get_req_blocks_per_leaf(c)["full"], c.tokens, c.processed_length,
                          c.current_position)
        m.runtime_inputs([ctxs])
        for c in ctxs:
            c.update(1)
            m.step(c)
        m.runtime_inputs([[]])  # posts the last commits: the sources stay pinned (the worker never catches up)
        for c in ctxs:
            m.release(c)
        m.check_invariants()
    m.shutdown()
    return out


def test_a_worker_that_never_catches_up_changes_nothing_observable():
    """Before the rule the third wave raised (two waves of released pages pinned); now both packages
    serve every wave, with the same hits and block ids."""
    a = _loop_with_a_worker_that_never_catches_up(kvref)
    b = _loop_with_a_worker_that_never_catches_up(kvfast)
    assert a == b
    assert [hit for hit, _ in a[4:]] == [2 * PS] * 20  # the shared prefix hits from the second request on
