"""kvfast's decode lanes under speculative decoding (spec/manager.md §15) and FP8 scales
(spec/manager.md §16), against kvref.

A scheduler loop drives a kvref and a kvfast manager through the same calls: ``alloc``,
``runtime_inputs`` (with and without a capture width), accepted drafts appended with
``update``, ``step``, drafts set for the next forward and, with overlap scheduling, drafts in
flight (``maybe_accepted_draft_tokens``). Every result (every field of the inputs, scales
included), every error and the block tables must agree (the conformance suite's
``capture`` / ``assert_same_outcome``). While a step neither rolls drafts back
nor admits, the policy's ``alloc`` and ``runtime_inputs`` are made to fail in kvfast's manager:
the lanes serve them.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvspec import KVCacheParams, LeafSpec, TextContext
from kvspec.conformance._compare import assert_same_outcome, capture

import kvfast
import kvref

PAGE = 4

CONFIGS = {
    "eagle k=2": dict(speculative_method="eagle", num_draft_tokens=2),
    "dflash k=3": dict(speculative_method="dflash", num_draft_tokens=3),  # a block draft: D = 1
    "fp8": dict(dtype="float8_e4m3fn"),
    "fp8 eagle k=2": dict(dtype="float8_e4m3fn", speculative_method="eagle", num_draft_tokens=2),
    "fp8 full + swa": dict(dtype="float8_e4m3fn",
                           leaves={"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(8)}),
    "eagle k=2 full + rec": dict(speculative_method="eagle", num_draft_tokens=2,
                                 leaves={"full": LeafSpec.full(), "rec": LeafSpec.recurrent((2,))}),
    "eagle k=2 dp=2": dict(speculative_method="eagle", num_draft_tokens=2, data_parallel_degree=2),
}


def _kind(transfer) -> str:
    """``alloc``'s result by its class (a ``CompletedTransfer`` has no equality)."""
    return type(transfer).__name__


def _tables(m, ctxs):
    return [m.get_req_blocks_per_leaf(c) for c in ctxs], m.get_metrics_aggregated()


class _PolicyGate:
    """Makes kvref's ``alloc`` and ``runtime_inputs`` fail for kvfast's manager while closed."""

    def __init__(self, monkeypatch, fast):
        self.closed = False
        for name in ("alloc", "runtime_inputs"):
            orig = getattr(kvref.PagedKVCacheManager, name)

            def gated(m, *a, _orig=orig, _name=name, **k):
                if m is fast and self.closed:
                    raise AssertionError(f"the policy's {_name} ran for a call a lane serves")
                return _orig(m, *a, **k)

            monkeypatch.setattr(kvref.PagedKVCacheManager, name, gated)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_decode_lanes_serve_drafts_and_fp8_with_the_reference_results(config, monkeypatch):
    p = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, **CONFIGS[config])
    dp, k = p.data_parallel_degree, p.num_draft_tokens
    kw = dict(num_blocks=96, max_batch_size=4, max_seq_len=96)
    ref, fast = kvref.PagedKVCacheManager(p, **kw), kvfast.PagedKVCacheManager(p, **kw)
    gate = _PolicyGate(monkeypatch, fast)
    rng = np.random.default_rng(sum(map(ord, config)))
    prompts = [rng.integers(0, 5, size=int(n)) for n in rng.integers(10, 30, size=4)]
    prompts[1][:8] = prompts[0][:8]  # a shared prefix: a device hit
    pairs = [(TextContext(str(i), t), TextContext(str(i), t)) for i, t in enumerate(prompts)]
    for i, (a, b) in enumerate(pairs):
        for m, c in ((ref, a), (fast, b)):
            m.claim(c, i % dp)
        assert_same_outcome(f"alloc({a.request_id})", capture(lambda: _kind(ref.alloc(a))),
                            capture(lambda: _kind(fast.alloc(b))))
    assert _tables(ref, [a for a, _ in pairs]) == _tables(fast, [b for _, b in pairs])

    def batches(j):
        return [[c[j] for i, c in enumerate(pairs) if i % dp == r] for r in range(dp)]

    def drafts(j, name, values):
        for c in pairs:
            setattr(c[j].spec_decoding_state, name, list(values[c[0].request_id]))

    for step in range(14):
        width = None if step % 3 else 96  # a CUDA-graph capture width every third step
        gate.closed = step > 0 and not (k and step % 4 == 3)  # step % 4 == 3: drafts in flight resolve
        assert_same_outcome(f"step {step}: runtime_inputs(max_cache_length={width})",
                            capture(lambda: ref.runtime_inputs(batches(0), max_cache_length=width)),
                            capture(lambda: fast.runtime_inputs(batches(1), max_cache_length=width)))
        # the forward: the accepted drafts and a bonus token are appended (update)
        accepted = {c[0].request_id: int(rng.integers(0, k + 1)) if k else 0 for c in pairs}
        for a, b in pairs:
            toks = rng.integers(0, 5, size=1 + accepted[a.request_id]).tolist()
            if len(a) + len(toks) > 80:
                toks = toks[:1]
            for t in toks:
                a.update(t), b.update(t)
        if k:  # the next forward's drafts; with overlap scheduling, some still in flight
            nxt = {c[0].request_id: rng.integers(0, 5, size=int(rng.integers(0, k + 1))).tolist() for c in pairs}
            maybe = {c[0].request_id: rng.integers(0, 5, size=int(rng.integers(0, k + 1))).tolist()
                     if step % 4 == 2 else [] for c in pairs}
            for j in (0, 1):
                drafts(j, "draft_tokens_to_verify", nxt)
                drafts(j, "maybe_accepted_draft_tokens", maybe)
        for a, b in pairs:
            assert_same_outcome(f"step {step}: step({a.request_id})", capture(lambda: ref.step(a)),
                                capture(lambda: fast.step(b)))
            assert_same_outcome(f"step {step}: alloc({a.request_id})", capture(lambda: _kind(ref.alloc(a))),
                                capture(lambda: _kind(fast.alloc(b))))
        gate.closed = False
        assert _tables(ref, [a for a, _ in pairs]) == _tables(fast, [b for _, b in pairs]), step
    fast.check_invariants()


@pytest.mark.parametrize("k", [0, 2])
def test_bad_drafts_go_to_the_policy_and_raise_its_errors(k):
    """Drafts the lanes do not take (a tuple, an array, a list longer than ``num_draft_tokens``,
    any draft without speculative decoding) reach the policy: kvfast accepts or refuses exactly
    what kvref does, with its messages, and a refusal changes nothing."""
    spec = dict(speculative_method="eagle", num_draft_tokens=k) if k else {}
    p = KVCacheParams(page_size=PAGE, num_layers=1, kv_heads=1, head_dim=2, **spec)
    kw = dict(num_blocks=32, max_batch_size=4, max_seq_len=64)
    ms = [pkg.PagedKVCacheManager(p, **kw) for pkg in (kvref, kvfast)]
    cs = [TextContext("a", np.arange(9)) for _ in ms]
    for m, c in zip(ms, cs):
        m.claim(c)
        m.alloc(c)
        c.update(1)
        m.step(c)
    for value in ([], [1], (1,), np.array([1, 2]), [1, 2, 3], (1, 2, 3), np.zeros((1, 1), int), 7):
        for name in ("draft_tokens_to_verify", "maybe_accepted_draft_tokens"):
            for c in cs:
                c.spec_decoding_state.draft_tokens_to_verify = []
                c.spec_decoding_state.maybe_accepted_draft_tokens = []
                setattr(c.spec_decoding_state, name, value)
            for call in (lambda m, c: _kind(m.alloc(c)), lambda m, c: m.runtime_inputs([[c]]),
                         lambda m, c: m.runtime_inputs([[c]], max_cache_length=64 + 3 * k + 1)):
                before = [_tables(m, [c]) for m, c in zip(ms, cs)]
                got = [capture(lambda m=m, c=c: call(m, c)) for m, c in zip(ms, cs)]
                assert_same_outcome(f"{name}={value!r}", *got)
                if got[0].raised:
                    assert [_tables(m, [c]) for m, c in zip(ms, cs)] == before
