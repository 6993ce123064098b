"""The ``kvcache`` command: ``replay``, ``info``, ``conformance``, ``bench``.

Every failure a user can cause (a missing file, a malformed trace line, an
impossible size) prints one line, ``kvcache: error: ...``, to stderr and
exits non-zero: 2 for bad input, 1 when the run itself cannot go on (a
``RuntimeError``: no manager in the backend, no GPU for ``--device cuda``,
a request that never fits). Any other exception is reported the same way
with exit code 70; ``--traceback`` shows where it came from.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import io
import os
import platform
import re
import subprocess
import sys
import time
from typing import Sequence

__all__ = ["main", "parse_bytes"]

EXIT_USAGE = 2
EXIT_FAILURE = 1
EXIT_INTERNAL = 70


class UsageError(Exception):
    """Bad command-line input; printed as one line, exit code 2."""


class CommandUnavailable(Exception):
    """A command whose implementation is not installed; exit code 1."""


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, not usage plus a message."""

    def error(self, message: str):  # noqa: D401 - argparse hook
        raise UsageError(message)


# --------------------------------------------------------------------------- option values

_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """A byte count: ``"1048576"``, ``"512MiB"``, ``"4GB"``, ``"1.5GiB"`` (``Ki``/``Mi``/``Gi``/``Ti``
    binary, ``K``/``M``/``G``/``T`` decimal, a trailing ``B`` optional).

    Raises
    ------
    ValueError
        Not a byte count, or a fraction of a byte.
    """
    m = _BYTES_RE.match(text) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"{text!r} is not a byte count (use e.g. 1048576, 512MiB or 4GB)")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def _bytes_opt(args, name: str) -> int | None:
    text = getattr(args, name)
    if text is None:
        return None
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise UsageError(f"--{name.replace('_', '-')}={text}: {e}") from None


def _at_least(args, name: str, low: int) -> None:
    value = getattr(args, name)
    if value is not None and value < low:
        raise UsageError(f"--{name.replace('_', '-')}={value}, must be >= {low}")


def _writable(flag: str, path: str | None) -> None:
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{flag}={path}: directory {parent} does not exist")
    if os.path.isdir(path):
        raise UsageError(f"{flag}={path}: is a directory")


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The ``kvcache`` argument parser (``replay``, ``info``, ``conformance``, ``bench``)."""
    from . import __version__

    p = _Parser(prog="kvcache", description="Serving-side KV cache: replay workloads, inspect, test, benchmark.")
    p.add_argument("--version", action="version", version=f"kvcache {__version__}")
    p.add_argument("--traceback", action="store_true", help="show the traceback of an unexpected error")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    r = sub.add_parser("replay", help="replay a workload through the cache and report hit rates",
                       description="Replay a workload through PagedKVCacheManager with a continuous-batching "
                                   "scheduler and print a summary table. Default workload: built-in, seeded "
                                   "multi-turn chat.")
    r.set_defaults(func=_cmd_replay)
    w = r.add_argument_group("workload")
    w.add_argument("--trace", metavar="FILE", help="Mooncake JSONL trace (default: the built-in chat workload)")
    w.add_argument("--num-requests", type=int, metavar="N",
                   help="requests to replay (default: 300 built-in, all of a trace)")
    w.add_argument("--seed", type=int, default=0, help="seed of the workload and token mapping (default 0)")
    c = r.add_argument_group("cache")
    c.add_argument("--page-size", type=int, default=16, metavar="TOKENS", help="tokens per page (default 16)")
    c.add_argument("--num-blocks", type=int, metavar="N",
                   help="device blocks per replica incl. the null block (default 2048)")
    c.add_argument("--device-bytes", metavar="BYTES", help="device pool per replica, instead of --num-blocks")
    c.add_argument("--host-bytes", metavar="BYTES", default="0", help="host tier size (default 0: none)")
    c.add_argument("--disk-bytes", metavar="BYTES", default="0", help="disk tier size (default 0: none)")
    c.add_argument("--disk-dir", metavar="DIR", help="disk tier directory (default: a temporary one)")
    c.add_argument("--remote", metavar="URL",
                   help="shared Redis tier under host and disk: redis://host:port/db or redis+cluster://host:port")
    c.add_argument("--replicas", type=int, default=1, help="data-parallel replicas (default 1)")
    c.add_argument("--backend", choices=("kvfast", "kvref"),
                   help="manager implementation (default kvfast when it has a PagedKVCacheManager, else kvref)")
    c.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    c.add_argument("--num-layers", type=int, default=2, help="model layers (default 2)")
    c.add_argument("--kv-heads", type=int, default=2, help="K/V heads (default 2)")
    c.add_argument("--head-dim", type=int, default=16, help="head size (default 16)")
    s = r.add_argument_group("scheduler")
    s.add_argument("--max-batch-size", type=int, default=32, help="requests per replica per step (default 32)")
    s.add_argument("--max-batch-tokens", type=int, default=2048, help="tokens per step (default 2048)")
    s.add_argument("--max-inflight", type=int, help="requests in flight at once (default batch size x replicas)")
    o = r.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write figures and the per-step series as JSON")
    o.add_argument("--plot", metavar="FILE.png", help="plot occupancy, hit rate and tier traffic (needs matplotlib)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")

    i = sub.add_parser("info", help="versions, devices, backends and GPU availability")
    i.set_defaults(func=_cmd_info)

    k = sub.add_parser("conformance", help="run the conformance suite against a backend",
                       usage="kvcache conformance --backend NAME_OR_MODULE:FACTORY [-- PYTEST_ARGS ...]",
                       description="Run `pytest --pyargs kvspec.conformance --kv-backend=...` in a subprocess; "
                                   "every other argument goes to pytest.")
    k.add_argument("--backend", required=True, metavar="NAME_OR_MODULE:FACTORY",
                   help="an entry point of kvcache.backends (e.g. kvref) or module:factory")
    k.set_defaults(func=_cmd_conformance)

    # kvcache.bench parses its own options (kvcache bench --help lists them).
    b = sub.add_parser("bench", help="the kvfast/kvref ratio table", add_help=False)
    b.set_defaults(func=_cmd_bench)
    return p


#: Commands whose unknown arguments pass through (to pytest, to kvcache.bench).
_PASSTHROUGH = ("conformance", "bench")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvcache`` command; returns the exit code (the console script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    show_traceback = "--traceback" in argv
    try:
        args, extra = build_parser().parse_known_args(argv)
        if extra and args.command not in _PASSTHROUGH:
            raise UsageError(f"unrecognized arguments: {' '.join(extra)}")
        args.passthrough = extra[1:] if extra[:1] == ["--"] else extra
        if args.command is None:
            raise UsageError("a command is required: replay, info, conformance or bench (see kvcache --help)")
        return args.func(args)
    except KeyboardInterrupt:
        print("kvcache: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the one place that turns errors into one line
        if show_traceback:
            raise
        code, text = _classify(e)
        print(f"kvcache: error: {text}", file=sys.stderr)
        return code


def _classify(e: Exception) -> tuple[int, str]:
    from .workload import WorkloadError

    msg = " ".join(str(e).split()) or type(e).__name__
    if isinstance(e, (UsageError, WorkloadError)):
        return EXIT_USAGE, msg
    if isinstance(e, (RuntimeError, CommandUnavailable)):
        # ReplayError, and a backend refusing the environment (no GPU for device='cuda').
        return EXIT_FAILURE, msg
    if isinstance(e, (ValueError, TypeError, ImportError)):
        return EXIT_USAGE, msg
    if isinstance(e, OSError):
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        return EXIT_FAILURE, f"{where}{e.strerror or msg}"
    return EXIT_INTERNAL, f"internal error: {type(e).__name__}: {msg} (rerun with --traceback for details)"


# --------------------------------------------------------------------------- replay


def _cmd_replay(args) -> int:
    from . import report
    from .replay import ReplayConfig, replay, required_blocks
    from .workload import read_mooncake_trace, synthetic_workload

    for name, low in (("page_size", 1), ("num_blocks", 2), ("replicas", 1), ("max_batch_size", 1),
                      ("max_batch_tokens", 1), ("max_inflight", 1), ("num_requests", 1), ("seed", 0),
                      ("num_layers", 1), ("kv_heads", 1), ("head_dim", 1)):
        _at_least(args, name, low)
    device_bytes = _bytes_opt(args, "device_bytes")
    host_bytes, disk_bytes = _bytes_opt(args, "host_bytes"), _bytes_opt(args, "disk_bytes")
    if args.num_blocks is not None and device_bytes is not None:
        raise UsageError(f"--num-blocks={args.num_blocks} and --device-bytes={args.device_bytes} are exclusive")
    if device_bytes is not None and device_bytes < 1:
        raise UsageError(f"--device-bytes={args.device_bytes}, must be > 0")
    if args.disk_dir is not None and not disk_bytes:
        raise UsageError(f"--disk-dir={args.disk_dir} needs --disk-bytes > 0")
    if args.disk_dir is not None and os.path.exists(args.disk_dir) and not os.path.isdir(args.disk_dir):
        raise UsageError(f"--disk-dir={args.disk_dir}: exists and is not a directory")
    if args.remote is not None and not re.match(r"redis(\+cluster)?://[^/:]+(:\d+)?(/\d+)?$", args.remote):
        raise UsageError(f"--remote={args.remote}, must be redis://host:port/db or redis+cluster://host:port")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise UsageError(f"--device={args.device}, must be cpu, cuda or cuda:N")
    _writable("--json", args.json)
    _writable("--plot", args.plot)
    if args.plot is not None:
        report.check_plot_available()
    config = ReplayConfig(
        page_size=args.page_size, num_blocks=args.num_blocks, device_bytes=device_bytes,
        host_bytes=host_bytes, disk_bytes=disk_bytes, disk_dir=args.disk_dir, remote_url=args.remote,
        replicas=args.replicas,
        backend=args.backend or "auto", device=args.device, max_batch_size=args.max_batch_size,
        max_batch_tokens=args.max_batch_tokens, max_inflight=args.max_inflight,
        num_layers=args.num_layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
    )
    nblocks = config.blocks_per_replica()
    if nblocks < 2:
        raise UsageError(f"--device-bytes={args.device_bytes} holds {nblocks} blocks of "
                         f"{config.page_bytes()} bytes, must hold >= 2")
    if args.trace is not None:
        requests = read_mooncake_trace(args.trace, num_requests=args.num_requests, seed=args.seed)
        label = f"trace {os.path.basename(args.trace)}"
    else:
        requests = synthetic_workload(args.num_requests or 300, seed=args.seed)
        label = "built-in chat"
    label += f" ({len(requests)} requests, seed {args.seed})"
    need, longest = required_blocks(requests, config.page_size)
    if need > nblocks - 1:
        flag = "--num-blocks" if device_bytes is None else "--device-bytes"
        value = nblocks if device_bytes is None else args.device_bytes
        raise UsageError(
            f"{flag}={value} holds {nblocks - 1} usable blocks of {config.page_size} tokens per replica, "
            f"but request {longest.request_id} needs {need} "
            f"({longest.prompt_length} prompt + {longest.output_length} output tokens)"
        )
    bar = _Progress() if (not args.no_progress and sys.stderr.isatty()) else None
    try:
        stats = replay(requests, config, workload=label, progress=bar)
    finally:
        if bar is not None:
            bar.close()
    print(report.format_table(stats))
    if args.json is not None:
        report.write_json(stats, args.json, config=_config_dict(args, config))
        print(f"  json                    {args.json}")
    if args.plot is not None:
        report.write_plot(stats, args.plot)
        print(f"  plot                    {args.plot}")
    return 0


def _config_dict(args, config) -> dict:
    d = {k: v for k, v in vars(args).items() if k not in ("func", "traceback", "command", "passthrough")}
    d["num_blocks"] = config.blocks_per_replica()
    return d


class _Progress:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self, width: int = 30):
        self.width = width
        self.last = 0.0
        self.drawn = False

    def __call__(self, done: int, total: int, step: int) -> None:
        now = time.monotonic()
        if now - self.last < 0.1 and done < total:
            return
        self.last = now
        fill = self.width * done // max(total, 1)
        sys.stderr.write(f"\rreplay [{'#' * fill}{'.' * (self.width - fill)}] {done}/{total} requests, step {step}")
        sys.stderr.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            sys.stderr.write("\r" + " " * (self.width + 60) + "\r")
            sys.stderr.flush()


# --------------------------------------------------------------------------- info


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_status() -> tuple[bool, str]:
    """Whether a CUDA device is usable from CuPy, and why not."""
    if importlib.util.find_spec("cupy") is None:
        return False, 'CuPy is not installed (pip install "kvcache[gpu]")'
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - any driver failure is the answer
        return False, f"CuPy cannot reach a device: {' '.join(str(e).split())}"
    if n == 0:
        return False, "CuPy sees no CUDA device"
    names = []
    for d in range(n):  # pragma: no cover - needs a GPU
        props = cupy.cuda.runtime.getDeviceProperties(d)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        names.append(f"cuda:{d} {name}")
    return True, ", ".join(names)  # pragma: no cover


def backends_found() -> list[tuple[str, str, str]]:
    """``(name, target, status)`` of each ``kvcache.backends`` entry point."""
    out = []
    for ep in sorted(importlib.metadata.entry_points(group="kvcache.backends"), key=lambda e: e.name):
        try:
            ep.load()
            status = "ok"
        except Exception as e:  # noqa: BLE001 - report, do not fail
            status = f"cannot load: {type(e).__name__}: {' '.join(str(e).split())}"
        out.append((ep.name, ep.value, status))
    return out


def _cmd_info(args) -> int:
    from .replay import BACKENDS, ReplayError, manager_class

    lines = [f"kvcache {_version('kvcache') or 'unknown'}",
             f"python {platform.python_version()} ({platform.python_implementation()}) on "
             f"{platform.system()} {platform.machine()}"]
    deps = ("numpy", "ml_dtypes", "numba", "xxhash")
    opt = ("cupy-cuda12x", "numba-cuda", "matplotlib", "asv", "pytest", "hypothesis", "mkdocs")
    lines.append("dependencies: " + ", ".join(f"{d} {_version(d) or 'MISSING'}" for d in deps))
    lines.append("optional: " + ", ".join(f"{d} {_version(d) or 'not installed'}" for d in opt))
    from kvfast._cuda.emulate import ENV as _EMU, enabled as _emulated

    if _emulated():  # a test device: say so before anything reports a GPU
        import kvfast  # noqa: F401  (registers the emulated cupy)

        lines.append(f"cuda emulation: ON ({_EMU}=1): device='cuda' runs on the CPU through kvfast's emulated "
                     "CuPy and the host-compiled .cu kernels; not a GPU")
    ok, why = gpu_status()
    lines.append(f"devices: cpu ({os.cpu_count()} cores); gpu: {why if ok else 'none: ' + why}")
    found = backends_found()
    lines.append("backends (entry points kvcache.backends):" + ("" if found else " none"))
    lines += [f"  {name} = {target}: {status}" for name, target, status in found]
    lines.append("managers:")
    for name in BACKENDS:
        try:
            manager_class(name)
            lines.append(f"  {name}.PagedKVCacheManager: ok")
        except ReplayError:
            lines.append(f"  {name}.PagedKVCacheManager: not available")
    print("\n".join(lines))
    return 0


# --------------------------------------------------------------------------- conformance and bench


def resolve_backend(spec: str) -> str:
    """``module:factory`` of an entry-point name or a ``module:factory`` string.

    Raises
    ------
    UsageError
        An unknown name, a malformed spec, or a module that cannot be found.
    """
    if ":" not in spec:
        eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="kvcache.backends")}
        if spec not in eps:
            known = ", ".join(sorted(eps)) or "none"
            raise UsageError(f"--backend={spec}: no such backend (entry points: {known}; or give module:factory)")
        spec = eps[spec]
    module, _, factory = spec.partition(":")
    if not module or not factory or not all(part.isidentifier() for part in module.split(".") + factory.split(".")):
        raise UsageError(f"--backend={spec}: must be NAME or MODULE:FACTORY")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise UsageError(f"--backend={spec}: no module named {module!r}")
    return spec


def conformance_command(spec: str, pytest_args: Sequence[str] = ()) -> list[str]:
    """The pytest command line that runs the conformance suite against ``spec``."""
    return [sys.executable, "-m", "pytest", "--pyargs", "kvspec.conformance", f"--kv-backend={spec}",
            *pytest_args]


def _cmd_conformance(args) -> int:
    spec = resolve_backend(args.backend)
    return subprocess.call(conformance_command(spec, args.passthrough))


def _cmd_bench(args) -> int:
    try:
        bench = importlib.import_module("kvcache.bench")
    except ModuleNotFoundError as e:
        if e.name != "kvcache.bench":
            raise
        raise CommandUnavailable("kvcache bench: the benchmark module kvcache/bench.py is not part of this build"
                                 ) from None
    # kvcache.bench parses its own options with argparse; keep its errors to one line.
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            code = bench.main(list(args.passthrough))
    except SystemExit as e:
        if e.code in (0, None):  # --help
            sys.stderr.write(captured.getvalue())
            return 0
        lines = [line.split(": error: ", 1)[1] for line in captured.getvalue().splitlines() if ": error: " in line]
        raise UsageError(lines[-1] if lines else f"kvcache bench exited with {e.code}") from None
    sys.stderr.write(captured.getvalue())
    return int(code or 0)

if __name__ == "__main__":  # python -m kvcache.cli
    sys.exit(main())
