"""What a shape rule sees: the node, its attributes, its inputs' TensorInfo, and the symbol table."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper

from onnxgen.runtime.shapes.dimexpr import DimExpr, product
from onnxgen.runtime.shapes.symbols import Dim, SymbolTable
from onnxgen.runtime.shapes.tensor import VALUE_MAX_ELEMENTS, TensorInfo


class RuleFailed(Exception):
    """The rule cannot decide the output shapes from what is known (outputs stay unresolved)."""


class RuleContext:
    def __init__(
        self,
        node: onnx.NodeProto,
        name: str,
        opset: int,
        inputs: list[TensorInfo | None],
        table: SymbolTable,
        subgraph_runner: Callable[[onnx.GraphProto, list[TensorInfo]], list[TensorInfo]],
    ) -> None:
        self.node = node
        self.name = name
        self.op_type = node.op_type
        self.opset = opset
        self.inputs = inputs
        self.table = table
        self._attrs: dict[str, Any] | None = None
        self._run_subgraph = subgraph_runner

    # -- node facts ----------------------------------------------------------------------
    @property
    def num_outputs(self) -> int:
        return len(self.node.output)

    def attr(self, name: str, default: Any = None) -> Any:
        if self._attrs is None:
            self._attrs = {}
            for a in self.node.attribute:
                if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                    self._attrs[a.name] = a.g if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
                else:
                    v = helper.get_attribute_value(a)
                    self._attrs[a.name] = v.decode() if isinstance(v, bytes) else v
        return self._attrs.get(name, default)

    def input(self, i: int) -> TensorInfo | None:
        return self.inputs[i] if i < len(self.inputs) else None

    def shape(self, i: int) -> tuple[Dim, ...]:
        """The input's shape; the rule fails when it is unknown."""
        t = self.input(i)
        if t is None or t.shape is None:
            raise RuleFailed(f"input {i} has no known shape")
        return t.shape

    def dtype(self, i: int) -> int:
        t = self.input(i)
        return t.dtype if t is not None else 0

    def has(self, i: int) -> bool:
        return self.input(i) is not None

    # -- values (small int tensors) ------------------------------------------------------
    def value(self, i: int) -> np.ndarray | None:
        t = self.input(i)
        return None if t is None else t.value

    def dims_value(self, i: int) -> list[Dim]:
        """A 1-D shape-like input as dims; fails when any element is unknown."""
        v = self.value(i)
        if v is None or any(e is None for e in v.reshape(-1)):
            raise RuleFailed(f"input {i} carries values that are not known")
        return [self.dim(e) for e in v.reshape(-1)]

    def dims_value_or_data(self, i: int) -> list[Dim]:
        """As dims_value; when the values come from device data but their count is known, one
        data-dependent symbol per element (the rank is still known)."""
        try:
            return self.dims_value(i)
        except RuleFailed:
            shape = self.shape(i)
            if len(shape) != 1 or not isinstance(shape[0], int):
                raise
            return [self.data_dependent() for _ in range(shape[0])]

    def ints_value(self, i: int) -> list[int] | None:
        """A 1-D input as ints if every element is a constant, else None."""
        v = self.value(i)
        if v is None:
            return None
        out = []
        for e in v.reshape(-1):
            c = None if e is None else e.const_value()
            if c is None:
                return None
            out.append(c)
        return out

    def ints_attr_or_input(self, attr: str, i: int) -> list[int] | None:
        """Axes and similar: an attribute (older opsets) or a constant input (newer)."""
        a = self.attr(attr)
        if a is not None:
            return [int(x) for x in a]
        if not self.has(i):
            return None
        got = self.ints_value(i)
        if got is None:
            raise RuleFailed(f"input {i} ({attr}) is not a known constant")
        return got

    # -- dims ----------------------------------------------------------------------------
    def e(self, d: Dim) -> DimExpr:
        return self.table.expr(d)

    def dim(self, expr: DimExpr | int) -> Dim:
        if isinstance(expr, int):
            if expr < 0:
                return self.table.opaque(f"{self.name}: negative extent {expr}")
            return expr
        return self.table.intern(expr, self.name)

    def prod(self, dims: Iterable[Dim]) -> DimExpr:
        return product(self.e(d) for d in dims)

    def derived(self, *deps: Iterable[Dim] | Dim) -> Dim:
        """A symbol that is a function of the given dims' symbols (no formula kept)."""
        sources: set[str] = set()
        for dep in deps:
            items = [dep] if isinstance(dep, int | str) else list(dep)
            for d in items:
                if isinstance(d, str):
                    sources |= self.e(d).symbols()
        return self.table.opaque(self.name, sources)

    def data_dependent(self) -> Dim:
        """A symbol for an extent that depends on tensor data (no provenance)."""
        return self.table.opaque(f"{self.name}: data-dependent")

    def unify(self, a: Dim, b: Dim) -> Dim:
        return self.table.unify(a, b, self.name)

    def broadcast(self, shapes: Sequence[tuple[Dim, ...]]) -> tuple[Dim, ...]:
        """Multidirectional broadcast; where two different symbols meet, record a unification."""
        rank = max((len(s) for s in shapes), default=0)
        out: list[Dim] = []
        for axis in range(rank):
            dims = [s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0]
            chosen: Dim = 1
            for d in dims:
                if d == 1:
                    continue
                chosen = d if chosen == 1 else self.unify(chosen, d)
            out.append(chosen)
        return tuple(out)

    def axis(self, axis: int, rank: int) -> int:
        if not -max(rank, 1) <= axis < max(rank, 1):
            raise RuleFailed(f"axis {axis} out of range for rank {rank}")
        return axis + rank if axis < 0 else axis

    # -- results -------------------------------------------------------------------------
    def out(self, shape: Sequence[Dim] | None, dtype: int, value: np.ndarray | None = None) -> TensorInfo:
        if value is not None and not isinstance(value, np.ndarray):  # numpy hands back 0-d results bare
            boxed = np.empty((), dtype=object)
            boxed[()] = value
            value = boxed
        if value is not None and value.size > VALUE_MAX_ELEMENTS:
            value = None
        return TensorInfo(None if shape is None else tuple(shape), dtype, value)

    def subgraph(self, graph: onnx.GraphProto, inputs: list[TensorInfo]) -> list[TensorInfo]:
        return self._run_subgraph(graph, inputs)


def value_shape(shape: tuple[Dim, ...] | None) -> tuple[int, ...] | None:
    """The concrete shape a tracked value needs, or None."""
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    n = 1
    for d in shape:
        n *= d  # type: ignore[operator]
    return tuple(shape) if n <= VALUE_MAX_ELEMENTS else None  # type: ignore[return-value]


def expr_array(items: Iterable[DimExpr | int | None], shape: tuple[int, ...]) -> np.ndarray:
    flat = [None if v is None else (v if isinstance(v, DimExpr) else DimExpr.const(int(v))) for v in items]
    arr = np.empty(len(flat), dtype=object)
    arr[:] = flat
    return arr.reshape(shape)
