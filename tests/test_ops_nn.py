"""Parity of the vision-style and normalization kernels (conv, pool, normalization, resize, vision)
with onnxruntime (CPU) on random inputs.

Each row is one single-node model: graph inputs are random, shape-like inputs (Resize scales/sizes,
Col2Im shapes, MaxUnpool output_shape) are initializers, as in exported models. Tolerances are
stated per row: fp32 rows 1e-5 unless accumulation order matters (convolutions, 1e-4), fp16 rows
about 2 ulp of the output (onnxruntime rounds once at the end; so do we). fp16 rows exist only
where onnxruntime's CPU build has the fp16 kernel.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from tests.conftest import DEVICES, HAS_CUDA, assert_parity, make_model, onnxgen_run

ELEM = {
    np.dtype(np.float32): TP.FLOAT,
    np.dtype(np.float16): TP.FLOAT16,
    np.dtype(np.float64): TP.DOUBLE,
    np.dtype(np.int8): TP.INT8,
    np.dtype(np.uint8): TP.UINT8,
    np.dtype(np.int32): TP.INT32,
    np.dtype(np.int64): TP.INT64,
    np.dtype(ml_dtypes.bfloat16): TP.BFLOAT16,
}
FP32 = (1e-5, 1e-5)
CONV32 = (1e-4, 1e-4)
FP16 = (2e-3, 2e-3)
BF16 = (1e-2, 1e-2)  # one bfloat16 rounding of the output
# torch lets cuDNN run float32 convolutions in TF32 by default (as onnxruntime's CUDA provider does)
TF32 = (1e-2, 5e-3)
CONV_OPS = ("Conv", "ConvTranspose", "DeformConv")


@dataclass
class Const:
    """An input stored as an initializer."""

    value: np.ndarray


Input = np.ndarray | Const | None


@dataclass
class Row:
    id: str
    op: str
    inputs: Callable[[np.random.Generator], list[Input]]
    attrs: dict[str, Any] = field(default_factory=dict)
    opset: int = 21
    outputs: int = 1
    tol: tuple[float, float] = FP32
    # None: onnxruntime; "reference": onnx's ReferenceEvaluator; or a numpy function of the inputs
    oracle: str | Callable[..., list[np.ndarray]] | None = None


def _model(row: Row, rng: np.random.Generator) -> tuple[Any, dict[str, np.ndarray]]:
    names, graph_inputs, inits, feeds = [], [], [], {}
    for index, value in enumerate(row.inputs(rng)):
        if value is None:
            names.append("")
            continue
        name = f"in{index}"
        names.append(name)
        if isinstance(value, Const):
            inits.append(numpy_helper.from_array(value.value, name))
        else:
            graph_inputs.append(helper.make_tensor_value_info(name, ELEM[value.dtype], value.shape))
            feeds[name] = value
    outs = [f"out{i}" for i in range(row.outputs)]
    node = helper.make_node(row.op, names, outs, **row.attrs)
    model = make_model(
        [node],
        graph_inputs,
        [helper.make_empty_tensor_value_info(o) for o in outs],
        inits,
        opset=row.opset,
        ms_opset=None,
    )
    return model, feeds


def rand(*shape: int, dtype: Any = np.float32, low: float = -2.0, high: float = 2.0) -> Callable:
    return lambda rng: rng.uniform(low, high, shape).astype(dtype)


def ins(*makers: Any) -> Callable[[np.random.Generator], list[Input]]:
    """Input list from makers: callables of the generator, arrays/Consts as they are, None."""

    def build(rng: np.random.Generator) -> list[Input]:
        return [m(rng) if callable(m) else m for m in makers]

    return build


def const(value: Any, dtype: Any = np.int64) -> Const:
    return Const(np.asarray(value, dtype=dtype))


# --- convolutions -------------------------------------------------------------------------------


def _conv_rows() -> list[Row]:
    rows = [
        Row("conv2d_bias", "Conv", ins(rand(2, 3, 7, 6), rand(4, 3, 3, 3), rand(4)), tol=CONV32),
        Row(
            "conv2d_asym_pads_stride_dil",
            "Conv",
            ins(rand(1, 4, 9, 8), rand(6, 2, 3, 2)),
            {"pads": [1, 0, 2, 1], "strides": [2, 1], "dilations": [2, 2], "group": 2},
            tol=CONV32,
        ),
        Row(
            "conv2d_depthwise",
            "Conv",
            ins(rand(1, 4, 6, 6), rand(4, 1, 3, 3), rand(4)),
            {"group": 4, "pads": [1, 1, 1, 1]},
            tol=CONV32,
        ),
        Row(
            "conv1d_valid",
            "Conv",
            ins(rand(2, 3, 11), rand(5, 3, 4)),
            {"auto_pad": "VALID", "strides": [2]},
            tol=CONV32,
        ),
        Row(
            "conv3d",
            "Conv",
            ins(rand(1, 2, 5, 4, 6), rand(3, 2, 2, 3, 2), rand(3)),
            {"pads": [1, 0, 1, 0, 1, 1]},
            tol=CONV32,
        ),
        Row(
            "conv2d_kernel_shape_attr",
            "Conv",
            ins(rand(1, 2, 5, 5), rand(2, 2, 2, 2)),
            {"kernel_shape": [2, 2]},
            tol=CONV32,
        ),
        Row(
            "conv2d_fp16",
            "Conv",
            ins(rand(1, 3, 6, 6, dtype=np.float16), rand(4, 3, 3, 3, dtype=np.float16)),
            {"pads": [1, 1, 1, 1]},
            tol=(1e-2, 1e-2),
        ),
    ]
    for auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        rows.append(
            Row(
                f"conv2d_{auto_pad.lower()}",
                "Conv",
                ins(rand(1, 2, 7, 6), rand(3, 2, 4, 3)),
                {"auto_pad": auto_pad, "strides": [2, 2]},
                tol=CONV32,
            )
        )
    convt = [
        ("convT2d", ins(rand(1, 2, 4, 5), rand(2, 3, 3, 3), rand(3)), {"strides": [2, 2]}),
        (
            "convT2d_pads_outpad",
            ins(rand(1, 2, 4, 4), rand(2, 3, 3, 2)),
            {"strides": [3, 2], "pads": [1, 0, 2, 1], "output_padding": [1, 1]},
        ),
        ("convT2d_group_dil", ins(rand(1, 4, 3, 4), rand(4, 1, 2, 3)), {"group": 2, "dilations": [2, 1]}),
        ("convT2d_output_shape", ins(rand(1, 1, 3, 3), rand(1, 2, 3, 3)), {"strides": [3, 2], "output_shape": [10, 8]}),
        ("convT2d_same_upper", ins(rand(1, 1, 3, 4), rand(1, 2, 3, 3)), {"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
        ("convT2d_same_lower", ins(rand(1, 1, 3, 4), rand(1, 2, 3, 3)), {"strides": [2, 2], "auto_pad": "SAME_LOWER"}),
        (
            "convT2d_output_shape_crop",
            ins(rand(1, 1, 3, 3), rand(1, 2, 3, 3)),
            {"strides": [3, 2], "output_shape": [8, 6]},
        ),
        ("convT1d", ins(rand(2, 2, 5), rand(2, 3, 4)), {"strides": [2]}),
        ("convT3d", ins(rand(1, 2, 3, 3, 2), rand(2, 2, 2, 3, 2)), {"strides": [1, 2, 2], "pads": [0, 1, 0, 0, 1, 1]}),
    ]
    rows += [Row(name, "ConvTranspose", inputs, attrs, tol=CONV32) for name, inputs, attrs in convt]
    rows.append(
        Row(
            "convT2d_fp16",
            "ConvTranspose",
            ins(rand(1, 2, 4, 4, dtype=np.float16), rand(2, 3, 3, 3, dtype=np.float16)),
            {"strides": [2, 2], "pads": [1, 1, 0, 0]},
            tol=(1e-2, 1e-2),
        )
    )

    rows += [
        Row(
            "deformconv_basic",
            "DeformConv",
            ins(rand(1, 2, 5, 6), rand(3, 2, 3, 3), rand(1, 18, 3, 4)),
            opset=22,
            tol=CONV32,
        ),
        Row(
            "deformconv_full",
            "DeformConv",
            ins(
                rand(2, 4, 6, 7),
                rand(4, 2, 2, 3),
                rand(2, 2 * 2 * 6, 3, 2, low=-3, high=3),
                rand(4),
                rand(2, 2 * 6, 3, 2, low=0, high=1),
            ),
            {"group": 2, "offset_group": 2, "pads": [1, 0, 0, 1], "strides": [2, 2], "dilations": [1, 2]},
            opset=22,
            tol=CONV32,
        ),
    ]

    def u8(*shape: int) -> Callable:
        return lambda rng: rng.integers(0, 256, shape).astype(np.uint8)

    rows += [
        Row(
            "convinteger_zp",
            "ConvInteger",
            ins(u8(1, 2, 5, 5), u8(3, 2, 3, 3), const(7, np.uint8), const(130, np.uint8)),
            {"pads": [1, 1, 0, 1]},
            opset=10,
        ),
        Row("convinteger_nozp", "ConvInteger", ins(u8(1, 2, 4, 4), u8(2, 2, 2, 2)), opset=10),
        Row(
            "qlinearconv_u8",
            "QLinearConv",
            ins(
                u8(1, 2, 6, 6),
                const(0.05, np.float32),
                const(120, np.uint8),
                u8(3, 2, 3, 3),
                const([0.02, 0.03, 0.01], np.float32),
                const(128, np.uint8),
                const(0.4, np.float32),
                const(100, np.uint8),
                const([100, -2000, 50], np.int32),
            ),
            {"pads": [1, 1, 1, 1], "strides": [2, 1]},
            opset=10,
            tol=(0, 1),
        ),
        Row(
            "col2im_2d",
            "Col2Im",
            ins(rand(2, 2 * 6, 25), const([5, 6]), const([2, 3])),
            {"strides": [1, 1], "pads": [0, 1, 1, 0], "dilations": [1, 1]},
            opset=18,
        ),
        Row("col2im_1d", "Col2Im", ins(rand(2, 3 * 3, 6), const([7]), const([3])), {"pads": [1, 0]}, opset=18),
        Row(
            "col2im_3d",
            "Col2Im",
            ins(rand(1, 2 * 4, 12), const([3, 4, 3]), const([2, 2, 1])),
            {"strides": [1, 2, 1], "pads": [0, 0, 0, 0, 1, 0]},
            opset=18,
        ),
        Row(
            "col2im_strided",
            "Col2Im",
            ins(rand(1, 3 * 4, 4), const([6, 6]), const([2, 2])),
            {"strides": [2, 2], "dilations": [2, 2]},
            opset=18,
        ),
    ]
    return rows


# --- pools ----------------------------------------------------------------------------------------


def _pool_rows() -> list[Row]:
    rows: list[Row] = []
    geometries = [
        ("k3", {"kernel_shape": [3, 3]}),
        ("k2_s2_ceil", {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
        ("k3_asym_pads", {"kernel_shape": [3, 2], "pads": [1, 0, 2, 1], "strides": [2, 1]}),
        ("k3_sym_pads_ceil", {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2], "ceil_mode": 1}),
        # ceil_mode windows that would start in the right pad are dropped (7 rows: torch path; 8 cols: generic)
        ("ceil_last_window_on_pad", {"kernel_shape": [2, 3], "pads": [1, 1, 1, 2], "strides": [3, 3], "ceil_mode": 1}),
        (
            "ceil_last_window_on_pad_sym",
            {"kernel_shape": [2, 2], "pads": [1, 1, 1, 1], "strides": [3, 3], "ceil_mode": 1},
        ),
        ("k2_dil2", {"kernel_shape": [2, 2], "dilations": [2, 2], "strides": [1, 2]}),
        (
            "k2_dil2_pads_ceil",
            {"kernel_shape": [2, 3], "dilations": [2, 1], "pads": [1, 1, 0, 1], "strides": [2, 2], "ceil_mode": 1},
        ),
        ("same_upper", {"kernel_shape": [3, 2], "auto_pad": "SAME_UPPER", "strides": [2, 2]}),
        ("same_lower", {"kernel_shape": [3, 2], "auto_pad": "SAME_LOWER", "strides": [2, 2]}),
        ("valid", {"kernel_shape": [2, 3], "auto_pad": "VALID", "strides": [2, 1]}),
    ]
    for name, attrs in geometries:
        rows.append(Row(f"maxpool_{name}", "MaxPool", ins(rand(2, 3, 7, 8)), attrs, opset=22))
        rows.append(Row(f"avgpool_{name}", "AveragePool", ins(rand(2, 3, 7, 8)), attrs, opset=22))
        if "pads" in attrs:
            rows.append(
                Row(
                    f"avgpool_{name}_include_pad",
                    "AveragePool",
                    ins(rand(2, 3, 7, 8)),
                    {**attrs, "count_include_pad": 1},
                    opset=22,
                )
            )
        if "auto_pad" not in attrs:
            rows.append(
                Row(f"lppool_{name}", "LpPool", ins(rand(1, 2, 7, 8)), {**attrs, "p": 3}, opset=22, tol=(1e-5, 1e-5))
            )
    rows += [
        Row(
            "maxpool_indices",
            "MaxPool",
            ins(rand(2, 2, 6, 7)),
            {"kernel_shape": [2, 3], "strides": [2, 2], "pads": [1, 1, 0, 1]},
            outputs=2,
            opset=22,
        ),
        Row(
            "maxpool_indices_torch_path",
            "MaxPool",
            ins(rand(2, 2, 6, 7)),
            {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
            outputs=2,
            opset=22,
        ),
        Row(
            "maxpool_indices_colmajor",
            "MaxPool",
            ins(rand(2, 2, 5, 7)),
            {"kernel_shape": [2, 2], "storage_order": 1},
            outputs=2,
            opset=22,
        ),
        Row(
            "maxpool_indices_colmajor_generic",
            "MaxPool",
            ins(rand(1, 2, 5, 7)),
            {"kernel_shape": [2, 2], "storage_order": 1, "pads": [0, 0, 1, 1]},
            outputs=2,
            opset=22,
        ),
        Row(
            "maxpool_1d", "MaxPool", ins(rand(2, 3, 9)), {"kernel_shape": [3], "strides": [2], "pads": [0, 1]}, opset=22
        ),
        Row(
            "maxpool_3d_indices", "MaxPool", ins(rand(1, 2, 4, 5, 4)), {"kernel_shape": [2, 2, 2]}, outputs=2, opset=22
        ),
        Row(
            "maxpool_uint8",
            "MaxPool",
            ins(lambda rng: rng.integers(0, 256, (1, 2, 5, 5)).astype(np.uint8)),
            {"kernel_shape": [2, 2], "pads": [1, 1, 0, 0]},
            opset=22,
        ),
        Row(
            "maxpool_int8",
            "MaxPool",
            ins(lambda rng: rng.integers(-128, 128, (1, 2, 5, 5)).astype(np.int8)),
            {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
            opset=22,
        ),
        Row(
            "maxpool_fp16",
            "MaxPool",
            ins(rand(1, 2, 6, 6, dtype=np.float16)),
            {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]},
            opset=22,
            tol=(0, 0),
        ),
        Row(
            "avgpool_1d",
            "AveragePool",
            ins(rand(2, 3, 9)),
            {"kernel_shape": [4], "pads": [1, 2], "count_include_pad": 1},
            opset=22,
        ),
        Row(
            "avgpool_3d",
            "AveragePool",
            ins(rand(1, 2, 5, 4, 6)),
            {"kernel_shape": [2, 2, 3], "strides": [2, 1, 2], "ceil_mode": 1},
            opset=22,
        ),
        Row(
            "avgpool_fp16",
            "AveragePool",
            ins(rand(1, 2, 6, 6, dtype=np.float16)),
            {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]},
            opset=22,
            tol=FP16,
        ),
        Row("global_avg", "GlobalAveragePool", ins(rand(2, 3, 5, 4)), opset=22),
        Row("global_max", "GlobalMaxPool", ins(rand(2, 3, 5, 4, 3)), opset=22),
        # onnxruntime has no GlobalLpPool: the spec's formula in numpy stands in
        Row(
            "global_lp",
            "GlobalLpPool",
            ins(rand(2, 3, 5, 4)),
            {"p": 3},
            opset=22,
            oracle=lambda x: [(np.abs(x.astype(np.float64)) ** 3).sum(axis=(2, 3), keepdims=True) ** (1 / 3)],
        ),
        Row(
            "lppool_fp16",
            "LpPool",
            ins(rand(1, 2, 6, 6, dtype=np.float16, low=-8, high=8)),
            {"kernel_shape": [3, 3], "p": 4},
            opset=22,
            tol=FP16,
        ),
        Row(
            "global_lp_fp16_vs_fp32",
            "GlobalLpPool",
            ins(rand(1, 2, 8, 8, dtype=np.float16, low=-30, high=30)),
            {"p": 3},
            opset=22,
            tol=FP16,
            oracle=lambda x: [(np.abs(x.astype(np.float64)) ** 3).sum(axis=(2, 3), keepdims=True) ** (1 / 3)],
        ),
        Row("global_max_fp16", "GlobalMaxPool", ins(rand(2, 3, 5, 4, dtype=np.float16)), opset=22, tol=(0, 0)),
        Row("global_avg_fp16", "GlobalAveragePool", ins(rand(2, 3, 5, 4, dtype=np.float16)), opset=22, tol=FP16),
        Row(
            "maxroipool",
            "MaxRoiPool",
            ins(rand(2, 3, 8, 9), const([[0, 1, 1, 6, 5], [1, 0, 2, 8, 7], [1, 3.6, 2.2, 4.4, 7.9]], np.float32)),
            {"pooled_shape": [2, 3], "spatial_scale": 0.8},
            opset=22,
            oracle=_max_roi_pool_reference,
        ),
    ]
    return rows


def _max_roi_pool_reference(x: np.ndarray, rois: np.ndarray) -> list[np.ndarray]:
    """MaxRoiPool from the spec (Caffe RoI pooling), one bin at a time."""
    pooled_h, pooled_w, scale = 2, 3, 0.8
    out = np.zeros((len(rois), x.shape[1], pooled_h, pooled_w), np.float32)
    for r, (b, *box) in enumerate(rois):
        x1, y1, x2, y2 = (int(np.sign(v) * np.floor(abs(v * scale) + 0.5)) for v in box)  # C round()
        h, w = max(y2 - y1 + 1, 1), max(x2 - x1 + 1, 1)
        for i in range(pooled_h):
            for j in range(pooled_w):
                hs = min(max(int(np.floor(i * h / pooled_h)) + y1, 0), x.shape[2])
                he = min(max(int(np.ceil((i + 1) * h / pooled_h)) + y1, 0), x.shape[2])
                ws = min(max(int(np.floor(j * w / pooled_w)) + x1, 0), x.shape[3])
                we = min(max(int(np.ceil((j + 1) * w / pooled_w)) + x1, 0), x.shape[3])
                if he > hs and we > ws:
                    out[r, :, i, j] = x[int(b), :, hs:he, ws:we].max(axis=(1, 2))
    return [out]


def _lrn_reference(x: np.ndarray) -> list[np.ndarray]:
    """LRN from the spec with size 4 and default alpha, beta, bias."""
    size, alpha, beta, bias = 4, 1e-4, 0.75, 1.0
    x64 = x.astype(np.float64)
    square_sum = np.zeros_like(x64)
    channels = x.shape[1]
    for c in range(channels):
        lo = max(0, c - (size - 1) // 2)
        hi = min(channels - 1, c + int(np.ceil((size - 1) / 2)))
        square_sum[:, c] = (x64[:, lo : hi + 1] ** 2).sum(axis=1)
    return [x64 / (bias + alpha / size * square_sum) ** beta]


def _mvn_reference(x: np.ndarray) -> list[np.ndarray]:
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=(0, 2, 3), keepdims=True)
    std = np.sqrt((x64**2).mean(axis=(0, 2, 3), keepdims=True) - mean**2)
    return [(x64 - mean) / (std + 1e-9)]


def _layer_norm_reference(x: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> list[np.ndarray]:
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=-1, keepdims=True)
    var = ((x64 - mean) ** 2).mean(axis=-1, keepdims=True)
    return [(x64 - mean) / np.sqrt(var + 1e-5) * scale.astype(np.float64) + bias.astype(np.float64)]


def _rms_norm_reference(x: np.ndarray, scale: np.ndarray) -> list[np.ndarray]:
    x64 = x.astype(np.float64)
    return [x64 / np.sqrt((x64**2).mean(axis=-1, keepdims=True) + 1e-5) * scale.astype(np.float64)]


# --- normalizations ---------------------------------------------------------------------------------


def _norm_rows() -> list[Row]:
    rows: list[Row] = []
    for dtype, tol in ((np.float32, FP32), (np.float16, FP16)):
        tag = np.dtype(dtype).name
        rows += [
            Row(
                f"layernorm_last_{tag}",
                "LayerNormalization",
                ins(rand(2, 5, 64, dtype=dtype, low=-3, high=5), rand(64, dtype=dtype), rand(64, dtype=dtype)),
                {"epsilon": 1e-5},
                opset=17,
                tol=tol,
            ),
            Row(
                f"layernorm_axis1_nobias_{tag}",
                "LayerNormalization",
                ins(rand(2, 3, 4, 5, dtype=dtype), rand(3, 4, 5, dtype=dtype)),
                {"axis": 1},
                opset=17,
                tol=tol,
            ),
            Row(
                f"layernorm_stats_{tag}",
                "LayerNormalization",
                ins(rand(3, 4, 16, dtype=dtype), rand(16, dtype=dtype), rand(16, dtype=dtype)),
                {"axis": -1, "epsilon": 1e-3},
                opset=17,
                outputs=3,
                tol=tol,
            ),
            Row(
                f"layernorm_broadcast_scale_{tag}",
                "LayerNormalization",
                ins(rand(2, 3, 8, dtype=dtype), rand(1, 8, dtype=dtype), rand(8, dtype=dtype)),
                {"axis": 1},
                opset=17,
                tol=tol,
            ),
            Row(
                f"rmsnorm_last_{tag}",
                "RMSNormalization",
                ins(rand(2, 5, 64, dtype=dtype, low=-3, high=5), rand(64, dtype=dtype)),
                opset=23,
                tol=tol,
            ),
            Row(
                f"rmsnorm_axis1_eps_{tag}",
                "RMSNormalization",
                ins(rand(2, 3, 4, 5, dtype=dtype), rand(3, 4, 5, dtype=dtype)),
                {"axis": 1, "epsilon": 1e-2},
                opset=23,
                tol=tol,
            ),
            Row(
                f"rmsnorm_stash_{tag}",
                "RMSNormalization",
                ins(rand(3, 32, dtype=dtype), rand(32, dtype=dtype)),
                {"axis": -1, "stash_type": 1},
                opset=23,
                tol=tol,
            ),
            Row(
                f"instancenorm_{tag}",
                "InstanceNormalization",
                ins(rand(2, 3, 4, 5, dtype=dtype), rand(3, dtype=dtype), rand(3, dtype=dtype)),
                {"epsilon": 1e-3},
                opset=22,
                tol=tol,
            ),
        ]
    # onnxruntime's CPU build has no bfloat16 kernels: float64 numpy from the spec's formulas stands in
    bf16 = ml_dtypes.bfloat16
    rows += [
        Row(
            "layernorm_bf16",
            "LayerNormalization",
            ins(rand(2, 3, 64, dtype=bf16, low=-3, high=5), rand(64, dtype=bf16), rand(64, dtype=bf16)),
            opset=17,
            tol=BF16,
            oracle=_layer_norm_reference,
        ),
        Row(
            "rmsnorm_bf16",
            "RMSNormalization",
            ins(rand(2, 3, 64, dtype=bf16, low=-3, high=5), rand(64, dtype=bf16)),
            opset=23,
            tol=BF16,
            oracle=_rms_norm_reference,
        ),
    ]
    rows += [
        Row(
            "layernorm_fp64",
            "LayerNormalization",
            ins(rand(2, 6, dtype=np.float64), rand(6, dtype=np.float64)),
            opset=17,
            tol=(1e-12, 1e-12),
        ),
        Row(
            "groupnorm_21",
            "GroupNormalization",
            ins(rand(2, 6, 3, 4), rand(6), rand(6)),
            {"num_groups": 3, "epsilon": 1e-4},
            opset=21,
        ),
        Row("groupnorm_18", "GroupNormalization", ins(rand(2, 6, 3, 4), rand(2), rand(2)), {"num_groups": 2}, opset=18),
        Row(
            "batchnorm",
            "BatchNormalization",
            ins(rand(2, 3, 4, 5), rand(3), rand(3), rand(3), rand(3, low=0.1, high=2)),
            {"epsilon": 1e-3},
            opset=15,
        ),
        Row(
            "batchnorm_2d_input",
            "BatchNormalization",
            ins(rand(4, 3), rand(3), rand(3), rand(3), rand(3, low=0.1, high=2)),
            opset=15,
        ),
        Row(
            "batchnorm_fp16",
            "BatchNormalization",
            ins(
                rand(2, 3, 4, 5, dtype=np.float16),
                rand(3, dtype=np.float16),
                rand(3, dtype=np.float16),
                rand(3, dtype=np.float16),
                rand(3, dtype=np.float16, low=0.1, high=2),
            ),
            opset=15,
            tol=FP16,
        ),
        Row("lrn", "LRN", ins(rand(2, 7, 3, 4)), {"size": 3, "alpha": 0.01, "beta": 0.7, "bias": 1.5}, opset=13),
        # onnxruntime rejects an even size; the spec allows it (onnx's reference loops over the wrong axis)
        Row("lrn_even_size", "LRN", ins(rand(2, 6, 3, 3)), {"size": 4}, opset=13, oracle=_lrn_reference),
        Row("lpnorm_l2", "LpNormalization", ins(rand(3, 4, 5)), {"axis": 1, "p": 2}, opset=22),
        Row(
            "lpnorm_l2_zero_row",
            "LpNormalization",
            ins(lambda rng: np.vstack([rng.uniform(-1, 1, (2, 5)), np.zeros((1, 5))]).astype(np.float32)),
            {"axis": 1, "p": 2},
            opset=22,
        ),
        Row("lpnorm_l2_fp16", "LpNormalization", ins(rand(3, 4, 5, dtype=np.float16)), {"axis": 1}, opset=22, tol=FP16),
        Row(
            "groupnorm_21_fp16",
            "GroupNormalization",
            ins(rand(2, 6, 3, 4, dtype=np.float16), rand(6, dtype=np.float16), rand(6, dtype=np.float16)),
            {"num_groups": 3},
            opset=21,
            tol=FP16,
        ),
        Row("lrn_fp16", "LRN", ins(rand(2, 7, 3, 4, dtype=np.float16)), {"size": 5, "alpha": 0.1}, opset=13, tol=FP16),
        # onnxruntime's function body for MVN mixes float16 and float: the spec's formula in numpy stands in
        Row(
            "mvn_fp16",
            "MeanVarianceNormalization",
            ins(rand(2, 3, 4, 5, dtype=np.float16)),
            opset=13,
            tol=FP16,
            oracle=_mvn_reference,
        ),
        Row("lpnorm_l1_last", "LpNormalization", ins(rand(3, 4, 5)), {"p": 1}, opset=22),
        Row("mvn", "MeanVarianceNormalization", ins(rand(2, 3, 4, 5)), opset=13),
        Row("mvn_axes", "MeanVarianceNormalization", ins(rand(2, 3, 4, 5)), {"axes": [1, 3]}, opset=13),
    ]
    return rows


# --- resize ---------------------------------------------------------------------------------------------


def _resize_rows() -> list[Row]:
    rows: list[Row] = []
    up = const([1, 1, 1.75, 2.5], np.float32)
    down = const([1, 1, 0.6, 0.45], np.float32)
    coord_modes = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "half_pixel_symmetric"]
    # align_corners: onnxruntime divides by the integer output length, the spec's reference (and the
    # node suite) by input length * scale; they agree when that product is whole, as in these rows
    whole_up = const([1, 1, 1.5, 1.25], np.float32)
    whole_down = const([1, 1, 0.5, 0.75], np.float32)
    for mode in ("nearest", "linear", "cubic"):
        for coord in coord_modes:
            for tag, scales in (("up", up), ("down", down)):
                shape = (2, 3, 5, 7)
                if coord == "align_corners":
                    scales, shape = (whole_up if tag == "up" else whole_down), (2, 3, 6, 8)
                rows.append(
                    Row(
                        f"resize_{mode}_{coord}_{tag}",
                        "Resize",
                        ins(rand(*shape), None, scales),
                        {"mode": mode, "coordinate_transformation_mode": coord},
                        opset=19,
                    )
                )
    for nearest in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil"):
        rows.append(
            Row(
                f"resize_nearest_{nearest}",
                "Resize",
                ins(rand(1, 2, 4, 6), None, None, const([1, 2, 7, 11])),
                {"mode": "nearest", "nearest_mode": nearest},
                opset=19,
            )
        )
    rows += [
        Row(
            "resize_linear_sizes_down",
            "Resize",
            ins(rand(1, 2, 9, 10), None, None, const([1, 2, 4, 7])),
            {"mode": "linear"},
            opset=19,
        ),
        Row(
            "resize_cubic_A05_exclude",
            "Resize",
            ins(rand(1, 2, 6, 5), None, const([1, 1, 1.5, 0.8], np.float32)),
            {"mode": "cubic", "cubic_coeff_a": -0.5, "exclude_outside": 1},
            opset=19,
        ),
        Row(
            "resize_linear_antialias",
            "Resize",
            ins(rand(1, 2, 12, 11), None, const([1, 1, 0.4, 0.6], np.float32)),
            {"mode": "linear", "antialias": 1},
            opset=19,
        ),
        Row(
            "resize_cubic_antialias",
            "Resize",
            ins(rand(1, 2, 12, 11), None, None, const([1, 2, 5, 4])),
            {"mode": "cubic", "antialias": 1},
            opset=19,
        ),
        Row(
            "resize_axes",
            "Resize",
            ins(rand(2, 3, 5, 6), None, const([2.0, 0.5], np.float32)),
            {"mode": "linear", "axes": [3, 2]},
            opset=19,
        ),
        Row(
            "resize_tf_crop_scales",
            "Resize",
            ins(rand(1, 1, 6, 8), const([0.2, 0.1, 0.8, 0.7], np.float32), const([1.5, 2.0], np.float32)),
            {"mode": "cubic", "coordinate_transformation_mode": "tf_crop_and_resize", "axes": [2, 3]},
            opset=19,
        ),
        Row(
            "resize_not_larger",
            "Resize",
            ins(rand(1, 1, 4, 6), None, None, const([7, 7])),
            {"mode": "nearest", "axes": [2, 3], "keep_aspect_ratio_policy": "not_larger"},
            opset=19,
        ),
        Row(
            "resize_not_smaller",
            "Resize",
            ins(rand(1, 1, 4, 6), None, None, const([7, 7])),
            {"mode": "linear", "axes": [2, 3], "keep_aspect_ratio_policy": "not_smaller"},
            opset=19,
        ),
        Row(
            "resize_tf_crop",
            "Resize",
            ins(rand(1, 2, 6, 7), const([0, 0, 0.2, 0.1, 1, 1, 0.9, 1.2], np.float32), None, const([1, 2, 4, 5])),
            {"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": 2.5},
            opset=19,
        ),
        Row(
            "resize_nearest_uint8",
            "Resize",
            ins(
                lambda rng: rng.integers(0, 256, (1, 1, 4, 5)).astype(np.uint8),
                None,
                const([1, 1, 2.0, 1.5], np.float32),
            ),
            {"mode": "nearest"},
            opset=19,
        ),
        Row(
            "resize_linear_3d",
            "Resize",
            ins(rand(1, 1, 3, 4, 5), None, const([1, 1, 2, 1.5, 0.8], np.float32)),
            {"mode": "linear"},
            opset=19,
        ),
        Row(
            "resize_linear_fp16",
            "Resize",
            ins(rand(1, 2, 5, 6, dtype=np.float16), None, const([1, 1, 1.6, 0.7], np.float32)),
            {"mode": "linear"},
            opset=19,
            tol=FP16,
        ),
        Row(
            "resize_cubic_fp16",
            "Resize",
            ins(rand(1, 2, 5, 6, dtype=np.float16), None, None, const([1, 2, 8, 4])),
            {"mode": "cubic"},
            opset=19,
            tol=FP16,
        ),
        Row(
            "resize_nearest_fp16",
            "Resize",
            ins(rand(1, 2, 5, 6, dtype=np.float16), None, const([1, 1, 2, 0.5], np.float32)),
            {"mode": "nearest"},
            opset=19,
            tol=(0, 0),
        ),
        Row(
            "resize_opset10_nearest",
            "Resize",
            ins(rand(1, 1, 3, 4), const([1, 1, 2, 3], np.float32)),
            {"mode": "nearest"},
            opset=10,
        ),
        Row(
            "resize_opset10_linear",
            "Resize",
            ins(rand(1, 1, 3, 4), const([1, 1, 2, 1.5], np.float32)),
            {"mode": "linear"},
            opset=10,
        ),
        Row(
            "resize_opset11_roi_ignored",
            "Resize",
            ins(rand(1, 1, 3, 4), const([], np.float32), const([1, 1, 2, 2], np.float32)),
            {"mode": "linear"},
            opset=11,
        ),
        Row(
            "upsample_nearest",
            "Upsample",
            ins(rand(1, 2, 3, 4), const([1, 1, 2, 3], np.float32)),
            {"mode": "nearest"},
            opset=9,
        ),
        Row(
            "upsample_linear",
            "Upsample",
            ins(rand(1, 2, 3, 4), const([1, 1, 2, 2.5], np.float32)),
            {"mode": "linear"},
            opset=9,
        ),
    ]
    return rows


# --- vision ------------------------------------------------------------------------------------------


def _vision_rows() -> list[Row]:
    rows: list[Row] = []
    for mode in ("linear", "nearest", "cubic"):
        for padding in ("zeros", "border", "reflection"):
            for align in (0, 1):
                rows.append(
                    Row(
                        f"gridsample_{mode}_{padding}_{align}",
                        "GridSample",
                        ins(rand(2, 3, 5, 6), rand(2, 4, 3, 2, low=-1.3, high=1.3)),
                        {"mode": mode, "padding_mode": padding, "align_corners": align},
                        opset=22,
                    )
                )
    rows += [
        Row(
            "gridsample_fp16",
            "GridSample",
            ins(rand(1, 2, 5, 6, dtype=np.float16), rand(1, 3, 4, 2, dtype=np.float16, low=-1.1, high=1.1)),
            {"mode": "linear"},
            opset=22,
            tol=FP16,
        ),
        Row(
            "gridsample_3d",
            "GridSample",
            ins(rand(1, 2, 3, 4, 5), rand(1, 2, 3, 4, 3, low=-1.2, high=1.2)),
            {"mode": "linear"},
            opset=22,
        ),
        Row(
            "gridsample_opset16_bilinear",
            "GridSample",
            ins(rand(1, 2, 4, 4), rand(1, 3, 3, 2, low=-1, high=1)),
            {"mode": "bilinear", "align_corners": 1},
            opset=16,
        ),
        Row("affinegrid_2d", "AffineGrid", ins(rand(2, 2, 3), const([2, 3, 4, 5])), opset=20),
        Row(
            "affinegrid_3d_align",
            "AffineGrid",
            ins(rand(1, 3, 4), const([1, 1, 3, 4, 5])),
            {"align_corners": 1},
            opset=20,
        ),
    ]
    # the last two regions reach past the right/bottom border (samples snap to the edge or drop out)
    rois = const(
        [
            [0.5, 1.0, 5.0, 6.5],
            [2.0, 0.0, 7.5, 3.0],
            [-1.0, -0.5, 3.0, 9.0],
            [3.3, 3.3, 3.4, 3.5],
            [6.0, 5.0, 11.5, 10.5],
            [9.0, 2.0, 13.0, 12.0],
        ],
        np.float32,
    )
    batches = const([0, 1, 1, 0, 1, 0])
    for mode in ("avg", "max"):
        for coord in ("half_pixel", "output_half_pixel"):
            for ratio in (0, 2):
                rows.append(
                    Row(
                        f"roialign_{mode}_{coord}_{ratio}",
                        "RoiAlign",
                        ins(rand(2, 3, 8, 9), rois, batches),
                        {
                            "mode": mode,
                            "coordinate_transformation_mode": coord,
                            "sampling_ratio": ratio,
                            "output_height": 3,
                            "output_width": 2,
                            "spatial_scale": 0.8,
                        },
                        opset=16,
                    )
                )

    def boxes(rng: np.random.Generator) -> np.ndarray:
        corner = rng.uniform(0, 10, (2, 12, 2))
        size = rng.uniform(1, 5, (2, 12, 2))
        out = np.concatenate([corner, corner + size], axis=-1).astype(np.float32)
        out[:, ::3] = out[:, ::3][..., [2, 3, 0, 1]]  # some boxes with flipped corners
        out[:, 5] = out[:, 4]  # identical boxes
        return out

    def scores(rng: np.random.Generator) -> np.ndarray:
        s = rng.uniform(0, 1, (2, 3, 12)).astype(np.float32)
        s[:, :, 7] = s[:, :, 8]  # a tie
        return s

    for name, extra, attrs in (
        ("nms_basic", [const([5]), const([0.3], np.float32), const([0.2], np.float32)], {}),
        ("nms_no_score_threshold", [const([20]), const([0.1], np.float32)], {}),
        ("nms_center_box", [const([3]), const([0.4], np.float32), const([0.0], np.float32)], {"center_point_box": 1}),
        ("nms_no_limit", [], {}),
    ):
        rows.append(Row(name, "NonMaxSuppression", ins(boxes, scores, *extra), attrs, opset=11))
    return rows


ROWS = _conv_rows() + _pool_rows() + _norm_rows() + _resize_rows() + _vision_rows()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_parity(row: Row, device: str) -> None:
    rng = np.random.default_rng(zlib.crc32(row.id.encode()))
    model, feeds = _model(row, rng)
    rtol, atol = row.tol
    if device == "cuda" and row.op in CONV_OPS:
        rtol, atol = max(rtol, TF32[0]), max(atol, TF32[1])
    if row.oracle is None:
        assert_parity(model, feeds, device, rtol=rtol, atol=atol)
        return
    if row.oracle == "reference":
        from onnx.reference import ReferenceEvaluator

        expected = ReferenceEvaluator(model).run(None, feeds)
    else:
        values = [numpy_helper.to_array(t) for t in model.graph.initializer]
        expected = row.oracle(*feeds.values(), *values)
    actual = onnxgen_run(model, feeds, device)
    for e, a in zip(expected, actual):
        assert a.shape == e.shape
        assert a.dtype == next(iter(feeds.values())).dtype
        np.testing.assert_allclose(a.astype(np.float64), np.asarray(e, np.float64), rtol=rtol, atol=atol)


def test_maxpool_then_maxunpool() -> None:
    """MaxUnpool scatters MaxPool's indices back into the original (odd-sized) input shape."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 5, 7)).astype(np.float32)
    nodes = [
        helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("MaxUnpool", ["y", "i", "shape"], ["u"], kernel_shape=[2, 2], strides=[2, 2]),
    ]
    model = make_model(
        nodes,
        [helper.make_tensor_value_info("x", TP.FLOAT, x.shape)],
        [helper.make_empty_tensor_value_info("u")],
        opset=22,
        ms_opset=None,
    )
    assert_parity(model, {"x": x})


def test_maxunpool_inferred_shape() -> None:
    rng = np.random.default_rng(8)
    x = rng.standard_normal((1, 2, 4, 6)).astype(np.float32)
    nodes = [
        helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("MaxUnpool", ["y", "i"], ["u"], kernel_shape=[2, 2], strides=[2, 2]),
    ]
    model = make_model(
        nodes,
        [helper.make_tensor_value_info("x", TP.FLOAT, x.shape)],
        [helper.make_empty_tensor_value_info("u")],
        opset=22,
        ms_opset=None,
    )
    assert_parity(model, {"x": x})


CAPTURE_ROWS = [r for r in ROWS if r.op not in ("RoiAlign", "NonMaxSuppression", "MaxRoiPool")]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("row", CAPTURE_ROWS, ids=[r.id for r in CAPTURE_ROWS])
def test_capture_replays_bit_identical(row: Row) -> None:
    """Every kernel that declares itself capturable records into a CUDA graph, and the replay
    equals the eager result bit for bit (shape-like inputs stay on the host)."""
    import torch

    from onnxgen.runtime.dtypes import numpy_to_torch
    from onnxgen.runtime.node_contract import NodeContext
    from onnxgen.runtime.ops.registry import load_all_ops, lookup

    load_all_ops()
    spec = lookup("", row.op, row.opset)
    assert spec is not None and spec.capture is None, f"{row.op} declares capture={spec and spec.capture!r}"
    rng = np.random.default_rng(zlib.crc32(row.id.encode()))
    args = []
    for position, value in enumerate(row.inputs(rng)):
        if value is None:
            args.append(None)
            continue
        array = value.value if isinstance(value, Const) else value
        tensor = numpy_to_torch(np.array(array))
        args.append(tensor if position in spec.host_inputs else tensor.cuda())
    ctx = NodeContext(
        row.id,
        row.op,
        "",
        row.opset,
        dict(row.attrs),
        torch.device("cuda"),
        len(args),
        row.outputs,
        outputs_wanted=(True,) * row.outputs,
    )

    def call() -> tuple:
        result = spec.fn(ctx, *args)
        return result if isinstance(result, tuple) else (result,)

    eager = [t.clone() for t in call()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    for e, c in zip(eager, captured):
        assert e.dtype == c.dtype and e.shape == c.shape
        assert torch.equal(e, c), f"replay differs from eager by {(e.double() - c.double()).abs().max().item()}"
