"""Incremental detokenization (genai/tokenizer.py StreamDecoder): the pieces emitted token by token
join to the tokenizers library's decode of all the ids (the oracle), and no piece carries half of a
character, for a byte-level BPE whose merges split multi-byte characters (emoji, CJK) across tokens
and for a Metaspace (SentencePiece-style) one."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from onnxgen.genai.tokenizer import Tokenizer

TEXTS = [
    "Hello wörld! 🙂 naïve café — 東京タワー and 🚀🚀 rockets.",
    "  spaces   and\ttabs\nnew lines 👍🏽 ok",
    "mixed 123 numbers 4.56 and émojis 🎉🎊 plus 中文字符",
]


def _byte_level() -> HfTokenizer:
    backend = HfTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(TEXTS * 3, trainer)
    return backend


def _metaspace() -> HfTokenizer:
    backend = HfTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", *alphabet])
    backend.train_from_iterator(TEXTS[:1], trainer)
    return backend


@pytest.mark.parametrize("make", [_byte_level, _metaspace], ids=["byte-level", "metaspace"])
def test_streamed_pieces_join_to_the_full_decode(tmp_path, make) -> None:
    backend = make()
    backend.save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer(tmp_path)
    rng = random.Random(0)
    cases = [backend.encode(text).ids for text in TEXTS]
    cases += [[rng.randrange(backend.get_vocab_size()) for _ in range(200)] for _ in range(5)]  # any ids
    for number, ids in enumerate(cases):
        stream = tokenizer.stream()
        pieces = [stream.push(token_id) for token_id in ids]
        joined, full = "".join(pieces), backend.decode(ids, skip_special_tokens=True)
        if number < len(TEXTS):
            assert joined == full
            assert not any("\ufffd" in piece for piece in pieces)  # a character is never emitted in halves
        else:  # random ids may end inside a character: those bytes are held back, nothing else
            assert full.startswith(joined) and set(full[len(joined) :]) <= {"\ufffd"}
