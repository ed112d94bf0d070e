"""Shapes of the ops onnxgen's CUDA fusion pass writes (onnxgen/runtime/fusion.py)."""

from __future__ import annotations

from onnxgen.runtime.shapes.context import RuleContext, RuleFailed
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


@rule("FusedLinearAttention", domain=FUSED)
def fused_linear_attention(ctx: RuleContext) -> list[TensorInfo | None]:
    """LinearAttention (com.microsoft's rule, or the default domain's) over a query of
    [batch, tokens, prod(query_source.shape[2:])] (runtime/fusion_delta_rule.py)."""
    b, t, v_hidden = ctx.shape(2)
    hq, hkv = int(ctx.attr("q_num_heads")), int(ctx.attr("kv_num_heads"))
    width = ctx.e(ctx.shape(0)[2])
    for extent in ctx.shape(0)[3:]:
        width = width * ctx.e(extent)
    d_k = width.exact_div(hq)
    d_v = ctx.e(v_hidden).exact_div(hkv)
    if d_k is None or d_v is None:
        raise RuleFailed(f"the query's width is not a multiple of {hq} heads, or the value's of {hkv}")
    inner = ctx.attr("inner_domain", "")
    heads_out = max(hq, hkv) if (inner.decode() if isinstance(inner, bytes) else inner) else hq
    state_dtype = ctx.dtype(3) if ctx.has(3) else ctx.dtype(0)
    return [
        ctx.out([b, t, ctx.dim(d_v * heads_out)], ctx.dtype(0)),
        ctx.out([b, hkv, ctx.dim(d_k), ctx.dim(d_v)], state_dtype),
    ]
