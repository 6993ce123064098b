"""The same decoder as an ONNX graph, run by ONNX Runtime with its own K/V cache.

Built with ``onnx.helper`` from :class:`~decoder.model.DecoderWeights`: each
layer is ``SimplifiedLayerNormalization`` (RMSNorm) -> three ``MatMul`` ->
``com.microsoft.GroupQueryAttention`` with ``past_key``/``past_value``, its
rotary option (``do_rotary=1`` with the model's cos/sin tables) and
``local_window_size = w`` on sliding layers (ONNX Runtime's
window also counts the current token, measured) -> ``MatMul`` -> residual,
then RMSNorm -> SwiGLU (``Sigmoid``, ``Mul``) -> residual; a final RMSNorm and
the output projection. ONNX Runtime keeps the cache (``present_*`` fed back
as ``past_*``), one request at a time: an independent implementation of the
attention, the rotary positions and the cache.

``kv_round="bfloat16"`` (or ``"float16"``) applies the rotary with
``RotaryEmbedding`` outside the attention op and rounds K and V through that
dtype (``Cast``) before the op caches them: the graph then sees the K/V a
bfloat16 (float16) kvcache stores.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .model import DecoderConfig, DecoderWeights, rope_tables

__all__ = ["build_onnx_model", "OrtDecoder"]


def build_onnx_model(cfg: DecoderConfig, w: DecoderWeights, kv_round: Optional[str] = None):
    """Return an ``onnx.ModelProto`` of the decoder.

    Inputs: ``input_ids`` int64 ``[1, S]``, ``seqlens_k`` int32 ``[1]`` (total
    length - 1), ``total_sequence_length`` int32 scalar, ``past_key_<l>`` /
    ``past_value_<l>`` float32 ``[1, kv_heads, P, head_dim]``. Outputs:
    ``logits`` float32 ``[1, S, vocab]``, ``present_key_<l>`` / ``present_value_<l>``.

    Parameters
    ----------
    cfg : DecoderConfig
    w : DecoderWeights
    kv_round : {None, "bfloat16", "float16"}
        Round K/V through this dtype before they are cached (the storage
        dtype of the kvcache under test).
    """
    from onnx import TensorProto, helper, numpy_helper

    rounding = {None: None, "bfloat16": TensorProto.BFLOAT16, "float16": TensorProto.FLOAT16}
    if kv_round not in rounding:
        raise ValueError(f"build_onnx_model: kv_round={kv_round!r}, must be None, 'bfloat16' or 'float16'")
    nodes, inits = [], []

    def init(name, arr):
        inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def node(op, ins, outs, domain="", **attrs):
        nodes.append(helper.make_node(op, ins, outs, domain=domain, **attrs))
        return outs[0]

    def rms(x, weight, name):
        return node("SimplifiedLayerNormalization", [x, init(name, weight)], [name + "_out"],
                    axis=-1, epsilon=cfg.rms_eps)

    cos, sin = rope_tables(cfg)
    init("cos_cache", cos)
    init("sin_cache", sin)
    f32 = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "S"]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info("logits", f32, [1, "S", cfg.vocab_size])]
    x = node("Gather", [init("embed", w.embed), "input_ids"], ["x0"], axis=0)
    if kv_round is not None:
        # RotaryEmbedding wants position_ids [1, S]: past length + arange(S)
        node("Shape", ["input_ids"], ["ids_shape"])
        node("Gather", ["ids_shape", init("one_i64", np.array(1, np.int64))], ["S"], axis=0)
        node("Cast", ["total_sequence_length"], ["total_i64"], to=TensorProto.INT64)
        node("Sub", ["total_i64", "S"], ["past_len"])
        node("Range", ["past_len", "total_i64", init("step_i64", np.array(1, np.int64))], ["pos_1d"])
        node("Unsqueeze", ["pos_1d", init("axes0", np.array([0], np.int64))], ["position_ids"])
    for l in range(cfg.num_layers):
        p = f"l{l}_"
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_{kind}_{l}", f32, [1, cfg.kv_heads, "P", cfg.head_dim]))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}_{l}", f32,
                                                         [1, cfg.kv_heads, "T", cfg.head_dim]))
        h = rms(x, w.attn_norm[l], p + "attn_norm")
        q = node("MatMul", [h, init(p + "wq", w.wq[l])], [p + "q"])
        k = node("MatMul", [h, init(p + "wk", w.wk[l])], [p + "k"])
        v = node("MatMul", [h, init(p + "wv", w.wv[l])], [p + "v"])
        do_rotary = 1
        if kv_round is not None:
            q = node("RotaryEmbedding", [q, "cos_cache", "sin_cache", "position_ids"], [p + "q_rot"],
                     num_heads=cfg.q_heads, interleaved=0)
            k = node("RotaryEmbedding", [k, "cos_cache", "sin_cache", "position_ids"], [p + "k_rot"],
                     num_heads=cfg.kv_heads, interleaved=0)
            for name in ("k", "v"):
                src = k if name == "k" else v
                node("Cast", [src], [p + name + "_narrow"], to=rounding[kv_round])
                node("Cast", [p + name + "_narrow"], [p + name + "_rounded"], to=TensorProto.FLOAT)
            k, v = p + "k_rounded", p + "v_rounded"
            do_rotary = 0
        window = cfg.windows[l]
        a = node("GroupQueryAttention",
                 [q, k, v, f"past_key_{l}", f"past_value_{l}", "seqlens_k", "total_sequence_length",
                  "cos_cache" if do_rotary else "", "sin_cache" if do_rotary else ""],
                 [p + "attn", f"present_key_{l}", f"present_value_{l}"], domain="com.microsoft",
                 num_heads=cfg.q_heads, kv_num_heads=cfg.kv_heads, do_rotary=do_rotary,
                 rotary_interleaved=0, local_window_size=-1 if window is None else window)
        o = node("MatMul", [a, init(p + "wo", w.wo[l])], [p + "o"])
        x = node("Add", [x, o], [p + "x_attn"])
        h = rms(x, w.mlp_norm[l], p + "mlp_norm")
        g = node("MatMul", [h, init(p + "w_gate", w.w_gate[l])], [p + "gate"])
        sg = node("Sigmoid", [g], [p + "sig"])
        silu = node("Mul", [g, sg], [p + "silu"])
        up = node("MatMul", [h, init(p + "w_up", w.w_up[l])], [p + "up"])
        m = node("Mul", [silu, up], [p + "swiglu"])
        d = node("MatMul", [m, init(p + "w_down", w.w_down[l])], [p + "down"])
        x = node("Add", [x, d], [p + "x_out"])
    h = rms(x, w.final_norm, "final_norm")
    node("MatMul", [h, init("lm_head", w.lm_head)], ["logits"])
    graph = helper.make_graph(nodes, "kvcache_toy_decoder", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


class OrtDecoder:
    """The ONNX graph in an ONNX Runtime CPU session, with ONNX Runtime's own K/V cache.

    Parameters
    ----------
    cfg : DecoderConfig
    w : DecoderWeights
    kv_round : {None, "bfloat16", "float16"}
        See :func:`build_onnx_model`.
    """

    def __init__(self, cfg: DecoderConfig, w: DecoderWeights, kv_round: Optional[str] = None):
        import onnxruntime as ort

        self.cfg = cfg
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        model = build_onnx_model(cfg, w, kv_round)
        self.session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])

    def generate(self, prompt, max_new_tokens: int) -> tuple[list[int], np.ndarray]:
        """Greedy generation for one request: prefill the prompt, then decode one token at a time.

        Parameters
        ----------
        prompt : int [N]
        max_new_tokens : int
            >= 1.

        Returns
        -------
        tokens : list of int, length ``max_new_tokens``
        logits : float32 [max_new_tokens, vocab]
            The logits each token was chosen from.
        """
        cfg = self.cfg
        prompt = [int(t) for t in prompt]
        if max_new_tokens < 1:
            raise ValueError(f"OrtDecoder.generate: max_new_tokens={max_new_tokens} must be >= 1")
        empty = np.zeros((1, cfg.kv_heads, 0, cfg.head_dim), np.float32)
        past = {f"past_{kind}_{l}": empty for l in range(cfg.num_layers) for kind in ("key", "value")}
        feed_tokens, total = prompt, 0
        out_tokens, out_logits = [], []
        for _ in range(max_new_tokens):
            total += len(feed_tokens)
            feeds = dict(past, input_ids=np.asarray([feed_tokens], np.int64),
                         seqlens_k=np.asarray([total - 1], np.int32),
                         total_sequence_length=np.asarray(total, np.int32))
            res = self.session.run(None, feeds)
            logits = res[0][0, -1]
            names = [o.name for o in self.session.get_outputs()]
            past = {n.replace("present_", "past_"): r for n, r in zip(names[1:], res[1:])}
            tok = int(np.argmax(logits))
            out_tokens.append(tok)
            out_logits.append(logits)
            feed_tokens = [tok]
        return out_tokens, np.stack(out_logits).astype(np.float32)
