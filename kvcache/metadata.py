"""Machine and version metadata recorded with every benchmark result.

``kvcache bench --json`` writes it next to the rows, so two result files say
what they were measured on (the asv results in ``asv_bench/results/`` carry
asv's own machine file and the same versions).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from importlib import metadata as _md

__all__ = ["machine_metadata"]

#: Distributions whose versions change the figures.
_PACKAGES = ("kvcache", "numpy", "numba", "llvmlite", "ml_dtypes", "xxhash", "cupy-cuda12x", "numba-cuda")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    """The commit of the checkout kvcache runs from (None when not a git checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def machine_metadata() -> dict:
    """What a benchmark figure was measured on.

    Returns
    -------
    dict
        ``date`` (UTC, ISO 8601), ``hostname``, ``os``, ``machine`` (the
        architecture), ``cpu`` (model name), ``cpu_count`` (logical CPUs the
        process may use), ``python``, ``versions`` (installed distributions of
        ``kvcache`` and its numeric dependencies; absent ones are left out) and
        ``git_commit`` (None outside a git checkout). JSON-ready.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 0
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = _md.version(name)
        except _md.PackageNotFoundError:
            continue
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": cpus,
        "python": sys.version.split()[0],
        "versions": versions,
        "git_commit": _git_commit(),
    }
