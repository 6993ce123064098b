"""Logit soft-capping and attention sinks in ``ops.varlen_attention`` (spec/slot-cache.md §7.3).

Both packages, both storage modes, full, sliding and cross layers, GQA: the result equals the
float64 formula of ``tests/_dense_attention.py``; without the options it is bit for bit what it
was. Bad values raise the documented error, naming the argument, and change nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvfast
import kvref
from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec

from _dense_attention import dense_attention

HK, HQ, D = 2, 4, 8
SINKS = np.array([0.25, -2.0, 3.0, 1.0], np.float32)
PACKAGES = [kvref, kvfast]


def _cache(pkg, mode, specs):
    cfg = KVCacheConfig(len(specs), 3, 24, mode, block_size=4, dtype="float32")
    return pkg.KVCache.make(cfg, specs)


def _history(pkg, mode, specs, rows, rng):
    """Two steps over ``rows = [(slot, n1, n2)]``; returns the cache, the second step and each slot's K/V."""
    cache = _cache(pkg, mode, specs)
    kv = {s: ([], []) for s, *_ in rows}
    step = None
    for i in (1, 2):
        q_lens = [r[i] for r in rows]
        cu = np.concatenate([[0], np.cumsum(q_lens)])
        past = [int(cache.seq_lens()[s]) for s, *_ in rows]
        step = cache.prepare_step(cu, past, [s for s, *_ in rows])
        for layer in range(len(specs)):
            k = rng.standard_normal((int(cu[-1]), HK, D)).astype(np.float32)
            v = rng.standard_normal((int(cu[-1]), HK, D)).astype(np.float32)
            pkg.ops.append_kv(cache, layer, k, v, step)
            for b, (s, *_) in enumerate(rows):
                kv[s][0].append((layer, k[cu[b]:cu[b + 1]]))
                kv[s][1].append((layer, v[cu[b]:cu[b + 1]]))
        if i == 1:
            for (s, n1, _), p in zip(rows, past):
                cache.update_position(s, p + n1)
    return cache, step, kv


def _row_kv(kv, slot, layer):
    k = np.concatenate([x for l, x in kv[slot][0] if l == layer])
    v = np.concatenate([x for l, x in kv[slot][1] if l == layer])
    return k, v


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.__name__)
@pytest.mark.parametrize("mode", [KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS])
@pytest.mark.parametrize("softcap, sinks", [(0.8, None), (None, SINKS), (2.5, SINKS), (None, SINKS * 5)])
def test_softcap_and_sinks_equal_the_formula(pkg, mode, softcap, sinks):
    rng = np.random.default_rng(4)
    specs = [KVLayerSpec.attention(HK, D), KVLayerSpec.sliding_window(HK, D, 3)]
    rows = [(1, 5, 2), (0, 3, 1), (2, 6, 4)]
    cache, step, kv = _history(pkg, mode, specs, rows, rng)
    cu = np.asarray(step.cu_seqlens_q)
    for layer, window in ((0, None), (1, 3)):
        q = rng.standard_normal((step.num_tokens, HQ, D)).astype(np.float32)
        got = pkg.ops.varlen_attention(q, cache, layer, step, softcap=softcap, sinks=sinks)
        for b, (s, n1, n2) in enumerate(rows):
            k, v = _row_kv(kv, s, layer)
            want, _ = dense_attention(q[cu[b]:cu[b + 1]], k, v, n1, window, softcap=softcap, sinks=sinks)
            np.testing.assert_allclose(got[cu[b]:cu[b + 1]], want, rtol=1e-5, atol=2e-6,
                                       err_msg=f"{pkg.__name__} {mode} layer {layer} row {b}")
        if softcap is None and sinks is None:
            continue
        plain = pkg.ops.varlen_attention(q, cache, layer, step)
        assert not np.allclose(plain, got), "the option changed nothing"


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.__name__)
def test_cross_layer_and_torch_inputs(pkg):
    """A cross layer takes the options too; a torch query and a torch parameter of sinks (a module's
    ``sinks``, bfloat16 included) give the same numbers as NumPy."""
    rng = np.random.default_rng(5)
    specs = [KVLayerSpec.cross_attention(HK, D, 6)]
    cache = _cache(pkg, KVCacheMode.PAGED, specs)
    k = rng.standard_normal((5, HK, D)).astype(np.float32)
    v = rng.standard_normal((5, HK, D)).astype(np.float32)
    cache.fill(0, 0, k, v)
    step = cache.prepare_step([0, 2], [0], [0])
    q = rng.standard_normal((2, HQ, D)).astype(np.float32)
    got = pkg.ops.varlen_attention(q, cache, 0, step, softcap=1.0, sinks=SINKS)
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), np.repeat(k, 2, axis=1).astype(np.float64)) / np.sqrt(D)
    s = np.tanh(s)
    m = np.maximum(s.max(-1, keepdims=True), SINKS[:, None, None])
    w = np.exp(s - m)
    want = np.einsum("hqk,khd->qhd", w / (w.sum(-1, keepdims=True) + np.exp(SINKS[:, None, None] - m)),
                     np.repeat(v, 2, axis=1))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    tq = pkg.ops.varlen_attention(torch.from_numpy(q), cache, 0, step, softcap=1.0,
                                  sinks=torch.nn.Parameter(torch.from_numpy(SINKS)))
    assert isinstance(tq, torch.Tensor)
    np.testing.assert_array_equal(tq.numpy(), got)
    bf = torch.from_numpy(SINKS).to(torch.bfloat16)
    np.testing.assert_array_equal(pkg.ops.varlen_attention(q, cache, 0, step, sinks=bf),
                                  pkg.ops.varlen_attention(q, cache, 0, step, sinks=bf.float().numpy()))


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.__name__)
def test_bad_softcap_and_sinks_raise_and_change_nothing(pkg):
    rng = np.random.default_rng(6)
    cache, step, _ = _history(pkg, KVCacheMode.PAGED, [KVLayerSpec.attention(HK, D)], [(0, 3, 1)], rng)
    q = np.ones((1, HQ, D), np.float32)
    before = [np.asarray(cache.keys(0)).tobytes(), np.asarray(cache.values(0)).tobytes(), cache.seq_lens().tobytes()]
    cases = [
        (dict(softcap=0.0), ValueError, r"varlen_attention: softcap=0.0, must be a finite float > 0 or None"),
        (dict(softcap=-1), ValueError, r"softcap=-1, must be a finite float > 0"),
        (dict(softcap=float("inf")), ValueError, r"softcap=inf"),
        (dict(softcap=10**400), ValueError, r"softcap=1000"),
        (dict(softcap="2"), TypeError, r"softcap='2', must be a float > 0 or None"),
        (dict(sinks=np.zeros(3, np.float32)), ValueError, r"sinks.shape=\(3,\), must be \(q_heads,\)=\(4,\)"),
        (dict(sinks=np.zeros((1, 4), np.float32)), ValueError, r"sinks.shape=\(1, 4\)"),
        (dict(sinks=np.array([0, 0, np.inf, 0], np.float32)), ValueError, r"sinks\[2\]=inf, must be finite"),
        (dict(sinks=np.zeros(4, np.int32)), TypeError, r"sinks dtype=int32, must be a floating type"),
    ]
    for kwargs, err, text in cases:
        with pytest.raises(err, match=text):
            pkg.ops.varlen_attention(q, cache, 0, step, **kwargs)
    after = [np.asarray(cache.keys(0)).tobytes(), np.asarray(cache.values(0)).tobytes(), cache.seq_lens().tobytes()]
    assert after == before
    cache.check_invariants()


from hypothesis import given, strategies as st  # noqa: E402


@given(kv_heads=st.integers(1, 2), group=st.integers(1, 3), dim=st.sampled_from([1, 4, 8]),
       window=st.one_of(st.none(), st.integers(1, 6)), softcap=st.one_of(st.none(), st.floats(0.05, 20.0)),
       sink_scale=st.one_of(st.none(), st.floats(-30.0, 30.0)), lengths=st.lists(st.tuples(st.integers(1, 9),
                                                                                          st.integers(1, 4)),
                                                                                min_size=1, max_size=3),
       paged=st.booleans(), seed=st.integers(0, 2**16))
def test_options_equal_the_formula_on_random_steps(kv_heads, group, dim, window, softcap, sink_scale, lengths, paged,
                                                   seed):
    """Any heads, group, head size, window, cap and sink magnitude (sinks far above and below the
    scores included): both packages equal the float64 formula, row by row."""
    rng = np.random.default_rng(seed)
    hq = kv_heads * group
    spec = KVLayerSpec.attention(kv_heads, dim) if window is None else KVLayerSpec.sliding_window(kv_heads, dim,
                                                                                                   window)
    sinks = None if sink_scale is None else (rng.standard_normal(hq) * sink_scale).astype(np.float32)
    mode = KVCacheMode.PAGED if paged else KVCacheMode.CONTIGUOUS
    for pkg in PACKAGES:
        cache = pkg.KVCache.make(KVCacheConfig(1, 3, 16, mode, block_size=4, dtype="float32"), [spec])
        rows = [(s, n1, n2) for s, (n1, n2) in enumerate(lengths)]
        hist = {}
        for i in (1, 2):
            cu = np.concatenate([[0], np.cumsum([r[i] for r in rows])])
            step = cache.prepare_step(cu, [int(cache.seq_lens()[s]) for s, *_ in rows], [s for s, *_ in rows])
            k = np.random.default_rng(seed + i).standard_normal((int(cu[-1]), kv_heads, dim)).astype(np.float32)
            v = np.random.default_rng(seed + 10 + i).standard_normal((int(cu[-1]), kv_heads, dim)).astype(np.float32)
            pkg.ops.append_kv(cache, 0, k, v, step)
            for b, (s, *_) in enumerate(rows):
                hist.setdefault(s, []).append((k[cu[b]:cu[b + 1]], v[cu[b]:cu[b + 1]]))
            if i == 1:
                for s, n1, _ in rows:
                    cache.update_position(s, n1)
        q = (rng.standard_normal((step.num_tokens, hq, dim)) * 2).astype(np.float32)
        got = pkg.ops.varlen_attention(q, cache, 0, step, softcap=softcap, sinks=sinks)
        for b, (s, n1, _) in enumerate(rows):
            k = np.concatenate([x for x, _ in hist[s]])
            v = np.concatenate([y for _, y in hist[s]])
            want, _ = dense_attention(q[cu[b]:cu[b + 1]], k, v, n1, window, softcap=softcap, sinks=sinks)
            np.testing.assert_allclose(got[cu[b]:cu[b + 1]], want, rtol=2e-5, atol=5e-6,
                                       err_msg=f"{pkg.__name__} row {b}")
