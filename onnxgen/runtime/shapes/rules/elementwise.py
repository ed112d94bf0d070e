"""Elementwise ops: same-shape unary ops, broadcasting n-ary ops (the unification chokepoint),
and the value arithmetic of small int tensors (Shape → Gather → Add → Concat chains)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx

from onnxgen.runtime.shapes.context import RuleContext, value_shape
from onnxgen.runtime.shapes.dimexpr import DimExpr
from onnxgen.runtime.shapes.rules import rule
from onnxgen.runtime.shapes.tensor import INT_TYPES, TensorInfo

BOOL = onnx.TensorProto.BOOL

UNARY = (
    "Abs Acos Acosh Asin Asinh Atan Atanh Ceil Celu Cos Cosh Elu Erf Exp Floor Gelu HardSigmoid HardSwish "
    "LeakyRelu Log Mish Neg Reciprocal Relu Round Selu Sigmoid Sign Sin Sinh Softplus Softsign Sqrt Tan Tanh "
    "ThresholdedRelu Shrink Swish BitwiseNot Softmax LogSoftmax Hardmax LpNormalization MeanVarianceNormalization "
    "LRN Trilu ReverseSequence RandomUniformLike RandomNormalLike Bernoulli EyeLike"
).split()
UNARY_BOOL = ("IsInf", "IsNaN", "Not")
MS = "com.microsoft"


def _sources(*values: DimExpr | None) -> set[str]:
    out: set[str] = set()
    for v in values:
        if v is not None:
            out |= v.symbols()
    return out


def _symbolic(ctx: RuleContext, *operands: DimExpr | None) -> DimExpr | None:
    """A result the polynomials cannot express: an opaque symbol that is a function of the operands."""
    if any(o is None for o in operands):
        return None
    return DimExpr.var(ctx.table.opaque(ctx.name, _sources(*operands)))


def _floordiv(ctx: RuleContext, a: DimExpr | None, b: DimExpr | None) -> DimExpr | None:
    if a is None or b is None:
        return None
    ca, cb = a.const_value(), b.const_value()
    if ca is not None and cb is not None:
        return DimExpr.const(ca // cb) if cb else None
    q = a.exact_div(b)
    return q if q is not None else _symbolic(ctx, a, b)


def _compare(ctx: RuleContext, op: str, a: DimExpr | None, b: DimExpr | None) -> DimExpr | None:
    if a is None or b is None:
        return None
    diff = (a - b).const_value()
    if diff is None:
        return _symbolic(ctx, a, b)
    result = {
        "Equal": diff == 0,
        "Less": diff < 0,
        "Greater": diff > 0,
        "LessOrEqual": diff <= 0,
        "GreaterOrEqual": diff >= 0,
    }[op]
    return DimExpr.const(int(result))


def _minmax(ctx: RuleContext, op: str, a: DimExpr | None, b: DimExpr | None) -> DimExpr | None:
    if a is None or b is None:
        return None
    diff = (a - b).const_value()
    if diff is None:
        return _symbolic(ctx, a, b)
    return (a if diff <= 0 else b) if op == "Min" else (a if diff >= 0 else b)


def _binary_value(ctx: RuleContext, op: str) -> Callable[[DimExpr | None, DimExpr | None], DimExpr | None] | None:
    def arith(f: Callable[[DimExpr, DimExpr], DimExpr]) -> Callable[[DimExpr | None, DimExpr | None], DimExpr | None]:
        return lambda a, b: None if a is None or b is None else f(a, b)

    if op == "Add":
        return arith(lambda a, b: a + b)
    if op == "Sub":
        return arith(lambda a, b: a - b)
    if op == "Mul":
        return arith(lambda a, b: a * b)
    if op == "Div":
        return lambda a, b: _floordiv(ctx, a, b)
    if op in ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"):
        return lambda a, b: _compare(ctx, op, a, b)
    if op in ("Min", "Max"):
        return lambda a, b: _minmax(ctx, op, a, b)
    if op in ("Mod", "And", "Or", "Xor", "Pow"):
        return lambda a, b: _const_or_symbolic(ctx, op, a, b)
    return None


def _const_or_symbolic(ctx: RuleContext, op: str, a: DimExpr | None, b: DimExpr | None) -> DimExpr | None:
    if a is None or b is None:
        return None
    ca, cb = a.const_value(), b.const_value()
    if ca is not None and cb is not None:
        if op == "Mod":
            return DimExpr.const(ca % cb) if cb else None
        if op == "Pow":
            return DimExpr.const(ca**cb) if cb >= 0 else None
        return DimExpr.const(int({"And": bool(ca and cb), "Or": bool(ca or cb), "Xor": bool(ca) != bool(cb)}[op]))
    return _symbolic(ctx, a, b)


def _values_broadcast(
    ctx: RuleContext, f: Callable[..., DimExpr | None], shape: tuple, indices: list[int]
) -> np.ndarray | None:
    target = value_shape(shape)
    if target is None:
        return None
    arrays = []
    for i in indices:
        v = ctx.value(i)
        if v is None:
            return None
        arrays.append(v)
    result = np.frompyfunc(f, len(arrays), 1)(*arrays)
    out = np.empty(target, dtype=object)
    out[...] = np.broadcast_to(np.asarray(result, dtype=object), target)
    return out


@rule(*UNARY)
def unary(ctx: RuleContext) -> list[TensorInfo | None]:
    t = ctx.input(0)
    value = None
    if ctx.op_type in ("Neg", "Abs") and t is not None and t.value is not None:
        if ctx.op_type == "Neg":
            value = np.frompyfunc(lambda a: None if a is None else -a, 1, 1)(t.value)
        else:
            value = np.frompyfunc(
                lambda a: None if a is None else (a if (a.const_value() or 0) >= 0 or not a.is_const() else -a), 1, 1
            )(t.value)
        value = np.asarray(value, dtype=object).reshape(t.value.shape)
    return [ctx.out(ctx.shape(0), ctx.dtype(0), value)]


@rule(*UNARY_BOOL)
def unary_bool(ctx: RuleContext) -> list[TensorInfo | None]:
    value = None
    if ctx.op_type == "Not" and ctx.value(0) is not None:
        v = ctx.value(0)
        value = np.asarray(np.frompyfunc(lambda a: None if a is None else _not(ctx, a), 1, 1)(v), dtype=object).reshape(
            v.shape
        )
    return [ctx.out(ctx.shape(0), BOOL, value)]


def _not(ctx: RuleContext, a: DimExpr) -> DimExpr | None:
    c = a.const_value()
    return DimExpr.const(int(not c)) if c is not None else _symbolic(ctx, a)


@rule("Identity")
def identity(ctx: RuleContext) -> list[TensorInfo | None]:
    t = ctx.input(0)
    if t is not None and t.kind != "tensor":
        return [TensorInfo(None, 0, kind=t.kind)]
    return [ctx.out(ctx.shape(0), ctx.dtype(0), ctx.value(0))]


@rule("Cast", "CastLike")
def cast(ctx: RuleContext) -> list[TensorInfo | None]:
    to = int(ctx.attr("to", 0)) if ctx.op_type == "Cast" else ctx.dtype(1)
    keep = to in INT_TYPES and ctx.dtype(0) in INT_TYPES
    return [ctx.out(ctx.shape(0), to, ctx.value(0) if keep else None)]


@rule("Clip", "Dropout", "CumSum", "CumProd")
@rule("QuickGelu", "FastGelu", "BiasGelu", "GatedRMSNorm", "GatedAdd", domain=MS)
def first_input_shape(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = ctx.shape(0)
    outs: list[TensorInfo | None] = [ctx.out(shape, ctx.dtype(0))]
    if ctx.op_type == "Dropout":
        outs.append(ctx.out(shape, BOOL))
    return outs


BINARY_SAME_TYPE = "Add Sub Mul Div Pow Mod PRelu BitShift BitwiseAnd BitwiseOr BitwiseXor".split()
BINARY_BOOL = "And Or Xor Equal Less Greater LessOrEqual GreaterOrEqual".split()


@rule(*BINARY_SAME_TYPE, *BINARY_BOOL, "Max", "Min", "Mean", "Sum")
def broadcast_op(ctx: RuleContext) -> list[TensorInfo | None]:
    indices = [i for i in range(len(ctx.inputs)) if ctx.has(i)]
    shape = ctx.broadcast([ctx.shape(i) for i in indices])
    dtype = BOOL if ctx.op_type in BINARY_BOOL else ctx.dtype(0)
    value = None
    f = _binary_value(ctx, ctx.op_type)
    if f is not None and dtype in INT_TYPES and len(indices) == 2:
        value = _values_broadcast(ctx, f, shape, indices)
    elif ctx.op_type in ("Max", "Min", "Sum") and dtype in INT_TYPES and len(indices) == 1:
        value = ctx.value(0)
    return [ctx.out(shape, dtype, value)]


@rule("Where")
def where(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = ctx.broadcast([ctx.shape(0), ctx.shape(1), ctx.shape(2)])
    dtype = ctx.dtype(1)
    value = None
    if dtype in INT_TYPES:

        def pick(c: DimExpr | None, a: DimExpr | None, b: DimExpr | None) -> DimExpr | None:
            if c is None or a is None or b is None:
                return None
            cv = c.const_value()
            if cv is None:
                return a if a == b else _symbolic(ctx, c, a, b)
            return a if cv else b

        value = _values_broadcast(ctx, pick, shape, [0, 1, 2])
    return [ctx.out(shape, dtype, value)]
