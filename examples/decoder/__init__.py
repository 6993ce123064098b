"""A toy Llama-style decoder served through kvcache and checked against ONNX Runtime.

* :mod:`decoder.model`: the NumPy model and its two cache bindings;
* :mod:`decoder.onnx_graph`: the same weights as an ONNX graph (ONNX Runtime keeps its own cache);
* :mod:`decoder.serve`: continuous-batching servers over ``KVCache`` and ``PagedKVCacheManager``,
  the ONNX Runtime reference run and the comparison.

Run from the repository root with ``examples`` on ``sys.path`` (``python -m decoder`` inside ``examples/``).
"""

from .model import Decoder, DecoderConfig, DecoderWeights, PagedTableAttention, SlotCacheAttention, layer_specs_for
from .serve import (
    ManagerServer,
    Request,
    ServeResult,
    ServeStats,
    SlotCacheServer,
    chat_workload,
    compare,
    reference_run,
)

__all__ = ["Decoder", "DecoderConfig", "DecoderWeights", "PagedTableAttention", "SlotCacheAttention",
           "layer_specs_for", "ManagerServer", "Request", "ServeResult", "ServeStats", "SlotCacheServer",
           "chat_workload", "compare", "reference_run", "OrtDecoder"]


def __getattr__(name):
    if name == "OrtDecoder":  # needs onnx and onnxruntime; imported on first use
        from .onnx_graph import OrtDecoder

        return OrtDecoder
    raise AttributeError(f"module 'decoder' has no attribute {name!r}")
