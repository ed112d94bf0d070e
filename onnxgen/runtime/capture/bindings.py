"""Bindings: the persistent tensors at a segment's boundary, and the signature that guards a replay.

A recording reads its inputs from fixed addresses and writes its outputs to fixed addresses. Every
tensor that crosses into a segment therefore lives in a binding: either one the runtime owns (the
value is copied in before each replay) or an *adopted* one (the caller hands the very same tensor
every step, like StaticKV's buffers and mask, or an earlier segment's recorded output): then it is
used in place and must keep its signature (pointer, shape, dtype, stride), or the replay would
read the wrong memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

Signature = tuple[int, torch.Size, torch.dtype, tuple[int, ...], torch.device]


def signature(t: torch.Tensor) -> Signature:
    return (t.data_ptr(), t.shape, t.dtype, t.stride(), t.device)


@dataclass
class Binding:
    name: str
    tensor: torch.Tensor
    adopted: bool  # used in place (the caller's tensor or a recorded output), never copied into
    recorded: Signature  # the tensor's signature when the recording was made

    @classmethod
    def adopt(cls, name: str, value: torch.Tensor) -> Binding:
        return cls(name, value, True, signature(value))

    @classmethod
    def own(cls, name: str, value: torch.Tensor, device: torch.device) -> Binding:
        buffer = torch.empty(tuple(value.shape), dtype=value.dtype, device=device)
        buffer.copy_(value)
        return cls(name, buffer, False, signature(buffer))

    def mismatch(self, value: Any) -> str | None:
        """Why ``value`` cannot be served by this binding (None: it can)."""
        if not isinstance(value, torch.Tensor):
            return f"{self.name}: not a tensor"
        if self.adopted:
            # pointer, shape, dtype, stride: also catches the same tensor resized or re-pointed in place
            if signature(value) != self.recorded:
                return f"{self.name}: adopted tensor changed ({_describe(self.tensor)} -> {_describe(value)})"
            return None
        t = self.tensor
        if value.shape != t.shape or value.dtype != t.dtype:
            return f"{self.name}: shape/dtype changed ({_describe(t)} -> {_describe(value)})"
        return None

    def write(self, value: torch.Tensor) -> None:
        """Bring the binding up to date before a replay (a no-op for adopted bindings)."""
        if self.adopted or value.data_ptr() == self.tensor.data_ptr():
            return
        if tuple(value.shape) == tuple(self.tensor.shape):
            self.tensor.copy_(value)
        # else: only reachable with the guard disabled (tests): the replay reads stale memory,
        # exactly what a CUDA graph would do, and verify mode must notice


class Guard:
    """A segment's replay guard, precomputed: the bindings' expected signatures as one tuple.

    ``mismatch`` builds the same tuple from this step's values and compares it once (the per-binding
    calls were a visible part of a replayed step's host time). It is never weaker than
    ``Binding.mismatch``: the tuple holds each value's class plus, for an adopted binding, its full
    signature and, for an owned one, its shape and dtype, so equal tuples imply that every
    ``Binding.mismatch`` returns None. Any difference (or a value that is not a tensor) goes through
    the per-binding check, which decides and names the reason.
    """

    def __init__(self, bindings: dict[str, Binding]):
        self.names = list(bindings)
        self.bindings = list(bindings.values())
        self.adopted = [b.adopted for b in self.bindings]
        self.owned = [k for k, b in enumerate(self.bindings) if not b.adopted]
        self.expected = tuple(
            (b.tensor.__class__, *b.recorded) if b.adopted else (b.tensor.__class__, b.tensor.shape, b.tensor.dtype)
            for b in self.bindings
        )

    def mismatch(self, values: list[Any]) -> str | None:
        """Why the values (in ``names`` order) cannot be served (None: they can)."""
        try:
            current = tuple(
                [
                    (v.__class__, v.data_ptr(), v.shape, v.dtype, v.stride(), v.device)
                    if adopted
                    else (v.__class__, v.shape, v.dtype)
                    for adopted, v in zip(self.adopted, values)
                ]
            )
            if current == self.expected:
                return None
        except Exception:
            pass  # not a tensor, or not tensor-like: the per-binding check says why
        for binding, value in zip(self.bindings, values):
            why = binding.mismatch(value)
            if why is not None:
                return why
        return None


def _describe(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).replace('torch.', '')} @{t.data_ptr():#x}"
