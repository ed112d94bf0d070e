"""com.microsoft contrib kernels against onnxruntime's CPU build (1.32) on random inputs.

Tolerances (|a - e| <= atol + rtol * |e|):
  GroupQueryAttention, RotaryEmbedding  fp32 1e-5 / 1e-5; fp16 2e-3 / 2e-3 (one fp16 ulp near 1)
  SimplifiedLayerNorm, Skip*LayerNorm   fp32 1e-5 / 1e-5; fp16 2e-3 / 2e-3
  MatMulNBits                           fp32 accuracy_level 0: 1e-4 relative to the output scale;
                                        accuracy_level 4 (onnxruntime quantizes A to int8 per
                                        block): 2e-2 of the output scale; fp16: 4e-3 of the scale
  GatherBlockQuantized, FastGelu, ...   fp32 1e-5 / 1e-6
Padding rows of a right-padded first prompt (rows >= seqlens_k[b] + 1) are unspecified by the
spec and not compared; the KV caches are compared whole.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper

from onnxgen import options
from onnxgen.errors import OpError
from tests.conftest import DEVICES, assert_parity, make_model, onnxgen_run, ort_run

NP_OF = {TP.FLOAT: np.float32, TP.FLOAT16: np.float16}
TORCH_OF = {TP.FLOAT: torch.float32, TP.FLOAT16: torch.float16}
TOL = {TP.FLOAT: 1e-5, TP.FLOAT16: 2e-3}


def _ort_session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _session(model: onnx.ModelProto, device: str):
    from onnxgen.runtime import InferenceSession

    return InferenceSession(model, device=device)


def _close(actual: np.ndarray, expected: np.ndarray, tol: float, what: str, rtol: float | None = None) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} vs {expected.dtype}"
    np.testing.assert_allclose(
        actual.astype(np.float64),
        expected.astype(np.float64),
        rtol=tol if rtol is None else rtol,
        atol=tol,
        err_msg=what,
    )


# ------------------------------------------------------------------------------------------------
# GroupQueryAttention
# ------------------------------------------------------------------------------------------------

GQA_INPUTS = (
    "query",
    "key",
    "value",
    "past_key",
    "past_value",
    "seqlens_k",
    "total_sequence_length",
    "cos_cache",
    "sin_cache",
    "position_ids",
    "attention_bias",
    "head_sink",
)


@dataclass
class GqaCase:
    num_heads: int = 4
    kv_heads: int = 2
    head_size: int = 16
    dtype: int = TP.FLOAT
    rotary: str = "none"  # none | half | interleaved
    rotary_dim: int = 0  # 0: the whole head
    packed: bool = False
    attrs: dict = field(default_factory=dict)
    with_position_ids: bool = False
    with_bias: bool = False
    with_sink: bool = False
    max_pos: int = 32

    def model(self) -> onnx.ModelProto:
        h, kv, d, t = self.num_heads, self.kv_heads, self.head_size, self.dtype
        hidden = (h + 2 * kv) * d if self.packed else h * d
        shapes: dict[str, tuple[int, list]] = {
            "query": (t, ["B", "S", hidden]),
            "past_key": (t, ["B", kv, "P", d]),
            "past_value": (t, ["B", kv, "P", d]),
            "seqlens_k": (TP.INT32, ["B"]),
            "total_sequence_length": (TP.INT32, []),
        }
        if not self.packed:
            shapes["key"] = (t, ["B", "S", kv * d])
            shapes["value"] = (t, ["B", "S", kv * d])
        if self.rotary != "none":
            half = (self.rotary_dim or d) // 2
            shapes["cos_cache"] = (t, [self.max_pos, half])
            shapes["sin_cache"] = (t, [self.max_pos, half])
        if self.with_position_ids:
            shapes["position_ids"] = (TP.INT64, ["B", "S"])
        if self.with_bias:
            shapes["attention_bias"] = (t, ["B", h, "S", "T"])
        if self.with_sink:
            shapes["head_sink"] = (t, [h])
        names = [n if n in shapes else "" for n in GQA_INPUTS]
        while not names[-1]:
            names.pop()
        attrs = dict(num_heads=h, kv_num_heads=kv, **self.attrs)
        if self.rotary != "none":
            attrs.update(do_rotary=1, rotary_interleaved=int(self.rotary == "interleaved"))
        node = helper.make_node(
            "GroupQueryAttention", names, ["output", "present_key", "present_value"], domain="com.microsoft", **attrs
        )
        inputs = [helper.make_tensor_value_info(n, *shapes[n]) for n in GQA_INPUTS if n in shapes]
        outputs = [helper.make_tensor_value_info(n, t, None) for n in ("output", "present_key", "present_value")]
        return make_model([node], inputs, outputs)

    def feeds(self, rng, seq: int, seqlens: list[int], past: tuple[np.ndarray, np.ndarray]) -> dict:
        npt = NP_OF[self.dtype]
        h, kv, d = self.num_heads, self.kv_heads, self.head_size
        batch = len(seqlens)
        total = max(seqlens)
        hidden = (h + 2 * kv) * d if self.packed else h * d
        feeds = {
            "query": rng.standard_normal((batch, seq, hidden)).astype(npt),
            "past_key": past[0],
            "past_value": past[1],
            "seqlens_k": np.array([s - 1 for s in seqlens], np.int32),
            "total_sequence_length": np.array(total, np.int32),
        }
        if not self.packed:
            feeds["key"] = rng.standard_normal((batch, seq, kv * d)).astype(npt)
            feeds["value"] = rng.standard_normal((batch, seq, kv * d)).astype(npt)
        if self.rotary != "none":
            half = (self.rotary_dim or d) // 2
            inv = 1.0 / (10000 ** (np.arange(half) / half))
            angles = np.arange(self.max_pos)[:, None] * inv[None, :]
            feeds["cos_cache"] = np.cos(angles).astype(npt)
            feeds["sin_cache"] = np.sin(angles).astype(npt)
        if self.with_position_ids:
            # arbitrary but in-range positions, different per batch entry
            feeds["position_ids"] = rng.integers(0, self.max_pos - seq, (batch, seq)).astype(np.int64)
        if self.with_bias:
            feeds["attention_bias"] = rng.standard_normal((batch, h, seq, total)).astype(npt)
        if self.with_sink:
            feeds["head_sink"] = rng.standard_normal(h).astype(npt)
        return feeds


# Steps: (sequence length of the step, tokens per batch entry in the cache after the step).
# The first step is a (right-padded, for batch 2) prompt, then decode steps.
STEPS_B1 = [(5, [5]), (1, [6]), (1, [7])]
STEPS_B2 = [(5, [5, 3]), (1, [6, 4]), (1, [7, 5])]


def _valid_rows(seq: int, seqlens: list[int], first: bool) -> list[int]:
    return [min(seq, t) if first else seq for t in seqlens]


def _compare_output(actual: np.ndarray, expected: np.ndarray, seq: int, seqlens, first: bool, tol: float) -> None:
    for b, rows in enumerate(_valid_rows(seq, seqlens, first)):
        _close(actual[b, :rows], expected[b, :rows], tol, f"output batch {b}")


def run_gqa_separate(case: GqaCase, steps, device: str, seed: int = 0) -> None:
    """Mode (a): past grows each step; present [B, Hkv, total, D] is a new tensor."""
    rng = np.random.default_rng(seed)
    model = case.model()
    ref, ours = _ort_session(model), _session(model, device)
    npt = NP_OF[case.dtype]
    batch = len(steps[0][1])
    empty = np.zeros((batch, case.kv_heads, 0, case.head_size), npt)
    past_ref = past_ours = (empty, empty)
    for index, (seq, seqlens) in enumerate(steps):
        feeds = case.feeds(rng, seq, seqlens, past_ref)
        expected = ref.run(None, feeds)
        actual = ours.run(None, {**feeds, "past_key": past_ours[0], "past_value": past_ours[1]})
        tol = TOL[case.dtype]
        _compare_output(actual[0], expected[0], seq, seqlens, index == 0, tol)
        _close(actual[1], expected[1], tol, f"step {index} present_key")
        _close(actual[2], expected[2], tol, f"step {index} present_value")
        past_ref, past_ours = (expected[1], expected[2]), (actual[1], actual[2])


def run_gqa_shared(case: GqaCase, steps, device: str, capacity: int = 12, seed: int = 0) -> None:
    """Mode (b): one fixed-capacity buffer bound as both past and present (onnxruntime IOBinding)."""
    rng = np.random.default_rng(seed)
    model = case.model()
    ref, ours = _ort_session(model), _session(model, device)
    npt = NP_OF[case.dtype]
    batch = len(steps[0][1])
    shape = (batch, case.kv_heads, capacity, case.head_size)
    # the buffer starts with junk: rows beyond each entry's length must never be read
    start_k = rng.standard_normal(shape).astype(npt)
    start_v = rng.standard_normal(shape).astype(npt)
    ref_k, ref_v = ort.OrtValue.ortvalue_from_numpy(start_k.copy()), ort.OrtValue.ortvalue_from_numpy(start_v.copy())
    our_k = torch.from_numpy(start_k.copy()).to(device)
    our_v = torch.from_numpy(start_v.copy()).to(device)
    for index, (seq, seqlens) in enumerate(steps):
        feeds = case.feeds(rng, seq, seqlens, (start_k, start_v))
        binding = ref.io_binding()
        for name, array in feeds.items():
            if name not in ("past_key", "past_value"):
                binding.bind_cpu_input(name, array)
        binding.bind_ortvalue_input("past_key", ref_k)
        binding.bind_ortvalue_input("past_value", ref_v)
        binding.bind_ortvalue_output("present_key", ref_k)
        binding.bind_ortvalue_output("present_value", ref_v)
        binding.bind_output("output")
        ref.run_with_iobinding(binding)
        expected = [o for o in binding.copy_outputs_to_cpu() if o.ndim == 3][0]

        torch_feeds = {k: torch.from_numpy(v).to(device) for k, v in feeds.items()}
        torch_feeds.update(past_key=our_k, past_value=our_v)
        result = ours.run_torch(torch_feeds)
        assert result["present_key"].data_ptr() == our_k.data_ptr(), "shared mode must write past in place"
        assert result["present_value"].data_ptr() == our_v.data_ptr()
        tol = TOL[case.dtype]
        _compare_output(result["output"].cpu().numpy(), expected, seq, seqlens, index == 0, tol)
        _close(our_k.cpu().numpy(), ref_k.numpy(), tol, f"step {index} key buffer")
        _close(our_v.cpu().numpy(), ref_v.numpy(), tol, f"step {index} value buffer")


GQA_CASES = {
    "plain": GqaCase(),
    "rotary": GqaCase(rotary="half"),
    "rotary_interleaved": GqaCase(rotary="interleaved"),
    "partial_rotary": GqaCase(head_size=32, rotary="half", rotary_dim=16),
    "window": GqaCase(attrs={"local_window_size": 3}),
    "window_rotary": GqaCase(num_heads=6, kv_heads=3, rotary="interleaved", attrs={"local_window_size": 2}),
    "packed_qkv": GqaCase(packed=True, rotary="half"),
    "mha_heads": GqaCase(num_heads=2, kv_heads=2),
    "scale_softcap": GqaCase(attrs={"scale": 0.3, "softcap": 2.0}),
    "smooth_softmax": GqaCase(attrs={"smooth_softmax": 1}),
    "head_sink": GqaCase(with_sink=True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", list(GQA_CASES))
def test_gqa_separate_kv(name: str, batch: int, device: str) -> None:
    run_gqa_separate(GQA_CASES[name], STEPS_B1 if batch == 1 else STEPS_B2, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", ["plain", "rotary", "rotary_interleaved", "window_rotary", "packed_qkv"])
def test_gqa_shared_kv(name: str, batch: int, device: str) -> None:
    run_gqa_shared(GQA_CASES[name], STEPS_B1 if batch == 1 else STEPS_B2, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [TP.FLOAT, TP.FLOAT16])
@pytest.mark.parametrize("packed", [False, True])
def test_gqa_shared_decode_model_heads(packed: bool, dtype: int, device: str) -> None:
    """Real-model head counts (14 query / 2 KV heads of 64) and a buffer longer than one 128-key block,
    entries of different lengths (one past a block, one inside the first): the shape of the fused
    CUDA decode kernel's split-K merge and of its one-block path."""
    case = GqaCase(num_heads=14, kv_heads=2, head_size=64, dtype=dtype, rotary="half", packed=packed, max_pos=320)
    steps = [(150, [150, 70]), (1, [151, 71]), (1, [152, 72]), (1, [153, 73])]
    run_gqa_shared(case, steps, device, capacity=300)


@pytest.mark.parametrize("device", DEVICES)
def test_gqa_shared_decode_combine_in_chunks(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Long buffers: the fused CUDA kernel merges its split-K partials a few splits at a time
    (here 2 per pass: a merge tile of 16 heads x 2 splits x 64 channels; 3 blocks of 128 keys)."""
    if importlib.util.find_spec("triton") is not None:
        from onnxgen.runtime.gpu import gqa_decode

        monkeypatch.setattr(gqa_decode, "COMBINE_TILE", 16 * 2 * 64)
    case = GqaCase(num_heads=14, kv_heads=2, head_size=64, rotary="half", max_pos=640)
    run_gqa_shared(case, [(300, [300, 200]), (1, [301, 201]), (1, [302, 202])], device, capacity=640)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [TP.FLOAT, TP.FLOAT16])
@pytest.mark.parametrize("window", [-1, 40])
def test_gqa_shared_prompt_chunks_model_heads(window: int, dtype: int, device: str) -> None:
    """Prompt chunks of real-model head counts over a shared buffer: a first prompt and a later
    chunk that each span several 64-row query and key blocks of the fused CUDA prefill kernel
    (gpu/gqa_prefill.py), with a window that starts the key walk past the first block."""
    case = GqaCase(num_heads=14, kv_heads=2, head_size=64, dtype=dtype, rotary="half", max_pos=320,
                   attrs={"local_window_size": window})  # fmt: skip
    run_gqa_shared(case, [(100, [100]), (70, [170]), (1, [171])], device, capacity=300)


@pytest.mark.parametrize("device", DEVICES)
def test_gqa_shared_position_ids(device: str) -> None:
    """position_ids over a shared buffer: the first prompt reads position_ids[0] only, a later
    chunk and a decode step one position per row."""
    steps = [(5, [5]), (3, [8]), (1, [9])]
    run_gqa_shared(GqaCase(rotary="half", with_position_ids=True), steps, device)
    run_gqa_shared(GqaCase(rotary="interleaved", with_position_ids=True), STEPS_B2, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shared", [False, True])
def test_gqa_fp16(shared: bool, device: str) -> None:
    case = GqaCase(dtype=TP.FLOAT16, rotary="half", attrs={"local_window_size": 4})
    if shared:
        run_gqa_shared(case, STEPS_B2, device)
    else:
        run_gqa_separate(case, STEPS_B2, device)


@pytest.mark.parametrize("device", DEVICES)
def test_gqa_prompt_chunks(device: str) -> None:
    """A later prompt chunk (S > 1 with past, batch 1), then decode."""
    steps = [(4, [4]), (3, [7]), (1, [8])]
    run_gqa_separate(GqaCase(rotary="half", attrs={"local_window_size": 5}), steps, device)
    run_gqa_shared(GqaCase(rotary="interleaved"), steps, device)


@pytest.mark.parametrize("device", DEVICES)
def test_gqa_position_ids(device: str) -> None:
    # onnxruntime reads only position_ids[0, 0] on a first prompt (S > 1), then one per token
    run_gqa_separate(GqaCase(rotary="half", with_position_ids=True), STEPS_B1, device)
    run_gqa_separate(GqaCase(rotary="interleaved", with_position_ids=True), STEPS_B2, device)


@pytest.mark.parametrize("device", DEVICES)
def test_gqa_attention_bias(device: str) -> None:
    run_gqa_separate(GqaCase(with_bias=True), STEPS_B2, device)
    run_gqa_separate(GqaCase(with_bias=True, attrs={"softcap": 1.5}), STEPS_B1, device)


# ------------------------------------------------------------------------------------------------
# SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization, SkipLayerNormalization
# ------------------------------------------------------------------------------------------------


def _value_infos(specs: dict[str, tuple[int, list | None]]) -> list[onnx.ValueInfoProto]:
    return [helper.make_tensor_value_info(name, t, shape) for name, (t, shape) in specs.items()]


def _untyped_outputs(names: list[str]) -> list[onnx.ValueInfoProto]:
    return [onnx.ValueInfoProto(name=n) for n in names if n]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [TP.FLOAT, TP.FLOAT16])
@pytest.mark.parametrize("axis", [-1, 1])
def test_simplified_layer_norm(axis: int, dtype: int, device: str) -> None:
    rng = np.random.default_rng(1)
    npt = NP_OF[dtype]
    x = (rng.standard_normal((2, 3, 16)) * 3).astype(npt)
    scale_shape = [16] if axis == -1 else [3, 16]
    scale = rng.standard_normal(scale_shape).astype(npt)
    node = helper.make_node("SimplifiedLayerNormalization", ["x", "scale"], ["y", "inv"], axis=axis, epsilon=1e-5)
    model = make_model(
        [node], _value_infos({"x": (dtype, [2, 3, 16]), "scale": (dtype, scale_shape)}), _untyped_outputs(["y", "inv"])
    )
    assert_parity(model, {"x": x, "scale": scale}, device, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_simplified_layer_norm_mixed_types(device: str) -> None:
    """Y takes the scale's type: fp32 X with an fp16 scale gives fp16."""
    rng = np.random.default_rng(2)
    node = helper.make_node("SimplifiedLayerNormalization", ["x", "scale"], ["y"], epsilon=1e-6)
    model = make_model(
        [node], _value_infos({"x": (TP.FLOAT, [4, 32]), "scale": (TP.FLOAT16, [32])}), _untyped_outputs(["y"])
    )
    feeds = {"x": rng.standard_normal((4, 32)).astype(np.float32), "scale": rng.standard_normal(32).astype(np.float16)}
    assert_parity(model, feeds, device, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [TP.FLOAT, TP.FLOAT16])
@pytest.mark.parametrize("op", ["SkipSimplifiedLayerNormalization", "SkipLayerNormalization"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_layer_norm(op: str, dtype: int, with_bias: bool, device: str) -> None:
    rng = np.random.default_rng(3)
    npt = NP_OF[dtype]
    hidden = 64
    specs = {"x": (dtype, [2, 3, hidden]), "skip": (dtype, [2, 3, hidden]), "gamma": (dtype, [hidden])}
    feeds = {
        "x": (rng.standard_normal((2, 3, hidden)) * 2).astype(npt),
        "skip": rng.standard_normal((2, 3, hidden)).astype(npt),
        "gamma": rng.standard_normal(hidden).astype(npt),
    }
    inputs = ["x", "skip", "gamma"]
    if op == "SkipLayerNormalization":
        specs["beta"] = (dtype, [hidden])
        feeds["beta"] = rng.standard_normal(hidden).astype(npt)
        inputs.append("beta")
    if with_bias:
        specs["bias"] = (dtype, [hidden])
        feeds["bias"] = rng.standard_normal(hidden).astype(npt)
        inputs += [""] * (4 - len(inputs)) + ["bias"] if op == "SkipLayerNormalization" else ["bias"]
    outputs = ["y", "mean", "inv_std", "sum"]
    node = helper.make_node(op, inputs, outputs, domain="com.microsoft", epsilon=1e-5)
    model = make_model([node], _value_infos(specs), _untyped_outputs(outputs))
    assert_parity(model, feeds, device, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_skip_simplified_layer_norm_2d_broadcast_skip(device: str) -> None:
    """Only the first output wanted; 2D input (token_count, hidden)."""
    rng = np.random.default_rng(4)
    node = helper.make_node(
        "SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["y"], domain="com.microsoft", epsilon=1e-6
    )
    specs = {"x": (TP.FLOAT, [5, 32]), "skip": (TP.FLOAT, [5, 32]), "gamma": (TP.FLOAT, [32])}
    model = make_model([node], _value_infos(specs), _untyped_outputs(["y"]))
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, (_, s) in specs.items()}
    assert_parity(model, feeds, device)


# ------------------------------------------------------------------------------------------------
# FastGelu, QuickGelu, BiasGelu
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [TP.FLOAT, TP.FLOAT16])
@pytest.mark.parametrize("op", ["FastGelu", "FastGeluBias", "QuickGelu", "BiasGelu"])
def test_gelu_variants(op: str, dtype: int, device: str) -> None:
    rng = np.random.default_rng(5)
    npt = NP_OF[dtype]
    specs = {"x": (dtype, [2, 3, 16])}
    feeds = {"x": (rng.standard_normal((2, 3, 16)) * 3).astype(npt)}
    attrs = {"alpha": 1.5} if op == "QuickGelu" else {}
    if op in ("FastGeluBias", "BiasGelu"):
        specs["b"] = (dtype, [16])
        feeds["b"] = rng.standard_normal(16).astype(npt)
    node = helper.make_node(
        op.replace("Bias", "") if op == "FastGeluBias" else op, list(specs), ["y"], domain="com.microsoft", **attrs
    )
    model = make_model([node], _value_infos(specs), _untyped_outputs(["y"]))
    tol = 1e-5 if dtype == TP.FLOAT else 2e-3
    assert_parity(model, feeds, device, rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------------
# MatMulNBits, GatherBlockQuantized
# ------------------------------------------------------------------------------------------------


def quantize_blocks(w: np.ndarray, bits: int, block_size: int, symmetric: bool):
    """Block quantization along the last axis: (codes [N, n_blocks*bs], scales [N, n_blocks], zp [N, n_blocks]).

    The test's own quantizer (not the runtime's): asymmetric uses min/max per block, symmetric keeps
    the default zero point 2^(bits-1). K is zero-padded to whole blocks.
    """
    n, k = w.shape
    n_blocks = -(-k // block_size)
    padded = np.zeros((n, n_blocks * block_size), np.float32)
    padded[:, :k] = w
    blocks = padded.reshape(n, n_blocks, block_size)
    top = (1 << bits) - 1
    if symmetric:
        zp = np.full((n, n_blocks), 1 << (bits - 1), np.float32)
        scale = np.abs(blocks).max(axis=2) / (1 << (bits - 1))
    else:
        lo, hi = np.minimum(blocks.min(axis=2), 0), np.maximum(blocks.max(axis=2), 0)
        scale = (hi - lo) / top
        zp = np.clip(np.rint(-lo / np.where(scale == 0, 1, scale)), 0, top)
    scale = np.where(scale == 0, 1, scale).astype(np.float32)
    codes = np.clip(np.rint(blocks / scale[:, :, None]) + zp[:, :, None], 0, top).astype(np.uint8)
    return codes.reshape(n, -1), scale, zp.astype(np.uint8)


def pack_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack the last axis low bits first, padding each row to whole bytes."""
    per_byte = 8 // bits
    rows = codes.reshape(-1, codes.shape[-1])
    pad = -rows.shape[1] % per_byte
    rows = np.concatenate([rows, np.zeros((rows.shape[0], pad), np.uint8)], axis=1)
    grouped = rows.reshape(rows.shape[0], -1, per_byte).astype(np.uint16)
    packed = sum(grouped[:, :, i] << (bits * i) for i in range(per_byte)).astype(np.uint8)
    return packed.reshape(*codes.shape[:-1], -1)


def matmul_nbits_model(k, n, bits, block_size, dtype, zp_kind, accuracy_level, with_bias=False, flat_scales=True):
    rng = np.random.default_rng(block_size + bits + k)
    npt = NP_OF[dtype]
    w = rng.standard_normal((n, k)).astype(np.float32)
    codes, scales, zp = quantize_blocks(w, bits, block_size, symmetric=zp_kind == "none")
    n_blocks = scales.shape[1]
    b = pack_rows(codes, bits).reshape(n, n_blocks, block_size * bits // 8)
    inits = [
        onnx.numpy_helper.from_array(b, "B"),
        onnx.numpy_helper.from_array(scales.reshape(-1) if flat_scales else scales.astype(npt), "scales"),
    ]
    if flat_scales:
        inits[1] = onnx.numpy_helper.from_array(scales.reshape(-1).astype(npt), "scales")
    inputs = ["A", "B", "scales"]
    if zp_kind == "packed":
        inits.append(onnx.numpy_helper.from_array(pack_rows(zp, bits).reshape(-1), "zp"))
        inputs.append("zp")
    elif zp_kind == "float":  # unpacked, same type as A (may be fractional)
        inits.append(onnx.numpy_helper.from_array((zp + 0.25).astype(npt), "zp"))
        inputs.append("zp")
    if with_bias:
        inputs += [""] * (5 - len(inputs)) + ["bias"]
        inits.append(onnx.numpy_helper.from_array(rng.standard_normal(n).astype(npt), "bias"))
    node = helper.make_node(
        "MatMulNBits",
        inputs,
        ["Y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=block_size,
        accuracy_level=accuracy_level,
    )
    return make_model([node], _value_infos({"A": (dtype, None)}), _untyped_outputs(["Y"]), inits)


def _nbits_parity(model, dtype, device, rel_tol, m_values=(1, 5), batch_dims=()):
    rng = np.random.default_rng(7)
    k = next(a.i for a in model.graph.node[0].attribute if a.name == "K")
    for m in m_values:
        a = rng.standard_normal((*batch_dims, m, k)).astype(NP_OF[dtype])
        expected = ort_run(model, {"A": a})[0]
        actual = onnxgen_run(model, {"A": a}, device)[0]
        scale = float(np.abs(expected.astype(np.float64)).max())
        _close(actual, expected, rel_tol * scale, f"M={m}", rtol=0.0)


# measured worst cases: 4e-7, 6e-3 (int8 A), 1.3e-6, 7e-3
NBITS_TOL = {(TP.FLOAT, 0): 1e-5, (TP.FLOAT, 4): 2e-2, (TP.FLOAT16, 0): 1e-3, (TP.FLOAT16, 4): 2e-2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accuracy_level", [0, 4])
@pytest.mark.parametrize("dtype", [TP.FLOAT, TP.FLOAT16])
@pytest.mark.parametrize("zp_kind", ["none", "packed", "float"])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
def test_matmul_nbits_4bit(block_size: int, zp_kind: str, dtype: int, accuracy_level: int, device: str) -> None:
    # K = 200 is not a whole number of blocks for any of these sizes; 16 gives 13 blocks (odd)
    model = matmul_nbits_model(200, 24, 4, block_size, dtype, zp_kind, accuracy_level)
    # on a Triton device (the interpreter too) M=1 takes the one-row 4-bit kernel, M=5 the split-K
    # GEMM's 16-row tiles, M=20 its 64-row tiles, M=130 (past linear_q4.AUTO_SPLIT_ROWS) the prompt
    # path that dequantizes into a transient buffer
    _nbits_parity(model, dtype, device, NBITS_TOL[(dtype, accuracy_level)], m_values=(1, 5, 20, 130))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("zp_kind", ["none", "packed", "float"])
def test_matmul_nbits_4bit_long_rows(zp_kind: str, device: str) -> None:
    """K = 2,100: the one-row 4-bit kernel's several 1,024-element tiles, the last one partial."""
    model = matmul_nbits_model(2100, 12, 4, 32, TP.FLOAT, zp_kind, 0)
    _nbits_parity(model, TP.FLOAT, device, NBITS_TOL[(TP.FLOAT, 0)], m_values=(1,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize(
    ("block_size", "zp_kind", "bits"), [(16, "packed", 4), (32, "none", 4), (128, "float", 4), (32, "packed", 8)]
)
def test_matmul_nbits_prompt_gemm(block_size: int, zp_kind: str, bits: int, swap: bool, device: str) -> None:
    """Option q4_prompt=gemm: several rows through the Triton GEMM that dequantizes tiles in
    registers (where the packed kernels serve; elsewhere the same as the default); swap: the tile as
    W @ A^T (option gemm_q4's SWAP), 24 weight rows in a 32-row tile and 5 prompt rows in 16."""
    from onnxgen import options

    model = matmul_nbits_model(200, 24, bits, block_size, TP.FLOAT16, zp_kind, 0)
    with options.override(q4_prompt="gemm", gemm_q4=(16, 32, 128, 4, 3, int(swap))):
        _nbits_parity(model, TP.FLOAT16, device, NBITS_TOL[(TP.FLOAT16, 0)], m_values=(5,))


# BLOCK_M, BLOCK_N, BLOCK_K, WARPS, STAGES, SPLITS, WORDS of the split-K prompt GEMM
SPLIT_GEMMS = {"words-3-splits": (16, 16, 128, 4, 1, 3, 1), "bytes-3-splits": (16, 16, 128, 4, 1, 3, 0),
               "words-1-split": (16, 16, 128, 4, 1, 1, 1)}  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", list(SPLIT_GEMMS))
@pytest.mark.parametrize(
    ("block_size", "zp_kind", "dtype", "bias"),
    [(16, "packed", TP.FLOAT16, False), (32, "none", TP.FLOAT, True), (64, "float", TP.FLOAT16, True),
     (128, "packed", TP.FLOAT, False), (32, "float", TP.FLOAT, False)],
)  # fmt: skip
def test_matmul_nbits_prompt_split(block_size: int, zp_kind: str, dtype: int, bias: bool, config: str, device: str):
    """Option q4_prompt=split: prompts of a few rows through the GEMM split along K
    (gpu/linear_q4_split.py, where the 4-bit kernels serve: CUDA, Triton's interpreter; elsewhere
    the same as the default). K = 300 is three 128-element K tiles, the last one partial (and for
    blocks of 128, a partial block); 20 rows are two row tiles."""
    model = matmul_nbits_model(300, 40, 4, block_size, dtype, zp_kind, 0, with_bias=bias)
    with options.override(q4_prompt="split", gemm_q4_split=SPLIT_GEMMS[config]):
        _nbits_parity(model, dtype, device, NBITS_TOL[(dtype, 0)], m_values=(5, 20))


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_nbits_split_gemm_repeats_bit_for_bit(device: str) -> None:
    """The split-K GEMM's partials meet in a fixed order, and every launch leaves its tickets at zero:
    three launches over one shared scratch give the same bits (a ticket left over would leave the
    second launch's output unwritten), and agree with one split within the fp16 rounding."""
    from onnxgen.runtime.gpu.launch import q4_kernels_serve
    from onnxgen.runtime.gpu.linear_q4 import matmul_q4

    with options.override(triton_q4=True):
        if not q4_kernels_serve(torch.zeros(1, device=device)):
            pytest.skip("the 4-bit Triton kernels do not serve this device")
    k, n, m = 512, 48, 16
    gen = torch.Generator().manual_seed(5)
    b = torch.randint(0, 256, (n, k // 32, 16), generator=gen, dtype=torch.uint8).to(device)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.05).half().to(device)
    a = torch.randn(m, k, generator=gen).half().to(device)
    runs = []
    for splits in (4, 4, 4, 1):
        with options.override(triton_q4=True, q4_prompt="split", gemm_q4_split=(16, 16, 128, 4, 1, splits, 1)):
            runs.append(matmul_q4(a, b, scales, None, n=n, k=k, block_size=32).float().cpu())
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    torch.testing.assert_close(runs[0], runs[3], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [2, 8])
@pytest.mark.parametrize("zp_kind", ["none", "packed"])
def test_matmul_nbits_other_widths(bits: int, zp_kind: str, device: str) -> None:
    model = matmul_nbits_model(96, 20, bits, 32, TP.FLOAT, zp_kind, 0)
    _nbits_parity(model, TP.FLOAT, device, 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [TP.FLOAT, TP.FLOAT16])
@pytest.mark.parametrize("zp_kind", ["none", "packed"])
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_matmul_nbits_8bit(block_size: int, zp_kind: str, dtype: int, device: str) -> None:
    """8-bit codes (onnxruntime-genai's int8 packages; mixed 4- and 8-bit ones): where Triton serves,
    the packed kernels take them as they take 4-bit ones (M=1 the one-row kernel, M=5 and 20 the
    split-K GEMM's two tile heights, M=130 the dequantizing prompt path). onnxruntime's CPU kernel
    refuses 8-bit codes with float zero points, so float zero points are checked against the
    formula below instead."""
    model = matmul_nbits_model(200, 24, 8, block_size, dtype, zp_kind, 0)
    _nbits_parity(model, dtype, device, NBITS_TOL[(dtype, 0)], m_values=(1, 5, 20, 130))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("zp_kind", ["none", "packed"])
def test_matmul_nbits_8bit_long_rows(zp_kind: str, device: str) -> None:
    """K = 2,100 in 8-bit codes: the one-row kernel split along K (256-element tiles), the last partial."""
    model = matmul_nbits_model(2100, 12, 8, 32, TP.FLOAT, zp_kind, 0)
    _nbits_parity(model, TP.FLOAT, device, NBITS_TOL[(TP.FLOAT, 0)], m_values=(1,))


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_nbits_8bit_float_zero_points(device: str) -> None:
    """8-bit codes with float zero points, which onnxruntime's CPU kernel refuses: against the
    contrib op's formula, (code - zero_point) * scale per block, in float64."""
    k, n, bs = 200, 24, 32
    model = matmul_nbits_model(k, n, 8, bs, TP.FLOAT16, "float", 0)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    n_blocks = -(-k // bs)
    codes = inits["B"].reshape(n, n_blocks, bs).astype(np.float64)
    w = (codes - inits["zp"].reshape(n, n_blocks, 1)) * inits["scales"].reshape(n, n_blocks, 1)
    w = w.reshape(n, -1)[:, :k].astype(np.float16).astype(np.float64)  # the weight as fp16 holds it
    rng = np.random.default_rng(3)
    for m in (1, 5):
        a = rng.standard_normal((m, k)).astype(np.float16)
        want = a.astype(np.float64) @ w.T
        got = onnxgen_run(model, {"A": a}, device)[0].astype(np.float64)
        _close(got, want, NBITS_TOL[(TP.FLOAT16, 0)] * float(np.abs(want).max()), f"M={m}", rtol=0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_nbits_2bit_fallback_is_said(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the packed kernels serve, a form they cannot take (2 bits) says so once, with the
    reason, and still matches onnxruntime over its dequantized copy."""
    from onnxgen.runtime.gpu.launch import q4_kernels_serve
    from onnxgen.runtime.ops import contrib_quant

    if not q4_kernels_serve(torch.zeros(1, device=device)):
        pytest.skip("the packed kernels serve on a Triton device (or under Triton's interpreter) only")
    monkeypatch.setattr(contrib_quant, "_SAID", set())
    model = matmul_nbits_model(96, 20, 2, 32, TP.FLOAT, "none", 0)
    with pytest.warns(RuntimeWarning, match=r"bits=2 \(the packed kernels are 4- and 8-bit\): no packed kernel"):
        _nbits_parity(model, TP.FLOAT, device, 1e-5)


def test_quantized_weight_paths_name_each_form() -> None:
    """``onnxgen show``'s per-form kernel lines, from the graph alone (quant_forms), for forms with
    and without a fast kernel on each device."""
    from onnxgen.runtime.ops.quant_forms import quantized_weight_paths

    def paths(model, device: str) -> list[str]:
        return [f"{f['form']} -> {f['path']}" for f in quantized_weight_paths(model, device)]

    level4 = matmul_nbits_model(256, 32, 4, 32, TP.FLOAT16, "packed", 4)
    assert paths(level4, "cuda") == [
        "bits=4 block_size=32 zero_points=packed accuracy_level=4 -> packed 4-bit kernels (gpu/linear_q4.py), "
        "no dequantized copy"
    ]
    assert paths(level4, "cpu") == [
        "bits=4 block_size=32 zero_points=packed accuracy_level=4 -> torch int4 GEMM (bf16 activations); "
        "a prompt chunk's many rows: the packed weight dequantized for the call, fp32 GEMM "
        "(ops/int4pack_rows.py); packed codes only"
    ]
    with options.override(triton_q4=False):
        assert paths(level4, "cuda")[0].endswith("-> dequantized fp16/bf16 copy (ONNXGEN_TRITON_Q4=0)")
    level0 = matmul_nbits_model(200, 24, 4, 16, TP.FLOAT, "float", 0)
    assert paths(level0, "cpu") == [
        "bits=4 block_size=16 zero_points=float accuracy_level=0 -> reference: dequantized fp32 copy kept "
        "(accuracy_level=0 asks for fp32 compute (the int4 GEMM is bf16: levels >= 3))"
    ]
    eight = matmul_nbits_model(96, 32, 8, 32, TP.FLOAT, "none", 4)
    assert paths(eight, "cpu") == [
        "bits=8 block_size=32 zero_points=none accuracy_level=4 -> torch int4 GEMM over the codes' high and low "
        "nibbles as two 4-bit planes (bf16 activations); a prompt chunk's many rows: both planes dequantized for "
        "the call, fp32 GEMM (ops/int4pack_rows.py); packed codes only"
    ]
    assert paths(eight, "cuda") == [
        "bits=8 block_size=32 zero_points=none accuracy_level=4 -> packed 8-bit kernels (gpu/linear_q4.py), "
        "no dequantized copy"
    ]
    two = matmul_nbits_model(96, 20, 2, 32, TP.FLOAT, "none", 4)
    assert paths(two, "cuda") == [
        "bits=2 block_size=32 zero_points=none accuracy_level=4 -> reference: dequantized fp16/bf16 copy kept "
        "(bits=2 (the packed kernels are 4- and 8-bit))"
    ]
    assert paths(two, "cpu") == [
        "bits=2 block_size=32 zero_points=none accuracy_level=4 -> reference: dequantized fp32 copy kept "
        "(bits=2 (the CPU int4 GEMM takes 4-bit codes, and 8-bit ones as two 4-bit planes))"
    ]
    model, _ = _gidx_model("none", np.arange(64, dtype=np.int32) // 16)
    g_idx_path = paths(model, "cuda")[0]
    assert g_idx_path.endswith("g_idx -> reference: dequantized fp16/bf16 copy kept (g_idx (blocks out of order))")
    gather4 = gather_block_quantized_model(4, 32, "packed", TP.FLOAT16)
    assert paths(gather4, "cuda") == [
        "bits=4 block_size=32 zero_points=packed -> one-kernel 4-bit row gather (gpu/prelude.py)"
    ]
    assert paths(gather4, "cpu") == [
        "bits=4 block_size=32 zero_points=packed -> reference: dequantizes the gathered rows only"
    ]
    gather8 = gather_block_quantized_model(8, 32, "none", TP.FLOAT)
    assert paths(gather8, "cuda") == [
        "bits=8 block_size=32 zero_points=none -> reference: dequantizes the gathered rows only"
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_nbits_bias_2d_scales_3d_input(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from onnxgen.runtime.ops import contrib_quant

    monkeypatch.setattr(contrib_quant, "_CHUNK_ELEMENTS", 150)  # dequantize a few rows at a time
    model = matmul_nbits_model(64, 16, 4, 16, TP.FLOAT, "packed", 0, with_bias=True, flat_scales=False)
    _nbits_parity(model, TP.FLOAT, device, 1e-5, m_values=(3,), batch_dims=(2,))


def _gidx_model(zp_kind: str, g: np.ndarray, k: int = 64, n: int = 8, block_size: int = 16):
    rng = np.random.default_rng(11)
    codes, scales, zp = quantize_blocks(rng.standard_normal((n, k)).astype(np.float32), 4, block_size, False)
    b = pack_rows(codes, 4).reshape(n, k // block_size, block_size // 2)
    inits = [
        onnx.numpy_helper.from_array(b, "B"),
        onnx.numpy_helper.from_array(scales.reshape(-1), "scales"),
        onnx.numpy_helper.from_array(g, "g_idx"),
    ]
    zp_name = ""
    if zp_kind == "packed":
        inits.append(onnx.numpy_helper.from_array(pack_rows(zp, 4).reshape(-1), "zp"))
        zp_name = "zp"
    elif zp_kind == "float":
        inits.append(onnx.numpy_helper.from_array(zp.astype(np.float32), "zp"))
        zp_name = "zp"
    node = helper.make_node(
        "MatMulNBits",
        ["A", "B", "scales", zp_name, "g_idx"],
        ["Y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=block_size,
    )
    model = make_model([node], _value_infos({"A": (TP.FLOAT, None)}), _untyped_outputs(["Y"]), inits)
    # act-order definition: column k uses block g_idx[k]
    dense = (codes.astype(np.float32) - zp[:, g]) * scales[:, g]
    return model, dense


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_nbits_g_idx(device: str) -> None:
    g = (np.random.default_rng(12).permutation(64) // 16).astype(np.int32)
    a = np.random.default_rng(13).standard_normal((3, 64)).astype(np.float32)
    for zp_kind in ("none", "float"):
        model, _ = _gidx_model(zp_kind, g)
        assert_parity(model, {"A": a}, device, rtol=1e-5, atol=1e-5)
    # onnxruntime 1.32 CPU disagrees with the act-order definition for g_idx with packed uint8
    # zero points (deprecated input); checked against the definition in numpy instead
    model, dense = _gidx_model("packed", g)
    actual = onnxgen_run(model, {"A": a}, device)[0]
    np.testing.assert_allclose(actual, a @ dense.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_nbits_dequant_cache(device: str) -> None:
    """A cached weight is reused, and a packed tensor changed in place is not served stale (the
    cache serves where the 4-bit kernels do not: here, with them turned off)."""
    from onnxgen import options

    with options.override(triton_q4=False):
        _dequant_cache_case(device)


def _dequant_cache_case(device: str) -> None:
    from onnxgen.runtime.ops.contrib_quant import DEQUANT_CACHE

    model = matmul_nbits_model(64, 16, 4, 32, TP.FLOAT, "packed", 0)
    session = _session(model, device)
    a = torch.from_numpy(np.random.default_rng(14).standard_normal((2, 64)).astype(np.float32)).to(device)
    first = session.run_torch({"A": a})["Y"].clone()
    used = DEQUANT_CACHE.used
    assert used > 0
    assert torch.equal(session.run_torch({"A": a})["Y"], first)
    assert DEQUANT_CACHE.used == used  # second call: no new entry
    packed = session.program.initializers["B"]
    packed.bitwise_xor_(0x11)  # flip a bit in every code, in place
    model.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(packed.cpu().numpy(), "B"))
    expected = ort_run(model, {"A": a.cpu().numpy()})[0]
    _close(session.run_torch({"A": a})["Y"].cpu().numpy(), expected, 1e-5, "after in-place change")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [4, 8])
def test_matmul_nbits_on_triton_keeps_no_dequantized_copy(bits: int, device: str) -> None:
    """With ONNXGEN_TRITON_Q4=1, where the 4-bit kernels serve (CUDA, Triton's interpreter), MatMulNBits multiplies the
    packed codes: one row and several, no weight enters the dequantized-weight cache."""
    from onnxgen import options
    from onnxgen.runtime.gpu.launch import q4_kernels_serve
    from onnxgen.runtime.ops.contrib_quant import DEQUANT_CACHE

    with options.override(triton_q4=True):
        if not q4_kernels_serve(torch.zeros(1, device=device)):
            pytest.skip("the 4-bit Triton kernels do not serve this device")
        DEQUANT_CACHE.clear()
        model = matmul_nbits_model(200, 24, bits, 32, TP.FLOAT16, "packed", 0)
        _nbits_parity(model, TP.FLOAT16, device, NBITS_TOL[(TP.FLOAT16, 0)], m_values=(1, 7))
        assert DEQUANT_CACHE.used == 0


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_nbits_zero_points_widened_at_load(device: str) -> None:
    """Where the packed kernels serve (CUDA, Triton's interpreter), a session holds a 4-bit weight's
    packed zero points as int8, a byte per block (contrib_quant.widen_zero_points), with the values
    the packed form holds (13 blocks: the last byte's high nibble is padding). They stay packed
    elsewhere, with option q4_zero_bytes off, for rows of one block, and where another op reads
    the same tensor. The products
    against onnxruntime are the parity cases' (test_matmul_nbits_4bit)."""
    from onnxgen.runtime.gpu.launch import q4_kernels_serve

    serves = q4_kernels_serve(torch.zeros(1, device=device))
    model = matmul_nbits_model(200, 24, 4, 16, TP.FLOAT16, "packed", 0)
    packed = onnx.numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "zp")).reshape(24, 7)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(24, 14)[:, :13]
    held = _session(model, device).program.initializers["zp"]
    if serves:
        assert held.dtype == torch.int8 and held.shape == (24, 13)
        assert np.array_equal(held.cpu().numpy(), codes)
    else:
        assert held.dtype == torch.uint8 and held.numel() == 24 * 7
    with options.override(q4_zero_bytes=False):
        assert _session(model, device).program.initializers["zp"].dtype == torch.uint8
    one_block = _session(matmul_nbits_model(200, 24, 4, 256, TP.FLOAT16, "packed", 0), device)
    assert one_block.program.initializers["zp"].dtype == torch.uint8
    model.graph.node.append(helper.make_node("Identity", ["zp"], ["Z"]))
    model.graph.output.append(onnx.ValueInfoProto(name="Z"))
    assert _session(model, device).program.initializers["zp"].dtype == torch.uint8


# on CUDA the session fuses a lone MatMulNBits into a one-member MatMulNBitsGroup (fusion "singles")
_NBITS_NODE_TYPES = ("MatMulNBits", "MatMulNBitsGroup")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["bytes", "blocks"])
def test_matmul_nbits_prompt_chunks_go_to_the_session_scratch(device: str, form: str) -> None:
    """A prompt that dequantizes (q4_prompt=dequant) writes its weight chunks into the session's one
    DequantScratch: one of five rows cuts the 24-row weight into chunks of 5, 5, 5, 5 and 4 rows.
    The product is onnxruntime's, and the scratch holds what the last two chunks left: rows 20-23
    of the weight, then row 19 (the reference dequantization, contrib_quant.dequantize_nbits).
    Either dequantization kernel (option q4_dequant)."""
    from onnxgen.runtime import InferenceSession
    from onnxgen.runtime.gpu.launch import LAUNCHES, q4_kernels_serve
    from onnxgen.runtime.gpu.linear_q4 import DequantScratch
    from onnxgen.runtime.ops.contrib_quant import SCRATCH_ATTR, dequantize_nbits

    with options.override(triton_q4=True, q4_prompt="dequant", q4_dequant=form):
        if not q4_kernels_serve(torch.zeros(1, device=device)):
            pytest.skip("the 4-bit Triton kernels do not serve this device")
        k, n = 200, 24
        model = matmul_nbits_model(k, n, 4, 32, TP.FLOAT16, "packed", 0)
        session = InferenceSession(model, device=device)
        scratch = DequantScratch(5 * k, torch.float16, torch.device(device))
        scratch.buffer.fill_(float("nan"))
        (node,) = [node for node in session.program.nodes if node.ctx.op_type in _NBITS_NODE_TYPES]
        node.ctx.__dict__[SCRATCH_ATTR] = scratch
        a = np.random.default_rng(3).standard_normal((20, k)).astype(np.float16)
        expected = ort_run(model, {"A": a})[0]
        kernel = "dequant_q4_blocks" if form == "blocks" else "dequant_q4"
        before = LAUNCHES[kernel]
        actual = session.run(None, {"A": a})[0]
        assert LAUNCHES[kernel] - before == 5, kernel  # the five chunks
        _close(actual, expected, NBITS_TOL[(TP.FLOAT16, 0)] * float(np.abs(expected).max()), "M=20", rtol=0.0)
        inits = {i.name: torch.from_numpy(onnx.numpy_helper.to_array(i).copy()) for i in model.graph.initializer}
        weight = dequantize_nbits(
            inits["B"], inits["scales"], inits["zp"], None, k=k, n=n, bits=4, block_size=32, dtype=torch.float32
        )
        left = scratch.buffer.view(5, k).float().cpu()
        torch.testing.assert_close(left, weight[[20, 21, 22, 23, 19]], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_nbits_prompt_chunks_capped_in_rows(device: str, with_bias: bool) -> None:
    """Option q4_dequant_chunk_rows caps a long prompt's dequantized chunk: at 256 rows a 600-row
    weight goes in three chunks of whole 64-row tiles (256, 256 and 88 rows), each product written
    into its columns of the result (with the bias where there is one), and the result is
    onnxruntime's; unset, the weight goes in one chunk. A cap that is not whole tiles is refused."""
    from onnxgen.runtime import InferenceSession
    from onnxgen.runtime.gpu.launch import LAUNCHES, q4_kernels_serve

    with options.override(triton_q4=True, q4_prompt="dequant"):
        if not q4_kernels_serve(torch.zeros(1, device=device)):
            pytest.skip("the 4-bit Triton kernels do not serve this device")
        k, n = 512, 600
        model = matmul_nbits_model(k, n, 4, 32, TP.FLOAT16, "packed", 0, with_bias=with_bias)
        a = np.random.default_rng(5).standard_normal((3, k)).astype(np.float16)
        expected = ort_run(model, {"A": a})[0]
        for cap, chunks in ((256, 3), (0, 1)):
            with options.override(q4_dequant_chunk_rows=cap):
                session = InferenceSession(model, device=device)
                before = LAUNCHES["dequant_q4_blocks"]
                actual = session.run(None, {"A": a})[0]
                assert LAUNCHES["dequant_q4_blocks"] - before == chunks, cap
            _close(actual, expected, NBITS_TOL[(TP.FLOAT16, 0)] * float(np.abs(expected).max()), f"cap {cap}", 0.0)
    with pytest.raises(ValueError, match="CHUNK_ROWS='100': expected a number of rows, a multiple of 64"):
        options.from_env({"ONNXGEN_Q4_DEQUANT_CHUNK_ROWS": "100"})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("bits", "block", "zero", "dtype"),
    [
        (4, 32, "packed", torch.float16),  # the builder's form: fp16 arithmetic, inline nibbles
        (4, 32, "bytes", torch.float16),  # widened at load (widen_zero_points)
        (4, 16, "none", torch.bfloat16),
        (4, 128, "float", torch.float16),
        (4, 64, "packed", torch.float32),
        (8, 32, "packed", torch.float16),
        (8, 256, "none", torch.float16),  # two blocks per program
    ],
)
def test_matmul_nbits_dequant_forms_agree(device: str, bits: int, block: int, zero: str, dtype) -> None:
    """The prompts' dequantization kernel in both forms (linear_q4.dequantize_q4: per byte, and per
    quantization block) gives contrib_quant.dequantize_nbits' weight bit for bit, over rows that
    are not a whole tile (37 of 16-row tiles), a last block past K (K 1,000) and a row range that
    starts inside the weight. (Triton's interpreter truncates fp32 to bf16 where compiled kernels
    round to nearest even: there bf16 weights are checked within one bf16 step, and the two forms
    against each other bit for bit.)"""
    from onnxgen.runtime.gpu import linear_q4
    from onnxgen.runtime.gpu.launch import q4_kernels_serve
    from onnxgen.runtime.ops.contrib_quant import dequantize_nbits

    if not q4_kernels_serve(torch.zeros(1, device=device)):
        pytest.skip("the 4-bit Triton kernels do not serve this device")
    gen = torch.Generator().manual_seed(bits * 1000 + block)
    n, k = 41, 1000  # two programs of the block form along K at every block size here
    n_blocks = -(-k // block)
    b = torch.randint(0, 256, (n, n_blocks * block * bits // 8), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, n_blocks, generator=gen) * 0.02 + 0.001).to(dtype)
    zero_points = {
        "none": None,
        "packed": torch.randint(0, 256, (n, -(-n_blocks * bits // 8)), dtype=torch.uint8, generator=gen),
        "bytes": torch.randint(0, 16, (n, n_blocks), dtype=torch.int8, generator=gen),
        "float": (torch.rand(n, n_blocks, generator=gen) * 15).to(dtype),
    }[zero]
    want = dequantize_nbits(b, scales, zero_points, None, k=k, n=n, bits=bits, block_size=block, dtype=dtype)
    on = [t.to(device) if t is not None else None for t in (b, scales, zero_points)]
    packed, scale, zeros, kind = linear_q4._layout(*on, n, k, block, bits)
    rows = slice(4, n)
    got = {
        form: linear_q4.dequantize_q4(packed, scale, zeros, kind, rows=rows, k=k, block_size=block, dtype=dtype,
                                      bits=bits, form=form).cpu()
        for form in linear_q4.DEQUANT_FORMS
    }  # fmt: skip
    assert torch.equal(got["blocks"], got["bytes"])
    if dtype == torch.bfloat16 and device == "cpu":
        torch.testing.assert_close(got["bytes"], want[rows], rtol=2**-7, atol=0.0)
    else:
        assert torch.equal(got["bytes"], want[rows])
    with pytest.raises(ValueError, match="form 'words' is not one of bytes, blocks"):
        linear_q4.dequantize_q4(packed, scale, zeros, kind, rows=rows, k=k, block_size=block, dtype=dtype, form="words")


@pytest.mark.parametrize(
    ("n", "fit", "step"),
    [
        (17920, 10922, 8960),  # a 1.5B-shape gate_up in a 16 Mi-element scratch: two equal chunks
        (151936, 10922, 10880),  # 14 chunks of whole 64-row tiles
        (896, 10000, 896),  # fits whole
        (24, 5, 5),  # a scratch narrower than one 64-row tile keeps its own size
        (4097, 4096, 2112),  # two chunks, not 4096 + 1
    ],
)
def test_dequant_chunks_are_whole_tiles(n: int, fit: int, step: int) -> None:
    """Chunks of a weight too large for the scratch keep cuBLAS's operands 16-byte aligned (rows a
    multiple of 64) and are as few and as even as the scratch allows."""
    from onnxgen.runtime.gpu.linear_q4 import chunk_rows

    assert chunk_rows(n, fit) == step


def test_dequant_scratch_fits_a_layer_weight_whole() -> None:
    """The session's scratch holds the largest layer weight whole where it is at most 32 Mi
    elements (a 1.5B shape's fused gate/up, 17,920 x 1,536), else 16 Mi elements at most (the
    0.5B shape's lm_head goes through in chunks either way)."""
    from onnxgen.runtime.gpu.linear_q4 import scratch_elements

    qwen_05b = [1152 * 896, 896 * 896, 9728 * 896, 896 * 4864, 151936 * 896]
    qwen_15b = [2048 * 1536, 1536 * 1536, 17920 * 1536, 1536 * 8960, 151936 * 1536]
    assert scratch_elements(qwen_05b) == 1 << 24
    assert scratch_elements(qwen_15b) == 17920 * 1536
    assert scratch_elements([200 * 24]) == 200 * 24
    assert scratch_elements([]) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_session_holds_one_dequant_scratch() -> None:
    """On CUDA a session's MatMulNBits get one DequantScratch at load, sized for the largest 4-bit
    weight (capped); under q4_prompt=gemm, which never dequantizes, none."""
    from onnxgen.runtime import InferenceSession
    from onnxgen.runtime.gpu.linear_q4 import SCRATCH_ELEMENTS
    from onnxgen.runtime.ops.contrib_quant import SCRATCH_ATTR

    model = matmul_nbits_model(200, 24, 4, 32, TP.FLOAT16, "packed", 0)
    for mode, elements in (("auto", min(SCRATCH_ELEMENTS, 200 * 24)), ("gemm", None)):
        with options.override(triton_q4=True, q4_prompt=mode):
            session = InferenceSession(model, device="cuda")
        (node,) = [node for node in session.program.nodes if node.ctx.op_type in _NBITS_NODE_TYPES]
        scratch = node.ctx.__dict__.get(SCRATCH_ATTR)
        assert (scratch.buffer.numel() if scratch is not None else None) == elements, mode


def gather_block_quantized_model(bits, block_size, zp_kind, scale_dtype, vocab=11, hidden=96, index_dtype=TP.INT64):
    rng = np.random.default_rng(bits * 1000 + block_size)
    codes, scales, zp = quantize_blocks(
        rng.standard_normal((vocab, hidden)).astype(np.float32), bits, block_size, zp_kind == "none"
    )
    n_blocks = scales.shape[1]
    hidden_padded = n_blocks * block_size  # whole blocks, as the model builder pads them
    data = pack_rows(codes, bits) if bits < 8 else codes
    inits = [
        onnx.numpy_helper.from_array(data.reshape(vocab, hidden_padded * bits // 8), "data"),
        onnx.numpy_helper.from_array(scales.astype(NP_OF[scale_dtype]), "scales"),
    ]
    inputs = ["data", "indices", "scales"]
    if zp_kind == "packed":
        inits.append(onnx.numpy_helper.from_array(pack_rows(zp, bits) if bits < 8 else zp, "zp"))
        inputs.append("zp")
    node = helper.make_node(
        "GatherBlockQuantized",
        inputs,
        ["y"],
        domain="com.microsoft",
        bits=bits,
        block_size=block_size,
        gather_axis=0,
        quantize_axis=1,
    )
    return make_model([node], _value_infos({"indices": (index_dtype, None)}), _untyped_outputs(["y"]), inits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale_dtype", [TP.FLOAT, TP.FLOAT16])
@pytest.mark.parametrize("zp_kind", ["none", "packed"])
@pytest.mark.parametrize("bits,block_size", [(4, 16), (4, 32), (4, 64), (4, 128), (8, 32)])
def test_gather_block_quantized(bits: int, block_size: int, zp_kind: str, scale_dtype: int, device: str) -> None:
    model = gather_block_quantized_model(bits, block_size, zp_kind, scale_dtype)
    indices = np.array([[3, 0, 10], [-1, 7, 3]], np.int64)  # 2-D, with a negative index
    assert_parity(model, {"indices": indices}, device, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_gather_block_quantized_int32_and_out_of_range(device: str) -> None:
    model = gather_block_quantized_model(4, 32, "packed", TP.FLOAT, index_dtype=TP.INT32)
    assert_parity(model, {"indices": np.array([2, 5, 2], np.int32)}, device, rtol=1e-5, atol=1e-6)
    # onnxruntime 1.32 gives zero rows for out-of-range indices; onnxgen refuses them, like Gather
    with pytest.raises(OpError, match=r"index 99 is out of range for axis 0"):
        onnxgen_run(model, {"indices": np.array([1, 99, -99], np.int32)}, device)


# ------------------------------------------------------------------------------------------------
# RotaryEmbedding (com.microsoft)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [TP.FLOAT, TP.FLOAT16])
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize(
    "layout,rotary_dim,pos_kind",
    [("3d", 0, "per_token"), ("3d", 0, "start"), ("3d", 16, "per_token"), ("4d", 0, "per_token"), ("4d", 0, "start")],
)
def test_rotary_embedding(
    layout: str, rotary_dim: int, pos_kind: str, interleaved: int, dtype: int, device: str
) -> None:
    rng = np.random.default_rng(21)
    npt = NP_OF[dtype]
    batch, seq, heads, head_size, max_pos = 2, 5, 3, 32, 24
    shape = [batch, seq, heads * head_size] if layout == "3d" else [batch, heads, seq, head_size]
    half = (rotary_dim or head_size) // 2
    angles = rng.uniform(0, 6.3, (max_pos, half))
    feeds = {
        "x": rng.standard_normal(shape).astype(npt),
        "pos": (rng.integers(0, max_pos, (batch, seq)) if pos_kind == "per_token" else np.array([7])).astype(np.int64),
        "cos": np.cos(angles).astype(npt),
        "sin": np.sin(angles).astype(npt),
    }
    attrs = {"interleaved": interleaved}
    if rotary_dim:
        attrs.update(rotary_embedding_dim=rotary_dim, num_heads=heads)
    node = helper.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], domain="com.microsoft", **attrs)
    specs = {
        "x": (dtype, shape),
        "pos": (TP.INT64, list(feeds["pos"].shape)),
        "cos": (dtype, [max_pos, half]),
        "sin": (dtype, [max_pos, half]),
    }
    model = make_model([node], _value_infos(specs), _untyped_outputs(["y"]))
    assert_parity(model, feeds, device, rtol=TOL[dtype], atol=TOL[dtype])


# ------------------------------------------------------------------------------------------------
# GroupQueryAttention: the newer inputs and attributes
# ------------------------------------------------------------------------------------------------


def _with_extra_input(model: onnx.ModelProto, position: int, name: str, elem_type: int, shape: list) -> None:
    node = model.graph.node[0]
    while len(node.input) < position:
        node.input.append("")
    node.input.append(name)
    model.graph.input.append(helper.make_tensor_value_info(name, elem_type, shape))


@pytest.mark.parametrize("device", DEVICES)
def test_gqa_query_seqlens_chunked_prefill(device: str) -> None:
    """Right-padded fixed-size chunks (query_seqlens), batch 2, an idle entry, shared buffer."""
    if tuple(int(part) for part in ort.__version__.split(".")[:2]) < (1, 32):
        # the GPU machine carries onnxruntime-gpu 1.31, whose schema ends before this input
        pytest.skip(f"the oracle, onnxruntime {ort.__version__}, has no GroupQueryAttention query_seqlens (1.32+)")
    case = GqaCase(rotary="half", attrs={"local_window_size": 5})
    model = case.model()
    _with_extra_input(model, 16, "query_seqlens", TP.INT32, ["B"])
    rng = np.random.default_rng(31)
    capacity = 12
    ref, ours = _ort_session(model), _session(model, device)
    shape = (2, case.kv_heads, capacity, case.head_size)
    start_k, start_v = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    ref_k, ref_v = ort.OrtValue.ortvalue_from_numpy(start_k.copy()), ort.OrtValue.ortvalue_from_numpy(start_v.copy())
    our_k, our_v = torch.from_numpy(start_k.copy()).to(device), torch.from_numpy(start_v.copy()).to(device)
    # (chunk length, cache length after the step, valid rows, total_sequence_length as an upper bound)
    for seq, cache_lens, valid, total in [
        (4, [3, 4], [3, 4], capacity),
        (4, [6, 5], [3, 1], capacity),
        (1, [7, 6], [1, 1], capacity),
        (4, [8, 6], [1, 0], 8),
    ]:
        feeds = case.feeds(rng, seq, cache_lens, (start_k, start_v))
        feeds["query_seqlens"] = np.array(valid, np.int32)
        feeds["total_sequence_length"] = np.array(total, np.int32)
        binding = ref.io_binding()
        for name, array in feeds.items():
            if name not in ("past_key", "past_value"):
                binding.bind_cpu_input(name, array)
        binding.bind_ortvalue_input("past_key", ref_k)
        binding.bind_ortvalue_input("past_value", ref_v)
        binding.bind_ortvalue_output("present_key", ref_k)
        binding.bind_ortvalue_output("present_value", ref_v)
        binding.bind_output("output")
        ref.run_with_iobinding(binding)
        expected = [o for o in binding.copy_outputs_to_cpu() if o.ndim == 3][0]
        torch_feeds = {k: torch.from_numpy(v).to(device) for k, v in feeds.items()}
        torch_feeds.update(past_key=our_k, past_value=our_v)
        output = ours.run_torch(torch_feeds)["output"].cpu().numpy()
        for b, (rows, length) in enumerate(zip(valid, cache_lens)):
            # only valid rows, and cache rows below T, are specified
            _close(output[b, :rows], expected[b, :rows], 1e-5, f"output {b}")
            _close(our_k[b, :, :length].cpu().numpy(), ref_k.numpy()[b, :, :length], 1e-5, f"keys {b}")
            _close(our_v[b, :, :length].cpu().numpy(), ref_v.numpy()[b, :, :length], 1e-5, f"values {b}")


@pytest.mark.parametrize("device", DEVICES)
def test_gqa_not_causal(device: str) -> None:
    run_gqa_separate(GqaCase(rotary="half", attrs={"causal": 0}), [(5, [5, 5]), (1, [6, 6])], device)


@pytest.mark.parametrize("device", DEVICES)
def test_gqa_fused_qk_norm(device: str) -> None:
    """q_norm_weight/k_norm_weight (onnxruntime CPU rejects them): the oracle is the unfused graph,
    Reshape -> SimplifiedLayerNormalization -> Reshape before a plain GroupQueryAttention."""
    case = GqaCase(rotary="half")
    h, kv, d = case.num_heads, case.kv_heads, case.head_size
    rng = np.random.default_rng(32)
    weights = {"q_w": rng.standard_normal(d).astype(np.float32), "k_w": rng.standard_normal(d).astype(np.float32)}
    eps = 1e-5

    fused = case.model()
    node = fused.graph.node[0]
    while len(node.input) < 14:
        node.input.append("")
    node.input.extend(["q_w", "k_w"])
    node.attribute.append(helper.make_attribute("qk_norm_epsilon", eps))
    fused.graph.initializer.extend(onnx.numpy_helper.from_array(w, n) for n, w in weights.items())

    unfused = case.model()
    gqa = unfused.graph.node[0]
    norm_nodes = []
    for name, heads, weight in (("query", h, "q_w"), ("key", kv, "k_w")):
        norm_nodes += [
            helper.make_node("Reshape", [name, f"{name}_4d_shape"], [f"{name}_4d"]),
            helper.make_node("SimplifiedLayerNormalization", [f"{name}_4d", weight], [f"{name}_n"], epsilon=eps),
            helper.make_node("Reshape", [f"{name}_n", f"{name}_3d_shape"], [f"{name}_normed"]),
        ]
        unfused.graph.initializer.extend(
            [
                onnx.numpy_helper.from_array(np.array([0, 0, heads, d], np.int64), f"{name}_4d_shape"),
                onnx.numpy_helper.from_array(np.array([0, 0, heads * d], np.int64), f"{name}_3d_shape"),
            ]
        )
        gqa.input[GQA_INPUTS.index(name)] = f"{name}_normed"
    unfused.graph.initializer.extend(onnx.numpy_helper.from_array(w, n) for n, w in weights.items())
    nodes = norm_nodes + [gqa]
    del unfused.graph.node[:]
    unfused.graph.node.extend(nodes)

    empty = np.zeros((2, kv, 0, d), np.float32)
    feeds = case.feeds(rng, 5, [5, 5], (empty, empty))
    expected = _ort_session(unfused).run(None, feeds)
    actual = _session(fused, device).run(None, feeds)
    for index in range(3):
        _close(actual[index], expected[index], 1e-5, f"output {index}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gqa_shared_decode_step_records_into_cuda_graph() -> None:
    """One decode step recorded once replays right for later steps (seqlens_k grows on the device)."""
    from onnxgen.runtime.node_contract import NodeContext
    from onnxgen.runtime.ops.contrib_attention import group_query_attention

    device = torch.device("cuda")
    attrs = {"num_heads": 4, "kv_num_heads": 2, "do_rotary": 1, "local_window_size": 6}
    ctx = NodeContext("gqa", "GroupQueryAttention", "com.microsoft", 1, attrs, device, 9, 3, (True, True, True))
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv, d, capacity = 2, 4, 2, 16, 16
    angles = torch.rand(32, d // 2, generator=gen) * 6
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    start_k = torch.randn(batch, kv, capacity, d, generator=gen).to(device)
    start_v = torch.randn(batch, kv, capacity, d, generator=gen).to(device)
    total = torch.tensor(capacity, dtype=torch.int32)  # host input: the capacity as the bound

    def new_inputs(step: int):
        g = torch.Generator().manual_seed(100 + step)
        q = torch.randn(batch, 1, heads * d, generator=g).to(device)
        k = torch.randn(batch, 1, kv * d, generator=g).to(device)
        v = torch.randn(batch, 1, kv * d, generator=g).to(device)
        lengths = torch.tensor([5 + step, 3 + step], dtype=torch.int32, device=device)
        return q, k, v, lengths

    # eager reference over three steps
    eager_k, eager_v = start_k.clone(), start_v.clone()
    eager_out = []
    for step in range(3):
        q, k, v, lengths = new_inputs(step)
        out = group_query_attention(ctx, q, k, v, eager_k, eager_v, lengths, total, cos, sin)[0]
        eager_out.append(out.clone())

    # recorded once at step 0, replayed for steps 1 and 2 with new inputs copied in
    graph_k, graph_v = start_k.clone(), start_v.clone()
    q_s, k_s, v_s, len_s = (t.clone() for t in new_inputs(0))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph, on scratch buffers
        group_query_attention(ctx, q_s, k_s, v_s, graph_k.clone(), graph_v.clone(), len_s, total, cos, sin)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = group_query_attention(ctx, q_s, k_s, v_s, graph_k, graph_v, len_s, total, cos, sin)[0]
    for step in range(3):
        for static, fresh in zip((q_s, k_s, v_s, len_s), new_inputs(step)):
            static.copy_(fresh)
        graph.replay()
        torch.testing.assert_close(out_s, eager_out[step], rtol=0, atol=0)
    torch.testing.assert_close(graph_k, eager_k, rtol=0, atol=0)
    torch.testing.assert_close(graph_v, eager_v, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_nbits_with_model_builder_quantizer(device: str) -> None:
    """onnxgen.models.quantize's MatMulNBits tensors mean to onnxruntime what they mean to us,
    and what its own dequantize() says (the builder emits int4 packages with exactly these)."""
    quantize = pytest.importorskip("onnxgen.models.quantize")
    rng = np.random.default_rng(41)
    k, n, block_size = 72, 12, 32  # K not a whole number of blocks, an odd block count
    q = quantize.quantize_4bit(rng.standard_normal((n, k)).astype(np.float32), block_size)
    b, scales, zp = q.matmulnbits_tensors()
    inits = [onnx.numpy_helper.from_array(x, name) for x, name in ((b, "B"), (scales, "scales"), (zp, "zp"))]
    node = helper.make_node(
        "MatMulNBits",
        ["A", "B", "scales", "zp"],
        ["Y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=4,
        block_size=block_size,
    )
    model = make_model([node], _value_infos({"A": (TP.FLOAT, ["M", k])}), _untyped_outputs(["Y"]), inits)
    a = rng.standard_normal((3, k)).astype(np.float32)
    expected = ort_run(model, {"A": a})[0]
    np.testing.assert_allclose(a @ q.dequantize().T, expected, rtol=1e-5, atol=1e-5)
    assert_parity(model, {"A": a}, device, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_matmul_nbits_from_onnxruntimes_quantizer(bits: int, symmetric: bool, device: str) -> None:
    """The MatMulNBits tensors onnxruntime's own weight-only quantizer writes (the tool behind
    onnxruntime-genai's builder; 8 bits for its int8 packages): two MatMuls of a float model
    quantized by it, run by onnxruntime and by onnxgen (on a Triton device: the packed kernels)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    rng = np.random.default_rng(bits + symmetric)
    k, hidden, n = 96, 160, 40  # 160 = 5 blocks of 32: an odd count of packed zero points
    inits = [onnx.numpy_helper.from_array(rng.standard_normal((k, hidden)).astype(np.float32) * 0.1, "W1"),
             onnx.numpy_helper.from_array(rng.standard_normal((hidden, n)).astype(np.float32) * 0.1, "W2")]  # fmt: skip
    nodes = [helper.make_node("MatMul", ["A", "W1"], ["H"]), helper.make_node("MatMul", ["H", "W2"], ["Y"])]
    model = make_model(nodes, _value_infos({"A": (TP.FLOAT, ["M", k])}), _untyped_outputs(["Y"]), inits)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=32, is_symmetric=symmetric)
    quantizer.process()
    quantized = quantizer.model.model
    kinds = [(node.op_type, next(a.i for a in node.attribute if a.name == "bits")) for node in quantized.graph.node]
    assert kinds == [("MatMulNBits", bits)] * 2, kinds
    for m in (1, 5):
        assert_parity(quantized, {"A": rng.standard_normal((m, k)).astype(np.float32)}, device, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------
# MultiHeadAttention
# ------------------------------------------------------------------------------------------------

MHA_INPUTS = ("query", "key", "value", "bias", "key_padding_mask", "attention_bias", "past_key", "past_value")


def _mha_case(name: str, dtype: int = TP.FLOAT):
    """(attributes, feeds) for one MultiHeadAttention configuration; batch 2, 2 heads of 16."""
    rng = np.random.default_rng(sum(map(ord, name)))
    npt = NP_OF[dtype]
    b, s, n, h, past = 2, 3, 2, 16, 4

    def rand(*shape):
        return rng.standard_normal(shape).astype(npt)

    feeds: dict[str, np.ndarray] = {"query": rand(b, s, n * h)}
    attrs = {"num_heads": n}
    if name == "self_past_causal":  # decoder step with a cache, a bias and a padded batch entry
        attrs["unidirectional"] = 1
        feeds.update(key=rand(b, s, n * h), value=rand(b, s, n * h), bias=rand(3 * n * h))
        feeds.update(past_key=rand(b, n, past, h), past_value=rand(b, n, past, h))
        feeds["key_padding_mask"] = np.array([[1] * 7, [0, 0, 1, 1, 1, 1, 1]], np.int32)
    elif name == "cross_lengths":  # 5 keys, right padding given as lengths
        feeds.update(key=rand(b, 5, n * h), value=rand(b, 5, n * h), key_padding_mask=np.array([5, 2], np.int32))
    elif name == "bias_3d_mask":
        attrs["scale"] = 0.2
        feeds.update(key=rand(b, s, n * h), value=rand(b, s, n * h), attention_bias=rand(1, n, s, s))
        feeds["key_padding_mask"] = (rng.random((b, s, s)) > 0.3).astype(np.int32)
    elif name == "bnsh_kv":  # a cross-attention cache fed as [B, N, L, H]
        feeds.update(key=rand(b, n, 6, h), value=rand(b, n, 6, h))
    elif name == "fully_masked_row":  # every key masked: onnxruntime averages V, no NaN
        feeds.update(key=rand(b, s, n * h), value=rand(b, s, n * h))
        feeds["key_padding_mask"] = np.array([[1, 1, 0], [0, 0, 0]], np.int32)
    return attrs, feeds


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["self_past_causal", "cross_lengths", "bias_3d_mask", "bnsh_kv", "fully_masked_row"])
def test_multi_head_attention(name: str, device: str) -> None:
    for dtype in (TP.FLOAT, TP.FLOAT16) if name == "self_past_causal" else (TP.FLOAT,):
        attrs, feeds = _mha_case(name, dtype)
        names = [n if n in feeds else "" for n in MHA_INPUTS]
        while not names[-1]:
            names.pop()
        outputs = ["output", "present_key", "present_value"] if "past_key" in feeds else ["output"]
        node = helper.make_node("MultiHeadAttention", names, outputs, domain="com.microsoft", **attrs)
        specs = {k: (TP.INT32 if v.dtype == np.int32 else dtype, list(v.shape)) for k, v in feeds.items()}
        model = make_model([node], _value_infos(specs), _untyped_outputs(outputs))
        # a fully masked row's logits sit near -10000, where fp32 resolves only ~1e-3 (CUDA's
        # SDPA adds the mask in another order than onnxruntime: 1.6e-4 apart on an H200)
        tol = 1e-3 if name == "fully_masked_row" else TOL[dtype]
        assert_parity(model, feeds, device, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_multi_head_attention_packed_qkv(device: str) -> None:
    """Packed QKV [B, S, N, 3, H] (onnxruntime CPU lacks it): the oracle is the same Q, K, V unpacked."""
    rng = np.random.default_rng(51)
    b, s, n, h = 2, 4, 2, 16
    packed = rng.standard_normal((b, s, n, 3, h)).astype(np.float32)
    unpacked = {name: packed[:, :, :, i].reshape(b, s, n * h) for i, name in enumerate(("query", "key", "value"))}
    node = helper.make_node("MultiHeadAttention", list(unpacked), ["y"], domain="com.microsoft", num_heads=n)
    specs = {name: (TP.FLOAT, [b, s, n * h]) for name in unpacked}
    expected = ort_run(make_model([node], _value_infos(specs), _untyped_outputs(["y"])), unpacked)[0]
    node = helper.make_node("MultiHeadAttention", ["query"], ["y"], domain="com.microsoft", num_heads=n)
    model = make_model([node], _value_infos({"query": (TP.FLOAT, [b, s, n, 3, h])}), _untyped_outputs(["y"]))
    _close(onnxgen_run(model, {"query": packed}, device)[0], expected, 1e-5, "packed QKV")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits,block_size", [(4, 16), (4, 32), (4, 128), (8, 32), (2, 16), (2, 32)])
@pytest.mark.parametrize("zp_kind", ["none", "packed", "float"])
def test_matmul_nbits_int8_activations(bits: int, block_size: int, zp_kind: str, device: str) -> None:
    """With ONNXGEN_INT8_ACTIVATIONS on, accuracy_level 4 rounds A like onnxruntime's CPU kernel:
    the op then matches it to fp32 rounding (measured <= 4e-7 of the output scale)."""
    if zp_kind == "float" and bits != 4:
        pytest.skip("float zero points are tested with 4 bits")
    model = matmul_nbits_model(256, 24, bits, block_size, TP.FLOAT, zp_kind, 4)
    with options.override(int8_activations="all"):
        _nbits_parity(model, TP.FLOAT, device, 1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_nbits_int8_activations_rounding(device: str) -> None:
    """Values where a / scale and a * (1 / scale) round to different codes: onnxruntime multiplies."""
    model = matmul_nbits_model(64, 24, 4, 32, TP.FLOAT, "none", 4)
    a = np.zeros((2, 64), np.float32)
    a[:, 0] = 2.9  # the block maximum fixes the scale at 2.9 / 127
    a[0, 1:3] = [-2.1350393295288086, 1.7468504905700684]
    a[1, 33] = 1.0
    expected = ort_run(model, {"A": a})[0]
    with options.override(int8_activations="all"):
        _close(onnxgen_run(model, {"A": a}, device)[0], expected, 1e-6, "int8 rounding")


# ------------------------------------------------------------------------------------------------
# The ops together, in a graph written by onnxruntime-genai's own model builder
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def genai_int4_model(tmp_path_factory) -> onnx.ModelProto:
    """A 2-layer random Llama built by onnxruntime-genai (int4, CPU): packed-QKV GroupQueryAttention
    with rotary, MatMulNBits, SkipSimplifiedLayerNormalization, GatherBlockQuantized embeddings."""
    builder = pytest.importorskip("onnxruntime_genai.models.builder")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("genai")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="t1", eos_token="t2", unk_token="t0"
    ).save_pretrained(root / "hf")
    command = [sys.executable, "-m", builder.__name__, "-i", root / "hf", "-o", root / "out", "-p", "int4"]
    subprocess.run([*map(str, command), "-e", "cpu", "-c", str(root / "cache")], check=True, capture_output=True)
    model = onnx.load(str(root / "out" / "model.onnx"))
    ops = {n.op_type for n in model.graph.node}
    assert {"GroupQueryAttention", "MatMulNBits", "SkipSimplifiedLayerNormalization", "GatherBlockQuantized"} <= ops
    for node in model.graph.node:  # accuracy_level 4 rounds A to int8 in onnxruntime (see contrib_quant)
        for attr in node.attribute:
            if node.op_type == "MatMulNBits" and attr.name == "accuracy_level":
                attr.i = 0
    return model


@pytest.mark.parametrize("device", DEVICES)
def test_genai_built_int4_decoder(genai_int4_model: onnx.ModelProto, device: str) -> None:
    """Prefill (batch 2, one entry right-padded) and three decode steps: logits and KV caches."""
    ref = _ort_session(genai_int4_model)
    ours = _session(genai_int4_model, device)
    rng = np.random.default_rng(61)
    batch, layers = 2, 2
    past_ref = past_ours = [np.zeros((batch, 2, 0, 16), np.float32)] * (2 * layers)
    ids = rng.integers(0, 256, (batch, 6)).astype(np.int64)
    mask = np.ones((batch, 6), np.int64)
    mask[1, 4:] = 0
    past_names = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    present_names = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    out_names = ["logits", *present_names]
    for step in range(4):
        feeds = {"input_ids": ids, "attention_mask": mask}
        expected = ref.run(out_names, {**feeds, **dict(zip(past_names, past_ref))})
        actual = ours.run(out_names, {**feeds, **dict(zip(past_names, past_ours))})
        logits_e, logits_a = expected[0], actual[0]
        if step == 0:  # rows of the padded entry past its length are unspecified
            logits_e, logits_a = logits_e[:, :4], logits_a[:, :4]
        _close(logits_a, logits_e, 1e-5, f"step {step} logits")
        for name, a, e in zip(present_names, actual[1:], expected[1:]):
            _close(a, e, 1e-5, f"step {step} {name}")
        past_ref, past_ours = expected[1:], actual[1:]
        ids = rng.integers(0, 256, (batch, 1)).astype(np.int64)
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)


def _resident_rows(total: int, capacity: int, window: int) -> int:
    """The spec's L(T): rows of a window cache that hold positions after T tokens."""
    reclaim = capacity - window + 1
    return total if total <= capacity else total - reclaim * -(-(total - capacity) // reclaim)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "steps,rotary,bias",
    [
        ([(4, [4]), (1, [5]), (1, [6]), (1, [7]), (2, [9]), (1, [10]), (1, [11])], "half", False),
        ([(4, [4, 4]), (1, [5, 5]), (1, [6, 6]), (1, [7, 7]), (1, [8, 8])], "interleaved", False),
        ([(3, [3, 3]), (1, [4, 4]), (1, [5, 5]), (1, [6, 6]), (1, [7, 7])], "none", True),
    ],
)
def test_gqa_sliding_window_cache(steps, rotary: str, bias: bool, device: str) -> None:
    """sliding_window_cache=1: a cache of capacity C >= window W that evicts C - W + 1 rows at once."""
    window, capacity = 3, 5
    case = GqaCase(rotary=rotary, with_bias=bias, attrs={"local_window_size": window, "sliding_window_cache": 1})
    model = case.model()
    ref, ours = _ort_session(model), _session(model, device)
    rng = np.random.default_rng(71)
    batch = len(steps[0][1])
    shape = (batch, case.kv_heads, capacity, case.head_size)
    past_ref = (np.zeros(shape, np.float32), np.zeros(shape, np.float32))
    past_ours = tuple(torch.zeros(shape, device=device) for _ in range(2))
    for index, (seq, lengths) in enumerate(steps):
        feeds = case.feeds(rng, seq, lengths, past_ref)
        expected = ref.run(None, feeds)
        torch_feeds = {k: torch.from_numpy(v).to(device) for k, v in feeds.items()}
        torch_feeds.update(past_key=past_ours[0], past_value=past_ours[1])
        result = ours.run_torch(torch_feeds)
        assert result["present_key"].data_ptr() == past_ours[0].data_ptr(), "the window cache is updated in place"
        _compare_output(result["output"].cpu().numpy(), expected[0], seq, lengths, index == 0, 1e-5)
        for b, length in enumerate(lengths):
            kept = _resident_rows(length, capacity, window)
            for name, ours_t, ref_t in (("key", past_ours[0], expected[1]), ("value", past_ours[1], expected[2])):
                _close(ours_t[b, :, :kept].cpu().numpy(), ref_t[b, :, :kept], 1e-5, f"step {index} {name} {b}")
        past_ref = (expected[1], expected[2])
