"""Tensor generators: window functions and random ops.

Random ops draw from a torch.Generator owned by the node (seeded from the ``seed`` attribute when
given, so a session is reproducible run to run, like onnxruntime's per-kernel generator). The
draws cannot match onnxruntime's bit for bit; only their distribution is comparable.
"""

from __future__ import annotations

import math
import struct

import torch

from onnxgen.runtime.dtypes import torch_dtype
from onnxgen.runtime.node_contract import NodeContext
from onnxgen.runtime.ops.common import ints
from onnxgen.runtime.ops.registry import implements

HOST_RNG = "host RNG state"


# -- windows -----------------------------------------------------------------------------------


def _window(ctx: NodeContext, size: torch.Tensor, terms: tuple[float, ...]) -> torch.Tensor:
    """sum_j (-1)^j a_j cos(2 pi j n / N), N = size (periodic) or size - 1 (symmetric)."""
    n = ints(size)[0]
    denom = n if ctx.attr("periodic", 1) else n - 1
    # built on the device from host scalars only, so it records into a CUDA graph
    k = torch.arange(n, dtype=torch.float64, device=ctx.device)
    out = torch.zeros(n, dtype=torch.float64, device=ctx.device)
    for j, a in enumerate(terms):
        phase = 2 * math.pi * j * k / denom if denom else torch.zeros_like(k)
        out = out + (-1) ** j * a * torch.cos(phase)
    return out.to(torch_dtype(ctx.attr("output_datatype", 1)))


@implements("HannWindow", since=17, host_inputs=(0,))
def hann_window(ctx: NodeContext, size: torch.Tensor) -> torch.Tensor:
    return _window(ctx, size, (0.5, 0.5))


@implements("HammingWindow", since=17, host_inputs=(0,))
def hamming_window(ctx: NodeContext, size: torch.Tensor) -> torch.Tensor:
    return _window(ctx, size, (25 / 46, 21 / 46))


@implements("BlackmanWindow", since=17, host_inputs=(0,))
def blackman_window(ctx: NodeContext, size: torch.Tensor) -> torch.Tensor:
    return _window(ctx, size, (0.42, 0.5, 0.08))


# -- random ------------------------------------------------------------------------------------


def _generator(ctx: NodeContext, device: torch.device) -> torch.Generator:
    """The node's own generator, created on first use (seeded if the node says so)."""
    gen = getattr(ctx, "_rng", None)
    if gen is None or gen.device.type != device.type:  # "cuda" and "cuda:0" are one device here
        gen = torch.Generator(device=device)
        seed = ctx.attr("seed")
        if seed is not None:
            # the attribute is a float: its bit pattern keeps seeds like 0.5 and 0.25 apart
            gen.manual_seed(struct.unpack("<I", struct.pack("<f", float(seed)))[0])
        else:
            gen.seed()
        ctx._rng = gen  # type: ignore[attr-defined]
    return gen


def _like_dtype(ctx: NodeContext, like: torch.Tensor) -> torch.dtype:
    dtype = ctx.attr("dtype")
    return torch_dtype(dtype) if dtype is not None else like.dtype


def _uniform(ctx: NodeContext, shape: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    low, high = ctx.attr("low", 0.0), ctx.attr("high", 1.0)
    out = torch.rand(shape, generator=_generator(ctx, device), dtype=torch.float32, device=device)
    return (out * (high - low) + low).to(dtype)


def _normal(ctx: NodeContext, shape: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    mean, scale = ctx.attr("mean", 0.0), ctx.attr("scale", 1.0)
    out = torch.randn(shape, generator=_generator(ctx, device), dtype=torch.float32, device=device)
    return (out * scale + mean).to(dtype)


@implements("RandomUniform", capture=HOST_RNG)
def random_uniform(ctx: NodeContext) -> torch.Tensor:
    return _uniform(ctx, list(ctx.require("shape")), torch_dtype(ctx.attr("dtype", 1)), ctx.device)


@implements("RandomNormal", capture=HOST_RNG)
def random_normal(ctx: NodeContext) -> torch.Tensor:
    return _normal(ctx, list(ctx.require("shape")), torch_dtype(ctx.attr("dtype", 1)), ctx.device)


@implements("RandomUniformLike", capture=HOST_RNG)
def random_uniform_like(ctx: NodeContext, like: torch.Tensor) -> torch.Tensor:
    return _uniform(ctx, list(like.shape), _like_dtype(ctx, like), like.device)


@implements("RandomNormalLike", capture=HOST_RNG)
def random_normal_like(ctx: NodeContext, like: torch.Tensor) -> torch.Tensor:
    return _normal(ctx, list(like.shape), _like_dtype(ctx, like), like.device)


@implements("Bernoulli", since=15, capture=HOST_RNG)
def bernoulli(ctx: NodeContext, p: torch.Tensor) -> torch.Tensor:
    draws = torch.bernoulli(p.to(torch.float32), generator=_generator(ctx, p.device))
    return draws.to(_like_dtype(ctx, p))


@implements("Multinomial", since=7, capture=HOST_RNG)
def multinomial(ctx: NodeContext, logits: torch.Tensor) -> torch.Tensor:
    """Input rows are unnormalized log-probabilities; draws are with replacement."""
    probs = torch.softmax(logits.to(torch.float32), dim=-1)
    samples = torch.multinomial(
        probs, ctx.attr("sample_size", 1), replacement=True, generator=_generator(ctx, logits.device)
    )
    return samples.to(torch_dtype(ctx.attr("dtype", 6)))
