"""``kvcache bench --json`` records the machine and versions next to the rows."""

from __future__ import annotations

import json

import numpy

import kvcache.bench as bench
from kvcache.metadata import machine_metadata


def test_machine_metadata_names_the_machine_and_versions():
    md = machine_metadata()
    assert md["cpu_count"] >= 1 and md["python"].count(".") == 2 and md["cpu"]
    assert md["versions"]["numpy"] == numpy.__version__ and "kvcache" in md["versions"]
    assert md["git_commit"] is None or len(md["git_commit"]) == 40
    json.dumps(md)  # JSON-ready


def test_bench_json_has_metadata_and_rows(tmp_path, monkeypatch, capsys):
    rows = [{"benchmark": "prepare_step", "ratio": 31.5}]
    monkeypatch.setattr(bench, "run_bench", lambda **kw: rows)
    monkeypatch.setattr(bench, "print_table", lambda rows, file=None: None)
    out = tmp_path / "b.json"
    assert bench.main(["--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["rows"] == rows
    assert set(data["metadata"]) >= {"date", "cpu", "cpu_count", "python", "versions", "git_commit"}
