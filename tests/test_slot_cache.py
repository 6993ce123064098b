"""Happy paths of ``kvref.KVCache`` (spec/slot-cache.md §1-§6).

Error paths live in ``test_slot_cache_errors.py``; attention through the
cache in ``test_ops.py``; the stateful differential test in
``test_slot_cache_machine.py``. The helpers at the top are shared with them.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvref
from kvref import KVCache
from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec, LayerKind, block_hashes, root_hash

PAGED, CONTIG = KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS


# ---------------------------------------------------------------------- helpers (shared)


def all_layer_specs(heads: int = 2, dim: int = 4, window: int = 3, enc: int = 5):
    """One layer of every kind: attention, sliding window, cross, state (2 conv windows + recurrent)."""
    return [
        KVLayerSpec.attention(heads, dim),
        KVLayerSpec.sliding_window(heads, dim, window),
        KVLayerSpec.cross_attention(heads, dim, enc),
        KVLayerSpec.state((3, 2), 4, recurrent=(2, 3, 2)),
    ]


def make_cache(mode=PAGED, specs=None, *, max_seqs=3, max_seq_len=16, block_size=4, num_blocks=0,
               dtype="float32", **kw) -> KVCache:
    specs = [KVLayerSpec.attention(2, 4)] if specs is None else specs
    cfg = KVCacheConfig(len(specs), max_seqs, max_seq_len, mode, block_size=block_size,
                        num_blocks=num_blocks, dtype=dtype, **kw)
    return KVCache.make(cfg, specs)


def storage_arrays(cache: KVCache) -> list[np.ndarray]:
    """Every buffer of the cache, through the public accessors."""
    out = []
    for l, spec in enumerate(cache.layer_specs):
        if spec.kind is LayerKind.STATE:
            out += [cache.conv_state(l, i) for i in range(len(spec.conv_dims))]
            if spec.recurrent is not None:
                out.append(cache.recurrent_state(l))
        else:
            out += [cache.keys(l), cache.values(l)]
    return out


def fingerprint(cache: KVCache):
    """Everything observable plus the private bookkeeping, as comparable values."""
    pool = cache._pool
    return {
        "seq_lens": cache.seq_lens().tobytes(),
        "table": None if cache.paged_block_table() is None else cache.paged_block_table().tobytes(),
        "free": cache._free_order(),
        "pool": None if pool is None else (
            [int(x) for x in pool.ref_count], list(pool.block_hash), dict(pool.hash_to_block),
            [None if t is None else t.tobytes() for t in pool.block_tokens],
        ),
        "enc": cache._enc.tobytes(),
        "nblk": cache._nblk.tobytes(),
        "nshared": cache._nshared.tobytes(),
        "checkpoints": [(h, [a.tobytes() for a in v]) for h, v in cache._checkpoints.items()],
        "parents": dict(cache._parents),
        "write_sets": dict(cache._write_sets.items()),
        "storage": [a.tobytes() for a in storage_arrays(cache)],
    }


def assert_unchanged(cache: KVCache, before) -> None:
    after = fingerprint(cache)
    for key in before:
        assert after[key] == before[key], f"{key} changed after a raising call"
    cache.check_invariants()


def run_step(cache: KVCache, rows, rng, *, commit=True):
    """prepare_step for ``rows = [(slot, q_len), ...]``, append random K/V to every attention layer, commit.

    Returns (step, {layer: (k, v)}) with the appended float32 values.
    """
    seq = cache.seq_lens()
    q = [n for _, n in rows]
    cu = np.concatenate([[0], np.cumsum(q)])
    step = cache.prepare_step(cu, [int(seq[s]) for s, _ in rows], [s for s, _ in rows])
    new = {}
    for l, spec in enumerate(cache.layer_specs):
        if spec.kind in (LayerKind.ATTENTION, LayerKind.SLIDING_WINDOW):
            k = rng.standard_normal((int(cu[-1]), spec.kv_heads, spec.head_dim)).astype(np.float32)
            v = rng.standard_normal((int(cu[-1]), spec.kv_heads, spec.head_dim)).astype(np.float32)
            kvref.ops.append_kv(cache, l, k, v, step)
            new[l] = (k, v)
    if commit:
        for s, n in rows:
            cache.update_position(s, int(seq[s]) + n)
    return step, new


# ---------------------------------------------------------------------- §1 construction and storage


def test_direct_construction_refused():
    with pytest.raises(TypeError, match=r"KVCache\.make"):
        KVCache()


@pytest.mark.parametrize("mode", [PAGED, CONTIG])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_make_storage_shapes_and_dtypes(mode, dtype):
    """spec/slot-cache.md §1: one buffer per layer kind, K/V in dtype, state in state_dtype."""
    cache = make_cache(mode, all_layer_specs(), max_seqs=3, max_seq_len=10, block_size=4, dtype=dtype,
                       state_dtype="float16")
    cfg = cache.config
    assert cache.mode() is mode and isinstance(cache.layer_specs, tuple) and len(cache.layer_specs) == 4
    if mode is PAGED:
        assert cfg.resolved_num_blocks == 3 * 3 + 1
        assert cache.keys(0).shape == (10, 4, 2, 4) and cache.values(1).shape == (10, 4, 2, 4)
        assert cache.paged_block_table().shape == (3, 3) and cache.paged_block_table().dtype == np.int32
        assert cache._free_order() == list(range(1, 10))
    else:
        assert cache.keys(0).shape == (3, 10, 2, 4) and cache.values(1).shape == (3, 10, 2, 4)
        assert cache.paged_block_table() is None and cache._free_order() == []
    assert cache.keys(2).shape == (3, 5, 2, 4)
    assert cache.conv_state(3).shape == (3, 3, 4) and cache.conv_state(3, 1).shape == (3, 2, 4)
    assert cache.recurrent_state(3).shape == (3, 2, 3, 2)
    for l in range(3):
        assert cache.keys(l).dtype == cfg.np_dtype and cache.values(l).dtype == cfg.np_dtype
    assert cache.conv_state(3).dtype == np.float16 and cache.recurrent_state(3).dtype == np.float16
    assert all(not a.any() for a in storage_arrays(cache))
    assert cache.seq_lens().dtype == np.int32 and cache.seq_lens().tolist() == [0, 0, 0]
    cache.check_invariants()
    kvref.check_invariants(cache)


@pytest.mark.parametrize("mode", [PAGED, CONTIG])
def test_accessors_return_the_same_live_buffer(mode):
    """spec/slot-cache.md §1: identity kept across calls, steps, evict_batch and reset (CUDA graphs)."""
    cache = make_cache(mode, all_layer_specs())
    first = storage_arrays(cache)
    rng = np.random.default_rng(0)
    run_step(cache, [(0, 5), (2, 3)], rng)
    cache.fill(2, 1, np.ones((2, 2, 4), np.float32), np.ones((2, 2, 4), np.float32))
    cache.conv_state(3)[0] = 1.5
    cache.evict_batch(0)
    cache.reset()
    again = storage_arrays(cache)
    assert all(a is b for a, b in zip(first, again))
    assert all(not a.any() for a in again)
    assert cache.seq_lens().tolist() == [0, 0, 0]


def test_seq_lens_and_block_table_are_copies():
    cache = make_cache(PAGED)
    cache.prepare_step([0, 3], [0], [1])
    cache.seq_lens()[1] = 7
    cache.paged_block_table()[1, 0] = 9
    assert cache.seq_lens()[1] == 0 and cache.paged_block_table()[1, 0] == 1


# ---------------------------------------------------------------------- §3 prepare_step / StepIndices


def test_prepare_step_paged_indices_exact():
    """spec/slot-cache.md §3: every field, dtype and value; rows in step order."""
    cache = make_cache(PAGED, max_seqs=4, max_seq_len=12, block_size=4)
    run_step(cache, [(2, 5)], np.random.default_rng(0))  # slot 2 holds blocks [1, 2], seq 5
    step = cache.prepare_step(np.array([0, 2, 5], np.int32), [5, 0], [2, 0])
    assert cache.seq_lens().tolist() == [0, 0, 5, 0]  # §2.8: not advanced
    table = cache.paged_block_table()
    assert table[2].tolist() == [1, 2, 0] and table[0].tolist() == [3, 0, 0]
    assert step.cu_seqlens_q.tolist() == [0, 2, 5] and step.cu_seqlens_q.dtype == np.int32
    assert step.past_len.tolist() == [5, 0] and step.past_len.dtype == np.int32
    assert step.seqused_k.tolist() == [7, 3] and step.seqused_k.dtype == np.int32
    assert step.cu_seqlens_k.tolist() == [0, 7, 10] and step.cu_seqlens_k.dtype == np.int32
    assert (step.max_seqlen_q, step.max_seqlen_k) == (3, 7)
    assert isinstance(step.max_seqlen_q, int) and isinstance(step.max_seqlen_k, int)
    assert step.slot_ids.tolist() == [2, 0] and step.slot_ids.dtype == np.int32
    assert step.batch_indices.tolist() == [0, 0, 1, 1, 1] and step.batch_indices.dtype == np.int32
    assert step.positions.tolist() == [5, 6, 0, 1, 2] and step.positions.dtype == np.int32
    assert step.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 12, 13, 14]
    assert step.slot_mapping.dtype == np.int64
    assert step.block_table.tolist() == [[1, 2, 0], [3, 0, 0]] and step.block_table.dtype == np.int32
    assert step.has_initial_state.tolist() == [True, False] and step.has_initial_state.dtype == np.bool_
    assert step.cross_seqused_k.tolist() == [0, 0] and step.cross_seqused_k.dtype == np.int32
    assert step.logits_indices.tolist() == [1, 4] and step.logits_indices.dtype == np.int32
    assert (step.num_seqs, step.num_tokens) == (2, 5)
    cache.check_invariants()


def test_prepare_step_contiguous_indices():
    cache = make_cache(CONTIG, all_layer_specs(), max_seqs=3, max_seq_len=10)
    cache.fill(2, 1, np.ones((4, 2, 4), np.float32), np.ones((4, 2, 4), np.float32))
    before = fingerprint(cache)
    step = cache.prepare_step([0, 1, 3], [0, 0], [1, 0])
    assert step.slot_mapping.tolist() == [10, 0, 1] and step.block_table is None
    assert step.cross_seqused_k.tolist() == [4, 0]
    assert fingerprint(cache) == before  # contiguous prepare_step changes nothing


def test_prepare_step_reserves_only_missing_blocks_and_repeats_idempotently():
    """spec/slot-cache.md §2.8: a second identical prepare_step (a retry) allocates nothing new."""
    cache = make_cache(PAGED, max_seqs=2, max_seq_len=16, block_size=4)
    s1 = cache.prepare_step([0, 6], [0], [0])
    s2 = cache.prepare_step([0, 6], [0], [0])
    assert s1.slot_mapping.tolist() == s2.slot_mapping.tolist()
    assert cache.paged_block_table()[0].tolist() == [1, 2, 0, 0]
    cache.update_position(0, 6)
    s3 = cache.prepare_step([0, 2], [6], [0])
    assert s3.slot_mapping.tolist() == [2 * 4 + 2, 2 * 4 + 3]  # still inside block 2
    assert cache.paged_block_table()[0].tolist() == [1, 2, 0, 0]


def test_prepare_step_accepts_empty_batch():
    cache = make_cache(PAGED)
    step = cache.prepare_step([0], [], [])
    assert step.num_seqs == 0 and step.num_tokens == 0 and step.max_seqlen_k == 0


# ---------------------------------------------------------------------- §2 lifecycle


def test_update_position_commit_rollback_keeps_blocks():
    """spec/slot-cache.md §2.6: bookkeeping only, shrinking frees nothing."""
    cache = make_cache(PAGED, block_size=4)
    run_step(cache, [(0, 7)], np.random.default_rng(0))
    before_k = cache.keys(0).copy()
    cache.update_position(0, 2)
    assert cache.seq_lens()[0] == 2 and cache.paged_block_table()[0].tolist()[:2] == [1, 2]
    cache.update_position(0, 8)  # capacity = 2 blocks * 4
    assert cache.seq_lens()[0] == 8
    assert np.array_equal(cache.keys(0), before_k)
    cache.update_position(0, 0)
    cache.check_invariants()


def test_update_position_contiguous_up_to_max_seq_len():
    cache = make_cache(CONTIG, max_seq_len=9)
    cache.update_position(2, 9)
    assert cache.seq_lens().tolist() == [0, 0, 9]


def test_reserve_advances_and_returns_offsets():
    """spec/slot-cache.md §2.9."""
    cache = make_cache(PAGED, max_seqs=3, max_seq_len=16, block_size=4)
    off = cache.reserve([1, 0], [5, 0])
    assert off.dtype == np.int32 and off.tolist() == [0, 0]
    assert cache.seq_lens().tolist() == [0, 5, 0]
    assert cache.paged_block_table()[1].tolist() == [1, 2, 0, 0]
    assert cache.paged_block_table()[0].tolist() == [0, 0, 0, 0]  # n=0 allocates nothing
    off = cache.reserve([1, 2], [3, 1])
    assert off.tolist() == [5, 0] and cache.seq_lens().tolist() == [0, 8, 1]
    assert cache.paged_block_table()[2].tolist() == [3, 0, 0, 0]
    assert cache.reserve([1], [0]).tolist() == [8]
    assert cache.reserve([], []).tolist() == []
    cache.check_invariants()


def test_evict_batch_zeroes_frees_and_is_idempotent():
    """spec/slot-cache.md §2.5."""
    cache = make_cache(PAGED, all_layer_specs(), block_size=4)
    run_step(cache, [(1, 6)], np.random.default_rng(1))
    cache.fill(2, 1, np.ones((3, 2, 4), np.float32), np.ones((3, 2, 4), np.float32))
    cache.conv_state(3, 1)[1] = 2.0
    cache.recurrent_state(3)[1] = 3.0
    cache.conv_state(3, 1)[0] = 4.0  # another slot: untouched
    cache.evict_batch(1)
    assert cache.seq_lens()[1] == 0 and not cache.paged_block_table()[1].any()
    assert not cache.keys(2)[1].any() and not cache.conv_state(3, 1)[1].any() and not cache.recurrent_state(3)[1].any()
    assert cache.conv_state(3, 1)[0].all()
    assert cache._free_order()[:2] == [1, 2]  # unpublished blocks to the front, head first (tail freed first)
    assert not cache._pool.hash_to_block  # publishes nothing
    snap = fingerprint(cache)
    cache.evict_batch(1)
    assert fingerprint(cache) == snap
    # the slot accepts a different t_enc after eviction
    cache.fill(2, 1, np.ones((5, 2, 4), np.float32), np.ones((5, 2, 4), np.float32))
    cache.check_invariants()


def test_reset_is_a_fresh_make():
    cache = make_cache(PAGED, all_layer_specs(), block_size=4)
    fresh = fingerprint(cache)
    run_step(cache, [(0, 9), (1, 4)], np.random.default_rng(2))
    cache.retire(0, list(range(9)))
    cache.reset()
    assert fingerprint(cache) == fresh


def test_fill_writes_and_zero_pads():
    """spec/slot-cache.md §2.7."""
    cache = make_cache(CONTIG, all_layer_specs(enc=5))
    k = np.arange(3 * 2 * 4, dtype=np.float32).reshape(3, 2, 4) + 1
    cache.keys(2)[0] = 9.0  # stale content beyond t_enc is zeroed
    cache.fill(2, 0, k, -k)
    assert np.array_equal(cache.keys(2)[0, :3], k) and not cache.keys(2)[0, 3:].any()
    assert np.array_equal(cache.values(2)[0, :3], -k)
    assert cache.seq_lens()[0] == 0
    cache.fill(2, 0, k * 2, k)  # same t_enc again: allowed, overwrites
    assert np.array_equal(cache.keys(2)[0, :3], 2 * k)
    step = cache.prepare_step([0, 1], [0], [0])
    assert step.cross_seqused_k.tolist() == [3]


def test_fill_casts_to_storage_dtype():
    cache = make_cache(PAGED, all_layer_specs(), dtype="bfloat16")
    k = np.full((2, 2, 4), 1.5, np.float64)
    cache.fill(2, 0, k, k)
    assert cache.keys(2).dtype == cache.config.np_dtype and float(cache.keys(2)[0, 0, 0, 0]) == 1.5


# ---------------------------------------------------------------------- §4 prefix reuse


def _prefill(cache, slot, tokens, rng):
    run_step(cache, [(slot, len(tokens))], rng)


def test_admit_hit_capped_whole_blocks():
    """spec/slot-cache.md §4.1: hit capped at len-1, whole blocks; addressable_len caps it further."""
    cache = make_cache(PAGED, max_seqs=2, max_seq_len=16, block_size=4)
    toks = list(range(10, 22))  # 12 tokens = 3 full blocks
    _prefill(cache, 0, toks, np.random.default_rng(0))
    cache.retire(0, toks)
    assert cache.admit(1, toks) == 8  # 12 - 1 = 11 -> 2 whole blocks
    assert cache.seq_lens()[1] == 8 and cache.paged_block_table()[1].tolist() == [1, 2, 0, 0]
    cache.evict_batch(1)
    assert cache.admit(1, toks + [5]) == 12
    cache.evict_batch(1)
    assert cache.admit(1, toks, addressable_len=12) == 12
    cache.evict_batch(1)
    assert cache.admit(1, toks, addressable_len=5) == 4
    cache.evict_batch(1)
    assert cache.admit(1, toks[:4] + [0] * 8) == 4  # diverges in block 1
    cache.evict_batch(1)
    assert cache.admit(1, [1, 2, 3]) == 0
    cache.check_invariants()


def test_admit_adopts_shared_blocks_and_refcounts():
    cache = make_cache(PAGED, max_seqs=3, block_size=4)
    toks = list(range(9))
    _prefill(cache, 0, toks, np.random.default_rng(0))
    cache.retire(0, toks)
    assert cache.admit(1, toks) == 8 and cache.admit(2, toks) == 8
    assert cache._pool.ref_count[1] == 2 and cache._pool.ref_count[2] == 2
    assert 1 not in cache._free_order() and 2 not in cache._free_order()
    cache.check_invariants()
    # writing continues into a fresh block, never into the shared ones
    step = cache.prepare_step([0, 1], [8], [1])
    assert step.slot_mapping.tolist() == [int(cache.paged_block_table()[1, 2]) * 4]
    cache.check_invariants()


def test_retire_publishes_only_below_addressable_and_seq():
    """spec/slot-cache.md §4.2: a = min(len(tokens), seq_len)."""
    cache = make_cache(PAGED, max_seqs=2, block_size=4)
    toks = list(range(11))
    _prefill(cache, 0, toks[:10], np.random.default_rng(0))  # seq 10, tokens 11 (last sampled never fed)
    cache.retire(0, toks)
    assert len(cache._pool.hash_to_block) == 2
    _prefill(cache, 0, toks[:10], np.random.default_rng(0))
    cache.retire(0, toks, addressable_len=3)
    assert cache.admit(1, toks) == 8  # the first publication is still retained


def test_retire_twin_dedup_keeps_existing_copy():
    """spec/slot-cache.md §4.2: already-published content keeps the existing copy; ours goes to the front."""
    cache = make_cache(PAGED, max_seqs=2, max_seq_len=8, block_size=4, num_blocks=6)
    toks = list(range(8))
    rng = np.random.default_rng(0)
    _prefill(cache, 0, toks, rng)  # blocks 1, 2
    _prefill(cache, 1, toks, rng)  # blocks 3, 4 (computed twice, not shared)
    cache.retire(0, toks)
    assert cache._free_order() == [5, 2, 1]
    cache.retire(1, toks)
    assert cache._pool.lookup(block_hashes(toks, 4)[0], toks[:4]) == 1
    assert not cache._pool.is_published(3) and not cache._pool.is_published(4)
    # twins freed unpublished to the front (tail first: 4 then 3 -> [3, 4, ...]); published at the back
    assert cache._free_order() == [3, 4, 5, 2, 1]
    cache.check_invariants()


def test_lru_retention_and_tail_first_eviction():
    """spec/slot-cache.md §5: the chain's tail is evicted before its head; eviction loses the hit."""
    cache = make_cache(PAGED, max_seqs=2, max_seq_len=12, block_size=4, num_blocks=4)
    toks = list(range(12))
    _prefill(cache, 0, toks, np.random.default_rng(0))
    cache.retire(0, toks + [99])
    assert cache._free_order() == [3, 2, 1]
    cache.reserve([1], [4])  # pops block 3: the tail
    assert cache.paged_block_table()[1, 0] == 3
    cache.evict_batch(1)
    assert cache.admit(1, toks + [99]) == 8
    cache.check_invariants()


def test_admit_verifies_stored_tokens():
    """spec/slot-cache.md §4.1 / spec/hashing.md: a hash is a key, never a proof."""
    cache = make_cache(PAGED, max_seqs=2, block_size=4)
    toks = list(range(9))
    _prefill(cache, 0, toks, np.random.default_rng(0))
    cache.retire(0, toks)
    cache._pool.block_tokens[1] = np.array([7, 7, 7, 7], np.int32)  # a colliding block: hash right, tokens wrong
    assert cache.admit(1, toks) == 0


def test_prefix_caching_disabled():
    cache = make_cache(PAGED, max_seqs=2, block_size=4, enable_prefix_caching=False)
    toks = list(range(9))
    _prefill(cache, 0, toks, np.random.default_rng(0))
    cache.retire(0, toks)
    assert not cache._pool.hash_to_block
    assert cache.admit(1, toks) == 0
    cache.check_invariants()


@pytest.mark.parametrize("algo", ["sha256", "xxh3_128"])
def test_hash_chain_matches_kvspec(algo):
    """spec/hashing.md: the published keys are kvspec.hashing.block_hashes with the config's seed, no salt."""
    cache = make_cache(PAGED, max_seqs=2, block_size=4, hash_algo=algo, hash_seed=7)
    toks = list(range(9))
    _prefill(cache, 0, toks, np.random.default_rng(0))
    cache.retire(0, toks)
    want = block_hashes(toks, 4, algo, hash_seed=7)
    assert set(cache._pool.hash_to_block) == set(want)
    assert cache._parents[want[0]] == root_hash(7)
    assert cache.admit(1, toks) == 8


# ---------------------------------------------------------------------- §4.3 state checkpoints


def hybrid_specs():
    return [KVLayerSpec.attention(1, 2), KVLayerSpec.state((2,), 3, recurrent=(1, 2, 2))]


def test_state_checkpoint_saved_at_aligned_end_and_restored():
    cache = make_cache(PAGED, hybrid_specs(), max_seqs=2, max_seq_len=16, block_size=4)
    toks = list(range(8))
    _prefill(cache, 0, toks, np.random.default_rng(0))
    cache.conv_state(1)[0] = 1.25
    cache.recurrent_state(1)[0] = -2.0
    cache.retire(0, toks + [3])  # a = min(9, 8) = 8 = seq, aligned
    assert len(cache._checkpoints) == 1
    assert not cache.conv_state(1)[0].any()  # retire frees the slot like evict_batch
    assert cache.admit(1, toks + [3, 4]) == 8
    assert (cache.conv_state(1)[1] == 1.25).all() and (cache.recurrent_state(1)[1] == -2.0).all()
    cache.check_invariants()


def test_hybrid_hit_cut_to_checkpoint_boundary():
    cache = make_cache(PAGED, hybrid_specs(), max_seqs=2, max_seq_len=16, block_size=4)
    toks = list(range(10))
    _prefill(cache, 0, toks, np.random.default_rng(0))
    cache.retire(0, toks)  # a = 10, not aligned: blocks published, no checkpoint
    assert len(cache._pool.hash_to_block) == 2 and not cache._checkpoints
    cache.conv_state(1)[1] = 5.0
    assert cache.admit(1, toks + [1]) == 0  # no checkpoint -> no hit, zero state
    assert not cache.conv_state(1)[1].any()
    # a later aligned retire at 4 checkpoints block 0: hits cut to 4 even though 8 tokens are cached
    cache.evict_batch(1)
    _prefill(cache, 0, toks[:4], np.random.default_rng(1))
    cache.retire(0, toks[:4])
    assert cache.admit(1, toks) == 4
    cache.check_invariants()


def test_checkpoints_lru_capacity_and_eviction_drop():
    cache = make_cache(PAGED, hybrid_specs(), max_seqs=2, max_seq_len=8, block_size=4, num_blocks=4,
                       num_state_checkpoints=2)
    rng = np.random.default_rng(0)
    prompts = [[1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]]
    for p in prompts[:2]:
        _prefill(cache, 0, p, rng)
        cache.retire(0, p)
    assert len(cache._checkpoints) == 2
    assert cache.admit(1, prompts[0] + [0]) == 4  # uses checkpoint 0: now most recent
    cache.evict_batch(1)
    _prefill(cache, 0, prompts[2], rng)  # pops the free block 3 first (never published)
    cache.retire(0, prompts[2])
    # capacity 2: the least recently used (prompt 1) is dropped
    keys = set(cache._checkpoints)
    assert block_hashes(prompts[1], 4)[0] not in keys and block_hashes(prompts[0], 4)[0] in keys
    # eviction of a checkpointed block drops its checkpoint
    cache.reserve([0, 1], [8, 4])
    assert not cache._checkpoints
    cache.check_invariants()


def test_num_state_checkpoints_zero_disables_hybrid_reuse():
    cache = make_cache(PAGED, hybrid_specs(), max_seqs=2, block_size=4, num_state_checkpoints=0)
    _prefill(cache, 0, [1, 2, 3, 4], np.random.default_rng(0))
    cache.retire(0, [1, 2, 3, 4])
    assert not cache._checkpoints and cache.admit(1, [1, 2, 3, 4, 5]) == 0


def test_cross_planes_never_reused():
    cache = make_cache(PAGED, all_layer_specs(), max_seqs=2, block_size=4)
    toks = list(range(8))
    rng = np.random.default_rng(0)
    cache.fill(2, 0, np.ones((3, 2, 4), np.float32), np.ones((3, 2, 4), np.float32))
    _prefill(cache, 0, toks, rng)
    cache.retire(0, toks)
    assert cache.admit(1, toks + [1]) == 8
    assert not cache.keys(2)[1].any()
    assert cache.prepare_step([0, 1], [8], [1]).cross_seqused_k.tolist() == [0]


# ---------------------------------------------------------------------- §6 invariants


def test_check_invariants_detects_corruption():
    cache = make_cache(PAGED, max_seqs=2, block_size=4)
    toks = list(range(9))
    _prefill(cache, 0, toks, np.random.default_rng(0))
    cache.check_invariants()
    cache._table[1, 2] = 3
    with pytest.raises(AssertionError, match=r"check_invariants: table\[1, 2\]=3"):
        cache.check_invariants()
    cache._table[1, 2] = 0
    cache._pool.ref_count[1] = 2
    with pytest.raises(AssertionError, match="check_invariants: block 1 ref_count=2 but 1 table entries"):
        cache.check_invariants()
    cache._pool.ref_count[1] = 1
    cache._seq[0] = 13
    with pytest.raises(AssertionError, match=r"seq_lens\(\)\[0\]=13 outside \[0, capacity=12\]"):
        cache.check_invariants()
    cache._seq[0] = 9
    cache.retire(0, toks)
    cache._pool.block_tokens[2] = np.array([0, 0, 0, 0], np.int32)
    with pytest.raises(AssertionError, match="check_invariants: published block 2 tokens hash to"):
        cache.check_invariants()


def test_check_invariants_detects_shared_block_in_write_set():
    cache = make_cache(PAGED, max_seqs=2, block_size=4)
    toks = list(range(9))
    _prefill(cache, 0, toks, np.random.default_rng(0))
    cache.retire(0, toks)
    cache.admit(1, toks)
    cache.prepare_step([0, 1], [8], [1])
    cache.check_invariants()
    cache._write_sets[1] = frozenset({1})
    with pytest.raises(AssertionError, match="block 1 in slot 1's write set is shared"):
        cache.check_invariants()


def test_hashing_golden_examples():
    """spec/hashing.md §5: the pinned bytes of the chain."""
    assert root_hash(0).hex() == "b6fe50ca9f013d96b8bfd121942e5edaf18bc64e2ff84e1bd0dd2159f1a72fe2"
    assert [h.hex() for h in block_hashes(list(range(8)), 4, "sha256")] == [
        "fcc86031e044bad34b9294f43376bac2a4b3d9708a85ee771b18ab01a0413e80",
        "18a2b45fe34860434c74773e049d480d9ffcae1fc67ea4a1fed5fd274ad44b06",
    ]
    assert [h.hex() for h in block_hashes(list(range(8)), 4, "xxh3_128")] == [
        "58b240359cf3f5d4e369909e5c231ee7",
        "89234ddc7a25c553fdefc77e1e6dc37f",
    ]


def test_docs_examples_run():
    """docs/slot-cache.md: its Python blocks run as written, in order."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "slot-cache.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/slot-cache.md", "exec"), namespace)
    assert namespace["hit"] == 8


def test_retire_with_fewer_tokens_than_adopted():
    """spec/slot-cache.md §2.11: a shorter token list only limits what is published; the slot is freed."""
    cache = make_cache(PAGED, max_seqs=2, block_size=4)
    toks = list(range(9))
    _prefill(cache, 0, toks, np.random.default_rng(0))
    cache.retire(0, toks)
    assert cache.admit(1, toks) == 8
    index = dict(cache._pool.hash_to_block)
    cache.retire(1, [])
    assert cache.seq_lens()[1] == 0 and cache._pool.hash_to_block == index
    cache.check_invariants()


def test_docstring_examples():
    """The Examples blocks of kvref._slot_cache run as doctests."""
    import doctest

    import kvref._slot_cache as module

    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 4 and result.failed == 0
