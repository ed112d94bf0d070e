"""Linear layers over MatMulNBits' packed 4-bit weights, dequantized in registers: no fp16 copy of
the weight exists anywhere, and each product reads a quarter of the bytes a dense fp16 weight has.

Layout, as MatMulNBits stores it: B is [N, n_blocks * QBLOCK / 2] bytes (K padded to whole blocks),
element c of a row in byte c // 2, the low nibble for even c; scales [N, n_blocks]; zero points
absent (8 for every block), packed uint8 [N, ceil(n_blocks / 2)] (block b in byte b // 2, the low
nibble for even b), or [N, n_blocks] in the scales' dtype. A weight is (code - zero) * scale.

One row (the decode step), with gpu/linear_row.py's prologues (rms, skip_rms, silu_mul):
- ``_q4_tile_kernel``: BLOCK_N whole rows per program in one tile, every code, scale and zero
  point load issued before the wait for the kernel before (PDL: they are constant);
- ``_q4_split_kernel``: rows longer than one tile (down_proj) split along K over a second grid
  axis, the partial sums added in split order by the program that draws the last ticket.
Per quantization block a row's product is scale * (sum q*a - zero * sum a): one multiply per block,
the sums in fp32. The weights are never rounded to the activation dtype here, so results differ
from a GEMM over the dequantized fp16 weight by that rounding (~1e-3 relative in fp16); the order
of every sum is fixed, so a run repeats bit for bit and a captured step equals the eager one.

Several rows (a prompt): ``_q4_matmul_kernel``, tiles of A times tiles of W dequantized in
registers ((q - zero) * scale in fp32, rounded once to the activation dtype, as dequantize_nbits
rounds it) on tensor cores (tl.dot; fp32 activations multiply in IEEE fp32, not TF32). Even and
odd columns of a tile are two products, so the codes need no interleaving.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen import options
from onnxgen.runtime.gpu.launch import LAUNCHES, pdl_launch
from onnxgen.runtime.gpu.linear_row import _activation, _activation_inputs, _plans, _prologue_args, split_scratch
from onnxgen.runtime.gpu.pdl import wait_for_previous

NORM_PROLOGUES = (1, 2)  # rms, skip_rms: statistics over the whole row, so never split along K


@triton.jit
def _block_zeros(zero_ptr, rows, blk, mask, n_blocks, zp_row_bytes, ZERO_KIND: tl.constexpr):
    """The zero point of block ``blk`` of each row, in fp32 (broadcast shape of rows x blk)."""
    if ZERO_KIND == 1:
        zbyte = tl.load(zero_ptr + rows * zp_row_bytes + blk // 2, mask=mask, other=0)
        return tl.where(blk % 2 == 0, zbyte & 0xF, zbyte >> 4).to(tl.float32)
    elif ZERO_KIND == 2:
        return tl.load(zero_ptr + rows * n_blocks + blk, mask=mask, other=0.0).to(tl.float32)
    else:
        return (rows * 0 + blk * 0 + 8).to(tl.float32)


@triton.jit
def _q4_products(
    x_ptr, x2_ptr, gamma_ptr, sum_ptr, b_ptr, scale_ptr, zero_ptr, rows, row_ok, first_block, k, n_blocks,
    row_bytes, zp_row_bytes, PROLOGUE: tl.constexpr, ZERO_KIND: tl.constexpr, QBLOCK: tl.constexpr,
    NB: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """(w[rows, blocks] . p(x), the prologue's sum of squares) in fp32 over the NB quantization
    blocks from ``first_block``: codes, scales and zeros loaded before the wait, activations after."""
    HALF: tl.constexpr = QBLOCK // 2
    blk = first_block + tl.arange(0, NB)
    blk_ok = blk < n_blocks
    byte = blk[:, None] * HALF + tl.arange(0, HALF)[None, :]  # [NB, HALF]: byte c // 2 of element c
    packed = tl.load(
        b_ptr + rows[:, None, None] * row_bytes + byte[None, :, :],
        mask=row_ok[:, None, None] & blk_ok[None, :, None], other=0,
    )  # fmt: skip
    block_mask = row_ok[:, None] & blk_ok[None, :]
    scale = tl.load(scale_ptr + rows[:, None] * n_blocks + blk[None, :], mask=block_mask, other=0.0).to(tl.float32)
    zero = _block_zeros(zero_ptr, rows[:, None], blk[None, :], block_mask, n_blocks, zp_row_bytes, ZERO_KIND)
    wait_for_previous(PDL)
    even = byte * 2
    odd = even + 1
    xe, x2e, ge = _activation_inputs(x_ptr, x2_ptr, gamma_ptr, even, even < k, PROLOGUE)
    xo, x2o, go = _activation_inputs(x_ptr, x2_ptr, gamma_ptr, odd, odd < k, PROLOGUE)
    ae, sqe = _activation(xe, x2e, ge, sum_ptr, even, even < k, PROLOGUE)
    ao, sqo = _activation(xo, x2o, go, sum_ptr, odd, odd < k, PROLOGUE)
    lo = (packed & 0xF).to(tl.float32)
    hi = (packed >> 4).to(tl.float32)
    qa = tl.sum(lo * ae[None, :, :] + hi * ao[None, :, :], axis=2)  # [BLOCK_N, NB]
    a_sum = tl.sum(ae + ao, axis=1)  # [NB]
    dot = tl.sum(scale * (qa - zero * a_sum[None, :]), axis=1)
    squares = tl.sum(tl.sum(sqe + sqo, axis=1), axis=0)
    return dot, squares


@triton.jit
def _q4_tile_kernel(
    x_ptr, x2_ptr, gamma_ptr, sum_ptr, b_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, n, k, n_blocks, row_bytes,
    zp_row_bytes, eps, PROLOGUE: tl.constexpr, ZERO_KIND: tl.constexpr, HAS_BIAS: tl.constexpr,
    QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """y[rows] for BLOCK_N rows whose NB * QBLOCK >= K elements fit one tile."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    dot, squares = _q4_products(
        x_ptr, x2_ptr, gamma_ptr, sum_ptr, b_ptr, scale_ptr, zero_ptr, rows, row_ok, 0, k, n_blocks, row_bytes,
        zp_row_bytes, PROLOGUE, ZERO_KIND, QBLOCK, NB, PDL,
    )  # fmt: skip
    if PROLOGUE == 1 or PROLOGUE == 2:
        dot = dot / tl.sqrt(squares / k + eps)
    if HAS_BIAS:
        dot += bias
    tl.store(out_ptr + rows, dot.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _q4_split_kernel(
    x_ptr, x2_ptr, gamma_ptr, sum_ptr, b_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, ticket_ptr, n, k,
    n_blocks, row_bytes, zp_row_bytes, PROLOGUE: tl.constexpr, ZERO_KIND: tl.constexpr, HAS_BIAS: tl.constexpr,
    QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (i, j): row block i over quantization blocks j * NB .. j * NB + NB - 1; the partial
    sums meet as in linear_row's _linear_split_kernel (PROLOGUE 0 or 3 only)."""
    block = tl.program_id(0)
    split = tl.program_id(1)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    dot, _ = _q4_products(
        x_ptr, x2_ptr, gamma_ptr, sum_ptr, b_ptr, scale_ptr, zero_ptr, rows, row_ok, split * NB, k, n_blocks,
        row_bytes, zp_row_bytes, PROLOGUE, ZERO_KIND, QBLOCK, NB, PDL,
    )  # fmt: skip
    tl.store(part_ptr + split * n + rows, dot, mask=row_ok)
    tl.debug_barrier()  # every thread's partials are stored before the ticket (release)
    splits = tl.num_programs(1)
    ticket = tl.atomic_add(ticket_ptr + block, 1, sem="acq_rel")
    if ticket == splits - 1:
        s = tl.arange(0, BLOCK_S)
        parts = tl.load(
            part_ptr + s[:, None] * n + rows[None, :], mask=(s < splits)[:, None] & row_ok[None, :], other=0.0,
            cache_modifier=".cg",
        )  # fmt: skip
        y = tl.sum(parts, axis=0)
        if HAS_BIAS:
            y += bias
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)
        tl.store(ticket_ptr + block, 0)


@triton.jit
def _q4_matmul_kernel(
    a_ptr, b_ptr, scale_ptr, zero_ptr, bias_ptr, c_ptr, m, n, k, a_stride, c_stride, n_blocks, row_bytes,
    zp_row_bytes, ZERO_KIND: tl.constexpr, HAS_BIAS: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """C[BLOCK_M, BLOCK_N] tile = A @ W^T (+ bias), W dequantized BLOCK_K columns at a time."""
    HALF: tl.constexpr = BLOCK_K // 2
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m
    col_ok = cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    half = tl.arange(0, HALF)
    for start in range(0, k, BLOCK_K):
        even = start + 2 * half  # [HALF]: the even columns of this tile; their bytes are start/2 + half
        ok = even < k
        a_rows = a_ptr + rows[:, None] * a_stride
        a_even = tl.load(a_rows + even[None, :], mask=row_ok[:, None] & ok[None, :], other=0.0)
        a_odd = tl.load(a_rows + even[None, :] + 1, mask=row_ok[:, None] & (even + 1 < k)[None, :], other=0.0)
        wmask = col_ok[:, None] & ok[None, :]
        packed = tl.load(b_ptr + cols[:, None] * row_bytes + (start // 2 + half)[None, :], mask=wmask, other=0)
        blk = even // QBLOCK
        scale = tl.load(scale_ptr + cols[:, None] * n_blocks + blk[None, :], mask=wmask, other=0.0).to(tl.float32)
        zero = _block_zeros(zero_ptr, cols[:, None], blk[None, :], wmask, n_blocks, zp_row_bytes, ZERO_KIND)
        w_lo = (((packed & 0xF).to(tl.float32) - zero) * scale).to(a_ptr.dtype.element_ty)
        w_hi = (((packed >> 4).to(tl.float32) - zero) * scale).to(a_ptr.dtype.element_ty)
        if IEEE:
            acc += tl.dot(a_even, tl.trans(w_lo), input_precision="ieee")
            acc += tl.dot(a_odd, tl.trans(w_hi), input_precision="ieee")
        else:
            acc += tl.dot(a_even, tl.trans(w_lo))
            acc += tl.dot(a_odd, tl.trans(w_hi))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = c_ptr + rows[:, None] * c_stride + cols[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# -- launch configurations ---------------------------------------------------------------------

TILE_LIMIT = 2048  # rows up to this many elements run one tile per program (longer: split along K)


def q4_config(
    n: int, k: int, block_size: int, device: torch.device, opts: options.Options | None = None
) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the one-row 4-bit kernels, from a sweep of each layer alone
    in CUDA graphs on the H200 (bench/gemv_micro.py, docs/benchmarks/2026-12-02-h200-int4.md):
    rows of at most TILE_LIMIT elements in one tile (BLOCK_K >= K), 16 rows per program (8 below
    1,024 rows); longer rows split along K in 512-element tiles, 16 rows per program; 4 warps. A
    row with a norm prologue is never split (its statistics span the row): the launcher widens the
    tile to the row. ``ONNXGEN_GEMV_Q4[_<N>x<K>]`` (option ``gemv_q4``) forces a configuration."""
    forced = (opts or options.current()).gemv_q4.lookup(n, k)
    if forced:
        return forced  # type: ignore[return-value]
    padded = -(-k // block_size) * block_size
    if padded > TILE_LIMIT:
        return 16, max(512, block_size), 4
    return (16 if n >= 1024 else 8), max(block_size, triton.next_power_of_2(padded)), 4


def gemm_q4_config(m: int, n: int, k: int, opts: options.Options | None = None) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the several-row kernel: short prompts in
    16-row tiles (memory-bound: the weight bytes dominate), long ones in 64 x 128 tiles.
    ``ONNXGEN_GEMM_Q4[_<N>x<K>]`` (option ``gemm_q4``) forces a configuration."""
    forced = (opts or options.current()).gemm_q4.lookup(n, k)
    if forced:
        return forced  # type: ignore[return-value]
    if m <= 16:
        return 16, 64, 128, 4, 3
    if m <= 64:
        return 64, 64, 64, 4, 3
    return 64, 128, 64, 8, 3


def _q4_plan(n: int, k: int, block_size: int, device: torch.device) -> tuple[int, int, int]:
    plans, opts = _plans()
    key = ("q4", n, k, block_size, device)
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = q4_config(n, k, block_size, device, opts)
    return plan  # type: ignore[return-value]


# -- launchers ---------------------------------------------------------------------------------


def _check_block(block_size: int) -> None:
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} is not a power of two >= 16")


def _layout(b: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None, n: int, k: int, block_size: int):
    """(codes [N, row bytes], scales [N, n_blocks], zeros or codes as a placeholder, ZERO_KIND)."""
    n_blocks = -(-k // block_size)
    packed = b.reshape(n, -1)
    if packed.shape[1] != n_blocks * block_size // 2:
        raise ValueError(f"B has {packed.shape[1]} bytes per row; {n_blocks} blocks of {block_size} need "
                         f"{n_blocks * block_size // 2}")  # fmt: skip
    zero_kind = 0 if zero_points is None else (1 if zero_points.dtype == torch.uint8 else 2)
    zeros = zero_points.reshape(n, -1) if zero_points is not None else packed
    return packed, scales.reshape(n, n_blocks), zeros, zero_kind


def linear_row_q4(
    x: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    *,
    n: int,
    k: int,
    block_size: int,
    prologue: str = "none",
    x2: torch.Tensor | None = None,
    gamma: torch.Tensor | None = None,
    eps: float = 0.0,
    sum_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """p(x) @ W^T (+ bias) for one row x of K values over MatMulNBits' 4-bit W; returns [N] in x's dtype."""
    _check_block(block_size)
    x = x.reshape(k).contiguous()
    code, x2, gamma, sum_out = _prologue_args(x, prologue, x2, gamma, sum_out)
    packed, scale, zeros, zero_kind = _layout(b, scales, zero_points, n, k, block_size)
    n_blocks = scale.shape[1]
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = _q4_plan(n, k, block_size, x.device)
    block_k = max(block_k, block_size)
    splits = triton.cdiv(n_blocks * block_size, block_k)
    if code in NORM_PROLOGUES and splits > 1:  # statistics span the row: one tile of the whole row
        block_k, splits = triton.next_power_of_2(n_blocks * block_size), 1
    common = dict(PROLOGUE=code, ZERO_KIND=zero_kind, HAS_BIAS=bias is not None, QBLOCK=block_size,
                  BLOCK_N=block_n, NB=block_k // block_size, num_warps=warps)  # fmt: skip
    bias_arg = bias if bias is not None else out
    LAUNCHES["linear_row_q4"] += 1
    if splits == 1:
        _q4_tile_kernel[(triton.cdiv(n, block_n),)](
            x, x2, gamma, sum_out, packed, scale, zeros, bias_arg, out, n, k, n_blocks, packed.shape[1],
            zeros.shape[1], float(eps), **common, **pdl_launch(x, out, sum_out),
        )  # fmt: skip
        return out
    blocks = triton.cdiv(n, block_n)
    parts, tickets = split_scratch(n, splits, blocks, x.device)
    LAUNCHES["linear_row_q4_split"] += 1
    _q4_split_kernel[(blocks, splits)](
        x, x2, gamma, sum_out, packed, scale, zeros, bias_arg, out, parts, tickets, n, k, n_blocks,
        packed.shape[1], zeros.shape[1], **common, BLOCK_S=triton.next_power_of_2(splits),
        **pdl_launch(x, out, parts, tickets),
    )  # fmt: skip
    return out


def matmul_q4(
    a: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    *,
    n: int,
    k: int,
    block_size: int,
) -> torch.Tensor:
    """A @ W^T (+ bias) for A [..., K] over MatMulNBits' 4-bit W; returns [..., N] in A's dtype."""
    _check_block(block_size)
    lead = a.shape[:-1]
    a2 = a.reshape(-1, k)
    if a2.stride(1) != 1:
        a2 = a2.contiguous()
    m = a2.shape[0]
    packed, scale, zeros, zero_kind = _layout(b, scales, zero_points, n, k, block_size)
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0:
        return out.reshape(*lead, n)
    block_m, block_n, block_k, warps, stages = gemm_q4_config(m, n, k)
    LAUNCHES["matmul_q4"] += 1
    _q4_matmul_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        a2, packed, scale, zeros, bias if bias is not None else out, out, m, n, k, a2.stride(0), out.stride(0),
        scale.shape[1], packed.shape[1], zeros.shape[1], ZERO_KIND=zero_kind, HAS_BIAS=bias is not None,
        QBLOCK=block_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=a.dtype == torch.float32,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out.reshape(*lead, n)
