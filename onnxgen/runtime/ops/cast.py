"""Cast, CastLike and BitCast: value conversion (with the float8 saturate rules), string
conversion through numpy object arrays, and bit reinterpretation."""

from __future__ import annotations

import math

import numpy as np
import onnx
import torch

from onnxgen.runtime.dtypes import TORCH_TO_ONNX, numpy_to_torch, onnx_type_name, torch_dtype, torch_to_numpy
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.elementwise import as_bits
from onnxgen.runtime.ops.registry import implements

Tensor = torch.Tensor
Value = Tensor | np.ndarray
STRING = onnx.TensorProto.STRING

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)


def _target_type(ctx: NodeContext) -> int:
    to = ctx.require("to")
    if isinstance(to, str):  # opset < 6 names the type ("FLOAT")
        try:
            return onnx.TensorProto.DataType.Value(to.upper())
        except ValueError:
            raise ctx.fail(f"unknown target type {to!r}") from None
    return int(to)


def _to_float8(x: Tensor, dtype: torch.dtype, saturate: bool) -> Tensor:
    if not x.is_floating_point():
        x = x.to(torch.float32)
    elif x.dtype in FLOAT8:
        x = x.to(torch.float32)
    limit = torch.finfo(dtype).max
    if saturate:  # +-inf and out-of-range values become +-max; NaN stays NaN
        return torch.clamp(x, -limit, limit).to(dtype)
    out = x.to(dtype)
    if dtype == torch.float8_e4m3fn:
        # torch saturates e4m3fn; ONNX wants NaN once the rounded value passes 448 (464 ties down)
        overflow = torch.isinf(x) | (x.abs() > 464.0)
        out = torch.where(overflow, torch.full_like(out, float("nan")), out)
    return out


# torch's int4/uint4/int2/uint2 carry one element per byte (low bits); torch has no kernels for them
SUB_BYTE = {torch.int4: (4, True), torch.uint4: (4, False), torch.int2: (2, True), torch.uint2: (2, False)}


def _decode_sub_byte(x: Tensor) -> Tensor:
    width, signed = SUB_BYTE[x.dtype]
    bits = (x.view(torch.uint8) & ((1 << width) - 1)).to(torch.int8)
    if signed:  # sign-extend the top bit of the field
        half = 1 << (width - 1)
        bits = (bits ^ half) - half
    return bits


def _encode_sub_byte(x: Tensor, dtype: torch.dtype) -> Tensor:
    width, _ = SUB_BYTE[dtype]
    # truncate toward zero, keep the low bits (wrap-around, as ml_dtypes does)
    whole = x.to(torch.int64) if x.dtype != torch.bool else x.to(torch.uint8)
    return (whole & ((1 << width) - 1)).to(torch.uint8).view(dtype)


def _to_e8m0(x: Tensor, saturate: bool, round_mode: str) -> Tensor:
    """float -> float8e8m0 (a bare power-of-two exponent), rounding as the Cast spec's round_mode says."""
    bits = x.to(torch.float32).view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    special = exponent == 0xFF  # NaN and Inf become the NaN code
    if round_mode == "up":
        step = (bits & 0x7FFFFF) != 0
    elif round_mode == "nearest":
        guard, rnd = (bits & 0x400000) != 0, (bits & 0x200000) != 0
        sticky = (bits & 0x1FFFFF) != 0
        step = guard & (rnd | sticky | (exponent > 0))
    elif round_mode == "down":
        step = torch.zeros_like(special)
    else:
        raise ValueError(f"round_mode must be up, down or nearest, got {round_mode!r}")
    if saturate:
        step = step & (exponent != 0xFE)
    exponent = torch.where(special, torch.full_like(exponent, 0xFF), exponent + step.to(exponent.dtype))
    if saturate:  # the spec's table: +-Inf saturates to E8M0_MAX (NaN stays NaN)
        exponent = torch.where(special & ((bits & 0x7FFFFF) == 0), torch.full_like(exponent, 0xFE), exponent)
    return exponent.to(torch.uint8).view(torch.float8_e8m0fnu)


def _from_e8m0(x: Tensor) -> Tensor:
    """float8e8m0 -> float32 from the bits (torch's own conversion yields a signalling NaN for 0xFF)."""
    exponent = x.view(torch.uint8).to(torch.int32)
    bits = torch.where(exponent == 0, torch.full_like(exponent, 0x400000), exponent << 23)  # 0 is 2**-127
    bits = torch.where(exponent == 0xFF, torch.full_like(exponent, 0x7FC00000), bits)
    return bits.view(torch.float32)


def convert(x: Tensor, dtype: torch.dtype, saturate: bool = True, round_mode: str = "up") -> Tensor:
    """Numeric Cast semantics onto a torch dtype."""
    if x.dtype == dtype:
        return x
    if x.dtype in SUB_BYTE:
        x = _decode_sub_byte(x)
        if x.dtype == dtype:
            return x
    if dtype in SUB_BYTE:
        return _encode_sub_byte(x, dtype)
    if dtype == torch.float8_e8m0fnu:
        return _to_e8m0(x, saturate, round_mode)
    if dtype in FLOAT8:
        return _to_float8(x, dtype, saturate)
    if x.dtype == torch.float8_e8m0fnu:
        x = _from_e8m0(x)
        if x.dtype == dtype:
            return x
    if x.dtype in FLOAT8 and dtype != torch.float32:
        x = x.to(torch.float32)  # float32 holds every float8 value exactly
    if dtype == torch.bool:
        return as_bits(x) != 0  # torch has no uint16/32/64 comparison kernels; the bits say the same
    return x.to(dtype)


def _format_number(value: object, is_float: bool) -> str:
    if is_float:
        number = float(value)
        if math.isnan(number):
            return "NaN"
        if math.isinf(number):
            return "INF" if number > 0 else "-INF"
        return f"{number:.8g}"
    if isinstance(value, (bool, np.bool_)):
        return "1" if value else "0"
    return str(int(value))


def _to_strings(x: Tensor) -> np.ndarray:
    is_float = x.is_floating_point()
    array = torch_to_numpy(x.float() if x.dtype in FLOAT8 or x.dtype == torch.bfloat16 else x)
    flat = [_format_number(v, is_float) for v in array.reshape(-1).tolist()]
    return np.array(flat, dtype=object).reshape(array.shape)


def _parse_float(text: str) -> float:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        return float.fromhex(text)  # strtod also reads hex floats


def _parse_int(text: str) -> int:
    try:
        return int(text.strip(), 0) if text.strip().lower().startswith(("0x", "-0x")) else int(text.strip())
    except ValueError:
        return int(_parse_float(text))  # "100.5" -> 100 (undefined in ONNX; stoll reads the prefix)


def _from_strings(x: np.ndarray, dtype: torch.dtype, device: torch.device, saturate: bool) -> Tensor:
    flat = [v.decode() if isinstance(v, bytes) else str(v) for v in x.reshape(-1).tolist()]
    if dtype.is_floating_point:
        parsed = torch.tensor([_parse_float(v) for v in flat], dtype=torch.float64).reshape(x.shape)
        return convert(parsed, dtype, saturate).to(device)
    if dtype == torch.bool:
        return torch.tensor([_parse_float(v) != 0 for v in flat], dtype=torch.bool).reshape(x.shape).to(device)
    ints = [_parse_int(v) for v in flat]
    if dtype == torch.uint64:  # values above int64 go through numpy's uint64
        return numpy_to_torch(np.array(ints, dtype=np.uint64).reshape(x.shape)).to(device)
    wide = torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in ints], dtype=torch.int64)
    return convert(wide.reshape(x.shape), dtype, saturate).to(device)


def cast_value(ctx: NodeContext, x: Value, elem_type: int) -> Value:
    saturate = bool(ctx.attr("saturate", 1))
    if elem_type == STRING:
        return x.copy() if isinstance(x, np.ndarray) else _to_strings(x)
    try:
        dtype = torch_dtype(elem_type)
    except TypeError:
        raise ctx.fail(f"casting to {onnx_type_name(elem_type)} is not supported") from None
    if isinstance(x, np.ndarray):
        return _from_strings(x, dtype, ctx.device, saturate)
    return convert(x, dtype, saturate, ctx.attr("round_mode", "up"))


@implements("Cast")
def cast(ctx: NodeContext, x: Value) -> Value:
    return cast_value(ctx, x, _target_type(ctx))


@implements("CastLike", since=15)
def cast_like(ctx: NodeContext, x: Value, like: Value) -> Value:
    if isinstance(like, np.ndarray):
        return cast_value(ctx, x, STRING)
    return cast_value(ctx, x, TORCH_TO_ONNX[like.dtype])


@implements("BitCast", since=26)
def bitcast(ctx: NodeContext, x: Tensor) -> Tensor:
    dtype = torch_dtype(_target_type(ctx))
    if x.element_size() != dtype.itemsize:
        raise ctx.fail(f"BitCast from {x.dtype} to {dtype} changes the element width")
    return x.view(dtype)
