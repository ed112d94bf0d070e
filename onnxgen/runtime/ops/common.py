"""Helpers shared by the ONNX op implementations: host-read shape values, axes, deterministic SDPA.

What an implementation sees of its node (``NodeContext``) is in ``onnxgen.runtime.node_contract``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from onnxgen.errors import OpError


def ints(value: torch.Tensor | Sequence[int] | None) -> list[int]:
    """A shape-like tensor as Python ints (host read; the executor keeps such tensors on the host)."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    return [int(v) for v in value]


def scalar(value: torch.Tensor) -> Any:
    return value.reshape(-1)[0].item()


def normalize_axis(axis: int, rank: int) -> int:
    if not -max(rank, 1) <= axis < max(rank, 1):
        raise OpError(f"axis {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


# CUDA SDPA backends onnxgen lets torch choose from. cuDNN's is left out: its decode kernels split
# the keys and combine the parts in a separate reduction, and on the H200 (torch 2.11) the same
# decode step then differed from itself in the last bit now and then (docs/benchmarks), which would
# break captured == eager. Flash and memory-efficient attention forward are run-to-run deterministic.
CUDA_SDPA_BACKENDS: list[Any] = []


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """torch's scaled_dot_product_attention, restricted on CUDA to deterministic backends.

    On CUDA, grouped KV heads are repeated to the query heads first: the memory-efficient backend
    (the one that takes an arbitrary mask) does not take enable_gqa, and without it torch would fall
    back to the math backend."""
    F = torch.nn.functional
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal, enable_gqa=enable_gqa
        )
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not CUDA_SDPA_BACKENDS:
        CUDA_SDPA_BACKENDS.extend([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    with sdpa_kernel(CUDA_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal)
