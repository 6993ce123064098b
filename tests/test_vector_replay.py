"""The compiled-language example (examples/vector_replay/): a C++ backend of the
paged slot cache's bookkeeping replays golden vectors without Python."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "vector_replay"
VECTORS = ROOT / "spec" / "vectors"
PAGED = ("slot_cache_paged.json", "slot_cache_random_paged_1.json", "slot_cache_random_paged_2.json")


@pytest.fixture(scope="module")
def replay(tmp_path_factory) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH (.ci/run installs g++)")
    exe = tmp_path_factory.mktemp("replay") / "replay"
    r = subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-o", str(exe),
                        str(EXAMPLE / "replay.cpp")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return exe


def test_cpp_backend_replays_the_paged_vectors_and_the_hash_chain(replay):
    r = subprocess.run([str(replay), *(str(VECTORS / n) for n in PAGED), str(VECTORS / "hashing.json")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "slot_cache_paged: 28 records replayed; every result, error and state matches" in r.stdout, r.stdout
    for name in PAGED[1:]:
        assert f"{name[:-5]}: " in r.stdout and "every result, error and state matches" in r.stdout
    assert "hashing: 12 sha256 cases match" in r.stdout, r.stdout


@pytest.mark.parametrize("field,edit", [
    ("result", lambda rec: rec.update(result=rec["result"] + 2)),                              # an admit hit
    ("state.free_order", lambda rec: rec["state"]["free_order"].reverse()),
    ("state.kv_sha256", lambda rec: rec["state"].update(kv_sha256="0" * 64)),
])
def test_cpp_replay_reports_a_difference(replay, tmp_path, field, edit):
    """The replayer really checks: an edited record is reported by index, op and field."""
    vec = json.loads((VECTORS / "slot_cache_paged.json").read_text())
    i = next(i for i, r in enumerate(vec["records"])
             if r["op"] == "admit" and "error" not in r and r["result"] > 0 and len(r["state"]["free_order"]) > 1)
    edit(vec["records"][i])
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(vec))
    r = subprocess.run([str(replay), str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.startswith(f"record {i} (admit): {field}: got "), r.stdout
