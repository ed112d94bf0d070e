"""Tokenizer of a package (tokenizer.json + tokenizer_config.json), with streaming detokenization."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from onnxgen.errors import ModelLoadError


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialized form
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, package_dir: str | Path):
        from tokenizers import Tokenizer as HfTokenizer

        directory = Path(package_dir)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{directory} has no tokenizer.json; expected a Hugging Face tokenizers file")
        try:
            self.backend = HfTokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelLoadError(f"{path} could not be read as a tokenizers file: {exc}") from None
        config_path = directory / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.backend.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def stream(self, skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Emits text as tokens arrive; holds back bytes until they form whole characters."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, self.skip)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        if not text.startswith(self.emitted):
            # a merge changed earlier text (rare with byte-level BPE); emit only the new tail
            common = 0
            while common < min(len(text), len(self.emitted)) and text[common] == self.emitted[common]:
                common += 1
            self.emitted = text[:common]
        new = text[len(self.emitted) :]
        self.emitted = text
        # keep the decode window short: restart it at a clean boundary
        if len(self.ids) > 64:
            self.ids = self.ids[-8:]
            self.emitted = self.tokenizer.decode(self.ids, self.skip)
        return new
