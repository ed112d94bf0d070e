"""y * sigmoid(g) (+ x) in one Triton kernel (the SigmoidGate fusion: Qwen3.5's gated attention
output and its shared expert's gate), computed in fp32 and rounded once; the graph as written
spends a kernel on each of Sigmoid, Mul and Add."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen.runtime.gpu.launch import KERNEL_DTYPES, LAUNCHES, pdl_launch
from onnxgen.runtime.gpu.pdl import wait_for_previous


@triton.jit
def _sigmoid_gate_kernel(
    y_ptr, g_ptr, x_ptr, out_ptr, n, cols, PER_ROW: tl.constexpr, HAS_X: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous(PDL)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    y = tl.load(y_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if PER_ROW:  # one gate per row of the last axis
        g = tl.load(g_ptr + offsets // cols, mask=inside, other=0.0).to(tl.float32)
    else:
        g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    out = y / (1.0 + tl.exp(-g))
    if HAS_X:
        out += tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=inside)


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
    """y * sigmoid(g) (+ x) where sigmoid_gate_applies says so."""
    LAUNCHES["sigmoid_gate"] += 1
    y, g = y.contiguous(), g.contiguous()
    x = x.contiguous() if x is not None else None
    out = torch.empty_like(y)
    n = y.numel()
    if n:
        block = 1024
        _sigmoid_gate_kernel[(triton.cdiv(n, block),)](
            y, g, x if x is not None else y, out, n, y.shape[-1], PER_ROW=g.shape != y.shape, HAS_X=x is not None,
            BLOCK=block, **pdl_launch(y, out),
        )  # fmt: skip
    return out
