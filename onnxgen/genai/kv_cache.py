"""KV state between decode steps.

- ``DynamicKV``: present outputs are fed back as the next step's past (the cache grows).
- ``GrowingKV``: the CPU form of a dynamic cache for graphs whose past inputs go straight into
  GroupQueryAttention. The past fed is a buffer with room to spare (capacity >= the step's total
  length), so the op writes the new rows in place and attends over the valid length only (the
  mask is as wide as the valid length, so total_sequence_length is that length, not the
  capacity). When a step would not fit, the buffer is reallocated with twice the room and the
  valid rows copied once: amortised O(1) copy per token, where DynamicKV's present = cat(past,
  new) copies the whole cache every step (and holds two caches while it does).
- ``StaticKV``: fixed-capacity buffers updated in place by the attention op, a fixed-width
  attention mask (ones up to the valid length) and so a device-side valid length (seqlens_k
  is derived from the mask inside the graph). Shapes never change between decode steps, which
  is what lets a whole decode step be captured.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from onnxgen.genai.package import PackageConfig

_GQA = "GroupQueryAttention"
_MS_DOMAIN = "com.microsoft"


def past_feeds_attention_in_place(graph: Any, config: PackageConfig) -> bool:
    """Whether every past key/value input of ``graph`` (an onnx GraphProto) is read only by
    GroupQueryAttention as its past_key/past_value (inputs 3 and 4), without a sliding-window
    cache. Such an op accepts a past buffer longer than the step's total length and writes the
    new rows into it (the shared-buffer layout, contrib_attention.py): what GrowingKV relies on.
    A graph that concatenates past and new rows itself (the standard layout) would read the
    spare rows as history, so it keeps DynamicKV."""
    wanted: dict[str, int] = {}
    for layer in config.kv_layer_ids:
        wanted[config.past_key_name(layer)] = 3
        wanted[config.past_value_name(layer)] = 4
    seen: set[str] = set()
    for node in graph.node:
        for position, name in enumerate(node.input):
            if name not in wanted:
                continue
            if node.op_type != _GQA or node.domain != _MS_DOMAIN or position != wanted[name]:
                return False
            if any(a.name == "sliding_window_cache" and a.i for a in node.attribute):
                return False
            seen.add(name)
    return seen == set(wanted)


class CarriedStates:
    """The fixed-size states a hybrid decoder carries beside its KV cache (PackageConfig.carried):
    zeros before the first step. Each step's present either is copied into the past buffer it came
    from, so the buffers keep their addresses (what a recorded step reads) for the whole generation,
    or, with ``rebind`` (no recording reads them), becomes the next step's past itself: the copy
    would rewrite every state (a Gated DeltaNet layer's is d_k x d_v per head) once per step for
    nothing. Readers look a buffer up by name when they use it, never keep one across steps.
    Unlike a KV cache, a state cannot be masked back: a step's tokens are folded in for good."""

    def __init__(
        self, config: PackageConfig, dtype: torch.dtype, device: torch.device, batch: int = 1, *, rebind: bool = False
    ):
        self._block, views = views_of_one_block([(batch, *s.shape) for s in config.carried], dtype, device)
        self._views = {s.past: view for s, view in zip(config.carried, views, strict=True)}
        self.buffers = dict(self._views)
        self._names = [(s.past, s.present) for s in config.carried]
        self.rebind = rebind

    def reset(self) -> None:
        """Zeros again, in the first buffers (a rebound past goes back to its view of the block)."""
        self.buffers = dict(self._views)
        self._block.zero_()

    def update(self, outputs: dict[str, torch.Tensor]) -> None:
        targets, sources = [], []
        for past, present in self._names:
            out, buffer = outputs[present], self.buffers[past]
            if out.data_ptr() == buffer.data_ptr():
                continue
            if self.rebind and out.shape == buffer.shape and out.dtype == buffer.dtype:
                self.buffers[past] = out
            else:
                targets.append(buffer)
                sources.append(out)
        if targets:  # one batched copy: on CUDA a few launches for all the states, not one each
            torch._foreach_copy_(targets, sources)


# where each view of views_of_one_block starts: a multiple of this many bytes, so every buffer is as
# aligned as a tensor of its own (the kernels' vector loads and their pointer specialisation)
VIEW_ALIGN_BYTES = 256


def views_of_one_block(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(block, views): one zeroed 1-D tensor and a contiguous view of it per shape, each starting at a
    multiple of VIEW_ALIGN_BYTES. A reset then zeroes the block in one kernel: a hybrid decoder
    carries some fifty buffers, and zeroing them one by one (torch's _foreach_zero_ included, which
    launched a fill kernel per tensor on the GPU) put that many launches before every prompt."""
    align = max(1, VIEW_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    starts, end = [], 0
    for shape in shapes:
        starts.append(end)
        end += -(-math.prod(shape) // align) * align
    block = torch.zeros(end, dtype=dtype, device=device)
    views = [block[start : start + math.prod(shape)].view(shape) for start, shape in zip(starts, shapes, strict=True)]
    return block, views


class DynamicKV:
    kind = "dynamic"

    def __init__(
        self, config: PackageConfig, dtype: torch.dtype, device: torch.device, batch: int = 1, *,
        rebind_states: bool = False,
    ):  # fmt: skip
        self.config = config
        self.length = 0
        shape = (batch, config.num_kv_heads, 0, config.head_size)
        self.past = {}
        for layer in config.kv_layer_ids:
            self.past[config.past_key_name(layer)] = torch.zeros(shape, dtype=dtype, device=device)
            self.past[config.past_value_name(layer)] = torch.zeros(shape, dtype=dtype, device=device)
        self.device = device
        self.batch = batch
        self.states = CarriedStates(config, dtype, device, batch, rebind=rebind_states)

    def attention_mask(self, new_tokens: int) -> torch.Tensor:
        return torch.ones((self.batch, self.length + new_tokens), dtype=torch.int64, device=self.device)

    def feeds(self) -> dict[str, torch.Tensor]:
        return {**self.past, **self.states.buffers}

    def update(self, outputs: dict[str, torch.Tensor], new_tokens: int) -> None:
        c = self.config
        for layer in c.kv_layer_ids:
            self.past[c.past_key_name(layer)] = outputs[c.present_key_name(layer)]
            self.past[c.past_value_name(layer)] = outputs[c.present_value_name(layer)]
        self.states.update(outputs)
        self.length += new_tokens


class GrowingKV:
    """A dynamic cache kept in buffers with spare rows (see the module docstring).

    Invariants: every buffer has the same capacity >= length; rows [0, length) hold the history;
    the feeds are the whole buffers (the op reads rows [0, total) and writes [length, total));
    the attention mask is ones of width length + new_tokens."""

    kind = "dynamic"
    min_capacity = 64

    def __init__(
        self, config: PackageConfig, dtype: torch.dtype, device: torch.device, limit: int, batch: int = 1, *,
        rebind_states: bool = False,
    ):  # fmt: skip
        self.config = config
        self.length = 0
        self.limit = limit  # never more rows than this (the context)
        self.device = device
        self.batch = batch
        self.dtype = dtype
        self.capacity = 0
        self.reallocations = 0
        self.buffers: dict[str, torch.Tensor] = {}
        self._names = [
            (config.past_key_name(layer), config.present_key_name(layer)) for layer in config.kv_layer_ids
        ] + [(config.past_value_name(layer), config.present_value_name(layer)) for layer in config.kv_layer_ids]
        self.states = CarriedStates(config, dtype, device, batch, rebind=rebind_states)
        self._grow(self.min_capacity)

    def _grow(self, needed: int) -> None:
        capacity = max(self.min_capacity, self.capacity)
        while capacity < needed:
            capacity *= 2
        capacity = min(max(capacity, needed), max(self.limit, needed))
        c = self.config
        shape = (self.batch, c.num_kv_heads, capacity, c.head_size)
        for past, _ in self._names:
            buffer = torch.zeros(shape, dtype=self.dtype, device=self.device)
            old = self.buffers.get(past)
            if old is not None and self.length:
                buffer[:, :, : self.length] = old[:, :, : self.length]
            self.buffers[past] = buffer  # the old buffer is freed here, one layer at a time
        if self.capacity:
            self.reallocations += 1
        self.capacity = capacity

    def attention_mask(self, new_tokens: int) -> torch.Tensor:
        end = self.length + new_tokens
        if end > self.capacity:
            self._grow(end)
        return torch.ones((self.batch, end), dtype=torch.int64, device=self.device)

    def feeds(self) -> dict[str, torch.Tensor]:
        return {**self.buffers, **self.states.buffers}

    def update(self, outputs: dict[str, torch.Tensor], new_tokens: int) -> None:
        self.states.update(outputs)
        for past, present in self._names:
            out = outputs[present]
            buffer = self.buffers[past]
            if out.data_ptr() != buffer.data_ptr():
                # the op returned a new tensor instead of writing in place: keep its rows (the
                # mask call of this step made room for length + new_tokens of them)
                rows = min(out.shape[2], self.capacity)
                buffer[:, :, :rows] = out[:, :, :rows]
        self.length += new_tokens


class StaticKV:
    kind = "static"

    def __init__(
        self, config: PackageConfig, dtype: torch.dtype, device: torch.device, capacity: int, batch: int = 1, *,
        rebind_states: bool = False,
    ):  # fmt: skip
        self.config = config
        self.capacity = capacity
        self.length = 0
        self.device = device
        self.batch = batch
        shape = (batch, config.num_kv_heads, capacity, config.head_size)
        names = [n for i in config.kv_layer_ids for n in (config.past_key_name(i), config.past_value_name(i))]
        self._rows, views = views_of_one_block([shape] * len(names), dtype, device)
        self.buffers = dict(zip(names, views, strict=True))
        self.mask = torch.zeros((batch, capacity), dtype=torch.int64, device=device)
        self.states = CarriedStates(config, dtype, device, batch, rebind=rebind_states)
        # (present output name, the past buffer it must land in), made once: update() runs every step
        self._pairs = [
            (present, self.buffers[past])
            for layer in config.kv_layer_ids
            for past, present in (
                (config.past_key_name(layer), config.present_key_name(layer)),
                (config.past_value_name(layer), config.present_value_name(layer)),
            )
        ]

    def reset(self, *, zero_rows: bool = True) -> None:
        """Empty again, in place: the buffers and the mask keep their addresses (what a recorded
        CUDA graph reads), so one cache serves generation after generation. ``zero_rows=False``
        leaves the old rows in the buffers: the cleared mask hides them, and a step writes a row
        before any step attends to it (a caller that reads only unmasked rows, batched.py)."""
        self.length = 0
        self.mask.zero_()
        # a state has no rows to hide: it starts from zeros again
        self.states.reset()
        if zero_rows:
            self._rows.zero_()

    @staticmethod
    def pinned_symbols(inputs: Iterable[Any], config: PackageConfig) -> set[str]:
        """The graph-input symbols a static cache fixes (the KV buffer length and the mask width):
        what a capture runtime pins for it. ``inputs``: value infos with .name and .shape."""
        shapes = {i.name: i.shape or [] for i in inputs}
        first = config.first_past_key_name
        dims = shapes.get(first, [])[2:3] + shapes.get(config.io.attention_mask, [])[1:2]
        return {d for d in dims if isinstance(d, str)}

    def attention_mask(self, new_tokens: int, set_rows: bool = True) -> torch.Tensor:
        """The mask for a step of ``new_tokens`` rows; ``set_rows=False`` when the device already set
        them (a step tail of the step before, decode_tail.py): the capacity is checked all the same."""
        end = self.length + new_tokens
        if end > self.capacity:
            raise ValueError(f"KV capacity {self.capacity} exceeded ({end} tokens)")
        if set_rows:
            self.mask[:, self.length : end] = 1  # in place: the mask tensor itself never changes identity
        return self.mask

    def unmask_rows(self, start: int, count: int) -> None:
        """Rows [start, start + count) hold nothing valid (a prefill chunk's padding): mask them out."""
        self.mask[:, start : start + count] = 0

    def feeds(self) -> dict[str, torch.Tensor]:
        return {**self.buffers, **self.states.buffers}

    def update(self, outputs: dict[str, torch.Tensor], new_tokens: int) -> None:
        self.states.update(outputs)
        for present, buffer in self._pairs:
            out = outputs[present]
            if out.data_ptr() != buffer.data_ptr():
                # the op returned a new tensor instead of writing in place: keep the buffer current
                buffer.copy_(out)
        self.length += new_tokens
