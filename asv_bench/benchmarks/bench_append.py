"""``ops.append_kv`` on the CPU: decode and prefill steps, both packages, against ``numpy.copyto``."""

import numpy as np

from kvspec import KVCacheConfig, KVCacheMode, KVLayerSpec


def _package(name):
    import importlib

    return importlib.import_module(name)


class AppendKV:
    """One step's K/V scattered into a paged pool (8 KV heads x 128, block 16)."""

    params = [
        ["kvref", "kvfast"],          # package
        ["decode", "prefill"],        # step shape: 256 rows x 1 token / 8 rows x 1024 tokens
        ["float16", "bfloat16", "float32"],  # storage dtype
    ]
    param_names = ["package", "step", "dtype"]

    def setup(self, package, step, dtype):
        pkg = _package(package)
        rows, q, past = (256, 1, 100) if step == "decode" else (8, 1024, 0)
        bs = 16
        cfg = KVCacheConfig(num_layers=1, max_seqs=rows, max_seq_len=2048, mode=KVCacheMode.PAGED, block_size=bs,
                            num_blocks=rows * -(-(past + q) // bs) + 1, dtype=dtype)
        self.cache = pkg.KVCache.make(cfg, [KVLayerSpec.attention(8, 128)])
        self.ops = pkg.ops
        slots = np.arange(rows, dtype=np.int32)
        if past:
            self.cache.reserve(slots, np.full(rows, past))
        self.step = self.cache.prepare_step(np.arange(rows + 1, dtype=np.int32) * q, np.full(rows, past, np.int32),
                                            slots)
        rng = np.random.default_rng(0)
        dt = cfg.np_dtype
        self.k = rng.standard_normal((rows * q, 8, 128)).astype(dt)
        self.v = rng.standard_normal((rows * q, 8, 128)).astype(dt)
        self.src = np.concatenate([self.k.reshape(-1), self.v.reshape(-1)])
        self.dst = np.ones_like(self.src)  # touched, so page faults stay out of the timing
        self.cache.keys(0)[...] = 0
        self.cache.values(0)[...] = 0
        self.ops.append_kv(self.cache, 0, self.k, self.v, self.step)  # compile / load kernels

    def time_append_kv(self, package, step, dtype):
        self.ops.append_kv(self.cache, 0, self.k, self.v, self.step)

    def time_numpy_copyto_same_bytes(self, package, step, dtype):
        np.copyto(self.dst, self.src)

    def track_bandwidth_ratio_vs_copyto(self, package, step, dtype):
        import time

        def best(fn, n=20):
            b = float("inf")
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                b = min(b, time.perf_counter() - t0)
            return b

        t_copy = best(lambda: np.copyto(self.dst, self.src))
        t_app = best(lambda: self.ops.append_kv(self.cache, 0, self.k, self.v, self.step))
        return t_copy / t_app

    track_bandwidth_ratio_vs_copyto.unit = "ratio"


class AppendKVCuda:
    """``append_kv`` on a GPU: % of HBM bandwidth (needs CuPy and a device)."""

    params = [["decode", "prefill"]]
    param_names = ["step"]

    def setup(self, step):
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() == 0:
                raise NotImplementedError("no CUDA device")
        except ImportError:
            raise NotImplementedError("CuPy not installed")
        import kvfast  # pragma: no cover - needs a GPU

        rows, q = (256, 1) if step == "decode" else (8, 1024)  # pragma: no cover
        cfg = KVCacheConfig(num_layers=1, max_seqs=rows, max_seq_len=2048, mode=KVCacheMode.PAGED,
                            block_size=16, device="cuda")  # pragma: no cover
        self.cache = kvfast.KVCache.make(cfg, [KVLayerSpec.attention(8, 128)])  # pragma: no cover
        self.step = self.cache.prepare_step(np.arange(rows + 1, dtype=np.int32) * q, np.zeros(rows, np.int32),
                                            np.arange(rows, dtype=np.int32))  # pragma: no cover
        self.k = cupy.ones((rows * q, 8, 128), cupy.float16)  # pragma: no cover
        self.ops = kvfast.ops  # pragma: no cover

    def track_gbps(self, step):  # pragma: no cover - needs a GPU
        import cupy

        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        self.ops.append_kv(self.cache, 0, self.k, self.k, self.step)
        start.record()
        for _ in range(20):
            self.ops.append_kv(self.cache, 0, self.k, self.k, self.step)
        end.record()
        end.synchronize()
        sec = cupy.cuda.get_elapsed_time(start, end) / 1e3 / 20
        return 4 * self.k.nbytes / sec / 1e9  # read K,V + write K,V

    track_gbps.unit = "GB/s"
