"""Parity of the reduction, softmax, linear-algebra and quantization kernels with onnxruntime (CPU).

One table row per case: an op, its inputs (random, seeded by the row id), attributes and opset.
Host inputs (axes) are initializers, as in real models; a few rows feed them as graph inputs.
Tolerances, stated per row family:
  fp32 reductions / softmax / small matmuls: rtol=atol=1e-5 (ordering of fp32 sums only)
  fp16: rtol=atol=2e-3 for elementwise-sized results (about 2 fp16 ulps near 1),
        5e-3 for sums/matmuls over up to 16 terms (onnxruntime and torch accumulate differently)
  integers, argmax, hardmax, quantized outputs: exact
onnxruntime's Python API cannot return float8 (other than e4m3fn as raw bytes) or 4-bit outputs,
so those quantize rows append a DequantizeLinear and compare floats (exact).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from tests.conftest import DEVICES, assert_parity, make_model, onnxgen_run, ort_run

F32 = (1e-5, 1e-5)
F16 = (2e-3, 2e-3)
F16_SUM = (5e-3, 5e-3)
EXACT = (0.0, 0.0)


@dataclass
class Case:
    id: str
    nodes: list[onnx.NodeProto]
    inputs: list[tuple[str, np.ndarray]]  # graph inputs (fed)
    outputs: list[tuple[str, int]]  # name, element type
    inits: list[onnx.TensorProto] = field(default_factory=list)
    opset: int = 21
    tol: tuple[float, float] = F32


def _rng(key: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(key.encode()))


def _elem(array: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(array.dtype)


def _single(
    id: str,
    op: str,
    inputs: list[tuple[str, np.ndarray | None, bool]],  # (name, value, is_initializer); None = absent
    out_types: list[int] | None = None,
    attrs: dict[str, Any] | None = None,
    opset: int = 21,
    tol: tuple[float, float] = F32,
) -> Case:
    names, feeds, inits = [], [], []
    for name, value, is_init in inputs:
        if value is None:
            names.append("")
            continue
        names.append(name)
        if is_init:
            inits.append(numpy_helper.from_array(value, name))
        else:
            feeds.append((name, value))
    first = next(v for _, v, _ in inputs if v is not None)
    out_types = out_types or [_elem(first)]
    outs = [f"y{i}" for i in range(len(out_types))]
    node = helper.make_node(op, names, outs, **(attrs or {}))
    return Case(id, [node], feeds, list(zip(outs, out_types)), inits, opset, tol)


def _values(key: str, shape: tuple[int, ...], dtype: str, kind: str = "any") -> np.ndarray:
    rng = _rng(key)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype.startswith(("int", "uint")):
        low = 0 if dtype.startswith("u") else -9
        return rng.integers(low, 10, size=shape).astype(dtype)
    if kind == "pos":
        values = rng.uniform(0.5, 2.0, size=shape)
    elif kind == "ties":  # few distinct values: argmax/hardmax ties
        values = rng.integers(0, 3, size=shape).astype(np.float64)
    elif kind == "large":
        values = rng.uniform(-1000.0, 1000.0, size=shape)
    else:
        values = rng.uniform(-2.0, 2.0, size=shape)
    return values.astype(dtype)


# -- reductions ------------------------------------------------------------------------------

REDUCE_OPS = (
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd",
    "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
)  # fmt: skip
POSITIVE_ONLY = ("ReduceLogSum",)
INT_REDUCE = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceSumSquare")
AXES_VARIANTS: list[tuple[str, list[int] | None, int, int]] = [
    # label, axes (None: absent), keepdims, noop_with_empty_axes
    ("axes1_keep", [1], 1, 0),
    ("axes02_drop", [0, 2], 0, 0),
    ("neg_keep", [-1], 1, 0),
    ("all_default", None, 1, 0),
    ("all_drop", None, 0, 0),
    ("noop", [], 1, 1),
]


def _reduce_case(op: str, dtype: str, label: str, axes, keepdims: int, noop: int, shape=(2, 3, 4), opset=21):
    key = f"{op}-{dtype}-{label}-{opset}"
    kind = "pos" if op in POSITIVE_ONLY else "any"
    if op == "ReduceProd" and dtype in ("float32", "float16"):
        kind = "pos"  # keeps the product of up to 24 values in a sane range
    x = _values(key, shape, dtype, kind)
    attrs: dict[str, Any] = {"keepdims": keepdims}
    inputs: list[tuple[str, np.ndarray | None, bool]] = [("x", x, False)]
    input_axes = opset >= (13 if op == "ReduceSum" else 18)
    if input_axes:
        if noop:
            attrs["noop_with_empty_axes"] = 1
        if axes is not None:
            inputs.append(("axes", np.array(axes, dtype=np.int64), True))
    elif axes:
        attrs["axes"] = axes
    if dtype == "float32":
        tol = F32 if op != "ReduceProd" else (1e-5, 1e-5)
    elif dtype == "float16":
        tol = F16_SUM
    else:
        tol = EXACT
    return _single(f"{op}-{dtype}-{label}-op{opset}", op, inputs, attrs=attrs, opset=opset, tol=tol)


def _reduce_cases() -> list[Case]:
    cases = []
    for op in REDUCE_OPS:
        for label, axes, keepdims, noop in AXES_VARIANTS:
            cases.append(_reduce_case(op, "float32", label, axes, keepdims, noop))
        cases.append(_reduce_case(op, "float16", "axes1_keep", [1], 1, 0))
        cases.append(_reduce_case(op, "float16", "all_drop", None, 0, 0))
        # old opset: axes as an attribute
        cases.append(_reduce_case(op, "float32", "attr_axes", [0, -1], 1, 0, opset=11))
        cases.append(_reduce_case(op, "float32", "attr_all", None, 0, 0, opset=11))
        # reduction over an empty set: a zero-sized reduced axis
        cases.append(_reduce_case(op, "float32", "empty_set", [1], 1, 0, shape=(2, 0, 3)))
        if op in INT_REDUCE:
            cases.append(_reduce_case(op, "int32", "axes02_drop", [0, 2], 0, 0))
            cases.append(_reduce_case(op, "int64", "all_default", None, 1, 0))
    for op in ("ReduceMax", "ReduceMin"):
        cases.append(_reduce_case(op, "bool", "axes1_keep", [1], 1, 0))
        # (bool over an empty set: onnxruntime raises; the node suite checks the spec's answer)
    # long fp16 reductions: onnxruntime accumulates in fp32; an fp16 accumulator would be far off
    for op in ("ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL2"):
        x = _values(f"{op}-long", (2, 4096), "float16", "pos")
        axes = np.array([1], np.int64)
        cases.append(_single(f"{op}-float16-long", op, [("x", x, False), ("axes", axes, True)], tol=F16))
    # logsumexp of large inputs must not overflow (max subtracted first)
    for dtype in ("float32", "float16"):
        x = _values(f"lse-large-{dtype}", (3, 5), dtype, "large")
        axes = np.array([1], np.int64)
        tol = F32 if dtype == "float32" else F16
        cases.append(
            _single(
                f"ReduceLogSumExp-{dtype}-large", "ReduceLogSumExp", [("x", x, False), ("axes", axes, True)], tol=tol
            )
        )
    # a ReduceSum whose axes are a graph input (host copy on CUDA)
    x = _values("sum-fed-axes", (3, 5), "float32")
    cases.append(
        _single("ReduceSum-fed-axes", "ReduceSum", [("x", x, False), ("axes", np.array([0], np.int64), False)])
    )
    # rank-0 input
    scalar = np.array(1.5, dtype=np.float32)
    cases.append(_single("ReduceMax-rank0", "ReduceMax", [("x", scalar, False)], attrs={"keepdims": 0}))
    return cases


def _arg_cases() -> list[Case]:
    cases = []
    for op in ("ArgMax", "ArgMin"):
        for dtype in ("float32", "float16", "int32"):
            for axis, keepdims, last in ((1, 1, 0), (-1, 0, 0), (0, 1, 1), (2, 0, 1)):
                key = f"{op}-{dtype}-{axis}-{keepdims}-{last}"
                x = _values(key, (3, 4, 5), dtype, "ties")
                attrs = {"axis": axis, "keepdims": keepdims, "select_last_index": last}
                cases.append(_single(key, op, [("x", x, False)], [TP.INT64], attrs, tol=EXACT))
    return cases


def _cumulative_cases() -> list[Case]:
    cases = []
    for op, opset in (("CumSum", 21), ("CumProd", 26)):
        for dtype in ("float32", "float16", "int32", "int64"):
            for axis in (0, -1):
                for exclusive in (0, 1):
                    for reverse in (0, 1):
                        key = f"{op}-{dtype}-ax{axis}-ex{exclusive}-rev{reverse}"
                        x = _values(key, (3, 5), dtype, "pos" if op == "CumProd" else "any")
                        if op == "CumProd" and dtype.startswith("int"):
                            x = np.clip(x, 1, 3)
                        tol = {"float32": F32, "float16": F16_SUM}.get(dtype, EXACT)
                        inputs = [("x", x, False), ("axis", np.array(axis, np.int64), True)]
                        attrs = {"exclusive": exclusive, "reverse": reverse}
                        cases.append(_single(key, op, inputs, attrs=attrs, opset=opset, tol=tol))
    return cases


# -- softmax family ----------------------------------------------------------------------------


def _softmax_cases() -> list[Case]:
    cases = []
    for op in ("Softmax", "LogSoftmax", "Hardmax"):
        for opset, axes in ((11, (None, 0, 2, -1)), (13, (None, 0, 1, -2))):
            for axis in axes:
                for dtype in ("float32", "float16"):
                    key = f"{op}-op{opset}-ax{axis}-{dtype}"
                    x = _values(key, (2, 3, 4), dtype, "ties" if op == "Hardmax" else "any")
                    attrs = {} if axis is None else {"axis": axis}
                    tol = EXACT if op == "Hardmax" else (F32 if dtype == "float32" else F16)
                    cases.append(_single(key, op, [("x", x, False)], attrs=attrs, opset=opset, tol=tol))
        large = _values(f"{op}-large", (3, 6), "float32", "large")
        cases.append(_single(f"{op}-large", op, [("x", large, False)], tol=F32 if op != "Hardmax" else EXACT))
    return cases


# -- linear algebra --------------------------------------------------------------------------


MATMUL_SHAPES = [
    ("2d", (3, 16), (16, 5)),
    ("batched_bcast", (2, 1, 3, 8), (4, 8, 5)),
    ("1d_3d", (8,), (2, 8, 3)),
    ("3d_1d", (2, 3, 8), (8,)),
    ("1d_1d", (8,), (8,)),
    ("empty_k", (3, 0), (0, 4)),
]


def _matmul_cases() -> list[Case]:
    cases = []
    for label, sa, sb in MATMUL_SHAPES:
        for dtype in ("float32", "float16", "int32", "int64"):
            key = f"MatMul-{label}-{dtype}"
            a = _values(key + "a", sa, dtype)
            b = _values(key + "b", sb, dtype)
            tol = {"float32": F32, "float16": F16_SUM}.get(dtype, EXACT)
            cases.append(_single(key, "MatMul", [("a", a, False), ("b", b, False)], tol=tol))
    return cases


def _gemm_cases() -> list[Case]:
    cases = []
    variants = [
        # label, transA, transB, alpha, beta, C shape (None: absent)
        ("plain_noc", 0, 0, 1.0, 1.0, None),
        ("matrix_c", 0, 0, 1.0, 1.0, (3, 5)),
        ("vector_c", 1, 0, 0.5, 2.0, (5,)),
        ("scalar_c", 0, 1, 1.0, -1.0, ()),
        ("row_c", 1, 1, 2.5, 0.5, (1, 5)),
        ("col_c", 0, 0, 1.0, 1.0, (3, 1)),
        ("beta0", 0, 0, 1.0, 0.0, (3, 5)),
        ("alpha_noc", 1, 1, 0.25, 1.0, None),
    ]
    for label, ta, tb, alpha, beta, c_shape in variants:
        for dtype in ("float32", "float16"):
            key = f"Gemm-{label}-{dtype}"
            a = _values(key + "a", (16, 3) if ta else (3, 16), dtype)
            b = _values(key + "b", (5, 16) if tb else (16, 5), dtype)
            c = _values(key + "c", c_shape, dtype) if c_shape is not None else None
            inputs = [("a", a, False), ("b", b, False), ("c", c, False)]
            attrs = {"transA": ta, "transB": tb, "alpha": alpha, "beta": beta}
            tol = F32 if dtype == "float32" else F16_SUM
            cases.append(_single(key, "Gemm", inputs, attrs=attrs, tol=tol))
    # opset 9: C required, unidirectional broadcast
    a, b, c = _values("g9a", (4, 6), "float32"), _values("g9b", (6, 2), "float32"), _values("g9c", (2,), "float32")
    cases.append(_single("Gemm-op9", "Gemm", [("a", a, False), ("b", b, False), ("c", c, False)], opset=9))
    return cases


EINSUM_CASES = [
    ("matmul", "ij,jk->ik", ((3, 4), (4, 5))),
    ("batch_matmul", "bij, bjk -> bik", ((2, 3, 4), (2, 4, 5))),
    ("transpose", "ij->ji", ((3, 4),)),
    ("sum_all", "ij->", ((3, 4),)),
    ("implicit", "ij,jk", ((3, 4), (4, 5))),
    ("implicit_outer", "i,j", ((3,), (4,))),
    ("inner", "i,i", ((6,), (6,))),
    ("diagonal", "...ii->...i", ((2, 3, 3),)),
    ("ellipsis_bcast", "...ij,...jk->...ik", ((2, 1, 3, 4), (1, 5, 4, 2))),
    ("three_operands", "ij,jk,kl->il", ((2, 3), (3, 4), (4, 2))),
    ("upper_lower", "aB,Bc->ac", ((2, 3), (3, 4))),
]


def _einsum_cases() -> list[Case]:
    cases = []
    for label, equation, shapes in EINSUM_CASES:
        for dtype in ("float32", "float16", "int32"):
            key = f"Einsum-{label}-{dtype}"
            inputs = [(f"x{i}", _values(f"{key}{i}", s, dtype), False) for i, s in enumerate(shapes)]
            tol = {"float32": F32, "float16": F16_SUM}.get(dtype, EXACT)
            cases.append(_single(key, "Einsum", inputs, attrs={"equation": equation}, tol=tol))
    return cases


def _matmul_integer_cases() -> list[Case]:
    cases = []
    variants = [
        # label, a dtype, b dtype, a_zp kind, b_zp kind  (kind: None | "scalar" | "vector")
        ("u8u8_scalar_zp", "uint8", "uint8", "scalar", "scalar"),
        ("u8u8_no_zp", "uint8", "uint8", None, None),
        ("s8s8_scalar_zp", "int8", "int8", "scalar", "scalar"),
        ("u8s8_vec_b_zp", "uint8", "int8", "scalar", "vector"),
        ("u8u8_only_b_zp", "uint8", "uint8", None, "vector"),  # (onnxruntime has no per-row A zero point)
    ]
    for label, ta, tb, za, zb in variants:
        rng = _rng(label)
        # u8 x s8: onnxruntime's x86 kernels without VNNI (AVX2) add the u8*s8 products in int16 pairs
        # that saturate for 8-bit A (their results then differ from exact integer math, which onnxgen
        # computes), so A keeps to 7 bits there, the range onnxruntime is exact in on every CPU
        high = 128 if (ta, tb) == ("uint8", "int8") else np.iinfo(ta).max + 1
        a = rng.integers(np.iinfo(ta).min, high, size=(2, 4, 32)).astype(ta)
        b = rng.integers(np.iinfo(tb).min, np.iinfo(tb).max + 1, size=(32, 6)).astype(tb)
        a_zp = None if za is None else rng.integers(0, 100, size=() if za == "scalar" else (4,)).astype(ta)
        b_zp = None if zb is None else rng.integers(0, 100, size=() if zb == "scalar" else (6,)).astype(tb)
        inputs = [("a", a, False), ("b", b, False), ("a_zp", a_zp, True), ("b_zp", b_zp, True)]
        cases.append(_single(f"MatMulInteger-{label}", "MatMulInteger", inputs, [TP.INT32], tol=EXACT))
    return cases


def _det_cases() -> list[Case]:
    cases = []
    for label, shape in (("2d", (4, 4)), ("batched", (2, 3, 3, 3))):
        for dtype in ("float32", "float16"):
            x = _values(f"det-{label}-{dtype}", shape, dtype)
            tol = (1e-4, 1e-5) if dtype == "float32" else (1e-2, 1e-2)  # fp16 det: fp32 math, one rounding
            cases.append(_single(f"Det-{label}-{dtype}", "Det", [("x", x, False)], tol=tol))
    return cases


# -- quantization ----------------------------------------------------------------------------

# exact halves after division by a power-of-two scale: round-half-to-even is visible
TIES = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 1000.0, -1000.0, 0.0], dtype=np.float32)


def _quantize_cases() -> list[Case]:
    cases = []
    per_tensor = [
        ("uint8", TP.UINT8, 128),
        ("int8", TP.INT8, -3),
        ("uint16", TP.UINT16, 30000),
        ("int16", TP.INT16, -7),
    ]
    for name, elem, zp_value in per_tensor:
        zp = np.array(zp_value, dtype=name)
        for xdtype in ("float32", "float16"):
            key = f"QuantizeLinear-{name}-{xdtype}"
            x = np.concatenate([TIES * 0.25, _values(key, (14,), "float32") * 40]).astype(xdtype)
            scale = np.array(0.25, dtype=xdtype)
            inputs = [("x", x, False), ("s", scale, True), ("z", zp, True)]
            cases.append(_single(key, "QuantizeLinear", inputs, [elem], tol=EXACT))
    # fp16 x and scale: the division runs in fp32 before opset 23 and in fp16 from 23 (ties differ)
    x = _values("q-f16-div", (4000,), "float16") * 6
    for opset in (21, 23):
        inputs = [("x", x, False), ("s", np.array(0.1, np.float16), True), ("z", np.array(0, np.int8), True)]
        cases.append(_single(f"QuantizeLinear-f16_division-op{opset}", "QuantizeLinear", inputs, [TP.INT8],
                             opset=opset, tol=EXACT))  # fmt: skip
    # no zero point: uint8 output; output_dtype attribute (opset 21)
    x = _values("q-nozp", (3, 8), "float32") * 100
    cases.append(
        _single("QuantizeLinear-no_zp", "QuantizeLinear", [("x", x, False), ("s", np.float32(0.7), True)],
                [TP.UINT8], tol=EXACT)
    )  # fmt: skip
    cases.append(
        _single("QuantizeLinear-output_dtype_int8", "QuantizeLinear", [("x", x, False), ("s", np.float32(0.7), True)],
                [TP.INT8], attrs={"output_dtype": TP.INT8}, tol=EXACT)
    )  # fmt: skip
    # per axis
    x = _values("q-axis", (2, 3, 4), "float32") * 50
    scale = np.array([0.5, 0.25, 1.0], dtype=np.float32)
    zp = np.array([0, 10, 250], dtype=np.uint8)
    for opset in (13, 21):
        cases.append(
            _single(f"QuantizeLinear-per_axis-op{opset}", "QuantizeLinear",
                    [("x", x, False), ("s", scale, True), ("z", zp, True)], [TP.UINT8],
                    attrs={"axis": 1}, opset=opset, tol=EXACT)
        )  # fmt: skip
    # blocked, along the last axis with a ragged final block
    x = _values("q-block", (3, 10), "float32") * 20
    scale = _values("q-block-s", (3, 3), "float32", "pos")
    zp = _rng("q-block-z").integers(-5, 5, size=(3, 3)).astype(np.int8)
    cases.append(
        _single("QuantizeLinear-blocked", "QuantizeLinear",
                [("x", x, False), ("s", scale, True), ("z", zp, True)], [TP.INT8],
                attrs={"axis": -1, "block_size": 4}, tol=EXACT)
    )  # fmt: skip
    return cases


def _dequantize_cases() -> list[Case]:
    cases = []
    for name in ("uint8", "int8", "uint16", "int16", "int32"):
        x = _values(f"dq-{name}", (4, 5), name) * (7 if name.endswith("16") or name == "int32" else 3)
        x = x.astype(name)
        zp = None if name == "int32" else np.array(2, dtype=name)
        for sdtype in ("float32", "float16"):
            scale = np.array(0.37, dtype=sdtype)
            elem = TP.FLOAT if sdtype == "float32" else TP.FLOAT16
            inputs = [("x", x, False), ("s", scale, True), ("z", zp, True)]
            cases.append(_single(f"DequantizeLinear-{name}-{sdtype}", "DequantizeLinear", inputs, [elem], tol=EXACT))
    x = _rng("dq-axis").integers(0, 256, size=(2, 3, 4)).astype(np.uint8)
    scale = np.array([0.5, 0.25, 1.5, 2.0], dtype=np.float32)
    zp = np.array([0, 10, 128, 255], dtype=np.uint8)
    cases.append(
        _single("DequantizeLinear-per_axis", "DequantizeLinear",
                [("x", x, False), ("s", scale, True), ("z", zp, True)], [TP.FLOAT],
                attrs={"axis": -1}, opset=13, tol=EXACT)
    )  # fmt: skip
    x = _rng("dq-block").integers(-128, 128, size=(7, 4)).astype(np.int8)
    scale = _values("dq-block-s", (3, 4), "float32", "pos")
    zp = _rng("dq-block-z").integers(-5, 5, size=(3, 4)).astype(np.int8)
    cases.append(
        _single("DequantizeLinear-blocked", "DequantizeLinear",
                [("x", x, False), ("s", scale, True), ("z", zp, True)], [TP.FLOAT],
                attrs={"axis": 0, "block_size": 3}, tol=EXACT)
    )  # fmt: skip
    return cases


def _roundtrip_case(id: str, x: np.ndarray, scale: np.ndarray, zp_elem: int, zp_values: list, attrs: dict) -> Case:
    """QuantizeLinear to a type onnxruntime cannot hand back, then DequantizeLinear to float."""
    shape = [] if scale.ndim == 0 else list(scale.shape)
    zp = helper.make_tensor("z", zp_elem, shape, zp_values)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], **attrs),
        helper.make_node("DequantizeLinear", ["q", "one", "z"], ["y0"], **{k: v for k, v in attrs.items()
                                                                          if k in ("axis", "block_size")}),
    ]  # fmt: skip
    one = numpy_helper.from_array(np.ones_like(scale), "one")
    return Case(id, nodes, [("x", x)], [("y0", TP.FLOAT)], [numpy_helper.from_array(scale, "s"), zp, one], 21, EXACT)


def _narrow_quant_cases() -> list[Case]:
    cases = []
    x = np.concatenate([TIES, _values("nq", (10,), "float32") * 30, [1e6, -1e6, np.inf, -np.inf]]).astype(np.float32)
    scale = np.array(0.5, dtype=np.float32)
    for elem in (TP.FLOAT8E4M3FN, TP.FLOAT8E4M3FNUZ, TP.FLOAT8E5M2, TP.FLOAT8E5M2FNUZ):
        for saturate in (1, 0):
            name = TP.DataType.Name(elem)
            cases.append(_roundtrip_case(f"Quant-{name}-sat{saturate}", x, scale, elem, [0], {"saturate": saturate}))
    finite = x[np.isfinite(x)]
    for elem, zp_value in ((TP.INT4, -2), (TP.UINT4, 3)):
        name = TP.DataType.Name(elem)
        cases.append(_roundtrip_case(f"Quant-{name}", finite, scale, elem, [zp_value], {}))
    # 4-bit blocked, as in weight-only quantization
    w = _values("nq-block", (4, 8), "float32") * 4
    scales = _values("nq-block-s", (4, 2), "float32", "pos")
    cases.append(
        _roundtrip_case("Quant-INT4-blocked", w, scales, TP.INT4, [1, -1, 0, 2, -3, 0, 1, 1],
                        {"axis": 1, "block_size": 4})
    )  # fmt: skip
    return cases


def _dynamic_cases() -> list[Case]:
    cases = []
    inputs = {
        "mixed": _values("dyn-mixed", (3, 7), "float32") * 5,
        "positive": _values("dyn-pos", (10,), "float32", "pos"),
        "negative": -_values("dyn-neg", (2, 5), "float32", "pos"),
        "zeros": np.zeros((4,), np.float32),
    }
    for label, x in inputs.items():
        cases.append(
            _single(f"DynamicQuantizeLinear-{label}", "DynamicQuantizeLinear", [("x", x, False)],
                    [TP.UINT8, TP.FLOAT, TP.UINT8], tol=(1e-7, 0.0))
        )  # fmt: skip
    return cases


def _qlinear_matmul_cases() -> list[Case]:
    cases = []
    for dtype in ("uint8", "int8"):
        for label, sa, sb in (("2d", (3, 16), (16, 5)), ("3d", (2, 3, 16), (16, 5))):
            for opset, sdtype in ((10, "float32"), (21, "float16")):
                key = f"QLinearMatMul-{dtype}-{label}-op{opset}"
                rng = _rng(key)
                info = np.iinfo(dtype)
                a = rng.integers(info.min, info.max + 1, size=sa).astype(dtype)
                b = rng.integers(info.min, info.max + 1, size=sb).astype(dtype)
                b_zp = -2 if dtype == "int8" else 130
                inputs = [
                    ("a", a, False), ("a_s", np.array(0.02, sdtype), True), ("a_z", np.array(3, dtype), True),
                    ("b", b, False), ("b_s", np.array(0.015, sdtype), True), ("b_z", np.array(b_zp, dtype), True),
                    ("y_s", np.array(0.9, sdtype), True), ("y_z", np.array(5, dtype), True),
                ]  # fmt: skip
                cases.append(_single(key, "QLinearMatMul", inputs, opset=opset, tol=EXACT))
    return cases


ALL_CASES: list[Case] = [
    *_reduce_cases(),
    *_arg_cases(),
    *_cumulative_cases(),
    *_softmax_cases(),
    *_matmul_cases(),
    *_gemm_cases(),
    *_einsum_cases(),
    *_matmul_integer_cases(),
    *_det_cases(),
    *_quantize_cases(),
    *_dequantize_cases(),
    *_narrow_quant_cases(),
    *_dynamic_cases(),
    *_qlinear_matmul_cases(),
]


def _model(case: Case) -> onnx.ModelProto:
    ins = [helper.make_tensor_value_info(n, _elem(v), v.shape) for n, v in case.inputs]
    outs = [helper.make_tensor_value_info(n, t, None) for n, t in case.outputs]
    return make_model(case.nodes, ins, outs, case.inits, opset=case.opset)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.id)
def test_parity(case: Case, device: str) -> None:
    rtol, atol = case.tol
    assert_parity(_model(case), dict(case.inputs), device, rtol=rtol, atol=atol)


# -- the CUDA integer-matmul path, checked on any device against numpy -------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "sa,sb",
    [((3, 7), (7, 4)), ((2, 1, 3, 9), (4, 9, 2)), ((9,), (2, 9, 3)), ((2, 3, 9), (9,)), ((3, 0), (0, 2))],
)
def test_chunked_int_matmul_matches_numpy(sa, sb, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from onnxgen.runtime.ops import linalg

    monkeypatch.setattr(linalg, "_CHUNK_ELEMENTS", 16)  # force several chunks over K
    rng = np.random.default_rng(0)
    a = rng.integers(-(2**20), 2**20, size=sa, dtype=np.int64)
    b = rng.integers(-(2**20), 2**20, size=sb, dtype=np.int64)
    ta, tb = torch.from_numpy(a).to(device), torch.from_numpy(b).to(device)
    squeeze_front, squeeze_back = ta.dim() == 1, tb.dim() == 1
    ta = ta.unsqueeze(0) if squeeze_front else ta
    tb = tb.unsqueeze(-1) if squeeze_back else tb
    y = linalg._chunked_int_matmul(ta, tb)
    y = y.squeeze(-1) if squeeze_back else y
    y = y.squeeze(-1 if squeeze_back else -2) if squeeze_front else y
    np.testing.assert_array_equal(y.cpu().numpy(), np.matmul(a, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("saturate", [1, 0])
def test_quantize_e4m3fn_bytes(saturate: int, device: str) -> None:
    """onnxruntime hands float8e4m3fn back as raw bytes: compare the bit patterns."""
    x = np.concatenate([TIES, _values("e4m3fn", (10,), "float32") * 300, [1e6, -1e6, np.inf, -np.inf]])
    x = x.astype(np.float32)
    zp = helper.make_tensor("z", TP.FLOAT8E4M3FN, [], [0])
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], saturate=saturate)
    model = make_model(
        [node], [helper.make_tensor_value_info("x", TP.FLOAT, x.shape)],
        [helper.make_tensor_value_info("q", TP.FLOAT8E4M3FN, None)],
        [numpy_helper.from_array(np.array(0.5, np.float32), "s"), zp],
    )  # fmt: skip
    (expected,) = ort_run(model, {"x": x})
    (actual,) = onnxgen_run(model, {"x": x}, device)
    np.testing.assert_array_equal(actual.view(np.uint8), expected.view(np.uint8))


def test_matmul_integer_u8s8_full_range_is_exact() -> None:
    """8-bit A against int64 numpy (where onnxruntime's AVX2 kernel saturates, see the cases above)."""
    rng = _rng("MatMulInteger-u8s8-full")
    a = rng.integers(0, 256, size=(2, 4, 32)).astype(np.uint8)
    b = rng.integers(-128, 128, size=(32, 6)).astype(np.int8)
    b_zp = rng.integers(0, 100, size=(6,)).astype(np.int8)
    node = helper.make_node("MatMulInteger", ["a", "b", "a_zp", "b_zp"], ["y"])
    inputs = [("a", TP.UINT8), ("b", TP.INT8), ("a_zp", TP.UINT8), ("b_zp", TP.INT8)]
    model = make_model(
        [node], [helper.make_tensor_value_info(n, t, None) for n, t in inputs],
        [helper.make_tensor_value_info("y", TP.INT32, None)],
    )  # fmt: skip
    (y,) = onnxgen_run(model, {"a": a, "b": b, "a_zp": np.array(7, np.uint8), "b_zp": b_zp})
    exact = (a.astype(np.int64) - 7) @ (b.astype(np.int64) - b_zp.astype(np.int64))
    np.testing.assert_array_equal(y, exact.astype(np.int32))
