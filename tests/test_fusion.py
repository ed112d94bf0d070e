"""The CUDA fusion pass (onnxgen/runtime/fusion.py) on small graphs: what it fuses, what it must
leave alone, and that the rewritten graph computes what onnxruntime computes on the original."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgen import options
from onnxgen.runtime import InferenceSession
from onnxgen.runtime.fusion import fuse_for_device, fuse_graph, pack_matmul_groups
from tests.conftest import DEVICES, make_model, ort_run

RNG = np.random.default_rng(3)


def _w(name: str, *shape: int) -> object:
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(np.float32), name)


def three_projections(bias_on: tuple[bool, ...], extra_consumer: bool = False):
    """x -> MatMul q/k/v (some followed by a bias Add) -> outputs."""
    nodes, inits, outputs = [], [], []
    for i, (name, width) in enumerate((("q", 6), ("k", 4), ("v", 4))):
        inits.append(_w(f"w_{name}", 8, width))
        nodes.append(helper.make_node("MatMul", ["x", f"w_{name}"], [f"mm_{name}"], name=f"mm_{name}"))
        out = f"mm_{name}"
        if bias_on[i]:
            inits.append(_w(f"b_{name}", width))
            nodes.append(helper.make_node("Add", [f"mm_{name}", f"b_{name}"], [f"y_{name}"], name=f"add_{name}"))
            out = f"y_{name}"
        outputs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, None))
    if extra_consumer:  # mm_q read twice: its Add must not be folded
        nodes.append(helper.make_node("Neg", ["mm_q"], ["neg_q"], name="neg"))
        outputs.append(helper.make_tensor_value_info("neg_q", TensorProto.FLOAT, None))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 8])
    return make_model(nodes, [x], outputs, inits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias_on", [(False, False, False), (True, True, True), (True, False, True)])
@pytest.mark.parametrize("rows", [(2, 3), (1, 1)])  # (1, 1): the one-row kernel where Triton serves
def test_matmul_group_matches_onnxruntime(bias_on, rows: tuple[int, int], device: str) -> None:
    model = three_projections(bias_on)
    fused, report = fuse_graph(model)
    assert report.matmul_groups == 1
    assert [n.op_type for n in fused.graph.node] == ["MatMulGroup"]
    x = RNG.standard_normal((*rows, 8)).astype(np.float32)
    want = ort_run(model, {"x": x})
    session = InferenceSession(fused, device=device)
    for packed in (False, True):
        if packed and device == "cpu":  # CUDA sessions pack by themselves
            assert pack_matmul_groups(session.program) == 1
            assert not {"w_q", "w_k", "w_v"} & set(session.program.initializers)  # one copy left
        got = session.run(None, {"x": x})
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_a_bias_add_whose_input_is_read_elsewhere_stays() -> None:
    fused, report = fuse_graph(three_projections((True, True, True), extra_consumer=True))
    ops = [n.op_type for n in fused.graph.node]
    assert report.matmul_groups == 1 and ops.count("Add") == 1 and "Neg" in ops
    group = next(n for n in fused.graph.node if n.op_type == "MatMulGroup")
    assert list(group.output) == ["mm_q", "y_k", "y_v"]


def swiglu_model(swap: bool):
    gate = helper.make_node("Sigmoid", ["g"], ["s"], name="sig")
    act = helper.make_node("Mul", ["s", "g"] if swap else ["g", "s"], ["a"], name="act")
    out = helper.make_node("Mul", ["u", "a"] if swap else ["a", "u"], ["y"], name="mul")
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 5]) for n in ("g", "u")]
    return make_model([gate, act, out], ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("swap", [False, True])
def test_silu_mul_matches_onnxruntime(swap: bool, device: str) -> None:
    model = swiglu_model(swap)
    fused, report = fuse_graph(model)
    assert report.silu_mul == 1 and [n.op_type for n in fused.graph.node] == ["SiluMul"]
    feeds = {n: RNG.standard_normal((2, 5)).astype(np.float32) for n in ("g", "u")}
    (want,) = ort_run(model, feeds)
    (got,) = InferenceSession(fused, device=device).run(None, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_sigmoid_read_elsewhere_is_not_fused() -> None:
    model = swiglu_model(False)
    model.graph.output.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, None))
    _, report = fuse_graph(model)
    assert report.silu_mul == 0


def test_rewrites_per_device() -> None:
    model = swiglu_model(False)
    assert fuse_for_device(model, "cpu")[1].total == 0
    assert fuse_for_device(model, "cuda")[1].total == 1
    with options.override(fuse=False):  # ONNXGEN_FUSE=0
        assert fuse_for_device(model, "cuda")[1].total == 0
    assert fuse_for_device(model, "cuda", options.Options(fuse=False))[1].total == 0
    assert fuse_graph(model)[0] is not model and len(model.graph.node) == 3  # the input is left alone


def attention_model(groups: int, mask: str, scale_op: str = "Mul", cast: bool = True, leak: bool = False):
    """Q [1,4,2,8], K/V [1,4/groups,5,8] -> the default-domain attention pattern fusion_attention knows."""
    heads, kv = 4, 4 // groups
    nodes, inits = [], [numpy_helper.from_array(np.array(0.35 if scale_op == "Mul" else 1 / 0.35, np.float32), "c")]

    def repeat(name: str) -> str:
        if groups == 1:
            return name
        inits.extend([
            numpy_helper.from_array(np.array([2], np.int64), f"{name}_ax"),
            numpy_helper.from_array(np.array([1, 1, groups, 1, 1], np.int64), f"{name}_rep"),
            numpy_helper.from_array(np.array([0, heads, -1, 8], np.int64), f"{name}_shape"),
        ])  # fmt: skip
        nodes.extend([
            helper.make_node("Unsqueeze", [name, f"{name}_ax"], [f"{name}_u"]),
            helper.make_node("Expand", [f"{name}_u", f"{name}_rep"], [f"{name}_e"]),
            helper.make_node("Reshape", [f"{name}_e", f"{name}_shape"], [f"{name}_r"]),
        ])  # fmt: skip
        return f"{name}_r"

    k, v = repeat("k"), repeat("v")
    nodes.append(helper.make_node("Transpose", [k], ["kt"], perm=[0, 1, 3, 2]))
    nodes.append(helper.make_node("MatMul", ["q", "kt"], ["qk"]))
    nodes.append(helper.make_node(scale_op, ["qk", "c"], ["scaled"]))
    scores = "scaled"
    if cast:
        nodes.append(helper.make_node("Cast", [scores], ["scores32"], to=TensorProto.FLOAT))
        scores = "scores32"
    if mask == "where":
        inits.append(numpy_helper.from_array(np.array(-3.4e38, np.float32), "fill"))
        nodes.append(helper.make_node("Where", ["m", scores, "fill"], ["masked"]))
        scores = "masked"
    elif mask == "add":
        nodes.append(helper.make_node("Add", ["bias", scores], ["masked"]))
        scores = "masked"
    nodes.append(helper.make_node("Softmax", [scores], ["p"], axis=-1))
    nodes.append(helper.make_node("MatMul", ["p", v], ["y"]))
    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info("q", f, [1, heads, 2, 8])]
    ins += [helper.make_tensor_value_info(n, f, [1, kv, 5, 8]) for n in ("k", "v")]
    if mask == "where":
        ins.append(helper.make_tensor_value_info("m", TensorProto.BOOL, [1, 1, 2, 5]))
    elif mask == "add":
        ins.append(helper.make_tensor_value_info("bias", f, [1, 1, 2, 5]))
    outs = [helper.make_tensor_value_info("y", f, None)]
    if leak:
        outs.append(helper.make_tensor_value_info("qk", f, None))
    return make_model(nodes, ins, outs, inits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("groups", "mask", "scale_op", "cast"),
    [(2, "where", "Mul", True), (1, "where", "Mul", False), (4, "add", "Div", True), (2, "none", "Mul", False)],
)
def test_masked_attention_matches_onnxruntime(groups: int, mask: str, scale_op: str, cast: bool, device: str) -> None:
    model = attention_model(groups, mask, scale_op, cast)
    fused, report = fuse_graph(model)
    assert report.attention == 1 and [n.op_type for n in fused.graph.node] == ["MaskedAttention"]
    feeds = {"q": RNG.standard_normal((1, 4, 2, 8)).astype(np.float32)}
    feeds.update({n: RNG.standard_normal((1, 4 // groups, 5, 8)).astype(np.float32) for n in ("k", "v")})
    if mask == "where":
        feeds["m"] = np.array([[[[1, 1, 0, 0, 0], [0, 0, 0, 0, 0]]]], bool)  # the second row sees nothing
    elif mask == "add":
        feeds["bias"] = RNG.standard_normal((1, 1, 2, 5)).astype(np.float32)
    (want,) = ort_run(model, feeds)
    (got,) = InferenceSession(fused, device=device).run(None, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_attention_scores_read_elsewhere_are_not_fused() -> None:
    _, report = fuse_graph(attention_model(2, "where", leak=True))
    assert report.attention == 0


def norm_mlp_model(
    dtype: int = TensorProto.FLOAT, norm_read_elsewhere: bool = False, sum_output: bool = True, inner: int = 24
):
    """x, skip -> SkipSimplifiedLayerNorm -> MatMul gate/up -> SwiGLU -> MatMul down -> outputs,
    with the residual sum as a graph output: every rewrite of the decode MLP block applies."""
    np_type = np.float16 if dtype == TensorProto.FLOAT16 else np.float32

    def w(name: str, *shape: int) -> object:
        return numpy_helper.from_array((RNG.standard_normal(shape) * 0.3).astype(np_type), name)

    inits = [w("gamma", 16), w("w_gate", 16, inner), w("w_up", 16, inner), w("w_down", inner, 16)]
    nodes = [
        helper.make_node(
            "SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"],
            ["normed", "", "", "total" if sum_output else ""],
            domain="com.microsoft", epsilon=1e-6, name="norm",
        ),
        helper.make_node("MatMul", ["normed", "w_gate"], ["g"], name="gate"),
        helper.make_node("MatMul", ["normed", "w_up"], ["u"], name="up"),
        helper.make_node("Sigmoid", ["g"], ["sg"], name="sig"),
        helper.make_node("Mul", ["g", "sg"], ["act"], name="act"),
        helper.make_node("Mul", ["act", "u"], ["h"], name="mul"),
        helper.make_node("MatMul", ["h", "w_down"], ["y"], name="down"),
    ]  # fmt: skip
    outs = [helper.make_tensor_value_info("y", dtype, None)]
    if sum_output:
        outs.append(helper.make_tensor_value_info("total", dtype, None))
    if norm_read_elsewhere:
        nodes.append(helper.make_node("Neg", ["normed"], ["neg"], name="neg"))
        outs.append(helper.make_tensor_value_info("neg", dtype, None))
    ins = [helper.make_tensor_value_info(n, dtype, ["b", "s", 16]) for n in ("x", "skip")]
    return make_model(nodes, ins, outs, inits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16])
@pytest.mark.parametrize(("sum_output", "inner"), [(True, 24), (False, 24), (True, 1300), (True, 2100)])
def test_norm_and_silu_prologues_match_onnxruntime(rows: int, dtype: int, sum_output: bool, inner: int, device: str):
    """The norm moves into the gate/up group, SiLU-mul into the down projection (a group of one);
    one row takes the one-row kernels (through Triton where it serves), more rows the unfused path.
    inner=1300 and 2100: the down projection takes linear_row's middle and long-K launch configurations."""
    model = norm_mlp_model(dtype, sum_output=sum_output, inner=inner)
    fused, report = fuse_graph(model)
    assert (report.matmul_groups, report.singles, report.prologues, report.silu_mul) == (1, 1, 2, 1), report
    assert [n.op_type for n in fused.graph.node] == ["MatMulGroup", "MatMulGroup"]
    np_type = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    feeds = {n: RNG.standard_normal((1, rows, 16)).astype(np_type) for n in ("x", "skip")}
    want = ort_run(model, feeds)
    got = InferenceSession(fused, device=device).run(None, feeds)
    tol = 2e-2 if dtype == TensorProto.FLOAT16 else 1e-5
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=tol, atol=tol)


def test_a_norm_read_elsewhere_stays_its_own_op() -> None:
    fused, report = fuse_graph(norm_mlp_model(norm_read_elsewhere=True))
    ops = [n.op_type for n in fused.graph.node]
    assert "SkipSimplifiedLayerNormalization" in ops and report.prologues == 1, ops  # SiLU-mul still moves
    group = next(n for n in fused.graph.node if n.op_type == "MatMulGroup" and len(n.output) == 2)
    assert group.input[0] == "normed" and not any(a.name == "prologue" for a in group.attribute)


# -- RowSumCast: the attention mask's valid lengths ----------------------------------------------


def row_sum_model(
    dtype: int = TensorProto.INT64, keepdims: int = 1, axes: list[int] | None = None, minus: int = 1,
    to: int = TensorProto.INT32, swapped: bool = False, width: int = 37, opset: int = 21,
):  # fmt: skip
    axes = [1] if axes is None else axes
    np_dtype = np.int64 if dtype == TensorProto.INT64 else np.int32
    inits = [numpy_helper.from_array(np.array(minus, np_dtype), "c")]
    if opset >= 13:
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
        reduce = helper.make_node("ReduceSum", ["mask", "axes"], ["s"], keepdims=keepdims, name="sum")
    else:
        reduce = helper.make_node("ReduceSum", ["mask"], ["s"], axes=axes, keepdims=keepdims, name="sum")
    sub = helper.make_node("Sub", ["c", "s"] if swapped else ["s", "c"], ["d"], name="sub")
    cast = helper.make_node("Cast", ["d"], ["y"], to=to, name="cast")
    ins = [helper.make_tensor_value_info("mask", dtype, ["batch", width])]
    return make_model([reduce, sub, cast], ins, [helper.make_tensor_value_info("y", to, None)], inits, opset=opset)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "kw",
    [{}, {"keepdims": 0}, {"axes": [-1]}, {"dtype": TensorProto.INT32, "to": TensorProto.INT64}, {"minus": -3},
     {"width": 5000}, {"opset": 11}],
)  # fmt: skip
def test_row_sum_cast_matches_onnxruntime(kw: dict, device: str) -> None:
    model = row_sum_model(**kw)
    fused, report = fuse_graph(model)
    assert report.row_sums == 1 and [n.op_type for n in fused.graph.node] == ["RowSumCast"]
    width = kw.get("width", 37)
    dtype = np.int32 if kw.get("dtype") == TensorProto.INT32 else np.int64
    mask = np.zeros((3, width), dtype)
    for row, length in enumerate((1, width // 2, width)):
        mask[row, :length] = 1
    mask[1, -1] = 5  # any integers, not only 0/1
    (want,) = ort_run(model, {"mask": mask})
    (got,) = InferenceSession(fused, device=device).run(None, {"mask": mask})
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kw", [{"swapped": True}, {"axes": [0]}, {"to": TensorProto.FLOAT}])
def test_other_reductions_are_not_row_sums(kw: dict) -> None:
    assert fuse_graph(row_sum_model(**kw))[1].row_sums == 0


def test_a_row_sum_read_elsewhere_is_not_fused() -> None:
    model = row_sum_model()
    model.graph.output.append(helper.make_tensor_value_info("s", TensorProto.INT64, None))
    assert fuse_graph(model)[1].row_sums == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [1100, 5000])  # a row in one block (read before the PDL wait), or looped
@pytest.mark.parametrize("indices", [[[3]], [[-1]], [[0, 9, -10], [4, 4, 1]]])
def test_embedding_gather_matches_onnxruntime(indices: list, width: int, device: str) -> None:
    """The one-kernel row gather of a decode step's embedding (with Triton; torch's index_select elsewhere)."""
    table = RNG.standard_normal((10, width)).astype(np.float16)
    node = helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)
    ids = np.array(indices, np.int64)
    model = make_model(
        [node], [helper.make_tensor_value_info("ids", TensorProto.INT64, list(ids.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)], [numpy_helper.from_array(table, "table")],
    )  # fmt: skip
    (want,) = ort_run(model, {"ids": ids})
    (got,) = InferenceSession(model, device=device).run(None, {"ids": ids})
    np.testing.assert_array_equal(got, want)


def _tied_embedding(perm: list[int] | None = None, second_reader: bool = False):
    """ids [B, S] -> Gather(Transpose(W [8, 50]), ids) -> [B, S, 8]; optionally the transposed table
    is also an output (a reader that is not a Gather)."""
    transpose = helper.make_node("Transpose", ["W"], ["table"], **({"perm": perm} if perm else {}))
    nodes = [transpose, helper.make_node("Gather", ["table", "ids"], ["emb"], axis=0)]
    outputs = [helper.make_tensor_value_info("emb", TensorProto.FLOAT, None)]
    if second_reader:
        nodes.append(helper.make_node("Identity", ["table"], ["table_out"]))
        outputs.append(helper.make_tensor_value_info("table_out", TensorProto.FLOAT, None))
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"])
    weight = numpy_helper.from_array(np.random.default_rng(3).standard_normal((8, 50)).astype(np.float32), "W")
    return make_model(nodes, [ids], outputs, [weight])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("perm", "second_reader", "rewritten"), [(None, False, 1), ([1, 0], False, 1), (None, True, 0)]
)
def test_tied_embedding_gather_matches_onnxruntime(device: str, perm, second_reader: bool, rewritten: int) -> None:
    model = _tied_embedding(perm, second_reader)
    ids = np.array([[3, 49, 0], [7, 7, 21]], dtype=np.int64)
    expected = ort_run(model, {"ids": ids})
    session = InferenceSession(model, device=device)
    assert session.fusions.tied_gathers == rewritten
    ours = session.run(None, {"ids": ids})
    for a, b in zip(ours, expected):
        np.testing.assert_array_equal(a, b)  # a gather and a transpose: exact


def _nbits_weight(
    name: str, k: int, n: int, zp_kind: str, np_type, block_size: int = 32, bits: int = 4
) -> tuple[list, list[str]]:
    """MatMulNBits initializers for a random [K, N] weight: (initializers, the node's B/scales/zp inputs)."""
    from tests.test_ops_contrib import pack_rows, quantize_blocks

    codes, scales, zp = quantize_blocks(RNG.standard_normal((n, k)).astype(np.float32) * 0.3, bits, block_size,
                                        zp_kind == "none")  # fmt: skip
    n_blocks = scales.shape[1]
    inits = [
        numpy_helper.from_array(pack_rows(codes, bits).reshape(n, n_blocks, block_size * bits // 8), f"{name}_b"),
        numpy_helper.from_array(scales.reshape(-1).astype(np_type), f"{name}_s"),
    ]
    names = [f"{name}_b", f"{name}_s"]
    if zp_kind == "packed":
        inits.append(numpy_helper.from_array(pack_rows(zp, bits).reshape(-1), f"{name}_z"))
        names.append(f"{name}_z")
    elif zp_kind == "float":
        inits.append(numpy_helper.from_array((zp + 0.25).astype(np_type), f"{name}_z"))
        names.append(f"{name}_z")
    return inits, names


def int4_norm_mlp_model(dtype: int, zp_kind: str, inner: int, bias: bool, bits: int = 4):
    """norm_mlp_model with MatMulNBits projections (block 32; K = 48 and ``inner``): the 4-bit (or
    ``bits``) group of gate and up behind the norm, the down projection behind SiLU-mul."""
    np_type = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    hidden = 48
    inits = [numpy_helper.from_array((RNG.random(hidden) + 0.5).astype(np_type), "gamma")]
    nodes = [
        helper.make_node(
            "SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["normed", "", "", "total"],
            domain="com.microsoft", epsilon=1e-6, name="norm",
        ),
    ]  # fmt: skip
    for name, src, dst, k, n in (("gate", "normed", "g", hidden, inner), ("up", "normed", "u", hidden, inner),
                                 ("down", "h", "y", inner, hidden)):  # fmt: skip
        more, ins = _nbits_weight(name, k, n, zp_kind, np_type, bits=bits)
        inits += more
        with_bias = bias and name == "up"  # as a following Add, which the group takes in
        nodes.append(helper.make_node("MatMulNBits", [src, *ins], [f"{dst}0" if with_bias else dst],
                                      domain="com.microsoft", name=name, K=k, N=n, bits=bits, block_size=32,
                                      accuracy_level=0))  # fmt: skip
        if with_bias:
            inits.append(numpy_helper.from_array(RNG.standard_normal(n).astype(np_type), "up_bias"))
            nodes.append(helper.make_node("Add", [f"{dst}0", "up_bias"], [dst], name="up_add"))
    nodes += [
        helper.make_node("Sigmoid", ["g"], ["sg"], name="sig"),
        helper.make_node("Mul", ["g", "sg"], ["act"], name="act"),
        helper.make_node("Mul", ["act", "u"], ["h"], name="mul"),
    ]
    outs = [helper.make_tensor_value_info(n, dtype, None) for n in ("y", "total")]
    ins = [helper.make_tensor_value_info(n, dtype, ["b", "s", hidden]) for n in ("x", "skip")]
    return make_model(nodes, ins, outs, inits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16])
@pytest.mark.parametrize(
    ("zp_kind", "inner", "bias"), [("none", 40, True), ("packed", 2100, False), ("float", 72, True)]
)
@pytest.mark.parametrize("kernels", ["copy", "packed", "apart"])
def test_int4_group_norm_silu_match_onnxruntime(
    rows: int, dtype: int, zp_kind: str, inner: int, bias: bool, kernels: str, device: str
) -> None:
    """A 4-bit gate/up group behind the norm and a 4-bit down projection behind SiLU-mul, joined
    once into one copy of the codes. With the packed 4-bit kernels where Triton serves: one row in
    the one-row 4-bit kernels with the prologues fused (inner=2,100: down split along K; "apart":
    the norm as a kernel of its own first, as wide rows such as the lm_head run it), several rows
    through the prompt paths; "copy": the dense kernels and cuBLAS over a dequantized copy."""
    with options.override(triton_q4=kernels != "copy", q4_norm_apart=1 if kernels == "apart" else 0):
        _int4_group_case(rows, dtype, zp_kind, inner, bias, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize(
    ("zp_kind", "inner", "bias", "dtype"),
    [("none", 40, True, TensorProto.FLOAT16), ("packed", 1100, False, TensorProto.FLOAT),
     ("packed", 72, True, TensorProto.FLOAT16)],
)  # fmt: skip
@pytest.mark.parametrize("kernels", ["packed", "apart"])
def test_int8_group_norm_silu_match_onnxruntime(
    rows: int, zp_kind: str, inner: int, bias: bool, dtype: int, kernels: str, device: str
) -> None:
    """The same group with 8-bit codes (onnxruntime-genai's int8 packages, and mixed 4- and 8-bit
    ones): where Triton serves, the packed kernels take them too, prologues fused for one row
    (inner=1,100: down split along K) and the prompt paths for several, with no dequantized copy.
    (onnxruntime's CPU kernel refuses 8-bit codes with float zero points, so no such case here.)"""
    import torch

    from onnxgen.runtime.gpu.launch import q4_kernels_serve
    from onnxgen.runtime.ops.contrib_quant import DEQUANT_CACHE

    DEQUANT_CACHE.clear()
    with options.override(triton_q4=True, q4_norm_apart=1 if kernels == "apart" else 0):
        serves = q4_kernels_serve(torch.zeros(1, device=device))
        _int4_group_case(rows, dtype, zp_kind, inner, bias, device, bits=8)
    if serves:  # elsewhere (a plain CPU run) the reference path's copy is the expected one
        assert DEQUANT_CACHE.used == 0


def _int4_group_case(
    rows: int, dtype: int, zp_kind: str, inner: int, bias: bool, device: str, bits: int = 4
) -> None:  # fmt: skip
    from onnxgen.runtime.fusion import pack_nbits_groups

    model = int4_norm_mlp_model(dtype, zp_kind, inner, bias, bits)
    fused, report = fuse_graph(model)
    assert (report.matmul_nbits_groups, report.singles, report.prologues, report.silu_mul) == (1, 1, 2, 1), report
    np_type = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    feeds = {n: RNG.standard_normal((1, rows, 48)).astype(np_type) for n in ("x", "skip")}
    want = ort_run(model, feeds)
    session = InferenceSession(fused, device=device)
    assert pack_nbits_groups(session.program) == 1  # a session packs only the groups its own fusion made
    assert not {"gate_b", "up_b", "gate_s", "up_s"} & set(session.program.initializers)  # one copy of the codes
    got = session.run(None, feeds)
    tol = 2e-3 if dtype == TensorProto.FLOAT16 else 1e-5  # of the output's largest magnitude
    for g, w in zip(got, want):
        scale = float(np.abs(w.astype(np.float32)).max())
        np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=0, atol=tol * scale)


@pytest.mark.parametrize("nbits", [False, True])
def test_grouped_weights_wait_on_the_host_and_only_the_joins_stay_on_the_device(nbits: bool) -> None:
    """A CUDA session holds a group's member weights on the host until they are joined (4-bit codes
    there, dense weights on the device a group at a time), so that the device never holds every
    member beside its joined copy (the load's memory peak). The "meta" device stands in for CUDA: a
    tensor moved there is one the device would hold."""
    import torch

    from onnxgen.runtime.executor import compile_model
    from onnxgen.runtime.fusion import group_weight_names, pack_nbits_groups

    model = int4_norm_mlp_model(TensorProto.FLOAT16, "packed", 40, True) if nbits else three_projections((True,) * 3)
    fused, _ = fuse_graph(model)
    held = group_weight_names(fused)
    members = {"gate_b", "gate_s", "gate_z", "up_b", "up_s", "up_z", "down_b", "down_s", "down_z", "up_bias"}
    assert held == (members if nbits else {"w_q", "w_k", "w_v"})
    program = compile_model(fused, torch.device("meta"), None, host_held=held)
    assert {program.initializers[n].device.type for n in held} == {"cpu"}
    assert (pack_nbits_groups(program) if nbits else pack_matmul_groups(program)) == 1
    program.move_host_held_to_device()
    devices = {n: v.device.type for n, v in program.initializers.items() if isinstance(v, torch.Tensor)}
    assert set(devices.values()) == {"meta"}, devices
    assert not {"gate_b", "up_b", "w_q"} & set(devices)  # the joined copies took the members' place
