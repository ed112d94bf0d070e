"""The contract between the executor and the ONNX op implementations.

An op implementation sees its node only through ``NodeContext`` (attributes, opset, device,
subgraph bodies) and a subgraph only through ``Subgraph`` (its declared outputs, a positional
run). The executor builds these; op implementations import this module and never the executor,
so no import goes both ways.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from onnxgen.errors import OpError


@dataclass
class ValueInfo:
    """A graph value's declared type: what a node knows of an input or output before it runs."""

    name: str
    elem_type: int  # 0 when unknown (non-tensor or untyped)
    shape: list[int | str | None] | None  # None: rank unknown; str: symbolic dim
    type_str: str


class Subgraph(Protocol):
    """A graph attribute (If/Loop/Scan body, FlexAttention modifier) as an op implementation sees it."""

    outputs: list[ValueInfo]

    def run_positional(self, inputs: list[Any], outer: Any, device: torch.device) -> list[Any]: ...


@dataclass
class NodeContext:
    name: str
    op_type: str
    domain: str
    opset: int
    attrs: dict[str, Any]
    device: torch.device
    num_inputs: int
    num_outputs: int
    # which declared outputs have a name (an empty name means the output is not wanted)
    outputs_wanted: tuple[bool, ...] = ()
    subgraphs: dict[str, Subgraph] = field(default_factory=dict)
    # set by the executor while the node runs: the enclosing value scope, for subgraphs
    scope: Any = None

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def require(self, name: str) -> Any:
        if name not in self.attrs:
            raise OpError(f"{self.op_type} node {self.name!r} needs attribute {name!r}")
        return self.attrs[name]

    def fail(self, message: str) -> OpError:
        return OpError(f"{self.op_type} node {self.name!r}: {message}")

    def run_subgraph(self, attr_name: str, inputs: Sequence[Any]) -> list[Any]:
        """Run the graph attribute ``attr_name`` with positional inputs; outer names resolve in scope."""
        program = self.subgraphs[attr_name]
        return program.run_positional(list(inputs), outer=self.scope, device=self.device)
