"""`onnxgen ARGS` through ``onnxgen.cli.main`` in the test process, for the commands whose child
process would spend most of its time importing torch: those that fail on their arguments before
loading a model, and those that only read a package (`show`, `list`). Commands that load a model to
generate keep to a child process (tests/test_cli.py's ``onnxgen``): their thread settings would stay
in this process."""

from __future__ import annotations

import io
import subprocess
from contextlib import redirect_stderr, redirect_stdout


def onnxgen_in_process(*args: str) -> subprocess.CompletedProcess:
    """The exit status, stdout and stderr of ``onnxgen ARGS`` as a child process would give them;
    an exception that escapes main() fails the test as a traceback on stderr would."""
    from onnxgen.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 2
    return subprocess.CompletedProcess(["onnxgen", *args], code, out.getvalue(), err.getvalue())
