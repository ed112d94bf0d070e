"""The node loop: a graph compiled once into nodes (op implementation + context + value routing), run many times.

``NodeRunner`` is the one node run; the capture runtime runs its seams and segments through it too."""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper

from onnxgen.errors import OnnxgenError, OpError, UnsupportedOpError
from onnxgen.runtime.model_io import tensor_to_value
from onnxgen.runtime.node_contract import NodeContext, ValueInfo
from onnxgen.runtime.ops.registry import OpImpl, load_all_ops, lookup, normalize_domain

# Ops that may run on the host when every input is a host value: the arithmetic of
# Shape -> Gather -> Concat -> Reshape chains. Ops whose output can be large stay on the device.
HOST_ELIGIBLE_OPS = frozenset(
    {
        "Shape",
        "Size",
        "Gather",
        "GatherElements",
        "Concat",
        "Slice",
        "Unsqueeze",
        "Squeeze",
        "Reshape",
        "Flatten",
        "Cast",
        "CastLike",
        "Identity",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Mod",
        "Neg",
        "Abs",
        "Min",
        "Max",
        "Equal",
        "Less",
        "Greater",
        "LessOrEqual",
        "GreaterOrEqual",
        "Not",
        "And",
        "Or",
        "Where",
        "ReduceProd",
        "ReduceSum",
        "ReduceMax",
        "ReduceMin",
        "Floor",
        "Ceil",
        "Sqrt",
        "Reciprocal",
        "Pow",
        "Sign",
    }
)
HOST_VALUE_MAX_ELEMENTS = 64


@dataclass
class CompiledNode:
    """One graph node compiled for one device: its op implementation, context and value routing.

    ``GraphProgram.nodes`` holds them in graph order; ``NodeRunner`` runs them."""

    spec: OpImpl
    ctx: NodeContext
    inputs: list[str]  # "" for a missing optional input
    outputs: list[str]
    on_host: bool
    host_input_positions: frozenset[int]
    release: list[str] = field(default_factory=list)  # values last used by this node
    # Shape/Size read only metadata: their input stays where it is (no device-to-host copy)
    reads_shape_only: bool = False
    # Derived once here, so the node run (run ~470 times a token on the CPU) does not work them out
    # per call: only nodes with subgraph bodies read ``ctx.scope`` (NodeContext.run_subgraph), and
    # an op that returns one value binds it to the first output ("" when it has none or is unnamed).
    runs_subgraphs: bool = field(init=False)
    first_output: str = field(init=False)

    def __post_init__(self) -> None:
        self.runs_subgraphs = bool(self.ctx.subgraphs)
        self.first_output = self.outputs[0] if self.outputs else ""


@dataclass(frozen=True)
class UnsupportedNode:
    op_type: str
    domain: str
    opset: int
    name: str

    def describe(self) -> str:
        domain = self.domain or "ai.onnx"
        return f"{self.op_type} (domain {domain}, opset {self.opset}) at node {self.name!r}"


def value_info_of(vi: onnx.ValueInfoProto) -> ValueInfo:
    t = vi.type
    if t.HasField("tensor_type"):
        tt = t.tensor_type
        shape: list[int | str | None] | None = None
        if tt.HasField("shape"):
            shape = []
            for d in tt.shape.dim:
                if d.HasField("dim_value"):
                    shape.append(d.dim_value)
                elif d.HasField("dim_param"):
                    shape.append(d.dim_param)
                else:
                    shape.append(None)
        type_name = helper.tensor_dtype_to_string(tt.elem_type).replace("TensorProto.", "").lower()
        return ValueInfo(vi.name, tt.elem_type, shape, f"tensor({type_name})")
    kind = t.WhichOneof("value") or "unknown"
    return ValueInfo(vi.name, 0, None, kind.replace("_type", ""))


class NodeRunner:
    """The node run: one compiled node's arguments, its op call and its outputs.

    Both node loops run nodes through it: ``GraphProgram.run`` (eager) and the capture runtime
    (seams, warm-up runs, segment recordings and CPU replays), so a node gets the same arguments,
    placements and errors in every one of them, and a recording executes exactly the kernels of
    an eager run. What a runner holds is where values go: the program's device, host copies of
    small constants (served to host-read inputs without a device-to-host read) and, in the
    capture runtime, device copies of host-folded shape values (constants for a binding key, so a
    recording reads a device buffer instead of copying from the host during the capture).

    ``arguments`` and ``call`` are the two halves of ``run``: the executor's CPU loop looks its
    arguments up itself (a CPU program holds only CPU values, so nothing moves) and calls ``call``.
    """

    __slots__ = ("device", "host_copies", "device_copies")

    def __init__(
        self, device: torch.device, host_copies: Mapping[str, Any], device_copies: Mapping[str, Any] | None = None
    ):
        self.device = device
        self.host_copies = host_copies
        self.device_copies = device_copies

    def run(
        self,
        node: CompiledNode,
        env: Mapping[str, Any],
        out: MutableMapping[str, Any],
        frozen: dict[int, Any] | None = None,
        freeze: dict[int, Any] | None = None,
    ) -> None:
        """Run ``node`` on values from ``env``; its outputs go into ``out``. ``freeze``/``frozen``:
        see ``arguments``."""
        self.call(node, self.arguments(node, env, frozen, freeze), env, out)

    def arguments(
        self,
        node: CompiledNode,
        env: Mapping[str, Any],
        frozen: dict[int, Any] | None = None,
        freeze: dict[int, Any] | None = None,
    ) -> list[Any]:
        """The node's arguments, each moved to the host or the device as the node wants it.
        ``freeze``: store the host-read arguments here (by input position); ``frozen``: use the
        stored ones instead of looking them up (a replay: what a CUDA graph baked in)."""
        device = self.device
        host_copies = self.host_copies
        device_copies = self.device_copies
        args: list[Any] = []
        for position, name in enumerate(node.inputs):
            if not name:
                args.append(None)
                continue
            if frozen is not None and position in frozen:
                args.append(frozen[position])
                continue
            try:
                value = env[name]
            except KeyError:
                raise OpError(
                    f"{node.ctx.op_type} node {node.ctx.name!r}: input {name!r} has no value "
                    "(not a graph input, initializer or earlier output)"
                ) from None
            want_host = node.on_host or position in node.host_input_positions
            if isinstance(value, torch.Tensor) and not node.reads_shape_only:
                if want_host and value.device.type != "cpu":
                    value = host_copies.get(name, value).cpu()
                elif not want_host and value.device != device:
                    copy = device_copies.get(name) if device_copies else None
                    value = copy if copy is not None else value.to(device)
            if freeze is not None and want_host:
                freeze[position] = value
            args.append(value)
        return args

    @staticmethod
    def call(node: CompiledNode, args: list[Any], env: Mapping[str, Any], out: MutableMapping[str, Any]) -> None:
        """The op implementation on ``args``, its outputs bound into ``out``. A failure other than onnxgen's own
        errors becomes a OpError naming the node. ``env`` is the scope a subgraph body reads
        outer names from; it is set only for the call's duration (a body runs inside it)."""
        ctx = node.ctx
        scoped = node.runs_subgraphs
        if scoped:
            ctx.scope = env
        try:
            result = node.spec.fn(ctx, *args)
        except OnnxgenError:
            raise
        except Exception as exc:
            raise OpError(f"{ctx.op_type} node {ctx.name!r} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            if scoped:
                ctx.scope = None
        if isinstance(result, tuple):  # op implementations return a tuple for several outputs
            for name, value in zip(node.outputs, result):
                if name:
                    out[name] = value
        else:
            name = node.first_output
            if name:
                out[name] = result


def is_host_sized(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.numel() <= HOST_VALUE_MAX_ELEMENTS
        and not value.is_floating_point()
        and not value.is_complex()
    )


class GraphProgram:
    """One compiled graph (the main graph or a control-flow body)."""

    def __init__(
        self,
        graph: onnx.GraphProto,
        opsets: Mapping[str, int],
        device: torch.device,
        base_dir: Path | None,
        unsupported: list[UnsupportedNode],
        *,
        scope_names: frozenset[str] = frozenset(),
        host_held: frozenset[str] = frozenset(),
    ):
        self.graph = graph
        self.device = device
        # initializers kept on the host at load (see move_host_held_to_device)
        self.host_held = host_held
        self.opsets = dict(opsets)
        self.inputs = [value_info_of(vi) for vi in graph.input]
        self.outputs = [value_info_of(vi) for vi in graph.output]
        self.initializers: dict[str, Any] = {}
        self.host_copies: dict[str, Any] = {}
        self.host_values: set[str] = set()  # values that live on the host (small integer shape data)
        for tensor in graph.initializer:
            self._add_constant(tensor.name, tensor_to_value(tensor, base_dir))
        for sparse in graph.sparse_initializer:
            dense = onnx.numpy_helper.to_array(sparse)  # sparse initializers are rare and small
            self._add_constant(sparse.values.name, torch.from_numpy(np.ascontiguousarray(dense)))
        self.nodes: list[CompiledNode] = []
        # called after every unit of work that runs nodes (a whole run, an eager unit of a captured
        # step, a recorded segment): an op that set work going on another stream joins it there
        self.unit_joins: list[Callable[[], None]] = []
        host_values = self.host_values
        known = set(scope_names) | {vi.name for vi in graph.input} | set(self.initializers)
        for node in graph.node:
            known.update(node.output)
        for index, node in enumerate(graph.node):
            compiled = self._compile_node(node, index, base_dir, unsupported, frozenset(known), host_values)
            if compiled is None:
                continue
            self.nodes.append(compiled)
        self._plan_releases()
        self.runner = NodeRunner(device, self.host_copies)

    # -- compilation -----------------------------------------------------------------------

    def _add_constant(self, name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.numel() <= HOST_VALUE_MAX_ELEMENTS:
                # a host copy serves ops that read it as a host input (shapes, Resize scales,
                # thresholds) without a device-to-host read per run
                self.host_copies[name] = value
                if is_host_sized(value):
                    self.host_values.add(name)
            if name not in self.host_held:
                value = value.to(self.device)
        self.initializers[name] = value

    def move_host_held_to_device(self) -> None:
        """Move the initializers still held on the host (``host_held``) to the program's device. The
        session holds the members of grouped weights there at load and joins them group by group
        (fusion.pack_matmul_groups, pack_nbits_groups): loaded onto the device first, every member
        would sit there beside its joined copy, the load's peak, and leave freed blocks behind in
        segments torch cannot return. Members that stayed apart (a group that was not joined) go to
        the device here, before anything runs."""
        for name in self.host_held:
            value = self.initializers.get(name)
            if isinstance(value, torch.Tensor) and value.device != self.device:
                self.initializers[name] = value.to(self.device)

    def _decode_attrs(
        self, node: onnx.NodeProto, base_dir: Path | None, unsupported: list[UnsupportedNode], scope: frozenset[str]
    ) -> tuple[dict[str, Any], dict[str, GraphProgram]]:
        attrs: dict[str, Any] = {}
        subgraphs: dict[str, GraphProgram] = {}
        for attr in node.attribute:
            if attr.ref_attr_name:
                raise OnnxgenError(f"node {node.name!r}: attribute references exist only inside functions")
            if attr.type == onnx.AttributeProto.GRAPH:
                subgraphs[attr.name] = GraphProgram(
                    attr.g, self.opsets, self.device, base_dir, unsupported, scope_names=scope
                )
                attrs[attr.name] = subgraphs[attr.name]
            elif attr.type == onnx.AttributeProto.GRAPHS:
                attrs[attr.name] = [
                    GraphProgram(g, self.opsets, self.device, base_dir, unsupported, scope_names=scope)
                    for g in attr.graphs
                ]
            elif attr.type == onnx.AttributeProto.TENSOR:
                attrs[attr.name] = tensor_to_value(attr.t, base_dir)
            elif attr.type == onnx.AttributeProto.TENSORS:
                attrs[attr.name] = [tensor_to_value(t, base_dir) for t in attr.tensors]
            elif attr.type == onnx.AttributeProto.SPARSE_TENSOR:
                attrs[attr.name] = torch.from_numpy(
                    np.ascontiguousarray(onnx.numpy_helper.to_array(attr.sparse_tensor))
                )
            else:
                value = helper.get_attribute_value(attr)
                if isinstance(value, bytes):
                    value = value.decode("utf-8")
                elif isinstance(value, list) and value and isinstance(value[0], bytes):
                    value = [v.decode("utf-8") for v in value]
                attrs[attr.name] = value
        return attrs, subgraphs

    def _compile_node(
        self,
        node: onnx.NodeProto,
        index: int,
        base_dir: Path | None,
        unsupported: list[UnsupportedNode],
        scope: frozenset[str],
        host_values: set[str],
    ) -> CompiledNode | None:
        domain = normalize_domain(node.domain)
        opset = self.opsets.get(domain, 1 if domain else 1)
        name = node.name or f"{node.op_type}_{index}"
        spec = lookup(domain, node.op_type, opset)
        attrs, subgraphs = self._decode_attrs(node, base_dir, unsupported, scope)
        if spec is None:
            unsupported.append(UnsupportedNode(node.op_type, domain, opset, name))
            return None
        ctx = NodeContext(
            name=name,
            op_type=node.op_type,
            domain=domain,
            opset=opset,
            attrs=attrs,
            device=self.device,
            num_inputs=len(node.input),
            num_outputs=len(node.output),
            outputs_wanted=tuple(bool(o) for o in node.output),
            subgraphs=subgraphs,
        )
        # Constant nodes are folded into initializers at compile time.
        if node.op_type == "Constant" and domain == "":
            value = spec.fn(ctx)
            self._add_constant(node.output[0], value)
            return None
        live_inputs = [i for i in node.input if i]
        on_host = (
            self.device.type != "cpu"
            and domain == ""
            and node.op_type in HOST_ELIGIBLE_OPS
            and not subgraphs
            and (node.op_type in ("Shape", "Size") or (live_inputs and all(i in host_values for i in live_inputs)))
        )
        if on_host:
            host_values.update(o for o in node.output if o)
            ctx.device = torch.device("cpu")
        return CompiledNode(
            spec=spec,
            ctx=ctx,
            inputs=list(node.input),
            outputs=list(node.output),
            on_host=on_host,
            host_input_positions=frozenset(spec.host_inputs),
            reads_shape_only=domain == "" and node.op_type in ("Shape", "Size"),
        )

    def _plan_releases(self) -> None:
        keep = {o.name for o in self.outputs} | set(self.initializers)
        last_use: dict[str, int] = {}
        for position, node in enumerate(self.nodes):
            names = list(node.inputs)
            for sub in node.ctx.subgraphs.values():
                names.extend(sub.outer_references())
            for name in names:
                if name:
                    last_use[name] = position
            for name in node.outputs:
                if name and name not in last_use:
                    last_use[name] = position  # produced but never read: free at once
        for name, position in last_use.items():
            if name not in keep:
                self.nodes[position].release.append(name)

    def outer_references(self) -> set[str]:
        """Names this graph (and its nested bodies) reads from enclosing scopes."""
        cached = getattr(self, "_outer_refs", None)
        if cached is not None:
            return cached
        local = {vi.name for vi in self.inputs} | set(self.initializers)
        refs: set[str] = set()
        for node in self.nodes:
            for name in node.inputs:
                if name and name not in local:
                    refs.add(name)
            for sub in node.ctx.subgraphs.values():
                refs.update(n for n in sub.outer_references() if n not in local)
            local.update(o for o in node.outputs if o)
        for out in self.outputs:
            if out.name not in local:
                refs.add(out.name)
        self._outer_refs = refs
        return refs

    # -- execution -------------------------------------------------------------------------

    def run_positional(self, inputs: list[Any], outer: Any, device: torch.device) -> list[Any]:
        feeds = {vi.name: value for vi, value in zip(self.inputs, inputs)}
        env = self.run(feeds, outer=outer)
        return [env[o.name] for o in self.outputs]

    def run(self, feeds: Mapping[str, Any], outer: Any = None) -> Mapping[str, Any]:
        local: dict[str, Any] = dict(self.initializers)
        local.update(feeds)
        env: Any = ChainMap(local, outer) if outer is not None else local
        runner = self.runner
        call = runner.call
        # A CPU session holds only CPU tensors (feeds are moved on entry, initializers at load,
        # op implementations make their outputs on ctx.device): nothing to route, so inputs are plain lookups.
        cpu_only = self.device.type == "cpu"
        with self.unit():
            for node in self.nodes:
                if cpu_only:
                    try:
                        args = [env[name] if name else None for name in node.inputs]
                    except KeyError:
                        args = runner.arguments(node, env)  # names the missing input
                else:
                    args = runner.arguments(node, env)
                call(node, args, env, local)
                for name in node.release:
                    local.pop(name, None)
        return env

    def unit(self) -> UnitOfWork:
        """``with program.unit(): ...`` around nodes run as one unit of work: unit_joins run at its
        end, also when it ends in an exception."""
        return UnitOfWork(self)

    def join_units(self, failed: bool = False) -> None:
        """The end of a unit of work (see unit_joins). ``failed``: it ended in an exception, which
        a join's own error (a recording already broken) must not replace."""
        for join in self.unit_joins:
            try:
                join()
            except Exception:
                if not failed:
                    raise


class UnitOfWork:
    """GraphProgram.unit's context manager (a class: it wraps every run)."""

    __slots__ = ("program",)

    def __init__(self, program: GraphProgram) -> None:
        self.program = program

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self.program.join_units(failed=exc_type is not None)
        return False


def compile_model(
    model: onnx.ModelProto, device: torch.device, base_dir: Path | None, *, host_held: frozenset[str] = frozenset()
) -> GraphProgram:
    """Compile the main graph; every unsupported node (also in subgraphs) is reported at once.
    ``host_held``: initializers left on the host (GraphProgram.move_host_held_to_device)."""
    load_all_ops()
    if model.functions:
        from onnx import inliner

        model = inliner.inline_local_functions(model)
    opsets = {normalize_domain(o.domain): o.version for o in model.opset_import}
    unsupported: list[UnsupportedNode] = []
    program = GraphProgram(model.graph, opsets, device, base_dir, unsupported, host_held=host_held)
    if unsupported:
        lines = "\n  ".join(u.describe() for u in unsupported)
        raise UnsupportedOpError(f"{len(unsupported)} node(s) use ops onnxgen has no implementation of:\n  {lines}")
    return program
