"""What capture did during a run: segments per step, recordings, replays, invalidations, seams."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CaptureStats:
    mode: str = "off"  # "on" | "off" | "verify"
    steps: int = 0  # steps run through the capture runtime
    eager_steps: int = 0  # ... of which ran fully eager (warm-up, unsupported, failed recording)
    captured_steps: int = 0  # ... of which recorded or replayed at least one segment
    captures: int = 0  # segment recordings
    replays: int = 0  # segment replays
    invalidations: int = 0  # binding-signature mismatches (never replayed)
    recording_failures: int = 0
    verified_steps: int = 0  # steps checked bit for bit against eager (verify mode)
    keys: int = 0  # binding keys seen
    segments_per_step: int = 0  # of the plan of the most recent key
    seams_per_step: int = 0  # eager + host seams of that plan (folded shape arithmetic not counted)
    seam_reasons: Counter[str] = field(default_factory=Counter)  # reason -> seams per step (latest plan)
    invalidation_reasons: Counter[str] = field(default_factory=Counter)
    quarantined: dict[str, str] = field(default_factory=dict)  # op type -> what broke
    unsupported: dict[str, str] = field(default_factory=dict)  # key -> why it stays eager
    tail: str = ""  # where the step tail ran, for the latest plan with one ("in the graph" or "eager: why")
    what: str = "decode steps"  # what one run is, in the summary (a prefill's runtime: "prefill chunks")

    def note_plan(self, segments: int, reasons: list[str]) -> None:
        self.segments_per_step = segments
        self.seams_per_step = len(reasons)
        self.seam_reasons = Counter(reasons)

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["seam_reasons"] = dict(self.seam_reasons)
        out["invalidation_reasons"] = dict(self.invalidation_reasons)
        return out

    def summary(self) -> str:
        if self.mode == "off" and not self.steps:
            return "capture off: every decode step ran eagerly (CUDA graphs need --device cuda)"
        lines = [
            f"capture {self.mode}: {self.steps} {self.what} ({self.captured_steps} captured, "
            f"{self.eager_steps} eager), {self.segments_per_step} segment(s) and {self.seams_per_step} seam(s) "
            f"per step, {self.captures} capture(s), {self.replays} replay(s), {self.invalidations} invalidation(s)"
        ]
        if self.tail:
            lines.append(f"  step tail (next token, position, mask row): {self.tail}")
        if self.verified_steps:
            lines.append(f"  verified bit-identical to eager: {self.verified_steps} step(s)")
        for reason, n in self.seam_reasons.most_common():
            lines.append(f"  seam x{n}: {reason}")
        for reason, n in self.invalidation_reasons.most_common():
            lines.append(f"  invalidated x{n}: {reason}")
        for op, why in self.quarantined.items():
            lines.append(f"  quarantined {op}: {why}")
        for key, why in self.unsupported.items():
            lines.append(f"  eager for key {key}: {why}")
        return "\n".join(lines)
