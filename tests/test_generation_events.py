"""Generator.events: one event per new token, then one final event; what the HTTP server streams.

The event structure runs on a tiny random-weights package with a word tokenizer (token ``w<i>`` is
id i, so texts are known without a model); text with real stop strings and chat messages on the
real SmolLM2 package (tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest

from onnxgen.errors import InvalidInputError
from onnxgen.genai.events import GenerationEvent
from onnxgen.genai.generator import Generator
from onnxgen.genai.sampling import SamplingError, SamplingParams
from onnxgen.genai.sequence import Sequence
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource
from onnxgen.runtime.capture.recorder import ReplayRecorder
from tests.conftest import onnxruntime_prompt_logits
from tests.test_capture_runtime import write_word_tokenizer

PROMPT = [3, 141, 59, 26]
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def with_(params: SamplingParams, **kw) -> SamplingParams:
    return dataclasses.replace(params, **kw)


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    config = TINY_CONFIGS["tiny-llama"]
    directory = build_package(RandomSource(config), tmp_path_factory.mktemp("events") / "gqa", attention="gqa")
    write_word_tokenizer(directory, config.vocab_size)
    return directory


@pytest.fixture(scope="module")
def generator(package) -> Generator:
    return Generator(package, kv="dynamic")


@pytest.fixture(scope="module")
def smollm2(smollm2_packages) -> Generator:
    return Generator(smollm2_packages["int4-gqa"])


def split(events: list[GenerationEvent]) -> tuple[list[GenerationEvent], GenerationEvent]:
    """(the token events, the final event), checking the shape every event stream has."""
    *tokens, final = events
    assert all(e.token_id is not None and e.finish_reason is None for e in tokens)
    assert final.token_id is None and final.finish_reason in ("stop", "length") and final.logprob is None
    return tokens, final


def test_one_event_per_token_then_one_final_event(generator) -> None:
    want = list(generator.generate_ids(PROMPT, GREEDY))
    tokens, final = split(list(generator.events(PROMPT, GREEDY)))
    assert [e.token_id for e in tokens] == want
    assert final.finish_reason == "length" and final.text == ""
    # the word tokenizer decodes "w<i>" joined by spaces: every token releases its text at once
    assert "".join(e.text for e in tokens) == " ".join(f"w{t}" for t in want).lstrip()
    assert all(e.logprob is None for e in tokens)
    stats = generator.last_stats
    assert stats.prompt_tokens == len(PROMPT) and stats.new_tokens == len(want) and stats.stop_reason == "length"


def test_eos_ends_with_stop_and_is_counted_but_not_an_event(generator) -> None:
    want = list(generator.generate_ids(PROMPT, GREEDY))
    eos = want[5]
    first = want.index(eos)
    saved = generator.eos_ids
    generator.eos_ids = {eos}
    try:
        tokens, final = split(list(generator.events(PROMPT, with_(GREEDY, ignore_eos=False))))
    finally:
        generator.eos_ids = saved
    assert [e.token_id for e in tokens] == want[:first]
    assert final.finish_reason == "stop"
    assert generator.last_stats.new_tokens == first + 1  # the EOS is a completion token too


def test_stop_string_held_back_and_never_released(generator) -> None:
    """The word tokenizer's text is known: a stop string spanning two tokens is held while it could
    still complete, the text before it goes out with the token that completes it."""
    want = list(generator.generate_ids(PROMPT, GREEDY))
    text = " ".join(f"w{t}" for t in want)
    stop = f"{want[3]} w{want[4]}"  # from inside token 3's text into token 4's
    cut = text.index(stop)
    events = list(generator.events(PROMPT, with_(GREEDY, stop=[stop, "no such text"])))
    tokens, final = split(events)
    completes = next(k for k in range(1, len(want) + 1) if len(" ".join(text.split()[:k])) >= cut + len(stop))
    assert [e.token_id for e in tokens] == want[:completes]
    assert "".join(e.text for e in events) == text[:cut] == generator.generate(PROMPT, with_(GREEDY, stop=stop))
    assert final.finish_reason == "stop" and final.text == "" and generator.last_stats.stop_reason == "stop string"
    # without a match, what was held goes out with the final event
    tokens, final = split(list(generator.events(PROMPT, with_(GREEDY, stop=["no such text"]))))
    assert final.text and final.finish_reason == "length"
    assert "".join(e.text for e in tokens) + final.text == text


def test_arguments_are_checked_when_events_is_called(generator) -> None:
    """A server refuses a bad request before it starts a stream: events() raises, not its first next()."""
    with pytest.raises(InvalidInputError, match="prompt is empty"):
        generator.events([], GREEDY)
    with pytest.raises(SamplingError, match="max_new_tokens must be >= 1"):
        generator.events(PROMPT, with_(GREEDY, max_new_tokens=0))


def test_real_text_stop_strings_and_messages(smollm2) -> None:
    params = SamplingParams(max_new_tokens=24)
    messages = [{"role": "user", "content": "List three colors."}]
    ids = smollm2.encode_messages(messages)
    assert ids == smollm2.encode("List three colors.", chat=True)
    text = smollm2.generate(ids, params)
    tokens, final = split(list(smollm2.events(ids, params)))
    assert "".join(e.text for e in tokens) + final.text == text
    word = text.split()[1]
    stopped = with_(params, stop=[word])
    events = list(smollm2.events(ids, stopped))
    _, final = split(events)
    released = "".join(e.text for e in events)
    assert released == text[: text.index(word)] == smollm2.generate(ids, stopped)
    assert final.finish_reason == "stop" and final.text == ""
    turns = [{"role": "assistant", "content": text}, {"role": "user", "content": "More."}]
    longer = smollm2.encode_messages(messages + turns)
    assert longer[: len(ids) - 3] == ids[: len(ids) - 3] and len(longer) > len(ids)
    for bad, words in [([], "non-empty list"), ([{"role": "user"}], "message 0 needs a str 'content'"),
                       (["hi"], "message 0 must be a dict")]:  # fmt: skip
        with pytest.raises(InvalidInputError, match=words):
            smollm2.encode_messages(bad)


# -- logprobs ----------------------------------------------------------------------------------


def oracle_logprobs(package: Path, context: list[int]) -> np.ndarray:
    """log_softmax, in float64, of onnxruntime's logits for the last row of ``context`` run as one
    prompt: the raw distribution the next token is drawn from, computed without onnxgen."""
    row = onnxruntime_prompt_logits(package, context)[-1].astype(np.float64)
    row -= row.max()
    return row - np.log(np.exp(row).sum())


def assert_logprobs_match(package: Path, prompt: list[int], events: list[GenerationEvent], top: int) -> None:
    context = list(prompt)
    for event in events:
        assert event.token_id is not None and event.logprob is not None
        oracle = oracle_logprobs(package, context)
        got = event.logprob
        assert got.token_id == event.token_id
        assert got.logprob == pytest.approx(oracle[event.token_id], abs=1e-4)
        assert len(got.top) == top
        # the reported top list: each id's own oracle value, and in the order of a sort of the oracle
        np.testing.assert_allclose([v for _, v in got.top], np.sort(oracle)[::-1][:top], atol=1e-4)
        np.testing.assert_allclose([v for _, v in got.top], [oracle[i] for i, _ in got.top], atol=1e-4)
        context.append(event.token_id)


def test_logprobs_are_the_raw_distributions_against_onnxruntime(package, generator) -> None:
    """Greedy and a hot, truncated draw alike report log_softmax of the raw logits (not of the
    tempered, top-k-cut ones: a top_k of 3 at temperature 1.7 would give other values)."""
    greedy, final = split(list(generator.events(PROMPT, with_(GREEDY, max_new_tokens=5, logprobs=4))))
    assert [e.token_id for e in greedy] == list(generator.generate_ids(PROMPT, with_(GREEDY, max_new_tokens=5)))
    assert_logprobs_match(package, PROMPT, greedy, 4)
    assert all(e.logprob.top[0][0] == e.token_id for e in greedy)  # type: ignore[union-attr]
    hot = with_(GREEDY, max_new_tokens=5, temperature=1.7, top_k=3, seed=5, logprobs=2)
    sampled, _ = split(list(generator.events(PROMPT, hot)))
    assert_logprobs_match(package, PROMPT, sampled, 2)
    alone, _ = split(list(generator.events(PROMPT, with_(GREEDY, max_new_tokens=2, logprobs=0))))
    assert [e.logprob.top for e in alone] == [(), ()]  # type: ignore[union-attr]


def test_logprobs_on_a_captured_pipelined_step_sample_between_steps_said_once(package, generator) -> None:
    """Where greedy would pick its tokens in the captured step's tail, a generation with logprobs
    samples between the steps (the tail does not read the row) and says so once; its tokens and
    logprobs are those of the plain dynamic-KV loop, and a default generation keeps the tail."""
    captured = Generator(package, kv="static", capture="on", recorder=ReplayRecorder(), pipeline=True)
    params = with_(GREEDY, max_new_tokens=6, logprobs=3)
    with pytest.warns(UserWarning, match=r"with logprobs \(each token's logits row is read.*sample between"):
        got = list(captured.events(PROMPT, params))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = list(captured.events(PROMPT, params))
        plain = list(captured.events(PROMPT, GREEDY))
    want = list(generator.events(PROMPT, params))
    for events in (got, again):
        assert [e.token_id for e in events] == [e.token_id for e in want]
        for mine, theirs in zip(events[:-1], want[:-1], strict=True):
            assert mine.logprob.logprob == pytest.approx(theirs.logprob.logprob, abs=1e-5)  # type: ignore[union-attr]
            assert [i for i, _ in mine.logprob.top] == [i for i, _ in theirs.logprob.top]  # type: ignore[union-attr]
    assert [e.token_id for e in plain] == [e.token_id for e in generator.events(PROMPT, GREEDY)]
    assert captured.engine._tail is not None  # the default generation sampled in the step's tail


# -- min_tokens --------------------------------------------------------------------------------


def test_min_tokens_bans_an_eos_greedy_would_pick(smollm2) -> None:
    """SmolLM2 (int4) answers "Reply with one word: yes or no. Is water wet?" in a few tokens and
    its EOS. With min_tokens 8 the EOS stays the model's most likely token there (its raw logprob
    says so), yet the next best one is taken."""
    ids = smollm2.encode("Reply with one word: yes or no. Is water wet?", chat=True)
    free, final = split(list(smollm2.events(ids, SamplingParams(max_new_tokens=12))))
    assert final.finish_reason == "stop" and len(free) < 8 and smollm2.last_stats.stop_reason == "eos"
    at = len(free)
    held = SamplingParams(max_new_tokens=12, min_tokens=8, logprobs=2)
    tokens, _ = split(list(smollm2.events(ids, held)))
    assert len(tokens) >= 8 and [e.token_id for e in tokens[:at]] == [e.token_id for e in free]
    forced = tokens[at].logprob
    assert forced is not None and forced.top[0][0] in smollm2.eos_ids
    assert tokens[at].token_id == forced.top[1][0] and forced.top[1][0] not in smollm2.eos_ids


def test_min_tokens_defers_stop_strings(generator) -> None:
    want = list(generator.generate_ids(PROMPT, GREEDY))
    text = " ".join(f"w{t}" for t in want)
    stop = f"w{want[0]} w{want[1]}"
    assert text.count(stop) == 1  # only in the first two tokens' text
    assert generator.generate(PROMPT, with_(GREEDY, stop=stop)) == ""
    tokens, final = split(list(generator.events(PROMPT, with_(GREEDY, stop=stop, min_tokens=3))))
    assert [e.token_id for e in tokens] == want and final.finish_reason == "length"
    assert "".join(e.text for e in tokens) + final.text == text


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(min_tokens=-1), "min_tokens must be >= 0"),
        (dict(min_tokens=5, max_new_tokens=4), r"min_tokens \(5\) must be <= max_new_tokens \(4\)"),
        (dict(min_tokens=1.5), "min_tokens must be an int"),
        (dict(logprobs=21), r"logprobs must be None \(off\) or in \[0, 20\]"),
        (dict(logprobs=-1), r"in \[0, 20\]"),
        (dict(logprobs=True), "logprobs must be an int"),
    ],
)
def test_min_tokens_and_logprobs_are_validated(kw, words) -> None:
    with pytest.raises(SamplingError, match=words):
        SamplingParams(**kw).validate()


# -- cancellation ------------------------------------------------------------------------------


def counting_steps(generator: Generator) -> list[Sequence]:
    """Wraps the engine's step: the returned list gets the sequence of every decode step run."""
    ran: list[Sequence] = []
    original = generator.engine.step

    def step(sequences: list[Sequence]) -> None:
        ran.extend(sequences)
        original(sequences)

    generator.engine.step = step  # type: ignore[method-assign]
    return ran


@pytest.mark.parametrize("form", ["dynamic", "captured-pipelined"])
@pytest.mark.parametrize("how", ["close", "drop"])
def test_closing_the_iterator_stops_the_generation_there(package, form, how) -> None:
    """After the consumer stops, no decode step runs, the sequence holds no KV state, and the
    next generation on the same Generator gives a fresh Generator's tokens. (The pipelined loop has
    enqueued its one lookahead step before the token it hands out: that one, and no other.)"""
    if form == "dynamic":
        generator = Generator(package, kv="dynamic")
    else:
        generator = Generator(package, kv="static", capture="on", recorder=ReplayRecorder(), pipeline=True)
    fresh = [e.token_id for e in Generator(package, kv="dynamic").events(PROMPT, GREEDY)]
    ran = counting_steps(generator)
    it = generator.events(PROMPT, GREEDY)
    got = [next(it).token_id for _ in range(4)]
    assert got == fresh[:4]
    steps = len(ran)
    assert steps == (3 if form == "dynamic" else 4)
    if how == "close":
        it.close()
    else:
        del it
    assert len(ran) == steps  # nothing more ran
    sequence = ran[-1]
    assert sequence.done and sequence.kv is None and sequence.token is None
    assert generator.last_stats.stop_reason == "cancelled" and generator.last_stats.new_tokens == 4
    assert [e.token_id for e in generator.events(PROMPT, GREEDY)] == fresh
    assert generator.last_stats.stop_reason == "length"
