"""The hash chain (spec/hashing.md, DESIGN §6)."""

import hashlib

import numpy as np
import pytest
import xxhash

from kvspec import hashing


def test_root_hash_bytes_pinned():
    # Spec hashing §1: root = sha256(b"kvcache/v1" + seed(8, little) + salt)
    assert hashing.root_hash(0) == hashlib.sha256(b"kvcache/v1" + bytes(8)).digest()
    assert hashing.root_hash(7, "a") == hashlib.sha256(b"kvcache/v1" + (7).to_bytes(8, "little") + b"a").digest()
    assert hashing.root_hash(0, "é") == hashing.root_hash(0, "é".encode())
    assert hashing.root_hash(0, "x") != hashing.root_hash(0, "y")


@pytest.mark.parametrize("algo", ["sha256", "xxh3_128"])
def test_chain_matches_definition(algo):
    toks = np.arange(10, dtype=np.int64)
    hs = hashing.block_hashes(toks, 4, algo)
    assert len(hs) == 2
    h = hashing.root_hash()
    for i in range(2):
        data = h + np.asarray(toks[4 * i : 4 * i + 4], dtype="<i4").tobytes()
        h = hashlib.sha256(data).digest() if algo == "sha256" else xxhash.xxh3_128_digest(data)
        assert hs[i] == h
    assert len(hs[0]) == hashing.digest_size(algo)
    # incremental extension gives the same chain
    assert hashing.block_hashes(toks[4:], 4, algo, parent=hs[0]) == hs[1:]


def test_golden_sha256_chain():
    # Pinned bytes: a backend in another language must reproduce these.
    hs = hashing.block_hashes(list(range(8)), 4)
    assert hs[1].hex() == hashlib.sha256(hs[0] + np.arange(4, 8, dtype="<i4").tobytes()).hexdigest()
    assert hs[1].hex().startswith("18a2b45fe3486043")


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: hashing.root_hash(-1), ValueError, "hash_seed=-1"),
        (lambda: hashing.root_hash(2**64), ValueError, "hash_seed="),
        (lambda: hashing.root_hash(1.5), TypeError, "hash_seed=1.5"),
        (lambda: hashing.root_hash(0, 5), TypeError, "cache_salt=5"),
        (lambda: hashing.block_hashes([1, 2], 0), ValueError, "block_size=0"),
        (lambda: hashing.block_hashes([1, 2], 1, "md5"), ValueError, "hash_algo='md5'"),
        (lambda: hashing.block_hashes([2**31], 1), ValueError, "int32"),
        (lambda: hashing.block_hashes([1.5], 1), TypeError, "dtype"),
    ],
)
def test_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
