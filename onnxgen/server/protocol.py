"""Request parsing and validation: the body of a POST, as bytes, to a ``GenerationRequest``, or an
``ApiError`` that names the field at fault.

All of the server's request checking lives here, so every refusal reads alike: "FIELD must be ...,
got ...", with ``param`` set to the field (``messages[1].content[0].text``). The rules:

- The body is a JSON object in UTF-8; NaN and Infinity are refused (JSON has no such numbers).
- Every field is one of OpenAI's (or vLLM's extensions ``top_k``, ``min_p``,
  ``repetition_penalty``, ``min_tokens``, ``ignore_eos``) for that endpoint. A field onnxgen does
  not implement (``tools``, ``logit_bias``, ...) is refused by name unless its value asks for
  nothing (null, ``{}``, ``{"type": "text"}``...), and so is a field nobody knows (a typo would
  otherwise change nothing, silently).
- null means "not given" for every optional field, as in OpenAI's API.
- Types are JSON's: an integer field takes no 2.0 and no true; a number field takes integers.
  Ranges that are the sampler's own (temperature >= 0, top_p in (0, 1], ...) are checked by
  ``SamplingParams.validate``, whose errors name the field too; the app maps them (``sampling_param``).

Defaults are OpenAI's: temperature 1, top_p 1, n 1; ``max_tokens`` 16 for completions and what
the context leaves for chat.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from onnxgen.server.errors import invalid

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs
MAX_STOP = 16  # stop strings per request (OpenAI takes 4)
MAX_STOP_CHARS = 1024
INT64_MAX = 2**63 - 1
SEED_LIMIT = 2**64
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

SAMPLING_FIELDS = (
    "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty",
)  # fmt: skip
COMMON_FIELDS = {
    "model", "max_tokens", "n", "stop", "seed", "stream", "stream_options", "user", "min_tokens", "ignore_eos",
    "logprobs", *SAMPLING_FIELDS,
}  # fmt: skip
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of"}


def _no_op(value: Any, allowed: tuple[Any, ...]) -> bool:
    return value is None or any(value == a and type(value) is type(a) for a in allowed)


# Fields onnxgen knows and does not implement: (the values that ask for nothing, what to say)
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "tools": (([],), "tool calling is not supported"),
    "tool_choice": (("none",), "tool calling is not supported"),
    "parallel_tool_calls": ((False,), "tool calling is not supported"),
    "functions": (([],), "function calling is not supported"),
    "function_call": (("none",), "function calling is not supported"),
    "response_format": (({"type": "text"},), "only plain text output is supported (no JSON mode or schema)"),
    "logit_bias": (({},), "logit_bias is not supported"),
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only the text modality is supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "reasoning_effort": ((), "reasoning_effort is not supported"),
    "web_search_options": ((), "web search is not supported"),
    "store": ((False,), "storing completions is not supported"),
    "metadata": (({},), "metadata is only stored with store, which is not supported"),
    "service_tier": (("auto", "default"), "service tiers are not supported"),
    "suffix": (("",), "suffix (insertion) is not supported"),
}


@dataclass
class GenerationRequest:
    """A validated /v1/chat/completions or /v1/completions request. ``prompts``: the completion
    prompts (each a str or token ids); ``messages``: the chat, roles mapped to the template's
    (developer -> system), contents flattened to str. ``sampling``: SamplingParams keyword
    arguments, not yet range-checked; ``seed`` separate (each choice derives its own)."""

    kind: str  # "chat" or "completion"
    model: str | None
    messages: list[dict[str, str]] = field(default_factory=list)
    prompts: list[str | list[int]] = field(default_factory=list)
    n: int = 1
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the field the value came from (errors name it)
    sampling: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # alternatives per token when logprobs are asked for, else None
    echo: bool = False

    @property
    def choices(self) -> int:
        return self.n * (len(self.prompts) if self.kind == "completion" else 1)


# -- JSON values ------------------------------------------------------------------------------


def json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _shown(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json_kind(value)
    text = json.dumps(value, ensure_ascii=False)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{json_kind(value)} ({text})" if value is not None else "null"


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(body: bytes) -> Any:
    """The JSON document of a body (UTF-8, no NaN/Infinity); a 400 naming what is wrong."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"the body is not UTF-8 text: byte 0x{body[exc.start]:02x} at offset {exc.start}") from None
    if not text.strip():
        raise invalid("the body is empty; expected a JSON object")
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise invalid(f"the body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except ValueError as exc:  # NaN/Infinity, or an integer with more digits than Python converts
        raise invalid(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid("the body is not valid JSON: nested too deeply") from None


def parse_object(body: bytes) -> dict[str, Any]:
    document = parse_json(body)
    if not isinstance(document, dict):
        raise invalid(f"the body must be a JSON object, got {json_kind(document)}")
    return document


def _utf8(name: str, text: str) -> str:
    """Refuses lone surrogates (what "\\ud800" in JSON makes): they are not text a tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ord(text[exc.start])
        raise invalid(f"{name} holds a lone surrogate (U+{bad:04X}), which is not text", name) from None
    return text


def get_str(body: dict, name: str, where: str | None = None) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    where = where or name
    if not isinstance(value, str):
        raise invalid(f"{where} must be a string, got {_shown(value)}", where)
    return _utf8(where, value)


def get_bool(body: dict, name: str, where: str | None = None) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise invalid(f"{where or name} must be a boolean, got {_shown(value)}", where or name)
    return value


def get_int(body: dict, name: str, low: int | None = None, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{name} must be an integer, got {_shown(value)}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]"
        raise invalid(f"{name} must be {bounds}, got {_shown(value)}", name)
    return value


def get_number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{name} must be a number, got {_shown(value)}", name)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise invalid(f"{name} must be a finite number, got {_shown(value)}", name)
    return number


# -- fields -----------------------------------------------------------------------------------


def check_fields(body: dict, known: set[str]) -> None:
    """Every field is known and implemented (or asks for nothing)."""
    for name, value in body.items():
        if name in UNSUPPORTED:
            allowed, why = UNSUPPORTED[name]
            if not _no_op(value, allowed):
                raise invalid(f"{name}: {why} by this server (onnxgen)", name, "unsupported_parameter")
        elif name not in known:
            shown = name if len(name) <= 64 else name[:61] + "..."
            raise invalid(f"unrecognized request field: {shown!r}", shown, "unknown_parameter")


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise invalid(f"stop must be a string or an array of strings, got {_shown(value)}", "stop")
    if len(items) > MAX_STOP:
        raise invalid(f"stop takes at most {MAX_STOP} strings, got {len(items)}", "stop")
    for index, item in enumerate(items):
        where = "stop" if isinstance(value, str) else f"stop[{index}]"
        if not isinstance(item, str):
            raise invalid(f"{where} must be a string, got {_shown(item)}", where)
        if not item:
            raise invalid(f"{where} is empty; stop strings must not be empty", where)
        if len(item) > MAX_STOP_CHARS:
            raise invalid(f"{where} is {len(item)} characters; at most {MAX_STOP_CHARS}", where)
        _utf8(where, item)
    return list(items)


def _stream_options(body: dict, stream: bool) -> bool:
    """include_usage; stream_options only with stream (as OpenAI)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise invalid(f"stream_options must be an object, got {_shown(options)}", "stream_options")
    for key in options:
        if key != "include_usage":
            raise invalid(f"stream_options.{key} is not supported (only include_usage)", f"stream_options.{key}")
    return bool(get_bool(options, "include_usage", "stream_options.include_usage"))


def _common(body: dict, request: GenerationRequest, max_choices: int) -> None:
    request.model = get_str(body, "model")
    get_str(body, "user")  # accepted, ignored (OpenAI uses it for abuse monitoring)
    request.n = get_int(body, "n", 1, max_choices) or 1
    request.stop = _stop(body)
    request.seed = get_int(body, "seed", 0, SEED_LIMIT - 1)
    request.stream = bool(get_bool(body, "stream"))
    request.include_usage = _stream_options(body, request.stream)
    sampling: dict[str, Any] = {}
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p", "repetition_penalty"):
        value = get_number(body, name)
        if value is not None:
            sampling[name] = value
    sampling.setdefault("temperature", 1.0)  # OpenAI's default: sampled
    top_k = get_int(body, "top_k", -1)
    if top_k is not None:
        sampling["top_k"] = max(top_k, 0)  # vLLM: -1 (and 0) mean off
    min_tokens = get_int(body, "min_tokens", 0)
    if min_tokens:
        sampling["min_tokens"] = min_tokens
    ignore_eos = get_bool(body, "ignore_eos")
    if ignore_eos:
        sampling["ignore_eos"] = True
    request.sampling = sampling


def _max_tokens(body: dict, names: tuple[str, ...]) -> tuple[int | None, str]:
    for name in names:
        value = get_int(body, name, 1)
        if value is not None:
            return value, name
    return None, names[0]


def _content(value: Any, where: str) -> str:
    """A message's content: a string, or an array of text parts joined by newlines."""
    if isinstance(value, str):
        return _utf8(where, value)
    if not isinstance(value, list):
        raise invalid(f"{where} must be a string or an array of content parts, got {_shown(value)}", where)
    texts = []
    for index, part in enumerate(value):
        at = f"{where}[{index}]"
        if not isinstance(part, dict):
            raise invalid(f"{at} must be an object, got {_shown(part)}", at)
        kind = part.get("type")
        if kind != "text":
            shown = _shown(kind)
            raise invalid(f'{at}.type must be "text" (this model takes text only), got {shown}', f"{at}.type")
        for key in part:
            if key not in ("type", "text"):
                raise invalid(f"{at}.{key} is not supported", f"{at}.{key}")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{at}.text must be a string, got {_shown(text)}", f"{at}.text")
        texts.append(_utf8(f"{at}.text", text))
    return "\n".join(texts)


def _messages(body: dict) -> list[dict[str, str]]:
    value = body.get("messages")
    if value is None:
        raise invalid("messages is required", "messages")
    if not isinstance(value, list):
        raise invalid(f"messages must be an array of message objects, got {_shown(value)}", "messages")
    if not value:
        raise invalid("messages is empty; give at least one message", "messages")
    messages = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object, got {_shown(message)}", where)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            shown = _shown(role) if role is not None else "none"
            raise invalid(
                f"{where}.role must be one of {', '.join(ROLES)}, got {shown}"
                + (" (tool messages are not supported)" if role in ("tool", "function") else ""),
                f"{where}.role",
            )
        for key, item in message.items():
            if key in ("role", "content") or (key == "refusal" and item is None):
                continue
            raise invalid(f"{where}.{key} is not supported by this server (onnxgen)", f"{where}.{key}")
        if message.get("content") is None:
            raise invalid(f"{where}.content is required", f"{where}.content")
        messages.append({"role": ROLES[role], "content": _content(message["content"], f"{where}.content")})
    return messages


def _token_ids(value: list, where: str) -> list[int]:
    for index, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise invalid(f"{where}[{index}] must be an integer token id, got {_shown(item)}", where)
    return list(value)


def _prompts(body: dict, max_choices: int) -> list[str | list[int]]:
    """A string, an array of strings, an array of token ids, or an array of such arrays."""
    value = body.get("prompt")
    if value is None:
        raise invalid("prompt is required", "prompt")
    if isinstance(value, str):
        return [_utf8("prompt", value)]
    if not isinstance(value, list) or not value:
        what = "empty" if value == [] else _shown(value)
        raise invalid(
            f"prompt must be a string, an array of strings, token ids, or an array of token-id arrays; got {what}",
            "prompt",
        )
    if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return [list(value)]
    if len(value) > max_choices:
        raise invalid(f"prompt holds {len(value)} prompts; this server takes at most {max_choices}", "prompt")
    prompts: list[str | list[int]] = []
    for index, item in enumerate(value):
        where = f"prompt[{index}]"
        if isinstance(item, str):
            prompts.append(_utf8(where, item))
        elif isinstance(item, list) and item:
            prompts.append(_token_ids(item, where))
        else:
            raise invalid(f"{where} must be a string or a non-empty array of token ids, got {_shown(item)}", where)
    return prompts


def parse_chat(body: dict, max_choices: int) -> GenerationRequest:
    check_fields(body, CHAT_FIELDS)
    request = GenerationRequest(kind="chat", model=None)
    request.messages = _messages(body)
    _common(body, request, max_choices)
    request.max_tokens, request.max_tokens_param = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    logprobs = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not logprobs:
        raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    request.logprobs = (top or 0) if logprobs else None
    return request


def parse_completion(body: dict, max_choices: int) -> GenerationRequest:
    check_fields(body, COMPLETION_FIELDS)
    request = GenerationRequest(kind="completion", model=None)
    request.prompts = _prompts(body, max_choices)
    _common(body, request, max_choices)
    request.max_tokens, request.max_tokens_param = _max_tokens(body, ("max_tokens",))
    if request.max_tokens is None:
        request.max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    request.logprobs = get_int(body, "logprobs", 0, MAX_LOGPROBS)
    request.echo = bool(get_bool(body, "echo"))
    if request.echo and request.logprobs is not None:
        raise invalid(
            "echo with logprobs is not supported: it needs the prompt tokens' logprobs, which onnxgen does not "
            "compute (the engine takes the logits of the last prompt row only); echo alone works",
            "echo",
        )
    best_of = get_int(body, "best_of", 1)
    if best_of is not None and best_of not in (1, request.n):
        raise invalid("best_of other than 1 or n is not supported by this server (onnxgen)", "best_of")
    if request.choices > max_choices:
        raise invalid(
            f"{len(request.prompts)} prompts x n {request.n} = {request.choices} choices; this server makes at most "
            f"{max_choices} per request",
            "n",
        )
    return request


# -- /tokenize and /detokenize (vLLM's shapes) -------------------------------------------------


@dataclass
class TokenizeRequest:
    model: str | None
    prompt: str | None  # text to tokenize as it is
    messages: list[dict[str, str]] | None  # or a chat, through the chat template
    add_special_tokens: bool


def parse_tokenize(body: dict) -> TokenizeRequest:
    check_fields(body, {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"})
    model = get_str(body, "model")
    if body.get("prompt") is not None and body.get("messages") is not None:
        raise invalid("give prompt or messages, not both", "messages")
    add_generation_prompt = get_bool(body, "add_generation_prompt")
    if add_generation_prompt is False:
        raise invalid("add_generation_prompt false is not supported (the template always opens the reply)",
                      "add_generation_prompt")  # fmt: skip
    if body.get("messages") is not None:
        return TokenizeRequest(model, None, _messages(body), bool(get_bool(body, "add_special_tokens")))
    prompt = get_str(body, "prompt")
    if prompt is None:
        raise invalid("prompt (a string) or messages is required", "prompt")
    return TokenizeRequest(model, prompt, None, bool(get_bool(body, "add_special_tokens")))


def parse_detokenize(body: dict) -> tuple[str | None, list[int]]:
    check_fields(body, {"model", "tokens"})
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise invalid(f"tokens must be an array of token ids, got {_shown(tokens)}", "tokens")
    return get_str(body, "model"), _token_ids(tokens, "tokens")
