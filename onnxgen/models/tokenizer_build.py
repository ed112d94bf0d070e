"""tokenizer.json + tokenizer_config.json (Hugging Face `tokenizers` format) from GGUF metadata.

A GGUF carries a byte-level BPE vocabulary (`tokenizer.ggml.model == "gpt2"`), its merges, the
type of every token, and the name of the pre-tokenizer (`tokenizer.ggml.pre`) -- the rule that
splits text into words before BPE. That name decides the split regex; an unknown name is an
error, since a wrong split silently changes token ids.

GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
Control tokens become special added tokens, user-defined ones plain added tokens; both are
matched whole in the text and never normalized.

No normalizer is set: llama.cpp applies none to these files, and neither does transformers'
GGUF loading (our oracle). (Qwen2's own tokenizer.json applies NFC first; the two differ only on
text that is not already NFC.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from onnxgen.errors import ModelLoadError
from onnxgen.models.gguf_reader import GGUFFile

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Qwen2's split: contractions, letters with one leading non-letter, single digits, punctuation
# runs, newlines, other whitespace (the regex published with Qwen2's tokenizer and llama.cpp).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# GPT-2's split: contractions, letter runs, digit runs, other symbols, whitespace (a space leads a word).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def _smollm() -> pre_tokenizers.PreTokenizer:
    # Every digit alone first, then GPT-2's split on what is between (llama.cpp's two regexes for
    # "smollm"; the same splits as SmolLM2's published Digits → ByteLevel). Written as two Split steps
    # because onnxruntime-genai's tokenizer follows those, while it ignores a Digits step.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated", invert=False),
            pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )


def _qwen2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )


PRE_TOKENIZERS = {"smollm": _smollm, "qwen2": _qwen2, "deepseek-r1-qwen": _qwen2, "gpt-2": _gpt2}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character map: printable Latin-1 bytes stand for themselves,
    the other 68 bytes take the characters from U+0100 on, in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


def _spell(token: str, alphabet: set[str], table: dict[int, str]) -> str:
    # Real vocabulary entries are written in the byte alphabet; a stray one is re-spelled from its bytes.
    return token if set(token) <= alphabet else "".join(table[b] for b in token.encode("utf-8"))


def build_tokenizer(gguf: GGUFFile) -> Tokenizer:
    """The `tokenizers.Tokenizer` this GGUF describes."""
    kind = gguf.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{gguf.path}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = gguf.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{gguf.path}: pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
    types = gguf.get("tokenizer.ggml.token_type")
    types = [_NORMAL] * len(tokens) if types is None else [int(t) for t in types]
    if len(types) != len(tokens):
        raise ModelLoadError(f"{gguf.path}: {len(types)} token types for {len(tokens)} tokens")
    merges = gguf.require("tokenizer.ggml.merges")

    table = byte_alphabet()
    alphabet = set(table.values())
    vocab: dict[str, int] = {}
    added: list[AddedToken] = []
    for i, (tok, kind_id) in enumerate(zip(tokens, types)):
        if kind_id in (_CONTROL, _USER_DEFINED):
            text = tok  # matched whole in the raw text, so kept as written
            added.append(AddedToken(text, special=kind_id == _CONTROL, normalized=False))
        else:
            text = _spell(tok, alphabet, table)
        if text in vocab:
            raise ModelLoadError(f"{gguf.path}: token {text!r} appears twice (ids {vocab[text]} and {i})")
        vocab[text] = i

    pairs = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep or not left or not right:
            raise ModelLoadError(f"{gguf.path}: merge {m!r} is not two tokens separated by a space")
        pairs.append((left, right))

    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(gguf, tokens)
    tok.add_tokens(added)  # add_tokens keeps each AddedToken's own `special` flag
    return tok


def _post_processor(gguf: GGUFFile, tokens: list[str]) -> processors.PostProcessor:
    """BOS/EOS around each sequence where the file asks for them; otherwise byte-level offsets only."""

    def wanted(flag: str, key: str) -> tuple[str, int] | None:
        tid = gguf.get(f"tokenizer.ggml.{key}")
        if not gguf.get(f"tokenizer.ggml.{flag}", False) or tid is None:
            return None
        return tokens[int(tid)], int(tid)

    bos, eos = wanted("add_bos_token", "bos_token_id"), wanted("add_eos_token", "eos_token_id")
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False)
    b = [bos[0]] if bos else []
    e = [eos[0]] if eos else []
    single = [*b, "$A", *e]
    pair = [*single, *(f"{t}:1" for t in b), "$B:1", *(f"{t}:1" for t in e)]
    special = list(dict.fromkeys(t for t in (bos, eos) if t is not None))
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair), special_tokens=special)


def tokenizer_config(gguf: GGUFFile) -> dict[str, Any]:
    """tokenizer_config.json: special tokens, BOS/EOS flags and the chat template."""
    tokens: list[str] = gguf.require("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        tid = gguf.get(f"tokenizer.ggml.{key}")
        return None if tid is None or int(tid) >= len(tokens) else tokens[int(tid)]

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(gguf.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(gguf.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "clean_up_tokenization_spaces": False,
    }
    arch = gguf.get("general.architecture")
    ctx = gguf.get(f"{arch}.context_length")
    if ctx is not None:
        config["model_max_length"] = int(ctx)
    template = gguf.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def write_tokenizer_files(gguf: GGUFFile | str | Path, out_dir: str | Path) -> list[Path]:
    """Write tokenizer.json and tokenizer_config.json for a GGUF (file or path) into `out_dir`."""
    if not isinstance(gguf, GGUFFile):
        with GGUFFile(gguf) as opened:
            return write_tokenizer_files(opened, out_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_path, cfg_path = out / "tokenizer.json", out / "tokenizer_config.json"
    build_tokenizer(gguf).save(str(tok_path))
    cfg_path.write_text(json.dumps(tokenizer_config(gguf), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return [tok_path, cfg_path]


# Files of a Hugging Face model directory that describe its tokenizer.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def copy_hf_tokenizer(src_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Copy a Hugging Face directory's tokenizer files as they are (tokenizer.json is required).

    Newer repos keep the chat template in chat_template.jinja; packages want it in
    tokenizer_config.json (onnxruntime-genai reads it there), so it is folded in. Where both hold
    one, the .jinja file wins, as it does when transformers loads the source directory.
    """
    src, out = Path(src_dir), Path(out_dir)
    if not (src / "tokenizer.json").is_file():
        raise ModelLoadError(f"{src} has no tokenizer.json; a package needs a Hugging Face tokenizers file")
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in HF_TOKENIZER_FILES:
        if (src / name).is_file():
            copied.append(Path(shutil.copyfile(src / name, out / name)))
    template_file = src / "chat_template.jinja"
    cfg_path = out / "tokenizer_config.json"
    if template_file.is_file():
        cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        template = template_file.read_text(encoding="utf-8")
        if cfg.get("chat_template") != template:
            cfg["chat_template"] = template
            cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
            if cfg_path not in copied:
                copied.append(cfg_path)
    return copied
