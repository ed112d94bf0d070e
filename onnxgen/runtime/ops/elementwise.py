"""Elementwise math of the default domain: arithmetic, unary math, variadic Max/Min/Sum/Mean, Clip,
Where, Identity, Dropout (inference), BitShift and the Bitwise ops.

ONNX keeps the input dtype for all of these. torch lacks most kernels for uint16/32/64, so those run
on a signed image: ops that only see bit patterns (add, mul, and, xor, ...) on the same-width signed
view (two's-complement wrap-around is the same), ops that see order (compare, divide, max) on an
order-preserving int64 image.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.registry import implements

Tensor = torch.Tensor

_SIGNED_TWIN = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)


# -- unsigned helpers (shared with logical.py) ----------------------------------------------------


def as_bits(t: Tensor) -> Tensor:
    """The same-width signed view of a wide unsigned tensor (bit-pattern ops give the same bits)."""
    twin = _SIGNED_TWIN.get(t.dtype)
    return t if twin is None else t.view(twin)


def from_bits(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.view(dtype)


def to_ordered(t: Tensor) -> Tensor:
    """An order-preserving signed image of a wide unsigned tensor (uint64: flip the top bit)."""
    if t.dtype in (torch.uint16, torch.uint32):
        return t.to(torch.int64)
    if t.dtype == torch.uint64:
        return t.view(torch.int64) ^ _INT64_MIN
    return t


def from_ordered(t: Tensor, dtype: torch.dtype) -> Tensor:
    if dtype in (torch.uint16, torch.uint32):
        return t.to(dtype)
    if dtype == torch.uint64:
        return (t ^ _INT64_MIN).view(torch.uint64)
    return t


def _lshr64(x: Tensor, s: Tensor) -> Tensor:
    """Logical right shift of int64 bit patterns by 0 <= s < 64."""
    shifted = ((x >> 1) & _INT64_MAX) >> (s - 1).clamp(min=0)
    return torch.where(s == 0, x, shifted)


def _udivmod64(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Exact unsigned 64-bit quotient and remainder on int64 bit patterns (torch has no uint64 div)."""
    a_ord, b_ord = a ^ _INT64_MIN, b ^ _INT64_MIN
    big_b = b < 0  # b >= 2**63: the quotient is 0 or 1
    safe_b = torch.where(big_b, torch.ones_like(b), b)
    # halve a so the signed division sees a non-negative dividend, then fix up by one
    q = torch.div(_lshr64(a, torch.ones_like(a)), safe_b, rounding_mode="trunc") << 1
    r = a - q * safe_b
    fix = (r ^ _INT64_MIN) >= (safe_b ^ _INT64_MIN)
    q = q + fix.to(torch.int64)
    q = torch.where(big_b, (a_ord >= b_ord).to(torch.int64), q)
    return q, a - q * b


# -- binary arithmetic ----------------------------------------------------------------------------


def legacy_broadcast(ctx: NodeContext, a: Tensor, b: Tensor) -> Tensor:
    """Opset < 7 binary ops: with broadcast=1 and an axis, B's dims line up with A's from that axis."""
    axis = ctx.attr("axis")
    if ctx.opset >= 7 or not ctx.attr("broadcast", 0) or axis is None:
        return b
    axis = axis + a.dim() if axis < 0 else axis
    return b.reshape(*b.shape, *([1] * (a.dim() - axis - b.dim())))


def _wrapping(op: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    def run(ctx: NodeContext, a: Tensor, b: Tensor) -> Tensor:
        b = legacy_broadcast(ctx, a, b)
        return from_bits(op(as_bits(a), as_bits(b)), a.dtype)

    return run


implements("Add", since=1)(_wrapping(torch.add))
implements("Sub", since=1)(_wrapping(torch.sub))
implements("Mul", since=1)(_wrapping(torch.mul))


def _int_div(a: Tensor, b: Tensor) -> Tensor:
    if a.dtype == torch.uint64:
        return _udivmod64(a.view(torch.int64), b.view(torch.int64))[0].view(torch.uint64)
    if a.dtype in (torch.uint16, torch.uint32):
        return torch.div(a.to(torch.int64), b.to(torch.int64), rounding_mode="trunc").to(a.dtype)
    return torch.div(a, b, rounding_mode="trunc")  # C semantics: truncate toward zero


@implements("Div")
def div(ctx: NodeContext, a: Tensor, b: Tensor) -> Tensor:
    b = legacy_broadcast(ctx, a, b)
    if a.is_floating_point() or a.is_complex():
        return torch.div(a, b)
    return _int_div(a, b)


@implements("Mod")
def mod(ctx: NodeContext, a: Tensor, b: Tensor) -> Tensor:
    truncated = bool(ctx.attr("fmod", 0))
    if a.dtype == torch.uint64:  # sign rules do not matter for unsigned values
        return _udivmod64(a.view(torch.int64), b.view(torch.int64))[1].view(torch.uint64)
    dtype = a.dtype
    if dtype in (torch.uint16, torch.uint32):
        a, b = a.to(torch.int64), b.to(torch.int64)
    # fmod=1: sign of the dividend (C fmod); fmod=0: sign of the divisor (Python %)
    out = torch.fmod(a, b) if truncated else torch.remainder(a, b)
    if not truncated and out.is_floating_point():
        # y = +-inf with finite x of the other sign gives y (torch gives nan); x = +-0 keeps y's sign
        out = torch.where(torch.isinf(b) & torch.isfinite(a) & (a != 0) & ((a < 0) != (b < 0)), b, out)
        out = torch.where((a == 0) & (b != 0), torch.copysign(torch.zeros_like(out), b), out)
    return out.to(dtype)


def _int_pow(base: Tensor, exponent: Tensor) -> Tensor:
    """Exact integer power; negative exponents follow C (1, +-1, or 0 after truncation)."""
    exponent = exponent.to(torch.int64)
    result = torch.pow(base.to(torch.int64), exponent.clamp(min=0))
    odd = (exponent % 2) != 0
    negative_power = torch.where(
        base == 1,
        torch.ones_like(result),
        torch.where((base == -1) & odd, -torch.ones_like(result), torch.where(base == -1, 1, 0)),
    )
    return torch.where(exponent < 0, negative_power, result)


@implements("Pow")
def pow_(ctx: NodeContext, base: Tensor, exponent: Tensor) -> Tensor:
    dtype = base.dtype  # the output keeps the base's type
    exponent = legacy_broadcast(ctx, base, exponent)
    if base.is_floating_point():
        # a 0-dim float exponent does not promote the base; anything else is cast to the base type
        if exponent.dtype != dtype and not (exponent.dim() == 0 and exponent.is_floating_point()):
            exponent = exponent.to(dtype)
        return torch.pow(base, exponent)
    if exponent.is_floating_point():  # integer base, float exponent: compute in double, truncate
        return torch.pow(base.to(torch.float64), exponent.to(torch.float64)).to(dtype)
    # the base is a signed type (ONNX allows int32/int64); a uint64 exponent above 2**63 is not meaningful
    exponent = exponent.view(torch.int64) if exponent.dtype == torch.uint64 else exponent
    return _int_pow(base, exponent).to(dtype)


# -- unary math ---------------------------------------------------------------------------------

_FLOAT_UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "Reciprocal": torch.reciprocal,
    "Sqrt": torch.sqrt,
    "Exp": torch.exp,
    "Log": torch.log,
    "Ceil": torch.ceil,
    "Floor": torch.floor,
    "Round": torch.round,  # half to even, as ONNX asks
    "Erf": torch.erf,
    "Sin": torch.sin,
    "Cos": torch.cos,
    "Tan": torch.tan,
    "Asin": torch.asin,
    "Acos": torch.acos,
    "Atan": torch.atan,
    "Sinh": torch.sinh,
    "Cosh": torch.cosh,
    "Asinh": torch.asinh,
    "Acosh": torch.acosh,
    "Atanh": torch.atanh,
}


def _unary(fn: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
    def run(ctx: NodeContext, x: Tensor) -> Tensor:
        return fn(x)

    return run


for _name, _fn in _FLOAT_UNARY.items():
    implements(_name)(_unary(_fn))


@implements("Abs")
def abs_(ctx: NodeContext, x: Tensor) -> Tensor:
    if x.dtype in (torch.uint8, *_SIGNED_TWIN):
        return x
    return torch.abs(x)


@implements("Neg")
def neg(ctx: NodeContext, x: Tensor) -> Tensor:
    return from_bits(torch.neg(as_bits(x)), x.dtype)


@implements("Sign")
def sign(ctx: NodeContext, x: Tensor) -> Tensor:
    if x.dtype in (torch.uint8, *_SIGNED_TWIN):
        return (x != 0).to(x.dtype)
    return torch.sign(x)


def _float_view(x: Tensor) -> Tensor:
    return x.float() if x.dtype in FLOAT8 else x


@implements("IsNaN")
def isnan(ctx: NodeContext, x: Tensor) -> Tensor:
    return torch.isnan(_float_view(x))


@implements("IsInf")
def isinf(ctx: NodeContext, x: Tensor) -> Tensor:
    x = _float_view(x)
    positive, negative = ctx.attr("detect_positive", 1), ctx.attr("detect_negative", 1)
    if positive and negative:
        return torch.isinf(x)
    if positive:
        return torch.isposinf(x)
    if negative:
        return torch.isneginf(x)
    return torch.zeros_like(x, dtype=torch.bool)


# -- variadic ---------------------------------------------------------------------------------


def _fold(op: Callable[[Tensor, Tensor], Tensor], inputs: tuple[Tensor, ...]) -> Tensor:
    result = inputs[0]
    for t in inputs[1:]:
        result = op(result, t)
    return result  # one input: shared, like Identity's output


def _ordered_fold(op: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    def run(ctx: NodeContext, *inputs: Tensor) -> Tensor:
        dtype = inputs[0].dtype
        return from_ordered(_fold(op, tuple(to_ordered(t) for t in inputs)), dtype)

    return run


implements("Max")(_ordered_fold(torch.maximum))
implements("Min")(_ordered_fold(torch.minimum))


@implements("Sum")
def sum_(ctx: NodeContext, *inputs: Tensor) -> Tensor:
    return from_bits(_fold(torch.add, tuple(as_bits(t) for t in inputs)), inputs[0].dtype)


@implements("Mean")
def mean(ctx: NodeContext, *inputs: Tensor) -> Tensor:
    return _fold(torch.add, inputs) / len(inputs)


# -- Clip, Where, Identity, Dropout ---------------------------------------------------------------


@implements("Clip", since=1)
def clip_attr(ctx: NodeContext, x: Tensor) -> Tensor:
    lo, hi = ctx.attr("min"), ctx.attr("max")
    if lo is None and hi is None:
        return x
    return torch.clamp(x, min=lo, max=hi)


@implements("Clip", since=11)
def clip(ctx: NodeContext, x: Tensor, lo: Tensor | None = None, hi: Tensor | None = None) -> Tensor:
    if lo is None and hi is None:
        return x
    dtype = x.dtype
    # clamp(min, max) = min(max(x, lo), hi): min > max gives max everywhere, as ONNX asks
    out = to_ordered(x)
    if lo is not None:
        out = torch.maximum(out, to_ordered(lo).to(out.dtype))
    if hi is not None:
        out = torch.minimum(out, to_ordered(hi).to(out.dtype))
    return from_ordered(out, dtype)


@implements("Where")
def where(ctx: NodeContext, cond: Tensor, x: Tensor | np.ndarray, y: Tensor | np.ndarray) -> Tensor | np.ndarray:
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):  # string tensors
        return np.where(cond.cpu().numpy(), np.asarray(x, dtype=object), np.asarray(y, dtype=object))
    return from_bits(torch.where(cond, as_bits(x), as_bits(y)), x.dtype)


@implements("Identity")
def identity(ctx: NodeContext, x: object) -> object:
    return x  # op implementations never write their inputs in place, so sharing is safe (and costs no copy)


def _dropout_outputs(ctx: NodeContext, x: Tensor, mask_dtype: torch.dtype) -> Tensor | tuple[Tensor, Tensor | None]:
    # identity (shared like Identity's output); the all-true mask only when a consumer names it
    if ctx.num_outputs < 2:
        return x
    wanted = not ctx.outputs_wanted or ctx.outputs_wanted[1]
    return x, torch.ones_like(x, dtype=mask_dtype) if wanted else None


@implements("Dropout", since=1)
def dropout_v1(ctx: NodeContext, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
    # An inference runtime: identity, whatever is_test says (the mask had the data's type before v10).
    return _dropout_outputs(ctx, x, torch.bool if ctx.opset >= 10 else x.dtype)


@implements("Dropout", since=12, host_inputs=(2,))
def dropout(
    ctx: NodeContext, x: Tensor, ratio: Tensor | None = None, training_mode: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    training = training_mode is not None and bool(training_mode.reshape(-1)[0])
    if not training:
        return _dropout_outputs(ctx, x, torch.bool)
    # Training mode (rare in inference graphs): the mask is drawn on the host with numpy's RandomState,
    # seeded by the `seed` attribute, as the ONNX reference does, so seeded runs are reproducible.
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ctx.fail("training-mode Dropout draws its mask on the host and cannot be recorded")
    drop = float(ratio.reshape(-1)[0]) if ratio is not None else 0.5
    if drop == 0.0:
        return _dropout_outputs(ctx, x, torch.bool)
    seed = ctx.attr("seed")
    rng = np.random.RandomState(seed) if seed is not None else np.random.RandomState()
    mask = torch.from_numpy(rng.uniform(0.0, 1.0, tuple(x.shape)) >= drop).to(x.device)
    out = (x * mask * (1.0 / (1.0 - drop))).to(x.dtype)
    return (out, mask) if ctx.num_outputs >= 2 else out


# -- bit manipulation -----------------------------------------------------------------------------

_BITS = {
    torch.int8: 8,
    torch.uint8: 8,
    torch.int16: 16,
    torch.uint16: 16,
    torch.int32: 32,
    torch.uint32: 32,
    torch.int64: 64,
    torch.uint64: 64,
}


@implements("BitShift")
def bitshift(ctx: NodeContext, x: Tensor, y: Tensor) -> Tensor:
    dtype = x.dtype
    width = _BITS[dtype]
    shift = y.to(torch.int64) if dtype != torch.uint64 else y.view(torch.int64)
    in_range = (shift >= 0) & (shift < width)
    shift = torch.where(in_range, shift, torch.zeros_like(shift))
    left = ctx.attr("direction", "LEFT").upper() == "LEFT"
    if dtype in (torch.uint16, torch.uint32):
        wide = x.to(torch.int64)  # non-negative, so >> is logical; .to wraps the left shift back
        out = (wide << shift) if left else (wide >> shift)
        out = torch.where(in_range, out, torch.zeros_like(out)).to(dtype)
        return out
    bits = as_bits(x)
    shift = shift.to(bits.dtype) if bits.dtype != torch.int64 else shift
    if left:
        out = bits << shift
        out = torch.where(in_range, out, torch.zeros_like(out))
    elif dtype == torch.uint64:
        out = _lshr64(bits, shift)
        out = torch.where(in_range, out, torch.zeros_like(out))
    else:
        out = bits >> shift  # arithmetic for signed types, logical for uint8
        fill = torch.where(bits < 0, -torch.ones_like(out), torch.zeros_like(out))
        out = torch.where(in_range, out, fill)
    return from_bits(out, dtype)


def _bitwise(op: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    def run(ctx: NodeContext, a: Tensor, b: Tensor) -> Tensor:
        return from_bits(op(as_bits(a), as_bits(b)), a.dtype)

    return run


implements("BitwiseAnd")(_bitwise(torch.bitwise_and))
implements("BitwiseOr")(_bitwise(torch.bitwise_or))
implements("BitwiseXor")(_bitwise(torch.bitwise_xor))


@implements("BitwiseNot")
def bitwise_not(ctx: NodeContext, x: Tensor) -> Tensor:
    return from_bits(torch.bitwise_not(as_bits(x)), x.dtype)
