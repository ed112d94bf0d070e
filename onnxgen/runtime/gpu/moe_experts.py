"""The experts of com.microsoft MoE and QMoE for a decode step (and short prompts) in two Triton
kernels that read each chosen expert's weights where they lie: no dequantized or gathered copy.

The torch path (runtime/ops/contrib_moe.py, ``_gathered``) gathers every (token, expert) pair's
whole weights and dequantizes them to fp32 before its einsums: on the Qwen3.5-35B-A3B shape about
100 MB of fp32 per layer for one token. Here, for P = T * k pairs (pair p: token p // k, expert
chosen[p], read on the device):

    _moe_fc1_kernel   program (p, j): columns j * BLOCK_I .. of the expert's intermediate activation
                      h[p] = act(fc1 x (+ b1)), SwiGLU's gate and up rows from fc1 (interleaved,
                      swiglu_fusion 1; concatenated, 2) or from fc1 and fc3 (0); h is fp32
    _moe_fc2_kernel   program (t, j): rows j * BLOCK_N .. of out[t] = sum over the token's k pairs of
                      routing weight * (fc2 h[p] (+ b2)), the k experts' rows in one tile

Each program streams its rows of one expert (fc2: of the token's k experts) once, so a call reads
each pair's expert codes, scales and zero points once (a token's k experts are distinct; tokens
that share an expert read it once each) and nothing else of size. It is a batch of one-row
products, gpu/linear_q4.py's tile over an expert-dependent base row (row e * N + r of the [E * N,
row bytes] codes). Where the routing is settled (launch.settled_before_launch: written by
torch's top-k, not by the PDL kernel just before), the expert index and every weight load of a
program's first K-chunk are issued before the wait for the kernel before (PDL); the activations
after it. Rows longer than one chunk loop over K after the wait.

Weights: dense [E, N, K] (fp16/bf16/fp32), or QMoE's integer codes [E, N, K * bits / 8] (4 bits,
two per byte, the low nibble first; or 8), scales per row [E, N] or per block along K [E, N, K /
block], zero points absent (2^(bits - 1)) or packed like the codes (per block: [E, N, blocks * bits
/ 8]; per row: [E, N * bits / 8]); biases optional. A block's product is scale * sum((code - zero) *
a) in fp32, codes made floats by linear_q4's exponent trick.

Numerics: everything in fp32, the output rounded once to the activation dtype, as the torch path
does; h stays fp32 between the two kernels (P * inter * 4 bytes, a few KB against megabytes of
codes), so fp16 activations are not rounded twice. The sums differ from the torch path's only in
order (each block's sum before its scale; tests/test_moe_kernels.py bounds the difference at 1e-5
of the largest magnitude in fp32). Every reduction, the routing
sum over a token's pairs included, has a fixed order and there are no atomics: a run repeats bit
for bit, and a captured step equals the eager one. The launches depend on shapes only (grid, one
fp32 [P, inter] and one [T, hidden] output from torch.empty), so the step can be recorded.

Prompts: the kernels serve up to P * E pairs (P: option moe_pairs_per_expert, reasoned below);
longer prompts take gpu/moe_grouped.py's kernels (the pairs grouped by expert on the device, each
expert read once per tile of its pairs). Neither reads the routing on the host, so a prompt of any
length runs without the torch path's host-reading grouped form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from onnxgen import options
from onnxgen.runtime.gpu.launch import KERNEL_DTYPES, LAUNCHES, pdl_launch, settled_before_launch
from onnxgen.runtime.gpu.linear_q4 import MAGIC, _block_codes, _block_scales, _codes_less_zero
from onnxgen.runtime.gpu.pdl import wait_for_previous

# The kernels read one expert's weights per pair, so a call reads up to pairs / E times the bytes
# of all the layer's experts, where the grouped kernels (gpu/moe_grouped.py) read each chosen
# expert once per tile of its pairs, for a sort and a few more launches and tiles padded to whole
# rows. Option moe_pairs_per_expert (ONNXGEN_MOE_PAIRS_PER_EXPERT) sets how many pairs per expert a
# prompt may bring here before the grouped kernels take it (a number, 0.25 by default): on the
# 35B-A3B shape (256 experts, k = 8) P pairs per expert are a 32 * P-token chunk. Few pairs per
# expert read few experts twice, and here each program's one-row products start at once; many pairs
# read most experts many times, and the grouped tiles read each once (bench/moe_prompt.py times
# both on that layer).
# the largest quantization block the grouped kernels (gpu/moe_grouped.py) take: a K step of theirs
# spans whole blocks, and a [tile, block] weight tile of a larger one would not stay in registers
GROUPED_MAX_BLOCK = 128
# the largest top k the fc2 tile holds (the token's k experts side by side in one program)
MAX_TOP_K = 32
# weight bytes one program holds per K-chunk, in WARPS warps: fc1's tile as gpu/linear_q4's one-row
# 4-bit tile (16 rows of 2,048 codes, linear_q4.q4_config), fc2's half that (its tile is [k, rows,
# blocks, block] and needs more registers per weight: at 16 KB ptxas spills it for sm_90, at 8 KB
# it does not; nor fc1's at 16 KB in 8 warps, where 4 warps spill)
_FC1_BYTES = 16384
_FC2_BYTES = 8192
WARPS = 8
# the largest quantization block one compute block spans (a larger block is the torch path's)
MAX_BLOCK = 2048
# activation_type as the kernels' ACT
ACTIVATIONS = {"identity": 0, "relu": 1, "gelu": 2, "silu": 3, "swiglu": 4}


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of every expert, as MoE or QMoE holds it (see the module docstring)."""

    weight: torch.Tensor  # dense [E, N, K], or uint8 codes [E, N, >= K * bits / 8]
    inner: int  # K
    bits: int = 0  # 0: dense; 4 or 8: integer codes
    scales: torch.Tensor | None = None  # [E, N] or [E, N, K / block]
    zeros: torch.Tensor | None = None  # uint8, packed like the codes
    bias: torch.Tensor | None = None  # [E, N]


# -- the weight tiles ----------------------------------------------------------------------------


@triton.jit
def _expert_loads(
    w_ptr, s_ptr, z_ptr, e, r, row_ok, first, n_blocks, n, k, row_len, z_len, BITS: tl.constexpr,
    PER_ROW: tl.constexpr, ZERO_KIND: tl.constexpr, QBLOCK: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """The constant inputs of compute blocks ``first`` .. ``first + NB - 1`` (QBLOCK elements of K
    each) of rows ``r`` of experts ``e`` (int64 vectors of R): (weights, scale [R, NB] fp32, offset
    [R, NB] fp32). Dense (BITS 0): the weights [R, NB, QBLOCK] in their dtype, scale and offset
    unused. Codes: [R, NB, QBLOCK * BITS / 8] bytes; offset = 2^23 + zero, what a code's magic float
    loses to become code - zero. Per-block scales make QBLOCK the quantization block; per-row ones
    any power of two. ZERO_KIND 0: no zero points (2^(BITS - 1)); 1: packed per block along the row;
    3: per row, packed along the expert's rows, or (per-block scales) int8 a byte per block, loaded
    as the scales are (linear_q4's ZERO_KIND 3). _expert_codes and _expert_scales are its two halves
    (loops over K load the scales a step ahead)."""
    scale, offset = _expert_scales(s_ptr, z_ptr, e, r, row_ok, first, n_blocks, n, z_len, BITS, PER_ROW, ZERO_KIND,
                                   NB)  # fmt: skip
    w = _expert_codes(w_ptr, e, r, row_ok, first, n_blocks, n, k, row_len, BITS, PER_ROW, QBLOCK, NB)
    return w, scale, offset


@triton.jit
def _expert_codes(
    w_ptr, e, r, row_ok, first, n_blocks, n, k, row_len, BITS: tl.constexpr, PER_ROW: tl.constexpr,
    QBLOCK: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """The weights of _expert_loads alone."""
    g = e * n + r  # the row in the [E * N, row_len] view of the weights
    # one branch per form and one return: the compiler visits what follows a return in a branch
    if BITS == 0:
        blk = first + tl.arange(0, NB)
        cols = blk[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
        ok = (row_ok[:, None] & (blk < n_blocks)[None, :])[:, :, None] & (cols < k)[None, :, :]
        w = tl.load(w_ptr + g[:, None, None] * row_len + cols[None, :, :], mask=ok, other=0.0)
    elif not PER_ROW:  # QMoE's block-wise form (4- or 8-bit) is MatMulNBits' layout row by row
        w = _block_codes(w_ptr, g, row_ok, first, n_blocks, row_len, NB, QBLOCK, BITS)
    else:
        blk = first + tl.arange(0, NB)
        block_ok = row_ok[:, None] & (blk < n_blocks)[None, :]
        BYTES: tl.constexpr = QBLOCK * BITS // 8
        byte = blk[:, None] * BYTES + tl.arange(0, BYTES)[None, :]
        ok = block_ok[:, :, None] & (byte < row_len)[None, :, :]
        w = tl.load(w_ptr + g[:, None, None] * row_len + byte[None, :, :], mask=ok, other=0)
    return w


@triton.jit
def _expert_scales(
    s_ptr, z_ptr, e, r, row_ok, first, n_blocks, n, z_len, BITS: tl.constexpr, PER_ROW: tl.constexpr,
    ZERO_KIND: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """(scale, offset) of _expert_loads alone (0.0, 0.0 for dense weights)."""
    g = e * n + r
    if BITS == 0:
        scale = 0.0
        offset = 0.0
    elif not PER_ROW:  # block-wise, as MatMulNBits (zero points: none, packed, or a byte per block: ZERO_KIND 3)
        scale, offset = _block_scales(s_ptr, z_ptr, g, row_ok, first, n_blocks, z_len, NB, ZERO_KIND, BITS)
    else:  # per row (zero points: none or packed per row)
        empty = tl.zeros((r.shape[0], NB), tl.float32)
        scale = tl.load(s_ptr + g, mask=row_ok, other=0.0).to(tl.float32)[:, None] + empty
        if ZERO_KIND == 3:  # per row, packed along the expert's rows
            if BITS == 4:
                zbyte = tl.load(z_ptr + e * z_len + r // 2, mask=row_ok, other=0)
                zrow = tl.where(r % 2 == 0, zbyte & 0xF, zbyte >> 4).to(tl.float32)
            else:
                zrow = tl.load(z_ptr + e * z_len + r, mask=row_ok, other=0).to(tl.float32)
            zero = zrow[:, None] + empty
        else:
            zero = empty + (1 << (BITS - 1))
        offset = zero + MAGIC
    return scale, offset


@triton.jit
def _dots(w, scale, offset, a, GROUPS: tl.constexpr, BITS: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr):
    """The rows' products with the activations, [GROUPS, R / GROUPS] fp32: w, scale, offset from
    _expert_loads over R rows, a [GROUPS, NB, QBLOCK] fp32, group g's rows against a[g]. Per block
    sum((code - zero) * a), then times the block's scale."""
    if BITS == 0:
        v = w.to(tl.float32)
    else:
        v = _codes_less_zero(w, offset, 0, NB, QBLOCK, BITS)
    ROWS: tl.constexpr = v.shape[0] // GROUPS
    per_block = tl.sum(tl.reshape(v, (GROUPS, ROWS, NB, QBLOCK)) * a[:, None, :, :], axis=3)
    if BITS != 0:
        per_block = per_block * tl.reshape(scale, (GROUPS, ROWS, NB))
    return tl.sum(per_block, axis=2)


@triton.jit
def _chunk_activations(x_ptr, rows, rows_ok, first, k, NB: tl.constexpr, QBLOCK: tl.constexpr):
    """x[rows, blocks first .. first + NB - 1] as [len(rows), NB, QBLOCK] fp32 (rows K apart)."""
    cols = (first + tl.arange(0, NB))[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    ok = rows_ok[:, None, None] & (cols < k)[None, :, :]
    return tl.load(x_ptr + rows[:, None, None] * k + cols[None, :, :], mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _row_activations(x_ptr, first, k, NB: tl.constexpr, QBLOCK: tl.constexpr):
    """x[blocks first .. first + NB - 1] of one row as [1, NB, QBLOCK] fp32."""
    cols = (first + tl.arange(0, NB))[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    return tl.load(x_ptr + cols, mask=cols < k, other=0.0).to(tl.float32)[None, :, :]


@triton.jit
def _act(gate, up, alpha, beta, limit, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """contrib_moe._activation in fp32: SwiGLU gate * sigmoid(alpha * gate) * (up + beta) (gate
    clamped above, up both sides, at the limit), relu, gelu (tanh form), silu, identity."""
    if ACT == 4:
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        return gate / (1.0 + tl.exp(-alpha * gate)) * (up + beta)
    elif ACT == 1:
        return tl.maximum(gate, 0.0)
    elif ACT == 2:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        return 0.5 * gate * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * inner)))  # 1 + tanh(inner)
    elif ACT == 3:
        return gate / (1.0 + tl.exp(-gate))
    else:
        return gate


# -- the kernels ---------------------------------------------------------------------------------


@triton.jit
def _moe_fc1_kernel(
    x_ptr, chosen_ptr, h_ptr, w_ptr, s_ptr, z_ptr, b_ptr, w3_ptr, s3_ptr, z3_ptr, b3_ptr, top_k, inter, hidden,
    n1, n3, row_len, z_len, n_blocks, gate_step, up_step, up_offset, alpha, beta, limit, ACT: tl.constexpr,
    HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr, BITS: tl.constexpr, PER_ROW: tl.constexpr,
    ZERO_KIND: tl.constexpr, QBLOCK: tl.constexpr, NB: tl.constexpr, BLOCK_I: tl.constexpr,
    EARLY: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """h[pair, cols] = act(gate rows . x[token] (+ bias), up rows . x[token] (+ bias)) in fp32, for
    columns cols of the pair's expert: gate row c * gate_step (of w), up row c * up_step + up_offset
    (of w3: fc3, or fc1 again for the fused layouts)."""
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    col_ok = cols < inter
    token = pair // top_k
    if not EARLY:
        wait_for_previous(PDL)
    e = tl.load(chosen_ptr + pair + cols * 0).to(tl.int64)  # the pair's expert, once per column
    gate_rows = cols * gate_step
    up_rows = cols * up_step + up_offset
    gw, gs, gz = _expert_loads(w_ptr, s_ptr, z_ptr, e, gate_rows, col_ok, 0, n_blocks, n1, hidden, row_len, z_len,
                               BITS, PER_ROW, ZERO_KIND, QBLOCK, NB)  # fmt: skip
    if ACT == 4:
        uw, us, uz = _expert_loads(w3_ptr, s3_ptr, z3_ptr, e, up_rows, col_ok, 0, n_blocks, n3, hidden, row_len,
                                   z_len, BITS, PER_ROW, ZERO_KIND, QBLOCK, NB)  # fmt: skip
    if HAS_BIAS:
        gate_bias = tl.load(b_ptr + e * n1 + gate_rows, mask=col_ok, other=0.0).to(tl.float32)
        if ACT == 4:
            up_bias = tl.load(b3_ptr + e * n3 + up_rows, mask=col_ok, other=0.0).to(tl.float32)
    if EARLY:
        wait_for_previous(PDL)
    x_row = x_ptr + token * hidden
    a = _row_activations(x_row, 0, hidden, NB, QBLOCK)
    gate = tl.reshape(_dots(gw, gs, gz, a, 1, BITS, NB, QBLOCK), (BLOCK_I,))
    up = gate
    if ACT == 4:
        up = tl.reshape(_dots(uw, us, uz, a, 1, BITS, NB, QBLOCK), (BLOCK_I,))
    for first in range(NB, n_blocks, NB):  # rows longer than one chunk (fresh names: nothing carried)
        gw2, gs2, gz2 = _expert_loads(w_ptr, s_ptr, z_ptr, e, gate_rows, col_ok, first, n_blocks, n1, hidden,
                                      row_len, z_len, BITS, PER_ROW, ZERO_KIND, QBLOCK, NB)  # fmt: skip
        a2 = _row_activations(x_row, first, hidden, NB, QBLOCK)
        gate += tl.reshape(_dots(gw2, gs2, gz2, a2, 1, BITS, NB, QBLOCK), (BLOCK_I,))
        if ACT == 4:
            uw2, us2, uz2 = _expert_loads(w3_ptr, s3_ptr, z3_ptr, e, up_rows, col_ok, first, n_blocks, n3, hidden,
                                          row_len, z_len, BITS, PER_ROW, ZERO_KIND, QBLOCK, NB)  # fmt: skip
            up += tl.reshape(_dots(uw2, us2, uz2, a2, 1, BITS, NB, QBLOCK), (BLOCK_I,))
    if HAS_BIAS:
        gate += gate_bias
        if ACT == 4:
            up += up_bias
    h = _act(gate, up, alpha, beta, limit, ACT, HAS_LIMIT)
    tl.store(h_ptr + pair * inter + cols, h, mask=col_ok)


@triton.jit
def _moe_fc2_kernel(
    h_ptr, chosen_ptr, route_ptr, out_ptr, w_ptr, s_ptr, z_ptr, b_ptr, top_k, hidden, inter, row_len, z_len,
    n_blocks, HAS_BIAS: tl.constexpr, BITS: tl.constexpr, PER_ROW: tl.constexpr, ZERO_KIND: tl.constexpr,
    QBLOCK: tl.constexpr, NB: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr, EARLY: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """out[token, rows] = sum over j < top_k of route[p] * (fc2 rows of expert chosen[p] . h[p]
    (+ bias)), p = token * top_k + j: the k experts' rows in one [KP * BLOCK_N] tile (KP >= top_k,
    a power of two; the padding pairs are masked), summed over j in one fixed-order reduction."""
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, KP)
    pair_ok = j < top_k
    pairs = token * top_k + j
    if not EARLY:
        wait_for_previous(PDL)
    e = tl.load(chosen_ptr + pairs, mask=pair_ok, other=0).to(tl.int64)
    route = tl.load(route_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
    tile_e = tl.reshape(e[:, None] + rows[None, :] * 0, (KP * BLOCK_N,))
    tile_r = tl.reshape(rows[None, :] + e[:, None] * 0, (KP * BLOCK_N,))
    tile_ok = tl.reshape(pair_ok[:, None] & (rows < hidden)[None, :], (KP * BLOCK_N,))
    w, s, z = _expert_loads(w_ptr, s_ptr, z_ptr, tile_e, tile_r, tile_ok, 0, n_blocks, hidden, inter, row_len, z_len,
                            BITS, PER_ROW, ZERO_KIND, QBLOCK, NB)  # fmt: skip
    if HAS_BIAS:
        bias = tl.load(b_ptr + tile_e * hidden + tile_r, mask=tile_ok, other=0.0).to(tl.float32)
    if EARLY:
        wait_for_previous(PDL)
    a = _chunk_activations(h_ptr, pairs, pair_ok, 0, inter, NB, QBLOCK)
    y = _dots(w, s, z, a, KP, BITS, NB, QBLOCK)  # [KP, BLOCK_N]
    for first in range(NB, n_blocks, NB):
        w2, s2, z2 = _expert_loads(w_ptr, s_ptr, z_ptr, tile_e, tile_r, tile_ok, first, n_blocks, hidden, inter,
                                   row_len, z_len, BITS, PER_ROW, ZERO_KIND, QBLOCK, NB)  # fmt: skip
        a2 = _chunk_activations(h_ptr, pairs, pair_ok, first, inter, NB, QBLOCK)
        y += _dots(w2, s2, z2, a2, KP, BITS, NB, QBLOCK)
    if HAS_BIAS:
        y += tl.reshape(bias, (KP, BLOCK_N))
    out = tl.sum(y * route[:, None], axis=0)
    tl.store(out_ptr + token * hidden + rows, out.to(out_ptr.dtype.element_ty), mask=rows < hidden)


# -- launch ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Form:
    """How a projection's tensors are read: the kernels' constexprs and row strides."""

    n: int  # rows per expert
    row_len: int  # a row's elements (dense) or bytes (codes)
    bits: int  # 0: dense
    weight_bits: int  # bits of one weight in memory (a dense element's width)
    qblock: int  # K-elements per compute block (per-block scales: the quantization block)
    n_blocks: int  # compute blocks of a row
    per_row: bool  # one scale per row (dense: no scale)
    zero_kind: int  # 0 none, 1 packed per block, 3 per row packed (per_row) or per block a byte each (not per_row)
    z_len: int  # bytes of zero points per row (per block) or per expert (per row)


def _compute_block(k: int) -> int:
    """K-elements per compute block where no quantization block decides it (dense, per-row scales)."""
    return min(128, max(16, triton.next_power_of_2(k)))


def _form(p: ExpertWeights, experts: int, device: torch.device) -> _Form | None:
    """The projection's form, or None where the kernels do not read it (the torch path does)."""
    w, k = p.weight, p.inner
    if w.dim() != 3 or w.shape[0] != experts or w.device != device or not w.is_contiguous() or k < 1:
        return None
    n = w.shape[1]
    b = p.bias
    if b is not None and (b.shape != (experts, n) or b.dtype not in KERNEL_DTYPES or b.device != device
                          or not b.is_contiguous()):  # fmt: skip
        return None
    if p.bits == 0:
        if w.dtype not in KERNEL_DTYPES or w.shape[2] != k:
            return None
        qblock = _compute_block(k)
        return _Form(n, k, 0, w.element_size() * 8, qblock, triton.cdiv(k, qblock), True, 0, 0)
    s, z, bits = p.scales, p.zeros, p.bits
    if bits not in (4, 8) or w.dtype != torch.uint8 or w.shape[2] * 8 < k * bits:
        return None
    if s is None or s.dtype not in KERNEL_DTYPES or s.device != device or not s.is_contiguous():
        return None
    if z is not None and (z.dtype not in (torch.uint8, torch.int8) or z.device != device or not z.is_contiguous()):
        return None
    if s.shape == (experts, n):  # per row
        if z is not None and z.dtype != torch.uint8:
            return None
        qblock = _compute_block(k)
        if z is not None and (z.dim() != 2 or z.shape[0] != experts or z.shape[1] * 8 < n * bits):
            return None
        zero_kind, z_len = (0, 0) if z is None else (3, z.shape[1])
        return _Form(n, w.shape[2], bits, bits, qblock, triton.cdiv(k, qblock), True, zero_kind, z_len)
    if s.dim() != 3 or s.shape[:2] != (experts, n) or k % s.shape[2]:
        return None
    block = k // s.shape[2]
    if block < 16 or block & (block - 1) or block > MAX_BLOCK:
        return None
    if z is not None and z.dtype == torch.int8:  # a byte per block (contrib_quant.widen_zero_points)
        if z.shape != s.shape:
            return None
        return _Form(n, w.shape[2], bits, bits, block, s.shape[2], False, 3, z.shape[2])
    if z is not None and (z.dim() != 3 or z.shape[:2] != (experts, n) or z.shape[2] * 8 < s.shape[2] * bits):
        return None
    zero_kind, z_len = (0, 0) if z is None else (1, z.shape[2])
    return _Form(n, w.shape[2], bits, bits, block, s.shape[2], False, zero_kind, z_len)


def _floor_power(v: int) -> int:
    return 1 << (max(v, 1).bit_length() - 1)


def _blocks_per_chunk(form: _Form, k: int, rows: int, budget_bytes: int) -> int:
    """NB: compute blocks per K-chunk, so that ``rows`` rows of a chunk hold about ``budget_bytes``."""
    budget = budget_bytes * 8 // form.weight_bits  # weights per program and chunk
    chunk = min(triton.next_power_of_2(k), _floor_power(budget // rows))
    return max(1, chunk // form.qblock)


def _forced_tiles() -> tuple[int, int, int, int, int] | None:
    """Option moe_per_pair's (FC1_ROWS, FC1_BYTES, FC2_ROWS, FC2_BYTES, WARPS), or None: the rules."""
    return options.current().moe_per_pair


def fc1_config(form: _Form, hidden: int, inter: int, rows_per_column: int) -> tuple[int, int]:
    """(BLOCK_I, NB) of _moe_fc1_kernel: a program's rows as the one-row kernels hold them (16 rows of
    4-bit codes, linear_q4.q4_config; 4 rows of a dense weight, linear_row.dense_config), the
    columns of SwiGLU taking a gate and an up row each; K in chunks of about _FC1_BYTES. On the
    35B-A3B shape a decode step is 8 pairs x 64 programs of 8 gate and 8 up rows. Option
    moe_per_pair forces the rows and the chunk's bytes."""
    forced = _forced_tiles()
    rows = forced[0] if forced else 16 if form.bits else 4
    budget = forced[1] if forced else _FC1_BYTES
    block_i = min(max(1, rows // rows_per_column), triton.next_power_of_2(inter))
    return block_i, _blocks_per_chunk(form, hidden, block_i * rows_per_column, budget)


def fc2_config(form: _Form, hidden: int, inter: int, top_k: int) -> tuple[int, int, int]:
    """(KP, BLOCK_N, NB) of _moe_fc2_kernel: the token's k experts (KP, a power of two >= k) times
    BLOCK_N rows, BLOCK_N as large as one chunk of the whole of K allows (2 to 16), then K in chunks
    of about _FC2_BYTES. On the 35B-A3B shape (k = 8, K = 512, 4-bit) a decode step is 512
    programs of 8 experts x 4 rows. Option moe_per_pair forces BLOCK_N and the chunk's bytes."""
    forced = _forced_tiles()
    budget_bytes = forced[3] if forced else _FC2_BYTES
    kp = triton.next_power_of_2(top_k)
    if forced and forced[2]:
        block_n = forced[2]
    else:
        budget = budget_bytes * 8 // form.weight_bits
        block_n = min(16, max(2, _floor_power(budget // (kp * triton.next_power_of_2(inter)))))
    block_n = min(block_n, max(2, triton.next_power_of_2(hidden)))
    return kp, block_n, _blocks_per_chunk(form, inter, kp * block_n, budget_bytes)


def launch_warps() -> int:
    """Warps of both per-pair kernels: WARPS, or option moe_per_pair's."""
    forced = _forced_tiles()
    return forced[4] if forced else WARPS


def moe_experts(
    x: torch.Tensor,
    chosen: torch.Tensor,
    routing: torch.Tensor,
    fc1: ExpertWeights,
    fc2: ExpertWeights,
    fc3: ExpertWeights | None,
    *,
    activation: str,
    fusion: int,
    alpha: float,
    beta: float,
    limit: float | None,
) -> torch.Tensor | None:
    """The experts' weighted sum [T, hidden] in x's dtype for tokens x [T, hidden], their top-k
    experts ``chosen`` [T, k] (int64) and routing weights [T, k] (fp32), as contrib_moe computes it
    (``fusion``: SwiGLU's layout, 0 for the other activations; ``limit`` None: no clamp). None
    where the kernels do not serve these inputs; the caller then runs the torch path, which also
    reports malformed ones."""
    act = ACTIVATIONS.get(activation)
    if act is None or x.dim() != 2 or x.dtype not in KERNEL_DTYPES or chosen.dim() != 2:
        return None
    tokens, hidden = x.shape
    top_k = chosen.shape[1]
    experts = fc1.weight.shape[0] if fc1.weight.dim() == 3 else 0
    pairs = tokens * top_k
    if not 1 <= top_k <= MAX_TOP_K or pairs == 0:
        return None
    if chosen.shape[0] != tokens or routing.shape != chosen.shape or chosen.dtype != torch.int64:
        return None
    if any(t.device != x.device for t in (chosen, routing)):
        return None
    f1, f2 = _form(fc1, experts, x.device), _form(fc2, experts, x.device)
    if f1 is None or f2 is None:
        return None
    up, f3 = fc1, f1
    if act == 4 and fusion in (1, 2):  # gate and up rows of fc1: interleaved (g0, u0, g1, ...) or halves
        if f1.n % 2:
            return None
        inter = f1.n // 2
        gate_step, up_step, up_offset = (2, 2, 1) if fusion == 1 else (1, 1, inter)
    elif act == 4:  # the up rows from fc3, read like fc1
        if fc3 is None:
            return None
        up, f3 = fc3, _form(fc3, experts, x.device)
        same = f3 == f1 and fc3.weight.dtype == fc1.weight.dtype and fc3.inner == fc1.inner
        if not same or (fc3.bias is None) != (fc1.bias is None) or (fc3.scales is None) != (fc1.scales is None):
            return None
        inter, gate_step, up_step, up_offset = f1.n, 1, 1, 0
    else:
        inter, gate_step, up_step, up_offset = f1.n, 1, 0, 0
    if fc1.inner != hidden or fc2.inner != inter or f2.n != hidden:
        return None
    if tokens > 1 and pairs > options.current().moe_pairs_per_expert * experts:  # each expert read once per tile
        if max(f1.qblock, f2.qblock) > GROUPED_MAX_BLOCK:
            return None
        from onnxgen.runtime.gpu.moe_grouped import grouped_experts

        return grouped_experts(x.contiguous(), chosen.contiguous(), routing.float().contiguous(), fc1, fc2, up, f1,
                               f2, f3, act=act, inter=inter, gate_step=gate_step, up_step=up_step,
                               up_offset=up_offset, alpha=alpha, beta=beta, limit=limit)  # fmt: skip

    x = x.contiguous()
    chosen, routing = chosen.contiguous(), routing.contiguous()
    h = torch.empty((pairs, inter), dtype=torch.float32, device=x.device)
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    LAUNCHES["moe_experts"] += 1
    block_i, nb1 = fc1_config(f1, hidden, inter, 2 if act == 4 else 1)
    w1 = fc1.weight
    early = settled_before_launch(chosen)
    _moe_fc1_kernel[(pairs, triton.cdiv(inter, block_i))](
        x, chosen, h, w1, _or(fc1.scales, w1), _or(fc1.zeros, w1), _or(fc1.bias, w1),
        up.weight, _or(up.scales, w1), _or(up.zeros, w1), _or(up.bias, w1),
        top_k, inter, hidden, f1.n, f3.n, f1.row_len, f1.z_len, f1.n_blocks, gate_step, up_step, up_offset,
        float(alpha), float(beta), float(limit or 0.0),
        ACT=act, HAS_LIMIT=limit is not None, HAS_BIAS=fc1.bias is not None, BITS=f1.bits, PER_ROW=f1.per_row,
        ZERO_KIND=f1.zero_kind, QBLOCK=f1.qblock, NB=nb1, BLOCK_I=block_i, EARLY=early, num_warps=launch_warps(),
        **pdl_launch(x, h),
    )  # fmt: skip
    kp, block_n, nb2 = fc2_config(f2, hidden, inter, top_k)
    w2 = fc2.weight
    early = settled_before_launch(chosen, routing)
    _moe_fc2_kernel[(tokens, triton.cdiv(hidden, block_n))](
        h, chosen, routing, out, w2, _or(fc2.scales, w2), _or(fc2.zeros, w2), _or(fc2.bias, w2),
        top_k, hidden, inter, f2.row_len, f2.z_len, f2.n_blocks,
        HAS_BIAS=fc2.bias is not None, BITS=f2.bits, PER_ROW=f2.per_row, ZERO_KIND=f2.zero_kind, QBLOCK=f2.qblock,
        NB=nb2, KP=kp, BLOCK_N=block_n, EARLY=early, num_warps=launch_warps(), **pdl_launch(x, out),
    )  # fmt: skip
    return out


def _or(t: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """An absent optional tensor as a pointer the kernel never reads (its constexprs say so)."""
    return placeholder if t is None else t
