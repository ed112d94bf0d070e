"""Shape-changing and tensor-building ops: Shape, Reshape, Squeeze, Transpose, Expand, Range, Trilu, OneHot, ...

Conventions of the data-movement ops (shape_ops, indexing):
- Outputs go to the *input's* device, not ``ctx.device``: host-eligible ops also run as shape
  arithmetic on small CPU tensors while the session's device is CUDA.
- Outputs are contiguous; a free view of a contiguous input (Reshape, Squeeze, ...) may alias it.
- Shape-like inputs are ``host_inputs`` read with ``ints()``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from onnxgen.runtime.dtypes import torch_dtype
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.common import ints, normalize_axis
from onnxgen.runtime.ops.registry import implements


def _shape_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


@implements("Shape")
def shape(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    dims = list(x.shape)
    rank = len(dims)

    def clamp(v: int) -> int:
        return min(max(v + rank if v < 0 else v, 0), rank)

    start = clamp(ctx.attr("start", 0))
    end = clamp(ctx.attr("end", rank))
    return _shape_tensor(dims[start:end], ctx.device)


@implements("Size")
def size(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(x.numel(), dtype=torch.int64, device=ctx.device)


def _reshape_target(x: torch.Tensor, target: list[int], allowzero: bool) -> list[int]:
    out = list(target)
    if not allowzero:  # 0 copies the input's dim at that position
        out = [x.shape[i] if v == 0 else v for i, v in enumerate(out)]
    if -1 in out:
        known = math.prod(v for v in out if v != -1)
        out[out.index(-1)] = x.numel() // known if known else 0
    return out


@implements("Reshape")
def reshape_v1(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    return x.reshape(_reshape_target(x, list(ctx.require("shape")), False))


@implements("Reshape", since=5, host_inputs=(1,))
def reshape(ctx: NodeContext, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return x.reshape(_reshape_target(x, ints(target), bool(ctx.attr("allowzero", 0))))


@implements("Flatten")
def flatten(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    rank = x.dim()
    axis = ctx.attr("axis", 1)
    axis = axis + rank if axis < 0 else axis
    return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


def _squeeze(x: torch.Tensor, axes: list[int] | None) -> torch.Tensor:
    if not axes:
        return x.reshape([d for d in x.shape if d != 1])
    drop = {normalize_axis(a, x.dim()) for a in axes}
    return x.reshape([d for i, d in enumerate(x.shape) if i not in drop])


@implements("Squeeze")
def squeeze_v1(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    return _squeeze(x, ctx.attr("axes"))


@implements("Squeeze", since=13, host_inputs=(1,))
def squeeze(ctx: NodeContext, x: torch.Tensor, axes: torch.Tensor | None = None) -> torch.Tensor:
    return _squeeze(x, ints(axes) if axes is not None else None)


def _unsqueeze(x: torch.Tensor, axes: list[int]) -> torch.Tensor:
    out_rank = x.dim() + len(axes)
    new = sorted(normalize_axis(a, out_rank) for a in axes)
    dims = list(x.shape)
    for a in new:  # ascending insertion keeps earlier positions valid
        dims.insert(a, 1)
    return x.reshape(dims)


@implements("Unsqueeze")
def unsqueeze_v1(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    return _unsqueeze(x, list(ctx.require("axes")))


@implements("Unsqueeze", since=13, host_inputs=(1,))
def unsqueeze(ctx: NodeContext, x: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
    return _unsqueeze(x, ints(axes))


@implements("Transpose")
def transpose(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    perm = ctx.attr("perm") or list(range(x.dim()))[::-1]
    return x.permute(*perm).contiguous()


@implements("Expand", since=8, host_inputs=(1,))
def expand(ctx: NodeContext, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    out_shape = torch.broadcast_shapes(tuple(x.shape), tuple(ints(target)))
    return x.expand(out_shape).contiguous()


@implements("Tile", since=6, host_inputs=(1,))
def tile(ctx: NodeContext, x: torch.Tensor, repeats: torch.Tensor) -> torch.Tensor:
    reps = ints(repeats)
    if x.dim() == 0:
        return x.clone()
    return x.repeat(*reps)


@implements("ConstantOfShape", since=9, host_inputs=(0,))
def constant_of_shape(ctx: NodeContext, target: torch.Tensor) -> torch.Tensor:
    value = ctx.attr("value")
    dims = ints(target)
    if value is None:
        return torch.zeros(dims, dtype=torch.float32, device=ctx.device)
    # a fill with a host scalar records into a CUDA graph; copying the attribute tensor up would not
    return torch.full(dims, value.reshape(-1)[0].item(), dtype=value.dtype, device=ctx.device)


@implements("Range", since=11, host_inputs=(0, 1, 2), capture="output values come from host scalars")
def range_(ctx: NodeContext, start: torch.Tensor, limit: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    dtype = start.dtype
    s, l, d = start.item(), limit.item(), delta.item()
    count = max(math.ceil((l - s) / d), 0)
    if not dtype.is_floating_point:
        return (torch.arange(count, dtype=torch.int64) * int(d) + int(s)).to(dtype).to(ctx.device)
    # onnxruntime adds delta step by step in the input type (float32 for half types); a sequential
    # accumulate on the host reproduces its rounding exactly
    np_type = np.float64 if dtype == torch.float64 else np.float32
    steps = np.full(count, d, dtype=np_type)
    if count:
        steps[0] = s
    values = np.add.accumulate(steps, dtype=np_type)
    return torch.from_numpy(values).to(dtype).to(ctx.device)


@implements("EyeLike", since=9)
def eye_like(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    dtype_attr = ctx.attr("dtype")
    dtype = torch_dtype(dtype_attr) if dtype_attr is not None else x.dtype
    rows, cols = x.shape
    k = ctx.attr("k", 0)
    r = torch.arange(rows, device=x.device).unsqueeze(1)
    c = torch.arange(cols, device=x.device).unsqueeze(0)
    return (c - r == k).to(dtype)


@implements("Trilu", since=14, host_inputs=(1,))
def trilu(ctx: NodeContext, x: torch.Tensor, k: torch.Tensor | None = None) -> torch.Tensor:
    diagonal = ints(k)[0] if k is not None else 0
    if x.shape[-1] == 0 or x.shape[-2] == 0:
        return x.clone()
    # torch.triu/tril lack kernels for some dtypes (bool on CUDA, uint); a mask works for all
    rows, cols = x.shape[-2], x.shape[-1]
    r = torch.arange(rows, device=x.device).unsqueeze(1)
    c = torch.arange(cols, device=x.device).unsqueeze(0)
    keep = (c - r >= diagonal) if ctx.attr("upper", 1) else (c - r <= diagonal)
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


@implements("OneHot", since=9, host_inputs=(1,))
def one_hot(ctx: NodeContext, indices: torch.Tensor, depth: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    n = int(depth.reshape(-1)[0].item())
    idx = indices.to(torch.int64)
    idx = torch.where(idx < 0, idx + n, idx)  # out-of-range indices match no class: all "off"
    classes = torch.arange(n, device=indices.device)
    hit = idx.unsqueeze(-1) == classes
    axis = normalize_axis(ctx.attr("axis", -1), indices.dim() + 1)
    hit = hit.movedim(-1, axis)
    values = values.to(indices.device)
    return torch.where(hit, values[1], values[0]).contiguous()
