"""Activation functions of the default domain; each keeps the input dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.registry import implements

Tensor = torch.Tensor


@implements("Relu")
def relu(ctx: NodeContext, x: Tensor) -> Tensor:
    return torch.relu(x)


@implements("Tanh")
def tanh(ctx: NodeContext, x: Tensor) -> Tensor:
    return torch.tanh(x)


@implements("Sigmoid")
def sigmoid(ctx: NodeContext, x: Tensor) -> Tensor:
    return torch.sigmoid(x)


@implements("LeakyRelu")
def leaky_relu(ctx: NodeContext, x: Tensor) -> Tensor:
    return F.leaky_relu(x, float(ctx.attr("alpha", 0.01)))


@implements("PRelu")
def prelu(ctx: NodeContext, x: Tensor, slope: Tensor) -> Tensor:
    if x.dtype in (torch.uint32, torch.uint64):  # never negative
        return x
    # slope broadcasts unidirectionally to x
    return torch.where(x < 0, x * slope, x).to(x.dtype)


@implements("Elu")
def elu(ctx: NodeContext, x: Tensor) -> Tensor:
    return F.elu(x, float(ctx.attr("alpha", 1.0)))


@implements("Selu")
def selu(ctx: NodeContext, x: Tensor) -> Tensor:
    alpha = float(ctx.attr("alpha", 1.67326319217681884765625))
    gamma = float(ctx.attr("gamma", 1.05070102214813232421875))
    return gamma * torch.where(x > 0, x, alpha * torch.expm1(x))


@implements("Celu")
def celu(ctx: NodeContext, x: Tensor) -> Tensor:
    return F.celu(x, float(ctx.attr("alpha", 1.0)))


@implements("Gelu")
def gelu(ctx: NodeContext, x: Tensor) -> Tensor:
    approximate = ctx.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise ctx.fail(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return F.gelu(x, approximate=approximate)


@implements("HardSigmoid")
def hard_sigmoid(ctx: NodeContext, x: Tensor) -> Tensor:
    alpha, beta = float(ctx.attr("alpha", 0.2)), float(ctx.attr("beta", 0.5))
    return torch.clamp(x * alpha + beta, 0.0, 1.0)


@implements("HardSwish")
def hard_swish(ctx: NodeContext, x: Tensor) -> Tensor:
    return F.hardswish(x)  # x * max(0, min(1, x / 6 + 0.5))


@implements("Mish")
def mish(ctx: NodeContext, x: Tensor) -> Tensor:
    return F.mish(x)


@implements("Softplus")
def softplus(ctx: NodeContext, x: Tensor) -> Tensor:
    return F.softplus(x)


@implements("Softsign")
def softsign(ctx: NodeContext, x: Tensor) -> Tensor:
    return F.softsign(x)


@implements("Swish")
def swish(ctx: NodeContext, x: Tensor) -> Tensor:
    alpha = float(ctx.attr("alpha", 1.0))
    return x * torch.sigmoid(x * alpha) if alpha != 1.0 else F.silu(x)


@implements("SwiGLU")
def swiglu(ctx: NodeContext, gate: Tensor, value: Tensor) -> Tensor:
    alpha = float(ctx.attr("alpha", 1.0))
    activated = gate * torch.sigmoid(gate * alpha) if alpha != 1.0 else F.silu(gate)
    return activated * value


@implements("ThresholdedRelu")
def thresholded_relu(ctx: NodeContext, x: Tensor) -> Tensor:
    alpha = float(ctx.attr("alpha", 1.0))
    return torch.where(x > alpha, x, torch.zeros_like(x))


@implements("Shrink")
def shrink(ctx: NodeContext, x: Tensor) -> Tensor:
    bias, lambd = float(ctx.attr("bias", 0.0)), float(ctx.attr("lambd", 0.5))
    # integer inputs with float attributes: compute in double, store back in the input type
    work = x if x.is_floating_point() else x.to(torch.float64)
    out = torch.where(work < -lambd, work + bias, torch.where(work > lambd, work - bias, torch.zeros_like(work)))
    return out.to(x.dtype)
