"""The `standard` flavour: default-domain ONNX ops only (opset 21), as PyTorch exporters write it.

Inputs input_ids, attention_mask and position_ids; the KV cache grows by Concat(past, new) on
the sequence axis. RMSNorm, rotary (halves or interleaved pairs), the causal+padding mask and
grouped KV heads are all written out in plain ops. In fp16, RMSNorm and softmax run in fp32
through Casts, like the Hugging Face reference does.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnxgen.models.builder_parts import DecoderGraph, rotary_dim, rotary_frequencies


def build_standard(g: DecoderGraph) -> None:
    c, w = g.config, g.w
    for name, shape in (
        ("input_ids", ["batch_size", "sequence_length"]),
        ("attention_mask", ["batch_size", "total_sequence_length"]),
        ("position_ids", ["batch_size", "sequence_length"]),
    ):
        w.add_input(name, TensorProto.INT64, shape)
    g.declare_logits()
    kv = g.declare_kv_io()

    allowed = _attention_allowed(g)
    cos, sin = _rotary_tables(g)

    x, table = g.embedding("input_ids")
    eps = float(c.rms_norm_eps)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        h = _rms_norm(g, x, p + "input_layernorm", eps)
        attn_out = _attention(g, h, i, kv[i], allowed, cos, sin)
        x = w.op("Add", x, attn_out, name=p + "residual_attn/Add")
        h2 = _rms_norm(g, x, p + "post_attention_layernorm", eps)
        x = w.op("Add", x, g.mlp(h2, i), name=p + "residual_mlp/Add")
    g.lm_head(_rms_norm(g, x, "model.norm", eps), table)


def _attention_allowed(g: DecoderGraph) -> str:
    """Bool [batch, 1, seq, total]: key j is visible to query i (at cache slot past+i) if j <= past+i
    and attention_mask[b, j] is set."""
    w = g.w
    p = "/model/attn_mask/"
    total = w.op(
        "Gather", w.op("Shape", "attention_mask", name=p + "Shape_total"), w.const(1), name=p + "total", axis=0
    )
    seq = w.op("Gather", w.op("Shape", "input_ids", name=p + "Shape_seq"), w.const(1), name=p + "seq", axis=0)
    past = w.op("Sub", total, seq, name=p + "past")
    rows = w.op("Range", past, total, w.const(1), name=p + "rows")
    cols = w.op("Range", w.const(0), total, w.const(1), name=p + "cols")
    causal = w.op(
        "LessOrEqual",
        w.op("Unsqueeze", cols, w.const([0]), name=p + "cols_2d"),
        w.op("Unsqueeze", rows, w.const([1]), name=p + "rows_2d"),
        name=p + "causal",
    )
    padding = w.op("Cast", "attention_mask", name=p + "padding", to=TensorProto.BOOL)
    padding = w.op("Unsqueeze", padding, w.const([1, 2]), name=p + "padding_4d")
    return w.op("And", causal, padding, name=p + "allowed")


def _rotary_tables(g: DecoderGraph) -> tuple[str, str]:
    """cos/sin rows for position_ids, shaped [batch, 1, seq, rotary_dim] to broadcast over heads."""
    c, w = g.config, g.w
    angles = rotary_frequencies(c, g.opt.context_length)
    # Halves layout pairs element i with i + d/2 (same angle); interleaved pairs 2i with 2i+1.
    angles = np.repeat(angles, 2, axis=1) if c.rope_interleaved else np.concatenate([angles, angles], axis=1)
    out = []
    for fn, name in ((np.cos, "cos"), (np.sin, "sin")):
        table = w.initializer(f"rotary.{name}_table", fn(angles).astype(g.opt.io_dtype))
        rows = w.op("Gather", table, "position_ids", name=f"/model/rotary/{name}/Gather")
        out.append(w.op("Unsqueeze", rows, w.const([1]), name=f"/model/rotary/{name}/Unsqueeze"))
    return out[0], out[1]


def _rms_norm(g: DecoderGraph, x: str, prefix: str, eps: float) -> str:
    """weight * x / sqrt(mean(x^2) + eps), the statistics in fp32."""
    w = g.w
    n = prefix + "/RMSNorm/"
    xf = w.op("Cast", x, name=n + "Cast_in", to=TensorProto.FLOAT) if g.opt.io_type != TensorProto.FLOAT else x
    sq = w.op("Pow", xf, w.const(2.0, np.float32), name=n + "Pow")
    mean = w.op("ReduceMean", sq, w.const([-1]), name=n + "ReduceMean", keepdims=1)
    std = w.op("Sqrt", w.op("Add", mean, w.const(eps, np.float32), name=n + "Add_eps"), name=n + "Sqrt")
    y = w.op("Mul", xf, w.op("Reciprocal", std, name=n + "Reciprocal"), name=n + "Mul")
    if g.opt.io_type != TensorProto.FLOAT:
        y = w.op("Cast", y, name=n + "Cast_out", to=g.opt.io_type)
    weight = g.float_weight(prefix + ".weight", g.fetch(prefix + ".weight"))
    return w.op("Mul", y, weight, name=n + "Mul_weight")


def _heads(g: DecoderGraph, x: str, heads: int, name: str) -> str:
    """[batch, seq, heads*head_dim] -> [batch, heads, seq, head_dim]."""
    r = g.w.op("Reshape", x, g.w.const([0, 0, heads, g.config.head_dim]), name=name + "/Reshape")
    return g.w.op("Transpose", r, name=name + "/Transpose", perm=[0, 2, 1, 3])


def _rotate(g: DecoderGraph, x: str, cos: str, sin: str, name: str) -> str:
    """x * cos + rotate(x) * sin on the first rotary_dim channels; the rest passes through."""
    c, w = g.config, g.w
    dim, half = rotary_dim(c), rotary_dim(c) // 2
    axis = w.const([3])
    part = x if dim == c.head_dim else w.op("Slice", x, w.const([0]), w.const([dim]), axis, name=name + "/Slice_rot")
    if c.rope_interleaved:
        pairs = w.op("Reshape", part, w.const([0, 0, 0, half, 2]), name=name + "/Reshape_pairs")
        even = w.op("Slice", pairs, w.const([0]), w.const([1]), w.const([4]), name=name + "/Slice_even")
        odd = w.op("Slice", pairs, w.const([1]), w.const([2]), w.const([4]), name=name + "/Slice_odd")
        swapped = w.op("Concat", w.op("Neg", odd, name=name + "/Neg"), even, name=name + "/Concat_pairs", axis=4)
        rotated = w.op("Reshape", swapped, w.const([0, 0, 0, dim]), name=name + "/Reshape_back")
    else:
        first = w.op("Slice", part, w.const([0]), w.const([half]), axis, name=name + "/Slice_first")
        second = w.op("Slice", part, w.const([half]), w.const([dim]), axis, name=name + "/Slice_second")
        rotated = w.op("Concat", w.op("Neg", second, name=name + "/Neg"), first, name=name + "/Concat_half", axis=3)
    out = w.op(
        "Add",
        w.op("Mul", part, cos, name=name + "/Mul_cos"),
        w.op("Mul", rotated, sin, name=name + "/Mul_sin"),
        name=name + "/Add",
    )
    if dim == c.head_dim:
        return out
    rest = w.op("Slice", x, w.const([dim]), w.const([c.head_dim]), axis, name=name + "/Slice_pass")
    return w.op("Concat", out, rest, name=name + "/Concat_pass", axis=3)


def _attention(
    g: DecoderGraph, h: str, layer: int, kv: tuple[str, str, str, str], allowed: str, cos: str, sin: str
) -> str:
    c, w = g.config, g.w
    p = f"model.layers.{layer}.self_attn."
    past_k, past_v, present_k, present_v = kv
    q = _heads(g, g.linear(h, p + "q_proj", bias=c.attention_bias), c.num_attention_heads, p + "q")
    k = _heads(g, g.linear(h, p + "k_proj", bias=c.attention_bias), c.num_key_value_heads, p + "k")
    v = _heads(g, g.linear(h, p + "v_proj", bias=c.attention_bias), c.num_key_value_heads, p + "v")
    q = _rotate(g, q, cos, sin, p + "q_rotary")
    k = _rotate(g, k, cos, sin, p + "k_rotary")
    w.node("Concat", [past_k, k], name=p + "present_key/Concat", outputs=[present_k], axis=2)
    w.node("Concat", [past_v, v], name=p + "present_value/Concat", outputs=[present_v], axis=2)
    keys, values = _repeat_kv(g, present_k, p + "k_repeat"), _repeat_kv(g, present_v, p + "v_repeat")

    kt = w.op("Transpose", keys, name=p + "k/Transpose_T", perm=[0, 1, 3, 2])
    scores = w.op("MatMul", q, kt, name=p + "scores/MatMul")
    scores = w.op("Mul", scores, g.io_const(1.0 / np.sqrt(c.head_dim)), name=p + "scores/Mul_scale")
    if g.opt.io_type != TensorProto.FLOAT:
        scores = w.op("Cast", scores, name=p + "scores/Cast_fp32", to=TensorProto.FLOAT)
    # Where, not an additive mask: a fully masked row (left padding) stays finite and uniform.
    lowest = w.const(np.finfo(np.float32).min, np.float32)
    scores = w.op("Where", allowed, scores, lowest, name=p + "scores/Where_mask")
    probs = w.op("Softmax", scores, name=p + "Softmax", axis=-1)
    if g.opt.io_type != TensorProto.FLOAT:
        probs = w.op("Cast", probs, name=p + "probs/Cast", to=g.opt.io_type)
    ctx = w.op("MatMul", probs, values, name=p + "context/MatMul")
    ctx = w.op("Transpose", ctx, name=p + "context/Transpose", perm=[0, 2, 1, 3])
    ctx = w.op("Reshape", ctx, w.const([0, 0, c.num_attention_heads * c.head_dim]), name=p + "context/Reshape")
    return g.linear(ctx, p + "o_proj")


def _repeat_kv(g: DecoderGraph, x: str, name: str) -> str:
    """[batch, kv_heads, total, d] -> [batch, heads, total, d], each KV head serving heads/kv_heads queries."""
    c, w = g.config, g.w
    n_rep = c.num_attention_heads // c.num_key_value_heads
    if n_rep == 1:
        return x
    x5 = w.op("Unsqueeze", x, w.const([2]), name=name + "/Unsqueeze")
    wide = w.op("Expand", x5, w.const([1, 1, n_rep, 1, 1]), name=name + "/Expand")
    return w.op("Reshape", wide, w.const([0, c.num_attention_heads, -1, c.head_dim]), name=name + "/Reshape")
