"""Loading ONNX models safely: external data may only come from inside the model's directory."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import onnx
import torch
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from onnxgen.errors import ModelLoadError
from onnxgen.runtime.dtypes import ONNX_TO_TORCH, numpy_to_torch

# bits per element of the ONNX types whose raw layout is not one numpy item per element
_SUB_BYTE_BITS = {
    getattr(onnx.TensorProto, name): bits
    for name, bits in (("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4), ("INT2", 2), ("UINT2", 2))
    if hasattr(onnx.TensorProto, name)
}


def load_model(path: str | os.PathLike) -> tuple[onnx.ModelProto, Path]:
    """Parse the model file without touching external data; returns the proto and its directory."""
    model_path = Path(path)
    if model_path.is_dir():
        candidate = model_path / "model.onnx"
        if not candidate.is_file():
            raise ModelLoadError(f"{model_path} is a directory without a model.onnx file")
        model_path = candidate
    if not model_path.exists():
        raise ModelLoadError(f"model file not found: {model_path}")
    if not model_path.is_file():
        raise ModelLoadError(f"model path is not a regular file: {model_path}")
    try:
        data = model_path.read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"cannot read {model_path}: {exc.strerror or exc}") from None
    return parse_model_bytes(data, str(model_path)), model_path.parent.resolve()


def parse_model_bytes(data: bytes, source: str) -> onnx.ModelProto:
    """A serialized ModelProto, refused (ModelLoadError) when it does not parse or holds no graph;
    ``source`` names where the bytes came from in the message."""
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(
            f"{source} is not a valid ONNX model (protobuf parse failed: {exc}); expected a serialized onnx.ModelProto"
        ) from None
    if not model.HasField("graph"):
        raise ModelLoadError(f"{source} holds no ONNX graph; expected a serialized onnx.ModelProto")
    return model


def _external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def _checked_int(info: dict[str, str], key: str, tensor_name: str) -> int | None:
    if key not in info:
        return None
    try:
        value = int(info[key])
    except ValueError:
        raise ModelLoadError(f"tensor {tensor_name!r}: external-data {key} {info[key]!r} is not an integer") from None
    if value < 0:
        raise ModelLoadError(f"tensor {tensor_name!r}: external-data {key} {value} is negative")
    return value


def resolve_inside(location: str, base_dir: Path, what: str, place: str = "the model directory") -> Path:
    """``base_dir / location``, refused (ModelLoadError) if it could lead outside ``base_dir``: an
    absolute or drive path, a '..' part, or a symlink (of the file or a folder on the way) that
    resolves outside. ``what`` names the entry in messages, ``place`` the directory. Existence is
    the caller's to check (its message knows what the file is for)."""
    if not location:
        raise ModelLoadError(f"{what} is empty")
    if os.path.isabs(location) or location.startswith(("/", "\\")) or (len(location) > 1 and location[1] == ":"):
        raise ModelLoadError(
            f"{what} {location!r} is absolute; expected a relative path inside {place} (files outside it are not read)"
        )
    parts = Path(location.replace("\\", "/")).parts
    if ".." in parts:
        raise ModelLoadError(f"{what} {location!r} climbs out with '..'; expected a path inside {place}")
    base = base_dir.resolve()
    target = (base / location).resolve()
    if base != target and base not in target.parents:
        raise ModelLoadError(f"{what} {location!r} resolves to {target}, outside {place} {base} (through a symlink)")
    return target


def resolve_external_location(location: str, base_dir: Path, tensor_name: str) -> Path:
    """The file an external-data entry names, refused if it could lead outside base_dir."""
    target = resolve_inside(location, base_dir, f"tensor {tensor_name!r}: external-data location")
    if not target.is_file():
        raise ModelLoadError(
            f"tensor {tensor_name!r}: external-data file {location!r} not found in {base_dir.resolve()}"
        )
    return target


def _expected_nbytes(tensor: onnx.TensorProto) -> int:
    count = int(np.prod(tensor.dims, dtype=np.int64)) if len(tensor.dims) else 1
    if tensor.data_type in _SUB_BYTE_BITS:
        return (count * _SUB_BYTE_BITS[tensor.data_type] + 7) // 8
    if tensor.data_type == onnx.TensorProto.STRING:
        raise ModelLoadError(f"tensor {tensor.name!r}: string tensors cannot be stored as external data")
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return count * itemsize


def read_external_bytes(tensor: onnx.TensorProto, base_dir: Path, into: torch.Tensor | None = None) -> bytes:
    """The tensor's external bytes, checked; with ``into`` (a uint8 CPU tensor of the expected
    size) they are read straight into it and b"" is returned (no intermediate copy)."""
    info = _external_info(tensor)
    name = tensor.name or "<unnamed>"
    path = resolve_external_location(info.get("location", ""), base_dir, name)
    offset = _checked_int(info, "offset", name) or 0
    length = _checked_int(info, "length", name)
    file_size = path.stat().st_size
    if offset > file_size:
        raise ModelLoadError(
            f"tensor {name!r}: external-data offset {offset} is beyond the end of {path.name} ({file_size} bytes)"
        )
    expected = _expected_nbytes(tensor)
    if length is None:
        length = expected
    if offset + length > file_size:
        raise ModelLoadError(
            f"tensor {name!r}: external data [{offset}, {offset + length}) runs past the end of "
            f"{path.name} ({file_size} bytes)"
        )
    if length != expected:
        raise ModelLoadError(
            f"tensor {name!r}: external-data length {length} does not match its shape {list(tensor.dims)} "
            f"and type {onnx.TensorProto.DataType.Name(tensor.data_type)} ({expected} bytes expected)"
        )
    with open(path, "rb") as handle:
        handle.seek(offset)
        if into is None:
            return handle.read(length)
        if handle.readinto(into.numpy()) != length:  # the file shrank since the size check
            raise ModelLoadError(f"tensor {name!r}: external data of {path.name} ended before {length} bytes")
        return b""


# byte-aligned types whose raw external data is the tensor's memory as is (little-endian, like
# ONNX's raw_data): read straight into the torch tensor, with no bytes/proto/numpy copies between
_DIRECT_TYPES = {
    t: ONNX_TO_TORCH[t]
    for t in (
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.DOUBLE,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.BFLOAT16,
        onnx.TensorProto.INT8,
        onnx.TensorProto.INT16,
        onnx.TensorProto.INT32,
        onnx.TensorProto.INT64,
        onnx.TensorProto.UINT8,
    )
}


def _read_external_direct(tensor: onnx.TensorProto, base_dir: Path) -> torch.Tensor:
    """An external tensor of a _DIRECT_TYPES type, read once, into its final storage. (The general
    path holds the bytes, a proto copy and a numpy copy of a large weight at the same time.)"""
    dtype = _DIRECT_TYPES[tensor.data_type]
    buffer = torch.empty(_expected_nbytes(tensor), dtype=torch.uint8)
    read_external_bytes(tensor, base_dir, into=buffer)
    return buffer.view(dtype).reshape(tuple(tensor.dims))


def tensor_to_value(tensor: onnx.TensorProto, base_dir: Path | None) -> torch.Tensor | np.ndarray:
    """A TensorProto as a torch tensor (numpy object array for strings), external data checked."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        if base_dir is None:
            raise ModelLoadError(
                f"tensor {tensor.name!r} keeps its data in an external file, but the model was given "
                "without a directory; load it from a path"
            )
        if tensor.data_type in _DIRECT_TYPES and sys.byteorder == "little":
            return _read_external_direct(tensor, base_dir)
        raw = read_external_bytes(tensor, base_dir)
        inline = onnx.TensorProto()
        inline.CopyFrom(tensor)
        del inline.external_data[:]
        inline.data_location = onnx.TensorProto.DEFAULT
        inline.raw_data = raw
        tensor = inline
    try:
        array = numpy_helper.to_array(tensor)
    except Exception as exc:  # onnx raises several types for malformed tensors
        raise ModelLoadError(f"tensor {tensor.name!r} is malformed: {exc}") from None
    if array.dtype == object:
        return array
    # ascontiguousarray turns 0-d arrays into shape (1,); keep scalars scalar
    return numpy_to_torch(np.ascontiguousarray(array).reshape(array.shape))
