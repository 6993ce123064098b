"""Padding rows (``slot_mapping < 0``) are never read, by any op, in any engine (issue 33).

``spec/slot-cache.md`` §7.1: a token whose ``slot_mapping`` entry is negative is
padding; ``append_kv`` skips it. Skipping means its K/V rows are not read at
all: no non-finite check (§10.2), no scale (no amax), no store. The engines
compared: kvref (NumPy reference), kvfast on the CPU (Numba) and kvfast on
``device="cuda"`` under ``KVFAST_CUDA_EMULATE=1`` (the ``.cu`` kernels compiled
for the host, through the ``emulated`` fixture of ``conftest.py``). Before the
fix every engine refused a NaN in a padding row of an FP8 cache (the policy ran
the non-finite check over all T rows).

Differential checks, per storage dtype (FP8 e4m3fn / e5m2, bfloat16, float16,
float32), mode (paged, contiguous) and input dtype (float32, float64):

* NaN, +-inf and huge finite values in padding rows (leading, middle and
  trailing; also padding query rows): no error, and every stored byte, every
  scale, ``gather_kv`` and the real rows of ``varlen_attention`` equal both the
  other engines' and the same engine's run with zeros in the padding rows;
* a non-finite value in a *real* row: on FP8 the same ``ValueError`` (type and
  message naming the first real token, even with non-finite padding rows
  before it) and nothing written; on the other dtypes the same stored bytes
  (the cast's NaN / inf bits);
* the kernels themselves (``append_kv_fp8`` launchers, float32 / float16 /
  bfloat16-bit inputs) against the reference and Numba engines with NaN
  padding rows.
"""

from __future__ import annotations

import dataclasses
import warnings

import ml_dtypes
import numpy as np
import pytest

import kvfast
import kvfast.ops
import kvref
import kvref.ops
from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec
from kvspec._dtypes import FP8_DTYPES

MODES = [KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS]
DTYPES = ["float8_e4m3fn", "float8_e5m2", "bfloat16", "float16", "float32"]
ENGINES = ("kvref", "kvfast", "cuda")
H, D = 2, 8  # kv heads, head dim (16 elements a row: the kernels' 16-byte vector path)


def host(x) -> np.ndarray:
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


def _bytes(x) -> bytes:
    a = host(x)
    return a.view(np.uint16).tobytes() if a.dtype.name == "bfloat16" else a.view(np.uint8).tobytes()


def make(engine: str, mode, dtype: str):
    cfg = KVCacheConfig(num_layers=2, max_seqs=3, max_seq_len=16, mode=mode, block_size=4, dtype=dtype,
                        device="cuda" if engine == "cuda" else "cpu")
    specs = [KVLayerSpec.attention(H, D), KVLayerSpec.sliding_window(H, D, 3)]
    cache = (kvref if engine == "kvref" else kvfast).KVCache.make(cfg, specs)
    assert type(cache.engine).__name__ == {"kvref": "ReferenceSlotEngine", "kvfast": "FastSlotEngine",
                                           "cuda": "CudaSlotEngine"}[engine]
    return cache


def _ops(engine: str):
    return kvref.ops if engine == "kvref" else kvfast.ops


def _padded(cache, step, pad: np.ndarray):
    """``step`` with the tokens in ``pad`` made padding (``slot_mapping = -1``), on the step's device."""
    sm = host(step.slot_mapping).copy()
    sm[pad] = -1
    if not isinstance(step.slot_mapping, np.ndarray):  # the emulated device's array type
        import cupy

        sm = cupy.asarray(sm)
    return dataclasses.replace(step, slot_mapping=sm)


def state(cache) -> list[bytes]:
    """Every stored K/V byte and (FP8) scale, and the lengths."""
    out = [host(cache.seq_lens()).tobytes()]
    for layer in range(2):
        out += [_bytes(cache.keys(layer)), _bytes(cache.values(layer))]
        if cache.config.dtype in FP8_DTYPES:
            out += [host(s).tobytes() for s in cache.scales(layer)]
    return out


def _poison(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``x`` with NaN, +inf, -inf and a huge finite value spread over ``rows`` (every row gets some)."""
    x = x.copy()
    big = np.finfo(x.dtype).max if x.dtype == np.float64 else np.float32(3e38)
    for i, t in enumerate(rows.tolist()):
        x[t, i % H, :] = (np.nan, np.inf, -np.inf, big)[i % 4]
        x[t, (i + 1) % H, ::2] = (big, -np.inf, np.nan, np.inf)[i % 4]
    return x


#: Three steps on slots 2 and 0: (cu_seqlens_q, padding tokens). Leading, middle and trailing
#: padding; the second step's padding row lands where a huge value would grow a scale.
STEPS = [
    (np.array([0, 6, 9]), np.array([0, 3, 8])),
    (np.array([0, 2, 5]), np.array([1, 2])),
    (np.array([0, 1, 2]), np.array([1])),
]
SLOTS = np.array([2, 0])


def run(engine: str, mode, dtype: str, src, *, poison: bool, emulated=None):
    """Feed :data:`STEPS` to a fresh cache; return its state, gathers and attention (real rows)."""
    cache, ops = make(engine, mode, dtype), _ops(engine)
    rng = np.random.default_rng(7)
    outs = []
    for cu, pad in STEPS:
        T = int(cu[-1])
        past = host(cache.seq_lens())[SLOTS]
        step = _padded(cache, cache.prepare_step(cu, past, SLOTS), pad)
        real = np.setdiff1d(np.arange(T), pad)
        q = rng.standard_normal((T, 2 * H, D)).astype(np.float32)
        if poison:
            q[pad] = np.nan  # a padding token's query is garbage too; real rows must not see it
        for layer in range(2):
            k = (rng.standard_normal((T, H, D)) * 4).astype(src)
            v = (rng.standard_normal((T, H, D)) * 0.25).astype(src)
            if poison:
                k, v = _poison(k, pad), _poison(v, pad[::-1])
            else:
                k[pad], v[pad] = 0, 0
            with warnings.catch_warnings():
                # a cast of a padding row may warn on a CPU engine (NumPy's astype of the whole
                # array); CuPy never warns. Warnings are not part of the contract, results are.
                warnings.simplefilter("ignore", RuntimeWarning)
                ops.append_kv(cache, layer, k, v, step)
            outs.append(host(ops.varlen_attention(q, cache, layer, step))[real])
        for b, s in enumerate(SLOTS.tolist()):
            cache.update_position(s, int(past[b] + cu[b + 1] - cu[b]))
    gathers = [host(x) for layer in range(2) for s in SLOTS.tolist() for x in ops.gather_kv(cache, layer, s)]
    return state(cache), gathers, outs


@pytest.mark.parametrize("src", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name.lower())
@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_rows_change_nothing_in_any_engine(emulated, dtype, mode, src):
    base_state, base_gather, base_att = run("kvref", mode, dtype, src, poison=False)
    for engine in ENGINES:
        got_state, got_gather, got_att = run(engine, mode, dtype, src, poison=True)
        assert got_state == base_state, f"{engine}: stored bytes / scales differ"
        for a, b in zip(got_gather, base_gather):
            assert _bytes(a) == _bytes(b), f"{engine}: gather_kv differs"
        for a, b in zip(got_att, base_att):
            assert np.isfinite(a).all(), f"{engine}: a real query row read a padding row"
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=engine)


# --------------------------------------------------------------------------- non-finite real rows


def _first_step(engine, mode, dtype):
    cache = make(engine, mode, dtype)
    step = cache.prepare_step(np.array([0, 6]), np.array([0]), np.array([1]))
    return cache, _padded(cache, step, np.array([0, 2, 3]))  # real tokens 1, 4, 5


def _outcome(engine, mode, dtype, k, v):
    cache, step = _first_step(engine, mode, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the cast of inf / huge values (not the contract)
        try:
            _ops(engine).append_kv(cache, 0, k, v, step)
        except Exception as e:  # noqa: BLE001 - the type and message are what is compared
            return type(e), str(e), state(cache)
    return None, None, state(cache)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name.lower())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "float64-overflow"])
def test_non_finite_real_row_is_treated_alike(emulated, dtype, mode, where, bad):
    """A real row's non-finite value: FP8 raises §10.2's ``ValueError`` naming the first *real*
    token (4 here: tokens 2 and 3 are padding and non-finite too), writing nothing; other
    dtypes store the cast bits. Identical in every engine."""
    rng = np.random.default_rng(1)
    k = rng.standard_normal((6, H, D))
    v = rng.standard_normal((6, H, D))
    x = k if where == "k" else v
    value = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "float64-overflow": 1e300}[bad]
    x[[0, 2, 3], 1, 5] = np.nan  # padding rows: never read
    x[4, 1, 3] = value  # the first real non-finite row (float64 1e300 becomes inf in float32)
    x[5, 0, 0] = np.inf
    if bad != "float64-overflow":
        k, v = k.astype(np.float32), v.astype(np.float32)
    results = {e: _outcome(e, mode, dtype, k, v) for e in ENGINES}
    ref = results["kvref"]
    fp8 = dtype in FP8_DTYPES
    if fp8:
        assert ref[0] is ValueError
        assert ref[1] == f"append_kv: {where}[4] has a non-finite value, FP8 storage needs finite inputs"
        assert ref[2] == state(make("kvref", mode, dtype)), "a refused append wrote something"
    else:
        assert ref[0] is None
    for engine in ENGINES[1:]:
        got = results[engine]
        assert got[:2] == ref[:2], engine
        assert got[2] == ref[2], f"{engine}: stored bytes differ"


def test_real_rows_between_non_finite_padding_runs(emulated):
    """The first real non-finite token is found past several non-finite padding runs, in every engine."""
    T = 12
    pad = np.array([0, 1, 3, 4, 6, 9, 10, 11])
    k = np.ones((T, H, D), np.float32)
    k[pad] = np.nan
    for first in (None, 2, 5, 7, 8):  # None: only the padding rows are non-finite
        kk = k.copy()
        if first is not None:
            kk[first, 0, 0] = np.inf
            kk[8, 1, 1] = np.nan
        msgs = set()
        for engine in ENGINES:
            cache = make(engine, KVCacheMode.CONTIGUOUS, "float8_e4m3fn")
            step = _padded(cache, cache.prepare_step(np.array([0, T]), np.array([0]), np.array([0])), pad)
            try:
                _ops(engine).append_kv(cache, 0, kk, np.ones_like(kk), step)
                msgs.add(None)
            except ValueError as e:
                msgs.add(str(e))
        want = None if first is None else f"append_kv: k[{first}] has a non-finite value, FP8 storage needs finite inputs"
        assert msgs == {want}


# --------------------------------------------------------------------------- the kernels


@pytest.mark.parametrize("fp8", sorted(FP8_DTYPES))
@pytest.mark.parametrize("inp", ["float32", "float16", "bfloat16"])
def test_fp8_kernels_never_read_padding_rows(emulated, fp8, inp):
    """``append_kv_fp8.cu`` (through its launcher, paged geometry) with NaN / inf / huge padding
    rows stores what the reference and Numba engines store with the same rows."""
    from kvfast._cuda.append_kv_fp8 import append_kv_fp8
    from kvfast._slot_engine import FastSlotEngine

    cp = emulated
    NB, P, T = 5, 4, 9
    rng = np.random.default_rng(5)
    sm = np.array([-1, 4, 5, -7, 9, 13, -1, 17, -1], np.int64)
    pad = np.flatnonzero(sm < 0)
    k = (rng.standard_normal((T, H, D)) * 3).astype(np.float32)
    v = (rng.standard_normal((T, H, D)) * 0.1).astype(np.float32)
    k, v = _poison(k, pad), _poison(v, pad)
    if inp == "float16":
        with np.errstate(over="ignore"):
            k, v = k.astype(np.float16), v.astype(np.float16)
    elif inp == "bfloat16":
        k, v = k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16)
    k32, v32 = k.astype(np.float32), v.astype(np.float32)  # exact widening (the engines' float32 inputs)
    want = []
    for eng in (kvref.ReferenceSlotEngine(), FastSlotEngine(1)):
        K, V = np.zeros((NB, P, H, D), FP8_DTYPES[fp8]), np.zeros((NB, P, H, D), FP8_DTYPES[fp8])
        Ks, Vs = np.zeros((NB, H), np.float32), np.zeros((NB, H), np.float32)
        assert eng.scatter_kv_fp8(K, V, Ks, Vs, k32, v32, sm, P) == -1
        want.append((K.view(np.uint8).tobytes(), V.view(np.uint8).tobytes(), Ks.tobytes(), Vs.tobytes()))
    assert want[0] == want[1]
    assert np.isfinite(np.frombuffer(want[0][2], np.float32)).all()
    dev = [cp.asarray(x.view(np.uint16)) if inp == "bfloat16" else cp.asarray(x) for x in (k, v)]
    K, V = cp.zeros((NB, P, H, D), cp.uint8), cp.zeros((NB, P, H, D), cp.uint8)
    Ks, Vs = cp.zeros((NB, H), cp.float32), cp.zeros((NB, H), cp.float32)
    append_kv_fp8(dev[0], dev[1], K, V, Ks, Vs, cp.asarray(sm), fp8=fp8, block_size=P, block_stride=P * H * D,
                  row_stride=H * D, unit_tokens=P, bfloat16_input=inp == "bfloat16")
    assert (K.get().tobytes(), V.get().tobytes(), Ks.get().tobytes(), Vs.get().tobytes()) == want[0]
