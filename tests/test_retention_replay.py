"""``kvcache replay --retention`` (spec/manager.md §14): priorities from the trace or by rule
(requests sharing their first 512 tokens with another: a system prompt), hit rates side by side."""

from __future__ import annotations

import json

import pytest

from kvcache.cli import main
from kvcache.replay import ReplayConfig, replay
from kvcache.workload import WorkloadError, read_mooncake_trace, with_retention, without_retention


def _system_burst_trace(path, *, claim: dict | None = None) -> None:
    """8 rounds of: two system-prompt requests (2 shared blocks of 512 tokens + 1 private),
    then three one-off requests of 6 private blocks (a burst that overflows a 400-page pool)."""
    lines, t, uid = [], 0, 1000
    for _ in range(8):
        for sys_ids in ([1, 2], [3, 4]):
            uid += 1
            rec = {"timestamp": t, "input_length": 1536, "output_length": 8, "hash_ids": sys_ids + [uid]}
            rec.update(claim or {})
            lines.append(rec)
            t += 10
        for _ in range(3):
            ids = list(range(uid + 1, uid + 7))
            uid += 6
            lines.append({"timestamp": t, "input_length": 3072, "output_length": 8, "hash_ids": ids})
            t += 10
    path.write_text("".join(json.dumps(rec) + "\n" for rec in lines))


def test_rule_assigns_system_prompts_and_keeps_their_hits(tmp_path):
    trace = tmp_path / "t.jsonl"
    _system_burst_trace(trace)
    reqs = read_mooncake_trace(trace)
    high = with_retention(reqs)
    assert [r.retention for r in high].count({"retention_priority": 80}) == 16  # the system-prompt requests
    assert all(r.retention == {} for r in without_retention(high))
    cfg = ReplayConfig(page_size=16, num_blocks=400, max_batch_size=1)
    lru = replay(without_retention(reqs), cfg)
    kept = replay(high, cfg)
    assert lru.hit_rate == 0.0  # every burst evicts both system prompts
    assert kept.hit_rate == pytest.approx(kept.ceiling_hit_rate)  # retention: every later round hits them
    assert kept.hit_rate == pytest.approx(14 * 1024 / (16 * 1536 + 24 * 3072))


def test_trace_claims_are_read_and_checked(tmp_path):
    trace = tmp_path / "t.jsonl"
    _system_burst_trace(trace, claim={"retention_priority": 90, "retention_seconds": 600})
    reqs = read_mooncake_trace(trace)
    assert sum(r.retention == {"retention_priority": 90, "retention_seconds": 600} for r in reqs) == 16
    # a request that carries a claim keeps it; the rule only fills in the others
    assert all(a is b for a, b in zip(with_retention(reqs, priority=50), reqs) if b.retention)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1],
                               "retention_priority": 101}) + "\n")
    with pytest.raises(WorkloadError, match="retention_priority=101, must be an int in 0..100"):
        read_mooncake_trace(bad)
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1],
                               "retention_seconds": 0}) + "\n")
    with pytest.raises(WorkloadError, match="retention_seconds=0"):
        read_mooncake_trace(bad)
    with pytest.raises(ValueError, match="shared_tokens=0"):
        with_retention(reqs, shared_tokens=0)


def test_cli_prints_both_hit_rates(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    _system_burst_trace(trace)
    code = main(["replay", "--trace", str(trace), "--retention", "--no-progress", "--num-blocks", "400",
                 "--max-batch-size", "1"])
    out = capsys.readouterr().out
    assert code == 0
    line = next(x for x in out.splitlines() if x.strip().startswith("retention"))
    assert "0.00 % plain LRU -> 14.58 % with retention (16 of 40 requests claimed)" in line
    assert main(["replay", "--retention", "--num-blocks", "400,500", "--no-progress"]) == 2
    assert "--retention and the sweep of --num-blocks exclude each other" in capsys.readouterr().err
