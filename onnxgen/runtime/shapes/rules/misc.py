"""Constants, generators, signal, vision, strings, losses and training ops."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from onnxgen.runtime.shapes.context import RuleContext, RuleFailed, expr_array
from onnxgen.runtime.shapes.rules import rule
from onnxgen.runtime.shapes.symbols import Dim
from onnxgen.runtime.shapes.tensor import INT_TYPES, VALUE_MAX_ELEMENTS, TensorInfo

INT64 = onnx.TensorProto.INT64
FLOAT = onnx.TensorProto.FLOAT
TRAINING = "ai.onnx.preview.training"


@rule("Constant")
def constant(ctx: RuleContext) -> list[TensorInfo | None]:
    for name, dtype in (("value_int", INT64), ("value_float", FLOAT)):
        if ctx.attr(name) is not None:
            return [ctx.out((), dtype, expr_array([int(ctx.attr(name))], ()) if dtype == INT64 else None)]
    for name, dtype in (("value_ints", INT64), ("value_floats", FLOAT)):
        if ctx.attr(name) is not None:
            items = list(ctx.attr(name))
            value = expr_array([int(x) for x in items], (len(items),)) if dtype == INT64 else None
            return [ctx.out((len(items),), dtype, value)]
    t = ctx.attr("value")
    if t is None:
        sparse = ctx.attr("sparse_value")
        if sparse is None:
            raise RuleFailed("Constant without a supported value attribute")
        return [ctx.out(tuple(int(d) for d in sparse.dims), sparse.values.data_type)]
    if isinstance(t, onnx.TensorProto):
        count = int(np.prod(t.dims)) if len(t.dims) else 1
        value = None
        if t.data_type in INT_TYPES and count <= VALUE_MAX_ELEMENTS:
            array = numpy_helper.to_array(t)
            value = expr_array((int(x) for x in array.reshape(-1)), array.shape)
        return [ctx.out(tuple(int(d) for d in t.dims), t.data_type, value)]
    return [ctx.out((), onnx.TensorProto.STRING)]


@rule("RandomUniform", "RandomNormal")
def random_shape(ctx: RuleContext) -> list[TensorInfo | None]:
    return [ctx.out([int(d) for d in ctx.attr("shape")], int(ctx.attr("dtype", FLOAT)))]


@rule("Multinomial")
def multinomial(ctx: RuleContext) -> list[TensorInfo | None]:
    return [ctx.out([ctx.shape(0)[0], int(ctx.attr("sample_size", 1))], int(ctx.attr("dtype", onnx.TensorProto.INT32)))]


@rule("BlackmanWindow", "HammingWindow", "HannWindow")
def window(ctx: RuleContext) -> list[TensorInfo | None]:
    return [ctx.out(ctx.dims_value(0), int(ctx.attr("output_datatype", FLOAT)))]


@rule("MelWeightMatrix")
def mel(ctx: RuleContext) -> list[TensorInfo | None]:
    n_mel, dft = ctx.dims_value(0), ctx.dims_value(1)
    half = ctx.e(dft[0]).exact_div(2)
    bins = ctx.dim(half + 1) if half is not None else ctx.derived(dft[0])
    return [ctx.out([bins, n_mel[0]], int(ctx.attr("output_datatype", FLOAT)))]


@rule("DFT", "STFT")
def signal(ctx: RuleContext) -> list[TensorInfo | None]:
    # extents come from lengths and axes that may be runtime inputs: a symbol of the input's extents
    x = ctx.shape(0)
    rank = len(x) if ctx.op_type == "DFT" else len(x) + 1
    return [ctx.out([ctx.derived(x) for _ in range(rank)], ctx.dtype(0))]


@rule("Det")
def det(ctx: RuleContext) -> list[TensorInfo | None]:
    return [ctx.out(ctx.shape(0)[:-2], ctx.dtype(0))]


@rule("BitCast")
def bitcast(ctx: RuleContext) -> list[TensorInfo | None]:
    return [ctx.out(ctx.shape(0), int(ctx.attr("to")))]


@rule("GridSample")
def grid_sample(ctx: RuleContext) -> list[TensorInfo | None]:
    x, grid = ctx.shape(0), ctx.shape(1)
    return [ctx.out([x[0], x[1], *grid[1:-1]], ctx.dtype(0))]


@rule("AffineGrid")
def affine_grid(ctx: RuleContext) -> list[TensorInfo | None]:
    size = ctx.dims_value(1)
    return [ctx.out([size[0], *size[2:], len(size) - 2], ctx.dtype(0))]


@rule("Col2Im")
def col2im(ctx: RuleContext) -> list[TensorInfo | None]:
    x = ctx.shape(0)
    image = ctx.dims_value(1)
    block = ctx.dims_value(2)
    channels = ctx.e(x[1]).exact_div(ctx.prod(block))
    c: Dim = ctx.dim(channels) if channels is not None else ctx.derived(x[1])
    return [ctx.out([x[0], c, *image], ctx.dtype(0))]


@rule("RoiAlign", "MaxRoiPool")
def roi(ctx: RuleContext) -> list[TensorInfo | None]:
    x, rois = ctx.shape(0), ctx.shape(1)
    if ctx.op_type == "RoiAlign":
        size = [int(ctx.attr("output_height", 1)), int(ctx.attr("output_width", 1))]
    else:
        size = [int(v) for v in ctx.attr("pooled_shape")]
    return [ctx.out([rois[0], x[1], *size], ctx.dtype(0))]


@rule("NonMaxSuppression")
def nms(ctx: RuleContext) -> list[TensorInfo | None]:
    return [ctx.out([ctx.data_dependent(), 3], INT64)]


@rule("StringConcat", "RegexFullMatch", "StringNormalizer")
def strings(ctx: RuleContext) -> list[TensorInfo | None]:
    if ctx.op_type == "StringConcat":
        return [ctx.out(ctx.broadcast([ctx.shape(0), ctx.shape(1)]), onnx.TensorProto.STRING)]
    if ctx.op_type == "RegexFullMatch":
        return [ctx.out(ctx.shape(0), onnx.TensorProto.BOOL)]
    shape = list(ctx.shape(0))
    shape[-1] = ctx.data_dependent()  # stopwords may remove elements
    return [ctx.out(shape, onnx.TensorProto.STRING)]


@rule("StringSplit")
def string_split(ctx: RuleContext) -> list[TensorInfo | None]:
    x = ctx.shape(0)
    return [ctx.out([*x, ctx.data_dependent()], onnx.TensorProto.STRING), ctx.out(x, INT64)]


@rule("NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss")
def losses(ctx: RuleContext) -> list[TensorInfo | None]:
    x = ctx.shape(0)
    target = ctx.shape(1)
    loss = list(target) if ctx.attr("reduction", "mean") == "none" else []
    outs: list[TensorInfo | None] = [ctx.out(loss, ctx.dtype(0))]
    if ctx.num_outputs > 1:
        outs.append(ctx.out(x, ctx.dtype(0)))
    return outs


@rule("Adagrad", "Adam", "Momentum", domain=TRAINING)
def training(ctx: RuleContext) -> list[TensorInfo | None]:
    # inputs: R, T, then groups of tensors; every output mirrors an optimised input's shape
    tensors = [ctx.input(i) for i in range(2, len(ctx.inputs))]
    return [ctx.out(t.shape, t.dtype) if t is not None else None for t in tensors[: ctx.num_outputs]]
