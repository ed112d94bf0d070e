"""Constant (folded into initializers when the graph is compiled)."""

from __future__ import annotations

import numpy as np
import torch

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.registry import implements


@implements("Constant")
def constant(ctx: NodeContext) -> torch.Tensor | np.ndarray:
    attrs = ctx.attrs
    if "value" in attrs:
        return attrs["value"]
    if "sparse_value" in attrs:
        return attrs["sparse_value"]
    if "value_float" in attrs:
        return torch.tensor(attrs["value_float"], dtype=torch.float32)
    if "value_floats" in attrs:
        return torch.tensor(attrs["value_floats"], dtype=torch.float32)
    if "value_int" in attrs:
        return torch.tensor(attrs["value_int"], dtype=torch.int64)
    if "value_ints" in attrs:
        return torch.tensor(attrs["value_ints"], dtype=torch.int64)
    if "value_string" in attrs:
        return np.array(attrs["value_string"], dtype=object)
    if "value_strings" in attrs:
        return np.array(attrs["value_strings"], dtype=object)
    raise ctx.fail("Constant needs one of value, sparse_value, value_float(s), value_int(s), value_string(s)")
