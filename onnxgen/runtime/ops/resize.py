"""Resize (opset 10-19+) and Upsample: every mode, coordinate transform, antialias and axes.

Resize is separable: each resized axis is one gather of ``taps`` neighbours plus a weighted sum.
The tap indices and weights depend only on shapes and attributes; they are computed with torch
ops on the node's device (float64, like the reference), so the implementation never copies host data
to the device and can be recorded into a CUDA graph.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.common import normalize_axis
from onnxgen.runtime.ops.registry import implements


@dataclass
class AxisPlan:
    """Resize of one axis: output length, scale and (for tf_crop_and_resize) the roi span."""

    axis: int
    in_len: int
    out_len: int
    scale: float
    roi: tuple[float, float] = (0.0, 1.0)


@dataclass
class Options:
    mode: str = "nearest"
    coordinate_mode: str = "half_pixel"
    nearest_mode: str = "round_prefer_floor"
    cubic_a: float = -0.75
    exclude_outside: bool = False
    extrapolation_value: float = 0.0
    antialias: bool = False


def _floats(t: torch.Tensor | None) -> list[float]:
    if t is None:
        return []
    return [float(v) for v in t.reshape(-1).tolist()]


def _div(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """``t / divisor`` rounded exactly: CUDA turns division by a Python scalar into multiplication
    by its reciprocal, which moves coordinates that sit exactly on a rounding boundary."""
    return t / torch.full_like(t, divisor)


def _source_coords(plan: AxisPlan, opts: Options, device: torch.device) -> torch.Tensor:
    """Where each output index samples the input (float64), per the coordinate transform."""
    y = torch.arange(plan.out_len, dtype=torch.float64, device=device)
    scale, length_in = plan.scale, plan.in_len
    length_out = scale * length_in  # the reference uses the unrounded output length
    mode = opts.coordinate_mode
    if mode == "half_pixel":
        return _div(y + 0.5, scale) - 0.5
    if mode == "asymmetric":
        return _div(y, scale)
    if mode == "align_corners":
        if length_out == 1:
            return torch.zeros_like(y)
        return _div(y * (length_in - 1), length_out - 1)
    if mode == "pytorch_half_pixel":
        if length_out == 1:
            return torch.zeros_like(y)
        return _div(y + 0.5, scale) - 0.5
    if mode == "tf_half_pixel_for_nn":
        return _div(y + 0.5, scale)
    if mode == "half_pixel_symmetric":
        # maps the centre of the input to the centre of the output
        offset = (length_in / 2) * (1 - plan.out_len / length_out)
        return offset + _div(y + 0.5, scale) - 0.5
    if mode == "tf_crop_and_resize":
        start, end = plan.roi
        if length_out == 1:
            return torch.full_like(y, (end - start) * (length_in - 1) / 2 + start * (length_in - 1))
        return _div(y * (end - start) * (length_in - 1), length_out - 1) + start * (length_in - 1)
    raise ValueError(f"unknown coordinate_transformation_mode {mode!r}")


def _nearest_index(x: torch.Tensor, plan: AxisPlan, opts: Options) -> torch.Tensor:
    floor = torch.floor(x)
    frac = x - floor
    mode = opts.nearest_mode
    if mode == "round_prefer_floor":
        index = torch.where(frac <= 0.5, floor, floor + 1)
    elif mode == "round_prefer_ceil":
        index = torch.where(frac < 0.5, floor, floor + 1)
    elif mode == "floor":
        index = floor
    elif mode == "ceil":
        index = torch.ceil(x)
    elif mode == "simple":
        # Resize-10 / Upsample: ceil when downsampling, truncate otherwise (onnxruntime's rule)
        index = torch.ceil(x) if plan.scale < 1 else torch.trunc(x)
    else:
        raise ValueError(f"unknown nearest_mode {mode!r}")
    return index


def _filter(d: torch.Tensor, opts: Options) -> torch.Tensor:
    """The interpolation kernel at distance ``d`` (in filter units)."""
    d = d.abs()
    if opts.mode == "linear":
        return (1 - d).clamp(min=0)
    a = opts.cubic_a
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return torch.where(d <= 1, near, torch.where(d < 2, far, torch.zeros_like(d)))


def axis_taps(plan: AxisPlan, opts: Options, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Indices [out, taps] into the axis and their weights [out, taps] (None: nearest, one tap)."""
    x = _source_coords(plan, opts, device)
    last = plan.in_len - 1
    if opts.mode == "nearest":
        return _nearest_index(x, plan, opts).clamp(0, last).to(torch.int64).unsqueeze(1), None
    # the filter is stretched by 1/scale when antialiasing a downsample
    fscale = min(plan.scale, 1.0) if opts.antialias else 1.0
    reach = 1.0 if opts.mode == "linear" else 2.0
    start = math.floor(-reach / fscale) + 1
    offsets = torch.arange(start, 2 - start, dtype=torch.float64, device=device)
    base = torch.floor(x)
    ratio = x - base
    # the reference takes the left neighbour at exact integers: base x-1 with ratio 1
    exact = ratio == 0
    base = torch.where(exact, base - 1, base)
    ratio = torch.where(exact, torch.ones_like(ratio), ratio)
    weights = _filter((offsets.unsqueeze(0) - ratio.unsqueeze(1)) * fscale, opts)
    if opts.antialias:
        weights = weights / weights.sum(dim=1, keepdim=True)
    index = base.unsqueeze(1) + offsets.unsqueeze(0)
    if opts.exclude_outside:
        weights = torch.where((index < 0) | (index > last), torch.zeros_like(weights), weights)
        total = weights.sum(dim=1, keepdim=True)
        weights = weights / torch.where(total == 0, torch.ones_like(total), total)
    return index.clamp(0, last).to(torch.int64), weights


def _apply_axis(t: torch.Tensor, plan: AxisPlan, opts: Options) -> torch.Tensor:
    index, weights = axis_taps(plan, opts, t.device)
    out_len, taps = index.shape
    picked = t.index_select(plan.axis, index.reshape(-1))
    if weights is None:
        result = picked
    else:
        shape = list(t.shape)
        shape[plan.axis : plan.axis + 1] = [out_len, taps]
        picked = picked.reshape(shape)
        w_shape = [out_len, taps] + [1] * (t.dim() - plan.axis - 1)
        result = (picked * weights.to(t.dtype).reshape(w_shape)).sum(dim=plan.axis + 1)
    if opts.coordinate_mode == "tf_crop_and_resize":
        x = _source_coords(plan, opts, t.device)
        outside = ((x < 0) | (x > plan.in_len - 1)).reshape([out_len] + [1] * (t.dim() - plan.axis - 1))
        result = torch.where(outside, torch.full_like(result, opts.extrapolation_value), result)
    return result


def _is_identity(plan: AxisPlan, opts: Options) -> bool:
    return (
        plan.out_len == plan.in_len
        and math.isclose(plan.scale, 1.0)
        and (opts.coordinate_mode != "tf_crop_and_resize" or plan.roi == (0.0, 1.0))
    )


def resize(x: torch.Tensor, plans: Sequence[AxisPlan], opts: Options) -> torch.Tensor:
    plans = [p for p in plans if not _is_identity(p, opts)]
    if not plans:
        return x
    if opts.mode == "nearest":
        work = x  # a pure gather: exact in any dtype
    elif x.dtype == torch.float64:
        work = x
    else:
        work = x.to(torch.float32)
    for plan in plans:
        work = _apply_axis(work, plan, opts)
    if work.dtype == x.dtype:
        return work
    if not x.dtype.is_floating_point:
        info = torch.iinfo(x.dtype)
        work = torch.round(work).clamp(info.min, info.max)
    return work.to(x.dtype)


def _plans(
    ctx: NodeContext,
    x: torch.Tensor,
    roi: list[float],
    scales: list[float],
    sizes: list[int],
) -> list[AxisPlan]:
    rank = x.dim()
    axes = [normalize_axis(a, rank) for a in ctx.attr("axes", list(range(rank)))]
    shape = list(x.shape)
    full_roi = [(0.0, 1.0)] * rank
    if len(roi) == 2 * len(axes):
        for i, a in enumerate(axes):
            full_roi[a] = (roi[i], roi[len(axes) + i])
    if sizes:
        if len(sizes) != len(axes):
            raise ctx.fail(f"sizes has {len(sizes)} values for {len(axes)} axes")
        axis_scales = [sizes[i] / shape[a] for i, a in enumerate(axes)]
        out = list(sizes)
        policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            if policy == "not_larger":
                common = min(axis_scales)
            elif policy == "not_smaller":
                common = max(axis_scales)
            else:
                raise ctx.fail(f"unknown keep_aspect_ratio_policy {policy!r}")
            axis_scales = [common] * len(axes)
            out = [int(common * shape[a] + 0.5) for a in axes]  # round half up
    elif scales:
        if len(scales) != len(axes):
            raise ctx.fail(f"scales has {len(scales)} values for {len(axes)} axes")
        axis_scales = list(scales)
        out = [int(s * shape[a]) for s, a in zip(scales, axes)]  # floor of a positive product
    else:
        raise ctx.fail("one of scales and sizes must be given")
    return [AxisPlan(a, shape[a], o, s, full_roi[a]) for a, o, s in zip(axes, out, axis_scales)]


def _options(ctx: NodeContext) -> Options:
    return Options(
        mode=ctx.attr("mode", "nearest"),
        coordinate_mode=ctx.attr("coordinate_transformation_mode", "half_pixel"),
        nearest_mode=ctx.attr("nearest_mode", "round_prefer_floor"),
        cubic_a=float(ctx.attr("cubic_coeff_a", -0.75)),
        exclude_outside=bool(ctx.attr("exclude_outside", 0)),
        extrapolation_value=float(ctx.attr("extrapolation_value", 0.0)),
        antialias=bool(ctx.attr("antialias", 0)),
    )


def _legacy_options(ctx: NodeContext) -> Options:
    """Resize-10 and Upsample: asymmetric coordinates, onnxruntime's simple nearest rounding."""
    mode = ctx.attr("mode", "nearest")
    return Options(
        mode="linear" if mode in ("linear", "bilinear") else mode,
        coordinate_mode="asymmetric",
        nearest_mode="simple",
    )


@implements("Resize", since=11, host_inputs=(1, 2, 3))
def resize_11(
    ctx: NodeContext,
    x: torch.Tensor,
    roi: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    sizes: torch.Tensor | None = None,
) -> torch.Tensor:
    size_list = [int(v) for v in sizes.reshape(-1).tolist()] if sizes is not None else []
    plans = _plans(ctx, x, _floats(roi), _floats(scales), size_list)
    return resize(x, plans, _options(ctx))


def _legacy(ctx: NodeContext, x: torch.Tensor, scales: list[float]) -> torch.Tensor:
    if len(scales) != x.dim():
        raise ctx.fail(f"scales has {len(scales)} values for rank {x.dim()}")
    plans = [AxisPlan(a, x.shape[a], int(s * x.shape[a]), s) for a, s in enumerate(scales)]
    return resize(x, plans, _legacy_options(ctx))


@implements("Resize", since=10, host_inputs=(1,))
def resize_10(ctx: NodeContext, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return _legacy(ctx, x, _floats(scales))


@implements("Upsample", since=7)
def upsample_7(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    return _legacy(ctx, x, [float(s) for s in ctx.require("scales")])


@implements("Upsample", since=9, host_inputs=(1,))
def upsample_9(ctx: NodeContext, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return _legacy(ctx, x, _floats(scales))
