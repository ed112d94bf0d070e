"""Linear layers over MatMulNBits' packed 4-bit weights: no dequantized copy of a weight is kept,
and a decode step's product reads a quarter of the bytes a dense fp16 weight has.

Layout, as MatMulNBits stores it: B is [N, n_blocks * QBLOCK / 2] bytes (K padded to whole blocks),
element c of a row in byte c // 2, the low nibble for even c; scales [N, n_blocks]; zero points
absent (8 for every block), packed uint8 [N, ceil(n_blocks / 2)] (block b in byte b // 2, the low
nibble for even b), or [N, n_blocks] in the scales' dtype. A weight is (code - zero) * scale.
One more form is onnxgen's own: int8 [N, n_blocks], a byte per block (ZERO_KIND 3), which
contrib_quant.widen_zero_points makes from the packed 4-bit form at load. Its load has the scales'
address pattern; the packed form's (byte b // 2) gets a layout from which Triton stages the prompt
GEMMs' dequantized weight tile through shared memory instead of handing it to the tensor cores in
registers (compiled for sm_90: docs/benchmarks/2026-12-07-h100-symmetric-and-zero-bytes.md).
8-bit codes (onnxruntime-genai's int8 packages, and the 8-bit layers of mixed ones) take the same
byte kernels with BITS 8: a byte per element, a byte per packed zero point, 128 where they are
absent; the word kernel and the PTX nibble unpacking are 4-bit only.

One row (the decode step), with gpu/linear_row.py's prologues (rms, skip_rms, silu_mul):
- ``_q4_tile_kernel``: BLOCK_N whole rows per program, a row's blocks in up to three power-of-two
  parts; every code, scale and zero point load issued before the wait for the kernel before
  (PDL: they are constant), every part's activations right after it, and a norm's statistics
  reduced once over the whole row (_row_inputs) after the products;
- ``_q4_split_kernel``: rows longer than one tile (down_proj) split along K over a second grid
  axis, the partial sums added in split order by the program that draws the last ticket.
Codes load as [rows, blocks, bytes]; the two nibbles of a byte are joined into element order, so
the activations load as contiguous block rows, and a code becomes a float by the exponent trick
(MAGIC_BITS). Per block a row's product is scale * sum((code - zero) * a), in fp32. The weights are
never rounded to the activation dtype here, so results differ from a GEMM over the dequantized
fp16 weight by that rounding (~1e-3 relative in fp16); the order of every sum is fixed, so a run
repeats bit for bit and a captured step equals the eager one. Where a norm prologue would be
recomputed by very many programs (the lm_head), it runs first as its own kernel (option
``q4_norm_apart``). Option ``q4_row_ready`` (off) makes the byte kernels' weights before the wait
instead, rounded to fp16 for fp16 activations (_ready_weights, _all_made).

Several rows (a prompt), option ``q4_prompt``: ``_q4_matmul_kernel``, tiles of A times tiles of W
dequantized in registers ((code - zero) * scale in fp32, rounded once to the activation dtype, as
dequantize_nbits rounds it) on tensor cores (tl.dot; fp32 activations in IEEE fp32, not TF32); or
``_q4_dequant_blocks_kernel`` (option ``q4_dequant``; ``bytes``: ``_q4_dequant_kernel``) into the
session's one DequantScratch (or, without one, a buffer that lives for the call), then cuBLAS.
Or (``q4_prompt=split``) gpu/linear_q4_split.py's GEMM split along K, for prompts of a few rows.
"""

from __future__ import annotations

from functools import partial

import torch
import triton
import triton.language as tl

from onnxgen import options
from onnxgen.runtime.gpu.dequant_ahead import Chunk, DequantAhead
from onnxgen.runtime.gpu.launch import COMPILE_OPTIONS, LAUNCHES, interpreting, pdl_launch
from onnxgen.runtime.gpu.linear_row import (
    _activation,
    _activation_inputs,
    _plans,
    _prologue_args,
    _prologue_values,
    merge_splits,
    resident_programs,
    split_scratch,
)
from onnxgen.runtime.gpu.pdl import wait_for_previous
from onnxgen.runtime.gpu.rms_norm import fused_rms_norm

NORM_PROLOGUES = (1, 2)  # rms, skip_rms: statistics over the whole row, so never split along K


@triton.jit
def _block_zeros(zero_ptr, rows, blk, mask, n_blocks, zp_row_bytes, ZERO_KIND: tl.constexpr, BITS: tl.constexpr = 4):
    """The zero point of block ``blk`` of each row, in fp32 (broadcast shape of rows x blk): packed
    codes (ZERO_KIND 1: two 4-bit ones per byte, an 8-bit one per byte), a byte per block
    (ZERO_KIND 3, any BITS), floats (2), or absent (0: 2^(BITS - 1))."""
    if ZERO_KIND == 3:  # rows of n_blocks bytes: the scales' address pattern (module doc)
        zero = tl.load(zero_ptr + rows * n_blocks + blk, mask=mask, other=0).to(tl.float32)
    elif ZERO_KIND == 1 and BITS == 8:
        zero = tl.load(zero_ptr + rows * zp_row_bytes + blk, mask=mask, other=0).to(tl.float32)
    elif ZERO_KIND == 1:
        zbyte = tl.load(zero_ptr + rows * zp_row_bytes + blk // 2, mask=mask, other=0)
        zero = tl.where(blk % 2 == 0, zbyte & 0xF, zbyte >> 4).to(tl.float32)
    elif ZERO_KIND == 2:
        zero = tl.load(zero_ptr + rows * n_blocks + blk, mask=mask, other=0.0).to(tl.float32)
    else:
        zero = (rows * 0 + blk * 0 + (1 << (BITS - 1))).to(tl.float32)
    return zero


# fp32 bits of 2^23: a code c < 2^23 OR-ed into the mantissa reads as exactly 2^23 + c, so a nibble
# becomes a float in two integer ops and one add, without the slow integer-to-float conversion
MAGIC_BITS = tl.constexpr(0x4B000000)
MAGIC = tl.constexpr(8388608.0)
# _codes_less_zero_half unpacks nibbles with inline PTX (_half_nibbles_ptx) when compiling for
# CUDA; Triton's interpreter (CI's check of what the kernels compute) runs no PTX, so there the
# same values come from Triton ops. Fixed for the process, as the interpreter is.
PTX_NIBBLES = tl.constexpr(not interpreting())


@triton.jit
def _block_loads(
    b_ptr, scale_ptr, zero_ptr, rows, row_ok, first_block, n_blocks, row_bytes, zp_row_bytes, NB: tl.constexpr,
    QBLOCK: tl.constexpr, ZERO_KIND: tl.constexpr, BITS: tl.constexpr = 4,
):  # fmt: skip
    """The constant inputs of NB quantization blocks from ``first_block`` of each row: the codes
    [BLOCK_N, NB, QBLOCK * BITS / 8] bytes, the block scales [BLOCK_N, NB] and the offset a code's
    magic float loses to become code - zero (2^23 + zero; for float zero points the zero alone)."""
    scale, zero = _block_scales(scale_ptr, zero_ptr, rows, row_ok, first_block, n_blocks, zp_row_bytes, NB,
                                ZERO_KIND, BITS)  # fmt: skip
    return _block_codes(b_ptr, rows, row_ok, first_block, n_blocks, row_bytes, NB, QBLOCK, BITS), scale, zero


@triton.jit
def _block_codes(
    b_ptr, rows, row_ok, first_block, n_blocks, row_bytes, NB: tl.constexpr, QBLOCK: tl.constexpr,
    BITS: tl.constexpr = 4,
):  # fmt: skip
    """The codes of _block_loads alone, [BLOCK_N, NB, QBLOCK * BITS / 8] bytes."""
    BYTES: tl.constexpr = QBLOCK * BITS // 8
    blk = first_block + tl.arange(0, NB)
    block_ok = row_ok[:, None] & (blk < n_blocks)[None, :]
    byte = blk[:, None] * BYTES + tl.arange(0, BYTES)[None, :]
    return tl.load(b_ptr + rows[:, None, None] * row_bytes + byte[None, :, :], mask=block_ok[:, :, None], other=0)


@triton.jit
def _block_scales(
    scale_ptr, zero_ptr, rows, row_ok, first_block, n_blocks, zp_row_bytes, NB: tl.constexpr, ZERO_KIND: tl.constexpr,
    BITS: tl.constexpr = 4,
):  # fmt: skip
    """(scale, offset) of _block_loads alone. Loops over K load these one step ahead: a row's zero
    points (and a few blocks' scales) are a few bytes per step, narrower than the 4 bytes per
    thread cp.async moves, so Triton's pipeline leaves them to a plain load at their use, and a
    step would wait out its memory round trip there. Blocks past ``n_blocks`` read as zeros."""
    blk = first_block + tl.arange(0, NB)
    block_ok = row_ok[:, None] & (blk < n_blocks)[None, :]
    scale = tl.load(scale_ptr + rows[:, None] * n_blocks + blk[None, :], mask=block_ok, other=0.0).to(tl.float32)
    zero = _block_zeros(zero_ptr, rows[:, None], blk[None, :], block_ok, n_blocks, zp_row_bytes, ZERO_KIND, BITS)
    if ZERO_KIND != 2:
        zero += MAGIC
    return scale, zero


@triton.jit
def _block_inputs(x_ptr, x2_ptr, gamma_ptr, first_block, k, PROLOGUE: tl.constexpr, NB: tl.constexpr,
                  QBLOCK: tl.constexpr):  # fmt: skip
    """The prologue's raw inputs (x, x2, gamma) of NB blocks from ``first_block``, [NB, QBLOCK]."""
    cols = (first_block + tl.arange(0, NB))[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    return _activation_inputs(x_ptr, x2_ptr, gamma_ptr, cols, cols < k, PROLOGUE)


@triton.jit
def _block_dot(
    codes, scale, offset, x, x2, gamma, sum_ptr, first_block, k, PROLOGUE: tl.constexpr, ZERO_KIND: tl.constexpr,
    NB: tl.constexpr, QBLOCK: tl.constexpr, BITS: tl.constexpr = 4, READY: tl.constexpr = False,
):  # fmt: skip
    """w . p(x) per row in fp32 over NB blocks from ``first_block``, from _block_inputs' raw inputs
    (a norm's statistics come from the whole row: _row_squares). The codes come in element order
    (_codes_less_zero), so the activations are contiguous rows of the tile; a block's sum of
    (code - zero) * a is multiplied once by its scale. READY: ``codes`` are _ready_weights' weights
    instead (scale and offset unused), and a block's sum is w . a."""
    cols = (first_block + tl.arange(0, NB))[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]  # [NB, QBLOCK]
    a, _ = _activation(x, x2, gamma, sum_ptr, cols, cols < k, PROLOGUE)
    if PROLOGUE == 0 or PROLOGUE == 3:  # exact in the input dtype: half the bytes to share out
        a = a.to(x.dtype)
    if READY:
        dot = tl.sum(tl.sum(codes.to(tl.float32) * a[None, :, :].to(tl.float32), axis=2), axis=1)
    else:
        v = _codes_less_zero(codes, offset, ZERO_KIND, NB, QBLOCK, BITS)
        dot = tl.sum(tl.sum(v * a[None, :, :].to(tl.float32), axis=2) * scale, axis=1)
    return dot


@triton.jit
def _row_inputs(x_ptr, x2_ptr, gamma_ptr, k, PROLOGUE: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
                QBLOCK: tl.constexpr):  # fmt: skip
    """The whole row's raw prologue inputs (x, x2, gamma) as one power-of-two tile covering its parts
    (power_parts: B0 + B1 + B2 <= 2 * B0 blocks), for what a row's parts share: a norm's sum of
    squares (and gpu/linear_q4_half.py's largest activation) in one reduction over the row, where
    one per part cost each part's reductions and barriers."""
    ROW: tl.constexpr = B0 * QBLOCK * (1 + (B1 > 0))
    cols = tl.arange(0, ROW)
    return _activation_inputs(x_ptr, x2_ptr, gamma_ptr, cols, cols < k, PROLOGUE)


@triton.jit
def _row_squares(x, x2, gamma, PROLOGUE: tl.constexpr):
    """A norm prologue's sum of squares over _row_inputs' row, fp32 (0.0 for the other prologues)."""
    if PROLOGUE == 1 or PROLOGUE == 2:
        _, sq, _ = _prologue_values(x, x2, gamma, PROLOGUE)
        squares = tl.sum(sq, axis=0)
    else:
        squares = 0.0
    return squares


@triton.jit
def _codes_less_zero(
    codes, offset, ZERO_KIND: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr, BITS: tl.constexpr = 4
):  # fmt: skip
    """code - zero in fp32, [BLOCK_N, NB, QBLOCK] in element order, from _block_loads' codes and
    offset: 4-bit codes with the two nibbles of each byte joined (2i low, 2i + 1 high), 8-bit ones a
    byte each; each made a float by the exponent trick."""
    wide = codes.to(tl.int32)
    if BITS == 8:
        q = (wide | MAGIC_BITS).to(tl.float32, bitcast=True)
    else:
        lo = ((wide & 0xF) | MAGIC_BITS).to(tl.float32, bitcast=True)
        hi = ((wide >> 4) | MAGIC_BITS).to(tl.float32, bitcast=True)
        q = tl.reshape(tl.join(lo, hi), (codes.shape[0], NB, QBLOCK))
    if ZERO_KIND == 2:
        q -= MAGIC
    return q - offset[:, :, None]


@triton.jit
def _codes_less_zero_half(w, offset, scale, NB: tl.constexpr, QBLOCK: tl.constexpr):
    """(code - zero) * scale of 4-bit codes in fp16 arithmetic, two weights per instruction (the
    compiler pairs them: HADD2, HMUL2): a nibble OR-ed into the mantissa of the fp16 1024 reads as
    exactly 1024 + code, and less 1024 + zero it is code - zero, exact; its fp16 product with the
    scale is rounded once, as the fp32 product (exact: 5 bits times the scale's 11) rounded to fp16
    is. So the weights equal _codes_less_zero's times the scale rounded to fp16, bit for bit
    (tests/test_moe_kernels.py), for integer zero points (ZERO_KIND 0, 1, 3; offset 2^23 + zero).
    Fewer instructions per weight than the fp32 form (instruction count turned out not to bound
    these GEMMs: docs/benchmarks/2026-12-06-h100-grouped-swap-ttft.md). bf16 stays on the fp32
    form: Triton's interpreter, the check CI has, misreads a bitcast to bf16."""
    if PTX_NIBBLES:
        lo, hi = _half_nibbles_ptx(w)
    else:
        wide = w.to(tl.int16)
        lo = ((wide & 0xF) | 0x6400).to(tl.float16, bitcast=True)
        hi = ((wide >> 4) | 0x6400).to(tl.float16, bitcast=True)
    q = tl.reshape(tl.join(lo, hi), (w.shape[0], NB, QBLOCK))
    # offset is 2^23 + zero in fp32 (_block_loads): 1024 + zero, exact in fp16
    less = (offset - (MAGIC - 1024.0)).to(tl.float16)
    return (q - less[:, :, None]) * scale.to(tl.float16)[:, :, None]


@triton.jit
def _half_nibbles_ptx(w):
    """(1024 + low nibble, 1024 + high nibble) of each code byte as fp16, four bytes (one 32-bit
    register) per instance: a byte permute puts bytes i and i + 1 in the low bytes of the two
    halves, and one LOP3 masks a nibble of each half and ORs in the fp16 1024, so two weights
    cost about one instruction. Left to the compiler, each weight took a byte extract, a shift,
    two masks and a pack. Bit for bit the values of _codes_less_zero_half's other branch."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t, u, v;
        prmt.b32 t, $4, $4, 0x1100;
        prmt.b32 u, $4, $4, 0x3322;
        lop3.b32 $0, t, 0x000F000F, 0x64006400, 0xEA;
        lop3.b32 $1, u, 0x000F000F, 0x64006400, 0xEA;
        shr.b32 v, t, 4;
        lop3.b32 $2, v, 0x000F000F, 0x64006400, 0xEA;
        shr.b32 v, u, 4;
        lop3.b32 $3, v, 0x000F000F, 0x64006400, 0xEA;
        }
        """,
        constraints="=r,=r,=r,=r,r", args=[w], dtype=(tl.float16, tl.float16), is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def _dequantized(codes, scale, offset, ZERO_KIND: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr,
                 DTYPE: tl.constexpr, BITS: tl.constexpr = 4):  # fmt: skip
    """_block_loads' codes as weights [BLOCK_N, NB, QBLOCK] in DTYPE, (code - zero) * scale rounded
    once: in fp16 arithmetic for fp16 with integer zero points (_codes_less_zero_half, or for 8-bit
    codes _bytes_less_zero_half), else in fp32."""
    if DTYPE == tl.float16 and ZERO_KIND != 2 and BITS == 8:
        w = _bytes_less_zero_half(codes, offset, scale)
    elif DTYPE == tl.float16 and ZERO_KIND != 2:
        w = _codes_less_zero_half(codes, offset, scale, NB, QBLOCK)
    else:
        w = (_codes_less_zero(codes, offset, ZERO_KIND, NB, QBLOCK, BITS) * scale[:, :, None]).to(DTYPE)
    return w


@triton.jit
def _ready_weights(codes, scale, offset, x_ptr, ZERO_KIND: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr,
                   BITS: tl.constexpr):  # fmt: skip
    """The one-row kernels' weights made before the PDL wait (option ``q4_row_ready``): for fp16
    activations rounded to fp16 (_dequantized: the very weights dequantize_nbits gives the prompt
    path), else fp32. What is left after the wait is the dense kernel's work: the activations,
    a multiply and a sum."""
    if x_ptr.dtype.element_ty == tl.float16:
        w = _dequantized(codes, scale, offset, ZERO_KIND, NB, QBLOCK, tl.float16, BITS)
    else:
        w = _dequantized(codes, scale, offset, ZERO_KIND, NB, QBLOCK, tl.float32, BITS)
    return w


@triton.jit
def _all_made(w, n):
    """A true scalar computed from every weight of ``w`` (_ready_weights'): the PDL wait is made
    conditional on it, because ptxas otherwise sinks the weights' arithmetic past the wait (which
    is no scheduling barrier for register math). True for every launch: a weight's bits, read
    as a non-negative integer, exceed -n for the n >= 1 rows a launch has; n is a runtime value,
    so the compiler cannot fold the test away."""
    if w.dtype == tl.float16:
        bits = w.to(tl.uint16, bitcast=True).to(tl.int32)
    else:
        bits = (w.to(tl.uint32, bitcast=True) >> 1).to(tl.int32)
    return tl.max(tl.max(tl.max(bits, axis=2), axis=1), axis=0) > -n


@triton.jit
def _bytes_less_zero_half(w, offset, scale):
    """(code - zero) * scale of 8-bit codes in fp16 arithmetic: a byte OR-ed into the mantissa of
    the fp16 1024 reads as exactly 1024 + code, less 1024 + zero (exact: at most 1,279) it is
    code - zero, exact, and its product with the scale is rounded once, as the fp32 product (exact:
    9 bits times the scale's 11) rounded to fp16 is. Integer zero points only (offset 2^23 + zero)."""
    q = (w.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
    less = (offset - (MAGIC - 1024.0)).to(tl.float16)
    return (q - less[:, :, None]) * scale.to(tl.float16)[:, :, None]


@triton.jit
def _row_bias(bias_ptr, rows, row_ok, HAS_BIAS: tl.constexpr):
    """The rows' bias in fp32 (0.0 where there is none), loaded before the PDL wait: it is constant."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    else:
        bias = 0.0
    return bias


@triton.jit
def _store_rows(dot, squares, bias, out_ptr, rows, row_ok, k, eps, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The one-tile kernels' end: a norm prologue's 1/rms (from the row's sum of squares), the bias,
    the rows stored in the output's dtype."""
    if PROLOGUE == 1 or PROLOGUE == 2:
        dot = dot / tl.sqrt(squares / k + eps)
    if HAS_BIAS:
        dot += bias
    tl.store(out_ptr + rows, dot.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _q4_tile_kernel(
    x_ptr, x2_ptr, gamma_ptr, sum_ptr, b_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, n, k, n_blocks, row_bytes,
    zp_row_bytes, eps, PROLOGUE: tl.constexpr, ZERO_KIND: tl.constexpr, HAS_BIAS: tl.constexpr,
    QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
    PDL: tl.constexpr, BITS: tl.constexpr, READY: tl.constexpr = False,
):  # fmt: skip
    """y[rows] for BLOCK_N whole rows per program, a row's blocks in up to three power-of-two parts
    (B0 + B1 + B2 >= n_blocks; a part of 0 is absent): every code, scale and zero of the program is
    loaded before the wait for the kernel before, the activations after it. READY: the weights are
    made before the wait too (_ready_weights)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    bias = _row_bias(bias_ptr, rows, row_ok, HAS_BIAS)
    c0, s0, z0 = _block_loads(b_ptr, scale_ptr, zero_ptr, rows, row_ok, 0, n_blocks, row_bytes, zp_row_bytes, B0,
                              QBLOCK, ZERO_KIND, BITS)  # fmt: skip
    if READY:
        c0 = _ready_weights(c0, s0, z0, x_ptr, ZERO_KIND, B0, QBLOCK, BITS)
    if B1 > 0:
        c1, s1, z1 = _block_loads(b_ptr, scale_ptr, zero_ptr, rows, row_ok, B0, n_blocks, row_bytes, zp_row_bytes,
                                  B1, QBLOCK, ZERO_KIND, BITS)  # fmt: skip
        if READY:
            c1 = _ready_weights(c1, s1, z1, x_ptr, ZERO_KIND, B1, QBLOCK, BITS)
    if B2 > 0:
        c2, s2, z2 = _block_loads(b_ptr, scale_ptr, zero_ptr, rows, row_ok, B0 + B1, n_blocks, row_bytes,
                                  zp_row_bytes, B2, QBLOCK, ZERO_KIND, BITS)  # fmt: skip
        if READY:
            c2 = _ready_weights(c2, s2, z2, x_ptr, ZERO_KIND, B2, QBLOCK, BITS)
    if READY:
        made = _all_made(c0, n)
        if B1 > 0:
            made = made & _all_made(c1, n)
        if B2 > 0:
            made = made & _all_made(c2, n)
        if made:
            wait_for_previous(PDL)
    else:
        wait_for_previous(PDL)
    # every part's activations are loaded before any part's sums: each load is a round trip to L2,
    # and a part's reductions end in barriers that later loads would otherwise wait behind
    xa, ya, ga = _block_inputs(x_ptr, x2_ptr, gamma_ptr, 0, k, PROLOGUE, B0, QBLOCK)
    if B1 > 0:
        xb, yb, gb = _block_inputs(x_ptr, x2_ptr, gamma_ptr, B0, k, PROLOGUE, B1, QBLOCK)
    if B2 > 0:
        xc, yc, gc = _block_inputs(x_ptr, x2_ptr, gamma_ptr, B0 + B1, k, PROLOGUE, B2, QBLOCK)
    if PROLOGUE == 1 or PROLOGUE == 2:  # the norm's statistics in one reduction over the whole row
        xr, yr, gr = _row_inputs(x_ptr, x2_ptr, gamma_ptr, k, PROLOGUE, B0, B1, QBLOCK)
    dot = _block_dot(c0, s0, z0, xa, ya, ga, sum_ptr, 0, k, PROLOGUE, ZERO_KIND, B0, QBLOCK, BITS, READY)
    if B1 > 0:
        dot += _block_dot(c1, s1, z1, xb, yb, gb, sum_ptr, B0, k, PROLOGUE, ZERO_KIND, B1, QBLOCK, BITS, READY)
    if B2 > 0:
        dot += _block_dot(c2, s2, z2, xc, yc, gc, sum_ptr, B0 + B1, k, PROLOGUE, ZERO_KIND, B2, QBLOCK, BITS,
                          READY)  # fmt: skip
    squares = 0.0
    if PROLOGUE == 1 or PROLOGUE == 2:  # after every product: only the store needs it
        squares = _row_squares(xr, yr, gr, PROLOGUE)
    _store_rows(dot, squares, bias, out_ptr, rows, row_ok, k, eps, PROLOGUE, HAS_BIAS)


@triton.jit
def _q4_split_kernel(
    x_ptr, x2_ptr, gamma_ptr, sum_ptr, b_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, ticket_ptr, n, k,
    n_blocks, row_bytes, zp_row_bytes, PROLOGUE: tl.constexpr, ZERO_KIND: tl.constexpr, HAS_BIAS: tl.constexpr,
    QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
    BITS: tl.constexpr, READY: tl.constexpr = False,
):  # fmt: skip
    """Program (i, j): row block i over blocks j * NB .. j * NB + NB - 1; the partial sums meet in
    linear_row.merge_splits (PROLOGUE 0 or 3 only). READY as in _q4_tile_kernel."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    first = tl.program_id(1) * NB
    bias = _row_bias(bias_ptr, rows, row_ok, HAS_BIAS)
    codes, scale, zero = _block_loads(b_ptr, scale_ptr, zero_ptr, rows, row_ok, first, n_blocks, row_bytes,
                                      zp_row_bytes, NB, QBLOCK, ZERO_KIND, BITS)  # fmt: skip
    if READY:
        codes = _ready_weights(codes, scale, zero, x_ptr, ZERO_KIND, NB, QBLOCK, BITS)
        if _all_made(codes, n):
            wait_for_previous(PDL)
    else:
        wait_for_previous(PDL)
    x, x2, gamma = _block_inputs(x_ptr, x2_ptr, gamma_ptr, first, k, PROLOGUE, NB, QBLOCK)
    dot = _block_dot(codes, scale, zero, x, x2, gamma, sum_ptr, first, k, PROLOGUE, ZERO_KIND, NB, QBLOCK, BITS,
                     READY)  # fmt: skip
    merge_splits(dot, bias, part_ptr, ticket_ptr, out_ptr, rows, row_ok, n, BLOCK_S)


@triton.jit
def _q4_matmul_kernel(
    a_ptr, b_ptr, scale_ptr, zero_ptr, bias_ptr, c_ptr, m, n, k, a_stride, c_stride, n_blocks, row_bytes,
    zp_row_bytes, ZERO_KIND: tl.constexpr, HAS_BIAS: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, BITS: tl.constexpr, SWAP: tl.constexpr = False,
):  # fmt: skip
    """C[BLOCK_M, BLOCK_N] tile = A @ W^T (+ bias), W dequantized BLOCK_K columns (whole quantization
    blocks, BLOCK_K >= QBLOCK) at a time: each block's codes, scale and zero load once per tile, the
    nibbles are joined into element order and rounded to A's dtype as dequantize_nbits rounds them.
    SWAP: the same tile as (W @ A^T)^T, the weight tile the product's first operand."""
    NBT: tl.constexpr = BLOCK_K // QBLOCK
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m
    col_ok = cols < n
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    scale, zero = _block_scales(scale_ptr, zero_ptr, cols, col_ok, 0, n_blocks, zp_row_bytes, NBT, ZERO_KIND, BITS)
    for first in range(0, n_blocks, NBT):
        codes = _block_codes(b_ptr, cols, col_ok, first, n_blocks, row_bytes, NBT, QBLOCK, BITS)
        # the next step's scales and zero points, loaded a step ahead (_block_scales)
        scale2, zero2 = _block_scales(scale_ptr, zero_ptr, cols, col_ok, first + NBT, n_blocks, zp_row_bytes, NBT,
                                      ZERO_KIND, BITS)  # fmt: skip
        w = tl.reshape(_dequantized(codes, scale, zero, ZERO_KIND, NBT, QBLOCK, a_ptr.dtype.element_ty, BITS),
                       (BLOCK_N, BLOCK_K))  # fmt: skip
        scale, zero = scale2, zero2
        kcols = first * QBLOCK + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * a_stride + kcols[None, :], mask=row_ok[:, None] & (kcols < k)[None, :],
                    other=0.0)  # fmt: skip
        if SWAP:  # W . A^T: the dequantized tile is the tensor cores' first operand, read from registers
            if IEEE:
                acc += tl.dot(w, tl.trans(a), input_precision="ieee")
            else:
                acc += tl.dot(w, tl.trans(a))
        elif IEEE:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
    if SWAP:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
        out = c_ptr + rows[None, :] * c_stride + cols[:, None]
        tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=row_ok[None, :] & col_ok[:, None])
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = c_ptr + rows[:, None] * c_stride + cols[None, :]
        tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _q4_dequant_kernel(
    b_ptr, scale_ptr, zero_ptr, w_ptr, n, k, row_bytes, n_blocks, zp_row_bytes, ZERO_KIND: tl.constexpr,
    QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BYTES: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """W[rows, elements of the bytes] = (code - zero) * scale in fp32, rounded once to W's dtype (as
    contrib_quant.dequantize_nbits computes it, so the GEMM after it sees the very same weight)."""
    ELEMENTS: tl.constexpr = BYTES * 8 // BITS
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    byte = tl.program_id(1) * BYTES + tl.arange(0, BYTES)
    row_ok = rows < n
    ok = row_ok[:, None] & (byte < row_bytes)[None, :]
    packed = tl.load(b_ptr + rows[:, None] * row_bytes + byte[None, :], mask=ok, other=0)
    blk = (byte * (8 // BITS)) // QBLOCK
    scale = tl.load(scale_ptr + rows[:, None] * n_blocks + blk[None, :], mask=ok, other=0.0).to(tl.float32)
    zero = _block_zeros(zero_ptr, rows[:, None], blk[None, :], ok, n_blocks, zp_row_bytes, ZERO_KIND, BITS)
    if BITS == 8:
        w = (packed.to(tl.float32) - zero) * scale
    else:
        lo = ((packed & 0xF).to(tl.float32) - zero) * scale
        hi = ((packed >> 4).to(tl.float32) - zero) * scale
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, ELEMENTS))  # element 2i (low nibble), then 2i + 1
    cols = tl.program_id(1) * ELEMENTS + tl.arange(0, ELEMENTS)
    tl.store(w_ptr + rows[:, None] * k + cols[None, :], w.to(w_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols < k)[None, :])  # fmt: skip


@triton.jit
def _q4_dequant_blocks_kernel(
    b_ptr, scale_ptr, zero_ptr, w_ptr, n, k, row_bytes, n_blocks, zp_row_bytes, ZERO_KIND: tl.constexpr,
    QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr,
):  # fmt: skip
    """_q4_dequant_kernel's weights, bit for bit, NB whole quantization blocks of BLOCK_N rows per
    program: each block's scale and zero point loaded once (the byte form loads them once per
    byte), the codes made floats by the exponent trick and, for fp16 with integer zero points,
    scaled in fp16 arithmetic, which rounds as the fp32 product rounded once does (_dequantized)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    first = tl.program_id(1) * NB
    codes, scale, offset = _block_loads(b_ptr, scale_ptr, zero_ptr, rows, row_ok, first, n_blocks, row_bytes,
                                        zp_row_bytes, NB, QBLOCK, ZERO_KIND, BITS)  # fmt: skip
    w = _dequantized(codes, scale, offset, ZERO_KIND, NB, QBLOCK, w_ptr.dtype.element_ty, BITS)
    cols = (first + tl.arange(0, NB))[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]  # [NB, QBLOCK]
    tl.store(w_ptr + rows[:, None, None] * k + cols[None, :, :], w.to(w_ptr.dtype.element_ty),
             mask=row_ok[:, None, None] & (cols < k)[None, :, :])  # fmt: skip


# -- launch configurations ---------------------------------------------------------------------

TILE_LIMIT = 2048  # rows up to this many elements run one tile per program (longer: split along K)
# the split tiles of longer rows, in elements, by code width: 8-bit rows in 1,024-element tiles were
# the fastest split of both shapes' down_proj on an H100 (docs/benchmarks/2026-12-07-h100-8bit-scaled-ttft.md)
SPLIT_TILE = {4: 512, 8: 1024}


WORDS_MIN_ROWS = 4096  # one-tile products with at least this many rows take the word kernel (gate_up, lm_head)
WORDS_MAX_LM_ROWS = 65536  # ...except vocabulary-wide ones over rows longer than 1,024 (the 1.5B lm_head)


def one_tile_elements(bits: int) -> int:
    """The longest row (elements) a one-row program takes in one tile: TILE_LIMIT 4-bit elements, the
    same bytes for 8-bit codes."""
    return TILE_LIMIT * (8 // bits) // 2


def q4_config(
    n: int, k: int, block_size: int, device: torch.device, opts: options.Options | None = None, bits: int = 4,
    half: bool = False,
) -> tuple[int, int, int, int]:  # fmt: skip
    """(BLOCK_N, BLOCK_K, num_warps, KERNEL) of the one-row 4-bit kernels, from sweeps of each layer
    alone in CUDA graphs and of the whole decode step on the H200 and H100 (bench/gemv_micro.py --words
    --half, bench/step_sweep.py; docs/benchmarks/2026-12-02-h200-int4.md, 2026-12-04-h200-int4-words.md,
    2026-12-07-h100-q4-half.md). ``half``: the product can take the fp16 pair kernel (half_fits); the
    layers _q4_half_table names then take it (KERNEL 2) under option ``q4_half`` ``auto``, every layer
    under ``all``, none under ``off``. Otherwise (_q4_table): rows of at most TILE_LIMIT elements in one
    tile (BLOCK_K >= K), 16 rows per program (8 below 1,024 rows), 4 warps; wide ones (WORDS_MIN_ROWS)
    over the codes as 32-bit words (gpu/linear_q4_words.py, KERNEL 1; 0: the byte kernel), 2 warps for
    rows of at most 1,024 elements; longer rows split along K in 512-element tiles, bytes, 16 rows per
    program (8 below 1,024 rows: the 0.5B down_proj's step was faster so, the 1.5B one's slower at 8;
    docs/benchmarks/2026-12-07-h100-table.md).
    A row with a norm prologue is never split (its statistics span the row): the launcher widens the
    tile to the row, or over twice the one-tile limit runs the norm apart (norm_apart).
    8-bit codes take the byte kernel, with the one-tile limit halved (the same bytes per program) and
    longer rows split in SPLIT_TILE[8]-element tiles, 16 rows per program (8-bit kept the 4-bit rule
    it was built under; the 8-row split is untimed for it).
    ``ONNXGEN_GEMV_Q4[_<N>x<K>]`` (option ``gemv_q4``) forces a configuration (for 8-bit codes,
    with the byte kernel; KERNEL 2 where the pair kernel does not fit, with the word kernel)."""
    opts = opts or options.current()
    forced = opts.gemv_q4.lookup(n, k)
    if forced:
        return (*forced[:3], forced[3] if bits == 4 else 0)  # type: ignore[return-value]
    table = _q4_table(n, k, block_size, bits)
    if bits != 4 or not half or opts.q4_half == "off":
        return table
    pairs = _q4_half_table(n, k, block_size)
    if pairs is not None:
        return pairs
    return (*table[:3], 2) if opts.q4_half == "all" else table


def _q4_table(n: int, k: int, block_size: int, bits: int) -> tuple[int, int, int, int]:
    """q4_config's table of the byte and word kernels (module doc there)."""
    padded = -(-k // block_size) * block_size
    if padded > one_tile_elements(bits):
        return (16 if n >= 1024 or bits == 8 else 8), max(SPLIT_TILE[bits], block_size), 4, 0
    tile = max(block_size, triton.next_power_of_2(padded))
    if bits == 4 and n >= WORDS_MIN_ROWS and (tile <= 1024 or n <= WORDS_MAX_LM_ROWS):
        return 16, tile, 2 if tile <= 1024 else 4, 1
    return (16 if n >= 1024 else 8), tile, 4, 0


def _q4_half_table(n: int, k: int, block_size: int) -> tuple[int, int, int, int] | None:
    """The 4-bit layers the fp16 pair kernel takes by default, and at what configuration; None: the
    byte or word kernel keeps it. From whole-step sweeps on an H100 (bench/step_sweep.py,
    docs/benchmarks/2026-12-07-h100-q4-half.md): rows longer than 1,024 elements gained on every
    layer together (the 1.5B shape), the wide non-vocabulary layer (gate_up) in 16,384-element tiles
    on 2 warps, the others at the byte kernel's tiles. Of rows of at most 1,024 elements (the 0.5B
    shape), only layers of WORDS_MIN_ROWS rows or more, 16 x 1,024 on 2 warps: gate_up gained in its
    tile form, the vocabulary-wide lm_head was level so and gained streamed (stream_programs); qkv,
    o_proj and the split down_proj were each slower or level on the pair kernel."""
    padded = -(-k // block_size) * block_size
    wide = WORDS_MIN_ROWS <= n <= WORDS_MAX_LM_ROWS
    if padded > one_tile_elements(4):
        return (16, max(SPLIT_TILE[4], block_size), 4, 2) if n >= 1024 else None
    tile = max(block_size, triton.next_power_of_2(padded))
    if tile <= 1024:
        return (16, tile, 2, 2) if n >= WORDS_MIN_ROWS else None
    return (8, tile, 2, 2) if wide else ((16 if n >= 1024 else 8), tile, 4, 2)


STREAM_PER_SM = 4  # programs per SM of the streaming form under q4_stream=auto
STREAM_MIN_BLOCKS = 2  # ...where each program then takes at least this many row blocks


def stream_programs(
    n: int, k: int, block_n: int, warps: int, device: torch.device, opts: options.Options | None = None
) -> int:  # fmt: skip
    """Programs of the pair kernel's streaming form for a one-tile product over weight [N, K] in blocks
    of ``block_n`` rows on ``warps`` warps (0: its tile form, a program per row block): the fifth
    value of option ``gemv_q4``'s configuration for that shape where it has one, else option
    ``q4_stream``: P programs per SM (on the CPU interpreter: P programs), or under ``auto`` this
    table: STREAM_PER_SM on 2 warps (the kernel's registers let that many 64-thread programs stay
    resident per SM) where every program gets STREAM_MIN_BLOCKS row blocks or more (one block leaves
    nothing to load ahead). From whole-step sweeps on an H100 (bench/step_sweep.py,
    docs/benchmarks/2026-12-07-h100-q4-stream.md): streamed at 4 per SM, the 1.5B gate_up (2,240
    blocks of 8 rows) gained most and the 0.5B lm_head (9,496 of 16) some; the 0.5B gate_up (608
    blocks: one or two per program) lost, and the 1.5B lm_head on 4 warps (two programs resident)
    was level."""
    opts = opts or options.current()
    forced = opts.gemv_q4.lookup(n, k)
    if forced is not None and len(forced) == 5:
        return resident_programs(forced[4], device)
    if opts.q4_stream != "auto":
        return resident_programs(opts.q4_stream, device)
    programs = resident_programs(STREAM_PER_SM, device) if warps == 2 else 0
    return programs if programs and triton.cdiv(n, block_n) >= STREAM_MIN_BLOCKS * programs else 0


def gemm_q4_config(m: int, n: int, k: int, opts: options.Options | None = None) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP) of the several-row kernel: short prompts in
    16 x 32 tiles (memory-bound: the weight bytes dominate, and narrow tiles make more programs),
    long ones in 128 x 128 tiles (the best of a small sweep on the H200's 0.5B-shape layers). SWAP 1
    multiplies the weight tile by A^T instead: compiled for sm_90, the dequantized tile then feeds
    the tensor cores from registers where SWAP 0 stores it to shared memory first. It beat SWAP 0 at
    1,024 rows on an H100 but both lost to dequantize-then-cuBLAS there (the default past 128 rows;
    docs/benchmarks/2026-12-07-h100-table.md), so it stays off.
    ``ONNXGEN_GEMM_Q4[_<N>x<K>]`` (option ``gemm_q4``) forces a configuration."""
    forced = (opts or options.current()).gemm_q4.lookup(n, k)
    if forced:
        return forced  # type: ignore[return-value]
    if m <= 16:
        return 16, 32, 128, 4, 3, 0
    if m <= 64:
        return 64, 64, 64, 4, 3, 0
    return 128, 128, 64, 8, 3, 0


def _q4_plan(
    n: int, k: int, block_size: int, device: torch.device, bits: int = 4, half: bool = False
) -> tuple[tuple[int, int, int, int], int]:
    """(q4_config's configuration, the pair kernel's streaming programs: stream_programs where the
    configuration takes that kernel, else 0), once per shape while the options stay the same."""
    plans, opts = _plans()
    key = ("q4", n, k, block_size, device, bits, half)
    plan = plans.get(key)
    if plan is None:
        config = q4_config(n, k, block_size, device, opts, bits, half)
        programs = stream_programs(n, k, config[0], config[2], device, opts) if half and config[3] == 2 else 0
        plan = plans[key] = (config, programs)
    return plan  # type: ignore[return-value]


# -- launchers ---------------------------------------------------------------------------------


def _check_block(block_size: int) -> None:
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} is not a power of two >= 16")


def _check_bits(bits: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits={bits}: these kernels take 4- and 8-bit codes")


# the kernels' ZERO_KIND by the zero points' dtype (absent: 0; any float dtype: 2)
ZERO_KINDS = {torch.uint8: 1, torch.int8: 3}


def _layout(
    b: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None, n: int, k: int, block_size: int,
    bits: int = 4,
):  # fmt: skip
    """(codes [N, row bytes], scales [N, n_blocks], zeros or codes as a placeholder, ZERO_KIND)."""
    n_blocks = -(-k // block_size)
    packed = b.reshape(n, -1)
    if packed.shape[1] != n_blocks * block_size * bits // 8:
        raise ValueError(f"B has {packed.shape[1]} bytes per row; {n_blocks} blocks of {block_size} {bits}-bit "
                         f"codes need {n_blocks * block_size * bits // 8}")  # fmt: skip
    zero_kind = 0 if zero_points is None else ZERO_KINDS.get(zero_points.dtype, 2)
    if zero_kind == 3 and zero_points.numel() != n * n_blocks:
        raise ValueError(f"int8 zero points (a byte per block) hold {zero_points.numel()} values; "
                         f"{n} rows of {n_blocks} blocks need {n * n_blocks}")  # fmt: skip
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
    bits: int = 4,
) -> torch.Tensor:
    """p(x) @ W^T (+ bias) for one row x of K values over MatMulNBits' 4- or 8-bit W; returns [N] in
    x's dtype."""
    _check_block(block_size)
    _check_bits(bits)
    x = x.reshape(k).contiguous()
    code, x2, gamma, sum_out = _prologue_args(x, prologue, x2, gamma, sum_out)
    packed, scale, zeros, zero_kind = _layout(b, scales, zero_points, n, k, block_size, bits)
    n_blocks = scale.shape[1]
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    half = bits == 4 and half_fits(x.dtype, zero_kind, block_size)
    (block_n, block_k, warps, kernel), programs = _q4_plan(n, k, block_size, x.device, bits, half)
    split_blocks = max(block_k, block_size) // block_size
    splits = triton.cdiv(n_blocks, split_blocks)
    if code in NORM_PROLOGUES and norm_apart(n, block_n, n_blocks * block_size, bits):
        x, _, _ = fused_rms_norm(x, gamma, eps, skip=x2 if code == 2 else None, sum_out=sum_out if code == 2 else None)
        code = 0
    common = dict(PROLOGUE=code, ZERO_KIND=zero_kind, HAS_BIAS=bias is not None, QBLOCK=block_size,
                  BLOCK_N=block_n, num_warps=warps)  # fmt: skip
    bias_arg = bias if bias is not None else out
    ready = options.current().q4_row_ready  # the byte kernels' form (_ready_weights)
    LAUNCHES["linear_row_q4"] += 1
    words = _as_words(packed) if kernel and bits == 4 else None
    if words is not None:
        return _linear_row_words(x, x2, gamma, sum_out, words, scale, zeros, bias_arg, out, common, n, k, n_blocks,
                                 splits, split_blocks, float(eps), half and kernel == 2, programs)  # fmt: skip
    if splits == 1 or code in NORM_PROLOGUES:  # a norm's statistics span the row: one tile of the whole row
        b0, b1, b2 = power_parts(n_blocks)
        _q4_tile_kernel[(triton.cdiv(n, block_n),)](
            x, x2, gamma, sum_out, packed, scale, zeros, bias_arg, out, n, k, n_blocks, packed.shape[1],
            zeros.shape[1], float(eps), **common, B0=b0, B1=b1, B2=b2, BITS=bits, READY=ready,
            **pdl_launch(x, out, sum_out),
        )  # fmt: skip
        return out
    blocks = triton.cdiv(n, block_n)
    parts, tickets = split_scratch(n, splits, blocks, x.device)
    LAUNCHES["linear_row_q4_split"] += 1
    _q4_split_kernel[(blocks, splits)](
        x, x2, gamma, sum_out, packed, scale, zeros, bias_arg, out, parts, tickets, n, k, n_blocks, packed.shape[1],
        zeros.shape[1], **common, NB=split_blocks, BLOCK_S=triton.next_power_of_2(splits), BITS=bits, READY=ready,
        **pdl_launch(x, out, parts, tickets),
    )  # fmt: skip
    return out


def norm_apart(n: int, block_n: int, padded_k: int, bits: int, opts: options.Options | None = None) -> bool:
    """Whether a norm prologue runs as a kernel of its own before a one-row product instead of in each
    program (option ``q4_norm_apart``, 0: never): where more than that many programs would each
    recompute the row's statistics (the lm_head), or where the row is over twice the one-tile limit,
    so that the whole row the norm needs would be one huge tile (8-bit down_proj under a norm took
    162 us where its split product takes 8: docs/benchmarks/2026-12-07-h100-8bit-scaled-ttft.md)."""
    apart = (opts or options.current()).q4_norm_apart
    long_row = padded_k > 2 * one_tile_elements(bits)
    return bool(apart) and (triton.cdiv(n, block_n) > apart or long_row)


def _as_words(packed: torch.Tensor) -> torch.Tensor | None:
    """The codes [N, row bytes] as int32 words [N, row bytes / 4], where their layout allows (rows
    of whole, 4-byte-aligned words); None where it does not."""
    if packed.stride(1) != 1 or packed.shape[1] % 4 or packed.stride(0) % 4 or packed.data_ptr() % 4:
        return None
    return packed.view(torch.int32)


def _linear_row_words(x, x2, gamma, sum_out, words, scale, zeros, bias_arg, out, common, n, k, n_blocks, splits,
                      split_blocks, eps, half: bool = False, programs: int = 0):  # fmt: skip
    """linear_row_q4's launch over the codes as 32-bit words: a program per row tile, or row tiles
    split along K; by gpu/linear_q4_words.py's kernels, or with ``half`` gpu/linear_q4_half.py's
    (which take no magic-bits argument), whose one-tile products run as ``programs`` streaming
    programs where that is fewer than their row tiles (_q4_plan)."""
    if half:
        from onnxgen.runtime.gpu import linear_q4_half as H

        label, extra, tile_kernel, split_kernel = "linear_row_q4_half", (), H._q4h_tile_kernel, H._q4h_split_kernel
    else:
        from onnxgen.runtime.gpu import linear_q4_words as W

        label, extra, tile_kernel, split_kernel = (
            "linear_row_q4_words",
            (W.MAGIC_WORD,),
            W._q4w_tile_kernel,
            W._q4w_split_kernel,
        )
    LAUNCHES[label] += 1
    tiles = triton.cdiv(n, common["BLOCK_N"])
    if splits == 1 or common["PROLOGUE"] in NORM_PROLOGUES:
        b0, b1, b2 = power_parts(n_blocks)
        if half and 0 < programs < tiles:  # fewer programs, each over every programs-th row block
            LAUNCHES["linear_row_q4_half_stream"] += 1
            tile_kernel, tiles = H._q4h_stream_kernel, programs
        tile_kernel[(tiles,)](
            x, x2, gamma, sum_out, words, scale, zeros, bias_arg, out, n, k, n_blocks, words.shape[1],
            zeros.shape[1], eps, *extra, **common, B0=b0, B1=b1, B2=b2, **pdl_launch(x, out, sum_out),
        )  # fmt: skip
        return out
    parts, tickets = split_scratch(n, splits, tiles, x.device)
    LAUNCHES[f"{label}_split"] += 1
    split_kernel[(tiles, splits)](
        x, x2, gamma, sum_out, words, scale, zeros, bias_arg, out, parts, tickets, n, k, n_blocks, words.shape[1],
        zeros.shape[1], *extra, **common, NB=split_blocks, BLOCK_S=triton.next_power_of_2(splits),
        **pdl_launch(x, out, parts, tickets),
    )  # fmt: skip
    return out


def half_fits(dtype: torch.dtype, zero_kind: int, block_size: int) -> bool:
    """Whether gpu/linear_q4_half.py's fp16 pair kernel takes a product (KERNEL 2): fp16 or bf16
    activations (a bf16 value scaled by a power of two into fp16's range is exact there), integer
    zero points (or none), whole groups of 32 elements per quantization block. Other forms (fp32
    activations, which fp16 would round) take q4_config's byte / word table; one forced to KERNEL 2
    (option gemv_q4) runs the word kernel at the forced tiles."""
    return dtype in (torch.float16, torch.bfloat16) and zero_kind != 2 and block_size >= 32


def power_parts(count: int) -> tuple[int, int, int]:
    """``count`` (a row's quantization blocks) as up to three power-of-two parts, largest first,
    that cover it with the least padding: the two highest bits, then the rest rounded up to a power
    of two (896 elements in blocks of 32 = 28 blocks = 16 + 8 + 4, exactly)."""
    parts: list[int] = []
    rest = count
    while rest and len(parts) < 2:
        part = 1 << (rest.bit_length() - 1)
        parts.append(part)
        rest -= part
    if rest:
        parts.append(triton.next_power_of_2(rest))
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


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
    scratch: DequantScratch | None = None,
    bits: int = 4,
) -> torch.Tensor:
    """A @ W^T (+ bias) for A [..., K] over MatMulNBits' 4- or 8-bit W; returns [..., N] in A's dtype.

    Option ``q4_prompt``: ``dequant`` dequantizes the weight in chunks of rows into ``scratch``
    (the session's one buffer; without it, a buffer of at most DEQUANT_ROWS_ELEMENTS that lives
    for this call) and multiplies each chunk with cuBLAS: the same weight and GEMM as a cached
    fp16 copy, without keeping the copy; ``gemm`` runs the Triton GEMM that dequantizes tiles in
    registers; ``split`` the split-K GEMM (gpu/linear_q4_split.py) for prompts of at most
    SPLIT_MAX_ROWS rows, dequant for longer ones; ``auto`` (the default) the split-K GEMM for
    prompts of at most AUTO_SPLIT_ROWS rows, dequant for longer ones."""
    _check_block(block_size)
    _check_bits(bits)
    lead = a.shape[:-1]
    a2 = a.reshape(-1, k)
    if a2.stride(1) != 1:
        a2 = a2.contiguous()
    m = a2.shape[0]
    packed, scale, zeros, zero_kind = _layout(b, scales, zero_points, n, k, block_size, bits)
    mode = options.current().q4_prompt
    if m and m <= (SPLIT_MAX_ROWS if mode == "split" else AUTO_SPLIT_ROWS if mode == "auto" else 0):
        from onnxgen.runtime.gpu.linear_q4_split import matmul_q4_split

        out = matmul_q4_split(a2, packed, scale, zeros, zero_kind, bias, n=n, k=k, block_size=block_size, bits=bits)
        return out.reshape(*lead, n)
    if m and mode != "gemm":
        out = _dequant_matmul(a2, packed, scale, zeros, zero_kind, bias, n=n, k=k, block_size=block_size,
                              scratch=scratch, bits=bits)  # fmt: skip
        return out.reshape(*lead, n)
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0:
        return out.reshape(*lead, n)
    block_m, block_n, block_k, warps, stages, swap = gemm_q4_config(m, n, k)
    block_k = max(block_k, block_size)  # whole quantization blocks per tile
    LAUNCHES["matmul_q4"] += 1
    _q4_matmul_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        a2, packed, scale, zeros, bias if bias is not None else out, out, m, n, k, a2.stride(0), out.stride(0),
        scale.shape[1], packed.shape[1], zeros.shape[1], ZERO_KIND=zero_kind, HAS_BIAS=bias is not None,
        QBLOCK=block_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=a.dtype == torch.float32,
        BITS=bits, SWAP=bool(swap), num_warps=warps, num_stages=stages, **COMPILE_OPTIONS,
    )  # fmt: skip
    return out.reshape(*lead, n)


SPLIT_MAX_ROWS = 128  # q4_prompt=split: prompts of at most this many rows take the split-K GEMM
# q4_prompt=auto: prompts of at most this many rows take the split-K GEMM, dequantize-then-cuBLAS
# longer ones. With 64-row tiles above 16 rows it beat dequantize-then-cuBLAS on every layer of the
# 1.5B shape at 64 rows on the H100 but o_proj (within 4%): docs/benchmarks/2026-12-05-h100-peers.md;
# up to 128 rows the whole prompt was no slower on the 1.5B shape and faster on the hybrid and MoE
# shapes, whose per-layer dequantizations dominated: docs/benchmarks/2026-12-06-h100-grouped-swap-ttft.md.
AUTO_SPLIT_ROWS = 128

DEQUANT_ROWS_ELEMENTS = 1 << 25  # weight elements dequantized at once (64 MiB in fp16): bounds the buffer
SCRATCH_ELEMENTS = 1 << 24  # a session's DequantScratch holds this much (32 MiB in fp16) at most,
SCRATCH_WHOLE_ELEMENTS = 1 << 25  # or its largest weight up to this (64 MiB), which then fits whole


def scratch_elements(weights: list[int]) -> int:
    """The size of a session's DequantScratch for 4-bit weights of these many elements: the largest
    (at most SCRATCH_ELEMENTS), or the largest of at most SCRATCH_WHOLE_ELEMENTS where that is
    more. A weight that fits whole is multiplied in one GEMM, without chunks whose products are
    each copied into the result; the largest ones (an lm_head, multiplied by many rows only in
    batched steps) go through it in chunks."""
    if not weights:
        return 0
    whole = max((w for w in weights if w <= SCRATCH_WHOLE_ELEMENTS), default=0)
    return max(min(max(weights), SCRATCH_ELEMENTS), whole)


class DequantScratch:
    """The one buffer that every 4-bit GEMM of a session dequantizes its weight chunks into.

    Invariants: it is allocated at load, outside any CUDA-graph capture, and neither freed nor
    regrown while the session lives, so a recorded prompt step keeps a valid address; each use
    writes it and reads it back within one op on the current stream, and a session's ops run in
    stream order, so no two uses overlap. (Two runs of one session on different streams at once
    would overlap here, as they would on the session's KV buffers.) A transient buffer per call
    instead is kept by every recording's memory pool: one per layer and recorded shape."""

    def __init__(self, elements: int, dtype: torch.dtype, device: torch.device):
        self.buffer = torch.empty(elements, dtype=dtype, device=device)
        # option q4_dequant_ahead (read per call): the buffer's two halves, the next chunk dequantized
        # on a second stream
        self.ahead = DequantAhead(self.buffer)

    def join(self) -> None:
        """End of a unit of work (DequantAhead.join)."""
        self.ahead.join()

    def rows_view(self, rows: int, k: int) -> torch.Tensor:
        return self.buffer[: rows * k].view(rows, k)

    def rows_for(self, k: int, dtype: torch.dtype, device: torch.device) -> int:
        """Weight rows of K elements that fit at once (0: this scratch does not serve the call)."""
        if dtype != self.buffer.dtype or device != self.buffer.device:
            return 0
        return self.buffer.numel() // k


# elements of a row each program of the block form dequantizes (whole quantization blocks)
DEQUANT_BLOCKS_ELEMENTS = 512
DEQUANT_FORMS = ("bytes", "blocks")


def dequantize_q4(
    packed: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor, zero_kind: int, *, rows: slice, k: int,
    block_size: int, dtype: torch.dtype, out: torch.Tensor | None = None, bits: int = 4, form: str = "blocks",
) -> torch.Tensor:  # fmt: skip
    """Rows ``rows`` of the 4- or 8-bit weight as a dense [rows, K] tensor of ``dtype``: ``out``
    (contiguous, that shape and dtype) or a new one. ``form`` picks the kernel (option
    ``q4_dequant`` for the prompts' path), both giving the same bits: ``bytes``
    (_q4_dequant_kernel) or ``blocks`` (_q4_dequant_blocks_kernel)."""
    if form not in DEQUANT_FORMS:
        raise ValueError(f"form {form!r} is not one of {', '.join(DEQUANT_FORMS)}")
    lo, hi = rows.start, rows.stop
    if out is None:
        out = torch.empty((hi - lo, k), dtype=dtype, device=packed.device)
    row_bytes = packed.shape[1]
    block_n = 16
    if form == "blocks":
        nb = max(1, DEQUANT_BLOCKS_ELEMENTS // block_size)
        n_blocks = scale.shape[1]
        LAUNCHES["dequant_q4_blocks"] += 1
        _q4_dequant_blocks_kernel[(triton.cdiv(hi - lo, block_n), triton.cdiv(n_blocks, nb))](
            packed[lo:hi], scale[lo:hi], zeros[lo:hi] if zero_kind else zeros, out, hi - lo, k, row_bytes, n_blocks,
            zeros.shape[1], ZERO_KIND=zero_kind, QBLOCK=block_size, BLOCK_N=block_n, NB=nb, BITS=bits, num_warps=4,
            **COMPILE_OPTIONS,
        )  # fmt: skip
        return out
    nbytes = 128
    LAUNCHES["dequant_q4"] += 1
    _q4_dequant_kernel[(triton.cdiv(hi - lo, block_n), triton.cdiv(row_bytes, nbytes))](
        packed[lo:hi], scale[lo:hi], zeros[lo:hi] if zero_kind else zeros, out, hi - lo, k, row_bytes,
        scale.shape[1], zeros.shape[1], ZERO_KIND=zero_kind, QBLOCK=block_size, BLOCK_N=block_n, BYTES=nbytes,
        BITS=bits, num_warps=4, **COMPILE_OPTIONS,
    )  # fmt: skip
    return out


def _dequant_matmul(
    a2, packed, scale, zeros, zero_kind, bias, *, n: int, k: int, block_size: int, scratch: DequantScratch | None,
    bits: int,
) -> torch.Tensor:  # fmt: skip
    """A @ W^T with W dequantized a chunk of rows at a time, into ``scratch`` where it serves (at most
    option ``q4_dequant_chunk_rows`` rows a chunk, where set); each chunk's product is written into
    its columns of the result by cuBLAS (its leading dimension N), not copied there."""
    opts = options.current()
    fit = scratch.rows_for(k, a2.dtype, a2.device) if scratch is not None else 0
    ahead = scratch.ahead if fit and opts.q4_dequant_ahead else None
    if ahead is not None:
        fit = ahead.rows_for(k)  # a chunk per half
    rows = fit if fit else max(16, DEQUANT_ROWS_ELEMENTS // k)
    cap = opts.q4_dequant_chunk_rows
    step = chunk_rows(n, min(rows, cap) if cap else rows)

    form = opts.q4_dequant

    def make(lo: int, hi: int, into: torch.Tensor | None) -> torch.Tensor:
        return dequantize_q4(packed, scale, zeros, zero_kind, rows=slice(lo, hi), k=k, block_size=block_size,
                             dtype=a2.dtype, out=into, bits=bits, form=form)  # fmt: skip

    def chunk(lo: int, hi: int) -> torch.Tensor:
        if ahead is not None:
            return ahead.weight(Chunk(packed.data_ptr(), lo, hi, k, partial(make, lo, hi)))
        return make(lo, hi, scratch.rows_view(hi - lo, k) if fit else None)

    if step >= n:
        result = _linear(a2, chunk(0, n), bias)
        if ahead is not None:
            ahead.read_done()
        return result
    out = torch.empty((a2.shape[0], n), dtype=a2.dtype, device=a2.device)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        weight, columns = chunk(lo, hi), out[:, lo:hi]
        if bias is None:
            torch.mm(a2, weight.t(), out=columns)
        else:
            torch.addmm(bias[lo:hi].to(a2.dtype), a2, weight.t(), out=columns)
        if ahead is not None:
            ahead.read_done()
    return out


CHUNK_ALIGN = 64  # rows: each chunk's output is [M, rows], and cuBLAS takes its Hopper kernels only
# where every leading dimension keeps 16-byte alignment (an odd chunk width fell back to an sm80
# "align2" kernel: docs/benchmarks/2026-12-04-h200-int4-prefill.md)


def chunk_rows(n: int, fit: int) -> int:
    """Rows per chunk of an N-row weight when at most ``fit`` rows fit at once: the fewest chunks,
    of equal size rounded up to CHUNK_ALIGN rows (n itself where it fits)."""
    if n <= fit:
        return n
    if fit < CHUNK_ALIGN:
        return fit
    chunks = -(-n // fit)
    even = -(-n // chunks)
    step = -(-even // CHUNK_ALIGN) * CHUNK_ALIGN
    return step if step <= fit else fit // CHUNK_ALIGN * CHUNK_ALIGN


def _linear(a2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The GEMM the cached-copy path runs (contrib_quant.matmul_nbits: F.linear in A's dtype)."""
    return torch.nn.functional.linear(a2, weight, bias.to(a2.dtype) if bias is not None else None)
