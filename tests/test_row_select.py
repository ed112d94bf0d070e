"""runtime/row_select.py: an output computed at one row of axis 1, in the last-layer forms that
onnxgen's and onnxruntime-genai's builders write. The oracle: onnxruntime on the graph as written,
whose row r must be what the rewritten graph gives for row r."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from onnxgen.runtime import InferenceSession
from onnxgen.runtime.row_select import select_row
from tests.conftest import ort_run

HIDDEN, VOCAB = 8, 11
ROW = "row"


def _model(nodes, inits, inputs, opsets=(("", 17), ("com.microsoft", 1))) -> onnx.ModelProto:
    outputs = [helper.make_tensor_value_info("logits", TP.FLOAT, ["batch", "seq", VOCAB])]
    graph = helper.make_graph(nodes, "head", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 8
    return model


def _hidden(name: str = "x") -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TP.FLOAT, ["batch", "seq", HIDDEN])


def _init(name: str, shape, seed: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), name)


def matmul_head() -> onnx.ModelProto:
    return _model([helper.make_node("MatMul", ["x", "W"], ["logits"])], [_init("W", (HIDDEN, VOCAB), 1)], [_hidden()])


def skip_norm_head() -> onnx.ModelProto:
    """The final residual add and RMSNorm as one SkipSimplifiedLayerNormalization, then the lm_head."""
    nodes = [
        helper.make_node(
            "SkipSimplifiedLayerNormalization",
            ["x", "res", "gamma"],
            ["normed", "", "", "sum"],
            domain="com.microsoft",
            epsilon=1e-5,
        ),  # fmt: skip
        helper.make_node("MatMul", ["normed", "W"], ["logits"]),
    ]
    inits = [_init("gamma", (HIDDEN,), 2), _init("W", (HIDDEN, VOCAB), 1)]
    return _model(nodes, inits, [_hidden(), _hidden("res")])


def tied_gemm_head() -> onnx.ModelProto:
    """onnxgen's tied float lm_head: Reshape -> Gemm(transB) over the embedding table -> Reshape back."""
    nodes = [
        helper.make_node("SimplifiedLayerNormalization", ["x", "gamma"], ["normed"], epsilon=1e-5, axis=-1),
        helper.make_node("Reshape", ["normed", "flat_shape"], ["flat"]),
        helper.make_node("Gemm", ["flat", "table"], ["y"], transB=1),
        helper.make_node("Shape", ["normed"], ["lead"], start=0, end=2),
        helper.make_node("Concat", ["lead", "vocab"], ["out_shape"], axis=0),
        helper.make_node("Reshape", ["y", "out_shape"], ["logits"]),
    ]
    inits = [
        _init("gamma", (HIDDEN,), 2),
        _init("table", (VOCAB, HIDDEN), 3),
        numpy_helper.from_array(np.array([-1, HIDDEN], np.int64), "flat_shape"),
        numpy_helper.from_array(np.array([VOCAB], np.int64), "vocab"),
    ]
    return _model(nodes, inits, [_hidden()])


def matmul_nbits_head() -> onnx.ModelProto:
    from onnxgen.models.quantize import quantize_4bit

    weight = np.random.default_rng(4).standard_normal((VOCAB, HIDDEN * 4)).astype(np.float32)
    packed, scales, zeros = quantize_4bit(weight, block_size=32).matmulnbits_tensors()
    node = helper.make_node("MatMulNBits", ["x", "B", "scales", "zp"], ["logits"], domain="com.microsoft",
                            K=HIDDEN * 4, N=VOCAB, bits=4, block_size=32)  # fmt: skip
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "scales"),
             numpy_helper.from_array(zeros, "zp")]  # fmt: skip
    x = helper.make_tensor_value_info("x", TP.FLOAT, ["batch", "seq", HIDDEN * 4])
    return _model([node], inits, [x])


FORMS = {"matmul": matmul_head, "skip_norm": skip_norm_head, "tied_gemm": tied_gemm_head}


def _feeds(model: onnx.ModelProto, batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    shapes = {vi.name: [d.dim_value or 0 for d in vi.type.tensor_type.shape.dim] for vi in model.graph.input}
    return {name: rng.standard_normal((batch, seq, dims[-1])).astype(np.float32) for name, dims in shapes.items()}


@pytest.mark.parametrize("form", [*FORMS, "matmul_nbits"])
@pytest.mark.parametrize(("batch", "seq", "row"), [(1, 6, 5), (2, 5, 2), (1, 1, 0)])
def test_the_rewritten_graph_gives_the_chosen_row(form: str, batch: int, seq: int, row: int) -> None:
    if form == "matmul_nbits":
        pytest.importorskip("onnxruntime")
        model = matmul_nbits_head()
    else:
        model = FORMS[form]()
    rewritten, why_not = select_row(model, "logits", ROW)
    assert why_not is None
    assert sum(n.op_type == "RowSelect" for n in rewritten.graph.node) == (2 if form == "skip_norm" else 1)
    feeds = _feeds(model, batch, seq)
    expected = ort_run(model, feeds)[0][:, row : row + 1]
    session = InferenceSession(rewritten)
    got = session.run(None, {**feeds, ROW: np.array([row], np.int64)})[0]
    assert got.shape == (batch, 1, VOCAB)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["matmul", "skip_norm", "tied_gemm"])
def test_a_row_per_batch_entry_picks_each_entry_its_own(form: str) -> None:
    """Prompts of different lengths in one batch (padded): each entry's logits at its own last row."""
    model = FORMS[form]()
    rewritten, why_not = select_row(model, "logits", ROW)
    assert why_not is None
    feeds = _feeds(model, 3, 6)
    rows = [5, 0, 3]
    full = ort_run(model, feeds)[0]
    expected = np.stack([full[b, r : r + 1] for b, r in enumerate(rows)])
    got = InferenceSession(rewritten).run(None, {**feeds, ROW: np.array(rows, np.int64)})[0]
    assert got.shape == (3, 1, VOCAB)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_one_row_passes_through_without_a_copy() -> None:
    """A one-token decode step: RowSelect hands its input on (no kernel, nothing captured for it)."""
    from onnxgen.runtime.ops import fused

    x = torch.randn(1, 1, HIDDEN)
    assert fused.row_select(None, x, torch.zeros(1, dtype=torch.int64)) is x  # type: ignore[arg-type]


def test_a_norm_whose_sum_is_read_elsewhere_picks_the_row_after_it() -> None:
    """The Skip norm's residual sum feeds a second output: the norm must run on every row, so the
    row is picked between the norm and the lm_head (still right, one kernel more)."""
    model = skip_norm_head()
    model.graph.output.append(helper.make_tensor_value_info("sum", TP.FLOAT, ["batch", "seq", HIDDEN]))
    rewritten, why_not = select_row(model, "logits", ROW)
    assert why_not is None
    select = next(n for n in rewritten.graph.node if n.op_type == "RowSelect")
    assert list(select.input) == ["normed", ROW]
    feeds = _feeds(skip_norm_head(), 1, 4)
    expected = ort_run(model, feeds)
    got = InferenceSession(rewritten).run(None, {**feeds, ROW: np.array([3], np.int64)})
    np.testing.assert_allclose(got[0], expected[0][:, 3:4], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-6)  # the sum keeps every row


def test_forms_it_cannot_prove_are_left_alone_with_the_reason() -> None:
    softcapped = matmul_head()
    softcapped.graph.node[0].output[0] = "raw"
    softcapped.graph.node.append(helper.make_node("Tanh", ["raw"], ["logits"]))
    model, why = select_row(softcapped, "logits", ROW)
    assert model is softcapped and "Tanh" in why and "not a MatMul" in why

    computed_weight = matmul_head()
    computed_weight.graph.input.append(helper.make_tensor_value_info("W2", TP.FLOAT, [HIDDEN, VOCAB]))
    computed_weight.graph.node[0].input[1] = "W2"
    assert "not constants" in select_row(computed_weight, "logits", ROW)[1]

    read_twice = matmul_head()
    read_twice.graph.node.append(helper.make_node("Identity", ["x"], ["copy"]))
    read_twice.graph.output.append(helper.make_tensor_value_info("copy", TP.FLOAT, ["batch", "seq", HIDDEN]))
    assert "read elsewhere" in select_row(read_twice, "logits", ROW)[1]

    assert "already has an input" in select_row(matmul_head(), "logits", "x")[1]
