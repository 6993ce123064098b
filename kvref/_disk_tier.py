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

Every file is opened without following a link and without blocking
(``O_NOFOLLOW | O_NONBLOCK``, the subdirectory through a descriptor opened
the same way) and ``fstat``-checked to be a regular file of the expected
size before one byte is read: a symlink, FIFO, device node, directory,
sparse or truncated file is refused and deleted, never read or waited on
(spec/tiers.md §7).

The metadata file carries a **generation** (a random 63-bit number, new at
every ``reset_prefix_cache``) that every block header repeats: a file of an
older generation is never served, whether its unlink failed or its write
landed late (spec/tiers.md §9).

File layout (all integers little-endian):

=======  ===========  ==========================================================
offset   size         field
=======  ===========  ==========================================================
0        8            magic ``b"KVCBLOCK"``
8        2            format version (2)
10       2            flags (0)
12       4            header_len: bytes before the payload
16       16           hash algorithm, ASCII, NUL-padded (``sha256``/``xxh3_128``)
32       32           geometry digest: sha256 of the canonical geometry JSON
                      (dtype, page shape and ``model_id``)
64       1            hash length in bytes (32 or 16)
65       32           block hash, zero-padded to 32 bytes
97       4            n: tokens in the block (== page_size)
101      8            payload length (== page bytes)
109      8            generation (== the metadata file's)
117      4n           the block's token ids, int32
117+4n   32           sha256 over bytes [0, 117+4n) and the payload
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

import errno
import hashlib
import itertools
import json
import os
import re
import secrets
import stat
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
FORMAT_VERSION = 2
METADATA_NAME = "kvcache-disk.json"
BLOCK_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
#: The metadata file is a few hundred bytes; anything larger is not ours.
METADATA_MAX_BYTES = 1 << 16

#: magic, version, flags, header_len, algo, geometry digest, hash len, hash, n tokens, payload len, generation
_FIXED = struct.Struct("<8sHHI16s32sB32sIQQ")
_CHECKSUM_BYTES = 32
_temp_counter = itertools.count()
# spec/tiers.md §7: never follow a link, never wait on a FIFO, never leak a descriptor.
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC


class DiskBlockError(Exception):
    """A block file failed verification or could not be read."""


def geometry_of(dtype_name: str, page_shape: tuple[int, ...], model_id: str = "") -> dict:
    """The canonical block geometry recorded in the metadata file and digested
    into every block header; ``model_id`` is part of it, so a directory (and
    every block file) belongs to one model (spec/tiers.md §7)."""
    return {"dtype": dtype_name, "page_shape": [int(d) for d in page_shape], "model_id": str(model_id)}


def geometry_digest(geometry: dict) -> bytes:
    return hashlib.sha256(json.dumps(geometry, sort_keys=True).encode()).digest()


def header_len(page_size: int) -> int:
    return _FIXED.size + 4 * page_size + _CHECKSUM_BYTES


def encode_block(
    hash_algo: str, geo_digest: bytes, block_hash: bytes, tokens: np.ndarray, payload: memoryview,
    generation: int = 0,
) -> bytes:
    """The header of a block file (payload not included)."""
    toks = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    n = len(toks) // 4
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, 0, header_len(n), hash_algo.encode("ascii"), geo_digest,
        len(block_hash), bytes(block_hash), n, len(payload), generation,
    )
    h = hashlib.sha256(fixed)
    h.update(toks)
    h.update(payload)
    return fixed + toks + h.digest()


def decode_block(
    data: bytes, *, hash_algo: str, geo_digest: bytes, block_hash: bytes, page_size: int,
    payload_len: int | None, tokens: np.ndarray | None, generation: int | None = None,
) -> tuple[np.ndarray, memoryview]:
    """Verify a block file (or, with ``payload_len=None``, only its header) and
    return ``(tokens, payload)``; ``DiskBlockError`` naming the first mismatch."""
    if len(data) < _FIXED.size:
        raise DiskBlockError(f"truncated header: {len(data)} bytes < {_FIXED.size}")
    magic, version, _flags, hlen, algo, geo, hl, h, n, plen, gen = _FIXED.unpack_from(data)
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
    if generation is not None and gen != generation:
        # spec/tiers.md §9: a block of an older generation was invalidated by a reset.
        raise DiskBlockError(f"generation={gen} != {generation} (invalidated by reset_prefix_cache)")
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


def _write_meta(fd: int, data: bytes) -> None:
    """Write the metadata bytes (not the block-write seam ``_write_all``)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as err:  # some filesystems cannot fsync a directory; the rename stands
        if err.errno not in (errno.EINVAL, errno.EBADF):
            raise


def read_regular(name, *, size: int | None = None, max_size: int | None = None,
                 head: int | None = None, dir_fd: int | None = None) -> bytes:
    """The bytes of a regular file, opened without following a link or blocking.

    ``size``: the file must be exactly this long; ``max_size``: at most this
    long; ``head``: read only this many leading bytes. ``DiskBlockError``
    (never a hang, never an unbounded read) for a symlink, FIFO, socket,
    device node, directory, a file of another size, or a read error.
    """
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise DiskBlockError("is a symbolic link (never followed)") from err
        raise DiskBlockError(f"cannot open: {err.strerror}") from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DiskBlockError(f"not a regular file (mode={stat.filemode(st.st_mode)})")
        if size is not None and st.st_size != size:
            raise DiskBlockError(f"file length={st.st_size} != {size}")
        if max_size is not None and st.st_size > max_size:
            raise DiskBlockError(f"file length={st.st_size} > {max_size}")
        want = st.st_size if head is None else min(head, st.st_size)
        chunks, got = [], 0
        while got < want:
            chunk = os.read(fd, want - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        data = b"".join(chunks)
        if len(data) != want:
            raise DiskBlockError(f"file shrank while read: {len(data)} of {want} bytes")
        return data
    except OSError as err:
        raise DiskBlockError(f"unreadable: {err.strerror}") from err
    finally:
        os.close(fd)


def remove_entry(name, dir_fd: int | None = None) -> bool:
    """Delete a directory entry of any kind without following it (an empty
    directory is removed, a non-empty one left); True if it is gone."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except OSError:
        return True
    try:
        if stat.S_ISDIR(st.st_mode):
            os.rmdir(name, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)
    except OSError:  # unwritable directory or a non-empty one: refused all the same
        return False
    return True


@dataclass(slots=True, eq=False)
class DiskEntry:
    """One block file held (or being written) in the disk tier."""

    block_hash: bytes
    tokens: np.ndarray
    size: int
    state: str = "writing"
    pins: int = 0
    dead: bool = False
    generation: int = 0


@dataclass(slots=True)
class WarmStart:
    """What ``DiskTier.open`` found in an existing directory."""

    indexed: int = 0
    temp_removed: int = 0
    foreign: int = 0
    rejected: int = 0
    evicted: int = 0


def _new_generation() -> int:
    """A fresh generation: random, so a lost metadata file never revives old blocks."""
    return secrets.randbits(63)


def _size(entry: DiskEntry) -> int:
    return entry.size


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
        ``geometry_of(dtype, page_shape, model_id)``.
    page_size, page_bytes : int
    holds_bytes : bool
        False in bookkeeping-only mode: the tier keeps its index and byte
        budget and never touches the directory (spec/tiers.md §11).
    """

    def __init__(self, root: Path, capacity: int, hash_algo: str, geometry: dict, page_size: int,
                 page_bytes: int, holds_bytes: bool = True):
        self.root = Path(root)
        self.capacity = capacity
        self.hash_algo = hash_algo
        self.geometry = geometry
        self.geo_digest = geometry_digest(geometry)
        self.page_size = page_size
        self.page_bytes = page_bytes
        self.file_bytes = header_len(page_size) + page_bytes
        self.holds_bytes = holds_bytes
        self.used = 0
        self.generation = 0
        #: entries refused (non-regular, wrong size, bad header) that could not be deleted
        self.undeletable = 0
        super().__init__()
        self._digest_hex = 2 * (16 if hash_algo == "xxh3_128" else 32)
        self._name_re = re.compile(rf"^([0-9a-f]{{{self._digest_hex}}}){re.escape(BLOCK_SUFFIX)}$")

    # ------------------------------------------------------------------ metadata

    def _metadata(self) -> dict:
        return {
            "format": "kvcache-disk", "version": FORMAT_VERSION, "hash_algo": self.hash_algo,
            "geometry": self.geometry, "geometry_digest": self.geo_digest.hex(),
            "generation": self.generation,
        }

    def _write_metadata(self) -> None:
        """Atomically replace the metadata file; if the directory refuses a new
        name, rewrite the existing file in place. ``OSError`` if neither works."""
        meta_path = self.root / METADATA_NAME
        text = json.dumps(self._metadata(), indent=1, sort_keys=True).encode()
        tmp = self.root / f".{METADATA_NAME}.{os.getpid()}.{next(_temp_counter)}{TEMP_SUFFIX}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o644)
            try:
                _write_meta(fd, text)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, meta_path)
            return
        except OSError:
            remove_entry(tmp)
        # spec/tiers.md §9: a directory that became read-only may still let us rewrite the file.
        fd = os.open(meta_path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "metadata is not a regular file")
            os.ftruncate(fd, 0)
            _write_meta(fd, text)
            os.fsync(fd)
        finally:
            os.close(fd)

    def check_metadata(self, owner: str) -> int:
        """Create the metadata file, or refuse a directory written with another
        hash algorithm, block geometry or model (``ValueError`` naming both).

        A metadata path that is not a regular file of at most
        ``METADATA_MAX_BYTES`` (symlink, FIFO, device, directory, huge sparse
        file) is deleted and recreated with a new generation, so no block file
        written before is served; returns the number of such entries (0 or 1).
        """
        # disk_dir itself is the operator's (a link to a mounted volume is fine); what is inside is not trusted
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"{owner}: disk_dir={str(self.root)!r} exists and is not a directory")
        self.root.mkdir(parents=True, exist_ok=True)
        meta_path = self.root / METADATA_NAME
        rejected = 0
        raw = None
        if os.path.lexists(meta_path):
            try:
                raw = read_regular(meta_path, max_size=METADATA_MAX_BYTES)
            except DiskBlockError:
                # spec/tiers.md §7: never read through a link or wait on a FIFO; replace it.
                if not remove_entry(meta_path):
                    raise ValueError(
                        f"{owner}: disk_dir={str(self.root)!r} has a {METADATA_NAME} that is not a regular "
                        "file and cannot be removed"
                    ) from None
                rejected = 1
        if raw is not None:
            try:
                have = json.loads(raw)
                have_algo, have_geo, have_ver = have["hash_algo"], have["geometry"], have["version"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(
                    f"{owner}: disk_dir={str(self.root)!r} has an unreadable {METADATA_NAME} ({err}); "
                    "refusing to reuse it"
                ) from err
            if have_ver != FORMAT_VERSION:
                raise ValueError(
                    f"{owner}: disk_dir={str(self.root)!r} has format version={have_ver}, this cache writes {FORMAT_VERSION}"
                )
            # spec/tiers.md §2: a directory of another algorithm, geometry or model is refused, never mixed.
            if have_algo != self.hash_algo:
                raise ValueError(
                    f"{owner}: disk_dir={str(self.root)!r} was written with hash_algo={have_algo!r}, "
                    f"this cache uses hash_algo={self.hash_algo!r}"
                )
            if isinstance(have_geo, dict) and have_geo.get("model_id", "") != self.geometry["model_id"]:
                raise ValueError(
                    f"{owner}: disk_dir={str(self.root)!r} was written for model_id={have_geo.get('model_id', '')!r}, "
                    f"this cache has model_id={self.geometry['model_id']!r}"
                )
            if have_geo != self.geometry:
                raise ValueError(
                    f"{owner}: disk_dir={str(self.root)!r} was written with block geometry {have_geo}, "
                    f"this cache has {self.geometry}"
                )
            gen = have.get("generation")
            if isinstance(gen, int) and not isinstance(gen, bool) and 0 <= gen < 2**63:
                self.generation = gen
                return rejected
            raise ValueError(f"{owner}: disk_dir={str(self.root)!r} has generation={gen!r} in {METADATA_NAME}, "
                             "must be an int in [0, 2**63)")
        self.generation = _new_generation()
        self._write_metadata()
        return rejected

    def new_generation(self) -> None:
        """Persist a new generation (``reset_prefix_cache``): every block file
        written before is invalid from now on, in this and every later process.
        ``OSError`` (nothing changed) when the metadata cannot be written."""
        old = self.generation
        self.generation = _new_generation()
        try:
            self._write_metadata()
        except OSError:
            self.generation = old
            raise

    # ------------------------------------------------------------------ open

    def _subdir_fd(self, sub: str, *, create: bool = False) -> int:
        """A descriptor of ``root/sub`` opened without following a link. With
        ``create``, a missing one is made and a non-directory in its place
        (a symlink, a file) removed first."""
        path = self.root / sub
        try:
            return os.open(path, _DIR_FLAGS)
        except OSError:
            if not create:
                raise
        if os.path.lexists(path) and not remove_entry(path):
            raise OSError(errno.ENOTDIR, f"{path} is not a directory and cannot be removed")
        try:
            os.mkdir(path)
        except FileExistsError:
            pass  # made by a concurrent writer in between: open it as ours
        return os.open(path, _DIR_FLAGS)

    def open(self) -> WarmStart:
        """Warm start: index every valid block file, oldest modification first
        (least recently used), removing temp files and refusing (deleting,
        counting) every block path that is not a regular file of the right
        size with a good header of this generation; foreign files are counted
        and left alone."""
        found = WarmStart()
        files: list[tuple[int, bytes, np.ndarray, int]] = []
        hlen = header_len(self.page_size)
        for top in os.scandir(self.root):
            if top.name == METADATA_NAME:
                continue
            if top.name.startswith(f".{METADATA_NAME}.") and top.name.endswith(TEMP_SUFFIX):
                remove_entry(top.path)  # a metadata write that never reached os.replace
                found.temp_removed += 1
                continue
            if not re.fullmatch(r"[0-9a-f]{2}", top.name):
                found.foreign += 1
                continue
            try:
                dfd = self._subdir_fd(top.name)
            except OSError:
                # spec/tiers.md §7: our subdirectory name, but a link, FIFO or file: refused and deleted.
                if not remove_entry(top.path):
                    self.undeletable += 1
                found.rejected += 1
                continue
            try:
                for f in os.scandir(dfd):
                    if f.name.startswith(".") and f.name.endswith(TEMP_SUFFIX):
                        # spec/tiers.md §7: a write that never reached os.replace (the writer died)
                        remove_entry(f.name, dir_fd=dfd)
                        found.temp_removed += 1
                        continue
                    m = self._name_re.match(f.name)
                    if m is None or m.group(1)[:2] != top.name:
                        found.foreign += 1  # spec/tiers.md §7: foreign files are counted and never touched
                        continue
                    h = bytes.fromhex(m.group(1))
                    try:
                        head = read_regular(f.name, size=self.file_bytes, head=hlen, dir_fd=dfd)
                        toks, _ = decode_block(
                            head, hash_algo=self.hash_algo, geo_digest=self.geo_digest, block_hash=h,
                            page_size=self.page_size, payload_len=None, tokens=None, generation=self.generation,
                        )
                        st = os.stat(f.name, dir_fd=dfd, follow_symlinks=False)
                    except (OSError, DiskBlockError):
                        if not remove_entry(f.name, dir_fd=dfd):
                            self.undeletable += 1
                        found.rejected += 1
                        continue
                    files.append((st.st_mtime_ns, h, toks, st.st_size))
            finally:
                os.close(dfd)
        files.sort(key=lambda x: (x[0], x[1]))
        for _, h, toks, size in files:
            self._add(DiskEntry(h, toks, size, state="ready", generation=self.generation))
            self.used += size
        found.indexed = len(files)
        while self.used > self.capacity and self._index:
            victim = next(iter(self._index.values()))
            self._drop(victim)
            found.evicted += 1
            found.indexed -= 1
        return found

    # ------------------------------------------------------------------ paths and IO

    def write_block(self, block_hash: bytes, tokens: np.ndarray, payload: np.ndarray, generation: int) -> int:
        """Write a block file atomically (temp, fsync, replace, dir fsync);
        returns the bytes written. Raises ``OSError`` (the temp file removed)."""
        hx = bytes(block_hash).hex()
        data = memoryview(np.ascontiguousarray(payload)).cast("B")
        header = encode_block(self.hash_algo, self.geo_digest, block_hash, tokens, data, generation)
        dfd = self._subdir_fd(hx[:2], create=True)
        try:
            tmp = f".{hx}.{os.getpid()}.{next(_temp_counter)}{TEMP_SUFFIX}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o644, dir_fd=dfd)
            try:
                try:
                    _write_all(fd, header)
                    _write_all(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                # a symlink, FIFO or file under the final name is replaced, never followed
                os.replace(tmp, hx + BLOCK_SUFFIX, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                remove_entry(tmp, dir_fd=dfd)
                raise
            _fsync_fd(dfd)
        finally:
            os.close(dfd)
        return len(header) + len(data)

    def read_block(self, block_hash: bytes, tokens: np.ndarray, generation: int | None = None) -> tuple[memoryview, int]:
        """Read and verify a block file; returns ``(payload, file bytes read)``.
        Raises ``DiskBlockError`` on any mismatch, a non-regular file, a file
        of another size, or a read error (never reads more than one file's bytes)."""
        hx = bytes(block_hash).hex()
        try:
            dfd = self._subdir_fd(hx[:2])
        except OSError as err:
            raise DiskBlockError(f"subdirectory {hx[:2]!r} unusable: {err.strerror}") from err
        try:
            data = read_regular(hx + BLOCK_SUFFIX, size=self.file_bytes, dir_fd=dfd)
        finally:
            os.close(dfd)
        _, payload = decode_block(
            data, hash_algo=self.hash_algo, geo_digest=self.geo_digest, block_hash=block_hash,
            page_size=self.page_size, payload_len=self.page_bytes, tokens=tokens,
            generation=self.generation if generation is None else generation,
        )
        return payload, len(data)

    def _unlink_block(self, block_hash: bytes) -> None:
        """Delete a block path of any kind, never following it (best effort: a
        file left behind carries an older generation or fails verification)."""
        if not self.holds_bytes:
            return
        hx = bytes(block_hash).hex()
        try:
            dfd = self._subdir_fd(hx[:2])
        except OSError:
            return
        try:
            if not remove_entry(hx + BLOCK_SUFFIX, dir_fd=dfd):
                self.undeletable += 1
        finally:
            os.close(dfd)

    # ------------------------------------------------------------------ index

    def reserve(self, block_hash: bytes, tokens: np.ndarray) -> DiskEntry | None:
        """Reserve ``file_bytes`` for a new file (state ``writing``), evicting
        least recently used unpinned files; None if the hash already has an
        entry or the bytes cannot be freed."""
        if block_hash in self._index:
            return None
        need = self.used + self.file_bytes - self.capacity
        if need > 0:
            victims = self._victims(need, _size)
            if sum(e.size for e in victims) < need:
                return None
            for e in victims:
                self._drop(e)
        entry = DiskEntry(bytes(block_hash), np.array(tokens, dtype=np.int32), self.file_bytes,
                          generation=self.generation)
        self._add(entry)
        self.used += entry.size
        return entry

    def abort(self, entry: DiskEntry) -> None:
        """A write failed (its temp file is gone): release the reservation."""
        self._release(entry)

    def reject(self, entry: DiskEntry) -> None:
        """A read found the file bad: forget it; the file goes when unpinned."""
        self._mark_dead(entry)
        if entry.pins == 0:
            self._drop(entry)

    def _discard(self, entry: DiskEntry) -> None:
        self._drop(entry)

    def _drop(self, entry: DiskEntry) -> None:
        """Release an entry and delete its file (under the connector's lock, so
        a later write of the same hash cannot be deleted by mistake)."""
        if self._index.get(entry.block_hash) is entry:
            self._unlink_block(entry.block_hash)
        self._release(entry)

    def _release(self, entry: DiskEntry) -> None:
        if self._index.get(entry.block_hash) is entry:
            self._remove(entry)  # spec/tiers.md §3.1: its claim goes with it
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
        self._check_levels()
