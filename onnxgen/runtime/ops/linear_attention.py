"""Recurrent-state ops of hybrid decoders (opset 27): LinearAttention and CausalConvWithState.

Both carry a fixed-size state from step to step instead of a growing KV cache, so their
shapes never mention the KV length: with fixed input shapes they are safe to record.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.registry import implements

_RULES = ("linear", "gated", "delta", "gated_delta")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, T, H*D) -> (B, H, T, D)."""
    b, t, hd = x.shape
    return x.reshape(b, t, num_heads, hd // num_heads).transpose(1, 2)


def _sequential(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's recurrence token by token (decode, and per-key-dim decay); output unscaled."""
    if g is not None:
        g = g.exp() if g.dim() == 4 else g.exp().unsqueeze(-1)  # (B, H, T, d_k or 1)
    outs = []
    for i in range(k.shape[2]):
        if g is not None:
            state = state * g[:, :, i].unsqueeze(-1)
        k_t, v_t = k[:, :, i], v[:, :, i]
        if beta is not None:
            retrieved = torch.einsum("bhdm,bhd->bhm", state, k_t)
            v_t = beta[:, :, i].unsqueeze(-1) * (v_t - retrieved)
        state = state + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
        # GQA: query head h reads KV head h // group, so the query heads are grouped per KV head
        outs.append(torch.einsum("bhgd,bhdm->bhgm", q[:, :, :, i], state))
    if not outs:  # T == 0: nothing read, state unchanged
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), state
    return torch.stack(outs, dim=3), state


def _chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence a chunk at a time (prefill), for no decay or a per-head scalar decay.

    Unrolled inside a chunk from its start state S0, with G the cumulative log decay:
      S_t = e^{G_t} S0 + sum_{j<=t} e^{G_t - G_j} k_j d_j^T,
    where the written values d_t are v_t (no delta rule) or, with the delta rule, the solution of
      d_t + beta_t sum_{j<t} e^{G_t - G_j} (k_t . k_j) d_j = beta_t (v_t - e^{G_t} S0^T k_t),
    a unit lower-triangular system. Outputs are q_t^T S_t. Equal to the token loop up to rounding,
    with a few large matmuls per chunk instead of several small kernels per token.
    """
    outs = []
    t = k.shape[2]
    for s in range(0, t, chunk):
        e = min(s + chunk, t)
        kc, vc, qc = k[:, :, s:e], v[:, :, s:e], q[:, :, :, s:e]
        n = e - s
        causal = torch.ones(n, n, dtype=torch.bool, device=k.device).tril()
        if g is not None:
            cum = g[:, :, s:e].cumsum(-1)  # (B, H, n)
            # e^{G_t - G_j} only where j <= t (there it is <= 1: no overflow)
            decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
            start_decay = cum.exp().unsqueeze(-1)  # (B, H, n, 1)
            end_decay = (cum[..., -1:] - cum).exp().unsqueeze(-1)  # e^{G_n - G_j}
            total = cum[..., -1].exp()[..., None, None]
        else:
            decay = causal.to(k.dtype).expand(*k.shape[:2], n, n)
            start_decay = end_decay = None
            total = None
        if beta is not None:
            from_start = kc @ state  # (B, H, n, d_v): S0^T k_t
            if start_decay is not None:
                from_start = from_start * start_decay
            bc = beta[:, :, s:e].unsqueeze(-1)  # (B, H|1, n, 1)
            lower = bc * (kc @ kc.transpose(-1, -2)) * decay.tril(-1)
            eye = torch.eye(n, dtype=k.dtype, device=k.device)
            written = torch.linalg.solve_triangular(
                eye + lower, bc * (vc - from_start), upper=False, unitriangular=True
            )
        else:
            written = vc
        # outputs: e^{G_t} q_t^T S0 + sum_{j<=t} e^{G_t - G_j} (q_t . k_j) d_j, per query group
        scores = (qc @ kc.unsqueeze(2).transpose(-1, -2)) * decay.unsqueeze(2)
        from_state = qc @ state.unsqueeze(2)
        if start_decay is not None:
            from_state = from_state * start_decay.unsqueeze(2)
        outs.append(from_state + scores @ written.unsqueeze(2))
        weighted = kc if end_decay is None else kc * end_decay
        state = (state if total is None else state * total) + weighted.transpose(-1, -2) @ written
    return torch.cat(outs, dim=3), state


@implements("LinearAttention", since=27)
def linear_attention(
    ctx: NodeContext,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_state: torch.Tensor | None = None,
    decay: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    rule = ctx.attr("update_rule", "gated_delta")
    hq, hkv = int(ctx.require("q_num_heads")), int(ctx.require("kv_num_heads"))
    if rule not in _RULES:
        raise ctx.fail(f"unknown update_rule {rule!r}")
    if hq <= 0 or hkv <= 0 or hq % hkv:
        raise ctx.fail(f"q_num_heads {hq} must be a positive multiple of kv_num_heads {hkv}")
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    if gated != (decay is not None):
        raise ctx.fail(f"update_rule {rule!r} {'needs' if gated else 'forbids'} the decay input")
    if delta != (beta is not None):
        raise ctx.fail(f"update_rule {rule!r} {'needs' if delta else 'forbids'} the beta input")

    b, t, _ = query.shape
    d_k = query.shape[-1] // hq
    d_v = value.shape[-1] // hkv
    group = hq // hkv
    scale = ctx.attr("scale", 0.0) or 1.0 / math.sqrt(d_k)
    f32 = torch.float32 if query.dtype != torch.float64 else torch.float64
    # the recurrence accumulates over every token: keep it in fp32 whatever the activations
    q = _heads(query, hq).to(f32).reshape(b, hkv, group, t, d_k)
    k = _heads(key, hkv).to(f32)
    v = _heads(value, hkv).to(f32)
    per_dim = decay is not None and decay.shape[-1] == hkv * d_k and decay.shape[-1] != hkv
    g = None  # log decay: per-head scalar (B, H_kv, T) or per-key-dim (B, H_kv, T, d_k)
    if decay is not None:
        g = _heads(decay, hkv).to(f32) if per_dim else decay.to(f32).transpose(1, 2)
    bt = beta.to(f32).transpose(1, 2) if beta is not None else None  # (B, H_kv|1, T)

    if past_state is not None:
        state = past_state.to(f32)
        state_dtype = past_state.dtype
    else:
        state = torch.zeros(b, hkv, d_k, d_v, dtype=f32, device=query.device)
        state_dtype = query.dtype
    if t > 1 and not per_dim:
        chunk = max(int(ctx.attr("chunk_size", 64)), 1)
        out, state = _chunked(q, k, v, g, bt, state, chunk)
    else:
        out, state = _sequential(q, k, v, g, bt, state)
    out = out * scale  # (B, H_kv, G, T, d_v)
    out = out.reshape(b, hq, t, d_v).transpose(1, 2).reshape(b, t, hq * d_v)
    return out.to(query.dtype), state.to(state_dtype)


@implements("CausalConvWithState", since=27)
def causal_conv_with_state(
    ctx: NodeContext,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    past_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    activation = ctx.attr("activation", "none")
    if activation not in ("none", "silu", "swish"):
        raise ctx.fail(f"unknown activation {activation!r}")
    batch, channels, length = x.shape
    k = weight.shape[-1]
    if past_state is None:
        past_state = x.new_zeros(batch, channels, k - 1)
    padded = torch.cat([past_state.to(x.dtype), x], dim=2)
    # depthwise conv in fp32 for half types: CPU half conv is slow or missing, and the sum over k
    # taps should not round at every step
    cd = torch.float32 if x.dtype in _LOW_PRECISION else x.dtype
    y = F.conv1d(padded.to(cd), weight.to(cd), None if bias is None else bias.to(cd), groups=channels)
    y = y.to(x.dtype)
    if activation != "none":
        y = F.silu(y.to(cd)).to(x.dtype)
    present = padded[:, :, padded.shape[2] - (k - 1) :]
    return y, present.contiguous()
