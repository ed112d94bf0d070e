"""pytest plugin (-p tests.triton_probe): print how often each fused Triton kernel ran, and which of
onnxgen's kernels were launched without launch.COMPILE_OPTIONS (interpreted runs only: the
interpreter sees every launch's keyword arguments, which it otherwise drops)."""

import json
from collections import Counter

# onnxgen kernels launched without every COMPILE_OPTIONS value, by module.qualname
UNPINNED: Counter[str] = Counter()
UNPINNED_KEY = "launched-without-compile-options"


def pytest_configure(config):
    from onnxgen.runtime.gpu.launch import COMPILE_OPTIONS, interpreting

    if not interpreting():
        return
    from triton.runtime import interpreter

    run = interpreter.InterpretedFunction.run

    def checked_run(self, *args, grid, warmup, **kwargs):
        module = getattr(self.fn, "__module__", "")
        if module.startswith("onnxgen.") and any(kwargs.get(k) != v for k, v in COMPILE_OPTIONS.items()):
            UNPINNED[f"{module}.{self.fn.__qualname__}"] += 1
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = checked_run


def pytest_sessionfinish(session, exitstatus):
    from onnxgen.runtime.gpu.launch import LAUNCHES

    # JSON, not a dict's repr: the parent reads it in a worker thread, and ast.literal_eval there can
    # race the main thread's ast.parse (CPython 3.11 shares the AST converter's recursion counter)
    print(f"\nTRITON-LAUNCHES {json.dumps({**LAUNCHES, UNPINNED_KEY: dict(UNPINNED)})}")
