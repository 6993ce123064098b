"""Zero-copy interop with torch (``kvfast.interop``) and torch tensors as ``ops`` inputs.

torch is an optional extra (``pip install "kvcache[torch]"``), not part of the
``test`` extra CI installs (a CPU wheel is ~200 MB): the tests that need it
skip with that reason. The emulated-device variants run where torch is
installed, through the ``emulated`` fixture of ``tests/conftest.py``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kvfast
import kvfast.interop as io
import kvref
from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec
from kvspec._interop import host_array

torch = pytest.importorskip("torch", reason="torch is an optional extra (kvcache[torch]); CI does not install it")


DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "int32": np.int32,
          "int64": np.int64, "uint32": np.uint32}


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_to_torch_shares_memory_for_every_dtype(name):
    a = np.zeros((3, 4), DTYPES[name])
    t = io.to_torch(a)
    assert tuple(t.shape) == (3, 4)
    assert str(t.dtype) == f"torch.{name}"
    t[1, 2] = 7
    assert float(a[1, 2]) == 7.0  # the write went through to the array: no copy
    assert t.data_ptr() == a.__array_interface__["data"][0]


def test_to_torch_of_a_cache_view_and_back():
    cfg = KVCacheConfig(num_layers=1, max_seqs=2, max_seq_len=8, mode=KVCacheMode.PAGED, block_size=4,
                        dtype="bfloat16")
    cache = kvfast.KVCache.make(cfg, [KVLayerSpec.attention(2, 4)])
    K = cache.keys(0)
    t = io.to_torch(K)
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == K.shape
    t[1, 0, 0, 0] = 2.5
    assert float(cache.keys(0)[1, 0, 0, 0]) == 2.5
    back = io.from_torch(t)
    assert back.dtype == K.dtype and back.__array_interface__["data"][0] == K.__array_interface__["data"][0]
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        io.from_torch(np.zeros(3))
    with pytest.raises(TypeError, match="must export DLPack"):
        io.to_torch([1, 2])
    with pytest.raises(ValueError, match="dtype='bfloat16' but x.dtype=float32"):
        io.to_torch(np.zeros(3, np.float32), dtype="bfloat16")


def test_host_array_reads_torch_without_copy():
    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).requires_grad_(True)
    a = host_array(t)
    assert a.dtype == ml_dtypes.bfloat16 and a.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert a.__array_interface__["data"][0] == t.data_ptr()


def _run_ops(mod, dtype, device, make_input):
    cfg = KVCacheConfig(num_layers=1, max_seqs=2, max_seq_len=16, mode=KVCacheMode.PAGED, block_size=4,
                        dtype=dtype, device=device)
    cache = mod.KVCache.make(cfg, [KVLayerSpec.attention(2, 8)])
    step = cache.prepare_step(np.array([0, 5, 7]), np.array([0, 0]), np.array([1, 0]))
    rng = np.random.default_rng(4)
    k = rng.standard_normal((7, 2, 8)).astype(np.float32)
    v = rng.standard_normal((7, 2, 8)).astype(np.float32)
    q = rng.standard_normal((7, 4, 8)).astype(np.float32)
    mod.ops.append_kv(cache, 0, make_input(k), make_input(v), step)
    out = mod.ops.varlen_attention(make_input(q), cache, 0, step)
    from kvspec.conformance._compare import to_numpy

    keys = to_numpy(cache.keys(0))
    return keys.view(np.uint16) if keys.dtype.name == "bfloat16" else keys, to_numpy(out)


@pytest.mark.parametrize("tdtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("cache_dtype", ["float16", "bfloat16", "float32"])
def test_ops_accept_torch_tensors(cache_dtype, tdtype):
    """torch tensors in, the bytes and outputs kvref gives for the same values as NumPy arrays."""
    tt = getattr(torch, tdtype)
    npt = DTYPES[tdtype]

    def as_torch(a):
        return torch.from_numpy(a).to(tt)

    def as_numpy(a):
        return np.asarray(torch.from_numpy(a).to(tt).to(torch.float32).numpy()).astype(npt)

    want = _run_ops(kvref, cache_dtype, "cpu", as_numpy)
    for mod in (kvref, kvfast):
        got = _run_ops(mod, cache_dtype, "cpu", as_torch)
        assert got[0].tobytes() == want[0].tobytes()
        np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tdtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cache_dtype", ["float16", "bfloat16"])
def test_ops_accept_torch_tensors_on_emulated_cuda(emulated, cache_dtype, tdtype):
    tt = getattr(torch, tdtype)
    npt = DTYPES[tdtype]
    want = _run_ops(kvref, cache_dtype, "cpu",
                    lambda a: np.asarray(torch.from_numpy(a).to(tt).to(torch.float32).numpy()).astype(npt))
    got = _run_ops(kvfast, cache_dtype, "cuda", lambda a: torch.from_numpy(a).to(tt))
    assert got[0].tobytes() == want[0].tobytes()
    np.testing.assert_allclose(got[1], want[1], rtol=2e-5, atol=2e-6)


def test_to_torch_of_emulated_device_storage(emulated):
    cp = emulated
    words = cp.asarray(np.array([0x3FC0, 0xC000], np.uint16))  # bfloat16 1.5, -2.0 as CuPy stores them
    t = io.to_torch(words, dtype="bfloat16")
    assert t.dtype == torch.bfloat16 and t.tolist() == [1.5, -2.0]
    t[0] = 4.0
    assert int(words[0]) == 0x4080  # shared: the emulated device is host memory, exported as such


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fill_accepts_torch_bfloat16(emulated, device):
    for mod in (kvref, kvfast) if device == "cpu" else (kvfast,):
        cfg = KVCacheConfig(num_layers=1, max_seqs=2, max_seq_len=8, mode=KVCacheMode.PAGED, block_size=4,
                            dtype="bfloat16", device=device)
        cache = mod.KVCache.make(cfg, [KVLayerSpec.cross_attention(2, 4, 6)])
        k = torch.randn(3, 2, 4, dtype=torch.bfloat16)
        cache.fill(0, 1, k, k * 2)
        from kvspec.conformance._compare import to_numpy

        got = to_numpy(cache.keys(0))[1, :3].view(np.uint16)
        assert got.tobytes() == k.view(torch.int16).numpy().tobytes()


def test_interop_guide_runs():
    """docs/interop.md's Python blocks, in order, as a reader would paste them."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "interop.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 2
    ns: dict = {}
    for b in blocks:
        exec(compile(b, "docs/interop.md", "exec"), ns)


def test_interop_is_an_attribute_of_the_package():
    """issue 33: ``import kvfast; kvfast.interop`` works without importing the submodule by name."""
    import subprocess
    import sys

    code = "import kvfast; m = kvfast.interop; assert m.__name__ == 'kvfast.interop'; assert 'interop' in dir(kvfast)"
    subprocess.run([sys.executable, "-c", code], check=True)
