"""Mixture of experts (com.microsoft MoE): routing, each token's top-k expert FFNs and their
weighted sum, as onnxruntime-genai's builder writes it for MoE decoders.

Routing: softmax over each token's router logits, the top k experts, their probabilities
renormalized to sum to one where ``normalize_routing_weights`` is set. Expert e's FFN is
fc2_e(act(fc1_e(x))) (+ biases), with SwiGLU taking its gate and up halves from a fused fc1
(interleaved or concatenated) or from fc1 and fc3. Everything is computed in fp32 and rounded to
the tensor type once.

"gelu" is the tanh approximation, as onnxruntime's CPU kernel computes it.

Two ways to run the experts, the same arithmetic: where a call has at most as many (token, expert)
pairs as there are experts (a decode step: k pairs) each pair's weights are gathered on the device
by the routing indices, so nothing waits for the host and the shapes depend on the token count
alone (a decode step containing it can be recorded); with more (a prompt, a wide batched step) the
tokens are grouped by expert, one GEMM per expert that has tokens, which reads the routing on the
host: a recording that meets it fails, and the capture runtime quarantines the op and runs it
eagerly, saying so. A device-side grouped kernel would remove that seam; it is not built.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.registry import MS_DOMAIN, implements

_ACTIVATIONS = ("relu", "gelu", "silu", "swiglu", "identity")


def _activation(kind: str, h: torch.Tensor, up: torch.Tensor | None, alpha: float, beta: float, limit: float | None):
    if kind == "swiglu":
        assert up is not None
        if limit is not None:
            h = h.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
        return h * torch.sigmoid(alpha * h) * (up + beta)
    if kind == "relu":
        return F.relu(h)
    if kind == "gelu":
        return F.gelu(h, approximate="tanh")
    if kind == "silu":
        return F.silu(h)
    return h


@implements("MoE", domain=MS_DOMAIN)
def moe(
    ctx: NodeContext,
    x: torch.Tensor,
    router_probs: torch.Tensor,
    fc1_weights: torch.Tensor,
    fc1_bias: torch.Tensor | None = None,
    fc2_weights: torch.Tensor | None = None,
    fc2_bias: torch.Tensor | None = None,
    fc3_weights: torch.Tensor | None = None,
    fc3_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    kind = ctx.attr("activation_type", "relu")
    if kind not in _ACTIVATIONS:
        raise ctx.fail(f"activation_type {kind!r} is not one of {', '.join(_ACTIVATIONS)} (onnxgen's MoE)")
    if int(ctx.attr("use_sparse_mixer", 0)):
        raise ctx.fail("use_sparse_mixer (Phi-3.5-MoE's sparse mixer routing) is not implemented")
    if int(ctx.attr("swiglu_limit_after_activation", 0)):
        raise ctx.fail("swiglu_limit_after_activation (onnxruntime's CUDA-only clamp) is not implemented")
    if fc2_weights is None:
        raise ctx.fail("fc2_experts_weights is required")
    fusion = int(ctx.attr("swiglu_fusion", 0))
    if fusion not in (0, 1, 2):
        raise ctx.fail(f"swiglu_fusion must be 0, 1 or 2, got {fusion}")
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    experts = fc1_weights.shape[0]
    k = int(ctx.attr("k", 1))
    if router_probs.shape != (rows.shape[0], experts):
        raise ctx.fail(f"router_probs has shape {list(router_probs.shape)}; expected [{rows.shape[0]}, {experts}] "
                       "(one row per token, one column per expert)")  # fmt: skip
    if not 1 <= k <= experts:
        raise ctx.fail(f"k {k} must be between 1 and the {experts} experts")
    fused = kind == "swiglu" and fusion in (1, 2)
    if kind == "swiglu" and not fused and fc3_weights is None:
        raise ctx.fail("swiglu with swiglu_fusion 0 takes its up projection from fc3_experts_weights, which is missing")
    if fc1_weights.shape[-1] != hidden or fc2_weights.shape[0] != experts or fc2_weights.shape[1] != hidden:
        raise ctx.fail(f"expert weights fc1 {list(fc1_weights.shape)} and fc2 {list(fc2_weights.shape)} do not "
                       f"match hidden size {hidden} and {experts} experts")  # fmt: skip
    limit = ctx.attr("swiglu_limit", None)
    params = _Params(
        kind, fusion if fused else 0, float(ctx.attr("activation_alpha", 1.0)), float(ctx.attr("activation_beta", 0.0)),
        None if limit is None or math.isinf(float(limit)) else float(limit),
    )  # fmt: skip

    probs = torch.softmax(router_probs.float(), dim=-1)
    weights, chosen = probs.topk(k, dim=-1)  # (T, k)
    if int(ctx.attr("normalize_routing_weights", 0)):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    fc = (fc1_weights, fc1_bias, fc2_weights, fc2_bias, fc3_weights, fc3_bias)
    xf = rows.float()
    if rows.shape[0] * k <= experts:
        out = _gathered(xf, chosen, weights, fc, params)
    else:
        out = _grouped(xf, chosen, weights, fc, params)
    return out.to(x.dtype).reshape(x.shape)


class _Params:
    def __init__(self, kind: str, fusion: int, alpha: float, beta: float, limit: float | None):
        self.kind, self.fusion, self.alpha, self.beta, self.limit = kind, fusion, alpha, beta, limit

    def split(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fc1's output as (gate or the only half, up or None)."""
        if self.fusion == 1:  # [g0, l0, g1, l1, ...]
            return h[..., 0::2], h[..., 1::2]
        if self.fusion == 2:  # [g | l]
            half = h.shape[-1] // 2
            return h[..., :half], h[..., half:]
        return h, None


def _gathered(xf, chosen, weights, fc, p: _Params) -> torch.Tensor:
    """Each (token, expert) pair's weights gathered by index: no host read, fixed shapes."""
    w1, b1, w2, b2, w3, b3 = fc
    pairs = chosen.reshape(-1)  # (T * k)
    xk = xf.repeat_interleave(chosen.shape[1], dim=0)  # (T * k, H)
    h = torch.einsum("pfh,ph->pf", w1[pairs].float(), xk)
    if b1 is not None:
        h = h + b1[pairs].float()
    gate, up = p.split(h)
    if p.kind == "swiglu" and up is None:
        up = torch.einsum("pfh,ph->pf", w3[pairs].float(), xk)
        if b3 is not None:
            up = up + b3[pairs].float()
    a = _activation(p.kind, gate, up, p.alpha, p.beta, p.limit)
    y = torch.einsum("phf,pf->ph", w2[pairs].float(), a)
    if b2 is not None:
        y = y + b2[pairs].float()
    return (y.reshape(*chosen.shape, -1) * weights.unsqueeze(-1)).sum(dim=1)


def _grouped(xf, chosen, weights, fc, p: _Params) -> torch.Tensor:
    """Tokens grouped by expert: one GEMM per expert that any token chose (reads the routing)."""
    w1, b1, w2, b2, w3, b3 = fc
    out = torch.zeros_like(xf)
    token_of_pair = torch.arange(chosen.shape[0], device=xf.device).repeat_interleave(chosen.shape[1])
    flat_expert, flat_weight = chosen.reshape(-1), weights.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)
    counts = torch.bincount(flat_expert, minlength=w1.shape[0]).tolist()
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        pick = order[start : start + count]
        start += count
        tokens = token_of_pair[pick]
        xe = xf[tokens]
        h = xe @ w1[e].float().T
        if b1 is not None:
            h = h + b1[e].float()
        gate, up = p.split(h)
        if p.kind == "swiglu" and up is None:
            up = xe @ w3[e].float().T
            if b3 is not None:
                up = up + b3[e].float()
        y = _activation(p.kind, gate, up, p.alpha, p.beta, p.limit) @ w2[e].float().T
        if b2 is not None:
            y = y + b2[e].float()
        out.index_add_(0, tokens, y * flat_weight[pick].unsqueeze(-1))
    return out
