"""``ops.varlen_attention`` through a float16 paged slot cache and ``ops.paged_attention`` through a
manager's float16 pages, both packages (``kvcache bench --only attention``)."""

import importlib

from kvcache.bench import attention_inputs, paged_attention_inputs


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


class PagedAttention:
    """One forward of ``rows`` requests holding 256 tokens each in a manager's pages: 8 query / 2 K/V heads of 64."""

    params = [
        ["kvref", "kvfast"],     # package
        [(16, 1), (2, 64)],      # (rows, tokens per row): decode / prefill
    ]
    param_names = ["package", "shape"]

    def setup(self, package, shape):
        self.pkg = importlib.import_module(package)
        self.kv, self.inputs, self.offsets, self.q = paged_attention_inputs(self.pkg, *shape)
        self.pkg.ops.paged_attention(self.q, self.kv, 0, self.inputs, self.offsets)  # compile / load the kernel

    def time_paged_attention(self, package, shape):
        self.pkg.ops.paged_attention(self.q, self.kv, 0, self.inputs, self.offsets)
