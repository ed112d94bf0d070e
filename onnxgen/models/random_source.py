"""Random weights for any DecoderConfig: for tests, and for speed work in a real model's shape.

Each tensor is drawn from its own generator seeded by (seed, name), so a weight is the same
whichever order it is asked for in, and asking twice gives the same array.
"""

from __future__ import annotations

import zlib
from dataclasses import replace

import numpy as np

from onnxgen.models.config import DecoderConfig, LinearAttentionSpec, MoESpec, weight_shapes


class RandomSource:
    """A WeightSource of seeded random weights. Linear weights ~ N(0, 1/in_features), so activations
    keep their scale through the layers; norms ~ 1 + N(0, 0.1^2); embeddings ~ N(0, 1)."""

    def __init__(self, config: DecoderConfig, seed: int = 0) -> None:
        self.config = config
        self.seed = seed
        self._shapes = weight_shapes(config)

    def names(self) -> list[str]:
        return list(self._shapes)

    def get(self, name: str) -> np.ndarray:
        shape = self._shapes.get(name)
        if shape is None:
            raise KeyError(name)
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        values = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith("norm.weight"):
            return 1.0 + np.float32(0.1) * values
        if name.endswith(".bias"):
            return np.float32(0.1) * values
        if name == "model.embed_tokens.weight":
            return values
        if len(shape) == 1:  # per-head constants of linear-attention layers (dt_bias, A_log)
            return np.float32(0.1) * values
        # a linear weight [out, in] or an expert's; a depthwise conv kernel [channels, 1, taps] by its taps
        return values * np.float32(1.0 / np.sqrt(shape[-1] if len(shape) == 3 and shape[1] == 1 else shape[1]))


_TINY = DecoderConfig(
    architecture="llama",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=1,
    eos_token_id=[2],
    pad_token_id=0,
    name="tiny-llama",
)

# Small configs for tests: every one builds and runs in well under a second.
TINY_CONFIGS: dict[str, DecoderConfig] = {
    "tiny-llama": _TINY,
    "tiny-qwen2": replace(
        _TINY,
        architecture="qwen2",
        attention_bias=True,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        num_hidden_layers=2,
        name="tiny-qwen2",
    ),
    "tiny-llama-mha": replace(_TINY, num_key_value_heads=4, num_hidden_layers=2, name="tiny-llama-mha"),
}


def _qwen35_layer_types(layers: int) -> list[str]:
    """Qwen3.5's pattern: three Gated DeltaNet layers, then one of full attention, repeated."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]


# The hybrid layout of the Qwen3.5 family (Gated DeltaNet layers, gated full attention with q/k
# norms, zero-centred RMSNorm weights, a quarter of each head rotated); the shapes below fill in widths.
_QWEN35 = dict(
    architecture="qwen3_5_text", rms_norm_eps=1e-6, rope_theta=1e7, partial_rotary_factor=0.25,
    attention_bias=False, attn_output_gate=True, qk_norm=True, norm_offset=1.0,
)  # fmt: skip

# Test-sized hybrids with the Qwen3.5 layout: 4 layers (3 Gated DeltaNet, then full attention).
# head_dim 64: a quarter of it rotates, 16 dimensions, the least onnxruntime's GroupQueryAttention
# takes. The vocabulary (384) differs from every projection's width (q_proj with its gate is 512):
# onnxruntime-genai's builder takes any Linear as wide as the vocabulary for the LM head.
TINY_CONFIGS["tiny-qwen3.5"] = DecoderConfig(
    **_QWEN35, vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
    eos_token_id=[2], pad_token_id=0, layer_types=_qwen35_layer_types(4),
    linear_attention=LinearAttentionSpec(num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16,
                                         conv_kernel=4),
    name="tiny-qwen3.5",
)  # fmt: skip
TINY_CONFIGS["tiny-qwen3.5-moe"] = replace(
    TINY_CONFIGS["tiny-qwen3.5"], tie_word_embeddings=False, name="tiny-qwen3.5-moe",
    # expert widths are whole int4 blocks (32): QMoE quantizes whole blocks along K
    moe=MoESpec(num_experts=8, top_k=2, expert_intermediate=32, shared_intermediate=32),
)  # fmt: skip

# Shapes of the real models in DESIGN.md, for speed work with random weights.
MODEL_SHAPES: dict[str, DecoderConfig] = {
    "smollm2-135m-instruct": DecoderConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=1,
        eos_token_id=[2],
        pad_token_id=2,
        name="smollm2-135m-instruct (random weights)",
    ),
    "qwen2.5-coder-0.5b-instruct": DecoderConfig(
        architecture="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        attention_bias=True,
        bos_token_id=151643,
        eos_token_id=[151645, 151643],
        pad_token_id=151643,
        name="qwen2.5-coder-0.5b-instruct (random weights)",
    ),
    "qwen2.5-coder-1.5b-instruct": DecoderConfig(
        architecture="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        attention_bias=True,
        bos_token_id=151643,
        eos_token_id=[151645, 151643],
        pad_token_id=151643,
        name="qwen2.5-coder-1.5b-instruct (random weights)",
    ),
    # Hybrid shapes as issue 21 gives them from the published text_config of Qwen/Qwen3.5-0.8B and
    # Qwen/Qwen3.5-35B-A3B. The 35B-A3B widths and its untied embeddings are also the defaults of
    # transformers' Qwen3_5MoeTextConfig, whose docstring cites that checkpoint; the EOS and pad ids are
    # those Qwen3.5 configs carry (not checked against the official files here; the benches ignore EOS).
    # Context 32768 rather than the published 262144: the benches generate a few hundred tokens, and
    # the packages' rotary tables (and a peer's preallocated caches) grow with the context.
    "qwen3.5-0.8b": DecoderConfig(
        **_QWEN35,
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        eos_token_id=[248046, 248044],
        pad_token_id=248044,
        layer_types=_qwen35_layer_types(24),
        linear_attention=LinearAttentionSpec(
            num_key_heads=16, num_value_heads=16, key_head_dim=128, value_head_dim=128, conv_kernel=4
        ),
        name="qwen3.5-0.8b (random weights)",
    ),
    "qwen3.5-35b-a3b": DecoderConfig(
        # every MLP is a mixture of experts: intermediate_size is read by no layer (the shared
        # expert's width stands in, so that config.json carries a value for the loaders that ask)
        **_QWEN35,
        vocab_size=248320,
        hidden_size=2048,
        intermediate_size=512,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        eos_token_id=[248046, 248044],
        pad_token_id=248044,
        layer_types=_qwen35_layer_types(40),
        linear_attention=LinearAttentionSpec(
            num_key_heads=16, num_value_heads=32, key_head_dim=128, value_head_dim=128, conv_kernel=4
        ),
        moe=MoESpec(num_experts=256, top_k=8, expert_intermediate=512, shared_intermediate=512),
        name="qwen3.5-35b-a3b (random weights)",
    ),
}
