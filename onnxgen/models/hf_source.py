"""A WeightSource for a Hugging Face-style model directory: config.json + *.safetensors.

Safetensors is read with numpy alone: an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}}, then the raw little-endian tensor bytes, which are
memory-mapped so only the tensor asked for is read. bf16 becomes fp32 by widening the bits.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from onnxgen.errors import ModelLoadError
from onnxgen.models.config import DecoderConfig, LinearAttentionSpec, MoESpec

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,  # widened below
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsFile:
    """One .safetensors file: header parsed eagerly, tensors memory-mapped on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ModelLoadError(f"{path}: too short to be a safetensors file")
            (size,) = struct.unpack("<Q", head)
            if size > 100 * 1024 * 1024:
                raise ModelLoadError(f"{path}: header length {size} is implausible; not a safetensors file?")
            try:
                header = json.loads(f.read(size))
            except ValueError as e:
                raise ModelLoadError(f"{path}: unreadable safetensors header ({e})") from e
        header.pop("__metadata__", None)
        self.entries: dict[str, dict[str, Any]] = header
        self._data_start = 8 + size
        self._map: np.memmap | None = None

    def get(self, name: str) -> np.ndarray:
        entry = self.entries[name]
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ModelLoadError(f"{self.path}: tensor {name} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._map[self._data_start + begin : self._data_start + end]
        array = raw.view(np.dtype(dtype).newbyteorder("<")).reshape(tuple(entry["shape"]))
        if entry["dtype"] == "BF16":
            return (array.astype(np.uint32) << 16).view(np.float32)
        return np.array(array)  # a private copy: the map stays read-only


TEXT_PREFIX = "model.language_model."


class HFSource:
    """Weights and DecoderConfig from a directory written by transformers' save_pretrained."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        config_path = self.directory / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{self.directory} has no config.json")
        raw = json.loads(config_path.read_text())
        generation = self.directory / "generation_config.json"
        gen = json.loads(generation.read_text()) if generation.is_file() else {}
        self._files: dict[str, SafetensorsFile] = {}
        stored: dict[str, str] = {}  # decoder name -> the name in the file
        for path in sorted(self.directory.glob("*.safetensors")):
            file = SafetensorsFile(path)
            for name in file.entries:
                self._files[name] = file
                stored[name] = name
        if not self._files:
            raise ModelLoadError(f"{self.directory} has no *.safetensors files")
        self._check_index()
        if f"{TEXT_PREFIX}embed_tokens.weight" in stored:
            # a multimodal wrapper's checkpoint (model.language_model.*, model.visual.*): the decoder
            # is its text part, read under the plain decoder's names; the vision tower is left out
            stored = {"model." + n[len(TEXT_PREFIX) :]: n for n in stored if n.startswith(TEXT_PREFIX)} | (
                {"lm_head.weight": "lm_head.weight"} if "lm_head.weight" in stored else {})  # fmt: skip
        self._stored = stored
        shapes = {name: tuple(self._files[n].entries[n]["shape"]) for name, n in stored.items()}
        self.config = config_from_hf(raw, gen, set(stored), shapes)

    def _check_index(self) -> None:
        """A sharded checkpoint's index must not name tensors that no shard holds."""
        index = self.directory / "model.safetensors.index.json"
        if not index.is_file():
            return
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        missing = sorted(set(weight_map) - set(self._files))
        if missing:
            raise ModelLoadError(f"{index}: the shards lack {len(missing)} tensors, e.g. {missing[0]}")

    def names(self) -> list[str]:
        return sorted(self._stored)

    def get(self, name: str) -> np.ndarray:
        stored = self._stored.get(name)
        if stored is None:
            raise KeyError(name)
        return self._files[stored].get(stored).astype(np.float32, copy=False)


# transformers picks a model's modelling code by its config's model_type; these families' RMSNorm
# weights are zero-centred (the norm multiplies by 1 + weight), a fact of that code that config.json
# does not state
_ZERO_CENTRED_NORMS = {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}
_LAYER_TYPES = ("full_attention", "linear_attention")


def config_from_hf(
    raw: dict[str, Any], gen: dict[str, Any], names: set[str], shapes: dict[str, tuple[int, ...]] | None = None
) -> DecoderConfig:
    """DecoderConfig from config.json (+ generation_config.json), checked against the tensor names
    (and, where given, their shapes)."""
    text = raw.get("text_config")
    if isinstance(text, dict):  # multimodal wrappers nest the decoder
        raw = {**raw, **text}

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise ModelLoadError(f"config.json has no {key!r}")
        return raw[key]

    # transformers 5 writes rope_parameters; older versions rope_theta + rope_scaling.
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type")) or rope.get("rope_type") or "default"
    if rope_type != "default":
        raise ModelLoadError(f"rope scaling {rope_type!r} is not supported by the builder")
    theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    if raw.get("use_sliding_window"):
        raise ModelLoadError("sliding-window attention is not supported by the builder")
    unsupported = sorted(n for n in names if n.endswith(("o_proj.bias", "mlp.gate_proj.bias", "mlp.down_proj.bias")))
    if unsupported:
        raise ModelLoadError(f"biases such as {unsupported[0]} are not supported by the builder")
    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))

    def token_ids(key: str) -> list[int]:
        value = gen.get(key, raw.get(key))
        if value is None:
            return []
        return [int(v) for v in (value if isinstance(value, list) else [value])]

    bos, pad = token_ids("bos_token_id"), token_ids("pad_token_id")
    layers = int(need("num_hidden_layers"))
    head_dim = int(raw.get("head_dim") or hidden // heads)
    layer_types = [str(t) for t in raw.get("layer_types") or []]
    linear = None
    if "linear_attention" in layer_types:
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown or len(layer_types) != layers:
            extra = f" with {', '.join(unknown)}" if unknown else ""
            raise ModelLoadError(
                f"layer_types must name {layers} layers, each one of {', '.join(_LAYER_TYPES)}; "
                f"got {len(layer_types)}{extra}"
            )
        linear = LinearAttentionSpec(
            num_key_heads=int(need("linear_num_key_heads")),
            num_value_heads=int(need("linear_num_value_heads")),
            key_head_dim=int(need("linear_key_head_dim")),
            value_head_dim=int(need("linear_value_head_dim")),
            conv_kernel=int(need("linear_conv_kernel_dim")),
        )
    else:
        layer_types = []
    moe = None
    if raw.get("num_experts") and "model.layers.0.mlp.experts.0.gate_proj.weight" in names:
        moe = MoESpec(
            num_experts=int(raw["num_experts"]),
            top_k=int(need("num_experts_per_tok")),
            expert_intermediate=int(need("moe_intermediate_size")),
            shared_intermediate=int(need("shared_expert_intermediate_size")),
            # the routers that omit the key (Qwen3.5-MoE's) renormalize their top k
            normalize=bool(raw.get("norm_topk_prob", True)),
        )
    full = next((i for i in range(layers) if not layer_types or layer_types[i] == "full_attention"), 0)
    q_rows = (shapes or {}).get(f"model.layers.{full}.self_attn.q_proj.weight", (0,))[0]
    return DecoderConfig(
        architecture=str(raw.get("model_type", "")),
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        # every MLP of a mixture-of-experts decoder is experts: its configs may omit the dense width
        intermediate_size=int(raw.get("intermediate_size") or 0) if moe else int(need("intermediate_size")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        max_position_embeddings=int(need("max_position_embeddings")),
        # The weights decide: save_pretrained drops lm_head.weight when it is tied.
        tie_word_embeddings="lm_head.weight" not in names,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in names,
        partial_rotary_factor=float(raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))),
        hidden_act=str(raw.get("hidden_act", "silu")),
        bos_token_id=bos[0] if bos else None,
        eos_token_id=token_ids("eos_token_id"),
        pad_token_id=pad[0] if pad else None,
        name=str(raw.get("_name_or_path", "")),
        layer_types=layer_types,
        linear_attention=linear,
        # a q_proj twice the heads' width also yields each head's output gate
        attn_output_gate=q_rows == 2 * heads * head_dim,
        qk_norm=f"model.layers.{full}.self_attn.q_norm.weight" in names,
        norm_offset=1.0 if raw.get("model_type") in _ZERO_CENTRED_NORMS else 0.0,
        moe=moe,
    )
