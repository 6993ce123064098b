"""Instructions per request of the manager's bookkeeping, per phase, counted by callgrind.

``kvcache bench``'s configuration rows time ``kvcache.bench.scheduler_loop`` with
``time.thread_time``; on a shared machine the same tree varies by 30 % or more
between runs. This script runs the same loop under valgrind's callgrind and
counts the instructions the calling thread executes inside each timed span:
the count is the same on every run (``PYTHONHASHSEED=0``, gc off), so a 2 %
change is visible, and the ratio of a configuration to the one-full-leaf row
is free of machine noise. Instructions are not time (cache misses, branch
mispredictions and a tier's worker threads are not in them): read the counts
next to ``kvcache bench``, not instead of it.

Needs ``valgrind`` and a C compiler (``cc``) for the client-request helper it
builds in a temporary folder::

    python benchmarks/instructions.py                      # every configuration, kvfast
    python benchmarks/instructions.py --configs "one full leaf" "host tier" --packages kvfast,kvref
    python benchmarks/instructions.py --requests 64 -j 2 --json out.json

Each (package, configuration, phase) is one valgrind run: the loop first runs 16
requests uncounted (kernels loaded, first calls made), then ``--requests`` more
with counting switched on only inside that phase's spans.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The spans of ``scheduler_loop`` (its ``clock`` argument names them).
PHASES = ("admit", "grow", "inputs", "step", "release")

_HELPER = r"""
#include <valgrind/callgrind.h>
void kv_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void kv_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void kv_stop(void) { CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION; }
"""


def build_helper(folder: str) -> str:
    """Compile the callgrind client-request helper into ``folder``; the shared library's path."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or shutil.which("valgrind") is None:
        raise SystemExit("instructions.py: needs valgrind and a C compiler (cc) on PATH")
    src, lib = os.path.join(folder, "kv_callgrind.c"), os.path.join(folder, "kv_callgrind.so")
    with open(src, "w") as f:
        f.write(_HELPER)
    done = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", lib, src], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"instructions.py: cannot build the callgrind helper (valgrind headers?):\n{done.stderr}")
    return lib


def child(package: str, config: str, phase: str, requests: int, helper: str) -> None:
    """Run inside valgrind: the warm-up loop uncounted, then the counted one."""
    import ctypes
    import gc
    import importlib

    from kvcache.bench import config_workload, scheduler_loop

    cls = importlib.import_module(package).PagedKVCacheManager
    prompts, gen = config_workload(16 + requests)
    scheduler_loop(cls, config, prompts[:16], gen[:16])
    gc.disable()  # the loop freezes what exists; no collection runs inside a counted span
    lib = ctypes.CDLL(helper)

    def clock(name: str) -> float:
        if name == phase or phase == "all":
            lib.kv_toggle()
        return 0.0

    lib.kv_start()
    scheduler_loop(cls, config, prompts[16:], gen[16:], clock=clock)
    lib.kv_stop()


def count(package: str, config: str, phase: str, requests: int, helper: str) -> int:
    """Instructions the main thread executed in ``phase`` spans of ``requests`` requests."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
           "--callgrind-out-file=/dev/null", sys.executable, __file__, "--child", package, config, phase,
           str(requests), helper]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    got = re.search(r"Collected\s*:\s*(\d+)", done.stderr)
    if done.returncode or got is None:
        raise RuntimeError(f"{package} {config!r} {phase}: valgrind failed\n{done.stderr[-3000:]}")
    return int(got.group(1))


def main(argv=None) -> int:
    from kvcache.bench import MANAGER_CONFIGS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(MANAGER_CONFIGS),
                    help="rows of kvcache.bench.MANAGER_CONFIGS, each quoted (the first is the reference)")
    ap.add_argument("--packages", default="kvfast", help="comma-separated: kvfast, kvref")
    ap.add_argument("--requests", type=int, default=32, help="counted requests (after 16 uncounted)")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", help="write the counts here")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        package, config, phase, requests, helper = args.child
        child(package, config, phase, int(requests), helper)
        return 0
    configs = args.configs
    unknown = [c for c in configs if c not in MANAGER_CONFIGS]
    if unknown:
        raise SystemExit(f"instructions.py: unknown configurations {unknown}; known: {list(MANAGER_CONFIGS)}")
    packages = [p.strip() for p in args.packages.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        helper = build_helper(folder)
        jobs = [(p, c, ph) for p in packages for c in configs for ph in PHASES]
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = {job: pool.submit(count, *job, args.requests, helper) for job in jobs}
            per = {job: f.result() / args.requests for job, f in futures.items()}
    rows = {}
    print(f"instructions per request ({args.requests} requests, main thread, callgrind)")
    print(f"{'package':8s} {'configuration':28s}" + "".join(f"{p:>10s}" for p in PHASES)
          + f"{'total':>11s}  vs {configs[0]}")
    for p in packages:
        ref = sum(per[p, configs[0], ph] for ph in PHASES)
        for c in configs:
            phases = {ph: per[p, c, ph] for ph in PHASES}
            total = sum(phases.values())
            rows.setdefault(p, {})[c] = {"phases": phases, "total": total, "vs_first": total / ref}
            print(f"{p:8s} {c:28s}" + "".join(f"{v / 1e3:9.1f}k" for v in phases.values())
                  + f"{total / 1e3:10.1f}k  {total / ref:5.2f}x")
    if len(packages) > 1:
        for c in configs:
            ratio = rows[packages[1]][c]["total"] / rows[packages[0]][c]["total"]
            print(f"{packages[1]} / {packages[0]} {c:28s} {ratio:5.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"requests": args.requests, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
