"""Quantized weights as float32 arrays, in numpy: what the fp32 reference graph (fp32_reference.py)
stores in place of a quantized op's codes.

Written from the operator specifications (com.microsoft MatMulNBits and GatherBlockQuantized,
default-domain DequantizeLinear), not shared with the op implementations in runtime/ops: a
reference that reused their code would share their bugs with the path it is meant to check. The
tests hold these functions to onnxruntime's results on the same tensors.

Every function computes in float32 with the codes and zero points as exact small integers, so a
weight is ``(code - zero_point) * scale`` rounded once, as the specifications define it.
"""

from __future__ import annotations

import numpy as np

# float32 elements per dequantization chunk: bounds the temporaries of an embedding-sized matrix
_CHUNK_ELEMENTS = 1 << 24


class DequantizeError(ValueError):
    """Tensors that do not fit the quantized layout their op declares (a shape, a bit width)."""


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [..., n] -> uint8 [..., n * 8 / bits]: the codes of each byte, lowest-order bits first."""
    if bits == 8:
        return packed
    if bits not in (2, 4):
        raise DequantizeError(f"bits={bits} is not supported (2, 4 or 8)")
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    codes = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))


def nbits_weight(
    b: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    *,
    n: int,
    k: int,
    bits: int,
    block_size: int,
) -> np.ndarray:
    """MatMulNBits' weight as float32 [N, K] (the product is A @ W^T).

    ``b``: uint8 codes, N rows of ceil(K / block_size) blocks of block_size * bits / 8 bytes.
    ``scales``: N * n_blocks floats. ``zero_points``: absent (the default 2^(bits-1)), uint8 packed
    like ``b`` with each row padded to whole bytes, or N * n_blocks floats of the scales' type."""
    n_blocks = -(-k // block_size)
    if b.dtype != np.uint8 or b.size != n * n_blocks * block_size * bits // 8:
        raise DequantizeError(
            f"B holds {b.size} {b.dtype} values; N={n}, K={k}, bits={bits}, block_size={block_size} need "
            f"{n * n_blocks * block_size * bits // 8} uint8"
        )
    if scales.size != n * n_blocks:
        raise DequantizeError(f"scales hold {scales.size} values; N * blocks = {n * n_blocks}")
    packed = b.reshape(n, -1)
    scale = scales.reshape(n, n_blocks).astype(np.float32)
    zero: np.ndarray | None = None
    if zero_points is not None:
        zero = zero_points.reshape(n, -1)
        if zero.dtype != np.uint8 and zero.shape[1] != n_blocks:
            raise DequantizeError(f"float zero points hold {zero_points.size} values; N * blocks = {n * n_blocks}")
    out = np.empty((n, k), dtype=np.float32)
    rows = max(1, _CHUNK_ELEMENTS // (n_blocks * block_size))
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        codes = unpack_codes(packed[lo:hi], bits).astype(np.float32).reshape(hi - lo, n_blocks, block_size)
        if zero is None:
            zeros = np.full((hi - lo, n_blocks), float(1 << (bits - 1)), dtype=np.float32)
        elif zero.dtype == np.uint8:
            zeros = unpack_codes(zero[lo:hi], bits)[:, :n_blocks].astype(np.float32)
        else:
            zeros = zero[lo:hi].astype(np.float32)
        weight = (codes - zeros[:, :, None]) * scale[lo:hi, :, None]
        out[lo:hi] = weight.reshape(hi - lo, -1)[:, :k]
    return out


def gather_table(
    data: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    *,
    bits: int,
    block_size: int,
    quantize_axis: int,
) -> np.ndarray:
    """GatherBlockQuantized's whole table as float32, for gather_axis 0 over a 2-D table quantized in
    blocks along its last axis (the embedding layout): uint8 ``data`` [rows, cols * bits / 8] packed
    lowest bits first, ``scales`` [rows, cols / block_size], ``zero_points`` absent (2^(bits-1)),
    uint8 packed like the data, or floats shaped like the scales."""
    if data.ndim != 2 or quantize_axis not in (1, -1):
        raise DequantizeError(
            f"only a 2-D table quantized along its last axis is supported (data rank {data.ndim}, "
            f"quantize_axis {quantize_axis})"
        )
    if data.dtype != np.uint8:
        raise DequantizeError(f"data of type {data.dtype} is not supported (uint8 packed codes)")
    rows = data.shape[0]
    cols = data.shape[1] * 8 // bits
    n_blocks = -(-cols // block_size)
    scale = scales.reshape(rows, -1).astype(np.float32)
    if scale.shape[1] != n_blocks:
        raise DequantizeError(f"scales are {list(scales.shape)}; a table of {rows} x {cols} needs {n_blocks} per row")
    out = np.empty((rows, cols), dtype=np.float32)
    step = max(1, _CHUNK_ELEMENTS // cols)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        codes = unpack_codes(data[lo:hi], bits).astype(np.float32)
        if zero_points is None:
            zeros = np.full((hi - lo, n_blocks), float(1 << (bits - 1)), dtype=np.float32)
        elif zero_points.dtype == np.uint8:
            zeros = unpack_codes(zero_points.reshape(rows, -1)[lo:hi], bits)[:, :n_blocks].astype(np.float32)
        else:
            zeros = zero_points.reshape(rows, -1)[lo:hi].astype(np.float32)
        per_element = np.repeat(np.arange(n_blocks), block_size)[:cols]
        out[lo:hi] = (codes - zeros[:, per_element]) * scale[lo:hi][:, per_element]
    return out


def dequantize_linear(
    x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, *, axis: int, block_size: int
) -> np.ndarray:
    """DequantizeLinear as float32: ``(x - zero_point) * scale`` per tensor (scalar scale), per axis
    (1-D scale along ``axis``) or blocked (scale of x's rank, ``block_size`` elements per scale
    along ``axis``). ``x`` holds the integer codes unpacked (numpy's int4/uint4 types included)."""
    codes = x.astype(np.float32)
    axis = axis + x.ndim if axis < 0 else axis

    def spread(param: np.ndarray) -> np.ndarray:
        param = param.astype(np.float32)
        if param.size == 1 and param.ndim <= 1:
            return param.reshape(())
        if param.ndim == 1:  # per axis
            if param.shape[0] != x.shape[axis]:
                raise DequantizeError(f"a per-axis parameter of {param.shape[0]} values for axis {axis} of {x.shape}")
            shape = [1] * x.ndim
            shape[axis] = -1
            return param.reshape(shape)
        if block_size <= 0 or param.ndim != x.ndim:
            raise DequantizeError(f"parameter of shape {param.shape} for codes {x.shape} without a block size")
        return np.repeat(param, block_size, axis=axis).take(range(x.shape[axis]), axis=axis)

    zero = spread(zero_point) if zero_point is not None else np.float32(0)
    return ((codes - zero) * spread(scale)).astype(np.float32)
