"""Every kernel of ``kvfast/kernels/*.cu`` executed on the CPU (kvfast._cuda.harness).

The ``.cu`` sources are compiled unchanged for the host with a CUDA shim and
run over the whole grid x block, in order and in two shuffled orders; every
result is compared byte for byte with NumPy (the definition kvref uses:
fancy-index assignment of rows) and, for append/gather, with ``kvref.ops`` on
a real cache. Destinations sit between guard bytes, so a write out of bounds
fails the test. Needs a host C++ compiler (``.ci/run`` installs g++).
"""

import numpy as np
import pytest

import kvref
import kvref.ops
from kvfast._cuda._sources import ELEM_SUFFIX, KERNELS
from kvfast._cuda.harness import HarnessError, HostKernel, build, entry_names, get_host_kernel
from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec

WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32}
SEEDS = [0, 1, 0xC0FFEE]  # in order, then two shuffles
GUARD = 64  # guard bytes on each side of every destination


def _alloc(shape, dtype, *, misalign: int, rng):
    """Random array whose first element sits ``misalign`` elements past a 16-byte boundary,
    with ``GUARD`` bytes of a known pattern before and after it."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape))
    raw = np.empty(n * dt.itemsize + 2 * GUARD + 32, np.uint8)
    raw[:] = 0xA5
    base = raw.__array_interface__["data"][0]
    start = GUARD + (-(base + GUARD) % 16) + misalign * dt.itemsize
    body = raw[start:start + n * dt.itemsize].view(dt).reshape(shape)
    body[...] = rng.integers(0, np.iinfo(dt).max, size=shape, dtype=dt, endpoint=True)
    return raw, body


def _guards_intact(raw, body):
    start = body.__array_interface__["data"][0] - raw.__array_interface__["data"][0]
    return bool((raw[:start] == 0xA5).all() and (raw[start + body.nbytes:] == 0xA5).all())


def test_every_file_builds_and_exports_every_entry():
    for filename in KERNELS:
        assert build(filename).exists()
        for name in entry_names(filename):
            assert get_host_kernel(filename, name).arity >= 4


def test_bad_launches_raise():
    k = get_host_kernel("state.cu", "state_zero_kernel_u8")
    with pytest.raises(HarnessError, match="len\\(args\\)=1 != 4"):
        k(1, 32, (np.zeros(4, np.uint8),))
    with pytest.raises(HarnessError, match="grid=\\(0,\\)"):
        k((0,), 32, (np.zeros(4, np.uint8), np.zeros(1, np.int64), 1, 4))
    with pytest.raises(ValueError, match="name='nope'"):
        HostKernel("state.cu", "nope")
    with pytest.raises(ValueError, match="filename='nope.cu'"):
        build("nope.cu")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("misalign", [0, 1])
@pytest.mark.parametrize("row_elems", [48, 13])  # whole 16-byte vectors / a scalar tail
@pytest.mark.parametrize("itemsize", sorted(ELEM_SUFFIX))
def test_append_kv(itemsize, row_elems, misalign, seed):
    rng = np.random.default_rng([itemsize, row_elems, misalign, seed])
    w = WORDS[itemsize]
    nb, bs, T = 5, 4, 7
    kstride = row_elems + 3  # strided source rows (row_elems contiguous, 3 elements of gap)
    _, key_full = _alloc((T, kstride), w, misalign=misalign, rng=rng)
    _, val = _alloc((T, row_elems), w, misalign=misalign, rng=rng)
    key = key_full[:, :row_elems]
    kraw, kc = _alloc((nb * bs, row_elems), w, misalign=misalign, rng=rng)
    vraw, vc = _alloc((nb * bs, row_elems), w, misalign=misalign, rng=rng)
    sm = np.array([3, -1, 17, 0, 19, -5, 8], np.int64)  # padding slots (< 0) skipped
    want_k, want_v = kc.copy(), vc.copy()
    keep = sm >= 0
    want_k[sm[keep]] = key[keep]
    want_v[sm[keep]] = val[keep]
    k = get_host_kernel("append_kv.cu", f"append_kv_kernel_{ELEM_SUFFIX[itemsize]}")
    k((T,), (32,), (key_full, val, kc, vc, sm, T, row_elems, kstride, row_elems, bs, bs * row_elems, row_elems),
      seed=seed)
    assert kc.tobytes() == want_k.tobytes() and vc.tobytes() == want_v.tobytes()
    assert _guards_intact(kraw, kc) and _guards_intact(vraw, vc)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("misalign", [0, 1])
@pytest.mark.parametrize("row_elems", [32, 7])
@pytest.mark.parametrize("itemsize", sorted(ELEM_SUFFIX))
def test_gather_kv(itemsize, row_elems, misalign, seed):
    rng = np.random.default_rng([itemsize, row_elems, misalign, seed, 1])
    w = WORDS[itemsize]
    nb, bs, n = 6, 4, 10
    # Strided pool: each block's rows sit block_stride apart with a gap after the block.
    block_stride = bs * row_elems + 5
    _, kc = _alloc((nb, block_stride), w, misalign=misalign, rng=rng)
    _, vc = _alloc((nb, block_stride), w, misalign=misalign, rng=rng)
    row = np.array([2, 5, 1, 0], np.int32)
    kraw, ko = _alloc((n, row_elems), w, misalign=misalign, rng=rng)
    vraw, vo = _alloc((n, row_elems), w, misalign=misalign, rng=rng)
    k = get_host_kernel("gather_kv.cu", f"gather_kv_kernel_{ELEM_SUFFIX[itemsize]}")
    k((n,), (64,), (kc, vc, row, ko, vo, n, row_elems, bs, block_stride, row_elems), seed=seed)
    for src, out in ((kc, ko), (vc, vo)):
        rows = src[:, : bs * row_elems].reshape(nb * bs, row_elems)
        pos = np.arange(n)
        want = rows[row[pos // bs].astype(np.int64) * bs + pos % bs]
        assert out.tobytes() == want.tobytes()
    assert _guards_intact(kraw, ko) and _guards_intact(vraw, vo)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("misalign", [0, 1])
@pytest.mark.parametrize("block_elems", [64, 9])
@pytest.mark.parametrize("itemsize", sorted(ELEM_SUFFIX))
def test_copy_blocks_and_stage(itemsize, block_elems, misalign, seed):
    rng = np.random.default_rng([itemsize, block_elems, misalign, seed, 2])
    w, suf = WORDS[itemsize], ELEM_SUFFIX[itemsize]
    nb, stride = 6, block_elems + 2  # strided blocks
    _, src = _alloc((nb, stride), w, misalign=misalign, rng=rng)
    draw, dst = _alloc((nb, stride), w, misalign=misalign, rng=rng)
    pairs = np.array([[1, 4], [5, 0], [1, 2]], np.int64)
    want = dst.copy()
    want[pairs[:, 1], :block_elems] = src[pairs[:, 0], :block_elems]
    copy = get_host_kernel("copy_blocks.cu", f"copy_blocks_kernel_{suf}")
    copy((3, 2), (32,), (src, dst, pairs, 3, block_elems, stride), seed=seed)  # two chunks per block
    assert dst.tobytes() == want.tobytes() and _guards_intact(draw, dst)

    ids = np.array([4, 0, 3], np.int64)
    sraw, staging = _alloc((3, block_elems), w, misalign=misalign, rng=rng)
    get_host_kernel("stage.cu", f"stage_gather_kernel_{suf}")((3, 3), (16,), (dst, staging, ids, 3, block_elems,
                                                                                 stride), seed=seed)
    assert staging.tobytes() == dst[ids, :block_elems].tobytes() and _guards_intact(sraw, staging)
    back = rng.integers(0, np.iinfo(w).max, size=(3, block_elems), dtype=w)
    want = dst.copy()
    want[ids, :block_elems] = back
    staging[...] = back
    get_host_kernel("stage.cu", f"stage_scatter_kernel_{suf}")((3, 1), (64,), (staging, dst, ids, 3, block_elems,
                                                                                  stride), seed=seed)
    assert dst.tobytes() == want.tobytes() and _guards_intact(draw, dst)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("misalign", [0, 1])
@pytest.mark.parametrize("row_elems", [40, 5])
@pytest.mark.parametrize("itemsize", sorted(ELEM_SUFFIX))
def test_state_copy_and_zero(itemsize, row_elems, misalign, seed):
    rng = np.random.default_rng([itemsize, row_elems, misalign, seed, 3])
    w, suf = WORDS[itemsize], ELEM_SUFFIX[itemsize]
    _, src = _alloc((4, row_elems), w, misalign=misalign, rng=rng)
    draw, dst = _alloc((6, row_elems), w, misalign=misalign, rng=rng)
    s_rows, d_rows = np.array([3, 0, 2], np.int64), np.array([5, 1, 0], np.int64)
    want = dst.copy()
    want[d_rows] = src[s_rows]
    get_host_kernel("state.cu", f"state_copy_kernel_{suf}")((3, 2), (32,), (src, dst, s_rows, d_rows, 3, row_elems),
                                                           seed=seed)
    assert dst.tobytes() == want.tobytes() and _guards_intact(draw, dst)
    rows = np.array([1, 4], np.int64)
    want[rows] = 0
    get_host_kernel("state.cu", f"state_zero_kernel_{suf}")((2, 1), (32,), (dst, rows, 2, row_elems), seed=seed)
    assert dst.tobytes() == want.tobytes() and _guards_intact(draw, dst)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_append_and_gather_match_kvref_ops(dtype):
    """The kernels, fed a kvref cache's own buffers and step, leave the bytes kvref.ops leaves."""
    cfg = KVCacheConfig(num_layers=1, max_seqs=3, max_seq_len=24, mode=KVCacheMode.PAGED, block_size=4,
                        dtype=dtype)
    spec = KVLayerSpec.attention(2, 8)
    ref = kvref.KVCache.make(cfg, [spec])
    step = ref.prepare_step(np.array([0, 5, 6, 9]), np.zeros(3, np.int64), np.array([2, 0, 1]))
    rng = np.random.default_rng(5)
    T = step.num_tokens
    k = rng.standard_normal((T, 2, 8)).astype(ref.keys(0).dtype)
    v = rng.standard_normal((T, 2, 8)).astype(ref.keys(0).dtype)
    K, V = ref.keys(0).copy(), ref.values(0).copy()  # before the append
    kvref.ops.append_kv(ref, 0, k, v, step)
    w = WORDS[K.dtype.itemsize]
    kern = get_host_kernel("append_kv.cu", f"append_kv_kernel_{ELEM_SUFFIX[K.dtype.itemsize]}")
    bs, row = 4, 16
    kern((T,), (32,), (k.view(w), v.view(w), K.view(w), V.view(w), np.asarray(step.slot_mapping, np.int64), T, row,
                       row, row, bs, bs * row, row), seed=3)
    assert K.tobytes() == ref.keys(0).tobytes() and V.tobytes() == ref.values(0).tobytes()
    ref.update_position(2, 5)  # row 0 of the step: slot 2, 5 tokens
    gk, gv = kvref.ops.gather_kv(ref, 0, 2)
    outk, outv = np.empty_like(gk), np.empty_like(gv)
    table = np.ascontiguousarray(ref.paged_block_table()[2], dtype=np.int32)
    get_host_kernel("gather_kv.cu", f"gather_kv_kernel_{ELEM_SUFFIX[K.dtype.itemsize]}")(
        (5,), (32,), (K.view(w), V.view(w), table, outk.view(w), outv.view(w), 5, row, bs, bs * row, row))
    assert outk.tobytes() == gk.tobytes() and outv.tobytes() == gv.tobytes()
