"""InferenceSession: the onnxruntime-like entry point (numpy in/out, plus a zero-copy torch path)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from onnxgen.errors import InvalidInputError, ModelLoadError
from onnxgen.runtime.dtypes import ONNX_TO_TORCH, numpy_to_torch, onnx_type_name, torch_to_numpy
from onnxgen.runtime.executor import GraphProgram, ValueInfo, compile_model
from onnxgen.runtime.fusion import fuse_for_device, pack_matmul_groups
from onnxgen.runtime.model_io import load_model


@dataclass(frozen=True)
class NodeArg:
    """Mirrors onnxruntime's NodeArg: name, type string and shape (ints, symbol names or None)."""

    name: str
    type: str
    shape: list[int | str | None] | None


def resolve_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError("device 'cuda' was asked for, but torch sees no CUDA device here")
    if dev.type not in ("cpu", "cuda"):
        raise InvalidInputError(f"device {device!r} is not supported; expected 'cpu' or 'cuda'")
    if dev.type == "cuda":
        if dev.index is None:  # 'cuda' != 'cuda:0' for torch: compare against the concrete device
            dev = torch.device("cuda", torch.cuda.current_device())
        # fp32 stays fp32: cuDNN would otherwise run fp32 convolutions in TF32 (torch's default)
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    return dev


class InferenceSession:
    """Load an ONNX model and run it on one device.

    ``path_or_model`` is a path to a ``.onnx`` file (or a directory holding ``model.onnx``), or an
    ``onnx.ModelProto``; ``base_dir`` tells where a proto's external data lives.
    """

    def __init__(
        self,
        path_or_model: str | os.PathLike | onnx.ModelProto | bytes,
        device: str | torch.device = "cpu",
        *,
        base_dir: str | os.PathLike | None = None,
    ):
        self.device = resolve_device(device)
        if isinstance(path_or_model, onnx.ModelProto):
            model, directory = path_or_model, Path(base_dir).resolve() if base_dir else None
        elif isinstance(path_or_model, (bytes, bytearray)):
            model = onnx.ModelProto()
            try:
                model.ParseFromString(bytes(path_or_model))
            except Exception as exc:
                raise ModelLoadError(f"bytes given are not a serialized ONNX model: {exc}") from None
            directory = Path(base_dir).resolve() if base_dir else None
        else:
            model, directory = load_model(path_or_model)
        # CUDA: fewer, larger kernels per step (see runtime/fusion.py); the rewritten graph is the
        # one that runs and that the capture planner sees
        model, self.fusions = fuse_for_device(model, self.device.type)
        self.model = model
        self.model_dir = directory
        self.program: GraphProgram = compile_model(model, self.device, directory)
        if self.fusions.matmul_groups:
            pack_matmul_groups(self.program)  # one copy of the grouped weights, not two
        inits = set(self.program.initializers)
        self._inputs = [vi for vi in self.program.inputs if vi.name not in inits]
        self._optional_inputs = {vi.name for vi in self.program.inputs if vi.name in inits}
        self._outputs = self.program.outputs
        self._checked_layouts: set[tuple[Any, ...]] = set()  # see _check_feeds_repeated

    # -- onnxruntime-like metadata ---------------------------------------------------------

    def get_inputs(self) -> list[NodeArg]:
        return [NodeArg(vi.name, vi.type_str, vi.shape) for vi in self._inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [NodeArg(vi.name, vi.type_str, vi.shape) for vi in self._outputs]

    def get_providers(self) -> list[str]:
        return ["CUDAExecutionProvider" if self.device.type == "cuda" else "CPUExecutionProvider"]

    # -- running ---------------------------------------------------------------------------

    def run(
        self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: Any = None
    ) -> list[Any]:
        """numpy in, numpy out (like ``onnxruntime.InferenceSession.run``)."""
        feeds = {name: _to_torch_value(value) for name, value in input_feed.items()}
        results = self.run_torch(feeds, output_names)
        return [_to_numpy_value(v) for v in results.values()]

    def run_torch(self, feeds: Mapping[str, Any], output_names: Sequence[str] | None = None) -> dict[str, Any]:
        """torch in, torch out; tensors already on the session's device are used without copies."""
        names = list(output_names) if output_names else [o.name for o in self._outputs]
        known_outputs = {o.name for o in self._outputs}
        for name in names:
            if name not in known_outputs:
                raise InvalidInputError(f"unknown output {name!r}; the model's outputs are {sorted(known_outputs)}")
        checked = self._check_feeds(feeds)
        env = self.program.run(checked)
        return {name: env[name] for name in names}

    def _check_feeds(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        expected = {vi.name: vi for vi in self._inputs}
        unknown = [n for n in feeds if n not in expected and n not in self._optional_inputs]
        if unknown:
            raise InvalidInputError(f"unknown input name(s) {unknown}; the model's inputs are {list(expected)}")
        missing = [n for n in expected if n not in feeds]
        if missing:
            raise InvalidInputError(f"missing input(s) {missing}; the model's inputs are {list(expected)}")
        bound: dict[str, tuple[int, str]] = {}
        checked: dict[str, Any] = {}
        for name, value in feeds.items():
            info = expected.get(name)
            if info is not None and isinstance(value, torch.Tensor):
                _check_tensor(info, value, bound)
                if value.device != self.device:
                    value = value.to(self.device)
            checked[name] = value
        return checked

    def _check_feeds_repeated(self, feeds: Mapping[str, Any]) -> Mapping[str, Any]:
        """``_check_feeds`` for a step that repeats every token (the captured decode step).

        _check_feeds' verdict depends only on the feed names, their order (which input binds a symbol
        first) and each tensor's shape, dtype and device; other values pass through untouched. So once
        a layout has passed with every tensor already on this device (nothing moved: the checked feeds
        are the feeds), the same layout needs neither the check nor a copy. Any other layout runs the
        full check (and raises like it)."""
        layout = tuple(
            [
                (n, v.shape, v.dtype, v.device) if isinstance(v, torch.Tensor) else (n, v.__class__)
                for n, v in feeds.items()
            ]
        )
        if layout in self._checked_layouts:
            return feeds
        checked = self._check_feeds(feeds)
        if all(v.device == self.device for v in feeds.values() if isinstance(v, torch.Tensor)):
            if len(self._checked_layouts) >= 16:  # a handful per generator (one per KV capacity): bounded anyway
                self._checked_layouts.clear()
            self._checked_layouts.add(layout)
        return checked


def _check_tensor(info: ValueInfo, value: torch.Tensor, bound: dict[str, tuple[int, str]]) -> None:
    want = ONNX_TO_TORCH.get(info.elem_type)
    if want is not None and value.dtype != want:
        raise InvalidInputError(f"input {info.name!r} has dtype {value.dtype}, expected {info.type_str} ({want})")
    if info.shape is None:
        return
    if value.dim() != len(info.shape):
        raise InvalidInputError(
            f"input {info.name!r} has rank {value.dim()} (shape {list(value.shape)}), "
            f"expected rank {len(info.shape)} (shape {info.shape})"
        )
    for axis, (dim, size) in enumerate(zip(info.shape, value.shape)):
        if isinstance(dim, int) and dim != size:
            raise InvalidInputError(
                f"input {info.name!r} has size {size} on axis {axis}, expected {dim} (shape {info.shape})"
            )
        if isinstance(dim, str) and dim:
            seen = bound.get(dim)
            if seen is not None and seen[0] != size:
                raise InvalidInputError(
                    f"input {info.name!r} has {dim}={size} on axis {axis}, but {seen[1]} bound {dim}={seen[0]}"
                )
            bound.setdefault(dim, (size, f"input {info.name!r}"))


def _to_torch_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype == object or value.dtype.kind in "US":
            return value.astype(object)
        return numpy_to_torch(value)
    if isinstance(value, (list, tuple)):
        return [_to_torch_value(v) for v in value]
    if isinstance(value, dict):
        return value
    if value is None:
        return None
    if isinstance(value, (int, float, bool, np.generic)):
        return numpy_to_torch(np.asarray(value))
    raise InvalidInputError(f"cannot feed a value of type {type(value).__name__}; expected a numpy array")


def _to_numpy_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch_to_numpy(value)
    if isinstance(value, list):
        return [_to_numpy_value(v) for v in value]
    return value


__all__ = ["InferenceSession", "NodeArg", "onnx_type_name"]
