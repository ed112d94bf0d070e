"""ai.onnx.preview::FlexAttention: attention whose scores and probabilities pass through subgraphs.

score_mod / prob_mod are graph attributes (one rank-4 tensor in, one out) that run through the
executor like If/Loop bodies, so the node as a whole is not recorded into a CUDA graph.
"""

from __future__ import annotations

import math

import torch

from onnxgen.runtime.dtypes import ONNX_TO_TORCH
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.registry import implements

_SOFTMAX_TYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _modify(ctx: NodeContext, name: str, x: torch.Tensor) -> torch.Tensor:
    if name not in ctx.subgraphs:
        return x
    outs = ctx.run_subgraph(name, [x])
    if len(outs) != 1 or outs[0].shape != x.shape:
        raise ctx.fail(f"{name} must give one tensor of shape {tuple(x.shape)}")
    return outs[0].to(x.dtype)


@implements("FlexAttention", domain="ai.onnx.preview", since=1, capture="runs score_mod/prob_mod subgraphs")
def flex_attention(ctx: NodeContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ctx.fail("Q, K and V must be rank 4")
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ctx.fail(f"q heads {hq} must be a multiple of kv heads {hkv}")
    if hq != hkv:  # query head h uses KV head h // group (contiguous groups)
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    scale = ctx.attr("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    precision = ctx.attr("softmax_precision")
    if precision is not None:
        compute = ONNX_TO_TORCH[precision]
        if compute not in _SOFTMAX_TYPES:
            raise ctx.fail(f"softmax_precision {precision} is not a float type")
    else:
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    # sqrt(scale) on both Q and K (as the spec's reference does) keeps half-precision products in range
    root = math.sqrt(scale)
    scores = torch.matmul((q * root).to(compute), (k * root).to(compute).transpose(-1, -2))
    scores = _modify(ctx, "score_mod", scores)
    probs = torch.softmax(scores, dim=-1)
    probs = _modify(ctx, "prob_mod", probs)
    return torch.matmul(probs, v.to(compute)).to(v.dtype)
