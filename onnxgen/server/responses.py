"""Response bodies in OpenAI's shapes, and their Server-Sent Events framing.

Shapes (https://platform.openai.com/docs/api-reference): a chat completion is
``{id: "chatcmpl-...", object: "chat.completion", created, model, choices: [{index, message:
{role, content}, logprobs, finish_reason}], usage}``; a streamed one is ``chat.completion.chunk``
objects whose choices carry a ``delta``; a completion is ``text_completion`` with ``choices[].text``
(its stream uses the same object name). Streams are ``data: JSON\\n\\n`` events ended by
``data: [DONE]\\n\\n``. With ``stream_options.include_usage`` every chunk has ``"usage": null`` and
one last chunk with empty choices carries the usage.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from onnxgen.genai.events import TokenLogprob
from onnxgen.server.token_text import TokenText

DONE = b"data: [DONE]\n\n"
LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a probability that underflowed float32 is shown as this


def dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def sse(value: Any) -> bytes:
    return b"data: " + dumps(value) + b"\n\n"


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens served from a
    prefix the server held (vLLM and OpenAI report it there too)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _logprob(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN to the floor


def chat_logprobs(entries: Sequence[TokenLogprob], tokens: TokenText) -> dict[str, Any]:
    """Chat's ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal"}."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": tokens.text(token_id), "logprob": _logprob(logprob), "bytes": tokens.bytes(token_id)}

    content = []
    for item in entries:
        row = entry(item.token_id, item.logprob)
        row["top_logprobs"] = [entry(token_id, logprob) for token_id, logprob in item.top]
        content.append(row)
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], tokens: TokenText, offset: int = 0) -> dict[str, Any]:
    """Completions' ``logprobs``: parallel lists, ``text_offset`` counted in characters of the
    choice's text from ``offset`` (where this part of it starts)."""
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for item in entries:
        text = tokens.text(item.token_id)
        result["tokens"].append(text)
        result["token_logprobs"].append(_logprob(item.logprob))
        top: dict[str, float] = {}
        for token_id, logprob in item.top:
            top.setdefault(tokens.text(token_id), _logprob(logprob))
        result["top_logprobs"].append(top)
        result["text_offset"].append(offset)
        offset += len(text)
    return result


@dataclass
class ChoiceResult:
    """One choice of a non-streamed response, as it is collected."""

    index: int
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    prefix: str = ""  # echoed prompt (completions)

    @property
    def text(self) -> str:
        return self.prefix + "".join(self.parts)


@dataclass
class Envelope:
    """What every response and chunk of one request shares."""

    kind: str  # "chat" or "completion"
    model: str
    include_usage: bool = False
    id: str = ""
    created: int = 0

    def __post_init__(self) -> None:
        self.id = self.id or new_id(self.kind)
        self.created = self.created or int(time.time())
        # a text chunk's bytes around its index and its text (text_chunk): what chunk() writes for it
        head = dumps({"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model})
        self._text_head = b"data: " + head[:-1] + b',"choices":[{"index":'
        self._text_mid = b',"delta":{"content":' if self.kind == "chat" else b',"text":'
        close = b"}" if self.kind == "chat" else b""
        self._text_tail = (
            close
            + b',"logprobs":null,"finish_reason":null}]'
            + (b',"usage":null}\n\n' if self.include_usage else b"}\n\n")
        )

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def text_chunk(self, index: int, text: str) -> bytes:
        """``chunk(index, text=text)``, the same bytes, without building and encoding the whole
        object: the chunk every streamed token makes (tests/test_server_responses.py holds them equal)."""
        return b"".join((self._text_head, str(index).encode(), self._text_mid, dumps(text), self._text_tail))

    def response(
        self,
        choices: Sequence[ChoiceResult],
        prompt_tokens: int,
        tokens: TokenText | None,
        with_logprobs: bool,
        cached_tokens: int = 0,
    ) -> dict[str, Any]:
        rows = []
        for choice in choices:
            logprobs = None
            if with_logprobs and tokens is not None:
                logprobs = (
                    chat_logprobs(choice.logprobs, tokens)
                    if self.kind == "chat"
                    else completion_logprobs(choice.logprobs, tokens, len(choice.prefix))
                )
            if self.kind == "chat":
                message = {"role": "assistant", "content": choice.text, "refusal": None}
                rows.append({"index": choice.index, "message": message, "logprobs": logprobs,
                             "finish_reason": choice.finish_reason})  # fmt: skip
            else:
                rows.append({"index": choice.index, "text": choice.text, "logprobs": logprobs,
                             "finish_reason": choice.finish_reason})  # fmt: skip
        completion = sum(c.completion_tokens for c in choices)
        return {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": rows,
            "usage": usage(prompt_tokens, completion, cached_tokens),
        }

    def chunk(
        self,
        index: int,
        *,
        text: str | None = None,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
        finish_reason: str | None = None,
    ) -> bytes:
        """One streamed choice chunk: for chat a delta (with the role on a choice's first chunk; an
        empty delta on its last), for completions the text."""
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if role:
                delta = {"role": "assistant", "content": text or "", "refusal": None}
            elif text is not None:
                delta = {"content": text}
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text or ""}
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        body: dict[str, Any] = {
            "id": self.id,
            "object": self._chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        return sse(
            {
                "id": self.id,
                "object": self._chunk_object,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
            }
        )


def model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "onnxgen"}
