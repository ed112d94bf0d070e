"""The pipelined (one-step lookahead) decode loop against the sequential one, on the CPU.

The Generator enqueues decode step N+1 before it waits for token N when it runs on CUDA with static
KV and capture on; ``pipeline=True`` forces that loop on the CPU (with the ReplayRecorder standing
in for CUDA graphs), where the pending host read is a plain ``.item()``. Everything the consumer
sees must be the same as with ``pipeline=False``: tokens, stop reasons, token counts, and the next
generation after an EOS, an early break or an error. Also here: the cheaper per-step host work of
the captured step (the feed-check memo, the binding key, the one-tuple replay guard) against the
checks it replaces, and the bench loop's pipelined mode.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from onnxgen.errors import InvalidInputError
from onnxgen.genai import engine as engine_module
from onnxgen.genai.generator import Generator
from onnxgen.genai.host_read import CpuHostRead
from onnxgen.genai.sampling import SamplingParams
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource
from onnxgen.runtime.capture.bindings import Binding, Guard
from onnxgen.runtime.capture.recorder import ReplayRecorder
from onnxgen.runtime.capture.runtime import CaptureRuntime
from tests.conftest import HAS_CUDA
from tests.test_capture_runtime import write_word_tokenizer

PROMPT = [3, 141, 59, 26]
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(
    max_new_tokens=24,
    temperature=0.9,
    top_k=40,
    top_p=0.95,
    repetition_penalty=1.3,
    frequency_penalty=0.4,
    presence_penalty=0.3,
    seed=7,
    ignore_eos=True,
)


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    config = TINY_CONFIGS["tiny-llama"]
    directory = build_package(RandomSource(config), tmp_path_factory.mktemp("pipelined") / "gqa", attention="gqa")
    write_word_tokenizer(directory, config.vocab_size)
    return directory


def make(package: Path, pipeline: bool, capture: str = "on", **kw) -> Generator:
    recorder = ReplayRecorder() if capture != "off" else None
    generator = Generator(package, kv="static", capture=capture, recorder=recorder, pipeline=pipeline, **kw)
    assert generator.pipelined == pipeline
    return generator


def run(generator: Generator, params: SamplingParams, prompt: list[int] = PROMPT) -> tuple[list[int], str, int]:
    tokens = list(generator.generate_ids(prompt, params))
    stats = generator.last_stats
    return tokens, stats.stop_reason, stats.new_tokens


def decode_steps(generator: Generator, params: SamplingParams, prompt: list[int] = PROMPT) -> int:
    """How many decode steps a generation ran (the capture runtime counts them)."""
    before = generator.capture_stats.steps
    run(generator, params, prompt)
    return generator.capture_stats.steps - before


def with_(params: SamplingParams, **kw) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, **kw)


@pytest.fixture(scope="module")
def pair(package) -> tuple[Generator, Generator]:
    """(sequential, pipelined), both captured through the ReplayRecorder: recordings are reused
    across the tests, as across a server's generations."""
    return make(package, False), make(package, True)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled-penalties"])
@pytest.mark.parametrize("max_new", [1, 2, 3, 24])
def test_same_tokens_stop_reasons_and_counts(pair, params: SamplingParams, max_new: int) -> None:
    sequential, pipelined = pair
    params = with_(params, max_new_tokens=max_new)
    want = run(sequential, params)
    assert want[1] == "length" and want[2] == max_new and len(want[0]) == max_new
    assert run(pipelined, params) == want
    stats = pipelined.last_stats
    assert stats.ttft_s > 0 and (stats.decode_s > 0) == (max_new > 1)
    # no lookahead past the last token: a length stop runs the same decode steps
    assert decode_steps(pipelined, params) == decode_steps(sequential, params) == max_new - 1
    assert pipelined.capture_stats.invalidations == 0


def test_matches_eager_without_capture(package, pair) -> None:
    """The captured pipelined loop gives the plain eager tokens, and pipeline=True also runs eagerly."""
    eager = make(package, False, capture="off")
    eager_pipelined = make(package, True, capture="off")
    for params in (GREEDY, SAMPLED):
        want = run(eager, params)
        assert run(pair[1], params) == want
        assert run(eager_pipelined, params) == want


def greedy_reference(generator: Generator, max_new: int = 24) -> list[int]:
    return run(generator, with_(GREEDY, max_new_tokens=max_new))[0]


def eos_at(tokens: list[int], position: int) -> int:
    """A token id whose first occurrence is at ``position``: greedy stops there when it is the EOS."""
    token = tokens[position]
    assert token not in tokens[:position], "pick another position: the token occurs earlier"
    return token


@pytest.mark.parametrize("position", [0, 1, 5, 11])  # EOS as the first token, the second, mid-way, the last
def test_eos_mid_way(package, position: int) -> None:
    max_new = 12
    sequential, pipelined = make(package, False), make(package, True)
    tokens = greedy_reference(sequential, max_new)
    eos = eos_at(tokens, position)
    for params in (with_(GREEDY, max_new_tokens=max_new, ignore_eos=False), with_(GREEDY, max_new_tokens=max_new)):
        for g in (sequential, pipelined):
            g.eos_ids = {eos}
        want = run(sequential, params)
        if params.ignore_eos:
            assert want == (tokens, "length", max_new)
        else:
            assert want == (tokens[:position], "eos", position + 1)  # the EOS is counted, not yielded
        assert run(pipelined, params) == want
    # the lookahead step dropped at the EOS wrote past the generation's end: the next one is unaffected
    other = [9, 8, 7]
    assert run(pipelined, GREEDY, other) == run(sequential, GREEDY, other)


def test_sampled_eos_mid_way(package) -> None:
    sequential, pipelined = make(package, False), make(package, True)
    tokens = run(sequential, SAMPLED)[0]
    eos = eos_at(tokens, 6)
    for g in (sequential, pipelined):
        g.eos_ids = {eos}
    params = with_(SAMPLED, ignore_eos=False)
    want = run(sequential, params)
    assert want == (tokens[:6], "eos", 7)
    assert run(pipelined, params) == want


def test_context_full(pair) -> None:
    sequential, pipelined = pair
    context = sequential.config.context_length
    prompt = [(7 * i) % 500 + 3 for i in range(context - 5)]
    params = SamplingParams(ignore_eos=True)  # no max_new_tokens: what the context has room for
    want = run(sequential, params, prompt)
    assert want[1] == "context full" and want[2] == 5
    assert run(pipelined, params, prompt) == want
    assert decode_steps(pipelined, params, prompt) == decode_steps(sequential, params, prompt) == 4


def test_early_break_leaves_the_next_generation_intact(pair) -> None:
    sequential, pipelined = pair
    want = run(sequential, GREEDY)
    for stop_after in (1, 2, 5):
        it = pipelined.generate_ids(PROMPT, GREEDY)
        got = [next(it) for _ in range(stop_after)]
        assert got == want[0][:stop_after]
        if stop_after == 2:
            del it  # abandoned, never closed explicitly
        else:
            it.close()
        assert run(pipelined, GREEDY) == want
    assert run(pipelined, GREEDY, [9, 8, 7]) == run(sequential, GREEDY, [9, 8, 7])


def test_stop_strings(pair) -> None:
    sequential, pipelined = pair
    tokens = run(sequential, GREEDY)[0]
    stop = sequential.tokenizer.decode([tokens[4]]).strip()
    params = with_(GREEDY, stop=[stop])
    want = sequential.generate(PROMPT, params)
    assert sequential.last_stats.stop_reason == "stop string"
    assert pipelined.generate(PROMPT, params) == want
    assert pipelined.last_stats.stop_reason == "stop string"
    assert run(pipelined, GREEDY) == run(sequential, GREEDY)


class LoggingRead(CpuHostRead):
    log: list[str] = []

    def start(self, token: torch.Tensor, at: int | None = None) -> None:
        self.log.append("start")
        super().start(token, at)

    def wait(self) -> int:
        self.log.append("wait")
        return super().wait()


def test_step_n_plus_1_is_enqueued_before_token_n_is_read(package, monkeypatch) -> None:
    """The order that makes the overlap: start read N, enqueue step N+1, wait N (from the second
    token on; the first is read before its step, so TTFT is prefill + first read); and never a step
    past max_new_tokens."""
    log: list[str] = []
    LoggingRead.log = log
    monkeypatch.setattr(engine_module, "host_read", lambda device, host_tokens=None: LoggingRead())
    pipelined = make(package, True)
    original = pipelined.engine._forward

    def step(sequence, ids, tail=None, **kw):
        log.append("prefill" if ids.shape[1] > 1 else "step")
        return original(sequence, ids, tail, **kw)

    pipelined.engine._forward = step  # type: ignore[method-assign]
    tokens = list(pipelined.generate_ids(PROMPT, with_(GREEDY, max_new_tokens=4)))
    assert len(tokens) == 4
    assert log == ["prefill", "start", "wait", "step"] + ["start", "step", "wait"] * 2 + ["start", "wait"]
    log.clear()
    assert len(list(pipelined.generate_ids(PROMPT, with_(GREEDY, max_new_tokens=1)))) == 1
    assert log == ["prefill", "start", "wait"]


def test_lookahead_runs_one_step_more_on_eos(package) -> None:
    """Proof that the lookahead is real: at an EOS the pipelined loop has enqueued one step more."""
    sequential, pipelined = make(package, False), make(package, True)
    tokens = greedy_reference(sequential)
    eos = eos_at(tokens, 5)
    counts = {}
    for name, g in (("sequential", sequential), ("pipelined", pipelined)):
        g.eos_ids = {eos}
        counts[name] = decode_steps(g, with_(GREEDY, ignore_eos=False))
    assert counts == {"sequential": 5, "pipelined": 6}


def test_a_failing_step_raises_after_the_same_tokens(package) -> None:
    """An error while enqueuing step N+1 surfaces where the sequential loop raises it: after token N."""

    def failing(generator: Generator, at: int) -> Generator:
        original, calls = generator.engine._forward, {"n": 0}

        def step(sequence, ids, tail=None, **kw):
            if ids.shape[1] == 1:
                calls["n"] += 1
                if calls["n"] == at:
                    raise RuntimeError("boom")
            return original(sequence, ids, tail, **kw)

        generator.engine._forward = step  # type: ignore[method-assign]
        return generator

    for at in (1, 2, 4):
        results = []
        for pipeline in (False, True):
            generator = failing(make(package, pipeline), at)
            got: list[int] = []
            with pytest.raises(RuntimeError, match="boom"):
                for token in generator.generate_ids(PROMPT, GREEDY):
                    got.append(token)
            results.append(got)
        assert results[0] == results[1] and len(results[0]) == at


def test_pipeline_argument(package) -> None:
    assert not Generator(package, kv="static").pipelined  # auto: CUDA only
    assert not Generator(package, kv="static", capture="on", recorder=ReplayRecorder()).pipelined
    assert Generator(package, kv="static", pipeline="on").pipelined
    assert not Generator(package, kv="dynamic", pipeline="off").pipelined
    with pytest.raises(InvalidInputError, match="pipeline must be 'auto', 'on' or 'off'"):
        Generator(package, kv="static", pipeline="yes")
    with pytest.raises(InvalidInputError, match="pipeline must be"):
        Generator(package, kv="static", pipeline=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="needs static KV"):
        Generator(package, kv="dynamic", pipeline=True)


# -- the cheaper host work per captured step -----------------------------------------------------------


def decode_feeds(generator: Generator) -> dict[str, torch.Tensor]:
    kv = generator.engine._new_kv(16)
    io = generator.config.io
    feeds = {io.input_ids: torch.tensor([[5]]), io.attention_mask: kv.attention_mask(1), **kv.feeds()}
    if generator.engine.logits_row is not None:  # engine_model's row input
        feeds[generator.engine.logits_row] = generator.engine._row_feed(0, 1)
    return feeds


def test_feed_check_memo_never_skips_a_different_layout(package) -> None:
    generator = make(package, False)
    session = generator.session
    feeds = decode_feeds(generator)
    assert session.check_feeds_repeated(feeds).keys() == feeds.keys()
    assert session.check_feeds_repeated(feeds) is feeds  # the same layout: passed through unchecked
    name = generator.config.past_key_name(1)
    bad = [
        {**feeds, name: feeds[name][:, :, :-1]},  # capacity differs from the other layers
        {**feeds, name: feeds[name].half()},
        {**feeds, "input_ids": torch.tensor([[5.0]])},
        {**feeds, "input_ids": torch.tensor([5])},
        {k: v for k, v in feeds.items() if k != name},
        {**feeds, "bogus": torch.zeros(1)},
    ]
    for wrong in bad:
        with pytest.raises(InvalidInputError):
            session._check_feeds(wrong)
        with pytest.raises(InvalidInputError):
            session.check_feeds_repeated(wrong)
    assert session.check_feeds_repeated({**feeds, "input_ids": torch.tensor([[9]])}) is not feeds


def old_key_of(runtime: CaptureRuntime, feeds) -> tuple:
    """CaptureRuntime.key_of as it was before its axes were precomputed."""
    bind = {}
    for vi in runtime.inputs:
        value = feeds.get(vi.name)
        if not isinstance(value, torch.Tensor) or vi.shape is None or value.dim() != len(vi.shape):
            continue
        for axis, d in enumerate(vi.shape):
            if isinstance(d, str) and d and d not in runtime.free:
                bind[d] = int(value.shape[axis])
    return tuple(sorted(bind.items()))


def test_key_of_unchanged(package) -> None:
    generator = make(package, False)
    feeds = decode_feeds(generator)
    runtime = generator.engine.capture_runtime()
    name = generator.config.past_key_name(2)
    variants = [
        feeds,
        {**feeds, "input_ids": torch.tensor([[5, 6, 7]])},
        {**feeds, name: feeds[name][:1, :, :3]},  # inconsistent: the later input wins in both
        {**feeds, name: feeds[name][0]},  # wrong rank: skipped in both
        {k: v for k, v in feeds.items() if k != "input_ids"},
        {**feeds, "input_ids": [[5]]},
    ]
    for f in variants:
        assert runtime.key_of(f) == old_key_of(runtime, f)


def old_mismatch(bindings: dict[str, Binding], values: list) -> str | None:
    for (_, binding), value in zip(bindings.items(), values):
        why = binding.mismatch(value)
        if why is not None:
            return why
    return None


def test_guard_is_the_per_binding_check() -> None:
    kv = torch.zeros(1, 2, 8, 4)
    ids = torch.zeros(1, 1, dtype=torch.int64)
    bindings = {"kv": Binding.adopt("kv", kv), "ids": Binding.own("ids", ids, torch.device("cpu"))}
    guard = Guard(bindings)
    resized = torch.zeros(1, 2, 8, 4)
    resized.resize_(1, 2, 4, 8)
    variants = [
        [kv, ids],
        [kv, torch.ones(1, 1, dtype=torch.int64)],  # owned: another tensor of the same shape is fine
        [kv.clone(), ids],  # adopted: another pointer
        [kv.transpose(2, 3).contiguous().transpose(2, 3), ids],  # same shape, other strides and pointer
        [kv.view(1, 2, 4, 8), ids],  # same pointer, other shape
        [kv, ids.int()],
        [kv, torch.zeros(1, 2, dtype=torch.int64)],
        [kv, [[0]]],
        [None, ids],
        [torch.nn.Parameter(kv, requires_grad=False), ids],  # a subclass: the slow path decides
        [resized, ids],
    ]
    for values in variants:
        assert guard.mismatch(values) == old_mismatch(bindings, values)
    assert guard.mismatch([kv, ids]) is None and guard.mismatch([kv.clone(), ids]) is not None
    kv.resize_(1, 2, 4, 8)  # the same tensor object, changed in place
    assert guard.mismatch([kv, ids]) is not None


# -- the bench loop ---------------------------------------------------------------------------------


def test_bench_greedy_loop_pipelined_matches_sequential(package) -> None:
    """The benches' greedy runs (the decode engine, random_package.greedy_run): pipelined or not, the
    tail in the graph or outside, pinned or copied host tokens, the tokens of eager decoding."""
    from bench.random_package import greedy_run, make_engine, open_package

    results = {}
    for no_pipeline, tail, host_tokens in ((True, "graph", "pinned"), (False, "graph", "pinned"),
                                           (False, "outside", "pinned"), (False, "graph", "copy")):  # fmt: skip
        args = argparse.Namespace(
            package_dir=package, device="cpu", kv="static", context=64, prompt_tokens=5, new_tokens=12,
            no_pipeline=no_pipeline, tail=tail, host_tokens=host_tokens,
        )  # fmt: skip
        session, config = open_package(args)
        engine = make_engine(session, config, args, capture="on", recorder=ReplayRecorder())
        assert engine.pipelined == (not no_pipeline) and not make_engine(session, config, args).pipelined
        assert engine.sample_in_graph == (tail == "graph") and engine.host_tokens == (host_tokens == "pinned")
        out = []
        for n in (1, 2, 3, 12):
            ttft, decode_s, tokens = greedy_run(engine, args, new_tokens=n)
            assert len(tokens) == n and ttft > 0 and decode_s >= 0
            out.append(tokens)
        results[no_pipeline, tail, host_tokens] = out
        stats = engine.capture_stats
        assert stats.replays > 0
        assert stats.steps == 0 + 1 + 2 + 11  # n - 1 decode steps per run: none past the last token
        assert stats.tail == ("in the graph" if tail == "graph" else "")
        eager = make_engine(session, config, args)  # the oracle: eager steps, the sampler's argmax
        assert out == [greedy_run(eager, args, new_tokens=n).tokens for n in (1, 2, 3, 12)], (no_pipeline, tail)
    assert len({str(v) for v in results.values()}) == 1


def test_bench_variant_names_map_to_engine_switches() -> None:
    """``--variant name:ONNXGEN_SAMPLE_IN_GRAPH=0`` (step_sweep.py, step_anatomy.py) still works: the two
    names are the engine's arguments now, over --tail / --host-tokens."""
    from bench.random_package import engine_switches

    args = argparse.Namespace(tail="graph", host_tokens="pinned")
    assert engine_switches(args) == {"sample_in_graph": True, "host_tokens": True}
    assert engine_switches(args, {"ONNXGEN_SAMPLE_IN_GRAPH": "0"}) == {"sample_in_graph": False, "host_tokens": True}
    assert engine_switches(args, {"ONNXGEN_HOST_TOKENS": "0", "ONNXGEN_PDL": "0"}) == {
        "sample_in_graph": True,
        "host_tokens": False,
    }
    copied = argparse.Namespace(tail="outside", host_tokens="copy")
    assert engine_switches(copied) == {"sample_in_graph": False, "host_tokens": False}
    assert engine_switches(copied, {"ONNXGEN_SAMPLE_IN_GRAPH": "1"})["sample_in_graph"]


def test_step_anatomy_steps_replay_the_engines_recording(package) -> None:
    """bench/step_anatomy.py times the engine's own step on a rewound sequence: the steps replay the
    recording the greedy runs made (no invalidation), a rewind starts them over, and the tail in the
    graph or outside makes the same tokens."""
    from bench.random_package import greedy_run, make_engine, open_package
    from bench.step_anatomy import rewind, timed_sequence

    runs = []
    for tail in ("graph", "outside"):
        args = argparse.Namespace(
            package_dir=package, device="cpu", kv="static", context=64, prompt_tokens=5, new_tokens=12,
            no_pipeline=False, tail=tail, host_tokens="pinned",
        )  # fmt: skip
        session, config = open_package(args)
        engine = make_engine(session, config, args, capture="on", recorder=ReplayRecorder())
        greedy_run(engine, args)  # warm-up and recording
        sequence = timed_sequence(engine, args)
        with torch.inference_mode():
            for _ in range(2):
                kv = rewind(engine, sequence)
                before = engine.capture_stats.replays
                tokens = []
                for _ in range(6):
                    engine.step([sequence])
                    tokens.append(int(sequence.token))
                assert kv.length == 5 + 6 and engine.capture_stats.replays == before + 6
                runs.append(tokens)
        assert engine.capture_stats.invalidations == 0
        assert (sequence.tail is not None) == (tail == "graph")
    assert all(r == runs[0] for r in runs)


# -- CUDA (pytest -m gpu) -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_pipelined_matches_sequential(package) -> None:
    auto = Generator(package, device="cuda", kv="static")
    assert auto.pipelined and auto.capture == "on"
    sequential = Generator(package, device="cuda", kv="static", pipeline=False)
    for params in (GREEDY, SAMPLED, with_(GREEDY, max_new_tokens=1), with_(GREEDY, max_new_tokens=2)):
        assert run(auto, params) == run(sequential, params)
    tokens = greedy_reference(sequential)
    for g in (auto, sequential):
        g.eos_ids = {eos_at(tokens, 5)}
    params = with_(GREEDY, ignore_eos=False)
    assert run(auto, params) == run(sequential, params) == (tokens[:5], "eos", 6)
    it = auto.generate_ids(PROMPT, GREEDY)
    next(it)
    it.close()
    assert run(auto, GREEDY) == run(sequential, GREEDY)
    assert auto.capture_stats.replays > 0 and auto.capture_stats.invalidations == 0


@pytest.mark.parametrize("pipeline", [False, True])
def test_decode_feeds_ids_and_positions_in_place(package, pipeline: bool) -> None:
    """A captured one-token step is fed the same token-ids and positions tensors every step, and the
    sampler writes the next token into the ids: the recording uses both in place (adopted bindings,
    nothing copied in before a replay), and the tokens stay those of the eager loop."""
    eager = make(package, False, capture="off")
    generator = make(package, pipeline)
    for params in (GREEDY, SAMPLED):
        assert run(generator, params) == run(eager, params)
    io = generator.config.io
    # greedy's recordings hold its step tail, the sampled run's the sampling one: one program each
    programs = list(generator.engine.capture_runtime().keys.values())
    assert sorted(type(p.tail).__name__ for p in programs) == ["GreedyTail", "SampledTail"]
    for captured in programs:
        bindings = {name: b for per_segment in captured.bindings.values() for name, b in per_segment.items()}
        for name in (io.input_ids, io.attention_mask, *([io.position_ids] if generator.has_positions else [])):
            assert bindings[name].adopted, name
    assert generator.capture_stats.invalidations == 0
