"""Control flow: If, Loop, Scan. Bodies run through ``ctx.run_subgraph``; outer names resolve in scope.

Conditions and trip counts are read on the host each iteration, so none of these can be
recorded into a CUDA graph (the bodies' own nodes still run on the device).
"""

from __future__ import annotations

from typing import Any

import torch

from onnxgen.runtime.dtypes import ONNX_TO_TORCH
from onnxgen.runtime.node_contract import NodeContext, ValueInfo
from onnxgen.runtime.ops.common import ints, scalar
from onnxgen.runtime.ops.registry import implements

HOST_FLOW = "host control flow"


def _truth(value: torch.Tensor) -> bool:
    return bool(scalar(value))


@implements("If", capture=HOST_FLOW, host_inputs=(0,))
def if_(ctx: NodeContext, cond: torch.Tensor) -> tuple[Any, ...]:
    branch = "then_branch" if _truth(cond) else "else_branch"
    return tuple(ctx.run_subgraph(branch, []))


def _stack(parts: list[torch.Tensor], axis: int = 0) -> torch.Tensor:
    return torch.stack(parts, dim=axis)


@implements("Loop", capture=HOST_FLOW, host_inputs=(0, 1))
def loop(ctx: NodeContext, trip_count: torch.Tensor | None, cond: torch.Tensor | None, *carried: Any) -> tuple:
    max_trips = ints(trip_count)[0] if trip_count is not None else None
    keep_going = _truth(cond) if cond is not None else True
    n_carried = len(carried)
    n_scan = ctx.num_outputs - n_carried
    state = list(carried)
    scans: list[list[torch.Tensor]] = [[] for _ in range(n_scan)]
    cond_value = torch.tensor(keep_going)
    i = 0
    while keep_going and (max_trips is None or i < max_trips):
        outs = ctx.run_subgraph("body", [torch.tensor(i, dtype=torch.int64), cond_value, *state])
        cond_value = outs[0]
        state = list(outs[1 : 1 + n_carried])
        for collected, value in zip(scans, outs[1 + n_carried :]):
            collected.append(value)
        keep_going = _truth(cond_value)
        i += 1
    results = list(state)
    declared = ctx.subgraphs["body"].outputs[1 + n_carried :]
    for collected, info in zip(scans, declared):
        results.append(_stack(collected) if collected else _empty_scan(info, ctx.device))
    return tuple(results)


def _empty_scan(info: ValueInfo, device: torch.device) -> torch.Tensor:
    """No iteration ran: [0, *per-iteration shape] as the body declares it (1-D where unknown)."""
    dtype = ONNX_TO_TORCH.get(info.elem_type, torch.float32)
    dims = info.shape or []
    per_step = [d for d in dims if isinstance(d, int)] if all(isinstance(d, int) for d in dims) else []
    return torch.empty([0, *per_step], dtype=dtype, device=device)


def _scan_run(
    ctx: NodeContext, states: list[Any], inputs: list[torch.Tensor], n_out: int
) -> tuple[list[Any], list[torch.Tensor]]:
    """Run the Scan body along the (already moved, already directed) axis 0 of ``inputs``."""
    in_axes = ctx.attr("scan_input_axes") or [0] * len(inputs)
    in_dirs = ctx.attr("scan_input_directions") or [0] * len(inputs)
    prepared = []
    for x, axis, direction in zip(inputs, in_axes, in_dirs):
        x = x.movedim(axis if axis >= 0 else axis + x.dim(), 0)
        prepared.append(x.flip(0) if direction else x)
    steps = prepared[0].shape[0] if prepared else 0
    collected: list[list[torch.Tensor]] = [[] for _ in range(n_out)]
    for t in range(steps):
        outs = ctx.run_subgraph("body", [*states, *(x[t] for x in prepared)])
        states = list(outs[: len(states)])
        for bucket, value in zip(collected, outs[len(states) :]):
            bucket.append(value)
    out_axes = ctx.attr("scan_output_axes") or [0] * n_out
    out_dirs = ctx.attr("scan_output_directions") or [0] * n_out
    scans = []
    for bucket, axis, direction in zip(collected, out_axes, out_dirs):
        y = torch.stack(bucket, dim=0)
        if direction:
            y = y.flip(0)
        scans.append(y.movedim(0, axis if axis >= 0 else axis + y.dim()).contiguous())
    return states, scans


@implements("Scan", since=9, capture=HOST_FLOW)
def scan(ctx: NodeContext, *values: Any) -> tuple:
    m = ctx.require("num_scan_inputs")
    n_state = len(values) - m
    states, scans = _scan_run(ctx, list(values[:n_state]), list(values[n_state:]), ctx.num_outputs - n_state)
    return (*states, *scans)


@implements("Scan", since=8, capture=HOST_FLOW)
def scan_v8(ctx: NodeContext, sequence_lens: torch.Tensor | None, *values: Any) -> tuple:
    """Opset 8: axis 0 is the batch, axis 1 the scan axis; each batch row runs on its own."""
    m = ctx.require("num_scan_inputs")
    n_state = len(values) - m
    n_out = ctx.num_outputs - n_state
    batch = values[0].shape[0] if values else 0
    lens = ints(sequence_lens) if sequence_lens is not None else None
    directions = ctx.attr("directions") or [0] * m
    per_state: list[list[torch.Tensor]] = [[] for _ in range(n_state)]
    per_scan: list[list[torch.Tensor]] = [[] for _ in range(n_out)]
    for b in range(batch):
        states = [v[b] for v in values[:n_state]]
        inputs = []
        for x, direction in zip(values[n_state:], directions):
            row = x[b]
            if lens is not None:
                row = row[: lens[b]]
            inputs.append(row.flip(0) if direction else row)
        sub = _V8View(ctx)
        states, scans = _scan_run(sub, states, inputs, n_out)
        for bucket, s in zip(per_state, states):
            bucket.append(s)
        for bucket, s in zip(per_scan, scans):
            bucket.append(s)
    return (*(torch.stack(b) for b in per_state), *(torch.stack(b) for b in per_scan))


class _V8View:
    """The opset-8 node seen through the opset-9 helper: no axis/direction attributes."""

    def __init__(self, ctx: NodeContext):
        self._ctx = ctx

    def attr(self, name: str, default: Any = None) -> Any:
        return default

    def run_subgraph(self, attr_name: str, inputs: list[Any]) -> list[Any]:
        return self._ctx.run_subgraph(attr_name, inputs)
