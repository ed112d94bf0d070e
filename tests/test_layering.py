"""The layers of docs/design.md hold: checked statically over every .py file under onnxgen/.

Rules (each violation is reported as file:line, the rule, and what was found):
  a. ``onnxgen.runtime`` (every subpackage) imports nothing from ``onnxgen.genai``, ``onnxgen.models``,
     ``onnxgen.cli``, ``onnxgen.server`` or ``onnxgen.show``: module-level, function-local and relative
     imports and ``importlib.import_module("...")`` with a literal name all count. ``onnxgen.options``
     sits below the runtime and imports only ``onnxgen.errors``.
  b. The environment (``os.environ``, ``os.getenv``, ``os.putenv``, ``os.unsetenv``, ``os.environb``,
     however ``os`` or those names were imported) is touched only in ENV_FILES: the switches are read
     once, in onnxgen/options.py.
  c. ``onnxgen.genai`` reaches the runtime through its API only: it imports no ``onnxgen.runtime.ops``
     or ``onnxgen.runtime.gpu`` module and calls no private (``_name``) attribute of a session.
     GENAI_ALLOWED lists today's exceptions; each entry must still occur, so the list is emptied as
     they are fixed.
  d. Inside the runtime, imports go one way: the ONNX op implementations (``runtime.ops``) see the
     executor only through ``runtime.node_contract`` and import neither the executor, the session nor
     the capture runtime; the GPU kernels (``runtime.gpu``) import no op implementation; the
     contract itself imports nothing of the runtime.
  e. The HTTP server sits on the genai layer: ``onnxgen.server`` imports no ``onnxgen.runtime`` module,
     and nothing below it (``onnxgen.genai``, ``onnxgen.models``) imports ``onnxgen.server``.
The checks parse the source (nothing is imported), so a file that fails to import is checked too.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "onnxgen"

# rule d: (importing package, packages it may not import, why)
INTERNAL_RULES = (
    (
        "onnxgen.runtime.ops",
        ("onnxgen.runtime.executor", "onnxgen.runtime.session", "onnxgen.runtime.capture"),
        "op implementations see the executor only through runtime.node_contract",
    ),
    (
        "onnxgen.runtime.gpu",
        ("onnxgen.runtime.ops", "onnxgen.runtime.executor", "onnxgen.runtime.session"),
        "GPU kernels sit below the op implementations",
    ),
    ("onnxgen.runtime.node_contract", ("onnxgen.runtime",), "the contract sits below both sides"),
)
RUNTIME_FORBIDDEN = ("onnxgen.genai", "onnxgen.models", "onnxgen.cli", "onnxgen.server", "onnxgen.show")
OPTIONS_ALLOWED = ("onnxgen.errors",)
# the files that may touch the process environment, and why
ENV_FILES = {
    "onnxgen/options.py": "the switches, read once",
    "onnxgen/threads.py": "libgomp reads OMP_* when torch loads: set before import torch",
    "onnxgen/models/fetch.py": "ONNXGEN_HOME, looked up at each pull",
}
ENV_NAMES = {"environ", "environb", "getenv", "putenv", "unsetenv"}

# rule c's exceptions as of issue 16: (file, what). Another branch moves the decode tail behind the
# Session API and gives the Generator a public feed check; remove each entry as its use goes away
# (test_genai_allow_list_is_still_needed fails on an entry that no longer occurs).
GENAI_ALLOWED: set[tuple[str, str]] = set()  # emptied by the decode engine (issue 16)


@dataclass(frozen=True)
class Found:
    path: str  # relative to the repository root
    line: int
    rule: str
    what: str  # the module imported, or the expression used

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [rule {self.rule}] {self.what}"


@functools.cache
def _sources() -> tuple[tuple[str, str, ast.Module], ...]:
    """(repository-relative path, dotted module name, tree) of every .py file under onnxgen/."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT)
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found.append((rel.as_posix(), ".".join(parts), ast.parse(path.read_text(), filename=str(rel))))
    return tuple(found)


def _package_of(module: str, rel: str) -> str:
    return module if rel.endswith("__init__.py") else module.rpartition(".")[0]


def _is_module(name: str) -> bool:
    """``name`` is a module or package of this repository (so ``from A import B`` imported A.B)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(rel: str, module: str, tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, dotted module) of everything the file imports, anywhere in it: ``from A import B``
    yields A.B where that is a module of the repository, else A; relative imports are resolved
    against the file; ``import_module``/``__import__`` calls with a literal (prefix of a) name count."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(module, rel).split(".")
                anchor = ".".join(package[: len(package) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            names = {f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names}
            for name in sorted(names):
                yield node.lineno, name
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            arg = node.args[0]
            if name in ("import_module", "__import__"):
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield node.lineno, arg.value
                elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
                    yield node.lineno, str(arg.values[0].value).rstrip(".")  # the literal prefix


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def internal_crossing(module: str, name: str) -> str | None:
    """Rule d: why ``module`` may not import ``name``, or None."""
    for inner, forbidden, why in INTERNAL_RULES:
        if _within(module, (inner,)) and _within(name, forbidden):
            return why
    return None


def runtime_violations() -> list[Found]:
    found = []
    for rel, module, tree in _sources():
        for line, name in imports(rel, module, tree):
            if _within(module, ("onnxgen.runtime",)) and _within(name, RUNTIME_FORBIDDEN):
                found.append(Found(rel, line, "a", f"{module} imports {name}"))
            why = internal_crossing(module, name)
            if why:
                found.append(Found(rel, line, "d", f"{module} imports {name} ({why})"))
            if module == "onnxgen.options" and _within(name, ("onnxgen",)) and name != "onnxgen":
                if not _within(name, OPTIONS_ALLOWED):
                    found.append(Found(rel, line, "a", f"{module} imports {name} (options sits below the runtime)"))
    return found


SERVER_BELOW = ("onnxgen.genai", "onnxgen.models")


def server_violations() -> list[Found]:
    """Rule e."""
    found = []
    for rel, module, tree in _sources():
        for line, name in imports(rel, module, tree):
            if _within(module, ("onnxgen.server",)) and _within(name, ("onnxgen.runtime",)):
                found.append(Found(rel, line, "e", f"{module} imports {name} (the server sits on the genai layer)"))
            if _within(module, SERVER_BELOW) and _within(name, ("onnxgen.server",)):
                found.append(Found(rel, line, "e", f"{module} imports {name} (the server sits above it)"))
    return found


def environment_uses(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, expression) of each touch of the process environment."""
    os_names = {"os"}
    env_names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_names |= {a.asname or a.name for a in node.names if a.name in ("os", "posix")}
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "posix"):
            for alias in node.names:
                if alias.name in ENV_NAMES:
                    env_names.add(alias.asname or alias.name)
                    yield node.lineno, f"from {node.module} import {alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENV_NAMES:
            if isinstance(node.value, ast.Name) and node.value.id in os_names:
                yield node.lineno, f"{node.value.id}.{node.attr}"
        elif isinstance(node, ast.Name) and node.id in env_names and isinstance(node.ctx, ast.Load):
            yield node.lineno, node.id


def environment_violations() -> list[Found]:
    found = []
    for rel, _, tree in _sources():
        if rel not in ENV_FILES:
            found += [
                Found(rel, line, "b", f"{what} outside {', '.join(ENV_FILES)}") for line, what in environment_uses(tree)
            ]
    return found


def _private_session_calls(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, "session._name") of each private attribute read off something called ``session``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else ""
            if name == "session":
                yield node.lineno, f"session.{node.attr}"


GPU_AND_OPS = ("onnxgen.runtime.ops", "onnxgen.runtime.gpu")


def genai_uses() -> list[tuple[Found, bool]]:
    """Rule c's findings, each with whether GENAI_ALLOWED excuses it."""
    found = []
    for rel, module, tree in _sources():
        if not _within(module, ("onnxgen.genai",)):
            continue
        kernels = {(line, name) for line, name in imports(rel, module, tree) if _within(name, GPU_AND_OPS)}
        # "from onnxgen.runtime.ops.m import f" yields the module and m.f: report the module
        modules = {(line, name) for line, name in kernels if not any(n == name.rpartition(".")[0] for _, n in kernels)}
        uses = sorted(modules) + sorted(_private_session_calls(tree))
        found += [(Found(rel, line, "c", what), (rel, what) in GENAI_ALLOWED) for line, what in uses]
    return found


def _report(found: list[Found]) -> str:
    return "layering violations (see tests/test_layering.py):\n" + "\n".join(f"  {f}" for f in found)


def test_runtime_imports_no_upper_layer() -> None:
    found = runtime_violations()
    assert not found, _report(found)


def test_the_server_sits_on_the_genai_layer() -> None:
    found = server_violations()
    assert not found, _report(found)


def test_environment_is_read_only_where_declared() -> None:
    found = environment_violations()
    assert not found, _report(found)


def test_genai_uses_the_runtime_api_only() -> None:
    found = [f for f, allowed in genai_uses() if not allowed]
    assert not found, _report(found)


def test_genai_allow_list_is_still_needed() -> None:
    """An entry whose use has gone is removed from GENAI_ALLOWED, so the list only shrinks."""
    used = {(f.path, f.what) for f, allowed in genai_uses() if allowed}
    stale = sorted(GENAI_ALLOWED - used)
    assert not stale, f"GENAI_ALLOWED entries that no longer occur (remove them): {stale}"


def test_the_checks_see_what_they_forbid() -> None:
    """Each detector on a snippet with the forbidden forms (a check that finds nothing proves nothing)."""
    source = (
        "import os as o\nfrom os import getenv as g\nfrom ...genai import generator\nfrom ..genai import x\n"
        "def f():\n    from onnxgen.models import fetch, pull\n    import importlib\n"
        "    importlib.import_module('onnxgen.cli')\n    return o.environ, g('X'), self.session._feeds\n"
    )
    tree = ast.parse(source)
    names = [name for _, name in imports("onnxgen/runtime/ops/x.py", "onnxgen.runtime.ops.x", tree)]
    # three dots from ops/x.py reach onnxgen, two onnxgen.runtime (no genai module there)
    assert sorted(names) == sorted(
        ["onnxgen.genai.generator", "onnxgen.runtime.genai", "onnxgen.models.fetch", "onnxgen.models.pull"]
        + ["os", "os", "importlib", "onnxgen.cli"]
    )
    assert {what for _, what in environment_uses(tree)} == {"from os import getenv", "o.environ", "g"}
    assert [what for _, what in _private_session_calls(tree)] == ["session._feeds"]
    assert internal_crossing("onnxgen.runtime.ops.control_flow", "onnxgen.runtime.executor")
    assert internal_crossing("onnxgen.runtime.gpu.linear_row", "onnxgen.runtime.ops.common")
    assert internal_crossing("onnxgen.runtime.node_contract", "onnxgen.runtime.dtypes")
    assert not internal_crossing("onnxgen.runtime.ops.control_flow", "onnxgen.runtime.node_contract")
    assert not internal_crossing("onnxgen.runtime.ops.fused", "onnxgen.runtime.gpu.linear_row")
