"""A token id as the logprobs of OpenAI's API show it: its text and its raw bytes.

A token is not always whole characters: byte-level BPE splits a multi-byte character over tokens,
so a token's own text can be a replacement character while its bytes are exact. The bytes come
from the vocabulary entry: byte-level vocabularies (GPT-2's scheme: every byte written as one
printable character) are mapped back to their bytes; ``<0xHH>`` byte-fallback tokens are that byte;
any other token is the UTF-8 of its decoded text.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level_table() -> dict[str, int]:
    """The printable character byte-level BPE writes for each byte, inverted: character -> byte.
    Printable Latin-1 bytes stand for themselves; the others, in order, for U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenText:
    """Text and bytes of token ids for one tokenizer (a ``tokenizers.Tokenizer``), cached."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        try:
            decoder = json.loads(backend.to_str()).get("decoder") or {}
        except (ValueError, AttributeError):
            decoder = {}
        self.byte_level = decoder.get("type") == "ByteLevel"
        self._table = _byte_level_table() if self.byte_level else {}
        self.text = functools.lru_cache(maxsize=65536)(self._text)
        self.bytes = functools.lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.backend.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> list[int]:
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return list(self._text(token_id).encode("utf-8"))
        if self.byte_level and all(c in self._table for c in piece):
            return [self._table[c] for c in piece]
        match = _BYTE_FALLBACK.match(piece)
        if match:
            return [int(match.group(1), 16)]
        return list(self._text(token_id).encode("utf-8"))
