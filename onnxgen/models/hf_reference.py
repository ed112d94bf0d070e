"""A transformers configuration for a DecoderConfig, for the tests and benches that compare with
transformers (a test dependency: imported only when called). The class is chosen from layout facts
alone (biases on Q/K/V: Qwen2's layout; none: Llama's), never from a model name."""

from __future__ import annotations

from typing import Any

from onnxgen.models.config import DecoderConfig


def transformers_config(config: DecoderConfig) -> Any:
    import transformers

    if config.rope_interleaved or config.partial_rotary_factor != 1.0:
        raise ValueError("no transformers config here for interleaved or partial rotary embeddings")
    eos = config.eos_token_id
    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act=config.hidden_act,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else list(eos),
        pad_token_id=config.pad_token_id,
    )
    if config.attention_bias:
        # biases on q/k/v only (none on o_proj or the MLP): the layout transformers calls Qwen2
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    return transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
