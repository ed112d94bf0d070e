"""FusedLinearAttention (onnxgen domain): LinearAttention with its query / key L2 norms and its
LinearAttentionGate folded in (runtime/fusion_delta_rule.py writes it).

Inputs: query_source, key_source, value, past_state, decay, beta, a, b, dt_bias, decay_scale, and
last_row (runtime/state_rows.py: the tokens after it keep the state).
Attributes: LinearAttention's, plus ``inner_domain`` ("" or "com.microsoft": which LinearAttention),
``qk_norm`` (0 none; 1 L2Normalize with ``qk_epsilon``; 2 LpNormalization p=2, a zero vector
staying zero) and ``qk_epsilon``. With a norm, the query is query_source normalised over its last
axis and read as [batch, tokens, -1] (batch and tokens from the value), the key likewise; with a
(gate folded) decay = decay_scale * softplus(a + dt_bias) and beta = sigmoid(b).

Where the sequential Gated DeltaNet kernel serves (gpu/gated_delta_decode.py: a step or a short
prompt, one norm group per head) it computes the norms and the gate per token itself, with the
arithmetic and roundings of the kernels it replaces (fp32, each value rounded once to its tensor's
dtype). Everywhere else the folded ops run first as they would unfused (the same functions), then
LinearAttention: results equal the unfused graph's there.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from onnxgen import options
from onnxgen.runtime.gpu.launch import triton_serves
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.contrib_gated import linear_attention_gate
from onnxgen.runtime.ops.fused import FUSED_DOMAIN, l2_normalize
from onnxgen.runtime.ops.linear_attention import (
    checked_last_row,
    chunked_kernel_takes,
    linear_attention,
    linear_attention_ms,
)
from onnxgen.runtime.ops.normalization import lp_normalization
from onnxgen.runtime.ops.registry import MS_DOMAIN, implements

_OWN_ATTRS = ("inner_domain", "qk_norm", "qk_epsilon")


@implements("FusedLinearAttention", domain=FUSED_DOMAIN)
def fused_linear_attention(
    ctx: NodeContext,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_state: torch.Tensor | None = None,
    decay: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    decay_scale: torch.Tensor | None = None,
    last_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    inner = ctx.attr("inner_domain", "")
    norm = int(ctx.attr("qk_norm", 0))
    if inner not in ("", MS_DOMAIN) or norm not in (0, 1, 2):
        raise ctx.fail(f"inner_domain {inner!r} / qk_norm {norm}: expected '' or {MS_DOMAIN!r} / 0, 1 or 2")
    gated = a is not None
    if gated and (dt_bias is None or decay_scale is None or decay is not None or beta is not None):
        raise ctx.fail("a folded gate takes a, dt_bias and decay_scale (and b) in place of decay and beta")
    if value.dim() != 3:
        raise ctx.fail(f"value must be [batch, tokens, heads * d_v], got shape {list(value.shape)}")
    eps = float(ctx.attr("qk_epsilon", 0.0))
    batch, tokens = value.shape[:2]
    last_row = checked_last_row(ctx, last_row, batch, tokens)
    if inner and (fast := _kernel(ctx, query, key, value, past_state, a, b, dt_bias, decay_scale, norm, eps,
                                  last_row)) is not None:  # fmt: skip
        return fast
    if norm:
        query = _normalize(ctx, query, norm, eps).reshape(batch, tokens, -1)
        key = _normalize(ctx, key, norm, eps).reshape(batch, tokens, -1)
    if gated:
        gate_ctx = dataclasses.replace(ctx, op_type="LinearAttentionGate", domain=MS_DOMAIN, attrs={},
                                       num_inputs=4, num_outputs=2, outputs_wanted=(True, b is not None))  # fmt: skip
        decay, beta = linear_attention_gate(gate_ctx, a, dt_bias, decay_scale, b)
    attrs = {k: v for k, v in ctx.attrs.items() if k not in _OWN_ATTRS}
    inner_ctx = dataclasses.replace(ctx, op_type="LinearAttention", domain=inner, attrs=attrs,
                                    num_inputs=6 if last_row is None else 7)  # fmt: skip
    run = linear_attention_ms if inner == MS_DOMAIN else linear_attention
    return run(inner_ctx, query, key, value, past_state, decay, beta, last_row)


def _normalize(ctx: NodeContext, x: torch.Tensor, norm: int, eps: float) -> torch.Tensor:
    """The folded norm as its own op computes it."""
    if norm == 1:
        return l2_normalize(dataclasses.replace(ctx, op_type="L2Normalize", attrs={"epsilon": eps}, num_inputs=1,
                                                num_outputs=1), x)  # fmt: skip
    return lp_normalization(dataclasses.replace(ctx, op_type="LpNormalization", domain="", attrs={"p": 2, "axis": -1},
                                                num_inputs=1, num_outputs=1), x)  # fmt: skip


def _kernel(ctx, query, key, value, past_state, a, b, dt_bias, decay_scale, norm: int, eps: float, last_row):
    """(output, present) from the sequential kernel with the prologues inside, or None where it does
    not serve (then the caller runs the ops one by one, which also reports malformed inputs). Only
    onnxruntime's LinearAttention form (com.microsoft, no state window) is folded into the kernel:
    both builders write that one."""
    from onnxgen.runtime.gpu.gated_delta_decode import MAX_SEQUENTIAL_TOKENS, gated_delta_prologue

    if not triton_serves(value) or int(ctx.attr("state_window", 0) or 0):
        return None
    batch, tokens, _ = value.shape
    opts = options.current()
    if not 1 <= tokens <= MAX_SEQUENTIAL_TOKENS or chunked_kernel_takes(tokens, opts):
        return None  # the chunked kernels' prompt (or the torch path's): the prologues run first
    if tokens > 1 and not opts.gdn_prompt_fold:
        return None  # the prologues as their own kernels, off the sequential kernel's chain of token steps
    if ctx.attr("update_rule", "gated_delta") != "gated_delta" or a is None or b is None:
        return None  # the kernel folds the gated delta rule's gate only
    hq, hkv = int(ctx.attr("q_num_heads", 0)), int(ctx.attr("kv_num_heads", 0))
    if hq <= 0 or hkv <= 0 or (hq % hkv and hkv % hq):
        return None
    q3 = query.reshape(batch, tokens, -1) if query.numel() else None
    k3 = key.reshape(batch, tokens, -1) if key.numel() else None
    if q3 is None or k3 is None or q3.shape[-1] % hq:
        return None
    d_k = q3.shape[-1] // hq
    if norm and (query.shape[-1] != d_k or key.shape[-1] != d_k):
        return None  # the norm groups are not the heads
    if a.shape != (batch, tokens, hkv) or b.shape != a.shape:
        return None
    if dt_bias.shape != (hkv,) or decay_scale.shape != (hkv,):
        return None
    scale = float(ctx.attr("scale", 0.0) or 0.0) or 1.0 / math.sqrt(d_k)
    return gated_delta_prologue(q3, k3, value, past_state, a, b, dt_bias, decay_scale, q_heads=hq, kv_heads=hkv,
                                scale=scale, norm=norm, eps=eps, last_row=last_row)  # fmt: skip
