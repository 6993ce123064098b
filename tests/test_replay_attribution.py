"""Lost-hit attribution (kvcache.attribution): the causes sum exactly to ceiling minus hits, and each
cause has a workload built to produce it alone."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcache.replay as replay_mod
from kvcache.attribution import CAUSES, evicted_cause
from kvcache.replay import ReplayConfig, replay
from kvcache.workload import Request, synthetic_workload
from kvspec import LeafSpec

TINY = dict(num_layers=1, kv_heads=1, head_dim=2, backend="kvref")


def req(rid, prompt, output, salt=None):
    return Request(rid, np.asarray(prompt, dtype=np.int32), np.asarray(output, dtype=np.int32), 0.0, salt)


def only(stats, cause):
    """The run lost hits, all of them to ``cause``, and the ladder held (no mismatch)."""
    assert stats.attribution_mismatches == 0
    assert stats.lost_hit_total == stats.ceiling_hit_tokens - stats.hit_tokens > 0
    assert set(stats.lost_hit_tokens) == {cause}, stats.lost_hit_tokens
    return stats.lost_hit_tokens[cause]


def test_evicted_cause_names_every_level():
    assert evicted_cause(False, False, False) == "evicted:device"
    assert evicted_cause(True, True, True) == "evicted:device+host+disk+remote"
    assert evicted_cause(True, False, False) == "evicted:device+host"
    assert "evicted" in CAUSES and "in_flight" in CAUSES


def test_in_flight_only():
    # Two identical prompts admitted in the same step: the second cannot reuse pages the first has
    # not computed yet; an infinite cache serving one at a time would reuse 2 pages.
    p = list(range(1, 13))
    w = [req("a", p, [99]), req("b", p, [98])]
    s = replay(w, ReplayConfig(page_size=4, num_blocks=64, **TINY))
    assert only(s, "in_flight") == 8 and s.hit_tokens == 0


def test_evicted_device_only():
    # a, then enough unrelated requests (one at a time) to push a's pages out, then a's prompt again.
    p = list(range(1, 13))
    others = [req(f"o{i}", list(range(100 * (i + 1), 100 * (i + 1) + 12)), [7]) for i in range(4)]
    w = [req("a", p, [99]), *others, req("b", p, [98])]
    s = replay(w, ReplayConfig(page_size=4, num_blocks=6, max_inflight=1, **TINY))
    assert only(s, "evicted:device") == 8


@pytest.mark.parametrize("backend", ["kvref", "kvfast"])
def test_evicted_device_and_host_only(backend):
    # As above with a host tier of one page: a's pages are offloaded, then pushed out of the host too.
    p = list(range(1, 13))
    others = [req(f"o{i}", list(range(100 * (i + 1), 100 * (i + 1) + 12)), [7]) for i in range(4)]
    w = [req("a", p, [99]), *others, req("b", p, [98])]
    cfg = ReplayConfig(page_size=4, num_blocks=6, max_inflight=1, **{**TINY, "backend": backend})
    s = replay(w, ReplayConfig(**{**cfg.__dict__, "host_bytes": cfg.page_bytes()}))
    assert s.d2h_bytes > 0  # the tier did take pages
    assert only(s, "evicted:device+host") == 8


def test_isolated_by_salt_only():
    p = list(range(1, 13))
    w = [req("a", p, [99], salt="tenant-1"), req("b", p, [98], salt="tenant-2")]
    s = replay(w, ReplayConfig(page_size=4, num_blocks=64, max_inflight=1, **TINY))
    assert only(s, "isolated_by_salt") == 8
    same = replay([req("a", p, [99], salt="t"), req("b", p, [98], salt="t")],
                  ReplayConfig(page_size=4, num_blocks=64, max_inflight=1, **TINY))
    assert same.hit_tokens == same.ceiling_hit_tokens == 8 and same.lost_hit_tokens == {}


def test_other_replica_pages_are_copied_not_lost():
    # A sliding-window leaf: a's prefill takes the whole first step; then a keeps replica 0 busy
    # decoding (one request per replica per step), so b, sharing a's committed prompt, is routed to
    # replica 1. Cross-replica copies serve every leaf kind (spec/manager.md §7.3), so nothing is lost
    # there: ``other_replica`` needs a manager whose peers cannot serve (tests/test_replay_causes.py).
    p = list(range(1, 13))
    w = [req("a", p, list(range(200, 230))), req("b", p + [50, 51], [98])]
    cfg = ReplayConfig(page_size=4, num_blocks=64, replicas=2, max_batch_size=1, max_inflight=2,
                       max_batch_tokens=12,
                       leaves=(("full", LeafSpec.full()), ("swa", LeafSpec.sliding_window(8))), **TINY)
    s = replay(w, cfg)
    assert s.attribution_mismatches == 0
    assert s.manager_metrics["cross_replica_blocks_copied"] > 0
    assert s.hit_tokens == s.ceiling_hit_tokens == 12 and s.lost_hit_tokens == {}


def test_no_checkpoint_only():
    # A recurrent leaf: a's 10-token prefill ends mid-page, so no state checkpoint is published at the
    # 8-token boundary; b shares a's first 10 tokens, and an infinite full-attention cache would reuse 8.
    p = list(range(1, 11))
    w = [req("a", p, [99, 98]), req("b", p + [60, 61, 62], [97])]
    cfg = ReplayConfig(page_size=4, num_blocks=16, max_inflight=1,
                       leaves=(("full", LeafSpec.full()), ("state", LeafSpec.recurrent((2, 2)))), **TINY)
    s = replay(w, cfg)
    assert only(s, "no_checkpoint") == 8


def _faulty(monkeypatch, fault):
    """Make the replay's manager use a FaultConnector around a host tier that does ``fault`` on load 1."""
    from _fault_connector import FaultConnector

    from kvref import TieredConnector

    made = []
    real = replay_mod.replay

    def with_connector(requests, config, **kw):
        conn = FaultConnector(TieredConnector(config.host_bytes, 0, None), load_faults={1: fault})
        made.append(conn)
        return real(requests, config, connector=conn, **kw)

    return with_connector, made


@pytest.mark.parametrize("fault, cause", [("refuse", "load_refused"), ("fail_first_poll", "load_failed"),
                                          ("fail_later", "load_failed")])
def test_load_refused_or_failed_only(monkeypatch, fault, cause):
    # a is offloaded to the host tier and evicted from the device; b's load of it is refused / fails.
    p = list(range(1, 13))
    others = [req(f"o{i}", list(range(100 * (i + 1), 100 * (i + 1) + 12)), [7]) for i in range(4)]
    w = [req("a", p, [99]), *others, req("b", p, [98])]
    cfg = ReplayConfig(page_size=4, num_blocks=6, max_inflight=1, allocate_buffers=True, **TINY)
    cfg = ReplayConfig(**{**cfg.__dict__, "host_bytes": 64 * cfg.page_bytes()})
    run, made = _faulty(monkeypatch, fault)
    s = run(w, cfg)
    assert made[0].injected == [fault]
    assert only(s, cause) == 8


def test_preempted_only():
    # x is older and grows while decoding; a (sharing nothing with x) is the youngest and is preempted
    # mid-prefill when x needs a page; b shares a's prompt and is admitted while a recomputes it.
    x = req("x", list(range(500, 512)), list(range(600, 624)))
    p = list(range(1, 33))
    w = [x, req("a", p, list(range(300, 308))), req("b", p + [70], [98])]
    s = replay(w, ReplayConfig(page_size=4, num_blocks=12, max_inflight=4, max_batch_tokens=8, **TINY))
    assert s.preemptions > 0
    assert only(s, "preempted") == 4


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(4, 24), seed=st.integers(0, 50), page=st.sampled_from([4, 16, 32]),
       extra=st.integers(0, 300), inflight=st.integers(1, 12), tokens=st.sampled_from([64, 512, 2048]),
       replicas=st.integers(1, 3), salted=st.booleans(), host=st.booleans())
def test_causes_sum_to_ceiling_minus_hits(n, seed, page, extra, inflight, tokens, replicas, salted, host):
    w = synthetic_workload(n, seed=seed)
    if salted:
        w = [Request(r.request_id, r.prompt, r.output, r.arrival, f"s{i % 3}") for i, r in enumerate(w)]
    need = max(-(-r.total_length // page) for r in w)
    cfg = ReplayConfig(page_size=page, num_blocks=need + 1 + extra, max_inflight=inflight, max_batch_tokens=tokens,
                       replicas=replicas, **TINY)
    if host:
        cfg = ReplayConfig(**{**cfg.__dict__, "host_bytes": 8 * cfg.page_bytes()})
    s = replay(w, cfg)
    assert s.attribution_mismatches == 0
    assert s.lost_hit_total == s.ceiling_hit_tokens - s.hit_tokens
    assert all(v > 0 and v % page == 0 for v in s.lost_hit_tokens.values())
    assert all(k in CAUSES or k.startswith("evicted:") for k in s.lost_hit_tokens)
