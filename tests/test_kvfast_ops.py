"""kvfast's kernels and ops against NumPy and kvref: bytes, indices and errors."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvfast
import kvref
from kvfast._numba import copy as C
from kvfast._slot_engine import FastSlotEngine
from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec

DTYPES = ["float16", "bfloat16", "float32"]


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:
        return ("err", type(e).__name__, str(e).replace("kvfast.KVCache", "kvref.KVCache"))


# --------------------------------------------------------------------------- copy kernels


@pytest.mark.parametrize("parallel", [False, True])
@given(data=st.data())
@settings(max_examples=40, deadline=None)
def test_scatter_rows_matches_numpy(parallel, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    word = data.draw(st.sampled_from([np.uint8, np.uint16, np.uint32, np.uint64]))
    nb, bs, r = data.draw(st.integers(2, 6)), data.draw(st.integers(1, 5)), data.draw(st.integers(1, 9))
    t = data.draw(st.integers(0, nb * bs))
    slots = rng.permutation(nb * bs)[:t].astype(np.int64)
    if t and data.draw(st.booleans()):
        slots.sort()  # runs of consecutive slots (one span per block)
    pad = rng.random(t) < 0.2
    slots[pad] = -1
    src_k = rng.integers(0, 250, (t, r)).astype(word)
    src_v = rng.integers(0, 250, (t, r)).astype(word)
    if data.draw(st.booleans()):  # strided rows, as qkv.unbind views
        wide = np.zeros((t, 2 * r), word)
        wide[:, :r] = src_k
        src_k = wide[:, :r]
    if data.draw(st.booleans()):  # a strided V beside a packed K (a run must not be one V span then)
        wide = np.zeros((t, 3 * r), word)
        wide[:, r : 2 * r] = src_v
        src_v = wide[:, r : 2 * r]
    dk = rng.integers(0, 250, nb * bs * r).astype(word)
    dv = rng.integers(0, 250, nb * bs * r).astype(word)
    want_k, want_v = dk.copy().reshape(nb * bs, r), dv.copy().reshape(nb * bs, r)
    keep = slots >= 0
    want_k[slots[keep]] = src_k[keep]
    want_v[slots[keep]] = src_v[keep]
    old = C.PARALLEL_RUNS, C.PARALLEL_SPAN_BYTES
    C.PARALLEL_RUNS, C.PARALLEL_SPAN_BYTES = (0, 1 << 60) if parallel else (1 << 60, 0)
    try:
        C.scatter_rows(src_k, src_v, dk, dv, 0, 0, slots, bs, bs * r, r)
    finally:
        C.PARALLEL_RUNS, C.PARALLEL_SPAN_BYTES = old
    assert dk.tobytes() == want_k.tobytes() and dv.tobytes() == want_v.tobytes()


def test_gather_rows():
    rng = np.random.default_rng(3)
    src = rng.integers(0, 1000, 6 * 4 * 3).astype(np.uint32)
    row = np.array([5, 2, 0], np.int32)
    out = np.empty((7, 3), np.uint32)
    C.gather_rows(src, 0, row, 7, 4, 12, 3, out)
    pool = src.reshape(6, 4, 3)
    want = np.concatenate([pool[5], pool[2]])[:7]
    assert np.array_equal(out, want)


def test_word_dtype_and_views():
    assert C.word_dtype(2048) == np.uint64 and C.word_dtype(6) == np.uint16 and C.word_dtype(3) == np.uint8
    x = np.zeros((4, 2, 3), np.float16)
    w = C.as_words(x, np.dtype(np.uint16))
    assert w.shape == (4, 6) and np.shares_memory(w, x)
    y = np.zeros((4, 3, 2), np.float16).transpose(0, 2, 1)  # inner axis not contiguous: copied
    assert C.as_words(y, np.dtype(np.uint16)).shape == (4, 6)


# --------------------------------------------------------------------------- step indices


@given(data=st.data())
@settings(max_examples=60, deadline=None)
def test_build_step_matches_reference_engine(data):
    paged = data.draw(st.booleans())
    S_, L, bs = 5, 12, data.draw(st.integers(1, 4))
    B = data.draw(st.integers(0, S_))
    slots = np.array(data.draw(st.permutations(range(S_)))[:B], np.int64)
    q = np.array(data.draw(st.lists(st.integers(1, 4), min_size=B, max_size=B)), np.int64)
    past = np.array([data.draw(st.integers(0, L - int(x))) for x in q], np.int64)
    cu = np.concatenate([[0], np.cumsum(q)]).astype(np.int64)
    table = np.random.default_rng(B).integers(1, 50, (S_, -(-L // bs))).astype(np.int32)
    enc = np.arange(S_, dtype=np.int64) * 3
    args = (cu, past, slots, table if paged else None, enc, bs, L)
    ref = kvref.ReferenceSlotEngine().build_step(*args)
    got = FastSlotEngine(S_).build_step(*args)
    for f in dataclasses.fields(ref):
        want, arr = getattr(ref, f.name), getattr(got, f.name)
        if isinstance(want, np.ndarray):
            assert arr.dtype == want.dtype and arr.shape == want.shape and np.array_equal(arr, want), f.name
        else:
            assert arr == want, f.name


# --------------------------------------------------------------------------- ops: same results and errors


def _pair(mode, dtype="float16", specs=None):
    cfg = KVCacheConfig(num_layers=3, max_seqs=3, max_seq_len=16, mode=mode, block_size=4, dtype=dtype)
    specs = specs or [KVLayerSpec.attention(2, 4), KVLayerSpec.sliding_window(1, 4, 3),
                      KVLayerSpec.cross_attention(2, 4, 5)]
    return kvref.KVCache.make(cfg, specs), kvfast.KVCache.make(cfg, specs)


@pytest.mark.parametrize("mode", [KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_match_reference(mode, dtype):
    r, f = _pair(mode, dtype)
    rng = np.random.default_rng(1)
    enc = rng.standard_normal((5, 2, 4)).astype(np.float32)
    for c, ops in ((r, kvref.ops), (f, kvfast.ops)):
        c.fill(2, 1, enc, enc * 2)
        c.fill(2, 2, enc[:3], enc[:3] * 3)
    steps = [([0, 3, 5], [0, 0], [1, 2]), ([0, 1, 2], [3, 2], [1, 2]), ([0, 4], [4], [1])]
    for cu, past, slots in steps:
        outs = []
        k = rng.standard_normal((cu[-1], 2, 4))  # float64: cast like the reference
        v = rng.standard_normal((cu[-1], 2, 4)).astype(np.float32)
        k1 = rng.standard_normal((cu[-1], 1, 4)).astype(np.float32)
        q = rng.standard_normal((cu[-1], 4, 4)).astype(np.float32)
        for c, ops in ((r, kvref.ops), (f, kvfast.ops)):
            st_ = c.prepare_step(cu, past, slots)
            ops.append_kv(c, 0, k, v, st_)
            ops.append_kv(c, 1, k1, k1, st_)
            outs.append([ops.varlen_attention(q, c, layer, st_) for layer in (0, 1)]
                        + [ops.varlen_attention(q[:, :2], c, 2, st_)])
            for b, s in enumerate(slots):
                c.update_position(s, past[b] + cu[b + 1] - cu[b])
        for a, b in zip(*outs):  # the same float32 formula, sums in another order (spec/slot-cache.md §7.3)
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
        for layer in range(3):
            assert r.keys(layer).tobytes() == f.keys(layer).tobytes()
            assert r.values(layer).tobytes() == f.values(layer).tobytes()
            for s in range(3):
                ga, gb = kvref.ops.gather_kv(r, layer, s), kvfast.ops.gather_kv(f, layer, s)
                assert ga[0].tobytes() == gb[0].tobytes() and ga[1].tobytes() == gb[1].tobytes()


def test_ops_errors_match_reference():
    r, f = _pair(KVCacheMode.PAGED)
    sr = r.prepare_step([0, 2], [0], [0])
    sf = f.prepare_step([0, 2], [0], [0])
    good = np.zeros((2, 2, 4), np.float16)
    cases = [
        lambda c, o, s: o.append_kv(c, 5, good, good, s),
        lambda c, o, s: o.append_kv(c, 2, good, good, s),
        lambda c, o, s: o.append_kv(c, 0, good.astype(np.int32), good, s),
        lambda c, o, s: o.append_kv(c, 0, good[:1], good, s),
        lambda c, o, s: o.append_kv(c, 0, good[:, :1], good, s),
        lambda c, o, s: o.append_kv(c, 0, good, good, "step"),
        lambda c, o, s: o.append_kv(c, True, good, good, s),
        lambda c, o, s: o.gather_kv(c, 0, 7),
        lambda c, o, s: o.gather_kv(c, 0, -1),
        lambda c, o, s: o.varlen_attention(good[:, :1], c, 0, s),
        lambda c, o, s: o.varlen_attention(np.zeros((2, 2, 4), np.float32), c, 2, s),
        lambda c, o, s: o.varlen_attention(good, c, 0, s, scale="x"),
        lambda c, o, s: o.append_kv(object(), 0, good, good, s),
    ]
    for i, case in enumerate(cases):
        a = _outcome(lambda: case(r, kvref.ops, sr))
        b = _outcome(lambda: case(f, kvfast.ops, sf))
        assert a == b, (i, a, b)
        assert a[0] == "err", i
    assert r.keys(0).tobytes() == f.keys(0).tobytes()


def test_append_kv_slot_mapping_out_of_range_matches_reference():
    import dataclasses

    r, f = _pair(KVCacheMode.PAGED)
    sr = r.prepare_step([0, 2], [0], [0])
    sf = f.prepare_step([0, 2], [0], [0])
    x = np.ones((2, 2, 4), np.float32)
    bad_r = dataclasses.replace(sr, slot_mapping=np.array([4, 10**6], np.int64))
    bad_f = dataclasses.replace(sf, slot_mapping=np.array([4, 10**6], np.int64))
    a = _outcome(lambda: kvref.ops.append_kv(r, 0, x, x, bad_r))
    b = _outcome(lambda: kvfast.ops.append_kv(f, 0, x, x, bad_f))
    assert a == b and a[1] == "IndexError"
    assert r.keys(0).tobytes() == f.keys(0).tobytes()


# --------------------------------------------------------------------------- surface and devices


def test_public_names_cover_kvref():
    missing = sorted(set(kvref.__all__) - set(kvfast.__all__))
    assert not missing
    for name in kvref.__all__:
        getattr(kvfast, name)
    for name in ("append_kv", "gather_kv", "varlen_attention"):
        assert callable(getattr(kvfast.ops, name))
    assert issubclass(kvfast.KVCache, kvref.KVCache)
    assert issubclass(kvfast.PagedKVCacheManager, kvref.PagedKVCacheManager)


def _has_cupy():
    try:
        import cupy  # noqa: F401

        return True
    except ImportError:
        return False


@pytest.mark.skipif(_has_cupy(), reason="CuPy installed: the no-CuPy error path does not apply")
def test_cuda_without_cupy_is_a_clear_error():
    cfg = KVCacheConfig(num_layers=1, max_seqs=1, max_seq_len=4, mode=KVCacheMode.PAGED, device="cuda")
    with pytest.raises(RuntimeError, match=r"KVCache.make: device='cuda:0' needs CuPy"):
        kvfast.KVCache.make(cfg, [KVLayerSpec.attention(1, 2)])
    from kvspec import KVCacheParams

    with pytest.raises(RuntimeError, match=r"PagedKVCacheManager: device='cuda:0' needs CuPy"):
        kvfast.PagedKVCacheManager(KVCacheParams(page_size=2, num_layers=1, kv_heads=1, head_dim=1),
                                   num_blocks=4, max_batch_size=1, max_seq_len=8, device="cuda")


def test_import_kvfast_loads_no_numba_or_cupy():
    import subprocess
    import sys

    code = "import kvfast, sys; print('numba' in sys.modules, 'cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
