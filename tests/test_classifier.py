"""The growing-symbol classifier and the planner's precedence, one rule per test.

Each graph declares a KV input ``past_key`` [.., kv, ..] (a growing source by its name and
rank) next to pinned extents B and S; the assertions name the node that must stay eager."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from onnxgen.runtime.capture.report import analyse
from tests.conftest import make_model

F, I64 = TensorProto.FLOAT, TensorProto.INT64
PINS = {"B": None, "S": None}


def vi(name: str, shape: list | None, dtype: int = F) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def ints(name: str, values: list[int]) -> onnx.TensorProto:
    return helper.make_tensor(name, I64, [len(values)], values)


def plan(nodes, inputs, outputs, inits=(), *, bind=None, mode="failsafe"):
    model = make_model(nodes, inputs, outputs, list(inits))
    binding = dict(PINS)
    binding.update(bind or {})
    return analyse(model, binding, mode=mode, decode_step=False).plan


PAST = vi("past_key", [1, 2, "kv", 8])


# -- derived extents --------------------------------------------------------------------------


def test_reshape_minus_one_absorbing_kv_poisons_consumers() -> None:
    p = plan(
        [
            helper.make_node("Reshape", ["past_key", "t"], ["r"], name="reshape"),
            helper.make_node("Relu", ["r"], ["y"], name="consumer"),
        ],
        [PAST],
        [vi("y", None)],
        [ints("t", [0, 0, -1])],
    )
    node = p.node("consumer")
    assert not node.capturable and node.growing == "8*kv"
    assert any("derived from kv" in step for step in node.chain)


def test_reshape_target_computed_as_kv_times_8_poisons_consumers() -> None:
    nodes = [
        helper.make_node("Shape", ["past_key"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "i2"], ["kv"], name="gather", axis=0),
        helper.make_node("Mul", ["kv", "eight"], ["kv8"], name="mul"),
        helper.make_node("Concat", ["lead", "kv8"], ["target"], name="concat", axis=0),
        helper.make_node("Reshape", ["past_key", "target"], ["r"], name="reshape"),
        helper.make_node("Relu", ["r"], ["y"], name="consumer"),
    ]
    p = plan(nodes, [PAST], [vi("y", None)], [ints("i2", [2]), ints("eight", [8]), ints("lead", [1, 2])])
    assert p.node("consumer").growing == "8*kv"
    assert p.node("mul").folded  # the arithmetic itself is host shape arithmetic


def test_flatten_of_kv_poisons_consumers() -> None:
    p = plan(
        [
            helper.make_node("Flatten", ["past_key"], ["r"], name="flatten", axis=2),
            helper.make_node("Relu", ["r"], ["y"], name="consumer"),
        ],
        [PAST],
        [vi("y", None)],
    )
    assert p.node("consumer").growing == "8*kv"


def test_pinned_only_derived_dim_stays_capturable() -> None:
    p = plan(
        [
            helper.make_node("Reshape", ["x", "t"], ["r"], name="reshape"),
            helper.make_node("Relu", ["r"], ["y"], name="consumer"),
            helper.make_node("Relu", ["past_key"], ["z"], name="kv_user"),
        ],
        [vi("x", ["B", "S", 8]), PAST],
        [vi("y", None), vi("z", None)],
        [ints("t", [0, -1])],
    )
    assert p.node("consumer").capturable and p.node("reshape").capturable
    assert not p.node("kv_user").capturable  # the same graph does have a growing symbol


# -- aliasing through the unification chokepoints --------------------------------------------


def _alias_case(kind: str):
    other = {
        "elementwise": vi("other", ["T", 8]),
        "matmul": vi("other", ["T", 1, 8, 4]),
        "concat": vi("other", [1, 2, "T", 3]),
        "expand": vi("other", ["T", 1]),
    }[kind]
    meet = {
        "elementwise": [helper.make_node("Add", ["past_key", "other"], ["m"], name="meet")],
        "matmul": [
            helper.make_node("Transpose", ["past_key"], ["pt"], name="tr", perm=[2, 0, 1, 3]),
            helper.make_node("MatMul", ["pt", "other"], ["m"], name="meet"),
        ],
        "concat": [helper.make_node("Concat", ["past_key", "other"], ["m"], name="meet", axis=3)],
        "expand": [
            helper.make_node("Shape", ["past_key"], ["s"], name="shape", start=2, end=3),
            helper.make_node("Concat", ["s", "one"], ["target"], name="target", axis=0),
            helper.make_node("Expand", ["other", "target"], ["m"], name="meet"),
        ],
    }[kind]
    consumer = helper.make_node("Relu", ["other"], ["y"], name="consumer")
    return plan([consumer, *meet], [PAST, other], [vi("y", None), vi("m", None)], [ints("one", [1])])


@pytest.mark.parametrize("kind", ["elementwise", "matmul", "concat", "expand"])
def test_growing_symbol_aliased_through_broadcast_keeps_consumer_eager(kind: str) -> None:
    p = _alias_case(kind)
    node = p.node("consumer")  # it only sees T; T met kv in `meet`
    assert not node.capturable and node.growing == "T", node.reason
    assert any("unified at meet" in step for step in node.chain)


def test_input_and_output_shapes_are_both_checked() -> None:
    """Add(x[S], past[kv]): the output shows the pinned representative S, the input still carries kv."""
    p = plan(
        [helper.make_node("Add", ["x", "past_key"], ["y"], name="add")],
        [vi("x", [1, 2, "S", 8]), PAST],
        [vi("y", None)],
    )
    node = p.node("add")
    assert p.node("add") and node.growing == "kv" and not node.capturable


def test_growing_symbol_only_on_last_axis_found_through_provenance() -> None:
    """kv+1 appears only on the last axis of a [1, kv+1] value (no KV layout at all)."""
    nodes = [
        helper.make_node("Shape", ["past_key"], ["s"], name="shape", start=2, end=3),
        helper.make_node("Add", ["s", "one"], ["n"], name="plus1"),
        helper.make_node("Squeeze", ["n"], ["n0"], name="squeeze"),
        helper.make_node("Range", ["zero", "n0", "one0"], ["r"], name="range"),
        helper.make_node("Unsqueeze", ["r", "zero1"], ["row"], name="row"),
        helper.make_node("Cast", ["row"], ["y"], name="consumer", to=F),
    ]
    inits = [
        ints("one", [1]),
        helper.make_tensor("zero", I64, [], [0]),
        helper.make_tensor("one0", I64, [], [1]),
        ints("zero1", [0]),
    ]
    p = plan(nodes, [PAST], [vi("y", None)], inits)
    node = p.node("consumer")
    assert not node.capturable and node.growing == "kv + 1"
    assert node.chain[0].startswith("kv: ")


# -- precedence -------------------------------------------------------------------------------


def test_control_flow_mentioning_growing_symbol_is_a_host_seam() -> None:
    branch = helper.make_graph([helper.make_node("Relu", ["past_key"], ["t"])], "b", [], [vi("t", None)])
    other = helper.make_graph([helper.make_node("Neg", ["past_key"], ["e"])], "e", [], [vi("e", None)])
    nodes = [helper.make_node("If", ["c"], ["y"], name="if", then_branch=branch, else_branch=other)]
    p = plan(nodes, [vi("c", [], TensorProto.BOOL), PAST], [vi("y", None)])
    node = p.node("if")
    assert node.kind == "host" and node.reason == "host control flow" and node.growing is None


def test_capturable_kernel_cannot_readmit_a_vetoed_node(monkeypatch) -> None:
    from onnxgen.runtime.capture import planner
    from onnxgen.runtime.ops.registry import lookup

    spec = lookup("", "Relu", 21)
    assert spec is not None and spec.capture is None  # the kernel says: always capturable
    p = plan([helper.make_node("Relu", ["past_key"], ["y"], name="relu")], [PAST], [vi("y", None)])
    assert not p.node("relu").capturable and p.node("relu").reason.startswith("classifier veto")
    # and no warm-up or kernel answer is even consulted for it
    monkeypatch.setattr(planner, "lookup", lambda *a: spec)
    p = plan([helper.make_node("Relu", ["past_key"], ["y"], name="relu")], [PAST], [vi("y", None)])
    assert not p.node("relu").capturable


# -- fail-safe / denylist, pinning --------------------------------------------------------------


def _nonzero_graph(mode: str):
    nodes = [
        helper.make_node("NonZero", ["x"], ["nz"], name="nonzero"),
        helper.make_node("Transpose", ["nz"], ["t"], name="transpose"),
        helper.make_node("Cast", ["t"], ["y"], name="consumer", to=F),
    ]
    return plan(nodes, [vi("x", ["B", 4])], [vi("y", None)], mode=mode)


def test_failsafe_minted_symbol_without_provenance_keeps_consumers_eager() -> None:
    p = _nonzero_graph("failsafe")
    node = p.node("consumer")
    assert not node.capturable and node.growing is not None and "without provenance" in node.chain[0]


def test_denylist_mode_admits_minted_symbols() -> None:
    p = _nonzero_graph("denylist")
    assert p.node("consumer").capturable and p.node("transpose").capturable
    assert not p.node("nonzero").capturable  # its kernel still says data-dependent


def test_binding_fixed_capacity_pins_kv_and_recomputes() -> None:
    nodes = [helper.make_node("Relu", ["past_key"], ["y"], name="relu"), helper.make_node("Neg", ["y"], ["z"])]
    assert not plan(nodes, [PAST], [vi("z", None)]).node("relu").capturable
    pinned = plan(nodes, [PAST], [vi("z", None)], bind={"kv": None})
    assert pinned.node("relu").capturable and pinned.growing == []
    bound = plan(nodes, [PAST], [vi("z", None)], bind={"kv": 64})
    assert bound.node("relu").capturable and len(bound.segments) == 1


def test_host_read_input_value_with_growing_symbol_vetoes() -> None:
    """Constant shapes are not enough: a value the kernel reads on the host (Slice starts) that
    follows kv would be baked into a recording. Shapes here are made constant on purpose."""
    from onnxgen.runtime.capture.classifier import classify
    from onnxgen.runtime.capture.planner import plan_capture
    from onnxgen.runtime.shapes.infer import infer_shapes

    nodes = [
        helper.make_node("Shape", ["past_key"], ["s"], name="shape", start=2, end=3),
        helper.make_node("Add", ["s", "one"], ["e"], name="end"),
        helper.make_node("Slice", ["table", "s", "e", "zero"], ["row"], name="slice"),
        helper.make_node("Relu", ["row"], ["y"], name="relu"),
    ]
    inits = [ints("one", [1]), ints("zero", [0])]
    model = make_model(nodes, [PAST, vi("table", [64, 8])], [vi("y", None)], inits)
    result = infer_shapes(model, PINS)
    for n in result.nodes:  # pretend inference proved the row extent constant (it is: end - start = 1)
        if n.name in ("slice", "relu"):
            for info in (*n.output_infos, *(n.input_infos if n.name == "relu" else ())):
                info.shape = (1, 8)
    p = plan_capture(result, classify(result), {"": 21}, min_segment_nodes=1)
    assert p.node("relu").capturable
    node = p.node("slice")
    assert not node.capturable and node.growing == "kv"


def test_unresolved_quarantined_and_cold_nodes_stay_eager() -> None:
    from onnxgen.runtime.capture.classifier import classify
    from onnxgen.runtime.capture.planner import plan_capture
    from onnxgen.runtime.shapes.infer import infer_shapes

    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("Mystery", ["a"], ["b"], name="mystery", domain="x.test"),
        helper.make_node("Neg", ["b"], ["c"], name="after_mystery"),
        helper.make_node("Sigmoid", ["x"], ["d"], name="sigmoid"),
        helper.make_node("Neg", ["d"], ["e"], name="neg"),
    ]
    model = make_model(nodes, [vi("x", ["B", 4])], [vi("c", None), vi("e", None)])
    model.opset_import.append(helper.make_opsetid("x.test", 1))
    result = infer_shapes(model, PINS)
    opsets = {"": 21}
    p = plan_capture(result, classify(result), opsets, min_segment_nodes=1)
    assert p.node("mystery").reason.startswith("unresolved shape")
    assert p.node("after_mystery").reason.startswith("unresolved shape")  # its input is unknown
    assert p.node("relu").capturable and p.node("sigmoid").capturable
    q = plan_capture(result, classify(result), opsets, quarantine={"Sigmoid"}, warmed={"relu", "sigmoid"})
    assert q.node("sigmoid").reason.startswith("quarantined")  # quarantine outranks everything
    assert q.node("neg").reason == "op not warmed for this shape"
