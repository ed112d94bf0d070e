"""Running a test file's Triton kernel cases on the CPU, through Triton's interpreter.

The interpreter must be on before triton defines a kernel, so a file's parity cases run in a
child pytest process with TRITON_INTERPRET=1 (``run_interpreted``); in the parent they skip, and on
CUDA they run directly (the gpu mark). KERNEL_DEVICES parametrizes such cases.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from onnxgen.runtime.gpu.launch import interpreting

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()
# where the kernels can run in this process: the interpreter (the child run) or CUDA
KERNEL_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreting(), reason="the child run interprets these")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]),
]


def run_interpreted(test_file: str, deselect: str) -> None:
    """Runs ``test_file``'s CPU cases (``-k "not DESELECT"``) in a child with the interpreter on; fails
    if any failed or any was skipped (a skipped case would be a parity case that never ran)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "ONNXGEN_TRITON": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", test_file]
    cmd += ["-k", f"not ({deselect})"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " skipped" not in done.stdout.splitlines()[-1], done.stdout[-3000:]
