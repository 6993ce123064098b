"""mkdocs hook: the benchmark history page (``benchmarks.md``), built from the
asv results kept in the repository (``asv_bench/results/<machine>/*.json``).

One table per benchmark: a row per recorded commit (oldest first), a column
per parameter combination. Adding a run (see the page) and rebuilding the site
adds a row; nothing else has to change.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import json
import math
import os
import re

from mkdocs.structure.files import File

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "asv_bench", "results")

ADD_A_RUN = """\
```bash
pip install -e ".[bench]"
cd asv_bench
asv machine --yes --machine kvcache-ref-2core --os "Linux (Debian 12)" --arch x86_64 \\
    --cpu "AMD EPYC (2 vCPU, shared)" --num_cpu 2 --ram "shared VM"   # once per machine
asv run --python=same --quick --machine kvcache-ref-2core --set-commit-hash $(git rev-parse HEAD)
# a subset: add --bench REGEX (e.g. "^bench_append"); runs of one commit merge into one file
git add results && git commit -m "asv: results of $(git rev-parse --short HEAD)" -- results
```"""


def _fmt(value, unit: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"  # skipped (e.g. no GPU) or failed
    if unit == "seconds":
        for scale, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")):
            if abs(value) >= scale:
                return f"{value / scale:.3g} {name}"
        return f"{value:.3g} s"
    if float(value).is_integer():
        return f"{int(value):,} {unit}".strip()
    return f"{value:.4g} {unit}".strip()


def _label(combo) -> str:
    """A parameter combination as table text (enum reprs by member name, no HTML-like brackets)."""
    parts = [re.sub(r"<\w+\.(\w+): [^>]*>", r"\1", str(p)).strip("'\"") for p in combo]
    return ", ".join(parts).replace("<", "&lt;") or "-"


def load_history(results_dir: str = RESULTS) -> tuple[dict, dict, list]:
    """``(benchmarks, machines, runs)`` from an asv results directory.

    ``runs``: one dict per result file, ``{machine, commit, date, results}``,
    sorted by date; ``results`` maps a benchmark name to
    ``(values, params)``.
    """
    benchmarks, machines, runs = {}, {}, []
    if not os.path.isdir(results_dir):
        return benchmarks, machines, runs
    path = os.path.join(results_dir, "benchmarks.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            benchmarks = {k: v for k, v in json.load(f).items() if isinstance(v, dict)}
    for machine in sorted(os.listdir(results_dir)):
        mdir = os.path.join(results_dir, machine)
        if not os.path.isdir(mdir):
            continue
        mfile = os.path.join(mdir, "machine.json")
        if os.path.isfile(mfile):
            with open(mfile, encoding="utf-8") as f:
                machines[machine] = json.load(f)
        for name in sorted(os.listdir(mdir)):
            if not name.endswith(".json") or name == "machine.json":
                continue
            with open(os.path.join(mdir, name), encoding="utf-8") as f:
                data = json.load(f)
            cols = data.get("result_columns", ["result", "params"])
            results = {}
            for bench, row in data.get("results", {}).items():
                rec = dict(zip(cols, row))
                results[bench] = (rec.get("result"), rec.get("params") or [])
            runs.append({"machine": machine, "commit": data.get("commit_hash", "")[:8],
                         "date": data.get("date", 0), "python": data.get("python", ""), "results": results,
                         "versions": data.get("params", {})})
    runs.sort(key=lambda r: r["date"])
    return benchmarks, machines, runs


def page_markdown(results_dir: str = RESULTS) -> str:
    benchmarks, machines, runs = load_history(results_dir)
    out = ["# Benchmark history", "",
           "Every figure below is an [asv](https://asv.readthedocs.io) result kept in the repository "
           "(`asv_bench/results/`), one row per recorded commit. The benchmarks are in "
           "`asv_bench/benchmarks/`; `kvcache bench --json` records the same machine and version "
           "metadata for the ratio table of the [performance page](performance.md).", "",
           "## Adding a run", "", ADD_A_RUN, "",
           "`--quick` runs each benchmark once (the machine is shared); drop it on a quiet machine for "
           "repeated samples. A `--quick` row is one sample on a shared machine: compare rows of the same "
           "machine, and read a single row as indicative. `n/a` is a benchmark that was skipped (the CUDA "
           "ones without a GPU) or failed. `asv publish` (then `asv preview`) builds asv's interactive pages "
           "from the same files into `asv_bench/.asv/html`.", "", "## Machines", ""]
    if not machines:
        out += ["No machine has recorded results yet.", ""]
    for name, info in machines.items():
        desc = ", ".join(f"{k}: {v}" for k, v in info.items() if k not in ("version", "machine") and v)
        out.append(f"* `{name}`: {desc}")
    out.append("")
    for bench in sorted({b for r in runs for b in r["results"]}):
        meta = benchmarks.get(bench, {})
        unit = meta.get("unit", "seconds")
        params = next((r["results"][bench][1] for r in runs if bench in r["results"] and r["results"][bench][1]), [])
        combos = list(itertools.product(*params)) if params else [()]
        out += [f"## `{bench}`", ""]
        if meta.get("param_names"):
            out += [f"Parameters: {', '.join(meta['param_names'])}.", ""]
        out.append("| date | commit | machine | " + " | ".join(_label(c) for c in combos) + " |")
        out.append("| --- | --- | --- | " + " | ".join("---" for _ in combos) + " |")
        for r in runs:
            if bench not in r["results"]:
                continue
            values = r["results"][bench][0]
            values = values if isinstance(values, list) else [values]
            day = _dt.datetime.fromtimestamp(r["date"] / 1000, _dt.timezone.utc).strftime("%Y-%m-%d")
            cells = [_fmt(v, unit) for v in values] + ["-"] * (len(combos) - len(values))
            out.append(f"| {day} | `{r['commit']}` | {r['machine']} | " + " | ".join(cells) + " |")
        out.append("")
    if not runs:
        out += ["No results are recorded yet.", ""]
    return "\n".join(out)


def on_files(files, config):
    files.append(File.generated(config, "benchmarks.md", content=page_markdown()))
    return files
