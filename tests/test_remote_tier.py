"""RemoteTier against real redis-server processes: a single node and a three-node cluster.

Servers come from ``_redis_servers`` (loopback ports, nothing persisted); the
tests skip with a stated reason only when no ``redis-server`` binary exists.
Timeouts here are generous (the CI machine is small and busy); the bound
itself is tested against a server that accepts and never answers.
"""

from __future__ import annotations

import doctest
import hashlib
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from _redis_servers import (  # noqa: F401  (fixtures)
    RedisNode,
    free_port,
    redis_own,
    redis_server,
    redis_shared,
    require_redis,
)
from kvref import _remote_tier
from kvref._remote_tier import FORMAT_VERSION, MAGIC, RemoteTier, RemoteTierMetrics, geometry_digest
from kvspec import KVCacheParams, LeafSpec
from kvspec.errors import KVLoadRefused
from kvspec.hashing import block_hashes

GEO = {"num_layers": 2, "kv_heads": 2, "head_dim": 8, "page_size": 4, "dtype": "float16"}
PAGE_BYTES = 2 * 2 * 4 * 2 * 8 * 2
TIMEOUT_S = 2.0


def chain(n: int, seed: int = 0, algo: str = "sha256", page_size: int = 4):
    """``n`` chained block hashes over random tokens, and the tokens as ``[n, page_size]``."""
    tokens = np.random.default_rng(seed).integers(0, 50_000, size=n * page_size, dtype=np.int32)
    return block_hashes(tokens, page_size, algo), tokens.reshape(n, page_size)


def payload_for(block_hash: bytes, size: int = PAGE_BYTES) -> bytes:
    """Deterministic K/V bytes of a block: whoever serves ``block_hash`` must return these."""
    out = b""
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(block_hash + counter.to_bytes(4, "little")).digest()
        counter += 1
    return out[:size]


def make_tier(url: str, geometry=GEO, algo: str | None = "sha256", **kw) -> RemoteTier:
    kw.setdefault("timeout_s", TIMEOUT_S)
    tier = RemoteTier(url, **kw)
    tier.bind(geometry, algo)
    return tier


def unused_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


# --------------------------------------------------------------------------- arguments


def test_constructor_errors():
    with pytest.raises(TypeError, match=r"RemoteTier: url type=int, must be a str"):
        RemoteTier(5)
    with pytest.raises(ValueError, match=r"scheme='http', must be 'redis' or 'redis\+cluster'"):
        RemoteTier("http://127.0.0.1:6379")
    with pytest.raises(ValueError, match=r"has no host"):
        RemoteTier("redis:///0")
    with pytest.raises(ValueError, match=r"port"):
        RemoteTier("redis://127.0.0.1:99999/0")
    with pytest.raises(ValueError, match=r"db='x', must be an integer in \[0, 99999\]"):
        RemoteTier("redis://127.0.0.1:6379/x")
    with pytest.raises(ValueError, match=r"db=2, must be 0 for redis\+cluster"):
        RemoteTier("redis+cluster://127.0.0.1:7000/2")
    with pytest.raises(ValueError, match=r"query or fragment"):
        RemoteTier("redis://127.0.0.1:6379/0?socket_timeout=9")
    with pytest.raises(ValueError, match=r"namespace='a:b', must be 1-64 characters"):
        RemoteTier("redis://h/0", namespace="a:b")
    with pytest.raises(ValueError, match=r"namespace='\{tag\}'"):
        RemoteTier("redis://h/0", namespace="{tag}")
    with pytest.raises(ValueError, match=r"namespace=''"):
        RemoteTier("redis://h/0", namespace="")
    with pytest.raises(ValueError, match=r"ttl_s=0.0, must be > 0"):
        RemoteTier("redis://h/0", ttl_s=0)
    with pytest.raises(ValueError, match=r"ttl_s=0.0001, must be >= 0.001"):
        RemoteTier("redis://h/0", ttl_s=0.0001)
    with pytest.raises(TypeError, match=r"ttl_s='1', must be a number of seconds"):
        RemoteTier("redis://h/0", ttl_s="1")
    with pytest.raises(ValueError, match=r"timeout_s=-1.0, must be > 0"):
        RemoteTier("redis://h/0", timeout_s=-1)
    with pytest.raises(ValueError, match=r"timeout_s=inf"):
        RemoteTier("redis://h/0", timeout_s=float("inf"))
    with pytest.raises(TypeError, match=r"timeout_s=True"):
        RemoteTier("redis://h/0", timeout_s=True)
    with pytest.raises(ValueError, match=r"reconnect_interval_s=-0.5, must be >= 0"):
        RemoteTier("redis://h/0", reconnect_interval_s=-0.5)


def test_url_forms():
    t = RemoteTier("redis://:secret@localhost")
    assert (t.is_cluster, t.url) == (False, "redis://:***@localhost")
    assert "secret" not in repr(t)
    assert "redis://localhost:6379/0" in repr(t)
    assert RemoteTier("redis://user:p%40ss@h:7/3").url == "redis://user:***@h:7/3"
    with pytest.raises(ValueError, match=r"url='redis://u:\*\*\*@h:1/x' db='x'") as info:
        RemoteTier("redis://u:hunter2@h:1/x")
    assert "hunter2" not in str(info.value)
    assert RemoteTier("redis+cluster://10.0.0.1:7000").is_cluster
    assert RemoteTier("redis+cluster://10.0.0.1:7000/0").is_cluster


def test_bind_errors_and_rebind():
    t = RemoteTier("redis://h/0")
    with pytest.raises(ValueError, match=r"RemoteTier.bind: hash_algo='md5', must be one of"):
        t.bind(GEO, "md5")
    with pytest.raises(ValueError, match=r"hash_algo=None, must be given with a geometry mapping"):
        t.bind(GEO)
    with pytest.raises(ValueError, match=r"geometry missing \['dtype'\]"):
        t.bind({k: v for k, v in GEO.items() if k != "dtype"}, "sha256")
    with pytest.raises(ValueError, match=r"geometry\['head_dim'\]=0, must be >= 1"):
        t.bind({**GEO, "head_dim": 0}, "sha256")
    with pytest.raises(TypeError, match=r"geometry\['num_layers'\]=2.0, must be an int"):
        t.bind({**GEO, "num_layers": 2.0}, "sha256")
    with pytest.raises(ValueError, match=r"geometry\['dtype'\]='int8', must be one of"):
        t.bind({**GEO, "dtype": "int8"}, "sha256")
    with pytest.raises(ValueError, match=r"geometry\['dtype'\]=5, must be one of"):
        t.bind({**GEO, "dtype": 5}, "sha256")
    with pytest.raises(TypeError, match=r"geometry=\[1, 2\], must be KVCacheParams or a mapping"):
        t.bind([1, 2], "sha256")
    with pytest.raises(ValueError, match=r"leaf_id=''"):
        t.bind(GEO, "sha256", leaf_id="")
    params = KVCacheParams(4, 2, 2, 8, leaves={"full": LeafSpec.full(), "rec": LeafSpec.recurrent((3,))})
    with pytest.raises(ValueError, match=r"leaf_id='rec' is a recurrent leaf"):
        t.bind(params, leaf_id="rec")
    with pytest.raises(ValueError, match=r"leaf_id='nope' not in params.leaves\(\)"):
        t.bind(params, leaf_id="nope")
    assert t.hash_algo is None and t.geometry_digest == b"" and t.page_bytes == 0
    t.bind(GEO, "sha256")
    t.bind(dict(GEO), "sha256")  # same geometry again: a no-op
    with pytest.raises(RuntimeError, match=r"already bound to hash_algo='sha256'"):
        t.bind({**GEO, "head_dim": 16}, "sha256")
    with pytest.raises(RuntimeError, match=r"already bound"):
        t.bind(GEO, "xxh3_128")
    assert (t.hash_algo, t.page_bytes, t.geometry_digest) == ("sha256", PAGE_BYTES, geometry_digest(GEO))


def test_geometry_digest_covers_every_field():
    base = geometry_digest(GEO)
    assert len(base) == 8
    params = KVCacheParams(page_size=4, num_layers=2, kv_heads=2, head_dim=8, dtype="float16")
    assert geometry_digest(params) == base
    assert geometry_digest({**GEO, "dtype": np.dtype(np.float16)}) == base
    variants = [{**GEO, "num_layers": 3}, {**GEO, "kv_heads": 4}, {**GEO, "head_dim": 16},
                {**GEO, "page_size": 8}, {**GEO, "dtype": "bfloat16"}]
    digests = {geometry_digest(v) for v in variants} | {geometry_digest(GEO, "swa")}
    assert base not in digests and len(digests) == len(variants) + 1


def test_key_format():
    t = make_tier("redis://h/0", namespace="prod-llama")
    h = bytes(range(32))
    assert t.key_for(h) == f"prod-llama:sha256:{geometry_digest(GEO).hex()}:{h.hex()}"
    assert len(geometry_digest(GEO).hex()) == 16


def test_method_errors_leave_state_unchanged():
    t = make_tier(unused_url(), reconnect_interval_s=60)
    hashes, rows = chain(3)
    before = t.metrics
    bad_calls = [
        (TypeError, r"RemoteTier.lookup: hashes type=bytes, must be a sequence of bytes", lambda: t.lookup(hashes[0])),
        (TypeError, r"RemoteTier.lookup: hashes\[1\] type=str, must be bytes", lambda: t.lookup([hashes[0], "x"])),
        (ValueError, r"RemoteTier.lookup: hashes\[0\] length=16, must be 32 \(sha256\)",
         lambda: t.lookup([hashes[0][:16]])),
        (ValueError, r"RemoteTier.get_many: tokens shape=\(2, 4\), must be \(3, 4\)",
         lambda: t.get_many(hashes, rows[:2])),
        (TypeError, r"RemoteTier.get_many: tokens dtype=float64, must be an integer type",
         lambda: t.get_many(hashes, rows.astype(float))),
        (ValueError, r"RemoteTier.put_many: tokens value out of int32 range",
         lambda: t.put_many(hashes, rows.astype(np.int64) + 2**31, [b"\0" * PAGE_BYTES] * 3)),
        (ValueError, r"RemoteTier.put_many: len\(payloads\)=2 but len\(hashes\)=3",
         lambda: t.put_many(hashes, rows, [b"\0" * PAGE_BYTES] * 2)),
        (ValueError, rf"RemoteTier.put_many: payloads\[1\] has 7 bytes, must be page_bytes={PAGE_BYTES}",
         lambda: t.put_many(hashes, rows, [b"\0" * PAGE_BYTES, b"1234567", b"\0" * PAGE_BYTES])),
        (TypeError, r"RemoteTier.put_many: payloads\[0\] type=int, must be bytes",
         lambda: t.put_many(hashes[:1], rows[:1], [5])),
        (TypeError, r"RemoteTier.put_many: payloads type=set, must be a sequence",
         lambda: t.put_many(hashes[:1], rows[:1], {b"x"})),
        (ValueError, r"RemoteTier.touch: hashes\[2\] length=31", lambda: t.touch([*hashes[:2], hashes[2][:31]])),
        (ValueError, r"RemoteTier.key_for: hashes\[0\] length=3", lambda: t.key_for(b"abc")),
    ]
    for exc, match, call in bad_calls:
        with pytest.raises(exc, match=match):
            call()
        assert t.metrics == before, match
    assert not t.connected


def test_unbound_and_closed_calls_raise():
    t = RemoteTier(unused_url())
    hashes, rows = chain(1)
    for call in (lambda: t.lookup(hashes), lambda: t.get_many(hashes, rows),
                 lambda: t.put_many(hashes, rows, [b"\0" * PAGE_BYTES]), lambda: t.touch(hashes),
                 lambda: t.key_for(hashes[0])):
        with pytest.raises(RuntimeError, match=r"not bound; call bind\(geometry, hash_algo\) first"):
            call()
    t.bind(GEO, "sha256")
    t.close()
    t.close()  # idempotent
    for call in (lambda: t.lookup(hashes), lambda: t.put_many(hashes, rows, [b"\0" * PAGE_BYTES]),
                 lambda: t.bind(GEO, "sha256")):
        with pytest.raises(RuntimeError, match=r"the tier is closed"):
            call()
    assert t.metrics == RemoteTierMetrics()


def test_metrics_snapshot_add_and_take():
    t = make_tier(unused_url(), reconnect_interval_s=60)
    hashes, rows = chain(2)
    assert t.lookup(hashes) == 0
    snap = t.metrics
    assert (snap.lookups, snap.lookup_blocks, snap.hits, snap.errors) == (1, 2, 0, 1)
    t.lookup(hashes)
    assert snap.lookups == 1  # a snapshot, not a live object
    taken = t.take_metrics()
    assert taken.lookups == 2 and t.metrics == RemoteTierMetrics()
    total = taken + snap
    assert total.lookups == 3 and total.as_dict()["lookup_blocks"] == 6


def test_docstring_examples_run():
    result = doctest.testmod(_remote_tier, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# --------------------------------------------------------------------------- a store that is not there


def test_unreachable_at_start_then_reconnects(tmp_path):
    require_redis()
    port = free_port()
    t = make_tier(f"redis://127.0.0.1:{port}/0", reconnect_interval_s=0.2)
    hashes, rows = chain(4, seed=3)
    data = [payload_for(h) for h in hashes]
    assert t.lookup(hashes) == 0
    with pytest.raises(KVLoadRefused, match=r"RemoteTier.get_many: store redis://127.0.0.1:\d+/0 unreachable"):
        t.get_many(hashes, rows)
    assert t.put_many(hashes, rows, data) == 0
    t.touch(hashes)
    m = t.metrics
    assert (m.loads_failed, m.offloads_dropped, m.connects, m.errors) == (1, 4, 0, 1)  # one attempt only
    assert "Connection" in t.last_error
    server = RedisNode(tmp_path, port=port)
    try:
        time.sleep(0.25)  # past reconnect_interval_s
        assert t.put_many(hashes, rows, data) == 4
        assert t.connected and t.metrics.connects == 1
        assert t.lookup(hashes) == 4
        assert t.get_many(hashes, rows) == data
    finally:
        server.stop()
        t.close()


class _SilentServer:
    """Accepts TCP connections and never answers: a hung Redis."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.conns.append(conn)

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize("scheme", ["redis", "redis+cluster"])
def test_hung_store_is_a_miss_and_is_not_retried_per_call(scheme):
    server = _SilentServer()
    try:
        t = make_tier(f"{scheme}://127.0.0.1:{server.port}", timeout_s=0.1, reconnect_interval_s=60)
        hashes, rows = chain(3)
        for _ in range(5):
            assert t.lookup(hashes) == 0
        with pytest.raises(KVLoadRefused, match=r"slower than timeout_s=0.1"):
            t.get_many(hashes, rows)
        assert t.put_many(hashes, rows, [payload_for(h) for h in hashes]) == 0
        t.touch(hashes)
        # Spec remote-tier §4: one connection attempt, then nothing until reconnect_interval_s passes.
        assert server.accepted == 1
        m = t.metrics
        assert (m.lookups, m.hits, m.loads_failed, m.offloads_dropped, m.errors, m.connects) == (5, 0, 1, 3, 1, 0)
        assert "Timeout" in t.last_error or "timed out" in t.last_error
        t.close()
    finally:
        server.close()


# --------------------------------------------------------------------------- a live store (single node and cluster)


def test_round_trip_and_leading_run(redis_server):
    t = make_tier(redis_server.url)
    hashes, rows = chain(6, seed=1)
    data = [payload_for(h) for h in hashes]
    assert t.lookup(hashes) == 0
    assert t.put_many(hashes[:4], rows[:4], data[:4]) == 4
    assert t.lookup(hashes) == 4
    assert t.get_many(hashes[:4], rows[:4]) == data[:4]
    assert t.put_many(hashes, rows, data) == 2  # the first four were present
    assert t.lookup(hashes) == 6
    with redis_server.raw() as raw:
        raw.delete(t.key_for(hashes[2]))
    assert t.lookup(hashes) == 2  # a gap ends the run
    assert t.lookup([]) == 0 and t.get_many([], np.zeros((0, 4), np.int32)) == []
    m = t.metrics
    assert (m.lookups, m.lookup_blocks, m.hits) == (4, 24, 12)
    assert (m.blocks_written, m.blocks_already_present, m.blocks_read) == (6, 4, 4)
    header = len(MAGIC) + 2 + 1 + 1 + 8 + 4 + 8 + 32 + 4 * 4 + 16
    assert m.bytes_written == 6 * (header + PAGE_BYTES) and m.bytes_read == 4 * (header + PAGE_BYTES)
    assert m.errors == 0 and m.time_s > 0
    t.close()


def test_value_layout_matches_spec_table(redis_server):
    """spec/remote-tier.md §2, byte for byte."""
    import struct

    import xxhash

    t = make_tier(redis_server.url)
    hashes, rows = chain(1, seed=11)
    payload = payload_for(hashes[0])
    assert t.put_many(hashes, rows, [payload]) == 1
    with redis_server.raw() as raw:
        value = raw.get(t.key_for(hashes[0]))
    d, p = 32, 4
    assert len(value) == 44 + d + 4 * p + PAGE_BYTES
    assert value[0:4] == MAGIC == b"KVRT"
    assert struct.unpack_from("<HBB", value, 4) == (FORMAT_VERSION, 1, d)
    assert value[8:16] == geometry_digest(GEO)
    assert struct.unpack_from("<IQ", value, 16) == (p, PAGE_BYTES)
    assert value[28 : 28 + d] == hashes[0]
    assert value[28 + d : 28 + d + 4 * p] == rows[0].astype("<i4").tobytes()
    head = 28 + d + 4 * p
    key = t.key_for(hashes[0]).encode()
    assert value[head : head + 16] == xxhash.xxh3_128(key + value[:head] + payload).digest()
    assert value[head + 16 :] == payload


def test_array_payloads_in_c_order(redis_server):
    params = KVCacheParams(page_size=4, num_layers=2, kv_heads=2, head_dim=8, dtype="bfloat16")
    t = make_tier(redis_server.url, params, None)
    assert t.hash_algo == "sha256" and t.page_bytes == PAGE_BYTES
    hashes, rows = chain(2, seed=2)
    blocks = np.random.default_rng(0).standard_normal((2, *params.page_shape)).astype(ml_dtypes.bfloat16)
    strided = np.asfortranarray(blocks[1])
    assert t.put_many(hashes, rows, [blocks[0], strided]) == 2
    got = t.get_many(hashes, rows)
    back = np.stack([np.frombuffer(g, dtype=ml_dtypes.bfloat16).reshape(params.page_shape) for g in got])
    assert back.tobytes() == blocks.tobytes()
    t.close()


def test_xxh3_128_round_trip(redis_server):
    t = make_tier(redis_server.url, algo="xxh3_128")
    hashes, rows = chain(3, seed=12, algo="xxh3_128")
    assert {len(h) for h in hashes} == {16}
    data = [payload_for(h) for h in hashes]
    assert t.put_many(hashes, rows, data) == 3
    assert t.lookup(hashes) == 3 and t.get_many(hashes, rows) == data
    assert t.key_for(hashes[0]).startswith("kvcache:xxh3_128:")
    with pytest.raises(ValueError, match=r"hashes\[0\] length=32, must be 16 \(xxh3_128\)"):
        t.lookup([bytes(32)])


def test_set_nx_first_writer_wins(redis_server):
    a, b = make_tier(redis_server.url), make_tier(redis_server.url)
    hashes, rows = chain(1, seed=4)
    assert a.put_many(hashes, rows, [b"\1" * PAGE_BYTES]) == 1
    assert b.put_many(hashes, rows, [b"\2" * PAGE_BYTES]) == 0
    assert b.metrics.blocks_already_present == 1
    assert b.get_many(hashes, rows) == [b"\1" * PAGE_BYTES]


_PROCESS = textwrap.dedent(
    """
    import sys
    import numpy as np
    from kvspec import KVCacheParams
    from kvspec.hashing import block_hashes
    from kvref._remote_tier import RemoteTier

    role, url, path = sys.argv[1:4]
    params = KVCacheParams(page_size=4, num_layers=2, kv_heads=2, head_dim=8, dtype="bfloat16")
    prompt = np.arange(1000, 1000 + 4 * 6 + 3, dtype=np.int32)   # six full blocks and a tail
    hashes = block_hashes(prompt, params.page_size, params.hash_algo)
    rows = prompt[: 4 * len(hashes)].reshape(len(hashes), 4)
    tier = RemoteTier(url, timeout_s=5.0)
    tier.bind(params)
    if role == "A":
        blocks = np.random.default_rng(7).standard_normal((len(hashes), *params.page_shape)).astype(params.np_dtype)
        written = tier.put_many(hashes, rows, list(blocks))
        open(path, "wb").write(blocks.tobytes())
        print(written)
    else:
        hit = tier.lookup(hashes)
        got = tier.get_many(hashes[:hit], rows[:hit])
        open(path, "wb").write(b"".join(got))
        print(hit)
    tier.close()
    """
)


def test_two_processes_share_blocks_byte_identical(redis_server, tmp_path):
    def run(role: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _PROCESS, role, redis_server.url, str(tmp_path / f"{role}.bin")],
            capture_output=True, text=True, timeout=120,
        )
        assert out.returncode == 0, out.stderr
        return int(out.stdout.strip())

    assert run("A") == 6
    assert run("B") == 6
    a, b = (tmp_path / "A.bin").read_bytes(), (tmp_path / "B.bin").read_bytes()
    assert len(a) == 6 * PAGE_BYTES and a == b


def test_docs_two_process_demo_runs(redis_server, tmp_path):
    """The script of docs/remote-tier.md, as printed there, in two processes."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "remote-tier.md").read_text()
    (script,) = re.findall(r"Save this as `share.py`:\n\n```python\n(.*?)```", page, re.S)
    (tmp_path / "share.py").write_text(script)

    def run(role: str) -> str:
        out = subprocess.run([sys.executable, "share.py", role, redis_server.url], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "A stored 8 blocks" in run("A")
    assert "B hit 8 of 8 blocks; K/V byte-identical to A's: True" in run("B")


def test_geometry_and_algorithm_isolation(redis_server):
    sha = make_tier(redis_server.url)
    other_geo = make_tier(redis_server.url, {**GEO, "kv_heads": 1, "head_dim": 16})  # same page bytes
    xxh = make_tier(redis_server.url, algo="xxh3_128")
    other_ns = make_tier(redis_server.url, namespace="another")
    hashes, rows = chain(3, seed=5)
    assert other_geo.page_bytes == sha.page_bytes
    assert sha.put_many(hashes, rows, [payload_for(h) for h in hashes]) == 3
    assert sha.lookup(hashes) == 3
    assert other_geo.lookup(hashes) == 0
    assert other_ns.lookup(hashes) == 0
    assert xxh.lookup([h[:16] for h in hashes]) == 0
    # A value copied under another geometry's or algorithm's key is refused by its header.
    with redis_server.raw() as raw:
        value = raw.get(sha.key_for(hashes[0]))
        raw.set(other_geo.key_for(hashes[0]), value)
        raw.set(xxh.key_for(hashes[0][:16]), value)
    assert other_geo.lookup(hashes[:1]) == 1
    with pytest.raises(KVLoadRefused, match=r"geometry digest=\w+ but expected"):
        other_geo.get_many(hashes[:1], rows[:1])
    with pytest.raises(KVLoadRefused, match=r"hash algorithm id=1 \(digest 32 B\) but expected 'xxh3_128'"):
        xxh.get_many([hashes[0][:16]], rows[:1])
    assert other_geo.metrics.loads_refused == 1 and xxh.metrics.loads_refused == 1


def _flip(offset_from_end: int):
    def edit(value: bytes) -> bytes:
        i = len(value) - offset_from_end
        return value[:i] + bytes([value[i] ^ 0x40]) + value[i + 1 :]

    return edit


_HEADER_AT = {"version": 4, "page_size": 16, "length": 20, "block_hash": 28, "tokens": 60, "checksum": 76}


def _poke(field: str, byte: int = 0x01):
    def edit(value: bytes) -> bytes:
        i = _HEADER_AT[field]
        return value[:i] + bytes([value[i] ^ byte]) + value[i + 1 :]

    return edit


@pytest.mark.parametrize(
    "edit, reason",
    [
        (_flip(1), r"checksum=\w+ but computed"),                      # last payload byte
        (_flip(PAGE_BYTES), r"checksum=\w+ but computed"),             # first payload byte
        (lambda v: v[:-10], r"value length=\d+ but header says \d+ \(truncated or padded\)"),
        (lambda v: v[:20], r"value length=20 < fixed header 28"),
        (lambda v: v + b"\0", r"value length=\d+ but header says \d+ \(truncated or padded\)"),
        (lambda v: b"", r"value length=0 < fixed header"),
        (lambda v: b"hello world, not a block" * 4, r"magic=b'hell' but expected b'KVRT'"),
        (_poke("version", 0x04), r"format version=6 but expected 2"),
        (_poke("page_size"), r"tokens per block=5 but expected 4"),
        (_poke("length"), r"payload length=\d+ but expected page_bytes"),
        (_poke("block_hash"), r"stored block hash=\w+… differs"),
        (_poke("tokens"), r"stored token ids differ"),
        (_poke("checksum"), r"checksum=\w+ but computed"),
    ],
    ids=["payload-last", "payload-first", "truncated", "short-header", "padded", "empty", "garbage",
         "version", "page-size", "length", "block-hash", "tokens", "checksum"],
)
def test_corrupted_or_truncated_value_refused(redis_server, edit, reason):
    t = make_tier(redis_server.url)
    hashes, rows = chain(3, seed=6)
    data = [payload_for(h) for h in hashes]
    assert t.put_many(hashes, rows, data) == 3
    key = t.key_for(hashes[1])
    with redis_server.raw() as raw:
        raw.set(key, edit(raw.get(key)))
    assert t.lookup(hashes) == 3  # lookups do not read values; loads verify them
    with pytest.raises(KVLoadRefused, match=r"RemoteTier.get_many: hashes\[1\]=\w+… " + reason) as info:
        t.get_many(hashes, rows)
    assert info.value.block_hash == hashes[1]
    assert t.get_many(hashes[:1], rows[:1]) == data[:1]
    m = t.metrics
    assert (m.loads_refused, m.loads_failed, m.blocks_read) == (1, 0, 1)


def test_value_under_another_hash_or_tokens_refused(redis_server):
    t = make_tier(redis_server.url)
    hashes, rows = chain(2, seed=7)
    assert t.put_many(hashes, rows, [payload_for(h) for h in hashes]) == 2
    with redis_server.raw() as raw:
        raw.set(t.key_for(hashes[1]), raw.get(t.key_for(hashes[0])))
    with pytest.raises(KVLoadRefused, match=r"hashes\[1\]=\w+… stored block hash=\w+… differs"):
        t.get_many(hashes, rows)
    other_rows = rows.copy()
    other_rows[0, 3] += 1  # a colliding hash with other tokens is refused, never served
    with pytest.raises(KVLoadRefused, match=r"hashes\[0\]=\w+… stored token ids differ"):
        t.get_many(hashes[:1], other_rows[:1])
    assert t.metrics.loads_refused == 2


def test_value_gone_after_lookup_refused(redis_server):
    t = make_tier(redis_server.url)
    hashes, rows = chain(2, seed=8)
    assert t.put_many(hashes, rows, [payload_for(h) for h in hashes]) == 2
    assert t.lookup(hashes) == 2
    with redis_server.raw() as raw:
        raw.delete(t.key_for(hashes[1]))  # evicted between lookup and load
    with pytest.raises(KVLoadRefused, match=r"hashes\[1\]=\w+… not in the store \(evicted or expired"):
        t.get_many(hashes, rows)
    assert t.metrics.loads_refused == 1


def test_ttl_expiry_and_touch(redis_server):
    hashes, rows = chain(2, seed=9)
    data = [payload_for(h) for h in hashes]
    short = make_tier(redis_server.url, ttl_s=1.0)
    assert short.put_many(hashes[:1], rows[:1], data[:1]) == 1
    with redis_server.raw() as raw:
        assert 0 < raw.pttl(short.key_for(hashes[0])) <= 1000
    assert short.lookup(hashes[:1]) == 1
    time.sleep(1.2)
    assert short.lookup(hashes[:1]) == 0
    # touch refreshes the TTL to ttl_s
    long = make_tier(redis_server.url, ttl_s=600)
    assert long.put_many(hashes[1:], rows[1:], data[1:]) == 1
    with redis_server.raw() as raw:
        key = long.key_for(hashes[1])
        raw.pexpire(key, 5_000)
        long.touch(hashes)  # the missing first block is ignored
        assert raw.pttl(key) > 500_000
    # without a TTL, values persist until Redis evicts them
    keep = make_tier(redis_server.url)
    assert keep.put_many(hashes[:1], rows[:1], data[:1]) == 1
    keep.touch(hashes[:1])
    with redis_server.raw() as raw:
        assert raw.pttl(keep.key_for(hashes[0])) == -1
    assert keep.metrics.errors == long.metrics.errors == 0


def test_concurrent_threads(redis_server):
    t = make_tier(redis_server.url)
    chains = [chain(5, seed=100 + i) for i in range(4)]
    errors: list[BaseException] = []

    def worker(hashes, rows):
        try:
            for _ in range(5):
                t.put_many(hashes, rows, [payload_for(h) for h in hashes])
                n = t.lookup(hashes)
                assert n == 5
                assert t.get_many(hashes, rows) == [payload_for(h) for h in hashes]
        except BaseException as e:  # collected for the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=c) for c in chains]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    m = t.metrics
    assert (m.blocks_written, m.blocks_already_present, m.lookups, m.hits) == (20, 80, 20, 100)


def test_cluster_lookups_independent_of_slot_placement(redis_server):
    if redis_server.kind != "cluster":
        pytest.skip("slot placement exists only in a Redis Cluster")
    import redis
    from redis.cluster import key_slot

    t = make_tier(redis_server.url)
    hashes, rows = chain(24, seed=10)
    data = [payload_for(h) for h in hashes]
    assert t.put_many(hashes, rows, data) == 24
    slots = [key_slot(t.key_for(h).encode()) for h in hashes]
    owners = [redis_server.slot_owner(s) for s in slots]
    assert set(owners) == set(redis_server.ports)  # the chain spans every node
    assert t.lookup(hashes) == 24
    # Reshard: move the first block's slot, with its key, to another node.
    slot, src = slots[0], owners[0]
    dst = next(p for p in redis_server.ports if p != src)

    def node(p):
        return redis.Redis(host="127.0.0.1", port=p, socket_timeout=5)

    ids = {p: node(p).execute_command("CLUSTER", "MYID").decode() for p in redis_server.ports}
    node(dst).execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
    node(src).execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
    keys = node(src).execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
    node(src).execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *keys)
    for p in redis_server.ports:
        node(p).execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
    assert redis_server.slot_owner(slot) == dst
    assert t.lookup(hashes) == 24
    assert t.get_many(hashes, rows) == data
    assert t.metrics.errors == 0


def test_hung_store_mid_run_is_a_miss_then_recovers(redis_server):
    """A live server stops answering (SIGSTOP) while connected: calls return
    misses within the bound, then hits resume once it answers again."""
    t = make_tier(redis_server.url, timeout_s=0.5, reconnect_interval_s=1.0)
    hashes, rows = chain(4, seed=300)
    data = [payload_for(h) for h in hashes]
    more, more_rows = chain(2, seed=301)
    assert t.put_many(hashes, rows, data) == 4 and t.lookup(hashes) == 4
    redis_server.pause()
    try:
        assert t.lookup(hashes) == 0  # times out once; the tier pauses its I/O
        with pytest.raises(KVLoadRefused, match=r"unreachable or slower than timeout_s=0.5"):
            t.get_many(hashes, rows)
        assert t.put_many(more, more_rows, [payload_for(h) for h in more]) == 0
        assert not t.connected
    finally:
        redis_server.resume()
    time.sleep(1.05)  # past reconnect_interval_s
    assert t.lookup(hashes) == 4
    assert t.get_many(hashes, rows) == data
    m = t.metrics
    assert (m.errors, m.loads_failed, m.offloads_dropped, m.connects) == (1, 1, 2, 2)
    assert "Timeout" in t.last_error or "timed out" in t.last_error


# --------------------------------------------------------------------------- a store that dies and returns


def test_server_killed_and_restarted_mid_sequence(redis_own):
    """Requests keep coming while the store dies and returns: never an
    exception, never wrong bytes, misses while down, hits again after."""
    t = make_tier(redis_own.url, reconnect_interval_s=0.2)
    prompts = [chain(4, seed=200 + i % 5) for i in range(30)]  # five prompts, each seen six times
    hits = []
    for i, (hashes, rows) in enumerate(prompts):
        if i == 10:
            redis_own.kill()
        if i == 20:
            redis_own.restart()
            time.sleep(0.25)  # past reconnect_interval_s
        n = t.lookup(hashes)
        if n:
            try:
                got = t.get_many(hashes[:n], rows[:n])
            except KVLoadRefused:
                got = []
            assert got in ([], [payload_for(h) for h in hashes[:n]])
        t.put_many(hashes, rows, [payload_for(h) for h in hashes])
        t.touch(hashes)
        hits.append(n)
    assert hits[:5] == [0] * 5 and hits[5:10] == [4] * 5  # written, then served
    assert hits[10:20] == [0] * 10  # down: misses
    assert hits[20:25] == [0] * 5 and hits[25:] == [4] * 5  # restarted empty, refilled, served
    m = t.metrics
    assert m.offloads_dropped == 10 * 4
    assert m.connects == 2 and m.errors >= 1
    assert m.hits == 10 * 4 and m.loads_refused == 0
    assert t.connected
    t.close()
