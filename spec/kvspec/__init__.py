"""kvspec: the contract shared by every kvcache backend.

Types, errors and the hash chain that ``kvref`` (the reference) and
``kvfast`` (the fast path) both use, plus Hypothesis strategies and the
conformance suite (``kvspec.conformance``). The normative text lives in
``spec/*.md`` beside this package.
"""

from ._config import KVCacheConfig, KVCacheMode, KVLayerSpec, LayerKind
from ._connector import KVConnector, NullConnector
from ._dtypes import KV_DTYPES, STATE_DTYPES
from ._manager_types import (
    DEFAULT_LEAF_ID,
    BlockCount,
    ByteCount,
    CompletedTransfer,
    KVCacheInputs,
    KVCacheInputsPerDevice,
    KVCacheMetrics,
    KVCacheParams,
    KVTransfer,
    LeafKind,
    LeafSpec,
    PrefixCacheHits,
    SpecDecodingState,
    TextContext,
    spec_decode_cache_slack,
)
from ._page_store import BookkeepingPageStore, HostPageStore, PageStore, ScaledPageStore
from ._step import StepIndices
from .errors import CapacityError, InsufficientBlocksError, KVLoadFailed, KVLoadRefused
from .hashing import BlockHash, block_hash, block_hashes, root_hash

__version__ = "0.1.0"

__all__ = [
    "KVCacheMode", "LayerKind", "KVLayerSpec", "KVCacheConfig", "StepIndices",
    "BlockCount", "ByteCount", "PrefixCacheHits", "KVCacheMetrics", "KVCacheParams",
    "LeafKind", "LeafSpec", "TextContext", "KVTransfer", "CompletedTransfer",
    "KVCacheInputs", "KVCacheInputsPerDevice", "KVConnector", "NullConnector",
    "CapacityError", "InsufficientBlocksError", "KVLoadRefused", "KVLoadFailed",
    "BlockHash", "block_hash", "block_hashes", "root_hash", "KV_DTYPES", "STATE_DTYPES",
    "DEFAULT_LEAF_ID", "PageStore", "HostPageStore", "BookkeepingPageStore",
    "SpecDecodingState", "spec_decode_cache_slack", "ScaledPageStore",
]
