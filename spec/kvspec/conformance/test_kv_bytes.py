"""Directed K/V byte tests of ``ops.append_kv`` and ``ops.gather_kv`` (DESIGN §4.4).

Every test writes K and V that are non-zero and differ in every element
(``kvspec.strategies.distinct_pair``), drives the backend and kvref in
lockstep (``CachePair``), and checks the stored bytes both against kvref and
against what was written: a V stored as K, a token written one row off, a
strided input read with the wrong stride or a dtype stored by bit pattern
cannot pass. Paths covered: gathers of every length from 1, inputs strided
or in another dtype, ``slot_mapping`` values at the storage's edges (token 0
at row 0, the last row, one past it), steps of 128 tokens and more.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec
from kvspec.conformance._compare import assert_same, to_numpy
from kvspec.conformance._harness import CachePair
from kvspec.conformance.machine import _layout, live_kv
from kvspec.conformance.plugin import require
from kvspec.strategies import distinct_pair

MODES = [pytest.param(KVCacheMode.CONTIGUOUS, id="contiguous"), pytest.param(KVCacheMode.PAGED, id="paged")]
_CAP = {KVCacheMode.CONTIGUOUS: "contiguous", KVCacheMode.PAGED: "paged"}


def _pair(backend, oracle, mode, *, dtype="float16", specs=None, **cfg) -> CachePair:
    require(backend, _CAP[mode])
    if backend.ops is None:
        pytest.skip(f"backend {backend.name} ships no ops")
    specs = specs or [KVLayerSpec.attention(2, 4), KVLayerSpec.attention(1, 2)]
    kw = dict(max_seqs=3, max_seq_len=7, mode=mode, block_size=3, dtype=dtype)
    kw.update(cfg)
    return CachePair(backend, oracle, KVCacheConfig(num_layers=len(specs), **kw), specs)


def _i32(x):
    return np.array(x, np.int32)


def _step(p: CachePair, rows: list[tuple[int, int]]):
    """``prepare_step`` for ``[(slot, q_len), ...]`` at the slots' current lengths."""
    seq = to_numpy(p.ref.seq_lens())
    cu = np.concatenate([[0], np.cumsum([q for _, q in rows])]).astype(np.int32)
    past = _i32([seq[s] for s, _ in rows])
    slots = _i32([s for s, _ in rows])
    return p.ok(f"step = cache.prepare_step({cu.tolist()}, {past.tolist()}, {slots.tolist()})",
                lambda c, o: c.prepare_step(cu, past, slots))


def _append(p: CachePair, steps, layer: int, k, v, label: str = "") -> None:
    p.ok(f"ops.append_kv(cache, {layer}, k, v, step)  {label}",
         lambda c, o: o.append_kv(c, layer, k, v, steps[0] if c is p.ref else steps[1]))


def _commit(p: CachePair, rows: list[tuple[int, int]]) -> None:
    seq = to_numpy(p.ref.seq_lens())
    for s, q in rows:
        n = int(seq[s]) + q
        p.ok(f"cache.update_position({s}, {n})", lambda c, o, s=s, n=n: c.update_position(s, n))


def _gather(p: CachePair, layer: int, slot: int):
    """``ops.gather_kv`` on both sides; equal outcomes; returns the backend's (K, V) on the host."""
    r, g = p.ok(f"ops.gather_kv(cache, {layer}, {slot})",
                lambda c, o: tuple(to_numpy(x).copy() for x in o.gather_kv(c, layer, slot)))
    return g


def _stored(p: CachePair, layer: int, slot: int, n: int):
    return live_kv(p.sut, layer, slot, n)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gather_every_length(kv_backend, kv_oracle, mode, dtype):
    """One token per step into slot 1 until it is full: after each, ``gather_kv``
    returns exactly the tokens written so far (length 1 included), K and V
    apart, in every layer; the other slots stay empty."""
    p = _pair(kv_backend, kv_oracle, mode, dtype=dtype)
    want = {l: ([], []) for l in range(2)}
    for n in range(1, 8):
        steps = _step(p, [(1, 1)])
        for l, sp in enumerate(p.specs):
            k, v = distinct_pair((1, sp.kv_heads, sp.head_dim), dtype, 100 * n + l)
            _append(p, steps, l, k, v)
            want[l][0].append(k[0])
            want[l][1].append(v[0])
        _commit(p, [(1, 1)])
        for l in range(2):
            gk, gv = _gather(p, l, 1)
            assert_same(np.stack(want[l][0]), gk, f"gather_kv K of layer {l} slot 1 at length {n}")
            assert_same(np.stack(want[l][1]), gv, f"gather_kv V of layer {l} slot 1 at length {n}")
        ek, _ = _gather(p, 0, 0)
        assert ek.shape[0] == 0, f"gather_kv of the empty slot 0 has {ek.shape[0]} rows"
    p.agree()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout, dtype", [
    ("strided_v", "float16"), ("strided_k", "bfloat16"), ("inner_strided", "float32"),
    ("float32", "float16"), ("float32", "bfloat16"), ("float64", "float16"), ("float16", "bfloat16"),
    ("float16", "float32"),
])
def test_append_input_layouts(kv_backend, kv_oracle, mode, layout, dtype):
    """K/V strided (V strided with K contiguous, K strided, a non-contiguous inner
    axis) or in a dtype other than storage's (cast on write; the values are
    exact in every dtype): the stored bytes are the values cast to storage."""
    p = _pair(kv_backend, kv_oracle, mode, dtype=dtype)
    rows = [(0, 4), (2, 3)]
    steps = _step(p, rows)
    written = {}
    for l, sp in enumerate(p.specs):
        k, v = distinct_pair((7, sp.kv_heads, sp.head_dim), dtype, 7 + l)
        k_in, v_in = _layout(layout, k, v)
        _append(p, steps, l, k_in, v_in, f"# layout {layout}")
        written[l] = (k, v)
    _commit(p, rows)
    for l in written:
        k, v = written[l]
        for s, lo, hi in ((0, 0, 4), (2, 4, 7)):
            sk, sv = _stored(p, l, s, hi - lo)
            assert_same(k[lo:hi], sk, f"K of layer {l} slot {s} after a {layout} append")
            assert_same(v[lo:hi], sv, f"V of layer {l} slot {s} after a {layout} append")
    p.agree()


@pytest.mark.parametrize("mode", MODES)
def test_slot_mapping_edges(kv_backend, kv_oracle, mode):
    """``slot_mapping`` at the storage's edges: row 0 and the last row are written;
    exactly the pool's end (one past the last row) at token 0 or at the last
    token raises ``IndexError`` and writes nothing; ``-1`` is padding, skipped."""
    p = _pair(kv_backend, kv_oracle, mode, specs=[KVLayerSpec.attention(1, 2)], max_seqs=2, max_seq_len=6,
              block_size=2)
    steps = _step(p, [(0, 3)])
    rows = int(np.prod(to_numpy(p.sut.keys(0)).shape[:2]))
    k, v = distinct_pair((3, 1, 2), "float16", 5)

    def bent(i, value):
        out = []
        for st in steps:
            sm = np.array(to_numpy(st.slot_mapping), copy=True)
            sm[i] = value
            out.append(dataclasses.replace(st, slot_mapping=sm))
        return out

    for i in (0, 2):
        msg = p.raises(f"ops.append_kv(cache, 0, k, v, step with slot_mapping[{i}]={rows})",
                       lambda c, o, i=i: o.append_kv(c, 0, k, v, bent(i, rows)[0 if c is p.ref else 1]), IndexError)
        assert f"slot_mapping[{i}]={rows}" in msg, f"IndexError message {msg!r} must name slot_mapping[{i}]={rows}"
    last = bent(0, rows - 1)
    _append(p, last, 0, k, v, f"# slot_mapping[0]={rows - 1}: the storage's last row")
    flat_k = to_numpy(p.sut.keys(0)).reshape(rows, 1, 2)
    flat_v = to_numpy(p.sut.values(0)).reshape(rows, 1, 2)
    assert_same(k[0], flat_k[rows - 1], "K of token 0 written at the storage's last row")
    assert_same(v[0], flat_v[rows - 1], "V of token 0 written at the storage's last row")
    k2, v2 = distinct_pair((3, 1, 2), "float16", 6)
    _append(p, bent(0, -1), 0, k2, v2, "# slot_mapping[0]=-1: padding")
    _commit(p, [(0, 3)])
    sk, sv = _stored(p, 0, 0, 3)
    assert_same(k2[1:], sk[1:], "K of tokens 1-2 (token 0 was padding)")
    assert_same(v2[1:], sv[1:], "V of tokens 1-2 (token 0 was padding)")
    if mode is KVCacheMode.CONTIGUOUS:  # token 0 of slot 0 is row 0: never written (last row, then padding)
        assert not to_numpy(p.sut.keys(0)).reshape(rows, 1, 2)[0].any(), "padding token 0 must leave row 0 as it was"
    p.agree()


@pytest.mark.parametrize("mode", MODES)
def test_pool_first_and_last_rows(kv_backend, kv_oracle, mode):
    """Every slot filled to ``max_seq_len`` in one step: token 0 of slot 0 and the
    last position of the last slot (in contiguous mode the storage's first and
    last rows) hold exactly what was written."""
    p = _pair(kv_backend, kv_oracle, mode, specs=[KVLayerSpec.attention(1, 4)], max_seqs=3, max_seq_len=5,
              block_size=5)
    rows = [(0, 5), (1, 5), (2, 5)]
    steps = _step(p, rows)
    k, v = distinct_pair((15, 1, 4), "float16", 9)
    _append(p, steps, 0, k, v)
    _commit(p, rows)
    for s in range(3):
        gk, gv = _gather(p, 0, s)
        assert_same(k[5 * s: 5 * s + 5], gk, f"K of slot {s}")
        assert_same(v[5 * s: 5 * s + 5], gv, f"V of slot {s}")
    if mode is KVCacheMode.CONTIGUOUS:
        flat = to_numpy(p.sut.keys(0)).reshape(-1, 1, 4)
        assert_same(k[0], flat[0], "the storage's first row")
        assert_same(k[-1], flat[-1], "the storage's last row")
    p.agree()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["contiguous", "strided_v", "strided_k", "inner_strided", "float32"])
def test_large_steps(kv_backend, kv_oracle, mode, layout):
    """Steps of 128 tokens and more (a kvfast option scatters those by runs, in
    parallel when there are many, ``KVFAST_PARALLEL_SCATTER=1``): a 140-token
    prefill of one slot, one of two slots (runs that start past the storage's
    first row), and a 130-row decode step; every token's K and V in its place."""
    paged = mode is KVCacheMode.PAGED
    p = _pair(kv_backend, kv_oracle, mode, specs=[KVLayerSpec.attention(1, 4)], max_seqs=130, max_seq_len=141,
              block_size=2 if paged else 16, num_blocks=300 if paged else 0)
    for seed, rows in ((11, [(0, 140)]), (13, [(1, 70), (2, 70)])):
        steps = _step(p, rows)
        k, v = distinct_pair((140, 1, 4), "float16", seed)
        _append(p, steps, 0, *_layout(layout, k, v))
        _commit(p, rows)
        t = 0
        for s, n in rows:
            gk, gv = _gather(p, 0, s)
            assert_same(k[t:t + n], gk, f"K of slot {s} after a 140-token prefill")
            assert_same(v[t:t + n], gv, f"V of slot {s} after a 140-token prefill")
            t += n
    rows = [(s, 1) for s in range(130)]
    steps = _step(p, rows)
    k2, v2 = distinct_pair((130, 1, 4), "float16", 12)
    storage = int(np.prod(to_numpy(p.sut.keys(0)).shape[:2]))
    for i in (0, 129):  # one token past the storage in a large step: refused, nothing written
        bad = []
        for st in steps:
            sm = np.array(to_numpy(st.slot_mapping), copy=True)
            sm[i] = storage
            bad.append(dataclasses.replace(st, slot_mapping=sm))
        msg = p.raises(f"ops.append_kv(cache, 0, k, v, step with slot_mapping[{i}]={storage})",
                       lambda c, o, bad=bad: o.append_kv(c, 0, *_layout(layout, k2, v2), bad[0 if c is p.ref else 1]),
                       IndexError)
        assert f"slot_mapping[{i}]={storage}" in msg, msg
    _append(p, steps, 0, *_layout(layout, k2, v2))
    _commit(p, rows)
    for s in (0, 1, 64, 129):
        n = {0: 141, 1: 71}.get(s, 1)
        sk, sv = _stored(p, 0, s, n)
        assert_same(k2[s], sk[n - 1], f"K of slot {s}'s decode token")
        assert_same(v2[s], sv[n - 1], f"V of slot {s}'s decode token")
    p.agree()
