"""com.microsoft RotaryEmbedding and MRotaryEmbedding in one Triton kernel.

The torch path (runtime/ops/contrib_attention.py) spends a dozen kernels or more on one call: the
cache rows gathered per position stream, the multimodal section picked by slices (mrope_select),
the rotation in fp32 (casts, halves, products, concatenations), the pass-through channels joined
back. onnxruntime-genai's builder writes these ops outside the attention (its Qwen3.5 export: one
MRotaryEmbedding for the queries and one for the keys of every full-attention layer), so a decode
step ran them all. One program here owns one token and a block of heads:

    stream(i)  which position stream rotary channel i takes: 0 for RotaryEmbedding; for
               MRotaryEmbedding, mrope_layout 0 (sectioned): T below section[0], H below
               section[0] + section[1], W above; layout 1 (interleaved): H where i % 3 == 1 and
               i < 3 * section[1], W where i % 3 == 2 and i < 3 * section[2], T elsewhere
    c, s       cos_cache / sin_cache at (position of stream(i), i), in fp32
    y          the pair (x1, x2) of channel i (halves: i and i + R/2; interleaved: 2i and 2i + 1)
               as (x1 c - x2 s, x2 c + x1 s) in fp32, rounded once to the output's dtype; channels
               from R on copied

as contrib_attention.apply_rotary computes it. Positions must index the caches' rows (the engine
refuses a context longer than the caches); a position beyond them reads zeros, not another row.
Programs share nothing: a run repeats bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen.runtime.gpu.launch import COMPILE_OPTIONS, KERNEL_DTYPES, LAUNCHES

MAX_HEAD_SIZE = 1024


@triton.jit
def _rotary_kernel(
    x_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, seq, heads, x_b, x_s, x_n, x_h, o_b, o_s, o_n, o_h, pos_stream,
    pos_b, pos_s, cache_rows, cache_row_stride, head_size, half, sec_t, sec_h, sec_w, STREAMS: tl.constexpr,
    LAYOUT: tl.constexpr, INTERLEAVED: tl.constexpr, POS_START: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    b = token // seq
    s = token % seq
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < heads
    i = tl.arange(0, BLOCK_R)
    i_ok = i < half
    if POS_START:  # one start position for every batch row: position = start + s
        p0 = tl.load(pos_ptr).to(tl.int64) + s
        pos = i.to(tl.int64) * 0 + p0
    else:
        p0 = tl.load(pos_ptr + b * pos_b + s * pos_s).to(tl.int64)
        pos = i.to(tl.int64) * 0 + p0
        if STREAMS == 3:
            p1 = tl.load(pos_ptr + pos_stream + b * pos_b + s * pos_s).to(tl.int64)
            p2 = tl.load(pos_ptr + 2 * pos_stream + b * pos_b + s * pos_s).to(tl.int64)
            if LAYOUT == 0:
                pos = tl.where(i < sec_t, p0, tl.where(i < sec_t + sec_h, p1, p2))
            else:
                pos = tl.where((i % 3 == 1) & (i < 3 * sec_h), p1, tl.where((i % 3 == 2) & (i < 3 * sec_w), p2, p0))
    row_ok = i_ok & (pos >= 0) & (pos < cache_rows)
    c = tl.load(cos_ptr + pos * cache_row_stride + i, mask=row_ok, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + pos * cache_row_stride + i, mask=row_ok, other=0.0).to(tl.float32)
    if INTERLEAVED:
        first, second = 2 * i, 2 * i + 1
    else:
        first, second = i, i + half
    x_row = x_ptr + b.to(tl.int64) * x_b + s.to(tl.int64) * x_s + n[:, None] * x_n
    o_row = out_ptr + b.to(tl.int64) * o_b + s.to(tl.int64) * o_s + n[:, None] * o_n
    ok = n_ok[:, None] & i_ok[None, :]
    x1 = tl.load(x_row + first[None, :] * x_h, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + second[None, :] * x_h, mask=ok, other=0.0).to(tl.float32)
    y1 = x1 * c[None, :] - x2 * sn[None, :]
    y2 = x2 * c[None, :] + x1 * sn[None, :]
    out_ty = out_ptr.dtype.element_ty
    tl.store(o_row + first[None, :] * o_h, y1.to(out_ty), mask=ok)
    tl.store(o_row + second[None, :] * o_h, y2.to(out_ty), mask=ok)
    rest = 2 * half + tl.arange(0, BLOCK_H)  # channels past the rotary dim pass through
    keep = n_ok[:, None] & (rest < head_size)[None, :]
    kept = tl.load(x_row + rest[None, :] * x_h, mask=keep, other=0.0)
    tl.store(o_row + rest[None, :] * o_h, kept.to(out_ty), mask=keep)


def rotary_applies(
    x: torch.Tensor, position_ids: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor
) -> bool:
    """Inputs the kernel serves (the op has checked shapes and attributes)."""
    if x.dtype not in KERNEL_DTYPES or position_ids.dtype not in (torch.int64, torch.int32):
        return False
    if any(t.device != x.device for t in (position_ids, cos_cache, sin_cache)):
        return False
    if cos_cache.dim() != 2 or cos_cache.shape != sin_cache.shape or cos_cache.stride() != sin_cache.stride():
        return False
    return cos_cache.dtype in KERNEL_DTYPES and sin_cache.dtype == cos_cache.dtype and cos_cache.stride(1) == 1


def rotary(
    x: torch.Tensor,
    xs: torch.Tensor,
    position_ids: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    *,
    rotary_dim: int,
    interleaved: bool,
    section: list[int] | None = None,
    layout: int = 0,
) -> torch.Tensor | None:
    """The op's output (x's shape and dtype) for x [B, S, hidden] or [B, N, S, H] and its heads view
    ``xs`` [B, N, S, H] (contrib_attention._rotary_heads); position_ids [B, S], one start position, or
    (``section`` given: MRotaryEmbedding) [3, B, S]. None where the kernel does not serve."""
    batch, heads, seq, head_size = xs.shape
    if head_size > MAX_HEAD_SIZE or not rotary_applies(x, position_ids, cos_cache, sin_cache):
        return None
    if batch * seq == 0 or heads == 0:
        return torch.empty_like(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    outs = out if out.dim() == 4 else out.reshape(batch, seq, heads, head_size).transpose(1, 2)
    start = position_ids.numel() == 1 and section is None
    if section is not None:
        pos_strides = position_ids.stride()  # [3, B, S]
    elif start:
        pos_strides = (0, 0, 0)
    else:
        pos_strides = (0, *position_ids.stride())  # [B, S]
    half = rotary_dim // 2
    block_n = min(triton.next_power_of_2(heads), 16)
    LAUNCHES["rotary"] += 1
    _rotary_kernel[(batch * seq, triton.cdiv(heads, block_n))](
        xs, position_ids, cos_cache, sin_cache, outs, seq, heads, xs.stride(0), xs.stride(2), xs.stride(1),
        xs.stride(3), outs.stride(0), outs.stride(2), outs.stride(1), outs.stride(3), *pos_strides, cos_cache.shape[0],
        cos_cache.stride(0), head_size, half, *(section or (0, 0, 0)), STREAMS=3 if section is not None else 1,
        LAYOUT=layout, INTERLEAVED=interleaved, POS_START=start, BLOCK_N=block_n,
        BLOCK_R=max(triton.next_power_of_2(half), 1), BLOCK_H=max(triton.next_power_of_2(head_size - 2 * half), 1),
        **COMPILE_OPTIONS,
    )  # fmt: skip
    return out
