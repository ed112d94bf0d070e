"""Symbolic shape inference: DimExpr algebra, interning, value tracking, and agreement with
onnxruntime's actual shapes on real decoder graphs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from onnxgen.runtime.ops.registry import registered_ops
from onnxgen.runtime.shapes.dimexpr import DimExpr
from onnxgen.runtime.shapes.infer import infer_shapes
from onnxgen.runtime.shapes.rules import load_rules
from onnxgen.runtime.shapes.symbols import SymbolTable
from tests.conftest import make_model
from tests.shape_helpers import build_tiny_packages, decode_feeds, run_all_values

tiny_packages = pytest.fixture(scope="module")(build_tiny_packages)

NAMES = ("a", "b", "c")


@st.composite
def polys(draw: st.DrawFn) -> DimExpr:
    out = DimExpr.const(draw(st.integers(-5, 5)))
    for _ in range(draw(st.integers(0, 3))):
        term = DimExpr.const(draw(st.integers(-4, 4)))
        for name in draw(st.lists(st.sampled_from(NAMES), max_size=2)):
            term = term * DimExpr.var(name)
        out = out + term
    return out


@settings(max_examples=150, deadline=None, database=None)
@given(polys(), polys(), st.tuples(*(st.integers(-6, 6) for _ in NAMES)))
def test_dimexpr_arithmetic_agrees_with_integers(p: DimExpr, q: DimExpr, point: tuple[int, ...]) -> None:
    env = dict(zip(NAMES, point))
    pv, qv = p.evaluate(env), q.evaluate(env)
    assert (p + q).evaluate(env) == pv + qv
    assert (p - q).evaluate(env) == pv - qv
    assert (p * q).evaluate(env) == pv * qv
    product = p * q
    if q.terms:
        quotient = product.exact_div(q)
        assert quotient is not None and quotient == p  # exact division recovers the factor
    assert hash(p + q) == hash(q + p) and p + q == q + p  # canonical form: interning relies on it


def test_exact_div_refuses_inexact() -> None:
    a, b = DimExpr.var("a"), DimExpr.var("b")
    assert (a * 8 + 4).exact_div(8) is None
    assert (a + b).exact_div(a) is None
    assert (a * b * 6).exact_div(a * 3) == b * 2


def test_interning_shares_symbols_and_records_edges() -> None:
    t = SymbolTable()
    past, seq = t.root("past"), t.root("seq")
    s1 = t.intern(t.expr(past) + t.expr(seq))
    s2 = t.intern(t.expr(seq) + t.expr(past))
    assert s1 == s2 and t.symbols[s1].kind == "derived"
    assert set(t.symbols[s1].sources) == {"past", "seq"}
    # a derived symbol used in further arithmetic expands to its base symbols
    s3 = t.intern(t.expr(s1) * 8)
    assert set(t.symbols[s3].sources) == {"past", "seq"}
    assert t.intern(t.expr(past) - t.expr(past) - 3) not in (-3,)  # negative extents become opaque


def _vi(name: str, shape: list, dtype: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def test_shape_gather_concat_reshape_resolves_symbolically() -> None:
    """Reshape target built from Shape → Gather → Mul → Concat is resolved to kv*heads, not unknown."""
    i64 = TensorProto.INT64
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["s", "i1"], ["kv"], axis=0),
        helper.make_node("Gather", ["s", "i2"], ["h"], axis=0),
        helper.make_node("Mul", ["kv", "h"], ["kvh"]),
        helper.make_node("Concat", ["b", "kvh", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]
    inits = [
        helper.make_tensor("i0", i64, [1], [0]),
        helper.make_tensor("i1", i64, [1], [1]),
        helper.make_tensor("i2", i64, [1], [2]),
        helper.make_tensor("minus1", i64, [1], [-1]),
    ]
    model = make_model(nodes, [_vi("x", ["B", "kv", 4, 8])], [_vi("y", None)], inits)
    r = infer_shapes(model)
    y = r.values["y"].shape
    assert y[0] == "B" and y[2] == 8
    assert r.table.expr(y[1]) == DimExpr.var("kv") * 4
    assert r.node("Reshape_6").resolved


def test_control_flow_bodies_are_inferred() -> None:
    then_g = helper.make_graph([helper.make_node("Relu", ["x"], ["t"])], "then", [], [_vi("t", None)])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [_vi("e", None)])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)]
    model = make_model(nodes, [_vi("c", [], TensorProto.BOOL), _vi("x", ["B", 3])], [_vi("y", None)])
    r = infer_shapes(model)
    assert r.values["y"].shape == ("B", 3)


def test_every_supported_op_has_a_rule() -> None:
    rules = load_rules()
    missing = sorted(f"{d}::{op}" for d, op in registered_ops() if (d, op) not in rules)
    assert missing == []


def test_op_without_rule_stays_unresolved() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("NoSuchOp", ["y"], ["z"], domain="x.test")]
    model = make_model(nodes, [_vi("x", ["B", 3])], [_vi("z", None)])
    model.opset_import.append(helper.make_opsetid("x.test", 1))
    r = infer_shapes(model)
    assert r.nodes[0].resolved and not r.nodes[1].resolved


# -- agreement with onnxruntime on real decoder graphs ---------------------------------------


@pytest.mark.parametrize("attention", ["standard", "gqa"])
def test_inferred_shapes_match_onnxruntime(tiny_packages, attention: str) -> None:
    """With every symbol bound, each inferred shape equals the shape onnxruntime produces."""
    config, dirs = tiny_packages
    model = onnx.load(str(dirs[attention] / "model.onnx"), load_external_data=False)
    batch, past = 2, 5
    r = infer_shapes(
        model,
        {"batch_size": batch, "sequence_length": 1, "past_sequence_length": past, "total_sequence_length": past + 1},
    )
    actual = run_all_values(dirs[attention], decode_feeds(config, attention, batch, past))
    checked = 0
    for name, shape in actual.items():
        info = r.values.get(name)
        assert info is not None and info.shape is not None, name
        assert info.shape == shape, (name, info.shape, shape)
        checked += 1
    assert checked > 10


def test_shape_rules_agree_with_the_onnx_backend_suite() -> None:
    """Every ONNX node-test case: with the graph's symbols bound to the case's input sizes, each
    output shape inference resolves to ints equals the shape of the spec's expected output."""
    import warnings

    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases(None)
    agreed, wrong = 0, []
    for case in cases:
        if not case.data_sets:
            continue
        model = case.model
        inputs, outputs = case.data_sets[0]
        inits = {t.name for t in model.graph.initializer}
        bind: dict[str, int | None] = {}
        for vi, value in zip([i for i in model.graph.input if i.name not in inits], inputs):
            if isinstance(value, onnx.TensorProto):
                value = onnx.numpy_helper.to_array(value)
            if vi.type.HasField("tensor_type") and isinstance(value, np.ndarray):
                for d, n in zip(vi.type.tensor_type.shape.dim, value.shape):
                    if d.HasField("dim_param"):
                        bind[d.dim_param] = int(n)
        result = infer_shapes(model, bind)
        for vi, expected in zip(model.graph.output, outputs):
            if isinstance(expected, onnx.TensorProto):
                expected = onnx.numpy_helper.to_array(expected)
            info = result.graph_outputs.get(vi.name)
            if not isinstance(expected, np.ndarray) or info is None or info.shape is None:
                continue
            if all(isinstance(d, int) for d in info.shape):
                if tuple(info.shape) == expected.shape:
                    agreed += 1
                else:
                    wrong.append((case.name, info.shape, expected.shape))
    assert wrong == []
    assert agreed > 1700
