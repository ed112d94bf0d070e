"""The decode step's first ops in one Triton kernel each: the attention mask's row sums (the
RowSumCast fusion: ReduceSum -> Sub -> Cast, the valid lengths GroupQueryAttention reads) and the
embedding lookup (Gather of table rows, the index wrapped as ONNX allows; and GatherBlockQuantized's
4-bit rows, dequantized as they are gathered, the embedding of onnxruntime-genai's int4 packages,
where torch's path costs about a dozen small kernels per step).

In torch these are five small kernels before the first layer, about 14 us of the 0.5B step on the
H200 (docs/benchmarks/2026-12-01-h200-anatomy.md section 2): a reduction, a subtraction, a cast,
the index wrap and the row copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen.runtime.gpu.launch import LAUNCHES, pdl_launch, settled_before_launch
from onnxgen.runtime.gpu.pdl import wait_for_previous


@triton.jit
def _row_sum_cast_kernel(x_ptr, out_ptr, width, stride, offset, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    wait_for_previous(PDL)
    total = tl.zeros((), dtype=x_ptr.dtype.element_ty)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        total += tl.sum(tl.load(x_ptr + row * stride + cols, mask=cols < width, other=0), axis=0)
    tl.store(out_ptr + row, (total + offset).to(out_ptr.dtype.element_ty))


def row_sum_cast(x: torch.Tensor, offset: int, dtype: torch.dtype) -> torch.Tensor:
    """(x.sum(1) + offset).to(dtype) for an integer [rows, width] x, as [rows]."""
    LAUNCHES["row_sum_cast"] += 1
    rows, width = x.shape
    out = torch.empty(rows, dtype=dtype, device=x.device)
    block = min(4096, max(16, triton.next_power_of_2(width)))
    _row_sum_cast_kernel[(rows,)](x, out, width, x.stride(0), offset, BLOCK=block, **pdl_launch(x, out))
    return out


@triton.jit
def _gather_rows_kernel(
    table_ptr, idx_ptr, out_ptr, rows, width, BLOCK: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr
):
    i = tl.program_id(0)
    if not EARLY:
        wait_for_previous(PDL)
    r = tl.load(idx_ptr + i).to(tl.int64) % rows
    r = tl.where(r < 0, r + rows, r)  # a floor mod, as torch.remainder: [-rows, rows) -> [0, rows)
    if EARLY:  # the index was settled and the table is constant: only the stores wait
        cols = tl.arange(0, BLOCK)
        row = tl.load(table_ptr + r * width + cols, mask=cols < width)
        wait_for_previous(PDL)
        tl.store(out_ptr + i * width + cols, row, mask=cols < width)
    else:
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < width
            tl.store(out_ptr + i * width + cols, tl.load(table_ptr + r * width + cols, mask=inside), mask=inside)


def gather_rows(table: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """table[indices mod rows] for a contiguous [rows, width] table: [indices.numel(), width].
    Where the indices are settled (not written by the kernel just launched, settled_before_launch)
    and a row fits one block, the row is read before the PDL wait (the decode step's token ids come
    from the step before)."""
    LAUNCHES["gather_rows"] += 1
    rows, width = table.shape
    idx = indices.reshape(-1)
    out = torch.empty((idx.numel(), width), dtype=table.dtype, device=table.device)
    if idx.numel():
        block = min(4096, max(16, triton.next_power_of_2(width)))
        early = block >= width and settled_before_launch(idx)
        _gather_rows_kernel[(idx.numel(),)](
            table, idx, out, rows, width, BLOCK=block, EARLY=early, **pdl_launch(table, out)
        )  # fmt: skip
    return out


@triton.jit
def _gather_q4_rows_kernel(
    data_ptr, idx_ptr, scale_ptr, zp_ptr, out_ptr, rows, width, n_blocks, zp_width, block_size,
    HAS_ZP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    wait_for_previous(PDL)
    r = tl.load(idx_ptr + i).to(tl.int64)
    r = tl.where(r < 0, r + rows, r)
    valid = (r >= 0) & (r < rows)  # out of range: a zero row (the host check refuses it outside a recording)
    r = tl.where(valid, r, 0)
    packed = tl.load(data_ptr + r * (width // 2) + cols // 2, mask=inside, other=0).to(tl.int32)
    code = (packed >> ((cols % 2) * 4)) & 15
    block = cols // block_size
    scale = tl.load(scale_ptr + r * n_blocks + block, mask=inside, other=0.0).to(tl.float32)
    if HAS_ZP:
        zbyte = tl.load(zp_ptr + r * zp_width + block // 2, mask=inside, other=0).to(tl.int32)
        zero = ((zbyte >> ((block % 2) * 4)) & 15).to(tl.float32)
    else:
        zero = tl.zeros_like(scale) + 8.0
    value = (code.to(tl.float32) - zero) * scale
    value = tl.where(valid, value, 0.0)
    tl.store(out_ptr + i * width + cols, value.to(out_ptr.dtype.element_ty), mask=inside)


def gather_q4_rows(
    data: torch.Tensor, indices: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None, block_size: int
) -> torch.Tensor:
    """GatherBlockQuantized's rows for 4-bit codes packed along the last axis (gather axis 0, quantize
    axis 1, the embedding form of onnxruntime-genai's int4 packages), dequantized in one kernel:
    (code - zero point, or 8) * scale in fp32, rounded once to the scales' dtype, as the torch path
    computes it. [indices.numel(), 2 * data.shape[1]]."""
    LAUNCHES["gather_q4_rows"] += 1
    rows, width = data.shape[0], data.shape[1] * 2
    idx = indices.reshape(-1)
    out = torch.empty((idx.numel(), width), dtype=scales.dtype, device=data.device)
    if idx.numel():
        block = min(1024, max(16, triton.next_power_of_2(width)))
        zp = zero_points if zero_points is not None else scales
        _gather_q4_rows_kernel[(idx.numel(), triton.cdiv(width, block))](
            data, idx, scales, zp, out, rows, width, scales.shape[1],
            zero_points.shape[1] if zero_points is not None else 0, block_size,
            HAS_ZP=zero_points is not None, BLOCK=block, **pdl_launch(data, out),
        )  # fmt: skip
    return out
