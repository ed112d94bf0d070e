"""Hybrid decoders (Gated DeltaNet + gated full attention, transformers' Qwen3_5ForCausalLM, and
with every MLP a mixture of experts, Qwen3_5MoeForCausalLM) through onnxgen's builder
(models/builder_hybrid.py) and generation engine.

Oracle: transformers (fp32, CPU) on the same tiny random checkpoint: the package's logits over a
prompt and then over decode steps that carry the KV caches and the conv / recurrent states equal
transformers' logits of the whole sequence at those positions. onnxruntime 1.32's CPU build runs
the same package as a second oracle of the graph (its contrib kernels for every op used).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from onnxgen.errors import ModelLoadError
from onnxgen.models.builder import BuildError, build_package
from onnxgen.models.hf_source import HFSource
from tests.test_capture_runtime import write_word_tokenizer

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("this transformers has no Qwen3_5ForCausalLM", allow_module_level=True)

PROMPT = [3, 17, 91, 5, 44, 120, 8]
DECODE = [61, 2, 99]


def tiny_checkpoint(directory: Path, *, value_heads: int, tied: bool, experts: int = 0) -> Path:
    """A 4-layer Qwen3.5-shaped checkpoint (3 Gated DeltaNet layers, then full attention; partial
    rotary, q/k norms, the output gate), random weights including the norms' zero-centred ones.
    head_dim 64: a quarter of it rotates, 16 dimensions, the least onnxruntime's GroupQueryAttention
    takes (its cos cache width must be a multiple of 8)."""
    family = (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM) if experts else (
        transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM)  # fmt: skip
    moe = dict(num_experts=experts, num_experts_per_tok=3, moe_intermediate_size=32, shared_expert_intermediate_size=24)
    config = family[0](
        **(moe if experts else {}),
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=value_heads,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=256,
        layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=tied, eos_token_id=1,
        initializer_range=0.2,  # larger than the default, so that every layer sways the next token
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    )  # fmt: skip
    torch.manual_seed(0)
    model = family[1](config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(("dt_bias", "A_log")):
                param.copy_(0.3 * torch.randn_like(param))
    model.save_pretrained(directory)
    return directory


def hf_model(directory: Path) -> torch.nn.Module:
    model_class = transformers.AutoModelForCausalLM
    return model_class.from_pretrained(directory, dtype=torch.float32).eval()


def hf_logits(directory: Path, ids: list[int]) -> np.ndarray:
    model = hf_model(directory)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


class Stepper:
    """Drives a hybrid package step by step: KV caches grow, conv and recurrent states carry."""

    def __init__(self, package: Path, run):
        self.model = onnx.load(str(package / "model.onnx"), load_external_data=False)
        self.run = run
        self.state: dict[str, np.ndarray] = {}
        for vi in self.model.graph.input:
            if vi.name.startswith("past"):
                dims = [d.dim_value if d.HasField("dim_value") else 0 for d in vi.type.tensor_type.shape.dim]
                dims[0] = 1
                self.state[vi.name] = np.zeros(dims, np.float32)
        self.length = 0

    def step(self, ids: list[int]) -> np.ndarray:
        feeds = {
            "input_ids": np.array([ids], np.int64),
            "attention_mask": np.ones((1, self.length + len(ids)), np.int64),
        }
        outs = self.run({**feeds, **self.state})
        names = [o.name for o in self.model.graph.output]
        values = dict(zip(names, outs))
        for name, value in values.items():
            if name.startswith("present"):
                self.state["past_key_values" + name[len("present") :] if name.endswith(("key", "value"))
                           else "past" + name[len("present") :]] = value  # fmt: skip
        self.length += len(ids)
        return values["logits"][0]


@pytest.fixture(
    scope="module",
    params=[(2, False, 0), (4, True, 0), (4, False, 8)],
    ids=["heads-equal", "more-value-heads-tied", "moe"],
)
def hybrid(request, tmp_path_factory):
    value_heads, tied, experts = request.param
    root = tmp_path_factory.mktemp("hybrid")
    checkpoint = tiny_checkpoint(root / "hf", value_heads=value_heads, tied=tied, experts=experts)
    package = build_package(HFSource(checkpoint), root / "pkg", precision="fp32")
    return checkpoint, package


def _onnxgen_run(package: Path):
    from onnxgen.runtime import InferenceSession

    session = InferenceSession(str(package / "model.onnx"))
    return lambda feeds: session.run(None, feeds)


def _ort_run(package: Path):
    import onnxruntime as ort

    session = ort.InferenceSession(str(package / "model.onnx"), providers=["CPUExecutionProvider"])
    return lambda feeds: session.run(None, feeds)


@pytest.mark.parametrize("engine", ["onnxgen", "onnxruntime"])
def test_hybrid_package_matches_transformers(hybrid, engine: str) -> None:
    checkpoint, package = hybrid
    expected = hf_logits(checkpoint, PROMPT + DECODE)
    stepper = Stepper(package, (_onnxgen_run if engine == "onnxgen" else _ort_run)(package))
    rows = [stepper.step(PROMPT)] + [stepper.step([t]) for t in DECODE]
    actual = np.concatenate(rows, axis=0)
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("engine", ["onnxgen", "onnxruntime"])
def test_folded_reshape_chains_keep_the_hybrid_logits(hybrid, engine: str, tmp_path: Path) -> None:
    """The graph with its Reshape chains folded (runtime/fusion_reshapes.py: the gated attention's
    query heads, and the keys' repeat where value heads outnumber key heads) gives transformers'
    logits as the graph as built does."""
    import shutil

    from onnxgen.runtime.fusion import fuse_graph

    checkpoint, package = hybrid
    folded_package = tmp_path / "folded"
    shutil.copytree(package, folded_package)
    folded, report = fuse_graph(onnx.load(str(package / "model.onnx")), frozenset({"reshape_chains"}))
    assert report.reshape_chains >= 1
    onnx.save(folded, str(folded_package / "model.onnx"))  # the weights inline: a tiny model
    expected = hf_logits(checkpoint, PROMPT + DECODE)
    stepper = Stepper(folded_package, (_onnxgen_run if engine == "onnxgen" else _ort_run)(folded_package))
    rows = [stepper.step(PROMPT)] + [stepper.step([t]) for t in DECODE]
    np.testing.assert_allclose(np.concatenate(rows, axis=0), expected, rtol=1e-4, atol=1e-4)


def test_hybrid_config_is_read_from_the_checkpoint(hybrid) -> None:
    checkpoint, _ = hybrid
    config = HFSource(checkpoint).config
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (
        config.linear_attention is not None
        and config.linear_attention.conv_dim == 2 * 16 + 8 * config.linear_attention.num_value_heads
    )
    assert config.attn_output_gate and config.qk_norm and config.norm_offset == 1.0
    assert config.partial_rotary_factor == 0.25


def test_hybrid_states_keep_fixed_shapes(hybrid) -> None:
    """The Gated DeltaNet layers' carried states are declared with fixed sizes (batch aside): the
    capture classifier sees nothing in them that grows with the sequence."""
    _, package = hybrid
    model = onnx.load(str(package / "model.onnx"), load_external_data=False)
    states = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in model.graph.input
              if vi.name.endswith((".conv", ".recurrent"))}  # fmt: skip
    assert set(states) == {f"past.{i}.{kind}" for i in range(3) for kind in ("conv", "recurrent")}
    assert all(all(isinstance(d, int) for d in dims[1:]) for dims in states.values()), states


def test_hybrid_refuses_the_standard_layout(hybrid, tmp_path) -> None:
    checkpoint, _ = hybrid
    with pytest.raises(BuildError, match="gqa layout only"):
        build_package(HFSource(checkpoint), tmp_path / "std", attention="standard")


@pytest.mark.parametrize("kv", ["auto", "static"])
def test_generator_greedy_equals_transformers(hybrid, kv: str) -> None:
    """The generation engine carries the conv and recurrent states beside the KV cache (growing
    and static caches): its greedy tokens equal transformers' generate."""
    from onnxgen.genai import Generator, SamplingParams

    checkpoint, package = hybrid
    write_word_tokenizer(package, 128)
    model = hf_model(checkpoint)
    model.generation_config.eos_token_id = None  # run on through EOS, as ignore_eos does (without forbidding it)
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12)
    expected = out[0, len(PROMPT) :].tolist()
    generator = Generator(package, "cpu", kv=kv)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    assert list(generator.generate_ids(PROMPT, params)) == expected
    assert list(generator.generate_ids(PROMPT, params)) == expected  # the states start from zero again


def _prompt_matches_transformers(engine, model, ids: list[int], what: str) -> None:
    """The engine's prompt over a fresh static cache: the last row's logits equal transformers' and
    the cache holds the prompt."""
    from onnxgen.genai import SamplingParams

    sequence = engine.new_sequence(ids, SamplingParams(max_new_tokens=1))
    sequence.kv = engine._new_kv(len(ids) + 1)
    with torch.inference_mode():
        ours = engine._prefill(sequence, torch.tensor([ids])).float().numpy()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0, -1].numpy()
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4, err_msg=what)
    assert sequence.kv.length == len(ids)


@pytest.mark.parametrize(
    ("pieces", "sizes", "steps", "shapes"),
    [
        # padded to the next power of two, the states stopping at the last real row (the default)
        ("pad", "pow2", [64, 32, 128], [32, 64, 128]),
        # or to the next of those and 1.5 times a power of two
        ("pad", "fine", [48, 24, 96], [24, 48, 96]),
        # unpadded power-of-two pieces, largest first (37 = 32 + 4 + 1; the one-row piece is a decode step)
        ("split", "pow2", [32, 4, 16, 4, 64, 4], [4, 16, 32, 64]),
    ],
)
def test_hybrid_prompts_run_as_recorded_chunks(
    hybrid, pieces: str, sizes: str, steps: list[int], shapes: list[int]
) -> None:
    """With a static cache a hybrid's prompt chunk runs as recorded steps of a few shapes: padded
    (option prefill_pieces pad), or as unpadded pieces (split), so that two prompt lengths share a
    recording and a recording replays at a later position (the mask spans the cache). The last
    row's logits equal transformers' for every phase (warm-up, recording, replay: the CPU stand-in
    for CUDA graphs). What the padding leaves in the states is test_padded_hybrid_prompts_decode_on."""
    from onnxgen import options
    from onnxgen.genai import Generator
    from onnxgen.runtime.capture.recorder import ReplayRecorder

    checkpoint, package = hybrid
    write_word_tokenizer(package, 128)
    generator = Generator(package, "cpu", kv="static", capture="on", recorder=ReplayRecorder())
    engine = generator.engine
    runtime = engine.prefill_runtime()
    rows: list[int] = []
    original = runtime.run
    runtime.run = lambda feeds, tail=None: rows.append(feeds["input_ids"].shape[1]) or original(feeds, tail)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(1, 128, size=n).tolist() for n in (37, 21, 68)]
    model = hf_model(checkpoint)
    with options.override(prefill_pieces=pieces, prefill_sizes=sizes):
        for attempt in range(4):
            for ids in prompts:
                _prompt_matches_transformers(engine, model, ids, f"{len(ids)}, {attempt}")
    assert rows == steps * 4
    # one recorded shape per chunk size, whatever the chunk's position (rows, cache rows)
    assert sorted(engine._prefill_keys) == [(n, 256) for n in shapes]
    assert engine.prefill_capture_stats.captured_steps > 0


def test_padded_hybrid_prompts_decode_on(hybrid) -> None:
    """A padded prompt chunk must leave the conv and recurrent states as the real rows alone make
    them: the prompt's last-row logits cannot tell (every row is causal), the steps after it can.
    Greedy generations after prompts of 37 and 21 tokens (padded to 64 and 32 rows, recorded and
    replayed: the CPU stand-in for CUDA graphs) equal transformers' generate."""
    from onnxgen import options
    from onnxgen.genai import Generator, SamplingParams
    from onnxgen.runtime.capture.recorder import ReplayRecorder

    checkpoint, package = hybrid
    write_word_tokenizer(package, 128)
    model = hf_model(checkpoint)
    model.generation_config.eos_token_id = None
    rng = np.random.default_rng(17)
    prompts = [rng.integers(1, 128, size=n).tolist() for n in (37, 21)]
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8)
        expected.append(out[0, len(ids) :].tolist())
    generator = Generator(package, "cpu", kv="static", capture="on", recorder=ReplayRecorder())
    rows: list[int] = []
    runtime = generator.engine.prefill_runtime()
    original = runtime.run
    runtime.run = lambda feeds, tail=None: rows.append(feeds["input_ids"].shape[1]) or original(feeds, tail)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with options.override(prefill_pieces="pad", prefill_sizes="pow2"):
        for attempt in range(3):  # warm-up, recording, replay
            for ids, tokens in zip(prompts, expected, strict=True):
                assert list(generator.generate_ids(ids, params)) == tokens, (len(ids), attempt)
    assert rows == [64, 32] * 3


@pytest.mark.parametrize(
    ("rows", "pow2", "fine"),
    [(1, 16, 16), (16, 16, 16), (17, 32, 24), (24, 32, 24), (25, 32, 32), (33, 64, 48), (49, 64, 64),
     (100, 128, 128), (700, 1024, 768), (1024, 1024, 1024)],
)  # fmt: skip
def test_padded_rows(rows: int, pow2: int, fine: int) -> None:
    """A padded chunk's rows: the next power of two of at least 16, or (fine) the next of those and
    1.5 times a power of two from 24 on; 13 sizes from 16 to 1,024 rows (the recordings they need,
    under the engine's 16)."""
    from onnxgen.genai.engine import DecodeEngine, padded_rows

    assert padded_rows(rows, 16, fine=False) == pow2
    assert padded_rows(rows, 16, fine=True) == fine
    assert len({padded_rows(n, 16, fine=True) for n in range(1, 1025)}) == 13 <= DecodeEngine.captured_prefill_keys


@pytest.mark.parametrize(
    ("rows", "pow2", "fine"),
    [
        (37, [32, 4, 1], [32, 4, 1]),
        (24, [16, 8], [24]),
        (56, [32, 16, 8], [48, 8]),
        (100, [64, 32, 4], [96, 4]),
        (1000, [512, 256, 128, 64, 32, 8], [768, 192, 32, 8]),
        (1024, [1024], [1024]),
        (12, [8, 4], [8, 4]),  # no 1.5x piece below 24 rows
    ],
)
def test_prompt_pieces(rows: int, pow2: list[int], fine: list[int]) -> None:
    """A split hybrid prompt chunk's unpadded pieces: powers of two, or (option prefill_sizes fine)
    also 1.5 times a power of two from 24 on; largest first, summing to the chunk, and no more than
    16 sizes up to 1,024 rows besides the one-row decode step (the recordings they need)."""
    from onnxgen import options
    from onnxgen.genai.engine import prompt_pieces

    assert prompt_pieces(rows, fine=False) == pow2
    with options.override(prefill_sizes="pow2"):
        assert prompt_pieces(rows) == pow2
    with options.override(prefill_sizes="fine"):
        assert prompt_pieces(rows) == fine
    sizes = {p for n in range(1, 1025) for p in prompt_pieces(n, fine=True) if p > 1}
    assert len(sizes) == 16 and sum(prompt_pieces(999, fine=True)) == 999


def test_hybrid_prompts_in_fine_pieces(hybrid) -> None:
    """Options prefill_pieces split, prefill_sizes fine: a 56-token prompt runs as 48 + 8 rows, 24 as
    one piece, 100 as 96 + 4, captured (the CPU stand-in for CUDA graphs) or not, and the last row's
    logits equal transformers' either way."""
    from onnxgen import options
    from onnxgen.genai import Generator
    from onnxgen.runtime.capture.recorder import ReplayRecorder

    checkpoint, package = hybrid
    write_word_tokenizer(package, 128)
    model = hf_model(checkpoint)
    rng = np.random.default_rng(13)
    prompts = [rng.integers(1, 128, size=n).tolist() for n in (56, 24, 100)]
    with options.override(prefill_pieces="split", prefill_sizes="fine"):
        for capture in ("on", "off"):
            recorder = ReplayRecorder() if capture == "on" else None
            engine = Generator(package, "cpu", kv="static", capture=capture, recorder=recorder).engine
            engine.prefill_chunk = 0  # the CPU's 256-token chunks would not cut these anyway; one span
            rows: list[int] = []
            forward = engine._forward
            engine._forward = lambda seq, chunk, *a, _f=forward, _r=rows, **k: (
                _r.append(chunk.shape[1]) or _f(seq, chunk, *a, **k)
            )
            for attempt in range(3 if capture == "on" else 1):  # warm-up, recording, replay
                for ids in prompts:
                    _prompt_matches_transformers(engine, model, ids, f"{capture} {attempt}")
            assert rows[:5] == [48, 8, 24, 96, 4], (capture, rows)


@pytest.mark.parametrize(("pieces", "sizes"), [("pad", "pow2"), ("pad", "fine"), ("split", "pow2"), ("split", "fine")])
def test_a_hybrid_prompt_computes_the_same_bits_captured_or_not(hybrid, pieces: str, sizes: str) -> None:
    """The capture setting must not change what a prompt computes: with a static cache a hybrid's
    prompt runs in the same padded chunks (or the same unpadded pieces) whether its steps are
    recorded or not. (The H200 run of 2026-12-05 found a captured generation parting from the
    uncaptured one after 30 tokens: the captured prompt ran as 8 + 4 rows, the uncaptured one as
    12, and a chunk split otherwise rounds otherwise.) The last row's logits are compared bit for
    bit, recorded (the CPU stand-in for CUDA graphs) against not, for lengths of one, two and three
    pieces. The uncaptured engine holds a recorder too: on the CPU that is what says it stands in
    for CUDA, where a padded prompt pads with capture off as well (without one the CPU runs a
    chunk whole)."""
    from onnxgen import options
    from onnxgen.genai import Generator, SamplingParams
    from onnxgen.runtime.capture.recorder import ReplayRecorder

    checkpoint, package = hybrid
    write_word_tokenizer(package, 128)
    rng = np.random.default_rng(5)
    engines = {
        "off": Generator(package, "cpu", kv="static", capture="off", recorder=ReplayRecorder()).engine,
        "on": Generator(package, "cpu", kv="static", capture="on", recorder=ReplayRecorder()).engine,
    }
    for n in (16, 12, 37, 56):  # 56: three pieces, or two of option prefill_sizes's finer sizes
        ids = rng.integers(1, 128, size=n).tolist()
        logits = {}
        for mode, engine in engines.items():
            for _ in range(3):  # warm-up, recording, replay
                sequence = engine.new_sequence(ids, SamplingParams(max_new_tokens=1))
                sequence.kv = engine._new_kv(n + 1)
                with torch.inference_mode(), options.override(prefill_pieces=pieces, prefill_sizes=sizes):
                    logits[mode] = engine._prefill(sequence, torch.tensor([ids])).clone()
        assert torch.equal(logits["on"], logits["off"]), n
    assert engines["on"].prefill_capture_stats.captured_steps > 0


def test_hybrid_decode_step_is_one_recorded_segment(hybrid) -> None:
    """With a static cache the whole decode step plans as one segment (the conv and recurrent
    state updates, the gates and norms recorded with the attention), and replaying it (the CPU
    stand-in for CUDA graphs, verify mode: each replay checked against eager) gives the eager
    generation's tokens. The captured prompt chunk runs padded (the CPU's uncaptured one whole)."""
    from onnxgen.genai import Generator, SamplingParams
    from onnxgen.runtime.capture.recorder import ReplayRecorder
    from onnxgen.runtime.capture.report import analyse

    checkpoint, package = hybrid
    write_word_tokenizer(package, 128)
    model = onnx.load(str(package / "model.onnx"), load_external_data=False)
    analysis = analyse(model, {"past_sequence_length": 256, "total_sequence_length": 256})
    (segment,) = analysis.plan.segments
    recorded = {analysis.plan.nodes[i].op_type for i in segment}
    assert {"CausalConvWithState", "LinearAttention", "GatedRMSNorm", "GroupQueryAttention"} <= recorded
    assert ("MoE" in recorded) == (HFSource(checkpoint).config.moe is not None)  # routing on the device
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    eager = list(Generator(package, "cpu", kv="static", capture="off").generate_ids(PROMPT, params))
    captured = Generator(package, "cpu", kv="static", capture="verify", recorder=ReplayRecorder())
    rows: list[int] = []
    runtime = captured.engine.prefill_runtime()
    original = runtime.run
    runtime.run = lambda feeds, tail=None: rows.append(feeds["input_ids"].shape[1]) or original(feeds, tail)
    assert list(captured.generate_ids(PROMPT, params)) == eager
    stats = captured.capture_stats
    assert stats.segments_per_step == 1 and stats.captured_steps > 0
    assert stats.invalidations == 0 and stats.recording_failures == 0 and not stats.quarantined
    # padded to 16 rows, the states stopping at row 7 (test_padded_hybrid_prompts_decode_on)
    assert len(PROMPT) == 7 and rows == [16]


def test_the_multimodal_wrappers_text_part_builds(tmp_path) -> None:
    """Published Qwen3.5 checkpoints are Qwen3_5ForConditionalGeneration: the decoder under
    model.language_model.*, a vision tower under model.visual.*, the text config nested. The
    package is the text part; its logits equal the wrapper's on text-only input."""
    text = tiny_checkpoint(tmp_path / "text", value_heads=4, tied=False)
    text_config = transformers.AutoConfig.from_pretrained(text).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=2,
                  spatial_merge_size=1, temporal_patch_size=1)  # fmt: skip
    config = transformers.Qwen3_5Config(text_config=text_config, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(1)
    wrapper = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in wrapper.named_parameters():
            if name.endswith(("norm.weight", "dt_bias", "A_log")) and "language_model" in name:
                param.copy_(0.3 * torch.randn_like(param))
    wrapper.save_pretrained(tmp_path / "wrapper")
    source = HFSource(tmp_path / "wrapper")
    assert not any(name.startswith("model.visual") for name in source.names())
    package = build_package(source, tmp_path / "pkg", precision="fp32")
    with torch.no_grad():
        expected = wrapper(input_ids=torch.tensor([PROMPT])).logits[0].numpy()
    actual = Stepper(package, _onnxgen_run(package)).step(PROMPT)
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=1e-4)


def test_int4_moe_package_matches_its_dequantized_weights(tmp_path) -> None:
    """int4 builds quantize the routed experts into QMoE's layout (4-bit blocks along K) and every
    other linear into MatMulNBits. Oracle: an fp32 package over the same weights quantized and
    dequantized. Rows differ by MatMulNBits' int8 activations (accuracy level 4 on the CPU), and
    where those move a router's top k a row differs more (routing is discontinuous), so the median
    row is held to 3% and every row's argmax to the reference's. onnxruntime runs the int4 package
    too; its level-4 activations differ more from the reference (measured 2-9% per row on the
    dense hybrid, more with experts), so it is held to the same tokens only."""
    from tests.test_builder import DequantizedSource

    checkpoint = tiny_checkpoint(tmp_path / "hf", value_heads=4, tied=False, experts=8)
    q4 = build_package(HFSource(checkpoint), tmp_path / "q4", precision="int4")
    reference = build_package(DequantizedSource(HFSource(checkpoint)), tmp_path / "ref", precision="fp32")
    ops = [n.op_type for n in onnx.load(str(q4 / "model.onnx"), load_external_data=False).graph.node]
    assert ops.count("QMoE") == 4 and "MoE" not in ops
    ids = PROMPT + DECODE
    actual = Stepper(q4, _onnxgen_run(q4)).step(ids)
    expected = Stepper(reference, _onnxgen_run(reference)).step(ids)
    rows = np.linalg.norm(actual - expected, axis=-1) / np.linalg.norm(expected, axis=-1)
    assert np.median(rows) < 0.03, rows
    assert (actual.argmax(-1) == expected.argmax(-1)).all()
    ort = Stepper(q4, _ort_run(q4)).step(ids)
    assert (actual.argmax(-1) == ort.argmax(-1)).mean() >= 0.8


def test_fp16_package_stays_close_to_fp32(hybrid, tmp_path) -> None:
    """fp16 activations and weights (the CUDA precision, run here on the CPU): logits within what
    fp16 rounding costs over four layers, every row's token the fp32 package's."""
    checkpoint, package = hybrid
    half = build_package(HFSource(checkpoint), tmp_path / "fp16", precision="fp16")
    ids = PROMPT + DECODE
    expected = Stepper(package, _onnxgen_run(package)).step(ids)
    stepper = Stepper(half, _onnxgen_run(half))
    stepper.state = {name: value.astype(np.float16) for name, value in stepper.state.items()}
    actual = stepper.step(ids).astype(np.float32)
    assert np.linalg.norm(actual - expected) / np.linalg.norm(expected) < 0.01
    assert (actual.argmax(-1) == expected.argmax(-1)).all()
    # onnxruntime takes the fp16 graph as it is (its schemas type LinearAttentionGate's dt_bias and
    # decay scale as float32 only) and computes the same tokens
    theirs = Stepper(half, _ort_run(half))
    theirs.state = {name: value.astype(np.float16) for name, value in theirs.state.items()}
    ort_logits = theirs.step(ids).astype(np.float32)
    assert np.linalg.norm(ort_logits - expected) / np.linalg.norm(expected) < 0.01
    assert (ort_logits.argmax(-1) == expected.argmax(-1)).all()


def test_serve_batches_hybrids_and_falls_back_where_it_cannot_batch(tmp_path) -> None:
    """The CPU's batching default takes a hybrid decoder (eager batched steps carry its states); a
    graph the batching runner cannot take (attention that concatenates its own KV) is served one
    request at a time: `onnxgen serve` says so once, with the reason; a --max-num-seqs the user
    gave is kept (the load then fails with the same reason)."""
    from onnxgen.server.options import ServeOptions, runner_for_package
    from tests.server_helpers import post
    from tests.test_server_cli import start

    hybrid = build_package(HFSource(tiny_checkpoint(tmp_path / "hf", value_heads=2, tied=False)), tmp_path / "pkg",
                           precision="fp32")  # fmt: skip
    assert runner_for_package(ServeOptions(model_name="m"), hybrid) == (ServeOptions(model_name="m"), None)
    standard = build_package(HFSource(dense_checkpoint(tmp_path / "dense")), tmp_path / "std", precision="fp32",
                             attention="standard")  # fmt: skip
    write_word_tokenizer(standard, 128)
    options, note = runner_for_package(ServeOptions(model_name="m"), standard)
    assert options.batch_size == 1 and "served one request at a time, not 8 at once" in note
    assert "concatenates its own KV cache" in note
    kept, none = runner_for_package(ServeOptions(model_name="m", max_num_seqs=4), standard)
    assert kept.batch_size == 4 and none is None

    process, port, lines = start(model=standard)
    try:
        text = "".join(lines)
        assert text.count("served one request at a time") == 1 and "one request at a time" in text.split("ready:")[1]
        status, body = post(port, "/v1/completions", {"prompt": [3, 17, 91], "max_tokens": 4, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    finally:
        process.terminate()
        process.wait(30)


def dense_checkpoint(directory: Path) -> Path:
    """A tiny Qwen2 checkpoint (the dense decoders onnxgen batches)."""
    config = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      eos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def test_onnxruntime_genai_runs_the_package(hybrid) -> None:
    """genai_config.json names the carried states as onnxruntime-genai's own Qwen3.5 packages do
    (past_conv_names, past_recurrent_names and their present forms): onnxruntime-genai 0.18 then
    runs onnxgen's hybrid graph, with transformers' greedy tokens."""
    import json

    from tests.test_generator import genai_greedy

    checkpoint, package = hybrid
    write_word_tokenizer(package, 128)
    decoder = json.loads((package / "genai_config.json").read_text())["model"]["decoder"]
    assert decoder["inputs"]["past_recurrent_names"] == "past.%d.recurrent"
    assert decoder["outputs"]["present_conv_names"] == "present.%d.conv"
    model = hf_model(checkpoint)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=12)
    expected = out[0, len(PROMPT) :].tolist()
    theirs = genai_greedy(package, PROMPT, 12)  # stops at an EOS id, if one comes
    assert theirs == expected[: len(theirs)] and len(theirs) >= 3


def test_a_moe_config_without_a_dense_width_builds(tmp_path) -> None:
    """Every MLP of the MoE family is experts; its published config has no intermediate_size (only
    moe_intermediate_size): the builder does not need one. A dense hybrid's config still must."""
    import json

    for experts in (8, 0):
        checkpoint = tiny_checkpoint(tmp_path / f"hf{experts}", value_heads=2, tied=False, experts=experts)
        config = json.loads((checkpoint / "config.json").read_text())
        del config["intermediate_size"]
        (checkpoint / "config.json").write_text(json.dumps(config))
        if experts:
            assert HFSource(checkpoint).config.moe is not None
            build_package(HFSource(checkpoint), tmp_path / "pkg", precision="fp32")
        else:
            with pytest.raises(ModelLoadError, match="intermediate_size"):
                HFSource(checkpoint)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda d: [d["inputs"].pop(k) for k in ("past_conv_names", "past_recurrent_names")],
            r"input\(s\) past\.0\.conv.*past_<kind>_names",
        ),
        (
            lambda d: d["outputs"].pop("present_recurrent_names"),
            "past_recurrent_names declares a carried state.*no 'present_recurrent_names'",
        ),
        (lambda d: d["inputs"].update(past_conv_names="state.%d.conv"), "'state.%d.conv' match no input"),
        (lambda d: d["outputs"].update(present_conv_names="new.%d.conv"), "'new.0.conv'.*is not a graph output"),
    ],
    ids=["undeclared", "no-present", "no-such-input", "present-not-an-output"],
)
def test_carried_states_come_from_the_declared_names(hybrid, tmp_path, change, message) -> None:
    """The engine carries what genai_config.json declares (past_<kind>_names with present_<kind>_names,
    onnxruntime-genai's convention), not what some op type reads, so a device rewrite that renames
    the op cannot hide a state. Each declaration fault is a one-line error naming it."""
    import json
    import shutil

    from onnxgen.genai import Generator

    _, package = hybrid
    copy = tmp_path / "pkg"
    shutil.copytree(package, copy)
    path = copy / "genai_config.json"
    config = json.loads(path.read_text())
    change(config["model"]["decoder"])
    path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        Generator(copy)
