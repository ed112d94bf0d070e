"""One-row linear layers (the decode step's GEMVs) in one Triton kernel each, with the op before
them fused in as a prologue.

At batch 1 a decode step is a chain of matrix-vector products separated by small ops (RMSNorm,
residual add, SiLU-mul). Each small op is a kernel of its own that costs more in launch and
latency than its few kilobytes of data; folded into the GEMV that reads its output, it costs
nothing extra: every program of the GEMV recomputes the prologue over the K-vector (a few KB from
L2) and only the weights stream from memory.

    y[n] = sum_k p(x)[k] * W[n, k]  (+ bias[n])

Prologues p (PROLOGUE):
    0  none         p(x) = x
    1  rms          p(x) = rms_norm(x) * gamma
    2  skip_rms     s = x + x2 (written to ``sum_out`` by program 0); p = rms_norm(s) * gamma
    3  silu_mul     p(x) = silu(x) * x2
p(x) is computed in fp32. SiLU-mul is rounded to the activation dtype before the products, as the
unfused kernel stores it; the norms are not: 1/rms multiplies the finished dot product (one pass
over K), so the fused kernel differs from the unfused pair by the activation's fp16 rounding and the
summation order (~1e-3 relative in fp16, ~1e-7 in fp32; tested against onnxruntime).
Weights: a dense [N, K] matrix (fp16/bf16/fp32); MatMulNBits' 4-bit codes take gpu/linear_q4.py's
kernels, which share these prologues.
Products accumulate in fp32 in a fixed order: the result is run-to-run deterministic, so captured
and eager steps agree bit for bit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from onnxgen import options
from onnxgen.runtime.gpu.launch import LAUNCHES, pdl_launch
from onnxgen.runtime.gpu.pdl import wait_for_previous

PROLOGUES = {"none": 0, "rms": 1, "skip_rms": 2, "silu_mul": 3}


@triton.jit
def _activation_inputs(x_ptr, x2_ptr, gamma_ptr, cols, inside, PROLOGUE: tl.constexpr):
    """The raw inputs of the prologue at ``cols`` (x, x2, gamma; unused ones are x again): loaded
    apart from _activation so that a loop can fetch the next tile's while it multiplies this one."""
    x = tl.load(x_ptr + cols, mask=inside, other=0.0)
    x2 = x
    gamma = x
    if PROLOGUE == 2 or PROLOGUE == 3:
        x2 = tl.load(x2_ptr + cols, mask=inside, other=0.0)
    if PROLOGUE == 1 or PROLOGUE == 2:
        gamma = tl.load(gamma_ptr + cols, mask=inside, other=0.0)
    return x, x2, gamma


@triton.jit
def _prologue_values(x, x2, gamma, PROLOGUE: tl.constexpr):
    """(a, s*s, s) in fp32 from the raw inputs: the value each weight column multiplies, for the norms
    the squares their statistics sum, and s itself (x + x2 for skip_rms, which it writes out). The
    norms' 1/rms is a common factor of every product, so it is applied once to the finished dot
    product: one pass over K instead of two (measured on the H200: a first statistics pass cost
    ~2 us of latency per kernel). Pure arithmetic: a kernel may compute it for the same inputs
    twice (once for a whole row's statistics) and gets the same bits."""
    xf = x.to(tl.float32)
    if PROLOGUE == 3:  # rounded as the unfused SiLU-mul kernel stores it
        u = x2.to(tl.float32)
        return (xf / (1.0 + tl.exp(-xf)) * u).to(x.dtype).to(tl.float32), xf * 0.0, xf
    if PROLOGUE == 0:
        return xf, xf * 0.0, xf
    if PROLOGUE == 2:
        xf += x2.to(tl.float32)
    return xf * gamma.to(tl.float32), xf * xf, xf


@triton.jit
def _activation(x, x2, gamma, sum_ptr, cols, inside, PROLOGUE: tl.constexpr):
    """(a, s*s) at ``cols`` (_prologue_values); skip_rms's program 0 writes x + x2 to ``sum_ptr``."""
    a, sq, s = _prologue_values(x, x2, gamma, PROLOGUE)
    if PROLOGUE == 2:
        first = (cols * 0 + tl.program_id(0)) == 0  # a block mask: the interpreter takes no scalar
        tl.store(sum_ptr + cols, s.to(sum_ptr.dtype.element_ty), mask=inside & first)
    return a, sq


@triton.jit
def _finish(dot, squares, k, eps, PROLOGUE: tl.constexpr):
    if PROLOGUE == 1 or PROLOGUE == 2:
        dot = dot / tl.sqrt(tl.sum(squares, axis=0) / k + eps)
    return dot


@triton.jit
def _tile_products(
    x_ptr, x2_ptr, gamma_ptr, sum_ptr, w_ptr, rows, row_ok, cols, inside, w_stride, PROLOGUE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """(w[rows, cols] . p(x)[cols], the prologue's squares) in fp32 for one tile, its weights loaded
    before the wait for the kernel before (they are constant) and the activations after it."""
    w = tl.load(w_ptr + rows[:, None] * w_stride + cols[None, :], mask=row_ok[:, None] & inside[None, :], other=0.0)
    wait_for_previous(PDL)
    x, x2, gamma = _activation_inputs(x_ptr, x2_ptr, gamma_ptr, cols, inside, PROLOGUE)
    a, sq = _activation(x, x2, gamma, sum_ptr, cols, inside, PROLOGUE)
    return tl.sum(w.to(tl.float32) * a[None, :], axis=1), sq


@triton.jit
def _linear_row_kernel(
    x_ptr,
    x2_ptr,  # skip (skip_rms) or up (silu_mul)
    gamma_ptr,
    sum_ptr,  # x + x2 out (skip_rms)
    w_ptr,  # [N, K], rows w_stride apart
    bias_ptr,
    out_ptr,
    n,
    k,
    w_stride,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (launch.pdl_launch)
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    # the weight tile of each iteration is loaded one iteration ahead; the first before the wait
    # for the kernel before (weights are constant), so under PDL it streams while that one finishes
    w_rows = w_ptr + rows[:, None] * w_stride
    cols = tl.arange(0, BLOCK_K)
    w_next = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & (cols < k)[None, :], other=0.0)
    wait_for_previous(PDL)
    # the activations too: the next tile's are in flight while this one's products are summed
    # (a long row's loop otherwise waits for an L2 round trip per tile)
    x_next, x2_next, gamma_next = _activation_inputs(x_ptr, x2_ptr, gamma_ptr, cols, cols < k, PROLOGUE)
    for start in range(0, k, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        inside = cols < k
        w = w_next
        x, x2, gamma = x_next, x2_next, gamma_next
        ahead = cols + BLOCK_K
        w_next = tl.load(w_rows + ahead[None, :], mask=row_ok[:, None] & (ahead < k)[None, :], other=0.0)
        x_next, x2_next, gamma_next = _activation_inputs(x_ptr, x2_ptr, gamma_ptr, ahead, ahead < k, PROLOGUE)
        a, sq = _activation(x, x2, gamma, sum_ptr, cols, inside, PROLOGUE)
        squares += sq
        acc += w.to(tl.float32) * a[None, :]
    y = _finish(tl.sum(acc, axis=1), squares, k, eps, PROLOGUE)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _linear_tile_kernel(
    x_ptr,
    x2_ptr,
    gamma_ptr,
    sum_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    n,
    k,
    w_stride,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= k: the whole row in one tile
    PDL: tl.constexpr,
):
    """_linear_row_kernel for rows that fit one tile (K <= BLOCK_K), without its loop: no
    loop-carried [BLOCK_N, BLOCK_K] accumulator and no next tile, so it needs about half the
    registers (72 against 158 per thread at 4 x 1,024 in 4 warps, compiled for sm_90), and more
    programs fit on an SM at once. It computes the loop kernel's products and sums, in fp32."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    cols = tl.arange(0, BLOCK_K)
    # every weight load (and the bias, also constant) is issued before the wait for the kernel before
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    dot, sq = _tile_products(x_ptr, x2_ptr, gamma_ptr, sum_ptr, w_ptr, rows, row_ok, cols, cols < k, w_stride,
                             PROLOGUE, PDL)  # fmt: skip
    y = _finish(dot, sq, k, eps, PROLOGUE)
    if HAS_BIAS:
        y += bias
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _linear_split_kernel(
    x_ptr,
    x2_ptr,
    gamma_ptr,
    sum_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,  # [splits, n] fp32: each program's partial dot products
    ticket_ptr,  # [row blocks] int32, zero between calls
    n,
    k,
    w_stride,
    eps,
    PROLOGUE: tl.constexpr,  # 0 or 3: no norm (its statistics would span the splits)
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the K-range of one program
    BLOCK_S: tl.constexpr,  # >= the number of splits
    PDL: tl.constexpr,
):
    """Rows longer than one tile (down_proj), split along K over a second grid axis: program (i, j)
    multiplies row block i by K-range j in one tile, as _linear_tile_kernel does, with every weight
    load issued before the wait for the kernel before, and stores its partial sums. The program of
    the block that draws the last ticket (as in gqa_decode's merge) adds the partials in split
    order, writes the rows and resets the ticket. The loop kernel streams such a row one tile at a
    time, a memory round trip per tile, and only after the wait."""
    block = tl.program_id(0)
    split = tl.program_id(1)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    cols = split * BLOCK_K + tl.arange(0, BLOCK_K)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    else:
        bias = 0.0
    dot, _ = _tile_products(x_ptr, x2_ptr, gamma_ptr, sum_ptr, w_ptr, rows, row_ok, cols, cols < k, w_stride,
                            PROLOGUE, PDL)  # fmt: skip
    merge_splits(dot, bias, part_ptr, ticket_ptr, out_ptr, rows, row_ok, n, BLOCK_S)


@triton.jit
def merge_splits(dot, bias, part_ptr, ticket_ptr, out_ptr, rows, row_ok, n, BLOCK_S: tl.constexpr):
    """Program (block, split) of a split-K launch stores its partial sums ``dot`` of ``rows``; the
    program of that row block that draws the last ticket adds every split's partials in split
    order (a fixed order: the result does not depend on which program finishes last), adds
    ``bias``, writes the rows and resets the ticket to zero for the next launch."""
    block = tl.program_id(0)
    split = tl.program_id(1)
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
        y = tl.sum(parts, axis=0) + bias
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)
        tl.store(ticket_ptr + block, 0)


@triton.jit
def _linear_tile_persistent_kernel(
    x_ptr,
    x2_ptr,
    gamma_ptr,
    sum_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    n,
    k,
    w_stride,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= k
    PDL: tl.constexpr,
):
    """_linear_tile_kernel with fewer programs than row blocks: each program takes every
    num_programs-th block of BLOCK_N rows, with the next block's weights in flight while it sums
    this one's, and computes the prologue once for all its blocks. Same products and sums per row
    as _linear_tile_kernel."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_K)
    inside = cols < k
    lanes = tl.arange(0, BLOCK_N)
    rows = pid * BLOCK_N + lanes
    w_next = tl.load(
        w_ptr + rows[:, None] * w_stride + cols[None, :], mask=(rows < n)[:, None] & inside[None, :], other=0.0
    )
    wait_for_previous(PDL)
    x, x2, gamma = _activation_inputs(x_ptr, x2_ptr, gamma_ptr, cols, inside, PROLOGUE)
    a, sq = _activation(x, x2, gamma, sum_ptr, cols, inside, PROLOGUE)
    for first in range(pid * BLOCK_N, n, step * BLOCK_N):
        rows = first + lanes
        row_ok = rows < n
        w = w_next
        ahead = rows + step * BLOCK_N
        w_next = tl.load(
            w_ptr + ahead[:, None] * w_stride + cols[None, :], mask=(ahead < n)[:, None] & inside[None, :], other=0.0
        )
        y = _finish(tl.sum(w.to(tl.float32) * a[None, :], axis=1), sq, k, eps, PROLOGUE)
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


# -- launch configurations ---------------------------------------------------------------------


def persistent_programs(device: torch.device, opts: options.Options | None = None) -> int:
    """Programs of the persistent one-tile kernel (0: off, the default): ``ONNXGEN_GEMV_PERSIST=P``
    (option ``gemv_persist``) launches P programs per SM (on the CPU interpreter: P programs) for
    rows that fit one tile."""
    return resident_programs((opts or options.current()).gemv_persist, device)


def resident_programs(per_sm: int, device: torch.device) -> int:
    """The programs of a kernel launched as ``per_sm`` programs per SM of ``device`` (the CPU
    interpreter has no SMs: ``per_sm`` programs there); 0 stays 0 (off)."""
    return per_sm * _multiprocessors(device.index or 0) if device.type == "cuda" and per_sm else per_sm


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# the interpreter has no SMs: the tables take the H200's count there, so that the CPU tests run the
# configurations that GPU runs
_INTERPRETER_SMS = 132


def _sms(device: torch.device) -> int:
    return _multiprocessors(device.index or 0) if device.type == "cuda" else _INTERPRETER_SMS


def single_tile_enabled(opts: options.Options | None = None) -> bool:
    """Rows that fit one tile run _linear_tile_kernel; ``ONNXGEN_GEMV_TILE=0`` (option ``gemv_tile``)
    runs the loop kernel there instead (the benches compare the two)."""
    return (opts or options.current()).gemv_tile


def split_config(
    n: int, k: int, device: torch.device, opts: options.Options | None = None
) -> tuple[int, int, int] | None:
    """(BLOCK_N, BLOCK_K, num_warps) of _linear_split_kernel for rows longer than one tile, or None
    (the loop kernel). Measured on the H200 (docs/benchmarks/2026-12-01-h200-tail-split.md): on the
    0.5B shape's down_proj (896 x 4,864), where the loop kernel has 224 programs for 132 SMs, split
    8 x 1,024 in 8 warps ran the step faster than the loop kernel; on the 1.5B shape's (1,536 x
    8,960: 384 programs) every split configuration lost. So the split runs where the loop kernel
    would have fewer than two programs per SM. ``ONNXGEN_GEMV_SPLIT=off`` (option ``gemv_split``)
    turns it off, ``ONNXGEN_GEMV_SPLIT[_<N>x<K>]=a,b,c`` forces a configuration (the benches sweep them)."""
    opts = opts or options.current()
    forced = opts.gemv_split.lookup(n, k)
    if forced == options.SPLIT_OFF:
        return None
    if forced is not None:
        return forced  # type: ignore[return-value]
    loop_block_n = dense_config(n, k, opts)[0]
    if device.type == "cuda" and triton.cdiv(n, loop_block_n) >= 2 * _multiprocessors(device.index or 0):
        return None
    return 8, 1024, 8


def dense_config(n: int, k: int, opts: options.Options | None = None) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a dense [N, K] weight, from whole-step sweeps on the H200
    under PDL (bench/step_anatomy.py, docs/benchmarks/2026-12-01-h200-anatomy.md):
    - K <= 2,048: the whole row in one tile (_linear_tile_kernel), 4 rows per program, 4 warps up
      to 1,024-wide tiles and 8 above, so that every weight load of a program is issued before it
      waits for the kernel before. On the Qwen2.5-1.5B shape (K = 1,536) one-tile rows ran the
      step faster than 256-wide tiles in a loop;
    - longer rows (down_proj, K = 4,864 or 8,960) in the loop kernel: 4 rows per program in
      1,024-wide tiles, 8 warps. The prologue (SiLU-mul of the gate and up rows) is computed once
      per program and serves its rows: on the 0.5B shape 4 rows beat 2, and 2 beat 1. Where that
      grid is small, split_config splits the rows along K instead.
    ``ONNXGEN_GEMV_DENSE[_<N>x<K>]`` (option ``gemv_dense``) forces a configuration."""
    forced = (opts or options.current()).gemv_dense.lookup(n, k)
    if forced:
        return forced  # type: ignore[return-value]
    if k <= 2048:
        block_k = max(16, triton.next_power_of_2(k))
        return 4, block_k, 4 if block_k <= 1024 else 8
    return 4, 1024, 8


@dataclass(frozen=True)
class _RowPlan:
    """How linear_row launches for one (N, K, split allowed, device) under one options object."""

    block_n: int
    block_k: int
    warps: int
    split: tuple[int, int, int] | None
    tile: bool  # the one-tile kernel (the row fits one tile and gemv_tile is on)
    resident: int  # programs of the persistent one-tile kernel (0: off)


# resolved launch plans for the options object in force (_PLANS_FOR[0]); emptied when it changes,
# so an override takes effect at the next launch and the hot path does one dict lookup per launch
_PLANS: dict[tuple, _RowPlan | tuple[int, int, int]] = {}
_PLANS_FOR: list[options.Options | None] = [None]


def _plans() -> tuple[dict[tuple, _RowPlan | tuple[int, int, int]], options.Options]:
    opts = options.current()
    if _PLANS_FOR[0] is not opts:
        _PLANS.clear()
        _PLANS_FOR[0] = opts
    return _PLANS, opts


def _row_plan(n: int, k: int, splittable: bool, device: torch.device) -> _RowPlan:
    plans, opts = _plans()
    key = (n, k, splittable, device)
    plan = plans.get(key)
    if plan is None:
        block_n, block_k, warps = dense_config(n, k, opts)
        split = split_config(n, k, device, opts) if block_k < k and splittable else None
        tile = block_k >= k and single_tile_enabled(opts)
        resident = persistent_programs(device, opts) if tile else 0
        plan = plans[key] = _RowPlan(block_n, block_k, warps, split, tile, resident)
    return plan  # type: ignore[return-value]


# -- launchers ---------------------------------------------------------------------------------


def _prologue_args(x: torch.Tensor, prologue: str, x2, gamma, sum_out):
    code = PROLOGUES[prologue]
    if code in (2, 3) and (x2 is None or x2.numel() != x.numel()):
        raise ValueError(f"prologue {prologue} needs a second input of x's size")
    if code in (1, 2) and (gamma is None or gamma.numel() != x.numel()):
        raise ValueError(f"prologue {prologue} needs gamma of x's size")
    if code == 2 and (sum_out is None or sum_out.numel() != x.numel()):
        raise ValueError("prologue skip_rms needs sum_out of x's size")
    x2 = x2.contiguous() if x2 is not None else x
    return code, x2, gamma if gamma is not None else x, sum_out if sum_out is not None else x


def linear_row(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    prologue: str = "none",
    x2: torch.Tensor | None = None,
    gamma: torch.Tensor | None = None,
    eps: float = 0.0,
    sum_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """p(x) @ weight.T (+ bias) for one row x of K values and a [N, K] weight; returns [N] in x's dtype."""
    n, k = weight.shape
    x = x.reshape(k).contiguous()
    if weight.stride(1) != 1:
        raise ValueError("the weight must be [N, K] with K contiguous")
    code, x2, gamma, sum_out = _prologue_args(x, prologue, x2, gamma, sum_out)
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    plan = _row_plan(n, k, code in (0, 3), x.device)
    block_n, block_k, warps = plan.block_n, plan.block_k, plan.warps
    LAUNCHES["linear_row"] += 1
    if plan.split is not None:
        _launch_split(x, x2, gamma, sum_out, weight, bias, out, code, plan.split)
        return out
    kernel, grid = _linear_row_kernel, triton.cdiv(n, block_n)
    if plan.tile:
        kernel = _linear_tile_kernel
        if plan.resident and grid > plan.resident:
            kernel, grid = _linear_tile_persistent_kernel, plan.resident
            LAUNCHES["linear_row_persistent"] += 1
    kernel[(grid,)](
        x, x2, gamma, sum_out, weight, bias if bias is not None else out, out,
        n, k, weight.stride(0), float(eps),
        PROLOGUE=code, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        **pdl_launch(x, out, sum_out),
    )  # fmt: skip
    return out


def _launch_split(x, x2, gamma, sum_out, weight, bias, out, code: int, config: tuple[int, int, int]) -> None:
    n, k = weight.shape
    block_n, block_k, warps = config
    blocks, splits = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    parts, tickets = split_scratch(n, splits, blocks, x.device)
    LAUNCHES["linear_row_split"] += 1
    _linear_split_kernel[(blocks, splits)](
        x, x2, gamma, sum_out, weight, bias if bias is not None else out, out, parts, tickets,
        n, k, weight.stride(0), 0.0,
        PROLOGUE=code, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_S=triton.next_power_of_2(splits), num_warps=warps, **pdl_launch(x, out, parts, tickets),
    )  # fmt: skip


# per (rows, splits, row blocks, device): the partials and the tickets of _linear_split_kernel.
# Kernels of one stream run one after another past their PDL wait, so layers of one shape share them
_SPLIT_SCRATCH: dict[tuple[int, int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def split_scratch(n: int, splits: int, blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (n, splits, blocks, device)
    found = _SPLIT_SCRATCH.get(key)
    if found is None:
        found = _SPLIT_SCRATCH[key] = (
            torch.empty((splits, n), dtype=torch.float32, device=device),
            torch.zeros(blocks, dtype=torch.int32, device=device),  # the kernel leaves them zero
        )
    return found
