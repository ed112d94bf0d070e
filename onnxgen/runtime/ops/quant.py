"""QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, QLinearMatMul.

Quantized integers: ``clamp(round_half_even(x / scale) + zero_point)``; the division is done in
fp32 before opset 23 and in the scale's type (or ``precision``) from 23, as onnxruntime does.
Dequantization multiplies in fp32 at every opset (onnxruntime does, also for fp16 scales). Float8 targets convert with
round-to-nearest-even, saturating to the format's largest finite value unless ``saturate=0``.
4-bit and 2-bit integers live in torch's int4/uint4/int2/uint2 shells (one element per byte, see
ops/cast.py); they are decoded to int8 for arithmetic and encoded after saturation.
float4e2m1 has no torch representation here and is not supported.
"""

from __future__ import annotations

import onnx
import torch

from onnxgen.runtime.dtypes import ONNX_TO_TORCH
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.cast import SUB_BYTE, convert
from onnxgen.runtime.ops.common import normalize_axis
from onnxgen.runtime.ops.linalg import int_matmul
from onnxgen.runtime.ops.registry import implements

TP = onnx.TensorProto
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _int_range(dtype: torch.dtype) -> tuple[int, int]:
    if dtype in SUB_BYTE:
        width, signed = SUB_BYTE[dtype]
        return (-(1 << (width - 1)), (1 << (width - 1)) - 1) if signed else (0, (1 << width) - 1)
    info = torch.iinfo(dtype)
    return info.min, info.max


def _numeric(t: torch.Tensor) -> torch.Tensor:
    """Sub-byte integers decoded to int8 (torch has no arithmetic on its int4/uint4 shells)."""
    return convert(t, torch.int8) if t.dtype in SUB_BYTE else t


def _target(ctx: NodeContext, zero_point: torch.Tensor | None) -> tuple[torch.dtype, float, float]:
    """Output dtype and its saturation range (the range is unused for float8)."""
    if zero_point is not None:
        dtype = zero_point.dtype
        if dtype in _FLOAT8:
            return dtype, 0.0, 0.0
        low, high = _int_range(dtype)
        return dtype, low, high
    code = int(ctx.attr("output_dtype", 0) or TP.UINT8)
    dtype = ONNX_TO_TORCH.get(code)
    if dtype is None:
        raise ctx.fail(f"output_dtype {onnx.helper.tensor_dtype_to_string(code)} is not supported")
    if dtype in _FLOAT8:
        return dtype, 0.0, 0.0
    low, high = _int_range(dtype)
    return dtype, low, high


def _broadcast_param(ctx: NodeContext, p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Shape a scale/zero point against x: per tensor, per axis (1-D), or blocked (same rank)."""
    p = _numeric(p)
    block = int(ctx.attr("block_size", 0) or 0)
    if x.dim() == 0 or (p.numel() == 1 and block == 0):
        return p.reshape(())  # per tensor
    axis = normalize_axis(ctx.attr("axis", 1), x.dim())
    if block > 0:
        if p.dim() != x.dim():
            raise ctx.fail(f"blocked quantization needs a scale of rank {x.dim()}, got shape {list(p.shape)}")
        return p.repeat_interleave(block, dim=axis).narrow(axis, 0, x.shape[axis])
    if p.dim() == 1:
        shape = [1] * x.dim()
        shape[axis] = p.shape[0]
        return p.reshape(shape)
    return p


def _quantize_float8(v: torch.Tensor, dtype: torch.dtype, saturate: bool) -> torch.Tensor:
    if not saturate:
        if dtype == torch.float8_e4m3fn:
            # torch's cast saturates e4m3fn; the spec wants NaN once the rounded value passes 448
            # (464 is the tie that rounds down). Keep the sign, as onnxruntime does (0xFF for -NaN).
            overflow = torch.isinf(v) | (v.abs() > 464.0)
            v = torch.where(overflow, torch.copysign(torch.full_like(v, float("nan")), v), v)
        return v.to(dtype)  # e5m2 overflows to inf, the fnuz types to their single NaN
    # +-inf and out-of-range values become +-max, NaN stays NaN. For the fnuz types the spec's
    # table says inf -> NaN, but onnxruntime and the onnx reference both saturate; we follow them.
    largest = torch.finfo(dtype).max
    return v.clamp(-largest, largest).to(dtype)


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    dtype: torch.dtype,
    low: float,
    high: float,
    saturate: bool = True,
    precision: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Quantize with already-broadcast scale and zero point; ``x / scale`` is computed in ``precision``."""
    v = (x.to(precision) / scale.to(precision)).to(torch.float32)
    if dtype in _FLOAT8:
        if zero_point is not None:
            v = v + zero_point.to(torch.float32)
        return _quantize_float8(v, dtype, saturate)
    v = torch.round(v)  # half to even
    if zero_point is not None:
        v = v + zero_point.to(torch.float32)
    v = v.clamp(low, high)
    return convert(v, dtype) if dtype in SUB_BYTE else v.to(dtype)


@implements("QuantizeLinear", since=10)
def quantize_linear(
    ctx: NodeContext, x: torch.Tensor, y_scale: torch.Tensor, y_zero_point: torch.Tensor | None = None
) -> torch.Tensor:
    dtype, low, high = _target(ctx, y_zero_point)
    scale = _broadcast_param(ctx, y_scale, x)
    zp = _broadcast_param(ctx, y_zero_point, x) if y_zero_point is not None else None
    saturate = bool(ctx.attr("saturate", 1))
    return quantize(x, scale, zp, dtype, low, high, saturate, _division_precision(ctx, y_scale))


def _division_precision(ctx: NodeContext, y_scale: torch.Tensor) -> torch.dtype:
    # From opset 23 the division runs in the `precision` attribute's type, else in y_scale's type
    # (an fp16 scale divides in fp16); onnxruntime does so too, and divides in fp32 before 23.
    if ctx.opset < 23:
        return torch.float32
    code = int(ctx.attr("precision", 0) or 0)
    dtype = ONNX_TO_TORCH.get(code) if code else y_scale.dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return torch.float32  # an int32 or float8e8m0 scale: exact in fp32
    return dtype


@implements("DequantizeLinear", since=10)
def dequantize_linear(
    ctx: NodeContext, x: torch.Tensor, x_scale: torch.Tensor, x_zero_point: torch.Tensor | None = None
) -> torch.Tensor:
    code = int(ctx.attr("output_dtype", 0) or 0)
    out_dtype = ONNX_TO_TORCH[code] if code else x_scale.dtype
    scale = _broadcast_param(ctx, x_scale, x)
    v = _numeric(x).to(torch.float32)
    if x_zero_point is not None:
        v = v - _broadcast_param(ctx, x_zero_point, x).to(torch.float32)
    return (v * scale.to(torch.float32)).to(out_dtype)


@implements("DynamicQuantizeLinear", since=11)
def dynamic_quantize_linear(ctx: NodeContext, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # range always includes 0 so that 0 is exactly representable (spec); all on the device
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    xf = x.to(torch.float32)
    if xf.numel() > 0:
        low, high = torch.aminmax(xf)
        low, high = torch.minimum(low, zero), torch.maximum(high, zero)
    else:
        low, high = zero, zero
    # a constant-zero input would give scale 0; onnxruntime uses 1 then (so do we)
    scale = torch.where(high > low, (high - low) / 255.0, torch.ones_like(zero))
    zero_point = torch.round((0.0 - low) / scale).clamp(0, 255)
    y = torch.round(xf / scale) + zero_point
    return y.clamp(0, 255).to(torch.uint8), scale, zero_point.to(torch.uint8)


def _per_row(p: torch.Tensor, rank: int) -> torch.Tensor:
    """A 1-D parameter of A or Y is per row: it varies along the second-to-last axis."""
    return p.unsqueeze(-1) if p.dim() == 1 and p.numel() > 1 and rank >= 2 else p


@implements("QLinearMatMul", since=10)
def qlinear_matmul(
    ctx: NodeContext,
    a: torch.Tensor,
    a_scale: torch.Tensor,
    a_zero_point: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_zero_point: torch.Tensor,
    y_scale: torch.Tensor,
    y_zero_point: torch.Tensor,
) -> torch.Tensor:
    a_wide = a.to(torch.int16) - _per_row(a_zero_point, a.dim()).to(torch.int16)
    b_wide = b.to(torch.int16) - b_zero_point.to(torch.int16)  # per column broadcasts as is
    acc = int_matmul(a_wide, b_wide, torch.int32).to(torch.float32)
    # requantize like onnxruntime: one fp32 multiplier (a_scale * b_scale / y_scale) per output
    multiplier = (
        _per_row(a_scale, a.dim()).to(torch.float32)
        * b_scale.to(torch.float32)
        / _per_row(y_scale, acc.dim()).to(torch.float32)
    )
    low, high = _int_range(y_zero_point.dtype)
    y = torch.round(acc * multiplier) + _per_row(y_zero_point, acc.dim()).to(torch.float32)
    return y.clamp(low, high).to(y_zero_point.dtype)
