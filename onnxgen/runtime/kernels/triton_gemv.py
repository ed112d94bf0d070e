"""One-row MatMulNBits (4-bit weights, fp16/fp32 activations) in one Triton kernel that reads the
packed weight: y[n] = sum_k a[k] * (code[n, k] - zero[n, k // bs]) * scale[n, k // bs] (+ bias[n]).

The CUDA MatMulNBits path otherwise multiplies by a cached fp16 copy of the dequantized weight,
which reads 4x the bytes of the packed one and holds 4x its memory. Dequantization is in fp32
(the weight is not rounded to fp16 first), products accumulate in fp32 in a fixed order.

Status: opt-in (ONNXGEN_TRITON_GEMV=1) until it has been measured on a GPU against the cached
fp16 GEMM; its results are tested against onnxruntime through Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen.runtime.kernels.triton_support import LAUNCHES


@triton.jit
def _gemv_int4_kernel(
    a_ptr,
    b_ptr,  # uint8 [N, row_bytes]: two 4-bit codes per byte, low nibble first
    scale_ptr,  # [N, n_blocks]
    zero_ptr,  # uint8 [N, zp_row_bytes] (packed), or [N, n_blocks] in the scale dtype, or unused
    bias_ptr,
    out_ptr,
    n,
    k,
    n_blocks,
    row_bytes,
    zp_row_bytes,
    BLOCK_SIZE: tl.constexpr,  # the quantization block along K
    ZERO_KIND: tl.constexpr,  # 0: none (8), 1: packed uint8, 2: same dtype as the scales
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # K elements per iteration (a multiple of 2)
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    pairs = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        even = start + 2 * pairs  # element index of each byte's low nibble
        in_k_even = even < k
        in_k_odd = even + 1 < k
        a_even = tl.load(a_ptr + even, mask=in_k_even, other=0.0).to(tl.float32)
        a_odd = tl.load(a_ptr + even + 1, mask=in_k_odd, other=0.0).to(tl.float32)
        byte_ok = row_ok[:, None] & in_k_even[None, :]
        packed = tl.load(b_ptr + rows[:, None] * row_bytes + (even // 2)[None, :], mask=byte_ok, other=0)
        low = (packed & 0xF).to(tl.float32)
        high = (packed >> 4).to(tl.float32)
        block = even // BLOCK_SIZE  # both nibbles of a byte share a block (BLOCK_SIZE is even)
        scale = tl.load(scale_ptr + rows[:, None] * n_blocks + block[None, :], mask=byte_ok, other=0.0).to(tl.float32)
        if ZERO_KIND == 0:
            zero = 8.0
        elif ZERO_KIND == 1:
            zbyte = tl.load(zero_ptr + rows[:, None] * zp_row_bytes + (block // 2)[None, :], mask=byte_ok, other=0)
            zero = tl.where((block % 2)[None, :] == 0, zbyte & 0xF, zbyte >> 4).to(tl.float32)
        else:
            zero = tl.load(zero_ptr + rows[:, None] * n_blocks + block[None, :], mask=byte_ok, other=0.0)
            zero = zero.to(tl.float32)
        acc += tl.sum((low - zero) * scale * a_even[None, :] + (high - zero) * scale * a_odd[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


def gemv_int4(
    a: torch.Tensor,  # [K] (one row)
    b: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    n: int,
    k: int,
    block_size: int,
) -> torch.Tensor:
    """[N] in a's dtype."""
    LAUNCHES["gemv_int4"] += 1
    n_blocks = -(-k // block_size)
    packed = b.reshape(n, -1)
    zero_kind = 0 if zero_points is None else (1 if zero_points.dtype == torch.uint8 else 2)
    zeros = zero_points.reshape(n, -1) if zero_points is not None else packed
    out = torch.empty(n, dtype=a.dtype, device=a.device)
    block_n = 8
    _gemv_int4_kernel[(triton.cdiv(n, block_n),)](
        a.contiguous(),
        packed,
        scales.reshape(n, n_blocks),
        zeros,
        bias if bias is not None else out,
        out,
        n,
        k,
        n_blocks,
        packed.shape[1],
        zeros.shape[1],
        BLOCK_SIZE=block_size,
        ZERO_KIND=zero_kind,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=max(64, min(256, triton.next_power_of_2(block_size))),
    )
    return out
