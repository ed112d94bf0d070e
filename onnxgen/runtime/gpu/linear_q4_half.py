"""The one-row 4-bit product in fp16 pair arithmetic (HFMA2): under two instructions per weight,
for fp16 or bf16 activations and integer zero points.

Why: bench/q4_ceiling.py showed the byte and word kernels bound by their arithmetic, not by the
bytes they read (docs/benchmarks/2026-12-07-h100-q4-ceiling.md): with their codes served from
cache they took most of their streaming time. Here a 32-bit word of codes becomes four fp16 pairs
in five integer instructions, and each pair's code - zero and its product into the accumulator
are one fp16x2 instruction each.

Layout: the codes as 32-bit words (gpu/linear_q4_words.py: nibble i of word j is element 8j + i
of the row), taken four words (32 elements, a "group") at a time; a quantization block is a whole
number of groups (QBLOCK >= 32). In word w, (w & 0x000F000F) | 0x64006400 reads as the fp16 pair
(1024 + nibble 0, 1024 + nibble 4); the mask 0x00F000F0 gives (1024 + 16 * nibble 1, ...5), and
w >> 8 nibbles 2, 6 and 3, 7 the same way. Less (1024 + zero), or times 1/16 less (64 + zero), each
is code - zero, exact. So each lane of an fp16 pair accumulator sums eight products: words
0-1 in one accumulator, 2-3 in another; the low lane elements 8j + m, the high lane 8j + 4 + m
(m in 0..3), in the order j, then m. The four lane sums then add in fp32, (first low + first
high) + (second low + second high), and take the block's scale there.

Range: a lane sums 8 products of |code - zero| <= 15 and an activation; fp16 overflows at 65504.
So the row's activations are first scaled by a power of two that puts their largest magnitude in
[64, 128] (a split program's: its part's): a lane then stays at most 8 * 15 * 128 = 15360,
whatever the activations' size; the scale comes off the fp32 result exactly. The one-tile kernels
find that largest magnitude, and a norm's sum of squares, in one reduction each over the whole row
(linear_q4._row_inputs), not one per part: a part's reductions end in barriers. Below the fp16 normal range
(2^-14) an activation scaled so is at most 2^-21 of the largest, and its products' error is
far below the fp32 sum's rounding.

Invariants: the weights (code - zero) are exact; the activations (fp32 after any prologue) are
rounded once to fp16 after the power-of-two scale, which changes none that an fp16 or bf16 value
holds (both fit fp16's mantissa; only a norm prologue's products round). Every sum runs in a
fixed order, so a run repeats bit for bit and a captured step equals the eager one. Under
Triton's interpreter (CI's check) the same values come from Triton ops: each fused multiply-add of
the PTX is computed exactly in fp64 (the product of an 11-bit fp16 activation and a 5-bit integer,
plus an fp16 sum, fits 53 bits) and rounded once to fp16, as fma.rn.f16x2 rounds.
"""

from __future__ import annotations

import triton
import triton.language as tl

from onnxgen.runtime.gpu.launch import interpreting
from onnxgen.runtime.gpu.linear_q4 import _row_bias, _row_inputs, _row_squares, _store_rows
from onnxgen.runtime.gpu.linear_q4_words import _word_loads
from onnxgen.runtime.gpu.linear_row import _activation, _activation_inputs, _prologue_values, merge_splits
from onnxgen.runtime.gpu.pdl import wait_for_previous

# the PTX form on CUDA; Triton ops under the interpreter (it runs no PTX), fixed for the process
PTX_PAIRS = tl.constexpr(not interpreting())
GROUP = tl.constexpr(32)  # elements per group: four words of codes


@triton.jit
def _zero_pairs(zero):
    """(fp16 pair of 1024 + zero, fp16 pair of -(64 + zero)) as int32 bits, from _word_loads' fp32
    zero points (integers 0..15): 1024 has an ulp of 1 and 64 one of 1/16, so both are exact."""
    z = zero.to(tl.int32)
    low = 0x6400 + z
    high = 0xD400 + 16 * z
    return low | (low << 16), high | (high << 16)


def _group_asm() -> str:
    """PTX for one group of one row: four words ($1..$4), their sixteen activation pairs ($5..$20,
    word j's pairs at 5 + 4j.. 8 + 4j), the zero point pairs 1024 + zero ($21) and -(64 + zero)
    ($22). Words 0-1 and 2-3 accumulate apart (eight products per lane each); $0 = (lanes of the
    first made fp32 and added) + (the same of the second)."""
    lines = ["{", ".reg .b32 s, q, v, acc, k16;", ".reg .b16 h0, h1;", ".reg .f32 f0, f1, t;",
             "mov.b32 k16, 0x2C002C00;"]  # fmt: skip
    for j in range(4):
        word = f"${1 + j}"
        for m in range(4):
            pair = f"${5 + 4 * j + m}"
            src = word if m < 2 else "s"
            if m == 2:
                lines.append(f"shr.b32 s, {word}, 8;")
            mask = "0x000F000F" if m % 2 == 0 else "0x00F000F0"
            lines.append(f"lop3.b32 q, {src}, {mask}, 0x64006400, 0xEA;")
            if m % 2 == 0:
                lines.append("sub.rn.f16x2 v, q, $21;")
            else:
                lines.append("fma.rn.f16x2 v, q, k16, $22;")
            if j == 2 and m == 0:
                lines += ["mov.b32 {h0, h1}, acc;", "cvt.f32.f16 f0, h0;", "cvt.f32.f16 f1, h1;", "add.f32 t, f0, f1;"]
            if j in (0, 2) and m == 0:
                lines.append(f"mul.rn.f16x2 acc, v, {pair};")
            else:
                lines.append(f"fma.rn.f16x2 acc, v, {pair}, acc;")
    lines += ["mov.b32 {h0, h1}, acc;", "cvt.f32.f16 f0, h0;", "cvt.f32.f16 f1, h1;", "add.f32 f0, f0, f1;",
              "add.f32 $0, t, f0;", "}"]  # fmt: skip
    return "\n".join(lines)


GROUP_ASM = tl.constexpr(_group_asm())
GROUP_CONSTRAINTS = tl.constexpr("=f," + ",".join(["r"] * 22))


@triton.jit
def _group_sums_ptx(w0, w1, w2, w3, p, low, high):
    """The lanes' sum of each group (module doc), fp32, by _group_asm's PTX."""
    return tl.inline_asm_elementwise(
        asm=GROUP_ASM, constraints=GROUP_CONSTRAINTS,
        args=[w0, w1, w2, w3, p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], p[10], p[11], p[12], p[13],
              p[14], p[15], low, high],
        dtype=tl.float32, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _fp16_fma(v, p_bits, acc, FIRST: tl.constexpr):
    """round_fp16(v * p + acc) (acc absent when FIRST), exact before the one rounding (module doc):
    v an integer code - zero in fp64, p the fp16 activation held in the low 16 bits of p_bits."""
    p = (p_bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float64)
    if FIRST:
        return (v * p).to(tl.float16)
    return (v * p + acc.to(tl.float64)).to(tl.float16)


@triton.jit
def _group_sums_ops(w0, w1, w2, w3, p, zero):
    """_group_sums_ptx's values from Triton ops (the interpreter's form), zero the fp32 zero points."""
    z = zero.to(tl.float64)
    lo = zero.to(tl.float16)
    hi = zero.to(tl.float16)
    for j in tl.static_range(4):
        if j == 0:
            w = w0
        elif j == 1:
            w = w1
        elif j == 2:
            w = w2
        else:
            w = w3
        for m in tl.static_range(4):
            pair = p[4 * j + m]
            v_lo = ((w >> (4 * m)) & 0xF).to(tl.float64) - z
            v_hi = ((w >> (4 * m + 16)) & 0xF).to(tl.float64) - z
            if j == 2 and m == 0:  # the first half's lanes, done
                total = lo.to(tl.float32) + hi.to(tl.float32)
            lo = _fp16_fma(v_lo, pair, lo, (j == 0 or j == 2) and m == 0)
            hi = _fp16_fma(v_hi, pair >> 16, hi, (j == 0 or j == 2) and m == 0)
    return total + (lo.to(tl.float32) + hi.to(tl.float32))


@triton.jit
def _pow2(e):
    """2^e in fp32 for integer e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _row_values(x, x2, gamma, PROLOGUE: tl.constexpr):
    """p(x) in fp32 from raw inputs, rounded as the products take it (_prologue_values)."""
    a, _, _ = _prologue_values(x, x2, gamma, PROLOGUE)
    if PROLOGUE == 0 or PROLOGUE == 3:  # exact in the input dtype, as the other kernels round it
        a = a.to(x.dtype).to(tl.float32)
    return a


@triton.jit
def _scale_exponent(amax):
    """The biased fp32 exponent E of the largest magnitude ``amax``, held at 7 or more: the
    activations are scaled by 2^(133 - E), which puts the largest in [64, 128) (at most 128 once
    rounded; module doc: Range) and keeps the power of two a normal fp32 (an all-zero row then
    takes 2^126: any value works)."""
    return tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 7)


@triton.jit
def _row_exponent(x, x2, gamma, PROLOGUE: tl.constexpr):
    """_scale_exponent of the largest activation of a whole row (_row_inputs' raw inputs): every
    part of a row shares it, so it takes one reduction, not one per part."""
    return _scale_exponent(tl.max(tl.abs(_row_values(x, x2, gamma, PROLOGUE)), axis=0))


@triton.jit
def _part_exponent(a):
    """_scale_exponent of the largest of one part's activations a [NG, 32] (a split program's)."""
    return _scale_exponent(tl.max(tl.max(tl.abs(a), axis=1), axis=0))


@triton.jit
def _quarters(t):
    """The four [..] slices of t [.., 2, 2] by index 2 * i + j of its last two axes."""
    t0, t1 = tl.split(t)  # j = 0, 1: [.., 2]
    a, b = tl.split(t0)
    c, d = tl.split(t1)
    return a, c, b, d  # (0, 0), (0, 1), (1, 0), (1, 1)


@triton.jit
def _activation_pairs(a16, NG: tl.constexpr):
    """The sixteen pair tensors [NG] of a group's fp16 activations a16 [NG, 32], pair 4j + m holding
    element 8j + m in its low half and 8j + 4 + m in its high half, as int32 bits."""
    t = tl.permute(tl.reshape(a16, (NG, 4, 2, 4)), (0, 1, 3, 2))  # [group, j, m, d]
    first, second = tl.split(t)
    low = first.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    bits = low | (second.to(tl.int16, bitcast=True).to(tl.int32) << 16)
    m0, m1, m2, m3 = _quarters(tl.reshape(bits, (NG, 4, 2, 2)))  # pair m of each word: [NG, 4] over j
    p00, p10, p20, p30 = _quarters(tl.reshape(m0, (NG, 2, 2)))
    p01, p11, p21, p31 = _quarters(tl.reshape(m1, (NG, 2, 2)))
    p02, p12, p22, p32 = _quarters(tl.reshape(m2, (NG, 2, 2)))
    p03, p13, p23, p33 = _quarters(tl.reshape(m3, (NG, 2, 2)))
    # pair 4j + m, each [1, NG]: broadcast to the rows by its use
    return (p00[None, :], p01[None, :], p02[None, :], p03[None, :], p10[None, :], p11[None, :], p12[None, :],
            p13[None, :], p20[None, :], p21[None, :], p22[None, :], p23[None, :], p30[None, :], p31[None, :],
            p32[None, :], p33[None, :])  # fmt: skip


@triton.jit
def _part_loads(
    w_ptr, scale_ptr, zero_ptr, rows, row_ok, first_block, n_blocks, row_words, zp_row_bytes, NB: tl.constexpr,
    QBLOCK: tl.constexpr, ZERO_KIND: tl.constexpr,
):  # fmt: skip
    """The constant inputs of NB blocks from ``first_block``, per group: the four words of each
    group ([BLOCK_N, NG] each), the groups' block scales (fp32), zero points (fp32) and zero pairs."""
    NG: tl.constexpr = NB * QBLOCK // GROUP
    words, scale, zero = _word_loads(w_ptr, scale_ptr, zero_ptr, rows, row_ok, first_block, n_blocks, row_words,
                                     zp_row_bytes, NB, QBLOCK, ZERO_KIND)  # fmt: skip
    BN: tl.constexpr = words.shape[0]
    if QBLOCK > GROUP:  # each block's scale and zero point for each of its groups
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BN, NB, QBLOCK // GROUP)), (BN, NG))
        zero = tl.reshape(tl.broadcast_to(zero[:, :, None], (BN, NB, QBLOCK // GROUP)), (BN, NG))
    w02, w13 = tl.split(tl.reshape(words, (BN, NG, 2, 2)))
    w0, w2 = tl.split(w02)
    w1, w3 = tl.split(w13)
    low, high = _zero_pairs(zero)
    return w0, w1, w2, w3, scale, zero, low, high


@triton.jit
def _row_loads(
    w_ptr, scale_ptr, zero_ptr, rows, row_ok, n_blocks, row_words, zp_row_bytes, B0: tl.constexpr, B1: tl.constexpr,
    B2: tl.constexpr, QBLOCK: tl.constexpr, ZERO_KIND: tl.constexpr,
):  # fmt: skip
    """_part_loads of a row's up to three power-of-two parts (B0, B1, B2 blocks; an absent part
    repeats the first's tensors, which no caller reads)."""
    first = _part_loads(w_ptr, scale_ptr, zero_ptr, rows, row_ok, 0, n_blocks, row_words, zp_row_bytes, B0, QBLOCK,
                        ZERO_KIND)  # fmt: skip
    second = first
    third = first
    if B1 > 0:
        second = _part_loads(w_ptr, scale_ptr, zero_ptr, rows, row_ok, B0, n_blocks, row_words, zp_row_bytes, B1,
                             QBLOCK, ZERO_KIND)  # fmt: skip
    if B2 > 0:
        third = _part_loads(w_ptr, scale_ptr, zero_ptr, rows, row_ok, B0 + B1, n_blocks, row_words, zp_row_bytes, B2,
                            QBLOCK, ZERO_KIND)  # fmt: skip
    return first, second, third


@triton.jit
def _part_inputs(x_ptr, x2_ptr, gamma_ptr, first_block, k, PROLOGUE: tl.constexpr, NB: tl.constexpr,
                 QBLOCK: tl.constexpr):  # fmt: skip
    """One part's raw prologue inputs (x, x2, gamma), [NG, 32]: a kernel loads every part's before it
    makes any part's pairs, whose reductions end in barriers that a later load would wait behind."""
    NG: tl.constexpr = NB * QBLOCK // GROUP
    cols = first_block * QBLOCK + tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [NG, 32]
    return _activation_inputs(x_ptr, x2_ptr, gamma_ptr, cols, cols < k, PROLOGUE)


@triton.jit
def _row_part_inputs(
    x_ptr, x2_ptr, gamma_ptr, k, PROLOGUE: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
    QBLOCK: tl.constexpr,
):  # fmt: skip
    """_part_inputs of a row's up to three parts (an absent part repeats the first's, which no caller
    reads) and the whole row's (_row_inputs), all loaded at once right after the wait."""
    first = _part_inputs(x_ptr, x2_ptr, gamma_ptr, 0, k, PROLOGUE, B0, QBLOCK)
    second = first
    third = first
    if B1 > 0:
        second = _part_inputs(x_ptr, x2_ptr, gamma_ptr, B0, k, PROLOGUE, B1, QBLOCK)
    if B2 > 0:
        third = _part_inputs(x_ptr, x2_ptr, gamma_ptr, B0 + B1, k, PROLOGUE, B2, QBLOCK)
    row = _row_inputs(x_ptr, x2_ptr, gamma_ptr, k, PROLOGUE, B0, B1, QBLOCK)
    return first, second, third, row


@triton.jit
def _part_values(
    x, x2, gamma, sum_ptr, first_block, k, PROLOGUE: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr,
):  # fmt: skip
    """One part's p(x) [NG, 32] in fp32 from _part_inputs' raw inputs, rounded as the products take
    it (skip_rms's program 0 writes x + x2 here: _activation)."""
    NG: tl.constexpr = NB * QBLOCK // GROUP
    cols = first_block * QBLOCK + tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [NG, 32]
    a, _ = _activation(x, x2, gamma, sum_ptr, cols, cols < k, PROLOGUE)
    if PROLOGUE == 0 or PROLOGUE == 3:  # exact in the input dtype, as the other kernels round it
        a = a.to(x.dtype).to(tl.float32)
    return a


@triton.jit
def _part_pairs(a, exponent):
    """One part's activations a [NG, 32] (_part_values) as the products take them, scaled by
    2^(133 - exponent) (_scale_exponent) and rounded to fp16: (the sixteen pair tensors, the power
    of two that takes the scale off)."""
    a16 = (a * _pow2(133 - exponent)).to(tl.float16)
    return _activation_pairs(a16, a.shape[0]), _pow2(exponent - 133)


@triton.jit
def _part_dot(w0, w1, w2, w3, scale, zero, low, high, p, down, PTX: tl.constexpr):
    """w . p(x) per row over one part's groups, fp32; PTX: the groups' sums by _group_sums_ptx, else
    by Triton ops (the same bits)."""
    if PTX:  # the pairs [NG] broadcast to every row (inline asm broadcasts its arguments)
        sums = _group_sums_ptx(w0, w1, w2, w3, p, low, high)
    else:
        sums = _group_sums_ops(w0, w1, w2, w3, p, zero)
    return tl.sum(sums * scale, axis=1) * down


@triton.jit
def _part_products(
    w0, w1, w2, w3, scale, zero, low, high, x, x2, gamma, sum_ptr, first_block, k, exponent, PROLOGUE: tl.constexpr,
    NB: tl.constexpr, QBLOCK: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """w . p(x) per row over one part's groups in fp32, from _part_inputs' raw inputs (_part_pairs)."""
    p, down = _part_pairs(_part_values(x, x2, gamma, sum_ptr, first_block, k, PROLOGUE, NB, QBLOCK), exponent)
    return _part_dot(w0, w1, w2, w3, scale, zero, low, high, p, down, PTX)


@triton.jit
def _row_prologue(
    x_ptr, x2_ptr, gamma_ptr, w_ptr, scale_ptr, zero_ptr, rows, row_ok, k, n_blocks, row_words, zp_row_bytes,
    PROLOGUE: tl.constexpr, ZERO_KIND: tl.constexpr, QBLOCK: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
    B2: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """What a whole-row program does up to its first product: every code, scale and zero point of
    the first row block (_row_loads) before the wait for the kernel before, then every activation at
    once (_row_part_inputs) and the row's largest activation's exponent (_row_exponent: a norm's
    statistics and the pair scale come from one reduction over the row). Returns the loads, the
    inputs and the exponent."""
    loads = _row_loads(w_ptr, scale_ptr, zero_ptr, rows, row_ok, n_blocks, row_words, zp_row_bytes, B0, B1, B2,
                       QBLOCK, ZERO_KIND)  # fmt: skip
    wait_for_previous(PDL)
    inputs = _row_part_inputs(x_ptr, x2_ptr, gamma_ptr, k, PROLOGUE, B0, B1, B2, QBLOCK)
    xr, yr, gr = inputs[3]
    return loads, inputs, _row_exponent(xr, yr, gr, PROLOGUE)


@triton.jit
def _q4h_tile_kernel(
    x_ptr, x2_ptr, gamma_ptr, sum_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, n, k, n_blocks, row_words,
    zp_row_bytes, eps, PROLOGUE: tl.constexpr, ZERO_KIND: tl.constexpr, HAS_BIAS: tl.constexpr,
    QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
    PDL: tl.constexpr, PTX: tl.constexpr = PTX_PAIRS,
):  # fmt: skip
    """y[rows] for BLOCK_N whole rows per program, a row's blocks in up to three power-of-two parts;
    every code, scale and zero point is loaded before the wait for the kernel before."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    bias = _row_bias(bias_ptr, rows, row_ok, HAS_BIAS)
    loads, inputs, exponent = _row_prologue(x_ptr, x2_ptr, gamma_ptr, w_ptr, scale_ptr, zero_ptr, rows, row_ok, k,
                                            n_blocks, row_words, zp_row_bytes, PROLOGUE, ZERO_KIND, QBLOCK, B0, B1,
                                            B2, PDL)  # fmt: skip
    a0, a1, a2, a3, s0, z0, l0, h0 = loads[0]
    b0, b1, b2, b3, s1, z1, l1, h1 = loads[1]
    c0, c1, c2, c3, s2, z2, l2, h2 = loads[2]
    xa, ya, ga = inputs[0]
    xb, yb, gb = inputs[1]
    xc, yc, gc = inputs[2]
    xr, yr, gr = inputs[3]
    dot = _part_products(a0, a1, a2, a3, s0, z0, l0, h0, xa, ya, ga, sum_ptr, 0, k, exponent, PROLOGUE, B0, QBLOCK,
                         PTX)  # fmt: skip
    if B1 > 0:
        dot += _part_products(b0, b1, b2, b3, s1, z1, l1, h1, xb, yb, gb, sum_ptr, B0, k, exponent, PROLOGUE, B1,
                              QBLOCK, PTX)  # fmt: skip
    if B2 > 0:
        dot += _part_products(c0, c1, c2, c3, s2, z2, l2, h2, xc, yc, gc, sum_ptr, B0 + B1, k, exponent, PROLOGUE,
                              B2, QBLOCK, PTX)  # fmt: skip
    squares = _row_squares(xr, yr, gr, PROLOGUE)  # after every product: only the store needs it
    _store_rows(dot, squares, bias, out_ptr, rows, row_ok, k, eps, PROLOGUE, HAS_BIAS)


@triton.jit
def _q4h_split_kernel(
    x_ptr, x2_ptr, gamma_ptr, sum_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, ticket_ptr, n, k,
    n_blocks, row_words, zp_row_bytes, PROLOGUE: tl.constexpr, ZERO_KIND: tl.constexpr, HAS_BIAS: tl.constexpr,
    QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
    PTX: tl.constexpr = PTX_PAIRS,
):  # fmt: skip
    """Program (i, j): row block i over blocks j * NB .. j * NB + NB - 1; the partial sums meet in
    linear_row.merge_splits (PROLOGUE 0 or 3 only)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    first = tl.program_id(1) * NB
    bias = _row_bias(bias_ptr, rows, row_ok, HAS_BIAS)
    w0, w1, w2, w3, scale, zero, low, high = _part_loads(w_ptr, scale_ptr, zero_ptr, rows, row_ok, first, n_blocks,
                                                         row_words, zp_row_bytes, NB, QBLOCK, ZERO_KIND)  # fmt: skip
    wait_for_previous(PDL)
    x, x2, gamma = _part_inputs(x_ptr, x2_ptr, gamma_ptr, first, k, PROLOGUE, NB, QBLOCK)
    a = _part_values(x, x2, gamma, sum_ptr, first, k, PROLOGUE, NB, QBLOCK)
    p, down = _part_pairs(a, _part_exponent(a))
    dot = _part_dot(w0, w1, w2, w3, scale, zero, low, high, p, down, PTX)
    merge_splits(dot, bias, part_ptr, ticket_ptr, out_ptr, rows, row_ok, n, BLOCK_S)


@triton.jit
def _q4h_stream_kernel(
    x_ptr, x2_ptr, gamma_ptr, sum_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, n, k, n_blocks, row_words,
    zp_row_bytes, eps, PROLOGUE: tl.constexpr, ZERO_KIND: tl.constexpr, HAS_BIAS: tl.constexpr,
    QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
    PDL: tl.constexpr, PTX: tl.constexpr = PTX_PAIRS,
):  # fmt: skip
    """_q4h_tile_kernel with fewer programs than row blocks (option q4_stream): each program takes
    every num_programs-th block of BLOCK_N rows, makes the activation pairs once for all of them,
    and has the next block's codes, scales and zero points in flight while it sums this one's. The
    same products and sums per row as _q4h_tile_kernel, so the same bits."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_N
    lanes = tl.arange(0, BLOCK_N)
    rows = pid * BLOCK_N + lanes
    row_ok = rows < n
    loads, inputs, exponent = _row_prologue(x_ptr, x2_ptr, gamma_ptr, w_ptr, scale_ptr, zero_ptr, rows, row_ok, k,
                                            n_blocks, row_words, zp_row_bytes, PROLOGUE, ZERO_KIND, QBLOCK, B0, B1,
                                            B2, PDL)  # fmt: skip
    a0, a1, a2, a3, s0, z0, l0, h0 = loads[0]
    b0, b1, b2, b3, s1, z1, l1, h1 = loads[1]
    c0, c1, c2, c3, s2, z2, l2, h2 = loads[2]
    xa, ya, ga = inputs[0]
    xb, yb, gb = inputs[1]
    xc, yc, gc = inputs[2]
    xr, yr, gr = inputs[3]
    p0, down0 = _part_pairs(_part_values(xa, ya, ga, sum_ptr, 0, k, PROLOGUE, B0, QBLOCK), exponent)
    if B1 > 0:
        p1, down1 = _part_pairs(_part_values(xb, yb, gb, sum_ptr, B0, k, PROLOGUE, B1, QBLOCK), exponent)
    if B2 > 0:
        p2, down2 = _part_pairs(_part_values(xc, yc, gc, sum_ptr, B0 + B1, k, PROLOGUE, B2, QBLOCK), exponent)
    squares = _row_squares(xr, yr, gr, PROLOGUE)
    for first in range(pid * BLOCK_N, n, step):
        rows = first + lanes
        row_ok = rows < n
        ahead = rows + step  # the next block's loads go out before this block's sums
        ahead_ok = ahead < n
        upcoming = _row_loads(w_ptr, scale_ptr, zero_ptr, ahead, ahead_ok, n_blocks, row_words, zp_row_bytes, B0,
                              B1, B2, QBLOCK, ZERO_KIND)  # fmt: skip
        n00, n01, n02, n03, ns0, nz0, nl0, nh0 = upcoming[0]
        n10, n11, n12, n13, ns1, nz1, nl1, nh1 = upcoming[1]
        n20, n21, n22, n23, ns2, nz2, nl2, nh2 = upcoming[2]
        bias = _row_bias(bias_ptr, rows, row_ok, HAS_BIAS)
        dot = _part_dot(a0, a1, a2, a3, s0, z0, l0, h0, p0, down0, PTX)
        a0, a1, a2, a3, s0, z0, l0, h0 = n00, n01, n02, n03, ns0, nz0, nl0, nh0
        if B1 > 0:
            dot += _part_dot(b0, b1, b2, b3, s1, z1, l1, h1, p1, down1, PTX)
            b0, b1, b2, b3, s1, z1, l1, h1 = n10, n11, n12, n13, ns1, nz1, nl1, nh1
        if B2 > 0:
            dot += _part_dot(c0, c1, c2, c3, s2, z2, l2, h2, p2, down2, PTX)
            c0, c1, c2, c3, s2, z2, l2, h2 = n20, n21, n22, n23, ns2, nz2, nl2, nh2
        _store_rows(dot, squares, bias, out_ptr, rows, row_ok, k, eps, PROLOGUE, HAS_BIAS)
