"""Kernel registry: one entry per (domain, op type, first opset), looked up by the node's opset.

A kernel is a plain function ``fn(ctx, *inputs) -> value | tuple[value, ...]`` over torch tensors.
Missing optional inputs arrive as ``None``. Inputs listed in ``host_inputs`` carry shapes or
scalars that the kernel reads on the host (``ctx.ints(t)``); the executor keeps them there so
that shape arithmetic never waits on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KernelFn = Callable[..., Any]

DEFAULT_DOMAIN = ""
MS_DOMAIN = "com.microsoft"


def normalize_domain(domain: str) -> str:
    return DEFAULT_DOMAIN if domain in ("", "ai.onnx") else domain


@dataclass(frozen=True)
class KernelSpec:
    op_type: str
    domain: str
    since_version: int
    fn: KernelFn
    # None: the kernel may be recorded into a CUDA graph; otherwise the reason it may not be
    # (allocates by data, reads device data on the host, data-dependent output shape, ...).
    capture: str | None
    host_inputs: tuple[int, ...]
    family: str


_REGISTRY: dict[tuple[str, str], list[KernelSpec]] = {}


def kernel(
    op_type: str | tuple[str, ...],
    *,
    domain: str = DEFAULT_DOMAIN,
    since: int = 1,
    capture: str | None = None,
    host_inputs: tuple[int, ...] = (),
    family: str | None = None,
) -> Callable[[KernelFn], KernelFn]:
    """Register ``fn`` for one op type (or several sharing one implementation)."""

    names = (op_type,) if isinstance(op_type, str) else op_type

    def register(fn: KernelFn) -> KernelFn:
        fam = family or fn.__module__.rsplit(".", 1)[-1]
        for name in names:
            spec = KernelSpec(name, normalize_domain(domain), since, fn, capture, tuple(host_inputs), fam)
            entries = _REGISTRY.setdefault((spec.domain, name), [])
            entries[:] = [e for e in entries if e.since_version != since]
            entries.append(spec)
            entries.sort(key=lambda e: e.since_version)
        return fn

    return register


def lookup(domain: str, op_type: str, opset: int) -> KernelSpec | None:
    """The registration with the highest first-opset not above ``opset``."""
    entries = _REGISTRY.get((normalize_domain(domain), op_type))
    if not entries:
        return None
    chosen = None
    for entry in entries:
        if entry.since_version <= opset:
            chosen = entry
    return chosen


def registered_ops() -> dict[tuple[str, str], list[KernelSpec]]:
    load_all_kernels()
    return dict(_REGISTRY)


_LOADED = False


def load_all_kernels() -> None:
    """Import every kernel module once (each registers itself on import)."""
    global _LOADED
    if _LOADED:
        return
    import importlib
    import pkgutil

    from onnxgen.runtime import kernels

    for module in pkgutil.iter_modules(kernels.__path__):
        # triton_* modules hold Triton kernels (imported on use: triton may be absent)
        if module.name not in ("registry", "common") and not module.name.startswith("triton_"):
            importlib.import_module(f"onnxgen.runtime.kernels.{module.name}")
    _LOADED = True
