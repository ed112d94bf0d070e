"""A decode step cut up as the capture plan says: segments (recorded), seams (eager), shape arithmetic.

Folded host shape arithmetic (DESIGN.md: resolved symbolically) comes in two kinds for one
binding key: *static* (its value mentions no symbol once the key's symbols are bound: computed
once per key, then a constant) and *dynamic* (it mentions a growing symbol, e.g. the KV length of a
dynamic cache: evaluated every step, on the host, before the segment it sits in, which it may
precede because its inputs are shapes of values the seams or the caller produced).

Units hold the program's compiled nodes; the capture runtime runs them with the executor's node
run (``executor.NodeRunner``), so seams and recordings execute exactly the kernels and placements
of an eager run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from onnxgen.runtime.capture.planner import CapturePlan, NodePlan
from onnxgen.runtime.executor import CompiledNode, GraphProgram
from onnxgen.runtime.shapes.infer import NodeShapes, ShapeResult


class ScheduleRefused(Exception):
    """The plan admits a node the runtime cannot record safely; ``op_type`` is to be quarantined."""

    def __init__(self, message: str, op_type: str):
        super().__init__(message)
        self.op_type = op_type


@dataclass
class Unit:
    kind: str  # "segment" | "seam" | "folded" (dynamic shape arithmetic)
    nodes: list[CompiledNode]
    segment: int | None = None
    reason: str | None = None
    inputs: list[str] = field(default_factory=list)  # segment: values read from outside the segment
    outputs: list[str] = field(default_factory=list)  # segment: values read after it (or graph outputs)

    @property
    def label(self) -> str:
        first, last = self.nodes[0].ctx.name, self.nodes[-1].ctx.name
        return f"segment {self.segment} ({len(self.nodes)} nodes, {first} .. {last})"


@dataclass
class Schedule:
    units: list[Unit]
    static_outputs: set[str]  # values of static folded arithmetic: constants for the key
    plan: CapturePlan

    @property
    def segments(self) -> list[Unit]:
        return [u for u in self.units if u.kind == "segment"]


def pair_with_plan(program: GraphProgram, plan: CapturePlan) -> list[tuple[CompiledNode, NodePlan]]:
    """Compiled nodes with their plan entries (Constant nodes were folded into initializers)."""
    nodes = [n for n in plan.nodes if not (n.op_type == "Constant" and n.domain == "")]
    if len(nodes) != len(program.nodes):
        raise ValueError(f"plan has {len(nodes)} runnable nodes, the program {len(program.nodes)} compiled nodes")
    for compiled, planned in zip(program.nodes, nodes):
        if compiled.ctx.name != planned.name or compiled.ctx.op_type != planned.op_type:
            raise ValueError(
                f"plan and program disagree: plan node {planned.name!r} vs compiled node {compiled.ctx.name!r}"
            )
    return list(zip(program.nodes, nodes))


def is_static(shapes: NodeShapes) -> bool:
    """Folded arithmetic whose every output value is a constant once the key is bound."""
    for name, info in zip(shapes.outputs, shapes.output_infos):
        if not name:
            continue
        if info is None or info.value is None:
            return False
        for e in info.value.reshape(-1):
            if e is None or not e.is_const():
                return False
    return True


def build_schedule(program: GraphProgram, plan: CapturePlan, shapes: ShapeResult) -> Schedule:
    by_index = {n.index: n for n in shapes.nodes}
    units: list[Unit] = []
    static_outputs: set[str] = set()
    open_segment: Unit | None = None
    constants = set(program.initializers)
    for compiled, planned in pair_with_plan(program, plan):
        if planned.capturable and compiled.on_host and all(not n or n in constants for n in compiled.inputs):
            # host arithmetic over constants the planner could not fold (e.g. a Cast to float): its
            # outputs are constants for the key too; left in a segment, its host result would need
            # a host-to-device copy during the capture, which CUDA refuses
            static_outputs.update(o for o in compiled.outputs if o)
            constants.update(o for o in compiled.outputs if o)
            continue
        if planned.folded:
            if is_static(by_index[planned.index]):
                static_outputs.update(o for o in compiled.outputs if o)
                constants.update(o for o in compiled.outputs if o)
                continue
            unit = Unit("folded", [compiled], reason=planned.reason)
            if open_segment is not None:  # hoist before the segment it sits in (checked below)
                units.insert(units.index(open_segment), unit)
            else:
                units.append(unit)
            continue
        if planned.capturable:
            if open_segment is None or open_segment.segment != planned.segment:
                open_segment = Unit("segment", [], segment=planned.segment)
                units.append(open_segment)
            open_segment.nodes.append(compiled)
            continue
        open_segment = None
        units.append(Unit("seam", [compiled], reason=planned.reason))
    schedule = Schedule(units, static_outputs, plan)
    _wire(program, schedule)
    return schedule


def _reads(compiled: CompiledNode) -> list[str]:
    names = [n for n in compiled.inputs if n]
    for sub in compiled.ctx.subgraphs.values():
        names.extend(sorted(sub.outer_references()))
    return names


def _wire(program: GraphProgram, schedule: Schedule) -> None:
    """Each segment's external inputs/outputs; refuse what a recording cannot serve."""
    constants = set(program.initializers) | schedule.static_outputs
    graph_outputs = {o.name for o in program.outputs}
    # every value must exist before the unit that reads it (hoisted arithmetic included)
    available = constants | {vi.name for vi in program.inputs}
    for unit in schedule.units:
        for compiled in unit.nodes:
            for name in _reads(compiled):
                if name not in available:
                    raise ScheduleRefused(
                        f"{compiled.ctx.name!r} would read {name!r} before it is produced (hoisted shape arithmetic)",
                        compiled.ctx.op_type,
                    )
            available.update(o for o in compiled.outputs if o)
    for i, unit in enumerate(schedule.units):
        if unit.kind != "segment":
            continue
        inside = {o for c in unit.nodes for o in c.outputs if o}
        inputs: list[str] = []
        for compiled in unit.nodes:
            if compiled.ctx.subgraphs:
                raise ScheduleRefused(f"{compiled.ctx.name!r} runs a subgraph", compiled.ctx.op_type)
            for position, name in enumerate(compiled.inputs):
                if not name or name in inside or name in constants:
                    continue
                if compiled.on_host or position in compiled.host_input_positions:
                    # a value read on the host would be baked into the recording, yet it changes
                    # from step to step (or must first come back from the device): never capture
                    raise ScheduleRefused(
                        f"{compiled.ctx.name!r} reads the per-step value {name!r} on the host", compiled.ctx.op_type
                    )
                if name not in inputs:
                    inputs.append(name)
        later = set(graph_outputs)
        for other in schedule.units[i + 1 :]:
            for compiled in other.nodes:
                later.update(_reads(compiled))
        unit.inputs = inputs
        unit.outputs = [o for c in unit.nodes for o in c.outputs if o and o in later]
