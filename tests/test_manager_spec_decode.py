"""Speculative decoding in the request manager (spec/manager.md §15), kvref and kvfast.

The first tests port MAX's speculative-decoding manager tests
(``max/tests/integration/nn/kv_cache/test_kv_cache_manager.py`` and
``max/tests/integration/kv_cache/jenga/test_jenga_cache_manager.py``) to our
API; the rest pin what we add: rollback of rejected drafts, verified-only
publishing (page bytes included), equal prefix hits with and without
speculation, refusals that leave state unchanged, and kvref == kvfast.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvspec import (
    InsufficientBlocksError,
    KVCacheParams,
    SpecDecodingState,
    TextContext,
    spec_decode_cache_slack,
)

import kvfast
import kvref

PKGS = [kvref, kvfast]
IDS = ["kvref", "kvfast"]


def _params(page=4, *, num_layers=1, kv_heads=1, head_dim=2, **kw) -> KVCacheParams:
    kw.setdefault("dtype", "float32")
    return KVCacheParams(page_size=page, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim, **kw)


def _manager(pkg, params, num_blocks=17, max_seq_len=32, max_batch_size=8):
    return pkg.PagedKVCacheManager(params, num_blocks=num_blocks, max_batch_size=max_batch_size,
                                   max_seq_len=max_seq_len)


def _blocks(m, ctx) -> list[int]:
    return m.get_req_blocks_per_leaf(ctx)["full"]


# ------------------------------------------------------------------ MAX's tests, ported


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_alloc_num_speculative_steps_allocates_extra_blocks(pkg):
    """MAX: 3 tokens + 1 step - 1 = 3 -> 1 block; with 4 drafts 3 + 2*4 = 11 -> 3 blocks (page 4)."""
    base = _manager(pkg, _params())
    spec = _manager(pkg, _params(num_draft_tokens=4))
    ctx = TextContext("a", np.array([1, 2, 3]))
    base.claim(ctx)
    base.alloc(ctx)
    assert len(_blocks(base, ctx)) == 1
    base.release(ctx)
    ctx2 = TextContext("b", np.array([1, 2, 3]))
    spec.claim(ctx2)
    spec.alloc(ctx2)
    assert len(_blocks(spec, ctx2)) == 3


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_alloc_spec_decoding_empty_draft_tokens_allocates_same_as_dummy(pkg):
    """MAX: the block count does not depend on whether draft_tokens_to_verify is filled."""
    m = _manager(pkg, _params(num_draft_tokens=4))
    empty = TextContext("empty", np.array([1, 2, 3]))
    assert empty.spec_decoding_state.draft_tokens_to_verify == []
    m.claim(empty)
    m.alloc(empty)
    n_empty = len(_blocks(m, empty))
    m.release(empty)
    dummy = TextContext("dummy", np.array([1, 2, 3]))
    dummy.spec_decoding_state.draft_tokens_to_verify = [42] * 4
    m.claim(dummy)
    m.alloc(dummy)
    n_dummy = len(_blocks(m, dummy))
    m.release(dummy)
    assert n_empty == n_dummy == 3


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_alloc_with_draft_tokens_to_verify_reserves_more_blocks(pkg):
    """MAX: 3 tokens + 0 maybe_accepted + 2*4 drafts + 1 - 1 = 11 -> 3 blocks."""
    m = _manager(pkg, _params(num_draft_tokens=4))
    ctx = TextContext("a", np.array([1, 2, 3]))
    ctx.spec_decoding_state.draft_tokens_to_verify = [10, 20, 30]
    m.claim(ctx)
    m.alloc(ctx)
    assert len(_blocks(m, ctx)) == 3
    assert m.num_req_blocks(ctx) == 3


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_runtime_inputs_with_num_speculative_steps(pkg):
    m = _manager(pkg, _params(num_draft_tokens=4))
    ctx = TextContext("a", np.array([1, 2, 3]))
    m.claim(ctx)
    m.alloc(ctx)
    inputs = m.runtime_inputs_for_leaf("full", [[ctx]])
    assert len(inputs.inputs) == 1
    assert inputs.inputs[0].lookup_table.shape == (1, 8)
    assert inputs.inputs[0].lookup_table[0, :3].tolist() == _blocks(m, ctx)


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_num_draft_tokens_per_step_threaded_from_params(pkg):
    """MAX (Jenga): dflash's block drafts write num_draft_tokens per step; eagle/mtp one; none 0."""
    assert _params(speculative_method="dflash", num_draft_tokens=3).num_draft_tokens_per_step == 3
    assert _params(speculative_method="dflash2", num_draft_tokens=3).num_draft_tokens_per_step == 3
    assert _params(speculative_method="eagle", num_draft_tokens=3).num_draft_tokens_per_step == 1
    assert _params(speculative_method="mtp", num_draft_tokens=2).num_draft_tokens_per_step == 1
    assert _params(num_draft_tokens=3).num_draft_tokens_per_step == 0
    assert _params().num_draft_tokens_per_step == 0
    # the block-draft slot: 3 tokens + 2*3 + 1 = 10 slots -> 10 blocks of 1 (eagle: 9)
    for method, blocks in (("dflash", 10), ("eagle", 9)):
        m = _manager(pkg, _params(page=1, speculative_method=method, num_draft_tokens=3), num_blocks=40,
                     max_seq_len=16)
        ctx = TextContext("a", np.arange(3))
        m.claim(ctx)
        m.alloc(ctx)
        assert len(_blocks(m, ctx)) == blocks


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_alloc_reserves_the_draft_positions_runtime_inputs_will_ask_for(pkg):
    """MAX (Jenga): alloc and the runtime_inputs boundary both size from num_draft_tokens."""
    m = _manager(pkg, _params(page=1, speculative_method="eagle", num_draft_tokens=3), num_blocks=40,
                 max_seq_len=16)
    ctx = TextContext("a", np.arange(3))
    m.claim(ctx)
    m.alloc(ctx)
    m.runtime_inputs([[ctx]])  # not raising is the assertion
    ctx.spec_decoding_state.maybe_accepted_draft_tokens = [5]  # one more slot than alloc drew
    with pytest.raises(ValueError, match=r"< seq_len=10; it does not have sufficient blocks"):
        m.runtime_inputs([[ctx]])


# ------------------------------------------------------------------ params, slack, lengths


def test_spec_decode_cache_slack_is_maxs_formula():
    assert spec_decode_cache_slack(_params()) == 0
    assert spec_decode_cache_slack(_params(num_draft_tokens=4)) == 13  # 3*4 + 0 + 1
    assert spec_decode_cache_slack(_params(speculative_method="eagle", num_draft_tokens=4)) == 13
    assert spec_decode_cache_slack(_params(speculative_method="dflash", num_draft_tokens=4)) == 14
    with pytest.raises(TypeError, match="must be a KVCacheParams"):
        spec_decode_cache_slack("params")


def test_params_draft_fields_are_validated_and_in_identity():
    a = _params(speculative_method="eagle", num_draft_tokens=2)
    assert a == _params(speculative_method="eagle", num_draft_tokens=2)
    assert hash(a) == hash(_params(speculative_method="eagle", num_draft_tokens=2))
    assert a != _params(speculative_method="mtp", num_draft_tokens=2)
    assert a != _params(speculative_method="eagle", num_draft_tokens=3)
    assert "speculative_method='eagle'" in repr(a) and "num_draft_tokens=2" in repr(a)
    with pytest.raises(ValueError, match=r"speculative_method='medusa', must be None or one of"):
        _params(speculative_method="medusa", num_draft_tokens=2)
    with pytest.raises(ValueError, match=r"speculative_method='eagle' needs num_draft_tokens >= 1, got 0"):
        _params(speculative_method="eagle")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        _params(num_draft_tokens=-1)
    with pytest.raises(TypeError, match="num_draft_tokens"):
        _params(num_draft_tokens=2.0)


def test_context_spec_decoding_state_is_lazy_and_reset_drops_it():
    ctx = TextContext("a", [0, 1, 2, 3])
    state = ctx.spec_decoding_state
    assert isinstance(state, SpecDecodingState) and state.draft_tokens_to_verify == []
    assert ctx.spec_decoding_state is state
    state.draft_tokens_to_verify = [10, 20, 30]
    ctx.update(4)
    ctx.reset()
    fresh = ctx.spec_decoding_state
    assert fresh is not state and fresh.draft_tokens_to_verify == [] and fresh.maybe_accepted_draft_tokens == []
    assert "_spec_decoding_state" in TextContext.__slots__


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_runtime_inputs_lengths_follow_maxs_formulas(pkg):
    """cache_lengths = processed + maybe_accepted; max_prompt = active + drafts to verify;
    max_cache = processed + maybe + active + drafts + num_draft_tokens."""
    k = 3
    m = _manager(pkg, _params(page=2, speculative_method="eagle", num_draft_tokens=k), num_blocks=40)
    a, b = TextContext("a", np.arange(5)), TextContext("b", np.arange(100, 103))
    for c in (a, b):
        m.claim(c)
        m.alloc(c)
        c.update(7)
        m.step(c)
    a.spec_decoding_state.draft_tokens_to_verify = [1, 2, 3]
    a.spec_decoding_state.maybe_accepted_draft_tokens = [4, 5]
    b.spec_decoding_state.draft_tokens_to_verify = [9]
    for c in (a, b):
        m.alloc(c)
    assert m.num_req_blocks(a) == -(-(6 + 2 + 2 * k) // 2)
    inp = m.runtime_inputs([[a, b]]).inputs[0]
    assert np.asarray(inp.cache_lengths).tolist() == [5 + 2, 3 + 0]
    assert inp.max_prompt_length == max(1 + 3, 1 + 1)
    assert inp.max_cache_length == max(5 + 2 + 1 + 3 + k, 3 + 0 + 1 + 1 + k)
    # a capture bound may reach max_seq_len + slack, not beyond
    slack = spec_decode_cache_slack(m.params)
    m.runtime_inputs([[a, b]], max_cache_length=32 + slack)
    with pytest.raises(ValueError, match=rf"max_cache_length={33 + slack} > max_seq_len=32 \+ "
                                         rf"spec_decode_cache_slack={slack}"):
        m.runtime_inputs([[a, b]], max_cache_length=33 + slack)


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_effective_max_seq_length_and_construction_count_the_slack(pkg):
    p = _params(page=4, num_draft_tokens=4)  # slack 13
    m = _manager(pkg, p, num_blocks=17, max_seq_len=48)
    assert m.effective_max_seq_length == min(48, 16 * 4 - 13)
    assert _manager(pkg, _params(page=4), num_blocks=17, max_seq_len=64).effective_max_seq_length == 64
    with pytest.raises(ValueError, match=r"max_seq_len=56 \+ spec_decode_cache_slack=13 needs 18 pages"):
        _manager(pkg, p, num_blocks=17, max_seq_len=56)


# ------------------------------------------------------------------ refusals leave state unchanged


def _state(m, ctxs) -> tuple:
    return (m.get_metrics_aggregated(), m.block_count(0), list(m._free_order(0)),
            [(m.get_req_blocks_per_leaf(c) if m.contains(c) else None, c.processed_length, c.active_length,
              c.cached_prefix_length) for c in ctxs])


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_refusals_leave_state_unchanged(pkg):
    m = _manager(pkg, _params(page=2, num_draft_tokens=2), num_blocks=12, max_seq_len=8)
    a = TextContext("a", np.arange(6))
    m.claim(a)
    m.alloc(a)
    a.update(9)
    m.step(a)
    before = _state(m, [a])
    a.spec_decoding_state.draft_tokens_to_verify = [1, 2, 3]
    with pytest.raises(ValueError, match=r"alloc: len\(ctx.spec_decoding_state.draft_tokens_to_verify\)=3 > "
                                         r"params.num_draft_tokens=2"):
        m.alloc(a)
    assert _state(m, [a]) == before
    with pytest.raises(ValueError, match=r"runtime_inputs: len\(batches\[0\]\[0\].spec_decoding_state."
                                         r"draft_tokens_to_verify\)=3 > params.num_draft_tokens=2"):
        m.runtime_inputs([[a]])
    a.spec_decoding_state.draft_tokens_to_verify = 7
    with pytest.raises(TypeError, match=r"draft_tokens_to_verify=7, must be a list, tuple or 1-D array of ints"):
        m.alloc(a)
    assert _state(m, [a]) == before
    a.spec_decoding_state.draft_tokens_to_verify = np.array([1, 2, 3])
    with pytest.raises(ValueError, match=r"draft_tokens_to_verify\)=3 > params.num_draft_tokens=2"):
        m.alloc(a)
    assert _state(m, [a]) == before
    a.spec_decoding_state.draft_tokens_to_verify = [1, 2]
    m.alloc(a)
    assert len(_blocks(m, a)) == 6  # 7 tokens + 2*2 drafts = 11 slots
    # the slack does not fit beside a: InsufficientBlocksError, nothing drawn
    b = TextContext("b", np.arange(50, 58))
    m.claim(b)
    before = _state(m, [a, b])
    with pytest.raises(InsufficientBlocksError, match=r"needs 6 blocks of leaf 'full', 5 free or evictable"):
        m.alloc(b)
    assert _state(m, [a, b]) == before
    m.release(a)
    m.alloc(b)
    assert len(_blocks(m, b)) == 6


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_a_manager_without_drafts_refuses_drafts(pkg):
    m = _manager(pkg, _params())
    ctx = TextContext("a", np.arange(5))
    m.claim(ctx)
    m.alloc(ctx)
    ctx.update(1)
    m.step(ctx)
    before = _state(m, [ctx])
    ctx.spec_decoding_state.draft_tokens_to_verify = [3]
    with pytest.raises(ValueError, match=r"params.num_draft_tokens=0"):
        m.alloc(ctx)
    with pytest.raises(ValueError, match=r"params.num_draft_tokens=0"):
        m.runtime_inputs([[ctx]])
    assert _state(m, [ctx]) == before
    ctx.spec_decoding_state.draft_tokens_to_verify = []  # an empty state is no draft
    m.alloc(ctx)
    m.runtime_inputs([[ctx]])


# ------------------------------------------------------------------ rollback


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_rows_shrink_after_in_flight_drafts_are_rejected(pkg):
    """Overlap scheduling: alloc counts the in-flight drafts as cached; when only some are
    accepted, the next alloc frees the pages past the need, tail first, unpublished (front)."""
    k = 4
    m = _manager(pkg, _params(page=2, speculative_method="eagle", num_draft_tokens=k), num_blocks=24)
    ctx = TextContext("a", np.arange(8))
    m.claim(ctx)
    m.alloc(ctx)
    ctx.update(100)
    m.step(ctx)  # processed 8, active 1
    ctx.spec_decoding_state.maybe_accepted_draft_tokens = [1, 2, 3, 4]
    m.alloc(ctx)
    wide = _blocks(m, ctx)
    assert len(wide) == -(-(9 + 4 + 2 * k) // 2) == 11
    # the in-flight forward accepted one draft and produced a bonus token; no drafts in flight now
    ctx.update(1)
    ctx.update(101)
    ctx.spec_decoding_state.maybe_accepted_draft_tokens = []
    m.step(ctx)
    free_before = m.block_count(0).free
    m.alloc(ctx)
    rows = _blocks(m, ctx)
    assert len(rows) == -(-(11 + 2 * k) // 2) == 10
    assert rows == wide[:10]
    assert m.block_count(0).free == free_before + 1
    assert m._free_order(0)[0] == wide[10]  # unpublished: front of the free list
    m.check_invariants()


# ------------------------------------------------------------------ a speculative decode loop


def _value(token: int, pos: int) -> float:
    return float(token * 1000 + pos + 1)


def _write(m, ctx, tokens_at) -> None:
    """Write K/V for positions ``processed .. processed + len(tokens_at) - 1`` (the active tokens
    then the drafts), value ``_value(token, pos)``: what a verifying forward writes."""
    buf, page = m.get_device_buffer(0), m.params.page_size
    rows = _blocks(m, ctx)
    for j, t in enumerate(tokens_at):
        p = ctx.processed_length + j
        buf[rows[p // page], :, :, p % page] = _value(t, p)


def _decode(m, ctx, target: list[int], rng, k: int, *, write: bool = True) -> None:
    """Decode ``ctx`` until it holds ``target``; with ``k`` > 0 each forward verifies ``k`` drafts
    (each correct with probability 1/2, so a random prefix is accepted) and appends the accepted
    drafts and the bonus token. Releases at the end."""
    while len(ctx) < len(target):
        m.alloc(ctx)
        m.runtime_inputs([[ctx]])
        state = ctx.spec_decoding_state if k else None
        drafts = list(state.draft_tokens_to_verify) if k else []
        if write:
            _write(m, ctx, list(ctx.active_tokens) + drafts)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == target[len(ctx) + accepted]:
            accepted += 1
        for t in target[len(ctx): len(ctx) + accepted + 1]:
            ctx.update(t)
        if k:  # the next drafts: each right with probability 1/2
            nxt = target[len(ctx): len(ctx) + k]
            state.draft_tokens_to_verify = [t if rng.random() < 0.5 else -1 - t for t in nxt]
        m.step(ctx)
    m.release(ctx)


def _workload(seed: int = 0, n: int = 12):
    """Requests sharing system prompts, each with its decoded continuation (fixed by the model)."""
    rng = np.random.default_rng(seed)
    systems = [list(rng.integers(0, 50, 9)) for _ in range(3)]
    out = []
    for i in range(n):
        prompt = systems[i % 3] + list(rng.integers(0, 50, int(rng.integers(1, 6))))
        target = prompt + list(rng.integers(0, 50, int(rng.integers(3, 12))))
        out.append((f"r{i}", [int(t) for t in prompt], [int(t) for t in target]))
    return out


def _run(pkg, k: int, seed: int = 0, *, write: bool = True, **params):
    m = _manager(pkg, _params(page=4, speculative_method="eagle" if k else None, num_draft_tokens=k, **params),
                 num_blocks=64, max_seq_len=32)
    rng = np.random.default_rng(seed + 1)
    hits = []
    for rid, prompt, target in _workload(seed):
        ctx = TextContext(rid, np.array(prompt))
        m.claim(ctx)
        m.alloc(ctx)
        hits.append(ctx.cached_prefix_length)
        _decode(m, ctx, target, rng, k, write=write)
    m.check_invariants()
    return m, hits


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculation_gets_the_same_hits_as_plain_decoding(pkg, seed):
    plain, plain_hits = _run(pkg, 0, seed)
    spec, spec_hits = _run(pkg, 3, seed)
    assert spec_hits == plain_hits and sum(plain_hits) > 0
    mp, ms = plain.get_metrics_aggregated(), spec.get_metrics_aggregated()
    assert (ms.cache_tokens, ms.device_blocks_served) == (mp.cache_tokens, mp.device_blocks_served)
    # every request's full blocks were published, in both: the same probes hit the same depth
    for rid, prompt, target in _workload(seed):
        probe = TextContext("probe", np.array(target))
        assert spec.get_prefix_cache_hit_counts(probe) == plain.get_prefix_cache_hit_counts(probe)


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_only_verified_tokens_are_published(pkg):
    """Rejected drafts wrote K/V past processed_length; every published page still holds exactly
    the K/V of its verified tokens, and no draft ever entered a hash."""
    m, _ = _run(pkg, 4, seed=5)
    pool_pages = m.get_device_buffer(0)
    page = m.params.page_size
    checked = 0
    for rid, prompt, target in _workload(5):
        probe = TextContext("probe", np.array(target))
        n = m.get_prefix_cache_hit_counts(probe)[0].device_blocks
        assert n == (len(target) - 1) // page  # the whole verified chain, no more
        m.claim(probe)
        m.alloc(probe)
        rows = _blocks(m, probe)[:n]
        for i, b in enumerate(rows):
            for j in range(page):
                p = i * page + j
                assert np.all(pool_pages[b, :, :, j] == _value(target[p], p)), (rid, p)
                checked += 1
        m.release(probe)
    assert checked > 50


@pytest.mark.parametrize("pkg", PKGS, ids=IDS)
def test_speculation_offloads_the_same_verified_blocks(pkg):
    """With a host tier: the blocks offloaded (verified ones only) are the same set with and without
    speculation, so after the device cache is dropped every probe loads the same depth."""
    import time

    out = []
    for k in (0, 3):
        m, _ = _run(pkg, k, seed=4, host_offload_bytes=1 << 20)
        deadline, seen = time.monotonic() + 30, -1
        while True:  # settled: nothing pinned and the tier's byte count unchanged over a poll
            m.poll_transfers()
            used = m.host_byte_count(0).used
            if not m.pending_transfers_exist(0) and used == seen:
                break
            seen = used
            assert time.monotonic() < deadline, "offloads never settled"
            time.sleep(0.02)
        for pool in m._pools[0].values():
            pool.reset_prefix_cache()  # the device copies only; the tier keeps its blocks
        probes = [m.get_prefix_cache_hit_counts(TextContext("probe", np.array(t)))[0] for _, _, t in _workload(4)]
        out.append((m.host_byte_count(0).used, probes))
        m.shutdown()
    assert out[0] == out[1]
    assert all(p.device_blocks == 0 for p in out[0][1]) and sum(p.external_blocks for p in out[0][1]) > 10


def test_kvref_and_kvfast_agree_under_speculation():
    for seed in (0, 3):
        (r, rh), (f, fh) = _run(kvref, 3, seed), _run(kvfast, 3, seed)
        assert rh == fh
        assert r.get_metrics_aggregated() == f.get_metrics_aggregated()
        assert r._free_order(0) == f._free_order(0)
        np.testing.assert_array_equal(r.get_device_buffer(0), f.get_device_buffer(0))


# ------------------------------------------------------------------ kvcache replay --draft-tokens


@pytest.mark.parametrize("backend", ["kvref", "kvfast"])
def test_speculative_replay_hit_rate_equals_plain(backend):
    """The same workload, one request at a time in an ample pool: speculation changes the number
    of forwards, not a single prefix hit."""
    from kvcache.replay import ReplayConfig, replay
    from kvcache.workload import synthetic_workload

    reqs = synthetic_workload(30, seed=1)
    base = {"num_blocks": 6000, "max_inflight": 1, "backend": backend}
    plain = replay(reqs, ReplayConfig(**base))
    spec = replay(reqs, ReplayConfig(**base, draft_tokens=4, draft_seed=7))
    assert plain.hit_rate > 0.5
    assert spec.hit_rate == plain.hit_rate
    assert spec.as_dict()["device_hit_tokens"] == plain.as_dict()["device_hit_tokens"]
    assert spec.as_dict()["steps"] < plain.as_dict()["steps"]  # several tokens per decode forward


def test_replay_config_checks_draft_tokens():
    from kvcache.replay import ReplayConfig

    assert ReplayConfig(draft_tokens=2).params().num_draft_tokens == 2
    assert ReplayConfig(draft_tokens=2).params().speculative_method == "eagle"
    with pytest.raises(ValueError, match="draft_tokens=65"):
        ReplayConfig(draft_tokens=65)
    with pytest.raises(TypeError, match="draft_tokens"):
        ReplayConfig(draft_tokens=1.5)
