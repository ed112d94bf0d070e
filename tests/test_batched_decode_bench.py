"""bench.batched_decode on a tiny fp32 package on the CPU: a row per batch size, each with the first
run's tokens equal to the serial engine loop's on the same prompts."""

from __future__ import annotations

from dataclasses import replace

from bench import batched_decode
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource


def test_rows_per_batch_with_the_serial_tokens(tmp_path, capsys) -> None:
    config = replace(TINY_CONFIGS["tiny-llama"], max_position_embeddings=64)
    package = build_package(RandomSource(config, seed=2), tmp_path / "tiny")
    argv = ["--device", "cpu", "--package", str(package), "--batch", "1,3", "--prompt-tokens", "5",
            "--new-tokens", "6", "--prefill-chunk", "2"]  # fmt: skip
    assert batched_decode.main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "3"]
    assert [row.rstrip(" |").split("|")[-1].strip() for row in rows] == ["1/1", "3/3"], rows
