"""One slab per replica, cut into huge blocks the leaves carve into pages (spec/manager.md §13).

MAX's Jenga expectations (``max/tests/integration/kv_cache/jenga/test_jenga_block_manager.py``,
``test_jenga_cache_manager.py``), ported to our API: at the level of the slab's
pools (a leaf at any ratio) and of the manager (full + sliding, full +
recurrent). Every test runs on kvref's and kvfast's mechanisms and expects the
same numbers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from kvspec import (
    BlockCount,
    InsufficientBlocksError,
    KVCacheParams,
    LeafSpec,
    TextContext,
)
from kvspec.errors import CapacityError

import kvfast
import kvref
from kvfast._block_pool import BlockPool as FastPool
from kvfast._slab import FastSlabTable
from kvref._block_pool import BlockPool as RefPool
from kvref._slab import ReferenceSlabTable, Slab, plan_slab_geometry

ENGINES = {"kvref": (ReferenceSlabTable, RefPool), "kvfast": (FastSlabTable, FastPool)}
MANAGERS = {"kvref": kvref.PagedKVCacheManager, "kvfast": kvfast.PagedKVCacheManager}


def make_slab(engine: str, num_huge: int, ratios: dict[str, int]) -> Slab:
    table, pool = ENGINES[engine]
    return Slab(table(num_huge, len(ratios)), {lid: pool(num_huge * r) for lid, r in ratios.items()}, ratios)


def draw(slab: Slab, demand: dict[str, int]) -> dict[str, list[int]]:
    """One request: check the joint demand, then draw each leaf's pages in leaf order."""
    short = slab.shortfall(demand)
    if short is not None:
        raise InsufficientBlocksError(f"short of leaf {short[0]!r}")
    return {lid: slab.pools[lid].allocate(n) for lid, n in demand.items()}


def free_pages(slab: Slab) -> dict[str, int]:
    return {lid: slab.num_free(lid) for lid in slab.leaf_ids}


@pytest.fixture(params=sorted(ENGINES))
def engine(request):
    return request.param


@pytest.fixture(params=sorted(MANAGERS))
def Manager(request):
    return MANAGERS[request.param]


# ------------------------------------------------------------------ the pool level


@pytest.mark.parametrize("ratio, first", [(1, 1), (3, 3)])
def test_first_page_id_is_the_ratio(engine, ratio, first):
    """MAX test_ratio: huge block 0 is null, so a leaf's first real page is ``ratio``."""
    slab = make_slab(engine, 10, {"full": ratio})
    assert slab.free_huge_blocks() == 9
    assert slab.pools["full"].allocate(3) == [first, first + 1, first + 2]
    assert slab.free_huge_blocks() == 9 - math.ceil(3 / ratio)
    slab.check_invariants()


def test_huge_block_shared_by_two_requests_of_one_leaf(engine):
    """MAX test_huge_block_shared_by_different_req: pages of one leaf split a huge block."""
    slab = make_slab(engine, 4, {"full": 3})
    assert slab.pools["full"].allocate(5) == [3, 4, 5, 6, 7]
    assert slab.free_huge_blocks() == 1
    assert slab.pools["full"].allocate(4) == [8, 9, 10, 11]
    assert slab.free_huge_blocks() == 0


def test_thirty_tokens_fit_three_huge_blocks_of_two_pages_of_five(engine):
    """MAX test_oom: 3 huge x ratio 2 x page 5 = 30 tokens fit, 31 do not."""
    slab = make_slab(engine, 4, {"full": 2})
    pool = slab.pools["full"]
    pages = pool.allocate(math.ceil(30 / 5))
    pool.free(pages[::-1])
    with pytest.raises(CapacityError):
        pool.allocate(math.ceil(31 / 5))
    assert slab.free_huge_blocks() == 3
    slab.check_invariants()


def test_values_and_scales_share_the_huge_blocks(engine):
    """MAX test_values_and_scales: {VALUES: 3, SCALES: 30} -> {1, 19} -> {0, 8}, then OOM."""
    slab = make_slab(engine, 4, {"values": 1, "scales": 10})
    assert free_pages(slab) == {"values": 3, "scales": 30}
    assert draw(slab, {"values": 1, "scales": 1}) == {"values": [1], "scales": [20]}
    assert slab.free_huge_blocks() == 1
    assert free_pages(slab) == {"values": 1, "scales": 19}
    assert draw(slab, {"values": 1, "scales": 1}) == {"values": [3], "scales": [21]}
    assert slab.free_huge_blocks() == 0
    assert free_pages(slab) == {"values": 0, "scales": 8}
    with pytest.raises(InsufficientBlocksError):
        draw(slab, {"values": 1, "scales": 1})
    slab.check_invariants()


def test_four_leaves_take_four_huge_blocks(engine):
    """MAX test_fp8_spec_dec: a huge block serves one leaf at a time, ids at each leaf's ratio."""
    slab = make_slab(engine, 5, {"tv": 1, "ts": 10, "dv": 2, "ds": 20})
    assert draw(slab, {"tv": 1, "ts": 1, "dv": 1, "ds": 1}) == {"tv": [1], "ts": [20], "dv": [6], "ds": [80]}
    assert slab.free_huge_blocks() == 0


def test_a_claim_of_another_leafs_parked_block_evicts_its_cached_pages(engine):
    """spec/manager.md §13.2: parked blocks keep their commits until another leaf claims the bytes."""
    slab = make_slab(engine, 3, {"a": 1, "b": 1})
    a, b = slab.pools["a"], slab.pools["b"]
    (pa,) = a.allocate(1)
    a.publish(pa, b"h" * 32, np.array([1, 2], np.int32))
    a.free([pa])
    assert slab.free_huge_blocks() == 2 and a.lookup(b"h" * 32, [1, 2]) == pa  # parked, still cached
    assert b.allocate(1) == [2]  # the pristine block first
    assert a.lookup(b"h" * 32, [1, 2]) == pa
    assert b.allocate(1) == [1]  # then a's parked block: a's commit in it is evicted
    assert a.lookup(b"h" * 32, [1, 2]) is None and a.free_order() == []
    with pytest.raises(CapacityError):
        a.allocate(1)
    slab.check_invariants()


def test_a_leaf_prefers_a_pristine_block_to_evicting_its_own_cache(engine):
    """MAX's claim rule: a published front page is popped only when no pristine block is left."""
    slab = make_slab(engine, 3, {"a": 1, "b": 1})
    a = slab.pools["a"]
    (p,) = a.allocate(1)
    a.publish(p, b"x" * 32, np.array([7], np.int32))
    a.free([p])
    assert a.allocate(1) == [2]  # pristine huge block 2, the cached page 1 kept
    assert a.lookup(b"x" * 32, [7]) == 1
    assert a.allocate(1) == [1]  # nothing pristine left: the leaf's own LRU page
    assert a.lookup(b"x" * 32, [7]) is None


def test_a_touched_page_takes_its_parked_block_back(engine):
    slab = make_slab(engine, 3, {"a": 1, "b": 2})
    a = slab.pools["a"]
    (p,) = a.allocate(1)
    a.publish(p, b"y" * 32, np.array([3], np.int32))
    a.free([p])
    assert slab.free_huge_blocks() == 2 and slab.num_free("b") == 4
    a.touch(p)  # a prefix hit
    assert slab.free_huge_blocks() == 1 and slab.num_free("b") == 2
    slab.check_invariants()


def test_joint_demand_counts_parked_blocks_once(engine):
    """MAX can_satisfy_demand: leaves compete for the parked blocks, not each on its own."""
    slab = make_slab(engine, 4, {"a": 1, "b": 1})
    assert slab.num_free("a") == 3 and slab.num_free("b") == 3
    assert slab.shortfall({"a": 2, "b": 1}) is None
    assert slab.shortfall({"a": 2, "b": 2}) == ("b", 2, 1)


def test_reset_prefix_cache_keeps_the_huge_blocks_where_they_are(engine):
    slab = make_slab(engine, 4, {"a": 1, "b": 1})
    a = slab.pools["a"]
    pages = a.allocate(2)
    for i, p in enumerate(pages):
        a.publish(p, bytes([i]) * 32, np.array([i], np.int32))
    a.free(pages[::-1])
    before = slab.table.parked_order()
    assert a.reset_prefix_cache() == [2, 1]
    assert slab.table.parked_order() == before and slab.page_states()["cached"] == 0
    slab.check_invariants()


# ------------------------------------------------------------------ geometry


def test_geometry_is_the_lcm_of_the_pages():
    g = plan_slab_geometry({"full": 32, "rec": 24}, {"full": 4, "rec": 4})
    assert (g.huge_bytes, g.ratios, g.padded_bytes) == (96, {"full": 3, "rec": 4}, {"full": 32, "rec": 24})


def test_geometry_pads_when_the_lcm_is_too_large():
    """Coprime pages: the smallest huge block every page tiles with <= 25% padding."""
    g = plan_slab_geometry({"a": 1000 * 4, "b": 1009 * 4}, {"a": 4, "b": 4})
    assert g.huge_bytes < math.lcm(4000, 4036)
    for lid in ("a", "b"):
        assert g.huge_bytes % g.padded_bytes[lid] == 0 and g.padded_bytes[lid] % 4 == 0
        assert 0 <= g.padding_fraction(lid) <= 0.25
    with pytest.raises(ValueError, match="not a multiple of row_bytes"):
        plan_slab_geometry({"a": 10}, {"a": 4})


# ------------------------------------------------------------------ the manager

FULL_SWA = {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(4)}


def manager(Manager, leaves, num_blocks, *, max_seq_len, page=1, caching=True, buffers=True, dtype="float32"):
    params = KVCacheParams(page_size=page, num_layers=1, kv_heads=1, head_dim=2, dtype=dtype, leaves=leaves,
                           enable_prefix_caching=caching, allocate_buffers=buffers)
    return Manager(params, num_blocks=num_blocks, max_batch_size=4, max_seq_len=max_seq_len)


def admit(m, rid, tokens):
    ctx = TextContext(rid, list(tokens))
    m.claim(ctx)
    m.alloc(ctx)
    return ctx


def test_block_count_counts_huge_blocks(Manager):
    """MAX test_jenga_cache_manager: block_count free 9 -> 6 after a 3-token request, total = huge - 1."""
    m = manager(Manager, FULL_SWA, 10, max_seq_len=4)
    assert m.block_count() == BlockCount(9, 9) and m.pressure_pct() == 0.0
    ctx = admit(m, "a", [1, 2, 3])
    assert m.get_req_blocks_per_leaf(ctx) == {"full": [1, 2, 3], "swa": [4, 5, 6]}
    assert m.block_count() == BlockCount(3, 9)
    # the fullest leaf: each leaf could still draw 3 pages of its 9
    assert m.pressure_pct() == pytest.approx(100.0 * 6 / 9)
    m.check_invariants()


def test_full_and_sliding_share_one_block_index(Manager):
    """MAX test_full_and_swa_share_one_block_index (page 1, window 4, 20 huge blocks)."""
    m = manager(Manager, FULL_SWA, 20, max_seq_len=8)
    ctx = admit(m, "a", range(6))
    assert m.get_req_blocks_per_leaf(ctx) == {"full": [1, 2, 3, 4, 5, 6], "swa": [7, 8, 9, 10, 11, 12]}
    ctx.update(42)
    m.step(ctx)
    assert m.get_req_blocks_per_leaf(ctx) == {"full": [1, 2, 3, 4, 5, 6], "swa": [0, 0, 0, 10, 11, 12]}
    m.check_invariants()


def test_full_and_sliding_resume_from_the_same_block(Manager):
    """MAX test_full_and_swa_resume_from_the_same_block: the joint hit, fresh pages from pristine blocks."""
    m = manager(Manager, FULL_SWA, 20, max_seq_len=8)
    a = admit(m, "a", range(6))
    a.update(42)
    m.step(a)
    m.release(a)
    b = admit(m, "b", range(6))
    assert b.processed_length == 5
    assert m.get_req_blocks_per_leaf(b) == {"full": [1, 2, 3, 4, 5, 13], "swa": [0, 0, 9, 10, 11, 14]}
    m.check_invariants()


def test_memory_flows_to_the_leaf_that_needs_it(Manager):
    """What per-leaf pools cannot do: the full leaf grows into the huge blocks the sliding leaf
    slid out of (13 huge blocks split per leaf would cap it at 6 pages); claiming them evicts
    the sliding leaf's cached pages in them."""
    m = manager(Manager, FULL_SWA, 14, max_seq_len=9)
    a = admit(m, "a", range(6))  # 6 full + 6 sliding pages of 13
    x = TextContext("x", list(range(7)))
    m.claim(x)
    with pytest.raises(InsufficientBlocksError, match="needs 7 blocks of leaf 'full', 1 free or evictable"):
        m.alloc(x)
    m.release(x)
    a.update(1)
    m.step(a)  # the window keeps 3 sliding pages; 3 huge blocks park with cached pages
    probe = TextContext("p", list(range(4)))
    assert m.block_count() == BlockCount(4, 13) and m.get_prefix_cache_hit_counts(probe)[0].device_blocks == 3
    for _ in range(3):  # decode: each step needs a page per leaf and slides one sliding page out
        m.alloc(a)
        a.update(1)
        m.step(a)
    assert m.get_req_blocks_per_leaf(a) == {"full": [1, 2, 3, 4, 5, 6, 13, 8, 10],
                                            "swa": [0, 0, 0, 0, 0, 0, 9, 7, 11]}
    assert m.block_count() == BlockCount(1, 13)
    assert m.get_prefix_cache_hit_counts(probe)[0].device_blocks == 0  # the sliding window's pages were claimed
    assert m._slabs[0].page_states() == {"free": 0, "cached": 1, "in_use": 12}
    m.check_invariants()


def test_full_and_recurrent_at_their_own_ratios(Manager):
    """Pages of different byte sizes: a full page of 16 B and a state of 24 B tile a 48 B huge block."""
    leaves = {"full": LeafSpec.full(), "rec": LeafSpec.recurrent((3, 2))}
    m = manager(Manager, leaves, 6, page=2, max_seq_len=6)  # full page 2*1*2*1*2*4 = 32 B, state 24 B: huge 96 B
    ctx = admit(m, "a", range(5))
    rows = m.get_req_blocks_per_leaf(ctx)
    assert rows == {"full": [3, 4, 5], "rec": [8, 9]}  # huge 1 -> full (ratio 3), huge 2 -> rec (ratio 4)
    bufs = m.get_device_buffer(0)
    assert bufs["full"].shape == (18, 2, 1, 2, 1, 2) and bufs["rec"].shape == (24, 3, 2)
    assert np.shares_memory(bufs["full"], bufs["rec"])
    bufs["rec"][8] = 5.0  # state page 8 is bytes [192, 216) of the slab: full page 6 of huge block 2
    assert bufs["full"][6].view(np.uint8).any() and not bufs["full"][5].view(np.uint8).any()
    m.check_invariants()


def test_bookkeeping_only_mode_allocates_no_slab(Manager):
    m = manager(Manager, FULL_SWA, 10, max_seq_len=4, buffers=False)
    assert m._slab_bytes == [None]
    ctx = admit(m, "a", range(4))
    assert m.get_req_blocks_per_leaf(ctx) == {"full": [1, 2, 3, 4], "swa": [5, 6, 7, 8]}
    with pytest.raises(RuntimeError, match="bookkeeping-only"):
        m.get_device_buffer(0)
    assert m.runtime_inputs([[ctx]]).inputs[0]["full"].kv_blocks is None


def test_construction_refuses_a_max_seq_len_the_slab_cannot_hold(Manager):
    with pytest.raises(ValueError, match=r"needs 10 huge blocks for one request \('full': 5, 'swa': 5\)"):
        manager(Manager, {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(40)}, 9, max_seq_len=5)
    manager(Manager, {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(40)}, 11, max_seq_len=5)


def test_single_full_leaf_is_unchanged(Manager):
    """A single leaf keeps today's pool: same ids, same free order, same counts."""
    m = manager(Manager, None, 10, max_seq_len=9)
    a = admit(m, "a", range(4))
    assert m.get_req_blocks_per_leaf(a) == {"full": [1, 2, 3, 4]}
    assert m._free_order() == [5, 6, 7, 8, 9]
    assert m.block_count() == BlockCount(5, 9)


def test_peek_predicts_allocate(engine):
    """``peek`` replays the claim rule: the pages it names are the ones ``allocate`` hands out."""
    rng = np.random.default_rng(3)
    for trial in range(60):
        ratios = {"a": int(rng.integers(1, 4)), "b": int(rng.integers(1, 3))}
        slab = make_slab(engine, int(rng.integers(2, 7)), ratios)
        held = {"a": [], "b": []}
        for step in range(30):
            lid = "ab"[int(rng.integers(0, 2))]
            pool = slab.pools[lid]
            if rng.random() < 0.55:
                n = int(rng.integers(1, 4))
                predicted = pool.peek(n)
                assert len(predicted) == min(n, pool.num_free)
                if n <= pool.num_free:
                    got = pool.allocate(n)
                    assert got == predicted
                    for b in got:
                        if rng.random() < 0.5:
                            pool.publish(b, bytes([trial, step, b % 256]) * 8, np.array([b], np.int32))
                    held[lid] += got
            elif held[lid]:
                pool.free([held[lid].pop(int(rng.integers(0, len(held[lid]))))])
            slab.check_invariants()


def test_padded_pages_are_strided_views_with_their_page_stride(Manager):
    """A coprime state size: the state page pads from 4036 to 4096 bytes (1.5%) instead of a 4 MiB
    least common multiple; its buffer is a strided view and ``page_stride`` says so."""
    params = KVCacheParams(page_size=16, num_layers=1, kv_heads=1, head_dim=64, dtype="float16",
                           leaves={"full": LeafSpec.full(), "rec": LeafSpec.recurrent((1009, 1))})
    m = Manager(params, num_blocks=6, max_batch_size=2, max_seq_len=32)
    g = m.slab_geometry
    assert (g.huge_bytes, g.ratios) == (4096, {"full": 1, "rec": 1})
    assert g.page_bytes == {"full": 4096, "rec": 4036} and g.padded_bytes == {"full": 4096, "rec": 4096}
    bufs = m.get_device_buffer(0)
    assert bufs["rec"].shape == (6, 1009, 1) and bufs["rec"].strides[0] == 4096
    ctx = admit(m, "a", range(20))
    rows = m.get_req_blocks_per_leaf(ctx)
    inp = m.runtime_inputs([[ctx]]).inputs[0]
    assert inp["full"].page_stride.tolist() == [-1] and inp["rec"].page_stride.tolist() == [1024]
    bufs["rec"][rows["rec"][0]] = 1.0
    slab = m._slab_bytes[0]
    h = rows["rec"][0]
    assert slab[h, :4036].view(np.float32).min() == 1.0 and not slab[h, 4036:].any()  # padding untouched
    m.check_invariants()


def _random_demand(engine: str, rng, trial: int):
    """A slab after random draws, publications and frees of 2-3 leaves, a joint demand, and cached
    free pages of each leaf a hit takes (``taken``)."""
    lids = ["a", "b", "c"][: int(rng.integers(2, 4))]
    ratios = {lid: int(rng.integers(1, 4)) for lid in lids}
    slab = make_slab(engine, int(rng.integers(2, 10)), ratios)
    held = {lid: [] for lid in lids}
    for step in range(int(rng.integers(0, 40))):
        lid = lids[int(rng.integers(0, len(lids)))]
        pool = slab.pools[lid]
        if rng.random() < 0.6 and pool.num_free:
            b = pool.allocate_one()
            held[lid].append(b)
            if rng.random() < 0.5:
                pool.publish(b, bytes([trial % 256, step, b % 256]) * 8, np.array([b], np.int32))
        elif held[lid]:
            pool.free([held[lid].pop(int(rng.integers(0, len(held[lid]))))])
    demand = {lid: int(rng.integers(0, 7)) for lid in lids}
    taken = {}
    for lid in lids:
        cached = [b for b in slab.pools[lid].free_order() if slab.pools[lid].block_hash[b] is not None]
        taken[lid] = cached[: int(rng.integers(0, 3))]
    return slab, lids, demand, taken


def _touch_then_draw(slab: Slab, lids, demand, taken) -> dict[str, list[int]]:
    """What the manager's commit does: touch the hit pages, then draw each leaf's pages in leaf order."""
    for lid in lids:
        for b in taken[lid]:
            slab.pools[lid].touch(b)
    return {lid: slab.pools[lid].allocate(demand[lid]) for lid in lids}


def _slab_state(slab: Slab) -> tuple:
    t = slab.table
    return (t.parked_order(), t.owners(), t.live_counts(),
            {lid: (p.free_order(), list(p.ref_count), list(p.block_hash)) for lid, p in slab.pools.items()})


def test_joint_check_says_exactly_whether_the_draw_succeeds(engine):
    """``shortfall`` is None iff touching the hit pages and then drawing every leaf's pages in leaf
    order succeeds (the manager checks, then commits: a draw never fails halfway)."""
    import copy

    rng = np.random.default_rng(11)
    for trial in range(400):
        slab, lids, demand, taken = _random_demand(engine, rng, trial)
        fits = slab.shortfall(demand, taken) is None
        try:
            _touch_then_draw(copy.deepcopy(slab), lids, demand, taken)
            drawn = True
        except CapacityError:
            drawn = False
        assert fits == drawn, (trial, demand, slab.ratios)


def test_joint_peek_names_the_pages_the_draw_hands_out(engine):
    """``Slab.peek(demand, taken)`` changes nothing and names, leaf by leaf, the pages touching the hit
    pages and drawing in leaf order hands out (spec/manager.md §9.8: a hybrid manager posts a tier
    load into them before anything is drawn); ``CapacityError`` exactly when the draw fails."""
    import copy

    rng = np.random.default_rng(12)
    checked = 0
    for trial in range(400):
        slab, lids, demand, taken = _random_demand(engine, rng, trial)
        before = _slab_state(slab)
        try:
            predicted = slab.peek(demand, taken)
        except CapacityError:
            predicted = None
        assert _slab_state(slab) == before, trial
        try:
            got = _touch_then_draw(copy.deepcopy(slab), lids, demand, taken)
        except CapacityError:
            got = None
        assert predicted == got, (trial, demand, taken)
        checked += got is not None and any(demand.values())
    assert checked > 50


def test_emulated_cuda_slab_matches_the_cpu(emulated):
    """kvfast on device="cuda" (the emulated CuPy): the same ids, views into one device slab."""
    leaves = {"full": LeafSpec.full(), "rec": LeafSpec.recurrent((3,))}
    params = KVCacheParams(page_size=2, num_layers=1, kv_heads=1, head_dim=2, dtype="bfloat16", leaves=leaves)
    cpu = kvfast.PagedKVCacheManager(params, num_blocks=6, max_batch_size=2, max_seq_len=8)
    gpu = kvfast.PagedKVCacheManager(params, num_blocks=6, max_batch_size=2, max_seq_len=8, device="cuda")
    for m in (cpu, gpu):
        for rid in ("a", "b"):
            ctx = TextContext(rid, list(range(4)))
            m.claim(ctx)
            m.alloc(ctx)
            ctx.update(1)
            m.step(ctx)
        m.check_invariants()
    probe = TextContext("b", list(range(4)))  # a context object is replaced when its tokens agree
    assert cpu.get_req_blocks_per_leaf(probe) == gpu.get_req_blocks_per_leaf(probe)
    bufs = gpu.get_device_buffer(0)
    assert bufs["full"].shape == (18, 2, 1, 2, 1, 2) and bufs["rec"].shape == (24, 3)
    assert type(bufs["full"]) is type(gpu._slab_bytes[0])
