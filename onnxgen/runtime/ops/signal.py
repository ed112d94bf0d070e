"""Signal processing: DFT (opsets 17 and 20), STFT, MelWeightMatrix.

Signals carry a trailing axis of 1 (real) or 2 (real, imaginary). torch.fft does the transforms;
half precision is computed in fp32 (torch's CPU FFT has no fp16) and cast back.
"""

from __future__ import annotations

import math

import torch

from onnxgen.runtime.dtypes import torch_dtype
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.common import ints, normalize_axis
from onnxgen.runtime.ops.registry import implements


def _as_complex(x: torch.Tensor) -> torch.Tensor:
    """[..., 1|2] real representation -> complex tensor without the trailing axis."""
    work = x if x.dtype in (torch.float32, torch.float64) else x.float()
    if work.shape[-1] == 1:
        return work[..., 0]
    return torch.complex(work[..., 0], work[..., 1])


def _to_real_pair(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.view_as_real(z).to(dtype)


def _dft(
    ctx: NodeContext, x: torch.Tensor, length: int | None, axis: int, inverse: bool, onesided: bool
) -> torch.Tensor:
    rank = x.dim()
    axis = normalize_axis(axis, rank)
    if axis == rank - 1:
        raise ctx.fail("the last axis holds real/imaginary parts and cannot be transformed")
    complex_input = x.shape[-1] == 2
    if inverse and onesided:  # IRFFT: one-sided complex spectrum -> full real signal
        if not complex_input:
            raise ctx.fail("inverse one-sided DFT needs complex input")
        n = length if length is not None else 2 * (x.shape[axis] - 1)
        real = torch.fft.irfft(_as_complex(x), n=n, dim=axis)
        return real.unsqueeze(-1).to(x.dtype)
    n = length if length is not None else x.shape[axis]
    signal = _as_complex(x)
    if inverse:
        return _to_real_pair(torch.fft.ifft(signal, n=n, dim=axis), x.dtype)
    if onesided:
        if signal.is_complex():  # RFFT of a complex signal: the full spectrum, cut in half
            full = torch.fft.fft(signal, n=n, dim=axis)
            return _to_real_pair(full.narrow(axis, 0, n // 2 + 1), x.dtype)
        return _to_real_pair(torch.fft.rfft(signal, n=n, dim=axis), x.dtype)
    return _to_real_pair(torch.fft.fft(signal, n=n, dim=axis), x.dtype)


def _optional_int(value: torch.Tensor | None) -> int | None:
    values = ints(value)
    return values[0] if values else None


@implements("DFT", since=17, host_inputs=(1,))
def dft_17(ctx: NodeContext, x: torch.Tensor, dft_length: torch.Tensor | None = None) -> torch.Tensor:
    axis = int(ctx.attr("axis", 1))
    return _dft(ctx, x, _optional_int(dft_length), axis, bool(ctx.attr("inverse", 0)), bool(ctx.attr("onesided", 0)))


@implements("DFT", since=20, host_inputs=(1, 2))
def dft_20(
    ctx: NodeContext, x: torch.Tensor, dft_length: torch.Tensor | None = None, axis: torch.Tensor | None = None
) -> torch.Tensor:
    ax = _optional_int(axis)
    ax = -2 if ax is None else ax
    return _dft(ctx, x, _optional_int(dft_length), ax, bool(ctx.attr("inverse", 0)), bool(ctx.attr("onesided", 0)))


@implements("STFT", since=17, host_inputs=(1, 3))
def stft(
    ctx: NodeContext,
    signal: torch.Tensor,
    frame_step: torch.Tensor,
    window: torch.Tensor | None = None,
    frame_length: torch.Tensor | None = None,
) -> torch.Tensor:
    step = ints(frame_step)[0]
    length = _optional_int(frame_length)
    if length is None:
        if window is None:
            raise ctx.fail("needs a window or a frame_length")
        length = window.shape[0]
    onesided = bool(ctx.attr("onesided", 1))
    z = _as_complex(signal)  # [B, L]
    frames = z.unfold(-1, length, step)  # [B, frames, length]
    if window is not None:
        frames = frames * window.to(frames.real.dtype if frames.is_complex() else frames.dtype)
    if onesided and not frames.is_complex():
        spectrum = torch.fft.rfft(frames, n=length, dim=-1)
    else:
        spectrum = torch.fft.fft(frames, n=length, dim=-1)
        if onesided:
            spectrum = spectrum[..., : length // 2 + 1]
    return _to_real_pair(spectrum, signal.dtype)


@implements(
    "MelWeightMatrix",
    since=17,
    host_inputs=(0, 1, 2, 3, 4),
    capture="output shape comes from input values read on the host",
)
def mel_weight_matrix(
    ctx: NodeContext,
    num_mel_bins: torch.Tensor,
    dft_length: torch.Tensor,
    sample_rate: torch.Tensor,
    lower_edge_hertz: torch.Tensor,
    upper_edge_hertz: torch.Tensor,
) -> torch.Tensor:
    bins = ints(num_mel_bins)[0]
    n_fft = ints(dft_length)[0]
    rate = ints(sample_rate)[0]
    low = float(lower_edge_hertz.reshape(-1)[0])
    high = float(upper_edge_hertz.reshape(-1)[0])
    spectrogram_bins = n_fft // 2 + 1

    def to_mel(hz: float) -> float:
        return 2595.0 * math.log10(1.0 + hz / 700.0)

    # bins + 2 points evenly spaced on the mel scale (step as the spec's reference takes it),
    # mapped back to Hz and then to FFT bin indices
    low_mel, high_mel = to_mel(low), to_mel(high)
    points = torch.arange(bins + 2, dtype=torch.float64)
    mel = points * ((high_mel - low_mel) / (bins + 2)) + low_mel
    hz = 700.0 * torch.expm1(mel / 2595.0 * math.log(10.0))
    edges = torch.floor((n_fft + 1) * hz / rate).to(torch.int64).tolist()

    out = torch.zeros(spectrogram_bins, bins, dtype=torch.float64)
    for m in range(bins):
        left, center, right = edges[m], edges[m + 1], edges[m + 2]
        if center == left:
            out[center, m] = 1.0
        else:  # rising edge, including the peak
            j = torch.arange(left, center + 1, dtype=torch.float64)
            out[left : center + 1, m] = (j - left) / (center - left)
        if right > center:  # falling edge, from the peak
            j = torch.arange(center, right, dtype=torch.float64)
            out[center:right, m] = (right - j) / (right - center)
    dtype = torch_dtype(int(ctx.attr("output_datatype", 1)))
    return out.to(dtype=dtype, device=ctx.device)
