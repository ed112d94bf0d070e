"""Packages that onnxgen did not build: onnxruntime-genai's own builder, from a tiny random checkpoint.

The checkpoint is a tied-embedding tiny Llama (bench.peers_decode.write_checkpoint: RandomSource's
seeded weights, a word-level tokenizer); ``python -m onnxruntime_genai.models.builder`` turns it
into a package (fp32 for the CPU, the form
its builder writes: packed QKV, GroupQueryAttention over a shared buffer, and the embedding as
Gather(Transpose(lm_head weight))). The oracles: onnxruntime-genai's greedy tokens on the same
package and onnxruntime's logits on the graph as written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from onnxgen.genai.generator import Generator
from onnxgen.genai.sampling import SamplingParams
from onnxgen.models.random_source import TINY_CONFIGS
from onnxgen.runtime import InferenceSession
from tests.conftest import onnxruntime_prompt_logits, prompt_feeds
from tests.test_generator import genai_greedy


@pytest.fixture(scope="module")
def genai_package(tmp_path_factory) -> Path:
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("transformers")
    from bench.peers_decode import write_checkpoint

    root = tmp_path_factory.mktemp("foreign")
    checkpoint = root / "hf"
    write_checkpoint(replace(TINY_CONFIGS["tiny-llama"], tie_word_embeddings=True), checkpoint, torch.float32, seed=0)
    out = root / "genai-fp32-cpu"
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o", str(out)]
    done = subprocess.run([*command, "-p", "fp32", "-e", "cpu"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


PROMPT = [5, 17, 301, 42, 9, 250, 77]


def test_the_builder_writes_the_tied_embedding_as_a_transposed_gather(genai_package) -> None:
    """The form the rewrite is for is what this builder writes (if it changes, the test says so)."""
    import onnx

    graph = onnx.load(str(genai_package / "model.onnx"), load_external_data=False).graph
    producers = {o: n for n in graph.node for o in n.output}
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"]
    assert [producers[g.input[0]].op_type for g in gathers] == ["Transpose"]


def test_the_logits_are_computed_for_the_last_prompt_row_only(genai_package) -> None:
    """engine_model's rewrite applies to this builder's lm_head (no warning, one RowSelect)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generator = Generator(genai_package)
    assert generator.engine.logits_row is not None
    assert sum(n.op_type == "RowSelect" for n in generator.session.model.graph.node) >= 1


@pytest.mark.parametrize("kv", ["auto", "dynamic"])
def test_greedy_tokens_match_onnxruntime_genai(genai_package, kv: str) -> None:
    generator = Generator(genai_package, kv=kv)
    assert generator.session.fusions.tied_gathers == 1
    ours = list(generator.generate_ids(PROMPT, SamplingParams(max_new_tokens=24)))
    assert ours == genai_greedy(genai_package, PROMPT, 24)


def test_rewritten_graph_matches_onnxruntime_on_the_graph_as_written(genai_package) -> None:
    pytest.importorskip("onnxruntime")
    session = InferenceSession(genai_package / "model.onnx")
    assert session.fusions.tied_gathers == 1
    assert "Transpose" not in {n.op_type for n in session.model.graph.node if n.input[:1] == ["lm_head.MatMul.weight"]}
    expected = onnxruntime_prompt_logits(genai_package, PROMPT)
    (ours,) = session.run(["logits"], prompt_feeds(genai_package, PROMPT))
    np.testing.assert_allclose(ours[0], expected, rtol=1e-5, atol=1e-5)


def test_kv_auto_on_the_cpu_grows_instead_of_a_static_buffer(genai_package) -> None:
    """The builder marks even CPU packages past_present_share_buffer; on the CPU kv auto takes the
    growing cache (attention over the valid rows), and says so in the stats."""
    assert json.loads((genai_package / "genai_config.json").read_text())["search"]["past_present_share_buffer"]
    generator = Generator(genai_package)
    assert generator.kv_kind == "dynamic"
    list(generator.generate_ids(PROMPT, SamplingParams(max_new_tokens=2)))
    assert generator.last_stats.kv == "dynamic"


def test_every_cuda_rewrite_matches_the_builders_graph(genai_package) -> None:
    """onnxgen show --capture --device cuda: what a CUDA session fuses in that builder's graph, and
    no rewrite left unmatched (its mask lengths come from Constant nodes, which RowSumCast reads)."""
    from onnxgen.runtime.capture.report import capture_report

    data = json.loads(capture_report(genai_package / "model.onnx", None, True, "cuda"))
    fused = data["fusions"]
    layers = TINY_CONFIGS["tiny-llama"].num_hidden_layers  # one SiLU-mul per layer's MLP
    assert fused["row_sums"] == 1 and fused["tied_gathers"] == 1 and fused["silu_mul"] == layers, fused
    assert fused["prologues"] > 0 and fused["matmul_groups"] + fused["singles"] > 0, fused
    assert data["rewrites_unmatched"] == {}


def test_the_fused_graph_matches_onnxruntime_on_the_graph_as_written(genai_package) -> None:
    """Every CUDA rewrite applied (RowSumCast's torch path runs on the CPU too): logits as written."""
    import onnx

    pytest.importorskip("onnxruntime")
    from onnxgen.runtime.fusion import DEVICE_REWRITES, fuse_graph

    model = onnx.load(str(genai_package / "model.onnx"))
    fused, report = fuse_graph(model, DEVICE_REWRITES["cuda"])
    assert report.row_sums == 1 and report.tied_gathers == 1
    session = InferenceSession(fused, device="cpu")
    expected = onnxruntime_prompt_logits(genai_package, PROMPT)
    (ours,) = session.run(["logits"], prompt_feeds(genai_package, PROMPT))
    np.testing.assert_allclose(ours[0], expected, rtol=1e-4, atol=1e-4)  # grouped GEMMs sum in another order


def test_show_names_a_rewrite_that_matched_nothing() -> None:
    from onnx import TensorProto, helper

    from onnxgen.runtime.fusion import DEVICE_REWRITES, FusionReport, unmatched_rewrites
    from tests.conftest import make_model

    # a ReduceSum over axis 0: RowSumCast starts from ReduceSum but wants axis 1 of a 2-D int input
    node = helper.make_node("ReduceSum", ["m"], ["s"], keepdims=0, axes=[0])
    model = make_model(
        [node], [helper.make_tensor_value_info("m", TensorProto.INT64, [2, 3])],
        [helper.make_tensor_value_info("s", TensorProto.INT64, None)], opset=11,
    )  # fmt: skip
    unmatched = unmatched_rewrites(model, "cuda", FusionReport())
    assert list(unmatched) == ["row_sums"] and "axis 1" in unmatched["row_sums"]
    assert "row_sums" in DEVICE_REWRITES["cuda"]
