"""Model-level parity: small random-weight decoders, logits vs onnxruntime at prefill and decode steps."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxgen.genai.package import load_package_config
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource
from onnxgen.runtime import InferenceSession
from tests.conftest import DEVICES

# (flavour, precision, config, tolerance on logits)
CASES = [
    ("gqa", "fp32", "tiny-llama", 1e-4),
    ("gqa", "fp32", "tiny-qwen2", 1e-4),
    ("gqa", "int4", "tiny-llama", 1e-4),
    ("gqa", "int4", "tiny-qwen2", 1e-4),  # tied: GatherBlockQuantized over the head's 4-bit codes
    ("gqa", "fp16", "tiny-llama", 2e-2),
    ("standard", "fp32", "tiny-llama", 1e-4),
    ("standard", "fp32", "tiny-qwen2", 1e-4),
    ("standard", "fp16", "tiny-qwen2", 2e-2),
]


def _ort_session(path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _set_accuracy_level(path, level: int) -> None:
    model = onnx.load(path, load_external_data=False)
    for node in model.graph.node:
        for attr in node.attribute:
            if node.op_type == "MatMulNBits" and attr.name == "accuracy_level":
                attr.i = level
    onnx.save(model, path)


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    built = {}
    for flavour, precision, name, _ in CASES:
        out = tmp_path_factory.mktemp(f"{name}-{flavour}-{precision}")
        build_package(RandomSource(TINY_CONFIGS[name], seed=5), out, precision=precision, attention=flavour)
        if precision == "int4":
            # compare at accuracy_level 0: at level 4 onnxruntime (alone) rounds activations to int8
            _set_accuracy_level(out / "model.onnx", 0)
        built[(flavour, precision, name)] = out
    return built


@pytest.mark.parametrize("fused", [False, True], ids=["graph", "fused"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flavour, precision, name, tol", CASES)
def test_logits_match_onnxruntime_with_growing_kv(packages, flavour, precision, name, tol, device, fused):
    """fused: onnxgen runs the graph its CUDA fusion pass rewrites (QKV and gate/up GEMM groups,
    bias folded, SiluMul, groups of one, norm and SiLU-mul prologues), onnxruntime the original;
    CUDA sessions fuse by themselves. The fused case decodes one row (batch 1)."""
    package = packages[(flavour, precision, name)]
    config = load_package_config(package)
    if fused:
        from onnxgen.runtime.fusion import fuse_graph
        from onnxgen.runtime.model_io import load_model

        model, report = fuse_graph(load_model(config.model_file)[0])
        assert report.silu_mul == config.num_layers, report
        assert report.matmul_groups + report.matmul_nbits_groups == 2 * config.num_layers, report
        assert report.attention == (config.num_layers if flavour == "standard" else 0), report
        assert report.row_sums == (1 if flavour == "gqa" else 0), report  # the mask's valid lengths
        ours = InferenceSession(model, device=device, base_dir=package)
        if device == "cpu":  # a CUDA session packs its groups itself
            from onnxgen.runtime.fusion import pack_matmul_groups

            groups = sum(n.op_type == "MatMulGroup" for n in model.graph.node)
            assert pack_matmul_groups(ours.program) == groups
        # one row per step in the fused graph: the decode steps take the one-row kernels (with
        # their prologues: triton_linear.py), the 7-token prefill the prologue-then-GEMM path
        # gqa: two norms and SiLU-mul per layer (+ the lm_head where it is a MatMul); standard graphs
        # spell RMSNorm out op by op, which no rewrite matches: SiLU-mul only
        per_layer = 3 if flavour == "gqa" else 1
        assert report.prologues >= per_layer * config.num_layers, report
    else:
        ours = InferenceSession(config.model_file, device=device)
    oracle = _ort_session(config.model_file)
    input_names = {i.name for i in oracle.get_inputs()}
    kv_type = {i.name: i.type for i in oracle.get_inputs()}[config.past_key_name(0)]
    kv_dtype = np.float16 if "float16" in kv_type else np.float32
    rng = np.random.default_rng(0)
    batch = 1 if fused else 2
    past = {}
    for layer in range(config.num_layers):
        for key in (config.past_key_name(layer), config.past_value_name(layer)):
            past[key] = np.zeros((batch, config.num_kv_heads, 0, config.head_size), kv_dtype)
    length = 0
    for step, new in enumerate([7, 1, 1, 1, 1]):
        ids = rng.integers(0, config.vocab_size, size=(batch, new), dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones((batch, length + new), np.int64), **past}
        if "position_ids" in input_names:
            feeds["position_ids"] = np.tile(np.arange(length, length + new, dtype=np.int64), (batch, 1))
        expected = dict(zip([o.name for o in oracle.get_outputs()], oracle.run(None, feeds)))
        actual = dict(zip([o.name for o in ours.get_outputs()], ours.run(None, feeds)))
        assert actual.keys() == expected.keys()
        for out_name, want in expected.items():
            got = actual[out_name]
            assert got.shape == want.shape and got.dtype == want.dtype, f"step {step} {out_name}"
            np.testing.assert_allclose(
                got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol, err_msg=f"step {step} {out_name}"
            )
        for layer in range(config.num_layers):
            past[config.past_key_name(layer)] = expected[config.present_key_name(layer)]
            past[config.past_value_name(layer)] = expected[config.present_value_name(layer)]
        length += new
