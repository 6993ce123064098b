"""Exception types shared by every backend (DESIGN §3).

Bad input raises the standard Python types: ``ValueError`` for a wrong value
or shape, ``IndexError`` for an index out of range, ``TypeError`` for a wrong
layer kind or argument type, ``RuntimeError`` for a call in the wrong mode.
The types below add the cache-specific failures. Every call that raises
leaves all state exactly as it was.
"""

from __future__ import annotations

__all__ = [
    "CapacityError",
    "InsufficientBlocksError",
    "KVLoadRefused",
    "KVLoadFailed",
    "insufficient_blocks_message",
]


class CapacityError(RuntimeError):
    """Out of blocks or out of tokens (``max_seq_len``); state is unchanged."""


class InsufficientBlocksError(CapacityError):
    """The request manager's name for running out of blocks.

    A scheduler treats it as "preempt or requeue", not as a bug: ``alloc``
    raised it after rolling back everything it had done.
    """


def insufficient_blocks_message(op: str, request_id: str, needed: int, leaf_id: str, free: int, replica: int) -> str:
    """The message of the request manager's ``InsufficientBlocksError`` (spec/manager.md §4 step 6):
    the call, the request, the pages its leaf needs and those it can still draw on its replica."""
    return (f"{op}: request_id={request_id!r} needs {needed} blocks of leaf {leaf_id!r}, "
            f"{free} free or evictable on replica {replica}")


class KVLoadRefused(Exception):
    """A connector declined a load (the block was evicted since the lookup,
    no staging room, or a stored copy failed verification).

    The manager turns it into a clean miss: the rows reserved for the load
    are freed and nothing is published.

    Parameters
    ----------
    message : str
        What was refused and why.
    leaf_id : str, optional
        The leaf whose block was refused.
    block_hash : bytes, optional
        The hash of the first refused block.
    """

    def __init__(self, message: str, leaf_id: str | None = None, block_hash: bytes | None = None):
        super().__init__(message)
        self.leaf_id = leaf_id
        self.block_hash = block_hash


class KVLoadFailed(Exception):
    """A load was accepted but its copy failed (at post, or when polled).

    The destination pages are unpinned without being published.
    """
