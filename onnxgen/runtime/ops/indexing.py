"""Indexing ops: Concat, Split, Slice, Gather*, Scatter*, TopK, Pad, NonZero, Unique, DepthToSpace, ...

Outputs live on the input's device (see shape_ops for why). Index tensors may hold negative
indices (valid ones lie in [-n, n-1]). Out-of-range indices are refused (OpError naming the
node, the index and the range), as onnxruntime refuses them: one min/max reduction per index
tensor, read on the host. A CUDA stream that is being captured into a graph must not read device
values, so there the check is left out and the index is wrapped (memory stays safe); the ids a
captured decode step gathers are checked where they enter (the prompt), and sampled tokens are in
range by construction.
"""

from __future__ import annotations

import math

import torch

from onnxgen.errors import OpError
from onnxgen.runtime.gpu.launch import triton_serves
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.common import ints, normalize_axis
from onnxgen.runtime.ops.registry import implements

DATA_DEPENDENT = "data-dependent output shape"


def _may_read(indices: torch.Tensor) -> bool:
    """Whether the indices' values may be read on the host now (not while a CUDA graph records)."""
    return not (indices.is_cuda and torch.cuda.is_current_stream_capturing())


# up to this many CPU indices (a decode step's token ids, shape arithmetic) are read as a list:
# fewer dispatches than a reduction
_LIST_BOUNDS_MAX = 64


def _bounds(idx: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty index tensor, read on the host."""
    if idx.device.type == "cpu" and idx.numel() <= _LIST_BOUNDS_MAX:
        values = idx.reshape(-1).tolist()
        return min(values), max(values)
    lo, hi = torch.stack(torch.aminmax(idx)).tolist()
    return lo, hi


def _out_of_range(ctx: NodeContext, index: int, axis: int, size: int) -> OpError:
    return ctx.fail(
        f"index {index} is out of range for axis {axis} of size {size}; valid indices are [{-size}, {size - 1}]"
    )


def checked_indices(ctx: NodeContext, indices: torch.Tensor, size: int, axis: int) -> torch.Tensor:
    """``indices`` as int64 in [0, size), refused (OpError) where one lies outside [-size, size-1].

    Where the values may not be read (a CUDA graph recording) they are wrapped by a floor-mod
    instead, so that no access lands outside the axis."""
    idx = indices.to(torch.int64)
    if not idx.numel():
        return idx
    if _may_read(idx):
        lo, hi = _bounds(idx)
        if hi >= size or lo < -size:
            raise _out_of_range(ctx, hi if hi >= size else lo, axis, size)
        if lo >= 0:
            return idx
    return idx.remainder(size) if size else idx


def _check_columns(ctx: NodeContext, indices: torch.Tensor, dims: tuple[int, ...], first_axis: int) -> None:
    """GatherND/ScatterND: column j of the [..., k] indices addresses axis first_axis + j (of size
    dims[j]); one reduction over all columns, one host read."""
    k = indices.shape[-1]
    if not indices.numel() or not k or not _may_read(indices):
        return
    lo, hi = torch.aminmax(indices.reshape(-1, k).to(torch.int64), dim=0)
    los, his = torch.stack((lo, hi)).tolist()
    for j, (low, high, size) in enumerate(zip(los, his, dims)):
        if high >= size or low < -size:
            raise _out_of_range(ctx, high if high >= size else low, first_axis + j, size)


def _wrap(indices: torch.Tensor, size: int) -> torch.Tensor:
    """Indices in [-size, size) mapped to [0, size) by a floor-mod in one kernel (checked before, or
    not readable: then a floor-mod still keeps every access inside the axis)."""
    idx = indices.to(torch.int64)
    return idx.remainder(size) if size else idx


# -- Concat / Split ----------------------------------------------------------------------------


@implements("Concat", since=4)
def concat(ctx: NodeContext, *inputs: torch.Tensor) -> torch.Tensor:
    axis = normalize_axis(ctx.require("axis"), inputs[0].dim())
    return torch.cat(inputs, dim=axis)


def _split_sizes(ctx: NodeContext, total: int, split: list[int] | None) -> list[int]:
    if split:
        return split
    num = ctx.attr("num_outputs")
    if num is not None:  # opset 18: ceil-sized chunks, the last one smaller
        chunk = -(-total // num)
        return [min(chunk, max(total - i * chunk, 0)) for i in range(num)]
    parts = ctx.num_outputs
    if total % parts:
        raise ctx.fail(f"axis of size {total} cannot be split into {parts} equal parts")
    return [total // parts] * parts


def _split(ctx: NodeContext, x: torch.Tensor, split: list[int] | None) -> tuple[torch.Tensor, ...]:
    """Views of x, not copies: a split of a packed projection (q | k | v along the last axis) is rows
    at a uniform stride, which the row kernels and cuBLAS read in place; a consumer that needs
    contiguous memory makes it so itself (one copy there, as here before)."""
    axis = normalize_axis(ctx.attr("axis", 0), x.dim())
    sizes = _split_sizes(ctx, x.shape[axis], split)
    return tuple(torch.split(x, sizes, dim=axis))


@implements("Split", since=1)
def split_v1(ctx: NodeContext, x: torch.Tensor, sizes: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Opsets 1-12: sizes from the attribute (opset 1 also took them as a second input)."""
    return _split(ctx, x, ints(sizes) if sizes is not None else ctx.attr("split"))


@implements("Split", since=13, host_inputs=(1,))
def split(ctx: NodeContext, x: torch.Tensor, sizes: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    return _split(ctx, x, ints(sizes) if sizes is not None else None)


# -- Slice -------------------------------------------------------------------------------------


def _slice(x: torch.Tensor, starts: list[int], ends: list[int], axes: list[int] | None, steps: list[int] | None):
    axes = [normalize_axis(a, x.dim()) for a in axes] if axes else list(range(len(starts)))
    steps = steps or [1] * len(starts)
    out = x
    for start, end, axis, step in zip(starts, ends, axes, steps):
        dim = x.shape[axis]
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
            index = [slice(None)] * axis + [slice(start, end, step)]
            out = out[tuple(index)]
        else:  # torch slicing has no negative steps: gather the indices instead
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
            picks = torch.arange(start, end, step, device=x.device)
            out = out.index_select(axis, picks)
    return out.contiguous()


@implements("Slice")
def slice_v1(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    return _slice(x, list(ctx.require("starts")), list(ctx.require("ends")), ctx.attr("axes"), None)


@implements("Slice", since=10, host_inputs=(1, 2, 3, 4))
def slice_(
    ctx: NodeContext,
    x: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    axes: torch.Tensor | None = None,
    steps: torch.Tensor | None = None,
) -> torch.Tensor:
    axes_list = ints(axes) if axes is not None else None
    return _slice(x, ints(starts), ints(ends), axes_list, ints(steps) if steps is not None else None)


# -- Gather ------------------------------------------------------------------------------------


# a decode step's embedding lookup: a few rows of a table, as one Triton kernel (gpu/prelude.py)
_ROW_GATHER_MAX = 64


@implements("Gather")
def gather(ctx: NodeContext, data: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    axis = normalize_axis(ctx.attr("axis", 0), data.dim())
    if (
        axis == 0
        and data.dim() == 2
        and data.is_contiguous()
        and data.shape[0] > 0
        and indices.numel() <= _ROW_GATHER_MAX
        and indices.device == data.device
        and indices.dtype in (torch.int32, torch.int64)
        and data.dtype != torch.bool
        and triton_serves(data)
    ):
        from onnxgen.runtime.gpu.prelude import gather_rows

        checked_indices(ctx, indices, data.shape[0], 0)  # the kernel wraps; this refuses
        return gather_rows(data, indices).reshape((*indices.shape, data.shape[1]))
    idx = checked_indices(ctx, indices, data.shape[axis], axis)
    picked = data.index_select(axis, idx.reshape(-1))
    return picked.reshape((*data.shape[:axis], *indices.shape, *data.shape[axis + 1 :]))


@implements("GatherElements", since=11)
def gather_elements(ctx: NodeContext, data: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    axis = normalize_axis(ctx.attr("axis", 0), data.dim())
    return torch.gather(data, axis, checked_indices(ctx, indices, data.shape[axis], axis))


def _flat_index(data_shape: tuple[int, ...], indices: torch.Tensor) -> torch.Tensor:
    """Row-major linear index over the first k dims of ``data_shape`` (k = indices.shape[-1])."""
    k = indices.shape[-1]
    lin = torch.zeros(indices.shape[:-1], dtype=torch.int64, device=indices.device)
    for j in range(k):
        lin = lin * data_shape[j] + _wrap(indices[..., j], data_shape[j])
    return lin


@implements("GatherND", since=11)
def gather_nd(ctx: NodeContext, data: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    b = ctx.attr("batch_dims", 0)
    k = indices.shape[-1]
    batch = data.shape[:b]
    rest = data.shape[b + k :]
    nb = math.prod(batch)
    flat = data.reshape(nb, math.prod(data.shape[b : b + k]), *rest)
    idx = indices.reshape(nb, -1, k)
    _check_columns(ctx, idx, tuple(data.shape[b : b + k]), b)
    lin = _flat_index(tuple(data.shape[b : b + k]), idx)  # [nb, n]
    rows = torch.arange(nb, device=data.device).unsqueeze(1)
    picked = flat[rows, lin]  # [nb, n, *rest]
    return picked.reshape((*batch, *indices.shape[b:-1], *rest))


# -- Scatter -----------------------------------------------------------------------------------

_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _scatter_elements(ctx: NodeContext, data: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor):
    axis = normalize_axis(ctx.attr("axis", 0), data.dim())
    idx = checked_indices(ctx, indices, data.shape[axis], axis)
    reduction = ctx.attr("reduction", "none")
    if reduction == "none":
        return data.scatter(axis, idx, updates)
    return data.scatter_reduce(axis, idx, updates, reduce=_REDUCE[reduction], include_self=True)


@implements("Scatter", since=9)
def scatter(ctx: NodeContext, data: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    return _scatter_elements(ctx, data, indices, updates)


@implements("ScatterElements", since=11)
def scatter_elements(
    ctx: NodeContext, data: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor
) -> torch.Tensor:
    return _scatter_elements(ctx, data, indices, updates)


@implements("ScatterND", since=11)
def scatter_nd(ctx: NodeContext, data: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    k = indices.shape[-1]
    rows = math.prod(data.shape[:k])
    out = data.clone()
    flat = out.view(rows, -1)
    _check_columns(ctx, indices, tuple(data.shape[:k]), 0)
    lin = _flat_index(tuple(data.shape[:k]), indices).reshape(-1)
    upd = updates.reshape(lin.shape[0], -1)
    reduction = ctx.attr("reduction", "none")
    if reduction == "none":
        flat.index_copy_(0, lin, upd)
    elif reduction == "add":
        flat.index_add_(0, lin, upd)
    else:
        flat.scatter_reduce_(0, lin.unsqueeze(1).expand_as(upd), upd, reduce=_REDUCE[reduction], include_self=True)
    return out


@implements("TensorScatter", since=24)
def tensor_scatter(
    ctx: NodeContext, past: torch.Tensor, update: torch.Tensor, write_indices: torch.Tensor | None = None
) -> torch.Tensor:
    axis = normalize_axis(ctx.attr("axis", -2), past.dim())
    capacity, length = past.shape[axis], update.shape[axis]
    batch = past.shape[0]
    # position[b, s] = write_indices[b] + s, laid out along `axis` and broadcast over the rest
    view = [1] * past.dim()
    view[axis] = length
    pos = torch.arange(length, device=past.device).reshape(view)
    if write_indices is not None:
        bview = [1] * past.dim()
        bview[0] = batch
        pos = pos + write_indices.to(torch.int64).reshape(bview)
    if ctx.attr("mode", "linear") == "circular":
        pos = pos % capacity
    return past.scatter(axis, pos.expand(update.shape), update)


# -- data-dependent selections -----------------------------------------------------------------


@implements("Compress", since=9, capture=DATA_DEPENDENT)
def compress(ctx: NodeContext, x: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
    axis = ctx.attr("axis")
    if axis is None:
        x, axis = x.reshape(-1), 0
    axis = normalize_axis(axis, x.dim())
    keep = torch.nonzero(condition.reshape(-1).to(torch.bool)).reshape(-1)
    return x.index_select(axis, keep)


@implements("NonZero", since=9, capture=DATA_DEPENDENT)
def nonzero(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0:
        return torch.zeros((0, int(bool(x.item()))), dtype=torch.int64, device=x.device)
    return torch.nonzero(x).T.contiguous()


@implements("Unique", since=11, capture=DATA_DEPENDENT)
def unique(ctx: NodeContext, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    axis = ctx.attr("axis")
    if axis is None:
        flat, dim = x.reshape(-1), 0
    else:
        flat, dim = x, normalize_axis(axis, x.dim())
    values, inverse, counts = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True, dim=dim)
    n = flat.shape[dim]
    positions = torch.arange(n, device=x.device)
    first = torch.full((values.shape[dim],), n, dtype=torch.int64, device=x.device)
    first = first.scatter_reduce(0, inverse, positions, reduce="amin")
    if not ctx.attr("sorted", 1):  # order by first occurrence instead of by value
        order = torch.argsort(first)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel(), device=x.device)
        values, first, counts, inverse = values.index_select(dim, order), first[order], counts[order], rank[inverse]
    return values, first, inverse, counts


# -- TopK --------------------------------------------------------------------------------------

_SIGNED_VIEW = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def _topk(ctx: NodeContext, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    axis = normalize_axis(ctx.attr("axis", -1), x.dim())
    largest = bool(ctx.attr("largest", 1))
    keys, raw = x, x
    signed = _SIGNED_VIEW.get(x.dtype)
    if signed is not None:  # sort/gather lack unsigned wide ints: flip the sign bit to keep the order
        raw = x.view(signed)
        keys = raw ^ torch.iinfo(signed).min
    # a stable sort keeps equal values in index order: ties go to the lower index, as in onnxruntime
    _, order = torch.sort(keys, dim=axis, descending=largest, stable=True)
    order = order.narrow(axis, 0, k)
    values = torch.gather(raw, axis, order)
    return (values.view(x.dtype) if signed is not None else values), order


@implements("TopK")
def topk_v1(ctx: NodeContext, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _topk(ctx, x, ctx.require("k"))


@implements("TopK", since=10, host_inputs=(1,))
def topk(ctx: NodeContext, x: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _topk(ctx, x, ints(k)[0])


# -- Pad ---------------------------------------------------------------------------------------


def _pad_index(mode: str, size: int, before: int, after: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(-before, size + after, device=device)
    if mode == "edge":
        return i.clamp(0, size - 1)
    if mode == "wrap":
        return i.remainder(size)
    period = 2 * (size - 1)  # reflect without repeating the edge
    if period == 0:
        return torch.zeros_like(i)
    j = i.remainder(period)
    return torch.where(j >= size, period - j, j)


def _pad(
    ctx: NodeContext, x: torch.Tensor, pads: list[int], value: torch.Tensor | float, axes: list[int] | None
) -> torch.Tensor:
    mode = ctx.attr("mode", "constant")
    rank = x.dim()
    axes = [normalize_axis(a, rank) for a in axes] if axes else list(range(rank))
    n = len(axes)
    before = dict(zip(axes, pads[:n]))
    after = dict(zip(axes, pads[n:]))
    # negative pads crop first
    out = x
    for axis in axes:
        b, a = before[axis], after[axis]
        if b < 0 or a < 0:
            start = -b if b < 0 else 0
            stop = out.shape[axis] + (a if a < 0 else 0)
            out = out.narrow(axis, start, max(stop - start, 0))
    grow = {axis: (max(before[axis], 0), max(after[axis], 0)) for axis in axes}
    if mode == "constant":
        shape = [out.shape[d] + sum(grow.get(d, (0, 0))) for d in range(rank)]
        if isinstance(value, torch.Tensor):
            result = value.reshape(()).to(device=x.device, dtype=x.dtype).expand(shape).clone()
        else:
            result = torch.full(shape, value, dtype=x.dtype, device=x.device)
        inner = tuple(slice(grow.get(d, (0, 0))[0], grow.get(d, (0, 0))[0] + out.shape[d]) for d in range(rank))
        result[inner] = out
        return result
    for axis, (b, a) in grow.items():
        if b or a:
            out = out.index_select(axis, _pad_index(mode, out.shape[axis], b, a, x.device))
    return out.contiguous()


@implements("Pad", since=1)
def pad_v1(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    pads = ctx.attr("pads") or ctx.attr("paddings")
    return _pad(ctx, x, list(pads), float(ctx.attr("value", 0.0)), None)


@implements("Pad", since=11, host_inputs=(1, 3))
def pad(
    ctx: NodeContext,
    x: torch.Tensor,
    pads: torch.Tensor,
    constant_value: torch.Tensor | None = None,
    axes: torch.Tensor | None = None,
) -> torch.Tensor:
    value: torch.Tensor | float = constant_value if constant_value is not None else 0
    return _pad(ctx, x, ints(pads), value, ints(axes) if axes is not None else None)


@implements("CenterCropPad", since=18, host_inputs=(1,))
def center_crop_pad(ctx: NodeContext, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    dims = ints(target)
    axes = [normalize_axis(a, x.dim()) for a in ctx.attr("axes") or range(x.dim())]
    out = x
    for axis, want in zip(axes, dims):
        have = out.shape[axis]
        if want < have:  # crop window starts rounded down
            out = out.narrow(axis, (have - want) // 2, want)
        elif want > have:  # the odd extra pixel goes to the right
            before = (want - have) // 2
            shape = list(out.shape)
            shape[axis] = want
            padded = torch.zeros(shape, dtype=out.dtype, device=out.device)
            padded.narrow(axis, before, have).copy_(out)
            out = padded
    return out.contiguous()


# -- sequences in time / blocks in space -------------------------------------------------------


@implements("ReverseSequence", since=10)
def reverse_sequence(ctx: NodeContext, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    batch_axis = ctx.attr("batch_axis", 1)
    time_axis = ctx.attr("time_axis", 0)
    moved = x.movedim((batch_axis, time_axis), (0, 1))  # [B, T, ...]
    steps = moved.shape[1]
    t = torch.arange(steps, device=x.device).unsqueeze(0)
    lens = lengths.to(device=x.device, dtype=torch.int64).unsqueeze(1)
    source = torch.where(t < lens, lens - 1 - t, t)  # [B, T]
    source = source.reshape((*source.shape, *([1] * (moved.dim() - 2)))).expand(moved.shape)
    return torch.gather(moved, 1, source).movedim((0, 1), (batch_axis, time_axis)).contiguous()


@implements("DepthToSpace", since=1)
def depth_to_space(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    bs = ctx.require("blocksize")
    n, c, h, w = x.shape
    if ctx.attr("mode", "DCR") == "CRD":
        y = x.reshape(n, c // (bs * bs), bs, bs, h, w).permute(0, 1, 4, 2, 5, 3)
    else:
        y = x.reshape(n, bs, bs, c // (bs * bs), h, w).permute(0, 3, 4, 1, 5, 2)
    return y.reshape(n, c // (bs * bs), h * bs, w * bs).contiguous()


@implements("SpaceToDepth", since=1)
def space_to_depth(ctx: NodeContext, x: torch.Tensor) -> torch.Tensor:
    bs = ctx.require("blocksize")
    n, c, h, w = x.shape
    y = x.reshape(n, c, h // bs, bs, w // bs, bs)
    if ctx.attr("mode", "DCR") == "CRD":
        y = y.permute(0, 1, 3, 5, 2, 4)
    else:
        y = y.permute(0, 3, 5, 1, 2, 4)
    return y.reshape(n, c * bs * bs, h // bs, w // bs).contiguous()
