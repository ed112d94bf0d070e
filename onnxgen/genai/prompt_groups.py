"""Prompts computed together: where the batched decoder's steps are captured, the prompts waiting to
start run as groups, each group one batched step of the package's graph (batched.py).

A group is up to ``max_rows`` prompts, in arrival order, whose tokens still to compute (after the
prefix reused from the KV pool) fit in one chunk of the same padded size S: the next power of two
of at least ``min_size`` tokens. It runs at batch = the next power of two of its prompts (the rows
past them compute a one-token dummy prompt nobody reads), so that a few recordings serve every
group: one per (rows, S). Row b holds its reused prefix (copied in from its slot first) and its
new tokens at rows r_b .. r_b + S - 1 of a scratch cache of ``max_rows`` sequences at fixed
addresses; its mask has r_b + S ones, so GroupQueryAttention places and attends row b's chunk
at its own length, causal within the chunk: a prompt row never sees its padding. Each row's logits
are taken at its own last real row (RowSelect with a row per entry, runtime/row_select.py). The
rows are then copied into the sequences' slots, one index_copy per KV buffer. A graph with carried
states (a hybrid) also takes row b's states from the scratch cache's row b (zeros, or its slot's
when it continues all the slot holds) and stops them at row b's last real row (the state row input
of runtime/state_rows.py, fed the same per-row index as the logits'); its presents go to the slots
the same way (batched.py).

Why groups: a prompt alone is a step of S rows whose weights are read for those rows only; a group
reads them once for every prompt in it, and costs the host one graph launch and one feed copy
instead of one per prompt. The arithmetic of a group's matrix products may differ from a lone
prompt's by rounding (a GEMM over more rows may pick another kernel): docs/batching.md says so.
"""

from __future__ import annotations

import torch

from onnxgen.genai.graph_layout import position_feed
from onnxgen.genai.kv_cache import StaticKV

MAX_GROUP_ROWS = 32  # prompts per group at most (the scratch cache holds this many sequences)


def power_of_two_at_least(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def power_of_two_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


class GroupFeeds:
    """The persistent feeds of a group step of ``rows`` rows of ``size`` tokens over ``scratch``
    (its first ``rows`` sequences): the same tensors every time, so a recording uses them in place.
    One copy from the host per step (pinned on CUDA, two buffers used in turn: a copy from pageable
    memory would wait for the work already queued), the rest computed on the device. Several groups
    of one shape may run in one iteration, with nothing read back between them: before a host
    buffer is written again, the copy out of it last time is waited for (an event per buffer)."""

    def __init__(
        self,
        scratch: StaticKV,
        rows: int,
        size: int,
        *,
        input_ids: str,
        attention_mask: str,
        position_ids: str | None,
        position_streams: int = 0,
        row_inputs: tuple[str, ...] = (),
    ) -> None:
        if rows > scratch.batch:
            raise ValueError(f"a group of {rows} rows does not fit a scratch cache of {scratch.batch}")
        device = scratch.device
        self.rows, self.size = rows, size
        self.checked = False  # the session has checked these feeds (batched.py, once)
        self._host_len = rows * size + 3 * rows  # ids; starts; real lengths; slots
        pinned = device.type == "cuda"
        self._host = [torch.zeros(self._host_len, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]  # each buffer's last copy (CUDA)
        self._turn = 0
        self._staged = torch.zeros(self._host_len, dtype=torch.int64, device=device)
        self.ids = torch.zeros((rows, size), dtype=torch.int64, device=device)
        self.positions = torch.zeros((rows, size), dtype=torch.int64, device=device)
        self.mask = torch.zeros((rows, scratch.capacity), dtype=torch.int64, device=device)
        self.last = torch.zeros(rows, dtype=torch.int64, device=device)  # each row's last real row
        self.slots = torch.zeros(rows, dtype=torch.int64, device=device)  # each row's KV slot
        self._steps = torch.arange(size, dtype=torch.int64, device=device)
        self._keys = torch.arange(scratch.capacity, dtype=torch.int64, device=device)
        self._allowed = torch.zeros((rows, scratch.capacity), dtype=torch.bool, device=device)
        self.feeds: dict[str, torch.Tensor] = {input_ids: self.ids, attention_mask: self.mask}
        if position_ids:
            self.feeds[position_ids] = position_feed(self.positions, position_streams)
        self.feeds.update(dict.fromkeys(row_inputs, self.last))  # engine_model's row inputs: each row's last
        self.feeds.update({name: buffer[:rows] for name, buffer in scratch.buffers.items()})
        # a hybrid's carried states (none for other graphs): each row's states before its chunk
        self.feeds.update({name: buffer[:rows] for name, buffer in scratch.states.buffers.items()})

    def fill(self, chunks: list[list[int]], starts: list[int], slots: list[int]) -> dict[str, torch.Tensor]:
        """The feeds for a group whose row b computes the tokens ``chunks[b]`` (at most ``size``)
        after ``starts[b]`` rows it holds already, for slot ``slots[b]``; rows past the chunks are
        idle (a one-token dummy prompt at row 0)."""
        rows, size = self.rows, self.size
        count = len(chunks)
        if not 0 < count <= rows or len(starts) != count or len(slots) != count:
            raise ValueError(f"a group of {rows} rows got {count} chunks, {len(starts)} starts, {len(slots)} slots")
        if max(len(c) for c in chunks) > size or min(len(c) for c in chunks) < 1:
            raise ValueError(f"a group chunk must have 1 to {size} tokens")
        flat: list[int] = []
        for chunk in chunks:
            flat += chunk
            flat += [0] * (size - len(chunk))
        flat += [0] * ((rows - count) * size)
        idle = [0] * (rows - count)
        flat += starts + idle
        flat += [len(c) for c in chunks] + [1] * (rows - count)
        flat += slots + idle
        turn = self._turn
        self._turn ^= 1
        host, copied = self._host[turn], self._copied[turn]
        if copied is not None:
            copied.synchronize()
        host.copy_(torch.tensor(flat, dtype=torch.int64))
        self._staged.copy_(host, non_blocking=True)
        if self._staged.device.type == "cuda":
            event = self._copied[turn] = torch.cuda.Event()
            event.record()
        tokens = rows * size
        self.ids.copy_(self._staged[:tokens].view(rows, size))
        start = self._staged[tokens : tokens + rows]
        torch.add(start.view(rows, 1), self._steps, out=self.positions)
        torch.lt(self._keys, (start + size).view(rows, 1), out=self._allowed)
        self.mask.copy_(self._allowed)
        torch.sub(self._staged[tokens + rows : tokens + 2 * rows], 1, out=self.last)
        self.slots.copy_(self._staged[tokens + 2 * rows :])
        return self.feeds
