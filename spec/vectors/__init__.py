"""Golden vectors: deterministic JSON traces recorded from ``kvref``.

The files live in ``spec/vectors/`` in the source tree and install as the
package data of ``kvspec.vectors``, so an installed suite finds them too.
The format is ``spec/vectors.md``; ``spec/tools/gen_vectors.py`` writes them.
"""

from __future__ import annotations

import json
from importlib import resources

__all__ = ["names", "load", "read_bytes"]


def names() -> list[str]:
    """File names of the vectors (``*.json``), sorted."""
    return sorted(p.name for p in resources.files(__name__).iterdir() if p.name.endswith(".json"))


def read_bytes(name: str) -> bytes:
    """The exact bytes of vector file ``name``; ``ValueError`` if there is none."""
    if name not in names():
        raise ValueError(f"kvspec.vectors.read_bytes: name={name!r} not in {names()}")
    return resources.files(__name__).joinpath(name).read_bytes()


def load(name: str) -> dict:
    """Vector file ``name`` parsed as JSON."""
    return json.loads(read_bytes(name).decode("utf-8"))
