"""silu(g) * u in one Triton kernel (the SiluMul fusion of Llama-style MLPs), computed in fp32 and
rounded once; torch would spend two kernels (silu, mul) and onnxruntime's unfused graph three."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen.runtime.gpu.launch import LAUNCHES, pdl_launch
from onnxgen.runtime.gpu.pdl import wait_for_previous


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    out = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=inside)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """g and u of one shape and dtype."""
    LAUNCHES["silu_mul"] += 1
    g, u = g.contiguous(), u.contiguous()
    out = torch.empty_like(g)
    n = g.numel()
    if n:
        block = 1024
        _silu_mul_kernel[(triton.cdiv(n, block),)](g, u, out, n, BLOCK=block, **pdl_launch(g, out))
    return out
