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
token is always computed (its logits give the first new token).

A hybrid decoder's slot also holds carried states, which cannot be cut back to a prefix. A prompt
reuses either a free slot whole (it continues all the slot holds, states included: a
conversation's next turn), or a prefix for which a state snapshot exists (state_snapshots.py) and
whose KV rows some slot, free or busy, still holds: the rows are taken or copied as above, the
states copied from the snapshot; whichever is longer. Snapshots are taken where prompts diverge:
a prompt that shares L tokens with what a slot or a snapshot holds, more than it can reuse, is to
leave a snapshot of its states after prompt[:L] (``snapshot_at``; the batched decoder ends a
prompt chunk there), so the first two conversations with one system prompt compute it and the
later ones start after it.

Invariants: ``lengths[s] == len(contents[s]) <= capacity``; the rows [0, lengths[s]) of slot s
hold the KV of ``contents[s]``; a busy slot belongs to exactly one running sequence; where
``state_held[s]``, slot s's carried states are those after ``contents[s]``; for a busy slot,
``snapshot_at[s]`` is 0 or a prompt length past what it reused, at most its prompt's length - 1.
"""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch

from onnxgen.genai.package import PackageConfig
from onnxgen.genai.state_snapshots import StateSnapshots

MIN_SNAPSHOT_TOKENS = 16  # a shorter shared prefix is not worth a prompt chunk's cut and a snapshot entry


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


def common_prefix(a: list[int], b: list[int], stride: int = 64) -> int:
    """How many leading ids ``a`` and ``b`` share. Compared ``stride`` ids at a time first (a list
    slice comparison runs in C), then id by id past the last equal stretch: every admission
    compares its prompt with each slot's contents and each snapshot's prefix."""
    n = min(len(a), len(b))
    i = 0
    while i + stride <= n and a[i : i + stride] == b[i : i + stride]:
        i += stride
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KVPool:
    """``slots`` sequences of at most ``capacity`` tokens each (prompt and generated tokens), and
    for a hybrid decoder up to ``state_snapshots`` snapshots of carried states (None: one per
    slot; 0, or ``prefix_caching`` off: none)."""

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
        state_snapshots: int | None = None,
    ):
        if slots < 1 or capacity < 2:
            raise ValueError(f"a KV pool needs at least 1 slot of at least 2 tokens, got {slots} x {capacity}")
        if state_snapshots is not None and state_snapshots < 0:
            raise ValueError(f"state_snapshots must be >= 0, got {state_snapshots}")
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
        # A state holds all of its slot's tokens, folded in for good: it is reused whole, for a
        # prompt that continues everything the slot holds, and only while ``state_held[s]`` (no
        # step has written a dummy row into it since); a prefix's states come from a snapshot
        self.states: dict[str, torch.Tensor] = {
            s.past: _zeros((slots, *s.shape), dtype, device) for s in config.carried
        }
        entries = slots if state_snapshots is None else state_snapshots
        self.snapshots: StateSnapshots | None = None
        if self.states and prefix_caching and entries:
            shapes = {s.past: tuple(s.shape) for s in config.carried}
            self.snapshots = StateSnapshots(shapes, entries, dtype, device, zeros=_zeros)
        self.state_held = [True] * slots
        self.snapshot_at = [0] * slots  # the prompt length after which a busy slot's states are kept (0: none)
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

    @property
    def snapshot_hits(self) -> int:
        """Prompts whose reused prefix's states came from a snapshot, over the pool's life."""
        return self.snapshots.hits if self.snapshots is not None else 0

    @property
    def snapshot_takes(self) -> int:
        """Snapshots taken, over the pool's life."""
        return self.snapshots.takes if self.snapshots is not None else 0

    def nbytes(self) -> int:
        held = sum(b.numel() * b.element_size() for b in (*self.buffers.values(), *self.states.values()))
        return held + (self.snapshots.nbytes() if self.snapshots is not None else 0)

    def acquire(
        self, prompt_ids: list[int], step_range: range = range(0), *, lowest_first: bool = False
    ) -> tuple[int, int]:
        """(slot, rows reused) for a sequence with ``prompt_ids``: the slot's rows [0, reused) hold
        the KV of prompt_ids[:reused] (reused < len(prompt_ids)), and for a hybrid decoder its
        states are those after them; the caller computes the rest (and, for a hybrid, keeps a
        snapshot at ``snapshot_at[slot]`` when that is set: ``keep_snapshot``).
        ``step_range``: the slots the running batch steps over now (idle ones there are preferred).
        ``lowest_first``: outside that range, the lowest free slot rather than the least recently
        used (captured steps span the slots from 0: low slots keep their bucket small).
        Raises RuntimeError when no slot is free (the caller admits only while ``free``)."""
        free = [s for s in range(self.slots) if not self.busy[s]]
        if not free:
            raise RuntimeError("no free KV slot")
        limit = len(prompt_ids) - 1 if self.prefix_caching else 0  # at least one prompt token is computed
        shared = [min(limit, common_prefix(c, prompt_ids)) for c in self.contents]
        if self.states:
            slot, reused = self._acquire_with_states(prompt_ids, free, shared, step_range, lowest_first)
        else:
            slot, reused = self._acquire_rows(free, shared, step_range, lowest_first)
        self.contents[slot] = list(prompt_ids[:reused])
        self.state_held[slot] = True
        self.busy[slot] = True
        self._clock += 1
        self._used_at[slot] = self._clock
        self.reused_tokens += reused
        return slot, reused

    def _acquire_rows(
        self, free: list[int], shared: list[int], step_range: range, lowest_first: bool
    ) -> tuple[int, int]:
        """A decoder without carried states: the free slot holding the longest prefix, or a fresh one
        with a busy slot's longer prefix copied in."""
        best_free = max(free, key=lambda s: (shared[s], -self._used_at[s]))
        busy = [s for s in range(self.slots) if self.busy[s]]
        best_busy = max(busy, key=lambda s: shared[s], default=None)
        if shared[best_free] > 0 and (best_busy is None or shared[best_busy] <= shared[best_free]):
            return best_free, shared[best_free]
        slot = self._fresh_slot(free, step_range, lowest_first)
        reused = shared[slot]
        if best_busy is not None and shared[best_busy] > reused:
            reused = shared[best_busy]
            self._copy_rows(best_busy, slot, reused)
            self.copied_tokens += reused
        return slot, reused

    def _acquire_with_states(
        self, prompt_ids: list[int], free: list[int], shared: list[int], step_range: range, lowest_first: bool
    ) -> tuple[int, int]:
        """A hybrid decoder (module docstring): a free slot reused whole, or a snapshot's prefix with
        its KV rows taken from the free slot holding them or copied from a busy one, whichever is
        longer; nothing else. Sets ``snapshot_at`` for the slot taken."""
        whole = {s: shared[s] for s in free if 0 < shared[s] == len(self.contents[s]) and self.state_held[s]}
        best_whole = max(whole, key=lambda s: (whole[s], -self._used_at[s]), default=None)
        entry, from_snapshot = None, 0
        if self.snapshots is not None:  # its KV rows must be held by some slot too
            entry, from_snapshot = self.snapshots.longest(prompt_ids, max(shared))
        if best_whole is not None and whole[best_whole] >= from_snapshot:
            slot, reused = best_whole, whole[best_whole]
        elif entry is not None:
            holding = [s for s in free if shared[s] >= from_snapshot]
            if holding:
                slot = max(holding, key=lambda s: (shared[s], -self._used_at[s]))
            else:
                slot = self._fresh_slot(free, step_range, lowest_first)
                source = max((s for s in range(self.slots) if self.busy[s]), key=lambda s: shared[s])
                self._copy_rows(source, slot, from_snapshot)
                self.copied_tokens += from_snapshot
            assert self.snapshots is not None
            self.snapshots.restore(entry, {name: state[slot] for name, state in self.states.items()})
            reused = from_snapshot
        else:
            slot, reused = self._fresh_slot(free, step_range, lowest_first), 0
            for state in self.states.values():
                state[slot].zero_()
        self.snapshot_at[slot] = self._divergence(prompt_ids, shared, reused)
        return slot, reused

    def _divergence(self, prompt_ids: list[int], shared: list[int], reused: int) -> int:
        """Where a prompt that reuses ``reused`` tokens is to leave a state snapshot (0: nowhere): the
        most tokens it shares with a slot or a snapshot (at most all but its last), if that is past
        ``reused``, at least MIN_SNAPSHOT_TOKENS, and not a snapshot's prefix already."""
        if self.snapshots is None:
            return 0
        limit = len(prompt_ids) - 1
        prefixes = [p for p in self.snapshots.prefixes if p is not None]
        point = max([*shared, *(min(limit, common_prefix(p, prompt_ids)) for p in prefixes)])
        if point <= reused or point < MIN_SNAPSHOT_TOKENS or self.snapshots.holds(prompt_ids[:point]):
            return 0
        return point

    def keep_snapshot(self, slot: int, prefix: list[int], states: dict[str, torch.Tensor]) -> None:
        """``states`` (name -> one sequence's state), those of slot ``slot``'s sequence after exactly
        ``prefix`` (its prompt up to ``snapshot_at[slot]``), kept as a snapshot."""
        assert self.snapshots is not None and len(prefix) == self.snapshot_at[slot]
        self.snapshots.take(prefix, states)
        self.snapshot_at[slot] = 0

    def _fresh_slot(self, free: list[int], step_range: range, lowest_first: bool) -> int:
        """A free slot for a prompt that reuses none of its rows: least recently used among the idle
        slots inside the running step, else among all (or the lowest, ``lowest_first``)."""
        inside = [s for s in free if s in step_range]
        if inside or not lowest_first:
            return min(inside or free, key=lambda s: self._used_at[s])
        return min(free)

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
