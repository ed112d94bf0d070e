"""Convolutions: Conv, ConvTranspose, ConvInteger, QLinearConv, DeformConv, Col2Im.

ONNX pads may be asymmetric and come from ``auto_pad``; torch's conv takes one symmetric pad per
axis, so we pad explicitly with ``F.pad`` first and run the torch conv unpadded.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.common import ints
from onnxgen.runtime.ops.registry import implements

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def window_pads(
    ctx: NodeContext,
    in_sizes: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int],
    dilations: Sequence[int],
) -> list[int]:
    """ONNX pads ``[b_1..b_n, e_1..e_n]`` from ``pads`` / ``auto_pad`` for a sliding-window op."""
    n = len(in_sizes)
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begins, ends = [], []
        for size, k, s, d in zip(in_sizes, kernel, strides, dilations):
            out = -(-size // s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
            small, large = total // 2, total - total // 2
            # SAME_UPPER puts the odd extra pad at the end, SAME_LOWER at the beginning
            begins.append(small if auto_pad == "SAME_UPPER" else large)
            ends.append(large if auto_pad == "SAME_UPPER" else small)
        return begins + ends
    if auto_pad == "VALID":
        return [0] * (2 * n)
    pads = list(ctx.attr("pads", [0] * (2 * n)))
    if len(pads) != 2 * n:
        raise ctx.fail(f"pads has {len(pads)} values, expected {2 * n}")
    return pads


def torch_pad_arg(pads: Sequence[int]) -> list[int]:
    """ONNX ``[b_1..b_n, e_1..e_n]`` as F.pad's ``(b_n, e_n, ..., b_1, e_1)`` (last axis first)."""
    n = len(pads) // 2
    arg: list[int] = []
    for axis in reversed(range(n)):
        arg += [pads[axis], pads[axis + n]]
    return arg


def _spatial_attrs(ctx: NodeContext, n: int) -> tuple[list[int], list[int]]:
    strides = list(ctx.attr("strides", [1] * n))
    dilations = list(ctx.attr("dilations", [1] * n))
    return strides, dilations


def _conv_nd(
    ctx: NodeContext,
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    pad_value: float = 0.0,
) -> torch.Tensor:
    """Conv over any 1-3 spatial dims with ONNX padding rules."""
    n = x.dim() - 2
    if n not in _CONV:
        raise ctx.fail(f"{n} spatial dims are not supported (1-3)")
    kernel_shape = list(ctx.attr("kernel_shape", w.shape[2:]))
    strides, dilations = _spatial_attrs(ctx, n)
    pads = window_pads(ctx, x.shape[2:], kernel_shape, strides, dilations)
    if any(pads):
        x = F.pad(x, torch_pad_arg(pads), value=pad_value)
    return _CONV[n](x, w, bias, stride=strides, dilation=dilations, groups=ctx.attr("group", 1))


@implements("Conv", since=1)
def conv(ctx: NodeContext, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return _conv_nd(ctx, x, w, b)


@implements("ConvTranspose", since=1)
def conv_transpose(ctx: NodeContext, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    n = x.dim() - 2
    if n not in _CONV_T:
        raise ctx.fail(f"{n} spatial dims are not supported (1-3)")
    group = ctx.attr("group", 1)
    kernel_shape = list(ctx.attr("kernel_shape", w.shape[2:]))
    strides, dilations = _spatial_attrs(ctx, n)
    output_padding = list(ctx.attr("output_padding", [0] * n))
    in_sizes = list(x.shape[2:])
    # length of the unpadded, uncropped transposed conv along each axis
    full = [(i - 1) * s + (k - 1) * d + 1 for i, s, k, d in zip(in_sizes, strides, kernel_shape, dilations)]
    auto_pad = ctx.attr("auto_pad", "NOTSET")
    output_shape = ctx.attr("output_shape")
    if output_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if output_shape is not None:
            target = list(output_shape)[-n:]
        else:
            target = [i * s for i, s in zip(in_sizes, strides)]
        begins, ends = [], []
        for f, op, t in zip(full, output_padding, target):
            total = f + op - t
            small, large = total // 2, total - total // 2
            # SAME_UPPER crops the odd extra element at the end; otherwise at the beginning
            begins.append(small if auto_pad == "SAME_UPPER" else large)
            ends.append(large if auto_pad == "SAME_UPPER" else small)
    elif auto_pad == "VALID":
        begins, ends = [0] * n, [0] * n
    else:
        pads = list(ctx.attr("pads", [0] * (2 * n)))
        begins, ends = pads[:n], pads[n:]
    y = _CONV_T[n](x, w, None, stride=strides, dilation=dilations, groups=group)
    # crop (or extend with zeros) each axis to [begin, full + output_padding - end)
    crop: list[int] = []
    for axis in reversed(range(n)):
        crop += [-begins[axis], output_padding[axis] - ends[axis]]
    if any(crop):
        y = F.pad(y, crop)
    if b is not None:
        y = y + b.reshape([1, -1] + [1] * n)
    return y


def _zero_point(zp: torch.Tensor | None, like: torch.Tensor, channel_axis: int) -> torch.Tensor | int:
    """A scalar or per-channel zero point, shaped to broadcast against ``like``."""
    if zp is None:
        return 0
    if zp.numel() == 1:
        return zp.reshape(()).to(like.dtype)
    shape = [1] * like.dim()
    shape[channel_axis] = -1
    return zp.reshape(shape).to(like.dtype)


def _integer_conv(
    ctx: NodeContext,
    x: torch.Tensor,
    x_zp: torch.Tensor | None,
    w: torch.Tensor,
    w_zp: torch.Tensor | None,
) -> torch.Tensor:
    """Exact integer accumulation: float64 holds every int32 sum of 8-bit products exactly."""
    xf = x.to(torch.float64) - _zero_point(x_zp, x.to(torch.float64), 1)
    wf = w.to(torch.float64) - _zero_point(w_zp, w.to(torch.float64), 0)
    # the zero point maps to 0, so padding the shifted input with 0 pads with the zero point
    return _conv_nd(ctx, xf, wf, None)


@implements("ConvInteger", since=10)
def conv_integer(
    ctx: NodeContext,
    x: torch.Tensor,
    w: torch.Tensor,
    x_zp: torch.Tensor | None = None,
    w_zp: torch.Tensor | None = None,
) -> torch.Tensor:
    return _integer_conv(ctx, x, x_zp, w, w_zp).to(torch.int32)


@implements("QLinearConv", since=10)
def qlinear_conv(
    ctx: NodeContext,
    x: torch.Tensor,
    x_scale: torch.Tensor,
    x_zp: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    w_zp: torch.Tensor | None,
    y_scale: torch.Tensor,
    y_zp: torch.Tensor | None,
    b: torch.Tensor | None = None,
) -> torch.Tensor:
    acc = _integer_conv(ctx, x, x_zp, w, w_zp)
    n = x.dim() - 2
    if b is not None:
        acc = acc + b.to(torch.float64).reshape([1, -1] + [1] * n)
    # requantize in float32 as the reference does: acc * (x_scale * w_scale / y_scale)
    ws = w_scale.to(torch.float32)
    if ws.numel() > 1:
        ws = ws.reshape([1, -1] + [1] * n)
    scale = x_scale.to(torch.float32).reshape(()) * ws / y_scale.to(torch.float32).reshape(())
    y = torch.round(acc.to(torch.float32) * scale)
    out_dtype = y_zp.dtype if y_zp is not None else x.dtype
    if y_zp is not None:
        y = y + y_zp.to(torch.float32).reshape(())
    info = torch.iinfo(out_dtype)
    return y.clamp(info.min, info.max).to(out_dtype)


def _bilinear_zero_outside(img: torch.Tensor, py: torch.Tensor, px: torch.Tensor) -> torch.Tensor:
    """Sample ``img`` [B, C, H, W] at float points ``py``/``px`` [B, P] (0 outside): [B, C, P]."""
    height, width = img.shape[-2:]
    flat = img.reshape(img.shape[0], img.shape[1], height * width)
    y0 = torch.floor(py)
    x0 = torch.floor(px)
    out = torch.zeros(img.shape[0], img.shape[1], py.shape[1], dtype=img.dtype, device=img.device)
    for dy in (0, 1):
        for dx in (0, 1):
            yi = y0 + dy
            xi = x0 + dx
            wy = 1 - (py - yi).abs()
            wx = 1 - (px - xi).abs()
            valid = (yi >= 0) & (yi <= height - 1) & (xi >= 0) & (xi <= width - 1)
            weight = torch.where(valid, wy * wx, torch.zeros_like(wy))
            index = (yi.clamp(0, height - 1) * width + xi.clamp(0, width - 1)).long()
            gathered = torch.gather(flat, 2, index.unsqueeze(1).expand(-1, img.shape[1], -1))
            out = out + gathered * weight.unsqueeze(1)
    return out


@implements("DeformConv", since=19)
def deform_conv(
    ctx: NodeContext,
    x: torch.Tensor,
    w: torch.Tensor,
    offset: torch.Tensor,
    b: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    if x.dim() != 4:
        raise ctx.fail("only 2-D DeformConv is supported")
    batch, channels, height, width = x.shape
    out_ch = w.shape[0]
    kh, kw = list(ctx.attr("kernel_shape", w.shape[2:]))
    strides, dilations = _spatial_attrs(ctx, 2)
    pads = list(ctx.attr("pads", [0] * 4))
    group = ctx.attr("group", 1)
    offset_group = ctx.attr("offset_group", 1)
    out_h, out_w = offset.shape[2], offset.shape[3]
    kk = kh * kw
    # base sampling positions per kernel tap and output position: [kk, out_h * out_w]
    ky, kx = torch.meshgrid(
        torch.arange(kh, device=x.device, dtype=x.dtype),
        torch.arange(kw, device=x.device, dtype=x.dtype),
        indexing="ij",
    )
    oy, ox = torch.meshgrid(
        torch.arange(out_h, device=x.device, dtype=x.dtype),
        torch.arange(out_w, device=x.device, dtype=x.dtype),
        indexing="ij",
    )
    base_y = (oy.reshape(1, -1) * strides[0] - pads[0]) + (ky.reshape(-1, 1) * dilations[0])
    base_x = (ox.reshape(1, -1) * strides[1] - pads[1]) + (kx.reshape(-1, 1) * dilations[1])
    # offset: [N, offset_group * kk * 2, oh, ow], (dy, dx) pairs per tap
    off = offset.reshape(batch, offset_group, kk, 2, out_h * out_w)
    py = base_y + off[:, :, :, 0]  # [N, og, kk, P]
    px = base_x + off[:, :, :, 1]
    ch_per_og = channels // offset_group
    cols = []
    for g in range(offset_group):
        img = x[:, g * ch_per_og : (g + 1) * ch_per_og]
        sampled = _bilinear_zero_outside(img, py[:, g].reshape(batch, -1), px[:, g].reshape(batch, -1))
        cols.append(sampled.reshape(batch, ch_per_og, kk, out_h * out_w))
    col = torch.cat(cols, dim=1)  # [N, C, kk, P]
    if mask is not None:
        m = mask.reshape(batch, offset_group, 1, kk, out_h * out_w).expand(-1, -1, ch_per_og, -1, -1)
        col = col * m.reshape(batch, channels, kk, out_h * out_w)
    # grouped matmul: weights [out_ch, C/group, kk]
    cin_g = channels // group
    cout_g = out_ch // group
    col = col.reshape(batch, group, cin_g * kk, out_h * out_w)
    wg = w.reshape(group, cout_g, cin_g * kk)
    y = torch.einsum("gok,bgkp->bgop", wg, col).reshape(batch, out_ch, out_h, out_w)
    if b is not None:
        y = y + b.reshape(1, -1, 1, 1)
    return y


@implements("Col2Im", since=18, host_inputs=(1, 2))
def col2im(ctx: NodeContext, x: torch.Tensor, image_shape: torch.Tensor, block_shape: torch.Tensor) -> torch.Tensor:
    image = ints(image_shape)
    block = ints(block_shape)
    n = len(image)
    strides, dilations = _spatial_attrs(ctx, n)
    pads = list(ctx.attr("pads", [0] * (2 * n)))
    padded = [image[i] + pads[i] + pads[i + n] for i in range(n)]
    counts = [(padded[i] - ((block[i] - 1) * dilations[i] + 1)) // strides[i] + 1 for i in range(n)]
    batch = x.shape[0]
    block_size = math.prod(block)
    channels = x.shape[1] // block_size
    if math.prod(counts) != x.shape[2]:
        raise ctx.fail(f"input has {x.shape[2]} blocks, the shapes give {math.prod(counts)}")
    if n <= 2:
        # torch's fold sums each output pixel's contributions in a fixed order (deterministic on CUDA)
        as_2d = (lambda v: [1, *v]) if n == 1 else (lambda v: list(v))
        out = F.fold(x, as_2d(padded), as_2d(block), dilation=as_2d(dilations), stride=as_2d(strides)).reshape(
            [batch, channels] + padded
        )
    else:
        out = _col2im_nd(x, padded, block, counts, strides, dilations)
    crop: list[int] = []
    for axis in reversed(range(n)):
        crop += [-pads[axis], -pads[axis + n]]
    return F.pad(out, crop) if any(crop) else out


def _col2im_nd(
    x: torch.Tensor,
    padded: list[int],
    block: list[int],
    counts: list[int],
    strides: list[int],
    dilations: list[int],
) -> torch.Tensor:
    n = len(padded)
    batch = x.shape[0]
    block_size = math.prod(block)
    channels = x.shape[1] // block_size
    # flat index into the padded image for every (block offset, block position) pair,
    # built by broadcasting over [block_1..block_n, count_1..count_n]
    index = torch.zeros([1] * (2 * n), dtype=torch.int64, device=x.device)
    stride_of_axis = 1
    for axis in reversed(range(n)):
        offs = torch.arange(block[axis], device=x.device) * dilations[axis]
        starts = torch.arange(counts[axis], device=x.device) * strides[axis]
        offs_shape = [1] * (2 * n)
        offs_shape[axis] = -1
        starts_shape = [1] * (2 * n)
        starts_shape[n + axis] = -1
        index = index + (offs.reshape(offs_shape) + starts.reshape(starts_shape)) * stride_of_axis
        stride_of_axis *= padded[axis]
    index = index.reshape(block_size, -1)
    cols = x.reshape(batch, channels, block_size, x.shape[2])
    out = torch.zeros(batch, channels, math.prod(padded), dtype=x.dtype, device=x.device)
    # one block offset at a time: its targets are distinct, so no two atomic adds collide and the
    # sum order is fixed (bit-identical runs on CUDA)
    for offset in range(block_size):
        out.index_add_(2, index[offset], cols[:, :, offset])
    return out.reshape([batch, channels] + padded)
