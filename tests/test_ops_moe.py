"""MoE (com.microsoft; runtime/ops/contrib_moe.py) against onnxruntime 1.32's CPU kernel.

onnxruntime's CPU MoE takes SwiGLU's gate and up projections interleaved only (swiglu_fusion 1):
the concatenated layout (2) and fc3 apart (0) are checked against it on the same weights
rearranged into that layout, an equivalent model.

Cases: the Qwen3.5-MoE form (SwiGLU with alpha 1 and beta 0, i.e. SiLU(gate) * up, top-k
renormalized), each SwiGLU layout (fc3 apart, interleaved, concatenated), a clamp limit, the plain
activations, biases, fp16, 2-D packed and 3-D inputs, and both ways of running the experts (few
tokens: weights gathered by index; many tokens: grouped by expert).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxgen.errors import OnnxgenError
from tests.conftest import DEVICES, make_model, onnxgen_run, ort_run

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _moe(
    tokens_shape: tuple[int, ...], experts: int, hidden: int, inter: int, dtype: int, *, fusion: int = 0,
    fc3: bool = False, bias: bool = False, seed: int = 0, **attrs,
):  # fmt: skip
    rng = np.random.default_rng(seed)
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    rows = int(np.prod(tokens_shape))
    width = 2 * inter if fusion else inter
    feeds = {
        "x": rng.standard_normal((*tokens_shape, hidden)).astype(np_dtype),
        "router": (2 * rng.standard_normal((rows, experts))).astype(np_dtype),
        "w1": (rng.standard_normal((experts, width, hidden)) / np.sqrt(hidden)).astype(np_dtype),
        "w2": (rng.standard_normal((experts, hidden, inter)) / np.sqrt(inter)).astype(np_dtype),
    }
    names = ["x", "router", "w1", "", "w2", "", "", ""]
    if bias:
        feeds["b1"] = (0.1 * rng.standard_normal((experts, width))).astype(np_dtype)
        feeds["b2"] = (0.1 * rng.standard_normal((experts, hidden))).astype(np_dtype)
        names[3], names[5] = "b1", "b2"
    if fc3:
        feeds["w3"] = (rng.standard_normal((experts, inter, hidden)) / np.sqrt(hidden)).astype(np_dtype)
        names[6] = "w3"
        if bias:
            feeds["b3"] = (0.1 * rng.standard_normal((experts, inter))).astype(np_dtype)
            names[7] = "b3"
    while names[-1] == "":
        names.pop()
    node = helper.make_node("MoE", names, ["y"], domain="com.microsoft", swiglu_fusion=fusion, **attrs)
    inputs = [helper.make_tensor_value_info(n, dtype, list(feeds[n].shape)) for n in names if n]
    model = make_model([node], inputs, [helper.make_tensor_value_info("y", dtype, None)])
    return model, feeds


QWEN_MOE = dict(activation_type="swiglu", k=4, normalize_routing_weights=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("tokens", "fusion", "fc3", "bias", "attrs"),
    [
        ((1,), 2, False, False, QWEN_MOE),  # a decode step: weights gathered by index
        ((2, 9), 2, False, False, QWEN_MOE),  # a prompt, 3-D: grouped by expert
        ((3,), 1, False, True, QWEN_MOE),  # interleaved gate/up, biases
        ((12,), 0, True, True, QWEN_MOE),  # up projection from fc3
        ((7,), 1, False, False, dict(activation_type="swiglu", k=2, swiglu_limit=0.5)),  # clamp, not renormalized
        ((9,), 0, False, True, dict(activation_type="relu", k=2)),
        ((2,), 0, False, False, dict(activation_type="gelu", k=1)),
        ((9,), 0, False, False, dict(activation_type="silu", k=3, normalize_routing_weights=1)),
    ],
)
def test_moe_matches_onnxruntime(device, tokens, fusion, fc3, bias, attrs) -> None:
    model, feeds = _moe(tokens, 16, 32, 24, F32, fusion=fusion, fc3=fc3, bias=bias, **attrs)
    _assert_matches(model, feeds, device, tol=1e-5)


def _interleaved(model, feeds: dict[str, np.ndarray]):
    """The same MoE with SwiGLU's gate and up rows interleaved in fc1 (swiglu_fusion 1), the one
    layout onnxruntime's CPU kernel takes."""
    (node,) = model.graph.node
    fusion = next((a.i for a in node.attribute if a.name == "swiglu_fusion"), 0)
    if fusion == 1 or "w3" not in feeds and fusion == 0:
        return model, feeds
    if fusion == 2:
        half = feeds["w1"].shape[1] // 2
        gate, up = feeds["w1"][:, :half], feeds["w1"][:, half:]
        bias = (feeds["b1"][:, :half], feeds["b1"][:, half:]) if "b1" in feeds else None
    else:
        gate, up = feeds["w1"], feeds["w3"]
        bias = (feeds["b1"], feeds["b3"]) if "b1" in feeds else None
    out = {n: v for n, v in feeds.items() if n not in ("w3", "b3")}
    out["w1"] = np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, gate.shape[2])
    if bias is not None:
        out["b1"] = np.stack(bias, axis=2).reshape(bias[0].shape[0], -1)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name != "swiglu_fusion"}
    attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
    names = [n for n in node.input[:6]]
    dtype = model.graph.input[0].type.tensor_type.elem_type
    moe = helper.make_node("MoE", names, ["y"], domain="com.microsoft", swiglu_fusion=1, **attrs)
    inputs = [helper.make_tensor_value_info(n, dtype, list(out[n].shape)) for n in names if n]
    return make_model([moe], inputs, [helper.make_tensor_value_info("y", dtype, None)]), out


def _assert_matches(model, feeds, device: str, tol: float) -> None:
    oracle_model, oracle_feeds = _interleaved(model, feeds)
    expected = ort_run(oracle_model, oracle_feeds)[0]
    actual = onnxgen_run(model, feeds, device)[0]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    np.testing.assert_allclose(actual.astype(np.float32), expected.astype(np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [(1,), (20,)])
def test_moe_fp16_matches_onnxruntime(device, tokens) -> None:
    model, feeds = _moe(tokens, 16, 32, 24, F16, fusion=2, seed=3, **QWEN_MOE)
    _assert_matches(model, feeds, device, tol=2e-3)


def test_gathered_and_grouped_experts_agree() -> None:
    """The same tokens through both ways of running the experts: one call with few tokens per
    expert pair budget, then each token alone (always gathered)."""
    model, feeds = _moe((10,), 8, 16, 12, F32, fusion=2, seed=5, **QWEN_MOE)  # 40 pairs > 8 experts: grouped
    together = onnxgen_run(model, feeds)[0]
    for i in range(10):
        one, one_feeds = _moe((1,), 8, 16, 12, F32, fusion=2, seed=5, **QWEN_MOE)
        one_feeds = dict(feeds, x=feeds["x"][i : i + 1], router=feeds["router"][i : i + 1])
        np.testing.assert_allclose(onnxgen_run(one, one_feeds)[0][0], together[i], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        (dict(activation_type="relu2", k=2), "activation_type 'relu2' is not one of"),
        (dict(activation_type="relu", k=2, use_sparse_mixer=1), "use_sparse_mixer"),
        (dict(activation_type="relu", k=17), "k 17 must be between 1 and the 16 experts"),
        (dict(activation_type="swiglu", k=2), "fc3_experts_weights, which is missing"),
    ],
)
def test_moe_refuses_what_it_does_not_implement(attrs: dict, message: str) -> None:
    model, feeds = _moe((2,), 16, 32, 24, F32, **attrs)
    with pytest.raises(OnnxgenError, match=message):
        onnxgen_run(model, feeds)
