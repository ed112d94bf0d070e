"""Architecture facts of a decoder model, independent of where the weights come from.

Every behaviour of the builder follows from these values (no model-name checks). Sources
(GGUF metadata, a Hugging Face config.json, a random-weights spec) fill this in; a missing
fact fails with a clear message instead of being guessed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class LinearAttentionSpec:
    """The Gated DeltaNet layers of a hybrid decoder: a depthwise causal convolution over the
    concatenated q/k/v projections, then the gated delta rule over per-head recurrent states."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class MoESpec:
    """Every layer's MLP as a mixture of experts: softmax top-k routing over ``num_experts``
    SwiGLU experts (renormalized where ``normalize``), plus a shared expert behind a sigmoid gate."""

    num_experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int
    normalize: bool = True


@dataclass
class DecoderConfig:
    architecture: str  # family as the source names it ("llama", "qwen2"); informative only
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # the context length packages are built for
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (qwen2 family)
    rope_interleaved: bool = False  # HF layout rotates halves; GGUF llama Q/K are un-permuted on read
    partial_rotary_factor: float = 1.0
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    name: str = ""  # display name for packages and progress (never used to pick behaviour)
    # hybrid decoders: "full_attention" or "linear_attention" per layer (empty: every layer full)
    layer_types: list[str] = field(default_factory=list)
    linear_attention: LinearAttentionSpec | None = None
    attn_output_gate: bool = False  # q_proj also yields a per-head gate: output * sigmoid(gate)
    qk_norm: bool = False  # RMSNorm over each head of q and k before the rotary embedding
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + weight): 1.0 for zero-centred weights
    moe: MoESpec | None = None  # every layer's MLP a mixture of experts (None: dense MLPs)

    def is_linear(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class WeightSource(Protocol):
    """Weights by Hugging Face parameter name, as float32 numpy arrays in HF layout.

    Names: model.embed_tokens.weight; model.layers.{i}.input_layernorm.weight;
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight (and {q,k,v}_proj.bias when attention_bias);
    model.layers.{i}.post_attention_layernorm.weight; model.layers.{i}.mlp.{gate,up,down}_proj.weight;
    model.norm.weight; lm_head.weight (absent when tie_word_embeddings).
    Linear weights are [out_features, in_features] like torch.nn.Linear.
    """

    config: DecoderConfig

    def names(self) -> list[str]: ...

    def get(self, name: str) -> np.ndarray: ...


LINEAR_ATTENTION_WEIGHTS = (
    "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight", "dt_bias",
    "A_log", "norm.weight", "out_proj.weight",
)  # fmt: skip


MOE_SHARED_WEIGHTS = (
    "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight", "shared_expert.down_proj.weight",
    "shared_expert_gate.weight",
)  # fmt: skip


def moe_weight_names(moe: MoESpec) -> Iterator[str]:
    """A sparse MLP's weights under its layer's "mlp." prefix, as checkpoints store them (one
    tensor per expert and projection)."""
    yield "gate.weight"
    for e in range(moe.num_experts):
        for proj in ("gate", "up", "down"):
            yield f"experts.{e}.{proj}_proj.weight"
    yield from MOE_SHARED_WEIGHTS


def iter_layer_names(config: DecoderConfig) -> Iterator[str]:
    """Every weight name a complete source must provide, in build order."""
    yield "model.embed_tokens.weight"
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight"
        if config.is_linear(i):
            yield from (p + "linear_attn." + name for name in LINEAR_ATTENTION_WEIGHTS)
        else:
            for proj in ("q", "k", "v"):
                yield p + f"self_attn.{proj}_proj.weight"
                if config.attention_bias:
                    yield p + f"self_attn.{proj}_proj.bias"
            if config.qk_norm:
                yield p + "self_attn.q_norm.weight"
                yield p + "self_attn.k_norm.weight"
            yield p + "self_attn.o_proj.weight"
        yield p + "post_attention_layernorm.weight"
        if config.moe is not None:
            yield from (p + "mlp." + name for name in moe_weight_names(config.moe))
            continue
        for proj in ("gate", "up", "down"):
            yield p + f"mlp.{proj}_proj.weight"
    yield "model.norm.weight"
    if not config.tie_word_embeddings:
        yield "lm_head.weight"


def weight_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """The HF-layout shape of every weight iter_layer_names names, in the same order."""
    c = config
    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    la = c.linear_attention
    linear = {}
    if la is not None:
        h, nv = c.hidden_size, la.num_value_heads
        linear = {
            "linear_attn.in_proj_qkv.weight": (la.conv_dim, h),
            "linear_attn.in_proj_z.weight": (la.value_dim, h),
            "linear_attn.in_proj_b.weight": (nv, h),
            "linear_attn.in_proj_a.weight": (nv, h),
            "linear_attn.conv1d.weight": (la.conv_dim, 1, la.conv_kernel),
            "linear_attn.dt_bias": (nv,),
            "linear_attn.A_log": (nv,),
            "linear_attn.norm.weight": (la.value_head_dim,),
            "linear_attn.out_proj.weight": (h, la.value_dim),
        }
    moe = {}
    if c.moe is not None:
        h, e, inter, shared = c.hidden_size, c.moe.num_experts, c.moe.expert_intermediate, c.moe.shared_intermediate
        moe = {
            "mlp.gate.weight": (e, h),
            **{f"mlp.experts.{i}.{proj}_proj.weight": (inter, h) for i in range(e) for proj in ("gate", "up")},
            **{f"mlp.experts.{i}.down_proj.weight": (h, inter) for i in range(e)},
            "mlp.shared_expert.gate_proj.weight": (shared, h),
            "mlp.shared_expert.up_proj.weight": (shared, h),
            "mlp.shared_expert.down_proj.weight": (h, shared),
            "mlp.shared_expert_gate.weight": (1, h),
        }
    by_suffix = {
        **linear,
        **moe,
        "self_attn.q_norm.weight": (c.head_dim,),
        "self_attn.k_norm.weight": (c.head_dim,),
        "input_layernorm.weight": (c.hidden_size,),
        "post_attention_layernorm.weight": (c.hidden_size,),
        "self_attn.q_proj.weight": (q_out * (2 if c.attn_output_gate else 1), c.hidden_size),
        "self_attn.k_proj.weight": (kv_out, c.hidden_size),
        "self_attn.v_proj.weight": (kv_out, c.hidden_size),
        "self_attn.q_proj.bias": (q_out,),
        "self_attn.k_proj.bias": (kv_out,),
        "self_attn.v_proj.bias": (kv_out,),
        "self_attn.o_proj.weight": (c.hidden_size, q_out),
        "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
    }
    top = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
        "lm_head.weight": (c.vocab_size, c.hidden_size),
    }
    return {n: top[n] if n in top else by_suffix[n.split(".", 3)[3]] for n in iter_layer_names(c)}
