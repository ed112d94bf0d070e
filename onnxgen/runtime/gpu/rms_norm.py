"""Residual add + RMSNorm in one Triton kernel (SkipSimplifiedLayerNormalization and
SimplifiedLayerNormalization over the last axis).

torch spends about twelve kernels on it (casts, add, pow, mean, add eps, rsqrt, two muls, casts
back); in a decode step of a 24-layer model that is ~600 launches. One program per row: the sum
x + skip (+ bias) and the statistics in fp32, y = sum * rsqrt(mean(sum^2) + eps) * gamma, as the
torch kernel computes it (the reduction order differs: results agree to fp32 rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen.runtime.gpu.launch import LAUNCHES, pdl_launch
from onnxgen.runtime.gpu.pdl import wait_for_previous
from onnxgen.runtime.gpu.strided_rows import as_rows


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    skip_ptr,
    bias_ptr,
    gamma_ptr,
    y_ptr,
    sum_ptr,
    inv_ptr,
    hidden,
    x_heads,
    x_outer_stride,
    x_head_stride,
    eps,
    HAS_SKIP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WRITE_SUM: tl.constexpr,
    WRITE_INV: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (launch.pdl_launch)
):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < hidden
    offsets = row * hidden + cols
    x_row = (row // x_heads) * x_outer_stride + (row % x_heads) * x_head_stride
    total = tl.load(x_ptr + x_row + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_SKIP:
        total += tl.load(skip_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if HAS_BIAS:
        total += tl.load(bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if WRITE_SUM:
        tl.store(sum_ptr + offsets, total.to(sum_ptr.dtype.element_ty), mask=inside)
    inv = 1.0 / tl.sqrt(tl.sum(total * total, axis=0) / hidden + eps)
    if WRITE_INV:
        tl.store(inv_ptr + row, inv)
    gamma = tl.load(gamma_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + offsets, (total * inv * gamma).to(y_ptr.dtype.element_ty), mask=inside)


def fused_rms_norm(
    x: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    *,
    skip: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    want_sum: bool = False,
    want_inv: bool = False,
    sum_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(y, x + skip + bias in x's dtype or None, 1/rms per row [..., 1] in fp32 or None); the sum
    goes into ``sum_out`` when given (x's shape and dtype, contiguous). x is read in place where its
    rows are (tokens x heads) at two strides, the last axis contiguous (the heads of one projection
    in a packed q | k | v GEMM's output); y, the sum and 1/rms are contiguous."""
    shape, hidden = x.shape, x.shape[-1]
    x, heads, outer_stride, head_stride = _head_rows(x)
    rows = x.numel() // hidden if hidden else 0
    # y and the sum contiguous whatever x's strides (the kernel writes row r at r * hidden)
    y = torch.empty(shape, dtype=out_dtype or x.dtype, device=x.device)
    total = sum_out
    if total is None and want_sum:
        total = torch.empty(shape, dtype=x.dtype, device=x.device)
    inv = torch.empty((*shape[:-1], 1), dtype=torch.float32, device=x.device) if want_inv else None
    LAUNCHES["rms_norm"] += 1
    if rows:
        skip_c = skip.contiguous() if skip is not None else x
        _rms_norm_kernel[(rows,)](
            x,
            skip_c,
            bias if bias is not None else x,
            gamma,
            y,
            total if total is not None else y,
            inv if inv is not None else y,
            hidden,
            heads,
            outer_stride,
            head_stride,
            float(eps),
            HAS_SKIP=skip is not None,
            HAS_BIAS=bias is not None,
            WRITE_SUM=total is not None,
            WRITE_INV=want_inv,
            BLOCK=triton.next_power_of_2(hidden),
            **pdl_launch(x, y, total, inv),
        )
    return y, total, inv


def _head_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(x's rows as the kernel reads them, heads, outer stride, head stride): row r of x's [rows,
    hidden] is at (r // heads) * outer + (r % heads) * head. Contiguous x: one "head" per row; else
    [outer, heads, hidden] over x's last two axes, a view where two strides describe x (as_rows), or
    a contiguous copy."""
    if x.dim() < 2 or x.is_contiguous():
        return x.contiguous(), 1, x.shape[-1], 0
    rows = as_rows(x, x.shape[-2], x.shape[-1])
    return rows, rows.shape[1], rows.stride(0), rows.stride(1)


def rms_norm_applies(x: torch.Tensor, gamma: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Shapes the kernel serves: normalise the last axis, gamma (and bias) of that length, skip of x's shape."""
    hidden = x.shape[-1]
    if x.dim() < 1 or hidden == 0 or hidden > 16384 or gamma.shape != (hidden,) or not gamma.is_contiguous():
        return False
    if not x.is_floating_point() or x.dtype == torch.float64:
        return False
    for t in others:
        if t is not None and (t.dtype == torch.float64 or t.device != x.device):
            return False
    return True
