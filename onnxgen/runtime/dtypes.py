"""Mapping between ONNX element types, torch dtypes and numpy dtypes."""

from __future__ import annotations

import numpy as np
import onnx
import torch

TP = onnx.TensorProto

ONNX_TO_TORCH: dict[int, torch.dtype] = {
    TP.FLOAT: torch.float32,
    TP.DOUBLE: torch.float64,
    TP.FLOAT16: torch.float16,
    TP.BFLOAT16: torch.bfloat16,
    TP.INT8: torch.int8,
    TP.INT16: torch.int16,
    TP.INT32: torch.int32,
    TP.INT64: torch.int64,
    TP.UINT8: torch.uint8,
    TP.UINT16: torch.uint16,
    TP.UINT32: torch.uint32,
    TP.UINT64: torch.uint64,
    TP.BOOL: torch.bool,
    TP.COMPLEX64: torch.complex64,
    TP.COMPLEX128: torch.complex128,
    TP.FLOAT8E4M3FN: torch.float8_e4m3fn,
    TP.FLOAT8E4M3FNUZ: torch.float8_e4m3fnuz,
    TP.FLOAT8E5M2: torch.float8_e5m2,
    TP.FLOAT8E5M2FNUZ: torch.float8_e5m2fnuz,
    TP.FLOAT8E8M0: torch.float8_e8m0fnu,
    # Sub-byte integers: one element per byte holding the low bits (as ml_dtypes stores them).
    # torch has no kernels for these dtypes; op implementations reinterpret them as uint8 (see ops/cast.py).
    TP.INT4: torch.int4,
    TP.UINT4: torch.uint4,
    TP.INT2: torch.int2,
    TP.UINT2: torch.uint2,
}
TORCH_TO_ONNX: dict[torch.dtype, int] = {v: k for k, v in ONNX_TO_TORCH.items()}

NUMPY_TO_TORCH: dict[np.dtype, torch.dtype] = {
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.float16): torch.float16,
    np.dtype(np.int8): torch.int8,
    np.dtype(np.int16): torch.int16,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.uint16): torch.uint16,
    np.dtype(np.uint32): torch.uint32,
    np.dtype(np.uint64): torch.uint64,
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.complex64): torch.complex64,
    np.dtype(np.complex128): torch.complex128,
}
TORCH_TO_NUMPY: dict[torch.dtype, np.dtype] = {v: k for k, v in NUMPY_TO_TORCH.items()}


_SUB_BYTE = {"int4": torch.int4, "uint4": torch.uint4, "int2": torch.int2, "uint2": torch.uint2}


def onnx_type_name(elem_type: int) -> str:
    try:
        return TP.DataType.Name(elem_type).lower()
    except ValueError:
        return f"onnx-type-{elem_type}"


def torch_dtype(elem_type: int) -> torch.dtype:
    try:
        return ONNX_TO_TORCH[elem_type]
    except KeyError:
        raise TypeError(f"ONNX element type {onnx_type_name(elem_type)} has no torch dtype") from None


def numpy_to_torch(array: np.ndarray) -> torch.Tensor:
    """Zero-copy where the dtype and strides allow; ml_dtypes bfloat16/float8 are reinterpreted
    bit-exactly. torch has no negative strides: such an array (a[::-1]) is copied first."""
    if any(stride < 0 for stride in array.strides):
        array = np.ascontiguousarray(array)
    name = array.dtype.name
    if name == "bfloat16":
        # ascontiguousarray turns a 0-d array into 1-d: restore the shape
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint16).reshape(array.shape)).view(torch.bfloat16)
    if name.startswith("float8"):
        target = {
            "float8_e4m3fn": torch.float8_e4m3fn,
            "float8_e4m3fnuz": torch.float8_e4m3fnuz,
            "float8_e5m2": torch.float8_e5m2,
            "float8_e5m2fnuz": torch.float8_e5m2fnuz,
            "float8_e8m0fnu": torch.float8_e8m0fnu,
        }[name]
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint8).reshape(array.shape)).view(target)
    if name in _SUB_BYTE:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint8)).view(_SUB_BYTE[name])
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array)


def torch_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.dtype in TORCH_TO_NUMPY:
        return tensor.resolve_conj().numpy()
    import ml_dtypes  # ships with onnx

    by_dtype = {
        torch.bfloat16: (torch.uint16, ml_dtypes.bfloat16),
        torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
        torch.float8_e4m3fnuz: (torch.uint8, ml_dtypes.float8_e4m3fnuz),
        torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2),
        torch.float8_e5m2fnuz: (torch.uint8, ml_dtypes.float8_e5m2fnuz),
        torch.float8_e8m0fnu: (torch.uint8, ml_dtypes.float8_e8m0fnu),
        torch.int4: (torch.uint8, ml_dtypes.int4),
        torch.uint4: (torch.uint8, ml_dtypes.uint4),
        torch.int2: (torch.uint8, ml_dtypes.int2),
        torch.uint2: (torch.uint8, ml_dtypes.uint2),
    }
    raw, np_type = by_dtype[tensor.dtype]
    return tensor.contiguous().view(raw).numpy().view(np_type)
