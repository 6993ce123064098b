"""``SlotKVCache`` inside transformers: a tiny Llama's decode step against ``DynamicCache`` (issue 33).

The model and the variants are ``kvcache bench --only transformers``'s (``kvcache.bench.tiny_llama``,
``kvcache.bench.TRANSFORMERS_VARIANTS``): 2 layers, hidden 64, 4 query / 2 K/V heads, a 32-token
prompt, greedy decode of batch 1, torch on one thread. Skipped (``NotImplementedError`` in
``setup``) where torch or transformers is not installed.
"""

from kvcache.bench import TRANSFORMERS_VARIANTS

STEPS = 50


class TransformersDecode:
    """50 greedy decode steps after a 32-token prompt, a fresh cache each time."""

    params = [list(TRANSFORMERS_VARIANTS)]  # "DynamicCache" and every SlotKVCache variant
    param_names = ["cache"]
    timeout = 300

    def setup(self, cache):
        from kvcache.bench import tiny_llama, transformers_available, transformers_decode

        missing = transformers_available()
        if missing:
            raise NotImplementedError(missing)
        import torch

        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self.model, self.ids = tiny_llama()
        self.decode = transformers_decode
        self.decode(self.model, self.ids, cache, steps=4)  # warm: kernels, the first forward of each path

    def teardown(self, cache):
        import torch

        torch.set_num_threads(self._threads)

    def time_generate(self, cache):
        """``model.generate`` of 51 new tokens (the prefill and 50 decode steps)."""
        from kvcache.bench import _transformers_generate

        _transformers_generate(self.model, self.ids, cache, STEPS + 1)

    def track_forward_us_per_step(self, cache):
        """The model forward per decode step of a manual greedy loop (best of 5), in microseconds."""
        return min(self.decode(self.model, self.ids, cache, steps=STEPS)["forward"] for _ in range(5)) * 1e6

    track_forward_us_per_step.unit = "us"

    def track_forward_ratio_vs_dynamic_cache(self, cache):
        """This cache's forward per decode step over ``DynamicCache``'s, timed interleaved (best of 5 each)."""
        best = {cache: float("inf"), "DynamicCache": float("inf")}
        for r in range(10):
            v = (cache, "DynamicCache")[r % 2]
            best[v] = min(best[v], self.decode(self.model, self.ids, v, steps=STEPS)["forward"])
        return best[cache] / best["DynamicCache"]

    track_forward_ratio_vs_dynamic_cache.unit = "x"
