"""The fp32 reference of a graph: the same graph with float32 arithmetic and dequantized weights.

``fp32_reference(model, base_dir)`` rewrites a loaded ModelProto (nothing is written to disk):

- every com.microsoft MatMulNBits whose codes, scales and zero points are initializers becomes a
  MatMul over its weight dequantized to float32 (plus an Add where it has a bias);
- every com.microsoft GatherBlockQuantized over a constant table becomes a Gather from the table
  dequantized to float32;
- every DequantizeLinear whose inputs are all initializers is folded into a float32 initializer;
- every float16 / bfloat16 initializer, constant, Cast target, dtype attribute and declared value
  type (graph inputs and outputs too: the KV cache and the logits) becomes float32, in nested
  subgraphs as well.

The weights keep the values the package stores (a float16 weight upcast is the same number); only
the arithmetic around them is done in float32. Ops that hold quantized weights of another kind
(QMoE's experts, say) are left as they are and named in ``Fp32Reference.kept``, so a caller can say
how far the reference is from a full fp32 computation. Initializers the rewrite does not touch stay
external (read from ``base_dir`` when the session loads them); new ones are held in the proto.

The dequantization (dequantize.py) is written from the specifications, independently of the op
implementations, so the reference does not inherit a bug of the path it checks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from onnxgen.errors import ModelLoadError
from onnxgen.runtime.dequantize import DequantizeError, dequantize_linear, gather_table, nbits_weight
from onnxgen.runtime.model_io import read_external_bytes

MS_DOMAIN = "com.microsoft"
_HALF = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
_DTYPE_ATTRIBUTES = ("to", "dtype", "output_dtype")  # integer attributes that name an element type
# ops that carry quantized weights this rewrite does not dequantize: named in Fp32Reference.kept
_QUANTIZED_OPS = {
    (MS_DOMAIN, "QMoE"),
    (MS_DOMAIN, "MatMulNBits"),
    (MS_DOMAIN, "GatherBlockQuantized"),
    (MS_DOMAIN, "MatMulIntegerToFloat"),
    (MS_DOMAIN, "DynamicQuantizeMatMul"),
    ("", "DequantizeLinear"),
    ("", "MatMulInteger"),
    ("", "QLinearMatMul"),
    ("", "QLinearConv"),
}


class Fp32ReferenceError(ModelLoadError):
    """The graph cannot be turned into its fp32 reference (a quantized weight of a layout the rewrite
    does not know); the message names the node."""


@dataclass
class Fp32Reference:
    """The rewritten model and what the rewrite did."""

    model: onnx.ModelProto
    dequantized: Counter[str] = field(default_factory=Counter)  # op type -> nodes replaced or folded
    upcast: int = 0  # float16/bfloat16 initializers, constants and Casts made float32
    kept: Counter[str] = field(default_factory=Counter)  # quantized op types left as they are

    def summary(self) -> str:
        parts = [f"{count} {op}" for op, count in sorted(self.dequantized.items())]
        done = f"dequantized {', '.join(parts)}" if parts else "no quantized weights"
        text = f"{done}; {self.upcast} float16 tensors and casts made float32"
        if self.kept:
            left = ", ".join(f"{count} {op}" for op, count in sorted(self.kept.items()))
            text += f"; left quantized (their weights stay as stored): {left}"
        return text


def fp32_reference(model: onnx.ModelProto, base_dir: str | Path | None) -> Fp32Reference:
    """The fp32 reference of ``model`` (left unchanged), whose external data lives in ``base_dir``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    rewrite = _Rewrite(out.graph, Path(base_dir) if base_dir is not None else None)
    rewrite.run()
    result = Fp32Reference(out, rewrite.dequantized, rewrite.upcast)
    for graph in _graphs(out.graph):
        for node in graph.node:
            if (node.domain or "", node.op_type) in _QUANTIZED_OPS:
                result.kept[node.op_type] += 1
    return result


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph nested in its nodes' attributes."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from _graphs(sub)


class _Rewrite:
    def __init__(self, graph: onnx.GraphProto, base_dir: Path | None):
        self.graph = graph
        self.base_dir = base_dir
        self.initializers = {t.name: t for t in graph.initializer}
        self.producers = {out: node for node in graph.node for out in node.output if out}
        self.dequantized: Counter[str] = Counter()
        self.upcast = 0
        self._cache: dict[tuple[str, ...], str] = {}  # dequantized weights by source names, made once

    def run(self) -> None:
        nodes: list[onnx.NodeProto] = []
        for node in self.graph.node:
            nodes.extend(self._replace(node))
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        _drop_dead(self.graph)
        for graph in _graphs(self.graph):
            self._upcast_graph(graph)

    # -- quantized ops ----------------------------------------------------------------------

    def _replace(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        domain = node.domain or ""
        try:
            if domain == MS_DOMAIN and node.op_type == "MatMulNBits":
                return self._matmul_nbits(node)
            if domain == MS_DOMAIN and node.op_type == "GatherBlockQuantized":
                return self._gather_block_quantized(node)
            if domain == "" and node.op_type == "DequantizeLinear":
                return self._dequantize_linear(node)
        except DequantizeError as exc:
            raise Fp32ReferenceError(f"{node.op_type} node {node.name!r}: {exc}") from None
        return [node]

    def _matmul_nbits(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        inputs = list(node.input) + [""] * (6 - len(node.input))
        a, b, scales, zeros, g_idx, bias = inputs[:6]
        if g_idx:
            return [node]  # act-order weights: left as they are (named in Fp32Reference.kept)
        arrays = [self._constant(name) for name in (b, scales)]
        zero = self._constant(zeros) if zeros else None
        if any(array is None for array in arrays) or (zeros and zero is None):
            return [node]  # weights computed in the graph: nothing to fold
        attrs = _attributes(node)
        n, k = int(attrs["N"]), int(attrs["K"])

        def weight_t() -> np.ndarray:  # [K, N]: MatMul's right operand
            weight = nbits_weight(
                arrays[0], arrays[1], zero, n=n, k=k, bits=int(attrs.get("bits", 4)),
                block_size=int(attrs["block_size"]),
            )  # fmt: skip
            return np.ascontiguousarray(weight.T)

        name = self._weight(("MatMulNBits", b, scales, zeros), f"{b}.fp32_reference", weight_t)
        self.dequantized["MatMulNBits"] += 1
        out = node.output[0]
        if not bias:
            return [onnx.helper.make_node("MatMul", [a, name], [out], name=f"{node.name}/fp32_reference")]
        product = f"{out}.fp32_reference_product"
        return [
            onnx.helper.make_node("MatMul", [a, name], [product], name=f"{node.name}/fp32_reference"),
            onnx.helper.make_node("Add", [product, bias], [out], name=f"{node.name}/fp32_reference_bias"),
        ]

    def _gather_block_quantized(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        inputs = list(node.input) + [""] * (4 - len(node.input))
        data, indices, scales, zeros = inputs[:4]
        arrays = [self._constant(name) for name in (data, scales)]
        zero = self._constant(zeros) if zeros else None
        if any(array is None for array in arrays) or (zeros and zero is None):
            return [node]
        attrs = _attributes(node)
        if int(attrs.get("gather_axis", 0)) != 0:
            raise DequantizeError(f"gather_axis {attrs['gather_axis']} is not supported (0)")

        def table() -> np.ndarray:
            return gather_table(
                arrays[0], arrays[1], zero, bits=int(attrs.get("bits", 4)),
                block_size=int(attrs.get("block_size", 128)), quantize_axis=int(attrs.get("quantize_axis", 1)),
            )  # fmt: skip

        name = self._weight(("GatherBlockQuantized", data, scales, zeros), f"{data}.fp32_reference", table)
        self.dequantized["GatherBlockQuantized"] += 1
        return [onnx.helper.make_node("Gather", [name, indices], [node.output[0]], name=f"{node.name}/fp32_reference")]

    def _dequantize_linear(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        names = list(node.input) + [""] * (3 - len(node.input))
        x, scale = self._constant(names[0]), self._constant(names[1])
        zero = self._constant(names[2]) if names[2] else None
        if x is None or scale is None or (names[2] and zero is None):
            return [node]  # activations, not weights
        attrs = _attributes(node)

        def folded() -> np.ndarray:
            return dequantize_linear(
                x, scale, zero, axis=int(attrs.get("axis", 1)), block_size=int(attrs.get("block_size", 0))
            )

        self._weight(("DequantizeLinear", *names), node.output[0], folded)
        self.dequantized["DequantizeLinear"] += 1
        return []

    def _weight(self, key: tuple[str, ...], name: str, make: Callable[[], np.ndarray]) -> str:
        """The float32 initializer for ``key``'s weight, made (by ``make()``) only once. Filled in
        place in the graph: a TensorProto appended would be copied whole once more."""
        if key not in self._cache:
            array = make()
            tensor = self.graph.initializer.add()
            tensor.name = name
            tensor.data_type = TensorProto.FLOAT
            tensor.dims.extend(array.shape)
            tensor.raw_data = array.astype("<f4", copy=False).tobytes()
            self._cache[key] = name
        return self._cache[key]

    def _constant(self, name: str) -> np.ndarray | None:
        """The value of ``name`` where the graph fixes it: an initializer, a Constant, or a Reshape of
        such values (the tied-table layout reshapes the LM head's codes into rows); else None."""
        tensor = self.initializers.get(name)
        if tensor is not None:
            return _array(tensor, self.base_dir)
        node = self.producers.get(name)
        if node is None:
            return None
        if node.op_type == "Constant" and not node.domain:
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
            return None
        if node.op_type == "Reshape" and not node.domain and len(node.input) >= 2:
            data, shape = self._constant(node.input[0]), self._constant(node.input[1])
            if data is None or shape is None:
                return None
            dims = [int(d) for d in shape.reshape(-1)]
            if not int(_attributes(node).get("allowzero", 0)):  # a 0 copies the input's extent there
                dims = [data.shape[i] if d == 0 else d for i, d in enumerate(dims)]
            return data.reshape(dims)
        return None

    # -- float16 -> float32 -------------------------------------------------------------------

    def _upcast_graph(self, graph: onnx.GraphProto) -> None:
        for index, tensor in enumerate(graph.initializer):
            if tensor.data_type in _HALF:
                graph.initializer[index].CopyFrom(_float32_tensor(tensor, self.base_dir))
                self.upcast += 1
        for info in (*graph.input, *graph.output, *graph.value_info):
            _upcast_type(info.type)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in _HALF:
                    attr.t.CopyFrom(_float32_tensor(attr.t, self.base_dir))
                    self.upcast += 1
                elif attr.type == onnx.AttributeProto.TENSORS:
                    for tensor in attr.tensors:
                        if tensor.data_type in _HALF:
                            tensor.CopyFrom(_float32_tensor(tensor, self.base_dir))
                            self.upcast += 1
                elif attr.type == onnx.AttributeProto.INT and attr.name in _DTYPE_ATTRIBUTES and attr.i in _HALF:
                    attr.i = TensorProto.FLOAT
                    self.upcast += 1


def _attributes(node: onnx.NodeProto) -> dict[str, object]:
    return {attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute}


def _array(tensor: TensorProto, base_dir: Path | None) -> np.ndarray:
    """An initializer's value as numpy, its external data read (checked) from ``base_dir``."""
    if tensor.data_location == TensorProto.EXTERNAL:
        if base_dir is None:
            raise ModelLoadError(
                f"tensor {tensor.name!r} keeps its data in an external file, but no directory was given to read it from"
            )
        inline = TensorProto()
        inline.CopyFrom(tensor)
        del inline.external_data[:]
        inline.data_location = TensorProto.DEFAULT
        inline.raw_data = read_external_bytes(tensor, base_dir)
        tensor = inline
    return numpy_helper.to_array(tensor)


def _float32_tensor(tensor: TensorProto, base_dir: Path | None) -> TensorProto:
    """A float16/bfloat16 tensor as the same values in float32 (exact: float32 holds every one)."""
    array = _array(tensor, base_dir).astype(np.float32)
    return numpy_helper.from_array(array, tensor.name)


def _upcast_type(value_type: onnx.TypeProto) -> None:
    kind = value_type.WhichOneof("value")
    if kind == "tensor_type" and value_type.tensor_type.elem_type in _HALF:
        value_type.tensor_type.elem_type = TensorProto.FLOAT
    elif kind == "sequence_type":
        _upcast_type(value_type.sequence_type.elem_type)
    elif kind == "optional_type":
        _upcast_type(value_type.optional_type.elem_type)


def _used_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name read by a node of ``graph`` or of a subgraph (outer-scope reads included)."""
    used: set[str] = set()
    for sub in _graphs(graph):
        for node in sub.node:
            used.update(name for name in node.input if name)
        used.update(o.name for o in sub.output)
    return used


def _drop_dead(graph: onnx.GraphProto) -> None:
    """Removes the nodes whose outputs nothing reads (the Reshapes that fed a replaced op) and the
    initializers left unread (the quantized codes), so the session neither runs nor loads them."""
    while True:
        used = _used_names(graph)
        live = [node for node in graph.node if any(out in used for out in node.output if out)]
        if len(live) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(live)
    used = _used_names(graph) | {i.name for i in graph.input}
    for index in reversed(range(len(graph.initializer))):  # one by one: no copy of the tensors kept
        if graph.initializer[index].name not in used:
            del graph.initializer[index]
