"""The CuPy launchers of ``kvfast/kernels/*.cu`` against NumPy (needs a CUDA device).

Every test is marked ``gpu`` and skips with a reason when CuPy or a device is
missing; without a GPU the kernels are still compiled by
``test_kvfast_nvrtc.py`` and run on the host by ``test_kernel_harness.py``.
"""

import numpy as np
import pytest

DTYPES = ["float16", "bfloat16", "float32"]


def _cupy():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:
        pass
    return None


cp = _cupy()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cp is None, reason="no CUDA device visible (CuPy absent or no GPU)")]


def _np_dtype(name):
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _dev(a):
    """Host -> device; bfloat16 travels as its uint16 bit patterns (CuPy has no bfloat16)."""
    return cp.asarray(a.view(np.uint16) if a.dtype.name == "bfloat16" else a)


def _bits(a):
    """Device or host array -> bytes (bit patterns)."""
    return (cp.asnumpy(a) if not isinstance(a, np.ndarray) else a).tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_append_and_gather_launchers(dtype):  # pragma: no cover - needs a GPU
    from kvfast._cuda.append_kv import append_kv
    from kvfast._cuda.gather_kv import gather_kv

    dt = _np_dtype(dtype)
    rng = np.random.default_rng(0)
    nb, bs, h, d = 6, 4, 2, 24
    kc = rng.standard_normal((nb, bs, h, d)).astype(dt)
    vc = rng.standard_normal((nb, bs, h, d)).astype(dt)
    key = rng.standard_normal((5, h, d)).astype(dt)
    val = rng.standard_normal((5, h, d)).astype(dt)
    sm = np.array([5, -1, 17, 4, 22], np.int64)
    want_k, want_v = kc.copy().reshape(-1, h, d), vc.copy().reshape(-1, h, d)
    keep = sm >= 0
    want_k[sm[keep]] = key[keep]
    want_v[sm[keep]] = val[keep]
    dk, dv = _dev(kc), _dev(vc)
    append_kv(_dev(key), _dev(val), dk, dv, cp.asarray(sm), block_size=bs, block_stride=bs * h * d,
              row_stride=h * d, threads=32)
    assert _bits(dk) == want_k.tobytes() and _bits(dv) == want_v.tobytes()
    row = cp.asarray(np.array([1, 4, 5, 0], np.int32))
    gk, gv = gather_kv(dk, dv, row, 10, block_size=bs, block_stride=bs * h * d, row_stride=h * d, kv_heads=h,
                       head_dim=d)
    pool_k = want_k.reshape(nb, bs, h, d)
    assert _bits(gk) == np.concatenate([pool_k[1], pool_k[4], pool_k[5]])[:10].tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_stage_and_state_launchers(dtype):  # pragma: no cover - needs a GPU
    from kvfast._cuda.copy_blocks import copy_blocks
    from kvfast._cuda.stage import stage_gather, stage_scatter
    from kvfast._cuda.state import state_copy_rows, state_zero_rows

    dt = _np_dtype(dtype)
    rng = np.random.default_rng(1)
    buf = rng.standard_normal((7, 2, 2, 4, 1, 8)).astype(dt)
    other = rng.standard_normal((7, 2, 2, 4, 1, 8)).astype(dt)
    d_buf, d_other = _dev(buf), _dev(other)
    copy_blocks(d_buf, d_other, cp.asarray(np.array([[1, 3], [2, 6]], np.int64)))
    want = other.copy()
    want[3], want[6] = buf[1], buf[2]
    assert _bits(d_other) == want.tobytes()
    staging = cp.empty((2, *buf.shape[1:]), d_buf.dtype)
    stage_gather(d_buf, staging, cp.asarray(np.array([5, 2], np.int64)))
    assert _bits(staging) == np.stack([buf[5], buf[2]]).tobytes()
    stage_scatter(staging, d_other, cp.asarray(np.array([0, 1], np.int64)))
    want[0], want[1] = buf[5], buf[2]
    assert _bits(d_other) == want.tobytes()
    slab = _dev(rng.standard_normal((3, 4, 5)).astype(dt))
    ckpt = cp.zeros((2, 4, 5), slab.dtype)
    state_copy_rows(slab, ckpt, np.array([2], np.int64), np.array([1], np.int64))
    assert _bits(ckpt[1]) == _bits(slab[2])
    state_zero_rows(slab, np.array([0, 2], np.int64))
    assert not cp.asnumpy(slab[0]).view(np.uint8).any() and not cp.asnumpy(slab[2]).view(np.uint8).any()


def test_cuda_slot_cache_end_to_end():  # pragma: no cover - needs a GPU
    import kvfast
    import kvref
    from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec

    specs = [KVLayerSpec.attention(2, 8)]
    base = dict(num_layers=1, max_seqs=2, max_seq_len=16, mode=KVCacheMode.PAGED, block_size=4)
    r = kvref.KVCache.make(KVCacheConfig(**base), specs)
    f = kvfast.KVCache.make(KVCacheConfig(**base, device="cuda"), specs)
    k = np.random.default_rng(2).standard_normal((6, 2, 8)).astype(np.float32)
    q = np.random.default_rng(3).standard_normal((6, 2, 8)).astype(np.float32)
    sr = r.prepare_step([0, 4, 6], [0, 0], [0, 1])
    sf = f.prepare_step([0, 4, 6], [0, 0], [0, 1])
    kvref.ops.append_kv(r, 0, k, k, sr)
    kvfast.ops.append_kv(f, 0, cp.asarray(k), cp.asarray(k), sf)
    assert _bits(f.keys(0)) == r.keys(0).tobytes()
    a = kvref.ops.varlen_attention(q, r, 0, sr)
    b = cp.asnumpy(kvfast.ops.varlen_attention(cp.asarray(q), f, 0, sf))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# The device="cuda" checks CI runs on the emulated device (tests/test_kvfast_cuda_emulated.py),
# here on the real one: same bodies, the real CuPy.


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_ops_match_kvref_every_dtype(dtype):  # pragma: no cover - needs a GPU
    from kvspec import KVCacheMode
    from test_kvfast_cuda_emulated import test_ops_on_cuda_match_kvref

    for mode in (KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS):
        for src in ("float32", "float64", "same"):
            test_ops_on_cuda_match_kvref(cp, dtype, mode, src)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_tiered_manager_reloads_written_bytes(dtype, tmp_path):  # pragma: no cover - needs a GPU
    from test_kvfast_cuda_emulated import test_tiered_manager_on_cuda_offloads_evicts_and_reloads as body

    body(cp, tmp_path, dtype)


def test_cuda_manager_differential_machine():  # pragma: no cover - needs a GPU
    from hypothesis.stateful import run_state_machine_as_test

    from kvfast._backend import conformance_backend
    from kvspec.conformance.manager_machine import ManagerComparison

    run_state_machine_as_test(ManagerComparison.for_backend(conformance_backend().on_device("cuda:0")))


def test_cuda_page_store_round_trip():  # pragma: no cover - needs a GPU
    from test_kvfast_cuda_emulated import test_cuda_page_store

    test_cuda_page_store(cp)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("head_dim", [16, 5])
def test_cuda_fp8_gather_decodes_every_bit_pattern(name, head_dim):  # pragma: no cover - needs a GPU
    from test_slot_fp8 import test_the_dequantising_gather_kernel_decodes_every_bit_pattern as body

    body(cp, name, head_dim)


def test_cuda_fp8_slot_cache_stores_the_reference_bytes_and_attends_exactly():  # pragma: no cover - needs a GPU
    from test_slot_fp8 import test_emulated_cuda_stores_the_reference_bytes_and_attends_exactly as body

    body(cp)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cuda_softcap_and_sinks_match_the_oracle(dtype):  # pragma: no cover - needs a GPU
    """spec/slot-cache.md §7.3 on the real device: ``paged_attention.cu`` and the CuPy slot engine
    with soft-capped scores and sink logits (the emulated run's bodies)."""
    import kvfast
    import kvref
    from kvspec import KVCacheMode
    from test_attention_softcap_sinks_kvfast import CASES, Engine, _run_paged, _run_slots

    engines = [Engine("kvref", kvref.ops), Engine("kvfast-cuda", kvfast.ops, cp)]
    for case in CASES:
        softcap, with_sinks = case.values
        _run_paged(engines, dtype, softcap=softcap, with_sinks=with_sinks)
        _run_paged(engines, dtype, window=3, softcap=softcap, with_sinks=with_sinks)
        for mode in (KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS):
            _run_slots(cp, dtype, mode, softcap=softcap, with_sinks=with_sinks)
