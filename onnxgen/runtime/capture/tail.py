"""A step tail: device work that follows the decode step and advances state the next step reads.

Greedy decode turns the step's logits into the next token id and moves the position and the
attention mask on by one row; done by the host between steps, that is a few eager kernels per
token outside the step's graph. Handed to ``CaptureRuntime.run(feeds, tail=...)``, it is recorded
into the step's last segment instead, so a replay leaves the next step's inputs ready and the host
only launches the graph (what gpt-fast and vLLM do by capturing the sampling).

A tail is not a pure function of the step: it overwrites its own state (which feeds the next step)
and must run exactly once per step. Recorders therefore run it only in the run they record, never
in a warm-up run (``commit`` of a segment function, recorder.py). Where the last unit of a step is
not a segment holding the tail's inputs, or a step runs eagerly, the runtime applies the tail
eagerly after the step: the same kernels, so the state is the same bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch


class StepTail(Protocol):
    reads: tuple[str, ...]  # the step outputs it reads

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors it advances in place (verify mode compares them with an eager run's)."""
        ...

    def apply(self, outputs: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> None:
        """Advance ``state`` (this tail's own, or verify mode's copy of it) from the step ``outputs``,
        in place, with capture-safe device work only (no host reads, no allocation that outlives it)."""
        ...
