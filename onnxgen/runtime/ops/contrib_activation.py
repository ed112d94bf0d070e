"""com.microsoft GELU variants: FastGelu (tanh approximation), QuickGelu, BiasGelu (exact erf)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.registry import MS_DOMAIN, implements


def _with_bias(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias


@implements("FastGelu", domain=MS_DOMAIN)
def fast_gelu(ctx: NodeContext, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) is exactly torch's tanh-approximate GELU
    return F.gelu(_with_bias(x, bias), approximate="tanh")


@implements("QuickGelu", domain=MS_DOMAIN)
def quick_gelu(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    alpha = float(ctx.attr("alpha", 1.702))
    return x * torch.sigmoid(alpha * x)


@implements("BiasGelu", domain=MS_DOMAIN)
def bias_gelu(ctx: NodeContext, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(a + b)
