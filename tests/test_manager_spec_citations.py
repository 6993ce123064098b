"""Every ``spec/manager.md §N`` / ``§N.M`` cited by the manager's code names a heading of
spec/manager.md (``## §N``) and, with ``.M``, an item ``M.`` of that section (issue 12)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ["kvref/_manager.py", "kvref/_prefix_hits.py", "kvref/_allocation.py", "kvref/_commit.py",
         "kvref/_transfers.py", "kvref/_request.py", "kvref/_runtime_inputs.py", "kvref/_leaves.py",
         "kvref/_manager_engine.py", "kvfast/_manager.py", "kvfast/_manager_engine.py",
         "spec/kvspec/engine/_manager.py", "spec/kvspec/engine/_pool.py"]
CITE = re.compile(r"spec/manager\.md §(\d+)(?:\.(\d+))?")


def _sections() -> dict[int, set[int]]:
    """``{N: {item numbers}}`` of spec/manager.md."""
    out: dict[int, set[int]] = {}
    current = None
    for line in (ROOT / "spec" / "manager.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"## §(\d+) ", line)
        if m:
            current = int(m.group(1))
            out[current] = set()
            continue
        m = re.match(r"(\d+)\. ", line)
        if m and current is not None:
            out[current].add(int(m.group(1)))
    return out


def test_every_manager_citation_resolves():
    sections = _sections()
    assert 12 in sections and 5 in sections[9]  # the parser reads the page
    bad, seen = [], 0
    for f in FILES:
        text = (ROOT / f).read_text(encoding="utf-8")
        assert not re.search(r"(?<![\w/.])[Ss]pec §", text), f"{f}: a citation without its file"
        for m in CITE.finditer(text):
            seen += 1
            n, item = int(m.group(1)), m.group(2)
            if n not in sections or (item is not None and int(item) not in sections[n]):
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{f}:{line}: {m.group(0)}")
    assert seen > 50
    assert not bad, "citations that name no heading or item of spec/manager.md:\n" + "\n".join(bad)
