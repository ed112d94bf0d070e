"""External data must come from inside the model directory, in bounds, with the declared size."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxgen.errors import ModelLoadError
from onnxgen.runtime import InferenceSession
from tests.conftest import make_model

WEIGHT = np.arange(12, dtype=np.float32).reshape(3, 4)


def write_model(directory, location="weights.bin", offset=None, length=None, dims=(3, 4), data=WEIGHT):
    """A MatMul model whose weight lives in an external file with the given entry."""
    directory.mkdir(parents=True, exist_ok=True)
    tensor = TensorProto()
    tensor.name = "w"
    tensor.data_type = TensorProto.FLOAT
    tensor.dims.extend(dims)
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        if value is not None:
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
    model = make_model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        initializers=[tensor],
    )
    path = directory / "model.onnx"
    path.write_bytes(model.SerializeToString())
    if data is not None and not os.path.isabs(location) and ".." not in location:
        target = directory / location
        if not target.exists():
            target.write_bytes(data.tobytes())
    return path


def test_valid_external_data_loads(tmp_path):
    padded = np.concatenate([np.zeros(2, np.float32), WEIGHT.ravel()])
    path = write_model(tmp_path / "m", offset=8, length=48, data=padded)
    x = np.ones((2, 3), np.float32)
    (y,) = InferenceSession(path).run(None, {"x": x})
    np.testing.assert_allclose(y, x @ WEIGHT)


def test_absolute_location_refused(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(WEIGHT.tobytes())
    path = write_model(tmp_path / "m", location=str(outside))
    with pytest.raises(ModelLoadError, match="is absolute"):
        InferenceSession(path)


def test_parent_climb_refused(tmp_path):
    (tmp_path / "outside.bin").write_bytes(WEIGHT.tobytes())
    path = write_model(tmp_path / "m", location="../outside.bin")
    with pytest.raises(ModelLoadError, match="climbs out"):
        InferenceSession(path)


def test_symlink_leaving_directory_refused(tmp_path):
    (tmp_path / "outside.bin").write_bytes(WEIGHT.tobytes())
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "weights.bin").symlink_to(tmp_path / "outside.bin")
    path = write_model(model_dir)
    with pytest.raises(ModelLoadError, match="outside the model directory"):
        InferenceSession(path)


def test_symlinked_directory_inside_is_fine(tmp_path):
    model_dir = tmp_path / "m"
    (model_dir / "real").mkdir(parents=True)
    (model_dir / "real" / "weights.bin").write_bytes(WEIGHT.tobytes())
    (model_dir / "alias").symlink_to(model_dir / "real")
    path = write_model(model_dir, location="alias/weights.bin")
    assert InferenceSession(path).get_inputs()[0].name == "x"


def test_offset_beyond_file_refused(tmp_path):
    path = write_model(tmp_path / "m", offset=4096)
    with pytest.raises(ModelLoadError, match="beyond the end"):
        InferenceSession(path)


def test_length_beyond_file_refused(tmp_path):
    path = write_model(tmp_path / "m", offset=8, length=48)
    with pytest.raises(ModelLoadError, match="runs past the end"):
        InferenceSession(path)


def test_size_not_matching_shape_refused(tmp_path):
    path = write_model(tmp_path / "m", length=40)
    with pytest.raises(ModelLoadError, match="does not match its shape"):
        InferenceSession(path)


def test_short_file_without_length_refused(tmp_path):
    path = write_model(tmp_path / "m", data=WEIGHT.ravel()[:5])
    with pytest.raises(ModelLoadError, match="runs past the end"):
        InferenceSession(path)


def test_missing_external_file(tmp_path):
    path = write_model(tmp_path / "m", location="nowhere.bin", data=None)
    with pytest.raises(ModelLoadError, match="not found"):
        InferenceSession(path)


def test_loading_writes_nothing(tmp_path):
    path = write_model(tmp_path / "m")
    before = sorted(p.name for p in (tmp_path / "m").iterdir())
    InferenceSession(path)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == before


def test_proto_with_external_data_needs_directory(tmp_path):
    path = write_model(tmp_path / "m")
    model = onnx.load(path, load_external_data=False)
    with pytest.raises(ModelLoadError, match="without a directory"):
        InferenceSession(model)
    assert InferenceSession(model, base_dir=tmp_path / "m").get_inputs()[0].name == "x"
