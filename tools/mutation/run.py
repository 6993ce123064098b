"""Mutation testing of kvfast (and kvref) against the conformance suite alone.

One command (``pip install -e ".[mutation]"`` first)::

    python tools/mutation/run.py --target kvfast --sample 120
    python tools/mutation/run.py --target kvref --sample 60

What it does, in a scratch copy of the repository (the working tree is never
touched, so it is safe next to other work):

1. copies ``kvfast/``, ``kvref/``, ``kvcache/`` and ``spec/`` as committed at
   ``--rev`` (default ``HEAD``; ``--worktree`` takes the working tree instead)
   into ``--workdir`` (default ``/tmp/kvcache-mutation-<target>``); ``--suite``
   takes ``spec/`` (the suite) from another revision or the working tree, so
   one set of mutants can be judged by the suite before and after a change;
2. writes a cosmic-ray config whose test command is ``tools/mutation/kill.py``:
   ``pytest --pyargs kvspec.conformance --kv-quick`` on the backend (kvfast
   for both targets: a kvref mutant changes the oracle, which the suite's
   absolute checks must notice), with ``PYTHONPATH`` on the copy;
3. ``cosmic-ray init`` enumerates every mutant of the target's modules; with
   ``--sample N`` all but a deterministic sample of N (``--seed``) are marked
   skipped, so a run fits in the time there is; mutants inside statements
   marked ``pragma: no cover`` (GPU-only code) are skipped unless
   ``--all-lines``; ``--only-from`` keeps only the mutants an earlier session ran;
4. runs the unmutated suite once (it must pass), then ``cosmic-ray exec``;
5. writes ``report.json`` and ``survivors.md`` (each surviving mutant's diff)
   into the workdir and prints the score.

A mutant is *killed* when the suite fails or times out (``--timeout``).
Whether a survivor is equivalent is a human judgement, recorded in
``docs/mutation.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Modules mutated per target: globs relative to the repository root, resolved
#: against the copied tree (so the job follows code as it moves between files).
#: The CUDA modules (``kvfast/_cuda``) are left out: without a GPU the suite
#: does not run them; neither are the backend factories or the tiers.
TARGETS = {
    "kvfast": ["kvfast/*.py", "kvfast/_numba/*.py"],
    "kvref": ["kvref/_block_pool.py", "kvref/_slot_cache.py", "kvref/_slot_engine.py", "kvref/ops.py",
              "kvref/_manager.py", "kvref/_prefix_hits.py", "kvref/_allocation.py", "kvref/_commit.py",
              "kvref/_transfers.py", "kvref/_runtime_inputs.py", "kvref/_leaves.py"],
}

#: Never mutated: package entry points, the conformance factory, torch/DLPack interop.
_NOT_MUTATED = {"__init__.py", "_backend.py", "interop.py", "_tiers.py"}


def resolve_modules(workdir: Path, patterns: list[str]) -> list[str]:
    """The repository-relative module paths ``patterns`` match in the copy."""
    out: list[str] = []
    for pat in patterns:
        for path in sorted(workdir.glob(pat)):
            rel = path.relative_to(workdir).as_posix()
            if path.name not in _NOT_MUTATED and rel not in out:
                out.append(rel)
    return out


_COPY = ("kvfast", "kvref", "kvcache", "spec", "tools")


def _ignore(_dir, names):
    return [n for n in names if n in ("__pycache__", ".hypothesis") or n.endswith(".pyc")]


def copy_tree(workdir: Path, rev: str | None) -> None:
    """A fresh copy of the importable packages under ``workdir``: the committed
    tree of ``rev`` (``git archive``), or the working tree when ``rev`` is None.
    This tool itself always comes from the working tree."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    if rev is None:
        for name in _COPY:
            shutil.copytree(ROOT / name, workdir / name, ignore=_ignore)
    else:
        tar = subprocess.run(["git", "archive", rev, *_COPY[:-1]], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(workdir)], input=tar, check=True)
        shutil.copytree(ROOT / "tools" / "mutation", workdir / "tools" / "mutation", ignore=_ignore, dirs_exist_ok=True)


#: What ``--suite`` swaps: the conformance package and the strategies it draws from.
_SUITE = ("spec/kvspec/conformance", "spec/kvspec/strategies.py")


def replace_suite(workdir: Path, suite: str) -> None:
    """Put the conformance suite of ``suite`` (a revision, or ``worktree``) into
    the copy, keeping everything else at the mutated packages' revision: the
    same mutants judged by two versions of the suite."""
    for rel in _SUITE:
        target = workdir / rel
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    if suite == "worktree":
        for rel in _SUITE:
            src = ROOT / rel
            if src.is_dir():
                shutil.copytree(src, workdir / rel, ignore=_ignore)
            else:
                shutil.copy2(src, workdir / rel)
    else:
        tar = subprocess.run(["git", "archive", suite, *_SUITE], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(workdir)], input=tar, check=True)


def _key(item) -> tuple:
    m = item.mutations[0]
    return (str(m.module_path), tuple(m.start_pos), m.operator_name, m.occurrence)


def _no_cover_lines(path: Path) -> set[int]:
    """Lines of ``path`` inside a statement whose first line says ``pragma: no cover``
    (the GPU-only branches and kernels: no CPU test can run them)."""
    import ast

    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    out: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.stmt) and "pragma: no cover" in lines[node.lineno - 1]:
            out.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return out


def skip_no_cover(db_path: Path, workdir: Path) -> int:
    """Mark mutants on ``pragma: no cover`` lines as skipped; returns how many."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    cache: dict[str, set[int]] = {}
    n = 0
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        for item in list(db.pending_work_items):
            m = item.mutations[0]
            path = str(m.module_path)
            if path not in cache:
                cache[path] = _no_cover_lines(workdir / path)
            if m.start_pos[0] in cache[path]:
                db.set_result(item.job_id, WorkResult(output="pragma: no cover", worker_outcome=WorkerOutcome.SKIPPED))
                n += 1
    return n


def restrict_to(db_path: Path, other: Path, survivors_only: bool = False) -> int:
    """Skip every pending mutant that did not run in the session ``other`` (a
    before/after comparison over exactly the same mutants). Returns how many remain."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    from cosmic_ray.work_item import TestOutcome

    with use_db(str(other), WorkDB.Mode.open) as db:
        ran = {_key(item) for item, result in db.completed_work_items
               if result.worker_outcome != WorkerOutcome.SKIPPED
               and not (survivors_only and result.test_outcome == TestOutcome.KILLED)}
    left = 0
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        for item in list(db.pending_work_items):
            if _key(item) in ran:
                left += 1
            else:
                db.set_result(item.job_id, WorkResult(output="not in --only-from", worker_outcome=WorkerOutcome.SKIPPED))
    return left
    # kvspec.vectors lives in spec/vectors (package-dir mapping); make it importable from the copy.
    vec = workdir / "spec" / "kvspec" / "vectors"
    if not vec.exists():
        shutil.copytree(ROOT / "spec" / "vectors", vec, ignore=_ignore)


def write_config(workdir: Path, modules: list[str], backend: str, timeout: float, extra: list[str]) -> Path:
    cfg = workdir / "cosmic-ray.toml"
    paths = ", ".join(json.dumps(m) for m in modules)
    cmd = " ".join([sys.executable, "tools/mutation/kill.py", f"--kv-backend={backend}", *extra])
    cfg.write_text(
        "[cosmic-ray]\n"
        f"module-path = [{paths}]\n"
        f"timeout = {timeout}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(cmd)}\n\n"
        "[cosmic-ray.distributor]\n"
        'name = "local"\n',
        encoding="utf-8",
    )
    return cfg


def sample_items(db_path: Path, n: int | None, seed: int) -> int:
    """Mark all but ``n`` work items (a seeded sample, stable across inits) as skipped."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    with use_db(str(db_path), WorkDB.Mode.open) as db:
        items = list(db.pending_work_items)
        if n is None or n >= len(items):
            return len(items)

        items.sort(key=_key)
        keep = {id(x) for x in random.Random(seed).sample(items, n)}
        for item in items:
            if id(item) not in keep:
                db.set_result(item.job_id, WorkResult(output="not sampled", worker_outcome=WorkerOutcome.SKIPPED))
        return len(items)


def summarize(db_path: Path, workdir: Path) -> dict:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    counts = {"killed": 0, "survived": 0, "incompetent": 0, "timeout": 0, "error": 0}
    survivors = []
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                continue
            m = item.mutations[0]
            where = f"{m.module_path}:{m.start_pos[0]} {m.operator_name}#{m.occurrence}"
            if result.worker_outcome != WorkerOutcome.NORMAL:
                counts["error"] += 1
                continue
            if result.test_outcome == TestOutcome.KILLED:
                counts["timeout" if (result.output or "").strip() == "timeout" else "killed"] += 1
            elif result.test_outcome == TestOutcome.INCOMPETENT:
                counts["incompetent"] += 1
            else:
                counts["survived"] += 1
                survivors.append({"where": where, "diff": result.diff})
    run = counts["killed"] + counts["timeout"] + counts["survived"]
    counts["score_pct"] = round(100.0 * (counts["killed"] + counts["timeout"]) / run, 1) if run else None
    counts["survivors"] = sorted(survivors, key=lambda s: s["where"])
    (workdir / "report.json").write_text(json.dumps(counts, indent=1) + "\n", encoding="utf-8")
    lines = [f"# Surviving mutants ({len(survivors)})", ""]
    for s in counts["survivors"]:
        lines += [f"## {s['where']}", "", "```diff", (s["diff"] or "").rstrip(), "```", ""]
    (workdir / "survivors.md").write_text("\n".join(lines), encoding="utf-8")
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=sorted(TARGETS), default="kvfast")
    ap.add_argument("--modules", nargs="*", help="override the target's module list (repository-relative paths)")
    ap.add_argument("--backend", default="kvfast", help="--kv-backend of the kill command (default kvfast)")
    ap.add_argument("--sample", type=int, default=None, help="run a seeded sample of N mutants (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds per mutant; a timeout counts as killed")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--rev", default="HEAD", help="git revision whose committed tree is mutated (default HEAD)")
    ap.add_argument("--worktree", action="store_true", help="mutate the working tree instead of --rev")
    ap.add_argument("--suite", default=None,
                    help="take the suite (spec/) from this revision or 'worktree' (default: with the packages)")
    ap.add_argument("--only-from", type=Path, default=None,
                    help="run only the mutants that ran in this earlier session.sqlite (before/after comparisons)")
    ap.add_argument("--only-survivors", action="store_true",
                    help="with --only-from: only the mutants that survived there (re-judge them with a newer suite)")
    ap.add_argument("--kill-arg", action="append", default=[],
                    help="extra pytest argument of the kill command (repeatable), e.g. --deselect=<node id>")
    ap.add_argument("--all-lines", action="store_true",
                    help="also mutate `pragma: no cover` (GPU-only) code, which the CPU suite cannot run")
    ap.add_argument("--resume", action="store_true", help="continue an interrupted run in --workdir")
    args = ap.parse_args(argv)
    if args.sample is not None and args.sample < 1:
        ap.error(f"--sample={args.sample} must be >= 1")
    modules = args.modules or TARGETS[args.target]
    workdir = (args.workdir or Path(f"/tmp/kvcache-mutation-{args.target}")).resolve()
    db = workdir / "session.sqlite"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(workdir), str(workdir / "spec"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("KVFAST_PARALLEL_SCATTER", None)
    if not args.resume:
        copy_tree(workdir, None if args.worktree else args.rev)
        if args.suite:
            replace_suite(workdir, args.suite)
        modules = resolve_modules(workdir, modules)
        if not modules:
            ap.error(f"no module matches {args.modules or TARGETS[args.target]} in {workdir}")
        cfg = write_config(workdir, modules, args.backend, args.timeout, args.kill_arg)
        subprocess.run(["cosmic-ray", "init", str(cfg), str(db)], cwd=workdir, env=env, check=True)
        total = sample_items(db, args.sample, args.seed)
        running = args.sample if args.sample and args.sample < total else total
        if not args.all_lines:
            gpu = skip_no_cover(db, workdir)
            print(f"mutation: {gpu} mutants on `pragma: no cover` (GPU-only) lines skipped", flush=True)
            running = None
        if args.only_from is not None:
            running = restrict_to(db, args.only_from.resolve(), args.only_survivors)
        if running is None:
            from cosmic_ray.work_db import WorkDB, use_db

            with use_db(str(db), WorkDB.Mode.open) as d:
                running = sum(1 for _ in d.pending_work_items)
        print(f"mutation: {total} mutants of {len(modules)} modules; running {running}", flush=True)
        t0 = time.time()
        base = subprocess.run([sys.executable, "tools/mutation/kill.py", f"--kv-backend={args.backend}", *args.kill_arg],
                              cwd=workdir, env=env, capture_output=True, text=True)
        if base.returncode != 0:
            print(base.stdout[-4000:], base.stderr[-2000:], sep="\n")
            print("mutation: the unmutated suite fails; fix that first", file=sys.stderr)
            return 2
        print(f"mutation: baseline passes in {time.time() - t0:.1f} s", flush=True)
    cfg = workdir / "cosmic-ray.toml"
    t0 = time.time()
    subprocess.run(["cosmic-ray", "exec", str(cfg), str(db)], cwd=workdir, env=env, check=True)
    counts = summarize(db, workdir)
    print(f"mutation: {counts['killed']} killed, {counts['timeout']} timed out, {counts['survived']} survived, "
          f"{counts['incompetent']} incompetent, {counts['error']} errors in {time.time() - t0:.0f} s; "
          f"score {counts['score_pct']} % (before judging equivalence)")
    print(f"mutation: report in {workdir / 'report.json'}, survivors' diffs in {workdir / 'survivors.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
