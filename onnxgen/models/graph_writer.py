"""Write an ONNX graph whose weights stream straight into one external-data file.

Each initializer's bytes go to `<model>.data` the moment it is added, so a multi-GB model
never sits in memory twice (only the tensor being converted does). Small tensors (shape
constants, scalars) stay inline in the protobuf, where shape-tracking code can read them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper

# Tensors at least this large are page-aligned in the data file so runtimes can mmap them.
_PAGE = 4096
_PAGE_ALIGN_FROM = 1 << 20
_INLINE_BELOW = 1024  # bytes

_NP_TO_ONNX = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.bool_): TensorProto.BOOL,
}


def onnx_dtype(dtype: np.dtype | type) -> int:
    return _NP_TO_ONNX[np.dtype(dtype)]


class GraphWriter:
    """Collects nodes and I/O declarations; initializer data goes to disk immediately."""

    def __init__(self, model_path: Path, data_name: str | None = None) -> None:
        self.model_path = Path(model_path)
        self.data_name = data_name or self.model_path.name + ".data"
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set()
        self._constants: dict[tuple, str] = {}
        self._node_count = 0
        self._data: BinaryIO = open(self.model_path.parent / self.data_name, "wb")  # noqa: SIM115 (closed in save)
        self._offset = 0

    # --- initializers -------------------------------------------------------------------

    def initializer(self, name: str, array: np.ndarray) -> str:
        """Add `array` as initializer `name`; large ones are appended to the data file now."""
        return self.stacked_initializer(name, [array])

    def stacked_initializer(self, name: str, parts: list[np.ndarray]) -> str:
        """Add the concatenation of `parts` along their first axis as initializer `name`, written
        part by part: the bytes of initializer(name, np.concatenate(parts)), without that copy."""
        parts = [np.ascontiguousarray(part) for part in parts]
        first = parts[0]
        if any(part.dtype != first.dtype or part.shape[1:] != first.shape[1:] for part in parts[1:]):
            raise ValueError(f"initializer {name!r}: parts of different dtypes or trailing shapes")
        tensor = self._claim(name, onnx_dtype(first.dtype))
        shape = first.shape if len(parts) == 1 else (sum(part.shape[0] for part in parts), *first.shape[1:])
        tensor.dims.extend(shape)
        self._store(tensor, [memoryview(part.reshape(-1).view(np.uint8)) for part in parts])  # no copies
        return name

    def packed_initializer(self, name: str, packed: np.ndarray, dims: tuple[int, ...], onnx_type: int) -> str:
        """An initializer of a sub-byte type (UINT4) whose bytes are already packed."""
        tensor = self._claim(name, onnx_type)
        tensor.dims.extend(dims)
        self._store(tensor, [memoryview(np.ascontiguousarray(packed, dtype=np.uint8).reshape(-1))])
        return name

    def _claim(self, name: str, onnx_type: int) -> TensorProto:
        if name in self._names:
            raise ValueError(f"initializer {name!r} written twice")
        self._names.add(name)
        tensor = TensorProto()
        tensor.name = name
        tensor.data_type = onnx_type
        return tensor

    def _store(self, tensor: TensorProto, raw: list[memoryview]) -> None:
        size = sum(part.nbytes for part in raw)
        if size < _INLINE_BELOW:
            tensor.raw_data = b"".join(raw)
        else:
            align = _PAGE if size >= _PAGE_ALIGN_FROM else 64
            pad = (-self._offset) % align
            if pad:
                self._data.write(b"\0" * pad)
                self._offset += pad
            for part in raw:
                self._data.write(part)
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", self.data_name), ("offset", self._offset), ("length", size)):
                entry = tensor.external_data.add()
                entry.key = key
                entry.value = str(value)
            self._offset += size
        self.initializers.append(tensor)

    def const(self, values: list | float | int | np.ndarray, dtype: np.dtype | type = np.int64) -> str:
        """A small shared constant, named by value (deduplicated)."""
        array = np.asarray(values, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        name = self._constants.get(key)
        if name is None:
            flat = "_".join(str(v) for v in array.reshape(-1)[:8].tolist())
            name = f"const/{array.dtype.name}/{list(array.shape)}/{flat}".replace(" ", "")
            if name in self._names:
                name += f"/{len(self._constants)}"
            self.initializer(name, array)
            self._constants[key] = name
        return name

    # --- nodes and I/O ------------------------------------------------------------------

    def node(
        self,
        op_type: str,
        inputs: list[str],
        num_outputs: int = 1,
        *,
        name: str | None = None,
        domain: str = "",
        outputs: list[str] | None = None,
        **attrs,
    ) -> list[str]:
        """Append a node; returns its output names (generated from the node name unless given)."""
        self._node_count += 1
        name = name or f"/{op_type}_{self._node_count}"
        if outputs is None:
            outputs = [f"{name}/output_{i}" for i in range(num_outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=name, domain=domain or None, **attrs))
        return outputs

    def op(self, op_type: str, *inputs: str, name: str | None = None, domain: str = "", **attrs) -> str:
        """A node with one output; returns that output's name."""
        return self.node(op_type, list(inputs), 1, name=name, domain=domain, **attrs)[0]

    def add_input(self, name: str, elem_type: int, shape: list[int | str]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def add_output(self, name: str, elem_type: int, shape: list[int | str]) -> str:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    # --- finish -------------------------------------------------------------------------

    def save(self, graph_name: str, opset: int = 21, ms_opset: int | None = 1, doc: str = "") -> Path:
        """Close the data file and write the model protobuf next to it."""
        self._data.flush()
        os.fsync(self._data.fileno())
        self._data.close()
        graph = helper.make_graph(self.nodes, graph_name, self.inputs, self.outputs, initializer=self.initializers)
        imports = [helper.make_opsetid("", opset)]
        if ms_opset is not None:
            imports.append(helper.make_opsetid("com.microsoft", ms_opset))
        model = helper.make_model(graph, opset_imports=imports, producer_name="onnxgen", doc_string=doc)
        model.ir_version = 10  # opset 21 needs IR 10; newer IRs are not read by every runtime yet
        with open(self.model_path, "wb") as f:
            f.write(model.SerializeToString())
        return self.model_path

    def abort(self) -> None:
        if not self._data.closed:
            self._data.close()
