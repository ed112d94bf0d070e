"""Control flow (If, Loop, Scan) with their bodies inferred, and sequence/optional ops (host values)."""

from __future__ import annotations

import onnx

from onnxgen.runtime.shapes.context import RuleContext, RuleFailed
from onnxgen.runtime.shapes.rules import rule
from onnxgen.runtime.shapes.symbols import Dim
from onnxgen.runtime.shapes.tensor import TensorInfo

INT64 = onnx.TensorProto.INT64


def _merge(ctx: RuleContext, a: TensorInfo, b: TensorInfo) -> TensorInfo:
    """One value from two branches: equal dims stay; differing dims become a symbol of both."""
    if a.kind != "tensor" or b.kind != "tensor":
        return TensorInfo(None, 0, kind=a.kind)
    if a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
        raise RuleFailed("If branches disagree on rank")
    dims: list[Dim] = [x if x == y else ctx.derived(x, y) for x, y in zip(a.shape, b.shape)]
    return ctx.out(dims, a.dtype or b.dtype)


@rule("If")
def if_op(ctx: RuleContext) -> list[TensorInfo | None]:
    then_out = ctx.subgraph(ctx.attr("then_branch"), [])
    else_out = ctx.subgraph(ctx.attr("else_branch"), [])
    cond = ctx.ints_value(0)
    if cond is not None and cond:
        return list(then_out) if cond[0] else list(else_out)
    return [_merge(ctx, a, b) for a, b in zip(then_out, else_out)]


@rule("Loop")
def loop(ctx: RuleContext) -> list[TensorInfo | None]:
    body: onnx.GraphProto = ctx.attr("body")
    carried = [ctx.input(i) for i in range(2, len(ctx.inputs))]
    iteration = ctx.out((), INT64)
    cond = ctx.out((), onnx.TensorProto.BOOL)
    outs = ctx.subgraph(body, [iteration, cond, *[c for c in carried if c is not None]])
    n_carried = len(carried)
    results: list[TensorInfo | None] = []
    for before, after in zip(carried, outs[1 : 1 + n_carried]):
        if before is None or after is None or before.shape != after.shape:
            # the carried value changes shape across iterations: one symbol of the inputs' extents
            results.append(
                ctx.out([ctx.derived(*(d for d in (before.shape or ()))) for _ in after.shape or ()], after.dtype)
            )
        else:
            results.append(ctx.out(before.shape, before.dtype))
    trips = ctx.value(0)
    trip = trips.reshape(-1)[0] if trips is not None and trips.reshape(-1)[0] is not None else None
    count = ctx.dim(trip) if trip is not None and ctx.input(1) is None else ctx.data_dependent()
    for scan in outs[1 + n_carried :]:
        results.append(ctx.out([count, *(scan.shape or ())], scan.dtype) if scan.shape is not None else None)
    return results


@rule("Scan")
def scan(ctx: RuleContext) -> list[TensorInfo | None]:
    body: onnx.GraphProto = ctx.attr("body")
    n_scan_in = int(ctx.attr("num_scan_inputs"))
    first = 0 if ctx.opset >= 9 else 1
    states = [ctx.input(i) for i in range(first, len(ctx.inputs) - n_scan_in)]
    scans = [ctx.input(i) for i in range(len(ctx.inputs) - n_scan_in, len(ctx.inputs))]
    if any(s is None or s.shape is None for s in scans):
        raise RuleFailed("scan input shape unknown")
    length = scans[0].shape[0]  # type: ignore[union-attr,index]
    body_in = [*(s for s in states if s is not None), *(ctx.out(s.shape[1:], s.dtype) for s in scans)]  # type: ignore[union-attr,index]
    outs = ctx.subgraph(body, body_in)
    results: list[TensorInfo | None] = [ctx.out(s.shape, s.dtype) for s in states if s is not None]
    for o in outs[len(states) :]:
        results.append(ctx.out([length, *(o.shape or ())], o.dtype) if o.shape is not None else None)
    return results


SEQUENCE_OPS = (
    "SequenceEmpty SequenceConstruct SequenceInsert SequenceErase SplitToSequence SequenceMap Optional"
).split()


@rule(*SEQUENCE_OPS)
def sequence(ctx: RuleContext) -> list[TensorInfo | None]:
    kind = "optional" if ctx.op_type == "Optional" else "sequence"
    return [TensorInfo(None, 0, kind=kind) for _ in range(ctx.num_outputs)]


@rule("SequenceLength", "OptionalHasElement")
def sequence_scalar(ctx: RuleContext) -> list[TensorInfo | None]:
    dtype = INT64 if ctx.op_type == "SequenceLength" else onnx.TensorProto.BOOL
    return [ctx.out((), dtype)]


@rule("SequenceAt", "OptionalGetElement", "ConcatFromSequence")
def sequence_element(ctx: RuleContext) -> list[TensorInfo | None]:
    # elements of a host sequence: shapes decided by data on the host, no provenance
    return [TensorInfo(None, 0)]
