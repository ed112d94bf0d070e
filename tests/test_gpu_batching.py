"""Captured batched decode steps on CUDA (issue 20), on the Qwen2.5-0.5B shape with random weights.

GPU only (`pytest -m gpu`). Sequences arrive at staggered times so the batched step runs at several
bucket sizes, and the prompts that arrive together run as prompt groups; the same arrivals run three
times, so that every group shape is recorded and replayed too. The engine captures in verify mode,
so every captured batched step and prompt group is also run eagerly on copies of its inputs and must
be equal to it bit for bit (the runtime raises CaptureMismatchError otherwise). The plan recorded
per bucket must be the one `onnxgen show --capture --device cuda --bind batch_size=N,...` prints.
Against the one-sequence captured loop: each sequence's first token is asserted equal (a group's
prompt rows are computed as the lone prompt's are, but its matrix products span more rows); later
tokens may part at near-ties where the batched GEMMs round otherwise than the one-row kernels, and
how many agree is printed, not asserted.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from onnxgen.genai.batched import BatchedDecoder
from onnxgen.genai.generator import Generator
from onnxgen.genai.sampling import SamplingParams
from onnxgen.runtime.capture.report import capture_report
from tests.conftest import HAS_CUDA
from tests.test_gpu_capture_models import qwen_shape_packages  # noqa: F401, F811 - the shared fixture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]

NEW_TOKENS = 48
SLOTS = 8
SLOT_TOKENS = 256


def _prompts(count: int, vocab: int) -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(5, 40))] for _ in range(count)]


@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_batched_steps_are_captured_per_bucket_and_equal_eager(qwen_shape_packages, precision: str) -> None:  # noqa: F811
    package = qwen_shape_packages[precision]
    generator = Generator(package, device="cuda", capture="verify", verify_steps=1_000_000)
    engine = generator.engine
    prompts = _prompts(SLOTS, engine.config.vocab_size)
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)] * (SLOTS - 2) + [
        SamplingParams(temperature=0.8, top_p=0.9, seed=11 + i, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        for i in range(2)
    ]
    decoder = BatchedDecoder(engine, max_seqs=SLOTS, max_model_len=SLOT_TOKENS, prefix_caching=False)
    for _ in range(3):
        sequences = [engine.new_sequence(p, q) for p, q in zip(prompts, params)]
        arrivals = {0: sequences[:1], 5: sequences[1:3], 12: sequences[3:]}
        tick = 0
        while decoder.admitted or any(t >= tick for t in arrivals):
            for sequence in arrivals.get(tick, []):
                decoder.admit(sequence)
            decoder.iterate()
            tick += 1
        assert all(s.done and s.stats.new_tokens == NEW_TOKENS for s in sequences)
    stats = decoder.capture_stats
    print(stats.summary())
    assert stats.keys >= 3 and stats.captured_steps > 0 and stats.verified_steps == stats.captured_steps
    assert stats.invalidations == 0 and not stats.unsupported and not stats.quarantined
    bind = f"batch_size={SLOTS},past_sequence_length={SLOT_TOKENS},total_sequence_length={SLOT_TOKENS}"
    report = json.loads(capture_report(engine.config.model_file, bind=bind, as_json=True, device="cuda"))
    assert stats.segments_per_step == int(report["segments"])
    groups = decoder.prompt_capture_stats
    print(groups.summary())
    assert decoder.grouped_prompts == 3 * SLOTS and decoder.prompt_groups < 3 * SLOTS
    assert groups.captured_steps > 0 and groups.verified_steps == groups.captured_steps
    assert groups.invalidations == 0 and not groups.unsupported and not groups.quarantined

    greedy = [(s, p) for s, p, q in zip(sequences, prompts, params) if q.temperature == 0]
    serial = Generator(package, device="cuda")
    greedy_params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    alone = [list(serial.generate_ids(p, greedy_params)) for _, p in greedy]
    same = sum(s.generated == a for (s, _), a in zip(greedy, alone))
    agree = sum(x == y for (s, _), a in zip(greedy, alone) for x, y in zip(s.generated, a))
    print(f"{precision}: {same}/{len(greedy)} greedy sequences equal to the one-sequence loop; "
          f"{agree}/{len(greedy) * NEW_TOKENS} tokens at equal positions")  # fmt: skip
    assert [s.generated[0] for s, _ in greedy] == [a[0] for a in alone]
    del decoder, generator, serial
    torch.cuda.empty_cache()


def test_recorded_ops_run_eagerly_then_record_then_replay() -> None:
    """genai/recorded_ops.py on CUDA: each call computes from the inputs' values at that call (the
    first eagerly, the second recorded then replayed, later ones replayed)."""
    from onnxgen.genai.recorded_ops import RecordedOps

    source = torch.zeros(8, device="cuda")
    out = torch.zeros(8, device="cuda")
    ops = RecordedOps(lambda: out.copy_(torch.where(source > 2, source * 2, -source)), torch.device("cuda"))
    for step in range(5):
        source.copy_(torch.arange(8, device="cuda") + step)
        ops()
        expected = torch.where(source > 2, source * 2, -source)
        assert torch.equal(out, expected), step
    assert ops.graph is not None and ops.calls == 5
