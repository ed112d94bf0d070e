"""Rows of a tensor as the small row-wise kernels of hybrid decoders address them.

Their inputs are often views into a wider tensor: Split's outputs of a convolution's channels, a
MatMulGroup's members (one GEMM's output split along N). Such a view is rows of contiguous elements
at a uniform row stride, which a kernel reads in place; copying it first would cost the kernel it
replaces.
"""

from __future__ import annotations

import torch


def as_rows(x: torch.Tensor, *inner: int) -> torch.Tensor:
    """``x`` as ``[rows, *inner]`` with its last axis contiguous: a view where the strides allow
    (every leading axis collapses into one uniformly strided row axis), else a contiguous copy.
    ``inner`` must be positive and divide ``x.numel()``; the caller has checked that."""
    try:
        rows = x.view(-1, *inner)
    except RuntimeError:  # strides no single row stride describes: copy
        rows = x.contiguous().view(-1, *inner)
    return rows if rows.stride(-1) == 1 or inner[-1] == 1 else rows.contiguous()
