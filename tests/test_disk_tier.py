"""The disk tier with real files and real processes: format, verification,
warm start, crash safety, full and unwritable disks, write policies."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from kvref import KVCacheParams, KVLoadFailed, KVLoadRefused, TieredConnector
from kvref._disk_tier import (
    FORMAT_VERSION,
    MAGIC,
    METADATA_NAME,
    decode_block,
    encode_block,
    geometry_digest,
    geometry_of,
    header_len,
)
from kvspec.hashing import block_hashes

PS = 4


def make_params(**kw) -> KVCacheParams:
    args = dict(page_size=PS, num_layers=2, kv_heads=2, head_dim=4, dtype="float16")
    args.update(kw)
    return KVCacheParams(**args)


def chain(n_blocks: int, start: int = 0, algo: str = "sha256"):
    toks = np.arange(start, start + n_blocks * PS, dtype=np.int32)
    return block_hashes(toks, PS, algo), toks.reshape(n_blocks, PS)


def pattern(h: bytes, nbytes: int) -> np.ndarray:
    """Page bytes derived from a block hash (so any process can recompute them)."""
    reps = -(-nbytes // 32)
    return np.frombuffer(hashlib.sha256(h).digest() * reps, dtype=np.uint8)[:nbytes]


def put(buf: np.ndarray, block_ids, hs) -> None:
    for b, h in zip(block_ids, hs):
        buf[b].view(np.uint8).reshape(-1)[:] = pattern(h, buf[b].nbytes)


def holds_pattern(buf: np.ndarray, block_ids, hs) -> bool:
    return all(np.array_equal(buf[b].view(np.uint8).reshape(-1), pattern(h, buf[b].nbytes)) for b, h in zip(block_ids, hs))


def connector(tmp_path, params, *, host_blocks=0, disk_blocks=64, num_blocks=32, **kw):
    file_bytes = header_len(params.page_size) + params.page_bytes()
    conn = TieredConnector(
        host_bytes=host_blocks * params.page_bytes(), disk_bytes=disk_blocks * file_bytes,
        disk_dir=tmp_path / "kv", **kw,
    )
    buf = np.zeros((num_blocks,) + params.page_shape, dtype=params.np_dtype)
    conn.attach([buf], params)
    return conn, buf


def block_files(root: Path) -> list[Path]:
    return sorted(root.glob("??/*.kvb"))


def settle(conn: TieredConnector) -> None:
    """Wait for background promotions (test helper; the serving loop polls instead)."""
    import time

    for _ in range(2000):
        conn.poll_transfers()
        if conn.pending() == 0:
            return
        time.sleep(0.005)
    raise AssertionError("background work never finished")


@pytest.fixture
def params():
    return make_params()


# --------------------------------------------------------------------------- round trips


def test_device_host_disk_device_round_trip_bit_identical(tmp_path, params):
    conn, buf = connector(tmp_path, params, host_blocks=1)
    hs, toks = chain(3)
    put(buf, [1, 2, 3], hs)
    conn.offload([1, 2, 3], hs, toks).synchronize()
    # one host slot: the first blocks were evicted from host, disk holds all three
    assert conn.held_in(hs[0]) == frozenset({"disk"})
    assert all("disk" in conn.held_in(h) for h in hs)
    assert len(block_files(tmp_path / "kv")) == 3
    assert conn.lookup(hs, toks) == 3
    conn.load([10, 11, 12], hs, toks).synchronize()
    assert holds_pattern(buf, [10, 11, 12], hs)
    m = conn.metrics
    file_bytes = header_len(PS) + params.page_bytes()
    assert m.disk_bytes_written == 3 * file_bytes
    assert m.disk_bytes_read == 2 * file_bytes  # the block still in host was read from host
    assert m.h2d_bytes_copied == 3 * params.page_bytes()
    settle(conn)
    assert "host" in conn.held_in(hs[1]) or "host" in conn.held_in(hs[0])  # promoted from disk
    conn.check_invariants()
    conn.shutdown()


def test_restarted_connector_hits_and_loads_identical_bytes(tmp_path, params):
    conn, buf = connector(tmp_path, params, host_blocks=4)
    hs, toks = chain(4)
    put(buf, [1, 2, 3, 4], hs)
    conn.offload([1, 2, 3, 4], hs, toks).synchronize()
    conn.shutdown()
    assert (tmp_path / "kv" / METADATA_NAME).exists()  # the directory stays

    conn2, buf2 = connector(tmp_path, params, host_blocks=4)
    st = conn2.tier_stats()
    assert (st.warm_start_indexed, st.disk_blocks, st.host_blocks) == (4, 4, 0)
    assert conn2.lookup(hs, toks) == 4
    conn2.load([20, 21, 22, 23], hs, toks).synchronize()
    assert holds_pattern(buf2, [20, 21, 22, 23], hs)
    assert conn2.disk_byte_count().used == 4 * (header_len(PS) + params.page_bytes())
    conn2.shutdown()


def test_xxh3_directory_round_trip(tmp_path):
    p = make_params(hash_algo="xxh3_128")
    conn, buf = connector(tmp_path, p)
    hs, toks = chain(2, algo="xxh3_128")
    assert len(hs[0]) == 16
    put(buf, [1, 2], hs)
    conn.offload([1, 2], hs, toks).synchronize()
    conn.shutdown()
    conn2, buf2 = connector(tmp_path, p)
    conn2.load([5, 6], hs, toks).synchronize()
    assert holds_pattern(buf2, [5, 6], hs)
    conn2.shutdown()


# --------------------------------------------------------------------------- file format


def test_file_layout_and_metadata(tmp_path, params):
    conn, buf = connector(tmp_path, params)
    hs, toks = chain(1)
    put(buf, [1], hs)
    conn.offload([1], hs, toks).synchronize()
    conn.shutdown()
    root = tmp_path / "kv"
    meta = json.loads((root / METADATA_NAME).read_text())
    geo = geometry_of("float16", params.page_shape)
    assert meta["version"] == FORMAT_VERSION and meta["hash_algo"] == "sha256"
    assert meta["geometry"] == geo and meta["geometry_digest"] == geometry_digest(geo).hex()
    path = root / hs[0].hex()[:2] / f"{hs[0].hex()}.kvb"
    assert block_files(root) == [path]
    data = path.read_bytes()
    assert data[:8] == MAGIC
    assert len(data) == header_len(PS) + params.page_bytes()
    got_toks, payload = decode_block(
        data, hash_algo="sha256", geo_digest=geometry_digest(geo), block_hash=hs[0], page_size=PS,
        payload_len=params.page_bytes(), tokens=toks[0],
    )
    assert np.array_equal(got_toks, toks[0])
    assert bytes(payload) == pattern(hs[0], params.page_bytes()).tobytes()
    assert not list(root.glob("**/*.tmp"))


# --------------------------------------------------------------------------- verification on read


def _offload_to_disk_only(tmp_path, params, n=2):
    conn, buf = connector(tmp_path, params, host_blocks=0)
    hs, toks = chain(n)
    put(buf, list(range(1, n + 1)), hs)
    conn.offload(list(range(1, n + 1)), hs, toks).synchronize()
    return conn, buf, hs, toks


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header_token", "truncate", "empty", "swap_file"])
def test_damaged_file_fails_the_load_and_is_counted(tmp_path, params, damage):
    conn, buf, hs, toks = _offload_to_disk_only(tmp_path, params)
    path = tmp_path / "kv" / hs[1].hex()[:2] / f"{hs[1].hex()}.kvb"
    data = bytearray(path.read_bytes())
    if damage == "flip_payload":
        data[-1] ^= 0xFF
    elif damage == "flip_header_token":
        data[110] ^= 0x01  # inside the token ids
    elif damage == "truncate":
        data = data[: len(data) - 7]
    elif damage == "empty":
        data = bytearray()
    elif damage == "swap_file":  # a valid file of another block under this name
        other = tmp_path / "kv" / hs[0].hex()[:2] / f"{hs[0].hex()}.kvb"
        data = bytearray(other.read_bytes())
    path.write_bytes(bytes(data))
    buf[10:12] = 0
    t = conn.load([10, 11], hs, toks)  # the index still holds it: accepted at post
    with pytest.raises(KVLoadFailed, match=r"hashes\[1\]=.*disk copy refused"):
        t.synchronize()
    with pytest.raises(KVLoadFailed):
        t.is_complete()
    assert not holds_pattern(buf, [11], hs[1:])  # never wrong K/V: nothing landed in the bad page
    st = conn.tier_stats()
    assert (st.files_rejected, st.load_failures) == (1, 1)
    assert not path.exists()  # dropped from disk
    assert conn.lookup(hs, toks) == 1
    with pytest.raises(KVLoadRefused):
        conn.load([10, 11], hs, toks)
    conn.check_invariants()
    conn.shutdown()


def test_valid_checksum_but_other_tokens_is_refused(tmp_path, params):
    """A file whose checksum is right but whose tokens are not the block's (a
    forged or colliding block) is never served."""
    conn, buf, hs, toks = _offload_to_disk_only(tmp_path, params, n=1)
    path = tmp_path / "kv" / hs[0].hex()[:2] / f"{hs[0].hex()}.kvb"
    geo = geometry_digest(geometry_of("float16", params.page_shape))
    payload = pattern(hs[0], params.page_bytes())
    gen = json.loads((tmp_path / "kv" / METADATA_NAME).read_text())["generation"]
    forged = encode_block("sha256", geo, hs[0], toks[0] + 1, memoryview(payload), gen) + payload.tobytes()
    path.write_bytes(forged)
    with pytest.raises(KVLoadFailed, match="token ids differ"):
        conn.load([5], hs, toks).synchronize()
    conn.shutdown()


def test_warm_start_rejects_bad_files_ignores_foreign_removes_temps(tmp_path, params):
    conn, buf, hs, toks = _offload_to_disk_only(tmp_path, params, n=4)
    conn.shutdown()
    root = tmp_path / "kv"
    files = {h: root / h.hex()[:2] / f"{h.hex()}.kvb" for h in hs}
    files[hs[1]].write_bytes(files[hs[1]].read_bytes()[:50])  # truncated header
    data = bytearray(files[hs[2]].read_bytes())
    data[0:8] = b"NOTMAGIC"
    files[hs[2]].write_bytes(bytes(data))
    (root / "README.txt").write_text("not ours")
    (root / "zz").mkdir()
    (root / hs[0].hex()[:2] / "notes.kvb").write_text("foreign")
    (root / hs[0].hex()[:2] / f".{hs[0].hex()}.123.0.tmp").write_bytes(b"half a blo")
    conn2, buf2 = connector(tmp_path, params)
    st = conn2.tier_stats()
    assert (st.warm_start_indexed, st.files_rejected, st.temp_files_removed, st.foreign_files) == (2, 2, 1, 3)
    assert (root / "README.txt").exists() and (root / hs[0].hex()[:2] / "notes.kvb").exists()
    assert not files[hs[1]].exists() and not files[hs[2]].exists()
    assert conn2.lookup(hs, toks) == 1  # block 1 is gone, so the chain stops there
    conn2.load([5], hs[:1], toks[:1]).synchronize()
    assert holds_pattern(buf2, [5], hs[:1])
    assert conn2.lookup(hs[3:], toks[3:]) == 1
    conn2.shutdown()


@pytest.mark.parametrize("change", ["algo", "geometry", "dtype"])
def test_directory_of_another_algo_or_geometry_is_refused(tmp_path, params, change):
    conn, _, _, _ = _offload_to_disk_only(tmp_path, params, n=1)
    conn.shutdown()
    other = {
        "algo": make_params(hash_algo="xxh3_128"),
        "geometry": make_params(num_layers=3),
        "dtype": make_params(dtype="bfloat16"),
    }[change]
    want = {
        "algo": r"written with hash_algo='sha256', this cache uses hash_algo='xxh3_128'",
        "geometry": r"written with block geometry .*'page_shape': \[2, 2, 4, 2, 4\].* this cache has .*\[2, 3, 4, 2, 4\]",
        "dtype": r"written with block geometry .*float16.* this cache has .*bfloat16",
    }[change]
    fresh = TieredConnector(host_bytes=0, disk_bytes=10**6, disk_dir=tmp_path / "kv")
    buf = np.zeros((4,) + other.page_shape, dtype=other.np_dtype)
    with pytest.raises(ValueError, match=want):
        fresh.attach([buf], other)
    assert fresh.disk_byte_count().total == 0  # not attached
    assert len(block_files(tmp_path / "kv")) == 1  # nothing deleted


def test_unreadable_metadata_is_refused(tmp_path, params):
    root = tmp_path / "kv"
    root.mkdir()
    (root / METADATA_NAME).write_text("{not json")
    conn = TieredConnector(host_bytes=0, disk_bytes=10**6, disk_dir=root)
    with pytest.raises(ValueError, match="unreadable kvcache-disk.json"):
        conn.attach([np.zeros((4,) + params.page_shape, np.float16)], params)


def test_disk_dir_that_is_a_file_is_refused(tmp_path, params):
    (tmp_path / "kv").write_text("x")
    conn = TieredConnector(host_bytes=0, disk_bytes=10**6, disk_dir=tmp_path / "kv")
    with pytest.raises(ValueError, match="is not a directory"):
        conn.attach([np.zeros((4,) + params.page_shape, np.float16)], params)


# --------------------------------------------------------------------------- capacity, full and failing disks


def test_disk_lru_by_bytes(tmp_path, params):
    conn, buf = connector(tmp_path, params, disk_blocks=2)
    hs, toks = chain(3)
    put(buf, [1, 2, 3], hs)
    conn.offload([1], hs[:1], toks[:1]).synchronize()
    conn.offload([2], hs[1:2], toks[1:2]).synchronize()
    conn.touch(hs[:1])  # h0 most recent
    conn.offload([3], hs[2:], toks[2:]).synchronize()  # evicts h1
    assert conn.held_in(hs[1]) == frozenset()
    assert {p.stem for p in block_files(tmp_path / "kv")} == {hs[0].hex(), hs[2].hex()}
    file_bytes = header_len(PS) + params.page_bytes()
    assert conn.disk_byte_count().used == 2 * file_bytes == conn.disk_byte_count().total
    assert conn.metrics.connector_offload_blocks_dropped == 0
    conn.shutdown()


def test_warm_start_over_budget_evicts_oldest(tmp_path, params):
    conn, buf = connector(tmp_path, params, disk_blocks=8)
    hs, toks = chain(4)
    put(buf, [1, 2, 3, 4], hs)
    for i in range(4):
        conn.offload([i + 1], hs[i : i + 1], toks[i : i + 1]).synchronize()
        path = tmp_path / "kv" / hs[i].hex()[:2] / f"{hs[i].hex()}.kvb"
        os.utime(path, ns=(10**18 + i * 10**9, 10**18 + i * 10**9))  # distinct ages
    conn.shutdown()
    conn2, _ = connector(tmp_path, params, disk_blocks=2)
    assert conn2.tier_stats().warm_start_indexed == 2
    assert [conn2.lookup(hs[i : i + 1], toks[i : i + 1]) for i in range(4)] == [0, 0, 1, 1]
    conn2.shutdown()


def test_tiny_disk_budget_drops_offloads(tmp_path, params):
    conn = TieredConnector(host_bytes=0, disk_bytes=10, disk_dir=tmp_path / "kv")
    buf = np.zeros((8,) + params.page_shape, np.float16)
    conn.attach([buf], params)
    hs, toks = chain(2)
    t = conn.offload([1, 2], hs, toks)
    t.synchronize()
    assert t.is_complete()
    assert conn.metrics.connector_offload_blocks_dropped == 2
    assert conn.lookup(hs, toks) == 0
    conn.shutdown()


def _block_in_the_way(tmp_path, h: bytes) -> None:
    """A non-empty directory under the block's final name: no write can land there."""
    (tmp_path / "kv" / h.hex()[:2] / f"{h.hex()}.kvb" / "in-the-way").mkdir(parents=True)


def test_unwritable_disk_drops_offloads_without_raising(tmp_path, params):
    """The block's final path is a non-empty directory (it cannot be replaced
    or removed): every write raises OSError (root ignores permissions, so no chmod)."""
    conn, buf = connector(tmp_path, params, host_blocks=2)
    hs, toks = chain(1)
    _block_in_the_way(tmp_path, hs[0])
    put(buf, [1], hs)
    t = conn.offload([1], hs, toks)
    t.synchronize()
    assert t.is_complete()
    m, st = conn.metrics, conn.tier_stats()
    assert m.connector_offload_blocks_dropped == 1 and st.disk_write_errors == 1
    assert conn.held_in(hs[0]) == frozenset({"host"})  # write-through: host still got it
    assert conn.disk_byte_count().used == 0
    conn.load([5], hs, toks).synchronize()
    assert holds_pattern(buf, [5], hs)
    conn.check_invariants()
    conn.shutdown()


def test_write_error_mid_file_leaves_no_temp(tmp_path, params, monkeypatch):
    import kvref._disk_tier as dt

    calls = []

    def failing(fd, data):
        calls.append(len(memoryview(data)))
        os.write(fd, bytes(memoryview(data).cast("B")[:10]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dt, "_write_all", failing)
    conn, buf = connector(tmp_path, params)
    hs, toks = chain(1)
    conn.offload([1], hs, toks).synchronize()
    assert calls and conn.metrics.connector_offload_blocks_dropped == 1
    assert not list((tmp_path / "kv").glob("**/*.tmp")) and not block_files(tmp_path / "kv")
    conn.shutdown()


def test_disk_dir_below_a_file_cannot_be_opened(tmp_path, params):
    (tmp_path / "afile").write_text("x")
    conn = TieredConnector(host_bytes=0, disk_bytes=10**6, disk_dir=tmp_path / "afile" / "kv")
    with pytest.raises(ValueError, match="cannot be opened"):
        conn.attach([np.zeros((4,) + params.page_shape, np.float16)], params)
    assert conn.disk_byte_count().total == 0


def test_write_back_eviction_to_a_failing_disk_is_dropped_and_counted(tmp_path, params):
    conn, buf = connector(tmp_path, params, host_blocks=1, write_policy="write_back")
    hs, toks = chain(2)
    _block_in_the_way(tmp_path, hs[0])  # h0's file cannot be written
    put(buf, [1, 2], hs)
    conn.offload([1], hs[:1], toks[:1]).synchronize()
    conn.offload([2], hs[1:], toks[1:]).synchronize()  # evicts h0 from host; its write-back fails
    assert conn.metrics.connector_offload_blocks_dropped == 1
    assert conn.tier_stats().disk_write_errors == 1
    assert conn.held_in(hs[0]) == frozenset() and conn.held_in(hs[1]) == frozenset({"host"})
    conn.check_invariants()
    conn.shutdown()


# --------------------------------------------------------------------------- write policies


def test_write_back_moves_host_evictions_to_disk(tmp_path, params):
    conn, buf = connector(tmp_path, params, host_blocks=2, write_policy="write_back")
    hs, toks = chain(3)
    put(buf, [1, 2, 3], hs)
    conn.offload([1, 2], hs[:2], toks[:2]).synchronize()
    assert block_files(tmp_path / "kv") == []  # write-back: host only
    assert conn.metrics.disk_bytes_written == 0
    conn.offload([3], hs[2:], toks[2:]).synchronize()  # evicts the LRU host entry to disk
    files = block_files(tmp_path / "kv")
    assert len(files) == 1
    evicted = bytes.fromhex(files[0].stem)
    assert conn.held_in(evicted) == frozenset({"disk"})
    assert conn.lookup(hs, toks) == 3
    conn.load([10, 11, 12], hs, toks).synchronize()
    assert holds_pattern(buf, [10, 11, 12], hs)
    conn.shutdown()


def test_write_through_writes_every_offload_to_disk(tmp_path, params):
    conn, buf = connector(tmp_path, params, host_blocks=8)
    hs, toks = chain(3)
    put(buf, [1, 2, 3], hs)
    conn.offload([1, 2, 3], hs, toks).synchronize()
    assert len(block_files(tmp_path / "kv")) == 3
    assert all(conn.held_in(h) == frozenset({"host", "disk"}) for h in hs)
    conn.shutdown()


def test_reset_prefix_cache_deletes_block_files_only(tmp_path, params):
    conn, buf, hs, toks = _offload_to_disk_only(tmp_path, params, n=3)
    (tmp_path / "kv" / "mine.txt").write_text("keep")
    conn.reset_prefix_cache()
    assert block_files(tmp_path / "kv") == []
    assert (tmp_path / "kv" / METADATA_NAME).exists() and (tmp_path / "kv" / "mine.txt").exists()
    assert conn.lookup(hs, toks) == 0 and conn.disk_byte_count().used == 0
    conn.shutdown()


# --------------------------------------------------------------------------- slow disk: handles never block


class SlowDiskConnector(TieredConnector):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.reading = threading.Event()

    def _disk_read(self, block_hash, tokens, generation):
        self.reading.set()
        assert self.gate.wait(30), "test gate never opened"
        return super()._disk_read(block_hash, tokens, generation)


def test_is_complete_never_blocks_on_a_slow_disk(tmp_path, params):
    conn = SlowDiskConnector(host_bytes=0, disk_bytes=10**6, disk_dir=tmp_path / "kv")
    buf = np.zeros((8,) + params.page_shape, np.float16)
    conn.attach([buf], params)
    hs, toks = chain(2)
    put(buf, [1, 2], hs)
    conn.offload([1, 2], hs, toks).synchronize()
    t = conn.load([3, 4], hs, toks)
    assert conn.reading.wait(30)
    assert [t.is_complete() for _ in range(50)] == [False] * 50
    conn.poll_transfers()
    conn.gate.set()
    t.synchronize()
    assert t.is_complete() and holds_pattern(buf, [3, 4], hs)
    conn.shutdown()


# --------------------------------------------------------------------------- crashes: a killed writer


_WRITER = textwrap.dedent(
    """
    import os, sys, hashlib
    import numpy as np
    import kvref, kvref._disk_tier as dt
    from kvspec.hashing import block_hashes

    mode, root, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    PS = 4
    p = kvref.KVCacheParams(page_size=PS, num_layers=2, kv_heads=2, head_dim=4)
    buf = np.zeros((n + 1,) + p.page_shape, p.np_dtype)
    toks = np.arange(n * PS, dtype=np.int32)
    hs = block_hashes(toks, PS)
    for i, h in enumerate(hs):
        raw = buf[i + 1].view(np.uint8).reshape(-1)
        raw[:] = np.frombuffer(hashlib.sha256(h).digest() * (raw.size // 32 + 1), np.uint8)[: raw.size]
    if mode == "exit_mid_file":
        real = dt._write_all
        def half_then_die(fd, data):
            v = memoryview(data).cast("B")
            if len(v) > 200:  # the payload: write half of it, then die without cleanup
                os.write(fd, bytes(v[: len(v) // 2]))
                os._exit(9)
            real(fd, data)
        dt._write_all = half_then_die
    if mode == "exit_before_rename":
        real_replace = os.replace
        def die(src, dst, **kw):
            if str(src).endswith(".tmp") and str(dst).endswith(".kvb"):
                os._exit(9)
            real_replace(src, dst, **kw)
        os.replace = die
    c = kvref.TieredConnector(host_bytes=0, disk_bytes=10**8, disk_dir=root, num_workers=2)
    c.attach([buf], p)
    for i in range(n):
        c.offload([i + 1], hs[i : i + 1], toks.reshape(n, PS)[i : i + 1]).synchronize()
        print(i, flush=True)
    c.shutdown()
    """
)


def _run_writer(mode: str, root: Path, n: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _WRITER, mode, str(root), str(n)], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("mode", ["exit_mid_file", "exit_before_rename"])
def test_writer_dying_mid_file_leaves_nothing_served(tmp_path, params, mode):
    root = tmp_path / "kv"
    proc = _run_writer(mode, root, 3)
    assert proc.returncode == 9, proc.stderr
    assert list(root.glob("??/.*.tmp")), "the dead writer should have left its temp file"
    assert block_files(root) == []
    conn, buf = connector(tmp_path, params)
    hs, toks = chain(3)
    assert conn.tier_stats().temp_files_removed == 1
    assert conn.lookup(hs, toks) == 0
    with pytest.raises(KVLoadRefused):
        conn.load([1], hs[:1], toks[:1])
    assert not list(root.glob("??/.*.tmp"))
    conn.shutdown()


def test_sigkilled_writer_leaves_only_verified_blocks(tmp_path, params):
    """SIGKILL a writer in the middle of a stream of offloads: a later reader
    serves only complete blocks, each bit-identical to what was written."""
    root = tmp_path / "kv"
    n = 2000  # far more than it writes before the kill
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, "plain", str(root), str(n)], stdout=subprocess.PIPE, text=True
    )
    try:
        for _ in range(20):  # let it get going, then kill it mid-stream
            assert proc.stdout.readline(), "writer ended early"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(60)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    conn, buf = connector(tmp_path, params, disk_blocks=n + 8, num_blocks=n + 1)
    hs, toks = chain(n)
    held = conn.lookup(hs, toks)
    assert 20 <= held <= n
    ids = list(range(1, held + 1))
    conn.load(ids, hs[:held], toks[:held]).synchronize()
    assert holds_pattern(buf, ids, hs[:held])
    assert conn.tier_stats().files_rejected == 0  # rename is atomic: no torn block under a final name
    assert not list(root.glob("??/.*.tmp"))
    conn.shutdown()


# --------------------------------------------------------------------------- end to end through the manager


def _manager(tmp_path, *, host_pages=1, num_blocks=6, connector=None, **kw):
    from kvref import PagedKVCacheManager

    p = make_params()
    file_bytes = header_len(PS) + p.page_bytes()
    p = make_params(
        host_offload_bytes=host_pages * p.page_bytes(), disk_offload_bytes=32 * file_bytes,
        disk_offload_dir=str(tmp_path / "kv"), **kw,
    )
    # spec/manager.md §1.6: at most what the pool holds
    return PagedKVCacheManager(p, num_blocks=num_blocks, max_batch_size=4, max_seq_len=min(64, (num_blocks - 1) * PS),
                               connector=connector), p


def _published_pages_hold_their_kv(m, registry) -> None:
    from _fault_connector import kv_values

    pool = m._pools[0]["full"]
    buf = m.get_device_buffer(0)
    for b, h in enumerate(pool.block_hash):
        if h is None:
            continue
        i = registry[h]
        toks = pool.block_tokens[b]
        want = kv_values(toks, np.arange(i * PS, (i + 1) * PS), buf.shape[1:], buf.dtype)
        assert np.array_equal(buf[b].transpose(2, 0, 1, 3, 4), want), f"page {b} (block {i}) K/V differ"


def test_end_to_end_device_host_disk_device(tmp_path):
    from _fault_connector import kv_values, run_request, settle_manager

    from kvref import TextContext

    m, p = _manager(tmp_path, host_pages=1)
    assert type(m._connector).__name__ == "TieredConnector"  # built from the params' tier sizes
    a = np.arange(100, 113, dtype=np.int32)  # 13 tokens: 3 full hashed blocks
    ca, cb = TextContext("a", a), TextContext("b", np.arange(500, 517, dtype=np.int32))
    run_request(m, ca)
    settle_manager(m)
    assert m.disk_byte_count().used == 3 * (header_len(PS) + p.page_bytes())
    assert m.host_byte_count().used == p.page_bytes()
    run_request(m, cb)  # evicts a's pages from the device
    settle_manager(m)
    ctx = TextContext("a2", a)
    hits = m.get_prefix_cache_hit_counts(ctx)
    assert (hits[0].device_blocks, hits[0].external_blocks) == (0, 3)
    m.take_metrics_aggregated()
    m.claim(ctx)
    m.alloc(ctx).synchronize()
    assert (ctx.cached_prefix_length, ctx.cached_prefix_external_length) == (12, 12)
    m.poll_transfers()  # lands and publishes
    row = m.get_req_blocks_per_leaf(ctx)["full"]
    buf = m.get_device_buffer(0)
    for i in range(3):
        want = kv_values(a[i * PS : (i + 1) * PS], np.arange(i * PS, (i + 1) * PS), buf.shape[1:], buf.dtype)
        assert np.array_equal(buf[row[i]].transpose(2, 0, 1, 3, 4), want)
    met = m.get_metrics_aggregated()
    assert met.h2d_bytes_copied == 3 * p.page_bytes()
    assert met.disk_bytes_read >= 2 * (header_len(PS) + p.page_bytes())  # host held at most one
    assert met.external_blocks_served == 3 and met.cache_tokens == 12
    registry = {h: i for c in (ca, cb) for i, h in enumerate(block_hashes(c.tokens, PS))}
    _published_pages_hold_their_kv(m, registry)
    m.check_invariants()
    m.release(ctx)
    m.shutdown()


def test_end_to_end_restarted_manager_hits(tmp_path):
    from _fault_connector import kv_values, run_request

    from kvref import TextContext

    m, p = _manager(tmp_path, host_pages=4)
    a = np.arange(7, 7 + 17, dtype=np.int32)  # 4 full blocks
    run_request(m, TextContext("a", a), decode_steps=3)
    m.shutdown()  # posts the queued offloads, waits, closes; the directory stays

    m2, _ = _manager(tmp_path, host_pages=4)
    ctx = TextContext("again", a)
    assert m2.get_prefix_cache_hit_counts(ctx)[0].external_blocks == 4
    m2.claim(ctx)
    m2.alloc(ctx).synchronize()
    m2.poll_transfers()
    assert ctx.cached_prefix_external_length == 16
    row = m2.get_req_blocks_per_leaf(ctx)["full"]
    buf = m2.get_device_buffer(0)
    for i in range(4):
        want = kv_values(a[i * PS : (i + 1) * PS], np.arange(i * PS, (i + 1) * PS), buf.shape[1:], buf.dtype)
        assert np.array_equal(buf[row[i]].transpose(2, 0, 1, 3, 4), want)
    m2.check_invariants()
    m2.release(ctx)
    m2.shutdown()


# --------------------------------------------------------------------------- a state machine over the connector alone


from hypothesis import note  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402

#: Token stems: chains share their first blocks, so hashes collide across chains.
_CHAINS = [
    np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], dtype=np.int32),
    np.array([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 1, 1, 1, 1], dtype=np.int32),
    np.array([9, 9, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], dtype=np.int32),
]


class DiskConnectorMachine(RuleBasedStateMachine):
    """Offload, load, corrupt files, restart the process, reset: a load either
    returns exactly the offloaded bytes or fails; never anything else."""

    def __init__(self):
        super().__init__()
        import tempfile

        self.root = Path(tempfile.mkdtemp(prefix="kvdisk-")) / "kv"
        self.params = make_params()
        self.hs = [block_hashes(c, PS) for c in _CHAINS]
        self.toks = [c.reshape(-1, PS) for c in _CHAINS]
        self.ever: set[bytes] = set()  # offloaded since the last reset
        self.conn = None

    def _open(self):
        file_bytes = header_len(PS) + self.params.page_bytes()
        self.conn = TieredConnector(
            2 * self.params.page_bytes(), 5 * file_bytes, self.root, write_policy=self.policy, num_workers=2
        )
        self.buf = np.zeros((24,) + self.params.page_shape, self.params.np_dtype)
        self.conn.attach([self.buf], self.params)

    @initialize(policy=st.sampled_from(["write_through", "write_back"]))
    def start(self, policy):
        self.policy = policy
        self._open()

    def teardown(self):
        import shutil

        if self.conn is not None:
            self.conn.shutdown()
        shutil.rmtree(self.root.parent, ignore_errors=True)

    @rule(c=st.integers(0, len(_CHAINS) - 1), n=st.integers(1, 4))
    def offload(self, c, n):
        note(f"offload chain {c} blocks [0, {n})")
        ids = list(range(1, n + 1))
        put(self.buf, ids, self.hs[c][:n])
        self.conn.offload(ids, self.hs[c][:n], self.toks[c][:n]).synchronize()
        self.ever.update(self.hs[c][:n])

    @rule(c=st.integers(0, len(_CHAINS) - 1))
    def load(self, c):
        n = self.conn.lookup(self.hs[c], self.toks[c])
        assert all(h in self.ever for h in self.hs[c][:n]), "hit on a block never offloaded"
        if not n:
            return
        ids = list(range(10, 10 + n))
        self.buf[10 : 10 + n] = 0
        note(f"load chain {c} blocks [0, {n})")
        try:
            self.conn.load(ids, self.hs[c][:n], self.toks[c][:n]).synchronize()
        except KVLoadFailed:
            return  # a corrupted file: refused, and it is gone now
        assert holds_pattern(self.buf, ids, self.hs[c][:n])

    @rule(c=st.integers(0, len(_CHAINS) - 1), i=st.integers(0, 3), offset=st.integers(0, 400))
    def corrupt_file(self, c, i, offset):
        path = self.root / self.hs[c][i].hex()[:2] / f"{self.hs[c][i].hex()}.kvb"
        if not path.exists():
            return
        data = bytearray(path.read_bytes())
        data[offset % len(data)] ^= 0x5A
        note(f"corrupt byte {offset % len(data)} of chain {c} block {i}")
        path.write_bytes(bytes(data))

    @rule()
    def restart(self):
        note("restart the process")
        self.conn.shutdown()
        self._open()

    @rule()
    def reset(self):
        note("reset_prefix_cache()")
        self.conn.reset_prefix_cache()
        self.ever.clear()

    @invariant()
    def consistent(self):
        if self.conn is None:
            return
        settle(self.conn)  # background promotions (and their write-back writes) finish
        self.conn.check_invariants()
        assert self.conn.disk_byte_count().used <= self.conn.disk_byte_count().total
        assert not list(self.root.glob("??/.*.tmp"))


test_disk_connector_machine = DiskConnectorMachine.TestCase
