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


# relative to the reference's largest magnitude: fp32 rounding, one ulp of the half types. Triton's
# interpreter truncates fp32 -> bfloat16 (compiled kernels round to nearest even, as torch does), so
# there a bf16 value may be off by another ulp (a kernel that rounds twice: two)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
INTERPRETED_BF16_TOL = 2e-2


def assert_close_to_torch_path(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """A kernel's output against the torch path's: same dtype and shape, and the largest difference
    within TOL of the reference's largest magnitude."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.double().cpu(), expected.double().cpu()
    error = float((a - e).abs().max()) / max(float(e.abs().max()), 1e-6)
    interpreted_bf16 = expected.dtype == torch.bfloat16 and actual.device.type == "cpu"
    assert error < (INTERPRETED_BF16_TOL if interpreted_bf16 else TOL[expected.dtype]), error
