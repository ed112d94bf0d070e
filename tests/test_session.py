"""InferenceSession API, input validation and error messages."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from onnxgen.errors import InvalidInputError, ModelLoadError, UnsupportedOpError
from onnxgen.runtime import InferenceSession
from tests.conftest import DEVICES, make_model


def add_model() -> onnx.ModelProto:
    return make_model(
        [helper.make_node("Add", ["x", "y"], ["z"], name="add0")],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4]),
        ],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 4])],
    )


def test_metadata_like_onnxruntime():
    session = InferenceSession(add_model())
    inputs = session.get_inputs()
    assert [i.name for i in inputs] == ["x", "y"]
    assert inputs[0].type == "tensor(float)"
    assert inputs[0].shape == ["batch", 4]
    assert [o.name for o in session.get_outputs()] == ["z"]


@pytest.mark.parametrize("device", DEVICES)
def test_numpy_and_torch_paths(device):
    session = InferenceSession(add_model(), device=device)
    x = np.random.rand(3, 4).astype(np.float32)
    y = np.random.rand(3, 4).astype(np.float32)
    (z,) = session.run(None, {"x": x, "y": y})
    assert isinstance(z, np.ndarray)
    np.testing.assert_array_equal(z, x + y)
    tx = torch.from_numpy(x).to(device)
    ty = torch.from_numpy(y).to(device)
    out = session.run_torch({"x": tx, "y": ty})
    assert out["z"].device.type == device
    torch.testing.assert_close(out["z"].cpu(), torch.from_numpy(x + y))


def test_torch_path_passes_tensors_without_copies():
    model = make_model(
        [helper.make_node("Identity", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    session = InferenceSession(model)
    x = torch.arange(2, dtype=torch.float32)
    y = session.run_torch({"x": x})["y"]
    assert y.data_ptr() == x.data_ptr()


@pytest.mark.parametrize(
    "feeds, message",
    [
        ({"x": np.zeros((2, 4), np.float32)}, "missing input"),
        (
            {"x": np.zeros((2, 4), np.float32), "y": np.zeros((2, 4), np.float32), "w": np.zeros(1)},
            "unknown input name",
        ),
        ({"x": np.zeros((2, 4), np.float64), "y": np.zeros((2, 4), np.float32)}, "expected tensor(float)"),
        ({"x": np.zeros((2, 4, 1), np.float32), "y": np.zeros((2, 4), np.float32)}, "expected rank 2"),
        ({"x": np.zeros((2, 5), np.float32), "y": np.zeros((2, 5), np.float32)}, "expected 4"),
        ({"x": np.zeros((2, 4), np.float32), "y": np.zeros((3, 4), np.float32)}, "batch=3"),
    ],
)
def test_bad_feeds_say_what_was_expected(feeds, message):
    session = InferenceSession(add_model())
    with pytest.raises(InvalidInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        session.run(None, feeds)


def test_unknown_output_name():
    with pytest.raises(InvalidInputError, match="unknown output 'nope'"):
        InferenceSession(add_model()).run(
            ["nope"], {"x": np.zeros((1, 4), np.float32), "y": np.zeros((1, 4), np.float32)}
        )


def test_all_unsupported_ops_listed_at_creation():
    model = make_model(
        [
            helper.make_node("FrobnicateA", ["x"], ["a"], name="first", domain="example.ops"),
            helper.make_node("Relu", ["a"], ["b"], name="fine"),
            helper.make_node("FrobnicateB", ["b"], ["y"], name="second", domain="example.ops"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model.opset_import.append(helper.make_opsetid("example.ops", 3))
    with pytest.raises(UnsupportedOpError) as info:
        InferenceSession(model)
    text = str(info.value)
    assert "2 node(s)" in text
    assert "FrobnicateA (domain example.ops, opset 3) at node 'first'" in text
    assert "FrobnicateB (domain example.ops, opset 3) at node 'second'" in text
    assert "Relu" not in text


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        InferenceSession(tmp_path / "absent.onnx")
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"\x08\x07garbage that is not protobuf\xff\xff\xff")
    with pytest.raises(ModelLoadError, match="not a valid ONNX model"):
        InferenceSession(corrupt)
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(add_model().SerializeToString()[:-7])
    with pytest.raises(ModelLoadError):
        InferenceSession(truncated)
    with pytest.raises(ModelLoadError, match="without a model.onnx"):
        InferenceSession(tmp_path)


def test_loads_from_directory_and_path(tmp_path):
    onnx.save(add_model(), tmp_path / "model.onnx")
    for target in (tmp_path, tmp_path / "model.onnx", str(tmp_path / "model.onnx")):
        assert [i.name for i in InferenceSession(target).get_inputs()] == ["x", "y"]
