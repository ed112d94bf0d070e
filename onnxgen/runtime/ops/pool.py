"""Pooling: AveragePool, MaxPool (with Indices), LpPool, their Global forms, MaxUnpool, MaxRoiPool.

The general path materialises every window with ``Tensor.unfold`` (any rank, asymmetric pads,
dilations, ceil_mode) and reduces it. Where torch's own pooling has exactly ONNX's semantics
(symmetric pads no larger than half the kernel), that faster path is taken instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.common import ints
from onnxgen.runtime.ops.conv import torch_pad_arg
from onnxgen.runtime.ops.registry import implements

_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


@dataclass
class Geometry:
    """Window geometry along each spatial axis, resolved from the node's attributes."""

    kernel: list[int]
    strides: list[int]
    dilations: list[int]
    pads: list[int]  # ONNX [b_1..b_n, e_1..e_n]
    out: list[int]
    ceil_mode: bool

    @property
    def effective(self) -> list[int]:
        return [(k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations)]

    def extension(self, in_sizes: Sequence[int]) -> list[int]:
        """Elements past the right pad that ceil_mode's last window reaches (never counted)."""
        n = len(in_sizes)
        return [
            max(0, (o - 1) * s + e - (i + self.pads[a] + self.pads[a + n]))
            for a, (o, s, e, i) in enumerate(zip(self.out, self.strides, self.effective, in_sizes))
        ]

    def torch_compatible(self) -> bool:
        n = len(self.kernel)
        return (
            n in _MAX_POOL
            and self.pads[:n] == self.pads[n:]
            and all(2 * p <= k for p, k in zip(self.pads[:n], self.kernel))
        )


def geometry(ctx: NodeContext, in_sizes: Sequence[int]) -> Geometry:
    n = len(in_sizes)
    kernel_shape = list(ctx.require("kernel_shape"))
    strides = list(ctx.attr("strides", [1] * n))
    dilations = list(ctx.attr("dilations", [1] * n))
    ceil_mode = bool(ctx.attr("ceil_mode", 0))
    eff = [(k - 1) * d + 1 for k, d in zip(kernel_shape, dilations)]
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [-(-i // s) for i, s in zip(in_sizes, strides)]
        begins, ends = [], []
        for i, s, e, o in zip(in_sizes, strides, eff, out):
            total = max(0, (o - 1) * s + e - i)
            small, large = total // 2, total - total // 2
            begins.append(small if auto_pad == "SAME_UPPER" else large)
            ends.append(large if auto_pad == "SAME_UPPER" else small)
        return Geometry(kernel_shape, strides, dilations, begins + ends, out, False)
    pads = [0] * (2 * n) if auto_pad == "VALID" else list(ctx.attr("pads", [0] * (2 * n)))
    out = []
    for a in range(n):
        span = in_sizes[a] + pads[a] + pads[a + n] - eff[a]
        if ceil_mode:
            size = -(-span // strides[a]) + 1
            # the last window must start inside the input or the left pad
            if (size - 1) * strides[a] >= in_sizes[a] + pads[a]:
                size -= 1
        else:
            size = span // strides[a] + 1
        out.append(size)
    return Geometry(kernel_shape, strides, dilations, pads, out, ceil_mode)


def windows(t: torch.Tensor, geo: Geometry, pad_value: float, ext_value: float) -> torch.Tensor:
    """All windows of ``t`` [N, C, *spatial] as [N, C, *out, prod(kernel)]."""
    n = len(geo.kernel)
    ext = geo.extension(t.shape[2:])
    if any(geo.pads):
        t = F.pad(t, torch_pad_arg(geo.pads), value=pad_value)
    if any(ext):
        t = F.pad(t, torch_pad_arg([0] * n + ext), value=ext_value)
    for a in range(n):
        t = t.unfold(2 + a, geo.effective[a], geo.strides[a])
        if geo.dilations[a] > 1:
            t = t[..., :: geo.dilations[a]]
        t = t.narrow(2 + a, 0, geo.out[a])
    return t.flatten(-n)


def _lowest(dtype: torch.dtype) -> float:
    if dtype.is_floating_point:
        return float("-inf")
    return torch.iinfo(dtype).min


def _storage_index(ctx: NodeContext, x: torch.Tensor, storage_order: int) -> torch.Tensor:
    """Flat ONNX index of each element of ``x`` (row-major, or column-major over the spatial axes)."""
    spatial = list(x.shape[2:])
    plane = math.prod(spatial)
    if storage_order == 0:
        return torch.arange(x.numel(), device=x.device, dtype=torch.int64).reshape(x.shape)
    index = torch.zeros(spatial, dtype=torch.int64, device=x.device)
    step = 1
    for a, size in enumerate(spatial):
        shape = [1] * len(spatial)
        shape[a] = size
        index = index + torch.arange(size, device=x.device).reshape(shape) * step
        step *= size
    base = torch.arange(x.shape[0] * x.shape[1], device=x.device, dtype=torch.int64) * plane
    return base.reshape([x.shape[0], x.shape[1]] + [1] * len(spatial)) + index


@implements("MaxPool", since=1)
def max_pool(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    n = x.dim() - 2
    geo = geometry(ctx, x.shape[2:])
    want_indices = ctx.num_outputs > 1 and ctx.outputs_wanted[1]
    storage_order = ctx.attr("storage_order", 0)
    if geo.torch_compatible() and x.dtype.is_floating_point:
        result = _MAX_POOL[n](
            x,
            geo.kernel,
            geo.strides,
            geo.pads[:n],
            geo.dilations,
            ceil_mode=geo.ceil_mode,
            return_indices=want_indices,
        )
        if not want_indices:
            return result
        y, plane_index = result
        if storage_order == 0:
            plane = math.prod(x.shape[2:])
            base = torch.arange(x.shape[0] * x.shape[1], device=x.device, dtype=torch.int64) * plane
            return y, plane_index + base.reshape([x.shape[0], x.shape[1]] + [1] * n)
        flat = _storage_index(ctx, x, storage_order).flatten(2)
        return y, torch.gather(flat, 2, plane_index.flatten(2)).reshape(plane_index.shape)
    low = _lowest(x.dtype)
    win = windows(x, geo, low, low)
    y, arg = win.max(dim=-1)
    if not want_indices:
        return y
    index = windows(_storage_index(ctx, x, storage_order), geo, -1, -1)
    return y, torch.gather(index, -1, arg.unsqueeze(-1)).squeeze(-1)


def _count(x: torch.Tensor, geo: Geometry, include_pad: bool) -> torch.Tensor:
    """How many elements each window averages over, shaped [*out]."""
    ones = torch.ones([1, 1, *x.shape[2:]], dtype=x.dtype, device=x.device)
    return windows(ones, geo, 1.0 if include_pad else 0.0, 0.0).sum(-1)[0, 0]


@implements("AveragePool", since=1)
def average_pool(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    n = x.dim() - 2
    geo = geometry(ctx, x.shape[2:])
    include_pad = bool(ctx.attr("count_include_pad", 0))
    if geo.torch_compatible() and all(d == 1 for d in geo.dilations):
        return _AVG_POOL[n](
            x, geo.kernel, geo.strides, geo.pads[:n], ceil_mode=geo.ceil_mode, count_include_pad=include_pad
        )
    total = windows(x, geo, 0.0, 0.0).sum(-1)
    return total / _count(x, geo, include_pad)


def _widened(x: torch.Tensor) -> torch.Tensor:
    """16-bit inputs in float32: |x|^p overflows and loses precision in half."""
    return x.to(torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x


@implements("LpPool", since=1)
def lp_pool(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    geo = geometry(ctx, x.shape[2:])
    p = float(ctx.attr("p", 2))
    win = windows(_widened(x), geo, 0.0, 0.0)
    return win.abs().pow(p).sum(-1).pow(1.0 / p).to(x.dtype)


def _spatial_dims(x: torch.Tensor) -> list[int]:
    return list(range(2, x.dim()))


@implements("GlobalAveragePool", since=1)
def global_average_pool(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=_spatial_dims(x), keepdim=True)


@implements("GlobalMaxPool", since=1)
def global_max_pool(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    return x.amax(dim=_spatial_dims(x), keepdim=True)


@implements("GlobalLpPool", since=1)
def global_lp_pool(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    p = float(ctx.attr("p", 2))
    return _widened(x).abs().pow(p).sum(dim=_spatial_dims(x), keepdim=True).pow(1.0 / p).to(x.dtype)


@implements("MaxUnpool", since=9, host_inputs=(2,))
def max_unpool(
    ctx: NodeContext, x: torch.Tensor, indices: torch.Tensor, output_shape: torch.Tensor | None = None
) -> torch.Tensor:
    n = x.dim() - 2
    if output_shape is not None:
        shape = ints(output_shape)
    else:
        kernel_shape = list(ctx.require("kernel_shape"))
        strides = list(ctx.attr("strides", [1] * n))
        pads = list(ctx.attr("pads", [0] * (2 * n)))
        spatial = [
            (i - 1) * s + k - pads[a] - pads[a + n]
            for a, (i, s, k) in enumerate(zip(x.shape[2:], strides, kernel_shape))
        ]
        shape = [x.shape[0], x.shape[1], *spatial]
    out = torch.zeros(math.prod(shape), dtype=x.dtype, device=x.device)
    # indices are flat over the whole output tensor (batch and channel included)
    out.scatter_(0, indices.reshape(-1).to(torch.int64), x.reshape(-1))
    return out.reshape(shape)


@implements("MaxRoiPool", since=1, capture="loops over regions on the host")
def max_roi_pool(ctx: NodeContext, x: torch.Tensor, rois: torch.Tensor) -> torch.Tensor:
    pooled_h, pooled_w = list(ctx.require("pooled_shape"))
    spatial_scale = float(ctx.attr("spatial_scale", 1.0))
    height, width = x.shape[2], x.shape[3]
    outputs = []
    # corners scaled in float32 and rounded half away from zero (C roundf), as Caffe's RoI pooling does
    scaled = rois.detach().to("cpu", torch.float32)[:, 1:5] * torch.tensor(spatial_scale, dtype=torch.float32)
    corners = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)).to(torch.int64).tolist()
    for batch, (x1, y1, x2, y2) in zip(rois[:, 0].to(torch.int64).tolist(), corners):
        roi_h = max(y2 - y1 + 1, 1)
        roi_w = max(x2 - x1 + 1, 1)
        cells = torch.zeros(x.shape[1], pooled_h, pooled_w, dtype=x.dtype, device=x.device)
        for ph in range(pooled_h):
            hs = min(max(math.floor(ph * roi_h / pooled_h) + y1, 0), height)
            he = min(max(math.ceil((ph + 1) * roi_h / pooled_h) + y1, 0), height)
            for pw in range(pooled_w):
                ws = min(max(math.floor(pw * roi_w / pooled_w) + x1, 0), width)
                we = min(max(math.ceil((pw + 1) * roi_w / pooled_w) + x1, 0), width)
                if he > hs and we > ws:
                    cells[:, ph, pw] = x[batch, :, hs:he, ws:we].amax(dim=(1, 2))
        outputs.append(cells)
    if not outputs:
        return torch.zeros(0, x.shape[1], pooled_h, pooled_w, dtype=x.dtype, device=x.device)
    return torch.stack(outputs)
