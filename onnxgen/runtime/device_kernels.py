"""The runtime's fused device kernels that callers above it use between or at the end of steps.

Layers above the runtime (genai's step tails) reach GPU kernels only through this module and the
session API, never through ``onnxgen.runtime.ops``: the kernels' modules, their launch tables
and their fallbacks stay the runtime's to change. Nothing here knows what the tensors mean to the
caller; the names say what is computed.
"""

from __future__ import annotations

import torch

from onnxgen.runtime.gpu.launch import triton_serves


def device_kernels_available(tensor: torch.Tensor) -> bool:
    """Whether the runtime's fused (Triton) kernels serve tensors on ``tensor``'s device: CUDA with
    Triton importable, or the CPU under Triton's interpreter (the tests)."""
    return triton_serves(tensor)


def argmax_advance(
    row: torch.Tensor,
    index: torch.Tensor,
    position: torch.Tensor,
    flags: torch.Tensor,
    host_out: torch.Tensor | None = None,
) -> None:
    """One fused kernel, in place: ``index`` <- argmax(``row``) (torch's rules: the first maximum,
    NaN counting as the largest), ``position`` <- position + 1, ``flags[0, p]`` <- 1 at the new
    position p (the last entry once p passes the end), and ``host_out[p]`` <- the index when given.

    ``row``: one contiguous 1-d tensor; ``index``, ``position``: one int64 each; ``flags``:
    [1, width] int64; ``host_out``: [width + 1] int64 in pinned host memory, which the kernel writes
    directly (the host reads it once the stream has passed, with no copy in the stream). Only where
    ``device_kernels_available(row)``; capture-safe (no allocation after the first call per device,
    no host read)."""
    from onnxgen.runtime.gpu.greedy_advance import greedy_advance  # imports Triton: only when used

    greedy_advance(row, index, position, flags, host_out)
