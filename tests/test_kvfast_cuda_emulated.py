"""kvfast's ``device="cuda"`` paths run in CI on the emulated device (``KVFAST_CUDA_EMULATE=1``).

The ``emulated`` fixture sets the variable and registers
:mod:`kvfast._cuda.emulate` as ``cupy`` for one test (what ``import cupy``
gives after ``import kvfast`` with the variable set), and undoes both, so the
rest of the session sees the machine as it is. The emulated
CuPy copies on ``asarray``, refuses implicit device-to-host conversion and
host arrays in device operations, and runs the ``.cu`` kernels compiled for
the host (``kvfast._cuda.harness``) with their launch configuration, so what
passes here ran the CUDA launchers' real argument lists and geometry.
Compared with kvref after every operation: the conformance state machines
(slot cache and manager, tiers included) on ``cuda:0``, a tiered manager that
offloads, evicts and reloads, and bfloat16 caches fed float32.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

import kvfast
import kvref
from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec


def _is_pinned(cp, arr: np.ndarray) -> bool:
    """Page-locked host memory: the emulator's registry, or the CUDA runtime's pointer attributes."""
    if getattr(cp, "KVFAST_EMULATED", False):
        from kvfast._cuda import emulate

        return emulate.is_pinned(arr)
    return cp.cuda.runtime.pointerGetAttributes(arr.ctypes.data).type == 1  # pragma: no cover - cudaMemoryTypeHost


def _run(code: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("KVFAST_CUDA_EMULATE")}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)


# --------------------------------------------------------------------------- selection


def test_variable_selects_emulation_and_nothing_else_does():
    code = ("import sys, kvfast\n"
            "assert 'cupy' not in sys.modules  # import kvfast loads no cupy, emulated or not\n"
            "try:\n    import cupy\n    print(getattr(cupy, 'KVFAST_EMULATED', False))\n"
            "except ImportError:\n    print(False)\n")
    on = _run(code, KVFAST_CUDA_EMULATE="1")
    assert on.returncode == 0, on.stderr
    assert on.stdout.strip() == "True"
    off = _run(code)
    assert off.returncode == 0, off.stderr
    assert off.stdout.strip() == "False"


def test_info_states_emulation(emulated, monkeypatch, capsys):
    from kvcache.cli import main

    assert main(["info"]) == 0
    on = capsys.readouterr().out
    assert "cuda emulation: ON (KVFAST_CUDA_EMULATE=1)" in on and "emulated CUDA device" in on
    monkeypatch.delenv("KVFAST_CUDA_EMULATE")
    monkeypatch.setattr("kvcache.cli.gpu_status", lambda: (False, "CuPy is not installed"))
    assert main(["info"]) == 0
    assert "emulat" not in capsys.readouterr().out


# --------------------------------------------------------------------------- the stand-in itself


def test_emulated_cupy_keeps_cupy_rules(emulated):
    cp = emulated
    host = np.arange(6, dtype=np.float32)
    dev = cp.asarray(host)
    host[0] = 99.0
    assert float(dev[0]) == 0.0  # asarray copied
    assert cp.asarray(dev) is dev
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(dev)
    with pytest.raises(TypeError, match="Unsupported type"):
        dev + np.ones(6, np.float32)
    with pytest.raises(TypeError, match="incorrect type"):
        cp.ascontiguousarray(host)
    with pytest.raises(ValueError, match="Unsupported dtype bfloat16"):
        cp.asarray(np.zeros(3, ml_dtypes.bfloat16))
    assert isinstance(dev.sum(), cp.ndarray) and dev.sum().ndim == 0  # reductions stay on the device
    assert dev.get().tobytes() == np.arange(6, dtype=np.float32).tobytes()
    out = np.empty(6, np.float32)
    with pytest.raises(ValueError, match="mismatch"):
        dev.get(out=np.empty(5, np.float32))
    assert dev.get(out=out) is out


def test_emulated_raw_kernel_checks_arguments(emulated):
    from kvfast._cuda._sources import source

    cp = emulated
    k = cp.RawModule(code=source("state.cu")).get_function("state_zero_kernel_u16")
    dst = cp.asarray(np.ones((4, 8), np.uint16))
    rows = cp.asarray(np.array([2, 0], np.int64))
    with pytest.raises(TypeError, match="device pointer"):
        k((2, 1), (32,), (np.ones((4, 8), np.uint16), rows, cp.int64(2), cp.int64(8)))
    with pytest.raises(TypeError, match="2-byte elements"):
        k((2, 1), (32,), (cp.asarray(np.ones((4, 8), np.float32)), rows, cp.int64(2), cp.int64(8)))
    with pytest.raises(TypeError, match="8-byte integer"):
        k((2, 1), (32,), (dst, rows, cp.int32(2), cp.int64(8)))
    assert dst.get().sum() == 32  # nothing ran
    k((2, 1), (32,), (dst, rows, cp.int64(2), 8))
    want = np.ones((4, 8), np.uint16)
    want[[2, 0]] = 0
    assert dst.get().tobytes() == want.tobytes()
    with pytest.raises(RuntimeError, match="only the sources of kvfast"):
        cp.RawModule(code="extern \"C\" __global__ void f() {}")


@pytest.mark.parametrize("src", ["float32", "float64", "float16"])
def test_bf16_bits_equal_ml_dtypes(emulated, src):
    from kvfast._cuda.convert import float_to_bf16_bits

    cp = emulated
    rng = np.random.default_rng(1)
    if src == "float32":
        x = np.concatenate([rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
                            ((np.arange(2**16, dtype=np.uint32) << 16) | 0x8000).view(np.float32)])  # every tie
    elif src == "float64":
        with np.errstate(invalid="ignore", over="ignore"):
            ties = ((np.arange(2**16, dtype=np.uint32) << 16) | 0x8000).view(np.float32).astype(np.float64)
            x = np.concatenate([rng.integers(0, 2**64, 100_000, dtype=np.uint64).view(np.float64),
                                ties * (1 + 2.0**-40), ties * (1 - 2.0**-40), [1 + 2**-8 + 2**-30, 3.5e38, 1e-41]])
    else:
        x = np.arange(2**16, dtype=np.uint16).view(np.float16)  # every float16
    with np.errstate(invalid="ignore", over="ignore"):
        want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN and out-of-range float64 inputs, on purpose
        got = float_to_bf16_bits(cp.asarray(x)).get()
    assert got.tobytes() == want.tobytes()


# --------------------------------------------------------------------------- CudaPageStore


def test_cuda_page_store(emulated):
    from kvfast._cuda.page_store import CudaPageStore
    from kvspec import PageStore

    cp = emulated
    host = np.random.default_rng(2).standard_normal((6, 2, 3, 4, 5)).astype(np.float16)
    buf = cp.asarray(host)
    ps = CudaPageStore(buf)
    assert isinstance(ps, PageStore) and ps.holds_bytes
    assert (ps.num_pages, ps.page_nbytes) == (6, 2 * 3 * 4 * 5 * 2)
    got = ps.read([3, 1, 3])
    assert got.dtype == np.uint8 and got.shape == (3, ps.page_nbytes)
    assert got.tobytes() == host[[3, 1, 3]].tobytes()
    assert _is_pinned(cp, got)
    arena = ps.alloc_host(4)
    assert arena.shape == (4, ps.page_nbytes) and not arena.any() and _is_pinned(cp, arena)
    kept = got.copy()
    ps.write([0, 5], got[:2].copy())
    assert got.tobytes() == kept.tobytes()  # a write never overwrites the last read's result
    host[[0, 5]] = host[[3, 1]]
    assert buf.get().tobytes() == host.tobytes()
    before = buf.get().tobytes()
    with pytest.raises(IndexError, match=r"block_ids\[1\]=6 out of range \[0, 6\)"):
        ps.write([1, 6], got[:2].copy())
    with pytest.raises(ValueError, match="repeats a page"):
        ps.write([1, 1], got[:2].copy())
    with pytest.raises(ValueError, match="data.nbytes=240 != len"):
        ps.write([1, 2], got[:1].copy())
    with pytest.raises(TypeError, match="must be a cupy.ndarray"):
        CudaPageStore(host)
    with pytest.raises(ValueError, match="alloc_host: num_pages=-1 < 0"):
        ps.alloc_host(-1)
    assert buf.get().tobytes() == before  # failed calls changed nothing
    assert ps.read([]).shape == (0, ps.page_nbytes)
    odd = cp.asarray(np.arange(5 * 3, dtype=np.uint8).reshape(5, 3))  # 3-byte pages: u8 staging words
    ops = CudaPageStore(odd)
    assert ops.read([4]).tobytes() == bytes([12, 13, 14])


# --------------------------------------------------------------------------- slot cache and ops on cuda


def _pair(dtype, mode, specs, **kw):
    cfg = KVCacheConfig(num_layers=len(specs), max_seqs=3, max_seq_len=24, mode=mode, block_size=4, dtype=dtype,
                        **kw)
    return (kvfast.KVCache.make(dataclasses.replace(cfg, device="cuda"), specs),
            kvref.KVCache.make(cfg, specs))


def _bits(x):
    from kvspec.conformance._compare import to_numpy

    a = to_numpy(x)
    return a.view(np.uint16).tobytes() if a.dtype.name == "bfloat16" else a.tobytes()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("mode", [KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS])
@pytest.mark.parametrize("src", ["float32", "float64", "same"])
def test_ops_on_cuda_match_kvref(emulated, dtype, mode, src):
    import kvfast.ops
    import kvref.ops

    specs = [KVLayerSpec.attention(2, 8), KVLayerSpec.sliding_window(2, 8, 3)]
    fast, ref = _pair(dtype, mode, specs)
    rng = np.random.default_rng(3)
    for step_no in range(3):
        cu, past, slots = np.array([0, 5, 6]), None, np.array([2, 0])
        if step_no:
            cu = np.array([0, 1, 2])
        steps = []
        for c in (fast, ref):
            past = _to_np(c.seq_lens())[slots]
            steps.append(c.prepare_step(cu, past, slots))
        T = int(cu[-1])
        k = rng.standard_normal((T, 2, 8)) * 3
        store = ref.keys(0).dtype
        k = k.astype(np.float32 if src == "float32" else np.float64 if src == "float64" else store)
        q = rng.standard_normal((T, 4, 8)).astype(np.float32)
        for layer in range(2):
            kvfast.ops.append_kv(fast, layer, k, k * 2, steps[0])
            kvref.ops.append_kv(ref, layer, k, k * 2, steps[1])
            assert _bits(fast.keys(layer)) == _bits(ref.keys(layer))
            assert _bits(fast.values(layer)) == _bits(ref.values(layer))
            got = kvfast.ops.varlen_attention(q, fast, layer, steps[0])
            want = kvref.ops.varlen_attention(q, ref, layer, steps[1])
            np.testing.assert_allclose(_to_np(got), want, rtol=2e-5, atol=2e-6)
        for c, st in ((fast, steps[0]), (ref, steps[1])):
            for b, s in enumerate(slots):
                c.update_position(int(s), int(_to_np(st.past_len)[b] + cu[b + 1] - cu[b]))
        for layer in range(2):
            for s in (0, 2):
                gf, gr = kvfast.ops.gather_kv(fast, layer, s), kvref.ops.gather_kv(ref, layer, s)
                assert _bits(gf[0]) == _bits(gr[0]) and _bits(gf[1]) == _bits(gr[1])


def _to_np(x):
    from kvspec.conformance._compare import to_numpy

    return to_numpy(x)


def test_append_kv_on_cuda_errors_match_kvref(emulated):
    import kvfast.ops
    import kvref.ops

    specs = [KVLayerSpec.attention(2, 8)]
    fast, ref = _pair("bfloat16", KVCacheMode.PAGED, specs)
    sf = fast.prepare_step(np.array([0, 2]), np.array([0]), np.array([1]))
    sr = ref.prepare_step(np.array([0, 2]), np.array([0]), np.array([1]))
    bad = [
        (np.zeros((2, 2, 8), np.int32), np.zeros((2, 2, 8), np.float32)),  # not floating
        (np.zeros((3, 2, 8), np.float32), np.zeros((2, 2, 8), np.float32)),  # wrong T
        (np.zeros((2, 2, 8), np.float32), np.zeros((2, 3, 8), np.float32)),  # wrong heads
        (np.zeros((2, 2, 8), np.float32), np.zeros((2, 2), np.float32)),  # wrong ndim
    ]
    before = _bits(fast.keys(0))
    for k, v in bad:
        with pytest.raises(Exception) as ef:
            kvfast.ops.append_kv(fast, 0, k, v, sf)
        with pytest.raises(Exception) as er:
            kvref.ops.append_kv(ref, 0, k, v, sr)
        assert (type(ef.value), str(ef.value)) == (type(er.value), str(er.value))
    rows = ref.keys(0).shape[0] * ref.keys(0).shape[1]  # storage rows: num_blocks * block_size
    oob_f = dataclasses.replace(sf, slot_mapping=emulated.asarray(np.array([0, rows + 3], np.int64)))
    oob_r = dataclasses.replace(sr, slot_mapping=np.array([0, rows + 3], np.int64))
    k = np.ones((2, 2, 8), np.float32)
    with pytest.raises(IndexError) as ef:
        kvfast.ops.append_kv(fast, 0, k, k, oob_f)
    with pytest.raises(IndexError) as er:
        kvref.ops.append_kv(ref, 0, k, k, oob_r)
    assert str(ef.value) == str(er.value)
    assert _bits(fast.keys(0)) == before  # nothing written


# --------------------------------------------------------------------------- the differential machines on cuda


def _cuda_backend():
    from kvfast._backend import conformance_backend

    b = conformance_backend()
    assert "cuda:0" in b.devices  # the emulated device is visible
    return b.on_device("cuda:0")


def test_slot_cache_differential_machine_on_cuda(emulated):
    from kvspec.conformance.machine import KVCacheComparison

    run_state_machine_as_test(KVCacheComparison.for_backend(_cuda_backend()),
                              settings=settings(max_examples=15, stateful_step_count=25, deadline=None))


def test_manager_differential_machine_on_cuda(emulated):
    from kvspec.conformance.manager_machine import ManagerComparison

    run_state_machine_as_test(ManagerComparison.for_backend(_cuda_backend()),
                              settings=settings(max_examples=15, stateful_step_count=25, deadline=None))


# --------------------------------------------------------------------------- tiers on cuda


def _tiered_run(manager, prompts, *, rounds: int) -> list[bytes]:
    """Requests one after another on one replica: claim, alloc (loads what the tiers hold),
    forward (writes K/V of the tokens it computes), step, runtime_inputs (posts offloads),
    release. Returns, per request, the device bytes of its full blocks after its alloc landed."""
    from kvspec import DEFAULT_LEAF_ID, TextContext
    from kvspec.conformance._compare import to_numpy
    from kvspec.conformance.manager_machine import write_forward

    seen = []
    for r in range(rounds):
        for i, p in enumerate(prompts):
            ctx = TextContext(f"q{r}.{i}", list(p))
            manager.claim(ctx)
            t = manager.alloc(ctx)
            t.synchronize()
            write_forward(manager, ctx, seed=1000 * i + 7)  # same values for the same prompt every round
            ctx.update(1)
            manager.step(ctx)
            manager.runtime_inputs([[ctx]])
            buf = to_numpy(manager.get_device_buffer(0)).view(np.uint8)
            rows = manager.get_req_blocks_per_leaf(ctx)[DEFAULT_LEAF_ID]
            full = (len(p) - 1) // manager.params.page_size
            seen.append(buf[rows[:full]].tobytes())
            _drain(manager)
            manager.release(ctx)
            _drain(manager)
    return seen


def _drain(manager) -> None:
    """Every posted transfer finished and reaped (both managers see the same tier state)."""
    import time

    for _ in range(10_000):
        manager.poll_transfers()
        if not manager.pending_transfers_exist(0):
            return
        time.sleep(0.001)
    raise AssertionError("transfers did not finish in 10 s")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_tiered_manager_on_cuda_offloads_evicts_and_reloads(emulated, tmp_path, dtype):
    """Host + disk tiers under a kvfast manager on cuda: K/V written by the forward are offloaded
    through the CudaPageStore (stage.cu, pinned arena), evicted from the device by other requests,
    reloaded; every byte equals what was written and what kvref (on the CPU) holds."""
    from kvspec import KVCacheParams

    page = 2
    geo = dict(page_size=page, num_layers=2, kv_heads=1, head_dim=4, dtype=dtype)
    pb = KVCacheParams(**geo).page_bytes()
    prompts = [list(range(10 * i, 10 * i + 9)) for i in range(4)]  # 4 full blocks each, disjoint
    out, hits = {}, {}
    for name, mod, dev in (("ref", kvref, "cpu"), ("fast", kvfast, "cuda")):
        params = KVCacheParams(**geo, host_offload_bytes=3 * pb, disk_offload_bytes=64 * pb,
                               disk_offload_dir=str(tmp_path / name))
        m = mod.PagedKVCacheManager(params, num_blocks=8, max_batch_size=1, max_seq_len=14, device=dev)
        out[name] = _tiered_run(m, prompts, rounds=2)
        met = m.get_metrics_aggregated()
        hits[name] = (met.d2h_bytes_copied, met.h2d_bytes_copied, met.disk_bytes_written, met.disk_bytes_read)
        if name == "fast":
            pinned = _is_pinned(emulated, m._connector._host.arena)  # the arena came from CudaPageStore.alloc_host
        m.shutdown()
    assert hits["fast"] == hits["ref"]
    assert hits["fast"][1] > 0 and hits["fast"][3] > 0  # reloads came from host and from disk
    assert out["fast"] == out["ref"]
    n = len(prompts)
    assert out["fast"][n:] == out["fast"][:n]  # round 2 reloaded exactly what round 1 wrote
    assert pinned


# --------------------------------------------------------------------------- the launchers


def test_gpu_marked_launcher_tests_pass_on_the_emulated_device(emulated, monkeypatch):
    """tests/test_kvfast_gpu.py (what a real GPU runs) with the emulated CuPy: every launcher,
    every dtype, through the host-compiled kernels."""
    import test_kvfast_gpu as g

    monkeypatch.setattr(g, "cp", emulated)
    for dtype in g.DTYPES:
        g.test_append_and_gather_launchers(dtype)
        g.test_block_stage_and_state_launchers(dtype)
    g.test_cuda_slot_cache_end_to_end()


def test_launchers_refuse_layouts_their_kernels_misread(emulated):
    from kvfast._cuda.append_kv import append_kv
    from kvfast._cuda.copy_blocks import copy_blocks
    from kvfast._cuda.stage import stage_gather
    from kvfast._cuda.state import state_copy_rows, state_zero_rows

    cp = emulated
    buf = cp.asarray(np.arange(6 * 2 * 8, dtype=np.uint16).reshape(6, 2, 8))
    before = buf.get().tobytes()
    ids = np.array([1, 2], np.int64)
    with pytest.raises(ValueError, match="staging.strides"):
        stage_gather(buf, cp.zeros((2, 2, 12), np.uint16)[:, :, :8], ids)  # rows not contiguous
    with pytest.raises(ValueError, match="2-byte elements"):
        stage_gather(buf, cp.zeros((2, 16), np.float32), ids)
    with pytest.raises(ValueError, match="staging.shape\\[0\\]=1 < len\\(block_ids\\)=2"):
        stage_gather(buf, cp.zeros((1, 16), np.uint16), ids)
    with pytest.raises(ValueError, match="each row must be C-contiguous"):
        stage_gather(buf[:, :, ::2], cp.zeros((2, 8), np.uint16), ids)
    with pytest.raises(ValueError, match="dst.strides\\[0\\]"):
        copy_blocks(buf, cp.zeros((6, 3, 8), np.uint16)[:, :2], np.array([[1, 2]], np.int64))
    with pytest.raises(ValueError, match="rows must be contiguous"):
        state_copy_rows(buf, cp.zeros((6, 3, 8), np.uint16)[:, :2], [1], [2])
    with pytest.raises(ValueError, match="len\\(dst_rows\\)=2 != len\\(src_rows\\)=1"):
        state_copy_rows(buf, buf, [1], [2, 3])
    with pytest.raises(ValueError, match="rows must be contiguous"):
        state_zero_rows(cp.zeros((6, 3, 8), np.uint16)[:, :2], [1])
    key = cp.zeros((3, 2, 8), np.uint16)[:, :, ::2]  # heads x dim not contiguous
    with pytest.raises(ValueError, match="key.strides"):
        append_kv(key, key, buf, buf, cp.asarray(np.array([0, 1, 2], np.int64)), block_size=1, block_stride=16,
                  row_stride=16)
    assert buf.get().tobytes() == before  # nothing ran


def test_manager_scheduler_diff_on_cuda(emulated, monkeypatch):
    """tests/test_kvfast_differential.py's ManagerDiff (replicas, hybrid full + sliding + recurrent
    leaves, speculative decoding with draft lists) with the kvfast manager on cuda:0."""
    import test_kvfast_differential as d
    from hypothesis import HealthCheck
    from hypothesis import strategies as st
    from hypothesis.stateful import initialize

    host_norm = d._norm

    def norm(v):  # device arrays (lookup tables, cache lengths) compared as host copies
        return host_norm(v.get() if isinstance(v, emulated.ndarray) else v)

    monkeypatch.setattr(d, "_norm", norm)

    class OnCuda(d.ManagerDiff):
        # (not "fp8": the machine's forward writes floats into the pages, and the device keeps FP8 as
        # uint8 bit patterns; tests/test_manager_fp8.py runs FP8 managers on the emulated device)
        @initialize(cfg=st.sampled_from(["hybrid", "replicas", "fast", "spec"]), num_blocks=st.integers(8, 14))
        def setup(self, cfg, num_blocks):
            super().setup(cfg, num_blocks)  # sizes the pool to hold MAX_SEQ (spec/manager.md §1.6)
            self.sides[1] = kvfast.PagedKVCacheManager(self.params, num_blocks=self.num_blocks, max_batch_size=3,
                                                       max_seq_len=d.MAX_SEQ, device="cuda")

    run_state_machine_as_test(OnCuda, settings=settings(max_examples=15, stateful_step_count=20, deadline=None,
                                                         suppress_health_check=[HealthCheck.too_slow]))


@pytest.mark.parametrize("hybrid", [False, True])
def test_cross_replica_copies_and_state_zeroing_use_the_kernels(emulated, monkeypatch, hybrid):
    """A prefix published on replica 0 and hit on replica 1 is copied by copy_blocks.cu; a recurrent
    leaf's fresh state is zeroed by state.cu; the device buffers equal kvref's byte for byte."""
    import kvfast._cuda.copy_blocks as cb
    import kvfast._cuda.state as stt
    from kvspec import KVCacheParams, LeafSpec, TextContext
    from kvspec.conformance._compare import to_numpy
    from kvspec.conformance.manager_machine import write_forward

    calls = {"copy_blocks": 0, "state_zero_rows": 0}
    for mod, name in ((cb, "copy_blocks"), (stt, "state_zero_rows")):
        orig = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _o=orig, _n=name, **k: (calls.__setitem__(_n, calls[_n] + 1),
                                                                           _o(*a, **k))[1])
    kw = {"leaves": {"full": LeafSpec.full(), "rec": LeafSpec.recurrent((2,))}} if hybrid else {}
    params = KVCacheParams(page_size=2, num_layers=1, kv_heads=1, head_dim=4, dtype="float16",
                           data_parallel_degree=2, **kw)
    out = []
    for mod, dev in ((kvref, "cpu"), (kvfast, "cuda")):
        m = mod.PagedKVCacheManager(params, num_blocks=10, max_batch_size=2, max_seq_len=16, device=dev)
        a = TextContext("a", list(range(7)))
        m.claim(a, 0)
        m.alloc(a)
        write_forward(m, a, 3, 0)
        a.update(9)
        m.step(a)
        b = TextContext("b", list(range(7)) + [5])
        m.claim(b, 1)
        m.alloc(b)  # hits a's prefix on the other replica: peer copies (full-leaf managers)
        bufs = [m.get_device_buffer(r) for r in range(2)]
        out.append([{k: to_numpy(v).tobytes() for k, v in x.items()} if isinstance(x, dict) else to_numpy(x).tobytes()
                    for x in bufs])
    assert out[0] == out[1]
    if hybrid:
        assert calls["state_zero_rows"] > 0
    else:
        assert calls["copy_blocks"] > 0


def test_emulated_launches_in_shuffled_thread_order(emulated, monkeypatch):
    """KVFAST_CUDA_EMULATE_SHUFFLE: every RawKernel launch runs its (block, thread) pairs shuffled;
    the CUDA paths give the same bytes (no kernel depends on thread order)."""
    monkeypatch.setenv("KVFAST_CUDA_EMULATE_SHUFFLE", "12345")
    test_ops_on_cuda_match_kvref(emulated, "bfloat16", KVCacheMode.PAGED, "float32")
    test_cuda_page_store(emulated)
    monkeypatch.setenv("KVFAST_CUDA_EMULATE_SHUFFLE", "x")
    with pytest.raises(ValueError, match="KVFAST_CUDA_EMULATE_SHUFFLE='x'"):
        test_cuda_page_store(emulated)


@pytest.mark.parametrize("config", ["full+sliding", "full+recurrent"])
def test_hybrid_tier_reload_on_cuda_matches_kvref(emulated, config):
    """A hybrid manager on cuda (host tier through the CudaPageStore of every leaf's units): a prompt
    served, offloaded and flushed from the device comes back from the tier in one admission whose
    load goes into the pages the slab's joint peek predicts (spec/manager.md §9.8); rows, metrics
    and every leaf's device bytes equal kvref's on the CPU."""
    from _hybrid_model import HYBRIDS, flush
    from kvspec import KVCacheParams, TextContext
    from kvspec.conformance._compare import to_numpy
    from kvspec.conformance.manager_machine import write_forward

    params = KVCacheParams(page_size=2, num_layers=1, kv_heads=1, head_dim=4, dtype="float16",
                           leaves=HYBRIDS[config], host_offload_bytes=1 << 16)
    prompt = list(range(3, 12))
    out = []
    for mod, dev in ((kvref, "cpu"), (kvfast, "cuda")):
        m = mod.PagedKVCacheManager(params, num_blocks=12, max_batch_size=2, max_seq_len=16, device=dev)
        a = TextContext("a", prompt)
        m.claim(a)
        a.chunk(8)  # a page-aligned chunk first: a recurrent leaf checkpoints at its end (spec/manager.md §5.2)
        m.alloc(a)
        write_forward(m, a, 5)
        a.advance_chunk()
        m.step(a)
        m.alloc(a)
        write_forward(m, a, 6)
        a.update(1)
        m.step(a)
        m.runtime_inputs([[a]])  # posts the offload
        m.release(a)
        _drain(m)
        flush(m)
        b = TextContext("b", prompt)
        m.claim(b)
        m.alloc(b).synchronize()
        m.poll_transfers()
        assert b.cached_prefix_external_length > 0, "the hit did not come from the tier"
        m.check_invariants()
        bufs = m.get_device_buffer(0)
        out.append((m.get_req_blocks_per_leaf(b), m.get_metrics_aggregated(), b.cached_prefix_length,
                    {k: to_numpy(v).tobytes() for k, v in bufs.items()}))
        m.shutdown()
    assert out[0] == out[1]
