"""Every error path of ``kvref.KVCache`` (spec/slot-cache.md §2): the documented type,
a message naming the argument and value, and the cache bit-for-bit unchanged.

Each case runs against a *busy* cache: a slot with an adopted (shared) prefix,
a slot with a filled cross plane, an empty slot, retained published blocks, a
state checkpoint and only two free blocks.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvref import KVCache
from kvspec import CapacityError, KVCacheConfig, KVCacheMode, KVLayerSpec
from test_slot_cache import all_layer_specs, assert_unchanged, fingerprint, make_cache, run_step

PAGED, CONTIG = KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS
F32 = np.float32


def busy_cache(mode) -> KVCache:
    """Layers: 0 attention, 1 sliding window, 2 cross (max_enc_len 5), 3 state (conv (3, 2) x 4, recurrent).

    Paged (block_size 4, blocks 1..7): slot 0 adopted blocks [1, 2] (hit 8) and
    holds block 3, seq 10; slot 1 holds blocks [4, 5], seq 5, cross filled with
    t_enc 3; slot 2 empty; free list [6, 7]; one state checkpoint.
    Contiguous: slot 0 seq 10, slot 1 seq 5 with cross filled, slot 2 empty.
    """
    rng = np.random.default_rng(0)
    cache = make_cache(mode, all_layer_specs(), max_seqs=3, max_seq_len=16, block_size=4,
                       num_blocks=8 if mode is PAGED else 0)
    prompt = list(range(8))
    if mode is PAGED:
        run_step(cache, [(0, 8)], rng)
        cache.conv_state(3)[0] = 1.0
        cache.retire(0, prompt)
        assert cache.admit(0, prompt + [8, 9]) == 8
        run_step(cache, [(0, 2)], rng)
    else:
        run_step(cache, [(0, 10)], rng)
    cache.fill(2, 1, rng.standard_normal((3, 2, 4)), rng.standard_normal((3, 2, 4)))
    run_step(cache, [(1, 5)], rng)
    cache.recurrent_state(3)[1] = 2.0
    if mode is PAGED:
        assert cache._free_order() == [6, 7] and len(cache._checkpoints) == 1
    return cache


K3 = np.zeros((3, 2, 4), F32)

# (id, modes, call, exception, message regex)
CASES = [
    # ---- §1 accessors
    ("keys-layer-high", "both", lambda c: c.keys(4), IndexError, r"keys: layer=4 out of range \[0, 4\)"),
    ("keys-layer-neg", "both", lambda c: c.keys(-1), IndexError, r"keys: layer=-1 out of range \[0, 4\)"),
    ("keys-layer-float", "both", lambda c: c.keys(0.0), TypeError, r"keys: layer=0.0, must be an int"),
    ("keys-layer-bool", "both", lambda c: c.keys(True), TypeError, r"keys: layer=True, must be an int"),
    ("keys-state", "both", lambda c: c.keys(3), TypeError, r"keys: layer=3 is STATE, must be"),
    ("values-state", "both", lambda c: c.values(3), TypeError, r"values: layer=3 is STATE"),
    ("values-layer-high", "both", lambda c: c.values(7), IndexError, r"values: layer=7 out of range"),
    ("conv-attention", "both", lambda c: c.conv_state(0), TypeError, r"conv_state: layer=0 is ATTENTION, must be STATE"),
    ("conv-index", "both", lambda c: c.conv_state(3, 2), IndexError, r"conv_state: index=2 out of range \[0, 2\)"),
    ("conv-index-neg", "both", lambda c: c.conv_state(3, -1), IndexError, r"conv_state: index=-1 out of range"),
    ("conv-layer-high", "both", lambda c: c.conv_state(4), IndexError, r"conv_state: layer=4 out of range"),
    ("recurrent-cross", "both", lambda c: c.recurrent_state(2), TypeError, r"recurrent_state: layer=2 is CROSS_ATTENTION"),
    ("recurrent-layer-high", "both", lambda c: c.recurrent_state(9), IndexError, r"recurrent_state: layer=9 out of range"),
    # ---- §2.6 update_position
    ("upd-slot-high", "both", lambda c: c.update_position(3, 0), IndexError, r"update_position: batch_idx=3 out of range \[0, 3\)"),
    ("upd-slot-float", "both", lambda c: c.update_position(1.0, 0), TypeError, r"update_position: batch_idx=1.0, must be an int"),
    ("upd-pos-float", "both", lambda c: c.update_position(1, 2.0), TypeError, r"update_position: new_pos=2.0, must be an int"),
    ("upd-neg", "both", lambda c: c.update_position(1, -1), ValueError, r"update_position: new_pos=-1 < 0"),
    ("upd-over-cap-paged", "paged", lambda c: c.update_position(0, 13), ValueError, r"update_position: new_pos=13 > capacity=12 of slot 0"),
    ("upd-empty-slot-paged", "paged", lambda c: c.update_position(2, 1), ValueError, r"update_position: new_pos=1 > capacity=0 of slot 2"),
    ("upd-over-cap-contig", "contig", lambda c: c.update_position(0, 17), ValueError, r"update_position: new_pos=17 > capacity=16 of slot 0"),
    ("upd-into-shared", "paged", lambda c: c.update_position(0, 7), ValueError, r"update_position: new_pos=7 < shared prefix=8 of slot 0"),
    # ---- §2.5 evict_batch
    ("evict-high", "both", lambda c: c.evict_batch(3), IndexError, r"evict_batch: batch_idx=3 out of range \[0, 3\)"),
    ("evict-neg", "both", lambda c: c.evict_batch(-1), IndexError, r"evict_batch: batch_idx=-1 out of range"),
    ("evict-str", "both", lambda c: c.evict_batch("0"), TypeError, r"evict_batch: batch_idx='0', must be an int"),
    # ---- §2.7 fill
    ("fill-attention", "both", lambda c: c.fill(0, 2, K3, K3), TypeError, r"fill: layer=0 is ATTENTION, must be CROSS_ATTENTION"),
    ("fill-state", "both", lambda c: c.fill(3, 2, K3, K3), TypeError, r"fill: layer=3 is STATE"),
    ("fill-layer-high", "both", lambda c: c.fill(4, 2, K3, K3), IndexError, r"fill: layer=4 out of range"),
    ("fill-slot-high", "both", lambda c: c.fill(2, 3, K3, K3), IndexError, r"fill: batch_idx=3 out of range \[0, 3\)"),
    ("fill-int-dtype", "both", lambda c: c.fill(2, 2, K3.astype(np.int32), K3), TypeError, r"fill: k dtype=int32, must be a floating type"),
    ("fill-ndim", "both", lambda c: c.fill(2, 2, K3[0], K3[0]), ValueError, r"fill: k.shape=\(2, 4\), must be \[t_enc, 2, 4\]"),
    ("fill-heads", "both", lambda c: c.fill(2, 2, np.zeros((3, 1, 4), F32), K3), ValueError, r"fill: k.shape=\(3, 1, 4\), must be \[t_enc, 2, 4\]"),
    ("fill-kv-mismatch", "both", lambda c: c.fill(2, 2, K3, np.zeros((2, 2, 4), F32)), ValueError, r"fill: v.shape=\(2, 2, 4\) != k.shape=\(3, 2, 4\)"),
    ("fill-empty", "both", lambda c: c.fill(2, 2, K3[:0], K3[:0]), ValueError, r"fill: t_enc=0 out of range \[1, 5\]"),
    ("fill-too-long", "both", lambda c: c.fill(2, 2, np.zeros((6, 2, 4), F32), np.zeros((6, 2, 4), F32)), ValueError, r"fill: t_enc=6 out of range \[1, 5\]"),
    ("fill-refill-other-len", "both", lambda c: c.fill(2, 1, np.zeros((4, 2, 4), F32), np.zeros((4, 2, 4), F32)), ValueError, r"fill: t_enc=4 != 3 already filled for slot 1"),
    # ---- §2.8 prepare_step
    ("ps-float-cu", "both", lambda c: c.prepare_step([0.0, 1.0], [0], [2]), TypeError, r"prepare_step: cu_seqlens_q dtype=float64, must be an integer type"),
    ("ps-bool-slots", "both", lambda c: c.prepare_step([0, 1], [0], [True]), TypeError, r"prepare_step: slot_ids dtype=bool"),
    ("ps-2d", "both", lambda c: c.prepare_step([[0, 1]], [0], [2]), ValueError, r"prepare_step: cu_seqlens_q.ndim=2, must be 1"),
    ("ps-cu-len", "both", lambda c: c.prepare_step([0, 1, 2], [0], [2]), ValueError, r"prepare_step: len\(cu_seqlens_q\)=3 != len\(slot_ids\)\+1=2"),
    ("ps-past-len", "both", lambda c: c.prepare_step([0, 1], [0, 0], [2]), ValueError, r"prepare_step: len\(past_len\)=2 != len\(slot_ids\)=1"),
    ("ps-cu0", "both", lambda c: c.prepare_step([1, 2], [0], [2]), ValueError, r"prepare_step: cu_seqlens_q\[0\]=1, must be 0"),
    ("ps-cu-flat", "both", lambda c: c.prepare_step([0, 2, 2], [0, 5], [2, 1]), ValueError, r"prepare_step: cu_seqlens_q\[2\]=2 <= cu_seqlens_q\[1\]=2, must be strictly increasing"),
    ("ps-slot-high", "both", lambda c: c.prepare_step([0, 1, 2], [5, 0], [1, 9]), IndexError, r"prepare_step: slot_ids\[1\]=9 out of range \[0, 3\)"),
    ("ps-slot-neg", "both", lambda c: c.prepare_step([0, 1], [0], [-1]), IndexError, r"prepare_step: slot_ids\[0\]=-1 out of range"),
    ("ps-slot-dup", "both", lambda c: c.prepare_step([0, 1, 2], [5, 5], [1, 1]), ValueError, r"prepare_step: slot_ids\[1\]=1 duplicates slot_ids\[0\]"),
    ("ps-past-mismatch", "both", lambda c: c.prepare_step([0, 1, 2], [0, 4], [2, 1]), ValueError, r"prepare_step: past_len\[1\]=4 but seq_lens\(\)\[slot 1\]=5"),
    ("ps-past-neg", "both", lambda c: c.prepare_step([0, 1], [-1], [2]), ValueError, r"prepare_step: past_len\[0\]=-1 but seq_lens\(\)\[slot 2\]=0"),
    ("ps-over-max-len", "both", lambda c: c.prepare_step([0, 1, 8], [0, 10], [2, 0]), CapacityError, r"prepare_step: past_len\[1\]\+q_len\[1\]=10\+7=17 > max_seq_len=16"),
    ("ps-no-blocks", "paged", lambda c: c.prepare_step([0, 4, 12], [0, 5], [2, 1]), CapacityError, r"prepare_step: needs 3 blocks, 2 free or evictable"),
    # ---- §2.9 reserve
    ("res-contig", "contig", lambda c: c.reserve([2], [1]), RuntimeError, r"reserve: mode=CONTIGUOUS, needs PAGED"),
    ("res-slot-high", "paged", lambda c: c.reserve([3], [1]), IndexError, r"reserve: slot_ids\[0\]=3 out of range \[0, 3\)"),
    ("res-dup", "paged", lambda c: c.reserve([2, 2], [1, 1]), ValueError, r"reserve: slot_ids\[1\]=2 duplicates slot_ids\[0\]"),
    ("res-neg", "paged", lambda c: c.reserve([2, 1], [1, -1]), ValueError, r"reserve: n_new_per_seq\[1\]=-1 < 0"),
    ("res-len", "paged", lambda c: c.reserve([2, 1], [1]), ValueError, r"reserve: len\(n_new_per_seq\)=1 != len\(slot_ids\)=2"),
    ("res-float", "paged", lambda c: c.reserve([2], [1.5]), TypeError, r"reserve: n_new_per_seq dtype=float64"),
    ("res-over-max-len", "paged", lambda c: c.reserve([2, 0], [1, 7]), CapacityError, r"reserve: seq_lens\(\)\[slot 0\]\+n_new_per_seq\[1\]=10\+7=17 > max_seq_len=16"),
    ("res-no-blocks", "paged", lambda c: c.reserve([2, 1], [4, 8]), CapacityError, r"reserve: needs 3 blocks, 2 free or evictable"),
    # ---- §2.10 admit
    ("admit-contig", "contig", lambda c: c.admit(2, [1, 2, 3]), RuntimeError, r"admit: mode=CONTIGUOUS, needs PAGED"),
    ("admit-busy-slot", "paged", lambda c: c.admit(1, [1, 2, 3]), ValueError, r"admit: batch_idx=1 holds seq_len=5 and 2 blocks, must be empty"),
    ("admit-slot-high", "paged", lambda c: c.admit(3, [1, 2]), IndexError, r"admit: batch_idx=3 out of range \[0, 3\)"),
    ("admit-empty", "paged", lambda c: c.admit(2, []), ValueError, r"admit: len\(prompt_ids\)=0, must be >= 1"),
    ("admit-float", "paged", lambda c: c.admit(2, [1.0, 2.0]), TypeError, r"admit: prompt_ids dtype=float64, must be an integer type"),
    ("admit-2d", "paged", lambda c: c.admit(2, [[1, 2]]), ValueError, r"admit: prompt_ids.ndim=2, must be 1"),
    ("admit-int32-range", "paged", lambda c: c.admit(2, [1, 2**31]), ValueError, r"admit: prompt_ids\[1\]=2147483648 out of int32 range"),
    ("admit-addr", "paged", lambda c: c.admit(2, [1, 2], addressable_len=-2), ValueError, r"admit: addressable_len=-2 < -1"),
    ("admit-addr-float", "paged", lambda c: c.admit(2, [1, 2], addressable_len=1.0), TypeError, r"admit: addressable_len=1.0, must be an int"),
    # ---- §2.11 retire
    ("retire-contig", "contig", lambda c: c.retire(1, [1, 2, 3]), RuntimeError, r"retire: mode=CONTIGUOUS, needs PAGED"),
    ("retire-slot-high", "paged", lambda c: c.retire(5, [1]), IndexError, r"retire: batch_idx=5 out of range \[0, 3\)"),
    ("retire-addr-over-seq", "paged", lambda c: c.retire(1, list(range(9)), addressable_len=6), ValueError, r"retire: addressable_len=6 > seq_lens\(\)\[1\]=5"),
    ("retire-addr-over-len", "paged", lambda c: c.retire(1, [1, 2, 3], addressable_len=4), ValueError, r"retire: addressable_len=4 > len\(full_token_ids\)=3"),
    ("retire-addr-neg", "paged", lambda c: c.retire(1, [1, 2, 3], addressable_len=-3), ValueError, r"retire: addressable_len=-3 < -1"),
    ("retire-float", "paged", lambda c: c.retire(1, np.ones(5)), TypeError, r"retire: full_token_ids dtype=float64"),
    ("retire-contradicts-adopted", "paged", lambda c: c.retire(0, [0, 1, 2, 3, 4, 99, 6, 7, 8, 9]), ValueError, r"retire: full_token_ids\[5\]=99 but adopted block 1 holds 5"),
]


def _params():
    out = []
    for case_id, modes, call, exc, match in CASES:
        for mode in (PAGED, CONTIG):
            if modes == "both" or (modes == "paged") == (mode is PAGED):
                out.append(pytest.param(mode, call, exc, match, id=f"{case_id}-{mode.name.lower()}"))
    return out


@pytest.mark.parametrize("mode, call, exc, match", _params())
def test_error_leaves_cache_unchanged(mode, call, exc, match):
    cache = busy_cache(mode)
    before = fingerprint(cache)
    with pytest.raises(exc, match=match):
        call(cache)
    assert_unchanged(cache, before)


def test_admit_refuses_slot_holding_reserved_blocks():
    """spec/slot-cache.md §2.10: empty means length 0 *and* no blocks (a prepared, uncommitted step counts)."""
    cache = busy_cache(PAGED)
    cache.prepare_step([0, 2], [0], [2])
    before = fingerprint(cache)
    with pytest.raises(ValueError, match=r"admit: batch_idx=2 holds seq_len=0 and 1 blocks, must be empty"):
        cache.admit(2, [1, 2, 3])
    assert_unchanged(cache, before)


def test_capacity_counts_retained_blocks_as_evictable():
    """spec/slot-cache.md §5: retained published blocks are evictable, so they count as available."""
    cache = make_cache(PAGED, max_seqs=2, max_seq_len=12, block_size=4, num_blocks=4)
    run_step(cache, [(0, 8)], np.random.default_rng(0))
    cache.retire(0, list(range(8)))  # blocks 1, 2 retained; 3 free
    before = fingerprint(cache)
    with pytest.raises(CapacityError, match=r"prepare_step: needs 4 blocks, 3 free or evictable"):
        cache.prepare_step([0, 12, 13], [0, 0], [0, 1])
    assert_unchanged(cache, before)
    assert cache.prepare_step([0, 12], [0], [0]).num_tokens == 12


def test_recurrent_state_absent_is_type_error():
    cache = make_cache(CONTIG, [KVLayerSpec.state((2,), 3)])
    before = fingerprint(cache)
    with pytest.raises(TypeError, match=r"recurrent_state: layer=0 is STATE with recurrent=None"):
        cache.recurrent_state(0)
    assert_unchanged(cache, before)


def test_make_errors():
    cfg = KVCacheConfig(2, 2, 8, PAGED, block_size=4)
    with pytest.raises(TypeError, match=r"KVCache\.make: config=.*must be a KVCacheConfig"):
        KVCache.make({"num_layers": 2}, [KVLayerSpec.attention(1, 2)] * 2)
    with pytest.raises(ValueError, match=r"KVCache\.make: len\(layer_specs\)=1 != config.num_layers=2"):
        KVCache.make(cfg, [KVLayerSpec.attention(1, 2)])
    with pytest.raises(TypeError, match=r"KVCache\.make: layer_specs\[1\]='x', must be a KVLayerSpec"):
        KVCache.make(cfg, [KVLayerSpec.attention(1, 2), "x"])
    with pytest.raises(TypeError, match=r"KVCache\.make: layer_specs=.*must be a sequence"):
        KVCache.make(cfg, KVLayerSpec.attention(1, 2))
    with pytest.raises(ValueError, match=r"KVCache\.make: config.device='cuda:0', kvref stores on 'cpu' only"):
        KVCache.make(KVCacheConfig(1, 2, 8, PAGED, device="cuda:0"), [KVLayerSpec.attention(1, 2)])
    with pytest.raises(TypeError, match=r"KVCache\.make"):
        KVCache(cfg, [])


@pytest.mark.parametrize("pkg", ["kvref", "kvfast"])
def test_make_refuses_cross_layers_of_different_max_enc_len(pkg):
    # spec/slot-cache.md §8.16: one encoder length per slot, so cross layers share max_enc_len
    import importlib

    from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec

    mod = importlib.import_module(pkg)
    cfg = KVCacheConfig(3, 2, 8, KVCacheMode.PAGED, block_size=2)
    specs = [KVLayerSpec.cross_attention(1, 2, 3), KVLayerSpec.attention(1, 2), KVLayerSpec.cross_attention(1, 2, 1)]
    with pytest.raises(ValueError, match=r"layer_specs\[2\]\.max_enc_len=1 but layer_specs\[0\]\.max_enc_len=3"):
        mod.KVCache.make(cfg, specs)
