"""The `gqa` flavour: the onnxruntime-genai model-builder layout with com.microsoft fused ops.

Per layer: (Skip)SimplifiedLayerNormalization, q/k/v projections, GroupQueryAttention with
rotary inside (cos/sin caches [context_length, rotary_dim/2]) and the KV write, o_proj, then
SkipSimplifiedLayerNormalization and the SiLU MLP. The attention mask only feeds two small
values: seqlens_k = sum(mask, 1) - 1 (int32) and total_sequence_length = mask.shape[1] (int32).
The same graph serves a growing KV cache (CPU) and a shared past/present buffer of
max_length (CUDA; genai_config says which).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnxgen.models.builder_parts import DecoderGraph, rotary_frequencies
from onnxgen.models.graph_writer import GraphWriter


def build_gqa(g: DecoderGraph) -> None:
    c, w = g.config, g.w
    declare_token_inputs(g)
    kv = g.declare_kv_io()
    seqlens_k, total_len = attention_lengths(w)
    cos_cache, sin_cache = rotary_caches(g)

    x, table = g.embedding("input_ids")
    residual = x
    layer_out = None
    eps = float(c.rms_norm_eps)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        ln_in = g.float_weight(p + "input_layernorm.weight", g.fetch(p + "input_layernorm.weight"))
        if layer_out is None:
            h = w.op(
                "SimplifiedLayerNormalization",
                x,
                ln_in,
                name=p + "input_layernorm/SimplifiedLayerNorm",
                axis=-1,
                epsilon=eps,
                stash_type=1,
            )
        else:
            h, residual = skip_norm(g, layer_out, residual, ln_in, p + "input_layernorm/SkipLayerNorm", eps)

        attn = p + "self_attn."
        q = g.linear(h, attn + "q_proj", bias=c.attention_bias)
        k = g.linear(h, attn + "k_proj", bias=c.attention_bias)
        v = g.linear(h, attn + "v_proj", bias=c.attention_bias)
        past_k, past_v, present_k, present_v = kv[i]
        gqa_out = w.node(
            "GroupQueryAttention",
            [q, k, v, past_k, past_v, seqlens_k, total_len, cos_cache, sin_cache],
            name=attn + "GroupQueryAttention",
            domain="com.microsoft",
            outputs=[attn + "GroupQueryAttention/output_0", present_k, present_v],
            num_heads=c.num_attention_heads,
            kv_num_heads=c.num_key_value_heads,
            scale=float(1.0 / np.sqrt(c.head_dim)),
            do_rotary=1,
            rotary_interleaved=int(c.rope_interleaved),
            local_window_size=-1,
            softcap=0.0,
        )[0]
        o = g.linear(gqa_out, attn + "o_proj")

        ln_post = g.float_weight(p + "post_attention_layernorm.weight", g.fetch(p + "post_attention_layernorm.weight"))
        h2, residual = skip_norm(g, o, residual, ln_post, p + "post_attention_layernorm/SkipLayerNorm", eps)
        layer_out = g.mlp(h2, i)

    norm = g.float_weight("model.norm.weight", g.fetch("model.norm.weight"))
    final = w.node(
        "SkipSimplifiedLayerNormalization",
        [layer_out, residual, norm],
        name="/model/norm/SkipLayerNorm",
        domain="com.microsoft",
        epsilon=eps,
    )[0]
    g.lm_head(final, table)


def declare_token_inputs(g: DecoderGraph) -> None:
    """input_ids and attention_mask in, logits out."""
    g.w.add_input("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"])
    g.w.add_input("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"])
    g.declare_logits()


def rotary_caches(g: DecoderGraph) -> tuple[str, str]:
    """GroupQueryAttention's cos and sin caches [context_length, rotary_dim / 2]."""
    angles = rotary_frequencies(g.config, g.opt.context_length)
    return (
        g.w.initializer("cos_cache", np.cos(angles).astype(g.opt.io_dtype)),
        g.w.initializer("sin_cache", np.sin(angles).astype(g.opt.io_dtype)),
    )


def attention_lengths(w: GraphWriter) -> tuple[str, str]:
    """The attention mask as the two lengths GroupQueryAttention wants: seqlens_k = sum(mask, 1) - 1
    and total_sequence_length = mask.shape[1] (int32)."""
    mask_sum = w.op("ReduceSum", "attention_mask", w.const([1]), name="/model/attn_mask/ReduceSum", keepdims=0)
    seqlens = w.op("Sub", mask_sum, w.const(1), name="/model/attn_mask/Sub")
    seqlens_k = w.op("Cast", seqlens, name="/model/attn_mask/seqlens_k", to=TensorProto.INT32)
    mask_shape = w.op("Shape", "attention_mask", name="/model/attn_mask/Shape")
    total = w.op("Gather", mask_shape, w.const(1), name="/model/attn_mask/Gather", axis=0)
    return seqlens_k, w.op("Cast", total, name="/model/attn_mask/total_seq_len", to=TensorProto.INT32)


def skip_norm(g: DecoderGraph, x: str, skip: str, gamma: str, name: str, eps: float) -> tuple[str, str]:
    """SkipSimplifiedLayerNormalization: returns (normalized, x + skip) — the new residual stream."""
    out, _, _, summed = g.w.node(
        "SkipSimplifiedLayerNormalization",
        [x, skip, gamma],
        name=name,
        domain="com.microsoft",
        outputs=[f"{name}/output_0", "", "", f"{name}/output_3"],
        epsilon=eps,
    )
    return out, summed
