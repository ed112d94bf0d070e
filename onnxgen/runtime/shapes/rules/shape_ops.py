"""Shape-moving ops: Shape/Size, Reshape/Flatten, (Un)Squeeze, Transpose, Concat, Slice, Gather,
Expand, Tile, Split, Pad, ConstantOfShape, Range and the data-dependent ones (NonZero, Unique...)."""

from __future__ import annotations

import numpy as np
import onnx

from onnxgen.runtime.shapes.context import RuleContext, RuleFailed, expr_array, value_shape
from onnxgen.runtime.shapes.dimexpr import DimExpr
from onnxgen.runtime.shapes.rules import rule
from onnxgen.runtime.shapes.symbols import Dim
from onnxgen.runtime.shapes.tensor import INT_TYPES, TensorInfo

INT64 = onnx.TensorProto.INT64


@rule("Shape")
def shape_op(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = ctx.shape(0)
    rank = len(shape)
    start = int(ctx.attr("start", 0))
    end = ctx.attr("end")
    start = min(max(start + rank if start < 0 else start, 0), rank)
    stop = rank if end is None else min(max(int(end) + rank if int(end) < 0 else int(end), 0), rank)
    dims = shape[start:stop]
    return [ctx.out((len(dims),), INT64, expr_array((ctx.e(d) for d in dims), (len(dims),)))]


@rule("Size")
def size_op(ctx: RuleContext) -> list[TensorInfo | None]:
    return [ctx.out((), INT64, expr_array([ctx.prod(ctx.shape(0))], ()))]


def _reshape_dims(ctx: RuleContext, in_shape: tuple[Dim, ...], target: list[Dim], allowzero: bool) -> list[Dim]:
    out: list[Dim] = []
    infer_at = None
    for i, d in enumerate(target):
        if d == -1:
            infer_at = i
            out.append(1)
        elif d == 0 and not allowzero:
            if i >= len(in_shape):
                raise RuleFailed("Reshape copies a dim past the input rank")
            out.append(in_shape[i])
        else:
            out.append(d)
    if infer_at is not None:
        known = [d for i, d in enumerate(out) if i != infer_at]
        out[infer_at] = _divide(ctx, in_shape, known)
    return out


def _divide(ctx: RuleContext, numerator: tuple[Dim, ...] | list[Dim], denominator: list[Dim]) -> Dim:
    """prod(numerator) / prod(denominator): cancel equal factors first, then divide polynomials."""
    num = list(numerator)
    rest: list[Dim] = []
    for d in denominator:
        if d in num:
            num.remove(d)
        else:
            rest.append(d)
    q = ctx.prod(num).exact_div(ctx.prod(rest))
    if q is not None:
        return ctx.dim(q)
    return ctx.derived(list(numerator), denominator)


@rule("Reshape")
def reshape(ctx: RuleContext) -> list[TensorInfo | None]:
    in_shape = ctx.shape(0)
    raw = ctx.value(1)
    if raw is None or any(e is None for e in raw.reshape(-1)):
        return [ctx.out(ctx.dims_value_or_data(1), ctx.dtype(0))]  # target read from device data
    # -1 and 0 are markers, not extents: keep them as ints before interning the rest
    target = [-1 if e.const_value() == -1 else ctx.dim(e) for e in raw.reshape(-1)]
    out = _reshape_dims(ctx, in_shape, target, bool(ctx.attr("allowzero", 0)))
    value = None
    v = ctx.value(0)
    vs = value_shape(tuple(out))
    if v is not None and vs is not None:
        value = v.reshape(vs)
    return [ctx.out(out, ctx.dtype(0), value)]


@rule("Flatten")
def flatten(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = ctx.shape(0)
    axis = int(ctx.attr("axis", 1))
    axis = axis + len(shape) if axis < 0 else axis
    out = (ctx.dim(ctx.prod(shape[:axis])), ctx.dim(ctx.prod(shape[axis:])))
    return [ctx.out(out, ctx.dtype(0))]


@rule("Squeeze")
def squeeze(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = ctx.shape(0)
    axes = ctx.ints_attr_or_input("axes", 1)
    if axes is None:
        if any(isinstance(d, str) for d in shape):
            raise RuleFailed("Squeeze without axes on a symbolic shape")
        keep = [d for d in shape if d != 1]
    else:
        drop = {ctx.axis(a, len(shape)) for a in axes}
        keep = [d for i, d in enumerate(shape) if i not in drop]
    v = ctx.value(0)
    return [ctx.out(keep, ctx.dtype(0), None if v is None else v.reshape(tuple(keep)))]


@rule("Unsqueeze")
def unsqueeze(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = list(ctx.shape(0))
    axes = ctx.ints_attr_or_input("axes", 1) or []
    rank = len(shape) + len(axes)
    for a in sorted(ctx.axis(a, rank) for a in axes):
        shape.insert(a, 1)
    v = ctx.value(0)
    return [ctx.out(shape, ctx.dtype(0), None if v is None else v.reshape(tuple(shape)))]


@rule("Transpose")
def transpose(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = ctx.shape(0)
    perm = ctx.attr("perm")
    perm = list(reversed(range(len(shape)))) if perm is None else [int(p) for p in perm]
    v = ctx.value(0)
    return [ctx.out([shape[p] for p in perm], ctx.dtype(0), None if v is None else v.transpose(perm))]


@rule("Concat")
def concat(ctx: RuleContext) -> list[TensorInfo | None]:
    shapes = [ctx.shape(i) for i in range(len(ctx.inputs)) if ctx.has(i)]
    rank = len(shapes[0])
    axis = ctx.axis(int(ctx.attr("axis", 0)), rank)
    out: list[Dim] = []
    for a in range(rank):
        if a == axis:
            out.append(ctx.dim(sum((ctx.e(s[a]) for s in shapes), DimExpr.const(0))))
        else:
            d = shapes[0][a]
            for s in shapes[1:]:
                d = ctx.unify(d, s[a])  # non-axis dims must agree: a chokepoint
            out.append(d)
    value = None
    vals = [ctx.value(i) for i in range(len(ctx.inputs)) if ctx.has(i)]
    if ctx.dtype(0) in INT_TYPES and all(v is not None for v in vals):
        value = np.concatenate(vals, axis=axis)  # type: ignore[arg-type]
    return [ctx.out(out, ctx.dtype(0), value)]


def _clamp_index(ctx: RuleContext, index: DimExpr, extent: DimExpr, step_positive: bool) -> DimExpr | None:
    """Slice start/end normalisation for constant indices over a possibly symbolic extent."""
    c = index.const_value()
    e = extent.const_value()
    if c is None:
        return None
    if e is not None:
        if c < 0:
            c += e
        lo, hi = (0, e) if step_positive else (-1, e - 1)
        return DimExpr.const(min(max(c, lo), hi))
    if c < 0:
        return extent + c  # assumes |c| <= extent, as exporters' slices from the end do
    if c >= 2**31 - 1:
        return extent if step_positive else extent - 1
    if c == 0:
        return DimExpr.const(0)
    return None  # c within a symbolic extent? unknown whether it clamps


@rule("Slice")
def slice_op(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = ctx.shape(0)
    rank = len(shape)
    if ctx.opset < 10:
        starts = [DimExpr.const(int(s)) for s in ctx.attr("starts")]
        ends = [DimExpr.const(int(s)) for s in ctx.attr("ends")]
        axes = [int(a) for a in ctx.attr("axes", list(range(len(starts))))]
        steps = [1] * len(starts)
    else:
        sv, ev = ctx.value(1), ctx.value(2)
        if sv is None or ev is None:
            return _data_slice(ctx, shape)
        starts, ends = list(sv.reshape(-1)), list(ev.reshape(-1))
        axes = ctx.ints_value(3) if ctx.has(3) else list(range(len(starts)))
        steps = ctx.ints_value(4) if ctx.has(4) else [1] * len(starts)
        if axes is None or steps is None:
            return _data_slice(ctx, shape)
    out = list(shape)
    slices: list[slice] = [slice(None)] * rank
    for start, end, axis, step in zip(starts, ends, axes, steps):
        a = ctx.axis(axis, rank)
        extent = ctx.e(shape[a])
        if start is None or end is None:
            out[a] = ctx.data_dependent()
            continue
        s = _clamp_index(ctx, start, extent, step > 0)
        e = _clamp_index(ctx, end, extent, step > 0)
        if s is None or e is None:
            sources = extent.symbols() | start.symbols() | end.symbols()
            out[a] = ctx.table.opaque(ctx.name, sources)
            continue
        length = e - s if step > 0 else s - e
        lc = length.const_value()
        if lc is not None:
            count = max(0, -(-lc // abs(step)))
            out[a] = count
        elif abs(step) == 1:
            out[a] = ctx.dim(length)
        else:
            out[a] = ctx.derived(shape[a])
        if s.is_const() and e.is_const():
            slices[a] = slice(s.const_value(), e.const_value() if e.const_value() >= 0 else None, step)
    value = None
    v = ctx.value(0)
    if v is not None and all(isinstance(d, int) for d in out):
        got = v[tuple(slices)]
        value = got if tuple(got.shape) == tuple(out) else None
    return [ctx.out(out, ctx.dtype(0), value)]


def _data_slice(ctx: RuleContext, shape: tuple[Dim, ...]) -> list[TensorInfo | None]:
    """Slice bounds read from device data: every axis may change, with no provenance."""
    return [ctx.out([ctx.data_dependent() for _ in shape], ctx.dtype(0))]


@rule("Gather")
def gather(ctx: RuleContext) -> list[TensorInfo | None]:
    data, indices = ctx.shape(0), ctx.shape(1)
    axis = ctx.axis(int(ctx.attr("axis", 0)), len(data))
    out = list(data[:axis]) + list(indices) + list(data[axis + 1 :])
    value = None
    v, iv = ctx.value(0), ctx.ints_value(1)
    if v is not None and iv is not None and ctx.input(1).value is not None:
        extent = v.shape[axis]
        idx = np.asarray([i + extent if i < 0 else i for i in iv], dtype=np.int64).reshape(ctx.input(1).value.shape)
        value = np.take(v, idx, axis=axis)
    return [ctx.out(out, ctx.dtype(0), value)]


@rule("GatherElements")
def gather_elements(ctx: RuleContext) -> list[TensorInfo | None]:
    ctx.shape(0)
    return [ctx.out(ctx.shape(1), ctx.dtype(0))]


@rule("GatherND")
def gather_nd(ctx: RuleContext) -> list[TensorInfo | None]:
    data, idx = ctx.shape(0), ctx.shape(1)
    b = int(ctx.attr("batch_dims", 0))
    last = idx[-1]
    if not isinstance(last, int):
        raise RuleFailed("GatherND index depth is symbolic")
    return [ctx.out(list(idx[:-1]) + list(data[b + last :]), ctx.dtype(0))]


@rule("Scatter", "ScatterElements", "ScatterND", "TensorScatter")
def scatter(ctx: RuleContext) -> list[TensorInfo | None]:
    return [ctx.out(ctx.shape(0), ctx.dtype(0))]


@rule("Expand")
def expand(ctx: RuleContext) -> list[TensorInfo | None]:
    if ctx.value(1) is None or any(e is None for e in ctx.value(1).reshape(-1)):
        n = len(ctx.dims_value_or_data(1))  # target from device data: every extent data-dependent
        return [ctx.out([ctx.data_dependent() for _ in range(max(n, len(ctx.shape(0))))], ctx.dtype(0))]
    target = tuple(ctx.dims_value(1))
    shape = ctx.broadcast([ctx.shape(0), target])
    value = None
    v = ctx.value(0)
    vs = value_shape(shape)
    if v is not None and vs is not None:
        value = np.empty(vs, dtype=object)
        value[...] = np.broadcast_to(v, vs)
    return [ctx.out(shape, ctx.dtype(0), value)]


@rule("Tile")
def tile(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = ctx.shape(0)
    reps = ctx.dims_value_or_data(1)
    return [ctx.out([ctx.dim(ctx.e(d) * ctx.e(r)) for d, r in zip(shape, reps)], ctx.dtype(0))]


@rule("Split")
def split(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = ctx.shape(0)
    axis = ctx.axis(int(ctx.attr("axis", 0)), len(shape))
    n = ctx.num_outputs
    sizes: list[Dim] | None = None
    if ctx.attr("split") is not None:
        sizes = [int(s) for s in ctx.attr("split")]
    elif ctx.has(1):
        sizes = ctx.dims_value(1)
    if sizes is None:
        extent = ctx.e(shape[axis])
        c = extent.const_value()
        if c is not None:
            chunk = -(-c // n)
            sizes = [min(chunk, max(c - chunk * i, 0)) for i in range(n)]
        else:
            q = extent.exact_div(n)
            part = ctx.dim(q) if q is not None else ctx.derived(shape[axis])
            sizes = [part] * n
    outs: list[TensorInfo | None] = []
    for s in sizes:
        out = list(shape)
        out[axis] = s
        outs.append(ctx.out(out, ctx.dtype(0)))
    return outs


@rule("Pad")
def pad(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = ctx.shape(0)
    rank = len(shape)
    pads = [ctx.e(int(p)) for p in ctx.attr("pads")] if ctx.attr("pads") is not None else None
    if pads is None:
        v = ctx.value(1)
        if v is None or any(x is None for x in v.reshape(-1)):
            return [ctx.out([ctx.data_dependent() for _ in shape], ctx.dtype(0))]
        pads = list(v.reshape(-1))
    axes = ctx.ints_value(3) if ctx.has(3) else list(range(rank))
    if axes is None:
        raise RuleFailed("Pad axes are not constant")
    axes = [ctx.axis(a, rank) for a in axes]
    out = list(shape)
    k = len(axes)
    for j, a in enumerate(axes):
        out[a] = ctx.dim(ctx.e(shape[a]) + pads[j] + pads[j + k])
    return [ctx.out(out, ctx.dtype(0))]


@rule("CenterCropPad")
def center_crop_pad(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = list(ctx.shape(0))
    sizes = ctx.dims_value(1)
    axes = ctx.attr("axes") or list(range(len(shape)))
    for a, s in zip(axes, sizes):
        shape[ctx.axis(int(a), len(shape))] = s
    return [ctx.out(shape, ctx.dtype(0))]


@rule("ConstantOfShape")
def constant_of_shape(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = ctx.dims_value_or_data(0)
    fill = ctx.attr("value")
    dtype = fill.data_type if fill is not None else onnx.TensorProto.FLOAT
    value = None
    vs = value_shape(tuple(shape))
    if vs is not None and dtype in INT_TYPES:
        scalar = int(onnx.numpy_helper.to_array(fill).reshape(-1)[0]) if fill is not None else 0
        value = expr_array([scalar] * int(np.prod(vs, dtype=np.int64)), vs)
    return [ctx.out(shape, dtype, value)]


@rule("Range")
def range_op(ctx: RuleContext) -> list[TensorInfo | None]:
    start, limit, delta = (ctx.value(i) for i in range(3))
    if start is None or limit is None or delta is None:
        return [ctx.out([ctx.data_dependent()], ctx.dtype(0))]
    s, l, d = (v.reshape(-1)[0] for v in (start, limit, delta))
    if s is None or l is None or d is None:
        return [ctx.out([ctx.data_dependent()], ctx.dtype(0))]
    dc = d.const_value()
    span = l - s
    if dc == 1:
        n = ctx.dim(span) if span.const_value() is None else max(span.const_value(), 0)
    elif dc is not None and span.const_value() is not None:
        n = max(-(-span.const_value() // dc), 0)
    else:
        n = ctx.derived([ctx.dim(x) for x in (s, l, d) if not x.is_const()])
    value = None
    if isinstance(n, int) and n <= 64 and s.is_const() and dc is not None:
        value = expr_array([s.const_value() + i * dc for i in range(n)], (n,))
    return [ctx.out([n], ctx.dtype(0), value)]


@rule("OneHot")
def one_hot(ctx: RuleContext) -> list[TensorInfo | None]:
    idx = list(ctx.shape(0))
    depth = ctx.value(1)
    d = depth.reshape(-1)[0] if depth is not None else None
    dim = ctx.dim(d) if d is not None else ctx.data_dependent()
    axis = int(ctx.attr("axis", -1))
    rank = len(idx) + 1
    idx.insert(ctx.axis(axis, rank), dim)
    return [ctx.out(idx, ctx.dtype(2))]


@rule("DepthToSpace", "SpaceToDepth")
def depth_space(ctx: RuleContext) -> list[TensorInfo | None]:
    n, c, h, w = ctx.shape(0)
    b = int(ctx.attr("blocksize"))
    if ctx.op_type == "DepthToSpace":
        q = ctx.e(c).exact_div(b * b)
        out = [n, ctx.dim(q) if q is not None else ctx.derived(c), ctx.dim(ctx.e(h) * b), ctx.dim(ctx.e(w) * b)]
    else:
        hq, wq = ctx.e(h).exact_div(b), ctx.e(w).exact_div(b)
        out = [
            n,
            ctx.dim(ctx.e(c) * (b * b)),
            ctx.dim(hq) if hq is not None else ctx.derived(h),
            ctx.dim(wq) if wq is not None else ctx.derived(w),
        ]
    return [ctx.out(out, ctx.dtype(0))]


@rule("NonZero")
def non_zero(ctx: RuleContext) -> list[TensorInfo | None]:
    return [ctx.out([len(ctx.shape(0)), ctx.data_dependent()], INT64)]


@rule("Compress")
def compress(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = list(ctx.shape(0))
    axis = ctx.attr("axis")
    if axis is None:
        return [ctx.out([ctx.data_dependent()], ctx.dtype(0))]
    shape[ctx.axis(int(axis), len(shape))] = ctx.data_dependent()
    return [ctx.out(shape, ctx.dtype(0))]


@rule("Unique")
def unique(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = list(ctx.shape(0))
    n = ctx.data_dependent()
    axis = ctx.attr("axis")
    if axis is None:
        y = [n]
    else:
        y = list(shape)
        y[ctx.axis(int(axis), len(shape))] = n
    total = shape[ctx.axis(int(axis), len(shape))] if axis is not None else ctx.dim(ctx.prod(shape))
    return [ctx.out(y, ctx.dtype(0)), ctx.out([n], INT64), ctx.out([total], INT64), ctx.out([n], INT64)]


@rule("TopK")
def top_k(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = list(ctx.shape(0))
    axis = ctx.axis(int(ctx.attr("axis", -1)), len(shape))
    k = ctx.attr("k") if ctx.opset < 10 else None
    if k is not None:
        shape[axis] = int(k)
    else:
        v = ctx.value(1)
        e = v.reshape(-1)[0] if v is not None else None
        shape[axis] = ctx.dim(e) if e is not None else ctx.data_dependent()
    return [ctx.out(shape, ctx.dtype(0)), ctx.out(shape, INT64)]
