"""The Reshape-chain rewrite (runtime/fusion_reshapes.py): chains folded where the composed shape is
known, left alone where it is not, the graph's results unchanged (onnxruntime on the graph before
and after), and on a built Qwen3.5 package one chain per gated attention layer (its query heads)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgen.models.builder import build_package
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource
from onnxgen.runtime.fusion import DEVICE_REWRITES, fuse_graph
from onnxgen.runtime.fusion_reshapes import composed_shape


@pytest.mark.parametrize(
    ("s1", "s2", "expected"),
    [
        ([0, 0, 64], [0, 0, 4, 16], [0, 0, 4, 16]),  # 0 of s2 over a 0 of s1: x's dimension still
        ([2, 3, 64], [0, -1, 16], [2, -1, 16]),  # 0 of s2 over a literal of s1
        ([0, -1, 16], [0, 0, 4, 4], None),  # 0 of s2 over s1's -1: unknown
        ([6, 64], [0, 0, 2], [6, 64, 2]),  # s2 longer than s1, its 0s within s1
        ([0, 0, 64], [0, 0, 1, 0], None),  # a 0 of s2 past s1's rank
    ],
)
def test_composed_shape(s1: list[int], s2: list[int], expected: list[int] | None) -> None:
    assert composed_shape(s1, s2) == expected


def _chains_model() -> onnx.ModelProto:
    """x [2, 3, 64]: a Split's strided heads reshaped out and back (folds), a chain of three
    (folds twice), one whose second shape needs the first's -1 (stays), one with allowzero (stays),
    and a Reshape read by two nodes (stays)."""
    ints = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    inits = [ints("heads", [0, 0, 4, 16]), ints("half", [8, 8]), ints("flat", [0, 0, 32]), ints("back", [0, 0, 4, 8]),
             ints("s_a", [6, 64]), ints("s_b", [0, 8, 8]), ints("s_c", [0, -1]), ints("s_d", [0, -1, 16]),
             ints("s_e", [0, 0, 4, 4]), ints("s_f", [2, 3, 64]), ints("s_g", [2, 3, 8, 8])]  # fmt: skip
    nodes = [
        helper.make_node("Reshape", ["x", "heads"], ["h4"]),
        helper.make_node("Split", ["h4", "half"], ["q4", "g4"], axis=-1),
        helper.make_node("Reshape", ["q4", "flat"], ["q"]),
        helper.make_node("Reshape", ["q", "back"], ["q_heads"]),  # folds with the one before
        helper.make_node("Reshape", ["g4", "flat"], ["g"]),
        helper.make_node("Reshape", ["x", "s_a"], ["a"]),
        helper.make_node("Reshape", ["a", "s_b"], ["b"]),
        helper.make_node("Reshape", ["b", "s_c"], ["c"]),  # a chain of three
        helper.make_node("Reshape", ["x", "s_d"], ["d"]),
        helper.make_node("Reshape", ["d", "s_e"], ["e"]),  # 0 over s_d's -1: stays
        helper.make_node("Reshape", ["x", "s_f"], ["f"], allowzero=1),
        helper.make_node("Reshape", ["f", "s_g"], ["f2"]),  # allowzero: stays
        helper.make_node("Reshape", ["x", "s_f"], ["k"]),
        helper.make_node("Reshape", ["k", "s_g"], ["k2"]),
        helper.make_node("Identity", ["k"], ["k_too"]),  # k read twice: stays
    ]
    outputs = ["q_heads", "g", "c", "e", "f2", "k2", "k_too"]
    graph = helper.make_graph(
        nodes, "chains", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 64])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def test_chains_fold_where_the_shape_is_known_and_results_stay() -> None:
    model = _chains_model()
    fused, report = fuse_graph(model, frozenset({"reshape_chains"}))
    assert report.reshape_chains == 3  # the query heads' pair; the chain of three, in two folds
    reshapes = [n for n in fused.graph.node if n.op_type == "Reshape"]
    assert len(reshapes) == len([n for n in model.graph.node if n.op_type == "Reshape"]) - 3
    assert not any(n.output[0] in ("q", "a", "b") for n in fused.graph.node)  # the folded inner values
    x = np.random.default_rng(0).standard_normal((2, 3, 64)).astype(np.float32)
    for before, after in zip(_run(model, x), _run(fused, x), strict=True):
        np.testing.assert_array_equal(before, after)


def test_gated_attention_query_heads_fold_on_a_built_package(tmp_path) -> None:
    """onnxgen's Qwen3.5 graph reshapes each gated attention layer's query heads out of the Split
    and straight back for the per-head norm: one fold per full-attention layer, none elsewhere."""
    config = TINY_CONFIGS["tiny-qwen3.5"]
    package = build_package(RandomSource(config), tmp_path / "pkg", precision="fp16", device="cuda")
    model = onnx.load(str(package / "model.onnx"))
    _, report = fuse_graph(model, DEVICE_REWRITES["cuda"])
    assert report.reshape_chains == config.layer_types.count("full_attention")
