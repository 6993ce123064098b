"""PagedKVCacheManager behaviours (spec/manager.md; reference note §11 items 1-13)."""

import math

import numpy as np
import pytest

from kvref import PagedKVCacheManager, check_invariants
from kvspec import (
    BlockCount,
    ByteCount,
    CompletedTransfer,
    InsufficientBlocksError,
    KVCacheInputs,
    KVCacheInputsPerDevice,
    KVCacheMetrics,
    KVCacheParams,
    LeafSpec,
    PrefixCacheHits,
    TextContext,
    block_hashes,
)

from _pool_sizes import holdable

PAGE = 4


def make(num_blocks=9, page=PAGE, dp=1, leaves=None, caching=True, max_batch_size=4, max_seq_len=None, **kw):
    params = KVCacheParams(page_size=page, num_layers=2, kv_heads=1, head_dim=2, dtype="float32",
                           data_parallel_degree=dp, enable_prefix_caching=caching, leaves=leaves)
    if max_seq_len is None:  # the longest the pool holds, at most 64 tokens
        max_seq_len = holdable(PagedKVCacheManager, params, num_blocks)
    return PagedKVCacheManager(params, num_blocks=num_blocks, max_batch_size=max_batch_size,
                               max_seq_len=max_seq_len, **kw)


def run_prompt(m, rid, tokens, replica=0, release=True, decode=0):
    """claim, alloc, one forward (update + step), optional decode steps, release."""
    ctx = TextContext(rid, tokens)
    m.claim(ctx, replica)
    m.alloc(ctx)
    ctx.update(1000 + len(ctx))
    m.step(ctx)
    for _ in range(decode):
        m.alloc(ctx)
        ctx.update(1000 + len(ctx))
        m.step(ctx)
    check_invariants(m)
    if release:
        m.release(ctx)
        check_invariants(m)
    return ctx


# --------------------------------------------------------------------------- 1. claim discipline


def test_claim_contains_release_cycle():
    m = make()
    ctx = TextContext("a", [1, 2, 3])
    assert not m.contains(ctx) and not m.contains("a")
    m.claim(ctx)
    assert m.contains(ctx) and m.contains("a")
    assert m.get_req_blocks_per_leaf(ctx) == {"full": []}
    m.release("a")  # a request id is accepted too
    assert not m.contains(ctx)
    m.claim(ctx, 0)  # claimable again after release
    m.release(ctx)


def test_claim_pins_the_replica():
    m = make(dp=2)
    ctx = TextContext("a", [1, 2, 3, 4, 5])
    m.claim(ctx, 1)
    m.alloc(ctx)
    assert m.block_count(1).used == 2 and m.block_count(0).used == 0
    with pytest.raises(ValueError, match="already claimed, on replica 1"):
        m.claim(ctx, 0)


# --------------------------------------------------------------------------- 2. exact sizing


@pytest.mark.parametrize("n,blocks", [(1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_fresh_prompt_holds_ceil_blocks(n, blocks):
    m = make()
    ctx = TextContext("a", list(range(n)))
    m.claim(ctx)
    assert isinstance(m.alloc(ctx), CompletedTransfer)
    assert len(m.get_req_blocks_per_leaf(ctx)["full"]) == blocks == m.num_req_blocks(ctx)
    assert m.block_count().used == blocks


def test_decode_adds_a_block_only_at_a_page_crossing():
    m = make()
    ctx = TextContext("a", [1, 2, 3])
    m.claim(ctx)
    sizes = []
    for t in range(8):
        m.alloc(ctx)
        sizes.append(len(m.get_req_blocks_per_leaf(ctx)["full"]))
        ctx.update(50 + t)
        m.step(ctx)
    # current_position 3,4,5,...,10 -> ceil(/4)
    assert sizes == [math.ceil(p / PAGE) for p in range(3, 11)]
    check_invariants(m)


def test_alloc_is_idempotent():
    m = make()
    ctx = TextContext("a", list(range(6)))
    m.claim(ctx)
    m.alloc(ctx)
    before = (m.get_req_blocks_per_leaf(ctx), m.block_count(), m.get_metrics_aggregated())
    m.alloc(ctx)
    assert (m.get_req_blocks_per_leaf(ctx), m.block_count(), m.get_metrics_aggregated()) == before


def test_first_block_ids_and_block_count():
    m = make(num_blocks=10)
    assert m.block_count() == BlockCount(9, 9)
    ctx = TextContext("a", [1, 2, 3])
    m.claim(ctx)
    m.alloc(ctx)
    assert m.get_req_blocks_per_leaf(ctx) == {"full": [1]}
    assert m.block_count() == BlockCount(8, 9)


# --------------------------------------------------------------------------- 3. atomic out-of-blocks


def test_out_of_blocks_rolls_back_everything_and_retry_succeeds():
    m = make(num_blocks=7)  # 6 usable
    prefix = list(range(8))
    run_prompt(m, "warm", prefix + [99])  # publishes 2 blocks
    hog = TextContext("hog", list(range(100, 116)))  # 4 blocks, unrelated
    m.claim(hog)
    m.alloc(hog)
    ctx = TextContext("b", prefix + list(range(200, 210)))  # 18 tokens: 5 blocks, 2 reusable
    m.claim(ctx)
    counts, metrics = m.block_count(), m.get_metrics_aggregated()
    free_order = m._free_order()
    with pytest.raises(InsufficientBlocksError, match=r"needs 3 blocks of leaf 'full', 0 free or evictable"):
        m.alloc(ctx)
    assert m.block_count() == counts and m.get_metrics_aggregated() == metrics
    assert m._free_order() == free_order
    assert (ctx.processed_length, ctx.active_length, ctx.cached_prefix_length) == (0, 18, 0)
    assert m.get_req_blocks_per_leaf(ctx) == {"full": []}
    check_invariants(m)
    m.release(hog)
    m.alloc(ctx)
    assert ctx.processed_length == 8 and ctx.cached_prefix_length == 8
    assert m.get_metrics_aggregated().cache_tokens == 8
    check_invariants(m)


def test_larger_than_pool_always_raises():
    # spec/manager.md §1.6: a pool that can never hold a max_seq_len request is refused up front ...
    with pytest.raises(ValueError, match=r"max_seq_len=64 needs 16 pages of leaf 'full' for one request, "
                                         r"the pool has 2 \(num_blocks=3"):
        make(num_blocks=3, max_seq_len=64)
    # ... and a context larger than what is free raises, nothing drawn.
    m = make(num_blocks=3)
    assert m.effective_max_seq_length == 8
    held = TextContext("h", [7])
    m.claim(held)
    m.alloc(held)
    ctx = TextContext("a", list(range(8)))
    m.claim(ctx)
    with pytest.raises(InsufficientBlocksError):
        m.alloc(ctx)
    assert m.block_count() == BlockCount(1, 2)
    m.release(held)
    m.alloc(ctx)


# --------------------------------------------------------------------------- 4. hit semantics


@pytest.mark.parametrize("p", [1, 3, 4, 5, 8, 9, 12, 13])
def test_repeated_prompt_reuses_floor_p_minus_1_over_page(p):
    m = make(num_blocks=12)
    tokens = list(range(10, 10 + p))
    run_prompt(m, "a", tokens)
    ctx = TextContext("b", tokens)
    m.claim(ctx)
    m.alloc(ctx)
    k = (p - 1) // PAGE
    assert ctx.processed_length == ctx.cached_prefix_length == k * PAGE
    assert ctx.active_length == p - k * PAGE >= 1  # the last token is never a hit
    assert m.get_metrics_aggregated().cache_tokens == k * PAGE
    check_invariants(m)


def test_shared_system_prefix_reuses_exactly_the_prefix_blocks():
    m = make(num_blocks=16)
    system = list(range(8))  # 2 blocks
    run_prompt(m, "a", system + [50, 51, 52, 53, 54, 55])
    ctx = TextContext("b", system + [60, 61, 62, 63, 64, 65])
    m.claim(ctx)
    m.alloc(ctx)
    assert ctx.cached_prefix_length == 8
    hits = m.get_prefix_cache_hit_counts(TextContext("probe", system + [70, 71, 72, 73, 74]))
    assert hits == [PrefixCacheHits(2, 0)]


def test_hit_stops_at_first_non_resident_block_and_verifies_tokens():
    m = make(num_blocks=16)
    run_prompt(m, "a", list(range(13)))  # blocks 0,1,2 published
    ctx = TextContext("b", list(range(4)) + [77, 5, 6, 7] + list(range(8, 13)))
    m.claim(ctx)
    m.alloc(ctx)
    assert ctx.cached_prefix_length == 4  # block 1 differs, block 2's hash chain differs too


def test_salt_separates_caches():
    m = make(num_blocks=16)
    run_prompt(m, "a", list(range(9)))
    ctx = TextContext("b", list(range(9)), cache_salt="tenant-2")
    m.claim(ctx)
    m.alloc(ctx)
    assert ctx.cached_prefix_length == 0
    same = TextContext("c", list(range(9)), cache_salt=b"")  # empty salt == no salt
    m.claim(same)
    m.alloc(same)
    assert same.cached_prefix_length == 8


def test_hash_chain_is_kvspec_block_hashes():
    m = make(num_blocks=16)
    toks = list(range(9))
    ctx = run_prompt(m, "a", toks, release=False)
    pool = m._pools[0]["full"]
    hs = block_hashes(toks, PAGE, hash_seed=0)
    rows = m.get_req_blocks_per_leaf(ctx)["full"]
    assert [pool.block_hash[b] for b in rows[:2]] == hs


def test_reuse_only_at_the_reuse_point():
    m = make(num_blocks=16)
    run_prompt(m, "a", list(range(9)))
    ctx = TextContext("b", list(range(9)))
    m.claim(ctx)
    ctx.chunk(3)  # scheduler chunked before alloc: at most active-1 tokens can be reused
    m.alloc(ctx)
    assert ctx.processed_length == 0 and ctx.cached_prefix_length == 0
    assert len(m.get_req_blocks_per_leaf(ctx)["full"]) == 1


def test_caching_off_never_hits():
    m = make(caching=False, num_blocks=16)
    run_prompt(m, "a", list(range(9)))
    ctx = TextContext("b", list(range(9)))
    m.claim(ctx)
    m.alloc(ctx)
    assert ctx.cached_prefix_length == 0
    assert m.get_prefix_cache_hit_counts(ctx) == [PrefixCacheHits(0, 0)]
    assert m.chunk_alignment_tokens == 0


# --------------------------------------------------------------------------- 5. commit on step, twins


def test_blocks_hittable_only_after_step():
    m = make(num_blocks=16)
    a = TextContext("a", list(range(9)))
    m.claim(a)
    m.alloc(a)
    assert m.get_prefix_cache_hit_counts(TextContext("p", list(range(9))))[0].device_blocks == 0
    a.update(5)
    m.step(a)
    assert m.get_prefix_cache_hit_counts(TextContext("p", list(range(9))))[0].device_blocks == 2


def test_twin_dedup_swaps_to_the_published_copy():
    m = make(num_blocks=16)
    toks = list(range(9))
    a, b = TextContext("a", toks), TextContext("b", toks)
    m.claim(a)
    m.claim(b)
    m.alloc(a)
    m.alloc(b)  # both computed the same prompt concurrently
    a.update(1)
    m.step(a)
    b.update(1)
    m.step(b)
    ra, rb = m.get_req_blocks_per_leaf(a)["full"], m.get_req_blocks_per_leaf(b)["full"]
    assert ra[:2] == rb[:2]  # b now shares a's published blocks
    assert m._pools[0]["full"].ref_count[ra[0]] == 2
    assert m.block_count().used == 2 + 1 + 1  # shared 2 + each private tail
    check_invariants(m)


def test_looped_prompt_never_leaks():
    m = make(num_blocks=8)
    for i in range(60):
        run_prompt(m, f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], decode=2)
    assert m.block_count().used == 0
    met = m.get_metrics_aggregated()
    assert met.cache_hit_rate > 0.5
    check_invariants(m)


# --------------------------------------------------------------------------- 6. tail-first LRU release


def test_released_chain_tail_evicted_before_head():
    m = make(num_blocks=7)  # 6 usable
    chain = list(range(13))  # 3 full hashed blocks + 1
    run_prompt(m, "a", chain)
    assert m.get_prefix_cache_hit_counts(TextContext("p", chain))[0].device_blocks == 3
    # unrelated traffic that needs 3 + 1 pages: all 3 fresh pages go first, then the tail
    for i, n in enumerate([4, 4, 4]):
        c = TextContext(f"u{i}", [500 + 10 * i + j for j in range(n)])
        m.claim(c)
        m.alloc(c)
    left = m.get_prefix_cache_hit_counts(TextContext("p", chain))[0].device_blocks
    assert left == 3  # 3 unpublished free pages were used first
    c = TextContext("u9", [900, 901])
    m.claim(c)
    m.alloc(c)
    assert m.get_prefix_cache_hit_counts(TextContext("p", chain))[0].device_blocks == 2  # tail gone, head kept
    check_invariants(m)


def test_freed_uncommitted_blocks_reused_before_committed():
    m = make(num_blocks=9)
    a = run_prompt(m, "a", list(range(9)))
    b = TextContext("b", [100, 101, 102])
    m.claim(b)
    m.alloc(b)
    assert m.get_req_blocks_per_leaf(b) == {"full": [3]}  # a's unpublished tail page came first
    m.release(b)  # unpublished: back to the front
    assert m._free_order()[0] == 3 and m._free_order()[-2:] == [2, 1]  # a's chain: tail 2 before head 1
    c = TextContext("c", [200, 201, 202])
    m.claim(c)
    m.alloc(c)
    assert m.get_prefix_cache_hit_counts(TextContext("p", list(a.tokens[:9])))[0].device_blocks == 2


# --------------------------------------------------------------------------- 7. sharing, reset


def test_refcounts_under_sharing_and_reset_keeps_live_blocks():
    m = make(num_blocks=16)
    run_prompt(m, "a", list(range(9)))
    b = TextContext("b", list(range(9)) + [40])
    m.claim(b)
    m.alloc(b)
    c = TextContext("c", list(range(9)) + [41])
    m.claim(c)
    m.alloc(c)
    rb, rc = m.get_req_blocks_per_leaf(b)["full"], m.get_req_blocks_per_leaf(c)["full"]
    assert rb[:2] == rc[:2] and m._pools[0]["full"].ref_count[rb[0]] == 2
    run_prompt(m, "d", [70, 71, 72, 73, 74])  # published, then unreferenced
    m.reset_prefix_cache()
    check_invariants(m)
    assert m.get_prefix_cache_hit_counts(TextContext("p", [70, 71, 72, 73, 74]))[0].device_blocks == 0
    assert m.get_prefix_cache_hit_counts(TextContext("p", list(range(9)) + [1]))[0].device_blocks == 2
    m.release(b)
    m.release(c)
    m.reset_prefix_cache()
    assert m.get_prefix_cache_hit_counts(TextContext("p", list(range(10))))[0].device_blocks == 0
    assert m.block_count().used == 0


# --------------------------------------------------------------------------- 8. null block and dummies


def test_null_block_never_handed_out_and_dummies_change_nothing():
    m = make(num_blocks=5)
    d = TextContext("dummy", list(range(7)))
    before = m.block_count()
    m.alloc_dummy(d, 0)
    assert m.contains(d)
    assert m.get_req_blocks_per_leaf(d) == {"full": [0, 0]}
    assert m.block_count() == before
    assert isinstance(m.alloc(d), CompletedTransfer) and m.block_count() == before
    m.step(d)
    ctx = TextContext("a", list(range(16)))
    m.claim(ctx)
    m.alloc(ctx)
    assert 0 not in m.get_req_blocks_per_leaf(ctx)["full"]
    inp = m.runtime_inputs([[d, ctx]]).inputs[0]
    assert inp.lookup_table[0].tolist() == [0] * 8
    m.release(d)
    assert m.block_count().used == 4
    check_invariants(m)


# --------------------------------------------------------------------------- 9. runtime inputs


def test_runtime_inputs_tensors():
    m = make(num_blocks=40, max_seq_len=128)
    a = TextContext("a", list(range(5)))
    b = TextContext("b", list(range(100, 137)))  # 37 tokens -> 10 blocks
    for c in (a, b):
        m.claim(c)
        m.alloc(c)
    out = m.runtime_inputs([[a, b]])
    assert isinstance(out, KVCacheInputs) and len(out) == 1
    inp = out.inputs[0]
    assert isinstance(inp, KVCacheInputsPerDevice)
    assert inp.kv_blocks is m.get_device_buffer(0)
    assert inp.kv_blocks.shape == (40, 2, 2, PAGE, 1, 2) and inp.kv_blocks.dtype == np.float32
    assert inp.lookup_table.dtype == np.uint32 and inp.lookup_table.shape == (2, 16)
    ra, rb = m.get_req_blocks_per_leaf(a)["full"], m.get_req_blocks_per_leaf(b)["full"]
    assert inp.lookup_table[0].tolist() == ra + [0] * 14
    assert inp.lookup_table[1].tolist() == rb + [0] * 6
    assert inp.cache_lengths.dtype == np.uint32 and inp.cache_lengths.tolist() == [0, 0]
    assert inp.max_prompt_length == 37 and inp.max_cache_length == 37
    a.update(9)
    m.step(a)
    m.alloc(a)
    inp = m.runtime_inputs([[a]], max_cache_length=65).inputs[0]
    assert inp.lookup_table.shape == (1, 24)  # ceil(65/4)=17 -> 24
    assert inp.cache_lengths.tolist() == [5] and inp.max_prompt_length == 1 and inp.max_cache_length == 65


def test_runtime_inputs_exact_boundary():
    m = make()
    ctx = TextContext("a", list(range(4)))
    m.claim(ctx)
    m.alloc(ctx)
    m.runtime_inputs([[ctx]])  # 4 tokens in 1 block pass
    ctx.update(1)  # 5 tokens need 2 blocks
    m.step(ctx)
    with pytest.raises(ValueError, match="does not have sufficient blocks"):
        m.runtime_inputs([[ctx]])
    m.alloc(ctx)
    m.runtime_inputs([[ctx]])


def test_runtime_inputs_empty_batch_is_allowed_for_paged_leaves():
    m = make(dp=2)
    a = TextContext("a", [1, 2, 3])
    m.claim(a, 1)
    m.alloc(a)
    out = m.runtime_inputs([[], [a]])
    assert out.inputs[0].lookup_table.shape == (0, 8)
    assert out.inputs[0].max_prompt_length == 0
    assert out.inputs[1].lookup_table[0, 0] == m.get_req_blocks_per_leaf(a)["full"][0]


# --------------------------------------------------------------------------- 10. replicas


def test_two_replicas_keep_ids_counts_and_tables_apart():
    m = make(dp=2, num_blocks=9)
    a = TextContext("a", list(range(9)))
    b = TextContext("b", list(range(100, 105)))
    m.claim(a, 0)
    m.claim(b, 1)
    m.alloc(a)
    m.alloc(b)
    assert m.get_req_blocks_per_leaf(a) == {"full": [1, 2, 3]}
    assert m.get_req_blocks_per_leaf(b) == {"full": [1, 2]}  # same ids, other memory
    assert m.block_count(0).used == 3 and m.block_count(1).used == 2
    out = m.runtime_inputs([[a], [b]])
    assert out.inputs[0].lookup_table[0, :3].tolist() == [1, 2, 3]
    assert out.inputs[1].lookup_table[0, :2].tolist() == [1, 2]
    assert out.inputs[0].kv_blocks is not out.inputs[1].kv_blocks
    m.reset_prefix_cache()
    assert m.block_count(0).used == 3  # live blocks survive reset
    check_invariants(m)


def test_full_replica_never_borrows():
    m = make(dp=2, num_blocks=3)
    a = TextContext("a", list(range(8)))
    m.claim(a, 0)
    m.alloc(a)
    b = TextContext("b", [1, 2])
    m.claim(b, 0)
    with pytest.raises(InsufficientBlocksError):
        m.alloc(b)
    assert m.block_count(1).used == 0


def test_cross_replica_copy_of_a_peer_held_prefix():
    m = make(dp=2, num_blocks=12)
    toks = list(range(13))
    a = TextContext("a", toks)
    m.claim(a, 0)
    m.alloc(a)
    buf0 = m.get_device_buffer(0)
    rows = m.get_req_blocks_per_leaf(a)["full"]
    for i, blk in enumerate(rows):
        buf0[blk] = i + 1  # the forward's K/V
    a.update(5)
    m.step(a)
    assert m.get_prefix_cache_hit_counts(TextContext("p", toks)) == [PrefixCacheHits(3, 0), PrefixCacheHits(3, 0)]
    b = TextContext("b", toks)
    m.claim(b, 1)
    m.alloc(b)
    assert b.cached_prefix_length == 12
    rb = m.get_req_blocks_per_leaf(b)["full"]
    buf1 = m.get_device_buffer(1)
    for i in range(3):
        assert np.array_equal(buf1[rb[i]], buf0[rows[i]])
    met = m.get_metrics_aggregated()
    assert met.cross_replica_blocks_copied == 3
    assert met.cross_replica_bytes_copied == 3 * m.params.page_bytes()
    assert met.device_blocks_served == 3
    check_invariants(m)
    # now published locally on replica 1 too
    c = TextContext("c", toks)
    m.claim(c, 1)
    m.alloc(c)
    assert m.get_metrics_aggregated().cross_replica_blocks_copied == 3


# --------------------------------------------------------------------------- 11. sliding windows


SW = {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(5)}  # window 5, page 4: 1 block in window


def test_sliding_window_nulls_blocks_below_the_window_after_step():
    m = make(num_blocks=20, leaves=SW)
    ctx = TextContext("a", list(range(13)))
    m.claim(ctx)
    m.alloc(ctx)
    rows = m.get_req_blocks_per_leaf(ctx)
    assert len(rows["full"]) == len(rows["swa"]) == 4
    used = m._pools[0]["swa"].num_usable - m._pools[0]["swa"].num_free
    ctx.update(1)  # processed 13 -> filled 3 blocks; window needs block 2 only
    m.step(ctx)
    rows2 = m.get_req_blocks_per_leaf(ctx)
    assert rows2["swa"][:2] == [0, 0] and rows2["swa"][2:] == rows["swa"][2:]
    assert rows2["full"] == rows["full"]
    assert m._pools[0]["swa"].num_usable - m._pools[0]["swa"].num_free == used - 2
    inp = m.runtime_inputs_for_leaf("swa", [[ctx]]).inputs[0]
    assert inp.lookup_table[0, :2].tolist() == [0, 0]
    both = m.runtime_inputs([[ctx]]).inputs[0]
    assert set(both) == {"full", "swa"}
    check_invariants(m)


def test_sliding_hit_needs_the_window_and_nulls_below_it():
    m = make(num_blocks=20, leaves=SW)
    toks = list(range(17))  # 4 hashed blocks
    run_prompt(m, "a", toks)  # after step: swa blocks 0..2 freed (published), 3 kept
    ctx = TextContext("b", toks)
    m.claim(ctx)
    m.alloc(ctx)
    assert ctx.cached_prefix_length == 16
    rows = m.get_req_blocks_per_leaf(ctx)
    assert rows["swa"][:3] == [0, 0, 0] and rows["swa"][3] != 0
    check_invariants(m)


def test_sliding_hole_spoils_the_window_above_but_not_the_root_run():
    m = make(num_blocks=20, leaves=SW)
    toks = list(range(17))
    run_prompt(m, "a", toks)
    # evict the swa page of block 3 (the window of a 16-token hit): unpublish it directly
    swa = m._pools[0]["swa"]
    h3 = block_hashes(toks, PAGE)[3]
    page3 = swa.hash_to_block[h3]
    swa._unpublish(page3)
    ctx = TextContext("b", toks)
    m.claim(ctx)
    m.alloc(ctx)
    # hit 4 needs swa block 3: gone; hit 3 needs swa block 2: resident
    assert ctx.cached_prefix_length == 12
    check_invariants(m)


def test_joint_hit_is_a_fixed_point_not_a_minimum():
    from kvref._leaves import Leaf, joint_hit

    full = Leaf.make("full", LeafSpec.full(), 4)
    swa = Leaf.make("swa", LeafSpec.sliding_window(9), 4)  # 2 blocks in window

    class Res:  # the Residency surface: resident(i), the run from the root, a span, the deepest
        def __init__(self, held):
            self.held = held

        def __call__(self, i):
            return i in self.held

        def run(self, k):
            return next((i for i in range(k) if i not in self.held), k)

        def span(self, lo, k):
            return next((i for i in range(lo, k) if i not in self.held), k) - lo

        def deepest(self, k):
            return next((j for j in range(k, 0, -1) if j - 1 in self.held), 0)

    full_res = {0, 1, 2, 3, 4, 5}
    swa_res = {0, 1, 3, 4}  # hole at 2: hits 5 (needs 3,4) ok; 3 needs 1,2 no; 2 needs 0,1 ok
    res = {"full": Res(full_res), "swa": Res(swa_res)}
    assert joint_hit([full, swa], 6, res) == 5
    rec = Leaf.make("rec", LeafSpec.recurrent((2,)), 4)
    res["rec"] = Res({3})  # checkpoint after block 3 -> hit 4: swa needs 2,3 -> no
    assert joint_hit([full, swa, rec], 6, res) == 0
    res["rec"] = Res({1, 3})  # hit 2: swa needs 0,1 -> ok
    assert joint_hit([full, swa, rec], 6, res) == 2


# --------------------------------------------------------------------------- recurrent leaves


REC = {"full": LeafSpec.full(), "rec": LeafSpec.recurrent((3,))}


def test_recurrent_checkpoint_at_page_boundaries_and_restore():
    m = make(num_blocks=20, leaves=REC)
    assert m.chunk_alignment_tokens == PAGE
    ctx = TextContext("a", list(range(10)))
    m.claim(ctx)
    ctx.chunk(8)  # chunk cut at a page boundary (chunk_alignment_tokens)
    m.alloc(ctx)
    rows = m.get_req_blocks_per_leaf(ctx)
    live = rows["rec"][0]
    assert len(rows["rec"]) == 2
    buf = m.get_device_buffer(0)["rec"]
    # spec/manager.md §13: the state leaf's pages are the slab's huge blocks cut at its ratio
    assert buf.shape == (20 * m.slab_geometry.ratios["rec"], 3) and not buf[live].any()
    buf[live] = [8.0, 8.0, 8.0]  # the state after 8 tokens
    ctx.advance_chunk()
    m.step(ctx)  # processed 8: checkpoint under h_1
    rows2 = m.get_req_blocks_per_leaf(ctx)
    assert rows2["rec"] == [rows["rec"][1]]
    assert np.array_equal(buf[rows2["rec"][0]], [8.0, 8.0, 8.0])
    m.alloc(ctx)
    assert len(m.get_req_blocks_per_leaf(ctx)["rec"]) == 2
    m.release(ctx)
    b = TextContext("b", list(range(10)))
    m.claim(b)
    m.alloc(b)
    assert b.cached_prefix_length == 8
    assert np.array_equal(buf[m.get_req_blocks_per_leaf(b)["rec"][0]], [8.0, 8.0, 8.0])
    check_invariants(m)


def test_recurrent_without_checkpoint_misses():
    m = make(num_blocks=20, leaves=REC)
    run_prompt(m, "a", list(range(10)))  # processed 10: no boundary, no checkpoint
    b = TextContext("b", list(range(10)))
    m.claim(b)
    m.alloc(b)
    assert b.cached_prefix_length == 0


def test_recurrent_runtime_inputs_need_a_batch():
    m = make(num_blocks=20, leaves=REC)
    with pytest.raises(ValueError, match="empty batch"):
        m.runtime_inputs([[]])
    ctx = TextContext("a", [1, 2, 3])
    m.claim(ctx)
    m.alloc(ctx)
    inp = m.runtime_inputs_for_leaf("rec", [[ctx]]).inputs[0]
    assert inp.lookup_table[0, 0] == m.get_req_blocks_per_leaf(ctx)["rec"][0]


# --------------------------------------------------------------------------- 12. counts, pressure


def test_block_count_and_pressure():
    m = make(num_blocks=11)
    assert m.pressure_pct() == 0.0
    seen = []
    ctxs = []
    for i in range(5):
        c = TextContext(f"r{i}", list(range(100 * i, 100 * i + 8)))
        m.claim(c)
        m.alloc(c)
        ctxs.append(c)
        seen.append(m.pressure_pct())
    assert seen == sorted(seen) and seen[-1] == 100.0
    bc = m.block_count()
    assert bc == BlockCount(0, 10) and bc.used_pct == 100.0 and bc.free_pct == 0.0
    for c in ctxs:
        c.update(1)
        m.step(c)
        m.release(c)
    assert m.block_count() == BlockCount(10, 10)  # cached-unreferenced counts as free
    assert m.pressure_pct() == 0.0


def test_effective_max_seq_length_and_properties():
    m = make(num_blocks=9, max_seq_len=32)
    assert m.effective_max_seq_length == 32
    with pytest.raises(ValueError, match=r"max_seq_len=100 needs 25 pages of leaf 'full'"):
        make(num_blocks=9, max_seq_len=100)  # spec/manager.md §1.6
    assert make(num_blocks=90, max_seq_len=100).effective_max_seq_length == 100
    assert m.params.page_size == PAGE and m.chunk_alignment_tokens == 0


def test_null_tier_answers():
    m = make()
    assert m.host_byte_count() == ByteCount(0, 0) and m.disk_byte_count(0) == ByteCount(0, 0)
    assert m.pending_transfers_exist() is False
    m.poll_transfers()
    ctx = TextContext("a", list(range(9)))
    m.claim(ctx)
    assert m.starts_lookup(ctx) is False and m.start_lookup(ctx) is False
    assert m.awaits_lookup(ctx) is False and m.hand_back_lookup(ctx) is False
    assert isinstance(m.alloc(ctx, defer_lookup=True), CompletedTransfer)
    assert len(m.get_req_blocks_per_leaf(ctx)["full"]) == 3
    m.shutdown()


# --------------------------------------------------------------------------- 13. metrics


def test_metrics_get_keeps_take_clears():
    m = make(num_blocks=16)
    run_prompt(m, "a", [10, 11, 12, 13, 14])
    ctx = TextContext("b", [10, 11, 12, 13])  # page 4: reuse floor(3/4)=0
    m.claim(ctx)
    m.alloc(ctx)
    c = TextContext("c", [10, 11, 12, 13, 14, 15])
    m.claim(c)
    m.alloc(c)
    met = m.get_metrics_aggregated()
    # a: 5 + decode-free; b: 4; c: 6 - 4 reused
    assert met.input_tokens == 5 + 4 + 2 and met.cache_tokens == 4 and met.device_blocks_served == 1
    assert met.prompt_tokens == 15 and met.cache_hit_rate == pytest.approx(4 / 15)
    met.input_tokens = 10**6  # a snapshot, not a live object
    assert m.get_metrics_aggregated().input_tokens == 11
    taken = m.take_metrics_aggregated()
    assert taken.input_tokens == 11 and m.get_metrics_aggregated() == KVCacheMetrics()


def test_decode_counts_input_tokens_every_forward():
    m = make()
    ctx = run_prompt(m, "a", [1, 2, 3], release=False, decode=3)
    assert m.get_metrics_aggregated().input_tokens == 3 + 3
    assert ctx.processed_length == 6


# --------------------------------------------------------------------------- 14-15. connector plumbing

from kvspec import KVLoadFailed, KVLoadRefused  # noqa: E402


class Handle:
    """A real transfer handle: ``land()`` performs the copy; ``fail`` makes polls raise."""

    def __init__(self, action, fail=False):
        self.action, self.fail, self.done, self.polls = action, fail, False, 0

    def land(self):
        if not self.done and not self.fail:
            self.action()
            self.done = True

    def is_complete(self):
        self.polls += 1
        if self.fail:
            raise KVLoadFailed("DictConnector: injected copy failure")
        return self.done

    def synchronize(self):
        self.land()
        if self.fail:
            raise KVLoadFailed("DictConnector: injected copy failure")


class DictConnector:
    """A connector that keeps page bytes in a dict keyed by hash (a real tier, no mocks).

    ``asynchronous``: handles complete only on ``land()`` (or ``land_all()``).
    ``refuse``/``fail_post``/``fail_poll``: the next so many loads are refused,
    fail at post, or fail at their first poll.
    """

    name = "dict"

    def __init__(self, asynchronous=False, offload_async=False):
        self.asynchronous, self.offload_async = asynchronous, offload_async
        self.store = {}
        self.buffers = None
        self.refuse = self.fail_post = self.fail_poll = 0
        self.handles = []
        self.touched = []
        self.lookups = 0
        self.metrics_ = KVCacheMetrics()

    def attach(self, stores, params, *, owner=None):
        self.buffers = list(stores)  # one kvspec.PageStore per replica (spec/manager.md §1.4)

    def lookup(self, hashes, tokens, replica_idx=0):
        self.lookups += 1
        n = 0
        for h, t in zip(hashes, tokens):
            if h not in self.store or not np.array_equal(self.store[h][0], t):
                break
            n += 1
        return n

    def load(self, block_ids, hashes, tokens, replica_idx=0):
        if self.refuse:
            self.refuse -= 1
            self.metrics_.connector_loads_refused += 1
            raise KVLoadRefused("DictConnector: refused", block_hash=hashes[0])
        if self.fail_post:
            self.fail_post -= 1
            raise KVLoadFailed("DictConnector: failed at post")
        if any(h not in self.store for h in hashes):
            self.metrics_.connector_loads_refused += 1
            raise KVLoadRefused("DictConnector: evicted since lookup")
        store = self.buffers[replica_idx]
        pages = [self.store[h][1] for h in hashes]

        def copy():
            for b, p in zip(block_ids, pages):
                store.write([b], p[None])
            self.metrics_.h2d_bytes_copied += sum(p.nbytes for p in pages)

        fail = bool(self.fail_poll)
        self.fail_poll = max(0, self.fail_poll - 1)
        h = Handle(copy, fail=fail)
        if not self.asynchronous:
            h.land()
        self.handles.append(h)
        return h

    def offload(self, block_ids, hashes, tokens, replica_idx=0):
        buf = self.buffers[replica_idx]

        def copy():
            for b, hh, t in zip(block_ids, hashes, tokens):
                self.store[bytes(hh)] = (np.array(t), buf.read([b])[0].copy())
            self.metrics_.d2h_bytes_copied += buf.page_nbytes * len(block_ids)

        h = Handle(copy)
        if not self.offload_async:
            h.land()
        self.handles.append(h)
        return h

    def land_all(self):
        for h in self.handles:
            h.land()

    def touch(self, hashes, replica_idx=0):
        self.touched.append(list(hashes))

    def poll_transfers(self):
        return None

    def reset_prefix_cache(self):
        self.store.clear()

    def shutdown(self):
        self.land_all()

    def host_byte_count(self):
        n = sum(p.nbytes for _, p in self.store.values())
        return ByteCount(10**6 - n, 10**6)

    def disk_byte_count(self):
        return ByteCount(0, 0)

    @property
    def metrics(self):
        return self.metrics_.copy()

    def take_metrics(self):
        m, self.metrics_ = self.metrics_, KVCacheMetrics()
        return m


def forward(m, ctx):
    """Write K/V that depends on every token up to the position, then update + step."""
    rows = m.get_req_blocks_per_leaf(ctx)["full"]
    buf = m.get_device_buffer(ctx_replica(m, ctx))
    toks = ctx.tokens
    for p in range(ctx.processed_length, ctx.current_position):
        buf[rows[p // PAGE], :, :, p % PAGE] = kv_value(toks, p)
    ctx.update(int(toks[-1]) + 1)
    m.step(ctx)


def ctx_replica(m, ctx):
    return m._requests[ctx.request_id].replica


def kv_value(toks, p):
    return float((int(np.sum(np.asarray(toks[: p + 1], dtype=np.int64) * np.arange(1, p + 2))) % 1009) + p)


def assert_kv_correct(m, ctx):
    """Every processed position holds the K/V its prefix produces."""
    rows = m.get_req_blocks_per_leaf(ctx)["full"]
    buf = m.get_device_buffer(ctx_replica(m, ctx))
    for p in range(ctx.processed_length):
        assert np.all(buf[rows[p // PAGE], :, :, p % PAGE] == kv_value(ctx.tokens, p)), p


def evict_device(m):
    for pools in m._pools:
        for pool in pools.values():
            pool.reset_prefix_cache()


def offloaded(m, conn, toks, rid="w"):
    ctx = TextContext(rid, toks)
    m.claim(ctx)
    m.alloc(ctx)
    forward(m, ctx)
    m.release(ctx)
    m.poll_transfers()
    conn.land_all()
    m.poll_transfers()
    evict_device(m)
    return ctx


def test_offload_then_load_round_trip_bit_identical():
    conn = DictConnector()
    m = make(num_blocks=16, connector=conn)
    toks = list(range(13))
    offloaded(m, conn, toks)
    assert len(conn.store) == 3
    ctx = TextContext("b", toks)
    assert m.get_prefix_cache_hit_counts(ctx) == [PrefixCacheHits(0, 3)]
    m.claim(ctx)
    assert isinstance(m.alloc(ctx), CompletedTransfer)
    assert ctx.processed_length == 12 and ctx.cached_prefix_external_length == 12 and ctx.cached_prefix_length == 12
    assert_kv_correct(m, ctx)
    met = m.get_metrics_aggregated()
    assert met.cache_tokens == 12 and met.external_blocks_served == 3 and met.h2d_bytes_copied > 0
    assert met.device_blocks_served == 0
    check_invariants(m)
    # landed pages are published: a third request hits on the device
    c = TextContext("c", toks)
    m.claim(c)
    m.alloc(c)
    assert c.cached_prefix_length == 12 and c.cached_prefix_external_length == 0
    assert_kv_correct(m, c)


def test_device_hit_then_connector_for_the_rest_and_touch():
    conn = DictConnector()
    m = make(num_blocks=16, connector=conn)
    toks = list(range(13))
    offloaded(m, conn, toks)
    run_prompt(m, "d", toks[:5])  # device holds block 0 only
    conn.touched.clear()
    ctx = TextContext("b", toks)
    m.claim(ctx)
    m.alloc(ctx)
    assert ctx.cached_prefix_length == 12 and ctx.cached_prefix_external_length == 8
    assert [len(t) for t in conn.touched] == [1]  # device-served run, root-anchored
    m.release(ctx)
    assert len(conn.touched[-1]) == 3  # release re-ranks the whole committed sequence


def test_async_load_pins_and_publishes_only_after_landing():
    conn = DictConnector(asynchronous=True)
    m = make(num_blocks=16, connector=conn)
    toks = list(range(13))
    offloaded(m, conn, toks)
    ctx = TextContext("b", toks)
    m.claim(ctx)
    t = m.alloc(ctx)
    assert not t.is_complete() and m.pending_transfers_exist(0)
    rows = m.get_req_blocks_per_leaf(ctx)["full"]
    assert all(m._pools[0]["full"].ref_count[b] == 2 for b in rows[:3])  # row + pin
    assert m.get_prefix_cache_hit_counts(TextContext("p", toks))[0].device_blocks == 0  # unlanded: unpublished
    check_invariants(m)
    m.poll_transfers()
    assert m.pending_transfers_exist(0)
    t.land()
    m.poll_transfers()
    assert not m.pending_transfers_exist(0)
    assert m.get_prefix_cache_hit_counts(TextContext("p", toks))[0].device_blocks == 3
    assert_kv_correct(m, ctx)
    forward(m, ctx)
    check_invariants(m)


def test_alloc_drains_finished_transfers_first():
    conn = DictConnector(asynchronous=True)
    m = make(num_blocks=16, connector=conn)
    toks = list(range(13))
    offloaded(m, conn, toks)
    ctx = TextContext("b", toks)
    m.claim(ctx)
    t = m.alloc(ctx)
    t.land()
    m.alloc(ctx)  # drains: the load lands and unpins
    assert not m.pending_transfers_exist(0)
    check_invariants(m)


def test_refused_load_is_a_clean_miss():
    conn = DictConnector()
    m = make(num_blocks=16, connector=conn)
    toks = list(range(13))
    offloaded(m, conn, toks)
    conn.refuse = 1
    ctx = TextContext("b", toks)
    m.claim(ctx)
    assert isinstance(m.alloc(ctx), CompletedTransfer)
    assert ctx.processed_length == 0 and ctx.cached_prefix_external_length == 0
    assert m.get_metrics_aggregated().connector_loads_refused == 1
    assert len(m.get_req_blocks_per_leaf(ctx)["full"]) == 4 and not m.pending_transfers_exist()
    check_invariants(m)


def test_load_failure_at_post_is_a_miss_and_skips_the_connector():
    conn = DictConnector()
    m = make(num_blocks=16, connector=conn)
    toks = list(range(13))
    offloaded(m, conn, toks)
    run_prompt(m, "d", toks[:5])  # device hit of 1 block
    conn.fail_post = 1
    ctx = TextContext("b", toks)
    m.claim(ctx)
    m.alloc(ctx)
    assert ctx.processed_length == 4 and ctx.cached_prefix_external_length == 0
    assert m.get_metrics_aggregated().connector_load_failures == 1
    assert m.starts_lookup(ctx) is False
    check_invariants(m)


def test_load_failure_at_first_poll_is_a_miss():
    conn = DictConnector(asynchronous=True)
    m = make(num_blocks=16, connector=conn)
    toks = list(range(13))
    offloaded(m, conn, toks)
    conn.fail_poll = 1
    ctx = TextContext("b", toks)
    m.claim(ctx)
    assert isinstance(m.alloc(ctx), CompletedTransfer)
    assert ctx.processed_length == 0 and m.get_metrics_aggregated().connector_load_failures == 1
    assert not m.pending_transfers_exist()
    check_invariants(m)


def test_load_failure_seen_later_resplices_only_the_device_hit():
    conn = DictConnector(asynchronous=True)
    m = make(num_blocks=16, connector=conn)
    toks = list(range(13))
    offloaded(m, conn, toks)
    run_prompt(m, "d", toks[:5])  # loads block 0 asynchronously
    conn.land_all()
    m.poll_transfers()  # now published on the device
    ctx = TextContext("b", toks)
    m.claim(ctx)
    t = m.alloc(ctx)
    assert ctx.processed_length == 12 and not t.is_complete()
    before = m.get_metrics_aggregated()
    t.fail = True
    m.poll_transfers()  # unpinned, unpublished
    assert not m.pending_transfers_exist()
    assert m.get_prefix_cache_hit_counts(TextContext("p", toks))[0].device_blocks == 1
    check_invariants(m)
    m.alloc(ctx)
    assert ctx.processed_length == 4 and ctx.cached_prefix_length == 4 and ctx.cached_prefix_external_length == 0
    met = m.get_metrics_aggregated()
    assert met.connector_load_failures == 1
    assert met.cache_tokens == before.cache_tokens - 8
    forward(m, ctx)
    assert_kv_correct(m, ctx)
    check_invariants(m)


def test_forward_that_ran_past_a_failed_load_raises_at_next_alloc():
    conn = DictConnector(asynchronous=True)
    m = make(num_blocks=16, connector=conn)
    toks = list(range(13))
    offloaded(m, conn, toks)
    ctx = TextContext("b", toks)
    m.claim(ctx)
    t = m.alloc(ctx)
    t.fail = True
    ctx.update(99)
    m.step(ctx)  # the forward ran although the load had not landed
    with pytest.raises(RuntimeError, match="ran past") as ei:
        m.alloc(ctx)
    assert isinstance(ei.value.__cause__, KVLoadFailed)
    m.release(ctx)
    assert m.block_count().used == 0 and not m.pending_transfers_exist()
    check_invariants(m)


def test_release_during_load_leaks_nothing():
    for fail in (False, True):
        conn = DictConnector(asynchronous=True)
        m = make(num_blocks=16, connector=conn)
        toks = list(range(13))
        offloaded(m, conn, toks)
        ctx = TextContext("b", toks)
        m.claim(ctx)
        t = m.alloc(ctx)
        m.release(ctx)
        assert m.pending_transfers_exist() and m.block_count().used == 3  # pinned
        check_invariants(m)
        t.fail = fail
        t.land()
        m.poll_transfers()
        assert not m.pending_transfers_exist() and m.block_count().used == 0
        hits = m.get_prefix_cache_hit_counts(TextContext("p", toks))[0].device_blocks
        assert hits == (0 if fail else 3)
        check_invariants(m)


def test_offload_sources_pinned_until_complete_and_survive_reset():
    conn = DictConnector(offload_async=True)
    m = make(num_blocks=16, connector=conn)
    ctx = TextContext("a", list(range(9)))
    m.claim(ctx)
    m.alloc(ctx)
    forward(m, ctx)
    m.release(ctx)
    assert not m.pending_transfers_exist()  # queued, not posted
    m.runtime_inputs([[]])  # posts the queued offloads
    assert m.pending_transfers_exist()
    assert m.block_count().used == 2
    m.reset_prefix_cache()  # pinned pages stay published
    assert m.get_prefix_cache_hit_counts(TextContext("p", list(range(9))))[0].device_blocks == 2
    conn.land_all()
    assert m.pending_transfers_exist()
    m.poll_transfers()
    assert not m.pending_transfers_exist() and m.block_count().used == 0
    assert len(conn.store) == 2
    check_invariants(m)


def test_offload_truncates_at_the_first_evicted_hash():
    conn = DictConnector()
    m = make(num_blocks=16, connector=conn)
    ctx = TextContext("a", list(range(13)))
    m.claim(ctx)
    m.alloc(ctx)
    forward(m, ctx)
    m.release(ctx)
    pool = m._pools[0]["full"]
    h1 = block_hashes(list(range(13)), PAGE)[1]
    pool._unpublish(pool.hash_to_block[h1])
    m.poll_transfers()
    assert len(conn.store) == 1


def test_deferred_lookup_flow():
    conn = DictConnector()
    m = make(num_blocks=16, connector=conn)
    toks = list(range(13))
    offloaded(m, conn, toks)
    ctx = TextContext("b", toks)
    m.claim(ctx)
    asked = conn.lookups
    assert m.starts_lookup(ctx) is True and conn.lookups == asked  # starts_lookup does not ask
    assert isinstance(m.alloc(ctx, defer_lookup=True), CompletedTransfer)
    assert ctx.processed_length == 0 and len(m.get_req_blocks_per_leaf(ctx)["full"]) == 4
    assert not m.awaits_lookup(ctx) and m.starts_lookup(ctx)
    used = m.block_count().used
    assert m.start_lookup(ctx) is True and m.awaits_lookup(ctx)
    assert m.block_count().used == used  # a lookup reserves nothing
    assert m.start_lookup(ctx) is False  # one outstanding at a time
    m.alloc(ctx)
    assert not m.awaits_lookup(ctx)
    assert ctx.processed_length == 12 and ctx.cached_prefix_external_length == 12
    assert m.get_metrics_aggregated().input_tokens == 13 + 1  # warm-up 13; b's forward counted once, after the skip
    assert_kv_correct(m, ctx)
    check_invariants(m)


def test_hand_back_lookup_is_always_safe():
    conn = DictConnector()
    m = make(num_blocks=16, connector=conn)
    toks = list(range(13))
    offloaded(m, conn, toks)
    ctx = TextContext("b", toks)
    m.claim(ctx)
    m.alloc(ctx, defer_lookup=True)
    m.start_lookup(ctx)
    assert m.hand_back_lookup(ctx) is True and not m.awaits_lookup(ctx)
    assert m.hand_back_lookup(ctx) is False
    m.alloc(ctx)
    assert ctx.processed_length == 0  # no load for this admission
    forward(m, ctx)
    check_invariants(m)
    m.release(ctx)
    # fresh request: lookup before any alloc, then alloc uses it
    c = TextContext("c", list(range(13)) + [1])
    evict_device(m)
    m.claim(c)
    assert m.start_lookup(c) is True
    m.alloc(c)
    assert c.cached_prefix_external_length == 12


def test_shutdown_posts_queued_offloads_and_waits():
    conn = DictConnector(offload_async=True)
    m = make(num_blocks=16, connector=conn)
    ctx = TextContext("a", list(range(9)))
    m.claim(ctx)
    m.alloc(ctx)
    forward(m, ctx)
    m.shutdown()
    assert len(conn.store) == 2 and not m.pending_transfers_exist()


def test_default_connector_is_tiered_when_params_ask_for_tiers():
    from kvref import TieredConnector

    params = KVCacheParams(page_size=PAGE, num_layers=2, kv_heads=1, head_dim=2, dtype="float32",
                           host_offload_bytes=64 * 1024)
    m = PagedKVCacheManager(params, num_blocks=17, max_batch_size=4, max_seq_len=64)
    assert isinstance(m._connector, TieredConnector)
    assert m.host_byte_count().total > 0
    toks = list(range(13))
    ctx = TextContext("a", toks)
    m.claim(ctx)
    m.alloc(ctx)
    forward(m, ctx)
    m.release(ctx)
    m.poll_transfers()
    for off in list(m._offloads):
        off.handle.synchronize()
    m.poll_transfers()
    evict_device(m)
    b = TextContext("b", toks)
    assert m.get_prefix_cache_hit_counts(b) == [PrefixCacheHits(0, 3)]
    m.claim(b)
    t = m.alloc(b)
    t.synchronize()
    m.poll_transfers()
    assert b.cached_prefix_external_length == 12
    assert_kv_correct(m, b)
    check_invariants(m)
    m.shutdown()


# --------------------------------------------------------------------------- the guide's examples run


def test_docs_manager_examples_run(capsys):
    import os
    import re

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "manager.md")
    with open(path, encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    assert len(blocks) >= 3
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/manager.md[{i}]", "exec"), {"__name__": "__docs__"})
    assert "hit rate" in capsys.readouterr().out


# --------------------------------------------------------------------------- regressions found by the machines


def test_repeated_alloc_returns_the_load_still_in_flight():
    conn = DictConnector(asynchronous=True)
    m = make(num_blocks=16, connector=conn)
    toks = list(range(13))
    offloaded(m, conn, toks)
    ctx = TextContext("b", toks)
    m.claim(ctx)
    t = m.alloc(ctx)
    assert not t.is_complete()
    assert m.alloc(ctx) is t  # still cordoned
    t.land()
    assert isinstance(m.alloc(ctx), CompletedTransfer)
    assert_kv_correct(m, ctx)


def test_peer_extension_takes_blocks_still_held_locally_after_a_hole():
    m = make(dp=2, num_blocks=12)
    toks = list(range(13))
    a = TextContext("a", toks)
    m.claim(a, 0)
    m.alloc(a)
    forward(m, a)
    b = TextContext("b", toks)
    m.claim(b, 1)
    m.alloc(b)
    rb = m.get_req_blocks_per_leaf(b)["full"]
    m.release(b)
    pool1 = m._pools[1]["full"]
    for blk in rb[:2]:  # replica 1 loses blocks 0 and 1 but keeps block 2
        pool1._unpublish(blk)
    c = TextContext("c", toks)
    m.claim(c, 1)
    m.alloc(c)
    assert c.cached_prefix_length == 12
    rc = m.get_req_blocks_per_leaf(c)["full"]
    assert rc[2] == rb[2]  # taken locally, not copied again
    assert m.get_metrics_aggregated().cross_replica_blocks_copied == 3 + 2
    assert_kv_correct(m, c)
    check_invariants(m)


class OddConnector(DictConnector):
    """Misbehaving connector: lookup answers a non-int; a handle's n-th poll raises OSError."""

    def __init__(self, bad_lookup=False, bad_poll=0):
        super().__init__(asynchronous=True)
        self.bad_lookup, self.bad_poll = bad_lookup, bad_poll

    def lookup(self, hashes, tokens, replica_idx=0):
        n = super().lookup(hashes, tokens, replica_idx)
        return "many" if self.bad_lookup and n else n

    def load(self, block_ids, hashes, tokens, replica_idx=0):
        h = super().load(block_ids, hashes, tokens, replica_idx)
        if self.bad_poll:
            bad_at, self.bad_poll = self.bad_poll, 0
            polls = []

            def is_complete():
                polls.append(1)
                if len(polls) >= bad_at:
                    raise OSError("device lost")
                return False

            h.is_complete = is_complete
        return h


def test_connector_lookup_answer_is_validated_and_alloc_rolls_back():
    conn = OddConnector()
    m = make(num_blocks=16, connector=conn)
    toks = list(range(13))
    offloaded(m, conn, toks)
    conn.bad_lookup = True
    ctx = TextContext("b", toks)
    m.claim(ctx)
    used = m.block_count()
    with pytest.raises(TypeError, match=r"alloc: connector.lookup returned 'many', must be an int >= 0"):
        m.alloc(ctx)
    assert m.block_count() == used and ctx.processed_length == 0
    check_invariants(m)


def test_unexpected_handle_error_at_first_poll_rolls_alloc_back():
    conn = OddConnector(bad_poll=1)
    m = make(num_blocks=16, connector=conn)
    toks = list(range(13))
    offloaded(m, conn, toks)
    conn.bad_poll = 1
    ctx = TextContext("b", toks)
    m.claim(ctx)
    used = m.block_count()
    with pytest.raises(OSError, match="device lost"):
        m.alloc(ctx)
    assert m.block_count() == used and ctx.processed_length == 0 and not m.pending_transfers_exist()
    check_invariants(m)
    m.alloc(ctx)  # a new load this time
    assert ctx.cached_prefix_external_length == 12


def test_unexpected_handle_error_later_propagates_from_poll_after_unpinning():
    conn = OddConnector()
    m = make(num_blocks=16, connector=conn)
    toks = list(range(13))
    offloaded(m, conn, toks)
    conn.bad_poll = 2
    ctx = TextContext("b", toks)
    m.claim(ctx)
    m.alloc(ctx)
    assert m.pending_transfers_exist()
    with pytest.raises(OSError, match="device lost"):
        m.poll_transfers()
    assert not m.pending_transfers_exist()
    assert m.get_prefix_cache_hit_counts(TextContext("p", toks))[0].device_blocks == 0  # never published
    check_invariants(m)
    m.alloc(ctx)  # the request falls back to its device hit (none here)
    assert ctx.processed_length == 0
    m.release(ctx)
    assert m.block_count().used == 0
