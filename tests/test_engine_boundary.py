"""One policy, two engines (issue 12; STYLE §6): kvfast uses only kvref's public names.

kvfast runs kvref's policy (its public ``PagedKVCacheManager`` and ``KVCache``)
on its own engine; it never reads a private module or name of kvref, so the
reference can change its internals freely. The check reads the source: a
``kvref._x`` attribute, a ``from kvref._x import`` / ``import kvref._x``, or a
``from kvref import _x`` anywhere under ``kvfast/`` fails it.
"""

from __future__ import annotations

import ast
import pathlib
import re

import kvref

KVFAST = pathlib.Path(__file__).resolve().parents[1] / "kvfast"


def _violations(source: str, name: str) -> list[str]:
    out = [f"{name}:{m.start()}: {m.group(0)}" for m in re.finditer(r"\bkvref\._\w*", source)]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvref":
            if node.module != "kvref":
                out.append(f"{name}:{node.lineno}: from {node.module} import ...")
            out += [f"{name}:{node.lineno}: from kvref import {a.name}" for a in node.names
                    if a.name.startswith("_")]
        if isinstance(node, ast.Import):
            out += [f"{name}:{node.lineno}: import {a.name}" for a in node.names
                    if a.name.startswith("kvref.")]
    return out


def test_kvfast_uses_no_private_name_of_kvref():
    files = sorted(KVFAST.rglob("*.py"))
    assert files, KVFAST
    bad = [v for f in files for v in _violations(f.read_text(), str(f.relative_to(KVFAST.parent)))]
    assert not bad, "kvfast reaches into kvref's private names:\n" + "\n".join(bad)


def test_every_kvref_name_kvfast_imports_is_public():
    used: set[str] = set()
    for f in KVFAST.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "kvref":
                used |= {a.name for a in node.names}
    assert used <= set(kvref.__all__), sorted(used - set(kvref.__all__))


def test_the_check_can_fail():
    assert _violations("import kvref\nx = kvref._manager\n", "f")
    assert _violations("from kvref._tiers import TieredConnector\n", "f")
    assert _violations("from kvref import _Request\n", "f")
    assert _violations("import kvref._slab\n", "f")
    assert not _violations("import kvref\nx = kvref.PagedKVCacheManager\n", "f")
