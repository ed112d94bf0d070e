"""bench/llamacpp_peer.py without a llama.cpp build: what it refuses, how it prepares the converter's
checkpoint, and how it reads llama-bench's JSON (records as a CPU build of llama-bench 0.3.36's
tree printed them on 2026-12-02, trimmed to the fields the bench reads and a few beside them)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.llamacpp_peer import (
    VOCAB_TEST_SEPARATOR,
    check_vocab_test,
    converter_checkpoint,
    measured,
    parse_bench_json,
    tree_problem,
)
from bench.peers_decode import engine_blocker

PROMPT_RECORD = {
    "build_commit": "unknown", "model_type": "llama 256M Q4_0", "n_threads": 1, "n_prompt": 8, "n_gen": 0,
    "n_depth": 0, "avg_ns": 31989847, "avg_ts": 250.081028, "samples_ns": [31906780, 32072915],
    "samples_ts": [250.73, 249.432],
}  # fmt: skip
DECODE_RECORD = {
    "build_commit": "unknown", "model_type": "llama 256M Q4_0", "n_threads": 1, "n_prompt": 0, "n_gen": 4,
    "n_depth": 16, "avg_ns": 31503268, "avg_ts": 126.985687, "samples_ns": [31842615, 31163922],
    "samples_ts": [125.618, 128.354],
}  # fmt: skip


def test_the_records_give_rates_and_prompt_seconds() -> None:
    records = parse_bench_json(json.dumps([PROMPT_RECORD, DECODE_RECORD]))
    rates, prompt_s = measured(records, records, new_tokens=4, lengths=[8])
    assert rates == [125.618, 128.354]
    assert prompt_s == {8: [0.03190678, 0.032072915]}
    with pytest.raises(ValueError, match="lacks the decode or prompt tests"):
        measured(records, records, new_tokens=128, lengths=[8])
    with pytest.raises(ValueError, match="no list of test records"):
        parse_bench_json(json.dumps({"n_gen": 4}))


def test_the_engine_says_what_it_needs(tmp_path: Path) -> None:
    none_given = argparse.Namespace(llamacpp=None, tokenizer_from=None)
    assert "needs --llamacpp" in engine_blocker("llama-cpp", "cpu", none_given)
    empty = argparse.Namespace(llamacpp=tmp_path, tokenizer_from=tmp_path)
    problem = engine_blocker("llama-cpp", "cpu", empty)
    assert (
        problem == tree_problem(tmp_path) and "build/bin/llama-bench" in problem and "convert_hf_to_gguf.py" in problem
    )


def test_the_converter_sees_the_real_tokenizer_beside_the_linked_weights(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"weights")
    (hf / "tokenizer.json").write_text('{"stand-in": true}')
    real = tmp_path / "real"
    real.mkdir()
    (real / "tokenizer.json").write_text('{"real": true}')
    view = converter_checkpoint(hf, real, tmp_path / "view")
    assert json.loads((view / "tokenizer.json").read_text()) == {"real": True}
    assert (view / "model.safetensors").is_symlink() and (view / "model.safetensors").read_bytes() == b"weights"
    assert not (view / "tokenizer_config.json").exists()
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        converter_checkpoint(hf, tmp_path / "nowhere", tmp_path / "view2")


def _word_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def test_a_vocab_test_pairs_texts_with_their_ids(tmp_path: Path) -> None:
    """llama.cpp's tokenizer test files: texts split by its separator, a line of ids per text (the last
    line ending in a newline or not); a tokenizer passes only if every text gives its ids."""
    tokenizer = _word_tokenizer(tmp_path)
    texts, ids = tmp_path / "v.inp", tmp_path / "v.out"
    texts.write_text(VOCAB_TEST_SEPARATOR.join(["hello world", "world", "nope hello"]), encoding="utf-8")
    ids.write_text(" 1 2\n 2\n 0 1\n", encoding="utf-8")
    assert check_vocab_test(tokenizer, texts, ids) == 3
    ids.write_text(" 1 2\n 2\n 0 2", encoding="utf-8")
    with pytest.raises(ValueError, match="'nope hello' to \\[0, 1\\].*expects \\[0, 2\\]"):
        check_vocab_test(tokenizer, texts, ids)
    ids.write_text(" 1 2\n 2\n", encoding="utf-8")
    with pytest.raises(ValueError, match="3 texts.*2 lines"):
        check_vocab_test(tokenizer, texts, ids)
