"""A WeightSource over a GGUF file: DecoderConfig from its metadata, HF-named float32 weights.

Tensors are dequantized one at a time on `get` (gguf.quants, numpy only), so peak memory is the
largest single tensor, not the model.

Rotary layout: llama.cpp's converter reorders the rows of each Q and K head for the `llama`
architecture so that the two halves HF rotates together (rows i and i + D/2) sit next to each
other (rows 2i, 2i+1), as llama.cpp's interleaved rotary wants. We undo that here, so the weights
match Hugging Face's rotate-half layout. `qwen2` files are written without that reordering.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from onnxgen.errors import ModelLoadError
from onnxgen.models.config import DecoderConfig, iter_layer_names, weight_shapes
from onnxgen.models.gguf_reader import GGUFFile

Q = GGMLQuantizationType
SUPPORTED_TYPES = (
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
)  # fmt: skip

# Architectures whose Q/K rows llama.cpp reorders for interleaved rotary (see module doc).
_PERMUTED_QK = {"llama": True, "qwen2": False}
SUPPORTED_ARCHITECTURES = tuple(_PERMUTED_QK)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, or None when it has none."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    return None


def read_config(gguf: GGUFFile, name: str = "") -> DecoderConfig:
    """DecoderConfig from GGUF metadata; a missing or unsupported fact is a ModelLoadError."""
    arch = gguf.require("general.architecture")
    if arch not in _PERMUTED_QK:
        raise ModelLoadError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def key(suffix: str, default: object = None) -> object:
        value = gguf.get(f"{arch}.{suffix}", default)
        if value is None:
            raise ModelLoadError(f"{gguf.path}: GGUF metadata lacks {arch}.{suffix!s}")
        if isinstance(value, np.ndarray):
            # Some files give per-layer values; one model shape needs them all equal.
            if value.size == 0 or (value != value.flat[0]).any():
                raise ModelLoadError(f"{gguf.path}: per-layer {arch}.{suffix} {value.tolist()} is not supported")
            value = value.flat[0].item()
        return value

    scaling = gguf.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "", None):
        raise ModelLoadError(f"{gguf.path}: rope scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in gguf.tensors:
        raise ModelLoadError(f"{gguf.path}: per-frequency rope factors (rope_freqs.weight) are not supported")

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    if heads <= 0 or hidden <= 0:
        raise ModelLoadError(f"{gguf.path}: {heads} attention heads over width {hidden}; the metadata is corrupt")
    kv_heads = int(key("attention.head_count_kv", heads))
    head_dim = int(key("attention.key_length", hidden // heads))
    value_dim = int(key("attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ModelLoadError(f"{gguf.path}: key length {head_dim} != value length {value_dim} is not supported")
    rotary_dims = int(key("rope.dimension_count", head_dim))

    tokens = gguf.require("tokenizer.ggml.tokens")
    eos = [gguf.get("tokenizer.ggml.eos_token_id")]
    eot = gguf.get("tokenizer.ggml.eot_token_id")  # end of turn, where the file names one apart from eos
    eos = [int(t) for t in dict.fromkeys(eos + [eot]) if t is not None]
    bos = gguf.get("tokenizer.ggml.bos_token_id")
    pad = gguf.get("tokenizer.ggml.padding_token_id")

    return DecoderConfig(
        architecture=arch,
        # The embedding may have more rows than the tokenizer has tokens (padding); the model's
        # vocabulary is the embedding's.
        vocab_size=gguf.tensors["token_embd.weight"].shape[0] if "token_embd.weight" in gguf.tensors else len(tokens),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors,
        rope_interleaved=False,  # un-permuted on read (module doc)
        partial_rotary_factor=rotary_dims / head_dim,
        hidden_act="silu",
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=eos,
        pad_token_id=None if pad is None else int(pad),
        name=name or str(gguf.get("general.name", "")),
    )


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head, rows (2i, 2i+1) go back to (i, i + D/2)."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return np.ascontiguousarray(w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


class GGUFWeightSource:
    """WeightSource (see config.py) over one GGUF file."""

    def __init__(self, path: str | os.PathLike, name: str = "") -> None:
        self.path = Path(path)
        self.gguf = GGUFFile(self.path)
        self.config = read_config(self.gguf, name)
        self._permuted = _PERMUTED_QK[self.config.architecture]
        self._by_hf: dict[str, str] = {}
        unknown = []
        for gname, info in self.gguf.tensors.items():
            h = hf_name(gname)
            if h is None:
                unknown.append(gname)
            elif info.qtype not in SUPPORTED_TYPES:
                raise ModelLoadError(
                    f"{self.path}: tensor {gname!r} has quantization {info.type_name}, which is not supported; "
                    f"supported: {', '.join(t.name for t in SUPPORTED_TYPES)}"
                )
            else:
                self._by_hf[h] = gname
        if unknown:
            shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
            raise ModelLoadError(f"{self.path}: tensors this {self.config.architecture} reader does not know: {shown}")
        missing = [n for n in iter_layer_names(self.config) if n not in self._by_hf]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelLoadError(f"{self.path}: GGUF lacks tensors: {shown}")
        expected = weight_shapes(self.config)
        for h, gname in self._by_hf.items():
            got = self.gguf.tensors[gname].shape
            if h not in expected:
                raise ModelLoadError(f"{self.path}: tensor {gname!r} does not belong to this configuration")
            if got != expected[h]:
                raise ModelLoadError(
                    f"{self.path}: tensor {gname!r} has shape {list(got)}, expected {list(expected[h])}"
                )

    def names(self) -> list[str]:
        return [n for n in iter_layer_names(self.config) if n in self._by_hf]

    def quant_type(self, name: str) -> str:
        """The GGUF storage type of a weight (e.g. "Q4_1"), for display and precision choices."""
        return self.gguf.tensors[self._gguf_name(name)].type_name

    def get(self, name: str) -> np.ndarray:
        gname = self._gguf_name(name)
        info = self.gguf.tensors[gname]
        w = dequantize(self.gguf.raw(gname), info.qtype).reshape(info.shape)
        # Own the memory as float32 (the F32 path is a read-only view of the mapped file).
        w = np.array(w, dtype=np.float32, copy=True)
        if self._permuted and (".q_proj." in name or ".k_proj." in name):
            heads = self.config.num_attention_heads if ".q_proj." in name else self.config.num_key_value_heads
            w = unpermute_rows(w, heads)
        return w

    def _gguf_name(self, name: str) -> str:
        try:
            return self._by_hf[name]
        except KeyError:
            raise ModelLoadError(f"{self.path}: no weight named {name!r} in this GGUF") from None

    def close(self) -> None:
        self.gguf.close()
