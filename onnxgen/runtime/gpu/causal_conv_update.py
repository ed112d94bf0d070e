"""CausalConvWithState's one-position step (T == 1) in one Triton kernel: the depthwise causal
convolution over the carried window plus the new input, the optional SiLU, and the shifted carry.

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
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from onnxgen.runtime.gpu.launch import KERNEL_DTYPES, LAUNCHES, pdl_launch
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


def causal_conv_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    past_state: torch.Tensor | None,
    *,
    activation: str,
    dilation: int,
    channels_last: bool,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(y, present) for one position without a state window, shaped and typed as the torch path
    returns them: channels-first x (B, C, 1) and state (B, C, L); channels-last x (B, 1, C...) and
    state (B, L, C...), the channel axes flattened to C. None where the kernel does not serve
    these inputs (the caller runs the torch path, which also reports malformed ones)."""
    if activation not in _ACTIVATIONS or dilation < 1 or x.dim() < 3 or (not channels_last and x.dim() != 3):
        return None
    if channels_last:
        batch, length, channel_axes = x.shape[0], x.shape[1], tuple(x.shape[2:])
        channels = math.prod(channel_axes)
    else:
        batch, channels, length = x.shape
        channel_axes = (channels,)
    if length != 1 or batch == 0 or channels == 0 or weight.dim() != 3:
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

    x2 = x.reshape(batch, channels)  # a view where x's channels are evenly strided
    past = past_state.contiguous() if past_state is not None else None
    present = torch.empty(state_shape, dtype=x.dtype, device=x.device)
    y = torch.empty(
        (batch, 1, *channel_axes) if channels_last else (batch, channels, 1), dtype=x.dtype, device=x.device
    )
    # strides of the contiguous state's (channel, position) axes
    state_strides = (1, channels) if channels_last else (carry, 1)
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
