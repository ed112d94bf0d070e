"""KV rows for many sequences at once: one slot per running sequence, allocated at start, at fixed
addresses, and the prompt prefixes the slots still hold.

Layout: per past key/value input, one buffer [slots, kv_heads, capacity, head_size]. Slot ``s``
is ``buffer[s]``; a sequence decodes in one slot from admission to retirement, so its KV is never
copied when others come and go, and a batched step over slots [lo, hi) feeds the views
``buffer[lo:hi]`` (views, no copy: GroupQueryAttention writes each entry's new row in place at
that entry's length, read from its mask row). An idle slot inside a batched step writes its dummy
row just past what it holds (batched.py), so its held rows stay valid.

Prefix reuse: a slot keeps the token ids whose KV rows it holds (``contents``) after its sequence
retires. A new sequence takes the free slot that already holds the longest prefix of its prompt,
or copies that prefix's rows from a busy slot that holds a longer one (two requests with the same
system prompt in flight at once), and computes only the rest. A free slot holding nothing useful
is taken least recently used first, among the idle slots a batched step runs anyway first (they
cost nothing more). Rows are compared token by token (not in blocks), and at least one prompt
token is always computed (its logits give the first new token). A hybrid decoder's slot also
holds carried states, which cannot be cut back to a prefix: it is reused only for a prompt that
continues all it holds (a conversation's next turn), never copied from a busy slot.

Invariants: ``lengths[s] == len(contents[s]) <= capacity``; the rows [0, lengths[s]) of slot s
hold the KV of ``contents[s]``; a busy slot belongs to exactly one running sequence; where
``state_held[s]``, slot s's carried states are those after ``contents[s]``.
"""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch

from onnxgen.genai.package import PackageConfig


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU an anonymous memory map (zero pages the OS maps in as they are first
    written) with huge pages declined where the OS lets us, so that memory becomes resident with the
    rows written, 4 KiB at a time. torch.zeros writes every page at once: a pool sized for the whole
    context would be resident from the start, and with transparent huge pages each slot's rows of a
    head and layer would become resident 2 MiB at a time."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = torch.empty((), dtype=dtype).element_size()
    nbytes = max(1, math.prod(shape) * size)
    region = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        region.madvise(mmap.MADV_NOHUGEPAGE)
    flat = np.frombuffer(region, dtype=np.uint8, count=math.prod(shape) * size)  # holds the map alive
    return torch.from_numpy(flat).view(dtype).view(shape)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KVPool:
    """``slots`` sequences of at most ``capacity`` tokens each (prompt and generated tokens)."""

    kind = "pool"

    def __init__(
        self,
        config: PackageConfig,
        dtype: torch.dtype,
        device: torch.device,
        slots: int,
        capacity: int,
        *,
        prefix_caching: bool = True,
    ):
        if slots < 1 or capacity < 2:
            raise ValueError(f"a KV pool needs at least 1 slot of at least 2 tokens, got {slots} x {capacity}")
        self.config = config
        self.slots = slots
        self.capacity = capacity
        self.device = device
        self.prefix_caching = prefix_caching  # False: every prompt is computed whole
        shape = (slots, config.num_kv_heads, capacity, config.head_size)
        self.buffers: dict[str, torch.Tensor] = {}
        for layer in config.kv_layer_ids:
            self.buffers[config.past_key_name(layer)] = _zeros(shape, dtype, device)
            self.buffers[config.past_value_name(layer)] = _zeros(shape, dtype, device)
        # per carried state (its past input's name), one buffer [slots, *shape]: zeroed when a slot is
        # taken for a new prompt, written back after each step for the rows that ran (batched.py).
        # A state holds all of its slot's tokens, folded in for good: it is reused only whole, for
        # a prompt that continues everything the slot holds, and only while ``state_held[s]`` (no
        # step has written a dummy row into it since)
        self.states: dict[str, torch.Tensor] = {
            s.past: _zeros((slots, *s.shape), dtype, device) for s in config.carried
        }
        self.state_held = [True] * slots
        self.contents: list[list[int]] = [[] for _ in range(slots)]
        self.busy = [False] * slots
        self._used_at = [0] * slots  # a clock tick per acquire: least recently used first
        self._clock = 0
        self.reused_tokens = 0  # prompt tokens served from held rows, over the pool's life
        self.copied_tokens = 0  # of those, rows copied from a busy slot

    @property
    def lengths(self) -> list[int]:
        return [len(c) for c in self.contents]

    @property
    def free(self) -> int:
        return self.busy.count(False)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (*self.buffers.values(), *self.states.values()))

    def acquire(
        self, prompt_ids: list[int], step_range: range = range(0), *, lowest_first: bool = False
    ) -> tuple[int, int]:
        """(slot, rows reused) for a sequence with ``prompt_ids``: the slot's rows [0, reused) hold
        the KV of prompt_ids[:reused] (reused < len(prompt_ids)); the caller computes the rest.
        ``step_range``: the slots the running batch steps over now (idle ones there are preferred).
        ``lowest_first``: outside that range, the lowest free slot rather than the least recently
        used (captured steps span the slots from 0: low slots keep their bucket small).
        Raises RuntimeError when no slot is free (the caller admits only while ``free``)."""
        free = [s for s in range(self.slots) if not self.busy[s]]
        if not free:
            raise RuntimeError("no free KV slot")
        limit = len(prompt_ids) - 1 if self.prefix_caching else 0  # at least one prompt token is computed
        held = {s: self._held(s, prompt_ids, limit) for s in range(self.slots)}
        best_free = max(free, key=lambda s: (held[s], -self._used_at[s]))
        # a busy slot's states are past its tokens so far: only KV rows can be copied from one
        busy = [s for s in range(self.slots) if self.busy[s]] if not self.states else []
        best_busy = max(busy, key=lambda s: held[s], default=None)
        if held[best_free] > 0 and (best_busy is None or held[best_busy] <= held[best_free]):
            slot, reused = best_free, held[best_free]
        else:
            inside = [s for s in free if s in step_range]
            if inside or not lowest_first:
                slot = min(inside or free, key=lambda s: self._used_at[s])
            else:
                slot = min(free)
            reused = held[slot]
            if best_busy is not None and held[best_busy] > reused:
                reused = held[best_busy]
                self._copy_rows(best_busy, slot, reused)
                self.copied_tokens += reused
        self.contents[slot] = list(prompt_ids[:reused])
        if not reused:
            for state in self.states.values():
                state[slot].zero_()
        self.state_held[slot] = True
        self.busy[slot] = True
        self._clock += 1
        self._used_at[slot] = self._clock
        self.reused_tokens += reused
        return slot, reused

    def _held(self, slot: int, prompt_ids: list[int], limit: int) -> int:
        """Prompt rows slot ``slot`` could serve: its common prefix with the prompt (at most
        ``limit``); with carried states, all it holds or nothing."""
        shared = min(limit, common_prefix(self.contents[slot], prompt_ids))
        if self.states and (shared != len(self.contents[slot]) or not self.state_held[slot]):
            return 0
        return shared

    def release(self, slot: int) -> None:
        """The slot's sequence is over; its rows stay for later prompts with the same prefix."""
        self.busy[slot] = False

    def forget(self, slot: int) -> None:
        """The slot's rows no longer match its contents (a failed step): hold nothing."""
        self.contents[slot] = []

    def _copy_rows(self, source: int, target: int, rows: int) -> None:
        for buffer in self.buffers.values():
            buffer[target, :, :rows].copy_(buffer[source, :, :rows])

    def slot_feeds(self, slot: int) -> dict[str, torch.Tensor]:
        """The past inputs (KV and carried states) of a step of slot ``slot`` alone (a prompt chunk):
        [1, ...] views."""
        return self.range_feeds(slot, slot + 1)

    def range_feeds(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """The past inputs (KV and carried states) of a batched step over slots [lo, hi): views."""
        return {name: buffer[lo:hi] for name, buffer in (*self.buffers.items(), *self.states.items())}
