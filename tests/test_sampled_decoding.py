"""Sampled decoding inside the captured step (genai/decode_tail.SampledTail) and its fused kernel.

- The oracle for the draw's distribution is the chi-square test of tests/test_sampling.py (softmax of
  transformers' processed logits); here the kernel (runtime/gpu/noisy_argmax.py) must pick what the
  torch path picks for the same state, draw after draw, with its bookkeeping (counts, counter,
  position, mask entry, host tokens), so the distribution carries over. On the CPU the kernel runs
  through Triton's interpreter (tests/test_triton_kernels.py starts that run); plain CPU runs skip it.
- A seeded generation gives the same tokens with the sampler in the graph (CPU stand-in recorder,
  verify mode comparing each replayed step and its tail state with an eager run), between the steps,
  and with capture off; it repeats exactly, and another seed gives other tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from onnxgen.genai.decode_tail import SampledTail, advance_position
from onnxgen.genai.generator import Generator
from onnxgen.genai.sampling import NON_FINITE, SamplerState, SamplingParams, SamplingPlan, draw_token
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource
from onnxgen.runtime.capture.recorder import ReplayRecorder
from onnxgen.runtime.gpu.launch import triton_serves
from tests.conftest import HAS_CUDA
from tests.test_capture_runtime import write_word_tokenizer

SETTINGS = {
    "temperature": SamplingParams(temperature=0.9, seed=11),
    "fused-penalties": SamplingParams(
        temperature=1.2, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, seed=5
    ),
    "truncated": SamplingParams(temperature=1.1, top_k=40, top_p=0.9, min_p=0.02, seed=3),
    "top-k-top-p": SamplingParams(temperature=1.5, top_k=50, top_p=0.8, min_p=0.01, repetition_penalty=1.2, seed=8),
    "top-k": SamplingParams(temperature=2.0, top_k=7, seed=1),
    "top-p": SamplingParams(temperature=2.5, top_p=0.5, frequency_penalty=0.3, seed=12),
    "top-p-min-p": SamplingParams(temperature=0.9, top_p=0.95, min_p=0.02, seed=13),
    "wide-top-k": SamplingParams(temperature=1.5, top_k=100, top_p=0.9, seed=6),  # past the kernel's: torch's cuts
    "min-p": SamplingParams(temperature=2.0, min_p=0.05, presence_penalty=0.5, seed=9),  # most mass cut
    "greedy-penalized": SamplingParams(repetition_penalty=1.5),
    "tiny-temperature": SamplingParams(temperature=1e-30, repetition_penalty=1e-5, seed=2),
}


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    config = TINY_CONFIGS["tiny-llama"]
    directory = build_package(RandomSource(config), tmp_path_factory.mktemp("sampled") / "gqa", attention="gqa")
    write_word_tokenizer(directory, config.vocab_size)
    return directory


def _params(params: SamplingParams, n: int = 24, **changes) -> SamplingParams:
    return dataclasses.replace(params, max_new_tokens=n, ignore_eos=True, **changes)


PROMPTS = ([3, 141, 59, 26], [7, 7, 7, 7, 7])


@pytest.mark.parametrize("name", list(SETTINGS))
def test_sampled_tokens_in_the_graph_equal_between_the_steps_and_eager(package, name: str) -> None:
    params = _params(SETTINGS[name])
    eager = Generator(package, kv="static", capture="off")
    want = [list(eager.generate_ids(p, params)) for p in PROMPTS]
    for pipeline in (True, False):
        graph = Generator(
            package, kv="static", capture="verify", recorder=ReplayRecorder(), verify_steps=100, pipeline=pipeline
        )
        between = Generator(package, kv="static", capture="on", recorder=ReplayRecorder(), sample_in_graph=False)
        assert [list(graph.generate_ids(p, params)) for p in PROMPTS] == want, (name, pipeline)
        assert [list(between.generate_ids(p, params)) for p in PROMPTS] == want, (name, pipeline)
        stats = graph.capture_stats
        assert stats.tail == "in the graph" and stats.verified_steps > 20 and stats.invalidations == 0
        assert between.capture_stats.tail == ""


def test_a_seeded_run_repeats_and_another_seed_differs(package) -> None:
    generator = Generator(package, kv="static", capture="on", recorder=ReplayRecorder())
    params = _params(SETTINGS["truncated"], n=32)
    first = list(generator.generate_ids(PROMPTS[0], params))
    captures = generator.capture_stats.captures
    assert list(generator.generate_ids(PROMPTS[0], params)) == first
    # a new generation with the same plan rebinds the tail's state: no new recording
    assert generator.capture_stats.captures == captures
    other = list(generator.generate_ids(PROMPTS[0], _params(SETTINGS["truncated"], n=32, seed=4)))
    assert other != first
    assert generator.capture_stats.captures == captures


def test_more_plans_than_tails_sample_between_the_steps_and_say_so(package) -> None:
    generator = Generator(package, kv="static", capture="on", recorder=ReplayRecorder())
    eager = Generator(package, kv="static", capture="off")
    generator.engine.sampled_tails_max = 1
    a, b = _params(SETTINGS["temperature"], n=8), _params(SETTINGS["truncated"], n=8)
    assert list(generator.generate_ids(PROMPTS[0], a)) == list(eager.generate_ids(PROMPTS[0], a))
    with pytest.warns(UserWarning, match="sample between the steps"):
        assert list(generator.generate_ids(PROMPTS[0], b)) == list(eager.generate_ids(PROMPTS[0], b))


# -- the fused kernel against the torch path ---------------------------------------------------------

VOCAB = 5000  # three of the kernel's 2,048-entry blocks


def _state(params: SamplingParams, device: str) -> tuple[SamplingPlan, dict[str, torch.Tensor]]:
    params = params.validate()
    plan = SamplingPlan.of(params, VOCAB)
    state = SamplerState.new(params, plan, VOCAB, params.seed or 0, torch.device(device)).tensors()
    state["counts"][torch.tensor([3, 17, 2100, 4999])] = torch.tensor([1.0, 2.0, 1.0, 3.0], device=device)
    return plan, state


def _torch_path(plan, state, row, advance):
    """draw_token with the fused kernels hidden, then the tail's torch bookkeeping (the CPU path)."""
    import onnxgen.genai.sampling as sampling

    out = torch.zeros((), dtype=torch.int64, device=row.device)
    real = sampling.device_kernels_available
    sampling.device_kernels_available = lambda t: False
    try:
        assert not draw_token(plan, state, row, VOCAB, out, count=True, advance=advance)
        advance_position(advance[0], advance[1])
    finally:
        sampling.device_kernels_available = real
    return out


def _rows(device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    rows = [(torch.randn(VOCAB + 8, generator=g) * 3).half() for _ in range(16)]
    nan, inf, dead = rows[0].clone(), rows[0].clone(), rows[0].clone()
    nan[4000] = float("nan")
    inf[10] = float("inf")
    dead[:VOCAB] = float("-inf")
    return [r.to(device) for r in [*rows, nan, inf, dead]]


# the cuts' floor kernel sorts each block, which Triton's interpreter takes ~20 s per call for
FLOORLESS = ("temperature", "fused-penalties", "min-p", "tiny-temperature", "wide-top-k", "top-p", "top-p-min-p")
CUTS = ("top-k", "top-k-top-p", "truncated")


def _kernel_against_torch(device: str, names: tuple[str, ...]) -> None:
    for name in names:
        plan, fused_state = _state(SETTINGS[name], device)
        _, torch_state = _state(SETTINGS[name], device)
        masks = [torch.zeros((1, 16), dtype=torch.int64, device=device) for _ in range(2)]
        positions = [torch.full((1, 1), 5, dtype=torch.int64, device=device) for _ in range(2)]
        for draw, row in enumerate(_rows(device)):
            for p in positions:
                p.fill_(5)
            out = torch.zeros((), dtype=torch.int64, device=device)
            # the kernel does the bookkeeping along with the draw
            assert draw_token(plan, fused_state, row, VOCAB, out, count=True, advance=(positions[0], masks[0], None))
            want = _torch_path(plan, torch_state, row, (positions[1], masks[1], None))
            assert int(out) == int(want), (name, draw)
            if draw >= 16:  # NaN, +inf, every token -inf
                assert int(out) == NON_FINITE, (name, draw)
            for key in ("counts", "draws"):
                assert torch.equal(fused_state[key], torch_state[key]), (name, draw, key)
            assert torch.equal(positions[0], positions[1]) and torch.equal(masks[0], masks[1]), (name, draw)
        assert int(fused_state["draws"]) == 19


@pytest.mark.skipif(not triton_serves(torch.empty(0)), reason="the kernel runs on the CPU through Triton's interpreter")
def test_noisy_argmax_kernel_picks_what_the_torch_path_picks() -> None:
    _kernel_against_torch("cpu", FLOORLESS)


@pytest.mark.slow
@pytest.mark.skipif(not triton_serves(torch.empty(0)), reason="the kernel runs on the CPU through Triton's interpreter")
def test_noisy_argmax_cuts_pick_what_the_torch_path_picks() -> None:
    """top-k (and top-p within it) through the floor kernel: minutes in the interpreter."""
    _kernel_against_torch("cpu", CUTS)


@pytest.mark.skipif(not triton_serves(torch.empty(0)), reason="the kernel runs on the CPU through Triton's interpreter")
def test_sampled_tail_kernel_stores_host_tokens() -> None:
    plan, state = _state(SETTINGS["fused-penalties"], "cpu")
    ids, pos = torch.zeros((1, 1), dtype=torch.int64), torch.full((1, 1), 3, dtype=torch.int64)
    mask = torch.zeros((1, 8), dtype=torch.int64)
    host = torch.full((9,), -7, dtype=torch.int64)
    tail = SampledTail("logits", plan, SamplerState(**state), VOCAB, ids, pos, mask, host)
    tail.writes_host = True  # the CPU has no pinned memory to insist on: the kernel writes it all the same
    tail.apply({"logits": _rows("cpu")[1].reshape(1, 1, -1)}, tail.state())
    assert int(pos) == 4 and int(mask[0, 4]) == 1 and int(mask.sum()) == 1
    assert int(host[4]) == int(ids) and int((host == -7).sum()) == 8


# -- CUDA (pytest -m gpu) ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_noisy_argmax_kernel_picks_what_the_torch_path_picks() -> None:
    _kernel_against_torch("cuda", FLOORLESS + CUTS)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", ["temperature", "fused-penalties", "truncated", "top-k-top-p"])
def test_gpu_sampled_tail_in_the_graph_equals_eager(package, name: str) -> None:
    """CUDA graphs with the sampler recorded in: verify mode compares every step and the tail's
    state with an eager run; the tokens equal the sampler's between the steps and capture off's."""
    params = _params(SETTINGS[name], n=40)
    want = [
        list(Generator(package, device="cuda", kv="static", capture="off").generate_ids(p, params)) for p in PROMPTS
    ]
    for kw in ({}, {"capture": "verify", "verify_steps": 60}, {"sample_in_graph": False}, {"pipeline": False}):
        generator = Generator(package, device="cuda", kv="static", **kw)
        for _ in range(2):
            assert [list(generator.generate_ids(p, params)) for p in PROMPTS] == want, (name, kw)
        stats = generator.capture_stats
        in_graph = kw.get("sample_in_graph") is not False
        assert stats.tail == ("in the graph" if in_graph else ""), kw
        assert stats.replays > 0 and stats.invalidations == 0, kw
        if in_graph:
            tails = list(generator.engine._sampled_tails.values())
            assert len(tails) == 1 and tails[0].writes_host, kw


def test_sampled_decode_bench_runs_on_the_cpu() -> None:
    """bench/sampled_decode.py's logic with the CPU stand-in recorder: it exits 0 only where the
    tokens in the graph, between the steps and with capture off agree."""
    import subprocess
    import sys
    from pathlib import Path

    cmd = [sys.executable, "-m", "bench.sampled_decode", "--shape", "smollm2-135m-instruct", "--device", "cpu",
           "--replay-recorder", "--precision", "fp32", "--context", "64", "--new-tokens", "4", "--repeats", "1",
           "--settings", "greedy,all"]  # fmt: skip
    done = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "MISMATCH" not in done.stderr
    lines = [line.split()[0] for line in done.stdout.splitlines() if line.startswith(("greedy", "all"))]
    assert lines == ["greedy", "all"], done.stdout
