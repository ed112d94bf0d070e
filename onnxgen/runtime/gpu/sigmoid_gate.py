"""y * sigmoid(g) (+ x) in one Triton kernel (the SigmoidGate fusion: Qwen3.5's gated attention
output and its shared expert's gate), computed in fp32 and rounded once; the graph as written
spends a kernel on each of Sigmoid, Mul and Add."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen.runtime.gpu.launch import KERNEL_DTYPES, LAUNCHES, pdl_launch
from onnxgen.runtime.gpu.pdl import wait_for_previous
from onnxgen.runtime.gpu.strided_rows import as_rows


@triton.jit
def _sigmoid_gate_kernel(
    y_ptr, g_ptr, x_ptr, out_ptr, cols, y_row_stride, g_row_stride, x_row_stride, PER_ROW: tl.constexpr,
    HAS_X: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (row, block): BLOCK elements of one row of the last axis; the inputs' rows at their own
    strides (members of a wider GEMM output), the output contiguous."""
    wait_for_previous(PDL)
    row = tl.program_id(0)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < cols
    y = tl.load(y_ptr + row * y_row_stride + offsets, mask=inside, other=0.0).to(tl.float32)
    if PER_ROW:  # one gate per row of the last axis
        g = tl.load(g_ptr + row * g_row_stride).to(tl.float32)
    else:
        g = tl.load(g_ptr + row * g_row_stride + offsets, mask=inside, other=0.0).to(tl.float32)
    out = y / (1.0 + tl.exp(-g))
    if HAS_X:
        out += tl.load(x_ptr + row * x_row_stride + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * cols + offsets, out.to(out_ptr.dtype.element_ty), mask=inside)


def sigmoid_gate_applies(y: torch.Tensor, g: torch.Tensor, x: torch.Tensor | None) -> bool:
    """The kernel's forms: g of y's shape, or of y's shape with a last axis of 1; x absent or of
    y's shape; one float dtype and device."""
    if y.dtype not in KERNEL_DTYPES or y.dim() == 0 or any(t.dtype != y.dtype for t in (g, x) if t is not None):
        return False
    if any(t.device != y.device for t in (g, x) if t is not None):
        return False
    per_row = tuple(g.shape) == (*y.shape[:-1], 1)
    return (g.shape == y.shape or per_row) and (x is None or x.shape == y.shape)


def sigmoid_gate(y: torch.Tensor, g: torch.Tensor, x: torch.Tensor | None) -> torch.Tensor:
    """y * sigmoid(g) (+ x) where sigmoid_gate_applies says so; inputs whose rows are uniformly
    strided are read in place, others copied; the result is contiguous."""
    LAUNCHES["sigmoid_gate"] += 1
    out = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    cols = y.shape[-1]
    if out.numel():
        per_row = g.shape != y.shape
        y_rows, g_rows = as_rows(y, cols), as_rows(g, 1 if per_row else cols)
        x_rows = as_rows(x, cols) if x is not None else y_rows
        block = min(1024, triton.next_power_of_2(cols))
        _sigmoid_gate_kernel[(y_rows.shape[0], triton.cdiv(cols, block))](
            y_rows, g_rows, x_rows, out, cols, y_rows.stride(0), g_rows.stride(0), x_rows.stride(0), PER_ROW=per_row,
            HAS_X=x is not None, BLOCK=block, **pdl_launch(y, out),
        )  # fmt: skip
    return out
