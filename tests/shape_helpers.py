"""Helpers for the shape/capture tests: tiny decoder packages, and every intermediate value's
actual shape from onnxruntime (the independent oracle)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper


def build_tiny_packages(tmp_path_factory: pytest.TempPathFactory):
    """Tiny random decoders (2 layers) in both graph flavours (use as a session fixture)."""
    from onnxgen.models.builder import build_package
    from onnxgen.models.config import DecoderConfig
    from onnxgen.models.random_source import RandomSource

    config = DecoderConfig("llama", 64, 64, 48, 2, 4, 2, 16, 1e-5, 10000.0, 64, True, False, eos_token_id=[1])
    root = tmp_path_factory.mktemp("tiny_packages")
    dirs = {a: build_package(RandomSource(config), root / a, attention=a) for a in ("standard", "gqa")}
    return config, dirs


def _exposed(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """The model with every node output also a graph output (types from onnx's inference)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in inferred.graph.value_info}
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    names = []
    for node in m.graph.node:
        for o in node.output:
            if o and o not in have and o in types:
                m.graph.output.append(helper.make_tensor_value_info(o, types[o], None))
                have.add(o)
            if o:
                names.append(o)
    return m, names


def run_all_values(model_dir, feeds: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """Every value's actual shape, from onnxruntime CPU (independent of onnxgen's kernels)."""
    import onnxruntime as ort

    model = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    exposed, _ = _exposed(model)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    path = model_dir / "exposed.onnx"
    onnx.save(exposed, str(path))
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return {n: tuple(v.shape) for n, v in zip(names, session.run(None, feeds))}


def decode_feeds(config, attention: str, batch: int, past: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    total = past + 1
    feeds = {
        "input_ids": rng.integers(0, config.vocab_size, (batch, 1), dtype=np.int64),
        "attention_mask": np.ones((batch, total), dtype=np.int64),
    }
    if attention == "standard":
        feeds["position_ids"] = np.full((batch, 1), past, dtype=np.int64)
    for i in range(config.num_hidden_layers):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = rng.standard_normal(
                (batch, config.num_key_value_heads, past, config.head_dim), dtype=np.float32
            )
    return feeds


def typed_exposed(model: onnx.ModelProto, dtypes: dict[str, int]) -> onnx.ModelProto:
    """Every node output made a graph output, typed by onnx's inference or else by ``dtypes``
    (element types only: the shapes stay for onnxruntime to produce)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
        types = {vi.name: vi.type.tensor_type.elem_type for vi in inferred.graph.value_info}
    except Exception:
        types = {}
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for node in m.graph.node:
        for o in node.output:
            dtype = types.get(o) or dtypes.get(o)
            if o and o not in have and dtype:
                m.graph.output.append(helper.make_tensor_value_info(o, dtype, None))
                have.add(o)
    return m


def ort_value_shapes(model: onnx.ModelProto, feeds: dict[str, np.ndarray], base_dir=None) -> dict[str, tuple]:
    """name -> actual shape of every graph input, initializer-free output and intermediate value."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    if base_dir is not None:  # external weights resolve next to the original file
        path = base_dir / "exposed.onnx"
        onnx.save(model, str(path))
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    else:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    shapes = {n: tuple(v.shape) for n, v in zip(names, session.run(None, feeds))}
    shapes.update({k: tuple(v.shape) for k, v in feeds.items()})
    return shapes


def assert_plan_sound(plan, shapes_nodes, runs: list[dict[str, tuple]], initializers: set[str]) -> int:
    """Every node the plan captures has identical input and output shapes in every run.
    Returns how many captured nodes were checked."""
    checked = 0
    for node_plan, node in zip(plan.nodes, shapes_nodes):
        if not node_plan.capturable:
            continue
        for name in [*node.inputs, *node.outputs]:
            if not name or name in initializers:
                continue
            seen = {run[name] for run in runs if name in run}
            assert len(seen) == 1, f"captured node {node.name} ({node.op_type}): {name} has shapes {seen}"
        checked += 1
    return checked
