"""Reductions (ReduceSum ... ReduceSumSquare), ArgMax/ArgMin, CumSum/CumProd.

Axes come from the ``axes`` attribute in old opsets (ReduceSum < 13, the others < 18) and from a
host input afterwards. Reductions over a zero-sized axis yield the identity of the operation
(0, 1, -inf, +inf, ...), as the spec asks; torch raises for some of them, so those are built by hand.
Half-precision sums/means accumulate in fp32 inside torch (as onnxruntime's CPU kernels do);
ops that square or exponentiate compute in fp32 and round once at the end.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.common import ints, normalize_axis
from onnxgen.runtime.ops.registry import implements

_HALF = (torch.float16, torch.bfloat16)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """A dtype in which squares/exps/logs are computed: fp32 for halves, fp64 for integers."""
    if x.dtype in _HALF:
        return x.float()
    if not x.is_floating_point():
        return x.double()
    return x


def _back(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if y.dtype == dtype:
        return y
    if not dtype.is_floating_point and y.is_floating_point():
        y = torch.trunc(y)  # C++ float -> int conversion truncates; so does onnxruntime
    return y.to(dtype)


def _lowest(dtype: torch.dtype) -> float | int | bool:
    if dtype == torch.bool:
        return False
    if dtype.is_floating_point:
        return float("-inf")
    return torch.iinfo(dtype).min


def _highest(dtype: torch.dtype) -> float | int | bool:
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point:
        return float("inf")
    return torch.iinfo(dtype).max


def _reduced_shape(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> list[int]:
    if keepdim:
        return [1 if i in dims else s for i, s in enumerate(x.shape)]
    return [s for i, s in enumerate(x.shape) if i not in dims]


def _empty_over(x: torch.Tensor, dims: tuple[int, ...]) -> bool:
    return any(x.shape[d] == 0 for d in dims)


def _sum(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    return torch.sum(x, dim=dims, keepdim=keepdim, dtype=x.dtype)


def _mean(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    count = 1
    for d in dims:
        count *= x.shape[d]
    if count == 0:  # the spec leaves it undefined; onnxruntime gives 0, not NaN
        return torch.zeros(_reduced_shape(x, dims, keepdim), dtype=x.dtype, device=x.device)
    if x.is_floating_point():
        return torch.mean(x, dim=dims, keepdim=keepdim)
    total = torch.sum(x, dim=dims, keepdim=keepdim, dtype=torch.int64)
    return torch.div(total, count, rounding_mode="trunc").to(x.dtype)  # C++ integer division


def _prod(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    # torch.prod takes one dim at a time; reduce from the last so earlier indices stay valid
    y = x
    for d in sorted(dims, reverse=True):
        y = torch.prod(y, dim=d, keepdim=keepdim, dtype=x.dtype)
    return y


def _extreme(largest: bool) -> Callable[[torch.Tensor, tuple[int, ...], bool], torch.Tensor]:
    def reduce(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
        if _empty_over(x, dims):
            fill = _lowest(x.dtype) if largest else _highest(x.dtype)
            return torch.full(_reduced_shape(x, dims, keepdim), fill, dtype=x.dtype, device=x.device)
        return (torch.amax if largest else torch.amin)(x, dim=dims, keepdim=keepdim)

    return reduce


def _l1(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    return torch.sum(torch.abs(x), dim=dims, keepdim=keepdim, dtype=x.dtype)


def _l2(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    w = _wide(x)
    return _back(torch.sqrt(torch.sum(w * w, dim=dims, keepdim=keepdim)), x.dtype)


def _sum_square(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    if not x.is_floating_point():
        return torch.sum(x * x, dim=dims, keepdim=keepdim, dtype=x.dtype)
    w = _wide(x)
    return _back(torch.sum(w * w, dim=dims, keepdim=keepdim), x.dtype)


def _log_sum(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    w = _wide(x)
    return _back(torch.log(torch.sum(w, dim=dims, keepdim=keepdim)), x.dtype)


def _log_sum_exp(x: torch.Tensor, dims: tuple[int, ...], keepdim: bool) -> torch.Tensor:
    # torch.logsumexp subtracts the max first, so large inputs do not overflow; -inf over empty sets
    return _back(torch.logsumexp(_wide(x), dim=dims, keepdim=keepdim), x.dtype)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _square(x: torch.Tensor) -> torch.Tensor:
    return x * x


def _log(x: torch.Tensor) -> torch.Tensor:
    return _back(torch.log(_wide(x)), x.dtype)


# op -> (reduction over a non-empty tuple of dims, elementwise part kept by noop_with_empty_axes)
_REDUCERS: dict[str, tuple[Callable[[torch.Tensor, tuple[int, ...], bool], torch.Tensor], Callable]] = {
    "ReduceSum": (_sum, _identity),
    "ReduceMean": (_mean, _identity),
    "ReduceProd": (_prod, _identity),
    "ReduceMax": (_extreme(True), _identity),
    "ReduceMin": (_extreme(False), _identity),
    "ReduceL1": (_l1, torch.abs),
    "ReduceL2": (_l2, torch.abs),
    "ReduceSumSquare": (_sum_square, _square),
    "ReduceLogSum": (_log_sum, _log),
    "ReduceLogSumExp": (_log_sum_exp, _identity),
}


def _reduce(ctx: NodeContext, x: torch.Tensor, axes: list[int] | None, noop_if_empty: bool) -> torch.Tensor:
    reduce, elementwise = _REDUCERS[ctx.op_type]
    keepdim = bool(ctx.attr("keepdims", 1))
    if not axes:
        if noop_if_empty:
            return elementwise(x)
        dims = tuple(range(x.dim()))
    else:
        dims = tuple(sorted({normalize_axis(a, x.dim()) for a in axes}))
    if not dims:  # rank-0 input: reducing "all axes" leaves the single value
        return reduce(x.reshape(1), (0,), False).reshape(())
    return reduce(x, dims, keepdim)


_REDUCE_OPS = tuple(_REDUCERS)


@implements(_REDUCE_OPS, since=1)
def reduce_attr_axes(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    axes = ctx.attr("axes")
    return _reduce(ctx, x, list(axes) if axes is not None else None, noop_if_empty=False)


def reduce_input_axes(ctx: NodeContext, x: torch.Tensor, axes: torch.Tensor | None = None) -> torch.Tensor:
    return _reduce(ctx, x, ints(axes), noop_if_empty=bool(ctx.attr("noop_with_empty_axes", 0)))


# ReduceSum took axes as an input from opset 13, the others from opset 18.
implements("ReduceSum", since=13, host_inputs=(1,))(reduce_input_axes)
implements(tuple(op for op in _REDUCE_OPS if op != "ReduceSum"), since=18, host_inputs=(1,))(reduce_input_axes)


# -- ArgMax / ArgMin -------------------------------------------------------------------------


@implements(("ArgMax", "ArgMin"), since=1)
def arg_extreme(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    axis = normalize_axis(ctx.attr("axis", 0), x.dim())
    keepdim = bool(ctx.attr("keepdims", 1))
    find = torch.argmax if ctx.op_type == "ArgMax" else torch.argmin
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    if x.dim() == 0:
        return torch.zeros((), dtype=torch.int64, device=x.device)
    if ctx.attr("select_last_index", 0):
        # torch returns the first extreme; search the reversed axis and map the index back
        index = find(x.flip(axis), dim=axis, keepdim=keepdim)
        return (x.shape[axis] - 1) - index
    return find(x, dim=axis, keepdim=keepdim)


# -- CumSum / CumProd ------------------------------------------------------------------------


@implements("CumProd", since=26, host_inputs=(1,))
@implements("CumSum", since=11, host_inputs=(1,))
def cumulative(ctx: NodeContext, x: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    dim = normalize_axis(ints(axis)[0], x.dim())
    reverse = bool(ctx.attr("reverse", 0))
    scan = torch.cumsum if ctx.op_type == "CumSum" else torch.cumprod
    if reverse:
        x = x.flip(dim)
    y = scan(x, dim=dim, dtype=x.dtype)
    n = x.shape[dim]
    if ctx.attr("exclusive", 0) and n > 0:
        # shift by one along the axis and put the identity (0 or 1) first; no subtraction/division
        first_shape = list(x.shape)
        first_shape[dim] = 1
        fill = 0 if ctx.op_type == "CumSum" else 1
        first = torch.full(first_shape, fill, dtype=x.dtype, device=x.device)
        y = torch.cat([first, y.narrow(dim, 0, n - 1)], dim=dim)
    if reverse:
        y = y.flip(dim)
    return y
