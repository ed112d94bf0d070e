"""Many-row products over a weight packed for torch's CPU int4 GEMM: the weight dequantized for the
one call into a scratch buffer shared by every weight, then one fp32 GEMM.

Why: ``aten::_weight_int4pack_mm_for_cpu`` unpacks the codes for every block of rows it computes,
so its cost grows with the rows about as fast as the rows themselves (a prompt chunk of 128 rows
took several times a dense fp32 GEMM of the same shape on the AVX2 machine this was written on),
while a decode step's few rows are what it is fast at. Dequantizing the whole weight once costs
about as much as a handful of rows through the kernel, and the fp32 GEMM then amortizes it over
the rows. Nothing is kept per weight: the scratch buffer holds one weight at a time (the largest
one seen, per thread), so the session still holds its 4-bit weights once.

The packed layout is the kernel's own (``_convert_weight_to_int4pack_for_cpu``) and differs by
instruction set: within each block of ``B`` output rows (32 with AVX2, 64 with AVX-512), for each
input column k, ``B / 2`` bytes, byte j holding row j in its low nibble and row ``j + B / 2`` in its
high one. ``packed_block_rows`` finds ``B`` once by packing a probe matrix and checking that
layout; where no ``B`` explains the probe, this path is off (the caller keeps the kernel) and says
so once. The dequantized value is the kernel's: ``(q - 8) * scale + zero`` in fp32 from the same
bf16 scales and zeros; the activations stay fp32 (the kernel rounds them, and its output, to bf16).
"""

from __future__ import annotations

import functools
import sys
import threading

import torch

MIN_ROWS = 64  # below this the kernel is faster (a decode step, a short chunk)
_CANDIDATE_BLOCKS = (64, 32, 16)
_scratch = threading.local()


@functools.cache
def packed_block_rows() -> int | None:
    """The kernel's block of output rows on this machine, or None (module docstring)."""
    n, k = 128, 64
    index = torch.arange(n * k).reshape(n, k)
    nibbles = []
    for digit in range(4):  # the source position of every nibble, four bits at a time
        codes = ((index >> (4 * digit)) & 15).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        nibbles.append(_unpack(packed.reshape(-1)))
    source = sum(value << (4 * digit) for digit, value in enumerate(nibbles))
    for block in _CANDIDATE_BLOCKS:
        if torch.equal(source, _layout(n, k, block).reshape(-1)):
            return block
    print(
        "onnxgen: the CPU int4 GEMM's packed layout is not one onnxgen reads back; prompt chunks keep the "
        "int4 kernel (slower for many rows)",
        file=sys.stderr,
    )
    return None


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """Bytes to nibbles, low nibble first."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(-1).to(torch.int64)


def _layout(n: int, k: int, block: int) -> torch.Tensor:
    """The source index (row * k + column) of each nibble of an [n, k] matrix in the block layout."""
    half = block // 2
    rows = torch.arange(n).reshape(n // block, 1, 2, half)  # [block group, -, nibble, byte]
    cols = torch.arange(k).reshape(1, k, 1, 1)
    source = rows * k + cols  # [n / block, k, 2, half]
    return source.permute(0, 1, 3, 2)  # bytes in order, each its low then its high nibble


def serves(n: int, rows: int) -> bool:
    """Whether a product of ``rows`` rows with an N = ``n`` weight takes this path."""
    if rows < MIN_ROWS:
        return False
    block = packed_block_rows()
    return block is not None and n % block == 0


def matmul(
    a: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, *, k: int, n: int, block_size: int, planes: int = 1
) -> torch.Tensor:
    """``a`` [rows, K] fp32 times the packed weight transposed: [rows, N] fp32 (``serves`` said so for
    ``planes * n``). Two planes (8-bit codes as high and low nibbles, contrib_quant.int4pack_planes)
    are summed into the first before the one GEMM."""
    w = _dequantized_t(packed, sz, k=k, n=planes * n, block_size=block_size)
    if planes == 2:
        w = w[:, :n].add_(w[:, n:])  # a view of row stride 2N: the GEMM reads it in place
    return a @ w


def _dequantized_t(packed: torch.Tensor, sz: torch.Tensor, *, k: int, n: int, block_size: int) -> torch.Tensor:
    """W^T [K, N] fp32 in the thread's scratch buffer (valid until the next call)."""
    block = packed_block_rows()
    assert block is not None
    half = block // 2
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < k * n:
        buffer = _scratch.buffer = torch.empty(k * n, dtype=torch.float32)
    codes = packed.view(n // block, k, half).permute(1, 0, 2)  # [K, N / B, B / 2]
    out = buffer[: k * n].view(k, n // block, block)
    out[:, :, :half] = codes & 15  # low nibbles: rows j
    out[:, :, half:] = codes >> 4  # high nibbles: rows j + B / 2
    scale = sz[..., 0].float()[:, None, :]  # [K / block_size, 1, N]
    zero = sz[..., 1].float()[:, None, :]
    w = out.view(k // block_size, block_size, n)
    torch.addcmul(zero, w.sub_(8.0), scale, out=w)  # (q - 8) * scale + zero
    return w.view(k, n)
