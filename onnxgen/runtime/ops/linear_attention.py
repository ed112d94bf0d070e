"""Recurrent-state ops of hybrid decoders (opset 27): LinearAttention and CausalConvWithState.

Both carry a fixed-size state from step to step instead of a growing KV cache, so their
shapes never mention the KV length: with fixed input shapes they are safe to record. Where Triton
serves and there is no state window, one fused kernel runs a CausalConvWithState call of any
number of positions (gpu/causal_conv_update.py; option ``conv_prompt`` for prompts) and a
LinearAttention call: a step or a short prompt sequentially (gpu/gated_delta_decode.py, up to its
MAX_SEQUENTIAL_TOKENS), a prompt of options ``gdn_chunked_from`` to ``gdn_chunked_to`` tokens a chunk at a
time (gpu/gated_delta_chunked.py; not for decays per key dim); everything else runs the torch code here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from onnxgen import options
from onnxgen.runtime.gpu.launch import triton_serves
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.registry import MS_DOMAIN, implements

_RULES = ("linear", "gated", "delta", "gated_delta")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, T, H*D) -> (B, H, T, D)."""
    b, t, hd = x.shape
    return x.reshape(b, t, num_heads, hd // num_heads).transpose(1, 2)


def _sequential(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's recurrence token by token (decode, and per-key-dim decay); output unscaled.

    Per token, with e = exp(g) (a per-head scalar or one factor per key row) and D = diag(e):
      S' = D S + k d^T,  d = v (no delta rule) or beta (v - (D S)^T k),  o = q^T S'.
    The state is the large operand (d_k x d_v per head), so it is read as few times as the algebra
    allows: (D S)^T k and (D S)^T q are one product of S with the rows [e*k; e*q], and
    o = (D S)^T q + (q . k) d needs no second read of S'; the update is one scale and one in-place
    rank-1 add. The decayed state is never the caller's tensor (no in-place write into a past)."""
    outs = []
    for i in range(k.shape[2]):
        k_t, q_t, v_t = k[:, :, i : i + 1], q[:, :, :, i], v[:, :, i : i + 1]  # (B,H,1,dk) (B,H,G,dk) (B,H,1,dv)
        rows = torch.cat([k_t, q_t], dim=2)
        if g is None:
            projected = rows @ state
        else:
            e = g[:, :, i].exp()  # (B, H) or, per key dim, (B, H, dk)
            e_row, e_col = (e[..., None, :], e[..., :, None]) if e.dim() == 3 else (e[..., None, None],) * 2
            projected = (rows * e_row) @ state
        k_s, q_s = projected[:, :, :1], projected[:, :, 1:]
        if beta is not None:
            v_t = beta[:, :, i, None, None] * (v_t - k_s)
        k_col = k_t.transpose(-1, -2)
        if g is None:
            state = torch.addcmul(state, k_col, v_t)
        else:
            state = (state * e_col).addcmul_(k_col, v_t)
        outs.append(q_s + (q_t @ k_col) * v_t)
    if not outs:  # T == 0: nothing read, state unchanged
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), state
    return torch.stack(outs, dim=3), state


def _chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor | None,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence a chunk at a time (prefill), for no decay or a per-head scalar decay.

    Unrolled inside a chunk from its start state S0, with G the cumulative log decay:
      S_t = e^{G_t} S0 + sum_{j<=t} e^{G_t - G_j} k_j d_j^T,
    where the written values d_t are v_t (no delta rule) or, with the delta rule, the solution of
      d_t + beta_t sum_{j<t} e^{G_t - G_j} (k_t . k_j) d_j = beta_t (v_t - e^{G_t} S0^T k_t),
    a unit lower-triangular system. Outputs are q_t^T S_t. Equal to the token loop up to rounding,
    with a few large matmuls per chunk instead of several small kernels per token.
    """
    outs = []
    t = k.shape[2]
    for s in range(0, t, chunk):
        e = min(s + chunk, t)
        kc, vc, qc = k[:, :, s:e], v[:, :, s:e], q[:, :, :, s:e]
        n = e - s
        causal = torch.ones(n, n, dtype=torch.bool, device=k.device).tril()
        if g is not None:
            cum = g[:, :, s:e].cumsum(-1)  # (B, H, n)
            # e^{G_t - G_j} only where j <= t (there it is <= 1: no overflow)
            decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
            start_decay = cum.exp().unsqueeze(-1)  # (B, H, n, 1)
            end_decay = (cum[..., -1:] - cum).exp().unsqueeze(-1)  # e^{G_n - G_j}
            total = cum[..., -1].exp()[..., None, None]
        else:
            decay = causal.to(k.dtype).expand(*k.shape[:2], n, n)
            start_decay = end_decay = None
            total = None
        if beta is not None:
            from_start = kc @ state  # (B, H, n, d_v): S0^T k_t
            if start_decay is not None:
                from_start = from_start * start_decay
            bc = beta[:, :, s:e].unsqueeze(-1)  # (B, H|1, n, 1)
            lower = bc * (kc @ kc.transpose(-1, -2)) * decay.tril(-1)
            eye = torch.eye(n, dtype=k.dtype, device=k.device)
            written = torch.linalg.solve_triangular(
                eye + lower, bc * (vc - from_start), upper=False, unitriangular=True
            )
        else:
            written = vc
        # outputs: e^{G_t} q_t^T S0 + sum_{j<=t} e^{G_t - G_j} (q_t . k_j) d_j, per query group
        scores = (qc @ kc.unsqueeze(2).transpose(-1, -2)) * decay.unsqueeze(2)
        from_state = qc @ state.unsqueeze(2)
        if start_decay is not None:
            from_state = from_state * start_decay.unsqueeze(2)
        outs.append(from_state + scores @ written.unsqueeze(2))
        weighted = kc if end_decay is None else kc * end_decay
        state = (state if total is None else state * total) + weighted.transpose(-1, -2) @ written
    return torch.cat(outs, dim=3), state


@implements("LinearAttention", since=27)
def linear_attention(
    ctx: NodeContext,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_state: torch.Tensor | None = None,
    decay: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    last_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _linear_attention(ctx, query, key, value, past_state, decay, beta, inverse_gqa=False, window=0,
                             last_row=last_row)  # fmt: skip


@implements("LinearAttention", domain=MS_DOMAIN)
def linear_attention_ms(
    ctx: NodeContext,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_state: torch.Tensor | None = None,
    decay: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    last_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """onnxruntime's form: also inverse GQA (more KV heads than query heads, one output head per
    KV head) and ``state_window`` (the states after each of the last W tokens, for speculative
    decoding)."""
    window = int(ctx.attr("state_window", 0))
    if not 0 <= window <= 8:
        raise ctx.fail(f"state_window must be in [0, 8], got {window}")
    return _linear_attention(ctx, query, key, value, past_state, decay, beta, inverse_gqa=True, window=window,
                             last_row=last_row)  # fmt: skip


def _linear_attention(
    ctx: NodeContext,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_state: torch.Tensor | None,
    decay: torch.Tensor | None,
    beta: torch.Tensor | None,
    *,
    inverse_gqa: bool,
    window: int,
    last_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``last_row`` (runtime/state_rows.py's extra input, int64 [1] or [batch]): the tokens after
    that row of each batch entry (a padded prompt's padding) neither write nor decay the state, so
    the present state is the one after the last real row; their outputs are unspecified. A one-token
    step ignores it (its one row is the last)."""
    rule = ctx.attr("update_rule", "gated_delta")
    hq, hkv = int(ctx.require("q_num_heads")), int(ctx.require("kv_num_heads"))
    if rule not in _RULES:
        raise ctx.fail(f"unknown update_rule {rule!r}")
    if hq <= 0 or hkv <= 0 or (hq % hkv and not (inverse_gqa and hkv % hq == 0)):
        expected = "a positive multiple or divisor" if inverse_gqa else "a positive multiple"
        raise ctx.fail(f"q_num_heads {hq} must be {expected} of kv_num_heads {hkv}")
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    if gated != (decay is not None):
        raise ctx.fail(f"update_rule {rule!r} {'needs' if gated else 'forbids'} the decay input")
    if delta != (beta is not None):
        raise ctx.fail(f"update_rule {rule!r} {'needs' if delta else 'forbids'} the beta input")

    b, t, _ = query.shape
    d_k = query.shape[-1] // hq
    d_v = value.shape[-1] // hkv
    scale = ctx.attr("scale", 0.0) or 1.0 / math.sqrt(d_k)
    last_row = checked_last_row(ctx, last_row, b, t)
    if last_row is not None and window:
        raise ctx.fail("a last-row input and a state_window together are not supported")
    if not window and triton_serves(query):  # one fused kernel where one serves (else None)
        fast = _fused(query, key, value, past_state, decay, beta, q_heads=hq, kv_heads=hkv, scale=scale,
                      last_row=last_row)  # fmt: skip
        if fast is not None:
            return fast
    f32 = torch.float32 if query.dtype != torch.float64 else torch.float64
    # the recurrence accumulates over every token: keep it in fp32 whatever the activations
    q = _heads(query, hq).to(f32)
    if hkv > hq:  # inverse GQA: KV head h reads query head h // (hkv / hq)
        q = q.repeat_interleave(hkv // hq, dim=1)
    heads_out = max(hq, hkv)
    group = heads_out // hkv
    q = q.reshape(b, hkv, group, t, d_k)
    key_heads = key.shape[-1] // d_k
    if key_heads == hkv:
        k = _heads(key, hkv).to(f32)
    elif inverse_gqa and key_heads == hq and hkv > hq and key.shape[-1] == hq * d_k:
        # keys packed per query head (onnxruntime-genai's Qwen3.5 export): shared like the queries
        k = _heads(key, hq).to(f32).repeat_interleave(hkv // hq, dim=1)
    else:
        allowed = f"{hkv} * {d_k}" + (f" or {hq} * {d_k}" if inverse_gqa and hkv > hq else "")
        raise ctx.fail(f"key has last dimension {key.shape[-1]}; expected kv_num_heads * d_k = {allowed}")
    v = _heads(value, hkv).to(f32)
    per_dim = decay is not None and decay.shape[-1] == hkv * d_k and decay.shape[-1] != hkv
    g = None  # log decay: per-head scalar (B, H_kv, T) or per-key-dim (B, H_kv, T, d_k)
    if decay is not None:
        g = _heads(decay, hkv).to(f32) if per_dim else decay.to(f32).transpose(1, 2)
    bt = beta.to(f32).transpose(1, 2) if beta is not None else None  # (B, H_kv|1, T)
    if last_row is not None:  # rows past the last: a zero key writes nothing, a zero log decay keeps the state
        live = live_rows(last_row, b, t).to(f32)  # (B, T)
        k = k * live[:, None, :, None]
        if g is not None:
            g = g * (live[:, None, :, None] if per_dim else live[:, None, :])

    state_shape = (b, hkv, d_k, d_v)
    if past_state is not None:
        expected = (window, *state_shape) if window else state_shape
        if tuple(past_state.shape) != expected:
            raise ctx.fail(f"past_state has shape {tuple(past_state.shape)}; expected {expected}")
        state = (past_state[-1] if window else past_state).to(f32)
        state_dtype = past_state.dtype
    else:
        state = torch.zeros(state_shape, dtype=f32, device=query.device)
        state_dtype = query.dtype
    if window > t + 1:
        raise ctx.fail(f"state_window {window} reaches before this call's {t} tokens and the state it starts from")
    # tokens before the window run in one pass; the window's tokens one at a time, each state kept
    head = t - window if window else t
    slots = [state] if window and head < 0 else []
    head = max(head, 0)
    if head > 1 and not per_dim:
        chunk = max(int(ctx.attr("chunk_size", 64)), 1)
        out, state = _chunked(q[:, :, :, :head], k[:, :, :head], v[:, :, :head], _cut(g, 0, head),
                              _cut(bt, 0, head), state, chunk)  # fmt: skip
    else:
        out, state = _sequential(q[:, :, :, :head], k[:, :, :head], v[:, :, :head], _cut(g, 0, head),
                                 _cut(bt, 0, head), state)  # fmt: skip
    outs = [out]
    for i in range(head, t) if window else ():
        one, state = _sequential(q[:, :, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], _cut(g, i, i + 1),
                                 _cut(bt, i, i + 1), state)  # fmt: skip
        outs.append(one)
        slots.append(state)
    out = torch.cat(outs, dim=3) if len(outs) > 1 else out
    out = out * scale  # (B, H_kv, G, T, d_v)
    out = out.reshape(b, heads_out, t, d_v).transpose(1, 2).reshape(b, t, heads_out * d_v)
    present = torch.stack(slots[-window:]) if window else state
    return out.to(query.dtype), present.to(state_dtype)


def chunked_kernel_takes(tokens: int, opts: options.Options) -> bool:
    """Whether a prompt of ``tokens`` goes to the chunked kernels: from option gdn_chunked_from (0: never)
    up to gdn_chunked_to (0: no bound). The one rule LinearAttention and FusedLinearAttention route by."""
    first, last = opts.gdn_chunked_from, opts.gdn_chunked_to
    return bool(first) and tokens >= first and (not last or tokens <= last)


def _fused(query, key, value, past_state, decay, beta, *, q_heads: int, kv_heads: int, scale: float, last_row=None):
    """The Triton kernels' (output, present), or None: a prompt the options send to the chunked kernels
    (``chunked_kernel_takes``) runs them (gpu/gated_delta_chunked.py), else (or where they refuse the
    inputs) a step or a short prompt the sequential one (gpu/gated_delta_decode.py). ``last_row``: as
    ``_linear_attention``'s (checked there)."""
    from onnxgen.runtime.gpu.gated_delta_decode import gated_delta_decode

    if query.dim() == 3 and chunked_kernel_takes(query.shape[1], options.current()):
        from onnxgen.runtime.gpu.gated_delta_chunked import gated_delta_chunked

        fast = gated_delta_chunked(query, key, value, past_state, decay, beta, q_heads=q_heads, kv_heads=kv_heads,
                                   scale=scale, last_row=last_row)  # fmt: skip
        if fast is not None:
            return fast
    return gated_delta_decode(query, key, value, past_state, decay, beta, q_heads=q_heads, kv_heads=kv_heads,
                              scale=scale, last_row=last_row)  # fmt: skip


def checked_last_row(ctx: NodeContext, last_row: torch.Tensor | None, batch: int, tokens: int) -> torch.Tensor | None:
    """The last-row input of a carried-state op (runtime/state_rows.py), checked: int64 of shape [1]
    (every batch entry) or [batch]; None where it changes nothing (absent, or a one-token step,
    whose one row is the last). Its values are not read on the host (a recorded step copies them in)."""
    if last_row is None or tokens <= 1:
        return None
    if last_row.dtype != torch.int64 or last_row.dim() != 1 or last_row.shape[0] not in (1, batch):
        raise ctx.fail(f"the last-row input is {last_row.dtype} of shape {list(last_row.shape)}; expected int64 "
                       f"of shape [1] or [{batch}] (the batch)")  # fmt: skip
    return last_row


def live_rows(last_row: torch.Tensor, batch: int, tokens: int) -> torch.Tensor:
    """(batch, tokens) bool: row t of entry b is at or before last_row[b] (or last_row[0])."""
    steps = torch.arange(tokens, device=last_row.device)
    return (steps[None, :] <= last_row[:, None]).expand(batch, tokens)


def _cut(x: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    """Tokens lo..hi of a decay or beta (token axis 2)."""
    return None if x is None else x[:, :, lo:hi]


@implements("CausalConvWithState", since=27)
def causal_conv_with_state(
    ctx: NodeContext,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    past_state: torch.Tensor | None = None,
    last_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``last_row`` (runtime/state_rows.py's extra input): the carry is the one after that row of
    each batch entry (positions after it, a padded prompt's padding, do not enter it)."""
    last_row = checked_last_row(ctx, last_row, x.shape[0], x.shape[-1]) if x.dim() == 3 else last_row
    fast = _conv_step(ctx, x, weight, bias, past_state, 1, False, last_row)
    if fast is not None:
        return fast
    return _causal_conv(ctx, x, weight, bias, past_state, dilation=1, window=0, last_row=last_row)


# onnxruntime's attributes that only its CUDA kernel implements, with their defaults
_CUDA_ONLY_CONV_ATTRS = {
    "state_length": 0,
    "state_channels_last": -1,
    "input_channel_offset": 0,
    "input_channels": 0,
    "state_update_capacity": 0,
}


@implements("CausalConvWithState", domain=MS_DOMAIN)
def causal_conv_with_state_ms(
    ctx: NodeContext,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    past_state: torch.Tensor | None = None,
    last_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """onnxruntime's form: also ``dilation``, ``channels_last`` (activations and state
    sequence-major, any number of trailing channel axes) and ``state_window`` (the carry after
    each of the last W positions). The 1-D form only, as Gated DeltaNet and Mamba exports use it.
    ``last_row`` as causal_conv_with_state's."""
    ndim = int(ctx.attr("ndim", 1))
    if ndim != 1:
        raise ctx.fail(f"ndim {ndim}: only the 1-D causal convolution (ndim 1) is implemented")
    for name, default in _CUDA_ONLY_CONV_ATTRS.items():
        if int(ctx.attr(name, default)) != default:
            raise ctx.fail(f"attribute {name} (onnxruntime's CUDA-only extended path) is not supported; "
                           f"expected its default {default}")  # fmt: skip
    dilation, window = int(ctx.attr("dilation", 1)), int(ctx.attr("state_window", 0))
    if dilation < 1:
        raise ctx.fail(f"dilation must be >= 1, got {dilation}")
    if not 0 <= window <= 8:
        raise ctx.fail(f"state_window must be in [0, 8], got {window}")
    channels_last = bool(int(ctx.attr("channels_last", 0)))
    if x.dim() >= 3:
        last_row = checked_last_row(ctx, last_row, x.shape[0], x.shape[1] if channels_last else x.shape[-1])
    if last_row is not None and window:
        raise ctx.fail("a last-row input and a state_window together are not supported")
    fast = None if window else _conv_step(ctx, x, weight, bias, past_state, dilation, channels_last, last_row)
    if fast is not None:
        return fast
    if not channels_last:
        return _causal_conv(ctx, x, weight, bias, past_state, dilation=dilation, window=window, last_row=last_row)
    if x.dim() < 3:
        raise ctx.fail(f"channels_last input must be (batch, sequence, channels...), got shape {tuple(x.shape)}")
    lead, channel_axes = x.shape[:2], x.shape[2:]
    # computed in this layout (channels flattened, contiguous along them), not transposed to channels first
    past = None if past_state is None else past_state.flatten(past_state.dim() - len(channel_axes))
    y, present = _causal_conv(ctx, x.flatten(2), weight, bias, past, dilation=dilation, window=window,
                              channels_last=True, last_row=last_row)  # fmt: skip
    return y.reshape(*lead, *channel_axes), present.reshape(*present.shape[:-1], *channel_axes)


def _conv_step(
    ctx: NodeContext,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    past_state: torch.Tensor | None,
    dilation: int,
    channels_last: bool,
    last_row: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A call without a state window in one fused kernel, where Triton serves and the kernel takes
    these inputs; None: the torch path runs (and reports malformed inputs)."""
    if not triton_serves(x):
        return None
    from onnxgen.runtime.gpu.causal_conv_update import causal_conv_update

    return causal_conv_update(x, weight, bias, past_state, activation=ctx.attr("activation", "none"),
                              dilation=dilation, channels_last=channels_last, last_row=last_row)  # fmt: skip


def _depthwise_taps(
    padded: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int, length: int, seq: int
) -> torch.Tensor:
    """The depthwise causal convolution of ``padded`` (carry + T positions along axis ``seq``,
    channels along the other non-batch axis) as k multiply-adds of shifted views,
    y = bias + sum_j w[:, j] * padded[j * dilation : j * dilation + T]: a few passes over the
    output in place of a general grouped convolution, whose per-call set-up on the CPU outweighs
    the arithmetic of a decode step's k taps per channel."""
    # tap j broadcast over the other axes: a row of C (channels last) or a column (channels first)
    taps = weight[:, 0, :].t() if seq == 1 else weight.movedim(-1, 0)  # (k, C) or (k, C, 1)
    y = padded.narrow(seq, 0, length) * taps[0]
    if bias is not None:
        y += bias if seq == 1 else bias[:, None]
    for j in range(1, taps.shape[0]):
        y.addcmul_(padded.narrow(seq, j * dilation, length), taps[j])
    return y


def _causal_conv(
    ctx: NodeContext,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    past_state: torch.Tensor | None,
    *,
    dilation: int,
    window: int,
    channels_last: bool = False,
    last_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, C, T) and the carry (B, C, (k - 1) * dilation), or (W, B, C, ...) with a window of
    W carries of which the last is read: y (B, C, T) and the new carry (or carries). With
    ``channels_last`` every one of them has its position and channel axes swapped. ``last_row``
    (checked by the caller; no window): the new carry ends at that position of each batch entry."""
    activation = ctx.attr("activation", "none")
    if activation not in ("none", "silu", "swish"):
        raise ctx.fail(f"unknown activation {activation!r}")
    if x.dim() != 3:
        raise ctx.fail(f"input must be (batch, channels, length), got shape {tuple(x.shape)}")
    seq = 1 if channels_last else 2
    batch, channels, length = (x.shape[0], x.shape[2], x.shape[1]) if channels_last else x.shape
    k = weight.shape[-1]
    carry = (k - 1) * dilation
    if tuple(weight.shape) != (channels, 1, k):
        raise ctx.fail(f"weight has shape {tuple(weight.shape)}; a depthwise kernel is ({channels}, 1, k)")
    one = (batch, carry, channels) if channels_last else (batch, channels, carry)
    expected = (window, *one) if window else one
    if past_state is None:
        past = x.new_zeros(one)
    elif tuple(past_state.shape) != expected:
        raise ctx.fail(f"past_state has shape {tuple(past_state.shape)}; expected {expected}")
    else:
        past = past_state[-1] if window else past_state
    if window > length + 1:
        raise ctx.fail(f"state_window {window} reaches before this call's {length} positions and its carry")
    padded = torch.cat([past.to(x.dtype), x], dim=seq)
    # in fp32 for half types: the sum over k taps should not round at every step
    cd = torch.float32 if x.dtype in _LOW_PRECISION else x.dtype
    y = _depthwise_taps(padded.to(cd), weight.to(cd), None if bias is None else bias.to(cd), dilation, length, seq)
    y = y.to(x.dtype)
    if activation != "none":  # on the sum rounded to x's dtype (gpu/causal_conv_update.py rounds alike)
        y = F.silu(y.to(cd)).to(x.dtype)
    if last_row is not None:
        # the carry is the `carry` padded positions that end at the last row: last + 1 .. last + carry
        # (gathered on the device: the row is a device value, not read on the host)
        ends = last_row.clamp(-1, length - 1) + 1  # (1 | B,)
        where = ends[:, None] + torch.arange(carry, device=x.device)[None, :]  # (1 | B, carry)
        where = where.expand(batch, carry)
        index = where[:, :, None] if channels_last else where[:, None, :]
        index = index.expand(*((batch, carry, channels) if channels_last else (batch, channels, carry)))
        return y, padded.gather(seq, index).contiguous()
    if not window:
        # a copy, not a view: a view would keep the whole padded input (a long prompt's) alive
        return y, padded.narrow(seq, length, carry).clone(memory_format=torch.contiguous_format)
    # slot j: the carry after position T - W + j, i.e. the `carry` values of the padded input that
    # end there (slot W - 1 is the plain present state; a slot at position -1 is the past itself)
    ends = range(length - window + 1 + carry, length + 1 + carry)
    return y, torch.stack([padded.narrow(seq, end - carry, carry) for end in ends])
