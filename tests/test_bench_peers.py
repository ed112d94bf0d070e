"""bench/peers_decode.py end to end on the CPU with tiny configs (dense and hybrid): every engine
gets a measured row; and its plans for the hybrid shapes too large to write on the GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ["onnxgen", "onnxgen-eager", "ort-genai", "ort-genai-own", "onnxgen-on-genai", "hf-eager"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "tiny,precision",
    [("tiny-llama", "int4"), ("tiny-qwen2", "fp32"), ("tiny-qwen3.5", "fp32"), ("tiny-qwen3.5-moe", "fp32")],
)
def test_peers_decode_tiny_cpu(tiny: str, precision: str) -> None:
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("transformers")
    command = [sys.executable, "-m", "bench.peers_decode", "--device", "cpu", "--tiny", tiny]
    command += ["--precision", precision, "--new-tokens", "32", "--repeats", "2", "--engines", ",".join(ENGINES)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("| ")}
    for engine in ENGINES:
        cells = [c.strip() for c in rows[engine].split("|")[2:5]]  # tok/s, ms/token, TTFT ms
        assert all(float(c) > 0 for c in cells), rows[engine]
    assert "command: python -m bench.peers_decode --device cpu" in done.stdout and "versions: torch" in done.stdout
    assert "against onnxruntime-genai's best form here (ort-genai" in done.stdout, done.stdout
    if precision == "fp32":  # the same fp32 weights everywhere: greedy ids agree token for token
        for engine in ENGINES[1:]:
            assert f"tokens: {engine} = onnxgen over all 32 greedy tokens" in done.stdout, done.stdout


def test_pool_lines_group_segments_by_pool_largest_first() -> None:
    from bench.peers_decode import pool_lines

    mb = 1_000_000
    segments = [
        {"segment_pool_id": (0, 0), "total_size": 20 * mb, "allocated_size": 2 * mb},
        {"segment_pool_id": (1, 5), "total_size": 30 * mb, "allocated_size": 30 * mb},
        {"segment_pool_id": (0, 0), "total_size": 2 * mb, "allocated_size": 0},
        {"segment_pool_id": (1, 5), "total_size": 10 * mb, "allocated_size": 1 * mb},
    ]
    assert pool_lines(segments) == [
        "recording pool (1, 5): 40.0 MB reserved, 31.0 MB live, 2 segment(s), largest 30.0, 10.0 MB",
        "default pool: 22.0 MB reserved, 2.0 MB live, 2 segment(s), largest 20.0, 2.0 MB",
    ]


def test_hybrid_tiny_cpu_onnxgen_and_onnxruntime_genai_on_its_package(tmp_path: Path) -> None:
    """The hybrid path of the bench, lean: onnxgen's package of a Qwen3.5-layout checkpoint, and
    onnxruntime-genai on that package as built (its genai_config.json names the recurrent states),
    with its intra-op threads pinned (its default is not one per core everywhere)."""
    pytest.importorskip("onnxruntime_genai")
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5TextConfig"):
        pytest.skip("this transformers has no Qwen3_5TextConfig")
    command = [sys.executable, "-m", "bench.peers_decode", "--device", "cpu", "--tiny", "tiny-qwen3.5"]
    command += ["--precision", "fp32", "--new-tokens", "8", "--repeats", "1", "--warmup-s", "0"]
    command += ["--engines", "onnxgen,ort-genai", "--genai-threads", "2", "--workdir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("| ")}
    assert "state names added" not in rows["ort-genai"]  # the builder names them itself
    assert "2 intra-op threads" in rows["ort-genai"], rows["ort-genai"]
    (variant,) = tmp_path.glob("*-genai-variant-plain")
    session = json.loads((variant / "genai_config.json").read_text())["model"]["decoder"]["session_options"]
    assert session["intra_op_num_threads"] == 2
    for engine in ("onnxgen", "ort-genai"):
        assert float(rows[engine].split("|")[2]) > 0, rows[engine]
    assert "tokens: ort-genai = onnxgen over all 8 greedy tokens" in done.stdout, done.stdout


@pytest.mark.parametrize("shape", ["qwen3.5-0.8b", "qwen3.5-35b-a3b"])
def test_hybrid_shapes_are_transformers_classes_text_and_wrapper(shape: str) -> None:
    """Both Qwen3.5 shapes are exactly what transformers' classes hold (built on the meta device):
    the text checkpoint's layout and the multimodal wrapper's text part."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5MoeForConditionalGeneration"):
        pytest.skip("this transformers has no Qwen3.5 classes")
    from bench.peers_decode import TINY_VISION, check_hf_layout, hf_config_for
    from onnxgen.models.random_source import MODEL_SHAPES

    config = MODEL_SHAPES[shape]
    text = hf_config_for(config)
    check_hf_layout(text, config)
    assert text.rope_parameters["mrope_section"] == [11, 11, 10]
    moe = config.moe is not None
    config_class = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    model_class = (
        transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    )
    wrapper = config_class(
        text_config=text.to_dict(), vision_config=TINY_VISION | {"out_hidden_size": config.hidden_size},
        tie_word_embeddings=config.tie_word_embeddings,
    )  # fmt: skip
    check_hf_layout(wrapper, config, model_class, prefix="model.language_model.")


def test_35b_plan_on_the_gpu_machines_disk(monkeypatch, capsys) -> None:
    """With the GPU machine's 64 GB disk the 35B-A3B shape gets no checkpoint (its fp16 form alone
    is about 69 GB): the engines that read one are refused with the sizes, and onnxgen's int4 package
    is planned straight from RandomSource."""
    pytest.importorskip("transformers")
    from bench import peers_decode

    monkeypatch.setattr(peers_decode, "disk_free", lambda path: 64 * 10**9)
    argv = ["--device", "cpu", "--shape", "qwen3.5-35b-a3b", "--precision", "int4", "--memory-gb", "128"]
    with pytest.raises(SystemExit):
        peers_decode.parse_args([*argv, "--engines", "onnxgen,ort-genai-own"])
    assert "it reads the Hugging Face checkpoint, which this run cannot write" in capsys.readouterr().err
    args = peers_decode.parse_args([*argv, "--engines", "onnxgen,ort-genai", "--plan"])
    plan = "\n".join(peers_decode.plan_lines(args))
    assert "no checkpoint: the float16 checkpoint of qwen3.5-35b-a3b would take 69.3 GB" in plan, plan
    assert "writes onnxgen's package (from RandomSource: no checkpoint)" in plan, plan
    assert peers_decode.main([*argv, "--engines", "onnxgen", "--plan"]) == 0
