"""A model package in the onnxruntime-genai layout: model.onnx + genai_config.json + tokenizer files."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnxgen.errors import ModelLoadError
from onnxgen.genai.package_reading import describe, package_file, read_json_object

CONFIG_FILE = "genai_config.json"


@dataclass
class DecoderIO:
    """Graph names of the decoder's inputs and outputs (``%d``: the layer). Defaults are
    onnxruntime-genai's; ``given`` holds the keys genai_config.json set itself: a name it gives must
    exist in the graph, while a default attention_mask/position_ids is fed only where the graph has it."""

    input_ids: str = "input_ids"
    attention_mask: str | None = "attention_mask"
    position_ids: str | None = "position_ids"
    past_key: str = "past_key_values.%d.key"
    past_value: str = "past_key_values.%d.value"
    logits: str = "logits"
    present_key: str = "present.%d.key"
    present_value: str = "present.%d.value"
    # per-layer states carried beside the KV cache, as (past, present) name patterns: onnxruntime-genai
    # declares each kind as inputs.past_<kind>_names / outputs.present_<kind>_names (kind: conv,
    # recurrent for its hybrid decoders)
    states: tuple[tuple[str, str], ...] = ()
    given: frozenset[str] = frozenset()


@dataclass(frozen=True)
class CarriedState:
    """A fixed-size state a hybrid decoder carries from step to step beside its KV cache (a causal
    convolution's last positions, a linear attention's recurrent state): fed as ``past``, returned
    as ``present``, shaped [batch, *shape]."""

    past: str
    present: str
    shape: tuple[int, ...]


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
    # from the graph (graph_layout.with_graph_layout): the layers that have a KV cache (None: every
    # one) and the states carried beside it
    kv_layers: tuple[int, ...] | None = None
    carried: tuple[CarriedState, ...] = ()
    # position_ids [streams, B, S] (multimodal RoPE: temporal, height, width; a text token's streams
    # are equal), or 0 for the usual [B, S]
    position_streams: int = 0

    @property
    def kv_layer_ids(self) -> range | tuple[int, ...]:
        return range(self.num_layers) if self.kv_layers is None else self.kv_layers

    @property
    def first_kv_layer(self) -> int:
        """The first layer with a KV cache (a hybrid decoder's first layers may carry states only):
        the layer whose past-key input tells the KV layout (buffer length, dtype)."""
        return next(iter(self.kv_layer_ids), 0)

    @property
    def first_past_key_name(self) -> str:
        return self.past_key_name(self.first_kv_layer)

    @property
    def config_file(self) -> Path:
        return self.directory / CONFIG_FILE

    def past_key_name(self, layer: int) -> str:
        return self.io.past_key % layer

    def past_value_name(self, layer: int) -> str:
        return self.io.past_value % layer

    def present_key_name(self, layer: int) -> str:
        return self.io.present_key % layer

    def present_value_name(self, layer: int) -> str:
        return self.io.present_value % layer


class _Fields:
    """Typed reads of genai_config.json: each bad value is a ModelLoadError naming the file, the
    field's dotted path, what it holds and what was expected."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, value: Any, expected: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: {where} is {describe(value)}; expected {expected}")

    def section(self, parent: dict[str, Any], key: str, where: str, required: bool = True) -> dict[str, Any]:
        path = f"{where}.{key}" if where else key
        if key not in parent:
            if required:
                raise ModelLoadError(f"{self.path}: {where or 'the top level'} has no {key!r}; onnxgen needs it")
            return {}
        value = parent[key]
        if not isinstance(value, dict):
            raise self.fail(path, value, "an object")
        return value

    def integer(
        self, section: dict[str, Any], key: str, where: str, minimum: int = 1, default: int | None = None
    ) -> int:
        """``section[key]`` as an int >= minimum; ``default`` where it is absent (None: required)."""
        path = f"{where}.{key}"
        if key not in section:
            if default is None:
                raise ModelLoadError(f"{self.path}: {where} has no {key!r}; onnxgen needs it to run the decoder")
            return default
        return self.check_int(section[key], path, minimum)

    def check_int(self, value: Any, path: str, minimum: int) -> int:
        # bool is an int subclass in Python, but true/false in JSON is no count
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            kind = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
            raise self.fail(path, value, kind)
        return value

    def token_ids(self, section: dict[str, Any], key: str, where: str) -> list[int]:
        """An id or a list of ids (eos_token_id takes both forms)."""
        value = section.get(key, [])
        if isinstance(value, list):
            return [self.check_int(v, f"{where}.{key}[{i}]", 0) for i, v in enumerate(value)]
        return [self.check_int(value, f"{where}.{key}", 0)]

    def optional_id(self, section: dict[str, Any], key: str, where: str) -> int | None:
        value = section.get(key)
        return None if value is None else self.check_int(value, f"{where}.{key}", 0)

    def name(self, section: dict[str, Any], key: str, where: str, default: str, per_layer: bool = False) -> str:
        if key not in section:
            return default
        value = section[key]
        if per_layer:
            if not isinstance(value, str) or value.count("%d") != 1 or "%" in value.replace("%d", ""):
                raise self.fail(f"{where}.{key}", value, "a name with one %d for the layer number")
        elif not isinstance(value, str) or not value:
            raise self.fail(f"{where}.{key}", value, "a non-empty graph name")
        return value

    def state_names(self, inputs: dict[str, Any], outputs: dict[str, Any]) -> tuple[tuple[str, str], ...]:
        """The (past, present) name patterns of every carried state kind the config declares: each
        ``inputs.past_<kind>_names`` other than key and value, with its ``outputs.present_<kind>_names``."""
        pairs = []
        for key in inputs:
            kind = m.group(1) if (m := re.fullmatch(r"past_(\w+)_names", key)) else None
            if kind is None or kind in ("key", "value"):
                continue
            present = f"present_{kind}_names"
            if present not in outputs:
                raise ModelLoadError(
                    f"{self.path}: model.decoder.inputs.{key} declares a carried state, but model.decoder.outputs "
                    f"has no {present!r} to say where each step returns it"
                )
            past = self.name(inputs, key, "model.decoder.inputs", "", per_layer=True)
            pairs.append((past, self.name(outputs, present, "model.decoder.outputs", "", per_layer=True)))
        return tuple(pairs)

    def flag(self, section: dict[str, Any], key: str, where: str) -> bool:
        value = section.get(key, False)
        if not isinstance(value, bool):
            raise self.fail(f"{where}.{key}", value, "true or false")
        return value


def load_package_config(directory: str | Path) -> PackageConfig:
    """genai_config.json of the package in ``directory``, every field onnxgen uses type-checked and
    the decoder file confined to the directory. Graph checks: package_checks.check_package."""
    directory = Path(directory)
    path = package_file(directory, CONFIG_FILE)
    if not path.is_file():
        raise ModelLoadError(f"{directory} has no {CONFIG_FILE}; expected an onnxruntime-genai style package")
    raw = read_json_object(path)
    f = _Fields(path)
    model = f.section(raw, "model", "")
    decoder = f.section(model, "decoder", "model")
    inputs = f.section(decoder, "inputs", "model.decoder", required=False)
    outputs = f.section(decoder, "outputs", "model.decoder", required=False)
    search = f.section(raw, "search", "", required=False)
    ins, outs = "model.decoder.inputs", "model.decoder.outputs"
    io = DecoderIO(
        input_ids=f.name(inputs, "input_ids", ins, "input_ids"),
        attention_mask=f.name(inputs, "attention_mask", ins, "attention_mask"),
        position_ids=f.name(inputs, "position_ids", ins, "position_ids"),
        past_key=f.name(inputs, "past_key_names", ins, "past_key_values.%d.key", per_layer=True),
        past_value=f.name(inputs, "past_value_names", ins, "past_key_values.%d.value", per_layer=True),
        logits=f.name(outputs, "logits", outs, "logits"),
        present_key=f.name(outputs, "present_key_names", outs, "present.%d.key", per_layer=True),
        present_value=f.name(outputs, "present_value_names", outs, "present.%d.value", per_layer=True),
        states=f.state_names(inputs, outputs),
        given=frozenset(inputs) | frozenset(outputs),
    )
    filename = decoder.get("filename", "model.onnx")
    if not isinstance(filename, str):
        raise f.fail("model.decoder.filename", filename, "a file name relative to the package directory")
    model_file = package_file(directory, filename, f"{path}: model.decoder.filename")
    if not model_file.is_file():
        raise ModelLoadError(f"{directory}: the decoder file {filename!r} named in {CONFIG_FILE} is missing")
    num_heads = f.integer(decoder, "num_attention_heads", "model.decoder")
    vocab_size = f.integer(model, "vocab_size", "model")
    eos_ids = f.token_ids(model, "eos_token_id", "model")
    bos, pad = f.optional_id(model, "bos_token_id", "model"), f.optional_id(model, "pad_token_id", "model")
    for key, ids in (("eos_token_id", eos_ids), ("bos_token_id", [bos]), ("pad_token_id", [pad])):
        for token in ids:
            if token is not None and token >= vocab_size:
                shown = f"holds {token}" if isinstance(model[key], list) else f"is {token}"
                raise ModelLoadError(
                    f"{path}: model.{key} {shown}, outside the vocabulary "
                    f"(model.vocab_size {vocab_size}: ids 0 to {vocab_size - 1})"
                )
    return PackageConfig(
        directory=directory,
        model_file=model_file,
        model_type=str(model.get("type", "")),
        context_length=f.integer(model, "context_length", "model"),
        vocab_size=vocab_size,
        num_layers=f.integer(decoder, "num_hidden_layers", "model.decoder"),
        num_kv_heads=f.integer(decoder, "num_key_value_heads", "model.decoder", default=num_heads),
        num_heads=num_heads,
        head_size=f.integer(decoder, "head_size", "model.decoder"),
        hidden_size=f.integer(decoder, "hidden_size", "model.decoder", minimum=0, default=0),
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        pad_token_id=pad,
        share_buffer=f.flag(search, "past_present_share_buffer", "search"),
        io=io,
        search=search,
        raw=raw,
    )
