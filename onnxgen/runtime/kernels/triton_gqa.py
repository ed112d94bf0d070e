"""GroupQueryAttention's single-token decode step over a shared (static) KV buffer, in three Triton
kernels instead of the ~40 torch kernels of the general path.

1. ``_rotate_and_append``: one program per (batch, head) over the query heads and the KV heads:
   rotary (fp32, as onnxruntime computes it for half inputs) on Q and K, the new K/V row written
   into the cache at row seqlens_k[b] (read on the device: no host sync, capture-safe).
2. ``_attend_split``: one program per (batch, KV head, key block): the G query heads that share
   the KV head attend to BLOCK_N keys (split-K over the sequence, "flash decoding"); partial max,
   sum and weighted values go to fp32 scratch. Blocks past the valid length T = seqlens_k + 1 exit.
3. ``_combine``: one program per (batch, query head) merges the valid blocks in a fixed order,
   COMBINE_SPLITS at a time.

The grid depends only on the buffer capacity, never on T, so a recorded graph serves every step;
every reduction has a fixed order, so the result is the same bit for bit from run to run (what
captured == eager needs). fp32 models use IEEE fp32 dot products (no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen.runtime.kernels.triton_support import LAUNCHES

# splits the combine kernel merges per iteration: a 32K-row buffer has 512 splits, too many for one
# register tile, so long buffers loop (tests lower it to exercise the loop)
COMBINE_SPLITS = 64


@triton.jit
def _rotate_and_append(
    q_ptr,
    k_ptr,
    v_ptr,
    q_row_stride,
    k_row_stride,
    v_row_stride,
    seqlens_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    key_cache_ptr,
    value_cache_ptr,
    cache_batch_stride,
    cache_head_stride,
    num_heads,
    head_size,
    HAS_POSITIONS: tl.constexpr,
    DO_ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HALF_ROT: tl.constexpr,  # rotary_dim / 2 (cos_cache's width)
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)  # 0 .. num_heads-1: query heads; then the KV heads
    row = tl.load(seqlens_ptr + b).to(tl.int64)  # the new token's cache row
    is_q = h < num_heads
    if is_q:
        src = q_ptr + b * q_row_stride + h * head_size
    else:
        src = k_ptr + b * k_row_stride + (h - num_heads) * head_size
    d = tl.arange(0, BLOCK_D)
    x = tl.load(src + d, mask=d < head_size, other=0.0)
    if DO_ROTARY:
        if HAS_POSITIONS:
            pos = tl.load(pos_ptr + b).to(tl.int64)
        else:
            pos = row
        i = tl.arange(0, BLOCK_HALF)
        in_rot = i < HALF_ROT
        if INTERLEAVED:
            lo, hi = 2 * i, 2 * i + 1
        else:
            lo, hi = i, i + HALF_ROT
        cos = tl.load(cos_ptr + pos * HALF_ROT + i, mask=in_rot, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * HALF_ROT + i, mask=in_rot, other=0.0).to(tl.float32)
        x1 = tl.load(src + lo, mask=in_rot, other=0.0).to(tl.float32)
        x2 = tl.load(src + hi, mask=in_rot, other=0.0).to(tl.float32)
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
    # channels past the rotary dims pass through (all of them without rotary)
    plain = (d < head_size) & (d >= 2 * HALF_ROT) if DO_ROTARY else d < head_size
    if is_q:
        dst = q_out_ptr + (b * num_heads + h) * head_size
        tl.store(dst + d, x, mask=plain)
        if DO_ROTARY:
            tl.store(dst + lo, r1.to(x.dtype), mask=in_rot)
            tl.store(dst + hi, r2.to(x.dtype), mask=in_rot)
    else:
        kv = h - num_heads
        base = b * cache_batch_stride + kv * cache_head_stride + row * head_size
        dst = key_cache_ptr + base
        tl.store(dst + d, x.to(key_cache_ptr.dtype.element_ty), mask=plain)
        if DO_ROTARY:
            tl.store(dst + lo, r1.to(key_cache_ptr.dtype.element_ty), mask=in_rot)
            tl.store(dst + hi, r2.to(key_cache_ptr.dtype.element_ty), mask=in_rot)
        vrow = tl.load(v_ptr + b * v_row_stride + kv * head_size + d, mask=d < head_size, other=0.0)
        tl.store(value_cache_ptr + base + d, vrow.to(value_cache_ptr.dtype.element_ty), mask=d < head_size)


@triton.jit
def _attend_split(
    q_ptr,  # [B, H, D] rotated queries
    key_cache_ptr,
    value_cache_ptr,
    seqlens_ptr,
    part_max_ptr,  # [B, H, S] fp32
    part_sum_ptr,  # [B, H, S] fp32
    part_acc_ptr,  # [B, H, S, D] fp32
    cache_batch_stride,
    cache_head_stride,
    num_heads,
    head_size,
    num_splits,
    scale,
    window,  # local_window_size (<= 0: none)
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    total = tl.load(seqlens_ptr + b).to(tl.int32) + 1  # valid rows T
    start = split * BLOCK_N
    if start < total:
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = start + tl.arange(0, BLOCK_N)
        heads = kv * GROUP + g
        q_mask = (g[:, None] < GROUP) & (d[None, :] < head_size)
        q = tl.load(q_ptr + (b * num_heads + heads[:, None]) * head_size + d[None, :], mask=q_mask, other=0.0)
        visible = n < total
        if window > 0:
            visible = visible & (n >= total - window)
        kv_base = b * cache_batch_stride + kv * cache_head_stride
        kv_mask = visible[:, None] & (d[None, :] < head_size)
        offsets = kv_base + n[:, None].to(tl.int64) * head_size + d[None, :]
        k = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0).to(q.dtype)
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
        v = tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v)
        part = (b * num_heads + heads) * num_splits + split
        g_ok = g < GROUP
        tl.store(part_max_ptr + part, block_max, mask=g_ok)
        tl.store(part_sum_ptr + part, block_sum, mask=g_ok)
        tl.store(part_acc_ptr + part[:, None] * head_size + d[None, :], acc, mask=q_mask)


@triton.jit
def _combine(
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    seqlens_ptr,
    out_ptr,  # [B, 1, H * D]
    num_heads,
    head_size,
    num_splits,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,  # splits merged per iteration (long buffers take several)
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    total = tl.load(seqlens_ptr + b).to(tl.int32) + 1
    used = tl.minimum((total + BLOCK_N - 1) // BLOCK_N, num_splits)
    d = tl.arange(0, BLOCK_D)
    base = (b * num_heads + h) * num_splits
    # pass 1: the largest partial max; pass 2: the rescaled sums, in split order (deterministic)
    top = float("-inf")
    for first in range(0, used, BLOCK_S):
        s = first + tl.arange(0, BLOCK_S)
        m = tl.load(part_max_ptr + base + s, mask=s < used, other=float("-inf"))
        top = tl.maximum(top, tl.max(m, axis=0))
    top = tl.where(top == float("-inf"), 0.0, top)
    denominator = 0.0
    out = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for first in range(0, used, BLOCK_S):
        s = first + tl.arange(0, BLOCK_S)
        live = s < used
        m = tl.load(part_max_ptr + base + s, mask=live, other=float("-inf"))
        l_part = tl.load(part_sum_ptr + base + s, mask=live, other=0.0)
        w = tl.where(live & (m > float("-inf")), tl.exp(m - top), 0.0)
        denominator += tl.sum(l_part * w, axis=0)
        acc_mask = live[:, None] & (d[None, :] < head_size)
        acc = tl.load(part_acc_ptr + (base + s[:, None]) * head_size + d[None, :], mask=acc_mask, other=0.0)
        out += tl.sum(acc * w[:, None], axis=0)
    out = out / denominator
    tl.store(out_ptr + (b * num_heads + h) * head_size + d, out.to(out_ptr.dtype.element_ty), mask=d < head_size)


def decode_step(
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
    if k is None:  # packed QKV: views into the one row
        width = num_heads * head_size
        q, k, v = q[..., :width], q[..., width : width + kv_heads * head_size], q[..., width + kv_heads * head_size :]
    q_rot = torch.empty((batch, num_heads, head_size), dtype=q.dtype, device=q.device)
    seqlens = seqlens_k.reshape(-1)
    do_rotary = cos_cache is not None
    half_rot = cos_cache.shape[-1] if do_rotary else 1
    block_d = triton.next_power_of_2(head_size)
    _rotate_and_append[(batch, num_heads + kv_heads)](
        q,
        k,
        v,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        seqlens,
        position_ids.reshape(-1) if position_ids is not None else seqlens,
        cos_cache if do_rotary else q,
        sin_cache if do_rotary else q,
        q_rot,
        key_cache,
        value_cache,
        key_cache.stride(0),
        key_cache.stride(1),
        num_heads,
        head_size,
        HAS_POSITIONS=position_ids is not None,
        DO_ROTARY=do_rotary,
        INTERLEAVED=interleaved,
        HALF_ROT=half_rot,
        BLOCK_HALF=triton.next_power_of_2(half_rot),
        BLOCK_D=block_d,
    )
    group = num_heads // kv_heads
    block_n = 64
    splits = triton.cdiv(capacity, block_n)
    part_max = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty((batch, num_heads, splits, head_size), dtype=torch.float32, device=q.device)
    _attend_split[(batch, kv_heads, splits)](
        q_rot,
        key_cache,
        value_cache,
        seqlens,
        part_max,
        part_sum,
        part_acc,
        key_cache.stride(0),
        key_cache.stride(1),
        num_heads,
        head_size,
        splits,
        scale,
        window,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32,
    )
    out = torch.empty((batch, 1, num_heads * head_size), dtype=q.dtype, device=q.device)
    _combine[(batch, num_heads)](
        part_max,
        part_sum,
        part_acc,
        seqlens,
        out,
        num_heads,
        head_size,
        splits,
        BLOCK_N=block_n,
        BLOCK_S=min(COMBINE_SPLITS, triton.next_power_of_2(splits)),
        BLOCK_D=block_d,
    )
    return out
