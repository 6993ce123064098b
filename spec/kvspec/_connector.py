"""The connector protocol between a request manager and its external tiers (DESIGN §5).

A connector holds copies of published device blocks outside the device pool
(host memory, disk, a remote store). The manager owns the device buffers and
calls the connector in a fixed order per step: ``load`` (inside ``alloc``),
``offload`` (posted at ``runtime_inputs`` or ``poll_transfers``), then the
forward. A connector never publishes into the device prefix cache itself: the
manager publishes an onloaded page only after its transfer lands.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from ._manager_types import ByteCount, CompletedTransfer, KVCacheMetrics, KVCacheParams, KVTransfer

__all__ = ["KVConnector", "NullConnector", "leaf_block_key"]

#: Domain tag of a leaf's tier key (spec/tiers.md §12); bumping it orphans every stored leaf page.
LEAF_KEY_TAG = b"kvcache/leaf/v1"


def leaf_block_key(block_hash: bytes, leaf_tag: bytes, part: int, hash_algo: str) -> bytes:
    """The tier key of unit ``part`` of one leaf's page of block ``block_hash`` (spec/tiers.md §12).

    ``H(LEAF_KEY_TAG + u16le(len(leaf_tag)) + leaf_tag + block_hash + u32le(part))`` with ``H``
    the manager's ``hash_algo`` (so the key has the digest size the tiers check). ``leaf_tag``
    names the leaf and its layout (``PagedKVCacheManager`` uses ``b"<leaf_id>|<kind>|<window>|
    <state_shape>|<state_dtype>"``), so a sliding page, a recurrent state and a full page of the
    same block never share a key, nor do two layouts of one leaf id.

    Parameters
    ----------
    block_hash : bytes
        The block's chained hash ``h_i`` (``kvspec.hashing``).
    leaf_tag : bytes
        At most 65535 bytes.
    part : int
        The unit index within the page, ``0 <= part < 2**32``.
    hash_algo : str
        ``"sha256"`` or ``"xxh3_128"``.
    """
    from . import hashing

    if not isinstance(leaf_tag, bytes) or len(leaf_tag) > 0xFFFF:
        raise ValueError(f"leaf_block_key: leaf_tag={leaf_tag!r:.40}, must be bytes of length <= 65535")
    if isinstance(part, bool) or not isinstance(part, int) or not 0 <= part < 2**32:
        raise ValueError(f"leaf_block_key: part={part!r}, must be an int in [0, 2**32)")
    data = LEAF_KEY_TAG + len(leaf_tag).to_bytes(2, "little") + leaf_tag + bytes(block_hash) + part.to_bytes(4, "little")
    return hashing._hasher(hash_algo)(data)


@runtime_checkable
class KVConnector(Protocol):
    """What a manager needs from its tiers.

    Arguments shared by the methods:

    block_ids : int [n]
        Device block ids of the replica (never 0, the null block).
    hashes : sequence of bytes [n]
        Chained block hashes (``kvspec.hashing``), root-anchored and in order.
    tokens : int32 [n, page_size]
        Token ids of each block; stored with the copy and compared on load,
        so a hash collision or a corrupted copy is a refused load, never wrong K/V.
    replica_idx : int
        The replica whose device buffer the block ids index.

    Optional (not part of the ``isinstance`` check): ``set_retention(hashes,
    priority, seconds, replica_idx=0)``, a request's retention claim on its
    committed blocks (spec/manager.md §14, spec/tiers.md §3.1: priority
    ``0 .. 100``, ``seconds`` ``None`` or > 0); the manager calls it at
    ``release`` when the connector has it. ``completed_transfers() -> int``:
    how many of its transfers have finished (grows by one per load or offload
    once its handle reports complete); a manager that sees it unchanged skips
    polling its in-flight offload handles (spec/manager.md §9.2).
    """

    name: str

    def attach(self, stores: Sequence, params: KVCacheParams, *, owner: object = None) -> None:
        """Bind the device pages before first use: one ``kvspec.PageStore`` per
        replica (every device read and write goes through ``store.read`` /
        ``store.write``; ``holds_bytes=False`` is bookkeeping-only mode), or one
        buffer ``[num_blocks, 2, num_layers, page_size, kv_heads, head_dim]`` per
        replica. ``owner`` is the attaching manager (it passes itself). A
        connector serves one live owner at a time: an attach by another live
        owner raises ``RuntimeError`` (spec/tiers.md §2)."""

    def lookup(self, hashes: Sequence[bytes], tokens: np.ndarray, replica_idx: int = 0) -> int:
        """Number of leading blocks of ``hashes`` the tiers hold. Advisory:
        reserves and pins nothing; a later ``load`` may still be refused."""

    def load(
        self, block_ids: Sequence[int], hashes: Sequence[bytes], tokens: np.ndarray, replica_idx: int = 0
    ) -> KVTransfer:
        """Copy the blocks ``hashes`` into ``block_ids``. Raises ``KVLoadRefused``
        (nothing was copied) or ``KVLoadFailed``; the handle may raise
        ``KVLoadFailed`` later."""

    def offload(
        self, block_ids: Sequence[int], hashes: Sequence[bytes], tokens: np.ndarray, replica_idx: int = 0
    ) -> KVTransfer:
        """Copy published device blocks out. The sources stay pinned by the
        manager until the handle completes. Never raises for a full or failing
        tier: such blocks are dropped and counted."""

    def touch(self, hashes: Sequence[bytes], replica_idx: int = 0) -> None:
        """Recency for blocks served from the device (root-anchored sequence)."""

    def poll_transfers(self) -> None:
        """Advance background work (promotions, write-back); never blocks."""

    def reset_prefix_cache(self) -> None:
        """Forget every stored block."""

    def shutdown(self) -> None:
        """Wait for every transfer and close the tiers; stored files stay."""

    def host_byte_count(self) -> ByteCount:
        """Bytes of the host tier, ``ByteCount(free, total)`` (``(0, 0)`` without one)."""

    def disk_byte_count(self) -> ByteCount:
        """Bytes of the disk tier, ``ByteCount(free, total)`` (``(0, 0)`` without one)."""

    @property
    def metrics(self) -> KVCacheMetrics:
        """A snapshot of the connector's counters."""

    def take_metrics(self) -> KVCacheMetrics:
        """The counters, then zero them."""


class NullConnector:
    """No tiers: every lookup misses, nothing is stored, every transfer is complete."""

    name = "null"

    def attach(self, stores, params, **kw) -> None:
        return None

    def lookup(self, hashes, tokens, replica_idx: int = 0) -> int:
        return 0

    def load(self, block_ids, hashes, tokens, replica_idx: int = 0) -> KVTransfer:
        if len(block_ids):
            from .errors import KVLoadRefused

            raise KVLoadRefused(f"NullConnector.load: holds no blocks, asked for {len(block_ids)}")
        return CompletedTransfer()

    def offload(self, block_ids, hashes, tokens, replica_idx: int = 0) -> KVTransfer:
        return CompletedTransfer()

    def touch(self, hashes, replica_idx: int = 0) -> None:
        return None

    def poll_transfers(self) -> None:
        return None

    def reset_prefix_cache(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def host_byte_count(self) -> ByteCount:
        return ByteCount(0, 0)

    def disk_byte_count(self) -> ByteCount:
        return ByteCount(0, 0)

    @property
    def metrics(self) -> KVCacheMetrics:
        return KVCacheMetrics()

    def take_metrics(self) -> KVCacheMetrics:
        return KVCacheMetrics()
