"""Sweeps: one replay per value of a size option, in parallel.

``kvcache replay --device-bytes 20GiB,40GiB,80GiB`` builds one
:class:`~kvcache.replay.ReplayConfig` per value and runs them

* in worker processes on this machine (``fork``: the workload is shared
  with the workers, not copied through a pipe), at most ``workers`` at once;
* or on a Dask cluster (``cluster="tcp://host:8786"``, or ``"local"`` for a
  ``distributed.LocalCluster`` of two in-process workers), the workload
  scattered to the workers once. Dask is the optional extra
  ``kvcache[cluster]``.

Runs come back as ``(ReplayStats, value)`` pairs in the order of the values;
a Ctrl-C returns the runs that finished.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import sys
from typing import Sequence

from .replay import ReplayConfig, ReplayStats, replay
from .workload import Request

__all__ = ["sweep", "swept_value"]

#: The workload of a forked worker (set in the parent just before the pool forks).
_WORKLOAD: Sequence[Request] | None = None


def swept_value(config: ReplayConfig, name: str):
    """The value of option ``name`` in ``config`` (``num_blocks``: blocks per replica)."""
    if name == "num_blocks":
        return config.blocks_per_replica()
    return getattr(config, name)


def _run_forked(config: ReplayConfig, workload: str) -> ReplayStats:
    return replay(_WORKLOAD, config, workload=workload)


def _run_shipped(requests: Sequence[Request], config: ReplayConfig, workload: str) -> ReplayStats:
    return replay(requests, config, workload=workload)


def _bar(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="run", desc="sweep", file=sys.stderr, dynamic_ncols=True)


def sweep(
    requests: Sequence[Request],
    configs: Sequence[ReplayConfig],
    *,
    name: str | None = None,
    workload: str = "requests",
    workers: int | None = None,
    cluster: str | None = None,
    progress: bool = False,
) -> list[tuple[ReplayStats, object]]:
    """Run one replay per config, in parallel.

    Parameters
    ----------
    requests : sequence of Request
    configs : sequence of ReplayConfig
        One per swept value (at least one).
    name : str, optional
        The swept option (a ``ReplayConfig`` field) whose value labels each run;
        default the one field that differs between the configs.
    workload : str
        The report's label.
    workers : int, optional
        Worker processes (default ``min(len(configs), os.cpu_count())``); 1 runs in this process.
    cluster : str, optional
        A Dask scheduler address, or ``"local"`` for a ``LocalCluster`` (2 workers, in process).
    progress : bool
        A tqdm bar over the runs on stderr.

    Returns
    -------
    list of (ReplayStats, value)
        In the order of ``configs``; after a ``KeyboardInterrupt``, the runs that finished.

    Raises
    ------
    ValueError
        No configs, ``workers < 1``.
    ImportError
        ``cluster`` without ``distributed`` installed.
    """
    if not configs:
        raise ValueError("sweep: configs is empty")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"sweep: workers={workers!r}, must be an int >= 1")
    if name is None:
        fields = [f for f in ReplayConfig.__dataclass_fields__
                  if len({repr(getattr(c, f)) for c in configs}) > 1]
        name = fields[0] if fields else "page_size"
    values = [swept_value(c, name) for c in configs]
    bar = _bar(len(configs), progress)
    done: dict[int, ReplayStats] = {}
    try:
        if cluster is not None:
            _on_dask(requests, configs, workload, cluster, done, bar)
        else:
            n = min(len(configs), workers or os.cpu_count() or 1)
            if n <= 1:
                for i, c in enumerate(configs):
                    done[i] = replay(requests, c, workload=workload)
                    if bar is not None:
                        bar.update(1)
            else:
                _on_processes(requests, configs, workload, n, done, bar)
    except KeyboardInterrupt:
        pass
    finally:
        if bar is not None:
            bar.close()
    return [(done[i], values[i]) for i in sorted(done)]


def _on_processes(requests, configs, workload, n, done, bar) -> None:
    global _WORKLOAD
    methods = multiprocessing.get_all_start_methods()
    _WORKLOAD = requests
    try:
        if "fork" in methods:
            ctx = multiprocessing.get_context("fork")
            pool = cf.ProcessPoolExecutor(n, mp_context=ctx)
            futures = {pool.submit(_run_forked, c, workload): i for i, c in enumerate(configs)}
        else:  # pragma: no cover - spawn-only platforms ship the workload to each run
            pool = cf.ProcessPoolExecutor(n)
            futures = {pool.submit(_run_shipped, requests, c, workload): i for i, c in enumerate(configs)}
        try:
            for f in cf.as_completed(futures):
                done[futures[f]] = f.result()
                if bar is not None:
                    bar.update(1)
        except BaseException:
            for f in futures:
                f.cancel()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
    finally:
        _WORKLOAD = None


def _on_dask(requests, configs, workload, cluster, done, bar) -> None:
    try:
        from distributed import Client, LocalCluster, as_completed
    except ImportError:
        raise ImportError('--cluster needs Dask: pip install "kvcache[cluster]"') from None
    local = None
    if cluster == "local":
        local = LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None)
        client = Client(local)
    else:
        client = Client(cluster, timeout=30)
    try:
        [shipped] = client.scatter([list(requests)], broadcast=True)  # one object, not one per request
        futures = {client.submit(_run_shipped, shipped, c, workload, pure=False): i for i, c in enumerate(configs)}
        for f in as_completed(list(futures)):
            done[futures[f]] = f.result()
            if bar is not None:
                bar.update(1)
    finally:
        client.close()
        if local is not None:
            local.close()
