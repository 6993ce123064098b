"""kvcache: the ``kvcache`` command and the replay job behind it.

``kvcache replay`` drives a ``PagedKVCacheManager`` (``kvfast`` or ``kvref``)
with a continuous-batching scheduler over a workload and reports prefix hit
rates against the infinite-cache ceiling, block use, preemptions and tier
traffic. The same pieces are importable:

* :func:`kvcache.replay.replay` with :class:`ReplayConfig` -> :class:`ReplayStats`
  (the module ``kvcache.replay`` keeps its name: the function is not re-exported);
* workloads: :func:`synthetic_workload`, :func:`read_mooncake_trace`
  (:class:`Request`);
* :func:`infinite_cache_ceiling` (:class:`Ceiling`);
* reports in :mod:`kvcache.report`.
"""

from __future__ import annotations

from .ceiling import Ceiling, infinite_cache_ceiling
from .replay import ReplayConfig, ReplayError, ReplayStats
from .workload import Request, WorkloadError, read_mooncake_trace, synthetic_workload

__version__ = "0.1.0"

__all__ = [
    "Ceiling",
    "ReplayConfig",
    "ReplayError",
    "ReplayStats",
    "Request",
    "WorkloadError",
    "infinite_cache_ceiling",
    "read_mooncake_trace",
    "synthetic_workload",
]
