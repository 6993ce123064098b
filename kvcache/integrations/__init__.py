"""Integrations of kvcache with model frameworks.

* :mod:`kvcache.integrations.transformers`: a ``transformers.Cache`` over the
  slot cache, an ``AttentionInterface`` function (``"kvcache"``) for packed,
  pad-free batches, and a continuous-batching generator over
  ``PagedKVCacheManager``. Needs ``torch`` and ``transformers``; importing this
  package does not import them.
"""

from __future__ import annotations

__all__: list[str] = []
