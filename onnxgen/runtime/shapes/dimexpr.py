"""DimExpr: an integer polynomial over named symbols, the arithmetic of symbolic extents.

Polynomials (not arbitrary expressions) because every extent arithmetic an exporter writes
(past + seq, 8 * kv, heads * head_dim * seq) is one, and polynomials have a canonical form:
two equal extents always print, hash and compare the same, which is what interning needs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

Monomial = tuple[tuple[str, int], ...]  # sorted (symbol, power) pairs; () is the constant term


def _mono_mul(a: Monomial, b: Monomial) -> Monomial:
    if not a:
        return b
    if not b:
        return a
    powers = dict(a)
    for name, power in b:
        powers[name] = powers.get(name, 0) + power
    return tuple(sorted(powers.items()))


def _mono_div(a: Monomial, b: Monomial) -> Monomial | None:
    powers = dict(a)
    for name, power in b:
        left = powers.get(name, 0) - power
        if left < 0:
            return None
        if left:
            powers[name] = left
        else:
            powers.pop(name, None)
    return tuple(sorted(powers.items()))


class DimExpr:
    __slots__ = ("terms", "_hash")

    def __init__(self, terms: Mapping[Monomial, int] | None = None) -> None:
        self.terms: dict[Monomial, int] = {m: c for m, c in (terms or {}).items() if c}
        self._hash: int | None = None

    # -- construction --------------------------------------------------------------------
    @staticmethod
    def const(value: int) -> DimExpr:
        return DimExpr({(): int(value)})

    @staticmethod
    def var(name: str) -> DimExpr:
        return DimExpr({((name, 1),): 1})

    # -- queries -------------------------------------------------------------------------
    def is_const(self) -> bool:
        return all(not m for m in self.terms)

    def const_value(self) -> int | None:
        if not self.is_const():
            return None
        return self.terms.get((), 0)

    def as_var(self) -> str | None:
        """The symbol name when the expression is exactly one symbol."""
        if len(self.terms) == 1:
            ((mono, coeff),) = self.terms.items()
            if coeff == 1 and len(mono) == 1 and mono[0][1] == 1:
                return mono[0][0]
        return None

    def symbols(self) -> set[str]:
        return {name for mono in self.terms for name, _ in mono}

    def evaluate(self, values: Mapping[str, int]) -> int | None:
        total = 0
        for mono, coeff in self.terms.items():
            term = coeff
            for name, power in mono:
                if name not in values:
                    return None
                term *= values[name] ** power
            total += term
        return total

    # -- arithmetic ----------------------------------------------------------------------
    def __add__(self, other: DimExpr | int) -> DimExpr:
        other = _lift(other)
        terms = dict(self.terms)
        for m, c in other.terms.items():
            terms[m] = terms.get(m, 0) + c
        return DimExpr(terms)

    __radd__ = __add__

    def __neg__(self) -> DimExpr:
        return DimExpr({m: -c for m, c in self.terms.items()})

    def __sub__(self, other: DimExpr | int) -> DimExpr:
        return self + (-_lift(other))

    def __rsub__(self, other: DimExpr | int) -> DimExpr:
        return _lift(other) - self

    def __mul__(self, other: DimExpr | int) -> DimExpr:
        other = _lift(other)
        terms: dict[Monomial, int] = {}
        for ma, ca in self.terms.items():
            for mb, cb in other.terms.items():
                m = _mono_mul(ma, mb)
                terms[m] = terms.get(m, 0) + ca * cb
        return DimExpr(terms)

    __rmul__ = __mul__

    def exact_div(self, other: DimExpr | int) -> DimExpr | None:
        """self / other when the division is exact as polynomials, else None.

        Exact for a monomial divisor (every term must divide); for a polynomial divisor, by
        repeated leading-term division (the remainder must vanish)."""
        other = _lift(other)
        if not other.terms:
            return None
        if len(other.terms) == 1:
            ((dm, dc),) = other.terms.items()
            out: dict[Monomial, int] = {}
            for m, c in self.terms.items():
                q = _mono_div(m, dm)
                if q is None or c % dc:
                    return None
                out[q] = c // dc
            return DimExpr(out)
        remainder = DimExpr(self.terms)
        quotient = DimExpr()
        names = sorted(self.symbols() | other.symbols())

        def order(item: tuple[Monomial, int]) -> tuple[int, tuple[int, ...]]:
            # graded lexicographic order on exponent vectors: a true monomial order
            powers = dict(item[0])
            return sum(powers.values()), tuple(powers.get(n, 0) for n in names)

        lead_m, lead_c = max(other.terms.items(), key=order)
        for _ in range(64):  # polynomials here are tiny; the bound only guards against surprises
            if not remainder.terms:
                return quotient
            m, c = max(remainder.terms.items(), key=order)
            q = _mono_div(m, lead_m)
            if q is None or c % lead_c:
                return None
            step = DimExpr({q: c // lead_c})
            quotient = quotient + step
            remainder = remainder - step * other
        return None

    def substitute(self, mapping: Mapping[str, DimExpr]) -> DimExpr:
        out = DimExpr()
        for mono, coeff in self.terms.items():
            term = DimExpr.const(coeff)
            for name, power in mono:
                base = mapping.get(name) or DimExpr.var(name)
                for _ in range(power):
                    term = term * base
            out = out + term
        return out

    # -- identity ------------------------------------------------------------------------
    def key(self) -> tuple[tuple[Monomial, int], ...]:
        return tuple(sorted(self.terms.items()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, int):
            return self.const_value() == other
        return isinstance(other, DimExpr) and self.terms == other.terms

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self.key())
        return self._hash

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        parts = []
        for mono, coeff in sorted(self.terms.items(), key=lambda kv: (-len(kv[0]), kv[0])):
            factors = [name if p == 1 else f"{name}^{p}" for name, p in mono]
            if not factors:
                text = str(abs(coeff))
            elif abs(coeff) == 1:
                text = "*".join(factors)
            else:
                text = "*".join([str(abs(coeff)), *factors])
            sign = "-" if coeff < 0 else "+"
            parts.append((sign, text))
        first_sign, first = parts[0]
        out = ("-" if first_sign == "-" else "") + first
        for sign, text in parts[1:]:
            out += f" {sign} {text}"
        return out

    __repr__ = __str__


def _lift(value: DimExpr | int) -> DimExpr:
    return value if isinstance(value, DimExpr) else DimExpr.const(value)


def product(values: Iterable[DimExpr | int]) -> DimExpr:
    out = DimExpr.const(1)
    for v in values:
        out = out * v
    return out
