"""The growing-symbol classifier: which symbols may change between two decode steps.

Sources (none of them a model-name check): KV slots of recognised stateful attention ops,
declared ``past*`` inputs / ``present*`` outputs of rank 4, and, in fail-safe mode, every
minted symbol without provenance. Closure: unifications in both directions, derivations
from source to derived only. Pinned symbols (fixed for the capture key) are never growing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from onnxgen.runtime.shapes.infer import ShapeResult
from onnxgen.runtime.shapes.symbols import Dim

MODES = ("failsafe", "denylist", "all")  # "all": every unpinned symbol grows (the no-classifier baseline)

# (domain, op) -> (input slots, output slots) holding [B, H_kv, S, D] caches; S is axis 2
KV_SLOTS: dict[tuple[str, str], tuple[tuple[int, ...], tuple[int, ...]]] = {
    ("com.microsoft", "GroupQueryAttention"): ((3, 4), (1, 2)),
    ("com.microsoft", "MultiHeadAttention"): ((6, 7), (1, 2)),
    ("", "Attention"): ((4, 5), (1, 2)),
}


@dataclass(frozen=True)
class Edge:
    parent: str | None  # None: this symbol is a source
    kind: str  # "source" | "unified" | "derived"
    where: str  # the reason (source) or the node that recorded the edge

    def describe(self, symbol: str) -> str:
        if self.kind == "source":
            return f"{symbol}: {self.where}"
        if self.kind == "unified":
            return f"{symbol} = {self.parent} (unified at {self.where})"
        return f"{symbol} derived from {self.parent}"


@dataclass
class Classification:
    mode: str
    growing: set[str]
    pinned: set[str]
    edges: dict[str, Edge] = field(default_factory=dict)

    def first_growing(self, dims: Iterable[Dim]) -> str | None:
        for d in dims:
            if isinstance(d, str) and d in self.growing:
                return d
        return None

    def chain(self, symbol: str) -> list[str]:
        """How ``symbol`` became growing, from its source to itself."""
        steps: list[str] = []
        seen: set[str] = set()
        current: str | None = symbol
        while current is not None and current not in seen:
            seen.add(current)
            edge = self.edges.get(current)
            if edge is None:
                break
            steps.append(edge.describe(current))
            current = edge.parent
        return list(reversed(steps))


def kv_sources(result: ShapeResult) -> dict[str, str]:
    """Symbols on the sequence axis of KV caches: symbol -> why it is a source."""
    found: dict[str, str] = {}

    def take(shape: tuple[Dim, ...] | None, why: str) -> None:
        if shape is not None and len(shape) == 4 and isinstance(shape[2], str):
            found.setdefault(shape[2], why)

    for node in result.nodes:
        slots = KV_SLOTS.get((node.domain, node.op_type))
        if slots is None:
            continue
        for i in slots[0]:
            info = node.input_infos[i] if i < len(node.input_infos) else None
            take(info.shape if info else None, f"KV slot (input {i}) of {node.op_type} {node.name!r}")
        for i in slots[1]:
            info = node.output_infos[i] if i < len(node.output_infos) else None
            take(info.shape if info else None, f"KV slot (output {i}) of {node.op_type} {node.name!r}")
    for name, info in result.graph_inputs.items():
        if name.startswith("past"):
            take(info.shape, f"sequence axis of declared KV input {name!r}")
    for name, dims in result.declared_outputs.items():
        if name.startswith("present"):
            take(dims, f"sequence axis of declared KV output {name!r}")
            info = result.graph_outputs.get(name)
            take(info.shape if info else None, f"sequence axis of KV output {name!r}")
    return found


def classify(result: ShapeResult, mode: str = "failsafe", pinned: Iterable[str] = ()) -> Classification:
    if mode not in MODES:
        raise ValueError(f"classifier mode {mode!r} is not one of {', '.join(MODES)}")
    table = result.table
    pins = set(pinned) | {k for k in result.binding}
    if mode == "all":  # the baseline knows no pinning: every symbolic extent may vary
        pins = set()
    sources: dict[str, str] = {}
    if mode == "all":
        sources = {name: "symbolic extent (no classifier)" for name in table.symbols}
    else:
        sources = kv_sources(result)
        if mode == "failsafe":
            for sym in table.symbols.values():
                if sym.kind == "opaque" and not sym.sources:
                    sources.setdefault(sym.name, f"minted without provenance ({sym.origin})")

    # adjacency: unifications both ways, derivations source -> derived
    adjacency: dict[str, list[tuple[str, str, str]]] = {}
    for u in table.unifications:
        if isinstance(u.winner, int):
            continue
        adjacency.setdefault(u.loser, []).append((u.winner, "unified", u.where))
        adjacency.setdefault(u.winner, []).append((u.loser, "unified", u.where))
    for sym in table.symbols.values():
        for src in sym.sources:
            adjacency.setdefault(src, []).append((sym.name, "derived", sym.origin))

    edges: dict[str, Edge] = {}
    queue: deque[str] = deque()
    for name, why in sources.items():
        if name in pins:
            continue
        edges[name] = Edge(None, "source", why)
        queue.append(name)
    while queue:
        current = queue.popleft()
        for nxt, kind, where in adjacency.get(current, ()):
            if nxt in edges or nxt in pins:
                continue
            edges[nxt] = Edge(current, kind, where)
            queue.append(nxt)
    return Classification(mode, set(edges), pins, edges)
