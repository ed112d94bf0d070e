"""GroupQueryAttention's single-token decode step over a shared (static) KV buffer, in one Triton
kernel instead of the ~40 torch kernels of the general path.

One program per (batch, KV head, key block): the G query heads that share the KV head attend to
BLOCK_N keys (split-K over the sequence, "flash decoding"). Each program applies rotary (fp32, as
onnxruntime computes it for half inputs) to its query heads and to the new K row; the new row sits
at cache row seqlens_k[b] (read on the device: no host sync, capture-safe), comes from registers in
the block that holds it, and that block's program writes K and V there. Partial max, sum and
weighted values go to fp32 scratch. Blocks past the valid length T = seqlens_k + 1 exit.

The last program of a (batch, KV head) to finish merges the partials of its G heads: each program
takes a ticket from a counter after its partials are stored, and the one that draws the last
ticket combines the valid blocks in block order (then resets the counter for the next step). A
second kernel for the merge would cost a launch per layer; the ticket costs one atomic.

The grid depends only on the buffer capacity, never on T, so a recorded graph serves every step;
every reduction has a fixed order (the merge does not depend on which program drew the last
ticket), so the result is the same bit for bit from run to run (what captured == eager needs).
fp32 models use IEEE fp32 dot products (no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen import options
from onnxgen.runtime.gpu.launch import LAUNCHES, pdl_launch, settled_before_launch
from onnxgen.runtime.gpu.pdl import wait_for_previous

# fp32 elements of one merge tile (heads x splits x head_size): long buffers merge in several passes
# (tests lower it to exercise the loop)
COMBINE_TILE = 8192

# per KV buffer, the (batch x KV head) tickets of the merge: zero between calls (the last program
# resets them), and one per buffer so that concurrent sessions and layers never share a counter
_TICKETS: dict[tuple[int, torch.device, int], torch.Tensor] = {}


@triton.jit
def _rotary_tables(
    cos_ptr, sin_ptr, pos, d, ok, DO_ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, HALF_ROT: tl.constexpr
):
    """(cos, sin) of channels ``d`` at position ``pos`` in fp32 (1 and 0 outside the rotated part)."""
    cos = tl.zeros(d.shape, tl.float32) + 1.0
    sin = tl.zeros(d.shape, tl.float32)
    if DO_ROTARY:
        in_rot = ok & (d < 2 * HALF_ROT)
        if INTERLEAVED:
            j = d // 2
        else:
            j = tl.where(d < HALF_ROT, d, d - HALF_ROT)
        cos = tl.load(cos_ptr + pos * HALF_ROT + j, mask=in_rot, other=1.0, cache_modifier=".cg").to(tl.float32)
        sin = tl.load(sin_ptr + pos * HALF_ROT + j, mask=in_rot, other=0.0, cache_modifier=".cg").to(tl.float32)
    return cos, sin


@triton.jit
def _rope(src, d, ok, cos, sin, DO_ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, HALF_ROT: tl.constexpr):
    """Channels ``d`` of the row(s) at ``src``, rotated by the tables ``cos``/``sin``, in fp32 (``ok``:
    which exist).

    Channel d pairs with a partner channel (d +- R/2, or its neighbour when interleaved):
    x_d * cos - x_partner * sin for the first of a pair, x_d * cos + x_partner * sin for the second."""
    x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
    if DO_ROTARY:
        in_rot = ok & (d < 2 * HALF_ROT)
        if INTERLEAVED:
            partner = d ^ 1
            sign = tl.where(d % 2 == 0, -1.0, 1.0)
        else:
            partner = tl.where(d < HALF_ROT, d + HALF_ROT, d - HALF_ROT)
            sign = tl.where(d < HALF_ROT, -1.0, 1.0)
        other = tl.load(src + partner, mask=in_rot, other=0.0).to(tl.float32)
        x = tl.where(in_rot, x * cos + sign * other * sin, x)
    return x


@triton.jit
def _settled_inputs(
    seqlens_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    key_cache_ptr,
    value_cache_ptr,
    b,
    kv_base,
    start,
    n,
    d,
    d_ok,
    head_size,
    window,
    HAS_POSITIONS: tl.constexpr,
    DO_ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HALF_ROT: tl.constexpr,
):
    """What the step reads that the kernel right before it does not write: the new row's index and
    position, the rotary tables there, and this block's cached K/V rows (earlier steps' rows; the new
    row itself comes from registers). Read from L2 (.cg): other kernels wrote them."""
    row = tl.load(seqlens_ptr + b, cache_modifier=".cg").to(tl.int32)  # the new token's row; T = row + 1
    if HAS_POSITIONS:
        pos = tl.load(pos_ptr + b, cache_modifier=".cg").to(tl.int64)
    else:
        pos = row.to(tl.int64)
    total = row + 1
    active = d_ok & ((start + tl.zeros_like(d)) < total)  # a vector mask: the interpreter takes no scalar
    cos, sin = _rotary_tables(cos_ptr, sin_ptr, pos, d, active, DO_ROTARY, INTERLEAVED, HALF_ROT)
    visible = n < total
    if window > 0:
        visible = visible & (n >= total - window)
    old = visible & (n != row)
    kv_mask = old[:, None] & d_ok[None, :]
    offsets = kv_base + n[:, None].to(tl.int64) * head_size + d[None, :]
    k = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0, cache_modifier=".cg")
    v = tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0.0, cache_modifier=".cg")
    return row, cos, sin, visible, k, v


@triton.jit
def _attend_split(
    q_ptr,  # the step's rows: query heads, then (for the new K/V) k and v rows
    k_ptr,
    v_ptr,
    q_row_stride,
    k_row_stride,
    v_row_stride,
    seqlens_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    key_cache_ptr,
    value_cache_ptr,
    part_max_ptr,  # [B, H, S] fp32
    part_sum_ptr,  # [B, H, S] fp32
    part_acc_ptr,  # [B, H, S, D] fp32
    ticket_ptr,  # [B * KV] int32, zero between calls
    out_ptr,  # [B, 1, H * D]
    cache_batch_stride,
    cache_head_stride,
    num_heads,
    head_size,
    num_splits,
    scale,
    window,  # local_window_size (<= 0: none)
    HAS_POSITIONS: tl.constexpr,
    DO_ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HALF_ROT: tl.constexpr,  # rotary_dim / 2 (cos_cache's width)
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # splits merged per pass
    IEEE: tl.constexpr,
    EARLY: tl.constexpr,  # read the settled inputs before the wait (decode_attention says when it may)
    PDL: tl.constexpr,  # programmatic dependent launch: wait for the kernel before
):
    b = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    start = split * BLOCK_N
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_size
    n = start + tl.arange(0, BLOCK_N)
    kv_base = b * cache_batch_stride + kv * cache_head_stride
    if not EARLY:
        wait_for_previous(PDL)
    # EARLY: under PDL these stream while the kernel before (the QKV projection) finishes
    row, cos, sin, visible, k, v = _settled_inputs(
        seqlens_ptr, pos_ptr, cos_ptr, sin_ptr, key_cache_ptr, value_cache_ptr, b, kv_base, start, n, d, d_ok,
        head_size, window, HAS_POSITIONS, DO_ROTARY, INTERLEAVED, HALF_ROT,
    )  # fmt: skip
    if EARLY:
        wait_for_previous(PDL)
    total = row + 1
    if start < total:
        heads = kv * GROUP + g
        q_mask = (g[:, None] < GROUP) & d_ok[None, :]
        q_src = q_ptr + b * q_row_stride + heads[:, None] * head_size
        q = _rope(q_src, d[None, :], q_mask, cos[None, :], sin[None, :], DO_ROTARY, INTERLEAVED, HALF_ROT)
        q = q.to(q_ptr.dtype.element_ty)
        # the new row, rotated, as the cache stores it; the block that holds it writes it there
        k_new = _rope(k_ptr + b * k_row_stride + kv * head_size, d, d_ok, cos, sin,
                      DO_ROTARY, INTERLEAVED, HALF_ROT).to(key_cache_ptr.dtype.element_ty)  # fmt: skip
        v_new = tl.load(v_ptr + b * v_row_stride + kv * head_size + d, mask=d_ok, other=0.0)
        v_new = v_new.to(value_cache_ptr.dtype.element_ty)
        here = start + tl.zeros_like(d)  # the block's first row, per channel (a vector mask)
        owns = d_ok & (here <= row) & (row < here + BLOCK_N)
        new_at = kv_base + row.to(tl.int64) * head_size + d
        tl.store(key_cache_ptr + new_at, k_new, mask=owns)
        tl.store(value_cache_ptr + new_at, v_new, mask=owns)

        k = tl.where((n == row)[:, None], k_new[None, :], k).to(q.dtype)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale
        scores = tl.where(visible[None, :], scores, float("-inf"))
        block_max = tl.max(scores, axis=1)
        safe_max = tl.where(block_max == float("-inf"), 0.0, block_max)
        p = tl.exp(scores - safe_max[:, None])
        block_sum = tl.sum(p, axis=1)
        v = tl.where((n == row)[:, None], v_new[None, :], v).to(q.dtype)
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v)
        g_ok = g < GROUP
        used = tl.minimum((total + BLOCK_N - 1) // BLOCK_N, num_splits)
        if used == 1:
            # one block holds every key: its partials are the result (the merge of one block
            # computes acc * 1 / (sum * 1), the same bits), written without the round trip
            out_at = (b * num_heads + heads)[:, None] * head_size + d[None, :]
            out = acc / tl.where(g_ok, block_sum, 1.0)[:, None]
            tl.store(out_ptr + out_at, out.to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            part = (b * num_heads + heads) * num_splits + split
            tl.store(part_max_ptr + part, block_max, mask=g_ok)
            tl.store(part_sum_ptr + part, block_sum, mask=g_ok)
            tl.store(part_acc_ptr + part[:, None] * head_size + d[None, :], acc, mask=q_mask)
            # every thread's partials are stored before the ticket (release); the last drawer merges
            tl.debug_barrier()
            ticket_at = ticket_ptr + b * tl.num_programs(1) + kv
            ticket = tl.atomic_add(ticket_at, 1, sem="acq_rel")
            if ticket == used - 1:
                _merge_group(part_max_ptr, part_sum_ptr, part_acc_ptr, out_ptr, b, heads, g_ok, d, used,
                             num_heads, head_size, num_splits, BLOCK_S)  # fmt: skip
                tl.store(ticket_at, 0)


@triton.jit
def _merge_group(
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    out_ptr,
    b,
    heads,
    g_ok,
    d,
    used,
    num_heads,
    head_size,
    num_splits,
    BLOCK_S: tl.constexpr,
):
    """The attention output of the query heads ``heads`` from the ``used`` blocks' partials, BLOCK_S
    blocks per pass in block order. Partials of other programs are read from L2 (.cg): this
    program's L1 may hold older lines of the scratch."""
    base = (b * num_heads + heads) * num_splits  # [G]
    d_ok = d < head_size
    # pass 1: the largest partial max per head; pass 2: the rescaled sums
    top = tl.full(heads.shape, float("-inf"), tl.float32)
    for first in range(0, used, BLOCK_S):
        s = first + tl.arange(0, BLOCK_S)
        live = g_ok[:, None] & (s < used)[None, :]
        m = tl.load(part_max_ptr + base[:, None] + s[None, :], mask=live, other=float("-inf"), cache_modifier=".cg")
        top = tl.maximum(top, tl.max(m, axis=1))
    top = tl.where(top == float("-inf"), 0.0, top)
    denominator = tl.zeros(heads.shape, tl.float32)
    out = tl.zeros((heads.shape[0], d.shape[0]), tl.float32)
    for first in range(0, used, BLOCK_S):
        s = first + tl.arange(0, BLOCK_S)
        live = g_ok[:, None] & (s < used)[None, :]
        at = base[:, None] + s[None, :]  # [G, S]
        m = tl.load(part_max_ptr + at, mask=live, other=float("-inf"), cache_modifier=".cg")
        l_part = tl.load(part_sum_ptr + at, mask=live, other=0.0, cache_modifier=".cg")
        w = tl.where(live & (m > float("-inf")), tl.exp(m - top[:, None]), 0.0)
        denominator += tl.sum(l_part * w, axis=1)
        acc_at = at[:, :, None] * head_size + d[None, None, :]
        acc_mask = live[:, :, None] & d_ok[None, None, :]
        acc = tl.load(part_acc_ptr + acc_at, mask=acc_mask, other=0.0, cache_modifier=".cg")
        out += tl.sum(acc * w[:, :, None], axis=1)
    out = out / tl.where(g_ok, denominator, 1.0)[:, None]
    out_at = (b * num_heads + heads)[:, None] * head_size + d[None, :]
    tl.store(out_ptr + out_at, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def packed_qkv_views(
    qkv: torch.Tensor, num_heads: int, kv_heads: int, head_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The query, key and value parts of packed QKV rows [..., (H + 2 KV) * D], as views."""
    width, kv_width = num_heads * head_size, kv_heads * head_size
    return qkv[..., :width], qkv[..., width : width + kv_width], qkv[..., width + kv_width :]


def decode_attention(
    q: torch.Tensor,  # [B, 1, H*D] (or the packed [B, 1, (H + 2 KV) * D] with k = v = None)
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    key_cache: torch.Tensor,  # [B, KV, C, D], written in place
    value_cache: torch.Tensor,
    seqlens_k: torch.Tensor,  # [B] int32: the new token's row (T - 1)
    *,
    num_heads: int,
    kv_heads: int,
    scale: float,
    cos_cache: torch.Tensor | None,
    sin_cache: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    interleaved: bool,
    window: int,
) -> torch.Tensor:
    LAUNCHES["gqa_decode"] += 1
    batch = q.shape[0]
    capacity, head_size = key_cache.shape[2], key_cache.shape[3]
    if k is None:
        q, k, v = packed_qkv_views(q, num_heads, kv_heads, head_size)
    seqlens = seqlens_k.reshape(-1)
    do_rotary = cos_cache is not None
    half_rot = cos_cache.shape[-1] if do_rotary else 1
    block_d = triton.next_power_of_2(head_size)
    group = num_heads // kv_heads
    opts = options.current()
    block_n, warps = decode_config(opts)
    splits = triton.cdiv(capacity, block_n)
    part_max = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty((batch, num_heads, splits, head_size), dtype=torch.float32, device=q.device)
    out = torch.empty((batch, 1, num_heads * head_size), dtype=q.dtype, device=q.device)
    block_g = max(16, triton.next_power_of_2(group))
    positions = position_ids.reshape(-1) if position_ids is not None else seqlens
    # before pdl_launch, which records this launch's own writes in place of the last one's
    settled = (seqlens, positions, cos_cache, sin_cache, key_cache, value_cache)
    early = early_reads_enabled(opts) and settled_before_launch(*settled)
    tickets = _tickets(key_cache, batch * kv_heads)
    _attend_split[(batch, kv_heads, splits)](
        q,
        k,
        v,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        seqlens,
        positions,
        cos_cache if do_rotary else q,
        sin_cache if do_rotary else q,
        key_cache,
        value_cache,
        part_max,
        part_sum,
        part_acc,
        tickets,
        out,
        key_cache.stride(0),
        key_cache.stride(1),
        num_heads,
        head_size,
        splits,
        scale,
        window,
        HAS_POSITIONS=position_ids is not None,
        DO_ROTARY=do_rotary,
        INTERLEAVED=interleaved,
        HALF_ROT=half_rot,
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_S=max(1, min(COMBINE_TILE // (block_g * block_d), triton.next_power_of_2(splits))),
        IEEE=q.dtype == torch.float32,
        EARLY=early,
        num_warps=warps,
        **pdl_launch(q, out, key_cache, value_cache, part_max, part_sum, part_acc, tickets),
    )
    return out


# (keys per program, warps), measured on the H200 (0.5B shape, docs/benchmarks/2026-12-01-h200-anatomy.md):
# 128 keys in 8 warps beat 64 in 4 and 256 in 8, at 128 and at 1,024 new tokens
DECODE_CONFIG = (128, 8)


def decode_config(opts: options.Options | None = None) -> tuple[int, int]:
    """(keys per program, warps): ``ONNXGEN_GQA_DECODE=BLOCK_N,WARPS`` (option ``gqa_decode``)
    overrides (the GPU benches sweep it); a buffer of up to BLOCK_N rows is attended by one program,
    without the merge."""
    return (opts or options.current()).gqa_decode or DECODE_CONFIG


def early_reads_enabled(opts: options.Options | None = None) -> bool:
    """The settled inputs are read before the PDL wait where that is safe (settled_before_launch);
    ``ONNXGEN_GQA_EARLY=0`` (option ``gqa_early``) reads them after it (the benches compare the two)."""
    return (opts or options.current()).gqa_early


def _tickets(key_cache: torch.Tensor, count: int) -> torch.Tensor:
    """The merge counters of this KV buffer, allocated and zeroed once (the kernel leaves them zero).
    Buffers come from torch's caching allocator, whose addresses repeat, so the map stays small."""
    key = (key_cache.data_ptr(), key_cache.device, count)
    tickets = _TICKETS.get(key)
    if tickets is None:
        tickets = _TICKETS[key] = torch.zeros(count, dtype=torch.int32, device=key_cache.device)
    return tickets
