"""String ops over numpy object arrays (strings never go to the device; numeric outputs do)."""

from __future__ import annotations

import re

import numpy as np
import torch

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.registry import implements

HOST_STRINGS = "string tensors live on the host"


def _strings(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=object)


@implements("StringConcat", since=20, capture=HOST_STRINGS)
def string_concat(ctx: NodeContext, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    a, b = np.broadcast_arrays(_strings(x), _strings(y))
    out = np.empty(a.shape, dtype=object)
    for index in np.ndindex(a.shape):
        out[index] = str(a[index]) + str(b[index])
    return out


@implements("StringNormalizer", since=10, capture=HOST_STRINGS)
def string_normalizer(ctx: NodeContext, x: np.ndarray) -> np.ndarray:
    x = _strings(x)
    stopwords = list(ctx.attr("stopwords") or [])
    action = ctx.attr("case_change_action", "NONE")
    if ctx.attr("is_case_sensitive", 0):
        stop = set(stopwords)
        kept = [s for s in x.reshape(-1) if s not in stop]
    else:
        stop = {w.lower() for w in stopwords}
        kept = [s for s in x.reshape(-1) if s.lower() not in stop]
    if action == "LOWER":
        kept = [s.lower() for s in kept]
    elif action == "UPPER":
        kept = [s.upper() for s in kept]
    if not kept:  # all dropped: one empty string, in the input's rank
        kept = [""]
    out = np.array(kept, dtype=object)
    return out.reshape(1, -1) if x.ndim == 2 else out


@implements("StringSplit", since=20, capture=HOST_STRINGS)
def string_split(ctx: NodeContext, x: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    x = _strings(x)
    delimiter = ctx.attr("delimiter") or None  # unset or "": split on runs of whitespace, trimmed
    maxsplit = ctx.attr("maxsplit")
    limit = -1 if maxsplit is None else maxsplit
    # an empty string has no substrings (Python would give [""] for an explicit delimiter)
    pieces = [str(s).split(delimiter, limit) if s else [] for s in x.reshape(-1)]
    width = max((len(p) for p in pieces), default=0)
    out = np.full((len(pieces), width), "", dtype=object)
    for row, parts in enumerate(pieces):
        out[row, : len(parts)] = parts
    counts = torch.tensor([len(p) for p in pieces], dtype=torch.int64, device=ctx.device)
    return out.reshape((*x.shape, width)), counts.reshape(x.shape)


@implements("RegexFullMatch", since=20, capture=HOST_STRINGS)
def regex_full_match(ctx: NodeContext, x: np.ndarray) -> torch.Tensor:
    # Python's re accepts the RE2 subset these patterns use (classes, \b, groups, bounded repeats)
    pattern = re.compile(ctx.require("pattern"))
    x = _strings(x)
    hits = [pattern.fullmatch(str(s)) is not None for s in x.reshape(-1)]
    return torch.tensor(hits, dtype=torch.bool, device=ctx.device).reshape(x.shape)
