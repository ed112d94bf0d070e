"""The argmax of a row plus counter-keyed Gumbel noise, in a Triton kernel: a categorical draw
from softmax(row) (Gumbel-max), optionally after an elementwise rescaling of the row by per-entry
counts and a temperature, with the bookkeeping a decode step's tail needs.

Per entry i of the row (x_i, float of any width, read as float32) and its count c_i:

    x_i <- x_i / a if (c_i > 0 and x_i > 0), x_i * a if (c_i > 0 and x_i <= 0)   (SCALE)
    x_i <- x_i - b * c_i                                                          (LINEAR)
    x_i <- x_i - d * [c_i > 0]                                                    (PRESENT)
    x_i <- x_i / t                                                                (TEMPER)
    g_i  = -log(-log(u_i)),  u_i = ((h_i >> 9) + 0.5) / 2**23
    h_i  = mix(mix(mix((i + s0) mod 2**32) ^ s1) ^ (n * 0x9E3779B1 mod 2**32))

where mix is a bijective 32-bit hash (xor-shift and odd multipliers), (s0, s1) the seed words and n
the counter. With FLOOR, entries below a floor are left out of the draw; kernels before it find
the floor as the largest of: the k-th largest x (top-k, k <= TOP_K_MAX), the top-p cut (the
smallest x whose softmax mass strictly above is below p: sorting's rule, ties aside; within the k
with top-k, by bisection in the floor kernel; over the whole row without it, from the cut
kernel's two mass histograms, to within one fine bucket), and max(x) + log(r) (min-p:
softmax(x)_i >= r * max softmax(x)).
The result is argmax_i (x_i + g_i) over the rest, the first index of the maximum; -1 where the
maximum of x is NaN or infinite or every x_i is -inf. Then c[max(result, 0)] += 1 (COUNT), n += 1,
and with ADVANCE: pos += 1, flags[min(pos, width - 1)] = 1 and host[pos] = result (HOST).

Every program reduces one block of the row and stores its partials; the program that draws the last
ticket (as greedy_advance does) reduces them in block order and does the bookkeeping.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen.runtime.device_kernels import NOISY_ARGMAX_TOP_K_MAX as TOP_K_MAX
from onnxgen.runtime.gpu.launch import LAUNCHES, cached_buffers, pdl_launch
from onnxgen.runtime.gpu.pdl import wait_for_previous

BLOCK = 2048


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    return x ^ (x >> 16)


@triton.jit
def _rescaled(row_ptr, offs, inside, counts_ptr, scale_ptr, linear_ptr, present_ptr, temper_ptr,
              SCALE: tl.constexpr, LINEAR: tl.constexpr, PRESENT: tl.constexpr, TEMPER: tl.constexpr):  # fmt: skip
    """x of the module's note, float32, -inf outside the row."""
    x = tl.load(row_ptr + offs, mask=inside, other=float("-inf")).to(tl.float32)
    if SCALE or LINEAR or PRESENT:
        c = tl.load(counts_ptr + offs, mask=inside, other=0.0)
        seen = c > 0
        if SCALE:
            a = tl.load(scale_ptr)
            x = tl.where(seen, tl.where(x > 0, x / a, x * a), x)
        if LINEAR:
            x = x - tl.load(linear_ptr) * c
        if PRESENT:
            x = x - tl.load(present_ptr) * seen.to(tl.float32)
    if TEMPER:
        x = x / tl.load(temper_ptr)
    return x


@triton.jit
def _key(v):
    """float32 -> int64 keys in the floats' order (their bits, the negative ones' magnitude flipped)."""
    bits = v.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _unkey(k):
    bits = k.to(tl.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _floor_kernel(
    row_ptr, vocab, counts_ptr, scale_ptr, linear_ptr, present_ptr, temper_ptr,
    top_k, top_p_ptr, ratio_ptr,
    part_max_ptr, cand_ptr, ticket_ptr, floor_ptr,
    BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, K: tl.constexpr,
    SCALE: tl.constexpr, LINEAR: tl.constexpr, PRESENT: tl.constexpr, TEMPER: tl.constexpr,
    TOPK: tl.constexpr, TOPP: tl.constexpr, RATIO: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """floor_ptr <- the smallest x the draw keeps (see noisy_argmax's note on FLOOR).

    Every program stores its block's maximum and, with TOPK, its K largest values (a block holds at
    most K of the k largest of the row); the last program finds the k-th largest value among those
    candidates, then with TOPP the top-p cut among the k kept, both by bisection over the values'
    order-preserving integer keys, and with RATIO the min-p cut max(x) + log(r)."""
    pid = tl.program_id(0)
    wait_for_previous(PDL)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    x = _rescaled(row_ptr, offs, inside, counts_ptr, scale_ptr, linear_ptr, present_ptr, temper_ptr,
                  SCALE, LINEAR, PRESENT, TEMPER)  # fmt: skip
    x = tl.where(x != x, float("-inf"), x)  # a NaN row is refused by the draw; here it must not win
    tl.store(part_max_ptr + pid, tl.max(x, axis=0))
    if TOPK:
        ranked = tl.sort(x, descending=True)
        at = tl.arange(0, BLOCK)
        tl.store(cand_ptr + pid * K + at, ranked, mask=at < K)
    tl.debug_barrier()
    programs = tl.num_programs(0)
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == programs - 1:
        p = tl.arange(0, BLOCK_P)
        valid = p < programs
        top = tl.max(tl.load(part_max_ptr + p, mask=valid, other=float("-inf"), cache_modifier=".cg"), axis=0)
        floor = tl.full((), float("-inf"), tl.float32)
        if TOPK:
            j = tl.arange(0, K)
            cand = tl.load(cand_ptr + p[:, None] * K + j[None, :], mask=valid[:, None], other=float("-inf"),
                           cache_modifier=".cg")  # fmt: skip
            keys = _key(cand)
            # the largest key v with at least top_k candidates >= v: the k-th largest value's
            lo = _key(tl.full((), float("-inf"), tl.float32))
            hi = _key(top)
            for _ in range(33):
                mid = lo + (hi - lo + 1) // 2
                enough = tl.sum(tl.where(keys >= mid, 1, 0)) >= top_k
                lo = tl.where(enough, mid, lo)
                hi = tl.where(enough, hi, mid - 1)
            floor = _unkey(lo)
            if TOPP:
                # mass(v): softmax mass of the kept candidates with keys > v; the cut is the smallest
                # key v with mass(v) < p: kept are the values whose mass strictly above is below p
                weight = tl.where(keys >= lo, tl.exp(cand - top), 0.0)
                total = tl.sum(weight)
                bound = tl.load(top_p_ptr) * total
                lo2 = lo
                hi2 = _key(top)
                for _ in range(33):
                    mid = lo2 + (hi2 - lo2) // 2
                    light = tl.sum(tl.where(keys > mid, weight, 0.0)) < bound
                    hi2 = tl.where(light, mid, hi2)
                    lo2 = tl.where(light, lo2, mid + 1)
                floor = tl.maximum(floor, _unkey(hi2))
        if RATIO:
            floor = tl.maximum(floor, top + tl.log(tl.load(ratio_ptr)))
        tl.store(floor_ptr, floor)
        tl.store(ticket_ptr, 0)


# top-p without top-k: the cut over the whole row, from two histograms of softmax mass (below)
CUT_BUCKETS = 2048
CUT_RANGE = tl.constexpr(28.0)  # nats below the maximum the first histogram spans: e**-28 * 2**40 < 1, so a token
# further below weighs nothing in FIXED_ONE units and cannot hold the cut
FIXED_ONE = tl.constexpr(2.0**40)  # softmax weights exp(x - max) in integer units: sums are exact and order-free


@triton.jit
def _cut_level_kernel(
    row_ptr, vocab, counts_ptr, scale_ptr, linear_ptr, present_ptr, temper_ptr, top_p_ptr, ratio_ptr,
    state_ptr,  # [8] fp64: max, lo, hi, mass above (units), target (units), level-1 bucket, floor, -
    hist_ptr,  # [CUT_BUCKETS] int64, zero between calls
    part_max_ptr, ticket_ptr, floor_ptr,
    LEVEL: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, NB: tl.constexpr,
    SCALE: tl.constexpr, LINEAR: tl.constexpr, PRESENT: tl.constexpr, TEMPER: tl.constexpr,
    RATIO: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """LEVEL 0: the row's maximum. LEVEL 1: the mass of each of NB buckets of width CUT_RANGE / NB
    below it; the last program finds the bucket that holds the top-p cut. LEVEL 2: the same over
    that bucket alone, in NB finer buckets; the last program writes the floor: the lower edge of the
    fine bucket holding the cut (with RATIO, at least min-p's max + log r)."""
    pid = tl.program_id(0)
    wait_for_previous(PDL)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    x = _rescaled(row_ptr, offs, inside, counts_ptr, scale_ptr, linear_ptr, present_ptr, temper_ptr,
                  SCALE, LINEAR, PRESENT, TEMPER)  # fmt: skip
    x = tl.where(x != x, float("-inf"), x)
    if LEVEL == 0:
        tl.store(part_max_ptr + pid, tl.max(x, axis=0))
    else:
        top = tl.load(state_ptr).to(tl.float32)
        width1 = CUT_RANGE / NB
        b1 = ((top - x) / width1).to(tl.int32)  # x <= top: b1 >= 0
        units = (tl.exp(x - top) * FIXED_ONE).to(tl.int64)
        if LEVEL == 1:
            take = inside & (b1 < NB) & (units > 0)
            tl.atomic_add(hist_ptr + tl.minimum(b1, NB - 1), units, mask=take, sem="relaxed")
        else:
            chosen = tl.load(state_ptr + 5).to(tl.int32)
            hi = top - chosen.to(tl.float32) * width1
            b2 = tl.minimum(((hi - x) / (width1 / NB)).to(tl.int32), NB - 1)
            take = inside & (b1 == chosen) & (units > 0)
            tl.atomic_add(hist_ptr + tl.maximum(b2, 0), units, mask=take, sem="relaxed")
    tl.debug_barrier()
    programs = tl.num_programs(0)
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == programs - 1:
        if LEVEL == 0:
            p = tl.arange(0, BLOCK_P)
            maxes = tl.load(part_max_ptr + p, mask=p < programs, other=float("-inf"), cache_modifier=".cg")
            tl.store(state_ptr, tl.max(maxes, axis=0).to(tl.float64))
        else:
            j = tl.arange(0, NB)
            h = tl.atomic_add(hist_ptr + j, tl.zeros((NB,), tl.int64), sem="acquire")  # read, settled
            tl.store(hist_ptr + j, tl.zeros((NB,), tl.int64))  # zero for the next call
            top = tl.load(state_ptr).to(tl.float32)
            if LEVEL == 1:
                above = tl.zeros((), tl.int64)
                target = (tl.load(top_p_ptr).to(tl.float64) * tl.sum(h).to(tl.float64)).to(tl.int64)
                tl.store(state_ptr + 4, target.to(tl.float64))
            else:
                above = tl.load(state_ptr + 3).to(tl.int64)
                target = tl.load(state_ptr + 4).to(tl.int64)
            reach = above + tl.cumsum(h, axis=0)
            cut = tl.min(tl.where(reach >= target, j, NB), axis=0)  # the first bucket reaching p
            before = tl.sum(tl.where(j < cut, h, 0))
            width1 = CUT_RANGE / NB
            if LEVEL == 1:
                tl.store(state_ptr + 3, (above + before).to(tl.float64))
                tl.store(state_ptr + 5, tl.minimum(cut, NB - 1).to(tl.float64))
                # never reached (p near 1 and the mass in FIXED_ONE units rounded down): keep it all
                tl.store(state_ptr + 6, tl.where(cut < NB, 0.0, float("-inf")).to(tl.float64))
            else:
                chosen = tl.load(state_ptr + 5).to(tl.int32)
                hi = top - chosen.to(tl.float32) * width1
                floor = hi - (tl.minimum(cut, NB - 1) + 1).to(tl.float32) * (width1 / NB)
                floor = tl.where(tl.load(state_ptr + 6) < 0.0, float("-inf"), floor)
                if RATIO:
                    floor = tl.maximum(floor, top + tl.log(tl.load(ratio_ptr)))
                tl.store(floor_ptr, floor)
        tl.store(ticket_ptr, 0)


@triton.jit
def _noisy_argmax_kernel(
    row_ptr,
    vocab,
    seed_ptr,  # [2] int64: s0, s1, each in [0, 2**32)
    counter_ptr,  # [] int64
    counts_ptr,  # [vocab] fp32
    scale_ptr,  # [] fp32: a
    linear_ptr,  # [] fp32: b
    present_ptr,  # [] fp32: d
    temper_ptr,  # [] fp32: t
    floor_ptr,  # [] fp32: the smallest x kept, from _floor_kernel (FLOOR)
    part_val_ptr,  # [programs] fp32: the block's best noisy value
    part_idx_ptr,  # [programs] int32: where
    part_max_ptr,  # [programs] fp32: the block's maximum of x (NaN left out)
    part_nan_ptr,  # [programs] int32: 1 where the block holds a NaN
    ticket_ptr,  # [1] int32, zero between calls
    out_ptr,  # [] int64: the result
    pos_ptr,
    flags_ptr,
    host_ptr,
    width,
    BLOCK: tl.constexpr,
    BLOCK_P: tl.constexpr,
    SCALE: tl.constexpr,
    LINEAR: tl.constexpr,
    PRESENT: tl.constexpr,
    TEMPER: tl.constexpr,
    FLOOR: tl.constexpr,
    COUNT: tl.constexpr,
    ADVANCE: tl.constexpr,
    HOST: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    wait_for_previous(PDL)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    x = _rescaled(row_ptr, offs, inside, counts_ptr, scale_ptr, linear_ptr, present_ptr, temper_ptr,
                  SCALE, LINEAR, PRESENT, TEMPER)  # fmt: skip
    is_nan = x != x
    has_nan = tl.max(tl.where(is_nan & inside, 1, 0), axis=0)
    clean = tl.where(is_nan | (offs >= vocab), float("-inf"), x)
    block_max = tl.max(clean, axis=0)
    s0 = tl.load(seed_ptr).to(tl.uint32)
    s1 = tl.load(seed_ptr + 1).to(tl.uint32)
    key = ((tl.load(counter_ptr) * 0x9E3779B1) & 0xFFFFFFFF).to(tl.uint32)
    h = _mix32(_mix32(offs.to(tl.uint32) + s0) ^ s1)
    h = _mix32(h ^ key)
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    score = clean - tl.log(-tl.log(u))
    if FLOOR:
        score = tl.where(clean < tl.load(floor_ptr), float("-inf"), score)
    best = tl.max(score, axis=0)
    best_at = tl.min(tl.where((score == best) & inside, offs, vocab), axis=0)
    tl.store(part_val_ptr + pid, best)
    tl.store(part_idx_ptr + pid, best_at)
    tl.store(part_max_ptr + pid, block_max)
    tl.store(part_nan_ptr + pid, has_nan)
    tl.debug_barrier()  # every partial is stored before the ticket (release)
    programs = tl.num_programs(0)
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == programs - 1:
        p = tl.arange(0, BLOCK_P)
        valid = p < programs
        vals = tl.load(part_val_ptr + p, mask=valid, other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(part_idx_ptr + p, mask=valid, other=vocab, cache_modifier=".cg")
        maxes = tl.load(part_max_ptr + p, mask=valid, other=float("-inf"), cache_modifier=".cg")
        nans = tl.load(part_nan_ptr + p, mask=valid, other=0, cache_modifier=".cg")
        top = tl.max(vals, axis=0)
        token = tl.min(tl.where(vals == top, idxs, vocab), axis=0)
        m = tl.max(maxes, axis=0)
        finite = (tl.max(nans, axis=0) == 0) & (m < float("inf")) & (m > float("-inf")) & (token < vocab)
        token = tl.where(finite, token, -1)
        tl.store(out_ptr, token.to(out_ptr.dtype.element_ty))
        if COUNT:
            at = tl.maximum(token, 0)
            tl.store(counts_ptr + at, tl.load(counts_ptr + at) + 1.0)
        tl.store(counter_ptr, tl.load(counter_ptr) + 1)
        if ADVANCE:
            pos = tl.load(pos_ptr) + 1
            tl.store(pos_ptr, pos)
            tl.store(flags_ptr + tl.minimum(pos, width - 1), tl.full((), 1, flags_ptr.dtype.element_ty))
            if HOST:
                tl.store(host_ptr + pos, token.to(host_ptr.dtype.element_ty))
        tl.store(ticket_ptr, 0)


def noisy_argmax(
    row: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
    out: torch.Tensor,
    counts: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    linear: torch.Tensor | None = None,
    present: torch.Tensor | None = None,
    temper: torch.Tensor | None = None,
    top_k: int = 0,
    top_p: torch.Tensor | None = None,
    floor_ratio: torch.Tensor | None = None,
    count: bool = False,
    position: torch.Tensor | None = None,
    flags: torch.Tensor | None = None,
    host_out: torch.Tensor | None = None,
) -> None:
    """See the module's note; ``top_k`` (0: off, else at most TOP_K_MAX), ``top_p`` (one fp32) and
    ``floor_ratio`` (min-p's r, one fp32): FLOOR's cuts, or left out. ``row``: [vocab] contiguous;
    ``seed``: [2] int64; ``counter``, ``out``: one int64 each; ``counts``: [vocab] fp32;
    ``scale``, ``linear``, ``present``, ``temper``: one fp32 each, or None for a stage left out;
    ``position`` with ``flags`` ([1, width] int64) and ``host_out`` ([width + 1] int64, pinned):
    the advance, or None."""
    LAUNCHES["noisy_argmax"] += 1
    vocab = row.numel()
    programs = triton.cdiv(vocab, BLOCK)
    if not 0 <= top_k <= TOP_K_MAX:
        raise ValueError(f"top_k must be in [0, {TOP_K_MAX}], got {top_k}")
    part_val, part_idx, part_max, part_nan, ticket, floor = _scratch(programs, row.device)
    one = counter  # a placeholder pointer for the stages left out (never read)
    advance = position is not None and flags is not None
    stages = {"SCALE": scale is not None, "LINEAR": linear is not None, "PRESENT": present is not None,
              "TEMPER": temper is not None}  # fmt: skip
    factors = [t if t is not None else one for t in (scale, linear, present, temper)]
    cut = top_k > 0 or top_p is not None or floor_ratio is not None
    if top_p is not None and not top_k:
        LAUNCHES["noisy_argmax_cut"] += 1
        state, hist = _cut_scratch(row.device)
        for level in (0, 1, 2):
            _cut_level_kernel[(programs,)](
                row, vocab, counts, *factors, top_p, floor_ratio if floor_ratio is not None else one,
                state, hist, part_max, ticket, floor,
                LEVEL=level, BLOCK=BLOCK, BLOCK_P=triton.next_power_of_2(programs), NB=CUT_BUCKETS, **stages,
                RATIO=floor_ratio is not None, num_warps=8, **pdl_launch(row, state, hist, part_max, ticket, floor),
            )  # fmt: skip
    elif cut:
        LAUNCHES["noisy_argmax_floor"] += 1
        k_width = triton.next_power_of_2(max(top_k, 1))
        candidates = _candidates(programs * k_width, row.device)
        _floor_kernel[(programs,)](
            row, vocab, counts, *factors, top_k, top_p if top_p is not None else one,
            floor_ratio if floor_ratio is not None else one, part_max, candidates, ticket, floor,
            BLOCK=BLOCK, BLOCK_P=triton.next_power_of_2(programs), K=k_width, **stages, TOPK=top_k > 0,
            TOPP=top_p is not None, RATIO=floor_ratio is not None, num_warps=8,
            **pdl_launch(row, part_max, candidates, ticket, floor),
        )  # fmt: skip
    _noisy_argmax_kernel[(programs,)](
        row,
        vocab,
        seed,
        counter,
        counts,
        *factors,
        floor,
        part_val,
        part_idx,
        part_max,
        part_nan,
        ticket,
        out,
        position if advance else out,
        flags if advance else out,
        host_out if host_out is not None else out,
        flags.shape[-1] if advance else 1,
        BLOCK=BLOCK,
        BLOCK_P=triton.next_power_of_2(programs),
        **stages,
        FLOOR=cut,
        COUNT=count,
        ADVANCE=advance,
        HOST=advance and host_out is not None,
        num_warps=4,
        **pdl_launch(
            row,
            counts,
            counter,
            out,
            part_val,
            part_idx,
            part_max,
            part_nan,
            ticket,
            position if advance else None,
            flags if advance else None,
        ),  # fmt: skip
    )


def _cut_scratch(device: torch.device) -> list[torch.Tensor]:
    """The cut kernel's state ([8] fp64) and histogram."""
    return cached_buffers("noisy_argmax_cut", 0, device, [(8, torch.float64), (CUT_BUCKETS, torch.int64)])


def _candidates(size: int, device: torch.device) -> torch.Tensor:
    return cached_buffers("noisy_argmax_candidates", size, device, [(size, torch.float32)])[0]


def _scratch(programs: int, device: torch.device) -> list[torch.Tensor]:
    """Partials (value, index, maximum, NaN flag), the ticket and the floor."""
    f32, i32 = torch.float32, torch.int32
    specs = [(programs, f32), (programs, i32), (programs, f32), (programs, i32), (1, i32), (0, f32)]
    return cached_buffers("noisy_argmax", programs, device, specs)
