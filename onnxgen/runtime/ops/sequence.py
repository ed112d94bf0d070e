"""Sequence and Optional ops.

Representations (shared with the executor and the session):
- A sequence is a Python ``list`` of tensors. Kernels never mutate a list they were given;
  SequenceInsert/Erase return a new list, because the input value may still be live elsewhere.
- An empty optional is Python ``None``, the same value the executor passes for a missing
  optional input. ONNX treats both alike wherever an optional is accepted (OptionalHasElement
  answers false for either; OptionalGetElement fails for either), and the session already
  feeds and returns ``None`` for an empty optional, so no sentinel class is needed.
- An optional that holds a value is just that value (a tensor or a list).
"""

from __future__ import annotations

from typing import Any

import torch

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.common import ints, normalize_axis
from onnxgen.runtime.ops.registry import implements

HOST_SEAM = "sequence values live on the host"


def _position(ctx: NodeContext, position: torch.Tensor | None, length: int, default: int, *, insert: bool) -> int:
    if position is None:
        return default
    pos = ints(position)[0]
    limit = length + 1 if insert else length
    if not -length <= pos < limit:
        raise ctx.fail(f"position {pos} is out of range for a sequence of {length} tensors")
    return pos + length if pos < 0 else pos


@implements("SequenceEmpty", since=11, capture=HOST_SEAM)
def sequence_empty(ctx: NodeContext) -> list[torch.Tensor]:
    return []


@implements("SequenceConstruct", since=11, capture=HOST_SEAM)
def sequence_construct(ctx: NodeContext, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return list(tensors)


@implements("SequenceInsert", since=11, capture=HOST_SEAM, host_inputs=(2,))
def sequence_insert(
    ctx: NodeContext, seq: list[torch.Tensor], tensor: torch.Tensor, position: torch.Tensor | None = None
) -> list[torch.Tensor]:
    out = list(seq)
    out.insert(_position(ctx, position, len(seq), len(seq), insert=True), tensor)
    return out


@implements("SequenceAt", since=11, capture=HOST_SEAM, host_inputs=(1,))
def sequence_at(ctx: NodeContext, seq: list[torch.Tensor], position: torch.Tensor) -> torch.Tensor:
    return seq[_position(ctx, position, len(seq), 0, insert=False)]


@implements("SequenceErase", since=11, capture=HOST_SEAM, host_inputs=(1,))
def sequence_erase(ctx: NodeContext, seq: list[torch.Tensor], position: torch.Tensor | None = None) -> list:
    out = list(seq)
    del out[_position(ctx, position, len(seq), len(seq) - 1, insert=False)]
    return out


@implements("SequenceLength", since=11, capture=HOST_SEAM)
def sequence_length(ctx: NodeContext, seq: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor(len(seq), dtype=torch.int64, device=ctx.device)


@implements("SplitToSequence", since=11, capture=HOST_SEAM, host_inputs=(1,))
def split_to_sequence(ctx: NodeContext, x: torch.Tensor, split: torch.Tensor | None = None) -> list[torch.Tensor]:
    axis = normalize_axis(ctx.attr("axis", 0), x.dim())
    if split is None:  # one slice per index; keepdims=0 drops the split axis
        parts = list(torch.split(x, 1, dim=axis))
        if not ctx.attr("keepdims", 1):
            parts = [p.squeeze(axis) for p in parts]
        return [p.contiguous() for p in parts]
    sizes = ints(split)
    chunk: int | list[int] = sizes[0] if split.dim() == 0 else sizes
    return [p.contiguous() for p in torch.split(x, chunk, dim=axis)]


@implements("ConcatFromSequence", since=11, capture=HOST_SEAM)
def concat_from_sequence(ctx: NodeContext, seq: list[torch.Tensor]) -> torch.Tensor:
    if ctx.attr("new_axis", 0):
        axis = normalize_axis(ctx.require("axis"), seq[0].dim() + 1)
        return torch.stack(seq, dim=axis)
    axis = normalize_axis(ctx.require("axis"), seq[0].dim())
    return torch.cat(seq, dim=axis)


@implements("SequenceMap", since=17, capture="host control flow")
def sequence_map(ctx: NodeContext, seq: list[torch.Tensor], *extra: Any) -> tuple[list[torch.Tensor], ...]:
    outputs: list[list[torch.Tensor]] = [[] for _ in range(ctx.num_outputs)]
    for i in range(len(seq)):
        args = [seq[i]] + [e[i] if isinstance(e, list) else e for e in extra]
        for collected, value in zip(outputs, ctx.run_subgraph("body", args)):
            collected.append(value)
    return tuple(outputs)


@implements("Optional", since=15, capture=HOST_SEAM)
def optional(ctx: NodeContext, value: Any = None) -> Any:
    return value


@implements("OptionalHasElement", since=15, capture=HOST_SEAM)
def optional_has_element(ctx: NodeContext, value: Any = None) -> torch.Tensor:
    return torch.tensor(value is not None, dtype=torch.bool, device=ctx.device)


@implements("OptionalGetElement", since=15, capture=HOST_SEAM)
def optional_get_element(ctx: NodeContext, value: Any = None) -> Any:
    if value is None:
        raise ctx.fail("the optional is empty")
    return value
