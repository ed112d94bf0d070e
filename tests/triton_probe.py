"""pytest plugin (-p tests.triton_probe): print how often each fused Triton kernel ran."""

import json


def pytest_sessionfinish(session, exitstatus):
    from onnxgen.runtime.gpu.launch import LAUNCHES

    # JSON, not a dict's repr: the parent reads it in a worker thread, and ast.literal_eval there can
    # race the main thread's ast.parse (CPython 3.11 shares the AST converter's recursion counter)
    print(f"\nTRITON-LAUNCHES {json.dumps(dict(LAUNCHES))}")
