"""The ONNX builder against independent oracles: transformers (same weights), onnxruntime on the
raw graph, onnxruntime-genai on the package, and a spec-level numpy unpacking of MatMulNBits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from onnxgen.models.builder import BuildError, build_package
from onnxgen.models.config import DecoderConfig, WeightSource
from onnxgen.models.hf_reference import transformers_config
from onnxgen.models.hf_source import HFSource
from onnxgen.models.quantize import quantize_4bit, quantize_4bit_symmetric
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource

CONTEXT = 64
PROMPT = [5, 17, 300, 42, 8, 99]
DECODE = [7, 250, 31]


# --- helpers -------------------------------------------------------------------------------


def hf_model(config: DecoderConfig, source: WeightSource) -> torch.nn.Module:
    """A transformers model of the same architecture holding the source's weights (fp32, eager attention)."""
    import transformers

    hf_config = transformers_config(config)
    model_cls = transformers.AutoModelForCausalLM
    model = model_cls.from_config(hf_config, attn_implementation="eager").eval()
    state = {name: torch.from_numpy(source.get(name)) for name in source.names()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    return model


def hf_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def session(directory: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(directory / "model.onnx"), options, providers=["CPUExecutionProvider"])


def empty_kv(config: DecoderConfig, dtype, batch: int = 1) -> dict[str, np.ndarray]:
    shape = (batch, config.num_key_value_heads, 0, config.head_dim)
    return {
        f"past_key_values.{i}.{kind}": np.zeros(shape, dtype)
        for i in range(config.num_hidden_layers)
        for kind in ("key", "value")
    }


class OrtDecoder:
    """Drives the raw graph step by step with a growing KV cache (the manual oracle loop)."""

    def __init__(self, directory: Path, config: DecoderConfig, sess=None) -> None:
        self.sess = sess or session(directory)
        self.config = config
        self.names = [o.name for o in self.sess.get_outputs()]
        self.wants_positions = "position_ids" in {i.name for i in self.sess.get_inputs()}
        kv_type = next(i.type for i in self.sess.get_inputs() if i.name.startswith("past"))
        self.kv = empty_kv(config, np.float16 if "float16" in kv_type else np.float32)
        self.length = 0

    def step(self, ids: list[int]) -> np.ndarray:
        n = len(ids)
        feeds = {
            "input_ids": np.array([ids], np.int64),
            "attention_mask": np.ones((1, self.length + n), np.int64),
            **self.kv,
        }
        if self.wants_positions:
            feeds["position_ids"] = np.arange(self.length, self.length + n, dtype=np.int64)[None]
        outs = dict(zip(self.names, self.sess.run(None, feeds)))
        self.kv = {name.replace("present", "past_key_values"): v for name, v in outs.items() if name != "logits"}
        self.length += n
        return outs["logits"][0].astype(np.float32)

    def greedy(self, prompt: list[int], count: int) -> list[int]:
        logits, tokens = self.step(prompt), []
        for _ in range(count):
            tokens.append(int(np.argmax(logits[-1])))
            logits = self.step(tokens[-1:])
        return tokens


def onnxgen_decode_logits(directory: Path, config: DecoderConfig) -> np.ndarray:
    """decode_logits over onnxgen's InferenceSession (CPU) instead of onnxruntime's."""
    from onnxgen.runtime import InferenceSession

    dec = OrtDecoder(directory, config, InferenceSession(str(directory / "model.onnx"), device="cpu"))
    return np.concatenate([dec.step(PROMPT)] + [dec.step([t]) for t in DECODE], axis=0)


def decode_logits(directory: Path, config: DecoderConfig) -> np.ndarray:
    """Logits of PROMPT (prefill) then DECODE one token at a time, stacked [len, vocab]."""
    dec = OrtDecoder(directory, config)
    rows = [dec.step(PROMPT)]
    rows += [dec.step([t]) for t in DECODE]
    return np.concatenate(rows, axis=0)


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """Build each (config, precision, device, flavour) once per module."""
    built: dict[tuple, Path] = {}

    def get(name: str, precision: str = "fp32", device: str = "cpu", attention: str = "gqa") -> Path:
        key = (name, precision, device, attention)
        if key not in built:
            out = tmp_path_factory.mktemp("_".join(key))
            build_package(RandomSource(TINY_CONFIGS[name], seed=1), out, precision, device, attention, CONTEXT)
            built[key] = out
        return built[key]

    return get


# --- (1) fp32 graphs match transformers at prefill and decode -------------------------------


@pytest.mark.parametrize("attention", ["gqa", "standard"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-llama-mha"])
def test_fp32_matches_transformers(packages, name, attention):
    config = TINY_CONFIGS[name]
    ours = decode_logits(packages(name, attention=attention), config)
    ref = hf_logits(hf_model(config, RandomSource(config, seed=1)), PROMPT + DECODE)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_standard_left_padding_matches_transformers(packages):
    """Batch of two, the shorter one left-padded: mask and position_ids must hide the pad slots."""
    config = TINY_CONFIGS["tiny-llama"]
    sess = session(packages("tiny-llama", attention="standard"))
    short = PROMPT[2:]
    ids = np.array([PROMPT, [0, 0] + short], np.int64)
    mask = np.array([[1] * 6, [0, 0, 1, 1, 1, 1]], np.int64)
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **empty_kv(config, np.float32, 2)}
    names = [o.name for o in sess.get_outputs()]
    outs = dict(zip(names, sess.run(None, feeds)))
    # One decode step on top of the padded cache.
    step = {
        "input_ids": np.array([[7], [7]], np.int64),
        "attention_mask": np.concatenate([mask, [[1], [1]]], 1),
        "position_ids": positions[:, -1:] + 1,
    }
    step |= {n.replace("present", "past_key_values"): v for n, v in outs.items() if n != "logits"}
    step_logits = sess.run(["logits"], step)[0]
    model = hf_model(config, RandomSource(config, seed=1))
    for row, seq in ((0, PROMPT), (1, short)):
        ref = hf_logits(model, seq + [7])
        scale = np.abs(ref).max()
        np.testing.assert_allclose(outs["logits"][row, -len(seq) :], ref[:-1], rtol=1e-4, atol=1e-4 * scale)
        np.testing.assert_allclose(step_logits[row, 0], ref[-1], rtol=1e-4, atol=1e-4 * scale)


# --- (2) int4 and fp16 stay close to fp32 ----------------------------------------------------


def _relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class LinearsMappedSource:
    """The source with each linear weight (2-D, the embedding kept) passed through ``linear``."""

    def __init__(self, source: WeightSource) -> None:
        self.source, self.config = source, source.config

    def names(self) -> list[str]:
        return self.source.names()

    def get(self, name: str) -> np.ndarray:
        array = self.source.get(name)
        if array.ndim == 2 and name != "model.embed_tokens.weight":
            return self.linear(array)
        return array

    def linear(self, array: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class DequantizedSource(LinearsMappedSource):
    """The source's linear weights passed through 4-bit quantization and back (embedding kept)."""

    def linear(self, array: np.ndarray) -> np.ndarray:
        return quantize_4bit(array).dequantize()


@pytest.mark.parametrize("attention", ["gqa", "standard"])
def test_int4_matches_dequantized_fp32(packages, tmp_path, attention):
    """int4 graph == fp32 graph over the dequantized weights, up to MatMulNBits' int8 activations
    (accuracy_level 4) on CPU; and int4 vs the original fp32 stays within what 4-bit Gaussian
    weights cost (~8% per linear: measured 18% on logits after 4 linears deep)."""
    config = TINY_CONFIGS["tiny-llama"]  # untied, so every linear is quantized in both
    build_package(DequantizedSource(RandomSource(config, seed=1)), tmp_path, "fp32", "cpu", attention, CONTEXT)
    q4 = decode_logits(packages("tiny-llama", "int4", attention=attention), config)
    assert _relative_error(q4, decode_logits(tmp_path, config)) < 0.03
    fp32 = decode_logits(packages("tiny-llama"), config)
    assert _relative_error(q4, fp32) < 0.25
    assert np.mean(np.argmax(q4, -1) == np.argmax(fp32, -1)) >= 0.6


class SymmetricSource(LinearsMappedSource):
    """The source's linear weights through symmetric 4-bit quantization and back (embedding kept)."""

    def linear(self, array: np.ndarray) -> np.ndarray:
        return quantize_4bit_symmetric(array).dequantize()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_int4_without_zero_points(tmp_path, name):
    """--int4-zero-points none: symmetric blocks, MatMulNBits and the tied embedding's
    GatherBlockQuantized with no zero-point input (the op's default 8); its logits are the fp32
    graph's over the same symmetric-dequantized weights (onnxruntime at accuracy_level 4 on the
    CPU, as test_int4_matches_dequantized_fp32), and onnxgen's match onnxruntime's on it."""
    config = TINY_CONFIGS[name]
    source = RandomSource(config, seed=1)
    int4 = build_package(source, tmp_path / "int4", "int4", "cpu", "gqa", CONTEXT, int4_zero_points="none")
    model = onnx.load(str(int4 / "model.onnx"), load_external_data=False)
    quantized = [n for n in model.graph.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized")]
    assert quantized and all(len([i for i in n.input if i]) == 3 for n in quantized), [list(n.input) for n in quantized]
    assert any(n.op_type == "GatherBlockQuantized" for n in quantized) == config.tie_word_embeddings
    if not config.tie_word_embeddings:
        build_package(SymmetricSource(source), tmp_path / "fp32", "fp32", "cpu", "gqa", CONTEXT)
        theirs = decode_logits(int4, config)
        assert _relative_error(theirs, decode_logits(tmp_path / "fp32", config)) < 0.03
    ours = onnxgen_decode_logits(int4, config)
    assert _relative_error(ours, decode_logits(int4, config)) < 0.03


class GridSource(LinearsMappedSource):
    """The source's linear weights moved onto a 4-bit grid of their own in every block of 32 along K,
    as a GGUF Q4_1 checkpoint holds them: min + d * code, both ends of the code range used, min and
    d rounded to fp16 (the embedding kept)."""

    def linear(self, array: np.ndarray) -> np.ndarray:
        n, k = array.shape
        blocks = array.reshape(n, k // 32, 32)
        low = blocks.min(axis=2).astype(np.float16).astype(np.float32)[..., None]
        step = ((blocks.max(axis=2)[..., None] - low) / 15).astype(np.float16).astype(np.float32)
        codes = np.clip(np.rint((blocks - low) / step), 0, 15)
        codes[..., 0], codes[..., 1] = 0, 15
        return (low + step * codes).reshape(n, k).astype(np.float32)


def test_int4_of_weights_on_a_4bit_grid_holds_them_exactly(tmp_path):
    """A checkpoint that is 4-bit already (blocks of min + d * code): the int4 package keeps its
    values with float zero points instead of rounding them onto another grid, so its logits are
    the fp32 build's (onnxruntime, which runs MatMulNBits with float zero points in fp32); its
    MatMulNBits tensors dequantize to the checkpoint's weights. A 4-bit zero point can place such
    a grid only where 0 falls on it: rounding the same weights that way moves the logits by
    several percent."""
    config = TINY_CONFIGS["tiny-llama"]  # untied: every linear is a MatMulNBits of its own
    source = GridSource(RandomSource(config, seed=1))
    fp32 = build_package(source, tmp_path / "fp32", "fp32", "cpu", "gqa", CONTEXT)
    int4 = build_package(source, tmp_path / "int4", "int4", "cpu", "gqa", CONTEXT)
    model = onnx.load(str(int4 / "model.onnx"))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    assert nodes and all(inits[n.input[3]].dtype == np.float32 for n in nodes)  # float zero points
    down = next(n for n in nodes if "layers.1.mlp.down_proj" in n.name)
    b, scales, zeros = (inits[name] for name in down.input[1:4])
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[0], -1).astype(np.float32)
    n_rows, n_blocks = b.shape[0], b.shape[1]
    deq = (codes.reshape(n_rows, n_blocks, 32) - zeros.reshape(n_rows, n_blocks, 1)) * scales.reshape(
        n_rows, n_blocks, 1
    )
    want = source.get("model.layers.1.mlp.down_proj.weight")
    np.testing.assert_allclose(deq.reshape(n_rows, -1), want, rtol=0, atol=1e-6 * np.abs(want).max())
    assert _relative_error(decode_logits(int4, config), decode_logits(fp32, config)) < 1e-4
    rounded = quantize_4bit(want).dequantize()
    assert _relative_error(rounded, want) > 0.01  # what the 4-bit zero point form would have held


def test_int4_tied_head_close_to_fp32(packages):
    config = TINY_CONFIGS["tiny-qwen2"]  # tied: Gather keeps the float table, the head is quantized
    fp32 = decode_logits(packages("tiny-qwen2"), config)
    q4 = decode_logits(packages("tiny-qwen2", "int4"), config)
    assert _relative_error(q4, fp32) < 0.25
    assert np.mean(np.argmax(q4, -1) == np.argmax(fp32, -1)) >= 0.8


def test_int4_tied_table_is_stored_once_in_4_bits(packages):
    """A tied int4 gqa package holds no float embedding table: GatherBlockQuantized reads the LM
    head's own MatMulNBits codes, scales and zero points through Reshapes (the values are checked
    against onnxruntime by test_model_parity's tied int4 case)."""
    model = onnx.load(str(packages("tiny-qwen2", "int4") / "model.onnx"), load_external_data=False)
    assert "model.embed_tokens.weight" not in {t.name for t in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    (gather,) = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    (head,) = [n for n in model.graph.node if n.op_type == "MatMulNBits" and n.output[0] == "logits"]
    sources = [producers[name] for name in (gather.input[0], gather.input[2], gather.input[3])]
    assert [node.op_type for node in sources] == ["Reshape"] * 3
    assert [node.input[0] for node in sources] == list(head.input[1:4])


@pytest.mark.parametrize("attention", ["gqa", "standard"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])  # tied: fp16 Gemm head on the table
def test_fp16_close_to_fp32(packages, name, attention):
    config = TINY_CONFIGS[name]
    fp32 = decode_logits(packages(name), config)
    fp16 = decode_logits(packages(name, "fp16", attention=attention), config)
    assert _relative_error(fp16, fp32) < 5e-3


@pytest.mark.parametrize("attention", ["gqa", "standard"])
def test_fp16_tokens_part_from_fp32_only_at_near_ties(packages, attention):
    """The fp32 teacher-forcing oracle (onnxgen verify) on the fp16 graph: every position's argmax is the
    fp32 computation's, or the fp32 logits put the two tokens within a near-tie (0.5 logits)."""
    from onnxgen.genai.verify import VerifySpec, run_verify

    package = packages("tiny-llama", "fp16", attention=attention)
    report = run_verify(VerifySpec(package, prompts=[PROMPT, DECODE], tokens=24, all_positions=True))
    assert report.passed and report.agreement.real_disagreements == 0, report.table()


def test_matmulnbits_packing_matches_spec():
    """onnxruntime's MatMulNBits on our packed tensors equals x @ W_deq^T, W_deq unpacked here from the spec."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    n, k, block = 24, 80, 32  # k not a multiple of the block: a padded last block, odd block count
    w = rng.standard_normal((n, k)).astype(np.float32)
    q = quantize_4bit(w, block)
    b, scales, zp = q.matmulnbits_tensors()
    n_blocks = -(-k // block)
    assert b.shape == (n, n_blocks, block // 2) and scales.shape == (n * n_blocks,)
    assert zp.shape == (n * ((n_blocks + 1) // 2),)
    # Spec unpacking: low nibble first along K; zero points two blocks per byte per row.
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, n_blocks * block).astype(np.float32)
    zrow = zp.reshape(n, -1)
    zps = np.stack([zrow & 0x0F, zrow >> 4], axis=-1).reshape(n, -1)[:, :n_blocks].astype(np.float32)
    deq = ((codes.reshape(n, n_blocks, block) - zps[..., None]) * scales.reshape(n, n_blocks, 1)).reshape(n, -1)[:, :k]
    assert np.abs(deq - w).max() <= scales.max() / 2 + 1e-6  # round-to-nearest error bound

    node = helper.make_node(
        "MatMulNBits",
        ["x", "b", "s", "z"],
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=block,
        accuracy_level=0,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])],
        initializer=[onnx.numpy_helper.from_array(a, nm) for a, nm in ((b, "b"), (scales, "s"), (zp, "z"))],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x @ deq.T, rtol=1e-4, atol=1e-4)


# --- (3) onnxruntime-genai runs the packages, token for token -------------------------------


@pytest.mark.parametrize(
    "name,precision,device,attention",
    [
        ("tiny-llama", "fp32", "cpu", "gqa"),
        ("tiny-llama", "fp32", "cpu", "standard"),
        ("tiny-llama", "int4", "cpu", "gqa"),
        ("tiny-llama", "fp16", "cpu", "standard"),
        ("tiny-qwen2", "fp32", "cpu", "standard"),
        ("tiny-llama", "int4", "cuda", "gqa"),  # shared past/present buffer, run by genai on CPU
    ],
)
def test_genai_greedy_matches_raw_graph(packages, tmp_path, name, precision, device, attention):
    og = pytest.importorskip("onnxruntime_genai")
    directory = packages(name, precision, device, attention)
    expected = OrtDecoder(directory, TINY_CONFIGS[name]).greedy(PROMPT, 16)
    if device == "cuda":  # same package, CUDA provider dropped so the CPU build of genai can load it
        cfg = json.loads((directory / "genai_config.json").read_text())
        assert cfg["search"]["past_present_share_buffer"] is True
        cfg["model"]["decoder"]["session_options"]["provider_options"] = []
        for file in ("model.onnx", "model.onnx.data"):
            (tmp_path / file).symlink_to(directory / file)
        (tmp_path / "genai_config.json").write_text(json.dumps(cfg))
        directory = tmp_path
    model = og.Model(str(directory))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(PROMPT) + 16, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([PROMPT], np.int32))
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    assert tokens == expected
    if not TINY_CONFIGS[name].tie_word_embeddings:  # random tied heads echo the last token
        assert len(set(tokens)) > 3  # a real sequence, not one token repeated


def test_genai_config_fields(packages):
    cfg = json.loads((packages("tiny-qwen2", "int4", "cuda") / "genai_config.json").read_text())
    assert cfg["search"]["past_present_share_buffer"] is True
    assert cfg["model"]["decoder"]["session_options"]["provider_options"] == [{"cuda": {}}]
    assert cfg["model"]["type"] == "qwen2" and cfg["model"]["context_length"] == CONTEXT
    assert cfg["model"]["decoder"]["inputs"]["past_key_names"] == "past_key_values.%d.key"
    std = json.loads((packages("tiny-llama", attention="standard") / "genai_config.json").read_text())
    assert std["search"]["past_present_share_buffer"] is False
    assert std["model"]["decoder"]["inputs"]["position_ids"] == "position_ids"


# --- (4) a transformers save_pretrained directory round-trips ---------------------------------


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen2", torch.bfloat16)])
def test_hf_directory_roundtrip(tmp_path, arch, dtype):
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    else:
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0)
        )
    with torch.no_grad():  # default init is tiny (std 0.02); widen so logits carry signal
        for p in model.parameters():
            p.mul_(25.0) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.1)
    model = model.to(dtype)
    # Small shards: exercises model.safetensors.index.json and a tensor lookup across files.
    model.save_pretrained(tmp_path / "hf", safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    # Reload in fp32 (not .float() on the bf16 model: that would keep a bf16-rounded rotary inv_freq).
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, attn_implementation="eager"
    ).eval()

    source = HFSource(tmp_path / "hf")
    assert source.config.attention_bias == (arch == "qwen2")
    assert source.config.tie_word_embeddings == (arch == "qwen2")
    assert source.config.rope_theta == model.config.rope_parameters["rope_theta"]
    for attention in ("gqa", "standard"):
        out = build_package(source, tmp_path / attention, "fp32", "cpu", attention)
        ids = [t % 256 for t in PROMPT + DECODE]
        ref = hf_logits(model, ids)
        ours = _decode_ids(out, source.config, ids)
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def _decode_ids(directory: Path, config: DecoderConfig, ids: list[int]) -> np.ndarray:
    dec = OrtDecoder(directory, config)
    split = len(PROMPT)
    rows = [dec.step(ids[:split])] + [dec.step([t]) for t in ids[split:]]
    return np.concatenate(rows, axis=0)


# --- (5) the cuda variant: shared past/present buffer ---------------------------------------


def test_cuda_variant_shared_buffer_on_cpu(packages):
    """The cuda gqa graph (fp16, int4) run with past and present bound to one max_length buffer
    gives the same logits as the growing-cache run."""
    config = TINY_CONFIGS["tiny-qwen2"]
    directory = packages("tiny-qwen2", "int4", "cuda")
    growing = decode_logits(directory, config)

    sess = session(directory)
    shape = (1, config.num_key_value_heads, CONTEXT, config.head_dim)
    buffers = {}
    for i in range(config.num_hidden_layers):
        for kind in ("key", "value"):
            buffers[i, kind] = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float16))
    rows, length = [], 0
    for ids in [PROMPT] + [[t] for t in DECODE]:
        binding = sess.io_binding()
        length += len(ids)
        binding.bind_cpu_input("input_ids", np.array([ids], np.int64))
        # With a shared buffer the mask spans the valid tokens; the KV axis stays at max_length.
        binding.bind_cpu_input("attention_mask", np.ones((1, length), np.int64))
        binding.bind_output("logits")  # first, so it is get_outputs()[0]
        for (i, kind), value in buffers.items():
            binding.bind_ortvalue_input(f"past_key_values.{i}.{kind}", value)
            binding.bind_ortvalue_output(f"present.{i}.{kind}", value)
        sess.run_with_iobinding(binding)
        rows.append(binding.get_outputs()[0].numpy()[0].astype(np.float32))
    shared = np.concatenate(rows, axis=0)
    np.testing.assert_array_equal(shared, growing)  # same kernels, only the KV storage differs
    # The KV really went into the shared buffer: written up to `length`, untouched beyond.
    key0 = buffers[0, "key"].numpy()[0]
    assert np.abs(key0[:, :length]).min(axis=-1).max() > 0 and not key0[:, length:].any()


# --- options and sources ----------------------------------------------------------------------


@pytest.mark.parametrize(("attention", "refetched"), [("gqa", 0), ("standard", 1)])
def test_progress_reports_every_weight(tmp_path, attention, refetched):
    """Tied int4: the gqa flavour's embedding shares the head's 4-bit codes (the table is fetched
    once); the standard flavour keeps a float table and quantizes it again for the head."""
    config = TINY_CONFIGS["tiny-qwen2"]
    seen = []
    build_package(
        RandomSource(config), tmp_path, "int4", attention=attention,
        progress=lambda name, done, total: seen.append((done, total)),
    )  # fmt: skip
    source_names = RandomSource(config).names()
    assert seen[-1][0] == seen[-1][1] == len(source_names) + refetched
    assert [d for d, _ in seen] == list(range(1, len(seen) + 1))


def test_rejects_bad_options(tmp_path):
    source = RandomSource(TINY_CONFIGS["tiny-llama"])
    with pytest.raises(BuildError, match="precision"):
        build_package(source, tmp_path, "int8")
    with pytest.raises(BuildError, match="attention"):
        build_package(source, tmp_path, attention="mha")


def test_external_data_and_checker(packages):
    directory = packages("tiny-llama")
    model = onnx.load(str(directory / "model.onnx"), load_external_data=False)
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external and all(e.value == "model.onnx.data" for t in external for e in t.external_data[:1])
    ops = {n.op_type for n in model.graph.node}
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization"} <= ops
    # onnx.checker does not know SimplifiedLayerNormalization (an onnxruntime op genai's builder puts in
    # the default domain), so only the standard flavour goes through it.
    for precision in ("fp32", "int4"):
        path = packages("tiny-llama", precision, attention="standard") / "model.onnx"
        onnx.checker.check_model(str(path), full_check=True)
        std = onnx.load(str(path), load_external_data=False)
        assert all(n.domain in ("", "ai.onnx") for n in std.graph.node)


def test_random_source_is_order_independent():
    source = RandomSource(TINY_CONFIGS["tiny-qwen2"], seed=3)
    first = source.get("model.layers.1.mlp.up_proj.weight")
    source.get("model.embed_tokens.weight")
    np.testing.assert_array_equal(first, source.get("model.layers.1.mlp.up_proj.weight"))
    assert "lm_head.weight" not in source.names()  # tied


def test_a_4bit_grid_is_found_without_both_ends_of_the_codes():
    """Blocks of 4-bit checkpoints need not use codes 0 and 15 (GGUF Q4_0: d * (code - 8), its
    largest magnitude at code 0; Q4_K's sub-blocks): the grid's step is read from the block's
    gaps, a divisor of the smallest where the codes skip (0, 2 and 7), and the values come back
    exactly. Gaussian weights, or 5-bit blocks, are on no 4-bit grid."""
    from onnxgen.models.quantize import on_4bit_grid

    rng = np.random.default_rng(3)
    n, blocks = 8, 6
    d = rng.uniform(0.01, 0.1, (n, blocks, 1)).astype(np.float16).astype(np.float32)
    codes = rng.integers(1, 13, (n, blocks, 32)).astype(np.float32)  # neither 0 nor 15 in most blocks
    codes[0, 0] = [0, 2, 7] * 10 + [2, 7]  # gaps of 2 and 5 steps
    w = (d * (codes - 8)).reshape(n, -1)
    q = on_4bit_grid(w, 32)
    assert q is not None and q.float_zero_points
    np.testing.assert_allclose(q.dequantize(), w, rtol=0, atol=1e-6 * np.abs(w).max())
    assert on_4bit_grid(rng.standard_normal((n, 64)).astype(np.float32), 32) is None
    five_bit = (d * (rng.integers(0, 32, (n, blocks, 32)) - 16)).reshape(n, -1).astype(np.float32)
    assert on_4bit_grid(five_bit, 32) is None
