"""llama.cpp as a peer of bench.peers_decode: its own converter's GGUF of the bench's checkpoint, timed
by its own llama-bench.

A llama.cpp tree built with ``../shared/device/pack-llamacpp.sh`` (``bash .lcpp/llamacpp-build.sh``
on the GPU machine; a CPU build the same way without ``-DGGML_CUDA=ON``) holds what is used here:
``convert_hf_to_gguf.py`` with its ``gguf-py`` beside it, and ``build/bin/llama-quantize`` and
``build/bin/llama-bench``. The converter reads the checkpoint's tokenizer and accepts only the
tokenizers it knows (it checks how a real one splits a test text), so the bench's stand-in
word-level tokenizer is replaced by a real one of the same family (``--tokenizer-from``: a directory
with tokenizer.json, e.g. ``python -m bench.llamacpp_peer qwen2.5-coder-0.5b-instruct .gpu/qwen-tok``,
which writes it from the pulled GGUF; the converter accepts it); speed does not depend on which
token ids the weights map. Without a model hub, ``python -m bench.llamacpp_peer --vocab qwen2
.gpu/qwen-tok`` writes the same family's tokenizer from the vocabulary-only GGUF that llama.cpp's
source keeps for its tokenizer tests (in the llama-cpp-python sdist, fetched with pip), checked
against the token ids that test expects.

The GGUF is F16 for fp16 and fp32 runs and Q4_0 (llama-quantize from the F16 file) for int4, the
forms issue 17 names. llama-bench runs twice: ``-p 0 -n N -d P`` (N tokens decoded after a context
of P tokens, the bench's prompt length) and ``-p P[,L] -n 0`` (prompt processing of P and L tokens).
Its TTFT is the prompt's processing time alone (it has no first-token read-back); it reports no
token ids (nothing to compare) and runs in its own process (no device-memory figure here).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class LlamaBenchNumbers:
    decode_tok_s: list[float]  # one per repetition
    prompt_s: dict[int, list[float]]  # prompt length -> seconds to process it, per repetition
    gguf: Path
    how: str


def tree_problem(tree: Path) -> str | None:
    """What the llama.cpp tree lacks for this bench, or None."""
    wanted = [tree / "convert_hf_to_gguf.py", tree / "gguf-py", tree / "build/bin/llama-bench"]
    wanted.append(tree / "build/bin/llama-quantize")
    missing = [str(p) for p in wanted if not p.exists()]
    return (
        f"the llama.cpp tree lacks {', '.join(missing)} (build it: ../shared/device/pack-llamacpp.sh)"
        if missing
        else None
    )


def converter_checkpoint(hf_dir: Path, tokenizer_from: Path, out: Path) -> Path:
    """A view of the checkpoint for the converter: its files linked, the tokenizer files replaced."""
    missing = [name for name in TOKENIZER_FILES[:1] if not (tokenizer_from / name).is_file()]
    if missing:
        raise FileNotFoundError(f"--tokenizer-from {tokenizer_from} has no {', '.join(missing)}")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for item in hf_dir.iterdir():
        if item.name not in TOKENIZER_FILES and item.name != "tokenizer.model":
            (out / item.name).symlink_to(item.resolve())
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copyfile(tokenizer_from / name, out / name)
    return out


def _run(command: list[str], what: str, env: dict[str, str] | None = None) -> str:
    print(f"llama.cpp: {what}: {' '.join(command)}", file=sys.stderr, flush=True)
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{what} failed (exit {done.returncode}): {' / '.join(tail)}")
    return done.stdout


def ensure_gguf(
    tree: Path, hf_dir: Path, tokenizer_from: Path, workdir: Path, precision: str, converter_args: Sequence[str] = ()
) -> Path:
    """The GGUF of the checkpoint in the form for ``precision`` (kept in ``workdir``); ``converter_args``
    go to convert_hf_to_gguf.py."""
    f16 = workdir / f"llamacpp-{hf_dir.name}-F16.gguf"
    if not f16.is_file():
        view = converter_checkpoint(hf_dir, tokenizer_from, workdir / f"llamacpp-{hf_dir.name}-hf")
        env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py")}
        script = str(tree / "convert_hf_to_gguf.py")
        partial = f16.with_suffix(".partial")
        command = [sys.executable, script, str(view), *converter_args, "--outtype", "f16", "--outfile", str(partial)]
        _run(command, "convert", env)
        partial.rename(f16)
    if precision != "int4":
        return f16
    q4 = workdir / f"llamacpp-{hf_dir.name}-Q4_0.gguf"
    if not q4.is_file():
        partial = q4.with_suffix(".partial")
        _run([str(tree / "build/bin/llama-quantize"), str(f16), str(partial), "Q4_0"], "quantize")
        partial.rename(q4)
    return q4


def parse_bench_json(text: str) -> list[dict]:
    """llama-bench -o json: a list of test records (n_prompt, n_gen, samples_ns, samples_ts, ...)."""
    records = json.loads(text)
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError("llama-bench -o json gave no list of test records")
    return records


def run_llama_bench(
    tree: Path, gguf: Path, device: str, prompt: int, long_prompt: int, new_tokens: int, repeats: int, threads: int
) -> LlamaBenchNumbers:
    bench = str(tree / "build/bin/llama-bench")
    common = ["-m", str(gguf), "-r", str(repeats), "-o", "json"]
    if device == "cuda":
        common += ["-ngl", "99", "-fa", "1"]
        how = "-ngl 99 -fa 1"
    else:
        common += ["-ngl", "0", "-t", str(threads)]
        how = f"-ngl 0 -t {threads}"
    decode = parse_bench_json(
        _run([bench, *common, "-p", "0", "-n", str(new_tokens), "-d", str(prompt)], "llama-bench decode")
    )
    lengths = [prompt] + ([long_prompt] if long_prompt else [])
    prefill = parse_bench_json(
        _run([bench, *common, "-p", ",".join(map(str, lengths)), "-n", "0"], "llama-bench prompt")
    )
    rates, prompt_s = measured(decode, prefill, new_tokens, lengths)
    built = decode[0].get("build_commit", "?") if decode else "?"
    return LlamaBenchNumbers(rates, prompt_s, gguf, f"llama-bench {how} (build {built}), {gguf.name}")


def measured(
    decode: list[dict], prefill: list[dict], new_tokens: int, lengths: list[int]
) -> tuple[list[float], dict[int, list[float]]]:
    """(decode tok/s per repetition, prompt length -> seconds per repetition) from llama-bench's
    records: the decode test is the one with n_gen = ``new_tokens``, a prompt test one with n_gen 0."""
    rates = [float(x) for r in decode if int(r["n_gen"]) == new_tokens for x in r["samples_ts"]]
    prompt_s = {
        n: [
            float(x) / 1e9 for r in prefill if int(r["n_prompt"]) == n and int(r["n_gen"]) == 0 for x in r["samples_ns"]
        ]
        for n in lengths
    }
    if not rates or not all(prompt_s.values()):
        raise ValueError("llama-bench's output lacks the decode or prompt tests asked for")
    return rates, prompt_s


def median_ms(samples: list[float]) -> float:
    return 1000.0 * statistics.median(samples)


def write_real_tokenizer(model: str, out: Path) -> list[Path]:
    """tokenizer.json and tokenizer_config.json of a known model, made from its pulled GGUF (onnxgen's
    own tokenizer builder): what --tokenizer-from needs, small enough to carry to the GPU machine."""
    from onnxgen.models.fetch import pull
    from onnxgen.models.tokenizer_build import write_tokenizer_files

    return write_tokenizer_files(pull(model, progress=True), out)


# the llama-cpp-python release whose vendored llama.cpp ../shared/device/pack-llamacpp.sh builds by default
LLAMACPP_SDIST_VERSION = "0.3.36"
VOCAB_TEST_SEPARATOR = "\n__ggml_vocab_test__\n"


def vocab_tokenizer(family: str, out: Path, sdist: Path | None = None) -> list[Path]:
    """tokenizer.json and tokenizer_config.json of a tokenizer family (``qwen2``, ``llama-bpe``, ...) from
    llama.cpp's vocabulary-only test GGUF (``models/ggml-vocab-FAMILY.gguf`` in the llama-cpp-python
    sdist, ``sdist`` or fetched with pip), by onnxgen's own tokenizer builder. Fails unless the result
    encodes every text of llama.cpp's own test for that file (``.inp``) to the ids it expects (``.out``)."""
    from onnxgen.models.tokenizer_build import write_tokenizer_files

    with tempfile.TemporaryDirectory() as tmp:
        if sdist is None:
            print(f"fetching llama-cpp-python {LLAMACPP_SDIST_VERSION} (its source, ~50 MB) with pip", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d",
                            tmp, f"llama-cpp-python=={LLAMACPP_SDIST_VERSION}"], check=True)  # fmt: skip
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        stem = f"ggml-vocab-{family}.gguf"
        files = {}
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if "/vendor/llama.cpp/models/" in member.name and name in (stem, stem + ".inp", stem + ".out"):
                    files[name] = Path(tmp) / name
                    files[name].write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
        missing = [name for name in (stem, stem + ".inp", stem + ".out") if name not in files]
        if missing:
            raise FileNotFoundError(f"{sdist} has no vendor/llama.cpp/models/{', '.join(missing)}")
        written = write_tokenizer_files(files[stem], out)
        checked = check_vocab_test(out / "tokenizer.json", files[stem + ".inp"], files[stem + ".out"])
    print(f"{out}: {family} tokenizer, llama.cpp's {checked} test texts encode to its ids", file=sys.stderr)
    return written


def check_vocab_test(tokenizer_json: Path, texts: Path, ids: Path) -> int:
    """How many of llama.cpp's tokenizer test texts (``texts``, each ended by VOCAB_TEST_SEPARATOR) the
    tokenizer encodes to the ids llama.cpp expects (``ids``, a line of ids a text); ValueError at the
    first that differs, or where the two files do not pair up."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    cases_text = texts.read_text(encoding="utf-8")
    if cases_text.endswith(VOCAB_TEST_SEPARATOR):  # the separator ends each text, the last one too
        cases_text = cases_text[: -len(VOCAB_TEST_SEPARATOR)]
    cases = cases_text.split(VOCAB_TEST_SEPARATOR)
    ids_text = ids.read_text(encoding="utf-8")
    expected = ids_text.split("\n")
    if ids_text.endswith("\n"):
        expected.pop()
    if len(cases) != len(expected):
        raise ValueError(f"{texts} has {len(cases)} texts, {ids} {len(expected)} lines of ids")
    for text, line in zip(cases, expected, strict=True):
        want = [int(t) for t in line.split()]
        got = tokenizer.encode(text, add_special_tokens=False).ids
        if got != want:
            raise ValueError(
                f"{tokenizer_json} encodes {text[:40]!r} to {got[:12]}, llama.cpp's test expects {want[:12]}"
            )
    return len(cases)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="write a real tokenizer for --tokenizer-from")
    parser.add_argument("model", nargs="?", help="a registry name, e.g. qwen2.5-coder-0.5b-instruct (pulled)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab", help="instead of a model: a llama.cpp test vocabulary, e.g. qwen2 (no model hub)")
    parser.add_argument("--sdist", type=Path, help="with --vocab: a llama-cpp-python sdist already here")
    args = parser.parse_args()
    if (args.model is None) == (args.vocab is None):
        parser.error("give a model or --vocab FAMILY")
    paths = (
        vocab_tokenizer(args.vocab, args.out, args.sdist) if args.vocab else write_real_tokenizer(args.model, args.out)
    )
    for path in paths:
        print(path)
