"""Hybrid decoders on CUDA: the captured decode step equals the eager one bit for bit.

Random weights (models/random_source.py) in a small hybrid shape with the Qwen3.5 structure
(3 Gated DeltaNet layers per full-attention layer, partial rotary, q/k norms, the output gate,
zero-centred norms), dense and with every MLP a mixture of experts; fp16 packages for CUDA.
The Generator records the decode step in CUDA graphs (verify mode: every replayed step checked
against eager for the first steps) and must produce the eager generation's tokens, in one
segment per step. The CPU tests (tests/test_builder_hybrid.py) hold the transformers oracle.
"""

from __future__ import annotations

import pytest
import torch

from onnxgen.models.config import DecoderConfig, LinearAttentionSpec, MoESpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NEW_TOKENS = 256


def hybrid_config(moe: bool) -> DecoderConfig:
    return DecoderConfig(
        architecture="qwen3_5_text", vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e7,
        max_position_embeddings=1024, tie_word_embeddings=True, attention_bias=False, partial_rotary_factor=0.25,
        eos_token_id=[2], name="small-hybrid-moe" if moe else "small-hybrid",
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
        linear_attention=LinearAttentionSpec(num_key_heads=2, num_value_heads=4, key_head_dim=32, value_head_dim=32,
                                             conv_kernel=4),
        attn_output_gate=True, qk_norm=True, norm_offset=1.0,
        moe=MoESpec(num_experts=16, top_k=4, expert_intermediate=64, shared_intermediate=128) if moe else None,
    )  # fmt: skip


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_captured_hybrid_decode_equals_eager(tmp_path, moe: bool) -> None:
    from onnxgen.genai import Generator, SamplingParams
    from onnxgen.models.builder import build_package
    from onnxgen.models.random_source import RandomSource
    from tests.test_capture_runtime import write_word_tokenizer

    config = hybrid_config(moe)
    package = build_package(RandomSource(config, seed=3), tmp_path / "pkg", precision="fp16", device="cuda")
    write_word_tokenizer(package, config.vocab_size)
    prompt = [5, 17, 300, 41, 9, 800, 77, 12, 3, 64, 101, 7]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    eager = list(Generator(package, "cuda", kv="static", capture="off").generate_ids(prompt, params))
    captured = Generator(package, "cuda", kv="static", capture="verify")
    tokens = list(captured.generate_ids(prompt, params))
    stats = captured.capture_stats
    print(f"\n{config.name}: {stats.summary()}")
    assert tokens == eager
    assert stats.segments_per_step == 1 and stats.captured_steps >= NEW_TOKENS - 3
    assert stats.invalidations == 0 and stats.recording_failures == 0 and not stats.quarantined


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_captured_batched_hybrid_equals_one_sequence_at_a_time(tmp_path, moe: bool) -> None:
    """Continuous batching of a hybrid on CUDA, steps captured per bucket (verify mode): each
    sequence's greedy tokens equal the eager one-sequence loop's."""
    from onnxgen.genai import Generator, SamplingParams
    from onnxgen.genai.batched import BatchedDecoder
    from onnxgen.models.builder import build_package
    from onnxgen.models.random_source import RandomSource
    from tests.test_batching import _run_as_room_allows as run_as_room_allows
    from tests.test_capture_runtime import write_word_tokenizer

    config = hybrid_config(moe)
    package = build_package(RandomSource(config, seed=3), tmp_path / "pkg", precision="fp16", device="cuda")
    write_word_tokenizer(package, config.vocab_size)
    prompts = [[5 + i, 17, 300, 41 + 3 * i, 9, 800 - i][: 3 + i] for i in range(6)]
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = Generator(package, "cuda", kv="static", capture="off")
    expected = [list(plain.generate_ids(p, params)) for p in prompts]
    engine = Generator(package, "cuda", kv="static", capture="verify").engine
    decoder = BatchedDecoder(engine, max_seqs=4, max_model_len=128)
    decoder.record_shapes()
    sequences = [engine.new_sequence(p, params) for p in prompts]
    run_as_room_allows(decoder, sequences)
    assert [s.generated for s in sequences] == expected
    stats = decoder.capture_stats
    assert stats.replays > 0 and stats.invalidations == 0 and not stats.unsupported
