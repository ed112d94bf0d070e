"""Variants of a built package that share its weight files (hard links, copies where links fail)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import onnx


def link_package_files(package: Path, out: Path, skip: set[str]) -> None:
    """Hard-link every file of `package` into `out` except the names in `skip`."""
    out.mkdir(parents=True, exist_ok=True)
    for item in package.iterdir():
        if item.name in skip or not item.is_file():
            continue
        try:
            os.link(item, out / item.name)
        except OSError:
            shutil.copy2(item, out / item.name)


def with_accuracy_level(package: Path, out: Path, level: int) -> Path:
    """A copy of `package` whose MatMulNBits nodes use another accuracy_level (weights linked)."""
    model = onnx.load(package / "model.onnx", load_external_data=False)
    for node in model.graph.node:
        for attr in node.attribute:
            if node.op_type == "MatMulNBits" and attr.name == "accuracy_level":
                attr.i = level
    link_package_files(package, out, skip={"model.onnx"})
    onnx.save(model, out / "model.onnx")
    return out
