"""onnxgen's benchmark harnesses: scripts with arguments, run as modules from the repo root.

    python -m bench.capture_decode --help

Each module here is one harness (``bench/README.md`` lists them; ``bench/h200.sh`` runs the usual
ones on a GPU machine as named stages); ``random_package`` and ``genai_peer`` are their shared helpers.
Not part of the installed ``onnxgen`` package and not run by the tests (some tests import the helpers).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repo root: where ``python -m bench.X`` runs


def module_command(module: str) -> list[str]:
    """The argv that runs bench module ``module`` (its ``__name__``) in a fresh interpreter; run it with
    ``cwd=ROOT`` so ``bench`` and ``onnxgen`` import from this tree."""
    return [sys.executable, "-m", module]


def reproduce_line(module: str) -> str:
    """``python -m bench.X ARGS...``: the command that reran this process, for a script's report."""
    return shlex.join(["python", "-m", module, *sys.argv[1:]])
