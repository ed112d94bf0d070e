"""From a model name (or a GGUF / Hugging Face directory) to a runnable package in the cache.

A package is built in a hidden sibling directory and renamed into place only when complete, so
an interrupted build never leaves a half package that later looks cached.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from onnxgen.errors import ModelLoadError
from onnxgen.models import fetch
from onnxgen.models.registry import MODELS, lookup
from onnxgen.progress import Progress

PACKAGE_FILES = ("model.onnx", "genai_config.json", "tokenizer.json", "tokenizer_config.json")


def default_precision(device: str) -> str:
    return "fp16" if device == "cuda" else "int4"


def is_complete_package(path: Path) -> bool:
    return all((path / name).is_file() for name in PACKAGE_FILES)


def _build_progress(label: str):
    state: dict[str, Progress] = {}

    def report(what: str, done: int, total: int) -> None:
        bar = state.get("bar")
        if bar is None:
            bar = state["bar"] = Progress(label, total, unit="tensors")
        bar.update(done - bar.done)
        if done >= total:
            bar.close()

    return report


def _build_into(source_path: Path, out: Path, precision: str, device: str, attention: str, name: str = "") -> None:
    """Write a complete package for a GGUF file or a Hugging Face directory into `out`."""
    from onnxgen.models.builder import build_package

    if source_path.is_dir():
        from onnxgen.models.hf_source import HFSource
        from onnxgen.models.tokenizer_build import copy_hf_tokenizer

        source = HFSource(source_path)
        build_package(
            source,
            out,
            precision=precision,
            device=device,
            attention=attention,
            progress=_build_progress(f"build {precision}/{device}/{attention}"),
        )
        copy_hf_tokenizer(source_path, out)
        return
    if not source_path.is_file():
        raise ModelLoadError(f"{source_path} is neither a GGUF file nor a Hugging Face model directory")
    from onnxgen.models.gguf_source import GGUFWeightSource
    from onnxgen.models.tokenizer_build import write_tokenizer_files

    source = GGUFWeightSource(source_path, name=name)
    try:
        build_package(
            source,
            out,
            precision=precision,
            device=device,
            attention=attention,
            progress=_build_progress(f"build {precision}/{device}/{attention}"),
        )
        write_tokenizer_files(source.gguf, out)
    finally:
        source.close()


def _atomic_build(target: Path, build) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".building-{target.name}-", dir=target.parent))
    try:
        build(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def ensure_package(
    name: str,
    *,
    precision: str | None = None,
    device: str = "cpu",
    attention: str = "gqa",
    force: bool = False,
) -> Path:
    """The package directory for a registry model, pulled and built on first use."""
    entry = lookup(name)  # unknown names fail here, listing the known ones
    precision = precision or default_precision(device)
    target = fetch.package_dir(entry.name, precision, device, attention)
    if not force and is_complete_package(target):
        return target
    gguf = fetch.pull(entry.name, force=force)
    return _atomic_build(target, lambda out: _build_into(gguf, out, precision, device, attention, entry.display_name))


def build_from_source(source: Path, output: Path, *, precision: str, device: str, attention: str) -> Path:
    """`onnxgen build`: a package from a GGUF file or a Hugging Face directory, written to `output`."""
    if output.exists() and any(output.iterdir()):
        raise ModelLoadError(f"output directory {output} exists and is not empty; choose a new one")
    return _atomic_build(output, lambda out: _build_into(source, out, precision, device, attention))


def cached_package(name: str) -> Path | None:
    """Some complete cached package of a registry model (for `show NAME`), preferring the defaults."""
    entry = lookup(name)
    preferred = fetch.package_dir(entry.name, default_precision("cpu"), "cpu", "gqa")
    if is_complete_package(preferred):
        return preferred
    root = fetch.models_home() / "packages"
    for path in sorted(root.glob(f"{entry.name}-*")) if root.is_dir() else []:
        if is_complete_package(path):
            return path
    return None


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def list_models() -> str:
    home = fetch.models_home()
    lines = [f"models home: {home}", "", "pullable models:"]
    for entry in MODELS.values():
        gguf = fetch.cached_gguf(entry)
        state = "GGUF cached" if gguf else "not pulled"
        lines.append(f"  {entry.name:<30} {entry.display_name} ({entry.architecture}, {entry.quantization}) [{state}]")
    lines += ["", "cached packages:"]
    root = home / "packages"
    packages = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []
    if not packages:
        lines.append("  (none)")
    for path in packages:
        note = "" if is_complete_package(path) else "  (incomplete)"
        lines.append(f"  {path.name:<48} {_dir_size(path) / 2**20:8.1f} MiB  {path}{note}")
    return "\n".join(lines)
