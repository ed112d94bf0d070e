"""InferenceSession: the onnxruntime-like entry point (numpy in/out, plus a zero-copy torch path)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import torch

from onnxgen import options
from onnxgen.errors import InvalidInputError, ModelLoadError
from onnxgen.options import Options
from onnxgen.runtime.dtypes import NUMPY_TO_TORCH, ONNX_TO_TORCH, numpy_to_torch, onnx_type_name, torch_to_numpy
from onnxgen.runtime.executor import GraphProgram, ValueInfo, compile_model
from onnxgen.runtime.fusion import fuse_for_device, group_weight_names, pack_matmul_groups, pack_nbits_groups
from onnxgen.runtime.host_memory import release_freed_host_memory
from onnxgen.runtime.model_io import load_model, parse_model_bytes
from onnxgen.runtime.ops.contrib_quant import attach_q4_scratch, prepack_int4, widen_zero_points

if TYPE_CHECKING:
    from onnxgen.runtime.capture.runtime import CaptureRuntime


@dataclass(frozen=True)
class NodeArg:
    """Mirrors onnxruntime's NodeArg: name, type string and shape (ints, symbol names or None)."""

    name: str
    type: str
    shape: list[int | str | None] | None


DEVICE_NAMES = "'cpu', 'cuda' or 'cuda:N'"


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device a session runs on; names are case-insensitive ('CPU' is 'cpu')."""
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        try:
            dev = torch.device(device.strip().lower())
        except RuntimeError:
            raise InvalidInputError(f"device {device!r} is not supported; expected {DEVICE_NAMES}") from None
    else:
        raise InvalidInputError(
            f"device {device!r} ({type(device).__name__}) is not a device name; expected {DEVICE_NAMES}"
        )
    if dev.type not in ("cpu", "cuda"):
        raise InvalidInputError(f"device {device!r} is not supported; expected {DEVICE_NAMES}")
    if dev.type == "cpu":
        return torch.device("cpu")  # 'cpu:0' names the same (only) CPU device
    if not torch.cuda.is_available():
        raise InvalidInputError(f"device {device!r} was asked for, but torch sees no CUDA device here")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise InvalidInputError(
            f"device {device!r} was asked for, but torch sees {count} CUDA device(s): cuda:0 .. cuda:{count - 1}"
        )
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
        # the switches in force now; the graph is rewritten (or not) under them, once
        self.options: Options = options.current()
        if isinstance(path_or_model, onnx.ModelProto):
            model, directory = path_or_model, Path(base_dir).resolve() if base_dir else None
        elif isinstance(path_or_model, (bytes, bytearray)):
            model = parse_model_bytes(bytes(path_or_model), "the bytes given")
            directory = Path(base_dir).resolve() if base_dir else None
        elif isinstance(path_or_model, (str, os.PathLike)):
            model, directory = load_model(path_or_model)
        else:
            raise ModelLoadError(
                f"cannot load a model from {type(path_or_model).__name__} {path_or_model!r}; "
                "expected a path, bytes or an onnx.ModelProto"
            )
        if not model.HasField("graph"):
            raise ModelLoadError("the onnx.ModelProto given holds no ONNX graph; expected a complete model")
        # CUDA: fewer, larger kernels per step (see runtime/fusion.py); the rewritten graph is the
        # one that runs and that the capture planner sees
        model, self.fusions = fuse_for_device(model, self.device.type, self.options)
        self.model = model
        self.model_dir = directory
        groups = self.fusions.matmul_groups or self.fusions.matmul_nbits_groups
        # grouped weights wait on the host and are joined group by group: the device never holds them all
        # beside their joins
        held = group_weight_names(model) if groups and self.device.type != "cpu" else frozenset()
        self.program: GraphProgram = compile_model(model, self.device, directory, host_held=held)
        if self.fusions.matmul_groups:
            pack_matmul_groups(self.program)  # one copy of the grouped weights, not two
        if self.fusions.matmul_nbits_groups:
            pack_nbits_groups(self.program)  # the same for 4-bit codes
        self.program.move_host_held_to_device()
        if self.device.type == "cpu":
            prepack_int4(self.program)  # the CPU int4 GEMM's layout in place of the codes, not beside
        widen_zero_points(self.program)  # where the packed Triton kernels serve: a byte per zero point
        if self.device.type == "cpu":
            release_freed_host_memory()  # the load's temporaries, kept by the allocator otherwise
        if self.device.type == "cuda":
            attach_q4_scratch(self.program)  # one buffer for the prompts' dequantized 4-bit chunks
            # hand the load's freed blocks back to the device, so that it holds what the session keeps
            torch.cuda.empty_cache()
        inits = set(self.program.initializers)
        self._inputs = [vi for vi in self.program.inputs if vi.name not in inits]
        self._optional_inputs = {vi.name for vi in self.program.inputs if vi.name in inits}
        self._outputs = self.program.outputs
        self._checked_layouts: set[tuple[Any, ...]] = set()  # see check_feeds_repeated
        # what run() must not hand out uncopied (after pack_matmul_groups: the tensors that stay)
        self._persistent_storages = frozenset(persistent_storages(self.program))
        self._written_inputs = written_inputs(self.program, {vi.name for vi in self._inputs})

    # -- onnxruntime-like metadata ---------------------------------------------------------

    def get_inputs(self) -> list[NodeArg]:
        return [NodeArg(vi.name, vi.type_str, vi.shape) for vi in self._inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [NodeArg(vi.name, vi.type_str, vi.shape) for vi in self._outputs]

    def get_providers(self) -> list[str]:
        return ["CUDAExecutionProvider" if self.device.type == "cuda" else "CPUExecutionProvider"]

    @property
    def graph_inputs(self) -> list[ValueInfo]:
        """Every declared graph input (name, ONNX element type, shape, type string), also those an
        initializer backs (optional feeds, which ``get_inputs`` leaves out as onnxruntime does)."""
        return list(self.program.inputs)

    def capture_runtime(
        self,
        *,
        mode: str = "on",
        recorder: Any = None,
        pin: set[str] | tuple[str, ...] = (),
        verify_steps: int = 8,
    ) -> CaptureRuntime:
        """A CaptureRuntime over this session's program: captured runs of its repeated step (CUDA
        graphs; ``recorder``: a stand-in such as capture.recorder.ReplayRecorder on the CPU). ``pin``:
        the graph-input symbols the caller holds fixed (a fixed-capacity cache's length and mask width)."""
        from onnxgen.runtime.capture.runtime import CaptureRuntime

        return CaptureRuntime(
            self.program, self.model, mode=mode, recorder=recorder, pin=pin, verify_steps=verify_steps
        )

    # -- running ---------------------------------------------------------------------------

    def run(
        self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: Any = None
    ) -> list[Any]:
        """numpy in, numpy out (like ``onnxruntime.InferenceSession.run``).

        Feeds are taken as onnxruntime takes them: numpy arrays of the declared dtype (any strides),
        Python lists (and scalars) converted to the declared dtype. The arrays returned belong to
        the caller: an output whose storage is shared with an initializer, a feed or another output
        is copied (only then), so writing into it changes nothing else."""
        names = self._output_names(output_names)
        declared = {vi.name: vi for vi in self.program.inputs}
        feeds = {name: feed_value(declared.get(name), name, value) for name, value in _feed_items(input_feed)}
        for name in self._written_inputs.intersection(feeds):  # an op writes it in place: not the caller's array
            value = feeds[name]
            if isinstance(value, torch.Tensor) and value.device == self.device:
                feeds[name] = value.clone()
        env = self.program.run(self._check_feeds(feeds))
        results = [env[name] for name in names]  # a name asked for twice: two arrays, as onnxruntime
        shared = set(self._persistent_storages)
        for value in feeds.values():  # a sequence feed is a list of tensors
            for tensor in value if isinstance(value, list) else [value]:
                if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                    shared.add(storage_of(tensor))
        handed_out: set[int] = set()
        return [owned_numpy(value, shared, handed_out) for value in results]

    def run_torch(self, feeds: Mapping[str, Any], output_names: Sequence[str] | None = None) -> dict[str, Any]:
        """torch in, torch out; tensors already on the session's device are used without copies.

        Nothing is copied on the way out either: an output may be a feed, an initializer, a view of
        one, or the same tensor as another output. Clone an output before writing into it."""
        names = self._output_names(output_names)
        checked = self._check_feeds(dict(_feed_items(feeds)))
        env = self.program.run(checked)
        return {name: env[name] for name in names}

    def _output_names(self, output_names: Sequence[str] | None) -> list[str]:
        """The names asked for (all outputs for None or []), each a known output name."""
        known = [o.name for o in self._outputs]
        if output_names is None:
            return known
        if isinstance(output_names, (str, bytes)):
            raise InvalidInputError(
                f"output_names must be a list of output names, got the {type(output_names).__name__} "
                f"{output_names!r}; write [{output_names!r}]"
            )
        names: list[str] = []
        for position, name in enumerate(output_names):
            if isinstance(name, bytes):  # onnxruntime's binding takes bytes as str
                name = name.decode("utf-8", errors="replace")
            if not isinstance(name, str):
                raise InvalidInputError(
                    f"output_names[{position}] is {name!r} ({type(name).__name__}); "
                    f"expected an output name (str) of {known}"
                )
            if name not in known:
                raise InvalidInputError(f"unknown output {name!r}; the model's outputs are {sorted(known)}")
            names.append(name)
        return names or known

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
            elif info is not None and info.type_str.startswith("tensor(") and not _is_string_array(info, value):
                raise InvalidInputError(
                    f"input {name!r} is of type {type(value).__name__}; expected a torch.Tensor of {info.type_str}"
                )
            checked[name] = value
        return checked

    def check_feeds_repeated(self, feeds: Mapping[str, Any]) -> Mapping[str, Any]:
        """``_check_feeds`` for a step run again and again with one feed layout (a captured decode step).

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


def _feed_items(feeds: Any) -> Any:
    if not isinstance(feeds, Mapping):
        raise InvalidInputError(f"input_feed must be a dict mapping input names to arrays, got {type(feeds).__name__}")
    return feeds.items()


def _is_string_array(info: ValueInfo, value: Any) -> bool:
    return info.elem_type == onnx.TensorProto.STRING and isinstance(value, np.ndarray) and value.dtype == object


def _expected(info: ValueInfo) -> str:
    return info.type_str if info.shape is None else f"{info.type_str} with shape {info.shape}"


def feed_value(info: ValueInfo | None, name: str, value: Any) -> Any:
    """One ``run`` feed as the executor takes it: a torch tensor of the declared dtype for tensor
    inputs (numpy memory shared where numpy allows), an object array for strings, values of other
    declared types (sequences, maps, optionals) as they come. ``info`` is None for a name the graph
    does not declare (``_check_feeds`` reports it)."""
    if isinstance(value, torch.Tensor):
        return value
    if info is None or not info.type_str.startswith("tensor("):
        return _untyped_value(info, name, value)
    elem = info.elem_type
    if isinstance(value, np.generic):  # a numpy scalar keeps its dtype, like a numpy array
        value = np.asarray(value)
    elif isinstance(value, (list, tuple, bool, int, float)):
        value = _convert_list(info, name, value)
    elif value is None:
        raise InvalidInputError(f"input {name!r} is None; expected {_expected(info)}")
    elif not isinstance(value, np.ndarray):
        raise InvalidInputError(f"input {name!r} is of type {type(value).__name__}; expected {_expected(info)}")
    if elem == onnx.TensorProto.STRING:
        if value.dtype.kind not in "USO":
            raise InvalidInputError(f"input {name!r} has dtype {value.dtype}, expected {info.type_str}")
        return value.astype(object)
    if value.dtype.kind in "USO":
        what = "strings" if value.dtype.kind in "US" else "Python objects"
        raise InvalidInputError(f"input {name!r} holds {what} (dtype {value.dtype}); expected {_expected(info)}")
    want = ONNX_TO_TORCH.get(elem)
    if want is not None and NUMPY_TO_TORCH.get(value.dtype) not in (None, want):
        raise InvalidInputError(f"input {name!r} has dtype {value.dtype}, expected {info.type_str}")
    return numpy_to_torch(value)


def _convert_list(info: ValueInfo, name: str, value: Any) -> np.ndarray:
    """A Python list (or scalar) as an array of the declared element type, as onnxruntime converts it."""
    elem = info.elem_type
    try:
        if elem == onnx.TensorProto.STRING:
            return np.array(value, dtype=str).astype(object)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem) if elem else None
        return np.array(value, dtype=dtype)
    except (ValueError, TypeError, OverflowError, KeyError) as exc:
        raise InvalidInputError(f"input {name!r}: the list cannot be converted to {info.type_str} ({exc})") from None


def _untyped_value(info: ValueInfo | None, name: str, value: Any) -> Any:
    """Feeds for sequences, maps and optionals (and undeclared names): tensors converted, the rest as is."""
    if isinstance(value, np.ndarray):
        if value.dtype == object or value.dtype.kind in "US":
            return value.astype(object)
        return numpy_to_torch(value)
    if isinstance(value, (list, tuple)):
        return [_untyped_value(None, name, v) for v in value]
    if isinstance(value, np.generic):
        return numpy_to_torch(np.asarray(value))
    if value is None or isinstance(value, dict):
        return value
    raise InvalidInputError(f"input {name!r} is of type {type(value).__name__}; expected a numpy array")


# (domain, op) -> the input slots its implementation may write in place: GroupQueryAttention's shared and
# window KV layouts write the step's rows into past_key/past_value (ops/contrib_attention.py)
WRITES_INPUTS: dict[tuple[str, str], tuple[int, ...]] = {("com.microsoft", "GroupQueryAttention"): (3, 4)}
# ops whose output may be a view of their first input (a write into it lands in the input)
VIEW_OPS = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Cast", "Expand"})


def written_inputs(program: GraphProgram, graph_inputs: set[str]) -> frozenset[str]:
    """The graph inputs a run may write into: fed (directly or through views) to an in-place slot."""
    written: set[str] = set()
    for node in reversed(program.nodes):  # consumers come after producers: one backward pass
        slots = WRITES_INPUTS.get((node.ctx.domain, node.ctx.op_type), ())
        written.update(node.inputs[i] for i in slots if i < len(node.inputs) and node.inputs[i])
        if node.ctx.domain == "" and node.ctx.op_type in VIEW_OPS and node.inputs and node.outputs[0] in written:
            written.add(node.inputs[0])
    return frozenset(written & graph_inputs)


def storage_of(tensor: torch.Tensor) -> int:
    """The address of the storage a tensor lives in: equal for a tensor and all its views."""
    return tensor.untyped_storage().data_ptr()


def persistent_storages(program: GraphProgram) -> set[int]:
    """Storage addresses (CPU) that outlive a run: initializers, their host copies and tensor
    attributes, in the graph and in every nested body."""
    found: set[int] = set()
    todo = [program]
    while todo:
        current = todo.pop()
        values: list[Any] = [*current.initializers.values(), *current.host_copies.values()]
        for node in current.nodes:
            for attr in node.ctx.attrs.values():
                values.extend(attr if isinstance(attr, list) else [attr])
        for value in values:
            if isinstance(value, GraphProgram):
                todo.append(value)
            elif isinstance(value, torch.Tensor) and value.device.type == "cpu":
                found.add(storage_of(value))
    return found


def owned_numpy(value: Any, shared: set[int], handed_out: set[int]) -> Any:
    """``value`` as numpy that the caller alone owns: a CPU tensor whose storage is in ``shared``
    or was already handed out (or whose strides make elements overlap, as an Expand view's do) is
    copied, any other is wrapped as it is. Device tensors are copied by the transfer anyway."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.numel():
            storage = storage_of(value)
            overlapping = any(st == 0 and n > 1 for st, n in zip(value.stride(), value.shape))
            if storage in shared or storage in handed_out or overlapping:
                value = value.clone(memory_format=torch.contiguous_format)
                storage = storage_of(value)
            handed_out.add(storage)
        return torch_to_numpy(value)
    if isinstance(value, np.ndarray):  # string tensors: object arrays, never on a fast path
        return value.copy()
    if isinstance(value, list):
        return [owned_numpy(v, shared, handed_out) for v in value]
    return value


__all__ = ["InferenceSession", "NodeArg", "onnx_type_name"]
