"""Captured prefill: the prompt as padded power-of-two chunks run through their own capture runtime.

On the CPU the ReplayRecorder stands in for CUDA graphs (the same warm-up, record and replay phases);
on CUDA (``-m gpu``) the chunks are real graphs, checked against eager in verify mode. The oracle is
onnxruntime running the whole prompt in one pass of the same graph.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from onnxgen.genai.generator import Generator
from onnxgen.genai.sampling import SamplingParams
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource
from onnxgen.runtime.capture.recorder import ReplayRecorder
from tests.conftest import HAS_CUDA, onnxruntime_prompt_logits
from tests.test_capture_runtime import write_word_tokenizer


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    config = TINY_CONFIGS["tiny-llama"]
    directory = build_package(RandomSource(config), tmp_path_factory.mktemp("prefill") / "gqa", attention="gqa")
    write_word_tokenizer(directory, config.vocab_size)
    return directory


def prompt(n: int, vocab: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(n).integers(1, vocab, size=n)]


def onnxruntime_last_logits(package: Path, ids: list[int]) -> np.ndarray:
    pytest.importorskip("onnxruntime")
    return onnxruntime_prompt_logits(package, ids)[-1]


def captured_generator(package: Path, device: str = "cpu", capture: str = "on", **kw) -> Generator:
    recorder = ReplayRecorder() if device == "cpu" else None
    return Generator(package, device=device, kv="static", capture=capture, recorder=recorder, **kw)


def prefill_logits(generator: Generator, ids: list[int]) -> np.ndarray:
    engine = generator.engine
    sequence = engine.new_sequence(ids, SamplingParams(max_new_tokens=1))
    sequence.kv = engine._new_kv(len(ids) + 1)
    with torch.inference_mode():
        logits = engine._prefill(sequence, torch.tensor([ids], device=engine.device)).float().cpu().numpy()
    assert sequence.kv.length == len(ids)
    assert int(sequence.kv.mask.sum()) == len(ids)  # the padding's rows are masked out again
    return logits


def chunk_rows(generator: Generator) -> list[int]:
    """Spy: the input_ids rows of each step the prefill runtime runs."""
    rows: list[int] = []
    runtime = generator.engine.prefill_runtime()
    original = runtime.run

    def run(feeds, tail=None):
        rows.append(feeds["input_ids"].shape[1])
        return original(feeds, tail)

    runtime.run = run  # type: ignore[method-assign]
    return rows


@pytest.mark.parametrize(
    ("n", "chunk_max", "expected_rows"),
    # 37 rows: padded to 48 (option prefill_sizes fine, the default: 1.5 times a power of two too)
    [(5, 1024, [16]), (16, 1024, [16]), (37, 1024, [48]), (37, 16, [16, 16, 16]), (40, 32, [32, 16])],
)
def test_captured_prefill_matches_onnxruntime(package, n: int, chunk_max: int, expected_rows: list[int]) -> None:
    generator = captured_generator(package)
    generator.engine.captured_prefill_max = chunk_max
    rows = chunk_rows(generator)
    ids = prompt(n, generator.config.vocab_size)
    expected = onnxruntime_last_logits(package, ids)
    scale = float(np.abs(expected).max())
    for attempt in range(4):  # warm-up, warm-up, record, replay: every phase against the oracle
        ours = prefill_logits(generator, ids)
        # fp32: chunking and padding change the order of the attention's sums, onnxruntime its kernels
        assert float(np.abs(ours - expected).max()) <= 2e-4 * scale, attempt
    assert rows == expected_rows * 4
    stats = generator.engine.prefill_capture_stats
    assert stats.captured_steps >= len(expected_rows) * 2 and stats.steps == len(expected_rows) * 4
    assert generator.capture_stats.steps == 0  # prefill chunks are not counted as decode steps


def test_power_of_two_sizes_pad_to_the_next_power_of_two(package) -> None:
    """Option prefill_sizes pow2: a 37-token prompt runs padded to 64 rows (48 with fine sizes,
    above), its last row's logits still onnxruntime's."""
    from onnxgen import options

    generator = captured_generator(package)
    rows = chunk_rows(generator)
    ids = prompt(37, generator.config.vocab_size)
    expected = onnxruntime_last_logits(package, ids)
    with options.override(prefill_sizes="pow2"):
        ours = prefill_logits(generator, ids)
    assert float(np.abs(ours - expected).max()) <= 2e-4 * float(np.abs(expected).max())
    assert rows == [64]


def test_no_room_for_padding_runs_the_chunk_at_its_own_length(package) -> None:
    generator = captured_generator(package)
    engine = generator.engine
    engine.kv_capacity = 40  # 37 + 1 rows fit, 64 do not
    rows = chunk_rows(generator)
    ids = prompt(37, generator.config.vocab_size)
    expected = onnxruntime_last_logits(package, ids)
    ours = prefill_logits(generator, ids)
    assert rows == [37]
    assert float(np.abs(ours - expected).max()) <= 2e-4 * float(np.abs(expected).max())


def test_chunk_shapes_beyond_the_limit_run_eagerly_and_say_so_once(package) -> None:
    generator = captured_generator(package)
    generator.engine.captured_prefill_keys = 1
    rows = chunk_rows(generator)
    for n in (5, 37, 40, 5):
        ids = prompt(n, generator.config.vocab_size)
        expected = onnxruntime_last_logits(package, ids)
        if n == 37:
            with pytest.warns(UserWarning, match="1 chunk shapes are recorded already"):
                ours = prefill_logits(generator, ids)
        else:
            ours = prefill_logits(generator, ids)
        assert float(np.abs(ours - expected).max()) <= 2e-4 * float(np.abs(expected).max()), n
    assert rows == [16, 16]  # only the first shape's chunks reach the prefill runtime
    assert generator.engine._prefill_keys_said


def test_decode_after_a_captured_prefill_is_captured_and_greedy_matches_eager(package) -> None:
    eager = Generator(package, kv="static", capture="off")
    captured = captured_generator(package)
    captured.engine.captured_prefill_max = 16
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    for n in (3, 21, 21, 21, 21, 9):
        ids = prompt(n, eager.config.vocab_size)
        assert list(captured.generate_ids(ids, params)) == list(eager.generate_ids(ids, params)), n
    stats = captured.capture_stats
    assert stats.captured_steps > 0 and stats.steps == 6 * 11  # n - 1 decode steps per generation
    assert captured.engine.prefill_capture_stats.captured_steps > 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_captured_prefill_on_cuda_is_eager_bit_for_bit_and_matches_onnxruntime(package) -> None:
    """verify mode: every captured chunk (recording and replays) against an eager run of the same
    feeds, exactly; the logits against onnxruntime's one pass (fp32 tolerance)."""
    generator = captured_generator(package, device="cuda", capture="verify", verify_steps=64)
    generator.engine.captured_prefill_max = 32
    for n in (5, 40, 40, 40, 40):
        ids = prompt(n, generator.config.vocab_size)
        expected = onnxruntime_last_logits(package, ids)
        ours = prefill_logits(generator, ids)
        assert float(np.abs(ours - expected).max()) <= 2e-4 * float(np.abs(expected).max()), n
    stats = generator.engine.prefill_capture_stats
    # two chunk keys, 16 and 32 rows (the mask spans the cache, so the 5-token prompt's chunk and the
    # 40-token prompts' second chunk share one): warm, warm, record, then replays; 16 rows run five
    # times (3 captured), 32 rows four (2)
    assert stats.verified_steps == stats.captured_steps == 5
    tokens = list(generator.generate_ids(prompt(40, generator.config.vocab_size), SamplingParams(max_new_tokens=8)))
    assert len(tokens) == 8 and generator.capture_stats.captured_steps > 0


def test_bench_times_replayed_prefills(package) -> None:
    """onnxgen bench warms a captured prefill up until it has recorded, so every timed run replays."""
    from onnxgen.genai.benchmark import run_bench

    generator = captured_generator(package)
    run_bench(generator, prompt_tokens=5, new_tokens=3, repeats=2)
    prefill = generator.engine.prefill_capture_stats
    assert prefill.steps == 3 + 2  # warm-up, warm-up, recording; two timed runs
    assert prefill.captures == prefill.segments_per_step and prefill.replays == 2 * prefill.segments_per_step


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")])],
)
def test_generations_of_other_kv_sizes_keep_each_others_recordings(tmp_path, device: str) -> None:
    """A generation whose prompt + max_new_tokens needs another KV size (256, then 512 rows) gets a
    cache of that size; going back to a size replays what was recorded over its cache (no recording,
    no invalidation), greedy and sampled alike, with the eager loop's tokens (the eager loop's own
    parity with onnxruntime is test_captured_prefill_matches_onnxruntime's and the generator tests')."""
    config = dataclasses.replace(TINY_CONFIGS["tiny-llama"], max_position_embeddings=1024)
    package = build_package(RandomSource(config), tmp_path / "gqa", attention="gqa")
    write_word_tokenizer(package, config.vocab_size)
    captured = captured_generator(package, device=device)
    eager = Generator(package, device=device, kv="static", capture="off")
    ids = prompt(20, config.vocab_size)
    greedy = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 250)]
    sampled = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0.8, top_k=20, seed=3) for n in (12, 250)]
    rounds = [[*greedy, *sampled]] * 3  # a prompt chunk shape records on its third run (warm-up first)
    counts = []
    for params_list in rounds:
        for params in params_list:
            assert list(captured.generate_ids(ids, params)) == list(eager.generate_ids(ids, params))
        engine = captured.engine
        counts.append((engine.capture_stats.captures, engine.prefill_capture_stats.captures))
        assert engine.capture_stats.invalidations == 0 and engine.prefill_capture_stats.invalidations == 0
    assert sorted(captured.engine._static_kvs) == [256, 512]
    assert counts[2] == counts[1], counts  # the third round recorded nothing
