"""The decode engine's own contract, on the CPU: token ids in, token ids out (no tokenizer), one
sequence per call with a clear refusal of batches, the same tokens on every loop form, and the
tokens of onnxruntime-genai on the same package (the oracle)."""

from __future__ import annotations

from pathlib import Path

import pytest

from onnxgen.errors import InvalidInputError
from onnxgen.genai.engine import BatchNotSupportedError, DecodeEngine, PromptTooLongError
from onnxgen.genai.package import load_package_config
from onnxgen.genai.sampling import SamplingParams
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource
from onnxgen.runtime import InferenceSession
from onnxgen.runtime.capture.recorder import ReplayRecorder

PROMPT = [3, 141, 59, 26]
GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    """A tiny random-weights GQA package without tokenizer files: the engine needs none."""
    return build_package(RandomSource(TINY_CONFIGS["tiny-llama"]), tmp_path_factory.mktemp("engine") / "gqa")


@pytest.fixture(scope="module")
def session(package) -> InferenceSession:
    return InferenceSession(load_package_config(package).model_file)


def engine_of(package: Path, session: InferenceSession, **kw) -> DecodeEngine:
    return DecodeEngine(session, load_package_config(package), **kw)


def decode(engine: DecodeEngine, prompt: list[int], params: SamplingParams, stop_ids=()) -> list[int]:
    sequence = engine.new_sequence(prompt, params, stop_ids)
    tokens = list(engine.generate([sequence]))
    assert sequence.done and sequence.generated == tokens
    return tokens


def test_ids_in_ids_out(package, session) -> None:
    engine = engine_of(package, session, kv="dynamic")
    sequence = engine.new_sequence(PROMPT, GREEDY)
    tokens = list(engine.generate([sequence]))
    vocab = engine.config.vocab_size
    assert len(tokens) == 16 and all(isinstance(t, int) and 0 <= t < vocab for t in tokens)
    assert sequence.done and sequence.generated == tokens and sequence.stats.stop_reason == "length"
    assert sequence.stats.new_tokens == 16 and sequence.stats.prompt_tokens == len(PROMPT)
    assert sequence.kv is not None and sequence.kv.length == len(PROMPT) + 15  # the last token is not fed


def test_a_batch_of_more_than_one_sequence_is_refused(package, session) -> None:
    engine = engine_of(package, session, kv="static")
    pair = [engine.new_sequence(PROMPT, GREEDY), engine.new_sequence([5, 6], GREEDY)]
    for call in (engine.generate, engine.prefill, engine.step):
        with pytest.raises(BatchNotSupportedError, match="one sequence at a time so far; got a batch of 2"):
            list(call(pair) or [])
    with pytest.raises(BatchNotSupportedError, match="batch of 0"):
        engine.prefill([])
    assert issubclass(BatchNotSupportedError, InvalidInputError)
    assert decode(engine, PROMPT, GREEDY) == decode(engine_of(package, session, kv="dynamic"), PROMPT, GREEDY)


@pytest.mark.parametrize(
    "ids, words",
    [
        ([3, 10**6], ["token id 1000000 at index 1 is outside the vocabulary [0, "]),
        ([3, 2.5], ["2.5", "float"]),
        ([], ["empty"]),
    ],
)
def test_prompt_ids_are_checked_where_they_enter_the_engine(package, session, ids, words) -> None:
    """The engine is the ids-in entry for every driver (the Generator, the benches, a scheduler):
    a sequence is only made of ids in range, so the decode loop needs no bound checks."""
    engine = engine_of(package, session, kv="dynamic")
    with pytest.raises(InvalidInputError) as info:
        engine.new_sequence(ids, GREEDY)
    for word in words:
        assert word in str(info.value)
    too_long = [1] * engine.config.context_length
    with pytest.raises(PromptTooLongError, match="context holds"):
        engine.new_sequence(too_long, GREEDY)


def test_every_loop_form_gives_the_same_tokens(package, session) -> None:
    """Dynamic and static KV, eager and captured (the ReplayRecorder standing in for CUDA graphs),
    sequential and pipelined, greedy's tail in the graph or not: one set of tokens, and a sampled
    generation with penalties the same between the loop forms too."""
    sampled = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, repetition_penalty=1.2, seed=3,
                             ignore_eos=True)  # fmt: skip
    forms = [
        dict(kv="dynamic"),
        dict(kv="static"),
        dict(kv="static", capture="on", recorder=ReplayRecorder(), pipeline=False),
        dict(kv="static", capture="on", recorder=ReplayRecorder(), pipeline=True),
        dict(kv="static", capture="on", recorder=ReplayRecorder(), pipeline=True, sample_in_graph=False),
        dict(kv="static", capture="on", recorder=ReplayRecorder(), pipeline=True, host_tokens=False),
        dict(kv="static", capture="on", recorder=ReplayRecorder(), kv_capacity=64),
    ]
    results = set()
    for form in forms:
        engine = engine_of(package, session, **form)
        results.add((tuple(decode(engine, PROMPT, GREEDY)), tuple(decode(engine, PROMPT, sampled))))
        assert decode(engine, [9, 8, 7], GREEDY) == decode(engine_of(package, session), [9, 8, 7], GREEDY), form
    assert len(results) == 1


def test_stop_ids_and_limits(package, session) -> None:
    engine = engine_of(package, session, kv="static", capture="on", recorder=ReplayRecorder(), pipeline=True)
    tokens = decode(engine, PROMPT, GREEDY)
    stop = tokens[3]
    first = tokens.index(stop)
    sequence = engine.new_sequence(PROMPT, SamplingParams(max_new_tokens=16), stop_ids={stop})
    assert list(engine.generate([sequence])) == tokens[:first]  # the stop id is counted, not handed out
    assert sequence.stats.stop_reason == "eos" and sequence.stats.new_tokens == first + 1
    ignored = engine.new_sequence(PROMPT, GREEDY, stop_ids={stop})  # ignore_eos: the stop ids do not apply
    assert list(engine.generate([ignored])) == tokens
    context = engine.config.context_length
    full = engine.new_sequence(list(range(3, context - 2)), SamplingParams(ignore_eos=True))
    assert len(list(engine.generate([full]))) == 5 and full.stats.stop_reason == "context full"


def test_prefill_then_steps_by_hand(package, session) -> None:
    """prefill() and step() are the loop's parts: driven by hand they make generate()'s tokens."""
    import torch

    engine = engine_of(package, session, kv="static", capture="on", recorder=ReplayRecorder())
    want = decode(engine, PROMPT, GREEDY)
    sequence = engine.new_sequence(PROMPT, GREEDY)
    engine.prefill([sequence])
    got = [int(sequence.token)]
    with torch.inference_mode():
        for _ in range(15):
            engine.step([sequence])
            got.append(int(sequence.token))
    assert got == want and sequence.tail is not None


def test_greedy_tokens_match_onnxruntime_genai(package, session) -> None:
    og = pytest.importorskip("onnxruntime_genai")
    config = load_package_config(package)
    model = og.Model(str(package))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(PROMPT) + 16)
    generator = og.Generator(model, params)
    generator.append_tokens(PROMPT)
    expected: list[int] = []
    while not generator.is_done():
        generator.generate_next_token()
        expected.append(int(generator.get_next_tokens()[0]))
    eos = set(config.eos_token_ids)
    if expected and expected[-1] in eos:
        expected = expected[:-1]  # onnxruntime-genai returns the EOS token, the engine stops before it
    for kv in ("dynamic", "static"):
        engine = engine_of(package, session, kv=kv)
        assert decode(engine, PROMPT, SamplingParams(max_new_tokens=16), eos) == expected, kv
