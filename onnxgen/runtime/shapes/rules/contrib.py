"""Attention and the fused contrib ops LLM graphs use (com.microsoft and their default-domain kin)."""

from __future__ import annotations

import onnx

from onnxgen.runtime.shapes.context import RuleContext, RuleFailed
from onnxgen.runtime.shapes.rules import rule
from onnxgen.runtime.shapes.symbols import Dim
from onnxgen.runtime.shapes.tensor import TensorInfo

MS = "com.microsoft"
FLOAT = onnx.TensorProto.FLOAT


def _heads_dim(ctx: RuleContext, hidden: Dim, heads: int) -> Dim:
    q = ctx.e(hidden).exact_div(heads)
    if q is None:
        raise RuleFailed(f"hidden {hidden} is not a multiple of {heads} heads")
    return ctx.dim(q)


@rule("GroupQueryAttention", domain=MS)
def group_query_attention(ctx: RuleContext) -> list[TensorInfo | None]:
    q = ctx.shape(0)
    batch, seq, hidden = q
    nh, kvh = int(ctx.attr("num_heads")), int(ctx.attr("kv_num_heads"))
    if ctx.has(1):
        head = _heads_dim(ctx, hidden, nh)
        ctx.unify(ctx.shape(1)[2], ctx.dim(ctx.e(head) * kvh))
    else:
        head = _heads_dim(ctx, hidden, nh + 2 * kvh)
    out_hidden = ctx.dim(ctx.e(head) * nh)
    total_v = ctx.value(6)
    total = total_v.reshape(-1)[0] if total_v is not None else None
    if ctx.has(3):
        past = ctx.shape(3)
        ctx.unify(past[0], batch)
        past_len = past[2]
        if total is None:
            present_len: Dim = ctx.derived(past_len)  # total read from data: tied to the past's extent
        else:
            diff = (ctx.e(past_len) - total).const_value()
            if diff is not None:
                present_len = past_len if diff >= 0 else ctx.dim(total)
            else:
                present_len = ctx.table.function("max", (past_len, ctx.dim(total)), ctx.name)
    else:
        present_len = ctx.dim(total) if total is not None else ctx.data_dependent()
    present = [batch, kvh, present_len, head]
    dtype = ctx.dtype(0)
    return [ctx.out([batch, seq, out_hidden], dtype), ctx.out(present, dtype), ctx.out(present, dtype)]


def _to_4d(ctx: RuleContext, i: int, heads: int | None) -> tuple[Dim, Dim, Dim, Dim]:
    s = ctx.shape(i)
    if len(s) == 4:
        return s[0], s[1], s[2], s[3]
    if heads is None:
        raise RuleFailed("3D attention input without a head count")
    return s[0], heads, s[1], _heads_dim(ctx, s[2], heads)


@rule("Attention")
def attention(ctx: RuleContext) -> list[TensorInfo | None]:
    qh, kvh = ctx.attr("q_num_heads"), ctx.attr("kv_num_heads")
    b, hq, sq, d = _to_4d(ctx, 0, None if qh is None else int(qh))
    kb, hk, sk, dk = _to_4d(ctx, 1, None if kvh is None else int(kvh))
    vb, hv, sv, dv = _to_4d(ctx, 2, None if kvh is None else int(kvh))
    ctx.unify(b, kb)
    ctx.unify(d, dk)
    ctx.unify(sk, sv)
    total = sk
    if ctx.has(4):
        pk = ctx.shape(4)
        total = ctx.dim(ctx.e(pk[2]) + ctx.e(sk))
    dtype = ctx.dtype(0)
    q3 = len(ctx.shape(0)) == 3
    y = [b, sq, ctx.dim(ctx.e(hq) * ctx.e(dv))] if q3 else [b, hq, sq, dv]
    if ctx.has(3):
        ctx.broadcast([ctx.shape(3), (b, hq, sq, total)])  # the mask meets the scores: a chokepoint
    return [
        ctx.out(y, dtype),
        ctx.out([b, hk, total, dk], dtype),
        ctx.out([b, hv, total, dv], dtype),
        ctx.out([b, hq, sq, total], dtype),
    ]


@rule("MultiHeadAttention", domain=MS)
def multi_head_attention(ctx: RuleContext) -> list[TensorInfo | None]:
    nh = int(ctx.attr("num_heads"))
    q = ctx.shape(0)
    if len(q) != 3 or not ctx.has(1) or not ctx.has(2):
        raise RuleFailed("only [B, S, hidden] query with separate K and V is modelled")
    b, s, hidden = q
    k, v = ctx.shape(1), ctx.shape(2)
    if len(k) == 4:  # [B, N, L, H] used as is: no past concatenation
        return [ctx.out([b, s, ctx.dim(ctx.e(v[1]) * ctx.e(v[3]))], ctx.dtype(0))]
    head = _heads_dim(ctx, hidden, nh)
    vhead = _heads_dim(ctx, v[2], nh)
    length = k[1]
    if ctx.has(6):
        length = ctx.dim(ctx.e(ctx.shape(6)[2]) + ctx.e(k[1]))
    return [
        ctx.out([b, s, ctx.dim(ctx.e(vhead) * nh)], ctx.dtype(0)),
        ctx.out([b, nh, length, head], ctx.dtype(0)),
        ctx.out([b, nh, length, vhead], ctx.dtype(0)),
    ]


@rule("RotaryEmbedding", "MRotaryEmbedding", domain=MS)
@rule("RotaryEmbedding")
def rotary(ctx: RuleContext) -> list[TensorInfo | None]:
    return [ctx.out(ctx.shape(0), ctx.dtype(0))]


@rule("SimplifiedLayerNormalization", domain=MS)
@rule("SimplifiedLayerNormalization")
def simplified_norm(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = ctx.shape(0)
    axis = ctx.axis(int(ctx.attr("axis", -1)), len(shape))
    stat = [d if i < axis else 1 for i, d in enumerate(shape)]
    return [ctx.out(shape, ctx.dtype(0)), ctx.out(stat, FLOAT)]


@rule("SkipLayerNormalization", "SkipSimplifiedLayerNormalization", domain=MS)
def skip_norm(ctx: RuleContext) -> list[TensorInfo | None]:
    shape = ctx.broadcast([ctx.shape(0), ctx.shape(1)])
    stat = [*shape[:-1], 1]
    dtype = ctx.dtype(0)
    return [ctx.out(shape, dtype), ctx.out(stat, FLOAT), ctx.out(stat, FLOAT), ctx.out(shape, dtype)]


@rule("MoE", "QMoE", domain=MS)
def moe(ctx: RuleContext) -> list[TensorInfo | None]:
    return [ctx.out(ctx.shape(0), ctx.dtype(0))]


@rule("LinearAttentionGate", domain=MS)
def linear_attention_gate(ctx: RuleContext) -> list[TensorInfo | None]:
    shape, dtype = ctx.shape(0), ctx.dtype(0)
    return [ctx.out(shape, dtype), ctx.out(shape, dtype)]


@rule("MatMulNBits", domain=MS)
def matmul_nbits(ctx: RuleContext) -> list[TensorInfo | None]:
    a = ctx.shape(0)
    ctx.unify(a[-1], int(ctx.attr("K")))
    return [ctx.out([*a[:-1], int(ctx.attr("N"))], ctx.dtype(0))]


@rule("GatherBlockQuantized", domain=MS)
def gather_block_quantized(ctx: RuleContext) -> list[TensorInfo | None]:
    data, idx = ctx.shape(0), ctx.shape(1)
    axis = ctx.axis(int(ctx.attr("gather_axis", 0)), len(data))
    out = list(data[:axis]) + list(idx) + list(data[axis + 1 :])
    bits = int(ctx.attr("bits", 4))
    if data and ctx.dtype(0) == onnx.TensorProto.UINT8 and bits < 8:
        last = out[-1]
        out[-1] = ctx.dim(ctx.e(last) * (8 // bits))  # packed codes unpack along the last axis
    return [ctx.out(out, ctx.dtype(2))]


@rule("SwiGLU")
def swiglu(ctx: RuleContext) -> list[TensorInfo | None]:
    return [ctx.out(ctx.broadcast([ctx.shape(0), ctx.shape(1)]), ctx.dtype(0))]


@rule("DequantizeLinear")
def dequantize(ctx: RuleContext) -> list[TensorInfo | None]:
    dtype = int(ctx.attr("output_dtype", 0)) or (ctx.dtype(1) if ctx.has(1) else FLOAT)
    return [ctx.out(ctx.shape(0), dtype)]


@rule("QuantizeLinear")
def quantize(ctx: RuleContext) -> list[TensorInfo | None]:
    dtype = int(ctx.attr("output_dtype", 0)) or (ctx.dtype(2) if ctx.has(2) else onnx.TensorProto.UINT8)
    return [ctx.out(ctx.shape(0), dtype)]


@rule("DynamicQuantizeLinear")
def dynamic_quantize(ctx: RuleContext) -> list[TensorInfo | None]:
    u8 = onnx.TensorProto.UINT8
    return [ctx.out(ctx.shape(0), u8), ctx.out((), FLOAT), ctx.out((), u8)]
