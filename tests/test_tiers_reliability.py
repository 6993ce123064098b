"""Issue 11, tier items: no path to wrong or stale K/V, model identity, special
files, bounded arguments, page stores and bookkeeping-only mode.

Real files, real threads, real subprocesses; the remote cases are in
test_tiers_security.py (they need redis-server).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvref
import kvref._disk_tier as dt
from kvref import KVCacheParams, KVLoadFailed, KVLoadRefused, TieredConnector
from kvref._disk_tier import METADATA_NAME, header_len
from kvspec import BookkeepingPageStore, HostPageStore, PageStore
from kvspec.hashing import block_hashes

PS = 4


def make_params(**kw) -> KVCacheParams:
    args = dict(page_size=PS, num_layers=2, kv_heads=2, head_dim=4, dtype="float16")
    args.update(kw)
    return KVCacheParams(**args)


def chain(n: int, start: int = 0):
    toks = np.arange(start, start + n * PS, dtype=np.int32)
    return block_hashes(toks, PS), toks.reshape(n, PS)


def fill(buf, ids, seed):
    rng = np.random.default_rng(seed)
    for b in ids:
        raw = buf[b].view(np.uint8)
        raw[...] = rng.integers(0, 256, raw.shape, dtype=np.uint8)


def file_bytes(params) -> int:
    return header_len(params.page_size) + params.page_bytes()


def disk_conn(root: Path, params, *, host_blocks=0, disk_blocks=32, num_blocks=16, **kw):
    conn = TieredConnector(host_bytes=host_blocks * params.page_bytes(), disk_bytes=disk_blocks * file_bytes(params),
                           disk_dir=root, **kw)
    buf = np.zeros((num_blocks,) + params.page_shape, params.np_dtype)
    conn.attach([buf], params)
    return conn, buf


def block_path(root: Path, h: bytes) -> Path:
    return root / h.hex()[:2] / f"{h.hex()}.kvb"


def run_with_timeout(fn, seconds: float = 20.0):
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it does not return."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as err:  # re-raised on the test thread
            out["error"] = err

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} hung for {seconds} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


# --------------------------------------------------------------------------- (3) model identity


def test_host_tier_never_crosses_models():
    """The host index belongs to one model: another model_id cannot attach to it."""
    a, b = make_params(model_id="base"), make_params(model_id="base-finetune")
    conn = TieredConnector(host_bytes=4 * a.page_bytes())
    buf = np.zeros((8,) + a.page_shape, a.np_dtype)
    conn.attach([buf], a)
    hs, toks = chain(2)
    fill(buf, [1, 2], 1)
    conn.offload([1, 2], hs, toks).synchronize()
    conn.detach()
    with pytest.raises(ValueError, match="model_id"):
        conn.attach([np.zeros_like(buf)], b)
    conn.shutdown()


def test_disk_directory_of_another_model_is_refused_and_its_files_never_served(tmp_path):
    a, b = make_params(model_id="base"), make_params(model_id="base-finetune")
    conn, buf = disk_conn(tmp_path / "kv", a)
    hs, toks = chain(2)
    fill(buf, [1, 2], 2)
    conn.offload([1, 2], hs, toks).synchronize()
    conn.shutdown()
    other = TieredConnector(host_bytes=0, disk_bytes=32 * file_bytes(b), disk_dir=tmp_path / "kv")
    with pytest.raises(ValueError, match=r"model_id='base'.*model_id='base-finetune'"):
        other.attach([np.zeros_like(buf)], b)
    # A block file of model "base" copied into model "finetune"'s directory fails its header check.
    conn_b, buf_b = disk_conn(tmp_path / "kv-b", b)
    dst = block_path(tmp_path / "kv-b", hs[0])
    dst.parent.mkdir(exist_ok=True)
    dst.write_bytes(block_path(tmp_path / "kv", hs[0]).read_bytes())
    conn_b.shutdown()
    conn_b, buf_b = disk_conn(tmp_path / "kv-b", b)
    assert conn_b.lookup(hs, toks) == 0
    assert conn_b.tier_stats().files_rejected == 1 and not dst.exists()
    conn_b.shutdown()


_PROC = textwrap.dedent(
    """
    import sys
    import numpy as np
    from kvref import PagedKVCacheManager, TieredConnector
    from kvspec import KVCacheParams, TextContext
    model, root = sys.argv[1], sys.argv[2]
    params = KVCacheParams(page_size=4, num_layers=1, kv_heads=1, head_dim=2, dtype="float32", model_id=model)
    conn = TieredConnector(host_bytes=0, disk_bytes=1 << 20, disk_dir=root)
    try:
        m = PagedKVCacheManager(params, num_blocks=16, max_batch_size=2, max_seq_len=60, connector=conn)
    except ValueError as err:
        print("refused", err)
        sys.exit(0)
    ctx = TextContext("r", list(range(100, 113)))
    m.claim(ctx)
    m.alloc(ctx).synchronize()
    m.poll_transfers()
    print("hit", ctx.cached_prefix_external_length)
    ctx.update(0)
    m.step(ctx)
    m.release(ctx)
    m.shutdown()
    """
)


def test_two_processes_two_models_over_one_disk_dir_share_nothing(tmp_path):
    def run(model):
        out = subprocess.run([sys.executable, "-c", _PROC, model, str(tmp_path / "kv")],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert run("llama-base") == "hit 0"
    assert run("llama-base").startswith("hit 12")  # the same model hits its own blocks
    refused = run("llama-finetune")
    assert refused.startswith("refused") and "model_id='llama-base'" in refused


# --------------------------------------------------------------------------- (4) reset that sticks


def test_reset_with_failing_unlinks_is_still_never_served(tmp_path, monkeypatch):
    """Issue 11 (4): files a reset could not delete carry the old generation."""
    params = make_params()
    conn, buf = disk_conn(tmp_path / "kv", params)
    hs, toks = chain(3)
    fill(buf, [1, 2, 3], 3)
    conn.offload([1, 2, 3], hs, toks).synchronize()
    monkeypatch.setattr(dt, "remove_entry", lambda *a, **k: False)  # every unlink fails
    conn.reset_prefix_cache()
    assert conn.lookup(hs, toks) == 0
    assert all(block_path(tmp_path / "kv", h).exists() for h in hs)
    assert conn.tier_stats().unlink_failures == 3  # counted
    conn.shutdown()
    monkeypatch.undo()
    fresh, _ = disk_conn(tmp_path / "kv", params)
    assert fresh.lookup(hs, toks) == 0
    st_ = fresh.tier_stats()
    assert st_.warm_start_indexed == 0 and st_.files_rejected == 3
    assert not any(block_path(tmp_path / "kv", h).exists() for h in hs)  # deleted now
    fresh.shutdown()


def test_reset_that_cannot_be_recorded_raises_and_changes_nothing(tmp_path, monkeypatch):
    params = make_params()
    conn, buf = disk_conn(tmp_path / "kv", params, host_blocks=2)
    hs, toks = chain(2)
    fill(buf, [1, 2], 4)
    conn.offload([1, 2], hs, toks).synchronize()

    def refuse(self):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(dt.DiskTier, "_write_metadata", refuse)
    with pytest.raises(RuntimeError, match=r"reset_prefix_cache: disk_dir=.* cannot record the reset"):
        conn.reset_prefix_cache()
    assert conn.tier_stats().reset_failures == 1
    assert conn.lookup(hs, toks) == 2  # nothing forgotten: the error is the signal
    monkeypatch.undo()
    conn.reset_prefix_cache()
    assert conn.lookup(hs, toks) == 0
    conn.shutdown()


def test_reset_in_a_read_only_directory_rewrites_the_metadata_in_place(tmp_path, monkeypatch):
    """The directory refuses new names (os.replace fails); the metadata file is rewritten in place."""
    params = make_params()
    conn, buf = disk_conn(tmp_path / "kv", params)
    hs, toks = chain(2)
    fill(buf, [1, 2], 5)
    conn.offload([1, 2], hs, toks).synchronize()
    gen0 = json.loads((tmp_path / "kv" / METADATA_NAME).read_text())["generation"]
    real_open = os.open

    def no_new_names(path, flags, *a, **k):
        if flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(dt.os, "open", no_new_names)
    monkeypatch.setattr(dt, "remove_entry", lambda *a, **k: False)
    conn.reset_prefix_cache()
    monkeypatch.undo()
    assert json.loads((tmp_path / "kv" / METADATA_NAME).read_text())["generation"] != gen0
    conn.shutdown()
    fresh, _ = disk_conn(tmp_path / "kv", params)
    assert fresh.lookup(hs, toks) == 0 and fresh.tier_stats().files_rejected == 2
    fresh.shutdown()


class GatedWrites(TieredConnector):
    """Holds every disk write until ``gate`` opens (a late write)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate, self.writing = threading.Event(), threading.Event()

    def _disk_write(self, block_hash, tokens, payload, generation):
        self.writing.set()
        assert self.gate.wait(30)
        return super()._disk_write(block_hash, tokens, payload, generation)


def test_late_write_after_reset_is_never_served(tmp_path, monkeypatch):
    params = make_params()
    conn = GatedWrites(host_bytes=0, disk_bytes=32 * file_bytes(params), disk_dir=tmp_path / "kv")
    buf = np.zeros((8,) + params.page_shape, params.np_dtype)
    conn.attach([buf], params)
    hs, toks = chain(1)
    fill(buf, [1], 6)
    t = conn.offload([1], hs, toks)
    assert conn.writing.wait(30)
    conn.reset_prefix_cache()
    monkeypatch.setattr(dt, "remove_entry", lambda *a, **k: False)  # the late file cannot be deleted
    conn.gate.set()
    t.synchronize()
    monkeypatch.undo()
    assert conn.lookup(hs, toks) == 0
    assert block_path(tmp_path / "kv", hs[0]).exists()  # landed late, undeletable
    conn.shutdown()
    fresh, _ = disk_conn(tmp_path / "kv", params)
    assert fresh.lookup(hs, toks) == 0 and fresh.tier_stats().files_rejected == 1
    fresh.shutdown()


class GatedWriteBack(TieredConnector):
    """Holds write-back evictions between the eviction and the disk write."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate, self.evicting = threading.Event(), threading.Event()

    def _write_evicted(self, evicted, epoch):
        if any(v.wanted for v in evicted):
            self.evicting.set()
            assert self.gate.wait(30)
        return super()._write_evicted(evicted, epoch)


def test_write_back_eviction_after_reset_writes_nothing(tmp_path):
    """Issue 11 (5): the eviction path checks the epoch (was 1 in 36 trials; deterministic here)."""
    params = make_params()
    conn = GatedWriteBack(host_bytes=params.page_bytes(), disk_bytes=32 * file_bytes(params),
                          disk_dir=tmp_path / "kv", write_policy="write_back")
    buf = np.zeros((8,) + params.page_shape, params.np_dtype)
    conn.attach([buf], params)
    hs, toks = chain(2)
    fill(buf, [1, 2], 7)
    conn.offload([1], hs[:1], toks[:1]).synchronize()
    t = conn.offload([2], hs[1:], toks[1:])  # evicts hs[0] from host: write-back to disk
    assert conn.evicting.wait(30)
    conn.reset_prefix_cache()
    conn.gate.set()
    t.synchronize()
    assert conn.lookup(hs[:1], toks[:1]) == 0
    assert not block_path(tmp_path / "kv", hs[0]).exists()
    assert conn.tier_stats().stale_writes_dropped >= 1
    conn.shutdown()
    fresh, _ = disk_conn(tmp_path / "kv", params)
    assert fresh.lookup(hs, toks) == 0
    fresh.shutdown()


# --------------------------------------------------------------------------- (9, 10) special files


def _make_special(path: Path, kind: str, good: bytes) -> None:
    """Put a ``kind`` entry at ``path`` (``good``: the valid bytes a file there would hold)."""
    if path.is_dir() and not path.is_symlink():
        import shutil

        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink_dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "symlink_to_valid":
        target = path.parent.parent / f"elsewhere-{path.name}"
        target.write_bytes(good)
        path.symlink_to(target)
    elif kind == "dangling_symlink":
        path.symlink_to(path.parent / "nowhere")
    elif kind == "empty_dir":
        path.mkdir()
    elif kind == "full_dir":
        (path / "x").mkdir(parents=True)
    elif kind == "sparse_3gib":
        with open(path, "wb") as f:
            f.truncate(3 << 30)
    elif kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif kind == "padded":
        path.write_bytes(good + b"\0" * 7)
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        raise AssertionError(kind)


SPECIAL = ["fifo", "symlink_dev_zero", "symlink_to_valid", "dangling_symlink", "empty_dir", "full_dir",
           "sparse_3gib", "truncated", "padded", "empty"]


def _gone_or_kept(path: Path, kind: str) -> bool:
    """Refused entries are deleted; only a non-empty directory cannot be."""
    return os.path.isdir(path) if kind == "full_dir" else not os.path.lexists(path)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A directory holding three good block files, and their bytes."""
    params = make_params()
    root = tmp_path_factory.mktemp("good") / "kv"
    conn, buf = disk_conn(root, params)
    hs, toks = chain(3)
    fill(buf, [1, 2, 3], 8)
    conn.offload([1, 2, 3], hs, toks).synchronize()
    conn.shutdown()
    return params, root, hs, toks, buf


def _copy_dir(src: Path, dst: Path) -> None:
    import shutil

    shutil.copytree(src, dst)


@settings(max_examples=len(SPECIAL) * 2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(SPECIAL), which=st.integers(0, 2), where=st.sampled_from(["load", "warm_start"]))
def test_special_block_files_are_refused_counted_deleted_never_hang(written, tmp_path_factory, kind, which, where):
    """Issue 11 (9, 10): at every path the tiers read a block file."""
    params, good_root, hs, toks, src = written
    root = tmp_path_factory.mktemp("special") / "kv"
    _copy_dir(good_root, root)
    path = block_path(root, hs[which])
    good = path.read_bytes()
    if where == "warm_start":
        _make_special(path, kind, good)
    conn, buf = run_with_timeout(lambda: disk_conn(root, params))
    if where == "load":
        _make_special(path, kind, good)
    n = conn.lookup(hs, toks)
    if where == "warm_start":
        assert n == which and conn.tier_stats().files_rejected == 1
        assert _gone_or_kept(path, kind)
    else:
        assert n == 3
        t = conn.load([4, 5, 6], hs, toks)
        with pytest.raises(KVLoadFailed, match="disk copy refused"):
            run_with_timeout(t.synchronize)
        st_ = conn.tier_stats()
        assert st_.files_rejected == 1 and st_.load_failures == 1
        assert _gone_or_kept(path, kind)
        # never retried: the entry is gone, a second load is refused at post without I/O
        with pytest.raises(KVLoadRefused):
            conn.load([4, 5, 6], hs, toks)
        assert conn.lookup(hs, toks) == which
    # what was served is the real bytes, never the special file's
    if which > 0:
        conn.load([9], hs[:1], toks[:1]).synchronize()
        assert buf[9].tobytes() == src[1].tobytes()
    assert os.path.exists("/dev/zero")  # never deleted through a link
    run_with_timeout(conn.shutdown)


@pytest.mark.parametrize("kind", SPECIAL)
def test_special_metadata_file_is_replaced_never_read(tmp_path, written, kind):
    """A metadata file that is not a small regular file: deleted, counted, recreated with a
    new generation (so no file written before is served); never a hang or a huge read."""
    params, good_root, hs, toks, _ = written
    root = tmp_path / "kv"
    _copy_dir(good_root, root)
    meta = root / METADATA_NAME
    if kind in ("truncated", "padded", "empty"):
        pytest.skip("a regular metadata file that does not parse is ValueError (test_disk_tier.py)")
    if kind == "full_dir":
        pytest.skip("cannot be removed: ValueError (test_metadata_that_is_a_full_directory...)")
    _make_special(meta, kind, meta.read_bytes())
    conn, _ = run_with_timeout(lambda: disk_conn(root, params))
    st_ = conn.tier_stats()
    assert conn.lookup(hs, toks) == 0 and st_.files_rejected == 1 + 3
    assert stat.S_ISREG(os.lstat(meta).st_mode)
    run_with_timeout(conn.shutdown)


def test_metadata_that_is_a_full_directory_is_refused_with_a_clear_error(tmp_path):
    params = make_params()
    (tmp_path / "kv" / METADATA_NAME / "x").mkdir(parents=True)
    conn = TieredConnector(host_bytes=0, disk_bytes=10**6, disk_dir=tmp_path / "kv")
    with pytest.raises(ValueError, match="not a regular file and cannot be removed"):
        run_with_timeout(lambda: conn.attach([np.zeros((4,) + params.page_shape, np.float16)], params))


@pytest.mark.parametrize("kind", ["symlink_elsewhere", "file", "fifo"])
def test_subdirectory_that_is_not_a_directory_is_never_followed(tmp_path, written, kind):
    params, good_root, hs, toks, buf_src = written
    root = tmp_path / "kv"
    _copy_dir(good_root, root)
    sub = root / hs[0].hex()[:2]
    outside = tmp_path / "outside"
    outside.mkdir()
    import shutil

    shutil.rmtree(sub)
    if kind == "symlink_elsewhere":
        shutil.copytree(good_root / hs[0].hex()[:2], outside / "copy")
        sub.symlink_to(outside / "copy")
    elif kind == "file":
        sub.write_text("x")
    else:
        os.mkfifo(sub)
    conn, buf = run_with_timeout(lambda: disk_conn(root, params))
    assert conn.lookup(hs, toks) == 0 and conn.tier_stats().files_rejected >= 1
    assert not os.path.lexists(sub) or sub.is_dir() and not sub.is_symlink()
    # writes land in a real subdirectory, never through the link
    fill(buf, [1], 9)
    conn.offload([1], hs[:1], toks[:1]).synchronize()
    assert sub.is_dir() and not sub.is_symlink() and block_path(root, hs[0]).is_file()
    if kind == "symlink_elsewhere":
        assert sorted(p.name for p in (outside / "copy").iterdir()) == [f"{hs[0].hex()}.kvb"]
    run_with_timeout(conn.shutdown)


def test_no_memory_error_from_a_huge_sparse_file_through_the_manager(tmp_path):
    """Issue 11 (10): alloc and shutdown see a counted failure, never MemoryError."""
    params = make_params()

    def manager():
        conn = TieredConnector(host_bytes=0, disk_bytes=10**6, disk_dir=tmp_path / "kv")
        return conn, kvref.PagedKVCacheManager(params, num_blocks=16, max_batch_size=2, max_seq_len=60,
                                               connector=conn)

    conn, m = manager()
    ctx = kvref.TextContext("a", list(range(13)))
    m.claim(ctx)
    m.alloc(ctx).synchronize()
    ctx.update(0)
    m.step(ctx)
    m.release(ctx)
    m.shutdown()
    files = sorted((tmp_path / "kv").glob("??/*.kvb"))
    assert len(files) == 3
    conn, m = run_with_timeout(manager)  # warm start indexes the three files
    for f in files:
        f.unlink()
        with open(f, "wb") as fh:
            fh.truncate(3 << 30)
    ctx2 = kvref.TextContext("b", list(range(13)))
    m.claim(ctx2)
    handle = m.alloc(ctx2)
    with pytest.raises(KVLoadFailed, match=r"file length=3221225472 != \d+"):  # never MemoryError
        run_with_timeout(handle.synchronize)
    for _ in range(3):
        m.poll_transfers()
    m.release(ctx2)
    run_with_timeout(m.shutdown)
    assert conn.tier_stats().files_rejected == 1
    assert not block_path(tmp_path / "kv", chain(3)[0][0]).exists()  # refused, deleted, never retried


# --------------------------------------------------------------------------- (19b) integer extremes

EXTREMES = [-(2**63), -1, 0, 1, 2**31 - 1, 2**31, 2**62, 2**62 + 1, 2**63, 2**64, 10**30]


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["host_bytes", "disk_bytes", "num_workers"]),
       value=st.one_of(st.sampled_from(EXTREMES), st.integers(), st.floats(allow_nan=True), st.booleans()))
def test_constructor_integer_extremes_are_bounded(name, value):
    kw = dict(host_bytes=0, disk_bytes=0, disk_dir="/nonexistent-kv")
    kw[name] = value
    try:
        conn = TieredConnector(**kw)
    except (ValueError, TypeError) as err:
        assert f"TieredConnector: {name}=" in str(err)
        return
    assert isinstance(value, int) and not isinstance(value, bool)
    lo, hi = {"num_workers": (1, 256)}.get(name, (0, 2**62))
    assert lo <= value <= hi
    conn.shutdown()


@settings(max_examples=60, deadline=None)
@given(arg=st.sampled_from(["replica_idx", "block_id"]),
       value=st.one_of(st.sampled_from(EXTREMES), st.integers()))
def test_call_integer_extremes_raise_the_documented_error_state_unchanged(arg, value):
    params = make_params()
    conn = TieredConnector(host_bytes=4 * params.page_bytes())
    buf = np.zeros((8,) + params.page_shape, params.np_dtype)
    conn.attach([buf], params)
    hs, toks = chain(1)
    fill(buf, [1], 10)
    conn.offload([1], hs, toks).synchronize()
    before = (conn.metrics, conn.host_byte_count(), conn.tier_stats())
    ids, r = ([value], 0) if arg == "block_id" else ([2], value)
    ok = (arg == "block_id" and 1 <= value < 8) or (arg == "replica_idx" and value == 0)
    for call in (lambda: conn.load(ids, hs, toks, r), lambda: conn.offload(ids, hs, toks, r)):
        if ok:
            call().synchronize()
        else:
            with pytest.raises((IndexError, ValueError)) as info:
                call()
            assert ("block_ids[0]=" if arg == "block_id" else "replica_idx=") in str(info.value)
            assert (conn.metrics, conn.host_byte_count(), conn.tier_stats()) == before
    if arg == "replica_idx" and not ok:
        with pytest.raises(IndexError, match="replica_idx="):
            conn.lookup(hs, toks, value)
        with pytest.raises(IndexError, match="replica_idx="):
            conn.touch(hs, value)
    conn.shutdown()


def test_host_arena_that_cannot_be_allocated_is_a_value_error():
    params = make_params()

    class NoMemory(HostPageStore):
        def alloc_host(self, num_pages):
            raise MemoryError(f"Unable to allocate {num_pages} pages")

    conn = TieredConnector(host_bytes=2**62)
    with pytest.raises(ValueError, match=r"host_bytes=4611686018427387904 needs an arena"):
        conn.attach([NoMemory(np.zeros((8,) + params.page_shape, params.np_dtype))], params)
    assert conn.host_byte_count() == kvref.ByteCount(0, 0)
    conn.shutdown()


@pytest.mark.parametrize("value", [0, -1, 2**62 + 1, True, 1.5])
def test_bookkeeping_store_bounds(value):
    with pytest.raises((ValueError, TypeError), match="BookkeepingPageStore: num_pages="):
        BookkeepingPageStore(value, 64)


# --------------------------------------------------------------------------- page stores


class RecordingStore(HostPageStore):
    """A HostPageStore that logs every call (the tiers must use nothing else)."""

    def __init__(self, buffer):
        super().__init__(buffer)
        self.calls = []

    def read(self, block_ids):
        self.calls.append(("read", list(block_ids)))
        return super().read(block_ids)

    def write(self, block_ids, data):
        self.calls.append(("write", list(block_ids)))
        super().write(block_ids, data)

    def alloc_host(self, num_pages):
        self.calls.append(("alloc_host", num_pages))
        return super().alloc_host(num_pages)


def test_every_device_copy_goes_through_the_page_store(tmp_path):
    params = make_params()
    buf = np.zeros((16,) + params.page_shape, params.np_dtype)
    store = RecordingStore(buf)
    assert isinstance(store, PageStore)
    conn = TieredConnector(host_bytes=2 * params.page_bytes(), disk_bytes=32 * file_bytes(params),
                           disk_dir=tmp_path / "kv")
    conn.attach([store], params)
    assert store.calls == [("alloc_host", 2)]
    hs, toks = chain(3)
    fill(buf, [1, 2, 3], 11)
    conn.offload([1, 2, 3], hs, toks).synchronize()
    assert ("read", [1, 2, 3]) in store.calls
    conn.load([7, 8, 9], hs, toks).synchronize()  # host for two, disk for one
    writes = sorted(ids[0] for kind, ids in store.calls if kind == "write")
    assert writes == [7, 8, 9]
    assert buf[7:10].tobytes() == buf[1:4].tobytes()
    conn.shutdown()


# --------------------------------------------------------------------------- bookkeeping-only mode


def _ops(draw_ops, hs, toks):
    return [(op, i, j) for op, i, j in draw_ops]


def _run_sequence(conn, ops, hs, toks, buf=None):
    """Apply ``ops`` and return everything observable after each (byte counts, holdings, metrics)."""
    seen = []
    for op, a, n in ops:
        sl = slice(a, min(a + n, len(hs)))
        h, t = hs[sl], toks[sl]
        if not h:
            continue
        ids = list(range(1, 1 + len(h)))
        if op == "offload":
            if buf is not None:
                for b, hh in zip(ids, h):
                    buf[b].view(np.uint8).reshape(-1)[:] = np.frombuffer(hh * (buf[b].nbytes // 32 + 1), np.uint8)[: buf[b].nbytes]
            conn.offload(ids, h, t).synchronize()
        elif op == "load":
            try:
                conn.load(ids, h, t).synchronize()
            except KVLoadRefused:
                pass
        elif op == "touch":
            conn.touch(h)
        elif op == "reset":
            conn.reset_prefix_cache()
        conn.poll_transfers()
        for _ in range(1000):  # background promotions land (bytes mode)
            if conn.pending() == 0:
                break
            threading.Event().wait(0.002)
        conn.poll_transfers()
        m = conn.metrics
        seen.append((conn.lookup(hs, toks), conn.host_byte_count(), conn.disk_byte_count(),
                     [sorted(conn.held_in(x)) for x in hs],
                     (m.h2d_bytes_copied, m.d2h_bytes_copied, m.disk_bytes_written, m.disk_bytes_read,
                      m.connector_loads_refused, m.connector_offload_blocks_dropped)))
    return seen


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["offload", "offload", "load", "touch", "reset"]),
                              st.integers(0, 5), st.integers(1, 3)), min_size=1, max_size=12),
       policy=st.sampled_from(["write_through", "write_back"]), host=st.integers(0, 3), disk=st.integers(0, 4))
def test_bookkeeping_only_equals_real_bytes(tmp_path_factory, ops, policy, host, disk):
    """spec/tiers.md §11: same calls, same hits, counts and holdings, with and without bytes."""
    real_p, plan_p = make_params(), make_params(allocate_buffers=False)
    hs, toks = chain(6)
    root = tmp_path_factory.mktemp("bk")
    kw = dict(host_bytes=host * real_p.page_bytes(), disk_bytes=disk * file_bytes(real_p),
              disk_dir=root / "real", write_policy=policy)
    real = TieredConnector(**kw)
    buf = np.zeros((8,) + real_p.page_shape, real_p.np_dtype)
    real.attach([buf], real_p)
    plan = TieredConnector(**{**kw, "disk_dir": root / "plan"})
    plan.attach([BookkeepingPageStore(8, plan_p.page_bytes())], plan_p)
    assert _run_sequence(plan, ops, hs, toks) == _run_sequence(real, ops, hs, toks, buf)
    assert not (root / "plan").exists()  # no directory, no file
    assert plan._host.arena is None
    real.check_invariants()
    plan.check_invariants()
    real.shutdown()
    plan.shutdown()


def test_bookkeeping_only_a_terabyte_host_tier_costs_entries_only():
    params = make_params(allocate_buffers=False)
    conn = TieredConnector(host_bytes=1 << 40, disk_bytes=1 << 50, disk_dir="/nonexistent/never-created")
    conn.attach([BookkeepingPageStore(1 << 20, params.page_bytes())], params)
    total = (1 << 40) // params.page_bytes() * params.page_bytes()
    assert conn.host_byte_count() == kvref.ByteCount(total, total)
    hs, toks = chain(4)
    assert isinstance(conn.offload([1, 2, 3, 4], hs, toks), kvref.CompletedTransfer)
    assert conn.lookup(hs, toks) == 4
    assert conn.host_byte_count().free == total - 4 * params.page_bytes()
    assert conn.metrics.d2h_bytes_copied == 4 * params.page_bytes()
    assert not Path("/nonexistent").exists()
    conn.shutdown()


def test_bookkeeping_mode_refusals():
    params = make_params(allocate_buffers=False)
    conn = TieredConnector(host_bytes=1 << 20)
    with pytest.raises(ValueError, match="holds_bytes=True but params.allocate_buffers=False"):
        conn.attach([np.zeros((8,) + params.page_shape, params.np_dtype)], params)
    with pytest.raises(ValueError, match="disagree on holds_bytes"):
        conn.attach([BookkeepingPageStore(8, params.page_bytes()),
                     HostPageStore(np.zeros((8,) + params.page_shape, params.np_dtype))],
                    make_params(allocate_buffers=False, data_parallel_degree=2))
    with pytest.raises(ValueError, match=r"page_nbytes=7 != page bytes"):
        conn.attach([BookkeepingPageStore(8, 7)], params)
    with pytest.raises(RuntimeError, match="holds no page bytes"):
        BookkeepingPageStore(8, 64).read([1])
    conn.shutdown()


@pytest.mark.parametrize("where", ["metadata", "block"])
def test_fifo_never_hangs_manager_construction_alloc_or_shutdown(tmp_path, where):
    """Issue 11 (9), through the manager: a FIFO as the metadata file or as a block file."""
    params = make_params()

    def manager():
        conn = TieredConnector(host_bytes=0, disk_bytes=10**6, disk_dir=tmp_path / "kv")
        return conn, kvref.PagedKVCacheManager(params, num_blocks=16, max_batch_size=2, max_seq_len=60,
                                               connector=conn)

    conn, m = manager()
    ctx = kvref.TextContext("a", list(range(13)))
    m.claim(ctx)
    m.alloc(ctx).synchronize()
    ctx.update(0)
    m.step(ctx)
    m.release(ctx)
    m.shutdown()
    hs, toks = chain(3)
    if where == "metadata":
        (tmp_path / "kv" / METADATA_NAME).unlink()
        os.mkfifo(tmp_path / "kv" / METADATA_NAME)
        conn, m = run_with_timeout(manager)
        assert conn.tier_stats().files_rejected == 1 + 3 and conn.lookup(hs, toks) == 0
    else:
        conn, m = run_with_timeout(manager)
        block_path(tmp_path / "kv", hs[0]).unlink()
        os.mkfifo(block_path(tmp_path / "kv", hs[0]))
        ctx2 = kvref.TextContext("b", list(range(13)))
        m.claim(ctx2)
        handle = m.alloc(ctx2)
        with pytest.raises(KVLoadFailed, match="not a regular file"):
            run_with_timeout(handle.synchronize)
        m.poll_transfers()
        m.release(ctx2)
        assert not os.path.lexists(block_path(tmp_path / "kv", hs[0]))
    run_with_timeout(m.shutdown)


def test_a_real_arena_larger_than_physical_memory_is_refused_up_front():
    """Issue 11 (13)/16: --host-bytes 1TiB with real bytes is a clear ValueError, never MemoryError or OOM."""
    params = make_params()
    conn = TieredConnector(host_bytes=1 << 50)
    with pytest.raises(ValueError, match=r"host_bytes=1125899906842624 needs an arena of \d+ bytes > \d+ bytes of physical"):
        conn.attach([np.zeros((8,) + params.page_shape, params.np_dtype)], params)
    assert conn.host_byte_count() == kvref.ByteCount(0, 0)
    conn.shutdown()


def test_disk_dir_itself_may_be_a_link_to_a_volume(tmp_path):
    """The configured directory is trusted (a link to a mounted volume); only what is inside is not."""
    params = make_params()
    (tmp_path / "volume").mkdir()
    (tmp_path / "kv").symlink_to(tmp_path / "volume")
    conn, buf = disk_conn(tmp_path / "kv", params)
    hs, toks = chain(1)
    fill(buf, [1], 12)
    conn.offload([1], hs, toks).synchronize()
    conn.shutdown()
    assert block_path(tmp_path / "volume", hs[0]).is_file()
    fresh, _ = disk_conn(tmp_path / "kv", params)
    assert fresh.lookup(hs, toks) == 1
    fresh.shutdown()
