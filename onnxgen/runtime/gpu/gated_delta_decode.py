"""LinearAttention's one-token step (T == 1), and short runs of tokens (a short prompt), in one
Triton kernel: the gated delta rule and its simpler forms (linear, gated, delta), for every batch
row and KV (value) head at once.

The torch path (runtime/ops/linear_attention.py, ``_sequential``) spends a dozen kernels per layer
on it: casts to fp32, exp, two einsums, the outer-product update, the scale, casts back. Here one
program owns a (batch row, KV head, value-dim tile) of the state S [d_k, d_v] and does, in fp32:

    S = S * exp(g)                  g: the log decay, per head or per key dim (gated rules)
    v' = beta * (v - S^T k)         (delta rules; else v' = v)
    S = S + k v'^T
    out = scale * S^T q             once per query head that reads this KV head

For T tokens the program repeats this token after token with S in registers (the recurrence's own
order), reading the state once and writing it once. That is a chain of T dependent steps, so it
serves up to MAX_SEQUENTIAL_TOKENS; longer prompts keep the torch path's chunked form, whose matrix
products do the same work in T / chunk dependent steps. By default it takes only prompts of up to 16
tokens: options gdn_chunked_from / gdn_chunked_to send longer ones to the chunked kernels
(gated_delta_chunked.py), which are faster there.

Every step is separable over the value dims (column m of S needs only column m and the whole of k),
so tiles over d_v never talk to each other: no atomics, no second pass, and each reduction over
d_k has a fixed order, so a replayed graph gives the eager result bit for bit. The new state goes
to a fresh present buffer (never the past: a recorded step must not consume its own input).

Head mapping, as ``_linear_attention`` groups them: with H_q >= H_kv, KV head h serves the
G = H_q / H_kv query heads h * G .. h * G + G - 1 (output heads likewise); with more KV heads than
query heads (onnxruntime's inverse GQA) KV head h reads query head h / R, R = H_kv / H_q, and
writes output head h. Keys come per KV head, or packed per query head (then key head h / R).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from onnxgen import options
from onnxgen.runtime.gpu.launch import KERNEL_DTYPES, LAUNCHES, pdl_launch
from onnxgen.runtime.gpu.linear_attention_gate import _softplus
from onnxgen.runtime.gpu.pdl import wait_for_previous

# key dims one program holds whole (the tile is d_k x BLOCK_V fp32 values in registers)
MAX_KEY_DIM = 512
# the longest run of tokens one program steps through (module docstring); at 100 and 128 tokens the
# sequential kernel still beat the torch path's chunked form in the hybrid shapes' prompts
# (docs/benchmarks/2026-12-06-h100-grouped-swap-ttft.md)
MAX_SEQUENTIAL_TOKENS = 128
# (value columns, warps) of a program on a prompt of 2 or more tokens: narrow tiles of one warp, whose
# reductions over the key dims stay inside the warp, shorten each of the chain's dependent steps
# (swept on the GPU: docs/benchmarks/2026-12-05-h100-gdn-prompt.md); option gdn_prompt forces another
PROMPT_TILE = (8, 1)
# enough programs to put a batch-1 step's state on every SM of a large GPU: the step reads and
# writes the whole state once, so it is bound by memory parallelism, not arithmetic
_TARGET_PROGRAMS = 128


@triton.jit
def _gated_delta_step_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    decay_ptr,
    beta_ptr,
    past_ptr,
    present_ptr,
    out_ptr,
    q_row_stride,
    q_tok_stride,
    k_row_stride,
    k_tok_stride,
    v_row_stride,
    v_tok_stride,
    decay_row_stride,
    decay_tok_stride,
    decay_head_stride,
    decay_dim_stride,
    beta_row_stride,
    beta_tok_stride,
    beta_head_stride,
    tokens,
    kv_heads,
    d_k,
    d_v,
    group,
    q_share,
    k_share,
    scale,
    ends_ptr,
    ends_stride,
    dt_bias_ptr,
    decay_scale_ptr,
    eps,
    HAS_PAST: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    HAS_BETA: tl.constexpr,
    HAS_END: tl.constexpr,  # a last row per batch entry (Launch.ends): the tokens after it keep the state
    NORM: tl.constexpr,  # 0: q and k as given; 1: L2-normalised (eps); 2: likewise, a zero vector staying zero
    GATE: tl.constexpr,  # the decay and beta inputs are LinearAttentionGate's a and b (see gated_delta_prologue)
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (launch.pdl_launch)
):
    wait_for_previous(PDL)
    bh = tl.program_id(0)  # batch row * kv_heads + KV head: the state's (B, H_kv) index
    b = bh // kv_heads
    h = bh % kv_heads
    rows = tl.arange(0, BLOCK_K)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < d_k
    col_ok = cols < d_v
    tile_ok = row_ok[:, None] & col_ok[None, :]
    # the state is contiguous (B, H_kv, d_k, d_v); masked rows and columns stay zero throughout
    cells = bh.to(tl.int64) * d_k * d_v + rows[:, None] * d_v + cols[None, :]
    if HAS_PAST:
        s = tl.load(past_ptr + cells, mask=tile_ok, other=0.0).to(tl.float32)
    else:
        s = tl.zeros((BLOCK_K, BLOCK_V), tl.float32)
    heads_out = kv_heads * group
    if GATE:  # per head: loaded once, not once per token
        dt_bias = tl.load(dt_bias_ptr + h + rows * 0).to(tl.float32)
        decay_scale = tl.load(decay_scale_ptr + h + rows * 0).to(tl.float32)
    else:
        dt_bias = 0.0
        decay_scale = 0.0
    last = tokens - 1
    if HAS_END:
        last = tl.load(ends_ptr + b * ends_stride)
    # token i's inputs are loaded and prepared while token i - 1 updates the state (none of them reads
    # it), so a prompt's chain of dependent steps does not also wait on each token's loads
    factor, k, v, beta, q = _token_inputs(
        q_ptr, k_ptr, v_ptr, decay_ptr, beta_ptr, b, h, 0, tokens, rows, row_ok, cols, col_ok, q_row_stride,
        q_tok_stride, k_row_stride, k_tok_stride, v_row_stride, v_tok_stride, decay_row_stride, decay_tok_stride,
        decay_head_stride, decay_dim_stride, beta_row_stride, beta_tok_stride, beta_head_stride, d_k, d_v, group,
        q_share, k_share, dt_bias, decay_scale, eps, HAS_DECAY, HAS_BETA, NORM, GATE,
    )  # fmt: skip
    for i in range(tokens):
        next_factor, next_k, next_v, next_beta, next_q = _token_inputs(
            q_ptr, k_ptr, v_ptr, decay_ptr, beta_ptr, b, h, i + 1, tokens, rows, row_ok, cols, col_ok,
            q_row_stride, q_tok_stride, k_row_stride, k_tok_stride, v_row_stride, v_tok_stride, decay_row_stride,
            decay_tok_stride, decay_head_stride, decay_dim_stride, beta_row_stride, beta_tok_stride,
            beta_head_stride, d_k, d_v, group, q_share, k_share, dt_bias, decay_scale, eps, HAS_DECAY, HAS_BETA,
            NORM, GATE,
        )  # fmt: skip
        if HAS_END:  # past the last row: a zero key writes nothing, a unit factor keeps the state
            k = tl.where(i <= last, k, 0.0)
            if HAS_DECAY:
                factor = tl.where(i <= last, factor, 1.0)
        if HAS_DECAY:
            s = s * factor[:, None]
        if HAS_BETA:
            v = beta * (v - tl.sum(s * k[:, None], axis=0))
        s = s + k[:, None] * v[None, :]
        for j in range(group):
            head = h * group + j
            if j > 0:  # the first query head of the group came with the token's inputs
                q = _query_head(q_ptr, b, i, head, q_row_stride, q_tok_stride, q_share, d_k, rows, row_ok, eps, NORM)
            out = tl.sum(q[:, None] * s, axis=0) * scale
            tl.store(out_ptr + ((b * tokens + i) * heads_out + head) * d_v + cols, out.to(out_ptr.dtype.element_ty),
                     mask=col_ok)  # fmt: skip
        factor, k, v, beta, q = next_factor, next_k, next_v, next_beta, next_q
    tl.store(present_ptr + cells, s.to(present_ptr.dtype.element_ty), mask=tile_ok)


@triton.jit
def _token_inputs(
    q_ptr, k_ptr, v_ptr, decay_ptr, beta_ptr, b, h, next_token, tokens, rows, row_ok, cols, col_ok, q_row_stride,
    q_tok_stride, k_row_stride, k_tok_stride, v_row_stride, v_tok_stride, decay_row_stride, decay_tok_stride,
    decay_head_stride, decay_dim_stride, beta_row_stride, beta_tok_stride, beta_head_stride, d_k, d_v, group,
    q_share, k_share, dt_bias, decay_scale, eps, HAS_DECAY: tl.constexpr, HAS_BETA: tl.constexpr,
    NORM: tl.constexpr, GATE: tl.constexpr,
):  # fmt: skip
    """Token i's (exp(g), k, v, beta, q of the group's first query head) in fp32, as the step reads
    them: the gate's decay and sigmoid and the L2 norms applied with their roundings. Nothing here
    reads the state. Past the last token (``next_token`` == ``tokens``) the last token's are read
    again (never beyond the inputs), the results unused."""
    i = tl.minimum(next_token, tokens - 1)
    if HAS_DECAY:
        g = tl.load(
            decay_ptr + b * decay_row_stride + i * decay_tok_stride + h * decay_head_stride + rows * decay_dim_stride,
            mask=row_ok, other=0.0,
        ).to(tl.float32)  # fmt: skip
        if GATE:  # LinearAttentionGate's decay, rounded to its dtype (a's) as that op's kernel rounds it
            g = (decay_scale * _softplus(g + dt_bias)).to(decay_ptr.dtype.element_ty).to(tl.float32)
        factor = tl.exp(g)
    else:
        factor = 1.0
    k = tl.load(k_ptr + b * k_row_stride + i * k_tok_stride + (h // k_share) * d_k + rows, mask=row_ok,
                other=0.0).to(tl.float32)  # fmt: skip
    if NORM != 0:
        k = _l2_normalized(k, eps, NORM).to(k_ptr.dtype.element_ty).to(tl.float32)
    v = tl.load(v_ptr + b * v_row_stride + i * v_tok_stride + h * d_v + cols, mask=col_ok,
                other=0.0).to(tl.float32)  # fmt: skip
    if HAS_BETA:
        beta = tl.load(beta_ptr + b * beta_row_stride + i * beta_tok_stride + h * beta_head_stride).to(tl.float32)
        if GATE:  # sigmoid(b), rounded to b's dtype
            beta = (1.0 / (1.0 + tl.exp(-beta))).to(beta_ptr.dtype.element_ty).to(tl.float32)
    else:
        beta = 0.0
    q = _query_head(q_ptr, b, i, h * group, q_row_stride, q_tok_stride, q_share, d_k, rows, row_ok, eps, NORM)
    return factor, k, v, beta, q


@triton.jit
def _query_head(q_ptr, b, i, head, q_row_stride, q_tok_stride, q_share, d_k, rows, row_ok, eps, NORM: tl.constexpr):
    """Query head ``head`` of token i in fp32, L2-normalised (with its rounding) where NORM says."""
    q = tl.load(q_ptr + b * q_row_stride + i * q_tok_stride + (head // q_share) * d_k + rows, mask=row_ok,
                other=0.0).to(tl.float32)  # fmt: skip
    if NORM != 0:
        q = _l2_normalized(q, eps, NORM).to(q_ptr.dtype.element_ty).to(tl.float32)
    return q


@triton.jit
def _l2_normalized(x, eps, NORM: tl.constexpr):
    """x / sqrt(sum(x^2) + eps) in fp32 (masked lanes zero), as gpu/l2_norm.py computes it; NORM 2:
    a vector whose sum is zero gives zeros (LpNormalization)."""
    total = tl.sum(x * x, axis=0) + eps
    if NORM == 2:
        return tl.where(total == 0.0, 0.0, x / tl.sqrt(tl.where(total == 0.0, 1.0, total)))
    else:
        return x / tl.sqrt(total)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A (B, T, N) tensor whose last axis is contiguous, and its batch and token strides. Split's
    views of a packed projection pass without a copy."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, x.stride(0), x.stride(1)


def _tile(batch: int, kv_heads: int, d_k: int, d_v: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_V): all key dims in one tile; value-dim tiles of at most 4096 fp32 cells
    (the program's registers), narrowed to 16 while that raises the program count toward
    _TARGET_PROGRAMS."""
    block_k = triton.next_power_of_2(d_k)
    block_v = max(1, min(triton.next_power_of_2(d_v), 32, 4096 // block_k))
    while block_v > 16 and batch * kv_heads * triton.cdiv(d_v, block_v) < _TARGET_PROGRAMS:
        block_v //= 2
    return block_k, block_v


@dataclass(frozen=True)
class Launch:
    """What both gated-delta kernels take (this module's sequential one, gated_delta_chunked.py's):
    the inputs with their last axes contiguous, the strides of every (batch row, token, head, key
    dim) axis the kernels index, the head mapping, and the fresh outputs."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    decay: torch.Tensor | None
    beta: torch.Tensor | None
    past: torch.Tensor | None
    present: torch.Tensor
    out: torch.Tensor
    strides: tuple[int, ...]  # q, k, v (batch row, token); decay (row, token, head, key dim); beta (row, token, head)
    batch: int
    tokens: int
    kv_heads: int
    d_k: int
    d_v: int
    group: int  # output (query) heads per KV head
    q_share: int  # inverse GQA: KV heads per query head
    k_share: int  # keys packed per query head: KV heads per key head
    # a prompt's last row per batch entry (int64 [1] or [B]): the tokens after it neither write nor
    # decay the state (a padded prompt's padding; their outputs are unspecified); None: every token counts
    ends: torch.Tensor | None = None

    def forms(self) -> dict[str, bool]:
        """The kernels' HAS_PAST / HAS_DECAY / HAS_BETA / HAS_END constexprs."""
        return {
            "HAS_PAST": self.past is not None,
            "HAS_DECAY": self.decay is not None,
            "HAS_BETA": self.beta is not None,
            "HAS_END": self.ends is not None,
        }

    def row_ends(self) -> tuple:
        """The kernels' (ends_ptr, ends_stride) arguments."""
        if self.ends is None:
            return self.query, 0
        return self.ends, 1 if self.ends.numel() > 1 else 0

    def arguments(self) -> tuple:
        """The kernels' leading arguments, in their order."""
        q = self.query
        return (q, self.key, self.value, self.decay if self.decay is not None else q,
                self.beta if self.beta is not None else q, self.past if self.past is not None else self.present,
                self.present, self.out, *self.strides, self.tokens, self.kv_heads, self.d_k, self.d_v, self.group,
                self.q_share, self.k_share)  # fmt: skip


def prepare(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_state: torch.Tensor | None,
    decay: torch.Tensor | None,
    beta: torch.Tensor | None,
    *,
    q_heads: int,
    kv_heads: int,
    per_dim_decay: bool = True,
    last_row: torch.Tensor | None = None,
) -> Launch | None:
    """The kernels' view of ``_linear_attention``'s inputs (no state window), with the outputs
    allocated: output (B, T, max(H_q, H_kv) * d_v) in the query's dtype, present state (B, H_kv,
    d_k, d_v) in the past state's dtype, else the query's. None where the kernels do not serve these
    inputs (the caller runs the torch path, which also reports malformed ones), and with
    ``per_dim_decay`` False where the decay is one per key dim of each head. The caller has
    checked the update rule against decay / beta and the head counts, and ``last_row``'s shape
    (Launch.ends; ignored for one token)."""
    b, t, width = query.shape if query.dim() == 3 else (0, 0, 0)
    if t < 1 or b == 0 or width % q_heads or value.shape[-1] % kv_heads:
        return None
    if t == 1:
        last_row = None
    elif last_row is not None and last_row.device != query.device:
        return None
    d_k, d_v = width // q_heads, value.shape[-1] // kv_heads
    tensors = [query, key, value, past_state, decay, beta]
    if any(x is not None and (x.dtype not in KERNEL_DTYPES or x.device != query.device) for x in tensors):
        return None
    if d_k == 0 or d_v == 0 or d_k > MAX_KEY_DIM or key.dim() != 3 or value.dim() != 3:
        return None
    if key.shape[:2] != (b, t) or value.shape[:2] != (b, t):
        return None
    share = kv_heads // q_heads if kv_heads > q_heads else 1  # inverse GQA: KV heads per query head
    if key.shape[-1] == kv_heads * d_k:
        k_share = 1
    elif kv_heads > q_heads and key.shape[-1] == q_heads * d_k:  # keys packed per query head
        k_share = share
    else:
        return None
    state_shape = (b, kv_heads, d_k, d_v)
    if past_state is not None and tuple(past_state.shape) != state_shape:
        return None
    decay_strides = (0, 0, 0, 0)  # batch row, token, head, key dim
    if decay is not None:
        if decay.dim() != 3 or decay.shape[:2] != (b, t):
            return None
        last = decay.shape[-1]
        if last == kv_heads:  # one log decay per head
            decay_strides = (decay.stride(0), decay.stride(1), decay.stride(2), 0)
        elif last == kv_heads * d_k and per_dim_decay:  # one per key dim of each head
            decay_strides = (decay.stride(0), decay.stride(1), d_k * decay.stride(2), decay.stride(2))
        elif last == 1:  # one for every head
            decay_strides = (decay.stride(0), decay.stride(1), 0, 0)
        else:
            return None
    beta_strides = (0, 0, 0)  # batch row, token, head
    if beta is not None:
        if beta.dim() != 3 or beta.shape[:2] != (b, t) or beta.shape[-1] not in (kv_heads, 1):
            return None
        beta_strides = (beta.stride(0), beta.stride(1), beta.stride(2) if beta.shape[-1] == kv_heads else 0)

    group = max(q_heads, kv_heads) // kv_heads
    query, *q_strides = _rows(query)
    key, *k_strides = _rows(key)
    value, *v_strides = _rows(value)
    past = past_state.contiguous() if past_state is not None else None
    present = torch.empty(state_shape, dtype=query.dtype if past is None else past.dtype, device=query.device)
    out = torch.empty((b, t, kv_heads * group * d_v), dtype=query.dtype, device=query.device)
    strides = (*q_strides, *k_strides, *v_strides, *decay_strides, *beta_strides)
    return Launch(query, key, value, decay, beta, past, present, out, strides, b, t, kv_heads, d_k, d_v, group, share,
                  k_share, last_row)  # fmt: skip


def gated_delta_decode(
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
    """(output, present state) as ``_linear_attention`` returns them (see ``prepare``) for 1 to
    MAX_SEQUENTIAL_TOKENS tokens without a state window, by the sequential kernel; None where it
    does not serve these inputs."""
    if not 1 <= (query.shape[1] if query.dim() == 3 else 0) <= MAX_SEQUENTIAL_TOKENS:
        return None
    run = prepare(query, key, value, past_state, decay, beta, q_heads=q_heads, kv_heads=kv_heads, last_row=last_row)
    if run is None:
        return None
    return _step(run, scale, run.query, run.query, 0.0, norm=0, gate=False)


def _step(run: Launch, scale: float, dt_bias, decay_scale, eps: float, *, norm: int, gate: bool):
    """The sequential kernel's launch over ``run`` (prepare's), with or without the prologues
    (gated_delta_prologue: dt_bias and decay_scale the gate's; else placeholders it never reads);
    returns (output, present)."""
    block_k, block_v = _tile(run.batch, run.kv_heads, run.d_k, run.d_v)
    warps = 4
    if run.tokens > 1:  # a prompt: its steps' latency, not the state's bytes, bounds it (PROMPT_TILE)
        columns, warps = options.current().gdn_prompt or PROMPT_TILE
        block_v = min(columns, triton.next_power_of_2(run.d_v))
    LAUNCHES["gated_delta_decode"] += 1
    _gated_delta_step_kernel[(run.batch * run.kv_heads, triton.cdiv(run.d_v, block_v))](
        *run.arguments(),
        float(scale),
        *run.row_ends(),
        dt_bias,
        decay_scale,
        float(eps),
        **run.forms(),
        NORM=norm,
        GATE=gate,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        num_warps=warps,
        **pdl_launch(run.query, run.present, run.out),
    )
    return run.out, run.present


def gated_delta_prologue(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_state: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    decay_scale: torch.Tensor,
    *,
    q_heads: int,
    kv_heads: int,
    scale: float,
    norm: int,
    eps: float,
    last_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The gated delta rule with the layer's prologues inside (ops/fused_linear_attention.py): the
    decay per KV head decay_scale * softplus(a + dt_bias) and beta = sigmoid(b) (a, b [B, T, H_kv]),
    each rounded to a's / b's dtype as gpu/linear_attention_gate.py rounds them, and with ``norm``
    1 or 2 the query and key heads L2-normalised (gpu/l2_norm.py's arithmetic, rounded to their
    dtype) as the kernel reads them. None where the kernel does not serve these inputs."""
    if not 1 <= (query.shape[1] if query.dim() == 3 else 0) <= MAX_SEQUENTIAL_TOKENS:
        return None
    if any(t.dtype not in KERNEL_DTYPES or t.device != query.device for t in (dt_bias, decay_scale)):
        return None
    run = prepare(query, key, value, past_state, a, b, q_heads=q_heads, kv_heads=kv_heads, per_dim_decay=False,
                  last_row=last_row)  # fmt: skip
    if run is None:  # a decay per key dim refused: the gate's is one per head
        return None
    LAUNCHES["gated_delta_prologue"] += 1
    return _step(run, scale, dt_bias.contiguous(), decay_scale.contiguous(), eps, norm=norm, gate=True)
