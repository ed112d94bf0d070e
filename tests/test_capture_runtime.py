"""The capture runtime (segments, bindings, phases, guard, verify, quarantine) against plain eager.

On CPU the ReplayRecorder stands in for CUDA graphs: it replays by re-running the recorded
steps from the same persistent bindings into the same output tensors, so everything except the
CUDA graph itself is exercised here. The oracle is the plain eager executor on an independent
session: captured decode must be bit-identical (torch.equal) in logits and KV. The `gpu` tests
repeat the main checks with CudaGraphRecorder.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from onnxgen.genai.generator import Generator
from onnxgen.genai.kv_cache import DynamicKV, StaticKV
from onnxgen.genai.package import load_package_config
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource
from onnxgen.runtime.capture.planner import CapturePlan
from onnxgen.runtime.capture.recorder import CudaGraphRecorder, ReplayRecorder
from onnxgen.runtime.capture.report import analyse
from onnxgen.runtime.capture.runtime import READY, CaptureMismatchError, CaptureRuntime
from onnxgen.runtime.session import InferenceSession
from tests.conftest import HAS_CUDA

CAPACITY = 64
STEPS = 24


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture_packages")
    config = TINY_CONFIGS["tiny-llama"]
    dirs = {a: build_package(RandomSource(config), root / a, attention=a) for a in ("gqa", "standard")}
    for d in dirs.values():
        write_word_tokenizer(d, config.vocab_size)
    return dirs


def write_word_tokenizer(directory, vocab_size: int) -> None:
    """A word-level tokenizer (w0 .. wN) so that a Generator can load a random-weights package."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"eos_token": "w2", "bos_token": "w1"}')


class Decoder:
    """Prefill + single-token decode of a package, through eager or a CaptureRuntime."""

    def __init__(self, package, kv_kind: str, device: str = "cpu", runtime_kw: dict | None = None):
        self.config = load_package_config(package)
        self.session = InferenceSession(self.config.model_file, device=device)
        self.device = self.session.device
        self.inputs = {i.name: i for i in self.session.program.inputs}
        self.kv_kind = kv_kind
        self.kv = self.new_kv()
        self.runtime: CaptureRuntime | None = None
        if runtime_kw is not None:
            pin = ("past_sequence_length", "total_sequence_length") if kv_kind == "static" else ()
            self.runtime = CaptureRuntime(self.session.program, self.session.model, pin=pin, **runtime_kw)

    def new_kv(self):
        if self.kv_kind == "static":
            return StaticKV(self.config, torch.float32, self.device, CAPACITY)
        return DynamicKV(self.config, torch.float32, self.device)

    def feeds(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        n = ids.shape[1]
        out = {"input_ids": ids, "attention_mask": self.kv.attention_mask(n), **self.kv.feeds()}
        if "position_ids" in self.inputs:
            out["position_ids"] = torch.arange(self.kv.length, self.kv.length + n, device=self.device).reshape(1, n)
        return out

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        feeds = self.feeds(ids)
        if ids.shape[1] == 1 and self.runtime is not None:
            out = self.runtime.run(feeds)
        else:
            out = self.session.run_torch(feeds)
        self.kv.update(out, ids.shape[1])
        return out["logits"].clone()  # replayed outputs are rewritten by the next replay


def prompt(device) -> torch.Tensor:
    return torch.tensor([[3, 141, 59, 26, 53]], device=device)


def decode_pair(eager: Decoder, captured: Decoder, steps: int = STEPS) -> None:
    """Greedy decode both in lock step; every step's logits and the final KV must be equal bit for bit."""
    with torch.inference_mode():
        a, b = eager.step(prompt(eager.device)), captured.step(prompt(captured.device))
        for i in range(steps):
            assert torch.equal(a, b), f"logits differ at step {i}"
            token = a[0, -1].argmax().reshape(1, 1)
            a, b = eager.step(token), captured.step(token.clone())
        assert torch.equal(a, b)
        for name, value in eager.kv.feeds().items():
            assert torch.equal(value, captured.kv.feeds()[name]), name


FLAVOURS = [("gqa", "static"), ("standard", "dynamic"), ("gqa", "dynamic")]


def expected_segments(package, kv_kind: str) -> int:
    """The planner's count for the decode step, from the same analysis `onnxgen show --capture` prints."""
    from onnxgen.runtime.model_io import load_model

    model, _ = load_model(package)
    bind = {"past_sequence_length": CAPACITY, "total_sequence_length": CAPACITY} if kv_kind == "static" else {}
    return len(analyse(model, bind).plan.segments)


@pytest.mark.parametrize(("attention", "kv_kind"), FLAVOURS)
def test_decode_bit_identical_to_eager(packages, attention: str, kv_kind: str) -> None:
    eager = Decoder(packages[attention], kv_kind)
    captured = Decoder(packages[attention], kv_kind, runtime_kw={"recorder": ReplayRecorder()})
    decode_pair(eager, captured)
    stats = captured.runtime.stats
    segments = expected_segments(packages[attention], kv_kind)
    assert stats.segments_per_step == segments
    assert (segments == 1) == (kv_kind == "static")  # GQA with a fixed capacity: the whole step
    assert stats.captures == segments  # recorded once
    assert stats.replays == segments * (STEPS - 3)  # 2 warm-up steps, 1 recording step
    assert stats.invalidations == 0 and stats.recording_failures == 0
    assert stats.captured_steps == STEPS - 2 and stats.eager_steps == 2
    (program,) = captured.runtime.keys.values()
    assert program.phase == READY
    if kv_kind == "static":  # the caller's KV buffers and mask are used in place, not copied
        adopted = {n for b in program.bindings.values() for n, x in b.items() if x.adopted}
        assert {"attention_mask", "past_key_values.0.key"} <= adopted
    else:  # attention over the growing KV stays eager, with its reason
        assert any("classifier veto" in r for r in stats.seam_reasons)


@pytest.mark.parametrize(("attention", "kv_kind"), FLAVOURS)
def test_fused_graph_captures_bit_identical(packages, attention: str, kv_kind: str, monkeypatch) -> None:
    """The graph CUDA sessions run (fusion pass applied) plans and replays like the original."""
    from onnxgen.runtime import session as session_module
    from onnxgen.runtime.fusion import fuse_graph

    monkeypatch.setattr(session_module, "fuse_for_device", lambda model, device, opts=None: fuse_graph(model))
    eager = Decoder(packages[attention], kv_kind)
    runtime_kw = {"recorder": ReplayRecorder(), "mode": "verify", "verify_steps": STEPS}
    captured = Decoder(packages[attention], kv_kind, runtime_kw=runtime_kw)
    assert captured.session.fusions.total > 0
    decode_pair(eager, captured)
    stats = captured.runtime.stats
    bind = {"past_sequence_length": CAPACITY, "total_sequence_length": CAPACITY} if kv_kind == "static" else {}
    assert stats.segments_per_step == len(analyse(captured.session.model, bind).plan.segments)
    assert (stats.segments_per_step == 1) == (kv_kind == "static")
    assert stats.verified_steps == STEPS - 2 and stats.invalidations == 0 and not stats.quarantined


def test_verify_mode_passes_and_counts(packages) -> None:
    eager = Decoder(packages["standard"], "dynamic")
    captured = Decoder(packages["standard"], "dynamic", runtime_kw={"recorder": ReplayRecorder(), "mode": "verify"})
    decode_pair(eager, captured, steps=12)
    assert captured.runtime.stats.verified_steps == 8  # the first N captured steps
    assert "verified bit-identical" in captured.runtime.stats.summary()


def force_into_segments(plan: CapturePlan, names: set[str]) -> CapturePlan:
    """A planted unsafe admission: the named nodes become capturable, segments are re-cut."""
    nodes = [dataclasses.replace(n) for n in plan.nodes]
    for n in nodes:
        n.segment = None
        if n.name in names and not (n.reason or "").startswith("quarantined"):
            n.capturable, n.kind, n.reason = True, "segment", None
    segments: list[list[int]] = []
    current = None
    for i, n in enumerate(nodes):
        if n.capturable:
            if current is None:
                current = []
                segments.append(current)
            current.append(i)
            n.segment = len(segments) - 1
        elif not n.folded:
            current = None
    return CapturePlan(nodes, segments, plan.mode, plan.growing, plan.pinned)


# reads the growing mask: its output shape [B] never changes (CUDA sessions fuse it into RowSumCast)
PLANTED = {"/model/attn_mask/ReduceSum", "/model/attn_mask/ReduceSum/RowSumCast"}


def planted_decoder(package, **kw) -> Decoder:
    decoder = Decoder(package, "dynamic", runtime_kw={"recorder": ReplayRecorder(), **kw})
    runtime = decoder.runtime
    original = runtime.plan_for
    runtime.plan_for = lambda key: (force_into_segments(original(key)[0], PLANTED), original(key)[1])
    return decoder


def test_planted_growing_admission_is_caught_by_the_binding_guard(packages) -> None:
    eager = Decoder(packages["gqa"], "dynamic")
    captured = planted_decoder(packages["gqa"])
    decode_pair(eager, captured, steps=12)  # still bit-identical: a mismatch never replays
    stats = captured.runtime.stats
    assert stats.invalidations >= 1
    assert any(r.startswith("attention_mask: shape/dtype changed") for r in stats.invalidation_reasons)
    (program,) = captured.runtime.keys.values()
    assert program.phase == "unsupported" and "keeps changing" in program.reason


def test_planted_admission_without_the_guard_is_caught_by_verify(packages) -> None:
    eager = Decoder(packages["gqa"], "dynamic")
    captured = planted_decoder(packages["gqa"], mode="verify", guard=False)
    with pytest.raises(CaptureMismatchError, match="differs from eager"):
        decode_pair(eager, captured, steps=12)


def test_plan_admitting_a_per_step_host_read_is_refused_and_quarantined(packages) -> None:
    # Range reads the (growing) KV length on the host: a recording would bake it in
    eager = Decoder(packages["standard"], "dynamic")
    captured = Decoder(packages["standard"], "dynamic", runtime_kw={"recorder": ReplayRecorder()})
    runtime = captured.runtime
    original = runtime.plan_for
    rows = "/model/attn_mask/rows"
    runtime.plan_for = lambda key: (force_into_segments(original(key)[0], {rows}), original(key)[1])
    decode_pair(eager, captured, steps=8)
    assert "reads the per-step value" in runtime.stats.quarantined["Range"]
    (program,) = runtime.keys.values()
    assert not program.plan.node(rows).capturable and program.plan.node(rows).reason.startswith("quarantined")
    assert runtime.stats.replays > 0


def test_signature_mismatch_invalidates_and_never_replays(packages) -> None:
    eager = Decoder(packages["gqa"], "static")
    captured = Decoder(packages["gqa"], "static", runtime_kw={"recorder": ReplayRecorder()})
    decode_pair(eager, captured, steps=6)
    stats = captured.runtime.stats
    replays, captures = stats.replays, stats.captures
    # the caller swaps in a different (equal-valued) KV buffer: the adopted pointer no longer matches
    name = "past_key_values.1.value"
    captured.kv.buffers[name] = captured.kv.buffers[name].clone()
    with torch.inference_mode():
        for i in range(4):
            token = eager.step(torch.tensor([[7 + i]]))
            assert torch.equal(token, captured.step(torch.tensor([[7 + i]])))
    assert stats.invalidations == 1 and stats.invalidation_reasons == {f"{name}: adopted tensor changed": 1}
    assert stats.captures == captures + 1  # re-recorded with the new buffer on the next step
    assert stats.replays == replays + 2  # not on the mismatched step, nor the recording step's own replay count
    for n, value in eager.kv.feeds().items():
        assert torch.equal(value, captured.kv.feeds()[n])


def test_recording_failure_quarantines_replans_and_completes_eagerly(packages) -> None:
    eager = Decoder(packages["gqa"], "static")
    captured = Decoder(packages["gqa"], "static", runtime_kw={"recorder": ReplayRecorder()})
    recording = {"on": False}
    broken = "Mul"

    class Recorder(ReplayRecorder):
        def record(self, fn, label):
            recording["on"] = True
            try:
                return super().record(fn, label)
            finally:
                recording["on"] = False

    captured.runtime.recorder = Recorder()
    for node in captured.session.program.nodes:
        if node.ctx.op_type == broken:
            original = node.spec.fn

            def fn(ctx, *args, _original=original):
                if recording["on"]:
                    raise RuntimeError("operation not permitted when stream is capturing")  # as CUDA says
                return _original(ctx, *args)

            node.spec = dataclasses.replace(node.spec, fn=fn)
    decode_pair(eager, captured, steps=16)
    stats = captured.runtime.stats
    assert stats.recording_failures == 1
    assert broken in stats.quarantined and "stream is capturing" in stats.quarantined[broken]
    (program,) = captured.runtime.keys.values()
    assert program.phase == READY
    quarantined = [n for n in program.plan.nodes if n.op_type == broken]
    assert quarantined and all(n.reason.startswith("quarantined") for n in quarantined)
    assert stats.segments_per_step == len(program.plan.segments) > 1  # re-planned around the op
    assert any(r.startswith("quarantined") for r in stats.seam_reasons)


@pytest.mark.parametrize(("attention", "kv"), [("gqa", "static"), ("standard", "dynamic")])
def test_generator_capture_verify_gives_the_same_tokens(packages, attention: str, kv: str) -> None:
    off = Generator(packages[attention], kv=kv)
    on = Generator(packages[attention], kv=kv, capture="verify", recorder=ReplayRecorder())
    from onnxgen.genai.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for ids in ([3, 141, 59, 26], [9, 8, 7]):  # a second generation reuses the recording
        assert list(on.generate_ids(ids, params)) == list(off.generate_ids(ids, params))
    stats = on.capture_stats
    assert stats.verified_steps > 0 and stats.replays > 0 and stats.invalidations == 0
    assert stats.captures == stats.segments_per_step  # recorded once for both generations
    assert off.capture_stats.mode == "off" and "capture off" in off.capture_stats.summary()
    text = stats.summary()
    assert f"{stats.segments_per_step} segment(s)" in text and "replay(s)" in text


def test_cli_generate_prints_capture_stats(packages, capsys) -> None:
    from onnxgen.cli import main

    assert main(["generate", "-m", str(packages["gqa"]), "-p", "w5 w6 w7", "-n", "4", "--stats"]) in (0, None)
    err = capsys.readouterr().err
    assert "capture off: every decode step ran eagerly" in err  # capture is CUDA-only: off on the CPU


def test_capture_on_cpu_without_a_recorder_is_refused(packages) -> None:
    from onnxgen.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="capture"):
        Generator(packages["gqa"], capture="on")


# -- the same on CUDA with real CUDA graphs (run on the GPU with `pytest -m gpu`) ----------------


needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("attention", "kv_kind"), FLAVOURS)
def test_gpu_cuda_graphs_bit_identical_to_eager(packages, attention: str, kv_kind: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    eager = Decoder(packages[attention], kv_kind, device="cuda")
    captured = Decoder(
        packages[attention],
        kv_kind,
        device="cuda",
        runtime_kw={"recorder": CudaGraphRecorder(device), "mode": "verify"},
    )
    decode_pair(eager, captured)
    stats = captured.runtime.stats
    assert stats.segments_per_step == expected_segments(packages[attention], kv_kind)
    assert stats.replays > 0 and stats.invalidations == 0 and stats.recording_failures == 0, stats.summary()
    assert stats.verified_steps == 8


@pytest.mark.gpu
@needs_cuda
def test_gpu_planted_admission_caught(packages) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    eager = Decoder(packages["gqa"], "dynamic", device="cuda")
    captured = Decoder(packages["gqa"], "dynamic", device="cuda", runtime_kw={"recorder": CudaGraphRecorder(device)})
    original = captured.runtime.plan_for
    captured.runtime.plan_for = lambda key: (force_into_segments(original(key)[0], PLANTED), original(key)[1])
    decode_pair(eager, captured, steps=12)
    assert captured.runtime.stats.invalidations >= 1


@pytest.mark.gpu
@needs_cuda
def test_gpu_planted_admission_without_the_guard_is_caught_by_verify(packages) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    eager = Decoder(packages["gqa"], "dynamic", device="cuda")
    runtime_kw = {"recorder": CudaGraphRecorder(device), "mode": "verify", "guard": False}
    captured = Decoder(packages["gqa"], "dynamic", device="cuda", runtime_kw=runtime_kw)
    original = captured.runtime.plan_for
    captured.runtime.plan_for = lambda key: (force_into_segments(original(key)[0], PLANTED), original(key)[1])
    with pytest.raises(CaptureMismatchError, match="differs from eager"):
        decode_pair(eager, captured, steps=12)


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_syncing_kernel_breaks_the_recording_and_is_quarantined(packages) -> None:
    """A kernel that reads a device value on the host (here: every attention op calls .item()) cannot
    be recorded: CUDA refuses the sync during stream capture. The recording aborts, the op type is
    quarantined, the step is re-planned around it and the decode goes on, bit-identical to eager."""
    # present in the graph CUDA sessions run, fused or not (the norms move into the GEMM groups)
    broken = "GroupQueryAttention"
    device = torch.device("cuda", torch.cuda.current_device())
    eager = Decoder(packages["gqa"], "static", device="cuda")
    captured = Decoder(packages["gqa"], "static", device="cuda", runtime_kw={"recorder": CudaGraphRecorder(device)})
    patched = 0
    for node in captured.session.program.nodes:
        if node.ctx.op_type == broken:
            original = node.spec.fn

            def fn(ctx, *args, _original=original):
                out = _original(ctx, *args)
                first = out[0] if isinstance(out, tuple) else out
                first.reshape(-1)[0].item()  # a host read of device data: legal eagerly, not while capturing
                return out

            node.spec = dataclasses.replace(node.spec, fn=fn)
            patched += 1
    assert patched
    decode_pair(eager, captured, steps=16)
    stats = captured.runtime.stats
    assert stats.recording_failures == 1 and broken in stats.quarantined, stats.summary()
    (program,) = captured.runtime.keys.values()
    assert program.phase == READY and stats.segments_per_step > 1 and stats.replays > 0, stats.summary()


@pytest.mark.gpu
@needs_cuda
def test_gpu_generator_capture_on_matches_off(packages) -> None:
    from onnxgen.genai.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    for attention, kv in (("gqa", "static"), ("standard", "dynamic")):
        off = Generator(packages[attention], device="cuda", kv=kv, capture="off")
        on = Generator(packages[attention], device="cuda", kv=kv, capture="verify")
        ids = [3, 141, 59, 26]
        assert list(on.generate_ids(ids, params)) == list(off.generate_ids(ids, params))
        assert on.capture_stats.replays > 0, on.capture_stats.summary()


def test_host_arithmetic_over_constants_leaves_the_segment(tmp_path) -> None:
    """On CUDA the executor runs small int arithmetic on the host; inside a segment its result would
    need a host-to-device copy during capture. Simulated here by marking the step host-placed."""
    import numpy as np
    from onnx import TensorProto, helper

    from tests.conftest import make_model, ort_run

    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "one"], ["g"], name="gather"),
        helper.make_node("Cast", ["g"], ["f"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "f"], ["y"], name="mul"),
        helper.make_node("Add", ["y", "x"], ["z"], name="add"),
        helper.make_node("Mul", ["z", "z"], ["w"], name="square"),
    ]
    model = make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("w", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor("one", TensorProto.INT64, [], [1])],
    )
    session = InferenceSession(model)
    cast = next(s for s in session.program.nodes if s.ctx.name == "cast")
    cast.on_host = True  # what the executor decides on CUDA: its input is host shape data
    runtime = CaptureRuntime(session.program, model, recorder=ReplayRecorder())
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    (want,) = ort_run(model, {"x": x})
    for _ in range(5):
        got = runtime.run({"x": torch.from_numpy(x)})["w"]
        assert torch.equal(got, torch.from_numpy(want))
    (program,) = runtime.keys.values()
    (segment,) = program.schedule.segments
    assert [s.ctx.name for s in segment.nodes] == ["mul", "add", "square"]
    assert "f" in program.schedule.static_outputs and runtime.stats.replays == 2


def test_every_unit_of_a_captured_step_ends_with_the_programs_joins(packages) -> None:
    """GraphProgram.unit_joins (where option q4_dequant_ahead's side stream is joined) run after
    every unit of a step: once per warm-up step (the whole program), once per unit of the schedule
    while recording (twice per segment) and replaying (ReplayRecorder re-runs a segment's nodes; a
    CUDA graph holds the join it recorded), and never between two nodes of a unit."""
    captured = Decoder(packages["standard"], "dynamic", runtime_kw={"recorder": ReplayRecorder()})
    program = captured.session.program
    events: list[str] = []
    program.unit_joins.append(lambda: events.append("join"))
    for node in program.nodes:

        def fn(ctx, *args, _original=node.spec.fn, _name=node.ctx.name):
            events.append(_name)
            return _original(ctx, *args)

        node.spec = dataclasses.replace(node.spec, fn=fn)
    with torch.inference_mode():
        logits = captured.step(prompt(captured.device))
        per_step = []
        for _ in range(5):
            events.clear()
            logits = captured.step(logits[0, -1].argmax().reshape(1, 1))
            per_step.append(list(events))
    (runtime_program,) = captured.runtime.keys.values()
    units = runtime_program.schedule.units
    assert len(units) > 1
    segments = sum(unit.kind == "segment" for unit in units)
    # the recording step runs each segment twice (recorded, then replayed to commit the step)
    assert [e.count("join") for e in per_step] == [1, 1, len(units) + segments, len(units), len(units)]
    last_nodes = {unit.nodes[-1].ctx.name for unit in units}
    assert all(per_step[2][i - 1] in last_nodes for i, e in enumerate(per_step[2]) if e == "join")
    for events in per_step[3:]:  # each unit's nodes, then a join
        expected = []
        for unit in units:
            expected += [n.ctx.name for n in unit.nodes] + ["join"]
        assert events == expected
