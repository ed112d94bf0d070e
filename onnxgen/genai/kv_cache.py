"""KV state between decode steps.

- ``DynamicKV``: present outputs are fed back as the next step's past (the cache grows).
- ``StaticKV``: fixed-capacity buffers updated in place by the attention op, a fixed-width
  attention mask (ones up to the valid length) and so a device-side valid length (seqlens_k
  is derived from the mask inside the graph). Shapes never change between decode steps, which
  is what lets a whole decode step be captured.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from onnxgen.genai.package import PackageConfig


class DynamicKV:
    kind = "dynamic"

    def __init__(self, config: PackageConfig, dtype: torch.dtype, device: torch.device, batch: int = 1):
        self.config = config
        self.length = 0
        shape = (batch, config.num_kv_heads, 0, config.head_size)
        self.past = {}
        for layer in range(config.num_layers):
            self.past[config.past_key_name(layer)] = torch.zeros(shape, dtype=dtype, device=device)
            self.past[config.past_value_name(layer)] = torch.zeros(shape, dtype=dtype, device=device)
        self.device = device
        self.batch = batch

    def attention_mask(self, new_tokens: int) -> torch.Tensor:
        return torch.ones((self.batch, self.length + new_tokens), dtype=torch.int64, device=self.device)

    def feeds(self) -> dict[str, torch.Tensor]:
        return dict(self.past)

    def update(self, outputs: dict[str, torch.Tensor], new_tokens: int) -> None:
        c = self.config
        for layer in range(c.num_layers):
            self.past[c.past_key_name(layer)] = outputs[c.present_key_name(layer)]
            self.past[c.past_value_name(layer)] = outputs[c.present_value_name(layer)]
        self.length += new_tokens


class StaticKV:
    kind = "static"

    def __init__(self, config: PackageConfig, dtype: torch.dtype, device: torch.device, capacity: int, batch: int = 1):
        self.config = config
        self.capacity = capacity
        self.length = 0
        self.device = device
        self.batch = batch
        shape = (batch, config.num_kv_heads, capacity, config.head_size)
        self.buffers = {}
        for layer in range(config.num_layers):
            self.buffers[config.past_key_name(layer)] = torch.zeros(shape, dtype=dtype, device=device)
            self.buffers[config.past_value_name(layer)] = torch.zeros(shape, dtype=dtype, device=device)
        self.mask = torch.zeros((batch, capacity), dtype=torch.int64, device=device)
        # (present output name, the past buffer it must land in), made once: update() runs every step
        self._pairs = [
            (present, self.buffers[past])
            for layer in range(config.num_layers)
            for past, present in (
                (config.past_key_name(layer), config.present_key_name(layer)),
                (config.past_value_name(layer), config.present_value_name(layer)),
            )
        ]

    def reset(self) -> None:
        """Empty again, in place: the buffers and the mask keep their addresses (what a recorded
        CUDA graph reads), so one cache serves generation after generation."""
        self.length = 0
        self.mask.zero_()
        for buffer in self.buffers.values():
            buffer.zero_()

    @staticmethod
    def pinned_symbols(inputs: Iterable[Any], config: PackageConfig) -> set[str]:
        """The graph-input symbols a static cache fixes (the KV buffer length and the mask width):
        what a capture runtime pins for it. ``inputs``: value infos with .name and .shape."""
        shapes = {i.name: i.shape or [] for i in inputs}
        dims = shapes.get(config.past_key_name(0), [])[2:3] + shapes.get(config.io.attention_mask, [])[1:2]
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

    def feeds(self) -> dict[str, torch.Tensor]:
        return dict(self.buffers)

    def update(self, outputs: dict[str, torch.Tensor], new_tokens: int) -> None:
        for present, buffer in self._pairs:
            out = outputs[present]
            if out.data_ptr() != buffer.data_ptr():
                # the op returned a new tensor instead of writing in place: keep the buffer current
                buffer.copy_(out)
        self.length += new_tokens
