"""Sequence-model and signal kernels against onnxruntime (CPU) on random inputs.

Tolerances: fp32 attention / rotary 1e-5; fp16 attention and rotary 2e-3 absolute (about two fp16
ulps at the output's magnitude: onnxruntime and torch round different intermediates); recurrent
fp32 1e-5 (a loop of small matmuls); DFT 1e-4 relative (different FFT algorithms).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.conftest import DEVICES, assert_parity, make_model, onnxgen_run, ort_run

RNG = np.random.default_rng(1234)
ONNX_TYPE = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}


def _randn(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def _single_node_model(
    op: str,
    feeds: dict[str, np.ndarray | None],
    outputs: list[str],
    out_type: int,
    opset: int,
    **attrs,
):
    """One node whose inputs are ``feeds`` in order (None: an omitted optional input)."""
    inputs = [name if value is not None else "" for name, value in feeds.items()]
    while inputs and not inputs[-1]:
        inputs.pop()
    node = helper.make_node(op, inputs, outputs, **attrs)
    graph_inputs = [
        helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)
        for name, value in feeds.items()
        if value is not None
    ]
    graph_outputs = [helper.make_tensor_value_info(name, out_type, None) for name in outputs if name]
    model = make_model([node], graph_inputs, graph_outputs, opset=opset, ms_opset=None)
    return model, {name: value for name, value in feeds.items() if value is not None}


# -- Attention ------------------------------------------------------------------------------

# name -> (Q, K, V shapes, past length or None, mask spec or None, attributes, extra outputs)
ATTENTION_CASES = {
    "mha_4d": ((2, 4, 5, 8), (2, 4, 5, 8), (2, 4, 5, 8), None, None, {}),
    "mha_4d_diff_v_head": ((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 6), None, None, {}),
    "gqa_causal_prefill": ((2, 8, 6, 16), (2, 2, 6, 16), (2, 2, 6, 16), None, None, {"is_causal": 1}),
    "gqa_3d_causal": (
        (2, 6, 64),
        (2, 6, 32),
        (2, 6, 32),
        None,
        None,
        {"is_causal": 1, "q_num_heads": 4, "kv_num_heads": 2},
    ),
    "cross_causal_short_q": ((1, 2, 3, 8), (1, 2, 6, 8), (1, 2, 6, 8), None, None, {"is_causal": 1}),
    "decode_gqa_past": ((2, 4, 1, 8), (2, 2, 1, 8), (2, 2, 1, 8), 7, None, {"is_causal": 1}),
    "decode_3d_past": (
        (2, 1, 32),
        (2, 1, 16),
        (2, 1, 16),
        5,
        None,
        {"is_causal": 1, "q_num_heads": 4, "kv_num_heads": 2},
    ),
    "chunk_causal_past": ((1, 4, 3, 8), (1, 4, 3, 8), (1, 4, 3, 8), 5, None, {"is_causal": 1}),
    # more new keys than queries: the causal offset is still the past length (query i sees past + i)
    "causal_past_more_new_keys": ((1, 2, 2, 8), (1, 2, 3, 8), (1, 2, 3, 8), 4, None, {"is_causal": 1}),
    "chunk_gqa_causal_past": ((2, 6, 4, 8), (2, 2, 4, 8), (2, 2, 4, 8), 3, None, {"is_causal": 1}),
    "bool_mask_2d": ((2, 4, 5, 8), (2, 4, 5, 8), (2, 4, 5, 8), None, ("bool", (5, 5)), {}),
    "bool_mask_causal_past": ((2, 4, 3, 8), (2, 2, 3, 8), (2, 2, 3, 8), 4, ("bool", (2, 1, 3, 7)), {"is_causal": 1}),
    "float_mask_4d_past": ((2, 4, 3, 8), (2, 4, 3, 8), (2, 4, 3, 8), 6, ("float", (2, 1, 3, 9)), {}),
    "float_mask_per_head_gqa": ((1, 4, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8), None, ("float", (4, 3, 5)), {}),
    "fully_masked_rows": ((1, 2, 3, 8), (1, 2, 4, 8), (1, 2, 4, 8), None, ("dead", (3, 4)), {}),
    "fully_masked_softcap_qk3": (
        (1, 2, 3, 8),
        (1, 2, 4, 8),
        (1, 2, 4, 8),
        None,
        ("dead", (3, 4)),
        {"softcap": 2.0, "qk_matmul_output_mode": 3},
    ),
    "scale_softcap": ((2, 4, 5, 8), (2, 4, 5, 8), (2, 4, 5, 8), None, None, {"scale": 0.3, "softcap": 2.0}),
    "qk_mode0": ((2, 4, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8), None, ("float", (5, 5)), {"qk_matmul_output_mode": 0}),
    "qk_mode1_softcap": (
        (2, 4, 5, 8),
        (2, 4, 5, 8),
        (2, 4, 5, 8),
        None,
        None,
        {"qk_matmul_output_mode": 1, "softcap": 3.0},
    ),
    "qk_mode2_past": ((1, 2, 2, 8), (1, 2, 2, 8), (1, 2, 2, 8), 3, ("float", (2, 5)), {"qk_matmul_output_mode": 2}),
    "qk_mode3": ((2, 4, 5, 8), (2, 4, 5, 8), (2, 4, 5, 8), None, ("bool", (5, 5)), {"qk_matmul_output_mode": 3}),
}


def _attention_model(name: str, dtype=np.float32):
    q_shape, k_shape, v_shape, past, mask_spec, attrs = ATTENTION_CASES[name]
    feeds: dict[str, np.ndarray | None] = {
        "Q": _randn(q_shape, dtype),
        "K": _randn(k_shape, dtype),
        "V": _randn(v_shape, dtype),
    }
    feeds["attn_mask"] = None
    if mask_spec is not None:
        kind, shape = mask_spec
        if kind == "bool":
            mask = RNG.random(shape) > 0.3
            mask[..., 0] = True  # keep every row alive: fully masked rows have their own case
            feeds["attn_mask"] = mask
        elif kind == "dead":
            feeds["attn_mask"] = np.array([[True, False, True, False], [False] * 4, [True] * 4])
        else:
            feeds["attn_mask"] = _randn(shape, dtype)
    outputs = ["Y"]
    if past is not None:
        batch = q_shape[0]
        kv_heads = k_shape[1] if len(k_shape) == 4 else attrs["kv_num_heads"]
        head = q_shape[-1] if len(q_shape) == 4 else q_shape[-1] // attrs["q_num_heads"]
        v_head = v_shape[-1] if len(v_shape) == 4 else v_shape[-1] // attrs["kv_num_heads"]
        feeds["past_key"] = _randn((batch, kv_heads, past, head), dtype)
        feeds["past_value"] = _randn((batch, kv_heads, past, v_head), dtype)
        outputs += ["present_key", "present_value"]
    if "qk_matmul_output_mode" in attrs:
        outputs += [""] * (3 - len(outputs)) + ["qk_matmul_output"]
    return _single_node_model("Attention", feeds, outputs, ONNX_TYPE[dtype], 23, **attrs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_attention_fp32(case: str, device: str) -> None:
    model, feeds = _attention_model(case)
    assert_parity(model, feeds, device, rtol=1e-5, atol=1e-5)


FP16_CASES = [
    "mha_4d",
    "gqa_causal_prefill",
    "decode_gqa_past",
    "chunk_causal_past",
    "float_mask_4d_past",
    "bool_mask_causal_past",
    "gqa_3d_causal",
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", FP16_CASES)
def test_attention_fp16(case: str, device: str) -> None:
    model, feeds = _attention_model(case, np.float16)
    assert_parity(model, feeds, device, rtol=0, atol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_qk_mode2_causal_masked_is_neg_inf(device: str) -> None:
    # The spec (and its reference) put -inf at causally masked places of the mode-2 output;
    # onnxruntime writes the lowest finite float there. Everything else must agree.
    feeds: dict[str, np.ndarray | None] = {
        "Q": _randn((1, 2, 2, 8)),
        "K": _randn((1, 2, 2, 8)),
        "V": _randn((1, 2, 2, 8)),
        "attn_mask": _randn((2, 5)),
        "past_key": _randn((1, 2, 3, 8)),
        "past_value": _randn((1, 2, 3, 8)),
    }
    outputs = ["Y", "present_key", "present_value", "qk"]
    model, feeds = _single_node_model(
        "Attention", feeds, outputs, TensorProto.FLOAT, 23, qk_matmul_output_mode=2, is_causal=1
    )
    expected = ort_run(model, feeds)
    actual = onnxgen_run(model, feeds, device)
    for e, a in zip(expected[:3], actual[:3]):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
    masked = expected[3] == np.finfo(np.float32).min
    assert masked.sum() == 2 * 1  # per head: query 0 cannot see the last key
    assert np.isneginf(actual[3][masked]).all()
    np.testing.assert_allclose(actual[3][~masked], expected[3][~masked], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_nonpad_kv_seqlen(device: str) -> None:
    # opset 24 external cache: K/V hold the whole cache, nonpad_kv_seqlen the valid length per batch
    feeds = {
        "Q": _randn((2, 4, 1, 8)),
        "K": _randn((2, 2, 6, 8)),
        "V": _randn((2, 2, 6, 8)),
        "attn_mask": None,
        "past_key": None,
        "past_value": None,
        "nonpad_kv_seqlen": np.array([3, 6], dtype=np.int64),
    }
    model, feeds = _single_node_model("Attention", feeds, ["Y"], TensorProto.FLOAT, 24, is_causal=1)
    assert_parity(model, feeds, device, rtol=1e-5, atol=1e-5)


# -- RotaryEmbedding ------------------------------------------------------------------------

ROTARY_CASES = {
    # name -> (input shape, with position_ids, attributes)
    "4d_positions": ((2, 3, 5, 16), True, {}),
    "4d_interleaved": ((2, 3, 5, 16), True, {"interleaved": 1}),
    "3d_num_heads": ((2, 5, 48), True, {"num_heads": 3}),
    "partial_rotary": ((2, 3, 5, 16), True, {"rotary_embedding_dim": 8}),
    "partial_interleaved_3d": ((2, 5, 48), True, {"num_heads": 3, "rotary_embedding_dim": 8, "interleaved": 1}),
    "no_positions": ((2, 3, 5, 16), False, {}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", sorted(ROTARY_CASES))
def test_rotary_embedding(case: str, dtype, device: str) -> None:
    shape, with_positions, attrs = ROTARY_CASES[case]
    batch = shape[0]
    seq = shape[2] if len(shape) == 4 else shape[1]
    head = shape[-1] if len(shape) == 4 else shape[-1] // attrs["num_heads"]
    half = attrs.get("rotary_embedding_dim", head) // 2
    angles = RNG.random((batch, seq, half)) * 6.0
    if with_positions:
        angles = RNG.random((12, half)) * 6.0
    feeds: dict[str, np.ndarray | None] = {
        "X": _randn(shape, dtype),
        "cos": np.cos(angles).astype(dtype),
        "sin": np.sin(angles).astype(dtype),
        "position_ids": RNG.integers(0, 12, (batch, seq)).astype(np.int64) if with_positions else None,
    }
    model, feeds = _single_node_model("RotaryEmbedding", feeds, ["Y"], ONNX_TYPE[dtype], 23, **attrs)
    tolerance = 1e-5 if dtype == np.float32 else 2e-3
    assert_parity(model, feeds, device, rtol=0, atol=tolerance)


# -- RNN / GRU / LSTM -----------------------------------------------------------------------


def _recurrent_feeds(
    gates: int,
    direction: str,
    seq: int,
    batch: int,
    inp: int,
    hidden: int,
    *,
    layout: int = 0,
    bias: bool = True,
    seq_lens: bool = False,
    initial: bool = False,
    lstm: bool = False,
    peephole: bool = False,
) -> dict[str, np.ndarray | None]:
    dirs = 2 if direction == "bidirectional" else 1
    x_shape = (batch, seq, inp) if layout else (seq, batch, inp)
    state_shape = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    feeds: dict[str, np.ndarray | None] = {
        "X": _randn(x_shape),
        "W": _randn((dirs, gates * hidden, inp)) * 0.5,
        "R": _randn((dirs, gates * hidden, hidden)) * 0.5,
        "B": _randn((dirs, 2 * gates * hidden)) * 0.5 if bias else None,
        "sequence_lens": RNG.integers(1, seq + 1, batch).astype(np.int32) if seq_lens else None,
        "initial_h": _randn(state_shape) if initial else None,
    }
    if lstm:
        feeds["initial_c"] = _randn(state_shape) if initial else None
        feeds["P"] = _randn((dirs, 3 * hidden)) if peephole else None
    return feeds


def _recurrent_outputs(op: str) -> list[str]:
    return ["Y", "Y_h", "Y_c"] if op == "LSTM" else ["Y", "Y_h"]


RECURRENT_CASES = {
    # name -> (op, direction, feed options, attributes)
    "rnn_forward": ("RNN", "forward", {}, {}),
    "rnn_bidirectional_seq_lens": ("RNN", "bidirectional", {"seq_lens": True, "initial": True}, {}),
    "rnn_relu_reverse": ("RNN", "reverse", {}, {"activations": ["Relu"]}),
    "gru_forward": ("GRU", "forward", {"initial": True}, {}),
    "gru_linear_before_reset": ("GRU", "bidirectional", {"seq_lens": True}, {"linear_before_reset": 1}),
    "gru_reverse_no_bias": ("GRU", "reverse", {"bias": False}, {}),
    "gru_activations_alpha": (
        "GRU",
        "forward",
        {},
        {"activations": ["HardSigmoid", "LeakyRelu"], "activation_alpha": [0.3, 0.05], "activation_beta": [0.4]},
    ),
    "lstm_forward": ("LSTM", "forward", {"initial": True}, {}),
    "lstm_bidirectional_peepholes": (
        "LSTM",
        "bidirectional",
        {"peephole": True, "initial": True, "seq_lens": True},
        {},
    ),
    "lstm_reverse_clip": ("LSTM", "reverse", {}, {"clip": 0.8}),
    "lstm_input_forget": ("LSTM", "forward", {"initial": True}, {"input_forget": 1}),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(RECURRENT_CASES))
def test_recurrent(case: str, device: str) -> None:
    op, direction, options, attrs = RECURRENT_CASES[case]
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    hidden = 5
    feeds = _recurrent_feeds(gates, direction, 4, 3, 6, hidden, lstm=op == "LSTM", **options)
    model, feeds = _single_node_model(
        op, feeds, _recurrent_outputs(op), TensorProto.FLOAT, 22, hidden_size=hidden, direction=direction, **attrs
    )
    assert_parity(model, feeds, device, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
def test_recurrent_batchwise_layout(op: str, device: str) -> None:
    # onnxruntime has no layout=1; its layout-0 run on transposed data is the oracle
    gates = {"RNN": 1, "GRU": 3, "LSTM": 4}[op]
    feeds = _recurrent_feeds(gates, "bidirectional", 4, 3, 6, 5, lstm=op == "LSTM", initial=True, seq_lens=True)
    outputs = _recurrent_outputs(op)
    model, feeds = _single_node_model(
        op, feeds, outputs, TensorProto.FLOAT, 22, hidden_size=5, direction="bidirectional"
    )
    expected = ort_run(model, feeds)
    batchwise = dict(feeds)
    batchwise["X"] = feeds["X"].transpose(1, 0, 2)
    for state in ("initial_h", "initial_c"):
        if state in feeds:
            batchwise[state] = feeds[state].transpose(1, 0, 2)
    model1, batchwise = _single_node_model(
        op, batchwise, outputs, TensorProto.FLOAT, 22, hidden_size=5, direction="bidirectional", layout=1
    )
    actual = onnxgen_run(model1, batchwise, device)
    np.testing.assert_allclose(actual[0], expected[0].transpose(2, 0, 1, 3), rtol=1e-5, atol=1e-5)
    for e, a in zip(expected[1:], actual[1:]):
        np.testing.assert_allclose(a, e.transpose(1, 0, 2), rtol=1e-5, atol=1e-5)


# -- DFT / STFT -----------------------------------------------------------------------------

DFT_CASES = {
    # name -> (input shape, opset, attributes, dft_length, axis input)
    "complex_axis1": ((2, 8, 3, 2), 20, {}, None, 1),
    "real_default_axis": ((2, 3, 8, 1), 20, {}, None, None),
    "rfft_padded": ((2, 7, 1), 20, {"onesided": 1}, 10, 1),
    "inverse_complex": ((3, 6, 2), 20, {"inverse": 1}, None, 1),
    "irfft": ((2, 5, 2), 20, {"inverse": 1, "onesided": 1}, None, 1),
    "opset17_axis_attr": ((2, 6, 4, 2), 17, {"axis": 2}, 5, None),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(DFT_CASES))
def test_dft(case: str, device: str) -> None:
    shape, opset, attrs, length, axis = DFT_CASES[case]
    feeds: dict[str, np.ndarray | None] = {
        "X": _randn(shape),
        "dft_length": None if length is None else np.array(length, dtype=np.int64),
    }
    if opset >= 20:
        feeds["axis"] = None if axis is None else np.array(axis, dtype=np.int64)
    model, feeds = _single_node_model("DFT", feeds, ["Y"], TensorProto.FLOAT, opset, **attrs)
    assert_parity(model, feeds, device, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("onesided", [0, 1])
def test_stft(onesided: int, device: str) -> None:
    feeds = {
        "signal": _randn((2, 40, 1)),
        "frame_step": np.array(6, dtype=np.int64),
        "window": np.hanning(16).astype(np.float32),
        "frame_length": np.array(16, dtype=np.int64),
    }
    model, feeds = _single_node_model("STFT", feeds, ["Y"], TensorProto.FLOAT, 17, onesided=onesided)
    assert_parity(model, feeds, device, rtol=1e-4, atol=1e-4)


# -- losses ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_softmax_cross_entropy_loss(reduction: str, device: str) -> None:
    labels = RNG.integers(0, 5, (3, 4)).astype(np.int64)
    labels[0, 1] = -1  # ignored
    feeds = {"scores": _randn((3, 5, 4)), "labels": labels, "weights": RNG.random(5).astype(np.float32)}
    model, feeds = _single_node_model(
        "SoftmaxCrossEntropyLoss",
        feeds,
        ["loss", "log_prob"],
        TensorProto.FLOAT,
        13,
        reduction=reduction,
        ignore_index=-1,
    )
    assert_parity(model, feeds, device, rtol=1e-5, atol=1e-5)
