"""Reading the files of a package: every name is confined to the package directory, text must be
UTF-8 and JSON must parse to an object, each failure a ModelLoadError naming the file.

The confinement rules are external data's (model_io.resolve_inside): no absolute paths, no '..',
no symlink that resolves outside. A package is often downloaded from elsewhere, so a name in it must
not make onnxgen read (or show the start of) a file outside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from onnxgen.errors import ModelLoadError
from onnxgen.runtime.model_io import resolve_inside

PLACE = "the package directory"


def package_file(directory: Path, name: str, what: str | None = None) -> Path:
    """``directory / name``, once checked to resolve inside ``directory``; it may not exist. The path
    stays as named (not resolved): a model file's external data is looked up beside the name the
    package gives, as onnxruntime does. ``what`` names where the name came from in messages."""
    resolve_inside(name, directory, what or "package file", PLACE)
    return directory / name


def read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"{path} could not be read: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file whose top level is an object."""
    try:
        value = json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: the top level is {describe(value)}; expected an object")
    return value


def describe(value: Any) -> str:
    """A JSON value as a message shows it: strings quoted, null/true/false as JSON spells them,
    containers by kind (their contents would flood the line)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return repr(value)
