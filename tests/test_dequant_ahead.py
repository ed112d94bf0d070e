"""Option q4_dequant_ahead (gpu/dequant_ahead.py): a long prompt's 4-bit chunks dequantized one
ahead on a second stream, into the other half of the scratch.

The ordering is checked here without a GPU, on a simulated timeline: every stream operation the
pipeline issues becomes a node of a happens-before graph (a stream's operations in issue order, an
event wait an edge), and each GEMM's read of a half must come after the write of its chunk with no
other write of that half in between or beside, and every unit must end with the side stream joined.
The arithmetic (the same bits as the serial path, in eager runs and in a CUDA graph) is checked on
the GPU (``gpu`` marks).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from onnxgen import options
from onnxgen.runtime.gpu.dequant_ahead import Chunk, DequantAhead
from tests.conftest import HAS_CUDA
from tests.interpreted_kernels import KERNEL_DEVICES
from tests.interpreted_runs import IN_THE_PARENT, interpreted_file, runs


class Timeline:
    """StreamOps that build a happens-before graph instead of running anything."""

    def __init__(self) -> None:
        self.preds: list[set[int]] = []  # per operation: every operation that happens before it
        self.stream_of: list[int] = []  # per operation: its stream
        self.last: dict[int, int] = {}  # stream -> its latest operation
        self.log: list[tuple[int, str, int, tuple]] = []  # (op, kind, half, chunk key)
        self.streams = 0
        self.active = self.new_stream()  # the main stream

    def _op(self, stream: int, after: tuple[int, ...] = ()) -> int:
        deps: set[int] = set()
        for d in (self.last.get(stream), *after):
            if d is not None:
                deps |= {d} | self.preds[d]
        self.preds.append(deps)
        self.stream_of.append(stream)
        op = len(self.preds) - 1
        self.last[stream] = op
        return op

    def before(self, a: int, b: int) -> bool:
        return a in self.preds[b]

    # StreamOps
    def current(self) -> int:
        return self.active

    def new_stream(self) -> int:
        self.streams += 1
        return self.streams

    @contextmanager
    def use(self, stream: int):
        saved, self.active = self.active, stream
        try:
            yield stream
        finally:
            self.active = saved

    def event(self) -> list[int]:
        return []  # the operation of its latest record

    def record(self, stream: int, event: list[int] | None = None) -> list[int]:
        event = [] if event is None else event
        event[:] = [self._op(stream)]
        return event

    def wait_event(self, stream: int, event: list[int]) -> None:
        self._op(stream, tuple(event))

    def wait_stream(self, stream: int, other: int) -> None:
        self._op(stream, (self._op(other),))

    # what the test's dequantization and GEMM issue
    def access(self, kind: str, half: int, key: tuple) -> int:
        op = self._op(self.active)
        self.log.append((op, kind, half, key))
        return op


def check_races(t: Timeline) -> None:
    """Every read of a half happens after the write of the chunk it reads, and every other write
    of that half happens before that write or after the read."""
    writes = [(op, half, key) for op, kind, half, key in t.log if kind == "write"]
    for op, kind, half, key in t.log:
        if kind != "read":
            continue
        mine = [w for w, h, k in writes if h == half and k == key and t.before(w, op)]
        assert mine, f"read of {key} in half {half} (op {op}) has no write of it before it"
        source = max(mine)
        for w, h, k in writes:
            if h == half and w != source:
                assert t.before(w, source) or t.before(op, w), (
                    f"write {w} of {k} into half {half} races the read {op} of {key} (written by {source})"
                )


class Stack:
    """Weights of chunks (rows lo..hi of K = 8 elements, the scratch holding 2 x 32 rows): a chunk's
    "dequantization" fills its view with the chunk's id, and the GEMM reads the view back."""

    def __init__(self, timeline: Timeline) -> None:
        self.t = timeline
        self.buffer = torch.zeros(2 * 32 * 8)
        self.ahead = DequantAhead(self.buffer, timeline)
        self.side = self.ahead.side

    def half_of(self, view: torch.Tensor) -> int:
        return int(view.data_ptr() != self.buffer.data_ptr())

    def chunk(self, weight: int, lo: int, hi: int) -> Chunk:
        def make(view: torch.Tensor) -> None:
            view.fill_(weight * 1000 + lo)
            self.t.access("write", self.half_of(view), (weight, lo, hi, 8))

        return Chunk(weight, lo, hi, 8, make)

    def product(self, weight: int, lo: int, hi: int) -> None:
        view = self.ahead.weight(self.chunk(weight, lo, hi))
        assert view.shape == (hi - lo, 8)
        assert torch.all(view == weight * 1000 + lo), f"chunk {(weight, lo, hi)} read another chunk's rows"
        self.t.access("read", self.half_of(view), (weight, lo, hi, 8))
        self.ahead.read_done()

    def unit(self, chunks: list[tuple[int, int, int]]) -> None:
        for c in chunks:
            self.product(*c)
        self.ahead.join()
        (end,) = self.t.record(self.t.active)
        side = [op for op in range(end) if self.t.stream_of[op] == self.side]
        assert all(self.t.before(op, end) for op in side), "the unit ended with side work unjoined"


# a layer's four weights: one of three chunks, the others whole
LAYER = [(1, 0, 12), (2, 0, 32), (2, 32, 64), (2, 64, 80), (3, 0, 20), (4, 0, 30)]


def run_units(stack: Stack, units: list[list[tuple[int, int, int]]]) -> list[int]:
    """Runs each unit; returns how many chunks each unit dequantized on the main stream."""
    on_main = []
    for chunks in units:
        start = len(stack.t.log)
        stack.unit(chunks)
        main_writes = 0
        for op, kind, _, _ in stack.t.log[start:]:
            if kind == "write" and stack.t.stream_of[op] != stack.side:
                main_writes += 1
        on_main.append(main_writes)
    check_races(stack.t)
    return on_main


@pytest.fixture
def stack() -> Stack:
    return Stack(Timeline())


def test_learned_order_dequantizes_ahead_without_races(stack: Stack) -> None:
    """The first run learns the order (every chunk on the main stream); from the second on only a
    unit's first chunk is made on the main stream, the rest ahead on the side stream, and no read
    races a write."""
    assert run_units(stack, [LAYER, LAYER, LAYER]) == [len(LAYER), 1, 1]


def test_a_changed_order_costs_only_the_wrong_guesses(stack: Stack) -> None:
    """A unit that skips a weight, one that repeats a chunk and one that stops early: the chunks
    asked for are still the ones read, made on the main stream where the guess was wrong."""
    skipped = [c for c in LAYER if c[0] != 3]
    repeated = [*LAYER[:2], LAYER[1], *LAYER[2:]]
    on_main = run_units(stack, [LAYER, LAYER, skipped, LAYER, repeated, LAYER[:3], LAYER])
    assert on_main[:2] == [len(LAYER), 1]
    assert on_main[2] == 2  # the chunk after the skipped weight
    assert on_main[3] == 2  # weight 3 again: its predecessor now points past it
    assert all(m < len(LAYER) for m in on_main[4:]), on_main


def test_a_link_past_a_units_end_is_unlearned(stack: Stack) -> None:
    """Whole runs learn the order across what later runs as two units (a captured step's
    segments): the first unit's last chunk then sets going the second's first, which the join
    waits for and unlearns, so the next time that unit ends with nothing left ahead."""
    first, second = LAYER[:3], LAYER[3:]
    before = stack.ahead.prefetches
    run_units(stack, [LAYER, LAYER])
    assert stack.ahead.prefetches - before == len(LAYER) - 1
    for attempt, wasted in enumerate((1, 0, 0)):
        before = stack.ahead.prefetches
        run_units(stack, [first, second])
        # within each unit all but its first chunk ahead; plus the wasted one the first time
        assert stack.ahead.prefetches - before == len(first) - 1 + len(second) - 1 + wasted, attempt


def test_the_race_check_catches_a_missing_wait(stack: Stack, monkeypatch) -> None:
    """The checker itself: without the side stream's wait for the half's last GEMM, or without the
    main stream's wait for a prefetch, the timeline has a race."""
    real = stack.t.wait_event

    def skip_side_waits(stream, event):
        if stream != stack.side:
            real(stream, event)

    monkeypatch.setattr(stack.t, "wait_event", skip_side_waits)
    with pytest.raises(AssertionError, match="races the read"):
        run_units(stack, [LAYER, LAYER])


def test_the_race_check_catches_a_read_before_its_prefetch(stack: Stack, monkeypatch) -> None:
    real = stack.t.wait_event

    def skip_main_waits(stream, event):
        if stream == stack.side:
            real(stream, event)

    monkeypatch.setattr(stack.t, "wait_event", skip_main_waits)
    with pytest.raises(AssertionError, match="has no write of it before it|unjoined"):
        run_units(stack, [LAYER, LAYER])


def test_program_joins_after_every_run_and_failed_run() -> None:
    """GraphProgram.run joins its unit_joins at the end of each run, and after an op's exception
    too, without a failing join hiding that exception."""
    from onnx import TensorProto, helper

    from onnxgen.runtime import InferenceSession

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    session = InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    joins = []
    session.program.unit_joins.append(lambda: joins.append(1))
    session.run(None, {"x": np.ones(2, np.float32)})
    session.run(None, {"x": np.ones(2, np.float32)})
    assert len(joins) == 2

    def broken_join():
        raise RuntimeError("join failed")

    session.program.unit_joins.append(broken_join)
    node = session.program.nodes[0]
    original = node.spec

    def failing(ctx, *args):
        raise ValueError("the op failed")

    node.spec = dataclasses.replace(original, fn=failing)
    with pytest.raises(Exception, match="the op failed"):
        session.run(None, {"x": np.ones(2, np.float32)})
    node.spec = original
    assert len(joins) == 3
    with pytest.raises(RuntimeError, match="join failed"):
        session.run(None, {"x": np.ones(2, np.float32)})


def test_option_is_read_at_load() -> None:
    assert options.from_env({"ONNXGEN_Q4_DEQUANT_AHEAD": "1"}).q4_dequant_ahead is True
    assert options.Options().q4_dequant_ahead is False


# -- the same bits as the serial path: on CUDA, and on one stream through Triton's interpreter -------------


def _weights(rng: torch.Generator, shapes: list[tuple[int, int]], device: str):
    weights = []
    for n, k in shapes:
        nb = k // 32
        codes = torch.randint(0, 256, (n, nb, 16), generator=rng, dtype=torch.uint8).to(device)
        scales = (torch.rand(n, nb, generator=rng) * 0.02).to(device, torch.float16)
        zeros = torch.randint(0, 256, (n, -(-nb // 2)), generator=rng, dtype=torch.uint8).to(device)
        weights.append((codes, scales, zeros, n, k))
    return weights


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_dequant_ahead_gives_the_serial_paths_bits(device: str) -> None:
    """Four weights (one of them in 4 chunks) multiplied by an 8-row prompt, three runs through the
    option's pipeline against a serial scratch of the same size: every product equal bit for bit; on
    CUDA also replayed from a CUDA graph recorded over one run (whose join closes the side stream)."""
    from onnxgen.runtime.gpu.launch import LAUNCHES
    from onnxgen.runtime.gpu.linear_q4 import DequantScratch, matmul_q4

    rng = torch.Generator().manual_seed(0)
    weights = _weights(rng, [(64, 64), (250, 64), (32, 128), (80, 64)], device)
    elements = 2 * 80 * 64  # halves of 80 rows of 64: the 250-row weight goes in 4 chunks (64, 64, 64, 58)
    dev = torch.device(device)
    serial = DequantScratch(elements, torch.float16, dev)
    ahead = DequantScratch(elements, torch.float16, dev)
    a = {k: torch.randn(8, k, generator=rng).to(device, torch.float16) for k in (64, 128)}

    def run(scratch: DequantScratch) -> list[torch.Tensor]:
        with options.override(q4_dequant_ahead=scratch is ahead):
            outs = [matmul_q4(a[k], b, s, z, n=n, k=k, block_size=32, scratch=scratch) for b, s, z, n, k in weights]
        scratch.join()
        return outs

    with options.override(triton_q4=True, q4_prompt="dequant"):
        before = LAUNCHES["dequant_q4_blocks"]
        expected = run(serial)
        assert LAUNCHES["dequant_q4_blocks"] - before == 1 + 2 + 1 + 1  # the whole scratch: 250 rows in 128 + 122
        for attempt in range(3):
            before, ahead_before = LAUNCHES["dequant_q4_blocks"], ahead.ahead.prefetches
            got = run(ahead)
            assert LAUNCHES["dequant_q4_blocks"] - before == 1 + 4 + 1 + 1, attempt
            # the first run learns the order; later ones make all but the first chunk ahead
            assert ahead.ahead.prefetches - ahead_before == (0 if attempt == 0 else 6), attempt
            for i, (e, g) in enumerate(zip(expected, got)):
                assert torch.equal(e, g), f"run {attempt}, weight {i}"
        if device != "cuda":
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = run(ahead)
        for _ in range(2):
            for out in captured:
                out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            for i, (e, g) in enumerate(zip(expected, captured)):
                assert torch.equal(e, g), f"replay, weight {i}"


@IN_THE_PARENT
@runs(KERNELS := interpreted_file(__file__, "not serial_paths_bits"))
def test_dequant_ahead_through_the_triton_interpreter() -> None:
    KERNELS.launches()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_session_with_the_option_matches_onnxruntime() -> None:
    """A MatMulNBits prompt of 200 rows through a session with the option on, run three times: from
    the second run on, the weight's chunks after the first are made ahead, and the result is
    onnxruntime's each time."""
    from onnx import TensorProto as TP

    from onnxgen.runtime import InferenceSession
    from tests.test_ops_contrib import NBITS_TOL, _close, matmul_nbits_model, ort_run

    k, n = 512, 4000
    model = matmul_nbits_model(k, n, 4, 32, TP.FLOAT16, "packed", 0, with_bias=True)
    a = np.random.default_rng(7).standard_normal((200, k)).astype(np.float16)
    expected = ort_run(model, {"A": a})[0]
    with options.override(triton_q4=True, q4_prompt="dequant", q4_dequant_ahead=True, q4_dequant_chunk_rows=1024):
        session = InferenceSession(model, device="cuda")
        (scratch,) = {node.ctx.__dict__["_q4_scratch"] for node in session.program.nodes}
        for attempt in range(3):
            before = scratch.ahead.prefetches
            actual = session.run(None, {"A": a})[0]
            assert scratch.ahead.prefetches - before == (0 if attempt == 0 else 3), attempt  # 4 chunks of <= 1,024
            _close(actual, expected, NBITS_TOL[(TP.FLOAT16, 0)] * float(np.abs(expected).max()), f"run {attempt}", 0.0)
