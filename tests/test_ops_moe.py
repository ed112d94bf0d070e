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


# ---------------------------------------------------------------- QMoE (integer-quantized experts)


def _quantize(w: np.ndarray, bits: int, block: int, zero_points: bool):
    """Experts' [E, N, K] float weights as QMoE's codes [E, N, K * bits / 8], scales [E, N, K / block]
    (per row [E, N] where block is 0) and packed zero points (or None: 2^(bits - 1))."""
    e, n, k = w.shape
    size = block or k
    blocks = w.reshape(e, n, k // size, size)
    top = (1 << bits) - 1
    if zero_points:
        lo, hi = blocks.min(-1), blocks.max(-1)
        scale = np.maximum(hi - lo, 1e-6) / top
        zero = np.clip(np.round(-lo / scale), 0, top).astype(np.int32)
    else:
        scale = np.maximum(np.abs(blocks).max(-1), 1e-6) / (1 << (bits - 1))
        zero = np.full(scale.shape, 1 << (bits - 1), np.int32)
    q = np.clip(np.round(blocks / scale[..., None]) + zero[..., None], 0, top).astype(np.uint8).reshape(e, n, k)
    pack = (lambda a: (a[..., 0::2] | (a[..., 1::2] << 4)).astype(np.uint8)) if bits == 4 else (lambda a: a)  # noqa: E731
    codes = pack(q)
    if not block:
        scale, zero = scale[..., 0], zero[..., 0]
        zp = pack(np.pad(zero, ((0, 0), (0, zero.shape[-1] % 2 if bits == 4 else 0))).astype(np.uint8))
    else:
        zp = pack(np.pad(zero, ((0, 0), (0, 0), (0, zero.shape[-1] % 2 if bits == 4 else 0))).astype(np.uint8))
    return codes, scale, (zp if zero_points else None)


def _qmoe(tokens: int, dtype: int, *, bits: int, block: int, zero_points: bool, fusion: int = 1, seed: int = 0,
          **attrs):  # fmt: skip
    """QMoE (swiglu, 8 experts, top 2 renormalized unless attrs say otherwise) and its feeds."""
    rng = np.random.default_rng(seed)
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    e, hidden, inter = 8, 64, 32
    feeds = {
        "x": rng.standard_normal((tokens, hidden)).astype(np_dtype),
        "router": (2 * rng.standard_normal((tokens, e))).astype(np_dtype),
    }
    names = ["x", "router"]
    for fc, (n, k) in (("fc1", (2 * inter, hidden)), ("fc2", (hidden, inter))):
        codes, scale, zp = _quantize(rng.standard_normal((e, n, k)) / np.sqrt(k), bits, block, zero_points)
        feeds[f"{fc}_w"], feeds[f"{fc}_s"] = codes, scale.astype(np_dtype)
        if zp is not None:
            feeds[f"{fc}_zp"] = zp
    names = ["x", "router", "fc1_w", "fc1_s", "", "fc2_w", "fc2_s", "", "", "", ""]
    if zero_points:
        names += ["fc1_zp", "fc2_zp"]
    attrs = {"activation_type": "swiglu", "k": 2, "normalize_routing_weights": 1, **attrs}
    if block:
        attrs["block_size"] = block
    node = helper.make_node("QMoE", names, ["y"], domain="com.microsoft", expert_weight_bits=bits,
                            swiglu_fusion=fusion, **attrs)  # fmt: skip
    inputs = [helper.make_tensor_value_info(n, dtype if n in ("x", "router") or n.endswith("_s") else
                                            TensorProto.UINT8, list(feeds[n].shape)) for n in names if n]  # fmt: skip
    return make_model([node], inputs, [helper.make_tensor_value_info("y", dtype, None)]), feeds


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("tokens", "bits", "block", "zero_points", "dtype"),
    [
        (1, 4, 32, False, F32),  # a decode step over block-wise 4-bit experts (the builder's int4 form)
        (12, 4, 32, False, F32),  # a prompt: grouped by expert
        (3, 4, 16, True, F32),  # zero points
        (10, 8, 32, True, F32),  # 8-bit
        (2, 4, 0, True, F32),  # per-row scales (no block_size)
        (9, 4, 32, False, F16),
    ],
)
def test_qmoe_matches_onnxruntime(device, tokens, bits, block, zero_points, dtype) -> None:
    model, feeds = _qmoe(tokens, dtype, bits=bits, block=block, zero_points=zero_points)
    expected = ort_run(model, feeds)[0]
    actual = onnxgen_run(model, feeds, device)[0]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = 1e-5 if dtype == F32 else 2e-3
    np.testing.assert_allclose(actual.astype(np.float32), expected.astype(np.float32), rtol=tol, atol=tol)


def test_qmoe_refuses_other_quantizations() -> None:
    model, feeds = _qmoe(2, F32, bits=4, block=32, zero_points=False, quant_type="fp8")
    with pytest.raises(OnnxgenError, match="only integer quantization"):
        onnxgen_run(model, feeds)
