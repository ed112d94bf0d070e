"""genai_config.json checked against the decoder graph it names, before any weight is read.

A wrong count or size in the config otherwise prints garbage (vocab_size smaller than the logits:
the sampler never sees the tail) or fails deep in a kernel (a KV buffer of the wrong shape). Each
check compares a config field with what the graph *states*: its declared input/output names and
shapes, and the initializers whose rows are positions. A symbolic dimension states nothing and is
not judged. Only the proto is read (no external data), so this costs a walk over the graph's
inputs, outputs and nodes.
"""

from __future__ import annotations

from typing import Any

import onnx

from onnxgen.errors import ModelLoadError
from onnxgen.genai.graph_layout import layers_named, with_graph_layout
from onnxgen.genai.package import PackageConfig

MS_DOMAIN = "com.microsoft"
Dim = int | str | None  # a static size, a symbol, or unknown


def _shape(value: onnx.ValueInfoProto) -> list[Dim] | None:
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim]


def _shown(shape: list[Dim]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _listing(names: list[str], limit: int = 8) -> str:
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


class _Checker:
    def __init__(self, config: PackageConfig, model: onnx.ModelProto):
        self.config = with_graph_layout(config, model)
        graph = model.graph
        self.initializers = {t.name: t for t in graph.initializer}
        # graph inputs that an initializer backs are optional: nobody has to feed them
        self.inputs = {v.name: v for v in graph.input if v.name not in self.initializers}
        self.outputs = {v.name: v for v in graph.output}
        self.nodes = list(graph.node)
        self.file = config.config_file
        self.model = model

    def fail(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.file}: {message}")

    def run(self) -> None:
        self.check_names()
        self.check_kv_names()
        self.check_unmapped()
        self.check_layers()
        self.check_shapes()
        self.check_context()
        self.check_share_buffer()

    # -- names -----------------------------------------------------------------------------------

    def _need(self, where: str, name: str, pool: dict[str, Any], kind: str) -> None:
        if name not in pool:
            raise self.fail(
                f"{where} names {name!r}, which is not an {kind} of the decoder graph "
                f"(its {kind}s: {_listing(list(pool))})"
            )

    def check_unmapped(self) -> None:
        """Every graph input is one onnxgen feeds: checked before the layer counts, since an input the
        config does not map (a hybrid's undeclared state) explains the count fault it would raise."""
        io = self.config.io
        fed = {io.input_ids, *(n for n in (io.attention_mask, io.position_ids) if n)}
        fed |= {io.past_key % i for i in layers_named(io.past_key, self.inputs)}
        fed |= {io.past_value % i for i in layers_named(io.past_value, self.inputs)}
        fed |= {state.past for state in self.config.carried}
        unfed = [name for name in self.inputs if name not in fed]
        if unfed:
            raise self.fail(
                f"the decoder graph has input(s) {_listing(unfed)} that model.decoder.inputs does not map; "
                "onnxgen feeds input_ids, attention_mask, position_ids, the past KV and the carried layer states "
                "declared as inputs.past_<kind>_names with outputs.present_<kind>_names"
            )

    def check_names(self) -> None:
        io, given = self.config.io, self.config.io.given
        ins, outs = "model.decoder.inputs", "model.decoder.outputs"
        self._need(f"{ins}.input_ids", io.input_ids, self.inputs, "input")
        for key, name in (("attention_mask", io.attention_mask), ("position_ids", io.position_ids)):
            if name and key in given:  # a default name is fed only where the graph has it
                self._need(f"{ins}.{key}", name, self.inputs, "input")
        self._need(f"{outs}.logits", io.logits, self.outputs, "output")

    def check_kv_names(self) -> None:
        io, ins, outs = self.config.io, "model.decoder.inputs", "model.decoder.outputs"
        first = self.config.first_kv_layer
        self._need(f"{ins}.past_key_names", io.past_key % first, self.inputs, "input")
        self._need(f"{ins}.past_value_names", io.past_value % first, self.inputs, "input")
        self._need(f"{outs}.present_key_names", io.present_key % first, self.outputs, "output")
        self._need(f"{outs}.present_value_names", io.present_value % first, self.outputs, "output")

    def check_layers(self) -> None:
        c, io = self.config, self.config.io
        layers = layers_named(io.past_key, self.inputs)
        # a hybrid decoder's linear-attention layers carry fixed-size states instead of a KV cache
        hybrid_ok = bool(c.carried) and layers and layers[-1] < c.num_layers
        if not hybrid_ok and (len(layers) != c.num_layers or layers != list(range(len(layers)))):
            raise self.fail(
                f"model.decoder.num_hidden_layers is {c.num_layers}, but the decoder has {len(layers)} layers "
                f"(KV inputs {_listing([io.past_key % i for i in layers], 3)})"
            )
        for layer in layers:
            self._need("model.decoder.inputs.past_value_names", io.past_value % layer, self.inputs, "input")
            self._need("model.decoder.outputs.present_key_names", io.present_key % layer, self.outputs, "output")
            self._need("model.decoder.outputs.present_value_names", io.present_value % layer, self.outputs, "output")

    # -- sizes -----------------------------------------------------------------------------------

    def _compare(self, field: str, value: int, name: str, shape: list[Dim] | None, axis: int, what: str) -> None:
        if shape is None or len(shape) <= abs(axis):
            return
        dim = shape[axis]
        if isinstance(dim, int) and dim > 0 and dim != value:
            raise self.fail(f"{field} is {value}, but the decoder's {name} has shape {_shown(shape)} ({what} {dim})")

    def check_shapes(self) -> None:
        c, io = self.config, self.config.io
        self._compare("model.vocab_size", c.vocab_size, io.logits, _shape(self.outputs[io.logits]), -1,
                      "the logits' last dimension is")  # fmt: skip
        layers = layers_named(io.past_key, self.inputs)
        kv = [(io.past_key % i, self.inputs) for i in layers]
        kv += [(io.past_value % i, self.inputs) for i in layers]
        kv += [(io.present_key % i, self.outputs) for i in layers]
        kv += [(io.present_value % i, self.outputs) for i in layers]
        for name, pool in kv:  # [batch, kv heads, sequence, head size]
            shape = _shape(pool[name])
            if shape is not None and len(shape) != 4:
                raise self.fail(f"the decoder's KV tensor {name} has shape {_shown(shape)}; expected 4 dimensions "
                                "[batch, num_key_value_heads, sequence, head_size]")  # fmt: skip
            self._compare("model.decoder.num_key_value_heads", c.num_kv_heads, name, shape, 1, "KV heads")
            self._compare("model.decoder.head_size", c.head_size, name, shape, 3, "head size")

    def _position_tables(self) -> list[tuple[str, int]]:
        """(what, rows) of each initializer the graph indexes by position: GroupQueryAttention's and
        (M)RotaryEmbedding's cos/sin caches, and a table gathered by the position_ids input."""
        tables: list[tuple[str, str]] = []
        positions = self.config.io.position_ids
        for node in self.nodes:
            slots: tuple[int, ...] = ()
            if node.domain == MS_DOMAIN and node.op_type == "GroupQueryAttention":
                slots = (7, 8)
            elif node.domain == MS_DOMAIN and node.op_type in ("RotaryEmbedding", "MRotaryEmbedding"):
                slots = (2, 3)
            elif node.domain in ("", "ai.onnx") and node.op_type == "Gather" and positions:
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                if axis == 0 and len(node.input) > 1 and node.input[1] == positions:
                    slots = (0,)
            for slot in slots:
                if slot < len(node.input) and node.input[slot] in self.initializers:
                    tables.append((node.input[slot], f"{node.op_type} node {node.name!r}"))
        rows = []
        for name, user in tables:
            dims = self.initializers[name].dims
            if dims:
                rows.append((f"position table {name} (read by {user})", int(dims[0])))
        return rows

    def check_context(self) -> None:
        c = self.config
        limits = self._position_tables()
        first = c.first_past_key_name
        shape = _shape(self.inputs[first]) if first in self.inputs else None
        if shape is not None and isinstance(shape[2], int) and shape[2] > 0:
            limits.append((f"KV input {first} (a fixed buffer)", shape[2]))
        for what, rows in limits:
            if c.context_length > rows:
                raise self.fail(
                    f"model.context_length is {c.context_length}, but the decoder's {what} holds {rows} positions; "
                    f"expected at most {rows}"
                )

    def check_share_buffer(self) -> None:
        reason = growing_kv(self.config, self.nodes)
        if self.config.share_buffer and reason:
            raise self.fail(
                f"search.past_present_share_buffer is true, but {reason}, so past and present cannot share a "
                "buffer; expected false"
            )


def growing_kv(config: PackageConfig, nodes: list[onnx.NodeProto]) -> str | None:
    """Why this graph's KV cannot live in fixed-capacity buffers (None when it can).

    A static cache needs each layer's present K/V to be written in place into the past buffer it
    came from: com.microsoft GroupQueryAttention does that when past and present share a buffer
    (runtime/ops/contrib_attention.py). Any other producer (Concat(past, new), an exporter's attention)
    returns a new, longer tensor each step."""
    producers = {out: node for node in nodes for out in node.output}
    io = config.io
    for layer in config.kv_layer_ids:
        for slot, present, past in ((1, io.present_key % layer, io.past_key % layer),
                                    (2, io.present_value % layer, io.past_value % layer)):  # fmt: skip
            node = producers.get(present)
            if node is None:
                return f"the graph's {present} is made by no node"
            in_place = (
                node.domain == MS_DOMAIN and node.op_type == "GroupQueryAttention"
                and list(node.output).index(present) == slot
                and len(node.input) > slot + 2 and node.input[slot + 2] == past
            )  # fmt: skip
            if not in_place:
                return (
                    f"the graph's {present} is made by {node.op_type} (node {node.name!r}), which returns a new tensor"
                )
    return None


def default_kv_kind(config: PackageConfig, device_type: str, fixed_buffer: bool) -> str:
    """The KV cache kind ``kv='auto'`` picks: a shared-buffer package gets the static cache where
    its decode step is captured (CUDA) or where the graph fixes the buffer length; on the CPU a
    growing cache is faster (its attention reads the valid rows only;
    docs/benchmarks/2026-12-02-cpu-foreign.md)."""
    return "static" if config.share_buffer and (device_type != "cpu" or fixed_buffer) else "dynamic"


def kv_sequence_symbols(config: PackageConfig, model: onnx.ModelProto) -> list[str]:
    """The symbolic extents a static cache fixes: the past KV's sequence axis and the attention
    mask's width (both the buffer's capacity in a static decode step)."""
    inputs = {v.name: v for v in model.graph.input}
    wanted = [(config.first_past_key_name, 2), (config.io.attention_mask, 1)]
    names: list[str] = []
    for name, axis in wanted:
        info = inputs.get(name) if name else None
        dims = info.type.tensor_type.shape.dim if info is not None else []
        if len(dims) > axis and dims[axis].dim_param and dims[axis].dim_param not in names:
            names.append(dims[axis].dim_param)
    return names


def check_package(config: PackageConfig, model: onnx.ModelProto) -> None:
    """Raise ModelLoadError, naming genai_config.json and the field, where the config contradicts the graph."""
    _Checker(config, model).run()
