"""Parity of the recurrent-state, FlexAttention and classic-ML kernels.

Oracles: onnxruntime where it has the op (LinearAttention, CausalConvWithState, the ai.onnx.ml
ops, TfIdfVectorizer); onnx's ReferenceEvaluator for ai.onnx.preview::FlexAttention, which
onnxruntime does not implement.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from tests.conftest import DEVICES, assert_parity, make_model, onnxgen_run, ort_run

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def _vi(name: str, elem: int, shape: list | None = None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _with_domain(model: onnx.ModelProto, domain: str, version: int) -> onnx.ModelProto:
    model.opset_import.append(helper.make_opsetid(domain, version))
    return model


# ---------------------------------------------------------------- LinearAttention


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("rule", "hq", "hkv", "per_dim_decay", "with_past", "dtype", "t", "chunk"),
    [
        ("linear", 2, 2, False, False, F32, 5, 64),
        ("gated", 2, 2, True, True, F32, 5, 64),
        ("gated", 4, 2, False, True, F32, 5, 64),
        ("delta", 2, 2, False, True, F32, 5, 64),
        ("gated_delta", 4, 1, False, True, F32, 5, 64),
        ("gated_delta", 4, 2, True, False, F32, 5, 64),
        ("gated_delta", 2, 2, False, True, F16, 5, 64),
        ("gated_delta", 1, 1, False, True, F32, 1, 64),  # one decode step
        # prefill over several chunks and a partial last one
        ("gated_delta", 4, 2, False, True, F32, 19, 4),
        ("delta", 2, 2, False, False, F32, 19, 5),
        ("gated", 2, 1, False, True, F32, 19, 6),
        ("linear", 2, 2, False, True, F32, 19, 8),
    ],
)
def test_linear_attention(device, rule, hq, hkv, per_dim_decay, with_past, dtype, t, chunk) -> None:
    rng = np.random.default_rng(0)
    b, d_k, d_v = 2, 4, 3
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    k = rng.standard_normal((b, t, hkv, d_k))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # delta rules expect L2-normalised keys
    feeds = {
        "q": rng.standard_normal((b, t, hq * d_k)).astype(np_dtype),
        "k": k.reshape(b, t, hkv * d_k).astype(np_dtype),
        "v": rng.standard_normal((b, t, hkv * d_v)).astype(np_dtype),
    }
    names = ["q", "k", "v", "past" if with_past else ""]
    if with_past:
        feeds["past"] = (0.3 * rng.standard_normal((b, hkv, d_k, d_v))).astype(np_dtype)
    if rule in ("gated", "gated_delta"):
        width = hkv * d_k if per_dim_decay else hkv
        feeds["decay"] = -rng.uniform(0.01, 0.5, (b, t, width)).astype(np_dtype)
        names.append("decay")
    else:
        names.append("")
    if rule in ("delta", "gated_delta"):
        feeds["beta"] = rng.uniform(0.1, 0.9, (b, t, hkv)).astype(np_dtype)
        names.append("beta")
    while names[-1] == "":
        names.pop()
    node = helper.make_node(
        "LinearAttention", names, ["out", "state"], q_num_heads=hq, kv_num_heads=hkv, update_rule=rule, chunk_size=chunk
    )
    inputs = [_vi(n, dtype, list(feeds[n].shape)) for n in names if n]
    model = make_model([node], inputs, [_vi("out", dtype), _vi("state", dtype)], opset=27, ms_opset=None)
    tol = 1e-5 if dtype == F32 else 5e-3
    assert_parity(model, feeds, device, rtol=tol, atol=tol)


# ---------------------------------------------------------------- CausalConvWithState


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("length", "k", "bias", "past", "activation", "dtype"),
    [
        (7, 4, False, False, "none", F32),
        (7, 4, True, True, "silu", F32),
        (1, 4, True, True, "swish", F32),  # decode step
        (2, 4, False, False, "none", F32),  # shorter than the carried state
        (5, 1, True, False, "silu", F32),  # no state at all
        (6, 3, True, True, "silu", F16),
    ],
)
def test_causal_conv_with_state(device, length, k, bias, past, activation, dtype) -> None:
    rng = np.random.default_rng(1)
    b, c = 2, 3
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    feeds = {
        "x": rng.standard_normal((b, c, length)).astype(np_dtype),
        "w": rng.standard_normal((c, 1, k)).astype(np_dtype),
    }
    names = ["x", "w", "", ""]
    if bias:
        feeds["bias"] = rng.standard_normal(c).astype(np_dtype)
        names[2] = "bias"
    if past:
        feeds["past"] = rng.standard_normal((b, c, k - 1)).astype(np_dtype)
        names[3] = "past"
    while names[-1] == "":
        names.pop()
    node = helper.make_node("CausalConvWithState", names, ["y", "state"], activation=activation)
    inputs = [_vi(n, dtype, list(feeds[n].shape)) for n in names if n]
    model = make_model([node], inputs, [_vi("y", dtype), _vi("state", dtype)], opset=27, ms_opset=None)
    tol = 1e-5 if dtype == F32 else 3e-3
    assert_parity(model, feeds, device, rtol=tol, atol=tol)


# ---------------------------------------------------------------- FlexAttention (vs ReferenceEvaluator)


def _soft_cap_graph(elem: int, cap: float) -> onnx.GraphProto:
    """score_mod: cap * tanh(s / cap)."""
    c = helper.make_tensor("cap", elem, [], [cap])
    nodes = [
        helper.make_node("Constant", [], ["c"], value=c),
        helper.make_node("Div", ["s", "c"], ["d"]),
        helper.make_node("Tanh", ["d"], ["t"]),
        helper.make_node("Mul", ["t", "c"], ["out"]),
    ]
    return helper.make_graph(nodes, "soft_cap", [_vi("s", elem)], [_vi("out", elem)])


def _causal_graph(elem: int) -> onnx.GraphProto:
    """score_mod: -inf above the diagonal, built from the scores' own shape."""
    neg = helper.make_tensor("neg", elem, [], [-np.inf])
    nodes = [
        helper.make_node("Shape", ["s"], ["shape"]),
        helper.make_node("ConstantOfShape", ["shape"], ["ones"], value=helper.make_tensor("one", elem, [1], [1])),
        helper.make_node("Trilu", ["ones"], ["keep_f"], upper=0),
        helper.make_node("Cast", ["keep_f"], ["keep"], to=TensorProto.BOOL),
        helper.make_node("Constant", [], ["n"], value=neg),
        helper.make_node("Where", ["keep", "s", "n"], ["out"]),
    ]
    return helper.make_graph(nodes, "causal", [_vi("s", elem)], [_vi("out", elem)])


def _sqrt_prob_graph(elem: int) -> onnx.GraphProto:
    return helper.make_graph([helper.make_node("Sqrt", ["p"], ["out"])], "pm", [_vi("p", elem)], [_vi("out", elem)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("case", "hq", "hkv", "dtype"),
    [
        ("plain", 2, 2, F32),
        ("soft_cap", 4, 2, F32),
        ("causal", 2, 1, F32),
        ("prob_mod", 2, 2, F32),
        ("soft_cap", 2, 2, F16),
    ],
)
def test_flex_attention(device, case, hq, hkv, dtype) -> None:
    rng = np.random.default_rng(2)
    b, length, s, e, ev = 2, 5, 5, 8, 6
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    feeds = {
        "Q": rng.standard_normal((b, hq, length, e)).astype(np_dtype),
        "K": rng.standard_normal((b, hkv, s, e)).astype(np_dtype),
        "V": rng.standard_normal((b, hkv, s, ev)).astype(np_dtype),
    }
    attrs: dict = {}
    softmax_elem = F32  # the default softmax precision for float/half inputs
    if case == "soft_cap":
        attrs = {"score_mod": _soft_cap_graph(softmax_elem, 2.0), "scale": 0.5}
    elif case == "causal":
        attrs = {"score_mod": _causal_graph(softmax_elem)}
    elif case == "prob_mod":
        attrs = {"prob_mod": _sqrt_prob_graph(softmax_elem)}
    node = helper.make_node("FlexAttention", ["Q", "K", "V"], ["Y"], domain="ai.onnx.preview", **attrs)
    inputs = [_vi(n, dtype, list(v.shape)) for n, v in feeds.items()]
    model = make_model([node], inputs, [_vi("Y", dtype)], opset=24, ms_opset=None)
    model = _with_domain(model, "ai.onnx.preview", 1)
    (expected,) = ReferenceEvaluator(model).run(None, feeds)
    (actual,) = onnxgen_run(model, feeds, device)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = 1e-5 if dtype == F32 else 2e-3
    np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64), rtol=tol, atol=tol)


# ---------------------------------------------------------------- ai.onnx.ml and TfIdfVectorizer (vs onnxruntime)


def _ml_model(node: onnx.NodeProto, inputs: list, outputs: list, ml_opset: int) -> onnx.ModelProto:
    return _with_domain(make_model([node], inputs, outputs, opset=21, ms_opset=None), "ai.onnx.ml", ml_opset)


@pytest.mark.parametrize("device", DEVICES)
def test_binarizer(device) -> None:
    x = np.random.default_rng(3).standard_normal((3, 5)).astype(np.float32)
    node = helper.make_node("Binarizer", ["x"], ["y"], domain="ai.onnx.ml", threshold=0.25)
    model = _ml_model(node, [_vi("x", F32, [3, 5])], [_vi("y", F32)], 1)
    assert_parity(model, {"x": x}, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(3, 6), (2, 3, 6)])
def test_array_feature_extractor(device, shape) -> None:
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    idx = np.array([4, 0, 4, 2], dtype=np.int64)
    node = helper.make_node("ArrayFeatureExtractor", ["x", "i"], ["y"], domain="ai.onnx.ml")
    model = _ml_model(node, [_vi("x", F32, list(shape)), _vi("i", TensorProto.INT64, [4])], [_vi("y", F32)], 1)
    assert_parity(model, {"x": x, "i": idx}, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["int_to_string", "string_to_int", "float_to_float_tensor"])
def test_label_encoder(device, kind) -> None:
    rng = np.random.default_rng(5)
    if kind == "int_to_string":
        attrs = dict(keys_int64s=[1, 3, 5], values_strings=["a", "b", "c"], default_string="?")
        x, xt, yt = rng.integers(0, 7, (4, 3)).astype(np.int64), TensorProto.INT64, TensorProto.STRING
    elif kind == "string_to_int":
        attrs = dict(keys_strings=["x", "y"], values_int64s=[7, 9])  # the default default is -1
        x, xt, yt = rng.choice(np.array(["x", "y", "z"], dtype=object), (5,)), TensorProto.STRING, TensorProto.INT64
    else:
        attrs = dict(
            keys_tensor=helper.make_tensor("k", F32, [3], [0.5, 1.5, 2.5]),
            values_tensor=helper.make_tensor("v", F32, [3], [10.0, 20.0, 30.0]),
            default_tensor=helper.make_tensor("d", F32, [1], [-7.0]),
        )
        x, xt, yt = rng.choice(np.array([0.5, 1.5, 2.5, 3.5], dtype=np.float32), (2, 4)), F32, F32
    node = helper.make_node("LabelEncoder", ["x"], ["y"], domain="ai.onnx.ml", **attrs)
    model = _ml_model(node, [_vi("x", xt, list(x.shape))], [_vi("y", yt)], 4)
    assert_parity(model, {"x": x}, device)


def _random_tree_ensemble(rng: np.random.Generator, n_features: int, n_targets: int, aggregate: int) -> dict:
    """Three random full trees of depth 1-3 (node 0 of each may hold a set-membership split)."""
    modes, splits, feats, t_ids, f_ids, t_leaf, f_leaf, members = [], [], [], [], [], [], [], []
    leaf_targets: list[int] = []
    leaf_weights: list[float] = []
    roots = []

    def leaf() -> int:
        leaf_targets.append(int(rng.integers(0, n_targets)))
        leaf_weights.append(float(rng.standard_normal()))
        return len(leaf_targets) - 1

    def build(depth: int) -> int:
        index = len(modes)
        mode = int(rng.integers(0, 7))
        modes.append(mode)
        splits.append(float(rng.choice([-0.5, 0.0, 0.5, 1.0])))
        feats.append(int(rng.integers(0, n_features)))
        if mode == 6:
            members.extend([0.5, 1.0, float("nan")])
        for ids, leafs in ((t_ids, t_leaf), (f_ids, f_leaf)):
            ids.append(0)
            leafs.append(0)
        for ids, leafs in ((t_ids, t_leaf), (f_ids, f_leaf)):
            if depth == 1 or rng.random() < 0.3:
                ids[index], leafs[index] = leaf(), 1
            else:
                ids[index], leafs[index] = build(depth - 1), 0
        return index

    for depth in (1, 2, 3):
        roots.append(build(depth))
    attrs = dict(
        nodes_modes=helper.make_tensor("m", TensorProto.UINT8, [len(modes)], modes),
        nodes_splits=helper.make_tensor("s", F32, [len(splits)], splits),
        nodes_featureids=feats,
        nodes_truenodeids=t_ids,
        nodes_falsenodeids=f_ids,
        nodes_trueleafs=t_leaf,
        nodes_falseleafs=f_leaf,
        nodes_missing_value_tracks_true=[int(rng.integers(0, 2)) for _ in modes],
        leaf_targetids=leaf_targets,
        leaf_weights=helper.make_tensor("w", F32, [len(leaf_weights)], leaf_weights),
        tree_roots=roots,
        n_targets=n_targets,
        aggregate_function=aggregate,
    )
    if members:
        attrs["membership_values"] = helper.make_tensor("mv", F32, [len(members)], members)
    return attrs


def _spec_post_transform(scores: np.ndarray, post: int) -> np.ndarray:
    """The TreeEnsemble spec's post transforms in numpy/scipy (onnxruntime swaps SOFTMAX and
    LOGISTIC for this op and approximates PROBIT, so it only supplies the raw scores)."""
    special = pytest.importorskip("scipy.special")
    s = scores.astype(np.float64)
    if post == 1:
        return special.softmax(s, axis=-1)
    if post == 2:
        return special.expit(s)
    if post == 3:
        e = np.where(s != 0, np.exp(s - s.max(axis=-1, keepdims=True)), 0.0)
        return e / e.sum(axis=-1, keepdims=True)
    return special.ndtri(s)  # PROBIT: the inverse normal CDF


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("seed", "aggregate", "post"),
    [(0, 1, 0), (1, 0, 0), (2, 2, 0), (3, 3, 0), (4, 1, 1), (5, 1, 2), (6, 0, 3), (7, 0, 4)],
)
def test_tree_ensemble(device, seed, aggregate, post) -> None:
    rng = np.random.default_rng(seed)
    attrs = _random_tree_ensemble(rng, n_features=3, n_targets=2, aggregate=aggregate)
    if post == 4:  # probit needs scores in (0, 1)
        n_leaves = attrs["leaf_weights"].dims[0]
        attrs["leaf_weights"] = helper.make_tensor("w", F32, [n_leaves], rng.uniform(0.05, 0.3, n_leaves))
    x = rng.choice(np.array([-1.0, -0.5, 0.0, 0.5, 1.0, 2.0, np.nan], dtype=np.float32), (16, 3))

    def model(post_transform: int) -> onnx.ModelProto:
        node = helper.make_node(
            "TreeEnsemble", ["x"], ["y"], domain="ai.onnx.ml", post_transform=post_transform, **attrs
        )
        return _ml_model(node, [_vi("x", F32, [16, 3])], [_vi("y", F32)], 5)

    if post == 0:
        assert_parity(model(0), {"x": x}, device)
        return
    (raw,) = ort_run(model(0), {"x": x})
    (actual,) = onnxgen_run(model(post), {"x": x}, device)
    assert actual.dtype == np.float32 and actual.shape == raw.shape
    np.testing.assert_allclose(actual, _spec_post_transform(raw, post), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("mode", "lo", "hi", "skip", "weights", "rank"),
    [
        ("TF", 1, 2, 0, False, 2),
        ("TF", 2, 2, 3, False, 1),
        ("IDF", 1, 3, 2, True, 2),
        ("TFIDF", 1, 2, 1, True, 2),
        ("IDF", 1, 2, 1, False, 1),
    ],
)
def test_tfidf_vectorizer(device, mode, lo, hi, skip, weights, rank) -> None:
    rng = np.random.default_rng(6)
    # pool: unigrams 2,3,5 ; bigrams (2,3) (5,2) (3,3) ; trigram (2,3,5)
    pool = [2, 3, 5, 2, 3, 5, 2, 3, 3, 2, 3, 5]
    attrs = dict(
        mode=mode,
        min_gram_length=lo,
        max_gram_length=hi,
        max_skip_count=skip,
        ngram_counts=[0, 3, 9],
        ngram_indexes=[6, 0, 1, 2, 5, 3, 4],
        pool_int64s=pool,
    )
    if weights:
        attrs["weights"] = [float(w) for w in rng.uniform(0.5, 2.0, 7)]
    shape = (3, 12) if rank == 2 else (12,)
    x = rng.choice(np.array([2, 3, 5, 7]), shape).astype(np.int64)
    node = helper.make_node("TfIdfVectorizer", ["x"], ["y"], **attrs)
    model = make_model([node], [_vi("x", TensorProto.INT64, list(shape))], [_vi("y", F32)], opset=21, ms_opset=None)
    assert_parity(model, {"x": x}, device)


@pytest.mark.parametrize("device", DEVICES)
def test_tfidf_vectorizer_strings(device) -> None:
    rng = np.random.default_rng(7)
    attrs = dict(
        mode="TF",
        min_gram_length=1,
        max_gram_length=2,
        max_skip_count=2,
        ngram_counts=[0, 2],
        ngram_indexes=[3, 0, 2, 1],
        pool_strings=["a", "b", "a", "b", "b", "b"],
    )
    x = rng.choice(np.array(["a", "b", "c"], dtype=object), (2, 9))
    node = helper.make_node("TfIdfVectorizer", ["x"], ["y"], **attrs)
    model = make_model([node], [_vi("x", TensorProto.STRING, [2, 9])], [_vi("y", F32)], opset=21, ms_opset=None)
    assert_parity(model, {"x": x}, device)
