"""Rewrites of two small chains that onnxruntime-genai's builder writes around its contrib ops (its
Qwen3.5 export has both), from the graph's structure alone:

- Rotary casts: a half-precision x rotated in fp32 and cast back,

      y = Cast(RotaryEmbedding(Cast(x, to=FLOAT), positions, cos, sin), to=T)      (or MRotaryEmbedding)

  with x declared of type T (float16 or bfloat16), becomes the rotary op on x itself, output y: the
  op computes in fp32 from x and rounds once to x's type (contrib_attention.apply_rotary, and
  gpu/rotary.py likewise), so the values are the chain's exactly and two cast kernels per call are
  gone.
- Query scales: ``LinearAttention`` (com.microsoft) whose query is Mul(q, c), c a float scalar
  constant, and whose ``scale`` attribute is set (not 0, the 1/sqrt(d_k) default): the op reads q
  and takes scale * c. Its output is scale * S^T (c q), so one elementwise kernel per layer is gone;
  the query is no longer rounded to its type after the Mul, which moves results within that
  type's rounding.

Every intermediate value must be read by the chain alone (and be no graph output); otherwise the
chain stays as written.
"""

from __future__ import annotations

from typing import Any

import onnx
from onnx import helper

from onnxgen.runtime.fusion import DEFAULT_DOMAINS, node_attr
from onnxgen.runtime.fusion_hybrid import _Chains

MS = "com.microsoft"
_ROTARIES = ("RotaryEmbedding", "MRotaryEmbedding")
_HALVES = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def _declared_type(rewriter: Any, name: str) -> int | None:
    """The element type the graph declares for value ``name`` (an input, a value_info or an
    initializer), else None."""
    declared = next((t.elem_type for t in rewriter._declared_tensors(name) if t.elem_type), None)
    if declared is not None:
        return declared
    init = rewriter.inits.get(name)
    return init.data_type if init is not None else None


def fuse_rotary_casts(rewriter: Any) -> int:
    chains = _Chains(rewriter)
    index = {id(n): i for i, n in enumerate(rewriter.graph.node)}
    replace: dict[int, onnx.NodeProto | None] = {}
    count = 0
    for rotary in rewriter.graph.node:
        if rotary.op_type not in _ROTARIES or rotary.domain != MS or len(rotary.output) != 1 or not rotary.input:
            continue
        up = chains.op(rotary.input[0], "Cast")
        if up is None or chains.sole(rotary.input[0]) is not rotary or node_attr(up, "to") != onnx.TensorProto.FLOAT:
            continue
        down = chains.sole(rotary.output[0])
        if down is None or down.op_type != "Cast" or down.domain not in DEFAULT_DOMAINS:
            continue
        target = node_attr(down, "to")
        if target not in _HALVES or _declared_type(rewriter, up.input[0]) != target:
            continue
        fused = helper.make_node(rotary.op_type, [up.input[0], *rotary.input[1:]], [down.output[0]],
                                 name=f"{rotary.name}/in_input_dtype", domain=MS)  # fmt: skip
        fused.attribute.extend(rotary.attribute)
        replace[index[id(up)]] = None
        replace[index[id(rotary)]] = fused  # x, the positions and the caches exist there
        replace[index[id(down)]] = None
        count += 1
    rewriter._apply(replace)
    return count


def fold_query_scales(rewriter: Any) -> int:
    chains = _Chains(rewriter)
    index = {id(n): i for i, n in enumerate(rewriter.graph.node)}
    replace: dict[int, onnx.NodeProto | None] = {}
    count = 0
    for attention in rewriter.graph.node:
        if attention.op_type != "LinearAttention" or attention.domain != MS or not attention.input:
            continue
        scale = float(node_attr(attention, "scale", 0.0))
        mul = chains.op(attention.input[0], "Mul")
        if not scale or mul is None or chains.sole(attention.input[0]) is not attention or len(mul.input) != 2:
            continue
        for side in (0, 1):
            factor = chains.float_scalar(mul.input[side])
            if factor is not None and mul.input[1 - side] != mul.input[side]:
                break
        else:
            continue
        attention.input[0] = mul.input[1 - side]
        for attr in attention.attribute:
            if attr.name == "scale":
                attr.f = scale * factor
        replace[index[id(mul)]] = None
        count += 1
    rewriter._apply(replace)
    return count
