"""mkdocs hook: the API reference, one page per package, generated from ``__all__``.

Each page lists every public name of the package (its ``__all__``) as a
mkdocstrings ``::: package.Name`` block, so a name added to ``__all__``
appears without editing the docs, and ``mkdocs build --strict`` fails on a
docstring mkdocstrings cannot render. ``kvref`` and ``kvfast`` re-export
``kvspec``'s shared types; their pages list only what they add and link to
the kvspec page for the rest.
"""

from __future__ import annotations

import importlib

from mkdocs.structure.files import File

#: page -> (title, packages whose __all__ it documents, intro)
PAGES = {
    "api/kvspec.md": ("kvspec: the contract", ["kvspec", "kvspec.hashing", "kvspec.engine", "kvspec.conformance"],
                      "Shared types, errors, the block hash chain, the engine protocol and the conformance "
                      "suite's public pieces. `kvref` and `kvfast` re-export the shared names "
                      "(`kvref.KVCacheConfig is kvspec.KVCacheConfig`)."),
    "api/kvref.md": ("kvref: the reference implementation", ["kvref", "kvref.ops"],
                     "Pure NumPy and the standard library: the executable definition of every behaviour. "
                     "The shared types are on the [kvspec](kvspec.md) page."),
    "api/kvfast.md": ("kvfast: the fast path", ["kvfast", "kvfast.ops"],
                      "The same classes and results as kvref, faster (Numba on the CPU, CuPy RawKernels on a "
                      "GPU). The shared types are on the [kvspec](kvspec.md) page."),
    "api/kvcache.md": ("kvcache: the library behind the command", ["kvcache"],
                       "The replay job, workloads and the infinite-cache ceiling behind `kvcache replay`."),
}


def public_names(package: str) -> list[str]:
    """``__all__`` of ``package`` without submodules and, outside kvspec, without kvspec's re-exports."""
    mod = importlib.import_module(package)
    names = list(getattr(mod, "__all__", []))
    shared = set(importlib.import_module("kvspec").__all__) if not package.startswith("kvspec") else set()
    out = []
    for n in names:
        obj = getattr(mod, n, None)
        if n in shared or type(obj).__name__ == "module":
            continue
        out.append(n)
    return out


def object_path(package: str, name: str) -> str:
    """The path mkdocstrings collects ``package.name`` under: the package's own
    name, or the defining module for names the package loads lazily
    (``_LAZY``: static analysis cannot follow a module ``__getattr__``)."""
    mod = importlib.import_module(package)
    lazy = getattr(mod, "_LAZY", {})
    if name in lazy and isinstance(lazy[name], str) and lazy[name].startswith("."):
        return f"{package}{lazy[name]}.{name}"
    obj = getattr(mod, name)
    home = getattr(obj, "__module__", None) or package
    if home.split(".")[0] != package.split(".")[0]:  # forwarded from another package at run time
        return f"{home}.{obj.__qualname__}"
    return f"{package}.{name}"


def page_markdown(path: str) -> str:
    title, packages, intro = PAGES[path]
    lines = [f"# {title}", "", intro, ""]
    for package in packages:
        lines += [f"## `{package}`", ""]
        for name in public_names(package):
            lines += [f"::: {object_path(package, name)}", "    options:", "      heading_level: 3", ""]
    return "\n".join(lines)


def on_files(files, config):
    for path in PAGES:
        files.append(File.generated(config, path, content=page_markdown(path)))
    return files
