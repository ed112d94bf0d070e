"""The experts of com.microsoft MoE and QMoE for prompts of many (token, expert) pairs: the pairs
grouped by expert on the device, each expert's weights read once per tile of its pairs, on tensor
cores. No host read and no allocation that depends on the routing, so a prompt chunk containing it
can be recorded in a CUDA graph.

Why: gpu/moe_experts.py's kernels read one expert's weights per pair. Past a few pairs per expert
(option moe_pairs_per_expert) that reads the layer's experts several times over, and the torch
path's grouped form reads the routing on the host (one GEMM per used expert), which a recording
cannot hold. Here, for P = T * k pairs (pair p: token p // k, expert chosen[p]):

    group_pairs       two small kernels: the pairs sorted by expert (stable: a pair's place
                      among its expert's pairs follows the pair order), and a table of at most
                      P // BLOCK_M + min(E, P) tiles, tile i holding up to BLOCK_M consecutive sorted
                      pairs of one expert (expert E: an empty tile, its programs return at once)
    _grouped_fc1      program (tile, j): h[pairs, cols] = act(gate . x[token] (+ b), up . x[token]
                      (+ b)) for columns j * BLOCK_N .. of the tile's expert, as tl.dot over K
    _grouped_fc2      program (tile, j): y[pairs, rows] = route[p] * (fc2 rows . h[p] (+ b)), fp32
    the sum           out[t] = sum over the token's k pairs of y, in pair order (torch's reduction
                      over a fixed shape), rounded once to the activation dtype

Numerics: a weight is (code - zero) * scale in fp32 (dense weights as stored), rounded to the
activation dtype for the tensor-core dot, as a dense GEMM over the dequantized weight would see it
(fp32 activations: IEEE fp32 dots, no rounding); h is rounded to the activation dtype between the
two products for the same reason. So for fp16 / bf16 the results differ from the torch path's fp32
arithmetic (and from moe_experts' kernels) by those roundings; tests/test_moe_kernels.py states the
bound. Every sum has a fixed order for a given routing and launch (no atomics), so a run repeats bit
for bit and a replay equals the eager call.

Weights: every form moe_experts reads (moe_experts._form: dense, 4- and 8-bit codes with per-row or
per-block scales and zero points), through its tile loads (moe_experts._expert_codes, _expert_scales).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen import options
from onnxgen.runtime.gpu.launch import COMPILE_OPTIONS, LAUNCHES
from onnxgen.runtime.gpu.linear_q4 import MAGIC_BITS, _dequantized
from onnxgen.runtime.gpu.moe_experts import ExpertWeights, _act, _expert_codes, _expert_scales, _Form, _or

WARPS = 4
STAGES = 3  # the software pipeline's depth (Triton's default); option moe_grouped forces another
# The rule's tiles (option moe_grouped forces others), from sweeps on the 35B-A3B expert layer
# (docs/benchmarks/2026-12-06-h100-moe-tiles-ttft.md, docs/benchmarks/2026-12-06-h100-grouped-swap-ttft.md):
# the products as weight rows times pairs (_dot's SWAP: the dequantized weights feed the tensor cores
# from registers as the first operand), K_STEP elements of K per step, output columns per program
# FC1_COLUMNS (SwiGLU: as many gate and up rows; the one accumulator of other activations takes twice
# as many) and FC2_COLUMNS. Pairs as the product's rows, as before, streamed the same bytes slower.
SWAP = True
K_STEP = 64
FC1_COLUMNS = 64
FC2_COLUMNS = 128
# the shortest K step: with 16 (one block of 16, or a forced step of 16) the compiled kernels summed
# wrong on an H100 under Triton 3.6 while the interpreter agreed with the torch path; 32 and up agree
MIN_K_STEP = 32


@triton.jit
def _weight_tile(w, scale, offset, BITS: tl.constexpr, NB: tl.constexpr, QBLOCK: tl.constexpr, DTYPE: tl.constexpr):
    """moe_experts._expert_loads' (weights, scale, offset) of R rows and NB compute blocks as [R,
    NB * QBLOCK] weights in DTYPE: (code - zero) * scale rounded once (4-bit codes as
    linear_q4._dequantized makes them; the offset is 2^23 + zero, its ZERO_KIND 0 form), dense ones
    as stored (zeros where a row or a block lies outside)."""
    if BITS == 0:
        v = w.to(tl.float32)
    elif BITS == 4:
        v = _dequantized(w, scale, offset, 0, NB, QBLOCK, DTYPE)
    else:
        v = ((w.to(tl.int32) | MAGIC_BITS).to(tl.float32, bitcast=True) - offset[:, :, None]) * scale[:, :, None]
    return tl.reshape(v, (w.shape[0], NB * QBLOCK)).to(DTYPE)


@triton.jit
def _dot(a, w, IEEE: tl.constexpr, SWAP: tl.constexpr):
    """a [M, K] . w [N, K]^T in fp32; SWAP: its transpose, w . a^T [N, M], the weights as the first
    operand (the tensor cores' A, which may stay in registers, and the weight rows, not the few
    pairs, as the product's M)."""
    if SWAP:
        if IEEE:
            return tl.dot(w, tl.trans(a), input_precision="ieee")
        else:
            return tl.dot(w, tl.trans(a))
    elif IEEE:
        return tl.dot(a, tl.trans(w), input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(w))


@triton.jit
def _step(
    a, w_ptr, s_ptr, z_ptr, e, r, row_ok, first, n_blocks, n, k, row_len, z_len, scale, offset, BITS: tl.constexpr,
    PER_ROW: tl.constexpr, ZERO_KIND: tl.constexpr, QBLOCK: tl.constexpr, NB: tl.constexpr, DTYPE: tl.constexpr,
    IEEE: tl.constexpr, SWAP: tl.constexpr,
):  # fmt: skip
    """One K step of a product: (a . the weights of rows ``r`` at step ``first``, made with this
    step's ``scale`` and ``offset``, then the next step's scale and offset), the next ones loaded
    before this step's weights are made: a row's scales and zero points are a few bytes per step, too
    narrow for the compiler's pipeline (cp.async moves 4 bytes and up per thread), so loaded where
    they are used each step would wait out a memory round trip (linear_q4._block_scales)."""
    w = _expert_codes(w_ptr, e, r, row_ok, first, n_blocks, n, k, row_len, BITS, PER_ROW, QBLOCK, NB)
    next_scale, next_offset = _expert_scales(s_ptr, z_ptr, e, r, row_ok, first + NB, n_blocks, n, z_len, BITS, PER_ROW,
                                             ZERO_KIND, NB)  # fmt: skip
    return _dot(a, _weight_tile(w, scale, offset, BITS, NB, QBLOCK, DTYPE), IEEE, SWAP), next_scale, next_offset


@triton.jit
def _row_tile(ptr, rows, rows_ok, start, width, BLOCK_K: tl.constexpr):
    """Columns ``start`` .. ``start + BLOCK_K`` of the ``rows`` of a [*, width] tensor, in its dtype
    (zeros outside): the A tile of a product."""
    cols = start + tl.arange(0, BLOCK_K)
    return tl.load(ptr + rows[:, None] * width + cols[None, :], mask=rows_ok[:, None] & (cols < width)[None, :],
                   other=0.0)  # fmt: skip


@triton.jit
def _tile_pairs(order_ptr, tile_expert_ptr, tile_first_ptr, tile_rows_ptr, BLOCK_M: tl.constexpr):
    """(expert, the tile's pairs [BLOCK_M] (int64), which of them are real) of this program's tile."""
    tile = tl.program_id(0)
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    count = tl.load(tile_rows_ptr + tile)
    slot = tl.arange(0, BLOCK_M)
    ok = slot < count
    pairs = tl.load(order_ptr + tl.load(tile_first_ptr + tile) + slot, mask=ok, other=0).to(tl.int64)
    return e, pairs, ok, count


@triton.jit
def _grouped_fc1(
    x_ptr, order_ptr, tile_expert_ptr, tile_first_ptr, tile_rows_ptr, h_ptr, w_ptr, s_ptr, z_ptr, b_ptr, w3_ptr,
    s3_ptr, z3_ptr, b3_ptr, top_k, inter, hidden, n1, n3, row_len, z_len, n_blocks, gate_step, up_step, up_offset,
    alpha, beta, limit, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr, BITS: tl.constexpr,
    PER_ROW: tl.constexpr, ZERO_KIND: tl.constexpr, QBLOCK: tl.constexpr, NB: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr, SWAP: tl.constexpr,
):  # fmt: skip
    """h[pair, cols] = act(gate rows . x[token] (+ bias), up rows . x[token] (+ bias)) for the tile's
    pairs, rounded to h's dtype: gate row c * gate_step (of w), up row c * up_step + up_offset (of
    w3: fc3, or fc1 again for the fused layouts). SWAP: the products as [cols, pairs] (_dot)."""
    e, pairs, pair_ok, count = _tile_pairs(order_ptr, tile_expert_ptr, tile_first_ptr, tile_rows_ptr, BLOCK_M)
    if count > 0:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        tokens = pairs // top_k
        ev = e + cols * 0
        gate_rows = cols * gate_step
        up_rows = cols * up_step + up_offset
        BLOCK_K: tl.constexpr = NB * QBLOCK
        dtype = h_ptr.dtype.element_ty
        ACC_SHAPE: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N)
        gate = tl.zeros(ACC_SHAPE, tl.float32)
        up = tl.zeros(ACC_SHAPE, tl.float32)
        # the scales and zero points one K step ahead (_step)
        gs, go = _expert_scales(s_ptr, z_ptr, ev, gate_rows, col_ok, 0, n_blocks, n1, z_len, BITS, PER_ROW, ZERO_KIND,
                                NB)  # fmt: skip
        us, uo = gs, go
        if ACT == 4:
            us, uo = _expert_scales(s3_ptr, z3_ptr, ev, up_rows, col_ok, 0, n_blocks, n3, z_len, BITS, PER_ROW,
                                    ZERO_KIND, NB)  # fmt: skip
        for first in range(0, n_blocks, NB):
            a = _row_tile(x_ptr, tokens, pair_ok, first * QBLOCK, hidden, BLOCK_K)
            product, gs, go = _step(a, w_ptr, s_ptr, z_ptr, ev, gate_rows, col_ok, first, n_blocks, n1, hidden,
                                    row_len, z_len, gs, go, BITS, PER_ROW, ZERO_KIND, QBLOCK, NB, dtype, IEEE,
                                    SWAP)  # fmt: skip
            gate += product
            if ACT == 4:
                product, us, uo = _step(a, w3_ptr, s3_ptr, z3_ptr, ev, up_rows, col_ok, first, n_blocks, n3, hidden,
                                        row_len, z_len, us, uo, BITS, PER_ROW, ZERO_KIND, QBLOCK, NB, dtype, IEEE,
                                        SWAP)  # fmt: skip
                up += product
        if SWAP:
            gate = tl.trans(gate)
            up = tl.trans(up)
        if HAS_BIAS:
            gate += tl.load(b_ptr + e * n1 + gate_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if ACT == 4:
                up += tl.load(b3_ptr + e * n3 + up_rows, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        h = _act(gate, up, alpha, beta, limit, ACT, HAS_LIMIT)
        tl.store(h_ptr + pairs[:, None] * inter + cols[None, :], h.to(dtype), mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_fc2(
    h_ptr, order_ptr, tile_expert_ptr, tile_first_ptr, tile_rows_ptr, route_ptr, y_ptr, w_ptr, s_ptr, z_ptr, b_ptr,
    hidden, inter, row_len, z_len, n_blocks, HAS_BIAS: tl.constexpr, BITS: tl.constexpr, PER_ROW: tl.constexpr,
    ZERO_KIND: tl.constexpr, QBLOCK: tl.constexpr, NB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr, SWAP: tl.constexpr,
):  # fmt: skip
    """y[pair, rows] = route[pair] * (fc2 rows of the tile's expert . h[pair] (+ bias)) in fp32; SWAP:
    the product as [rows, pairs] (_dot)."""
    e, pairs, pair_ok, count = _tile_pairs(order_ptr, tile_expert_ptr, tile_first_ptr, tile_rows_ptr, BLOCK_M)
    if count > 0:
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < hidden
        ev = e + rows * 0
        BLOCK_K: tl.constexpr = NB * QBLOCK
        ACC_SHAPE: tl.constexpr = (BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N)
        acc = tl.zeros(ACC_SHAPE, tl.float32)
        dtype = h_ptr.dtype.element_ty
        ws, wo = _expert_scales(s_ptr, z_ptr, ev, rows, row_ok, 0, n_blocks, hidden, z_len, BITS, PER_ROW, ZERO_KIND,
                                NB)  # fmt: skip
        for first in range(0, n_blocks, NB):
            a = _row_tile(h_ptr, pairs, pair_ok, first * QBLOCK, inter, BLOCK_K)
            product, ws, wo = _step(a, w_ptr, s_ptr, z_ptr, ev, rows, row_ok, first, n_blocks, hidden, inter, row_len,
                                    z_len, ws, wo, BITS, PER_ROW, ZERO_KIND, QBLOCK, NB, dtype, IEEE, SWAP)  # fmt: skip
            acc += product
        if SWAP:
            acc = tl.trans(acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + e * hidden + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        route = tl.load(route_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + pairs[:, None] * hidden + rows[None, :], acc * route[:, None],
                 mask=pair_ok[:, None] & row_ok[None, :])  # fmt: skip


# -- grouping and launch -------------------------------------------------------------------------


def tile_rows(pairs: int, experts: int) -> int:
    """BLOCK_M: pairs per tile, the average pairs per expert rounded up to a power of two, 16 to 64
    (tl.dot takes at least 16 rows; more rows share a weight tile's loads among more pairs, fewer
    leave fewer padding rows in each expert's last tile). On the 35B-A3B expert layer at 32-256
    tokens the rule's 16 beat forced tiles of 32 and 64 pairs
    (docs/benchmarks/2026-12-06-h100-moe-tiles-ttft.md)."""
    return min(64, max(16, triton.next_power_of_2(-(-pairs // experts))))


# pairs (or tiles) per program of the grouping kernels, and the cap on one one-hot [block, E] tile of
# their registers: a program's comparisons against every expert at once
_GROUP_BLOCK = 64
_GROUP_CELLS = 8192


@triton.jit
def _count_pairs_kernel(chosen_ptr, counts_ptr, pairs, BLOCK: tl.constexpr):
    """counts[e] += the pairs of this program's block routed to expert e (counts zeroed before)."""
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = p < pairs
    e = tl.load(chosen_ptr + p, mask=ok, other=0).to(tl.int32)
    tl.atomic_add(counts_ptr + e, tl.full((BLOCK,), 1, tl.int32), mask=ok)


@triton.jit
def _pick(one_hot, values):
    """values[e] for each row's expert e (one_hot [R, E_PAD] with at most one True per row)."""
    return tl.sum(tl.where(one_hot, values[None, :], 0), axis=1)


@triton.jit
def _group_pairs_kernel(
    chosen_ptr, counts_ptr, order_ptr, tile_expert_ptr, tile_first_ptr, tile_rows_ptr, pairs, experts, tiles_total,
    pair_programs, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Programs below ``pair_programs``: the sorted places of a block of pairs (order[place] = pair);
    the rest: a block of the tile table. Each program derives the per-expert sums it needs from the
    counts (exclusive prefix sums over E_PAD bins: a few vector ops, cheaper than a launch)."""
    bins = tl.arange(0, E_PAD)
    real = bins < experts
    counts = tl.load(counts_ptr + bins, mask=real, other=0)
    bounds = tl.cumsum(counts, axis=0) - counts  # the first sorted place of each expert's pairs
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    program = tl.program_id(0)
    lane = tl.arange(0, BLOCK)
    if program < pair_programs:
        p = program * BLOCK + lane
        ok = p < pairs
        e = tl.load(chosen_ptr + p, mask=ok, other=E_PAD).to(tl.int32)
        # stable: a pair's place among its expert's pairs is the count of that expert's earlier pairs
        rank = tl.zeros((BLOCK,), tl.int32)
        for before in range(0, program):
            q = before * BLOCK + lane
            f = tl.load(chosen_ptr + q, mask=q < pairs, other=E_PAD + 1).to(tl.int32)
            rank += tl.sum((e[:, None] == f[None, :]).to(tl.int32), axis=1)
        rank += tl.sum(((e[:, None] == e[None, :]) & (lane[None, :] < lane[:, None])).to(tl.int32), axis=1)
        place = _pick(e[:, None] == bins[None, :], bounds) + rank
        tl.store(order_ptr + place, p, mask=ok)
    else:
        t = (program - pair_programs) * BLOCK + lane
        ok = t < tiles_total
        # the tile's expert: how many experts' tiles end at or before it (E: past the last used tile)
        expert = tl.sum(((tile_end[None, :] <= t[:, None]) & real[None, :]).to(tl.int32), axis=1)
        inside = expert < experts
        one_hot = tl.minimum(expert, experts - 1)[:, None] == bins[None, :]
        local = t - (_pick(one_hot, tile_end) - _pick(one_hot, tiles))
        left = _pick(one_hot, counts) - local * BLOCK_M
        tl.store(tile_expert_ptr + t, expert, mask=ok)
        tl.store(tile_first_ptr + t, _pick(one_hot, bounds) + local * BLOCK_M, mask=ok)
        tl.store(tile_rows_ptr + t, tl.where(inside, tl.minimum(tl.maximum(left, 0), BLOCK_M), 0), mask=ok)


def group_pairs(chosen: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """(order, tile_expert, tile_first, tile_rows), int32, for the pairs of ``chosen`` [T, k]: the
    pair indices sorted by expert (stable), and per tile (P // block_m + min(E, P) of them) its
    expert (E for an empty tile), its first place in ``order`` and its pair count (0 for an empty
    tile). Two kernels and a zeroed count buffer, shapes fixed by (T, k, E): nothing reads the
    routing on the host, and no sort (torch's radix sort and the searchsorted / cumsum / gather ops
    around it were some twenty launches per layer)."""
    flat = chosen.reshape(-1)
    pairs = flat.numel()
    tiles_total = pairs // block_m + min(experts, pairs)
    e_pad = triton.next_power_of_2(experts)
    block = max(16, min(_GROUP_BLOCK, _GROUP_CELLS // e_pad))
    device = flat.device
    counts = torch.zeros(experts, dtype=torch.int32, device=device)
    order = torch.empty(pairs, dtype=torch.int32, device=device)
    table = torch.empty((3, tiles_total), dtype=torch.int32, device=device)
    pair_programs = triton.cdiv(pairs, block)
    _count_pairs_kernel[(pair_programs,)](flat, counts, pairs, BLOCK=block, **COMPILE_OPTIONS)
    _group_pairs_kernel[(pair_programs + triton.cdiv(tiles_total, block),)](
        flat, counts, order, table[0], table[1], table[2], pairs, experts, tiles_total, pair_programs,
        BLOCK_M=block_m, E_PAD=e_pad, BLOCK=block, **COMPILE_OPTIONS,
    )  # fmt: skip
    return order, table[0], table[1], table[2]


def grouped_experts(
    x: torch.Tensor,
    chosen: torch.Tensor,
    routing: torch.Tensor,
    fc1: ExpertWeights,
    fc2: ExpertWeights,
    up: ExpertWeights,
    f1: _Form,
    f2: _Form,
    f3: _Form,
    *,
    act: int,
    inter: int,
    gate_step: int,
    up_step: int,
    up_offset: int,
    alpha: float,
    beta: float,
    limit: float | None,
) -> torch.Tensor:
    """The experts' weighted sum [T, hidden] in x's dtype; the arguments as moe_experts.moe_experts
    resolved them (its forms, the SwiGLU row steps), the caller having checked that every form is
    one the kernels read."""
    tokens, hidden = x.shape
    top_k = chosen.shape[1]
    experts = fc1.weight.shape[0]
    pairs = tokens * top_k
    forced = options.current().moe_grouped
    block_m = forced[0] if forced and forced[0] else tile_rows(pairs, experts)
    order, tile_expert, tile_first, rows = group_pairs(chosen, experts, block_m)
    ieee = x.dtype == torch.float32
    h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    LAUNCHES["moe_grouped"] += 1
    w1 = fc1.weight
    block_n1 = FC1_COLUMNS if act == 4 else 2 * FC1_COLUMNS  # SwiGLU holds a gate and an up accumulator
    block_n2, warps, nb1, nb2, swap, stages = FC2_COLUMNS, WARPS, _blocks(f1), _blocks(f2), SWAP, STAGES
    if forced:  # option moe_grouped (a sweep's configuration)
        block_n1, block_n2, warps, swap = forced[1], forced[2], forced[4], bool(forced[5])
        nb1, nb2 = _blocks(f1, forced[3]), _blocks(f2, forced[3])
        stages = forced[6] or STAGES
    _grouped_fc1[(tile_expert.numel(), triton.cdiv(inter, block_n1))](
        x, order, tile_expert, tile_first, rows, h, w1, _or(fc1.scales, w1), _or(fc1.zeros, w1), _or(fc1.bias, w1),
        up.weight, _or(up.scales, w1), _or(up.zeros, w1), _or(up.bias, w1),
        top_k, inter, hidden, f1.n, f3.n, f1.row_len, f1.z_len, f1.n_blocks, gate_step, up_step, up_offset,
        float(alpha), float(beta), float(limit or 0.0),
        ACT=act, HAS_LIMIT=limit is not None, HAS_BIAS=fc1.bias is not None, BITS=f1.bits, PER_ROW=f1.per_row,
        ZERO_KIND=f1.zero_kind, QBLOCK=f1.qblock, NB=nb1, BLOCK_M=block_m, BLOCK_N=block_n1, IEEE=ieee, SWAP=swap,
        num_warps=warps, num_stages=stages,
        **COMPILE_OPTIONS,
    )  # fmt: skip
    w2 = fc2.weight
    _grouped_fc2[(tile_expert.numel(), triton.cdiv(hidden, block_n2))](
        h, order, tile_expert, tile_first, rows, routing, y, w2, _or(fc2.scales, w2), _or(fc2.zeros, w2),
        _or(fc2.bias, w2), hidden, inter, f2.row_len, f2.z_len, f2.n_blocks,
        HAS_BIAS=fc2.bias is not None, BITS=f2.bits, PER_ROW=f2.per_row, ZERO_KIND=f2.zero_kind, QBLOCK=f2.qblock,
        NB=nb2, BLOCK_M=block_m, BLOCK_N=block_n2, IEEE=ieee, SWAP=swap, num_warps=warps, num_stages=stages,
        **COMPILE_OPTIONS,
    )  # fmt: skip
    return y.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def _blocks(form: _Form, k_step: int = K_STEP) -> int:
    """NB: compute blocks per K step, so that a step spans at least max(``k_step``, MIN_K_STEP)
    elements of K (a quantization block of 128 is one block a step)."""
    return max(1, max(k_step, MIN_K_STEP) // form.qblock)
