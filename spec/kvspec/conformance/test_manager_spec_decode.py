"""Speculative decoding and FP8 scales in the manager (spec/manager.md §15, §16), against kvref.

Each scenario drives the backend and kvref in lockstep (``ManagerPair``: same
outcome per call, unchanged state after a raise, full state compared by
``agree()``) and checks the spec's numbers, so it also guards kvref. Behind
the capabilities ``spec_decode`` and ``fp8_kv``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule, run_state_machine_as_test

from kvspec import KVCacheParams, TextContext, spec_decode_cache_slack
from kvspec import strategies as kst
from kvspec.conformance._compare import begin_reproduction, record, to_numpy
from kvspec.conformance._harness import ManagerPair
from kvspec.conformance.manager_machine import _RARE, ManagerComparison, write_forward
from kvspec.conformance.plugin import require


def _pair(backend, oracle, *caps, page=4, num_blocks=24, max_seq_len=24, **params) -> ManagerPair:
    require(backend, "manager", "prefix_caching", *caps)
    kw = {"page_size": page, "num_layers": 1, "kv_heads": 1, "head_dim": 2, "dtype": "float32"}
    kw.update(params)
    return ManagerPair(backend, oracle, KVCacheParams(**kw), num_blocks=num_blocks, max_batch_size=4,
                       max_seq_len=max_seq_len)


def _set(p: ManagerPair, rid: str, verify=None, maybe=None) -> None:
    """Set the drafts of ``rid``'s context on both sides."""
    for cs in (p.ctx_ref, p.ctx_sut):
        st = cs[rid].spec_decoding_state
        if verify is not None:
            st.draft_tokens_to_verify = list(verify)
        if maybe is not None:
            st.maybe_accepted_draft_tokens = list(maybe)


def _inputs(p: ManagerPair, rids) -> tuple:
    """``runtime_inputs`` of one batch on both sides: (lut, cache_lengths, max_prompt, max_cache), equal."""
    def run(m, cs):
        i = m.runtime_inputs([[cs[r] for r in rids]]).inputs[0]
        return (to_numpy(i.lookup_table).tolist(), to_numpy(i.cache_lengths).tolist(), i.max_prompt_length,
                i.max_cache_length)
    ref, sut = p.ok(f"manager.runtime_inputs([[{', '.join('ctx_' + r for r in rids)}]])", run)
    if p.strict:
        assert ref == sut
    else:
        assert ref[1:] == sut[1:]
    return ref


def _update(p: ManagerPair, rid: str, tokens) -> None:
    for cs in (p.ctx_ref, p.ctx_sut):
        for t in tokens:
            cs[rid].update(int(t))


# ---------------------------------------------------------------- sizing (MAX's tests)


@pytest.mark.parametrize("filled", [False, True])
def test_three_tokens_and_four_drafts_take_three_blocks_of_four(kv_backend, kv_oracle, filled):
    """MAX: 3 tokens + 2 * 4 drafts = 11 slots -> 3 blocks of 4, whether or not
    draft_tokens_to_verify is filled."""
    p = _pair(kv_backend, kv_oracle, "spec_decode", num_draft_tokens=4, num_blocks=17, max_seq_len=16)
    p.new("a", [1, 2, 3])
    if filled:
        _set(p, "a", verify=[42] * 4)
    p.ok("manager.claim(ctx_a)", lambda m, cs: m.claim(cs["a"]))
    p.ok("manager.alloc(ctx_a)", lambda m, cs: m.alloc(cs["a"]).is_complete())
    n = p.ok("len(manager.get_req_blocks_per_leaf(ctx_a)['full'])",
             lambda m, cs: len(m.get_req_blocks_per_leaf(cs["a"])["full"]))
    assert n == (3, 3)
    _, lengths, longest, reach = _inputs(p, ["a"])
    assert lengths == [0] and longest == 3 + (4 if filled else 0) and reach == 3 + (4 if filled else 0) + 4
    p.agree()


def test_slack_and_block_drafts(kv_backend, kv_oracle):
    p = _pair(kv_backend, kv_oracle, "spec_decode", page=1, speculative_method="dflash", num_draft_tokens=3,
              num_blocks=40, max_seq_len=16)
    assert spec_decode_cache_slack(p.params) == 3 * 3 + 1 + 1
    p.new("a", [0, 1, 2])
    p.ok("manager.claim(ctx_a)", lambda m, cs: m.claim(cs["a"]))
    p.ok("manager.alloc(ctx_a)", lambda m, cs: m.alloc(cs["a"]).is_complete())
    assert p.ok("manager.num_req_blocks(ctx_a)", lambda m, cs: m.num_req_blocks(cs["a"])) == (10, 10)
    assert p.ok("manager.effective_max_seq_length", lambda m, cs: m.effective_max_seq_length) == (16, 16)
    p.agree()


# ---------------------------------------------------------------- a speculative decode, step by step


def test_speculative_decode_publishes_only_verified_tokens(kv_backend, kv_oracle):
    """Drafts verified, partly accepted, appended with update; every state agrees with kvref,
    and the published chain is exactly the verified tokens' (a probe hits all of it)."""
    k = 3
    p = _pair(kv_backend, kv_oracle, "spec_decode", page=2, speculative_method="eagle", num_draft_tokens=k,
              num_blocks=30, max_seq_len=24)
    target = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    p.new("a", target[:5])
    p.ok("manager.claim(ctx_a)", lambda m, cs: m.claim(cs["a"]))
    rng = np.random.default_rng(0)
    while len(p.ctx_ref["a"]) < len(target):
        n = len(p.ctx_ref["a"])
        drafts = list(p.ctx_ref["a"].spec_decoding_state.draft_tokens_to_verify)
        p.ok("manager.alloc(ctx_a)", lambda m, cs: m.alloc(cs["a"]).is_complete())
        _inputs(p, ["a"])
        acc = 0
        while acc < len(drafts) and drafts[acc] == target[n + acc]:
            acc += 1
        _update(p, "a", target[n: n + acc + 1])
        nxt = target[len(p.ctx_ref["a"]): len(p.ctx_ref["a"]) + k]
        _set(p, "a", verify=[t if rng.random() < 0.6 else -t for t in nxt])
        p.ok("manager.step(ctx_a)", lambda m, cs: m.step(cs["a"]))
        p.agree()
    hits = p.ok("manager.get_prefix_cache_hit_counts(probe)",
                lambda m, cs: m.get_prefix_cache_hit_counts(TextContext("probe", np.array(target, np.int32))))
    assert hits[0][0].device_blocks == (len(target) - 1) // 2
    assert hits[0] == hits[1]
    p.ok("manager.release(ctx_a)", lambda m, cs: m.release(cs["a"]))
    p.agree()


def test_rejected_in_flight_drafts_roll_back(kv_backend, kv_oracle):
    k = 4
    p = _pair(kv_backend, kv_oracle, "spec_decode", page=2, speculative_method="eagle", num_draft_tokens=k,
              num_blocks=30, max_seq_len=20)
    p.new("a", list(range(8)))
    p.ok("manager.claim(ctx_a)", lambda m, cs: m.claim(cs["a"]))
    p.forward("a", 100)
    _set(p, "a", maybe=[1, 2, 3, 4])
    p.ok("manager.alloc(ctx_a)", lambda m, cs: m.alloc(cs["a"]).is_complete())
    assert _inputs(p, ["a"])[1] == [8 + 4]
    _update(p, "a", [1, 101])
    _set(p, "a", maybe=[])
    p.ok("manager.step(ctx_a)", lambda m, cs: m.step(cs["a"]))
    before = p.ok("manager.block_count(0).free", lambda m, cs: m.block_count(0).free)
    p.ok("manager.alloc(ctx_a)", lambda m, cs: m.alloc(cs["a"]).is_complete())
    after = p.ok("manager.block_count(0).free", lambda m, cs: m.block_count(0).free)
    assert after[0] == before[0] + 1 and after == (after[0], after[0])
    p.agree()


def test_too_many_drafts_are_refused_with_state_unchanged(kv_backend, kv_oracle):
    p = _pair(kv_backend, kv_oracle, "spec_decode", page=2, num_draft_tokens=2, max_seq_len=16)
    p.new("a", list(range(5)))
    p.ok("manager.claim(ctx_a)", lambda m, cs: m.claim(cs["a"]))
    p.forward("a", 9)
    _set(p, "a", verify=[1, 2, 3])
    msg = p.raises("manager.alloc(ctx_a)", lambda m, cs: m.alloc(cs["a"]), ValueError)
    assert "draft_tokens_to_verify)=3 > params.num_draft_tokens=2" in msg
    p.raises("manager.runtime_inputs([[ctx_a]])", lambda m, cs: m.runtime_inputs([[cs["a"]]]), ValueError)
    _set(p, "a", verify=[1, 2])
    p.ok("manager.alloc(ctx_a)", lambda m, cs: m.alloc(cs["a"]).is_complete())
    p.agree()


# ---------------------------------------------------------------- FP8 scales


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_scales_buffer_and_inputs(kv_backend, kv_oracle, dtype):
    p = _pair(kv_backend, kv_oracle, "fp8_kv", dtype=dtype, num_layers=2, kv_heads=3)
    shape = p.ok("manager.get_device_scales_buffer(0).shape",
                 lambda m, cs: tuple(m.get_device_scales_buffer(0).shape))
    assert shape == ((24, 2, 2, 3),) * 2
    p.new("a", list(range(9)))
    p.ok("manager.claim(ctx_a)", lambda m, cs: m.claim(cs["a"]))
    p.ok("manager.alloc(ctx_a)", lambda m, cs: m.alloc(cs["a"]).is_complete())

    def fields(m, cs):
        i = m.runtime_inputs([[cs["a"]]]).inputs[0]
        return (i.kv_scales is m.get_device_scales_buffer(0), to_numpy(i.scales_page_stride).tolist(),
                np.array_equal(to_numpy(i.scales_lookup_table), to_numpy(i.lookup_table)))
    assert p.ok("runtime_inputs scale fields", fields) == ((True, [12], True),) * 2
    p.agree()


def test_fp8_scales_follow_a_cross_replica_copy(kv_backend, kv_oracle):
    p = _pair(kv_backend, kv_oracle, "fp8_kv", "replicas", dtype="float8_e4m3fn", data_parallel_degree=2)
    toks = list(range(13))
    p.new("a", toks)
    p.ok("manager.claim(ctx_a, 0)", lambda m, cs: m.claim(cs["a"], 0))
    p.ok("manager.alloc(ctx_a)", lambda m, cs: m.alloc(cs["a"]).is_complete())

    def write_scales(m, cs):
        rows = m.get_req_blocks_per_leaf(cs["a"])["full"]
        sc = m.get_device_scales_buffer(0)
        for i, b in enumerate(rows):
            sc[b] = float(i + 1) / 4
        cs["a"].update(5)
        m.step(cs["a"])
    p.ok("write scales; ctx_a.update(5); manager.step(ctx_a)", write_scales)
    p.new("b", toks)
    p.ok("manager.claim(ctx_b, 1)", lambda m, cs: m.claim(cs["b"], 1))
    p.ok("manager.alloc(ctx_b)", lambda m, cs: m.alloc(cs["b"]).is_complete())

    def copied(m, cs):
        rows = m.get_req_blocks_per_leaf(cs["b"])["full"][:3]
        return to_numpy(m.get_device_scales_buffer(1))[rows][:, 0, 0, 0].tolist()
    assert p.ok("scales of ctx_b's copied pages", copied) == ([0.25, 0.5, 0.75],) * 2
    p.agree()


# ---------------------------------------------------------------- the state machine, speculating


class SpeculativeManagerComparison(ManagerComparison):
    """``ManagerComparison`` on managers with ``num_draft_tokens > 0`` (spec/manager.md §15): the
    same rules, plus drafts set on the contexts (sometimes one too many) and forwards that accept
    several tokens at once, so sizing with slack, rollback and verified-only commits are compared
    with kvref after every step."""

    @initialize(data=st.data())
    def make(self, data):
        caps = self.backend.capabilities
        k = data.draw(st.integers(1, 3), label="num_draft_tokens")
        method = data.draw(st.sampled_from([None, "eagle", "dflash"]), label="speculative_method")
        page = data.draw(st.integers(1, 4), label="page_size")
        params = KVCacheParams(
            page_size=page, num_layers=data.draw(st.integers(1, 2), label="num_layers"), kv_heads=1, head_dim=2,
            dtype="float32", enable_prefix_caching=data.draw(st.booleans(), label="prefix caching"),
            data_parallel_degree=data.draw(st.integers(1, 2), label="replicas") if "replicas" in caps else 1,
            speculative_method=method, num_draft_tokens=k)
        self.params = params
        self.max_seq_len = data.draw(st.integers(4, 16), label="max_seq_len")
        self.dp = params.data_parallel_degree
        per_seq = -(-(self.max_seq_len + spec_decode_cache_slack(params)) // page)
        kw = {"num_blocks": data.draw(st.integers(per_seq + 1, 2 * per_seq + 2), label="num_blocks"),
              "max_batch_size": 4, "max_seq_len": self.max_seq_len}
        self.conns = (None, None)
        begin_reproduction("manager", self.backend, params=params, kw=kw, connector=False)
        self.ref = self.oracle.make_manager(params, **kw)
        self.sut = self.backend.build_manager(params, **kw)
        self._start_requests(data)

    @rule(data=st.data())
    def set_drafts(self, data):
        """Drafts to verify and in flight, on both sides (rarely one more than ``num_draft_tokens``)."""
        rid = self._rid(data)
        if rid is None:
            return
        k = self.params.num_draft_tokens
        top = k + 1 if data.draw(_RARE, label="too many") else k
        verify = data.draw(st.lists(kst.token_ids(), max_size=top), label="draft_tokens_to_verify")
        maybe = data.draw(st.lists(kst.token_ids(), max_size=top), label="maybe_accepted_draft_tokens")
        record(f"for c in (ctx_{rid},): c.spec_decoding_state.draft_tokens_to_verify = {verify}; "
               f"c.spec_decoding_state.maybe_accepted_draft_tokens = {maybe}")
        for cs in (self.ctx_ref, self.ctx_sut):
            cs[rid].spec_decoding_state.draft_tokens_to_verify = list(verify)
            cs[rid].spec_decoding_state.maybe_accepted_draft_tokens = list(maybe)

    @precondition(lambda self: self.allocated)
    @rule(data=st.data())
    def speculative_step(self, data):
        """A verifying forward that accepts some drafts: the K/V of the active tokens written, the
        accepted drafts and the bonus token appended with ``update``, the in-flight drafts resolved,
        then ``step``."""
        rid = data.draw(st.sampled_from(sorted(self.allocated)), label="request")
        if self.ctx_ref[rid].pending_length:
            return
        seed = data.draw(st.integers(0, 2**16), label="kv seed")
        tokens = data.draw(st.lists(kst.token_ids(), min_size=1, max_size=self.params.num_draft_tokens + 1),
                           label="accepted")
        record(f"write_forward(manager, ctx_{rid}, {seed}, {self.replica_of[rid]}); "
               f"[ctx_{rid}.update(t) for t in {tokens}]; ctx_{rid}.spec_decoding_state.maybe_accepted_draft_tokens = []")
        for m, cs in ((self.ref, self.ctx_ref), (self.sut, self.ctx_sut)):
            write_forward(m, cs[rid], seed, self.replica_of[rid])
            for t in tokens:
                cs[rid].update(t)
            cs[rid].spec_decoding_state.maybe_accepted_draft_tokens = []
        self.allocated.discard(rid)
        self._both(f"manager.step(ctx_{rid})", lambda m, cs: m.step(cs[rid]))


def test_speculative_manager_comparison(kv_backend, kv_oracle, kv_settings):
    require(kv_backend, "manager", "spec_decode")
    run_state_machine_as_test(SpeculativeManagerComparison.for_backend(kv_backend, kv_oracle), settings=kv_settings)
