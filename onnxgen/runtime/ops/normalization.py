"""Normalizations: Layer/RMS/Group/Instance/Batch normalization, LRN, LpNormalization, MVN.

16-bit inputs are normalized in float32 (``stash_type``) and rounded once at the end, as
onnxruntime's CPU kernels do; the LLM-critical LayerNormalization and RMSNormalization use
torch's fused kernels where they compute exactly that (one kernel on CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from onnxgen.runtime.dtypes import torch_dtype
from onnxgen.runtime.gpu.launch import KERNEL_DTYPES, triton_serves
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.common import normalize_axis
from onnxgen.runtime.ops.registry import implements


def _compute_dtype(ctx: NodeContext, x: torch.Tensor) -> torch.dtype:
    """The precision of the statistics: ``stash_type`` (float32 by default); doubles stay double."""
    stash = torch_dtype(ctx.attr("stash_type", 1))
    if x.dtype == torch.float64 and stash == torch.float32:
        return torch.float64
    return stash


def _as_param(t: torch.Tensor | None, shape: Sequence[int]) -> torch.Tensor | None:
    """``t`` broadcast to exactly ``shape`` (what torch's fused norms take), or None if impossible."""
    if t is None:
        return None
    while t.dim() > len(shape) and t.shape[0] == 1:
        t = t[0]
    if t.dim() > len(shape):
        return None
    try:
        return t.expand(list(shape))
    except RuntimeError:
        return None


def _unwanted(ctx: NodeContext, first: int) -> bool:
    """True when no output from index ``first`` on is wanted."""
    return not any(ctx.outputs_wanted[first:])


@implements("LayerNormalization", since=17)
def layer_normalization(
    ctx: NodeContext, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    axis = normalize_axis(ctx.attr("axis", -1), x.dim())
    eps = float(ctx.attr("epsilon", 1e-5))
    norm_shape = list(x.shape[axis:])
    compute = _compute_dtype(ctx, x)
    if _unwanted(ctx, 1) and x.dtype in KERNEL_DTYPES and compute == torch.float32:
        weight = _as_param(scale, norm_shape)
        b = _as_param(bias, norm_shape)
        if weight is not None and (bias is None or b is not None):
            # fused: statistics in float32 for 16-bit inputs, one rounding at the end
            return F.layer_norm(x, norm_shape, weight, b, eps)
    dims = list(range(axis, x.dim()))
    xf = x.to(compute)
    mean = xf.mean(dim=dims, keepdim=True)
    centered = xf - mean
    inv_std = torch.rsqrt((centered * centered).mean(dim=dims, keepdim=True) + eps)
    y = centered * inv_std * scale.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    y = y.to(x.dtype)
    if ctx.num_outputs == 1:
        return y
    return (y, mean, inv_std)[: ctx.num_outputs]


@implements("RMSNormalization", since=23)
def rms_normalization(ctx: NodeContext, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    axis = normalize_axis(ctx.attr("axis", -1), x.dim())
    eps = float(ctx.attr("epsilon", 1e-5))
    norm_shape = list(x.shape[axis:])
    compute = _compute_dtype(ctx, x)
    if x.dtype in KERNEL_DTYPES and compute == torch.float32 and scale.dtype == x.dtype:
        weight = _as_param(scale, norm_shape)
        if weight is not None:
            # torch's rms_norm upcasts 16-bit input to float32 and rounds once at the end
            return F.rms_norm(x, norm_shape, weight, eps)
    dims = list(range(axis, x.dim()))
    xf = x.to(compute)
    y = xf * torch.rsqrt((xf * xf).mean(dim=dims, keepdim=True) + eps) * scale.to(compute)
    return y.to(x.dtype)


def _group_stats(xf: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """``xf`` normalized per (instance, group of channels)."""
    shape = xf.shape
    grouped = xf.reshape(shape[0], groups, -1)
    mean = grouped.mean(dim=-1, keepdim=True)
    centered = grouped - mean
    inv_std = torch.rsqrt((centered * centered).mean(dim=-1, keepdim=True) + eps)
    return (centered * inv_std).reshape(shape)


def _channel_param(t: torch.Tensor, rank: int, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).reshape([1, -1] + [1] * (rank - 2))


@implements("GroupNormalization", since=18)
def group_normalization(ctx: NodeContext, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    groups = int(ctx.require("num_groups"))
    eps = float(ctx.attr("epsilon", 1e-5))
    channels = x.shape[1]
    if ctx.opset < 21:
        # opset 18: scale and bias are per group; spread them over each group's channels
        scale = scale.repeat_interleave(channels // groups)
        bias = bias.repeat_interleave(channels // groups)
    compute = (
        _compute_dtype(ctx, x) if ctx.opset >= 21 else (torch.float64 if x.dtype == torch.float64 else torch.float32)
    )
    normalized = _group_stats(x.to(compute), groups, eps)
    y = normalized * _channel_param(scale, x.dim(), compute) + _channel_param(bias, x.dim(), compute)
    return y.to(x.dtype)


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for 16-bit inputs (statistics need the range and precision), else the input's own."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


@implements("InstanceNormalization", since=1)
def instance_normalization(ctx: NodeContext, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    eps = float(ctx.attr("epsilon", 1e-5))
    compute = _work_dtype(x)
    normalized = _group_stats(x.to(compute), x.shape[1], eps)
    y = normalized * _channel_param(scale, x.dim(), compute) + _channel_param(bias, x.dim(), compute)
    return y.to(x.dtype)


@implements("BatchNormalization", since=1)
def batch_normalization(
    ctx: NodeContext,
    x: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    eps = float(ctx.attr("epsilon", 1e-5))
    momentum = float(ctx.attr("momentum", 0.9))
    compute = _work_dtype(x)
    rank = x.dim()
    xf = x.to(compute)
    training = bool(ctx.attr("training_mode", 0)) if ctx.opset >= 14 else ctx.num_outputs > 1
    if not training:
        inv = torch.rsqrt(_channel_param(var, rank, compute) + eps)
        y = (xf - _channel_param(mean, rank, compute)) * inv * _channel_param(scale, rank, compute)
        return (y + _channel_param(bias, rank, compute)).to(x.dtype)
    dims = [0] + list(range(2, rank))
    batch_mean = xf.mean(dim=dims)
    batch_var = xf.var(dim=dims, unbiased=False)
    inv = torch.rsqrt(_channel_param(batch_var, rank, compute) + eps)
    y = (xf - _channel_param(batch_mean, rank, compute)) * inv * _channel_param(scale, rank, compute)
    y = (y + _channel_param(bias, rank, compute)).to(x.dtype)
    running_mean = (mean.to(compute) * momentum + batch_mean * (1 - momentum)).to(mean.dtype)
    running_var = (var.to(compute) * momentum + batch_var * (1 - momentum)).to(var.dtype)
    if ctx.opset >= 14:
        return (y, running_mean, running_var)[: ctx.num_outputs]
    # before opset 14 the training outputs also carried the batch statistics
    outputs = (y, running_mean, running_var, batch_mean.to(mean.dtype), batch_var.to(var.dtype))
    return outputs[: ctx.num_outputs]


@implements("LRN", since=1)
def lrn(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    size = int(ctx.require("size"))
    alpha = float(ctx.attr("alpha", 1e-4))
    beta = float(ctx.attr("beta", 0.75))
    bias = float(ctx.attr("bias", 1.0))
    compute = _work_dtype(x)
    xf = x.to(compute)
    # sum of squares over the channel window [c - floor((size-1)/2), c + ceil((size-1)/2)]
    sq = (xf * xf).movedim(1, -1)
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    window_sum = F.pad(sq, (before, after)).unfold(-1, size, 1).sum(-1).movedim(-1, 1)
    return (xf / (bias + (alpha / size) * window_sum).pow(beta)).to(x.dtype)


@implements("LpNormalization", since=1)
def lp_normalization(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    axis = normalize_axis(ctx.attr("axis", -1), x.dim())
    p = int(ctx.attr("p", 2))
    if p not in (1, 2):
        raise ctx.fail(f"p must be 1 or 2, got {p}")
    if p == 2 and axis == x.dim() - 1 and triton_serves(x):
        # the per-head key / query norm of onnxruntime-genai's hybrid exports: one kernel
        from onnxgen.runtime.gpu.l2_norm import l2_norm_applies, l2_normalize

        if l2_norm_applies(x):
            return l2_normalize(x, 0.0, zero_safe=True)
    xf = x.to(_work_dtype(x))
    norm = torch.linalg.vector_norm(xf, ord=p, dim=axis, keepdim=True)
    # a zero norm gives 0, not NaN
    return torch.where(norm == 0, torch.zeros_like(xf), xf / norm).to(x.dtype)


@implements("MeanVarianceNormalization", since=1)
def mean_variance_normalization(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    axes = [normalize_axis(a, x.dim()) for a in ctx.attr("axes", [0, 2, 3])]
    compute = _work_dtype(x)
    xf = x.to(compute)
    mean = xf.mean(dim=axes, keepdim=True)
    # as the function body: sqrt(E[x^2] - E[x]^2) + 1e-9
    std = ((xf * xf).mean(dim=axes, keepdim=True) - mean * mean).sqrt()
    return ((xf - mean) / (std + 1e-9)).to(x.dtype)
