"""com.microsoft MRotaryEmbedding (multimodal RoPE, what onnxruntime-genai's builder writes for
Qwen3.5's full-attention layers; runtime/ops/contrib_attention.py).

Oracle: onnxruntime 1.32's CPU kernel. The three position streams differ in every case, so a
stream picked for the wrong channel shows (text-only prompts make them equal, which would hide it).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxgen.errors import OnnxgenError
from tests.conftest import DEVICES, assert_parity, make_model, onnxgen_run

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _case(*, rank: int, heads: int, head: int, rotary: int, section, layout: int, interleaved: int, dtype=F32):
    rng = np.random.default_rng(7)
    b, s, max_pos = 2, 5, 40
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    shape = (b, s, heads * head) if rank == 3 else (b, heads, s, head)
    angles = rng.uniform(0, 2 * np.pi, (max_pos, rotary // 2))
    feeds = {
        "x": rng.standard_normal(shape).astype(np_dtype),
        "pos": rng.integers(0, max_pos, (3, b, s)).astype(np.int64),  # T, H, W streams all differ
        "cos": np.cos(angles).astype(np_dtype),
        "sin": np.sin(angles).astype(np_dtype),
    }
    attrs = dict(mrope_section=list(section), mrope_layout=layout, interleaved=interleaved, num_heads=heads)
    if rotary != head:
        attrs["rotary_embedding_dim"] = rotary
    node = helper.make_node("MRotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], domain="com.microsoft", **attrs)
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.INT64 if n == "pos" else dtype, list(v.shape))
        for n, v in feeds.items()
    ]
    return make_model([node], inputs, [helper.make_tensor_value_info("y", dtype, None)]), feeds


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("rank", "heads", "head", "rotary", "section", "layout", "interleaved"),
    [
        (3, 4, 64, 16, (3, 3, 2), 1, 0),  # Qwen3.5: a quarter of the head rotates, interleaved sections
        (3, 2, 32, 32, (6, 5, 5), 1, 0),  # whole head, interleaved
        (3, 2, 32, 32, (8, 4, 4), 0, 0),  # Qwen2-VL's contiguous sections
        (4, 3, 16, 16, (4, 2, 2), 0, 1),  # [B, N, S, H] input, interleaved real/imaginary pairs
        (4, 2, 64, 16, (2, 3, 3), 1, 1),
    ],
)
def test_mrope_matches_onnxruntime(device, rank, heads, head, rotary, section, layout, interleaved):
    model, feeds = _case(
        rank=rank, heads=heads, head=head, rotary=rotary, section=section, layout=layout, interleaved=interleaved
    )
    assert_parity(model, feeds, device, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_mrope_fp16_matches_onnxruntime(device):
    model, feeds = _case(rank=3, heads=4, head=64, rotary=16, section=(3, 3, 2), layout=1, interleaved=0, dtype=F16)
    assert_parity(model, feeds, device, rtol=1e-3, atol=2e-3)


def test_mrope_equal_streams_is_plain_rotary():
    """Text-only positions (T = H = W) make the op com.microsoft RotaryEmbedding on the T stream."""
    model, feeds = _case(rank=3, heads=4, head=64, rotary=16, section=(3, 3, 2), layout=1, interleaved=0)
    feeds["pos"] = np.broadcast_to(feeds["pos"][:1], feeds["pos"].shape).copy()
    plain = helper.make_node(
        "RotaryEmbedding", ["x", "pos2", "cos", "sin"], ["y"], domain="com.microsoft",
        num_heads=4, rotary_embedding_dim=16,
    )  # fmt: skip
    inputs = [helper.make_tensor_value_info(n, F32, list(feeds[n].shape)) for n in ("x", "cos", "sin")]
    inputs.append(helper.make_tensor_value_info("pos2", TensorProto.INT64, [2, 5]))
    rotary = make_model([plain], inputs, [helper.make_tensor_value_info("y", F32, None)])
    want = onnxgen_run(rotary, {"x": feeds["x"], "pos2": feeds["pos"][0], "cos": feeds["cos"], "sin": feeds["sin"]})
    np.testing.assert_array_equal(onnxgen_run(model, feeds)[0], want[0])


def test_mrope_refuses_bad_sections_and_positions():
    model, feeds = _case(rank=3, heads=4, head=64, rotary=16, section=(3, 3, 3), layout=1, interleaved=0)
    with pytest.raises(OnnxgenError, match="must sum to half the rotary dim"):
        onnxgen_run(model, feeds)
    model, feeds = _case(rank=3, heads=4, head=64, rotary=16, section=(3, 3, 2), layout=1, interleaved=0)
    feeds["pos"] = feeds["pos"][:2]
    model.graph.input[1].type.tensor_type.ClearField("shape")  # the op's own check, not the feed check
    with pytest.raises(OnnxgenError, match=r"position_ids must be \[3, 2, 5\]"):
        onnxgen_run(model, feeds)
