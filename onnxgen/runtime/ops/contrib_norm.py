"""RMSNorm and the fused residual + norm ops of decoder graphs (onnxruntime contrib ops).

SimplifiedLayerNormalization (RMSNorm; onnxruntime registers it in the default domain),
SkipSimplifiedLayerNormalization and SkipLayerNormalization (com.microsoft). Statistics are taken
in fp32 (stash_type 1, onnxruntime's default) and the residual sum is normalised unrounded, as
onnxruntime does; outputs keep the input dtype. mean / inv_std_var have the input's shape with the
normalised axes set to 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onnxgen.runtime.gpu.launch import triton_serves
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.common import normalize_axis
from onnxgen.runtime.ops.registry import DEFAULT_DOMAIN, MS_DOMAIN, implements

_STASH_DOUBLE = 11  # TensorProto.DOUBLE


def _stats_dtype(ctx: NodeContext) -> torch.dtype:
    return torch.float64 if int(ctx.attr("stash_type", 1)) == _STASH_DOUBLE else torch.float32


def _rms(x: torch.Tensor, dims: tuple[int, ...], eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over `dims`, kept as size-1 axes."""
    return torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + eps)


@implements("SimplifiedLayerNormalization", domain=DEFAULT_DOMAIN)
@implements("SimplifiedLayerNormalization", domain=MS_DOMAIN)
def simplified_layer_norm(
    ctx: NodeContext, x: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    axis = normalize_axis(int(ctx.attr("axis", -1)), x.dim())
    eps = float(ctx.attr("epsilon", 1e-5))
    stats = _stats_dtype(ctx)
    if axis == x.dim() - 1 and stats == torch.float32 and triton_serves(x):
        from onnxgen.runtime.gpu.rms_norm import fused_rms_norm, rms_norm_applies

        if rms_norm_applies(x, scale):
            y, _, inv = fused_rms_norm(x, scale, eps, out_dtype=scale.dtype, want_inv=ctx.num_outputs > 1)
            return (y, inv) if ctx.num_outputs > 1 else y
    xf = x.to(stats)
    inv = _rms(xf, tuple(range(axis, x.dim())), eps)
    # Y takes the scale's dtype (the op's type V), which may differ from X's
    y = (xf * inv * scale.to(stats)).to(scale.dtype)
    if ctx.num_outputs > 1:
        return y, inv
    return y


def _skip_sum(x: torch.Tensor, skip: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    total = x.float() + skip.float()
    return total + bias.float() if bias is not None else total


@implements("SkipSimplifiedLayerNormalization", domain=MS_DOMAIN)
def skip_simplified_layer_norm(
    ctx: NodeContext,
    x: torch.Tensor,
    skip: torch.Tensor,
    gamma: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Outputs: output, mean (zeros: RMSNorm has none), inv_std_var, input + skip (+ bias)."""
    eps = float(ctx.attr("epsilon", 1e-12))
    wanted = ctx.outputs_wanted
    if skip.shape == x.shape and triton_serves(x) and not (len(wanted) > 1 and wanted[1]):
        from onnxgen.runtime.gpu.rms_norm import fused_rms_norm, rms_norm_applies

        if rms_norm_applies(x, gamma, skip, bias):  # one kernel instead of about twelve
            want_inv = len(wanted) > 2 and wanted[2]
            want_sum = len(wanted) > 3 and wanted[3]
            y, total, inv = fused_rms_norm(x, gamma, eps, skip=skip, bias=bias, want_sum=want_sum, want_inv=want_inv)
            return _skip_outputs(ctx, y, None, inv, total)
    total = _skip_sum(x, skip, bias)
    if len(wanted) == 4 and not (wanted[1] or wanted[2]) and x.dtype == gamma.dtype == torch.float32:
        # the decoder case (output and sum only): torch's rms_norm does the same arithmetic
        # (x * rsqrt(mean(x^2) + eps) * gamma, bit-identical in our checks) in one call
        return _skip_outputs(ctx, F.rms_norm(total, (total.shape[-1],), gamma, eps), None, None, total)
    inv = _rms(total, (-1,), eps)
    y = (total * inv * gamma.float()).to(x.dtype)
    unwanted = len(wanted) > 1 and not wanted[1]  # decoders never read the mean
    mean = None if unwanted else torch.zeros_like(inv)
    return _skip_outputs(ctx, y, mean, inv, total.to(x.dtype))


@implements("SkipLayerNormalization", domain=MS_DOMAIN)
def skip_layer_norm(
    ctx: NodeContext,
    x: torch.Tensor,
    skip: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Outputs: output, mean, inv_std_var, input + skip (+ bias)."""
    eps = float(ctx.attr("epsilon", 1e-12))
    total = _skip_sum(x, skip, bias)
    mean = total.mean(dim=-1, keepdim=True)
    centered = total - mean
    inv = torch.rsqrt(centered.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = centered * inv * gamma.float()
    if beta is not None:
        y = y + beta.float()
    return _skip_outputs(ctx, y.to(x.dtype), mean, inv, total.to(x.dtype))


def _skip_outputs(ctx: NodeContext, *values: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    return values[: max(ctx.num_outputs, 1)]
