"""Parity of the data-movement, sequence, control-flow, string and generator kernels with onnxruntime
(CPU) on random inputs. One table row per op configuration, run for each listed input type and
device. Random ops are checked by distribution (onnxruntime's draws cannot be matched bit for bit).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

from tests.conftest import DEVICES, HAS_CUDA, assert_parity, make_model, onnxgen_run, ort_run

F = ("float32", "float16")
ALL = ("float32", "float16", "int64", "int32", "bool")
NUM = ("float32", "float16", "int64", "int32")
NUM_NO_F16 = ("float32", "int64", "int32")  # onnxruntime has no fp16 scatter reductions


@dataclass(frozen=True)
class D:
    """A random data input of the row's dtype; ``kind`` shapes the values (``ties``: few distinct)."""

    shape: tuple[int, ...]
    kind: str = "any"


def I(*values: int) -> np.ndarray:  # noqa: E743 - a short literal for int64 shape inputs
    return np.array(values, dtype=np.int64)


@dataclass(frozen=True)
class Row:
    op: str
    dtypes: tuple[str, ...]
    inputs: tuple[Any, ...]  # D (random, row dtype), np.ndarray (fixed feed), None (missing)
    attrs: dict[str, Any] = field(default_factory=dict)
    outputs: int = 1
    opset: int = 21
    label: str = ""


def _random(rng: np.random.Generator, spec: D, dtype: str) -> np.ndarray:
    if dtype == "bool":
        return rng.random(spec.shape) > 0.5
    if spec.kind == "ties":  # few distinct values, so sorts/uniques meet equal keys
        return rng.integers(0, 4, spec.shape).astype(dtype)
    if spec.kind == "prob":
        return rng.random(spec.shape).astype(dtype)
    if dtype.startswith("float"):
        return rng.standard_normal(spec.shape).astype(dtype)
    if dtype.startswith("uint"):
        return rng.integers(0, 50, spec.shape).astype(dtype)
    return rng.integers(-20, 20, spec.shape).astype(dtype)


def _build(row: Row, dtype: str, seed: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    names, feeds, infos = [], {}, []
    for position, spec in enumerate(row.inputs):
        if spec is None:
            names.append("")
            continue
        name = f"in{position}"
        value = _random(rng, spec, dtype) if isinstance(spec, D) else spec
        names.append(name)
        feeds[name] = value
        elem = helper.np_dtype_to_tensor_dtype(value.dtype)
        infos.append(helper.make_tensor_value_info(name, elem, value.shape))
    outs = [f"out{i}" for i in range(row.outputs)]
    node = helper.make_node(row.op, names, outs, **row.attrs)
    out_infos = [helper.make_value_info(o, onnx.TypeProto()) for o in outs]
    return make_model([node], infos, out_infos, opset=row.opset, ms_opset=None), feeds


PAD_IN = (D((3, 4, 5)), I(1, 2, 0, 2, 1, 3))

ROWS: list[Row] = [
    # -- shape_ops
    Row("Shape", ALL, (D((2, 3, 4, 5)),)),
    Row("Shape", ("float32",), (D((2, 3, 4, 5)),), {"start": -3, "end": -1}, label="slice"),
    Row("Shape", ("float32",), (D((2, 3, 4, 5)),), {"start": 3, "end": 1}, label="empty"),
    Row("Size", ALL, (D((2, 3, 4)),)),
    Row("Reshape", ALL, (D((2, 3, 4)), I(0, -1, 2))),
    Row("Reshape", F, (D((0, 3, 4)), I(4, 0, 3)), {"allowzero": 1}, label="allowzero"),
    Row("Reshape", F, (D((2, 3, 4)), I(4, 0, 2)), {"allowzero": 0}, label="zero_copies"),
    Row("Flatten", ALL, (D((2, 3, 4, 5)),), {"axis": 2}),
    Row("Flatten", F, (D((2, 3, 4, 5)),), {"axis": 0}, label="axis0"),
    Row("Flatten", F, (D((2, 3, 4, 5)),), {"axis": -1}, label="neg"),
    Row("Squeeze", ALL, (D((1, 3, 1, 4)), I(-2, 0))),
    Row("Squeeze", F, (D((1, 3, 1, 4)),), label="all"),
    Row("Unsqueeze", ALL, (D((3, 4)), I(4, 0, -2))),
    Row("Transpose", ALL, (D((2, 3, 4, 5)),), {"perm": [2, 0, 3, 1]}),
    Row("Transpose", F, (D((2, 3, 4)),), label="default"),
    Row("Expand", ALL, (D((3, 1)), I(2, 1, 4))),
    Row("Expand", F, (D((2, 3, 4)), I(3, 1)), label="smaller"),
    Row("Tile", ALL, (D((2, 3)), I(2, 3))),
    Row("ConstantOfShape", ("int64",), (I(2, 3),), {"value": helper.make_tensor("v", TP.FLOAT16, [1], [1.5])}),
    Row("ConstantOfShape", ("int64",), (I(3, 0),), label="empty"),
    Row("Range", ("int64",), (np.array(10, np.int64), np.array(-3, np.int64), np.array(-4, np.int64))),
    Row("Range", ("int32",), (np.array(1, np.int32), np.array(8, np.int32), np.array(2, np.int32)), label="i32"),
    Row("Range", ("float32",), (np.array(0.5, np.float32), np.array(3.1, np.float32), np.array(0.3, np.float32))),
    Row("EyeLike", NUM, (D((4, 6)),), {"k": -1}),
    Row("EyeLike", ("float32",), (D((5, 3)),), {"k": 1, "dtype": TP.INT32}, label="dtype"),
    Row("Trilu", NUM, (D((2, 4, 5)), np.array(1, np.int64))),
    Row("Trilu", NUM, (D((4, 5)), np.array(-1, np.int64)), {"upper": 0}, label="lower"),
    Row("Trilu", F, (D((3, 3)),), {"upper": 0}, label="nok"),
    Row("OneHot", ("int64",), (D((2, 3)), np.array(7, np.int64), np.array([0.5, 2], np.float32))),
    # float indices hold whole numbers: onnxruntime 1.30 and 1.32 cast fractional ones differently
    Row(
        "OneHot",
        ("float32",),
        (
            np.array([[0, -1, 3], [6, -7, 2]], np.float32),
            np.array(7, np.float32),
            np.array([0.5, 2], np.float32),
        ),
        label="f32",
    ),
    Row(
        "OneHot",
        ("int64",),
        (D((2, 3)), np.array(25, np.int64), np.array([0, 3], np.int64)),
        {"axis": 1},
        label="axis",
    ),
    # -- indexing
    Row("Concat", ALL, (D((2, 3, 4)), D((2, 1, 4)), D((2, 2, 4))), {"axis": -2}),
    Row("Split", ALL, (D((7, 4)),), {"axis": 0, "num_outputs": 3}, outputs=3),
    Row("Split", F, (D((3, 6)), I(1, 0, 5)), {"axis": 1}, outputs=3, label="sizes"),
    Row("Split", F, (D((4, 6)),), {"axis": -1}, outputs=2, opset=13, label="equal13"),
    Row("Slice", ALL, (D((5, 6, 7)), I(1, -1), I(100, -100), I(0, -1), I(2, -3))),
    Row("Slice", F, (D((5, 6)), I(-2, 9), I(-100, 0), I(0, 1), I(-1, -2)), label="clamp"),
    Row("Slice", F, (D((5, 6)), I(1), I(4)), label="defaults"),
    Row("Slice", F, (D((5, 6)),), {"starts": [1, 0], "ends": [3, -1], "axes": [1, 0]}, opset=9, label="attrs"),
    Row("Gather", ALL, (D((5, 4, 3)), np.array([[0, -1], [3, -5]], np.int64)), {"axis": 0}),
    Row("Gather", F, (D((5, 4, 3)), np.array([2, -1, 0], np.int32)), {"axis": -1}, label="axis"),
    Row("Gather", F, (D((5, 4)), np.array(-2, np.int64)), {"axis": 1}, label="scalar"),
    Row("GatherElements", ALL, (D((3, 4)), np.array([[0, -1, 2, 1], [2, 2, -3, 0]], np.int64)), {"axis": 0}),
    Row("GatherND", ALL, (D((2, 3, 4)), np.array([[[1, 2]], [[-1, 0]]], np.int64)), {"batch_dims": 1}),
    Row("GatherND", F, (D((2, 3, 4)), np.array([[1], [0], [1]], np.int64)), label="rows"),
    Row("ScatterElements", ALL, (D((3, 4)), np.array([[1, 0, 2, 0], [0, 2, 1, 1]]), D((2, 4))), {"axis": 0}),
    *[
        Row(
            "ScatterElements",
            NUM_NO_F16,
            (D((3, 4)), np.array([[1, 1, 3, -1], [0, 0, 2, 2]]), D((2, 4))),
            {"axis": 1, "reduction": r},
            label=r,
        )
        for r in ("add", "mul", "max", "min")
    ],
    Row("ScatterND", ALL, (D((4, 3, 2)), np.array([[1, 2], [-1, 0]], np.int64), D((2, 2)))),
    *[
        Row(
            "ScatterND",
            NUM_NO_F16,
            (D((4, 3)), np.array([[1], [3], [1]], np.int64), D((3, 3))),
            {"reduction": r},
            label=r,
        )
        for r in ("add", "mul", "max", "min")
    ],
    Row("Compress", ALL, (D((3, 4)), np.array([True, False, True])), {"axis": 0}),
    Row("Compress", F, (D((3, 4)), np.array([False, True, True, False, True])), label="flat"),
    Row("NonZero", ("float32", "int64", "bool"), (D((3, 4, 2), "ties"),)),
    Row("Unique", ("float32", "int64"), (D((12,), "ties"),), outputs=4),
    Row("Unique", ("float32", "int64"), (D((12,), "ties"),), {"sorted": 0}, outputs=4, label="unsorted"),
    Row("Unique", ("float32", "int64"), (D((5, 2), "ties"),), {"axis": 0}, outputs=4, label="axis"),
    Row("TopK", ("float32", "float16", "int64", "int32"), (D((3, 9), "ties"), I(4)), outputs=2),
    Row("TopK", ("float32", "int64"), (D((6, 3), "ties"), I(3)), {"axis": 0, "largest": 0}, outputs=2, label="min"),
    Row("TopK", ("float32",), (D((2, 5, 3)), I(5)), {"axis": 1}, outputs=2, label="full"),
    Row("Pad", NUM + ("bool",), PAD_IN),
    Row("Pad", NUM, (D((3, 4, 5)), I(1, -1, 0, 2, 1, -2)), {"mode": "edge"}, label="edge"),
    Row("Pad", NUM, (D((3, 4, 5)), I(2, 3, 0, 1, 0, 4)), {"mode": "reflect"}, label="reflect"),
    Row("Pad", F, (D((3, 4, 5)), I(1, 3, 0, 2), None, I(0, -1)), {"mode": "reflect"}, label="reflect_axes"),
    Row("Pad", NUM, (D((3, 4, 5)), I(2, 1, 0, 4, 2, 1)), {"mode": "wrap"}, label="wrap"),
    Row("Pad", ("float32",), (D((3, 4, 5)), I(1, 2, 3, 1), np.array(2.5, np.float32), I(-1, 0)), label="axes"),
    Row("ReverseSequence", ALL, (D((4, 3, 2)), I(4, 1, 3)), {"batch_axis": 1, "time_axis": 0}),
    Row("ReverseSequence", F, (D((3, 4)), I(2, 4, 1)), {"batch_axis": 0, "time_axis": 1}, label="batch0"),
    Row("DepthToSpace", F, (D((1, 8, 2, 3)),), {"blocksize": 2}),
    Row("DepthToSpace", F, (D((2, 8, 2, 3)),), {"blocksize": 2, "mode": "CRD"}, label="crd"),
    Row("SpaceToDepth", F, (D((2, 3, 4, 6)),), {"blocksize": 2}),
    Row("CenterCropPad", NUM, (D((5, 4, 3)), I(3, 7)), {"axes": [0, -1]}),
]


def _row_id(row: Row) -> str:
    return f"{row.op}-{row.label}" if row.label else row.op


PARAMS = [pytest.param(row, dtype, id=f"{_row_id(row)}-{dtype}") for row in ROWS for dtype in row.dtypes]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("row", "dtype"), PARAMS)
def test_op_parity(row: Row, dtype: str, device: str) -> None:
    model, feeds = _build(row, dtype, zlib.crc32(f"{_row_id(row)}-{dtype}".encode()))
    assert_parity(model, feeds, device, rtol=0, atol=0)


# Kernels that declare themselves capturable must record into a CUDA graph, and a replay must
# follow new input values (nothing baked in but shapes and host inputs).
CAPTURE_PARAMS = [pytest.param(row, row.dtypes[0], id=f"{_row_id(row)}-{row.dtypes[0]}") for row in ROWS]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize(("row", "dtype"), CAPTURE_PARAMS)
def test_capturable_kernels_record_and_replay(row: Row, dtype: str) -> None:
    import torch

    from onnxgen.runtime import InferenceSession
    from onnxgen.runtime.dtypes import numpy_to_torch

    model, feeds = _build(row, dtype, zlib.crc32(f"{_row_id(row)}-{dtype}".encode()))
    (node,) = InferenceSession(model, device="cuda").program.nodes
    if node.spec.capture is not None or node.on_host:
        pytest.skip(f"not capturable: {node.spec.capture or 'runs on the host'}")
    args = []
    for position, name in enumerate(node.inputs):
        value = numpy_to_torch(feeds[name]) if name else None
        if value is not None and position not in node.host_input_positions:
            value = value.cuda()
        args.append(value)

    def call() -> tuple:
        out = node.spec.fn(node.ctx, *args)
        return out if isinstance(out, tuple) else (out,)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # warm-up outside the recording, as the capture planner does
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recorded = call()
    for arg, spec in zip(args, row.inputs):  # new values in the same buffers
        if isinstance(spec, D) and arg is not None:
            arg.copy_(numpy_to_torch(_random(np.random.default_rng(99), spec, dtype)).cuda())
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(recorded, call()):
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_shape_arithmetic_chain(device: str) -> None:
    """Shape -> Gather/Slice -> Concat -> Reshape: on CUDA these run on the host, on small int64 CPU tensors."""
    t = helper.make_tensor_value_info
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "last"], ["d_last"], axis=0),
        helper.make_node("Slice", ["shape", "zero", "two"], ["lead"]),
        helper.make_node("Unsqueeze", ["d_last", "zero"], ["d_last1"]),
        helper.make_node("Concat", ["lead", "minus1", "d_last1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
        helper.make_node("Squeeze", ["d_last1", "zero"], ["scalar"]),
        helper.make_node("Size", ["x"], ["n"]),
    ]
    inits = [
        helper.make_tensor("last", TP.INT64, [], [-1]),
        helper.make_tensor("zero", TP.INT64, [1], [0]),
        helper.make_tensor("two", TP.INT64, [1], [2]),
        helper.make_tensor("minus1", TP.INT64, [1], [-1]),
    ]
    outs = [helper.make_value_info(n, onnx.TypeProto()) for n in ("y", "target", "scalar", "n")]
    model = make_model(nodes, [t("x", TP.FLOAT16, [2, 3, 4, 5])], outs, inits, ms_opset=None)
    x = np.random.default_rng(5).standard_normal((2, 3, 4, 5)).astype(np.float16)
    assert_parity(model, {"x": x}, device, rtol=0, atol=0)
    if device == "cuda":
        from onnxgen.runtime import InferenceSession

        steps = InferenceSession(model, device="cuda").program.nodes
        assert [s.ctx.op_type for s in steps if not s.on_host] == ["Reshape"]


# -- sequences and optionals -------------------------------------------------------------------


def _seq_model() -> onnx.ModelProto:
    """Construct, insert (front and default back), erase, at, length, concat and stack."""
    t = helper.make_tensor_value_info
    nodes = [
        helper.make_node("SequenceConstruct", ["a", "b"], ["s0"]),
        helper.make_node("SequenceInsert", ["s0", "c", "zero"], ["s1"]),
        helper.make_node("SequenceInsert", ["s1", "a"], ["s2"]),
        helper.make_node("SequenceErase", ["s2", "one"], ["s3"]),
        helper.make_node("SequenceAt", ["s3", "minus1"], ["last"]),
        helper.make_node("SequenceLength", ["s3"], ["n"]),
        helper.make_node("ConcatFromSequence", ["s3"], ["cat"], axis=1),
        helper.make_node("SplitToSequence", ["cat", "two"], ["parts"], axis=1),
        helper.make_node("ConcatFromSequence", ["parts"], ["stacked"], axis=0, new_axis=1),
        helper.make_node("SplitToSequence", ["a"], ["rows"], axis=0, keepdims=0),
        helper.make_node("ConcatFromSequence", ["rows"], ["rowcat"], axis=-1),
    ]
    inits = [
        helper.make_tensor("zero", TP.INT64, [], [0]),
        helper.make_tensor("one", TP.INT64, [], [1]),
        helper.make_tensor("minus1", TP.INT32, [], [-1]),
        helper.make_tensor("two", TP.INT64, [], [2]),
    ]
    ins = [t(n, TP.FLOAT, [2, 2]) for n in ("a", "b", "c")]
    outs = [helper.make_value_info(n, onnx.TypeProto()) for n in ("last", "n", "cat", "stacked", "rowcat")]
    return make_model(nodes, ins, outs, inits, ms_opset=None)


@pytest.mark.parametrize("device", DEVICES)
def test_sequence_ops(device: str) -> None:
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal((2, 2)).astype(np.float32) for n in ("a", "b", "c")}
    assert_parity(_seq_model(), feeds, device, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_optional_ops(device: str) -> None:
    tensor_type = helper.make_tensor_type_proto(TP.FLOAT, [3])
    nodes = [
        helper.make_node("Optional", ["x"], ["some"]),
        helper.make_node("Optional", [], ["none"], type=tensor_type),
        helper.make_node("OptionalHasElement", ["some"], ["has_some"]),
        helper.make_node("OptionalHasElement", ["none"], ["has_none"]),
        helper.make_node("OptionalGetElement", ["some"], ["got"]),
    ]
    ins = [helper.make_tensor_value_info("x", TP.FLOAT, [3])]
    outs = [helper.make_value_info(n, onnx.TypeProto()) for n in ("has_some", "has_none", "got")]
    model = make_model(nodes, ins, outs, ms_opset=None)
    assert_parity(model, {"x": np.arange(3, dtype=np.float32)}, device)


# -- control flow with outer-scope references --------------------------------------------------


def _if_model() -> onnx.ModelProto:
    t = helper.make_tensor_value_info
    then_graph = helper.make_graph(
        [helper.make_node("Add", ["x", "bias"], ["then_out"])], "then", [], [t("then_out", TP.FLOAT, None)]
    )
    else_graph = helper.make_graph(
        [
            helper.make_node("Concat", ["bias", "x"], ["cat"], axis=0),
            helper.make_node("Transpose", ["cat"], ["else_out"]),
        ],
        "else",
        [],
        [t("else_out", TP.FLOAT, None)],
    )
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=then_graph, else_branch=else_graph)]
    ins = [t("cond", TP.BOOL, []), t("x", TP.FLOAT, [2, 3]), t("bias", TP.FLOAT, [2, 3])]
    return make_model(nodes, ins, [t("y", TP.FLOAT, None)], ms_opset=None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cond", [True, False])
def test_if_outer_scope(cond: bool, device: str) -> None:
    rng = np.random.default_rng(2)
    feeds = {
        "cond": np.array(cond),
        "x": rng.standard_normal((2, 3)).astype(np.float32),
        "bias": rng.standard_normal((2, 3)).astype(np.float32),
    }
    assert_parity(_if_model(), feeds, device)


def _loop_model() -> onnx.ModelProto:
    """acc += table[i] each step; the scan output is acc; stops at trip count or when keep[i] is false."""
    t = helper.make_tensor_value_info
    body = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "i"], ["row"], axis=0),  # outer-scope table
            helper.make_node("Add", ["acc_in", "row"], ["acc_out"]),
            helper.make_node("Gather", ["keep", "i"], ["cond_out"], axis=0),  # outer-scope keep
            helper.make_node("Unsqueeze", ["acc_out", "axis0"], ["scan_out"]),
        ],
        "body",
        [t("i", TP.INT64, []), t("cond_in", TP.BOOL, []), t("acc_in", TP.FLOAT, [3])],
        [t("cond_out", TP.BOOL, []), t("acc_out", TP.FLOAT, [3]), t("scan_out", TP.FLOAT, [1, 3])],
        initializer=[helper.make_tensor("axis0", TP.INT64, [1], [0])],
    )
    nodes = [helper.make_node("Loop", ["trips", "", "acc0"], ["acc", "scans"], body=body)]
    ins = [t("trips", TP.INT64, []), t("acc0", TP.FLOAT, [3]), t("table", TP.FLOAT, [6, 3]), t("keep", TP.BOOL, [6])]
    outs = [t("acc", TP.FLOAT, None), t("scans", TP.FLOAT, None)]
    return make_model(nodes, ins, outs, ms_opset=None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("trips", "stop_at"), [(4, 6), (6, 2), (0, 6)])
def test_loop_outer_scope(trips: int, stop_at: int, device: str) -> None:
    rng = np.random.default_rng(3)
    keep = np.arange(6) < stop_at
    feeds = {
        "trips": np.array(trips, np.int64),
        "acc0": rng.standard_normal(3).astype(np.float32),
        "table": rng.standard_normal((6, 3)).astype(np.float32),
        "keep": keep,
    }
    assert_parity(_loop_model(), feeds, device)


@pytest.mark.parametrize("device", DEVICES)
def test_scan_axes_directions(device: str) -> None:
    """Running sum over axis 1 read backwards; outputs stacked on axis 1, the second one reversed."""
    t = helper.make_tensor_value_info
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "x_t"], ["s_out"]), helper.make_node("Add", ["s_out", "x_t"], ["y_t"])],
        "body",
        [t("s_in", TP.FLOAT, [2]), t("x_t", TP.FLOAT, [2])],
        [t("s_out", TP.FLOAT, [2]), t("y_t", TP.FLOAT, [2])],
    )
    node = helper.make_node(
        "Scan",
        ["s0", "x"],
        ["s", "y"],
        body=body,
        num_scan_inputs=1,
        scan_input_axes=[1],
        scan_input_directions=[1],
        scan_output_axes=[-1],
        scan_output_directions=[1],
    )
    ins = [t("s0", TP.FLOAT, [2]), t("x", TP.FLOAT, [2, 5])]
    model = make_model([node], ins, [t("s", TP.FLOAT, None), t("y", TP.FLOAT, None)], ms_opset=None)
    rng = np.random.default_rng(4)
    feeds = {"s0": rng.standard_normal(2).astype(np.float32), "x": rng.standard_normal((2, 5)).astype(np.float32)}
    assert_parity(model, feeds, device)


# -- strings -----------------------------------------------------------------------------------


def _string_model(op: str, n_in: int, n_out: int, **attrs: Any) -> onnx.ModelProto:
    ins = [helper.make_tensor_value_info(f"s{i}", TP.STRING, None) for i in range(n_in)]
    outs = [helper.make_value_info(f"o{i}", onnx.TypeProto()) for i in range(n_out)]
    node = helper.make_node(op, [f"s{i}" for i in range(n_in)], [f"o{i}" for i in range(n_out)], **attrs)
    return make_model([node], ins, outs, ms_opset=None)


WORDS = np.array([["The cat", "a  dog ", "MONDAY"], ["x-y--z", "", "émigré Straße"]], dtype=object)


@pytest.mark.parametrize(
    ("op", "n_in", "n_out", "attrs", "inputs"),
    [
        ("StringConcat", 2, 1, {}, (WORDS, np.array(["!", "?", "."], dtype=object))),
        ("StringSplit", 1, 2, {}, (WORDS,)),
        ("StringSplit", 1, 2, {"delimiter": "-", "maxsplit": 2}, (WORDS,)),
        ("StringSplit", 1, 2, {"delimiter": " "}, (WORDS,)),
        ("RegexFullMatch", 1, 1, {"pattern": r"[A-Z][a-z]+ \w+|x(-+\w)*"}, (WORDS,)),
    ],
    ids=["concat", "split_ws", "split_max", "split_space", "regex"],
)
def test_string_ops(op: str, n_in: int, n_out: int, attrs: dict, inputs: tuple) -> None:
    model = _string_model(op, n_in, n_out, **attrs)
    feeds = {f"s{i}": v for i, v in enumerate(inputs)}
    expected, actual = ort_run(model, feeds), onnxgen_run(model, feeds)
    for e, a in zip(expected, actual):
        assert a.shape == e.shape
        assert a.tolist() == e.tolist()


@pytest.mark.parametrize(
    ("attrs", "x", "expected"),
    [
        ({"case_change_action": "UPPER", "stopwords": ["monday"]}, WORDS[0], ["THE CAT", "A  DOG "]),
        (
            {"case_change_action": "LOWER", "is_case_sensitive": 1, "stopwords": ["MONDAY"]},
            WORDS[:1],
            [["the cat", "a  dog "]],
        ),
        ({"is_case_sensitive": 1, "stopwords": ["monday"]}, WORDS[0], ["The cat", "a  dog ", "MONDAY"]),
        ({"stopwords": ["MonDay"]}, WORDS[0, 2:], [""]),
        ({"stopwords": ["MonDay"]}, WORDS[:1, 2:], [[""]]),
    ],
    ids=["upper", "lower_2d", "case_sensitive", "all_dropped", "all_dropped_2d"],
)
def test_string_normalizer(attrs: dict, x: np.ndarray, expected: list) -> None:
    """Expected values from the spec (onnxruntime needs an installed en_US.UTF-8 locale to run it)."""
    (actual,) = onnxgen_run(_string_model("StringNormalizer", 1, 1, **attrs), {"s0": x})
    assert actual.tolist() == expected


# -- generators --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["HannWindow", "HammingWindow", "BlackmanWindow"])
@pytest.mark.parametrize("periodic", [0, 1])
def test_windows(op: str, periodic: int, device: str) -> None:
    node = helper.make_node(op, ["n"], ["w"], periodic=periodic, output_datatype=TP.DOUBLE)
    model = make_model(
        [node],
        [helper.make_tensor_value_info("n", TP.INT64, [])],
        [helper.make_value_info("w", onnx.TypeProto())],
        ms_opset=None,
    )
    assert_parity(model, {"n": np.array(11, np.int64)}, device, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_random_ops_distribution(device: str) -> None:
    """Same shape and dtype as onnxruntime; moments and ranges as the attributes ask; seeded runs repeat."""
    nodes = [
        helper.make_node("RandomUniform", [], ["u"], shape=[200, 100], low=-2.0, high=3.0, seed=1.0),
        helper.make_node("RandomNormal", [], ["n"], shape=[200, 100], mean=1.0, scale=0.5, dtype=TP.DOUBLE),
        helper.make_node("RandomUniformLike", ["like"], ["ul"]),
        helper.make_node("RandomNormalLike", ["like"], ["nl"], dtype=TP.FLOAT),
        helper.make_node("Bernoulli", ["p"], ["b"]),
        helper.make_node("Multinomial", ["logits"], ["m"], sample_size=4000),
    ]
    ins = [
        helper.make_tensor_value_info("like", TP.FLOAT16, [100, 100]),
        helper.make_tensor_value_info("p", TP.FLOAT, [20000]),
        helper.make_tensor_value_info("logits", TP.FLOAT, [2, 3]),
    ]
    outs = [helper.make_value_info(n, onnx.TypeProto()) for n in ("u", "n", "ul", "nl", "b", "m")]
    model = make_model(nodes, ins, outs, ms_opset=None)
    probs = np.array([[0.2, 0.3, 0.5], [0.7, 0.2, 0.1]], np.float32)
    feeds = {
        "like": np.zeros((100, 100), np.float16),
        "p": np.full(20000, 0.3, np.float32),
        "logits": np.log(probs),
    }
    expected = ort_run(model, feeds)
    actual = onnxgen_run(model, feeds, device)
    for e, a in zip(expected, actual):
        assert (a.dtype, a.shape) == (e.dtype, e.shape)
    u, n, ul, nl, b, m = actual
    assert -2 <= u.min() and u.max() < 3 and abs(u.mean() - 0.5) < 0.05
    assert abs(n.mean() - 1.0) < 0.02 and abs(n.std() - 0.5) < 0.02
    assert 0 <= ul.min() and ul.max() <= 1 and abs(ul.astype(np.float64).mean() - 0.5) < 0.02
    assert abs(nl.mean()) < 0.05 and abs(nl.std() - 1) < 0.05
    assert set(np.unique(b)) <= {0.0, 1.0} and abs(b.mean() - 0.3) < 0.02
    for row in range(2):
        freq = np.bincount(m[row], minlength=3) / m.shape[1]
        np.testing.assert_allclose(freq, probs[row], atol=0.03)
    again = onnxgen_run(model, feeds, device)
    np.testing.assert_array_equal(again[0], u)  # seeded: a fresh session repeats its draws
