"""L2 normalisation over the last axis in one Triton kernel: y = x / sqrt(sum(x^2) + eps).

Gated DeltaNet layers normalise their queries and keys per head before the recurrence; exporters
spell it ReduceSumSquare -> Add(eps) -> Sqrt -> Div (the L2Normalize fusion, runtime/fusion_hybrid.py)
or LpNormalization(p=2). In torch either is five to seven kernels (casts, square, sum, add, sqrt,
div); here one program per (row, head) does it in fp32 and rounds once to x's dtype.

Invariants: each program reduces its head in one fixed order (no atomics), so a replayed graph
gives the eager result bit for bit; the output is a fresh contiguous tensor of x's shape; x's last
axis is read in place even when x is a strided view (Split's outputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen.runtime.gpu.launch import KERNEL_DTYPES, LAUNCHES, pdl_launch
from onnxgen.runtime.gpu.pdl import wait_for_previous
from onnxgen.runtime.gpu.strided_rows import as_rows

# the widest last axis one program holds whole (in registers, fp32)
MAX_DIM = 16384
# the grid's second axis (one program per head) has at most this many programs; an axis beyond it
# folds into the rows
MAX_HEADS = 65535


@triton.jit
def _l2_norm_kernel(
    x_ptr,
    y_ptr,
    row_stride,
    head_stride,
    heads,
    dim,
    eps,
    ZERO_SAFE: tl.constexpr,  # LpNormalization: a zero vector normalises to zero, not NaN
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (launch.pdl_launch)
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    inside = cols < dim
    x = tl.load(x_ptr + row * row_stride + head * head_stride + cols, mask=inside, other=0.0).to(tl.float32)
    total = tl.sum(x * x, axis=0) + eps
    if ZERO_SAFE:
        y = tl.where(total == 0.0, 0.0, x / tl.sqrt(tl.where(total == 0.0, 1.0, total)))
    else:
        y = x / tl.sqrt(total)
    tl.store(y_ptr + (row * heads + head) * dim + cols, y.to(y_ptr.dtype.element_ty), mask=inside)


def l2_norm_applies(x: torch.Tensor) -> bool:
    """Inputs the kernel serves: a float tensor of rank >= 1 whose last axis fits one program."""
    return x.dim() >= 1 and x.dtype in KERNEL_DTYPES and 0 < x.shape[-1] <= MAX_DIM


def l2_normalize(x: torch.Tensor, eps: float, *, zero_safe: bool = False) -> torch.Tensor:
    """x / sqrt(sum(x^2 over the last axis) + eps), in fp32, rounded once to x's dtype; with
    ``zero_safe`` a vector whose sum is zero gives zeros. Needs l2_norm_applies(x)."""
    dim = x.shape[-1]
    heads = x.shape[-2] if x.dim() >= 2 and 0 < x.shape[-2] <= MAX_HEADS else 1
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    LAUNCHES["l2_norm"] += 1
    if x.numel():
        rows = as_rows(x, heads, dim)  # [rows, heads, dim]: a head is the unit of work
        _l2_norm_kernel[(rows.shape[0], heads)](
            rows,
            y,
            rows.stride(0),
            rows.stride(1),
            heads,
            dim,
            float(eps),
            ZERO_SAFE=zero_safe,
            BLOCK=triton.next_power_of_2(dim),
            **pdl_launch(x, y),
        )
    return y
