"""``kvref.ops`` (spec/slot-cache.md §7): scatter, gather and attention through the cache
equal dense attention over each sequence's history, and the issue's "Done when"
scenario (retire, admit an extension, attend the continuation) for paged,
sliding-window and hybrid caches.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvref import ops
from kvspec import KVLayerSpec, KVCacheMode, LayerKind
from test_slot_cache import assert_unchanged, fingerprint, make_cache

PAGED, CONTIG = KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS


# ---------------------------------------------------------------------- dense reference


def dense_attention(q, k, v, first_pos, *, window=None, causal=True, scale=None):
    """Plain per-query, per-head softmax attention in float64.

    q [Tq, Hq, D] are the queries at positions first_pos .. first_pos+Tq-1;
    k, v [N, Hk, D] the whole history; causal: query p sees keys [0, p]
    (window: [p-window+1, p]); non-causal: all N keys.
    """
    Tq, Hq, D = q.shape
    group = Hq // k.shape[1]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    out = np.zeros((Tq, Hq, D))
    for j in range(Tq):
        p = first_pos + j
        lo = 0 if (not causal or window is None) else max(0, p - window + 1)
        hi = k.shape[0] if not causal else p + 1
        for h in range(Hq):
            kk = k[lo:hi, h // group].astype(np.float64)
            vv = v[lo:hi, h // group].astype(np.float64)
            s = kk @ q[j, h].astype(np.float64) * scale
            w = np.exp(s - s.max())
            out[j, h] = (w / w.sum()) @ vv
    return out


def token_kv(tokens, heads, dim, layer, dtype=np.float32):
    """K/V as a pure function of (layer, token prefix position, token): what a model would compute."""
    ks, vs = [], []
    for pos, tok in enumerate(tokens):
        rng = np.random.default_rng([layer, pos, int(tok)])
        ks.append(rng.standard_normal((heads, dim)))
        vs.append(rng.standard_normal((heads, dim)))
    return np.array(ks).astype(dtype), np.array(vs).astype(dtype)


def step_and_append(cache, rows, tokens_of, start_of=None):
    """prepare_step for rows [(slot, q_len)], append each attention layer's K/V from token_kv, commit.

    ``tokens_of[slot]`` is the slot's full token list; the step covers
    positions [seq, seq+q_len).
    """
    seq = cache.seq_lens()
    cu = np.concatenate([[0], np.cumsum([n for _, n in rows])])
    step = cache.prepare_step(cu, [int(seq[s]) for s, _ in rows], [s for s, _ in rows])
    for l, spec in enumerate(cache.layer_specs):
        if spec.kind not in (LayerKind.ATTENTION, LayerKind.SLIDING_WINDOW):
            continue
        ks, vs = [], []
        for s, n in rows:
            k, v = token_kv(tokens_of[s][: seq[s] + n], spec.kv_heads, spec.head_dim, l)
            ks.append(k[seq[s]:])
            vs.append(v[seq[s]:])
        ops.append_kv(cache, l, np.concatenate(ks), np.concatenate(vs), step)
    return step


def check_attention(cache, step, tokens_of, rng, q_heads_mult=2):
    """varlen_attention through the cache == dense_attention over each row's full history, every K/V layer."""
    for l, spec in enumerate(cache.layer_specs):
        if spec.kind is LayerKind.STATE:
            continue
        q = rng.standard_normal((step.num_tokens, spec.kv_heads * q_heads_mult, spec.head_dim)).astype(np.float32)
        got = ops.varlen_attention(q, cache, l, step)
        assert got.dtype == np.float32 and got.shape == q.shape
        cu = step.cu_seqlens_q
        for b in range(step.num_seqs):
            s, past = int(step.slot_ids[b]), int(step.past_len[b])
            lo, hi = int(cu[b]), int(cu[b + 1])
            if spec.kind is LayerKind.CROSS_ATTENTION:
                k, v = cache._test_enc[l][s]
                want = dense_attention(q[lo:hi], k, v, past, causal=False)
            else:
                n = int(step.seqused_k[b])
                k, v = token_kv(tokens_of[s][:n], spec.kv_heads, spec.head_dim, l)
                window = spec.window if spec.kind is LayerKind.SLIDING_WINDOW else None
                want = dense_attention(q[lo:hi], k, v, past, window=window)
            np.testing.assert_allclose(got[lo:hi], want, rtol=1e-4, atol=1e-5)


def mixed_specs():
    return [KVLayerSpec.attention(2, 4), KVLayerSpec.sliding_window(2, 4, 3), KVLayerSpec.cross_attention(1, 4, 6)]


def fill_cross(cache, slot, t_enc, rng):
    """Fill every cross layer of ``slot``; remember the dense values for check_attention."""
    cache._test_enc = getattr(cache, "_test_enc", {})
    for l, spec in enumerate(cache.layer_specs):
        if spec.kind is LayerKind.CROSS_ATTENTION:
            k = rng.standard_normal((t_enc, spec.kv_heads, spec.head_dim)).astype(np.float32)
            v = rng.standard_normal((t_enc, spec.kv_heads, spec.head_dim)).astype(np.float32)
            cache.fill(l, slot, k, v)
            cache._test_enc.setdefault(l, {})[slot] = (k, v)


# ---------------------------------------------------------------------- append / gather


@pytest.mark.parametrize("mode", [PAGED, CONTIG])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_append_then_gather_is_the_history(mode, dtype):
    """spec/slot-cache.md §7.1-7.2: chunked prefill then decode, rows out of slot order."""
    cache = make_cache(mode, mixed_specs(), max_seqs=3, max_seq_len=20, block_size=4, dtype=dtype)
    toks = {0: list(range(30, 43)), 2: list(range(7, 16))}
    for rows in ([(2, 5), (0, 3)], [(0, 6), (2, 1)], [(2, 3), (0, 4)]):
        step_and_append(cache, rows, toks)
        for s, n in rows:
            cache.update_position(s, int(cache.seq_lens()[s]) + n)
    for l in (0, 1):
        for s in (0, 2):
            k, v = ops.gather_kv(cache, l, s)
            wk, wv = token_kv(toks[s][: cache.seq_lens()[s]], 2, 4, l)
            assert k.dtype == cache.config.np_dtype and k.shape == (len(toks[s]) if s == 0 else 9, 2, 4)
            assert np.array_equal(k, wk.astype(cache.config.np_dtype)) and np.array_equal(v, wv.astype(cache.config.np_dtype))
    k, v = ops.gather_kv(cache, 0, 1)
    assert k.shape == (0, 2, 4)
    fill_cross(cache, 1, 4, np.random.default_rng(0))
    k, v = ops.gather_kv(cache, 2, 1)
    assert k.shape == (4, 1, 4) and np.array_equal(k, cache._test_enc[2][1][0].astype(cache.config.np_dtype))
    cache.check_invariants()


def test_append_skips_negative_slot_mapping():
    cache = make_cache(PAGED, max_seqs=2, max_seq_len=8, block_size=4)
    step = cache.prepare_step([0, 3], [0], [0])
    padded = dataclasses.replace(step, slot_mapping=np.array([4, -1, 6], np.int64))
    k = np.ones((3, 2, 4), np.float32)
    ops.append_kv(cache, 0, k, k, padded)
    assert cache.keys(0)[1, 0].all() and not cache.keys(0)[1, 1].any() and cache.keys(0)[1, 2].all()


# ---------------------------------------------------------------------- attention == dense


@pytest.mark.parametrize("mode", [PAGED, CONTIG])
def test_attention_through_cache_equals_dense(mode):
    """spec/slot-cache.md §7.3: causal, sliding window (3), GQA (q_heads = 2 x kv_heads), cross non-causal."""
    rng = np.random.default_rng(1)
    cache = make_cache(mode, mixed_specs(), max_seqs=3, max_seq_len=20, block_size=3)
    toks = {0: list(range(100, 117)), 1: list(range(50, 60)), 2: list(range(5, 20))}
    for s, t in ((0, 5), (1, 2), (2, 6)):
        fill_cross(cache, s, t, rng)
    for rows in ([(1, 4), (0, 7)], [(2, 5), (0, 1), (1, 3)], [(0, 2), (2, 1)]):
        step = step_and_append(cache, rows, toks)
        check_attention(cache, step, toks, rng)
        for s, n in rows:
            cache.update_position(s, int(cache.seq_lens()[s]) + n)
    cache.check_invariants()


def test_paged_and_contiguous_agree_bitwise():
    """spec/slot-cache.md §7.3: the storage mode never changes the result."""
    q = np.random.default_rng(3).standard_normal((14, 4, 4)).astype(np.float32)
    outs = []
    for mode in (PAGED, CONTIG):
        cache = make_cache(mode, mixed_specs()[:2], max_seqs=2, max_seq_len=12, block_size=4)
        toks = {0: list(range(12)), 1: list(range(40, 52))}
        step = step_and_append(cache, [(0, 5), (1, 9)], toks)
        outs.append([ops.varlen_attention(q, cache, l, step) for l in (0, 1)])
    for a, b in zip(*outs):
        assert np.array_equal(a, b)


# ---------------------------------------------------------------------- Done when: retire, admit an extension, attend


def _serve(cache, slot, tokens, rng, chunk=5):
    """Prefill ``tokens[:-1]`` in chunks starting at seq_lens()[slot] (the last token is sampled, never fed);
    check attention on every chunk."""
    toks = {slot: tokens}
    while cache.seq_lens()[slot] < len(tokens) - 1:
        n = min(chunk, len(tokens) - 1 - int(cache.seq_lens()[slot]))
        step = step_and_append(cache, [(slot, n)], toks)
        check_attention(cache, step, toks, rng)
        cache.update_position(slot, int(cache.seq_lens()[slot]) + n)
        cache.check_invariants()


@pytest.mark.parametrize("specs", [
    [KVLayerSpec.attention(2, 4)],
    [KVLayerSpec.sliding_window(2, 4, 5), KVLayerSpec.attention(1, 4)],
], ids=["attention", "sliding-window"])
def test_done_when_retire_admit_extension_attends_like_dense(specs):
    """Issue 2 "Done when": after retire and admit of an extension, admit returns the whole-block hit
    (capped at len-1) and the continuation attends exactly like dense attention over the full sequence."""
    rng = np.random.default_rng(4)
    cache = make_cache(PAGED, specs, max_seqs=2, max_seq_len=32, block_size=4)
    first = list(rng.integers(0, 50, 14))  # 13 fed + 1 sampled
    _serve(cache, 0, first, rng)
    cache.retire(0, first)  # a = min(14, 13) = 13 -> 3 full blocks published
    extended = first + list(rng.integers(0, 50, 6))
    hit = cache.admit(1, extended)
    assert hit == 12 and cache.seq_lens()[1] == 12
    k, v = ops.gather_kv(cache, 0, 1)
    wk, wv = token_kv(extended[:12], specs[0].kv_heads, specs[0].head_dim, 0)
    assert np.array_equal(k, wk.astype(k.dtype)) and np.array_equal(v, wv.astype(v.dtype))
    _serve(cache, 1, extended, rng)
    # the exact-prefix case: the prompt is exactly the retired blocks -> capped at len-1 (one block less)
    cache.retire(1, extended)
    assert cache.admit(0, extended[:16]) == 12
    cache.check_invariants()


def _conv_state_after(tokens, dims, width):
    """A toy conv state: the last ``width`` token embeddings (newest last), left zero-padded."""
    out = np.zeros((dims, width), np.float32)
    tail = tokens[-width:]
    for i, t in enumerate(tail):
        out[:, width - len(tail) + i] = np.random.default_rng([9, int(t)]).standard_normal(dims)
    return out


def _recurrent_after(tokens, shape):
    acc = np.zeros(shape, np.float32)
    for pos, t in enumerate(tokens):
        acc = 0.5 * acc + np.random.default_rng([8, pos, int(t)]).standard_normal(shape).astype(np.float32)
    return acc


def test_done_when_hybrid_with_state_checkpoints():
    """Issue 2 "Done when", hybrid: the hit stops at the checkpointed boundary, the checkpoint is
    restored into the slot's slabs, and attention for the continuation equals dense attention."""
    rng = np.random.default_rng(5)
    specs = [KVLayerSpec.attention(2, 4), KVLayerSpec.state((3,), 2, recurrent=(1, 2, 2)),
             KVLayerSpec.sliding_window(1, 4, 6)]
    cache = make_cache(PAGED, specs, max_seqs=2, max_seq_len=32, block_size=4)
    first = list(rng.integers(0, 50, 13))  # 12 fed (aligned) + 1 sampled
    _serve(cache, 0, first, rng)
    fed = first[:12]
    cache.conv_state(1)[0] = _conv_state_after(fed, 3, 2)
    cache.recurrent_state(1)[0] = _recurrent_after(fed, (1, 2, 2))
    cache.retire(0, first)  # a = 12 = seq_len, aligned: checkpoint at block 2
    assert not cache.conv_state(1)[0].any()
    extended = first + list(rng.integers(0, 50, 5))
    assert cache.admit(1, extended) == 12
    np.testing.assert_array_equal(cache.conv_state(1)[1], _conv_state_after(fed, 3, 2))
    np.testing.assert_array_equal(cache.recurrent_state(1)[1], _recurrent_after(fed, (1, 2, 2)))
    _serve(cache, 1, extended, rng)
    # a retire at an unaligned end publishes blocks but saves no new checkpoint: the old one still serves
    cache.retire(1, extended)  # seq 17, a = 17: not aligned
    assert cache.admit(0, extended) == 12
    cache.check_invariants()


# ---------------------------------------------------------------------- errors


def _err_cache():
    cache = make_cache(PAGED, mixed_specs() + [KVLayerSpec.state((2,), 2)], max_seqs=2, max_seq_len=8, block_size=4)
    step = cache.prepare_step([0, 3], [0], [1])
    return cache, step


K = np.zeros((3, 2, 4), np.float32)
OP_CASES = [
    ("append-cross", lambda c, s: ops.append_kv(c, 2, np.zeros((3, 1, 4), np.float32), np.zeros((3, 1, 4), np.float32), s), TypeError, r"append_kv: layer=2 is CROSS_ATTENTION, must be ATTENTION or SLIDING_WINDOW"),
    ("append-state", lambda c, s: ops.append_kv(c, 3, K, K, s), TypeError, r"append_kv: layer=3 is STATE"),
    ("append-layer-high", lambda c, s: ops.append_kv(c, 4, K, K, s), IndexError, r"append_kv: layer=4 out of range \[0, 4\)"),
    ("append-not-step", lambda c, s: ops.append_kv(c, 0, K, K, {"slot_mapping": []}), TypeError, r"append_kv: step=dict, must be the StepIndices"),
    ("append-not-cache", lambda c, s: ops.append_kv(object(), 0, K, K, s), TypeError, r"append_kv: cache=object, must be a kvref.KVCache"),
    ("append-tokens", lambda c, s: ops.append_kv(c, 0, K[:2], K[:2], s), ValueError, r"append_kv: k.shape\[0\]=2 != step.num_tokens=3"),
    ("append-heads", lambda c, s: ops.append_kv(c, 0, np.zeros((3, 1, 4), np.float32), K, s), ValueError, r"append_kv: k.shape\[1\]=1 != kv_heads=2"),
    ("append-dim", lambda c, s: ops.append_kv(c, 0, K, np.zeros((3, 2, 5), np.float32), s), ValueError, r"append_kv: v.shape\[2\]=5 != head_dim=4"),
    ("append-ndim", lambda c, s: ops.append_kv(c, 0, K[0], K, s), ValueError, r"append_kv: k.ndim=2, must be 3"),
    ("append-int", lambda c, s: ops.append_kv(c, 0, K.astype(np.int64), K, s), TypeError, r"append_kv: k dtype=int64, must be a floating type"),
    ("append-slot-mapping-range", lambda c, s: ops.append_kv(c, 0, K, K, dataclasses.replace(s, slot_mapping=np.array([0, 1, 99], np.int64))), IndexError, r"append_kv: step.slot_mapping\[2\]=99 out of range \[0, 20\)"),
    ("gather-state", lambda c, s: ops.gather_kv(c, 3, 0), TypeError, r"gather_kv: layer=3 is STATE"),
    ("gather-slot", lambda c, s: ops.gather_kv(c, 0, 2), IndexError, r"gather_kv: slot=2 out of range \[0, 2\)"),
    ("gather-slot-type", lambda c, s: ops.gather_kv(c, 0, "1"), TypeError, r"gather_kv: slot='1', must be an int"),
    ("attn-state", lambda c, s: ops.varlen_attention(np.zeros((3, 2, 4), np.float32), c, 3, s), TypeError, r"varlen_attention: layer=3 is STATE"),
    ("attn-gqa", lambda c, s: ops.varlen_attention(np.zeros((3, 3, 4), np.float32), c, 0, s), ValueError, r"varlen_attention: q.shape\[1\]=3 is not a multiple of kv_heads=2"),
    ("attn-tokens", lambda c, s: ops.varlen_attention(np.zeros((2, 2, 4), np.float32), c, 0, s), ValueError, r"varlen_attention: q.shape\[0\]=2 != step.num_tokens=3"),
    ("attn-int", lambda c, s: ops.varlen_attention(np.zeros((3, 2, 4), np.int32), c, 0, s), TypeError, r"varlen_attention: q dtype=int32"),
    ("attn-scale", lambda c, s: ops.varlen_attention(np.zeros((3, 2, 4), np.float32), c, 0, s, scale="x"), TypeError, r"varlen_attention: scale='x', must be a float or None"),
    ("attn-scale-huge", lambda c, s: ops.varlen_attention(np.zeros((3, 2, 4), np.float32), c, 0, s, scale=10**400), ValueError, r"varlen_attention: scale=1000\d+, must be a finite float or None"),
    ("attn-scale-nan", lambda c, s: ops.varlen_attention(np.zeros((3, 2, 4), np.float32), c, 0, s, scale=float("nan")), ValueError, r"varlen_attention: scale=nan, must be a finite float"),
    ("attn-cross-unfilled", lambda c, s: ops.varlen_attention(np.zeros((3, 2, 4), np.float32), c, 2, s), ValueError, r"varlen_attention: step.cross_seqused_k\[0\]=0 for slot 1, fill layer 2 first"),
]


@pytest.mark.parametrize("call, exc, match", [pytest.param(c, e, m, id=i) for i, c, e, m in OP_CASES])
def test_op_errors_leave_cache_unchanged(call, exc, match):
    cache, step = _err_cache()
    before = fingerprint(cache)
    with pytest.raises(exc, match=match):
        call(cache, step)
    assert_unchanged(cache, before)
