"""Tokenizer of a package (tokenizer.json + tokenizer_config.json [+ chat_template.jinja]), with
streaming detokenization.

Chat templates are found as transformers finds them: a chat_template.jinja file (what
onnxruntime-genai's builder writes) takes priority over tokenizer_config.json's chat_template,
which is a string or named templates (a list of {name, template} objects, or an object of them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from onnxgen.errors import ModelLoadError
from onnxgen.genai.package_reading import describe, package_file, read_json_object, read_text

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

ChatTemplate = str | dict[str, str]


def _token_text(config: dict[str, Any], key: str, path: Path) -> str | None:
    value = config.get(key)
    if isinstance(value, dict):  # AddedToken serialized form
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ModelLoadError(f"{path}: {key} is {describe(config[key])}; expected a string or an object with 'content'")
    return value


def _named_templates(value: Any, path: Path) -> ChatTemplate | None:
    """tokenizer_config.json's chat_template: a string, a list of {name, template}, or an object."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for index, entry in enumerate(value):
            where = f"{path}: chat_template[{index}]"
            if not isinstance(entry, dict):
                raise ModelLoadError(f"{where} is {describe(entry)}; expected an object with 'name' and 'template'")
            for key in ("name", "template"):
                if not isinstance(entry.get(key), str):
                    shown = "has no" if key not in entry else f"has {describe(entry[key])} as its"
                    raise ModelLoadError(f"{where} {shown} {key!r}; expected a string")
            named[entry["name"]] = entry["template"]
        return named
    if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        return dict(value)
    raise ModelLoadError(
        f"{path}: chat_template is {describe(value)}; expected a string or a list of {{name, template}} objects"
    )


class Tokenizer:
    def __init__(self, package_dir: str | Path):
        from tokenizers import Tokenizer as HfTokenizer

        directory = Path(package_dir)
        path = package_file(directory, TOKENIZER_FILE)
        if not path.is_file():
            raise ModelLoadError(f"{directory} has no {TOKENIZER_FILE}; expected a Hugging Face tokenizers file")
        try:
            self.backend = HfTokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelLoadError(f"{path} could not be read as a tokenizers file: {exc}") from None
        config_path = package_file(directory, TOKENIZER_CONFIG_FILE)
        self.config: dict[str, Any] = read_json_object(config_path) if config_path.is_file() else {}
        template_path = package_file(directory, CHAT_TEMPLATE_FILE)
        if template_path.is_file():
            # transformers: a template file replaces whatever tokenizer_config.json holds
            self.chat_template: ChatTemplate | None = read_text(template_path)
        else:
            self.chat_template = _named_templates(self.config.get("chat_template"), config_path)
        self.bos_token = _token_text(self.config, "bos_token", config_path)
        self.eos_token = _token_text(self.config, "eos_token", config_path)

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
    """Emits text as tokens arrive; holds back bytes until they form whole characters.

    The text of the ids so far is the decode of a short window of the latest ids after the text
    already emitted (tokenizers' DecodeStream, which keeps that window in Rust): one call per token,
    the window bounded, so a token costs the same at any length of the generation."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self.backend = tokenizer.backend
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_id: int) -> str:
        return self.stream.step(self.backend, token_id) or ""
