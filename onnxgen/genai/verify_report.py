"""``onnxgen verify``'s result: the verdict, as a table for people or one JSON object for tools."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from onnxgen.genai.agreement import Agreement, Disagreement


@dataclass
class VerifyReport:
    package: str
    reference: str  # "fp32", "eager" or the reference package's directory
    reference_notes: str  # what the reference is, in words
    device: str
    path: str  # the path under test, in words
    contexts: list[list[int]]  # the recorded contexts: each prompt and the reference's greedy tokens
    prompt_lengths: list[int]
    all_positions: bool
    min_agreement: float
    max_kl: float | None
    allow_real: bool
    agreement: Agreement
    tokenizer: Any = None  # onnxgen.genai.tokenizer.Tokenizer, for the tokens' text (None: ids only)

    @property
    def failures(self) -> list[str]:
        """Why the check failed (empty: it passed)."""
        a = self.agreement
        reasons = []
        if a.top1_agreement < self.min_agreement:
            reasons.append(f"top-1 agreement {a.top1_agreement:.4f} is below --min-agreement {self.min_agreement}")
        if self.max_kl is not None and not a.kl_mean <= self.max_kl:
            reasons.append(f"mean KL divergence {a.kl_mean:.6f} is above --max-kl {self.max_kl}")
        if a.non_finite:
            reasons.append(f"{a.non_finite} position{'s' if a.non_finite > 1 else ''} with NaN or infinite logits")
        if a.real_disagreements and not self.allow_real:
            reasons.append(
                f"{a.real_disagreements} disagreement{'s' if a.real_disagreements > 1 else ''} where the reference "
                f"prefers its token by {a.near_tie} logits or more (not near-ties)"
            )
        return reasons

    @property
    def passed(self) -> bool:
        return not self.failures

    def _text(self, token: int) -> str | None:
        if self.tokenizer is None or token < 0:
            return None
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _disagreement(self, d: Disagreement) -> dict[str, Any]:
        entry = d.as_dict()
        if self.tokenizer is not None:
            entry["reference_text"] = self._text(d.reference_token)
            entry["test_text"] = self._text(d.test_token)
        return entry

    def as_dict(self) -> dict[str, Any]:
        a = self.agreement
        return {
            "package": self.package,
            "reference": self.reference,
            "reference_notes": self.reference_notes,
            "device": self.device,
            "path": self.path,
            "positions_scored": "prompt and generated" if self.all_positions else "generated",
            "positions": a.positions,
            "top1_agreement": a.top1_agreement,
            "kl_divergence_mean": a.kl_mean,
            "kl_divergence_max": a.kl_max,
            "non_finite_positions": a.non_finite,
            "near_tie_threshold": a.near_tie,
            "near_ties": a.near_ties,
            "real_disagreements": a.real_disagreements,
            "min_agreement": self.min_agreement,
            "max_kl": self.max_kl,
            "allow_real": self.allow_real,
            "passed": self.passed,
            "failures": self.failures,
            "disagreements": [self._disagreement(d) for d in a.disagreements],
            "contexts": [
                {"prompt_tokens": p, "token_ids": ids}
                for p, ids in zip(self.prompt_lengths, self.contexts, strict=True)
            ],
        }

    def table(self) -> str:
        a = self.agreement
        scored = "prompt and generated tokens" if self.all_positions else "generated tokens"
        tokens = sorted({len(c) - p for c, p in zip(self.contexts, self.prompt_lengths, strict=True)})
        lines = [
            f"package       {self.package}",
            f"path          {self.path}",
            f"reference     {self.reference}: {self.reference_notes}",
            f"contexts      {len(self.contexts)} (prompt + {', '.join(map(str, tokens))} reference tokens); "
            f"{a.positions} positions scored ({scored})",
            f"top-1 agree   {a.top1_agreement:.4f} ({a.agreed} / {a.positions})",
            f"KL(ref||pkg)  mean {a.kl_mean:.6f}  max {a.kl_max:.6f} nats",
            f"disagree      {len(a.disagreements)}: {a.near_ties} near-ties (reference gap < {a.near_tie} logits), "
            f"{a.real_disagreements} real",
        ]
        if a.non_finite:
            lines.append(f"non-finite    {a.non_finite} positions with NaN or infinite logits")
        if a.disagreements:
            lines.append("")
            lines.append(f"  {'ctx':>3} {'pos':>5}  {'reference':<24} {'package':<24} {'margin':>7} {'gap':>7}  kind")
            for d in a.disagreements:
                kind = "near-tie" if d.near_tie else "REAL"
                gap = f"{d.gap:7.3f}" if d.test_token >= 0 else "    n/a"
                lines.append(
                    f"  {d.context + 1:>3} {d.position:>5}  {self._label(d.reference_token):<24} "
                    f"{self._label(d.test_token):<24} {d.margin:7.3f} {gap}  {kind}"
                )
        lines.append("")
        verdict = "PASS" if self.passed else "FAIL: " + "; ".join(self.failures)
        lines.append(f"verdict       {verdict}")
        return "\n".join(lines)

    def _label(self, token: int) -> str:
        if token < 0:
            return "(non-finite)"
        text = self._text(token)
        label = f"{token} {text!r}" if text is not None else str(token)
        return label if len(label) <= 24 else label[:23] + "…"
