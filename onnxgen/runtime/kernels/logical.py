"""Logical ops and comparisons of the default domain (outputs are bool tensors)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from onnxgen.runtime.kernels.common import NodeContext
from onnxgen.runtime.kernels.elementwise import as_bits, legacy_broadcast, to_ordered
from onnxgen.runtime.kernels.registry import kernel

Tensor = torch.Tensor


def _logical(op: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    def run(ctx: NodeContext, a: Tensor, b: Tensor) -> Tensor:
        return op(a, legacy_broadcast(ctx, a, b))

    return run


kernel("And")(_logical(torch.logical_and))
kernel("Or")(_logical(torch.logical_or))
kernel("Xor")(_logical(torch.logical_xor))


@kernel("Not")
def not_(ctx: NodeContext, x: Tensor) -> Tensor:
    return torch.logical_not(x)


@kernel("Equal")
def equal(ctx: NodeContext, a: Tensor | np.ndarray, b: Tensor | np.ndarray) -> Tensor:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):  # string tensors compare on the host
        result = np.equal(np.asarray(a, dtype=object), np.asarray(b, dtype=object)).astype(np.bool_)
        return torch.from_numpy(np.ascontiguousarray(result)).to(ctx.device)
    return torch.eq(as_bits(a), as_bits(legacy_broadcast(ctx, a, b)))  # equality only sees bit patterns


def _ordered_compare(op: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    def run(ctx: NodeContext, a: Tensor, b: Tensor) -> Tensor:
        return op(to_ordered(a), to_ordered(legacy_broadcast(ctx, a, b)))

    return run


kernel("Greater")(_ordered_compare(torch.gt))
kernel("Less")(_ordered_compare(torch.lt))
kernel("GreaterOrEqual")(_ordered_compare(torch.ge))
kernel("LessOrEqual")(_ordered_compare(torch.le))
