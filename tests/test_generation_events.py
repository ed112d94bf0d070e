"""Generator.events: one event per new token, then one final event; what the HTTP server streams.

The event structure runs on a tiny random-weights package with a word tokenizer (token ``w<i>`` is
id i, so texts are known without a model); text with real stop strings and chat messages on the
real SmolLM2 package (tests/conftest.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from onnxgen.errors import InvalidInputError
from onnxgen.genai.events import GenerationEvent
from onnxgen.genai.generator import Generator
from onnxgen.genai.sampling import SamplingError, SamplingParams
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource
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
