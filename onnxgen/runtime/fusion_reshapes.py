"""Reshape chains folded: Reshape(Reshape(x, s1), s2), the inner one read by the outer alone, as
Reshape(x, s2') with s2' the composed constant shape.

Why: a reshape of a strided view copies where the view's strides cannot express the new shape,
and the view's next reshape may give back a shape they could. Qwen3.5's gated attention writes
both: its query heads, a Split of the per-head [query | gate] projection (a view, every head at a
stride of two heads' width), are reshaped to [B, S, heads * d], which copies, and then at once back
to [B, S, heads, d] for the per-head norm, which the view already is. Folded, the norm reads the
view in place (gpu/rms_norm.py) and the copy kernel goes, in every decode step and prompt chunk.

s2' keeps s2's literal and -1 entries; a 0 of s2 (copy the inner output's dimension) becomes s1's
entry there when s1 gives a literal, stays 0 when s1 copies x's dimension too, and leaves the chain
alone when s1 infers it (-1). Both shapes must be constants and neither Reshape set allowzero.
The rewrite runs after every other one: their patterns read the Reshapes as the graph wrote them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxgen.runtime.fusion import DEFAULT_DOMAINS, node_attr
from onnxgen.runtime.fusion_hybrid import _new_name


def composed_shape(s1: list[int], s2: list[int]) -> list[int] | None:
    """The shape of Reshape(Reshape(x, s1), s2) as one Reshape of x (allowzero off), or None where a
    0 of s2 refers to a dimension s1 infers."""
    out = []
    for i, d in enumerate(s2):
        if d != 0:
            out.append(d)
        elif i >= len(s1) or s1[i] == -1:
            return None
        else:
            out.append(s1[i])  # 0: x's own dimension i, as the inner Reshape copied it
    return out


def _shape(rewriter: Any, name: str) -> list[int] | None:
    t = rewriter.scalars.get(name)
    if t is None or t.data_type != onnx.TensorProto.INT64 or len(t.dims) != 1:
        return None
    return [int(v) for v in numpy_helper.to_array(t)]


def _plain_reshape(node: onnx.NodeProto | None) -> bool:
    return (
        node is not None
        and node.op_type == "Reshape"
        and node.domain in DEFAULT_DOMAINS
        and len(node.input) == 2
        and not node_attr(node, "allowzero", 0)
    )


def fold_reshape_chains(rewriter: Any) -> int:
    count = 0
    while True:  # a chain of three folds in two rounds
        consumers = rewriter._consumers()
        index = {id(n): i for i, n in enumerate(rewriter.graph.node)}
        replace: dict[int, onnx.NodeProto | None] = {}  # by the node's index in the graph
        taken: set[int] = set()  # the nodes of this round's folds (a node folds once a round)
        for inner in rewriter.graph.node:
            if not _plain_reshape(inner) or id(inner) in taken:
                continue
            outer = rewriter._sole_consumer(inner.output[0], consumers)
            if not _plain_reshape(outer) or id(outer) in taken or outer.input[0] != inner.output[0]:
                continue
            s1, s2 = _shape(rewriter, inner.input[1]), _shape(rewriter, outer.input[1])
            shape = composed_shape(s1, s2) if s1 is not None and s2 is not None else None
            if shape is None:
                continue
            name = _new_name(rewriter, f"{outer.name}/folded_shape")
            const = numpy_helper.from_array(np.array(shape, np.int64), name)
            rewriter.graph.initializer.append(const)
            rewriter.inits[const.name] = rewriter.scalars[const.name] = const
            folded = helper.make_node("Reshape", [inner.input[0], const.name], [outer.output[0]],
                                      name=f"{outer.name or inner.name}/folded")  # fmt: skip
            replace[index[id(inner)]] = None
            replace[index[id(outer)]] = folded  # the outer one's place: x exists there
            taken.update((id(inner), id(outer)))
        if not replace:
            return count
        rewriter._apply(replace)
        count += len(replace) // 2
