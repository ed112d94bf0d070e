"""LinearAttention and CausalConvWithState in onnxruntime's com.microsoft form (what onnxruntime-
genai's builder writes for Gated DeltaNet layers; runtime/ops/linear_attention.py).

Oracle: onnxruntime 1.32's CPU kernels. Their state_window (per-token states for speculative
decoding) is CUDA-only there, so a window's slots are checked against onnxruntime's plain op run
on each prefix of the tokens: slot j is the state after token T - W + j.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxgen.errors import OnnxgenError
from tests.conftest import DEVICES, assert_parity, make_model, onnxgen_run, ort_run

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _vi(name: str, elem: int, shape: list | None = None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _model(op: str, names: list[str], feeds: dict[str, np.ndarray], dtype: int, **attrs) -> onnx.ModelProto:
    while names and names[-1] == "":
        names = names[:-1]
    node = helper.make_node(op, names, ["out", "state"], domain="com.microsoft", **attrs)
    inputs = [_vi(n, dtype, list(feeds[n].shape)) for n in names if n]
    return make_model([node], inputs, [_vi("out", dtype), _vi("state", dtype)])


# ---------------------------------------------------------------- LinearAttention


def _attention_feeds(rule, hq, hkv, t, dtype, per_dim_decay=False, past=True, window=0, seed=0, key_heads=None):
    rng = np.random.default_rng(seed)
    b, d_k, d_v = 2, 4, 3
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    key_heads = key_heads or hkv
    k = rng.standard_normal((b, t, key_heads, d_k))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # delta rules expect L2-normalised keys
    feeds = {
        "q": rng.standard_normal((b, t, hq * d_k)).astype(np_dtype),
        "k": k.reshape(b, t, key_heads * d_k).astype(np_dtype),
        "v": rng.standard_normal((b, t, hkv * d_v)).astype(np_dtype),
    }
    names = ["q", "k", "v", "past" if past else "", "", ""]
    if past:
        shape = (b, hkv, d_k, d_v)
        feeds["past"] = (0.3 * rng.standard_normal((window, *shape) if window else shape)).astype(np_dtype)
    if rule in ("gated", "gated_delta"):
        feeds["decay"] = -rng.uniform(0.01, 0.5, (b, t, hkv * d_k if per_dim_decay else hkv)).astype(np_dtype)
        names[4] = "decay"
    if rule in ("delta", "gated_delta"):
        feeds["beta"] = rng.uniform(0.1, 0.9, (b, t, hkv)).astype(np_dtype)
        names[5] = "beta"
    return feeds, names


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("rule", "hq", "hkv", "per_dim_decay", "past", "dtype", "t", "chunk"),
    [
        ("gated_delta", 2, 2, False, True, F32, 19, 4),  # Qwen3.5-0.8B's GDN heads: as many q as v
        ("gated_delta", 1, 2, False, True, F32, 19, 4),  # inverse GQA (35B-A3B: 16 key, 32 value heads)
        ("gated_delta", 2, 4, False, False, F32, 1, 64),  # inverse GQA, one decode step, no past
        ("gated_delta", 4, 2, False, True, F32, 5, 64),  # standard GQA
        ("gated_delta", 1, 2, False, True, F16, 7, 4),
        ("gated", 1, 2, True, True, F32, 6, 64),  # per-key-dimension decay, inverse GQA
        ("delta", 2, 2, False, True, F32, 9, 4),
        ("linear", 2, 4, False, False, F32, 5, 2),
    ],
)
def test_linear_attention_ms_matches_onnxruntime(device, rule, hq, hkv, per_dim_decay, past, dtype, t, chunk) -> None:
    feeds, names = _attention_feeds(rule, hq, hkv, t, dtype, per_dim_decay, past)
    model = _model(
        "LinearAttention", names, feeds, dtype, q_num_heads=hq, kv_num_heads=hkv, update_rule=rule, chunk_size=chunk
    )
    tol = 1e-5 if dtype == F32 else 5e-3
    assert_parity(model, feeds, device, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t", [7, 1])
def test_linear_attention_ms_keys_per_query_head(device, t) -> None:
    """Inverse GQA with the keys packed per query head, as onnxruntime-genai's Qwen3.5 export feeds
    them (2 key heads, 4 value heads): each key head serves the value heads its query head does."""
    feeds, names = _attention_feeds("gated_delta", 2, 4, t, F32, key_heads=2, seed=3)
    model = _model("LinearAttention", names, feeds, F32, q_num_heads=2, kv_num_heads=4, update_rule="gated_delta",
                   chunk_size=4)  # fmt: skip
    assert_parity(model, feeds, device, rtol=1e-5, atol=1e-5)


def test_linear_attention_ms_refuses_keys_of_another_width() -> None:
    feeds, names = _attention_feeds("gated_delta", 2, 4, 3, F32, key_heads=3)
    model = _model("LinearAttention", names, feeds, F32, q_num_heads=2, kv_num_heads=4)
    with pytest.raises(
        OnnxgenError, match=r"key has last dimension 12; expected kv_num_heads \* d_k = 4 \* 4 or 2 \* 4"
    ):
        onnxgen_run(model, feeds)


@pytest.mark.parametrize(("t", "window"), [(5, 3), (5, 5), (4, 5), (1, 2)])
def test_linear_attention_state_window_holds_the_state_after_each_of_the_last_tokens(t: int, window: int) -> None:
    """Slot j of present_state is the state after token T - W + j: onnxruntime's window-less op
    run on that prefix of the tokens (from the window's last past slot); a slot before the first
    token is that past slot itself. The output equals the window-less op's."""
    hq, hkv = 1, 2
    feeds, names = _attention_feeds("gated_delta", hq, hkv, t, F32, window=window, seed=4)
    attrs = dict(q_num_heads=hq, kv_num_heads=hkv, update_rule="gated_delta", chunk_size=2)
    out, state = onnxgen_run(_model("LinearAttention", names, feeds, F32, state_window=window, **attrs), feeds)
    assert state.shape == (window, 2, hkv, 4, 3)
    plain = dict(feeds, past=feeds["past"][-1])
    expected_out = ort_run(_model("LinearAttention", names, plain, F32, **attrs), plain)[0]
    np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)
    for j in range(window):
        end = t - window + j + 1  # tokens seen by slot j
        if end == 0:
            np.testing.assert_array_equal(state[j], plain["past"])
            continue
        prefix = {n: (v[:, :end] if n != "past" else v) for n, v in plain.items()}
        expected_state = ort_run(_model("LinearAttention", names, prefix, F32, **attrs), prefix)[1]
        np.testing.assert_allclose(state[j], expected_state, rtol=1e-5, atol=1e-5, err_msg=f"slot {j}")


def test_linear_attention_ms_refuses_a_window_before_its_past() -> None:
    feeds, names = _attention_feeds("gated_delta", 2, 2, 2, F32, window=4)
    model = _model("LinearAttention", names, feeds, F32, q_num_heads=2, kv_num_heads=2, state_window=4)
    with pytest.raises(OnnxgenError, match="state_window 4 reaches before"):
        onnxgen_run(model, feeds)


def test_linear_attention_ms_refuses_heads_that_do_not_divide() -> None:
    feeds, names = _attention_feeds("gated_delta", 3, 2, 2, F32)
    model = _model("LinearAttention", names, feeds, F32, q_num_heads=3, kv_num_heads=2)
    with pytest.raises(OnnxgenError, match="multiple or divisor of kv_num_heads 2"):
        onnxgen_run(model, feeds)


# ---------------------------------------------------------------- CausalConvWithState


def _conv_feeds(length, k, dilation, channels_last, channel_axes, dtype, past=True, window=0, bias=True, seed=1):
    rng = np.random.default_rng(seed)
    b = 2
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    c = int(np.prod(channel_axes))
    carry = (k - 1) * dilation
    x_shape = (b, length, *channel_axes) if channels_last else (b, c, length)
    state_shape = (b, carry, *channel_axes) if channels_last else (b, c, carry)
    feeds = {"x": rng.standard_normal(x_shape).astype(np_dtype), "w": rng.standard_normal((c, 1, k)).astype(np_dtype)}
    names = ["x", "w", "", ""]
    if bias:
        feeds["bias"] = rng.standard_normal(c).astype(np_dtype)
        names[2] = "bias"
    if past:
        shape = (window, *state_shape) if window else state_shape
        feeds["past"] = rng.standard_normal(shape).astype(np_dtype)
        names[3] = "past"
    return feeds, names


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("length", "k", "dilation", "channels_last", "channel_axes", "past", "activation", "dtype"),
    [
        (7, 4, 1, False, (6,), True, "silu", F32),  # the Gated DeltaNet form
        (7, 4, 2, False, (3,), True, "none", F32),  # dilated: the carry holds (k - 1) * 2 positions
        (1, 4, 3, False, (3,), True, "swish", F32),  # a decode step, dilated
        (6, 4, 1, True, (5,), True, "silu", F32),  # channels-last activations and carry
        (5, 3, 2, True, (2, 3), False, "none", F32),  # two trailing channel axes, no past
        (6, 4, 1, True, (4,), True, "silu", F16),
    ],
)
def test_causal_conv_ms_matches_onnxruntime(
    device, length, k, dilation, channels_last, channel_axes, past, activation, dtype
) -> None:
    feeds, names = _conv_feeds(length, k, dilation, channels_last, channel_axes, dtype, past)
    attrs = dict(activation=activation, dilation=dilation, channels_last=int(channels_last))
    model = _model("CausalConvWithState", names, feeds, dtype, **attrs)
    tol = 1e-5 if dtype == F32 else 3e-3
    assert_parity(model, feeds, device, rtol=tol, atol=tol)


@pytest.mark.parametrize(("length", "window", "channels_last"), [(6, 3, False), (2, 3, False), (5, 2, True)])
def test_causal_conv_state_window_holds_the_carry_after_each_of_the_last_positions(
    length: int, window: int, channels_last: bool
) -> None:
    """Slot j is the carry after position T - W + j: onnxruntime's window-less op on that prefix."""
    feeds, names = _conv_feeds(length, 3, 2, channels_last, (4,), F32, window=window, seed=5)
    attrs = dict(activation="silu", dilation=2, channels_last=int(channels_last))
    out, state = onnxgen_run(_model("CausalConvWithState", names, feeds, F32, state_window=window, **attrs), feeds)
    plain = dict(feeds, past=feeds["past"][-1])
    np.testing.assert_allclose(out, ort_run(_model("CausalConvWithState", names, plain, F32, **attrs), plain)[0],
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    axis = 1 if channels_last else 2
    for j in range(window):
        end = length - window + j + 1
        if end == 0:
            np.testing.assert_array_equal(state[j], plain["past"])
            continue
        prefix = dict(plain, x=np.take(plain["x"], range(end), axis=axis))
        expected = ort_run(_model("CausalConvWithState", names, prefix, F32, **attrs), prefix)[1]
        np.testing.assert_array_equal(state[j], expected, err_msg=f"slot {j}")


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        (dict(ndim=2), "only the 1-D causal convolution"),
        (dict(state_length=8), "attribute state_length .*CUDA-only"),
        (dict(input_channels=2), "attribute input_channels .*CUDA-only"),
        (dict(dilation=0), "dilation must be >= 1"),
    ],
)
def test_causal_conv_ms_refuses_what_it_does_not_implement(attrs: dict, message: str) -> None:
    feeds, names = _conv_feeds(4, 3, 1, False, (3,), F32)
    with pytest.raises(OnnxgenError, match=message):
        onnxgen_run(_model("CausalConvWithState", names, feeds, F32, **attrs), feeds)


def test_shape_rules_pin_the_states_whatever_the_token_count() -> None:
    """The capture classifier's view of a Gated DeltaNet step: the outputs follow the symbolic
    token count T, the carried states never mention it (they are fixed-size: safe to record)."""
    from onnxgen.runtime.shapes.infer import infer_shapes

    f = F32
    nodes = [
        helper.make_node(
            "CausalConvWithState",
            ["x", "w", "", "conv_past"],
            ["y", "conv"],
            domain="com.microsoft",
            dilation=2,
            channels_last=1,
            activation="silu",
        ),  # fmt: skip
        helper.make_node(
            "LinearAttention",
            ["q", "k", "v", "rec_past", "g", "b"],
            ["o", "rec"],
            domain="com.microsoft",
            q_num_heads=2,
            kv_num_heads=4,
            state_window=3,
        ),  # fmt: skip
    ]
    inputs = [_vi("x", f, ["B", "T", 12]), _vi("w", f, [12, 1, 4]), _vi("conv_past", f, ["B", 6, 12])]
    inputs += [_vi("q", f, ["B", "T", 16]), _vi("k", f, ["B", "T", 32]), _vi("v", f, ["B", "T", 24])]
    inputs += [_vi("rec_past", f, [3, "B", 4, 8, 6]), _vi("g", f, ["B", "T", 4]), _vi("b", f, ["B", "T", 4])]
    result = infer_shapes(make_model(nodes, inputs, [_vi(n, f, None) for n in ("y", "conv", "o", "rec")]))
    shape = {name: [str(d) for d in result.values[name].shape] for name in ("y", "conv", "o", "rec")}
    assert shape == {
        "y": ["B", "T", "12"],
        "conv": ["B", "6", "12"],
        "o": ["B", "T", "24"],  # one head per KV head under inverse GQA: 4 x 6
        "rec": ["3", "B", "4", "8", "6"],
    }
