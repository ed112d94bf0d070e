"""The capture planner: one reason per node, maximal capturable runs become segments.

Reasons, first match wins (DESIGN.md "Which ops may be captured"):
1. quarantined op type; 2. structural: host control flow / sequence values (host seam),
unresolved shape (eager); 3. classifier veto: a growing symbol in an input or output shape,
or in the value of an input the op reads on the host (eager device seam); 4. not warmed;
5. the op implementation's own capture support.

Shape arithmetic whose every value is known symbolically (Shape → Gather → Concat chains,
constants) is folded on the host: for a fixed binding its values are constants, computed from
the symbol bindings before the step, so it is kind "host" but does NOT split a segment.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from onnxgen.runtime.capture.classifier import Classification
from onnxgen.runtime.executor import HOST_ELIGIBLE_OPS
from onnxgen.runtime.ops.registry import load_all_ops, lookup
from onnxgen.runtime.shapes.infer import NodeShapes, ShapeResult

HOST_FLOW_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})
HOST_VALUE_OPS = frozenset(
    {
        "SequenceEmpty",
        "SequenceConstruct",
        "SequenceInsert",
        "SequenceAt",
        "SequenceErase",
        "SequenceLength",
        "SplitToSequence",
        "ConcatFromSequence",
        "Optional",
        "OptionalHasElement",
        "OptionalGetElement",
    }
)
FOLDED_REASON = "shape arithmetic (folded on host)"


@dataclass
class NodePlan:
    index: int
    name: str
    op_type: str
    domain: str
    capturable: bool
    kind: str  # "segment" | "host" | "eager"
    reason: str | None
    segment: int | None = None
    folded: bool = False  # host shape arithmetic: not a seam, does not split segments
    growing: str | None = None  # for a classifier veto: the growing symbol found
    chain: list[str] = field(default_factory=list)  # ... and how it became growing

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "op_type": self.op_type,
            "domain": self.domain,
            "capturable": self.capturable,
            "kind": self.kind,
            "reason": self.reason,
            "segment": self.segment,
            "folded": self.folded,
        }
        if self.growing is not None:
            out["growing"] = self.growing
            out["chain"] = self.chain
        return out


@dataclass
class CapturePlan:
    nodes: list[NodePlan]
    segments: list[list[int]]  # node indices per segment, in graph order
    mode: str
    growing: list[str]
    pinned: list[str]

    @property
    def seams(self) -> list[NodePlan]:
        return [n for n in self.nodes if not n.capturable and not n.folded]

    def counts(self) -> dict[str, int]:
        return {
            "segments": len(self.segments),
            "nodes": len(self.nodes),
            "captured": sum(n.capturable for n in self.nodes),
            "folded": sum(n.folded for n in self.nodes),
            "host_seams": sum(n.kind == "host" and not n.folded for n in self.nodes),
            "eager_seams": sum(n.kind == "eager" for n in self.nodes),
        }

    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def to_json(self) -> dict[str, Any]:
        return {
            "segments": len(self.segments),
            "counts": self.counts(),
            "mode": self.mode,
            "growing": self.growing,
            "pinned": self.pinned,
            "nodes": [n.to_json() for n in self.nodes],
        }


def _infos(node: NodeShapes) -> list:
    return [i for i in (*node.input_infos, *node.output_infos) if i is not None]


def _folded(node: NodeShapes) -> bool:
    if node.op_type == "Constant" and node.domain == "":
        return True
    if node.domain != "" or node.op_type not in HOST_ELIGIBLE_OPS or not node.resolved:
        return False
    outs = [o for name, o in zip(node.outputs, node.output_infos) if name]
    if not outs or not all(o is not None and o.value_known() for o in outs):
        return False
    if node.op_type in ("Shape", "Size"):
        return True
    ins = [i for name, i in zip(node.inputs, node.input_infos) if name]
    return all(i is not None and i.value_known() for i in ins)


def _decide(
    node: NodeShapes,
    cls: Classification,
    opsets: dict[str, int],
    quarantine: frozenset[str],
    warmed: set[str] | None,
) -> NodePlan:
    plan = NodePlan(node.index, node.name, node.op_type, node.domain, False, "eager", None)
    # 1. quarantine
    if node.op_type in quarantine:
        plan.reason = f"quarantined: {node.op_type} broke a recording earlier in this session"
        return plan
    # 2. structural
    if node.domain == "" and node.op_type in HOST_FLOW_OPS:
        plan.kind, plan.reason = "host", "host control flow"
        return plan
    if node.domain == "" and node.op_type in HOST_VALUE_OPS:
        plan.kind, plan.reason = "host", "sequence/optional value (host)"
        return plan
    if not node.resolved:
        plan.reason = f"unresolved shape: {node.note}"
        return plan
    infos = _infos(node)
    if any(i.kind == "tensor" and i.shape is None for i in infos):
        plan.reason = "unresolved shape: rank unknown"
        return plan
    if _folded(node):
        plan.kind, plan.reason, plan.folded = "host", FOLDED_REASON, True
        return plan
    spec = lookup(node.domain, node.op_type, opsets.get(node.domain, 1))
    # 3. classifier veto: every input and output shape, and values the op reads on the host
    dims = [d for i in infos for d in i.shape or ()]
    host_reads = spec.host_inputs if spec is not None else ()
    for position in host_reads:
        info = node.input_infos[position] if position < len(node.input_infos) else None
        if info is not None and info.value is not None:
            for e in info.value.reshape(-1):
                if e is not None:
                    dims.extend(sorted(e.symbols()))
    found = cls.first_growing(dims)
    if found is not None:
        plan.reason = f"classifier veto: growing symbol {found}"
        plan.growing, plan.chain = found, cls.chain(found)
        return plan
    # 4. warm-up
    if warmed is not None and node.name not in warmed:
        plan.reason = "op not warmed for this shape"
        return plan
    # 5. the op implementation's own capture support
    if spec is None:
        plan.reason = "no implementation of this op"
        return plan
    if spec.capture is not None:
        plan.reason = f"op: {spec.capture}"
        return plan
    plan.capturable, plan.kind = True, "segment"
    return plan


def _demote_short_runs(nodes: list[NodePlan], minimum: int) -> None:
    run: list[NodePlan] = []
    for plan in [*nodes, None]:
        if plan is not None and (plan.capturable or plan.folded):
            if plan.capturable:
                run.append(plan)
            continue
        if 0 < len(run) < minimum:
            for p in run:
                p.capturable, p.kind = False, "eager"
                p.reason = f"run of {len(run)} capturable node(s) between seams: a graph launch saves nothing"
        run = []


def plan_capture(
    result: ShapeResult,
    classification: Classification,
    opsets: dict[str, int],
    *,
    quarantine: Iterable[str] = (),
    warmed: set[str] | None = None,
    min_segment_nodes: int = 2,
) -> CapturePlan:
    """Plan the step described by ``result`` (main graph nodes, in graph order).

    A run shorter than ``min_segment_nodes`` stays eager: one graph launch for one kernel saves nothing."""
    load_all_ops()
    q = frozenset(quarantine)
    nodes = [_decide(n, classification, opsets, q, warmed) for n in result.nodes]
    _demote_short_runs(nodes, min_segment_nodes)
    segments: list[list[int]] = []
    current: list[int] | None = None
    for position, plan in enumerate(nodes):
        if plan.capturable:
            if current is None:
                current = []
                segments.append(current)
            current.append(position)
            plan.segment = len(segments) - 1
        elif not plan.folded:
            current = None  # a seam closes the segment; folded host arithmetic does not
    return CapturePlan(
        nodes, segments, classification.mode, sorted(classification.growing), sorted(classification.pinned)
    )
