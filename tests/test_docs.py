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
             "spec/index.html", "spec/manager/index.html")  # spec/README.md renders as spec/index.html
    for page in pages:
        assert (site / page).is_file(), page


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


def test_pyproject_test_extra_builds_the_docs():
    text = read("pyproject.toml")
    test_extra = re.search(r"^test = \[(.*?)\]", text, flags=re.M | re.S).group(1)
    assert "mkdocs" in test_extra and "mkdocs-material" in test_extra


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


@pytest.mark.parametrize("page", ["quickstart.md", "replay.md"])
def test_python_examples_run(page, capsys):
    blocks = code_blocks(read("docs", page), "python")
    assert blocks
    for block in blocks:
        exec(compile(block, f"docs/{page}", "exec"), {"__name__": "__docs__"})
