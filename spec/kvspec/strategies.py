"""Hypothesis strategies for kvcache tests (DESIGN §8).

Everything is small on purpose: a vocabulary of a few tokens so prompts share
prefixes and block hashes collide in the index, block sizes of 2 to 4, a few
slots and pools barely larger than one sequence so eviction and
``CapacityError`` happen within a handful of steps.

Importing this module needs ``hypothesis`` (the ``test`` extra).
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from ._config import KVCacheConfig, KVCacheMode, KVLayerSpec
from ._dtypes import KV_DTYPES
from ._manager_types import DEFAULT_LEAF_ID, KVCacheParams, LeafKind, LeafSpec

__all__ = [
    "VOCAB",
    "token_ids",
    "prompts",
    "exact_values",
    "nonzero_values",
    "kv_arrays",
    "kv_pairs",
    "distinct_pair",
    "layer_specs",
    "cache_configs",
    "manager_setups",
]

#: Token ids drawn from ``range(VOCAB)``: tiny, so prefixes collide.
VOCAB = 3

#: Block sizes the suite draws from.
BLOCK_SIZES = (2, 3, 4)


def token_ids(vocab: int = VOCAB) -> st.SearchStrategy[int]:
    """One token id in ``[0, vocab)``."""
    return st.integers(0, vocab - 1)


def prompts(min_size: int = 1, max_size: int = 12, vocab: int = VOCAB) -> st.SearchStrategy[list[int]]:
    """A prompt: a list of ``min_size..max_size`` token ids from a tiny vocabulary."""
    return st.lists(token_ids(vocab), min_size=min_size, max_size=max_size)


def exact_values(shape, dtype, seed: int) -> np.ndarray:
    """Deterministic values ``k / 8`` with ``|k| < 64``, exact in float16, bfloat16 and float32.

    Parameters
    ----------
    shape : tuple of int
    dtype : str or numpy dtype
        A K/V or state dtype name (``"float16"``, ``"bfloat16"``, ``"float32"``).
    seed : int
        ``numpy.random.default_rng`` seed.

    Returns
    -------
    ndarray [shape], dtype
    """
    dt = KV_DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
    rng = np.random.default_rng(seed)
    return (rng.integers(-63, 64, size=shape) / 8.0).astype(dt)


def nonzero_values(shape, dtype, seed: int) -> np.ndarray:
    """Like :func:`exact_values` but never zero: ``k / 8`` with ``1 <= |k| <= 63``.

    Zero is what a fresh buffer holds, so a write that never happened (or a
    row written to the wrong place and read back from an empty one) cannot
    pass as a written zero.

    Returns
    -------
    ndarray [shape], dtype
    """
    dt = KV_DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
    rng = np.random.default_rng(seed)
    mag = rng.integers(1, 64, size=shape)
    sign = np.where(rng.integers(0, 2, size=shape) == 1, 1, -1)
    return (mag * sign / 8.0).astype(dt)


def distinct_pair(shape, dtype, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(k, v)``: independent non-zero draws that differ in **every** element.

    ``v`` is drawn from another seed, then negated wherever it equals ``k``
    (non-zero, so the negation differs), so "V written as K", "K and V
    swapped" or a V copied from K's source never compares equal.

    Returns
    -------
    k, v : ndarray [shape], dtype
    """
    k = nonzero_values(shape, dtype, seed)
    v = nonzero_values(shape, dtype, seed ^ 0x5BD1E995)
    same = v == k
    v[same] = -v[same]
    return k, v


def kv_pairs(shape, dtype) -> st.SearchStrategy[tuple[np.ndarray, np.ndarray]]:
    """``(k, v)`` from :func:`distinct_pair` (one seed drawn; never equal, never zero)."""
    return st.integers(0, 2**32 - 1).map(lambda seed: distinct_pair(tuple(shape), dtype, seed))


def kv_arrays(shape, dtype) -> st.SearchStrategy[np.ndarray]:
    """Arrays of ``shape`` in ``dtype`` with exactly representable values (see ``exact_values``)."""
    return st.integers(0, 2**32 - 1).map(lambda seed: exact_values(tuple(shape), dtype, seed))


@st.composite
def layer_specs(draw, capabilities=frozenset({"sliding_window", "cross", "state"}), max_layers: int = 3):
    """A list of ``KVLayerSpec``: the first is full attention; the others are drawn
    from the kinds in ``capabilities`` (``"sliding_window"``, ``"cross"``, ``"state"``)."""
    kv_heads = draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from((2, 4)))
    specs = [KVLayerSpec.attention(kv_heads, head_dim)]
    kinds = ["attention"]
    if "sliding_window" in capabilities:
        kinds.append("sliding_window")
    if "cross" in capabilities:
        kinds.append("cross")
    if "state" in capabilities:
        kinds.append("state")
    extra = draw(st.lists(st.sampled_from(kinds), max_size=max_layers - 1))
    # One encoder length per slot is shared by every cross layer, so they share max_enc_len too.
    max_enc_len = draw(st.integers(1, 4))
    for kind in extra:
        if kind == "attention":
            specs.append(KVLayerSpec.attention(draw(st.integers(1, 2)), draw(st.sampled_from((2, 4)))))
        elif kind == "sliding_window":
            specs.append(KVLayerSpec.sliding_window(kv_heads, head_dim, draw(st.integers(1, 6))))
        elif kind == "cross":
            specs.append(KVLayerSpec.cross_attention(draw(st.integers(1, 2)), 2, max_enc_len))
        else:
            dims = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
            width = draw(st.integers(1, 3)) if dims else 0
            rec = draw(st.one_of(st.none(), st.just((1, 2, 2)))) if dims else (1, 2, 2)
            specs.append(KVLayerSpec.state(dims, width, rec))
    return specs


@st.composite
def cache_configs(draw, capabilities=frozenset({"contiguous", "paged"}), mode: KVCacheMode | None = None):
    """``(KVCacheConfig, [KVLayerSpec])`` for a small slot cache.

    Parameters
    ----------
    capabilities : frozenset of str
        Backend capabilities: the modes (``"contiguous"``, ``"paged"``) and
        layer kinds (``"sliding_window"``, ``"cross"``, ``"state"``) to draw from.
    mode : KVCacheMode, optional
        Force one mode.
    """
    if mode is None:
        modes = [m for m, c in ((KVCacheMode.PAGED, "paged"), (KVCacheMode.CONTIGUOUS, "contiguous")) if c in capabilities]
        mode = draw(st.sampled_from(modes))
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    max_seqs = draw(st.integers(1, 4))
    max_seq_len = draw(st.integers(4, 12))
    per_seq = math.ceil(max_seq_len / block_size)
    num_blocks = 0
    if mode is KVCacheMode.PAGED:
        # Small pools: often less than every slot at full length, so eviction and CapacityError happen.
        num_blocks = draw(st.one_of(st.just(0), st.integers(2, max_seqs * per_seq + 1)))
    specs = draw(layer_specs(capabilities))
    has_state = any(s.kind.name == "STATE" for s in specs)
    config = KVCacheConfig(
        num_layers=len(specs),
        max_seqs=max_seqs,
        max_seq_len=max_seq_len,
        mode=mode,
        block_size=block_size,
        num_blocks=num_blocks,
        dtype=draw(st.sampled_from(("float16", "bfloat16", "float32"))),
        state_dtype=draw(st.sampled_from(("float32", "float16"))),
        enable_prefix_caching=draw(st.sampled_from((True, True, True, False))),
        hash_algo=draw(st.sampled_from(("sha256", "xxh3_128"))),
        hash_seed=draw(st.sampled_from((0, 0, 7))),
        num_state_checkpoints=draw(st.one_of(st.none(), st.integers(0, 3))) if has_state else None,
    )
    return config, specs


@st.composite
def manager_setups(draw, capabilities=frozenset({"manager", "prefix_caching"})):
    """Keyword arguments of a small ``PagedKVCacheManager``.

    Returns
    -------
    dict
        ``params`` (a ``KVCacheParams``: the ``"full"`` leaf, plus a sliding-window
        leaf ``"swa"`` and a recurrent leaf ``"rec"`` when declared),
        ``num_blocks``, ``max_batch_size``, ``max_seq_len``.
    """
    page_size = draw(st.sampled_from(BLOCK_SIZES))
    max_seq_len = draw(st.integers(4, 16))
    leaves = None
    extra = []
    if "sliding_window" in capabilities and draw(st.booleans()):
        extra.append(("swa", LeafSpec.sliding_window(draw(st.integers(2, 6)))))
    if "recurrent_leaf" in capabilities and draw(st.booleans()):
        extra.append(("rec", LeafSpec.recurrent((2, 2))))
    if extra:
        leaves = {DEFAULT_LEAF_ID: LeafSpec.full(), **dict(extra)}
    replicas = draw(st.sampled_from((1, 1, 2))) if "replicas" in capabilities else 1
    caching = draw(st.sampled_from((True, True, True, False))) if "prefix_caching" in capabilities else False
    params = KVCacheParams(
        page_size=page_size,
        num_layers=draw(st.integers(1, 2)),
        kv_heads=draw(st.integers(1, 2)),
        head_dim=draw(st.sampled_from((2, 4))),
        dtype=draw(st.sampled_from(("float16", "float32", "bfloat16"))),
        data_parallel_degree=replicas,
        enable_prefix_caching=caching,
        hash_algo=draw(st.sampled_from(("sha256", "xxh3_128"))),
        hash_seed=draw(st.sampled_from((0, 0, 5))),
        leaves=leaves,
    )
    per_seq = math.ceil(max_seq_len / page_size)
    # spec/manager.md §1.6: the pool holds one request of max_seq_len in every leaf (else construction
    # refuses it); with several leaves sharing a slab, their pages together (a safe bound for any ratio)
    hold = per_seq + sum(
        1 if spec.kind is LeafKind.RECURRENT else min(per_seq, math.ceil((spec.window - 1) / page_size) + 1)
        for _, spec in extra)
    return {
        "params": params,
        "num_blocks": draw(st.integers(max(3, hold + 1), max(hold + 1, 2 * per_seq + 2))),
        "max_batch_size": draw(st.integers(1, 4)),
        "max_seq_len": max_seq_len,
    }
