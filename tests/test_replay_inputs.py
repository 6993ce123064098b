"""Hostile input to ``kvcache replay`` (issue 11 items 8, 11, 12, 13): every one is a single
``kvcache: error: ...`` line with exit 2 (or a clean run), never an internal error, a password in
the output, or a replaced special file."""

from __future__ import annotations

import json
import os
import stat

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache.cli import main, redact_url

TINY = ("--num-layers", "1", "--kv-heads", "1", "--head-dim", "2", "--no-progress", "--backend", "kvref")
GOOD = {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [0, 1]}


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcache: error: "), err
    assert "internal error" not in lines[0] and "Traceback" not in err
    return lines[0][len("kvcache: error: "):]


# --------------------------------------------------------------------------- item 8: passwords, IPv6


def test_redact_url():
    assert redact_url("redis://:s3cret@db:6379/0") == "redis://***@db:6379/0"
    assert redact_url("redis://user:pw@[::1]:6379") == "redis://***@[::1]:6379"
    assert redact_url("redis://db:6379/0") == "redis://db:6379/0"


@pytest.mark.parametrize("url", ["redis://:hunter2pass@bad host:6379/0", "redis://:hunter2pass@db:99999/0",
                                 "redis://:hunter2pass@db:6379/x", "http://:hunter2pass@db:6379",
                                 "redis://:hunter2pass@[::zz]:6379/0"])
def test_a_refused_remote_url_never_prints_its_password(capsys, url):
    code, out, err = run(capsys, "replay", "--remote", url, *TINY)
    assert code == 2
    line = one_error(err)
    assert "hunter2pass" not in out + err and line.startswith("--remote=")


def test_a_password_never_reaches_errors_or_json(capsys, tmp_path, monkeypatch):
    # An accepted URL (IPv6 literal) whose tier then fails: the error, the traceback and the JSON never
    # carry the password.
    import kvcache.replay as replay_mod

    def refuse(*a, **k):
        raise RuntimeError("cannot reach redis://:hunter2pass@[::1]:6390/0 (connection refused)")

    monkeypatch.setattr(replay_mod, "replay", refuse)
    code, out, err = run(capsys, "replay", "--remote", "redis://:hunter2pass@[::1]:6390/0", "--num-requests", "2",
                         *TINY)
    assert code == 1 and "hunter2pass" not in out + err and "***" in err
    code = main(["--traceback", "replay", "--remote=redis://:hunter2pass@[::1]:6390/0", "--num-requests", "2",
                 *TINY])
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" in err and "hunter2pass" not in out + err
    monkeypatch.undo()
    # The JSON document's config: the URL redacted.
    import types

    from kvcache import cli
    from kvcache.replay import ReplayConfig

    args = types.SimpleNamespace(remote="redis://:hunter2pass@[::1]:6390/0", page_size="16")
    d = cli._config_dict(args, ReplayConfig())
    assert "hunter2pass" not in json.dumps(d) and d["remote"] == "redis://***@[::1]:6390/0"


# --------------------------------------------------------------------------- item 11: output targets


def test_json_to_stdout(capsys):
    code, out, err = run(capsys, "replay", "--num-requests", "3", "--json", "-", *TINY)
    assert code == 0, err
    doc = json.loads(out)  # stdout is the JSON alone; the table went to stderr
    assert doc["schema_version"] == 2 and doc["runs"][0]["requests"] == 3
    assert "prefix hit rate" in err
    assert not os.path.exists("-")


def test_json_writes_through_a_symlink(capsys, tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    code, out, err = run(capsys, "replay", "--num-requests", "3", "--json", str(link), *TINY)
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())["runs"][0]["requests"] == 3


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_special_targets_are_refused_never_replaced(capsys, tmp_path, flag):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code, out, err = run(capsys, "replay", "--num-requests", "3", flag, str(fifo), *TINY)
    assert code == 2 and out == ""
    assert one_error(err) == f"{flag}={fifo}: is a FIFO; refusing to replace it (give a regular file or -)"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    code, out, err = run(capsys, "replay", "--num-requests", "3", flag, "/dev/null", *TINY)
    assert code == 2 and "is a device node" in one_error(err)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    link = tmp_path / "to-fifo"
    link.symlink_to(fifo)
    code, out, err = run(capsys, "replay", "--num-requests", "3", flag, str(link), *TINY)
    assert code == 2 and "is a FIFO" in one_error(err) and link.is_symlink()


# --------------------------------------------------------------------------- item 12: hostile traces


HOSTILE = [
    ({**GOOD, "hash_ids": [10**23, 1]}, "hash_ids[0]=100000000000000000000000, must be an int in [0, "),
    ({**GOOD, "timestamp": int("9" * 400)}, "timestamp=" + "9" * 57 + "..., must be <= 9007199254740992"),
    ({**GOOD, "output_length": 10**10}, "output_length=10000000000, must be <= 4194304"),
    ({**GOOD, "input_length": 10**12, "hash_ids": [0]}, "input_length=1000000000000, must be <= 4194304"),
    ({**GOOD, "input_length": "600"}, "input_length='600', must be an int"),
    ({**GOOD, "hash_ids": {"a": 1}}, "hash_ids={'a': 1}, must be a list of ints"),
    ({**GOOD, "hash_ids": [0, 1.5]}, "hash_ids[1]=1.5, must be an int in"),
    ({**GOOD, "timestamp": 1.5}, "timestamp=1.5, must be an int"),
    ({**GOOD, "cache_salt": 7}, "cache_salt=7, must be a string of at most 1024 UTF-8 bytes, or null"),
    ({**GOOD, "hash_ids": list(range(10**5))}, "len(hash_ids)=100000 but input_length=600"),
]


@pytest.mark.parametrize("record, message", HOSTILE)
def test_hostile_trace_values(capsys, tmp_path, record, message):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(record) + "\n")
    code, out, err = run(capsys, "replay", "--trace", str(path), *TINY)
    assert code == 2 and out == ""
    line = one_error(err)
    assert line.startswith(f"{path}:2: {message}"), line
    assert len(line) < 400


def test_deeply_nested_json_is_one_line(capsys, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    code, out, err = run(capsys, "replay", "--trace", str(path), *TINY)
    assert code == 2 and one_error(err) == f"{path}:1: JSON nested too deeply"


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(field=st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids", "cache_salt", "extra"]),
       value=_json_values | st.integers(-(2**70), 2**70) | st.lists(st.integers(-(2**70), 2**70), max_size=3),
       raw=st.sampled_from(["", "{", "[1,", "\x00", '{"timestamp": 1e999}', "nan"]))
def test_randomized_hostile_lines_never_crash(capsys, tmp_path, field, value, raw):
    path = tmp_path / "t.jsonl"
    rec = {**GOOD, field: value}
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(rec) + "\n" + (raw + "\n" if raw else ""))
    code, out, err = run(capsys, "replay", "--trace", str(path), "--page-size", "512", *TINY)
    if code == 0:
        assert "prefix hit rate" in out
    else:
        assert code == 2, err
        assert one_error(err).startswith(f"{path}:")


# --------------------------------------------------------------------------- item 13: flag bounds


BOUNDS = [
    (["--replicas", "100000"], "--replicas=100000, must be <= 1024"),
    (["--page-size", "100000000"], "--page-size=100000000, must be <= 1048576"),
    (["--num-blocks", str(2**40)], f"--num-blocks={2**40}, must be <= 4194304"),
    (["--replicas", "1000", "--num-blocks", "100000"], "--replicas=1000 x 100000 blocks x 1 leaves = 100000000 blocks"),
    (["--max-batch-tokens", str(10**12)], "--max-batch-tokens=1000000000000, must be <= 16777216"),
    (["--max-batch-size", str(10**9)], "--max-batch-size=1000000000, must be <= 65536"),
    (["--seed", str(2**64)], f"--seed={2**64}, must be <= {2**63 - 1}"),
    (["--num-requests", str(10**7)], "--num-requests=10000000, must be <= 200000 for the built-in workload"),
    (["--head-dim", str(2**20)], f"--head-dim={2**20}, must be <= 65536"),
    (["--host-bytes", "1TiB", "--real-bytes"], "--host-bytes=1099511627776 allocates 1024.0 GiB of real buffers"),
    # neither size flag given: the message names the default and the flags that set the size
    (["--page-size", "100000", "--head-dim", "4096", "--real-bytes"],
     "the default device pool (2048 blocks of 100000 tokens per replica; --num-blocks or --device-bytes set its size)"),
    (["--page-size", "100000", "--head-dim", "4096", "--num-blocks", "2048", "--real-bytes"],
     "--num-blocks=2048 allocates"),
    (["--device-bytes", "99999999TiB"], f"--device-bytes={99999999 * 2**40}, must be <= {2**60}"),
    (["--page-size", "1" * 40], "argument --page-size: invalid int value: '" + "1" * 40),
    (["--device", "cuda:" + "9" * 50], "--device=cuda:99999"),
]


@pytest.mark.parametrize("argv, message", BOUNDS)
def test_flag_bounds(capsys, argv, message):
    code, out, err = run(capsys, "replay", *TINY, *argv)
    assert code == 2 and out == "", err
    assert one_error(err).startswith(message), err


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(["--page-size", "--num-blocks", "--replicas", "--max-batch-size", "--max-batch-tokens",
                             "--max-inflight", "--num-requests", "--seed", "--num-layers", "--kv-heads",
                             "--head-dim", "--device-bytes", "--host-bytes", "--disk-bytes", "--workers"]),
       value=st.sampled_from([-(2**63), -1, 0, 2**31 - 1, 2**31, 2**32, 2**53, 2**63 - 1, 2**63, 2**64, 10**30]))
def test_integer_extremes_of_every_flag(capsys, flag, value):
    # head size 128: a page of 16 tokens is 8 KiB, so a byte size near 2**31 is a quarter million blocks
    code, out, err = run(capsys, "replay", *TINY, "--head-dim", "128", flag, str(value), "--num-requests", "2")
    if code == 0:  # an extreme that is in range (a big seed, a big pool planned bookkeeping-only)
        assert "prefix hit rate" in out
    else:
        assert code in (1, 2), err
        line = one_error(err)
        assert flag in line or "argument" in line or "does not implement bookkeeping-only" in line, line
