"""The small gated ops of hybrid (Gated DeltaNet) decoders, onnxruntime contrib ops (com.microsoft):
GatedRMSNorm, GatedAdd and LinearAttentionGate.

Each replaces a chain of casts and elementwise ops that exporters write around the linear-attention
layers; the arithmetic follows onnxruntime's schema text: GatedRMSNorm and LinearAttentionGate
compute in fp32 whatever the tensor type and round once at the end; GatedAdd's plain form rounds
the product to the tensor type before the add, as separate Mul and Add would. Their shapes never
mention the KV length, so a decode step that contains them stays recordable.

Where Triton serves the device, GatedRMSNorm and LinearAttentionGate run as one kernel each
(gpu/gated_rms_norm.py, gpu/linear_attention_gate.py), the same fp32 arithmetic; the torch code
below stays the reference and the path everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onnxgen.runtime.gpu.launch import triton_serves
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.registry import MS_DOMAIN, implements

_GATE_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "sigmoid": torch.sigmoid}


@implements("GatedRMSNorm", domain=MS_DOMAIN)
def gated_rms_norm(ctx: NodeContext, x: torch.Tensor, scale: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Y = X * rsqrt(mean(X^2) + epsilon) * scale * activation(gate), the mean over each group of
    C = len(scale) trailing elements (a per-head norm on a packed [..., H * C] tensor)."""
    activation = ctx.attr("activation", "silu")
    if activation not in _GATE_ACTIVATIONS:
        raise ctx.fail(f"activation {activation!r} is not one of {', '.join(sorted(_GATE_ACTIVATIONS))}")
    eps = float(ctx.attr("epsilon", 1e-5))
    if scale.dim() != 1:
        raise ctx.fail(f"scale must be 1-D (C), got shape {list(scale.shape)}")
    groups = scale.shape[0]
    if x.dim() == 0 or groups == 0 or x.shape[-1] % groups:
        raise ctx.fail(f"X's last dimension must be a multiple of scale's length {groups}, got shape {list(x.shape)}")
    if gate.shape != x.shape:
        raise ctx.fail(f"gate must have X's shape {list(x.shape)}, got {list(gate.shape)}")
    if triton_serves(x):
        from onnxgen.runtime.gpu.gated_rms_norm import gated_rms_norm as kernel
        from onnxgen.runtime.gpu.gated_rms_norm import gated_rms_norm_applies

        if gated_rms_norm_applies(x, scale, gate, activation):
            return kernel(x, scale, gate, eps, activation)
    grouped = (*x.shape[:-1], x.shape[-1] // groups, groups)
    xf = x.float().reshape(grouped)
    inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    gated = _GATE_ACTIVATIONS[activation](gate.float().reshape(grouped))
    return (xf * inv * scale.float() * gated).reshape(x.shape).to(x.dtype)


@implements("GatedAdd", domain=MS_DOMAIN)
def gated_add(
    ctx: NodeContext, x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, gate_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain: X + (Y * gate) with gate [..., 1]; projected (gate_weight [K, 1]): the gate is
    sigmoid(gate . gate_weight) per row, each step rounded to bfloat16 (the schema defines it for
    bfloat16 only)."""
    if y.shape != x.shape:
        raise ctx.fail(f"Y must have X's shape {list(x.shape)}, got {list(y.shape)}")
    if gate.dim() != x.dim() or gate.shape[:-1] != x.shape[:-1]:
        raise ctx.fail(f"gate's leading dimensions must be X's {list(x.shape[:-1])}, got shape {list(gate.shape)}")
    if gate_weight is None:
        if gate.shape[-1] != 1:
            raise ctx.fail(f"without gate_weight the gate is one value per row ([..., 1]), got {list(gate.shape)}")
        return x + y * gate  # each op rounds to the tensor type, as Mul then Add
    if x.dtype != torch.bfloat16:
        raise ctx.fail(f"the projected form (gate_weight given) is defined for bfloat16 tensors, got {x.dtype}")
    if gate_weight.shape != (gate.shape[-1], 1):
        raise ctx.fail(f"gate_weight must have shape [{gate.shape[-1]}, 1], got {list(gate_weight.shape)}")
    bf16 = torch.bfloat16
    projected = (gate.float() @ gate_weight.float()).to(bf16)
    s = torch.sigmoid(projected.float()).to(bf16)
    return (x.float() + (y.float() * s.float()).to(bf16).float()).to(bf16)


@implements("LinearAttentionGate", domain=MS_DOMAIN)
def linear_attention_gate(
    ctx: NodeContext,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    decay_scale: torch.Tensor,
    b: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """decay = decay_scale * Softplus(a + dt_bias), beta = Sigmoid(b), in fp32, rounded once."""
    heads = a.shape[-1] if a.dim() else 0
    for name, tensor in (("dt_bias", dt_bias), ("decay_scale", decay_scale)):
        if tensor.shape != (heads,):
            raise ctx.fail(f"{name} must have shape [{heads}] (a's heads), got {list(tensor.shape)}")
    wanted = ctx.outputs_wanted or (True,) * ctx.num_outputs
    beta_in = None  # b, where the beta output is asked for (else b may be absent)
    if len(wanted) >= 2 and wanted[1]:
        if b is None:
            raise ctx.fail("the beta output needs the b input")
        if b.shape != a.shape:
            raise ctx.fail(f"b must have a's shape {list(a.shape)}, got {list(b.shape)}")
        beta_in = b
    if triton_serves(a):
        from onnxgen.runtime.gpu.linear_attention_gate import linear_attention_gate as kernel
        from onnxgen.runtime.gpu.linear_attention_gate import linear_attention_gate_applies

        if linear_attention_gate_applies(a, dt_bias, decay_scale, beta_in):
            decay, beta = kernel(a, dt_bias, decay_scale, beta_in)
            return (decay, beta) if ctx.num_outputs > 1 else decay
    decay = (decay_scale.float() * F.softplus(a.float() + dt_bias.float())).to(a.dtype)
    if beta_in is None:
        return (decay, None) if ctx.num_outputs > 1 else decay
    return decay, torch.sigmoid(beta_in.float()).to(beta_in.dtype)
