"""``kvcache gpu-check``: the one prepared run for a lent GPU (issue 13).

In one command, under five minutes on one device:

1. every ``gpu``-marked test (``pytest -m gpu tests``) in a subprocess;
2. ``append_kv`` decode and prefill bandwidth, kernel alone and through
   ``kvfast.ops``, as a fraction of a CuPy device-to-device copy of the same
   bytes timed in the same run, and of the HBM peak (``--peak-tbps``, H200
   4.8 TB/s);
3. tier staging (``CudaPageStore.read``: ``stage.cu`` gather + copy into
   pinned memory; ``write``: the reverse) as a fraction of a CuPy
   device-to-host copy of the same bytes into pinned memory (and back);
4. ``prepare_step`` (256 decode rows) and a ``PagedKVCacheManager`` decode
   step (alloc, runtime_inputs, step for a batch) on the device.

Results go to JSON (``--json``) and, with ``--update-docs``, into the GPU
section of ``docs/performance.md`` between ``<!-- gpu-check:begin -->`` and
``<!-- gpu-check:end -->``. Under ``KVFAST_CUDA_EMULATE=1`` it runs end to end
on the CPU (``--tiny`` sizes in CI); the figures are then labelled emulated
and say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["run_check", "update_docs", "main", "BEGIN", "END"]

BEGIN = "<!-- gpu-check:begin -->"
END = "<!-- gpu-check:end -->"

#: Sizes: the real run, and ``--tiny`` (the emulated CI run).
SIZES = {
    "full": dict(heads=8, head_dim=128, block_size=16, decode_rows=256, prefill_tokens=16384, stage_pages=64,
                 layers=4, repeat=7, number=20, manager_batch=64, manager_steps=32, pages=4096),
    "tiny": dict(heads=2, head_dim=16, block_size=4, decode_rows=8, prefill_tokens=64, stage_pages=4,
                 layers=2, repeat=2, number=2, manager_batch=4, manager_steps=3, pages=64),
}


def _median_time(cp, fn, repeat: int, number: int, *, events: bool = True) -> float:
    """Median seconds per call of ``fn`` over ``repeat`` samples of ``number`` calls, after a warm-up;
    device time between CUDA events (``events``) or host time after a device sync."""
    fn()
    cp.cuda.get_current_stream().synchronize()
    samples = []
    for _ in range(repeat):
        if events:
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(number):
                fn()
            end.record()
            end.synchronize()
            samples.append(cp.cuda.get_elapsed_time(start, end) / 1e3 / number)
        else:
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            cp.cuda.get_current_stream().synchronize()
            samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


def _append(cp, sz: dict, *, prefill: bool, peak: float) -> dict:
    import kvfast
    import kvfast.ops
    from kvfast._cuda.append_kv import append_kv as launch
    from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec

    h, d, bs = sz["heads"], sz["head_dim"], sz["block_size"]
    rows, q = (1, sz["prefill_tokens"]) if prefill else (sz["decode_rows"], 1)
    past = 0 if prefill else 3 * bs
    max_len = past + q + bs
    cfg = KVCacheConfig(num_layers=1, max_seqs=rows, max_seq_len=max_len, mode=KVCacheMode.PAGED, block_size=bs,
                        num_blocks=rows * -(-max_len // bs) + 1, dtype="float16", device="cuda")
    cache = kvfast.KVCache.make(cfg, [KVLayerSpec.attention(h, d)])
    slots = np.arange(rows, dtype=np.int32)
    if past:
        cache.reserve(slots, np.full(rows, past))
    step = cache.prepare_step(np.arange(rows + 1, dtype=np.int32) * q, np.full(rows, past, np.int32), slots)
    t = rows * q
    rng = np.random.default_rng(0)
    k = cp.asarray(rng.standard_normal((t, h, d)).astype(np.float16))
    v = cp.asarray(rng.standard_normal((t, h, d)).astype(np.float16))
    K, V = cache.keys(0), cache.values(0)
    sm = cp.asarray(step.slot_mapping, cp.int64)
    src = cp.concatenate([k.reshape(-1), v.reshape(-1)])
    dst = cp.empty_like(src)
    payload = int(src.nbytes)  # bytes written to the cache (and read from k, v)
    r, n = sz["repeat"], sz["number"]

    def kernel():
        launch(k, v, K, V, sm, block_size=bs, block_stride=bs * h * d, row_stride=h * d)

    t_copy = _median_time(cp, lambda: dst.__setitem__(Ellipsis, src), r, n)
    t_kernel = _median_time(cp, kernel, r, n)
    t_ops = _median_time(cp, lambda: kvfast.ops.append_kv(cache, 0, k, v, step), r, n)
    moved = 2 * payload  # read + write
    return {
        "name": f"append_kv {'prefill' if prefill else 'decode'} ({rows} rows x {q} tok, {h}x{d} fp16)",
        "bytes": payload,
        "copy_us": t_copy * 1e6, "kernel_us": t_kernel * 1e6, "ops_us": t_ops * 1e6,
        "kernel_vs_copy": t_copy / t_kernel, "ops_vs_copy": t_copy / t_ops,
        "kernel_vs_peak": moved / t_kernel / peak, "copy_vs_peak": moved / t_copy / peak,
        "kernel_gbps": moved / t_kernel / 1e9,
    }


def _staging(cp, sz: dict) -> dict:
    from kvfast._cuda.page_store import CudaPageStore, pinned_empty

    h, d, bs, layers, n = sz["heads"], sz["head_dim"], sz["block_size"], sz["layers"], sz["stage_pages"]
    num_pages = 4 * n + 1
    buf = cp.asarray(np.random.default_rng(1).integers(0, 2**16, size=(num_pages, 2, layers, bs, h, d),
                                                       dtype=np.uint16))
    store = CudaPageStore(buf)
    ids = np.arange(1, 4 * n + 1, 4)[:n]  # every fourth page: a real gather
    nbytes = n * store.page_nbytes
    dev = cp.empty(nbytes, cp.uint8)
    pinned = pinned_empty((nbytes,))
    data = store.read(ids).copy()
    r, num = sz["repeat"], max(1, sz["number"] // 4)
    t_d2h = _median_time(cp, lambda: dev.get(out=pinned), r, num, events=False)
    t_read = _median_time(cp, lambda: store.read(ids), r, num, events=False)
    t_h2d = _median_time(cp, lambda: dev.set(pinned), r, num, events=False)
    t_write = _median_time(cp, lambda: store.write(ids, data), r, num, events=False)
    return {
        "name": f"tier staging ({n} pages x {store.page_nbytes // 1024} KiB)",
        "bytes": nbytes,
        "d2h_us": t_d2h * 1e6, "read_us": t_read * 1e6, "h2d_us": t_h2d * 1e6, "write_us": t_write * 1e6,
        "read_vs_d2h": t_d2h / t_read, "write_vs_h2d": t_h2d / t_write,
        "read_gbps": nbytes / t_read / 1e9, "d2h_gbps": nbytes / t_d2h / 1e9,
    }


def _prepare(cp, sz: dict) -> dict:
    import kvfast
    from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec

    rows = sz["decode_rows"]
    cfg = KVCacheConfig(num_layers=1, max_seqs=rows, max_seq_len=2048, mode=KVCacheMode.PAGED,
                        block_size=sz["block_size"], device="cuda")
    cache = kvfast.KVCache.make(cfg, [KVLayerSpec.attention(sz["heads"], sz["head_dim"])])
    slots = np.arange(rows, dtype=np.int32)
    cache.reserve(slots, np.full(rows, 100))
    cu = np.arange(rows + 1, dtype=np.int32)
    past = np.full(rows, 100, np.int32)
    t = _median_time(cp, lambda: cache.prepare_step(cu, past, slots), sz["repeat"], sz["number"], events=False)
    return {"name": f"prepare_step decode ({rows} rows, paged, indices on the device)", "us": t * 1e6}


def _manager(cp, sz: dict) -> dict:
    import kvfast
    from kvspec import KVCacheParams, TextContext

    bs, batch, steps = sz["block_size"], sz["manager_batch"], sz["manager_steps"]
    params = KVCacheParams(page_size=bs, num_layers=sz["layers"], kv_heads=sz["heads"], head_dim=sz["head_dim"])
    m = kvfast.PagedKVCacheManager(params, num_blocks=sz["pages"], max_batch_size=batch,
                                   max_seq_len=min(4096, (sz["pages"] - 1) * bs),  # spec/manager.md §1.6
                                   device="cuda")
    rng = np.random.default_rng(2)
    ctxs = [TextContext(f"r{i}", rng.integers(0, 32000, size=3 * bs + 1).tolist()) for i in range(batch)]
    for c in ctxs:
        m.claim(c)
        m.alloc(c)
        c.skip_processing(c.active_length - 1)
        m.step(c)
        c.update(1)
        m.step(c)
    samples = []
    for s in range(steps):
        t0 = time.perf_counter()
        for c in ctxs:
            m.alloc(c)
        m.runtime_inputs([ctxs])
        for c in ctxs:
            c.update(int(s))
            m.step(c)
        cp.cuda.get_current_stream().synchronize()
        samples.append(time.perf_counter() - t0)
    for c in ctxs:
        m.release(c)
    t = statistics.median(samples)
    return {"name": f"manager decode step ({batch} requests: alloc, runtime_inputs, step)", "us": t * 1e6,
            "us_per_request": t * 1e6 / batch}


def _run_tests(pytest_args: Sequence[str], timeout: float, paths: Sequence[str] = ()) -> dict:
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
           *([str(root / p) for p in paths] or [str(root / "tests")]), *pytest_args]
    t0 = time.perf_counter()
    try:
        env = dict(os.environ)
        env.setdefault("HYPOTHESIS_PROFILE", "ci")  # the bounded example counts CI uses
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=root, env=env)
        out, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), 124
    summary = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)",
                                                summary[-1] if summary else "")}
    return {"command": " ".join(cmd), "returncode": rc, "seconds": time.perf_counter() - t0,
            "summary": summary[-1] if summary else out[-2000:], "counts": counts}


def run_check(*, tiny: bool = False, run_tests: bool = True, pytest_args: Sequence[str] = (),
              peak_tbps: float = 4.8, test_timeout: float = 180.0, test_paths: Sequence[str] = ()) -> dict:
    """Run the GPU check; the results as a dict (what ``--json`` writes).

    Parameters
    ----------
    tiny : bool
        The ``tiny`` sizes (the emulated CI run) instead of the real ones.
    run_tests : bool
        Run ``pytest -m gpu`` first.
    pytest_args : sequence of str
        More arguments for that pytest run (e.g. ``-k launchers``).
    peak_tbps : float
        HBM peak in TB/s for the ``*_vs_peak`` fractions (H200: 4.8).
    test_timeout : float
        Seconds the pytest run may take.
    test_paths : sequence of str
        Test files or directories, relative to the repository (default ``tests``).

    Raises
    ------
    RuntimeError
        No CUDA device (neither CuPy with a GPU nor ``KVFAST_CUDA_EMULATE=1``).
    ValueError
        ``peak_tbps <= 0``.
    """
    if not peak_tbps > 0:
        raise ValueError(f"gpu-check: peak_tbps={peak_tbps} <= 0")
    import kvfast  # noqa: F401  (registers the emulated cupy under KVFAST_CUDA_EMULATE=1)
    from kvfast._cuda._module import cupy, emulating

    from .cli import gpu_status

    ok, why = gpu_status()
    if not ok:
        raise RuntimeError(f"gpu-check: no CUDA device: {why} (set KVFAST_CUDA_EMULATE=1 for the CPU stand-in)")
    cp = cupy()
    sz = SIZES["tiny" if tiny else "full"]
    t0 = time.perf_counter()
    out: dict = {
        "device": why, "emulated": emulating(), "sizes": "tiny" if tiny else "full", "peak_tbps": peak_tbps,
        "python": platform.python_version(), "cupy": getattr(cp, "__version__", "?"),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    if run_tests:
        out["tests"] = _run_tests(pytest_args, test_timeout, test_paths)
    peak = peak_tbps * 1e12
    out["append_decode"] = _append(cp, sz, prefill=False, peak=peak)
    out["append_prefill"] = _append(cp, sz, prefill=True, peak=peak)
    out["staging"] = _staging(cp, sz)
    out["prepare_step"] = _prepare(cp, sz)
    out["manager_step"] = _manager(cp, sz)
    out["seconds"] = time.perf_counter() - t0
    return out


def render(res: dict) -> str:
    """The GPU section's Markdown for one result."""
    emu = " **(emulated on the CPU: not GPU figures)**" if res["emulated"] else ""
    lines = [BEGIN, "", f"Run of `kvcache gpu-check` on {res['device']}, {res['started']}, "
             f"{res['seconds']:.0f} s{emu}.", ""]
    if "tests" in res:
        lines += [f"`gpu` tests: {res['tests']['summary']} ({res['tests']['seconds']:.0f} s).", ""]
    lines += ["| measurement | time | fraction |", "| --- | --- | --- |"]
    for key in ("append_decode", "append_prefill"):
        a = res[key]
        lines.append(f"| {a['name']}: kernel | {a['kernel_us']:.1f} us ({a['kernel_gbps']:.0f} GB/s) | "
                     f"{a['kernel_vs_copy']:.2f} of a D2D copy, {a['kernel_vs_peak']:.2f} of HBM peak |")
        lines.append(f"| {a['name']}: `ops.append_kv` | {a['ops_us']:.1f} us | {a['ops_vs_copy']:.2f} of a D2D copy |")
    s = res["staging"]
    lines.append(f"| {s['name']}: read (stage + D2H pinned) | {s['read_us']:.1f} us ({s['read_gbps']:.1f} GB/s) | "
                 f"{s['read_vs_d2h']:.2f} of a D2H copy into pinned memory |")
    lines.append(f"| {s['name']}: write (H2D + scatter) | {s['write_us']:.1f} us | "
                 f"{s['write_vs_h2d']:.2f} of an H2D copy from pinned memory |")
    lines.append(f"| {res['prepare_step']['name']} | {res['prepare_step']['us']:.1f} us | |")
    m = res["manager_step"]
    lines.append(f"| {m['name']} | {m['us']:.0f} us ({m['us_per_request']:.1f} us/request) | |")
    lines += ["", END]
    return "\n".join(lines)


def update_docs(path: Path, res: dict) -> None:
    """Replace the text between ``BEGIN`` and ``END`` in ``path`` with :func:`render`'s.

    Raises
    ------
    ValueError
        ``path`` lacks the markers (nothing is written).
    """
    text = Path(path).read_text()
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"gpu-check: path={str(path)!r} has no '{BEGIN}' ... '{END}' section")
    Path(path).write_text(text[:i] + render(res) + text[j + len(END):])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvcache gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--update-docs", metavar="PATH", nargs="?", const="docs/performance.md",
                   help="write the GPU section of PATH (default docs/performance.md)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (the emulated CI run)")
    p.add_argument("--no-tests", action="store_true", help="skip the pytest -m gpu run")
    p.add_argument("--pytest-args", default="", help="more pytest arguments, one string (e.g. '-k launchers')")
    p.add_argument("--peak-tbps", type=float, default=4.8, help="HBM peak in TB/s (default 4.8, H200)")
    p.add_argument("--test-timeout", type=float, default=180.0, help="seconds for the pytest run (default 180)")
    p.add_argument("--test-paths", nargs="*", default=[], metavar="PATH",
                   help="test files or directories for the pytest run (default: tests)")
    args = p.parse_args(argv)
    try:
        res = run_check(tiny=args.tiny, run_tests=not args.no_tests, pytest_args=args.pytest_args.split(),
                        peak_tbps=args.peak_tbps, test_timeout=args.test_timeout, test_paths=args.test_paths)
    except (RuntimeError, ValueError) as e:
        print(f"kvcache gpu-check: {e}", file=sys.stderr)
        return 2
    text = json.dumps(res, indent=2, sort_keys=True)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if args.update_docs:
        update_docs(Path(args.update_docs), res)
    print(render(res))
    failed = res.get("tests", {}).get("returncode", 0) not in (0, 5)  # 5: no gpu test collected
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
