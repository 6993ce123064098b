"""Issue 11, remote-tier security: authenticated values, no prompt in clear,
model and namespace separation, hostile values, redacted URLs, IPv6 hosts,
bounded numbers. Against real redis-server processes (skipped without one).
"""

from __future__ import annotations

import math
import os
import re
import struct

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from _redis_servers import RedisNode, free_port, require_redis, start
from kvref import KVCacheParams, KVLoadFailed, KVLoadRefused, TieredConnector
from kvref._remote_tier import (
    AUTH_FORMAT_VERSION,
    FORMAT_VERSION,
    MAX_TTL_S,
    RemoteTier,
    redact_url,
)
from kvspec.hashing import block_hashes

PS = 4
GEO = {"num_layers": 2, "kv_heads": 2, "head_dim": 8, "page_size": PS, "dtype": "float16"}
PAGE_BYTES = 2 * 2 * PS * 2 * 8 * 2
SECRET = b"0123456789abcdef0123456789abcdef"
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    servers = start("single", tmp_path_factory.mktemp("redis-sec"))
    yield servers
    servers.stop()


@pytest.fixture
def server(redis):
    redis.flush()
    return redis


def chain(n: int, seed: int = 0):
    toks = np.random.default_rng(seed).integers(0, 50_000, size=n * PS, dtype=np.int32)
    return block_hashes(toks, PS), toks.reshape(n, PS)


def payload_for(h: bytes) -> bytes:
    return (h * (PAGE_BYTES // len(h) + 1))[:PAGE_BYTES]


def tier(url: str, geometry=GEO, **kw) -> RemoteTier:
    kw.setdefault("timeout_s", 2.0)
    t = RemoteTier(url, **kw)
    t.bind(geometry, "sha256")
    return t


# --------------------------------------------------------------------------- authenticated values


def test_secret_values_round_trip_and_store_no_prompt(server):
    t = tier(server.url, secret=SECRET)
    hs, rows = chain(3, seed=1)
    assert t.authenticated and "SECRET" not in repr(t) and SECRET.decode() not in repr(t)
    assert t.put_many(hs, rows, [payload_for(h) for h in hs]) == 3
    assert t.get_many(hs, rows) == [payload_for(h) for h in hs]
    with server.raw() as raw:
        value = raw.get(t.key_for(hs[0]))
    assert struct.unpack_from("<H", value, 4) == (AUTH_FORMAT_VERSION,)
    assert rows[0].astype("<i4").tobytes() not in value  # the prompt's token ids are not stored
    for k in range(PS):
        assert int(rows[0][k]).to_bytes(4, "little") not in value[: len(value) - PAGE_BYTES]
    # another block's tokens under the same hash (a collision) are refused
    with pytest.raises(KVLoadRefused, match="token ids differ"):
        t.get_many(hs[:1], rows[1:2])


def _plain_forgery(key: str, h: bytes, tokens: np.ndarray, payload: bytes, geo: bytes) -> bytes:
    """What an attacker without the secret can write: a well-formed plain value."""
    head = struct.pack("<4sHBB8sIQ", b"KVRT", FORMAT_VERSION, 1, 32, geo, PS, len(payload)) + h
    head += tokens.astype("<i4").tobytes()
    c = xxhash.xxh3_128(key.encode())
    c.update(head)
    c.update(payload)
    return head + c.digest() + payload


def test_without_a_secret_anyone_who_can_write_can_poison(server):
    """Documented (spec/remote-tier.md §2): the plain checksum stops accidents, not forgery."""
    t = tier(server.url)
    hs, rows = chain(1, seed=2)
    evil = b"\x66" * PAGE_BYTES
    with server.raw() as raw:
        raw.set(t.key_for(hs[0]), _plain_forgery(t.key_for(hs[0]), hs[0], rows[0], evil, t.geometry_digest))
    assert t.get_many(hs, rows) == [evil]


def test_with_a_secret_a_forgery_is_never_loaded(server):
    t = tier(server.url, secret=SECRET)
    hs, rows = chain(1, seed=3)
    key = t.key_for(hs[0])
    evil = b"\x66" * PAGE_BYTES
    with server.raw() as raw:
        raw.set(key, _plain_forgery(key, hs[0], rows[0], evil, t.geometry_digest))
    with pytest.raises(KVLoadRefused, match="unauthenticated value"):
        t.get_many(hs, rows)
    # a value written with another secret
    other = tier(server.url, secret=b"another secret of 32 bytes......", namespace="kvcache")
    with server.raw() as raw:
        raw.delete(key)
    other.put_many(hs, rows, [evil])
    with pytest.raises(KVLoadRefused, match="authentication tag does not match"):
        t.get_many(hs, rows)
    m = t.metrics
    assert m.auth_failures == 2 and m.loads_refused == 2
    # a reader without the secret refuses authenticated values as well
    plain = tier(server.url)
    with pytest.raises(KVLoadRefused, match="has no remote_secret"):
        plain.get_many(hs, rows)
    assert plain.metrics.auth_failures == 1


@FUZZ
@given(data=st.data())
def test_hostile_values_are_refused(server, data):
    """Any edit of a stored value, with or without a secret: a flipped bit
    anywhere, truncation, extension, a payload swapped in from another block,
    a value replayed under another block's key, another namespace's or another
    model's. (A deliberate forgery without a secret is the documented hole:
    test_without_a_secret_anyone_who_can_write_can_poison.)"""
    server.flush()  # every example starts from an empty store (SET NX keeps old values)
    secret = data.draw(st.sampled_from([None, SECRET]), label="secret")
    t = tier(server.url, secret=secret)
    hs, rows = chain(2, seed=4)
    assert t.put_many(hs, rows, [payload_for(h) for h in hs]) == 2
    with server.raw() as raw:
        v0, v1 = raw.get(t.key_for(hs[0])), raw.get(t.key_for(hs[1]))
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "swap_payload", "replay_other_block",
                                      "other_namespace", "other_model"]), label="kind")
    target_tier, target_hash, target_rows = t, hs[0], rows[:1]
    if kind == "flip":
        i = data.draw(st.integers(0, len(v0) - 1), label="byte")
        bit = data.draw(st.integers(0, 7), label="bit")
        value = v0[:i] + bytes([v0[i] ^ (1 << bit)]) + v0[i + 1:]
    elif kind == "truncate":
        value = v0[: data.draw(st.integers(0, len(v0) - 1), label="length")]
    elif kind == "extend":
        value = v0 + data.draw(st.binary(min_size=1, max_size=64), label="tail")
    elif kind == "swap_payload":
        value = v0[: len(v0) - PAGE_BYTES] + v1[len(v1) - PAGE_BYTES:]
    elif kind == "replay_other_block":
        value = v1
    elif kind == "other_namespace":
        target_tier = tier(server.url, secret=secret, namespace="tenant-b")
        value = v0
    else:
        target_tier = tier(server.url, {**GEO, "model_id": "finetune"}, secret=secret)
        value = v0
    with server.raw() as raw:
        raw.set(target_tier.key_for(target_hash), value)
    before = target_tier.metrics.loads_refused
    with pytest.raises(KVLoadRefused):
        target_tier.get_many([target_hash], target_rows)
    assert target_tier.metrics.loads_refused == before + 1


def test_replay_across_models_and_namespaces_refused_without_a_secret(server):
    base = tier(server.url)
    tuned = tier(server.url, {**GEO, "model_id": "finetune"})
    other_ns = tier(server.url, namespace="tenant-b")
    hs, rows = chain(1, seed=5)
    base.put_many(hs, rows, [payload_for(hs[0])])
    assert tuned.lookup(hs) == 0 and other_ns.lookup(hs) == 0  # other keys: never a hit
    with server.raw() as raw:
        value = raw.get(base.key_for(hs[0]))
        raw.set(tuned.key_for(hs[0]), value)
        raw.set(other_ns.key_for(hs[0]), value)
    with pytest.raises(KVLoadRefused, match="geometry digest"):
        tuned.get_many(hs, rows)
    with pytest.raises(KVLoadRefused, match="checksum"):
        other_ns.get_many(hs, rows)


def test_connector_with_secret_through_two_managers(server, monkeypatch):
    """End to end: a manager writes through an authenticated tier; another with the
    same secret (from an environment variable) hits; a forged value fails the load."""
    from kvref import PagedKVCacheManager, TextContext

    monkeypatch.setenv("KV_TEST_SECRET", SECRET.decode())
    params = KVCacheParams(page_size=PS, num_layers=1, kv_heads=1, head_dim=2, dtype="float32", model_id="m")

    def run(name, secret="KV_TEST_SECRET"):
        conn = TieredConnector(host_bytes=0, remote_url=server.url, remote_timeout_s=2.0, remote_secret=secret)
        m = PagedKVCacheManager(params, num_blocks=16, max_batch_size=2, max_seq_len=60, connector=conn)
        ctx = TextContext(name, list(range(100, 113)))
        m.claim(ctx)
        try:
            m.alloc(ctx).synchronize()
        except KVLoadFailed:
            pass
        m.poll_transfers()
        hit = ctx.cached_prefix_external_length
        buf = m.get_device_buffer(0)
        rows = m.get_req_blocks_per_leaf(ctx)["full"]
        buf[list(rows[:3])] = 1.5
        ctx.update(0)
        m.step(ctx)
        failures = m.get_metrics_aggregated().connector_load_failures
        m.release(ctx)
        m.shutdown()
        return hit, conn.remote_metrics(), failures

    assert run("a")[:3:2] == (0, 0)
    assert run("b")[:3:2] == (12, 0)
    _, metrics, failures = run("c", secret=b"a different secret, 32 bytes...")
    assert metrics.auth_failures == 1 and failures == 1  # the load failed: the pages were never published


@pytest.mark.parametrize(
    "secret, exc, text",
    [
        (b"short", ValueError, r"secret from remote_secret has 5 bytes, must be >= 16"),
        ("KV_TEST_UNSET_VARIABLE", ValueError, r"environment variable 'KV_TEST_UNSET_VARIABLE', which is not set"),
        ("not a name", ValueError, r"must name an environment variable"),
        (12345, TypeError, r"secret type=int"),
    ],
)
def test_secret_validation(secret, exc, text, monkeypatch):
    monkeypatch.delenv("KV_TEST_UNSET_VARIABLE", raising=False)
    with pytest.raises(exc, match=text):
        RemoteTier("redis://127.0.0.1:1/0", secret=secret)
    with pytest.raises(ValueError, match="remote_secret given without remote_url"):
        TieredConnector(host_bytes=0, remote_secret=SECRET)


def test_short_secret_from_the_environment_is_not_echoed(monkeypatch):
    monkeypatch.setenv("KV_TEST_SHORT", "hunter2")
    with pytest.raises(ValueError) as info:
        RemoteTier("redis://127.0.0.1:1/0", secret="KV_TEST_SHORT")
    assert "hunter2" not in str(info.value) and "KV_TEST_SHORT" in str(info.value)


# --------------------------------------------------------------------------- (8) URLs


PASSWORDS = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126, blacklist_characters="%#?"),
                    min_size=6, max_size=24).filter(lambda p: not p.startswith("/"))


@settings(max_examples=60, deadline=None)
@given(password=PASSWORDS, user=st.sampled_from(["", "default", "svc"]),
       tail=st.sampled_from(["127.0.0.1:1/0", "127.0.0.1:99999/0", "127.0.0.1:1/x", "127.0.0.1:1/0?a=1",
                             "[::1]:1/0", "[zz]:1/0", "", "h:1/0#frag", "h:" + "9" * 40 + "/0",
                             "h:1/" + "9" * 400, "h:-1/0"]))
def test_password_never_appears_in_messages_or_repr(password, user, tail):
    assume(password not in tail and "***" not in password)
    url = f"redis://{user}:{password}@{tail}"
    shown = redact_url(url)
    prefix = f"redis://{user}:***@"
    assert shown.startswith(prefix) and password not in shown[len(prefix):]
    texts = []
    try:
        t = RemoteTier(url, timeout_s=0.05)
        texts += [repr(t), t.url]
        t.close()
    except (ValueError, TypeError) as err:
        texts.append(str(err))
    try:
        conn = TieredConnector(host_bytes=0, remote_url=url, remote_timeout_s=0.05)
        texts += [repr(conn), str(conn.remote_metrics().as_dict())]
        conn.shutdown()
    except (ValueError, TypeError) as err:
        texts.append(str(err))
    for text in texts:
        scrubbed = text.replace(f"redis://{user}:***@", "")
        assert password not in scrubbed, (url, text)


def test_redaction_examples():
    assert redact_url("redis://:PASSWORD@host:6379/0") == "redis://:***@host:6379/0"
    assert redact_url("redis://user:p@ss/w:rd@host/0") == "redis://user:***@host/0"
    assert redact_url("redis://secret@host") == "redis://***@host"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"


def test_password_server_and_a_wrong_password_never_leak(tmp_path):
    require_redis()
    node = RedisNode(tmp_path / "pw", password="s3cr@t/pa:ss")
    try:
        port = node.ports[0]
        good = tier(f"redis://:s3cr%40t%2Fpa%3Ass@127.0.0.1:{port}/0")
        hs, rows = chain(1, seed=6)
        assert good.put_many(hs, rows, [payload_for(hs[0])]) == 1
        assert good.lookup(hs) == 1
        bad = tier(f"redis://:wrong-pass-123@127.0.0.1:{port}/0")
        assert bad.lookup(hs) == 0 and bad.metrics.errors == 1
        for text in (bad.last_error or "", repr(bad), bad.url, str(bad.metrics.as_dict())):
            assert "wrong-pass-123" not in text and "s3cr" not in text
        good.close()
        bad.close()
    finally:
        node.stop()


def test_ipv6_literal_host(tmp_path):
    require_redis()
    node = RedisNode(tmp_path / "v6", bind="127.0.0.1 ::1")
    try:
        t = tier(f"redis://[::1]:{node.ports[0]}/0")
        assert t.url == f"redis://[::1]:{node.ports[0]}/0" and "[::1]" in repr(t)
        hs, rows = chain(2, seed=7)
        assert t.put_many(hs, rows, [payload_for(h) for h in hs]) == 2
        assert t.get_many(hs, rows) == [payload_for(h) for h in hs]
        t.close()
    finally:
        node.stop()


# --------------------------------------------------------------------------- (19b) bounded numbers


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(["ttl_s", "timeout_s", "reconnect_interval_s"]),
       value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(min_value=-(10**30), max_value=10**30),
                       st.sampled_from([1e17, 2**63, 2**64, -0.0, 5e-324, True, "1", None])))
def test_remote_numbers_are_bounded(name, value):
    bounds = {"ttl_s": (0.001, MAX_TTL_S), "timeout_s": (0.001, 3600.0), "reconnect_interval_s": (0.0, 86400.0)}
    if name == "ttl_s" and value is None:
        return  # None: no expiry (the default)
    try:
        t = RemoteTier("redis://127.0.0.1:1/0", **{name: value})
    except (ValueError, TypeError) as err:
        assert f"RemoteTier: {name}=" in str(err)
        return
    lo, hi = bounds[name]
    assert not isinstance(value, bool) and math.isfinite(float(value)) and lo <= float(value) <= hi
    t.close()


def test_ttl_1e17_is_refused_and_the_largest_ttl_works(server):
    with pytest.raises(ValueError, match=r"ttl_s=1e\+17, must be <= 4\.29497e\+09"):
        RemoteTier(server.url, ttl_s=1e17)
    with pytest.raises(ValueError, match=r"remote|ttl_s=1e\+17"):
        TieredConnector(host_bytes=0, remote_url=server.url, remote_ttl_s=1e17)
    t = tier(server.url, ttl_s=MAX_TTL_S)
    hs, rows = chain(1, seed=8)
    assert t.put_many(hs, rows, [payload_for(hs[0])]) == 1 and t.metrics.offloads_dropped == 0
    t.touch(hs)
    assert t.metrics.errors == 0 and t.lookup(hs) == 1
    with server.raw() as raw:
        assert raw.pttl(t.key_for(hs[0])) > 0
    t.close()


def test_unused_port_url_is_a_miss_not_an_error():
    t = tier(f"redis://:pw-never-shown@127.0.0.1:{free_port()}/0", timeout_s=0.05)
    assert t.lookup(chain(1)[0]) == 0 and "pw-never-shown" not in (t.last_error or "")
    assert re.match(r"redis://127\.0\.0\.1:\d+/0", t._redacted_url())
    t.close()


def test_bookkeeping_only_remote_shares_hits_stores_no_kv(server):
    """spec/remote-tier.md §8: planning processes share lookups through header-only values."""
    from kvspec import BookkeepingPageStore

    params = KVCacheParams(page_size=PS, num_layers=2, kv_heads=2, head_dim=8, allocate_buffers=False)
    hs, rows = chain(3, seed=9)

    def conn(secret=None):
        c = TieredConnector(host_bytes=0, remote_url=server.url, remote_timeout_s=2.0, remote_secret=secret)
        c.attach([BookkeepingPageStore(8, params.page_bytes())], params)
        return c

    a = conn()
    a.offload([1, 2, 3], hs, rows)
    b = conn()
    assert b.lookup(hs, rows) == 3
    b.load([4, 5, 6], hs, rows).synchronize()
    assert b.metrics.h2d_bytes_copied == 3 * params.page_bytes()
    with server.raw() as raw:
        keys = sorted(k.decode() for k in raw.keys("*"))
        assert len(keys) == 3 and all(":plan:" in k for k in keys)
        assert all(len(raw.get(k)) < params.page_bytes() for k in keys)  # headers only
    # a real-bytes reader never sees planning entries
    real = RemoteTier(server.url, timeout_s=2.0)
    real.bind(KVCacheParams(page_size=PS, num_layers=2, kv_heads=2, head_dim=8))
    assert real.lookup(hs) == 0
    for c in (a, b):
        c.shutdown()
    real.close()
