"""CausalConvWithState in one Triton kernel: the depthwise causal convolution over the carried
window plus the new input, the optional SiLU, and the shifted carry; a one-position step (T == 1)
and a prompt of T positions.

The torch path (runtime/ops/linear_attention.py, ``_causal_conv``) spends several kernels on it
(a cast, the concatenation, the conv, casts, the activation, the carry's copy, and for
channels-last states two transposes). One program here owns a block of channels of one batch row:

    window = [carry_0 .. carry_{L-1}, x]        L = (k - 1) * dilation carried positions
    y      = act(sum_i weight[c, i] * window[i * dilation] + bias[c])
    carry' = window[1 ..]                        the last L positions, in x's dtype

with the rounding of the torch path: the carry is rounded to x's dtype before it is used (the
torch path concatenates in x's dtype), the sum is taken in fp32 and rounded to x's dtype, and the
SiLU is applied to that rounded value in fp32 and rounded again.

Both state layouts: channels-first (B, C, L) and channels-last (B, L, C...), as onnxruntime's
``channels_last`` attribute and onnxgen's builder write it; channels are independent, so the grid
is (batch rows, channel blocks) and nothing is reduced across programs.

A prompt (``_causal_conv_prompt_kernel``) adds a grid axis of position blocks: position t reads
the padded input [carry, x] at t + i * dilation for tap i, so positions are independent too; the
programs of the first position block also write the new carry (the padded input's last L
positions, or with a last row per batch entry the L positions that end there: a padded
prompt's padding never enters the carry). The taps are summed in the step kernel's order (the
newest first, then the carried ones from the oldest), so each position's output equals what T
steps of the step kernel give.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from onnxgen import options
from onnxgen.runtime.gpu.launch import COMPILE_OPTIONS, KERNEL_DTYPES, LAUNCHES, pdl_launch
from onnxgen.runtime.gpu.pdl import wait_for_previous

_ACTIVATIONS = {"none": False, "silu": True, "swish": True}  # -> apply SiLU
BLOCK_C = 128


@triton.jit
def _causal_conv_step_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    past_ptr,
    present_ptr,
    y_ptr,
    channels,
    x_row_stride,
    x_channel_stride,
    state_channel_stride,
    state_position_stride,
    carry,
    dilation,
    KERNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PAST: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (launch.pdl_launch)
):
    wait_for_previous(PDL)
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < channels
    act_ty = y_ptr.dtype.element_ty  # x's dtype: the carry, y and the new carry's
    state = b.to(tl.int64) * channels * carry + c * state_channel_stride  # (b, c, position 0)
    x = tl.load(x_ptr + b * x_row_stride + c * x_channel_stride, mask=ok, other=0.0).to(act_ty)
    acc = tl.load(w_ptr + c * KERNEL + (KERNEL - 1), mask=ok, other=0.0).to(tl.float32) * x.to(tl.float32)
    if HAS_PAST:
        for i in tl.static_range(KERNEL - 1):  # tap i reads carried position i * dilation < carry
            tap = tl.load(past_ptr + state + i * dilation * state_position_stride, mask=ok, other=0.0)
            w = tl.load(w_ptr + c * KERNEL + i, mask=ok, other=0.0).to(tl.float32)
            acc += w * tap.to(act_ty).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=ok, other=0.0).to(tl.float32)
    y = acc.to(act_ty)
    if SILU:
        yf = y.to(tl.float32)
        y = (yf / (1.0 + tl.exp(-yf))).to(act_ty)
    tl.store(y_ptr + b * channels + c, y, mask=ok)
    # the carry shifts by one: position j takes position j + 1, the last takes x
    for j in range(carry - 1):
        if HAS_PAST:
            kept = tl.load(past_ptr + state + (j + 1) * state_position_stride, mask=ok, other=0.0).to(act_ty)
        else:
            kept = tl.zeros((BLOCK,), act_ty)
        tl.store(present_ptr + state + j * state_position_stride, kept, mask=ok)
    tl.store(present_ptr + state + (carry - 1) * state_position_stride, x, mask=ok)


@triton.jit
def _causal_conv_prompt_kernel(
    x_ptr, w_ptr, bias_ptr, past_ptr, present_ptr, y_ptr, ends_ptr, channels, length, x_batch_stride,
    x_position_stride, x_channel_stride, y_batch_stride, y_position_stride, y_channel_stride, state_channel_stride,
    state_position_stride, carry, dilation, ends_stride, KERNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_PAST: tl.constexpr, HAS_END: tl.constexpr, SILU: tl.constexpr, BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = c < channels
    inside = (t < length)[:, None] & ok[None, :]
    act_ty = y_ptr.dtype.element_ty
    state = b.to(tl.int64) * channels * carry + c * state_channel_stride  # (b, c, position 0)
    x_row = x_ptr + b.to(tl.int64) * x_batch_stride
    # tap KERNEL - 1 reads position t of x itself
    x = tl.load(x_row + t[:, None] * x_position_stride + c[None, :] * x_channel_stride, mask=inside, other=0.0)
    w = tl.load(w_ptr + c * KERNEL + (KERNEL - 1), mask=ok, other=0.0).to(tl.float32)
    acc = w[None, :] * x.to(act_ty).to(tl.float32)
    for i in tl.static_range(KERNEL - 1):  # tap i reads padded position t + i * dilation: x's t - back
        back = carry - i * dilation
        src = t - back  # < 0: carried position carry + src
        in_x = src >= 0
        tap = tl.load(x_row + src[:, None] * x_position_stride + c[None, :] * x_channel_stride,
                      mask=inside & in_x[:, None], other=0.0).to(act_ty)  # fmt: skip
        if HAS_PAST:
            kept = tl.load(past_ptr + state[None, :] + (carry + src)[:, None] * state_position_stride,
                           mask=inside & (src < 0)[:, None], other=0.0).to(act_ty)  # fmt: skip
            tap = tl.where(in_x[:, None], tap, kept)
        w = tl.load(w_ptr + c * KERNEL + i, mask=ok, other=0.0).to(tl.float32)
        acc += w[None, :] * tap.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=ok, other=0.0).to(tl.float32)[None, :]
    y = acc.to(act_ty)
    if SILU:
        yf = y.to(tl.float32)
        y = (yf / (1.0 + tl.exp(-yf))).to(act_ty)
    y_at = y_ptr + b.to(tl.int64) * y_batch_stride + t[:, None] * y_position_stride + c[None, :] * y_channel_stride
    tl.store(y_at, y, mask=inside)
    if tl.program_id(2) == 0:
        # the new carry: the carry positions that end after x's position end - 1 (the last real row
        # with HAS_END, else the last), i.e. x's end - carry + j
        end = length
        if HAS_END:
            end = tl.minimum(tl.maximum(tl.load(ends_ptr + b * ends_stride) + 1, 0), length)
        for j in range(carry):
            pos = c * 0 + (end - carry + j)  # per channel, so that the masks are vectors
            fresh = tl.load(x_row + pos * x_position_stride + c * x_channel_stride, mask=ok & (pos >= 0), other=0.0)
            value = fresh.to(act_ty)
            if HAS_PAST:
                carried = tl.load(past_ptr + state + (carry + pos) * state_position_stride, mask=ok & (pos < 0),
                                  other=0.0).to(act_ty)  # fmt: skip
                value = tl.where(pos >= 0, value, carried)
            tl.store(present_ptr + state + j * state_position_stride, value, mask=ok)


PROMPT_BLOCK_C = 64  # channels per program of a prompt (a guess for the H200, not measured yet)
PROMPT_BLOCK_T = 16  # positions per program of a prompt


def causal_conv_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    past_state: torch.Tensor | None,
    *,
    activation: str,
    dilation: int,
    channels_last: bool,
    last_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(y, present) for T >= 1 positions without a state window, shaped and typed as the torch path
    returns them: channels-first x (B, C, T) and state (B, C, L); channels-last x (B, T, C...) and
    state (B, L, C...), the channel axes flattened to C. ``last_row`` (int64 [1] or [B], prompts
    only): the present carry is the one after that position of each batch entry. None where the
    kernels do not serve these inputs (the caller runs the torch path, which also reports malformed
    ones)."""
    if activation not in _ACTIVATIONS or dilation < 1 or x.dim() < 3 or (not channels_last and x.dim() != 3):
        return None
    if channels_last:
        batch, length, channel_axes = x.shape[0], x.shape[1], tuple(x.shape[2:])
        channels = math.prod(channel_axes)
    else:
        batch, channels, length = x.shape
        channel_axes = (channels,)
    if length < 1 or batch == 0 or channels == 0 or weight.dim() != 3:
        return None
    kernel = weight.shape[-1]
    carry = (kernel - 1) * dilation
    if kernel < 2 or tuple(weight.shape) != (channels, 1, kernel):
        return None
    if bias is not None and tuple(bias.shape) != (channels,):
        return None
    state_shape = (batch, carry, *channel_axes) if channels_last else (batch, channels, carry)
    if past_state is not None and tuple(past_state.shape) != state_shape:
        return None
    tensors = [t for t in (x, weight, bias, past_state) if t is not None]
    if any(t.dtype not in KERNEL_DTYPES or t.device != x.device for t in tensors):
        return None
    if length > 1 and not options.current().conv_prompt:
        return None

    past = past_state.contiguous() if past_state is not None else None
    present = torch.empty(state_shape, dtype=x.dtype, device=x.device)
    y = torch.empty(
        (batch, length, *channel_axes) if channels_last else (batch, channels, length), dtype=x.dtype, device=x.device
    )
    # strides of the contiguous state's (channel, position) axes
    state_strides = (1, channels) if channels_last else (carry, 1)
    if length > 1:
        if last_row is not None and last_row.device != x.device:
            return None
        return _prompt(x, weight, bias, past, present, y, channels_last, batch, length, channels, carry, dilation,
                       state_strides, activation, last_row)  # fmt: skip
    x2 = x.reshape(batch, channels)  # a view where x's channels are evenly strided
    LAUNCHES["causal_conv_update"] += 1
    _causal_conv_step_kernel[(batch, triton.cdiv(channels, BLOCK_C))](
        x2,
        weight.contiguous(),
        bias.contiguous() if bias is not None else x2,
        past if past is not None else present,
        present,
        y,
        channels,
        x2.stride(0),
        x2.stride(1),
        *state_strides,
        carry,
        dilation,
        KERNEL=kernel,
        HAS_BIAS=bias is not None,
        HAS_PAST=past is not None,
        SILU=_ACTIVATIONS[activation],
        BLOCK=BLOCK_C,
        **pdl_launch(x, present, y),
    )
    return y, present


def _prompt(x, weight, bias, past, present, y, channels_last, batch, length, channels, carry, dilation, state_strides,
            activation, last_row):  # fmt: skip
    """causal_conv_update's launch for a prompt of ``length`` > 1 positions."""
    # x as (B, T, C) with its own strides (a view: reshape copies only where the channel axes do not
    # flatten evenly); y contiguous in x's layout
    if channels_last:
        x3 = x.reshape(batch, length, channels)
        x_strides = (x3.stride(0), x3.stride(1), x3.stride(2))
        y_strides = (length * channels, channels, 1)
    else:
        x3 = x
        x_strides = (x.stride(0), x.stride(2), x.stride(1))
        y_strides = (channels * length, 1, length)
    kernel = weight.shape[-1]
    LAUNCHES["causal_conv_prompt"] += 1
    grid = (batch, triton.cdiv(channels, PROMPT_BLOCK_C), triton.cdiv(length, PROMPT_BLOCK_T))
    _causal_conv_prompt_kernel[grid](
        x3, weight.contiguous(), bias.contiguous() if bias is not None else x3, past if past is not None else present,
        present, y, last_row if last_row is not None else x3, channels, length, *x_strides, *y_strides,
        *state_strides, carry, dilation, 1 if last_row is not None and last_row.numel() > 1 else 0, KERNEL=kernel,
        HAS_BIAS=bias is not None, HAS_PAST=past is not None, HAS_END=last_row is not None,
        SILU=_ACTIVATIONS[activation], BLOCK=PROMPT_BLOCK_C, BLOCK_T=PROMPT_BLOCK_T, **COMPILE_OPTIONS,
    )  # fmt: skip
    return y, present
