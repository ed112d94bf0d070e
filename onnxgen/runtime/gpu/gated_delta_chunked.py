"""LinearAttention over a prompt a chunk of CHUNK tokens at a time, in two Triton kernels: the gated
delta rule (and its linear, gated and delta forms), as runtime/ops/linear_attention.py's ``_chunked``
computes it in torch, for the prompts options gdn_chunked_from / gdn_chunked_to send here (by default
every prompt from 17 tokens: there these kernels beat the sequential one, gated_delta_decode.py, and
the torch path's chunked form; up to 16 tokens the sequential kernel's single chain is the shorter
wait: docs/benchmarks/2026-12-06-h200-gdn-chunked.md, 2026-12-06-h100-memory-and-chunked.md).

Why: the sequential kernel is a chain of one dependent step per token. Here the work of a chunk
that does not read the state runs for every chunk at once, and what remains in order is one short
step per chunk. With G the cumulative log decay inside a chunk (no decay: G = 0), D[t, j] =
e^(G_t - G_j) for j <= t (else 0), and S the state before the chunk, in fp32:

    A   = beta * (K K^T) * D, strictly lower            (I + A) W = beta * (V - e^G * (K S))
    T   = (I + A)^-1                                    so W = U - M S with
    U   = T (beta * V),  M = T (beta * e^G * K)          neither of which reads S
    P_j = (Q_j K^T) * D                                  per query head j of this KV head
    out_j = scale * (e^G * (Q_j S) + P_j W)
    S'  = e^(G_last) S + (K * e^(G_last - G))^T W

(no delta rule: W = V, so U = V and M = 0). The first kernel (one program per batch row, KV head
and chunk) computes T, U, M and the P_j into scratch buffers; T by 16 x 16 blocks, each diagonal
block's inverse a product of log2(16) factors (A is nilpotent) and the blocks below it by block
substitution, so no product of the whole chunk's A raises entries that grow with its powers. The
second kernel (one program per batch row, KV head and value-dim tile, the state tile in registers)
steps through the chunks: per chunk two products (M S, and the state's update), and two per query
head (Q_j S, P_j W). Every product is an fp32 dot in IEEE fp32 (tl.dot's sides are at least 16).

Tokens past the prompt's end (and, with a last row per batch entry, the tokens after it: a padded
prompt's padding) load their keys as zeros with a zero log decay: they neither write nor decay the
state; their outputs are unspecified.

Invariants: tiles over d_v never talk to each other and every sum has a fixed order, so a run
repeats bit for bit and a captured prompt equals the eager one; the new state goes to a fresh
present buffer; the scratch is written before it is read within each kernel (block barriers) or
by the kernel before. Decays per key dim (one per key dim of each head) are not served (the torch
path's chunked form does not take them either: they run token by token).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from onnxgen.runtime.gpu.gated_delta_decode import prepare
from onnxgen.runtime.gpu.launch import COMPILE_OPTIONS, LAUNCHES

CHUNK = 32  # tokens per chunk, a multiple of BLOCK: at 64 ptxas spilled the fp32 products badly for sm_90
BLOCK = 16  # the triangular inverse's block side (tl.dot's smallest)
# the state kernel's value columns per program: 16 (tl.dot's smallest) puts a batch-1 prompt of 16 value
# heads on 128 programs, one per SM of a large GPU, and holds the fewest registers
STATE_COLUMNS = 16


@triton.jit
def _dot(a, b):
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _last_row(ends_ptr, b, ends_stride, tokens, HAS_END: tl.constexpr):
    """Batch entry b's last row that writes the state: its last-row input where there is one."""
    last = tokens - 1
    if HAS_END:
        last = tl.minimum(tl.load(ends_ptr + b * ends_stride), tokens - 1)
    return last


@triton.jit
def _chunk_keys(k_ptr, b, h, t, last, rows, row_ok, k_row_stride, k_tok_stride, d_k, k_share):
    """Rows t of KV head h's keys [CHUNK, BLOCK_K] in fp32, zeros past the last row."""
    return tl.load(k_ptr + b * k_row_stride + t[:, None] * k_tok_stride + (h // k_share) * d_k + rows[None, :],
                   mask=(t <= last)[:, None] & row_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip


@triton.jit
def _chunk_queries(q_ptr, b, head, t, tokens, rows, row_ok, q_row_stride, q_tok_stride, d_k, q_share):
    """Rows t of output head ``head``'s queries [CHUNK, BLOCK_K] in fp32, zeros past the prompt."""
    return tl.load(q_ptr + b * q_row_stride + t[:, None] * q_tok_stride + (head // q_share) * d_k + rows[None, :],
                   mask=(t < tokens)[:, None] & row_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip


@triton.jit
def _p_rows(p_ptr, b, head, heads_out, padded, first, step, CHUNK: tl.constexpr):
    """Pointers to output head ``head``'s P [CHUNK, CHUNK] of the chunk at ``first`` in the scratch."""
    return p_ptr + ((b * heads_out + head).to(tl.int64) * padded + first + step)[:, None] * CHUNK + step[None, :]


@triton.jit
def _chunk_rows(
    k_ptr, decay_ptr, beta_ptr, b, h, first, tokens, last, rows, row_ok, k_row_stride, k_tok_stride, d_k, k_share,
    decay_row_stride, decay_tok_stride, decay_head_stride, beta_row_stride, beta_tok_stride, beta_head_stride,
    HAS_DECAY: tl.constexpr, HAS_BETA: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """A chunk's keys [CHUNK, BLOCK_K] (zeros past the last row), cumulative log decays G [CHUNK]
    (flat past it) and betas [CHUNK], in fp32."""
    t = first + tl.arange(0, CHUNK)
    live = t <= last
    k = _chunk_keys(k_ptr, b, h, t, last, rows, row_ok, k_row_stride, k_tok_stride, d_k, k_share)
    if HAS_DECAY:
        g = tl.load(decay_ptr + b * decay_row_stride + t * decay_tok_stride + h * decay_head_stride, mask=live,
                    other=0.0).to(tl.float32)  # fmt: skip
        cum = tl.cumsum(g, 0)
    else:
        cum = tl.zeros((CHUNK,), tl.float32)
    if HAS_BETA:
        beta = tl.load(beta_ptr + b * beta_row_stride + t * beta_tok_stride + h * beta_head_stride, mask=t < tokens,
                       other=0.0).to(tl.float32)  # fmt: skip
    else:
        beta = tl.zeros((CHUNK,), tl.float32)
    return k, cum, beta


@triton.jit
def _block(ptr, i, j, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Pointers to block (i, j) of a [CHUNK, CHUNK] row-major matrix."""
    r = tl.arange(0, BLOCK)
    return ptr + (i * BLOCK + r)[:, None] * CHUNK + (j * BLOCK + r)[None, :]


@triton.jit
def _chunk_prepare_kernel(
    q_ptr, k_ptr, v_ptr, decay_ptr, beta_ptr, a_ptr, t_ptr, u_ptr, m_ptr, p_ptr, g_ptr, q_row_stride, q_tok_stride,
    k_row_stride, k_tok_stride, v_row_stride, v_tok_stride, decay_row_stride, decay_tok_stride, decay_head_stride,
    beta_row_stride, beta_tok_stride, beta_head_stride, tokens, padded, kv_heads, d_k, d_v, group, q_share, k_share,
    ends_ptr, ends_stride, HAS_DECAY: tl.constexpr, HAS_BETA: tl.constexpr, HAS_END: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_VV: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    SQUARINGS: tl.constexpr,
):  # fmt: skip
    """One chunk of one (batch row, KV head): G, U, M and the P_j into the scratch (module docstring);
    a_ptr / t_ptr: this chunk's [CHUNK, CHUNK] A and T, written and read here only."""
    bh = tl.program_id(0)  # batch row * kv_heads + KV head
    c = tl.program_id(1)
    b = bh // kv_heads
    h = bh % kv_heads
    first = c * CHUNK
    rows = tl.arange(0, BLOCK_K)
    row_ok = rows < d_k
    step = tl.arange(0, CHUNK)
    t = first + step
    last = _last_row(ends_ptr, b, ends_stride, tokens, HAS_END)
    k, cum, beta = _chunk_rows(
        k_ptr, decay_ptr, beta_ptr, b, h, first, tokens, last, rows, row_ok, k_row_stride, k_tok_stride, d_k,
        k_share, decay_row_stride, decay_tok_stride, decay_head_stride, beta_row_stride, beta_tok_stride,
        beta_head_stride, HAS_DECAY, HAS_BETA, CHUNK,
    )  # fmt: skip
    scratch = bh.to(tl.int64) * padded + first  # this chunk's first row in the [BH, padded, ...] buffers
    tl.store(g_ptr + scratch + step, cum)
    lower_or_diag = step[:, None] >= step[None, :]
    decay = tl.where(lower_or_diag, tl.exp(cum[:, None] - cum[None, :]), 0.0)
    cols = tl.arange(0, BLOCK_VV)
    u_rows = u_ptr + (scratch + step)[:, None] * BLOCK_VV + cols[None, :]
    m_rows = m_ptr + (scratch + step)[:, None] * BLOCK_K + rows[None, :]
    if HAS_BETA:
        a = beta[:, None] * _dot(k, tl.trans(k)) * tl.where(step[:, None] > step[None, :], decay, 0.0)
        chunk_a = a_ptr + (bh.to(tl.int64) * tl.num_programs(1) + c) * CHUNK * CHUNK
        chunk_t = t_ptr + (bh.to(tl.int64) * tl.num_programs(1) + c) * CHUNK * CHUNK
        tl.store(chunk_a + step[:, None] * CHUNK + step[None, :], a)
        tl.debug_barrier()
        r = tl.arange(0, BLOCK)
        eye = (r[:, None] == r[None, :]).to(tl.float32)
        for i in tl.static_range(CHUNK // BLOCK):
            # the diagonal block's inverse: (I + N)^-1 = prod_k (I + (-N)^(2^k)), N strictly lower
            neg = -tl.load(_block(chunk_a, i, i, CHUNK, BLOCK))
            inv = eye + neg
            power = neg
            for _ in tl.static_range(SQUARINGS):
                power = _dot(power, power)
                inv = inv + _dot(inv, power)
            tl.store(_block(chunk_t, i, i, CHUNK, BLOCK), inv)
            for j in tl.static_range(CHUNK // BLOCK):
                if j < i:  # T_ij = -T_ii sum_{j <= l < i} A_il T_lj (the rows above are written)
                    acc = tl.zeros((BLOCK, BLOCK), tl.float32)
                    for l in tl.static_range(j, i):
                        acc += _dot(tl.load(_block(chunk_a, i, l, CHUNK, BLOCK)),
                                    tl.load(_block(chunk_t, l, j, CHUNK, BLOCK)))  # fmt: skip
                    tl.store(_block(chunk_t, i, j, CHUNK, BLOCK), -_dot(inv, acc))
                elif j > i:
                    tl.store(_block(chunk_t, i, j, CHUNK, BLOCK), tl.zeros((BLOCK, BLOCK), tl.float32))
            tl.debug_barrier()
        inverse = tl.load(chunk_t + step[:, None] * CHUNK + step[None, :])
        tl.store(m_rows, _dot(inverse, (beta * tl.exp(cum))[:, None] * k))
    else:  # W = V
        tl.store(m_rows, tl.zeros((CHUNK, BLOCK_K), tl.float32))
    heads_out = kv_heads * group
    for j in range(group):
        head = h * group + j
        q = _chunk_queries(q_ptr, b, head, t, tokens, rows, row_ok, q_row_stride, q_tok_stride, d_k, q_share)
        tl.store(_p_rows(p_ptr, b, head, heads_out, padded, first, step, CHUNK), _dot(q, tl.trans(k)) * decay)
    # the values last, so that they and the keys are not held at once
    v = tl.load(v_ptr + b * v_row_stride + t[:, None] * v_tok_stride + h * d_v + cols[None, :],
                mask=(t < tokens)[:, None] & (cols < d_v)[None, :], other=0.0).to(tl.float32)  # fmt: skip
    if HAS_BETA:
        tl.store(u_rows, _dot(inverse, beta[:, None] * v))
    else:
        tl.store(u_rows, v)


@triton.jit
def _chunk_state_kernel(
    q_ptr, k_ptr, past_ptr, present_ptr, out_ptr, u_ptr, m_ptr, p_ptr, g_ptr, q_row_stride, q_tok_stride,
    k_row_stride, k_tok_stride, tokens, padded, kv_heads, d_k, d_v, group, q_share, k_share, scale, ends_ptr,
    ends_stride, HAS_PAST: tl.constexpr, HAS_END: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_VV: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """The chunks of one (batch row, KV head, value-dim tile) in order: W = U - M S, the outputs of
    the chunk's tokens, the state after it (module docstring)."""
    bh = tl.program_id(0)
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
    heads_out = kv_heads * group
    last = _last_row(ends_ptr, b, ends_stride, tokens, HAS_END)
    for first in range(0, tokens, CHUNK):
        t = first + step
        t_ok = t < tokens
        scratch = bh.to(tl.int64) * padded + first
        cum = tl.load(g_ptr + scratch + step)
        total = tl.load(g_ptr + scratch + CHUNK - 1)  # flat past the last row and the prompt's end
        k = _chunk_keys(k_ptr, b, h, t, last, rows, row_ok, k_row_stride, k_tok_stride, d_k, k_share)
        u = tl.load(u_ptr + (scratch + step)[:, None] * BLOCK_VV + cols[None, :], mask=col_ok[None, :], other=0.0)
        m = tl.load(m_ptr + (scratch + step)[:, None] * BLOCK_K + rows[None, :])
        w = u - _dot(m, s)
        for j in range(group):
            head = h * group + j
            q = _chunk_queries(q_ptr, b, head, t, tokens, rows, row_ok, q_row_stride, q_tok_stride, d_k, q_share)
            p = tl.load(_p_rows(p_ptr, b, head, heads_out, padded, first, step, CHUNK))
            out = tl.exp(cum)[:, None] * _dot(q, s) + _dot(p, w)
            tl.store(out_ptr + ((b * tokens + t[:, None]) * heads_out + head) * d_v + cols[None, :],
                     (out * scale).to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & col_ok[None, :])  # fmt: skip
        s = s * tl.exp(total) + _dot(tl.trans(k * tl.exp(total - cum)[:, None]), w)
    tl.store(present_ptr + cells, s.to(present_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _tile(d_k: int, d_v: int) -> tuple[int, int, int]:
    """(BLOCK_K, BLOCK_V, BLOCK_VV): all key dims in one tile, value-dim tiles of STATE_COLUMNS for the
    state, and all value dims for the first kernel's U."""
    block_vv = max(16, triton.next_power_of_2(d_v))
    return max(16, triton.next_power_of_2(d_k)), min(STATE_COLUMNS, block_vv), block_vv


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
    for any number of tokens without a state window; None where these kernels do not serve these
    inputs (decays per key dim, or what ``prepare`` refuses)."""
    run = prepare(query, key, value, past_state, decay, beta, q_heads=q_heads, kv_heads=kv_heads, per_dim_decay=False,
                  last_row=last_row)  # fmt: skip
    if run is None:
        return None
    block_k, block_v, block_vv = _tile(run.d_k, run.d_v)
    chunks = triton.cdiv(run.tokens, CHUNK)
    padded = chunks * CHUNK
    bh = run.batch * kv_heads
    heads_out = kv_heads * run.group
    f32 = dict(dtype=torch.float32, device=query.device)
    square = (bh, chunks, CHUNK, CHUNK)
    a, inverse = (torch.empty(square, **f32), torch.empty(square, **f32)) if run.beta is not None else (None, None)
    u = torch.empty((bh, padded, block_vv), **f32)
    m = torch.empty((bh, padded, block_k), **f32)
    p = torch.empty((run.batch * heads_out, padded, CHUNK), **f32)
    g = torch.empty((bh, padded), **f32)
    q, k, v, decay_, beta_ = run.arguments()[:5]
    (q_rs, q_ts, k_rs, k_ts, v_rs, v_ts, d_rs, d_ts, d_hs, _, b_rs, b_ts, b_hs) = run.strides
    forms = run.forms()
    LAUNCHES["gated_delta_chunked"] += 1
    _chunk_prepare_kernel[(bh, chunks)](
        q, k, v, decay_, beta_, a if a is not None else u, inverse if inverse is not None else u, u, m, p, g,
        q_rs, q_ts, k_rs, k_ts, v_rs, v_ts, d_rs, d_ts, d_hs, b_rs, b_ts, b_hs, run.tokens, padded, kv_heads, run.d_k,
        run.d_v, run.group, run.q_share, run.k_share, *run.row_ends(), HAS_DECAY=forms["HAS_DECAY"],
        HAS_BETA=forms["HAS_BETA"], HAS_END=forms["HAS_END"], BLOCK_K=block_k, BLOCK_VV=block_vv, CHUNK=CHUNK,
        BLOCK=BLOCK, SQUARINGS=int(math.log2(BLOCK)) - 1, num_warps=8, **COMPILE_OPTIONS,
    )  # fmt: skip
    past = run.past if run.past is not None else run.present
    _chunk_state_kernel[(bh, triton.cdiv(run.d_v, block_v))](
        q, k, past, run.present, run.out, u, m, p, g, q_rs, q_ts, k_rs, k_ts, run.tokens, padded, kv_heads, run.d_k,
        run.d_v, run.group, run.q_share, run.k_share, float(scale), *run.row_ends(), HAS_PAST=forms["HAS_PAST"],
        HAS_END=forms["HAS_END"], BLOCK_K=block_k, BLOCK_V=block_v, BLOCK_VV=block_vv, CHUNK=CHUNK, num_warps=8,
        **COMPILE_OPTIONS,
    )  # fmt: skip
    return run.out, run.present
