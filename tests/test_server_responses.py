"""server/responses.py: a streamed token's chunk, written by the fast path (Envelope.text_chunk),
is byte for byte the chunk the general path (Envelope.chunk) writes, for every kind and text."""

from __future__ import annotations

import json

import pytest

from onnxgen.server.responses import Envelope

TEXTS = ["", "hello", ' "quoted" \\ back', "line\nbreak\ttab\x00\x1f", "ünïcødé 漢字 🙂"]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_text_chunk_is_the_general_chunk(kind: str, include_usage: bool) -> None:
    envelope = Envelope(kind, 'model "x"', include_usage=include_usage)
    for index in (0, 7, 123):
        for text in TEXTS:
            fast = envelope.text_chunk(index, text)
            assert fast == envelope.chunk(index, text=text)
            event = json.loads(fast.removeprefix(b"data: "))
            content = event["choices"][0]["delta"]["content"] if kind == "chat" else event["choices"][0]["text"]
            assert content == text and event["choices"][0]["index"] == index
            assert ("usage" in event) is include_usage
