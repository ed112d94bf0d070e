"""GatedRMSNorm, GatedAdd and LinearAttentionGate (com.microsoft; runtime/ops/contrib_gated.py)
against onnxruntime 1.32's CPU kernels (graph optimizations off), fp32 and fp16; GatedAdd's
projected form, which onnxruntime implements only on CUDA for bfloat16, against the schema's
formula written out in numpy (fp32 arithmetic, rounded to bfloat16 at each stated step)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper

from tests.conftest import make_model, onnxgen_run, ort_run

NP = {TP.FLOAT: np.float32, TP.FLOAT16: np.float16}
TOL = {TP.FLOAT: 1e-5, TP.FLOAT16: 2e-3}


def _close(actual: np.ndarray, expected: np.ndarray, dtype: int) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = max(float(np.abs(expected.astype(np.float64)).max()), 1e-6)
    error = float(np.abs(actual.astype(np.float64) - expected.astype(np.float64)).max()) / scale
    assert error < TOL[dtype], error


def _vi(name: str, dtype: int, shape: list[int]):
    return helper.make_tensor_value_info(name, dtype, shape)


@pytest.mark.parametrize("dtype", [TP.FLOAT, TP.FLOAT16])
@pytest.mark.parametrize("activation", ["silu", "swish", "sigmoid"])
@pytest.mark.parametrize("groups", [8, 32])
def test_gated_rms_norm_matches_onnxruntime(dtype: int, activation: str, groups: int) -> None:
    shape = [2, 3, 32]
    node = helper.make_node(
        "GatedRMSNorm", ["X", "scale", "gate"], ["Y"], domain="com.microsoft", activation=activation, epsilon=1e-6
    )
    inputs = [_vi("X", dtype, shape), _vi("scale", dtype, [groups]), _vi("gate", dtype, shape)]
    model = make_model([node], inputs, [_vi("Y", dtype, shape)])
    rng = np.random.default_rng(groups)
    feeds = {
        "X": rng.standard_normal(shape).astype(NP[dtype]),
        "scale": rng.standard_normal(groups).astype(NP[dtype]),
        "gate": rng.standard_normal(shape).astype(NP[dtype]),
    }
    _close(onnxgen_run(model, feeds)[0], ort_run(model, feeds)[0], dtype)


@pytest.mark.parametrize("dtype", [TP.FLOAT, TP.FLOAT16])
def test_gated_add_matches_onnxruntime(dtype: int) -> None:
    node = helper.make_node("GatedAdd", ["X", "Y", "gate"], ["out"], domain="com.microsoft")
    shape = [2, 5, 16]
    inputs = [_vi("X", dtype, shape), _vi("Y", dtype, shape), _vi("gate", dtype, [2, 5, 1])]
    model = make_model([node], inputs, [_vi("out", dtype, shape)])
    rng = np.random.default_rng(1)
    feeds = {k: rng.standard_normal(s).astype(NP[dtype]) for k, s in (("X", shape), ("Y", shape), ("gate", [2, 5, 1]))}
    _close(onnxgen_run(model, feeds)[0], ort_run(model, feeds)[0], dtype)


def _bf16(values: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 (nearest, ties to even), kept as float32."""
    bits = values.astype(np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def test_gated_add_projected_form_follows_the_schema_formula() -> None:
    import torch

    from onnxgen.runtime import InferenceSession

    node = helper.make_node("GatedAdd", ["X", "Y", "gate", "w"], ["out"], domain="com.microsoft")
    bf = TP.BFLOAT16
    model = make_model(
        [node], [_vi("X", bf, [3, 8]), _vi("Y", bf, [3, 8]), _vi("gate", bf, [3, 4]), _vi("w", bf, [4, 1])],
        [_vi("out", bf, [3, 8])],
    )  # fmt: skip
    rng = np.random.default_rng(2)
    x, y, gate, w = (_bf16(rng.standard_normal(s).astype(np.float32)) for s in ([3, 8], [3, 8], [3, 4], [4, 1]))
    p = _bf16(gate.astype(np.float64) @ w.astype(np.float64))
    s = _bf16(1.0 / (1.0 + np.exp(-p.astype(np.float64))))
    expected = _bf16(x + _bf16(y * s))
    feeds = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in (("X", x), ("Y", y), ("gate", gate), ("w", w))}
    actual = InferenceSession(model, device="cpu").run_torch(feeds)["out"].float().numpy()
    np.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize("dtype", [TP.FLOAT, TP.FLOAT16])
@pytest.mark.parametrize("with_beta", [True, False])
def test_linear_attention_gate_matches_onnxruntime(dtype: int, with_beta: bool) -> None:
    shape = [2, 3, 4]
    inputs = ["a", "dt_bias", "decay_scale"] + (["b"] if with_beta else [])
    outputs = ["decay"] + (["beta"] if with_beta else [])
    node = helper.make_node("LinearAttentionGate", inputs, outputs, domain="com.microsoft")
    infos = [_vi("a", dtype, shape), _vi("dt_bias", TP.FLOAT, [4]), _vi("decay_scale", TP.FLOAT, [4])]
    infos += [_vi("b", dtype, shape)] if with_beta else []
    model = make_model([node], infos, [_vi(name, dtype, shape) for name in outputs])
    rng = np.random.default_rng(3)
    feeds = {
        "a": (3 * rng.standard_normal(shape)).astype(NP[dtype]),
        "dt_bias": rng.standard_normal(4).astype(np.float32),
        "decay_scale": -np.exp(rng.standard_normal(4)).astype(np.float32),
    }
    if with_beta:
        feeds["b"] = rng.standard_normal(shape).astype(NP[dtype])
    for actual, expected in zip(onnxgen_run(model, feeds), ort_run(model, feeds), strict=True):
        _close(actual, expected, dtype)


def test_gated_rms_norm_says_what_is_wrong() -> None:
    from onnxgen.errors import OnnxgenError

    shape = [2, 30]
    node = helper.make_node("GatedRMSNorm", ["X", "scale", "gate"], ["Y"], domain="com.microsoft")
    model = make_model(
        [node], [_vi("X", TP.FLOAT, shape), _vi("scale", TP.FLOAT, [8]), _vi("gate", TP.FLOAT, shape)],
        [_vi("Y", TP.FLOAT, shape)],
    )  # fmt: skip
    feeds = {k: np.ones(s, np.float32) for k, s in (("X", shape), ("scale", [8]), ("gate", shape))}
    with pytest.raises(OnnxgenError, match="multiple of scale's length 8"):
        onnxgen_run(model, feeds)


def test_shape_rules_keep_the_inputs_shape_symbolically() -> None:
    """The capture classifier's shape rules: each output has the first input's shape, symbols kept."""
    from onnxgen.runtime.shapes.infer import infer_shapes

    f = TP.FLOAT
    nodes = [
        helper.make_node("GatedRMSNorm", ["x", "scale", "g"], ["n"], domain="com.microsoft"),
        helper.make_node("GatedAdd", ["n", "x", "row"], ["s"], domain="com.microsoft"),
        helper.make_node("LinearAttentionGate", ["a", "dt", "ds", "b"], ["decay", "beta"], domain="com.microsoft"),
    ]
    inputs = [_vi("x", f, ["B", "T", 64]), _vi("scale", f, [16]), _vi("g", f, ["B", "T", 64])]
    inputs += [_vi("row", f, ["B", "T", 1]), _vi("a", f, ["B", "T", 4]), _vi("dt", f, [4]), _vi("ds", f, [4])]
    inputs += [_vi("b", f, ["B", "T", 4])]
    outputs = [_vi(name, f, None) for name in ("s", "decay", "beta")]
    result = infer_shapes(make_model(nodes, inputs, outputs))
    assert list(result.values["s"].shape) == ["B", "T", 64]
    assert list(result.values["decay"].shape) == list(result.values["beta"].shape) == ["B", "T", 4]
