"""Build an onnxruntime-genai style package (model.onnx + model.onnx.data + genai_config.json).

Two graph flavours from one weight source:
- `gqa`: the layout onnxruntime-genai's own model builder writes (com.microsoft fused ops);
- `standard`: default-domain ops only, a dynamic Concat KV cache, as PyTorch exporters write.
Tokenizer files are written by the tokenizer code; this module only writes the decoder.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from onnxgen.models.build_pool import BuildPool, plan_jobs
from onnxgen.models.builder_gqa import build_gqa
from onnxgen.models.builder_hybrid import build_hybrid
from onnxgen.models.builder_parts import BuildError, BuildOptions, DecoderGraph, Progress, rotary_dim
from onnxgen.models.builder_standard import build_standard
from onnxgen.models.config import DecoderConfig, WeightSource
from onnxgen.models.graph_writer import GraphWriter

__all__ = ["BuildError", "build_package", "genai_config"]

MODEL_FILE = "model.onnx"
INT4_ZERO_POINTS = ("exact", "packed", "none")
# model.type values onnxruntime-genai runs as a plain decoder; any other family is declared as llama,
# whose runtime behaviour (decoder-only, KV cache) is the same.
_GENAI_DECODER_TYPES = {"llama", "qwen2", "mistral", "phi3", "gemma", "granite", "olmo", "smollm3", "qwen3"}


def build_package(
    source: WeightSource,
    out_dir: str | Path,
    precision: str = "fp32",
    device: str = "cpu",
    attention: str = "gqa",
    context_length: int | None = None,
    progress: Progress | None = None,
    workers: int = 0,
    int4_zero_points: str = "exact",
) -> Path:
    """Write model.onnx (+ external data) and genai_config.json into `out_dir`; returns `out_dir`.

    precision: fp32 | fp16 | int4 (MatMulNBits 4-bit, block 32, in `gqa`; blocked DequantizeLinear
    + MatMul in `standard`). device: cpu | cuda (cuda: fp16 activations for int4 and a shared
    past/present buffer for `gqa`). `progress(name, done, total)` is called per weight tensor.
    workers > 0: an int4 `gqa` build computes its quantized weights ahead in that many worker
    processes (build_pool; the same package, byte for byte); the source must pickle, and the
    program's main module must be safe to import (the ``if __name__ == "__main__"`` idiom).
    int4_zero_points: "exact" keeps a weight that is on a 4-bit grid already (a GGUF's Q4_1
    blocks) exactly, with float zero points; "packed" gives every MatMulNBits weight 4-bit zero
    points (BuildOptions.int4_zero_points says why one would).
    """
    config = source.config
    options = _options(config, precision, device, attention, context_length, int4_zero_points)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writer = GraphWriter(out / MODEL_FILE)
    pool = None
    try:
        if workers > 0:
            jobs = plan_jobs(config, options, DecoderGraph.q4_table_shared(config, options))
            pool = BuildPool(source, jobs, workers, options.block_size) if jobs else None
        graph = DecoderGraph(writer, source, options, progress, pool)
        if config.layer_types:
            build_hybrid(graph)
        else:
            (build_gqa if attention == "gqa" else build_standard)(graph)
        writer.save(config.name or config.architecture or "decoder", doc=f"onnxgen {attention} {precision} {device}")
    except BaseException:
        writer.abort()
        raise
    finally:
        if pool is not None:
            pool.close()
    text = json.dumps(genai_config(config, options), indent=4)
    (out / "genai_config.json").write_text(text + "\n")
    return out


def _options(
    config: DecoderConfig,
    precision: str,
    device: str,
    attention: str,
    context_length: int | None,
    int4_zero_points: str = "exact",
) -> BuildOptions:
    for value, allowed, what in (
        (precision, ("fp32", "fp16", "int4"), "precision"),
        (device, ("cpu", "cuda"), "device"),
        (attention, ("gqa", "standard"), "attention"),
        (int4_zero_points, INT4_ZERO_POINTS, "int4 zero points"),
    ):
        if value not in allowed:
            raise BuildError(f"{what} {value!r} is not one of {', '.join(allowed)}")
    if int4_zero_points != "exact" and precision != "int4":
        raise BuildError(f"--int4-zero-points applies to int4 builds; this one is --precision {precision}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise BuildError(
            f"num_attention_heads {config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {config.num_key_value_heads}"
        )
    if config.moe is not None and not config.layer_types:
        raise BuildError("mixture-of-experts decoders are built with linear-attention layers only so far")
    if config.layer_types and attention != "gqa":
        raise BuildError("hybrid (linear-attention) decoders are built in the gqa layout only (--attention gqa)")
    rotary_dim(config)  # validates
    length = context_length or config.max_position_embeddings
    if length <= 0:
        raise BuildError(f"context length must be positive, got {length}")
    options = BuildOptions(precision, device, attention, int(length), int4_zero_points=int4_zero_points)
    if attention == "gqa" and device == "cuda" and options.io_dtype.itemsize == 4:
        # onnxgen runs it, but onnxruntime's CUDA GroupQueryAttention only takes fp16/bf16.
        warnings.warn("gqa + cuda + fp32: onnxruntime's CUDA GroupQueryAttention needs fp16", stacklevel=3)
    return options


def genai_config(config: DecoderConfig, options: BuildOptions) -> dict[str, Any]:
    """genai_config.json as onnxruntime-genai 0.18 reads it (no keys it does not know)."""
    if not config.eos_token_id:
        raise BuildError("the model config names no eos_token_id; a package needs one to stop generating")
    eos = [int(t) for t in config.eos_token_id]
    pad = config.pad_token_id if config.pad_token_id is not None else eos[0]
    bos = config.bos_token_id if config.bos_token_id is not None else pad
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    if options.attention == "standard":
        inputs["position_ids"] = "position_ids"
    inputs |= {"past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    outputs = {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}
    if config.linear_attention is not None:
        # a hybrid's carried states, under the keys onnxruntime-genai's own Qwen3.5 packages use: without
        # them it feeds none and fails at the first CausalConvWithState (onnxgen finds them in the graph)
        inputs |= {"past_conv_names": "past.%d.conv", "past_recurrent_names": "past.%d.recurrent"}
        outputs |= {"present_conv_names": "present.%d.conv", "present_recurrent_names": "present.%d.recurrent"}
    provider_options = [{"cuda": {}}] if options.device == "cuda" else []
    arch = (config.architecture or "").lower()
    return {
        "model": {
            "bos_token_id": int(bos),
            "context_length": options.context_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": provider_options},
                "filename": MODEL_FILE,
                "head_size": config.head_dim,
                "hidden_size": config.hidden_size,
                "inputs": inputs,
                "outputs": outputs,
                "num_attention_heads": config.num_attention_heads,
                "num_hidden_layers": config.num_hidden_layers,
                "num_key_value_heads": config.num_key_value_heads,
            },
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": int(pad),
            "type": arch if arch in _GENAI_DECODER_TYPES else "llama",
            "vocab_size": config.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": options.context_length,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            # A shared buffer needs an op that writes the new KV in place: only gqa on CUDA (as genai builds it).
            "past_present_share_buffer": options.attention == "gqa" and options.device == "cuda",
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
        },
    }
