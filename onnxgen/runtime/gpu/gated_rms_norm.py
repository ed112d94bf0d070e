"""GatedRMSNorm (com.microsoft) in one Triton kernel: per group of C = len(scale) trailing elements,
y = x * rsqrt(mean(x^2) + eps) * scale * act(gate), act SiLU or sigmoid.

It closes every Gated DeltaNet layer (the per-head norm of LinearAttention's output, gated by the
z projection); torch spends about a dozen kernels on it (casts, pow, mean, add, rsqrt, the
activation, three multiplies, casts back). One program per (row, group) computes it in fp32 in the
torch path's order (ops/contrib_gated.py) and rounds once to x's dtype.

Invariants: a group's reduction has one fixed order (no atomics: a replay is bit-identical to the
eager run); the output is a fresh contiguous tensor of x's shape; x and the gate are read in place
when they are row-strided views (the gate is a MatMulGroup member's slice of one GEMM output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen.runtime.gpu.launch import KERNEL_DTYPES, LAUNCHES, pdl_launch
from onnxgen.runtime.gpu.pdl import wait_for_previous
from onnxgen.runtime.gpu.strided_rows import as_rows

# the widest group one program holds whole (in registers, fp32), and the most groups per row (the
# grid's second axis)
MAX_GROUP = 16384
MAX_GROUPS = 65535
# the gate activations the kernel knows, by the op's attribute value
ACTIVATIONS = {"silu": 0, "swish": 0, "sigmoid": 1}


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    gate_ptr,
    scale_ptr,
    y_ptr,
    x_row_stride,
    gate_row_stride,
    width,
    size,
    eps,
    SIGMOID: tl.constexpr,  # the gate's activation: sigmoid, else SiLU
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (launch.pdl_launch)
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * size + tl.arange(0, BLOCK)  # this group's columns of the row
    inside = tl.arange(0, BLOCK) < size
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * gate_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + tl.arange(0, BLOCK), mask=inside, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / size + eps)
    if SIGMOID:
        gated = 1.0 / (1.0 + tl.exp(-g))
    else:
        gated = g / (1.0 + tl.exp(-g))  # SiLU, spelled as torch's kernel spells it
    y = x * inv * scale * gated
    tl.store(y_ptr + row * width + cols, y.to(y_ptr.dtype.element_ty), mask=inside)


def gated_rms_norm_applies(x: torch.Tensor, scale: torch.Tensor, gate: torch.Tensor, activation: str) -> bool:
    """Inputs the kernel serves (the op has checked the shapes: gate of x's shape, scale 1-D of a
    length C dividing x's last axis)."""
    if activation not in ACTIVATIONS or not 0 < scale.shape[0] <= MAX_GROUP or x.dim() == 0:
        return False
    if x.shape[-1] // scale.shape[0] > MAX_GROUPS:
        return False
    tensors = (x, scale, gate)
    return all(t.dtype in KERNEL_DTYPES and t.device == x.device for t in tensors) and scale.is_contiguous()


def gated_rms_norm(
    x: torch.Tensor, scale: torch.Tensor, gate: torch.Tensor, eps: float, activation: str
) -> torch.Tensor:
    """GatedRMSNorm's Y in x's dtype; needs gated_rms_norm_applies."""
    size = scale.shape[0]
    width = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    LAUNCHES["gated_rms_norm"] += 1
    if x.numel():
        xs, gs = as_rows(x, width), as_rows(gate, width)
        _gated_rms_norm_kernel[(xs.shape[0], width // size)](
            xs,
            gs,
            scale,
            y,
            xs.stride(0),
            gs.stride(0),
            width,
            size,
            float(eps),
            SIGMOID=ACTIVATIONS[activation] == 1,
            BLOCK=triton.next_power_of_2(size),
            **pdl_launch(x, y),
        )
    return y
