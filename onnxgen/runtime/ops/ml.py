"""Classic-ML ops: ai.onnx.ml LabelEncoder, Binarizer, ArrayFeatureExtractor, TreeEnsemble and
the default-domain TfIdfVectorizer.

Numeric work stays in torch on the node's device. Lookups keyed by strings, or by arbitrary
values through a Python dict (LabelEncoder, TfIdfVectorizer), run on the host.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.registry import implements

ML = "ai.onnx.ml"
HOST_LOOKUP = "dictionary lookup on the host"


def _as_list(value: Any) -> list[Any]:
    """An attribute (list, torch tensor or numpy array) as a flat Python list; bytes decoded."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).tolist()
    if isinstance(value, np.ndarray):
        value = value.reshape(-1).tolist()
    return [v.decode("utf-8") if isinstance(v, bytes) else v for v in value]


def _host_items(x: torch.Tensor | np.ndarray) -> tuple[list[Any], tuple[int, ...]]:
    if isinstance(x, torch.Tensor):
        return x.reshape(-1).cpu().tolist(), tuple(x.shape)
    arr = np.asarray(x, dtype=object)
    return [v.decode("utf-8") if isinstance(v, bytes) else v for v in arr.reshape(-1)], arr.shape


# ---------------------------------------------------------------- LabelEncoder


def _label_values(ctx: NodeContext) -> tuple[list[Any], Any, torch.dtype | None]:
    """(values, default, torch dtype or None for strings) from whichever values_* is set."""
    if ctx.attr("values_tensor") is not None:
        values = ctx.attr("values_tensor")
        default = ctx.attr("default_tensor")
        if isinstance(values, np.ndarray):  # strings
            fallback = _as_list(default)[0] if default is not None else "_Unused"
            return _as_list(values), fallback, None
        if default is not None:
            fallback = _as_list(default)[0]
        else:
            fallback = -0.0 if values.dtype.is_floating_point else -1
        return _as_list(values), fallback, values.dtype
    if ctx.attr("values_strings") is not None:
        return _as_list(ctx.attr("values_strings")), ctx.attr("default_string", "_Unused"), None
    if ctx.attr("values_int64s") is not None:
        return _as_list(ctx.attr("values_int64s")), ctx.attr("default_int64", -1), torch.int64
    if ctx.attr("values_floats") is not None:
        return _as_list(ctx.attr("values_floats")), ctx.attr("default_float", -0.0), torch.float32
    raise ctx.fail("needs one of values_tensor, values_strings, values_int64s, values_floats")


def _label_keys(ctx: NodeContext) -> list[Any]:
    for name in ("keys_tensor", "keys_strings", "keys_int64s", "keys_floats"):
        if ctx.attr(name) is not None:
            return _as_list(ctx.attr(name))
    raise ctx.fail("needs one of keys_tensor, keys_strings, keys_int64s, keys_floats")


@implements("LabelEncoder", domain=ML, since=1, capture=HOST_LOOKUP)
def label_encoder(ctx: NodeContext, x: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
    keys = _label_keys(ctx)
    values, default, out_dtype = _label_values(ctx)
    if len(keys) != len(values):
        raise ctx.fail(f"{len(keys)} keys but {len(values)} values")
    table = dict(zip(keys, values))
    # NaN never equals itself: a NaN key maps every NaN input
    nan_value = next((v for k, v in zip(keys, values) if isinstance(k, float) and math.isnan(k)), default)
    items, shape = _host_items(x)
    mapped = [nan_value if isinstance(v, float) and math.isnan(v) else table.get(v, default) for v in items]
    if out_dtype is None:
        out = np.empty(len(mapped), dtype=object)
        out[:] = mapped
        return out.reshape(shape)
    return torch.tensor(mapped, dtype=out_dtype, device=ctx.device).reshape(shape)


# ---------------------------------------------------------------- Binarizer, ArrayFeatureExtractor


@implements("Binarizer", domain=ML, since=1)
def binarizer(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    return (x > ctx.attr("threshold", 0.0)).to(x.dtype)


# declines capture as a whole: for string data the indices are read on the host
@implements("ArrayFeatureExtractor", domain=ML, since=1, capture="indexes string data on the host")
def array_feature_extractor(
    ctx: NodeContext, data: torch.Tensor | np.ndarray, indices: torch.Tensor
) -> torch.Tensor | np.ndarray:
    # selects along the last axis; a 1-D input gives one row (as onnxruntime does)
    count = indices.numel()
    lead = (1,) if data.ndim == 1 else tuple(data.shape[:-1])
    if isinstance(data, np.ndarray):
        return data[..., indices.reshape(-1).cpu().numpy()].reshape(*lead, count)
    picked = data.index_select(data.dim() - 1, indices.reshape(-1).to(data.device, torch.int64))
    return picked.reshape(*lead, count)


# ---------------------------------------------------------------- TreeEnsemble

_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)
_AVERAGE, _SUM, _MIN, _MAX = range(4)


def _max_depth(
    roots: list[int], true_ids: list[int], false_ids: list[int], true_leaf: list[int], false_leaf: list[int]
) -> int:
    """Longest root-to-leaf path in branch nodes (host, from attributes only)."""
    depth = 0
    for root in roots:
        stack = [(root, 1)]
        while stack:
            node, d = stack.pop()
            depth = max(depth, d)
            if d > len(true_ids):
                raise ValueError("TreeEnsemble nodes form a cycle")
            for child, is_leaf in ((true_ids[node], true_leaf[node]), (false_ids[node], false_leaf[node])):
                if not is_leaf:
                    stack.append((child, d + 1))
    return depth


def _post_transform(scores: torch.Tensor, kind: int) -> torch.Tensor:
    if kind == 1:  # SOFTMAX
        return torch.softmax(scores, dim=-1)
    if kind == 2:  # LOGISTIC
        return torch.sigmoid(scores)
    if kind == 3:  # SOFTMAX_ZERO: softmax over the non-zero scores, zeros stay zero
        nonzero = scores != 0
        exp = torch.where(nonzero, torch.exp(scores - scores.amax(dim=-1, keepdim=True)), 0)
        return exp / exp.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)
    if kind == 4:  # PROBIT
        return math.sqrt(2.0) * torch.erfinv(2 * scores - 1)
    return scores


# The walk itself is device code with a fixed trip count, but the node tables are copied from
# host lists on every call, which a CUDA graph cannot record.
@implements("TreeEnsemble", domain=ML, since=5, capture="copies host tables to the device per call")
def tree_ensemble(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    modes = _as_list(ctx.require("nodes_modes"))
    features = _as_list(ctx.require("nodes_featureids"))
    true_ids = _as_list(ctx.require("nodes_truenodeids"))
    false_ids = _as_list(ctx.require("nodes_falsenodeids"))
    true_leaf = _as_list(ctx.require("nodes_trueleafs"))
    false_leaf = _as_list(ctx.require("nodes_falseleafs"))
    roots = _as_list(ctx.require("tree_roots"))
    n_targets = int(ctx.require("n_targets"))
    aggregate = int(ctx.attr("aggregate_function", _SUM))
    dev, dt = x.device, x.dtype

    def tensor(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=dev)

    splits = ctx.require("nodes_splits").reshape(-1).to(dev, dt)
    missing = _as_list(ctx.attr("nodes_missing_value_tracks_true")) or [0] * len(modes)
    # set-membership nodes, in node order, each read from the NaN-separated membership_values
    members_flat = _as_list(ctx.attr("membership_values"))
    sets: list[list[float]] = [[] for _ in modes]
    cursor = 0
    for node, mode in enumerate(modes):
        if mode == _MEMBER:
            while cursor < len(members_flat) and not math.isnan(members_flat[cursor]):
                sets[node].append(members_flat[cursor])
                cursor += 1
            cursor += 1
    width = max((len(s) for s in sets), default=0) or 1
    members = tensor([s + [math.nan] * (width - len(s)) for s in sets], dt)  # NaN pads never match

    # walk every (sample, tree) pair in lockstep for the deepest tree's depth: a fixed trip count
    # from the attributes, so no host read of the data
    depth = _max_depth(roots, true_ids, false_ids, true_leaf, false_leaf)
    n = x.shape[0]
    node = tensor(roots, torch.int64).expand(n, -1).clone()
    done = torch.zeros_like(node, dtype=torch.bool)
    t_mode, t_feat = tensor(modes, torch.int64), tensor(features, torch.int64)
    t_true, t_false = tensor(true_ids, torch.int64), tensor(false_ids, torch.int64)
    t_tleaf, t_fleaf = tensor(true_leaf, torch.bool), tensor(false_leaf, torch.bool)
    t_missing = tensor(missing, torch.bool)
    rows = torch.arange(n, device=dev).unsqueeze(1)
    for _ in range(depth):
        at = torch.where(done, 0, node)  # finished walks hold a leaf index: read any branch node
        value = x[rows, t_feat[at]]
        split, mode = splits[at], t_mode[at]
        outcomes = torch.stack(
            [
                value <= split,
                value < split,
                value >= split,
                value > split,
                value == split,
                value != split,
                (value.unsqueeze(-1) == members[at]).any(-1),
            ],
            dim=-1,
        )
        go_true = outcomes.gather(-1, mode.unsqueeze(-1)).squeeze(-1) | (t_missing[at] & value.isnan())
        nxt = torch.where(go_true, t_true[at], t_false[at])
        leaf = torch.where(go_true, t_tleaf[at], t_fleaf[at])
        node = torch.where(done, node, nxt)
        done = done | leaf
    weights = ctx.require("leaf_weights").reshape(-1).to(dev, dt)[node]
    targets = tensor(_as_list(ctx.require("leaf_targetids")), torch.int64)[node]
    if aggregate in (_SUM, _AVERAGE):
        out = torch.zeros(n, n_targets, dtype=dt, device=dev).scatter_add_(1, targets, weights)
        if aggregate == _AVERAGE:
            out = out / len(roots)
    elif aggregate in (_MIN, _MAX):
        start = torch.finfo(dt).max if aggregate == _MIN else torch.finfo(dt).min
        out = torch.full((n, n_targets), start, dtype=dt, device=dev)
        out = out.scatter_reduce(1, targets, weights, "amin" if aggregate == _MIN else "amax")
        # a target no tree reached scores 0, as in onnxruntime (onnx's reference leaves the sentinel)
        hit = torch.zeros_like(out, dtype=torch.bool).scatter_(1, targets, True)
        out = torch.where(hit, out, 0)
    else:
        raise ctx.fail(f"unknown aggregate_function {aggregate}")
    return _post_transform(out, int(ctx.attr("post_transform", 0)))


# ---------------------------------------------------------------- TfIdfVectorizer


def _ngram_table(ctx: NodeContext) -> dict[tuple[Any, ...], int]:
    """Every pooled n-gram (as a tuple) -> its output column."""
    pool = _as_list(ctx.attr("pool_int64s")) or _as_list(ctx.attr("pool_strings"))
    starts = _as_list(ctx.require("ngram_counts"))
    columns = _as_list(ctx.require("ngram_indexes"))
    table: dict[tuple[Any, ...], int] = {}
    ngram_id = 0  # n-grams are numbered across all sizes, in pool order
    for size_minus_one, start in enumerate(starts):
        size = size_minus_one + 1
        end = starts[size_minus_one + 1] if size < len(starts) else len(pool)
        for offset in range(start, end - size + 1, size):
            table.setdefault(tuple(pool[offset : offset + size]), columns[ngram_id])
            ngram_id += 1
    return table


@implements("TfIdfVectorizer", since=9, capture=HOST_LOOKUP)
def tfidf_vectorizer(ctx: NodeContext, x: torch.Tensor | np.ndarray) -> torch.Tensor:
    lo, hi = int(ctx.require("min_gram_length")), int(ctx.require("max_gram_length"))
    max_skip = int(ctx.require("max_skip_count"))
    mode = ctx.require("mode")
    table = {k: v for k, v in _ngram_table(ctx).items() if lo <= len(k) <= hi}
    width = max(_as_list(ctx.require("ngram_indexes")), default=-1) + 1
    items, shape = _host_items(x)
    if len(shape) > 2:
        raise ctx.fail(f"input must be [C] or [B, C], got {list(shape)}")
    n_rows = shape[0] if len(shape) == 2 else 1
    n_cols = shape[-1] if shape else 1
    counts = np.zeros((n_rows, width), dtype=np.float32)
    for r in range(n_rows):
        row = items[r * n_cols : (r + 1) * n_cols]
        for size in range(lo, hi + 1):
            # unigrams do not depend on the skip, so they are counted once
            for step in range(1, (1 if size == 1 else max_skip + 1) + 1):
                for start in range(n_cols - (size - 1) * step):
                    column = table.get(tuple(row[start : start + (size - 1) * step + 1 : step]))
                    if column is not None:
                        counts[r, column] += 1
    # weights[i] belongs to the i-th pooled n-gram (the spec's wording, and onnxruntime), whose
    # column is ngram_indexes[i]; onnx's reference evaluator indexes them by column instead
    weights = _as_list(ctx.attr("weights"))
    column_weight = np.ones(width, dtype=np.float32)
    for ngram, column in enumerate(_as_list(ctx.require("ngram_indexes"))[: len(weights)]):
        column_weight[column] = weights[ngram]
    if mode == "IDF":
        counts = np.where(counts > 0, column_weight, 0.0).astype(np.float32)
    elif mode == "TFIDF":
        counts = counts * column_weight
    elif mode not in ("TF", "TFIDF"):
        raise ctx.fail(f"unknown mode {mode!r}")
    out = torch.from_numpy(counts).to(ctx.device)
    return out if len(shape) == 2 else out.reshape(width)
