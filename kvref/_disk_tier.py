"""The disk tier: one verified file per block hash under ``disk_dir`` (DESIGN §5).

Layout of the directory::

    disk_dir/
      kvcache-disk.json            format version, hash algorithm, block geometry
      3f/3f9a...e1.kvb             one block: header + payload (hash hex, lowercase)
      3f/.3f9a...e1.<pid>.<n>.tmp  a write in progress (never read; removed at warm start)

A block file is written to a temporary name in its final directory,
``fsync``-ed, ``os.replace``-d onto its final name and the directory is
``fsync``-ed, so a crash at any point leaves either the old state or a
complete file, never a torn block under a final name. Every read verifies
the whole header and a sha256 checksum over header and payload, so a torn,
corrupted or foreign file is refused, never served.

File layout (all integers little-endian):

=======  ===========  ==========================================================
offset   size         field
=======  ===========  ==========================================================
0        8            magic ``b"KVCBLOCK"``
8        2            format version (1)
10       2            flags (0)
12       4            header_len: bytes before the payload
16       16           hash algorithm, ASCII, NUL-padded (``sha256``/``xxh3_128``)
32       32           geometry digest: sha256 of the canonical geometry JSON
64       1            hash length in bytes (32 or 16)
65       32           block hash, zero-padded to 32 bytes
97       4            n: tokens in the block (== page_size)
101      8            payload length (== page bytes)
109      4n           the block's token ids, int32
109+4n   32           sha256 over bytes [0, 109+4n) and the payload
hdr_len  page_bytes   payload: the device page (``[2, num_layers, page_size,
                      kv_heads, head_dim]``, C order, raw element bytes)
=======  ===========  ==========================================================

Like ``HostTier`` this class keeps an index that is **not** thread-safe;
``TieredConnector`` holds its lock around every index call. File writes and
reads (``write_block``, ``read_block``) run outside the lock on worker
threads; an entry in state ``writing`` owns its final path until it commits
or aborts.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._tier_index import EntryIndex

__all__ = [
    "DiskTier",
    "DiskEntry",
    "DiskBlockError",
    "MAGIC",
    "FORMAT_VERSION",
    "METADATA_NAME",
    "geometry_of",
    "encode_block",
    "decode_block",
]

MAGIC = b"KVCBLOCK"
FORMAT_VERSION = 1
METADATA_NAME = "kvcache-disk.json"
BLOCK_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"

#: magic, version, flags, header_len, algo, geometry digest, hash len, hash, n tokens, payload len
_FIXED = struct.Struct("<8sHHI16s32sB32sIQ")
_CHECKSUM_BYTES = 32
_temp_counter = itertools.count()


class DiskBlockError(Exception):
    """A block file failed verification or could not be read."""


def geometry_of(dtype_name: str, page_shape: tuple[int, ...]) -> dict:
    """The canonical block geometry recorded in the metadata file and digested
    into every block header."""
    return {"dtype": dtype_name, "page_shape": [int(d) for d in page_shape]}


def geometry_digest(geometry: dict) -> bytes:
    return hashlib.sha256(json.dumps(geometry, sort_keys=True).encode()).digest()


def header_len(page_size: int) -> int:
    return _FIXED.size + 4 * page_size + _CHECKSUM_BYTES


def encode_block(
    hash_algo: str, geo_digest: bytes, block_hash: bytes, tokens: np.ndarray, payload: memoryview
) -> bytes:
    """The header of a block file (payload not included)."""
    toks = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    n = len(toks) // 4
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, 0, header_len(n), hash_algo.encode("ascii"), geo_digest,
        len(block_hash), bytes(block_hash), n, len(payload),
    )
    h = hashlib.sha256(fixed)
    h.update(toks)
    h.update(payload)
    return fixed + toks + h.digest()


def decode_block(
    data: bytes, *, hash_algo: str, geo_digest: bytes, block_hash: bytes, page_size: int,
    payload_len: int | None, tokens: np.ndarray | None,
) -> tuple[np.ndarray, memoryview]:
    """Verify a block file (or, with ``payload_len=None``, only its header) and
    return ``(tokens, payload)``; ``DiskBlockError`` naming the first mismatch."""
    if len(data) < _FIXED.size:
        raise DiskBlockError(f"truncated header: {len(data)} bytes < {_FIXED.size}")
    magic, version, _flags, hlen, algo, geo, hl, h, n, plen = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise DiskBlockError(f"magic={magic!r} != {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise DiskBlockError(f"format version={version} != {FORMAT_VERSION}")
    algo_s = algo.rstrip(b"\0").decode("ascii", "replace")
    if algo_s != hash_algo:
        raise DiskBlockError(f"hash_algo={algo_s!r} != {hash_algo!r}")
    if geo != geo_digest:
        raise DiskBlockError("geometry digest differs from this cache's block geometry")
    if h[:hl] != bytes(block_hash) or hl != len(block_hash):
        raise DiskBlockError(f"block hash={h[:hl].hex()[:16]} != {bytes(block_hash).hex()[:16]}")
    if n != page_size or hlen != header_len(page_size):
        raise DiskBlockError(f"tokens per block={n} != page_size={page_size}")
    if payload_len is not None and plen != payload_len:
        raise DiskBlockError(f"payload length={plen} != page bytes {payload_len}")
    if len(data) < hlen:
        raise DiskBlockError(f"truncated header: {len(data)} bytes < {hlen}")
    toks = np.frombuffer(data, dtype="<i4", count=n, offset=_FIXED.size).astype(np.int32)
    if tokens is not None and not np.array_equal(toks, tokens):
        raise DiskBlockError("stored token ids differ from the requested block's tokens")
    if payload_len is None:
        return toks, memoryview(b"")
    if len(data) != hlen + plen:
        raise DiskBlockError(f"file length={len(data)} != header {hlen} + payload {plen}")
    view = memoryview(data)
    check = hashlib.sha256(view[: hlen - _CHECKSUM_BYTES])
    check.update(view[hlen:])
    if check.digest() != bytes(view[hlen - _CHECKSUM_BYTES : hlen]):
        raise DiskBlockError("checksum mismatch")
    return toks, view[hlen:]


def _write_all(fd: int, data) -> None:
    """Write every byte of ``data`` to ``fd`` (a seam for crash tests)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(slots=True, eq=False)
class DiskEntry:
    """One block file held (or being written) in the disk tier."""

    block_hash: bytes
    tokens: np.ndarray
    size: int
    state: str = "writing"
    pins: int = 0
    dead: bool = False


@dataclass(slots=True)
class WarmStart:
    """What ``DiskTier.open`` found in an existing directory."""

    indexed: int = 0
    temp_removed: int = 0
    foreign: int = 0
    rejected: int = 0
    evicted: int = 0


class DiskTier(EntryIndex):
    """Block files under ``root`` within ``capacity`` bytes, LRU by use.

    Parameters
    ----------
    root : Path
        The directory (created if missing).
    capacity : int
        Byte budget over whole files (header + payload).
    hash_algo : str
    geometry : dict
        ``geometry_of(dtype, page_shape)``.
    page_size, page_bytes : int
    """

    def __init__(self, root: Path, capacity: int, hash_algo: str, geometry: dict, page_size: int, page_bytes: int):
        self.root = Path(root)
        self.capacity = capacity
        self.hash_algo = hash_algo
        self.geometry = geometry
        self.geo_digest = geometry_digest(geometry)
        self.page_size = page_size
        self.page_bytes = page_bytes
        self.file_bytes = header_len(page_size) + page_bytes
        self.used = 0
        super().__init__()
        self._digest_hex = 2 * (16 if hash_algo == "xxh3_128" else 32)
        self._name_re = re.compile(rf"^([0-9a-f]{{{self._digest_hex}}}){re.escape(BLOCK_SUFFIX)}$")

    # ------------------------------------------------------------------ open

    def check_metadata(self, owner: str) -> None:
        """Create the metadata file, or refuse a directory written with another
        hash algorithm or block geometry (``ValueError`` naming both)."""
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"{owner}: disk_dir={str(self.root)!r} exists and is not a directory")
        self.root.mkdir(parents=True, exist_ok=True)
        meta_path = self.root / METADATA_NAME
        want = {
            "format": "kvcache-disk", "version": FORMAT_VERSION, "hash_algo": self.hash_algo,
            "geometry": self.geometry, "geometry_digest": self.geo_digest.hex(),
        }
        if meta_path.exists():
            try:
                have = json.loads(meta_path.read_text())
                have_algo, have_geo, have_ver = have["hash_algo"], have["geometry"], have["version"]
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise ValueError(
                    f"{owner}: disk_dir={str(self.root)!r} has an unreadable {METADATA_NAME} ({err}); "
                    "refusing to reuse it"
                ) from err
            if have_ver != FORMAT_VERSION:
                raise ValueError(
                    f"{owner}: disk_dir={str(self.root)!r} has format version={have_ver}, this cache writes {FORMAT_VERSION}"
                )
            # Spec tiers §2: a directory of another algorithm or geometry is refused, never mixed.
            if have_algo != self.hash_algo:
                raise ValueError(
                    f"{owner}: disk_dir={str(self.root)!r} was written with hash_algo={have_algo!r}, "
                    f"this cache uses hash_algo={self.hash_algo!r}"
                )
            if have_geo != self.geometry:
                raise ValueError(
                    f"{owner}: disk_dir={str(self.root)!r} was written with block geometry {have_geo}, "
                    f"this cache has {self.geometry}"
                )
            return
        tmp = self.root / f".{METADATA_NAME}.{os.getpid()}.{next(_temp_counter)}{TEMP_SUFFIX}"
        tmp.write_text(json.dumps(want, indent=1, sort_keys=True))
        os.replace(tmp, meta_path)

    def open(self) -> WarmStart:
        """Warm start: index every valid block file, oldest modification first
        (least recently used), removing temp files and files with a bad
        header; foreign files are counted and left alone."""
        found = WarmStart()
        files: list[tuple[int, bytes, np.ndarray, int]] = []
        for top in os.scandir(self.root):
            if top.name == METADATA_NAME:
                continue
            if not (top.is_dir(follow_symlinks=False) and re.fullmatch(r"[0-9a-f]{2}", top.name)):
                found.foreign += 1
                continue
            for f in os.scandir(top.path):
                if f.name.startswith(".") and f.name.endswith(TEMP_SUFFIX):
                    # Spec tiers §7: a write that never reached os.replace (the writer died)
                    _unlink(f.path)
                    found.temp_removed += 1
                    continue
                m = self._name_re.match(f.name)
                # Spec tiers §7: foreign files are counted and never touched
                if m is None or not f.is_file(follow_symlinks=False) or m.group(1)[:2] != top.name:
                    found.foreign += 1
                    continue
                h = bytes.fromhex(m.group(1))
                try:
                    st = f.stat()
                    with open(f.path, "rb") as fh:
                        head = fh.read(header_len(self.page_size))
                    toks, _ = decode_block(
                        head, hash_algo=self.hash_algo, geo_digest=self.geo_digest, block_hash=h,
                        page_size=self.page_size, payload_len=None, tokens=None,
                    )
                    if st.st_size != self.file_bytes:
                        raise DiskBlockError(f"file length={st.st_size} != {self.file_bytes}")
                except (OSError, DiskBlockError):
                    _unlink(f.path)
                    found.rejected += 1
                    continue
                files.append((st.st_mtime_ns, h, toks, st.st_size))
        files.sort(key=lambda x: (x[0], x[1]))
        for _, h, toks, size in files:
            self._index[h] = DiskEntry(h, toks, size, state="ready")
            self.used += size
        found.indexed = len(files)
        while self.used > self.capacity and self._index:
            victim = next(iter(self._index.values()))
            self._drop(victim)
            found.evicted += 1
            found.indexed -= 1
        return found

    # ------------------------------------------------------------------ paths and IO

    def path_for(self, block_hash: bytes) -> Path:
        hx = bytes(block_hash).hex()
        return self.root / hx[:2] / (hx + BLOCK_SUFFIX)

    def write_block(self, block_hash: bytes, tokens: np.ndarray, payload: np.ndarray) -> int:
        """Write a block file atomically (temp, fsync, replace, dir fsync);
        returns the bytes written. Raises ``OSError`` (the temp file removed)."""
        final = self.path_for(block_hash)
        data = memoryview(np.ascontiguousarray(payload)).cast("B")
        header = encode_block(self.hash_algo, self.geo_digest, block_hash, tokens, data)
        final.parent.mkdir(exist_ok=True)
        tmp = final.parent / f".{final.stem}.{os.getpid()}.{next(_temp_counter)}{TEMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _write_all(fd, header)
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            _unlink(tmp)
            raise
        _fsync_dir(final.parent)
        return len(header) + len(data)

    def read_block(self, block_hash: bytes, tokens: np.ndarray) -> tuple[memoryview, int]:
        """Read and verify a block file; returns ``(payload, file bytes read)``.
        Raises ``DiskBlockError`` on any mismatch or read error."""
        try:
            with open(self.path_for(block_hash), "rb") as fh:
                data = fh.read()
        except OSError as err:
            raise DiskBlockError(f"unreadable: {err}") from err
        _, payload = decode_block(
            data, hash_algo=self.hash_algo, geo_digest=self.geo_digest, block_hash=block_hash,
            page_size=self.page_size, payload_len=self.page_bytes, tokens=tokens,
        )
        return payload, len(data)

    # ------------------------------------------------------------------ index

    def reserve(self, block_hash: bytes, tokens: np.ndarray) -> DiskEntry | None:
        """Reserve ``file_bytes`` for a new file (state ``writing``), evicting
        least recently used unpinned files; None if the hash already has an
        entry or the bytes cannot be freed."""
        if block_hash in self._index:
            return None
        need = self.used + self.file_bytes - self.capacity
        if need > 0:
            victims, freed = [], 0
            for e in self._evictable():
                if freed >= need:
                    break
                victims.append(e)
                freed += e.size
            if freed < need:
                return None
            for e in victims:
                self._drop(e)
        entry = DiskEntry(bytes(block_hash), np.array(tokens, dtype=np.int32), self.file_bytes)
        self._index[entry.block_hash] = entry
        self.used += entry.size
        return entry

    def abort(self, entry: DiskEntry) -> None:
        """A write failed (its temp file is gone): release the reservation."""
        self._release(entry)

    def reject(self, entry: DiskEntry) -> None:
        """A read found the file bad: forget it; the file goes when unpinned."""
        entry.dead = True
        if entry.pins == 0:
            self._drop(entry)

    def _discard(self, entry: DiskEntry) -> None:
        self._drop(entry)

    def _drop(self, entry: DiskEntry) -> None:
        """Release an entry and delete its file (under the connector's lock, so
        a later write of the same hash cannot be deleted by mistake)."""
        if self._index.get(entry.block_hash) is entry:
            _unlink(self.path_for(entry.block_hash))
        self._release(entry)

    def _release(self, entry: DiskEntry) -> None:
        if self._index.get(entry.block_hash) is entry:
            del self._index[entry.block_hash]
            self.used -= entry.size

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        p = "DiskTier.check_invariants"
        total = sum(e.size for e in self._index.values())
        assert total == self.used, f"{p}: entries hold {total} bytes but used={self.used}"
        assert self.used <= self.capacity, f"{p}: used={self.used} > capacity={self.capacity}"
        for h, e in self._index.items():
            assert e.block_hash == h, f"{p}: entry under {h.hex()[:12]} holds {e.block_hash.hex()[:12]}"
            assert e.pins >= 0, f"{p}: entry {h.hex()[:12]} pins={e.pins} < 0"


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:  # already gone, or the directory is unwritable: nothing to serve either way
        pass
