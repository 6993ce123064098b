"""The ``kvcache`` command: replay output, info, conformance, bench and every error path."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import kvcache.cli as cli
from kvcache.cli import main, parse_bytes

# The Mooncake traces live in shared/ beside the repository (never copied into it).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = next((d for d in (os.path.join(_ROOT, "..", "shared", "traces"), "/work/shared/traces")
               if os.path.isdir(d)), os.path.join(_ROOT, "..", "shared", "traces"))
CONVERSATION = os.path.join(TRACES, "conversation_trace.jsonl")
TINY = ["--num-layers", "1", "--kv-heads", "1", "--head-dim", "2", "--no-progress"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def percent(out: str, label: str) -> float:
    m = re.search(rf"{label}\s+([\d.]+) %", out)
    assert m, out
    return float(m.group(1))


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("kvcache: error: "), err
    assert "Traceback" not in err
    return lines[0][len("kvcache: error: "):]


def write_trace(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


GOOD = [
    json.dumps({"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [0, 1]}),
    json.dumps({"timestamp": 1, "input_length": 1100, "output_length": 2, "hash_ids": [0, 1, 2]}),
]


# --------------------------------------------------------------------------- replay output


def test_default_replay_prints_the_table_under_the_ceiling(capsys):
    # The README's first command, in process.
    code, out, err = run(capsys, "replay", "--no-progress")
    assert code == 0, err
    assert err == ""
    assert "built-in chat (300 requests, seed 0)" in out
    for label in ("requests", "prompt tokens", "prefix hit rate", "infinite-cache ceiling", "block use peak / mean",
                  "preemptions", "tier bytes moved", "bookkeeping per step"):
        assert label in out
    assert 0 < percent(out, "prefix hit rate") <= percent(out, "infinite-cache ceiling")


def test_replay_json_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra (matplotlib)")
    js, png = tmp_path / "r.json", tmp_path / "r.png"
    code, out, err = run(capsys, "replay", "--num-requests", "10", "--json", str(js), "--plot", str(png), *TINY)
    assert code == 0, err
    doc = json.loads(js.read_text())
    assert doc["schema_version"] == 2 and doc["sweep"] is None and len(doc["runs"]) == 1
    run0 = doc["runs"][0]
    assert run0["requests"] == 10
    assert run0["hit_rate"] <= run0["ceiling_hit_rate"]
    assert sum(run0["lost_hit_tokens"].values()) == run0["ceiling_hit_tokens"] - run0["hit_tokens"]
    assert doc["config"]["num_requests"] == 10 and doc["config"]["num_blocks"] == 2048
    assert len(run0["series"]["blocks_used"]) == run0["steps"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(js) in out and str(png) in out
    assert not list(tmp_path.glob("*.tmp"))


def test_replay_trace_with_tiers_and_replicas(capsys, tmp_path):
    path = write_trace(tmp_path / "t.jsonl", GOOD * 3)
    code, out, err = run(capsys, "replay", "--trace", path, "--page-size", "64", "--num-blocks", "60",
                         "--host-bytes", "1MiB", "--replicas", "2", "--max-batch-size", "2", *TINY)
    assert code == 0, err
    assert "trace t.jsonl (6 requests, seed 0)" in out
    assert "x 2 (page 64 tokens)" in out
    assert percent(out, "prefix hit rate") <= percent(out, "infinite-cache ceiling")


@pytest.mark.skipif(not os.path.isfile(CONVERSATION), reason=f"Mooncake traces not present at {TRACES}")
def test_replay_conversation_trace_page_512_reaches_its_ceiling(capsys):
    code, out, err = run(capsys, "replay", "--trace", CONVERSATION, "--num-requests", "8", "--page-size", "512",
                         "--num-blocks", "400", "--max-inflight", "1", "--backend", "kvref", "--head-dim", "1",
                         "--kv-heads", "1", "--num-layers", "1", "--no-progress")
    assert code == 0, err
    assert percent(out, "prefix hit rate") == percent(out, "infinite-cache ceiling") > 0


def test_progress_bar_on_a_terminal(capsys, monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    fake = Tty()
    monkeypatch.setattr(sys, "stderr", fake)
    code = main(["replay", "--num-requests", "4", "--num-layers", "1", "--kv-heads", "1", "--head-dim", "2"])
    assert code == 0
    text = fake.getvalue()
    assert text.startswith("kvcache: reading the built-in chat workload ...\n")  # a first line at once
    assert "4/4" in text and "req/s" in text  # tqdm: count, rate (and ETA while running)
    assert "prefix hit rate" in capsys.readouterr().out


def test_no_progress_bar_when_not_a_terminal(capsys):
    code, out, err = run(capsys, "replay", "--num-requests", "3", "--num-layers", "1", "--kv-heads", "1",
                         "--head-dim", "2")
    assert code == 0 and err == ""


# --------------------------------------------------------------------------- error paths


@pytest.mark.parametrize("argv, code, message", [
    ([], 2, "a command is required: replay, info, conformance or bench (see kvcache --help)"),
    (["frobnicate"], 2, "argument COMMAND: invalid choice: 'frobnicate'"),
    (["replay", "--bogus"], 2, "unrecognized arguments: --bogus"),
    (["replay", "--page-size", "x"], 2, "argument --page-size: invalid int value: 'x'"),
    (["replay", "--page-size", "0"], 2, "--page-size=0, must be >= 1"),
    (["replay", "--num-blocks", "1"], 2, "--num-blocks=1, must be >= 2"),
    (["replay", "--replicas", "0"], 2, "--replicas=0, must be >= 1"),
    (["replay", "--max-batch-size", "0"], 2, "--max-batch-size=0, must be >= 1"),
    (["replay", "--max-batch-tokens", "0"], 2, "--max-batch-tokens=0, must be >= 1"),
    (["replay", "--max-inflight", "0"], 2, "--max-inflight=0, must be >= 1"),
    (["replay", "--num-requests", "0"], 2, "--num-requests=0, must be >= 1"),
    (["replay", "--seed", "-1"], 2, "--seed=-1, must be >= 0"),
    (["replay", "--head-dim", "0"], 2, "--head-dim=0, must be >= 1"),
    (["replay", "--backend", "torch"], 2, "argument --backend: invalid choice: 'torch'"),
    (["replay", "--device", "gpu"], 2, "--device=gpu, must be cpu, cuda or cuda:N"),
    (["replay", "--num-blocks", "9", "--device-bytes", "1MiB"], 2,
     "--num-blocks=9 and --device-bytes=1MiB are exclusive"),
    (["replay", "--device-bytes", "12XB"], 2,
     "--device-bytes=12XB: '12XB' is not a byte count (use e.g. 1048576, 512MiB or 4GB)"),
    (["replay", "--host-bytes", "0.5"], 2, "--host-bytes=0.5: '0.5' is not a whole number of bytes"),
    (["replay", "--device-bytes", "0"], 2, "--device-bytes=0, must be > 0"),
    (["replay", "--device-bytes", "100"], 2, "--device-bytes=100 holds 0 pages of 4096 bytes, must hold >= 2"),
    (["conformance"], 2, "the following arguments are required: --backend"),
    (["conformance", "--backend", "nope"], 2, "--backend=nope: no such backend (entry points: "),
    (["conformance", "--backend", "a b:c"], 2, "--backend=a b:c: must be NAME or MODULE:FACTORY"),
    (["conformance", "--backend", "mod:"], 2, "--backend=mod:: must be NAME or MODULE:FACTORY"),
    (["conformance", "--backend", "no_such_module_xyz:make"], 2,
     "--backend=no_such_module_xyz:make: no module named 'no_such_module_xyz'"),
])
def test_usage_errors(capsys, argv, code, message):
    got, out, err = run(capsys, *argv)
    assert got == code
    assert out == ""
    assert one_error_line(err).startswith(message)


def test_pool_too_small_for_the_longest_request(capsys):
    got, out, err = run(capsys, "replay", "--num-requests", "20", "--num-blocks", "50", *TINY)
    assert got == 2 and out == ""
    assert re.fullmatch(
        r"--num-blocks=50 holds 49 usable blocks of 16 tokens per replica, but request chat-\S+ needs \d+ "
        r"\(\d+ prompt \+ \d+ output tokens\); a pool of \d+ blocks \(\d+\.\d KiB\) at page size 16, "
        r"or page size \d+ with 50 blocks would fit", one_error_line(err))
    got, out, err = run(capsys, "replay", "--num-requests", "20", "--device-bytes", "16KiB", "--page-size", "16",
                        *TINY)
    assert got == 2
    assert one_error_line(err).startswith("--device-bytes=16KiB holds 127 usable blocks of 16 tokens per replica")


def test_trace_errors_name_the_file_and_line(capsys, tmp_path):
    missing = tmp_path / "nope.jsonl"
    got, _, err = run(capsys, "replay", "--trace", str(missing), *TINY)
    assert got == 2 and one_error_line(err) == f"{missing}: no such file"
    bad = write_trace(tmp_path / "bad.jsonl", GOOD + ["{oops"])
    got, _, err = run(capsys, "replay", "--trace", bad, *TINY)
    assert got == 2
    assert one_error_line(err) == (
        f"{bad}:3: malformed JSON (Expecting property name enclosed in double quotes at column 2)")
    short = write_trace(tmp_path / "short.jsonl", [GOOD[0], '{"timestamp": 0, "input_length": 5}'])
    got, _, err = run(capsys, "replay", "--trace", short, *TINY)
    assert got == 2 and one_error_line(err) == f"{short}:2: missing field 'output_length' " \
                                              f"(need timestamp, input_length, output_length, hash_ids)"
    empty = write_trace(tmp_path / "empty.jsonl", [])
    got, _, err = run(capsys, "replay", "--trace", empty, *TINY)
    assert got == 2 and one_error_line(err) == f"{empty}: no requests (empty file)"
    got, _, err = run(capsys, "replay", "--trace", str(tmp_path), *TINY)
    assert got == 2 and one_error_line(err) == f"{tmp_path}: is a directory, not a JSONL file"


def test_output_path_errors(capsys, tmp_path):
    got, _, err = run(capsys, "replay", "--json", str(tmp_path / "no" / "r.json"), *TINY)
    assert got == 2 and one_error_line(err) == f"--json={tmp_path / 'no' / 'r.json'}: directory {tmp_path / 'no'} " \
                                              f"does not exist"
    got, _, err = run(capsys, "replay", "--plot", str(tmp_path), *TINY)
    assert got == 2 and one_error_line(err) == f"--plot={tmp_path}: is a directory"


def test_disk_options_errors(capsys, tmp_path):
    got, _, err = run(capsys, "replay", "--disk-dir", str(tmp_path), *TINY)
    assert got == 2 and one_error_line(err) == f"--disk-dir={tmp_path} needs --disk-bytes > 0"
    f = tmp_path / "file"
    f.write_text("x")
    got, _, err = run(capsys, "replay", "--disk-dir", str(f), "--disk-bytes", "1MiB", *TINY)
    assert got == 2 and one_error_line(err) == f"--disk-dir={f}: exists and is not a directory"


def test_plot_without_matplotlib(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    got, out, err = run(capsys, "replay", "--plot", str(tmp_path / "p.png"), *TINY)
    assert got == 2 and out == ""
    assert one_error_line(err) == '--plot needs matplotlib: pip install "kvcache[plot]"'
    assert not (tmp_path / "p.png").exists()


def test_missing_kvfast_manager_suggests_kvref(capsys, monkeypatch):
    import kvfast

    def missing(name):
        raise AttributeError(f"module 'kvfast' has no attribute {name!r}")

    monkeypatch.setattr(kvfast, "__getattr__", missing, raising=False)
    monkeypatch.delattr(kvfast, "PagedKVCacheManager", raising=False)
    got, out, err = run(capsys, "replay", "--backend", "kvfast", "--num-requests", "2", *TINY)
    assert got == 1 and out == ""
    line = one_error_line(err)
    assert line.startswith("backend 'kvfast' has no PagedKVCacheManager") and line.endswith("; use --backend kvref")


def test_internal_error_is_one_line_and_traceback_on_request(capsys, monkeypatch):
    import kvcache.replay

    def boom(*a, **k):
        raise KeyError("boom")

    monkeypatch.setattr(kvcache.replay, "replay", boom)
    got, out, err = run(capsys, "replay", "--num-requests", "2", *TINY)
    assert got == 70
    assert one_error_line(err) == "internal error: KeyError: 'boom' (rerun with --traceback for details)"
    assert main(["--traceback", "replay", "--num-requests", "2", *TINY]) == 70
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "KeyError: 'boom'" in err


def test_keyboard_interrupt(capsys, monkeypatch):
    import kvcache.replay

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(kvcache.replay, "replay", interrupted)
    got, _, err = run(capsys, "replay", "--num-requests", "2", *TINY)
    assert got == 130 and err == "kvcache: interrupted\n"


def test_replay_error_when_the_head_never_fits(capsys, monkeypatch):
    import kvcache.replay
    from kvcache.replay import ReplayError

    def stuck(*a, **k):
        raise ReplayError("replay: request r does not fit replica 0")

    monkeypatch.setattr(kvcache.replay, "replay", stuck)
    got, _, err = run(capsys, "replay", "--num-requests", "2", *TINY)
    assert got == 1 and one_error_line(err) == "replay: request r does not fit replica 0"


def test_backend_refusing_the_device_is_one_line(capsys, monkeypatch):
    import kvref

    class NoGpu(kvref.PagedKVCacheManager):
        def __init__(self, *a, **k):
            raise RuntimeError("PagedKVCacheManager: device='cuda:0' needs CuPy and a GPU")

    import kvcache.replay

    monkeypatch.setattr(kvcache.replay, "manager_class", lambda backend: (NoGpu, "kvref"))
    got, out, err = run(capsys, "replay", "--device", "cuda", "--num-requests", "2", *TINY)
    assert got == 1 and out == ""
    assert one_error_line(err) == "PagedKVCacheManager: device='cuda:0' needs CuPy and a GPU"


def test_help_and_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == "kvcache 0.1.0"
    with pytest.raises(SystemExit) as e:
        main(["replay", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for flag in ("--trace", "--page-size", "--num-blocks", "--device-bytes", "--host-bytes", "--disk-bytes",
                 "--disk-dir", "--replicas", "--backend", "--device", "--seed", "--num-requests",
                 "--max-batch-size", "--max-batch-tokens", "--max-inflight", "--json", "--plot", "--no-progress"):
        assert flag in out


# --------------------------------------------------------------------------- info, conformance, bench


def test_info(capsys):
    code, out, err = run(capsys, "info")
    assert code == 0 and err == ""
    assert out.startswith("kvcache 0.1.0\npython ")
    assert "numpy " in out and "devices: cpu (" in out and "gpu: " in out
    assert "kvref = kvref:conformance_backend" in out
    assert "kvref.PagedKVCacheManager: ok" in out


def test_gpu_status_explains_a_missing_cupy(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cupy" else real(name, *a))
    assert cli.gpu_status() == (False, 'CuPy is not installed (pip install "kvcache[gpu]")')


def test_conformance_runs_pytest_on_the_suite(capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(subprocess, "call", lambda cmd: calls.append(cmd) or 3)
    code, _, err = run(capsys, "conformance", "--backend", "kvref", "--", "-x", "-q")
    assert code == 3 and err == ""
    assert calls == [[sys.executable, "-m", "pytest", "--pyargs", "kvspec.conformance",
                      "--kv-backend=kvref:conformance_backend", "-x", "-q"]]
    calls.clear()
    assert main(["conformance", "--backend", "kvref:conformance_backend"]) == 3
    assert calls[0][-1] == "--kv-backend=kvref:conformance_backend"
    calls.clear()
    assert main(["conformance", "-x", "--backend", "kvref", "-k", "machine"]) == 3  # no "--" needed
    assert calls[0][-3:] == ["-x", "-k", "machine"]


def test_bench_without_its_module(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvcache.bench", None)  # as if kvcache/bench.py were absent
    got, out, err = run(capsys, "bench")
    assert got == 1 and out == ""
    assert one_error_line(err) == "kvcache bench: the benchmark module kvcache/bench.py is not part of this build"


needs_bench = pytest.mark.skipif(importlib.util.find_spec("kvcache.bench") is None,
                                 reason="kvcache/bench.py is not part of this build")


@needs_bench
def test_bench_passes_its_arguments_and_keeps_errors_to_one_line(capsys, monkeypatch):
    import kvcache.bench as bench

    seen = []
    monkeypatch.setattr(bench, "run_bench", lambda **k: seen.append(k) or [])
    monkeypatch.setattr(bench, "print_table", lambda rows, file=None: print("TABLE"))
    code, out, err = run(capsys, "bench", "--quick", "--only", "prepare")
    assert code == 0 and out == "TABLE\n" and err == ""
    assert seen == [{"quick": True, "replay_requests": 128, "only": ["prepare"]}]
    code, out, err = run(capsys, "bench", "--only", "nope")
    assert code == 2 and out == ""
    assert one_error_line(err).startswith("--only: unknown ['nope'], choose from append,prepare,attention,replay")
    code, out, err = run(capsys, "bench", "--bogus")
    assert code == 2 and one_error_line(err) == "unrecognized arguments: --bogus"
    code, out, err = run(capsys, "bench", "--help")  # kvcache.bench's own help
    assert code == 0 and out.startswith("usage: kvcache bench") and err == ""


@pytest.mark.parametrize("text, value", [
    ("0", 0), ("1048576", 1048576), ("512MiB", 512 << 20), ("4GB", 4 * 10**9), ("1.5GiB", 3 << 29),
    ("64k", 64000), ("2 KiB", 2048), ("7B", 7), ("1ti", 1 << 40),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "-1", "1.5", "12XB", "MiB", "1e6", "0x10"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError, match="is not a (byte count|whole number of bytes)"):
        parse_bytes(text)


# --------------------------------------------------------------------------- the console script


@pytest.mark.skipif(shutil.which("kvcache") is None, reason="the kvcache console script is not installed")
def test_console_script_error_and_success():
    bad = subprocess.run(["kvcache", "replay", "--page-size", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert bad.stderr == "kvcache: error: --page-size=0, must be >= 1\n"
    ok = subprocess.run(["kvcache", "replay", "--num-requests", "3", *TINY], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "infinite-cache ceiling" in ok.stdout and ok.stderr == ""


@pytest.mark.skipif(importlib.util.find_spec("kvspec.conformance.plugin") is None,
                    reason="the conformance plugin is not part of this build")
def test_conformance_collects_the_suite_for_kvref():
    r = subprocess.run([sys.executable, "-m", "kvcache.cli", "conformance", "--backend", "kvref", "--",
                        "--collect-only", "-q", "-p", "no:cacheprovider"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"\d+ tests? collected", r.stdout)
