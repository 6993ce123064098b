"""Torch in, torch out; the ``bhsd`` layout; the down-cast rule; ``gather_step`` (spec/slot-cache.md §7).

Every test runs the same calls through kvref, kvfast on the CPU and kvfast on the emulated CUDA
device (``KVFAST_CUDA_EMULATE=1``) and compares bytes: the policy is kvref's, the engines differ.
"""

from __future__ import annotations


import ml_dtypes
import numpy as np
import pytest

import kvfast
import kvref
from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec

torch = pytest.importorskip("torch")

H, D, HQ = 2, 8, 4
SPECS = [KVLayerSpec.attention(H, D), KVLayerSpec.sliding_window(H, D, window=3),
         KVLayerSpec.cross_attention(H, D, max_enc_len=5)]


def _host(x):
    """NumPy of a result: torch (bfloat16 as ml_dtypes), CuPy/emulated (``.get()``), NumPy."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    if not isinstance(x, np.ndarray):
        return x.get()
    return x


def _make(pkg, mode, dtype="float32", device="cpu"):
    cfg = KVCacheConfig(num_layers=3, max_seqs=3, max_seq_len=16, mode=mode, block_size=4, dtype=dtype,
                        device=device)
    return pkg.KVCache.make(cfg, SPECS)


def _engines(emulated_cp=None):
    out = [("kvref", kvref, "cpu"), ("kvfast", kvfast, "cpu")]
    if emulated_cp is not None:
        out.append(("kvfast-cuda", kvfast, "cuda:0"))
    return out


def _bytes(cache, layer):
    return _host(cache.keys(layer)).tobytes() + _host(cache.values(layer)).tobytes()


def _step(cache, q_lens, past, slots):
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    return cache.prepare_step(cu, np.asarray(past, np.int64), np.asarray(slots, np.int64))


def _bhsd(x_thd, B, S):
    """transformers' ``[B, H, S, D]`` of a packed ``[B * S, H, D]`` (``view(B, S, H, D).transpose(1, 2)``)."""
    return x_thd.reshape(B, S, *x_thd.shape[1:]).transpose(1, 2)


@pytest.fixture
def engines(emulated):
    return _engines(emulated)


@pytest.mark.parametrize("mode", [KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn"])
def test_bhsd_equals_thd_in_every_engine(engines, mode, dtype):
    B, S = 2, 3
    g = torch.Generator().manual_seed(1)
    k, v, q = (torch.randn(B * S, h, D, generator=g) for h in (H, H, HQ))
    want = None
    for name, pkg, device in engines:
        a, b = _make(pkg, mode, dtype, device), _make(pkg, mode, dtype, device)
        sa, sb = _step(a, [S] * B, [0] * B, [2, 0]), _step(b, [S] * B, [0] * B, [2, 0])
        pkg.ops.append_kv(a, 0, k, v, sa)
        pkg.ops.append_kv(b, 0, _bhsd(k, B, S), _bhsd(v, B, S), sb, layout="bhsd")
        assert _bytes(a, 0) == _bytes(b, 0), f"{name}: bhsd append differs from thd"
        oa = pkg.ops.varlen_attention(q, a, 0, sa)
        ob = pkg.ops.varlen_attention(_bhsd(q, B, S), b, 0, sb, layout="bhsd")
        assert isinstance(oa, torch.Tensor) and isinstance(ob, torch.Tensor), f"{name}: torch q, torch out"
        assert ob.shape == (B, HQ, S, D) and oa.dtype == ob.dtype == torch.float32
        assert torch.equal(ob.transpose(1, 2).reshape(B * S, HQ, D), oa), f"{name}: bhsd attention differs"
        got = (_bytes(a, 0), oa.numpy().tobytes())
        want = want or got
        assert got[0] == want[0], f"{name}: storage differs from kvref's"
        np.testing.assert_allclose(oa.numpy(), np.frombuffer(want[1], np.float32).reshape(oa.shape), rtol=1e-5,
                                   atol=1e-6, err_msg=name)


def test_bhsd_of_transformers_memory_is_read_without_a_copy():
    from kvref.ops import _tokens_input

    B, S = 3, 2
    mem = torch.randn(B, S, H, D)                       # what q_proj(x).view(B, S, H, D) holds
    x = mem.transpose(1, 2)                             # transformers' [B, H, S, D]
    got, shape = _tokens_input("append_kv", "k", x, "bhsd", B * S)
    assert shape == (B, S) and got.shape == (B * S, H, D)
    assert np.shares_memory(got, mem.numpy()), "the packed step is a view of the tensor's memory"
    bf = mem.to(torch.bfloat16).transpose(1, 2)
    got, _ = _tokens_input("append_kv", "k", bf, "bhsd", B * S)
    assert got.dtype.name == "bfloat16" and got.ctypes.data == bf.data_ptr()


def test_outputs_follow_the_query_kind_and_out_dtype():
    c = _make(kvfast, KVCacheMode.PAGED)
    st = _step(c, [3, 1], [0, 0], [0, 1])
    rng = np.random.default_rng(2)
    k, v, q = (rng.standard_normal((4, h, D)).astype(np.float32) for h in (H, H, HQ))
    kvfast.ops.append_kv(c, 0, k, v, st)
    ref = kvfast.ops.varlen_attention(q, c, 0, st)
    assert type(ref) is np.ndarray and ref.dtype == np.float32  # NumPy in, NumPy float32 out: as before
    tq = torch.from_numpy(q).to(torch.bfloat16)
    out32 = kvfast.ops.varlen_attention(tq, c, 0, st)
    assert out32.dtype == torch.float32 and out32.device.type == "cpu"
    np.testing.assert_allclose(out32.numpy(), kvfast.ops.varlen_attention(tq.float().numpy(), c, 0, st), rtol=0,
                               atol=0)
    bf = kvfast.ops.varlen_attention(tq, c, 0, st, out_dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf, out32.to(torch.bfloat16))  # rounded once
    half = kvfast.ops.varlen_attention(q, c, 0, st, out_dtype="float16")
    assert half.dtype == np.float16 and np.array_equal(half, ref.astype(np.float16))
    nb = kvfast.ops.varlen_attention(q, c, 0, st, out_dtype="bfloat16")
    assert nb.dtype == ml_dtypes.bfloat16 and np.array_equal(nb.view(np.uint16),
                                                             ref.astype(ml_dtypes.bfloat16).view(np.uint16))
    with pytest.raises(ValueError, match=r"varlen_attention: out_dtype='int8', must be None"):
        kvfast.ops.varlen_attention(q, c, 0, st, out_dtype="int8")
    K, V = kvfast.ops.gather_kv(c, 0, 0, like=tq)
    assert isinstance(K, torch.Tensor) and K.shape == (0, H, D)
    with pytest.raises(TypeError, match=r"gather_kv: like=list, must be a torch.Tensor"):
        kvfast.ops.gather_kv(c, 0, 0, like=[1])


@pytest.mark.parametrize("fp8", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_tensors_are_widened_exactly(engines, fp8):
    g = torch.Generator().manual_seed(3)
    k8, v8 = (torch.randn(4, H, D, generator=g).to(getattr(torch, fp8)) for _ in range(2))
    for name, pkg, device in engines:
        for dtype in ("float16", "bfloat16", "float8_e4m3fn"):
            a, b = _make(pkg, KVCacheMode.PAGED, dtype, device), _make(pkg, KVCacheMode.PAGED, dtype, device)
            sa, sb = _step(a, [4], [0], [1]), _step(b, [4], [0], [1])
            pkg.ops.append_kv(a, 0, k8, v8, sa)
            pkg.ops.append_kv(b, 0, k8.float().numpy(), v8.float().numpy(), sb)
            assert _bytes(a, 0) == _bytes(b, 0), f"{name} {dtype}: an FP8 input is its float32 values"
            q8 = torch.randn(4, HQ, D, generator=g).to(getattr(torch, fp8))
            assert torch.equal(pkg.ops.varlen_attention(q8, a, 0, sa),
                               pkg.ops.varlen_attention(q8.float(), a, 0, sa)), name


def test_layout_errors_name_the_argument_and_change_nothing(engines):
    for name, pkg, device in engines:
        c = _make(pkg, KVCacheMode.PAGED, "float16", device)
        st = _step(c, [2, 2], [0, 0], [0, 1])
        before = _bytes(c, 0)
        k = np.ones((4, H, D), np.float32)
        with pytest.raises(ValueError, match=r"append_kv: layout='bshd', must be 'thd' or 'bhsd'"):
            pkg.ops.append_kv(c, 0, k, k, st, layout="bshd")
        with pytest.raises(ValueError, match=r"append_kv: k.ndim=3, must be 4 \[batch, heads, seq, head_dim\]"):
            pkg.ops.append_kv(c, 0, k, k, st, layout="bhsd")
        with pytest.raises(ValueError, match=r"batch\*seq=6 tokens != step.num_tokens=4"):
            pkg.ops.append_kv(c, 0, np.ones((2, H, 3, D)), np.ones((2, H, 3, D)), st, layout="bhsd")
        with pytest.raises(ValueError, match=r"append_kv: k.shape\[1\]=4 != kv_heads=2"):
            pkg.ops.append_kv(c, 0, np.ones((2, 4, 2, D)), np.ones((2, 4, 2, D)), st, layout="bhsd")
        with pytest.raises(ValueError, match=r"varlen_attention: layout=None, must be 'thd' or 'bhsd'"):
            pkg.ops.varlen_attention(np.ones((4, HQ, D)), c, 0, st, layout=None)
        with pytest.raises(TypeError, match=r"append_kv: k dtype=int64, must be a floating type"):
            pkg.ops.append_kv(c, 0, torch.ones(4, H, D, dtype=torch.int64), k, st)
        assert _bytes(c, 0) == before, f"{name}: a refused append wrote"


# ----------------------------------------------------------------------------- the down-cast rule (§7.1)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 70000 -> float16 inf, on purpose
def test_downcast_rounds_once_to_nearest_even(engines):
    """spec/slot-cache.md §7.1: a float32 input into a float16 / bfloat16 cache is accepted and
    rounded once to nearest even (float16 overflow to inf), bit-equal in every engine."""
    one = np.float32(1.0)
    ties = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 70000.0, -1e-9, 3.0e38, 0.1],
                    np.float32)
    x = np.resize(ties, (1, H, D)) * one
    want = {"bfloat16": x.astype(ml_dtypes.bfloat16).view(np.uint16),
            "float16": x.astype(np.float16).view(np.uint16)}
    assert want["bfloat16"][0, 0, 0] == np.array(1.0, ml_dtypes.bfloat16).view(np.uint16)  # tie to even: down
    assert want["bfloat16"][0, 0, 1] == np.array(1 + 2.0**-6, ml_dtypes.bfloat16).view(np.uint16)  # tie: up
    assert np.isinf(x.astype(np.float16)[0, 0, 4])
    for name, pkg, device in engines:
        for dtype, bits in want.items():
            c = _make(pkg, KVCacheMode.CONTIGUOUS, dtype, device)
            st = _step(c, [1], [0], [0])
            pkg.ops.append_kv(c, 0, torch.from_numpy(x), x, st)
            K = _host(c.keys(0))[0, :1]
            V = _host(c.values(0))[0, :1]
            assert K.view(np.uint16).tobytes() == bits.tobytes(), f"{name} {dtype}: K not rounded once (RNE)"
            assert V.view(np.uint16).tobytes() == bits.tobytes(), f"{name} {dtype}: V not rounded once (RNE)"


# ----------------------------------------------------------------------------- gather_step


def _history(pkg, device, mode, dtype):
    """A cache with two rows of history (prefill committed, one decode token appended) and what it holds."""
    c = _make(pkg, mode, dtype, device)
    rng = np.random.default_rng(4)
    pre = [5, 2]
    st = _step(c, pre, [0, 0], [1, 2])
    k1, v1 = (rng.standard_normal((sum(pre), H, D)).astype(np.float32) for _ in range(2))
    pkg.ops.append_kv(c, 0, k1, v1, st)
    c.update_position(1, 5)
    c.update_position(2, 2)
    st2 = _step(c, [1, 3], [5, 2], [1, 2])
    k2, v2 = (rng.standard_normal((4, H, D)).astype(np.float32) for _ in range(2))
    pkg.ops.append_kv(c, 0, k2, v2, st2)
    rows_k = [np.concatenate([k1[:5], k2[:1]]), np.concatenate([k1[5:], k2[1:]])]
    rows_v = [np.concatenate([v1[:5], v2[:1]]), np.concatenate([v1[5:], v2[1:]])]
    return c, st2, rows_k, rows_v


@pytest.mark.parametrize("mode", [KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e5m2"])
def test_gather_step_padded_and_packed(engines, mode, dtype):
    seen = []
    for name, pkg, device in engines:
        c, st, rows_k, rows_v = _history(pkg, device, mode, dtype)
        K, V, lengths = pkg.ops.gather_step(c, 0, st)
        Kp, Vp, cu = pkg.ops.gather_step(c, 0, st, padded=False)
        K, V, lengths, Kp, Vp, cu = map(_host, (K, V, lengths, Kp, Vp, cu))
        assert lengths.tolist() == [6, 5] and lengths.dtype == np.int32, name
        assert cu.tolist() == [0, 6, 11] and cu.dtype == np.int32, name
        assert K.shape == (2, 6, H, D) and Kp.shape == (11, H, D), name
        assert not K[1, 5:].astype(np.float32).any(), f"{name}: padding is zero"
        for b, (rk, rv) in enumerate(zip(rows_k, rows_v)):
            n = len(rk)
            assert Kp[cu[b]:cu[b + 1]].tobytes() == K[b, :n].tobytes(), name
            assert Vp[cu[b]:cu[b + 1]].tobytes() == V[b, :n].tobytes(), name
            if dtype == "float32":
                assert np.array_equal(K[b, :n], rk) and np.array_equal(V[b, :n], rv), name
            elif dtype == "bfloat16":
                # (CuPy's bfloat16 is its uint16 bit patterns)
                assert K[b, :n].view(np.uint16).tobytes() == rk.astype(ml_dtypes.bfloat16).view(np.uint16).tobytes()
            else:  # FP8: float32, dequantised exactly as gather_kv reads
                assert K.dtype == np.float32
                np.testing.assert_allclose(K[b, :n], rk, rtol=0.26, atol=0.3, err_msg=name)
        # after commit, a row's padded history equals gather_kv of its slot
        seen.append((K.tobytes(), Kp.tobytes()))
        tk = torch.zeros(1)
        Kt, Vt, lt = pkg.ops.gather_step(c, 0, st, like=tk)
        assert isinstance(Kt, torch.Tensor) and isinstance(lt, torch.Tensor) and lt.tolist() == [6, 5], name
        assert _host(Kt).tobytes() == K.tobytes(), name
    assert all(s == seen[0] for s in seen), "engines disagree on gather_step bytes"


def test_gather_step_cross_layer_and_errors():
    for pkg in (kvref, kvfast):
        c = _make(pkg, KVCacheMode.PAGED)
        enc = np.arange(3 * H * D, dtype=np.float32).reshape(3, H, D)
        c.fill(2, 1, enc, enc + 1)
        st = _step(c, [1, 1], [0, 0], [1, 0])
        with pytest.raises(TypeError, match=r"gather_step: padded=1, must be a bool"):
            pkg.ops.gather_step(c, 2, st, padded=1)
        with pytest.raises(TypeError, match=r"gather_step: step=list, must be the StepIndices"):
            pkg.ops.gather_step(c, 2, [])
        with pytest.raises(IndexError, match=r"gather_step: layer=3 out of range \[0, 3\)"):
            pkg.ops.gather_step(c, 3, st)
        K, V, lengths = pkg.ops.gather_step(c, 2, st)
        assert lengths.tolist() == [3, 0] and np.array_equal(K[0], enc) and not K[1].any()
        Kp, Vp, cu = pkg.ops.gather_step(c, 2, st, padded=False)
        assert cu.tolist() == [0, 3, 3] and np.array_equal(Vp, enc + 1)
