"""The text side of a package: its config, tokenizer, chat template, stop ids, and the checks on
prompt ids. It needs no weights and no device, so a process that only handles text (the server's,
when the engine runs in a process of its own: engine_process.py) has everything a Generator offers
for prompts without loading the model."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from onnxgen.errors import InvalidInputError, OnnxgenError
from onnxgen.genai.chat import render_chat
from onnxgen.genai.package import PackageConfig, load_package_config
from onnxgen.genai.tokenizer import Tokenizer


class PromptTooLongError(OnnxgenError):
    """The prompt does not fit in the model's context."""


def checked_prompt_ids(prompt_ids: Iterable[object], vocab: int, context: int) -> list[int]:
    """``prompt_ids`` as ints, checked where ids enter decoding: ints (numpy integers too; bool and
    float refused) within [0, vocab), not empty, leaving room for one new token in ``context``. These
    checks keep the decode loop free of bound checks: sampled tokens are always in range."""
    ids: list[int] = []
    for index, value in enumerate(prompt_ids):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise InvalidInputError(
                f"token ids must be ints; the one at index {index} is {value!r} ({type(value).__name__})"
            )
        if not 0 <= value < vocab:
            raise InvalidInputError(
                f"token id {int(value)} at index {index} is outside the vocabulary [0, {vocab}) of this model"
            )
        ids.append(int(value))
    if not ids:
        raise InvalidInputError("the prompt is empty; give at least one token of text")
    if len(ids) >= context:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens, but the context holds {context} (prompt plus at least one new token)"
        )
    return ids


class PromptText:
    """``PromptText(package)``: a package's config and tokenizer, and prompts made and checked with
    them (``encode``, ``encode_messages``, ``apply_chat_template``). ``eos_ids``: the package's stop
    ids, with the tokenizer's EOS token."""

    def __init__(self, package: str | Path | PackageConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = package if isinstance(package, PackageConfig) else load_package_config(package)
        self.tokenizer = tokenizer or Tokenizer(self.config.directory)
        self.eos_ids = set(self.config.eos_token_ids)
        eos = self.tokenizer.token_id(self.tokenizer.eos_token)
        if eos is not None:
            self.eos_ids.add(eos)

    def checked_prompt_ids(self, prompt_ids: Iterable[object]) -> list[int]:
        return checked_prompt_ids(prompt_ids, self.config.vocab_size, self.config.context_length)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        t = self.tokenizer
        return render_chat(t.chat_template, messages, bos_token=t.bos_token, eos_token=t.eos_token)

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        """Token ids of a text prompt (with the chat template if ``chat``), or a caller's ids checked
        (``checked_prompt_ids``)."""
        if isinstance(prompt, (list, tuple)):
            return self.checked_prompt_ids(prompt)
        if not isinstance(prompt, str):
            raise InvalidInputError(
                f"the prompt must be a str or a list of token ids (int), got {type(prompt).__name__}"
            )
        if chat:
            prompt = self.apply_chat_template([{"role": "user", "content": prompt}])
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidInputError(
                f"the prompt is not valid UTF-8 text: U+{ord(prompt[exc.start]):04X} at character {exc.start} is "
                "a lone surrogate (what Python makes of bytes that are not UTF-8, e.g. in a command-line argument)"
            ) from None
        return self.checked_prompt_ids(self.tokenizer.encode(prompt))

    def encode_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """Checked prompt ids of a chat: the package's chat template over the whole ``messages``
        list (each a dict with a str "role" and a str "content"; flattening content parts is the
        caller's), with the assistant's turn opened for the reply."""
        if not isinstance(messages, list) or not messages:
            raise InvalidInputError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise InvalidInputError(f"message {index} must be a dict, got {type(message).__name__}")
            for key in ("role", "content"):
                if not isinstance(message.get(key), str):
                    raise InvalidInputError(
                        f"message {index} needs a str {key!r}, got {type(message.get(key)).__name__}"
                    )
        return self.encode(self.apply_chat_template(messages))
