"""``PagedKVCacheManager``: the peer bookkeeping workload replayed, and the decode-step calls, both packages."""

import numpy as np

from kvcache.bench import BATCH_CONFIGS, MANAGER_CONFIGS
from kvspec import KVCacheParams, TextContext


class ManagerReplay:
    """The first requests of the peer workload (WORKLOAD.md: shared 1024-token prompts,
    waves of 64, 64 decode steps, 8192 blocks of 16) through the manager's API."""

    params = [["kvref", "kvfast"], [64]]  # package; requests replayed (kvref ~50 ms per request)
    param_names = ["package", "requests"]
    timeout = 600

    def setup(self, package, requests):
        import importlib

        from kvcache.bench import peer_workload

        self.cls = importlib.import_module(package).PagedKVCacheManager
        self.prompts, self.gen, _ = peer_workload(requests)

    def time_replay(self, package, requests):
        from kvcache.bench import replay_manager

        replay_manager(self.cls, self.prompts, self.gen)

    def track_hit_tokens(self, package, requests):
        from kvcache.bench import replay_manager

        return replay_manager(self.cls, self.prompts, self.gen)["hit_tokens"]

    track_hit_tokens.unit = "tokens"


class DecodeStep:
    """One decode step of 64 requests: ``alloc`` + ``update`` + ``step`` each."""

    params = [["kvref", "kvfast"]]
    param_names = ["package"]

    def setup(self, package):
        import importlib

        cls = importlib.import_module(package).PagedKVCacheManager
        self.m = cls(KVCacheParams(page_size=16, num_layers=1, kv_heads=1, head_dim=1),
                     num_blocks=4097, max_batch_size=64, max_seq_len=1 << 16)
        self.ctxs = [TextContext(str(i), np.arange(300) + 1000 * i) for i in range(64)]
        for c in self.ctxs:
            self.m.claim(c)
            self.m.alloc(c)
            c.skip_processing(c.active_length - 1)
            self.m.step(c)

    def time_decode_step(self, package):
        m = self.m
        for c in self.ctxs:
            m.alloc(c)
            c.update(5)
            m.step(c)


class ManagerConfigs:
    """Issue 12's scheduler loop (``claim``, ``alloc``, ``runtime_inputs`` every step, ``step``,
    ``release``) in each configuration of ``kvcache.bench.MANAGER_CONFIGS`` (one full leaf, two
    replicas, a host tier, full + sliding window, full + recurrent), both packages on the same
    workload (``kvcache.bench.config_workload``: 32 requests over 8 shared 512-token prompts).

    ``time_scheduler_loop`` is the whole loop's wall time (the workload's contexts and the
    simulated forward included); ``track_bookkeeping_us_per_request`` is what ``kvcache bench``
    reports: CPU time of this thread inside manager calls per request (best of three), the figure
    issue 12's targets are stated in; ``track_hit_tokens`` and ``track_peak_blocks`` must be equal
    for the two packages."""

    params = [["kvref", "kvfast"], list(MANAGER_CONFIGS)]
    param_names = ["package", "config"]
    timeout = 600
    requests = 32

    def setup(self, package, config):
        import importlib

        from kvcache.bench import config_workload, scheduler_loop

        self.cls = importlib.import_module(package).PagedKVCacheManager
        self.prompts, self.gen = config_workload(self.requests)
        scheduler_loop(self.cls, config, self.prompts[:2], self.gen[:2])  # compile / load the kernels

    def time_scheduler_loop(self, package, config):
        from kvcache.bench import scheduler_loop

        scheduler_loop(self.cls, config, self.prompts, self.gen)

    def track_bookkeeping_us_per_request(self, package, config):
        from kvcache.bench import scheduler_loop

        best = min(scheduler_loop(self.cls, config, self.prompts, self.gen)["seconds"] for _ in range(3))
        return best / self.requests * 1e6

    track_bookkeeping_us_per_request.unit = "us"

    def track_hit_tokens(self, package, config):
        from kvcache.bench import scheduler_loop

        return scheduler_loop(self.cls, config, self.prompts, self.gen)["hit_tokens"]

    track_hit_tokens.unit = "tokens"

    def track_peak_blocks(self, package, config):
        from kvcache.bench import scheduler_loop

        return scheduler_loop(self.cls, config, self.prompts, self.gen)["peak_blocks"]

    track_peak_blocks.unit = "blocks"


class DecodeStepBatch:
    """Issue 32's decode step: 256 running requests, one token each, through the batch calls
    (``alloc_many`` + ``TextContext.update_many`` + ``step_many``, spec/manager.md §17) or the
    per-request loop of the same calls, in each configuration of ``kvcache.bench.BATCH_CONFIGS``
    (``kvcache.bench.decode_batch``: 16 steps, the admissions untimed). ``track_us_per_step`` is
    the CPU time of this thread per step, the figure ``kvcache bench --only batch`` reports."""

    params = [["kvref", "kvfast"], ["batch", "loop"], list(BATCH_CONFIGS)]
    param_names = ["package", "calls", "config"]
    timeout = 600

    def setup(self, package, calls, config):
        import importlib

        self.cls = importlib.import_module(package).PagedKVCacheManager

    def track_us_per_step(self, package, calls, config):
        from kvcache.bench import decode_batch

        return min(decode_batch(self.cls, config, batch=calls == "batch")["seconds_per_step"] for _ in range(3)) * 1e6

    track_us_per_step.unit = "us"

    def track_hit_tokens(self, package, calls, config):
        from kvcache.bench import decode_batch

        return decode_batch(self.cls, config, rows=64, steps=2, batch=calls == "batch")["hit_tokens"]

    track_hit_tokens.unit = "tokens"
