"""gpu/linear_q4_half.py's fp16 pair kernel against a model of its arithmetic written here in numpy,
and against the fp64 product: on CUDA (the PTX) and, in a child run, through Triton's interpreter
(the Triton-ops form).

The model follows the module's stated rules, not its code: activations scaled by the power of two
that puts the row's largest magnitude in [64, 128] and rounded to fp16; per part of the row, per group of
32 elements and row, two fp16 lanes per half group (words 0-1, then 2-3), each a chain of eight
fused multiply-adds rounded once (computed exactly in float64, then rounded to fp16), the low lane
over elements 8j + m, the high one over 8j + 4 + m; the four lanes added in fp32 as (lo + hi) +
(lo' + hi'); times the block's scale, summed, and the power of two taken off. The kernel writes fp32
here, so the model must match it to fp32 rounding: a different accumulation (16 products per lane,
or fp32 lanes) is off by about 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onnxgen.runtime.gpu.launch import COMPILE_OPTIONS, triton_importable
from tests.interpreted_kernels import KERNEL_DEVICES
from tests.interpreted_runs import IN_THE_PARENT, interpreted_file, runs

pytestmark = pytest.mark.skipif(not triton_importable(), reason="triton is not installed")


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """[N, bytes] -> [N, 2 * bytes] codes in element order (element 2i the low nibble of byte i)."""
    return np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(codes.shape[0], -1).astype(np.float64)


def _lane(values: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """An fp16 lane's chain over the last axis: acc = fp16(v * p), then fp16(v * p + acc), each exact
    before its one rounding (float64 holds these products and sums exactly)."""
    acc = (values[..., 0] * pairs[..., 0]).astype(np.float16)
    for i in range(1, values.shape[-1]):
        acc = (values[..., i] * pairs[..., i] + acc.astype(np.float64)).astype(np.float16)
    return acc.astype(np.float32)


def _part_bounds(n_blocks: int) -> list[tuple[int, int]]:
    """The kernel's parts of a row in blocks: the two highest bits of the count, then the rest."""
    bounds, start, rest = [], 0, n_blocks
    while rest:
        size = 1 << (rest.bit_length() - 1) if len(bounds) < 2 else rest
        bounds.append((start, start + size))
        start, rest = start + size, rest - size
    return bounds


def lane_model(codes, scales, zeros, x, block_size: int) -> np.ndarray:
    """The product of the module doc, fp64 [N], from numpy codes [N, bytes], scales [N, blocks] (fp16),
    integer zero points [N, blocks] and activations x [K] (fp16 or bf16 values, as float32)."""
    n, n_blocks = scales.shape
    values = _nibbles(codes) - np.repeat(zeros.astype(np.float64), block_size, axis=1)  # code - zero
    xf = np.zeros(n_blocks * block_size, np.float32)
    xf[: x.size] = x.astype(np.float32)
    y = np.zeros(n)
    _, e = np.frexp(np.float32(np.abs(xf).max()))  # the row's max |a| = m * 2^e, m in [0.5, 1)
    exponent = max(int(e) - 1 + 127, 7)  # its biased fp32 exponent, held at 7 or more
    for first, last in _part_bounds(n_blocks):
        part = xf[first * block_size : last * block_size]
        a16 = (part * np.float32(2.0 ** (133 - exponent))).astype(np.float16).astype(np.float64)
        v = values[:, first * block_size : last * block_size].reshape(n, -1, 4, 8)  # [N, group, word, nibble]
        a = a16.reshape(-1, 4, 8)
        halves = []
        for words in ((0, 1), (2, 3)):  # eight products per lane: nibbles 0..3 (low), 4..7 (high)
            low = _lane(
                v[:, :, words, :4].reshape(n, -1, 8),
                np.broadcast_to(a[:, words, :4].reshape(-1, 8), (n, a.shape[0], 8)),
            )
            high = _lane(
                v[:, :, words, 4:].reshape(n, -1, 8),
                np.broadcast_to(a[:, words, 4:].reshape(-1, 8), (n, a.shape[0], 8)),
            )
            halves.append(low + high)  # fp32
        group = halves[0] + halves[1]  # [N, groups], fp32
        group_scale = np.repeat(scales[:, first:last].astype(np.float32), block_size // 32, axis=1)
        y += (group * group_scale).astype(np.float64).sum(axis=1) * 2.0 ** (exponent - 133)
    return y


def _launch(
    device: str, codes, scales, zeros, x, n: int, k: int, block_size: int, block_n: int, programs: int = 0
) -> torch.Tensor:
    """_q4h_tile_kernel over one row, fp32 out (PROLOGUE 0, no bias); with ``programs``
    _q4h_stream_kernel on that many programs instead."""
    import triton

    from onnxgen.runtime.gpu import linear_q4_half as H
    from onnxgen.runtime.gpu.linear_q4 import _layout, power_parts

    packed, scale, zp, kind = _layout(codes, scales, zeros, n, k, block_size)
    words = packed.view(torch.int32)
    out = torch.empty(n, device=device, dtype=torch.float32)
    b0, b1, b2 = power_parts(scale.shape[1])
    kernel, grid = (H._q4h_stream_kernel, programs) if programs else (H._q4h_tile_kernel, triton.cdiv(n, block_n))
    kernel[(grid,)](
        x, x, x, x, words, scale, zp, out, out, n, k, scale.shape[1], words.shape[1], zp.shape[1], 0.0, PROLOGUE=0,
        ZERO_KIND=kind, HAS_BIAS=False, QBLOCK=block_size, BLOCK_N=block_n, B0=b0, B1=b1, B2=b2, PDL=False,
        **COMPILE_OPTIONS,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("zero_form", ["none", "packed", "bytes"])
@pytest.mark.parametrize(("k", "block_size"), [(896, 32), (1000, 64), (640, 128)])
@pytest.mark.parametrize("magnitude", [1.0, 5e3, 1e-4])
def test_fp16_pair_kernel_equals_the_lane_model(
    device: str, zero_form: str, k: int, block_size: int, magnitude: float
) -> None:
    """Zero points absent (8), packed two per byte and a byte per block; rows of whole and padded
    blocks in one to three parts; activations of ordinary size, near fp16's largest (a lane of
    unscaled products would overflow) and near its smallest normal."""
    _equals_the_lane_model(device, zero_form, k, block_size, magnitude, torch.float16)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("magnitude", [1.0, 1e6])
def test_fp16_pair_kernel_takes_bf16_activations(device: str, magnitude: float) -> None:
    """bf16 activations, also far past fp16's range: scaled by a power of two into it, exact there."""
    _equals_the_lane_model(device, "packed", 896, 32, magnitude, torch.bfloat16)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(("k", "block_size"), [(896, 32), (1000, 64)])
def test_streaming_form_equals_the_lane_model(device: str, k: int, block_size: int) -> None:
    """_q4h_stream_kernel (option q4_stream) on 2 programs over 3 row blocks of 16 (one program
    takes two, the other one, each loading past the last row while it sums its last block): the
    lane model's values, rows of one to three parts."""
    _equals_the_lane_model(device, "packed", k, block_size, 1.0, torch.float16, programs=2)


def _equals_the_lane_model(
    device: str, zero_form: str, k: int, block_size: int, magnitude: float, dtype, programs: int = 0
) -> None:
    gen = torch.Generator().manual_seed(7)
    n, n_blocks = 40, -(-k // block_size)
    codes = torch.randint(0, 256, (n, n_blocks * block_size // 2), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, n_blocks, generator=gen) * 0.02 + 0.002).half()
    zero_values = torch.randint(0, 16, (n, n_blocks), generator=gen)
    if zero_form == "none":
        zeros, zero_values = None, torch.full((n, n_blocks), 8)
    elif zero_form == "bytes":
        zeros = zero_values.to(torch.int8)
    else:  # two per byte, rows padded to whole bytes
        padded = torch.nn.functional.pad(zero_values, (0, n_blocks % 2))
        zeros = (padded[:, 0::2] | (padded[:, 1::2] << 4)).to(torch.uint8)
    x = (torch.randn(k, generator=gen) * magnitude).to(dtype)
    assert torch.isfinite(x).all()
    x_values = x.float().numpy()  # exact for either dtype
    model = lane_model(codes.numpy(), scales.numpy(), zero_values.numpy(), x_values, block_size)
    to = dict(device=device)
    got = _launch(device, codes.to(**to), scales.to(**to), None if zeros is None else zeros.to(**to), x.to(**to), n,
                  k, block_size, 16, programs).double().cpu().numpy()  # fmt: skip
    top = np.abs(model).max()
    assert np.abs(got - model).max() <= 2e-6 * top, np.abs(got - model).max() / top
    # and the model is the product to fp16 accuracy (fp64 weights (code - zero) * scale)
    weights = (_nibbles(codes.numpy())[:, :k] - np.repeat(zero_values.numpy(), block_size, axis=1)[:, :k]) * np.repeat(
        scales.numpy().astype(np.float64), block_size, axis=1
    )[:, :k]
    exact = weights @ x_values.astype(np.float64)
    assert np.abs(model - exact).max() <= 1e-3 * np.abs(exact).max()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize(
    ("setting", "dtype", "kernel"),
    [("auto", torch.float16, "half"), ("auto", torch.bfloat16, "half"), ("off", torch.float16, "words"),
     ("auto", torch.float32, "words")],
)  # fmt: skip
def test_the_default_puts_wide_products_on_the_pair_kernel(device: str, setting: str, dtype, kernel: str) -> None:
    """linear_row_q4 as the runtime calls it, with no configuration forced: a wide product (4,096 rows)
    of fp16 or bf16 activations takes the pair kernel under q4_half=auto (its table), the word
    kernel under off and for fp32 activations, which the pair kernel would round; the result is the
    product either way."""
    from onnxgen import options
    from onnxgen.runtime.gpu.launch import LAUNCHES
    from onnxgen.runtime.gpu.linear_q4 import linear_row_q4

    gen = torch.Generator().manual_seed(3)
    n, k, block_size = 4096, 64, 32
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // block_size, generator=gen) * 0.02 + 0.002).half()
    zeros = torch.randint(0, 256, (n, 1), generator=gen, dtype=torch.uint8)  # two blocks' zero points per byte
    x = torch.randn(k, generator=gen).to(dtype)
    before = dict(LAUNCHES)
    with options.override(q4_half=setting):
        got = linear_row_q4(x.to(device), codes.to(device), scales.to(device), zeros.to(device), n=n, k=k,
                            block_size=block_size).double().cpu()  # fmt: skip
    label = f"linear_row_q4_{kernel}"
    other = "linear_row_q4_words" if kernel == "half" else "linear_row_q4_half"
    assert LAUNCHES[label] - before.get(label, 0) == 1 and LAUNCHES[other] == before.get(other, 0)
    nib = _nibbles(codes.numpy()) - np.repeat(_nibbles(zeros.numpy()), block_size, axis=1)
    weights = nib * np.repeat(scales.numpy().astype(np.float64), block_size, axis=1)
    exact = torch.from_numpy(weights @ x.double().numpy())
    ulps = 2.0 * torch.finfo(dtype).eps if dtype == torch.bfloat16 else 2e-3  # the output's rounding (bf16: 2^-7)
    assert (got - exact).abs().max() <= ulps * exact.abs().max()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("prologue", ["rms", "skip_rms", "silu_mul"])
def test_prologues_over_rows_of_three_parts(device: str, prologue: str) -> None:
    """The pair kernel behind each prologue on rows of 896 elements (28 blocks: parts of 16, 8 and 4,
    whose sums of squares meet for the norm), 72 rows in blocks of 16: the fp64 product of the
    prologue's activations; the streaming form (gemv_q4's fifth value: 3 programs on the interpreter,
    one per SM on a GPU, with the rows there grown past one block per SM) gives the tile form's bits."""
    from onnxgen import options
    from onnxgen.runtime.gpu.launch import LAUNCHES
    from onnxgen.runtime.gpu.linear_q4 import linear_row_q4

    gen = torch.Generator().manual_seed(11)
    per_sm, n, k, block_size = 3, 72, 896, 32
    if device == "cuda":  # fewer programs than row blocks, or the tile form runs
        per_sm, n = 1, 16 * torch.cuda.get_device_properties(0).multi_processor_count + 72
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // block_size, generator=gen) * 0.02 + 0.002).half()
    zeros = torch.randint(0, 256, (n, k // block_size // 2), generator=gen, dtype=torch.uint8)
    x, x2 = (torch.randn(k, generator=gen).half() for _ in range(2))
    gamma = (torch.rand(k, generator=gen) + 0.5).half()
    outs = []
    for programs in (0, per_sm):
        total = torch.empty(k, dtype=torch.float16, device=device)
        before = LAUNCHES["linear_row_q4_half_stream"]
        with options.override(q4_half="all", gemv_q4=(16, 1024, 2, 2, programs), q4_norm_apart=0):
            y = linear_row_q4(x.to(device), codes.to(device), scales.to(device), zeros.to(device), n=n, k=k,
                              block_size=block_size, prologue=prologue, x2=x2.to(device), gamma=gamma.to(device),
                              eps=1e-6, sum_out=total)  # fmt: skip
        assert LAUNCHES["linear_row_q4_half_stream"] - before == (1 if programs else 0)
        outs.append(y.cpu())
    assert torch.equal(outs[0], outs[1])
    xs, x2s, gs = (t.double().numpy() for t in (x, x2, gamma))
    if prologue == "silu_mul":
        a = xs / (1 + np.exp(-xs)) * x2s
    else:
        h = xs + x2s if prologue == "skip_rms" else xs
        a = h / np.sqrt(np.mean(h * h) + 1e-6) * gs
    nib = _nibbles(codes.numpy()) - np.repeat(_nibbles(zeros.numpy()), block_size, axis=1)
    exact = (nib * np.repeat(scales.numpy().astype(np.float64), block_size, axis=1)) @ a
    assert np.abs(outs[0].double().numpy() - exact).max() <= 2e-3 * np.abs(exact).max()


@IN_THE_PARENT
@runs(KERNELS := interpreted_file(__file__, "through_the_triton_interpreter"))
def test_fp16_pair_kernel_through_the_triton_interpreter() -> None:
    KERNELS.launches()
