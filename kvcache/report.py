"""Reports of a replay or a sweep: the summary tables, the JSON document and the plots.

Outputs are written through :func:`write_output`: ``"-"`` is stdout; a
symlink is written through to its target; anything that is not a regular
file (a FIFO, a device node, a socket) is refused, never replaced; a
regular file is replaced atomically (a temporary file beside the target,
then a rename).
"""

from __future__ import annotations

import io
import json
import os
import stat
import sys
import tempfile
import textwrap

from .replay import ReplayStats

__all__ = ["SCHEMA_VERSION", "format_table", "format_sweep", "format_bytes", "json_document", "write_json",
           "write_output", "write_plot", "write_sweep_plot", "check_plot_available"]

#: Version of the ``--json`` document's layout (``runs`` list, ``lost_hit_tokens``): 2.
SCHEMA_VERSION = 2


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units, one decimal past bytes."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _gib(n: int) -> str:
    """GiB with two decimals; below 1 GiB the binary size follows in brackets."""
    text = f"{n / 2**30:,.2f} GiB"
    return text if n >= 2**30 or n == 0 else f"{text} ({format_bytes(n)})"


def _us(x: float) -> str:
    return f"{x / 1000:.2f} ms" if x >= 1000 else f"{x:.0f} µs"


def _lost_text(s: ReplayStats) -> str:
    lost = s.lost_hit_tokens
    if not lost:
        return "none"
    total = sum(lost.values())
    parts = [f"{k} {100 * v / s.prompt_tokens:.2f} %" for k, v in sorted(lost.items(), key=lambda kv: -kv[1])]
    return f"{100 * total / s.prompt_tokens:.2f} %: " + ", ".join(parts)


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
    model = f"{s.model} ({s.model_id}), " if s.model else ""
    mode = "bookkeeping only (no K/V bytes allocated)" if not s.allocate_buffers else "real buffers"
    rows = [
        ("requests", f"{s.requests:,}" + ("  (interrupted: the work done so far)" if s.interrupted else "")),
        ("prompt tokens", f"{s.prompt_tokens:,} (+{s.output_tokens:,} generated)"),
        ("prefix hit rate", f"{100 * s.hit_rate:.2f} %  (device {100 * s.device_hit_rate:.2f} %, "
                            f"external {100 * s.external_hit_rate:.2f} %)"),
        ("infinite-cache ceiling", f"{100 * s.ceiling_hit_rate:.2f} %  (page {s.page_size}, whole pages, "
                                   f"last token never reused)"),
        ("lost hits", _lost_text(s)),
        ("model", f"{model}{s.dtype}, {format_bytes(s.page_bytes)} per page; {mode}"),
        ("device blocks", f"{total:,} per replica x {s.replicas} (page {s.page_size} tokens)"),
        ("device pool", f"{_gib(s.pool_bytes)} over {s.replicas} replica(s), "
                        f"{s.capacity_tokens:,} tokens of capacity"),
        ("tiers", f"host {_gib(s.host_bytes) if s.host_bytes else 'none'}, "
                  f"disk {_gib(s.disk_bytes) if s.disk_bytes else 'none'}"
                  if s.host_bytes or s.disk_bytes else "none"),
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
        rows.insert(11, ("failed onloads", f"{s.load_failures:,}"))
    if s.attribution_mismatches:
        rows.insert(5, ("attribution", f"{s.attribution_mismatches} request(s) hit more than the cold-start "
                                       f"ladder allows (a warm tier?)"))
    at = 1 + next(i for i, (k, _) in enumerate(rows) if k == "block use peak / mean")
    rows[at:at] = _leaf_rows(s.leaves)
    width = max(len(k) for k, _ in rows)
    head = f"kvcache replay: {s.workload}, backend {s.backend}"
    return "\n".join([head] + [f"  {k:<{width}}  {v}" for k, v in rows])


def _leaf_rows(leaves: dict) -> list[tuple[str, str]]:
    """One table row per leaf of a hybrid model: its kind, bytes per page and pages in use."""
    rows = []
    for lid, leaf in leaves.items():
        kind = leaf["kind"] + (f" {leaf['window']}" if leaf["window"] else "")
        size = leaf["page_bytes"]
        rows.append((f"leaf {lid}", f"{kind}, {format_bytes(size)} per page; pages in use peak "
                                    f"{leaf['pages_peak']:,} / mean {leaf['pages_mean']:,.1f}  "
                                    f"({format_bytes(leaf['pages_peak'] * size)} / "
                                    f"{format_bytes(int(leaf['pages_mean'] * size))})"))
    return rows


def _value_text(name: str, value) -> str:
    return format_bytes(value) if name.endswith("_bytes") else f"{value:,}"


def _pct1(x: float) -> str:
    return f"{x:.1f}" if x >= 0.05 else "<0.1"


def format_sweep(runs: list, name: str) -> str:
    """One row per swept value: hit rate, ceiling, the largest lost-hit causes, preemptions, capacity."""
    if not runs:
        return "kvcache replay sweep: no run finished"
    head = (f"{'--' + name.replace('_', '-'):>16}  {'blocks':>9}  {'capacity':>12}  {'hit %':>6}  "
            f"{'ceiling %':>9}  {'preempt':>7}  lost hits (% of prompt tokens)")
    lines = [f"kvcache replay sweep: {runs[0][0].workload}, backend {runs[0][0].backend}", head]
    for s, value in runs:
        lost = ", ".join(f"{k} {_pct1(100 * v / s.prompt_tokens)}"
                         for k, v in sorted(s.lost_hit_tokens.items(), key=lambda kv: -kv[1])) or "none"
        lines.append(f"{_value_text(name, value):>16}  {s.blocks_per_replica - 1:>9,}  "
                     f"{s.capacity_tokens:>12,}  {100 * s.hit_rate:>6.2f}  {100 * s.ceiling_hit_rate:>9.2f}  "
                     f"{s.preemptions:>7,}  {lost}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- outputs


def write_output(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path``: ``"-"`` is stdout; a symlink is written through to its target; a
    target that exists and is not a regular file is refused (``ValueError``), never replaced.

    Raises
    ------
    ValueError
        The target is a FIFO, device node, socket or directory.
    OSError
        The directory is not writable.
    """
    path = os.fspath(path)
    if path == "-":
        out = getattr(sys.stdout, "buffer", None)
        if out is None:
            sys.stdout.write(data.decode("utf-8", "replace"))
        else:
            sys.stdout.flush()
            out.write(data)
            out.flush()
        return
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path}: is not a regular file (a FIFO, device node, socket or directory); "
                         f"refusing to replace it")
    fd, tmp = tempfile.mkstemp(prefix=".kvcache-", suffix=".tmp", dir=os.path.dirname(real))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, real)  # the symlink (if any) stays and points at the new file
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def json_document(runs: list, config: dict | None = None, sweep: str | None = None) -> dict:
    """The ``--json`` document: ``schema_version``, ``config``, ``sweep`` and ``runs``.

    ``runs`` holds ``ReplayStats`` or ``(ReplayStats, swept value)`` pairs; each becomes
    ``ReplayStats.as_dict()`` (``hit_tokens``, ``ceiling_hit_tokens``, ``lost_hit_tokens``: cause -> tokens,
    every figure of the table, ``series``) plus ``sweep_value`` in a sweep.
    """
    out = []
    for run in runs:
        s, value = run if isinstance(run, tuple) else (run, None)
        d = s.as_dict()
        if sweep is not None:
            d["sweep_value"] = value
        out.append(d)
    return {"schema_version": SCHEMA_VERSION, "config": config or {}, "sweep": sweep, "runs": out}


def write_json(runs, path: str | os.PathLike, config: dict | None = None, sweep: str | None = None) -> None:
    """Write :func:`json_document` to ``path`` (``"-"``: stdout) through :func:`write_output`.

    ``runs`` is a list (see :func:`json_document`) or one ``ReplayStats``.
    """
    if isinstance(runs, ReplayStats):
        runs = [runs]
    text = json.dumps(json_document(runs, config, sweep), indent=1) + "\n"
    write_output(path, text.encode("utf-8"))


def check_plot_available() -> None:
    """Raise ``ImportError`` with an install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401  (availability check)
    except ImportError:
        raise ImportError('--plot needs matplotlib: pip install "kvcache[plot]"') from None


def _pyplot():
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_output(path, buf.getvalue())


def write_plot(stats: ReplayStats, path: str | os.PathLike) -> None:
    """Plot a run to ``path`` (PNG; ``"-"``: stdout): blocks in use against the pool, the hit rate
    against the ceiling, the lost hits by cause, and the cumulative tier traffic. Panels with no data
    (no lost hits, no tier traffic) are left out."""
    plt = _pyplot()
    s = stats.series
    x = s["step"]
    tier_keys = [k for k in ("d2h_bytes", "h2d_bytes", "disk_bytes_written", "disk_bytes_read") if any(s[k])]
    panels = ["blocks", "hit"] + (["lost"] if stats.lost_hit_tokens else []) + (["tiers"] if tier_keys else [])
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3 * len(panels)))
    for name, ax in zip(panels, axes):
        if name == "blocks":
            ax.plot(x, s["blocks_used"], label="blocks in use")
            ax.axhline((stats.blocks_per_replica - 1) * stats.replicas, color="grey", ls="--", label="pool")
            ax.set_ylabel("device blocks")
            ax.set_xlabel("scheduler step")
            ax.legend(loc="lower right")
        elif name == "hit":
            ax.plot(x, [100 * v for v in s["hit_rate"]], label="prefix hit rate (admitted so far)")
            ax.axhline(100 * stats.ceiling_hit_rate, color="grey", ls="--", label="infinite-cache ceiling")
            ax.set_ylabel("%")
            ax.set_xlabel("scheduler step")
            ax.legend(loc="lower right")
        elif name == "lost":
            items = sorted(stats.lost_hit_tokens.items(), key=lambda kv: -kv[1])
            ax.barh([k for k, _ in items], [100 * v / stats.prompt_tokens for _, v in items], color="tab:red")
            ax.invert_yaxis()
            ax.set_xlabel("lost hits, % of prompt tokens (ceiling minus hit rate)")
        else:
            top = max(max(s[k]) for k in tier_keys)
            unit, div = next((u, d) for u, d in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10),
                                                 ("B", 1)) if top >= d or d == 1)
            labels = {"d2h_bytes": "device->host", "h2d_bytes": "host->device",
                      "disk_bytes_written": "disk write", "disk_bytes_read": "disk read"}
            for key in tier_keys:
                ax.plot(x, [v / div for v in s[key]], label=labels[key])
            ax.set_ylabel(f"{unit} moved (cumulative)")
            ax.set_xlabel("scheduler step")
            ax.legend(loc="upper left")
    fig.suptitle(textwrap.fill(f"kvcache replay: {stats.workload}, backend {stats.backend}", 90), fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def write_sweep_plot(runs: list, name: str, path: str | os.PathLike) -> None:
    """The sweep's hit rate against the swept value (the ceiling dashed) over the lost hits by cause,
    stacked per value, to ``path`` (PNG; ``"-"``: stdout)."""
    plt = _pyplot()
    runs = sorted(runs, key=lambda r: r[1])
    xs = [v / 2**30 if name.endswith("_bytes") else v for _, v in runs]
    causes = sorted({k for s, _ in runs for k in s.lost_hit_tokens})
    fig, axes = plt.subplots(2 if causes else 1, 1, figsize=(9, 8 if causes else 4.5), squeeze=False)
    ax = axes[0][0]
    ax.plot(xs, [100 * s.hit_rate for s, _ in runs], marker="o", label="prefix hit rate")
    ax.plot(xs, [100 * s.ceiling_hit_rate for s, _ in runs], ls="--", color="grey", label="infinite-cache ceiling")
    unit = " (GiB)" if name.endswith("_bytes") else ""
    ax.set_xlabel(f"--{name.replace('_', '-')}{unit}")
    ax.set_ylabel("% of prompt tokens")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right")
    if len(xs) > 2 and min(xs) > 0 and max(xs) / min(xs) >= 16:
        ax.set_xscale("log", base=2)
    if causes:
        ax2 = axes[1][0]
        bottom = [0.0] * len(runs)
        labels = [f"{x:g}" for x in xs]
        for cause in causes:
            h = [100 * s.lost_hit_tokens.get(cause, 0) / s.prompt_tokens for s, _ in runs]
            ax2.bar(labels, h, bottom=bottom, label=cause)
            bottom = [b + v for b, v in zip(bottom, h)]
        ax2.set_xlabel(f"--{name.replace('_', '-')}{unit}")
        ax2.set_ylabel("lost hits, % of prompt tokens")
        ax2.legend(loc="upper right", fontsize="small")
    fig.suptitle(textwrap.fill(f"kvcache replay sweep: {runs[0][0].workload}", 90), fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
