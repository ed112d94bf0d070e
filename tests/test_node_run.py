"""The one node run (executor.NodeRunner) that the eager node loop and the capture runtime share.

GraphProgram.run (with its CPU shortcut for input lookups) and the capture runtime's warm-up runs,
seams and segment functions run nodes through NodeRunner: the same node gives the same outputs and
the same errors through either loop, and a recording's frozen host arguments stand in for the
values they were taken from.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from onnxgen.errors import OpError
from onnxgen.runtime.capture.recorder import ReplayRecorder
from onnxgen.runtime.capture.runtime import CaptureRuntime
from onnxgen.runtime.executor import NodeRunner
from onnxgen.runtime.session import InferenceSession
from tests.conftest import DEVICES, make_model, ort_run


def _vi(name: str, elem: int = TensorProto.FLOAT, shape: list | None = None):
    return helper.make_tensor_value_info(name, elem, ["n", 4] if shape is None else shape)


def mixed_model():
    """A host-read shape input (Reshape), a segment of plain arithmetic and an If seam whose
    branches read an outer value through the scope."""
    then_body = helper.make_graph(
        [helper.make_node("Mul", ["sq", "two"], ["t"], name="then_mul")], "then", [], [_vi("t")]
    )
    else_body = helper.make_graph(
        [helper.make_node("Add", ["sq", "two"], ["e"], name="else_add")], "else", [], [_vi("e")]
    )
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Reshape", ["x", "s"], ["r"], name="reshape"),
        helper.make_node("Mul", ["r", "x"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "x"], ["a"], name="add"),
        helper.make_node("Mul", ["a", "a"], ["sq"], name="square"),
        helper.make_node("If", ["cond"], ["w"], name="branch", then_branch=then_body, else_branch=else_body),
    ]
    return make_model(
        nodes,
        [_vi("x"), _vi("cond", TensorProto.BOOL, [])],
        [_vi("w")],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])],
    )


@pytest.mark.parametrize("device", DEVICES)
def test_executor_and_capture_runtime_compute_the_same(device: str) -> None:
    """On CUDA the segment is a CUDA graph (Shape runs on the host there, its value is a constant
    of the key that the recorded Reshape reads as a frozen host argument)."""
    model = mixed_model()
    eager = InferenceSession(model, device=device)
    captured = InferenceSession(model, device=device)
    recorder = ReplayRecorder() if device == "cpu" else None  # None: CUDA graphs
    runtime = CaptureRuntime(captured.program, model, recorder=recorder)
    rng = np.random.default_rng(0)
    for step in range(6):  # warm-up, warm-up, record, replays; the If seam runs eagerly every step
        x = rng.standard_normal((3, 4)).astype(np.float32)
        feeds = {"x": torch.from_numpy(x), "cond": torch.tensor(step % 2 == 0)}
        (want,) = ort_run(model, {k: v.numpy() for k, v in feeds.items()})
        feeds = {k: v.to(eager.device) for k, v in feeds.items()}
        got_eager = eager.program.run(feeds)["w"]
        got_captured = runtime.run(feeds)["w"]
        if device == "cpu":
            assert torch.equal(got_eager, torch.from_numpy(want))
        assert torch.equal(got_captured, got_eager)
    assert runtime.stats.replays >= 2, runtime.stats.summary()
    for program in (eager.program, captured.program):
        branch = next(n for n in program.nodes if n.ctx.name == "branch")
        assert branch.runs_subgraphs and branch.ctx.scope is None  # set only while the If runs


def test_node_by_node_runs_match_the_loop() -> None:
    """NodeRunner.run over each compiled node in turn (the capture path's way) leaves the values the
    executor's loop (plain CPU lookups + NodeRunner.call) leaves, minus what the loop released."""
    session = InferenceSession(mixed_model())
    program = session.program
    feeds = {"x": torch.randn(2, 4), "cond": torch.tensor(False)}
    values = dict(program.initializers, **feeds)
    for node in program.nodes:
        program.runner.run(node, values, values)
    env = program.run(feeds)
    assert set(env) <= set(values)
    for name, value in env.items():
        assert value is values[name] or torch.equal(value, values[name]), name


def test_a_failing_kernel_is_named_alike_by_both_loops() -> None:
    model = make_model(
        [helper.make_node("Gather", ["d", "i"], ["z"], name="pick", axis=0)],
        [_vi("d", shape=[3, 4]), _vi("i", TensorProto.INT64, [1])],
        [_vi("z", shape=[1, 4])],
    )
    feeds = {"d": torch.randn(3, 4), "i": torch.tensor([7])}
    session = InferenceSession(model)
    with pytest.raises(OpError) as eager:
        session.program.run(feeds)
    runtime = CaptureRuntime(session.program, model, recorder=ReplayRecorder())
    with pytest.raises(OpError) as captured:
        runtime.run(feeds)  # the key's first run: the capture runtime's warm-up
    assert str(eager.value).startswith("Gather node 'pick'"), eager.value
    assert str(captured.value) == str(eager.value)


def test_a_missing_value_is_named_alike_by_both_loops() -> None:
    session = InferenceSession(mixed_model())
    program = session.program
    feeds = {"x": torch.randn(2, 4), "cond": torch.tensor(True)}
    square = next(n for n in program.nodes if n.ctx.name == "square")
    square.inputs[1] = "nowhere"
    want = "Mul node 'square': input 'nowhere' has no value (not a graph input, initializer or earlier output)"
    with pytest.raises(OpError) as eager:
        program.run(feeds)
    with pytest.raises(OpError) as direct:
        program.runner.run(square, {"a": torch.ones(1)}, {})
    assert str(eager.value) == str(direct.value) == want


def test_frozen_host_arguments_stand_in_for_their_values() -> None:
    """A recording freezes the arguments a node reads on the host (what a CUDA graph bakes in); its
    replays use them without looking the value up again."""
    program = InferenceSession(mixed_model()).program
    reshape = next(n for n in program.nodes if n.ctx.name == "reshape")
    assert 1 in reshape.host_input_positions and 0 not in reshape.host_input_positions
    runner = NodeRunner(program.device, program.host_copies)
    x = torch.randn(2, 4)
    frozen: dict[int, object] = {}
    out: dict[str, object] = {}
    runner.run(reshape, {"x": x, "s": torch.tensor([2, 4])}, out, freeze=frozen)
    assert list(frozen) == [1] and torch.equal(frozen[1], torch.tensor([2, 4]))
    replayed: dict[str, object] = {}
    runner.run(reshape, {"x": x}, replayed, frozen=frozen)  # "s" is gone: the frozen value serves
    assert torch.equal(replayed["r"], out["r"])
    with pytest.raises(OpError, match="input 's' has no value"):
        runner.run(reshape, {"x": x}, {})
