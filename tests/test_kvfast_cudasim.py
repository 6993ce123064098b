"""kvfast's Numba-CUDA kernels under the CUDA simulator (no GPU needed).

The simulator must be chosen before ``numba.cuda`` is imported, so each test
runs a small script in a subprocess with ``NUMBA_ENABLE_CUDASIM=1``; the
script compares the kernels to NumPy on tiny shapes and prints ``OK``.
"""

import os
import subprocess
import sys
import textwrap

import pytest

_PRELUDE = textwrap.dedent(
    """
    import numpy as np
    from numba import cuda
    assert cuda.simulator_enabled if hasattr(cuda, "simulator_enabled") else True
    from kvfast._cuda.numba_kernels import append_kv, build_step_indices
    rng = np.random.default_rng(0)
    """
)


def _run(body: str) -> None:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(body) + "\nprint('OK')"],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr


@pytest.mark.parametrize("paged", [True, False])
def test_step_indices_kernel_matches_numpy(paged):
    _run(
        f"""
        paged = {paged}
        bs, max_seq_len, max_seqs = 4, 16, 4
        table = np.zeros((max_seqs, 4), np.int32)
        table[:] = rng.permutation(np.arange(1, 17, dtype=np.int32)).reshape(4, 4)
        cu = np.array([0, 3, 4, 9], np.int32)
        past = np.array([2, 7, 0], np.int32)
        slots = np.array([2, 0, 3], np.int32)
        t = int(cu[-1])
        bi = np.full(t, -1, np.int32); pos = np.full(t, -1, np.int32); sm = np.full(t, -9, np.int64)
        build_step_indices(cu, past, slots, table, bi, pos, sm, block_size=bs, max_seq_len=max_seq_len,
                           paged=paged, threads=32)
        q = np.diff(cu)
        want_bi = np.repeat(np.arange(3, dtype=np.int32), q)
        want_pos = past[want_bi] + (np.arange(t) - cu[:-1][want_bi])
        s = slots[want_bi].astype(np.int64)
        if paged:
            want_sm = table[s, want_pos // bs].astype(np.int64) * bs + want_pos % bs
        else:
            want_sm = s * max_seq_len + want_pos
        assert (bi == want_bi).all(), (bi, want_bi)
        assert (pos == want_pos).all(), (pos, want_pos)
        assert (sm == want_sm).all(), (sm, want_sm)
        """
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_append_kv_kernel_matches_numpy(dtype):
    _run(
        f"""
        import ml_dtypes
        dt = np.dtype(ml_dtypes.bfloat16) if "{dtype}" == "bfloat16" else np.dtype("{dtype}")
        ut = {{2: np.uint16, 4: np.uint32}}[dt.itemsize]
        nb, bs, row = 5, 4, 12
        kc = rng.standard_normal((nb, bs, row)).astype(dt); vc = rng.standard_normal((nb, bs, row)).astype(dt)
        key = rng.standard_normal((5, row)).astype(dt); val = rng.standard_normal((5, row)).astype(dt)
        sm = np.array([5, -1, 17, 0, 19], np.int64)   # one padding token
        want_k = kc.copy(); want_v = vc.copy()
        for t, s in enumerate(sm):
            if s >= 0:
                want_k[s // bs, s % bs] = key[t]; want_v[s // bs, s % bs] = val[t]
        kcu = kc.view(ut); vcu = vc.view(ut)
        append_kv(key.view(ut), val.view(ut), kcu, vcu, sm, block_size=bs, threads=32)
        assert kc.tobytes() == want_k.tobytes()
        assert vc.tobytes() == want_v.tobytes()
        """
    )
