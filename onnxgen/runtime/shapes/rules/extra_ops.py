"""Shape rules for the recurrent-state ops (LinearAttention, CausalConvWithState, in the ONNX and
com.microsoft forms), the preview
FlexAttention, the ai.onnx.ml ops and TfIdfVectorizer (implementations in ops/linear_attention.py,
ops/flex_attention.py, ops/ml.py)."""

from __future__ import annotations

import numpy as np
import onnx

from onnxgen.runtime.shapes.context import RuleContext, RuleFailed
from onnxgen.runtime.shapes.rules import rule
from onnxgen.runtime.shapes.symbols import Dim
from onnxgen.runtime.shapes.tensor import TensorInfo

ML = "ai.onnx.ml"
TP = onnx.TensorProto


def _per_head(ctx: RuleContext, hidden: Dim, heads: int) -> Dim:
    q = ctx.e(hidden).exact_div(heads)
    if q is None:
        raise RuleFailed(f"{hidden} is not a multiple of {heads} heads")
    return ctx.dim(q)


@rule("LinearAttention")
def linear_attention(ctx: RuleContext) -> list[TensorInfo | None]:
    b, t, q_hidden = ctx.shape(0)
    hq, hkv = int(ctx.attr("q_num_heads")), int(ctx.attr("kv_num_heads"))
    d_k = _per_head(ctx, q_hidden, hq)
    d_v = _per_head(ctx, ctx.shape(2)[2], hkv)
    state_dtype = ctx.dtype(3) if ctx.has(3) else ctx.dtype(0)
    return [
        ctx.out([b, t, ctx.dim(ctx.e(d_v) * hq)], ctx.dtype(0)),
        ctx.out([b, hkv, d_k, d_v], state_dtype),
    ]


@rule("CausalConvWithState")
def causal_conv_with_state(ctx: RuleContext) -> list[TensorInfo | None]:
    b, c, _ = ctx.shape(0)
    k = ctx.shape(1)[2]
    return [ctx.out(ctx.shape(0), ctx.dtype(0)), ctx.out([b, c, ctx.dim(ctx.e(k) - 1)], ctx.dtype(0))]


@rule("LinearAttention", domain="com.microsoft")
def linear_attention_ms(ctx: RuleContext) -> list[TensorInfo | None]:
    """onnxruntime's form: one output head per query head, or per KV head under inverse GQA; with
    state_window W the state gains a leading axis of W."""
    b, t, q_hidden = ctx.shape(0)
    hq, hkv = int(ctx.attr("q_num_heads")), int(ctx.attr("kv_num_heads"))
    d_k = _per_head(ctx, q_hidden, hq)
    d_v = _per_head(ctx, ctx.shape(2)[2], hkv)
    window = int(ctx.attr("state_window", 0) or 0)
    state_dtype = ctx.dtype(3) if ctx.has(3) else ctx.dtype(0)
    state = [b, hkv, d_k, d_v]
    return [
        ctx.out([b, t, ctx.dim(ctx.e(d_v) * max(hq, hkv))], ctx.dtype(0)),
        ctx.out([window, *state] if window else state, state_dtype),
    ]


@rule("CausalConvWithState", domain="com.microsoft")
def causal_conv_with_state_ms(ctx: RuleContext) -> list[TensorInfo | None]:
    """onnxruntime's form: the carry holds (k - 1) * dilation positions, channels-first
    (B, C, L) or channels-last (B, L, d_1, ..., d_n); state_window W adds a leading axis of W."""
    x = ctx.shape(0)
    carry = ctx.dim((ctx.e(ctx.shape(1)[2]) - 1) * int(ctx.attr("dilation", 1) or 1))
    state = [x[0], carry, *x[2:]] if int(ctx.attr("channels_last", 0) or 0) else [x[0], x[1], carry]
    window = int(ctx.attr("state_window", 0) or 0)
    return [ctx.out(x, ctx.dtype(0)), ctx.out([window, *state] if window else state, ctx.dtype(0))]


@rule("FlexAttention", domain="ai.onnx.preview")
def flex_attention(ctx: RuleContext) -> list[TensorInfo | None]:
    b, hq, length, _ = ctx.shape(0)
    return [ctx.out([b, hq, length, ctx.shape(2)[3]], ctx.dtype(2))]


@rule("Binarizer", domain=ML)
def binarizer(ctx: RuleContext) -> list[TensorInfo | None]:
    return [ctx.out(ctx.shape(0), ctx.dtype(0))]


@rule("LabelEncoder", domain=ML)
def label_encoder(ctx: RuleContext) -> list[TensorInfo | None]:
    values = ctx.attr("values_tensor")
    if values is not None:
        dtype = values.data_type
    elif ctx.attr("values_strings") is not None:
        dtype = TP.STRING
    elif ctx.attr("values_int64s") is not None:
        dtype = TP.INT64
    else:
        dtype = TP.FLOAT
    return [ctx.out(ctx.shape(0), dtype)]


@rule("ArrayFeatureExtractor", domain=ML)
def array_feature_extractor(ctx: RuleContext) -> list[TensorInfo | None]:
    x = ctx.shape(0)
    count = ctx.dim(ctx.prod(ctx.shape(1)))
    lead = [1] if len(x) == 1 else list(x[:-1])
    return [ctx.out([*lead, count], ctx.dtype(0))]


@rule("TreeEnsemble", domain=ML)
def tree_ensemble(ctx: RuleContext) -> list[TensorInfo | None]:
    return [ctx.out([ctx.shape(0)[0], int(ctx.attr("n_targets"))], ctx.dtype(0))]


@rule("TfIdfVectorizer")
def tfidf_vectorizer(ctx: RuleContext) -> list[TensorInfo | None]:
    x = ctx.shape(0)
    width = int(np.max(ctx.attr("ngram_indexes"), initial=-1)) + 1
    return [ctx.out([x[0], width] if len(x) == 2 else [width], TP.FLOAT)]
