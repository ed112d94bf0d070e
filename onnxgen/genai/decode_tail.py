"""Decode's step tails (runtime/capture/tail.py): the next token, position and mask row, written
on the device at the end of the step, so a captured step feeds the next one by itself. GreedyTail
takes the argmax of the raw logits; SampledTail runs the whole sampling pipeline."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from onnxgen.genai.sampling import LogitsSampler, SamplerState, SamplingPlan, draw_token
from onnxgen.runtime import argmax_advance, device_kernels_available


def advance_position(pos: torch.Tensor, mask: torch.Tensor) -> None:
    """pos += 1 and mask[0, pos] <- 1 for the new pos (the last entry once the cache is full): the
    torch form of what the tails' kernels do after the token."""
    pos.add_(1)
    mask.view(-1).index_fill_(0, pos.view(-1).clamp(max=mask.shape[1] - 1), 1)


class _AdvancingTail:
    """What both tails share: the step's token-id and position feeds and its mask, which they
    advance, and optional pinned host tokens (see GreedyTail). ``extra``: further state tensors the
    tail advances (verify mode compares them all with an eager run's)."""

    def __init__(
        self,
        logits: str,
        vocab_size: int,
        ids: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        host_tokens: torch.Tensor | None = None,
        extra: Mapping[str, torch.Tensor] | None = None,
    ):
        name = type(self).__name__
        if ids.numel() != 1 or pos.numel() != 1 or mask.dim() != 2 or mask.shape[0] != 1:
            raise ValueError(
                f"{name} needs one token id, one position and a [1, capacity] mask; got ids "
                f"{list(ids.shape)}, pos {list(pos.shape)}, mask {list(mask.shape)}"
            )
        self.reads = (logits,)
        self.logits = logits
        self.vocab_size = vocab_size
        self._state = {"ids": ids, "pos": pos, "mask": mask, **(extra or {})}
        if host_tokens is not None and (host_tokens.dtype != torch.int64 or host_tokens.numel() != mask.shape[1] + 1):
            raise ValueError(f"host_tokens must be {mask.shape[1] + 1} int64 values (the capacity + 1)")
        self.host_tokens = host_tokens
        self.writes_host = host_tokens is not None and device_kernels_available(mask) and host_tokens.is_pinned()

    @staticmethod
    def host_tokens_for(capacity: int, device: torch.device) -> torch.Tensor | None:
        """Pinned host memory for the tokens of a ``capacity``-row cache, or None where the kernel
        cannot write it (a CPU device: there is no copy to save)."""
        if device.type != "cuda" or not device_kernels_available(torch.empty(0, device=device)):
            return None
        return torch.zeros(capacity + 1, dtype=torch.int64, pin_memory=True)

    def state(self) -> dict[str, torch.Tensor]:
        return self._state


class GreedyTail(_AdvancingTail):
    """After a one-token step: ``ids`` <- argmax of the logits row (its first ``vocab_size``
    entries), ``pos`` <- pos + 1, ``mask[0, pos]`` <- 1 for the new pos (the last entry once the
    cache is full). ids and pos are the step's [1, 1] int64 feeds, mask its [1, capacity] one; the
    host sets them before the first decode step of a generation, the tail from then on.

    ``host_tokens`` (see ``host_tokens_for``): pinned [capacity + 1] int64 host memory where the
    Triton kernel also stores each token at its new position, for the host to read after the step
    without a copy in the stream. Only the kernel does that, so ``writes_host`` says whether it is
    used; the host must otherwise copy the token (``ids``) as before."""

    def apply(self, outputs: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> None:
        row = outputs[self.logits][0, -1][: self.vocab_size]
        ids, pos, mask = state["ids"], state["pos"], state["mask"]
        if device_kernels_available(row) and row.is_contiguous():
            # verify mode's eager reference advances a copy of the state: it leaves the host tokens alone
            host = self.host_tokens if self.writes_host and state is self._state else None
            argmax_advance(row, ids, pos, mask, host)
            return
        torch.argmax(row, out=ids.view(()))
        advance_position(pos, mask)


class SampledTail(_AdvancingTail):
    """After a one-token step, what ``LogitsSampler.sample`` does between the steps, inside the
    step: penalties, temperature, top-k, top-p, min-p and the seeded Gumbel-max draw
    (sampling.process and sampling.pick) into ``ids``; the token counted for the penalties; then
    pos and the mask row as GreedyTail does.

    It is made for one ``SamplingPlan`` (the kernels and their shapes) and holds a SamplerState of
    its own, persistent, so one recording serves every generation with that plan: ``bind`` copies a
    generation's state (its parameter values, seed lanes, counts and draw counter) into it and hands
    the sampler this state, which the tail advances from then on. ``host_tokens``: as GreedyTail's,
    written where the fused kernel serves the device (``writes_host``)."""

    def __init__(
        self,
        logits: str,
        plan: SamplingPlan,
        state: SamplerState,
        vocab_size: int,
        ids: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        host_tokens: torch.Tensor | None = None,
    ):
        super().__init__(logits, vocab_size, ids, pos, mask, host_tokens, extra=state.tensors())
        self.plan = plan
        self.sampler_state = state

    def bind(self, sampler: LogitsSampler) -> None:
        """Continue ``sampler``'s generation: its state is copied into this tail's (in place, so the
        recordings stay valid), and the sampler works on the tail's state from now on."""
        if sampler.plan != self.plan:
            raise ValueError(f"this tail samples with {self.plan}, the sampler with {sampler.plan}")
        if sampler.state is not self.sampler_state:
            self.sampler_state.copy_(sampler.state)
            sampler.adopt(self.sampler_state)

    def apply(self, outputs: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> None:
        # verify mode's eager reference advances a copy of the state: it leaves the host tokens alone
        host = self.host_tokens if self.writes_host and state is self._state else None
        row = outputs[self.logits][0, -1]
        pos, mask = state["pos"], state["mask"]
        if not draw_token(self.plan, state, row, self.vocab_size, state["ids"].view(()), count=True,
                          advance=(pos, mask, host)):  # fmt: skip
            advance_position(pos, mask)
