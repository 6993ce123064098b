"""kvfast manager fast lanes (claim, decode alloc, step fill, release) against kvref.

Each case drives both managers through the same calls and compares return
values, exceptions (type and message), block tables, free order and metrics;
after an exception the state must be unchanged.
"""

import contextlib

import numpy as np
import pytest

import kvfast
import kvref
from kvspec import CompletedTransfer, KVCacheParams, LeafSpec, TextContext
from kvspec.errors import InsufficientBlocksError
from kvspec.hashing import collide_hashes

from _pool_sizes import holdable  # noqa: E402

PAGE = 4


def _pair(num_blocks=12, max_seq_len=None):
    p = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2)
    if max_seq_len is None:  # the longest the pool holds, at most 64 (spec/manager.md §1.6)
        max_seq_len = holdable(kvref.PagedKVCacheManager, p, num_blocks, 64)
    kw = dict(num_blocks=num_blocks, max_batch_size=4, max_seq_len=max_seq_len)
    return kvref.PagedKVCacheManager(p, **kw), kvfast.PagedKVCacheManager(p, **kw)


def _outcome(fn):
    try:
        v = fn()
        return ("ok", "CompletedTransfer" if isinstance(v, CompletedTransfer) else v)
    except Exception as e:
        return ("err", type(e), str(e))


def _state(m, ctxs):
    return (
        [m.get_req_blocks_per_leaf(c) if m.contains(c) else None for c in ctxs],
        m._free_order(),
        m.get_metrics_aggregated(),
        [(c.processed_length, c.active_length, c.cached_prefix_length) for c in ctxs],
    )


def _both(pair, ctx_pairs, name, *args, **kw):
    (r, f), (rc, fc) = pair, ctx_pairs
    a = _outcome(lambda: getattr(r, name)(rc, *args, **kw))
    b = _outcome(lambda: getattr(f, name)(fc, *args, **kw))
    assert a == b, (name, a, b)
    assert _state(r, [rc]) == _state(f, [fc])
    return a


def _ctxs(rid, tokens):
    return TextContext(rid, tokens), TextContext(rid, tokens)


def _admitted(pair, rid, tokens):
    """The request's two contexts, claimed and allocated on both managers."""
    c = _ctxs(rid, tokens)
    _both(pair, c, "claim")
    _both(pair, c, "alloc")
    return c


def test_claim_errors_match_reference():
    pair = _pair(max_seq_len=8)
    ok = _ctxs("a", np.arange(5))
    assert _both(pair, ok, "claim")[0] == "ok"
    assert _both(pair, ok, "claim")[1] is ValueError  # already claimed
    long = _ctxs("b", np.arange(9))
    assert _both(pair, long, "claim")[1] is ValueError  # len > max_seq_len
    c = _ctxs("c", np.arange(3))
    assert _both(pair, c, "claim", 1)[1] is IndexError  # replica out of range
    assert _both(pair, c, "claim", True)[1] is TypeError  # a bool is not a replica index
    assert _both(pair, c, "claim", np.int64(0))[0] == "ok"  # numpy ints take the reference path


def test_decode_lifecycle_with_fills_and_growth_matches_reference():
    pair = _pair(num_blocks=40)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 100, 10)
    cs = [_ctxs(f"r{i}", prompt) for i in range(3)]  # same prompt: later ones hit the first's blocks
    for c in cs:
        _both(pair, c, "claim")
        _both(pair, c, "alloc")
        c[0].skip_processing(c[0].active_length - 1)
        c[1].skip_processing(c[1].active_length - 1)
        _both(pair, c, "step")
    for t in range(13):  # crosses page boundaries: fills, publishes and grows rows
        for c in cs:
            _both(pair, c, "alloc")
            c[0].update(int(t))
            c[1].update(int(t))
            _both(pair, c, "step")
    for c in cs:
        _both(pair, c, "release")
        assert _both(pair, c, "release")[1] is ValueError  # second release
    pair[1].check_invariants()


def test_decode_growth_without_free_blocks_raises_and_changes_nothing():
    pair = _pair(num_blocks=5)  # 4 usable blocks (max_seq_len 16: spec/manager.md §1.6)
    h = _admitted(pair, "h", np.arange(100, 103))  # holds the 4th block
    c = _admitted(pair, "a", np.arange(12))  # exactly 3 blocks
    for ctx in c:
        ctx.skip_processing(11)
    _both(pair, c, "step")
    for ctx in c:
        ctx.update(5)  # the 13th token needs a 4th block
    out = _both(pair, c, "alloc")
    assert out[0] == "err" and out[1] is InsufficientBlocksError


def test_step_past_the_rows_raises_like_reference():
    pair = _pair()
    c = _admitted(pair, "a", np.arange(6))
    for ctx in c:
        ctx.skip_processing(5)
        for t in (1, 2, 3, 4):  # processed_length 9 > 2 blocks * 4 tokens
            ctx.update(t)
    out = _both(pair, c, "step")
    assert out[0] == "err" and out[1] is ValueError


def test_release_by_request_id_and_replacement_context():
    pair = _pair()
    c = _admitted(pair, "a", np.arange(9))
    r, f = pair
    assert _outcome(lambda: r.release("a")) == _outcome(lambda: f.release("a"))
    assert r._free_order() == f._free_order()
    c2 = _admitted(pair, "b", np.arange(9))
    fresh = _ctxs("b", np.arange(9))  # a new object for a claimed id replaces the old one (Spec §2.3)
    _both(pair, fresh, "release")


def test_splice_near_capacity_counts_revived_hits_exactly():
    # The second request hits 2 free cached blocks; whether it fits depends on counting
    # them as revived (they leave the free list) exactly.
    pair = _pair(num_blocks=6)  # 5 usable
    prompt = np.arange(9)  # 3 blocks, 2 hashable
    a = _admitted(pair, "a", prompt)
    for ctx in a:
        ctx.skip_processing(8)
    _both(pair, a, "step")
    _both(pair, a, "release")  # 2 published blocks now free and cached
    filler = _admitted(pair, "f", np.arange(100, 104))  # takes the unpublished free block first
    b = _ctxs("b", np.concatenate([prompt[:8], np.arange(200, 209)]))  # 2 hits + 3 more blocks
    _both(pair, b, "claim")
    out = _both(pair, b, "alloc")  # needs 3 more, 4 free of which 2 are its revived hits
    assert out[0] == "err" and out[1] is InsufficientBlocksError
    c = _ctxs("c", np.concatenate([prompt[:8], np.arange(300, 306)]))
    _both(pair, c, "claim")
    assert _both(pair, c, "alloc")[0] == "ok"  # needs 2 more: fits exactly
    assert c[1].cached_prefix_length == 8
    pair[1].check_invariants()


def _inputs_fields(out):
    """Every field of a ``KVCacheInputs`` as plain values (arrays as (dtype, shape, list))."""
    rows = []
    for per in out.inputs:
        for lid, x in sorted(per.items()) if isinstance(per, dict) else [("", per)]:
            rows.append((lid, x.lookup_table.dtype.str, x.lookup_table.shape, x.lookup_table.tolist(),
                         x.cache_lengths.dtype.str, x.cache_lengths.tolist(),
                         x.max_prompt_length, x.max_cache_length,
                         None if x.page_stride is None else x.page_stride.tolist()))
    return rows


def test_inputs_plan_serves_capture_widths_and_empty_batches(monkeypatch):
    """``runtime_inputs`` with ``max_cache_length`` (a CUDA-graph capture width) and with an empty
    replica batch is served by kvfast's lane (the policy's method is made to fail), with the
    reference's results; every bad width goes to the policy, which raises the reference's error."""
    from kvspec import LeafSpec

    for leaves in ({}, {"leaves": {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(8)}},
                   {"leaves": {"full": LeafSpec.full(), "rec": LeafSpec.recurrent((2,))}}):
        p = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, data_parallel_degree=2, **leaves)
        ms = [pkg.PagedKVCacheManager(p, num_blocks=64, max_batch_size=4, max_seq_len=128) for pkg in (kvref, kvfast)]
        cs = []
        for m in ms:
            c = TextContext("a", np.arange(50))
            m.claim(c, 0)
            m.alloc(c)
            cs.append(c)
        calls = [([[0], []], None), ([[0], []], 100), ([[0], []], 52), ([[0], []], 128)]
        if "rec" not in p.leaves():
            calls += [([[], []], None), ([[], []], 9)]
        want = [_inputs_fields(ms[0].runtime_inputs([[cs[0]] * len(b) for b in bs], max_cache_length=w))
                for bs, w in calls]
        with monkeypatch.context() as mp:
            mp.setattr(kvref.PagedKVCacheManager, "runtime_inputs",
                       lambda *a, **k: (_ for _ in ()).throw(AssertionError("the policy ran")))
            got = [_inputs_fields(ms[1].runtime_inputs([[cs[1]] * len(b) for b in bs], max_cache_length=w))
                   for bs, w in calls]
        assert got == want
        for bad in (0, 48, 129, True, 3.0):  # (4) and the type check: the policy's messages
            errs = [_outcome(lambda m=m, c=c, bad=bad: m.runtime_inputs([[c], []], max_cache_length=bad))
                    for m, c in zip(ms, cs)]
            assert errs[0] == errs[1] and errs[0][0] == "err", errs
        if "rec" in p.leaves():
            errs = [_outcome(lambda m=m: m.runtime_inputs([[], []])) for m in ms]
            assert errs[0] == errs[1] and errs[0][0] == "err", errs


def _leaf_sets():
    return {
        "full": {"full": LeafSpec.full()},
        "full+swa": {"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(2 * PAGE + 1)},
        "full+rec": {"full": LeafSpec.full(), "rec": LeafSpec.recurrent((2, 2))},
        "swa+full": {"swa": LeafSpec.sliding_window(PAGE + 1), "full": LeafSpec.full()},
    }


@pytest.mark.parametrize("leaves", sorted(_leaf_sets()))
@pytest.mark.parametrize("collide", [False, True], ids=["distinct", "colliding"])
def test_decode_fills_of_every_leaf_set_match_reference(leaves, collide):
    """spec/manager.md §5.1-§5.3 at the decode step that fills a block (kvfast's fill lane for one
    leaf and for several): with every block hash colliding (``collide_hashes``: the hash ignores
    the tokens) a request whose tokens differ from the published chain's loses the collision at the
    anchor, its chain stops there and every later fill's parent check fails; twins (identical
    prompts decoding identical tokens) switch to the published page. Rows, committed hits, free
    order, metrics and invariants agree with kvref at every step."""
    params = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, leaves=_leaf_sets()[leaves])
    kw = dict(num_blocks=40 * len(params.leaves()), max_batch_size=4, max_seq_len=48)
    ms = kvref.PagedKVCacheManager(params, **kw), kvfast.PagedKVCacheManager(params, **kw)
    prompts = {"a": [1, 2, 3, 4, 5, 6], "twin": [1, 2, 3, 4, 5, 6], "other": [9, 8, 7, 6, 5, 4], "short": [3]}
    rng = np.random.default_rng(3)
    with collide_hashes() if collide else contextlib.nullcontext():
        ctxs = [{rid: TextContext(rid, p) for rid, p in prompts.items()} for _ in ms]
        for rid in prompts:
            for m, cs in zip(ms, ctxs):
                m.claim(cs[rid])
                m.alloc(cs[rid])
        for step in range(3 * PAGE + 1):
            # the twin decodes what "a" decodes (its filled blocks are twins of a's); the others
            # decode their own tokens
            tok = {"a": int(rng.integers(0, 50)), "other": int(rng.integers(0, 50)), "short": 11}
            tok["twin"] = tok["a"]
            for rid in prompts:
                got = []
                for m, cs in zip(ms, ctxs):
                    ctx = cs[rid]
                    m.alloc(ctx)
                    ctx.update(tok[rid])
                    m.step(ctx)
                    req = m._requests[rid]
                    got.append((_state(m, [ctx]), req.committed, len(req.hashes)))
                assert got[0] == got[1], (step, rid, got)
            for m in ms:
                m.check_invariants()
        committed = {rid: ms[1]._requests[rid].committed for rid in prompts}
        for rid in prompts:
            for m, cs in zip(ms, ctxs):
                m.release(cs[rid])
        assert ms[0]._free_order() == ms[1]._free_order()
    if collide:  # "other" collides with a's chain at block 0: nothing of it is ever published
        assert committed["other"] == 0 and committed["a"] > 1
    else:
        assert min(committed.values()) > 0


def _fails(name):
    def fail(*args, **kwargs):
        raise AssertionError(f"the policy's {name} ran")
    return fail


@pytest.mark.parametrize("leaves", ["full+swa", "full+rec", "swa+full", "swa"])
def test_admission_step_and_release_lanes_of_several_leaves(leaves, monkeypatch):
    """kvfast's lanes for several leaves, or one leaf that is not a full leaf (issue 12): the
    admission's splice (the joint hit over the leaves, each leaf's part, one slab check, the slab's
    draw per leaf, a recurrent leaf's state restored from its checkpoint), the step that commits a
    prefill then slides or checkpoints, and the release serve every kvfast call here: the policy's
    ``alloc``, ``step`` and ``release`` are made to fail while kvfast runs, after kvref ran the same
    call. Outcomes (an admission the slab cannot serve raises the reference's error, from the lane,
    and changes nothing), rows, hits, every leaf's free order, metrics, the huge blocks' owners,
    live counts and parked queue, and the request's phase agree."""
    sets = dict(_leaf_sets(), swa={"swa": LeafSpec.sliding_window(2 * PAGE + 1)})
    params = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, leaves=sets[leaves])
    ms = [pkg.PagedKVCacheManager(params, num_blocks=10 * len(params.leaves()), max_batch_size=4, max_seq_len=32)
          for pkg in (kvref, kvfast)]

    def state(m, ctx):
        return ([m.get_req_blocks_per_leaf(ctx) if m.contains(ctx) else None],
                [m._free_order(0, lid) for lid in params.leaves()], m.get_metrics_aggregated(),
                (ctx.processed_length, ctx.active_length, ctx.cached_prefix_length))

    def slab_state(m):
        if not m._slabs:  # one sliding leaf: its own pool, no slab (the lane's per-leaf check)
            return None
        t = m._slabs[0].table
        return t.owners(), t.live_counts(), t.parked_order()

    def both(name, pair, *args):
        a = _outcome(lambda: getattr(ms[0], name)(pair[0], *args))
        with monkeypatch.context() as mp:
            for policy in ("alloc", "step", "release"):
                mp.setattr(kvref.PagedKVCacheManager, policy, _fails(policy))
            b = _outcome(lambda: getattr(ms[1], name)(pair[1], *args))
        assert a == b, (name, a, b)
        assert state(ms[0], pair[0]) == state(ms[1], pair[1])
        assert slab_state(ms[0]) == slab_state(ms[1])
        # the request's lifecycle too: the first step after an admission clears its flags
        phases = [m._requests[c.request_id].phase if m.contains(c) else None for m, c in zip(ms, pair)]
        assert phases[0] == phases[1], (name, phases)
        return a

    def admit(rid, tokens):
        pair = _ctxs(rid, tokens)
        for m, ctx in zip(ms, pair):
            m.claim(ctx)
        return pair, both("alloc", pair)

    first = list(range(1, 5 * PAGE + 2))  # 5 full blocks and a token
    a, out = admit("a", first)
    assert out[0] == "ok" and a[1].cached_prefix_length == 0
    for ctx in a:  # the prefill's forward: every token but the last, 5 whole pages (a checkpoint)
        ctx.skip_processing(5 * PAGE)
    both("step", a)
    b, out = admit("b", first[: 5 * PAGE] + [60, 61, 62])  # shares a's 5 blocks and its checkpoint
    assert out[0] == "ok" and b[1].cached_prefix_length == 5 * PAGE
    for ctx in b:
        ctx.skip_processing(ctx.active_length - 1)
    both("step", b)
    held = [a, b]
    for i in range(8):  # 8 pages a paged leaf each, until the slab cannot serve one
        c, out = admit(f"c{i}", list(range(100 + 40 * i, 132 + 40 * i)))
        if out[0] == "err":
            break
        held.append(c)
    assert out[0] == "err" and out[1] is InsufficientBlocksError, out
    assert ms[1].get_req_blocks_per_leaf(c[1]) == {lid: [] for lid in params.leaves()}
    for pair in held:
        both("release", pair)
    assert both("alloc", c)[0] == "ok"  # the pages the others let go serve it now
    for m in ms:
        m.check_invariants()
