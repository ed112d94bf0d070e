"""LinearAttention over a long prompt in one Triton kernel: the gated delta rule (and its linear,
gated and delta forms) a chunk of CHUNK tokens at a time, as runtime/ops/linear_attention.py's
``_chunked`` does it in torch, for prompts the sequential kernel (gated_delta_decode.py) leaves.

Why: the sequential kernel steps through the tokens one after another, each step a pass over the
state tile; the torch path's chunked form takes a dozen kernels per chunk. Here one program owns a
(batch row, KV head, value-dim tile) of the state S [d_k, d_v], as in the sequential kernel, and
does per chunk, in fp32, with G the cumulative log decay inside the chunk (no decay: G = 0) and
D[t, j] = e^(G_t - G_j) for j <= t (else 0):

    U   = beta * (V - e^G * (K S))                   the written values' right-hand side
    A   = beta * (K K^T) * D, strictly lower           so W solves (I + A) W = U
    W   = (I + A)^-1 U,  (I + A)^-1 = prod_k (I + (-A)^(2^k))   (A is nilpotent: A^CHUNK = 0)
    out = scale * (e^G * (Q S) + ((Q K^T) * D) W)      once per query head that reads this KV head
    S   = e^(G_last) S + (K * e^(G_last - G))^T W

(no delta rule: W = V). Every product is a tensor-core dot in IEEE fp32 (CHUNK, the key and the
value tiles are at least 16). Tokens past the prompt's end (and, with a last row per batch entry,
the tokens after it: a padded prompt's padding) load their keys as zeros with a zero log decay:
they neither write nor decay the state. The inverse is a product of log2(CHUNK) factors instead of
CHUNK dependent substitutions: exact in exact arithmetic, and the entries of A are bounded by
beta |k_t . k_j| <= 1 for the unit keys a Gated DeltaNet feeds it.

Invariants: tiles over d_v never talk to each other and every sum has a fixed order, so a run
repeats bit for bit and a captured prompt equals the eager one; the new state goes to a fresh
present buffer. Decays per key dim (one per key dim of each head) are not served (the torch path's
chunked form does not take them either: they run token by token).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from onnxgen.runtime.gpu.gated_delta_decode import prepare
from onnxgen.runtime.gpu.launch import LAUNCHES

CHUNK = 16  # tokens per chunk: a power of two >= 16 (tl.dot's smallest side)


@triton.jit
def _dot(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _gated_delta_chunk_kernel(
    q_ptr, k_ptr, v_ptr, decay_ptr, beta_ptr, past_ptr, present_ptr, out_ptr, q_row_stride, q_tok_stride,
    k_row_stride, k_tok_stride, v_row_stride, v_tok_stride, decay_row_stride, decay_tok_stride, decay_head_stride,
    decay_dim_stride, beta_row_stride, beta_tok_stride, beta_head_stride, tokens, kv_heads, d_k, d_v, group, q_share,
    k_share, scale, ends_ptr, ends_stride, HAS_PAST: tl.constexpr, HAS_DECAY: tl.constexpr, HAS_BETA: tl.constexpr,
    HAS_END: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr, SQUARINGS: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0)  # batch row * kv_heads + KV head: the state's (B, H_kv) index
    b = bh // kv_heads
    h = bh % kv_heads
    rows = tl.arange(0, BLOCK_K)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < d_k
    col_ok = cols < d_v
    cells = bh.to(tl.int64) * d_k * d_v + rows[:, None] * d_v + cols[None, :]
    if HAS_PAST:
        s = tl.load(past_ptr + cells, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    else:
        s = tl.zeros((BLOCK_K, BLOCK_V), tl.float32)
    step = tl.arange(0, CHUNK)
    lower = step[:, None] > step[None, :]  # j < t
    eye = (step[:, None] == step[None, :]).to(tl.float32)
    heads_out = kv_heads * group
    last = tokens - 1
    if HAS_END:  # the tokens after the last row load as past the end: no write, no decay
        last = tl.minimum(tl.load(ends_ptr + b * ends_stride), tokens - 1)
    for first in range(0, tokens, CHUNK):
        t = first + step
        t_ok = t < tokens
        live = t <= last
        k = tl.load(k_ptr + b * k_row_stride + t[:, None] * k_tok_stride + (h // k_share) * d_k + rows[None, :],
                    mask=live[:, None] & row_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        v = tl.load(v_ptr + b * v_row_stride + t[:, None] * v_tok_stride + h * d_v + cols[None, :],
                    mask=t_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        if HAS_DECAY:
            g = tl.load(decay_ptr + b * decay_row_stride + t * decay_tok_stride + h * decay_head_stride, mask=live,
                        other=0.0).to(tl.float32)  # fmt: skip
            cum = tl.cumsum(g, 0)
            total = tl.sum(g, 0)
            start = tl.exp(cum)  # e^G_t
            decay = tl.where(lower | (step[:, None] == step[None, :]), tl.exp(cum[:, None] - cum[None, :]), 0.0)
        else:
            start = tl.full((CHUNK,), 1.0, tl.float32)
            decay = tl.where(lower | (step[:, None] == step[None, :]), 1.0, 0.0)
        if HAS_BETA:
            beta = tl.load(beta_ptr + b * beta_row_stride + t * beta_tok_stride + h * beta_head_stride, mask=t_ok,
                           other=0.0).to(tl.float32)  # fmt: skip
            rhs = beta[:, None] * (v - start[:, None] * _dot(k, s))
            neg = -beta[:, None] * _dot(k, tl.trans(k)) * tl.where(lower, decay, 0.0)  # -A
            inverse = eye + neg
            power = neg
            for _ in tl.static_range(SQUARINGS):
                power = _dot(power, power)
                inverse = inverse + _dot(inverse, power)
            w = _dot(inverse, rhs)
        else:
            w = v
        for j in range(group):
            head = h * group + j
            q = tl.load(q_ptr + b * q_row_stride + t[:, None] * q_tok_stride + (head // q_share) * d_k + rows[None, :],
                        mask=t_ok[:, None] & row_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
            out = start[:, None] * _dot(q, s) + _dot(_dot(q, tl.trans(k)) * decay, w)
            tl.store(out_ptr + ((b * tokens + t[:, None]) * heads_out + head) * d_v + cols[None, :],
                     (out * scale).to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & col_ok[None, :])  # fmt: skip
        if HAS_DECAY:
            s = s * tl.exp(total) + _dot(tl.trans(k * tl.exp(total - cum)[:, None]), w)
        else:
            s = s + _dot(tl.trans(k), w)
    tl.store(present_ptr + cells, s.to(present_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _tile(d_k: int, d_v: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_V): all key dims in one tile, value-dim tiles of 32 (at least 16: tl.dot)."""
    return max(16, triton.next_power_of_2(d_k)), max(16, min(32, triton.next_power_of_2(d_v)))


def gated_delta_chunked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_state: torch.Tensor | None,
    decay: torch.Tensor | None,
    beta: torch.Tensor | None,
    *,
    q_heads: int,
    kv_heads: int,
    scale: float,
    last_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(output, present state) as ``_linear_attention`` returns them (gated_delta_decode.prepare)
    for any number of tokens without a state window; None where this kernel does not serve these
    inputs (decays per key dim, or what ``prepare`` refuses)."""
    run = prepare(query, key, value, past_state, decay, beta, q_heads=q_heads, kv_heads=kv_heads, per_dim_decay=False,
                  last_row=last_row)  # fmt: skip
    if run is None:
        return None
    block_k, block_v = _tile(run.d_k, run.d_v)
    LAUNCHES["gated_delta_chunked"] += 1
    _gated_delta_chunk_kernel[(run.batch * kv_heads, triton.cdiv(run.d_v, block_v))](
        *run.arguments(),
        float(scale),
        *run.row_ends(),
        **run.forms(),
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        CHUNK=CHUNK,
        SQUARINGS=int(math.log2(CHUNK)) - 1,
        num_warps=4,
    )
    return run.out, run.present
