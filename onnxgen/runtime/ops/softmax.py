"""Softmax, LogSoftmax, Hardmax.

Before opset 13 these flatten the input to 2-D at ``axis`` (default 1) and normalize each row over
all trailing dims; from opset 13 they normalize along the single ``axis`` (default -1).
torch's softmax accumulates half inputs in fp32 on both CPU and CUDA, so halves stay halves.
"""

from __future__ import annotations

import torch

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.common import normalize_axis
from onnxgen.runtime.ops.registry import implements


def _hardmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    out = torch.zeros_like(x)
    if x.shape[dim] == 0 or x.numel() == 0:
        return out
    index = torch.argmax(x, dim=dim, keepdim=True)  # first maximum wins, as the spec asks
    return out.scatter_(dim, index, torch.ones_like(index, dtype=x.dtype))


def _along(op_type: str, x: torch.Tensor, dim: int) -> torch.Tensor:
    if op_type == "Softmax":
        return torch.softmax(x, dim=dim)
    if op_type == "LogSoftmax":
        return torch.log_softmax(x, dim=dim)
    return _hardmax(x, dim)


_OPS = ("Softmax", "LogSoftmax", "Hardmax")


@implements(_OPS, since=1)
def normalize_flattened(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    axis = normalize_axis(ctx.attr("axis", 1), x.dim())
    rows = 1
    for size in x.shape[:axis]:
        rows *= size
    cols = 1
    for size in x.shape[axis:]:
        cols *= size
    return _along(ctx.op_type, x.reshape(rows, cols), 1).reshape(x.shape)


@implements(_OPS, since=13)
def normalize_axis_op(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0:
        return _along(ctx.op_type, x.reshape(1), 0).reshape(())
    return _along(ctx.op_type, x, normalize_axis(ctx.attr("axis", -1), x.dim()))
