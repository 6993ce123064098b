"""kvcache.replay, kvcache.workload, kvcache.ceiling: the replay job as a library."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache
import kvcache.replay as replay_mod
from kvcache.ceiling import infinite_cache_ceiling
from kvcache.replay import ReplayConfig, ReplayError, ReplayStats, manager_class, replay, required_blocks
from kvcache.workload import (
    MOONCAKE_BLOCK_TOKENS,
    Request,
    WorkloadError,
    read_mooncake_trace,
    synthetic_workload,
)

# The Mooncake traces live in shared/ beside the repository (never copied into it).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = next((d for d in (os.path.join(_ROOT, "..", "shared", "traces"), "/work/shared/traces")
               if os.path.isdir(d)), os.path.join(_ROOT, "..", "shared", "traces"))
CONVERSATION = os.path.join(TRACES, "conversation_trace.jsonl")
needs_traces = pytest.mark.skipif(
    not os.path.isfile(CONVERSATION), reason=f"Mooncake traces not present at {TRACES}"
)

# A tiny model: page bytes stay small, so pools of thousands of blocks are cheap.
TINY = dict(num_layers=1, kv_heads=1, head_dim=2)


def req(rid, prompt, output, t=0.0):
    return Request(rid, np.asarray(prompt, dtype=np.int32), np.asarray(output, dtype=np.int32), t)


def decode_heavy(n=8):
    """Short prompts with a shared 8-token head and long answers: decode growth forces preemption."""
    head = list(range(1, 9))
    return [req(f"d{i}", head + [100 + i] * 4, list(range(1000 + 40 * i, 1036 + 40 * i)), float(i)) for i in range(n)]


@pytest.fixture(scope="module")
def chat():
    return synthetic_workload(24, seed=3)


def write_trace(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


# --------------------------------------------------------------------------- ceiling


def test_ceiling_doc_example():
    p = np.arange(1, 10, dtype=np.int32)
    c = infinite_cache_ceiling([req("a", p, [7]), req("b", p, [7])], 4)
    # b reuses (9 - 1) // 4 = 2 pages of a; a reuses nothing.
    assert c.per_request.tolist() == [0, 8]
    assert (c.hit_tokens, c.prompt_tokens) == (8, 18)
    assert c.hit_rate == pytest.approx(8 / 18)


def test_ceiling_last_token_never_reused():
    p = list(range(1, 9))  # 8 tokens = exactly 2 pages of 4
    c = infinite_cache_ceiling([req("a", p, [50]), req("b", p, [50])], 4)
    assert c.per_request.tolist() == [0, 4]  # (8 - 1) // 4 = 1 page, not 2


def test_ceiling_counts_pages_committed_by_outputs():
    # a's answer fills page 2; b's prompt holds a's prompt and answer (a later turn).
    a = req("a", [1, 2, 3, 4, 5, 6], [7, 8, 9])
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12], [13])
    c = infinite_cache_ceiling([a, b], 4)
    # a commits pages of its first 6 + 3 - 1 = 8 tokens: [1..4], [5..8]; b reuses both.
    assert c.per_request.tolist() == [0, 8]


def test_ceiling_stops_at_first_miss_and_needs_a_leading_run():
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], [1])
    b = req("b", [9, 9, 9, 9, 5, 6, 7, 8, 9], [1])  # page 2 equal in tokens, not in chain
    c = infinite_cache_ceiling([a, b], 4)
    assert c.per_request.tolist() == [0, 0]


def test_ceiling_order_matters_and_validates():
    a = req("a", list(range(1, 20)), [1])
    b = req("b", list(range(1, 10)), [1])
    assert infinite_cache_ceiling([a, b], 4).per_request.tolist() == [0, 8]
    assert infinite_cache_ceiling([b, a], 4).per_request.tolist() == [0, 8]
    assert infinite_cache_ceiling([], 4).hit_rate == 0.0
    with pytest.raises(ValueError, match="infinite_cache_ceiling: page_size=0, must be >= 1"):
        infinite_cache_ceiling([a], 0)


def test_ceiling_page_one_reuses_every_shared_token_but_the_last():
    a = req("a", [5, 6, 7, 8], [9])
    b = req("b", [5, 6, 7, 1], [9])
    assert infinite_cache_ceiling([a, b], 1).per_request.tolist() == [0, 3]


# --------------------------------------------------------------------------- synthetic workload


def test_synthetic_workload_is_seeded_and_shares_prefixes():
    a, b = synthetic_workload(60, seed=1), synthetic_workload(60, seed=1)
    assert len(a) == 60
    assert all(np.array_equal(x.prompt, y.prompt) and np.array_equal(x.output, y.output) for x, y in zip(a, b))
    assert [x.request_id for x in a] == [y.request_id for y in b]
    c = synthetic_workload(60, seed=2)
    assert not all(np.array_equal(x.prompt, y.prompt) for x, y in zip(a, c))
    assert [r.arrival for r in a] == sorted(r.arrival for r in a)
    for r in a:
        assert r.prompt.dtype == np.int32 and r.output.dtype == np.int32
        assert r.prompt_length >= 1 and r.output_length >= 1
        assert r.total_length == r.prompt_length + r.output_length
    # Shared system prompts and growing conversations give a high ceiling.
    assert infinite_cache_ceiling(a, 16).hit_rate > 0.5


def test_synthetic_later_turn_contains_earlier_answer():
    w = synthetic_workload(200, seed=0)
    by_session = {}
    for r in w:
        _, _, sid, turn = r.request_id.split("-")
        by_session.setdefault(sid, {})[int(turn[1:])] = r
    pairs = [(t[k], t[k + 1]) for t in by_session.values() for k in t if k + 1 in t]
    assert pairs
    for first, second in pairs:
        whole = np.concatenate([first.prompt, first.output])
        assert np.array_equal(second.prompt[: whole.size], whole)


def test_synthetic_workload_validates():
    with pytest.raises(ValueError, match="synthetic_workload: num_requests=0, must be >= 1"):
        synthetic_workload(0)
    with pytest.raises(ValueError, match="synthetic_workload: seed=-1, must be >= 0"):
        synthetic_workload(5, seed=-1)
    with pytest.raises(TypeError, match="synthetic_workload: num_requests=2.5, must be an int"):
        synthetic_workload(2.5)


# --------------------------------------------------------------------------- Mooncake reader


def rec(ts, n_in, n_out, ids):
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def test_trace_prefix_identity_and_private_tail(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [
        rec(0, 1000, 5, [0, 1]),
        rec(0, 1100, 3, [0, 2, 3]),
        rec(5, 1024, 1, [0, 4]),  # a full last block keeps its id's tokens
        rec(6, 1024, 2, [0, 4]),
    ])
    r = read_mooncake_trace(path)
    B = MOONCAKE_BLOCK_TOKENS
    assert [x.prompt_length for x in r] == [1000, 1100, 1024, 1024]
    assert [x.output_length for x in r] == [5, 3, 1, 2]
    assert np.array_equal(r[0].prompt[:B], r[1].prompt[:B])  # id 0 shared
    assert not np.array_equal(r[0].prompt[B:1000], r[1].prompt[B:1000])
    assert np.array_equal(r[2].prompt, r[3].prompt)  # same ids, both full
    assert r[2].arrival == 0.005
    for x in r:
        assert x.prompt.dtype == np.int32 and 1 <= x.prompt.min() and x.prompt.max() <= 2**31 - 2
    # Private tokens (partial tails, outputs) differ between requests.
    assert not np.array_equal(r[2].output, r[3].output[:1])
    assert not np.array_equal(r[0].output[:3], r[1].output)
    again = read_mooncake_trace(path)
    assert all(np.array_equal(x.prompt, y.prompt) and np.array_equal(x.output, y.output) for x, y in zip(r, again))
    other = read_mooncake_trace(path, seed=9)
    assert not np.array_equal(r[0].prompt, other[0].prompt)
    # At page 512 the ceiling of r[3] is one page (block 0 and 4 minus the last token).
    c = infinite_cache_ceiling(r, B)
    assert c.per_request.tolist() == [0, B, B, B]


def test_trace_sorted_by_timestamp_stable_and_truncated(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [
        rec(10, 10, 1, [7]), rec(0, 20, 1, [8]), rec(10, 30, 1, [9]), "", rec(3, 40, 0, [1]),
    ])
    r = read_mooncake_trace(path)
    assert [x.prompt_length for x in r] == [20, 40, 10, 30]
    assert r[1].output_length == 1  # output_length 0: a prefill still samples one token
    assert [x.prompt_length for x in read_mooncake_trace(path, num_requests=2)] == [20, 40]


@pytest.mark.parametrize("line, message", [
    ("{not json", r"t.jsonl:2: malformed JSON \(Expecting property name enclosed in double quotes at column 2\)"),
    ("[1, 2]", r"t.jsonl:2: expected a JSON object, got list"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}', r"t.jsonl:2: missing field 'hash_ids'"),
    ('{"timestamp": "0", "input_length": 5, "output_length": 1, "hash_ids": [1]}',
     r"t.jsonl:2: timestamp='0', must be an int"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}',
     r"t.jsonl:2: input_length=0, must be >= 1"),
    ('{"timestamp": 0, "input_length": 5, "output_length": -1, "hash_ids": [1]}',
     r"t.jsonl:2: output_length=-1, must be >= 0"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": 3}',
     r"t.jsonl:2: hash_ids=3, must be a list of ints"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-4]}',
     r"t.jsonl:2: hash_ids\[0\]=-4, must be an int in \[0, 9007199254740992\]"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
     r"t.jsonl:2: len\(hash_ids\)=1 but input_length=600 needs ceil\(600/512\)=2"),
    ('{"timestamp": true, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
     r"t.jsonl:2: timestamp=True, must be an int"),
])
def test_trace_bad_line_names_file_and_line(tmp_path, line, message):
    path = write_trace(tmp_path / "t.jsonl", [rec(0, 5, 1, [1]), line])
    with pytest.raises(WorkloadError, match=message):
        read_mooncake_trace(path)


def test_trace_file_errors(tmp_path):
    with pytest.raises(WorkloadError, match=r"nope.jsonl: no such file"):
        read_mooncake_trace(tmp_path / "nope.jsonl")
    with pytest.raises(WorkloadError, match=r"is a directory"):
        read_mooncake_trace(tmp_path)
    empty = write_trace(tmp_path / "e.jsonl", ["", "  "])
    with pytest.raises(WorkloadError, match=r"e.jsonl: no requests \(empty file\)"):
        read_mooncake_trace(empty)
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(WorkloadError, match=r"b.jsonl: not UTF-8 text"):
        read_mooncake_trace(binary)
    with pytest.raises(ValueError, match="read_mooncake_trace: num_requests=0, must be >= 1"):
        read_mooncake_trace(empty, num_requests=0)


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("kwargs, message", [
    (dict(page_size=0), "ReplayConfig: page_size=0, must be >= 1"),
    (dict(num_blocks=1), "ReplayConfig: num_blocks=1, must be >= 2"),
    (dict(num_blocks=8, device_bytes=1024), "ReplayConfig: num_blocks=8 and device_bytes=1024 are exclusive"),
    (dict(replicas=0), "ReplayConfig: replicas=0, must be >= 1"),
    (dict(backend="torch"), "ReplayConfig: backend='torch', must be one of"),
    (dict(device="gpu"), "ReplayConfig: device='gpu', must be 'cpu', 'cuda' or 'cuda:N'"),
    (dict(max_batch_tokens=0), "ReplayConfig: max_batch_tokens=0, must be >= 1"),
    (dict(max_inflight=0), "ReplayConfig: max_inflight=0, must be >= 1"),
    (dict(host_bytes=-1), "ReplayConfig: host_bytes=-1, must be >= 0"),
])
def test_config_validates(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ReplayConfig(**kwargs)


def test_config_sizes():
    assert ReplayConfig().blocks_per_replica() == 2048
    cfg = ReplayConfig(page_size=16, device_bytes=10 * 2 * 2 * 16 * 2 * 16 * 2, num_layers=2, kv_heads=2, head_dim=16)
    assert cfg.blocks_per_replica() == 10
    assert ReplayConfig(replicas=3, max_batch_size=4).inflight_limit() == 12
    assert ReplayConfig(max_inflight=5).inflight_limit() == 5


def test_manager_class_resolves_backends():
    cls, name = manager_class("kvref")
    import kvref

    assert cls is kvref.PagedKVCacheManager and name == "kvref"
    assert manager_class("auto")[1] in ("kvfast", "kvref")
    with pytest.raises(ReplayError, match="backend='nope', must be one of"):
        manager_class("nope")


def test_manager_class_missing_kvfast_suggests_kvref(monkeypatch):
    import kvfast

    def missing(name):
        raise AttributeError(f"module 'kvfast' has no attribute {name!r}")

    monkeypatch.setattr(kvfast, "__getattr__", missing, raising=False)
    monkeypatch.delattr(kvfast, "PagedKVCacheManager", raising=False)
    with pytest.raises(ReplayError, match=r"backend 'kvfast' has no PagedKVCacheManager .*; use --backend kvref"):
        manager_class("kvfast")
    assert manager_class("auto")[1] == "kvref"


# --------------------------------------------------------------------------- the replay


def test_unbounded_pool_one_in_flight_reaches_the_ceiling(chat):
    need, _ = required_blocks(chat, 16)
    total = sum(-(-r.total_length // 16) for r in chat)
    s = replay(chat, ReplayConfig(num_blocks=total + 1, max_inflight=1, backend="kvref", **TINY))
    assert s.preemptions == 0 and s.peak_blocks_used >= need
    assert s.ceiling_hit_tokens > 0
    assert s.hit_tokens == s.ceiling_hit_tokens
    assert s.hit_rate == s.ceiling_hit_rate
    assert s.requests == len(chat) and s.prompt_tokens == sum(r.prompt_length for r in chat)


@pytest.mark.parametrize("page_size", [1, 7, 64])
def test_unbounded_pool_reaches_the_ceiling_at_any_page_size(page_size):
    w = synthetic_workload(8, seed=11)
    total = sum(-(-r.total_length // page_size) for r in w)
    s = replay(w, ReplayConfig(page_size=page_size, num_blocks=total + 1, max_inflight=1, backend="kvref", **TINY))
    assert s.hit_tokens == s.ceiling_hit_tokens > 0


def test_small_pool_preempts_and_stays_below_the_ceiling():
    w = decode_heavy()
    need, _ = required_blocks(w, 4)
    assert need == 12
    s = replay(w, ReplayConfig(page_size=4, num_blocks=need + 1, backend="kvref", **TINY))
    assert s.preemptions > 0
    assert s.hit_tokens <= s.ceiling_hit_tokens
    assert s.peak_blocks_used <= need
    assert s.output_tokens == 8 * 36 and s.requests == 8


def test_small_pool_loses_hits(chat):
    need, _ = required_blocks(chat, 16)
    s = replay(chat, ReplayConfig(num_blocks=need + 1, max_batch_tokens=256, backend="kvref", **TINY))
    roomy = replay(chat, ReplayConfig(max_batch_tokens=256, backend="kvref", **TINY))
    assert s.hit_tokens < roomy.hit_tokens <= s.ceiling_hit_tokens


@settings(max_examples=6)
@given(
    extra=st.integers(0, 300),
    inflight=st.integers(1, 8),
    tokens=st.sampled_from([1, 40, 512, 4096]),
    page=st.sampled_from([4, 16]),
    batch=st.integers(1, 4),
    replicas=st.integers(1, 2),
    host=st.sampled_from([0, 1 << 20]),
)
def test_hit_rate_never_exceeds_the_ceiling(extra, inflight, tokens, page, batch, replicas, host):
    w = synthetic_workload(6, seed=5)
    need, _ = required_blocks(w, page)
    s = replay(w, ReplayConfig(page_size=page, num_blocks=need + 1 + extra, max_inflight=inflight,
                               max_batch_tokens=tokens, max_batch_size=batch, replicas=replicas,
                               host_bytes=host, backend="kvref", **TINY))
    assert 0 <= s.hit_tokens <= s.ceiling_hit_tokens
    assert host or s.external_hit_tokens == 0
    assert s.peak_blocks_used <= (need + extra) * replicas
    assert s.requests == 6 and s.series["waiting"][-1] == 0 and s.series["running"][-1] == 0


def test_host_tier_serves_external_hits(chat):
    need, _ = required_blocks(chat, 16)
    s = replay(chat, ReplayConfig(num_blocks=need + 40, host_bytes=4 << 20, max_batch_tokens=256,
                                  backend="kvref", **TINY))
    assert s.external_hit_tokens > 0
    assert s.d2h_bytes > 0 and s.h2d_bytes > 0
    assert s.hit_tokens <= s.ceiling_hit_tokens
    assert s.manager_metrics["h2d_bytes_copied"] == s.h2d_bytes


def test_disk_tier_in_a_temporary_directory_is_removed(chat, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    need, _ = required_blocks(chat, 16)
    need, _ = required_blocks(chat, 64)
    s = replay(chat[:6], ReplayConfig(page_size=64, num_blocks=need + 8, disk_bytes=4 << 20, max_batch_tokens=256,
                                      backend="kvref", **TINY))
    assert s.disk_bytes_written > 0
    assert s.hit_tokens <= s.ceiling_hit_tokens
    assert list(tmp_path.iterdir()) == []  # the temporary disk directory is gone


def test_disk_dir_given_stays(chat, tmp_path):
    need, _ = required_blocks(chat, 16)
    d = tmp_path / "disk"
    d.mkdir()
    need, _ = required_blocks(chat, 64)
    s = replay(chat[:6], ReplayConfig(page_size=64, num_blocks=need + 8, disk_bytes=4 << 20, disk_dir=str(d),
                                      max_batch_tokens=256, backend="kvref", allocate_buffers=True, **TINY))
    assert s.disk_bytes_written > 0
    assert any(d.rglob("*"))  # real bytes: block files, and they stay


def test_two_replicas_route_and_stay_below_the_ceiling(chat):
    need, _ = required_blocks(chat, 16)
    s = replay(chat, ReplayConfig(num_blocks=need + 60, replicas=2, max_batch_size=4, backend="kvref", **TINY))
    assert s.replicas == 2
    assert 0 < s.hit_tokens <= s.ceiling_hit_tokens


def test_stats_series_and_json_ready(chat):
    s = replay(chat[:10], ReplayConfig(backend="kvref", **TINY))
    assert set(s.series) == set(ReplayStats.SERIES_KEYS)
    assert all(len(v) == s.steps for v in s.series.values())
    assert s.series["step"] == list(range(s.steps))
    assert sum(s.series["batch_tokens"]) == (
        s.prompt_tokens - s.hit_tokens + s.output_tokens - s.requests  # every token computed once
    )
    assert s.series["hit_rate"][-1] == pytest.approx(s.hit_rate)
    assert s.bookkeeping_us_p50 > 0 and s.bookkeeping_s_total > 0
    d = json.loads(json.dumps(s.as_dict()))
    assert d["hit_rate"] == s.hit_rate and d["ceiling_hit_rate"] == s.ceiling_hit_rate
    assert d["series"]["blocks_used"] == s.series["blocks_used"]


def test_progress_is_called_every_step(chat):
    calls = []
    s = replay(chat[:5], ReplayConfig(backend="kvref", **TINY), progress=lambda *a: calls.append(a))
    assert len(calls) == s.steps
    assert calls[-1] == (5, 5, s.steps)
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)


def test_replay_refuses_bad_input(chat):
    with pytest.raises(ValueError, match="replay: requests is empty"):
        replay([], ReplayConfig())
    need, longest = required_blocks(chat, 16)
    with pytest.raises(ValueError, match=(
        rf"replay: num_blocks={need} holds {need - 1} usable blocks of 16 tokens per replica, "
        rf"but request {longest.request_id} needs {need}"
    )):
        replay(chat, ReplayConfig(num_blocks=need, backend="kvref", **TINY))
    # Exactly enough for the longest request alone still runs.
    s = replay(chat[:6], ReplayConfig(num_blocks=required_blocks(chat[:6], 16)[0] + 1, backend="kvref", **TINY))
    assert s.requests == 6


# --------------------------------------------------------------------------- scheduler mechanics


class _Spy:
    """Manager subclass factory: checks invariants and records what the loop did."""

    def __init__(self, slow_polls=0):
        import kvref

        spy = self
        self.instances = []
        self.events = []
        self.slow = {}  # request id -> its Slow onload
        self.first_alloc_done = set()
        base = kvref.PagedKVCacheManager

        class Slow:
            """An onload that reports incomplete for a few polls."""

            def __init__(self, inner):
                self.inner, self.left = inner, slow_polls

            def is_complete(self):
                if self.left:
                    self.left -= 1
                    return False
                return self.inner.is_complete()

            def synchronize(self):
                self.left = 0
                self.inner.synchronize()

        class Checked(base):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                spy.instances.append(self)

            def alloc(self, ctx, **k):
                t = super().alloc(ctx, **k)
                first = ctx.request_id not in spy.first_alloc_done
                spy.first_alloc_done.add(ctx.request_id)
                if slow_polls and first and ctx.cached_prefix_length:
                    spy.events.append(("cordon", ctx.request_id))
                    spy.slow[ctx.request_id] = Slow(t)
                    return spy.slow[ctx.request_id]
                return t

            def release(self, ctx):
                spy.events.append(("release", ctx.request_id))
                spy.first_alloc_done.discard(ctx.request_id)
                super().release(ctx)
                self.check_invariants()

            def runtime_inputs(self, batches, **k):
                for b in batches:
                    for ctx in b:  # a cordoned request never runs before its onload lands
                        t = spy.slow.get(ctx.request_id)
                        assert t is None or t.left == 0, ctx.request_id
                out = super().runtime_inputs(batches, **k)
                self.check_invariants()
                return out

        self.cls = Checked


def test_loop_keeps_invariants_and_releases_everything(monkeypatch):
    spy = _Spy()
    monkeypatch.setattr(replay_mod, "manager_class", lambda backend: (spy.cls, "kvref"))
    w = decode_heavy()
    s = replay(w, ReplayConfig(page_size=4, num_blocks=14, **TINY))
    assert s.preemptions > 0
    mgr = spy.instances[-1]  # [0] may be the bookkeeping-only probe
    assert mgr.block_count(0).used == 0  # every request released, nothing pinned
    released = [rid for kind, rid in spy.events if kind == "release"]
    assert len(released) == len(w) + s.preemptions
    assert {r.request_id for r in w} == set(released)


def test_cordoned_requests_wait_for_their_onload(chat, monkeypatch):
    spy = _Spy(slow_polls=3)
    monkeypatch.setattr(replay_mod, "manager_class", lambda backend: (spy.cls, "kvref"))
    base = replay(chat[:12], ReplayConfig(backend="kvref", **TINY))
    s = replay(chat[:12], ReplayConfig(**TINY))
    assert any(kind == "cordon" for kind, _ in spy.events)
    assert max(s.series["cordoned"]) > 0
    assert s.hit_tokens <= s.ceiling_hit_tokens
    assert s.requests == base.requests and s.output_tokens == base.output_tokens
    assert spy.instances[-1].block_count(0).used == 0


def test_pool_that_can_never_fit_the_head_is_a_replay_error(monkeypatch):
    import kvref

    class Stingy(kvref.PagedKVCacheManager):
        def alloc(self, ctx, **k):
            from kvspec import InsufficientBlocksError

            raise InsufficientBlocksError("alloc: needs 9 blocks, 0 free")

    monkeypatch.setattr(replay_mod, "manager_class", lambda backend: (Stingy, "kvref"))
    w = synthetic_workload(3, seed=0)
    with pytest.raises(ReplayError, match=r"replay: request chat-00000-\S+ \(\d+ tokens to compute, \d+ in all\) "
                                          r"does not fit replica 0: \d+ of \d+ blocks free and nothing else in flight"):
        replay(w, ReplayConfig(**TINY))


# --------------------------------------------------------------------------- Mooncake conversation trace


@needs_traces
def test_conversation_trace_page_512_reaches_its_ceiling():
    w = read_mooncake_trace(CONVERSATION, num_requests=12)
    total = sum(-(-r.total_length // 512) for r in w)
    s = replay(w, ReplayConfig(page_size=512, num_blocks=total + 1, max_inflight=1, backend="kvref",
                               num_layers=1, kv_heads=1, head_dim=1))
    assert s.ceiling_hit_tokens > 0  # every conversation request starts with block 0
    assert s.hit_tokens == s.ceiling_hit_tokens


@needs_traces
def test_conversation_trace_small_pool_preempts_and_loses_hits():
    # Twenty requests of at most 16k tokens (the trace's 87k-token request would
    # need the whole pool alone); a pool 8 pages above the longest one.
    w = [r for r in read_mooncake_trace(CONVERSATION, num_requests=60) if r.total_length <= 16384][:20]
    need, _ = required_blocks(w, 512)
    tiny = dict(page_size=512, backend="kvref", num_layers=1, kv_heads=1, head_dim=1)
    s = replay(w, ReplayConfig(num_blocks=need + 8, max_batch_tokens=2048, **tiny))
    assert s.preemptions > 0
    assert s.hit_tokens <= s.ceiling_hit_tokens
    assert s.lost_hit_total == s.ceiling_hit_tokens - s.hit_tokens and s.attribution_mismatches == 0
    assert s.requests == 20 and s.output_tokens == sum(r.output_length for r in w)
    roomy = replay(w, ReplayConfig(num_blocks=1000, max_inflight=1, **tiny))
    assert roomy.hit_tokens == roomy.ceiling_hit_tokens == s.ceiling_hit_tokens


def test_public_surface():
    for name in kvcache.__all__:
        assert getattr(kvcache, name) is not None
    assert kvcache.__version__ == "0.1.0"


def _has_kvfast_manager() -> bool:
    try:
        manager_class("kvfast")
        return True
    except ReplayError:
        return False


@pytest.mark.skipif(not _has_kvfast_manager(), reason="kvfast has no PagedKVCacheManager in this build")
def test_kvfast_and_kvref_replay_identically():
    # Without tiers a replay is deterministic step by step (with tiers, when a
    # worker thread finishes an offload moves block use between steps).
    chat = synthetic_workload(8, seed=2)
    cases = [(decode_heavy(12), ReplayConfig(page_size=4, num_blocks=14, **TINY)),
             (chat, ReplayConfig(num_blocks=required_blocks(chat, 16)[0] + 5, **TINY))]
    for w, cfg in cases:
        runs = [replay(w, dataclasses.replace(cfg, backend=b)) for b in ("kvref", "kvfast")]
        ref, fast = (r.as_dict() for r in runs)
        for key in ("device_hit_tokens", "external_hit_tokens", "ceiling_hit_tokens", "peak_blocks_used",
                    "mean_blocks_used", "preemptions", "steps"):
            assert ref[key] == fast[key], key
        for key in ("blocks_used", "batch_tokens", "batch_requests", "running", "waiting", "hit_rate",
                    "preemptions"):
            assert ref["series"][key] == fast["series"][key], key
    assert runs[0].preemptions == 0 and ref["hit_tokens"] > 0
    assert replay(cases[0][0], cases[0][1]).preemptions > 0


@pytest.mark.parametrize("pending_polls", [0, 2])
def test_failed_onloads_are_counted_and_lose_their_external_hit(chat, monkeypatch, pending_polls):
    import kvref
    from kvspec import KVLoadFailed

    class Failing:
        """An onload in flight for ``pending_polls`` polls, then failed (reported once)."""

        def __init__(self):
            self.left, self.raised = pending_polls, False

        def is_complete(self):
            if self.left:
                self.left -= 1
                return False
            if not self.raised:
                self.raised = True
                raise KVLoadFailed("injected: copy failed")
            return True

        def synchronize(self):
            self.left = 0
            self.is_complete()

    failed = []

    class Flaky(kvref.PagedKVCacheManager):
        def alloc(self, ctx, **k):
            t = super().alloc(ctx, **k)
            if ctx.cached_prefix_external_length and ctx.request_id not in failed:
                t.synchronize()  # the real copy lands; the scheduler sees a failure
                failed.append(ctx.request_id)
                return Failing()
            return t

    monkeypatch.setattr(replay_mod, "manager_class", lambda backend: (Flaky, "kvref"))
    need, _ = required_blocks(chat, 16)
    s = replay(chat, ReplayConfig(num_blocks=need + 40, host_bytes=4 << 20, max_batch_tokens=256, **TINY))
    assert failed and s.load_failures == len(failed)
    assert s.external_hit_tokens == 0  # every onload failed: only device hits stand
    assert (max(s.series["cordoned"]) > 0) == bool(pending_polls)
    assert 0 < s.device_hit_tokens <= s.ceiling_hit_tokens


def test_report_table_json_and_bytes(chat, tmp_path):
    from kvcache.report import format_bytes, format_table, write_json

    assert [format_bytes(n) for n in (0, 1023, 1536, 5 << 20, 3 << 40)] == [
        "0 B", "1023 B", "1.5 KiB", "5.0 MiB", "3.0 TiB"]
    s = replay(chat[:4], ReplayConfig(backend="kvref", **TINY), workload="four chats")
    table = format_table(s)
    assert table.splitlines()[0] == "kvcache replay: four chats, backend kvref"
    assert "failed onloads" not in table
    s.load_failures = 2
    assert "failed onloads" in format_table(s)
    path = tmp_path / "s.json"
    write_json(s, path, config={"page_size": 16})
    doc = json.loads(path.read_text())
    assert doc["config"] == {"page_size": 16} and doc["runs"][0]["load_failures"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]


@pytest.mark.parametrize("tokens, batch, inflight", [(64, 3, None), (1, 2, 4), (700, 32, 1)])
def test_scheduler_limits_hold_every_step(chat, tokens, batch, inflight):
    s = replay(chat[:10], ReplayConfig(max_batch_tokens=tokens, max_batch_size=batch, max_inflight=inflight,
                                       backend="kvref", **TINY))
    ser = s.series
    assert max(ser["batch_tokens"]) <= tokens
    assert max(ser["batch_requests"]) <= batch
    limit = inflight if inflight is not None else batch
    assert all(r + c <= limit for r, c in zip(ser["running"], ser["cordoned"]))
    # Every token is computed exactly once (no preemption here): prefill after the hit, then decodes.
    assert s.preemptions == 0
    assert sum(ser["batch_tokens"]) == s.prompt_tokens - s.hit_tokens + s.output_tokens - s.requests
    if tokens == 64:  # chunked prefill: prompts of hundreds of tokens span several steps
        assert s.steps > (s.prompt_tokens - s.hit_tokens) // 64


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**62), domain=st.integers(0, 1),
       keys=st.lists(st.integers(0, 2**53), min_size=1, max_size=4), length=st.integers(1, 700),
       stride=st.sampled_from([512, 2**32]))
def test_trace_tokens_kernel_equals_the_numpy_definition(seed, domain, keys, length, stride):
    from kvcache import workload as wl

    got = wl._trace_tokens(seed, domain, keys, length, stride)
    want = wl._trace_tokens_numpy(seed, domain, keys, length, stride)
    assert got.dtype == np.int32 and np.array_equal(got, want)
    assert got.min() >= 1
