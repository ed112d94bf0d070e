"""quantize_4bit and the MoE experts' 4-bit tensors keep the arithmetic they had."""

from __future__ import annotations

import numpy as np
import pytest

from onnxgen.models.builder_hybrid import quantize_experts
from onnxgen.models.quantize import quantize_4bit
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource


def _quantize_4bit_reference(weight: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_4bit as first written: whole-array float32 arithmetic, zero-padded to whole blocks."""
    n, k = weight.shape
    n_blocks = -(-k // block_size)
    w = np.zeros((n, n_blocks * block_size), np.float32)
    w[:, :k] = weight
    blocks = w.reshape(n, n_blocks, block_size)
    lo = np.minimum(blocks.min(axis=2), 0.0)
    hi = np.maximum(blocks.max(axis=2), 0.0)
    scale = (hi - lo) / 15.0
    scale = np.where(scale == 0.0, 1.0, scale).astype(np.float32)
    zp = np.clip(np.rint(-lo / scale), 0, 15)
    q = np.clip(np.rint(blocks / scale[:, :, None]) + zp[:, :, None], 0, 15)
    return q.reshape(w.shape).astype(np.uint8), scale, zp.astype(np.uint8)


@pytest.mark.parametrize(("shape", "block"), [((64, 256), 32), ((33, 100), 32), ((5, 64), 16), ((7, 128), 64)])
def test_quantize_4bit_keeps_its_arithmetic(shape: tuple[int, int], block: int) -> None:
    rng = np.random.default_rng(shape[1])
    weight = rng.standard_normal(shape, dtype=np.float32) * rng.uniform(0.01, 3.0, (shape[0], 1)).astype(np.float32)
    weight[0] = 0.0  # all-zero blocks
    weight[1, : shape[1] // 2] = 0.5  # constant and positive-only blocks
    weight[2] = -np.abs(weight[2])  # negative-only blocks
    q = quantize_4bit(weight, block)
    for got, want in zip((q.codes, q.scales, q.zero_points), _quantize_4bit_reference(weight, block)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_experts_quantized_one_at_a_time_equal_the_stacked_layer() -> None:
    """QMoE's fc1 was the interleaved [gate; up] rows of each expert quantized whole: rows are
    quantized independently, so quantizing gate and up apart and interleaving gives its tensors."""
    config = TINY_CONFIGS["tiny-qwen3.5-moe"]
    source = RandomSource(config, seed=2)
    experts = range(2, 7)
    got = quantize_experts(source.get, 1, experts, 32)
    p = "model.layers.1.mlp.experts."
    want: list[list[np.ndarray]] = [[] for _ in range(6)]
    for e in experts:
        gate, up, down = (source.get(f"{p}{e}.{proj}_proj.weight") for proj in ("gate", "up", "down"))
        fc1 = np.stack([gate, up], axis=1).reshape(2 * gate.shape[0], -1)
        for index, weight in ((0, fc1), (3, down)):
            b, s, z = quantize_4bit(weight, 32).matmulnbits_tensors()
            for j, tensor in enumerate((b, s, z)):
                want[index + j].append(tensor.reshape(weight.shape[0], -1))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, np.stack(w))
