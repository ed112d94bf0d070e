"""InferenceSession.run's contract with its caller, against onnxruntime as the oracle.

* Returned arrays belong to the caller: writing into one changes neither the model, nor the
  caller's feeds, nor another returned array, nor the next run (onnxruntime returns owned arrays).
* Indexing ops refuse out-of-range indices (onnxruntime fails with "out of bounds"), naming the
  op, the node, the index and the valid range.
* Feeds are taken as onnxruntime takes them (lists converted with the declared dtype,
  negative-stride arrays); what onnxruntime refuses gets onnxgen's own clear error.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from onnxgen.errors import InvalidInputError, ModelLoadError, OnnxgenError, OpError
from onnxgen.runtime import InferenceSession
from tests.conftest import make_model, ort_run

# -- 2. returned arrays are the caller's ----------------------------------------------------------

W = np.arange(6, dtype=np.float32).reshape(2, 3)


def _vi(name: str, elem: int = TP.FLOAT, shape: list | None = None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _int64(name: str, values: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _alias_model(nodes: list[onnx.NodeProto], outputs: list[str], extra_inits: list | None = None) -> onnx.ModelProto:
    """x: [2, 3] float input, w: a [2, 3] initializer; every output untyped beyond float."""
    inits = [numpy_helper.from_array(W, "w"), *(extra_inits or [])]
    return make_model(nodes, [_vi("x", shape=[2, 3])], [_vi(o) for o in outputs], inits)


def _const_node() -> onnx.NodeProto:
    return helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(W + 10, "cv"))


ALIAS_ROUTES = {
    "output is the graph input": ([], ["x"]),
    "output is an initializer": ([], ["w"]),
    "output is a Constant": ([_const_node()], ["c"]),
    "Identity of the input": ([helper.make_node("Identity", ["x"], ["y"])], ["y"]),
    "Identity of an initializer": ([helper.make_node("Identity", ["w"], ["y"])], ["y"]),
    "Reshape of an initializer": ([helper.make_node("Reshape", ["w", "shape"], ["y"])], ["y"]),
    "Flatten of the input": ([helper.make_node("Flatten", ["x"], ["y"], axis=0)], ["y"]),
    "Squeeze of an Unsqueeze of the input": (
        [helper.make_node("Unsqueeze", ["x", "ax0"], ["u"]), helper.make_node("Squeeze", ["u", "ax0"], ["y"])],
        ["y"],
    ),
    "Slice (whole) of an initializer": ([helper.make_node("Slice", ["w", "s0", "s2"], ["y"])], ["y"]),
    "Slice (rows) of the input": ([helper.make_node("Slice", ["x", "s0", "s1"], ["y"])], ["y"]),
    "Expand of an initializer row": (
        [helper.make_node("Slice", ["w", "s0", "s1"], ["r"]), helper.make_node("Expand", ["r", "shape"], ["y"])],
        ["y"],
    ),
    "Cast of the input to its own type": ([helper.make_node("Cast", ["x"], ["y"], to=TP.FLOAT)], ["y"]),
    "two outputs, one value": (
        [helper.make_node("Add", ["x", "w"], ["s"]), helper.make_node("Identity", ["s"], ["y"])],
        ["s", "y"],
    ),
    "input and its Identity": ([helper.make_node("Identity", ["x"], ["y"])], ["x", "y"]),
}
ALIAS_INITS = [_int64("shape", [2, 3]), _int64("ax0", [0]), _int64("s0", [0]), _int64("s1", [1]), _int64("s2", [2])]


@pytest.mark.parametrize("route", list(ALIAS_ROUTES))
def test_returned_arrays_are_owned_by_the_caller(route: str) -> None:
    nodes, outputs = ALIAS_ROUTES[route]
    model = _alias_model(nodes, outputs, ALIAS_INITS)
    x = np.full((2, 3), 7.0, np.float32)
    want = ort_run(model, {"x": x.copy()})
    session = InferenceSession(model)
    first = session.run(None, {"x": x})
    for got, expected in zip(first, want):
        np.testing.assert_array_equal(got, expected)
    for array in first:  # the caller scribbles over every returned array
        assert array.flags.writeable
        array[...] = -1.0
    np.testing.assert_array_equal(x, np.full((2, 3), 7.0, np.float32))  # the feed is untouched
    for got, expected in zip(session.run(None, {"x": x}), want):  # the model is untouched
        np.testing.assert_array_equal(got, expected)
    again = session.run(None, {"x": x})
    again[0][(0,) * again[0].ndim] = 99.0
    for other, expected in zip(again[1:], want[1:]):  # the outputs do not alias one another
        np.testing.assert_array_equal(other, expected)


def test_same_output_twice_gives_two_arrays() -> None:
    model = _alias_model([helper.make_node("Add", ["x", "w"], ["s"])], ["s"])
    a, b = InferenceSession(model).run(["s", "s"], {"x": np.ones((2, 3), np.float32)})
    a[...] = 0
    np.testing.assert_array_equal(b, W + 1)


def test_fresh_outputs_are_not_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only shared storage is copied: an output computed by the run is handed out as it is."""
    model = _alias_model([helper.make_node("Add", ["x", "w"], ["s"])], ["s"])
    session = InferenceSession(model)
    clones: list[int] = []
    original = torch.Tensor.clone

    def counting_clone(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        clones.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    (s,) = session.run(None, {"x": np.ones((2, 3), np.float32)})
    np.testing.assert_array_equal(s, W + 1)
    assert not clones


def test_if_branch_returning_its_initializer_is_copied() -> None:
    branch = helper.make_graph(
        [helper.make_node("Identity", ["bw"], ["bo"])], "then", [], [_vi("bo")], [numpy_helper.from_array(W, "bw")]
    )
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["eo"])], "else", [], [_vi("eo")])
    model = make_model(
        [helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=other)],
        [_vi("cond", TP.BOOL, []), _vi("x", shape=[2, 3])],
        [_vi("y")],
    )
    session = InferenceSession(model)
    feeds = {"cond": np.array(True), "x": np.zeros((2, 3), np.float32)}
    session.run(None, feeds)[0][...] = -5
    np.testing.assert_array_equal(session.run(None, feeds)[0], ort_run(model, feeds)[0])


def test_feeds_written_in_place_by_a_kernel_stay_the_callers() -> None:
    """GroupQueryAttention's shared KV layout writes the step's rows into past_key/past_value; run()
    (numpy, onnxruntime's contract) must leave the caller's arrays as they were, as onnxruntime does."""
    from tests.test_ops_contrib import GqaCase

    case = GqaCase()
    model = case.model()
    rng = np.random.default_rng(0)
    past = tuple(rng.standard_normal((1, case.kv_heads, 12, case.head_size)).astype(np.float32) for _ in "kv")
    feeds = case.feeds(rng, 1, [6], past)  # capacity 12 >= 6 tokens: the shared layout
    before = [p.copy() for p in past]
    want = ort_run(model, feeds)
    got = InferenceSession(model).run(None, feeds)
    np.testing.assert_array_equal(past[0], before[0])
    np.testing.assert_array_equal(past[1], before[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1][:, :, :6], want[1][:, :, :6], rtol=1e-5, atol=1e-6)


# -- 3. out-of-range indices ----------------------------------------------------------------------

D = np.arange(6, dtype=np.float32).reshape(3, 2)


def _index_model(op: str, extra_inputs: list[str] = (), index_type: int = TP.INT64, **attrs) -> onnx.ModelProto:
    inputs = ["d", "i", *extra_inputs]
    infos = [_vi("d"), _vi("i", index_type), *[_vi(n) for n in extra_inputs]]
    return make_model([helper.make_node(op, inputs, ["z"], name="pick", **attrs)], infos, [_vi("z")])


# (model, feeds, the offending index, the bound n of its axis)
OUT_OF_RANGE = {
    "Gather past the end": (_index_model("Gather"), {"i": np.array([0, 3])}, 3, 3),
    "Gather below -n": (_index_model("Gather"), {"i": np.array([0, -4])}, -4, 3),
    "Gather a token id 10**6": (_index_model("Gather"), {"i": np.array([[1, 10**6]])}, 10**6, 3),
    "Gather a token id -100000": (_index_model("Gather"), {"i": np.array([-100000])}, -100000, 3),
    "Gather int32 indices": (_index_model("Gather", index_type=TP.INT32), {"i": np.array([5], np.int32)}, 5, 3),
    "Gather axis 1": (_index_model("Gather", axis=1), {"i": np.array([2])}, 2, 2),
    "Gather from an empty axis": (
        _index_model("Gather"),
        {"d": np.zeros((0, 2), np.float32), "i": np.array([0])},
        0,
        0,
    ),
    "GatherElements": (_index_model("GatherElements", axis=1), {"i": np.array([[0, 2], [1, 0], [0, 0]])}, 2, 2),
    "GatherElements negative": (
        _index_model("GatherElements", axis=1),
        {"i": np.array([[0, -3], [1, 0], [0, 0]])},
        -3,
        2,
    ),
    "GatherND first column": (_index_model("GatherND"), {"i": np.array([[0, 1], [3, 0]])}, 3, 3),
    "GatherND second column": (_index_model("GatherND"), {"i": np.array([[0, 2]])}, 2, 2),
    "ScatterElements": (
        _index_model("ScatterElements", ["u"], axis=0),
        {"i": np.array([[3, 0]]), "u": np.ones((1, 2), np.float32)},
        3,
        3,
    ),
    "ScatterND": (_index_model("ScatterND", ["u"]), {"i": np.array([[5]]), "u": np.ones((1, 2), np.float32)}, 5, 3),
    "ScatterND negative": (
        _index_model("ScatterND", ["u"]),
        {"i": np.array([[-4]]), "u": np.ones((1, 2), np.float32)},
        -4,
        3,
    ),
}


@pytest.mark.parametrize("case", list(OUT_OF_RANGE))
def test_out_of_range_indices_are_refused(case: str) -> None:
    model, feeds, index, bound = OUT_OF_RANGE[case]
    feeds = {"d": D, **feeds}
    with pytest.raises(Exception, match="(?i)out of|invalid ind"):  # onnxruntime refuses it too
        ort_run(model, feeds)
    with pytest.raises(OpError) as info:
        InferenceSession(model).run(None, feeds)
    text = str(info.value)
    op = model.graph.node[0].op_type
    assert text.startswith(f"{op} node 'pick'") and f"index {index} " in text, text
    assert f"[{-bound}, {bound - 1}]" in text, text


def test_scatter_v9_out_of_range_is_refused() -> None:
    model = make_model(
        [helper.make_node("Scatter", ["d", "i", "u"], ["z"], name="pick")],
        [_vi("d"), _vi("i", TP.INT64), _vi("u")],
        [_vi("z")],
        opset=9,
    )
    feeds = {"d": D, "i": np.array([[0, 3]]), "u": np.ones((1, 2), np.float32)}
    with pytest.raises(Exception, match="out of data bounds"):
        ort_run(model, feeds)
    with pytest.raises(OpError, match=r"Scatter node 'pick': index 3 .*\[-3, 2\]"):
        InferenceSession(model).run(None, feeds)


@pytest.mark.parametrize(
    "op, feeds",
    [
        ("Gather", {"i": np.array([[0, -3], [2, -1]])}),
        ("GatherElements", {"i": np.array([[0, -2], [1, 0], [-1, 1]])}),
        ("GatherND", {"i": np.array([[-3, 1], [2, -2]])}),
    ],
)
def test_in_range_negative_indices_match_onnxruntime(op: str, feeds: dict) -> None:
    model = _index_model(op, axis=1) if op == "GatherElements" else _index_model(op)
    feeds = {"d": D, **feeds}
    np.testing.assert_array_equal(InferenceSession(model).run(None, feeds)[0], ort_run(model, feeds)[0])


def _gather_block_quantized_model() -> onnx.ModelProto:
    codes = np.random.default_rng(0).integers(0, 255, (4, 16), dtype=np.uint8)  # 4 rows of 32 int4
    node = helper.make_node(
        "GatherBlockQuantized", ["d", "i", "s"], ["z"], name="embed", domain="com.microsoft",
        block_size=32, gather_axis=0, quantize_axis=1,
    )  # fmt: skip
    inits = [numpy_helper.from_array(codes, "d"), numpy_helper.from_array(np.ones((4, 1), np.float32), "s")]
    return make_model([node], [_vi("i", TP.INT64)], [_vi("z")], inits)


def test_gather_block_quantized_refuses_out_of_range() -> None:
    """onnxruntime 1.32 gives zero rows here (a silent wrong answer for a token id past the
    vocabulary); onnxgen refuses, like every other indexing op."""
    model = _gather_block_quantized_model()
    in_range = {"i": np.array([[1, -4, 3]])}
    np.testing.assert_array_equal(InferenceSession(model).run(None, in_range)[0], ort_run(model, in_range)[0])
    session = InferenceSession(model)
    for index in (4, -5, 10**6):
        with pytest.raises(OpError, match=rf"GatherBlockQuantized node 'embed': index {index} .*\[-4, 3\]"):
            session.run(None, {"i": np.array([[1, index]])})


def test_gather_on_host_shape_arithmetic_out_of_range() -> None:
    """Gather over a Shape (the host path on CUDA sessions; on the CPU the same kernel)."""
    model = make_model(
        [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "k"], ["z"], name="dim")],
        [_vi("x", shape=[2, 3])],
        [_vi("z", TP.INT64)],
        [_int64("k", [2])],
    )
    with pytest.raises(OpError, match=r"Gather node 'dim': index 2 .*\[-2, 1\]"):
        InferenceSession(model).run(None, {"x": np.zeros((2, 3), np.float32)})


# -- 15. feeds, output names, devices, model bytes ------------------------------------------------


def _unary(op: str, elem: int, shape: list | None) -> onnx.ModelProto:
    return make_model([helper.make_node(op, ["x"], ["z"])], [_vi("x", elem, shape)], [_vi("z", elem, shape)])


ACCEPTED_FEEDS = {
    "float list": (_unary("Neg", TP.FLOAT, [2]), [1, 2.5]),
    "float16 list": (_unary("Neg", TP.FLOAT16, [2]), [1, 2]),
    "int64 list (floats truncated)": (_unary("Neg", TP.INT64, [2]), [1.5, 2]),
    "int8 list": (_unary("Neg", TP.INT8, [1]), [-1.7]),
    "bool list": (_unary("Not", TP.BOOL, [2]), [True, False]),
    "bool list from ints": (_unary("Not", TP.BOOL, [2]), [1, 0]),
    "float list with None": (_unary("Neg", TP.FLOAT, [1]), [None]),
    "empty list": (_unary("Neg", TP.FLOAT, [None]), []),
    "nested list": (_unary("Neg", TP.FLOAT, [2, 1]), [[1.0], [2.0]]),
    "string list": (_unary("Identity", TP.STRING, [2]), ["a", "b"]),
    "string list from ints": (_unary("Identity", TP.STRING, [2]), [1, 2]),
    "negative-stride array": (_unary("Neg", TP.FLOAT, [3]), np.arange(3, dtype=np.float32)[::-1]),
    "non-contiguous array": (_unary("Neg", TP.FLOAT, [2]), np.arange(4, dtype=np.float32)[::2]),
    "negative strides, 2-D": (
        _unary("Neg", TP.FLOAT, [2, 2]),
        np.arange(4, dtype=np.float32).reshape(2, 2)[::-1, ::-1],
    ),
    "0-d array": (_unary("Neg", TP.FLOAT, []), np.array(3.0, np.float32)),
}


@pytest.mark.parametrize("case", list(ACCEPTED_FEEDS))
def test_feeds_onnxruntime_accepts(case: str) -> None:
    model, value = ACCEPTED_FEEDS[case]
    (want,) = ort_run(model, {"x": value})
    (got,) = InferenceSession(model).run(None, {"x": value})
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "value, elem, want",
    [(3, TP.FLOAT, np.float32(-3)), (2.5, TP.DOUBLE, np.float64(-2.5)), (True, TP.BOOL, np.bool_(False))],
)
def test_python_scalar_takes_the_declared_dtype(value, elem: int, want) -> None:
    """onnxruntime refuses a bare Python scalar; onnxgen takes it as a 0-d array of the declared type."""
    model = _unary("Not" if elem == TP.BOOL else "Neg", elem, [])
    (got,) = InferenceSession(model).run(None, {"x": value})
    assert got.shape == () and got.dtype == np.asarray(want).dtype and got == want


F2 = _unary("Neg", TP.FLOAT, [2])
S2 = _unary("Identity", TP.STRING, [2])

REFUSED_FEEDS = {
    "None": (F2, None, r"input 'x' is None; expected tensor\(float\)"),
    "string array for float": (
        F2,
        np.array(["a", "b"]),
        r"input 'x' holds strings \(dtype <U1\); expected tensor\(float\)",
    ),
    "float array for string": (S2, np.ones(2, np.float32), r"input 'x' has dtype float32, expected tensor\(string\)"),
    "dict": (F2, {"a": 1.0}, r"input 'x' is of type dict; expected tensor\(float\)"),
    "object": (F2, object(), r"input 'x' is of type object; expected tensor\(float\)"),
    "ragged list": (F2, [[1.0], [2.0, 3.0]], r"input 'x': the list cannot be converted to tensor\(float\)"),
    "strings in a float list": (F2, ["a", "b"], r"input 'x': the list cannot be converted to tensor\(float\)"),
    "int list overflowing uint8": (_unary("Identity", TP.UINT8, [1]), [300], r"cannot be converted to tensor\(uint8\)"),
    "list of wrong rank": (F2, [[1.0, 2.0]], r"input 'x' has rank 2 \(shape \[1, 2\]\), expected rank 1"),
    "float64 array for float": (F2, np.ones(2), r"input 'x' has dtype float64, expected tensor\(float\)"),
    "int32 array for int64": (
        _unary("Neg", TP.INT64, [2]),
        np.ones(2, np.int32),
        r"dtype int32, expected tensor\(int64\)",
    ),
    "float array for bool": (
        _unary("Not", TP.BOOL, [2]),
        np.ones(2, np.float32),
        r"dtype float32, expected tensor\(bool\)",
    ),
    "bool array for float": (F2, np.ones(2, bool), r"dtype bool, expected tensor\(float\)"),
}


@pytest.mark.parametrize("case", list(REFUSED_FEEDS))
def test_feeds_onnxruntime_refuses_get_a_clear_error(case: str) -> None:
    model, value, message = REFUSED_FEEDS[case]
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime refuses it too (its own error types)
        ort_run(model, {"x": value})
    with pytest.raises(InvalidInputError, match=message):
        InferenceSession(model).run(None, {"x": value})


def test_feed_that_is_not_a_mapping() -> None:
    with pytest.raises(InvalidInputError, match=r"input_feed must be a dict .* got list"):
        InferenceSession(F2).run(None, [("x", np.ones(2, np.float32))])


@pytest.mark.parametrize(
    "names, message",
    [
        ([3], r"output_names\[0\] is 3 \(int\); expected an output name \(str\) of \['z'\]"),
        ("z", r"output_names must be a list of output names, got the str 'z'"),
        (["z", None], r"output_names\[1\] is None \(NoneType\)"),
    ],
)
def test_output_names_that_are_not_names(names, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        InferenceSession(F2).run(names, {"x": np.ones(2, np.float32)})
    with pytest.raises(InvalidInputError, match=message):
        InferenceSession(F2).run_torch({"x": torch.ones(2)}, names)


def test_output_names_as_bytes_and_empty_like_onnxruntime() -> None:
    session = InferenceSession(F2)
    feeds = {"x": np.ones(2, np.float32)}
    for names in ([b"z"], []):
        np.testing.assert_array_equal(session.run(names, feeds)[0], ort_run(F2, feeds)[0])


@pytest.mark.parametrize(
    "device, message",
    [
        ("gpu", r"device 'gpu' is not supported; expected 'cpu', 'cuda' or 'cuda:N'"),
        ("", r"device '' is not supported"),
        ("mps", r"device 'mps' is not supported"),
        (3, r"device 3 \(int\) is not a device name; expected 'cpu', 'cuda' or 'cuda:N'"),
        (None, r"device None \(NoneType\) is not a device name"),
        ("cuda:x", r"device 'cuda:x' is not supported"),
    ],
)
def test_bad_device_gets_a_clear_error(device, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        InferenceSession(F2, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
@pytest.mark.parametrize("device", ["cuda", "cuda:7", "CUDA"])
def test_cuda_without_cuda(device: str) -> None:
    with pytest.raises(InvalidInputError, match=rf"device '{device}' was asked for, but torch sees no CUDA device"):
        InferenceSession(F2, device=device)


@pytest.mark.parametrize("device", ["CPU", "cpu:0", " cpu ", torch.device("cpu")])
def test_cpu_spellings(device) -> None:
    assert InferenceSession(F2, device=device).device == torch.device("cpu")


def test_model_bytes_without_a_graph() -> None:
    with pytest.raises(Exception, match="No graph"):
        import onnxruntime as ort

        ort.InferenceSession(b"")
    with pytest.raises(ModelLoadError, match="holds no ONNX graph"):
        InferenceSession(b"")
    with pytest.raises(ModelLoadError, match="holds no ONNX graph"):
        InferenceSession(onnx.ModelProto())


@pytest.mark.parametrize("value", [5, None, 2.5])
def test_model_argument_of_the_wrong_type(value) -> None:
    with pytest.raises(ModelLoadError, match=r"expected a path, bytes or an onnx.ModelProto"):
        InferenceSession(value)


def test_truncated_model_files_never_escape_as_raw_errors(tmp_path) -> None:
    """Every prefix of a small model file: a clear onnxgen error or (a prefix that is whole) a session."""
    model = _alias_model([helper.make_node("Add", ["x", "w"], ["s"])], ["s"])
    data = model.SerializeToString()
    path = tmp_path / "model.onnx"
    cuts = sorted({0, 1, 2, *range(3, len(data), max(1, len(data) // 40)), len(data) - 1})
    for cut in cuts:
        path.write_bytes(data[:cut])
        try:
            InferenceSession(path)
        except OnnxgenError:
            pass
        except Exception as exc:  # pragma: no cover - the failure message is the point
            raise AssertionError(f"a file cut at {cut}/{len(data)} bytes raised {type(exc).__name__}: {exc}") from exc
        try:
            InferenceSession(data[:cut])
        except OnnxgenError:
            pass


def test_directory_without_model_onnx(tmp_path) -> None:
    os.mkdir(tmp_path / "pkg")
    with pytest.raises(ModelLoadError, match="is a directory without a model.onnx file"):
        InferenceSession(tmp_path / "pkg")


# -- 16. show --bind --------------------------------------------------------------------------


def test_show_bind_refuses_unknown_symbols(tmp_path) -> None:
    from onnxgen.show import show_model

    model = make_model(
        [helper.make_node("Neg", ["x"], ["z"])], [_vi("x", shape=["batch", "seq"])], [_vi("z", shape=["batch", "seq"])]
    )
    onnx.save(model, tmp_path / "model.onnx")
    assert "capture plan" in show_model(str(tmp_path), capture=True, bind="batch=1,seq=pinned")
    with pytest.raises(OnnxgenError, match=r"--bind names symbol\(s\) \['nope'\] that model.onnx does not have; "
                       r"its symbols are \['batch', 'seq'\]"):  # fmt: skip
        show_model(str(tmp_path), capture=True, bind="batch=1,nope=3")
    with pytest.raises(OnnxgenError, match=r"--bind sets symbols of the capture plan; it needs --capture"):
        show_model(str(tmp_path), bind="batch=1")
