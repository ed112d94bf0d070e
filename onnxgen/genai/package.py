"""A model package in the onnxruntime-genai layout: model.onnx + genai_config.json + tokenizer files."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnxgen.errors import ModelLoadError


@dataclass
class DecoderIO:
    input_ids: str = "input_ids"
    attention_mask: str | None = "attention_mask"
    position_ids: str | None = "position_ids"
    past_key: str = "past_key_values.%d.key"
    past_value: str = "past_key_values.%d.value"
    logits: str = "logits"
    present_key: str = "present.%d.key"
    present_value: str = "present.%d.value"


@dataclass
class PackageConfig:
    directory: Path
    model_file: Path
    model_type: str
    context_length: int
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    num_heads: int
    head_size: int
    hidden_size: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    pad_token_id: int | None
    share_buffer: bool
    io: DecoderIO
    search: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)

    def past_key_name(self, layer: int) -> str:
        return self.io.past_key % layer

    def past_value_name(self, layer: int) -> str:
        return self.io.past_value % layer

    def present_key_name(self, layer: int) -> str:
        return self.io.present_key % layer

    def present_value_name(self, layer: int) -> str:
        return self.io.present_value % layer


def _need(section: dict[str, Any], key: str, where: str) -> Any:
    if key not in section:
        raise ModelLoadError(f"genai_config.json: {where} has no {key!r}; onnxgen needs it to run the decoder")
    return section[key]


def load_package_config(directory: str | Path) -> PackageConfig:
    directory = Path(directory)
    path = directory / "genai_config.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory} has no genai_config.json; expected an onnxruntime-genai style package")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    model = _need(raw, "model", "the top level")
    decoder = _need(model, "decoder", "model")
    inputs = decoder.get("inputs", {})
    outputs = decoder.get("outputs", {})
    io = DecoderIO(
        input_ids=inputs.get("input_ids", "input_ids"),
        attention_mask=inputs.get("attention_mask"),
        position_ids=inputs.get("position_ids"),
        past_key=inputs.get("past_key_names", "past_key_values.%d.key"),
        past_value=inputs.get("past_value_names", "past_key_values.%d.value"),
        logits=outputs.get("logits", "logits"),
        present_key=outputs.get("present_key_names", "present.%d.key"),
        present_value=outputs.get("present_value_names", "present.%d.value"),
    )
    eos = model.get("eos_token_id", [])
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    search = raw.get("search", {})
    model_file = directory / decoder.get("filename", "model.onnx")
    if not model_file.is_file():
        raise ModelLoadError(f"{directory}: the decoder file {model_file.name} named in genai_config.json is missing")
    num_heads = int(_need(decoder, "num_attention_heads", "model.decoder"))
    return PackageConfig(
        directory=directory,
        model_file=model_file,
        model_type=str(model.get("type", "")),
        context_length=int(_need(model, "context_length", "model")),
        vocab_size=int(_need(model, "vocab_size", "model")),
        num_layers=int(_need(decoder, "num_hidden_layers", "model.decoder")),
        num_kv_heads=int(decoder.get("num_key_value_heads", num_heads)),
        num_heads=num_heads,
        head_size=int(_need(decoder, "head_size", "model.decoder")),
        hidden_size=int(decoder.get("hidden_size", 0)),
        bos_token_id=model.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=model.get("pad_token_id"),
        share_buffer=bool(search.get("past_present_share_buffer", False)),
        io=io,
        search=search,
        raw=raw,
    )
