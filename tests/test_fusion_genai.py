"""The rewrites of runtime/fusion_genai.py (the chains onnxruntime-genai's builder writes around its
rotary and linear-attention ops) against onnxruntime on the graph as written, and their near misses.

The rotary rewrite keeps every value: the fused graph's output equals the unfused graph's, run by
onnxgen, bit for bit (the torch path on the CPU; through Triton's interpreter the kernel, which
test_triton_kernels.py's rotary run covers on the op itself).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgen.runtime import InferenceSession
from onnxgen.runtime.fusion import fuse_graph
from tests.conftest import gated_delta_feeds, make_model, ort_run

MS = "com.microsoft"
F16, F32 = TensorProto.FLOAT16, TensorProto.FLOAT


def rotary_model(
    *, x_type: int = F16, back_to: int = F16, op: str = "MRotaryEmbedding", cast_read_twice: bool = False
) -> onnx.ModelProto:
    """y = Cast(op(Cast(x, FLOAT), pos, cos, sin), back_to): Qwen3.5's query rotary as
    onnxruntime-genai writes it (4 heads of 64, a quarter rotating, interleaved sections)."""
    attrs = dict(num_heads=4, rotary_embedding_dim=16, interleaved=0)
    if op == "MRotaryEmbedding":
        attrs.update(mrope_section=[3, 3, 2], mrope_layout=1)
    nodes = [
        helper.make_node("Cast", ["x"], ["x32"], to=F32),
        helper.make_node(op, ["x32", "pos", "cos", "sin"], ["r"], domain=MS, **attrs),
        helper.make_node("Cast", ["r"], ["y"], to=back_to),
    ]
    outputs = [helper.make_tensor_value_info("y", back_to, None)]
    if cast_read_twice:
        nodes.append(helper.make_node("Identity", ["x32"], ["x32_again"]))
        outputs.append(helper.make_tensor_value_info("x32_again", F32, None))
    pos_shape = [3, 2, 5] if op == "MRotaryEmbedding" else [2, 5]
    inputs = [
        helper.make_tensor_value_info("x", x_type, ["b", "s", 256]),
        helper.make_tensor_value_info("pos", TensorProto.INT64, pos_shape),
        helper.make_tensor_value_info("cos", F32, [40, 8]),
        helper.make_tensor_value_info("sin", F32, [40, 8]),
    ]
    return make_model(nodes, inputs, outputs)


def _rotary_feeds(op: str, x_type: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    angles = rng.uniform(0, 2 * np.pi, (40, 8))
    shape = (3, 2, 5) if op == "MRotaryEmbedding" else (2, 5)
    return {
        "x": rng.standard_normal((2, 5, 256)).astype(helper.tensor_dtype_to_np_dtype(x_type)),
        "pos": rng.integers(0, 40, shape).astype(np.int64),  # three streams that differ
        "cos": np.cos(angles).astype(np.float32),
        "sin": np.sin(angles).astype(np.float32),
    }


@pytest.mark.parametrize("op", ["MRotaryEmbedding", "RotaryEmbedding"])
def test_rotary_casts_go_and_the_values_stay(op: str) -> None:
    model = rotary_model(op=op)
    fused, report = fuse_graph(model)
    assert report.rotary_casts == 1
    assert [(n.op_type, n.input[0], n.output[0]) for n in fused.graph.node] == [(op, "x", "y")]
    feeds = _rotary_feeds(op, F16)
    (written,) = InferenceSession(model, device="cpu").run(None, feeds)
    (got,) = InferenceSession(fused, device="cpu").run(None, feeds)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, written)
    if op == "MRotaryEmbedding":  # onnxruntime's CPU kernel takes the multimodal form
        (want,) = ort_run(model, feeds)
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-3, atol=2e-3)


@pytest.mark.parametrize(
    "near_miss",
    [
        {"x_type": F32},  # x already fp32: the last Cast rounds, the op alone would not
        {"x_type": TensorProto.BFLOAT16},  # cast back to another type than x's
        {"back_to": F32},
        {"cast_read_twice": True},
    ],
)
def test_near_misses_keep_their_rotary_casts(near_miss: dict) -> None:
    _, report = fuse_graph(rotary_model(**near_miss))
    assert report.rotary_casts == 0


def scaled_query_model(*, scale: float | None = 1.0, factor_shape: tuple[int, ...] = ()) -> onnx.ModelProto:
    """LinearAttention (gated delta rule, inverse GQA with packed keys) reading Mul(q, c), as
    onnxruntime-genai's Qwen3.5 export scales its queries (c = 1 / sqrt(d), the op's scale 1)."""
    hq, hkv, d = 2, 4, 8
    attrs = dict(q_num_heads=hq, kv_num_heads=hkv, update_rule="gated_delta")
    if scale is not None:
        attrs["scale"] = scale
    factor = numpy_helper.from_array(np.full(factor_shape, d**-0.5, dtype=np.float32), "c")
    nodes = [
        helper.make_node("Mul", ["q", "c"], ["qs"]),
        helper.make_node(
            "LinearAttention", ["qs", "k", "v", "past", "decay", "beta"], ["out", "state"], domain=MS, **attrs
        ),  # fmt: skip
    ]
    inputs = [
        helper.make_tensor_value_info(name, F32, shape)
        for name, shape in (("q", ["b", "t", hq * d]), ("k", ["b", "t", hq * d]), ("v", ["b", "t", hkv * 3]),
                            ("past", ["b", hkv, d, 3]), ("decay", ["b", "t", hkv]), ("beta", ["b", "t", hkv]))
    ]  # fmt: skip
    outputs = [helper.make_tensor_value_info(n, F32, None) for n in ("out", "state")]
    return make_model(nodes, inputs, outputs, [factor])


@pytest.mark.parametrize("t", [1, 4])
def test_a_scalar_query_scale_folds_into_linear_attention(t: int) -> None:
    model = scaled_query_model(scale=0.5)
    fused, report = fuse_graph(model)
    assert report.query_scales == 1
    (attention,) = fused.graph.node
    assert attention.input[0] == "q"
    assert helper.get_attribute_value(next(a for a in attention.attribute if a.name == "scale")) == pytest.approx(
        0.5 * 8**-0.5
    )
    feeds = gated_delta_feeds(t, key_heads=2, kv_heads=4, d=8, dv=3, seed=6)
    want = ort_run(model, feeds)
    got = InferenceSession(fused, device="cpu").run(None, feeds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "near_miss",
    [
        {"scale": None},  # the default scale (1 / sqrt(d_k)) would need d_k from shapes
        {"scale": 0.0},
        {"factor_shape": (2,)},  # not a scalar
    ],
)
def test_near_misses_keep_their_query_scale(near_miss: dict) -> None:
    _, report = fuse_graph(scaled_query_model(**near_miss))
    assert report.query_scales == 0
