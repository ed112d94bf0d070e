"""Hybrid packages that onnxgen did not build: onnxruntime-genai 0.18's builder on tiny random
Qwen3.5 checkpoints (transformers' ``Qwen3_5ForConditionalGeneration`` and its MoE sibling; the
builder exports their text part).

What that builder writes, besides the dense ops: ``MRotaryEmbedding`` over 3-row ``position_ids``
[3, B, S], ``LpNormalization`` for the key / query L2 norms, ``LinearAttention`` with the keys packed
per query head, ``CausalConvWithState`` with channels-first states [B, conv_dim, k - 1], ``MoE`` (and
``QMoE`` in int4) with ``GatedAdd`` for the shared expert, and a KV head dimension left symbolic.

Oracles: transformers (fp32) on the checkpoint, onnxruntime-genai's own greedy tokens on the
package, and onnxruntime 1.32 on the int4 graph (at accuracy_level 0: level 4 lets onnxruntime
round activations to int8, which onnxgen does not).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from onnxgen.models.package_variants import with_accuracy_level
from tests.test_generator import genai_greedy

transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai")
if not hasattr(transformers, "Qwen3_5ForConditionalGeneration"):
    pytest.skip("this transformers has no Qwen3_5ForConditionalGeneration", allow_module_level=True)

PROMPT = [3, 17, 91, 5, 44, 120, 8]


def wrapper_checkpoint(directory: Path, *, experts: int) -> Path:
    """A 4-layer Qwen3.5-shaped multimodal checkpoint (3 Gated DeltaNet layers, then gated full
    attention; 2 key / 4 value linear heads; partial interleaved multimodal rotary) with a one-block
    vision tower. The vocabulary (160) differs from every vision projection's width: the builder
    takes any Linear as wide as the vocabulary for the LM head."""
    text = dict(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256,
        layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=False, eos_token_id=1,
        initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    )  # fmt: skip
    if experts:
        text.update(num_experts=experts, num_experts_per_tok=3, moe_intermediate_size=32,
                    shared_expert_intermediate_size=24)  # fmt: skip
        config_class, model_class = transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration
    else:
        config_class, model_class = transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(("dt_bias", "A_log")):
                param.copy_(0.3 * torch.randn_like(param))
    model.save_pretrained(directory)
    return directory


def genai_build(checkpoint: Path, out: Path, precision: str) -> Path:
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out),
               "-p", precision, "-e", "cpu", "-c", str(out.parent / "cache")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


BOTH = ["dense", "moe"]


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    """(checkpoint, onnxruntime-genai's fp32 package, its directory) of the family in request.param."""
    root = tmp_path_factory.mktemp("foreign-hybrid")
    checkpoint = wrapper_checkpoint(root / "hf", experts=8 if request.param == "moe" else 0)
    return checkpoint, genai_build(checkpoint, root / "fp32", "fp32"), root


def hf_model(checkpoint: Path) -> torch.nn.Module:
    return transformers.AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()


def prompt_feeds(package: Path, ids: list[int]) -> dict[str, np.ndarray]:
    """The first step's feeds, as onnxruntime-genai feeds a text prompt: the three position
    streams equal, every state and KV cache empty."""
    model = onnx.load(str(package / "model.onnx"), load_external_data=False)
    n = len(ids)
    feeds = {
        "input_ids": np.array([ids], np.int64),
        "attention_mask": np.ones((1, n), np.int64),
        "position_ids": np.broadcast_to(np.arange(n, dtype=np.int64), (3, 1, n)).copy(),
    }
    for vi in model.graph.input:
        if vi.name.startswith("past"):
            dims = [d.dim_value if d.HasField("dim_value") else 0 for d in vi.type.tensor_type.shape.dim]
            dims[0] = 1
            if vi.name.endswith((".key", ".value")):
                dims[3] = 64  # the head size the graph leaves symbolic (kv_cache_dim)
            feeds[vi.name] = np.zeros(dims, np.float32)
    return feeds


@pytest.mark.parametrize("family", BOTH, indirect=True)
def test_the_builder_writes_the_forms_this_file_is_about(family) -> None:
    """If onnxruntime-genai's builder changes what it writes, this says so first."""
    _, package, _ = family
    model = onnx.load(str(package / "model.onnx"), load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    assert {"MRotaryEmbedding", "LpNormalization", "LinearAttention", "CausalConvWithState"} <= ops
    positions = next(v for v in model.graph.input if v.name == "position_ids")
    assert positions.type.tensor_type.shape.dim[0].dim_value == 3


@pytest.mark.parametrize("family", BOTH, indirect=True)
def test_prompt_logits_match_transformers(family) -> None:
    from onnxgen.runtime import InferenceSession

    checkpoint, package, _ = family
    with torch.no_grad():
        expected = hf_model(checkpoint)(torch.tensor([PROMPT])).logits[0].numpy()
    actual = InferenceSession(str(package / "model.onnx")).run(None, prompt_feeds(package, PROMPT))[0][0]
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", BOTH, indirect=True)
@pytest.mark.parametrize("kv", ["auto", "static"])
def test_greedy_tokens_match_transformers_and_onnxruntime_genai(family, kv: str) -> None:
    """The engine feeds the three position streams, carries the channels-first conv states and the
    recurrent states beside the KV cache: its tokens are transformers' generate and onnxruntime-genai's."""
    from onnxgen.genai import Generator, SamplingParams

    checkpoint, package, _ = family
    model = hf_model(checkpoint)
    model.generation_config.eos_token_id = None  # run on through EOS, as ignore_eos does
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12)
    expected = out[0, len(PROMPT) :].tolist()
    generator = Generator(package, "cpu", kv=kv)
    assert generator.config.position_streams == 3
    ours = list(generator.generate_ids(PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True)))
    assert ours == expected
    theirs = genai_greedy(package, PROMPT, 12)  # stops at its EOS ids, if one comes
    assert ours[: len(theirs)] == theirs


@pytest.mark.parametrize("family", ["moe"], indirect=True)
def test_int4_package_matches_onnxruntime(family) -> None:
    """int4 (MatMulNBits everywhere; the MoE family's routed experts as QMoE): onnxgen's logits are
    onnxruntime's on the same graph at accuracy_level 0, and its greedy tokens onnxruntime-genai's."""
    import onnxruntime as ort

    from onnxgen.genai import Generator, SamplingParams
    from onnxgen.runtime import InferenceSession

    checkpoint, _, root = family
    package = with_accuracy_level(genai_build(checkpoint, root / "int4", "int4"), root / "int4-level0", 0)
    ops = {n.op_type for n in onnx.load(str(package / "model.onnx"), load_external_data=False).graph.node}
    assert "MatMulNBits" in ops and ("QMoE" in ops) == ("MoE" in {n.op_type for n in onnx.load(
        str(root / "fp32" / "model.onnx"), load_external_data=False).graph.node})  # fmt: skip
    feeds = prompt_feeds(package, PROMPT)
    expected = ort.InferenceSession(str(package / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)
    actual = InferenceSession(str(package / "model.onnx")).run(None, feeds)
    np.testing.assert_allclose(actual[0], expected[0], rtol=1e-4, atol=1e-4)
    ours = list(Generator(package, "cpu").generate_ids(PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True)))
    theirs = genai_greedy(package, PROMPT, 12)
    assert ours[: len(theirs)] == theirs


@pytest.mark.parametrize("family", BOTH, indirect=True)
def test_decode_step_is_one_recorded_segment(family) -> None:
    """Static KV: the whole decode step of the foreign graph plans as one segment (routing and
    experts too), and replaying it on the CPU stand-in recorder (verify mode) gives eager's tokens."""
    from onnxgen.genai import Generator, SamplingParams
    from onnxgen.runtime.capture.recorder import ReplayRecorder
    from onnxgen.runtime.capture.report import analyse

    _, package, _ = family
    model = onnx.load(str(package / "model.onnx"), load_external_data=False)
    analysis = analyse(model, {"past_sequence_length": 256, "total_sequence_length": 256})
    (segment,) = analysis.plan.segments
    recorded = {analysis.plan.nodes[i].op_type for i in segment}
    assert {"MRotaryEmbedding", "CausalConvWithState", "LinearAttention", "GroupQueryAttention"} <= recorded
    assert ("MoE" in recorded) == ("MoE" in {n.op_type for n in model.graph.node})
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    eager = list(Generator(package, "cpu", kv="static", capture="off").generate_ids(PROMPT, params))
    captured = Generator(package, "cpu", kv="static", capture="verify", recorder=ReplayRecorder())
    assert list(captured.generate_ids(PROMPT, params)) == eager
    stats = captured.capture_stats
    assert stats.segments_per_step == 1 and stats.captured_steps > 0
    assert stats.invalidations == 0 and stats.recording_failures == 0 and not stats.quarantined


@pytest.mark.parametrize("family", ["dense"], indirect=True)
def test_a_context_beyond_the_multimodal_rotary_caches_is_refused(family, tmp_path) -> None:
    """MRotaryEmbedding's cos/sin caches bound the positions like RotaryEmbedding's do."""
    import json

    from onnxgen.errors import ModelLoadError
    from onnxgen.genai import Generator
    from onnxgen.models.package_variants import link_package_files

    _, package, _ = family
    link_package_files(package, tmp_path, skip={"genai_config.json"})
    config = json.loads((package / "genai_config.json").read_text())
    config["model"]["context_length"] = 512
    (tmp_path / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"position table cos_cache \(read by MRotaryEmbedding .*holds 256"):
        Generator(tmp_path, "cpu")


@pytest.mark.parametrize("family", ["dense"], indirect=True)
def test_position_streams_must_be_a_fixed_count(family, tmp_path) -> None:
    from onnxgen.errors import ModelLoadError
    from onnxgen.genai import Generator
    from onnxgen.models.package_variants import link_package_files

    _, package, _ = family
    link_package_files(package, tmp_path, skip={"model.onnx"})
    model = onnx.load(str(package / "model.onnx"), load_external_data=False)
    positions = next(v for v in model.graph.input if v.name == "position_ids")
    positions.type.tensor_type.shape.dim[0].dim_param = "streams"
    onnx.save(model, str(tmp_path / "model.onnx"))
    with pytest.raises(ModelLoadError, match=r"position input 'position_ids' has shape \['streams'"):
        Generator(tmp_path, "cpu")


@pytest.mark.parametrize("family", ["moe"], indirect=True)
def test_show_plans_what_the_device_records_by_default(family, tmp_path) -> None:
    """`onnxgen show PKG --capture --device cuda` shows the static-KV plan a CUDA session records
    (one segment); `--kv dynamic` the growing cache's, where the full-attention layer stays eager;
    on the CPU the default is the growing cache."""
    import json

    from onnxgen.errors import OnnxgenError
    from onnxgen.show import show_model

    _, package, _ = family
    cuda = json.loads(show_model(str(package), capture=True, as_json=True, device="cuda"))
    assert cuda["kv"] == "static" and cuda["segments"] == 1
    assert cuda["binding"]["past_sequence_length"] == cuda["binding"]["total_sequence_length"] == 256
    dynamic = json.loads(show_model(str(package), capture=True, as_json=True, device="cuda", kv="dynamic"))
    assert dynamic["kv"] == "dynamic" and dynamic["segments"] == 2
    assert json.loads(show_model(str(package), capture=True, as_json=True))["kv"] == "dynamic"
    text = show_model(str(package), capture=True, device="cuda")
    assert "KV cache: static (what a cuda session uses for this package; --kv dynamic for the other plan)" in text
    bare = tmp_path / "bare.onnx"  # a graph outside any package: no genai_config.json beside it
    onnx.save(onnx.load(str(package / "model.onnx"), load_external_data=False), str(bare))
    with pytest.raises(OnnxgenError, match="it needs a package directory"):
        show_model(str(bare), capture=True, kv="static")


def _decode_feeds(package: Path, past: int) -> dict[str, np.ndarray]:
    """One decode step's feeds after ``past`` tokens (random caches and states, batch 1)."""
    rng = np.random.default_rng(past)
    model = onnx.load(str(package / "model.onnx"), load_external_data=False)
    feeds = {"input_ids": np.array([[5]], np.int64), "attention_mask": np.ones((1, past + 1), np.int64)}
    positions = next((v for v in model.graph.input if v.name == "position_ids"), None)
    if positions is not None:  # onnxgen's gqa layout derives positions from the mask
        rows = len(positions.type.tensor_type.shape.dim)
        feeds["position_ids"] = np.full((3, 1, 1) if rows == 3 else (1, 1), past, np.int64)
    for vi in model.graph.input:
        if vi.name.startswith("past"):
            dims = [d.dim_value if d.HasField("dim_value") else 0 for d in vi.type.tensor_type.shape.dim]
            dims[0] = 1
            if vi.name.endswith((".key", ".value")):
                dims[2], dims[3] = past, 64
            feeds[vi.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


@pytest.mark.parametrize("family", BOTH, indirect=True)
@pytest.mark.parametrize("builder", ["onnxgen", "genai"])
def test_soundness_oracle_of_the_growing_cache_plan(family, builder: str, tmp_path) -> None:
    """The capture plan's soundness oracle on both builders' hybrid graphs: the decode step run by
    onnxruntime at two KV lengths; every node the plan records (growing cache: the classifier
    decides) keeps the shapes of all its inputs and outputs."""
    from onnxgen.models.builder import build_package
    from onnxgen.models.hf_source import HFSource
    from onnxgen.runtime.capture.report import analyse
    from onnxgen.runtime.model_io import load_model
    from tests.shape_helpers import assert_plan_sound, ort_value_shapes, typed_exposed

    checkpoint, package, _ = family
    if builder == "onnxgen":
        package = build_package(HFSource(checkpoint), tmp_path / "onnxgen", precision="fp32")
    model, _ = load_model(package / "model.onnx")
    analysis = analyse(model)
    assert len(analysis.plan.segments) == 2  # the one full-attention layer splits the step
    dtypes = {k: v.dtype for k, v in analysis.shapes.values.items() if v.dtype}
    exposed = typed_exposed(onnx.load(str(package / "model.onnx"), load_external_data=False), dtypes)
    runs = [ort_value_shapes(exposed, _decode_feeds(package, past), base_dir=package) for past in (3, 9)]
    assert runs[0]["logits"] == runs[1]["logits"] and runs[0]["present.3.key"] != runs[1]["present.3.key"]
    checked = assert_plan_sound(analysis.plan, analysis.shapes.nodes, runs, {t.name for t in model.graph.initializer})
    assert checked > 50


@pytest.mark.parametrize("family", ["dense"], indirect=True)
def test_verify_teacher_forces_a_hybrid_with_position_streams(family) -> None:
    """onnxgen verify on onnxruntime-genai's fp32 hybrid package: its one-pass run feeds the three
    position streams and agrees with the fp32 reference everywhere; the engine's decode steps
    (carried states, --capture off) agree with the one pass."""
    from onnxgen.genai.verify import VerifySpec, run_verify

    _, package, _ = family
    for capture in (None, "off"):
        report = run_verify(VerifySpec(package, prompts=[PROMPT], tokens=12, all_positions=True, capture=capture))
        assert report.passed and report.agreement.top1_agreement == 1.0, report.table()
        assert report.agreement.kl_mean < 1e-8, report.table()
