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


def iter_layer_names(config: DecoderConfig) -> Iterator[str]:
    """Every weight name a complete source must provide, in build order."""
    yield "model.embed_tokens.weight"
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight"
        for proj in ("q", "k", "v"):
            yield p + f"self_attn.{proj}_proj.weight"
            if config.attention_bias:
                yield p + f"self_attn.{proj}_proj.bias"
        yield p + "self_attn.o_proj.weight"
        yield p + "post_attention_layernorm.weight"
        for proj in ("gate", "up", "down"):
            yield p + f"mlp.{proj}_proj.weight"
    yield "model.norm.weight"
    if not config.tie_word_embeddings:
        yield "lm_head.weight"


def weight_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """The HF-layout shape of every weight iter_layer_names names, in the same order."""
    c = config
    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    by_suffix = {
        "input_layernorm.weight": (c.hidden_size,),
        "post_attention_layernorm.weight": (c.hidden_size,),
        "self_attn.q_proj.weight": (q_out, c.hidden_size),
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
