"""bench/peers_decode.py end to end on the CPU with a tiny config: every engine gets a measured row."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ["onnxgen", "onnxgen-eager", "ort-genai", "ort-genai-own", "onnxgen-on-genai", "hf-eager"]


@pytest.mark.slow
@pytest.mark.parametrize("tiny,precision", [("tiny-llama", "int4"), ("tiny-qwen2", "fp32")])
def test_peers_decode_tiny_cpu(tiny: str, precision: str) -> None:
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("transformers")
    command = [sys.executable, "-m", "bench.peers_decode", "--device", "cpu", "--tiny", tiny]
    command += ["--precision", precision, "--new-tokens", "32", "--repeats", "2", "--engines", ",".join(ENGINES)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("| ")}
    for engine in ENGINES:
        cells = [c.strip() for c in rows[engine].split("|")[2:5]]  # tok/s, ms/token, TTFT ms
        assert all(float(c) > 0 for c in cells), rows[engine]
    assert "command: python -m bench.peers_decode --device cpu" in done.stdout and "versions: torch" in done.stdout
    assert "against onnxruntime-genai's best form here (ort-genai" in done.stdout, done.stdout
    if precision == "fp32":  # the same fp32 weights everywhere: greedy ids agree token for token
        for engine in ENGINES[1:]:
            assert f"tokens: {engine} = onnxgen over all 32 greedy tokens" in done.stdout, done.stdout


def test_pool_lines_group_segments_by_pool_largest_first() -> None:
    from bench.peers_decode import pool_lines

    mb = 1_000_000
    segments = [
        {"segment_pool_id": (0, 0), "total_size": 20 * mb, "allocated_size": 2 * mb},
        {"segment_pool_id": (1, 5), "total_size": 30 * mb, "allocated_size": 30 * mb},
        {"segment_pool_id": (0, 0), "total_size": 2 * mb, "allocated_size": 0},
        {"segment_pool_id": (1, 5), "total_size": 10 * mb, "allocated_size": 1 * mb},
    ]
    assert pool_lines(segments) == [
        "recording pool (1, 5): 40.0 MB reserved, 31.0 MB live, 2 segment(s), largest 30.0, 10.0 MB",
        "default pool: 22.0 MB reserved, 2.0 MB live, 2 segment(s), largest 20.0, 2.0 MB",
    ]
