"""NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (opsets 12/13/22).

Both reduce to torch's nll_loss, whose weighting and ignore_index rules are the spec's:
'mean' divides by the summed weights of the counted (not ignored) samples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.registry import implements

# torch needs some ignore_index; -100 can never be a valid class label
_NO_IGNORE = -100


def _nll(ctx: NodeContext, log_prob: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    reduction = str(ctx.attr("reduction", "mean"))
    if reduction not in ("none", "sum", "mean"):
        raise ctx.fail(f"unknown reduction {reduction!r}")
    ignore_index = ctx.attr("ignore_index")
    ignore = _NO_IGNORE if ignore_index is None else int(ignore_index)
    work = log_prob if log_prob.dtype in (torch.float32, torch.float64) else log_prob.float()
    w = None if weight is None else weight.to(work.dtype)
    loss = F.nll_loss(work, target.long(), weight=w, ignore_index=ignore, reduction=reduction)
    return loss.to(log_prob.dtype)


@implements("NegativeLogLikelihoodLoss", since=12)
def negative_log_likelihood_loss(
    ctx: NodeContext, x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    return _nll(ctx, x, target, weight)


@implements("SoftmaxCrossEntropyLoss", since=12)
def softmax_cross_entropy_loss(
    ctx: NodeContext, scores: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    log_prob = torch.log_softmax(scores, dim=1)
    loss = _nll(ctx, log_prob, labels, weights)
    if ctx.num_outputs > 1:
        return loss, log_prob
    return loss
