"""The `onnxgen` command, driven as a user would (subprocess) on the real default model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from onnxgen import options
from tests.cli_in_process import onnxgen_in_process


def onnxgen(
    *args: str, stdin: str | None = None, timeout: int = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "onnxgen", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env} if env else None,
    )


@pytest.fixture(scope="module")
def package(smollm2_packages):
    return str(smollm2_packages["int4-gqa"])


def test_generate_streams_text_and_stats(package):
    result = onnxgen("generate", "--model", package, "--prompt", "What is 2 + 2?", "--chat", "-n", "12")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "no generated text on stdout"
    assert "prompt " in result.stderr and "tok/s" in result.stderr, "no stats line on stderr"
    assert "tok/s" not in result.stdout


def test_bench_reports_the_generators_own_timing(package):
    """`onnxgen bench`: the fixed greedy workload, median of the timed runs, numbers on stdout
    (JSON here), progress on stderr; the tokens per run are checked inside (exactly -n of them)."""
    import json

    result = onnxgen("bench", "--model", package, "-n", "6", "--prompt-tokens", "5", "--repeats", "2", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert (data["prompt_tokens"], data["new_tokens"], data["repeats"], data["device"]) == (5, 6, 2, "cpu")
    assert len(data["decode_tok_s_runs"]) == 2 and data["decode_tok_s"] in data["decode_tok_s_runs"]
    assert data["decode_tok_s"] > 0 and data["ttft_ms"] > 0
    assert abs(data["ms_per_token"] - 1000 / data["decode_tok_s"]) < 1e-6 * data["ms_per_token"] + 1e-9
    assert "warm-up run" in result.stderr and "timed run 2 of 2" in result.stderr
    too_long = onnxgen("bench", "--model", package, "--prompt-tokens", "9000")
    assert too_long.returncode == 2 and "exceed the model's context" in too_long.stderr


def test_generate_default_model_without_model_flag(smollm2_packages):
    # the default model resolves through the registry to the cached int4 cpu package
    result = onnxgen("generate", "--prompt", "Hello", "-n", "4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_seeded_sampling_same_output_twice(package):
    args = (
        "generate",
        "--model",
        package,
        "--prompt",
        "Name a fruit.",
        "--chat",
        "-n",
        "16",
        "--temperature",
        "0.9",
        "--top-k",
        "40",
        "--top-p",
        "0.9",
        "--seed",
        "5",
    )
    first, second = onnxgen(*args), onnxgen(*args)
    assert first.returncode == 0 and second.returncode == 0
    assert first.stdout == second.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    ],
)
def test_invalid_sampling_values(package, args, message):
    result = onnxgen_in_process("generate", "--model", package, "--prompt", "hi", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_model_lists_known_ones():
    result = onnxgen_in_process("generate", "--model", "no-such-model", "--prompt", "hi")
    assert result.returncode == 2
    assert "smollm2-135m-instruct" in result.stderr
    assert "Traceback" not in result.stderr


def test_empty_and_too_long_prompts(package):
    empty = onnxgen("generate", "--model", package, "--prompt", "")
    assert empty.returncode == 2 and "prompt is empty" in empty.stderr and "Traceback" not in empty.stderr
    long_prompt = "word " * 9000  # SmolLM2's context is 8192 tokens
    long = onnxgen("generate", "--model", package, "--prompt", long_prompt)
    assert long.returncode == 2 and "context holds" in long.stderr and "Traceback" not in long.stderr


def test_show_package_and_capture_plan(smollm2_packages):
    package = str(smollm2_packages["fp32-standard"])
    shown = onnxgen_in_process("show", package)
    assert shown.returncode == 0, shown.stderr
    assert "GroupQueryAttention" not in shown.stdout and "MatMul" in shown.stdout and "parameters:" in shown.stdout
    with options.override(fuse=False):  # ONNXGEN_FUSE=0
        as_stored = json.loads(onnxgen_in_process("show", package, "--capture", "--json").stdout)
    assert as_stored["segments"] == 31  # 30 layers + 1 for the dynamic-KV decode step
    assert {"name", "op_type", "capturable", "kind", "reason", "segment"} <= set(as_stored["nodes"][0])
    assert not any(as_stored["fusions"].values())
    # what a CPU session runs: the attention rewrite only; a CUDA session: every rewrite
    plan = onnxgen_in_process("show", package, "--capture", "--json")
    assert plan.returncode == 0, plan.stderr
    data = json.loads(plan.stdout)
    assert data["device"] == "cpu" and data["fusions"] == {
        "attention": 30, "matmul_groups": 0, "matmul_nbits_groups": 0, "silu_mul": 0, "singles": 0, "prologues": 0,
        "row_sums": 0, "tied_gathers": 0,  # onnxgen's builder stores the embedding table as it is read
        "l2_norms": 0, "key_repeats": 0, "query_scales": 0, "delta_prologues": 0,  # no linear attention
        "rotary_casts": 0, "sigmoid_gates": 0,  # nor a rotary op or a sigmoid gate
        "reshape_chains": 0,  # a CUDA rewrite
    }  # fmt: skip
    text = onnxgen_in_process("show", package, "--capture")
    assert "prompt logits: computed for the last prompt row only" in text.stdout, text.stdout[-500:]
    fused = json.loads(onnxgen_in_process("show", package, "--capture", "--json", "--device", "cuda").stdout)
    # o_proj and down_proj as groups of one; SiLU-mul moves into down_proj (this graph spells its
    # RMSNorms out op by op, which the prologue rewrite does not match)
    assert fused["fusions"] == {
        "attention": 30, "matmul_groups": 60, "matmul_nbits_groups": 0, "silu_mul": 30, "singles": 60, "prologues": 30,
        "row_sums": 0,  # this layout has no ReduceSum -> Sub -> Cast of the mask (GroupQueryAttention's lengths)
        "tied_gathers": 0, "l2_norms": 0, "key_repeats": 0, "rotary_casts": 0, "query_scales": 0, "sigmoid_gates": 0,
        "delta_prologues": 0, "reshape_chains": 0,  # no Reshape reads another in a Llama layer
    }  # fmt: skip
    assert data["segments"] == fused["segments"] == 31 and len(fused["nodes"]) < len(data["nodes"])
    # attention over the growing KV: one eager op per layer instead of a dozen
    stored_seams = as_stored["counts"]["eager_seams"]
    assert fused["counts"]["eager_seams"] == data["counts"]["eager_seams"] < stored_seams / 3


def test_pull_prints_package_dir_last_and_list(package):
    pulled = onnxgen("pull", "smollm2-135m-instruct")
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.strip().splitlines()[-1] == package
    listed = onnxgen("list")
    assert listed.returncode == 0 and "qwen2.5-coder-0.5b-instruct" in listed.stdout


def test_chat_repl_commands(package):
    script = "Say hello.\n/stats\n/system You are terse.\n/reset\n/exit\n"
    result = onnxgen("run", "--model", package, "-n", "8", stdin=script)
    assert result.returncode == 0, result.stderr
    assert "history cleared" in result.stderr and "tok/s" in result.stderr


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_bench_refuses_a_seed_outside_torch_range_before_loading(seed):
    """`bench --seed` outside [0, 2**64): one line, before any model is pulled or loaded."""
    done = onnxgen_in_process("bench", "-m", "/nonexistent-package-dir", f"--seed={seed}", "-n", "4")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"onnxgen: error: bench's prompt seed must be an int in [0, 2**64), got {seed}"


def test_show_names_the_kernel_of_each_quantized_form(smollm2_packages):
    """`onnxgen show` lists each MatMulNBits / GatherBlockQuantized form with the kernel that serves
    it on the device asked about, and names the fallback where none does (here: accuracy_level 0
    on the CPU keeps an fp32 copy)."""
    int4 = str(smollm2_packages["int4-gqa"])
    cpu = onnxgen_in_process("show", int4)
    assert cpu.returncode == 0, cpu.stderr
    assert "quantized weights on cpu (kernel per form):" in cpu.stdout
    assert "accuracy_level=4: " in cpu.stdout and "-> torch int4 GEMM (bf16 activations)" in cpu.stdout
    cuda = json.loads(onnxgen_in_process("show", int4, "--json", "--device", "cuda").stdout)["quantized_weights"]
    assert {f["path"] for f in cuda["forms"] if f["op"] == "MatMulNBits"} == {
        "packed 4-bit kernels (gpu/linear_q4.py), no dequantized copy"
    }
    # the tied table: rows of the head's codes (through Reshapes), gathered by one kernel
    assert [f["path"] for f in cuda["forms"] if f["op"] == "GatherBlockQuantized"] == [
        "one-kernel 4-bit row gather (gpu/prelude.py)"
    ]
    level0 = onnxgen_in_process("show", str(smollm2_packages["int4-gqa-level0"]))
    assert "-> reference: dequantized fp32 copy kept (accuracy_level=0 asks for fp32 compute" in level0.stdout
