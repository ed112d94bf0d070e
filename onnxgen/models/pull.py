"""From a model name (or a GGUF / Hugging Face directory) to a runnable package in the cache.

A package is built in a hidden sibling directory and renamed into place only when complete
(publish.py), while the package's lock is held (cache_lock.py): an interrupted build never
leaves a half package that later looks cached, and several processes asking for the same
package build it once, the others wait and use it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from onnxgen.errors import ModelFetchError, ModelLoadError
from onnxgen.models import cache_lock, fetch
from onnxgen.models.builder_parts import BuildError
from onnxgen.models.package_files import built_at, float_zero_point_weights, foreign_entries, package_problem
from onnxgen.models.publish import build_directory
from onnxgen.models.registry import MODELS, lookup
from onnxgen.progress import Progress


def default_precision(device: str) -> str:
    return "fp16" if device == "cuda" else "int4"


def is_complete_package(path: Path) -> bool:
    """Every file the package refers to is there (package_files.package_problem)."""
    return path.is_dir() and package_problem(path) is None


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


def _build_into(
    source_path: Path,
    out: Path,
    precision: str,
    device: str,
    attention: str,
    name: str = "",
    int4_zero_points: str = "exact",
) -> None:
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
            int4_zero_points=int4_zero_points,
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
            int4_zero_points=int4_zero_points,
        )
        write_tokenizer_files(source.gguf, out)
    finally:
        source.close()


def pull_command(name: str, precision: str, device: str, attention: str) -> str:
    """The `onnxgen pull ... --force` line that rebuilds this package."""
    flags = "" if device == "cpu" else f" --device {device}"
    flags += "" if precision == default_precision(device) else f" --precision {precision}"
    flags += "" if attention == "gqa" else f" --attention {attention}"
    return f"onnxgen pull {name}{flags} --force"


def ensure_package(
    name: str,
    *,
    precision: str | None = None,
    device: str = "cpu",
    attention: str = "gqa",
    force: bool = False,
) -> Path:
    """The package directory for a registry model, pulled and built on first use.

    A cached package that is incomplete (a file it names is missing or short) is an error that
    says how to rebuild it; it is not silently used or replaced.
    """
    entry = lookup(name)  # unknown names fail here, listing the known ones
    precision = precision or default_precision(device)
    target = fetch.package_dir(entry.name, precision, device, attention)
    asked_at = time.time()
    if not force and is_complete_package(target):
        cache_lock.clean_if_idle(target)
        cache_lock.clean_if_idle(fetch.gguf_path(entry.name))
        return target
    fetch.ensure_directory(target.parent)
    with cache_lock.held(target, f"the package {target}", ModelFetchError):
        cache_lock.remove_leftovers(target)
        if target.exists():
            problem = package_problem(target) if target.is_dir() else "it is not a directory"
            if problem is None and not force:
                return target  # built by another process while this one waited
            if problem is None and (built_at(target) or 0) >= asked_at:
                print(f"onnxgen: {target.name} was rebuilt by another onnxgen process while this one waited; "
                      "using that build", file=sys.stderr, flush=True)  # fmt: skip
                return target
            if problem is not None and not force:
                raise ModelLoadError(
                    f"cached package {target} is incomplete: {problem}; "
                    f"run `{pull_command(entry.name, precision, device, attention)}` to rebuild it"
                )
        gguf = fetch.pull(entry.name, force=force, not_before=asked_at if force else None)
        return build_directory(
            target,
            lambda out: _build_into(gguf, out, precision, device, attention, entry.display_name),
            source=str(gguf),
            foreign=None,  # the cache's own entry
            error=ModelFetchError,
        )


def build_from_source(
    source: Path, output: Path, *, precision: str, device: str, attention: str, int4_zero_points: str = "exact"
) -> Path:
    """`onnxgen build`: a package from a GGUF file or a Hugging Face directory, published at `output`.

    Refused before anything is built when `output` is a file, the current directory (or holds
    it), or a directory holding files that are not a package onnxgen built; a package onnxgen
    built there before is replaced.
    """
    target = _output_target(output)
    if not source.exists():
        raise ModelLoadError(f"{source} does not exist; expected a GGUF file or a Hugging Face model directory")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BuildError(f"cannot create {target.parent} for -o {output}: {e.strerror}") from None
    with cache_lock.held(target, str(target), BuildError):
        cache_lock.remove_leftovers(target)
        _refuse_output(output, target)
        build_directory(
            target,
            lambda out: _build_into(source, out, precision, device, attention, int4_zero_points=int4_zero_points),
            source=str(source),
            foreign=_foreign,
            error=BuildError,
        )
    if precision == "int4":
        _say_float_zero_points(target)
    return output


def _say_float_zero_points(package: Path) -> None:
    """One line where the package keeps 4-bit blocks exactly with float zero points: onnxgen runs
    that form at the speed of the other, onnxruntime's CPU MatMulNBits does not."""
    from onnxgen.models.builder import MODEL_FILE

    floats, total = float_zero_point_weights(package / MODEL_FILE)
    if floats:
        print(
            f"onnxgen: note: {floats} of {total} MatMulNBits weights keep the source's 4-bit blocks exactly, with "
            "float zero points; onnxruntime's CPU MatMulNBits runs that form far more slowly than 4-bit zero "
            "points (README, CPU); --int4-zero-points packed writes those instead, rounding each block again",
            file=sys.stderr,
            flush=True,
        )


def _output_target(output: Path) -> Path:
    target = output.resolve()  # a symlink names where the package goes
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        raise BuildError(
            f"-o {output} is the current directory{'' if target == cwd else ' or holds it'}; onnxgen build "
            "publishes the package as a new directory of its own, so name one, e.g. -o ./my-package"
        )
    return target


def _refuse_output(output: Path, target: Path) -> None:
    if target.exists() and not target.is_dir():
        raise BuildError(f"-o {output}: {target} exists and is a file; -o names the package directory to create")
    if target.is_dir():
        names = _foreign(target)
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise BuildError(
                f"output directory {output} exists and holds files not written by onnxgen ({shown}); "
                "choose a new directory or empty this one"
            )


def _foreign(path: Path) -> list[str]:
    return foreign_entries(path) if path.is_dir() else [path.name]


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


def _rebuild_hint(folder: str) -> str:
    """How to rebuild the cached package in `folder` (NAME-PRECISION-DEVICE-ATTENTION)."""
    fields = folder.rsplit("-", 3)
    if len(fields) == 4 and fields[0] in MODELS:
        return f"rebuild with `{pull_command(*fields)}`"
    return "delete it or rebuild it with `onnxgen pull NAME --force`"


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def list_models() -> str:
    home = fetch.models_home()
    lines = [f"models home: {home}", "", "pullable models:"]
    for entry in MODELS.values():
        gguf = fetch.cached_gguf(entry, verify=False)  # list stays fast; the hash is checked on use
        state = "GGUF cached" if gguf else "not pulled"
        lines.append(f"  {entry.name:<30} {entry.display_name} ({entry.architecture}, {entry.quantization}) [{state}]")
    lines += ["", "cached packages:"]
    root = home / "packages"
    packages = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []
    if not packages:
        lines.append("  (none)")
    for path in packages:
        problem = package_problem(path)
        note = f"  (incomplete: {problem}; {_rebuild_hint(path.name)})" if problem else ""
        lines.append(f"  {path.name:<48} {_dir_size(path) / 2**20:8.1f} MiB  {path}{note}")
    return "\n".join(lines)
