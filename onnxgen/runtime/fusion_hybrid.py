"""Rewrites of the small op chains around linear attention (Gated DeltaNet layers), from the graph's
structure alone.

- ``L2Normalize``: the per-head L2 norm of queries and keys, spelled

      s = ReduceSumSquare(x, axes=[last], keepdims=1);  y = Div(x, Sqrt(Add(s, eps)))

  (eps a float scalar constant, on either side of the Add) becomes ``L2Normalize(x)`` in the
  ``onnxgen`` domain, attribute ``epsilon``: x / sqrt(sum(x^2) + eps) over the last axis in fp32,
  rounded once (one kernel on a Triton device, gpu/l2_norm.py; the unfused ops round the sum and
  the root to x's type, so results move within that type's rounding). Reshapes around the chain
  stay: they are views.
- Key repeat: LinearAttention (com.microsoft) with more KV heads than query heads (inverse GQA,
  R = kv_num_heads / q_num_heads) whose keys arrive as

      Reshape(Tile(Reshape(k, [0, 0, q_num_heads, 1, d]), [1, 1, 1, R, 1]), [0, 0, kv_num_heads * d])

  (each key head repeated R times in place) reads ``k`` itself, reshaped to [0, 0, q_num_heads * d]:
  the op's keys packed per query head, which it shares as exactly that repeat (KV head h reads key
  head h / R). A Tile copy per layer is gone and nothing else changes: the values are identical.

Every intermediate value must be read by the chain alone (and be no graph output); otherwise the
chain stays as written.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxgen.runtime.fusion import DEFAULT_DOMAINS, FUSED_DOMAIN, node_attr

_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)


class _Chains:
    """Producer / sole-reader lookups over one graph, for the patterns above."""

    def __init__(self, rewriter: Any):
        self.rw = rewriter
        self.consumers = rewriter._consumers()
        self.producer = {o: n for n in rewriter.graph.node for o in n.output if o}

    def op(self, value: str, op_type: str, domains: tuple[str, ...] = DEFAULT_DOMAINS) -> onnx.NodeProto | None:
        """The node of ``op_type`` (in ``domains``) that makes ``value``, else None."""
        node = self.producer.get(value)
        if node is None or node.op_type != op_type or node.domain not in domains:
            return None
        return node

    def sole(self, value: str) -> onnx.NodeProto | None:
        return self.rw._sole_consumer(value, self.consumers)

    def ints(self, name: str) -> list[int] | None:
        t = self.rw.scalars.get(name)
        if t is None or t.data_type not in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
            return None
        return [int(v) for v in numpy_helper.to_array(t).reshape(-1)]

    def float_scalar(self, name: str) -> float | None:
        """The value of a one-element float constant of rank 0 or 1 (rank 1 never widens a broadcast)."""
        t = self.rw.scalars.get(name)
        if t is None or t.data_type not in _FLOATS or len(t.dims) > 1 or (t.dims and t.dims[0] != 1):
            return None
        return float(numpy_helper.to_array(t).reshape(-1)[0])


# -- L2Normalize -----------------------------------------------------------------------------


def _last_axis_only(chains: _Chains, reduce: onnx.NodeProto) -> bool:
    """ReduceSumSquare reduces the last axis alone, keeping it (as 1): axes [-1], or [rank - 1]
    where the input's rank is declared."""
    if int(node_attr(reduce, "keepdims", 1)) != 1:
        return False
    if len(reduce.input) > 1 and reduce.input[1]:
        axes = chains.ints(reduce.input[1])
    else:
        axes = node_attr(reduce, "axes")
        axes = [int(a) for a in axes] if axes is not None else None
    if axes is None or len(axes) != 1:
        return False
    if axes[0] == -1:
        return True
    rank = chains.rw._declared_rank(reduce.input[0])
    return rank is not None and axes[0] == rank - 1


def _match_l2(chains: _Chains, div: onnx.NodeProto) -> tuple[str, float, list[onnx.NodeProto]] | None:
    """(x, eps, the chain's nodes before the Div) when ``div`` ends an L2 norm of x."""
    if len(div.input) != 2:
        return None
    x, denominator = div.input
    sqrt = chains.op(denominator, "Sqrt")
    if sqrt is None or chains.sole(denominator) is not div:
        return None
    add = chains.op(sqrt.input[0], "Add")
    if add is None or len(add.input) != 2 or chains.sole(sqrt.input[0]) is not sqrt:
        return None
    for side in (0, 1):
        reduce = chains.op(add.input[side], "ReduceSumSquare")
        eps = chains.float_scalar(add.input[1 - side])
        if reduce is not None and eps is not None:
            break
    else:
        return None
    if chains.sole(reduce.output[0]) is not add or reduce.input[0] != x or not _last_axis_only(chains, reduce):
        return None
    return x, eps, [reduce, add, sqrt]


def fuse_l2_norms(rewriter: Any) -> int:
    chains = _Chains(rewriter)
    index = {id(n): i for i, n in enumerate(rewriter.graph.node)}
    replace: dict[int, onnx.NodeProto | None] = {}
    count = 0
    for div in rewriter.graph.node:
        if div.op_type != "Div" or div.domain not in DEFAULT_DOMAINS:
            continue
        found = _match_l2(chains, div)
        if found is None:
            continue
        x, eps, chain = found
        fused = helper.make_node(
            "L2Normalize", [x], [div.output[0]], name=f"{div.name or chain[0].name}/L2Normalize",
            domain=FUSED_DOMAIN, epsilon=eps,
        )  # fmt: skip
        for node in chain:
            replace[index[id(node)]] = None
        replace[index[id(div)]] = fused  # the Div's place: x exists there
        count += 1
    rewriter._apply(replace)
    return count


# -- the key repeat of inverse GQA -----------------------------------------------------------


def _repeated_keys(chains: _Chains, attention: onnx.NodeProto) -> tuple[str, int, list[onnx.NodeProto]] | None:
    """(k, per-head width d, the three repeat nodes) when ``attention``'s keys are k's heads repeated
    in place, as the op's packed keys would be."""
    hq, hkv = int(node_attr(attention, "q_num_heads", 0)), int(node_attr(attention, "kv_num_heads", 0))
    if len(attention.input) < 2 or hq <= 0 or hkv <= hq or hkv % hq:
        return None
    key = attention.input[1]
    outer = chains.op(key, "Reshape")
    if outer is None or chains.sole(key) is not attention:
        return None
    tile = chains.op(outer.input[0], "Tile")
    if tile is None or chains.sole(outer.input[0]) is not outer:
        return None
    inner = chains.op(tile.input[0], "Reshape")
    if inner is None or chains.sole(tile.input[0]) is not tile:
        return None
    if any(int(node_attr(r, "allowzero", 0)) for r in (outer, inner)):
        return None
    split = chains.ints(inner.input[1])
    if split is None or len(split) != 5 or split[:4] != [0, 0, hq, 1] or split[4] <= 0:
        return None
    d = split[4]
    if chains.ints(tile.input[1]) != [1, 1, 1, hkv // hq, 1] or chains.ints(outer.input[1]) not in (
        [0, 0, hkv * d], [0, 0, -1]
    ):  # fmt: skip
        return None
    return inner.input[0], d, [inner, tile, outer]


def _new_name(rewriter: Any, base: str) -> str:
    taken = set(rewriter.inits) | {o for n in rewriter.graph.node for o in n.output}
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    return name


def elide_key_repeats(rewriter: Any) -> int:
    chains = _Chains(rewriter)
    index = {id(n): i for i, n in enumerate(rewriter.graph.node)}
    replace: dict[int, onnx.NodeProto | None] = {}
    count = 0
    for attention in rewriter.graph.node:
        if attention.op_type != "LinearAttention" or attention.domain != "com.microsoft":
            continue
        found = _repeated_keys(chains, attention)
        if found is None:
            continue
        k, d, (inner, tile, outer) = found
        hq = int(node_attr(attention, "q_num_heads"))
        shape = numpy_helper.from_array(
            np.array([0, 0, hq * d], np.int64), _new_name(rewriter, f"{attention.name}/packed_keys_shape")
        )
        rewriter.graph.initializer.append(shape)
        rewriter.inits[shape.name] = rewriter.scalars[shape.name] = shape
        # a new value name: the repeated keys' declared shape (value_info) does not describe these
        packed_name = _new_name(rewriter, f"{outer.output[0]}/packed")
        packed = helper.make_node("Reshape", [k, shape.name], [packed_name], name=f"{outer.name}/packed_keys")
        attention.input[1] = packed_name
        replace[index[id(inner)]] = packed  # k exists there, before the attention
        replace[index[id(tile)]] = None
        replace[index[id(outer)]] = None
        count += 1
    rewriter._apply(replace)
    return count
