"""The delta_prologues rewrite (runtime/fusion_delta_rule.py) on both builders' hybrid graphs: each
Gated DeltaNet layer's q / k norms and LinearAttentionGate fold into FusedLinearAttention, and the
graph computes the same bits on the CPU (where the folded ops run one by one, as unfused).

Oracle: the same graph rewritten by every other rewrite but this one, run by the same session
code; tests/test_hybrid_kernels.py holds the GPU kernel that computes the prologues inside against
the ops one by one (through Triton's interpreter here).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxgen.runtime import InferenceSession
from onnxgen.runtime.fusion import ALL_REWRITES, fuse_graph

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("this transformers has no Qwen3_5ForCausalLM", allow_module_level=True)

FOLDED = {"L2Normalize", "LpNormalization", "LinearAttentionGate", "LinearAttention"}


@pytest.fixture(scope="module", params=["onnxgen", "genai"])
def package(request, tmp_path_factory) -> Path:
    from onnxgen.models.builder import build_package
    from onnxgen.models.hf_source import HFSource
    from tests.test_builder_hybrid import tiny_checkpoint

    root = tmp_path_factory.mktemp("delta-prologues")
    if request.param == "genai":
        pytest.importorskip("onnxruntime_genai")
        from tests.test_foreign_hybrid import genai_build, wrapper_checkpoint

        return genai_build(wrapper_checkpoint(root / "hf", experts=0), root / "pkg", "fp32")
    checkpoint = tiny_checkpoint(root / "hf", value_heads=4, tied=False)
    return build_package(HFSource(checkpoint), root / "pkg", precision="fp32")


def _rewritten(package: Path, rewrites: frozenset[str]) -> onnx.ModelProto:
    model = onnx.load(str(package / "model.onnx"))
    fused, _ = fuse_graph(model, rewrites)
    return fused


def test_every_gated_deltanet_layer_folds_and_computes_the_same_bits(package: Path) -> None:
    from tests.test_foreign_hybrid import _decode_feeds, prompt_feeds

    model = onnx.load(str(package / "model.onnx"), load_external_data=False)
    layers = sum(n.op_type == "LinearAttention" for n in model.graph.node)
    fused, report = fuse_graph(onnx.load(str(package / "model.onnx")), ALL_REWRITES)
    assert report.delta_prologues == layers == 3
    ops = {n.op_type for n in fused.graph.node}
    assert "FusedLinearAttention" in ops and not ops & FOLDED
    reference = _rewritten(package, ALL_REWRITES - {"delta_prologues"})
    assert {"LinearAttention", "LinearAttentionGate"} <= {n.op_type for n in reference.graph.node}
    ids = [3, 17, 91, 5, 44, 120, 8]
    feeds = [_decode_feeds(package, 9)]
    if any(v.name == "position_ids" for v in model.graph.input):
        feeds.append(prompt_feeds(package, ids))
    for feed in feeds:
        expected = InferenceSession(reference, device="cpu").run(None, feed)
        actual = InferenceSession(fused, device="cpu").run(None, feed)
        for a, e in zip(actual, expected, strict=True):
            assert np.array_equal(a, e)


def test_a_gate_output_read_elsewhere_keeps_the_gate(package: Path) -> None:
    """A near miss: the beta of one layer's gate is also a graph output, so that gate stays (its
    norms still fold), and the others fold whole."""
    model = onnx.load(str(package / "model.onnx"))
    gate = next(n for n in model.graph.node if n.op_type == "LinearAttentionGate")
    model.graph.output.append(onnx.helper.make_tensor_value_info(gate.output[1], onnx.TensorProto.FLOAT, None))
    fused, report = fuse_graph(model, ALL_REWRITES)
    assert report.delta_prologues == 3
    kept = [n for n in fused.graph.node if n.op_type == "LinearAttentionGate"]
    assert [n.output[1] for n in kept] == [gate.output[1]]


def test_the_engine_carries_the_states_of_folded_layers(package: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine finds a step's carried states in the graph its session runs, where the folded
    layers' recurrent states go through FusedLinearAttention (the H200 run of 2026-12-05 found the
    engine looking for LinearAttention only: every prompt failed with the recurrent states
    missing). On the CPU with CUDA's rewrites: the same greedy tokens as without this one."""
    from onnxgen.genai import Generator, SamplingParams
    from onnxgen.runtime import fusion
    from tests.test_capture_runtime import write_word_tokenizer

    if not (package / "tokenizer.json").exists():
        write_word_tokenizer(package, 128)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ids = [3, 17, 91, 5, 44, 120, 8]
    tokens = {}
    for name, rewrites in (("without", ALL_REWRITES - {"delta_prologues"}), ("with", ALL_REWRITES)):
        monkeypatch.setitem(fusion.DEVICE_REWRITES, "cpu", rewrites)
        generator = Generator(package, "cpu", kv="static")
        folded = any(n.op_type == "FusedLinearAttention" for n in generator.engine.session.model.graph.node)
        assert folded == (name == "with")
        tokens[name] = list(generator.generate_ids(ids, params))
    assert tokens["with"] == tokens["without"]


def test_fuse_skip_leaves_one_rewrite_out(package: Path) -> None:
    """ONNXGEN_FUSE_SKIP (option fuse_skip) leaves the named rewrites out and runs the others, so a
    bench can time one rewrite against the graph without it; a name that is no rewrite is refused."""
    from onnxgen import options
    from onnxgen.errors import OptionError
    from onnxgen.runtime.fusion import fuse_for_device

    model = onnx.load(str(package / "model.onnx"))
    _, every = fuse_for_device(model, "cuda")
    with options.override(fuse_skip=frozenset({"delta_prologues"})):
        _, skipped = fuse_for_device(model, "cuda")
    assert every.delta_prologues == 3 and skipped.delta_prologues == 0
    assert skipped.l2_norms == every.l2_norms
    # the Reshapes around the keys that the folded prologues take fold as chains without them
    assert skipped.total - skipped.reshape_chains == every.total - every.reshape_chains - 3
    with options.override(fuse_skip=frozenset({"delta_prologue"})), pytest.raises(OptionError, match="delta_prologue"):
        fuse_for_device(model, "cuda")
