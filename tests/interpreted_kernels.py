"""Running a test file's Triton kernel cases on the CPU, through Triton's interpreter.

The interpreter must be on before triton defines a kernel, so a file's parity cases run in a
child pytest process with TRITON_INTERPRET=1 (tests/interpreted_runs.py: ``interpreted_file``); in
the parent they skip, and on CUDA they run directly (the gpu mark). KERNEL_DEVICES parametrizes such
cases.
"""

from __future__ import annotations

import pytest
import torch

from onnxgen.runtime.gpu.launch import interpreting

HAS_CUDA = torch.cuda.is_available()
# where the kernels can run in this process: the interpreter (the child run) or CUDA
KERNEL_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not interpreting(), reason="the child run interprets these")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]),
]


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


class LaunchSpy:
    """Stands in for a Triton kernel: records each launch's keyword arguments, then launches it."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch
