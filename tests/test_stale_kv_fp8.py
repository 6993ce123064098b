"""Wrong or stale FP8 K/V: values and scales must stay one unit through prefix hits, speculative
steps, rollbacks, reuse and reset (spec/slot-cache.md §10-§11, spec/manager.md §16), kvref and kvfast.

The class these tests close: a write (or a re-quantisation, which rewrites a whole unit-head)
that lands in a block another slot shares, or scales that stay behind when values move. Each
test compares every shared block's raw FP8 bytes *and* its scales before and after, and the
dequantised history a later reader gathers against what the first writer stored.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvspec import CapacityError, KVCacheConfig, KVCacheMode, KVLayerSpec
from test_slot_spec_decode import host, kv_of
from test_stale_kv_spec_decode import Fp8SpecHybridMachine

import kvfast
import kvref

PKGS = [kvref, kvfast]
IDS = ["kvref", "kvfast"]
P = 4


def _cache(pkg, dtype="float8_e4m3fn", num_blocks=24):
    cfg = KVCacheConfig(num_layers=1, max_seqs=3, max_seq_len=32, mode=KVCacheMode.PAGED, block_size=P,
                        dtype=dtype, num_blocks=num_blocks)
    return pkg.KVCache.make(cfg, [KVLayerSpec.attention(2, 4)])


def _write(pkg, c, b, tokens, *, scale=1.0):
    """One step of ``tokens`` after slot b's length (K/V ``scale`` times the model's)."""
    n = int(c.seq_lens()[b])
    step = c.prepare_step([0, len(tokens)], [n], [b])
    k, v = kv_of(tokens, range(n, n + len(tokens)))
    pkg.ops.append_kv(c, 0, k * scale, v * scale, step)
    return n


def _blocks(c, b, n):
    return [int(x) for x in c.paged_block_table()[b, :n]]


def _unit(c, blocks):
    """Raw FP8 bits and scales of ``blocks`` (K and V)."""
    ks, vs = c.scales(0)
    ids = np.asarray(blocks)
    return (host(c.keys(0))[ids].view(np.uint8).copy(), host(c.values(0))[ids].view(np.uint8).copy(),
            host(ks)[ids].copy(), host(vs)[ids].copy())


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_a_speculative_step_never_requantises_an_adopted_block(pkg, dtype):
    """Slot 1 adopts slot 0's two published blocks, then verifies drafts 1000x larger across a
    page boundary (their scales grow, their units re-quantise) and rolls back: the adopted
    blocks' bits and scales never change, and a third slot that adopts them reads the first
    writer's dequantised K/V exactly."""
    c = _cache(pkg, dtype)
    prompt = list(range(1, 10))  # 2 full blocks + 1 token
    _write(pkg, c, 0, prompt)
    c.update_position(0, len(prompt))
    K0, V0 = (host(x)[: 2 * P] for x in pkg.ops.gather_kv(c, 0, 0))
    c.retire(0, prompt)
    hit = c.admit(1, prompt + [11, 12, 13])
    assert hit == 2 * P
    shared = _blocks(c, 1, 2)
    before = _unit(c, shared)
    # a verifying step: the last prompt token then 6 large drafts, crossing into block 3
    n = _write(pkg, c, 1, [9, 11, 500, 501, 502, 503, 504], scale=1000.0)
    assert n == hit
    assert _same(_unit(c, shared), before), "a speculative step re-quantised a shared block"
    c.update_position(1, n + 2)  # one draft accepted: rejected rows stay as capacity
    with pytest.raises(ValueError, match="shared prefix"):
        c.update_position(1, hit - 1)  # a rollback into the shared prefix is refused
    assert _same(_unit(c, shared), before)
    c.evict_batch(1)
    assert c.admit(2, prompt + [7]) == 2 * P
    assert _blocks(c, 2, 2) == shared
    K2, V2 = (host(x) for x in pkg.ops.gather_kv(c, 0, 2))
    np.testing.assert_array_equal(K2, K0)
    np.testing.assert_array_equal(V2, V0)
    c.check_invariants()


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_rejected_drafts_grow_only_unshared_scales_and_retire_publishes_the_verified_units(pkg):
    """Drafts that grew a private block's scale and were rejected: retire publishes the block
    (values re-quantised at the grown scale, within the bound), and the next admission reads
    back exactly the stored bits times the stored scales, the scales unchanged since retire."""
    c = _cache(pkg)
    _write(pkg, c, 0, [1, 2, 3])
    c.update_position(0, 3)
    n = _write(pkg, c, 0, [4, 90, 91, 92], scale=1.0)  # drafts 90.. big: block 0's scale may grow
    c.update_position(0, n + 2)  # [1, 2, 3, 4, 90] verified
    toks = [1, 2, 3, 4, 90]
    blk = _blocks(c, 0, 1)
    c.retire(0, toks)
    after_retire = _unit(c, blk)
    assert c.admit(1, toks + [5]) == P
    assert _same(_unit(c, blk), after_retire)
    K, _ = pkg.ops.gather_kv(c, 0, 1)
    ks = host(c.scales(0)[0])[blk[0]]
    raw = host(c.keys(0))[blk[0]].astype(np.float32) * ks[None, :, None]
    np.testing.assert_array_equal(host(K), raw)


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_a_reused_block_starts_with_zero_scales_and_reset_zeroes_them(pkg):
    """A block evicted from the prefix cache and handed to another slot restarts its scales at 0
    (a small value written there is not quantised at the old owner's large scale), and reset()
    zeroes every scale while keeping the buffers."""
    c = _cache(pkg, num_blocks=9)  # 8 usable blocks: slot 1 reaches the retained ones
    big = list(range(1, 9))
    _write(pkg, c, 0, big, scale=1000.0)
    c.update_position(0, 8)
    old = _blocks(c, 0, 2)
    c.retire(0, big)  # published, retained
    # slot 1 takes every block: the retained ones are evicted and reused
    while True:
        try:
            _write(pkg, c, 1, [7] * P, scale=0.001)
        except CapacityError:
            break
        c.update_position(1, int(c.seq_lens()[1]) + P)
    n = int(c.seq_lens()[1])
    assert set(old) <= set(_blocks(c, 1, n // P)), "the retained blocks were not reused"
    K, _ = pkg.ops.gather_kv(c, 0, 1)
    want, _ = kv_of([7] * n, range(n))
    assert np.abs(host(K) - want * 0.001).max() <= 2.0**-4 * np.abs(want * 0.001).max(), \
        "a reused block kept its old owner's scale"
    ks, vs = c.scales(0)
    c.reset()
    assert not host(ks).any() and not host(vs).any()
    c.check_invariants()


def test_fp8_hybrid_manager_machine_e5m2_kvref():
    """The spec-decode machine over e5m2 pages (the e4m3fn one lives in test_stale_kv_spec_decode)."""
    class M(Fp8SpecHybridMachine):
        dtype = "float8_e5m2"

    from hypothesis import settings

    M.TestCase.settings = settings(M.TestCase.settings, deadline=None, max_examples=20)
    M.TestCase().runTest()
