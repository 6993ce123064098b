"""``ops.varlen_attention`` through a float16 paged slot cache, both packages (``kvcache bench --only attention``)."""

import importlib

from kvcache.bench import attention_inputs


class VarlenAttention:
    """One step over ``rows`` slots holding 256 tokens each: 8 query / 2 K/V heads of 64."""

    params = [
        ["kvref", "kvfast"],     # package
        [(16, 1), (2, 64)],      # (rows, tokens per row): decode / prefill
    ]
    param_names = ["package", "shape"]

    def setup(self, package, shape):
        self.pkg = importlib.import_module(package)
        rows, q = shape
        self.cache, self.step, self.q = attention_inputs(self.pkg, rows, q)
        self.pkg.ops.varlen_attention(self.q, self.cache, 0, self.step)  # compile / load the kernel

    def time_varlen_attention(self, package, shape):
        self.pkg.ops.varlen_attention(self.q, self.cache, 0, self.step)
