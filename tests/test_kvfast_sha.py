"""kvfast's Numba sha256 chain equals the hashlib chain of kvspec.hashing (DESIGN §6)."""

import hashlib

import numpy as np
import pytest

from kvfast._numba import sha
from kvspec import hashing


@pytest.mark.parametrize("page", [1, 4, 16, 33])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 64])
def test_chain_matches_kvspec_block_hashes(page, n):
    rng = np.random.default_rng(page * 100 + n)
    tokens = rng.integers(-(2**31), 2**31, size=n * page + 3, dtype=np.int64).astype(np.int32)
    root = hashing.root_hash(7, "salt")
    want = hashing.block_hashes(tokens, page, "sha256", parent=root, num_blocks=n)
    got = sha.chain_sha256(root, hashing.tokens_to_bytes(tokens), 4 * page, n)
    assert got == want
    assert all(type(h) is bytes and len(h) == 32 for h in got)


def test_numba_path_is_active_with_libcrypto():
    # The project's CI image has the libcrypto that hashlib links; the fallback is for others.
    assert sha.AVAILABLE


def test_fallback_parent_not_32_bytes_uses_hashlib():
    data = bytes(range(64))
    got = sha.chain_sha256(b"short", data, 32, 2)
    h0 = hashlib.sha256(b"short" + data[:32]).digest()
    assert got == [h0, hashlib.sha256(h0 + data[32:]).digest()]


def test_int32_array_input_equals_bytes_input():
    tokens = np.arange(-40, 88, dtype=np.int32)  # 8 blocks of 16
    root = hashing.root_hash()
    want = sha.chain_sha256(root, tokens.astype("<i4").tobytes(), 64, 8)
    assert sha.chain_sha256(root, tokens, 64, 8) == want
    assert sha.chain_sha256(root[:31], tokens, 64, 2) == sha.chain_sha256(root[:31], tokens.tobytes(), 64, 2)
