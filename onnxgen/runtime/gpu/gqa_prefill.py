"""GroupQueryAttention over a shared (static) KV buffer for a step of several rows (a prompt or a
prompt chunk), in two Triton kernels instead of the ~25 torch kernels of the general path.

1. ``_store_rows``: the step's K rows, rotated, and its V rows go into the cache at rows
   P .. P + S - 1, one program per (batch, block of rows, KV head).
2. ``_flash_attend``: causal flash attention, one program per (block of query rows, batch, query
   head). The program rotates its query rows in registers and walks the cache's key blocks from the
   first one its rows may see to the last, with an online softmax in fp32; key blocks wholly past
   the block's last visible key are never read, so a chunk at the start of the cache costs what a
   causal attention of S x S costs, not S x capacity.

Where the rows sit is read on the device (no host sync, capture-safe): with T = seqlens_k[b] + 1
the step's rows start at P = T - S (P = 0 on a first prompt, S == total_sequence_length), and
query row s (absolute position P + s) sees keys j < min(P + s + 1, T), the last
``local_window_size`` of them when a window is set; this is contrib_attention's rule. Every
reduction runs in a fixed order, so the result is the same bit for bit from run to run.

The grid depends on S and the capacity only (a recorded chunk shape replays for every position).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from onnxgen.runtime.gpu.gqa_decode import _rope, _rotary_tables, packed_qkv_views
from onnxgen.runtime.gpu.launch import LAUNCHES, pdl_launch
from onnxgen.runtime.gpu.pdl import wait_for_previous

_LOG2E = 1.4426950408889634


@triton.jit
def _step_start(seqlens_ptr, b, seq, FIRST_PROMPT: tl.constexpr):
    """(P, T): the cache row of the step's first row, and the cache length after the step."""
    total = tl.load(seqlens_ptr + b).to(tl.int32) + 1
    if FIRST_PROMPT:
        start = total * 0
    else:
        start = total - seq
    return start, total


@triton.jit
def _rotary_rows(cos_ptr, sin_ptr, pos_ptr, b, rows, row_ok, start, seq, d, d_ok,
                 HAS_POSITIONS: tl.constexpr, DO_ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr,
                 HALF_ROT: tl.constexpr):  # fmt: skip
    """The rotary tables [ROWS, D] of the step's rows ``rows`` (positions P + s, or position_ids)."""
    if HAS_POSITIONS:
        pos = tl.load(pos_ptr + b * seq + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        pos = (start + rows).to(tl.int64)
    ok = row_ok[:, None] & d_ok[None, :]
    return _rotary_tables(cos_ptr, sin_ptr, pos[:, None], d[None, :], ok, DO_ROTARY, INTERLEAVED, HALF_ROT)


@triton.jit
def _rotated_rows(x_ptr, batch_stride, row_stride, head, seqlens_ptr, pos_ptr, cos_ptr, sin_ptr, b, rows, seq, d,
                  head_size, HAS_POSITIONS: tl.constexpr, DO_ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr,
                  HALF_ROT: tl.constexpr, FIRST_PROMPT: tl.constexpr):  # fmt: skip
    """The step's rows ``rows`` of head ``head`` in x, rotated, in fp32 [ROWS, D]; with which
    (row, channel) exist, P and T (_step_start)."""
    d_ok = d < head_size
    row_ok = rows < seq
    start, total = _step_start(seqlens_ptr, b, seq, FIRST_PROMPT)
    cos, sin = _rotary_rows(cos_ptr, sin_ptr, pos_ptr, b, rows, row_ok, start, seq, d, d_ok,
                            HAS_POSITIONS, DO_ROTARY, INTERLEAVED, HALF_ROT)  # fmt: skip
    ok = row_ok[:, None] & d_ok[None, :]
    src = x_ptr + b * batch_stride + rows[:, None].to(tl.int64) * row_stride + head * head_size
    return _rope(src, d[None, :], ok, cos, sin, DO_ROTARY, INTERLEAVED, HALF_ROT), ok, start, total


@triton.jit
def _store_rows(
    k_ptr,  # [B, S, ...] rows: KV heads x D channels at k_ptr + b * batch_stride + s * row_stride
    v_ptr,
    k_batch_stride,
    k_row_stride,
    v_batch_stride,
    v_row_stride,
    seqlens_ptr,
    pos_ptr,  # [B, S] rotary positions (HAS_POSITIONS)
    cos_ptr,
    sin_ptr,
    key_cache_ptr,  # [B, KV, C, D]
    value_cache_ptr,
    cache_batch_stride,
    cache_head_stride,
    seq,
    head_size,
    HAS_POSITIONS: tl.constexpr,
    DO_ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HALF_ROT: tl.constexpr,
    FIRST_PROMPT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    b = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    kv = tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    wait_for_previous(PDL)
    k, ok, start, _ = _rotated_rows(k_ptr, k_batch_stride, k_row_stride, kv, seqlens_ptr, pos_ptr, cos_ptr, sin_ptr,
                                    b, rows, seq, d, head_size, HAS_POSITIONS, DO_ROTARY, INTERLEAVED, HALF_ROT,
                                    FIRST_PROMPT)  # fmt: skip
    v_src = v_ptr + b * v_batch_stride + rows[:, None].to(tl.int64) * v_row_stride + kv * head_size
    v = tl.load(v_src + d[None, :], mask=ok, other=0.0)
    at = b * cache_batch_stride + kv * cache_head_stride + (start + rows)[:, None].to(tl.int64) * head_size + d[None, :]
    tl.store(key_cache_ptr + at, k.to(key_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(value_cache_ptr + at, v.to(value_cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _flash_attend(
    q_ptr,  # [B, S, ...] rows: query heads x D channels
    q_batch_stride,
    q_row_stride,
    seqlens_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,  # [B, S, H * D]
    cache_batch_stride,
    cache_head_stride,
    seq,
    num_heads,
    head_size,
    scale_log2,  # scale * log2(e): the softmax runs in base 2
    window,  # local_window_size (<= 0: none)
    HAS_POSITIONS: tl.constexpr,
    DO_ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HALF_ROT: tl.constexpr,
    FIRST_PROMPT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kv = h // GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_size
    row_ok = rows < seq
    wait_for_previous(PDL)
    q, q_ok, start, total = _rotated_rows(q_ptr, q_batch_stride, q_row_stride, h, seqlens_ptr, pos_ptr, cos_ptr,
                                          sin_ptr, b, rows, seq, d, head_size, HAS_POSITIONS, DO_ROTARY,
                                          INTERLEAVED, HALF_ROT, FIRST_PROMPT)  # fmt: skip
    q = q.to(key_cache_ptr.dtype.element_ty)  # rounded as the general path rounds the rotated query

    end = tl.minimum(start + rows + 1, total)  # [M] exclusive: the keys row s may see
    first = tl.zeros_like(end)
    if window > 0:
        first = tl.maximum(end - window, 0)
    lo = (tl.min(tl.where(row_ok, first, 2**30)) // BLOCK_N) * BLOCK_N
    hi = tl.max(tl.where(row_ok, end, 0))

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    kv_base = b * cache_batch_stride + kv * cache_head_stride
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        kv_ok = (n < hi)[:, None] & d_ok[None, :]
        offsets = kv_base + n[:, None].to(tl.int64) * head_size + d[None, :]
        k = tl.load(key_cache_ptr + offsets, mask=kv_ok, other=0.0)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        visible = (n[None, :] < end[:, None]) & (n[None, :] >= first[:, None])
        scores = tl.where(visible, scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
        p = tl.exp2(scores - safe[:, None])
        alpha = tl.exp2(m_i - safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(value_cache_ptr + offsets, mask=kv_ok, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_at = (b * seq + rows)[:, None].to(tl.int64) * (num_heads * head_size) + h * head_size + d[None, :]
    tl.store(out_ptr + out_at, out.to(out_ptr.dtype.element_ty), mask=q_ok)


def prefill_config(head_size: int) -> tuple[int, int, int]:
    """(query rows per program, keys per block, warps) for a head size."""
    if head_size <= 128:
        return 64, 64, 4
    return 32, 32, 4


def prefill_attention(
    q: torch.Tensor,  # [B, S, H*D] (or the packed [B, S, (H + 2 KV) * D] with k = v = None)
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    key_cache: torch.Tensor,  # [B, KV, C, D], written in place
    value_cache: torch.Tensor,
    seqlens_k: torch.Tensor,  # [B] int32: T - 1
    *,
    num_heads: int,
    kv_heads: int,
    scale: float,
    first_prompt: bool,
    cos_cache: torch.Tensor | None,
    sin_cache: torch.Tensor | None,
    positions: torch.Tensor | None,  # [B, S] rotary positions, or None for P + s
    interleaved: bool,
    window: int,
) -> torch.Tensor:
    LAUNCHES["gqa_prefill"] += 1
    batch, seq = q.shape[0], q.shape[1]
    head_size = key_cache.shape[3]
    if k is None:
        q, k, v = packed_qkv_views(q, num_heads, kv_heads, head_size)
    assert v is not None
    seqlens = seqlens_k.reshape(-1)
    do_rotary = cos_cache is not None
    half_rot = cos_cache.shape[-1] if do_rotary else 1
    block_d = triton.next_power_of_2(head_size)
    pos = positions.contiguous() if positions is not None else seqlens
    cos = cos_cache if do_rotary else q
    sin = sin_cache if do_rotary else q
    common = dict(HAS_POSITIONS=positions is not None, DO_ROTARY=do_rotary, INTERLEAVED=interleaved,
                  HALF_ROT=half_rot, FIRST_PROMPT=first_prompt, BLOCK_D=block_d)  # fmt: skip
    block_r = max(1, min(16, triton.next_power_of_2(seq)))
    _store_rows[(batch, triton.cdiv(seq, block_r), kv_heads)](
        k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), seqlens, pos, cos, sin,
        key_cache, value_cache, key_cache.stride(0), key_cache.stride(1), seq, head_size,
        BLOCK_R=block_r, num_warps=4, **common, **pdl_launch(q, key_cache, value_cache),
    )  # fmt: skip
    out = torch.empty((batch, seq, num_heads * head_size), dtype=q.dtype, device=q.device)
    block_m, block_n, warps = prefill_config(head_size)
    _flash_attend[(triton.cdiv(seq, block_m), batch, num_heads)](
        q, q.stride(0), q.stride(1), seqlens, pos, cos, sin, key_cache, value_cache, out,
        key_cache.stride(0), key_cache.stride(1), seq, num_heads, head_size, scale * _LOG2E, window,
        GROUP=num_heads // kv_heads, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        num_warps=warps, num_stages=2, **common, **pdl_launch(q, out),
    )  # fmt: skip
    return out
