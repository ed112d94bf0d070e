"""The small ops of a Gated DeltaNet layer on a Triton device: the kernels of LinearAttentionGate,
GatedRMSNorm and the L2 norm (gpu/linear_attention_gate.py, gpu/gated_rms_norm.py, gpu/l2_norm.py)
against the torch path of the ops that dispatch to them, and the rewrites that feed them
(runtime/fusion_hybrid.py: the L2Normalize chain, the key repeat of inverse GQA) against onnxruntime
on the graph as written.

On the CPU the kernels run through Triton's interpreter, which must be on before triton defines a
kernel: test_kernels_match_the_torch_path_through_the_triton_interpreter runs this file again in a
child process with TRITON_INTERPRET=1, where the kernel tests run (in a plain process they skip).
On CUDA they run directly (gpu mark), and once more on the qwen3.5-0.8b layer widths.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnxgen import options
from onnxgen.models.random_source import MODEL_SHAPES
from onnxgen.runtime import InferenceSession
from onnxgen.runtime.fusion import fuse_graph
from onnxgen.runtime.gpu.launch import LAUNCHES, interpreting
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.contrib_gated import gated_rms_norm, linear_attention_gate
from onnxgen.runtime.ops.fused import l2_normalize
from onnxgen.runtime.ops.normalization import lp_normalization
from tests.conftest import gated_delta_feeds, make_model, ort_run
from tests.interpreted_kernels import HAS_CUDA, KERNEL_DEVICES
from tests.interpreted_runs import IN_THE_PARENT, interpreted_file, runs

# relative to the reference's largest magnitude: fp32 rounding, about one ulp of the half types
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
# Triton's interpreter truncates fp32 -> bfloat16 where compiled kernels and torch round to nearest
INTERPRETED_BF16_TOL = 1.6e-2
MS = "com.microsoft"


def _ctx(op: str, domain: str, device: str, attrs: dict, num_inputs: int, wanted: tuple[bool, ...]) -> NodeContext:
    return NodeContext(op, op, domain, 1, attrs, torch.device(device), num_inputs, len(wanted), wanted)


def _close(actual: torch.Tensor | None, expected: torch.Tensor | None) -> None:
    if expected is None:
        assert actual is None
        return
    assert actual is not None and actual.dtype == expected.dtype and actual.shape == expected.shape
    assert actual.is_contiguous()
    a, e = actual.double().cpu(), expected.double().cpu()
    error = float((a - e).abs().max()) / max(float(e.abs().max()), 1e-6)
    interpreted_bf16 = expected.dtype == torch.bfloat16 and actual.device.type == "cpu"
    assert error < (INTERPRETED_BF16_TOL if interpreted_bf16 else TOL[expected.dtype]), error


def _kernel_vs_torch(kernel: str, run: Callable[[], object]) -> None:
    """``run`` (an op call) takes the kernel, twice with bit-identical results (what a replayed graph
    relies on), and matches the torch path (triton off)."""
    before = LAUNCHES[kernel]
    fused, again = run(), run()
    assert LAUNCHES[kernel] == before + 2, f"{kernel} did not run"
    with options.override(triton=False):
        reference = run()
    as_tuple = lambda v: v if isinstance(v, tuple) else (v,)  # noqa: E731
    for actual, repeat, expected in zip(as_tuple(fused), as_tuple(again), as_tuple(reference), strict=True):
        assert actual is None or torch.equal(actual, repeat)
        _close(actual, expected)


def _randn(*shape: int, gen: torch.Generator, device: str, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _columns(t: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """Columns [start, start + width) of t's last axis: a strided view, as Split's and MatMulGroup's outputs are."""
    return t[..., start : start + width]


# ---------------------------------------------------------------- L2 norm (L2Normalize, LpNormalization)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["heads_of_a_split_view", "contiguous_2d", "rank_1"])
def test_l2_norm_matches_the_torch_path(device: str, dtype: torch.dtype, layout: str) -> None:
    gen = torch.Generator().manual_seed(0)
    if layout == "heads_of_a_split_view":  # q of a conv output [B, T, 3 * 2 * 17 + 5], as [B, T, 2, 17]
        x = _columns(_randn(3, 2, 107, gen=gen, device=device, dtype=dtype), 34, 34).reshape(3, 2, 2, 17)
        assert not x.is_contiguous()
    elif layout == "contiguous_2d":
        x = _randn(5, 33, gen=gen, device=device, dtype=dtype, scale=0.01)
    else:
        x = _randn(7, gen=gen, device=device, dtype=dtype)
    ctx = _ctx("L2Normalize", "onnxgen", device, {"epsilon": 1e-6}, 1, (True,))
    _kernel_vs_torch("l2_norm", lambda: l2_normalize(ctx, x))


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lp_normalization_of_the_last_axis_takes_the_kernel_and_keeps_zero_vectors_zero(
    device: str, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(1)
    x = _randn(2, 1, 3, 9, gen=gen, device=device, dtype=dtype)
    x[0, 0, 1] = 0.0  # a zero head: LpNormalization gives zeros, not NaN
    ctx = _ctx("LpNormalization", "", device, {"axis": -1, "p": 2}, 1, (True,))
    _kernel_vs_torch("l2_norm", lambda: lp_normalization(ctx, x))
    assert not torch.isnan(lp_normalization(ctx, x)).any()


# ---------------------------------------------------------------- GatedRMSNorm


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("activation", "group", "groups", "scale_fp32"), [("silu", 12, 3, True), ("sigmoid", 7, 1, False)]
)
def test_gated_rms_norm_matches_the_torch_path(
    device: str, dtype: torch.dtype, activation: str, group: int, groups: int, scale_fp32: bool
) -> None:
    """X [B, T, H * C] as LinearAttention writes it; the gate a member of a wider GEMM output."""
    gen = torch.Generator().manual_seed(2)
    width = group * groups
    x = _randn(2, 3, width, gen=gen, device=device, dtype=dtype)
    gate = _columns(_randn(2, 3, width + 11, gen=gen, device=device, dtype=dtype, scale=2.0), 5, width)
    scale = 1.0 + 0.1 * torch.randn(group, generator=gen)
    scale = scale.to(device=device, dtype=torch.float32 if scale_fp32 else dtype)
    ctx = _ctx("GatedRMSNorm", MS, device, {"activation": activation, "epsilon": 1e-6}, 3, (True,))
    _kernel_vs_torch("gated_rms_norm", lambda: gated_rms_norm(ctx, x, scale, gate))


# ---------------------------------------------------------------- LinearAttentionGate


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("beta", [True, False])
def test_linear_attention_gate_matches_the_torch_path(device: str, dtype: torch.dtype, beta: bool) -> None:
    """a and b: the two narrow members at the end of the in_proj group's output; dt_bias and
    decay_scale float32 (the schema's type) whatever the activations. Arguments reach softplus's
    linear region (above 20) and its far negative tail."""
    gen = torch.Generator().manual_seed(3)
    heads = 5
    projected = _randn(3, 2, 40 + 2 * heads, gen=gen, device=device, dtype=dtype, scale=3.0)
    projected[0, 0, 40] = 25.0
    projected[0, 1, 41] = -30.0
    a, b = _columns(projected, 40, heads), _columns(projected, 40 + heads, heads)
    dt_bias = torch.randn(heads, generator=gen).to(device)
    decay_scale = -torch.rand(heads, generator=gen).exp().to(device)
    wanted = (True, beta)
    ctx = _ctx("LinearAttentionGate", MS, device, {}, 4, wanted)
    _kernel_vs_torch(
        "linear_attention_gate", lambda: linear_attention_gate(ctx, a, dt_bias, decay_scale, b if beta else None)
    )


# ---------------------------------------------------------------- the rewrites, against onnxruntime


def _const(name: str, values: list, dtype=np.int64) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, dtype=dtype), name)


def l2_chain_model(
    elem: int = TensorProto.FLOAT,
    axes: tuple[int, ...] = (-1,),
    keepdims: int = 1,
    divide_by_other: bool = False,
    eps_shape: tuple[int, ...] = (),
    sqrt_read_elsewhere: bool = False,
    axes_as_attribute: bool = False,
) -> onnx.ModelProto:
    """x [B, T, 2 * 6] -> Reshape [0, 0, 2, 6] -> the L2 norm chain -> Reshape [0, 0, 12], as onnxgen's
    builder writes the Gated DeltaNet query / key norm; the keyword arguments make near misses."""
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    inits = [
        _const("heads", [0, 0, 2, 6]),
        _const("flat", [0, 0, 12]),
        numpy_helper.from_array(np.full(eps_shape, 1e-6, dtype=dtype), "eps"),
    ]
    if axes_as_attribute:  # opset 13: axes is an attribute
        reduce = helper.make_node("ReduceSumSquare", ["xh"], ["s"], axes=list(axes), keepdims=keepdims)
    else:
        inits.append(_const("axes", list(axes)))
        reduce = helper.make_node("ReduceSumSquare", ["xh", "axes"], ["s"], keepdims=keepdims)
    nodes = [
        helper.make_node("Reshape", ["x", "heads"], ["xh"]),
        reduce,
        helper.make_node("Add", ["eps", "s"], ["se"]),
        helper.make_node("Sqrt", ["se"], ["norm"]),
        helper.make_node("Div", ["other" if divide_by_other else "xh", "norm"], ["y4"]),
        helper.make_node("Reshape", ["y4", "flat"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info("x", elem, ["b", "t", 12])]
    if divide_by_other:
        inputs.append(helper.make_tensor_value_info("other", elem, ["b", "t", 2, 6]))
    outputs = [helper.make_tensor_value_info("y", elem, None)]
    if sqrt_read_elsewhere:
        outputs.append(helper.make_tensor_value_info("norm", elem, None))
    return make_model(nodes, inputs, outputs, inits, opset=13 if axes_as_attribute else 21)


@pytest.mark.parametrize(("elem", "tol"), [(TensorProto.FLOAT, 1e-6), (TensorProto.FLOAT16, 1e-3)])
@pytest.mark.parametrize("axes_as_attribute", [False, True])
def test_l2_norm_chain_becomes_one_op_and_matches_onnxruntime(elem: int, tol: float, axes_as_attribute: bool) -> None:
    model = l2_chain_model(elem, axes_as_attribute=axes_as_attribute)
    fused, report = fuse_graph(model)
    assert report.l2_norms == 1
    assert [n.op_type for n in fused.graph.node] == ["Reshape", "L2Normalize", "Reshape"]
    x = np.random.default_rng(4).standard_normal((2, 3, 12)).astype(helper.tensor_dtype_to_np_dtype(elem))
    x[0, 0, :6] = 0.0  # a zero head: the epsilon keeps it finite in both
    (want,) = ort_run(model, {"x": x})
    before = LAUNCHES["l2_norm"]
    (got,) = InferenceSession(fused, device="cpu").run(None, {"x": x})
    assert LAUNCHES["l2_norm"] == before + (1 if interpreting() else 0)  # the kernel where Triton serves
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "near_miss",
    [
        {"axes": (2,)},  # another axis
        {"axes": (-1, -2)},
        {"keepdims": 0},
        {"divide_by_other": True},
        {"eps_shape": (1, 1, 1, 1, 2)},  # not a scalar: it would widen the broadcast
        {"sqrt_read_elsewhere": True},
    ],
)
def test_near_misses_of_the_l2_norm_chain_are_not_rewritten(near_miss: dict) -> None:
    model = l2_chain_model(**near_miss)
    fused, report = fuse_graph(model)
    assert report.l2_norms == 0 and "L2Normalize" not in {n.op_type for n in fused.graph.node}


def repeated_keys_model(hq: int = 2, hkv: int = 4, d: int = 4, interleaved: bool = True) -> onnx.ModelProto:
    """LinearAttention (gated delta rule, inverse GQA) whose keys are k's heads repeated by
    Reshape -> Tile -> Reshape, as onnxgen's builder writes it; ``interleaved=False`` repeats the
    whole block of heads instead (head j reads key head j mod Hq), which is not the op's sharing."""
    r = hkv // hq
    split, reps = ([0, 0, hq, 1, d], [1, 1, 1, r, 1]) if interleaved else ([0, 0, 1, hq, d], [1, 1, r, 1, 1])
    inits = [_const("split", split), _const("reps", reps), _const("flat", [0, 0, hkv * d])]
    nodes = [
        helper.make_node("Reshape", ["k", "split"], ["k5"]),
        helper.make_node("Tile", ["k5", "reps"], ["k5r"]),
        helper.make_node("Reshape", ["k5r", "flat"], ["kr"]),
        helper.make_node(
            "LinearAttention", ["q", "kr", "v", "past", "decay", "beta"], ["out", "state"], domain=MS,
            q_num_heads=hq, kv_num_heads=hkv, update_rule="gated_delta",
        ),
    ]  # fmt: skip
    f32 = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info(name, f32, shape)
        for name, shape in (("q", ["b", "t", hq * d]), ("k", ["b", "t", hq * d]), ("v", ["b", "t", hkv * 3]),
                            ("past", ["b", hkv, d, 3]), ("decay", ["b", "t", hkv]), ("beta", ["b", "t", hkv]))
    ]  # fmt: skip
    outputs = [helper.make_tensor_value_info(n, f32, None) for n in ("out", "state")]
    return make_model(nodes, inputs, outputs, inits)


@pytest.mark.parametrize("t", [1, 3])
def test_the_key_repeat_is_dropped_and_the_attention_matches_onnxruntime(t: int) -> None:
    model = repeated_keys_model()
    fused, report = fuse_graph(model)
    assert report.key_repeats == 1
    assert [n.op_type for n in fused.graph.node] == ["Reshape", "LinearAttention"]
    feeds = gated_delta_feeds(t, key_heads=2, kv_heads=4, d=4, dv=3, seed=5)
    want = ort_run(model, feeds)
    got = InferenceSession(fused, device="cpu").run(None, feeds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("near_miss", [{"interleaved": False}, {"hq": 2, "hkv": 2}])
def test_other_key_layouts_keep_their_repeat(near_miss: dict) -> None:
    model = repeated_keys_model(**near_miss)
    _, report = fuse_graph(model)
    assert report.key_repeats == 0


# ---------------------------------------------------------------- sigmoid gates (fusion_gates.py)


def gate_model(elem: int, *, per_row: bool, add: bool, silu: bool = False, sigmoid_read_twice: bool = False):
    """Qwen3.5's gates: y * sigmoid(g) then o_proj (per element, ``add`` False) or the shared expert's
    y * sigmoid(g) + x with one gate per row; ``silu``: the Mul takes the Sigmoid's own input."""
    g_shape = ["t", 1] if per_row else ["t", 8]
    nodes = [
        helper.make_node("Sigmoid", ["g"], ["s"]),
        helper.make_node("Mul", ["g" if silu else "y", "s"], ["m"]),
    ]
    outputs = ["m"]
    if add:
        nodes.append(helper.make_node("Add", ["x", "m"], ["out"]))
        outputs = ["out"]
    if sigmoid_read_twice:
        outputs.append("s")
    inputs = [helper.make_tensor_value_info(n, elem, shape) for n, shape in (("y", ["t", 8]), ("g", g_shape),
                                                                            ("x", ["t", 8]))]  # fmt: skip
    return make_model(nodes, inputs, [helper.make_tensor_value_info(o, elem, None) for o in outputs])


@pytest.mark.parametrize(("elem", "tol"), [(TensorProto.FLOAT, 1e-6), (TensorProto.FLOAT16, 1e-3)])
@pytest.mark.parametrize(("per_row", "add"), [(True, True), (False, False), (False, True)])
def test_sigmoid_gates_become_one_op_and_match_onnxruntime(elem: int, tol: float, per_row: bool, add: bool) -> None:
    model = gate_model(elem, per_row=per_row, add=add)
    fused, report = fuse_graph(model)
    assert report.sigmoid_gates == 1
    (node,) = fused.graph.node
    assert node.op_type == "SigmoidGate" and list(node.input) == (["y", "g", "x"] if add else ["y", "g"])
    rng = np.random.default_rng(9)
    np_type = helper.tensor_dtype_to_np_dtype(elem)
    feeds = {"y": rng.standard_normal((3, 8)), "g": 2 * rng.standard_normal((3, 1 if per_row else 8)),
             "x": rng.standard_normal((3, 8))}  # fmt: skip
    feeds = {k: v.astype(np_type) for k, v in feeds.items()}
    (want,) = ort_run(model, feeds)
    before = LAUNCHES["sigmoid_gate"]
    (got,) = InferenceSession(fused, device="cpu").run(None, feeds)
    assert LAUNCHES["sigmoid_gate"] == before + (1 if interpreting() else 0)  # the kernel where Triton serves
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)


def test_a_product_of_two_sigmoids_becomes_one_gate() -> None:
    """Mul(Sigmoid(a), Sigmoid(b)): either Sigmoid starts a gate over the one Mul; the rewrite takes
    the first and leaves the other Sigmoid as the gate's y (a second match over the taken Mul left
    a gate reading the first Sigmoid's removed output), and the result is onnxruntime's."""
    nodes = [helper.make_node("Sigmoid", ["a"], ["sa"]), helper.make_node("Sigmoid", ["b"], ["sb"]),
             helper.make_node("Mul", ["sa", "sb"], ["out"])]  # fmt: skip
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 8]) for n in ("a", "b")]
    model = make_model(nodes, inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    fused, report = fuse_graph(model, frozenset({"sigmoid_gates"}))
    assert report.sigmoid_gates == 1
    assert [n.op_type for n in fused.graph.node] == ["Sigmoid", "SigmoidGate"]
    rng = np.random.default_rng(4)
    feeds = {n: rng.standard_normal((3, 8)).astype(np.float32) for n in ("a", "b")}
    (want,) = ort_run(model, feeds)
    (got,) = InferenceSession(fused, device="cpu").run(None, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("near_miss", [{"silu": True}, {"sigmoid_read_twice": True}])
def test_near_misses_of_the_sigmoid_gate_are_not_rewritten(near_miss: dict) -> None:
    from onnxgen.runtime.fusion import unmatched_rewrites

    model = gate_model(TensorProto.FLOAT, per_row=False, add=True, **near_miss)
    _, report = fuse_graph(model)
    assert report.sigmoid_gates == 0
    # `onnxgen show` names the rewrite as unmatched (where SiluMul takes every Sigmoid, as in a SwiGLU
    # MLP, it does not: tests/test_foreign_packages.py)
    assert "sigmoid_gates" in unmatched_rewrites(model, "cuda", report)


# ---------------------------------------------------------------- the drivers


@IN_THE_PARENT
@runs(KERNELS := interpreted_file(__file__, "through_the_triton_interpreter or near_miss or other_key_layouts"))
def test_kernels_match_the_torch_path_through_the_triton_interpreter() -> None:
    KERNELS.launches()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 4])
def test_kernels_on_the_qwen35_08b_layer_widths(rows: int) -> None:
    """One Gated DeltaNet layer of the qwen3.5-0.8b shape in fp16, batch ``rows``, one token: q and k
    (16 heads of 128) as views of the conv output, a / b / z as members of the in_proj group's output."""
    la = MODEL_SHAPES["qwen3.5-0.8b"].linear_attention
    assert la is not None
    gen = torch.Generator().manual_seed(6)
    f16 = torch.float16
    key_dim, value_dim, heads = la.key_dim, la.value_dim, la.num_value_heads
    mixed = _randn(rows, 1, 2 * key_dim + value_dim, gen=gen, device="cuda", dtype=f16)
    l2 = _ctx("L2Normalize", "onnxgen", "cuda", {"epsilon": 1e-6}, 1, (True,))
    for start in (0, key_dim):
        x = _columns(mixed, start, key_dim).reshape(rows, 1, la.num_key_heads, la.key_head_dim)
        _kernel_vs_torch("l2_norm", lambda x=x: l2_normalize(l2, x))
    projected = _randn(rows, 1, 2 * key_dim + 2 * value_dim + 2 * heads, gen=gen, device="cuda", dtype=f16)
    z = _columns(projected, 2 * key_dim + value_dim, value_dim)
    a, b = (
        _columns(projected, projected.shape[-1] - 2 * heads, heads),
        _columns(projected, projected.shape[-1] - heads, heads),
    )
    dt_bias = torch.randn(heads, generator=gen).cuda()
    decay_scale = -torch.rand(heads, generator=gen).exp().cuda()
    gate = _ctx("LinearAttentionGate", MS, "cuda", {}, 4, (True, True))
    _kernel_vs_torch("linear_attention_gate", lambda: linear_attention_gate(gate, a, dt_bias, decay_scale, b))
    out = _randn(rows, 1, value_dim, gen=gen, device="cuda", dtype=f16)
    scale = (1.0 + 0.1 * torch.randn(la.value_head_dim, generator=gen)).to("cuda", f16)
    norm = _ctx("GatedRMSNorm", MS, "cuda", {"activation": "silu", "epsilon": 1e-6}, 3, (True,))
    _kernel_vs_torch("gated_rms_norm", lambda: gated_rms_norm(norm, out, scale, z))
