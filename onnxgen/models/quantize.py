"""4-bit block quantization of linear weights, laid out for com.microsoft::MatMulNBits.

A weight W [N, K] (torch.nn.Linear layout: out x in) is split along K into blocks of
`block_size`; each block gets a float scale and a zero point, and each value a 4-bit code, so
that W[n, k] ~= (code - zero_point) * scale. Two forms of zero point:

- 4-bit (``quantize_4bit``, the default): the range of every block includes 0, which keeps zero
  exactly representable and the zero point an integer in [0, 15], packed two per byte.
- none (``quantize_4bit_symmetric``): symmetric blocks with MatMulNBits' default zero point 8 and
  no zero-point tensor, the form onnxruntime-genai's builder writes by default (and llama.cpp's
  Q4_0): each block's largest-magnitude value is code 0 exactly.
- float (``on_4bit_grid``): a block's range is its own [min, max] and the zero point the float
  -min / scale. A weight that already lies on such a grid in every block (a 4-bit checkpoint
  dequantized, e.g. GGUF Q4_1, whose blocks are min + d * code) is then held exactly, where the
  4-bit form would round it onto another grid. It costs a zero point of the scales' dtype per
  block instead of half a byte.

MatMulNBits layout (bits=4): B [N, n_blocks, block_size/2] uint8 with the lower-k code in the
low nibble; scales [N * n_blocks]; zero_points [N * ceil(n_blocks/2)] uint8, two blocks per
byte, low nibble first, or [N * n_blocks] of the scales' dtype. The same codes also feed a
default-domain DequantizeLinear (opset 21 blocked, UINT4; 4-bit zero points only) for graphs that
must avoid contrib ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_ROWS_PER_CHUNK = 4096  # bounds the temporaries when quantizing an embedding-sized matrix


@dataclass
class Quantized4Bit:
    codes: np.ndarray  # uint8 [N, n_blocks * block_size], values 0..15, K zero-padded to whole blocks
    scales: np.ndarray  # float32 [N, n_blocks]
    zero_points: np.ndarray  # uint8 [N, n_blocks], values 0..15; or float32 (on_4bit_grid)
    k: int  # logical in_features (before padding)
    block_size: int
    symmetric: bool = False  # every zero point is 8 and none is written (quantize_4bit_symmetric)

    @property
    def n(self) -> int:
        return self.codes.shape[0]

    @property
    def n_blocks(self) -> int:
        return self.scales.shape[1]

    def dequantize(self) -> np.ndarray:
        """W as the runtime sees it: [N, K] float32."""
        blocks = self.codes.reshape(self.n, self.n_blocks, self.block_size).astype(np.float32)
        w = (blocks - self.zero_points[:, :, None].astype(np.float32)) * self.scales[:, :, None]
        return w.reshape(self.n, -1)[:, : self.k]

    @property
    def float_zero_points(self) -> bool:
        return self.zero_points.dtype != np.uint8

    def matmulnbits_tensors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(B [N, n_blocks, block/2] uint8, scales [N*n_blocks] float32, zero_points
        [N*ceil(n_blocks/2)] uint8, or [N*n_blocks] float32 where they are float, or empty where
        the blocks are symmetric: the op's default zero point, no tensor)."""
        b = pack_uint4(self.codes).reshape(self.n, self.n_blocks, self.block_size // 2)
        if self.symmetric:
            return b, self.scales.reshape(-1).copy(), np.zeros(0, np.uint8)
        if self.float_zero_points:
            return b, self.scales.reshape(-1).copy(), self.zero_points.reshape(-1).astype(np.float32)
        zp = self.zero_points
        if self.n_blocks % 2:  # pad each row to whole bytes; the pad nibble is never read
            zp = np.concatenate([zp, np.zeros((self.n, 1), np.uint8)], axis=1)
        return b, self.scales.reshape(-1).copy(), pack_uint4(zp).reshape(-1)

    def dequantize_linear_tensors(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Operands of DequantizeLinear(axis=0, block_size) producing W^T [K, N] for MatMul.

        Returns (x packed UINT4 bytes of [K, N], scale [n_blocks, N] float32, zero_point packed UINT4 of
        [n_blocks, N]). Needs K to be a whole number of blocks (no padding rows in x).
        """
        if self.k % self.block_size:
            raise ValueError(f"in_features {self.k} is not a multiple of block size {self.block_size}")
        if self.float_zero_points:
            raise ValueError("DequantizeLinear's UINT4 zero points cannot hold float zero points")
        x = pack_uint4(np.ascontiguousarray(self.codes.T))
        zp = pack_uint4(np.ascontiguousarray(self.zero_points.T))
        return x, np.ascontiguousarray(self.scales.T), zp


def pack_uint4(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes two per byte in row-major order, first element in the low nibble."""
    flat = codes.reshape(-1).astype(np.uint8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return (flat[0::2] & 0x0F) | ((flat[1::2] & 0x0F) << 4)


def _fold(op: np.ufunc, blocks: np.ndarray) -> np.ndarray:
    """op (np.minimum / np.maximum) over the last axis, a power of two long, by halving it: the same
    values as blocks.min/max(axis=-1) (each is one of the inputs), in fewer passes over short rows."""
    while blocks.shape[-1] > 1:
        half = blocks.shape[-1] // 2
        blocks = op(blocks[..., :half], blocks[..., half:])
    return blocks[..., 0]


def _block_grid(weight: np.ndarray, block_size: int) -> tuple[int, int, int]:
    """(N, K, blocks per row) of a 2-D weight quantized in blocks of `block_size` along K (checked)."""
    if weight.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {weight.shape}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    n, k = weight.shape
    return n, k, -(-k // block_size)


def quantize_4bit(weight: np.ndarray, block_size: int = 32) -> Quantized4Bit:
    """Asymmetric 4-bit quantization of W [N, K] along K in blocks of `block_size`."""
    n, k, n_blocks = _block_grid(weight, block_size)
    codes = np.empty((n, n_blocks * block_size), np.uint8)
    scales = np.empty((n, n_blocks), np.float32)
    zero_points = np.empty((n, n_blocks), np.uint8)
    for start in range(0, n, _ROWS_PER_CHUNK):
        rows = slice(start, min(n, start + _ROWS_PER_CHUNK))
        if k % block_size:
            w = np.zeros((rows.stop - rows.start, n_blocks * block_size), np.float32)
            w[:, :k] = weight[rows]
        else:
            w = np.ascontiguousarray(weight[rows], dtype=np.float32)
        blocks = w.reshape(w.shape[0], n_blocks, block_size)
        lo = np.minimum(_fold(np.minimum, blocks), 0.0)
        hi = np.maximum(_fold(np.maximum, blocks), 0.0)
        scale = (hi - lo) / 15.0
        scale = np.where(scale == 0.0, 1.0, scale).astype(np.float32)  # an all-zero block
        zp = np.clip(np.rint(-lo / scale), 0, 15)
        # clip(rint(blocks / scale) + zp, 0, 15) in float32, in place in one temporary
        q = np.divide(blocks, scale[:, :, None])
        np.rint(q, out=q)
        np.add(q, zp[:, :, None], out=q)
        np.clip(q, 0, 15, out=q)
        codes[rows] = q.reshape(w.shape)  # whole numbers in 0..15: the cast is exact
        scales[rows] = scale
        zero_points[rows] = zp
    return Quantized4Bit(codes, scales, zero_points, k, block_size)


def quantize_4bit_symmetric(weight: np.ndarray, block_size: int = 32) -> Quantized4Bit:
    """Symmetric 4-bit quantization of W [N, K] along K in blocks of `block_size`, zero point 8.

    A block's scale is its largest-magnitude value m over -8, so m is code 0 exactly and the codes
    8 + rint(w / scale) cover -8..7 steps (negative scales where m is positive); a value of the
    opposite sign and the same magnitude as m clips to 7 steps, one step short. All-zero blocks
    get scale 1 (every code 8)."""
    n, k, n_blocks = _block_grid(weight, block_size)
    codes = np.empty((n, n_blocks * block_size), np.uint8)
    scales = np.empty((n, n_blocks), np.float32)
    for start in range(0, n, _ROWS_PER_CHUNK):
        rows = slice(start, min(n, start + _ROWS_PER_CHUNK))
        w = np.zeros((rows.stop - rows.start, n_blocks * block_size), np.float32)
        w[:, :k] = weight[rows]
        blocks = w.reshape(w.shape[0], n_blocks, block_size)
        index = np.abs(blocks).argmax(axis=2)[:, :, None]
        scale = np.take_along_axis(blocks, index, axis=2)[:, :, 0] / -8.0
        scale = np.where(scale == 0.0, 1.0, scale).astype(np.float32)
        q = np.divide(blocks, scale[:, :, None])
        np.rint(q, out=q)
        np.clip(q, -8, 7, out=q)
        codes[rows] = (q + 8).reshape(w.shape)  # whole numbers in 0..15: the cast is exact
        scales[rows] = scale
    zero_points = np.full((n, n_blocks), 8, np.uint8)
    return Quantized4Bit(codes, scales, zero_points, k, block_size, symmetric=True)


# a value on its block's grid is within this fraction of a step of a grid point (float rounding
# of the checkpoint's own arithmetic, min + d * code, is far below it)
GRID_TOLERANCE = 1e-3


def on_4bit_grid(weight: np.ndarray, block_size: int = 32) -> Quantized4Bit | None:
    """W [N, K] with float zero points, where every block of it lies on an evenly spaced grid of at
    most 16 values of its own: the step is the block's smallest gap between distinct values, the
    codes count steps from its minimum, and every value is within GRID_TOLERANCE of a step of a
    code no larger than 15. That holds for the blocks of 4-bit checkpoints whether or not they use
    both ends of the code range (GGUF Q4_1: min + d * code; Q4_0: d * (code - 8); Q4_K's 32-value
    sub-blocks: d * sc * code - dmin * m). None where one block does not (the weight was not 4-bit
    in blocks of this size). K must be whole blocks."""
    if weight.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {weight.shape}")
    n, k = weight.shape
    if k % block_size:
        return None
    n_blocks = k // block_size
    codes = np.empty((n, k), np.uint8)
    scales = np.empty((n, n_blocks), np.float32)
    zero_points = np.empty((n, n_blocks), np.float32)
    for start in range(0, n, _ROWS_PER_CHUNK):
        rows = slice(start, min(n, start + _ROWS_PER_CHUNK))
        blocks = weight[rows].astype(np.float32).reshape(-1, n_blocks, block_size)
        lo, hi = blocks.min(axis=2), blocks.max(axis=2)
        gaps = np.diff(np.sort(blocks, axis=2), axis=2)
        # a gap below a tolerance of the block's range is the same value twice (float noise)
        gaps = np.where(gaps > GRID_TOLERANCE * (hi - lo)[:, :, None] / 15.0, gaps, np.inf)
        smallest = gaps.min(axis=2)
        smallest = np.where(np.isfinite(smallest), smallest, 1.0)  # a constant block: code 0
        scale = np.full(smallest.shape, np.nan, np.float32)
        # the step divides the smallest gap (a block using codes 0, 2 and 7 has gaps of 2 and 5 steps)
        for parts in range(1, 16):
            open_ = np.isnan(scale)
            if not open_.any():
                break
            trial = (smallest / parts).astype(np.float32)
            steps = (blocks - lo[:, :, None]) / trial[:, :, None]
            q = np.rint(steps)
            fits = (q.max(axis=2) <= 15) & (np.abs(steps - q).max(axis=2) <= GRID_TOLERANCE)
            if parts == 1 and fits.mean() < 0.5:  # a float weight: most blocks are on no grid at all
                return None
            scale = np.where(open_ & fits, trial, scale)
        if np.isnan(scale).any():
            return None
        steps = (blocks - lo[:, :, None]) / scale[:, :, None]
        q = np.rint(steps)
        codes[rows] = q.reshape(-1, k).astype(np.uint8)
        scales[rows] = scale
        zero_points[rows] = -lo / scale
    return Quantized4Bit(codes, scales, zero_points, k, block_size)
