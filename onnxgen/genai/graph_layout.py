"""What a package's decoder graph carries between steps: the layers that have a KV cache (read
from the graph's inputs), and the fixed-size states of hybrid decoders (a causal convolution's last
positions, a linear attention's recurrent state) that genai_config.json names and that a step reads
from a graph input and returns as an output.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import onnx
import torch

from onnxgen.errors import ModelLoadError
from onnxgen.genai.package import CarriedState, PackageConfig


def carried_states(config: PackageConfig, model: onnx.ModelProto) -> list[CarriedState]:
    """The states a step carries, as the package declares them (``config.io.states``): for every
    layer whose past name is a graph input, that input paired with its present name, which must be
    a graph output; shapes from the graph input (every dimension after the batch fixed). The graph's
    ops are not consulted, so a device rewrite that renames the op reading a state changes nothing."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    inputs = {v.name: v for v in graph.input if v.name not in initializers}
    outputs = {v.name for v in graph.output}
    states = []
    for past_names, present_names in config.io.states:
        layers = [layer for layer in range(config.num_layers) if past_names % layer in inputs]
        if not layers:
            raise ModelLoadError(
                f"{config.config_file}: the carried state names {past_names!r} match no input of the decoder "
                f"graph for layers 0 to {config.num_layers - 1}"
            )
        for layer in layers:
            past, present = past_names % layer, present_names % layer
            if present not in outputs:
                raise ModelLoadError(
                    f"the decoder reads the carried state {past!r} from a graph input, but {present!r} (the "
                    "name genai_config.json gives its update) is not a graph output, so nothing could carry "
                    "it to the next step"
                )
            dims = inputs[past].type.tensor_type.shape.dim
            shape = [d.dim_value if d.HasField("dim_value") else None for d in dims][1:]
            if not dims or any(d is None or d <= 0 for d in shape):
                raise ModelLoadError(
                    f"the carried state {past!r} must have a fixed shape after its batch dimension, "
                    f"got {[d.dim_param or d.dim_value for d in dims]}"
                )
            states.append(CarriedState(past, present, tuple(shape)))  # type: ignore[arg-type]
    return states


def layers_named(pattern: str, names: Iterable[str]) -> list[int]:
    """The layer numbers of the names that ``pattern`` (a genai_config name with one %d) matches,
    ascending."""
    before, after = pattern.split("%d")
    regex = re.compile(re.escape(before) + r"(\d+)" + re.escape(after))
    return sorted(int(m.group(1)) for name in names if (m := regex.fullmatch(name)))


def kv_layers(config: PackageConfig, model: onnx.ModelProto) -> tuple[int, ...]:
    """The layers whose past key is a graph input (a hybrid decoder's linear layers have none)."""
    return tuple(layers_named(config.io.past_key, (vi.name for vi in model.graph.input)))


def position_streams(config: PackageConfig, model: onnx.ModelProto) -> int:
    """0 where the position input is [B, S] (or absent); its leading extent where it is
    [streams, B, S], as multimodal RoPE graphs declare it (MRotaryEmbedding: 3)."""
    name = config.io.position_ids
    info = next((v for v in model.graph.input if v.name == name), None) if name else None
    if info is None or not info.type.tensor_type.HasField("shape"):
        return 0
    dims = info.type.tensor_type.shape.dim
    if len(dims) == 2:
        return 0
    if len(dims) == 3 and dims[0].HasField("dim_value") and dims[0].dim_value > 0:
        return dims[0].dim_value
    shown = [d.dim_param or d.dim_value for d in dims]
    raise ModelLoadError(
        f"the decoder's position input {name!r} has shape {shown}; expected [batch, sequence] or "
        "[streams, batch, sequence] with a fixed number of streams"
    )


def position_feed(positions: torch.Tensor, streams: int) -> torch.Tensor:
    """The position feed of a graph with ``streams`` position streams, from the [B, S] positions of
    a text sequence: every stream the same (a view of ``positions``: writes into it show through,
    so a buffer a recorded step reads stays the one buffer)."""
    return positions if not streams else positions.unsqueeze(0).expand(streams, *positions.shape)


def with_graph_layout(config: PackageConfig, model: onnx.ModelProto) -> PackageConfig:
    """``config`` with the graph's KV layers, carried states and position streams filled in."""
    states = tuple(carried_states(config, model))
    # the layers with a KV input, where they are not simply all of them (a hybrid's; or a count fault
    # that package_checks names): the first of them tells the KV layout
    layers = kv_layers(config, model)
    layers = None if not layers or layers == tuple(range(config.num_layers)) else layers
    streams = position_streams(config, model)
    return dataclasses.replace(config, kv_layers=layers, carried=states, position_streams=streams)
