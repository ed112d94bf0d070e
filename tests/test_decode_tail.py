"""Step tails (runtime/capture/tail.py) and greedy decode's (genai/decode_tail.py), on the CPU.

- GreedyTail against torch.argmax (the sampler's greedy path, the oracle): ties inside and across
  the kernel's blocks, NaN, an all -inf row, logits wider than the vocabulary, the mask entry at
  the end of a full cache. Plain CPU runs torch's kernels; test_triton_kernels.py runs these cases
  again through Triton's interpreter, where the Triton kernel serves them.
- The capture runtime runs a tail exactly once per step in every phase (warm-up, recording,
  replay, eager, capture off), inside the last segment where it can and eagerly where not, and
  verify mode compares the tail's state with an eager run's.
- The Generator with the tail gives the tokens of the loop without it and of eager decoding.
"""

from __future__ import annotations

import pytest
import torch

from onnxgen.genai.decode_tail import GreedyTail
from onnxgen.genai.generator import Generator
from onnxgen.genai.sampling import SamplingParams
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource
from onnxgen.runtime.capture.recorder import ReplayRecorder
from onnxgen.runtime.capture.runtime import CaptureMismatchError, CaptureRuntime
from onnxgen.runtime.gpu.launch import triton_serves
from tests.conftest import HAS_CUDA
from tests.test_capture_runtime import Decoder, prompt, write_word_tokenizer

VOCAB = 5000  # three of the kernel's 2,048-entry blocks


def _row(case: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    row = torch.randn(VOCAB + 8, generator=g).half()  # wider than the vocabulary, as padded logits are
    row[VOCAB:] = 100.0  # the padding must never win
    if case == "tie_across_blocks":
        row[[7, 2100, 4999]] = 9.0
    elif case == "tie_in_block":
        row[[3000, 3001]] = 9.0
    elif case == "last_entry":
        row[VOCAB - 1] = 9.0
    elif case == "nan":
        row[[4000, 4500]] = float("nan")
        row[10] = float("inf")
    elif case == "all_minus_inf":
        row[:VOCAB] = float("-inf")
    return row


@pytest.mark.parametrize("case", ["random", "tie_across_blocks", "tie_in_block", "last_entry", "nan", "all_minus_inf"])
def test_greedy_tail_matches_torch_argmax(case: str) -> None:
    row = _row(case)
    ids = torch.full((1, 1), -1, dtype=torch.int64)
    pos = torch.full((1, 1), 9, dtype=torch.int64)
    mask = torch.zeros((1, 16), dtype=torch.int64)
    mask[0, :10] = 1
    tail = GreedyTail("logits", VOCAB, ids, pos, mask)
    tail.apply({"logits": row.reshape(1, 1, -1)}, tail.state())
    assert int(ids) == int(torch.argmax(row[:VOCAB])), case
    assert int(pos) == 10
    want = torch.zeros((1, 16), dtype=torch.int64)
    want[0, :11] = 1
    assert torch.equal(mask, want)


def test_greedy_tail_at_the_end_of_a_full_cache_keeps_to_the_mask() -> None:
    """The step on the last row names a position past the buffer: the mask's last entry (already 1)."""
    ids, pos = torch.zeros((1, 1), dtype=torch.int64), torch.full((1, 1), 15, dtype=torch.int64)
    memory = torch.zeros((1, 20), dtype=torch.int64)
    mask = memory[:, :16]  # the mask of a 16-row cache, with memory after it that must stay untouched
    mask.fill_(1)
    tail = GreedyTail("logits", VOCAB, ids, pos, mask)
    tail.apply({"logits": _row("random").reshape(1, 1, -1)}, tail.state())
    assert int(pos) == 16 and torch.equal(mask, torch.ones((1, 16), dtype=torch.int64))
    assert not memory[0, 16:].any()


@pytest.mark.skipif(not triton_serves(torch.empty(0)), reason="the kernel runs on the CPU through Triton's interpreter")
def test_greedy_tail_kernel_stores_host_tokens() -> None:
    """The kernel's host copy: the token at its new position, nothing else (run interpreted: a CPU
    tensor stands in for the pinned memory the GPU writes)."""
    from onnxgen.runtime.gpu.greedy_advance import greedy_advance

    row = _row("tie_across_blocks")[:VOCAB]
    ids, pos = torch.zeros((1, 1), dtype=torch.int64), torch.full((1, 1), 4, dtype=torch.int64)
    mask, host = torch.zeros((1, 8), dtype=torch.int64), torch.full((9,), -1, dtype=torch.int64)
    greedy_advance(row, ids, pos, mask, host)
    want = torch.full((9,), -1, dtype=torch.int64)
    want[5] = int(torch.argmax(row))
    assert torch.equal(host, want) and int(ids) == want[5]


def test_greedy_tail_refuses_a_batch() -> None:
    with pytest.raises(ValueError, match=r"\[1, capacity\] mask"):
        GreedyTail("logits", VOCAB, torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2, 8))


class CountingTail:
    """Counts its runs; names ``reads`` (which place it, or not, in the last segment) but reads nothing."""

    def __init__(self, reads: tuple[str, ...] = ("logits",)):
        self.reads = reads
        self.count = torch.zeros(1, dtype=torch.int64)

    def state(self) -> dict[str, torch.Tensor]:
        return {"count": self.count}

    def apply(self, outputs, state) -> None:
        state["count"].add_(1)


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    config = TINY_CONFIGS["tiny-llama"]
    directory = build_package(RandomSource(config), tmp_path_factory.mktemp("tail") / "gqa", attention="gqa")
    write_word_tokenizer(directory, config.vocab_size)
    return directory


def _decode_with_tail(decoder: Decoder, tail, steps: int) -> None:
    with torch.inference_mode():
        logits = decoder.step(prompt(decoder.device))
        for _ in range(steps):
            token = logits[0, -1].argmax().reshape(1, 1)
            feeds = decoder.feeds(token)
            out = decoder.runtime.run(feeds, tail=tail)
            decoder.kv.update(out, 1)
            logits = out["logits"].clone()


@pytest.mark.parametrize("mode", ["on", "off", "verify"])
def test_a_tail_runs_once_per_step_in_every_phase(package, mode: str) -> None:
    """2 warm-up steps, 1 recording step, then replays: one run of the tail each, in the graph."""
    recorder = ReplayRecorder() if mode != "off" else None
    decoder = Decoder(package, "static", runtime_kw={"recorder": recorder, "mode": mode, "verify_steps": 4})
    tail = CountingTail()
    _decode_with_tail(decoder, tail, 10)
    stats = decoder.runtime.stats
    assert int(tail.count) == 10
    if mode != "off":
        assert stats.tail == "in the graph" and stats.replays >= 7
    if mode == "verify":
        assert stats.verified_steps == 4


def test_a_tail_the_last_segment_cannot_feed_runs_eagerly_once(package) -> None:
    decoder = Decoder(package, "static", runtime_kw={"recorder": ReplayRecorder()})
    tail = CountingTail(reads=("logits", "attention_mask"))  # a graph input: no segment makes it
    _decode_with_tail(decoder, tail, 8)
    assert int(tail.count) == 8
    assert decoder.runtime.stats.tail == "eager: the step's last segment does not make attention_mask"
    assert decoder.runtime.stats.replays >= 5


class HostCountTail(CountingTail):
    """Not capture-safe: writes a host-side count, so a replay computes something an eager run does not."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def apply(self, outputs, state) -> None:
        self.calls += 1
        state["count"].fill_(self.calls)


def test_verify_compares_the_tail_state_with_eager(package) -> None:
    decoder = Decoder(package, "static", runtime_kw={"recorder": ReplayRecorder(), "mode": "verify"})
    with pytest.raises(CaptureMismatchError, match="step tail state"):
        _decode_with_tail(decoder, HostCountTail(), 6)


def test_tails_have_their_own_recordings(package) -> None:
    decoder = Decoder(package, "static", runtime_kw={"recorder": ReplayRecorder()})
    first, second = CountingTail(), CountingTail()
    _decode_with_tail(decoder, first, 5)
    decoder.kv = decoder.new_kv()
    runtime: CaptureRuntime = decoder.runtime
    before = runtime.stats.captures
    _decode_with_tail(decoder, second, 5)
    assert int(first.count) == 5 and int(second.count) == 5
    assert runtime.stats.captures > before and len(runtime.keys) == 2


GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)


def test_generator_tokens_with_the_tail_in_the_graph(package) -> None:
    """Greedy through the tail (pipelined and not) == without it == eager decoding, across generations."""
    eager = Generator(package, kv="static", capture="off")
    want = [list(eager.generate_ids([3, 141, 59, 26], GREEDY)), list(eager.generate_ids([7, 7, 7], GREEDY))]
    for pipeline in (False, True):
        for in_graph in (True, False):
            generator = Generator(
                package, kv="static", capture="on", recorder=ReplayRecorder(), pipeline=pipeline,
                sample_in_graph=in_graph,
            )  # fmt: skip
            got = [list(generator.generate_ids([3, 141, 59, 26], GREEDY)),
                   list(generator.generate_ids([7, 7, 7], GREEDY))]  # fmt: skip
            assert got == want, (pipeline, in_graph)
            assert generator.capture_stats.tail == ("in the graph" if in_graph else "")
            assert generator.capture_stats.invalidations == 0


def test_generator_tail_fills_the_cache_to_its_last_row(package) -> None:
    """A generation that ends on the cache's last row: the tail's mask entry stays inside the buffer.
    A 16-row cache: every step is verified against eager, twice the work per step (and minutes
    through the Triton interpreter at 64 rows)."""
    capacity = 16
    eager = Generator(package, kv="static", capture="off")
    generator = Generator(package, kv="static", capture="verify", recorder=ReplayRecorder(), verify_steps=100)
    generator.engine._static_capacity = lambda total: capacity  # type: ignore[method-assign]
    eager.engine._static_capacity = lambda total: capacity  # type: ignore[method-assign]
    ids = [3, 141, 59, 26]
    params = SamplingParams(max_new_tokens=capacity - len(ids), ignore_eos=True)
    assert list(generator.generate_ids(ids, params)) == list(eager.generate_ids(ids, params))
    assert generator.capture_stats.verified_steps > 0


# -- CUDA (pytest -m gpu) ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", ["random", "tie_across_blocks", "tie_in_block", "last_entry", "nan", "all_minus_inf"])
def test_gpu_greedy_tail_kernel_matches_torch_argmax(case: str) -> None:
    """The Triton kernel (with PDL where the GPU has it) against torch.argmax on the GPU; and a
    151,936-entry row, the Qwen2.5 vocabulary, random."""
    from onnxgen.runtime.gpu.launch import LAUNCHES

    rows = [_row(case).cuda()]
    if case == "random":
        rows.append(torch.randn(151936, generator=torch.Generator().manual_seed(5)).half().cuda())
    for row in rows:
        vocab = min(VOCAB, row.numel())
        ids = torch.full((1, 1), -1, dtype=torch.int64, device="cuda")
        pos = torch.full((1, 1), 9, dtype=torch.int64, device="cuda")
        mask = torch.zeros((1, 16), dtype=torch.int64, device="cuda")
        before = LAUNCHES["greedy_advance"]
        tail = GreedyTail("logits", vocab if row.numel() != 151936 else 151936, ids, pos, mask)
        for _ in range(3):  # the ticket must be reset between calls
            pos.fill_(9)
            tail.apply({"logits": row.reshape(1, 1, -1)}, tail.state())
            want = torch.argmax(row[: tail.vocab_size])
            assert int(ids) == int(want), case
            assert int(pos) == 10 and int(mask[0, 10]) == 1 and int(mask.sum()) == 1
        assert LAUNCHES["greedy_advance"] == before + 3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_generator_tokens_with_the_tail_in_the_graph(package) -> None:
    """CUDA graphs with the tail recorded in: the tokens of the loop without it and of eager decoding,
    and verify mode's eager comparison of outputs and tail state."""
    want = list(Generator(package, device="cuda", kv="static", capture="off").generate_ids([3, 141, 59, 26], GREEDY))
    for kw in ({}, {"sample_in_graph": False}, {"capture": "verify", "verify_steps": 30}, {"pipeline": False}):
        generator = Generator(package, device="cuda", kv="static", **kw)
        for _ in range(2):
            assert list(generator.generate_ids([3, 141, 59, 26], GREEDY)) == want, kw
        stats = generator.capture_stats
        in_graph = kw.get("sample_in_graph") is not False
        assert stats.tail == ("in the graph" if in_graph else ""), kw
        assert stats.replays > 0 and stats.invalidations == 0, kw
        if in_graph:  # the kernel stores each token in pinned host memory: no copy in the stream
            assert generator.engine._tail is not None and generator.engine._tail.writes_host, kw


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_greedy_tail_writes_pinned_host_tokens_inside_a_graph() -> None:
    """Replays of a CUDA graph holding the kernel: each stores its token where the host reads it."""
    rows = torch.randn(6, 151936, generator=torch.Generator().manual_seed(9)).half().cuda()
    source = torch.empty(151936, dtype=torch.half, device="cuda")
    ids = torch.zeros((1, 1), dtype=torch.int64, device="cuda")
    pos = torch.zeros((1, 1), dtype=torch.int64, device="cuda")
    mask = torch.zeros((1, 8), dtype=torch.int64, device="cuda")
    host = GreedyTail.host_tokens_for(8, ids.device)
    assert host is not None and host.is_pinned()
    tail = GreedyTail("logits", 151936, ids, pos, mask, host)
    assert tail.writes_host
    source.copy_(rows[0])
    tail.apply({"logits": source.reshape(1, 1, -1)}, tail.state())  # eager: compiles, makes the scratch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tail.apply({"logits": source.reshape(1, 1, -1)}, tail.state())
    for i in range(1, 6):
        source.copy_(rows[i])
        graph.replay()
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
        assert int(host[i + 1]) == int(torch.argmax(rows[i])) == int(ids), i
    assert int(host[1]) == int(torch.argmax(rows[0]))
