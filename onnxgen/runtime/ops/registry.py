"""Op registry: one implementation per (domain, op type, first opset), looked up by the node's opset.

An op implementation is a plain function ``fn(ctx, *inputs) -> value | tuple[value, ...]`` over
torch tensors (``ctx``: ``node_contract.NodeContext``). Missing optional inputs arrive as ``None``.
Inputs listed in ``host_inputs`` carry shapes or scalars that the implementation reads on the host
(``ctx.ints(t)``); the executor keeps them there so that shape arithmetic never waits on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OpFn = Callable[..., Any]

DEFAULT_DOMAIN = ""
MS_DOMAIN = "com.microsoft"


def normalize_domain(domain: str) -> str:
    return DEFAULT_DOMAIN if domain in ("", "ai.onnx") else domain


@dataclass(frozen=True)
class OpImpl:
    op_type: str
    domain: str
    since_version: int
    fn: OpFn
    # None: the op may be recorded into a CUDA graph; otherwise the reason it may not be
    # (allocates by data, reads device data on the host, data-dependent output shape, ...).
    capture: str | None
    host_inputs: tuple[int, ...]
    family: str


_REGISTRY: dict[tuple[str, str], list[OpImpl]] = {}


def implements(
    op_type: str | tuple[str, ...],
    *,
    domain: str = DEFAULT_DOMAIN,
    since: int = 1,
    capture: str | None = None,
    host_inputs: tuple[int, ...] = (),
    family: str | None = None,
) -> Callable[[OpFn], OpFn]:
    """Register ``fn`` for one op type (or several sharing one implementation)."""

    names = (op_type,) if isinstance(op_type, str) else op_type

    def register(fn: OpFn) -> OpFn:
        fam = family or fn.__module__.rsplit(".", 1)[-1]
        for name in names:
            spec = OpImpl(name, normalize_domain(domain), since, fn, capture, tuple(host_inputs), fam)
            entries = _REGISTRY.setdefault((spec.domain, name), [])
            entries[:] = [e for e in entries if e.since_version != since]
            entries.append(spec)
            entries.sort(key=lambda e: e.since_version)
        return fn

    return register


def lookup(domain: str, op_type: str, opset: int) -> OpImpl | None:
    """The registration with the highest first-opset not above ``opset``."""
    entries = _REGISTRY.get((normalize_domain(domain), op_type))
    if not entries:
        return None
    chosen = None
    for entry in entries:
        if entry.since_version <= opset:
            chosen = entry
    return chosen


def registered_ops() -> dict[tuple[str, str], list[OpImpl]]:
    load_all_ops()
    return dict(_REGISTRY)


_LOADED = False


def load_all_ops() -> None:
    """Import every op module once (each registers itself on import)."""
    global _LOADED
    if _LOADED:
        return
    import importlib
    import pkgutil

    from onnxgen.runtime import ops

    for module in pkgutil.iter_modules(ops.__path__):
        if module.name not in ("registry", "common", "cpu_gemv"):
            importlib.import_module(f"onnxgen.runtime.ops.{module.name}")
    _LOADED = True
