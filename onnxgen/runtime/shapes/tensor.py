"""What inference knows about one value: its dtype, its shape, and for small int tensors its value."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from onnxgen.runtime.shapes.symbols import Dim

INT_TYPES = frozenset(
    {
        onnx.TensorProto.INT64,
        onnx.TensorProto.INT32,
        onnx.TensorProto.INT16,
        onnx.TensorProto.INT8,
        onnx.TensorProto.UINT64,
        onnx.TensorProto.UINT32,
        onnx.TensorProto.UINT16,
        onnx.TensorProto.UINT8,
        onnx.TensorProto.BOOL,
    }
)
VALUE_MAX_ELEMENTS = 64  # as the executor's HOST_VALUE_MAX_ELEMENTS: larger int tensors are data, not shapes


@dataclass
class TensorInfo:
    shape: tuple[Dim, ...] | None  # None: rank unknown
    dtype: int = 0  # onnx.TensorProto data type; 0 unknown
    # small int tensors: a numpy object array (of the tensor's shape) of DimExpr, or None per element
    value: np.ndarray | None = None
    kind: str = "tensor"  # "tensor" | "sequence" | "optional" | "other"

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    def symbols(self) -> set[str]:
        return {d for d in self.shape or () if isinstance(d, str)}

    def value_known(self) -> bool:
        return self.value is not None and all(v is not None for v in self.value.reshape(-1))

    def show(self) -> str:
        if self.kind != "tensor":
            return self.kind
        if self.shape is None:
            return "?"
        return "[" + ", ".join(str(d) for d in self.shape) + "]"


def unknown(dtype: int = 0) -> TensorInfo:
    return TensorInfo(None, dtype)
