"""`onnxgen show MODEL --capture`: the capture plan of the single-token decode step, explained."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import onnx

from onnxgen.errors import OnnxgenError
from onnxgen.runtime.capture.classifier import Classification, classify
from onnxgen.runtime.capture.planner import CapturePlan, plan_capture
from onnxgen.runtime.model_io import load_model
from onnxgen.runtime.shapes.infer import ShapeResult, _declared, infer_shapes

PINNED_WORDS = ("pinned", "*", "")


@dataclass
class Analysis:
    shapes: ShapeResult
    classification: Classification
    plan: CapturePlan
    baseline: CapturePlan  # every symbolic extent treated as varying (no classifier)


def parse_bind(text: str | None) -> dict[str, int | None]:
    """``NAME=VALUE,...``; VALUE an int, or ``pinned`` (fixed for the step, value not needed)."""
    out: dict[str, int | None] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not name:
            raise OnnxgenError(f"--bind item {item!r} has no name")
        if not sep or value.lower() in PINNED_WORDS:
            out[name] = None
            continue
        try:
            out[name] = int(value)
        except ValueError:
            raise OnnxgenError(f"--bind {name}: {value!r} is not an integer (or 'pinned')") from None
        if out[name] < 0:  # type: ignore[operator]
            raise OnnxgenError(f"--bind {name}: extents cannot be negative")
    return out


def decode_binding(model: onnx.ModelProto) -> dict[str, int | None]:
    """The single-token decode step: batch pinned, query length 1 (read from input_ids' dims)."""
    for vi in model.graph.input:
        kind, dims, _ = _declared(vi)
        if vi.name == "input_ids" and dims is not None and len(dims) == 2:
            out: dict[str, int | None] = {}
            if isinstance(dims[0], str):
                out[dims[0]] = None
            if isinstance(dims[1], str):
                out[dims[1]] = 1
            return out
    return {}


def analyse(
    model: onnx.ModelProto,
    bind: dict[str, int | None] | None = None,
    *,
    mode: str = "failsafe",
    decode_step: bool = True,
    quarantine: tuple[str, ...] = (),
) -> Analysis:
    binding = decode_binding(model) if decode_step else {}
    binding.update(bind or {})
    shapes = infer_shapes(model, binding)
    opsets = {("" if o.domain in ("", "ai.onnx") else o.domain): o.version for o in model.opset_import}
    cls = classify(shapes, mode=mode)
    plan = plan_capture(shapes, cls, opsets, quarantine=quarantine)
    baseline = plan_capture(shapes, classify(shapes, mode="all"), opsets, quarantine=quarantine)
    return Analysis(shapes, cls, plan, baseline)


def _text(analysis: Analysis, path: str) -> str:
    plan, cls = analysis.plan, analysis.classification
    counts = plan.counts()
    binding = ", ".join(f"{k}={'pinned' if v is None else v}" for k, v in analysis.shapes.binding.items())
    lines = [
        f"capture plan (single-token decode step) for {path}",
        f"binding: {binding}",
        f"classifier mode: {cls.mode}",
        f"growing symbols: {', '.join(sorted(cls.growing)) or '(none)'}",
        f"segments: {len(plan.segments)} (without the classifier: {len(analysis.baseline.segments)})",
        f"nodes: {counts['nodes']}, captured {counts['captured']}, folded on host {counts['folded']}, "
        f"host seams {counts['host_seams']}, eager seams {counts['eager_seams']}",
    ]
    for i, seg in enumerate(plan.segments):
        first, last = plan.nodes[seg[0]], plan.nodes[seg[-1]]
        lines.append(f"  segment {i}: {len(seg)} nodes, {first.name} .. {last.name}")
    lines.append("seams:")
    for n in plan.seams:
        lines.append(f"  [{n.kind}] {n.op_type} {n.name}: {n.reason}")
        for step in n.chain:
            lines.append(f"      <- {step}")
    return "\n".join(lines)


def capture_report(onnx_path: str | os.PathLike, bind: str | None, as_json: bool, device: str = "cpu") -> str:
    """The plan for the graph a session on ``device`` runs (CUDA sessions run the fused graph)."""
    from onnxgen.runtime.fusion import fuse_for_device, fusion_enabled, unmatched_rewrites

    stored, _ = load_model(onnx_path)
    model, fused = fuse_for_device(stored, device)
    analysis = analyse(model, parse_bind(bind))
    rewrites = dataclasses.asdict(fused)
    unmatched = unmatched_rewrites(stored, device, fused) if fusion_enabled(device) else {}
    if as_json:
        data = analysis.plan.to_json()
        data["segments_without_classifier"] = len(analysis.baseline.segments)
        data["binding"] = analysis.shapes.binding
        data["device"], data["fusions"], data["rewrites_unmatched"] = device, rewrites, unmatched
        return json.dumps(data, indent=2)
    text = _text(analysis, str(onnx_path))
    done = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in rewrites.items() if n)
    header, _, rest = text.partition("\n")
    lines = [header, f"graph as a {device} session runs it: {'fused (' + done + ')' if done else 'as stored'}"]
    lines += [f"rewrite {name} matched nothing: it looks for {pattern}" for name, pattern in unmatched.items()]
    return "\n".join([*lines, rest])
