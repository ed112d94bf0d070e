"""CPU decode fast paths against onnxruntime (1.32, CPU, graph optimizations off).

- MatMulNBits through torch's int4 GEMM (accuracy_level >= 3 only: it rounds A, scales and
  zeros to bf16). Oracle: onnxruntime at accuracy_level 0 (exact fp32 arithmetic); tolerance
  1e-2 of the output scale (bf16 keeps 8 mantissa bits: ~4e-3 per rounding; measured worst case
  5.1e-3; onnxruntime at level 4, which rounds A to int8, is off by up to 8.2e-3
  on the same cases). At accuracy_level 0 the path must not be taken (exact to 1e-5 of the scale).
- GroupQueryAttention's appending step (batch 1, past + new rows = total): outputs and presents
  as onnxruntime, tolerance 1e-5 (fp32), as in test_ops_contrib.
Each test also checks that the fast path really ran.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

from onnxgen.runtime.ops import contrib_attention, contrib_quant
from tests.conftest import make_model, onnxgen_run, ort_run
from tests.test_ops_contrib import GqaCase, matmul_nbits_model, run_gqa_separate

INT4_TOL = 1e-2


def _with_level(model: onnx.ModelProto, level: int) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for attr in copy.graph.node[0].attribute:
        if attr.name == "accuracy_level":
            attr.i = level
    return copy


@pytest.fixture
def int4_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = contrib_quant._Int4Plan.run

    def counting(self, a, bias):
        calls.append(a.shape[-2] if a.dim() > 1 else 1)
        return original(self, a, bias)

    monkeypatch.setattr(contrib_quant._Int4Plan, "run", counting)
    return calls


def _max_rel_error(actual: np.ndarray, expected: np.ndarray) -> float:
    scale = float(np.abs(expected.astype(np.float64)).max())
    return float(np.abs(actual.astype(np.float64) - expected.astype(np.float64)).max()) / scale


@pytest.mark.parametrize(
    ("bits", "zp_kind"), [(4, "none"), (4, "packed"), (4, "float"), (8, "none"), (8, "packed")]
)  # (onnxruntime's CPU kernel refuses 8-bit codes with float zero points: the next test)
@pytest.mark.parametrize("block_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [TP.FLOAT, TP.FLOAT16])
def test_matmul_nbits_int4_gemm_matches_onnxruntime(bits, zp_kind, block_size, dtype, int4_calls) -> None:
    """4-bit codes, and 8-bit ones as two 4-bit planes (their high and low nibbles)."""
    k, n = 256, 48
    model = matmul_nbits_model(k, n, bits, block_size, dtype, zp_kind, accuracy_level=4, with_bias=True)
    exact = _with_level(model, 0)
    rng = np.random.default_rng(3)
    npt = np.float32 if dtype == TP.FLOAT else np.float16
    for shape in ((1, k), (1, 1, k), (5, k), (2, 3, k)):
        a = rng.standard_normal(shape).astype(npt)
        expected = ort_run(exact, {"A": a})[0]
        actual = onnxgen_run(model, {"A": a})[0]
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        assert _max_rel_error(actual, expected) < INT4_TOL, shape
    assert len(int4_calls) == 4, "the int4 GEMM path did not run"


def test_matmul_nbits_8bit_planes_with_float_zero_points(int4_calls) -> None:
    """8-bit codes with float zero points (fractional here) through the two planes, against the
    contrib op's formula, (code - zero_point) * scale per block, in float64."""
    k, n, bs = 256, 48, 32
    model = matmul_nbits_model(k, n, 8, bs, TP.FLOAT, "float", accuracy_level=4)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    codes = inits["B"].reshape(n, k // bs, bs).astype(np.float64)
    w = (codes - inits["zp"].reshape(n, -1, 1)) * inits["scales"].reshape(n, -1, 1)
    rng = np.random.default_rng(9)
    for rows in (1, 5, 80):  # 80: the many-row path where this machine's packing is read back
        a = rng.standard_normal((rows, k)).astype(np.float32)
        assert _max_rel_error(onnxgen_run(model, {"A": a})[0], a.astype(np.float64) @ w.reshape(n, k).T) < INT4_TOL
    assert len(int4_calls) == 3, "the int4 GEMM path did not run"


def test_matmul_nbits_level0_stays_exact(int4_calls) -> None:
    model = matmul_nbits_model(256, 48, 4, 32, TP.FLOAT, "packed", accuracy_level=0)
    a = np.random.default_rng(4).standard_normal((3, 256)).astype(np.float32)
    actual, expected = onnxgen_run(model, {"A": a})[0], ort_run(model, {"A": a})[0]
    assert _max_rel_error(actual, expected) < 1e-5
    assert not int4_calls


def test_matmul_nbits_int4_plan_follows_a_changed_weight(int4_calls) -> None:
    """B fed as a graph input: a new B must not be served from the first call's packed copy."""
    from onnxgen.runtime import InferenceSession

    k, n = 64, 32
    model = matmul_nbits_model(k, n, 4, 32, TP.FLOAT, "none", accuracy_level=4)
    b_init = next(t for t in model.graph.initializer if t.name == "B")
    b_shape = list(b_init.dims)
    model.graph.initializer.remove(b_init)
    model.graph.input.append(helper.make_tensor_value_info("B", TP.UINT8, b_shape))
    session = InferenceSession(model, device="cpu")
    exact = _with_level(model, 0)
    rng = np.random.default_rng(5)
    a = rng.standard_normal((1, k)).astype(np.float32)
    for _ in range(2):
        b = rng.integers(0, 256, b_shape).astype(np.uint8)
        expected = ort_run(exact, {"A": a, "B": b})[0]
        actual = session.run(None, {"A": a, "B": b})[0]
        assert _max_rel_error(actual, expected) < INT4_TOL
    assert len(int4_calls) == 2


def test_matmul_nbits_unsupported_shapes_keep_exact_path(int4_calls) -> None:
    # N = 24 is not a multiple of 16 and K = 200 is not a multiple of the block: no int4 GEMM
    model = matmul_nbits_model(200, 24, 4, 32, TP.FLOAT, "packed", accuracy_level=4)
    a = np.random.default_rng(6).standard_normal((2, 200)).astype(np.float32)
    actual, expected = onnxgen_run(model, {"A": a})[0], ort_run(_with_level(model, 0), {"A": a})[0]
    assert _max_rel_error(actual, expected) < 1e-5
    assert not int4_calls


# -- GroupQueryAttention: the appending step ---------------------------------------------------------


@pytest.fixture
def appending_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = contrib_attention._appending_step

    def counting(ctx, q, *args, **kwargs):
        calls.append(q.shape[2])
        return original(ctx, q, *args, **kwargs)

    monkeypatch.setattr(contrib_attention, "_appending_step", counting)
    return calls


# a prompt, decode steps, then a 3-token continuation chunk and one more decode step
STEPS = [(5, [5]), (1, [6]), (1, [7]), (3, [10]), (1, [11])]


@pytest.mark.parametrize(
    "case",
    [
        GqaCase(rotary="half"),
        GqaCase(rotary="interleaved", packed=True),
        GqaCase(rotary="half", with_position_ids=True),
        GqaCase(rotary="half", attrs={"local_window_size": 4}),
        GqaCase(rotary="none", attrs={"softcap": 2.0}),
        GqaCase(rotary="half", with_sink=True),
        GqaCase(num_heads=6, kv_heads=3, head_size=32, rotary="half", rotary_dim=16),
    ],
    ids=["rotary", "packed-interleaved", "position-ids", "window", "softcap", "sink", "partial-rotary"],
)
def test_gqa_appending_step_matches_onnxruntime(case: GqaCase, appending_calls) -> None:
    run_gqa_separate(case, STEPS, "cpu")
    assert appending_calls == [seq for seq, _ in STEPS], "the appending path did not take every step"


def test_gqa_padded_batch_takes_general_path(appending_calls) -> None:
    run_gqa_separate(GqaCase(rotary="half"), [(5, [5, 3]), (1, [6, 4])], "cpu")
    assert not appending_calls


def test_gqa_right_padded_single_prompt_takes_general_path(appending_calls) -> None:
    """One sequence of 3 tokens padded to 5 (total 5, seqlens_k 2): not a plain append."""
    case = GqaCase(rotary="half")
    model = case.model()
    rng = np.random.default_rng(8)
    empty = np.zeros((1, case.kv_heads, 0, case.head_size), np.float32)
    feeds = case.feeds(rng, 5, [3], (empty, empty))
    feeds["total_sequence_length"] = np.array(5, np.int32)
    expected = ort_run(model, feeds)
    actual = onnxgen_run(model, feeds)
    np.testing.assert_allclose(actual[0][:, :3], expected[0][:, :3], rtol=1e-5, atol=1e-5)
    for got, want in zip(actual[1:], expected[1:]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not appending_calls


def test_matmul_nbits_int4_plan_sees_in_place_writes(int4_calls) -> None:
    """A packed weight written in place (same tensor, new version) is packed again."""
    import torch

    from onnxgen.runtime.node_contract import NodeContext

    k, n = 64, 32
    attrs = dict(K=k, N=n, bits=4, block_size=32, accuracy_level=4)
    ctx = NodeContext("mm", "MatMulNBits", "com.microsoft", 1, attrs, torch.device("cpu"), 3, 1, (True,))
    gen = torch.Generator().manual_seed(0)
    b = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.rand(n * k // 32, generator=gen) + 0.5
    a = torch.randn(1, k, generator=gen)
    contrib_quant.matmul_nbits(ctx, a, b, scales)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))
    after = contrib_quant.matmul_nbits(ctx, a, b, scales)
    weight = contrib_quant.dequantize_nbits(b, scales, None, None, k=k, n=n, bits=4, block_size=32, dtype=torch.float32)
    expected = (a.double() @ weight.double().T).float()
    assert (after - expected).abs().max() / expected.abs().max() < INT4_TOL
    assert len(int4_calls) == 2


# -- SkipSimplifiedLayerNormalization: the decoder's two-output form -------------------------------


def test_skip_rms_norm_output_and_sum_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs [y, "", "", sum] (what decoders use) go through torch's rms_norm: same as onnxruntime."""
    import torch

    from onnxgen.runtime.ops import contrib_norm

    calls: list[int] = []
    original = torch.nn.functional.rms_norm

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(contrib_norm.F, "rms_norm", counting)
    d = 96
    node = helper.make_node(
        "SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"], ["y", "", "", "sum"], domain="com.microsoft",
        epsilon=1e-5,
    )  # fmt: skip
    inputs = [
        helper.make_tensor_value_info("x", TP.FLOAT, [2, 3, d]),
        helper.make_tensor_value_info("skip", TP.FLOAT, [2, 3, d]),
    ]
    outputs = [helper.make_tensor_value_info(n, TP.FLOAT, None) for n in ("y", "sum")]
    rng = np.random.default_rng(9)
    gamma = onnx.numpy_helper.from_array(rng.standard_normal(d).astype(np.float32), "gamma")
    model = make_model([node], inputs, outputs, [gamma])
    feeds = {n: (rng.standard_normal((2, 3, d)) * 3).astype(np.float32) for n in ("x", "skip")}
    expected, actual = ort_run(model, feeds), onnxgen_run(model, feeds)
    for got, want in zip(actual, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert calls, "the rms_norm path did not run"


def test_gqa_rotary_factors_follow_the_position_with_constant_caches(appending_calls) -> None:
    """cos/sin caches as initializers (as in real models): factors shared across steps must follow
    the position, not be served stale."""
    from onnxgen.runtime import InferenceSession

    case = GqaCase(rotary="half")
    model = case.model()
    rng = np.random.default_rng(10)
    empty = np.zeros((1, case.kv_heads, 0, case.head_size), np.float32)
    caches = case.feeds(rng, 1, [1], (empty, empty))
    for name in ("cos_cache", "sin_cache"):
        model.graph.input.remove(next(i for i in model.graph.input if i.name == name))
        model.graph.initializer.append(onnx.numpy_helper.from_array(caches[name], name))
    session = InferenceSession(model, device="cpu")
    past = (empty, empty)
    for seq, seqlens in STEPS:
        feeds = case.feeds(rng, seq, seqlens, past)
        del feeds["cos_cache"], feeds["sin_cache"]
        expected = ort_run(model, feeds)
        actual = session.run(None, feeds)
        for got, want in zip(actual, expected):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        past = (expected[1], expected[2])
    assert len(appending_calls) == len(STEPS)


# -- fp32 MatMul / Gemm with one activation row: the weight split across threads -----------------


@pytest.fixture
def two_threads():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the split needs more than one thread (any machine can run two)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("op", ["MatMul", "Gemm"])
@pytest.mark.parametrize("a_shape", [(1, 1, 384), (1, 384), (2, 384), (8, 1, 384), (8, 384), (12, 384), (17, 384)])
def test_split_gemv_matches_onnxruntime(op: str, a_shape, two_threads, monkeypatch: pytest.MonkeyPatch) -> None:
    """One activation row (a decode step) and up to 16 (a batched one) take the fast forms of
    ops/cpu_gemv.py; more rows keep torch's plain product. Every form against onnxruntime."""
    from onnxgen.runtime.ops import cpu_gemv, linalg

    if op == "Gemm" and len(a_shape) != 2:
        pytest.skip("Gemm takes 2D A")
    served: list[bool] = []

    def recording(*args, **kwargs):
        out = cpu_gemv.split_gemv(*args, **kwargs)
        served.append(out is not None)
        return out

    monkeypatch.setattr(linalg, "split_gemv", recording)
    rng = np.random.default_rng(11)
    k, n = 384, 512
    if op == "MatMul":
        weight = rng.standard_normal((k, n)).astype(np.float32)
        node = helper.make_node("MatMul", ["A", "W"], ["Y"])
    else:  # the lm_head form: W is [N, K], transB=1
        weight = rng.standard_normal((n, k)).astype(np.float32)
        node = helper.make_node("Gemm", ["A", "W"], ["Y"], transB=1)
    inputs = [helper.make_tensor_value_info("A", TP.FLOAT, list(a_shape))]
    outputs = [helper.make_tensor_value_info("Y", TP.FLOAT, None)]
    model = make_model([node], inputs, outputs, [onnx.numpy_helper.from_array(weight, "W")])
    a = rng.standard_normal(a_shape).astype(np.float32)
    actual, expected = onnxgen_run(model, {"A": a})[0], ort_run(model, {"A": a})[0]
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-4)
    rows = int(np.prod(a_shape[:-1]))
    assert served == [rows <= 16], "the fast path ran where it should not, or did not run"


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 16])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("k,n", [(256, 768), (768, 256)])
def test_split_gemv_forms_equal_the_plain_product(rows: int, transposed: bool, k: int, n: int, two_threads) -> None:
    """Each form of split_gemv (one row: column blocks; several: column blocks, or W @ A^T for
    [N, K] weights with N >= K up to 8 rows) against torch's plain product, with a strided activation."""
    import torch

    from onnxgen.runtime.ops.cpu_gemv import split_gemv

    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(n, k, generator=generator) if transposed else torch.randn(k, n, generator=generator)
    a = torch.randn(rows, 1, 2 * k, generator=generator)[..., ::2]  # not contiguous
    out = split_gemv(a, weight, b_transposed=transposed)
    assert out is not None and out.shape == (rows, 1, n)
    plain = a.reshape(rows, k) @ (weight.t() if transposed else weight)
    torch.testing.assert_close(out.reshape(rows, n), plain, rtol=1e-5, atol=1e-4)


def test_int4_weights_are_packed_once_at_load(int4_calls) -> None:
    """A CPU session puts the int4 GEMM's layout in place of the codes, scales and zero points
    (prepack_int4): the originals are gone, so the weight is held once, and the path runs."""
    from onnxgen.runtime import InferenceSession

    model = matmul_nbits_model(256, 48, 4, 32, TP.FLOAT, "packed", accuracy_level=4, with_bias=True)
    session = InferenceSession(model, device="cpu")
    names = set(session.program.initializers)
    assert not {"B", "scales", "zp"} & names, names
    assert {"onnxgen.int4pack[B]", "onnxgen.int4pack_sz[B]", "bias"} <= names
    held = sum(t.numel() * t.element_size() for t in session.program.initializers.values())
    assert held == 48 * 256 // 2 + (256 // 32) * 48 * 2 * 2 + 48 * 4  # codes, bf16 scale/zero pairs, bias
    a = np.random.default_rng(8).standard_normal((2, 256)).astype(np.float32)
    expected = ort_run(_with_level(model, 0), {"A": a})[0]
    assert _max_rel_error(session.run(None, {"A": a})[0], expected) < INT4_TOL
    assert int4_calls == [2]
    level0 = InferenceSession(_with_level(model, 0), device="cpu")  # exact fp32 asked: left as it is
    assert {"B", "scales", "zp"} <= set(level0.program.initializers)


def test_8bit_weights_are_packed_once_at_load(int4_calls) -> None:
    """8-bit codes are prepacked as two 4-bit planes: a byte per weight, as B, and no fp32 copy."""
    from onnxgen.runtime import InferenceSession

    k, n = 256, 48
    model = matmul_nbits_model(k, n, 8, 32, TP.FLOAT, "packed", accuracy_level=4)
    contrib_quant.DEQUANT_CACHE.clear()
    session = InferenceSession(model, device="cpu")
    names = set(session.program.initializers)
    assert not {"B", "scales", "zp"} & names, names
    held = sum(t.numel() * t.element_size() for t in session.program.initializers.values())
    assert held == n * k + (k // 32) * 2 * n * 2 * 2  # both planes' codes, their bf16 scale/zero pairs
    a = np.random.default_rng(8).standard_normal((1, k)).astype(np.float32)
    expected = ort_run(_with_level(model, 0), {"A": a})[0]
    assert _max_rel_error(session.run(None, {"A": a})[0], expected) < INT4_TOL
    assert int4_calls == [1]
    assert contrib_quant.DEQUANT_CACHE.used == 0, "a dequantized copy was made"


@pytest.mark.parametrize(("bits", "zp_kind"), [(4, "none"), (4, "packed"), (4, "float"), (8, "none"), (8, "packed")])
@pytest.mark.parametrize("block_size", [32, 128])
def test_matmul_nbits_many_rows_dequantize_the_packed_weight_per_call(
    bits, zp_kind, block_size, int4_calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt chunk's product (at least int4pack_rows.MIN_ROWS rows) takes the weight dequantized
    from the int4 GEMM's packed layout for the call and one fp32 GEMM; the same oracle and
    tolerance as the kernel (it rounds the scales and zeros to bf16 alike)."""
    from onnxgen.runtime.ops import int4pack_rows

    if int4pack_rows.packed_block_rows() is None:
        pytest.skip("this machine's int4 packing is not a layout onnxgen reads back")
    rows_calls: list[int] = []
    original = int4pack_rows.matmul

    def counting(a, *args, **kwargs):
        rows_calls.append(a.shape[0])
        return original(a, *args, **kwargs)

    monkeypatch.setattr(int4pack_rows, "matmul", counting)
    k, n = 256, 128
    model = matmul_nbits_model(k, n, bits, block_size, TP.FLOAT, zp_kind, accuracy_level=4, with_bias=True)
    exact = _with_level(model, 0)
    rng = np.random.default_rng(11)
    for shape in ((80, k), (2, 40, k), (3, k)):
        a = rng.standard_normal(shape).astype(np.float32)
        expected = ort_run(exact, {"A": a})[0]
        actual = onnxgen_run(model, {"A": a})[0]
        assert actual.shape == expected.shape
        assert _max_rel_error(actual, expected) < INT4_TOL, shape
    assert rows_calls == [80, 80], "the many-row path did not run, or ran for 3 rows"
