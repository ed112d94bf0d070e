"""MatMul, Gemm, Einsum, MatMulInteger, Det.

Integer products: torch's CPU matmul handles integer tensors, its CUDA matmul does not. So off the
CPU, integer matmuls run as exact int64 multiply-and-sum over chunks of the inner dimension
(broadcasting, fixed shapes: capture-safe). Operands of at most 16 bits use float64 instead, which
is exact there (every partial sum stays below 2**53 for inner sizes up to 2**20) and much faster.
Integer Einsum runs in int64 on the CPU and in float64 elsewhere (exact while sums stay below 2**53).
"""

from __future__ import annotations

import torch

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.cpu_gemv import split_gemv
from onnxgen.runtime.ops.registry import implements

_NARROW_INTS = (torch.int8, torch.uint8, torch.int16, torch.uint16, torch.bool)
# elements of one int64 chunk product (a[..., M, k, 1] * b[..., 1, k, N]); bounds scratch memory
_CHUNK_ELEMENTS = 1 << 24


def _chunked_int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int64 matmul of at-least-2-D operands by broadcast multiply and sum."""
    a = a.to(torch.int64)
    b = b.to(torch.int64)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    per_k = max(1, m * n)
    for size in batch:
        per_k *= max(size, 1)
    step = max(1, _CHUNK_ELEMENTS // per_k)
    out = torch.zeros((*batch, m, n), dtype=torch.int64, device=a.device)
    for start in range(0, k, step):
        width = min(step, k - start)
        left = a.narrow(-1, start, width).unsqueeze(-1)  # [..., M, w, 1]
        right = b.narrow(-2, start, width).unsqueeze(-3)  # [..., 1, w, N]
        out += (left * right).sum(dim=-2)
    return out


def int_matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """numpy-style matmul of integer tensors, exact (wrapping like C++ for the output dtype)."""
    squeeze_front = a.dim() == 1
    squeeze_back = b.dim() == 1
    if squeeze_front:
        a = a.unsqueeze(0)
    if squeeze_back:
        b = b.unsqueeze(-1)
    if a.dtype in _NARROW_INTS and b.dtype in _NARROW_INTS and a.shape[-1] <= (1 << 20):
        y = torch.matmul(a.to(torch.float64), b.to(torch.float64)).to(torch.int64)
    elif a.device.type == "cpu":
        y = torch.matmul(a.to(torch.int64), b.to(torch.int64))
    else:
        y = _chunked_int_matmul(a, b)
    if squeeze_back:
        y = y.squeeze(-1)
    if squeeze_front:
        y = y.squeeze(-1 if squeeze_back else -2)
    return y.to(out_dtype)


def matmul_any(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.is_floating_point():
        return torch.matmul(a, b)
    return int_matmul(a, b, a.dtype)


@implements("MatMul", since=1)
def matmul(ctx: NodeContext, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    fast = split_gemv(a, b)  # fp32 CPU decode: use every core's bandwidth (see cpu_gemv)
    return fast if fast is not None else matmul_any(a, b)


@implements("Gemm", since=1)
def gemm(ctx: NodeContext, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None) -> torch.Tensor:
    alpha = float(ctx.attr("alpha", 1.0))
    beta = float(ctx.attr("beta", 1.0))
    if ctx.attr("transA", 0):
        a = a.transpose(0, 1)
    if ctx.attr("transB", 0):
        b = b.transpose(0, 1)
    use_c = c is not None and beta != 0.0  # beta == 0 ignores C (even NaNs in it), as onnxruntime does
    if a.is_floating_point():
        if use_c:
            # one BLAS call: alpha * (a @ b) + beta * c, with c broadcast to [M, N]
            return torch.addmm(c, a, b, beta=beta, alpha=alpha)
        y = split_gemv(a, b.transpose(0, 1), b_transposed=True) if ctx.attr("transB", 0) else None
        y = torch.mm(a, b) if y is None else y
        return y if alpha == 1.0 else y * alpha
    y = int_matmul(a, b, torch.int64)
    if alpha != 1.0 or (use_c and beta != 1.0):
        scaled = y.to(torch.float64) * alpha
        if use_c:
            scaled = scaled + beta * c.to(torch.float64)
        return torch.trunc(scaled).to(a.dtype)
    if use_c:
        y = y + c.to(torch.int64)
    return y.to(a.dtype)


@implements("Einsum", since=12)
def einsum(ctx: NodeContext, *inputs: torch.Tensor) -> torch.Tensor:
    equation = str(ctx.require("equation")).replace(" ", "")
    dtype = inputs[0].dtype
    if dtype.is_floating_point:
        return torch.einsum(equation, *inputs)
    if inputs[0].device.type == "cpu":
        return torch.einsum(equation, *(t.to(torch.int64) for t in inputs)).to(dtype)
    # CUDA has no integer GEMM: float64 is exact while every partial sum stays below 2**53
    return torch.einsum(equation, *(t.to(torch.float64) for t in inputs)).to(torch.int64).to(dtype)


@implements("MatMulInteger", since=10)
def matmul_integer(
    ctx: NodeContext,
    a: torch.Tensor,
    b: torch.Tensor,
    a_zero_point: torch.Tensor | None = None,
    b_zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    # widen before subtracting so uint8 - zero point cannot wrap
    a_wide = a.to(torch.int16)
    b_wide = b.to(torch.int16)
    if a_zero_point is not None:
        zp = a_zero_point.to(torch.int16)
        # a 1-D zero point of A is per row: it varies along A's second-to-last axis
        a_wide = a_wide - (zp.unsqueeze(-1) if zp.dim() == 1 and a.dim() >= 2 else zp)
    if b_zero_point is not None:
        b_wide = b_wide - b_zero_point.to(torch.int16)  # per column: broadcasts along the last axis
    return int_matmul(a_wide, b_wide, torch.int32)


@implements("Det", since=11, capture="linear-algebra solver may synchronize with the host")
def det(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    if x.dtype in (torch.float32, torch.float64):
        return torch.linalg.det(x)
    return torch.linalg.det(x.float()).to(x.dtype)  # torch's LU has no half kernels
