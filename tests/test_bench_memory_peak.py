"""bench/memory_peak.py's replay of torch's allocator trace, on a trace written out by hand (the
GPU run itself is the bench's; CI has no CUDA allocator to record)."""

from __future__ import annotations

from bench.memory_peak import main, replay, report, site_of

SITE_PACKAGES = "/usr/lib/python3.12/site-packages"
OP = {"filename": f"{SITE_PACKAGES}/onnxgen/runtime/ops/matmul.py", "line": 10, "name": "matmul"}
ENGINE = {"filename": "/work/repo/onnxgen/genai/engine.py", "line": 5, "name": "prefill"}
TORCH = {"filename": f"{SITE_PACKAGES}/torch/nn/functional.py", "line": 2, "name": "linear"}
BENCH = {"filename": "/work/repo/bench/prefill.py", "line": 7, "name": "main"}


def test_a_block_is_put_on_its_innermost_onnxgen_line() -> None:
    assert site_of([TORCH, OP, ENGINE]) == "onnxgen/runtime/ops/matmul.py:10 matmul"
    assert site_of([TORCH, BENCH]) == "/work/repo/bench/prefill.py:7 main"
    assert site_of([TORCH]) == site_of([]) == "(no Python frame)"


def test_the_peak_holds_the_blocks_alive_when_the_reserved_bytes_were_highest() -> None:
    """Reserved bytes: 100 before, 1,100, then 3,100 (the peak), then 2,100. The block freed (requested)
    before the second segment is not at the peak though its free completes after it; a free of a block
    from before the trace changes nothing."""
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 1000},
        {"action": "alloc", "addr": 1, "size": 600, "frames": [TORCH, OP]},
        {"action": "alloc", "addr": 2, "size": 300, "frames": [ENGINE]},
        {"action": "free_requested", "addr": 1, "size": 600},
        {"action": "segment_alloc", "addr": 5000, "size": 2000},
        {"action": "alloc", "addr": 3, "size": 1500, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 600},
        {"action": "free_requested", "addr": 99, "size": 70},
        {"action": "segment_free", "addr": 0, "size": 1000},
        {"action": "alloc", "addr": 4, "size": 50, "frames": [OP]},
    ]
    peak = replay(trace, reserved_before=100)
    assert peak.reserved == 3100
    assert peak.live == 1800
    assert dict(peak.sites) == {"onnxgen/genai/engine.py:5 prefill": 300, "(no Python frame)": 1500}
    assert peak.live_high == 1850
    lines = report(peak, drop=4_000_000, reserved_end=2_100_000, top=1)
    assert lines[1].endswith("beyond torch at the end: 2 MB (CUDA context, kernels, graph executables, "
                             "library workspaces)")  # fmt: skip
    assert lines[-2].strip().endswith("(no Python frame)") and lines[-1].strip().endswith("(1 more sites)")


def test_a_trace_that_ends_on_a_new_segment_takes_the_blocks_then() -> None:
    trace = [
        {"action": "alloc", "addr": 1, "size": 10, "frames": [OP]},
        {"action": "segment_map", "addr": 0, "size": 500},
    ]
    peak = replay(trace, reserved_before=400)
    assert (peak.reserved, peak.live, dict(peak.sites)) == (900, 10, {"onnxgen/runtime/ops/matmul.py:10 matmul": 10})


def test_without_cuda_it_says_so() -> None:
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["--device", "cpu"]) == 2
