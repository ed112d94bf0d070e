"""Linear algebra, reductions, normalisations, convolutions/pools, recurrent ops, Einsum, Resize."""

from __future__ import annotations

import onnx

from onnxgen.runtime.shapes.context import RuleContext, RuleFailed
from onnxgen.runtime.shapes.rules import rule
from onnxgen.runtime.shapes.symbols import Dim
from onnxgen.runtime.shapes.tensor import INT_TYPES, TensorInfo

INT64 = onnx.TensorProto.INT64
FLOAT = onnx.TensorProto.FLOAT


def matmul_shape(ctx: RuleContext, a: tuple[Dim, ...], b: tuple[Dim, ...]) -> list[Dim]:
    """numpy matmul: batch dims broadcast (a chokepoint), the contracted dims unify."""
    a1, b1 = len(a) == 1, len(b) == 1
    a2 = (1, a[0]) if a1 else a
    b2 = (b[0], 1) if b1 else b
    ctx.unify(a2[-1], b2[-2])
    batch = ctx.broadcast([a2[:-2], b2[:-2]])
    out = list(batch)
    if not a1:
        out.append(a2[-2])
    if not b1:
        out.append(b2[-1])
    return out


@rule("MatMul", "MatMulInteger")
def matmul(ctx: RuleContext) -> list[TensorInfo | None]:
    dtype = onnx.TensorProto.INT32 if ctx.op_type == "MatMulInteger" else ctx.dtype(0)
    return [ctx.out(matmul_shape(ctx, ctx.shape(0), ctx.shape(1)), dtype)]


@rule("QLinearMatMul")
def qlinear_matmul(ctx: RuleContext) -> list[TensorInfo | None]:
    return [ctx.out(matmul_shape(ctx, ctx.shape(0), ctx.shape(3)), ctx.dtype(7))]


@rule("Gemm")
def gemm(ctx: RuleContext) -> list[TensorInfo | None]:
    a, b = ctx.shape(0), ctx.shape(1)
    m, k = (a[1], a[0]) if ctx.attr("transA", 0) else (a[0], a[1])
    k2, n = (b[1], b[0]) if ctx.attr("transB", 0) else (b[0], b[1])
    ctx.unify(k, k2)
    out = (m, n)
    if ctx.has(2):
        out = ctx.broadcast([out, ctx.shape(2)])
    return [ctx.out(out, ctx.dtype(0))]


def _reduce_axes(ctx: RuleContext, rank: int) -> list[int] | None:
    if ctx.op_type == "ReduceSum" and ctx.opset >= 13 or ctx.opset >= 18:
        axes = ctx.ints_value(1) if ctx.has(1) else []
        if ctx.has(1) and axes is None:
            raise RuleFailed("reduction axes are not constant")
    else:
        axes = [int(a) for a in ctx.attr("axes", [])]
    if not axes:
        return None if not ctx.attr("noop_with_empty_axes", 0) else []
    return sorted({ctx.axis(a, rank) for a in axes})


REDUCE = "ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum"


@rule(*REDUCE.split(), "ReduceSumSquare")
def reduce(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = ctx.shape(0)
    axes = _reduce_axes(ctx, len(shape))
    if axes is None:
        axes = list(range(len(shape)))
    keep = bool(ctx.attr("keepdims", 1))
    out = (
        [1 if i in axes else d for i, d in enumerate(shape)]
        if keep
        else [d for i, d in enumerate(shape) if i not in axes]
    )
    value = None
    v = ctx.value(0)
    if ctx.op_type in ("ReduceSum", "ReduceProd") and v is not None and ctx.dtype(0) in INT_TYPES and len(shape) <= 1:
        items = list(v.reshape(-1))
        if all(x is not None for x in items):
            from onnxgen.runtime.shapes.context import expr_array
            from onnxgen.runtime.shapes.dimexpr import DimExpr, product

            total = sum(items, DimExpr.const(0)) if ctx.op_type == "ReduceSum" else product(items)
            value = expr_array([total], tuple(out))  # type: ignore[arg-type]
    return [ctx.out(out, ctx.dtype(0), value)]


@rule("ArgMax", "ArgMin")
def arg_reduce(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = ctx.shape(0)
    axis = ctx.axis(int(ctx.attr("axis", 0)), len(shape))
    keep = bool(ctx.attr("keepdims", 1))
    out = (
        [1 if i == axis else d for i, d in enumerate(shape)] if keep else [d for i, d in enumerate(shape) if i != axis]
    )
    return [ctx.out(out, INT64)]


@rule("LayerNormalization", "RMSNormalization")
def layer_norm(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = ctx.shape(0)
    axis = ctx.axis(int(ctx.attr("axis", -1)), len(shape))
    stat = [d if i < axis else 1 for i, d in enumerate(shape)]
    return [ctx.out(shape, ctx.dtype(0)), ctx.out(stat, FLOAT), ctx.out(stat, FLOAT)]


@rule("BatchNormalization", "InstanceNormalization", "GroupNormalization")
def batch_norm(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = ctx.shape(0)
    outs: list[TensorInfo | None] = [ctx.out(shape, ctx.dtype(0))]
    if ctx.op_type == "BatchNormalization":
        c = [shape[1]] if len(shape) > 1 else [1]
        outs += [ctx.out(c, ctx.dtype(3)) for _ in range(ctx.num_outputs - 1)]
    return outs


def _spatial(ctx: RuleContext, in_dims: tuple[Dim, ...], kernel: list[int], transpose: bool = False) -> list[Dim]:
    n = len(in_dims)
    strides = list(ctx.attr("strides", [1] * n))
    dil = list(ctx.attr("dilations", [1] * n))
    pads = list(ctx.attr("pads", [0] * 2 * n))
    auto = ctx.attr("auto_pad", "NOTSET")
    ceil = bool(ctx.attr("ceil_mode", 0))
    out: list[Dim] = []
    for i, d in enumerate(in_dims):
        if not isinstance(d, int):
            out.append(ctx.derived(d))
            continue
        k = (kernel[i] - 1) * dil[i] + 1
        if transpose:
            op = list(ctx.attr("output_padding", [0] * n))
            if auto in ("SAME_UPPER", "SAME_LOWER"):
                out.append(d * strides[i])
            else:
                out.append(strides[i] * (d - 1) + op[i] + k - pads[i] - pads[i + n])
        elif auto in ("SAME_UPPER", "SAME_LOWER"):
            out.append(-(-d // strides[i]))
        elif auto == "VALID":
            out.append((d - k) // strides[i] + 1)
        else:
            span = d + pads[i] + pads[i + n] - k
            size = (-(-span // strides[i]) if ceil else span // strides[i]) + 1
            if ceil and (size - 1) * strides[i] >= d + pads[i]:
                size -= 1  # the last window would start in the end padding: dropped
            out.append(size)
    return out


@rule("Conv", "ConvInteger", "QLinearConv", "DeformConv", "ConvTranspose")
def conv(ctx: RuleContext) -> list[TensorInfo | None]:
    w_index = 3 if ctx.op_type == "QLinearConv" else 1
    x, w = ctx.shape(0), ctx.shape(w_index)
    kernel = list(ctx.attr("kernel_shape", w[2:]))
    if not all(isinstance(k, int) for k in kernel):
        raise RuleFailed("symbolic kernel shape")
    transpose = ctx.op_type == "ConvTranspose"
    if transpose and ctx.attr("output_shape") is not None:
        spatial: list[Dim] = [int(s) for s in ctx.attr("output_shape")][-len(kernel) :]
    else:
        spatial = _spatial(ctx, x[2:], kernel, transpose)
    channels = ctx.dim(ctx.e(w[1]) * int(ctx.attr("group", 1))) if transpose else w[0]
    dtype = {"ConvInteger": onnx.TensorProto.INT32, "QLinearConv": ctx.dtype(7)}.get(ctx.op_type, ctx.dtype(0))
    return [ctx.out([x[0], channels, *spatial], dtype)]


@rule("AveragePool", "MaxPool", "LpPool")
def pool(ctx: RuleContext) -> list[TensorInfo | None]:
    x = ctx.shape(0)
    out = [x[0], x[1], *_spatial(ctx, x[2:], [int(k) for k in ctx.attr("kernel_shape")])]
    outs: list[TensorInfo | None] = [ctx.out(out, ctx.dtype(0))]
    if ctx.num_outputs > 1:
        outs.append(ctx.out(out, INT64))
    return outs


@rule("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
def global_pool(ctx: RuleContext) -> list[TensorInfo | None]:
    x = ctx.shape(0)
    return [ctx.out([x[0], x[1], *([1] * (len(x) - 2))], ctx.dtype(0))]


@rule("MaxUnpool")
def max_unpool(ctx: RuleContext) -> list[TensorInfo | None]:
    if ctx.has(2):
        return [ctx.out(ctx.dims_value(2), ctx.dtype(0))]
    x = ctx.shape(0)
    n = len(x) - 2
    strides = list(ctx.attr("strides", [1] * n))
    pads = list(ctx.attr("pads", [0] * 2 * n))
    k = [int(v) for v in ctx.attr("kernel_shape")]
    spatial: list[Dim] = []
    for i, d in enumerate(x[2:]):
        spatial.append(ctx.dim(ctx.e(d) * strides[i] + (k[i] - strides[i] - pads[i] - pads[i + n])))
    return [ctx.out([x[0], x[1], *spatial], ctx.dtype(0))]


@rule("RNN", "GRU", "LSTM")
def recurrent(ctx: RuleContext) -> list[TensorInfo | None]:
    x = ctx.shape(0)
    hidden = int(ctx.attr("hidden_size"))
    dirs = 2 if ctx.attr("direction", "forward") == "bidirectional" else 1
    batch_major = bool(ctx.attr("layout", 0))
    seq, batch = (x[1], x[0]) if batch_major else (x[0], x[1])
    y = [batch, seq, dirs, hidden] if batch_major else [seq, dirs, batch, hidden]
    h = [batch, dirs, hidden] if batch_major else [dirs, batch, hidden]
    return [ctx.out(y, ctx.dtype(0)), ctx.out(h, ctx.dtype(0)), ctx.out(h, ctx.dtype(0))]


@rule("Einsum")
def einsum(ctx: RuleContext) -> list[TensorInfo | None]:
    equation = str(ctx.attr("equation")).replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    terms = lhs.split(",")
    letters: dict[str, Dim] = {}
    ellipsis: list[tuple[Dim, ...]] = []
    for i, term in enumerate(terms):
        shape = ctx.shape(i)
        if "..." in term:
            head, tail = term.split("...")
            n_ell = len(shape) - len(head) - len(tail)
            ellipsis.append(tuple(shape[len(head) : len(head) + n_ell]))
            pairs = list(zip(head, shape[: len(head)])) + list(zip(tail, shape[len(shape) - len(tail) :]))
        else:
            pairs = list(zip(term, shape))
        for letter, d in pairs:
            if letter in letters:
                if d != 1 and letters[letter] != 1:
                    letters[letter] = ctx.unify(letters[letter], d)  # a repeated letter: the dims meet
                elif letters[letter] == 1:
                    letters[letter] = d
            else:
                letters[letter] = d
    ell = list(ctx.broadcast(ellipsis)) if ellipsis else []
    if not _:
        counts = {c: lhs.count(c) for c in set(lhs.replace(",", "").replace(".", ""))}
        rhs = ("..." if ellipsis else "") + "".join(sorted(c for c, n in counts.items() if n == 1))
    out: list[Dim] = []
    if "..." in rhs:
        head, tail = rhs.split("...")
        out = [letters[c] for c in head] + ell + [letters[c] for c in tail]
    else:
        out = [letters[c] for c in rhs]
    return [ctx.out(out, ctx.dtype(0))]


@rule("Resize", "Upsample")
def resize(ctx: RuleContext) -> list[TensorInfo | None]:
    x = ctx.shape(0)
    sizes_index, scales_index = (3, 2) if ctx.op_type == "Resize" and ctx.opset >= 11 else (-1, 1)
    if sizes_index > 0 and ctx.has(sizes_index) and ctx.input(sizes_index).shape not in ((0,), None):
        sizes = ctx.dims_value(sizes_index)
        axes = ctx.attr("axes")
        if axes is not None:
            out = list(x)
            for a, s in zip(axes, sizes):
                out[ctx.axis(int(a), len(x))] = s
            return [ctx.out(out, ctx.dtype(0))]
        return [ctx.out(sizes, ctx.dtype(0))]
    # scales are float data: the extents follow from the input dims (data-determined when not constant)
    return [ctx.out([ctx.derived(d) if not isinstance(d, int) else ctx.data_dependent() for d in x], ctx.dtype(0))]
