"""Random weights for any DecoderConfig: for tests, and for speed work in a real model's shape.

Each tensor is drawn from its own generator seeded by (seed, name), so a weight is the same
whichever order it is asked for in, and asking twice gives the same array.
"""

from __future__ import annotations

import zlib
from dataclasses import replace

import numpy as np

from onnxgen.models.config import DecoderConfig, weight_shapes


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
}
