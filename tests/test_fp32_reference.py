"""The fp32 reference graph (runtime/fp32_reference.py, dequantize.py) against onnxruntime.

- Each dequantization against onnxruntime's own op on the same tensors (MatMulNBits over an
  identity matrix hands back W^T; every zero-point form; a padded last block).
- Whole packages: onnxruntime on the rewritten graph gives what onnxruntime gives on the quantized
  graph at MatMulNBits accuracy level 0 (fp32 arithmetic), for the contrib-op int4 layout (tied
  table through GatherBlockQuantized) and the default-domain one (folded DequantizeLinear); an fp16
  package comes back with no float16 anywhere; onnxgen runs every rewritten graph as onnxruntime does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgen.models.builder import build_package
from onnxgen.models.package_variants import with_accuracy_level
from onnxgen.models.quantize import pack_uint4, quantize_4bit
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource
from onnxgen.runtime import InferenceSession
from onnxgen.runtime.dequantize import nbits_weight
from onnxgen.runtime.fp32_reference import fp32_reference
from onnxgen.runtime.model_io import load_model, read_external_bytes
from tests.conftest import make_model, ort_run, prompt_feeds

PROMPT = [5, 17, 300, 42, 8, 99, 3]


@pytest.mark.parametrize("zero", ["none", "uint8", "float"])
@pytest.mark.parametrize(("n", "k", "block"), [(24, 64, 32), (10, 80, 32)])  # 80: a padded last block, odd count
def test_nbits_weight_matches_onnxruntime(zero: str, n: int, k: int, block: int) -> None:
    rng = np.random.default_rng(0)
    q = quantize_4bit(rng.standard_normal((n, k)).astype(np.float32), block)
    b, scales, packed_zero = q.matmulnbits_tensors()
    zero_points = {"none": None, "uint8": packed_zero, "float": q.zero_points.astype(np.float32).reshape(-1)}[zero]
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "scales")]
    if zero_points is not None:
        inits.append(numpy_helper.from_array(zero_points, "zeros"))
    node = helper.make_node(
        "MatMulNBits", ["A", "B", "scales"] + (["zeros"] if zero_points is not None else []), ["Y"],
        domain="com.microsoft", K=k, N=n, bits=4, block_size=block,
    )  # fmt: skip
    model = make_model(
        [node],
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [k, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [k, n])],
        inits,
    )
    (weight_t,) = ort_run(model, {"A": np.eye(k, dtype=np.float32)})  # I @ W^T
    ours = nbits_weight(b, scales, zero_points, n=n, k=k, bits=4, block_size=block)
    # float zero points: onnxruntime folds them into an offset (q * scale - zero * scale), a rounding
    # apart from (q - zero) * scale; integer ones give the same float32 values
    np.testing.assert_allclose(ours, weight_t.T, rtol=1e-6 if zero == "float" else 0, atol=0)


def test_odd_zero_point_rows_are_unpacked_per_row() -> None:
    """Three blocks per row: each row's packed zero points end in a pad nibble that is never read."""
    n, k, block = 4, 96, 32
    codes = np.arange(n * k, dtype=np.uint8).reshape(n, k) % 16
    zeros = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]], np.uint8)
    packed_zeros = pack_uint4(np.concatenate([zeros, np.zeros((n, 1), np.uint8)], axis=1))
    weight = nbits_weight(
        pack_uint4(codes), np.ones(n * 3, np.float32), packed_zeros, n=n, k=k, bits=4, block_size=block
    )
    expected = codes.astype(np.float32) - np.repeat(zeros, block, axis=1)
    np.testing.assert_array_equal(weight, expected)


def _inlined(model: onnx.ModelProto, base_dir: Path) -> onnx.ModelProto:
    """The model with its external data read in, so that onnxruntime can take it as bytes (onnx's own
    loader refuses the hard-linked data files of with_accuracy_level's copies)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for tensor in copy.graph.initializer:
        if tensor.data_location == TensorProto.EXTERNAL:
            raw = read_external_bytes(tensor, base_dir)
            del tensor.external_data[:]
            tensor.data_location = TensorProto.DEFAULT
            tensor.raw_data = raw
    return copy


def _logits(model: onnx.ModelProto, base_dir: Path, feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(onnxruntime's, onnxgen's) logits of ``model``."""
    expected = ort_run(_inlined(model, base_dir), feeds)[0]
    actual = InferenceSession(model, base_dir=base_dir).run(["logits"], feeds)[0]
    return expected, actual


def _feeds(package: Path) -> dict[str, np.ndarray]:
    feeds = prompt_feeds(package, PROMPT)
    model, _ = load_model(package / "model.onnx")
    if "position_ids" in {i.name for i in model.graph.input}:  # the default-domain layout
        feeds["position_ids"] = np.arange(len(PROMPT), dtype=np.int64)[None]
    return feeds


def _rewritten(package: Path) -> tuple[onnx.ModelProto, Path, object]:
    model, base_dir = load_model(package / "model.onnx")
    reference = fp32_reference(model, base_dir)
    return reference.model, base_dir, reference


@pytest.mark.parametrize(
    ("name", "attention", "rewritten_ops"),
    [
        ("tiny-qwen2", "gqa", {"MatMulNBits", "GatherBlockQuantized"}),  # tied: the table is the head's codes
        ("tiny-llama", "gqa", {"MatMulNBits"}),
        ("tiny-llama", "standard", {"DequantizeLinear"}),
    ],
)
def test_int4_reference_is_onnxruntime_at_fp32(tmp_path, name: str, attention: str, rewritten_ops: set[str]) -> None:
    package = build_package(RandomSource(TINY_CONFIGS[name], seed=2), tmp_path / "q4", "int4", attention=attention)
    model, base_dir, reference = _rewritten(package)
    assert set(reference.dequantized) == rewritten_ops and not reference.kept, reference.summary()
    left = {n.op_type for n in model.graph.node} & {"MatMulNBits", "GatherBlockQuantized", "DequantizeLinear"}
    assert not left
    feeds = _feeds(package)
    level0 = package if attention == "standard" else with_accuracy_level(package, tmp_path / "level0", 0)
    original = ort_run(_inlined(*load_model(level0 / "model.onnx")), feeds)[0]
    expected, actual = _logits(model, base_dir, feeds)
    scale = float(np.abs(original).max())
    np.testing.assert_allclose(expected, original, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * scale)


def test_fp16_reference_has_no_float16_left(tmp_path) -> None:
    config = TINY_CONFIGS["tiny-llama"]
    half = build_package(RandomSource(config, seed=2), tmp_path / "fp16", "fp16")
    model, base_dir, reference = _rewritten(half)
    assert reference.upcast > 0 and not reference.dequantized
    half_types = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
    assert not [t.name for t in model.graph.initializer if t.data_type in half_types]
    assert not [v.name for v in (*model.graph.input, *model.graph.output) if v.type.tensor_type.elem_type in half_types]
    casts = [a.i for n in model.graph.node if n.op_type == "Cast" for a in n.attribute if a.name == "to"]
    assert TensorProto.FLOAT16 not in casts
    feeds = _feeds(half)  # fp32 KV: what the rewritten graph declares
    expected, actual = _logits(model, base_dir, feeds)
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * scale)
    # the same numbers as the fp16 graph, without its rounding: close to the fp32 package's
    full = build_package(RandomSource(config, seed=2), tmp_path / "fp32", "fp32")
    fp32 = ort_run(_inlined(*load_model(full / "model.onnx")), feeds)[0]
    assert np.linalg.norm(expected - fp32) / np.linalg.norm(fp32) < 5e-3


def test_the_original_model_is_left_as_it_was(tmp_path) -> None:
    package = build_package(RandomSource(TINY_CONFIGS["tiny-llama"], seed=2), tmp_path / "q4", "int4")
    model, base_dir = load_model(package / "model.onnx")
    before = model.SerializeToString()
    fp32_reference(model, base_dir)
    assert model.SerializeToString() == before


def test_casts_constants_and_subgraphs_become_float32() -> None:
    """Every way a graph names float16 outside its initializers: a Cast's target, a Constant, a
    ConstantOfShape's value, a value type, and the same inside an If branch."""
    half = TensorProto.FLOAT16
    branch = helper.make_graph(
        [
            helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array([0.1], np.float16))),
            helper.make_node("Add", ["h", "c"], ["y"]),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("y", half, [3])],
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["h"], ["z"])], "else", [], [helper.make_tensor_value_info("z", half, [3])]
    )
    nodes = [
        helper.make_node("Cast", ["x"], ["h"], to=half),
        helper.make_node("ConstantOfShape", ["shape"], ["ones"], value=helper.make_tensor("v", half, [1], [1.0])),
        helper.make_node("If", ["flag"], ["branch"], then_branch=branch, else_branch=other),
        helper.make_node("Mul", ["branch", "ones"], ["out"]),
    ]
    model = make_model(
        nodes,
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("out", half, [3])],
        [numpy_helper.from_array(np.array([3], np.int64), "shape")],
    )
    reference = fp32_reference(model, None).model
    text = str(reference)
    assert "FLOAT16" not in text and "elem_type: 10" not in text and "data_type: 10" not in text
    x = np.array([1.0001, 2.0002, 3.0003], np.float32)
    (out,) = ort_run(reference, {"x": x, "flag": np.array(True)})
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, x + np.float32(np.float16(0.1)), rtol=1e-7)  # no float16 rounding of x
