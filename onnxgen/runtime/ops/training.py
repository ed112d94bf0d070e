"""Optimizer steps of ai.onnx.preview.training (opset 1): Adagrad, Adam, Momentum.

Inputs are R (learning rate), T (update count) and then n tensors of each per-parameter group
(X..., G..., and the optimizer's state tensors). T decides branches, so it is read on the host.
"""

from __future__ import annotations

import math

import torch

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.common import ints
from onnxgen.runtime.ops.registry import implements

TRAINING_DOMAIN = "ai.onnx.preview.training"
_HOST_T = "branches on the update count T, read on the host"


def _groups(ctx: NodeContext, tensors: tuple[torch.Tensor, ...], count: int) -> list[tuple[torch.Tensor, ...]]:
    """Split X1..Xn, G1..Gn, ... into n tuples (X, G, ...)."""
    if len(tensors) % count:
        raise ctx.fail(f"expected a multiple of {count} tensor inputs after R and T, got {len(tensors)}")
    n = len(tensors) // count
    return [tuple(tensors[k * n + i] for k in range(count)) for i in range(n)]


def _rate(r: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return r.reshape(()).to(device=like.device, dtype=like.dtype)


@implements("Adagrad", domain=TRAINING_DOMAIN, since=1, host_inputs=(1,), capture=_HOST_T)
def adagrad(ctx: NodeContext, r: torch.Tensor, t: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    step = ints(t)[0]
    decay = float(ctx.attr("decay_factor", 0.0))
    eps = float(ctx.attr("epsilon", 1e-6))
    norm = float(ctx.attr("norm_coefficient", 0.0))
    xs, hs = [], []
    for x, g, h in _groups(ctx, tensors, 3):
        rate = _rate(r, x) / (1 + step * decay)
        g_reg = norm * x + g
        h_new = h + g_reg * g_reg
        xs.append(x - rate * g_reg / (torch.sqrt(h_new) + eps))
        hs.append(h_new)
    return (*xs, *hs)


@implements("Adam", domain=TRAINING_DOMAIN, since=1, host_inputs=(1,), capture=_HOST_T)
def adam(ctx: NodeContext, r: torch.Tensor, t: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    step = ints(t)[0]
    alpha = float(ctx.attr("alpha", 0.9))
    beta = float(ctx.attr("beta", 0.999))
    eps = float(ctx.attr("epsilon", 1e-6))
    norm = float(ctx.attr("norm_coefficient", 0.0))
    norm_post = float(ctx.attr("norm_coefficient_post", 0.0))
    # bias correction of the first and second moments, folded into the rate (not at T = 0)
    correction = math.sqrt(1 - beta**step) / (1 - alpha**step) if step > 0 else 1.0
    xs, vs, hs = [], [], []
    for x, g, v, h in _groups(ctx, tensors, 4):
        g_reg = norm * x + g
        v_new = alpha * v + (1 - alpha) * g_reg
        h_new = beta * h + (1 - beta) * (g_reg * g_reg)
        x_new = x - _rate(r, x) * correction * (v_new / (torch.sqrt(h_new) + eps))
        xs.append((1 - norm_post) * x_new)
        vs.append(v_new)
        hs.append(h_new)
    return (*xs, *vs, *hs)


@implements("Momentum", domain=TRAINING_DOMAIN, since=1, host_inputs=(1,), capture=_HOST_T)
def momentum(ctx: NodeContext, r: torch.Tensor, t: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    step = ints(t)[0]
    alpha = float(ctx.require("alpha"))
    beta = float(ctx.require("beta"))
    norm = float(ctx.require("norm_coefficient"))
    mode = str(ctx.require("mode"))
    if mode not in ("standard", "nesterov"):
        raise ctx.fail(f"unknown mode {mode!r}")
    beta_adjusted = beta if step > 0 else 1.0
    xs, vs = [], []
    for x, g, v in _groups(ctx, tensors, 3):
        rate = _rate(r, x)
        g_reg = norm * x + g
        v_new = alpha * v + beta_adjusted * g_reg
        if mode == "nesterov":
            xs.append(x - rate * (g_reg + alpha * v_new))
        else:
            xs.append(x - rate * v_new)
        vs.append(v_new)
    return (*xs, *vs)
