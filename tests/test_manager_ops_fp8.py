"""The manager's ops on FP8 pages (spec/manager.md §18.5): ``append_kv_paged`` quantises into a
manager's ``kv_blocks`` and ``inputs.kv_scales`` by the slot cache's rule (spec/slot-cache.md
§10.2, one scale unit per page), ``paged_attention`` reads the pages dequantised.

Three engines run the same calls: kvref (NumPy, the definition: the slot engine's
``scatter_kv_fp8`` on the touched pages), kvfast on the CPU (``kvfast/_numba/fp8.py`` on the
layer's planes, ``kvfast/_numba/paged.py``) and kvfast on the emulated CUDA device
(``append_kv_fp8.cu`` and ``paged_attention.cu`` through the host harness). Pages and scales must
be bit-equal; attention equal to kvref's within rtol 1e-5 / atol 1e-6, kvref's equal to a dense
attention over the dequantised history, and within §10.2's error bound of a float32 oracle over
the inputs. A refused call changes neither the pages nor the scales.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvfast
import kvref
from kvspec import KVCacheParams, TextContext
from kvspec._dtypes import FP8_DTYPES, fp8_scale

from _dense_attention import dense_attention

H, HQ, D, P, LAYERS = 2, 4, 8, 4, 2
TOL = dict(rtol=1e-5, atol=1e-6)
FP8 = ["float8_e4m3fn", "float8_e5m2"]
#: (mantissa bits M, smallest normal exponent emin) of each format (spec/slot-cache.md §10.2's bound)
FORMAT = {"float8_e4m3fn": (3, -6), "float8_e5m2": (2, -14)}


class Engine:
    """One engine's copy of the pages and scales: NumPy (kvref, kvfast CPU) or device (CUDA, uint8 bits)."""

    def __init__(self, name, ops, cp=None):
        self.name, self.ops, self.cp = name, ops, cp

    def state(self, values, scales):
        if self.cp is None:
            return values.copy(), scales.copy()
        return self.cp.asarray(values.view(np.uint8)), self.cp.asarray(scales)

    def host(self, x):
        return x if isinstance(x, np.ndarray) else x.get()

    def bits(self, x):
        return self.host(x).view(np.uint8).tobytes()

    def inputs(self, inp, buf, scales):
        if self.cp is None:
            return dataclasses.replace(inp, kv_blocks=buf, kv_scales=scales, scales_lookup_table=inp.lookup_table)
        lut = self.cp.asarray(inp.lookup_table)
        return dataclasses.replace(inp, kv_blocks=buf, lookup_table=lut,
                                   cache_lengths=self.cp.asarray(inp.cache_lengths), kv_scales=scales,
                                   scales_lookup_table=lut)

    def kw(self, fp8):
        return {"kv_dtype": fp8} if self.cp is not None else {}


@pytest.fixture
def engines(emulated):
    return [Engine("kvref", kvref.ops), Engine("kvfast", kvfast.ops), Engine("kvfast-cuda", kvfast.ops, emulated)]


def _manager(pkg, fp8, num_blocks=24):
    params = KVCacheParams(page_size=P, num_layers=LAYERS, kv_heads=H, head_dim=D, dtype=fp8)
    return pkg.PagedKVCacheManager(params, num_blocks=num_blocks, max_batch_size=4, max_seq_len=48)


def _host_state(mgr):
    return np.asarray(mgr.get_device_buffer(0)).copy(), np.asarray(mgr.get_device_scales_buffer(0)).copy()


def _dequantised(values, scales, layer, row, n):
    """float32 K, V [n, H, D] of a row's positions ``[0, n)`` read through its lookup table row."""
    pos = np.arange(n)
    pages = np.asarray(row, np.int64)[pos // P]
    out = []
    for kv in (0, 1):
        x = values[pages, kv, layer, pos % P].astype(np.float32)
        out.append(x * scales[pages, kv, layer][:, :, None])
    return out


def _attention_bound(q, k, kh, v, vh, mask):
    """spec/slot-cache.md §10.2: ``|out - out_hat| <= max_j |v_j - v̂_j| + (exp(2 d) - 1) * max_j |v̂_j|``
    per query row and head, ``d = scale * max_j sum_i |q_i| |k_ji - k̂_ji|`` over the visible keys."""
    g = q.shape[1] // k.shape[1]
    dk = np.repeat(np.abs(k.astype(np.float64) - kh), g, axis=1)
    dv = np.repeat(np.abs(v.astype(np.float64) - vh).max(-1), g, axis=1)  # [keys, heads]
    av = np.repeat(np.abs(vh.astype(np.float64)).max(-1), g, axis=1)
    e = np.einsum("qhd,khd->hqk", np.abs(q.astype(np.float64)), dk) / np.sqrt(D)
    d = np.where(mask[None], e, 0).max(-1)  # [heads, q]
    vmax = np.where(mask[None], dv.T[:, None, :], 0).max(-1)
    amax = np.where(mask[None], av.T[:, None, :], 0).max(-1)
    return (vmax + np.expm1(2 * d) * amax).T  # [q, heads]


def _run(engines, fp8, pkg=kvref, window=None, steps=3, layer=1):
    """A prefill of two rows (7 and 3 tokens), then decode steps whose magnitudes grow (scales grow,
    pages are re-quantised); every step: engines bit-equal, attention within tolerance."""
    M, emin = FORMAT[fp8]
    mgr = _manager(pkg, fp8)
    rng = np.random.default_rng(11)
    ctxs = [TextContext("a", np.arange(7, dtype=np.int32)), TextContext("b", np.arange(3, dtype=np.int32) + 40)]
    for c in ctxs:
        mgr.claim(c)
    values, scales = _host_state(mgr)
    states = [e.state(values, scales) for e in engines]
    hist = {c.request_id: ([], []) for c in ctxs}
    for it in range(steps):
        for c in ctxs:
            mgr.alloc(c)
        inp = mgr.runtime_inputs([ctxs]).inputs[0]
        off = np.concatenate([[0], np.cumsum([c.active_length for c in ctxs])]).astype(np.int64)
        T = int(off[-1])
        mag = np.float32(4.0) ** it  # each step needs a larger scale than the last
        k = (rng.standard_normal((T, H, D)) * mag).astype(np.float32)
        v = (rng.standard_normal((T, H, D)) * mag).astype(np.float32)
        q = rng.standard_normal((T, HQ, D)).astype(np.float32)
        outs = []
        for e, (buf, sc) in zip(engines, states):
            ei = e.inputs(inp, buf, sc)
            e.ops.append_kv_paged(buf, layer, k, v, ei, off, **e.kw(fp8))
            out = e.ops.paged_attention(q, buf, layer, ei, off, window=window, **e.kw(fp8))
            assert e.host(out).dtype == np.float32
            outs.append(e.host(out))
        ref_v, ref_s = engines[0].host(states[0][0]), engines[0].host(states[0][1])
        for e, (buf, sc) in zip(engines[1:], states[1:]):
            assert e.bits(buf) == ref_v.view(np.uint8).tobytes(), f"{e.name}: pages differ from kvref's, step {it}"
            assert e.bits(sc) == ref_s.tobytes(), f"{e.name}: scales differ from kvref's, step {it}"
        for e, out in zip(engines[1:], outs[1:]):
            np.testing.assert_allclose(out, outs[0], **TOL, err_msg=f"{e.name} step {it}")
        s_nonzero = ref_s[ref_s != 0]
        assert np.all(np.frexp(s_nonzero)[0] == 0.5), "every scale is 0 or a power of two"
        for b, c in enumerate(ctxs):
            hk, hv = hist[c.request_id]
            hk.append(k[off[b]:off[b + 1]])
            hv.append(v[off[b]:off[b + 1]])
            K, V = np.concatenate(hk), np.concatenate(hv)
            n = K.shape[0]
            Kh, Vh = _dequantised(ref_v, ref_s, layer, inp.lookup_table[b], n)
            # every stored value within §10.2's bound of its input, with its page-head's final scale
            pages = np.asarray(inp.lookup_table[b], np.int64)[np.arange(n) // P]
            for X, Xh, kv in ((K, Kh, 0), (V, Vh, 1)):
                s = ref_s[pages, kv, layer][:, :, None].astype(np.float64)
                bound = 2.0 ** -(M + 1) * np.abs(X) + 2.0 ** (emin - M) * s
                assert np.all(np.abs(X - Xh) <= bound), f"row {b} step {it}: a value past the bound"
            qb = q[off[b]:off[b + 1]]
            # kvref reads exactly the dequantised history (float32 math vs float64 here)
            want, mask = dense_attention(qb, Kh, Vh, c.processed_length, window)
            np.testing.assert_allclose(outs[0][off[b]:off[b + 1]], want, rtol=1e-5, atol=2e-6 * mag,
                                       err_msg=f"kvref vs dense over the dequantised history, row {b} step {it}")
            # and the float32 inputs' attention within the bound
            exact, _ = dense_attention(qb, K, V, c.processed_length, window)
            err = np.abs(outs[0][off[b]:off[b + 1]] - exact).max(-1)
            assert np.all(err <= _attention_bound(qb, K, Kh, V, Vh, mask) * (1 + 1e-5) + 1e-5 * mag), \
                f"row {b} step {it}: attention past §10.2's bound"
        for c in ctxs:
            c.update(int(rng.integers(0, 100)))
            mgr.step(c)


@pytest.mark.parametrize("fp8", FP8)
def test_engines_agree_bit_for_bit_and_stay_within_the_bound(engines, fp8):
    _run(engines, fp8)


@pytest.mark.parametrize("fp8", FP8)
def test_sliding_window_and_a_kvfast_manager(engines, fp8):
    _run(engines, fp8, pkg=kvfast, window=3, steps=2, layer=0)


def _one_step(fp8="float8_e4m3fn"):
    mgr = _manager(kvref, fp8)
    ctxs = [TextContext("a", np.arange(6, dtype=np.int32)), TextContext("b", np.arange(2, dtype=np.int32) + 9)]
    for c in ctxs:
        mgr.claim(c)
        mgr.alloc(c)
    inp = mgr.runtime_inputs([ctxs]).inputs[0]
    return mgr, inp, np.array([0, 6, 8], np.int64)


def test_the_write_is_the_slot_caches_rule_on_each_page():
    """kvref's pages equal ``ReferenceSlotEngine.scatter_kv_fp8`` on dense copies of the layer's
    planes with one unit per page (spec/manager.md §18.5: reuse, not a second rule)."""
    mgr, inp, off = _one_step("float8_e5m2")
    values, scales = _host_state(mgr)
    rng = np.random.default_rng(2)
    k, v = ((rng.standard_normal((8, H, D)) * 300).astype(np.float32) for _ in range(2))
    got_v, got_s = values.copy(), scales.copy()
    kvref.ops.append_kv_paged(got_v, 1, k, v, dataclasses.replace(inp, kv_blocks=got_v, kv_scales=got_s), off)
    pos = np.concatenate([np.arange(6), np.arange(2)])
    rows = np.repeat([0, 1], [6, 2])
    sm = inp.lookup_table[rows, pos // P].astype(np.int64) * P + pos % P
    Kr, Vr = values[:, 0, 1].copy(), values[:, 1, 1].copy()
    Ksr, Vsr = scales[:, 0, 1].copy(), scales[:, 1, 1].copy()
    kvref.ReferenceSlotEngine().scatter_kv_fp8(Kr, Vr, Ksr, Vsr, k, v, sm, P)
    assert got_v[:, 0, 1].view(np.uint8).tobytes() == Kr.view(np.uint8).tobytes()
    assert got_v[:, 1, 1].view(np.uint8).tobytes() == Vr.view(np.uint8).tobytes()
    np.testing.assert_array_equal(got_s[:, 0, 1], Ksr)
    np.testing.assert_array_equal(got_s[:, 1, 1], Vsr)
    assert not got_v[:, :, 0].view(np.uint8).any() and not got_s[:, :, 0].any(), "layer 0 untouched"
    # the needed scale of a page-head is fp8_scale of its largest magnitude
    page = int(inp.lookup_table[0, 0])
    np.testing.assert_array_equal(got_s[page, 0, 1], fp8_scale(np.abs(k[:4]).max(axis=(0, 2)), "float8_e5m2"))


def test_a_page_written_from_its_first_position_restarts_its_scales(engines):
    """Stale scales on a page (a previous owner's) do not coarsen a write that starts the page: the
    layer's scales of every page written at offset 0 restart at 0, so the result equals a write
    into zeroed scales; other layers' scales, and pages continued past offset 0, keep theirs."""
    fp8 = "float8_e4m3fn"
    mgr, inp, off = _one_step(fp8)
    values, scales = _host_state(mgr)
    rng = np.random.default_rng(4)
    k, v = (rng.standard_normal((8, H, D)).astype(np.float32) for _ in range(2))
    stale = scales.copy()
    stale[...] = np.float32(2.0 ** 20)  # far larger than the step needs
    for e in engines:
        a, sa = e.state(values, scales)
        b, sb = e.state(values, stale)
        e.ops.append_kv_paged(a, 1, k, v, e.inputs(inp, a, sa), off, **e.kw(fp8))
        e.ops.append_kv_paged(b, 1, k, v, e.inputs(inp, b, sb), off, **e.kw(fp8))
        assert e.bits(a) == e.bits(b), f"{e.name}: stale scales changed the pages"
        hs, hb = e.host(sa), e.host(sb)
        written = np.unique(inp.lookup_table[inp.lookup_table > 0]).astype(np.int64)
        np.testing.assert_array_equal(hb[written, :, 1], hs[written, :, 1])
        assert np.all(hb[:, :, 0] == 2.0 ** 20), f"{e.name}: another layer's scales changed"
        # a decode write continuing a page (offset > 0) keeps the page's scale (max rule)
        ctx = dataclasses.replace(inp, cache_lengths=np.array([6, 2], np.uint32))
        big = (k * 64).astype(np.float32)
        e.ops.append_kv_paged(a, 1, big[:2], big[:2], e.inputs(ctx, a, sa), np.array([0, 1, 2]), **e.kw(fp8))
        page = int(inp.lookup_table[0, 1])
        assert np.all(e.host(sa)[page, :, 1] >= hs[page, :, 1]), f"{e.name}: a continued page's scale shrank"


def test_padding_tokens_are_not_read(engines):
    """A dummy row (all-0 lookup table) with NaN and inf in its k / v / q: the same bytes and
    scales as without it, no error, and its queries give zeros."""
    fp8 = "float8_e5m2"
    mgr, inp, off = _one_step(fp8)
    values, scales = _host_state(mgr)
    rng = np.random.default_rng(1)
    k, v = (rng.standard_normal((8, H, D)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((8, HQ, D)).astype(np.float32)
    lut = np.vstack([inp.lookup_table, np.zeros((1, inp.lookup_table.shape[1]), np.uint32)])
    padded = dataclasses.replace(inp, lookup_table=lut, cache_lengths=np.append(inp.cache_lengths, np.uint32(0)))
    junk = np.array([np.nan, np.inf, -np.inf], np.float32)[:, None, None] * np.ones((1, H, D), np.float32)
    kp, vp = np.concatenate([k, junk]), np.concatenate([v, junk * 1e30])
    qp = np.concatenate([q, np.full((3, HQ, D), np.nan, np.float32)])
    offp = np.append(off, 11)
    for e in engines:
        a, sa = e.state(values, scales)
        b, sb = e.state(values, scales)
        e.ops.append_kv_paged(a, 0, k, v, e.inputs(inp, a, sa), off, **e.kw(fp8))
        e.ops.append_kv_paged(b, 0, kp, vp, e.inputs(padded, b, sb), offp, **e.kw(fp8))
        assert e.bits(a) == e.bits(b) and e.bits(sa) == e.bits(sb), f"{e.name}: a padding token was read"
        out = e.host(e.ops.paged_attention(qp, b, 0, e.inputs(padded, b, sb), offp, **e.kw(fp8)))
        assert not np.isnan(out).any() and not out[8:].any(), f"{e.name}: padding queries give zeros"
        np.testing.assert_allclose(out[:8], e.host(e.ops.paged_attention(q, a, 0, e.inputs(inp, a, sa), off,
                                                                         **e.kw(fp8))), **TOL)


def test_torch_views_and_bhsd(engines):
    """CPU torch views of the FP8 pages and scales are written through; ``bhsd`` and a torch query
    give the layout's and the kind's result (spec/slot-cache.md §7.4)."""
    torch = pytest.importorskip("torch")
    fp8 = "float8_e4m3fn"
    mgr, inp, off = _one_step(fp8)
    values, scales = _host_state(mgr)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(8, H, D, generator=g) for _ in range(2))
    q = torch.randn(8, HQ, D, generator=g)
    ref_v, ref_s = values.copy(), scales.copy()
    kvref.ops.append_kv_paged(ref_v, 1, k.numpy(), v.numpy(), dataclasses.replace(inp, kv_scales=ref_s), off)
    want = kvref.ops.paged_attention(q.numpy(), ref_v, 1, dataclasses.replace(inp, kv_scales=ref_s), off)
    for ops in (kvref.ops, kvfast.ops):
        tv = torch.from_numpy(values.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        ts = torch.from_numpy(scales.copy())
        ti = dataclasses.replace(inp, kv_blocks=tv, kv_scales=ts)
        ops.append_kv_paged(tv, 1, k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float(), ti, off)
        b2, s2 = values.copy(), scales.copy()
        kvref.ops.append_kv_paged(b2, 1, k.to(torch.bfloat16).float().numpy(), v.to(torch.bfloat16).float().numpy(),
                                  dataclasses.replace(inp, kv_scales=s2), off)
        assert tv.view(torch.uint8).numpy().tobytes() == b2.view(np.uint8).tobytes()
        assert ts.numpy().tobytes() == s2.tobytes()
        tv2 = torch.from_numpy(ref_v.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        ti2 = dataclasses.replace(inp, kv_blocks=tv2, kv_scales=torch.from_numpy(ref_s.copy()))
        out = ops.paged_attention(q, tv2, 1, ti2, off)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
        np.testing.assert_allclose(out.numpy(), want, **TOL)
        qb = q.reshape(2, 4, HQ, D).transpose(1, 2)  # [B, H, S, D], B * S = 8
        ob = ops.paged_attention(qb, tv2, 1, ti2, off, layout="bhsd", out_dtype="float16")
        assert ob.shape == (2, HQ, 4, D) and ob.dtype == torch.float16
        np.testing.assert_array_equal(ob.transpose(1, 2).reshape(8, HQ, D).numpy(), want.astype(np.float16))


def test_strided_pages(engines):
    """Pages of a padded page stride (a slab leaf's view): the same bytes and scales as packed ones."""
    fp8 = "float8_e4m3fn"
    mgr, inp, off = _one_step(fp8)
    values, scales = _host_state(mgr)
    rng = np.random.default_rng(3)
    k, v = ((rng.standard_normal((8, H, D)) * 9).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((8, HQ, D)).astype(np.float32)
    wide_host = np.zeros((values.shape[0], 2, LAYERS, P + 2, H, D), values.dtype)
    for e in engines:
        packed, sp = e.state(values, scales)
        wide, sw = e.state(wide_host, scales)
        view = wide[:, :, :, 1:P + 1]
        e.ops.append_kv_paged(packed, 1, k, v, e.inputs(inp, packed, sp), off, **e.kw(fp8))
        e.ops.append_kv_paged(view, 1, k, v, e.inputs(inp, view, sw), off, **e.kw(fp8))
        assert e.bits(view) == e.bits(packed) and e.bits(sw) == e.bits(sp), f"{e.name}: strided write"
        w = e.host(wide).view(np.uint8)
        assert not w[:, :, :, 0].any() and not w[:, :, :, P + 1].any(), f"{e.name}: wrote outside the view"
        np.testing.assert_allclose(e.host(e.ops.paged_attention(q, view, 1, e.inputs(inp, view, sw), off,
                                                                **e.kw(fp8))),
                                   e.host(e.ops.paged_attention(q, packed, 1, e.inputs(inp, packed, sp), off,
                                                                **e.kw(fp8))), **TOL)


def test_errors_name_the_argument_and_change_nothing(engines):
    fp8 = "float8_e4m3fn"
    mgr, inp, off = _one_step(fp8)
    values, scales = _host_state(mgr)
    k = np.ones((8, H, D), np.float32)
    q = np.ones((8, HQ, D), np.float32)
    k_nan = k.copy()
    k_nan[3, 1, 2] = np.nan
    v_inf = k.copy()
    v_inf[7, 0, 0] = -np.inf
    other_lut = inp.lookup_table.copy()
    other_lut[0, 0] = 0
    for e in engines:
        buf, sc = e.state(values, scales)
        sc[...] = 1.0 / 64  # a written state: a change would show
        before = (e.bits(buf), e.bits(sc))
        ei = e.inputs(inp, buf, sc)
        kw = e.kw(fp8)
        slut = e.inputs(dataclasses.replace(inp, lookup_table=other_lut), buf, sc).lookup_table
        cases = [
            (ValueError, r"append_kv_paged: k\[3\] has a non-finite value, FP8 storage needs finite inputs",
             lambda: e.ops.append_kv_paged(buf, 0, k_nan, k_nan, ei, off, **kw)),
            (ValueError, r"append_kv_paged: v\[7\] has a non-finite value, FP8 storage needs finite inputs",
             lambda: e.ops.append_kv_paged(buf, 0, k, v_inf, ei, off, **kw)),
            (TypeError, r"append_kv_paged: inputs.kv_scales=None, FP8 kv_blocks need the leaf's scales",
             lambda: e.ops.append_kv_paged(buf, 0, k, k, dataclasses.replace(ei, kv_scales=None), off, **kw)),
            (ValueError, r"append_kv_paged: inputs.kv_scales.shape=\(24, 2, 2, 1\) != \(24, 2, 2, 2\)",
             lambda: e.ops.append_kv_paged(buf, 0, k, k, dataclasses.replace(ei, kv_scales=sc[..., :1]), off,
                                           **kw)),
            (ValueError, r"paged_attention: inputs.scales_lookup_table != inputs.lookup_table",
             lambda: e.ops.paged_attention(q, buf, 0, dataclasses.replace(ei, scales_lookup_table=slut), off,
                                           **kw)),
            (ValueError, r"append_kv_paged: k.shape\[1\]=4 != kv_heads=2",
             lambda: e.ops.append_kv_paged(buf, 0, q, q, ei, off, **kw)),
            (TypeError, r"append_kv_paged: v dtype=int32, must be a floating type",
             lambda: e.ops.append_kv_paged(buf, 0, k, k.astype(np.int32), ei, off, **kw)),
            (TypeError, r"paged_attention: kv_dtype=8, must be a dtype name",
             lambda: e.ops.paged_attention(q, buf, 0, ei, off, kv_dtype=8)),
        ]
        if e.cp is None:
            cases.append((ValueError, r"append_kv_paged: kv_dtype='float8_e5m2' != kv_blocks dtype=float8_e4m3fn",
                          lambda: e.ops.append_kv_paged(buf, 0, k, k, ei, off, kv_dtype="float8_e5m2")))
        else:
            cases.append((TypeError, r"append_kv_paged: kv_blocks dtype=uint8 holds FP8 bit patterns, pass "
                                     r"kv_dtype='float8_e4m3fn' or 'float8_e5m2' \(got kv_dtype=None\)",
                          lambda: e.ops.append_kv_paged(buf, 0, k, k, ei, off)))
        for exc, msg, call in cases:
            with pytest.raises(exc, match=msg):
                call()
            assert (e.bits(buf), e.bits(sc)) == before, f"{e.name}: a refused call ({msg}) changed the pages"


def test_float16_pages_still_refuse_fp8_only_names():
    """A non-FP8 buffer with another ``kv_dtype`` is refused; other dtypes name every supported one."""
    params = KVCacheParams(page_size=P, num_layers=1, kv_heads=H, head_dim=D, dtype="float16")
    mgr = kvref.PagedKVCacheManager(params, num_blocks=8, max_batch_size=2, max_seq_len=16)
    c = TextContext("a", np.arange(3, dtype=np.int32))
    mgr.claim(c)
    mgr.alloc(c)
    inp = mgr.runtime_inputs([[c]]).inputs[0]
    for ops in (kvref.ops, kvfast.ops):
        with pytest.raises(ValueError, match=r"append_kv_paged: kv_dtype='float8_e4m3fn' != kv_blocks dtype=float16"):
            ops.append_kv_paged(inp.kv_blocks, 0, np.ones((3, H, D)), np.ones((3, H, D)), inp, [0, 3],
                                kv_dtype="float8_e4m3fn")
        with pytest.raises(TypeError, match=r"kv_blocks dtype=int16, must be float16, bfloat16, float32, "
                                            r"float8_e4m3fn or float8_e5m2"):
            ops.paged_attention(np.ones((3, H, D)), inp.kv_blocks.view(np.int16), 0, inp, [0, 3])
    assert FP8_DTYPES  # the formats the ops accept are kvspec's
