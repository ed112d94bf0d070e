"""LinearAttentionGate (com.microsoft) in one Triton kernel: per head h,
decay = decay_scale[h] * softplus(a + dt_bias[h]) and beta = sigmoid(b).

Gated DeltaNet layers compute their log decay and write strength this way from two narrow
projections (one value per head); torch spends about eight kernels on it (casts, add, softplus,
multiply, sigmoid, casts back). One program per row computes both in fp32, as the torch path
(ops/contrib_gated.py) does, and rounds each once to its input's dtype.

Softplus follows torch's definition (x above 20 passes through, else log1p(exp(x))), with log1p
computed without a libdevice call (which Triton's CPU interpreter lacks) by the classic correction
log1p(e) = log(u) * e / (u - 1), u = 1 + e rounded (e itself where u rounds to 1): it cancels
the rounding of 1 + e, so small e keep their relative accuracy.

Invariants: elementwise, no reductions, so a replay is bit-identical to the eager run; the outputs
are fresh contiguous tensors of a's shape; a and b are read in place when they are row-strided
views (MatMulGroup members, slices of one GEMM output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen.runtime.gpu.launch import KERNEL_DTYPES, LAUNCHES, pdl_launch
from onnxgen.runtime.gpu.pdl import wait_for_previous
from onnxgen.runtime.gpu.strided_rows import as_rows

# the most heads one program holds whole
MAX_HEADS = 16384


@triton.jit
def _softplus(x):
    # torch's threshold (beta 1): above 20, softplus(x) is x (and exp is kept from overflowing)
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    rounded = u - 1.0  # e as 1 + e kept it; zero where e vanished in the sum (then log1p(e) is e)
    log1p = tl.where(rounded == 0.0, e, tl.log(u) * (e / tl.where(rounded == 0.0, 1.0, rounded)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _linear_attention_gate_kernel(
    a_ptr,
    b_ptr,
    dt_bias_ptr,
    decay_scale_ptr,
    decay_ptr,
    beta_ptr,
    a_row_stride,
    b_row_stride,
    heads,
    HAS_BETA: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (launch.pdl_launch)
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < heads
    a = tl.load(a_ptr + row * a_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    decay_scale = tl.load(decay_scale_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    decay = decay_scale * _softplus(a + dt_bias)
    tl.store(decay_ptr + row * heads + cols, decay.to(decay_ptr.dtype.element_ty), mask=inside)
    if HAS_BETA:
        b = tl.load(b_ptr + row * b_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
        beta = 1.0 / (1.0 + tl.exp(-b))
        tl.store(beta_ptr + row * heads + cols, beta.to(beta_ptr.dtype.element_ty), mask=inside)


def linear_attention_gate_applies(
    a: torch.Tensor, dt_bias: torch.Tensor, decay_scale: torch.Tensor, b: torch.Tensor | None
) -> bool:
    """Inputs the kernel serves (the op has checked the shapes: dt_bias and decay_scale [heads],
    b of a's shape)."""
    if a.dim() == 0 or not 0 < a.shape[-1] <= MAX_HEADS:
        return False
    tensors = [t for t in (a, dt_bias, decay_scale, b) if t is not None]
    if any(t.dtype not in KERNEL_DTYPES or t.device != a.device for t in tensors):
        return False
    return dt_bias.is_contiguous() and decay_scale.is_contiguous()


def linear_attention_gate(
    a: torch.Tensor, dt_bias: torch.Tensor, decay_scale: torch.Tensor, b: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(decay in a's dtype, beta in b's dtype or None without b); needs linear_attention_gate_applies."""
    heads = a.shape[-1]
    decay = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    beta = torch.empty(b.shape, dtype=b.dtype, device=b.device) if b is not None else None
    LAUNCHES["linear_attention_gate"] += 1
    if a.numel():
        a_rows = as_rows(a, heads)
        b_rows = as_rows(b, heads) if b is not None else a_rows
        _linear_attention_gate_kernel[(a_rows.shape[0],)](
            a_rows,
            b_rows,
            dt_bias,
            decay_scale,
            decay,
            beta if beta is not None else decay,
            a_rows.stride(0),
            b_rows.stride(0),
            heads,
            HAS_BETA=beta is not None,
            BLOCK=triton.next_power_of_2(heads),
            **pdl_launch(a, decay, beta),
        )
    return decay, beta
