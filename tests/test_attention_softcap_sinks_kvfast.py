"""Logit soft-capping and attention sinks in kvfast's attention engines.

Every score is ``s = scale * dot(q, k)`` (float32), soft-capped to ``softcap * tanh(s / softcap)``
when ``softcap`` is given; a head's sink logit ``sinks[h]`` joins the largest score ``m`` and the
softmax denominator with no value: ``out = sum_k exp(s_k - m) v_k / (sum_k exp(s_k - m) +
exp(sinks[h] - m))``. A query that sees no key gives zeros.

The engines under test, each against a float64 NumPy oracle of that formula (over what the cache
holds: the pages read back, dequantised for FP8; the slot cache's keys rounded to its dtype) and
against kvref on the same inputs (rtol 1e-5 / atol 1e-6: float32 sums in another order):

* the manager's ops (``paged_attention``): the Numba kernel ``attend_paged`` (NumPy pages) and
  ``paged_attention.cu`` on the emulated CUDA device (``KVFAST_CUDA_EMULATE=1``, CuPy pages);
* the slot cache's ``varlen_attention``: ``CudaSlotEngine.attend`` on a ``device="cuda"`` cache
  (emulated) and the CPU engine (kvref's algorithm, inherited).

Softcap only, sinks only, both; full and sliding-window attention; GQA (``q_heads = 2 *
kv_heads``) and plain multi-head; float32, float16, bfloat16 (and FP8) storage.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import kvfast
import kvref
from kvspec import KVCacheConfig, KVCacheMode, KVCacheParams, KVLayerSpec, TextContext

from _dense_attention import dense_attention

H, D, P, LAYERS = 2, 8, 4, 2
TOL = dict(rtol=1e-5, atol=1e-6)
ORACLE_TOL = dict(rtol=1e-5, atol=2e-6)
SOFTCAP = 1.5  # below the typical score (queries are scaled up): capping changes the result
Q_GAIN = 3.0

#: (softcap, with sinks) of every option case
CASES = [pytest.param(SOFTCAP, False, id="softcap"), pytest.param(None, True, id="sinks"),
         pytest.param(SOFTCAP, True, id="softcap+sinks")]


def _sinks(hq: int, seed: int = 5) -> np.ndarray:
    """float32 [hq] sink logits: moderate ones and one (head 0) above every score (it becomes ``m``)."""
    s = (np.random.default_rng(seed).standard_normal(hq) * 1.5).astype(np.float32)
    s[0] = 8.0
    if hq > 2:
        s[-1] = -6.0  # far below the scores: nearly no weight
    return s


def oracle(q, k, v, past: int, *, window=None, scale=None, softcap=None, sinks=None):
    """float64 causal GQA attention of ``q`` ``[t, q_heads, d]`` (positions ``past..``) over a row's
    ``k`` / ``v`` ``[n, kv_heads, d]`` with soft-capping and sink logits: the tests' one oracle
    (``tests/_dense_attention.py``), its output only."""
    return dense_attention(q, k, v, past, window, scale, softcap=softcap, sinks=sinks)[0]


def _opts(softcap, with_sinks, hq):
    return {"softcap": softcap, "sinks": _sinks(hq) if with_sinks else None}


# --------------------------------------------------------------------------- the manager's ops


class Engine:
    """One engine's copy of the pages (and FP8 scales): NumPy (kvref, kvfast's Numba kernel) or
    device arrays (kvfast's CUDA kernel; bfloat16 as ``uint16`` bits, FP8 as ``uint8`` bits)."""

    def __init__(self, name, ops, cp=None):
        self.name, self.ops, self.cp = name, ops, cp

    def state(self, values, scales):
        if self.cp is None:
            return values.copy(), None if scales is None else scales.copy()
        bits = values.view(np.uint16) if values.dtype.name == "bfloat16" else \
            values.view(np.uint8) if scales is not None else values
        return self.cp.asarray(bits), None if scales is None else self.cp.asarray(scales)

    def host(self, x):
        return x if isinstance(x, np.ndarray) else x.get()

    def inputs(self, inp, buf, scales):
        if self.cp is None:
            if scales is None:
                return inp
            return dataclasses.replace(inp, kv_blocks=buf, kv_scales=scales, scales_lookup_table=inp.lookup_table)
        lut = self.cp.asarray(inp.lookup_table)
        extra = {} if scales is None else dict(kv_scales=scales, scales_lookup_table=lut)
        return dataclasses.replace(inp, kv_blocks=buf if scales is not None else None, lookup_table=lut,
                                   cache_lengths=self.cp.asarray(inp.cache_lengths), **extra)

    def kw(self, dtype):
        return {"kv_dtype": dtype} if self.cp is not None and dtype.startswith("float8") else {}


@pytest.fixture
def engines(emulated):
    return [Engine("kvref", kvref.ops), Engine("kvfast", kvfast.ops), Engine("kvfast-cuda", kvfast.ops, emulated)]


def _manager(dtype="float32", num_blocks=24):
    params = KVCacheParams(page_size=P, num_layers=LAYERS, kv_heads=H, head_dim=D, dtype=dtype)
    return kvref.PagedKVCacheManager(params, num_blocks=num_blocks, max_batch_size=4, max_seq_len=48)


def _history(values, scales, layer: int, row, n: int):
    """float32 K, V ``[n, H, D]`` of a row's positions ``[0, n)`` as the pages hold them (FP8:
    dequantised with the page-heads' scales)."""
    pos = np.arange(n)
    pages = np.asarray(row, np.int64)[pos // P]
    got = []
    for kv in (0, 1):
        x = values[pages, kv, layer, pos % P].astype(np.float32)
        if scales is not None:
            x = x * scales[pages, kv, layer][:, :, None]
        got.append(x)
    return got


def _run_paged(engines, dtype="float32", *, hq=2 * H, window=None, softcap=None, with_sinks=False, steps=3):
    """A prefill of two rows (7 and 3 tokens), then decode steps: every engine's attention equal to
    kvref's and to the oracle; returns kvfast's (Numba) outputs of every step."""
    fp8 = dtype.startswith("float8")
    mgr = _manager(dtype)
    rng = np.random.default_rng(7)
    ctxs = [TextContext("a", np.arange(7, dtype=np.int32)), TextContext("b", np.arange(3, dtype=np.int32) + 40)]
    for c in ctxs:
        mgr.claim(c)
    host = np.asarray(mgr.get_device_buffer(0)).copy()
    host_scales = np.asarray(mgr.get_device_scales_buffer(0)).copy() if fp8 else None
    states = [e.state(host, host_scales) for e in engines]
    opts = _opts(softcap, with_sinks, hq)
    got = []
    for it in range(steps):
        for c in ctxs:
            mgr.alloc(c)
        inp = mgr.runtime_inputs([ctxs]).inputs[0]
        off = np.concatenate([[0], np.cumsum([c.active_length for c in ctxs])]).astype(np.int64)
        T = int(off[-1])
        k, v = (rng.standard_normal((T, H, D)).astype(np.float32) for _ in range(2))
        q = (rng.standard_normal((T, hq, D)) * Q_GAIN).astype(np.float32)
        outs = []
        for e, (buf, sc) in zip(engines, states):
            ein = e.inputs(inp, buf, sc)
            e.ops.append_kv_paged(buf, 1, k, v, ein, off, **e.kw(dtype))
            outs.append(e.host(e.ops.paged_attention(q, buf, 1, ein, off, window=window, **opts, **e.kw(dtype))))
        for e, out in zip(engines[1:], outs[1:]):
            np.testing.assert_allclose(out, outs[0], **TOL, err_msg=f"{e.name} vs kvref, step {it}")
        values, scales = states[0]
        for b, c in enumerate(ctxs):
            n = c.processed_length + c.active_length
            hk, hv = _history(values, scales, 1, inp.lookup_table[b], n)
            want = oracle(q[off[b]:off[b + 1]], hk, hv, c.processed_length, window=window, **opts)
            for e, out in zip(engines, outs):
                np.testing.assert_allclose(out[off[b]:off[b + 1]], want, **ORACLE_TOL,
                                           err_msg=f"{e.name} vs the oracle, row {b} step {it}")
        got.append(outs[1])
        for c in ctxs:
            c.update(int(rng.integers(0, 100)))
            mgr.step(c)
    return got


@pytest.mark.parametrize("softcap, with_sinks", CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_paged_engines_match_the_oracle(engines, dtype, softcap, with_sinks):
    _run_paged(engines, dtype, softcap=softcap, with_sinks=with_sinks)


@pytest.mark.parametrize("softcap, with_sinks", CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_sliding_window(engines, dtype, softcap, with_sinks):
    _run_paged(engines, dtype, window=3, softcap=softcap, with_sinks=with_sinks)


@pytest.mark.parametrize("hq", [H, 2 * H])
def test_paged_heads_per_group(engines, hq):
    """GQA (two query heads per K/V head) and plain multi-head (one): each head its own sink."""
    _run_paged(engines, "float32", hq=hq, softcap=SOFTCAP, with_sinks=True, steps=2)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_paged_fp8_pages(engines, dtype):
    """FP8 pages read dequantised through their scales, capped and with sinks."""
    _run_paged(engines, dtype, window=5, softcap=SOFTCAP, with_sinks=True, steps=2)


def test_options_change_the_result(engines):
    """The cases above have teeth: capping and sinks each move every engine's output."""
    plain = _run_paged(engines, "float32", steps=1)[0]
    capped = _run_paged(engines, "float32", softcap=SOFTCAP, steps=1)[0]
    sunk = _run_paged(engines, "float32", with_sinks=True, steps=1)[0]
    assert np.abs(capped - plain).max() > 1e-2
    assert np.abs(sunk - plain).max() > 1e-2
    # head 0's sink (8.0) is above every score: that head's outputs shrink
    assert np.abs(sunk[:, 0]).mean() < 0.5 * np.abs(plain[:, 0]).mean()


def test_padding_queries_still_give_zeros(engines):
    """A dummy row (lookup table all 0, NaN queries): zeros with a cap and sinks, and the real
    rows as without the dummy row."""
    mgr = _manager()
    ctxs = [TextContext("a", np.arange(6, dtype=np.int32)), TextContext("b", np.arange(2, dtype=np.int32) + 9)]
    for c in ctxs:
        mgr.claim(c)
        mgr.alloc(c)
    inp = mgr.runtime_inputs([ctxs]).inputs[0]
    off = np.array([0, 6, 8], np.int64)
    rng = np.random.default_rng(1)
    k, v = (rng.standard_normal((8, H, D)).astype(np.float32) for _ in range(2))
    q = (rng.standard_normal((8, 2 * H, D)) * Q_GAIN).astype(np.float32)
    lut = np.vstack([inp.lookup_table, np.zeros((1, inp.lookup_table.shape[1]), np.uint32)])
    padded = dataclasses.replace(inp, lookup_table=lut, cache_lengths=np.append(inp.cache_lengths, np.uint32(0)))
    qp = np.concatenate([q, np.full((3, 2 * H, D), np.nan, np.float32)])
    offp = np.append(off, 11)
    opts = _opts(SOFTCAP, True, 2 * H)
    host = np.asarray(mgr.get_device_buffer(0))
    for e in engines:
        buf, _ = e.state(host, None)
        e.ops.append_kv_paged(buf, 0, k, v, e.inputs(inp, buf, None), off)
        out = e.host(e.ops.paged_attention(qp, buf, 0, e.inputs(padded, buf, None), offp, **opts))
        assert not np.isnan(out).any() and not out[8:].any(), f"{e.name}: padding queries give zeros"
        real = e.host(e.ops.paged_attention(q, buf, 0, e.inputs(inp, buf, None), off, **opts))
        np.testing.assert_allclose(out[:8], real, **TOL, err_msg=e.name)


def test_engine_attend_takes_the_options_as_kvref_passes_them(emulated):
    """The engines' ``attend`` directly (host float32 sinks, a float softcap, 0.0 = off): Numba and
    CUDA equal to ``ReferencePagedOps.attend``; ``softcap=0.0, sinks=None`` is the plain attention."""
    from kvfast.ops import CudaPagedOps, FastPagedOps

    mgr = _manager()
    ctxs = [TextContext("a", np.arange(9, dtype=np.int32))]
    for c in ctxs:
        mgr.claim(c)
        mgr.alloc(c)
    inp = mgr.runtime_inputs([ctxs]).inputs[0]
    rng = np.random.default_rng(2)
    kv = np.asarray(mgr.get_device_buffer(0)).copy()
    kv[...] = rng.standard_normal(kv.shape).astype(np.float32)
    q = (rng.standard_normal((9, 2 * H, D)) * Q_GAIN).astype(np.float32)
    lut, lengths = inp.lookup_table.astype(np.int64), inp.cache_lengths.astype(np.int64)
    offs = np.array([0, 9], np.int64)
    sinks = _sinks(2 * H)
    ref, fast, cuda = kvref.ops.ReferencePagedOps(), FastPagedOps(), CudaPagedOps()
    dev = emulated.asarray(kv)
    for cap, sk in ((0.0, None), (SOFTCAP, None), (0.0, sinks), (SOFTCAP, sinks)):
        want = ref.attend(q, kv, 1, lut, lengths, offs, 4, 0.35, softcap=cap, sinks=sk)
        got = fast.attend(q, kv, 1, lut, lengths, offs, 4, 0.35, softcap=cap, sinks=sk)
        np.testing.assert_allclose(got, want, **TOL, err_msg=f"numba softcap={cap} sinks={sk is not None}")
        got = cuda.attend(q, dev, 1, lut, lengths, offs, 4, 0.35, softcap=cap, sinks=sk).get()
        np.testing.assert_allclose(got, want, **TOL, err_msg=f"cuda softcap={cap} sinks={sk is not None}")
    plain = fast.attend(q, kv, 1, lut, lengths, offs, 4, 0.35)
    assert fast.attend(q, kv, 1, lut, lengths, offs, 4, 0.35, softcap=0.0, sinks=None).tobytes() == plain.tobytes()


def test_cuda_launcher_sinks_and_softcap_arguments(emulated):
    """``paged_attention`` (the launcher): device sinks as host ones, ``-0.0`` as no cap, a sinks
    array of the wrong shape refused."""
    from kvfast._cuda.paged_attention import KV_FORMATS, paged_attention as launch

    cp = emulated
    mgr = _manager()
    ctxs = [TextContext("a", np.arange(5, dtype=np.int32))]
    for c in ctxs:
        mgr.claim(c)
        mgr.alloc(c)
    inp = mgr.runtime_inputs([ctxs]).inputs[0]
    rng = np.random.default_rng(4)
    host = np.asarray(mgr.get_device_buffer(0)).copy()
    host[...] = rng.standard_normal(host.shape).astype(np.float32)
    kv = cp.asarray(host)
    q = cp.asarray((rng.standard_normal((5, 2 * H, D)) * Q_GAIN).astype(np.float32))
    args = (q, kv, 0, inp.lookup_table, inp.cache_lengths, np.array([0, 5], np.int64))
    kw = dict(window=0, scale=0.35, kv_format=KV_FORMATS["float32"])
    sinks = _sinks(2 * H)
    on_host = launch(*args, **kw, softcap=SOFTCAP, sinks=sinks).get()
    on_device = launch(*args, **kw, softcap=SOFTCAP, sinks=cp.asarray(sinks)).get()
    assert on_host.tobytes() == on_device.tobytes()
    assert launch(*args, **kw, softcap=-0.0).get().tobytes() == launch(*args, **kw).get().tobytes()
    with pytest.raises(ValueError, match=r"sinks shape=\(3,\), must be \[q_heads\] = \(4,\)"):
        launch(*args, **kw, sinks=np.zeros(3, np.float32))


def test_kvfast_paged_attention_refuses_what_kvref_refuses(engines):
    """The options reach kvref's checks through ``kvfast.ops.paged_attention``, on either buffer."""
    mgr = _manager()
    ctxs = [TextContext("a", np.arange(4, dtype=np.int32))]
    for c in ctxs:
        mgr.claim(c)
        mgr.alloc(c)
    inp = mgr.runtime_inputs([ctxs]).inputs[0]
    q = np.ones((4, 2 * H, D), np.float32)
    off = np.array([0, 4], np.int64)
    host = np.asarray(mgr.get_device_buffer(0))
    for e in engines[1:]:
        buf, _ = e.state(host, None)
        with pytest.raises(ValueError, match="softcap"):
            e.ops.paged_attention(q, buf, 0, e.inputs(inp, buf, None), off, softcap=-1.0)
        with pytest.raises(ValueError, match="sinks"):
            e.ops.paged_attention(q, buf, 0, e.inputs(inp, buf, None), off, sinks=np.zeros(3, np.float32))


# --------------------------------------------------------------------------- the slot cache


def _to_np(x):
    from kvspec.conformance._compare import to_numpy

    return to_numpy(x)


_STORED = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _run_slots(emulated, dtype, mode, *, hq=2 * H, softcap=None, with_sinks=False, window=3):
    """Two rows (slots 2 and 0): a prefill then two decode steps through an attention and a
    sliding-window layer on kvref's cache, kvfast's CPU cache and kvfast's (emulated) CUDA cache;
    every attention equal to kvref's and to the oracle over the slot's keys as stored."""
    specs = [KVLayerSpec.attention(H, D), KVLayerSpec.sliding_window(H, D, window)]
    cfg = KVCacheConfig(num_layers=len(specs), max_seqs=3, max_seq_len=24, mode=mode, block_size=4, dtype=dtype)
    caches = [kvref.KVCache.make(cfg, specs), kvfast.KVCache.make(cfg, specs),
              kvfast.KVCache.make(dataclasses.replace(cfg, device="cuda"), specs)]
    names = ["kvref", "kvfast", "kvfast-cuda"]
    pkgs = [kvref.ops, kvfast.ops, kvfast.ops]
    opts = _opts(softcap, with_sinks, hq)
    rng = np.random.default_rng(3)
    slots = np.array([2, 0])
    hist = {(layer, int(s)): ([], []) for layer in range(2) for s in slots}  # keys, values as stored
    for step_no in range(3):
        cu = np.array([0, 5, 6]) if step_no == 0 else np.array([0, 1, 2])
        steps = [c.prepare_step(cu, _to_np(c.seq_lens())[slots], slots) for c in caches]
        past = _to_np(caches[0].seq_lens())[slots]
        q = (rng.standard_normal((int(cu[-1]), hq, D)) * Q_GAIN).astype(np.float32)
        for layer in range(2):
            k, v = (rng.standard_normal((int(cu[-1]), H, D)).astype(np.float32) for _ in range(2))
            outs = []
            for ops, c, st in zip(pkgs, caches, steps):
                ops.append_kv(c, layer, k, v, st)
                outs.append(_to_np(ops.varlen_attention(q, c, layer, st, **opts)))
            for name, out in zip(names[1:], outs[1:]):
                np.testing.assert_allclose(out, outs[0], **TOL, err_msg=f"{name} vs kvref, layer {layer}")
            for b, s in enumerate(slots):
                hk, hv = hist[layer, int(s)]
                hk.append(k[cu[b]:cu[b + 1]].astype(_STORED[dtype]).astype(np.float32))
                hv.append(v[cu[b]:cu[b + 1]].astype(_STORED[dtype]).astype(np.float32))
                want = oracle(q[cu[b]:cu[b + 1]], np.concatenate(hk), np.concatenate(hv), int(past[b]),
                              window=window if layer == 1 else None, **opts)
                for name, out in zip(names, outs):
                    np.testing.assert_allclose(out[cu[b]:cu[b + 1]], want, **ORACLE_TOL,
                                               err_msg=f"{name} vs the oracle, layer {layer} row {b} step {step_no}")
        for c in caches:
            for b, s in enumerate(slots):
                c.update_position(int(s), int(past[b] + cu[b + 1] - cu[b]))


@pytest.mark.parametrize("softcap, with_sinks", CASES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("mode", [KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS])
def test_slot_engines_match_the_oracle(emulated, dtype, mode, softcap, with_sinks):
    _run_slots(emulated, dtype, mode, softcap=softcap, with_sinks=with_sinks)


@pytest.mark.parametrize("hq", [H, 2 * H])
def test_slot_heads_per_group(emulated, hq):
    _run_slots(emulated, "float32", KVCacheMode.PAGED, hq=hq, softcap=SOFTCAP, with_sinks=True, window=2)


def test_cuda_slot_engine_attend_directly(emulated):
    """``CudaSlotEngine.attend`` with the options as kvref passes them (a float softcap, 0.0 = off;
    host float32 sinks): equal to ``ReferenceSlotEngine.attend`` on the same storage, and the
    plain attention for ``softcap=0.0, sinks=None``."""
    from kvspec import LayerKind

    specs = [KVLayerSpec.sliding_window(H, D, 4)]
    cfg = KVCacheConfig(num_layers=1, max_seqs=2, max_seq_len=16, mode=KVCacheMode.PAGED, block_size=4,
                        dtype="bfloat16")
    ref, dev = kvref.KVCache.make(cfg, specs), kvfast.KVCache.make(dataclasses.replace(cfg, device="cuda"), specs)
    rng = np.random.default_rng(9)
    cu, slots = np.array([0, 7, 10]), np.array([1, 0])
    k, v = (rng.standard_normal((10, H, D)).astype(np.float32) for _ in range(2))
    q = (rng.standard_normal((10, 2 * H, D)) * Q_GAIN).astype(np.float32)
    steps = []
    for ops, c in ((kvref.ops, ref), (kvfast.ops, dev)):
        steps.append(c.prepare_step(cu, np.zeros(2, np.int64), slots))
        ops.append_kv(c, 0, k, v, steps[-1])
    sinks = _sinks(2 * H)
    for cap, sk in ((0.0, None), (SOFTCAP, None), (0.0, sinks), (SOFTCAP, sinks)):
        want = ref.engine.attend(q, ref.keys(0), ref.values(0), LayerKind.SLIDING_WINDOW, 4, steps[0], 4, 0.3,
                                 softcap=cap, sinks=sk)
        got = dev.engine.attend(q, dev.keys(0), dev.values(0), LayerKind.SLIDING_WINDOW, 4, steps[1], 4, 0.3,
                                softcap=cap, sinks=sk)
        np.testing.assert_allclose(_to_np(got), want, **TOL, err_msg=f"softcap={cap} sinks={sk is not None}")
    plain = dev.engine.attend(q, dev.keys(0), dev.values(0), LayerKind.SLIDING_WINDOW, 4, steps[1], 4, 0.3)
    off = dev.engine.attend(q, dev.keys(0), dev.values(0), LayerKind.SLIDING_WINDOW, 4, steps[1], 4, 0.3,
                            softcap=0.0, sinks=None)
    assert _to_np(plain).tobytes() == _to_np(off).tobytes()
