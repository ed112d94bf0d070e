"""A small progress line on stderr: percent, amount done, rate.

On a terminal the line redraws in place (at most ten times a second). When stderr is not a
terminal (CI logs, pipes) nothing is drawn while running and one final line is written, so logs
stay short. `enabled=False` silences it entirely.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_REDRAW_S = 0.1


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # unreachable; keeps type checkers calm


def _amount(n: float, unit: str) -> str:
    return format_bytes(n) if unit == "B" else f"{n:.0f}{(' ' + unit) if unit else ''}"


class Progress:
    """Use as a context manager: `with Progress("pull", total) as p: p.update(n)`."""

    def __init__(
        self,
        label: str,
        total: int | None = None,
        unit: str = "B",
        stream: TextIO | None = None,
        enabled: bool = True,
    ) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.done = 0
        self.start = time.monotonic()
        self._last_draw = 0.0
        self._live = enabled and _isatty(self.stream)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)

    def update(self, n: int) -> None:
        self.done += n
        if self._live:
            now = time.monotonic()
            if now - self._last_draw >= _REDRAW_S:
                self._last_draw = now
                self.stream.write("\r" + self.line() + "\x1b[K")
                self.stream.flush()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / elapsed
        parts = [self.label]
        if self.total:
            parts.append(f"{100.0 * self.done / self.total:5.1f}%")
            parts.append(f"{_amount(self.done, self.unit)} / {_amount(self.total, self.unit)}")
        else:
            parts.append(_amount(self.done, self.unit))
        parts.append(f"{_amount(rate, self.unit)}/s")
        return "  ".join(parts)

    def close(self, ok: bool = True) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        end = "done" if ok else "stopped"
        final = f"{self.line()}  {end} in {elapsed:.1f} s"
        prefix = "\r" if self._live else ""
        self.stream.write(prefix + final + ("\x1b[K" if self._live else "") + "\n")
        self.stream.flush()
        self.enabled = False  # close once


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
