"""Device pages as the tiers see them (spec/tiers.md §2).

A tier never indexes a device buffer itself: it reads and writes whole pages
through a ``PageStore``, one per replica, which the engine that owns the
buffer provides. On the CPU that is a view of the NumPy buffer
(``HostPageStore``); on a GPU the fast engine stages pages through pinned
host memory with its own kernels; in bookkeeping-only mode
(``KVCacheParams(allocate_buffers=False)``) the store holds no bytes and the
tiers keep only their accounting.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

__all__ = ["PageStore", "HostPageStore", "BookkeepingPageStore", "ScaledPageStore", "LeafUnitStore",
           "PaddedPageStore"]


@runtime_checkable
class PageStore(Protocol):
    """The pages of one replica's device buffer, each one contiguous run of bytes.

    Attributes
    ----------
    num_pages : int
        Pages in the buffer, the null page 0 included.
    page_nbytes : int
        Bytes of one page (every layer's K and V of one block).
    holds_bytes : bool
        ``False`` in bookkeeping-only mode: ``read`` and ``write`` raise
        ``RuntimeError`` and the tiers account bytes without copying them.
    """

    num_pages: int
    page_nbytes: int
    holds_bytes: bool

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        """Host copies (or, on the CPU, views) of the pages: uint8 ``[n, page_nbytes]``.

        The result is valid until the next ``read`` on the same store from the
        same thread; callers copy what they keep.
        """

    def write(self, block_ids: Sequence[int], data: np.ndarray) -> None:
        """Overwrite the pages ``block_ids`` with ``data``: uint8 ``[n, page_nbytes]``."""

    def alloc_host(self, num_pages: int) -> np.ndarray:
        """Host memory for ``num_pages`` pages, uint8 ``[num_pages, page_nbytes]``, zeroed,
        suited to this store's transfers (pinned on a GPU). The host tier's arena."""


class HostPageStore:
    """A ``PageStore`` over a C-contiguous NumPy buffer ``[num_pages, ...]``.

    Parameters
    ----------
    buffer : ndarray [num_pages, ...]
        C-contiguous; page ``i`` is ``buffer[i]`` viewed as bytes.
    """

    holds_bytes = True

    def __init__(self, buffer: np.ndarray):
        if not isinstance(buffer, np.ndarray):
            raise TypeError(f"HostPageStore: buffer is {type(buffer).__name__}, must be a numpy.ndarray")
        if buffer.ndim < 1 or not buffer.flags.c_contiguous:
            raise ValueError(
                f"HostPageStore: buffer.shape={buffer.shape} C-contiguous={buffer.flags.c_contiguous}, "
                "must be C-contiguous with at least one dimension"
            )
        self.buffer = buffer  # kept so the store pins the memory its views read
        self._pages = buffer.reshape(buffer.shape[0], -1).view(np.uint8)
        self.num_pages = int(buffer.shape[0])
        self.page_nbytes = int(self._pages.shape[1])

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size == 1:
            return self._pages[int(ids[0]) : int(ids[0]) + 1]  # a view: no copy for one page
        return self._pages[ids]

    def write(self, block_ids: Sequence[int], data: np.ndarray) -> None:
        ids = np.asarray(block_ids, dtype=np.int64)
        self._pages[ids] = np.asarray(data, dtype=np.uint8).reshape(len(ids), self.page_nbytes)

    def alloc_host(self, num_pages: int) -> np.ndarray:
        return np.zeros((int(num_pages), self.page_nbytes), dtype=np.uint8)

    def __repr__(self) -> str:
        return f"HostPageStore(num_pages={self.num_pages}, page_nbytes={self.page_nbytes})"


class BookkeepingPageStore:
    """A ``PageStore`` that holds no bytes (bookkeeping-only mode, spec/tiers.md §11).

    The tiers attached to it run their whole policy (indexes, LRU, byte
    capacities, hits, transfers as accounting) without allocating an arena,
    writing a file or storing a value remotely; ``read``, ``write`` and
    ``alloc_host`` raise ``RuntimeError``.

    Parameters
    ----------
    num_pages : int
        Pages of the replica's pool, the null page 0 included (>= 1).
    page_nbytes : int
        Bytes one page would hold (>= 1).
    """

    holds_bytes = False

    def __init__(self, num_pages: int, page_nbytes: int):
        for name, v in (("num_pages", num_pages), ("page_nbytes", page_nbytes)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"BookkeepingPageStore: {name}={v!r}, must be an int")
            if not 1 <= int(v) <= 2**62:
                raise ValueError(f"BookkeepingPageStore: {name}={v} out of range [1, 2**62]")
        self.num_pages = int(num_pages)
        self.page_nbytes = int(page_nbytes)

    def _no_bytes(self, op: str):
        raise RuntimeError(f"BookkeepingPageStore.{op}: bookkeeping-only mode holds no page bytes")

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        self._no_bytes("read")

    def write(self, block_ids: Sequence[int], data: np.ndarray) -> None:
        self._no_bytes("write")

    def alloc_host(self, num_pages: int) -> np.ndarray:
        self._no_bytes("alloc_host")

    def __repr__(self) -> str:
        return f"BookkeepingPageStore(num_pages={self.num_pages}, page_nbytes={self.page_nbytes})"


class ScaledPageStore:
    """A ``PageStore`` whose page payload is a values page followed by its scales page
    (FP8 K/V, spec/manager.md §16): ``page_nbytes = values.page_nbytes + scales.page_nbytes``.

    The tiers move, checksum and verify the payload as one page, so a page's
    scales travel with its values through every tier unchanged.

    Parameters
    ----------
    values, scales : PageStore
        Stores over the values buffer and the scales buffer of the same pages
        (same ``num_pages``, both holding bytes).

    Raises
    ------
    TypeError
        A store is not a ``PageStore``.
    ValueError
        The stores differ in ``num_pages`` or one holds no bytes.
    """

    holds_bytes = True

    def __init__(self, values: PageStore, scales: PageStore):
        for name, st in (("values", values), ("scales", scales)):
            if not isinstance(st, PageStore):
                raise TypeError(f"ScaledPageStore: {name} is {type(st).__name__}, must be a kvspec.PageStore")
            if not st.holds_bytes:
                raise ValueError(f"ScaledPageStore: {name}.holds_bytes=False, must hold bytes")
        if values.num_pages != scales.num_pages:
            raise ValueError(f"ScaledPageStore: values.num_pages={values.num_pages} != scales.num_pages="
                             f"{scales.num_pages}")
        self.values, self.scales = values, scales
        self.buffer = getattr(values, "buffer", None)  # the values buffer (the pages' owner)
        self.num_pages = int(values.num_pages)
        self._split = int(values.page_nbytes)
        self.page_nbytes = self._split + int(scales.page_nbytes)

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        """uint8 ``[n, page_nbytes]``: each page's value bytes, then its scale bytes (a new array)."""
        v = self.values.read(block_ids)
        out = np.empty((v.shape[0], self.page_nbytes), dtype=np.uint8)
        out[:, : self._split] = v
        out[:, self._split :] = self.scales.read(block_ids)
        return out

    def write(self, block_ids: Sequence[int], data: np.ndarray) -> None:
        """Overwrite pages ``block_ids`` with ``data`` uint8 ``[n, page_nbytes]`` (values, then scales).

        Raises ``ValueError`` for data of the wrong size, before either buffer changes.
        """
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        data = np.asarray(data)
        if data.nbytes != ids.size * self.page_nbytes:
            raise ValueError(f"ScaledPageStore.write: data.nbytes={data.nbytes} != len(block_ids)*page_nbytes="
                             f"{ids.size}*{self.page_nbytes}")
        pages = np.ascontiguousarray(data).view(np.uint8).reshape(ids.size, self.page_nbytes)
        self.values.write(ids, np.ascontiguousarray(pages[:, : self._split]))
        self.scales.write(ids, np.ascontiguousarray(pages[:, self._split :]))

    def alloc_host(self, num_pages: int) -> np.ndarray:
        """Zeroed host memory for ``num_pages`` payloads, uint8 ``[num_pages, page_nbytes]``, carved
        from the values store's ``alloc_host`` (pinned on a GPU)."""
        n = int(num_pages)
        if n < 0:
            raise ValueError(f"ScaledPageStore.alloc_host: num_pages={n} < 0")
        total = n * self.page_nbytes
        base = self.values.alloc_host(-(-total // self._split) if total else 0)
        return np.asarray(base).reshape(-1)[:total].reshape(n, self.page_nbytes)

    def __repr__(self) -> str:
        return f"ScaledPageStore(num_pages={self.num_pages}, page_nbytes={self.page_nbytes})"


class PaddedPageStore:
    """The first ``nbytes`` of every page of ``store``: a padded slab page's data without its
    padding (spec/manager.md §13.1), so the tiers move ``params`` page bytes, as in every other
    geometry, and a unit on a tier never depends on how a slab padded it.

    ``read`` returns a new array; ``write`` zero-fills the padding.

    Raises ``TypeError`` for a store that is not a ``PageStore``, ``ValueError`` for one without
    bytes or ``nbytes`` outside ``[1, store.page_nbytes]``.
    """

    holds_bytes = True

    def __init__(self, store: PageStore, nbytes: int):
        if not isinstance(store, PageStore):
            raise TypeError(f"PaddedPageStore: store is {type(store).__name__}, must be a kvspec.PageStore")
        if not store.holds_bytes:
            raise ValueError("PaddedPageStore: store.holds_bytes=False, must hold bytes")
        if not 1 <= int(nbytes) <= int(store.page_nbytes):
            raise ValueError(f"PaddedPageStore: nbytes={nbytes} out of range [1, {int(store.page_nbytes)}]")
        self.store = store
        self.buffer = getattr(store, "buffer", None)
        self.num_pages = int(store.num_pages)
        self.page_nbytes = int(nbytes)
        self._padded = int(store.page_nbytes)

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        """uint8 ``[n, page_nbytes]``: each page's data bytes (a new array)."""
        return np.array(np.asarray(self.store.read(block_ids))[:, : self.page_nbytes], dtype=np.uint8)

    def write(self, block_ids: Sequence[int], data: np.ndarray) -> None:
        """Overwrite pages ``block_ids`` with ``data`` uint8 ``[n, page_nbytes]``, padding zeroed.

        Raises ``ValueError`` for data of the wrong size, before the store changes.
        """
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        data = np.asarray(data)
        if data.nbytes != ids.size * self.page_nbytes:
            raise ValueError(f"PaddedPageStore.write: data.nbytes={data.nbytes} != len(block_ids)*page_nbytes="
                             f"{ids.size}*{self.page_nbytes}")
        whole = np.zeros((ids.size, self._padded), dtype=np.uint8)
        whole[:, : self.page_nbytes] = np.ascontiguousarray(data).view(np.uint8).reshape(ids.size, -1)
        self.store.write(ids, whole)

    def alloc_host(self, num_pages: int) -> np.ndarray:
        """Zeroed host memory for ``num_pages`` pages, uint8 ``[num_pages, page_nbytes]``, carved from
        the store's ``alloc_host`` (pinned on a GPU)."""
        n = int(num_pages)
        if n < 0:
            raise ValueError(f"PaddedPageStore.alloc_host: num_pages={n} < 0")
        total = n * self.page_nbytes
        base = self.store.alloc_host(-(-total // self._padded) if total else 0)
        return np.asarray(base).reshape(-1)[:total].reshape(n, self.page_nbytes)

    def __repr__(self) -> str:
        return f"PaddedPageStore(num_pages={self.num_pages}, page_nbytes={self.page_nbytes} of {self._padded})"


class LeafUnitStore:
    """Every leaf's pages of one replica as one ``PageStore`` of equal **units** (spec/tiers.md §12).

    The tiers hold pages of one byte size; a manager with several leaves (full,
    sliding window, recurrent state) hands them this store. Leaf ``l`` (in the
    order given; the first one's pages are exactly one unit) has
    ``u_l = ceil(stores[l].page_nbytes / unit_nbytes)`` units per page; unit ``j``
    of its page ``p`` is unit id ``base_l + p * u_l + j`` (``base_0 = 0``,
    ``base_{l+1} = base_l + stores[l].num_pages * u_l``) and holds the page's bytes
    ``[j * unit_nbytes, (j + 1) * unit_nbytes)``, the last unit zero-padded. Unit 0
    is the first leaf's null page, never used.

    Parameters
    ----------
    stores : sequence of PageStore
        One per leaf, all holding bytes; ``stores[0].page_nbytes`` is the unit size.

    Raises
    ------
    TypeError
        A store is not a ``PageStore``.
    ValueError
        No store, or one holds no bytes.
    """

    holds_bytes = True

    def __init__(self, stores: Sequence[PageStore]):
        stores = list(stores)
        if not stores:
            raise ValueError("LeafUnitStore: stores is empty, needs one store per leaf")
        for i, st in enumerate(stores):
            if not isinstance(st, PageStore):
                raise TypeError(f"LeafUnitStore: stores[{i}] is {type(st).__name__}, must be a kvspec.PageStore")
            if not st.holds_bytes:
                raise ValueError(f"LeafUnitStore: stores[{i}].holds_bytes=False, must hold bytes")
        self.stores = stores
        self.page_nbytes = unit = int(stores[0].page_nbytes)
        self.units = [-(-int(st.page_nbytes) // unit) for st in stores]
        self.bases = [0]
        for st, u in zip(stores, self.units):
            self.bases.append(self.bases[-1] + int(st.num_pages) * u)
        self.num_pages = self.bases.pop()
        self.buffer = getattr(stores[0], "buffer", None)

    def _locate(self, block_ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(leaf, page, part)`` int64 arrays of the unit ids."""
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        leaf = np.searchsorted(np.asarray(self.bases, dtype=np.int64), ids, side="right") - 1
        units = np.asarray(self.units, dtype=np.int64)[leaf]
        off = ids - np.asarray(self.bases, dtype=np.int64)[leaf]
        return leaf, off // units, off % units

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        """uint8 ``[n, page_nbytes]``: each unit's bytes (a new array)."""
        leaf, page, part = self._locate(block_ids)
        unit = self.page_nbytes
        out = np.zeros((leaf.size, unit), dtype=np.uint8)
        for l in np.unique(leaf).tolist():
            at = np.flatnonzero(leaf == l)
            st, u = self.stores[l], self.units[l]
            if int(st.page_nbytes) == unit:
                out[at] = np.asarray(st.read(page[at].tolist())).reshape(at.size, unit)
                continue
            for k in at.tolist():
                data = np.asarray(st.read([int(page[k])])).reshape(-1)
                seg = data[int(part[k]) * unit : (int(part[k]) + 1) * unit]
                out[k, : seg.size] = seg
        return out

    def write(self, block_ids: Sequence[int], data: np.ndarray) -> None:
        """Overwrite units ``block_ids`` with ``data`` uint8 ``[n, page_nbytes]``; a unit of a
        multi-unit page rewrites that page with the unit's bytes patched in."""
        leaf, page, part = self._locate(block_ids)
        unit = self.page_nbytes
        data = np.ascontiguousarray(np.asarray(data)).view(np.uint8).reshape(leaf.size, unit)
        for l in np.unique(leaf).tolist():
            at = np.flatnonzero(leaf == l)
            st, nbytes = self.stores[l], int(self.stores[l].page_nbytes)
            if nbytes == unit:
                st.write(page[at].tolist(), data[at])
                continue
            for p in np.unique(page[at]).tolist():
                whole = np.array(np.asarray(st.read([p])).reshape(-1), dtype=np.uint8)  # a copy
                for k in at[page[at] == p].tolist():
                    lo = int(part[k]) * unit
                    n = min(unit, nbytes - lo)
                    whole[lo : lo + n] = data[k, :n]
                st.write([p], whole[None])

    def alloc_host(self, num_pages: int) -> np.ndarray:
        """Host memory for ``num_pages`` units, from the first leaf's store (pinned on a GPU)."""
        return self.stores[0].alloc_host(num_pages)

    def __repr__(self) -> str:
        return f"LeafUnitStore(num_pages={self.num_pages}, page_nbytes={self.page_nbytes}, units={self.units})"

