"""Shapes of the ops onnxgen's CUDA fusion pass writes (onnxgen/runtime/fusion.py)."""

from __future__ import annotations

from onnxgen.runtime.shapes.context import RuleContext
from onnxgen.runtime.shapes.rules import rule
from onnxgen.runtime.shapes.tensor import TensorInfo

FUSED = "onnxgen"


@rule("MatMulGroup", "MatMulNBitsGroup", domain=FUSED)
def matmul_group(ctx: RuleContext) -> list[TensorInfo | None]:
    a = ctx.shape(0)
    if ctx.op_type == "MatMulNBitsGroup":
        ctx.unify(a[-1], int(ctx.attr("K")))
    outs = [ctx.out([*a[:-1], int(w)], ctx.dtype(0)) for w in ctx.attr("widths")]
    prologue = ctx.attr("prologue", "")
    if (prologue.decode() if isinstance(prologue, bytes) else prologue) == "skip_rms":
        outs.append(ctx.out(list(a), ctx.dtype(0)))  # the residual sum (fusion.py's prologues)
    return outs


@rule("SiluMul", domain=FUSED)
def silu_mul(ctx: RuleContext) -> list[TensorInfo | None]:
    return [ctx.out(ctx.broadcast([ctx.shape(0), ctx.shape(1)]), ctx.dtype(0))]


@rule("SigmoidGate", domain=FUSED)
def sigmoid_gate(ctx: RuleContext) -> list[TensorInfo | None]:
    shapes = [ctx.shape(i) for i in range(len(ctx.node.input)) if ctx.node.input[i]]
    return [ctx.out(ctx.broadcast(shapes), ctx.dtype(0))]


@rule("L2Normalize", domain=FUSED)
def l2_normalize(ctx: RuleContext) -> list[TensorInfo | None]:
    return [ctx.out(list(ctx.shape(0)), ctx.dtype(0))]


@rule("MaskedAttention", domain=FUSED)
def masked_attention(ctx: RuleContext) -> list[TensorInfo | None]:
    q, v = ctx.shape(0), ctx.shape(2)
    return [ctx.out([*q[:-1], v[-1]], ctx.dtype(0))]


@rule("RowSumCast", domain=FUSED)
def row_sum_cast(ctx: RuleContext) -> list[TensorInfo | None]:
    x = ctx.shape(0)
    keep = int(ctx.attr("keepdims", 1))
    return [ctx.out([x[0], 1] if keep else [x[0]], int(ctx.attr("to")))]


@rule("RowSelect", domain=FUSED)
def row_select(ctx: RuleContext) -> list[TensorInfo | None]:
    x = ctx.shape(0)
    return [ctx.out([x[0], 1, *x[2:]], ctx.dtype(0))]
