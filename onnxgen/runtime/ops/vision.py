"""Vision ops: GridSample, AffineGrid, RoiAlign, NonMaxSuppression."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.common import ints, scalar
from onnxgen.runtime.ops.registry import implements

# opset 16 names and opset 20 names of the interpolation modes, as torch spells them
_GRID_MODES = {
    "bilinear": "bilinear",
    "linear": "bilinear",
    "nearest": "nearest",
    "bicubic": "bicubic",
    "cubic": "bicubic",
}


@implements("GridSample", since=16)
def grid_sample(ctx: NodeContext, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    # ONNX GridSample is defined after torch's grid_sample (same unnormalization and padding)
    mode = _GRID_MODES.get(ctx.attr("mode", "linear" if ctx.opset >= 20 else "bilinear"))
    if mode is None:
        raise ctx.fail(f"unknown mode {ctx.attr('mode')!r}")
    if x.dim() not in (4, 5) or (x.dim() == 5 and mode == "bicubic"):
        raise ctx.fail(f"{mode} sampling of a rank-{x.dim()} input is not supported")
    work = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)
    y = F.grid_sample(
        work,
        grid.to(work.dtype),
        mode=mode,
        padding_mode=ctx.attr("padding_mode", "zeros"),
        align_corners=bool(ctx.attr("align_corners", 0)),
    )
    return y.to(x.dtype)


@implements("AffineGrid", since=20, host_inputs=(1,))
def affine_grid(ctx: NodeContext, theta: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    shape = ints(size)
    work = theta if theta.dtype in (torch.float32, torch.float64) else theta.to(torch.float32)
    grid = F.affine_grid(work, shape, align_corners=bool(ctx.attr("align_corners", 0)))
    return grid.to(theta.dtype)


def _roi_samples(
    height: int,
    width: int,
    box: list[float],
    pooled: tuple[int, int],
    sampling_ratio: int,
    spatial_scale: float,
    half_pixel: bool,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Bilinear taps of one region: flat pixel indices [ph*pw, g, 4], weights alike, samples per bin."""
    out_h, out_w = pooled
    offset = 0.5 if half_pixel else 0.0
    x1, y1, x2, y2 = (v * spatial_scale - offset for v in box)
    roi_w, roi_h = x2 - x1, y2 - y1
    if not half_pixel:  # legacy: malformed regions become 1x1
        roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
    bin_h, bin_w = roi_h / out_h, roi_w / out_w
    grid_h = sampling_ratio if sampling_ratio > 0 else math.ceil(roi_h / out_h)
    grid_w = sampling_ratio if sampling_ratio > 0 else math.ceil(roi_w / out_w)
    # sample coordinates, [out_h, grid_h] and [out_w, grid_w]
    ys = y1 + np.arange(out_h)[:, None] * bin_h + (np.arange(grid_h)[None, :] + 0.5) * bin_h / grid_h
    xs = x1 + np.arange(out_w)[:, None] * bin_w + (np.arange(grid_w)[None, :] + 0.5) * bin_w / grid_w
    y = np.broadcast_to(ys[:, None, :, None], (out_h, out_w, grid_h, grid_w)).reshape(out_h * out_w, -1)
    x = np.broadcast_to(xs[None, :, None, :], (out_h, out_w, grid_h, grid_w)).reshape(out_h * out_w, -1)
    outside = (y < -1.0) | (y > height) | (x < -1.0) | (x > width)
    y = np.maximum(y, 0.0)
    x = np.maximum(x, 0.0)
    y_low = np.floor(y).astype(np.int64)
    x_low = np.floor(x).astype(np.int64)
    # at or past the last row/column the sample snaps to it
    y_edge = y_low >= height - 1
    x_edge = x_low >= width - 1
    y_low = np.where(y_edge, height - 1, y_low)
    x_low = np.where(x_edge, width - 1, x_low)
    y = np.where(y_edge, y_low, y)
    x = np.where(x_edge, x_low, x)
    y_high = np.where(y_edge, y_low, y_low + 1)
    x_high = np.where(x_edge, x_low, x_low + 1)
    ly, lx = y - y_low, x - x_low
    hy, hx = 1.0 - ly, 1.0 - lx
    index = np.stack(
        [y_low * width + x_low, y_low * width + x_high, y_high * width + x_low, y_high * width + x_high], axis=-1
    )
    weight = np.stack([hy * hx, hy * lx, ly * hx, ly * lx], axis=-1)
    weight = np.where(outside[..., None], 0.0, weight)
    index = np.where(outside[..., None], 0, index)
    return index, weight, max(grid_h * grid_w, 1)


@implements("RoiAlign", since=10, capture="region sampling grids depend on the region coordinates (host read)")
def roi_align(ctx: NodeContext, x: torch.Tensor, rois: torch.Tensor, batch_indices: torch.Tensor) -> torch.Tensor:
    out_h = int(ctx.attr("output_height", 1))
    out_w = int(ctx.attr("output_width", 1))
    sampling_ratio = int(ctx.attr("sampling_ratio", 0))
    spatial_scale = float(ctx.attr("spatial_scale", 1.0))
    default_mode = "half_pixel" if ctx.opset >= 16 else "output_half_pixel"
    half_pixel = ctx.attr("coordinate_transformation_mode", default_mode) == "half_pixel"
    mode = ctx.attr("mode", "avg")
    _, channels, height, width = x.shape
    boxes = rois.detach().to("cpu", torch.float64).tolist()
    batches = [int(b) for b in batch_indices.reshape(-1).tolist()]
    flat = x.reshape(x.shape[0], channels, height * width)
    work_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    outputs = []
    for box, b in zip(boxes, batches):
        index, weight, count = _roi_samples(
            height, width, box, (out_h, out_w), sampling_ratio, spatial_scale, half_pixel
        )
        idx = torch.from_numpy(index).to(x.device)
        w = torch.from_numpy(weight).to(x.device, work_dtype)
        taps = flat[b][:, idx.reshape(-1)].to(work_dtype).reshape(channels, *idx.shape) * w
        if mode == "avg":
            cell = taps.sum(dim=(-1, -2)) / count
        else:
            # onnxruntime's max mode: the largest weighted corner over all samples of a bin
            cell = taps.amax(dim=(-1, -2))
        outputs.append(cell.reshape(channels, out_h, out_w))
    if not outputs:
        return torch.zeros(0, channels, out_h, out_w, dtype=x.dtype, device=x.device)
    return torch.stack(outputs).to(x.dtype)


def _corners(boxes: torch.Tensor, center_point_box: int) -> torch.Tensor:
    """[..., 4] boxes as (y_min, x_min, y_max, x_max), whatever the corner order."""
    if center_point_box:
        xc, yc, w, h = boxes.unbind(-1)
        return torch.stack([yc - h / 2, xc - w / 2, yc + h / 2, xc + w / 2], dim=-1)
    y1, x1, y2, x2 = boxes.unbind(-1)
    return torch.stack(
        [torch.minimum(y1, y2), torch.minimum(x1, x2), torch.maximum(y1, y2), torch.maximum(x1, x2)], dim=-1
    )


def _suppression_matrix(corners: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """[N, N] bool: box i suppresses box j (IoU strictly above the threshold)."""
    y0, x0, y1, x1 = corners.unbind(-1)
    iy = torch.minimum(y1[:, None], y1[None, :]) - torch.maximum(y0[:, None], y0[None, :])
    ix = torch.minimum(x1[:, None], x1[None, :]) - torch.maximum(x0[:, None], x0[None, :])
    inter = iy.clamp(min=0) * ix.clamp(min=0)
    area = (y1 - y0) * (x1 - x0)
    union = area[:, None] + area[None, :] - inter
    valid = (iy > 0) & (ix > 0) & (area[:, None] > 0) & (area[None, :] > 0) & (union > 0)
    iou = inter / torch.where(union > 0, union, torch.ones_like(union))
    return valid & (iou > iou_threshold)


@implements("NonMaxSuppression", since=10, host_inputs=(2, 3, 4), capture="data-dependent output shape")
def non_max_suppression(
    ctx: NodeContext,
    boxes: torch.Tensor,
    scores: torch.Tensor,
    max_output: torch.Tensor | None = None,
    iou_threshold: torch.Tensor | None = None,
    score_threshold: torch.Tensor | None = None,
) -> torch.Tensor:
    limit = max(int(scalar(max_output)), 0) if max_output is not None and max_output.numel() else 0
    iou_limit = float(scalar(iou_threshold)) if iou_threshold is not None and iou_threshold.numel() else 0.0
    has_score_limit = score_threshold is not None and score_threshold.numel() > 0
    score_limit = float(scalar(score_threshold)) if has_score_limit else 0.0
    # greedy selection is inherently sequential: run it on the host
    corners = _corners(boxes.detach().to("cpu", torch.float64), ctx.attr("center_point_box", 0))
    host_scores = scores.detach().to("cpu", torch.float64)
    selected: list[tuple[int, int, int]] = []
    for b in range(boxes.shape[0]):
        suppress = _suppression_matrix(corners[b], iou_limit).tolist() if limit else []
        for c in range(scores.shape[1]):
            class_scores = host_scores[b, c].tolist()
            candidates = [i for i, s in enumerate(class_scores) if not has_score_limit or s > score_limit]
            # highest score first; equal scores: lower box index first
            candidates.sort(key=lambda i: (-class_scores[i], i))
            kept: list[int] = []
            for i in candidates:
                if len(kept) >= limit:
                    break
                if not any(suppress[i][k] for k in kept):
                    kept.append(i)
                    selected.append((b, c, i))
    result = torch.tensor(selected, dtype=torch.int64).reshape(-1, 3)
    return result.to(ctx.device)
