"""`kvcache replay --remote`: two processes share a prefix cache through a real Redis
(issue 8; spec/remote-tier.md §7). Skips only when no redis-server binary exists."""

import json
import subprocess
import sys

import pytest

from _redis_servers import redis_server, redis_shared  # noqa: F401
from kvcache.cli import main


def _replay(url, out, extra=()):
    cmd = [sys.executable, "-m", "kvcache.cli", "replay", "--num-requests", "20", "--no-progress",
           "--host-bytes", "1Mi", "--remote", url, "--json", str(out), "--real-bytes", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())["runs"][0]  # real bytes: what one process offloads, the next loads


def test_second_process_hits_what_the_first_offloaded(redis_server, tmp_path):
    a = _replay(redis_server.url, tmp_path / "a.json")
    assert a["external_hit_tokens"] == 0  # nothing shared yet: a fresh store
    b = _replay(redis_server.url, tmp_path / "b.json")
    # process B ("another machine") has an empty device pool and host tier, so its
    # first use of each shared prefix is served from Redis
    assert b["external_hit_tokens"] > 0
    # the first use of each shared system prompt cannot hit in a fresh single process
    # (A's ceiling says so); B serves it from Redis, so B beats A's hit count
    assert b["hit_tokens"] > a["hit_tokens"]


def test_dead_remote_is_a_miss_not_a_failure(tmp_path):
    # a port nobody listens on: every remote call is a miss, the replay completes
    from _redis_servers import free_port

    out = _replay(f"redis://127.0.0.1:{free_port()}/0", tmp_path / "dead.json")
    assert out["external_hit_tokens"] == 0 and out["requests"] == 20


@pytest.mark.parametrize("url", ["http://x:1", "redis://", "redis://h:1/x"])
def test_bad_remote_url_is_one_error_line(url, capsys):
    assert main(["replay", "--remote", url, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvcache: error: --remote=")
