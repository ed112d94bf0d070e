"""What a kernel sees of its node: attributes, opset, device, subgraphs; helpers shared by kernels."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from onnxgen.errors import KernelError

if TYPE_CHECKING:
    from onnxgen.runtime.executor import GraphProgram


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
    subgraphs: dict[str, GraphProgram] = field(default_factory=dict)
    # set by the executor while the node runs: the enclosing value scope, for subgraphs
    scope: Any = None

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def require(self, name: str) -> Any:
        if name not in self.attrs:
            raise KernelError(f"{self.op_type} node {self.name!r} needs attribute {name!r}")
        return self.attrs[name]

    def fail(self, message: str) -> KernelError:
        return KernelError(f"{self.op_type} node {self.name!r}: {message}")

    def run_subgraph(self, attr_name: str, inputs: Sequence[Any]) -> list[Any]:
        """Run the graph attribute ``attr_name`` with positional inputs; outer names resolve in scope."""
        program = self.subgraphs[attr_name]
        return program.run_positional(list(inputs), outer=self.scope, device=self.device)


def ints(value: torch.Tensor | Sequence[int] | None) -> list[int]:
    """A shape-like tensor as Python ints (host read; the executor keeps such tensors on the host)."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    return [int(v) for v in value]


def scalar(value: torch.Tensor) -> Any:
    return value.reshape(-1)[0].item()


def normalize_axis(axis: int, rank: int) -> int:
    if not -max(rank, 1) <= axis < max(rank, 1):
        raise KernelError(f"axis {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis
