"""The block hash chain (DESIGN §6): identical bytes in every backend.

::

    root = sha256(b"kvcache/v1" + hash_seed.to_bytes(8, "little") + salt_bytes)
    h_i  = H(h_{i-1} + tokens_i)          # tokens_i: the block's ids as int32 little-endian

``H`` is ``sha256`` (32-byte digests) or ``xxh3_128`` (16-byte digests,
big-endian canonical form as ``xxhash.xxh3_128_digest`` returns it). The root is
always a 32-byte sha256 digest. Only full blocks are hashed. A hash is a key,
never a proof: every hit also compares the stored token ids.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from typing import NewType, Sequence

import numpy as np

__all__ = [
    "collide_hashes", "native_tokens_are_hash_input",
    "BlockHash",
    "HASH_ALGOS",
    "ROOT_DOMAIN",
    "root_hash",
    "block_hash",
    "block_hashes",
    "salt_bytes",
    "tokens_to_bytes",
    "digest_size",
]

BlockHash = NewType("BlockHash", bytes)

#: Domain-separation prefix of the root hash.
ROOT_DOMAIN = b"kvcache/v1"

#: Supported values of ``hash_algo`` and their digest sizes in bytes.
HASH_ALGOS = {"sha256": 32, "xxh3_128": 16}

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def digest_size(hash_algo: str) -> int:
    """Bytes in a block hash of ``hash_algo``; ``ValueError`` if unknown."""
    try:
        return HASH_ALGOS[hash_algo]
    except KeyError:
        raise ValueError(f"hash_algo={hash_algo!r}, must be one of {sorted(HASH_ALGOS)}") from None


def salt_bytes(cache_salt: str | bytes | None) -> bytes:
    """The salt as bytes: ``None`` -> ``b""``, ``str`` -> UTF-8, ``bytes`` as is."""
    if cache_salt is None:
        return b""
    if isinstance(cache_salt, str):
        return cache_salt.encode("utf-8")
    if isinstance(cache_salt, (bytes, bytearray)):
        return bytes(cache_salt)
    raise TypeError(f"cache_salt={cache_salt!r}, must be str, bytes or None")


def root_hash(hash_seed: int = 0, cache_salt: str | bytes | None = None) -> BlockHash:
    """The parent hash of block 0.

    Parameters
    ----------
    hash_seed : int
        ``0 <= hash_seed < 2**64``; written as 8 little-endian bytes.
    cache_salt : str, bytes or None
        Enters the root, so different salts never share blocks.
    """
    if isinstance(hash_seed, bool) or not isinstance(hash_seed, (int, np.integer)):
        raise TypeError(f"hash_seed={hash_seed!r}, must be an int")
    if not 0 <= int(hash_seed) < 2**64:
        raise ValueError(f"hash_seed={hash_seed}, must be in [0, 2**64)")
    data = ROOT_DOMAIN + int(hash_seed).to_bytes(8, "little") + salt_bytes(cache_salt)
    return BlockHash(hashlib.sha256(data).digest())


def tokens_to_bytes(tokens) -> bytes:
    """Token ids as little-endian int32 bytes; ``ValueError`` if one does not fit int32."""
    arr = np.asarray(tokens)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"tokens dtype={arr.dtype}, must be an integer type")
    if arr.dtype != np.dtype("<i4"):
        if arr.size and (arr.min() < _INT32_MIN or arr.max() > _INT32_MAX):
            raise ValueError(f"tokens: value out of int32 range [{_INT32_MIN}, {_INT32_MAX}]")
        arr = arr.astype("<i4")
    return arr.tobytes()


#: The encoder as defined here; ``collide_hashes`` swaps the module's ``tokens_to_bytes`` name.
_STANDARD_TOKENS_TO_BYTES = tokens_to_bytes


def native_tokens_are_hash_input() -> bool:
    """Whether int32 token ids in native byte order are the hash input as they are: the standard
    encoder is in place (no ``collide_hashes`` active) and the machine is little-endian. Lets a
    backend hash its int32 token arrays in place while staying exact under the collision hook."""
    return tokens_to_bytes is _STANDARD_TOKENS_TO_BYTES and sys.byteorder == "little"


def _hasher(hash_algo: str):
    if hash_algo == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    if hash_algo == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128_digest
    digest_size(hash_algo)  # raises ValueError naming the algorithm
    raise AssertionError("unreachable")


def block_hash(parent: bytes, tokens, hash_algo: str = "sha256") -> BlockHash:
    """``H(parent + int32le(tokens))`` for one full block."""
    return BlockHash(_hasher(hash_algo)(bytes(parent) + tokens_to_bytes(tokens)))


def block_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    hash_algo: str = "sha256",
    *,
    parent: bytes | None = None,
    hash_seed: int = 0,
    cache_salt: str | bytes | None = None,
    num_blocks: int | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``tokens``.

    Parameters
    ----------
    tokens : int [N]
        Token ids; only the first ``N // block_size`` full blocks are hashed
        (or ``num_blocks`` of them when given).
    block_size : int
        Tokens per block, > 0.
    hash_algo : {"sha256", "xxh3_128"}
    parent : bytes, optional
        The hash before ``tokens[0]``; default ``root_hash(hash_seed, cache_salt)``.
        Pass the last hash of a chain to extend it incrementally.

    Returns
    -------
    list of BlockHash
        ``h_0 .. h_{k-1}``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size={block_size}, must be > 0")
    h = _hasher(hash_algo)
    data = tokens_to_bytes(tokens)
    step = 4 * block_size
    n_full = len(data) // step
    if num_blocks is not None:
        if not 0 <= num_blocks <= n_full:
            raise ValueError(f"num_blocks={num_blocks} out of range [0, {n_full}]")
        n_full = num_blocks
    prev = bytes(parent) if parent is not None else root_hash(hash_seed, cache_salt)
    out: list[BlockHash] = []
    for i in range(n_full):
        prev = h(prev + data[i * step : (i + 1) * step])
        out.append(BlockHash(prev))
    return out


@contextlib.contextmanager
def collide_hashes():
    """Make every block hash ignore token values while the context is active.

    Every block hash becomes ``H(parent + zeros)``: two prompts of the same
    salt collide at every depth. Backends that hash only through this module
    (``tokens_to_bytes``) collide with it, and a correct backend still serves
    only token-verified hits (spec/hashing.md). Not thread-safe; the
    conformance suite's collision hook (``Backend.collide_hashes``).
    """
    global tokens_to_bytes
    real = tokens_to_bytes

    def zeros(tokens) -> bytes:
        return bytes(len(real(tokens)))  # validates as the real one, then forgets the values

    tokens_to_bytes = zeros
    try:
        yield
    finally:
        tokens_to_bytes = real
