"""Conformance of the manager's ops (spec/manager.md §18): ``ops.append_kv_paged`` and
``ops.paged_attention`` of the backend, on the backend's manager, against kvref's ops on kvref's.

The backend's ``ops`` must provide both functions (a backend without them skips, naming what is
missing). K/V and queries are host NumPy arrays on every device (spec/conformance.md); pages are
compared through each side's lookup table (block ids may differ without ``strict_block_ids``),
attention within spec/slot-cache.md §7.3's bound, rtol 1e-5 / atol ``1e-5 * max(1, |v|max)``
(float32 sums in another order: :func:`attention_atol`).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvspec import KVCacheParams
from kvspec.conformance._compare import attention_atol, to_numpy
from kvspec.conformance._harness import ManagerPair
from kvspec.conformance.plugin import require

H, HQ, D, PAGE = 2, 4, 8, 4


def _ops(backend):
    require(backend, "manager")
    ops = backend.ops
    missing = [f for f in ("append_kv_paged", "paged_attention") if not callable(getattr(ops, f, None))]
    if missing:
        pytest.skip(f"backend {backend.name} ops has no {', '.join(missing)} (spec/manager.md §18)")
    return ops


def _rows(buffer, inp, lengths, layer: int) -> list[np.ndarray]:
    """Each row's K/V bytes at positions [0, lengths[b]) read through its lookup table."""
    buf, lut = to_numpy(buffer), to_numpy(inp.lookup_table).astype(np.int64)
    out = []
    for b, n in enumerate(lengths):
        pos = np.arange(int(n))
        out.append(buf[lut[b, pos // PAGE], :, layer, pos % PAGE].tobytes())
    return out


def _two_rows(kv_backend, kv_oracle, dtype: str) -> ManagerPair:
    """A manager pair (backend and kvref) of two layers in ``dtype`` with two claimed requests,
    ``a`` (7 prompt tokens) and ``b`` (3)."""
    p = ManagerPair(kv_backend, kv_oracle, KVCacheParams(page_size=PAGE, num_layers=2, kv_heads=H, head_dim=D,
                                                         dtype=dtype),
                    num_blocks=16, max_batch_size=4, max_seq_len=32)
    p.new("a", list(range(7)))
    p.new("b", [40, 41, 42])
    for rid in "ab":
        p.ok(f"manager.claim(ctx_{rid})", lambda m, cs, rid=rid: m.claim(cs[rid]))
    return p


def _one_row(kv_backend, kv_oracle, dtype: str):
    """A one-layer manager pair in ``dtype`` with request ``a`` (5 prompt tokens) claimed and
    allocated: the pair, then kvref's and the backend's inputs of replica 0."""
    p = ManagerPair(kv_backend, kv_oracle, KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=H, head_dim=D,
                                                         dtype=dtype),
                    num_blocks=8, max_batch_size=2, max_seq_len=16)
    p.new("a", [1, 2, 3, 4, 5])
    p.ok("manager.claim(ctx_a)", lambda m, cs: m.claim(cs["a"]))
    p.ok("manager.alloc(ctx_a)", lambda m, cs: m.alloc(cs["a"]) and None)
    return p, p.ref.runtime_inputs([[p.ctx_ref["a"]]]).inputs[0], p.sut.runtime_inputs([[p.ctx_sut["a"]]]).inputs[0]


def _step_inputs(p: ManagerPair):
    """One forward of both rows: each ``alloc`` (checked equal on both sides), then kvref's and the
    backend's inputs of replica 0, the rows' query lengths and their ``input_row_offsets``."""
    for rid in "ab":
        p.ok(f"manager.alloc(ctx_{rid})", lambda m, cs, rid=rid: m.alloc(cs[rid]) and None)
    ref_in = p.ref.runtime_inputs([[p.ctx_ref[r] for r in "ab"]]).inputs[0]
    sut_in = p.sut.runtime_inputs([[p.ctx_sut[r] for r in "ab"]]).inputs[0]
    q_lens = [p.ctx_ref[r].active_length for r in "ab"]
    off = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    return ref_in, sut_in, q_lens, off


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_append_and_attention_equal_kvref(kv_backend, kv_oracle, dtype):
    """spec/manager.md §18.3, §18.4: a prefill of two rows, then two decode steps."""
    ops = _ops(kv_backend)
    import kvref

    p = _two_rows(kv_backend, kv_oracle, dtype)
    rng = np.random.default_rng(11)
    hist_v = []
    for it in range(3):
        ref_in, sut_in, q_lens, off = _step_inputs(p)
        T = int(off[-1])
        k, v = (rng.standard_normal((T, H, D)).astype(np.float32) for _ in range(2))
        hist_v.append(v)
        q = rng.standard_normal((T, HQ, D)).astype(np.float32)
        kvref.ops.append_kv_paged(ref_in.kv_blocks, 1, k, v, ref_in, off)
        ops.append_kv_paged(sut_in.kv_blocks, 1, k, v, sut_in, off)
        reach = [p.ctx_ref[r].processed_length + n for r, n in zip("ab", q_lens)]
        assert _rows(sut_in.kv_blocks, sut_in, reach, 1) == _rows(ref_in.kv_blocks, ref_in, reach, 1), \
            f"step {it}: append_kv_paged wrote other K/V than kvref (spec/manager.md §18.3)"
        for window in (None, 3):
            want = kvref.ops.paged_attention(q, ref_in.kv_blocks, 1, ref_in, off, window=window)
            got = to_numpy(ops.paged_attention(q, sut_in.kv_blocks, 1, sut_in, off, window=window))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=attention_atol(hist_v),
                                       err_msg=f"step {it} window={window}: paged_attention (spec/manager.md §18.4)")
        for rid in "ab":
            token = int(rng.integers(0, 50))
            for cs in (p.ctx_ref, p.ctx_sut):
                cs[rid].update(token)
            p.ok(f"manager.step(ctx_{rid})", lambda m, cs, rid=rid: m.step(cs[rid]))
    p.agree()


def test_softcap_and_sinks_equal_kvref(kv_backend, kv_oracle):
    """spec/manager.md §18.4 with spec/slot-cache.md §7.3's options: soft-capped scores and one
    sink logit per query head, with and without a window, equal kvref's; bad values raise kvref's
    error type and write nothing."""
    ops = _ops(kv_backend)
    require(kv_backend, "attention_options")
    import kvref

    p = _two_rows(kv_backend, kv_oracle, "float32")
    rng = np.random.default_rng(12)
    sinks = np.array([0.5, -1.5, 2.0, 0.0], np.float32)
    hist_v = []
    for it in range(2):
        ref_in, sut_in, q_lens, off = _step_inputs(p)
        T = int(off[-1])
        k, v = (rng.standard_normal((T, H, D)).astype(np.float32) for _ in range(2))
        hist_v.append(v)
        q = rng.standard_normal((T, HQ, D)).astype(np.float32) * 3
        kvref.ops.append_kv_paged(ref_in.kv_blocks, 1, k, v, ref_in, off)
        ops.append_kv_paged(sut_in.kv_blocks, 1, k, v, sut_in, off)
        for window, softcap, sink in ((None, 1.5, None), (None, None, sinks), (3, 0.75, sinks)):
            kw = dict(window=window, softcap=softcap, sinks=sink)
            want = kvref.ops.paged_attention(q, ref_in.kv_blocks, 1, ref_in, off, **kw)
            got = to_numpy(ops.paged_attention(q, sut_in.kv_blocks, 1, sut_in, off, **kw))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=attention_atol(hist_v),
                                       err_msg=f"step {it} {kw}: paged_attention (spec/slot-cache.md §7.3)")
        before = to_numpy(sut_in.kv_blocks).tobytes()
        for bad, exc in ((dict(softcap=0.0), ValueError), (dict(softcap="1"), TypeError),
                         (dict(sinks=sinks[:3]), ValueError), (dict(sinks=np.full(4, np.nan, np.float32)), ValueError)):
            with pytest.raises(exc):
                ops.paged_attention(q, sut_in.kv_blocks, 1, sut_in, off, **bad)
        assert to_numpy(sut_in.kv_blocks).tobytes() == before, "a refused paged_attention wrote"
        for rid in "ab":
            token = int(rng.integers(0, 50))
            for cs in (p.ctx_ref, p.ctx_sut):
                cs[rid].update(token)
            p.ok(f"manager.step(ctx_{rid})", lambda m, cs, rid=rid: m.step(cs[rid]))
    p.agree()


def test_refused_calls_write_nothing(kv_backend, kv_oracle):
    """spec/manager.md §18.2: the checks precede the write; the same error type as kvref's."""
    ops = _ops(kv_backend)
    import kvref

    p, ref_in, sut_in = _one_row(kv_backend, kv_oracle, "float32")
    k = np.ones((5, H, D), np.float32)
    before = to_numpy(sut_in.kv_blocks).tobytes()
    for label, args, exc in [("offsets end past the tokens", (k, k, [0, 6]), ValueError),
                             ("offsets of another batch", (k, k, [0, 2, 5]), ValueError),
                             ("heads of a query", (np.ones((5, HQ, D), np.float32),) * 2 + ([0, 5],), ValueError),
                             ("integer keys", (k.astype(np.int32), k, [0, 5]), TypeError)]:
        kk, vv, off = args
        for name, fn, inp in (("kvref", kvref.ops.append_kv_paged, ref_in),
                              (kv_backend.name, ops.append_kv_paged, sut_in)):
            with pytest.raises(exc):
                fn(inp.kv_blocks, 0, kk, vv, inp, np.asarray(off, np.int64))
        assert to_numpy(sut_in.kv_blocks).tobytes() == before, f"{label}: the refused append wrote"
    with pytest.raises(IndexError):
        ops.append_kv_paged(sut_in.kv_blocks, 1, k, k, sut_in, np.array([0, 5], np.int64))
    with pytest.raises(ValueError):
        ops.paged_attention(np.ones((5, HQ, D), np.float32), sut_in.kv_blocks, 0, sut_in, np.array([0, 5]), window=0)
    assert to_numpy(sut_in.kv_blocks).tobytes() == before


#: float32-oracle tolerance of attention through FP8 pages (unit-normal inputs;
#: spec/slot-cache.md §10.2 bounds each dequantised value by 2**-(M+1) relative plus half a subnormal step of its scale).
FP8_ATTENTION_ATOL = {"float8_e4m3fn": 0.15, "float8_e5m2": 0.3}


def _dense(q, k, v, past: int, window=None):
    """float64 causal GQA attention of a row's queries (positions past..) over its k / v."""
    g = q.shape[1] // k.shape[1]
    kf, vf = (np.repeat(x.astype(np.float64), g, axis=1) for x in (k, v))
    s = np.einsum("qhd,khd->hqk", q.astype(np.float64), kf) / np.sqrt(D)
    qp, kp = past + np.arange(q.shape[0])[:, None], np.arange(k.shape[0])[None, :]
    mask = (kp <= qp) & ((kp > qp - window) if window else True)
    s = np.where(mask[None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", w / w.sum(-1, keepdims=True), vf)


def _scale_rows(scales, inp, lengths, layer: int) -> list[bytes]:
    """Each row's K and V scales of the pages holding positions [0, lengths[b]), through its lookup table."""
    sc, lut = to_numpy(scales), to_numpy(inp.lookup_table).astype(np.int64)
    return [sc[lut[b, :-(-int(n) // PAGE)], :, layer].tobytes() for b, n in enumerate(lengths)]


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_append_and_attention_equal_kvref(kv_backend, kv_oracle, dtype):
    """spec/manager.md §18.5: FP8 pages quantised by the slot cache's rule with per-page scales in
    ``inputs.kv_scales``: the backend's pages and scales bit-identical to kvref's (through each
    side's lookup table), attention within spec/manager.md §18.4's tolerance of kvref's and within FP8's of a
    float32 oracle over the inputs. The magnitudes grow step by step, so scales grow and pages are
    re-quantised."""
    ops = _ops(kv_backend)
    import kvref

    p = _two_rows(kv_backend, kv_oracle, dtype)
    rng = np.random.default_rng(13)
    hist = {r: ([], []) for r in "ab"}
    for it in range(3):
        ref_in, sut_in, q_lens, off = _step_inputs(p)
        T = int(off[-1])
        mag = 2.0 ** (3 * it)
        k, v = ((rng.standard_normal((T, H, D)) * mag).astype(np.float32) for _ in range(2))
        q = (rng.standard_normal((T, HQ, D)) / mag).astype(np.float32)
        kvref.ops.append_kv_paged(ref_in.kv_blocks, 1, k, v, ref_in, off)
        ops.append_kv_paged(sut_in.kv_blocks, 1, k, v, sut_in, off, kv_dtype=dtype)
        reach = [p.ctx_ref[r].processed_length + n for r, n in zip("ab", q_lens)]
        assert _rows(sut_in.kv_blocks, sut_in, reach, 1) == _rows(ref_in.kv_blocks, ref_in, reach, 1), \
            f"step {it}: append_kv_paged wrote other FP8 bytes than kvref (spec/manager.md §18.5)"
        assert _scale_rows(sut_in.kv_scales, sut_in, reach, 1) == _scale_rows(ref_in.kv_scales, ref_in, reach, 1), \
            f"step {it}: append_kv_paged wrote other scales than kvref (spec/manager.md §18.5)"
        for window in (None, 3):
            want = kvref.ops.paged_attention(q, ref_in.kv_blocks, 1, ref_in, off, window=window)
            got = to_numpy(ops.paged_attention(q, sut_in.kv_blocks, 1, sut_in, off, window=window, kv_dtype=dtype))
            assert got.dtype == np.float32
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * mag,
                                       err_msg=f"step {it} window={window}: FP8 paged_attention (spec/manager.md §18.5)")
            for b, rid in enumerate("ab"):
                hk, hv = hist[rid]
                K = np.concatenate(hk + [k[off[b]:off[b + 1]]])
                V = np.concatenate(hv + [v[off[b]:off[b + 1]]])
                exact = _dense(q[off[b]:off[b + 1]], K, V, p.ctx_ref[rid].processed_length, window)
                np.testing.assert_allclose(want[off[b]:off[b + 1]], exact, rtol=0,
                                           atol=FP8_ATTENTION_ATOL[dtype] * float(np.abs(V).max()),
                                           err_msg=f"step {it} row {rid}: FP8 attention vs the float32 oracle")
        for b, rid in enumerate("ab"):
            hist[rid][0].append(k[off[b]:off[b + 1]])
            hist[rid][1].append(v[off[b]:off[b + 1]])
            token = int(rng.integers(0, 50))
            for cs in (p.ctx_ref, p.ctx_sut):
                cs[rid].update(token)
            p.ok(f"manager.step(ctx_{rid})", lambda m, cs, rid=rid: m.step(cs[rid]))
    p.agree()  # a CUDA buffer's FP8 uint8 bits compare with kvref's FP8 arrays bit for bit (_compare)


def test_fp8_refused_calls_change_nothing(kv_backend, kv_oracle):
    """spec/manager.md §18.5: a non-finite value in a non-padding token is a ``ValueError`` naming
    the first such token of ``k`` (then ``v``), as kvref's; neither the pages nor the scales change."""
    ops = _ops(kv_backend)
    import kvref

    dtype = "float8_e4m3fn"
    p, ref_in, sut_in = _one_row(kv_backend, kv_oracle, dtype)
    k = np.ones((5, H, D), np.float32)
    off = np.array([0, 5], np.int64)
    ops.append_kv_paged(sut_in.kv_blocks, 0, k, k, sut_in, off, kv_dtype=dtype)  # a written state
    before = (to_numpy(sut_in.kv_blocks).tobytes(), to_numpy(sut_in.kv_scales).tobytes())
    bad_k, bad_v = k.copy(), k.copy()
    bad_k[2, 1, 3] = np.nan
    bad_v[4, 0, 0] = np.inf
    for label, kk, vv, msg in [("NaN in k", bad_k, k, r"append_kv_paged: k\[2\] has a non-finite value"),
                               ("inf in v", k * 1e6, bad_v, r"append_kv_paged: v\[4\] has a non-finite value")]:
        for fn, inp, kw in ((kvref.ops.append_kv_paged, ref_in, {}),
                            (ops.append_kv_paged, sut_in, {"kv_dtype": dtype})):
            with pytest.raises(ValueError, match=msg):
                fn(inp.kv_blocks, 0, kk, vv, inp, off, **kw)
        assert (to_numpy(sut_in.kv_blocks).tobytes(), to_numpy(sut_in.kv_scales).tobytes()) == before, \
            f"{label}: the refused append changed the pages or the scales"
