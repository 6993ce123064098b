"""Integer extremes on every public integer parameter of the slot cache and its config
(issue 11, items 15-16; ``spec/types.md`` §1, ``spec/slot-cache.md`` §2.8-§2.9).

Each example calls the same method with the same extreme value on a kvref and
a kvfast cache in the same state (paged and contiguous) and checks: the same
outcome (result, or exception type and message), a documented exception type
(never ``OverflowError``/``MemoryError``), and, on a raise, the cache
unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvfast
import kvref
from kvspec import CapacityError, KVCacheConfig, KVCacheMode, KVLayerSpec, LayerKind
from kvspec._config import INT32_MAX

PAGED, CONTIG = KVCacheMode.PAGED, KVCacheMode.CONTIGUOUS
DOCUMENTED = (ValueError, IndexError, TypeError, RuntimeError, CapacityError)

#: values at and around every integer boundary a backend could wrap at
EXTREMES = [0, 1, 2, 3, 4, 7, 8, 16, 17, -1, -2, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32, 2**32 + 1,
            2**53 + 1, 2**62, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, -(2**64), 10**30]


def _as(kind: str, value: int):
    """``value`` as a Python int, or as a NumPy int64/uint64 when it fits."""
    if kind == "i64" and -(2**63) <= value < 2**63:
        return np.int64(value)
    if kind == "u64" and 0 <= value < 2**64:
        return np.uint64(value)
    return value


ints = st.builds(_as, st.sampled_from(["py", "i64", "u64"]), st.sampled_from(EXTREMES) | st.integers(-3, 20))


def _specs():
    return [
        KVLayerSpec.attention(1, 2),
        KVLayerSpec.sliding_window(1, 2, 3),
        KVLayerSpec.cross_attention(1, 2, 3),
        KVLayerSpec.state((2,), 2, recurrent=(1, 1, 2)),
    ]


def _pair(mode):
    """A kvref and a kvfast cache in the same busy state: slot 0 at 8 tokens (paged: an adopted
    prefix of 2 blocks with a state checkpoint), slot 1 at 3 tokens with a filled cross plane,
    slot 2 empty."""
    cfg = KVCacheConfig(4, 3, 16, mode, block_size=4, num_blocks=9 if mode is PAGED else 0, dtype="float32")
    out = []
    for pkg in (kvref, kvfast):
        c = pkg.KVCache.make(cfg, _specs())
        rng = np.random.default_rng(0)
        step = c.prepare_step([0, 8, 11], [0, 0], [0, 1])
        for layer in (0, 1):
            kv = rng.standard_normal((11, 1, 2)).astype(np.float32)
            pkg.ops.append_kv(c, layer, kv, kv, step)
        c.update_position(0, 8)
        c.update_position(1, 3)
        c.fill(2, 1, np.ones((2, 1, 2)), np.ones((2, 1, 2)))
        if mode is PAGED:
            c.conv_state(3)[0] = 1.0
            c.retire(0, list(range(8)))
            assert c.admit(0, list(range(9))) == 8
        out.append((pkg, c))
    return out


def _observe(cache):
    """What a user can see of a cache, as comparable values."""
    arrays = []
    for l, sp in enumerate(cache.layer_specs):
        if sp.kind is LayerKind.STATE:
            arrays += [cache.conv_state(l, 0), cache.recurrent_state(l)]
        else:
            arrays += [cache.keys(l), cache.values(l)]
    table = cache.paged_block_table()
    return (cache.seq_lens().tolist(), None if table is None else table.tolist(), list(cache._free_order()),
            [a.tobytes() for a in arrays])


def _outcome(fn):
    try:
        out = fn()
    except DOCUMENTED as e:
        return ("raise", type(e).__name__, str(e))
    if hasattr(out, "slot_mapping"):
        return ("ok", out.slot_mapping.tolist(), out.positions.tolist(), out.cu_seqlens_k.tolist())
    if isinstance(out, tuple):
        return ("ok", [a.tobytes() for a in out])
    return ("ok", None if out is None else np.asarray(out).tolist())


_NO_KV = np.zeros((0, 1, 2), np.float32)  # the K/V (or q) of an empty step

# One entry per public call taking integers: (name, modes, builder(values) -> call(cache, ops)).
CALLS = {
    "keys": lambda a, b, c: (lambda x, ops: x.keys(a)),
    "values": lambda a, b, c: (lambda x, ops: x.values(a)),
    "conv_state": lambda a, b, c: (lambda x, ops: x.conv_state(a, b)),
    "recurrent_state": lambda a, b, c: (lambda x, ops: x.recurrent_state(a)),
    "update_position": lambda a, b, c: (lambda x, ops: x.update_position(a, b)),
    "evict_batch": lambda a, b, c: (lambda x, ops: x.evict_batch(a)),
    "fill": lambda a, b, c: (lambda x, ops: x.fill(a, b, np.ones((2, 1, 2)), np.ones((2, 1, 2)))),
    "prepare_step-q": lambda a, b, c: (lambda x, ops: x.prepare_step([0, a], [int(x.seq_lens()[2])], [2])),
    "prepare_step-two": lambda a, b, c: (lambda x, ops: x.prepare_step([0, a, b], [0, c], [2, 1])),
    "prepare_step-past": lambda a, b, c: (lambda x, ops: x.prepare_step([0, 1], [a], [b])),
    "prepare_step-cu0": lambda a, b, c: (lambda x, ops: x.prepare_step([a, b], [0], [2])),
    "reserve": lambda a, b, c: (lambda x, ops: x.reserve([a], [b])),
    "reserve-two": lambda a, b, c: (lambda x, ops: x.reserve([2, 1], [a, b])),
    "admit": lambda a, b, c: (lambda x, ops: x.admit(a, list(range(9)), b)),
    "admit-tokens": lambda a, b, c: (lambda x, ops: x.admit(2, [0, 1, 2, 3, a, b, c, 7, 8], -1)),
    "retire": lambda a, b, c: (lambda x, ops: x.retire(a, list(range(9)), b)),
    "retire-tokens": lambda a, b, c: (lambda x, ops: x.retire(1, [a, b, c], -1)),
    "gather_kv": lambda a, b, c: (lambda x, ops: ops.gather_kv(x, a, b)),
    "append_kv": lambda a, b, c: (lambda x, ops: ops.append_kv(x, a, _NO_KV, _NO_KV, x.prepare_step([0], [], []))),
    "varlen_attention": lambda a, b, c: (
        lambda x, ops: ops.varlen_attention(_NO_KV, x, a, x.prepare_step([0], [], []))),
}


@pytest.mark.parametrize("mode", [PAGED, CONTIG], ids=["paged", "contiguous"])
@pytest.mark.parametrize("name", sorted(CALLS))
@settings(max_examples=15)
@given(a=ints, b=ints, c=ints)
def test_integer_extremes_same_outcome_in_both_packages(mode, name, a, b, c):
    caches = _pair(mode)
    outcomes = []
    for pkg, cache in caches:
        before = _observe(cache)
        got = _outcome(lambda: CALLS[name](a, b, c)(cache, pkg.ops))
        if got[0] == "raise":
            assert _observe(cache) == before, f"{pkg.__name__}: {name} raised {got[1:]} and changed the cache"
        cache.check_invariants()
        outcomes.append(got)
    assert outcomes[0] == outcomes[1], (name, a, b, c)


def test_prepare_step_q_near_2_63_is_a_capacity_error():
    """Issue 11 item 15: no wrap, the exact sum in the message, in both packages and both modes."""
    for mode in (PAGED, CONTIG):
        for pkg, cache in _pair(mode):
            before = _observe(cache)
            with pytest.raises(CapacityError, match=r"prepare_step: past_len\[0\]\+q_len\[0\]=0\+9223372036854775807="
                                                    r"9223372036854775807 > max_seq_len=16"):
                cache.prepare_step([0, 2**63 - 1], [0], [2])
            assert _observe(cache) == before
            if mode is PAGED:
                with pytest.raises(CapacityError, match=r"reserve: seq_lens\(\)\[slot 0\]\+n_new_per_seq\[0\]="
                                                        r"8\+9223372036854775807=9223372036854775815 > max_seq_len=16"):
                    cache.reserve([0], [2**63 - 1])
                assert _observe(cache) == before


def test_cu_seqlens_k_beyond_int32_is_refused():
    """Two rows of 2**31 - 2 keys sum past int32 ``cu_seqlens_k``: a CapacityError, not a wrap."""
    L = INT32_MAX
    cfg = KVCacheConfig(1, 2, L, CONTIG)
    msgs = []
    for pkg in (kvref, kvfast):
        cache = pkg.KVCache.make(cfg, [KVLayerSpec.state((1,), 1)])  # no K/V storage: a huge L is cheap
        cache.update_position(0, L - 1)
        cache.update_position(1, L - 1)
        with pytest.raises(CapacityError, match=r"sum\(past_len\+q_len\)=4294967294 > 2147483647") as e:
            cache.prepare_step([0, 1, 2], [L - 1, L - 1], [0, 1])
        msgs.append(str(e.value))
        assert cache.seq_lens().tolist() == [L - 1, L - 1]
        step = cache.prepare_step([0, 1], [L - 1], [0])  # one row at the very end still fits
        assert step.positions.tolist() == [L - 1] and step.slot_mapping.tolist() == [L - 1]
    assert msgs[0] == msgs[1]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_seq_len=2**32), r"KVCacheConfig: max_seq_len=4294967296, must be <= 2147483647"),
        (dict(max_seq_len=2**31), r"max_seq_len=2147483648, must be <= 2147483647"),
        (dict(max_seqs=2**31), r"max_seqs=2147483648, must be <= 2147483647"),
        (dict(num_layers=2**40), r"num_layers=1099511627776, must be <= 2147483647"),
        (dict(block_size=2**63), r"block_size=9223372036854775808, must be <= 2147483647"),
        (dict(num_blocks=2**31), r"num_blocks=2147483648, must be <= 2147483647"),
        (dict(num_state_checkpoints=2**63), r"num_state_checkpoints=9223372036854775808"),
        (dict(hash_seed=2**64), r"hash_seed=18446744073709551616, must be <= 18446744073709551615"),
        (dict(max_seqs=2**20, max_seq_len=2**20, block_size=16),
         r"num_blocks=0 sizes the pool to max_seqs\*ceil\(max_seq_len/block_size\)\+1=68719476737, "
         r"must be <= 2147483647 \(int32 block ids\); give num_blocks"),
    ],
)
def test_config_refuses_sizes_beyond_the_index_dtypes(kwargs, match):
    base = dict(num_layers=1, max_seqs=2, max_seq_len=8, mode=PAGED)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        KVCacheConfig(**base)


def test_config_accepts_the_largest_representable_sizes():
    c = KVCacheConfig(1, INT32_MAX, INT32_MAX, CONTIG, block_size=INT32_MAX)
    assert c.max_blocks_per_seq == 1
    p = KVCacheConfig(1, 1, INT32_MAX, PAGED, block_size=1, num_blocks=INT32_MAX)
    assert p.resolved_num_blocks == INT32_MAX
    # the auto pool size right at the bound: (2**31 - 2) / 2 slots of 2 blocks, plus the null block
    q = KVCacheConfig(1, (2**31 - 2) // 2, 2, PAGED, block_size=1)
    assert q.resolved_num_blocks == INT32_MAX


CONFIG_FIELDS = ["num_layers", "max_seqs", "max_seq_len", "block_size", "num_blocks", "hash_seed",
                 "num_state_checkpoints"]


@settings(max_examples=60)
@given(field=st.sampled_from(CONFIG_FIELDS), value=ints)
def test_config_integer_extremes_are_accepted_or_refused_by_name(field, value):
    base = dict(num_layers=1, max_seqs=2, max_seq_len=8, mode=CONTIG)
    base[field] = value
    try:
        cfg = KVCacheConfig(**base)
    except (ValueError, TypeError) as e:
        assert f"KVCacheConfig: {field}=" in str(e) or "num_blocks=0 sizes" in str(e)
        return
    # accepted: every derived size fits the index dtypes
    assert cfg.max_seq_len <= INT32_MAX and cfg.max_seqs <= INT32_MAX and cfg.num_blocks <= INT32_MAX


SPEC_CALLS = {
    "attention": lambda a, b: KVLayerSpec.attention(a, b),
    "sliding_window": lambda a, b: KVLayerSpec.sliding_window(1, a, b),
    "cross_attention": lambda a, b: KVLayerSpec.cross_attention(a, 1, b),
    "state": lambda a, b: KVLayerSpec.state((a,), b),
    "state-recurrent": lambda a, b: KVLayerSpec.state((), 0, recurrent=(1, a, b)),
}


@settings(max_examples=40)
@given(name=st.sampled_from(sorted(SPEC_CALLS)), a=ints, b=ints)
def test_layer_spec_integer_extremes(name, a, b):
    try:
        spec = SPEC_CALLS[name](a, b)
    except (ValueError, TypeError) as e:
        assert str(e).startswith("KVLayerSpec.")
        return
    sizes = [spec.kv_heads, spec.head_dim, spec.window, spec.max_enc_len, spec.conv_width, *spec.conv_dims,
             *(spec.recurrent or ())]
    assert all(0 <= s <= INT32_MAX for s in sizes)


@settings(max_examples=40)
@given(a=ints, b=ints, c=ints)
def test_largest_max_seq_len_same_outcome_in_both_packages(a, b, c):
    """max_seq_len = 2**31 - 1 (the bound): positions, lengths and sums stay exact in both packages.

    A contiguous cache with only a state layer holds no K/V, so the largest length is cheap.
    """
    L = INT32_MAX
    cfg = KVCacheConfig(1, 3, L, CONTIG)
    outcomes = []
    for pkg in (kvref, kvfast):
        cache = pkg.KVCache.make(cfg, [KVLayerSpec.state((1,), 1)])
        cache.update_position(1, L - 1)
        got = [_outcome(lambda: cache.update_position(0, a))]
        seq = cache.seq_lens()
        got.append(_outcome(lambda: cache.prepare_step([0, b, c], [int(seq[0]), int(seq[1])], [0, 1])))
        got.append(_outcome(lambda: cache.prepare_step([0, b], [int(seq[1])], [1])))
        got.append(cache.seq_lens().tolist())
        cache.check_invariants()
        outcomes.append(got)
    assert outcomes[0] == outcomes[1], (a, b, c)
    for step in outcomes[0][1:3]:
        if step[0] == "ok":
            assert all(0 <= p < L for p in step[2]), "positions wrapped"


@pytest.mark.parametrize("mode", [PAGED, CONTIG])
@pytest.mark.parametrize("past_of_row_1", [
    3, np.int64(3), True, 3.0, 2**63, -(2**63) - 1, "3", [3],
], ids=["int", "np.int64", "bool", "float", "2**63", "-2**63-1", "str", "nested"])
def test_list_inputs_match_their_numpy_arrays(mode, past_of_row_1):
    """A list of Python ints takes ``prepare_step``'s packed int64 path; a list that path cannot
    convert exactly (a float, a str, a nested list, a value beyond int64) falls back to NumPy's
    conversion: either way the outcome (StepIndices, or exception type and message) is the one of
    ``np.asarray`` of the same list, in both packages, and a raise leaves the cache unchanged."""
    cu, past, slots = [0, 1, 2], [8, past_of_row_1], [0, 1]
    outcomes = []
    for pkg, cache in _pair(mode):
        for form in ("list", "tuple", "numpy"):
            if form == "numpy":
                try:
                    args = (np.asarray(cu), np.asarray(past), np.asarray(slots))
                except (TypeError, ValueError, OverflowError):
                    continue  # NumPy itself refuses the list (a nested one): the list forms are compared
            else:
                wrap = list if form == "list" else tuple
                args = (wrap(cu), wrap(past), wrap(slots))
            before = _observe(cache)
            got = _outcome(lambda: cache.prepare_step(*args))
            if got[0] == "raise":
                assert _observe(cache) == before, f"{pkg.__name__} {form}: raised and changed the cache"
            outcomes.append(got)
    assert all(o == outcomes[0] for o in outcomes), outcomes
