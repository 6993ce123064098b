"""The slot-cache engines compared at the protocol level (``kvspec.engine.SlotEngine``,
``spec/slot-cache.md`` §9): kvref's reference engine and kvfast's fast engine, given the
same calls, find the same offenders, hand out the same blocks, build the same indices and
write the same bytes. The packages are compared at the API level in
``test_kvfast_differential.py`` and the conformance suite.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvfast
import kvref
from kvfast._slot_engine import FastSlotEngine
from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec
from kvspec.engine import STEP_OK, STEP_TOTAL, SlotEngine, WriteSets

S, L = 6, 40


def _engines():
    return kvref.ReferenceSlotEngine(), FastSlotEngine(S)


def test_engines_implement_the_protocol():
    for engine in _engines():
        assert isinstance(engine, SlotEngine) and engine.device == "cpu"
        assert isinstance(engine.write_sets(S), WriteSets)
    cfg = KVCacheConfig(1, 2, 8, KVCacheMode.PAGED, block_size=4)
    assert type(kvref.KVCache.make(cfg, [KVLayerSpec.attention(1, 2)]).engine) is kvref.ReferenceSlotEngine
    assert type(kvfast.KVCache.make(cfg, [KVLayerSpec.attention(1, 2)]).engine) is FastSlotEngine


small = st.integers(-2, 12)
wide = st.sampled_from([0, 1, L, L + 1, 2**31 - 1, 2**31, 2**62, 2**63 - 1, -(2**63)]) | small


@settings(max_examples=150)
@given(data=st.data())
def test_check_step_finds_the_same_offender(data):
    B = data.draw(st.integers(0, 5))
    valid = data.draw(st.booleans())
    seq = np.array(data.draw(st.lists(st.integers(0, L), min_size=S, max_size=S)), np.int32)
    if valid:
        slots = np.array(data.draw(st.permutations(range(S)))[:B], np.int64)
        past = seq[slots].astype(np.int64)
        q = data.draw(st.lists(st.integers(1, 8), min_size=B, max_size=B))
        cu = np.concatenate([[0], np.cumsum(q)]).astype(np.int64)
    else:
        slots = np.array(data.draw(st.lists(st.integers(-1, S), min_size=B, max_size=B)), np.int64)
        past = np.array(data.draw(st.lists(wide, min_size=B, max_size=B)), np.int64)
        cu = np.array(data.draw(st.lists(wide, min_size=B + 1, max_size=B + 1)), np.int64)
        if data.draw(st.booleans()):
            cu.sort()
    ref, fast = _engines()
    got = [e.check_step(cu, past, slots, seq, S, L) for e in (ref, fast)]
    assert tuple(map(int, got[0])) == tuple(map(int, got[1])), (cu, past, slots, seq)
    got = [e.check_slots(slots, S) for e in (ref, fast)]
    assert tuple(map(int, got[0])) == tuple(map(int, got[1]))


def test_check_step_total_beyond_int32():
    seq = np.full(S, 2**31 - 2, np.int32)
    for e in _engines():
        code, total, _ = e.check_step(np.array([0, 1, 2]), seq[:2].astype(np.int64), np.array([0, 1]), seq, S,
                                      2**31 - 1)
        assert (code, total) == (STEP_TOTAL, 2 * (2**31 - 1))


@settings(max_examples=60)
@given(data=st.data())
def test_growth_release_and_write_sets_agree(data):
    """Reserve, build, record, release through both engines on their own pools: same blocks, free order."""
    bs = data.draw(st.integers(1, 5))
    mb = -(-L // bs)
    nb = data.draw(st.integers(2, S * mb + 1))
    state = []
    for e in _engines():
        state.append(dict(e=e, pool=e.block_pool(nb, lambda h: None), table=np.zeros((S, mb), np.int32),
                          nblk=np.zeros(S, np.int64), seq=np.zeros(S, np.int32), ws=e.write_sets(S)))
    enc = np.arange(S, dtype=np.int64)
    for _ in range(data.draw(st.integers(1, 6))):
        B = data.draw(st.integers(0, S))
        slots = np.array(data.draw(st.permutations(range(S)))[:B], np.int64)
        seq = state[0]["seq"]
        q = [data.draw(st.integers(1, max(1, L - int(seq[s])))) if seq[s] < L else 0 for s in slots.tolist()]
        keep = [i for i, x in enumerate(q) if x]
        slots = slots[keep]
        q = [q[i] for i in keep]
        past = seq[slots].astype(np.int64)
        cu = np.concatenate([[0], np.cumsum(q)]).astype(np.int64)
        release = data.draw(st.booleans()) and slots.size > 0
        outs = []
        for st_ in state:
            e = st_["e"]
            assert e.check_step(cu, past, slots, st_["seq"], S, L)[0] == STEP_OK
            add, total = e.step_blocks_needed(cu, past, slots, st_["nblk"], bs)
            add2, total2 = e.blocks_needed(slots, past + np.diff(cu), st_["nblk"], bs)
            assert np.array_equal(add, add2) and total == total2
            if total > st_["pool"].num_free:
                outs.append(("full", total))
                continue
            e.grow_rows(st_["pool"], slots, add, total, st_["table"], st_["nblk"])
            step = e.build_step(cu, past, slots, st_["table"], enc, bs, L)
            st_["ws"].record(slots, step, bs)
            st_["seq"][slots] = past + np.diff(cu)
            outs.append((step.slot_mapping.tolist(), step.block_table.tolist(), sorted(st_["ws"].items())))
            if release:
                s = int(slots[0])
                e.release_blocks(st_["pool"], st_["table"][s, : int(st_["nblk"][s])][::-1])
                st_["table"][s] = 0
                st_["nblk"][s] = 0
                st_["seq"][s] = 0
                st_["ws"].pop(s)
        assert outs[0] == outs[1]
        assert state[0]["table"].tolist() == state[1]["table"].tolist()
        assert list(state[0]["pool"].free_order()) == list(state[1]["pool"].free_order())


@pytest.mark.parametrize("dtype", [np.float16, np.float32, "bfloat16"])
@settings(max_examples=40)
@given(data=st.data())
def test_scatter_and_gather_write_the_same_bytes(dtype, data):
    from kvspec._dtypes import KV_DTYPES, resolve_dtype

    dt = resolve_dtype("t", "dtype", dtype if isinstance(dtype, str) else np.dtype(dtype).name, KV_DTYPES)
    nb, bs, h, d = data.draw(st.integers(2, 5)), data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3)), 4
    rows = nb * bs
    T = data.draw(st.integers(0, rows))
    rng = np.random.default_rng(data.draw(st.integers(0, 99)))
    sm = rng.permutation(rows)[:T].astype(np.int64)
    sm[rng.random(T) < 0.2] = -1
    if T and data.draw(st.booleans()):
        sm[data.draw(st.integers(0, T - 1))] = rows + data.draw(st.integers(0, 3))  # past the storage
    k = rng.standard_normal((T, h, d)).astype(np.float32)
    v = rng.standard_normal((T, h, d)).astype(np.float32)
    row = rng.permutation(nb).astype(np.int32)
    n = data.draw(st.integers(0, rows))
    outs = []
    for e in _engines():
        K = e.zeros((nb, bs, h, d), dt)
        V = e.zeros((nb, bs, h, d), dt)
        bad = e.scatter_kv(K, V, e.kv_input("t", "k", k, K.dtype, "x"), e.kv_input("t", "v", v, V.dtype, "x"), sm)
        gk, gv = e.gather_kv(K, V, 0, n, row, bs)
        dk, dv = e.gather_kv(K, V, 1, bs, None, bs)
        outs.append((bad, K.tobytes(), V.tobytes(), gk.tobytes(), gv.tobytes(), gk.shape, dk.tobytes(), dv.tobytes()))
    assert outs[0] == outs[1]
    if outs[0][0] >= 0:
        assert not any(outs[0][1]) and not any(outs[0][2])  # a row past the storage: nothing written


def test_fast_step_indices_is_the_dataclass_built_by_its_slots():
    """kvfast builds ``StepIndices`` by its slots' descriptors (``_step_indices``): every field is
    the value given, in the dataclass's field order, the object stays frozen, and the dataclass has
    no ``__post_init__`` the shortcut would skip (a field added, reordered or validated fails here)."""
    import dataclasses

    from kvfast._slot_engine import _step_indices
    from kvspec import StepIndices

    assert not hasattr(StepIndices, "__post_init__")
    names = [f.name for f in dataclasses.fields(StepIndices)]
    values = [object() for _ in names]
    fast, slow = _step_indices(*values), StepIndices(*values)
    assert type(fast) is StepIndices
    assert [getattr(fast, n) for n in names] == [getattr(slow, n) for n in names] == values
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.past_len = None
    # the engine's step holds, field by field, what kvref's StepIndices(...) holds
    cfg = KVCacheConfig(num_layers=1, max_seqs=4, max_seq_len=64, mode=KVCacheMode.PAGED, block_size=4)
    steps = [mod.KVCache.make(cfg, [KVLayerSpec.attention(1, 2)]).prepare_step([0, 3, 4], [0, 0], [2, 0])
             for mod in (kvref, kvfast)]
    for n in names:
        want, got = (getattr(st_, n) for st_ in steps)
        assert type(got) is type(want) and np.array_equal(got, want), n
