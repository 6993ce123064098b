"""Every ``§`` citation in the code names its document, and every citation of a spec page resolves.

Scans the Python and CUDA sources of ``kvref/``, ``kvfast/``, ``spec/kvspec/`` and ``kvcache/``
(issue 12, deliverable 6):

* a citation ``spec/<page>.md §N`` (the file may be in double backticks, the ``§`` on the next
  line of a docstring or comment) names a heading of that page: ``## §N``, ``## N.``,
  ``### §N.M`` or ``### N.M``; ``§N.M`` may also name item ``M.`` of section ``N``'s numbered
  list (the style of spec/manager.md);
* further sections listed after it (``spec/manager.md §4.6 and §4.9``, ``§4 step 6, §9.2``)
  belong to the same page;
* a ``§`` with no document before it (``(§9.2)``, ``Spec §6``) is a failure; the documents
  outside this repository a citation may name instead are the design brief (``DESIGN``,
  ``STYLE``), an issue (``issue 11 §8``), the peers' ``WORKLOAD.md`` and the reference notes
  (``manager-semantics``, ``manager note``); those are not resolved here.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("kvref", "kvfast", "spec/kvspec", "kvcache")
SUFFIXES = (".py", ".cu", ".cuh")

_REF = r"§\d+(?:\.\d+)*"
_JOIN = r"(?:[^\S\n]*(?:\n[^\S\n]*(?:#[^\S\n]*)?)?)"  # spaces, or a line break into a docstring/comment
# a list of sections: "§4", "§4.6 and §4.9", "§4 step 6, §9.2", "§5/§4.2", "§4, §7"
_LIST = rf"{_REF}(?:(?:\s*(?:,|/|and|or)\s*|\s+step\s+\d+,\s*|\s+steps\s+[\d-]+,\s*){_REF})*"
SPEC_CITE = re.compile(rf"spec/(?P<page>[\w-]+)\.md(?:``)?{_JOIN}(?P<refs>{_LIST})")
OTHER_CITE = re.compile(
    rf"(?:DESIGN|STYLE|issue \d+|WORKLOAD\.md|manager-semantics|manager note)(?:``)?{_JOIN}(?P<refs>{_LIST})")
ANY_REF = re.compile(_REF)


def _sources(root: Path) -> list[Path]:
    out = []
    for d in SOURCES:
        for p in sorted((root / d).rglob("*")):
            if p.suffix in SUFFIXES and "__pycache__" not in p.parts:
                out.append(p)
    return out


@lru_cache(maxsize=None)
def _anchors(root: Path, page: str) -> frozenset[str] | None:
    """Every citable ``N`` / ``N.M`` of ``spec/<page>.md`` (None when the page does not exist)."""
    path = root / "spec" / f"{page}.md"
    if not path.exists():
        return None
    out: set[str] = set()
    section = None
    fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        if fence:
            continue
        m = re.match(r"(#{2,4}) §?(\d+(?:\.\d+)*)\.?(?:\s|$)", line)
        if m:
            out.add(m.group(2))
            if len(m.group(1)) == 2:
                section = m.group(2)
            continue
        m = re.match(r"(\d+)\. ", line)  # an item of the section's numbered list (column 0)
        if m and section is not None and "." not in section:
            out.add(f"{section}.{m.group(1)}")
    return frozenset(out)


def _scan(root: Path = ROOT):
    """(citations checked, unresolved, bare) over every source file under ``root``."""
    seen, unresolved, bare = 0, [], []
    for path in _sources(root):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(root)
        covered: set[int] = set()
        for m in SPEC_CITE.finditer(text):
            anchors = _anchors(root, m.group("page"))
            for r in ANY_REF.finditer(m.group("refs")):
                covered.add(m.start("refs") + r.start())
                seen += 1
                where = f"{rel}:{text.count(chr(10), 0, m.start()) + 1}"
                if anchors is None:
                    unresolved.append(f"{where}: spec/{m.group('page')}.md does not exist")
                elif r.group(0)[1:] not in anchors:
                    unresolved.append(f"{where}: spec/{m.group('page')}.md {r.group(0)} names no heading or item")
        for m in OTHER_CITE.finditer(text):
            for r in ANY_REF.finditer(m.group("refs")):
                covered.add(m.start("refs") + r.start())
        for r in ANY_REF.finditer(text):
            if r.start() not in covered:
                line = text.count("\n", 0, r.start()) + 1
                bare.append(f"{rel}:{line}: {text.splitlines()[line - 1].strip()}")
    return seen, unresolved, bare


def test_every_spec_citation_resolves_to_a_heading():
    seen, unresolved, _ = _scan()
    assert seen > 150  # the scan reads the sources
    assert not unresolved, "citations that name no heading of their page:\n" + "\n".join(unresolved)


def test_every_citation_names_its_document():
    _, _, bare = _scan()
    assert not bare, "citations without their document (write spec/<page>.md §N):\n" + "\n".join(bare)


def test_the_scanner_has_teeth(tmp_path):
    """A wrong section, a missing page and a bare ``§`` are all caught."""
    pkg = tmp_path / "kvref"
    pkg.mkdir()
    (pkg / "x.py").write_text(
        '"""Sized as spec/manager.md §4 step 6, §9.2; see ``spec/slot-cache.md``\n    §2.8."""\n'
        "# spec/manager.md §99.1 and spec/nowhere.md §1\n"
        "x = 1  # the drain (§9.2)\n"
        "y = 2  # DESIGN §4.3, issue 11 §8\n", encoding="utf-8")
    spec = tmp_path / "spec"
    spec.mkdir()
    for page in ("manager", "slot-cache"):
        (spec / f"{page}.md").write_text((ROOT / "spec" / f"{page}.md").read_text(encoding="utf-8"),
                                         encoding="utf-8")
    seen, unresolved, bare = _scan(tmp_path)
    assert seen == 5
    assert [u.split(": ", 1)[1] for u in unresolved] == [
        "spec/manager.md §99.1 names no heading or item", "spec/nowhere.md does not exist"]
    assert len(bare) == 1 and "the drain (§9.2)" in bare[0]
