"""bench/gemv_micro.py times the one-row products a decode step runs: its list of (K, N) must be
the products the CUDA rewrites make of a built package (each MatMulGroup / MatMulNBitsGroup: the
members' K and summed widths), for a dense, a hybrid and a mixture-of-experts decoder."""

from __future__ import annotations

import onnx
import pytest
from onnx import helper

from bench.gemv_micro import config_layer_shapes
from onnxgen.models.builder import build_package
from onnxgen.models.random_source import TINY_CONFIGS, RandomSource
from onnxgen.runtime.fusion import DEVICE_REWRITES, FUSED_DOMAIN, fuse_graph


def _grouped_products(model: onnx.ModelProto, inits: dict[str, tuple[int, ...]]) -> set[tuple[int, int]]:
    products = set()
    for node in model.graph.node:
        if node.domain != FUSED_DOMAIN or node.op_type not in ("MatMulGroup", "MatMulNBitsGroup"):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        widths = sum(int(w) for w in attrs["widths"])
        k = int(attrs["K"]) if "K" in attrs else inits[node.input[1]][0]
        products.add((k, widths))
    return products


@pytest.mark.parametrize(("name", "precision"), [("tiny-qwen2", "fp16"), ("tiny-qwen3.5", "int4"),
                                                 ("tiny-qwen3.5-moe", "int4")])  # fmt: skip
def test_gemv_bench_times_the_products_the_runtime_groups(tmp_path, name: str, precision: str) -> None:
    config = TINY_CONFIGS[name]
    package = build_package(RandomSource(config), tmp_path / name, precision=precision, device="cuda")
    model = onnx.load(str(package / "model.onnx"))
    inits = {t.name: tuple(t.dims) for t in model.graph.initializer}
    fused, report = fuse_graph(model, DEVICE_REWRITES["cuda"])
    assert report.singles or report.matmul_groups or report.matmul_nbits_groups
    expected = {(k, n) for _, k, n in config_layer_shapes(config)}
    if config.tie_word_embeddings and precision != "int4":  # the lm_head multiplies the embedding table
        expected.discard((config.hidden_size, config.vocab_size))  # itself (no group); the bench times it alike
    assert _grouped_products(fused, inits) == expected
