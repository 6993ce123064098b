"""FP8 K/V with per-(block, head) scales in the slot cache (``spec/slot-cache.md`` §10).

Attention through an FP8 cache equals dense attention over the dequantised
history exactly (kvref, kvfast on the CPU, kvfast on the emulated CUDA
device), is within the documented bound of the unquantised attention, and
every backend stores the same bytes and scales; bad input raises and leaves
storage and scales bit-for-bit unchanged. The quantising kernels run through
the CPU kernel harness (``kvfast/kernels/append_kv_fp8.cu``) and as the
Numba twin, both against the reference rule.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kvfast
import kvref
from kvref._slot_engine import softmax_attend  # the oracle's float32 attention (a test may read kvref)
from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec
from kvspec._dtypes import FP8_DTYPES, FP8_MAX, fp8_decode_table, fp8_scale

FP8 = sorted(FP8_DTYPES)
MODES = [KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS]
#: (mantissa bits, smallest normal exponent) of each format, for the error bound of §10.2
FORMAT = {"float8_e4m3fn": (3, -6), "float8_e5m2": (2, -14)}


def host(x) -> np.ndarray:
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


def make(pkg, mode, dtype, device="cpu", *, max_seqs=3, max_seq_len=16, block_size=4, num_blocks=0):
    cfg = KVCacheConfig(num_layers=3, max_seqs=max_seqs, max_seq_len=max_seq_len, mode=mode, block_size=block_size,
                        dtype=dtype, device=device, num_blocks=num_blocks)
    specs = [KVLayerSpec.attention(2, 8), KVLayerSpec.sliding_window(2, 8, 3), KVLayerSpec.cross_attention(2, 8, 6)]
    return pkg.KVCache.make(cfg, specs)


def snapshot(cache) -> list[np.ndarray]:
    """Every K/V byte and scale of the cache, plus lengths (for unchanged-after-raise checks)."""
    out = [cache.seq_lens()]
    for l in range(3):
        out += [host(cache.keys(l)).view(np.uint8).copy(), host(cache.values(l)).view(np.uint8).copy()]
        out += [host(s).copy() for s in cache.scales(l)]
    return out


def run_steps(pkg, cache, steps, seed=0, in_dtype=np.float32):
    """Feed ``steps`` (a list of query lengths) to slot 1 (and one token to slot 0 each step);
    return every attention output, the unquantised history and the dequantised history."""
    rng = np.random.default_rng(seed)
    ops = pkg.ops
    hist = {0: [], 1: []}
    outs = []
    enc_k = rng.standard_normal((5, 2, 8)).astype(in_dtype)
    enc_v = rng.standard_normal((5, 2, 8)).astype(in_dtype)
    cache.fill(2, 1, enc_k, enc_v)
    cache.fill(2, 0, enc_k * 3, enc_v)
    for i, q in enumerate(steps):
        past = [int(x) for x in cache.seq_lens()[[1, 0]]]
        step = cache.prepare_step([0, q, q + 1], past, [1, 0])
        # growing magnitudes: later tokens re-quantise earlier ones of the same block
        k = (rng.standard_normal((q + 1, 2, 8)) * (1 + 4 * i)).astype(in_dtype)
        v = (rng.standard_normal((q + 1, 2, 8)) * (1 + 2 * i)).astype(in_dtype)
        for layer in (0, 1):
            ops.append_kv(cache, layer, k, v, step)
        query = rng.standard_normal((q + 1, 4, 8)).astype(np.float32)
        outs.append([host(ops.varlen_attention(query, cache, l, step)) for l in (0, 1, 2)] + [query, step])
        hist[1].append((k[:q], v[:q]))
        hist[0].append((k[q:], v[q:]))
        cache.update_position(1, past[0] + q)
        cache.update_position(0, past[1] + 1)
    return outs, hist, (enc_k, enc_v)


def dense_masks(past: int, q: int, n: int, window: int | None):
    pos = past + np.arange(q)[:, None]
    key = np.arange(n)[None, :]
    mask = key <= pos
    if window is not None:
        mask &= key > pos - window
    return mask


# --------------------------------------------------------------------------- the rule itself


@pytest.mark.parametrize("name", FP8)
def test_numba_encoder_is_ml_dtypes_round_to_nearest_even(name):
    from kvfast._numba import fp8

    dt = FP8_DTYPES[name]
    vals = fp8_decode_table(name)
    vals = np.unique(vals[np.isfinite(vals)])
    mids = ((vals[1:].astype(np.float64) + vals[:-1]) / 2).astype(np.float32)  # ties
    rng = np.random.default_rng(7)
    rand = (rng.standard_normal(20000) * FP8_MAX[name] / 3).astype(np.float32)
    sub = rng.integers(1, 2**23, 2000).astype(np.uint32).view(np.float32)  # float32 subnormals
    x = np.concatenate([vals, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)),
                        rand, sub, -sub, (rng.standard_normal(5000) * 2.0**-14).astype(np.float32)])
    x = x[np.abs(x) <= FP8_MAX[name]]
    out = np.zeros(x.size, np.int64)
    M, B, _ = fp8.FP8_FORMAT[name]
    fp8.encode_array(x.view(np.uint32), M, B, out)
    np.testing.assert_array_equal(out.astype(np.uint8), x.astype(dt).view(np.uint8))


@pytest.mark.parametrize("name", FP8)
def test_scale_rule_is_the_smallest_power_of_two_that_fits(name):
    amax = np.array([0, 1e-45, 1e-30, 0.1, 1, FP8_MAX[name], np.nextafter(np.float32(FP8_MAX[name]), np.float32(1e9)),
                     3.0e38], np.float32)
    s = fp8_scale(amax, name)
    m, _ = np.frexp(s)
    assert (m == 0.5).all()  # powers of two
    assert (amax <= FP8_MAX[name] * s.astype(np.float64)).all()
    smaller = s.astype(np.float64) / 2
    fits_smaller = amax <= FP8_MAX[name] * smaller
    assert not (fits_smaller & (s > 2.0**-126)).any()  # minimal unless clamped
    assert s[0] == np.float32(2.0**-126) and s[5] == 1 and s[6] == 2


# --------------------------------------------------------------------------- the cache


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FP8)
@pytest.mark.parametrize("pkg", [kvref, kvfast], ids=["kvref", "kvfast"])
def test_attention_equals_dense_attention_over_dequantised_history(pkg, name, mode):
    cache = make(pkg, mode, name)
    outs, hist, _ = run_steps(pkg, cache, [5, 1, 3, 2])
    cache.check_invariants()
    # the last step: rows see the whole committed history, which gather_kv returns dequantised
    a0, a1, a2, query, step = outs[-1]
    q = 2
    K, V = pkg.ops.gather_kv(cache, 0, 1)
    n = K.shape[0]
    assert K.dtype == np.float32 and n == int(cache.seq_lens()[1])
    scale = 1 / np.sqrt(8)
    dense = softmax_attend(query[:q], K, V, dense_masks(n - q, q, n, None), scale)
    np.testing.assert_array_equal(a0[:q], dense)  # exact: same bits
    Ks, Vs = pkg.ops.gather_kv(cache, 1, 1)
    np.testing.assert_array_equal(a1[:q], softmax_attend(query[:q], Ks, Vs, dense_masks(n - q, q, n, 3), scale))
    Kc, Vc = pkg.ops.gather_kv(cache, 2, 1)
    np.testing.assert_array_equal(a2[:q], softmax_attend(query[:q], Kc, Vc, np.ones((q, 5), bool), scale))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FP8)
@pytest.mark.parametrize("pkg", [kvref, kvfast], ids=["kvref", "kvfast"])
def test_dequantised_history_and_attention_are_within_the_documented_bound(pkg, name, mode):
    cache = make(pkg, mode, name)
    outs, hist, (enc_k, _) = run_steps(pkg, cache, [5, 1, 3, 2], seed=3)
    M, emin = FORMAT[name]
    P = cache.config.block_size
    K, V = pkg.ops.gather_kv(cache, 0, 1)
    Kt = np.concatenate([h[0] for h in hist[1]])
    Vt = np.concatenate([h[1] for h in hist[1]])
    Ks, Vs = cache.scales(0)
    table = cache.paged_block_table()
    for X, Xt, S in ((K, Kt, Ks), (V, Vt, Vs)):
        pos = np.arange(X.shape[0])
        unit_scale = S[table[1, pos // P]] if mode is KVCacheMode.PAGED else S[1, pos // P]
        bound = 2.0 ** -(M + 1) * np.abs(Xt) + 2.0 ** (emin - M) * unit_scale[:, :, None]
        assert (np.abs(X - Xt) <= bound).all()
        amax = np.zeros_like(unit_scale)
        for p in pos:  # the scale is below twice the largest magnitude its unit saw over FP8_MAX
            amax[p] = np.abs(Xt[(pos // P) == p // P]).max(axis=(0, 2))
        assert (unit_scale < 2 * amax / FP8_MAX[name]).all()
    # attention: |out - out_hat| <= max|v - v_hat| + (exp(2 d) - 1) max|v_hat|
    a0, _, _, query, _ = outs[-1]
    q, n = 2, K.shape[0]
    exact = softmax_attend(query[:q], Kt, Vt, dense_masks(n - q, q, n, None), 1 / np.sqrt(8))
    group = query.shape[1] // 2
    dk = np.repeat(np.abs(K - Kt), group, axis=1)  # [n, q_heads, dim]
    d = (np.einsum("qhd,khd->qhk", np.abs(query[:q]), dk) / np.sqrt(8)).max()
    dv = np.abs(V - Vt).max()
    bound = dv + (np.exp(2 * d) - 1) * np.abs(V).max()
    err = np.abs(a0[:q] - exact).max()
    assert err <= bound + 1e-6
    assert err > 0  # FP8 is lossy here: the comparison is not vacuous
    # cross plane: fresh scales per unit, same bound
    Kc, _ = pkg.ops.gather_kv(cache, 2, 1)
    Sc = cache.scales(2)[0][1]
    us = Sc[np.arange(5) // P][:, :, None]
    assert (np.abs(Kc - enc_k) <= 2.0 ** -(M + 1) * np.abs(enc_k) + 2.0 ** (emin - M) * us).all()


@pytest.mark.parametrize("in_dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.float64])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", FP8)
def test_kvfast_cpu_stores_the_reference_bytes_and_scales(name, mode, in_dtype):
    caches = [make(pkg, mode, name) for pkg in (kvref, kvfast)]
    results = [run_steps(pkg, c, [5, 1, 3, 2], seed=11, in_dtype=in_dtype) for pkg, c in zip((kvref, kvfast), caches)]
    for a, b in zip(snapshot(caches[0]), snapshot(caches[1])):
        np.testing.assert_array_equal(a, b)
    for ra, rb in zip(results[0][0], results[1][0]):
        for x, y in zip(ra[:3], rb[:3]):
            np.testing.assert_array_equal(x, y)


def test_emulated_cuda_stores_the_reference_bytes_and_attends_exactly(emulated):
    for mode in MODES:
        for name in FP8:
            ref = make(kvref, mode, name)
            dev = make(kvfast, mode, name, device="cuda:0")
            assert dev.keys(0).dtype == np.uint8  # FP8 lives as bit patterns on the device
            r_out = run_steps(kvref, ref, [5, 1, 3, 2], seed=5)[0]
            d_out = run_steps(kvfast, dev, [5, 1, 3, 2], seed=5)[0]
            for a, b in zip(snapshot(ref), snapshot(dev)):
                np.testing.assert_array_equal(a, b)
            for ra, rb in zip(r_out, d_out):
                for x, y in zip(ra[:3], rb[:3]):
                    np.testing.assert_array_equal(x, y)
            K, V = kvfast.ops.gather_kv(dev, 0, 1)
            Kr, Vr = kvref.ops.gather_kv(ref, 0, 1)
            np.testing.assert_array_equal(host(K), Kr)
            dev.check_invariants()


def test_requantisation_when_a_later_token_needs_a_larger_scale():
    cfg = KVCacheConfig(num_layers=1, max_seqs=1, max_seq_len=8, mode=KVCacheMode.PAGED, block_size=4,
                        dtype="float8_e4m3fn")
    for pkg in (kvref, kvfast):
        c = pkg.KVCache.make(cfg, [KVLayerSpec.attention(1, 2)])
        small = np.array([[[1.0, 0.3]]], np.float32)
        st = c.prepare_step([0, 1], [0], [0])
        pkg.ops.append_kv(c, 0, small, small, st)
        c.update_position(0, 1)
        blk = int(c.paged_block_table()[0, 0])
        assert c.scales(0)[0][blk, 0] == np.float32(2.0**-8)  # 1.0 needs 2**-8 (256 <= 448)
        big = np.array([[[1000.0, -3.0]]], np.float32)
        st = c.prepare_step([0, 1], [1], [0])
        pkg.ops.append_kv(c, 0, big, big, st)
        c.update_position(0, 2)
        assert c.scales(0)[0][blk, 0] == np.float32(4.0)  # 1000 needs 4 (250 <= 448)
        K, _ = pkg.ops.gather_kv(c, 0, 0)
        # 1.0 / 4 = 0.25 is normal in e4m3fn: exact; 0.3 / 4 = 0.075 rounds on the coarser grid
        want0 = (np.float32(0.3) / np.float32(2.0**-8)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        want0 = (want0 * np.float32(2.0**-8 / 4)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * 4
        want1 = np.float32(250.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * 4  # 256 * 4
        np.testing.assert_array_equal(K[:, 0], [[1.0, want0], [want1, -3.0]])


# --------------------------------------------------------------------------- scales follow their units


@pytest.mark.parametrize("pkg", [kvref, kvfast], ids=["kvref", "kvfast"])
def test_scales_follow_blocks_through_retire_admit_and_reallocation(pkg):
    c = make(pkg, KVCacheMode.PAGED, "float8_e4m3fn", num_blocks=4, max_seq_len=8, block_size=4)
    rng = np.random.default_rng(2)
    k = (rng.standard_normal((8, 2, 8)) * 50).astype(np.float32)
    st = c.prepare_step([0, 8], [0], [0])
    pkg.ops.append_kv(c, 0, k, k, st)
    c.update_position(0, 8)
    before = pkg.ops.gather_kv(c, 0, 0)[0]
    blocks = c.paged_block_table()[0, :2].tolist()
    scales = c.scales(0)[0][blocks].copy()
    assert (scales > 0).all()
    c.retire(0, list(range(9)))
    hit = c.admit(1, list(range(9)))
    assert hit == 8 and c.paged_block_table()[1, :2].tolist() == blocks
    np.testing.assert_array_equal(c.scales(0)[0][blocks], scales)  # adopted: values and scales together
    np.testing.assert_array_equal(pkg.ops.gather_kv(c, 0, 1)[0], before)
    c.evict_batch(1)
    # a fresh sequence pops the retained blocks (LRU): their scales restart at 0
    st = c.prepare_step([0, 8], [0], [2])
    got = c.paged_block_table()[2, :2].tolist()
    assert set(got) <= {1, 2, 3}
    np.testing.assert_array_equal(c.scales(0)[0][got], 0)
    small = np.full((8, 2, 8), 0.01, np.float32)
    pkg.ops.append_kv(c, 0, small, small, st)
    c.update_position(2, 8)
    K, _ = pkg.ops.gather_kv(c, 0, 2)
    assert np.abs(K - 0.01).max() <= 0.01 * 2.0**-4  # precise: not the old, coarse scale
    c.check_invariants()


@pytest.mark.parametrize("pkg", [kvref, kvfast], ids=["kvref", "kvfast"])
def test_contiguous_and_cross_scales_are_zeroed_with_the_slot_and_by_reset(pkg):
    c = make(pkg, KVCacheMode.CONTIGUOUS, "float8_e5m2")
    run_steps(pkg, c, [3, 2])
    assert (c.scales(0)[0][1] > 0).any() and (c.scales(2)[0][1] > 0).any()
    ids = [id(a) for l in range(3) for a in c.scales(l)]
    c.evict_batch(1)
    for l in (0, 1, 2):
        for s in c.scales(l):
            assert (s[1] == 0).all()
    assert (c.scales(0)[0][0] > 0).any()  # another slot keeps its scales
    c.reset()
    assert all((s == 0).all() for l in range(3) for s in c.scales(l))
    assert [id(a) for l in range(3) for a in c.scales(l)] == ids  # live, same objects


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("pkg", [kvref, kvfast], ids=["kvref", "kvfast"])
@pytest.mark.parametrize("mode", MODES)
def test_bad_input_raises_and_leaves_bytes_and_scales_unchanged(pkg, mode):
    c = make(pkg, mode, "float8_e4m3fn")
    run_steps(pkg, c, [3])
    step = c.prepare_step([0, 2], [3], [1])
    good = np.ones((2, 2, 8), np.float32) * 1000
    before = snapshot(c)
    bad = good.copy()
    bad[1, 0, 3] = np.nan
    with pytest.raises(ValueError, match=r"append_kv: k\[1\] has a non-finite value"):
        pkg.ops.append_kv(c, 0, bad, good, step)
    inf = good.copy()
    inf[0, 1, 0] = -np.inf
    with pytest.raises(ValueError, match=r"append_kv: v\[0\] has a non-finite value"):
        pkg.ops.append_kv(c, 0, good, inf, step)
    with pytest.raises(ValueError, match=r"append_kv: k.shape\[1\]=1 != kv_heads=2"):
        pkg.ops.append_kv(c, 0, good[:, :1], good, step)
    with pytest.raises(TypeError, match=r"append_kv: k dtype=int32, must be a floating type"):
        pkg.ops.append_kv(c, 0, good.astype(np.int32), good, step)
    import dataclasses

    far = dataclasses.replace(step, slot_mapping=np.array([0, 10**6], np.int64))
    with pytest.raises(IndexError, match=r"append_kv: step.slot_mapping\[1\]=1000000 out of range"):
        pkg.ops.append_kv(c, 0, good, good, far)
    with pytest.raises(ValueError, match=r"fill: k\[0\] has a non-finite value"):
        c.fill(2, 1, np.full((5, 2, 8), np.inf, np.float32), np.ones((5, 2, 8), np.float32))
    for a, b in zip(before, snapshot(c)):
        np.testing.assert_array_equal(a, b)  # bit for bit
    with pytest.raises(IndexError, match=r"scales: layer=3 out of range \[0, 3\)"):
        c.scales(3)


def test_scales_refused_without_fp8_and_fp8_state_refused():
    cfg = KVCacheConfig(num_layers=1, max_seqs=1, max_seq_len=4, mode=KVCacheMode.PAGED, block_size=2)
    for pkg in (kvref, kvfast):
        c = pkg.KVCache.make(cfg, [KVLayerSpec.attention(1, 2)])
        with pytest.raises(RuntimeError, match=r"scales: config.dtype='float16' has no scales"):
            c.scales(0)
    with pytest.raises(ValueError, match=r"KVCacheConfig: state_dtype='float8_e4m3fn', must be one of"):
        KVCacheConfig(num_layers=1, max_seqs=1, max_seq_len=4, mode=KVCacheMode.PAGED, state_dtype="float8_e4m3fn")


# --------------------------------------------------------------------------- the kernels


def _reference_append(name, K, V, Ks, Vs, k, v, sm, unit):
    e = kvref.ReferenceSlotEngine()
    dt = FP8_DTYPES[name]
    K, V = K.view(dt).copy(), V.view(dt).copy()
    Ks, Vs = Ks.copy(), Vs.copy()
    assert e.scatter_kv_fp8(K, V, Ks, Vs, k.astype(np.float32), v.astype(np.float32), sm, unit) == -1
    return K.view(np.uint8), V.view(np.uint8), Ks, Vs


@pytest.mark.parametrize("seed", [0, 12345])
@pytest.mark.parametrize("suffix", ["u32", "u16", "bf16", "u8"])
@pytest.mark.parametrize("name", FP8)
def test_harness_kernels_equal_the_reference_rule(name, suffix, seed):
    from kvfast._cuda.append_kv_fp8 import FP8_FORMAT
    from kvfast._cuda.harness import get_host_kernel

    rng = np.random.default_rng(seed)
    A, bs, H, D, unit = 5, 8, 2, 24, 4  # row of 48 bytes: three 16-byte vectors; 2 units per block
    finite = np.flatnonzero(np.isfinite(fp8_decode_table(name))).astype(np.uint8)
    K = rng.choice(finite, (A, bs, H, D))  # stale bytes: finite patterns of both signs
    V = rng.choice(finite, (A, bs, H, D))
    scale0 = fp8_scale(np.float32(2.0), name)
    Ks = np.where(rng.random((A, 2, H)) < 0.5, 0, scale0).astype(np.float32)
    Vs = np.where(rng.random((A, 2, H)) < 0.5, 0, scale0).astype(np.float32)
    T = 9
    sm = rng.choice(A * bs, T, replace=False).astype(np.int64)
    sm[3] = -1
    x = (rng.standard_normal((2, T, H, D)) * np.array([0.1, 30.0])[:, None, None, None]).astype(np.float32)
    if suffix == "u16":
        inp = x.astype(np.float16)
        k_in, v_in = inp[0], inp[1]
        ref_in = inp.astype(np.float32)
    elif suffix == "bf16":
        inp = x.astype(ml_dtypes.bfloat16)
        k_in, v_in = inp[0].view(np.uint16), inp[1].view(np.uint16)
        ref_in = inp.astype(np.float32)
    elif suffix == "u8":
        inp = np.clip(x, -FP8_MAX[name], FP8_MAX[name]).astype(FP8_DTYPES[name])
        k_in, v_in = inp[0].view(np.uint8), inp[1].view(np.uint8)
        ref_in = inp.astype(np.float32)
    else:
        k_in, v_in = x[0], x[1]
        ref_in = x
    want = _reference_append(name, K, V, Ks, Vs, ref_in[0], ref_in[1], sm, unit)
    suf = "u16" if suffix == "bf16" else suffix
    fmt, in_fmt = FP8_FORMAT[name], 1 if suffix == "bf16" else 0
    Kg, Vg, Ksg, Vsg = K.copy(), V.copy(), Ks.copy(), Vs.copy()
    kn, vn = Ksg.copy(), Vsg.copy()
    f = "append_kv_fp8.cu"
    get_host_kernel(f, f"fp8_scale_kernel_{suf}")(
        T, 32, (k_in, v_in, kn.view(np.uint32), vn.view(np.uint32), sm, T, H, D, H * D, H * D, in_fmt, fmt, bs, 2,
                unit), seed=seed)
    get_host_kernel(f, f"fp8_requant_kernel_{suf}")(
        A * 2, 32, (Kg, Vg, Ksg, Vsg, kn, vn, A * 2, H, D, bs, 2, unit, bs * H * D, H * D, H, fmt), seed=seed)
    get_host_kernel(f, f"fp8_append_kernel_{suf}")(
        T, 32, (k_in, v_in, Kg, Vg, Ksg, Vsg, sm, T, H, D, H * D, H * D, in_fmt, fmt, bs, 2, unit, bs * H * D,
                H * D, H), seed=seed)
    for got, exp in zip((Kg, Vg, Ksg, Vsg), want):
        np.testing.assert_array_equal(got, exp)
    assert (Ksg > Ks).any()  # scales grew: the re-quantise path ran


@pytest.mark.parametrize("name", FP8)
def test_numba_twin_equals_the_reference_rule(name):
    from kvfast._numba import fp8

    rng = np.random.default_rng(4)
    A, bs, H, D, unit = 3, 6, 2, 5, 4  # a partial unit at the end of each block
    K = np.zeros((A, bs, H, D), np.uint8)
    V = np.zeros((A, bs, H, D), np.uint8)
    Ks = np.zeros((A, 2, H), np.float32)
    Vs = np.zeros((A, 2, H), np.float32)
    state = [K, V, Ks, Vs]
    for i in range(4):
        T = 5
        sm = rng.choice(A * bs, T, replace=False).astype(np.int64)
        k = (rng.standard_normal((T, H, D)) * 10.0**i).astype(np.float32)
        v = (rng.standard_normal((T, H, D)) * 3.0**i).astype(np.float32)
        want = _reference_append(name, *state, k, v, sm, unit)
        got = [a.copy() for a in state]
        fp8.append_fp8(k, v, got[0].view(FP8_DTYPES[name]), got[1].view(FP8_DTYPES[name]), got[2], got[3], sm, unit,
                       name, fp8_decode_table(name))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        state = [a.copy() for a in want]


def test_launcher_validates_its_arguments(emulated):
    from kvfast._cuda.append_kv_fp8 import append_kv_fp8

    cp = emulated
    K = cp.zeros((2, 4, 1, 16), cp.uint8)
    S = cp.zeros((2, 1), cp.float32)
    x = cp.zeros((1, 1, 16), cp.float32)
    sm = cp.asarray(np.array([1], np.int64))
    kw = dict(block_size=4, block_stride=64, row_stride=16, unit_tokens=4)
    with pytest.raises(ValueError, match=r"fp8='float8_e4m3'"):
        append_kv_fp8(x, x, K, K, S, S, sm, fp8="float8_e4m3", **kw)
    with pytest.raises(ValueError, match=r"cache dtype=float32, must be uint8"):
        append_kv_fp8(x, x, S, S, S, S, sm, fp8="float8_e5m2", **kw)
    with pytest.raises(ValueError, match=r"bfloat16_input=True"):
        append_kv_fp8(x, x, K, K, S, S, sm, fp8="float8_e5m2", bfloat16_input=True, **kw)
    append_kv_fp8(x + 3, x + 3, K, K, S, S, sm, fp8="float8_e5m2", **kw)
    assert float(S[0, 0].get()) == 2.0**-14  # 3 needs 2**-14 on e5m2 (3 * 2**14 <= 57344)


def test_launcher_writes_strided_scale_rows_of_a_manager_buffer(emulated):
    """The kernels address scales through a row stride: the K and V rows of one layer in a
    ``[num_blocks, 2, num_layers, kv_heads]`` scales buffer (the manager's layout,
    spec/manager.md §16), values in the layer's planes of ``[num_blocks, 2, num_layers, page, heads, dim]``."""
    from kvfast._cuda.append_kv_fp8 import append_kv_fp8

    cp = emulated
    NB, L, P, H, D, layer = 4, 3, 4, 2, 8, 1
    buf = cp.zeros((NB, 2, L, P, H, D), cp.uint8)
    scales = cp.zeros((NB, 2, L, H), cp.float32)
    rng = np.random.default_rng(9)
    sm = np.array([5, 6, 9, -1, 12], np.int64)  # blocks 1, 1, 2, padding, 3
    k = (rng.standard_normal((5, H, D)) * 20).astype(np.float32)
    v = (rng.standard_normal((5, H, D)) * 0.5).astype(np.float32)
    append_kv_fp8(cp.asarray(k), cp.asarray(v), buf[:, 0, layer], buf[:, 1, layer], scales[:, 0, layer],
                  scales[:, 1, layer], cp.asarray(sm), fp8="float8_e4m3fn", block_size=P,
                  block_stride=2 * L * P * H * D, row_stride=H * D, unit_tokens=P)
    # the reference on dense copies of the same plane
    dt = FP8_DTYPES["float8_e4m3fn"]
    Kr, Vr = np.zeros((NB, P, H, D), dt), np.zeros((NB, P, H, D), dt)
    Ksr, Vsr = np.zeros((NB, H), np.float32), np.zeros((NB, H), np.float32)
    kvref.ReferenceSlotEngine().scatter_kv_fp8(Kr, Vr, Ksr, Vsr, k, v, sm, P)
    got = buf.get()
    np.testing.assert_array_equal(got[:, 0, layer], Kr.view(np.uint8))
    np.testing.assert_array_equal(got[:, 1, layer], Vr.view(np.uint8))
    np.testing.assert_array_equal(scales.get()[:, 0, layer], Ksr)
    np.testing.assert_array_equal(scales.get()[:, 1, layer], Vsr)
    other = np.ones(got.shape[2], bool)
    other[layer] = False
    assert not got[:, :, other].any() and not scales.get()[:, :, other].any()  # other layers untouched


# --------------------------------------------------------------------------- property: any magnitudes

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@given(name=st.sampled_from(FP8), mode=st.sampled_from(MODES),
       exps=st.lists(st.integers(-140, 120), min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_any_magnitudes_backends_agree_and_stay_within_the_bound(name, mode, exps, seed):
    """Steps of random magnitude ``2**e`` (float32 subnormals to ``2**120``, so the scale clamps at
    ``2**-126`` and grows by large factors): kvref and kvfast store the same bytes and scales, and
    every dequantised value is within §10.2's bound of its input."""
    M, emin = FORMAT[name]
    cfg = KVCacheConfig(num_layers=1, max_seqs=1, max_seq_len=12, mode=mode, block_size=4, dtype=name)
    caches = [pkg.KVCache.make(cfg, [KVLayerSpec.attention(1, 4)]) for pkg in (kvref, kvfast)]
    rng = np.random.default_rng(seed)
    hist = []
    past = 0
    for e in exps[: 12 // 2]:
        q = int(rng.integers(1, 3))
        if past + q > 12:
            break
        x = (rng.standard_normal((q, 1, 4)) * 2.0**e).astype(np.float32)
        hist.append(x)
        for pkg, c in zip((kvref, kvfast), caches):
            step = c.prepare_step([0, q], [past], [0])
            pkg.ops.append_kv(c, 0, x, -x, step)
            c.update_position(0, past + q)
        past += q
    ref, fast = caches
    np.testing.assert_array_equal(host(ref.keys(0)).view(np.uint8), host(fast.keys(0)).view(np.uint8))
    for a, b in zip(ref.scales(0), fast.scales(0)):
        np.testing.assert_array_equal(a, b)
    K, V = kvref.ops.gather_kv(ref, 0, 0)
    xt = np.concatenate(hist)
    pos = np.arange(past)
    S = ref.scales(0)[0]
    s = S[ref.paged_block_table()[0, pos // 4]] if mode is KVCacheMode.PAGED else S[0, pos // 4]
    bound = 2.0 ** -(M + 1) * np.abs(xt).astype(np.float64) + 2.0 ** (emin - M) * s[:, :, None].astype(np.float64)
    assert (np.abs(K.astype(np.float64) - xt) <= bound).all()
    np.testing.assert_array_equal(V, -K)  # sign-symmetric rounding: V = -K quantises to -K's value


# --------------------------------------------------------------------------- the differential machine


def test_fp8_differential_machine_on_cpu_and_emulated_cuda(emulated):
    """``KVCacheFP8Comparison`` (every example FP8) for kvfast on the CPU and on the emulated device."""
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    from kvfast._backend import conformance_backend
    from kvspec.conformance.machine import KVCacheFP8Comparison

    quick = settings(max_examples=10, stateful_step_count=20, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    backend = conformance_backend()
    run_state_machine_as_test(KVCacheFP8Comparison.for_backend(backend), settings=quick)
    run_state_machine_as_test(KVCacheFP8Comparison.for_backend(backend.on_device("cuda:0")), settings=quick)


@pytest.mark.parametrize("name", FP8)
@pytest.mark.parametrize("head_dim", [16, 5])  # 16: the 16-byte load path; 5: the scalar tail only
def test_the_dequantising_gather_kernel_decodes_every_bit_pattern(emulated, name, head_dim):
    """``fp8_gather_kernel`` (``kernels/append_kv_fp8.cu``, one launch) on the emulated device: every
    one of the 256 FP8 bit patterns, NaN and (e5m2) infinities included, decoded and times its
    unit-head's scale (spec/slot-cache.md §10.3), through a paged block row and a contiguous slot,
    bit for bit the reference decode table times the scale."""
    from kvfast._cuda.append_kv_fp8 import gather_kv_fp8

    cp = emulated
    rng = np.random.default_rng(head_dim)
    heads, bs, unit = 2, 4, 2  # two scale units per block
    blocks = 2 * (-(-256 // (2 * bs * heads * head_dim)) + 2)  # every pattern; even (two blocks per slot below)
    bits = np.resize(rng.permutation(256).astype(np.uint8), (blocks, bs, heads, head_dim))
    vbits = bits[::-1].copy()
    upb = bs // unit
    ks = (2.0 ** rng.integers(-20, 20, size=(blocks * upb, heads))).astype(np.float32)
    vs = (2.0 ** rng.integers(-20, 20, size=(blocks * upb, heads))).astype(np.float32)
    table = fp8_decode_table(name)
    row = rng.permutation(np.arange(1, blocks)).astype(np.int32)
    n = len(row) * bs - 1
    pos = np.arange(n)
    blk, r = row[pos // bs].astype(np.int64), pos % bs
    u = blk * upb + r // unit
    want_k = table[bits[blk, r]] * ks[u][:, :, None]
    want_v = table[vbits[blk, r]] * vs[u][:, :, None]
    row_elems = heads * head_dim
    got_k, got_v = gather_kv_fp8(cp.asarray(bits), cp.asarray(vbits), cp.asarray(ks), cp.asarray(vs),
                                 cp.asarray(row), n, fp8=name, block_size=bs, block_stride=bs * row_elems,
                                 row_stride=row_elems, unit_tokens=unit, kv_heads=heads, head_dim=head_dim)
    assert got_k.dtype == np.float32 and got_k.shape == (n, heads, head_dim)
    np.testing.assert_array_equal(host(got_k), want_k)  # (NaN compares equal to NaN here)
    np.testing.assert_array_equal(host(got_v), want_v)
    # contiguous storage: slot s is one "block" of max_seq_len positions, table row [s]
    slot, msl = 2, bs * 2
    cont = bits.reshape(-1, msl, heads, head_dim)
    cks = ks.reshape(cont.shape[0], -1, heads)
    got_k, _ = gather_kv_fp8(cp.asarray(cont), cp.asarray(cont), cp.asarray(cks), cp.asarray(cks),
                             cp.asarray(np.array([slot], np.int32)), msl, fp8=name, block_size=msl,
                             block_stride=msl * row_elems, row_stride=row_elems, unit_tokens=unit, kv_heads=heads,
                             head_dim=head_dim)
    want = table[cont[slot]] * cks[slot][np.arange(msl) // unit][:, :, None]
    np.testing.assert_array_equal(host(got_k), want)


def test_the_gather_launcher_validates_its_arguments(emulated):
    from kvfast._cuda.append_kv_fp8 import gather_kv_fp8

    cp = emulated
    K = cp.zeros((2, 4, 1, 16), cp.uint8)
    S = cp.zeros((2, 1), cp.float32)
    row = cp.asarray(np.array([1], np.int32))
    kw = dict(block_size=4, block_stride=64, row_stride=16, unit_tokens=4, kv_heads=1, head_dim=16)
    with pytest.raises(ValueError, match=r"gather_kv_fp8: fp8='float8_e4m3'"):
        gather_kv_fp8(K, K, S, S, row, 3, fp8="float8_e4m3", **kw)
    with pytest.raises(ValueError, match=r"gather_kv_fp8: cache dtype=float32, must be uint8"):
        gather_kv_fp8(S, S, S, S, row, 3, fp8="float8_e5m2", **kw)
    with pytest.raises(ValueError, match=r"gather_kv_fp8: scale dtype=uint8, must be float32"):
        gather_kv_fp8(K, K, K, K, row, 3, fp8="float8_e5m2", **kw)
    k, v = gather_kv_fp8(K, K, S, S, row, 0, fp8="float8_e5m2", **kw)
    assert k.shape == v.shape == (0, 1, 16)
