"""Reports of a replay: the summary table, the JSON file and the plot."""

from __future__ import annotations

import json
import os

from .replay import ReplayStats

__all__ = ["format_table", "write_json", "write_plot", "check_plot_available", "format_bytes"]


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units, one decimal past bytes."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _us(x: float) -> str:
    return f"{x / 1000:.2f} ms" if x >= 1000 else f"{x:.0f} µs"


def format_table(stats: ReplayStats) -> str:
    """The summary table ``kvcache replay`` prints, one figure per line.

    Parameters
    ----------
    stats : ReplayStats

    Returns
    -------
    str
        Lines of ``label  value``, no trailing newline.
    """
    s = stats
    total = s.blocks_per_replica - 1  # the null block is never used
    cap = total * s.replicas
    pct = (lambda x: 100.0 * x / cap) if cap else (lambda x: 0.0)
    rows = [
        ("requests", f"{s.requests:,}"),
        ("prompt tokens", f"{s.prompt_tokens:,} (+{s.output_tokens:,} generated)"),
        ("prefix hit rate", f"{100 * s.hit_rate:.2f} %  (device {100 * s.device_hit_rate:.2f} %, "
                            f"external {100 * s.external_hit_rate:.2f} %)"),
        ("infinite-cache ceiling", f"{100 * s.ceiling_hit_rate:.2f} %  (page {s.page_size}, whole pages, "
                                   f"last token never reused)"),
        ("device blocks", f"{total:,} per replica x {s.replicas} (page {s.page_size} tokens)"),
        ("block use peak / mean", f"{s.peak_blocks_used:,} / {s.mean_blocks_used:,.1f}  "
                                  f"({pct(s.peak_blocks_used):.1f} % / {pct(s.mean_blocks_used):.1f} %)"),
        ("preemptions", f"{s.preemptions:,}"),
        ("tier bytes moved", f"device->host {format_bytes(s.d2h_bytes)}, "
                             f"host->device {format_bytes(s.h2d_bytes)}, "
                             f"disk write {format_bytes(s.disk_bytes_written)}, "
                             f"disk read {format_bytes(s.disk_bytes_read)}"),
        ("scheduler steps", f"{s.steps:,}"),
        ("bookkeeping per step", f"mean {_us(s.bookkeeping_us_mean)}, p50 {_us(s.bookkeeping_us_p50)}, "
                                 f"p99 {_us(s.bookkeeping_us_p99)}"),
        ("wall time", f"{s.wall_s:.2f} s"),
    ]
    if s.load_failures:
        rows.insert(7, ("failed onloads", f"{s.load_failures:,}"))
    width = max(len(k) for k, _ in rows)
    head = f"kvcache replay: {s.workload}, backend {s.backend}"
    return "\n".join([head] + [f"  {k:<{width}}  {v}" for k, v in rows])


def write_json(stats: ReplayStats, path: str | os.PathLike, config: dict | None = None) -> None:
    """Write the figures, the manager's metrics and the per-step series as JSON.

    The file is written to a temporary name beside ``path`` and renamed, so a
    reader never sees half a file.
    """
    doc = {"config": config or {}, **stats.as_dict()}
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def check_plot_available() -> None:
    """Raise ``ImportError`` with an install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401  (availability check)
    except ImportError:
        raise ImportError('--plot needs matplotlib: pip install "kvcache[plot]"') from None


def write_plot(stats: ReplayStats, path: str | os.PathLike) -> None:
    """Plot occupancy, hit rate and tier traffic over scheduler steps to ``path`` (PNG)."""
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = stats.series
    x = s["step"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    ax = axes[0]
    ax.plot(x, s["blocks_used"], label="blocks in use")
    ax.axhline((stats.blocks_per_replica - 1) * stats.replicas, color="grey", ls="--", label="pool")
    ax.set_ylabel("device blocks")
    ax.legend(loc="lower right")
    ax = axes[1]
    ax.plot(x, [100 * v for v in s["hit_rate"]], label="prefix hit rate (admitted so far)")
    ax.axhline(100 * stats.ceiling_hit_rate, color="grey", ls="--", label="infinite-cache ceiling")
    ax.set_ylabel("%")
    ax.legend(loc="lower right")
    ax = axes[2]
    mib = 1024.0 * 1024.0
    for key, label in (("d2h_bytes", "device->host"), ("h2d_bytes", "host->device"),
                       ("disk_bytes_written", "disk write"), ("disk_bytes_read", "disk read")):
        ax.plot(x, [v / mib for v in s[key]], label=label)
    ax.set_ylabel("MiB moved (cumulative)")
    ax.set_xlabel("scheduler step")
    ax.legend(loc="upper left")
    fig.suptitle(f"kvcache replay: {stats.workload}, backend {stats.backend}")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
