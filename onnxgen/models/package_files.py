"""What a package directory holds: the files its genai_config and model name, and onnxgen's marker.

A package is complete when every file it refers to is there: genai_config.json, the decoder
model it names, each external-data file the model's initializers point into (at least as long as
the furthest byte they read), and the tokenizer files. The marker `.onnxgen-package.json`, written
last into a package onnxgen built, lists the files of that build; a directory with the marker and
no other files is one onnxgen may replace on a rebuild.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

MARKER = ".onnxgen-package.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_marker(directory: Path, source: str) -> None:
    """Record the files now in `directory` (the finished build) and when it was built."""
    files = sorted(p.name for p in directory.iterdir() if p.name != MARKER)
    info = {"format": 1, "files": files, "source": source, "built_at": time.time()}
    path = directory / MARKER
    path.write_text(json.dumps(info, indent=1) + "\n")


def read_marker(directory: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and isinstance(info.get("files"), list) else None


def built_at(directory: Path) -> float | None:
    info = read_marker(directory)
    value = info.get("built_at") if info else None
    return float(value) if isinstance(value, int | float) else None


def foreign_entries(directory: Path) -> list[str]:
    """Names in `directory` that no onnxgen build put there (all of them when it has no marker)."""
    info = read_marker(directory)
    ours = set(info["files"]) | {MARKER} if info else set()
    return sorted(p.name for p in directory.iterdir() if p.name not in ours)


def package_problem(directory: Path) -> str | None:
    """Why `directory` is not a complete package (the first missing piece), or None when it is."""
    config_path = directory / "genai_config.json"
    if not config_path.is_file():
        return "genai_config.json is missing"
    try:
        decoder = json.loads(config_path.read_text())["model"]["decoder"]["filename"]
    except (OSError, ValueError, KeyError, TypeError):
        return "genai_config.json is unreadable or names no model.decoder.filename"
    model_path = directory / str(decoder)
    if not model_path.is_file():
        return f"{decoder} (named by genai_config.json) is missing"
    problem = _external_data_problem(model_path)
    if problem:
        return problem
    missing = [n for n in TOKENIZER_FILES if not (directory / n).is_file()]
    return f"{', '.join(missing)} missing" if missing else None


def _external_data_problem(model_path: Path) -> str | None:
    import onnx

    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as e:  # noqa: BLE001 (any parse failure means the same to the caller)
        return f"{model_path.name} is not a readable ONNX model ({type(e).__name__})"
    needed: dict[str, int] = {}
    for tensor in _all_initializers(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        end = int(info.get("offset") or 0) + int(info.get("length") or 0)
        needed[location] = max(needed.get(location, 0), end)
    for location, end in sorted(needed.items()):
        path = model_path.parent / location
        try:
            size = os.stat(path).st_size
        except OSError:
            return f"{location} (the weights {model_path.name} refers to) is missing"
        if size < end:
            return f"{location} is truncated ({size} bytes; {model_path.name} reads up to byte {end})"
    return None


def _all_initializers(graph):
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from _all_initializers(sub)


def float_zero_point_weights(model_path: Path) -> tuple[int, int]:
    """(MatMulNBits nodes whose zero points are floats, all MatMulNBits nodes) of a model, read
    without its external data. onnxruntime's CPU kernel takes a slow path for the float form,
    so a build that writes it says so (pull.build_from_source)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    dtypes = {t.name: t.data_type for t in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits" and n.domain == "com.microsoft"]
    floats = sum(1 for n in nodes if len(n.input) > 3 and dtypes.get(n.input[3], onnx.TensorProto.UINT8)
                 != onnx.TensorProto.UINT8)  # fmt: skip
    return floats, len(nodes)
