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
def linear_row_enabled() -> bool:
    """The one-row GEMV kernels of triton_linear, opt-in (ONNXGEN_TRITON_LINEAR=1): on the H200 they
    lost to cuBLAS (docs/benchmarks/2026-12-01-h200.md), so by default a fused group runs its
    prologue's kernel and then cuBLAS (on the dequantized copy for 4-bit weights)."""
    return os.environ.get("ONNXGEN_TRITON_LINEAR", "0") == "1"


def linear_row_serves(a: torch.Tensor) -> bool:
    """A one-row linear layer over ``a`` may run as triton_linear's kernel."""
    return a.dtype in (torch.float16, torch.bfloat16, torch.float32) and linear_row_enabled() and triton_serves(a)
