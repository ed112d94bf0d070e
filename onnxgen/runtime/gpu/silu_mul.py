"""silu(g) * u in one Triton kernel (the SiluMul fusion of Llama-style MLPs), computed in fp32 and
rounded once; torch would spend two kernels (silu, mul) and onnxruntime's unfused graph three."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen.runtime.gpu.launch import LAUNCHES, pdl_launch
from onnxgen.runtime.gpu.pdl import wait_for_previous
from onnxgen.runtime.gpu.strided_rows import as_rows


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, width, g_row_stride, u_row_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, block): BLOCK elements of one row; g's and u's rows at their own strides (views
    of one GEMM's output, split along N), the output contiguous."""
    wait_for_previous(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    g = tl.load(g_ptr + row * g_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    out = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """g and u of one shape and dtype, read in place where their rows are uniformly strided (a
    packed gate_up projection split in two) and copied otherwise; the result is contiguous."""
    LAUNCHES["silu_mul"] += 1
    out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    width = g.shape[-1] if g.dim() else 1
    if out.numel():
        g_rows, u_rows = as_rows(g, width), as_rows(u, width)
        block = min(1024, triton.next_power_of_2(width))
        grid = (g_rows.shape[0], triton.cdiv(width, block))
        _silu_mul_kernel[grid](g_rows, u_rows, out, width, g_rows.stride(0), u_rows.stride(0), BLOCK=block,
                               **pdl_launch(g, out))  # fmt: skip
    return out
