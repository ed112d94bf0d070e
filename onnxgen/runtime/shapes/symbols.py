"""The symbol table: roots, interned derived symbols with derivation edges, unifications, opaque symbols.

A dim is an ``int`` or a ``str`` naming a symbol here. Derived symbols are named by their
canonical polynomial, so equal expressions share one symbol. Every fact the classifier later
needs (what was derived from what, what met what in a broadcast) is recorded here, once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from onnxgen.runtime.shapes.dimexpr import DimExpr

Dim = int | str


@dataclass
class Symbol:
    name: str
    kind: str  # "root" (declared dim_param) | "derived" (polynomial of others) | "opaque" (no formula)
    expr: DimExpr  # roots and opaque symbols: themselves; derived: the polynomial over base symbols
    origin: str = ""  # where it was minted (node name, input name)
    sources: tuple[str, ...] = ()  # derivation sources (derived, or opaque-but-shape-determined)


@dataclass(frozen=True)
class Unification:
    loser: str
    winner: Dim
    where: str


@dataclass
class SymbolTable:
    symbols: dict[str, Symbol] = field(default_factory=dict)
    unifications: list[Unification] = field(default_factory=list)
    _interned: dict[tuple, str] = field(default_factory=dict)
    _opaque_count: int = 0

    # -- creation ------------------------------------------------------------------------
    def root(self, name: str, origin: str = "") -> str:
        if name not in self.symbols:
            self.symbols[name] = Symbol(name, "root", DimExpr.var(name), origin)
        return name

    def opaque(self, origin: str, sources: Iterable[str] = ()) -> str:
        """A fresh symbol with no formula. ``sources``: the symbols it is a function of (empty:
        data-dependent, no provenance)."""
        self._opaque_count += 1
        name = f"?{self._opaque_count}"
        src = tuple(sorted(set(sources)))
        self.symbols[name] = Symbol(name, "opaque", DimExpr.var(name), origin, src)
        return name

    def function(self, label: str, args: tuple[Dim, ...], origin: str = "") -> str:
        """An extent no polynomial expresses but that is a fixed function of ``args`` (``max(a, b)``):
        interned by (label, args), with derivation edges from the args' symbols."""
        key = ("fn", label, args)
        name = self._interned.get(key)
        if name is None:
            name = f"{label}({', '.join(str(a) for a in args)})"
            while name in self.symbols:
                name += "'"
            sources: set[str] = set()
            for a in args:
                if isinstance(a, str):
                    sources |= self.expr(a).symbols()
            self.symbols[name] = Symbol(name, "opaque", DimExpr.var(name), origin, tuple(sorted(sources)))
            self._interned[key] = name
        return name

    def intern(self, expr: DimExpr, origin: str = "") -> Dim:
        """The dim for ``expr``: an int, an existing symbol, or a new derived symbol with edges."""
        value = expr.const_value()
        if value is not None:
            if value < 0:
                return self.opaque(f"{origin}: negative extent {value}")
            return value
        var = expr.as_var()
        if var is not None:
            return var
        key = expr.key()
        name = self._interned.get(key)
        if name is None:
            name = str(expr)
            while name in self.symbols:
                name += "'"
            self.symbols[name] = Symbol(name, "derived", expr, origin, tuple(sorted(expr.symbols())))
            self._interned[key] = name
        return name

    # -- arithmetic over dims ------------------------------------------------------------
    def expr(self, dim: Dim) -> DimExpr:
        if isinstance(dim, int):
            return DimExpr.const(dim)
        sym = self.symbols.get(dim)
        return sym.expr if sym is not None else DimExpr.var(dim)

    def unify(self, a: Dim, b: Dim, where: str) -> Dim:
        """Two extents that must be equal meet (a broadcast chokepoint): record it, return the winner.

        The winner is an int if either is one, else a root, else the first."""
        if a == b:
            return a
        if isinstance(a, int) and isinstance(b, int):
            return a  # a real mismatch; the runtime will fail, nothing to record
        if isinstance(b, int) or (isinstance(a, str) and self.kind(b) == "root" and self.kind(a) != "root"):
            a, b = b, a
        # a is the winner
        self.unifications.append(Unification(str(b), a, where))
        return a

    def kind(self, name: Dim) -> str:
        if isinstance(name, int):
            return "int"
        sym = self.symbols.get(name)
        return sym.kind if sym is not None else "root"

    def describe(self, name: str) -> str:
        sym = self.symbols.get(name)
        if sym is None:
            return name
        if sym.kind == "opaque":
            return f"{name} (opaque, {sym.origin})"
        return name
