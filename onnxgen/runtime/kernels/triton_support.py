"""Whether onnxgen's Triton kernels may run on a tensor's device.

Triton is used on CUDA only, where it is installed with torch. Tests run the same kernels on the
CPU through Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported), so a CPU
tensor qualifies when the interpreter is on. ``ONNXGEN_TRITON=0`` turns the kernels off (the torch
kernels run instead), which the benches use to measure what the kernels bring.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections import Counter

import torch

# how often each fused kernel ran in this process (tests check that the fused path was taken)
LAUNCHES: Counter[str] = Counter()


@functools.cache
def triton_importable() -> bool:
    if os.environ.get("ONNXGEN_TRITON", "1") == "0":
        return False
    try:
        import triton  # noqa: F401
    except Exception as exc:
        _MISSING.append(f"{type(exc).__name__}: {exc}")
        return False
    return True


_MISSING: list[str] = []
_WARNED: list[bool] = []


def _warn_fallback() -> None:
    """Said once per process: without Triton the CUDA decode step runs torch's unfused kernels."""
    if _MISSING and not _WARNED:
        _WARNED.append(True)
        warnings.warn(
            f"triton cannot be imported ({_MISSING[0]}): onnxgen's fused CUDA kernels (RMSNorm, "
            "GroupQueryAttention decode, SiLU-mul) are off and the torch kernels run instead (slower decode)",
            RuntimeWarning,
            stacklevel=3,
        )


@functools.cache
def interpreting() -> bool:
    """Triton's interpreter is on (read once: triton itself decides when a kernel is defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_serves(t: torch.Tensor) -> bool:
    """Triton kernels apply to tensors on this device."""
    if t.device.type == "cuda":
        if triton_importable():
            return True
        _warn_fallback()
        return False
    return interpreting() and t.device.type == "cpu" and triton_importable()


@functools.cache
def gemv_opted_in() -> bool:
    """The one-row int4 GEMV (triton_gemv) is opt-in until it is measured on a GPU."""
    return os.environ.get("ONNXGEN_TRITON_GEMV", "0") == "1"


def int4_gemv_serves(a: torch.Tensor, k: int, bits: int) -> bool:
    """The one-row int4 GEMV applies: opted in, 4-bit weights, one row of A, Triton on A's device."""
    return bits == 4 and a.numel() == k and gemv_opted_in() and triton_serves(a)
