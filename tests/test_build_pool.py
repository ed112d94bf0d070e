"""An int4 build with a pool of workers (build_pool) writes the serial build's package byte for
byte; quantize_4bit and the MoE experts' 4-bit tensors keep the arithmetic they had."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onnxgen.models import build_pool
from onnxgen.models.builder import BuildError, build_package
from onnxgen.models.builder_hybrid import expert_weight_names, quantize_experts
from onnxgen.models.quantize import quantize_4bit, quantize_4bit_symmetric
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource


def _files(directory: Path) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in ("model.onnx", "model.onnx.data", "genai_config.json")}


@pytest.mark.parametrize(
    ("name", "device", "spill"),
    [("tiny-qwen3.5-moe", "cuda", True), ("tiny-qwen3.5-moe", "cpu", False), ("tiny-qwen2", "cpu", True)],
)
def test_a_pool_build_writes_the_serial_package(tmp_path, monkeypatch, name: str, device: str, spill: bool) -> None:
    """The MoE hybrid (routed experts in runs, the LM head started first) and a tied table shared
    with the head (its embedding quantized first); results through RAM files, or the pipe."""
    if not spill:
        monkeypatch.setattr(build_pool, "SPILL_DIR", str(tmp_path / "absent"))
    monkeypatch.setattr(build_pool, "EXPERT_RUN_ELEMENTS", 3 * 32 * 64 * 3)  # runs of 3 experts: 8 = 3 + 3 + 2
    source = RandomSource(TINY_CONFIGS[name], seed=4)
    seen: list[list[str]] = [[], []]
    for names, workers in zip(seen, (0, 2)):
        build_package(source, tmp_path / str(workers), "int4", device, progress=lambda n, d, t, s=names: s.append(n),
                      workers=workers)  # fmt: skip
    assert _files(tmp_path / "0") == _files(tmp_path / "2")
    assert seen[0] == seen[1], "progress names every weight, in the same order"
    assert not list(Path(build_pool.SPILL_DIR).glob("onnxgen-build-*"))


class _Damaged(RandomSource):
    """A source with one non-finite value in one expert (pickles: workers read it too)."""

    def get(self, name: str) -> np.ndarray:
        values = super().get(name)
        if name == "model.layers.2.mlp.experts.5.down_proj.weight":
            values[0, 0] = np.nan
        return values


def test_a_workers_error_stops_the_build(tmp_path) -> None:
    with pytest.raises(BuildError, match=r"experts\.5\.down_proj.*non-finite"):
        build_package(_Damaged(TINY_CONFIGS["tiny-qwen3.5-moe"]), tmp_path, "int4", "cuda", workers=1)


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


@pytest.mark.parametrize(("shape", "block"), [((64, 256), 32), ((33, 100), 32), ((7, 128), 64)])
def test_symmetric_quantization_puts_each_blocks_extreme_on_code_0(shape: tuple[int, int], block: int) -> None:
    """quantize_4bit_symmetric: scale = the block's largest-magnitude value over -8 (that value is code
    0 exactly), zero points 8, codes 8 + rint(w / scale) clipped to 0..15, all-zero blocks scale 1;
    no zero-point tensor for MatMulNBits."""
    rng = np.random.default_rng(shape[0])
    weight = rng.standard_normal(shape, dtype=np.float32)
    weight[0] = 0.0
    q = quantize_4bit_symmetric(weight, block)
    n, k = shape
    padded = np.zeros((n, q.n_blocks * block), np.float32)
    padded[:, :k] = weight
    blocks = padded.reshape(n, q.n_blocks, block)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=2)[:, :, None], axis=2)[:, :, 0]
    want_scale = np.where(extreme == 0, 1.0, extreme / -8.0).astype(np.float32)
    np.testing.assert_array_equal(q.scales, want_scale)
    want_codes = np.clip(np.rint(blocks / want_scale[:, :, None]), -8, 7) + 8
    np.testing.assert_array_equal(q.codes, want_codes.reshape(n, -1).astype(np.uint8))
    assert (q.zero_points == 8).all() and q.matmulnbits_tensors()[2].size == 0
    error = np.abs(q.dequantize() - weight).max(axis=1)
    assert (error <= np.abs(weight).max(axis=1) / 8 + 1e-6).all()  # at most one step anywhere


def test_experts_quantized_one_at_a_time_equal_the_stacked_layer() -> None:
    """QMoE's fc1 was the interleaved [gate; up] rows of each expert quantized whole: rows are
    quantized independently, so quantizing gate and up apart and interleaving gives its tensors."""
    config = TINY_CONFIGS["tiny-qwen3.5-moe"]
    source = RandomSource(config, seed=2)
    experts = range(2, 7)
    got = quantize_experts(source.get, 1, experts, 32)
    assert len(expert_weight_names(1, experts)) == 3 * len(experts)
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
