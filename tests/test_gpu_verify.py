"""`onnxgen verify` on CUDA (issue 22): captured decode steps against eager ones, and fp16 against fp32.

GPU only (`pytest -m gpu`). Captured and eager steps must give the same logits bit for bit (the
capture contract), so teacher forcing through both shows top-1 agreement 1 and a KL divergence of
exactly 0 at every position, on SmolLM2's real weights and on the Qwen2.5-0.5B shape. The fp16
captured path against the fp32 reference on the GPU must part only at near-ties.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from onnxgen.genai.verify import VerifySpec, run_verify
from tests.conftest import HAS_CUDA
from tests.test_gpu_capture_models import qwen_shape_packages, smollm2_package  # noqa: F401 - the shared fixture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]

TOKENS = 128


@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_smollm2_captured_steps_equal_eager(precision: str) -> None:
    package = smollm2_package(precision, "gqa")
    report = run_verify(VerifySpec(package, reference="eager", device="cuda", capture="on", tokens=TOKENS))
    print("\n" + report.table())
    assert report.agreement.top1_agreement == 1.0 and report.agreement.kl_max == 0.0, report.table()
    assert report.passed


@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_qwen_shape_captured_steps_equal_eager(qwen_shape_packages, precision: str) -> None:  # noqa: F811
    prompts = [[3, 141, 59, 26, 53, 5000, 120000], [9, 8, 7]]
    spec = VerifySpec(
        qwen_shape_packages[precision], reference="eager", device="cuda", capture="on", prompts=prompts,
        tokens=TOKENS, all_positions=True,
    )  # fmt: skip
    report = run_verify(spec)
    assert report.agreement.top1_agreement == 1.0 and report.agreement.kl_max == 0.0, report.table()


def test_smollm2_fp16_captured_against_fp32_on_the_gpu() -> None:
    """As a user runs it: the captured fp16 decode steps against the package's fp32 arithmetic."""
    package = smollm2_package("fp16", "gqa")
    result = subprocess.run(
        [sys.executable, "-m", "onnxgen", "verify", str(package), "--device", "cuda", "--capture", "on", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    data = json.loads(result.stdout)
    print(json.dumps({k: data[k] for k in ("top1_agreement", "kl_divergence_mean", "near_ties")}))
    assert result.returncode == 0 and data["real_disagreements"] == 0, data["failures"]
