"""The hybrid flavour: decoders whose layers are either full attention or Gated DeltaNet linear
attention (config.layer_types), written with com.microsoft ops as onnxruntime-genai's builder
writes them.

Full-attention layers are the `gqa` flavour's, plus what these models add: an RMSNorm over each
head of q and k (qk_norm), and a per-head output gate taken from a q_proj twice the heads' width
(attn_output_gate: the attention output times sigmoid(gate)). A Gated DeltaNet layer:

    qkv = in_proj_qkv(h)          CausalConvWithState (channels last, SiLU) over it, carrying the
                                  last k - 1 positions in past.N.conv / present.N.conv
    q, k, v = split(qkv)          q and k L2-normalised per head (epsilon inside), k repeated to
                                  the value heads where there are more of them
    decay, beta = LinearAttentionGate(in_proj_a(h), dt_bias, -exp(A_log), in_proj_b(h))
    o = LinearAttention(q, k, v, past.N.recurrent, decay, beta)   (gated delta rule; query heads
                                  shared by value heads as inverse GQA)
    out_proj(GatedRMSNorm(o, norm.weight, in_proj_z(h)))

Where every layer's MLP is a mixture of experts (config.moe) it is MoE over the routed experts
plus a shared expert behind a sigmoid gate. Every RMSNorm multiplies by (norm_offset + weight),
folded into its weight here. Rotary positions
come from the attention mask as in the `gqa` flavour: a text-only package, whose three multimodal
position rows would all be equal, so the rotation is the plain partial one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from onnxgen.models.builder_gqa import attention_lengths, declare_token_inputs, rotary_caches, skip_norm
from onnxgen.models.builder_parts import BuildError, DecoderGraph, q4_tensors

MS = "com.microsoft"


def state_io_names(layer: int) -> tuple[str, str, str, str]:
    """A Gated DeltaNet layer's carried state: (past conv, past recurrent, present conv, present recurrent)."""
    return f"past.{layer}.conv", f"past.{layer}.recurrent", f"present.{layer}.conv", f"present.{layer}.recurrent"


def build_hybrid(g: DecoderGraph) -> None:
    c, w = g.config, g.w
    la = c.linear_attention
    if la is None:
        raise BuildError("a hybrid build needs the linear-attention layers' dimensions (config.linear_attention)")
    declare_token_inputs(g)
    kv = _declare_io(g)
    seqlens_k, total_len = attention_lengths(w)
    cos_cache, sin_cache = rotary_caches(g)

    x, table = g.embedding("input_ids")
    residual, layer_out = x, None
    eps = float(c.rms_norm_eps)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        ln_in = _norm_weight(g, p + "input_layernorm.weight")
        if layer_out is None:
            h = w.op("SimplifiedLayerNormalization", x, ln_in, name=p + "input_layernorm/SimplifiedLayerNorm",
                     axis=-1, epsilon=eps, stash_type=1)  # fmt: skip
        else:
            h, residual = skip_norm(g, layer_out, residual, ln_in, p + "input_layernorm/SkipLayerNorm", eps)
        if c.is_linear(i):
            mixed = _gated_delta_net(g, h, i)
        else:
            mixed = _full_attention(g, h, i, kv[i], seqlens_k, total_len, cos_cache, sin_cache)
        ln_post = _norm_weight(g, p + "post_attention_layernorm.weight")
        h2, residual = skip_norm(g, mixed, residual, ln_post, p + "post_attention_layernorm/SkipLayerNorm", eps)
        layer_out = g.mlp(h2, i) if c.moe is None else _mixture_of_experts(g, h2, i)

    norm = _norm_weight(g, "model.norm.weight")
    final = w.node("SkipSimplifiedLayerNormalization", [layer_out, residual, norm], name="/model/norm/SkipLayerNorm",
                   domain=MS, epsilon=eps)[0]  # fmt: skip
    g.lm_head(final, table)


def _declare_io(g: DecoderGraph) -> dict[int, tuple[str, str, str, str]]:
    """Per layer: the KV cache of a full-attention layer, the conv and recurrent states of a Gated
    DeltaNet layer (fixed sizes: [batch, k - 1, conv channels] and [batch, value heads, key dim,
    value dim])."""
    c, w, la = g.config, g.w, g.config.linear_attention
    assert la is not None
    io: dict[int, tuple[str, str, str, str]] = {}
    for i in range(c.num_hidden_layers):
        if c.is_linear(i):
            names = state_io_names(i)
            conv = ["batch_size", la.conv_kernel - 1, la.conv_dim]
            recurrent = ["batch_size", la.num_value_heads, la.key_head_dim, la.value_head_dim]
            for name, shape in zip(names, (conv, recurrent, conv, recurrent)):
                (w.add_input if name.startswith("past") else w.add_output)(name, g.opt.io_type, shape)
        else:
            names = (f"past_key_values.{i}.key", f"past_key_values.{i}.value", f"present.{i}.key", f"present.{i}.value")
            for name in names:
                length = "past_sequence_length" if name.startswith("past") else "total_sequence_length"
                shape = ["batch_size", c.num_key_value_heads, length, c.head_dim]
                (w.add_input if name.startswith("past") else w.add_output)(name, g.opt.io_type, shape)
        io[i] = names
    return io


def _norm_weight(g: DecoderGraph, name: str) -> str:
    return g.float_weight(name, g.config.norm_offset + g.fetch(name))


def _heads_norm(g: DecoderGraph, x: str, heads: int, dim: int, weight: str, name: str) -> str:
    """RMSNorm over each head of a packed [B, S, heads * dim] tensor."""
    w = g.w
    split = w.op("Reshape", x, w.const([0, 0, heads, dim]), name=name + "/Reshape")
    normed = w.op("SimplifiedLayerNormalization", split, _norm_weight(g, weight), name=name + "/SimplifiedLayerNorm",
                  axis=-1, epsilon=float(g.config.rms_norm_eps), stash_type=1)  # fmt: skip
    return w.op("Reshape", normed, w.const([0, 0, heads * dim]), name=name + "/Reshape_out")


def _full_attention(g, h, layer, kv, seqlens_k, total_len, cos_cache, sin_cache) -> str:
    c, w = g.config, g.w
    attn = f"model.layers.{layer}.self_attn."
    heads, hd = c.num_attention_heads, c.head_dim
    q = g.linear(h, attn + "q_proj", bias=c.attention_bias)
    gate = None
    if c.attn_output_gate:  # per head: [query (hd) | gate (hd)]
        both = w.op("Reshape", q, w.const([0, 0, heads, 2 * hd]), name=attn + "q_gate/Reshape")
        q_heads, gate_heads = w.node("Split", [both, w.const([hd, hd])], num_outputs=2,
                                     name=attn + "q_gate/Split", axis=-1)  # fmt: skip
        q = w.op("Reshape", q_heads, w.const([0, 0, heads * hd]), name=attn + "q/Reshape")
        gate = w.op("Reshape", gate_heads, w.const([0, 0, heads * hd]), name=attn + "gate/Reshape")
    k = g.linear(h, attn + "k_proj", bias=c.attention_bias)
    v = g.linear(h, attn + "v_proj", bias=c.attention_bias)
    if c.qk_norm:
        q = _heads_norm(g, q, heads, hd, attn + "q_norm.weight", attn + "q_norm")
        k = _heads_norm(g, k, c.num_key_value_heads, hd, attn + "k_norm.weight", attn + "k_norm")
    past_k, past_v, present_k, present_v = kv
    out = w.node(
        "GroupQueryAttention", [q, k, v, past_k, past_v, seqlens_k, total_len, cos_cache, sin_cache],
        name=attn + "GroupQueryAttention", domain=MS, outputs=[attn + "GroupQueryAttention/output_0", present_k,
        present_v], num_heads=heads, kv_num_heads=c.num_key_value_heads, scale=float(1.0 / np.sqrt(hd)),
        do_rotary=1, rotary_interleaved=int(c.rope_interleaved), local_window_size=-1, softcap=0.0,
    )[0]  # fmt: skip
    if gate is not None:
        out = w.op("Mul", out, w.op("Sigmoid", gate, name=attn + "gate/Sigmoid"), name=attn + "gate/Mul")
    return g.linear(out, attn + "o_proj")


def _gated_delta_net(g: DecoderGraph, h: str, layer: int) -> str:
    c, w, la = g.config, g.w, g.config.linear_attention
    assert la is not None
    p = f"model.layers.{layer}.linear_attn."
    past_conv, past_rec, present_conv, present_rec = state_io_names(layer)
    qkv = g.linear(h, p + "in_proj_qkv")
    z = g.linear(h, p + "in_proj_z")
    b = g.linear(h, p + "in_proj_b")
    a = g.linear(h, p + "in_proj_a")
    conv_w = g.float_weight(p + "conv1d.weight", g.fetch(p + "conv1d.weight"))
    mixed = w.node("CausalConvWithState", [qkv, conv_w, "", past_conv], name=p + "conv1d", domain=MS,
                   outputs=[p + "conv1d/output_0", present_conv], activation="silu", channels_last=1)[0]  # fmt: skip
    sizes = w.const([la.key_dim, la.key_dim, la.value_dim])
    q, k, v = w.node("Split", [mixed, sizes], 3, name=p + "qkv/Split", axis=-1)
    q = _l2_heads(g, q, la.num_key_heads, la.key_head_dim, p + "q_l2norm")
    k = _l2_heads(g, k, la.num_key_heads, la.key_head_dim, p + "k_l2norm")
    repeat = la.num_value_heads // la.num_key_heads
    if repeat > 1:  # each key head serves `repeat` value heads, in order (the query's inverse GQA)
        k5 = w.op("Reshape", k, w.const([0, 0, la.num_key_heads, 1, la.key_head_dim]), name=p + "k_repeat/Reshape")
        tiled = w.op("Tile", k5, w.const([1, 1, 1, repeat, 1]), name=p + "k_repeat/Tile")
        k = w.op("Reshape", tiled, w.const([0, 0, la.value_dim // la.value_head_dim * la.key_head_dim]),
                 name=p + "k_repeat/Reshape_out")  # fmt: skip
    # LinearAttentionGate's schema (com.microsoft) types dt_bias and decay_scale as float32 whatever the
    # activations' dtype: onnxruntime refuses to load an fp16 graph that stores them in fp16
    dt_bias = w.initializer(p + "dt_bias", g.fetch(p + "dt_bias").astype(np.float32))
    decay_scale = w.initializer(p + "A_log.decay_scale", (-np.exp(g.fetch(p + "A_log").astype(np.float32))))
    decay, beta = w.node("LinearAttentionGate", [a, dt_bias, decay_scale, b], 2, name=p + "gate", domain=MS)
    o = w.node(
        "LinearAttention", [q, k, v, past_rec, decay, beta], name=p + "LinearAttention", domain=MS,
        outputs=[p + "LinearAttention/output_0", present_rec], q_num_heads=la.num_key_heads,
        kv_num_heads=la.num_value_heads, update_rule="gated_delta",
    )[0]  # fmt: skip
    norm_w = g.float_weight(p + "norm.weight", g.fetch(p + "norm.weight"))
    normed = w.op("GatedRMSNorm", o, norm_w, z, name=p + "norm", domain=MS, activation="silu",
                  epsilon=float(c.rms_norm_eps))  # fmt: skip
    return g.linear(normed, p + "out_proj")


L2_NORM_EPS = 1e-6  # inside the square root, as the reference Gated DeltaNet normalizes q and k


def _l2_heads(g: DecoderGraph, x: str, heads: int, dim: int, name: str) -> str:
    """x / sqrt(sum(x^2) + L2_NORM_EPS) per head: with the epsilon, not LpNormalization, whose
    plain norm departs from the reference where a head's activations are small."""
    w = g.w
    split = w.op("Reshape", x, w.const([0, 0, heads, dim]), name=name + "/Reshape")
    squares = w.op("ReduceSumSquare", split, w.const([-1]), name=name + "/ReduceSumSquare", keepdims=1)
    norm = w.op("Sqrt", w.op("Add", squares, g.io_const(L2_NORM_EPS), name=name + "/Add"), name=name + "/Sqrt")
    normed = w.op("Div", split, norm, name=name + "/Div")
    return w.op("Reshape", normed, w.const([0, 0, heads * dim]), name=name + "/Reshape_out")


def _mixture_of_experts(g: DecoderGraph, h: str, layer: int) -> str:
    """The sparse MLP: MoE (com.microsoft) over the routed experts, plus the shared expert behind
    sigmoid(shared_expert_gate(h)). The router's logits go to MoE as [tokens, experts] (its softmax
    and top k are inside); each expert's gate and up projections are written interleaved row by
    row (swiglu_fusion 1), the one layout onnxruntime's CPU kernel takes."""
    w, moe = g.w, g.config.moe
    assert moe is not None
    p = f"model.layers.{layer}.mlp."
    logits = g.linear(h, p + "gate")
    router = w.op("Reshape", logits, w.const([-1, moe.num_experts]), name=p + "router/Reshape")
    routing = dict(k=moe.top_k, normalize_routing_weights=int(moe.normalize), activation_type="swiglu",
                   swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0)  # fmt: skip
    if g.opt.precision == "int4":
        q1, q2 = _quantized_experts(g, layer)
        inputs = [h, router, q1[0], q1[1], "", q2[0], q2[1], "", "", "", "", q1[2], q2[2]]
        routed = w.op("QMoE", *inputs, name=p + "QMoE", domain=MS, expert_weight_bits=4,
                      block_size=g.opt.block_size, **routing)  # fmt: skip
    else:
        experts = range(moe.num_experts)
        # [experts, 2 * inter, hidden], rows g0, u0, g1, u1, ... of each expert's gate and up
        fc1 = np.stack([_gate_up(g.fetch, p, e) for e in experts])
        fc2 = np.stack([g.fetch(f"{p}experts.{e}.down_proj.weight") for e in experts])  # [experts, hidden, inter]
        fc1_name = g.float_weight(p + "experts.fc1", fc1)
        fc2_name = g.float_weight(p + "experts.fc2", fc2)
        del fc1, fc2
        routed = w.op("MoE", h, router, fc1_name, "", fc2_name, name=p + "MoE", domain=MS, **routing)
    sp = p + "shared_expert."
    shared_gate = g.linear(h, sp + "gate_proj")
    act = w.op("Mul", shared_gate, w.op("Sigmoid", shared_gate, name=sp + "act/Sigmoid"), name=sp + "act/Mul")
    shared = g.linear(w.op("Mul", act, g.linear(h, sp + "up_proj"), name=sp + "Mul"), sp + "down_proj")
    weight = w.op("Sigmoid", g.linear(h, p + "shared_expert_gate"), name=p + "shared_expert_gate/Sigmoid")
    gated = w.op("Mul", shared, weight, name=p + "shared_expert_gate/Mul")
    return w.op("Add", routed, gated, name=p + "Add")


def _gate_up(fetch: Callable[[str], np.ndarray], p: str, e: int) -> np.ndarray:
    """Expert e's gate and up projections interleaved row by row: [2 * inter, hidden], rows g0, u0, g1, u1, ..."""
    gate, up = fetch(f"{p}experts.{e}.gate_proj.weight"), fetch(f"{p}experts.{e}.up_proj.weight")
    return np.stack([gate, up], axis=1).reshape(2 * gate.shape[0], -1)


def _quantized_experts(g: DecoderGraph, layer: int) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
    """QMoE's 4-bit tensors of the layer's experts, fc1 (gate and up interleaved) and fc2 (down),
    blocks along K (the builder's block size, as MatMulNBits quantizes): codes [experts, N, K / 2]
    (low nibble first), scales [experts, N, K / block] and packed zero points [experts, N,
    ceil(blocks / 2)]; their names. The build pool computes them ahead in runs of experts where
    it has them; the rest are computed here, by the same function."""
    moe = g.config.moe
    assert moe is not None
    p = f"model.layers.{layer}.mlp."
    for what, k in (("gate/up", g.config.hidden_size), ("down", moe.expert_intermediate)):
        if k % g.opt.block_size:
            raise BuildError(f"{p}experts: the {what} projections' in_features {k} is not a multiple of the int4 "
                             f"block size {g.opt.block_size} (QMoE quantizes whole blocks)")  # fmt: skip
    parts, start = [], 0
    while start < moe.num_experts:
        run = g.pool.take(("experts", layer, start)) if g.pool is not None else None
        if run is None:
            run = quantize_experts(g.fetch, layer, range(start, moe.num_experts), g.opt.block_size)
        else:
            for name in expert_weight_names(layer, range(start, start + len(run[0]))):
                g.fetched(name)
        parts.append(run)
        start += len(run[0])
    names = []
    for index, prefix in enumerate((p + "experts.fc1", p + "experts.fc2")):
        codes, scales, zeros = ([part[3 * index + j] for part in parts] for j in range(3))
        names.append((
            g.w.stacked_initializer(prefix + ".qweight", codes),
            g.w.stacked_initializer(prefix + ".scales", [g.cast(prefix + " scales", s) for s in scales]),
            g.w.stacked_initializer(prefix + ".qzeros", zeros),
        ))  # fmt: skip
    return names[0], names[1]


def expert_weight_names(layer: int, experts: range) -> list[str]:
    """The weights quantize_experts reads for `experts` of `layer`, in the order it reads them."""
    p = f"model.layers.{layer}.mlp.experts."
    return [f"{p}{e}.{proj}_proj.weight" for e in experts for proj in ("gate", "up", "down")]


def quantize_experts(
    fetch: Callable[[str], np.ndarray], layer: int, experts: range, block_size: int
) -> tuple[np.ndarray, ...]:
    """QMoE's tensors for a run of a layer's experts, one expert at a time (never the run's float
    weights at once): fc1's codes, scales (float32) and zero points, then fc2's, each stacked over
    the run. Quantizing rows one at a time, interleaved or not, gives the same rows (blocks run
    along K), so fc1's rows are the gate's and the up's quantized apart and interleaved. A pure
    function of the weights: the build pool's workers run it too."""
    p = f"model.layers.{layer}.mlp."
    out: list[list[np.ndarray]] = [[] for _ in range(6)]
    for e in experts:
        gate, up, down = (q4_tensors(fetch(f"{p}experts.{e}.{proj}_proj.weight"), block_size, "packed")
                          for proj in ("gate", "up", "down"))  # fmt: skip
        fc1 = [np.stack([a.reshape(gate.n, -1), b.reshape(up.n, -1)], axis=1).reshape(gate.n + up.n, -1)
               for a, b in ((gate.b, up.b), (gate.scales, up.scales), (gate.zero_points, up.zero_points))]  # fmt: skip
        fc2 = [t.reshape(down.n, -1) for t in (down.b, down.scales, down.zero_points)]
        for stacked, tensor in zip(out, fc1 + fc2):
            stacked.append(tensor)
    return tuple(np.stack(stacked) for stacked in out)
