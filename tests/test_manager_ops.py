"""The manager's ops (spec/manager.md §18): ``append_kv_paged`` and ``paged_attention`` over a
``PagedKVCacheManager``'s ``kv_blocks`` and ``runtime_inputs``.

Three engines run the same calls: kvref (NumPy, the definition), kvfast on the CPU (Numba) and
kvfast on the emulated CUDA device (``paged_attention.cu`` through the host harness). Writes
must be bit-equal; attention equal to kvref's within rtol 1e-5 / atol 1e-6 (float32 sums in
another order) and to a dense NumPy attention over each row's tokens. Every refused call leaves
the buffer's bytes as they were.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import kvfast
import kvref
from kvspec import KVCacheParams, TextContext

from _dense_attention import dense_attention

H, HQ, D, P, LAYERS = 2, 4, 8, 4, 2
TOL = dict(rtol=1e-5, atol=1e-6)


class Engine:
    """One engine's view of the buffer: a NumPy buffer (kvref, kvfast CPU) or a device copy (CUDA)."""

    def __init__(self, name, ops, cp=None):
        self.name, self.ops, self.cp = name, ops, cp

    def buffer(self, host):
        return host.copy() if self.cp is None else self.cp.asarray(host.view(np.uint16) if host.dtype.name ==
                                                                      "bfloat16" else host)

    def host(self, x):
        return x if isinstance(x, np.ndarray) else x.get()

    def inputs(self, inp):
        if self.cp is None:
            return inp
        return dataclasses.replace(inp, kv_blocks=None, lookup_table=self.cp.asarray(inp.lookup_table),
                                   cache_lengths=self.cp.asarray(inp.cache_lengths))


@pytest.fixture
def engines(emulated):
    return [Engine("kvref", kvref.ops), Engine("kvfast", kvfast.ops), Engine("kvfast-cuda", kvfast.ops, emulated)]


def _manager(pkg=kvref, dtype="float32", num_blocks=24):
    params = KVCacheParams(page_size=P, num_layers=LAYERS, kv_heads=H, head_dim=D, dtype=dtype)
    return pkg.PagedKVCacheManager(params, num_blocks=num_blocks, max_batch_size=4, max_seq_len=48)


def _run(engines, dtype="float32", window=None, pkg=kvref, steps=3, softcap=None, sinks=None):
    """A prefill of two rows (7 and 3 tokens), then decode steps; returns every engine's buffer bytes."""
    mgr = _manager(pkg, dtype)
    rng = np.random.default_rng(7)
    ctxs = [TextContext("a", np.arange(7, dtype=np.int32)), TextContext("b", np.arange(3, dtype=np.int32) + 40)]
    for c in ctxs:
        mgr.claim(c)
    host = np.asarray(mgr.get_device_buffer(0)).copy()
    bufs = [e.buffer(host) for e in engines]
    hist = {c.request_id: ([], [], []) for c in ctxs}  # k, v, q rows per request
    for it in range(steps):
        for c in ctxs:
            mgr.alloc(c)
        inp = mgr.runtime_inputs([ctxs]).inputs[0]
        q_lens = [c.active_length for c in ctxs]
        off = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
        T = int(off[-1])
        k, v = (rng.standard_normal((T, H, D)).astype(np.float32) for _ in range(2))
        q = rng.standard_normal((T, HQ, D)).astype(np.float32)
        outs = []
        for e, buf in zip(engines, bufs):
            e.ops.append_kv_paged(buf, 1, k, v, e.inputs(inp), off)
            outs.append(e.host(e.ops.paged_attention(q, buf, 1, e.inputs(inp), off, window=window, softcap=softcap,
                                                     sinks=sinks)))
        first = engines[0].host(bufs[0])
        for e, buf in zip(engines[1:], bufs[1:]):
            assert e.host(buf).tobytes() == first.view(e.host(buf).dtype).tobytes(), \
                f"{e.name}: pages differ from kvref's after step {it}"
        for e, out in zip(engines[1:], outs[1:]):
            np.testing.assert_allclose(out, outs[0], **TOL, err_msg=f"{e.name} step {it}")
        # against a dense attention over each row's tokens (stored dtype: what the cache holds)
        stored = np.float32 if dtype == "float32" else ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
        for b, c in enumerate(ctxs):
            hk, hv, _ = hist[c.request_id]
            hk.append(k[off[b]:off[b + 1]].astype(stored).astype(np.float32))
            hv.append(v[off[b]:off[b + 1]].astype(stored).astype(np.float32))
            want, _ = dense_attention(q[off[b]:off[b + 1]], np.concatenate(hk), np.concatenate(hv), c.processed_length,
                                      window, softcap=softcap, sinks=sinks)
            np.testing.assert_allclose(outs[0][off[b]:off[b + 1]], want, rtol=1e-5, atol=2e-6,
                                       err_msg=f"kvref vs dense, row {b} step {it}")
        for c in ctxs:
            c.update(int(rng.integers(0, 100)))
            mgr.step(c)
    return [e.host(b) for b in bufs]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_engines_agree_with_kvref_and_dense_attention(engines, dtype):
    _run(engines, dtype)


def test_sliding_window_and_a_kvfast_manager(engines):
    _run(engines, "float32", window=3, pkg=kvfast, steps=2)


SINKS = np.array([0.5, -1.0, 2.0, 0.0], np.float32)   # one per query head (HQ = 4)


@pytest.mark.parametrize("softcap, sinks, window", [(0.7, None, None), (None, SINKS, None), (1.5, SINKS, 3),
                                                    (None, SINKS * 4, 2)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_softcap_and_sinks_on_every_engine(engines, dtype, softcap, sinks, window):
    """Soft-capped scores and sink logits (spec/slot-cache.md §7.3): every engine equals kvref, and
    kvref the float64 formula; a torch ``sinks`` (a module's parameter) reads the same."""
    _run(engines, dtype, window=window, softcap=softcap, sinks=sinks, steps=2)


def test_softcap_and_sinks_are_checked():
    import torch

    mgr = _manager()
    c = TextContext("a", np.arange(5, dtype=np.int32))
    mgr.claim(c)
    mgr.alloc(c)
    inp = mgr.runtime_inputs([[c]]).inputs[0]
    buf, off, q = inp.kv_blocks, np.array([0, 5]), np.ones((5, HQ, D), np.float32)
    before = np.asarray(buf).tobytes()
    for ops in (kvref.ops, kvfast.ops):
        for bad, err, text in ((0.0, ValueError, "softcap=0.0, must be a finite float > 0 or None"),
                               (float("nan"), ValueError, "softcap=nan"), ("1", TypeError, "softcap='1'"),
                               (True, TypeError, "softcap=True")):
            with pytest.raises(err, match=text.replace("(", r"\(").replace(")", r"\)")):
                ops.paged_attention(q, buf, 0, inp, off, softcap=bad)
        with pytest.raises(ValueError, match=r"sinks.shape=\(3,\), must be \(q_heads,\)=\(4,\)"):
            ops.paged_attention(q, buf, 0, inp, off, sinks=np.zeros(3, np.float32))
        with pytest.raises(ValueError, match=r"sinks\[1\]=nan, must be finite"):
            ops.paged_attention(q, buf, 0, inp, off, sinks=np.array([0, np.nan, 0, 0], np.float32))
        with pytest.raises(TypeError, match="sinks dtype=int64, must be a floating type"):
            ops.paged_attention(q, buf, 0, inp, off, sinks=np.zeros(4, np.int64))
        got = ops.paged_attention(q, buf, 0, inp, off, sinks=torch.nn.Parameter(torch.from_numpy(SINKS)))
        want = ops.paged_attention(q, buf, 0, inp, off, sinks=SINKS)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.asarray(buf).tobytes() == before


def _one_step(dtype="float32"):
    mgr = _manager(kvref, dtype)
    ctxs = [TextContext("a", np.arange(6, dtype=np.int32)), TextContext("b", np.arange(2, dtype=np.int32) + 9)]
    for c in ctxs:
        mgr.claim(c)
        mgr.alloc(c)
    inp = mgr.runtime_inputs([ctxs]).inputs[0]
    return mgr, inp, np.array([0, 6, 8], np.int64)


def test_padding_rows_are_skipped(engines):
    """A row whose lookup table is all 0 (a dummy row, padding) is neither read nor written:
    NaN there changes nothing, and its queries attend nothing (zeros)."""
    mgr, inp, off = _one_step()
    rng = np.random.default_rng(1)
    k, v = (rng.standard_normal((8, H, D)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((8, HQ, D)).astype(np.float32)
    lut = np.vstack([inp.lookup_table, np.zeros((1, inp.lookup_table.shape[1]), np.uint32)])
    padded = dataclasses.replace(inp, lookup_table=lut, cache_lengths=np.append(inp.cache_lengths, np.uint32(0)))
    kp = np.concatenate([k, np.full((3, H, D), np.nan, np.float32)])
    qp = np.concatenate([q, np.full((3, HQ, D), np.nan, np.float32)])
    offp = np.append(off, 11)
    host = np.asarray(mgr.get_device_buffer(0))
    for e in engines:
        a, b = e.buffer(host), e.buffer(host)
        e.ops.append_kv_paged(a, 0, k, v, e.inputs(inp), off)
        e.ops.append_kv_paged(b, 0, kp, kp, e.inputs(padded), offp)
        e.ops.append_kv_paged(b, 0, k, v, e.inputs(inp), off)  # the real rows' values
        assert e.host(a).tobytes() == e.host(b).tobytes(), f"{e.name}: a padding row was written"
        out = e.host(e.ops.paged_attention(qp, b, 0, e.inputs(padded), offp))
        assert not np.isnan(out).any() and not out[8:].any(), f"{e.name}: padding queries give zeros"
        np.testing.assert_allclose(out[:8], e.host(e.ops.paged_attention(q, a, 0, e.inputs(inp), off)), **TOL)


def test_torch_in_torch_out_and_bhsd(engines):
    torch = pytest.importorskip("torch")
    mgr = _manager(kvref, "bfloat16")
    ctxs = [TextContext(r, np.arange(3, dtype=np.int32) + i) for i, r in enumerate("ab")]
    for c in ctxs:
        mgr.claim(c)
        mgr.alloc(c)
    inp = mgr.runtime_inputs([ctxs]).inputs[0]
    off = np.array([0, 3, 6], np.int64)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 3, H, D, generator=g).to(torch.bfloat16) for _ in range(2))   # [B, S, H, D] memory
    q = torch.randn(2, 3, HQ, D, generator=g).to(torch.bfloat16)
    host = np.asarray(mgr.get_device_buffer(0))
    results = []
    for e in engines:
        a, b = e.buffer(host), e.buffer(host)
        e.ops.append_kv_paged(a, 1, k.reshape(6, H, D), v.reshape(6, H, D), e.inputs(inp), off)
        e.ops.append_kv_paged(b, 1, k.transpose(1, 2), v.transpose(1, 2), e.inputs(inp), off, layout="bhsd")
        assert e.host(a).tobytes() == e.host(b).tobytes(), f"{e.name}: bhsd write differs"
        out = e.ops.paged_attention(q.transpose(1, 2), b, 1, e.inputs(inp), off, layout="bhsd",
                                    out_dtype=torch.bfloat16)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.shape == (2, HQ, 3, D)
        flat = e.ops.paged_attention(q.reshape(6, HQ, D), b, 1, e.inputs(inp), off)
        assert flat.dtype == torch.float32
        assert torch.equal(out.transpose(1, 2).reshape(6, HQ, D), flat.to(torch.bfloat16)), e.name
        results.append(flat)
    for e, r in zip(engines[1:], results[1:]):
        torch.testing.assert_close(r, results[0], **TOL, msg=e.name)
    # a torch view of the manager's buffer is written through (kvfast.interop.to_torch)
    view = kvfast.interop.to_torch(np.asarray(mgr.get_device_buffer(0)))
    kvfast.ops.append_kv_paged(view, 0, k.reshape(6, H, D), v.reshape(6, H, D), inp, off)
    assert torch.equal(view[inp.lookup_table[0, 0].item(), 0, 0, 0], k[0, 0])


def test_strided_buffer(engines):
    """A buffer with padded heads (a slab view's strides): the same values as a packed one."""
    mgr, inp, off = _one_step()
    host = np.asarray(mgr.get_device_buffer(0))
    rng = np.random.default_rng(3)
    k, v = (rng.standard_normal((8, H, D)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((8, HQ, D)).astype(np.float32)
    for e in engines:
        packed = e.buffer(host)
        wide = e.buffer(np.zeros(host.shape[:-1] + (D + 3,), np.float32))
        view = wide[..., 1:D + 1]
        e.ops.append_kv_paged(packed, 1, k, v, e.inputs(inp), off)
        e.ops.append_kv_paged(view, 1, k, v, e.inputs(inp), off)
        assert np.array_equal(e.host(view), e.host(packed)), f"{e.name}: strided write"
        assert not e.host(wide)[..., 0].any() and not e.host(wide)[..., D + 1:].any(), f"{e.name}: wrote outside"
        np.testing.assert_allclose(e.host(e.ops.paged_attention(q, view, 1, e.inputs(inp), off)),
                                   e.host(e.ops.paged_attention(q, packed, 1, e.inputs(inp), off)), **TOL)


def test_errors_name_argument_and_value_and_change_nothing(engines):
    mgr, inp, off = _one_step()
    host = np.asarray(mgr.get_device_buffer(0))
    k = np.ones((8, H, D), np.float32)
    q = np.ones((8, HQ, D), np.float32)
    cols = inp.lookup_table.shape[1]
    bad_page = inp.lookup_table.copy()
    bad_page[1, 0] = 24
    far = dataclasses.replace(inp, cache_lengths=np.array([0, cols * P - 1], np.uint32))
    for e in engines:
        buf = e.buffer(host)
        before = e.host(buf).tobytes()
        ei = e.inputs(inp)
        cases = [
            (TypeError, r"append_kv_paged: kv_blocks=None \(a bookkeeping-only manager",
             lambda: e.ops.append_kv_paged(None, 0, k, k, ei, off)),
            (ValueError, r"append_kv_paged: kv_blocks.shape=\(24, 2, 2, 4, 2\), must be \[num_blocks, 2",
             lambda: e.ops.append_kv_paged(buf[..., 0], 0, k, k, ei, off)),
            (IndexError, r"append_kv_paged: layer=2 out of range \[0, 2\)",
             lambda: e.ops.append_kv_paged(buf, 2, k, k, ei, off)),
            (TypeError, r"append_kv_paged: layer=True, must be an int",
             lambda: e.ops.append_kv_paged(buf, True, k, k, ei, off)),
            (TypeError, r"append_kv_paged: inputs=dict, must be a KVCacheInputsPerDevice",
             lambda: e.ops.append_kv_paged(buf, 0, k, k, {}, off)),
            (ValueError, r"append_kv_paged: len\(input_row_offsets\)=2 != rows \+ 1 = 3",
             lambda: e.ops.append_kv_paged(buf, 0, k, k, ei, np.array([0, 8]))),
            (ValueError, r"append_kv_paged: input_row_offsets\[0\]=1, must be 0",
             lambda: e.ops.append_kv_paged(buf, 0, k, k, ei, np.array([1, 6, 8]))),
            (ValueError, r"append_kv_paged: input_row_offsets\[2\]=5 < input_row_offsets\[1\]=6",
             lambda: e.ops.append_kv_paged(buf, 0, k, k, ei, np.array([0, 6, 5]))),
            (ValueError, r"append_kv_paged: input_row_offsets\[-1\]=7 != num_tokens=8",
             lambda: e.ops.append_kv_paged(buf, 0, k, k, ei, np.array([0, 6, 7]))),
            (TypeError, r"append_kv_paged: input_row_offsets dtype=float64, must be an integer type",
             lambda: e.ops.append_kv_paged(buf, 0, k, k, ei, np.array([0.0, 6, 8]))),
            (IndexError, rf"append_kv_paged: token 7 \(row 1\) at position {cols * P} needs "
                         rf"inputs.lookup_table\[1, {cols}\], the table has {cols} columns",
             lambda: e.ops.append_kv_paged(buf, 0, k, k, e.inputs(far), off)),
            (IndexError, r"append_kv_paged: inputs.lookup_table\[1, 0\]=24 out of range \[0, 24\)",
             lambda: e.ops.append_kv_paged(buf, 0, k, k, e.inputs(dataclasses.replace(inp, lookup_table=bad_page)),
                                           off)),
            (ValueError, r"append_kv_paged: k.shape\[1\]=4 != kv_heads=2",
             lambda: e.ops.append_kv_paged(buf, 0, q, q, ei, off)),
            (ValueError, r"append_kv_paged: k.ndim=2, must be 3",
             lambda: e.ops.append_kv_paged(buf, 0, k[0], k[0], ei, off)),
            (TypeError, r"append_kv_paged: v dtype=int32, must be a floating type",
             lambda: e.ops.append_kv_paged(buf, 0, k, k.astype(np.int32), ei, off)),
            (ValueError, r"append_kv_paged: layout='hsd', must be 'thd' or 'bhsd'",
             lambda: e.ops.append_kv_paged(buf, 0, k, k, ei, off, layout="hsd")),
            (ValueError, r"paged_attention: window=0, must be >= 1 or None",
             lambda: e.ops.paged_attention(q, buf, 0, ei, off, window=0)),
            (ValueError, r"paged_attention: scale=nan, must be a finite float or None",
             lambda: e.ops.paged_attention(q, buf, 0, ei, off, scale=float("nan"))),
            (ValueError, r"paged_attention: q.shape\[1\]=3 is not a multiple of kv_heads=2",
             lambda: e.ops.paged_attention(np.ones((8, 3, D)), buf, 0, ei, off)),
            (ValueError, r"paged_attention: out_dtype='int8', must be None",
             lambda: e.ops.paged_attention(q, buf, 0, ei, off, out_dtype="int8")),
        ]
        for exc, msg, call in cases:
            with pytest.raises(exc, match=msg):
                call()
            assert e.host(buf).tobytes() == before, f"{e.name}: a refused call ({msg}) changed the buffer"


def test_fp8_pages_are_written_with_their_scales():
    """FP8 pages are no longer refused (spec/manager.md §18.5; tests/test_manager_ops_fp8.py has the
    differential tests): the write fills the pages and their scales, a non-FP8 dtype is still refused."""
    params = KVCacheParams(page_size=P, num_layers=1, kv_heads=H, head_dim=D, dtype="float8_e4m3fn")
    mgr = kvref.PagedKVCacheManager(params, num_blocks=8, max_batch_size=2, max_seq_len=16)
    c = TextContext("a", np.arange(3, dtype=np.int32))
    mgr.claim(c)
    mgr.alloc(c)
    inp = mgr.runtime_inputs([[c]]).inputs[0]
    page = int(inp.lookup_table[0, 0])
    for ops in (kvref.ops, kvfast.ops):
        buf, sc = np.asarray(inp.kv_blocks).copy(), np.asarray(inp.kv_scales).copy()
        ei = dataclasses.replace(inp, kv_blocks=buf, kv_scales=sc, scales_lookup_table=inp.lookup_table)
        ops.append_kv_paged(buf, 0, np.ones((3, H, D)), np.ones((3, H, D)), ei, [0, 3])
        assert np.all(sc[page, :, 0] == 2.0 ** -8)  # 1 needs 2**-8 on e4m3fn (1 <= 448 * 2**-8)
        np.testing.assert_array_equal(buf[page, :, 0, :3].astype(np.float32) * 2.0 ** -8, 1.0)
        out = ops.paged_attention(np.ones((3, HQ, D)), buf, 0, ei, [0, 3])
        np.testing.assert_allclose(out, 1.0, rtol=1e-6)
        with pytest.raises(TypeError, match=r"append_kv_paged: kv_blocks dtype=int8, must be float16, bfloat16, "
                                            r"float32, float8_e4m3fn or float8_e5m2"):
            ops.append_kv_paged(buf.view(np.int8), 0, np.ones((3, H, D)), np.ones((3, H, D)), ei, [0, 3])
