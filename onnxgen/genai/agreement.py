"""How far a path's logits are from a reference's over the same teacher-forced positions.

For each position, from the two logits rows (computed in float64):

- top-1 agreement: whether the path's argmax is the reference's;
- KL(reference || path): sum over the vocabulary of p_ref * (log p_ref - log p_path), from the
  log-softmax of each row, in nats (0 when the distributions are equal);
- at a disagreement, the reference's **margin** (its top-1 logit minus its top-2 logit) and its
  **gap** (its top-1 logit minus its logit for the path's token). The gap equals the margin where
  the path picked the reference's second choice and is larger otherwise. A disagreement is a
  **near-tie** when the gap is below the threshold: the reference itself barely prefers its token
  over the path's, so rounding can flip it. Else it is a real disagreement.

A path row that is not finite (NaN or infinite logits) counts as a real disagreement and is left
out of the KL figures (``non_finite`` counts it). A reference row that is not finite is refused:
such a reference cannot decide anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from onnxgen.errors import OnnxgenError


class ReferenceNotFiniteError(OnnxgenError):
    """The reference produced NaN or infinite logits: it cannot serve as a reference."""


@dataclass(frozen=True)
class Disagreement:
    """One position where the path's top-1 token is not the reference's."""

    context: int  # which context (prompt) of the run
    position: int  # index in that context of the last token seen; the prediction is for position + 1
    reference_token: int
    test_token: int  # -1 where the path's logits are not finite
    margin: float  # reference: top-1 logit - top-2 logit
    gap: float  # reference: its top-1 logit - its logit for the path's token (inf where not finite)
    near_tie: bool

    def as_dict(self) -> dict[str, object]:
        return {
            "context": self.context,
            "position": self.position,
            "reference_token": self.reference_token,
            "test_token": self.test_token,
            "reference_margin": round(self.margin, 6),
            "reference_gap": round(self.gap, 6) if math.isfinite(self.gap) else None,
            "near_tie": self.near_tie,
        }


@dataclass
class Agreement:
    """Running totals over the positions compared so far (``add`` one context's rows at a time)."""

    near_tie: float
    positions: int = 0
    agreed: int = 0
    non_finite: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    disagreements: list[Disagreement] = field(default_factory=list)

    def add(self, context: int, first_position: int, reference: torch.Tensor, test: torch.Tensor) -> None:
        """Rows [R, vocab] of ``reference`` and ``test`` for positions first_position .. first_position + R - 1."""
        if reference.shape != test.shape or reference.dim() != 2:
            raise ValueError(f"logits of shapes {list(reference.shape)} and {list(test.shape)} cannot be compared")
        ref = reference.to(torch.float64)
        path = test.to(torch.float64)
        bad_ref = ~torch.isfinite(ref).all(dim=1)
        if bad_ref.any():
            row = int(bad_ref.nonzero()[0])
            raise ReferenceNotFiniteError(
                f"the reference's logits are not finite (NaN or infinite) at position {first_position + row} of "
                f"context {context}; it cannot serve as a reference"
            )
        finite = torch.isfinite(path).all(dim=1)
        top2 = torch.topk(ref, 2, dim=1)
        # both tops by argmax (the first of equal maxima): topk breaks an exact tie otherwise, so
        # identical rows would count as a disagreement of gap 0
        ref_top = torch.argmax(ref, dim=1)
        margin = top2.values[:, 0] - top2.values[:, 1]
        path_top = torch.argmax(torch.where(finite[:, None], path, torch.zeros_like(path)), dim=1)
        log_ref = torch.log_softmax(ref, dim=1)
        log_path = torch.log_softmax(path, dim=1)
        kl = (log_ref.exp() * (log_ref - log_path)).sum(dim=1)
        self.positions += ref.shape[0]
        ok = finite.nonzero().flatten()
        self.non_finite += int((~finite).sum())
        if ok.numel():
            self.kl_sum += float(kl[ok].sum())
            self.kl_max = max(self.kl_max, float(kl[ok].max()))
        agree = finite & (path_top == ref_top)
        self.agreed += int(agree.sum())
        for row in (~agree).nonzero().flatten().tolist():
            if finite[row]:
                token = int(path_top[row])
                gap = float(ref[row, ref_top[row]] - ref[row, token])
            else:
                token, gap = -1, math.inf
            self.disagreements.append(
                Disagreement(
                    context=context, position=first_position + row, reference_token=int(ref_top[row]),
                    test_token=token, margin=float(margin[row]), gap=gap, near_tie=gap < self.near_tie,
                )
            )  # fmt: skip

    @property
    def top1_agreement(self) -> float:
        return self.agreed / self.positions if self.positions else 1.0

    @property
    def kl_mean(self) -> float:
        scored = self.positions - self.non_finite
        return self.kl_sum / scored if scored else 0.0

    @property
    def near_ties(self) -> int:
        return sum(d.near_tie for d in self.disagreements)

    @property
    def real_disagreements(self) -> int:
        return len(self.disagreements) - self.near_ties
