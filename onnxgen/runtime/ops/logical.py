"""Logical ops and comparisons of the default domain (outputs are bool tensors)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.elementwise import as_bits, legacy_broadcast, to_ordered
from onnxgen.runtime.ops.registry import implements

Tensor = torch.Tensor


def _logical(op: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    def run(ctx: NodeContext, a: Tensor, b: Tensor) -> Tensor:
        return op(a, legacy_broadcast(ctx, a, b))

    return run


implements("And")(_logical(torch.logical_and))
implements("Or")(_logical(torch.logical_or))
implements("Xor")(_logical(torch.logical_xor))


@implements("Not")
def not_(ctx: NodeContext, x: Tensor) -> Tensor:
    return torch.logical_not(x)


@implements("Equal")
def equal(ctx: NodeContext, a: Tensor | np.ndarray, b: Tensor | np.ndarray) -> Tensor:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):  # string tensors compare on the host
        result = np.equal(np.asarray(a, dtype=object), np.asarray(b, dtype=object)).astype(np.bool_)
        return torch.from_numpy(np.ascontiguousarray(result)).to(ctx.device)
    return torch.eq(as_bits(a), as_bits(legacy_broadcast(ctx, a, b)))  # equality only sees bit patterns


def _ordered_compare(op: Callable[[Tensor, Tensor], Tensor]) -> Callable[..., Tensor]:
    def run(ctx: NodeContext, a: Tensor, b: Tensor) -> Tensor:
        return op(to_ordered(a), to_ordered(legacy_broadcast(ctx, a, b)))

    return run


implements("Greater")(_ordered_compare(torch.gt))
implements("Less")(_ordered_compare(torch.lt))
implements("GreaterOrEqual")(_ordered_compare(torch.ge))
implements("LessOrEqual")(_ordered_compare(torch.le))
