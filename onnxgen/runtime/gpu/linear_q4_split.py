"""A short prompt's product over MatMulNBits' packed 4-bit weights, split along K.

Why: a prompt of a few rows reads the whole weight for little arithmetic, so its product is bound
by how many programs stream the codes at once. gpu/linear_q4.py's tiled GEMM gives each program a
column tile over the whole of K: a narrow layer (qkv, o_proj) makes fewer programs than the
device has SMs, each looping over every block. Here a launch is (column tiles, row tiles, splits);
each program multiplies its own range of K tiles, and the partial sums meet as in the one-row
split kernel (gpu/linear_row.merge_splits): every program stores its tile's fp32 partials, and the
program of that tile that draws the last ticket adds them in split order (the result does not
depend on which program finishes last), adds the bias, stores, and resets the ticket.

Codes as bytes (WORDS 0) take gpu/linear_q4.py's conversion: the two nibbles of a byte joined into
element order. Codes as 32-bit words (WORDS 1) are never reordered: nibble i of word j is element
8j + i of the row, so the K axis of a tile runs as eight products, the i-th over the activations'
columns 8j + i, each a tensor-core dot over BLOCK_K / 8 (at least 16: BLOCK_K >= 128).

Invariants: every weight is (code - zero) * scale in fp32, rounded once to the activations' dtype,
as contrib_quant.dequantize_nbits rounds it (so the products see the weight the dequantizing path
multiplies); fp32 activations multiply in IEEE fp32 (not TF32); every sum runs in a fixed order for
a given launch configuration, so a run repeats bit for bit and a captured prompt step equals the
eager one. The partials' scratch is shared by every launch of one shape (linear_row.split_scratch):
launches on one stream never overlap, and each leaves the tickets at zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen import options
from onnxgen.runtime.gpu.launch import COMPILE_OPTIONS, LAUNCHES
from onnxgen.runtime.gpu.linear_q4 import (
    MAGIC,
    _as_words,
    _block_codes,
    _block_scales,
    _block_zeros,
    _dequantized,
)
from onnxgen.runtime.gpu.linear_q4_words import MAGIC_WORD
from onnxgen.runtime.gpu.linear_row import _multiprocessors, split_scratch


@triton.jit
def _byte_tile(
    a_ptr, b_ptr, scale, zero, rows, row_ok, cols, col_ok, tile, k, a_stride, n_blocks, row_bytes,
    ZERO_KIND: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    BITS: tl.constexpr,
):  # fmt: skip
    """A[rows, K tile] @ W[cols, K tile]^T in fp32 over the codes as bytes (4- or 8-bit), with the
    tile's ``scale`` and ``zero`` (linear_q4._block_scales, loaded a tile ahead by the caller)."""
    NBT: tl.constexpr = BLOCK_K // QBLOCK
    codes = _block_codes(b_ptr, cols, col_ok, tile * NBT, n_blocks, row_bytes, NBT, QBLOCK, BITS)
    w = tl.reshape(_dequantized(codes, scale, zero, ZERO_KIND, NBT, QBLOCK, a_ptr.dtype.element_ty, BITS),
                   (BLOCK_N, BLOCK_K))  # fmt: skip
    return _a_times(a_ptr, rows, row_ok, tile * BLOCK_K + tl.arange(0, BLOCK_K), k, a_stride, w, IEEE)


@triton.jit
def _a_times(a_ptr, rows, row_ok, kcols, k, a_stride, w, IEEE: tl.constexpr):
    """A[rows, kcols] @ w^T in fp32 (w: [BLOCK_N, len(kcols)] in A's dtype)."""
    a = tl.load(a_ptr + rows[:, None] * a_stride + kcols[None, :], mask=row_ok[:, None] & (kcols < k)[None, :],
                other=0.0)  # fmt: skip
    if IEEE:
        return tl.dot(a, tl.trans(w), input_precision="ieee")
    return tl.dot(a, tl.trans(w))


@triton.jit
def _nibble_product(
    a_ptr, rows, row_ok, kword, k, a_stride, words, scale, zero, magic_bits, I: tl.constexpr,
    ZERO_KIND: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """A[rows, columns 8j + I for the tile's words j] @ W'^T in fp32, W' = (nibble I of each word - zero)
    * scale in fp32, rounded to A's dtype ([BLOCK_N, BLOCK_K / 8]; the nibble made a float by the
    exponent trick; the magic bits come as an argument, as in linear_q4_words._nibble)."""
    bits = ((words >> (4 * I)) & 0xF) | magic_bits
    q = bits.to(tl.float32, bitcast=True)
    if ZERO_KIND == 2:
        q = (q - MAGIC) - zero
    else:
        q = q - (zero + MAGIC)  # an integer zero point: exact
    w = (q * scale).to(a_ptr.dtype.element_ty)
    return _a_times(a_ptr, rows, row_ok, kword * 8 + I, k, a_stride, w, IEEE)


@triton.jit
def _word_tile(
    a_ptr, w_ptr, scale_ptr, zero_ptr, rows, row_ok, cols, col_ok, tile, k, a_stride, n_blocks, row_words,
    zp_row_bytes, magic_bits, ZERO_KIND: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    """A[rows, K tile] @ W[cols, K tile]^T in fp32 over the codes as 32-bit words, in eight products
    by nibble place (in place order 0..7: a fixed order)."""
    WPT: tl.constexpr = BLOCK_K // 8
    WPB: tl.constexpr = QBLOCK // 8
    kword = tile * WPT + tl.arange(0, WPT)
    ok = col_ok[:, None] & (kword < row_words)[None, :]
    words = tl.load(w_ptr + cols[:, None] * row_words + kword[None, :], mask=ok, other=0)
    blk = (kword // WPB)[None, :]
    scale = tl.load(scale_ptr + cols[:, None] * n_blocks + blk, mask=ok, other=0.0).to(tl.float32)
    zero = _block_zeros(zero_ptr, cols[:, None], blk, ok, n_blocks, zp_row_bytes, ZERO_KIND)
    acc = _nibble_product(a_ptr, rows, row_ok, kword, k, a_stride, words, scale, zero, magic_bits, 0, ZERO_KIND, IEEE)
    for place in tl.static_range(1, 8):
        acc += _nibble_product(a_ptr, rows, row_ok, kword, k, a_stride, words, scale, zero, magic_bits, place,
                               ZERO_KIND, IEEE)  # fmt: skip
    return acc


@triton.jit
def _q4_split_gemm_kernel(
    a_ptr, b_ptr, scale_ptr, zero_ptr, bias_ptr, c_ptr, part_ptr, ticket_ptr, m, n, k, a_stride, c_stride,
    n_blocks, row_units, zp_row_bytes, tiles_per_split, k_tiles, magic_bits, ZERO_KIND: tl.constexpr,
    HAS_BIAS: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, WORDS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """Program (column tile, row tile, split): C[rows, cols] over K tiles split * tiles_per_split ..
    (the next split's first) - 1; with SPLIT, the partials meet through the tickets (module doc).
    ``row_units``: a weight row's bytes (WORDS 0) or 32-bit words (WORDS 1)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    row_ok = rows < m
    col_ok = cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, k_tiles)
    NBT: tl.constexpr = BLOCK_K // QBLOCK
    if not WORDS:
        scale, zero = _block_scales(scale_ptr, zero_ptr, cols, col_ok, first * NBT, n_blocks, zp_row_bytes, NBT,
                                    ZERO_KIND, BITS)  # fmt: skip
    for tile in range(first, last):
        if WORDS:
            acc += _word_tile(a_ptr, b_ptr, scale_ptr, zero_ptr, rows, row_ok, cols, col_ok, tile, k, a_stride,
                              n_blocks, row_units, zp_row_bytes, magic_bits, ZERO_KIND, QBLOCK, BLOCK_K,
                              IEEE)  # fmt: skip
        else:
            # the next tile's scales and zero points, loaded a tile ahead (linear_q4._block_scales)
            scale2, zero2 = _block_scales(scale_ptr, zero_ptr, cols, col_ok, (tile + 1) * NBT, n_blocks, zp_row_bytes,
                                          NBT, ZERO_KIND, BITS)  # fmt: skip
            acc += _byte_tile(a_ptr, b_ptr, scale, zero, rows, row_ok, cols, col_ok, tile, k, a_stride, n_blocks,
                              row_units, ZERO_KIND, QBLOCK, BLOCK_N, BLOCK_K, IEEE, BITS)  # fmt: skip
            scale, zero = scale2, zero2
    inside = row_ok[:, None] & col_ok[None, :]
    cell = rows[:, None] * n + cols[None, :]
    if SPLIT:
        tl.store(part_ptr + split * m * n + cell, acc, mask=inside)
        tl.debug_barrier()  # every thread's partials are stored before the ticket (release)
        ticket_index = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        splits = tl.num_programs(2)
        ticket = tl.atomic_add(ticket_ptr + ticket_index, 1, sem="acq_rel")
        if ticket == splits - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, splits):
                acc += tl.load(part_ptr + s * m * n + cell, mask=inside, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(c_ptr + rows[:, None] * c_stride + cols[None, :], acc.to(c_ptr.dtype.element_ty), mask=inside)
            tl.store(ticket_ptr + ticket_index, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptr + rows[:, None] * c_stride + cols[None, :], acc.to(c_ptr.dtype.element_ty), mask=inside)


# -- launch configuration ------------------------------------------------------------------------

PROGRAMS_PER_SM = 2  # splits are chosen so that a launch makes about this many programs per SM
SHORT_ROWS = 16  # prompts of at most this many rows take 16-row tiles; longer ones 64-row tiles
# 64-row tiles are 64 columns wide where a layer has at least this many (32-column x K tile) units of
# work per SM (a long K or many columns), else 32 wide: wider tiles halve the programs that re-read
# the activations but leave narrow layers too few programs
WIDE_TILE_WORK_PER_SM = 8


def split_gemm_config(
    m: int, n: int, k: int, block_size: int, sms: int, words_ok: bool, opts: options.Options | None = None
) -> tuple[int, int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, splits, WORDS): K tiles of 128 elements (whole
    quantization blocks), the codes as bytes, and as many splits along K as make about
    PROGRAMS_PER_SM programs on each of ``sms`` SMs (never more splits than K tiles, none empty).
    Tiles: 16 x 32 up to SHORT_ROWS rows; above, 64 rows by 64 columns on layers with at least
    WIDE_TILE_WORK_PER_SM units of work per SM, by 32 on narrower ones. In the sweeps of the 1.5B
    shape's layers these were the fastest split forms (16 x 32 at 16 rows on the H200 and the H100;
    at 64 rows 64-row tiles beat 16 x 32 by 1.2-1.6x on qkv, gate_up and down on the H100, and word
    tiles were slower everywhere: docs/benchmarks/2026-12-05-h200-day.md,
    docs/benchmarks/2026-12-05-h100-peers.md). ``ONNXGEN_GEMM_Q4_SPLIT[_<N>x<K>]`` (option
    ``gemm_q4_split``) forces one; its SPLITS 0 keeps the count this rule gives, and WORDS 1 takes
    the codes as 32-bit words where their layout allows."""
    forced = (opts or options.current()).gemm_q4_split.lookup(n, k)
    if forced:
        block_m, block_n, block_k, warps, stages, splits, words = forced
    elif m <= SHORT_ROWS:
        block_m, block_n, block_k, warps, stages, splits, words = 16, 32, 128, 4, 3, 0, 0
    else:
        work = triton.cdiv(n, 32) * triton.cdiv(k, 128)
        wide = work >= WIDE_TILE_WORK_PER_SM * sms
        block_m, block_n, block_k, warps, stages, splits, words = 64, 64 if wide else 32, 128, 4, 3, 0, 0
    block_k = max(block_k, block_size)
    words = words if words_ok and block_k >= 128 else 0
    k_tiles = triton.cdiv(triton.cdiv(k, block_size) * block_size, block_k)
    if not splits:
        tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
        splits = triton.cdiv(PROGRAMS_PER_SM * sms, tiles)
    splits = max(1, min(splits, k_tiles))
    splits = triton.cdiv(k_tiles, triton.cdiv(k_tiles, splits))  # no split without a K tile
    return block_m, block_n, block_k, warps, stages, splits, words


def _sm_count(device: torch.device) -> int:
    """SMs of a CUDA device; 1 elsewhere (Triton's interpreter on the CPU: one split unless forced)."""
    return _multiprocessors(device.index or 0) if device.type == "cuda" else 1


def matmul_q4_split(
    a2: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor, zero_kind: int,
    bias: torch.Tensor | None, *, n: int, k: int, block_size: int, bits: int = 4,
) -> torch.Tensor:  # fmt: skip
    """A [M, K] @ W^T (+ bias) -> [M, N] in A's dtype, W as linear_q4._layout gives it (4- or 8-bit
    codes; the word tiles take 4-bit ones only)."""
    m = a2.shape[0]
    out = torch.empty((m, n), dtype=a2.dtype, device=a2.device)
    if m == 0:
        return out
    words = _as_words(packed) if bits == 4 else None
    block_m, block_n, block_k, warps, stages, splits, use_words = split_gemm_config(
        m, n, k, block_size, _sm_count(a2.device), words is not None
    )
    codes = words if use_words else packed
    k_tiles = triton.cdiv(scale.shape[1] * block_size, block_k)
    per_split = triton.cdiv(k_tiles, splits)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), splits)
    if splits > 1:
        parts, tickets = split_scratch(m * n, splits, grid[0] * grid[1], a2.device)
    else:
        parts = tickets = out
    LAUNCHES["matmul_q4_split"] += 1
    _q4_split_gemm_kernel[grid](
        a2, codes, scale, zeros, bias if bias is not None else out, out, parts, tickets, m, n, k, a2.stride(0),
        out.stride(0), scale.shape[1], codes.shape[1], zeros.shape[1], per_split, k_tiles, MAGIC_WORD,
        ZERO_KIND=zero_kind, HAS_BIAS=bias is not None, QBLOCK=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, WORDS=bool(use_words), SPLIT=splits > 1, IEEE=a2.dtype == torch.float32, BITS=bits,
        num_warps=warps, num_stages=stages, **COMPILE_OPTIONS,
    )  # fmt: skip
    return out
