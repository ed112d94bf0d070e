"""The CUDA fusion pass (onnxgen/runtime/fusion.py) on small graphs: what it fuses, what it must
leave alone, and that the rewritten graph computes what onnxruntime computes on the original."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

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
def test_matmul_group_matches_onnxruntime(bias_on, device: str) -> None:
    model = three_projections(bias_on)
    fused, report = fuse_graph(model)
    assert report.matmul_groups == 1
    assert [n.op_type for n in fused.graph.node] == ["MatMulGroup"]
    x = RNG.standard_normal((2, 3, 8)).astype(np.float32)
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


def test_only_cuda_sessions_are_rewritten(monkeypatch: pytest.MonkeyPatch) -> None:
    model = swiglu_model(False)
    assert fuse_for_device(model, "cpu")[1].total == 0
    assert fuse_for_device(model, "cuda")[1].total == 1
    monkeypatch.setenv("ONNXGEN_FUSE", "0")
    assert fuse_for_device(model, "cuda")[1].total == 0
    assert fuse_graph(model)[0] is not model and len(model.graph.node) == 3  # the input is left alone
