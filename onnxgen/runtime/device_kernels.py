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


NOISY_ARGMAX_TOP_K_MAX = 64  # noisy_argmax's floor kernel holds this many candidates per block at most


def noisy_argmax(
    row: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
    out: torch.Tensor,
    counts: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    linear: torch.Tensor | None = None,
    present: torch.Tensor | None = None,
    temper: torch.Tensor | None = None,
    top_k: int = 0,
    top_p: torch.Tensor | None = None,
    floor_ratio: torch.Tensor | None = None,
    count: bool = False,
    position: torch.Tensor | None = None,
    flags: torch.Tensor | None = None,
    host_out: torch.Tensor | None = None,
) -> None:
    """One fused kernel, in place: ``out`` <- argmax_i(x_i + g_i), a categorical draw from
    softmax(x) (Gumbel-max), where x is ``row`` rescaled by the per-entry ``counts`` c and the
    optional one-element factors (``scale`` a: x / a for c > 0 and x > 0, x * a for c > 0 and
    x <= 0; ``linear`` b: x - b * c; ``present`` d: x - d * [c > 0]; ``temper`` t: x / t, in this
    order), and g_i Gumbel noise hashed from (``seed`` [2] int64 words, ``counter``, i); only over
    the ``top_k`` largest x (0: all; at most ``NOISY_ARGMAX_TOP_K_MAX``), of those the smallest set
    whose softmax mass reaches ``top_p`` (one fp32), and the x_i >= max(x) + log(``floor_ratio``)
    (one fp32), where given: kernels before it find that floor. -1 where x's maximum is NaN or
    infinite. Then ``counts[out]`` += 1 (``count``; index 0 for -1),
    ``counter`` += 1 and, given ``position`` and ``flags``, the advance of ``argmax_advance``
    (``host_out`` included). The exact hash and numerics: runtime/gpu/noisy_argmax.py. Only where
    ``device_kernels_available(row)``; capture-safe."""
    from onnxgen.runtime.gpu.noisy_argmax import noisy_argmax as kernel  # imports Triton: only when used

    kernel(
        row, seed, counter, out, counts, scale=scale, linear=linear, present=present, temper=temper,
        top_k=top_k, top_p=top_p, floor_ratio=floor_ratio, count=count, position=position, flags=flags,
        host_out=host_out,
    )  # fmt: skip
