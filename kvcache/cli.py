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
    from fractions import Fraction

    if len(m.group(1)) > 40:
        raise ValueError(f"{text[:40]!r}... has more than 40 digits")
    value = Fraction(m.group(1)) * _UNITS[(m.group(2) or "").lower()]  # exact, no float rounding
    if value.denominator != 1:
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


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
                                   "multi-turn chat. Bookkeeping only by default (no K/V bytes allocated), so "
                                   "any pool and tier size can be planned. A size option given as a comma list "
                                   "(--device-bytes 20GiB,40GiB) sweeps it: one replay per value, in parallel.")
    r.set_defaults(func=_cmd_replay)
    w = r.add_argument_group("workload")
    w.add_argument("--trace", metavar="FILE", help="Mooncake JSONL trace (default: the built-in chat workload)")
    w.add_argument("--num-requests", type=int, metavar="N",
                   help="requests to replay (default: 300 built-in, all of a trace)")
    w.add_argument("--seed", type=int, default=0, help="seed of the workload and token mapping (default 0)")
    m = r.add_argument_group("model")
    m.add_argument("--model", metavar="NAME", help="a model preset (geometry, leaves, model id); see --list-models")
    m.add_argument("--list-models", action="store_true", help="list the model presets and exit")
    m.add_argument("--dtype", choices=("float16", "bfloat16", "float32"),
                   help="K/V dtype (default: the model's, float16 without --model)")
    m.add_argument("--num-layers", type=int, default=2, help="model layers without --model (default 2)")
    m.add_argument("--kv-heads", type=int, default=2, help="K/V heads without --model (default 2)")
    m.add_argument("--head-dim", type=int, default=16, help="head size without --model (default 16)")
    c = r.add_argument_group("cache (SIZE options take a comma list to sweep)")
    c.add_argument("--page-size", default="16", metavar="SIZE", help="tokens per page (default 16)")
    c.add_argument("--num-blocks", metavar="SIZE",
                   help="device blocks per replica incl. the null block (default 2048)")
    c.add_argument("--device-bytes", metavar="SIZE",
                   help="device pool per replica (e.g. 120GiB), instead of --num-blocks")
    c.add_argument("--host-bytes", metavar="SIZE", default="0", help="host tier size (default 0: none)")
    c.add_argument("--disk-bytes", metavar="SIZE", default="0", help="disk tier size (default 0: none)")
    c.add_argument("--disk-dir", metavar="DIR", help="disk tier directory (default: a temporary one)")
    c.add_argument("--remote", metavar="URL",
                   help="shared Redis tier under host and disk: redis://[:PASSWORD@]host:port/db or "
                        "redis+cluster://host:port (IPv6 hosts in brackets)")
    c.add_argument("--replicas", default="1", metavar="SIZE", help="data-parallel replicas (default 1)")
    c.add_argument("--real-bytes", action="store_true",
                   help="allocate the K/V buffers and tier storage (default: bookkeeping only)")
    c.add_argument("--build-inputs", action="store_true",
                   help="call runtime_inputs before every forward even without a tier (it then changes nothing; "
                        "default: only when a tier needs it to post offloads)")
    c.add_argument("--backend", choices=("kvfast", "kvref"),
                   help="manager implementation (default kvfast when it has a PagedKVCacheManager, else kvref)")
    c.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    s = r.add_argument_group("scheduler")
    s.add_argument("--max-batch-size", default="32", metavar="SIZE",
                   help="requests per replica per step (default 32)")
    s.add_argument("--max-batch-tokens", default="2048", metavar="SIZE", help="tokens per step (default 2048)")
    s.add_argument("--max-inflight", metavar="SIZE",
                   help="requests in flight at once (default batch size x replicas)")
    s.add_argument("--draft-tokens", type=int, default=0, metavar="K",
                   help="speculative decoding: each decode forward verifies K drafts (K + 1 tokens of the batch "
                        "budget, as vLLM counts them) and accepts some (--draft-acceptance) plus one token; only "
                        "verified tokens are cached. Faster decodes change when pages are freed and requests "
                        "admitted, so under pool pressure or concurrency the hit rate may differ from plain "
                        "decoding's (docs/replay.md) (default 0: off)")
    s.add_argument("--draft-acceptance", choices=("random", "none", "all"), default="random",
                   help="drafts accepted per forward: random (0..K, seeded by --seed), none (the plain run's "
                        "schedule with the speculative bookkeeping: a diagnostic) or all (default random)")
    s.add_argument("--retention", action="store_true",
                   help="replay twice, without and with retention claims (the trace's retention_priority / "
                        "retention_seconds, else priority 80 for requests that share their first 512 tokens "
                        "with another request), and show both hit rates")
    x = r.add_argument_group("sweeps")
    x.add_argument("--workers", type=int, metavar="N",
                   help="worker processes of a sweep (default: one per value, at most the CPU count)")
    x.add_argument("--cluster", metavar="ADDRESS",
                   help="run the sweep on a Dask cluster: a scheduler address (tcp://host:8786), or 'local' "
                        "for a LocalCluster on this machine (pip install \"kvcache[cluster]\")")
    o = r.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write figures (and the per-step series) as JSON; - for stdout")
    o.add_argument("--plot", metavar="FILE.png",
                   help="plot the run (occupancy, hit rate, lost hits, tier traffic) or the sweep's hit-rate "
                        "curve (needs matplotlib); - for stdout")
    o.add_argument("--no-progress", action="store_true", help="no progress bar or status lines")

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

    # kvcache.gpu_check parses its own options (kvcache gpu-check --help lists them).
    g = sub.add_parser("gpu-check", help="the prepared GPU run: gpu tests, append/staging bandwidth, step times",
                       add_help=False)
    g.set_defaults(func=_cmd_gpu_check)
    return p


#: Commands whose unknown arguments pass through (to pytest, to kvcache.bench).
_PASSTHROUGH = ("conformance", "bench", "gpu-check")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvcache`` command; returns the exit code (the console script exits with it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    show_traceback = "--traceback" in argv
    _SECRETS.clear()
    for i, arg in enumerate(argv):  # issue 11 §8: a --remote password is never printed
        if isinstance(arg, str) and arg.startswith("--remote="):
            _remember_secret(arg.partition("=")[2])
        elif arg == "--remote" and i + 1 < len(argv):
            _remember_secret(argv[i + 1])
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
        code, text = _classify(e)
        if show_traceback:
            import traceback

            sys.stderr.write(scrub(traceback.format_exc()))
        print(f"kvcache: error: {scrub(text)}", file=sys.stderr)
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
    if isinstance(e, MemoryError):
        return EXIT_FAILURE, f"out of memory ({msg}); plan bookkeeping-only (without --real-bytes) or smaller sizes"
    if isinstance(e, OSError):
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        return EXIT_FAILURE, f"{where}{e.strerror or msg}"
    return EXIT_INTERNAL, f"internal error: {type(e).__name__}: {msg} (rerun with --traceback for details)"


# --------------------------------------------------------------------------- replay


#: The size options: (argparse dest, lowest value, is a byte count). Each takes a comma list (a sweep).
_SIZE_OPTIONS = (("page_size", 1, False), ("num_blocks", 2, False), ("device_bytes", 1, True),
                 ("host_bytes", 0, True), ("disk_bytes", 0, True), ("replicas", 1, False),
                 ("max_batch_size", 1, False), ("max_batch_tokens", 1, False), ("max_inflight", 1, False))

#: Upper bounds of the plain integer options (issue 11 §13).
_MAX_SEED = 2**63 - 1
_MAX_REQUESTS = 2**31 - 1
_MAX_BUILTIN_REQUESTS = 200_000


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _size_values(args, name: str, low: int, is_bytes: bool) -> list[int] | None:
    """The values of a size option (one, or a comma list), each checked against ``low``."""
    text = getattr(args, name)
    if text is None:
        return None
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) > 64:
        raise UsageError(f"{_flag(name)}={_cut(text)}: {len(parts)} values, must be <= 64")
    out = []
    for part in parts:
        if is_bytes:
            try:
                v = parse_bytes(part)
            except ValueError as e:
                raise UsageError(f"{_flag(name)}={_cut(text)}: {e}") from None
        else:
            if not re.fullmatch(r"[+-]?\d{1,30}", part):
                raise UsageError(f"argument {_flag(name)}: invalid int value: {_cut(part)!r}")
            v = int(part)
        if v < low:
            raise UsageError(f"{_flag(name)}={part}, must be {'> 0' if is_bytes and low == 1 else f'>= {low}'}")
        out.append(v)
        _RAW[(name, v)] = part
    if len(set(out)) != len(out):
        raise UsageError(f"{_flag(name)}={_cut(text)}: a value is repeated")
    return out


#: (option, value) -> the text the user gave for it (error messages quote it)
_RAW: dict = {}


def _cut(text, n: int = 60) -> str:
    text = str(text)
    return text if len(text) <= n else text[: n - 3] + "..."


_CONFIG_FIELD = re.compile(r"\bReplayConfig: ")
_FIELD_FLAG = {"num_layers": "--num-layers", "kv_heads": "--kv-heads", "head_dim": "--head-dim",
               "allocate_buffers": "--real-bytes", "model": "--model", "dtype": "--dtype", "remote_url": "--remote",
               **{name: _flag(name) for name, _, _ in _SIZE_OPTIONS}}


def _config_error(e: ValueError) -> UsageError:
    """A ``ReplayConfig`` refusal with its field names spelled as the flags."""
    text = _CONFIG_FIELD.sub("", str(e))
    text = re.sub(r"\b(" + "|".join(_FIELD_FLAG) + r")=", lambda m: _FIELD_FLAG[m.group(1)] + "=", text)
    from .replay import SIZE_FIELDS

    text = text.replace(SIZE_FIELDS, "--num-blocks or --device-bytes")
    return UsageError(text.replace("allocate_buffers=True", "--real-bytes"))


# --------------------------------------------------------------------------- redaction and outputs

_SECRETS: list[str] = []


def redact_url(url: str) -> str:
    """``url`` with the password (and user name) of its authority replaced by ``***``."""
    m = re.match(r"^([a-z+]+://)([^@/]*)@(.*)$", url or "", re.IGNORECASE | re.DOTALL)
    return f"{m.group(1)}***@{m.group(3)}" if m else url


def _remember_secret(url: str | None) -> None:
    m = re.match(r"^[a-z+]+://([^@/]*)@", url or "", re.IGNORECASE)
    if m and m.group(1):
        from urllib.parse import unquote

        userinfo = m.group(1)
        for piece in {userinfo, userinfo.partition(":")[2], unquote(userinfo.partition(":")[2])}:
            if len(piece) >= 1 and piece not in _SECRETS:
                _SECRETS.append(piece)
        _SECRETS.sort(key=len, reverse=True)


def scrub(text: str) -> str:
    """``text`` with every remembered secret (a ``--remote`` password) replaced by ``***``."""
    for secret in _SECRETS:
        if len(secret) >= 4:
            text = text.replace(secret, "***")
        elif secret:  # a very short password: only where it sits in a URL, not every letter of the message
            text = text.replace(f":{secret}@", ":***@").replace(f"password={secret!r}", "password='***'")
    return text


def _check_remote(url: str) -> None:
    """``redis://[user:password@]host[:port][/db]`` or ``redis+cluster://...`` with an IPv4, name or
    ``[IPv6]`` host; ``UsageError`` naming the (redacted) URL otherwise."""
    from urllib.parse import urlsplit

    shown = redact_url(url)
    form = "must be redis://[:PASSWORD@]host:port/db or redis+cluster://host:port"
    try:
        u = urlsplit(url)
        port = u.port
        host = u.hostname
    except ValueError as e:
        raise UsageError(f"--remote={shown}, {form} ({scrub(str(e))})") from None
    if u.scheme not in ("redis", "redis+cluster") or not host or u.query or u.fragment:
        raise UsageError(f"--remote={shown}, {form}")
    if "[" in u.netloc:
        import ipaddress

        try:
            ipaddress.IPv6Address(host.split("%")[0])
        except ValueError:
            raise UsageError(f"--remote={shown}: [{host}] is not an IPv6 address") from None
    elif not re.fullmatch(r"[A-Za-z0-9._-]+", host):
        raise UsageError(f"--remote={shown}, {form}")
    if port is not None and not 1 <= port <= 65535:
        raise UsageError(f"--remote={shown}: port {port}, must be in [1, 65535]")
    path = u.path
    if path not in ("", "/") and (u.scheme == "redis+cluster" or not re.fullmatch(r"/\d{1,5}", path)):
        raise UsageError(f"--remote={shown}, {form}")


def _output_target(flag: str, path: str | None) -> None:
    """Refuse an output path that cannot be written without replacing something that is not a file."""
    if path is None or path == "-":
        return
    import stat

    real = os.path.realpath(path)  # a symlink is written through, to its target
    parent = os.path.dirname(real)
    if os.path.isdir(real):
        raise UsageError(f"{flag}={path}: is a directory")
    if not os.path.isdir(parent):
        raise UsageError(f"{flag}={path}: directory {parent} does not exist")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return
    except OSError as e:
        raise UsageError(f"{flag}={path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device node"
                if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a socket"
                if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise UsageError(f"{flag}={path}: is {kind}; refusing to replace it (give a regular file or -)")


# --------------------------------------------------------------------------- replay


def _cmd_replay(args) -> int:
    from . import report
    from .models import model_table
    from .replay import ReplayConfig, fit_hint, replay, required_blocks
    from .workload import read_mooncake_trace, synthetic_workload

    if args.list_models:
        print(model_table())
        return 0
    for name, low, high in (("num_requests", 1, _MAX_REQUESTS), ("seed", 0, _MAX_SEED), ("num_layers", 1, 2**16),
                            ("kv_heads", 1, 2**16), ("head_dim", 1, 2**16), ("workers", 1, 1024),
                            ("draft_tokens", 0, 64)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise UsageError(f"{_flag(name)}={value}, must be >= {low}")
        if value is not None and value > high:
            raise UsageError(f"{_flag(name)}={value}, must be <= {high}")
    if args.trace is None and (args.num_requests or 0) > _MAX_BUILTIN_REQUESTS:
        raise UsageError(f"--num-requests={args.num_requests}, must be <= {_MAX_BUILTIN_REQUESTS} for the "
                         f"built-in workload")
    values = {name: _size_values(args, name, low, is_bytes) for name, low, is_bytes in _SIZE_OPTIONS}
    swept = [name for name, v in values.items() if v is not None and len(v) > 1]
    if len(swept) > 1:
        raise UsageError(f"{_flag(swept[0])} and {_flag(swept[1])} are both lists; sweep one option at a time")
    if args.num_blocks is not None and args.device_bytes is not None:
        raise UsageError(f"--num-blocks={args.num_blocks} and --device-bytes={args.device_bytes} are exclusive")
    disk_any = any(values["disk_bytes"])
    if args.disk_dir is not None and not disk_any:
        raise UsageError(f"--disk-dir={args.disk_dir} needs --disk-bytes > 0")
    if args.disk_dir is not None and os.path.exists(args.disk_dir) and not os.path.isdir(args.disk_dir):
        raise UsageError(f"--disk-dir={args.disk_dir}: exists and is not a directory")
    if args.remote is not None:
        _check_remote(args.remote)
    if not re.fullmatch(r"cpu|cuda(:\d{1,4})?", args.device):
        raise UsageError(f"--device={_cut(args.device)}, must be cpu, cuda or cuda:N")
    if args.draft_acceptance != "random" and not args.draft_tokens:
        raise UsageError(f"--draft-acceptance={args.draft_acceptance} needs --draft-tokens > 0")
    if args.retention and swept:
        raise UsageError(f"--retention and the sweep of {_flag(swept[0])} exclude each other; replay one size")
    if args.cluster is not None and not swept:
        raise UsageError(f"--cluster={args.cluster} needs a sweep (a size option given as a comma list)")
    if args.json == "-" and args.plot == "-":
        raise UsageError("--json - and --plot - both write to stdout; give one of them a file")
    _output_target("--json", args.json)
    _output_target("--plot", args.plot)
    if args.plot is not None:
        report.check_plot_available()

    def config_for(override: dict) -> ReplayConfig:
        one = {name: (v[0] if v is not None else None) for name, v in values.items()}
        one.update(override)
        try:
            return ReplayConfig(
                page_size=one["page_size"], num_blocks=one["num_blocks"], device_bytes=one["device_bytes"],
                host_bytes=one["host_bytes"], disk_bytes=one["disk_bytes"], disk_dir=args.disk_dir,
                remote_url=args.remote, replicas=one["replicas"], backend=args.backend or "auto",
                device=args.device, max_batch_size=one["max_batch_size"],
                max_batch_tokens=one["max_batch_tokens"], max_inflight=one["max_inflight"],
                num_layers=args.num_layers, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                model=args.model, allocate_buffers=args.real_bytes, build_inputs=args.build_inputs,
                draft_tokens=args.draft_tokens, draft_seed=args.seed, draft_acceptance=args.draft_acceptance,
            )
        except (ValueError, TypeError) as e:
            raise _config_error(e) from None

    sweep_name = swept[0] if swept else None
    configs = [config_for({sweep_name: v}) for v in values[sweep_name]] if sweep_name else [config_for({})]

    progress = not args.no_progress and sys.stderr.isatty()
    status = _status if progress else None
    if status:
        status(f"reading {'trace ' + args.trace if args.trace else 'the built-in chat workload'}")
    if args.trace is not None:
        requests = read_mooncake_trace(args.trace, num_requests=args.num_requests, seed=args.seed)
        label = f"trace {os.path.basename(args.trace)}"
    else:
        requests = synthetic_workload(args.num_requests or 300, seed=args.seed)
        label = "built-in chat"
    label += f" ({len(requests)} requests, seed {args.seed})"
    if args.model:
        label += f", model {configs[0].preset().name}"
    for config in configs:
        need, longest = required_blocks(requests, config.page_size)
        nblocks = config.blocks_per_replica()
        if need > nblocks - 1:
            flag = "--num-blocks" if config.num_blocks is not None or config.device_bytes is None else "--device-bytes"
            value = nblocks if flag == "--num-blocks" else _RAW.get(("device_bytes", config.device_bytes),
                                                                    config.device_bytes)
            raise UsageError(
                f"{flag}={value} holds {nblocks - 1} usable blocks of {config.page_size} tokens per replica, "
                f"but request {longest.request_id} needs {need} "
                f"({longest.prompt_length} prompt + {longest.output_length} output tokens); "
                f"{fit_hint(config, longest.total_length)} would fit"
            )
    out = sys.stderr if "-" in (args.json, args.plot) else sys.stdout
    if sweep_name:
        from .sweep import sweep

        runs = sweep(requests, configs, name=sweep_name, workload=label, workers=args.workers, cluster=args.cluster,
                     progress=progress)
        print(report.format_sweep(runs, sweep_name), file=out)
        interrupted = len(runs) < len(configs)
    else:
        lru = None
        if args.retention:  # spec/manager.md §14: the same workload without claims first (plain LRU)
            from .workload import with_retention, without_retention

            if status:
                status("replaying without retention (plain LRU)")
            lru = replay(without_retention(requests), configs[0], workload=label, status=status)
            requests = with_retention(requests)
        bar = _progress_bar(len(requests)) if progress else None
        try:
            stats = replay(requests, configs[0], workload=label, progress=bar, status=status)
        finally:
            if bar is not None:
                bar.close()
        runs = [stats]
        print(report.format_table(stats), file=out)
        if lru is not None:
            claimed = sum(1 for r in requests if r.retention)
            print(f"  {'retention':<24}prefix hit rate {100 * lru.hit_rate:.2f} % plain LRU -> "
                  f"{100 * stats.hit_rate:.2f} % with retention ({claimed:,} of {len(requests):,} requests "
                  f"claimed)", file=out)
        interrupted = stats.interrupted
    doc_config = _config_dict(args, configs[0])
    if args.json is not None and runs:
        report.write_json(runs, args.json, config=doc_config, sweep=sweep_name)
        if args.json != "-":
            print(f"  json                    {args.json}", file=out)
    if args.plot is not None and runs:
        if sweep_name:
            report.write_sweep_plot(runs, sweep_name, args.plot)
        else:
            report.write_plot(runs[0], args.plot)
        if args.plot != "-":
            print(f"  plot                    {args.plot}", file=out)
    if interrupted:
        print("kvcache: interrupted; the summary covers the work done so far", file=sys.stderr)
        return 130
    return 0


def _config_dict(args, config) -> dict:
    d = {k: v for k, v in vars(args).items()
         if k not in ("func", "traceback", "command", "passthrough", "list_models")}
    if d.get("remote") is not None:
        d["remote"] = redact_url(d["remote"])  # issue 11 §8: never copy a password into an output
    d["num_blocks"] = config.blocks_per_replica()
    d["allocate_buffers"] = config.allocate_buffers
    d["model_id"] = config.params().model_id
    return d


def _status(text: str) -> None:
    """A status line on stderr (the first one as soon as work starts)."""
    sys.stderr.write(f"kvcache: {text} ...\n")
    sys.stderr.flush()


def _progress_bar(total: int):
    """A tqdm bar over requests (rate and ETA), fed by the replay's progress callback."""
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency; a broken install still gets the plain bar
        return _Progress()

    class _Bar:
        def __init__(self):
            self.bar = tqdm(total=total, unit="req", desc="replay", file=sys.stderr, smoothing=0.05,
                            mininterval=0.2, dynamic_ncols=True)
            self.done = 0
            self.last = 0.0

        def __call__(self, done: int, total: int, step: int) -> None:
            now = time.monotonic()
            if now - self.last < 0.2 and done < total:
                return
            self.last = now
            self.bar.set_postfix_str(f"step {step:,}", refresh=False)
            self.bar.update(done - self.done)
            self.done = done

        def close(self) -> None:
            self.bar.close()

    return _Bar()


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


def _cmd_gpu_check(args) -> int:
    from .gpu_check import main as gpu_check

    return gpu_check(args.passthrough)


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
