"""Per-op shape rules, registered by (domain, op type). An op with no rule leaves its outputs
unresolved, and so is never captured."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from onnxgen.runtime.shapes.context import RuleContext
    from onnxgen.runtime.shapes.tensor import TensorInfo

RuleFn = Callable[["RuleContext"], "list[TensorInfo | None] | None"]
RULES: dict[tuple[str, str], RuleFn] = {}


def rule(*op_types: str, domain: str = "") -> Callable[[RuleFn], RuleFn]:
    def register(fn: RuleFn) -> RuleFn:
        for op in op_types:
            RULES[(domain, op)] = fn
        return fn

    return register


_LOADED = False


def load_rules() -> dict[tuple[str, str], RuleFn]:
    global _LOADED
    if not _LOADED:
        from onnxgen.runtime.shapes.rules import (  # noqa: F401  (each module registers on import)
            contrib,
            control,
            elementwise,
            extra_ops,
            fused,
            misc,
            nn,
            shape_ops,
        )

        _LOADED = True
    return RULES
