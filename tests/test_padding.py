"""Padding takes no blocks and never enters a prefix hash (issue 33, deliverable 5).

``spec/slot-cache.md`` §13: ``prepare_step``'s varlen path needs no pads; a caller holding a
left-padded batch (transformers' ``attention_mask``) gives ``admit`` / ``retire`` its
``pad_token_id`` or ``attention_mask`` and the pads are removed before anything is hashed,
hit or published, and a caller that keeps the padded layout maps its pads to
``slot_mapping = -1`` (``spec/slot-cache.md`` §7.1), so they take no position and no block.
Both packages (kvref, kvfast on the CPU).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvfast
import kvref
from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec
from kvspec.conformance.machine import cache_snapshot

PKGS = [pytest.param(kvref, id="kvref"), pytest.param(kvfast, id="kvfast")]
P = 4
PAD = 0
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # 10 tokens: two full blocks and a partial one


def _cache(pkg, dtype="float32"):
    cfg = KVCacheConfig(num_layers=1, max_seqs=4, max_seq_len=32, mode=KVCacheMode.PAGED, block_size=P,
                        dtype=dtype)
    return pkg.KVCache.make(cfg, [KVLayerSpec.attention(1, 2)])


def _blocks_held(cache, slot):
    return int(np.count_nonzero(cache.paged_block_table()[slot]))


def _num_free(cache):
    return len(cache._free_order())


def _prefill(pkg, cache, slot, tokens, hit=0, seed=0):
    """The step after an admit: the tokens past the hit, K/V written, committed."""
    n = len(tokens) - hit
    step = cache.prepare_step([0, n], [hit], [slot])
    k = np.random.default_rng(seed).standard_normal((n, 1, 2)).astype(np.float32)
    pkg.ops.append_kv(cache, 0, k, -k, step)
    cache.update_position(slot, hit + n)


def _fp(cache):
    return repr((cache_snapshot(cache, cache.layer_specs, free_order=True), cache._pool.snapshot(),
                 cache._nblk.tolist(), cache._nshared.tolist()))


@pytest.mark.parametrize("pkg", PKGS)
def test_a_left_padded_prompt_reuses_the_unpadded_prefix(pkg):
    c = _cache(pkg)
    _prefill(pkg, c, 0, PROMPT)
    c.retire(0, PROMPT)
    padded = [PAD] * 5 + PROMPT
    # without the pad id the pads are tokens: the chain differs and nothing is reused (the complaint)
    assert c.admit(1, padded) == 0
    c.evict_batch(1)
    # the same admission and prefill of the unpadded prompt on a twin cache: every block and count agree
    twin = _cache(pkg)
    _prefill(pkg, twin, 0, PROMPT)
    twin.retire(0, PROMPT)
    assert twin.admit(1, padded) == 0
    twin.evict_batch(1)
    hit = c.admit(1, padded, pad_token_id=PAD)
    assert hit == 8 == c.seq_lens()[1] == twin.admit(1, PROMPT)
    _prefill(pkg, c, 1, PROMPT, hit=hit, seed=1)
    _prefill(pkg, twin, 1, PROMPT, hit=hit, seed=1)
    assert _blocks_held(c, 1) == 3  # ceil(10 / 4): the five pads took no block
    assert c.paged_block_table().tolist() == twin.paged_block_table().tolist()
    assert c._free_order() == twin._free_order()
    c.check_invariants()
    c.evict_batch(1)
    mask = [0] * 5 + [1] * len(PROMPT)
    assert c.admit(2, padded, attention_mask=mask) == 8
    assert c.admit(3, padded, attention_mask=np.array(mask, bool)) == 8
    c.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_a_padded_retire_publishes_the_unpadded_chain(pkg):
    c = _cache(pkg)
    padded = [PAD, PAD, PAD] + PROMPT
    assert c.admit(0, padded, pad_token_id=PAD) == 0
    _prefill(pkg, c, 0, PROMPT)
    c.retire(0, padded, pad_token_id=PAD)
    assert c.admit(1, PROMPT + [1]) == 8  # the unpadded prompt hits what the padded row published
    c.evict_batch(1)
    # a right-padded row (pads after the prompt) through the mask publishes the same chain
    hit = c.admit(2, PROMPT)
    assert hit == 8
    _prefill(pkg, c, 2, PROMPT, hit=hit, seed=2)
    right = PROMPT + [PAD, PAD]
    c.retire(2, right, attention_mask=[1] * len(PROMPT) + [0, 0])
    assert c.admit(1, PROMPT + [1]) == 8
    c.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_without_removal_pads_enter_the_hash(pkg):
    """What the rule prevents: a retire of the padded ids publishes a chain the unpadded prompt misses."""
    c = _cache(pkg)
    padded = [PAD] * 3 + PROMPT
    _prefill(pkg, c, 0, padded)  # the pads written as tokens: four blocks
    assert _blocks_held(c, 0) == 4
    c.retire(0, padded)
    assert c.admit(1, PROMPT + [1]) == 0


@pytest.mark.parametrize("pkg", PKGS)
def test_pad_token_id_removes_only_the_leading_run(pkg):
    c = _cache(pkg)
    toks = [PAD, PAD, 5, PAD, 6, 7, 8, 9, 10]  # a pad id inside the prompt is a token
    c.admit(0, toks, pad_token_id=PAD)
    _prefill(pkg, c, 0, toks[2:])
    c.retire(0, toks, pad_token_id=PAD)
    assert c.admit(1, toks[2:] + [1]) == 4
    assert c.admit(2, [5, 6, 7, 8, 9]) == 0  # the kept pad id is part of block 0
    c.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_addressable_len_counts_tokens_after_the_pads(pkg):
    c = _cache(pkg)
    _prefill(pkg, c, 0, PROMPT)
    c.retire(0, [PAD] * 2 + PROMPT, addressable_len=4, pad_token_id=PAD)  # publishes block 0 only
    assert c.admit(1, [PAD] * 7 + PROMPT, pad_token_id=PAD) == 4
    c.evict_batch(1)
    assert c.admit(1, [PAD] * 7 + PROMPT, addressable_len=3, pad_token_id=PAD) == 0
    c.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_padded_layout_pads_take_no_block_and_no_byte(pkg, dtype):
    """A caller that keeps transformers' padded layout maps pads to slot_mapping -1: the step reserves
    blocks for the real tokens only, and the pads' K/V (NaN here) are never read or stored."""
    c = _cache(pkg, dtype=dtype)
    pads = 3
    free = _num_free(c)
    step = c.prepare_step([0, len(PROMPT)], [0], [0])  # the real tokens only
    assert free - _num_free(c) == 3 == _blocks_held(c, 0)
    sm = np.concatenate([np.full(pads, -1, np.int64), np.asarray(step.slot_mapping)])
    padded_step = dataclasses.replace(step, slot_mapping=sm,
                                      cu_seqlens_q=np.array([0, pads + len(PROMPT)], np.int32),
                                      batch_indices=np.zeros(pads + len(PROMPT), np.int32),
                                      positions=np.concatenate([np.zeros(pads, np.int32), step.positions]))
    k = np.random.default_rng(3).standard_normal((pads + len(PROMPT), 1, 2)).astype(np.float32)
    k[:pads] = np.nan
    pkg.ops.append_kv(c, 0, k, -k, padded_step)
    c.update_position(0, len(PROMPT))
    other = _cache(pkg, dtype=dtype)
    step2 = other.prepare_step([0, len(PROMPT)], [0], [0])
    pkg.ops.append_kv(other, 0, k[pads:], -k[pads:], step2)
    other.update_position(0, len(PROMPT))
    got = [np.asarray(x) for x in pkg.ops.gather_kv(c, 0, 0)]
    want = [np.asarray(x) for x in pkg.ops.gather_kv(other, 0, 0)]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert _blocks_held(c, 0) == 3
    c.check_invariants()


@pytest.mark.parametrize("pkg", PKGS)
def test_padding_argument_errors_leave_the_cache_unchanged(pkg):
    c = _cache(pkg)
    _prefill(pkg, c, 0, PROMPT)
    cases = [
        (lambda: c.admit(1, [PAD, 5], pad_token_id=PAD, attention_mask=[0, 1]), ValueError,
         r"admit: pad_token_id=0 and an attention_mask given, pass one of them"),
        (lambda: c.admit(1, [PAD, 5], pad_token_id=0.5), TypeError, r"admit: pad_token_id=0.5, must be an int"),
        (lambda: c.admit(1, [PAD, 5], pad_token_id=True), TypeError, r"admit: pad_token_id=True, must be an int"),
        (lambda: c.admit(1, [PAD, 5], pad_token_id=2**31), ValueError,
         r"admit: pad_token_id=2147483648 out of int32 range"),
        (lambda: c.admit(1, [PAD, 5], attention_mask=[0.0, 1.0]), TypeError,
         r"admit: attention_mask dtype=float64, must be bool or integer 0/1"),
        (lambda: c.admit(1, [PAD, 5], attention_mask=[1]), ValueError,
         r"admit: attention_mask.shape=\(1,\), must be \[len\(prompt_ids\)\]=\[2\]"),
        (lambda: c.admit(1, [PAD, 5], attention_mask=[[0, 1]]), ValueError, r"admit: attention_mask.shape=\(1, 2\)"),
        (lambda: c.admit(1, [PAD, 5], attention_mask=[0, 2]), ValueError,
         r"admit: attention_mask\[1\]=2, must be 0 \(pad\) or 1 \(token\)"),
        (lambda: c.admit(1, [PAD, PAD, PAD], pad_token_id=PAD), ValueError,
         r"admit: prompt_ids holds 3 pads and no token, must hold >= 1 token"),
        (lambda: c.admit(1, [7, 8], attention_mask=[0, 0]), ValueError, r"admit: prompt_ids holds 2 pads and no token"),
        (lambda: c.retire(0, PROMPT, pad_token_id=PAD, attention_mask=[1] * 10), ValueError,
         r"retire: pad_token_id=0 and an attention_mask given"),
        (lambda: c.retire(0, PROMPT, attention_mask=[1] * 9), ValueError,
         r"retire: attention_mask.shape=\(9,\), must be \[len\(full_token_ids\)\]=\[10\]"),
        (lambda: c.retire(0, [PAD] * 2 + PROMPT, addressable_len=11, pad_token_id=PAD), ValueError,
         r"retire: addressable_len=11 > seq_lens\(\)\[0\]=10"),
    ]
    for fn, exc, match in cases:
        before = _fp(c)
        with pytest.raises(exc, match=match):
            fn()
        assert _fp(c) == before, match
        c.check_invariants()
    c.retire(0, [PAD] * 4, pad_token_id=PAD)  # nothing left to publish: allowed, as an empty full_token_ids
    c.check_invariants()
