"""`onnxgen show`: what a package or ONNX file holds, read from the graph and metadata alone."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnxgen.errors import ModelLoadError, OnnxgenError
from onnxgen.runtime.executor import value_info_of
from onnxgen.runtime.model_io import load_model
from onnxgen.runtime.ops.quant_forms import quantized_weight_paths


def _tensor_bytes(t: onnx.TensorProto) -> tuple[int, int]:
    count = int(np.prod(t.dims, dtype=np.int64)) if len(t.dims) else 1
    if t.data_location == onnx.TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        nbytes = int(info["length"]) if "length" in info else 0
    else:
        nbytes = len(t.raw_data) if t.raw_data else count * 4
    if not nbytes and t.data_type not in (onnx.TensorProto.STRING,):
        nbytes = count * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    return count, nbytes


def _model_path(target: str) -> tuple[Path, Path | None]:
    """(onnx file, package dir or None) for a directory, a file or a registry name."""
    path = Path(target).expanduser()
    if path.is_dir():
        return path / "model.onnx", path
    if path.is_file():
        return path, path.parent if (path.parent / "genai_config.json").is_file() else None
    from onnxgen.models.pull import cached_package
    from onnxgen.models.registry import known_names, looks_like_path

    if looks_like_path(target):
        raise ModelLoadError(
            f"no such file or directory: {target} (expected an .onnx file, a package directory or a registry "
            f"name: {', '.join(known_names())})"
        )
    cached = cached_package(target)
    if cached is None:
        raise ModelLoadError(f"{target!r} is neither a file, a package directory nor a pulled model")
    return cached / "model.onnx", cached


def model_summary(target: str, device: str = "cpu") -> dict[str, Any]:
    onnx_path, package = _model_path(target)
    model, _ = load_model(onnx_path)
    graph = model.graph
    params = 0
    nbytes = 0
    by_dtype: Counter[str] = Counter()
    for t in graph.initializer:
        count, size = _tensor_bytes(t)
        params += count
        nbytes += size
        by_dtype[onnx.TensorProto.DataType.Name(t.data_type).lower()] += size
    ops = Counter(f"{n.domain + '::' if n.domain else ''}{n.op_type}" for n in graph.node)
    summary: dict[str, Any] = {
        "file": str(onnx_path),
        "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "inputs": [{"name": v.name, "type": v.type_str, "shape": v.shape} for v in map(value_info_of, graph.input)],
        "outputs": [{"name": v.name, "type": v.type_str, "shape": v.shape} for v in map(value_info_of, graph.output)],
        "nodes": len(graph.node),
        "op_counts": dict(ops.most_common()),
        "initializer_elements": params,
        "initializer_bytes": nbytes,
        "bytes_by_dtype": dict(by_dtype),
    }
    quantized = quantized_weight_paths(model, device)
    if quantized:
        summary["quantized_weights"] = {"device": device, "forms": quantized}
    if package is not None and (package / "genai_config.json").is_file():
        config = json.loads((package / "genai_config.json").read_text())
        model_cfg = config.get("model", {})
        decoder = model_cfg.get("decoder", {})
        summary["architecture"] = {
            "type": model_cfg.get("type"),
            "context_length": model_cfg.get("context_length"),
            "vocab_size": model_cfg.get("vocab_size"),
            "layers": decoder.get("num_hidden_layers"),
            "hidden_size": decoder.get("hidden_size"),
            "heads": decoder.get("num_attention_heads"),
            "kv_heads": decoder.get("num_key_value_heads"),
            "head_size": decoder.get("head_size"),
            "past_present_share_buffer": config.get("search", {}).get("past_present_share_buffer"),
        }
    return summary


def _format(summary: dict[str, Any]) -> str:
    lines = [f"file: {summary['file']}"]
    if "architecture" in summary:
        lines.append("architecture:")
        lines += [f"  {k}: {v}" for k, v in summary["architecture"].items()]
    lines.append("opsets: " + ", ".join(f"{k} {v}" for k, v in summary["opsets"].items()))
    for kind in ("inputs", "outputs"):
        lines.append(f"{kind}:")
        lines += [f"  {v['name']}: {v['type']} {v['shape']}" for v in summary[kind]]
    lines.append(f"nodes: {summary['nodes']}")
    lines += [f"  {op}: {n}" for op, n in summary["op_counts"].items()]
    lines.append(
        f"parameters: {summary['initializer_elements']:,} elements, {summary['initializer_bytes'] / 2**20:.1f} MiB"
    )
    lines += [f"  {dtype}: {n / 2**20:.1f} MiB" for dtype, n in summary["bytes_by_dtype"].items()]
    if "quantized_weights" in summary:
        quantized = summary["quantized_weights"]
        lines.append(f"quantized weights on {quantized['device']} (kernel per form):")
        lines += [f"  {f['op']} {f['form']}: {f['nodes']} node(s) -> {f['path']}" for f in quantized["forms"]]
    return "\n".join(lines)


def model_symbols(model: onnx.ModelProto) -> list[str]:
    """The dim_param names the graph's inputs and outputs declare (what --bind can set)."""
    names = {
        d.dim_param
        for vi in (*model.graph.input, *model.graph.output)
        if vi.type.HasField("tensor_type")
        for d in vi.type.tensor_type.shape.dim
        if d.dim_param
    }
    return sorted(names)


def _check_bind_names(onnx_path: Path, bind: str) -> None:
    """A --bind name the graph does not declare would bind nothing (a typo): refuse it."""
    from onnxgen.runtime.capture.report import parse_bind

    wanted = parse_bind(bind)
    model, _ = load_model(onnx_path)
    symbols = model_symbols(model)
    unknown = [name for name in wanted if name not in symbols]
    if unknown:
        raise OnnxgenError(
            f"--bind names symbol(s) {unknown} that {onnx_path.name} does not have; its symbols are {symbols}"
        )


def _rewrite_lines(package: Path, onnx_path: Path) -> str:
    """What genai.engine_graph's rewrites make of this package's graph: whether a generation
    computes the prompt's logits for its last row only, and, for a package whose steps carry states
    (a hybrid decoder), whether its prompt chunks pad (the states stopping at the last real row);
    why not where a rewrite does not fit."""
    from onnxgen.genai.engine import engine_graph
    from onnxgen.genai.package import load_package_config

    model, _ = load_model(onnx_path)
    graph = engine_graph(model, load_package_config(package))
    if graph.logits_why_not is None:
        lines = ["prompt logits: computed for the last prompt row only (a RowSelect before the lm_head)"]
    else:
        lines = [f"prompt logits: computed for every prompt row ({graph.logits_why_not})"]
    if graph.carried and graph.states_why_not is None:
        lines.append(f"prompt chunks: padded, the {graph.carried} carried states stopping at the last real row "
                     "(option prefill_pieces)")  # fmt: skip
    elif graph.carried:
        lines.append(f"prompt chunks: unpadded pieces, one pass over the weights each ({graph.states_why_not})")
    return "\n".join(lines)


KV_KINDS = ("auto", "static", "dynamic")


def _kv_binding(package: Path, onnx_path: Path, device: str, kv: str, bind: str | None) -> tuple[str | None, str]:
    """(the --bind text with a static cache's extents pinned, a line saying which KV cache the plan
    is for). ``auto`` is what a Generator on ``device`` uses for this package; a static cache
    fixes the past KV's sequence axis and the mask's width (the buffer's capacity) for the step."""
    from onnxgen.genai.graph_layout import with_graph_layout
    from onnxgen.genai.package import load_package_config
    from onnxgen.genai.package_checks import default_kv_kind, growing_kv, kv_sequence_symbols
    from onnxgen.runtime.capture.report import parse_bind

    model, _ = load_model(onnx_path)
    config = with_graph_layout(load_package_config(package), model)
    past = next((v for v in model.graph.input if v.name == config.first_past_key_name), None)
    dims = past.type.tensor_type.shape.dim if past is not None else []
    fixed = len(dims) > 2 and dims[2].HasField("dim_value") and dims[2].dim_value > 0
    kind = default_kv_kind(config, device, fixed) if kv == "auto" else kv
    growing = growing_kv(config, list(model.graph.node)) if kind == "static" else None
    if growing and kv == "static":
        raise OnnxgenError(
            f"--kv static needs a decoder that writes its KV in place into a fixed buffer, but {growing}"
        )
    if growing:
        kind = "dynamic"
    how = f"what a {device} session uses for this package" if kv == "auto" else "--kv"
    other = "dynamic" if kind == "static" else "static"
    line = f"KV cache: {kind} ({how}; --kv {other} for the other plan)"
    if kind == "dynamic":
        return bind, line
    # the buffer of a generation's first static cache (DecodeEngine._static_capacity): larger ones
    # bind the same extents to another number, which leaves the plan as it is
    capacity = dims[2].dim_value if fixed else min(config.context_length, 256)
    given = parse_bind(bind)
    fixed_names = [name for name in kv_sequence_symbols(config, model) if name not in given]
    extra = ",".join(f"{name}={capacity}" for name in fixed_names)
    return ",".join(part for part in (bind, extra) if part) or None, f"{line}, capacity {capacity}"


def show_model(
    target: str,
    *,
    capture: bool = False,
    as_json: bool = False,
    bind: str | None = None,
    device: str = "cpu",
    kv: str = "auto",
) -> str:
    if kv not in KV_KINDS:
        raise OnnxgenError(f"--kv must be one of {', '.join(KV_KINDS)}, got {kv!r}")
    if capture:
        from onnxgen.runtime.capture.report import capture_report

        onnx_path, package = _model_path(target)
        if bind:
            _check_bind_names(onnx_path, bind)
        is_package = package is not None and (package / "genai_config.json").is_file()
        if not is_package:
            if kv != "auto":
                raise OnnxgenError("--kv picks the KV cache of a package's decode step; it needs a package directory")
            return capture_report(onnx_path, bind=bind, as_json=as_json, device=device)
        assert package is not None
        bind, kv_line = _kv_binding(package, onnx_path, device, kv, bind)
        report = capture_report(onnx_path, bind=bind, as_json=as_json, device=device)
        if as_json:
            data = json.loads(report)
            data["kv"] = kv_line.split()[2]
            return json.dumps(data, indent=2)
        header, _, rest = report.partition("\n")
        return f"{header}\n{kv_line}\n{rest.rstrip()}\n{_rewrite_lines(package, onnx_path)}\n"
    if bind:
        raise OnnxgenError("--bind sets symbols of the capture plan; it needs --capture")
    if kv != "auto":
        raise OnnxgenError("--kv picks the KV cache of the capture plan; it needs --capture")
    summary = model_summary(target, device)
    return json.dumps(summary, indent=2) if as_json else _format(summary)
