"""Method-level conformance tests of the slot cache (``KVCache``, DESIGN §4).

Each test drives the backend and kvref in lockstep (``CachePair``): same
outcome per call, unchanged state after every raise. Some add absolute checks
that hold whatever kvref does (the spec's numbers), so that a test also
guards kvref itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvspec import CapacityError, KVCacheConfig, KVCacheMode, KVLayerSpec
from kvspec.conformance._compare import assert_same, to_numpy
from kvspec.conformance._harness import CachePair
from kvspec.conformance.machine import live_kv
from kvspec.conformance.plugin import require

MODES = [pytest.param(KVCacheMode.CONTIGUOUS, id="contiguous"), pytest.param(KVCacheMode.PAGED, id="paged")]
_CAP = {KVCacheMode.CONTIGUOUS: "contiguous", KVCacheMode.PAGED: "paged"}


def _pair(backend, oracle, mode=KVCacheMode.PAGED, *, specs=None, **cfg) -> CachePair:
    require(backend, _CAP[mode])
    kw = dict(num_layers=1, max_seqs=3, max_seq_len=8, mode=mode, block_size=2, dtype="float16")
    kw.update(cfg)
    specs = specs or [KVLayerSpec.attention(2, 4)]
    kw["num_layers"] = len(specs)
    return CachePair(backend, oracle, KVCacheConfig(**kw), specs)


def _i32(x):
    return np.array(x, np.int32)


# ---------------------------------------------------------------- construction and accessors


@pytest.mark.parametrize("mode", MODES)
def test_make_starts_empty(kv_backend, kv_oracle, mode):
    p = _pair(kv_backend, kv_oracle, mode)
    p.agree()
    assert_same(np.zeros(3, np.int32), p.sut.seq_lens(), "seq_lens() after make")
    table = p.sut.paged_block_table()
    if mode is KVCacheMode.PAGED:
        assert_same(np.zeros((3, 4), np.int32), table, "paged_block_table() after make")
    else:
        assert table is None, f"paged_block_table()={table!r} on a contiguous cache, must be None"


def test_direct_construction_refused(kv_backend, kv_oracle):
    p = _pair(kv_backend, kv_oracle, KVCacheMode.PAGED if kv_backend.supports("paged") else KVCacheMode.CONTIGUOUS)
    with pytest.raises(TypeError, match="KVCache.make"):
        type(p.sut)()


@pytest.mark.parametrize("mode", MODES)
def test_make_rejects_wrong_layer_count(kv_backend, kv_oracle, mode):
    require(kv_backend, _CAP[mode])
    cfg = KVCacheConfig(num_layers=2, max_seqs=2, max_seq_len=8, mode=mode, block_size=2)
    specs = [KVLayerSpec.attention(1, 2)]
    with pytest.raises(ValueError) as ref:
        kv_oracle.make_cache(cfg, specs)
    with pytest.raises(ValueError) as got:
        kv_backend.build_cache(cfg, specs)
    assert str(got.value) == str(ref.value)


@pytest.mark.parametrize("mode", MODES)
def test_accessor_errors(kv_backend, kv_oracle, mode):
    specs = [KVLayerSpec.attention(1, 2), KVLayerSpec.state((2,), 3, (1, 2, 2))]
    if not kv_backend.supports("state"):
        specs = specs[:1]
    p = _pair(kv_backend, kv_oracle, mode, specs=specs)
    p.raises("cache.keys(5)", lambda c, o: c.keys(5), IndexError)
    p.raises("cache.values(-1)", lambda c, o: c.values(-1), IndexError)
    p.raises("cache.conv_state(0)", lambda c, o: c.conv_state(0), TypeError)
    p.raises("cache.recurrent_state(0)", lambda c, o: c.recurrent_state(0), TypeError)
    if len(specs) > 1:
        p.raises("cache.keys(1)", lambda c, o: c.keys(1), TypeError)
        p.raises("cache.conv_state(1, 1)", lambda c, o: c.conv_state(1, 1), IndexError)
    p.raises("cache.evict_batch(3)", lambda c, o: c.evict_batch(3), IndexError)
    p.raises("cache.update_position(0, 9)", lambda c, o: c.update_position(0, 9), ValueError)
    p.raises("cache.update_position(0, -1)", lambda c, o: c.update_position(0, -1), ValueError)
    p.raises("cache.update_position(7, 0)", lambda c, o: c.update_position(7, 0), IndexError)


def test_paged_only_methods_refuse_contiguous(kv_backend, kv_oracle):
    p = _pair(kv_backend, kv_oracle, KVCacheMode.CONTIGUOUS)
    p.raises("cache.reserve([0], [1])", lambda c, o: c.reserve(_i32([0]), _i32([1])), RuntimeError)
    p.raises("cache.admit(0, [1, 2])", lambda c, o: c.admit(0, _i32([1, 2])), RuntimeError)
    p.raises("cache.retire(0, [1, 2])", lambda c, o: c.retire(0, _i32([1, 2])), RuntimeError)


@pytest.mark.parametrize("mode", MODES)
def test_views_are_live_and_stable(kv_backend, kv_oracle, mode):
    from kvspec.conformance._compare import data_ptr

    p = _pair(kv_backend, kv_oracle, mode)
    k0, v0 = data_ptr(p.sut.keys(0)), data_ptr(p.sut.values(0))
    p.write(0, 3, seed=1)
    p.ok("cache.evict_batch(0)", lambda c, o: c.evict_batch(0))
    p.ok("cache.reset()", lambda c, o: c.reset())
    assert data_ptr(p.sut.keys(0)) == k0 and data_ptr(p.sut.values(0)) == v0, "keys()/values() moved after reset()"
    p.agree()


# ---------------------------------------------------------------- prepare_step


@pytest.mark.parametrize("mode", MODES)
def test_prepare_step_indices(kv_backend, kv_oracle, mode):
    p = _pair(kv_backend, kv_oracle, mode)
    p.write(1, 3, seed=1)
    ref, got = p.ok("cache.prepare_step([0, 2, 3], [3, 0], [1, 0])",
                    lambda c, o: c.prepare_step(_i32([0, 2, 3]), _i32([3, 0]), _i32([1, 0])))
    assert_same(ref, got, "StepIndices")
    for name, dt in (("cu_seqlens_q", np.int32), ("slot_mapping", np.int64), ("positions", np.int32),
                     ("has_initial_state", np.bool_)):
        assert to_numpy(getattr(got, name)).dtype == dt, f"StepIndices.{name} dtype"
    assert_same(_i32([3, 4, 0]), got.positions, "positions")
    assert_same(_i32([5, 1]), got.seqused_k, "seqused_k")
    assert_same(np.array([True, False]), got.has_initial_state, "has_initial_state")
    assert_same(_i32([1, 2]), got.logits_indices, "logits_indices")
    assert_same(_i32([3, 0]), p.sut.seq_lens()[[1, 0]], "prepare_step must not advance seq_lens()")
    p.agree()


@pytest.mark.parametrize("mode", MODES)
def test_prepare_step_errors(kv_backend, kv_oracle, mode):
    p = _pair(kv_backend, kv_oracle, mode)
    p.write(0, 2, seed=3)
    cases = [
        ("cu[0] != 0", ([1, 2], [2], [0]), ValueError),
        ("non-increasing cu", ([0, 2, 2], [2, 0], [0, 1]), ValueError),
        ("len(cu) != B+1", ([0, 1, 2], [2], [0]), ValueError),
        ("len(past) != B", ([0, 1], [2, 0], [0]), ValueError),
        ("past != seq_lens", ([0, 1], [1], [0]), ValueError),
        ("duplicate slot", ([0, 1, 2], [2, 2], [0, 0]), ValueError),
        ("slot out of range", ([0, 1], [0], [3]), IndexError),
        ("past + q > max_seq_len", ([0, 7], [2], [0]), CapacityError),
    ]
    for what, (cu, past, slots), exc in cases:
        p.raises(f"cache.prepare_step({cu}, {past}, {slots})  # {what}",
                 lambda c, o, a=(cu, past, slots): c.prepare_step(*(_i32(x) for x in a)), exc)
    p.raises("cache.prepare_step(float cu)", lambda c, o: c.prepare_step(np.array([0.0, 1.0]), _i32([2]), _i32([0])),
             TypeError)
    p.agree()


@pytest.mark.parametrize("mode", MODES)
def test_prepared_rows_stay_until_evicted(kv_backend, kv_oracle, mode):
    # spec/slot-cache.md §2.8: a 3-token step prepared once, committed one token at a time; each
    # one-token step then maps its position to the row the first step gave it, allocating nothing.
    p = _pair(kv_backend, kv_oracle, mode)
    p.write(1, 1, seed=2)
    ref, chunk = p.ok("cache.prepare_step([0, 3], [1], [1])",
                      lambda c, o: c.prepare_step(_i32([0, 3]), _i32([1]), _i32([1])))
    rows = to_numpy(chunk.slot_mapping).tolist()
    for j in range(3):
        free = len(p.sut._free_order()) if mode is KVCacheMode.PAGED else 0
        ref, got = p.ok(f"cache.prepare_step([0, 1], [{1 + j}], [1])",
                        lambda c, o, j=j: c.prepare_step(_i32([0, 1]), _i32([1 + j]), _i32([1])))
        assert to_numpy(got.slot_mapping).tolist() == [rows[j]], f"position {1 + j} moved"
        if mode is KVCacheMode.PAGED:
            assert len(p.sut._free_order()) == free, "a prepared position allocated again"
        p.ok(f"cache.update_position(1, {2 + j})", lambda c, o, j=j: c.update_position(1, 2 + j))
    p.agree()


def test_failed_reservation_is_atomic(kv_backend, kv_oracle):
    # 4 usable blocks of 2 tokens; slot 0 takes 2, then a step needing 3 more must fail whole.
    p = _pair(kv_backend, kv_oracle, num_blocks=5)
    p.write(0, 4, seed=1)
    msg = p.raises("cache.prepare_step([0, 2, 6], [4, 0], [0, 1])",
                   lambda c, o: c.prepare_step(_i32([0, 2, 6]), _i32([4, 0]), _i32([0, 1])), CapacityError)
    assert "blocks" in msg, f"CapacityError message {msg!r} should count blocks"
    p.raises("cache.reserve([1, 2], [2, 4])", lambda c, o: c.reserve(_i32([1, 2]), _i32([2, 4])), CapacityError)
    p.agree()
    ref, got = p.ok("cache.reserve([1, 2], [2, 2])", lambda c, o: c.reserve(_i32([1, 2]), _i32([2, 2])))
    assert_same(_i32([0, 0]), got, "reserve returns pre-advance lengths")
    p.agree()


# ---------------------------------------------------------------- lifecycle


@pytest.mark.parametrize("mode", MODES)
def test_update_position_commits_and_rolls_back(kv_backend, kv_oracle, mode):
    p = _pair(kv_backend, kv_oracle, mode)
    p.write(2, 5, seed=4)
    p.ok("cache.update_position(2, 3)", lambda c, o: c.update_position(2, 3))
    p.ok("cache.update_position(2, 5)", lambda c, o: c.update_position(2, 5))
    p.agree()


@pytest.mark.parametrize("mode", MODES)
def test_evict_batch_zeroes_state_and_cross(kv_backend, kv_oracle, mode):
    require(kv_backend, "state", "cross")
    specs = [KVLayerSpec.attention(1, 2), KVLayerSpec.state((2, 3), 2, (1, 2, 2)), KVLayerSpec.cross_attention(1, 2, 3)]
    p = _pair(kv_backend, kv_oracle, mode, specs=specs)
    p.write(1, 3, seed=2)
    k = np.full((2, 1, 2), 1.5, np.float16)

    def dirty(c, o):
        c.fill(2, 1, k, k)
        for i in range(2):
            c.conv_state(1, i)[1] = 2.0
        c.recurrent_state(1)[1] = 3.0

    p.ok("cache.fill(2, 1, np.full((2, 1, 2), 1.5, np.float16), np.full((2, 1, 2), 1.5, np.float16)); "
         "cache.conv_state(1, 0)[1] = 2.0; cache.conv_state(1, 1)[1] = 2.0; cache.recurrent_state(1)[1] = 3.0", dirty)
    p.ok("cache.evict_batch(1)", lambda c, o: c.evict_batch(1))
    for i in range(2):
        assert not to_numpy(p.sut.conv_state(1, i))[1].any(), f"conv_state(1, {i})[1] not zeroed by evict_batch"
    assert not to_numpy(p.sut.recurrent_state(1))[1].any(), "recurrent_state(1)[1] not zeroed by evict_batch"
    assert not to_numpy(p.sut.keys(2))[1].any(), "cross plane keys(2)[1] not zeroed by evict_batch"
    p.ok("cache.evict_batch(1)  # idempotent", lambda c, o: c.evict_batch(1))
    p.agree()


def test_fill_errors(kv_backend, kv_oracle):
    require(kv_backend, "cross")
    specs = [KVLayerSpec.attention(1, 2), KVLayerSpec.cross_attention(1, 2, 3)]
    mode = KVCacheMode.PAGED if kv_backend.supports("paged") else KVCacheMode.CONTIGUOUS
    p = _pair(kv_backend, kv_oracle, mode, specs=specs)
    k2 = np.ones((2, 1, 2), np.float16)
    p.raises("cache.fill(0, 0, k, v)  # not cross", lambda c, o: c.fill(0, 0, k2, k2), TypeError)
    p.raises("cache.fill(1, 0, k[4], v[4])  # t_enc > max", lambda c, o: c.fill(1, 0, np.ones((4, 1, 2)), np.ones((4, 1, 2))), ValueError)
    p.raises("cache.fill(1, 0, k, v)  # wrong heads", lambda c, o: c.fill(1, 0, np.ones((2, 2, 2)), np.ones((2, 2, 2))), ValueError)
    p.ok("cache.fill(1, 0, k, v)", lambda c, o: c.fill(1, 0, k2, k2))
    p.raises("cache.fill(1, 0, k[1], v[1])  # other t_enc", lambda c, o: c.fill(1, 0, k2[:1], k2[:1]), ValueError)
    step = p.ok("cache.prepare_step([0, 1], [0], [0])", lambda c, o: c.prepare_step(_i32([0, 1]), _i32([0]), _i32([0])))
    assert_same(_i32([2]), step[1].cross_seqused_k, "cross_seqused_k")
    p.agree()


# ---------------------------------------------------------------- prefix reuse (paged)


def test_admit_retire_roundtrip(kv_backend, kv_oracle):
    p = _pair(kv_backend, kv_oracle)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    assert_same(0, p.ok("cache.admit(0, prompt)", lambda c, o: c.admit(0, _i32(prompt)))[1], "admit on an empty index")
    written = p.write(0, 7, seed=5)
    p.ok("cache.retire(0, prompt + [8])", lambda c, o: c.retire(0, _i32(prompt + [8])))
    p.agree()
    hit = p.ok("cache.admit(2, prompt + [9])", lambda c, o: c.admit(2, _i32(prompt + [9])))[1]
    assert hit == 6, f"admit hit={hit}, expected 6 (three full published blocks of 2)"
    k, v = live_kv(p.sut, 0, 2, 6)
    assert_same(written[0][0][:6], k, "K served by the hit")
    assert_same(written[0][1][:6], v, "V served by the hit")
    p.raises("cache.admit(2, prompt)  # slot busy", lambda c, o: c.admit(2, _i32(prompt)), ValueError)
    p.raises("cache.admit(1, [])", lambda c, o: c.admit(1, _i32([])), ValueError)
    p.raises("cache.retire(2, prompt, 7)  # addressable > seq", lambda c, o: c.retire(2, _i32(prompt), 7), ValueError)
    p.agree()


def test_last_token_is_never_a_hit(kv_backend, kv_oracle):
    """DESIGN §5/§4.2: the default cap is len(prompt) - 1, so a prompt of whole
    published blocks hits all but its last block."""
    p = _pair(kv_backend, kv_oracle)
    prompt = [3, 1, 4, 1, 5, 9]
    p.ok("cache.admit(0, prompt)", lambda c, o: c.admit(0, _i32(prompt)))
    p.write(0, 6, seed=7)
    p.ok(f"cache.retire(0, np.array({prompt}, np.int32))", lambda c, o: c.retire(0, _i32(prompt)))
    hit = p.ok(f"cache.admit(1, np.array({prompt}, np.int32))", lambda c, o: c.admit(1, _i32(prompt)))[1]
    assert hit == 4, f"admit of a fully published prompt hit {hit}, expected 4 (len 6 - 1, whole blocks)"
    p.agree()


def test_tail_first_eviction(kv_backend, kv_oracle):
    """DESIGN §4.2: a released chain goes to the LRU tail-first, so pressure
    evicts its tail and the head stays hittable."""
    p = _pair(kv_backend, kv_oracle, num_blocks=4)
    prompt = [1, 1, 2, 2, 3, 3]
    p.ok("cache.admit(0, prompt)", lambda c, o: c.admit(0, _i32(prompt)))
    p.write(0, 6, seed=1)
    p.ok("cache.retire(0, prompt)", lambda c, o: c.retire(0, _i32(prompt)))
    p.ok("cache.reserve([1], [1])  # evicts one retained block", lambda c, o: c.reserve(_i32([1]), _i32([1])))
    hit = p.ok("cache.admit(2, prompt + [4])", lambda c, o: c.admit(2, _i32(prompt + [4])))[1]
    assert hit == 4, f"hit={hit} after one eviction, expected 4: the chain's tail must be evicted first"
    p.agree()


def test_prefix_hit_verifies_tokens_under_hash_collisions(kv_backend, kv_oracle):
    """DESIGN §6: a hash is a key, not a proof. With the backend's hashing made
    to collide (every block of a depth has the same hash), hits must still stop
    at the first block whose stored tokens differ, and serve only verified K/V."""
    require(kv_backend, "paged")
    if kv_backend.collide_hashes is None:
        pytest.skip(f"backend {kv_backend.name} has no collide_hashes hook")
    cfg = KVCacheConfig(num_layers=1, max_seqs=3, max_seq_len=8, mode=KVCacheMode.PAGED, block_size=2)
    specs = [KVLayerSpec.attention(1, 2)]
    with kv_backend.collide_hashes():
        from kvspec.conformance._harness import write_step

        cache = kv_backend.build_cache(cfg, specs)
        a = [1, 1, 2, 2, 3, 3]
        cache.admit(0, _i32(a))
        written = write_step(cache, kv_backend.ops, 0, 6, seed=11)
        cache.retire(0, _i32(a))
        b = [1, 1, 2, 2, 5, 5, 6]
        hit = cache.admit(1, _i32(b))
        assert hit == 4, (
            f"admit hit={hit} for a prompt that matches 2 blocks then differs, expected 4: positions "
            f"[4, {hit}) would serve K/V stored for tokens {a[4:hit]} to prompt tokens {b[4:hit]}"
        )
        k, _ = live_kv(cache, 0, 1, 4)
        assert_same(written[0][0][:4], k, "K of the verified hit")
        c = [7, 7, 7, 7, 7]
        hit = cache.admit(2, _i32(c))
        assert hit == 0, f"admit hit={hit} for a prompt sharing no tokens, expected 0 (hashes collide, tokens differ)"
        if kv_backend.supports("invariants"):
            cache.check_invariants()


def test_state_checkpoint_roundtrip(kv_backend, kv_oracle):
    require(kv_backend, "state")
    specs = [KVLayerSpec.attention(1, 2), KVLayerSpec.state((2,), 2, (1, 2, 2))]
    p = _pair(kv_backend, kv_oracle, specs=specs)
    prompt = [1, 2, 3, 4, 5]
    p.ok(f"cache.admit(0, np.array({prompt}, np.int32))", lambda c, o: c.admit(0, _i32(prompt)))
    p.write(0, 4, seed=2)

    def set_state(c, o):
        c.conv_state(1, 0)[0] = 1.25
        c.recurrent_state(1)[0] = -0.5

    p.ok("cache.conv_state(1, 0)[0] = 1.25; cache.recurrent_state(1)[0] = -0.5", set_state)
    p.ok(f"cache.retire(0, np.array({prompt}, np.int32))", lambda c, o: c.retire(0, _i32(prompt)))
    hit = p.ok(f"cache.admit(1, np.array({prompt}, np.int32))", lambda c, o: c.admit(1, _i32(prompt)))[1]
    assert hit == 4, f"hybrid admit hit={hit}, expected 4 (checkpoint at the block boundary 4)"
    assert (to_numpy(p.sut.recurrent_state(1))[1] == -0.5).all(), "checkpointed recurrent state not restored"
    p.agree()


@pytest.mark.parametrize("mode", MODES)
def test_attention_through_cache(kv_backend, kv_oracle, mode):
    """``ops.varlen_attention`` through the cache equals kvref's within tolerance."""
    if kv_backend.ops is None:
        pytest.skip(f"backend {kv_backend.name} ships no ops")
    specs = [KVLayerSpec.attention(1, 4), KVLayerSpec.sliding_window(1, 4, 3)]
    if not kv_backend.supports("sliding_window"):
        specs = specs[:1]
    p = _pair(kv_backend, kv_oracle, mode, specs=specs, dtype="float32")
    p.write(0, 3, seed=1)
    step = p.ok("cache.prepare_step([0, 2, 3], [3, 0], [0, 1])",
                lambda c, o: c.prepare_step(_i32([0, 2, 3]), _i32([3, 0]), _i32([0, 1])))
    from kvspec.strategies import exact_values

    for l in range(len(specs)):
        kv = exact_values((3, 1, 4), "float32", 40 + l)
        p.ok(f"ops.append_kv(cache, {l}, k, v, step)",
             lambda c, o, l=l: o.append_kv(c, l, kv, kv, step[0] if c is p.ref else step[1]))
        q = exact_values((3, 2, 4), "float32", 50 + l)
        r = kv_oracle.ops.varlen_attention(q, p.ref, l, step[0])
        g = to_numpy(kv_backend.ops.varlen_attention(q, p.sut, l, step[1]))
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=f"varlen_attention layer {l}")


@pytest.mark.parametrize("mode", MODES)
def test_attention_softcap_and_sinks(kv_backend, kv_oracle, mode):
    """spec/slot-cache.md §7.3: ``softcap`` and ``sinks`` through the cache equal kvref's; bad
    values raise kvref's error type."""
    if kv_backend.ops is None:
        pytest.skip(f"backend {kv_backend.name} ships no ops")
    require(kv_backend, "attention_options")
    specs = [KVLayerSpec.attention(1, 4), KVLayerSpec.sliding_window(1, 4, 3)]
    if not kv_backend.supports("sliding_window"):
        specs = specs[:1]
    p = _pair(kv_backend, kv_oracle, mode, specs=specs, dtype="float32")
    p.write(0, 3, seed=2)
    step = p.ok("cache.prepare_step([0, 2, 3], [3, 0], [0, 1])",
                lambda c, o: c.prepare_step(_i32([0, 2, 3]), _i32([3, 0]), _i32([0, 1])))
    from kvspec.strategies import exact_values

    sinks = np.array([1.0, -0.5], np.float32)
    for l in range(len(specs)):
        kv = exact_values((3, 1, 4), "float32", 60 + l)
        p.ok(f"ops.append_kv(cache, {l}, k, v, step)",
             lambda c, o, l=l: o.append_kv(c, l, kv, kv, step[0] if c is p.ref else step[1]))
        q = exact_values((3, 2, 4), "float32", 70 + l) * 4
        for softcap, sink in ((0.5, None), (None, sinks), (2.0, sinks)):
            r = kv_oracle.ops.varlen_attention(q, p.ref, l, step[0], softcap=softcap, sinks=sink)
            g = to_numpy(kv_backend.ops.varlen_attention(q, p.sut, l, step[1], softcap=softcap, sinks=sink))
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5,
                                       err_msg=f"varlen_attention layer {l} softcap={softcap} sinks={sink}")
        for bad, exc in ((dict(softcap=-1.0), ValueError), (dict(softcap=[1.0]), TypeError),
                         (dict(sinks=np.zeros(3, np.float32)), ValueError),
                         (dict(sinks=np.zeros(2, np.int64)), TypeError)):
            with pytest.raises(exc):
                kv_backend.ops.varlen_attention(q, p.sut, l, step[1], **bad)
    p.agree()


# ---------------------------------------------------------------- FP8 K/V (spec/slot-cache.md §10)


def _dense_attention(q, k, v, mask, scale):
    """float32 attention of q [Tq, Hq, D] over k, v [Tk, Hk, D] under a bool mask (GQA by repeat)."""
    group = q.shape[1] // k.shape[1]
    k = np.repeat(k.astype(np.float32), group, axis=1)
    v = np.repeat(v.astype(np.float32), group, axis=1)
    s = np.einsum("qhd,khd->hqk", q.astype(np.float32), k) * np.float32(scale)
    s = np.where(mask[None], s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", w / w.sum(axis=-1, keepdims=True), v)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("mode", MODES)
def test_fp8_quantised_bytes_scales_and_dequantised_attention(kv_backend, kv_oracle, mode, dtype):
    """Same FP8 bytes and scales as kvref; ``gather_kv`` dequantised exactly as kvref; attention
    equals dense attention over the backend's own dequantised history."""
    require(kv_backend, "slot_fp8")
    if kv_backend.ops is None:
        pytest.skip(f"backend {kv_backend.name} ships no ops")
    p = _pair(kv_backend, kv_oracle, mode, specs=[KVLayerSpec.attention(2, 4)], dtype=dtype, max_seq_len=8, block_size=4)
    rng = np.random.default_rng(3)
    past = 0
    for q_len, mag in ((3, 0.5), (2, 40.0), (1, 0.01)):  # the second step re-quantises the first block
        step = p.ok(f"cache.prepare_step([0, {q_len}], [{past}], [1])",
                    lambda c, o: c.prepare_step(_i32([0, q_len]), _i32([past]), _i32([1])))
        k = (rng.standard_normal((q_len, 2, 4)) * mag).astype(np.float32)
        v = (rng.standard_normal((q_len, 2, 4)) * mag).astype(np.float32)
        p.ok("ops.append_kv(cache, 0, k, v, step)",
             lambda c, o: o.append_kv(c, 0, k, v, step[0] if c is p.ref else step[1]))
        bad = k.copy()
        bad[0, 0, 0] = np.nan
        p.raises("ops.append_kv(cache, 0, k_nan, v, step)",
                 lambda c, o: o.append_kv(c, 0, bad, v, step[0] if c is p.ref else step[1]), ValueError)
        q = rng.standard_normal((q_len, 4, 4)).astype(np.float32)
        out = to_numpy(kv_backend.ops.varlen_attention(q, p.sut, 0, step[1]))
        p.ok(f"cache.update_position(1, {past + q_len})", lambda c, o: c.update_position(1, past + q_len))
        past += q_len
        r, s = p.ok("ops.gather_kv(cache, 0, 1)", lambda c, o: tuple(to_numpy(x) for x in o.gather_kv(c, 0, 1)))
        assert_same(r, s, "gather_kv (dequantised float32)")
        K, V = s
        mask = np.arange(past)[None, :] <= (past - q_len + np.arange(q_len))[:, None]
        np.testing.assert_allclose(out, _dense_attention(q, K, V, mask, 0.5), rtol=1e-5, atol=1e-6,
                                   err_msg="varlen_attention over the dequantised history")
        for a, b, name in zip(p.ref.scales(0), p.sut.scales(0), "KV"):
            assert_same(to_numpy(a), to_numpy(b), f"scales(0) {name}")
    p.agree()


# ---------------------------------------------------------------- speculative decoding (spec/slot-cache.md §11)


@pytest.mark.parametrize("mode", MODES)
def test_spec_decode_checkpoint_and_restore(kv_backend, kv_oracle, mode):
    """``checkpoint_state`` before a verification step; ``restore_state`` brings back the state
    slabs and the length; errors without a checkpoint; dropped by ``evict_batch``."""
    require(kv_backend, "slot_spec_decode")
    specs = [KVLayerSpec.attention(1, 2), KVLayerSpec.state((2,), 2, (1, 2, 2))]
    if not kv_backend.supports("state"):
        specs = specs[:1]
    p = _pair(kv_backend, kv_oracle, mode, specs=specs)
    p.raises("cache.restore_state(0)", lambda c, o: c.restore_state(0), ValueError)
    p.raises("cache.checkpoint_state(3)", lambda c, o: c.checkpoint_state(3), IndexError)
    p.write(0, 3, seed=4)
    assert p.ok("cache.checkpoint_state(0)", lambda c, o: c.checkpoint_state(0))[1] == 3

    def verify(c, o):  # a forward over 1 + 2 drafts moves the state past the accepted length
        st = c.prepare_step(_i32([0, 3]), _i32([3]), _i32([0]))
        if len(specs) > 1:
            c.conv_state(1, 0)[0] = 2.5
            c.recurrent_state(1)[0] = -1.5
        return st.slot_mapping.shape[0]

    p.ok("verify(cache)", verify)
    assert p.ok("cache.restore_state(0)", lambda c, o: c.restore_state(0))[1] == 3
    assert_same(np.array([3, 0, 0], np.int32), p.sut.seq_lens(), "seq_lens() after restore_state")
    if len(specs) > 1:
        assert (to_numpy(p.sut.recurrent_state(1))[0] != -1.5).all(), "restore_state left the drafted state"
    p.agree()
    p.ok("cache.evict_batch(0)", lambda c, o: c.evict_batch(0))
    p.raises("cache.restore_state(0)", lambda c, o: c.restore_state(0), ValueError)
    p.agree()
