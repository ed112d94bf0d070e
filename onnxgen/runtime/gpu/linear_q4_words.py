"""The one-row 4-bit product over 32-bit words of codes: eight weights per integer load lane and
about three instructions per weight (gpu/linear_q4.py's byte kernels spend more on taking bytes
apart than on the arithmetic).

Layout: MatMulNBits' codes read as int32 words [N, row_bytes / 4] (little-endian, so element
8j + i of a row is nibble i of word j, bits 4i..4i+3); a quantization block of QBLOCK elements is
QBLOCK / 8 whole words. Per word, nibble i in {0..3} of ``w`` and of ``w >> 16`` is masked in place
(no shift) and OR-ed into the mantissa of 2^23: the float reads 2^23 + code * 16^(i mod 4), exact
(15 * 16^3 < 2^23). Less 2^23 it is multiplied by the activation scaled by 16^-(i mod 4), also
exact (a power of two), so a product is code * a rounded once, by the FFMA that accumulates it.
The zero point comes off per block as zero * (the block's sum of activations), which every row of
the program shares; then the block's scale. Invariants: every sum runs in a fixed order, so a run
repeats bit for bit and a captured step equals the eager one; fp32 throughout (the weights are
never rounded to the activation dtype).
"""

from __future__ import annotations

import triton
import triton.language as tl

from onnxgen.runtime.gpu.linear_q4 import MAGIC, _block_zeros, _row_bias, _row_inputs, _row_squares, _store_rows
from onnxgen.runtime.gpu.linear_row import _activation, _activation_inputs, merge_splits
from onnxgen.runtime.gpu.pdl import wait_for_previous


@triton.jit
def _word_loads(
    w_ptr, scale_ptr, zero_ptr, rows, row_ok, first_block, n_blocks, row_words, zp_row_bytes, NB: tl.constexpr,
    QBLOCK: tl.constexpr, ZERO_KIND: tl.constexpr,
):  # fmt: skip
    """The constant inputs of NB blocks from ``first_block`` of each row: words [BLOCK_N, NB, QBLOCK / 8],
    scales [BLOCK_N, NB] and zero points [BLOCK_N, NB] in fp32."""
    WPB: tl.constexpr = QBLOCK // 8
    blk = first_block + tl.arange(0, NB)
    block_ok = row_ok[:, None] & (blk < n_blocks)[None, :]
    word = blk[:, None] * WPB + tl.arange(0, WPB)[None, :]
    words = tl.load(w_ptr + rows[:, None, None] * row_words + word[None, :, :], mask=block_ok[:, :, None], other=0)
    scale = tl.load(scale_ptr + rows[:, None] * n_blocks + blk[None, :], mask=block_ok, other=0.0).to(tl.float32)
    zero = _block_zeros(zero_ptr, rows[:, None], blk[None, :], block_ok, n_blocks, zp_row_bytes, ZERO_KIND)
    return words, scale, zero


@triton.jit
def _nibble(words, shifted, magic_bits, I: tl.constexpr):
    """code * 16^(I mod 4) of nibble I of each word, exact in fp32 (the exponent trick, no shift).
    ``magic_bits`` (MAGIC_BITS) comes as a kernel argument, not a constant: with the mask an
    immediate and the magic in a register, the mask-and-or is one LOP3 instead of two."""
    if I < 4:
        src = words
    else:
        src = shifted
    bits = (src & (0xF << (4 * (I % 4)))) | magic_bits
    return bits.to(tl.float32, bitcast=True) - MAGIC


@triton.jit
def _word_columns(first_block, NB: tl.constexpr, QBLOCK: tl.constexpr):
    """The columns of NB blocks from ``first_block`` as [NB, QBLOCK / 8, 8]: word j, nibble i."""
    WPB: tl.constexpr = QBLOCK // 8
    blk = first_block + tl.arange(0, NB)
    return blk[:, None, None] * QBLOCK + tl.arange(0, WPB)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]


@triton.jit
def _word_inputs(x_ptr, x2_ptr, gamma_ptr, first_block, k, PROLOGUE: tl.constexpr, NB: tl.constexpr,
                 QBLOCK: tl.constexpr):  # fmt: skip
    """The raw prologue inputs (x, x2, gamma) of NB blocks from ``first_block``, [NB, QBLOCK / 8, 8]:
    a kernel loads every part's before any part's sums, whose reductions end in barriers that a
    later load would wait behind."""
    cols = _word_columns(first_block, NB, QBLOCK)
    return _activation_inputs(x_ptr, x2_ptr, gamma_ptr, cols, cols < k, PROLOGUE)


@triton.jit
def _word_activations(
    x, x2, gamma, sum_ptr, first_block, k, PROLOGUE: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr,
):  # fmt: skip
    """The activations of NB blocks from ``first_block`` as the word products take them, from
    _word_inputs' raw inputs: for each nibble place i, [NB, QBLOCK / 8] values p(x)[8j + i] scaled
    by 16^-(i mod 4) (exact); the blocks' sums of p(x) (what the zero points take off). A norm's
    statistics come from the whole row (linear_q4._row_squares)."""
    WPB: tl.constexpr = QBLOCK // 8
    cols = _word_columns(first_block, NB, QBLOCK)
    a, _ = _activation(x, x2, gamma, sum_ptr, cols, cols < k, PROLOGUE)
    if PROLOGUE == 0 or PROLOGUE == 3:  # exact in the input dtype, as the byte kernel rounds it
        a = a.to(x.dtype).to(tl.float32)
    block_sum = tl.sum(tl.sum(a, axis=2), axis=1)  # [NB]
    # element 8j + i = 4 * d2 + 2 * d1 + d0: split d0, then d1, then d2
    even, odd = tl.split(tl.reshape(a, (NB, WPB, 2, 2, 2)))
    e0, e1 = tl.split(even)  # elements {0, 4}, {2, 6}
    o0, o1 = tl.split(odd)  # {1, 5}, {3, 7}
    a0, a4 = tl.split(e0)
    a2, a6 = tl.split(e1)
    a1, a5 = tl.split(o0)
    a3, a7 = tl.split(o1)
    return (a0, a1 * 0.0625, a2 * 0.00390625, a3 * 0.000244140625, a4, a5 * 0.0625, a6 * 0.00390625,
            a7 * 0.000244140625, block_sum)  # fmt: skip


@triton.jit
def _word_dot(words, scale, zero, magic_bits, a0, a1, a2, a3, a4, a5, a6, a7, block_sum):
    """w . p(x) per row, fp32, over the blocks of ``words`` [BLOCK_N, NB, QBLOCK / 8] with the
    activations of _word_activations."""
    shifted = words >> 16
    acc = _nibble(words, shifted, magic_bits, 0) * a0[None, :, :]
    acc += _nibble(words, shifted, magic_bits, 1) * a1[None, :, :]
    acc += _nibble(words, shifted, magic_bits, 2) * a2[None, :, :]
    acc += _nibble(words, shifted, magic_bits, 3) * a3[None, :, :]
    acc += _nibble(words, shifted, magic_bits, 4) * a4[None, :, :]
    acc += _nibble(words, shifted, magic_bits, 5) * a5[None, :, :]
    acc += _nibble(words, shifted, magic_bits, 6) * a6[None, :, :]
    acc += _nibble(words, shifted, magic_bits, 7) * a7[None, :, :]
    per_block = tl.sum(acc, axis=2) - zero * block_sum[None, :]
    return tl.sum(per_block * scale, axis=1)


@triton.jit
def _word_products(
    words, scale, zero, x, x2, gamma, sum_ptr, first_block, k, magic_bits, PROLOGUE: tl.constexpr,
    NB: tl.constexpr, QBLOCK: tl.constexpr,
):  # fmt: skip
    """w . p(x) per row over NB blocks from ``first_block`` in fp32, from _word_inputs' raw inputs."""
    a0, a1, a2, a3, a4, a5, a6, a7, block_sum = _word_activations(
        x, x2, gamma, sum_ptr, first_block, k, PROLOGUE, NB, QBLOCK
    )
    return _word_dot(words, scale, zero, magic_bits, a0, a1, a2, a3, a4, a5, a6, a7, block_sum)


@triton.jit
def _q4w_tile_kernel(
    x_ptr, x2_ptr, gamma_ptr, sum_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, n, k, n_blocks, row_words,
    zp_row_bytes, eps, magic_bits, PROLOGUE: tl.constexpr, ZERO_KIND: tl.constexpr, HAS_BIAS: tl.constexpr,
    QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """y[rows] for BLOCK_N whole rows per program, a row's blocks in up to three power-of-two parts;
    every code, scale and zero point is loaded before the wait for the kernel before."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    bias = _row_bias(bias_ptr, rows, row_ok, HAS_BIAS)
    w0, s0, z0 = _word_loads(w_ptr, scale_ptr, zero_ptr, rows, row_ok, 0, n_blocks, row_words, zp_row_bytes, B0,
                             QBLOCK, ZERO_KIND)  # fmt: skip
    if B1 > 0:
        w1, s1, z1 = _word_loads(w_ptr, scale_ptr, zero_ptr, rows, row_ok, B0, n_blocks, row_words, zp_row_bytes,
                                 B1, QBLOCK, ZERO_KIND)  # fmt: skip
    if B2 > 0:
        w2, s2, z2 = _word_loads(w_ptr, scale_ptr, zero_ptr, rows, row_ok, B0 + B1, n_blocks, row_words,
                                 zp_row_bytes, B2, QBLOCK, ZERO_KIND)  # fmt: skip
    wait_for_previous(PDL)
    xa, ya, ga = _word_inputs(x_ptr, x2_ptr, gamma_ptr, 0, k, PROLOGUE, B0, QBLOCK)
    if B1 > 0:
        xb, yb, gb = _word_inputs(x_ptr, x2_ptr, gamma_ptr, B0, k, PROLOGUE, B1, QBLOCK)
    if B2 > 0:
        xc, yc, gc = _word_inputs(x_ptr, x2_ptr, gamma_ptr, B0 + B1, k, PROLOGUE, B2, QBLOCK)
    if PROLOGUE == 1 or PROLOGUE == 2:  # the norm's statistics in one reduction over the whole row
        xr, yr, gr = _row_inputs(x_ptr, x2_ptr, gamma_ptr, k, PROLOGUE, B0, B1, QBLOCK)
    dot = _word_products(w0, s0, z0, xa, ya, ga, sum_ptr, 0, k, magic_bits, PROLOGUE, B0, QBLOCK)
    if B1 > 0:
        dot += _word_products(w1, s1, z1, xb, yb, gb, sum_ptr, B0, k, magic_bits, PROLOGUE, B1, QBLOCK)
    if B2 > 0:
        dot += _word_products(w2, s2, z2, xc, yc, gc, sum_ptr, B0 + B1, k, magic_bits, PROLOGUE, B2, QBLOCK)
    squares = 0.0
    if PROLOGUE == 1 or PROLOGUE == 2:  # after every product: only the store needs it
        squares = _row_squares(xr, yr, gr, PROLOGUE)
    _store_rows(dot, squares, bias, out_ptr, rows, row_ok, k, eps, PROLOGUE, HAS_BIAS)


@triton.jit
def _q4w_split_kernel(
    x_ptr, x2_ptr, gamma_ptr, sum_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, ticket_ptr, n, k,
    n_blocks, row_words, zp_row_bytes, magic_bits, PROLOGUE: tl.constexpr, ZERO_KIND: tl.constexpr,
    HAS_BIAS: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Program (i, j): row block i over blocks j * NB .. j * NB + NB - 1; the partial sums meet in
    linear_row.merge_splits (PROLOGUE 0 or 3 only)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    first = tl.program_id(1) * NB
    bias = _row_bias(bias_ptr, rows, row_ok, HAS_BIAS)
    words, scale, zero = _word_loads(w_ptr, scale_ptr, zero_ptr, rows, row_ok, first, n_blocks, row_words,
                                     zp_row_bytes, NB, QBLOCK, ZERO_KIND)  # fmt: skip
    wait_for_previous(PDL)
    x, x2, gamma = _word_inputs(x_ptr, x2_ptr, gamma_ptr, first, k, PROLOGUE, NB, QBLOCK)
    dot = _word_products(words, scale, zero, x, x2, gamma, sum_ptr, first, k, magic_bits, PROLOGUE, NB, QBLOCK)
    merge_splits(dot, bias, part_ptr, ticket_ptr, out_ptr, rows, row_ok, n, BLOCK_S)


MAGIC_WORD = 0x4B000000  # linear_q4.MAGIC_BITS, passed to the kernels as an argument (see _nibble)
