"""A hybrid decoder's carried states after a prompt prefix, kept so that later prompts with that
prefix start from them instead of computing the prefix again.

A carried state (a Gated DeltaNet layer's conv and recurrent state) folds every token in for good:
unlike KV rows it cannot be cut back to a prefix. So a KV pool slot that holds a long shared system
prompt followed by one conversation serves another conversation only through its KV rows; the
states after the shared part must have been kept when they passed by. ``StateSnapshots`` keeps
them: ``entries`` snapshots, each the token ids it follows and a copy of every carried state of
one sequence, in buffers ``[entries, *state_shape]`` allocated once, at fixed addresses (a captured
step never sees them; taking and restoring one are plain copies issued between steps).

Which prefixes: the KV pool decides (kv_pool.py: where a new prompt stops sharing tokens with what
the pool holds); the batched decoder ends a prompt chunk there and hands the states over.

Invariants: an entry with ``prefixes[e]`` not None holds, in every buffer's row ``e``, the states
after exactly the tokens ``prefixes[e]``; no two entries have the same prefix; a full store drops
its least recently used entry (taken or restored longest ago) for a new one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

Zeros = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def _torch_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


class StateSnapshots:
    """``entries`` (>= 1) snapshots of the states named by ``shapes`` (past input name -> one
    sequence's state shape), ``dtype`` on ``device``; ``zeros`` makes each buffer (the KV pool
    passes its allocator, whose CPU memory becomes resident as entries are written)."""

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        entries: int,
        dtype: torch.dtype,
        device: torch.device,
        zeros: Zeros = _torch_zeros,
    ) -> None:
        if entries < 1:
            raise ValueError(f"a state snapshot store needs at least 1 entry, got {entries}")
        self.buffers: dict[str, torch.Tensor] = {
            name: zeros((entries, *shape), dtype, device) for name, shape in shapes.items()
        }
        self.prefixes: list[list[int] | None] = [None] * entries
        self._used_at = [0] * entries
        self._clock = 0
        self.hits = 0  # snapshots restored into a slot, over the store's life
        self.takes = 0  # snapshots taken

    @property
    def entries(self) -> int:
        return len(self.prefixes)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def longest(self, prompt_ids: list[int], limit: int) -> tuple[int | None, int]:
        """(entry, length) of the snapshot whose prefix is the longest prefix of ``prompt_ids`` of at
        most ``limit`` tokens; (None, 0) when there is none."""
        best, length = None, 0
        for entry, prefix in enumerate(self.prefixes):
            n = len(prefix) if prefix is not None else 0
            if length < n <= limit and prompt_ids[:n] == prefix:
                best, length = entry, n
        return best, length

    def holds(self, prefix: list[int]) -> bool:
        return any(p == prefix for p in self.prefixes)

    def take(self, prefix: list[int], states: Mapping[str, torch.Tensor]) -> int:
        """Keeps ``states`` (name -> one sequence's state, after exactly ``prefix``) as the snapshot
        of ``prefix``, in place of the least recently used entry (or of one for the same prefix);
        returns its entry."""
        same = [e for e, p in enumerate(self.prefixes) if p == prefix]
        entry = same[0] if same else min(range(self.entries), key=self._rank)
        for name, buffer in self.buffers.items():
            buffer[entry].copy_(states[name])
        self.prefixes[entry] = list(prefix)
        self._touch(entry)
        self.takes += 1
        return entry

    def restore(self, entry: int, into: Mapping[str, torch.Tensor]) -> None:
        """Copies entry ``entry``'s states into ``into`` (name -> one sequence's state)."""
        if self.prefixes[entry] is None:
            raise ValueError(f"state snapshot {entry} holds nothing")
        for name, buffer in self.buffers.items():
            into[name].copy_(buffer[entry])
        self._touch(entry)
        self.hits += 1

    def _rank(self, entry: int) -> tuple[bool, int]:
        """Eviction order: empty entries first, then the least recently used."""
        return self.prefixes[entry] is not None, self._used_at[entry]

    def _touch(self, entry: int) -> None:
        self._clock += 1
        self._used_at[entry] = self._clock
