"""The lost-hit causes added for the capacity planner (kvcache.attribution): isolation by model, warm
starts, pages only the full-attention leaves held (sliding window) or only another replica held; and the
per-leaf usage of hybrid models in the table and the JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache.attribution import CAUSES, LostHits
from kvcache.models import get_model
from kvcache.replay import ReplayConfig, replay
from kvcache.report import format_table, json_document
from kvcache.workload import Request, WorkloadError, _trace_request, _trace_requests, read_mooncake_trace
from kvspec import LeafSpec

TINY = dict(num_layers=1, kv_heads=1, head_dim=2, backend="kvref")


def req(rid, prompt, output, salt=None, model=None):
    return Request(rid, np.asarray(prompt, dtype=np.int32), np.asarray(output, dtype=np.int32), 0.0, salt,
                   model=model)


def only(stats, cause):
    assert stats.attribution_mismatches == 0
    assert stats.lost_hit_total == stats.ceiling_hit_tokens - stats.hit_tokens > 0
    assert set(stats.lost_hit_tokens) == {cause}, stats.lost_hit_tokens
    return stats.lost_hit_tokens[cause]


# --------------------------------------------------------------------------- isolation by model


@pytest.mark.parametrize("backend", ["kvref", "kvfast"])
def test_isolated_by_model_only(backend):
    # Two models share the pool; the second asks for the first's prompt. The ceiling is global (identical
    # tokens), the manager keys the hash root by model: 2 pages lost, to the model alone.
    p = list(range(1, 13))
    w = [req("a", p, [99], model="base"), req("b", p, [98], model="base+lora-1")]
    s = replay(w, ReplayConfig(page_size=4, num_blocks=64, max_inflight=1, **{**TINY, "backend": backend}))
    assert only(s, "isolated_by_model") == 8 and s.hit_tokens == 0
    same = replay([req("a", p, [99], model="m"), req("b", p, [98], model="m")],
                  ReplayConfig(page_size=4, num_blocks=64, max_inflight=1, **TINY))
    assert same.hit_tokens == same.ceiling_hit_tokens == 8 and same.lost_hit_tokens == {}


def test_model_rung_comes_before_the_salt_rung():
    p = list(range(1, 13))
    cfg = ReplayConfig(page_size=4, num_blocks=64, max_inflight=1, **TINY)
    # same model, other salt: the salt isolates
    s = replay([req("a", p, [99], "t1", "m"), req("b", p, [98], "t2", "m")], cfg)
    assert only(s, "isolated_by_salt") == 8
    # other model and other salt: the model is named (its rung comes first)
    s = replay([req("a", p, [99], "t1", "m1"), req("b", p, [98], "t2", "m2")], cfg)
    assert only(s, "isolated_by_model") == 8
    # other model, same salt: the model
    s = replay([req("a", p, [99], "t", "m1"), req("b", p, [98], "t", "m2")], cfg)
    assert only(s, "isolated_by_model") == 8


def test_cache_key_keeps_models_apart():
    r = req("a", [1, 2], [3], salt="s", model="m")
    assert r.cache_key == b"model\0m\0salt\0s"
    assert req("a", [1, 2], [3], model="m").cache_key == b"model\0m"
    assert req("a", [1, 2], [3], salt="s").cache_key == "s"  # no model: the salt as before
    assert req("a", [1, 2], [3]).cache_key is None


def test_trace_model_field(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2], "model": "m1"}\n'
                 '{"timestamp": 1, "input_length": 512, "output_length": 0, "hash_ids": [1]}\n')
    a, b = read_mooncake_trace(f)
    assert a.model == "m1" and b.model is None
    for bad in ('""', '"a\\u0000b"', "3", '"' + "x" * 1025 + '"'):
        f.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1], "model": %s}\n' % bad)
        with pytest.raises(WorkloadError, match=r"t.jsonl:1: model="):
            read_mooncake_trace(f)


def test_trace_tokens_in_one_pass_equal_the_per_request_definition(tmp_path):
    lines = []
    rng = np.random.default_rng(5)
    for i in range(40):
        n_in = int(rng.integers(1, 3000))
        ids = [int(x) for x in rng.integers(0, 20, size=-(-n_in // 512))]
        lines.append((i + 1, {"timestamp": int(rng.integers(0, 9)), "input_length": n_in,
                              "output_length": int(rng.integers(0, 40)), "hash_ids": ids,
                              "cache_salt": None if i % 3 else "s"}))
    lines.sort(key=lambda r: r[1]["timestamp"])
    for seed in (0, 7):
        got = _trace_requests(lines, seed)
        want = [_trace_request(n, rec, seed) for n, rec in lines]
        for g, w in zip(got, want, strict=True):
            assert g.request_id == w.request_id and g.cache_salt == w.cache_salt and g.arrival == w.arrival
            assert np.array_equal(g.prompt, w.prompt) and np.array_equal(g.output, w.output)
            assert g.prompt.dtype == np.int32 and g.output.size >= 1


# --------------------------------------------------------------------------- warm start


def test_warm_disk_tier_raises_the_ceiling_instead_of_breaking_the_ladder(tmp_path):
    # Run 1 writes a's pages to a disk directory; run 2 (a new process's replay of the same directory)
    # hits them although no request of run 2 committed them: the ceiling is raised over the warm pages,
    # the causes still sum to ceiling - hits, and no request is a mismatch.
    p = list(range(1, 13))
    others = [req(f"o{i}", list(range(100 * (i + 1), 100 * (i + 1) + 12)), [7]) for i in range(4)]
    cfg = ReplayConfig(page_size=4, num_blocks=6, max_inflight=1, allocate_buffers=True,
                       disk_dir=str(tmp_path), **TINY)
    cfg = ReplayConfig(**{**cfg.__dict__, "disk_bytes": 64 * cfg.page_bytes()})
    first = replay([req("a", p, [99]), *others], cfg)
    assert first.disk_bytes_written > 0 and first.warm_ceiling_tokens == 0
    second = replay([req("b", p + [5], [98]), req("c", p + [6], [97])], cfg)
    assert second.hit_tokens > 0 and second.external_hit_tokens > 0
    assert second.warm_ceiling_tokens == 8  # b's 2 pages: the cold ceiling gives b nothing
    assert second.attribution_mismatches == 0
    assert second.lost_hit_total == second.ceiling_hit_tokens - second.hit_tokens
    cold = replay([req("b", p + [5], [98]), req("c", p + [6], [97])],
                  ReplayConfig(**{**cfg.__dict__, "disk_dir": str(tmp_path / "cold")}))
    assert cold.warm_ceiling_tokens == 0 and second.ceiling_hit_tokens == cold.ceiling_hit_tokens + 8


def test_warm_pages_raise_later_ceilings_too():
    # LostHits alone: request 0 hits 2 warm pages; request 1 shares them and then a page of its own
    # that request 0 never commits: its ceiling rises from 0 to 2 pages over the warm ones.
    ids = [np.array([10, 11, 12]), np.array([10, 11, 13, 14])]
    lost = LostHits(ids, np.array([0, 0]), [None, None], 4, peers_serve=False, recurrent=False,
                    evicted="evicted:device", reusable_pages=np.array([2, 3]))
    lost.admit(0, 0, 8)  # both pages warm
    assert lost.warm_ceiling_tokens == 8 and lost.mismatches == 0
    lost.admit(1, 0, 0)  # request 0 not committed yet, warm pages 10, 11 still count
    assert lost.warm_ceiling_tokens == 16 and lost.tokens == {"evicted:device": 8}


# --------------------------------------------------------------------------- sliding window, other replica


def test_sliding_window_cause_is_what_the_full_leaves_held():
    # Request 1 shares 3 committed pages with request 0 and hit 1: with the full leaves holding 2 of them
    # (window_pages=2) one page is the window's loss and one was evicted from every leaf.
    ids = [np.array([1, 2, 3, 4]), np.array([1, 2, 3, 9])]
    lost = LostHits(ids, np.array([0, 3]), [None, None], 4, peers_serve=False, recurrent=False,
                    evicted="evicted:device")
    lost.admit(0, 0, 0)
    lost.commit(0, 0, 16)
    lost.admit(1, 0, 4, window_pages=2)
    assert lost.tokens == {"sliding_window": 4, "evicted:device": 4} and lost.mismatches == 0
    only_window = LostHits(ids, np.array([0, 3]), [None, None], 4, peers_serve=False, recurrent=False,
                           evicted="evicted:device")
    only_window.commit(0, 0, 16)
    only_window.admit(1, 0, 4, window_pages=3)
    assert only_window.tokens == {"sliding_window": 8}
    assert "sliding_window" in CAUSES and "isolated_by_model" in CAUSES


def test_other_replica_cause_when_peers_cannot_serve():
    ids = [np.array([1, 2, 3]), np.array([1, 2, 3])]
    lost = LostHits(ids, np.array([0, 2]), [None, None], 4, peers_serve=False, recurrent=False,
                    evicted="evicted:device")
    lost.commit(0, 0, 12)
    lost.admit(1, 1, 0)
    assert lost.tokens == {"other_replica": 8}
    served = LostHits(ids, np.array([0, 2]), [None, None], 4, peers_serve=True, recurrent=False,
                      evicted="evicted:device")
    served.commit(0, 0, 12)
    served.admit(1, 1, 0)
    assert served.tokens == {"evicted:device": 8}


# --------------------------------------------------------------------------- hybrid presets, per-leaf usage


def test_hybrid_presets_report_usage_per_leaf():
    w = [req(f"r{i}", list(range(1, 40)) + [100 + i] * (i + 1), list(range(500, 520))) for i in range(6)]
    s = replay(w, ReplayConfig(page_size=8, num_blocks=64, max_inflight=3,
                               leaves=(("full", LeafSpec.full()), ("swa", LeafSpec.sliding_window(16))), **TINY))
    assert set(s.leaves) == {"full", "swa"}
    full, swa = s.leaves["full"], s.leaves["swa"]
    assert full["kind"] == "full" and swa["kind"] == "sliding_window" and swa["window"] == 16
    assert full["page_bytes"] == swa["page_bytes"] == 2 * 1 * 8 * 1 * 2 * 2
    # the window keeps at most ceil(15 / 8) + 1 = 3 pages per request, 3 requests at once
    assert 0 < swa["pages_peak"] <= 3 * 3 < full["pages_peak"]
    assert len(s.series["pages_used:full"]) == s.steps == len(s.series["pages_used:swa"])
    assert max(s.series["pages_used:swa"]) == swa["pages_peak"]
    table = format_table(s)
    assert "leaf full" in table and "leaf swa" in table and "sliding_window 16" in table
    doc = json.loads(json.dumps(json_document([s], config={})))
    assert doc["runs"][0]["leaves"]["swa"]["pages_peak"] == swa["pages_peak"]
    plain = replay(w, ReplayConfig(page_size=8, num_blocks=64, **TINY))
    assert plain.leaves == {} and "leaf full" not in format_table(plain)


@pytest.mark.parametrize("name", ["gemma-3-12b", "jamba-v0.1", "qwen3-next-80b-a3b"])
def test_hybrid_presets_replay_with_real_leaves(name):
    m = get_model(name)
    w = [req(f"r{i}", list(range(1, 50)) + [100 + i], [7, 8, 9]) for i in range(4)]
    cfg = ReplayConfig(model=name, page_size=16, num_blocks=40, max_inflight=2, backend="kvref")
    s = replay(w, cfg)
    assert s.attribution_mismatches == 0 and s.lost_hit_total == s.ceiling_hit_tokens - s.hit_tokens
    params = cfg.params()
    assert set(s.leaves) == set(params.leaves()) and len(s.leaves) == 2
    for lid, leaf in s.leaves.items():
        assert leaf["page_bytes"] == params.page_bytes(lid) and leaf["pages_peak"] > 0
    if m.state_shape:
        assert s.leaves["state"]["kind"] == "recurrent"
        itemsize = {"float32": 4, "bfloat16": 2}[m.state_dtype]
        assert s.leaves["state"]["page_bytes"] == int(np.prod(m.state_shape)) * itemsize
    assert s.page_bytes == sum(leaf["page_bytes"] for leaf in s.leaves.values())


def test_qwen3_next_geometry():
    m = get_model("qwen3-next-80b-a3b")
    # 12 gated-attention layers x 2 KV heads x 256 x 2 (K, V) x 2 bytes
    assert m.kv_bytes_per_token() == 12 * 2 * 256 * 2 * 2
    # per Gated DeltaNet layer: 32 heads x 128 x 128 state + 8192 x 3 conv = 32 x 128 x 134
    assert 32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3 == 32 * 128 * 134
    assert m.state_shape == (36, 32, 128, 134) and m.state_dtype == "bfloat16" and m.kind == "hybrid"


# --------------------------------------------------------------------------- runtime_inputs


def test_runtime_inputs_on_request_changes_no_figure():
    from kvcache.workload import synthetic_workload

    w = synthetic_workload(40, seed=2)
    need = max(-(-r.total_length // 16) for r in w)
    for backend in ("kvref", "kvfast"):
        base = dict(page_size=16, num_blocks=need + 30, max_batch_tokens=256, **{**TINY, "backend": backend})
        a = replay(w, ReplayConfig(**base)).as_dict()
        b = replay(w, ReplayConfig(**base, build_inputs=True)).as_dict()
        assert a["preemptions"] > 0
        for key in ("hit_tokens", "ceiling_hit_tokens", "lost_hit_tokens", "preemptions", "steps",
                    "peak_blocks_used", "manager_metrics"):
            assert a[key] == b[key], key
        assert a["series"]["blocks_used"] == b["series"]["blocks_used"]
    with pytest.raises(TypeError, match="build_inputs"):
        ReplayConfig(build_inputs=1)


# --------------------------------------------------------------------------- the ceiling's page ids


@pytest.mark.parametrize("page", [1, 5, 16, 64])
def test_ceiling_page_ids_equal_the_hash_chain(page):
    from kvcache.ceiling import infinite_cache_ceiling
    from kvcache.workload import synthetic_workload

    w = synthetic_workload(60, seed=page)
    fast = infinite_cache_ceiling(w, page)
    for algo in ("xxh3_128", "sha256"):
        chained = infinite_cache_ceiling(w, page, hash_algo=algo)
        assert np.array_equal(fast.per_request, chained.per_request)
        assert all(np.array_equal(a, b) for a, b in zip(fast.page_ids, chained.page_ids, strict=True))


# --------------------------------------------------------------------------- sliding window, end to end


def _window_manager(pkg):
    from kvspec import KVCacheParams, TextContext

    p = KVCacheParams(4, 1, 1, 2, leaves={"full": LeafSpec.full(), "swa": LeafSpec.sliding_window(8)},
                      allocate_buffers=False)
    m = pkg.PagedKVCacheManager(p, num_blocks=24, max_batch_size=4, max_seq_len=64)
    a = TextContext("a", np.arange(1, 41, dtype=np.int32))  # 10 pages, decoding 20 more tokens
    m.claim(a, 0)
    m.alloc(a)
    a.update(100)
    m.step(a)
    for t in range(101, 121):
        m.alloc(a)
        a.update(t)
        m.step(a)
    f = TextContext("f", np.arange(500, 504, dtype=np.int32))  # takes the last free pages: evicts the
    m.claim(f, 0)                                             # window pages 'a' no longer needs
    m.alloc(f)
    f.update(1)
    m.step(f)
    b = TextContext("b", np.concatenate([np.arange(1, 25, dtype=np.int32), np.array([900, 901], np.int32)]))
    return m, b


@pytest.mark.parametrize("pkg_name", ["kvref", "kvfast"])
def test_per_leaf_prefix_hit_query(pkg_name):
    """spec/manager.md §3.6: the hit of the named leaves alone; read-only; arguments checked."""
    import importlib

    m, b = _window_manager(importlib.import_module(pkg_name))
    before = (m.get_metrics_aggregated().as_dict(), m.block_count(0), m._free_order(0), m._free_order(0, "swa"))
    assert m.get_prefix_cache_hit_counts(b)[0].device_blocks == 0  # the window before page 6 is gone
    assert m.get_prefix_cache_hit_counts_per_leaf(b, ["full"]) == [6]  # 'a' holds its prompt's pages
    assert m.get_prefix_cache_hit_counts_per_leaf(b, ("swa",)) == [0]
    assert m.get_prefix_cache_hit_counts_per_leaf(b, ["swa", "full"]) == [0]  # every leaf: the joint hit
    for bad, err, match in (("full", TypeError, "must be a list or tuple"), ([1], TypeError, "must be a list"),
                            ([], ValueError, "at least one"), (["full", "full"], ValueError, "distinct"),
                            (["nope"], ValueError, r"leaf ids of \['full', 'swa'\]")):
        with pytest.raises(err, match=match):
            m.get_prefix_cache_hit_counts_per_leaf(b, bad)
    with pytest.raises(TypeError, match="get_prefix_cache_hit_counts_per_leaf: ctx="):
        m.get_prefix_cache_hit_counts_per_leaf("b", ["full"])
    assert (m.get_metrics_aggregated().as_dict(), m.block_count(0), m._free_order(0), m._free_order(0, "swa")) == before
    m.shutdown()


@pytest.mark.parametrize("backend", ["kvref", "kvfast"])
def test_sliding_window_only(backend):
    # 'a' (40-token prompt) decodes while 'f' runs; 'b', admitted after 'f', asks for a's first 24 tokens.
    # The full leaf still holds those 6 pages (a references them); the sliding leaf released the ones
    # below its window as 'a' moved on, and the small pool evicted them: the window before every stop
    # is gone, so the joint hit is 0, and the 24 tokens are the window's loss alone.
    a = list(range(1, 41))
    w = [req("a", a, list(range(100, 140))), req("f", [500 + i for i in range(8)], [1, 2]),
         req("b", a[:24] + [900, 901, 902, 903, 904], [3])]
    leaves = (("full", LeafSpec.full()), ("swa", LeafSpec.sliding_window(8)))
    s = replay(w, ReplayConfig(page_size=4, num_blocks=24, max_inflight=2, leaves=leaves,
                               **{**TINY, "backend": backend}))
    assert only(s, "sliding_window") == 24 and s.hit_tokens == 0 and s.preemptions == 0
    roomy = replay(w, ReplayConfig(page_size=4, num_blocks=64, max_inflight=2, leaves=leaves, **TINY))
    assert roomy.hit_tokens == roomy.ceiling_hit_tokens == 24 and roomy.lost_hit_tokens == {}


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(4, 16), seed=st.integers(0, 50), page=st.sampled_from([4, 16]), extra=st.integers(0, 200),
       inflight=st.integers(1, 8), window=st.sampled_from([8, 33, 256]), drafts=st.sampled_from([0, 3]),
       causal=st.booleans())
def test_causes_sum_with_a_sliding_leaf(n, seed, page, extra, inflight, window, drafts, causal):
    """The sum rule with the full leaves' hit in the ladder (and speculation, and without causality)."""
    from kvcache.workload import synthetic_workload

    w = synthetic_workload(n, seed=seed)
    if not causal:
        w = [Request(r.request_id, r.prompt, r.output, r.arrival) for r in w]
    need = max(-(-r.total_length // page) for r in w)
    leaves = (("full", LeafSpec.full()), ("swa", LeafSpec.sliding_window(window)))
    s = replay(w, ReplayConfig(page_size=page, num_blocks=2 * need + 2 + extra, max_inflight=inflight,
                               leaves=leaves, draft_tokens=drafts, **TINY))
    assert s.attribution_mismatches == 0
    assert s.lost_hit_total == s.ceiling_hit_tokens - s.hit_tokens
    assert all(v > 0 and v % page == 0 for v in s.lost_hit_tokens.values())
