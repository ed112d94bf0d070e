"""The inference driver: walks a graph (and control-flow bodies) once, applying per-op rules.

Dims start as the graph's declared dim_params (roots, or ints where the caller binds a value);
rules derive the rest. Graph outputs' declared dims are unified with the inferred ones, so a
declared ``present.*`` extent and the Concat that produces it are one class for the classifier.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from onnxgen.runtime.shapes.context import RuleContext, RuleFailed, expr_array
from onnxgen.runtime.shapes.rules import load_rules
from onnxgen.runtime.shapes.symbols import Dim, SymbolTable
from onnxgen.runtime.shapes.tensor import INT_TYPES, VALUE_MAX_ELEMENTS, TensorInfo


@dataclass
class NodeShapes:
    index: int
    name: str
    op_type: str
    domain: str
    inputs: list[str]
    outputs: list[str]
    input_infos: list[TensorInfo | None]
    output_infos: list[TensorInfo | None]
    resolved: bool
    note: str = ""  # why it is unresolved


@dataclass
class ShapeResult:
    table: SymbolTable
    values: dict[str, TensorInfo]
    nodes: list[NodeShapes]
    graph_inputs: dict[str, TensorInfo]
    graph_outputs: dict[str, TensorInfo]
    binding: dict[str, int | None] = field(default_factory=dict)
    # the graph's declared output dims (after the binding), for declared-KV sources
    declared_outputs: dict[str, tuple[Dim, ...] | None] = field(default_factory=dict)

    def node(self, name: str) -> NodeShapes:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


def _domain(d: str) -> str:
    return "" if d in ("", "ai.onnx") else d


def _declared(vi: onnx.ValueInfoProto) -> tuple[str, list[int | str | None] | None, int]:
    t = vi.type
    if t.HasField("sequence_type"):
        return "sequence", None, 0
    if t.HasField("optional_type"):
        return "optional", None, 0
    if not t.HasField("tensor_type"):
        return "other", None, 0
    tt = t.tensor_type
    if not tt.HasField("shape"):
        return "tensor", None, tt.elem_type
    dims: list[int | str | None] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return "tensor", dims, tt.elem_type


def _constant_info(array: np.ndarray, dtype: int) -> TensorInfo:
    value = None
    if dtype in INT_TYPES and array.size <= VALUE_MAX_ELEMENTS:
        value = expr_array((int(x) for x in array.reshape(-1)), array.shape)
    return TensorInfo(tuple(int(d) for d in array.shape), dtype, value)


def _initializer_info(t: onnx.TensorProto) -> TensorInfo:
    count = int(np.prod(t.dims)) if len(t.dims) else 1
    if t.data_type in INT_TYPES and count <= VALUE_MAX_ELEMENTS and t.data_location != onnx.TensorProto.EXTERNAL:
        return _constant_info(numpy_helper.to_array(t), t.data_type)
    return TensorInfo(tuple(int(d) for d in t.dims), t.data_type)


class ShapeInference:
    def __init__(self, model: onnx.ModelProto, binding: Mapping[str, int | None] | None = None) -> None:
        if model.functions:
            from onnx import inliner

            model = inliner.inline_local_functions(model)
        self.model = model
        self.opsets = {_domain(o.domain): o.version for o in model.opset_import}
        self.binding = dict(binding or {})
        self.table = SymbolTable()
        self.rules = load_rules()

    # -- declared dims -------------------------------------------------------------------
    def _declared_dim(self, d: int | str | None, where: str) -> Dim:
        if isinstance(d, int):
            return d
        if d is None:
            return self.table.opaque(f"{where}: undeclared dim")
        bound = self.binding.get(d)
        if bound is not None:
            return int(bound)
        return self.table.root(d, where)

    def _input_info(self, vi: onnx.ValueInfoProto) -> TensorInfo:
        kind, dims, dtype = _declared(vi)
        if kind != "tensor":
            return TensorInfo(None, 0, kind=kind)
        if dims is None:
            return TensorInfo(None, dtype)
        shape = tuple(self._declared_dim(d, f"{vi.name}[{i}]") for i, d in enumerate(dims))
        return TensorInfo(shape, dtype)

    # -- the walk ------------------------------------------------------------------------
    def run(self) -> ShapeResult:
        graph = self.model.graph
        env: dict[str, TensorInfo] = {}
        for t in graph.initializer:
            env[t.name] = _initializer_info(t)
        inputs: dict[str, TensorInfo] = {}
        for vi in graph.input:
            if vi.name in env:
                continue  # an input with an initializer default: the initializer's shape
            inputs[vi.name] = env[vi.name] = self._input_info(vi)
        records: list[NodeShapes] = []
        self._walk(graph, env, records)
        outputs: dict[str, TensorInfo] = {}
        declared: dict[str, tuple[Dim, ...] | None] = {}
        for vi in graph.output:
            info = env.get(vi.name)
            kind, dims, dtype = _declared(vi)
            declared[vi.name] = (
                None
                if dims is None
                else tuple(self._declared_dim(d, f"{vi.name}[{i}]") if d is not None else 0 for i, d in enumerate(dims))
            )
            if info is not None and info.shape is not None and dims is not None and len(dims) == len(info.shape):
                # declared output dims are facts the model states: they meet the inferred ones here
                for i, d in enumerate(dims):
                    if d is not None:
                        self.table.unify(info.shape[i], self._declared_dim(d, f"{vi.name}[{i}]"), f"output {vi.name}")
            outputs[vi.name] = info if info is not None else TensorInfo(None, dtype)
        return ShapeResult(self.table, env, records, inputs, outputs, dict(self.binding), declared)

    def _walk(self, graph: onnx.GraphProto, env: Any, records: list[NodeShapes] | None) -> None:
        for index, node in enumerate(graph.node):
            name = node.name or f"{node.op_type}_{index}"
            ins = [env.get(i) if i else None for i in node.input]
            outs, resolved, note = self._apply(node, name, ins, env)
            for out_name, info in zip(node.output, outs):
                if out_name and info is not None:
                    env[out_name] = info
            if records is not None:
                records.append(
                    NodeShapes(
                        index,
                        name,
                        node.op_type,
                        _domain(node.domain),
                        list(node.input),
                        list(node.output),
                        ins,
                        outs,
                        resolved,
                        note,
                    )
                )

    def _apply(
        self, node: onnx.NodeProto, name: str, ins: list[TensorInfo | None], env: Any
    ) -> tuple[list[TensorInfo | None], bool, str]:
        domain = _domain(node.domain)
        n_out = len(node.output)
        fn = self.rules.get((domain, node.op_type))
        if fn is None:
            return [None] * n_out, False, "no shape rule for this op"
        for i, (input_name, info) in enumerate(zip(node.input, ins)):
            if input_name and info is None:
                return [None] * n_out, False, f"input {i} ({input_name}) is unresolved"

        def run_body(body: onnx.GraphProto, body_inputs: list[TensorInfo]) -> list[TensorInfo]:
            scope = ChainMap({}, env)
            for t in body.initializer:
                scope[t.name] = _initializer_info(t)
            for vi, info in zip(body.input, body_inputs):
                scope[vi.name] = info
            self._walk(body, scope, None)
            return [scope.get(o.name) or TensorInfo(None, _declared(o)[2]) for o in body.output]

        ctx = RuleContext(node, name, self.opsets.get(domain, 1), ins, self.table, run_body)
        try:
            outs = fn(ctx)
        except RuleFailed as exc:
            return [None] * n_out, False, str(exc)
        except (ValueError, IndexError, TypeError, ZeroDivisionError) as exc:
            return [None] * n_out, False, f"shape rule failed: {exc}"
        if outs is None:
            return [None] * n_out, False, "shape rule could not decide"
        outs = list(outs) + [None] * (n_out - len(outs))
        for i, o in enumerate(node.output):
            if o and outs[i] is None:
                return outs, False, f"output {i} unresolved"
        return outs, True, ""


def infer_shapes(model: onnx.ModelProto, binding: Mapping[str, int | None] | None = None) -> ShapeResult:
    """Symbolic shapes of every value in ``model``. ``binding``: dim_param → value (int) or None
    (pinned without a value, which inference does not need to know)."""
    return ShapeInference(model, binding).run()
