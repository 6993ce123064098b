"""Numba's on-disk kernel cache, made stale as a whole when any source of a package changes.

Numba keys a ``cache=True`` function's cached machine code by the modification time and size of
the function's own file only. A kernel that calls a compiled function of another file (a slab
kernel calling the free list's ``pop_front_evict``, the attention kernels calling
``vecmath.attend_head``) carries that callee's code in its own cache entry, so after only the
callee's file changes (a ``git pull``, an edit, a partial upgrade) the caller keeps running the
old callee: a fixed bookkeeping or attention bug would go on serving wrong K/V until the caller's
own file happened to change.

:func:`stamp_package_caches` registers a Numba cache locator, ahead of Numba's own, for the
functions whose source lies under a package directory: it stores their cache where Numba's
locator would, and adds to each entry's source stamp the (path, mtime, size) of every ``.py``
file of the package, read once when the locator is first asked for a function of it. Any change
to any file of the package then invalidates every cached kernel of the package, which Numba
recompiles on first call. Functions outside the registered packages are located by Numba's own
locators, unchanged.
"""

from __future__ import annotations

import os

__all__ = ["stamp_package_caches"]

_ROOTS: dict[str, tuple | None] = {}  # registered package directory -> its fingerprint (read lazily)


def _fingerprint(root: str) -> tuple:
    """``(relative path, mtime_ns, size)`` of every ``.py`` file under ``root``, sorted."""
    out = []
    for base, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(base, name)
                st = os.stat(path)
                out.append((os.path.relpath(path, root), st.st_mtime_ns, st.st_size))
    return tuple(out)


def _root_of(py_file: str) -> str | None:
    path = os.path.abspath(py_file)
    for root in _ROOTS:
        if path.startswith(root + os.sep):
            return root
    return None


def _locator_class(caching, numba_locators: list):
    class PackageStampLocator(caching._CacheLocator):
        """Numba's own locator for a function of a registered package, with the package's
        fingerprint added to its source stamp."""

        def __init__(self, inner, root: str):
            self._inner = inner
            self._root = root

        @classmethod
        def from_function(cls, py_func, py_file):
            root = _root_of(py_file)
            if root is None:
                return None  # not ours: Numba's locators decide
            for locator_cls in numba_locators:
                inner = locator_cls.from_function(py_func, py_file)
                if inner is not None:
                    return cls(inner, root)
            return None

        def ensure_cache_path(self):
            self._inner.ensure_cache_path()

        def get_cache_path(self):
            return self._inner.get_cache_path()

        def get_disambiguator(self):
            return self._inner.get_disambiguator()

        def get_source_stamp(self):
            stamp = _ROOTS.get(self._root)
            if stamp is None:
                stamp = _ROOTS[self._root] = _fingerprint(self._root)
            return (self._inner.get_source_stamp(), stamp)

    return PackageStampLocator


def stamp_package_caches(package_dir: str) -> bool:
    """Make every cached Numba function under ``package_dir`` stale when any ``.py`` file under it
    changes (see the module's doc). Call it before the package's kernels are decorated.

    Returns False, changing nothing, when this Numba keeps its locators elsewhere (a version this
    was not written for) or ``NUMBA_CACHE_LOCATOR_CLASSES`` overrides them; the functions are then
    cached as Numba caches them.
    """
    from numba.core import caching, config

    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    locators = getattr(impl, "_locator_classes", None)
    if not isinstance(locators, list) or not hasattr(caching, "_CacheLocator") or \
            getattr(config, "CACHE_LOCATOR_CLASSES", None):
        return False
    root = os.path.abspath(package_dir)
    _ROOTS.setdefault(root, None)
    if not any(getattr(c, "__name__", "") == "PackageStampLocator" for c in locators):
        locators.insert(0, _locator_class(caching, list(locators)))
    return True
