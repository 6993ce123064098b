"""The docs site builds in strict mode (a broken link fails), and what the docs say is true."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from kvcache.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
MY_PAGES = ("index.md", "quickstart.md", "replay.md")


def read(*parts) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def mkdocs_build(config: str, site: str) -> subprocess.CompletedProcess:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[test]')")
    pytest.importorskip("material", reason="mkdocs-material is not installed (pip install -e '.[test]')")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config, "-d", site],
        cwd=os.path.dirname(config), capture_output=True, text=True, timeout=300, env=env,
    )


def test_site_builds_in_strict_mode(tmp_path):
    site = tmp_path / "site"
    r = mkdocs_build(os.path.join(ROOT, "mkdocs.yml"), str(site))
    assert r.returncode == 0, r.stdout + r.stderr
    pages = ("index.html", "quickstart/index.html", "replay/index.html", "performance/index.html",
             "spec/index.html", "spec/manager/index.html",  # spec/README.md renders as spec/index.html
             "benchmarks/index.html", "api/kvspec/index.html", "api/kvref/index.html", "api/kvfast/index.html",
             "api/kvcache/index.html")
    for page in pages:
        assert (site / page).is_file(), page
    # the API pages render every public name from its docstring (mkdocstrings, NumPy style)
    sys.path.insert(0, DOCS + "/_hooks")
    try:
        import api_pages
    finally:
        sys.path.pop(0)
    for path, (_, packages, _) in api_pages.PAGES.items():
        html = (site / path.replace(".md", "/index.html")).read_text(encoding="utf-8")
        for package in packages:
            for name in api_pages.public_names(package):
                assert f'id="{api_pages.object_path(package, name)}"' in html, f"{path}: {package}.{name} not rendered"
    api = (site / "api" / "kvspec" / "index.html").read_text(encoding="utf-8")
    assert "Sizes and options of a slot cache" in api  # KVCacheConfig's docstring, rendered
    # nothing the site shows (guide, spec pages, rendered docstrings) cites a document outside the repository
    cites = {str(f.relative_to(site)): _OUTSIDE.findall(f.read_text(encoding="utf-8"))
             for f in site.rglob("*.html") if _OUTSIDE.search(f.read_text(encoding="utf-8"))}
    assert not cites, cites
    history = (site / "benchmarks" / "index.html").read_text(encoding="utf-8")
    assert "Adding a run" in history and "kvcache-ref-2core" in history


def test_a_broken_link_fails_the_build(tmp_path):
    for name in ("mkdocs.yml",):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    shutil.copytree(DOCS, tmp_path / "docs")
    (tmp_path / "spec").mkdir()
    for name in os.listdir(os.path.join(ROOT, "spec")):
        if name.endswith(".md"):
            shutil.copy(os.path.join(ROOT, "spec", name), tmp_path / "spec" / name)
    page = tmp_path / "docs" / "replay.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    r = mkdocs_build(str(tmp_path / "mkdocs.yml"), str(tmp_path / "site"))
    assert r.returncode != 0
    assert "no-such-page.md" in r.stdout + r.stderr


def test_readme_first_commands():
    lines = read("README.md").splitlines()
    start = lines.index("```bash")
    assert lines[start + 1] == "pip install -e . && kvcache replay"
    assert lines[start + 2] == 'pip install -e ".[test]" && python -m pytest -n 2 -q'
    assert "`kvcache/replay.py`" in read("README.md")


def _extra(name: str) -> str:
    return re.search(rf"^{name} = \[(.*?)\]$", read("pyproject.toml"), flags=re.M | re.S).group(1)


def test_pyproject_test_extra_builds_the_docs():
    for extra in ("test", "docs"):
        text = _extra(extra)
        assert "mkdocs" in text and "mkdocs-material" in text and "mkdocstrings[python]" in text, extra


def test_conformance_extra_is_only_pytest_and_hypothesis():
    """A backend author's install: no docs tooling, Redis client or CUDA wheel."""
    names = sorted(re.match(r"[A-Za-z0-9_.-]+", x.strip().strip('"')).group(0)
                   for x in _extra("conformance").split(",") if x.strip())
    assert names == ["hypothesis", "pytest"], names


def _undocumented() -> tuple[int, list[str]]:
    """Public names (``__all__`` of each package, and the public methods and
    properties of its classes) with no docstring. A method counts as documented
    when its docstring is inherited, when the class docstring lists it
    (``name : type``), or when it implements a documented method of a public
    ``Protocol`` (the contract is there). Dataclass fields are data, rendered
    with their type and default; state-machine rules are test steps."""
    import dataclasses
    import enum
    import importlib
    import inspect

    from hypothesis.stateful import RuleBasedStateMachine

    def listed(name, doc):
        return re.search(rf"^\s*(\w+, )*{re.escape(name)}(, \w+)* :", doc, re.M) is not None

    objs = []
    for mod in ("kvspec", "kvspec.hashing", "kvspec.engine", "kvspec.conformance", "kvref", "kvref.ops",
                "kvfast", "kvfast.ops", "kvcache"):
        m = importlib.import_module(mod)
        for n in m.__all__:
            o = getattr(m, n)
            if not inspect.ismodule(o) and (inspect.isclass(o) or callable(o)):
                objs.append((f"{mod}.{n}", o))
    protocols = [o for _, o in objs if inspect.isclass(o) and getattr(o, "_is_protocol", False)]
    missing, seen, total = [], set(), 0
    for qual, o in objs:
        total += 1
        if not inspect.getdoc(o):
            missing.append(qual)
        if not inspect.isclass(o) or id(o) in seen:
            continue
        seen.add(id(o))
        doc = inspect.getdoc(o) or ""
        fields = {f.name for f in dataclasses.fields(o)} if dataclasses.is_dataclass(o) else set()
        impl = [p for p in protocols if p is not o and all(hasattr(o, a) for a in vars(p) if not a.startswith("_"))]
        for a, v in vars(o).items():
            if a.startswith("_") or a in fields or (isinstance(o, enum.EnumMeta) and not callable(v)):
                continue
            if issubclass(o, RuleBasedStateMachine) and a != "for_backend":
                continue
            if isinstance(v, (staticmethod, classmethod)):
                v = v.__func__
            if not (callable(v) or isinstance(v, property)):
                continue
            total += 1
            own = inspect.getdoc(v) if isinstance(v, property) else inspect.getdoc(getattr(o, a))
            if own or listed(a, doc) or any(inspect.getdoc(getattr(p, a)) for p in impl if hasattr(p, a)):
                continue
            missing.append(f"{qual}.{a}")
    return total, missing


def test_every_public_name_has_a_docstring():
    total, missing = _undocumented()
    assert total > 300, total  # the walk really covers the API
    assert not missing, f"{len(missing)} of {total} public names have no docstring: {missing}"


#: Documents a reader of the repository cannot open (the design brief and the
#: background notes live outside it).
_OUTSIDE = re.compile(r"DESIGN(\.md| §)|/work/shared|\.\./shared|shared/peers|shared/reference|reference/[a-z-]+\.md")


def test_docs_cite_nothing_outside_the_repository():
    pages = [os.path.join("docs", p) for p in os.listdir(DOCS) if p.endswith(".md")]
    pages += [os.path.join("spec", p) for p in ("conformance.md", "vectors.md")]
    pages += ["README.md", os.path.join("examples", "vector_replay", "README.md")]
    pages += [os.path.join("spec", "kvspec", "conformance", p) for p in ("plugin.py", "_backend.py", "_compare.py",
                                                                          "_harness.py", "__init__.py")]
    bad = {p: _OUTSIDE.findall(read(p)) for p in pages if _OUTSIDE.search(read(p))}
    assert not bad, bad


def _replay_options() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    replay = sub.choices["replay"]
    return [s for a in replay._actions for s in a.option_strings if s.startswith("--") and s != "--help"]


def test_replay_page_documents_every_option():
    page = read("docs", "replay.md")
    missing = [opt for opt in _replay_options() if f"`{opt}" not in page]
    assert not missing, f"docs/replay.md does not document {missing}"


@pytest.mark.parametrize("page", MY_PAGES)
def test_documented_commands_parse(page):
    parser = build_parser()
    seen = 0
    text = read("docs", page)
    lines = [line for b in code_blocks(text, "bash") for line in b.splitlines()]
    lines += [line[2:] for b in code_blocks(text, "text") for line in b.splitlines() if line.startswith("$ ")]
    for line in (part.strip() for line in lines for part in line.split("&&")):
        if line.startswith("kvcache "):
            argv = shlex.split(line.split(" #")[0])[1:]
            args = parser.parse_args(argv)
            assert args.command in ("replay", "info", "conformance", "bench"), line
            seen += 1
    assert seen > 0


@pytest.mark.parametrize("page", ["quickstart.md", "replay.md", "slot-cache.md", "manager.md"])
def test_python_examples_run(page, capsys):
    blocks = code_blocks(read("docs", page), "python")
    assert blocks
    ns = {"__name__": "__docs__"}  # a page's blocks run in order, as a reader runs them
    for block in blocks:
        exec(compile(block, f"docs/{page}", "exec"), ns)


def _history():
    sys.path.insert(0, os.path.join(DOCS, "_hooks"))
    try:
        import benchmark_history
    finally:
        sys.path.pop(0)
    return benchmark_history


def test_benchmark_history_is_kept_in_the_repository():
    """asv results of the reference machine are committed and every recorded benchmark is on the page."""
    h = _history()
    benchmarks, machines, runs = h.load_history()
    assert "kvcache-ref-2core" in machines and runs, "no asv results under asv_bench/results/"
    page = h.page_markdown()
    for name in {b for r in runs for b in r["results"]}:
        assert f"## `{name}`" in page, name


def test_benchmark_history_adds_a_row_per_commit(tmp_path):
    """Two runs of a parametrized benchmark render as two rows, oldest first, a column per combination."""
    import json

    h = _history()
    (tmp_path / "m1").mkdir()
    (tmp_path / "m1" / "machine.json").write_text(json.dumps({"machine": "m1", "cpu": "test cpu", "version": 1}))
    (tmp_path / "benchmarks.json").write_text(json.dumps(
        {"b.T.time_x": {"unit": "seconds", "param_names": ["package"]}, "version": 2}))
    cols = ["result", "params", "version", "started_at", "duration"]
    for commit, date, values in (("bbbbbbbb22", 2000, [2e-3, None]), ("aaaaaaaa11", 1000, [1.5e-6, 3.0])):
        (tmp_path / "m1" / f"{commit[:8]}-env.json").write_text(json.dumps({
            "commit_hash": commit, "date": date, "result_columns": cols, "version": 2,
            "results": {"b.T.time_x": [values, [["'kvref'", "'kvfast'"]], "v", 0, 0]}}))
    page = h.page_markdown(str(tmp_path))
    assert "| date | commit | machine | kvref | kvfast |" in page
    first, second = page.index("`aaaaaaaa`"), page.index("`bbbbbbbb`")
    assert first < second
    assert "| 1.5 us | 3 s |" in page and "| 2 ms | n/a |" in page
    assert "`m1`: cpu: test cpu" in page
